#!/usr/bin/env bash
# Set up and run the demo: the embedded tiny (random-weight) MiniCPM-o 4.5 on a bundled speech WAV.
# Extra arguments go to `duplexkit demo` (see `duplexkit demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
exec "${DUPLEXKIT_VENV:-.venv}/bin/duplexkit" demo "$@"
