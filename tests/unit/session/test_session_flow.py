"""Session scenario tests (docs/protocol.md §4–§9, §12 items that apply to the Session)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf

from _driver import Driver, fixture_audio, pcm16_b64
from duplexkit.engine.api import (
    AppendUnit, AudioChunk, CancelEpoch, CloseStream, Decision, EngineFailure, ForceSpeak, OpenStream, TextDelta,
    TurnEnd, UpdateStream,
)
from duplexkit.session import Session, SessionConfig, SessionLimits, TRANSITIONS, Phase, TEvent


def second(x=1.0, amp=0.1):
    return (amp * np.sin(2 * np.pi * 220 * np.arange(int(16000 * x)) / 16000)).astype(np.float32)


# ---------------------------------------------------------------------------------------- start


def test_start_emits_session_created_and_open_stream():
    d = Driver()
    ev = d.events[0]
    assert ev["type"] == "session.created" and ev["server_event_seq"] == 1
    s = ev["session"]
    assert s["type"] == "realtime" and s["id"].startswith("sess_") and len(s["id"]) == 5 + 24
    assert s["capabilities"]["implementation_level"] == "model_native_duplex"
    assert "response.listen" in s["capabilities"]["extension_events"]
    assert s["audio"]["input"]["turn_detection"]["create_response"] is False
    assert s["sample_rate_hz"] == 16000 and s["extra_body"]["answer_policy"] == "model"
    assert isinstance(d.cmds[0], OpenStream) and d.cmds[0].stream_id == d.sid


def test_compat_profile_defaults():
    d = Driver(profile="compat")
    s = d.events[0]["session"]
    assert s["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert s["audio"]["input"]["turn_detection"]["create_response"] is True
    assert s["extra_body"] == {"force_listen_count": 0, "answer_policy": "on_request", "playback_commit_policy": "commit_on_done", "early_unit_close": False, "tool_filler": "One moment, I'll check.",
                               "tool_progress": {"after_ms": 6000, "text": "Still working on it."},
                               "seed": None}
    assert s["capabilities"]["extension_events"] == []


def test_autostart_off_applies_first_update_before_created():
    d = Driver(start=False)
    d.send({"type": "session.update", "session": {"instructions": "Be brief.", "modalities": ["text"]}})
    assert d.types() == ["session.created"]
    assert d.events[0]["session"]["instructions"] == "Be brief."
    assert d.cmds[0].config.instructions == "Be brief." and d.cmds[0].config.output_audio is False


def test_autostart_off_bad_first_update_errors_before_created():
    # the error echoing the rejected first update precedes session.created, so a client's
    # connect() can fail on it; the session still starts, with the defaults
    d = Driver(start=False)
    d.send({"type": "session.update", "event_id": "cevt_first", "session": {"temperature": 9}})
    assert d.types() == ["error", "session.created"]
    assert d.events[0]["error"]["event_id"] == "cevt_first"
    assert [e["server_event_seq"] for e in d.events] == [1, 2]
    assert d.events[1]["session"]["temperature"] != 9


def test_autostart_off_unparsable_first_update_text_frame_errors_before_created():
    d = Driver(start=False)
    d.s.receive_client_event(json.dumps({"type": "session.update", "event_id": "cevt_x",
                                         "session": {"turn_detection": {"type": "bogus"}}}), 0)
    d.pump()
    assert d.types() == ["error", "session.created"]
    assert d.events[0]["error"]["event_id"] == "cevt_x"


def test_autostart_off_bad_first_non_update_event_still_creates_then_errors():
    d = Driver(start=False)
    d.send({"type": "response.cancel", "response_id": 5})
    assert d.types() == ["session.created", "error"]


# ---------------------------------------------------------------------------------------- envelope


def test_commit_create_speak_full_envelope():
    d = Driver()
    d.append(second(1.2))
    d.send({"type": "input_audio_buffer.commit"})
    new = d.send({"type": "response.create"})
    assert d.types(new) == ["response.created"]
    assert new[0]["response"]["trigger"] == "client" and new[0]["response"]["epoch"] == 0
    # the forced unit runs at once (early unit close): the commit's partial unit (2 640 real samples after
    # unit 0's 16 560) is held back for COMMIT_MERGE_MS and becomes the forced unit, zero-padded
    forced = [c for c in new if isinstance(c, AppendUnit)]
    assert len(forced) == 1 and forced[0].force_speak and not forced[0].force_listen
    assert forced[0].audio[:2640].any() and not forced[0].audio[2640:].any()
    assert not any(isinstance(c, ForceSpeak) for c in new)
    new = d.speak(["Hi ", "there."])
    assert d.types(new) == [
        "conversation.item.added", "response.output_item.added", "response.content_part.added", "response.speak",
        "response.output_audio.delta", "response.output_audio_transcript.delta",
        "response.output_audio.delta", "response.output_audio_transcript.delta",
        "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done", "response.done",
    ]
    done = new[-1]["response"]
    assert done["status"] == "completed" and done["audio_duration_ms"] == (20160 + 24000) * 1000 // 24000
    assert d.of("response.output_audio_transcript.done")[0]["transcript"] == "Hi there."
    delta = d.of("response.output_audio.delta")[0]
    assert delta["format"] == "pcm16" and delta["sample_rate_hz"] == 24000
    assert delta["metadata"]["audio_text_marks"] == [{"text_chars": 3, "audio_end_ms": 840}]
    assert d.s.state == "idle"


def test_model_triggered_response_and_listen_beats():
    d = Driver()
    d.append(second(1.1))
    new = d.engine(Decision(d.sid, 0, 0, decision="listen"))
    assert d.types(new) == ["response.listen"] and "response_id" not in new[0]
    assert new[0]["response"]["status"] == "listening"
    new = d.speak()
    assert new[0]["type"] == "response.created" and new[0]["response"]["trigger"] == "model"


def test_compat_has_no_extension_events():
    d = Driver(profile="compat")
    d.engine(Decision(d.sid, 0, 0, decision="listen"))
    d.speak()
    assert "response.listen" not in d.types() and "response.speak" not in d.types()


def test_forced_unit_listen_terminates_precreated_response():
    d = Driver()
    d.append(second(1.1))
    d.send({"type": "response.create"})
    forced = d.s.resp.active().forced_unit
    assert d.types(d.engine(Decision(d.sid, 0, forced - 1, decision="listen"))) == []  # before the forced unit
    new = d.engine(Decision(d.sid, 0, forced, decision="listen"))
    assert d.types(new) == ["response.listen", "response.done"]
    assert new[0]["response_id"] == new[1]["response"]["id"]
    assert new[1]["response"]["status"] == "completed" and new[1]["response"]["output"] == []
    assert new[1]["response"]["metadata"]["decision"] == "listen"


def test_text_only_response():
    d = Driver()
    d.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
    assert isinstance(d.cmds[-1], UpdateStream) and d.cmds[-1].config.output_audio is False
    d.engine(Decision(d.sid, 0, 0, decision="speak", turn_start=True))
    d.engine(TextDelta(d.sid, 0, 0, text="Bonjour", n_tokens=2))
    d.engine(AudioChunk(d.sid, 0, 0, audio=np.ones(100, np.float32), text="x"))  # ignored in text mode
    new = d.engine(TurnEnd(d.sid, 0, 1))
    assert d.of("response.output_text.delta")[0]["delta"] == "Bonjour"
    assert "response.output_audio.delta" not in d.types()
    assert d.of("response.output_text.done")[0]["text"] == "Bonjour"
    assert d.of("response.content_part.added")[0]["part"] == {"type": "text", "text": ""}
    assert new[-1]["response"]["output_modalities"] == ["text"]


# ---------------------------------------------------------------------------------------- cancel / epochs


def test_cancel_is_idempotent_and_advances_epoch_once():
    d = Driver()
    d.append(second(1.1))
    d.speak(end=False)
    rid = d.s.active_response_id
    new = d.send({"type": "response.cancel"})
    assert [c.epoch for c in new if isinstance(c, CancelEpoch)] == [1]
    done = d.of("response.done", new)[0]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
    for _ in range(2):
        new = d.send({"type": "response.cancel", "response_id": rid})
        assert d.of("error", new)[0]["error"]["code"] == "response_not_active"
    assert d.s.epoch == 1
    # stale engine output of epoch 0 is dropped
    assert d.types(d.speak(epoch=0)) == []
    # the session can still complete a normal turn
    new = d.speak()
    assert new[-1]["type"] == "response.done" and new[-1]["response"]["epoch"] == 1


def test_cancel_with_stale_id_while_active():
    d = Driver()
    d.speak(end=False)
    new = d.send({"type": "response.cancel", "response_id": "resp_nope"})
    assert d.of("error", new)[0]["error"]["code"] == "response_not_active"
    assert d.s.active_response_id is not None and d.s.epoch == 0


def test_create_while_active_is_rejected():
    d = Driver()
    d.send({"type": "response.create"})
    new = d.send({"type": "response.create"})
    assert d.of("error", new)[0]["error"]["code"] == "response_already_active"
    d.speak()


def test_input_clear_keeps_epoch_and_response():
    d = Driver()
    d.append(second(0.5))
    d.speak(end=False)
    new = d.send({"type": "input_audio_buffer.clear"})
    assert d.types(new) == ["input_audio_buffer.cleared"] and d.s.epoch == 0 and d.s.active_response_id
    assert d.s.input._framer.pending_samples == 0


def test_output_audio_buffer_clear():
    d = Driver()
    new = d.send({"type": "output_audio_buffer.clear"})
    assert d.types(new) == ["output_audio_buffer.cleared"] and "response_id" not in new[0] and d.s.epoch == 0
    d.speak(end=False)
    rid = d.s.active_response_id
    new = d.send({"type": "output_audio_buffer.clear"})
    assert new[0]["type"] == "output_audio_buffer.cleared" and new[0]["response_id"] == rid
    assert d.of("response.done", new)[0]["response"]["status"] == "cancelled" and d.s.epoch == 1


def test_token_cap_ends_incomplete_and_cancels_epoch():
    d = Driver()
    d.send({"type": "session.update", "session": {"max_response_output_tokens": 3}})
    d.engine(Decision(d.sid, 0, 0, decision="speak", turn_start=True))
    d.engine(TextDelta(d.sid, 0, 0, text="a b", n_tokens=2))
    new = d.engine(TextDelta(d.sid, 0, 1, text="c d", n_tokens=2))
    done = d.of("response.done", new)[0]["response"]
    assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens"
    assert any(isinstance(c, CancelEpoch) and c.epoch == 1 for c in new)
    assert d.types(d.engine(AudioChunk(d.sid, 0, 1, audio=np.ones(960, np.float32), text="a b"))) == []


def test_server_default_token_cap_is_finite():
    d = Driver(max_output_tokens=5)
    d.engine(Decision(d.sid, 0, 0, decision="speak", turn_start=True))
    for i in range(5):
        d.engine(TextDelta(d.sid, d.s.epoch, i, text="x", n_tokens=1))
    assert d.of("response.done")[0]["response"]["status"] == "incomplete"


def test_engine_error_fails_response_and_fatal_closes_1011():
    d = Driver()
    d.speak(end=False)
    new = d.engine(EngineFailure(d.sid, 0, 1, code="server_error", message="boom"))
    done = d.of("response.done", new)[0]["response"]
    assert done["status"] == "failed" and done["status_details"]["error"]["code"] == "server_error"
    new = d.engine(EngineFailure(d.sid, 0, 1, message="dead", fatal=True))
    assert d.types(new) == ["error", "session.closed"]
    assert new[1]["reason"] == "server_error" and d.closes[-1].code == 1011
    assert isinstance([c for c in new if not isinstance(c, dict)][0], CloseStream)
    assert d.s.closed and d.send({"type": "session.heartbeat"}) == []


# ---------------------------------------------------------------------------------------- input


def test_commit_needs_100ms():
    d = Driver()
    new = d.send({"type": "input_audio_buffer.commit"})
    assert d.of("error", new)[0]["error"]["code"] == "input_audio_buffer_empty"
    d.append(second(0.05))
    assert d.of("error", d.send({"type": "input_audio_buffer.commit"}))
    d.append(second(0.06))
    new = d.send({"type": "input_audio_buffer.commit"})
    assert d.types(new) == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    units = [c for c in new + d.tick(50) if isinstance(c, AppendUnit)]  # after COMMIT_MERGE_MS
    assert len(units) == 1 and units[0].audio.shape == (16560,) and units[0].unit_index == 0
    assert new[-1]["item"]["role"] == "user" and new[-1]["item"]["content"] == [{"type": "input_audio"}]


def test_byte_splitting_gives_same_model_input():
    x = second(2.3, amp=0.3)
    raw = (x * 32767).astype("<i2").tobytes()
    ref = Driver()
    ref.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(raw).decode()})
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, len(raw)), size=40, replace=False))
    d = Driver()
    for a, b in zip([0, *cuts], [*cuts, len(raw)]):
        d.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(raw[a:b]).decode()})
    u1 = [c.audio for c in ref.cmds if isinstance(c, AppendUnit)]
    u2 = [c.audio for c in d.cmds if isinstance(c, AppendUnit)]
    assert len(u1) == len(u2) == 2
    for a, b in zip(u1, u2):
        np.testing.assert_array_equal(a, b)


def test_resampled_input_24k_compat():
    d = Driver(profile="compat")
    x24 = (0.3 * np.sin(2 * np.pi * 440 * np.arange(24000 * 3) / 24000)).astype(np.float32)
    d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x24)})
    units = [c for c in d.cmds if isinstance(c, AppendUnit)]
    assert len(units) == 2
    a = units[1].audio
    f = np.argmax(np.abs(np.fft.rfft(a))) * 16000 / len(a)
    assert abs(f - 440) < 440 * 0.01
    assert all(u.force_listen for u in units)  # compat: on_request answer policy


def test_answer_policy_on_request_force_listen():
    d = Driver()
    d.send({"type": "session.update", "session": {"extra_body": {"answer_policy": "on_request"}}})
    d.append(second(1.1))
    assert [c.force_listen for c in d.cmds if isinstance(c, AppendUnit)] == [True]
    d.send({"type": "response.create"})
    d.append(second(1.0))
    assert [c.force_listen for c in d.cmds if isinstance(c, AppendUnit)] == [True, False]
    d.speak()
    d.append(second(1.0))
    assert [c.force_listen for c in d.cmds if isinstance(c, AppendUnit)][-1] is True


def test_force_listen_count():
    d = Driver()
    d.send({"type": "session.update", "session": {"extra_body": {"force_listen_count": 2}}})
    d.append(second(3.6))
    assert [c.force_listen for c in d.cmds if isinstance(c, AppendUnit)] == [False, False, False]  # set after start
    d2 = Driver(start=False)
    d2.send({"type": "session.update", "session": {"extra_body": {"force_listen_count": 2}}})
    d2.append(second(3.6))
    assert [c.force_listen for c in d2.cmds if isinstance(c, AppendUnit)] == [True, True, False]


def test_silence_feeding_never_stalls_an_answer():
    d = Driver()
    d.append(second(0.5))
    d.send({"type": "input_audio_buffer.commit"})
    n0 = len([c for c in d.cmds if isinstance(c, AppendUnit)])
    forced = [c for c in d.send({"type": "response.create"}) if isinstance(c, AppendUnit)]
    # the commit's 0.5 s partial unit is the forced unit (COMMIT_MERGE_MS)
    assert [(u.unit_index, u.force_speak, u.is_silence) for u in forced] == [(n0, True, False)]
    assert not [c for c in d.tick(500) if isinstance(c, AppendUnit)]  # deadline not yet passed
    new = d.tick(1000)
    units = [c for c in new if isinstance(c, AppendUnit)]
    assert len(units) == 1 and units[0].is_silence and units[0].audio.shape == (16000,) and not units[0].audio.any()
    assert units[0].unit_index == n0 + 1 and not units[0].force_speak
    # real input takes precedence: a partial unit is completed with silence, marked not-silence
    d.append(second(0.3))
    new = d.tick(1300)
    units = [c for c in new if isinstance(c, AppendUnit)]
    assert len(units) == 1 and not units[0].is_silence and units[0].audio[:4800].any() and not units[0].audio[-100:].any()
    # nothing is fed without an active response
    d.speak()
    assert not [c for c in d.tick(5000) if isinstance(c, AppendUnit)]


def test_backpressure():
    d = Driver(limits=SessionLimits(max_pending_input_s=2))
    d.append(second(2.0))
    new = d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(second(0.5))})
    assert d.of("error", new)[0]["error"]["code"] == "input_backpressure"
    d.engine(Decision(d.sid, 0, 0, decision="listen"))  # unit 0 consumed
    assert not d.of("error", d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(second(0.5))}))


# ---------------------------------------------------------------------------------------- barge-in


def _speaking_driver(**kw) -> Driver:
    d = Driver(**kw)
    d.append(np.zeros(16000, np.float32))
    d.speak(["Once upon ", "a time "], end=False)
    assert d.s.state == "speaking"
    return d


def test_server_vad_barge_in():
    d = _speaking_driver()
    rid = d.s.active_response_id
    x = fixture_audio("interrupt_16k.wav")
    pos_ms = d.s.input._real_samples * 1000 // 16000
    new = d.append(x)
    st = d.of("input_audio_buffer.speech_started", new)[0]
    done = d.of("response.done", new)[0]
    assert done["response"]["id"] == rid and done["response"]["status_details"]["reason"] == "turn_detected"
    assert d.types(new).index("input_audio_buffer.speech_started") < d.types(new).index("response.done")
    assert d.s.epoch == 1
    assert st["audio_start_ms"] <= pos_ms + 300 - 300 + 50  # onset 0.30 s, pre-roll >= 300 ms
    # units framed after the onset was detected go to the engine in the new epoch
    i0 = new.index(st)
    assert [c.epoch for c in new[i0:] if isinstance(c, AppendUnit)] and all(
        c.epoch == 1 for c in new[i0:] if isinstance(c, AppendUnit))
    new = d.append(np.zeros(16000, np.float32))
    stop = d.of("input_audio_buffer.speech_stopped", d.events)[0]
    com = d.of("input_audio_buffer.committed")[-1]
    assert com["item_id"] == st["item_id"] == stop["item_id"]
    assert "response.created" not in d.types(new)  # duplex default: create_response false
    assert d.types(d.speak(epoch=0)) == []  # stale
    assert d.speak()[-1]["response"]["status"] == "completed"


def test_vad_interrupt_false_never_cancels():
    d = _speaking_driver()
    d.send({"type": "session.update", "session": {"turn_detection": {"type": "server_vad", "interrupt_response": False}}})
    new = d.append(fixture_audio("interrupt_16k.wav"))
    assert d.of("input_audio_buffer.speech_started", new) and d.s.epoch == 0 and d.s.active_response_id


def test_vad_create_response_compat():
    d = Driver(profile="compat")
    x = fixture_audio("question_16k.wav")
    from duplexkit.audio import StreamResampler
    x24 = StreamResampler(16000, 24000).process(np.concatenate([x, np.zeros(16000, np.float32)]))
    d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x24)})
    created = d.of("response.created")
    assert created and created[0]["response"]["trigger"] == "server_vad"
    assert d.types().index("input_audio_buffer.committed") < d.types().index("response.created")


def test_model_native_mode_no_vad_events():
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    assert d.events[-1]["session"]["turn_detection"] is None
    d.speak(end=False)
    d.append(fixture_audio("interrupt_16k.wav"))
    assert not d.of("input_audio_buffer.speech_started") and d.s.active_response_id


# ---------------------------------------------------------------------------------------- playback truth


def _spoken(d: Driver, policy="ack_only"):
    d.send({"type": "session.update", "session": {"extra_body": {"playback_commit_policy": policy}}})
    d.speak(["One two ", "three four ", "five."])
    return d.of("response.done")[-1]["response"]


def test_playback_ack_and_truncate():
    d = Driver()
    r = _spoken(d)
    rid, iid = r["id"], r["output"][0]["id"]
    sent = r["audio_duration_ms"]
    assert r["committed_ms"] == 0
    d.send({"type": "playback.ack", "response_id": rid, "item_id": iid, "played_ms": 900})
    assert d.s.item_playback(iid) == (sent, 900, False)
    d.send({"type": "playback.ack", "response_id": rid, "played_ms": 100})
    assert d.s.item_playback(iid)[1] == 900  # never lowered
    d.send({"type": "playback.ack", "response_id": rid, "played_ms": 10**9})
    assert d.s.item_playback(iid)[1] == sent  # clamped
    new = d.send({"type": "conversation.item.truncate", "item_id": iid, "content_index": 0, "audio_end_ms": 850})
    assert new[0]["type"] == "conversation.item.truncated" and new[0]["audio_end_ms"] == 850
    assert d.s.item_playback(iid) == (sent, 850, True)
    ret = d.send({"type": "conversation.item.retrieve", "item_id": iid})[0]["item"]
    assert ret["content"][0]["transcript"] == "One two "  # cut at the last mark <= 850 ms
    d.send({"type": "playback.ack", "response_id": rid, "played_ms": 2000})
    assert d.s.item_playback(iid)[1] == 850  # final


def test_commit_on_done_policy():
    d = Driver()
    r = _spoken(d, "commit_on_done")
    assert r["committed_ms"] == r["audio_duration_ms"]


def test_truncate_without_audio_and_invalid():
    d = Driver()
    d.speak([], end=False)
    rid = d.s.active_response_id
    iid = d.s.resp.active().item_id
    new = d.send({"type": "conversation.item.truncate", "item_id": iid, "content_index": 0, "audio_end_ms": 500})
    assert new[0]["type"] == "conversation.item.truncated" and new[0]["audio_end_ms"] == 0
    for bad in (1.5, -1, "x", None, True):
        e = d.send({"type": "conversation.item.truncate", "item_id": iid, "content_index": 0, "audio_end_ms": bad})
        assert e[0]["error"]["code"] == "invalid_truncate"
    e = d.send({"type": "conversation.item.truncate", "item_id": iid, "content_index": 1, "audio_end_ms": 0})
    assert e[0]["error"]["code"] == "invalid_truncate"
    e = d.send({"type": "conversation.item.truncate", "item_id": "item_x", "content_index": 0, "audio_end_ms": 0})
    assert e[0]["error"]["code"] == "item_not_found"
    assert d.of("error", d.send({"type": "playback.ack", "response_id": "resp_x", "played_ms": 1}))[0]["error"]["code"] == "item_not_found"
    assert d.send({"type": "playback.ack", "response_id": rid, "played_ms": 1}) == []
    e = d.send({"type": "playback.ack", "response_id": rid, "played_ms": 1.5})
    assert e[0]["error"]["code"] == "bad_event"


# ---------------------------------------------------------------------------------------- items


def test_items_create_retrieve_delete():
    d = Driver()
    new = d.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                "content": [{"type": "input_text", "text": "Hi"}]}})
    assert d.types(new) == ["conversation.item.added", "conversation.item.done"]
    assert isinstance(d.cmds[-1], UpdateStream) and d.cmds[-1].config.seed_text == "Hi"
    iid = new[0]["item"]["id"]
    assert d.send({"type": "conversation.item.retrieve", "item_id": iid})[0]["item"]["content"][0]["text"] == "Hi"
    e = d.send({"type": "conversation.item.create", "previous_item_id": "item_nope",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}})
    assert e[0]["error"]["code"] == "item_not_found"
    e = d.send({"type": "conversation.item.create", "item": {"type": "message", "role": "assistant",
                                                              "content": [{"type": "output_audio", "audio": "AAAA"}]}})
    assert e[0]["error"]["code"] == "bad_event"  # assistant audio cannot be taken (text can: test_text_items_*)
    new = d.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                "content": [{"type": "input_audio", "audio": pcm16_b64(second(0.5))}]}})
    assert d.types(new) == ["conversation.item.added", "conversation.item.done"]
    assert [c for c in new if isinstance(c, AppendUnit)]
    e = d.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                              "content": [{"type": "input_text", "text": "late"}]}})
    assert d.types(e) == ["conversation.item.added", "conversation.item.done", "session.warning"]  # history only
    assert d.send({"type": "conversation.item.delete", "item_id": iid})[0] == {**d.events[-1]}
    assert d.events[-1]["type"] == "conversation.item.deleted"
    assert d.send({"type": "conversation.item.retrieve", "item_id": iid})[0]["error"]["code"] == "item_not_found"
    d.speak(end=False)
    e = d.send({"type": "conversation.item.delete", "item_id": d.s.resp.active().item_id})
    assert e[0]["error"]["code"] == "bad_event"


# ---------------------------------------------------------------------------------------- session.update


def test_session_update_validation_is_atomic():
    d = Driver()
    before = d.s.settings.copy()
    cases = [
        ({"modalities": ["text"], "output_modalities": ["audio"]}, "bad_event"),
        ({"temperature": 3}, "bad_event"),
        ({"input_audio_format": "mp3"}, "unsupported_audio_format"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 4000}}}}, "unsupported_audio_format"),
        ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "unsupported_audio_format"),
        ({"turn_detection": {"type": "semantic_vad", "eagerness": "never"}}, "unsupported_turn_detection"),
        ({"turn_detection": {"type": "near_field"}}, "unsupported_turn_detection"),
        ({"turn_detection": {"type": "server_vad", "silence_duration_ms": 50}}, "unsupported_turn_detection"),
        ({"max_output_tokens": 0}, "bad_event"),
        ({"extra_body": {"answer_policy": "sometimes"}}, "bad_event"),
        ({"temperature": 0.2, "ref_audio": "https://example.com/a.wav"}, "ref_audio_invalid"),
        ({"tools": [{"type": "function"}]}, "invalid_tools"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "invalid_tools"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "invalid_tools"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 7}}}}]},
         "invalid_tools"),
        ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "invalid_tools"),
        ({"tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}, "invalid_tools"),
        ({"tools": "get_weather"}, "invalid_tools"),
        ({"tools": {"type": "function", "name": "f"}}, "invalid_tools"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"$ref": "https://example.com/s.json"}}]},
         "invalid_tools"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {
            "type": "object", "properties": {"x": {"$ref": "file:///etc/passwd"}}}}]}, "invalid_tools"),
        ({"tool_choice": "sometimes"}, "invalid_tools"),
        ({"tool_choice": {"type": "function", "name": "missing"}}, "invalid_tools"),
        ({"temperature": 0.2, "audio": {"input": {"transcription": "whisper-1"}}}, "bad_event"),
    ]
    for sess, code in cases:
        new = d.send({"type": "session.update", "session": sess})
        assert [e["error"]["code"] for e in d.of("error", new)] == [code], sess
        assert d.s.settings == before
    tool = {"type": "function", "name": "f", "description": "", "parameters": {"type": "object", "properties": {}}}
    new = d.send({"type": "session.update", "session": {"type": "realtime", "voice": "alloy", "tools": [{"type": "function", "name": "f"}],
                                                        "input_audio_format": "pcm16", "sample_rate_hz": 8000}})
    s = new[0]["session"]
    assert s["voice"] == "alloy" and s["tools"] == [tool] and s["tool_choice"] == "auto" and s["sample_rate_hz"] == 8000


def test_instructions_after_first_unit_are_accepted():
    # the turn-boundary rule itself: tests/unit/session/test_session_midsession.py
    d = Driver()
    d.send({"type": "session.update", "session": {"instructions": "A"}})
    d.append(second(1.1))
    new = d.send({"type": "session.update", "session": {"instructions": "B"}})
    assert not d.of("error", new) and d.of("session.updated", new)[0]["session"]["instructions"] == "B"
    assert [w["code"] for w in d.of("session.warning", new)] == ["instructions_reprefill"]
    assert not d.of("error", d.send({"type": "session.update", "session": {"instructions": "B"}}))  # unchanged resend


def _wav_data_url(x: np.ndarray, rate: int, channels: int = 1) -> str:
    buf = io.BytesIO()
    data = np.stack([x] * channels, axis=1) if channels > 1 else x
    sf.write(buf, data, rate, format="WAV", subtype="FLOAT")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def test_reference_voice_rules(tmp_path):
    x = fixture_audio("ref_voice_16k.wav")
    d = Driver()
    url = _wav_data_url(x[:40123], 16000, channels=2)
    new = d.send({"type": "session.update", "session": {"ref_audio": url}})
    ra = new[0]["session"]["ref_audio"]
    rv = d.cmds[-1].config.ref_voice
    assert len(rv.audio) == 40000 and ra == {"sha256": rv.sha256, "duration_ms": 2500}
    # 48 kHz input is resampled to 16 kHz
    from duplexkit.audio import StreamResampler
    x48 = StreamResampler(16000, 48000).process(x[:16000])
    d.send({"type": "session.update", "session": {"extra_body": {"ref_audio": _wav_data_url(x48, 48000)}}})
    assert len(d.cmds[-1].config.ref_voice.audio) % 1600 == 0 and abs(len(d.cmds[-1].config.ref_voice.audio) - 16000) <= 1600
    for bad in (_wav_data_url(x[:4000], 16000), "data:audio/wav;base64,!!!", "data:audio/wav;base64,AAAA",
                "/etc/passwd", "file:///tmp/x.wav", "http://h/x.wav"):
        e = d.send({"type": "session.update", "session": {"ref_audio": bad}})
        assert e[0]["error"]["code"] == "ref_audio_invalid", bad
    long = Driver(limits=SessionLimits(max_ref_audio_s=1))
    assert long.send({"type": "session.update", "session": {"ref_audio": url}})[0]["error"]["code"] == "ref_audio_invalid"
    # paths through the loader only
    p = tmp_path / "v.wav"
    sf.write(p, x[:16000], 16000)
    dl = Driver(ref_audio_loader=lambda path: open(path, "rb").read())
    assert dl.send({"type": "session.update", "session": {"ref_audio": f"file://{p}"}})[0]["type"] == "session.updated"
    # change after first audio delta
    d.send({"type": "session.update", "session": {"ref_audio": url}})
    d.speak()
    assert d.send({"type": "session.update", "session": {"ref_audio": url}})[0]["type"] == "session.updated"
    e = d.send({"type": "session.update", "session": {"ref_audio": _wav_data_url(x[:20000], 16000)}})
    assert e[0]["error"]["code"] == "ref_audio_update_unsupported"
    assert d.speak()[-1]["type"] == "response.done"


# ---------------------------------------------------------------------------------------- limits / parser


def test_size_limit_and_parser_fuzz():
    d = Driver(limits=SessionLimits(max_event_bytes=1000))
    big = json.dumps({"type": "input_audio_buffer.append", "event_id": "big", "audio": "A" * 2000})
    new = d.send(big)
    assert [e["error"]["code"] for e in new] == ["event_too_large"] and new[0]["error"]["event_id"] == "big"
    for raw, code in (('{"type":"nope","event_id":"u"}', "unknown_event"), ('{"type":"session.upd', "invalid_json"),
                      ("[1,2]", "invalid_json"), (b"\xff\xfe", "invalid_json"),
                      ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "bad_audio"),
                      ({"type": "input_audio_buffer.append"}, "bad_event")):
        new = d.send(raw)
        assert [e["error"]["code"] for e in new] == [code], raw
    assert d.send({"type": "session.heartbeat"})[0]["type"] == "session.heartbeat_ack"
    assert d.s.epoch == 0 and not d.s.conv.items()


def test_heartbeat_close_and_timeout():
    d = Driver()
    assert d.send({"type": "session.event_ack"}) == []
    d.speak(end=False)
    new = d.send({"type": "close"})
    assert d.types(new)[-2:] == ["response.done", "session.closed"] and new[-1].code == 1000
    assert d.of("session.closed")[0]["reason"] == "client_close"
    d2 = Driver(limits=SessionLimits(idle_timeout_s=1))
    assert d2.tick(999) == []
    new = d2.tick(1)
    assert d2.types(new) == ["session.closed"] and new[-1].code == 1000 and d2.of("session.closed")[0]["reason"] == "timeout"


def test_transition_table_is_total():
    for phase in Phase:
        assert set(TRANSITIONS[phase]) == set(TEvent)
