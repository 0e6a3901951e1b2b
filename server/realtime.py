"""The realtime WebSocket shell: one :class:`duplexkit.session.Session` per connection.

The shell only moves bytes (docs/architecture.md, "The sans-I/O Session"): frames in ->
``Session.receive_client_event``; engine outputs -> ``Session.receive_engine_output``; a clock ->
``Session.tick``; and ``Session.drain()`` out -> server events sent as JSON text frames, engine
commands forwarded with :func:`duplexkit.engine.api.apply_command` (``OpenStream`` opens the
stream on the shared engine), and a final ``CloseConnection`` closes the socket with its code.

Handshake checks (docs/protocol.md §1): authentication (``Authorization: Bearer`` or the
``openai-insecure-api-key.<key>`` subprotocol; failure -> ``error{unauthorized}`` (compat profile:
``invalid_api_key``) + 1008),
the ``model`` query parameter (refused -> ``error{model_not_found, param:"model"}`` listing the
served ids + 1008; OpenAI ids are mapped, see ``ServerState.resolve_model``), session
capacity (-> ``error{session_capacity_exhausted}`` + 1013).

Session resume (docs/protocol.md §1.6, :mod:`duplexkit_server.resume`): with ``state.resumes`` set,
the first frame of an ``autostart=0`` connection is read before the Session is made; a
``session.resume`` hands the socket to the parked session it names (no new slot is taken), anything
else starts a new session with that frame as its first event. A session whose socket drops
(:data:`PARK_CLOSE_CODES`) is parked, not closed, while its events go on into its replay journal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import deque
from typing import Any, Optional

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from duplexkit.engine.api import SILENCE_SLACK_MS
from duplexkit.errors import ErrorCode
from duplexkit.protocol import ErrorEvent
from duplexkit.protocol.vocabulary import CloseCode, CloseReason

from .dialect import dialect_of_first_update, pick_dialect, translate
from .resume import (JournalOverflow, ResumeRefused, _event_bytes, check_resume_fields, new_token, parse_resume,
                     principal_of, token_digest, token_matches)


logger = logging.getLogger("duplexkit.server.realtime")

__all__ = ["handle", "RealtimeConnection", "KEY_SUBPROTOCOL_PREFIX"]

KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
#: how a connection may end and still leave its session resumable (docs/protocol.md §1.6): no close
#: frame (1006, or a failed send: None), no status (1005), the peer or a proxy going away or
#: restarting (1001, 1011-1014). A normal close (1000) or a protocol violation (1002, 1003, 1007-1010)
#: ends the session at once.
PARK_CLOSE_CODES = frozenset({None, CloseCode.GOING_AWAY, 1005, 1006, CloseCode.INTERNAL_ERROR, 1012,
                              CloseCode.TRY_AGAIN_LATER, 1014})
_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no", ""}


def _handshake_error(code: ErrorCode, message: str, param: Optional[str] = None, *, naming: str = "duplexkit",
                     seq: Optional[int] = 1, client_event_id: Optional[str] = None) -> dict:
    """The ``error`` event of a refused handshake or resume (:meth:`ErrorEvent.of`): the code in the
    profile's ``naming``, its OpenAI type from the §9 table; ``seq`` None for a resume refusal (an
    event outside the session's sequence)."""
    return ErrorEvent.of(code, message, param or None, naming=naming, event_id="event_" + secrets.token_hex(12),
                         server_event_seq=seq, client_event_id=client_event_id).to_wire()


async def _reject(ws: WebSocket, subprotocol: Optional[str], event: dict, close_code: int) -> None:
    await ws.accept(subprotocol=subprotocol)
    try:
        await ws.send_text(json.dumps(event))
        await ws.close(code=close_code, reason=event["error"]["code"])
    except Exception:  # the peer may already be gone
        pass


WS_ENDPOINTS_HINT = ("the realtime endpoints are /v1/realtime (add ?duplex=1 for full duplex) "
                     "and /v1/duplex; phone media streams: /v1/telephony/twilio and /v1/telephony/telnyx")


async def reject_unknown_path(ws: WebSocket) -> None:
    """Refuse a WebSocket handshake to a path that has no endpoint with HTTP 404 and an OpenAI
    error body ``{error{message, type:"invalid_request_error", param:null, code:null}}`` naming the
    endpoints (docs/protocol.md §1.1). Sent as the handshake's answer through the ASGI
    ``websocket.http.response`` extension (uvicorn has it); without it, the connection closes
    with 1008 before the upgrade."""
    from fastapi.responses import JSONResponse

    path = (ws.scope.get("path") or "/")[:200]  # client-chosen: bounded in the answer and the log
    message = f"no WebSocket endpoint at {path}: {WS_ENDPOINTS_HINT}"
    logger.info("refused websocket %r: no such endpoint", path)
    if "websocket.http.response" in (ws.scope.get("extensions") or {}):
        await ws.send_denial_response(JSONResponse(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}},
            status_code=404))
    else:
        await ws.close(code=CloseCode.POLICY_VIOLATION, reason="no such endpoint")


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
    duplex_raw = (q.get("duplex") or "").strip().lower()
    if duplex_raw not in _TRUE | _FALSE:
        duplex_raw = ""
    duplex = force_duplex or duplex_raw in _TRUE
    # handshake refusals use the profile's naming of codes, as the session would (docs/protocol.md §9)
    naming = "duplexkit" if duplex else "openai"

    if not state.check_key(key):
        await _reject(ws, subprotocol, _handshake_error(ErrorCode.UNAUTHORIZED, "missing or invalid API key",
                                                        naming=naming), CloseCode.POLICY_VIOLATION)
        return
    autostart_raw = (q.get("autostart") or "1").strip().lower()
    autostart = autostart_raw not in {"0", "false", "off", "no"}

    reg = getattr(state, "resumes", None)
    principal = principal_of(key) if state.settings.api_keys else None
    # while draining (SIGTERM) no new session starts, but a parked session of this principal may
    # still be resumed (autostart=0 with session.resume as the first frame)
    resume_only = (not state.ready and getattr(state, "draining", False) and state.engine is not None
                   and reg is not None and not autostart and reg.has_parked(principal))
    if not state.ready and not resume_only:
        failure = getattr(state, "engine_failure", None)
        await _reject(ws, subprotocol, _handshake_error(
            ErrorCode.SESSION_CAPACITY_EXHAUSTED, f"the engine failed: {failure}" if failure
            else "the server is loading or shutting down; retry later", naming=naming), CloseCode.TRY_AGAIN_LATER)
        return
    try:
        dialect = pick_dialect(q.get("dialect"), ws.headers.get("openai-beta"))
    except ValueError as exc:
        await _reject(ws, subprotocol, _handshake_error(ErrorCode.BAD_EVENT, str(exc), "dialect", naming=naming),
                      CloseCode.POLICY_VIOLATION)
        return
    model = q.get("model")
    if not state.accepts_model(model):
        await _reject(ws, subprotocol, _handshake_error(ErrorCode.MODEL_NOT_FOUND, state.unknown_model_message(model),
                                                        "model", naming=naming), CloseCode.POLICY_VIOLATION)
        return
    from duplexkit.recording import session_record_choice

    recorded, refusal = session_record_choice(state.settings, q.get("record"))  # docs/server.md, "Recording"
    if refusal is not None:
        await _reject(ws, subprotocol, _handshake_error(ErrorCode.BAD_EVENT, refusal, "record", naming=naming),
                      CloseCode.POLICY_VIOLATION)
        return
    client = state.client_id(key, ws.scope)
    held = {"slot": False, "parked": False, "ending": False}

    def release_slot() -> None:
        """Give the slot back (idempotent): called as soon as the session ends, before its socket is
        closed, so a client that reconnects once its close returned finds the slot free."""
        if held["slot"]:
            held["slot"] = False
            if held["ending"]:
                held["ending"] = False
                state.slots.ending -= 1
            state.slots.release(None if held["parked"] else client)
            from .memory import schedule_trim

            schedule_trim()  # give the session's freed buffers back to the OS (RSS back to baseline)

    def slot_ending() -> None:
        """The peer closed for good: the slot is about to be given back (SlotPool.acquire waits for it)."""
        if held["slot"] and not held["ending"]:
            held["ending"] = True
            state.slots.ending += 1

    def slot_parked(parked: bool) -> None:
        """A parked session keeps its slot in the pool but leaves its client's share (a reloaded
        page must not lock its user out); a resumed one counts again (docs/server.md, "Limits")."""
        if held["slot"] and parked != held["parked"]:
            held["parked"] = parked
            (state.slots.leave_share if parked else state.slots.join_share)(client)

    # a resume re-uses the slot its parked session holds: over capacity, a connection that may be
    # a resume (autostart=0, this principal has a parked session) is let in to show its first frame
    maybe_resume = reg is not None and not autostart and reg.has_parked(principal)
    if not resume_only:
        held["slot"] = state.slots.try_acquire(client)
        if not held["slot"] and not maybe_resume:
            held["slot"] = await _take_slot(state, client)
    if not held["slot"] and not resume_only and not maybe_resume:
        await _reject(ws, subprotocol, _handshake_error(
            ErrorCode.SESSION_CAPACITY_EXHAUSTED, state.capacity_message(client), naming=naming),
            CloseCode.TRY_AGAIN_LATER)
        return
    try:
        first: Optional[dict] = None
        if reg is not None and not autostart:
            await ws.accept(subprotocol=subprotocol)
            first = await _first_message(ws, state.settings.idle_timeout_s)
            if first is None:
                return
            resume = parse_resume(first["text"]) if first.get("text") is not None else None
            if resume is not None:
                release_slot()
                await _serve_resume(state, ws, resume, principal)
                return
            if not held["slot"] and not resume_only:
                held["slot"] = await _take_slot(state, client)
            if not held["slot"]:
                msg = ("this replica is draining for shutdown: only session.resume is accepted" if resume_only
                       else state.capacity_message(client))
                await _refuse(ws, _handshake_error(ErrorCode.SESSION_CAPACITY_EXHAUSTED, msg, naming=naming),
                              CloseCode.TRY_AGAIN_LATER)
                return
        conn = RealtimeConnection(state, ws, profile="duplex" if duplex else "compat", autostart=autostart,
                                  dialect=dialect, principal=principal)
        conn.client = client
        conn.release_slot = release_slot
        conn.slot_parked = slot_parked
        conn.slot_ending = slot_ending
        if model and model not in state.model_ids:
            conn.requested_model = model  # an OpenAI id served by this model (ServerState.resolve_model)
        state.connections.add(conn)
        recording = None
        if recorded:
            from duplexkit.recording import attach_server_recording

            recording = attach_server_recording(state, conn.driver)
        try:
            if first is None:
                await ws.accept(subprotocol=subprotocol)
            await conn.run(first)
        finally:
            state.connections.discard(conn)
            state.session_closed(conn.session)
            if recording is not None:
                recording.close()
    finally:
        release_slot()


async def _take_slot(state, client) -> bool:
    """A slot for a new session of ``client`` when none was free at once: wait up to
    ``slot_wait_s`` for one being given back (a session that ended a moment ago)."""
    return await state.slots.acquire(client, getattr(state.settings, "slot_wait_s", 0.0))


async def _close_stuck(ws: WebSocket, reason: str) -> None:
    """Close a connection whose peer does not read: the close frame is queued if the transport
    takes it within 1 s; then the transport is aborted where the server exposes it
    (:func:`duplexkit_server.security.abortable_websocket_protocol`), so its buffers go at once."""
    try:
        await asyncio.wait_for(ws.close(code=CloseCode.POLICY_VIOLATION, reason=reason), 1.0)
    except Exception:
        pass
    abort = ((ws.scope.get("extensions") or {}).get("duplexkit.transport") or {}).get("abort")
    if abort is not None:
        asyncio.get_running_loop().call_later(1.0, abort)


async def _first_message(ws: WebSocket, timeout_s: float) -> Optional[dict]:
    """The first client message of an ``autostart=0`` connection (None: the peer left or stayed
    silent for ``timeout_s``, the idle timeout)."""
    try:
        msg = await asyncio.wait_for(ws.receive(), timeout_s)
    except (asyncio.TimeoutError, WebSocketDisconnect, RuntimeError):
        return None
    return None if msg.get("type") == "websocket.disconnect" else msg


async def _refuse(ws: WebSocket, event: dict, close_code: int, extra: Optional[dict] = None) -> None:
    """Send ``event`` (and ``extra``), then close ``close_code`` on an accepted socket."""
    try:
        await ws.send_text(json.dumps(event))
        if extra is not None:
            await ws.send_text(json.dumps(extra))
        await ws.close(code=close_code, reason=event["error"]["code"])
    except Exception:  # the peer may already be gone
        pass


async def _serve_resume(state, ws: WebSocket, data: dict, principal: Optional[str]) -> None:
    """A connection whose first frame is ``session.resume`` (docs/protocol.md §1.6): hand the
    socket to the parked session and hold it until that session lets it go."""
    reg = state.resumes
    sid = data.get("session_id") if isinstance(data.get("session_id"), str) else None
    try:
        sid, token, seq = check_resume_fields(data)
        conn = reg.find(sid, token, principal)
        released = await conn.request_resume(ws, seq, token)
    except ResumeRefused as r:
        reg.count_refusal(r.code)
        logger.info("session.resume of %s refused: %s", (sid or "?")[:64], r.code)
        err = _handshake_error(r.code, r.message, seq=None,
                               client_event_id=data["event_id"] if isinstance(data.get("event_id"), str) else None)
        closed = None
        if r.code in (ErrorCode.RESUME_EXPIRED, ErrorCode.RESUME_JOURNAL_OVERFLOW) and sid:
            reason = CloseReason.SERVER_ERROR if r.code == ErrorCode.RESUME_JOURNAL_OVERFLOW else CloseReason.TIMEOUT
            closed = {"type": "session.closed", "event_id": "event_" + secrets.token_hex(12), "session_id": sid,
                      "reason": reason.value}
        await _refuse(ws, err, r.close_code, closed)
        return
    await released.wait()


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
                                  silence_slack_ms=getattr(s, "silence_slack_ms", SILENCE_SLACK_MS), limits=limits,
                                  supports_session_resume=getattr(state, "resumes", None) is not None)
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
    :class:`duplexkit.driver.SessionDriver`; this class only reads frames and writes events.

    With session resume on (``state.resumes``, :mod:`duplexkit_server.resume`) every server event
    first goes into the session's replay journal; a dropped socket parks the session (``parked``)
    until a ``session.resume`` hands it a new socket, the window expires, or the journal overflows.
    """

    def __init__(self, state, ws: WebSocket, *, profile: str, autostart: bool,
                 dialect: Optional[str] = "ga", principal: Optional[str] = None) -> None:
        from duplexkit.driver import SessionDriver
        from duplexkit.session import Session

        self.state = state
        self.ws: Optional[WebSocket] = ws
        self.profile = profile
        self.autostart = autostart
        #: "ga", "beta", "both", or None until the first client event decides (server/dialect.py)
        self.dialect = dialect
        self.requested_model: Optional[str] = None
        self.session = Session(session_config(state, profile), now_ms=0)
        self.driver = SessionDriver(self.session, state.engine, on_event=self._send, on_close=self._close_socket,
                                    tick_interval_s=state.settings.tick_interval_s, decider=state.tool_decider)
        if getattr(state, "metrics", None) is not None:  # duplexkit_server.metrics (GET /metrics)
            self.driver.observer = state.metrics.session_observer()
        self._closed = asyncio.Event()
        self._close_override: Optional[int] = None
        # resume (None when off)
        self.registry = getattr(state, "resumes", None)
        self.principal = principal
        self.journal = self.registry.new_journal() if self.registry is not None else None
        self._token: Optional[str] = new_token() if self.registry is not None else None
        self._token_digest = token_digest(self._token) if self._token else ""
        self.parked = False
        self.resumes = 0
        self._send_lock = asyncio.Lock()
        # the outbox: events queued for the socket, bounded (docs/server.md, "Limits")
        self._outbox: "deque[tuple[dict, int]]" = deque()
        self._outbox_bytes = 0
        self._outbox_ready = asyncio.Event()
        self._outbox_empty = asyncio.Event()
        self._outbox_empty.set()
        self._writer_task: Optional[asyncio.Task] = None
        self._max_outbound_bytes = int(getattr(state.settings, "max_outbound_bytes", 8 * 2**20))
        self._stall_s = float(getattr(state.settings, "outbound_stall_s", 30.0))
        self._wake = asyncio.Event()
        self._lost = False  # the current socket is gone (read end or failed send)
        self._disconnect_code: Optional[int] = None
        self._sent_seq = 0  # the highest server_event_seq written to a socket
        #: client frames processed so far, over every connection (reported by session.resumed so
        #: that the client re-sends the frames the dropped connection lost)
        self.client_frames = 0
        self._overflowed = False
        self._park_deadline: Optional[float] = None
        self._takeover: Optional[tuple] = None  # (ws, last_seq, token, future)
        self._released: dict[int, asyncio.Event] = {}
        #: who holds the slot (``ServerState.client_id``) and how to give it back (set by :func:`handle`)
        self.client: Any = None
        self.release_slot: Any = lambda: None
        self.slot_parked: Any = lambda parked: None
        self.slot_ending: Any = lambda: None

    def now_ms(self) -> int:
        return self.driver.now_ms()

    @property
    def stream(self):
        return self.driver.stream

    def check_token(self, token: str) -> bool:
        """Whether ``token`` is the session's current resume token (constant time)."""
        return bool(self._token_digest) and token_matches(token, self._token_digest)

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self, first: Optional[dict] = None) -> None:
        """Serve the session until it closes. ``first``: an already received first message."""
        if self.autostart:
            self.driver.start_session()
        self.driver.start()
        if self.registry is not None:
            self.registry.add(self)
        loop = asyncio.get_running_loop()
        dispatched = loop.create_task(self.driver.dispatch_done.wait(), name="dispatch-done")
        reader: Optional[asyncio.Task] = None
        try:
            while not dispatched.done():
                if self.ws is None:  # parked
                    outcome = await self._park(dispatched)
                    if outcome == "closed":
                        break
                    if outcome != "takeover":
                        await self._end_parked(outcome, dispatched)
                        break
                    await self._attach()
                    continue
                self._wake.clear()
                if not (self._takeover or self._lost):
                    if reader is None:
                        reader = loop.create_task(self._read(self.ws, first), name="read")
                        first = None
                    waker = loop.create_task(self._wake.wait())
                    await asyncio.wait({reader, dispatched, waker}, return_when=asyncio.FIRST_COMPLETED)
                    waker.cancel()
                    if reader.done():
                        self._lost = True
                if dispatched.done():
                    break
                if not (self._takeover or self._lost):
                    continue
                if reader is not None:
                    reader.cancel()
                    await asyncio.gather(reader, return_exceptions=True)
                    reader = None
                if self._takeover is not None:  # a resume while this socket still looked alive
                    await self._detach(close_code=CloseCode.GOING_AWAY)
                    continue
                if not self._parkable():
                    break
                await self._detach()
        finally:
            self._closed.set()
            self.release_slot()  # the session is over: its slot is free before anything is closed
            if self._writer_task is not None:
                # the writer also stops on ``_closed`` by itself: on Python 3.11 a cancel that lands
                # while ``wait_for(send_text)`` completes is swallowed, and the writer would wait on
                # ``_outbox_ready`` forever (the session never ended: /health ``sessions_open`` stuck)
                self._outbox_ready.set()
                self._writer_task.cancel()
                await asyncio.wait({self._writer_task}, timeout=self._stall_s)
            for t in (reader, dispatched):
                if t is not None:
                    t.cancel()
            await asyncio.gather(*(t for t in (reader, dispatched) if t is not None), return_exceptions=True)
            await self.driver.aclose()
            if self.driver.observer is not None:
                self.driver.observer.close()
            ws = self.ws
            if ws is not None and ws.application_state != WebSocketState.DISCONNECTED:
                try:
                    await asyncio.wait_for(ws.close(code=CloseCode.NORMAL), self._stall_s)
                except Exception:
                    pass
            if self.registry is not None:
                self.registry.remove(self)
                if self._takeover is not None:
                    fut = self._takeover[3]
                    if not fut.done():
                        fut.set_exception(ResumeRefused(ErrorCode.RESUME_NOT_FOUND, "the session has ended"))
            for ev in self._released.values():
                ev.set()
            if self.journal is not None:  # the session is over: its replay journal goes now
                self.journal.clear()

    async def shutdown(self, reason: str = "shutdown") -> None:
        """Server shutdown: ``session.closed{reason}`` then close 1001 (docs/protocol.md §1.5)."""
        if self._closed.is_set():
            return
        self._close_override = CloseCode.GOING_AWAY
        self.driver.close_session(reason, CloseCode.GOING_AWAY)
        await self._closed.wait()

    # -- resume -----------------------------------------------------------------------------------
    def _parkable(self) -> bool:
        return (self.registry is not None and self.session.started and not self.session.closed
                and self._disconnect_code in PARK_CLOSE_CODES)

    async def _detach(self, close_code: Optional[int] = None) -> None:
        """Stop using the current socket (it dropped, or a resume replaces it): the session parks."""
        async with self._send_lock:
            ws, self.ws = self.ws, None
            self._clear_outbox()  # what it held is in the journal: a resume replays it by seq
            self.parked = True
            self.slot_parked(True)
            self._lost = False
        if ws is None:
            return
        if close_code is not None:
            try:
                await ws.close(code=close_code, reason="resumed on another connection")
            except Exception:
                pass
        rel = self._released.pop(id(ws), None)
        if rel is not None:
            rel.set()

    async def _park(self, dispatched: asyncio.Task) -> str:
        """Wait parked: ``takeover`` (a resume came), ``expired``, ``overflow`` or ``closed``."""
        loop = asyncio.get_running_loop()
        if self._park_deadline is None:
            self._park_deadline = loop.time() + self.registry.window_s
            logger.info("session %s parked for %.0f s (connection dropped, code %s)", self.session.session_id,
                        self.registry.window_s, self._disconnect_code)
        while True:
            self._wake.clear()
            if dispatched.done():
                return "closed"
            if self._takeover is not None:
                return "takeover"
            if self._overflowed:
                return "overflow"
            left = self._park_deadline - loop.time()
            if left <= 0:
                return "expired"
            waker = loop.create_task(self._wake.wait())
            await asyncio.wait({waker, dispatched}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            waker.cancel()

    async def _end_parked(self, outcome: str, dispatched: asyncio.Task) -> None:
        """Close a parked session that can no longer be resumed (its slot is freed first)."""
        self.release_slot()
        if outcome == "expired":
            code, reason, close = ErrorCode.RESUME_EXPIRED.value, CloseReason.TIMEOUT.value, CloseCode.NORMAL
            msg = f"the session was not resumed within {self.registry.window_s:g} s and was closed"
        else:
            code, reason, close = (ErrorCode.RESUME_JOURNAL_OVERFLOW.value, CloseReason.SERVER_ERROR.value,
                                   CloseCode.INTERNAL_ERROR)
            msg = (f"server events the client had not received were dropped from the resume journal "
                   f"({self.journal.max_events} events / {self.journal.max_bytes} bytes); the session was closed")
        logger.info("parked session %s closed: %s", self.session.session_id, code)
        self.registry.bury(self, code, msg)
        self.driver.close_session(reason, close)
        await asyncio.wait({dispatched}, timeout=10)

    async def request_resume(self, ws: WebSocket, last_seq: int, token: str) -> asyncio.Event:
        """Hand ``ws`` to this session (a checked ``session.resume``). Returns an event set when
        the session stops using ``ws``. Raises :class:`~duplexkit_server.resume.ResumeRefused`."""
        if self._closed.is_set():
            raise ResumeRefused(ErrorCode.RESUME_NOT_FOUND, "the session has ended")
        fut = asyncio.get_running_loop().create_future()
        if self._takeover is not None and not self._takeover[3].done():
            self._takeover[3].set_exception(ResumeRefused(ErrorCode.RESUME_UNAUTHORIZED, "superseded by another resume"))
        self._takeover = (ws, last_seq, token, fut)
        self._wake.set()
        return await fut

    async def _attach(self) -> None:
        """Take the pending resume: ``session.resumed``, the replay, then live events."""
        ws, last_seq, token, fut = self._takeover
        self._takeover = None
        if fut.done():  # the resuming connection went away meanwhile
            return
        overflow = False
        async with self._send_lock:
            if not self.check_token(token):
                fut.set_exception(ResumeRefused(ErrorCode.RESUME_UNAUTHORIZED,
                                                "the resume token was rotated by another resume"))
                return
            if last_seq > self.journal.last_seq:
                fut.set_exception(ResumeRefused(ErrorCode.BAD_EVENT, f"last_server_event_seq {last_seq} is beyond the last "
                                                             f"event of the session ({self.journal.last_seq})"))
                return
            try:
                replay = self.journal.since(last_seq)
            except JournalOverflow as exc:
                overflow, replay = True, []
                first_frame = _handshake_error(ErrorCode.RESUME_JOURNAL_OVERFLOW, str(exc), seq=None)
            else:
                self._token = new_token()
                self._token_digest = token_digest(self._token)
                first_frame = {"type": "session.resumed", "event_id": "event_" + secrets.token_hex(12),
                               "session_id": self.session.session_id, "last_server_event_seq": last_seq,
                               "replayed": len(replay), "client_frames_received": self.client_frames,
                               "resume_token": self._token}
            self.ws, self.parked, self._lost, self._park_deadline = ws, False, False, None
            self.slot_parked(False)
            self._disconnect_code = None
            rel = self._released[id(ws)] = asyncio.Event()
            fut.set_result(rel)
            try:
                await asyncio.wait_for(ws.send_text(json.dumps(first_frame)), self._stall_s)
            except (WebSocketDisconnect, RuntimeError, ConnectionError, asyncio.TimeoutError):
                self._socket_lost()
                return
            for ev in replay:
                if not await self._write(ev):
                    break
            if not overflow:
                self.resumes += 1
                self.registry.resumes += 1
                logger.info("session %s resumed after seq %d (%d events replayed)", self.session.session_id,
                            last_seq, len(replay))
        if overflow:
            self.registry.count_refusal(ErrorCode.RESUME_JOURNAL_OVERFLOW.value)
            self.driver.close_session(CloseReason.SERVER_ERROR.value, CloseCode.INTERNAL_ERROR)

    # -- the socket side ------------------------------------------------------------------------
    async def _send(self, event: dict) -> None:
        """The driver's ``on_event``: journal the event and queue it for the socket (never waits for
        the peer: a peer that does not read fills this connection's bounded outbox, not the driver)."""
        async with self._send_lock:
            if self.journal is not None:
                self.journal.append(event)
                if self.ws is None and self.journal.dropped_through > self._sent_seq and not self._overflowed:
                    self._overflowed = True  # an event the client never got is gone: no resume can be whole
                    self._wake.set()
            if self.ws is not None and not self._lost:
                size = _event_bytes(event)
                self._outbox.append((event, size))
                self._outbox_bytes += size
                if self._outbox_bytes > self._max_outbound_bytes:
                    self._peer_stuck(f"{self._outbox_bytes} bytes of server events queued "
                                     f"(--max-outbound-bytes {self._max_outbound_bytes})")
                    return
                self._outbox_ready.set()
                if self._writer_task is None or self._writer_task.done():
                    self._writer_task = asyncio.get_running_loop().create_task(self._writer(), name="write")

    async def _writer(self) -> None:
        """Write queued events to the socket, in order (a failure of its own drops the connection)."""
        try:
            await self._write_loop()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("session %s: writing events failed", self.session.session_id)
            self._clear_outbox()
            self._socket_lost()

    async def _write_loop(self) -> None:
        while not self._closed.is_set():
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            if self._closed.is_set():
                break
            while self._outbox:
                if self.ws is None or self._lost:
                    self._clear_outbox()
                    break
                event, size = self._outbox[0]
                ok = await self._write(event)
                if self._outbox and self._outbox[0][0] is event:
                    self._outbox.popleft()
                    self._outbox_bytes -= size
                if not ok:
                    self._clear_outbox()
                    break
            if not self._outbox:
                self._outbox_empty.set()

    def _clear_outbox(self) -> None:
        self._outbox.clear()
        self._outbox_bytes = 0
        self._outbox_empty.set()

    async def _write(self, event: dict) -> bool:
        """Write one event's frames to the current socket; False when the socket failed or the peer
        took nothing for ``outbound_stall_s`` (the connection is then dropped: :meth:`_peer_stuck`)."""
        ws = self.ws
        try:
            for frame in translate(event, self.dialect or "ga", beta_model=self.requested_model):
                if self._token is not None and frame.get("type") == "session.created":
                    frame = {**frame, "resume_token": self._token}
                await asyncio.wait_for(ws.send_text(json.dumps(frame, separators=(",", ":"))), self._stall_s)
        except asyncio.TimeoutError:
            if self.ws is ws:
                self._peer_stuck(f"the peer took no data for {self._stall_s:g} s (--outbound-stall-s)")
            return False
        except (WebSocketDisconnect, RuntimeError, ConnectionError):
            self._socket_lost()
            return False
        seq = event.get("server_event_seq")
        if isinstance(seq, int) and seq > self._sent_seq:
            self._sent_seq = seq
            if self.journal is not None:
                self.journal.mark_sent(seq)
        return True

    def _peer_stuck(self, why: str) -> None:
        """The peer does not read: drop this connection (close 1008 ``peer not reading``, best effort:
        a peer that reads nothing may never see it). The session parks like any dropped connection
        when resume is on (a client that was only stalled may resume it), else it ends."""
        ws = self.ws
        if ws is None or self._lost:
            return
        logger.warning("session %s: closing its connection, the peer is not reading: %s",
                       self.session.session_id, why)
        self._disconnect_code = None  # as a connection that dropped without a close frame
        self._clear_outbox()
        self._socket_lost()
        asyncio.get_running_loop().create_task(_close_stuck(ws, "peer not reading"))

    def _socket_lost(self) -> None:
        self._lost = True
        self._wake.set()

    async def _close_socket(self, item) -> None:
        self.release_slot()  # before the close frame: a client whose close returned finds the slot free
        ws = self.ws
        if ws is None:
            return
        if self._outbox and not self._lost:  # every event before the close goes out first (bounded wait)
            self._outbox_empty.clear()
            try:
                await asyncio.wait_for(self._outbox_empty.wait(), self._stall_s)
            except asyncio.TimeoutError:
                pass
        try:
            await asyncio.wait_for(ws.close(code=self._close_override or item.code, reason=item.reason or ""),
                                   self._stall_s)
        except Exception:
            pass

    async def _read(self, ws: WebSocket, first: Optional[dict] = None) -> None:
        try:
            msg = first
            while True:
                if msg is None:
                    msg = await ws.receive()
                if msg.get("type") == "websocket.disconnect":
                    self._disconnect_code = msg.get("code")
                    self._peer_gone()
                    break
                self.client_frames += 1
                text = msg.get("text")
                if text is not None:
                    if self.journal is not None and '"session.event_ack"' in text:
                        self._ack(text)
                    if self.dialect is None:
                        self.dialect = dialect_of_first_update(text)
                    self.driver.client_event(text)
                elif msg.get("bytes") is not None:
                    # docs/protocol.md §1.3: binary frames get bad_event and are ignored
                    self.session.receive_binary_frame(self.now_ms())
                    self.driver.flush()
                msg = None
        except WebSocketDisconnect as exc:
            self._disconnect_code = exc.code
            self._peer_gone()
        except RuntimeError:
            pass

    def _ack(self, text: str) -> None:
        """``session.event_ack{server_event_seq}``: the client has every event through that number,
        so the journal drops them (the Session itself answers nothing)."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            return
        if isinstance(data, dict) and data.get("type") == "session.event_ack":
            self.journal.ack(data.get("server_event_seq"))

    def _peer_gone(self) -> None:
        """The peer's socket ended: unless the session will park, its slot is about to be freed."""
        if not self._parkable():
            self.slot_ending()
