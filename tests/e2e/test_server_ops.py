"""Operability of a real ``duplexkit serve scripted`` process over real sockets (docs/deployment.md,
"Probes", "Metrics", "Runbook"): the Prometheus scrape moves after a spoken turn, ``/ready`` flips to
503 when the slots are full and while draining, and SIGTERM drains: new sessions are refused, the
live one goes on until ``--drain-s`` ends and then gets ``session.closed{reason:"shutdown"}``, exit 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from duplexkit.audio import read_wav
from duplexkit.clients import DuplexClient

from _serverproc import ServerProc
from _timing import bound

pytestmark = pytest.mark.e2e


def scrape(url: str, headers: dict | None = None) -> dict:
    """``/metrics`` -> {(sample name, sorted label items): value}."""
    r = httpx.get(url + "/metrics", headers=headers or {}, timeout=bound(10))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


async def _recv_until(ws, type_: str, timeout: float = 30.0) -> list:
    got = []
    async with asyncio.timeout(timeout):
        while True:
            ev = json.loads(await ws.recv())
            got.append(ev)
            if ev["type"] == type_:
                return got


@pytest.fixture(scope="module")
def one_slot_server():
    """Scripted engine, answers on request, 3 units per turn, ONE slot, metrics behind the key."""
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=3",
                    "--max-sessions", "1", "--api-key", "k1") as srv:
        yield srv


AUTH = {"Authorization": "Bearer k1"}


async def test_metrics_move_after_a_spoken_turn_and_ready_flips_when_full(one_slot_server, question_wav):
    srv = one_slot_server
    # /metrics follows the API key setting (--metrics auth, the default); the probes need no key
    assert httpx.get(srv.url + "/metrics", timeout=bound(10)).status_code == 401
    r = httpx.get(srv.url + "/ready", timeout=bound(10))
    assert r.status_code == 200 and r.json() == {"status": "ready", "sessions_active": 0, "sessions_max": 1}
    assert httpx.get(srv.url + "/live", timeout=bound(10)).json()["status"] == "alive"
    before = scrape(srv.url, AUTH)
    assert val(before, "duplexkit_sessions_capacity") == 1 and val(before, "duplexkit_ready") == 1

    speech = read_wav(question_wav, 16_000)[0]
    async with DuplexClient(srv.ws_url, api_key="k1") as c:
        # the only slot is taken: readiness says "full", a second session is refused with 1013
        r = httpx.get(srv.url + "/ready", timeout=bound(10))
        assert r.status_code == 503 and r.json()["status"] == "full" and r.json()["sessions_active"] == 1
        assert r.headers["retry-after"] == "1"
        assert httpx.get(srv.url + "/health", timeout=bound(10)).status_code == 200  # /health is unchanged
        async with websockets.connect(srv.ws_url + "/v1/realtime?duplex=1", additional_headers=AUTH) as ws2:
            with pytest.raises(websockets.ConnectionClosed) as ei:
                await _recv_until(ws2, "never")
            assert ei.value.rcvd.code == 1013
        chat = httpx.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=bound(10),
                          json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503
        for i in range(0, len(speech), 3200):
            await c.send_audio(speech[i:i + 3200], rate=16_000)
        await c.commit()
        h = await c.create_response()
        final = await h.wait(bound(30))
        assert final.response.status == "completed" and h.audio_samples == 72000
        mid = scrape(srv.url, AUTH)
        assert val(mid, "duplexkit_sessions_active") == 1 and val(mid, "duplexkit_ready") == 0
    for _ in range(100):  # the slot is released when the socket ends
        if httpx.get(srv.url + "/ready", timeout=bound(10)).status_code == 200:
            break
        await asyncio.sleep(0.1)
    assert httpx.get(srv.url + "/ready", timeout=bound(10)).status_code == 200
    # a bad append in a new session: one realtime error by its §9 code
    async with websockets.connect(srv.ws_url + "/v1/realtime?duplex=1", additional_headers=AUTH) as ws:
        await _recv_until(ws, "session.created")
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "!!not base64"}))
        await _recv_until(ws, "error")
    # a compat-profile session's cancel race goes out under OpenAI's name and is counted under duplexkit's
    async with websockets.connect(srv.ws_url + "/v1/realtime", additional_headers=AUTH) as ws:
        await _recv_until(ws, "session.created")
        await ws.send(json.dumps({"type": "response.cancel"}))
        assert (await _recv_until(ws, "error"))[-1]["error"]["code"] == "response_cancel_not_active"

    after = scrape(srv.url, AUTH)
    d = lambda name, **lb: val(after, name, **lb) - val(before, name, **lb)  # noqa: E731
    assert d("duplexkit_realtime_sessions_total") == 3
    # the turn: 3 speaking units (units_per_turn=3) and the listening units of 3.5 s of speech
    assert d("duplexkit_units_decided_total", decision="speak") == 3
    assert d("duplexkit_units_decided_total", decision="listen") >= 3
    n_units = d("duplexkit_units_decided_total", decision="speak") + d("duplexkit_units_decided_total",
                                                                        decision="listen")
    # one UnitTimings per decided unit (the last one may be cut off by the close)
    assert n_units - 1 <= d("duplexkit_unit_latency_seconds_count") <= n_units
    assert d("duplexkit_stage_latency_seconds_count", stage="queue") == d("duplexkit_unit_latency_seconds_count")
    assert d("duplexkit_ttfp_seconds_count", trigger="client") == 1
    assert 0 < d("duplexkit_ttfp_seconds_sum", trigger="client") < 60
    assert d("duplexkit_errors_total", code="session_capacity_exhausted", where="handshake") == 1
    assert d("duplexkit_errors_total", code="session_capacity_exhausted", where="http") == 1
    assert d("duplexkit_errors_total", code="bad_audio", where="realtime") == 1
    assert d("duplexkit_errors_total", code="response_not_active", where="realtime") == 1
    assert d("duplexkit_errors_total", code="response_cancel_not_active", where="realtime") == 0
    assert d("duplexkit_errors_total", code="unauthorized", where="http") == 0  # /metrics 401s are not counted
    assert val(after, "duplexkit_units_behind_max") == 0 and val(after, "duplexkit_sessions_active") == 0
    # the scripted engine never imports torch and has no KV pool: no GPU or KV series
    assert not [k for k in after if k[0].startswith(("duplexkit_gpu_memory_bytes", "duplexkit_kv_"))]


async def test_sigterm_drains_then_closes_the_live_session_with_shutdown():
    # the checks below all happen during the drain: it must outlast them on a busy machine too
    drain_s = bound(10.0)
    srv = ServerProc("scripted", "--drain-s", f"{drain_s:g}s", "--metrics", "public")
    try:
        async with websockets.connect(srv.ws_url + "/v1/realtime?duplex=1") as ws:
            await _recv_until(ws, "session.created")
            t_sig = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            # readiness flips to 503 "draining" at once; liveness and the scrape still answer
            for _ in range(100):
                r = httpx.get(srv.url + "/ready", timeout=bound(10))
                if r.status_code == 503:
                    break
                await asyncio.sleep(0.05)
            assert r.status_code == 503 and r.json()["status"] == "draining", r.text
            assert httpx.get(srv.url + "/live", timeout=bound(10)).status_code == 200
            assert httpx.get(srv.url + "/health", timeout=bound(10)).json()["status"] == "shutting_down"
            m = scrape(srv.url)
            assert val(m, "duplexkit_draining") == 1 and val(m, "duplexkit_sessions_active") == 1
            # new sessions are refused during the drain: error{session_capacity_exhausted}, close 1013
            async with websockets.connect(srv.ws_url + "/v1/realtime?duplex=1") as ws2:
                refused = json.loads(await ws2.recv())
                assert refused["type"] == "error" and refused["error"]["code"] == "session_capacity_exhausted"
                with pytest.raises(websockets.ConnectionClosed) as ei:
                    await ws2.recv()
                assert ei.value.rcvd.code == 1013
            chat = httpx.post(srv.url + "/v1/chat/completions", timeout=bound(10),
                              json={"messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 503 and "draining" in chat.json()["error"]["message"]
            # the live session still works during the drain
            await ws.send(json.dumps({"type": "session.heartbeat"}))
            await _recv_until(ws, "session.heartbeat_ack")
            evs = await _recv_until(ws, "session.closed", timeout=drain_s + 60)
            waited = time.monotonic() - t_sig
            assert evs[-1]["reason"] == "shutdown"
            assert waited >= drain_s - 0.5, waited  # not closed before the drain time was up
            with pytest.raises(websockets.ConnectionClosed) as ei:
                await ws.recv()
            assert ei.value.rcvd.code == 1001
        assert srv.proc.wait(bound(30)) == 0
        assert "draining: 1 session slot(s) in use" in srv.output()
    finally:
        srv.__exit__(None, None, None)


async def test_sigterm_drain_ends_early_when_the_sessions_finish():
    srv = ServerProc("scripted", "--drain-s", "10m")
    try:
        async with websockets.connect(srv.ws_url + "/v1/realtime?duplex=1") as ws:
            await _recv_until(ws, "session.created")
            srv.proc.send_signal(signal.SIGTERM)
            for _ in range(100):
                if httpx.get(srv.url + "/ready", timeout=bound(10)).status_code == 503:
                    break
                await asyncio.sleep(0.05)
            await ws.send(json.dumps({"type": "session.close"}))
            evs = await _recv_until(ws, "session.closed")
            assert evs[-1]["reason"] == "client_close"
        # the last session ended by itself: the process stops long before the 10-minute drain
        assert srv.proc.wait(bound(60)) == 0
    finally:
        srv.__exit__(None, None, None)


def _client(app):
    from fastapi.testclient import TestClient

    return TestClient(app, base_url="http://127.0.0.1")  # a loopback Host, as a local scraper sends


def test_metrics_modes_and_one_registry_per_app():
    from duplexkit.testing import ScriptedEngine
    from duplexkit_server import ServerSettings, create_app

    a = create_app(ScriptedEngine(), ServerSettings(max_sessions=3, api_keys=["k"], metrics="public"))
    b = create_app(ScriptedEngine(), ServerSettings(max_sessions=5, api_keys=["k"]))
    off = create_app(ScriptedEngine(), ServerSettings(metrics="off"))
    with _client(a) as ca, _client(b) as cb, _client(off) as co:
        ma = text_string_to_metric_families(ca.get("/metrics").text)  # public: no key needed
        caps = {s.value for f in ma for s in f.samples if s.name == "duplexkit_sessions_capacity"}
        assert caps == {3.0}
        assert cb.get("/metrics").status_code == 401  # auth (default) with keys set
        r = cb.get("/metrics", headers={"Authorization": "Bearer k"})
        assert "duplexkit_sessions_capacity 5.0" in r.text
        assert co.get("/metrics").status_code == 404
        assert co.get("/ready").status_code == 200 and co.get("/live").status_code == 200
    with pytest.raises(ValueError):
        create_app(ScriptedEngine(), ServerSettings(metrics="maybe"))
    # error labels stay bounded: a free-text close reason is counted as "other"
    m = a.state.duplexkit.metrics
    m.error("origin not allowed", "handshake")
    m.error("request_too_large", "http")
    text = m.render()[0].decode()
    assert 'duplexkit_errors_total{code="other",where="handshake"} 1.0' in text
    assert 'duplexkit_errors_total{code="request_too_large",where="http"} 1.0' in text


def test_gpu_memory_series_when_cuda_is_in_use():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from duplexkit.testing import ScriptedEngine
    from duplexkit_server import create_app

    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda:0")  # 64 MiB held by this process
    with _client(create_app(ScriptedEngine())) as c:
        fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    got = {(s.labels["device"], s.labels["kind"]): s.value for s in fams["duplexkit_gpu_memory_bytes"].samples}
    assert got[("cuda:0", "allocated")] >= x.numel()
    assert got[("cuda:0", "reserved")] >= got[("cuda:0", "allocated")]
    assert got[("cuda:0", "total")] == torch.cuda.get_device_properties(0).total_memory
