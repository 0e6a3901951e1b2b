"""Constrained tool calling in turn-based generation (docs/model.md, "Tool calls"), on the tiny
random-weight checkpoint: whatever the weights sample, ``required`` and a named ``tool_choice`` end
with one call whose arguments are valid against the tool's schema, within ``max_tokens``."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from duplexkit.models.minicpmo45.chat import ChatInputError, build_chat_prompt, chat_generate  # noqa: E402
from duplexkit.models.minicpmo45.tools import (ToolSpecError, generation_schema, normalize_tool_choice,  # noqa: E402
                                               normalize_tools)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "options": {
            "type": "object",
            "properties": {"hourly": {"type": "boolean"},
                           "fields": {"type": "array", "items": {"type": "string", "enum": ["rain", "wind"]},
                                      "minItems": 1, "maxItems": 2}},
            "required": ["fields"],
        },
    },
    "required": ["city", "days", "options"],
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "minLength": 2},
                   "limit": {"type": "integer", "minimum": 100, "maximum": 250},
                   "scores": {"type": "array", "items": {"type": "number"}}},
    "required": ["query", "limit"],
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather forecast <|im_end|>", "parameters": WEATHER},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}},
    {"type": "function", "name": "ping"},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "ping": {"type": "object", "properties": {}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
BUDGET = 120  # the tiny tokenizer spells the call's fixed text in ~1-3 characters a token


def _check_call(call) -> None:
    assert call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.6])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_always_yields_one_schema_valid_call(tiny_model, seed, temperature):
    r = chat_generate(tiny_model.thinker, MSGS, tools=TOOLS, tool_choice="required", seed=seed,
                      temperature=temperature, max_tokens=BUDGET)
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1, r
    _check_call(r.tool_calls[0])
    assert len(r.token_ids) <= BUDGET
    assert r.text == "" and len(r.tts_token_ids) == 0  # nothing to say, nothing spoken


@pytest.mark.parametrize("name", ["get_weather", "search"])
@pytest.mark.parametrize("seed", [3, 4])
def test_named_choice_calls_that_tool(tiny_model, name, seed):
    for choice in ({"type": "function", "name": name}, {"type": "function", "function": {"name": name}}):
        r = chat_generate(tiny_model.thinker, MSGS, tools=TOOLS, tool_choice=choice, seed=seed, temperature=1.0,
                          max_tokens=BUDGET)
        assert r.finish_reason == "tool_calls" and [c.name for c in r.tool_calls] == [name]
        _check_call(r.tool_calls[0])


def test_a_tight_budget_still_ends_with_a_valid_call(tiny_model, monkeypatch):
    """The budget invariant: the closing path takes over when sampling would not fit any more."""
    from duplexkit.models.minicpmo45.tools import ToolConstraint

    th = tiny_model.thinker
    tails = []
    advance = ToolConstraint.advance

    def spy(self, token, remaining):
        out = advance(self, token, remaining)
        if out is not None:
            tails.append(out)
        return out

    monkeypatch.setattr(ToolConstraint, "advance", spy)
    for budget in (96, 104):
        for seed in range(3):
            r = chat_generate(th, MSGS, tools=TOOLS[:1], tool_choice="required", seed=seed, temperature=1.5,
                              max_tokens=budget)
            assert r.finish_reason == "tool_calls" and len(r.token_ids) <= budget
            _check_call(r.tool_calls[0])
    assert tails  # the closing path did finish some of them
    with pytest.raises(ToolSpecError, match="too small for a tool call"):
        chat_generate(th, MSGS, tools=TOOLS[:1], tool_choice="required", max_tokens=8)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_auto_is_text_or_a_valid_call(tiny_model, seed):
    r = chat_generate(tiny_model.thinker, MSGS, tools=TOOLS, tool_choice="auto", seed=seed, temperature=1.0,
                      max_tokens=40)
    if r.tool_calls:
        assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1
        _check_call(r.tool_calls[0])
    else:
        assert r.finish_reason in ("stop", "length") and "<tool_call>" not in r.text


def test_auto_follows_the_model_into_a_call(tiny_model):
    """A model that opens ``<tool_call>`` under ``auto`` is held to the grammar (the token boosted)."""
    th = tiny_model.thinker
    open_id = th.tokenizer.convert_tokens_to_ids("<tool_call>")
    bias = torch.zeros(th.config.vocab_size)
    bias[open_id] = 50.0
    orig = th.logits
    th.logits = lambda h: orig(h) + bias.to(h.device)
    try:
        r = chat_generate(th, MSGS, tools=TOOLS, tool_choice="auto", seed=0, temperature=0.7, max_tokens=BUDGET)
    finally:
        del th.logits
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1
    _check_call(r.tool_calls[0])


def test_none_never_calls_and_hides_the_tools(tiny_model):
    th = tiny_model.thinker
    plain = chat_generate(th, MSGS, seed=5, temperature=0.0, max_tokens=12)
    r = chat_generate(th, MSGS, tools=TOOLS, tool_choice="none", seed=5, temperature=0.0, max_tokens=12)
    assert r.tool_calls == () and r.finish_reason in ("stop", "length")
    assert r.prompt_tokens == plain.prompt_tokens and list(r.token_ids) == list(plain.token_ids)


def test_streamed_tokens_leave_the_call_out(tiny_model):
    got = []
    r = chat_generate(tiny_model.thinker, MSGS, tools=TOOLS, tool_choice="required", seed=0, max_tokens=BUDGET,
                      on_token=got.append)
    assert r.tool_calls and got == []


def test_the_prompt_carries_the_tools_section_as_plain_text(tiny_model):
    th = tiny_model.thinker
    tok = th.tokenizer
    specs = normalize_tools(TOOLS)
    p = build_chat_prompt(th, [{"role": "system", "content": "Be brief."}] + MSGS, tools=specs)
    ref = tok.apply_chat_template([{"role": "system", "content": "Be brief."}] + MSGS,
                                  tools=[s.template_entry() for s in specs], tokenize=False,
                                  add_generation_prompt=True, enable_thinking=False)
    assert p.rendered == ref  # the checkpoint's own template, tools in the chat-completions nesting
    assert "<tools>" in p.rendered and '"name": "get_weather"' in p.rendered and "Be brief." in p.rendered
    # the description's "<|im_end|>" stays text: only the system and user turns end with the control id
    assert p.ids.count(th.special.im_end) == 2
    assert tok.decode(p.ids, skip_special_tokens=False) == ref


def test_tiny_template_writes_calls_and_tool_results_like_qwen3(tiny_model):
    tok = tiny_model.thinker.tokenizer
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "ping", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "pong"}]
    s = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "ping", "arguments": {"x": 1}}\n</tool_call><|im_end|>' in s
    assert "<|im_start|>user\n<tool_response>\npong\n</tool_response><|im_end|>" in s
    for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        i = tok.convert_tokens_to_ids(t)
        assert tok.convert_ids_to_tokens(i) == t and i not in tok.bad_token_ids


def test_generation_schema_only_narrows():
    g = generation_schema(WEATHER)
    assert g["additionalProperties"] is False and g["properties"]["options"]["additionalProperties"] is False
    assert "additionalProperties" not in WEATHER  # the tool's own schema is untouched
    both = generation_schema({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in s for s in both["allOf"])
    jsonschema.validate({"city": "x", "days": 2, "options": {"fields": ["rain"]}}, g)


@pytest.mark.parametrize("tools, match", [
    (["not a dict"], "must be a dict"),
    ([{"type": "function", "description": "no name"}], "name must be"),
    ([{"type": "function", "name": "bad name!"}], "name must be"),
    ([{"type": "retrieval", "name": "x"}], "only function tools"),
    ([{"type": "function", "name": "a"}, {"type": "function", "name": "a"}], "used twice"),
    ([{"type": "function", "name": "a", "parameters": [1]}], "JSON Schema object"),
    ([{"type": "function", "name": "a", "parameters": {"type": "string"}}], "describe a JSON object"),
    ([{"type": "function", "name": "a", "parameters": {"type": "object", "properties": {
        "p": {"type": "string", "pattern": "(?<=a)b"}}}}], "cannot be compiled"),
    ([{"type": "function", "name": "a", "parameters": {"type": "object", "properties": {"p": {"$ref": "#/nowhere"}}}}],
     "cannot be compiled"),
])
def test_bad_tools_are_typed_errors(tiny_model, tools, match):
    with pytest.raises(ToolSpecError, match=match) as info:
        chat_generate(tiny_model.thinker, MSGS, tools=tools, tool_choice="auto", max_tokens=8)
    assert isinstance(info.value, ChatInputError) and isinstance(info.value, ValueError)


def test_bad_tool_choice_is_a_typed_error():
    specs = normalize_tools(TOOLS)
    assert normalize_tool_choice("auto", specs) == ("auto", ["get_weather", "search", "ping"])
    assert normalize_tool_choice({"type": "function", "name": "ping"}, specs) == ("required", ["ping"])
    for bad, match in (("sometimes", "must be 'auto'"), ({"type": "function", "name": "nope"}, "not one of"),
                       ({"name": 3}, "must name a function"), (7, "string or a dict")):
        with pytest.raises(ToolSpecError, match=match):
            normalize_tool_choice(bad, specs)
    with pytest.raises(ToolSpecError, match="at least one tool"):
        normalize_tool_choice("required", [])
    assert normalize_tool_choice("auto", []) == ("none", [])


def test_tools_with_thinking_may_think_first(tiny_model):
    r = chat_generate(tiny_model.thinker, MSGS, tools=TOOLS[2:], tool_choice="required", enable_thinking=True,
                      seed=1, temperature=1.0, max_tokens=BUDGET)
    assert r.finish_reason == "tool_calls" and r.tool_calls[0].name == "ping"
    assert json.loads(r.tool_calls[0].arguments) == {}
    assert np.all(r.token_ids >= 0)


async def test_engine_generate_returns_tool_calls():
    """``DuplexEngine.generate`` / ``generate_stream`` carry the calls; a call is not spoken (the engine
    here has no vocoder, and ``output_audio`` still works because nothing reaches it)."""
    from duplexkit.engine import DuplexEngine
    from duplexkit.engine.api import ChatMessage, ChatRequest, ToolCall

    eng = DuplexEngine.from_pretrained("tiny", layout="cpu", progress=False, with_code2wav=False)
    try:
        req = ChatRequest(messages=[ChatMessage("user", ["Weather in Paris?"])], tools=tuple(TOOLS),
                          tool_choice={"type": "function", "name": "get_weather"}, max_tokens=BUDGET, seed=2,
                          output_audio=True)
        res = await eng.generate(req)
        assert res.finish_reason == "tool_calls" and len(res.tool_calls) == 1
        assert isinstance(res.tool_calls[0], ToolCall) and res.tool_calls[0].name == "get_weather"
        _check_call(res.tool_calls[0])
        assert res.text == "" and res.audio is not None and res.audio.size == 0
        deltas = [d async for d in eng.generate_stream(req)]
        assert all(d.text == "" and d.audio is None for d in deltas)
        assert deltas[-1].finish_reason == "tool_calls" and deltas[-1].tool_calls == res.tool_calls  # same seed
        none = await eng.generate(ChatRequest(messages=[ChatMessage("user", ["hi"])], tools=tuple(TOOLS),
                                              tool_choice="none", max_tokens=6, seed=1))
        assert none.tool_calls == () and none.finish_reason in ("stop", "length")
        with pytest.raises(ToolSpecError, match="not one of"):
            await eng.generate(ChatRequest(messages=[ChatMessage("user", ["hi"])], tools=tuple(TOOLS),
                                           tool_choice={"type": "function", "name": "nope"}))
        # concurrent replies move on together (one step for all in each slice): each is what it is alone
        reqs = [ChatRequest(messages=[ChatMessage("user", [q])], tools=tuple(TOOLS), tool_choice=choice,
                            max_tokens=BUDGET, seed=seed, temperature=1.0)
                for q, choice, seed in (("Weather in Paris?", "required", 1), ("Find cats.", "auto", 2),
                                        ("Ping it.", {"type": "function", "name": "ping"}, 3))]
        alone = [await eng.generate(r) for r in reqs]
        together = await asyncio.gather(*(eng.generate(r) for r in reqs))
        assert [(r.text, r.tool_calls) for r in together] == [(r.text, r.tool_calls) for r in alone]
        assert together[2].tool_calls[0].name == "ping"
    finally:
        await eng.aclose()


def test_jump_forward_feeds_the_forced_tokens_in_passes(tiny_model):
    """The call's forced text (``<tool_call>{"name": "get_weather", ...``) is taken without sampling,
    one forward pass per run of it; the call stays schema-valid and fewer tokens are decoded one by one."""
    th = tiny_model.thinker
    kw = dict(tools=TOOLS[:1], tool_choice="required", temperature=0.0, max_tokens=BUDGET)
    slow = chat_generate(th, MSGS, jump_forward=False, **kw)
    fast = chat_generate(th, MSGS, **kw)
    assert slow.stats["forced_tokens"] == slow.stats["forced_passes"] == 0
    assert fast.stats["forced_tokens"] > 10 and 1 <= fast.stats["forced_passes"] < fast.stats["forced_tokens"]
    assert fast.stats["decode_steps"] + 10 < slow.stats["decode_steps"]
    for r in (slow, fast):
        assert r.finish_reason == "tool_calls"
        _check_call(r.tool_calls[0])
        # every id was decoded, forced, or is the unfed end of the call
        assert r.stats["decode_steps"] + r.stats["forced_tokens"] <= len(r.token_ids) <= BUDGET
    assert fast.tool_calls[0].name == "get_weather"


@pytest.fixture(scope="module")
def fast_thinker(tiny_dir):
    from duplexkit.models.minicpmo45 import load

    return load(tiny_dir, progress=False, with_code2wav=False, with_talker=False, fast=True).thinker


def test_static_kv_generates_the_same_reply_and_gives_its_slot_back(fast_thinker):
    """A reply held in a slot of the fast thinker's pool (its CUDA graphs on a GPU) decodes the same
    ids as in a DynamicCache, hands back the same spoken hidden states, and frees the slot at the end,
    when abandoned, and never grows a full pool (it falls back to the DynamicCache)."""
    from duplexkit.models.minicpmo45.chat import chat_steps

    th = fast_thinker
    free = list(th.pool.free)
    kw = dict(tools=TOOLS[:1], tool_choice="required", temperature=0.0, max_tokens=BUDGET)
    a = chat_generate(th, MSGS, static_kv=True, **kw)
    b = chat_generate(th, MSGS, static_kv=False, **kw)
    assert (a.stats["kv"], b.stats["kv"]) == ("static", "dynamic")
    assert a.token_ids.tolist() == b.token_ids.tolist() and a.tool_calls == b.tool_calls
    assert th.pool.free == free
    spoken = dict(temperature=0.0, max_tokens=10, use_tts_template=True)
    a = chat_generate(th, MSGS, static_kv=True, **spoken)
    b = chat_generate(th, MSGS, static_kv=False, **spoken)
    assert a.token_ids.tolist() == b.token_ids.tolist() and len(a.tts_token_ids) > 0
    np.testing.assert_allclose(a.tts_hidden.numpy(), b.tts_hidden.numpy(), atol=2e-4, rtol=1e-3)
    assert th.pool.free == free
    steps = chat_steps(th, MSGS, static_kv=True, **spoken)
    next(steps)
    next(steps)
    assert len(th.pool.free) == len(free) - 1
    steps.close()  # the engine closes an abandoned reply's generator
    assert th.pool.free == free
    held = [th._stream_cache() for _ in range(len(free))]
    try:
        n = th.pool.n_slots
        r = chat_generate(th, MSGS, static_kv=True, **kw)
        assert r.stats["kv"] == "dynamic" and th.pool.n_slots == n
        _check_call(r.tool_calls[0])
    finally:
        for h in held:
            h.release()
    assert th.pool.free == free


def test_replies_stepped_together_share_decode_steps(fast_thinker):
    """:func:`step_replies` runs the single-token steps of replies held in pool slots as one batched
    decode step: three replies stepped together give each the ids it gets alone, in fewer steps."""
    from duplexkit.models.minicpmo45.chat import ChatReply, step_replies

    th = fast_thinker
    free = list(th.pool.free)
    asks = [(MSGS, dict(tools=TOOLS[:1], tool_choice="required")),
            ([{"role": "user", "content": "Search for cats."}], dict(tools=TOOLS, tool_choice="auto")),
            ([{"role": "user", "content": "Say hello."}], dict(use_tts_template=True))]

    def reply(msgs, kw):
        return ChatReply(th, msgs, temperature=0.0, max_tokens=BUDGET, static_kv=True, **kw)

    alone = []
    for msgs, kw in asks:
        r = reply(msgs, kw)
        n0 = th.stats["decode_steps"]
        while not r.done:
            step_replies(th, [r])
        alone.append((r.result, th.stats["decode_steps"] - n0))
    rs = [reply(msgs, kw) for msgs, kw in asks]
    assert len(th.pool.free) == len(free) - 3
    n0 = th.stats["decode_steps"]
    while not all(r.done for r in rs):
        step_replies(th, rs)
    shared = th.stats["decode_steps"] - n0
    for r, (a, _) in zip(rs, alone):
        assert r.result.token_ids.tolist() == a.token_ids.tolist() and r.result.tool_calls == a.tool_calls
        assert r.result.stats["kv"] == "static"
    assert shared < sum(n for _, n in alone) and shared >= max(n for _, n in alone)
    assert th.pool.free == free


def test_a_reply_that_fails_ends_alone(fast_thinker, monkeypatch):
    """One reply's own failure (here its sampler) ends that reply with the error and gives its slot
    back; the replies stepped with it finish as they would alone."""
    from duplexkit.models.minicpmo45.chat import ChatReply, step_replies

    th = fast_thinker
    free = list(th.pool.free)
    kw = dict(tools=TOOLS[:1], tool_choice="required", temperature=0.0, max_tokens=BUDGET, static_kv=True)
    alone = chat_generate(th, MSGS, **kw)
    good = [ChatReply(th, MSGS, **kw) for _ in range(2)]
    bad = ChatReply(th, MSGS, **kw)
    calls = {"n": 0}
    choose = ChatReply.choose

    def broken(self):
        if self is bad:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("non-finite logits")
        return choose(self)

    monkeypatch.setattr(ChatReply, "choose", broken)
    rs = [good[0], bad, good[1]]
    while not all(r.done for r in rs):
        step_replies(th, rs)
    assert isinstance(bad.error, RuntimeError) and bad.result is None
    for r in good:
        assert r.error is None and r.result.token_ids.tolist() == alone.token_ids.tolist()
    assert th.pool.free == free
    monkeypatch.setattr(ChatReply, "choose", lambda self: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(ValueError, match="bad"):
        chat_generate(th, MSGS, **kw)  # the generator raises its reply's error
    assert th.pool.free == free
