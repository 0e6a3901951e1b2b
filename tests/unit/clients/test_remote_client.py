"""DuplexClient against scripted in-test WebSocket servers (real sockets on loopback):
beta/vLLM-Omni event names (docs/protocol.md §12.24), session resume, and never hanging."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from websockets.asyncio.server import serve

from duplexkit.audio import float32_to_pcm16
from duplexkit.clients import DuplexClient, DuplexConnectionError

SESSION = {"type": "realtime", "id": "sess_" + "a" * 24, "object": "realtime.session",
           "capabilities": {"supports_session_resume": False}}


def pcm_b64(n: int) -> str:
    return base64.b64encode(float32_to_pcm16(np.full(n, 0.1, np.float32))).decode()


def response_trace(beta: bool, rid: str = "resp_1", iid: str = "item_9") -> list[dict]:
    a = "response.audio" if beta else "response.output_audio"
    tr = "response.audio_transcript" if beta else "response.output_audio_transcript"
    ids = {"response_id": rid, "item_id": iid, "output_index": 0, "content_index": 0}
    item = {"id": iid, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    evs = [{"type": "response.created", "response": {"id": rid, "status": "in_progress", "output": []}}]
    if beta:
        evs.append({"type": "conversation.item.created", "item": item})
    evs += [{"type": "conversation.item.added", "item": item},
            {"type": "response.output_item.added", "response_id": rid, "output_index": 0, "item": item}]
    if beta:
        evs += [{"type": "conversation.item.created", "item": item},  # duplicate: ignored
                {"type": "response.listen", "epoch": 0},  # id-less beat
                {"type": "overlap.decision", "decision": "speak"}]  # unknown: surfaced raw
    for n, text in ((20160, "Hello "), (24000, "world")):
        evs += [{"type": f"{a}.delta", **ids, "delta": pcm_b64(n)}, {"type": f"{tr}.delta", **ids, "delta": text}]
    evs += [{"type": f"{a}.done", **ids}, {"type": f"{tr}.done", **ids, "transcript": "Hello world"},
            {"type": "response.done", "response": {"id": rid, "status": "completed", "output": []}}]
    return evs


class FakeServer:
    """Answers session.update with session.created, commit with committed, response.create with a trace."""

    def __init__(self, trace: list[dict], *, resume: bool = False, drop_after: int | None = None) -> None:
        self.trace = trace
        self.resume = resume
        self.drop_after = drop_after  # drop the socket after this many trace events (first connection)
        self.received: list[dict] = []
        self.seq = 0
        self.sent: list[dict] = []
        self.connections = 0

    async def send(self, ws, ev: dict) -> None:
        self.seq += 1
        ev = {**ev, "event_id": f"event_{self.seq}", "server_event_seq": self.seq}
        self.sent.append(ev)
        await ws.send(json.dumps(ev))

    async def handler(self, ws) -> None:
        self.connections += 1
        first_conn = self.connections == 1
        async for raw in ws:
            ev = json.loads(raw)
            self.received.append(ev)
            t = ev["type"]
            if t == "session.update" and first_conn and self.seq == 0:
                caps = {"supports_session_resume": self.resume}
                await self.send(ws, {"type": "session.created", "session": {**SESSION, "capabilities": caps}})
            elif t == "session.resume":
                last = ev["last_server_event_seq"]
                for old in self.sent:  # replay what the client missed, and one it already has
                    if old["server_event_seq"] >= last:
                        await ws.send(json.dumps(old))
                for rest in self.trace[self.drop_after:]:
                    await self.send(ws, rest)
            elif t == "input_audio_buffer.commit":
                await self.send(ws, {"type": "input_audio_buffer.committed", "item_id": "item_u"})
            elif t == "response.create":
                for i, tev in enumerate(self.trace):
                    if first_conn and self.drop_after is not None and i == self.drop_after:
                        ws.transport.abort()  # the network drops: no close frame
                        return
                    await self.send(ws, tev)
            elif t == "session.close":
                await self.send(ws, {"type": "session.closed", "session_id": SESSION["id"], "reason": "client_close"})
                await ws.close()
                return

    async def __aenter__(self):
        self._srv = await serve(self.handler, "127.0.0.1", 0)
        self.url = f"ws://127.0.0.1:{self._srv.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self._srv.close()
        await self._srv.wait_closed()


async def run_turn(url: str) -> tuple:
    async with DuplexClient(url, request_timeout_s=5) as c:
        await c.send_audio(np.zeros(1600, np.float32))
        await c.commit()
        h = await c.create_response()
        await h.wait(5)
        evs = []
        while True:
            try:
                evs.append(await asyncio.wait_for(c.events().get(), 0.2))
            except (asyncio.TimeoutError, StopAsyncIteration):
                break
    return c, h, evs


async def test_beta_trace_gives_the_same_response_as_ga():
    results = {}
    for beta in (False, True):
        async with FakeServer(response_trace(beta)) as srv:
            c, h, evs = await run_turn(srv.url)
            results[beta] = (h.status, h.transcript, h.chunk_sizes, h.item_id,
                             [e.type for e in evs if e.type.startswith(("response.output", "response.done"))])
            if beta:
                types = [e.type for e in evs]
                assert "overlap.decision" in types  # unknown events surface raw
                assert types.count("conversation.item.added") == 1  # created+added of one item -> one
            # the client connected the vLLM-Omni way: autostart=0 and the full session first
            assert srv.received[0]["type"] == "session.update"
    assert results[False] == results[True]
    assert results[True][:3] == ("completed", "Hello world", [20160, 24000])


async def test_resume_after_a_dropped_connection():
    trace = response_trace(False)
    async with FakeServer(trace, resume=True, drop_after=5) as srv:
        async with DuplexClient(srv.url, request_timeout_s=5) as c:
            await c.commit()
            h = await c.create_response()
            await h.wait(10)
            assert c.resumes == 1
            assert h.status == "completed" and h.chunk_sizes == [20160, 24000]
            assert h.transcript == "Hello world"
        resume = [e for e in srv.received if e["type"] == "session.resume"]
        assert len(resume) == 1
        assert resume[0]["session_id"] == SESSION["id"]
        assert resume[0]["last_server_event_seq"] == 7  # created, committed, 5 trace events


async def test_connection_loss_without_resume_fails_fast():
    async with FakeServer(response_trace(False), resume=False, drop_after=5) as srv:
        c = DuplexClient(srv.url, request_timeout_s=5)
        await c.connect()
        await c.commit()
        h = await c.create_response()
        with pytest.raises(DuplexConnectionError):
            await h.wait(5)
        with pytest.raises(DuplexConnectionError):
            async for _ in c.events():
                pass
        with pytest.raises(DuplexConnectionError):
            await c.commit()
        await c.close()


async def test_unreachable_server_raises():
    with pytest.raises(DuplexConnectionError) as ei:
        async with DuplexClient("ws://127.0.0.1:9", open_timeout_s=2):
            pass
    assert ei.value.code == "connection_failed"


def test_build_url():
    from duplexkit.clients import build_url

    assert build_url("http://h:1") == "ws://h:1/v1/realtime?duplex=1&autostart=0&dialect=ga"
    assert build_url("ws://h:1/v1/duplex", model="m") == "ws://h:1/v1/duplex?autostart=0&dialect=ga&model=m"
    assert build_url("wss://h/v1/realtime?duplex=0", profile="compat") == \
        "wss://h/v1/realtime?duplex=0&autostart=0&dialect=ga"


def test_handshake_refusal_messages():
    from duplexkit.clients.remote import _REFUSAL_CODES, _refusal_message

    url = "ws://h:1/v1/realtim"
    bare403 = _refusal_message(url, 403, b"")
    assert "wrong path or API key" in bare403 and "/v1/realtime" in bare403 and url in bare403
    assert 403 not in _REFUSAL_CODES  # not reported as `unauthorized`: it may be a wrong path
    said = json.dumps({"error": {"message": "Origin 'http://evil' is not allowed", "code": "unauthorized"}})
    assert _refusal_message(url, 403, said.encode()) == \
        "handshake rejected with HTTP 403: Origin 'http://evil' is not allowed"
    assert _refusal_message(url, 404, b"<html>nope</html>").startswith(f"no WebSocket endpoint at {url} (HTTP 404): ")
    assert _refusal_message(url, 500, None) == "handshake rejected with HTTP 500"
