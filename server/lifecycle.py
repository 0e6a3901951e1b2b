"""Probes, drain and the uvicorn runner of the bundled server (docs/deployment.md, "Probes" and
"Runbook"; docs/server.md, "Graceful shutdown").

* ``GET /ready``: 200 while the replica accepts a new session; 503 with a JSON ``status`` of
  ``loading``, ``error``, ``draining`` or ``full`` otherwise (a load balancer's readiness probe).
* ``GET /live``: 200 while the process and its event loop run (a liveness probe: it needs nothing
  else, so a busy engine never gets the pod restarted); 503 ``error`` once the engine process died
  (:mod:`duplexkit.engine.process`: nothing but a restart brings it back).
* :func:`drain`: refuse new sessions (WebSocket close 1013 ``session_capacity_exhausted``, chat HTTP
  503), wait up to ``drain_s`` for the live sessions to end by themselves, then close the rest with
  ``session.closed{reason:"shutdown"}`` and close 1001 (docs/protocol.md §1.5), and wait (within
  ``shutdown_grace_s``) for the clients' close frames in reply (:func:`close_handshakes`).
* :func:`serve`: uvicorn with duplexkit's transport limits; SIGTERM drains for
  ``ServerSettings.drain_s``; SIGINT (Ctrl+C), or a second signal during a drain, closes the
  sessions at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from typing import Callable, Optional

logger = logging.getLogger("duplexkit.server")

__all__ = ["not_ready_reason", "install", "drain", "close_handshakes", "serve"]


def not_ready_reason(state) -> Optional[str]:
    """Why the replica takes no new session now: ``error`` (the model failed to load, or the engine
    process died), ``loading``,
    ``draining`` (SIGTERM received, or shutting down), ``full`` (every slot in use); None when it does."""
    if state.load_error is not None:
        return "error"
    if state.engine is None:
        return "loading"
    if getattr(state, "engine_failure", None) is not None:
        return "error"
    if state.shutting_down or getattr(state, "draining", False):
        return "draining"
    if state.slots.used >= state.slots.size:
        return "full"
    return None


_MESSAGES = {
    "error": "the model failed to load",
    "loading": "the model is loading",
    "draining": "this replica is draining for shutdown: new sessions go to another replica",
    "full": "every session slot is in use",
}


def install(app, state) -> None:
    """Add ``GET``/``HEAD /ready`` and ``GET``/``HEAD /live`` (no authentication: probes carry no key, and the bodies
    hold only the states above and slot counts)."""
    from fastapi.responses import JSONResponse

    @app.api_route("/ready", methods=["GET", "HEAD"], include_in_schema=False)
    async def ready():
        reason = not_ready_reason(state)
        body = {"status": reason or "ready", "sessions_active": state.slots.used, "sessions_max": state.slots.size}
        if state.settings.replica_id:
            body["replica"] = state.settings.replica_id
        if reason is None:
            return body
        failure = getattr(state, "engine_failure", None)
        body["reason"] = (f"the engine failed: {failure}; restart the server"
                          if reason == "error" and state.load_error is None and failure else _MESSAGES[reason])
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(state.settings.retry_after_s)})

    @app.api_route("/live", methods=["GET", "HEAD"], include_in_schema=False)
    async def live():
        failure = getattr(state, "engine_failure", None)
        if failure is not None:  # the engine process died: only a restart brings it back
            return JSONResponse({"status": "error", "reason": f"the engine failed: {failure}; restart the server",
                                 "uptime_s": int(time.time()) - state.started_at}, status_code=503)
        return {"status": "alive", "uptime_s": int(time.time()) - state.started_at}


async def drain(state, drain_s: float, *, force: Callable[[], bool] = lambda: False, poll_s: float = 0.1,
                handshakes: Callable[[], int] = lambda: 0, stop: Callable[[], bool] = lambda: False) -> int:
    """Drain: refuse new sessions, wait up to ``drain_s`` seconds while slots are in use (stop early
    when ``force()`` turns true), then close what is left with ``session.closed{reason:"shutdown"}``
    and close 1001, and wait for the clients' close frames in reply (:func:`close_handshakes`).

    ``handshakes()``: how many WebSocket connections have sent their close frame and still wait for
    the peer's; the wait for them ends when it is 0, when ``stop()`` turns true (a third signal), or
    ``state.settings.shutdown_grace_s`` seconds after the sessions began closing (that grace also
    bounds the closing itself).

    Returns the number of sessions that were still open when the wait ended (0: all finished).
    """
    state.draining = True
    state.shutting_down = True  # /health 503 shutting_down; the handshake and chat refuse (state.ready)
    open_now = state.slots.used
    if open_now and drain_s > 0:
        logger.info("draining: %d session slot(s) in use; waiting up to %g s for them to end "
                    "(send the signal again to close them now)", open_now, drain_s)
        deadline = time.monotonic() + drain_s
        while state.slots.used and time.monotonic() < deadline and not force():
            await asyncio.sleep(poll_s)
    # a session that gave its slot back has ended, even while its connection is still being torn down
    left = len(state.connections) if state.slots.used else 0
    if left:
        logger.info("drain over: closing %d open session(s) with session.closed{reason:\"shutdown\"}", left)
    deadline = time.monotonic() + state.settings.shutdown_grace_s
    await state.shutdown_sessions("shutdown")
    await close_handshakes(handshakes, deadline, stop=stop)
    return left


async def close_handshakes(pending: Callable[[], int], deadline: float, *, stop: Callable[[], bool] = lambda: False,
                           poll_s: float = 0.01) -> int:
    """Wait until ``pending()`` (connections whose close frame was sent and whose peer has not yet
    answered with its own) is 0, ``stop()`` turns true, or ``time.monotonic()`` reaches ``deadline``.

    uvicorn's shutdown closes the TCP connection of every WebSocket that sent its close frame at
    once; a client still sending (``input_audio_buffer.append`` in flight) then has its frames
    arrive at a closed socket, the server's kernel resets the connection, and a client that writes
    again before it has read the ``session.closed`` and close frame waiting for it loses them (it
    sees close 1006). Once the peer's close frame has come back, uvicorn closes the connection
    itself, with nothing left unread: a clean end. Returns how many were still pending (0: all).
    """
    left = pending()
    if left:
        logger.debug("waiting up to %.1f s for %d client(s) to answer the close frame",
                    max(0.0, deadline - time.monotonic()), left)
    while left and not stop() and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
        left = pending()
    if left:
        logger.info("%d client(s) did not answer the close frame %s; closing their connections", left,
                    "(stopped waiting)" if stop() else "in time")
    return left


def serve(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          sockets: Optional[list] = None) -> int:
    """Run ``app`` under uvicorn with duplexkit's transport limits, drain and graceful shutdown.

    ``ws_max_size`` is twice ``max_event_bytes`` (docs/protocol.md §1.3), pings every
    ``ping_interval_s`` without a pong deadline (a late pong on a busy loop must not drop a live
    session); a request head must be complete within ``header_timeout_s`` and at most
    ``max_header_bytes`` long (431 beyond: :func:`duplexkit_server.security.header_timeout_protocol`).

    SIGTERM starts a drain of ``settings.drain_s`` seconds (:func:`drain`): the listening socket stays
    open so ``/ready`` answers 503 ``draining`` and new sessions are refused, live sessions may finish,
    and the rest get ``session.closed{reason:"shutdown"}`` and close 1001. SIGINT, or a second
    SIGTERM/SIGINT during the drain, closes the sessions at once. Then uvicorn shuts down, the
    application's shutdown included (the engine closed, its process joined); a third signal stops
    waiting for open connections and skips that shutdown. The process then ends with the returned
    status (the signals are not re-raised).

    ``sockets``: already bound listening sockets (``duplexkit serve`` binds before loading, so a
    port in use fails at once); ``host``/``port`` then only name them in logs.

    Returns 0 after a clean stop, 1 when the engine failed to load (the server then stops itself).
    """
    import uvicorn

    state = app.state.duplexkit
    s = state.settings
    s.bind_host, s.bind_port = host, (port or None)
    from .security import abortable_websocket_protocol, header_timeout_protocol, is_loopback_host

    if not s.api_keys and not is_loopback_host(host):
        logger.warning("listening on %s without an API key: anyone who can reach this address can use the "
                       "model; pass --api-key (or set DUPLEXKIT_API_KEY), or bind 127.0.0.1", host)

    class _Server(uvicorn.Server):
        first_signal: Optional[int] = None
        signals_seen = 0

        def handle_exit(self, sig, frame):  # type: ignore[override]
            # Not uvicorn's own: it would take a second SIGINT as "exit now", skipping the
            # application's shutdown (the engine and its process are then never closed), and re-raise
            # the signals once stopped, so that the process died by the signal instead of ending
            # with its status. Here a second signal ends the drain (sessions closed at once, then the
            # same clean shutdown); a third stops waiting for connections and the application's
            # shutdown (what is still open is closed at interpreter exit).
            self.signals_seen += 1
            if self.first_signal is None:
                self.first_signal = sig
            if self.signals_seen >= 3:
                self.force_exit = True
            self.should_exit = True

        async def shutdown(self, sockets=None):  # type: ignore[override]
            drain_s = s.drain_s if self.first_signal == signal.SIGTERM else 0.0
            conns = self.server_state.connections
            try:
                await drain(state, drain_s, force=lambda: self.signals_seen > 1,
                            handshakes=lambda: sum(bool(getattr(c, "close_handshake_pending", False)) for c in conns),
                            stop=lambda: self.force_exit)
            except Exception:  # pragma: no cover
                logger.exception("graceful session shutdown failed")
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=header_timeout_protocol(s.header_timeout_s, s.max_header_bytes),
                            h11_max_incomplete_event_size=s.max_header_bytes,  # the same cap under h11
                            ws=abortable_websocket_protocol() or "auto",
                            ws_max_size=2 * s.max_event_bytes,
                            ws_ping_interval=s.ping_interval_s,
                            # no ping timeout: a loop slowed by engine threads reads pongs late and
                            # uvicorn would close live sessions with 1011 and no session.closed; dead
                            # peers end by TCP errors or the idle timeout (session.closed{timeout})
                            ws_ping_timeout=None,
                            timeout_graceful_shutdown=s.shutdown_grace_s + 5)

    server = _Server(config)

    def _stop_on_load_error(exc: BaseException) -> None:
        print(f"error: engine failed to load: {exc}", file=sys.stderr, flush=True)
        server.should_exit = True

    state.on_load_error = _stop_on_load_error
    import warnings

    # a stop between uvicorn making its serve() coroutine and running it leaves that coroutine
    # unstarted: nothing to clean up, so no "never awaited" warning for it (only for that coroutine)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="coroutine 'Server.serve' was never awaited", category=RuntimeWarning)
        try:
            server.run(sockets=sockets)
        except KeyboardInterrupt:  # SIGINT outside uvicorn's run (before it took the signals, or after)
            pass
    return 1 if state.load_error is not None else 0
