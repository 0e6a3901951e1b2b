"""``duplexkit serve MODEL --ray-replicas N`` and the ``serve run`` config builder: the engine side
of :mod:`duplexkit_server.ray_serve` (docs/deployment.md, "Ray Serve").

The server room may not import the engine (docs/architecture.md, "Import rules"), so the loader
each replica runs is built here: :func:`engine_loader` returns a picklable callable that Serve ships
to every replica.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

from .common import EXIT_LOAD, EXIT_USAGE, CliError, _eprint

#: Serve's proxy checks, patient enough for a loaded host (Ray 2.60 defaults: ready check 5 s,
#: health check 10 s, 3 misses). On a machine whose cores are busy (the engine's own threads, CI),
#: Serve otherwise kills a proxy that is merely slow to start and the deployment never comes up.
#: Applied to local clusters this command starts; set the variables yourself to override them.
SERVE_PATIENCE = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


def patient_serve_checks() -> None:
    """Set :data:`SERVE_PATIENCE` in the environment (unless already set) before ``ray.init``
    starts a local cluster, whose processes inherit it."""
    for key, value in SERVE_PATIENCE.items():
        os.environ.setdefault(key, value)

__all__ = ["engine_loader", "gpus_of_layout", "app_builder", "serve_on_ray"]

#: ``app_builder`` args that go to the engine loader; the rest are ServerSettings or RayOptions fields.
ENGINE_ARGS = ("model", "layout", "dtype", "scripted", "seed", "quantization")


def engine_loader(model: str, *, layout: Optional[str] = None, dtype: Optional[str] = None, seed: int = 0,
                  scripted: Optional[dict] = None, quantization: Optional[str] = None,
                  memory_gib: Optional[float] = None):
    """A picklable zero-argument callable that loads ``model`` as ``duplexkit serve`` does
    (:func:`duplexkit.engine.load_engine`, pre-load checks included, no progress output).
    Raises (when called) what ``load_engine`` raises: ``PreflightError``/``LayoutError``,
    :class:`~duplexkit.errors.EngineLoadError`. ``memory_gib``: build to the memory plan for that
    budget (``serve --memory``, :mod:`duplexkit.engine.memory_plan`)."""
    from duplexkit.engine.loading import load_engine

    return functools.partial(load_engine, model, layout=layout, dtype=dtype, seed=seed,
                             scripted=dict(scripted or {}), progress=False, quantization=quantization,
                             memory_gib=memory_gib)


def gpus_of_layout(layout: Optional[str], model: str) -> int:
    """How many GPUs a replica needs: the distinct CUDA devices of ``layout`` (0 for ``scripted``,
    for ``cpu``, and for ``tiny`` without a layout; a checkpoint without a layout gets ``1gpu``'s 1)."""
    if model == "scripted":
        return 0
    if layout is None:
        return 0 if model == "tiny" else 1
    from duplexkit.engine import load_layout

    devices = set()
    for stage in load_layout(layout).stages.values():
        devs = stage.device if isinstance(stage.device, (list, tuple)) else [stage.device]
        devices.update(str(d) for d in devs if str(d).startswith("cuda"))
    return len(devices)


def app_builder(args: dict):
    """Serve application builder for ``serve run`` / ``serve deploy`` config files
    (``import_path: duplexkit.cli.ray_serve:app_builder``; deploy/ray/duplexkit.yaml).

    ``args``: ``model`` (required), ``layout``, ``dtype``, ``seed``, ``scripted``, ``quantization`` (the engine), any
    :class:`~duplexkit_server.ServerSettings` field (``max_sessions``, ``drain_s``, ``api_keys``, ...)
    and any :class:`~duplexkit_server.ray_serve.RayOptions` field (``replicas``, ``max_replicas``,
    ``gpus_per_replica``, ...). Raises ``ValueError`` on a missing model or an unknown key.
    """
    from dataclasses import fields

    from duplexkit_server import ServerSettings
    from duplexkit_server.ray_serve import RayOptions, build_app

    args = dict(args)
    if "model" not in args:
        raise ValueError("app_builder needs args.model (a checkpoint path, 'tiny' or 'scripted')")
    engine = {k: args.pop(k) for k in ENGINE_ARGS if k in args}
    s_names = {f.name for f in fields(ServerSettings)} - {"replica_id"}
    r_names = {f.name for f in fields(RayOptions)}
    unknown = set(args) - s_names - r_names
    if unknown:
        raise ValueError(f"unknown app_builder args: {sorted(unknown)}")
    settings = ServerSettings(**{k: v for k, v in args.items() if k in s_names})
    ray_opts = {k: v for k, v in args.items() if k in r_names}
    ray_opts.setdefault("gpus_per_replica", gpus_of_layout(engine.get("layout"), engine["model"]))
    return build_app(engine_loader(engine.pop("model"), memory_gib=settings.memory_gib, **engine), settings,
                     RayOptions(**ray_opts))


def serve_on_ray(args, settings, scripted: dict) -> int:
    """``duplexkit serve MODEL --ray-replicas N|MIN-MAX``: the replicas on Ray Serve behind its proxy
    at ``--host:--port`` until SIGTERM or SIGINT; then Serve stops every replica, each draining for
    ``--drain-s``. Joins ``--ray-address`` / ``$RAY_ADDRESS``, else starts a local cluster.

    Returns 0 after a clean stop. Raises :class:`CliError`: exit 2 when Ray Serve is not installed,
    exit 4 when Serve gives up constructing replicas (the engine failed to load)."""
    import signal
    import threading

    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise CliError(f"--ray-replicas needs Ray Serve, which is not installed ({exc}); install it with "
                       "python -m pip install 'duplexkit[ray]'", EXIT_USAGE) from None
    from duplexkit_server.ray_serve import DEPLOYMENT_NAME, RayOptions, build_app

    lo, hi = args.ray_replicas
    gpus = args.ray_gpus_per_replica
    if gpus is None:
        gpus = gpus_of_layout(args.layout, args.model)
    options = RayOptions(replicas=lo, max_replicas=hi, gpus_per_replica=gpus,
                         cpus_per_replica=args.ray_cpus_per_replica)
    settings.bind_host, settings.bind_port = args.host, args.port
    loader = engine_loader(args.model, layout=args.layout, dtype=args.dtype, seed=args.weights_seed,
                           scripted=scripted, quantization=getattr(args, "quantization", None),
                           memory_gib=settings.memory_gib)
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:  # a new local cluster, never one some other `ray start` left on this machine
        patient_serve_checks()
        ray.init(address="local", include_dashboard=False)
    stop = threading.Event()
    prev: dict[Any, Any] = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(build_app(loader, settings, options), name=DEPLOYMENT_NAME, route_prefix="/")
        except RuntimeError as exc:  # Serve gave up constructing replicas (the engine failed to load)
            raise CliError(f"engine failed to load on Ray Serve: {str(exc).strip().splitlines()[0]} "
                           "(the replicas' errors are in the log above)", EXIT_LOAD) from exc
        scale = f"{lo}" if hi is None else f"{lo}-{hi} (autoscaling)"
        _eprint(f"duplexkit serving {args.model} on Ray Serve, {scale} replica(s), at http://{args.host}:{args.port} "
                f"(realtime: /v1/realtime, /v1/duplex; auth {'on' if settings.api_keys else 'off'}); "
                "SIGTERM/Ctrl+C drains and stops")
        stop.wait()
        _eprint(f"stopping: each replica drains for up to {settings.drain_s:g} s")
        serve.delete(DEPLOYMENT_NAME)
    finally:
        for sig, handler in prev.items():
            signal.signal(sig, handler)
        serve.shutdown()
        ray.shutdown()
    return 0
