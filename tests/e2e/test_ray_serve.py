"""duplexkit on Ray Serve (docs/deployment.md, "Ray Serve"): a local Ray cluster, 2 replicas of the
torch-free scripted engine behind Serve's proxy, real WebSocket clients and real speech.

Shown here: sessions spread across replicas (each reports its identity in the
``x-duplexkit-replica`` handshake header and ``/health``), a spoken turn through the proxy, full
replicas refusing with 1013 rather than queueing, a
replica stopped by Serve drains (new sessions go to another replica, the live ones get
``session.closed{reason:"shutdown"}``), and a killed replica's clients get a close and reconnect
through the same endpoint to a live replica.

Costs: the cluster and the first deployment take about 10 s on 2 idle cores (about a minute with both
cores busy). Every wait is on an event (a session opened, refused or closed, Serve reporting a
deployment) with a bound from tests/_timing.py; the only durations the tests rely on are the drain
window :data:`DRAIN_S` and the time :data:`ROUTING_UPDATE_S` Serve's proxy may take to stop routing
to a stopped replica, both scaled by ``DUPLEXKIT_TEST_TIME_SCALE``.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
import websockets
from _timing import bound
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (python -m pip install 'duplexkit[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (python -m pip install 'duplexkit[ray]')")

from duplexkit.audio import read_wav  # noqa: E402
from duplexkit.cli.ray_serve import engine_loader, patient_serve_checks  # noqa: E402
from duplexkit.clients import DuplexClient  # noqa: E402
from duplexkit_server import ServerSettings  # noqa: E402
from duplexkit_server.ray_serve import DEPLOYMENT_NAME, REPLICA_HEADER, RayOptions, build_app  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.timeout(bound(600))]

#: How long a replica Serve stops lets its live sessions go on (``drain_s``). Long enough that
#: several sessions are opened during the drain even when each open takes seconds (loaded machine).
DRAIN_S = bound(16.0)
#: How long after a replica began draining Serve's proxy may still route a new session to it (the
#: controller tells the proxy by a long poll, which lags on a busy machine; Serve itself waits
#: ``graceful_shutdown_wait_loop_s`` for it). Such a session is refused with 1013 (``shutting
#: down``) and the client opens another; after this, no session may reach the draining replica.
ROUTING_UPDATE_S = bound(6.0)
#: Bound for one WebSocket handshake or first event through the proxy.
OPEN_S = bound(60)
# every test client comes from 127.0.0.1: no per-client cap
SETTINGS = ServerSettings(max_sessions=3, max_sessions_per_client=0, drain_s=DRAIN_S, answer_policy="on_request")
ENGINE = engine_loader("scripted", scripted={"units_per_turn": 3})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Requests Serve's proxy may hold while no replica can take them (``max_queued_requests``): room
#: for every probe :func:`test_replicas_stopped_by_serve_drain_and_new_sessions_avoid_them` keeps
#: in flight (:data:`PROBES_MAX`) while a rolled update has no replica in routing.
QUEUED_MAX = 64


def _deploy(replicas: int) -> None:
    """(Re)deploy with ``replicas`` replicas; returns when Serve reports the application running.
    Serve gives every ``serve.run`` a new code version, so each call is a rolling update."""
    serve.run(build_app(ENGINE, SETTINGS, RayOptions(replicas=replicas, cpus_per_replica=0.5,
                                                     max_queued_requests=QUEUED_MAX)),
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
    ws = await websockets.connect(f"ws://{addr}/v1/realtime?duplex=1", open_timeout=OPEN_S)
    created = json.loads(await asyncio.wait_for(ws.recv(), OPEN_S))
    assert created["type"] == "session.created", created
    return ws, ws.response.headers[REPLICA_HEADER], created


async def _until_closed(ws, timeout: float = bound(120)) -> list:
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
        final = await h.wait(bound(120))
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
        health = httpx.get(f"http://{cluster}/health", timeout=OPEN_S)
        assert health.status_code == 200
        assert health.json()["replica"] == health.headers[REPLICA_HEADER] in {tag_a, tag_b}
        assert 1 <= health.json()["sessions_active"] <= 3 and health.json()["sessions_max"] == 3
        await _spoken_turn(cluster, question_wav)
        # every replica's /metrics samples reach Ray's metrics with a replica tag
        capacity = {}
        spoken = 0.0
        async with httpx.AsyncClient() as http, asyncio.timeout(bound(180)):  # the mirror copies every 5 s
            while len(capacity) < 2 or spoken < 3:
                await asyncio.sleep(1)
                try:
                    text = (await http.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=OPEN_S)).text
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


async def _try_open(addr: str, refused: list | None = None, open_s: float = OPEN_S):
    """:func:`_open`, or None when the replica Serve picked refused the session (1013); the refusal
    (replica tag, error event, close code) is appended to ``refused``. ``open_s`` bounds the
    handshake and the first event (each)."""
    ws = await websockets.connect(f"ws://{addr}/v1/realtime?duplex=1", open_timeout=open_s)
    first = json.loads(await asyncio.wait_for(ws.recv(), open_s))
    tag = ws.response.headers[REPLICA_HEADER]
    if first["type"] == "error" and first["error"]["code"] == "session_capacity_exhausted":
        await _until_closed(ws, open_s)
        if refused is not None:
            refused.append((tag, first, ws.close_code))
        return None
    assert first["type"] == "session.created", first
    return ws, tag, first


#: Bound for filling replicas whose slots Serve's router does not see exactly (it samples queue
#: lengths and caches them, and after a redeploy its list of replicas lags Serve's status on a busy
#: machine: it went on sending every session to one full replica for over 8 s under two busy loops):
#: a session sent to a full replica is refused and opened again REFUSED_PAUSE_S later.
FILL_S = bound(120)
REFUSED_PAUSE_S = 0.25


async def _open_on_both(addr: str) -> list:
    """Open sessions until both replicas hold one (Serve's router samples queue lengths; it is not
    bound to alternate). Returns every session opened, the first two on different replicas."""
    opened, refused = [], []
    deadline = asyncio.get_running_loop().time() + FILL_S
    while len({t for _, t, _ in opened}) < 2:
        assert len(opened) < 4, [t for _, t, _ in opened]  # each replica takes 3
        assert asyncio.get_running_loop().time() < deadline, (opened, refused)
        got = await _try_open(addr, refused)
        if got is not None:
            opened.append(got)
        else:
            await asyncio.sleep(REFUSED_PAUSE_S)
    assert all(code == 1013 for _, _, code in refused), refused  # only a full replica refuses here
    second = next(o for o in opened if o[1] != opened[0][1])
    return [opened[0], second] + [o for o in opened[1:] if o is not second]


async def test_full_replicas_refuse_with_1013_instead_of_queueing(cluster):
    """2 replicas x 3 slots: 6 sessions spread 3/3; the 7th is refused by duplexkit at once
    (Serve's max_ongoing_requests is above the cap, so it is not held in Serve's queue)."""
    _deploy(2)
    held: list = []
    deadline = asyncio.get_running_loop().time() + FILL_S
    while len(held) < 6 and asyncio.get_running_loop().time() < deadline:
        got = await _try_open(cluster)  # a session routed to a replica that is already full is refused: try again
        if got is not None:
            held.append(got)
        else:
            await asyncio.sleep(REFUSED_PAUSE_S)
    try:
        assert len(held) == 6
        tags = [t for _, t, _ in held]
        assert sorted(tags.count(t) for t in set(tags)) == [3, 3]
        ws = await websockets.connect(f"ws://{cluster}/v1/realtime?duplex=1", open_timeout=OPEN_S)
        events = await _until_closed(ws, timeout=OPEN_S)
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "session_capacity_exhausted"
        assert ws.close_code == 1013
        # /ready through the proxy says full, whichever replica answers
        r = httpx.get(f"http://{cluster}/ready", timeout=OPEN_S)
        assert r.status_code == 503 and r.json()["status"] == "full" and r.json()["replica"] in tags
    finally:
        for ws, _, _ in held:
            await ws.close()


async def _closed_when(ws, loop) -> tuple[list, float]:
    """Read ``ws`` until it closes: (its events, the loop time the close was seen)."""
    events = await _until_closed(ws, timeout=DRAIN_S + bound(300))
    return events, loop.time()


#: Probes begin every PROBE_PERIOD_S while fewer than PROBES_BRISK are in flight, then every
#: PROBE_HELD_PERIOD_S up to PROBES_MAX in flight (< QUEUED_MAX). Probes pile up when Serve's proxy
#: holds them: in the rolled update below, Serve stops the last old replica and starts the new one
#: at the same moment, so while the new one starts (about 30 s with both cores busy, against about
#: 1 s idle) no replica is in routing and every new session waits in the proxy's queue for the whole
#: drain. The slower pace keeps probes beginning all through that drain without overflowing the
#: queue (then the proxy would refuse them); each is judged by the replica that answers it, late.
PROBE_PERIOD_S = 0.25
PROBE_HELD_PERIOD_S = 1.0
PROBES_BRISK = 8
PROBES_MAX = 48
#: Bound for a probe's handshake: it may wait in the proxy's queue while the new replica starts.
PROBE_OPEN_S = bound(150)


async def _probe(addr: str, loop, log: list) -> None:
    """Open one session and close it; append (start time, replica tag, outcome, answer time) to
    ``log``: ``accepted``, ``shutting_down`` (refused by a replica being stopped) or ``full``
    (refused by a replica whose slots the other probes hold). Anything else fails the test."""
    t0, refused = loop.time(), []
    got = await _try_open(addr, refused, PROBE_OPEN_S)
    if got is None:
        tag, event, code = refused[0]
        assert code == 1013, refused
        msg = event["error"]["message"]
        outcome = "shutting_down" if "shutting down" in msg else "full" if "slots are in use" in msg else msg
        assert outcome in ("shutting_down", "full"), refused
        log.append((t0, tag, outcome, loop.time()))
    else:
        ws, tag, _ = got
        log.append((t0, tag, "accepted", loop.time()))
        await ws.close()


async def test_replicas_stopped_by_serve_drain_and_new_sessions_avoid_them(cluster):
    """Scale in from 2 replicas to 1, which Serve does as a rolled update (every ``serve.run`` is a
    new version): it takes one old replica out of routing and stops it, then stops the other while
    it starts the new one. duplexkit drains each stopped replica for DRAIN_S. Meanwhile probe
    sessions are opened (PROBE_PERIOD_S apart, slower while many wait): while Serve's proxy has not
    yet heard of a stop (at most ROUTING_UPDATE_S) a probe may reach the stopping replica, which
    refuses it with 1013 (``shutting down``); every probe begun after that goes to another replica
    (it may wait in the proxy's queue until the new replica is up). The drained sessions get
    ``session.closed{reason:"shutdown"}`` and 1001 only after the whole DRAIN_S."""
    _deploy(2)
    both = await _open_on_both(cluster)
    (a, tag_a, _), (b, tag_b, _) = both[0], both[1]
    for ws, _, _ in both[2:]:
        await ws.close()
    assert tag_a != tag_b
    loop = asyncio.get_running_loop()
    watch = {tag_a: asyncio.ensure_future(_closed_when(a, loop)), tag_b: asyncio.ensure_future(_closed_when(b, loop))}
    probes: set = set()
    try:
        started = loop.time()
        deploy = asyncio.ensure_future(asyncio.to_thread(_deploy, 1))
        log = []  # (time the probe began, replica tag, outcome, time it was answered)
        deployed_at = None
        # probe until serve.run has returned and the drains have ended: every watched session
        # closed, or 2 x DRAIN_S + ROUTING_UPDATE_S (+ slack) after serve.run returned (a scale-in
        # keeps one session open for good; in a rolled update the second old replica's drain may
        # begin after serve.run returned)
        deadline = loop.time() + bound(300.0)

        def drains_running() -> bool:
            nonlocal deployed_at
            if all(w.done() for w in watch.values()):
                return False
            if deployed_at is None:
                deployed_at = loop.time()
            return loop.time() - deployed_at < 2 * DRAIN_S + ROUTING_UPDATE_S + bound(10.0)

        next_probe = loop.time()
        while (not deploy.done() or drains_running()) and loop.time() < deadline:
            for p in [p for p in probes if p.done()]:
                p.result()  # a probe's failure fails the test
                probes.discard(p)
            if loop.time() >= next_probe and len(probes) < PROBES_MAX:
                probes.add(asyncio.ensure_future(_probe(cluster, loop, log)))
                next_probe = loop.time() + (PROBE_PERIOD_S if len(probes) < PROBES_BRISK else PROBE_HELD_PERIOD_S)
            if deploy.done():  # (a wait on a finished task returns at once: the loop would spin)
                await deploy  # a failed serve.run fails here
                await asyncio.sleep(PROBE_PERIOD_S)
            else:
                await asyncio.wait([deploy], timeout=PROBE_PERIOD_S)
        await deploy  # serve.run returns once the stopped replicas are gone
        await asyncio.gather(*probes)
        drained = {t: w for t, w in watch.items() if w.done()}
        assert drained  # at least one old replica was stopped
        closed_at = {}
        for tag, w in drained.items():  # each drained session got session.closed{shutdown} + 1001
            events, closed_at[tag] = w.result()
            assert events[-1]["type"] == "session.closed" and events[-1]["reason"] == "shutdown", events[-3:]
            assert (a if tag == tag_a else b).close_code == 1001
        for tag, ws in ((tag_a, a), (tag_b, b)):
            if tag not in drained:  # a surviving replica's session is untouched
                await ws.send(json.dumps({"type": "session.heartbeat"}))
                assert ws.close_code is None
        for _, tag, outcome, _ in log:  # "shutting down" only ever came from a replica being stopped
            assert outcome != "shutting_down" or tag in drained, (tag, log)
        rel = sorted((round(t - started, 2), tag, outcome, round(done - t, 2)) for t, tag, outcome, done in log)
        print("probes (began s after the scale-in began, replica, outcome, s to the answer):", rel,
              "closes:", {t: round(e - started, 2) for t, e in closed_at.items()})
        # the drain began at least DRAIN_S before its close; every probe begun from ROUTING_UPDATE_S
        # into it until the close went to another replica, wherever and whenever it was answered
        # (and there were several)
        for tag, end in closed_at.items():
            assert end - started >= DRAIN_S, (tag, end - started, rel)  # the session outlived the drain
            during = [t_tag for t, t_tag, _, _ in log if end - DRAIN_S + ROUTING_UPDATE_S <= t < end]
            assert len(during) >= 3 and tag not in during, (tag, round(end - started, 2), str(rel))
    finally:
        for p in probes:
            p.cancel()
        await a.close()
        await b.close()
        for w in watch.values():
            w.cancel()


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
