"""The gate between CUDA-graph captures and every other GPU launch of the engine's stage threads.

The engine runs the thinker, the talker and Code2Wav on three threads that share one CUDA context
and the legacy default stream (with ``DUPLEXKIT_THINKER_STREAM=1`` the thinker launches on a stream of
its own, :mod:`duplexkit.engine.thinker_stream`; the gate applies to it all the same). A CUDA graph may be captured lazily while the engine serves (a batch
size or length bucket met for the first time). While a capture is open on one thread, a launch or an
allocation on another thread's legacy stream fails (``cudaErrorStreamCaptureImplicit`` /
"operation not permitted when stream is capturing"), a draw from the default CUDA generator fails
("Offset increment outside graph capture"), and the broken capture leaves the graph pool recording
("beginAllocateToPool: already recording to mempool_id") so that every later capture fails too.
Measured on the H200 (benchmarks/results/2026-12-01-e2e-latency-h200.md, the third run): one lazy capture at 8 sessions broke the
engine for the rest of the process.

:class:`CaptureGate` is a readers-writer gate. Stage work holds it *shared* (any number of threads
at once: the stages never wait for each other through it); a capture holds it *exclusive*, which waits
until no other thread is inside shared work and keeps new shared work out until the capture ends
(writer preference, so a capture is not starved by busy stages). A thread that already holds shared
work and starts a capture gives its own shares up while it waits (no upgrade deadlock: two capturing
threads never wait on each other's shares) and takes them back when the capture ends. Both sides are
re-entrant per thread. The gate is pure Python (no torch import).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["CaptureGate", "CAPTURE_GATE"]


class CaptureGate:
    """Readers-writer gate: :meth:`shared` for GPU work, :meth:`exclusive` for a graph capture.

    Both are context managers, re-entrant within a thread; a shared hold taken inside this thread's
    own exclusive hold does not wait. Never raises on its own.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0  # shares held by threads that are not the writer
        self._writer: int | None = None  # thread id holding the exclusive side
        self._waiting_writers = 0
        self._local = threading.local()

    def _tls(self):
        t = self._local
        if not hasattr(t, "counted"):
            t.counted = []  # one bool per shared hold of this thread: counted in self._shared
            t.depth = 0  # exclusive re-entry depth
            t.dropped = 0  # this thread's shares given up while it holds the exclusive side
        return t

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the gate for GPU work: waits only while a capture runs or waits on another thread."""
        t = self._tls()
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                t.counted.append(False)
            else:
                if not t.counted:  # a nested share never waits (it would wait for itself)
                    while self._writer is not None or self._waiting_writers:
                        self._cond.wait()
                t.counted.append(True)
                self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                if t.counted.pop():
                    self._shared -= 1
                    if self._shared == 0:
                        self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the gate alone (a capture): waits until no other thread holds shared work."""
        t = self._tls()
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                t.depth += 1
            else:
                mine = sum(1 for c in t.counted if c)
                self._shared -= mine  # give this thread's own shares up while waiting
                self._waiting_writers += 1
                if mine:
                    self._cond.notify_all()
                try:
                    while self._writer is not None or self._shared > 0:
                        self._cond.wait()
                except BaseException:  # interrupted while waiting: take the shares back
                    self._shared += mine
                    raise
                finally:
                    self._waiting_writers -= 1
                    self._cond.notify_all()
                self._writer = me
                t.depth = 1
                t.dropped = mine
        try:
            yield
        finally:
            with self._cond:
                t.depth -= 1
                if t.depth == 0:
                    self._writer = None
                    self._shared += t.dropped
                    t.dropped = 0
                    self._cond.notify_all()


CAPTURE_GATE = CaptureGate()
"""The process-wide gate (one CUDA context per process)."""
