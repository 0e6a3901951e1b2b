#!/usr/bin/env bash
# Set up everything duplexkit needs on a fresh Debian/Ubuntu machine: system packages
# (PortAudio, PulseAudio for headless audio tests, espeak-ng/sox for speech fixtures, libsndfile)
# and a virtual environment at .venv with duplexkit[all] installed in editable mode.
#
# Idempotent: re-running it only installs what is missing. Honours DUPLEXKIT_VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(libportaudio2 libsndfile1 pulseaudio pulseaudio-utils alsa-utils libasound2-plugins espeak-ng sox python3-venv)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  echo "[setup] apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

VENV=${DUPLEXKIT_VENV:-.venv}
PY=${PYTHON:-python3}
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch and torchaudio must be a matching pair (docs/model.md §7.6); install them first so the
# resolver never pulls a mismatched torchaudio.
if ! "$VENV/bin/python" -c "import torch, torchaudio; assert torch.__version__.startswith('2.9.1')" 2>/dev/null; then
  echo "[setup] installing torch 2.9.1 + torchaudio 2.9.1 (large download, once)"
  "$VENV/bin/python" -m pip install -q torch==2.9.1 torchaudio==2.9.1
fi
echo "[setup] installing duplexkit[all]"
"$VENV/bin/python" -m pip install -q -e ".[all]"
echo "[setup] done: $VENV"
