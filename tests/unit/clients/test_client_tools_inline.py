"""Client-side tools end to end in-process: InlineDuplexClient(tools=[...]) over the ScriptedEngine,
whose tool_script decides the calls; the Session issues them, the client runs them and answers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from duplexkit.agent import tool
from duplexkit.audio import read_wav
from duplexkit.clients import InlineDuplexClient, ToolCallFinished, ToolCallStarted
from duplexkit.testing import ScriptedEngine

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


def speech() -> np.ndarray:
    return read_wav(FIXTURES / "question_16k.wav", 16_000)[0]


NO_VAD = {"turn_detection": None}  # the client's commit ends the user turn (one turn per say())


async def say(c, audio: np.ndarray) -> None:
    for i in range(0, len(audio), 1600):
        await c.send_audio(audio[i:i + 1600])
    await c.commit()


async def until(c, pred, seen: list, timeout: float = 20.0):
    """Read events() into ``seen`` until ``pred(event)``; returns that event."""
    async def loop():
        while True:
            ev = await c.events().get()
            seen.append(ev)
            if pred(ev):
                return ev
    return await asyncio.wait_for(loop(), timeout)


def _is(t):
    return lambda ev: getattr(ev, "type", None) == t


async def test_a_scripted_call_runs_and_its_answer_is_spoken():
    notes = []

    @tool(filler="Writing it down.")
    async def add_note(text: str) -> dict:
        """Add a note.

        Args:
            text: the note.
        """
        notes.append(text)
        return {"id": len(notes), "text": text}

    eng = ScriptedEngine(units_per_turn=3, tool_script=[("add_note", {"text": "buy milk"})])
    async with InlineDuplexClient(eng, tools=[add_note], answer_policy="on_request", session=NO_VAD) as c:
        tools = c.session["tools"]
        assert [t["name"] for t in tools] == ["add_note"] and c.session["tool_choice"] == "auto"
        await say(c, speech())
        seen: list = []
        fin = await until(c, lambda ev: isinstance(ev, ToolCallFinished), seen)
        assert notes == ["buy milk"]
        call = fin.call
        assert call.status == "completed" and call.sent and json.loads(call.output) == {"id": 1, "text": "buy milk"}
        assert any(isinstance(ev, ToolCallStarted) and ev.call is call for ev in seen)
        # the output went to the server as a function_call_output item, then a response answered it
        await until(c, lambda ev: _is("conversation.item.added")(ev) and ev.item.type == "function_call_output"
                    and ev.item.call_id == call.call_id, seen)
        created = await until(c, lambda ev: _is("response.created")(ev) and ev.response.trigger == "client", seen)
        done = await until(c, lambda ev: _is("response.done")(ev) and ev.response.id == created.response.id, seen)
        assert done.response.status == "completed"
        # the decider wrote the answer from the call and its output (ScriptedEngine's chat text)
        assert eng.chat_requests[-1].tool_choice == "none"
        assert c.tool_calls == {call.call_id: call}
        assert call.elapsed_ms is not None and call.elapsed_ms >= 0


async def test_a_failing_tool_sends_an_error_output_and_the_model_still_answers():
    @tool
    def add_note(text: str) -> str:
        """Add a note."""
        raise PermissionError("the notebook is read-only")

    eng = ScriptedEngine(units_per_turn=3, tool_script=[("add_note", {"text": "x"})])
    async with InlineDuplexClient(eng, tools=[add_note], answer_policy="on_request",
                                  session={**NO_VAD, "extra_body": {"tool_filler": ""}}) as c:
        await say(c, speech())
        seen: list = []
        fin = await until(c, lambda ev: isinstance(ev, ToolCallFinished), seen)
        assert fin.call.status == "failed" and "read-only" in fin.call.error
        added = await until(c, lambda ev: _is("conversation.item.added")(ev) and ev.item.type == "function_call_output",
                            seen)
        assert json.loads(added.item.output) == {"error": "PermissionError: the notebook is read-only"}
        created = await until(c, lambda ev: _is("response.created")(ev) and ev.response.trigger == "client", seen)
        done = await until(c, lambda ev: _is("response.done")(ev) and ev.response.id == created.response.id, seen)
        assert done.response.status == "completed"


async def test_client_cancel_cancels_a_slow_cancellable_call_and_deletes_its_item():
    started, cancelled = asyncio.Event(), asyncio.Event()

    @tool(timeout_s=30)
    async def add_note(text: str) -> str:
        """Add a note, slowly."""
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    eng = ScriptedEngine(units_per_turn=3, tool_script=[("add_note", {"text": "x"})])
    async with InlineDuplexClient(eng, tools=[add_note], answer_policy="on_request", session=NO_VAD) as c:
        await say(c, speech())
        await asyncio.wait_for(started.wait(), 20)
        await c.cancel()
        await asyncio.wait_for(cancelled.wait(), 5)
        seen: list = []
        fin = await until(c, lambda ev: isinstance(ev, ToolCallFinished), seen)
        assert fin.call.status == "cancelled" and not fin.call.sent
        deleted = await until(c, _is("conversation.item.deleted"), seen)
        assert deleted.item_id == fin.call.item_id
        # nothing was sent for it: the session never saw an output for the call
        assert all(not (_is("conversation.item.added")(ev) and ev.item.type == "function_call_output") for ev in seen)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "add_note"}])
async def test_tool_choice_is_sent_with_the_tools(tool_choice):
    def add_note(text: str) -> str:
        """Add a note."""
        return "ok"

    async with InlineDuplexClient(ScriptedEngine(), tools=[add_note], tool_choice=tool_choice,
                                  answer_policy="on_request") as c:
        assert c.session["tool_choice"] == tool_choice
        assert c.session["tools"][0]["parameters"]["required"] == ["text"]
