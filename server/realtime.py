"""The realtime WebSocket shell: one :class:`duplexkit.session.Session` per connection.

The shell only moves bytes (docs/architecture.md, "The sans-I/O Session"): frames in ->
``Session.receive_client_event``; engine outputs -> ``Session.receive_engine_output``; a clock ->
``Session.tick``; and ``Session.drain()`` out -> server events sent as JSON text frames, engine
commands forwarded with :func:`duplexkit.engine.api.apply_command` (``OpenStream`` opens the
stream on the shared engine), and a final ``CloseConnection`` closes the socket with its code.

Handshake checks (docs/protocol.md §1): authentication (``Authorization: Bearer`` or the
``openai-insecure-api-key.<key>`` subprotocol; failure -> ``error{unauthorized}`` + 1008),
the ``model`` query parameter (refused -> ``error{model_not_found, param:"model"}`` listing the
served ids + 1008; OpenAI ids are mapped, see ``ServerState.resolve_model``), session
capacity (-> ``error{session_capacity_exhausted}`` + 1013).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any, Optional

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from .dialect import dialect_of_first_update, pick_dialect, translate


logger = logging.getLogger("duplexkit.server.realtime")

__all__ = ["handle", "RealtimeConnection", "KEY_SUBPROTOCOL_PREFIX"]

KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no", ""}


def _handshake_error(code: str, message: str, param: Optional[str] = None) -> dict:
    err: dict[str, Any] = {"type": "invalid_request_error" if code != "session_capacity_exhausted"
                           else "rate_limit_error", "code": code, "message": message}
    if param:
        err["param"] = param
    return {"type": "error", "event_id": "event_" + secrets.token_hex(12), "server_event_seq": 1, "error": err}


async def _reject(ws: WebSocket, subprotocol: Optional[str], event: dict, close_code: int) -> None:
    await ws.accept(subprotocol=subprotocol)
    try:
        await ws.send_text(json.dumps(event))
        await ws.close(code=close_code, reason=event["error"]["code"])
    except Exception:  # the peer may already be gone
        pass


def _pick_subprotocol(offered: list[str]) -> Optional[str]:
    if not offered:
        return None
    if "realtime" in offered:
        return "realtime"
    for p in offered:
        if not p.startswith(KEY_SUBPROTOCOL_PREFIX):
            return p
    return None  # never echo a key back (it would land in proxy logs and the browser's devtools)


async def handle(state, ws: WebSocket, *, force_duplex: bool) -> None:
    """ASGI WebSocket entry point for ``/v1/realtime`` (``force_duplex=False``) and ``/v1/duplex``."""
    q = ws.query_params
    offered = list(ws.scope.get("subprotocols") or [])
    subprotocol = _pick_subprotocol(offered)

    key = state.bearer(ws.headers.get("authorization"))
    if key is None:
        for p in offered:
            if p.startswith(KEY_SUBPROTOCOL_PREFIX):
                key = p[len(KEY_SUBPROTOCOL_PREFIX):]
                break
    if not state.check_key(key):
        await _reject(ws, subprotocol, _handshake_error("unauthorized", "missing or invalid API key"), 1008)
        return

    duplex_raw = (q.get("duplex") or "").strip().lower()
    if duplex_raw not in _TRUE | _FALSE:
        duplex_raw = ""
    duplex = force_duplex or duplex_raw in _TRUE
    autostart_raw = (q.get("autostart") or "1").strip().lower()
    autostart = autostart_raw not in {"0", "false", "off", "no"}

    if not state.ready:
        await _reject(ws, subprotocol, _handshake_error(
            "session_capacity_exhausted", "the server is loading or shutting down; retry later"), 1013)
        return
    try:
        dialect = pick_dialect(q.get("dialect"), ws.headers.get("openai-beta"))
    except ValueError as exc:
        await _reject(ws, subprotocol, _handshake_error("bad_event", str(exc), "dialect"), 1008)
        return
    model = q.get("model")
    if not state.accepts_model(model):
        await _reject(ws, subprotocol, _handshake_error("model_not_found", state.unknown_model_message(model), "model"),
                      1008)
        return
    client = state.client_id(key, ws.scope)
    if not state.slots.try_acquire(client):
        await _reject(ws, subprotocol, _handshake_error(
            "session_capacity_exhausted", state.capacity_message(client)), 1013)
        return
    try:
        conn = RealtimeConnection(state, ws, profile="duplex" if duplex else "compat", autostart=autostart,
                                  dialect=dialect)
        if model and model not in state.model_ids:
            conn.requested_model = model  # an OpenAI id served by this model (ServerState.resolve_model)
        state.connections.add(conn)
        try:
            await ws.accept(subprotocol=subprotocol)
            await conn.run()
        finally:
            state.connections.discard(conn)
            state.session_closed(conn.session)
    finally:
        state.slots.release(client)
        from .memory import schedule_trim

        schedule_trim()  # give the session's freed buffers back to the OS (RSS back to baseline)


def session_config(state, profile: str):
    """The per-connection :class:`duplexkit.session.SessionConfig` built from server settings."""
    from duplexkit.session import SessionConfig, SessionLimits

    s = state.settings
    limits = SessionLimits(max_event_bytes=s.max_event_bytes, max_pending_input_s=s.max_pending_input_s,
                           idle_timeout_s=s.idle_timeout_s, max_ref_audio_s=s.max_ref_audio_s,
                           input_default_rate=s.default_input_rate)
    kwargs: dict[str, Any] = dict(profile=profile, model_id=state.model_id,
                                  default_instructions=s.default_instructions,
                                  answer_policy=s.answer_policy,
                                  ref_audio_loader=state.load_ref_audio_path if s.ref_audio_dir else None,
                                  audio_output_available=bool(getattr(state.engine, "supports_audio", True)),
                                  silence_slack_ms=getattr(s, "silence_slack_ms", 250), limits=limits)
    if s.max_output_tokens is not None:
        kwargs["max_output_tokens"] = s.max_output_tokens
    voices = getattr(state, "voices", None)
    if voices:
        kwargs["voices"] = voices
    default_voice = getattr(state, "default_voice", None)
    if default_voice is not None:
        kwargs["default_voice"] = default_voice
    return SessionConfig(**kwargs)


class RealtimeConnection:
    """Drives one Session over one WebSocket (see the module docstring) with a
    :class:`duplexkit.driver.SessionDriver`; this class only reads frames and writes events."""

    def __init__(self, state, ws: WebSocket, *, profile: str, autostart: bool,
                 dialect: Optional[str] = "ga") -> None:
        from duplexkit.driver import SessionDriver
        from duplexkit.session import Session

        self.state = state
        self.ws = ws
        self.profile = profile
        self.autostart = autostart
        #: "ga", "beta", "both", or None until the first client event decides (server/dialect.py)
        self.dialect = dialect
        self.requested_model: Optional[str] = None
        self.session = Session(session_config(state, profile), now_ms=0)
        self.driver = SessionDriver(self.session, state.engine, on_event=self._send, on_close=self._close_socket,
                                    tick_interval_s=state.settings.tick_interval_s)
        if getattr(state, "metrics", None) is not None:  # duplexkit_server.metrics (GET /metrics)
            self.driver.observer = state.metrics.session_observer()
        self._closed = asyncio.Event()
        self._ended = asyncio.Event()
        self._close_override: Optional[int] = None

    def now_ms(self) -> int:
        return self.driver.now_ms()

    @property
    def stream(self):
        return self.driver.stream

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        if self.autostart:
            self.driver.start_session()
        self.driver.start()
        loop = asyncio.get_running_loop()
        # the connection ends when the peer goes (reader), the Session closes it (dispatch), or a
        # send fails (_send)
        reader = loop.create_task(self._read(), name="read")
        dispatched = loop.create_task(self.driver.dispatch_done.wait(), name="dispatch-done")
        for t in (reader, dispatched):
            t.add_done_callback(lambda _t: self._ended.set())
        try:
            await self._ended.wait()
        finally:
            self._closed.set()
            reader.cancel()
            dispatched.cancel()
            await asyncio.gather(reader, dispatched, return_exceptions=True)
            await self.driver.aclose()
            if self.driver.observer is not None:
                self.driver.observer.close()
            if self.ws.application_state != WebSocketState.DISCONNECTED:
                try:
                    await self.ws.close(code=1000)
                except Exception:
                    pass

    async def shutdown(self, reason: str = "shutdown") -> None:
        """Server shutdown: ``session.closed{reason}`` then close 1001 (docs/protocol.md §1.5)."""
        if self._closed.is_set():
            return
        self._close_override = 1001
        self.driver.close_session(reason, 1001)
        await self._closed.wait()

    # -- the socket side ------------------------------------------------------------------------
    async def _send(self, event: dict) -> None:
        try:
            for frame in translate(event, self.dialect or "ga", beta_model=self.requested_model):
                await self.ws.send_text(json.dumps(frame, separators=(",", ":")))
        except (WebSocketDisconnect, RuntimeError, ConnectionError):
            self._ended.set()

    async def _close_socket(self, item) -> None:
        try:
            await self.ws.close(code=self._close_override or item.code, reason=item.reason or "")
        except Exception:
            pass

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.ws.receive()
                if msg.get("type") == "websocket.disconnect":
                    break
                text = msg.get("text")
                if text is not None:
                    if self.dialect is None:
                        self.dialect = dialect_of_first_update(text)
                    self.driver.client_event(text)
                elif msg.get("bytes") is not None:
                    # docs/protocol.md §1.3: binary frames get bad_event and are ignored
                    self.session.receive_binary_frame(self.now_ms())
                    self.driver.flush()
        except (WebSocketDisconnect, RuntimeError):
            pass
