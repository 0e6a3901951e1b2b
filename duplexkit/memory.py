"""Give freed heap memory back to the OS after sessions end (issue 13, deliverable 6).

Used by the server after a session or chat request ends and by the engine process
(:mod:`duplexkit.engine.process_child`) after a stream closes.

A realtime session allocates many short-lived buffers (base64 text, PCM, numpy arrays); after a
burst of sessions glibc's malloc keeps the freed arenas mapped, so the server's RSS stays at its
high-water mark although its Python objects are back to baseline. ``malloc_trim(0)`` (glibc only)
returns the free pages. :func:`schedule_trim` runs it in a worker thread, at most once per
``min_interval_s`` (it walks every arena: a few ms), after the last of a burst of closes.

Before the trim a full ``gc.collect()`` runs on the event loop: a closed session's objects are
joined in reference cycles (connection, Session, driver, replay journal), which only the cyclic
collector frees, and it runs only after enough new allocations; on a server that went quiet after
a burst, the sessions' journals of base64 audio stayed allocated until the next burst (measured:
+345 % RSS after 64 sessions x 5 min, benchmarks/NOTES.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import sys
import time
from typing import Optional

logger = logging.getLogger("duplexkit.memory")

__all__ = ["malloc_trim", "schedule_trim", "cuda_memory"]

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        _libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        _libc = None

_last = 0.0
_pending: Optional[asyncio.TimerHandle] = None


def malloc_trim() -> bool:
    """``malloc_trim(0)``; True when memory was released, False when nothing was or not glibc."""
    if _libc is None:
        return False
    return bool(_libc.malloc_trim(0))


def schedule_trim(delay_s: float = 1.0, min_interval_s: float = 5.0) -> None:
    """Collect reference cycles, then trim the allocator (off the event loop), ``delay_s`` after the
    last call (debounced, at most once per ``min_interval_s``)."""
    global _pending
    loop = asyncio.get_running_loop()
    if _pending is not None:
        _pending.cancel()

    def fire() -> None:
        global _pending, _last
        _pending = None
        now = time.monotonic()
        if now - _last < min_interval_s:
            _pending = loop.call_later(min_interval_s - (now - _last), fire)
            return
        _last = now
        gc.collect()  # on the loop: finalizers of the freed cycles may touch loop objects
        if _libc is not None:
            loop.create_task(asyncio.to_thread(malloc_trim))

    _pending = loop.call_later(delay_s, fire)


def cuda_memory() -> dict:
    """This process's CUDA memory, ``{"cuda:N": {"allocated", "reserved", "total"}}`` in bytes, when
    torch is already imported and CUDA initialised; ``{}`` otherwise (never imports torch). Read by
    the server's ``duplexkit_gpu_memory_bytes`` in its own process, or in the engine process, which
    pushes it to the server."""
    torch = sys.modules.get("torch")
    if torch is None or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {f"cuda:{i}": {"allocated": torch.cuda.memory_allocated(i), "reserved": torch.cuda.memory_reserved(i),
                          "total": torch.cuda.get_device_properties(i).total_memory}
            for i in range(torch.cuda.device_count())}
