"""``DuplexClient``: the remote client over a Realtime WebSocket (docs/protocol.md §1, §11).

It speaks to the bundled server and to any server following docs/protocol.md, vLLM-Omni's included:
it connects with ``autostart=0`` and sends the full session first, maps beta event names to GA
(:func:`duplexkit.protocol.parse_server_event`), sends ``session.heartbeat`` periodically, and when
the server advertises ``capabilities.supports_session_resume`` it reconnects after a dropped
connection and sends ``session.resume{session_id, resume_token, last_server_event_seq}``
(docs/protocol.md §1.6): events it already saw are dropped on replay, frames the dead connection
lost are sent again, and ``events()`` shows ``client.reconnecting`` then ``session.resumed``. Every
resume decision (whether to reconnect, when, what to send, what the answer means, which frames to send
again) is the sans-I/O core's (:class:`~duplexkit.clients.state.ClientState`); this shell does the I/O.
:meth:`DuplexClient.continuation` seeds a new session elsewhere when the server is gone.
It never hangs: transport loss fails every waiting call and iterator with
:class:`~duplexkit.clients.base.DuplexConnectionError`, and every call has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from duplexkit.errors import ErrorCode

from .actions import Reconnect, ResumeAccepted
from .base import BaseDuplexClient, DuplexConnectionError, wait_done
from .continuation import ContinuationSeed, ConversationLog
from .handles import ref_audio_data_url
from .state import OUTBOX_FRAMES  # noqa: F401  (re-exported: its home was this module)

logger = logging.getLogger("duplexkit.clients.remote")

__all__ = ["DuplexClient", "build_url"]


def build_url(url: str, *, profile: str = "duplex", model: Optional[str] = None, autostart: bool = False) -> str:
    """Normalise a server URL into the realtime WebSocket URL.

    ``http(s)://`` becomes ``ws(s)://``; a bare host gets ``/v1/realtime``; the duplex profile adds
    ``duplex=1`` unless the URL already says otherwise (or uses ``/v1/duplex``); ``autostart=0``,
    ``dialect=ga`` (GA event names only, whatever spellings the session uses; docs/server.md,
    "Interop") and ``model`` are added unless present.
    """
    parts = urlsplit(url if "://" in url else "ws://" + url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path or ""
    if path in ("", "/"):
        path = "/v1/realtime"
    q = dict(parse_qsl(parts.query, keep_blank_values=True))
    if profile == "duplex" and "duplex" not in q and not path.endswith("/duplex"):
        q["duplex"] = "1"
    if not autostart:
        q.setdefault("autostart", "0")
    q.setdefault("dialect", "ga")
    if model:
        q.setdefault("model", model)
    return urlunsplit((scheme, parts.netloc, path, urlencode(q), ""))


_REFUSAL_CODES = {401: ErrorCode.UNAUTHORIZED.value, 503: ErrorCode.SESSION_CAPACITY_EXHAUSTED.value}
"""Handshake HTTP statuses with their own code; any other status (403, 404, ...) is
``connection_failed`` and its message says what the status means."""

_ENDPOINTS = "/v1/realtime (add ?duplex=1 for full duplex) or /v1/duplex"


def _refusal_message(url: str, status: int, body: Optional[bytes]) -> str:
    """The message of a handshake refused with HTTP ``status``: for 404 the URL (without its query)
    and the realtime endpoints; otherwise the server's own explanation (the ``error.message`` of an
    OpenAI error body) when it sent one, else what the status usually means.

    A bare 403 is what Starlette-based servers answer for a WebSocket to an unknown path, and also
    what a proxy may answer for a bad key, so it names both; a 404 names the realtime endpoints.
    """
    said = None
    try:
        err = json.loads(body or b"").get("error")
        said = str(err["message"]) if isinstance(err, dict) and err.get("message") else None
    except (ValueError, AttributeError, TypeError):
        pass
    if status == 404:  # the URL without the query the client added: its path is what is wrong
        u = urlsplit(url)
        return f"no WebSocket endpoint at {urlunsplit((u.scheme, u.netloc, u.path, '', ''))} (HTTP 404): " \
               f"the realtime endpoints are {_ENDPOINTS}"
    head = f"handshake rejected with HTTP {status}"
    if said:
        return f"{head}: {said}"
    if status == 403:
        return (f"{head} by {url}: a wrong path or API key (the realtime endpoints are {_ENDPOINTS}; "
                "pass the key with --api-key or DUPLEXKIT_API_KEY)")
    return head


class DuplexClient(BaseDuplexClient):
    """A remote duplex client (websockets).

    Args:
        url: ``ws://host:port/v1/realtime`` (or ``http://host:port``, or ``/v1/duplex``).
        api_key: sent as ``Authorization: Bearer <key>``.
        profile: ``"duplex"`` (default) or ``"compat"``.
        model: the ``model`` query parameter.
        heartbeat_s: ``session.heartbeat`` period in seconds (None: off).
        resume: reconnect + ``session.resume`` when the server advertises it.
        resume_attempts: reconnect attempts before giving up.
        open_timeout_s: WebSocket handshake timeout.
        continuation: a :class:`~duplexkit.clients.continuation.ContinuationSeed` (from
            :meth:`continuation` of a client whose server died) to seed this new session with:
            instructions, voice and reference voice in the first ``session.update`` (the
            ``session``/``ref_audio`` options win), then the played transcript as an item. Lossy:
            see docs/clients.md, "Continuing elsewhere".
        record: a directory (or a :class:`duplexkit.recording.Recorder`) to record what this client
            sends and receives into, ``DIR/<session_id>/`` (docs/debugging.md); None (default): off.
            (A server-side recording is the server's ``--record``; ``?record=0|1`` in ``url`` asks
            the server to skip or make one, docs/server.md.)
        **options: the options of :class:`~duplexkit.clients.base.BaseDuplexClient`.
    """

    def __init__(self, url: str, api_key: Optional[str] = None, *, profile: str = "duplex",
                 model: Optional[str] = None, heartbeat_s: Optional[float] = 15.0, resume: bool = True,
                 resume_attempts: int = 5, open_timeout_s: float = 10.0, max_frame_bytes: int = 64 * 2**20,
                 continuation: Optional[ContinuationSeed] = None, record: Any = None, **options: Any) -> None:
        super().__init__(**options)
        self.record = record
        self.recording = None  # duplexkit.recording.SessionRecording while recording
        self._seed = continuation
        self._log = ConversationLog()
        self._ref_audio_url: Optional[str] = None
        self.url = build_url(url, profile=profile, model=model)
        self.api_key = api_key
        self.heartbeat_s = heartbeat_s
        self.state.resume_enabled = resume
        self.state.resume_attempts = resume_attempts
        self.open_timeout_s = open_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._ws = None
        self._reader: Optional[asyncio.Task] = None
        self._heartbeat: Optional[asyncio.Task] = None
        self._reconnected = asyncio.Event()  # cleared while the read loop carries out a drop
        self._reconnected.set()
        self.frames_resent = 0

    # -- the resume state lives in the sans-I/O core (ClientState, docs/protocol.md §1.6) --------
    @property
    def resume_enabled(self) -> bool:
        return self.state.resume_enabled

    @resume_enabled.setter
    def resume_enabled(self, value: bool) -> None:
        self.state.resume_enabled = bool(value)

    @property
    def resume_attempts(self) -> int:
        return self.state.resume_attempts

    @resume_attempts.setter
    def resume_attempts(self, value: int) -> None:
        self.state.resume_attempts = int(value)

    @property
    def resume_token(self) -> Optional[str]:
        """The current resume token (from ``session.created``, rotated by each ``session.resumed``)."""
        return self.state.resume_token

    @property
    def resume_failures(self) -> int:
        """Resumes the server refused."""
        return self.state.resume_failures

    @property
    def frames_sent(self) -> int:
        """Client frames written to the server on this session (all connections)."""
        return self.state.frames_sent

    _frames_sent = frames_sent

    @property
    def resumes(self) -> int:
        """Successful resumes of this session (``session.resumed`` received)."""
        return self.state.resumes

    @property
    def connection_state(self) -> str:
        """``"connecting"``, ``"open"``, ``"reconnecting"`` (resuming after a drop) or ``"closed"``."""
        if self.closed or self._failure is not None:
            return "closed"
        if self.state.reconnecting or not self._reconnected.is_set():
            return "reconnecting"
        return "open" if self.state.opened else "connecting"

    # -- continuation (docs/clients.md, "Continuing elsewhere") ---------------------------------
    def continuation(self) -> ContinuationSeed:
        """A seed for a new session elsewhere (e.g. after this server died): instructions, voice,
        the reference voice this client sent, and the transcript as the user heard it (assistant
        text cut at ``played_ms``). Works after the connection is lost or closed. Lossy: the new
        model sees text history only (no audio, no KV)."""
        s = self.session
        return ContinuationSeed(source_session_id=self.session_id, instructions=s.get("instructions"),
                                voice=s.get("voice"), ref_audio=self._ref_audio_url,
                                output_modalities=s.get("output_modalities"),
                                turns=self._log.turns(self.state.responses))

    def _initial_update(self) -> dict:
        seed = self._seed.session_update() if self._seed is not None else {}
        if self.options.ref_audio is not None or "ref_audio" in (self.options.session or {}):
            seed.pop("ref_audio", None)
        upd = {**seed, **super()._initial_update()}
        if isinstance(upd.get("ref_audio"), str):
            self._ref_audio_url = upd["ref_audio"]
        return upd

    async def connect(self) -> dict:
        """:meth:`BaseDuplexClient.connect`; with ``continuation``, the seed's items are created
        right after ``session.created`` (each awaited; a refusal raises and closes)."""
        opened = self.state.opened
        session = await super().connect()
        if self._seed is not None and not opened:
            try:
                for item in self._seed.items():
                    await self._request({"type": "conversation.item.create", "item": item},
                                        "conversation.item.added")
            except BaseException:
                await asyncio.shield(self._abort_connect())
                raise
        return session

    async def update(self, **session_fields) -> dict:
        if session_fields.get("ref_audio") is not None:
            session_fields["ref_audio"] = ref_audio_data_url(session_fields["ref_audio"])
            self._ref_audio_url = session_fields["ref_audio"]
        return await super().update(**session_fields)

    @property
    def supports_resume(self) -> bool:
        """The server advertises ``capabilities.supports_session_resume``."""
        return self.state.supports_resume

    # -- transport ----------------------------------------------------------------------------
    async def _connect_ws(self):
        import websockets
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            return await connect(self.url, additional_headers=headers, max_size=self.max_frame_bytes,
                                 open_timeout=self.open_timeout_s, ping_interval=20, ping_timeout=20,
                                 compression=None)
        except websockets.exceptions.InvalidStatus as exc:
            status = exc.response.status_code
            raise DuplexConnectionError(_refusal_message(self.url, status, exc.response.body),
                                        code=_REFUSAL_CODES.get(status, "connection_failed")) from exc
        except (OSError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as exc:
            raise DuplexConnectionError(f"cannot connect to {self.url}: {exc}", code="connection_failed") from exc

    async def _open(self) -> None:
        if self.record is not None and self.recording is None:
            from duplexkit.recording import recorder_for

            t0 = time.monotonic()
            self.recording = recorder_for(self.record).open_session(
                lambda: int((time.monotonic() - t0) * 1000), side="client")
        self._ws = await self._connect_ws()
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_loop(), name="duplex-reader")
        if self.heartbeat_s:
            self._heartbeat = loop.create_task(self._heartbeat_loop(), name="duplex-heartbeat")

    async def _transmit(self, event: dict) -> None:
        import websockets

        if not self._reconnected.is_set():
            if not await wait_done(self._reconnected.wait(), self.options.request_timeout_s):
                raise DuplexConnectionError("reconnect did not finish in time", code="connection_lost")
        if self._failure is not None:
            raise self._failure
        ws = self._ws
        text = json.dumps(event, separators=(",", ":"))
        try:
            await ws.send(text)
            self._sent(text)
        except websockets.exceptions.ConnectionClosed as exc:
            if self._failure is not None:
                raise self._failure from exc
            if self.state.resumable and not self._released:
                # wait for the read loop to notice the drop and resume on a new connection
                loop = asyncio.get_running_loop()
                deadline = loop.time() + self.options.request_timeout_s
                while (self._ws is ws or not self._reconnected.is_set()) and self._failure is None \
                        and not self.closed and loop.time() < deadline:
                    await asyncio.sleep(0.02)
                if self._failure is not None:
                    raise self._failure from exc
                if self._ws is ws:
                    raise DuplexConnectionError("reconnect did not finish in time", code="connection_lost") from exc
                await self._ws.send(text)
                self._sent(text)
                return
            raise DuplexConnectionError(f"connection closed: {exc}", code="connection_lost",
                                        close_code=getattr(exc.rcvd, "code", None)) from exc

    def _sent(self, text: str) -> None:
        if self.recording is not None:
            from duplexkit.audio import InputFormat

            self.recording.client_event(text, self.state.input_format or InputFormat("pcm16", self.options.input_rate))
        self.state.frame_sent(text)

    async def _shutdown(self) -> None:
        for t in (self._heartbeat,):
            if t is not None:
                t.cancel()
        if self._ws is not None:
            try:
                await asyncio.wait_for(self._ws.close(), 5)
            except Exception:
                pass
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._heartbeat is not None:
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        if self.recording is not None:
            self.recording.close()

    # -- loops --------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        import websockets

        while True:
            ws = self._ws
            try:
                async for msg in ws:
                    if isinstance(msg, (bytes, bytearray)):
                        continue  # the protocol has no binary server frames
                    try:
                        data = json.loads(msg)
                    except ValueError:
                        logger.warning("dropping a non-JSON server frame")
                        continue
                    if not isinstance(data, dict):
                        continue
                    if self.recording is not None:
                        self.recording.server_event(msg)
                    self._on_frame(data)
                exc: Optional[BaseException] = None
            except websockets.exceptions.ConnectionClosed as e:
                exc = e
            except asyncio.CancelledError:
                raise
            except Exception as e:  # pragma: no cover - defensive
                exc = e
            self.close_code = getattr(ws, "close_code", None) or self.close_code
            if self._released:
                self._finish_all(None)
                return
            if not await self._carry_out_drop(str(exc) if exc else ""):
                return

    def _on_frame(self, data: dict) -> None:
        from duplexkit.protocol import ProtocolError, parse_server_event

        try:
            ev = parse_server_event(data)
        except ProtocolError:  # pragma: no cover - data is already a dict
            return
        self._log.observe(ev)
        self._on_server_event(ev)

    async def _carry_out_drop(self, detail: str) -> bool:
        """The connection ended: carry out what the core decides (docs/protocol.md §1.6): reconnect
        and send its ``session.resume``, hand it the answer, re-send the frames it names. True once
        a new connection carries the session (its replay then flows through the read loop); False
        when the session is over (everything has been failed or ended)."""
        import websockets

        self._reconnected.clear()
        ws = None
        try:
            actions = self.state.connection_ended(self.close_code, detail)
            while True:
                step = next((a for a in actions if isinstance(a, (Reconnect, ResumeAccepted))), None)
                self._apply([a for a in actions if a is not step])
                if isinstance(step, Reconnect):
                    await asyncio.sleep(step.delay_s)
                    ws, reply = await self._open_resume(step.event)
                    actions = self.state.reconnect_failed() if ws is None else self.state.resume_answer(reply)
                    continue
                if isinstance(step, ResumeAccepted):
                    if step.lost is not None:
                        logger.warning("frames %d..%d were lost with the connection and are no longer kept; "
                                       "re-sending from %d", step.lost[0], step.lost[1], step.lost[1] + 1)
                    try:
                        for frame in step.frames:
                            await ws.send(frame)
                            self.frames_resent += 1
                    except websockets.exceptions.ConnectionClosed:  # the new connection dropped too
                        await _close_quietly(ws)
                        ws = None
                        actions = self.state.reconnect_failed()
                        continue
                    self._ws = ws
                    if step.event is not None:
                        self._on_frame(step.event)
                    return True
                if ws is not None:  # the resume was refused
                    await _close_quietly(ws)
                self._finish_streams(self._failure)
                return False
        finally:
            self._reconnected.set()

    async def _open_resume(self, event: dict) -> tuple[Any, Any]:
        """Open a new connection, send ``event`` (the core's ``session.resume``) as its first frame
        and read the server's first answer: ``(ws, decoded answer)``, or ``(None, None)`` when any
        of it failed (the connection is then closed)."""
        import websockets

        try:
            ws = await self._connect_ws()
        except DuplexConnectionError:
            return None, None
        try:
            await ws.send(json.dumps(event))
            return ws, json.loads(await asyncio.wait_for(ws.recv(), self.open_timeout_s))
        except (websockets.exceptions.ConnectionClosed, asyncio.TimeoutError, ValueError):
            await _close_quietly(ws)
            return None, None

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self.closed or self._failure is not None:
                return
            try:
                await self._send({"type": "session.heartbeat"})
            except Exception:
                return


async def _close_quietly(ws) -> None:
    try:
        await asyncio.wait_for(ws.close(), 2)
    except Exception:
        pass
