"""Session resume within a replica (docs/protocol.md §1.6) through a real TCP proxy that
cuts the connection (RST, no close frame: the client sees 1006) while audio deltas stream.

A real uvicorn server (in-process, ScriptedEngine) sits behind :class:`CuttingProxy`; the bundled
:class:`DuplexClient` talks through the proxy. Counts are in events and samples, never in wall time.
"""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import websockets

from duplexkit.audio import read_wav
from duplexkit.clients import DuplexClient
from duplexkit.errors import DuplexConnectionError
from duplexkit.testing import ScriptedEngine
from duplexkit_server import ServerSettings, create_app

from _loopback import CuttingProxy, inprocess_server
from _timing import bound

pytestmark = pytest.mark.e2e

UNITS = 5
AUDIO_MARK = b'"response.output_audio.delta"'


def _settings(**kw) -> ServerSettings:
    base = dict(answer_policy="on_request", silence_slack_ms=0, tick_interval_s=0.05, resume_window_s=60.0)
    base.update(kw)
    return ServerSettings(**base)


async def _collect(client, sink: list, during_reconnect: list = None) -> None:
    try:
        async for ev in client.events():
            sink.append(ev)
            if during_reconnect is not None and ev.type == "client.reconnecting":
                # the application calls while the client is reconnecting: the call waits, then is answered
                assert client.connection_state == "reconnecting"
                during_reconnect.append(asyncio.get_running_loop().create_task(client.heartbeat()))
    except DuplexConnectionError as exc:
        sink.append(exc)


async def _speak(client, fixtures_audio, seconds: float = 1.2) -> None:
    speech, _ = read_wav(fixtures_audio / "question_16k.wav", 24_000)
    x = speech[: int(seconds * 24_000)]
    for i in range(0, len(x), 2400):
        await client.send_audio(x[i:i + 2400], rate=24_000)


async def test_resume_through_a_cut_mid_response(fixtures_audio):
    engine = ScriptedEngine(units_per_turn=UNITS)
    app = create_app(engine=engine, settings=_settings())
    state = app.state.duplexkit
    async with inprocess_server(app) as port:
        proxy = await CuttingProxy(port, cut_after=(AUDIO_MARK, 2)).start()
        client = DuplexClient(f"ws://127.0.0.1:{proxy.port}", heartbeat_s=None, input_rate=24_000,
                              session={"instructions": "Be brief.", "turn_detection": None})
        events: list = []
        try:
            await client.connect()
            assert client.supports_resume and client.resume_token
            calls: list = []
            reader = asyncio.get_running_loop().create_task(_collect(client, events, calls))
            await _speak(client, fixtures_audio)
            handle = await client.create_response()
            await handle.wait(timeout=bound(120))  # generous: the cut + resume happen inside
            assert proxy.cuts == 1 and proxy.connections == 2
            assert len(calls) == 1 and (await calls[0]).type == "session.heartbeat_ack"
            assert client.connection_state == "open"
            # playback went on through the cut: every sample of the answer is heard, once
            assert await handle.wait_heard(timeout=bound(120)) == 1000 * UNITS == handle.audio_ms
            # the session and its formats survived: more input in the declared 24 kHz format is taken
            conn = next(iter(state.connections))
            assert conn.resumes == 1 and conn.session.settings.instructions == "Be brief."
            assert conn.session.settings.input_format.rate == 24_000
            before = conn.session.input_audio_ms
            await _speak(client, fixtures_audio, 0.5)
            ack = await client.heartbeat()  # a request answered over the new connection
            assert ack.type == "session.heartbeat_ack"
            assert 480 <= conn.session.input_audio_ms - before <= 510  # the streaming resampler holds back a few ms
        finally:
            await client.close()
            await proxy.close()
        await asyncio.wait_for(reader, bound(30))
    kinds = [getattr(e, "type", type(e).__name__) for e in events]
    assert "client.reconnecting" in kinds and "session.resumed" in kinds, kinds
    assert kinds.index("client.reconnecting") < kinds.index("session.resumed")
    seqs = [e.server_event_seq for e in events if getattr(e, "server_event_seq", None) is not None]
    assert seqs == list(range(1, len(seqs) + 1)), seqs  # every event exactly once, in order
    assert kinds.count("response.created") == kinds.count("response.done") == 1
    done = next(e for e in events if getattr(e, "type", "") == "response.done")
    assert done.response.status == "completed"
    deltas = [e for e in events if getattr(e, "type", "") == "response.output_audio.delta"]
    got = sum(len(base64.b64decode(e.delta)) // 2 for e in deltas)
    assert got == handle.audio_samples == 24_000 * UNITS  # ScriptedEngine: exactly 1 s per unit
    resumed = kinds.index("session.resumed")
    assert events[resumed].replayed >= 1  # the delta cut in half on the old connection came again
    assert any(k == "response.output_audio.delta" for k in kinds[:resumed - 1])  # the cut was mid-response
    assert client.resumes == 1 and state.resumes.resumes == 1
    assert client.close_reason == "client_close"


async def _raw_resume(port: int, data: dict, headers=None) -> list[dict]:
    """Open a connection, send ``data`` as the first frame, return every frame until close."""
    url = f"ws://127.0.0.1:{port}/v1/realtime?duplex=1&autostart=0"
    got = []
    async with websockets.connect(url, additional_headers=headers) as ws:
        await ws.send(json.dumps(data))
        try:
            while True:
                got.append(json.loads(await asyncio.wait_for(ws.recv(), bound(30))))
        except websockets.exceptions.ConnectionClosed as exc:
            got.append({"close_code": exc.rcvd.code if exc.rcvd else None})
    return got


async def _open_and_drop(port: int, key: str = None) -> tuple[dict, int]:
    """A raw session that is opened, then dropped without a close frame. Returns
    ``(session.created frame, last seq seen)``."""
    url = f"ws://127.0.0.1:{port}/v1/realtime?duplex=1&autostart=0"
    headers = {"Authorization": f"Bearer {key}"} if key else None
    ws = await websockets.connect(url, additional_headers=headers)
    await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "x"}}))
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created" and created["resume_token"], created
    ws.transport.abort()  # no close frame: 1006 on the server side
    return created, created["server_event_seq"]


async def _wait_parked(state, n: int = 1) -> None:
    for _ in range(2000):
        if state.resumes.parked >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the session was never parked")


async def test_resume_refused_wrong_token_wrong_key_then_right_one():
    app = create_app(engine=ScriptedEngine(), settings=_settings(api_keys=["key-a", "key-b"]))
    state = app.state.duplexkit
    async with inprocess_server(app) as port:
        created, seq = await _open_and_drop(port, "key-a")
        await _wait_parked(state)
        sid, token = created["session"]["id"], created["resume_token"]
        base = {"type": "session.resume", "event_id": "cevt_1", "session_id": sid, "last_server_event_seq": seq}
        bad = await _raw_resume(port, {**base, "resume_token": "not-the-token"}, {"Authorization": "Bearer key-a"})
        assert bad[0]["error"]["code"] == "resume_unauthorized" and bad[0]["error"]["event_id"] == "cevt_1"
        assert bad[-1]["close_code"] == 1008
        other = await _raw_resume(port, {**base, "resume_token": token}, {"Authorization": "Bearer key-b"})
        assert other[0]["error"]["code"] == "resume_not_found" and other[-1]["close_code"] == 1008
        assert state.resumes.parked == 1  # refusals leave the parked session alone
        # the right key and token: accepted, with a fresh token; the old token stops working
        url = f"ws://127.0.0.1:{port}/v1/realtime?duplex=1&autostart=0"
        async with websockets.connect(url, additional_headers={"Authorization": "Bearer key-a"}) as ws:
            await ws.send(json.dumps({**base, "resume_token": token}))
            resumed = json.loads(await ws.recv())
            assert resumed["type"] == "session.resumed" and resumed["replayed"] == 0
            assert resumed["resume_token"] != token
            await ws.send(json.dumps({"type": "session.heartbeat"}))
            ack = json.loads(await ws.recv())
            assert ack["type"] == "session.heartbeat_ack" and ack["server_event_seq"] == seq + 1
            ws.transport.abort()
        await _wait_parked(state)
        stale = await _raw_resume(port, {**base, "resume_token": token}, {"Authorization": "Bearer key-a"})
        assert stale[0]["error"]["code"] == "resume_unauthorized"
    assert state.resumes.refused == {"resume_unauthorized": 2, "resume_not_found": 1}


async def test_resume_after_window_expiry_is_refused_and_slot_freed():
    app = create_app(engine=ScriptedEngine(), settings=_settings(resume_window_s=0.3, max_sessions=1))
    state = app.state.duplexkit
    async with inprocess_server(app) as port:
        created, seq = await _open_and_drop(port)
        await _wait_parked(state)
        for _ in range(3000):  # the window passes; the session is closed and its slot freed
            if state.slots.used == 0 and not state.connections:
                break
            await asyncio.sleep(0.01)
        assert state.slots.used == 0 and not state.connections
        got = await _raw_resume(port, {"type": "session.resume", "session_id": created["session"]["id"],
                                       "resume_token": created["resume_token"], "last_server_event_seq": seq})
        assert got[0]["error"]["code"] == "resume_expired", got
        assert got[1]["type"] == "session.closed" and got[1]["reason"] == "timeout"
        # the freed slot takes a new session (max_sessions=1)
        client = DuplexClient(f"ws://127.0.0.1:{port}", heartbeat_s=None)
        await client.connect()
        await client.close()


async def test_resume_of_unknown_session_and_the_client_error():
    app = create_app(engine=ScriptedEngine(), settings=_settings())
    async with inprocess_server(app) as port:
        got = await _raw_resume(port, {"type": "session.resume", "session_id": "sess_nope", "resume_token": "t",
                                       "last_server_event_seq": 0})
        assert got[0]["error"]["code"] == "resume_not_found" and got[-1]["close_code"] == 1008


async def test_journal_overflow_ends_the_session(fixtures_audio):
    """A journal of 8 events cannot hold a 5-unit response produced while the client is away: the
    parked session is closed at once (slot freed) and the resume is refused with
    ``resume_journal_overflow`` + ``session.closed``; the client's events() raise that code."""
    engine = ScriptedEngine(units_per_turn=UNITS)
    app = create_app(engine=engine, settings=_settings(resume_journal_events=8))
    state = app.state.duplexkit
    async with inprocess_server(app) as port:
        proxy = await CuttingProxy(port, cut_after=(AUDIO_MARK, 1)).start()
        proxy.block_after_cut = True  # the client cannot get back in until the journal has overflowed
        client = DuplexClient(f"ws://127.0.0.1:{proxy.port}", heartbeat_s=None, input_rate=24_000,
                              session={"turn_detection": None}, resume_attempts=60)
        events: list = []
        try:
            await client.connect()
            reader = asyncio.get_running_loop().create_task(_collect(client, events))
            await _speak(client, fixtures_audio)
            handle = await client.create_response()
            for _ in range(6000):  # the parked session overflows its journal and is closed
                if proxy.cuts and not state.connections:
                    break
                await asyncio.sleep(0.01)
            assert proxy.cuts == 1 and not state.connections and state.slots.used == 0
            proxy.blocked = False
            with pytest.raises(DuplexConnectionError) as ei:
                await handle.wait(timeout=bound(120))
            assert ei.value.code == "resume_journal_overflow", ei.value
        finally:
            await client.close()
            await proxy.close()
        await asyncio.wait_for(reader, bound(30))
        assert isinstance(events[-1], DuplexConnectionError) and events[-1].code == "resume_journal_overflow"
        for _ in range(1000):
            if not state.connections:
                break
            await asyncio.sleep(0.01)
        assert not state.connections and state.slots.used == 0
        assert state.resumes.refused.get("resume_journal_overflow", 0) >= 1


async def test_resume_off_advertises_false():
    app = create_app(engine=ScriptedEngine(), settings=_settings(session_resume=False))
    async with inprocess_server(app) as port:
        async with DuplexClient(f"ws://127.0.0.1:{port}", heartbeat_s=None) as client:
            assert client.supports_resume is False and client.resume_token is None


async def test_resume_takes_over_a_connection_the_server_still_thinks_alive():
    """A half-open connection (the client's network vanished; the server saw nothing): a valid
    resume on a new connection takes the session over and closes the old socket with 1001."""
    app = create_app(engine=ScriptedEngine(), settings=_settings())
    state = app.state.duplexkit
    async with inprocess_server(app) as port:
        url = f"ws://127.0.0.1:{port}/v1/realtime?duplex=1&autostart=0"
        old = await websockets.connect(url)
        await old.send(json.dumps({"type": "session.update", "session": {"instructions": "x"}}))
        created = json.loads(await old.recv())
        await old.send(json.dumps({"type": "session.heartbeat"}))
        assert json.loads(await old.recv())["server_event_seq"] == 2
        assert state.resumes.parked == 0
        async with websockets.connect(url) as new:
            await new.send(json.dumps({"type": "session.resume", "session_id": created["session"]["id"],
                                       "resume_token": created["resume_token"], "last_server_event_seq": 1}))
            resumed = json.loads(await new.recv())
            assert resumed["type"] == "session.resumed" and resumed["replayed"] == 1
            replay = json.loads(await new.recv())
            assert replay["type"] == "session.heartbeat_ack" and replay["server_event_seq"] == 2
            with pytest.raises(websockets.exceptions.ConnectionClosed) as ei:
                await asyncio.wait_for(old.recv(), bound(30))
            assert ei.value.rcvd.code == 1001
            await new.send(json.dumps({"type": "session.close"}))
            closed = json.loads(await new.recv())
            assert closed["type"] == "session.closed" and closed["server_event_seq"] == 3
        assert len(state.connections) <= 1
        for _ in range(1000):
            if not state.connections and state.slots.used == 0:
                break
            await asyncio.sleep(0.01)
        assert not state.connections and state.slots.used == 0


async def test_a_full_server_still_takes_the_resume_of_its_parked_session():
    app = create_app(engine=ScriptedEngine(), settings=_settings(max_sessions=1))
    state = app.state.duplexkit
    async with inprocess_server(app) as port:
        created, seq = await _open_and_drop(port)
        await _wait_parked(state)
        assert state.slots.used == 1  # the parked session keeps its slot
        # a new session is refused (full), even on an autostart=0 connection of the same principal
        with pytest.raises(DuplexConnectionError) as ei:
            await DuplexClient(f"ws://127.0.0.1:{port}", heartbeat_s=None).connect()
        assert ei.value.code == "session_capacity_exhausted"
        url = f"ws://127.0.0.1:{port}/v1/realtime?duplex=1&autostart=0"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "session.resume", "session_id": created["session"]["id"],
                                      "resume_token": created["resume_token"], "last_server_event_seq": seq}))
            assert json.loads(await ws.recv())["type"] == "session.resumed"
            assert state.slots.used == 1 and state.resumes.parked == 0
            await ws.send(json.dumps({"type": "session.close"}))
            assert json.loads(await ws.recv())["type"] == "session.closed"


async def test_client_frames_lost_with_the_connection_are_sent_again(fixtures_audio):
    """Frames the client wrote into a connection that then died (they never reached the server)
    are re-sent after the resume: the server says how many it processed (``session.resumed``
    ``client_frames_received``). A request among them is answered; audio among them is heard."""
    app = create_app(engine=ScriptedEngine(), settings=_settings())
    state = app.state.duplexkit
    async with inprocess_server(app) as port:
        proxy = await CuttingProxy(port).start()
        client = DuplexClient(f"ws://127.0.0.1:{proxy.port}", heartbeat_s=None, input_rate=24_000,
                              session={"turn_detection": None})
        try:
            await client.connect()
            conn = next(iter(state.connections))
            await _speak(client, fixtures_audio, 0.5)
            await client.heartbeat()
            before_ms, before_frames = conn.session.input_audio_ms, conn.client_frames
            proxy.blackhole = True  # from here the client's frames are lost in flight
            await _speak(client, fixtures_audio, 0.5)  # 5 appends, written to the socket "successfully"
            ping = asyncio.get_running_loop().create_task(client.heartbeat())
            for _ in range(1000):
                if proxy.bytes_dropped and client._frames_sent >= before_frames + 6:
                    break
                await asyncio.sleep(0.01)
            assert conn.client_frames == before_frames  # none of them arrived
            proxy.blackhole = False
            proxy.cut_now()
            ack = await asyncio.wait_for(ping, bound(60))
            assert ack.type == "session.heartbeat_ack"
            assert client.resumes == 1 and client.frames_resent == 6
            assert conn.client_frames == before_frames + 6
            assert 480 <= conn.session.input_audio_ms - before_ms <= 510  # the lost audio arrived once
        finally:
            await client.close()
            await proxy.close()


async def test_a_draining_replica_refuses_new_sessions_but_takes_resumes(fixtures_audio):
    """SIGTERM's drain (duplexkit_server.lifecycle.drain) refuses new sessions; a live session whose
    connection drops during the drain can still resume, and the drain ends when it closes."""
    from duplexkit_server.lifecycle import drain

    engine = ScriptedEngine(units_per_turn=UNITS)
    app = create_app(engine=engine, settings=_settings())
    state = app.state.duplexkit
    async with inprocess_server(app) as port:
        proxy = await CuttingProxy(port, cut_after=(AUDIO_MARK, 2)).start()
        client = DuplexClient(f"ws://127.0.0.1:{proxy.port}", heartbeat_s=None, input_rate=24_000,
                              session={"turn_detection": None})
        events: list = []
        drained = None
        try:
            await client.connect()
            reader = asyncio.get_running_loop().create_task(_collect(client, events))
            drained = asyncio.get_running_loop().create_task(drain(state, 120))
            while not state.draining:
                await asyncio.sleep(0.01)
            # a new session is refused while draining
            with pytest.raises(websockets.exceptions.ConnectionClosed) as refused:
                async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1") as ws:
                    while True:
                        await asyncio.wait_for(ws.recv(), bound(30))
            assert refused.value.rcvd.code == 1013 and "session_capacity_exhausted" in refused.value.rcvd.reason
            await _speak(client, fixtures_audio)
            handle = await client.create_response()
            await handle.wait(timeout=bound(120))
            assert proxy.cuts == 1 and proxy.connections == 2 and client.resumes == 1
            assert handle.status == "completed" and handle.audio_samples == 24_000 * UNITS
            assert not drained.done()  # the live session keeps the replica draining
        finally:
            await client.close()
            await proxy.close()
        assert await asyncio.wait_for(drained, bound(30)) == 0  # it finished by itself: nothing left to close
        await asyncio.wait_for(reader, bound(30))
