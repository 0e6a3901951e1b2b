"""Conformance: every server event the Session emits validates against the openai SDK's typed
Realtime server events (``openai.types.realtime.RealtimeServerEvent``), except the duplex extension
events of docs/protocol.md, which validate against their own models (duplexkit.protocol)."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

openai_rt = pytest.importorskip("openai.types.realtime")
from pydantic import TypeAdapter  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "session"))
from _driver import Driver, fixture_audio, pcm16_b64  # noqa: E402

from duplexkit.engine.api import Decision, EngineFailure, TextDelta, TurnEnd  # noqa: E402
from duplexkit.protocol import EXTENSION_EVENT_TYPES, UnknownServerEvent, parse_server_event  # noqa: E402
from duplexkit.session import SessionLimits  # noqa: E402

ADAPTER = TypeAdapter(openai_rt.RealtimeServerEvent)


def _scenario(profile: str) -> list[dict]:
    d = Driver(profile=profile, max_output_tokens=6, limits=SessionLimits(idle_timeout_s=100))
    rate = 16000 if profile == "duplex" else 24000
    x = fixture_audio("question_16k.wav")
    if rate != 16000:
        from duplexkit.audio import StreamResampler
        x = StreamResampler(16000, rate).process(x)
    d.send({"type": "session.update", "session": {"instructions": "Be brief.", "voice": "alloy",
                                                  "extra_body": {"playback_commit_policy": "ack_only"}}})
    buf = io.BytesIO()
    sf.write(buf, fixture_audio("ref_voice_16k.wav")[:32000], 16000, format="WAV")
    d.send({"type": "session.update", "session": {"ref_audio": "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()}})
    d.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": "hi"}]}})
    d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x)})  # VAD speech -> committed
    d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(rate // 2, np.float32))})
    d.send({"type": "input_audio_buffer.commit"})
    if d.s.active_response_id is None:
        d.send({"type": "response.create", "response": {"metadata": {"k": "v"}, "instructions": "ignored"}})
    d.engine(Decision(d.sid, d.s.epoch, 10**6, decision="listen"))  # forced unit listens -> terminating listen
    d.engine(Decision(d.sid, d.s.epoch, 0, decision="listen"))  # beat
    r = d.speak(["Hello ", "there."])[-1]["response"]
    iid = r["output"][0]["id"]
    d.send({"type": "playback.ack", "response_id": r["id"], "played_ms": 500})
    d.send({"type": "conversation.item.truncate", "item_id": iid, "content_index": 0, "audio_end_ms": 300})
    d.send({"type": "conversation.item.retrieve", "item_id": iid})
    d.speak(["Interrupted"], end=False)
    d.append(fixture_audio("interrupt_16k.wav"))  # barge-in (server VAD)
    d.speak(["More"], end=False)
    d.send({"type": "response.cancel"})
    d.send({"type": "response.cancel"})  # response_not_active
    d.speak(["More"], end=False)
    d.send({"type": "output_audio_buffer.clear"})
    d.send({"type": "output_audio_buffer.clear"})  # nothing active
    d.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
    d.engine(Decision(d.sid, d.s.epoch, 0, decision="speak"))
    d.engine(TextDelta(d.sid, d.s.epoch, 0, text="one two three", n_tokens=7))  # token cap
    d.engine(Decision(d.sid, d.s.epoch, 0, decision="speak"))
    d.engine(TextDelta(d.sid, d.s.epoch, 0, text="ok", n_tokens=1))
    d.engine(TurnEnd(d.sid, d.s.epoch, 0))
    d.engine(Decision(d.sid, d.s.epoch, 0, decision="speak"))
    d.engine(EngineFailure(d.sid, d.s.epoch, 0, message="transient"))
    d.send({"type": "input_audio_buffer.clear"})
    d.send({"type": "conversation.item.delete", "item_id": iid})
    d.send({"type": "bogus"})
    d.send({"type": "session.heartbeat"})
    d.send({"type": "session.close"})
    return d.events


@pytest.mark.parametrize("profile", ["duplex", "compat"])
def test_every_emitted_event_validates(profile):
    events = _scenario(profile)
    seen = set()
    for ev in events:
        seen.add(ev["type"])
        if ev["type"] in EXTENSION_EVENT_TYPES:
            parsed = parse_server_event(ev)
            assert not isinstance(parsed, UnknownServerEvent), ev
            continue
        if ev["type"] == "output_audio_buffer.cleared" and "response_id" not in ev:
            # docs/protocol.md §2.3: with nothing active the answer carries no response_id (OpenAI types it
            # as required); everything else of the event validates.
            ADAPTER.validate_python({**ev, "response_id": ""})
            continue
        ADAPTER.validate_python(ev)
    expected = {
        "session.created", "session.updated", "conversation.item.added", "conversation.item.done",
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
        "response.created", "response.done", "response.output_item.added", "response.output_item.done",
        "response.content_part.added", "response.content_part.done", "response.output_audio.delta",
        "response.output_audio.done", "response.output_audio_transcript.delta", "response.output_audio_transcript.done",
        "response.output_text.delta", "response.output_text.done", "conversation.item.truncated",
        "conversation.item.retrieved", "conversation.item.deleted", "input_audio_buffer.cleared",
        "output_audio_buffer.cleared", "error", "session.heartbeat_ack", "session.closed",
    }
    if profile == "duplex":
        expected |= {"response.listen", "response.speak"}
    assert expected <= seen, expected - seen


def test_extension_data_rides_in_extra_keys():
    events = _scenario("duplex")
    for ev in events:
        r = ev.get("response")
        if isinstance(r, dict) and "metadata" in r:
            assert all(isinstance(v, str) for v in r["metadata"].values())
        if ev["type"] in ("response.created", "response.done"):
            assert isinstance(r["epoch"], int) and r["trigger"] in ("model", "client", "server_vad")
    created = events[0]["session"]
    assert created["type"] == "realtime" and "capabilities" in created and "epoch" in created
    fmt = created["audio"]["input"]["format"]
    assert fmt.get("rate") in (None, 24000) and fmt["sample_rate_hz"] == 16000


def _tools_scenario(profile: str) -> list[dict]:
    """The function-calling flow and user transcripts (docs/tools.md) through the Session."""
    from duplexkit.engine.api import DecideTools, ToolCall, ToolDecision, TranscribeAudio, Transcription

    weather = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    d = Driver(profile=profile, limits=SessionLimits(idle_timeout_s=100))
    rate = 16000 if profile == "duplex" else 24000
    x = fixture_audio("question_16k.wav")
    if rate != 16000:
        from duplexkit.audio import StreamResampler
        x = StreamResampler(16000, rate).process(x)
    d.send({"type": "session.update", "session": {
        "tools": [weather], "tool_choice": "auto", "turn_detection": None,
        "audio": {"input": {"transcription": {"model": "acme-asr-1"}}}}})  # not served: a session.warning
    d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x)})
    d.send({"type": "input_audio_buffer.commit"})
    tr = [c for c in d.cmds if isinstance(c, TranscribeAudio)][-1]
    d.engine(Transcription(d.sid, d.s.epoch, -1, item_id=tr.item_id, text="what's the weather in Paris"))
    ask = [c for c in d.cmds if isinstance(c, DecideTools)][-1]
    d.engine(ToolDecision(d.sid, d.s.epoch, -1, request_id=ask.request_id,
                          calls=(ToolCall("get_weather", '{"city": "Paris"}'),)))
    call = [e for e in d.events if e["type"] == "response.done"][-1]["response"]["output"][0]
    d.speak(["One moment, ", "I'll check."])  # the filler
    d.send({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": call["call_id"],
                                                          "output": '{"sky": "clear"}'}})
    d.send({"type": "response.create"})
    ask = [c for c in d.cmds if isinstance(c, DecideTools)][-1]
    d.engine(ToolDecision(d.sid, d.s.epoch, -1, request_id=ask.request_id, text="It is clear in Paris."))
    d.speak(["It is clear ", "in Paris."])
    d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[: rate])})
    d.send({"type": "input_audio_buffer.commit"})
    tr = [c for c in d.cmds if isinstance(c, TranscribeAudio)][-1]
    d.engine(Transcription(d.sid, d.s.epoch, -1, item_id=tr.item_id, error="recogniser failed"))
    d.send({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "call_x",
                                                          "output": "?"}})  # call_not_found
    return d.events


@pytest.mark.parametrize("profile", ["duplex", "compat"])
def test_tool_flow_events_validate(profile):
    events = _tools_scenario(profile)
    seen = set()
    for ev in events:
        seen.add(ev["type"])
        if ev["type"] in EXTENSION_EVENT_TYPES or ev["type"] == "session.warning":  # duplexkit's own events
            assert not isinstance(parse_server_event(ev), UnknownServerEvent), ev
            continue
        ADAPTER.validate_python(ev)
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done",
            "conversation.item.input_audio_transcription.delta",
            "conversation.item.input_audio_transcription.completed",
            "conversation.item.input_audio_transcription.failed", "error"} <= seen
    # session.warning is an extension event: the compat profile (plain OpenAI clients) sends none
    assert ("session.warning" in seen) == (profile == "duplex")
    assert not seen & EXTENSION_EVENT_TYPES if profile == "compat" else True
    done = [ev for ev in events if ev["type"] == "response.done"]
    call = ADAPTER.validate_python(done[0])
    assert call.response.output[0].type == "function_call" and call.response.output[0].name == "get_weather"
    created = ADAPTER.validate_python(events[1])  # session.updated echoes the tools
    assert created.session.tools[0].name == "get_weather"
