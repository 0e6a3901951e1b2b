"""duplexkit on Ray Serve (docs/deployment.md, "Ray Serve"): a local Ray cluster, 2 replicas of the
torch-free scripted engine behind Serve's proxy, real WebSocket clients and real speech.

Shown here: sessions spread across replicas (each reports its identity in the
``x-duplexkit-replica`` handshake header and ``/health``), a spoken turn through the proxy, full
replicas refusing with 1013 rather than queueing, a
replica stopped by Serve drains (new sessions go to another replica, the live ones get
``session.closed{reason:"shutdown"}``), and a killed replica's clients get a close and reconnect
through the same endpoint to a live replica.

Costs: the cluster and the first deployment take about 10 s on 2 cores; each test waits on events
with generous bounds.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (python -m pip install 'duplexkit[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (python -m pip install 'duplexkit[ray]')")

from duplexkit.audio import read_wav  # noqa: E402
from duplexkit.cli.ray_serve import engine_loader, patient_serve_checks  # noqa: E402
from duplexkit.clients import DuplexClient  # noqa: E402
from duplexkit_server import ServerSettings  # noqa: E402
from duplexkit_server.ray_serve import DEPLOYMENT_NAME, REPLICA_HEADER, RayOptions, build_app  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

DRAIN_S = 8.0
# every test client comes from 127.0.0.1: no per-client cap
SETTINGS = ServerSettings(max_sessions=3, max_sessions_per_client=0, drain_s=DRAIN_S, answer_policy="on_request")
ENGINE = engine_loader("scripted", scripted={"units_per_turn": 3})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deploy(replicas: int) -> None:
    """(Re)deploy with ``replicas`` replicas; returns when Serve reports the application running."""
    serve.run(build_app(ENGINE, SETTINGS, RayOptions(replicas=replicas, cpus_per_replica=0.5)),
              name=DEPLOYMENT_NAME, route_prefix="/")


METRICS_PORT = _free_port()  # the Ray node's metrics agent (ray_duplexkit_* series of every replica)


@pytest.fixture(scope="module")
def cluster():
    patient_serve_checks()  # a slow proxy start on a loaded machine is not a failure
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=METRICS_PORT)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _deploy(2)
        yield f"127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


async def _open(addr: str):
    """A raw realtime session through the proxy: (socket, replica tag, session.created)."""
    ws = await websockets.connect(f"ws://{addr}/v1/realtime?duplex=1", open_timeout=60)
    created = json.loads(await asyncio.wait_for(ws.recv(), 60))
    assert created["type"] == "session.created", created
    return ws, ws.response.headers[REPLICA_HEADER], created


async def _until_closed(ws, timeout: float = 120.0) -> list:
    """Read events until the socket closes; returns them (the close is in ``ws.close_code``)."""
    got = []
    async with asyncio.timeout(timeout):
        try:
            while True:
                got.append(json.loads(await ws.recv()))
        except websockets.ConnectionClosed:
            return got


async def _spoken_turn(addr: str, wav) -> None:
    """One full turn through the proxy with duplexkit's own client and real speech."""
    speech = read_wav(wav, 16_000)[0]
    async with DuplexClient(f"ws://{addr}") as c:
        for i in range(0, len(speech), 3200):
            await c.send_audio(speech[i:i + 3200], rate=16_000)
        await c.commit()
        h = await c.create_response()
        final = await h.wait(120)
        assert final.response.status == "completed"
        assert h.audio_samples == 72000  # 3 scripted units of 24 kHz audio
        assert h.transcript.startswith("Hello there")


async def test_sessions_spread_across_replicas_and_a_turn_goes_through_the_proxy(cluster, question_wav):
    _deploy(2)
    # Serve's router (power of two choices on queue lengths it samples) is not bound to alternate:
    # open sessions until both replicas hold one (each replica takes 3, so at most 4 opens)
    opened = await _open_on_both(cluster)
    tag_a, tag_b = opened[0][1], opened[1][1]
    try:
        assert tag_a != tag_b
        health = httpx.get(f"http://{cluster}/health", timeout=60)
        assert health.status_code == 200
        assert health.json()["replica"] == health.headers[REPLICA_HEADER] in {tag_a, tag_b}
        assert 1 <= health.json()["sessions_active"] <= 3 and health.json()["sessions_max"] == 3
        await _spoken_turn(cluster, question_wav)
        # every replica's /metrics samples reach Ray's metrics with a replica tag
        capacity = {}
        spoken = 0.0
        async with httpx.AsyncClient() as http:
            while len(capacity) < 2 or spoken < 3:  # the mirror copies every 5 s; the test timeout bounds it
                await asyncio.sleep(1)
                try:
                    text = (await http.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=30)).text
                except httpx.HTTPError:
                    continue
                for fam in text_string_to_metric_families(text):
                    for smp in fam.samples:
                        if smp.name == "ray_duplexkit_sessions_capacity" and smp.labels.get("replica") in (tag_a, tag_b):
                            capacity[smp.labels["replica"]] = smp.value
                        if smp.name == "ray_duplexkit_units_decided_total" and smp.labels.get("decision") == "speak":
                            spoken = max(spoken, smp.value)
        assert capacity == {tag_a: 3.0, tag_b: 3.0} and spoken == 3.0  # the turn's 3 scripted units
    finally:
        for ws, _, _ in opened:
            await ws.close()


async def _try_open(addr: str):
    """:func:`_open`, or None when the replica Serve picked refused the session (1013: full)."""
    ws = await websockets.connect(f"ws://{addr}/v1/realtime?duplex=1", open_timeout=60)
    first = json.loads(await asyncio.wait_for(ws.recv(), 60))
    if first["type"] == "error" and first["error"]["code"] == "session_capacity_exhausted":
        await ws.close()
        return None
    assert first["type"] == "session.created", first
    return ws, ws.response.headers[REPLICA_HEADER], first


async def _open_on_both(addr: str) -> list:
    """Open sessions until both replicas hold one (Serve's router samples queue lengths; it is not
    bound to alternate). Returns every session opened, the first two on different replicas."""
    opened = []
    while len({t for _, t, _ in opened}) < 2:
        assert len(opened) < 4, [t for _, t, _ in opened]  # each replica takes 3
        opened.append(await _open(addr))
    second = next(o for o in opened if o[1] != opened[0][1])
    return [opened[0], second] + [o for o in opened[1:] if o is not second]


async def test_full_replicas_refuse_with_1013_instead_of_queueing(cluster):
    """2 replicas x 3 slots: 6 sessions spread 3/3; the 7th is refused by duplexkit at once
    (Serve's max_ongoing_requests is above the cap, so it is not held in Serve's queue)."""
    _deploy(2)
    held: list = []
    for _ in range(12):  # a session routed to a replica that is already full is refused: try again
        if len(held) == 6:
            break
        got = await _try_open(cluster)
        if got is not None:
            held.append(got)
    try:
        assert len(held) == 6
        tags = [t for _, t, _ in held]
        assert sorted(tags.count(t) for t in set(tags)) == [3, 3]
        ws = await websockets.connect(f"ws://{cluster}/v1/realtime?duplex=1", open_timeout=60)
        events = await _until_closed(ws, timeout=60)
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "session_capacity_exhausted"
        assert ws.close_code == 1013
        # /ready through the proxy says full, whichever replica answers
        r = httpx.get(f"http://{cluster}/ready", timeout=60)
        assert r.status_code == 503 and r.json()["status"] == "full" and r.json()["replica"] in tags
    finally:
        for ws, _, _ in held:
            await ws.close()


async def test_replicas_stopped_by_serve_drain_and_new_sessions_avoid_them(cluster):
    _deploy(2)
    both = await _open_on_both(cluster)
    (a, tag_a, _), (b, tag_b, _) = both[0], both[1]
    for ws, _, _ in both[2:]:
        await ws.close()
    assert tag_a != tag_b
    loop = asyncio.get_running_loop()
    try:
        # scale in to one replica (Serve may also roll both to a new version): Serve takes the
        # replica(s) it stops out of routing and stops them gracefully; duplexkit drains for DRAIN_S
        deploy = asyncio.ensure_future(asyncio.to_thread(_deploy, 1))
        attempts = []  # (time, replica tag) of sessions opened meanwhile
        closed_at = {}  # replica tag -> when its session was first seen closed
        while not deploy.done():
            # every one must be accepted: a draining duplexkit replica refuses new sessions with 1013
            ws, tag, _ = await _open(cluster)
            attempts.append((loop.time(), tag))
            await ws.close()
            for t, w in ((tag_a, a), (tag_b, b)):
                if w.close_code is not None:
                    closed_at.setdefault(t, loop.time())
            if a.close_code is None or b.close_code is None:
                await asyncio.sleep(0.2)
            else:
                await asyncio.wait([deploy], timeout=60)
        await deploy  # serve.run returns once the stopped replicas are gone
        drained = {t: ws for t, ws in ((tag_a, a), (tag_b, b)) if ws.close_code is not None}
        assert drained  # at least one old replica was stopped
        for tag, ws in drained.items():  # each drained session got session.closed{shutdown} + 1001
            events = await _until_closed(ws)
            assert events[-1]["type"] == "session.closed" and events[-1]["reason"] == "shutdown", events[-3:]
            assert ws.close_code == 1001
        for tag, ws in ((tag_a, a), (tag_b, b)):
            if tag not in drained:  # a surviving replica's session is untouched
                await ws.send(json.dumps({"type": "session.heartbeat"}))
                assert ws.close_code is None
        # each drain lasted DRAIN_S before its close: sessions opened in its last part went elsewhere
        for tag in drained:
            during = [t_tag for t, t_tag in attempts if closed_at[tag] - DRAIN_S / 2 < t < closed_at[tag]]
            assert len(during) >= 3 and tag not in during, (tag, attempts)
    finally:
        await a.close()
        await b.close()


async def test_a_killed_replicas_clients_get_a_close_and_reconnect_to_a_live_replica(cluster, question_wav):
    _deploy(2)
    both = await _open_on_both(cluster)
    (a, tag_a, _), (b, tag_b, _) = both[0], both[1]
    for ws, _, _ in both[2:]:
        await ws.close()
    assert tag_a != tag_b
    try:
        victim = ray.get_actor(f"SERVE_REPLICA::{DEPLOYMENT_NAME}#{DEPLOYMENT_NAME}#{tag_a}", namespace="serve")
        ray.kill(victim, no_restart=True)
        await _until_closed(a)  # the client is told: its connection ends
        assert a.close_code == 1006  # the proxy drops the connection without a close frame
        # the other replica's session goes on
        assert b.close_code is None
        await b.send(json.dumps({"type": "session.heartbeat"}))
        # reconnect through the same endpoint: a live replica takes the new session
        c, tag_c, _ = await _open(cluster)
        assert tag_c != tag_a
        await c.close()
        await _spoken_turn(cluster, question_wav)
    finally:
        await a.close()
        await b.close()
