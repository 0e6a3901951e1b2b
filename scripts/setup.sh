#!/usr/bin/env bash
# Set up everything duplexkit needs on a fresh Debian/Ubuntu machine: system packages, then a virtual
# environment at .venv with duplexkit[all] installed in editable mode (all = every extra, webrtc's aiortc
# included: the WebRTC route and its tests need it).
#
# System packages (Debian names; scripts/lib_apt.sh installs the missing ones, as root or through sudo,
# after saying which):
#   --demo: only what `duplexkit demo` and the next steps it prints need: python3-venv (creates the venv)
#           and libportaudio2 (microphone and speaker for `duplexkit mic`);
#   default: also what the tests and audio devices need: libsndfile1, PulseAudio (headless audio tests),
#           alsa-utils, libasound2-plugins, espeak-ng and sox (speech fixtures). Chromium, for the browser
#           tests only, is installed by scripts/setup_test.sh when scripts/test.sh runs those tests.
#
# torch: one of two builds of torch 2.9.1 + torchaudio 2.9.1, chosen by the machine:
#   no NVIDIA GPU (no nvidia-smi on PATH, no /proc/driver/nvidia): the CPU-only build from PyTorch's
#       index https://download.pytorch.org/whl/cpu (about 0.2 GB to download, 0.8 GB on disk). When that
#       index cannot be reached from here, PyPI's CUDA build instead, with a warning saying so;
#   an NVIDIA GPU: PyPI's build for CUDA 12.8 (about 4.1 GB to download, 6.6 GB on disk; docs/install.md).
# A torch 2.9.1 already in the venv is kept, whichever build it is, unless DUPLEXKIT_TORCH or
# DUPLEXKIT_TORCH_INDEX asks for a particular one.
#
# Idempotent and quick on re-runs: after a successful install it writes a stamp into the venv
# holding a hash of pyproject.toml, this script, the Python version and the torch choice.
# When the stamp matches and duplexkit still imports from this checkout, pip is not run at all
# (about a second). Any change to those inputs, or a broken venv, runs the install steps again.
#
# Environment:
#   DUPLEXKIT_VENV         the venv directory (default .venv)
#   PYTHON                 the interpreter that creates the venv (default python3)
#   DUPLEXKIT_TORCH        auto (default: by the GPU check above), cpu or cuda (PyPI's CUDA 12.8 build)
#   DUPLEXKIT_TORCH_INDEX  a PyTorch wheel index for torch/torchaudio (overrides DUPLEXKIT_TORCH), e.g.
#                          https://download.pytorch.org/whl/cu126 for an older driver; the build must
#                          come from it (its last path part is the label: cpu, cu126, ...)
#   DUPLEXKIT_TORCH_CPU_INDEX  where the automatic CPU choice looks (default
#                          https://download.pytorch.org/whl/cpu; a mirror of it)
#   DUPLEXKIT_SKIP_APT=1   do not check or install system packages (no apt, no sudo)
#   DUPLEXKIT_FORCE=1      ignore the stamp and run every install step
#   pip's own variables apply to every pip step: HTTPS_PROXY, PIP_INDEX_URL (a mirror),
#   PIP_NO_INDEX=1 + PIP_FIND_LINKS=DIR (offline, from downloaded wheels).
# Options:
#   --demo                 system packages for the demo only (scripts/demo.sh passes it)
#   --dry-run              print what would be installed (system packages, torch build, pip steps with
#                          their download sizes) and exit; installs nothing, downloads nothing
#   --print-stamp          print the stamp this checkout would write, and exit
# Exit status: 0 done; 3 a pip step could not download from its package index (unreachable, or
# the package is not there: one "[setup] error:" line names the fix); 1 any other failure.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib_apt.sh

VENV=${DUPLEXKIT_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=2.9.1
STAMP_FILE="$VENV/.duplexkit-setup-stamp"

MODE=install
APT_SET=dev
for arg in "$@"; do
  case $arg in
    --print-stamp) MODE=stamp ;;
    --dry-run) MODE=dry-run ;;
    --demo) APT_SET=demo ;;
    *) echo "[setup] error: unknown option $arg (options: --demo, --dry-run, --print-stamp)" >&2; exit 1 ;;
  esac
done

# --- the torch build ------------------------------------------------------------------------------
# TORCH_BUILD: cpu (PyTorch's CPU-only index), cuda (PyPI's CUDA 12.8 build) or index (DUPLEXKIT_TORCH_INDEX).
# TORCH_WANT: which installed build counts as right: any (the automatic choice keeps what is there),
# cpu, cuda, or the index's label.
CPU_INDEX=${DUPLEXKIT_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
NVIDIA_PROC=${DUPLEXKIT_NVIDIA_PROC:-/proc/driver/nvidia}  # the driver's /proc entry (a test points it elsewhere)
has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 || [[ -e $NVIDIA_PROC ]]; }
OVERRIDE="override: DUPLEXKIT_TORCH=cuda (PyPI's CUDA 12.8 build), DUPLEXKIT_TORCH=cpu, or DUPLEXKIT_TORCH_INDEX=URL"
TORCH_INDEX=""
if [[ -n ${DUPLEXKIT_TORCH_INDEX:-} ]]; then
  TORCH_BUILD=index TORCH_INDEX=$DUPLEXKIT_TORCH_INDEX
  TORCH_WANT=$(basename "${TORCH_INDEX%/}")
  TORCH_WHY="DUPLEXKIT_TORCH_INDEX is set"
else
  case ${DUPLEXKIT_TORCH:-auto} in
    cpu) TORCH_BUILD=cpu TORCH_WANT=cpu TORCH_WHY="DUPLEXKIT_TORCH=cpu" ;;
    cuda) TORCH_BUILD=cuda TORCH_WANT=cuda TORCH_WHY="DUPLEXKIT_TORCH=cuda" ;;
    auto)
      TORCH_WANT=any
      if has_nvidia_gpu; then
        TORCH_BUILD=cuda TORCH_WHY="an NVIDIA GPU driver is present (nvidia-smi or $NVIDIA_PROC)"
      else
        TORCH_BUILD=cpu TORCH_WHY="no NVIDIA GPU found (no nvidia-smi on PATH, no $NVIDIA_PROC)"
      fi ;;
    *) echo "[setup] error: DUPLEXKIT_TORCH must be auto, cpu or cuda, not '${DUPLEXKIT_TORCH}'" >&2; exit 1 ;;
  esac
  if [[ $TORCH_BUILD == cpu ]]; then TORCH_INDEX=$CPU_INDEX; fi
fi
torch_plan() {
  case $TORCH_BUILD in
    cpu) echo "the CPU-only build from $TORCH_INDEX (about 0.2 GB to download, 0.8 GB on disk)" ;;
    cuda) echo "PyPI's CUDA 12.8 build (about 4.1 GB to download: torch 0.9 GB, 16 nvidia-* CUDA libraries" \
      "2.9 GB, triton 0.2 GB; 6.6 GB on disk)" ;;
    index) echo "the build on $TORCH_INDEX (label $TORCH_WANT)" ;;
  esac
}

# The stamp: what the venv's contents depend on. The venv's Python version is part of it so a
# venv rebuilt with another interpreter reinstalls.
setup_stamp() {
  local pyver="none"
  if [[ -x "$VENV/bin/python" ]]; then
    pyver=$("$VENV/bin/python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
  fi
  { cat pyproject.toml scripts/setup.sh; echo "python=$pyver"; echo "torch=$TORCH_BUILD $TORCH_WANT $TORCH_INDEX"; } \
    | sha256sum | cut -d' ' -f1
}

if [[ $MODE == stamp ]]; then
  setup_stamp
  exit 0
fi

# --- system packages: one per line, so additions merge cleanly --------------------------------------
APT_DEMO=(
  python3-venv
  libportaudio2
)
APT_DEV=(
  "${APT_DEMO[@]}"
  libsndfile1
  pulseaudio
  pulseaudio-utils
  alsa-utils
  libasound2-plugins
  espeak-ng
  sox
  graphviz
)
if [[ $APT_SET == demo ]]; then
  APT_PACKAGES=("${APT_DEMO[@]}")
  APT_WHAT="the demo"
else
  APT_PACKAGES=("${APT_DEV[@]}")
  APT_WHAT="duplexkit and its audio tests"
fi

# True when duplexkit and the server import from THIS checkout and the engine's packages are
# present (found, not imported: importing torch alone takes seconds).
venv_ok() {
  "$VENV/bin/python" - "$PWD" <<'PY' 2>/dev/null
import importlib.util, os, sys
import duplexkit, duplexkit_server
root = os.path.realpath(sys.argv[1])
assert os.path.realpath(duplexkit.__file__).startswith(root + os.sep), duplexkit.__file__
for mod in ("torch", "torchaudio", "stepaudio2", "transformers", "fastapi", "prometheus_client", "sounddevice", "pytest",
            "kubernetes_validate", "ray", "aiortc"):
    assert importlib.util.find_spec(mod) is not None, mod
PY
}
up_to_date() {
  [[ ${DUPLEXKIT_FORCE:-0} != 1 && -x "$VENV/bin/python" && -f "$STAMP_FILE" ]] \
    && [[ $(cat "$STAMP_FILE") == "$(setup_stamp)" ]] && venv_ok
}

PIP_STEPS=(
  "1/3 pip itself (about 2 MB)"
  "2/3 torch $TORCH_VERSION + torchaudio $TORCH_VERSION: $(torch_plan)"
  "3/3 duplexkit[all], editable, and its dependencies (transformers, fastapi, ray, aiortc, onnxruntime, playwright, ...): about 0.5 GB to download, 1.9 GB on disk"
)

if [[ $MODE == dry-run ]]; then
  echo "[setup] dry run: nothing is installed or downloaded"
  APT_DRY_RUN=1 apt_ensure "$APT_WHAT" "${APT_PACKAGES[@]}"
  echo "[setup] torch: $TORCH_WHY -> $(torch_plan)"
  if [[ $TORCH_BUILD == cpu && $TORCH_WANT == any ]]; then
    echo "[setup]   (if $CPU_INDEX cannot be reached from here: PyPI's CUDA 12.8 build, with a warning)"
  fi
  echo "[setup]   $OVERRIDE"
  if up_to_date; then
    echo "[setup] $VENV is up to date: pip would not run"
  else
    echo "[setup] pip steps into $VENV (a torch $TORCH_VERSION already there is kept when it fits the choice):"
    for step in "${PIP_STEPS[@]}"; do echo "[setup]   $step"; done
  fi
  exit 0
fi

apt_ensure "$APT_WHAT" "${APT_PACKAGES[@]}" || exit 1

if up_to_date; then
  echo "[setup] $VENV is up to date (nothing changed since the last install; DUPLEXKIT_FORCE=1 reinstalls)"
  exit 0
fi

echo "[setup] torch: $TORCH_WHY -> $(torch_plan)"
echo "[setup]   $OVERRIDE"
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
rm -f "$STAMP_FILE"

# Every pip install goes through pip_install: pip's messages stay on screen (its stdout is left alone,
# so on a terminal pip draws its progress bars; elsewhere they are off and each download is one
# "Downloading ... (size)" line), and when pip fails one "[setup] error:" line says why and what to do.
# A failure whose messages show a connection error, or no matching distribution on the index, is an
# index problem (exit 3); anything else exits 1.
PIP_LOG=$(mktemp)
trap 'rm -f "$PIP_LOG"' EXIT
PIP_PROGRESS=()
if [[ ! -t 1 ]]; then PIP_PROGRESS=(--progress-bar off); fi
pip_install() {
  local index_name=$1 rc=0
  shift
  # pip writes its warnings and errors to stderr: copied into PIP_LOG for the checks below
  { "$VENV/bin/python" -m pip install "${PIP_PROGRESS[@]}" "$@" 2>&1 1>&3 3>&- | tee "$PIP_LOG" >&2 3>&-; } 3>&1 \
    || rc=$?
  ((rc == 0)) && return 0
  if grep -qiE 'NewConnectionError|Failed to establish a new connection|Max retries exceeded|ProxyError|Tunnel connection failed|Name or service not known|Temporary failure in name resolution|Network is unreachable|Connection refused|Read timed out|ConnectTimeout|SSLError|CERTIFICATE_VERIFY_FAILED|No matching distribution found|from versions: none' "$PIP_LOG"; then
    echo "[setup] error: pip could not download from $index_name (unreachable from this machine, or the package is not on it):" \
      "behind a proxy, export HTTPS_PROXY=http://HOST:PORT; with a mirror, PIP_INDEX_URL=URL (torch: DUPLEXKIT_TORCH_INDEX=URL);" \
      "offline, PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR with the wheels downloaded elsewhere (pip download); then re-run bash scripts/setup.sh" >&2
    exit 3
  fi
  echo "[setup] error: pip install $* failed (exit $rc; pip's message is above); fix that and re-run bash scripts/setup.sh" >&2
  exit 1
}
PYPI_NAME="the package index (${PIP_INDEX_URL:-PyPI})"

echo "[setup] ${PIP_STEPS[0]}"
pip_install "$PYPI_NAME" -q --upgrade pip

# torch and torchaudio must be a matching pair (docs/model.md §7.6); install them first so the
# resolver never pulls a mismatched torchaudio. torch_ok: both are TORCH_VERSION, of the same build,
# and of the wanted one (any, cpu, cuda, or an index's label).
torch_ok() {
  "$VENV/bin/python" - "$TORCH_VERSION" "$TORCH_WANT" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
want, build = sys.argv[1], sys.argv[2]
labels = set()
for dist in ("torch", "torchaudio"):
    base, _, local = version(dist).partition("+")
    assert base == want, (dist, base)
    labels.add(local)
# PyPI's wheels carry no label in their metadata; an index's wheels do (2.9.1+cpu, 2.9.1+cu126).
assert len(labels) == 1, labels  # a CPU torch next to a CUDA torchaudio does not import
(label,) = labels
if build == "cuda":
    assert label == "" or label.startswith("cu"), label
elif build != "any":
    assert label == build, (label, build)
PY
}
# Prints nothing and succeeds when the index answers for torch within 15 s; else prints why and fails.
# Uses the venv's Python with the variables pip would use (HTTPS_PROXY, PIP_CERT).
index_reachable() {
  "$VENV/bin/python" - "$1" <<'PY'
import os, ssl, sys, urllib.request
url = sys.argv[1].rstrip("/") + "/torch/"
ctx = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
try:
    with urllib.request.urlopen(url, timeout=15, context=ctx) as r:
        r.read(1)
except Exception as exc:
    print(f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}")
    sys.exit(1)
PY
}

echo "[setup] ${PIP_STEPS[1]}"
if torch_ok; then
  echo "[setup]   torch $TORCH_VERSION and torchaudio $TORCH_VERSION are already in $VENV: kept"
else
  if [[ $TORCH_BUILD == cpu && $TORCH_WANT == any && -z ${PIP_NO_INDEX:-} ]] \
     && ! why=$(index_reachable "$TORCH_INDEX"); then
    echo "[setup] warning: the CPU-only torch index $TORCH_INDEX cannot be reached from this machine ($why):" \
      "installing PyPI's torch $TORCH_VERSION instead, the CUDA 12.8 build (about 4.1 GB to download, 6.6 GB on" \
      "disk; it runs on the CPU too). For the light build, make download.pytorch.org reachable (HTTPS_PROXY=...)" \
      "or point DUPLEXKIT_TORCH_CPU_INDEX at a mirror of it, then run this again into a fresh venv" \
      "(DUPLEXKIT_VENV=DIR, or delete $VENV)" >&2
    TORCH_FELL_BACK=1
    TORCH_INDEX=""
  fi
  if [[ -n $TORCH_INDEX ]]; then
    echo "[setup]   from $TORCH_INDEX"
    pip_install "the torch index $TORCH_INDEX" --force-reinstall --no-deps \
      --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" "torchaudio==$TORCH_VERSION"
  else
    echo "[setup]   from ${PIP_INDEX_URL:-PyPI}"
    pip_install "$PYPI_NAME" --force-reinstall --no-deps "torch==$TORCH_VERSION" "torchaudio==$TORCH_VERSION"
  fi
  # torch's own dependencies (filelock, sympy, ... and for the CUDA build the nvidia-* libraries) from
  # the regular index; the torch just installed satisfies torch==2.9.1.
  pip_install "$PYPI_NAME" "torch==$TORCH_VERSION" "torchaudio==$TORCH_VERSION"
fi
echo "[setup] ${PIP_STEPS[2]}"
pip_install "$PYPI_NAME" -e ".[all]"
if ! venv_ok; then
  echo "[setup] error: duplexkit[all] was installed but does not import from $PWD" >&2
  exit 1
fi
if grep -q "BuildBackendWarning: Editable installation" "$PIP_LOG" 2>/dev/null; then
  echo "[setup] (the 'Editable installation' notice above is setuptools' standard note for an editable install; nothing is wrong)"
fi
if [[ ${TORCH_FELL_BACK:-0} == 1 ]]; then
  TORCH_INDEX=$CPU_INDEX  # the stamp holds what was asked for, so a rerun finds it current
fi
setup_stamp >"$STAMP_FILE"
echo "[setup] done: $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1) on disk)"
if [[ ${TORCH_FELL_BACK:-0} == 1 ]]; then
  echo "[setup] note: this venv holds the CUDA build of torch (the CPU-only index could not be reached; see the warning above)" >&2
fi
