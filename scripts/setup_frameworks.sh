#!/usr/bin/env bash
# Create the separate virtual environment of the voice-agent frameworks whose OpenAI Realtime services
# are tested against `duplexkit serve` (tests/e2e/test_framework_tools.py, docs/tools.md "Pipecat and
# LiveKit"): Pipecat's OpenAIRealtimeLLMService and LiveKit Agents' openai.realtime.RealtimeModel.
# They pin their own openai, websockets, numpy and aiohttp ranges, which duplexkit's venv does not share.
#
# Installs pipecat-ai[openai] 1.14.0, livekit-agents 1.8.9 and livekit-plugins-openai 1.8.9 (one
# resolve, so the two frameworks agree on openai / pydantic / aiohttp) plus jsonschema for the checks.
# Measured on the 2-core CI machine with a warm pip cache: ~35 s, ~760 MB on disk.
#
# Idempotent: a stamp (hash of this script and the Python version) skips pip on re-runs.
#
# Environment:
#   DUPLEXKIT_FRAMEWORKS_VENV   the venv directory (default .venv-frameworks)
#   PYTHON                      the interpreter that creates it (default python3; 3.10-3.13)
#   DUPLEXKIT_FORCE=1           reinstall
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${DUPLEXKIT_FRAMEWORKS_VENV:-.venv-frameworks}
PY=${PYTHON:-python3}
PACKAGES=("pipecat-ai[openai]==1.14.0" "livekit-agents==1.8.9" "livekit-plugins-openai==1.8.9" "jsonschema>=4")
STAMP_FILE="$VENV/.duplexkit-frameworks-stamp"

stamp() {
  { cat scripts/setup_frameworks.sh pyproject.toml; "$PY" -c 'import sys; print(sys.version_info[:3])'; } | sha256sum | cut -d' ' -f1
}
# duplexkit itself, editable from this checkout (the integrations' tests import it here: duplexkit.integrations)
duplexkit_ok() {
  "$VENV/bin/python" -c 'import os, duplexkit.testing, duplexkit.clients
assert os.path.samefile(os.path.dirname(duplexkit.__file__), "duplexkit")' >/dev/null 2>&1
}
frameworks_ok() {
  "$VENV/bin/python" -c 'import jsonschema
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from livekit.plugins.openai.realtime import RealtimeModel
from livekit.agents import function_tool' >/dev/null 2>&1
}

if [[ ${DUPLEXKIT_FORCE:-0} != 1 && -f "$STAMP_FILE" && $(cat "$STAMP_FILE") == "$(stamp)" ]] && frameworks_ok && duplexkit_ok; then
  echo "[setup-frameworks] $VENV is up to date"
  exit 0
fi
t0=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup-frameworks] creating $VENV"
  "$PY" -m venv "$VENV"
fi
rm -f "$STAMP_FILE"
echo "[setup-frameworks] installing ${PACKAGES[*]}"
"$VENV/bin/python" -m pip install -q "${PACKAGES[@]}"
# + duplexkit, editable, with its light dependencies only (numpy, soxr, webrtcvad-wheels, ...; no torch:
# the scripted engine and the clients import without it)
"$VENV/bin/python" -m pip install -q -e .
if ! duplexkit_ok; then
  echo "[setup-frameworks] error: duplexkit (this checkout) does not import in $VENV" >&2
  exit 1
fi
if ! frameworks_ok; then
  echo "[setup-frameworks] error: pipecat / livekit do not import in $VENV" >&2
  "$VENV/bin/python" -c 'from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from livekit.plugins.openai.realtime import RealtimeModel' 2>&1 | tail -3 >&2
  exit 1
fi
stamp >"$STAMP_FILE"
echo "[setup-frameworks] done: $VENV in $((SECONDS - t0)) s, $(du -sh "$VENV" | cut -f1) on disk"
