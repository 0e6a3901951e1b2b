"""Concurrent turn-based replies in the engine (several sessions' tool decisions at once): they move
on together, their single-token steps batched in the fast thinker's pool slots; a reply that finds
every slot taken waits for one that a reply gives back instead of decoding eagerly."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
pytest.importorskip("torch")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from duplexkit.engine.api import ChatMessage, ChatRequest  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = ({"type": "function", "name": "get_weather", "parameters": WEATHER},)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from duplexkit.engine import DuplexEngine
    from duplexkit.models.minicpmo45 import build_tiny_checkpoint, load

    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)
    model = load(ckpt, progress=False, with_code2wav=False, fast=True)
    eng = DuplexEngine(model, "cpu")
    eng.stages.chat_static_kv = True  # as on a GPU (its CUDA graphs): replies in pool slots
    yield eng
    asyncio.run(eng.aclose())


def _req(q: str, seed: int) -> ChatRequest:
    return ChatRequest(messages=[ChatMessage("user", [q])], tools=TOOLS, tool_choice="required", max_tokens=96,
                       seed=seed, temperature=1.0)


def test_concurrent_replies_wait_for_a_slot_and_match_their_lone_runs(engine, monkeypatch):
    import duplexkit.models.minicpmo45.chat as chat

    th = engine.stages.model.thinker
    kinds = []
    real = chat._chat_kv

    def spy(t, need, static_kv):
        kv = real(t, need, static_kv)
        kinds.append("static" if hasattr(kv, "slot") else "dynamic")
        return kv

    monkeypatch.setattr(chat, "_chat_kv", spy)
    reqs = [_req(q, s) for s, q in enumerate(("Weather in Paris?", "And in Rome?", "Oslo, in fahrenheit?",
                                              "What about Lima?"))]

    async def run():
        alone = [await engine.generate(r) for r in reqs]
        free = list(th.pool.free)
        held = [th._stream_cache() for _ in range(len(free) - 2)]  # two slots left for four replies
        try:
            steps0 = th.stats["decode_steps"]
            together = await asyncio.gather(*(engine.generate(r) for r in reqs))
            steps = th.stats["decode_steps"] - steps0
        finally:
            for h in held:
                h.release()
        assert th.pool.free == free
        return alone, together, steps

    kinds.clear()
    alone, together, steps = asyncio.run(run())
    assert kinds == ["static"] * 8  # four alone, then four together: none fell back to the DynamicCache
    for a, b in zip(alone, together):
        assert a.tool_calls == b.tool_calls and b.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(b.tool_calls[0].arguments), WEATHER)
    assert steps > 0


def test_a_reply_with_every_slot_held_by_streams_decodes_in_a_dynamic_cache(engine):
    th = engine.stages.model.thinker
    free = list(th.pool.free)
    held = [th._stream_cache() for _ in range(len(free))]
    try:
        res = asyncio.run(engine.generate(_req("Weather in Paris?", 7)))
    finally:
        for h in held:
            h.release()
    assert res.finish_reason == "tool_calls" and th.pool.free == free
    jsonschema.validate(json.loads(res.tool_calls[0].arguments), WEATHER)


def test_an_abandoned_reply_gives_its_slot_back(engine):
    th = engine.stages.model.thinker
    free = list(th.pool.free)

    async def run():
        task = asyncio.ensure_future(engine.generate(ChatRequest(
            messages=[ChatMessage("user", ["Tell me a long story."])], max_tokens=400, temperature=1.0, seed=1)))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(th.pool.free) < len(free):
                break
        assert len(th.pool.free) == len(free) - 1  # the reply holds a slot
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ok = await engine.generate(_req("Weather in Paris?", 3))  # the thinker thread has run the close
        assert ok.finish_reason == "tool_calls"

    asyncio.run(run())
    assert th.pool.free == free


def test_one_failing_reply_leaves_the_concurrent_ones_alone(engine, monkeypatch):
    """A reply that fails (its sampler, here) is that caller's error; the replies moving on with it
    in the same steps answer as they do alone, and every slot comes back."""
    import duplexkit.models.minicpmo45.chat as chat

    th = engine.stages.model.thinker
    choose = chat.ChatReply.choose

    def broken(self):
        if "Rome" in self.prompt.rendered and len(self.out_ids) > 3:
            raise RuntimeError("non-finite logits")
        return choose(self)

    reqs = [_req("Weather in Paris?", 1), _req("And in Rome?", 2), _req("Oslo?", 3)]

    async def run():
        alone = [await engine.generate(r) for r in (reqs[0], reqs[2])]
        free = list(th.pool.free)
        monkeypatch.setattr(chat.ChatReply, "choose", broken)
        got = await asyncio.gather(*(engine.generate(r) for r in reqs), return_exceptions=True)
        assert th.pool.free == free
        return alone, got

    alone, got = asyncio.run(run())
    assert isinstance(got[1], RuntimeError) and "non-finite" in str(got[1])
    assert [got[0].tool_calls, got[2].tool_calls] == [a.tool_calls for a in alone]
