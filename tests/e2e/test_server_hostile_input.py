"""Malformed and oversized input against a real ``duplexkit serve scripted`` process: every shape
gets its docs/protocol.md §9 code or an OpenAI-shaped 4xx body, never a 500, a traceback or a
silent close; quotas are enforced before work (docs/server.md, "Security")."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets
from _serverproc import ServerProc

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def srv():
    with ServerProc("scripted", "--answer-policy", "on_request", "--max-body-bytes", "2000000",
                    "--max-sessions", "4", "--max-sessions-per-client", "2", "--header-timeout-s", "1") as s:
        yield s


def _flac_silence(seconds: float) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(seconds * 16_000), np.float32), 16_000, format="FLAC")
    return buf.getvalue()


def _deep(n: int) -> str:
    return '{"type":"session.update","a":' + "[" * n + "]" * n + "}"


async def _recv_until(ws, etype: str, limit: int = 50) -> dict:
    for _ in range(limit):
        ev = json.loads(await asyncio.wait_for(ws.recv(), 120))  # a hang fails, it does not wait for the idle timeout
        if ev["type"] == etype:
            return ev
    raise AssertionError(f"no {etype}")


async def test_deep_json_frames_get_invalid_json_and_session_lives(srv):
    async with websockets.connect(srv.ws_url + "/v1/realtime") as ws:
        await _recv_until(ws, "session.created")
        for _ in range(3):
            await ws.send(_deep(100_000))
            ev = await _recv_until(ws, "error")
            assert ev["error"]["code"] == "invalid_json"
        await ws.send(json.dumps({"type": "session.heartbeat", "event_id": "hb"}))
        assert (await _recv_until(ws, "session.heartbeat_ack"))["type"] == "session.heartbeat_ack"
    assert "Traceback" not in srv.output()


async def test_deep_json_first_frame_of_autostart0_is_answered_not_closed(srv):
    async with websockets.connect(srv.ws_url + "/v1/realtime?autostart=0") as ws:
        await ws.send(_deep(100_000))
        types = [json.loads(await ws.recv())["type"] for _ in range(2)]
        assert "error" in types and "session.created" in types
        await ws.send(json.dumps({"type": "session.heartbeat"}))
        await _recv_until(ws, "session.heartbeat_ack")


@pytest.mark.parametrize("body,status,code", [
    (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    (b'{"messages":[{"role":"user","content":"x"}],"modalities":[[1],{}]}', 400, None),
    (b'{"messages":[{"role":"user","content":[{"type":"audio_url","audio_url":"data:x"}]}]}', 400, None),
    (b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":"http://x"}]}]}', 400, None),
    (b'{"messages":[{"role":"user","content":[{"type":"text"}]}]}', 400, None),
    (b'{"messages":[{"role":"user","content":"x"}],"stream_options":[]}', 400, None),
    (b'{"messages":[{"role":"user","content":"x"}],"temperature":"hot"}', 400, None),
    (b'{"messages":[{"role":"tool","content":"x"}]}', 400, None),
    (b'{"messages":"x"}', 400, None),
    (b'"just a string"', 400, None),
    (b"\xff\xfe", 400, "invalid_json"),
])
def test_malformed_chat_bodies_are_openai_400s(srv, body, status, code):
    r = httpx.post(srv.url + CHAT, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if code:
        assert err["code"] == code


def test_body_limit_413_before_reading(srv):
    r = httpx.post(srv.url + CHAT, content=b"x" * 3_000_000, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while streaming
        for _ in range(40):
            yield b" " * 100_000
    r = httpx.post(srv.url + CHAT, content=chunks(), timeout=30)
    assert r.status_code == 413


def test_long_compressed_audio_refused_from_the_header(srv):
    flac = _flac_silence(368.0)
    assert len(flac) < 400_000  # small on the wire, 23 MB once decoded
    before = httpx.get(srv.url + "/health").json()
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(flac).decode(), "format": "wav"}}
    for role in ("user", "system"):
        r = httpx.post(srv.url + CHAT, json={"messages": [{"role": role, "content": [part]},
                                                           {"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 400 and "at most" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] in ("bad_audio", "ref_audio_invalid")
    assert httpx.get(srv.url + "/health").json()["sessions_active"] == before["sessions_active"]


async def test_long_compressed_ref_audio_refused_on_websocket(srv):
    url = "data:audio/flac;base64," + base64.b64encode(_flac_silence(368.0)).decode()
    async with websockets.connect(srv.ws_url + "/v1/realtime") as ws:
        await _recv_until(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {"ref_audio": url}}))
        ev = await _recv_until(ws, "error")
        assert ev["error"]["code"] == "ref_audio_invalid" and "got 368" in ev["error"]["message"]


async def _no_sessions_left(srv, timeout_s: float = 60) -> None:
    """Wait until the earlier tests' sessions have released their slots (a closed session frees its
    slot once its engine stream has closed: on a loaded machine that can lag the client's close)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while (await client.get(srv.url + "/health")).json().get("sessions_active", 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


async def test_per_client_session_limit(srv):
    await _no_sessions_left(srv)
    a = await websockets.connect(srv.ws_url + "/v1/realtime")
    b = await websockets.connect(srv.ws_url + "/v1/realtime")
    try:
        for ws in (a, b):
            await _recv_until(ws, "session.created")
        async with websockets.connect(srv.ws_url + "/v1/realtime") as c:
            ev = json.loads(await c.recv())
            assert ev["error"]["code"] == "session_capacity_exhausted" and "per-client" in ev["error"]["message"]
            with pytest.raises(websockets.ConnectionClosed) as ei:
                await c.recv()
            assert ei.value.rcvd.code == 1013
        r = httpx.post(srv.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 503 and "per-client" in r.json()["error"]["message"]
    finally:
        await a.close()
        await b.close()


def test_no_5xx_and_no_traceback_logged(srv):
    for path in ("/static/%00", "/static/" + "a" * 5000, "/v1/models?x=%ff", "/%2e%2e/etc/passwd"):
        assert httpx.get(srv.url + path).status_code < 500
    assert "Traceback" not in srv.output() and "ERROR" not in srv.output()


def _closed_by_server(sock: socket.socket) -> float:
    """Seconds until the server closes ``sock`` (reading whatever it sends first)."""
    t0 = time.monotonic()
    sock.settimeout(60)
    while sock.recv(65536):
        pass
    return time.monotonic() - t0


def test_slow_request_head_is_closed(srv):
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
        assert _closed_by_server(s) < 30  # --header-timeout-s 1; the fixed bound only catches "never"
    with socket.create_connection(("127.0.0.1", srv.port)) as s:  # a kept-alive connection, then a slow head
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b"200 OK" in s.recv(65536)
        s.sendall(b"GET /health HTTP/1.1\r\n")
        assert _closed_by_server(s) < 30
    # a WebSocket session that stays quiet longer than the header timeout is not affected
    async def quiet_session():
        async with websockets.connect(srv.ws_url + "/v1/realtime") as ws:
            await _recv_until(ws, "session.created")
            await asyncio.sleep(2.5)
            await ws.send(json.dumps({"type": "session.heartbeat"}))
            await _recv_until(ws, "session.heartbeat_ack")
    asyncio.run(quiet_session())
