"""Tools during a conversation (docs/tools.md) with the unmodified OpenAI Python SDK against a
real ``duplexkit serve scripted`` process: the function-calling flow end to end (session.update with
tools, speech, the call, the output, the spoken answer), its error rules over the wire, and user
transcripts for ``whisper-1``; every event validated by the SDK's typed models (GA, and beta where
noted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _timing import bound

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

pytest.importorskip("openai")
pytest.importorskip("jsonschema")

from _serverproc import ServerProc  # noqa: E402
from openai_sdk_tools import (  # noqa: E402
    FILLER, WEATHER_TOOL, Recorder, beta_adapter, check_call_response, check_spoken_response, ga_adapter,
    speak, split_responses, trigger,
)
from openai_sdk_turns import sdk_client  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
QUESTION = FIXTURES / "question_16k.wav"
SCRIPTED_ANSWER = "This is a scripted chat reply."  # ScriptConfig.chat_text: what the decider's answer says
GA_COMMIT = {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None}


@pytest.fixture(scope="module")
def server():
    # tool_choice "required" everywhere in this module: no tool_script, so each decision is the first
    # tool with schema-valid example arguments, whatever order the tests run in
    with ServerProc("scripted", "--scripted", "units_per_turn=2") as srv:
        yield srv


async def _call_turn(rec, conn, session_update: dict) -> tuple[dict, list]:
    """session.update, speech + commit; returns the call and the events of the call and filler responses."""
    await conn.session.update(session=session_update)
    upd = (await rec.until(lambda e: e.type == "session.updated"))[-1]
    await speak(conn, QUESTION)
    await conn.input_audio_buffer.commit()
    events = await rec.responses(2)  # the call, then the filler
    return upd, events


async def test_ga_function_call_flow(server):
    """The documented flow, every event GA-typed: the call with schema-valid arguments, the filler, the
    client's output + response.create, the spoken answer completed."""
    async with sdk_client(server.url).realtime.connect(model="gpt-realtime") as conn:
        rec = Recorder(conn, ga_adapter(), bound(30))
        assert (await rec.next()).type == "session.created"
        upd, events = await _call_turn(rec, conn, {"type": "realtime", "tools": [WEATHER_TOOL],
                                                   "tool_choice": "required", "audio": {"input": GA_COMMIT}})
        assert [t.name for t in upd.session.tools] == ["get_weather"] and upd.session.tool_choice == "required"
        types = [e.type for e in events]
        assert types[0] == "input_audio_buffer.committed", types
        user_item = next(e.item for e in events if e.type == "conversation.item.added")
        assert user_item.role == "user"
        call_resp, filler = split_responses(events)
        call = check_call_response(call_resp)
        assert call["name"] == "get_weather" and trigger(call_resp[0].response) == "tool"
        f = check_spoken_response(filler)
        assert f["trigger"] == "filler" and f["transcript"] == FILLER

        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": json.dumps({"temperature_c": 21})})
        await conn.response.create()
        ev = await rec.until(lambda e: e.type == "response.done")
        added = [e for e in ev if e.type == "conversation.item.added"]
        assert added[0].item.type == "function_call_output" and added[0].item.call_id == call["call_id"]
        answer = check_spoken_response(ev[ev.index(next(e for e in ev if e.type == "response.created")):])
        assert answer["trigger"] == "client" and answer["transcript"] == SCRIPTED_ANSWER
        assert answer["response_id"] not in (call["response_id"], f["response_id"])


async def test_ga_server_vad_turn_calls_the_tool(server):
    """The compat default server_vad ends the turn (no commit, no response.create): the call comes."""
    async with sdk_client(server.url).realtime.connect(model="gpt-realtime") as conn:
        rec = Recorder(conn, ga_adapter(), bound(30))
        first = await rec.next()
        assert first.session.audio.input.turn_detection.type == "server_vad"
        await conn.session.update(session={"type": "realtime", "tools": [WEATHER_TOOL], "tool_choice": "required"})
        await rec.until(lambda e: e.type == "session.updated")
        await speak(conn, QUESTION, silence_s=1.5)
        events = await rec.responses(2)
        types = [e.type for e in events]
        assert types.index("input_audio_buffer.speech_stopped") < types.index("input_audio_buffer.committed") \
            < types.index("response.created"), types
        call_resp, filler = split_responses(events)
        call = check_call_response(call_resp)
        assert trigger(call_resp[0].response) == "server_vad"  # the VAD's response carries the call
        assert check_spoken_response(filler)["trigger"] == "filler"
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": "sunny"})
        await conn.response.create()
        ev = await rec.until(lambda e: e.type == "response.done")
        created = next(i for i, e in enumerate(ev) if e.type == "response.created")
        assert check_spoken_response(ev[created:])["transcript"] == SCRIPTED_ANSWER


async def test_ga_after_a_greeting_a_whole_utterance_at_once_gets_only_the_clients_answer(server):
    """A greeting first, then a whole utterance and its trailing silence appended at once (what
    Pipecat and a client reading a file send), the output 0.3 s after the call: the filler rides its
    own forced unit, so no response of the model's own starts while the call waits, and the client's
    response.create is the answer (before the fix: a 'model' response after the filler, then
    conversation_already_has_active_response, 3 runs of 3)."""
    import asyncio

    async with sdk_client(server.url).realtime.connect(model="gpt-realtime") as conn:
        rec = Recorder(conn, ga_adapter(), bound(30))
        await rec.next()
        await conn.session.update(session={"type": "realtime", "tools": [WEATHER_TOOL], "tool_choice": "required"})
        await rec.until(lambda e: e.type == "session.updated")
        await conn.response.create(response={"tool_choice": "none"})  # the greeting: no call
        await rec.until(lambda e: e.type == "response.done")
        await speak(conn, QUESTION, silence_s=1.5)
        call_resp, filler = split_responses(await rec.responses(2))
        call = check_call_response(call_resp)
        assert check_spoken_response(filler)["trigger"] == "filler"
        await asyncio.sleep(0.3)
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": "sunny"})
        await conn.response.create()
        ev = await rec.until(lambda e: e.type == "response.done")
        created = [e for e in ev if e.type == "response.created"]
        assert len(created) == 1 and trigger(created[0].response) == "client", [trigger(e.response) for e in created]
        i = next(k for k, e in enumerate(ev) if e.type == "response.created")
        assert check_spoken_response(ev[i:])["transcript"] == SCRIPTED_ANSWER


async def test_ga_error_rules_keep_the_session_alive(server):
    """call_not_found, call_already_answered, invalid_tools (bad tools, bad tool_choice): each an
    ``error`` event (GA-typed) and the session goes on: a further response is spoken."""
    async with sdk_client(server.url).realtime.connect(model="gpt-realtime") as conn:
        rec = Recorder(conn, ga_adapter(), bound(30))
        await rec.next()
        _, events = await _call_turn(rec, conn, {"type": "realtime", "tools": [WEATHER_TOOL],
                                                 "tool_choice": "required", "audio": {"input": GA_COMMIT}})
        call = check_call_response(split_responses(events)[0])

        async def error_for(send) -> object:
            await send()
            return (await rec.until(lambda e: e.type == "error", errors_ok=True))[-1].error

        async def spoken_response(**response) -> dict:
            await conn.response.create(**({"response": response} if response else {}))
            ev = await rec.until(lambda e: e.type == "response.done")
            created = next(i for i, e in enumerate(ev) if e.type == "response.created")
            return check_spoken_response(ev[created:])

        err = await error_for(lambda: conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": "call_0000deadbeef", "output": "x"}))
        assert err.code == "call_not_found", err
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": "sunny"})
        await rec.until(lambda e: e.type == "conversation.item.done" and e.item.type == "function_call_output")
        err = await error_for(lambda: conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": call["call_id"], "output": "again"}))
        assert err.code == "call_already_answered", err
        assert (await spoken_response())["transcript"] == SCRIPTED_ANSWER  # the answer to the output

        bad_tools = [
            [{"type": "function", "name": "get_weather", "parameters": {"type": "string"}}],  # not an object schema
            [WEATHER_TOOL, WEATHER_TOOL],  # duplicate name
            [{"type": "function", "name": "bad name!", "parameters": {"type": "object"}}],
        ]
        for tools in bad_tools:
            err = await error_for(lambda: conn.session.update(session={"type": "realtime", "tools": tools}))
            assert err.code == "invalid_tools", (tools, err)
        err = await error_for(lambda: conn.session.update(
            session={"type": "realtime", "tool_choice": {"type": "function", "name": "no_such_tool"}}))
        assert err.code == "invalid_tools", err
        err = await error_for(lambda: conn.session.update(session={"type": "realtime", "tool_choice": "sometimes"}))
        assert err.code == "invalid_tools", err

        # nothing changed: the tools and tool_choice are still the first update's
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 512})
        upd = (await rec.until(lambda e: e.type == "session.updated"))[-1]
        assert [t.name for t in upd.session.tools] == ["get_weather"] and upd.session.tool_choice == "required"
        # and the session still answers: tool_choice "none" for this response -> the model speaks
        r = await spoken_response(tool_choice="none")
        assert r["trigger"] == "client"
        # a response.create under "required" (no output pending) is a new call, answered as before
        await conn.response.create()
        ev = await rec.responses(2)
        call2_resp, filler = split_responses(ev)
        call2 = check_call_response(call2_resp)
        assert call2["call_id"] != call["call_id"] and check_spoken_response(filler)["transcript"] == FILLER


async def test_ga_transcription_whisper_model_is_substituted(server):
    """audio.input.transcription{model: whisper-1}: served by the default recogniser without a warning,
    then the committed turn gets input_audio_transcription delta/completed (GA-typed)."""
    async with sdk_client(server.url).realtime.connect(model="gpt-realtime") as conn:
        rec = Recorder(conn, ga_adapter(), bound(30))
        await rec.next()
        await conn.session.update(session={"type": "realtime", "audio": {"input": {
            **GA_COMMIT, "transcription": {"model": "whisper-1"}}}})
        ev = await rec.all_of("session.updated")
        upd = next(e for e in ev if e.type == "session.updated")
        assert upd.session.audio.input.transcription.model == "whisper-1"  # echoed as asked
        await speak(conn, QUESTION)
        await conn.input_audio_buffer.commit()
        ev = await rec.until(lambda e: e.type in ("conversation.item.input_audio_transcription.completed",
                                                  "conversation.item.input_audio_transcription.failed"))
        committed = next(e for e in ev if e.type == "input_audio_buffer.committed")
        done = ev[-1]
        assert done.type == "conversation.item.input_audio_transcription.completed", rec.raw[-1]
        assert done.item_id == committed.item_id and done.content_index == 0 and done.transcript
        deltas = [e for e in ev if e.type == "conversation.item.input_audio_transcription.delta"]
        assert "".join(d.delta for d in deltas) in ("", done.transcript)
        # the session goes on
        await conn.response.create()
        ev = await rec.until(lambda e: e.type == "response.done")
        created = next(i for i, e in enumerate(ev) if e.type == "response.created")
        check_spoken_response(ev[created:])


async def test_beta_function_call_flow_and_transcription(server):
    """The beta dialect (``OpenAI-Beta: realtime=v1``): the same flow, every event typed by
    ``openai.types.beta.realtime``; ``input_audio_transcription{whisper-1}`` gives the warning and
    the completed transcript."""
    async with sdk_client(server.url).beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
        rec = Recorder(conn, beta_adapter(), bound(30))
        assert (await rec.next()).type == "session.created"
        beta_tool = {k: v for k, v in WEATHER_TOOL.items()}
        await conn.session.update(session={"modalities": ["audio", "text"], "input_audio_format": "pcm16",
                                           "turn_detection": None, "tools": [beta_tool], "tool_choice": "required",
                                           "input_audio_transcription": {"model": "whisper-1"}})
        upd = next(e for e in await rec.all_of("session.updated") if e.type == "session.updated")
        assert [t.name for t in upd.session.tools] == ["get_weather"] and upd.session.tool_choice == "required"
        assert [r.get("code") for r in rec.raw if r["type"] == "session.warning"] == []
        await speak(conn, QUESTION)
        await conn.input_audio_buffer.commit()
        have = {"transcript": False, "done": 0}

        def pred(e):
            have["transcript"] |= e.type == "conversation.item.input_audio_transcription.completed"
            have["done"] += e.type == "response.done"
            return have["transcript"] and have["done"] == 2

        events = await rec.until(pred)
        tr = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
        committed = next(e for e in events if e.type == "input_audio_buffer.committed")
        assert tr.item_id == committed.item_id and tr.transcript
        # the transcription events may interleave with the responses: drop them to check each response
        resp_events = [e for e in events if not e.type.startswith("conversation.item.input_audio_transcription")]
        call_resp, filler = split_responses(resp_events)
        call = check_call_response(call_resp, beta=True)
        assert check_spoken_response(filler, beta=True)["transcript"] == FILLER
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": "sunny"})
        await conn.response.create()
        ev = await rec.until(lambda e: e.type == "response.done")
        assert any(e.type == "conversation.item.created" and e.item.type == "function_call_output" for e in ev)
        assert not any(e.type == "conversation.item.added" for e in ev)
        created = next(i for i, e in enumerate(ev) if e.type == "response.created")
        answer = check_spoken_response(ev[created:], beta=True)
        assert answer["transcript"] == SCRIPTED_ANSWER
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": "again"})
        err_ev = (await rec.until(lambda e: e.type == "error", errors_ok=True))[-1]
        assert err_ev.error.code == "call_already_answered"
