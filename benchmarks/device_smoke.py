"""Smoke check of the GPU machine: package imports, device, copy bandwidth and bf16 matmul rate.

Run on the device machine after installing the carried wheels (see benchmarks/README.md).
Prints one table; the bandwidth is the "floor" denominator used by benchmarks/gpu_engine.py.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main() -> None:
    import torch

    rows = [("torch", torch.__version__), ("cuda", str(torch.version.cuda)), ("device", torch.cuda.get_device_name(0))]
    for mod in ("torchaudio", "transformers", "stepaudio2", "s3tokenizer", "hyperpyyaml", "pydantic", "soxr", "soundfile", "webrtcvad"):
        t = time.perf_counter()
        try:
            m = __import__(mod)
            rows.append((mod, f"{getattr(m, '__version__', 'ok')} ({time.perf_counter() - t:.1f}s)"))
        except Exception as e:  # report and go on: this is a smoke check
            rows.append((mod, f"FAILED {type(e).__name__}: {e}"[:120]))
    dev = torch.device("cuda")
    n = 2 * 1024**3 // 2  # 2 GiB of bf16
    a = torch.randn(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    bw = 2 * a.numel() * 2 * 10 / (s.elapsed_time(e) / 1e3) / 1e12
    rows.append(("copy bandwidth (read+write)", f"{bw:.2f} TB/s"))
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    s.record()
    for _ in range(10):
        x @ y
    e.record()
    torch.cuda.synchronize()
    rows.append(("bf16 matmul 8192^3", f"{2 * m**3 * 10 / (s.elapsed_time(e) / 1e3) / 1e12:.0f} TFLOP/s"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="Imports, device name, copy bandwidth and bf16 matmul rate of a "
                                        "GPU machine (needs CUDA).").parse_args()
    main()
