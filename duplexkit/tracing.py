"""OpenTelemetry traces of sessions: session > turn > response > unit > stage spans, built from the
facts a :class:`duplexkit.driver.SessionDriver` already sees (docs/debugging.md, "Traces").

Off by default, and then free: nothing here imports ``opentelemetry`` until tracing is on, and the
driver adds no observer. Tracing is on for a session when a tracer provider is given (the
``tracer_provider`` argument of ``SessionDriver`` / ``InlineDuplexClient``, or :func:`configure` for
the whole process), or when the standard OTLP environment is set:

* ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (either turns it on);
* ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``http/protobuf``
  (default, the OpenTelemetry specification's) or ``grpc``;
* ``OTEL_SERVICE_NAME`` (default ``duplexkit``), ``OTEL_RESOURCE_ATTRIBUTES``, the ``OTEL_BSP_*``
  batch settings and the exporters' own ``OTEL_EXPORTER_OTLP_*`` options (headers, timeout, TLS)
  are read by the OpenTelemetry SDK as usual; ``OTEL_SDK_DISABLED=true`` or
  ``OTEL_TRACES_EXPORTER=none`` keep it off.

The spans are made after the fact with explicit start and end times, so the engine's hot path is
untouched: a unit's span ends when its ``UnitTimings`` reaches the driver and starts ``total_ms``
earlier; its stage spans are placed inside it from the stage times and queue waits the engine
reports (:class:`duplexkit.engine.api.UnitTimings`). A response's spans are written when it is done
(and its units' timings are in); a turn's when the next turn starts or the session ends.

The ``tracing`` session field (OpenAI Realtime's, docs/protocol.md §4.1) is honoured: ``"auto"``
(the default here: every session of a tracing server is traced), ``{workflow_name, group_id,
metadata}`` (the workflow name names the session span; all three become attributes), or ``null``:
nothing more of that session is traced.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Optional

from duplexkit.errors import DuplexkitError, ErrorCode

logger = logging.getLogger("duplexkit.tracing")

__all__ = ["TracingError", "SessionTracer", "configure", "enabled", "env_enabled", "provider_from_env",
           "session_tracer", "parse_tracing_field", "stage_windows", "DEFAULT_SESSION_SPAN",
           "TRACES_ENDPOINT_VARS", "PROTOCOL_VARS"]

TRACES_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
"""Either one set (non-empty) turns tracing on (the OpenTelemetry OTLP exporter specification)."""
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
"""The signal-specific one wins; unset = ``http/protobuf`` (the specification's default)."""
DEFAULT_SESSION_SPAN = "duplexkit.session"
"""The session span's name when the ``tracing`` field names no workflow."""
TRACER_NAME = "duplexkit"

_lock = threading.Lock()
_configured: Any = None  # a TracerProvider given to configure()
_env_provider: Any = None  # the one made from the environment (made once)
_env_failed = False


class TracingError(DuplexkitError, ValueError):
    """Tracing cannot be set up as asked: an unsupported ``OTEL_EXPORTER_OTLP_*PROTOCOL`` or the
    ``otel`` extra not installed (``pip install 'duplexkit[otel]'``); or a ``tracing`` session
    field of the wrong shape. Code ``bad_event``."""

    default_code = ErrorCode.BAD_EVENT.value


# -- switching on ---------------------------------------------------------------------------------


def env_enabled(environ: Optional[dict] = None) -> bool:
    """True when the environment asks for OTLP traces (:data:`TRACES_ENDPOINT_VARS`), unless
    ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. Reads ``os.environ`` only."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(env.get(v, "").strip() for v in TRACES_ENDPOINT_VARS)


def enabled() -> bool:
    """True when sessions of this process are traced (a provider from :func:`configure`, or the
    environment of :func:`env_enabled`). Imports nothing."""
    return _configured is not None or (env_enabled() and not _env_failed)


def configure(tracer_provider: Any = None) -> None:
    """Trace every session of this process into ``tracer_provider`` (an OpenTelemetry
    ``TracerProvider``, e.g. ``opentelemetry.trace.get_tracer_provider()`` of an app that set one
    up); None goes back to the environment (:func:`env_enabled`)."""
    global _configured
    _configured = tracer_provider


def _protocol(env: Optional[dict] = None) -> str:
    env = os.environ if env is None else env
    for v in PROTOCOL_VARS:
        p = env.get(v, "").strip().lower()
        if p:
            break
    else:
        p = "http/protobuf"
    if p not in ("http/protobuf", "grpc"):
        raise TracingError(f"{v}={p!r} is not supported: use 'http/protobuf' or 'grpc' "
                           "(the Python OTLP exporters have no http/json)")
    return p


def provider_from_env() -> Any:
    """The process's ``TracerProvider`` made from the environment (once): a batch span processor
    over the OTLP exporter of the configured protocol, resource ``service.name`` =
    ``OTEL_SERVICE_NAME`` or ``duplexkit`` and ``service.version`` = duplexkit's version.

    Raises:
        TracingError: an unsupported protocol, or the ``otel`` extra missing.
    """
    global _env_provider
    with _lock:
        if _env_provider is not None:
            return _env_provider
        proto = _protocol()
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            if proto == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TracingError(f"OTLP tracing is configured ({'/'.join(TRACES_ENDPOINT_VARS)}) but the "
                               f"OpenTelemetry packages are missing ({exc.name}): "
                               "pip install 'duplexkit[otel]'") from exc
        from duplexkit import __version__

        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "").strip() or "duplexkit",
                                    "service.version": __version__})
        endpoint = next(os.environ[v] for v in TRACES_ENDPOINT_VARS if os.environ.get(v, "").strip())
        provider = TracerProvider(resource=resource)  # flushed and shut down at exit by the SDK
        guard = _GuardedExporter(OTLPSpanExporter(), endpoint)
        provider.add_span_processor(_bounded_processor_class(BatchSpanProcessor)(guard))
        _env_provider = provider
        logger.info("OpenTelemetry traces on: OTLP %s to %s", proto, endpoint)
        return provider


# -- an endpoint that does not answer -------------------------------------------------------------

EXPORT_WARNING_EVERY_S = 60.0
"""At most one warning per this many seconds while spans cannot be exported (the first at once)."""
SHUTDOWN_FLUSH_S = 1.5
"""How long a shutdown (at exit) waits for the last spans to be exported; with an endpoint that
is already failing, not at all. A forced flush waits at most this long too."""
EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                    "opentelemetry.exporter.otlp.common.http",
                    "opentelemetry.exporter.otlp.proto.grpc.exporter",
                    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
"""The OTLP span exporters' loggers: their per-attempt warnings and errors (every retry of every
batch) become one rate-limited warning of ``duplexkit.tracing``; each stays on its DEBUG log."""


class _ExporterLogGuard(logging.Filter):
    """On the exporter loggers: hands their WARNING and ERROR records to the guard instead."""

    def __init__(self, guard: "_GuardedExporter") -> None:
        super().__init__()
        self.guard = guard

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.guard.exporter_said(record.getMessage())
        return False


def _short_reason(message: str) -> str:
    """The gist of an exporter message: the OS error (``Connection refused``) when it names one."""
    import re

    m = (re.search(r"\[Errno -?\d+\] ([^'\")]+)", message)  # http: the OS error
         or re.search(r"(Connection refused|Connection reset|Deadline Exceeded|timed out)", message, re.I)
         or re.search(r"(StatusCode\.\w+)", message))  # grpc
    return m.group(1).strip() if m else message.strip()[:160]


class _GuardedExporter:
    """A span exporter around the OTLP one: a failing endpoint gives one clear warning (then at most
    one per :data:`EXPORT_WARNING_EVERY_S`) instead of the exporter's line per retry, and each
    export runs on a daemon thread that the processor can stop waiting for (``give_up_at``), so
    that a shutdown is never held by an endpoint that does not answer (:data:`SHUTDOWN_FLUSH_S`)."""

    def __init__(self, inner: Any, endpoint: str) -> None:
        self.inner = inner
        self.endpoint = endpoint
        self.give_up_at: Optional[float] = None  # monotonic; set by a shutdown or forced flush
        self.failing = False
        self._reason = ""
        self._warned_at: Optional[float] = None
        self._dropped = 0  # spans not exported since the last warning
        self._lock = threading.Lock()
        self._filter = _ExporterLogGuard(self)
        for name in EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(self._filter)

    def exporter_said(self, message: str) -> None:
        """A warning or error of the exporter itself (a retry, a failed batch)."""
        logger.debug("OTLP exporter: %s", message)
        with self._lock:
            self.failing = True
            self._reason = _short_reason(message)
        self._maybe_warn()

    def _maybe_warn(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._warned_at is not None and now - self._warned_at < EXPORT_WARNING_EVERY_S:
                return
            first, dropped = self._warned_at is None, self._dropped
            self._warned_at, self._dropped = now, 0
        if first:
            logger.warning("OpenTelemetry traces cannot be exported to %s (%s): spans are dropped while it does "
                           "not answer; this warning repeats at most every %g s", self.endpoint,
                           self._reason or "export failed", EXPORT_WARNING_EVERY_S)
        else:
            logger.warning("OpenTelemetry traces still cannot be exported to %s (%s): %d span(s) dropped since "
                           "the last warning", self.endpoint, self._reason or "export failed", dropped)

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        give_up = self.give_up_at
        if give_up is not None and (self.failing or time.monotonic() >= give_up):
            self._count_dropped(len(spans))
            return SpanExportResult.FAILURE
        box: dict = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["result"] = self.inner.export(spans)
            except Exception as exc:  # noqa: BLE001 - reported as a failed export
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name="duplexkit-otlp-export", daemon=True).start()
        while not done.wait(0.05):
            give_up = self.give_up_at
            if give_up is not None and time.monotonic() >= give_up:
                break  # a shutdown stops waiting; the thread ends with the exporter's own timeout
        result = box.get("result", SpanExportResult.FAILURE)
        if result == SpanExportResult.SUCCESS:
            if self.failing:
                logger.info("OpenTelemetry traces reach %s again", self.endpoint)
            with self._lock:
                self.failing = False
            return result
        if "error" in box:
            self.exporter_said(f"{type(box['error']).__name__}: {box['error']}")
        with self._lock:
            self.failing = True
        self._count_dropped(len(spans))
        self._maybe_warn()
        return SpanExportResult.FAILURE

    def _count_dropped(self, n: int) -> None:
        with self._lock:
            self._dropped += n

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is buffered here (the batch processor holds the spans)

    def shutdown(self) -> None:
        self.give_up_at = time.monotonic()
        try:
            self.inner.shutdown()  # also ends the retry waits of an export still running
        except Exception:  # pragma: no cover - at exit, best effort
            logger.debug("OTLP exporter shutdown failed", exc_info=True)
        # the filters stay: an abandoned export thread may still log its last retry


def _bounded_processor_class(base: type) -> type:
    """``base`` (the SDK's ``BatchSpanProcessor``) whose shutdown and forced flush wait at most
    :data:`SHUTDOWN_FLUSH_S` for its :class:`_GuardedExporter` (not at all while it is failing):
    the SDK's own wait is 30 s for a shutdown, and unbounded for a flush."""

    class BoundedBatchSpanProcessor(base):
        def __init__(self, exporter: _GuardedExporter) -> None:
            super().__init__(exporter)
            self._guard = exporter

        def shutdown(self) -> None:
            self._guard.give_up_at = time.monotonic() + (0.0 if self._guard.failing else SHUTDOWN_FLUSH_S)
            super().shutdown()

        def force_flush(self, timeout_millis: Optional[int] = None) -> bool:
            if self._guard.failing:
                return False
            bound_s = SHUTDOWN_FLUSH_S if timeout_millis is None else min(SHUTDOWN_FLUSH_S, timeout_millis / 1000)
            self._guard.give_up_at = time.monotonic() + bound_s
            try:
                return bool(super().force_flush(timeout_millis)) and not self._guard.failing
            finally:
                self._guard.give_up_at = None

    return BoundedBatchSpanProcessor


def check_env() -> bool:
    """For a server's start: make the environment's provider now if tracing is asked for, so a bad
    setting fails at once. Returns whether tracing is on.

    Raises:
        TracingError: see :func:`provider_from_env`.
    """
    if _configured is not None:
        return True
    if not env_enabled():
        return False
    provider_from_env()
    return True


def session_tracer(session: Any, tracer_provider: Any = None) -> Optional["SessionTracer"]:
    """A :class:`SessionTracer` for ``session`` (a :class:`duplexkit.session.Session`), or None when
    tracing is off (then nothing is imported). The provider is ``tracer_provider``, else the one of
    :func:`configure`, else the environment's. A provider that cannot be made (see
    :func:`provider_from_env`) is logged once and tracing stays off: a session never fails for it."""
    global _env_failed
    provider = tracer_provider if tracer_provider is not None else _configured
    if provider is None:
        if _env_failed or not env_enabled():
            return None
        try:
            provider = provider_from_env()
        except TracingError as exc:
            _env_failed = True
            logger.error("tracing is off: %s", exc)
            return None
    return SessionTracer(provider.get_tracer(TRACER_NAME, _version()), session)


def _version() -> str:
    from duplexkit import __version__

    return __version__


# -- the tracing session field --------------------------------------------------------------------


def parse_tracing_field(value: Any) -> Optional[dict]:
    """The ``tracing`` session field as a dict (``{}`` for ``"auto"``), or None for ``null``.

    Raises:
        TracingError: anything but ``null``, ``"auto"`` or an object whose ``workflow_name`` and
            ``group_id`` are strings (or absent) and whose ``metadata`` is an object (or absent).
    """
    if value is None:
        return None
    if value == "auto":
        return {}
    if isinstance(value, dict):
        out = {}
        for k in ("workflow_name", "group_id"):
            v = value.get(k)
            if v is not None and not isinstance(v, str):
                raise TracingError(f"session.tracing.{k} must be a string")
            if v:
                out[k] = v
        md = value.get("metadata")
        if md is not None and not isinstance(md, dict):
            raise TracingError("session.tracing.metadata must be an object")
        if md:
            out["metadata"] = md
        return out
    raise TracingError('session.tracing must be null, "auto" or {workflow_name, group_id, metadata}')


# -- stage placement ------------------------------------------------------------------------------


def _f(tm: dict, key: str) -> Optional[float]:
    v = tm.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def stage_windows(tm: dict) -> list:
    """Where each engine stage ran inside one unit, from its ``UnitTimings`` (ms since the unit was
    submitted; every window clamped into ``[0, total_ms]``).

    Returns:
        ``[(name, start_ms, end_ms, attributes), ...]`` for the stages the timings describe:
        ``thinker.prefill`` and ``thinker.decode`` (the thinker's step ends at ``thinker_done_ms``
        and lasted ``thinker_ms``; prefill first, decode after), ``talker`` (ends at
        ``talker_done_ms``, lasted ``talker_ms``) and ``code2wav`` (starts ``code2wav_queue_ms``
        after the talker's result was handed on, lasts ``code2wav_ms``). Timings without stage
        keys (the scripted engine reports ``total_ms`` and ``queue_ms`` only) give ``[]``.
    """
    total = _f(tm, "total_ms")
    if total is None:
        return []

    def clamp(x: float) -> float:
        return min(max(x, 0.0), total)

    out = []
    th, th_done = _f(tm, "thinker_ms"), _f(tm, "thinker_done_ms")
    if th is not None:
        end = th_done if th_done is not None else (_f(tm, "thinker_queue_ms") or 0.0) + th
        start = end - th
        pre, dec = _f(tm, "thinker_prefill_ms"), _f(tm, "thinker_decode_ms")
        common = {"duplexkit.stage.queue_ms": _f(tm, "thinker_queue_ms"), "duplexkit.stage.batch": tm.get("thinker_batch")}
        if pre is None and dec is None:
            out.append(("thinker", clamp(start), clamp(end), dict(common, **{"duplexkit.stage.ms": th})))
        else:
            p_end = min(start + (pre or 0.0), end)
            out.append(("thinker.prefill", clamp(start), clamp(p_end), dict(common, **{"duplexkit.stage.ms": pre})))
            out.append(("thinker.decode", clamp(p_end), clamp(min(p_end + (dec or 0.0), end) if dec else end),
                        {"duplexkit.stage.ms": dec, "duplexkit.stage.steps": tm.get("decode_steps"),
                         "duplexkit.stage.batch": tm.get("thinker_batch")}))
    tk, tk_done = _f(tm, "talker_ms"), _f(tm, "talker_done_ms")
    if tk is not None:
        end = tk_done if tk_done is not None else (th_done or 0.0) + (_f(tm, "talker_queue_ms") or 0.0) + tk
        out.append(("talker", clamp(end - tk), clamp(end),
                    {"duplexkit.stage.ms": tk, "duplexkit.stage.queue_ms": _f(tm, "talker_queue_ms"),
                     "duplexkit.stage.steps": tm.get("talker_steps"), "duplexkit.stage.codes": tm.get("talker_codes"),
                     "duplexkit.stage.batch": tm.get("talker_batch")}))
    cw = _f(tm, "code2wav_ms")
    if cw is not None:
        start = (tk_done if tk_done is not None else total - cw) + (_f(tm, "code2wav_queue_ms") or 0.0)
        start = min(start, total - cw)
        out.append(("code2wav", clamp(start), clamp(start + cw),
                    {"duplexkit.stage.ms": cw, "duplexkit.stage.queue_ms": _f(tm, "code2wav_queue_ms"),
                     "duplexkit.stage.batch": tm.get("code2wav_batch")}))
    return out


def _attrs(d: dict) -> dict:
    """OpenTelemetry attributes: None dropped, other non-primitive values as JSON text."""
    out = {}
    for k, v in d.items():
        if v is None:
            continue
        if not isinstance(v, (str, bool, int, float)):
            v = json.dumps(v, default=str, separators=(",", ":"))
        out[k] = v
    return out


# -- the observer ---------------------------------------------------------------------------------

_MS = 1_000_000  # ns per ms
_AUDIO_DELTAS = ("response.output_audio.delta", "response.audio.delta")
_TOOL_TRIGGERS = ("tool", "filler", "progress")


class _Turn:
    __slots__ = ("start", "end", "span", "responses", "closed", "speech_started", "speech_stopped", "open_resp",
                 "index", "audio_start_ms", "audio_end_ms")

    def __init__(self, start: int, index: int, speech: bool) -> None:
        self.start = start
        self.end = start
        self.span = None
        self.responses: list = []  # response ids
        self.closed = False  # superseded by the next turn (its span ends once its responses are written)
        self.speech_started = start if speech else None
        self.speech_stopped = None
        self.open_resp = 0  # responses of the turn not written yet
        self.index = index
        self.audio_start_ms = self.audio_end_ms = None  # the speech on the session's audio clock


class _Resp:
    __slots__ = ("id", "created", "trigger", "epoch", "first_audio", "done", "status", "usage", "tool_call",
                 "units", "waiting", "turn", "written", "audio_ms")

    def __init__(self, rid: str) -> None:
        self.id = rid
        self.created: Optional[int] = None
        self.trigger = None
        self.epoch = None
        self.first_audio: Optional[int] = None
        self.done: Optional[int] = None
        self.status = None
        self.usage: dict = {}
        self.tool_call = False
        self.units: list = []  # finished unit records
        self.waiting: set = set()  # unit indexes of this response whose UnitTimings are not in yet
        self.turn: Optional[_Turn] = None
        self.written = False
        self.audio_ms = None


class SessionTracer:
    """One session's spans: an observer of :class:`duplexkit.driver.SessionDriver` (hooks
    ``client_event``, ``server_event``, ``engine_command``, ``engine_output``, ``driver_closed``).
    Every hook is cheap and never raises (the driver also guards them). Times are wall-clock
    nanoseconds (``time.time_ns``) taken when the driver sees a fact.

    Spans and their attributes (all ``duplexkit.*`` unless noted):

    * session (name: the workflow name, else :data:`DEFAULT_SESSION_SPAN`): ``session.id``,
      ``model``, ``tracing.workflow_name`` / ``tracing.group_id`` / ``tracing.metadata.<key>``,
      ``turns``, ``responses``, ``units``;
    * ``duplexkit.turn``: ``turn.index``, ``turn.speech_started`` (bool), ``turn.speech_ms`` (the
      server VAD's speech start to stop as the driver saw them, wall clock) and
      ``turn.speech_audio_ms`` (the same on the audio clock);
    * ``duplexkit.response``: ``response.id``, ``trigger``, ``epoch``, ``status``, ``ttfp_ms`` (
      ``response.created`` to the first audio delta, as the driver saw them), ``output_tokens``,
      ``audio_ms``, ``units``, ``tool_call``;
    * ``duplexkit.unit`` (speaking units under their response, listening ones under the session):
      ``unit.index``, ``epoch``, ``unit.decision``, ``unit.tokens``, ``unit.force_speak``, and the
      engine's ``UnitTimings`` as ``unit.<key>`` (``total_ms``, ``queue_ms``, ``thinker_queue_ms``,
      ``first_audio_ms``, ...);
    * stages ``thinker.prefill``, ``thinker.decode``, ``talker``, ``code2wav`` (see
      :func:`stage_windows`): ``stage.ms``, ``stage.queue_ms``, ``stage.batch``, ``stage.steps``;
    * ``duplexkit.decide_tools`` / ``duplexkit.transcribe``: the tool decider's and recogniser's
      calls (``elapsed_ms``, ``error``), under the session.
    """

    def __init__(self, tracer: Any, session: Any = None) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        self._in_context = trace.set_span_in_context  # imported here, at the session's start, not in a hook
        self.tracer = tracer
        self.session = session
        self._parent_ctx = otel_context.get_current()  # an app's span around an inline client nests it
        self.t0 = time.time_ns()
        self.active = True  # False after ``tracing: null``
        self.settings: dict = {}  # the parsed tracing field
        self.session_id = getattr(session, "session_id", None)
        self.model = None
        self.span = None
        self.turn: Optional[_Turn] = None
        self.turns: list = []
        self.n_turns = self.n_resps = self.n_units = 0
        self.resps: dict = {}
        self.unit_resp: dict = {}  # unit index -> response id (speaking units)
        self.unit_info: dict = {}  # unit index -> {"decision", "tokens", "force_speak", "epoch"}
        self.pending_updates: list = []  # (client event_id, has_tracing, value) per session.update seen
        self.closed = False

    # -- span helpers ---------------------------------------------------------------------------
    def _ctx(self, parent: Any) -> Any:
        return self._in_context(parent, self._parent_ctx)

    def _start(self, name: str, parent: Any, start: int, attrs: dict) -> Any:
        ctx = self._ctx(parent) if parent is not None else self._parent_ctx
        return self.tracer.start_span(name, context=ctx, start_time=int(start), attributes=_attrs(attrs))

    def _session_span(self) -> Any:
        if self.span is None:
            name = self.settings.get("workflow_name") or DEFAULT_SESSION_SPAN
            self.span = self._start(name, None, self.t0, self._session_attrs())
        return self.span

    def _session_attrs(self) -> dict:
        a = {"duplexkit.session.id": self.session_id, "duplexkit.model": self.model,
             "duplexkit.tracing.workflow_name": self.settings.get("workflow_name"),
             "duplexkit.tracing.group_id": self.settings.get("group_id")}
        for k, v in (self.settings.get("metadata") or {}).items():
            a[f"duplexkit.tracing.metadata.{k}"] = v if isinstance(v, (str, bool, int, float)) else json.dumps(v)
        return a

    # -- hooks ----------------------------------------------------------------------------------
    def client_event(self, raw: Any) -> None:
        try:
            if isinstance(raw, dict):
                ev = raw
            else:
                if "session.update" not in (raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray))
                                            else str(raw)):
                    return
                ev = json.loads(raw)
            if not isinstance(ev, dict) or ev.get("type") != "session.update":
                return
            s = ev.get("session")
            has = isinstance(s, dict) and "tracing" in s
            self.pending_updates.append((ev.get("event_id"), has, s.get("tracing") if has else None))
            del self.pending_updates[:-64]
        except Exception:  # noqa: BLE001 - a malformed event is the Session's to answer
            return

    def server_event(self, ev: Any) -> None:
        if not isinstance(ev, dict) or self.closed:
            return
        typ = ev.get("type")
        now = time.time_ns()
        if typ in ("session.created", "session.updated"):
            s = ev.get("session") or {}
            self.session_id = s.get("id") or self.session_id
            self.model = s.get("model") or self.model
            if self.span is not None:
                self.span.set_attributes(_attrs({"duplexkit.session.id": self.session_id,
                                                 "duplexkit.model": self.model}))
            if self.pending_updates:
                _eid, has, value = self.pending_updates.pop(0)
                if has:
                    self._apply_tracing(value, now)
        elif typ == "error":
            err = ev.get("error") or {}
            if self.pending_updates and (str(err.get("param") or "").split(".")[0] == "session"
                                         or (err.get("event_id") and err.get("event_id") == self.pending_updates[0][0])):
                self.pending_updates.pop(0)  # the update was refused: all or nothing
        if not self.active:
            return
        if typ == "input_audio_buffer.speech_started":
            if self.turn is None or self.turn.responses:
                self._new_turn(now, speech=True)
            if self.turn.audio_start_ms is None:
                self.turn.audio_start_ms = ev.get("audio_start_ms")
        elif typ == "input_audio_buffer.speech_stopped":
            if self.turn is not None and self.turn.speech_stopped is None:
                self.turn.speech_stopped = now
                self.turn.audio_end_ms = ev.get("audio_end_ms")
                self.turn.end = max(self.turn.end, now)
        elif typ == "response.created":
            resp = ev.get("response") or {}
            r = self._resp(resp.get("id"))
            if r is not None and r.created is None:
                r.created, r.trigger, r.epoch = now, resp.get("trigger"), resp.get("epoch")
                self._place(r)
        elif typ in _AUDIO_DELTAS:
            r = self.resps.get(ev.get("response_id"))
            if r is not None and r.first_audio is None:
                r.first_audio = now
        elif typ == "response.done":
            resp = ev.get("response") or {}
            r = self._resp(resp.get("id"))
            if r is not None:
                if r.created is None:
                    r.created, r.trigger, r.epoch = now, resp.get("trigger"), resp.get("epoch")
                    self._place(r)
                r.done, r.status = now, resp.get("status")
                r.usage = resp.get("usage") or {}
                r.audio_ms = resp.get("audio_duration_ms")
                r.tool_call = any(isinstance(it, dict) and it.get("type") == "function_call"
                                  for it in resp.get("output") or [])
                self._maybe_write(r)

    def engine_command(self, cmd: Any) -> None:
        if not self.active or type(cmd).__name__ != "AppendUnit":
            return
        info = self.unit_info.setdefault(int(cmd.unit_index), {})
        info["force_speak"] = bool(getattr(cmd, "force_speak", False))
        if len(self.unit_info) > 256:  # units that never report (cancelled): keep this bounded
            for k in sorted(self.unit_info)[:-128]:
                self.unit_info.pop(k, None)
                self.unit_resp.pop(k, None)

    def engine_output(self, out: Any) -> None:
        if not self.active or self.closed:
            return
        kind = type(out).__name__
        k = getattr(out, "unit_index", -1)
        if kind == "Decision":
            info = self.unit_info.setdefault(k, {})
            info["decision"], info["epoch"] = out.decision, out.epoch
            info["turn_start"] = bool(getattr(out, "turn_start", False))
            return
        if kind in ("TextDelta", "AudioChunk", "TurnEnd", "UnitTimings", "EngineFailure") and k >= 0:
            info = self.unit_info.get(k)
            if info is not None and info.get("decision") == "speak" and k not in self.unit_resp:
                rid = getattr(self.session, "active_response_id", None)  # the response it speaks for
                if rid:
                    self.unit_resp[k] = rid
                    r = self._resp(rid)
                    r.waiting.add(k)
        if kind == "TextDelta":
            info = self.unit_info.setdefault(k, {})
            info["tokens"] = info.get("tokens", 0) + int(getattr(out, "n_tokens", 0) or 0)
        elif kind == "EngineFailure":
            self.unit_info.setdefault(k, {})["failure"] = f"{out.code}: {out.message}"
        elif kind == "UnitTimings":
            self._unit_done(k, out, time.time_ns())
        elif kind in ("ToolDecision", "Transcription") and (kind == "Transcription" or getattr(out, "final", True)):
            now = time.time_ns()
            ms = float(getattr(out, "elapsed_ms", 0.0) or 0.0)
            s = self._start("duplexkit.decide_tools" if kind == "ToolDecision" else "duplexkit.transcribe",
                            self._session_span(), max(self.t0, now - int(ms * _MS)),
                            {"duplexkit.elapsed_ms": ms, "duplexkit.error": getattr(out, "error", None),
                             "duplexkit.tool_calls": len(getattr(out, "calls", ()) or ()) if kind == "ToolDecision" else None})
            s.end(end_time=now)

    def driver_closed(self, _arg: Any = None) -> None:
        """The session is over: write what is left and end the session span."""
        if self.closed:
            return
        if self.active:
            self._end_all(time.time_ns())
        self.closed = True

    # -- the tracing field ----------------------------------------------------------------------
    def _apply_tracing(self, value: Any, now: int) -> None:
        try:
            parsed = parse_tracing_field(value)
        except TracingError:
            return  # refused by the Session (the protocol checks the shape)
        if parsed is None:
            if self.active:
                self._end_all(now, empty=False)
                self.active = False
            return
        if not self.active:  # traced again: a new session span from now
            self.active, self.t0, self.span = True, now, None
            self.n_turns = self.n_resps = self.n_units = 0
        self.settings = parsed
        if self.span is not None:
            self.span.update_name(parsed.get("workflow_name") or DEFAULT_SESSION_SPAN)
            self.span.set_attributes(_attrs(self._session_attrs()))

    # -- turns and responses --------------------------------------------------------------------
    def _new_turn(self, now: int, speech: bool) -> _Turn:
        if self.turn is not None:
            self.turn.closed = True
            self._maybe_end_turn(self.turn)
        self.n_turns += 1
        t = self.turn = _Turn(now, self.n_turns, speech)
        self.turns.append(t)
        return t

    def _resp(self, rid: Optional[str]) -> Optional[_Resp]:
        if not rid:
            return None
        r = self.resps.get(rid)
        if r is None:
            r = self.resps[rid] = _Resp(rid)
        return r

    def _place(self, r: _Resp) -> None:
        """Put a new response in a turn: the open one, unless that turn already had an answer that
        did not call a tool and this response is not a tool follow-up (then a new turn)."""
        t = self.turn
        if t is None:
            t = self._new_turn(r.created, speech=False)
        elif t.responses and r.trigger not in _TOOL_TRIGGERS:
            prev = self.resps.get(t.responses[-1])
            if prev is not None and prev.done is not None and not prev.tool_call:
                t = self._new_turn(r.created, speech=False)
        r.turn = t
        t.responses.append(r.id)
        t.open_resp += 1

    def _unit_done(self, k: int, out: Any, now: int) -> None:
        tm = dict(getattr(out, "timings", None) or {})
        info = self.unit_info.pop(k, {})
        rid = self.unit_resp.pop(k, None)
        total = _f(tm, "total_ms") or 0.0
        unit = {"index": k, "end": now, "start": max(self.t0, now - int(total * _MS)), "timings": tm,
                "epoch": getattr(out, "epoch", info.get("epoch")), **info}
        self.n_units += 1
        r = self.resps.get(rid) if rid else None
        if r is not None and not r.written:
            r.units.append(unit)
            r.waiting.discard(k)
            self._maybe_write(r)
        else:
            self._write_unit(self._session_span(), unit)
        for other in list(self.resps.values()):  # a response done before its last unit's timings
            if other.done is not None and not other.written and other.waiting and all(w < k for w in other.waiting):
                other.waiting.clear()
                self._maybe_write(other)

    def _write_unit(self, parent: Any, u: dict) -> None:
        tm = u["timings"]
        a = {"duplexkit.unit.index": u["index"], "duplexkit.epoch": u.get("epoch"),
             "duplexkit.unit.decision": u.get("decision"), "duplexkit.unit.tokens": u.get("tokens"),
             "duplexkit.unit.force_speak": u.get("force_speak"), "duplexkit.unit.turn_start": u.get("turn_start"),
             "duplexkit.unit.failure": u.get("failure")}
        for key, v in tm.items():
            if isinstance(v, (int, float, str)) and not isinstance(v, bool):
                a[f"duplexkit.unit.{key}"] = v
        span = self._start("duplexkit.unit", parent, u["start"], a)
        for name, s_ms, e_ms, attrs in stage_windows(tm):
            st = self._start(name, span, min(u["start"] + int(s_ms * _MS), u["end"]), attrs)
            st.end(end_time=min(u["start"] + int(e_ms * _MS), u["end"]))
        span.end(end_time=u["end"])

    def _maybe_write(self, r: _Resp, force: bool = False) -> None:
        if r.written or r.created is None or (not force and (r.done is None or r.waiting)):
            return
        r.written = True
        t = r.turn
        units = sorted(r.units, key=lambda u: u["start"])
        start = min([r.created] + [u["start"] for u in units])
        end = max([r.done or time.time_ns()] + [u["end"] for u in units])
        if t.span is None:
            t.start = min(t.start, start)
            t.span = self._start("duplexkit.turn", self._session_span(), t.start,
                                 {"duplexkit.turn.index": t.index,
                                  "duplexkit.turn.speech_started": t.speech_started is not None})
        tokens = (r.usage or {}).get("output_tokens")
        span = self._start("duplexkit.response", t.span, start, {
            "duplexkit.response.id": r.id, "duplexkit.response.trigger": r.trigger, "duplexkit.epoch": r.epoch,
            "duplexkit.response.status": r.status or "incomplete",
            "duplexkit.response.ttfp_ms": (r.first_audio - r.created) / _MS if r.first_audio else None,
            "duplexkit.response.output_tokens": tokens, "duplexkit.response.audio_ms": r.audio_ms,
            "duplexkit.response.units": len(units), "duplexkit.response.tool_call": r.tool_call})
        for u in units:
            self._write_unit(span, u)
        span.end(end_time=end)
        self.n_resps += 1
        t.end = max(t.end, end)
        t.open_resp -= 1
        self.resps.pop(r.id, None)
        self._maybe_end_turn(t)

    def _maybe_end_turn(self, t: _Turn) -> None:
        if not t.closed or t.open_resp > 0:
            return
        if t.span is None:
            t.span = self._start("duplexkit.turn", self._session_span(), t.start,
                                 {"duplexkit.turn.index": t.index,
                                  "duplexkit.turn.speech_started": t.speech_started is not None})
        if t.speech_started is not None and t.speech_stopped is not None:
            t.span.set_attribute("duplexkit.turn.speech_ms", (t.speech_stopped - t.speech_started) / _MS)
        if isinstance(t.audio_start_ms, int) and isinstance(t.audio_end_ms, int):
            t.span.set_attribute("duplexkit.turn.speech_audio_ms", t.audio_end_ms - t.audio_start_ms)
        t.span.end(end_time=max(t.end, t.start))
        if t in self.turns:
            self.turns.remove(t)
        if self.turn is t:
            self.turn = None

    def _end_all(self, now: int, empty: bool = True) -> None:
        """Write every response and turn left and end the session span (with ``empty`` False, a
        session span with nothing under it yet is never started)."""
        for r in list(self.resps.values()):
            if r.created is not None:
                self._maybe_write(r, force=True)
        self.resps.clear()
        for t in list(self.turns):
            t.closed = True
            t.open_resp = 0
            self._maybe_end_turn(t)
        self.unit_resp.clear()
        self.unit_info.clear()
        if self.span is not None or empty:
            span = self._session_span()
            span.set_attributes({"duplexkit.turns": self.n_turns, "duplexkit.responses": self.n_resps,
                                 "duplexkit.units": self.n_units})
            span.end(end_time=max(now, self.t0))
        self.span = None
