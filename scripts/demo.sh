#!/usr/bin/env bash
# Set up and run the demo: the embedded tiny (random-weight) MiniCPM-o 4.5 on a bundled speech WAV.
#
#   bash scripts/demo.sh [--dry-run] [ARGS...]
#
# Installs only what the demo needs (scripts/setup.sh --demo): the Debian packages python3-venv and
# libportaudio2 when missing (as root, or through sudo; it says which before installing, and what to do
# when neither works), then .venv with duplexkit[all] and the torch build that fits the machine (the
# CPU-only one without an NVIDIA GPU). Test-only packages (PulseAudio, espeak-ng, Chromium, ...) are
# left to scripts/test.sh. Each step says what it downloads and about how much before it starts.
# --dry-run prints that plan and the demo command, and exits without installing or running anything.
# Other arguments go to `duplexkit demo` (see `duplexkit demo --help`). The environment variables of
# scripts/setup.sh apply (DUPLEXKIT_VENV, DUPLEXKIT_TORCH, DUPLEXKIT_SKIP_APT=1, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DUPLEXKIT_VENV:-.venv}
if [[ ${1:-} == "--dry-run" ]]; then
  shift
  bash scripts/setup.sh --demo --dry-run
  echo "[demo] then: TORCHDYNAMO_DISABLE=1 $VENV/bin/duplexkit demo${*:+ $*}"
  exit 0
fi
bash scripts/setup.sh --demo
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
exec "$VENV/bin/duplexkit" demo "$@"
