#!/usr/bin/env bash
# Set up everything duplexkit needs on a fresh Debian/Ubuntu machine: system packages
# (PortAudio, PulseAudio for headless audio tests, espeak-ng/sox for speech fixtures, libsndfile)
# and a virtual environment at .venv with duplexkit[all] installed in editable mode (all = every extra,
# webrtc's aiortc included: the WebRTC route and its tests need it).
#
# Idempotent and quick on re-runs: after a successful install it writes a stamp into the venv
# holding a hash of pyproject.toml, this script, the Python version and DUPLEXKIT_TORCH_INDEX.
# When the stamp matches and duplexkit still imports from this checkout, pip is not run at all
# (about a second). Any change to those inputs, or a broken venv, runs the install steps again.
#
# Environment:
#   DUPLEXKIT_VENV         the venv directory (default .venv)
#   PYTHON                 the interpreter that creates the venv (default python3)
#   DUPLEXKIT_TORCH_INDEX  a PyTorch wheel index for torch/torchaudio, e.g.
#                          https://download.pytorch.org/whl/cpu for the CPU-only build (~1 GB
#                          instead of ~6 GB with the CUDA 12.8 libraries; see docs/install.md).
#                          Unset: torch 2.9.1 from PyPI (CUDA 12.8 build; it also runs on a CPU).
#   DUPLEXKIT_SKIP_APT=1   do not check or install system packages (no apt, no sudo)
#   DUPLEXKIT_FORCE=1      ignore the stamp and run every install step
#   pip's own variables apply to every pip step: HTTPS_PROXY, PIP_INDEX_URL (a mirror),
#   PIP_NO_INDEX=1 + PIP_FIND_LINKS=DIR (offline, from downloaded wheels).
# Options:
#   --print-stamp          print the stamp this checkout would write, and exit
# Exit status: 0 done; 3 a pip step could not download from its package index (unreachable, or
# the package is not there: one "[setup] error:" line names the fix); 1 any other failure.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${DUPLEXKIT_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=2.9.1
TORCH_INDEX=${DUPLEXKIT_TORCH_INDEX:-}
STAMP_FILE="$VENV/.duplexkit-setup-stamp"

# The stamp: what the venv's contents depend on. The venv's Python version is part of it so a
# venv rebuilt with another interpreter reinstalls.
setup_stamp() {
  local pyver="none"
  if [[ -x "$VENV/bin/python" ]]; then
    pyver=$("$VENV/bin/python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
  fi
  { cat pyproject.toml scripts/setup.sh; echo "python=$pyver"; echo "torch_index=$TORCH_INDEX"; } \
    | sha256sum | cut -d' ' -f1
}

if [[ ${1:-} == "--print-stamp" ]]; then
  setup_stamp
  exit 0
fi

# System packages: one per line, so additions merge cleanly.
APT_PACKAGES=(
  libportaudio2
  libsndfile1
  pulseaudio
  pulseaudio-utils
  alsa-utils
  libasound2-plugins
  espeak-ng
  sox
  python3-venv
  chromium
  graphviz
)
if [[ ${DUPLEXKIT_SKIP_APT:-0} != 1 ]]; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if ((${#missing[@]})); then
    SUDO=""
    if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
    echo "[setup] apt-get install ${missing[*]}"
    if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
           $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
      echo "[setup] error: apt-get could not install ${missing[*]} (its message is above: no network, no sudo, or" \
        "another distribution?): install them another way and re-run with DUPLEXKIT_SKIP_APT=1" >&2
      exit 1
    fi
  fi
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

if [[ ${DUPLEXKIT_FORCE:-0} != 1 && -x "$VENV/bin/python" && -f "$STAMP_FILE" ]] \
   && [[ $(cat "$STAMP_FILE") == "$(setup_stamp)" ]] && venv_ok; then
  echo "[setup] $VENV is up to date (nothing changed since the last install; DUPLEXKIT_FORCE=1 reinstalls)"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
rm -f "$STAMP_FILE"

# Every pip install goes through pip_install: pip's messages stay on screen, and when pip fails one
# "[setup] error:" line says why and what to do. A failure whose messages show a connection error,
# or no matching distribution on the index, is an index problem (exit 3); anything else exits 1.
PIP_LOG=$(mktemp)
trap 'rm -f "$PIP_LOG"' EXIT
pip_install() {
  local index_name=$1 rc=0
  shift
  "$VENV/bin/python" -m pip install "$@" 2>&1 | tee "$PIP_LOG" || rc=$?
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

pip_install "$PYPI_NAME" -q --upgrade pip

# torch and torchaudio must be a matching pair (docs/model.md §7.6); install them first so the
# resolver never pulls a mismatched torchaudio. With DUPLEXKIT_TORCH_INDEX the build must come
# from that index (its last path part is the local version label: cpu, cu128, ...).
torch_ok() {
  "$VENV/bin/python" - "$TORCH_VERSION" "$TORCH_INDEX" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
want, index = sys.argv[1], sys.argv[2]
label = index.rstrip("/").rsplit("/", 1)[-1] if index else ""
for dist in ("torch", "torchaudio"):
    v = version(dist)
    base, _, local = v.partition("+")
    assert base == want, (dist, v)
    # PyPI's wheels carry no label in their metadata; an index's wheels do (2.9.1+cpu).
    assert not label or local == label, (dist, v, label)
PY
}
if ! torch_ok; then
  if [[ -n $TORCH_INDEX ]]; then
    echo "[setup] installing torch $TORCH_VERSION + torchaudio $TORCH_VERSION from $TORCH_INDEX"
    pip_install "the torch index DUPLEXKIT_TORCH_INDEX ($TORCH_INDEX)" -q --force-reinstall --no-deps \
      --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" "torchaudio==$TORCH_VERSION"
    # torch's own small dependencies (filelock, sympy, ...) from the regular index.
    pip_install "$PYPI_NAME" -q "torch==$TORCH_VERSION" "torchaudio==$TORCH_VERSION"
  else
    echo "[setup] installing torch $TORCH_VERSION + torchaudio $TORCH_VERSION (large download, once)"
    pip_install "$PYPI_NAME" -q "torch==$TORCH_VERSION" "torchaudio==$TORCH_VERSION"
  fi
fi
echo "[setup] installing duplexkit[all]"
pip_install "$PYPI_NAME" -q -e ".[all]"
if ! venv_ok; then
  echo "[setup] error: duplexkit[all] was installed but does not import from $PWD" >&2
  exit 1
fi
if grep -q "BuildBackendWarning: Editable installation" "$PIP_LOG" 2>/dev/null; then
  echo "[setup] (the 'Editable installation' notice above is setuptools' standard note for an editable install; nothing is wrong)"
fi
setup_stamp >"$STAMP_FILE"
echo "[setup] done: $VENV"
