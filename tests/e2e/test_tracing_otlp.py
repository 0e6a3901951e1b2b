"""Traces through real OTLP receivers: ``duplexkit serve scripted`` as a subprocess with the standard
``OTEL_EXPORTER_OTLP_*`` environment pointing at a receiver started here (http/protobuf: a small HTTP
server decoding ``ExportTraceServiceRequest``; gRPC: the OTLP ``TraceService`` on grpcio), one
realtime session over a WebSocket on a fixture WAV; the session > turn > response > unit tree
arrives with its attributes. Also: a bad protocol setting stops ``serve`` with a usage error."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.proto")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

from duplexkit.audio import VirtualPlayer, read_wav  # noqa: E402
from duplexkit.clients import DuplexClient  # noqa: E402
from _serverproc import REPO, ServerProc, free_port  # noqa: E402
from _timing import bound  # noqa: E402

FIX = REPO / "tests" / "fixtures" / "audio"
TD = {"type": "server_vad", "create_response": False, "interrupt_response": True, "silence_duration_ms": 500}


class _Spans:
    """Spans decoded from OTLP requests: (resource attributes, span) pairs, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list = []
        self.requests = 0

    def add(self, req: "trace_service_pb2.ExportTraceServiceRequest") -> None:
        with self.lock:
            self.requests += 1
            for rs in req.resource_spans:
                res = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        self.items.append((res, sp))

    def wait_for(self, pred, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                items = list(self.items)
            if pred(items):
                return items
            time.sleep(0.1)
        raise AssertionError(f"spans did not arrive: {[s.name for _r, s in self.items]}")


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attrs(span) -> dict:
    return {a.key: _value(a.value) for a in span.attributes}


def _http_receiver(sink: _Spans):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/v1/traces" or "protobuf" not in (self.headers.get("Content-Type") or ""):
                self.send_response(404)
                self.end_headers()
                return
            req = trace_service_pb2.ExportTraceServiceRequest()
            req.ParseFromString(body)
            sink.add(req)
            out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


async def _one_session(ws_url: str, session: dict) -> tuple:
    speech = read_wav(FIX / "question_16k.wav", 16_000)[0]
    async with DuplexClient(ws_url, player=VirtualPlayer(block_ms=20), session=dict({"turn_detection": TD}, **session),
                            input_rate=16_000, request_timeout_s=bound(30)) as c:
        sid = c.session["id"]
        for i in range(0, len(speech), 1600):
            await c.send_audio(speech[i:i + 1600])
            await asyncio.sleep(0.01)
        await c.commit()
        h = await c.create_response()
        await h.wait(bound(30))
        await h.wait_heard(bound(30))
    return sid, h


def _check(items: list, sid: str, rid: str, workflow: str) -> None:
    spans = [s for _r, s in items]
    by_id = {s.span_id: s for s in spans}
    (root,) = [s for s in spans if s.name == workflow]
    ra = _attrs(root)
    assert ra["duplexkit.session.id"] == sid and ra["duplexkit.tracing.group_id"] == "g-e2e"
    assert ra["duplexkit.tracing.metadata.case"] == "otlp"
    assert not root.parent_span_id
    resp = [s for s in spans if s.name == "duplexkit.response" and _attrs(s)["duplexkit.response.id"] == rid]
    assert len(resp) == 1
    resp = resp[0]
    turn = by_id[resp.parent_span_id]
    assert turn.name == "duplexkit.turn" and turn.parent_span_id == root.span_id
    units = [s for s in spans if s.parent_span_id == resp.span_id]
    assert len(units) == 3 and all(u.name == "duplexkit.unit" for u in units)
    for child, parent in [(turn, root), (resp, turn)] + [(u, resp) for u in units]:
        assert parent.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= parent.end_time_unix_nano
        assert child.trace_id == root.trace_id
    assert _attrs(resp)["duplexkit.response.ttfp_ms"] > 0
    assert all(_attrs(u)["duplexkit.unit.decision"] == "speak" for u in units)
    res = items[0][0]
    assert res["service.name"] == "duplexkit-e2e"


def _env(endpoint: str, protocol: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
               OTEL_SERVICE_NAME="duplexkit-e2e", OTEL_BSP_SCHEDULE_DELAY="200")
    return env


def _run(endpoint: str, protocol: str, sink: _Spans) -> None:
    tracing = {"workflow_name": f"e2e-{protocol}", "group_id": "g-e2e", "metadata": {"case": "otlp"}}
    with ServerProc("scripted", "--scripted", "units_per_turn=3", env=_env(endpoint, protocol)) as srv:
        sid, h = asyncio.run(_one_session(srv.ws_url + "/v1/realtime?duplex=1", {"tracing": tracing}))
        srv.wait_idle()
        items = sink.wait_for(lambda it: any(s.name == tracing["workflow_name"] for _r, s in it), bound(30))
    assert h.status == "completed"
    _check(items, sid, h.id, tracing["workflow_name"])


def test_serve_exports_the_span_tree_over_otlp_http():
    sink = _Spans()
    srv, url = _http_receiver(sink)
    try:
        _run(url, "http/protobuf", sink)
    finally:
        srv.shutdown()


def test_serve_exports_the_span_tree_over_otlp_grpc():
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    sink = _Spans()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the service's name
            sink.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        _run(f"http://127.0.0.1:{port}", "grpc", sink)
    finally:
        server.stop(0)


def test_serve_refuses_an_unsupported_otlp_protocol():
    env = _env("http://127.0.0.1:9", "http/json")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-m", "duplexkit.cli", "serve", "scripted", "--host", "127.0.0.1",
                          "--port", str(free_port())], env=env, capture_output=True, text=True,
                         timeout=bound(120), cwd=str(REPO))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "http/json" in out.stderr and "OTEL_EXPORTER_OTLP_PROTOCOL" in out.stderr


def _stop_s(srv: ServerProc) -> float:
    """Seconds from SIGINT to the server's exit (status 0)."""
    t0 = time.monotonic()
    assert srv.stop() == 0, srv.output()[-3000:]
    return time.monotonic() - t0


def _endpoint_lines(out: str, port: int) -> list:
    """The log lines about the endpoint at ``port`` (the exporter's, or duplexkit's about it), after
    the start-up line naming it."""
    lines = out.split("OpenTelemetry traces on:", 1)[-1].splitlines()[1:]
    return [ln for ln in lines if f"127.0.0.1:{port}" in ln or f"port={port}" in ln]


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_serve_with_an_unreachable_otlp_endpoint_warns_once_and_stops_promptly(protocol):
    """``OTEL_EXPORTER_OTLP_ENDPOINT`` at a closed port: sessions go on, the log gets one warning
    (the exporter's line per retry only at DEBUG), and the exit is not held by the exporter's
    retries: it takes at most a couple of seconds longer than the same server's without tracing."""
    if protocol == "grpc":
        pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    with ServerProc("scripted", "--scripted", "units_per_turn=3") as srv:
        baseline_s = _stop_s(srv)
    closed = free_port()  # nothing listens there
    srv = ServerProc("scripted", "--scripted", "units_per_turn=3", "--log-level", "debug",
                     env=_env(f"http://127.0.0.1:{closed}", protocol))
    try:
        deadline = time.monotonic() + bound(120)
        # sessions until the exporter has failed at least 3 times (each failure is on the DEBUG log)
        while len(_endpoint_lines(srv.output(), closed)) < 4:
            assert time.monotonic() < deadline, srv.output()[-5000:]
            _sid, h = asyncio.run(_one_session(srv.ws_url + "/v1/realtime?duplex=1", {}))
            assert h.status == "completed"  # tracing never gets in a session's way
            srv.wait_idle()
        stop_s = _stop_s(srv)
        out = srv.output()
    finally:
        srv.__exit__(None, None, None)
    loud = [ln for ln in out.splitlines() if " WARNING " in ln or " ERROR " in ln or "Traceback" in ln]
    assert len(loud) == 1, "\n".join(loud)
    assert f"duplexkit.tracing: OpenTelemetry traces cannot be exported to http://127.0.0.1:{closed}" in loud[0]
    assert stop_s < baseline_s + bound(2.5), (stop_s, baseline_s)
