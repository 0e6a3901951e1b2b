"""Client-side tools over a real socket: DuplexClient(tools=[...]) against a ``duplexkit serve scripted``
process whose tool_script decides the call; the client runs it, sends its output, and the answer is
spoken. The same flow as the inline test (tests/unit/clients/test_client_tools_inline.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from _serverproc import ServerProc
from _timing import bound

from duplexkit.agent import tool
from duplexkit.audio import read_wav
from duplexkit.clients import DuplexClient, ToolCallFinished, ToolCallStarted

pytestmark = pytest.mark.e2e


async def _until(c, pred, seen: list, timeout: float):
    async def loop():
        while True:
            ev = await c.events().get()
            seen.append(ev)
            if pred(ev):
                return ev
    return await asyncio.wait_for(loop(), timeout)


async def test_duplex_client_runs_a_scripted_call_and_the_answer_is_spoken(question_wav):
    notes = []

    @tool(filler="Writing it down.")
    def add_note(text: str, priority: int = 1) -> dict:
        """Add a note.

        Args:
            text: the note.
            priority: 1 (low) to 3 (high).
        """
        notes.append((text, priority))
        return {"id": len(notes)}

    audio, _ = read_wav(question_wav, 16_000)
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=3",
                    "--scripted", 'tool_script=[["add_note", {"text": "buy milk", "priority": 2}]]') as srv:
        async with DuplexClient(srv.ws_url, tools=[add_note], session={"turn_detection": None}) as c:
            assert [t["name"] for t in c.session["tools"]] == ["add_note"]
            for i in range(0, len(audio), 1600):
                await c.send_audio(audio[i:i + 1600])
            await c.commit()
            seen: list = []
            fin = await _until(c, lambda ev: isinstance(ev, ToolCallFinished), seen, bound(30))
            assert notes == [("buy milk", 2)]
            assert fin.call.status == "completed" and json.loads(fin.call.output) == {"id": 1}
            assert any(isinstance(ev, ToolCallStarted) for ev in seen)
            added = await _until(c, lambda ev: ev.type == "conversation.item.added"
                                 and ev.item.type == "function_call_output", seen, bound(30))
            assert added.item.call_id == fin.call.call_id
            created = await _until(c, lambda ev: ev.type == "response.created" and ev.response.trigger == "client",
                                   seen, bound(30))
            done = await _until(c, lambda ev: ev.type == "response.done" and ev.response.id == created.response.id,
                                seen, bound(30))
            assert done.response.status == "completed"
            h = c.response(created.response.id)
            assert h is not None and h.audio_samples > 0
