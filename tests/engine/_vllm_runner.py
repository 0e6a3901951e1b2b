"""Runs a scripted sequence of vLLM requests for tests/engine/test_vllm_thinker.py, inside the vLLM venv.

Usage: ``<vllm python> tests/engine/_vllm_runner.py SPEC.json OUT.json`` with the worktree on
PYTHONPATH. SPEC: ``{"model": dir, "max_model_len": int, "prefix_caching": bool, "block_size": int (optional),
"steps": [...]}``,
each step one of

* ``{"op": "plain", "ids": [...], "n": int}``: one ordinary greedy request,
* ``{"op": "session", "units": [{"ids": [...], "n": int, "barge_in_after": bool}, ...]}``: one
  streaming-input session (:class:`duplexkit.engine.vllm_thinker.VllmSession`); ``barge_in_after``
  starts a new epoch while that unit decodes (its tokens are then reported as dropped: its epoch is
  stale when it completes). A unit refused by the session (``VllmBackendError``, e.g. past
  ``max_model_len``) is reported as ``{"error": message}`` and ends that session. ``"hidden": true`` on a session step records the final-norm hidden rows
  each unit computed (:class:`duplexkit.engine.vllm_thinker.HiddenRowsExtension`) into
  ``OUT.stepI.npz`` (arrays ``unit0``, ``unit1``, ...).

* ``{"op": "chat", "ids": [...], "n": int, "stop": [...], "repetition_penalty": float}``: one
  greedy chat completion (:func:`duplexkit.engine.vllm_thinker.chat_sampling_params`); reports the
  tokens without the final stop id, the finish reason, and the hidden rows (``rows``) it computed.
* ``{"op": "concurrent", "sessions": [[unit, ...], ...]}``: several sessions at once (one
  streaming request per duplex stream, batched by the engine), units as above without barge-in.

OUT: ``{"init_s": float, "steps": [...]}``, per plain step ``{"tokens": [...]}``, per session step
``{"units": [{"tokens": [...], "epoch": int, "dropped": bool}, ...]}``, plus per-step ``"s"``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time


async def _run(spec: dict, out_path: str) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    import numpy as np

    from duplexkit.engine.vllm_thinker import VllmBackendError, VllmSession, chat_sampling_params, hidden_rows

    t0 = time.perf_counter()
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=spec["model"], dtype="float32", max_model_len=int(spec.get("max_model_len", 512)), enforce_eager=True,
        max_num_seqs=int(spec.get("max_num_seqs", 4)), enable_prefix_caching=bool(spec.get("prefix_caching", True)),
        worker_extension_cls="duplexkit.engine.vllm_thinker.HiddenRowsExtension",
        **({"block_size": int(spec["block_size"])} if spec.get("block_size") else {})))
    out = {"init_s": round(time.perf_counter() - t0, 2), "steps": []}
    try:
        for i, step in enumerate(spec["steps"]):
            ts = time.perf_counter()
            if step["op"] == "concurrent":
                async def one(j, us):
                    s = VllmSession(eng, f"conc-{i}-{j}")
                    got = [(await s.unit(u["ids"], int(u["n"]))).token_ids for u in us]
                    await s.close()
                    return got
                res = {"sessions": list(await asyncio.gather(*(one(j, us) for j, us in enumerate(step["sessions"]))))}
            elif step["op"] == "plain":
                sp = SamplingParams(temperature=0.0, max_tokens=int(step["n"]), ignore_eos=True)
                last = None
                async for o in eng.generate({"prompt_token_ids": list(step["ids"])}, sp, f"plain-{i}"):
                    last = o
                res = {"tokens": [int(t) for t in last.outputs[0].token_ids]}
            elif step["op"] == "chat":
                await eng.collective_rpc("dk_hidden_start")
                sp = chat_sampling_params(int(step["n"]), step["stop"], float(step["repetition_penalty"]))
                last = None
                async for o in eng.generate({"prompt_token_ids": list(step["ids"])}, sp, f"chat-{i}"):
                    last = o
                toks = [int(t) for t in last.outputs[0].token_ids]
                res = {"tokens": toks[:-1] if toks and toks[-1] in step["stop"] else toks,
                       "finish_reason": last.outputs[0].finish_reason,
                       "hidden_file": f"{out_path}.step{i}.npz"}
                np.savez(res["hidden_file"], rows=hidden_rows((await eng.collective_rpc("dk_hidden_take"))[0]))
            else:
                s = VllmSession(eng, f"session-{i}", max_model_len=int(spec.get("max_model_len", 512)))
                units, rows = [], {}
                if step.get("hidden"):
                    await eng.collective_rpc("dk_hidden_start")
                for u in step["units"]:
                    task = asyncio.ensure_future(s.unit(u["ids"], int(u["n"])))
                    await asyncio.sleep(0)  # the unit is submitted (its epoch taken) ...
                    if u.get("barge_in_after"):
                        s.barge_in()  # ... and a barge-in arrives while it decodes
                    try:
                        r = await task
                    except VllmBackendError as exc:
                        units.append({"error": str(exc)})
                        break
                    units.append({"tokens": r.token_ids, "epoch": r.epoch, "dropped": r.epoch != s.epoch})
                    if step.get("hidden"):
                        rows[f"unit{len(units) - 1}"] = hidden_rows((await eng.collective_rpc("dk_hidden_take"))[0])
                await s.close()
                res = {"units": units}
                if rows:
                    res["hidden_file"] = f"{out_path}.step{i}.npz"
                    np.savez(res["hidden_file"], **rows)
            res["s"] = round(time.perf_counter() - ts, 3)
            out["steps"].append(res)
    finally:
        eng.shutdown()
    return out


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    result = asyncio.run(_run(spec, sys.argv[2]))
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
