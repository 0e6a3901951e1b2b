"""``/health`` counters (sessions_open, sessions_opened, input_appends, input_audio_ms) of a real
``duplexkit serve scripted`` process, over a real WebSocket."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
import websockets
from _timing import bound

pytestmark = pytest.mark.e2e

KEYS = ("sessions_open", "sessions_opened", "input_appends", "input_audio_ms")


def _counts(srv) -> tuple:
    h = httpx.get(srv.url + "/health", timeout=bound(10)).json()
    return tuple(h[k] for k in KEYS)


def _append(ms: int) -> str:
    pcm = np.zeros(16 * ms, np.int16).tobytes()  # 16 kHz pcm16
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})


async def _recv_until(ws, type_: str) -> None:
    while json.loads(await ws.recv())["type"] != type_:
        pass


async def test_health_counts_accepted_appends_and_sessions(scripted_server):
    o, n, a, ms = _counts(scripted_server)
    assert o == 0
    async with websockets.connect(scripted_server.ws_url + "/v1/realtime?duplex=1") as ws:
        await _recv_until(ws, "session.created")
        for _ in range(3):
            await ws.send(_append(100))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "!!not base64"}))
        await ws.send(json.dumps({"type": "session.heartbeat"}))
        await _recv_until(ws, "session.heartbeat_ack")
        # the rejected append (bad_audio) is not counted
        assert _counts(scripted_server) == (1, n + 1, a + 3, ms + 300)
        await ws.send(json.dumps({"type": "session.close"}))
        await _recv_until(ws, "session.closed")
    for _ in range(50):  # the server folds the session into its totals when the socket ends
        if _counts(scripted_server)[0] == 0:
            break
        await asyncio.sleep(0.1)
    # a closed session's counts stay in the totals
    assert _counts(scripted_server) == (0, n + 1, a + 3, ms + 300)


def _health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=10).json()


async def _until(srv, pred, what: str) -> dict:
    for _ in range(300):  # the server updates its state when the socket's handler runs; generous bound
        h = _health(srv)
        if pred(h):
            return h
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what}: {h}")


async def test_sessions_active_counts_slots_sessions_open_counts_sessions(scripted_server):
    """``sessions_active`` is slots in use; ``sessions_open`` is realtime sessions that exist. An
    ``autostart=0`` socket holds a slot before its first frame creates the session (docs/server.md)."""
    h0 = await _until(scripted_server, lambda h: h["sessions_active"] == 0 and h["sessions_open"] == 0, "idle")
    url = scripted_server.ws_url + "/v1/realtime?duplex=1&autostart=0"
    async with websockets.connect(url) as ws:
        # accepted, nothing sent yet: a slot is reserved, no session exists
        h = _health(scripted_server)
        assert (h["sessions_active"], h["sessions_open"], h["sessions_opened"]) == (1, 0, h0["sessions_opened"])
        await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "hi"}}))
        await _recv_until(ws, "session.created")
        h = _health(scripted_server)
        assert (h["sessions_active"], h["sessions_open"], h["sessions_opened"]) == (1, 1, h0["sessions_opened"] + 1)
        await ws.send(json.dumps({"type": "session.close"}))
        await _recv_until(ws, "session.closed")
    await _until(scripted_server, lambda h: h["sessions_active"] == 0 and h["sessions_open"] == 0, "not released")
