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

The trim reaches only memory that glibc's malloc manages. CPython's own small-object allocator
(pymalloc: every object or buffer of <= 512 bytes) carves 1 MiB arenas from the OS and gives an arena
back only when every object in it is dead; a few objects that outlive a burst (a metric's new value,
a timer handle, a cached header) are scattered over the arenas the burst filled and keep each one
mapped with its free pools resident (measured: 5 extra arenas, ~5 MiB of free pools, after
16 sessions x 120 s; benchmarks/NOTES.md). :func:`use_malloc_for_objects` re-executes the server with
``PYTHONMALLOC=malloc`` (CPython's documented switch, https://docs.python.org/3/using/cmdline.html#envvar-PYTHONMALLOC),
so that small objects also come from glibc's malloc and ``malloc_trim`` gives their free pages back
one 4 KiB page at a time.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import sys
import time
from typing import Optional

logger = logging.getLogger("duplexkit.memory")

__all__ = ["malloc_trim", "schedule_trim", "cuda_memory", "use_malloc_for_objects", "ALLOCATOR_ENV"]

#: CPython's allocator switch (read once at interpreter start-up).
ALLOCATOR_ENV = "PYTHONMALLOC"

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


def use_malloc_for_objects(environ: Optional[dict] = None, execve=None) -> bool:
    """Re-execute this process with ``PYTHONMALLOC=malloc`` so that Python's small objects come from
    glibc's malloc, which :func:`malloc_trim` can give back page by page (see the module docstring).

    Returns False, and does nothing, when it does not apply: not glibc (no ``malloc_trim``), the
    environment is ignored (``python -E``/``-I``), or ``PYTHONMALLOC`` is already set by anyone (so
    the re-executed process does not loop, and an operator keeps pymalloc with
    ``PYTHONMALLOC=pymalloc``). Otherwise it does not return: the interpreter is replaced (same pid,
    same open descriptors except Python's non-inheritable ones, same arguments: ``sys.orig_argv``).
    Call it first thing, before threads start or sockets are bound. ``environ``/``execve`` are for
    tests (default ``os.environ``/``os.execve``).

    Raises:
        OSError: the interpreter could not be executed.
    """
    env = os.environ if environ is None else environ
    if _libc is None or sys.flags.ignore_environment or env.get(ALLOCATOR_ENV):
        return False
    logger.debug("re-executing with %s=malloc", ALLOCATOR_ENV)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    (execve or os.execve)(sys.executable, list(sys.orig_argv), dict(env, **{ALLOCATOR_ENV: "malloc"}))
    return True  # only when a test's execve returns


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
