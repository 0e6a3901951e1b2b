"""``duplexkit serve``: the bundled server."""

from __future__ import annotations

import argparse
import os
import typing
from pathlib import Path
from typing import Any, Union

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
    check_output_dir,
    load_engine,
    recording_summary,
)


def _settings_option_type(typ: Any, opt):
    """The argparse ``type`` of a settings option: its syntax's parser, or a bounded int / float."""
    if opt.syntax == "duration":
        return _duration
    if opt.syntax == "http_url":
        return _http_url
    if opt.syntax == "retention":
        return _retention
    if typ is int:
        if opt.ge is None and opt.gt is None:
            return int
        lo = int(opt.ge) if opt.ge is not None else int(opt.gt) + 1
        return _int_range(lo, None if opt.le is None else int(opt.le))
    if typ is float:
        if opt.gt is not None:
            return _float_min(opt.gt, strict=True)
        return _float_min(opt.ge) if opt.ge is not None else float
    return None


def _unoptional(typ: Any) -> Any:
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    return args[0] if typing.get_origin(typ) is Union and len(args) == 1 else typ


def _settings_dest(name: str, typ: Any, opt) -> str:
    """The argparse ``dest`` of a settings option: the flag's name (``--api-key`` -> ``api_key``), the
    field's for a ``--no-...`` switch."""
    if typ is bool:
        return name
    return (opt.flag or "--" + name.replace("_", "-"))[2:].replace("-", "_")


def _add_settings_args(p, group: str) -> None:
    """The ``serve`` options of one group of :class:`duplexkit.settings.ServerSettings` fields,
    generated from the fields: flag, type and bounds, default, choices and help."""
    from dataclasses import MISSING, fields

    from duplexkit.settings import ServerSettings, cli_options

    defaults = {f.name: f.default for f in fields(ServerSettings)}
    for name, typ, opt in cli_options(group):
        flag = opt.flag or "--" + name.replace("_", "-")
        base = _unoptional(typ)
        kw: dict[str, Any] = {"help": opt.help}
        if base is bool:
            if flag.startswith("--no-"):
                kw.update(dest=name, action="store_false")
            else:
                kw.update(action=argparse.BooleanOptionalAction, default=defaults[name])
        elif typing.get_origin(base) is list or base is dict:
            kw.update(action="append", default=None)  # repeatable; none given -> the field's empty default
        else:
            kw["default"] = None if defaults[name] is MISSING else defaults[name]
            kind = _settings_option_type(base, opt)
            if kind is not None:
                kw["type"] = kind
        if opt.choices:
            kw["choices"] = list(opt.choices)
        if opt.metavar:
            kw["metavar"] = opt.metavar
        p.add_argument(flag, **kw)


def _flag(field: str) -> str:
    """The ``serve`` flag of a :class:`duplexkit.settings.ServerSettings` field (``record_dir`` -> ``--record``)."""
    from duplexkit.settings import cli_options

    return next(opt.flag or "--" + name.replace("_", "-") for name, _, opt in cli_options() if name == field)


def _settings_from_args(args) -> dict:
    """``ServerSettings`` keyword arguments of every settings option in ``args`` (a missing
    attribute keeps the field's default): repeated options become lists (``--voice NAME=WAV``
    a dict), paths :class:`~pathlib.Path` (an empty one None)."""
    from dataclasses import MISSING

    from duplexkit.settings import cli_options

    out: dict[str, Any] = {}
    for name, typ, opt in cli_options():
        v = getattr(args, _settings_dest(name, typ, opt), MISSING)
        base = _unoptional(typ)
        if v is MISSING:
            continue
        if opt.syntax == "name=path":
            v = dict(_parse_voice(x) for x in v or [])
        elif typing.get_origin(base) is list:
            v = list(v or [])
        elif base is Path:
            v = Path(v) if v else None
        out[name] = v
    return out


def _http_url(text: str) -> str:
    """An argparse type: an ``http://`` or ``https://`` URL."""
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL, got {text!r}")
    return text


def _retention(text: str) -> str:
    """An argparse type: a recording retention, ``N`` or ``Nd`` (:func:`duplexkit.recording.parse_keep`)."""
    from duplexkit.recording import RecordingError, parse_keep

    try:
        parse_keep(text)
    except RecordingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_hardening_args(p) -> None:
    """``serve`` options of the server's security and quota layer (docs/server.md, "Security") and of
    operability (docs/deployment.md, "Probes", "Metrics", "Runbook")."""
    _add_settings_args(p, "hardening")


def _add_tool_args(p) -> None:
    """``serve`` options of the tool decider (docs/tools.md, "Delegation") and the phone bridges."""
    _add_settings_args(p, "tools")
    _add_telephony_args(p)


def _add_telephony_args(p) -> None:
    """``serve`` options of the phone media-stream bridges (docs/telephony.md)."""
    _add_settings_args(p, "telephony")


def _add_record_args(p) -> None:
    """``serve`` options of session recordings (docs/debugging.md, docs/server.md "Recording")."""
    _add_settings_args(p, "record")


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
                                         scripted=self.scripted, checked=True,
                                         quantization=getattr(args, "quantization", None),
                                         memory_gib=getattr(args, "memory", None))
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
        from .common import interrupt_until_stopped

        with self._lock:
            self._cancelled = True
            if self._proc is not None:
                self._proc.cancel()
                return
        # the in-process load: interrupted until it has stopped (one interrupt can be swallowed)
        interrupt_until_stopped(lambda: self._thread, self._lock, load_engine.__code__)

    def _engine_process(self):
        """The engine in its own process (``--engine-process``, docs/architecture.md "Processes"): the
        child runs :func:`duplexkit.engine.loading.load_engine` with the same arguments; its load errors
        come back as the same types (``EngineLoadError`` -> :class:`CliError` exit 4, ``LayoutError`` exit 2)."""
        from duplexkit.engine.process import EngineProcess, EngineSpec
        from duplexkit.errors import EngineLoadError

        args = self.args
        spec = EngineSpec("duplexkit.engine.loading:load_engine", (args.model,),
                          {"layout": args.layout, "dtype": args.dtype, "seed": args.weights_seed,
                           "scripted": self.scripted, "checked": True,
                           "quantization": getattr(args, "quantization", None),
                           "memory_gib": getattr(args, "memory", None)})
        proc = EngineProcess(spec)
        with self._lock:
            if self._cancelled:
                raise KeyboardInterrupt
            self._proc = proc
        try:
            return proc.start()
        except EngineLoadError as exc:
            raise CliError(str(exc), EXIT_LOAD) from exc.__cause__


def _planned_sessions(args, memory_gib: float, max_sessions: int) -> int:
    """``--max-sessions`` capped at the stream slots of the memory plan for ``--memory`` (the engine
    is built to the same plan, :meth:`duplexkit.engine.DuplexEngine.from_pretrained`), so a session
    beyond them is refused with ``session_capacity_exhausted`` like any other over capacity.

    Raises:
        MemoryBudgetError (a LayoutError: exit 2): the budget cannot hold the model or one stream;
        PreflightError: ``--memory`` with an engine plugin (``scripted``).
    """
    import logging

    from duplexkit.engine import DuplexEngine, load_layout
    from duplexkit.engine.engine import default_layout_name, tiny_checkpoint_dir
    from duplexkit.engine.loading import check_plugin_options

    check_plugin_options(args.model, memory_gib=memory_gib)
    ckpt = tiny_checkpoint_dir(args.weights_seed) if args.model == "tiny" else Path(args.model)
    plan, _ = DuplexEngine._memory_plan(ckpt, load_layout(args.layout or default_layout_name()), memory_gib,
                                        dtype=args.dtype, quantization="none", thinker_positions=None, streams=None)
    n = min(int(max_sessions), plan.streams)
    logging.getLogger("duplexkit.memory").info(
        "memory plan for %g GiB: %d stream slots (%d thinker KV positions, %d Code2Wav graph rows); max sessions %d",
        memory_gib, plan.streams, plan.thinker_positions, plan.graph_rows, n)
    return n


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
    if getattr(args, "record", None):  # a session would only log a warning for a bad one
        check_output_dir(args.record, _flag("record_dir"))
    from duplexkit.engine.loading import check_plugin_options

    check_plugin_options(args.model, memory_gib=getattr(args, "memory", None),  # not silently ignored
                         quantization=getattr(args, "quantization", None))
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
    if tuned:  # how the process's memory is set up: for --log-level debug, not every user's first line
        logging.getLogger("duplexkit.memory").debug(
            "allocator: PYTHONMALLOC=%s, %s, numpy data handler %s", os.environ.get("PYTHONMALLOC", "pymalloc"),
            f"glibc mmap threshold fixed at {mmap_threshold} bytes" if mmap_threshold
            else "glibc mmap threshold not set",
            numpy_handler)
    from duplexkit import tracing

    try:  # OpenTelemetry traces when OTEL_EXPORTER_OTLP_*ENDPOINT is set: a bad setting fails here
        tracing.check_env()
    except tracing.TracingError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    defaults = _session_defaults(args, args.model)
    options = _settings_from_args(args)
    if options.get("memory_gib") is not None:
        options["max_sessions"] = _planned_sessions(args, options["memory_gib"], options.get("max_sessions", 8))
    settings = ServerSettings(**options, max_output_tokens=defaults.get("max_output_tokens", 1024),
                              answer_policy=defaults.get("answer_policy"))
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
    recorder = getattr(app.state.duplexkit, "recorder", None)  # made with the first recorded session
    if settings.record_dir is not None and app.state.duplexkit.engine is not None:
        sessions = size = 0
        if recorder is not None:
            recorder.close()  # the sessions closed by the shutdown are written out first
            sessions, size = recorder.summary()
        _eprint(recording_summary(settings.record_dir, sessions, size))
    err = app.state.duplexkit.load_error
    if err is not None:
        from duplexkit.errors import LayoutError

        return EXIT_USAGE if isinstance(err, LayoutError) else EXIT_LOAD
    return rc

