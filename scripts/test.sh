#!/usr/bin/env bash
# Set up and run the whole test suite (unit, model parity, engine, end-to-end, device, conformance).
# Extra arguments go to pytest. pytest's exit code 5 ("no tests collected") is an error here.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
export PYTHONUNBUFFERED=1
"${DUPLEXKIT_VENV:-.venv}/bin/python" -m pytest -ra -q "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "[test] pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit $rc
