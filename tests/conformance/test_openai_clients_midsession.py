"""Unmodified OpenAI clients against an in-process ``ScriptedEngine`` server, compat profile:

* the OpenAI Python SDK sends the events that OpenAI refuses with ``input_audio_buffer_commit_empty``,
  ``response_cancel_not_active`` and ``conversation_already_has_active_response`` (the codes Pipecat
  and other OpenAI clients treat as benign races), gets exactly those codes, and the answer that was
  being made still arrives in full (docs/protocol.md §9, "Which code is sent");
* the OpenAI Agents SDK's ``RealtimeSession.update_agent`` switches the instructions while the first
  agent is speaking: the answer plays out unchanged, and the engine stream is re-prefilled with the new
  instructions at the next turn boundary, before the next answer (docs/protocol.md §4.1,
  "Instructions after the first unit"). Nothing the SDK cannot validate is sent (no ``session.warning``
  in the compat profile), so it reports no error event.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from _timing import bound

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _loopback import inprocess_server  # noqa: E402

from duplexkit.engine.api import AppendUnit, TurnEnd, UpdateStream  # noqa: E402
from duplexkit.testing.scripted import ScriptedEngine  # noqa: E402

pytest.importorskip("openai")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"


class RecordingEngine(ScriptedEngine):
    """A ScriptedEngine that keeps one timeline per stream: ``("cmd", command)`` when the Session
    submits a command, ``("out", output)`` when the stream emits an output."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.timelines: list[list] = []

    async def open_stream(self, stream_id, config):
        st = await super().open_stream(stream_id, config)
        line: list = [("cmd", config)]
        self.timelines.append(line)
        submit, emit = st.submit, st._emit  # noqa: SLF001 (instance wrappers, test only)

        def rec_submit(cmd):
            line.append(("cmd", cmd))
            return submit(cmd)

        def rec_emit(out):
            line.append(("out", out))
            return emit(out)

        st.submit, st._emit = rec_submit, rec_emit  # noqa: SLF001
        return st


def _app(engine):
    from duplexkit_server import ServerSettings, create_app

    return create_app(engine=engine, settings=ServerSettings())


async def test_openai_sdk_gets_openai_error_codes_and_the_answer():
    from openai.types.realtime import RealtimeServerEvent
    from pydantic import TypeAdapter

    from openai_sdk_turns import sdk_client

    adapter = TypeAdapter(RealtimeServerEvent)
    engine = RecordingEngine(units_per_turn=2)
    async with inprocess_server(_app(engine)) as port:
        client = sdk_client(f"http://127.0.0.1:{port}")
        async with client.realtime.connect(model="gpt-realtime") as conn:
            events: list = []

            async def until(pred):
                async with asyncio.timeout(bound(60)):
                    while True:
                        ev = await conn.recv()
                        adapter.validate_python(ev.model_dump(exclude_unset=True))  # every event is OpenAI's
                        events.append(ev)
                        if pred(ev):
                            return ev

            await until(lambda e: e.type == "session.created")
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await until(lambda e: e.type == "session.updated")
            await conn.input_audio_buffer.commit()  # nothing appended
            empty = await until(lambda e: e.type == "error")
            await conn.response.cancel()  # nothing active
            not_active = await until(lambda e: e.type == "error")
            await conn.response.create()
            created = await until(lambda e: e.type == "response.created")
            await conn.response.create()  # one is active
            already = await until(lambda e: e.type == "error")
            await conn.conversation.item.retrieve(item_id="item_nope")
            missing = await until(lambda e: e.type == "error")
            done = await until(lambda e: e.type == "response.done")
    assert [e.error.code for e in (empty, not_active, already, missing)] == [
        "input_audio_buffer_commit_empty", "response_cancel_not_active", "conversation_already_has_active_response",
        "item_retrieve_invalid_item_id"]
    assert all(e.error.type == "invalid_request_error" for e in (empty, not_active, already, missing))
    # the answer being made when the errors came is not lost: all of it arrives
    assert done.response.id == created.response.id and done.response.status == "completed"
    audio = sum(len(e.delta) * 3 // 4 // 2 for e in events if e.type == "response.output_audio.delta")
    assert audio == 2 * 24000  # units_per_turn=2: 1 s of 24 kHz audio per unit
    assert not any(e.type == "session.warning" for e in events)


async def test_agents_sdk_update_agent_takes_effect_at_the_next_turn():
    from _thirdparty import agents_sdk

    agents_sdk()
    from agents.realtime import RealtimeAgent, RealtimeRunner

    from agents_sdk_flows import _send_paced, pcm24k_chunks

    first = RealtimeAgent(name="Greeter", instructions="You greet the caller.")
    second = RealtimeAgent(name="Billing", instructions="You answer billing questions in French.")
    engine = RecordingEngine(units_per_turn=3)
    errors: list = []
    audio: dict[str, bytes] = {}
    updated: list[str] = []
    async with inprocess_server(_app(engine)) as port:
        runner = RealtimeRunner(starting_agent=first)
        session = await runner.run(model_config={"url": f"ws://127.0.0.1:{port}/v1/realtime", "api_key": "sk-unused"})
        async with session:
            sender = asyncio.create_task(_send_paced(session, pcm24k_chunks(FIXTURES / "question_16k.wav", 1.5)))
            switched = mid_answer = False
            answers = 0
            async with asyncio.timeout(bound(120)):
                async for event in session:
                    if event.type == "error":
                        errors.append(event.error)
                    elif event.type == "raw_model_event":
                        data = event.data
                        if getattr(data, "type", "") == "error":
                            errors.append(data)
                        elif getattr(data, "type", "") == "raw_server_event" and data.data.get("type") == "session.updated":
                            updated.append(data.data["session"].get("instructions"))
                    elif event.type == "audio":
                        audio[event.item_id] = audio.get(event.item_id, b"") + event.audio.data
                        if not switched:  # mid-answer: the first agent is speaking
                            switched = True
                            sender.cancel()  # the rest of the answer rides silence units: >= 2 s to go
                            mid_answer = not any(isinstance(x, TurnEnd) for _, x in engine.timelines[0])
                            await session.update_agent(second)
                    elif event.type == "audio_end":
                        answers += 1
                        if answers == 1:
                            await asyncio.gather(sender, return_exceptions=True)
                            sender = asyncio.create_task(
                                _send_paced(session, pcm24k_chunks(FIXTURES / "question_16k.wav", 1.5)))
                        else:
                            break
            await sender
    assert not errors, errors
    assert mid_answer
    assert updated[0] == first.instructions and updated[-1] == second.instructions
    assert [len(a) for a in audio.values()] == [3 * 48000, 3 * 48000]  # the first answer was not cut
    (line,) = engine.timelines
    updates = [i for i, (k, x) in enumerate(line) if k == "cmd" and isinstance(x, UpdateStream)
               and x.config.instructions.startswith(second.instructions)]
    assert updates, "the new instructions never reached the engine"
    at = updates[0]
    # the re-prefilled system text: the new instructions, then what was said so far as text
    new_instructions, history = line[at][1].config.instructions.split("\n\n", 1)
    assert new_instructions == second.instructions
    assert history.splitlines()[-1] == "Assistant: Hello there, this is a scripted"  # the first answer, as heard
    turn_ends = [i for i, (k, x) in enumerate(line) if k == "out" and isinstance(x, TurnEnd)]
    assert len(turn_ends) == 2
    # re-prefilled after the first answer ended and before the second one: at the turn boundary
    assert turn_ends[0] < at < turn_ends[1]
    assert any(k == "cmd" and isinstance(x, AppendUnit) for k, x in line[at:turn_ends[1]])
    # every earlier config the engine got kept the first instructions
    assert all(x.config.instructions == first.instructions for k, x in line[:at]
               if k == "cmd" and isinstance(x, UpdateStream))
