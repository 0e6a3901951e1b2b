"""The telephony bridge's translation, without sockets (server/telephony.py, docs/telephony.md):
provider messages -> client events, session server events -> provider messages."""

from __future__ import annotations

import asyncio
import base64
import socket

import numpy as np
import pytest

from duplexkit.audio.codecs import float32_to_pcm16, ulaw_to_float32
from duplexkit_server.telephony import (ADAPTERS, BadProviderMessage, CallBridge, CallStart, fetch_webhook_settings,
                                        webhook_session)

SID = "MZ" + "c" * 32


def _twilio_start(params=None, fmt=None):
    return {"event": "start", "sequenceNumber": "1", "streamSid": SID,
            "start": {"streamSid": SID, "callSid": "CA1", "accountSid": "AC1", "tracks": ["inbound"],
                      "customParameters": params or {},
                      "mediaFormat": fmt or {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}


def _started(provider="twilio", **kw) -> CallBridge:
    b = CallBridge(ADAPTERS[provider], **kw)
    if provider == "twilio":
        b.provider_message(_twilio_start({"instructions": "Be a baker.", "voice": "baker", "from": "+1555"}))
    else:
        b.provider_message({"event": "start", "stream_id": "S1", "start": {
            "call_control_id": "v3:x", "from": "+1", "to": "+2", "custom_parameters": {"k": "v"},
            "media_format": {"encoding": "PCMA", "sample_rate": 8000, "channels": 1}}})
    return b


def _delta(rid: str, seconds: float, item="item_a") -> dict:
    t = np.arange(int(24000 * seconds)) / 24000
    pcm = float32_to_pcm16((0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32))
    return {"type": "response.output_audio.delta", "response_id": rid, "item_id": item,
            "delta": base64.b64encode(pcm).decode()}


def test_start_messages_of_both_providers():
    b = _started()
    assert (b.call.provider, b.call.stream_id, b.call.call_id, b.call.from_) == ("twilio", SID, "CA1", "+1555")
    assert b.call.encoding == "g711_ulaw"
    t = _started("telnyx")
    assert (t.call.stream_id, t.call.call_id, t.call.from_, t.call.to, t.call.encoding) == (
        "S1", "v3:x", "+1", "+2", "g711_alaw")
    assert t.call.metadata()["custom_parameters"] == {"k": "v"}
    with pytest.raises(BadProviderMessage, match="audio/x-mulaw 8000"):
        CallBridge(ADAPTERS["twilio"]).provider_message(_twilio_start(fmt={"encoding": "audio/x-l16", "sampleRate": 16000}))
    with pytest.raises(BadProviderMessage):
        CallBridge(ADAPTERS["twilio"]).provider_message({"event": 3})


def test_inbound_media_and_dtmf_become_client_events():
    b = CallBridge(ADAPTERS["twilio"])
    frame = {"event": "media", "streamSid": SID, "media": {"track": "inbound", "payload": "//8="}}
    assert b.provider_message(frame) == ([], [])  # before start: nowhere to go
    b = _started()
    assert b.provider_message(frame) == ([{"type": "input_audio_buffer.append", "audio": "//8="}], [])
    out = {"event": "media", "media": {"track": "outbound", "payload": "//8="}}
    assert b.provider_message(out) == ([], [])
    ev, _ = b.provider_message({"event": "dtmf", "dtmf": {"track": "inbound_track", "digit": "7"}})
    assert ev == [{"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "DTMF: 7"}]}}]
    with pytest.raises(BadProviderMessage):
        b.provider_message({"event": "dtmf", "dtmf": {"digit": "77"}})
    assert b.provider_message({"event": "stop"}) == ([], []) and b.stopped


def test_output_audio_is_8khz_ulaw_with_marks_and_echoes_become_acks():
    b = _started(mark_every_ms=200)
    b.server_event({"type": "response.created", "response": {"id": "r1"}})
    _, out = b.server_event(_delta("r1", 1.0))
    _, tail = b.server_event({"type": "response.output_audio.done", "response_id": "r1", "item_id": "item_a"})
    out += tail
    media = [m for m in out if m["event"] == "media"]
    marks = [m for m in out if m["event"] == "mark"]
    assert [m["event"] for m in out[:2]] == ["media", "mark"] and len(media) == len(marks)
    assert all(m["streamSid"] == SID for m in out)
    data = b"".join(base64.b64decode(m["media"]["payload"]) for m in media)
    assert len(data) == 8000  # 1 s at 8 kHz, one byte per sample, the resampler's tail flushed
    assert max(len(base64.b64decode(m["media"]["payload"])) for m in media) == 1600  # 200 ms pieces
    x = ulaw_to_float32(data)
    spec = np.abs(np.fft.rfft(x[1000:7000]))
    assert abs(np.argmax(spec) * 8000 / 6000 - 440) < 5  # the tone survived resampling and mu-law
    # Twilio echoes the first two marks: 400 ms were played
    ev1, _ = b.provider_message({"event": "mark", "mark": {"name": marks[0]["mark"]["name"]}})
    ev2, _ = b.provider_message({"event": "mark", "mark": {"name": marks[1]["mark"]["name"]}})
    assert ev1 == [{"type": "playback.ack", "response_id": "r1", "played_ms": 200, "item_id": "item_a"}]
    assert ev2[0]["played_ms"] == 400 and b.heard_ms("r1") == 400
    assert b.provider_message({"event": "mark", "mark": {"name": "not-ours"}}) == ([], [])
    # the caller talks: clear, and the item is truncated where playback got to
    ev, out = b.server_event({"type": "input_audio_buffer.speech_started", "item_id": "u2"})
    assert out == [{"event": "clear", "streamSid": SID}]
    assert ev == [{"type": "conversation.item.truncate", "item_id": "item_a", "content_index": 0, "audio_end_ms": 400}]
    # echoes of the cleared marks (Twilio returns them after a clear) are not playback
    assert b.provider_message({"event": "mark", "mark": {"name": marks[2]["mark"]["name"]}}) == ([], [])
    # ... and the cancelled response's done adds no second clear, later audio of it is dropped
    assert b.server_event({"type": "response.done", "response": {"id": "r1", "status": "cancelled"}}) == ([], [])
    assert b.server_event(_delta("r1", 0.5)) == ([], [])
    assert b.stats["clears"] == 1 and b.stats["marks_played"] == 2


def test_speech_after_everything_played_clears_nothing():
    b = _started()
    _, out = b.server_event(_delta("r1", 0.4))
    for m in out:
        if m["event"] == "mark":
            b.provider_message({"event": "mark", "mark": m["mark"]})
    assert b.server_event({"type": "input_audio_buffer.speech_started"}) == ([], [])
    # a response cancelled by the client (output_audio_buffer.cleared) is cleared at the provider
    _, out = b.server_event(_delta("r2", 0.4, item="item_b"))
    ev, out = b.server_event({"type": "output_audio_buffer.cleared", "response_id": "r2"})
    assert out == [{"event": "clear", "streamSid": SID}] and ev[0]["audio_end_ms"] == 0


def test_telnyx_alaw_output_and_message_shapes():
    b = _started("telnyx", mark_every_ms=100)
    _, out = b.server_event(_delta("r1", 0.2))
    assert out[0] == {"event": "media", "stream_id": "S1", "media": {"payload": out[0]["media"]["payload"]}}
    assert out[1]["event"] == "mark" and out[1]["stream_id"] == "S1"
    ev, out = b.server_event({"type": "input_audio_buffer.speech_started"})
    assert out == [{"event": "clear", "stream_id": "S1"}]


def test_session_update_and_webhook_fields():
    b = _started()
    s = b.session_update({"baker"})["session"]
    assert s == {"input_audio_format": "g711_ulaw", "instructions": "Be a baker.", "voice": "baker",
                 "turn_detection": {"type": "server_vad", "create_response": True, "interrupt_response": True}}
    assert "voice" not in b.session_update({"other"})["session"]  # unknown voice: the default stays
    assert webhook_session({"session": {"instructions": "x", "turn_detection": None, "voice": "v"}}) == {
        "instructions": "x", "voice": "v"}
    assert webhook_session({"tools": []}) == {"tools": []}
    assert webhook_session(["no"]) is None and webhook_session({"session": {"input_audio_format": "pcm16"}}) is None


def test_webhook_failure_means_defaults(caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    call = CallStart("twilio", SID, call_id="CA9")
    got = asyncio.run(fetch_webhook_settings(f"http://127.0.0.1:{port}/hook", call, 2.0))
    assert got is None
    assert "telephony webhook failed for call CA9" in caplog.text
