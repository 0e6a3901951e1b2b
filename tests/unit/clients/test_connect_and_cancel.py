"""connect() fails on a rejected initial session.update (docs/protocol.md §5.1), and a cancelled call
never keeps running when its reply lands in the same loop iteration."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from duplexkit.audio import read_wav
from duplexkit.clients import DuplexError, InlineDuplexClient
from duplexkit.clients.base import BaseDuplexClient, wait_done
from duplexkit.testing import ScriptedEngine

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


def short_ref() -> tuple[np.ndarray, int]:
    """0.3 s of the reference voice fixture: under the 0.5 s minimum (docs/protocol.md §8)."""
    audio, sr = read_wav(FIXTURES / "ref_voice_16k.wav", 16_000)
    return audio[: int(0.3 * sr)], sr


@pytest.mark.parametrize("kwargs, code", [
    ({"ref_audio": "file:///x.wav"}, "ref_audio_invalid"),
    ({"session": {"turn_detection": {"type": "near_field_vad"}}}, "unsupported_turn_detection"),
    ({"session": {"temperature": 9}}, "bad_event"),
])
async def test_inline_connect_raises_on_a_rejected_initial_update(kwargs, code):
    engine = ScriptedEngine()
    c = InlineDuplexClient(engine, **kwargs)
    with pytest.raises(DuplexError) as ei:
        async with c:
            pytest.fail("connect() returned for a rejected initial update")
    assert ei.value.code == code
    assert ei.value.event_id is not None and ei.value.event_id.startswith("cevt_")
    # connect() cleaned up after itself: the session is closed, the transport released
    assert c.closed and c.session_machine.closed
    assert c.close_reason == "client_close"


async def test_inline_connect_raises_for_a_too_short_reference_voice():
    c = InlineDuplexClient(ScriptedEngine(), ref_audio=short_ref())
    with pytest.raises(DuplexError) as ei:
        await c.connect()
    assert ei.value.code == "ref_audio_invalid"
    assert c.closed
    await c.close()  # idempotent after a failed connect


async def test_inline_connect_accepts_a_valid_initial_update():
    async with InlineDuplexClient(ScriptedEngine(), ref_audio=FIXTURES / "ref_voice_16k.wav",
                                  session={"instructions": "Be brief."}) as c:
        assert c.session["instructions"] == "Be brief."
        assert c.session["ref_audio"]["duration_ms"] > 500
        assert not c.closed


# -------------------------------------------------------------------------- cancellation race


class _RecordingClient(BaseDuplexClient):
    """A client whose transport records sent events; the test plays the server by handing reply
    events to ``_on_server_event`` itself, so it controls the exact loop iteration they land in."""

    def __init__(self) -> None:
        super().__init__(request_timeout_s=30)
        self.sent: list[dict] = []

    async def _open(self) -> None:
        pass

    async def _transmit(self, event: dict) -> None:
        self.sent.append(event)
        if event["type"] == "session.close":  # the one reply the transport gives by itself
            asyncio.get_running_loop().call_soon(self._on_server_event, {
                "type": "session.closed", "session_id": "sess_1", "epoch": 0, "reason": event["reason"]})

    async def _shutdown(self) -> None:
        pass


def _reply_for(kind: str, sent: dict) -> dict:
    if kind == "commit":
        return {"type": "input_audio_buffer.committed", "item_id": "item_1", "previous_item_id": None}
    if kind == "heartbeat":
        return {"type": "session.heartbeat_ack", "session_id": "sess_1"}
    return {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "trigger": "client",
                                                      "output": []}}


def _call(c: _RecordingClient, kind: str):
    return {"commit": c.commit, "heartbeat": c.heartbeat, "create_response": c.create_response}[kind]()


async def _waiting(c: _RecordingClient, kind: str) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(_call(c, kind))
    for _ in range(100):
        await asyncio.sleep(0)
        if c.sent and c.sent[-1]["event_id"] in c._futures:
            return task
    raise AssertionError("the call never started waiting for its reply")


@pytest.mark.parametrize("kind", ["commit", "heartbeat", "create_response"])
async def test_cancel_when_the_reply_lands_in_the_same_iteration_propagates(kind):
    c = _RecordingClient()
    task = await _waiting(c, kind)
    # the reply arrives and the caller is cancelled in the same loop iteration
    c._on_server_event(_reply_for(kind, c.sent[-1]))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


@pytest.mark.parametrize("kind", ["commit", "heartbeat", "create_response"])
async def test_the_reply_is_returned_when_not_cancelled(kind):
    c = _RecordingClient()
    task = await _waiting(c, kind)
    c._on_server_event(_reply_for(kind, c.sent[-1]))
    res = await task
    if kind == "create_response":
        assert res.id == "resp_1" and res.trigger == "client"
    else:
        assert res.type == _reply_for(kind, {})["type"]


async def test_response_wait_cancel_is_not_lost_when_done_lands_together():
    c = _RecordingClient()
    c._on_server_event(_reply_for("create_response", {}))
    h = c.response("resp_1")
    task = asyncio.get_running_loop().create_task(h.wait(30))
    await asyncio.sleep(0)
    c._on_server_event({"type": "response.done", "response": {"id": "resp_1", "status": "completed", "output": []}})
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_wait_done_times_out_and_leaves_a_given_future_alone():
    fut = asyncio.get_running_loop().create_future()
    assert await wait_done(fut, 0.01) is False
    assert not fut.cancelled()
    fut.set_result(3)
    assert await wait_done(fut, 0.01) is True and fut.result() == 3
    ev = asyncio.Event()
    assert await wait_done(ev.wait(), 0.01) is False  # the coroutine's task is cancelled, not leaked


async def test_connect_raises_when_the_error_lands_together_with_session_created():
    """A server that sends session.created first and the init update's error right after (the old
    order): when both land before connect() resumes, connect() still raises."""
    c = _RecordingClient()
    task = asyncio.get_running_loop().create_task(c.connect())
    for _ in range(100):
        await asyncio.sleep(0)
        if c.sent:
            break
    eid = c.sent[0]["event_id"]
    assert c.sent[0]["type"] == "session.update"
    c._on_server_event({"type": "session.created", "session": {"id": "sess_1"}})
    c._on_server_event({"type": "error", "error": {"type": "invalid_request_error", "code": "ref_audio_invalid",
                                                   "message": "too short", "param": "ref_audio", "event_id": eid}})
    with pytest.raises(DuplexError) as ei:
        await task
    assert ei.value.code == "ref_audio_invalid" and ei.value.event_id == eid
    assert c.closed and c.close_reason == "client_close" and c.close_code == 1000


async def test_an_error_for_the_init_update_after_connect_returned_goes_to_events():
    c = _RecordingClient()
    task = asyncio.get_running_loop().create_task(c.connect())
    for _ in range(100):
        await asyncio.sleep(0)
        if c.sent:
            break
    eid = c.sent[0]["event_id"]
    c._on_server_event({"type": "session.created", "session": {"id": "sess_1"}})
    assert (await task)["id"] == "sess_1"
    c._on_server_event({"type": "error", "error": {"code": "bad_event", "message": "late", "event_id": eid}})
    assert [(await c.events().get()).type for _ in range(2)] == ["session.created", "error"]
    assert not c.closed
