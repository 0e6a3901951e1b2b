"""Client-side playback buffer: per-response queues, flush on cancel, played-ms cursor.

The player (a :class:`~duplexkit.audio.SpeakerStream` callback, or any loop) calls
:meth:`PlaybackBuffer.read` for each output block; that advances the played cursor of the response
the samples came from. After a barge-in the client calls :meth:`PlaybackBuffer.flush` and reports
``played_ms(response_id)`` to the server (PROTOCOL.md §7.5 playback truth).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

import numpy as np

__all__ = ["PlaybackBuffer", "OUTPUT_RATE"]

#: Output audio rate, Hz (PROTOCOL.md §6.2: always 24 kHz mono).
OUTPUT_RATE = 24000


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
        sample_rate: Hz (24 000, PROTOCOL.md §6.2).
    """

    def __init__(self, sample_rate: int = OUTPUT_RATE) -> None:
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        self.sample_rate = int(sample_rate)
        self._queues: OrderedDict[str, _Queue] = OrderedDict()
        self._lock = threading.Lock()
        self.underrun_samples = 0  #: zeros handed out by read() because nothing was queued

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
        with self._lock:
            for q in self._queues.values():
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
                if filled == n:
                    break
            self.underrun_samples += n - filled
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
