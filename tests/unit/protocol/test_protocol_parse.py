"""duplexkit.protocol: tolerant client-event parsing, strict outbound models, client-side server parsing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from duplexkit.protocol import (
    ERROR_TYPES, ConversationItemAdded, ErrorCode, OutputAudioDelta, PlaybackAckEvent, ProtocolError, ResponseListen,
    SessionCloseEvent, SessionUpdateEvent, UnknownServerEvent, parse_client_event, parse_server_event,
)
from duplexkit.protocol.server_events import SERVER_EVENT_MODELS


def code_of(raw, **kw):
    with pytest.raises(ProtocolError) as ei:
        parse_client_event(raw, **kw)
    return ei.value


def test_error_table_covers_protocol_section_9():
    assert {c.value for c in ErrorCode} == {
        "invalid_json", "unknown_event", "bad_event", "bad_audio", "event_too_large", "unsupported_audio_format",
        "unsupported_turn_detection", "input_audio_buffer_empty", "response_already_active", "response_not_active",
        "item_not_found", "invalid_truncate", "ref_audio_invalid", "ref_audio_update_unsupported",
        "session_capacity_exhausted", "input_backpressure", "unauthorized", "server_error",
        "input_rate_mismatch",  # duplexkit extension (a warning)
        "model_not_found",  # a refused model id (handshake and chat)
        # session.resume refusals (docs/protocol.md §1.6)
        "resume_not_found", "resume_expired", "resume_unauthorized", "resume_journal_overflow",
        # tools (docs/tools.md)
        "invalid_tools", "call_not_found", "call_already_answered", "call_cancelled"}
    assert set(ERROR_TYPES) == set(ErrorCode)
    assert ERROR_TYPES[ErrorCode.INPUT_BACKPRESSURE] == "rate_limit_error"


def test_ga_and_beta_session_spellings_normalise():
    ga = parse_client_event({"type": "session.update", "session": {
        "type": "realtime", "output_modalities": ["text"], "max_output_tokens": "inf",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None},
                  "output": {"voice": {"id": "v1"}}}}})
    beta = parse_client_event({"type": "session.update", "session": {
        "modalities": ["text"], "max_response_output_tokens": "inf", "input_audio_format": "pcm16",
        "sample_rate_hz": 24000, "turn_detection": None, "voice": "v1", "unknown_field": 1}})
    assert isinstance(ga, SessionUpdateEvent)
    for ev in (ga, beta):
        p = ev.session
        assert p.output_modalities == ["text"] and p.max_output_tokens == "inf" and p.voice == "v1"
        assert "turn_detection" in p.given and p.turn_detection is None
    assert beta.session.input_format == "pcm16" and beta.session.input_sample_rate_hz == 24000


def test_conflicting_spellings_are_bad_event():
    e = code_of({"type": "session.update", "event_id": "e1", "session": {"voice": "a", "audio": {"output": {"voice": "b"}}}})
    assert e.code == ErrorCode.BAD_EVENT and e.event_id == "e1"
    # identical values in both spellings are fine
    parse_client_event({"type": "session.update", "session": {"voice": "a", "audio": {"output": {"voice": "a"}}}})


def test_aliases_and_unknowns():
    assert isinstance(parse_client_event('{"type":"audio.playback_ack","response_id":"r","played_ms":5}'), PlaybackAckEvent)
    assert isinstance(parse_client_event({"type": "close"}), SessionCloseEvent)
    assert parse_client_event({"type": "close"}).reason == "client_close"
    assert code_of('{"type":"overlap.decision","event_id":"x"}').code == ErrorCode.UNKNOWN_EVENT
    assert code_of('{"type":"overlap.decision","event_id":"x"}').event_id == "x"
    assert code_of('{"event_id":"x"}').code == ErrorCode.BAD_EVENT
    assert code_of("not json").code == ErrorCode.INVALID_JSON
    assert code_of('"str"').code == ErrorCode.INVALID_JSON
    assert code_of('{"type":"input_audio_buffer.append","event_id":"y","audio":').event_id == "y"


def test_field_errors_name_param():
    e = code_of({"type": "playback.ack", "response_id": "r", "played_ms": -1})
    assert e.code == ErrorCode.BAD_EVENT and e.param == "played_ms"
    e = code_of({"type": "session.update", "session": {"temperature": 2.5}})
    assert e.param == "session.temperature"
    e = code_of({"type": "response.cancel", "event_id": "z" * 200})
    assert e.code == ErrorCode.BAD_EVENT and e.event_id == "z" * 128


def test_size_limit():
    raw = json.dumps({"type": "input_audio_buffer.append", "event_id": "big", "audio": "A" * 100})
    e = code_of(raw, max_event_bytes=50)
    assert e.code == ErrorCode.EVENT_TOO_LARGE and e.event_id == "big"
    assert parse_client_event(raw, max_event_bytes=len(raw)).type == "input_audio_buffer.append"


@given(st.binary(max_size=64) | st.text(max_size=64))
def test_parser_never_raises_anything_but_protocol_error(raw):
    try:
        parse_client_event(raw)
    except ProtocolError:
        pass


def test_outbound_strictness():
    ev = OutputAudioDelta(event_id="e", server_event_seq=1, response_id="r", item_id="i", delta="", bogus=1)
    with pytest.raises(ValueError):
        ev.to_wire()
    ok = OutputAudioDelta(event_id="e", server_event_seq=1, response_id="r", item_id="i", delta="").to_wire()
    assert ok == {"type": "response.output_audio.delta", "event_id": "e", "server_event_seq": 1, "response_id": "r",
                  "item_id": "i", "output_index": 0, "content_index": 0, "delta": ""}


def test_parse_server_event_ga_beta_and_unknown():
    base = {"event_id": "e", "response_id": "r", "item_id": "i", "output_index": 0, "content_index": 0, "delta": "AA=="}
    ga = parse_server_event({"type": "response.output_audio.delta", **base})
    beta = parse_server_event(json.dumps({"type": "response.audio.delta", **base, "x_vendor": 1}))
    assert type(ga) is type(beta) is OutputAudioDelta
    assert beta.type == "response.output_audio.delta" and beta.raw_type == "response.audio.delta"
    assert beta.model_extra == {"x_vendor": 1}
    created = parse_server_event({"type": "conversation.item.created", "event_id": "e2",
                                  "item": {"id": "item_1", "role": "user", "content": [{"type": "input_audio"}]}})
    assert isinstance(created, ConversationItemAdded) and created.raw_type == "conversation.item.created"
    assert created.item.id == "item_1"
    listen = parse_server_event({"type": "response.listen", "event_id": "e3"})  # vLLM-Omni: id-less
    assert isinstance(listen, ResponseListen) and listen.response_id is None
    for t in ("overlap.decision", "turn.event", "playback.acknowledged", "rate_limits.updated"):
        u = parse_server_event({"type": t, "foo": 1})
        assert isinstance(u, UnknownServerEvent) and u.raw == {"type": t, "foo": 1}
    bad = parse_server_event({"type": "response.done", "event_id": "x"})  # missing body: surfaced raw
    assert isinstance(bad, UnknownServerEvent) and bad.validation_error
    odd = parse_server_event({"type": "response.done", "event_id": "x", "response": {"status": "weird_new_status"}})
    assert odd.response.status == "weird_new_status"
    with pytest.raises(ProtocolError):
        parse_server_event("nope")


def test_every_server_model_has_a_ga_type():
    assert "response.audio.delta" not in SERVER_EVENT_MODELS
    assert all(not t.startswith("response.audio") and t != "conversation.item.created" for t in SERVER_EVENT_MODELS)
