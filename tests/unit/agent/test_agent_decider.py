"""duplexkit.agent.decider: the engine decider against a fake engine, the chat-endpoint decider against a
real HTTP server on 127.0.0.1, and text_messages."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from duplexkit.agent import (
    ChatEndpointToolDecider,
    EngineToolDecider,
    ToolDecider,
    check_calls,
    text_messages,
    tool,
)
from duplexkit.engine.api import ChatMessage, ChatResult, DecideTools, ToolCall, TranscribeAudio, Transcription


@tool
def convert(value: float, unit: str = "km") -> str:
    """Convert a distance to miles.

    Args:
        value: the distance.
        unit: its unit.
    """
    return str(value)


TOOLS = (convert.session_tool() | {"filler": "One sec."},)
AUDIO = np.zeros(1600, np.float32)


def _cmd(messages=None, tools=TOOLS, choice="auto") -> DecideTools:
    msgs = messages if messages is not None else (
        ChatMessage("system", ["You help."]), ChatMessage("user", ["how far is 5 km in miles?"]))
    return DecideTools(stream_id="s1", epoch=3, request_id="dec_1", messages=tuple(msgs), tools=tools,
                       tool_choice=choice)


class FakeEngine:
    """Records the ChatRequests and answers with a scripted ChatResult (or raises)."""

    model_id = "fake"
    random_weights = False

    def __init__(self, result=None, exc=None):
        self.result, self.exc, self.requests = result, exc, []

    async def generate(self, request):
        self.requests.append(request)
        if self.exc is not None:
            raise self.exc
        return self.result


# ------------------------------------------------------------------------------------------ engine decider


async def test_engine_decider_passes_the_request_and_returns_the_calls():
    eng = FakeEngine(ChatResult(text="", audio=None, finish_reason="tool_calls", prompt_tokens=10, completion_tokens=5,
                                tool_calls=(ToolCall("convert", '{"value": 5}'),)))
    d = EngineToolDecider(eng, max_tokens=99)
    assert isinstance(d, ToolDecider) and d.accepts_audio is True
    cmd = _cmd(messages=(ChatMessage("user", [AUDIO]),), choice={"type": "function", "name": "convert"})
    out = await d.decide(cmd)
    req = eng.requests[0]
    assert req.messages == list(cmd.messages) and req.messages[0].content[0] is AUDIO  # audio goes as it is
    assert req.tools == TOOLS and req.tool_choice == {"type": "function", "name": "convert"}
    assert (req.temperature, req.max_tokens, req.output_audio) == (0.0, 99, False)
    assert out.calls == (ToolCall("convert", '{"value": 5}'),) and out.error is None
    assert (out.stream_id, out.epoch, out.unit_index, out.request_id) == ("s1", 3, -1, "dec_1")
    assert out.elapsed_ms >= 0


async def test_engine_decider_no_call_failure_and_invalid_call():
    text = ChatResult(text="It is about 3.1 miles.", audio=None, finish_reason="stop", prompt_tokens=3,
                      completion_tokens=4)
    out = await EngineToolDecider(FakeEngine(text)).decide(_cmd())
    assert out.calls == () and out.error is None and out.text == "It is about 3.1 miles."

    out = await EngineToolDecider(FakeEngine(exc=RuntimeError("thinker gone"))).decide(_cmd())
    assert out.calls == () and "RuntimeError: thinker gone" in out.error and out.request_id == "dec_1"

    bad = ChatResult(text="", audio=None, finish_reason="tool_calls", prompt_tokens=1, completion_tokens=1,
                     tool_calls=(ToolCall("convert", '{"value": "five"}'),))
    out = await EngineToolDecider(FakeEngine(bad)).decide(_cmd())
    assert out.calls == () and "do not fit its schema at value" in out.error


def test_check_calls():
    assert check_calls([ToolCall("convert", '{"value": 1.5, "unit": "m"}')], TOOLS) is None
    assert check_calls([ToolCall("convert", "")], [{"type": "function", "name": "convert"}]) is None  # no schema
    nested = [{"type": "function", "function": {"name": "convert", "parameters": convert.parameters}}]
    assert check_calls([ToolCall("convert", '{"value": 2}')], nested) is None
    assert "not among the tools" in check_calls([ToolCall("weather", "{}")], TOOLS)
    assert "not JSON" in check_calls([ToolCall("convert", "{value: 1}")], TOOLS)
    assert "'value' is a required property" in check_calls([ToolCall("convert", "{}")], TOOLS)
    assert "Additional properties" in check_calls([ToolCall("convert", '{"value": 1, "x": 2}')], TOOLS)
    broken = [{"type": "function", "name": "convert", "parameters": {"type": "object", "$ref": "#/nowhere"}}]
    assert "cannot be checked" in check_calls([ToolCall("convert", "{}")], broken)


async def test_deciders_never_raise_on_malformed_tools():
    bad_tools = ("not a tool",)
    res = ChatResult(text="", audio=None, finish_reason="tool_calls", prompt_tokens=1, completion_tokens=1,
                     tool_calls=(ToolCall("convert", "{}"),))
    out = await EngineToolDecider(FakeEngine(res)).decide(_cmd(tools=bad_tools))
    assert out.calls == () and "cannot be checked" in out.error
    d = ChatEndpointToolDecider("http://127.0.0.1:9/v1")
    try:
        out = await d.decide(_cmd(tools=bad_tools))
    finally:
        await d.aclose()
    assert out.calls == () and out.error


# ------------------------------------------------------------------------------------------ text_messages


class FakeTranscriber:
    def __init__(self, text="five kilometres", error=None):
        self.text, self.error, self.seen = text, error, []

    async def transcribe(self, cmd: TranscribeAudio) -> Transcription:
        self.seen.append(cmd.audio)
        return Transcription(cmd.stream_id, cmd.epoch, -1, item_id=cmd.item_id, text="" if self.error else self.text,
                             error=self.error)


async def test_text_messages_replaces_audio_drops_images():
    image = np.zeros((4, 4, 3), np.uint8)
    msgs = [ChatMessage("system", ["sys"]), ChatMessage("user", [AUDIO, image]),
            ChatMessage("assistant", ["ok"]), ChatMessage("user", ["typed", AUDIO])]
    t = FakeTranscriber()
    out = await text_messages(msgs, t)
    assert [(m.role, m.content) for m in out] == [
        ("system", ["sys"]), ("user", ["five kilometres"]), ("assistant", ["ok"]),
        ("user", ["typed", "five kilometres"])]
    assert len(t.seen) == 2 and t.seen[0] is AUDIO

    async def fn(audio):
        return f"{audio.size} samples"

    out = await text_messages([ChatMessage("user", [AUDIO])], fn)
    assert out[0].content == ["1600 samples"]
    # without a transcriber: audio next to text is dropped; audio alone is an error
    out = await text_messages([ChatMessage("user", ["said: hi", AUDIO])], None)
    assert out[0].content == ["said: hi"]
    with pytest.raises(ValueError, match="audio only"):
        await text_messages([ChatMessage("user", [AUDIO])], None)
    with pytest.raises(ValueError, match="could not be transcribed: no speech"):
        await text_messages([ChatMessage("user", [AUDIO])], FakeTranscriber(error="no speech"))


# ------------------------------------------------------------------------------------------ endpoint decider


class _Endpoint:
    """A real HTTP server on 127.0.0.1 answering POST /v1/chat/completions with ``self.reply``
    (``(status, body)``) and recording each request's path, headers and JSON body."""

    def __init__(self):
        self.reply = (200, {})
        self.requests = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                outer.requests.append((self.path, dict(self.headers), json.loads(self.rfile.read(n))))
                status, body = outer.reply
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    e = _Endpoint()
    yield e
    e.close()


def _completion(tool_calls=None, content=None) -> dict:
    msg = {"role": "assistant", "content": content}
    if tool_calls is not None:
        msg["tool_calls"] = [{"id": f"call_{k}", "type": "function", "function": {"name": n, "arguments": a}}
                             for k, (n, a) in enumerate(tool_calls)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0, "message": msg,
                                                                          "finish_reason": "tool_calls"}]}


async def test_endpoint_decider_request_and_calls(endpoint):
    endpoint.reply = (200, _completion([("convert", '{"value": 5, "unit": "km"}')]))
    async with ChatEndpointToolDecider(endpoint.url, api_key="sk-test", model="big-text", timeout_s=5) as d:
        assert isinstance(d, ToolDecider) and d.accepts_audio is False
        out = await d.decide(_cmd(choice={"type": "function", "name": "convert"}))
    assert out.error is None and out.calls == (ToolCall("convert", '{"value": 5, "unit": "km"}', "call_0"),)
    assert out.request_id == "dec_1" and out.elapsed_ms > 0
    path, headers, body = endpoint.requests[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer sk-test"
    assert body["model"] == "big-text" and body["temperature"] == 0
    assert body["messages"] == [{"role": "system", "content": "You help."},
                                {"role": "user", "content": "how far is 5 km in miles?"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "convert", "description": convert.description,
                                                               "parameters": convert.parameters}}]  # no filler
    assert body["tool_choice"] == {"type": "function", "function": {"name": "convert"}}


async def test_endpoint_decider_audio_goes_through_the_transcriber(endpoint):
    endpoint.reply = (200, _completion(content="Sure."))
    t = FakeTranscriber("what is 5 km in miles")
    d = ChatEndpointToolDecider(endpoint.url + "/chat/completions", transcriber=t)
    try:
        out = await d.decide(_cmd(messages=(ChatMessage("user", [AUDIO]),)))
    finally:
        await d.aclose()
    assert out.error is None and out.calls == () and out.text == "Sure."
    _, headers, body = endpoint.requests[0]
    assert "Authorization" not in headers and "model" not in body
    assert body["messages"] == [{"role": "user", "content": "what is 5 km in miles"}]


@pytest.mark.parametrize("reply, match", [
    ((200, _completion([("convert", '{"value": "five"}')])), "do not fit its schema"),
    ((200, _completion([("convert", '{"value": 5')])), "not JSON"),
    ((200, _completion([("weather", "{}")])), "not among the tools"),
    ((500, {"error": {"message": "overloaded"}}), "HTTP 500: .*overloaded"),
    ((200, "not json at all"), "not a chat completion"),
    ((200, {"choices": []}), "not a chat completion"),
])
async def test_endpoint_decider_bad_answers_become_errors(endpoint, reply, match):
    endpoint.reply = reply
    async with ChatEndpointToolDecider(endpoint.url) as d:
        out = await d.decide(_cmd())
    assert out.calls == () and out.error is not None
    import re
    assert re.search(match, out.error), out.error


async def test_endpoint_decider_unreachable_and_audio_without_transcriber():
    e = _Endpoint()
    url = e.url
    e.close()  # nothing listens there any more
    async with ChatEndpointToolDecider(url, timeout_s=2) as d:
        out = await d.decide(_cmd())
        assert out.calls == () and "failed: ConnectError" in out.error
        out = await d.decide(_cmd(messages=(ChatMessage("user", [AUDIO]),)))
        assert out.calls == () and "audio only" in out.error
