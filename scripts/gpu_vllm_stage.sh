#!/usr/bin/env bash
# vLLM thinker vs native fast thinker on the lent GPU machine (benchmarks/results/2026-12-02-vllm-units-h200.md).
#
# The machine has no network: vLLM 0.26.0 (the CUDA 13 wheel that pins torch 2.11, the image's) and
# the packages it needs that the image lacks travel in two carried folders, each under the 64 MiB a
# call may carry next to the working tree (prepared here as benchmarks/results/2026-12-02-vllm-units-h200.md describes):
#   .vllmgpu_a/  vllm026.tar.xz.part00             first 58 MiB of the trimmed vLLM tree (tar.xz)
#   .vllmgpu_b/  vllm026.tar.xz.part01, .sha256    the rest, and the checksum of the whole archive
#                wheels/*.whl                      ~80 small wheels (fastapi, pydantic, msgspec, ...)
# Files under /tmp stay on the machine while it is warm (30 s after a call), so two calls in a row:
#
#   call 1: bash scripts/gpu_vllm_stage.sh a      (carry .vllmgpu_a) keeps part00 in /tmp/vllmgpu,
#           then runs the native half of the comparison (results kept in /tmp/vllmgpu/native.json)
#   call 2: bash scripts/gpu_vllm_stage.sh b      (carry .vllmgpu_b) joins and unpacks vLLM,
#           installs the wheels, runs the vLLM half and prints the table (native too when call 1's
#           results are missing)
#
# Extra arguments go to benchmarks/vllm_units.py (e.g. --vllm-eager, --units 6).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?usage: gpu_vllm_stage.sh a|b [benchmark args]}
shift
W=/tmp/vllmgpu
OUTDIR=${OUT:-$W/out}
mkdir -p "$W" "$OUTDIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
say() { echo "[stage $STAGE +$(( $(date +%s) - T0 ))s] $*"; }

case "$STAGE" in
a)
  cp .vllmgpu_a/vllm026.tar.xz.part00 "$W/" || { say "no .vllmgpu_a/vllm026.tar.xz.part00 (carry .vllmgpu_a)"; exit 2; }
  say "part00 kept in $W ($(du -m "$W/vllm026.tar.xz.part00" | cut -f1) MiB)"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  python3 benchmarks/vllm_units.py --device cuda --backends native --json "$W/native.json" "$@" 2>&1 \
    | tee "$OUTDIR/native.log"
  rc=${PIPESTATUS[0]}
  cp -f "$W/native.json" "$OUTDIR/" 2>/dev/null
  say "native half done (rc $rc); now call 2 at once: bash scripts/gpu_vllm_stage.sh b (carry .vllmgpu_b)"
  exit "$rc"
  ;;
b)
  [[ -f $W/vllm026.tar.xz.part00 ]] || { say "no $W/vllm026.tar.xz.part00: the machine went back after call 1; run call 1 again, then call 2 at once"; exit 3; }
  if [[ ! -f $W/vllm/vllm/__init__.py ]]; then
    cat "$W/vllm026.tar.xz.part00" .vllmgpu_b/vllm026.tar.xz.part01 >"$W/vllm026.tar.xz" || exit 4
    (cd "$W" && sha256sum -c "$OLDPWD/.vllmgpu_b/vllm026.tar.xz.sha256") || { say "vLLM archive checksum wrong"; exit 5; }
    mkdir -p "$W/vllm" && tar -xJf "$W/vllm026.tar.xz" -C "$W/vllm" || exit 6
    rm -f "$W/vllm026.tar.xz"
    say "vLLM tree unpacked ($(du -sm "$W/vllm" | cut -f1) MiB)"
  fi
  if [[ ! -f $W/site/.done ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" \
      .vllmgpu_b/wheels/*.whl || exit 7
    touch "$W/site/.done"
    say "wheels installed"
  fi
  export PYTHONPATH=$W/vllm:$W/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  python3 -c 'import vllm, vllm.platforms as p; print("vllm", vllm.__version__, "platform", type(p.current_platform).__name__)' || exit 8
  backends=vllm
  [[ -f $W/native.json ]] || backends=native,vllm
  python3 benchmarks/vllm_units.py --device cuda --backends "$backends" --merge "$W/native.json" \
    --json "$OUTDIR/vllm_units.json" "$@" 2>&1 | tee "$OUTDIR/vllm.log"
  rc=${PIPESTATUS[0]}
  say "done (rc $rc)"
  exit "$rc"
  ;;
*)
  echo "usage: gpu_vllm_stage.sh a|b [benchmark args]" >&2
  exit 2
  ;;
esac
