"""Tools and user transcripts in the sans-I/O Session (docs/tools.md), driven by real client events,
the speech fixtures and emulated engine / decider outputs; every event stream is checked by the §12
checker (rule 15 covers function calls)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from duplexkit.engine.api import (
    AppendUnit,
    CancelEpoch,
    DecideTools,
    SpeakText,
    ToolCall,
    ToolDecision,
    TranscribeAudio,
    Transcription,
)
from duplexkit.session import SessionConfig
from duplexkit.session.tools import DEFAULT_TOOL_FILLER, TOOL_DECISION_TIMEOUT_MS

from _driver import Driver, fixture_audio

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                            "unit": {"type": "string", "enum": ["C", "F"]}},
                          "required": ["city"], "additionalProperties": False}}
NOTE = {"type": "function", "function": {"name": "add_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


def _session(**update) -> Driver:
    d = Driver()
    d.send({"type": "session.update", "session": {"tools": [WEATHER], **update}})
    return d


def _turn(d: Driver, seconds: float = 1.5) -> list:
    """A user turn of real speech, ended by a client commit."""
    new = d.append(fixture_audio("question_16k.wav")[: int(16000 * seconds)])
    return new + d.send({"type": "input_audio_buffer.commit"})


def _decide(d: Driver, *calls: ToolCall, text: str = "", error=None) -> list:
    ask = [c for c in d.cmds if isinstance(c, DecideTools)][-1]
    return d.engine(ToolDecision(d.sid, d.s.epoch, -1, request_id=ask.request_id, calls=tuple(calls), text=text,
                                 error=error))


def test_user_turn_asks_the_decider_with_its_audio_and_holds_the_model():
    d = _session(instructions="Be brief.")
    new = _turn(d)
    asks = d.cmds_of(DecideTools, new)
    assert len(asks) == 1
    ask = asks[0]
    assert ask.tool_choice == "auto" and [t["name"] for t in ask.tools] == ["get_weather"]
    assert ask.messages[0].role == "system" and ask.messages[0].content == ["Be brief."]
    audio = ask.messages[-1].content[0]
    assert ask.messages[-1].role == "user" and audio.dtype == np.float32 and 20000 <= audio.size <= 24000 + 160
    # the gate: every unit while the decision is pending is a forced listen
    d.tick(30)
    new = d.append(np.zeros(32000, np.float32))
    units = d.cmds_of(AppendUnit, new)
    assert units and all(u.force_listen for u in units)
    # no call: the gate opens (once the VAD has heard the speech end), the model decides as usual again
    _decide(d)
    units = d.cmds_of(AppendUnit, d.append(np.zeros(32000, np.float32)))
    assert units and not units[-1].force_listen


def test_gate_covers_the_users_speech_and_the_commits_closing_unit():
    d = _session()
    new = d.append(fixture_audio("question_16k.wav"))  # server VAD: speech started, not stopped yet
    assert d.of("input_audio_buffer.speech_started", new)
    assert all(u.force_listen for u in d.cmds_of(AppendUnit, new)[1:])
    new = d.send({"type": "input_audio_buffer.commit"})
    d.tick(50)
    closing = [c for c in d.cmds if isinstance(c, AppendUnit)][-1]
    assert closing.force_listen  # the early-closed last unit of the turn is already held
    # without tools nothing is held
    d2 = Driver()
    new = d2.append(fixture_audio("question_16k.wav"))
    assert not any(u.force_listen for u in d2.cmds_of(AppendUnit, new))


def test_a_call_supersedes_an_answer_the_model_began_on_its_own():
    d = _session(tool_filler="")
    d.append(fixture_audio("question_16k.wav")[:24000])  # the user speaks (the VAD starts)
    d.speak(["Hmm "], end=False)  # a unit submitted before the gate closed decides to speak: the model's own response
    own = d.s.active_response_id
    d.send({"type": "input_audio_buffer.commit"})
    new = _decide(d, ToolCall("get_weather", '{"city": "Paris"}'))
    done = d.of("response.done", new)
    assert done[0]["response"]["id"] == own and done[0]["response"]["status"] == "cancelled"
    assert done[1]["response"]["output"][0]["type"] == "function_call"
    assert any(isinstance(c, CancelEpoch) for c in new)


def test_call_is_a_response_of_function_call_items_then_a_filler_speaks():
    d = _session()
    _turn(d)
    new = _decide(d, ToolCall("get_weather", '{"city": "Paris"}'))
    types = d.types(new)
    assert types[:8] == ["response.created", "conversation.item.added", "response.output_item.added",
                         "response.function_call_arguments.delta", "response.function_call_arguments.done",
                         "response.output_item.done", "conversation.item.done", "response.done"]
    done = d.of("response.done", new)[0]["response"]
    assert done["status"] == "completed" and done["trigger"] == "tool"
    (call,) = done["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")
    assert d.of("response.function_call_arguments.done", new)[0]["call_id"] == call["call_id"]
    # the filler: a second response spoken by SpeakText in the session's voice
    assert types[8] == "response.created" and d.of("response.created", new)[1]["response"]["trigger"] == "filler"
    (speak,) = d.cmds_of(SpeakText, new)
    assert speak.text == DEFAULT_TOOL_FILLER and speak.epoch == d.s.epoch
    # an early unit close carries it at once (not at the next 1-s boundary), after the SpeakText
    (unit,) = d.cmds_of(AppendUnit, new)
    assert unit.force_speak and new.index(speak) < new.index(unit)
    # while the call waits for its output and the filler is over, the model is held
    d.speak([DEFAULT_TOOL_FILLER])
    assert d.s.active_response_id is None
    units = d.cmds_of(AppendUnit, d.append(np.zeros(32000, np.float32)))
    assert units and all(u.force_listen for u in units)


def test_output_then_response_create_speaks_the_decider_answer():
    d = _session(tool_filler="")
    _turn(d)
    new = _decide(d, ToolCall("get_weather", '{"city": "Paris", "unit": "C"}'))
    assert d.cmds_of(SpeakText, new) == []  # filler off
    call_id = d.of("response.done", new)[0]["response"]["output"][0]["call_id"]
    new = d.send({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": call_id,
                                                               "output": '{"temp_c": 21}'}})
    added = d.of("conversation.item.added", new)[0]["item"]
    assert added["type"] == "function_call_output" and added["call_id"] == call_id and added["output"] == '{"temp_c": 21}'
    new = d.send({"type": "response.create"})
    rid = d.of("response.created", new)[0]["response"]["id"]
    (ask,) = d.cmds_of(DecideTools, new)
    assert ask.tool_choice == "none" and ask.tools == ()
    texts = [p for m in ask.messages for p in m.content if isinstance(p, str)]
    assert any("<tool_call>" in t and "get_weather" in t for t in texts)
    assert any("<tool_response>" in t and "temp_c" in t for t in texts)
    # no forced unit before the answer text is known
    assert not any(isinstance(c, AppendUnit) and c.force_speak for c in new)
    new = _decide(d, text="It is 21 degrees in Paris.")
    (speak,) = d.cmds_of(SpeakText, new)
    assert speak.text == "It is 21 degrees in Paris."
    d.speak(["It is 21 degrees ", "in Paris."])
    done = d.of("response.done")[-1]["response"]
    assert done["id"] == rid and done["status"] == "completed"
    assert done["output"][0]["content"][0]["transcript"] == "It is 21 degrees in Paris."


def test_required_response_create_decides_first_and_named_choice_is_passed():
    d = _session(tool_filler="")
    d.send({"type": "session.update", "session": {"tools": [WEATHER, NOTE]}})
    _turn(d)
    _decide(d)  # the turn's own decision: no call
    new = d.send({"type": "response.create", "response": {"tool_choice": {"type": "function", "name": "add_note"}}})
    (ask,) = d.cmds_of(DecideTools, new)
    assert ask.tool_choice == {"type": "function", "name": "add_note"}
    assert isinstance(ask.messages[-1].content[0], np.ndarray)  # the last turn's audio
    assert not any(isinstance(c, AppendUnit) and c.force_speak for c in new)
    new = _decide(d, ToolCall("add_note", '{"text": "milk"}'))
    assert d.of("response.done", new)[0]["response"]["output"][0]["name"] == "add_note"


def test_no_call_releases_a_waiting_response_as_a_forced_unit():
    d = _session()
    _turn(d)
    _decide(d)
    d.send({"type": "session.update", "session": {"tool_choice": "required"}})
    new = d.send({"type": "response.create"})
    assert d.cmds_of(DecideTools, new)
    new = _decide(d)  # the decider found nothing (it failed the 'required' contract): the model answers
    units = d.cmds_of(AppendUnit, new)
    assert len(units) == 1 and units[0].force_speak


def test_invalid_and_unknown_calls_are_dropped_with_a_warning():
    d = _session()
    _turn(d)
    new = _decide(d, ToolCall("get_weather", '{"city": 7}'), ToolCall("launch", "{}"),
                  ToolCall("get_weather", '{"city": "Oslo", "unit": "K"}'), ToolCall("get_weather", "{oops"))
    warns = [w["code"] for w in d.of("session.warning", new)]
    assert warns == ["tool_call_invalid"] * 4
    assert d.of("response.created", new) == []
    units = d.cmds_of(AppendUnit, d.append(np.zeros(32000, np.float32)))
    assert units and not units[-1].force_listen


def test_function_call_output_errors_keep_the_session():
    d = _session(tool_filler="")
    _turn(d)
    call_id = d.of("response.done", _decide(d, ToolCall("get_weather", '{"city": "Rome"}')))[0]["response"]["output"][0]["call_id"]

    def out(cid, output="ok", **kw):
        return d.send({"type": "conversation.item.create",
                       "item": {"type": "function_call_output", "call_id": cid, "output": output, **kw}})

    def code(new):
        return [e["error"]["code"] for e in d.of("error", new)]

    assert code(out("call_nope")) == ["call_not_found"]
    assert code(d.send({"type": "conversation.item.create", "item": {"type": "function_call_output", "output": "x"}})) == ["bad_event"]
    assert code(d.send({"type": "conversation.item.create",
                        "item": {"type": "function_call_output", "call_id": call_id}})) == ["bad_event"]
    assert code(out(call_id, "x" * (64 * 1024 + 1))) == ["bad_event"]
    assert code(out(call_id)) == []
    assert code(out(call_id)) == ["call_already_answered"]
    # a deleted function_call item cancels its call; a late output is refused
    _turn(d)
    new = _decide(d, ToolCall("get_weather", '{"city": "Lima"}'))
    item = d.of("response.done", new)[0]["response"]["output"][0]
    d.send({"type": "conversation.item.delete", "item_id": item["id"]})
    assert code(out(item["call_id"])) == ["call_cancelled"]
    assert not d.s.closed


def test_tool_warnings_are_logged_not_sent_in_the_compat_profile(caplog):
    # unmodified OpenAI clients reject event types they do not know (docs/protocol.md §4.1)
    d = Driver(SessionConfig(profile="compat"))
    d.send({"type": "session.update", "session": {"tools": [WEATHER], "turn_detection": None}})
    _turn(d)
    with caplog.at_level("INFO", logger="duplexkit.session"):
        new = d.tick(TOOL_DECISION_TIMEOUT_MS + 10)
    assert d.of("session.warning", new) == [] and d.of("error", new) == []
    assert "tool_decision_timeout" in caplog.text
    assert not d.s.closed


def test_decision_timeout_warns_and_drops_the_late_answer():
    d = _session()
    _turn(d)
    new = d.tick(TOOL_DECISION_TIMEOUT_MS + 10)
    assert [w["code"] for w in d.of("session.warning", new)] == ["tool_decision_timeout"]
    new = _decide(d, ToolCall("get_weather", '{"city": "Paris"}'))
    assert d.of("response.created", new) == []


def test_barge_in_over_the_filler_cancels_it_and_a_queued_create_runs_after():
    d = _session(turn_detection={"type": "server_vad"})
    d.send({"type": "input_audio_buffer.clear"})
    _turn(d, 1.0)
    new = _decide(d, ToolCall("get_weather", '{"city": "Paris"}'))
    call_id = d.of("response.done", new)[0]["response"]["output"][0]["call_id"]
    filler_id = d.s.active_response_id
    d.send({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": call_id,
                                                         "output": "sunny"}})
    new = d.send({"type": "response.create"})  # while the filler speaks: queued, no error
    assert d.of("error", new) == [] and d.of("response.created", new) == []
    d.append(np.zeros(16000, np.float32))  # the question's speech ends (the VAD stops)
    e0 = d.s.epoch
    d.append(fixture_audio("interrupt_16k.wav"))  # the user talks over the filler
    assert d.s.epoch > e0 and any(isinstance(c, CancelEpoch) for c in d.cmds)
    done = [e["response"] for e in d.of("response.done") if e["response"]["id"] == filler_id]
    assert done and done[0]["status"] == "cancelled"
    # the queued response.create started when the filler ended; it speaks the tool result
    created = d.of("response.created")[-1]["response"]
    assert created["id"] != filler_id and created["trigger"] == "client"
    assert [c for c in d.cmds if isinstance(c, DecideTools)][-1].tool_choice == "none"


def test_transcription_of_each_user_turn():
    d = Driver()
    new = d.send({"type": "session.update", "session": {"audio": {"input": {"transcription": {"model": "whisper-1",
                                                                                            "language": "en"}}}}})
    w = d.of("session.warning", new)
    assert w == []  # an OpenAI model name is served by the default silently (unmodified clients reject unknown events)
    s = d.of("session.updated", new)[0]["session"]
    assert s["audio"]["input"]["transcription"] == {"model": "whisper-1", "language": "en"}
    new = _turn(d, 1.2)
    (tr,) = d.cmds_of(TranscribeAudio, new)
    item_id = d.of("input_audio_buffer.committed", new)[0]["item_id"]
    assert tr.item_id == item_id and tr.model == "minicpm-o" and tr.language == "en"
    assert tr.audio.dtype == np.float32 and abs(tr.audio.size - 19200) <= 160
    assert d.cmds_of(DecideTools, new) == []  # no tools: no decision
    new = d.engine(Transcription(d.sid, d.s.epoch + 3, -1, item_id=item_id, text="what is the weather"))
    assert d.types(new) == ["conversation.item.input_audio_transcription.delta",
                            "conversation.item.input_audio_transcription.completed"]
    assert d.of("conversation.item.input_audio_transcription.completed", new)[0]["transcript"] == "what is the weather"
    d.send({"type": "conversation.item.retrieve", "item_id": item_id})
    got = d.of("conversation.item.retrieved")[-1]["item"]
    assert got["content"] == [{"type": "input_audio", "transcript": "what is the weather"}]
    # a failure is reported per item; the session goes on
    new = _turn(d, 1.0)
    (tr,) = d.cmds_of(TranscribeAudio, new)
    new = d.engine(Transcription(d.sid, d.s.epoch, -1, item_id=tr.item_id, error="recogniser crashed"))
    (f,) = d.of("conversation.item.input_audio_transcription.failed", new)
    assert f["item_id"] == tr.item_id and f["error"]["message"] == "recogniser crashed"
    # the next decision sees the transcript as text
    d.send({"type": "session.update", "session": {"tools": [WEATHER], "audio": {"input": {"transcription": None}}}})
    new = _turn(d, 1.0)
    assert d.cmds_of(TranscribeAudio, new) == []
    (ask,) = d.cmds_of(DecideTools, new)
    assert ["what is the weather"] in [m.content for m in ask.messages if m.role == "user"]


@pytest.mark.parametrize("profile", ["duplex", "compat"])
def test_server_vad_turn_with_create_response_waits_for_the_decision(profile):
    d = Driver(SessionConfig(profile=profile))
    d.send({"type": "session.update", "session": {"tools": [WEATHER], "tool_filler": "",
                                                  "turn_detection": {"type": "server_vad", "create_response": True}}})
    d.append(fixture_audio("question_16k.wav"))
    d.append(np.zeros(16000, np.float32))
    created = d.of("response.created")
    assert len(created) == 1 and created[0]["response"]["trigger"] == "server_vad"
    assert not any(isinstance(c, AppendUnit) and c.force_speak for c in d.cmds)
    new = _decide(d, ToolCall("get_weather", '{"city": "Paris"}'))
    done = d.of("response.done", new)[0]["response"]
    assert done["id"] == created[0]["response"]["id"] and done["output"][0]["type"] == "function_call"


def test_progress_line_while_a_slow_tool_runs():
    d = _session(tool_filler="", tool_progress={"after_ms": 2000, "text": "Still checking."})
    _turn(d)
    d.append(np.zeros(16000, np.float32))  # the VAD hears the speech end
    new = _decide(d, ToolCall("get_weather", '{"city": "Paris"}'))
    call_id = d.of("response.done", new)[0]["response"]["output"][0]["call_id"]
    assert d.cmds_of(SpeakText, d.tick(1000)) == []
    new = d.tick(1100)
    (speak,) = d.cmds_of(SpeakText, new)
    assert speak.text == "Still checking." and d.of("response.created", new)[0]["response"]["trigger"] == "progress"
    d.send({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": call_id,
                                                         "output": "sunny"}})
    new = d.send({"type": "response.create"})  # queued behind the progress line
    assert d.of("error", new) == [] and d.of("response.created", new) == []
    d.speak(["Still checking."])
    assert d.of("response.created")[-1]["response"]["trigger"] == "client"
    # answered: no more progress lines
    d.speak(["Sunny."])
    assert d.cmds_of(SpeakText, d.tick(5000)) == []
    errs = [e["error"]["code"] for e in d.of("error", d.send({"type": "session.update", "session": {
        "tool_progress": {"after_ms": 10}}}))]
    assert errs == ["bad_event"]


def test_a_call_never_answered_stops_holding_the_model():
    from duplexkit.session.tools import TOOL_OUTPUT_WAIT_MS

    d = _session(tool_filler="", tool_progress=None)
    _turn(d)
    d.append(np.zeros(16000, np.float32))
    new = _decide(d, ToolCall("get_weather", '{"city": "Paris"}'))
    call_id = d.of("response.done", new)[0]["response"]["output"][0]["call_id"]
    assert d.s.tools.gate()
    new = d.tick(TOOL_OUTPUT_WAIT_MS + 100)
    assert [w["code"] for w in d.of("session.warning", new)] == ["tool_output_timeout"]
    assert not d.s.tools.gate()
    units = d.cmds_of(AppendUnit, d.append(np.zeros(16000, np.float32)))
    assert units and not units[-1].force_listen
    new = d.send({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": call_id,
                                                               "output": "late"}})
    assert d.of("error", new) == [] and d.of("conversation.item.added", new)


def test_a_streamed_answer_is_spoken_piece_by_piece_in_one_response():
    d = _session(tool_filler="")
    _turn(d)
    d.append(np.zeros(16000, np.float32))
    call_id = d.of("response.done", _decide(d, ToolCall("get_weather", '{"city": "Oslo"}')))[0]["response"]["output"][0]["call_id"]
    d.send({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": call_id,
                                                         "output": "3 C, snow"}})
    rid = d.of("response.created", d.send({"type": "response.create"}))[0]["response"]["id"]
    ask = [c for c in d.cmds if isinstance(c, DecideTools)][-1]

    def piece(text, final=False):
        return d.engine(ToolDecision(d.sid, d.s.epoch, -1, request_id=ask.request_id, text=text, final=final))

    assert d.cmds_of(SpeakText, piece("It is ")) == []  # not enough to read well yet
    new = piece("three degrees in Oslo")
    (s1,) = d.cmds_of(SpeakText, new)
    assert s1.text == "It is three degrees in"  # four whole words: the first piece starts the audio early
    (u,) = d.cmds_of(AppendUnit, new)
    assert u.force_speak  # it rides an early-closed unit
    d.speak(["It is three degrees in"])  # the engine speaks piece 1 and ends its model turn
    assert d.s.active_response_id == rid  # ... but the answer goes on
    new = piece(" with snow. Take a")
    (s2,) = d.cmds_of(SpeakText, new)
    assert s2.text == " Oslo with snow." and d.cmds_of(AppendUnit, new) == []  # queued behind, up to the sentence mark
    new = piece(" coat.", final=False) + piece("It is three degrees in Oslo with snow. Take a coat.", final=True)
    (s3,) = d.cmds_of(SpeakText, new)
    assert s3.text == " Take a coat."
    d.speak([" Oslo with snow."])
    assert d.s.active_response_id == rid
    d.speak([" Take a coat."])
    done = d.of("response.done")[-1]["response"]
    assert done["id"] == rid and done["status"] == "completed"
    assert done["output"][0]["content"][0]["transcript"] == "It is three degrees in Oslo with snow. Take a coat."
    assert d.s.active_response_id is None


def test_a_barge_in_during_a_streamed_answer_drops_the_rest():
    d = _session(tool_filler="")
    _turn(d)
    d.append(np.zeros(16000, np.float32))
    call_id = d.of("response.done", _decide(d, ToolCall("get_weather", '{"city": "Oslo"}')))[0]["response"]["output"][0]["call_id"]
    d.send({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": call_id,
                                                         "output": "snow"}})
    d.send({"type": "response.create"})
    ask = [c for c in d.cmds if isinstance(c, DecideTools)][-1]
    d.engine(ToolDecision(d.sid, d.s.epoch, -1, request_id=ask.request_id, text="It is snowing in Oslo today. ",
                          final=False))
    d.speak(["It is snowing"], end=False)
    d.append(fixture_audio("interrupt_16k.wav"))  # barge-in
    assert d.of("response.done")[-1]["response"]["status"] == "cancelled"
    new = d.engine(ToolDecision(d.sid, d.s.epoch, -1, request_id=ask.request_id, text="More text. ", final=False))
    new += d.engine(ToolDecision(d.sid, d.s.epoch, -1, request_id=ask.request_id, text="x", final=True))
    assert d.cmds_of(SpeakText, new) == [] and d.of("response.created", new) == []
