"""Many duplexkit replicas behind one endpoint, on Ray Serve (docs/deployment.md, "Ray Serve").

Each Serve replica builds its own engine (a picklable loader, run once per replica;
:mod:`duplexkit.cli.ray_serve` makes the one of ``duplexkit serve``: ``model``, ``layout``,
``dtype``, ``scripted`` options) and serves the bundled FastAPI app (:func:`duplexkit_server.create_app`) as
Serve's ingress, so ``/v1/realtime``, ``/v1/duplex`` (WebSocket) and ``/v1/chat/completions``,
``/health``, ``/ready``, ``/live``, ``/metrics`` (HTTP) go through Serve's proxy. A session is placed
once, when its WebSocket connects, by Serve's router (power of two choices on ongoing requests), and
stays on that replica for its whole life.

* Identity: each replica sets :attr:`ServerSettings.replica_id` to Serve's replica tag
  (``serve.get_replica_context().replica_tag``); ``/health`` and ``/ready`` report it as
  ``replica`` and every HTTP response and WebSocket handshake carries it in the
  :data:`REPLICA_HEADER` header.
* Capacity: the session cap stays duplexkit's (``max_sessions``; a full replica refuses a WebSocket
  with ``error{session_capacity_exhausted}`` + close 1013 and chat with HTTP 503). Serve's
  ``max_ongoing_requests`` is ``max_sessions + probe_headroom``, so probes, metrics scrapes and
  refusals still reach a replica whose slots are all taken instead of waiting in Serve's queue, and
  ``max_queued_requests`` bounds what waits in that queue (beyond it the proxy answers 503).
* Drain: when Serve stops a replica (scale-in, redeploy, ``serve delete``, ``serve shutdown``) it
  first takes it out of routing, then waits up to ``graceful_shutdown_timeout_s`` for its ongoing
  requests (= live sessions) and then kills it. The replica notices the stop and runs the server's
  own drain (:func:`duplexkit_server.lifecycle.drain`): new sessions are refused, live ones go on for
  up to ``drain_s``, then get ``session.closed{reason:"shutdown"}`` and close 1001, all inside
  Serve's timeout (set to ``drain_s + shutdown_grace_s + DRAIN_MARGIN_S``).

  Serve has no public hook for "this replica is stopping": the replica reads the ``_shutting_down``
  flag of Ray Serve's internal ``Replica`` object (checked with Ray 2.60). When that object
  cannot be found (another Ray version), a warning is logged and a stopping replica's live sessions
  end when Serve kills it, without ``session.closed``.

Start it with ``duplexkit serve MODEL --ray-replicas N`` or ``serve run deploy/ray/duplexkit.yaml``
(both in :mod:`duplexkit.cli.ray_serve`). Ray is imported only inside functions.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from .app import ServerSettings, create_app

logger = logging.getLogger("duplexkit.server.ray")

__all__ = ["REPLICA_HEADER", "DRAIN_MARGIN_S", "RayOptions", "build_app", "deployment_options", "drain_budget"]

#: Response / WebSocket-handshake header naming the replica that served it.
REPLICA_HEADER = "x-duplexkit-replica"
#: Seconds of Serve's ``graceful_shutdown_timeout_s`` beyond ``drain_s + shutdown_grace_s``: Serve's
#: drain loop polls every ``graceful_shutdown_wait_loop_s`` (1 s here) and then closes the engine.
DRAIN_MARGIN_S = 5.0
#: Seconds between copies of a replica's metrics into Ray's metrics (:func:`_mirror_metrics`).
MIRROR_PERIOD_S = 5.0
#: Serve's name for the deployment and the default application name.
DEPLOYMENT_NAME = "duplexkit"


@dataclass
class RayOptions:
    """How the replicas are run (each maps to a ``duplexkit serve --ray-*`` flag).

    Attributes:
        replicas: fixed number of replicas, or the minimum with autoscaling (``max_replicas`` set).
        max_replicas: autoscale between ``replicas`` and this on Serve's ongoing-requests signal
            (None: a fixed count).
        target_sessions: the autoscaler's ``target_ongoing_requests`` per replica (None:
            ``0.75 * max_sessions``, at least 1). One live session is one ongoing request.
        gpus_per_replica: Ray ``num_gpus`` of each replica (Ray sets ``CUDA_VISIBLE_DEVICES``,
            so the layout's ``cuda:0`` is the replica's first GPU).
        cpus_per_replica: Ray ``num_cpus`` of each replica (a scheduling reservation).
        probe_headroom: Serve ``max_ongoing_requests`` is ``max_sessions`` plus this.
        max_queued_requests: requests that may wait in each proxy's queue when every replica is at
            ``max_ongoing_requests``; beyond that the proxy answers HTTP 503.
    """

    replicas: int = 1
    max_replicas: Optional[int] = None
    target_sessions: Optional[float] = None
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    probe_headroom: int = 4
    max_queued_requests: int = 16

    def __post_init__(self) -> None:
        if self.replicas < 1 and not self.max_replicas:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < max(1, self.replicas):
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= replicas ({self.replicas}) and >= 1")
        if self.probe_headroom < 1:
            raise ValueError("probe_headroom must be >= 1: probes must reach a full replica")


def deployment_options(settings: ServerSettings, ray: RayOptions) -> dict:
    """The ``serve.deployment`` options for ``settings`` and ``ray`` (documented in
    docs/deployment.md, "Ray Serve"). Pure: needs no Ray."""
    opts: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": settings.max_sessions + ray.probe_headroom,
        "max_queued_requests": ray.max_queued_requests,
        "graceful_shutdown_timeout_s": settings.drain_s + settings.shutdown_grace_s + DRAIN_MARGIN_S,
        "graceful_shutdown_wait_loop_s": 1.0,
        "ray_actor_options": {"num_cpus": ray.cpus_per_replica, "num_gpus": ray.gpus_per_replica},
    }
    if ray.max_replicas is None:
        opts["num_replicas"] = ray.replicas
    else:
        target = ray.target_sessions or ceil_target(settings.max_sessions)
        opts["autoscaling_config"] = {
            "min_replicas": ray.replicas, "max_replicas": ray.max_replicas,
            "target_ongoing_requests": target,
            # sessions last minutes: scale out after 30 s of load, scale in (a drain) only after 10 min
            "upscale_delay_s": 30.0, "downscale_delay_s": 600.0,
        }
    return opts


def _stopping_probe():
    """A callable telling whether Serve has begun stopping this replica, or None when Ray Serve's
    internal ``Replica`` object (its ``_shutting_down`` flag, Ray 2.60) cannot be found."""
    import gc

    from ray import serve

    try:
        from ray.serve._private.replica import Replica
    except ImportError:
        return None
    me = serve.get_replica_context().replica_id
    for obj in gc.get_objects():
        if isinstance(obj, Replica) and getattr(obj, "_replica_id", None) == me \
                and isinstance(getattr(obj, "_shutting_down", None), bool):
            return lambda: bool(obj._shutting_down)
    return None


async def _mirror_metrics(registry, replica_id: str, period_s: float) -> None:
    """Copy every sample of the replica's ``/metrics`` registry into Ray's metrics every
    ``period_s`` seconds, as gauges with a ``replica`` tag (exported by each Ray node's metrics agent
    as ``ray_<sample name>``; counters and histogram buckets keep their cumulative values).
    Through Serve's proxy ``/metrics`` answers from one replica at a time; these series show all."""
    from ray.util.metrics import Gauge

    gauges: dict = {}
    while True:
        try:
            for fam in registry.collect():
                for sample in fam.samples:
                    if sample.name.endswith("_created"):
                        continue
                    keys = tuple(sorted({*sample.labels, "replica"}))
                    g = gauges.get((sample.name, keys))
                    if g is None:
                        g = gauges[(sample.name, keys)] = Gauge(
                            sample.name, description=fam.documentation or sample.name, tag_keys=keys)
                    g.set(float(sample.value), tags={**sample.labels, "replica": replica_id})
        except Exception:  # pragma: no cover - never let metrics break the replica
            logger.exception("mirroring metrics into Ray failed; retrying")
        await asyncio.sleep(period_s)


def drain_budget(settings: ServerSettings, graceful_shutdown_timeout_s: Optional[float]) -> float:
    """How long a stopping replica lets live sessions go on: ``settings.drain_s``, cut so that
    ``session.closed`` (``shutdown_grace_s``) and Serve's drain poll still fit in Serve's
    ``graceful_shutdown_timeout_s`` (a config file may set it lower than duplexkit does)."""
    if graceful_shutdown_timeout_s is None:
        return settings.drain_s
    room = graceful_shutdown_timeout_s - settings.shutdown_grace_s - DRAIN_MARGIN_S / 2
    return max(0.0, min(settings.drain_s, room))


def _graceful_shutdown_timeout_s() -> Optional[float]:
    """This deployment's ``graceful_shutdown_timeout_s`` as Serve runs it (None if unknown)."""
    from ray import serve

    config = getattr(serve.get_replica_context(), "_deployment_config", None)
    value = getattr(config, "graceful_shutdown_timeout_s", None)
    return float(value) if isinstance(value, (int, float)) else None


class _ReplicaHeader:
    """ASGI middleware: adds :data:`REPLICA_HEADER` to HTTP responses and WebSocket accepts."""

    def __init__(self, app, replica_id: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*(message.get("headers") or []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class DuplexkitReplica:
    """One Serve replica: one engine, one :func:`create_app` app (the class Serve instantiates;
    wrapped by ``serve.ingress()`` in :func:`build_app`)."""

    async def __init__(self, engine_loader: Callable[[], Any], settings: dict, watch_period_s: float = 0.25,
                       mirror_period_s: float = MIRROR_PERIOD_S) -> None:
        from ray import serve

        from . import lifecycle

        self.replica_id = serve.get_replica_context().replica_tag
        self.settings = ServerSettings(**{**settings, "replica_id": self.replica_id})
        # load before joining: Serve routes to a replica only once its constructor has returned
        self.engine = await asyncio.to_thread(engine_loader)
        self._fastapi = create_app(self.engine, self.settings)
        self._fastapi.add_middleware(_ReplicaHeader, replica_id=self.replica_id)
        self.state = self._fastapi.state.duplexkit
        self._drain = lifecycle.drain
        self._stopping = _stopping_probe()
        if self._stopping is None:
            logger.warning("cannot see Ray Serve's replica shutdown flag (Ray version?): when Serve stops "
                           "this replica, live sessions end without session.closed{shutdown}")
        else:
            self._watch = asyncio.get_running_loop().create_task(self._watch_stop(watch_period_s))
        if self.state.metrics is not None and mirror_period_s > 0:
            self._mirror = asyncio.get_running_loop().create_task(
                _mirror_metrics(self.state.metrics.registry, self.replica_id, mirror_period_s))
        logger.info("duplexkit replica %s ready (%s, %d session slots)", self.replica_id,
                    getattr(self.engine, "model_id", "?"), self.settings.max_sessions)

    async def _watch_stop(self, period_s: float) -> None:
        while not self._stopping():
            await asyncio.sleep(period_s)
        drain_s = drain_budget(self.settings, _graceful_shutdown_timeout_s())
        logger.info("replica %s: Serve is stopping it; draining up to %g s", self.replica_id, drain_s)
        await self._drain(self.state, drain_s)

    def __serve_build_asgi_app__(self):
        return self._fastapi


def build_app(engine_loader: Callable[[], Any], settings: ServerSettings, ray: Optional[RayOptions] = None):
    """The Serve application (``serve.run(build_app(...))``).

    Args:
        engine_loader: a picklable zero-argument callable that returns the replica's engine, run
            once in each replica (e.g. ``functools.partial(duplexkit.engine.load_engine, "scripted")``;
            :func:`duplexkit.cli.ray_serve.engine_loader` builds the one of ``duplexkit serve``).
        settings: the server options of every replica (``replica_id`` is set per replica).
        ray: replica count, autoscaling and resources (:class:`RayOptions`).

    Raises:
        ImportError: Ray Serve is not installed (``pip install 'duplexkit[ray]'``).
    """
    from ray import serve

    ray = ray or RayOptions()
    cls = serve.ingress()(DuplexkitReplica)
    dep = serve.deployment(cls, **deployment_options(settings, ray))
    settings_d = {k: v for k, v in asdict(settings).items() if k != "replica_id"}
    return dep.bind(engine_loader, settings_d)


def ceil_target(max_sessions: int) -> float:
    """The default autoscaling target: ``0.75 * max_sessions`` rounded up, at least 1."""
    return float(max(1, math.ceil(0.75 * max_sessions)))
