#!/usr/bin/env bash
# Build the two carry folders of scripts/gpu_vllm_stage.sh (vLLM 0.26.0 for the lent GPU machine,
# which has no network) in the repo root: .vllmgpu_a/ and .vllmgpu_b/ (both git-ignored through
# .git/info/exclude). Runs here (any x86_64 Linux with pip and network); ~5 min (xz -9 of ~270 MB).
#
# Why 0.26.0: the newest vLLM whose CUDA wheel pins torch==2.11.0 (the image's torch 2.11.0+cu130;
# 0.27+ pin torch 2.13). Its PyPI wheel is the CUDA 13 build (its _C links libcudart.so.13), so the
# image's torch loads it. The wheel is 290 MiB; trimmed (files the bf16 Qwen3 thinker on an H200
# never loads) and xz-compressed it is 66 MiB, split at 58 MiB so each call carries < 64 MiB with
# the working tree (~4 MiB):
#   dropped: vllm_flash_attn/_vllm_fa2_C (FA2; Hopper takes FA3), _moe_C_stable_libtorch (MoE;
#   imported under contextlib.suppress), vllm-rs (the Rust frontend binary), _flashmla*, _qutlass_C
#   (MLA / FP4, imported lazily or under try), deep_gemm's _C for Pythons other than 3.12, the CUDA
#   headers of third_party/deep_gemm and fmha_sm100 (JIT of FP8 / Blackwell kernels), the Swagger UI.
# The small wheels: vLLM 0.26.0's requirements (and theirs) that the image lacks, found by walking
# Requires-Dist from the wheel's METADATA against KINDS.md's package list, without the big optional
# kernel packages that vLLM imports lazily (flashinfer, tilelang, cutlass-dsl, quack, humming,
# tokenspeed-mla, cudnn-frontend, fastsafetensors, torchcodec, PyNvVideoCodec, nvtx) and without
# cryptography (pyjwt's lazy import); plus soundfile and soxr for duplexkit's audio front end. 53 MiB.
# Checked here: the trimmed tree and these wheels import vLLM's engine, worker, model runner, Qwen3,
# FlashAttention backend, dummy loader and duplexkit's plugin with only KINDS.md's packages beside
# them (vllm.platforms.cuda itself needs libcuda: not checkable without a GPU). That check found
# pycountry (mistral_common -> pydantic_extra_types.language_code at import) and apache-tvm-ffi
# (xgrammar, imported by vllm.v1.structured_output) needed, and xgrammar 0.2.6 (the newest whose
# tvm-ffi need, >= 0.1.10, meets vLLM's pin apache-tvm-ffi==0.1.10).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-$(mktemp -d)}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64 --platform any)
SMALL="agent-detector==2.0.0 annotated-types==0.8.0 anthropic==2.15.0 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2
cbor2==6.3.0 cffi==2.1.1 compressed-tensors==0.17.0 depyf==0.20.0 detect-installer==0.2.1 dill==0.4.1 dnspython==2.9.2
docstring-parser==0.18.0 email-validator==2.4.0 fastapi-cli==0.0.34 fastapi-cloud-cli==0.28.0 fastapi==0.136.3
fastar==0.12.0 googleapis-common-protos==1.76.0 httpcore2==2.16.2 httptools==0.9.0 httpx2==2.16.2 ijson==3.6.0
interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 jsonschema-specifications==2025.9.1 jsonschema==4.26.0 lark==1.2.2
llguidance==1.7.6 lm-format-enforcer==0.11.3 loguru==0.7.3 mcp-types==2.3.0 mcp==2.3.0 mistral-common==1.13.1
model-hosting-container-standards==0.1.16 msgspec==0.23.0 openai-harmony==0.0.8 openai==3.57.0 opentelemetry-api==1.45.2
opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp==1.45.2 opentelemetry-proto==1.45.2
opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions-ai==0.5.1 opentelemetry-semantic-conventions==0.66b2
outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1
pycparser==3.12 pydantic-core==2.50.5 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 pydantic==2.14.4
pyjwt==2.15.1 python-dotenv==1.2.4 python-json-logger==4.2.0 python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0
rich-toolkit==0.20.6 rignore==0.8.1 rpds-py==2026.9.1 sentry-sdk==2.75.0 setproctitle==1.3.8 sniffio==1.3.1
soundfile==0.14.0 soxr==1.1.0 sse-starlette==3.7.0 starlette==1.10.0 supervisor==4.3.0 truststore==0.10.5
typing-inspection==0.4.5 uvicorn==0.54.0 watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.6
apache-tvm-ffi==0.1.10 pycountry==26.2.16"

python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/dl" vllm==0.26.0
rm -rf "$WORK/trim" && mkdir -p "$WORK/trim"
(cd "$WORK/trim" && python3 -m zipfile -e "$WORK"/dl/vllm-0.26.0-*.whl . && cd vllm \
  && rm -f vllm_flash_attn/_vllm_fa2_C.abi3.so _moe_C_stable_libtorch.abi3.so vllm-rs _flashmla_C.abi3.so \
       _flashmla_extension_C.abi3.so _qutlass_C.abi3.so third_party/deep_gemm/_C.cpython-31[0134]-*.so \
  && rm -rf third_party/deep_gemm/include third_party/fmha_sm100/cutlass/include entrypoints/serve/instrumentator/static \
  && chmod +x ./*.so vllm_flash_attn/*.so)
(cd "$WORK/trim" && tar -cf - vllm vllm-0.26.0.dist-info | xz -9 -T2 >"$WORK/vllm026.tar.xz")
rm -rf .vllmgpu_a .vllmgpu_b && mkdir -p .vllmgpu_a .vllmgpu_b/wheels
(cd "$WORK" && sha256sum vllm026.tar.xz) >.vllmgpu_b/vllm026.tar.xz.sha256
split -b 60817408 -d -a 2 "$WORK/vllm026.tar.xz" .vllmgpu_b/vllm026.tar.xz.part
mv .vllmgpu_b/vllm026.tar.xz.part00 .vllmgpu_a/
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps "${PLAT[@]}" -d .vllmgpu_b/wheels $SMALL
for d in .vllmgpu_a .vllmgpu_b; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
done
du -sh .vllmgpu_a .vllmgpu_b
