"""Runs duplex streams on the vLLM thinker for tests/engine/test_vllm_duplex.py, inside the vLLM venv.

Usage: ``<vllm python> tests/engine/_vllm_duplex_runner.py SPEC.json OUT.npz`` with the worktree on
PYTHONPATH. SPEC: ``{"checkpoint": tiny MiniCPM-o dir, "model": exported dir (audio plugin),
"audio": npz path, "max_model_len": int, "streams": [...]}``; each stream
``{"force_listen_count": int, "ref_audio": npz key or null, "seed_text": str or null, "policy": {DuplexPolicy
fields} (optional), "seed": int (optional), "units": [...]}``,
each unit ``{"audio": npz key, "force_listen": bool, "force_speak": bool, "barge_in": bool, "frame": npz key
of an RGB uint8 frame or null}``
(``barge_in``: a barge-in arrives while the unit runs; the caller ends the turn after it returned).
The first stream runs alone, then all others at once (their units batched in the same vLLM steps).

OUT (npz): per stream s and unit u ``s{s}u{u}_tokens`` (generated ids), ``_rec`` (talker token ids),
``_hidden`` (float32 [L, H]), ``_meta`` (int [decision is speak, turn_start, end_of_turn, epoch,
dropped, window slides, positions dropped by the window, context length after the unit]); ``init_s`` and ``unit_s`` (seconds per unit).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np


async def _run(spec: dict) -> dict:
    from duplexkit.engine.vllm_thinker import ensure_vllm_plugin

    ensure_vllm_plugin()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from duplexkit.engine.vllm_duplex import VllmDuplexThinker
    from duplexkit.models.minicpmo45 import load
    from duplexkit.models.minicpmo45.duplex import DuplexPolicy

    th = load(spec["checkpoint"], devices="cpu", with_code2wav=False, with_talker=False, progress=False).thinker
    audio = np.load(spec["audio"])
    t0 = time.perf_counter()
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=spec["model"], dtype="float32", max_model_len=int(spec["max_model_len"]), enforce_eager=True,
        max_num_seqs=4, enable_prefix_caching=False, enable_mm_embeds=True, limit_mm_per_prompt={"audio": 0, "image": 0},
        logits_processors=["duplexkit.engine.vllm_model:DuplexDecisionProcessor"],
        worker_extension_cls="duplexkit.engine.vllm_model.DuplexkitWorkerExtension"))
    out = {"init_s": np.float64(time.perf_counter() - t0)}
    times = []
    try:
        vt = VllmDuplexThinker(th, eng, int(spec["max_model_len"]))

        async def run(si: int, s: dict) -> None:
            ref = audio[s["ref_audio"]] if s.get("ref_audio") else None
            pol = DuplexPolicy(**{"temperature": 0.0, "force_listen_count": int(s["force_listen_count"]), **s.get("policy", {})})
            vs = vt.new_stream(ref_audio=ref, seed_text=s.get("seed_text"), policy=pol, seed=s.get("seed"))
            for ui, u in enumerate(s["units"]):
                ts = time.perf_counter()
                frame = audio[u["frame"]] if u.get("frame") else None
                task = asyncio.ensure_future(vt.unit(vs, audio[u["audio"]], bool(u["force_listen"]), bool(u["force_speak"]),
                                                     frame))
                await asyncio.sleep(0)  # submitted (its epoch taken) ...
                if u.get("barge_in"):
                    vt.barge_in(vs)  # ... and a barge-in arrives while it runs
                r, epoch = await task
                times.append(time.perf_counter() - ts)
                dropped = epoch != vs.epoch
                if dropped:
                    vt.end_turn(vs)
                k = f"s{si}u{ui}"
                out[k + "_tokens"] = np.asarray(r.generated_ids, np.int64)
                out[k + "_rec"] = np.asarray(r.token_ids, np.int64)
                out[k + "_hidden"] = r.hidden.float().numpy()
                out[k + "_meta"] = np.asarray([r.decision == "speak", r.turn_start, r.end_of_turn, epoch, dropped,
                                               vs.st.window_slides, vs.st.window_dropped,
                                               vs.session.length + len(vs.st.pending_ids)], np.int64)
            await vt.close(vs)

        streams = spec["streams"]
        await run(0, streams[0])  # alone, then the others at once (batched by vLLM)
        await asyncio.gather(*(run(si, s) for si, s in enumerate(streams) if si > 0))
    finally:
        eng.shutdown()
    out["unit_s"] = np.asarray(times)
    return out


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    np.savez(sys.argv[2], **asyncio.run(_run(spec)))
