"""Client-side playback: the :class:`Player` protocol, per-response queues and playback clocks.

A *player* is what the clients feed with the assistant's audio and ask what was actually heard
(docs/protocol.md §7.5 playback truth). Three implementations ship:

* :class:`PlaybackBuffer`: per-response queues read by any output loop; :meth:`PlaybackBuffer.read`
  hands the next block to the device and advances the played cursor of the response the samples
  came from. Its clock is the output device's: samples read = samples played.
* :class:`VirtualPlayer`: a :class:`PlaybackBuffer` read in real time by an asyncio task (the
  default player of the clients when none is given: a speaker that plays in real time, for WAV
  demos, tests and headless agents).
* :class:`~duplexkit.audio.SpeakerStream`: the sounddevice speaker, which owns a
  :class:`PlaybackBuffer` and reads it in the PortAudio callback.

After a barge-in the client calls :meth:`Player.flush` and reports ``played_ms(response_id)``;
when a response has played out, :meth:`Player.on_drained` callbacks tell the client to report it
as fully heard at that moment. :class:`Player` is everything the clients need; two optional
capabilities are protocols of their own: :class:`RenderingPlayer` (``on_render``, needed for echo
control) and :class:`ForgettingPlayer` (``forget``). All three shipped players have both.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Callable, Optional, Protocol, runtime_checkable

import numpy as np

from duplexkit.engine.api import OUTPUT_SAMPLE_RATE

__all__ = ["Player", "RenderingPlayer", "ForgettingPlayer", "PlaybackBuffer", "VirtualPlayer", "OUTPUT_RATE"]

#: Output audio rate, Hz (docs/protocol.md §6.2: always 24 kHz mono; ``duplexkit.engine.api.OUTPUT_SAMPLE_RATE``).
OUTPUT_RATE = OUTPUT_SAMPLE_RATE


@runtime_checkable
class Player(Protocol):
    """What a client needs of a speaker (float32 mono at ``sample_rate`` Hz, 24 000 by default).

    All methods are thread-safe; ``on_drained`` callbacks may run on the audio thread.
    """

    sample_rate: int

    def enqueue(self, response_id: str, pcm: np.ndarray) -> int:
        """Queue float32 [n] audio of ``response_id``; returns samples queued (0 once flushed)."""

    def flush(self, response_id: Optional[str] = None) -> int:
        """Drop the unplayed audio of one response (all when ``None``); returns samples dropped.
        Later audio of a flushed response is dropped on enqueue."""

    def played_ms(self, response_id: str) -> int:
        """Integer ms of ``response_id`` played so far (floored; 0 if unknown)."""

    def queued_samples(self, response_id: Optional[str] = None) -> int:
        """Unplayed samples of one response, or of all when ``None``."""

    def on_drained(self, callback: Callable[[str], None]) -> None:
        """Register ``callback(response_id)``: called each time the queued audio of a response has
        all been played (its queue ran empty after holding audio)."""


@runtime_checkable
class RenderingPlayer(Player, Protocol):
    """A :class:`Player` that reports every block it plays: what echo control needs (the clients'
    ``echo`` option other than off; docs/clients.md, "Players"). A client given ``echo`` and a
    player without ``on_render`` raises TypeError at construction."""

    def on_render(self, callback: Callable[[np.ndarray], None]) -> None:
        """Register ``callback(block)``: each block handed to the output (float32 [n] at
        ``sample_rate``), in play order; may run on the audio thread."""


@runtime_checkable
class ForgettingPlayer(Player, Protocol):
    """A :class:`Player` that can drop the bookkeeping of an old response. Optional: the clients
    call it (when present) for responses they stop keeping, so a long session's player stays small."""

    def forget(self, response_id: str) -> None:
        """Remove everything kept for ``response_id`` (its played cursor included)."""


class _Queue:
    __slots__ = ("chunks", "head", "queued", "played", "closed")

    def __init__(self) -> None:
        self.chunks: deque[np.ndarray] = deque()
        self.head = 0  # read offset into chunks[0]
        self.queued = 0  # samples waiting
        self.played = 0  # samples handed to the player
        self.closed = False  # flushed: further enqueues are dropped


class PlaybackBuffer:
    """Thread-safe per-response playback queues (float32 mono at ``sample_rate``, default 24 kHz).

    Responses play in the order their first chunk was enqueued; a response's samples play in order.
    Times are integer ms, floored: ``samples * 1000 // sample_rate``.

    Args:
        sample_rate: Hz (24 000, docs/protocol.md §6.2).
    """

    def __init__(self, sample_rate: int = OUTPUT_RATE) -> None:
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        self.sample_rate = int(sample_rate)
        self._queues: OrderedDict[str, _Queue] = OrderedDict()
        self._lock = threading.Lock()
        self._drained_callbacks: list[Callable[[str], None]] = []
        self._render_callbacks: list[Callable[[np.ndarray], None]] = []
        self.underrun_samples = 0  #: zeros handed out by read() because nothing was queued

    def on_drained(self, callback: Callable[[str], None]) -> None:
        """Register ``callback(response_id)``, called (from the thread that calls :meth:`read`,
        outside the lock) whenever a response's queue runs empty by playing its last sample."""
        self._drained_callbacks.append(callback)

    def on_render(self, callback: Callable[[np.ndarray], None]) -> None:
        """Register ``callback(block)``: every block :meth:`read` hands out (float32 [n] at
        ``sample_rate``, zeros included), in play order. The echo canceller's reference signal."""
        self._render_callbacks.append(callback)

    def _ms(self, samples: int) -> int:
        return samples * 1000 // self.sample_rate

    def enqueue(self, response_id: str, pcm: np.ndarray) -> int:
        """Queue float32 [n] mono audio of ``response_id``.

        Returns the samples queued: ``n``, or 0 if the response was already flushed (late audio of a
        cancelled response is dropped, never played). Raises ValueError for non-1-D audio.
        """
        a = np.asarray(pcm, dtype=np.float32)
        if a.ndim != 1:
            raise ValueError(f"expected mono audio of shape [n], got shape {a.shape}")
        with self._lock:
            q = self._queues.get(response_id)
            if q is None:
                q = self._queues[response_id] = _Queue()
            if q.closed:
                return 0
            if a.size:
                q.chunks.append(a.copy())
                q.queued += a.size
            return int(a.size)

    def read(self, n: int) -> np.ndarray:
        """Take the next ``n`` samples for the output device: float32 [n], zero-filled when short.

        Advances the played cursor of every response the samples came from.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out = np.zeros(n, np.float32)
        filled = 0
        drained: list[str] = []
        with self._lock:
            for rid, q in self._queues.items():
                had = q.queued > 0
                while filled < n and q.chunks:
                    c = q.chunks[0]
                    take = min(n - filled, c.size - q.head)
                    out[filled : filled + take] = c[q.head : q.head + take]
                    filled += take
                    q.head += take
                    q.queued -= take
                    q.played += take
                    if q.head == c.size:
                        q.chunks.popleft()
                        q.head = 0
                if had and q.queued == 0:
                    drained.append(rid)
                if filled == n:
                    break
            self.underrun_samples += n - filled
        for cb in self._render_callbacks:
            cb(out)
        for rid in drained:
            for cb in self._drained_callbacks:
                cb(rid)
        return out

    def flush(self, response_id: str | None = None) -> int:
        """Drop the unplayed audio of ``response_id`` (or of every response when ``None``).

        Later :meth:`enqueue` calls for a flushed response are ignored. Returns dropped samples.
        """
        with self._lock:
            ids = list(self._queues) if response_id is None else [response_id]
            dropped = 0
            for rid in ids:
                q = self._queues.get(rid)
                if q is None:
                    q = self._queues[rid] = _Queue()
                dropped += q.queued
                q.chunks.clear()
                q.head = 0
                q.queued = 0
                q.closed = True
            return dropped

    def played_samples(self, response_id: str) -> int:
        """Samples of ``response_id`` handed to the player so far (0 if unknown)."""
        with self._lock:
            q = self._queues.get(response_id)
            return q.played if q else 0

    def played_ms(self, response_id: str) -> int:
        """Played ms of ``response_id`` (integer, floored; 0 if unknown)."""
        return self._ms(self.played_samples(response_id))

    def queued_samples(self, response_id: str | None = None) -> int:
        """Unplayed samples of one response, or of all when ``None``."""
        with self._lock:
            if response_id is None:
                return sum(q.queued for q in self._queues.values())
            q = self._queues.get(response_id)
            return q.queued if q else 0

    @property
    def pending_ms(self) -> int:
        """Unplayed audio over all responses, integer ms (floored)."""
        return self._ms(self.queued_samples())

    @property
    def current_response(self) -> str | None:
        """The response whose audio plays next (first with queued samples), or ``None``."""
        with self._lock:
            for rid, q in self._queues.items():
                if q.queued:
                    return rid
            return None

    def forget(self, response_id: str) -> None:
        """Remove all bookkeeping of a response (its played cursor included)."""
        with self._lock:
            self._queues.pop(response_id, None)


class VirtualPlayer(PlaybackBuffer):
    """A :class:`PlaybackBuffer` played by a virtual real-time speaker (no audio device).

    A speaker that plays in real time from :meth:`start` on: every ``block_ms`` an asyncio task
    reads exactly the samples that real time has made due since the start (no drift), so
    ``played_ms`` follows the wall clock the way a sound card's would, including underruns
    (silence while nothing is queued). :meth:`advance` does one such step; tests may call it with
    their own ``clock``.

    Args:
        sample_rate: Hz (default 24 000, docs/protocol.md §6.2).
        block_ms: speaker block, ms (default 20: a flush is heard within one block).
        clock: seconds, monotonic (default :func:`time.monotonic`).
    """

    def __init__(self, sample_rate: int = OUTPUT_RATE, block_ms: int = 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(sample_rate)
        if block_ms <= 0:
            raise ValueError(f"block_ms must be positive, got {block_ms}")
        self.block_ms = int(block_ms)
        self.clock = clock
        self._t0: Optional[float] = None
        self._read_total = 0
        self._task = None
        self.output: Optional[list] = None  #: when a list, every block read is appended (tests)

    def advance(self) -> np.ndarray:
        """Play what real time has made due since the last call: float32 [k] (k >= 0)."""
        now = self.clock()
        if self._t0 is None:
            self._t0 = now
        due = int((now - self._t0) * self.sample_rate) - self._read_total
        if due <= 0:
            return np.zeros(0, np.float32)
        self._read_total += due
        out = self.read(due)
        if self.output is not None:
            self.output.append(out)
        return out

    def start(self) -> "VirtualPlayer":
        """Start the real-time reader task on the running asyncio loop (idempotent)."""
        import asyncio

        if self._task is None or self._task.done():
            self._t0 = None
            self._read_total = 0
            self._task = asyncio.get_running_loop().create_task(self._run(), name="duplexkit-virtual-player")
        return self

    async def _run(self) -> None:
        import asyncio

        while True:
            self.advance()
            await asyncio.sleep(self.block_ms / 1000)

    async def stop(self) -> None:
        """Stop the reader task (queued audio stays queued)."""
        import asyncio

        t, self._task = self._task, None
        if t is not None:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
