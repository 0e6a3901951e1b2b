"""Prometheus metrics of the bundled server: ``GET /metrics`` (docs/deployment.md, "Metrics").

Every app gets its own :class:`prometheus_client.CollectorRegistry` (never the process-global one),
so several apps in one process (tests, embedding) keep separate numbers.

Where the numbers come from:

* slots, readiness and draining: read from :class:`~duplexkit_server.app.ServerState` at scrape time;
* per-session numbers: a :class:`SessionObserver` hooked into each realtime session's
  :class:`duplexkit.driver.SessionDriver` (``driver.observer``) sees the engine commands
  (``AppendUnit``), the engine outputs (``Decision``, ``UnitTimings``) and the server events
  (``response.created``, the first ``response.output_audio.delta``, ``error``) as they are sent;
* handshake refusals (close 1008 / 1013 before a session exists) and HTTP error answers
  (chat completions, 401, 413, 503): an ASGI middleware reads the close frame's reason or the
  small OpenAI error body (``{error{code}}``, docs/protocol.md §10.1);
* GPU memory: ``torch.cuda`` when torch is already imported and CUDA is initialised (the scripted
  engine never imports torch, and then the series are absent).

* KV use: the engine's ``kv_usage()`` (the GPU fast paths' static KV pools), absent without one.
A failure inside an observer is logged once and never reaches the session.
"""

from __future__ import annotations

import json
import logging
import re
import time
import weakref
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import Response

from duplexkit.errors import ErrorCode, canonical_error_code
from duplexkit.protocol.vocabulary import CloseCode

logger = logging.getLogger("duplexkit.server.metrics")

__all__ = ["ServerMetrics", "SessionObserver", "MetricsMiddleware", "install", "METRICS_MODES"]

#: ``--metrics`` values: ``auth`` (the API key is required when keys are set), ``public`` (no key,
#: for a scraper inside a private network), ``off`` (no route).
METRICS_MODES = ("auth", "public", "off")

#: Histogram buckets in seconds. Stage steps are tens of ms to ~1 s on a GPU; a unit is 1 s of
#: audio, so anything above 1 s is behind real time (benchmarks/README.md).
STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
#: TTFP targets are 250-500 ms (benchmarks/README.md); the scripted engine's answers land at ~1-3 s.
TTFP_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)

_AUDIO_DELTA = "response.output_audio.delta"
_CODE_RE = re.compile(r"[a-z][a-z0-9_]{0,47}")


class ServerMetrics:
    """The metric families of one app, in their own registry.

    Args:
        state: the app's :class:`~duplexkit_server.app.ServerState` (read at scrape time).
    """

    def __init__(self, state) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.state = state
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.observers: "weakref.WeakSet[SessionObserver]" = weakref.WeakSet()  # gone with their session
        self._warned = False
        g = Gauge("duplexkit_sessions_active", "Used session slots (realtime sessions and chat requests).", registry=r)
        g.set_function(lambda: state.slots.used)
        g = Gauge("duplexkit_sessions_capacity", "Session slots in all (--max-sessions).", registry=r)
        g.set_function(lambda: state.slots.size)
        g = Gauge("duplexkit_ready", "1 when /ready answers 200 (loaded, not draining, a slot free).", registry=r)
        g.set_function(lambda: 1.0 if _ready_reason(state) is None else 0.0)
        g = Gauge("duplexkit_draining", "1 while the server drains after SIGTERM.", registry=r)
        g.set_function(lambda: 1.0 if getattr(state, "draining", False) else 0.0)
        g = Gauge("duplexkit_units_behind_max",
                  "Largest number of input units submitted to the engine and not yet decided, over the live "
                  "realtime sessions (1 unit = 1 s of audio; above 1-2 the engine is behind real time).", registry=r)
        g.set_function(lambda: max((o.units_behind for o in list(self.observers)), default=0))
        g = Gauge("duplexkit_units_behind_sum", "Units submitted and not yet decided, summed over live sessions.",
                  registry=r)
        g.set_function(lambda: sum(o.units_behind for o in list(self.observers)))
        self.sessions = Counter("duplexkit_realtime_sessions", "Realtime sessions opened.", registry=r)
        self.units = Counter("duplexkit_units_decided", "Units the engine decided, by decision.", ["decision"],
                             registry=r)
        self.unit_latency = Histogram("duplexkit_unit_latency_seconds",
                                      "Engine time per unit (UnitTimings total_ms): submit to the unit's last output.",
                                      buckets=STAGE_BUCKETS, registry=r)
        self.stage_latency = Histogram("duplexkit_stage_latency_seconds",
                                       "Per-unit time of each engine stage (UnitTimings *_ms keys: thinker_prefill, "
                                       "thinker_decode, talker, code2wav, queue waits, first_audio).",
                                       ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self.ttfp = Histogram("duplexkit_ttfp_seconds",
                              "Time to first audio packet: response.created sent -> its first audio delta sent, by "
                              "trigger (client = response.create, server_vad = end of speech, model = the model "
                              "chose to speak).", ["trigger"], buckets=TTFP_BUCKETS, registry=r)
        self.errors = Counter("duplexkit_errors", "Errors sent, by docs/protocol.md §9 code and where: realtime "
                              "(an error event in a session), handshake (refused WebSocket), http (an HTTP error "
                              "answer).", ["code", "where"], registry=r)
        from prometheus_client.registry import Collector

        class _Gpu(Collector):
            def collect(self_inner):
                return _gpu_families(state.engine)

        r.register(_Gpu())

        class _Kv(Collector):
            def collect(self_inner):
                return _kv_families(state.engine)

        r.register(_Kv())

    # -- hooks ----------------------------------------------------------------------------------
    def session_observer(self) -> "SessionObserver":
        """A new observer for one realtime session (registered until :meth:`SessionObserver.close`)."""
        o = SessionObserver(self)
        self.observers.add(o)
        self.sessions.inc()
        return o

    def error(self, code: str, where: str) -> None:
        """Count one error. Codes are the server's own snake_case identifiers (docs/protocol.md §9,
        ``request_too_large``) under duplexkit's names: a compat-profile session's OpenAI code
        (``response_cancel_not_active``) counts as its duplexkit code (``response_not_active``,
        :func:`duplexkit.errors.canonical_error_code`); anything else (a free-text close reason)
        counts as ``other``, so the label set stays bounded."""
        code = canonical_error_code(str(code))
        self.errors.labels(code=code if _CODE_RE.fullmatch(code) else "other", where=where).inc()

    def warn_once(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("metrics observer failed (reported once): %r", exc, exc_info=exc)

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class SessionObserver:
    """What one realtime session reports (set as ``SessionDriver.observer``).

    ``units_behind``: units submitted (``AppendUnit``) and not yet decided (``Decision``); the engine
    keeps up with real time while it stays at 0-1.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.submitted = -1
        self.decided = -1
        self._created: dict[str, tuple[float, str]] = {}  # response id -> (monotonic s, trigger)

    @property
    def units_behind(self) -> int:
        return max(0, self.submitted - self.decided)

    def engine_command(self, cmd: Any) -> None:
        try:
            ui = getattr(cmd, "unit_index", None)
            if ui is not None and type(cmd).__name__ == "AppendUnit":
                self.submitted = max(self.submitted, int(ui))
        except Exception as exc:  # pragma: no cover - metrics never break a session
            self.m.warn_once(exc)

    def engine_output(self, out: Any) -> None:
        try:
            kind = type(out).__name__
            if kind == "Decision":
                self.decided = max(self.decided, int(out.unit_index))
                self.m.units.labels(decision=out.decision).inc()
            elif kind == "UnitTimings":
                for key, value in (out.timings or {}).items():
                    if not isinstance(value, (int, float)) or not key.endswith("_ms"):
                        continue
                    if key == "total_ms":
                        self.m.unit_latency.observe(value / 1000.0)
                    else:
                        self.m.stage_latency.labels(stage=key[:-3]).observe(value / 1000.0)
        except Exception as exc:  # pragma: no cover
            self.m.warn_once(exc)

    def server_event(self, event: dict) -> None:
        try:
            t = event.get("type")
            if t == _AUDIO_DELTA:
                got = self._created.pop(event.get("response_id"), None)
                if got is not None:
                    self.m.ttfp.labels(trigger=got[1]).observe(time.monotonic() - got[0])
            elif t == "response.created":
                resp = event.get("response") or {}
                if resp.get("id"):
                    self._created[resp["id"]] = (time.monotonic(), str(resp.get("trigger") or "unknown"))
            elif t == "response.done":
                self._created.pop((event.get("response") or {}).get("id"), None)
            elif t == "error":
                self.m.error((event.get("error") or {}).get("code") or "unknown", "realtime")
        except Exception as exc:  # pragma: no cover
            self.m.warn_once(exc)

    def close(self) -> None:
        self.m.observers.discard(self)


def _ready_reason(state) -> Optional[str]:
    from .lifecycle import not_ready_reason

    return not_ready_reason(state)




def _gpu_families(engine=None):
    """``duplexkit_gpu_memory_bytes{device, kind}`` (allocated, reserved, total) of the process that
    holds the model: the engine process's report (``engine.gpu_memory()``,
    :class:`duplexkit.engine.process.EngineProcess`, at most 1 s old), else this process when torch is
    loaded and CUDA initialised; nothing otherwise."""
    fn = getattr(engine, "gpu_memory", None)
    try:
        from duplexkit.memory import cuda_memory

        usage = fn() if fn is not None else cuda_memory()
    except Exception as exc:  # pragma: no cover - a broken driver must not break the scrape
        logger.debug("gpu metrics unavailable: %r", exc)
        return []
    if not usage:
        return []
    from prometheus_client.core import GaugeMetricFamily

    fam = GaugeMetricFamily("duplexkit_gpu_memory_bytes",
                            "CUDA memory of the engine's process: allocated and reserved by torch's caching "
                            "allocator, and the device total.", labels=["device", "kind"])
    for dev, u in sorted(usage.items()):
        for kind in ("allocated", "reserved", "total"):
            fam.add_metric([dev, kind], float(u[kind]))
    return [fam]


def _kv_families(engine):
    """``duplexkit_kv_slots{stage, kind=used|total}`` and ``duplexkit_kv_bytes{stage}`` from the
    engine's ``kv_usage()`` (:meth:`duplexkit.engine.DuplexEngine.kv_usage`: the GPU fast paths'
    static KV pools); nothing for an engine without one or with no pool (CPU path, scripted)."""
    fn = getattr(engine, "kv_usage", None)
    if fn is None:
        return []
    try:
        usage = fn() or {}
    except Exception as exc:  # pragma: no cover
        logger.debug("kv usage unavailable: %r", exc)
        return []
    if not usage:
        return []
    from prometheus_client.core import GaugeMetricFamily

    slots = GaugeMetricFamily("duplexkit_kv_slots", "KV-cache slots of the engine's static pools (one per live "
                              "stream and stage), used and allocated.", labels=["stage", "kind"])
    nbytes = GaugeMetricFamily("duplexkit_kv_bytes", "Bytes allocated for K and V of the engine's static pools.",
                               labels=["stage"])
    for stage, u in sorted(usage.items()):
        slots.add_metric([stage, "used"], float(u["slots_used"]))
        slots.add_metric([stage, "total"], float(u["slots_total"]))
        nbytes.add_metric([stage], float(u["bytes"]))
    return [slots, nbytes]


class MetricsMiddleware:
    """Counts refusals that happen outside a session: WebSocket closes 1008/1013 with their error
    code as the close reason (the handshake, docs/protocol.md §1.5) and HTTP answers >= 400 whose JSON
    body is an OpenAI error (``{error{code}}``, at most 64 KiB read)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        kind = scope.get("type")
        if kind == "websocket":
            async def ws_send(message):
                if message.get("type") == "websocket.close" and message.get("code") in (CloseCode.POLICY_VIOLATION, CloseCode.TRY_AGAIN_LATER):
                    self.metrics.error(message.get("reason") or "unknown", "handshake")
                await send(message)

            return await self.app(scope, receive, ws_send)
        if kind != "http" or scope.get("path") == "/metrics":
            return await self.app(scope, receive, send)
        box: dict = {"status": 200, "body": b"", "json": False}

        async def http_send(message):
            t = message.get("type")
            if t == "http.response.start":
                box["status"] = message.get("status", 200)
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                box["json"] = box["status"] >= 400 and ctype.startswith(b"application/json")
            elif t == "http.response.body" and box["json"]:
                if len(box["body"]) < 65536:
                    box["body"] += message.get("body", b"")
                if not message.get("more_body"):
                    box["json"] = False
                    self._count_http(box["status"], box["body"])
            await send(message)

        return await self.app(scope, receive, http_send)

    def _count_http(self, status: int, body: bytes) -> None:
        try:
            code = (json.loads(body).get("error") or {}).get("code")
        except Exception:
            code = None
        if code:
            self.metrics.error(code, "http")


def install(app, state) -> Optional[ServerMetrics]:
    """Add ``GET /metrics`` and the middleware to ``app`` per ``state.settings.metrics``
    (``auth``/``public``/``off``). Returns the :class:`ServerMetrics`, or None when off.

    Raises:
        ValueError: an unknown mode.
    """
    mode = getattr(state.settings, "metrics", "auth")
    if mode not in METRICS_MODES:
        raise ValueError(f"metrics must be one of {', '.join(METRICS_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    try:
        import prometheus_client  # noqa: F401
    except ImportError:  # the server extra installs it; an embedding may not have it
        logger.warning("GET /metrics is off: prometheus-client is not installed (pip install prometheus-client)")
        return None
    from .responses import openai_error

    metrics = ServerMetrics(state)
    state.metrics = metrics

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request):
        if mode == "auth" and not state.check_key(state.bearer(request.headers.get("authorization"))):
            return openai_error(401, "missing or invalid API key (or run with --metrics public)", ErrorCode.UNAUTHORIZED.value)
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return metrics
