"""The scripted engine's tool decisions (``tool_script``, ``example_arguments``) and forced-speech pieces."""

from __future__ import annotations

import json

import jsonschema
import pytest

from duplexkit.engine.api import ChatMessage, ChatRequest, ToolCall
from duplexkit.testing import ScriptedEngine
from duplexkit.testing.scripted import example_arguments, speech_pieces

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "minLength": 2}}, "required": ["city"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9},
                                      "x": {"type": "number", "exclusiveMinimum": 0.5}}, "required": ["n", "x"]},
    {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "k": {"type": "integer", "default": 4},
                                      "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}},
     "required": ["unit", "k", "tags"]},
    {"type": "object", "properties": {"where": {"type": "object", "properties": {
        "lat": {"type": "number", "maximum": -10}, "ok": {"type": "boolean"}, "none": {"type": "null"}},
        "required": ["lat", "ok", "none"]}}, "required": ["where"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string"}]},
                                      "w": {"type": ["null", "string"], "minLength": 1}}, "required": ["v", "w"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$", "examples": ["ABC"]}},
     "required": ["code"]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"properties": {"b": {"const": "z"}}, "required": ["b"]}]},
    {"type": "object", "properties": {}, "minProperties": 0},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_example_arguments_are_valid(schema):
    jsonschema.validate(example_arguments(schema), schema)


def test_speech_pieces_concatenate_to_the_text():
    for text, per in (("Hello there, how are you today?", 2), ("  lead and trail  ", 1), ("one", 6), ("   ", 3)):
        pieces = speech_pieces(text, per)
        assert "".join(p for p, _ in pieces) == text and all(1 <= n <= per for _, n in pieces)
    assert [p for p, _ in speech_pieces("a b c d e", 2)] == ["a b", " c d", " e"]


TOOLS = (
    {"type": "function", "name": "get_weather", "parameters": SCHEMAS[0]},
    {"type": "function", "function": {"name": "count", "parameters": SCHEMAS[1]}},
)


def _req(choice, **kw) -> ChatRequest:
    return ChatRequest(messages=[ChatMessage("user", ["hi"])], tools=TOOLS, tool_choice=choice, **kw)


async def test_tool_script_list_is_consumed_one_per_request():
    eng = ScriptedEngine(tool_script=[("get_weather", {"city": "Paris"}), None])
    r = await eng.generate(_req("auto", output_audio=True))
    assert r.finish_reason == "tool_calls" and r.tool_calls == (ToolCall("get_weather", '{"city": "Paris"}'),)
    assert r.text == "" and r.audio is not None and r.audio.size == 0
    r = await eng.generate(_req("auto"))  # None: a text answer
    assert r.tool_calls == () and r.finish_reason == "stop" and r.text
    r = await eng.generate(_req("auto"))  # ran out: text under auto
    assert r.tool_calls == ()
    r = await eng.generate(_req("required"))  # ran out: a valid call to the first tool under required
    assert r.tool_calls[0].name == "get_weather"
    jsonschema.validate(json.loads(r.tool_calls[0].arguments), SCHEMAS[0])
    r = await eng.generate(_req({"type": "function", "name": "count"}))
    assert r.tool_calls[0].name == "count"
    jsonschema.validate(json.loads(r.tool_calls[0].arguments), SCHEMAS[1])
    r = await eng.generate(_req("none"))
    assert r.tool_calls == () and r.finish_reason == "stop"


async def test_tool_script_callable_and_the_stream():
    seen = []

    def decide(messages, tools, choice):
        seen.append((len(messages), len(tools), choice))
        return ("count", {"n": 5, "x": 1.0})

    eng = ScriptedEngine(tool_script=decide)
    deltas = [d async for d in eng.generate_stream(_req("auto"))]
    assert len(deltas) == 1 and deltas[0].finish_reason == "tool_calls"
    assert deltas[0].tool_calls == (ToolCall("count", '{"n": 5, "x": 1.0}'),) and deltas[0].usage["total_tokens"] >= 1
    assert seen == [(1, 2, "auto")]
    plain = [d async for d in eng.generate_stream(ChatRequest(messages=[ChatMessage("user", ["hi"])]))]
    assert plain[-1].finish_reason == "stop" and plain[-1].tool_calls == () and seen == [(1, 2, "auto")]
