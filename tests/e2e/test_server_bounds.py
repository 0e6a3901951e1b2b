"""Server bounds and slots, against real ``duplexkit serve scripted`` processes over real
sockets (docs/server.md, "Limits and close codes"):

* slots are free before the close returns: 100 sequential sessions at a per-client share of 1 are
  never refused; a page reloaded 5 times (each reload parks a session) is never locked out;
* a request head over ``--max-header-bytes`` gets 431 at once, for HTTP and WebSocket handshakes,
  without the server's memory growing;
* a chat request takes its slot before its body is read (a refused one is never read), and a slow
  body gets 408 after ``--body-timeout-s``;
* a WebSocket peer that sends but never reads is cut off by the outbound bounds (bytes or time);
* the resume journal is trimmed by ``session.event_ack``;
* ``HEAD`` on the probes, ``models.retrieve`` and text-only chat through the OpenAI SDK.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time

import httpx
import pytest
import websockets
from _serverproc import ServerProc
from _timing import bound

pytestmark = pytest.mark.e2e

SECOND_16K = base64.b64encode(b"\0" * 32000).decode()  # 1 s of 16 kHz pcm16 silence


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=bound(10)).json()


def _wait(pred, what: str, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound(bound_s)
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {bound(bound_s):.0f} s: {what}")


async def _first_event(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), bound(30)))


# -- slots --------------------------------------------------------------------------------------

async def test_100_sequential_sessions_are_never_refused():
    # a share of 1 slot per client: each session needs the previous one's slot back
    with ServerProc("scripted", "--max-sessions", "2", "--max-sessions-per-client", "1") as srv:
        refused = []
        for i in range(100):
            async with websockets.connect(srv.ws_url + "/v1/realtime") as ws:
                ev = await _first_event(ws)
                if ev["type"] != "session.created":
                    refused.append((i, ev))
                    continue
                if i % 2:  # the client closes (1000) ...
                    await ws.close()
                else:  # ... or asks the server to, and waits for its close frame
                    await ws.send(json.dumps({"type": "session.close"}))
                    with pytest.raises(websockets.ConnectionClosedOK):
                        while True:
                            await asyncio.wait_for(ws.recv(), bound(30))
        assert refused == []
        assert _health(srv)["sessions_opened"] == 100


async def test_a_session_closed_then_its_socket_closed_at_once_ends():
    # the browser page's Stop: session.close and the close frame back to back, without waiting
    # for session.closed; the writer was sending session.closed when the session ended, and on
    # Python 3.11 its cancel was swallowed by wait_for: the session never ended (sessions_open stuck)
    with ServerProc("scripted") as srv:
        for i in range(6):
            async with websockets.connect(srv.ws_url + "/v1/realtime?duplex=1") as ws:
                assert (await _first_event(ws))["type"] == "session.created"
                await ws.send(json.dumps({"type": "session.close"}))
                if i % 2:
                    await asyncio.sleep(0.05)
                await ws.close(1000)
        _wait(lambda: _health(srv)["sessions_open"] == 0, "every session ended (sessions_open 0)", 10)
        h = _health(srv)
        assert h["sessions_opened"] == 6 and h["sessions_active"] == 0, h


async def test_a_page_reloaded_five_times_is_not_locked_out():
    # defaults: 8 slots, 4 per client; a browser reload closes with 1001 (going away), which parks
    # the session for the resume window: parked sessions keep their slot but leave the client's share
    with ServerProc("scripted", "--resume-window-s", "60") as srv:
        for load in range(6):
            ws = await websockets.connect(srv.ws_url + "/v1/realtime")
            ev = await _first_event(ws)
            assert ev["type"] == "session.created", (load, ev)
            if load < 5:
                await ws.close(code=1001)
        h = _health(srv)
        assert h["sessions_open"] == 6 and h["sessions_active"] == 6  # 5 parked + the live page
        await ws.close()


# -- request heads --------------------------------------------------------------------------------

def _raw_exchange(port: int, head: bytes) -> bytes:
    """Send ``head`` (sendall; the server may stop reading) and read the answer until EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=bound(30)) as s:
        try:
            s.sendall(head)
        except OSError:
            pass
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError:
            pass
        return data


def test_request_heads_over_the_cap_get_431_without_memory_growth():
    with ServerProc("scripted", "--max-header-bytes", "65536") as srv:
        assert httpx.get(srv.url + "/health", headers={"X-Fill": "a" * 60_000}).status_code == 200
        rss0 = _rss_kib(srv.proc.pid)
        for i in range(8):
            big = b"b" * (1 << 20)  # 1 MiB
            if i % 2:
                head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + big + b"\r\n\r\n"
            else:  # a WebSocket handshake goes through the same guard
                head = (b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                        b"Sec-WebSocket-Version: 13\r\nX-Big: " + big + b"\r\n\r\n")
            answer = _raw_exchange(srv.port, head)
            assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "request_too_large"
        grown_mib = (_rss_kib(srv.proc.pid) - rss0) / 1024
        assert grown_mib < 16, f"RSS grew {grown_mib:.0f} MiB over 8 refused 1 MiB heads"
        assert httpx.get(srv.url + "/health").status_code == 200


# -- chat bodies ----------------------------------------------------------------------------------

def test_chat_refused_for_capacity_before_its_body_is_read():
    with ServerProc("scripted", "--max-sessions", "1") as srv:
        async def hold_and_post() -> list:
            async with websockets.connect(srv.ws_url + "/v1/realtime") as ws:
                assert (await _first_event(ws))["type"] == "session.created"
                rss0 = _rss_kib(srv.proc.pid)
                answers = []
                for _ in range(8):
                    # 15 MB declared, 64 KiB sent: a server that reads the body before the slot check
                    # waits for the rest (and holds it all in memory); the check comes first now
                    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                            b"Content-Type: application/json\r\nContent-Length: 15000000\r\n\r\n")
                    answers.append(await asyncio.to_thread(_raw_exchange, srv.port, head + b" " * 65536))
                return answers, (_rss_kib(srv.proc.pid) - rss0) / 1024

        answers, grown_mib = asyncio.run(hold_and_post())
        for a in answers:
            assert a.startswith(b"HTTP/1.1 503 "), a[:200]
            assert json.loads(a.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "session_capacity_exhausted"
        assert grown_mib < 16


def test_a_slow_chat_body_gets_408():
    with ServerProc("scripted", "--body-timeout-s", "1") as srv:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"messages\":")
        answer = _raw_exchange(srv.port, head)  # the rest of the body never comes
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        srv.wait_idle()  # its slot is back


# -- a peer that never reads ----------------------------------------------------------------------

def _raw_ws(port: int, path: str) -> socket.socket:
    """A WebSocket client that reads nothing after the handshake: a blocking socket with a small
    receive buffer (libraries read frames in the background; this one never does)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(bound(30))
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                 "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                 "Sec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _frame(text: str) -> bytes:
    """One masked client text frame (RFC 6455 §5.2)."""
    payload = text.encode()
    mask = b"\x01\x02\x03\x04"
    n = len(payload)
    head = b"\x81" + (bytes([0x80 | n]) if n < 126 else b"\xfe" + n.to_bytes(2, "big") if n < 65536
                      else b"\xff" + n.to_bytes(8, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@pytest.mark.parametrize("bound_args,rss_mib", [
    (("--max-outbound-bytes", "65536"), 32),
    (("--outbound-stall-s", "1", "--max-outbound-bytes", str(160 * 2**20)), 128),
], ids=["bytes", "stall"])
def test_a_peer_that_sends_but_never_reads_is_cut_off(bound_args, rss_mib):
    # compat profile, server VAD off, no token cap: the scripted model answers one unit per second of
    # input, as fast as input comes; input goes in far faster than real time; nothing is ever read
    with ServerProc("scripted", "--scripted", "units_per_turn=100000", "--no-session-resume", *bound_args) as srv:
        rss0 = _rss_kib(srv.proc.pid)
        sock = _raw_ws(srv.port, "/v1/realtime")
        second = _frame(json.dumps({"type": "input_audio_buffer.append",
                                    "audio": base64.b64encode(b"\0" * 48000).decode()}))
        try:
            sock.sendall(_frame(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "max_output_tokens": "inf", "audio": {"input": {"turn_detection": None}}}})))
            sock.sendall(second + _frame(json.dumps({"type": "response.create"})))
            sock.settimeout(0.5)
            deadline = time.monotonic() + bound(120)
            next_check = 0.0
            while time.monotonic() < deadline:
                try:  # input as fast as the server takes it
                    sock.sendall(second)
                except (socket.timeout, OSError):
                    time.sleep(0.2)
                if time.monotonic() > next_check:
                    if not _health(srv)["sessions_open"]:
                        break
                    next_check = time.monotonic() + 0.5
            assert _health(srv)["sessions_open"] == 0, "the session of a peer that never reads is still open"
            why = "bytes of server events queued" if "--max-outbound-bytes" == bound_args[0] else "took no data"
            assert "the peer is not reading: " in srv.output() and why in srv.output(), srv.output()[-3000:]
            grown_mib = (_rss_kib(srv.proc.pid) - rss0) / 1024
            assert grown_mib < rss_mib, f"RSS grew {grown_mib:.0f} MiB"
        finally:
            sock.close()


# -- resume journal ---------------------------------------------------------------------------

async def _answer(ws, ack: bool) -> int:
    """Ask for an answer and read it to the end, acknowledging every event when ``ack``; returns
    the last server_event_seq."""
    await ws.send(json.dumps({"type": "response.create"}))
    last = 0
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), bound(60)))
        last = max(last, ev.get("server_event_seq") or 0)
        if ack and ev.get("server_event_seq"):
            await ws.send(json.dumps({"type": "session.event_ack", "server_event_seq": ev["server_event_seq"]}))
        if ev["type"] == "response.done":
            return last


async def test_resume_journal_is_trimmed_by_event_acks():
    # keep-sent long: only acks trim here
    with ServerProc("scripted", "--scripted", "units_per_turn=6", "--resume-keep-sent-s", "3600") as srv:
        async with websockets.connect(srv.ws_url + "/v1/realtime?duplex=1", max_size=None) as ws:
            assert (await _first_event(ws))["type"] == "session.created"
            await _answer(ws, ack=False)
            unacked = _health(srv)["resume_journal_bytes"]
            assert unacked > 6 * 48_000  # six 1-s units of 24 kHz audio, base64
            # one ack of the last event drops everything before it
            last = await _answer(ws, ack=True)
            await ws.send(json.dumps({"type": "session.event_ack", "server_event_seq": last}))
            _wait(lambda: _health(srv)["resume_journal_bytes"] < 4096, "journal trimmed by the acks")


# -- OpenAI SDK -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sdk_server():
    with ServerProc("scripted") as srv:
        yield srv


def test_probes_answer_head(sdk_server):
    for path in ("/ready", "/live", "/health"):
        r = httpx.head(sdk_server.url + path)
        assert r.status_code == 200 and r.content == b"", path


def test_models_retrieve_with_the_openai_sdk(sdk_server):
    import openai

    client = openai.OpenAI(api_key="sk-unused", base_url=sdk_server.url + "/v1")
    for mid in ("scripted", "openbmb/MiniCPM-o-4_5", "gpt-4o-realtime-preview"):
        m = client.models.retrieve(mid)
        assert m.id == mid and m.object == "model" and m.owned_by == "duplexkit"
    with pytest.raises(openai.NotFoundError) as ei:
        client.models.retrieve("no-such-model")
    err = ei.value.body
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    assert "scripted" in err["message"]


def test_plain_openai_chat_is_text_only(sdk_server):
    import openai

    client = openai.OpenAI(api_key="sk-unused", base_url=sdk_server.url + "/v1")
    messages = [{"role": "user", "content": "Hello"}]
    c = client.chat.completions.create(model="gpt-4o", messages=messages)
    assert len(c.choices) == 1 and c.choices[0].message.content == "This is a scripted chat reply."
    assert c.choices[0].message.audio is None
    chars, text = 0, ""
    for chunk in client.chat.completions.create(model="gpt-4o", messages=messages, stream=True):
        chars += len(chunk.model_dump_json())
        for ch in chunk.choices:
            assert ch.index == 0 and getattr(ch.delta, "audio", None) is None
            text += ch.delta.content or ""
    assert text == "This is a scripted chat reply." and chars < 10_000  # no base64 audio
    # audio when asked for in OpenAI's shape ...
    c = client.chat.completions.create(model="gpt-4o-audio-preview", messages=messages,
                                       modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    assert c.choices[0].message.audio.data
    # ... and the vLLM-Omni default behind its dialect
    c = client.chat.completions.create(model="gpt-4o", messages=messages, extra_query={"dialect": "vllm_omni"})
    assert [ch.index for ch in c.choices] == [0, 1] and c.choices[1].message.audio.data
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="gpt-4o", messages=messages, extra_query={"dialect": "nope"})
    assert ei.value.body["param"] == "dialect"
