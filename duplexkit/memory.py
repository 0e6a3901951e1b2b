"""Give freed heap memory back to the OS after sessions end.

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
+345 % RSS after 64 sessions x 5 min, benchmarks/results/2026-12-01-server-load.md).

The trim reaches only memory that glibc's malloc manages. CPython's own small-object allocator
(pymalloc: every object or buffer of <= 512 bytes) carves 1 MiB arenas from the OS and gives an arena
back only when every object in it is dead; a few objects that outlive a burst (a metric's new value,
a timer handle, a cached header) are scattered over the arenas the burst filled and keep each one
mapped with its free pools resident (measured: 5 extra arenas, ~5 MiB of free pools, after
16 sessions x 120 s; benchmarks/results/2026-12-01-server-load.md). :func:`use_malloc_for_objects` re-executes the server with
``PYTHONMALLOC=malloc`` (CPython's documented switch, https://docs.python.org/3/using/cmdline.html#envvar-PYTHONMALLOC),
so that small objects also come from glibc's malloc and ``malloc_trim`` gives their free pages back
one 4 KiB page at a time.

What ``malloc_trim`` cannot give back is a page that still holds one live chunk (or a free chunk's
header). The brk heap grows with the load's high-water mark; the few allocations that outlive a soak
(a container's re-allocated storage, a C extension's handle, a thread's cached free chunks) land
anywhere in it, mostly in the region the peak added, one per page. :func:`fix_mmap_threshold` sets
glibc's ``M_MMAP_THRESHOLD`` to a fixed :data:`MMAP_THRESHOLD` (32 KiB) with ``mallopt(3)``, so that a
session's large buffers (1 s of 24 kHz output audio is a 64 000-character base64 string, kept in the
replay journal; its JSON frame; PCM and numpy arrays) are mmapped, and unmapped on free, instead of
growing the heap (one that fits a free heap chunk still takes it: the threshold decides how the heap
grows, not how it is reused). glibc's default threshold starts at 128 KiB and, each time a mmapped
chunk is freed, rises to that chunk's size (up to 32 MiB on 64-bit; "dynamic mmap threshold" in
mallopt(3), https://man7.org/linux/man-pages/man3/mallopt.3.html), after which even megabyte buffers
grow the heap. At 64 sessions x 5 min the journals' audio grew the heap by ~540 MiB. Measured in benchmarks/results/2026-12-01-server-load.md ("what pins the brk heap"). An operator's own setting wins:
nothing is changed when ``MALLOC_MMAP_THRESHOLD_`` is set or ``GLIBC_TUNABLES`` names
``glibc.malloc.mmap_threshold`` (glibc reads both at start, tunables(7)). Only the server process sets
it: the engine process keeps glibc's adaptive default, which suits torch's many same-sized CPU tensors
(a fixed threshold would mmap, fault in and unmap each one).

Most of what still pins heap pages after a load is free memory that caches hold on to: glibc's
per-thread tcache (up to 7 chunks per size class per thread, out of reach of ``malloc_trim``) and
numpy's small-block cache (up to 7 freed data blocks of each size under 1024 bytes, never released: a
session's short float32 audio frames). The re-executed server runs with the tcache off
(:func:`use_malloc_for_objects`, a glibc tunable), and :func:`numpy_without_block_cache` switches
numpy's array data to CPython's raw allocator through numpy's data-memory policy API (NEP 49), so that
those blocks are freed.
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

__all__ = ["malloc_trim", "schedule_trim", "cuda_memory", "use_malloc_for_objects", "fix_mmap_threshold",
           "numpy_without_block_cache", "ALLOCATOR_ENV", "MMAP_THRESHOLD", "NUMPY_HANDLER_NAME", "TCACHE_TUNABLE"]

#: CPython's allocator switch (read once at interpreter start-up).
ALLOCATOR_ENV = "PYTHONMALLOC"

#: The fixed mmap threshold the server sets, bytes: requests of at least this size are mmapped. Below
#: the 64 000-character base64 string of 1 s of 24 kHz PCM16 output audio (the bulk of a session's
#: replay journal), above a 100 ms input append's (4 268 characters). glibc's own floor is 0, its
#: ceiling 32 MiB (HEAP_MAX_SIZE / 2), its default 128 KiB before it adapts (mallopt(3)).
MMAP_THRESHOLD = 32 * 1024

#: The glibc tunable the re-executed server runs with: no per-thread cache of freed chunks (tunables(7)).
TCACHE_TUNABLE = "glibc.malloc.tcache_count=0"
#: Carries the operator's ``GLIBC_TUNABLES`` (maybe empty) through the re-execution, for the children.
_TUNABLES_SAVED = "DUPLEXKIT_OPERATOR_GLIBC_TUNABLES"

#: ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (glibc ``malloc.h``).
_M_MMAP_THRESHOLD = -3

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        _libc.malloc_trim.restype = ctypes.c_int
        _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc.mallopt.restype = ctypes.c_int
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
        # CPython's method cache (4096 slots) keeps a reference to the name string of each cached
        # attribute lookup; a library that looks a method up by a freshly built name keeps one such
        # string alive per slot it last filled (soxr: getattr(obj, f"process_{dtype}") for every
        # resampler, ~100 strings each on its own heap page after 64 sessions x 5 min,
        # benchmarks/results/2026-12-01-server-load.md). Clearing it costs a few lookups that refill it.
        sys._clear_type_cache()
        if _libc is not None:
            loop.create_task(asyncio.to_thread(malloc_trim))

    _pending = loop.call_later(delay_s, fire)


def use_malloc_for_objects(environ: Optional[dict] = None, execve=None) -> bool:
    """Re-execute this process with ``PYTHONMALLOC=malloc`` so that Python's small objects come from
    glibc's malloc, which :func:`malloc_trim` can give back page by page (see the module docstring),
    and with glibc's per-thread cache off (``glibc.malloc.tcache_count=0`` appended to
    ``GLIBC_TUNABLES``, tunables(7); the cache keeps up to 7 freed chunks of each size class per thread,
    out of reach of ``malloc_trim``: after a load they pinned about half of the heap pages left,
    benchmarks/results/2026-12-01-server-load.md). An operator's ``GLIBC_TUNABLES`` is kept and extended; one that names
    ``glibc.malloc.tcache_count`` is left as it is. glibc reads tunables at start only, so they go in
    the re-executed environment; the process's own children (the engine process) get the operator's
    ``GLIBC_TUNABLES`` back: the next call, in the re-executed process, restores it in ``os.environ``.

    Returns False, and does nothing else, when it does not apply: not glibc (no ``malloc_trim``), the
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
    if _TUNABLES_SAVED in env:  # the re-executed process: its children get the operator's tunables
        saved = env.pop(_TUNABLES_SAVED)
        if saved:
            env["GLIBC_TUNABLES"] = saved
        else:
            env.pop("GLIBC_TUNABLES", None)
    if _libc is None or sys.flags.ignore_environment or env.get(ALLOCATOR_ENV):
        return False
    logger.debug("re-executing with %s=malloc", ALLOCATOR_ENV)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    new = dict(env, **{ALLOCATOR_ENV: "malloc"})
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.tcache_count" not in tunables:
        new["GLIBC_TUNABLES"] = f"{tunables}:{TCACHE_TUNABLE}" if tunables else TCACHE_TUNABLE
        new[_TUNABLES_SAVED] = tunables
    # SIGINT and SIGTERM stay blocked across the exec (a blocked signal stays pending in the new image)
    # until the new process's CLI holds them (duplexkit.cli.common.held_signals), so a Ctrl+C during
    # its start-up imports ends it cleanly instead of with a traceback
    import signal

    stop = {signal.SIGINT, signal.SIGTERM}
    if execve is None:
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        (execve or os.execve)(sys.executable, list(sys.orig_argv), new)
    except BaseException:
        if execve is None:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
        raise
    return True  # only when a test's execve returns


def fix_mmap_threshold(environ: Optional[dict] = None, threshold: int = MMAP_THRESHOLD) -> Optional[int]:
    """Set glibc's ``M_MMAP_THRESHOLD`` to ``threshold`` bytes in this process (``mallopt(3)``; this also
    turns off glibc's dynamic adjustment of it), so that buffers of ``threshold`` bytes or more are
    mmapped and returned to the OS when freed instead of spreading the brk heap (module docstring).

    Returns the threshold set, or None when nothing was changed: not glibc, the operator set it
    (``MALLOC_MMAP_THRESHOLD_`` in the environment, or ``glibc.malloc.mmap_threshold`` in
    ``GLIBC_TUNABLES``), or ``mallopt`` refused the value (it returns 0 for one above 32 MiB).
    ``environ`` is for tests (default ``os.environ``). Called by ``duplexkit serve`` in the server
    process, after :func:`use_malloc_for_objects`.
    """
    env = os.environ if environ is None else environ
    operator_set = "MALLOC_MMAP_THRESHOLD_" in env or "glibc.malloc.mmap_threshold" in env.get("GLIBC_TUNABLES", "")
    if _libc is None or operator_set:
        return None
    if not _libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)):
        return None
    return int(threshold)


#: name of the numpy data-memory handler set by :func:`numpy_without_block_cache`
NUMPY_HANDLER_NAME = "duplexkit_raw"

_numpy_handler = None  # (the handler struct, its capsule): numpy keeps pointers into them for ever


class _Allocator(ctypes.Structure):
    # CPython's PyMemAllocatorEx and numpy's PyDataMemAllocator (version 1) share this layout; numpy's
    # free takes a third argument (the size), which the C calling convention lets CPython's ignore
    _fields_ = [("ctx", ctypes.c_void_p), ("malloc", ctypes.c_void_p), ("calloc", ctypes.c_void_p),
                ("realloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


class _Handler(ctypes.Structure):  # numpy's PyDataMem_Handler (numpy/ndarraytypes.h)
    _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8), ("allocator", _Allocator)]


def numpy_without_block_cache() -> Optional[str]:
    """Make numpy allocate array data with CPython's raw allocator (``malloc`` itself) instead of its
    default handler, which keeps up to 7 freed blocks of each size under 1024 bytes for reuse and never
    gives them back (numpy/_core/src/multiarray/alloc.c, ``datacache``).

    Why: after a load, those cached blocks (a session's short audio frames: float32 arrays of a few
    hundred samples) sit one per page all over the brk heap the load grew, and ``malloc_trim`` cannot
    return a page that holds one (benchmarks/results/2026-12-01-server-load.md, "what pins the brk heap"). How: numpy's
    documented data-memory policy API (NEP 49, https://numpy.org/doc/stable/reference/c-api/data_memory.html):
    a ``PyDataMem_Handler`` named :data:`NUMPY_HANDLER_NAME` whose functions are
    ``PyMem_GetAllocator(PYMEM_DOMAIN_RAW)``'s, in a ``"mem_handler"`` capsule, passed to
    ``PyDataMem_SetHandler`` (slot 304 of numpy's C-API table, numpy >= 1.22). The handler is a context
    variable: call this in the main thread before the event loop starts (tasks and ``to_thread`` copy
    the context); arrays made earlier keep the handler they were made with.

    Returns the handler name in effect, or None when numpy is too old, too new (3 or later: the C-API
    slot is not checked there) or not importable.
    """
    global _numpy_handler
    try:
        import numpy as np

        try:
            from numpy._core import _multiarray_umath as umath, multiarray
        except ImportError:  # numpy 1.x
            from numpy.core import _multiarray_umath as umath, multiarray
    except ImportError:
        return None
    if not hasattr(multiarray, "get_handler_name"):
        return None
    if int(np.__version__.split(".")[0]) >= 3:  # slot 304 is checked for numpy 1.22-2.x only
        logger.info("numpy %s: its block cache is kept (the handler slot is not checked for it)", np.__version__)
        return None
    if _numpy_handler is None:
        api = ctypes.pythonapi
        api.PyCapsule_GetPointer.restype = ctypes.c_void_p
        api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        api.PyCapsule_New.restype = ctypes.py_object
        api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        api.PyMem_GetAllocator.restype = None
        api.PyMem_GetAllocator.argtypes = [ctypes.c_int, ctypes.POINTER(_Allocator)]
        raw = _Allocator()
        api.PyMem_GetAllocator(0, ctypes.byref(raw))  # PYMEM_DOMAIN_RAW
        handler = _Handler(NUMPY_HANDLER_NAME.encode(), 1, raw)
        # numpy keeps a pointer to the handler in every array made with it, also while the
        # interpreter shuts down, after this module's objects are gone: the struct lives in memory
        # from libc's malloc that is never freed (a ctypes object here crashed the server at exit,
        # SIGSEGV, seen in tests/e2e/test_engine_process.py)
        libc = _libc if _libc is not None else ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        mem = libc.malloc(ctypes.sizeof(_Handler))
        if not mem:
            return None
        ctypes.memmove(mem, ctypes.addressof(handler), ctypes.sizeof(_Handler))
        capsule = api.PyCapsule_New(mem, b"mem_handler", None)
        _numpy_handler = (mem, capsule)
    table = ctypes.cast(ctypes.pythonapi.PyCapsule_GetPointer(umath._ARRAY_API, None), ctypes.POINTER(ctypes.c_void_p))
    set_handler = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(table[304])  # PyDataMem_SetHandler
    set_handler(_numpy_handler[1])
    del np
    return multiarray.get_handler_name()


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
