"""``duplexkit serve``: the bundled server."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from .common import (
    CliError,
    EXIT_LOAD,
    EXIT_USAGE,
    _bind,
    _check_model_arg,
    _eprint,
    _float_min,
    _int_range,
    _parse_scripted,
    _parse_voice,
    _random_weights_notice,
    _session_defaults,
    load_engine,
)


def _add_hardening_args(p) -> None:
    """``serve`` options of the server's security and quota layer (docs/server.md, "Security")."""
    p.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                   help="browser origin allowed to open sessions and POST, e.g. https://app.example.com "
                        "(repeatable; '*' = any; default: the server's own origin only)")
    p.add_argument("--max-body-bytes", type=_int_range(1024), default=16 * 2**20,
                   help="largest HTTP request body in bytes (default 16 MiB; larger: HTTP 413)")
    p.add_argument("--max-sessions-per-client", type=_int_range(0), default=None,
                   help="slots one client (API key, or address when auth is off) may hold; 0 = no limit "
                        "(default: half of --max-sessions, at least 1)")
    p.add_argument("--header-timeout-s", type=_float_min(0, strict=True), default=10.0,
                   help="close a connection whose request head is not complete after this many s (default 10)")
    p.add_argument("--max-header-bytes", type=_int_range(1024), default=64 * 2**10,
                   help="largest HTTP request head (request line + headers, WebSocket handshakes too) in bytes "
                        "(default 64 KiB; larger: HTTP 431)")
    p.add_argument("--body-timeout-s", type=_float_min(0, strict=True), default=30.0,
                   help="a chat request body not complete this many s after its slot was taken gets HTTP 408 "
                        "(default 30)")
    p.add_argument("--slot-wait-s", type=_float_min(0), default=1.0,
                   help="how long a new session or chat request waits for a slot that an ending session is "
                        "giving back before it is refused, s (default 1)")
    p.add_argument("--max-outbound-bytes", type=_int_range(64 * 2**10), default=8 * 2**20,
                   help="server events queued for a WebSocket peer that does not read, in bytes, before the "
                        "session is closed with 1008 (default 8 MiB)")
    p.add_argument("--outbound-stall-s", type=_float_min(0, strict=True), default=30.0,
                   help="close a session (1008) whose peer has not taken a queued event for this many s "
                        "(default 30)")
    p.add_argument("--no-session-resume", dest="session_resume", action="store_false",
                   help="do not offer session resume (capabilities.supports_session_resume: false)")
    p.add_argument("--resume-window-s", type=_float_min(0, strict=True), default=30.0,
                   help="how long a session whose connection dropped waits for session.resume, s (default 30)")
    p.add_argument("--resume-journal-events", type=_int_range(1), default=4096,
                   help="server events kept per session for replay on resume (default 4096)")
    p.add_argument("--resume-journal-bytes", type=_int_range(1024), default=4 * 2**20,
                   help="bytes of server events kept per session for replay on resume (default 4 MiB)")
    p.add_argument("--resume-keep-sent-s", type=_float_min(0), default=10.0,
                   help="while connected, how long events already written to the socket stay in the resume "
                        "journal, s (default 10; session.event_ack trims sooner)")


    # operability (docs/deployment.md, "Probes", "Metrics", "Runbook")
    p.add_argument("--drain-s", type=_duration, default=300.0, metavar="DURATION",
                   help="on SIGTERM, let live sessions go on this long (new ones refused, /ready 503) before "
                        "closing them with session.closed{shutdown}: seconds, or 10m / 1h (default 300; "
                        "SIGINT or a second signal closes at once)")
    p.add_argument("--metrics", default="auth", choices=["auth", "public", "off"],
                   help="GET /metrics (Prometheus): auth = needs the API key when keys are set (default), "
                        "public = no key (scrapers on a private network), off = no route")


def _add_tool_args(p) -> None:
    """``serve`` options of the tool decider (docs/tools.md, "Delegation")."""
    p.add_argument("--tool-model", default=None, metavar="URL",
                   help="an OpenAI-compatible chat endpoint (e.g. http://host:8001/v1) that decides tool calls and "
                        "writes tool answers, instead of this model's thinker in text mode (default)")
    p.add_argument("--tool-model-key", default=None, metavar="KEY",
                   help="API key for --tool-model (default: $DUPLEXKIT_TOOL_MODEL_KEY)")
    p.add_argument("--tool-model-name", default=None, metavar="NAME",
                   help="the model name sent to --tool-model (default: the endpoint's own default)")
    _add_telephony_args(p)


def _add_telephony_args(p) -> None:
    """``serve`` options of the phone media-stream bridges (docs/telephony.md)."""
    p.add_argument("--telephony-webhook", default=None, metavar="URL",
                   help="POST each phone call's start metadata (provider, call id, from, to, custom parameters) "
                        "to URL; its JSON answer ({\"session\": {...}}) sets that call's session (instructions, "
                        "voice, tools...); a failure keeps the defaults")
    p.add_argument("--telephony-webhook-timeout-s", type=float, default=3.0, metavar="S",
                   help="how long a call waits for the webhook's answer (default 3 s)")


def _add_record_args(p) -> None:
    """``serve`` options of session recordings (docs/debugging.md, docs/server.md "Recording")."""
    p.add_argument("--record", default=None, metavar="DIR",
                   help="record realtime sessions into DIR/<session_id>/ (audio, events, transcripts, meta; "
                        "view with `duplexkit replay DIR`); default off")
    p.add_argument("--record-policy", default="all", choices=["all", "opt-in", "always"],
                   help="which sessions --record records: all (default; a client may opt out with ?record=0), "
                        "opt-in (only ?record=1), always (?record=0 is refused)")
    p.add_argument("--record-max-mb", type=_float_min(0, strict=True), default=100.0, metavar="MB",
                   help="per-session recording cap in MiB, events + audio (default 100); over it recording stops")
    p.add_argument("--record-keep", default=None, metavar="N|Nd",
                   help="retention: keep the N newest recordings, or those of the last N days (e.g. 7d); "
                        "default: keep all")


def _record_settings(args) -> dict:
    from duplexkit.recording import RecordingError, parse_keep

    keep = getattr(args, "record_keep", None)
    try:
        parse_keep(keep)
    except RecordingError as exc:
        raise CliError(f"--record-keep: {exc}", EXIT_USAGE) from exc
    rec = getattr(args, "record", None)
    return {"record_dir": Path(rec) if rec else None, "record_policy": getattr(args, "record_policy", "all"),
            "record_max_mb": getattr(args, "record_max_mb", 100.0), "record_keep": keep}


def _telephony_settings(args) -> dict:
    url = getattr(args, "telephony_webhook", None)
    if url is not None and not url.startswith(("http://", "https://")):
        raise CliError(f"--telephony-webhook must be an http:// or https:// URL, got {url!r}", EXIT_USAGE)
    timeout = getattr(args, "telephony_webhook_timeout_s", 3.0)
    if not timeout > 0:
        raise CliError(f"--telephony-webhook-timeout-s must be > 0, got {timeout}", EXIT_USAGE)
    return {"telephony_webhook": url, "telephony_webhook_timeout_s": timeout}


def _tool_settings(args) -> dict:
    url = getattr(args, "tool_model", None)
    if url is not None and not url.startswith(("http://", "https://")):
        raise CliError(f"--tool-model must be an http:// or https:// URL, got {url!r}", EXIT_USAGE)
    return {"tool_model_url": url, "tool_model_key": getattr(args, "tool_model_key", None),
            "tool_model_name": getattr(args, "tool_model_name", None)}


def _add_ray_args(p) -> None:
    """``serve`` options of the Ray Serve deployment (docs/deployment.md, "Ray Serve")."""
    p.add_argument("--ray-replicas", type=_replica_range, default=None, metavar="N|MIN-MAX",
                   help="serve N replicas on Ray Serve (one engine each, one endpoint), or autoscale between "
                        "MIN and MAX on ongoing sessions; needs Ray Serve (pip install 'duplexkit[ray]')")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, else a new local cluster)")
    p.add_argument("--ray-gpus-per-replica", type=_float_min(0), default=None,
                   help="GPUs per replica (default: the CUDA devices the layout names; 0 for scripted and cpu)")
    p.add_argument("--ray-cpus-per-replica", type=_float_min(0), default=1.0,
                   help="CPUs Ray reserves per replica (default 1)")


def _replica_range(text: str) -> tuple:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), (int(hi) if sep else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX, got {text!r}") from None
    if a < 1 or (b is not None and b < a):
        raise argparse.ArgumentTypeError(f"expected N >= 1 or 1 <= MIN <= MAX, got {text!r}")
    return a, b


def _duration(text: str) -> float:
    """An argparse type: seconds, or a number with s/m/h (``duplexkit_server.lifecycle.parse_duration``)."""
    t = text.strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(t[-1:])
    try:
        v = float(t[:-1] if scale else t) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or a number with s/m/h (e.g. 300, 5m), got {text!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite duration >= 0, got {text}")
    return v


def _hardening_settings(args) -> dict:
    return {"allow_origins": list(args.allow_origin or []), "max_body_bytes": args.max_body_bytes,
            "max_sessions_per_client": args.max_sessions_per_client, "header_timeout_s": args.header_timeout_s,
            "session_resume": args.session_resume, "resume_window_s": args.resume_window_s,
            "resume_journal_events": args.resume_journal_events, "resume_journal_bytes": args.resume_journal_bytes,
            "resume_keep_sent_s": args.resume_keep_sent_s, "max_header_bytes": args.max_header_bytes,
            "body_timeout_s": args.body_timeout_s, "slot_wait_s": args.slot_wait_s,
            "max_outbound_bytes": args.max_outbound_bytes, "outbound_stall_s": args.outbound_stall_s,
            "drain_s": args.drain_s, "metrics": args.metrics}


class _Loader:
    """The server's engine loader (``create_app(engine_loader=...)``), which the server can stop:
    ``cancel()`` (the server stops while the model loads, Ctrl+C or SIGTERM) kills an engine
    process that is loading (``--engine-process``), or interrupts the in-process load in the
    loader thread (:func:`duplexkit.cli.common.interrupt_thread`); the call then raises."""

    def __init__(self, args, scripted: dict) -> None:
        import threading

        self.args = args
        self.scripted = scripted
        self._lock = threading.Lock()
        self._proc = None  # the EngineProcess being started
        self._thread = None  # the thread in an in-process load
        self._cancelled = False

    def __call__(self):
        args = self.args
        try:
            if getattr(args, "engine_process", False):
                engine = self._engine_process()
            else:
                import threading

                with self._lock:
                    if self._cancelled:
                        raise KeyboardInterrupt
                    self._thread = threading.current_thread()
                try:
                    engine = load_engine(args.model, layout=args.layout, dtype=args.dtype, seed=args.weights_seed,
                                         scripted=self.scripted, checked=True)
                finally:
                    with self._lock:
                        self._thread = None
        except CliError as exc:  # the server prints "error: engine failed to load: <message>"
            prefix = "engine failed to load: "
            raise type(exc)(str(exc)[len(prefix):] if str(exc).startswith(prefix) else str(exc),
                            exc.exit_status) from exc.__cause__
        _random_weights_notice(engine)
        return engine

    def cancel(self) -> None:
        from .common import interrupt_thread

        with self._lock:
            self._cancelled = True
            if self._proc is not None:
                self._proc.cancel()
            elif self._thread is not None:
                interrupt_thread(self._thread)

    def _engine_process(self):
        """The engine in its own process (``--engine-process``, docs/architecture.md "Processes"): the
        child runs :func:`duplexkit.engine.loading.load_engine` with the same arguments; its load errors
        come back as the same types (``EngineLoadError`` -> :class:`CliError` exit 4, ``LayoutError`` exit 2)."""
        from duplexkit.engine.process import EngineProcess, EngineSpec
        from duplexkit.errors import EngineLoadError

        args = self.args
        spec = EngineSpec("duplexkit.engine.loading:load_engine", (args.model,),
                          {"layout": args.layout, "dtype": args.dtype, "seed": args.weights_seed,
                           "scripted": self.scripted, "checked": True})
        proc = EngineProcess(spec)
        with self._lock:
            if self._cancelled:
                raise KeyboardInterrupt
            self._proc = proc
        try:
            return proc.start()
        except EngineLoadError as exc:
            raise CliError(str(exc), EXIT_LOAD) from exc.__cause__


def cmd_serve(args) -> int:
    """``duplexkit serve``. Ctrl+C or SIGTERM stop it cleanly with status 0 in every phase (before the
    port is bound, while the model loads, serving, draining): a stop signal is how a server ends."""
    from .common import _stop_resource_tracker

    try:
        return _cmd_serve(args)
    except KeyboardInterrupt:  # SIGINT or SIGTERM (Terminated) before uvicorn took the signals over
        _eprint("stopped")
        return 0
    finally:
        _stop_resource_tracker()  # an engine process was spawned through it: do not let it outlive us


def _cmd_serve(args) -> int:
    _check_model_arg(args.model, getattr(args, "layout", None))  # before importing the server or binding
    tuned = getattr(args, "ray_replicas", None) is None and getattr(args, "process_command_line", False)
    mmap_threshold = numpy_handler = None
    if tuned:
        from duplexkit.memory import fix_mmap_threshold, numpy_without_block_cache, use_malloc_for_objects

        # small objects on glibc's malloc, so that RSS returns to its baseline after load (the trim
        # after sessions close cannot reach pymalloc's arenas); PYTHONMALLOC=pymalloc keeps pymalloc
        use_malloc_for_objects()
        # large buffers mmapped, so that they do not spread the brk heap (MALLOC_MMAP_THRESHOLD_ keeps
        # an operator's value); numpy's freed small blocks given back, not cached (duplexkit/memory.py)
        mmap_threshold = fix_mmap_threshold()
        numpy_handler = numpy_without_block_cache()
    sock = _bind(args.host, args.port)
    import logging

    from duplexkit_server import ServerSettings, create_app, serve

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if tuned:
        logging.getLogger("duplexkit.memory").info(
            "allocator: PYTHONMALLOC=%s, %s, numpy data handler %s", os.environ.get("PYTHONMALLOC", "pymalloc"),
            f"glibc mmap threshold fixed at {mmap_threshold} bytes" if mmap_threshold
            else "glibc mmap threshold not set",
            numpy_handler)
    defaults = _session_defaults(args, args.model)
    settings = ServerSettings(
        model_id=args.served_model_name, aliases=list(args.alias or []), api_keys=list(args.api_key or []),
        openai_model_ids=args.openai_model_ids,
        max_sessions=args.max_sessions, max_event_bytes=args.max_event_bytes, idle_timeout_s=args.idle_timeout_s,
        ping_interval_s=args.ping_interval_s, max_pending_input_s=args.max_pending_input_s,
        silence_slack_ms=args.silence_slack_ms,
        max_ref_audio_s=args.max_ref_audio_s, max_input_audio_s=args.max_input_audio_s,
        ref_audio_dir=Path(args.ref_audio_dir) if args.ref_audio_dir else None,
        max_output_tokens=defaults.get("max_output_tokens", 1024), answer_policy=defaults.get("answer_policy"),
        default_input_rate=args.default_input_rate, default_instructions=args.instructions,
        default_voice=Path(args.default_voice) if args.default_voice else None,
        voices=dict(_parse_voice(v) for v in (args.voice or [])),
        **_hardening_settings(args), **_tool_settings(args),
        **_telephony_settings(args), **_record_settings(args))
    scripted = _parse_scripted(args.scripted)
    if getattr(args, "ray_replicas", None) is not None:
        sock.close()  # the port was free; Serve's proxy binds it
        from .ray_serve import serve_on_ray

        return serve_on_ray(args, settings, scripted)

    app = create_app(engine_loader=_Loader(args, scripted), settings=settings)
    port = sock.getsockname()[1]
    _eprint(f"duplexkit serving {args.model} on http://{args.host}:{port} "
            f"(realtime: ws://{args.host}:{port}/v1/realtime?duplex=1 or /v1/duplex; OpenAI-compatible: "
            f"/v1/realtime; auth {'on' if settings.api_keys else 'off'})")
    rc = serve(app, host=args.host, port=port, log_level=args.log_level, sockets=[sock])
    err = app.state.duplexkit.load_error
    if err is not None:
        from duplexkit.errors import LayoutError

        return EXIT_USAGE if isinstance(err, LayoutError) else EXIT_LOAD
    return rc

