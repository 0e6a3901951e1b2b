"""What recording and tracing cost: the same sessions with both off, then with both on, side by side.

Serves the model in this process (the builders of benchmarks/e2e_latency.py), then for each
concurrency level N runs N WebSocket sessions of e2e_latency's scenarios (real-time speech, a
commit + response.create answer, a server-VAD answer, a barge-in) twice: ``off`` (no recording, no
tracer: the driver has no extra observer and nothing imports OpenTelemetry) and ``on`` (every
session recorded, ``--record`` as ``duplexkit serve`` does it, and traced: an OpenTelemetry
``TracerProvider`` with the batch span processor and the OTLP exporter, http/protobuf, to a receiver
this script starts, or to the collector that ``OTEL_EXPORTER_OTLP_ENDPOINT`` names). The modes
alternate ``--repeats`` times per level so that drift (a warming GPU, a busy host) hits both.

Per level and mode it prints p50 / p90 of:

* ``unit_ms``: engine time per unit (``UnitTimings.total_ms``: submit to the unit's last output);
* ``create``: ``response.create`` sent -> first audio delta at the client (what the user feels);
* ``vad_eos``: end of the user's speech -> first audio delta (server VAD);
* ``hooks``: time the event loop's thread spent in the recording and tracing observers, in
  microseconds per unit (0 when off: there are none), also apart (``rec``, ``trace``). Wall time
  (``time.perf_counter``; a per-thread CPU clock costs a system call per reading here, more than the
  hooks): it includes waits for the GIL while the recording's writer thread or the span exporter's
  thread holds it (Python hands the GIL over every 5 ms, ``sys.getswitchinterval()``), which delay
  the loop all the same;
* the units measured, the spans exported and the recording bytes written.

Examples::

    python benchmarks/observability_cost.py --model scripted --sessions 1,4
    python benchmarks/observability_cost.py --model tiny --sessions 1,2 --rounds 1
    python benchmarks/observability_cost.py --model random-real --device cuda --sessions 32 --tokens 19
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from _realtime import pct, stop_server, wait_idle  # noqa: E402
from e2e_latency import _start_local, _start_random, run_level  # noqa: E402


class Meter:
    """Unit timings and observer time of the sessions of one run (the server's thread writes)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.unit_ms: list = []
        self.hook_s = 0.0  # wall time of the event loop's thread in the hooks (waits for the GIL included)
        self.hook_calls = 0
        self.by_kind: dict = {}  # "recording" / "tracing" -> seconds


def install(server, meter: Meter) -> None:
    """Time every call into the driver's added observers (recording, tracer) and collect the
    ``UnitTimings`` of every session (through the metrics observer the server sets)."""
    from duplexkit.driver import SessionDriver, logger

    def _observe(self, hook, arg):
        if self.observer is not None:
            fn = getattr(self.observer, hook, None)
            if fn is not None:
                try:
                    fn(arg)
                except Exception:  # noqa: BLE001 - as the driver's own
                    logger.exception("session observer %s failed", hook)
        if hook == "engine_output" and type(arg).__name__ == "UnitTimings" and "total_ms" in (arg.timings or {}):
            meter.unit_ms.append(float(arg.timings["total_ms"]))
        if not self.observers:
            return
        for obs in self.observers:
            fn = getattr(obs, hook, None)
            if fn is not None:
                t = time.perf_counter()
                try:
                    fn(arg)
                except Exception:  # noqa: BLE001
                    logger.exception("session observer %s failed", hook)
                dt = time.perf_counter() - t
                kind = "tracing" if type(obs).__name__ == "SessionTracer" else "recording"
                meter.by_kind[kind] = meter.by_kind.get(kind, 0.0) + dt
                meter.hook_s += dt
        meter.hook_calls += 1

    SessionDriver._observe = _observe


class Receiver:
    """A local OTLP/HTTP trace receiver that counts the spans it is sent (decoding each request)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

        self.spans = 0
        lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                req = pb.ExportTraceServiceRequest()
                req.ParseFromString(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
                with lock:
                    outer.spans += n
                body = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/traces"


class CountingExporter:
    """Wraps a span exporter and counts the spans handed to it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.spans = 0

    def export(self, spans):
        self.spans += len(spans)
        return self.inner.export(spans)

    def shutdown(self):
        return self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000):
        return getattr(self.inner, "force_flush", lambda *_: True)(timeout_millis)


def make_provider():
    """A TracerProvider exporting OTLP http/protobuf: to OTEL_EXPORTER_OTLP_*ENDPOINT if set, else to
    a local :class:`Receiver`. Returns (provider, counting exporter, receiver or None)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from duplexkit import tracing

    receiver = None
    if tracing.env_enabled():
        inner = OTLPSpanExporter()
    else:
        receiver = Receiver()
        inner = OTLPSpanExporter(endpoint=receiver.url)
    exp = CountingExporter(inner)
    provider = TracerProvider(resource=Resource.create({"service.name": "duplexkit-bench"}))
    provider.add_span_processor(BatchSpanProcessor(exp))
    return provider, exp, receiver


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def set_mode(state, on: bool, provider, rec_dir: Path) -> None:
    from duplexkit import tracing

    state.settings.record_dir = rec_dir if on else None
    state.settings.record_policy = "all"
    tracing.configure(provider if on else None)


def summarize(r: dict, meter: Meter, spans: int, rec_bytes: int) -> dict:
    n = len(meter.unit_ms)
    return {"units": n, "unit_p50": pct(meter.unit_ms, 50), "unit_p90": pct(meter.unit_ms, 90),
            "create_p50": pct(r["create"], 50), "create_p90": pct(r["create"], 90),
            "vad_p50": pct(r["vad_eos"], 50), "vad_p90": pct(r["vad_eos"], 90),
            "hook_us_per_unit": meter.hook_s * 1e6 / n if n else 0.0,
            "rec_us_per_unit": meter.by_kind.get("recording", 0.0) * 1e6 / n if n else 0.0,
            "trace_us_per_unit": meter.by_kind.get("tracing", 0.0) * 1e6 / n if n else 0.0, "spans": spans, "rec_bytes": rec_bytes,
            "errors": len(r["errors"])}


def merge(runs: list) -> dict:
    """Several repeats of one mode: the samples pooled (so the percentiles are over all of them)."""
    out = {"create": [], "vad_eos": [], "errors": []}
    for r in runs:
        for k in out:
            out[k] += r[k]
    return out


def print_table(rows: list, header: str) -> None:
    print("\n" + header)
    hdr = (f"{'sessions':>8} {'mode':>4} | {'units':>6} {'unit_ms p50':>11} {'p90':>7} | {'create p50':>10} {'p90':>7} | "
           f"{'vad_eos p50':>11} {'p90':>7} | {'hooks us/unit':>13} {'rec':>7} {'trace':>7} | {'spans':>6} {'rec MB':>7} | {'errors':>6}")
    print(hdr)
    print("-" * len(hdr))
    for n, mode, s in rows:
        print(f"{n:>8} {mode:>4} | {s['units']:>6} {s['unit_p50']:>11.1f} {s['unit_p90']:>7.1f} | "
              f"{s['create_p50']:>10.0f} {s['create_p90']:>7.0f} | {s['vad_p50']:>11.0f} {s['vad_p90']:>7.0f} | "
              f"{s['hook_us_per_unit']:>13.0f} {s['rec_us_per_unit']:>7.0f} {s['trace_us_per_unit']:>7.0f} | {s['spans']:>6} {s['rec_bytes'] / 2**20:>7.2f} | {s['errors']:>6}")
    sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Examples:\n" + __doc__.split("Examples::\n")[1])
    ap.add_argument("--model", default="scripted", help="scripted | tiny | <checkpoint dir> | random-real | random-tiny")
    ap.add_argument("--sessions", default="1", help="comma list of concurrency levels (e.g. 1,8,32)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of e2e_latency's scenarios per session and run")
    ap.add_argument("--repeats", type=int, default=1, help="off/on pairs per level (alternating)")
    ap.add_argument("--unit-delay-ms", type=float, default=0.0, help="scripted: simulated engine compute per unit")
    ap.add_argument("--tokens", default="19", help="random-*: decided tokens per speaking unit")
    ap.add_argument("--device", default="cuda", help="random-*: torch device")
    ap.add_argument("--code2wav-dtype", choices=("float32", "float16"), default="float32")
    ap.add_argument("--no-warm-turn", action="store_true", help="random-* on CUDA: skip the warm-up turn")
    ap.add_argument("--engine-process", action="store_true", help="random-*: the engine in its own process")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-wait timeout, s")
    ap.add_argument("--keep-recordings", default=None, metavar="DIR",
                    help="record into DIR and keep it (default: a temporary folder, removed at the end)")
    a = ap.parse_args(argv)
    a.tokenizer_dir = None
    levels = [int(x) for x in a.sessions.split(",") if x.strip()]
    try:
        provider, exporter, receiver = make_provider()
    except ImportError as exc:
        raise SystemExit(f"tracing needs the otel extra: pip install 'duplexkit[otel]' ({exc})") from exc
    server, url = (_start_random if a.model.startswith("random-") else _start_local)(a, max(levels))
    state = server.duplexkit_state
    meter = Meter()
    install(server, meter)
    rec_root = Path(a.keep_recordings) if a.keep_recordings else Path(tempfile.mkdtemp(prefix="duplexkit-obs-"))
    rec_root.mkdir(parents=True, exist_ok=True)
    rows: list = []
    header = (f"observability cost: model {a.model}"
              + (f", device {a.device}" if a.model.startswith("random-") else ", CPU")
              + f", {a.rounds} round(s) x {a.repeats} repeat(s) per mode; on = recording + OTLP tracing "
              f"({'the collector of OTEL_EXPORTER_OTLP_*ENDPOINT' if receiver is None else 'a local receiver'})")
    try:
        set_mode(state, False, provider, rec_root)
        w = asyncio.run(run_level(url, 1, 1, a.timeout))  # the process's cold start, not counted
        print(f"cold start (not counted): create {[round(x) for x in w['create']]} ms", flush=True)
        for n in levels:
            runs: dict = {"off": [], "on": []}
            stats = {"off": Meter(), "on": Meter()}
            spans = {"off": 0, "on": 0}
            rec_bytes = {"off": 0, "on": 0}
            for _ in range(a.repeats):
                for mode in ("off", "on"):
                    wait_idle(url)
                    set_mode(state, mode == "on", provider, rec_root)
                    meter.reset()
                    s0, b0 = exporter.spans, dir_bytes(rec_root)
                    t = time.perf_counter()
                    r = asyncio.run(run_level(url, n, a.rounds, a.timeout))
                    wait_idle(url)
                    if mode == "on":  # a session's slot is free a moment before its driver and recording close
                        time.sleep(1.5)
                        provider.force_flush()
                        if getattr(state, "recorder", None) is not None:
                            state.recorder.flush(60)
                    runs[mode].append(r)
                    stats[mode].unit_ms += meter.unit_ms
                    stats[mode].hook_s += meter.hook_s
                    for k, v in meter.by_kind.items():
                        stats[mode].by_kind[k] = stats[mode].by_kind.get(k, 0.0) + v
                    spans[mode] += exporter.spans - s0
                    rec_bytes[mode] += dir_bytes(rec_root) - b0
                    print(f"level {n} {mode}: {time.perf_counter() - t:.0f} s, {len(meter.unit_ms)} units, "
                          f"{len(r['errors'])} errors", flush=True)
            for mode in ("off", "on"):
                rows.append((n, mode, summarize(merge(runs[mode]), stats[mode], spans[mode], rec_bytes[mode])))
            print_table(rows[-2:], header)
        print_table(rows, header)
        if receiver is not None:
            print(f"spans received by the local OTLP receiver: {receiver.spans}")
    finally:
        set_mode(state, False, None, rec_root)
        stop_server(server)
        provider.shutdown()
        if not a.keep_recordings:
            shutil.rmtree(rec_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    raise SystemExit(main())
