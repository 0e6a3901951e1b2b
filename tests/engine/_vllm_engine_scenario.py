"""One duplex scenario through a ``DuplexEngine``, run on the native thinker and on the vLLM thinker
(tests/engine/test_vllm_duplex.py; the vLLM side in the vLLM venv through ``python
tests/engine/_vllm_engine_scenario.py CKPT AUDIO.npz OUT.json``).

Stream ``a`` (greedy, forced listen for its first unit): units 0-3 with a forced speak at unit 2,
then a barge-in (``CancelEpoch``) once unit 3 is out, then units 4-7 in epoch 1 with a forced speak
at unit 5. Stream ``b`` (temperature 0.7, seed 7) runs 4 units at the same time, so thinker steps
carry both streams. Then one greedy text chat request. Text only (``output_audio`` False).
Returns per stream the decisions ``[unit, epoch, decision, turn_start]``, the text per unit and the
turn ends, and the chat reply.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np


async def _collect(stream, last_unit: int) -> list:
    from duplexkit.engine.api import UnitTimings

    outs = []
    async for o in stream.outputs():
        outs.append(o)
        if isinstance(o, UnitTimings) and o.unit_index >= last_unit:
            return outs
    return outs


def _summary(outs: list) -> dict:
    from duplexkit.engine.api import Decision, EngineFailure, TextDelta, TurnEnd

    fails = [str(getattr(o, "message", o)) for o in outs if isinstance(o, EngineFailure)]
    if fails:
        raise RuntimeError(f"stream failed: {fails}")
    text: dict = {}
    for o in outs:
        if isinstance(o, TextDelta):
            text[str(o.unit_index)] = text.get(str(o.unit_index), "") + o.text
    return {"decisions": [[o.unit_index, o.epoch, o.decision, bool(o.turn_start)] for o in outs if isinstance(o, Decision)],
            "text": text, "turn_ends": [[o.unit_index, o.reason] for o in outs if isinstance(o, TurnEnd)]}


async def run_scenario(engine, audio: list) -> dict:
    """``audio``: float32 unit arrays (16560 samples, then 16000 each), at least 8."""
    from duplexkit.engine.api import AppendUnit, CancelEpoch, ChatMessage, ChatRequest, StreamConfig

    a = await engine.open_stream("a", StreamConfig(temperature=0.0, force_listen_count=1, output_audio=False))
    b = await engine.open_stream("b", StreamConfig(temperature=0.7, seed=7, output_audio=False))
    for i, j in enumerate((0, 5, 6, 7)):
        a.submit(AppendUnit("a", 0, unit_index=i, audio=audio[i], force_speak=i == 2))
        b.submit(AppendUnit("b", 0, unit_index=i, audio=audio[j]))
    first, outs_b = await asyncio.gather(_collect(a, 3), _collect(b, 3))
    a.submit(CancelEpoch("a", 1))  # a barge-in after unit 3
    for i in range(4, 8):
        a.submit(AppendUnit("a", 1, unit_index=i, audio=audio[i], force_speak=i == 5))
    rest = await _collect(a, 7)
    await a.aclose()
    await b.aclose()
    chats = {}
    for name, content in (("text", ["Hello there, how are you today?"]),
                          ("audio", ["Answer this:", np.concatenate(audio[:3])])):  # 3 s of speech
        r = await engine.generate(ChatRequest(messages=[ChatMessage("user", content)], temperature=0.0, max_tokens=16))
        chats[name] = {"text": r.text, "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
                       "completion_tokens": r.completion_tokens}
    return {"a": _summary(first + rest), "b": _summary(outs_b), "chat": chats}


async def _main(ckpt: str, audio_path: str, out_path: str) -> None:
    from duplexkit.engine import DuplexEngine
    from duplexkit.engine.layout import Layout

    lay = Layout.from_dict({"name": "cpu-vllm", "stages": {
        "thinker": {"device": "cpu", "dtype": "float32", "backend": "vllm", "max_model_len": 2048, "max_num_seqs": 4},
        "talker": {"device": "cpu", "dtype": "float32"}, "code2wav": {"device": "cpu", "dtype": "float32"}}})
    data = np.load(audio_path)
    eng = DuplexEngine.from_pretrained(ckpt, layout=lay, progress=False, with_code2wav=False)
    try:
        res = await run_scenario(eng, [data[f"a{i}"] for i in range(len(data.files))])
    finally:
        await eng.aclose()
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(res, f)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    asyncio.run(_main(*sys.argv[1:4]))
