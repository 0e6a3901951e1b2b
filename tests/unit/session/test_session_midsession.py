"""Mid-session instructions and text items, ignored-field warnings and the wire naming of error codes
(docs/protocol.md §4.1 "Instructions after the first unit", §4.2, §9 "Which code is sent")."""

from __future__ import annotations

import numpy as np
import pytest

from duplexkit.engine.api import AppendUnit, Decision, UpdateStream
from duplexkit.errors import (
    OPENAI_ERROR_CODES,
    DuplexError,
    ErrorCode,
    canonical_error_code,
    wire_error_code,
)
from duplexkit.session import SessionConfig
from duplexkit.session.tools import decider_messages

from _driver import Driver, fixture_audio


def _speech(seconds: float) -> np.ndarray:
    return fixture_audio("question_16k.wav")[: int(16000 * seconds)]


def _updates(new) -> list[UpdateStream]:
    return [c for c in new if isinstance(c, UpdateStream)]


def _decide_listen(d: Driver) -> list:
    """The engine decides ``listen`` for every appended unit not yet decided."""
    new = []
    for u in [u for u, _ in list(d.s.input._inflight)]:  # noqa: SLF001 (the units the engine owes a decision)
        new += d.engine(Decision(d.sid, d.s.epoch, u, decision="listen"))
    return new


def test_instructions_before_first_unit_apply_at_once():
    d = Driver()
    new = d.send({"type": "session.update", "session": {"instructions": "Be brief."}})
    (up,) = _updates(new)
    assert up.config.instructions == "Be brief." and not d.of("session.warning", new)


def test_instructions_mid_turn_wait_for_the_turn_boundary():
    d = Driver()
    d.send({"type": "session.update", "session": {"instructions": "A", "turn_detection": None}})
    d.append(_speech(1.1))
    d.speak(end=False)  # the model is speaking: an assistant turn is open
    new = d.send({"type": "session.update", "session": {"instructions": "B", "temperature": 0.3}})
    assert d.of("session.updated", new)[0]["session"]["instructions"] == "B"  # accepted, echoed at once
    (w,) = d.of("session.warning", new)
    assert w["code"] == "instructions_reprefill" and w["param"] == "session.instructions"
    (up,) = _updates(new)  # the temperature goes at once, with the prefix the engine already has
    assert up.config.temperature == 0.3 and up.config.instructions == "A"
    assert not _updates(d.tick(1500))  # still speaking
    d.append(_speech(1.0))  # a unit goes out while the turn is open
    assert not _updates(_decide_listen(d))  # the response is still active
    from duplexkit.engine.api import TurnEnd
    ended = d.engine(TurnEnd(d.sid, d.s.epoch, d.last_unit()))
    assert d.of("response.done", ended)
    (up,) = _updates(ended)  # the boundary: no response, nothing in flight
    assert up.config.instructions == "B" and up.config.temperature == 0.3
    # the next units come after it: the engine re-prefills before them
    d.append(_speech(1.0))
    units = [i for i, c in enumerate(d.cmds) if isinstance(c, AppendUnit)]
    assert units[-1] > d.cmds.index(up)
    assert not d.of("session.warning", d.send({"type": "session.update", "session": {"instructions": "C"}}))  # once


def test_reprefill_carries_the_conversation_as_text():
    from duplexkit.engine.api import TurnEnd

    d = Driver()
    d.send({"type": "session.update", "session": {"instructions": "A", "turn_detection": None}})
    d.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "seeded"}]}})
    d.append(_speech(1.1))
    d.send({"type": "input_audio_buffer.commit"})
    d.tick(100)
    _decide_listen(d)
    d.speak(["Hello ", "there."], end=False)
    done = d.of("response.done", d.engine(TurnEnd(d.sid, d.s.epoch, d.last_unit())))[0]["response"]
    d.send({"type": "playback.ack", "response_id": done["id"], "played_ms": 5000})  # heard in full
    d.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "I typed this."}]}})
    _decide_listen(d)
    (up,) = _updates(d.send({"type": "session.update", "session": {"instructions": "B"}}))
    head, history = up.config.instructions.split("\n\n", 1)
    assert head == "B" and up.config.seed_text == "seeded"
    assert history.splitlines() == [
        "The conversation so far (a text transcript of what was said and heard before these instructions took "
        "effect, not the audio):",
        "User: [the user spoke; no transcript]", "Assistant: Hello there.", "User: I typed this."]
    # the settings (and the echo) keep the client's text; a resend of it changes nothing
    assert d.s.settings.instructions == "B"
    (up2,) = _updates(d.send({"type": "session.update", "session": {"instructions": "B", "temperature": 0.5}}))
    assert up2.config.instructions == up.config.instructions and up2.config.temperature == 0.5  # no new prefix


def test_history_keeps_the_most_recent_lines():
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    d.append(_speech(1.1))
    _decide_listen(d)
    for i in range(200):
        d.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": f"line {i:03d} " + "x" * 30}]}})
    text = d.s.opts._history_text()  # noqa: SLF001
    assert len(text) <= 4000 + 200 and text.splitlines()[-1].startswith("User: line 199")
    assert "line 000" not in text
    d.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "y" * 9000 + "END"}]}})
    last = d.s.opts._history_text().splitlines()  # noqa: SLF001
    assert len(last) == 2 and last[1].endswith("END") and len(last[1]) == 4000


def test_instructions_wait_for_decisions_in_flight():
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    d.append(_speech(1.1))
    assert d.s.input._inflight  # noqa: SLF001: unit 0 awaits its decision
    new = d.send({"type": "session.update", "session": {"instructions": "B"}})
    assert not _updates(new)
    got = _decide_listen(d)
    (up,) = _updates(got)
    assert up.config.instructions == "B"


def test_units_forced_to_listen_do_not_hold_instructions_back():
    # answer policy on_request (the compat default): a unit outside a requested response is forced
    # to listen, so it cannot open a turn ahead of the re-prefill: no need to wait for its decision
    d = Driver(SessionConfig(profile="compat"))
    d.send({"type": "session.update", "session": {"turn_detection": None, "input_audio_format": "pcm16",
                                                  "sample_rate_hz": 16000}})
    d.append(_speech(1.1))
    assert d.s.input._inflight and all(c.force_listen for c in d.cmds if isinstance(c, AppendUnit))  # noqa: SLF001
    (up,) = _updates(d.send({"type": "session.update", "session": {"instructions": "B"}}))
    assert up.config.instructions == "B"


def test_system_item_after_first_unit_is_reprefilled_and_user_text_goes_to_history():
    d = Driver()
    d.send({"type": "session.update", "session": {"instructions": "Base.", "turn_detection": None}})
    d.append(_speech(1.1))
    _decide_listen(d)
    new = d.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "system", "content": [{"type": "input_text", "text": "Speak French."}]}})
    assert d.types(new)[:2] == ["conversation.item.added", "conversation.item.done"]
    assert d.of("session.warning", new)[0]["code"] == "instructions_reprefill"
    (up,) = _updates(new)  # at a boundary already: sent at once
    assert up.config.instructions == "Base.\nSpeak French."
    new = d.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "My name is Ada."}]}})
    assert d.types(new) == ["conversation.item.added", "conversation.item.done", "session.warning"]
    assert d.of("session.warning", new)[0]["code"] == "text_item_not_heard" and not _updates(new)
    new = d.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]}})
    item = d.of("conversation.item.done", new)[0]["item"]
    assert item["role"] == "assistant" and item["content"] == [{"type": "output_text", "text": "Hello Ada."}]
    assert [w["param"] for w in d.of("session.warning", new)] == ["item.assistant"]  # its own field
    # the tool decider's conversation (docs/tools.md): system, user and assistant text, in order
    msgs = [(m.role, m.content[0]) for m in decider_messages(d.s.settings.instructions, d.s.conv.items(), d.s.conv.truth_text, None)]  # noqa: SLF001
    assert msgs[0] == ("system", "Base.")
    assert msgs[-3:] == [("system", "Speak French."), ("user", "My name is Ada."), ("assistant", "Hello Ada.")]
    hist = d.s.history()
    assert [h["role"] for h in hist][-3:] == ["system", "user", "assistant"]


def test_assistant_audio_without_audio_bytes_is_text():
    d = Driver()
    new = d.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "assistant", "content": [{"type": "audio", "transcript": "Earlier answer."}]}})
    assert d.of("conversation.item.added", new)[0]["item"]["content"][0]["text"] == "Earlier answer."
    e = d.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "assistant", "content": [{"type": "output_audio", "audio": "AAAA"}]}})
    assert e[0]["error"]["code"] == "bad_event" and e[0]["error"]["param"] == "item.content.0.audio"


def test_compat_profile_sends_no_session_warning_but_applies():
    d = Driver(SessionConfig(profile="compat"))
    d.send({"type": "session.update", "session": {"input_audio_format": "pcm16", "sample_rate_hz": 16000}})
    d.append(_speech(1.1))
    assert d.s.input._units_appended > 0  # noqa: SLF001: after the first unit
    new = d.send({"type": "session.update", "session": {"instructions": "B",
                                                        "audio": {"input": {"noise_reduction": {"type": "near_field"}}}}})
    assert d.types(new) == ["session.updated"] and new[0]["session"]["instructions"] == "B"
    assert "session.warning" not in d.types()


@pytest.mark.parametrize("session,params", [
    ({"audio": {"input": {"noise_reduction": {"type": "far_field"}}}}, ["session.audio.input.noise_reduction"]),
    ({"input_audio_noise_reduction": {"type": "near_field"}, "tracing": "auto", "speed": 1.2},
     ["session.input_audio_noise_reduction", "session.speed", "session.tracing"]),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 6000}}}},
     ["session.audio.input.turn_detection.idle_timeout_ms"]),
    ({"truncation": "disabled", "include": ["item.input_audio_transcription.logprobs"], "prompt": {"id": "pmpt_1"}},
     ["session.include", "session.prompt", "session.truncation"]),
    # values that ask for nothing this server lacks: no warning
    ({"input_audio_noise_reduction": None, "truncation": "auto", "speed": 1.0, "include": [], "tracing": None,
      "model": "gpt-realtime", "audio": {"input": {"noise_reduction": None}, "output": {"speed": 1}}}, []),
])
def test_ignored_fields_get_one_warning_each(session, params):
    d = Driver()
    new = d.send({"type": "session.update", "session": session})
    ws = d.of("session.warning", new)
    assert sorted(w["param"] for w in ws) == params and all(w["code"] == "field_ignored" for w in ws)
    assert d.of("session.updated", new)  # accepted
    assert not d.of("session.warning", d.send({"type": "session.update", "session": session}))  # once per field


def test_response_fields_not_honoured_are_warned_once():
    d = Driver()
    new = d.send({"type": "response.create", "response": {"instructions": "Say hi.", "audio": {"output": {"voice": "ash"}},
                                                          "metadata": {"k": "v"}}})
    ws = d.of("session.warning", new)
    assert [w["param"] for w in ws] == ["response.instructions", "response.audio.output.voice"]
    assert all(w["code"] == "field_ignored" for w in ws)
    assert d.of("response.created", new)[0]["response"]["metadata"]["ignored_fields"] == "instructions,audio.output.voice"
    d.send({"type": "response.cancel"})
    new = d.send({"type": "response.create", "response": {"instructions": "Again.", "input": []}})
    assert [w["param"] for w in d.of("session.warning", new)] == ["response.input"]  # the others: once per session
    d.send({"type": "response.cancel"})
    assert not d.of("session.warning", d.send({"type": "response.create", "response": {"instructions": None}}))


def _three_errors(d: Driver) -> list[str]:
    codes = []
    d.append(_speech(0.05))
    codes.append(d.send({"type": "input_audio_buffer.commit"})[-1]["error"]["code"])
    codes.append(d.send({"type": "response.cancel"})[-1]["error"]["code"])
    d.send({"type": "response.create"})
    codes.append(d.send({"type": "response.create"})[-1]["error"]["code"])
    for t in ("conversation.item.retrieve", "conversation.item.delete", "conversation.item.truncate"):
        ev = {"type": t, "item_id": "item_nope"}
        if t.endswith("truncate"):
            ev.update(content_index=0, audio_end_ms=0)
        codes.append(d.send(ev)[-1]["error"]["code"])
    codes.append(d.send({"type": "nope"})[-1]["error"]["code"])
    d.s.receive_binary_frame(d.t)
    codes.append(d.pump()[-1]["error"]["code"])
    return codes


def test_error_codes_per_profile():
    openai = ["input_audio_buffer_commit_empty", "response_cancel_not_active",
              "conversation_already_has_active_response", "item_retrieve_invalid_item_id",
              "item_delete_invalid_item_id", "item_truncate_invalid_item_id", "invalid_value", "invalid_event"]
    own = ["input_audio_buffer_empty", "response_not_active", "response_already_active", "item_not_found",
           "item_not_found", "item_not_found", "unknown_event", "bad_event"]
    assert _three_errors(Driver(SessionConfig(profile="compat"))) == openai
    assert _three_errors(Driver(SessionConfig(profile="duplex"))) == own
    assert _three_errors(Driver(SessionConfig(profile="duplex", error_codes="openai"))) == openai
    assert _three_errors(Driver(SessionConfig(profile="compat", error_codes="duplexkit"))) == own


def test_error_code_table_round_trip():
    for ec in ErrorCode:
        assert wire_error_code(ec, "duplexkit") == ec.value
        oc = wire_error_code(ec, "openai")
        assert oc == OPENAI_ERROR_CODES.get(ec, ec.value)
        if oc != "invalid_value":  # shared by several codes: kept as sent
            assert canonical_error_code(oc) == ec.value
    assert canonical_error_code("item_truncate_invalid_item_id") == "item_not_found"
    assert canonical_error_code("invalid_value") == "invalid_value"
    err = DuplexError.from_event({"type": "error", "error": {"type": "invalid_request_error",
                                                             "code": "response_cancel_not_active", "message": "x"}})
    assert err.code == "response_not_active" and err.wire_code == "response_cancel_not_active"
    with pytest.raises(ValueError):
        wire_error_code(ErrorCode.BAD_EVENT, "klingon")
    with pytest.raises(ValueError):
        SessionConfig(error_codes="klingon")
