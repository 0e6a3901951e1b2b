"""The pieces of the client API that are not the client itself: options, the response handle (a
:class:`~duplexkit.clients.state.ResponseRecord` with asyncio iterators), reference-voice loading,
and the two asyncio helpers the shells share (a never-losing wait and a single-consumer stream).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Protocol, Union

import numpy as np

from duplexkit.errors import DuplexConnectionError, DuplexTimeout

from .records import ResponseRecord

if TYPE_CHECKING:  # duplexkit.audio is imported when first used
    from duplexkit.audio.playback import Player

__all__ = ["ClientOptions", "ResponseHandle", "ResponseOwner", "ref_audio_data_url", "wait_done"]


class ResponseOwner(Protocol):
    """What a :class:`ResponseHandle` needs of its client (a
    :class:`~duplexkit.clients.BaseDuplexClient`): its player and its ``cancel``."""

    player: Player

    async def cancel(self, response_id: Optional[str] = None) -> None:
        """Send ``response.cancel`` for ``response_id``."""


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
    """A reference voice as a ``data:audio/wav;base64,…`` URL (docs/protocol.md §8.1).

    Args:
        ref: a WAV path, WAV file bytes, a float32 [n] array at ``rate`` Hz, an ``(array, rate)``
            tuple, or an existing data URL / ``file://`` / server-side path string. Strings that
            are not an existing local file are passed through unchanged (server-side allow-listed
            paths, docs/protocol.md §8.1).
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
        input_rate: rate in Hz of the audio given to :meth:`BaseDuplexClient.send_audio` (pcm16
            bytes or float32 arrays) unless a call passes ``rate``. It is also declared as the
            session's input rate when ``session`` gives no input format. Whatever the session
            declares later (``update()``), audio is resampled and encoded to match.
        player: a :class:`~duplexkit.audio.Player` (a :class:`~duplexkit.audio.PlaybackBuffer` read
            by your output loop, or a :class:`~duplexkit.audio.SpeakerStream`); None = a
            :class:`~duplexkit.audio.VirtualPlayer`, a speaker playing in real time.
        auto_ack: report playback truth automatically (``playback.ack``; docs/concepts.md).
        barge_in: local barge-in on the audio passed to ``send_audio`` (True, or a ``VadConfig``).
        echo: echo control for speakers without headphones: None/"off", "gate", "aec", "auto"
            (aec when ``duplexkit[echo]`` is installed, else gate) or an
            :class:`~duplexkit.audio.EchoConfig` (docs/concepts.md "Echo"). The player's rendered
            audio is the reference; the microphone audio is echo-cancelled (aec) before it is sent,
            and local barge-in needs speech well above the echo level while the answer is audible.
        request_timeout_s: how long a call waits for its answer before :class:`DuplexTimeout`.
        max_buffered_events: ``events()`` keeps at most this many unread events (oldest dropped,
            counted in ``events_dropped``).
    """

    session: Optional[dict] = None
    ref_audio: Any = None
    input_rate: int = 16_000
    player: Optional[Player] = None
    auto_ack: bool = True
    barge_in: Any = False
    echo: Any = None
    request_timeout_s: float = 30.0
    max_buffered_events: int = 4096


_CLOSED = object()


class _EventQueue:
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


class ResponseHandle(ResponseRecord):
    """One response (docs/protocol.md §5.3), created on ``response.created``: a
    :class:`~duplexkit.clients.state.ResponseRecord` (identity, text, status, ``generating``,
    ``audible``, ``played_ms``) plus the asyncio side: an audio iterator and ``wait()``.

    Attributes (besides the record's): ``created_at``, ``first_audio_at``, ``done_at`` (monotonic
    seconds).
    """

    def __init__(self, client: ResponseOwner, event: Any) -> None:
        super().__init__(event)
        self._client = client
        self.created_at = time.monotonic()
        self.first_audio_at: Optional[float] = None
        self.done_at: Optional[float] = None
        self._audio = _EventQueue()
        self._chunks: list[np.ndarray] = []
        self._done = asyncio.Event()
        self._error: Optional[BaseException] = None

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

    async def wait(self, timeout: Optional[float] = None) -> Any:
        """Wait for ``response.done``; returns it (typed). Raises :class:`DuplexTimeout` after
        ``timeout`` seconds, :class:`DuplexConnectionError` if the connection drops first."""
        if not self._done.is_set() and not await wait_done(self._done.wait(), timeout):
            raise DuplexTimeout(f"response {self.id} not done after {timeout} s")
        if self._error is not None and self.final is None:
            raise self._error
        return self.final

    done = wait

    async def wait_heard(self, timeout: Optional[float] = None) -> int:
        """Wait until playback of this response is settled (fully played, or flushed by a
        barge-in/cancel); returns its ``played_ms``. Raises :class:`DuplexTimeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            await self.wait(timeout)
        except DuplexConnectionError:
            pass  # generation ended with the connection; what arrived still plays
        while not self.heard_final and self.audio_samples and \
                (self.audible or self._client.player.queued_samples(self.id)):
            if deadline is not None and time.monotonic() > deadline:
                raise DuplexTimeout(f"response {self.id} still playing after {timeout} s")
            await asyncio.sleep(0.01)
        return self.played_ms

    async def cancel(self) -> None:
        """Cancel this response while it generates (no-op afterwards; see ``barge_in`` for audio
        that is still playing)."""
        if self.generating:
            await self._client.cancel(self.id)

    # -- fed by the client shell ------------------------------------------------------------
    def _on_audio(self, pcm: np.ndarray) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
        self._chunks.append(pcm)
        self._audio.put(pcm)

    def _on_end(self, error: Optional[BaseException]) -> None:
        if error is not None and self.final is None:
            self._error = error
            self._audio.finish(error)
        else:
            self.done_at = time.monotonic()
            self._audio.finish()
        self._done.set()
