"""Protocol tests against a real ``duplexkit serve scripted`` process (fast: no torch).

The ScriptedEngine answers only when asked here (``--answer-policy on_request``), speaks 3 units
per turn with the real vocoder chunk sizes (20 160, 24 000, 24 000 and a 3 840-sample flush).
"""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
import websockets

from duplexkit.audio import read_wav
from duplexkit.clients import response_id_of
from duplexkit.clients import DuplexClient
from _timing import bound

pytestmark = pytest.mark.e2e


def _speech(path) -> np.ndarray:
    return read_wav(path, 16_000)[0]


async def _send_wav(client, audio: np.ndarray, chunk: int = 3200) -> None:
    for i in range(0, len(audio), chunk):
        await client.send_audio(audio[i:i + chunk], rate=16_000)


async def _recv_until(ws, pred, timeout: float = 10.0) -> list[dict]:
    got = []
    async with asyncio.timeout(timeout):
        while True:
            ev = json.loads(await ws.recv())
            got.append(ev)
            if pred(ev):
                return got


def test_health_and_models(scripted_server):
    h = httpx.get(scripted_server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == "scripted"
    assert h["sessions_max"] == 8
    m = httpx.get(scripted_server.url + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "scripted"
    assert m["data"][0]["owned_by"] == "duplexkit"


async def test_commit_driven_turn(scripted_server, question_wav):
    async with DuplexClient(scripted_server.ws_url) as c:
        assert c.session_id.startswith("sess_")
        assert c.session["extra_body"]["answer_policy"] == "on_request"
        await _send_wav(c, _speech(question_wav))
        committed = await c.commit()
        assert committed.type == "input_audio_buffer.committed"
        h = await c.create_response()
        assert h.trigger == "client"
        final = await h.wait(bound(20))
        assert final.response.status == "completed"
        assert h.chunk_sizes == [20160, 24000, 24000, 3840]
        assert h.audio_samples == 72000
        assert h.transcript == "Hello there, this is a scripted "
        # the envelope of docs/protocol.md §5.3, in order, and gap-free sequence numbers
        types = [e.type for e in h.events]
        assert types[:5] == ["response.created", "conversation.item.added", "response.output_item.added",
                             "response.content_part.added", "response.speak"]
        assert types[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                              "response.content_part.done", "response.output_item.done",
                              "conversation.item.done", "response.done"]
    assert c.close_reason == "client_close"


async def test_sequence_numbers_and_heartbeat(scripted_server):
    async with websockets.connect(scripted_server.ws_url + "/v1/realtime?duplex=1") as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created" and created["server_event_seq"] == 1
        await ws.send("{not json")
        await ws.send(json.dumps({"type": "no.such.event", "event_id": "c1"}))
        await ws.send(b"\x00\x01binary")
        await ws.send(json.dumps({"type": "session.heartbeat"}))
        evs = await _recv_until(ws, lambda e: e["type"] == "session.heartbeat_ack")
        codes = [e["error"]["code"] for e in evs if e["type"] == "error"]
        assert codes == ["invalid_json", "unknown_event", "bad_event"]
        binary = [e for e in evs if e["type"] == "error"][2]["error"]
        assert binary["message"] == "binary frames are not supported: send each event as a JSON text frame"
        assert [e for e in evs if e["type"] == "error"][1]["error"]["event_id"] == "c1"
        assert [e["server_event_seq"] for e in evs] == list(range(2, 2 + len(evs)))


async def test_client_barge_in_then_answer(scripted_server, question_wav, interrupt_wav):
    """Client-forced barge-in (docs/protocol.md §7.3): cancel mid-answer, then a new question is answered."""
    async with DuplexClient(scripted_server.ws_url) as c:
        await _send_wav(c, _speech(question_wav))
        await c.commit()
        first = await c.create_response()
        async for _ in first.audio():  # the first chunk arrived: interrupt now
            break
        barged = await c.barge_in()
        assert barged is first
        await first.wait(bound(10))
        assert first.status == "cancelled"
        assert first.status_details["reason"] == "client_cancelled"
        n_after_done = first.audio_samples
        await _send_wav(c, _speech(interrupt_wav))
        await c.commit()
        second = await c.create_response()
        await second.wait(bound(20))
        assert second.status == "completed" and second.audio_samples > 0
        assert second.epoch == first.epoch + 1
        assert first.audio_samples == n_after_done  # nothing of R arrived after its response.done
        # no event of the first response after its response.done
        seen_done = False
        evs = []
        while True:
            try:
                evs.append(await asyncio.wait_for(c.events().get(), 0.2))
            except (asyncio.TimeoutError, StopAsyncIteration):
                break
        for ev in evs:
            rid = response_id_of(ev)
            if seen_done:
                assert rid != first.id, ev.type
            if ev.type == "response.done" and rid == first.id:
                seen_done = True
        assert seen_done


async def test_server_vad_turn_and_barge_in(scripted_server, question_wav, interrupt_wav):
    """Server VAD (docs/protocol.md §7.2): speech + silence commits and answers; speech over the answer
    cancels it with ``turn_detected``; the interruption is then answered."""
    session = {"turn_detection": {"type": "server_vad", "create_response": True, "interrupt_response": True}}
    async with DuplexClient(scripted_server.ws_url, session=session) as c:
        await _send_wav(c, _speech(question_wav))
        await _send_wav(c, np.zeros(16000, np.float32))
        first = await asyncio.wait_for(c.responses().get(), 10)
        assert first.trigger == "server_vad"
        async for _ in first.audio():
            break
        await _send_wav(c, _speech(interrupt_wav))
        await first.wait(bound(10))
        assert first.status == "cancelled"
        assert first.status_details["reason"] == "turn_detected"
        await _send_wav(c, np.zeros(16000, np.float32))
        second = await asyncio.wait_for(c.responses().get(), 10)
        await second.wait(bound(20))
        assert second.status == "completed" and second.audio_samples > 0


def test_chat_completions(scripted_server):
    r = httpx.post(scripted_server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], "modalities": ["text", "audio"]}, timeout=bound(30))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    audio_choices = [c for c in body["choices"] if (c["message"].get("audio") or {}).get("data")]
    text_choices = [c for c in body["choices"] if c["message"].get("content")]
    assert len(audio_choices) == 1 and len(text_choices) == 1
    wav = base64.b64decode(audio_choices[0]["message"]["audio"]["data"])
    audio, rate = read_wav(wav)
    assert rate == 24000 and len(audio) > 0
    assert audio_choices[0]["message"]["audio"]["transcript"] == text_choices[0]["message"]["content"]
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_chat_completions_stream(scripted_server):
    body = {"messages": [{"role": "user", "content": "hello"}], "modalities": ["text", "audio"],
            "stream": True, "stream_options": {"include_usage": True}}
    text, audio_chunks, finish, usage, done = "", 0, {}, None, False
    with httpx.stream("POST", scripted_server.url + "/v1/chat/completions", json=body, timeout=bound(30)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            assert chunk["object"] == "chat.completion.chunk"
            if not chunk["choices"]:
                usage = chunk["usage"]
                continue
            ch = chunk["choices"][0]
            if chunk["modality"] == "text":
                assert ch["index"] == 0
                text += ch["delta"].get("content") or ""
            else:
                assert chunk["modality"] == "audio" and ch["index"] == 1
                if ch["delta"].get("content"):
                    a, rate = read_wav(base64.b64decode(ch["delta"]["content"]))
                    assert rate == 24000 and len(a) > 0
                    audio_chunks += 1
            if ch.get("finish_reason"):
                finish[chunk["modality"]] = ch["finish_reason"]
    assert done and text == "This is a scripted chat reply."
    assert audio_chunks >= 1 and finish == {"text": "stop", "audio": "stop"}
    assert usage is not None and usage["completion_tokens"] >= 1
    assert usage["prompt_tokens"] >= 1 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_completions_stream_length_finish(scripted_server):
    """The engine's last stream delta carries the finish reason: a cut reply ends with "length"."""
    body = {"messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": 2,
            "stream_options": {"include_usage": True}}
    finish, usage = None, None
    with httpx.stream("POST", scripted_server.url + "/v1/chat/completions", json=body, timeout=bound(30)) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:
                usage = chunk["usage"]
            elif chunk["choices"][0].get("finish_reason"):
                finish = chunk["choices"][0]["finish_reason"]
    assert finish == "length" and usage["completion_tokens"] == 2


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                 "input_audio": {"data": "%%%", "format": "wav"}}]}]},
     "messages[0].content[0]"),
])
def test_chat_completions_400(scripted_server, body, param):
    r = httpx.post(scripted_server.url + "/v1/chat/completions", json=body, timeout=bound(30))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_chat_completions_malformed_json(scripted_server):
    r = httpx.post(scripted_server.url + "/v1/chat/completions", content=b"{oops", timeout=bound(30))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


async def test_unknown_model_is_rejected(scripted_server):
    async with websockets.connect(scripted_server.ws_url + "/v1/realtime?model=llama-3-8b") as ws:
        ev = json.loads(await ws.recv())
        assert ev["type"] == "error" and ev["error"]["code"] == "model_not_found" and ev["error"]["param"] == "model"
        assert "openbmb/MiniCPM-o-4_5" in ev["error"]["message"] and "scripted" in ev["error"]["message"]
        with pytest.raises(websockets.ConnectionClosed) as ei:
            await ws.recv()
        assert ei.value.rcvd.code == 1008


async def test_duplex_alias_and_compat_profile(scripted_server):
    async with websockets.connect(scripted_server.ws_url + "/v1/duplex") as ws:
        s = json.loads(await ws.recv())["session"]
        assert s["extra_body"]["playback_commit_policy"] == "ack_only"
    async with websockets.connect(scripted_server.ws_url + "/v1/realtime?model=scripted") as ws:
        s = json.loads(await ws.recv())["session"]
        assert s["extra_body"]["playback_commit_policy"] == "commit_on_done"
        assert s["audio"]["input"]["format"]["rate"] == 24000


async def test_autostart_0_applies_first_update(scripted_server):
    async with websockets.connect(scripted_server.ws_url + "/v1/realtime?duplex=1&autostart=0") as ws:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ws.recv(), bound(0.5))
        await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
        ev = json.loads(await ws.recv())
        assert ev["type"] == "session.created" and ev["session"]["instructions"] == "Be brief."
        assert ev["server_event_seq"] == 1


def test_chat_completions_template_kwargs_and_system_voice(scripted_server, fixtures_audio):
    wav = base64.b64encode((fixtures_audio / "ref_voice_16k.wav").read_bytes()).decode()
    body = {"messages": [{"role": "system", "content": [{"type": "input_audio",
                                                         "input_audio": {"data": wav, "format": "wav"}}]},
                         {"role": "user", "content": "hello"}],
            "modalities": ["text", "audio"], "chat_template_kwargs": {"enable_thinking": True}}
    r = httpx.post(scripted_server.url + "/v1/chat/completions", json=body, timeout=bound(30))
    assert r.status_code == 200, r.text
    text = next(c for c in r.json()["choices"] if c["message"].get("content"))["message"]["content"]
    assert text.startswith("<think>")  # enable_thinking reached the engine
    # a reference voice shorter than 0.5 s is refused
    short = read_wav(fixtures_audio / "ref_voice_16k.wav", 16_000)[0][:4000]
    from duplexkit.audio import wav_bytes
    body["messages"][0]["content"][0]["input_audio"]["data"] = base64.b64encode(wav_bytes(short, 16000)).decode()
    r = httpx.post(scripted_server.url + "/v1/chat/completions", json=body, timeout=bound(30))
    assert r.status_code == 400 and r.json()["error"]["code"] == "ref_audio_invalid"


async def test_heartbeat_from_client(scripted_server):
    async with DuplexClient(scripted_server.ws_url, heartbeat_s=0.2) as c:
        async with asyncio.timeout(bound(5)):
            async for ev in c.events():
                if ev.type == "session.heartbeat_ack":
                    break
        assert ev.session_id == c.session_id


@pytest.mark.parametrize("kwargs, code", [
    ({"ref_audio": "short"}, "ref_audio_invalid"),
    ({"ref_audio": "file:///x.wav"}, "ref_audio_invalid"),
    ({"session": {"turn_detection": {"type": "near_field_vad"}}}, "unsupported_turn_detection"),
])
async def test_connect_raises_when_the_initial_update_is_rejected(scripted_server, fixtures_audio, kwargs, code):
    """docs/protocol.md §5.1: the error echoing the first update comes before session.created, and
    connect() raises it (the session is then closed; no close() is needed)."""
    from duplexkit.clients import DuplexError

    if kwargs.get("ref_audio") == "short":
        audio, sr = read_wav(fixtures_audio / "ref_voice_16k.wav", 16_000)
        kwargs = {"ref_audio": (audio[: int(0.3 * sr)], sr)}  # 0.3 s < the 0.5 s minimum (§8.2)
    c = DuplexClient(scripted_server.ws_url, **kwargs)
    with pytest.raises(DuplexError) as ei:
        async with c:
            pytest.fail("connect() returned although the initial update was rejected")
    assert ei.value.code == code and ei.value.event_id.startswith("cevt_")
    assert c.closed and c.close_reason == "client_close"
    # the raw order on the wire: the error, then session.created with the defaults
    async with websockets.connect(scripted_server.ws_url + "/v1/realtime?duplex=1&autostart=0") as ws:
        await ws.send(json.dumps({"type": "session.update", "event_id": "c_first",
                                  "session": {"turn_detection": {"type": "near_field_vad"}}}))
        err = json.loads(await ws.recv())
        created = json.loads(await ws.recv())
        assert err["type"] == "error" and err["error"]["event_id"] == "c_first"
        assert created["type"] == "session.created"
        assert [err["server_event_seq"], created["server_event_seq"]] == [1, 2]


def test_chat_remote_image_url_is_refused_with_what_is_accepted(scripted_server):
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}]}
    r = httpx.post(scripted_server.url + "/v1/chat/completions", json=body, timeout=bound(30))
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "never fetched" in msg and "data URL" in msg and "reference-voice" not in msg
    body["messages"][0]["content"][1]["image_url"]["url"] = "/etc/hostname"
    r = httpx.post(scripted_server.url + "/v1/chat/completions", json=body, timeout=bound(30))
    assert r.status_code == 400 and "--ref-audio-dir" in r.json()["error"]["message"]
