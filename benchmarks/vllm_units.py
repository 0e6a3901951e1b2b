"""Per-unit time of duplex units on the vLLM thinker vs the native thinker (docs/vllm.md, "Numbers").

Runs in the vLLM venv (both thinkers in one process, the same torch)::

    PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/vllm_units.py [--streams 1 4] [--units 8]

Each stream feeds real speech (tests/fixtures/audio) unit by unit, greedy, with
``min_unit_tokens = max_unit_tokens = 19`` so every speaking unit decides 19 tokens (20 steps), the
first unit forced to listen. Reports the median seconds per unit (all streams' units in one step
for N > 1: the wall time of a round of N concurrent units) after one warm-up round. The native side
runs the same units one stream after the other on ``run_unit`` (the CPU reference path).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _speech(n: int) -> list:
    with wave.open(str(ROOT / "tests/fixtures/audio/long_question_16k.wav")) as w:
        a = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768.0
    a = np.tile(a, 1 + (16560 + 16000 * n) // a.size)
    return [a[:16560]] + [a[16560 + 16000 * i:16560 + 16000 * (i + 1)] for i in range(n - 1)]


async def _main(args) -> None:
    from duplexkit.engine.vllm_thinker import ensure_vllm_plugin, export_thinker_llm

    ensure_vllm_plugin()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from duplexkit.engine.vllm_duplex import VllmDuplexThinker
    from duplexkit.models.minicpmo45 import load
    from duplexkit.models.minicpmo45.duplex import DuplexPolicy, UnitInput, run_unit
    from duplexkit.models.minicpmo45.tiny import tiny_checkpoint

    ckpt = tiny_checkpoint()
    th = load(ckpt, devices="cpu", with_code2wav=False, with_talker=False, progress=False).thinker
    units = _speech(args.units)
    pol = dict(temperature=0.0, force_listen_count=1, min_unit_tokens=19, max_unit_tokens=19)

    st = th.new_stream(policy=DuplexPolicy(**pol))
    native = []
    for a in units:
        t0 = time.perf_counter()
        run_unit(th, UnitInput(stream=st, audio=a))
        native.append(time.perf_counter() - t0)
    print(f"native run_unit: median {statistics.median(native[2:]) * 1000:.1f} ms/unit (19 tokens), "
          f"{statistics.median(native[2:]) / 20 * 1000:.2f} ms/step")

    model = export_thinker_llm(ckpt, Path(os.environ.get("TMPDIR", "/tmp")) / "dk-vllm-bench", audio_token_id=th.special.unk)
    t0 = time.perf_counter()
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model), dtype="float32", max_model_len=4096, enforce_eager=True, max_num_seqs=max(args.streams),
        enable_prefix_caching=False, enable_mm_embeds=True, limit_mm_per_prompt={"audio": 0, "image": 0},
        logits_processors=["duplexkit.engine.vllm_model:DuplexDecisionProcessor"],
        worker_extension_cls="duplexkit.engine.vllm_model.DuplexkitWorkerExtension"))
    print(f"vLLM engine start: {time.perf_counter() - t0:.1f} s")
    try:
        vt = VllmDuplexThinker(th, eng, 4096)
        for n in args.streams:
            vss = [vt.new_stream(policy=DuplexPolicy(**pol)) for _ in range(n)]
            rounds = []
            for a in units:
                t0 = time.perf_counter()
                await asyncio.gather(*(vt.unit(vs, a) for vs in vss))
                rounds.append(time.perf_counter() - t0)
            for vs in vss:
                await vt.close(vs)
            med = statistics.median(rounds[2:])
            print(f"vLLM {n} stream(s): median {med * 1000:.1f} ms per round of {n} unit(s) (19 tokens each), "
                  f"{med / 20 * 1000:.2f} ms/step")
    finally:
        eng.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--units", type=int, default=8)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(asyncio.run(_main(p.parse_args())))
