"""The client API shared by :class:`InlineDuplexClient` and :class:`DuplexClient` (DESIGN.md).

Both clients exchange the same event dictionaries with a :class:`duplexkit.session.Session`: the
inline client calls it directly, the remote client through a WebSocket. Everything that is not
transport lives here once:

* the public calls (``send_audio``, ``commit``, ``create_response``, ``cancel``, ``ack_playback``,
  ``update``, ``truncate``, ``clear_input``, ``heartbeat``, ``close``) and ``events()`` /
  ``responses()``;
* :class:`ResponseHandle`: one per ``response.created`` (id, item id, epoch, trigger, transcript or
  text, an async iterator of the decoded 24 kHz float32 audio, the final status);
* error correlation: every client event carries an ``event_id``; an ``error`` echoing it fails the
  waiting call (:class:`DuplexError`); other errors go to ``events()`` (PROTOCOL.md §9);
* playback truth (PROTOCOL.md §7.4-7.5): an optional :class:`~duplexkit.audio.PlaybackBuffer`
  ``player`` receives every audio delta; without one a virtual real-time clock stands in for the
  speaker. ``auto_ack`` reports what was played with ``playback.ack`` at ``response.done``;
* local barge-in: with ``barge_in=True`` (or a :class:`~duplexkit.audio.VadConfig`) the audio
  passed to :meth:`send_audio` runs through :class:`~duplexkit.audio.StreamingVAD`; user speech
  during a response cancels it, flushes the player and acknowledges what was heard
  (``playback.ack{truncate:true}``), PROTOCOL.md §7.3;
* reference voice loading: a path, WAV bytes or a float32 array -> a WAV data URL (PROTOCOL.md §8).

Beta / vLLM-Omni event names are mapped to GA names before anything else sees them
(PROTOCOL.md §2.1); a ``conversation.item.created`` repeating an ``added`` item is dropped.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import collections
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Optional, Union

import numpy as np

from duplexkit.errors import DuplexConnectionError, DuplexError, DuplexTimeout

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

OUTPUT_RATE = 24_000
"""Server output rate in Hz (PROTOCOL.md §6.2)."""

MAX_KEPT_RESPONSES = 256
"""Finished response handles kept for :meth:`BaseDuplexClient.response` lookups (older ones are dropped)."""

CLOSE_CODES = {"client_close": 1000, "timeout": 1000, "shutdown": 1001, "server_error": 1011}
"""WebSocket close code that follows ``session.closed{reason}`` (PROTOCOL.md §1.5)."""

_BENIGN_ERRORS = {"response_not_active"}
"""Error codes clients swallow (PROTOCOL.md §7.3: cancel races)."""


async def wait_done(aw: Any, timeout: Optional[float]) -> bool:
    """Wait for a future/awaitable for at most ``timeout`` seconds (None: no limit); True when it
    finished, False on timeout (it is then cancelled if this call created it; a given future is
    left alone).

    Unlike ``asyncio.wait_for`` on Python 3.11, a cancellation of the waiting task is never lost
    when the awaited thing completes in the same loop iteration: ``asyncio.wait`` only waits, so
    the ``CancelledError`` always propagates. The caller reads the result (``fut.result()``).
    """
    fut = asyncio.ensure_future(aw)
    owned = fut is not aw
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout)
    except BaseException:
        if owned:
            fut.cancel()
        raise
    if not done:
        if owned:
            fut.cancel()
        return False
    return True


def ref_audio_data_url(ref: Union[str, Path, bytes, np.ndarray, tuple], rate: int = 16_000) -> str:
    """A reference voice as a ``data:audio/wav;base64,…`` URL (PROTOCOL.md §8.1).

    Args:
        ref: a WAV path, WAV file bytes, a float32 [n] array at ``rate`` Hz, an ``(array, rate)``
            tuple, or an existing data URL / ``file://`` / server-side path string. Strings that
            are not an existing local file are passed through unchanged (server-side allow-listed
            paths, PROTOCOL.md §8.1).
    Raises:
        duplexkit.audio.AudioFormatError: undecodable bytes or non-finite samples.
    """
    from duplexkit.audio import read_wav, wav_bytes

    if isinstance(ref, tuple):
        arr, rate = ref
        data = wav_bytes(np.asarray(arr, np.float32), int(rate))
    elif isinstance(ref, np.ndarray):
        data = wav_bytes(np.asarray(ref, np.float32), rate)
    elif isinstance(ref, (bytes, bytearray, memoryview)):
        audio, sr = read_wav(bytes(ref))
        data = wav_bytes(audio, sr)
    else:
        s = str(ref)
        if s.startswith("data:") or s.startswith("file://") or not Path(s).is_file():
            return s
        audio, sr = read_wav(s)
        data = wav_bytes(audio, sr)
    return "data:audio/wav;base64," + base64.b64encode(data).decode("ascii")


@dataclass
class ClientOptions:
    """Options common to both clients.

    Attributes:
        session: initial ``session.update`` fields (GA or beta spellings), sent before anything else.
        ref_audio: reference voice (see :func:`ref_audio_data_url`); sent with the initial update.
        input_rate: rate in Hz of bytes given to :meth:`send_audio` (pcm16 mono); also set as the
            session's input format when ``session`` does not give one.
        player: a :class:`duplexkit.audio.PlaybackBuffer` fed with every audio delta (the caller
            reads it into a speaker); None = a virtual real-time playback clock.
        auto_ack: send ``playback.ack`` with the played ms when a response ends.
        barge_in: local barge-in (True, or a ``VadConfig``); see the module docstring.
        request_timeout_s: how long a call waits for its answer before :class:`DuplexTimeout`.
        max_buffered_events: ``events()`` keeps at most this many unread events (oldest dropped,
            counted in ``events_dropped``).
    """

    session: Optional[dict] = None
    ref_audio: Any = None
    input_rate: int = 16_000
    player: Any = None
    auto_ack: bool = True
    barge_in: Any = False
    request_timeout_s: float = 30.0
    max_buffered_events: int = 4096


_CLOSED = object()


class _Stream:
    """A single-consumer async queue that can end or fail."""

    def __init__(self, maxlen: Optional[int] = None) -> None:
        self._items: collections.deque = collections.deque()
        self._maxlen = maxlen
        self._event = asyncio.Event()
        self._end: Any = None  # None while open; _CLOSED or an exception
        self.dropped = 0

    def put(self, item: Any) -> None:
        if self._end is not None:
            return
        if self._maxlen is not None and len(self._items) >= self._maxlen:
            self._items.popleft()
            self.dropped += 1
        self._items.append(item)
        self._event.set()

    def finish(self, exc: Optional[BaseException] = None) -> None:
        if self._end is None:
            self._end = exc if exc is not None else _CLOSED
            self._event.set()

    async def get(self) -> Any:
        """The next item; raises StopAsyncIteration at a clean end, the failure otherwise."""
        while True:
            if self._items:
                return self._items.popleft()
            if self._end is not None:
                if self._end is _CLOSED:
                    raise StopAsyncIteration
                raise self._end
            self._event.clear()
            await self._event.wait()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.get()


class ResponseHandle:
    """One response (PROTOCOL.md §5.3), created on ``response.created``.

    Attributes:
        id, item_id, epoch, trigger: identity (``trigger``: ``model``/``client``/``server_vad``).
        status: None while active, then ``completed``/``cancelled``/``incomplete``/``failed``.
        status_details: the ``response.done`` details (e.g. ``{"reason": "turn_detected"}``).
        transcript: audio transcript so far (concatenated deltas; the ``done`` value at the end).
        text: text-only output so far (``output_modalities == ["text"]``).
        audio_samples: 24 kHz samples received; ``audio_ms`` their duration (floored).
        chunk_sizes: samples per audio delta, in order.
        decision: ``"listen"`` when a requested response ended with a terminating ``response.listen``.
        final: the ``response.done`` event (None while active).
    """

    def __init__(self, client: "BaseDuplexClient", event: dict) -> None:
        r = event.get("response") or {}
        self._client = client
        self.id: str = r.get("id") or event.get("response_id") or ""
        self.epoch: Optional[int] = r.get("epoch", (r.get("metadata") or {}).get("epoch") if isinstance(
            r.get("metadata"), dict) else None)
        self.trigger: Optional[str] = r.get("trigger")
        self.item_id: Optional[str] = None
        self.status: Optional[str] = None
        self.status_details: Optional[dict] = None
        self.transcript = ""
        self.text = ""
        self.audio_samples = 0
        self.chunk_sizes: list[int] = []
        self.decision: Optional[str] = None
        self.final: Optional[dict] = None
        self.created_at = time.monotonic()
        self.first_audio_at: Optional[float] = None
        self.done_at: Optional[float] = None
        self.events: list[dict] = []
        self._audio = _Stream()
        self._chunks: list[np.ndarray] = []
        self._done = asyncio.Event()
        self._error: Optional[BaseException] = None
        self.acked_ms = 0

    # -- state --------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.status is None

    @property
    def audio_ms(self) -> int:
        return self.audio_samples * 1000 // OUTPUT_RATE

    def audio_array(self) -> np.ndarray:
        """All audio received so far: float32 [n] at 24 kHz."""
        if not self._chunks:
            return np.zeros(0, np.float32)
        return np.concatenate(self._chunks)

    def audio(self) -> AsyncIterator[np.ndarray]:
        """Async iterator of decoded audio chunks (float32 [n], 24 kHz) as they arrive; it ends at
        ``response.done`` and raises :class:`DuplexConnectionError` if the connection is lost.
        Single consumer."""
        return self._audio

    async def wait(self, timeout: Optional[float] = None) -> dict:
        """Wait for ``response.done``; returns it. Raises :class:`DuplexTimeout` after ``timeout``
        seconds, :class:`DuplexConnectionError` if the connection drops first."""
        if not self._done.is_set() and not await wait_done(self._done.wait(), timeout):
            raise DuplexTimeout(f"response {self.id} not done after {timeout} s")
        if self._error is not None and self.final is None:
            raise self._error
        return self.final or {}

    done = wait

    async def cancel(self) -> None:
        """Cancel this response (no-op if it already ended)."""
        if self.active:
            await self._client.cancel(self.id)

    # -- fed by the client --------------------------------------------------------------------
    def _audio_delta(self, pcm: np.ndarray) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
        self.audio_samples += len(pcm)
        self.chunk_sizes.append(len(pcm))
        self._chunks.append(pcm)
        self._audio.put(pcm)

    def _finish(self, ev: dict) -> None:
        r = ev.get("response") or {}
        self.final = ev
        self.status = r.get("status") or "completed"
        self.status_details = r.get("status_details")
        self.done_at = time.monotonic()
        self._audio.finish()
        self._done.set()

    def _fail(self, exc: BaseException) -> None:
        if self.status is None:
            self._error = exc
            self._audio.finish(exc)
            self._done.set()

    def __repr__(self) -> str:
        return (f"ResponseHandle(id={self.id!r}, status={self.status!r}, trigger={self.trigger!r}, "
                f"epoch={self.epoch}, audio_ms={self.audio_ms}, transcript={self.transcript!r})")


class BaseDuplexClient(abc.ABC):
    """The shared client machinery; subclasses provide the transport.

    Subclasses implement ``_open()`` (connect; server events then arrive through
    :meth:`_on_server_event`), ``_transmit(event: dict)`` and ``_shutdown()``; they call
    :meth:`_on_transport_lost` when the transport dies.
    """

    def __init__(self, *, session: Optional[dict] = None, ref_audio: Any = None, input_rate: int = 16_000,
                 player: Any = None, auto_ack: bool = True, barge_in: Any = False,
                 request_timeout_s: float = 30.0, max_buffered_events: int = 4096) -> None:
        self.options = ClientOptions(session=dict(session or {}), ref_audio=ref_audio, input_rate=int(input_rate),
                                     player=player, auto_ack=auto_ack, barge_in=barge_in,
                                     request_timeout_s=request_timeout_s,
                                     max_buffered_events=max_buffered_events)
        if self.options.input_rate < 8000 or self.options.input_rate > 48000:
            raise ValueError("input_rate must be within 8000..48000 Hz (PROTOCOL.md §6.1)")
        self.session: dict = {}
        self.session_id: Optional[str] = None
        self.epoch = 0
        self.closed = False
        self.close_reason: Optional[str] = None
        self.close_code: Optional[int] = None
        self._released = False
        self.last_server_event_seq = 0
        self.events_dropped = 0
        self._events = _Stream(max_buffered_events)
        self._responses = _Stream()
        self._handles: dict[str, ResponseHandle] = {}
        self._items_added: set[str] = set()
        self._vad_stopped_items: set[str] = set()
        self._waiters: dict[str, asyncio.Future] = {}
        self._session_waiter: Optional[tuple[str, asyncio.Future]] = None
        self._create_waiter: Optional[tuple[str, asyncio.Future]] = None
        self._quiet_ids: set[str] = set()
        self._active: Optional[ResponseHandle] = None
        self._vad = None
        self._vad_resampler = None
        self._failure: Optional[BaseException] = None
        self._opened = False
        self._init_event_id: Optional[str] = None
        self._init_error: Optional[BaseException] = None
        self._send_lock = asyncio.Lock()
        self.barge_ins = 0

    # ------------------------------------------------------------------ context manager / lifecycle
    async def __aenter__(self):
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> dict:
        """Open the session and wait for ``session.created``; returns the session object.

        The initial options (``session`` fields, ``ref_audio``, the input rate) are sent as the
        first ``session.update`` (applied before ``session.created``, PROTOCOL.md §5.1).
        Raises :class:`DuplexConnectionError` (e.g. ``unauthorized``, ``session_capacity_exhausted``),
        :class:`DuplexError` for a rejected initial update (e.g. ``ref_audio_invalid``: an ``error``
        echoing the update's ``event_id`` that arrives before, or together with,
        ``session.created``), :class:`DuplexTimeout`. On any of these the session is closed and the
        transport released before the error is raised (no ``close()`` is needed).
        """
        if self._opened:
            return self.session
        self._opened = True
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        eid = self._new_event_id()
        update = self._initial_update()
        self._init_event_id = eid
        self._init_error = None
        self._session_waiter = (eid, fut)
        self._waiters[eid] = fut  # an error echoing eid fails connect() (base _on_error)
        try:
            await self._open()
            if self._failure is not None:
                raise self._failure
            await self._send({"type": "session.update", "event_id": eid, "session": update})
            session = await self._await(fut, "session.created")
            if self._init_error is not None:  # the error landed together with session.created
                raise self._init_error
            return session
        except BaseException:
            await asyncio.shield(self._abort_connect())
            raise
        finally:
            self._init_event_id = None

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
        return upd

    async def close(self, reason: str = "client_close") -> None:
        """Send ``session.close`` (if still open), wait briefly for ``session.closed``, then release
        the transport. Idempotent; never raises for a connection that is already gone."""
        if self._released:
            return
        if not self.closed and self._failure is None and self._opened:
            try:
                await self._send({"type": "session.close", "reason": reason})
                await wait_done(self._closed_event().wait(), 5)
            except Exception:
                pass
        self.closed = True
        self._released = True
        try:
            await self._shutdown()
        finally:
            self._finish_all(None)

    def _closed_event(self) -> asyncio.Event:
        if not hasattr(self, "_session_closed"):
            self._session_closed = asyncio.Event()
        return self._session_closed

    # ------------------------------------------------------------------ public calls
    async def send_audio(self, audio: Union[bytes, bytearray, np.ndarray], *, rate: Optional[int] = None) -> None:
        """Append microphone audio (``input_audio_buffer.append``).

        Args:
            audio: pcm16 mono little-endian bytes at ``input_rate``, or a float32 [n] array in
                [-1, 1] at ``rate`` Hz (default ``input_rate``; resampled to ``input_rate`` if it
                differs).
        Raises:
            ValueError: a non-1-D array; :class:`DuplexConnectionError` if the connection is gone.
        """
        from duplexkit.audio import float32_to_pcm16, pcm16_to_float32

        if isinstance(audio, np.ndarray):
            if audio.ndim != 1:
                raise ValueError(f"expected mono float32 [n], got shape {audio.shape}")
            x = np.asarray(audio, np.float32)
            if rate is not None and int(rate) != self.options.input_rate:
                from duplexkit.audio.resample import resample
                x = resample(x, int(rate), self.options.input_rate)
            data = float32_to_pcm16(x)
        else:
            data = bytes(audio)
            x = None
        if not data:
            return
        if self.options.barge_in:
            if x is None:
                x = pcm16_to_float32(data[: len(data) - (len(data) % 2)])
            await self._local_vad(x)
        await self._send({"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode("ascii")})

    async def commit(self) -> dict:
        """``input_audio_buffer.commit``; returns ``input_audio_buffer.committed``.
        Raises :class:`DuplexError` (e.g. ``input_audio_buffer_empty``)."""
        return await self._request({"type": "input_audio_buffer.commit"}, ("input_audio_buffer.committed",))

    async def clear_input(self) -> dict:
        """``input_audio_buffer.clear``; returns ``input_audio_buffer.cleared``."""
        return await self._request({"type": "input_audio_buffer.clear"}, ("input_audio_buffer.cleared",))

    async def create_response(self, *, modalities: Optional[list[str]] = None, temperature: Optional[float] = None,
                              max_output_tokens: Union[int, str, None] = None,
                              metadata: Optional[dict] = None) -> ResponseHandle:
        """``response.create``: force an answer (PROTOCOL.md §7.1). Returns its handle once
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
        eid = self._new_event_id()
        fut = asyncio.get_running_loop().create_future()
        self._create_waiter = (eid, fut)
        self._waiters[eid] = fut
        await self._send({"type": "response.create", "event_id": eid, "response": resp})
        return await self._await(fut, "response.created")

    async def cancel(self, response_id: Optional[str] = None) -> None:
        """``response.cancel`` (PROTOCOL.md §7.3). Races (nothing active) are swallowed."""
        ev: dict[str, Any] = {"type": "response.cancel", "event_id": self._new_event_id()}
        if response_id:
            ev["response_id"] = response_id
        self._quiet_ids.add(ev["event_id"])
        await self._send(ev)

    async def ack_playback(self, response_id: str, played_ms: int, *, item_id: Optional[str] = None,
                           truncate: bool = False) -> None:
        """``playback.ack``: report cumulative ms of ``response_id`` actually played (PROTOCOL.md §7.5)."""
        played_ms = int(played_ms)
        if played_ms < 0:
            raise ValueError("played_ms must be >= 0")
        ev: dict[str, Any] = {"type": "playback.ack", "response_id": response_id, "played_ms": played_ms}
        h = self._handles.get(response_id)
        item_id = item_id or (h.item_id if h else None)
        if item_id:
            ev["item_id"] = item_id
        if truncate:
            ev["truncate"] = True
        if h is not None:
            h.acked_ms = max(h.acked_ms, played_ms)
        await self._send(ev)

    async def truncate(self, item_id: str, audio_end_ms: int) -> dict:
        """``conversation.item.truncate``; returns ``conversation.item.truncated``."""
        return await self._request({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                                    "audio_end_ms": int(audio_end_ms)}, ("conversation.item.truncated",))

    async def update(self, **session_fields) -> dict:
        """``session.update`` with the given fields (GA or beta spellings; ``ref_audio`` may be a
        path, bytes or array). Returns the effective session. Raises :class:`DuplexError`."""
        if "ref_audio" in session_fields and session_fields["ref_audio"] is not None:
            session_fields["ref_audio"] = ref_audio_data_url(session_fields["ref_audio"])
        eid = self._new_event_id()
        fut = asyncio.get_running_loop().create_future()
        self._session_waiter = (eid, fut)
        self._waiters[eid] = fut
        await self._send({"type": "session.update", "event_id": eid, "session": session_fields})
        return await self._await(fut, "session.updated")

    async def heartbeat(self) -> dict:
        """``session.heartbeat``; returns ``session.heartbeat_ack``."""
        return await self._request({"type": "session.heartbeat"}, ("session.heartbeat_ack",))

    async def send_event(self, event: dict) -> None:
        """Send any client event as is (an ``event_id`` is added when missing)."""
        await self._send(dict(event))

    def events(self) -> AsyncIterator[dict]:
        """Every server event (GA names, dicts), in order, from ``session.created`` on. Single
        consumer. Ends after ``session.closed``/close; raises :class:`DuplexConnectionError` on
        transport loss. Unread events beyond ``max_buffered_events`` are dropped oldest-first."""
        return self._events

    def responses(self) -> AsyncIterator[ResponseHandle]:
        """A :class:`ResponseHandle` per ``response.created`` (model-, client- and VAD-triggered)."""
        return self._responses

    @property
    def active_response(self) -> Optional[ResponseHandle]:
        return self._active

    def response(self, response_id: str) -> Optional[ResponseHandle]:
        return self._handles.get(response_id)

    # ------------------------------------------------------------------ internals: sending/waiting
    @staticmethod
    def _new_event_id() -> str:
        return "cevt_" + secrets.token_hex(8)

    async def _send(self, event: dict) -> None:
        if self._failure is not None:
            raise self._failure
        if self._released:
            raise DuplexConnectionError("the client is closed", code="client_closed")
        event.setdefault("event_id", self._new_event_id())
        async with self._send_lock:
            await self._transmit(event)

    async def _request(self, event: dict, reply_types: tuple[str, ...]) -> dict:
        eid = self._new_event_id()
        event["event_id"] = eid
        fut = asyncio.get_running_loop().create_future()
        self._waiters[eid] = fut
        self._typed_waiters.setdefault(reply_types[0], collections.deque()).append((eid, fut))
        await self._send(event)
        return await self._await(fut, reply_types[0])

    @property
    def _typed_waiters(self) -> dict:
        if not hasattr(self, "_tw"):
            self._tw: dict[str, collections.deque] = {}
        return self._tw

    async def _await(self, fut: asyncio.Future, what: str) -> Any:
        """The reply ``fut`` carries, within ``request_timeout_s`` (:class:`DuplexTimeout`).

        ``asyncio.wait`` rather than ``wait_for(shield(fut))``: on Python 3.11 ``wait_for`` drops a
        cancellation of the caller when the reply lands in the same loop iteration; this never does.
        """
        if not await wait_done(fut, self.options.request_timeout_s):
            raise DuplexTimeout(f"no {what} within {self.options.request_timeout_s} s")
        return fut.result()

    @staticmethod
    def _resolve(fut: Optional[asyncio.Future], value: Any = None, exc: Optional[BaseException] = None) -> None:
        if fut is None or fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: a caller that timed out must not log noise
        else:
            fut.set_result(value)

    # ------------------------------------------------------------------ internals: receiving
    def _normalize(self, ev: dict) -> Optional[dict]:
        from duplexkit.protocol import BETA_EVENT_ALIASES

        t = ev.get("type")
        if t in ("conversation.item.created", "conversation.item.added"):
            item_id = (ev.get("item") or {}).get("id")
            if item_id and item_id in self._items_added:
                return None  # the second of created/added for one item is ignored (§2.1)
        if isinstance(t, str) and t in BETA_EVENT_ALIASES:
            ev = {**ev, "type": BETA_EVENT_ALIASES[t]}
        return ev

    def _on_server_event(self, ev: dict) -> None:
        """Handle one server event (already a dict). Never raises."""
        try:
            self._dispatch(ev)
        except Exception:  # pragma: no cover - a client bug must not kill the transport loop
            logger.exception("client failed to handle %r", ev.get("type"))

    def _epoch_from(self, ev: dict) -> Optional[int]:
        for src in (ev, ev.get("metadata") or {}, ev.get("response") or {}, ev.get("session") or {}):
            if isinstance(src, dict) and isinstance(src.get("epoch"), int):
                return src["epoch"]
        md = (ev.get("response") or {}).get("metadata")
        if isinstance(md, dict):
            try:
                return int(md.get("epoch"))
            except (TypeError, ValueError):
                return None
        return None

    def _dispatch(self, ev: dict) -> None:
        ev = self._normalize(ev)
        if ev is None:
            return
        t = ev.get("type")
        seq = ev.get("server_event_seq")
        if isinstance(seq, int):
            self.last_server_event_seq = max(self.last_server_event_seq, seq)
        ep = self._epoch_from(ev)
        if ep is not None and ep > self.epoch:
            self.epoch = ep
        rid = ev.get("response_id") or (ev.get("response") or {}).get("id")
        h = self._handles.get(rid) if rid else None
        if h is None and t in ("conversation.item.added", "conversation.item.done"):
            item = ev.get("item") or {}
            if item.get("role") == "assistant":
                iid = item.get("id")
                h = next((x for x in self._handles.values() if x.item_id and x.item_id == iid), None)
                if h is None and t == "conversation.item.added" and self._active is not None \
                        and self._active.item_id is None:
                    h = self._active

        if t in ("session.created", "session.updated"):
            self.session = ev.get("session") or {}
            self.session_id = self.session.get("id") or self.session_id
            sw = self._session_waiter
            if sw is not None:
                self._session_waiter = None
                self._waiters.pop(sw[0], None)
                self._resolve(sw[1], self.session)
        elif t == "error":
            self._on_error(ev)
        elif t == "session.closed":
            # the session is over: mark the client closed now (the close frame may come later;
            # the remote client then replaces close_code with the code it read)
            self.close_reason = ev.get("reason")
            self.closed = True
            if self.close_code is None:
                self.close_code = CLOSE_CODES.get(str(self.close_reason), 1000)
            self._closed_event().set()
        elif t == "conversation.item.added":
            item = ev.get("item") or {}
            if item.get("id"):
                self._items_added.add(item["id"])
            if item.get("role") == "assistant" and self._active is not None and self._active.item_id is None:
                self._active.item_id = item.get("id")
        elif t == "response.created":
            h = ResponseHandle(self, ev)
            self._handles[h.id] = h
            if len(self._handles) > MAX_KEPT_RESPONSES:  # forget the oldest finished handles
                for old in [k for k, v in self._handles.items() if not v.active][:-MAX_KEPT_RESPONSES // 2]:
                    del self._handles[old]
            self._active = h
            self._responses.put(h)
            cw = self._create_waiter
            if cw is not None and h.trigger in (None, "client"):
                self._create_waiter = None
                self._waiters.pop(cw[0], None)
                self._resolve(cw[1], h)
        elif t == "response.output_item.added" and h is not None:
            h.item_id = h.item_id or (ev.get("item") or {}).get("id")
        elif t == "response.output_audio.delta" and h is not None and h.active:
            pcm = _decode_pcm16(ev.get("delta") or "")
            h.item_id = h.item_id or ev.get("item_id")
            h._audio_delta(pcm)
            player = self.options.player
            if player is not None:
                player.enqueue(h.id, pcm)
        elif t == "response.output_audio_transcript.delta" and h is not None and h.active:
            h.transcript += ev.get("delta") or ""
        elif t == "response.output_audio_transcript.done" and h is not None:
            if isinstance(ev.get("transcript"), str):
                h.transcript = ev["transcript"]
        elif t == "response.output_text.delta" and h is not None and h.active:
            h.text += ev.get("delta") or ""
        elif t == "response.output_text.done" and h is not None:
            if isinstance(ev.get("text"), str):
                h.text = ev["text"]
        elif t == "response.listen" and h is not None:
            h.decision = "listen"
        elif t == "response.done" and h is not None:
            h.events.append(ev)
            h._finish(ev)
            if self._active is h:
                self._active = None
            if self.options.auto_ack and h.audio_samples and h.status == "completed":
                self._spawn(self._ack_done(h))
        if h is not None and t != "response.done":
            # the decoded audio is kept once (audio_array()); the event keeps its size, not its payload
            h.events.append({**ev, "delta": f"<{h.chunk_sizes[-1]} samples>"}
                            if t == "response.output_audio.delta" and h.chunk_sizes else ev)
        if t == "input_audio_buffer.speech_stopped" and ev.get("item_id"):
            self._vad_stopped_items.add(ev["item_id"])
        # typed waiters (commit, clear, truncate, heartbeat); a commit that follows a VAD
        # speech_stopped of the same item is the server's automatic commit, not our reply
        q = self._typed_waiters.get(t)
        if q and not (t == "input_audio_buffer.committed" and ev.get("item_id") in self._vad_stopped_items):
            eid, fut = q.popleft()
            self._waiters.pop(eid, None)
            self._resolve(fut, ev)
        self._events.put(ev)
        self.events_dropped = self._events.dropped
        if t == "session.closed":
            self._finish_all(None)

    def _on_error(self, ev: dict) -> None:
        err = ev.get("error") or {}
        ceid = err.get("event_id")
        code = err.get("code")
        if ceid and ceid in self._quiet_ids and code in _BENIGN_ERRORS:
            self._quiet_ids.discard(ceid)
            return  # cancel race: swallowed (PROTOCOL.md §7.3)
        if ceid and ceid == self._init_event_id:
            # the initial session.update was rejected; if session.created already resolved
            # connect()'s future, connect() still raises this (it has not returned yet)
            self._init_error = DuplexError.from_event(ev)
        if ceid and ceid in self._waiters:
            fut = self._waiters.pop(ceid)
            if self._session_waiter and self._session_waiter[0] == ceid:
                self._session_waiter = None
            if self._create_waiter and self._create_waiter[0] == ceid:
                self._create_waiter = None
            for q in self._typed_waiters.values():
                for pair in list(q):
                    if pair[0] == ceid:
                        q.remove(pair)
            self._resolve(fut, exc=DuplexError.from_event(ev))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        if not hasattr(self, "_bg"):
            self._bg: set = set()
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _ack_done(self, h: ResponseHandle) -> None:
        played = self._played_ms(h)
        if played > h.acked_ms:
            try:
                await self.ack_playback(h.id, played)
            except DuplexError:
                pass

    def _played_ms(self, h: ResponseHandle) -> int:
        player = self.options.player
        if player is not None:
            return int(player.played_ms(h.id))
        if h.first_audio_at is None:
            return 0
        if h.status is not None and h.status == "completed":
            return h.audio_ms
        # virtual speaker: real-time playback since the first audio delta, capped at what arrived
        return min(h.audio_ms, int((time.monotonic() - h.first_audio_at) * 1000))

    # ------------------------------------------------------------------ local barge-in
    async def _local_vad(self, x: np.ndarray) -> None:
        from duplexkit.audio import StreamingVAD, VadConfig

        if self._vad is None:
            cfg = self.options.barge_in if isinstance(self.options.barge_in, VadConfig) else VadConfig()
            self._vad = StreamingVAD(cfg)
            if self.options.input_rate != 16_000:
                from duplexkit.audio import StreamResampler
                self._vad_resampler = StreamResampler(self.options.input_rate, 16_000)
        if self._vad_resampler is not None:
            x = self._vad_resampler.process(x)
        for vev in self._vad.process(x):
            if vev.kind == "speech_started":
                await self.barge_in()

    async def barge_in(self) -> Optional[ResponseHandle]:
        """Interrupt the active response now (what local VAD does on speech): ``response.cancel``,
        flush the player, ``playback.ack{played_ms, truncate:true}`` of what was heard. Returns the
        interrupted handle, or None when nothing was active."""
        h = self._active
        if h is None or not h.active:
            return None
        self.barge_ins += 1
        played = self._played_ms(h)
        await self.cancel(h.id)
        player = self.options.player
        if player is not None:
            player.flush(h.id)
        await self.ack_playback(h.id, played, truncate=True)
        return h

    # ------------------------------------------------------------------ failure
    def _finish_all(self, exc: Optional[BaseException]) -> None:
        for eid, fut in list(self._waiters.items()):
            self._resolve(fut, exc=exc or DuplexConnectionError("the session closed", code="session_closed"))
        self._waiters.clear()
        for w in (self._session_waiter, self._create_waiter):
            if w is not None:
                self._resolve(w[1], exc=exc or DuplexConnectionError("the session closed", code="session_closed"))
        self._session_waiter = self._create_waiter = None
        for h in self._handles.values():
            if h.active:
                h._fail(exc or DuplexConnectionError(f"the session closed before response {h.id} ended",
                                                     code="session_closed"))
        self._events.finish(exc)
        self._responses.finish(exc)
        self._closed_event().set()

    def _on_transport_lost(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc if isinstance(exc, DuplexConnectionError) else DuplexConnectionError(str(exc))
        self._finish_all(self._failure)

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


def _decode_pcm16(b64: str) -> np.ndarray:
    from duplexkit.audio import pcm16_to_float32

    data = base64.b64decode(b64) if b64 else b""
    if len(data) % 2:
        data = data[:-1]
    return pcm16_to_float32(data)
