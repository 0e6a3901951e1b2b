"""The asyncio client shell shared by :class:`InlineDuplexClient` and :class:`DuplexClient`.

All conversation logic of the client side lives in the sans-I/O
:class:`~duplexkit.clients.state.ClientState` (correlation, responses, playback truth, barge-in).
This module is the asyncio half, written once for both transports:

* the public calls (``send_audio``, ``commit``, ``create_response``, ``cancel``, ``barge_in``,
  ``ack_playback``, ``update``, ``truncate``, ``clear_input``, ``heartbeat``, ``close``) turn into
  :meth:`ClientState.request` calls whose reply resolves an asyncio future;
* server events (dicts or parsed models) go through :meth:`ClientState.receive`; its actions are
  carried out: transmit, resolve/reject futures, feed :class:`ResponseHandle` iterators,
  ``events()`` (typed :mod:`duplexkit.protocol` models, GA names), ``responses()``;
* the player (:class:`~duplexkit.audio.Player`): the one given, or a
  :class:`~duplexkit.audio.VirtualPlayer` playing in real time. Its ``on_drained`` callbacks come
  back to the event loop and tell the state a response was fully heard;
* input: audio is encoded for the session's declared input format and rate (the last
  ``session.updated``) with one streaming resampler per stream (:class:`~duplexkit.audio.StreamEncoder`);
  optional echo control (:mod:`duplexkit.audio.echo`) and local-VAD barge-in run on the way;
* reference voice loading: a path, WAV bytes or a float32 array -> a WAV data URL (docs/protocol.md §8);
* function tools (``tools=[...]``): the sans-I/O :class:`~duplexkit.clients.tools.ToolRunner` decides,
  this shell runs each call in a task, sends the outputs in order and delivers
  :class:`~duplexkit.clients.tools.ToolCallStarted` / :class:`~duplexkit.clients.tools.ToolCallFinished`
  records to ``events()`` (docs/clients.md, "Tools").
"""

from __future__ import annotations

import abc
import asyncio
import base64
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Sequence, Union, cast

import numpy as np

from duplexkit.errors import DuplexConnectionError, DuplexError, DuplexTimeout
from duplexkit.protocol.vocabulary import CLOSE_CODE_OF_REASON

from . import state as cs
from . import tools as tl
from .handles import ClientOptions, ResponseHandle, _EventQueue, ref_audio_data_url, wait_done

if TYPE_CHECKING:  # duplexkit.audio is imported when first used
    from duplexkit.audio.playback import Player, RenderingPlayer

logger = logging.getLogger("duplexkit.clients")

__all__ = [
    "BaseDuplexClient",
    "ResponseHandle",
    "DuplexError",
    "DuplexConnectionError",
    "DuplexTimeout",
    "ClientOptions",
    "ref_audio_data_url",
    "OUTPUT_RATE",
]

OUTPUT_RATE = cs.OUTPUT_RATE
"""Server output rate in Hz (docs/protocol.md §6.2)."""

CLOSE_CODES = CLOSE_CODE_OF_REASON
"""WebSocket close code that follows ``session.closed{reason}`` (docs/protocol.md §1.5)."""

class BaseDuplexClient(abc.ABC):
    """The shared asyncio client; subclasses provide the transport.

    Subclasses implement ``_open()`` (connect; server events then arrive through
    :meth:`_on_server_event`), ``_transmit(event: dict)`` and ``_shutdown()``; they call
    :meth:`_on_transport_lost` when the transport dies.

    The keyword options are :class:`~duplexkit.clients.handles.ClientOptions`' plus:

    Args:
        tools: plain sync/async functions or :class:`~duplexkit.agent.FunctionTool` objects (see
            :func:`duplexkit.agent.tool`). Their schemas go out with the first ``session.update``
            (unless ``session`` lists ``tools`` itself) and the client runs the calls the server
            issues (:mod:`duplexkit.clients.tools`). None: the client runs nothing.
        tool_choice: ``"auto"`` (default), ``"required"``, ``"none"`` or ``{"type": "function",
            "name": ...}``; sent with the tools.

    Raises:
        ToolDefinitionError: a function that cannot be a tool, or two tools with one name.
        TypeError: ``player`` is not a :class:`~duplexkit.audio.Player`, or ``echo`` asks for echo
            control and the player has no ``on_render`` (:class:`~duplexkit.audio.RenderingPlayer`).
        ValueError: ``input_rate`` outside 8000..48000 Hz, or an unknown ``echo`` value.
    """

    def __init__(self, *, session: Optional[dict] = None, ref_audio: Any = None, input_rate: int = 16_000,
                 player: Optional[Player] = None, auto_ack: bool = True, barge_in: Any = False, echo: Any = None,
                 request_timeout_s: float = 30.0, max_buffered_events: int = 4096,
                 tools: Optional[Sequence[Any]] = None, tool_choice: Union[str, dict] = "auto") -> None:
        self.options = ClientOptions(session=dict(session or {}), ref_audio=ref_audio, input_rate=int(input_rate),
                                     player=player, auto_ack=auto_ack, barge_in=barge_in, echo=echo,
                                     request_timeout_s=request_timeout_s,
                                     max_buffered_events=max_buffered_events)
        if self.options.input_rate < 8000 or self.options.input_rate > 48000:
            raise ValueError("input_rate must be within 8000..48000 Hz (docs/protocol.md §6.1)")
        if echo not in (None, False, True, "off", "gate", "aec", "auto") and \
                type(echo).__name__ != "EchoConfig":
            raise ValueError(f"echo must be None, 'off', 'gate', 'aec', 'auto' or an EchoConfig, got {echo!r}")
        from duplexkit.audio.playback import VirtualPlayer

        if player is None:
            player = VirtualPlayer()
        # echo control's reference is what the player plays: a clear error now, not a failure mid-call
        cs.require_player(player, rendering=echo not in (None, False, "off"))
        # a VirtualPlayer plays while the session is open (started by connect, stopped by close)
        self._own_player = isinstance(player, VirtualPlayer)
        self.player: "Player" = player
        self.state = cs.ClientState(player, auto_ack=auto_ack, new_record=lambda ev: ResponseHandle(self, ev))
        self.close_code: Optional[int] = None
        self._released = False
        self.events_dropped = 0
        self._events = _EventQueue(max_buffered_events)
        self._responses = _EventQueue()
        self._futures: dict[str, asyncio.Future] = {}
        self._failure: Optional[BaseException] = None
        self._opened = False
        self._send_lock = asyncio.Lock()
        self._session_closed = asyncio.Event()
        self._bg: set = set()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._encoder = None
        self._capture_rate: Optional[int] = None
        self._vad = None
        self._capture_resampler = None
        self._echo = None
        self._echo_lock = threading.Lock()
        self._pcm_carry = b""
        self._init_eid: Optional[str] = None
        self._init_error: Optional[BaseException] = None
        player.on_drained(self._drained_from_player)
        self.tool_runner: Optional[tl.ToolRunner] = tl.ToolRunner(tools, tool_choice) if tools else None
        self._tool_tasks: dict[str, asyncio.Task] = {}
        self._tool_outbox: deque = deque()
        self._tool_sender: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------ state views
    @property
    def session(self) -> dict:
        """The effective session of the last ``session.created``/``session.updated``, as a dict
        (empty before the first)."""
        return self.state.session or {}

    @property
    def session_id(self) -> Optional[str]:
        return self.state.session_id

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def closed(self) -> bool:
        return self.state.closed or self._released

    @property
    def close_reason(self) -> Optional[str]:
        return self.state.close_reason

    @property
    def last_server_event_seq(self) -> int:
        return self.state.last_server_event_seq

    @property
    def barge_ins(self) -> int:
        """How many barge-ins this client made (API calls and local VAD)."""
        return self.state.barge_ins

    @property
    def speaking(self) -> bool:
        """True while audio of any response is audible (queued in the player)."""
        return self.state.speaking

    @property
    def active_response(self) -> Optional[ResponseHandle]:
        """The response still generating, if any."""
        return self.state.active_response

    def response(self, response_id: str) -> Optional[ResponseHandle]:
        return self.state.responses.get(response_id)

    @property
    def tool_calls(self) -> dict:
        """call_id -> :class:`~duplexkit.clients.tools.ToolCallRecord` of every function call this client
        ran (or refused), oldest first; empty without ``tools``."""
        return dict(self.tool_runner.calls) if self.tool_runner is not None else {}

    def events(self) -> AsyncIterator[Any]:
        """Every server event as a typed :mod:`duplexkit.protocol` model (GA names; unknown types
        as :class:`~duplexkit.protocol.UnknownServerEvent`), in order, from ``session.created`` on.
        Single consumer. Ends after ``session.closed``/close; raises
        :class:`DuplexConnectionError` on transport loss. Unread events beyond
        ``max_buffered_events`` are dropped oldest-first."""
        return self._events

    def responses(self) -> AsyncIterator[ResponseHandle]:
        """A :class:`ResponseHandle` per ``response.created`` (model-, client- and VAD-triggered)."""
        return self._responses

    # ------------------------------------------------------------------ context manager / lifecycle
    async def __aenter__(self):
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> dict:
        """Open the session and wait for ``session.created``; returns the session (a dict).

        The initial options (``session`` fields, ``ref_audio``, the input rate) are sent as the
        first ``session.update`` (applied before ``session.created``, docs/protocol.md §5.1).
        Raises :class:`DuplexConnectionError` (e.g. ``unauthorized``, ``session_capacity_exhausted``),
        :class:`DuplexError` for a rejected initial update (e.g. ``ref_audio_invalid``),
        :class:`DuplexTimeout`. On any of these the session is closed and the transport released
        before the error is raised (no ``close()`` is needed).
        """
        if self._released:
            raise DuplexConnectionError("the client is closed; make a new one to connect again",
                                        code="client_closed")
        if self._opened:
            return self.session
        self._opened = True
        self._loop = asyncio.get_running_loop()
        try:
            if self._own_player:
                self.player.start()
            await self._open()
            if self._failure is not None:
                raise self._failure
            self._init_error = None
            await self._request({"type": "session.update", "session": self._initial_update()}, "session.created")
            if self._init_error is not None:  # the error landed together with session.created
                raise self._init_error
            return self.session
        except BaseException:
            await asyncio.shield(self._abort_connect())
            raise
        finally:
            self._init_eid = None

    async def _abort_connect(self) -> None:
        try:
            await self.close()
        except Exception:  # pragma: no cover - close() never raises; defensive
            logger.debug("close after a failed connect failed", exc_info=True)

    def _initial_update(self) -> dict:
        upd = dict(self.options.session or {})
        has_format = "input_audio_format" in upd or ((upd.get("audio") or {}).get("input") or {}).get("format")
        if not has_format:
            audio = dict(upd.get("audio") or {})
            inp = dict(audio.get("input") or {})
            inp["format"] = {"type": "audio/pcm", "rate": self.options.input_rate}
            audio["input"] = inp
            upd["audio"] = audio
        if self.options.ref_audio is not None and "ref_audio" not in upd:
            upd["ref_audio"] = ref_audio_data_url(self.options.ref_audio)
        if self.tool_runner is not None and "tools" not in upd:
            fields = self.tool_runner.session_fields()
            upd["tools"] = fields["tools"]
            upd.setdefault("tool_choice", fields["tool_choice"])
        return upd

    async def close(self, reason: str = "client_close") -> None:
        """Send ``session.close`` (if still open), wait briefly for ``session.closed``, then release
        the transport and the player it created. Idempotent; never raises for a connection that
        is already gone."""
        if self._released:
            return
        if not self.state.closed and self._failure is None and self._opened:
            try:
                await self._send({"type": "session.close", "reason": reason})
                await wait_done(self._session_closed.wait(), 5)
            except Exception:
                pass
        self._released = True
        try:
            await self._shutdown()
        finally:
            if not self.state.closed:
                self._apply(self.state.close())
            self._finish_streams(None)
            self.player.flush(None)  # the session is over: nothing of it plays on
            if self._own_player:
                await self.player.stop()
            for t in list(self._bg) + list(self._tool_tasks.values()):
                t.cancel()
            self._tool_tasks.clear()

    # ------------------------------------------------------------------ public calls
    async def send_audio(self, audio: Union[bytes, bytearray, np.ndarray], *, rate: Optional[int] = None) -> None:
        """Append microphone audio (``input_audio_buffer.append``).

        Args:
            audio: pcm16 mono little-endian bytes, or a float32 [n] array in [-1, 1].
            rate: Hz of ``audio`` (default ``input_rate``). The audio is resampled (one streaming
                resampler per stream, no seams) and encoded for the session's declared input
                format and rate (pcm16, pcm_f32le, G.711; the last ``session.updated``).
        Raises:
            ValueError: a non-1-D array or a rate outside 8000..48000 Hz;
            :class:`~duplexkit.audio.AudioFormatError` (a ``ValueError``): non-finite samples;
            TypeError: not bytes, a float or an int16 array;
            :class:`DuplexConnectionError`: the client is closed (``client_closed``) or the
            connection is gone.
        """
        from duplexkit.audio import pcm16_to_float32

        self._check_open()
        src_rate = self.options.input_rate if rate is None else _check_rate(rate)
        if isinstance(audio, np.ndarray):
            if audio.ndim != 1:
                raise ValueError(f"expected mono audio of shape [n], got shape {audio.shape}")
            if audio.dtype == np.int16:  # pcm16 samples
                x = audio.astype(np.float32) / 32768.0
            elif np.issubdtype(audio.dtype, np.floating):
                x = np.asarray(audio, np.float32)
            else:
                raise TypeError(f"expected a float32 (or int16) array, got dtype {audio.dtype}")
        elif not isinstance(audio, (bytes, bytearray, memoryview)):
            raise TypeError(f"expected pcm16 bytes or a numpy array, got {type(audio).__name__}")
        else:
            data = self._pcm_carry + bytes(audio)
            cut = len(data) - (len(data) % 2)
            self._pcm_carry = data[cut:]
            x = pcm16_to_float32(data[:cut])
        if x.size == 0:
            return
        if self.options.barge_in or self._echo_wanted():
            x, src_rate = await self._listen(x, src_rate), 16_000
        payload = self._encode(x, src_rate)
        if payload:
            await self._send({"type": "input_audio_buffer.append", "audio": base64.b64encode(payload).decode("ascii")})

    async def commit(self) -> Any:
        """``input_audio_buffer.commit``; returns ``input_audio_buffer.committed`` (typed).
        Raises :class:`DuplexError` (e.g. ``input_audio_buffer_empty``)."""
        self._pcm_carry = b""  # an incomplete sample is dropped at a commit (docs/protocol.md §6.1)
        await self._flush_encoder()
        return await self._request({"type": "input_audio_buffer.commit"}, "input_audio_buffer.committed")

    async def clear_input(self) -> Any:
        """``input_audio_buffer.clear``; returns ``input_audio_buffer.cleared`` (typed)."""
        self._pcm_carry = b""
        if self._encoder is not None:
            self._encoder.flush()  # held-back samples belong to the cleared audio
        return await self._request({"type": "input_audio_buffer.clear"}, "input_audio_buffer.cleared")

    async def create_response(self, *, modalities: Optional[list[str]] = None, temperature: Optional[float] = None,
                              max_output_tokens: Union[int, str, None] = None,
                              metadata: Optional[dict] = None) -> ResponseHandle:
        """``response.create``: force an answer (docs/protocol.md §7.1). Returns its handle once
        ``response.created`` arrives. Raises :class:`DuplexError` (``response_already_active``...)."""
        resp: dict[str, Any] = {}
        if modalities is not None:
            resp["output_modalities"] = list(modalities)
        if temperature is not None:
            resp["temperature"] = temperature
        if max_output_tokens is not None:
            resp["max_output_tokens"] = max_output_tokens
        if metadata is not None:
            resp["metadata"] = metadata
        return await self._request({"type": "response.create", "response": resp}, "response.created")

    async def cancel(self, response_id: Optional[str] = None) -> None:
        """``response.cancel`` (docs/protocol.md §7.3). Races (nothing active) are swallowed.
        The server's ``response.done{cancelled}`` then flushes the player and reports what was
        heard; use :meth:`barge_in` to stop what is audible at once."""
        self._check_open()
        ev: dict[str, Any] = {"type": "response.cancel"}
        if response_id:
            ev["response_id"] = response_id
        await self._send_action(self.state.request(ev, quiet=True))
        if self.tool_runner is not None:
            self._apply_tools(self.tool_runner.client_cancelled())

    async def barge_in(self) -> Optional[ResponseHandle]:
        """Interrupt what the user hears now (what local VAD does on speech): cancel the response
        if it is still generating, flush the player and report ``playback.ack{played_ms,
        truncate:true}`` of what was heard. Works on the tail that is still playing after
        ``response.done``. Returns the interrupted handle, or None when nothing was audible."""
        rec, actions = self.state.barge_in()  # the player is flushed here, whatever the transport
        if self._released or self._failure is not None:
            self._apply([a for a in actions if not isinstance(a, cs.Send)])
            return rec
        await self._apply_async(actions)
        if self.tool_runner is not None:
            self._apply_tools(self.tool_runner.client_cancelled())
        return rec

    async def ack_playback(self, response_id: str, played_ms: int, *, item_id: Optional[str] = None,
                           truncate: bool = False) -> None:
        """``playback.ack``: report cumulative ms of ``response_id`` actually played
        (docs/protocol.md §7.5; automatic with ``auto_ack``). Raises ValueError for a negative value."""
        self._check_open()
        if isinstance(played_ms, bool) or not float(played_ms).is_integer():
            raise ValueError(f"played_ms must be a whole number of ms, got {played_ms!r}")
        await self._send_action(self.state.ack(response_id, played_ms, item_id=item_id, truncate=truncate))

    async def truncate(self, item_id: str, audio_end_ms: int) -> Any:
        """``conversation.item.truncate``; returns ``conversation.item.truncated`` (typed)."""
        return await self._request({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                                    "audio_end_ms": int(audio_end_ms)}, "conversation.item.truncated")

    async def update(self, **session_fields) -> dict:
        """``session.update`` with the given fields (GA or beta spellings; ``ref_audio`` may be a
        path, bytes or array). Returns the effective session (dict); later ``send_audio`` calls
        follow its input format. Raises :class:`DuplexError`."""
        if "ref_audio" in session_fields and session_fields["ref_audio"] is not None:
            session_fields["ref_audio"] = ref_audio_data_url(session_fields["ref_audio"])
        self._pcm_carry = b""  # a format change drops an incomplete sample (docs/protocol.md §6.1)
        await self._request({"type": "session.update", "session": session_fields}, "session.updated")
        return self.session

    async def heartbeat(self) -> Any:
        """``session.heartbeat``; returns ``session.heartbeat_ack`` (typed)."""
        return await self._request({"type": "session.heartbeat"}, "session.heartbeat_ack")

    async def send_event(self, event: dict) -> None:
        """Send any client event as is (an ``event_id`` is added when missing)."""
        await self._send(dict(event))

    # ------------------------------------------------------------------ internals: input path
    def _echo_wanted(self) -> bool:
        return self.options.echo not in (None, False, "off")

    def _echo_control(self):
        """The :class:`~duplexkit.audio.EchoControl` of this client (created on first use; its
        reference signal is every block the player renders). Raises
        :class:`~duplexkit.audio.EchoUnavailableError` for ``"aec"`` without the AEC package."""
        if self._echo is None:
            from duplexkit.audio.echo import EchoConfig, EchoControl, aec_available

            cfg = self.options.echo
            if cfg is True or cfg == "auto":
                cfg = EchoConfig(mode="aec" if aec_available() else "gate")
            elif isinstance(cfg, str):
                cfg = EchoConfig(mode=cfg)
            player = cast("RenderingPlayer", self.player)  # checked at construction (require_player)
            ctl = EchoControl(cfg, capture_rate=16_000, render_rate=player.sample_rate)
            lock = self._echo_lock

            def render(block: np.ndarray) -> None:  # the player's thread
                with lock:
                    ctl.render(block)

            player.on_render(render)
            self._echo = ctl
        return self._echo

    async def _listen(self, x: np.ndarray, rate: int) -> np.ndarray:
        """The client's own listening path at 16 kHz: one streaming resampler, echo control
        (``echo``), then the local VAD (``barge_in``) whose speech starts barge in. Returns the
        16 kHz float32 audio to send (echo-cancelled in ``"aec"`` mode, residual echo suppressed
        in both modes: :meth:`~duplexkit.audio.EchoControl.suppress`)."""
        from duplexkit.audio import StreamingVAD, StreamResampler, VadConfig

        if self._capture_rate != rate:
            self._capture_rate = rate
            self._capture_resampler = StreamResampler(rate, 16_000) if rate != 16_000 else None
        x16 = self._capture_resampler.process(x) if self._capture_resampler is not None else x
        echo = self._echo_control() if self._echo_wanted() else None
        if echo is not None:
            with self._echo_lock:
                x16 = echo.capture(x16)
        heard = x16
        if self.options.barge_in:
            if self._vad is None:
                cfg = self.options.barge_in if isinstance(self.options.barge_in, VadConfig) else VadConfig()
                self._vad = StreamingVAD(cfg, echo=echo) if echo is not None else StreamingVAD(cfg)
            for vev in self._vad.process(heard):  # the gate learns from the unsuppressed capture
                if vev.kind == "speech_started":
                    _, actions = self.state.local_speech_started()
                    await self._apply_async(actions)
        if echo is not None:  # what the server hears: residual echo pushed below any VAD's floor
            with self._echo_lock:
                x16 = echo.suppress(heard)
        return x16

    def _encode(self, x: np.ndarray, rate: int) -> bytes:
        from duplexkit.audio import InputFormat, StreamEncoder

        fmt = self.state.input_format or InputFormat("pcm16", self.options.input_rate)
        if self._encoder is None:
            self._encoder = StreamEncoder(fmt)
            head = b""
        else:
            head = self._encoder.set_format(fmt)
        return head + self._encoder.encode(x, rate)

    async def _flush_encoder(self) -> None:
        if self._encoder is not None:
            tail = self._encoder.flush()
            if tail:
                await self._send({"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(tail).decode("ascii")})

    # ------------------------------------------------------------------ internals: sending/waiting
    def _check_open(self) -> None:
        """Raise what a call after the end gets: the transport failure, or ``client_closed``."""
        if self._released:
            raise DuplexConnectionError("the client is closed", code="client_closed")
        if self._failure is not None:
            raise self._failure

    async def _send(self, event: dict) -> None:
        self._check_open()
        await self._send_action(self.state.request(event) if not self.state.closed else cs.Send(event))

    async def _send_action(self, action: "cs.Send") -> None:
        if self._failure is not None:
            raise self._failure
        if self._released:
            raise DuplexConnectionError("the client is closed", code="client_closed")
        async with self._send_lock:
            await self._transmit(action.event)

    async def _request(self, event: dict, what: str) -> Any:
        """Send ``event`` through the correlation map and wait for its reply (``what`` names it
        for the timeout message). Raises what the reply carries, :class:`DuplexTimeout`."""
        self._check_open()
        action = self.state.request(event)
        eid = action.event["event_id"]
        if what == "session.created":
            self._init_eid = eid
        fut = asyncio.get_running_loop().create_future()
        self._futures[eid] = fut
        try:
            await self._send_action(action)
            if not await wait_done(fut, self.options.request_timeout_s):
                raise DuplexTimeout(f"no {what} within {self.options.request_timeout_s} s")
            return fut.result()
        finally:
            self._futures.pop(eid, None)

    # ------------------------------------------------------------------ internals: receiving
    def _on_server_event(self, ev: Any) -> None:
        """Handle one server event (a dict or a parsed model). Never raises."""
        try:
            self._apply(self.state.receive(ev))
            if self.tool_runner is not None:
                self._apply_tools(self.tool_runner.receive(ev))
        except Exception:  # pragma: no cover - a client bug must not kill the transport loop
            logger.exception("client failed to handle %r", ev.get("type") if isinstance(ev, dict) else ev)

    def _drained_from_player(self, response_id: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_drained, response_id)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _on_drained(self, response_id: str) -> None:
        if not self._released:
            self._apply(self.state.playback_drained(response_id))

    def _apply(self, actions: list) -> None:
        """Carry out the state's actions; sends are queued in order on the event loop."""
        sends = []
        for a in actions:
            if isinstance(a, cs.Send):
                sends.append(a)
            elif isinstance(a, cs.Resolve):
                self._settle(a.event_id, value=a.value)
            elif isinstance(a, cs.Reject):
                self._settle(a.event_id, exc=a.error)
            elif isinstance(a, cs.Deliver):
                ev = a.event
                if ev.type == "error" and self._init_eid is not None and \
                        getattr(getattr(ev, "error", None), "event_id", None) == self._init_eid:
                    self._init_error = DuplexError.from_event(ev.model_dump(mode="json"))
                self._events.put(ev)
                self.events_dropped = self._events.dropped
            elif isinstance(a, cs.ResponseStarted):
                self._responses.put(a.response)
            elif isinstance(a, cs.ResponseAudio):
                a.response._on_audio(a.pcm)
            elif isinstance(a, cs.ResponseEnded):
                a.response._on_end(a.error)
            elif isinstance(a, cs.SessionEnded):
                if self.close_code is None and a.error is None:
                    self.close_code = CLOSE_CODES.get(str(a.reason), 1000)
                if a.error is not None and self._failure is None:
                    self._failure = a.error  # the transport failed: later calls raise it
                self._session_closed.set()
                self._finish_streams(a.error)
        if sends:
            self._spawn(self._send_all(sends))

    async def _apply_async(self, actions: list) -> None:
        """Like :meth:`_apply`, but the sends are awaited (errors reach the caller)."""
        sends = [a for a in actions if isinstance(a, cs.Send)]
        self._apply([a for a in actions if not isinstance(a, cs.Send)])
        for a in sends:
            await self._send_action(a)

    async def _send_all(self, sends: list) -> None:
        for a in sends:
            try:
                await self._send_action(a)
            except DuplexError as exc:
                logger.debug("could not send %s: %s", a.event.get("type"), exc)
                return

    def _settle(self, event_id: str, value: Any = None, exc: Optional[BaseException] = None) -> None:
        fut = self._futures.get(event_id)
        if fut is None or fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: a caller that timed out must not log noise
        else:
            fut.set_result(value)

    # ------------------------------------------------------------------ internals: tools
    def _apply_tools(self, actions: list) -> None:
        """Carry out the tool runner's actions: start or cancel call tasks, queue events to send (one
        sender task keeps their order), deliver records to ``events()``."""
        for a in actions:
            if isinstance(a, tl.StartCall):
                task = asyncio.get_running_loop().create_task(self._run_tool(a.call), name=f"tool-{a.call.name}")
                self._tool_tasks[a.call.call_id] = task
            elif isinstance(a, tl.CancelCall):
                task = self._tool_tasks.pop(a.call.call_id, None)
                if task is not None:
                    task.cancel()
            elif isinstance(a, tl.SendEvent):
                self._tool_outbox.append(a.event)
            elif isinstance(a, tl.Notify):
                self._events.put(a.record)
                self.events_dropped = self._events.dropped
        if self._tool_outbox and (self._tool_sender is None or self._tool_sender.done()) and not self._released:
            self._tool_sender = asyncio.get_running_loop().create_task(self._send_tool_events())
            self._bg.add(self._tool_sender)
            self._tool_sender.add_done_callback(self._bg.discard)

    async def _send_tool_events(self) -> None:
        while self._tool_outbox:
            ev = self._tool_outbox.popleft()
            try:
                await self._send(ev)
            except DuplexError as exc:  # the connection is gone: the rest cannot go either
                logger.debug("could not send %s: %s", ev.get("type"), exc)
                self._tool_outbox.clear()
                return

    async def _run_tool(self, call: "tl.ToolCallRecord") -> None:
        t0 = time.perf_counter()
        output, error = None, None
        try:
            output = await call.tool.invoke(call.arguments)
        except asyncio.CancelledError:
            call.elapsed_ms = (time.perf_counter() - t0) * 1000
            raise
        except Exception as exc:  # the tool's own error goes back to the model as an error output
            error = exc
        call.elapsed_ms = (time.perf_counter() - t0) * 1000
        if self._tool_tasks.get(call.call_id) is asyncio.current_task():
            del self._tool_tasks[call.call_id]
        if not self._released and self.tool_runner is not None:
            self._apply_tools(self.tool_runner.call_finished(call.call_id, output, error))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # ------------------------------------------------------------------ failure
    def _finish_streams(self, exc: Optional[BaseException]) -> None:
        for eid, fut in list(self._futures.items()):
            if not fut.done():
                self._settle(eid, exc=exc or DuplexConnectionError("the session closed", code="session_closed"))
        self._events.finish(exc)
        self._responses.finish(exc)
        self._session_closed.set()

    def _finish_all(self, exc: Optional[BaseException]) -> None:
        """End everything (transport gone or session over): pending calls fail, iterators end
        (cleanly when ``exc`` is None)."""
        if not self.state.closed:
            self._apply(self.state.close() if exc is None else self.state.connection_lost(exc))
        self._finish_streams(exc)

    def _on_transport_lost(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc if isinstance(exc, DuplexConnectionError) else DuplexConnectionError(str(exc))
        if not self.state.closed:
            self._apply(self.state.connection_lost(self._failure))
        self._finish_streams(self._failure)

    # ------------------------------------------------------------------ transport (subclasses)
    @abc.abstractmethod
    async def _open(self) -> None:
        """Open the transport (a WebSocket, or a SessionDriver in-process)."""

    @abc.abstractmethod
    async def _transmit(self, event: dict) -> None:
        """Deliver one client event dict to the Session."""

    @abc.abstractmethod
    async def _shutdown(self) -> None:
        """Release the transport."""


def _check_rate(rate) -> int:
    """A per-call source rate: an integer number of Hz within 8000..48000 (the input rates of
    docs/protocol.md §6.1). Raises ValueError."""
    if isinstance(rate, bool) or not float(rate).is_integer() or not 8000 <= int(rate) <= 48000:
        raise ValueError(f"rate must be an integer within 8000..48000 Hz, got {rate!r}")
    return int(rate)
