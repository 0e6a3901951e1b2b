"""Run an engine in its own process, so that the server's event loop never shares a GIL with it.

:class:`EngineProcess` implements the :class:`duplexkit.engine.api.Engine` protocol in the server
process while the real engine (:class:`~duplexkit.engine.DuplexEngine`, or
:class:`~duplexkit.testing.ScriptedEngine`) and its stage threads live in a child process started
with the multiprocessing ``spawn`` context (no forked CUDA or thread state). ``duplexkit serve`` uses
it by default (``--engine-process``; docs/architecture.md, "Processes").

What crosses the pipe
---------------------
One :func:`multiprocessing.Pipe` (a Unix socket pair) carries pickled *batches* (lists) of tuples:

* server -> engine: ``("open", rid, stream_id, StreamConfig)``, ``("cmd", stream_id, EngineCommand)``
  (the :mod:`duplexkit.engine.api` dataclasses; audio is float32 numpy), ``("close", rid, stream_id)``,
  ``("gen", rid, ChatRequest)``, ``("gens", rid, ChatRequest)``, ``("cancel", rid)``, ``("shutdown", rid)``;
* engine -> server: ``("ready", info)`` or ``("load_error", exception)`` once, then
  ``("out", stream_id, EngineOutput)``, ``("end", stream_id)`` (the stream's outputs ended),
  ``("reply", rid, ok, value)``, ``("delta", rid, ChatDelta)``, ``("stats", {kv_usage, num_streams, gpu_memory})``
  (once a second when it changed).

Each side has a reader thread and a writer thread, so neither event loop ever blocks on the pipe:
the server's reader thread hands each batch to the loop with ``loop.call_soon_threadsafe``; per-stream
order is the pipe's order (one writer per side, FIFO queues, one loop dispatching in order).

Flow control: the engine side sends a stream's outputs only against *credits* (at most
:data:`OUTPUT_CREDITS` outputs or chat deltas queued or in the pipe; the writer returns credits once it
has written them); the server's reader thread holds at most :data:`MAX_BATCHES_IN_FLIGHT` batches not
yet dispatched by its loop before it stops reading. A stalled server loop therefore stops the pipe,
then the engine's output pumps, and outputs wait in the engine stream's own queue, which the Session
bounds: it submits input units only up to its pending-input cap (``max_pending_input_s``). Commands
(server -> engine) are bounded by the same Session caps.

Failure behaviour
-----------------
* Load errors are raised by :meth:`EngineProcess.start` as the same exception types the factory
  raised (``EngineLoadError``, ``LayoutError``, ...; an exception that cannot be pickled becomes an
  :class:`~duplexkit.errors.EngineLoadError` with its text); a child that exits while loading gives an
  ``EngineLoadError`` naming the exit code.
* If the child dies, every open stream gets a fatal :class:`~duplexkit.engine.api.EngineFailure`
  (the Session closes with ``session.closed`` and 1011), pending and later calls raise
  :class:`~duplexkit.errors.EngineProcessError`, :attr:`EngineProcess.failure` says why (``/ready``
  and ``/health`` report ``error``) and one ERROR line is logged.
* The child ignores SIGINT and SIGTERM in every phase (a terminal's Ctrl+C and a service manager's
  signal reach the whole process group): the server alone decides when it stops. A load in progress
  is stopped with :meth:`EngineProcess.cancel` (from any thread: the child is killed, :meth:`start`
  raises), a loaded engine with :meth:`EngineProcess.aclose` (which joins the child); the child
  exits by itself when the server process dies (its reader thread sees the pipe's EOF).
* One thread at a time reaps the child (``waitpid``), under a lock; waits watch the process's
  sentinel, which any number of threads may do at once. (Two threads in ``Process.join`` at once
  race in ``waitpid``: the loser sees the child as alive after it exited.)
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  (its atexit join must run after ours: registered first)
import queue
import signal
import threading
import weakref
from typing import Any, AsyncIterator, Optional

from duplexkit.errors import EngineLoadError, EngineProcessError, ErrorCode

from .api import ChatDelta, ChatRequest, ChatResult, CloseStream, EngineCommand, EngineFailure, EngineOutput, \
    OpenStream, StreamConfig
from .process_child import BATCH_MAX, MAX_BATCHES_IN_FLIGHT, OUTPUT_CREDITS, STATS_INTERVAL_S, EngineSpec, child_main, \
    _STOP_SIGNALS

logger = logging.getLogger("duplexkit.engine.process")

__all__ = ["EngineSpec", "EngineProcess", "EngineProcessError", "OUTPUT_CREDITS", "MAX_BATCHES_IN_FLIGHT",
           "STATS_INTERVAL_S"]

# =============================================================================================
# the server (parent) side
# =============================================================================================


class _StreamProxy:
    """One engine stream seen from the server (implements :class:`~duplexkit.engine.api.EngineStream`)."""

    def __init__(self, owner: "EngineProcess", stream_id: str) -> None:
        self.stream_id = stream_id
        self._owner = owner
        self._q: asyncio.Queue = asyncio.Queue()
        self._end_seen = asyncio.Event()  # the engine said the outputs ended (or the process died)
        self._ended = False  # outputs() consumed the end marker
        self._closing = False
        self.epoch = 0

    def submit(self, command: EngineCommand) -> None:
        """Queue one command for the engine process (non-blocking). Commands to a closed or failed
        stream are ignored, as the in-process runtime does.

        Raises:
            TypeError: ``OpenStream`` (the shell calls :meth:`EngineProcess.open_stream`).
        """
        if isinstance(command, OpenStream):
            raise TypeError("OpenStream is handled by Engine.open_stream")
        if self._end_seen.is_set() or self._closing or self._owner.failure is not None:
            return
        self.epoch = max(self.epoch, command.epoch)
        if isinstance(command, CloseStream):
            self._closing = True
        self._owner._post(("cmd", self.stream_id, command))

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        """Outputs in engine order; ends after the stream is closed (or the engine process died)."""
        while not self._ended:
            item = await self._q.get()
            if item is None:
                self._ended = True
                return
            yield item

    async def aclose(self) -> None:
        """Close the stream in the engine process and wait until its state is freed there."""
        self._closing = True
        if self._owner.failure is None:  # also after the end: the engine process drops its handle
            try:
                await self._owner._call(("close", None, self.stream_id))
            except EngineProcessError:
                pass
        await self._end_seen.wait()

    # from the owner's dispatch
    def _deliver(self, out: Optional[EngineOutput]) -> None:
        self._q.put_nowait(out)
        if out is None:
            self._end_seen.set()


class EngineProcess:
    """An :class:`~duplexkit.engine.api.Engine` whose engine runs in a spawned child process.

    Args:
        spec: how the child builds the engine (:class:`EngineSpec`).
        name: the child's process name (``ps``).

    Call :meth:`start` (blocking: spawns the child and waits until the engine is loaded) from any
    thread, then use the async API from one event loop. Attributes mirrored from the engine:
    ``model_id``, ``random_weights``, ``random_weights_noticed``, ``supports_audio``; :meth:`kv_usage` is the child's last
    report (<= :data:`STATS_INTERVAL_S` old). ``pid``, ``exitcode``, :attr:`failure` (None while the
    child serves; a message once it died) describe the process.
    """

    def __init__(self, spec: EngineSpec, *, name: str = "duplexkit-engine") -> None:
        if spec.log_level is None:
            spec = EngineSpec(spec.factory, spec.args, spec.kwargs, logging.getLogger().getEffectiveLevel())
        self.spec = spec
        self.name = name
        self.model_id = "duplexkit"
        self.random_weights = False
        self.random_weights_noticed = False
        self.supports_audio = True
        self.info: dict = {}
        self.failure: Optional[str] = None
        self._proc = None
        self._conn = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._out: queue.Queue = queue.Queue()
        self._inflight = threading.BoundedSemaphore(MAX_BATCHES_IN_FLIGHT)
        self._streams: dict[str, _StreamProxy] = {}
        self._pending: dict[int, asyncio.Future] = {}
        self._gens: dict[int, asyncio.Queue] = {}
        self._ids = itertools.count(1)
        self._stats: dict = {}
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._reap_lock = threading.Lock()  # one waitpid at a time (see the module docstring)
        self._cancelled = threading.Event()  # cancel() or a close while loading: start() gives up

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, poll_s: float = 0.5) -> "EngineProcess":
        """Spawn the child and wait until its engine is loaded (blocking; for a model this takes as
        long as loading it in-process). Returns self.

        Raises:
            the factory's exception (``EngineLoadError``, ``LayoutError``, ...) when loading fails;
            ``EngineLoadError`` when the child exits while loading.
        """
        if self._proc is not None:
            raise RuntimeError("EngineProcess.start() was already called")
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=child_main, args=(child, self.spec), name=self.name)
        # The child inherits this thread's signal mask (fork, then exec): spawned with SIGINT and
        # SIGTERM blocked, a Ctrl+C to the terminal's process group cannot stop it before
        # child_main ignores them (importing numpy and torch takes seconds); as the standard
        # library's resource tracker is spawned. That tracker first, since starting it unblocks both.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            self._proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()  # only the child holds its end: the child's exit is our EOF, and ours its EOF
        self._conn = parent
        _live.add(self)
        first = None
        while first is None and not self._cancelled.is_set():
            ready = mp.connection.wait([parent, self._proc.sentinel], poll_s)
            if parent in ready:
                try:
                    first = parent.recv()[0]
                except (EOFError, OSError):
                    break
            elif ready:  # the child exited without a word
                break
        if first is None or first[0] != "ready":
            cancelled = self._cancelled.is_set()
            if not cancelled:
                self._wait_exit(10)  # its exit code names the cause
            self._close_sync()
            if cancelled:
                raise EngineLoadError("engine failed to load: loading was cancelled (the server is stopping)")
            if first is not None and first[0] == "load_error":
                raise first[1]
            raise EngineLoadError(f"engine failed to load: the engine process exited with code "
                                  f"{self.exitcode} while loading")
        self.info = dict(first[1])
        self.model_id = self.info["model_id"]
        self.random_weights = self.info["random_weights"]
        self.random_weights_noticed = bool(self.info.get("random_weights_noticed", False))  # the child printed it
        self.supports_audio = self.info["supports_audio"]
        for target, tname in ((self._reader, "engine-proc-reader"), (self._writer, "engine-proc-writer")):
            t = threading.Thread(target=target, name=tname, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    @property
    def exitcode(self) -> Optional[int]:
        if self._proc is None:
            return None
        with self._reap_lock:  # reading it reaps (waitpid)
            return self._proc.exitcode

    def cancel(self) -> None:
        """Stop a :meth:`start` in progress (callable from any thread, e.g. a server's shutdown path
        while another thread waits in :meth:`start`): kills the loading child, so :meth:`start` raises
        :class:`~duplexkit.errors.EngineLoadError` at once (within its ``poll_s``). A no-op once
        loaded (close a loaded engine with :meth:`aclose`) or before :meth:`start`."""
        if self._threads or self._proc is None:
            return
        self._cancelled.set()
        self._kill()

    def _kill(self) -> None:
        proc = self._proc
        with self._reap_lock:  # not reaped yet, so its pid is still its own
            if proc.exitcode is None:
                proc.kill()

    def _wait_exit(self, timeout_s: Optional[float]) -> bool:
        """Wait up to ``timeout_s`` for the child to exit (on its sentinel, which never reaps), then reap
        it under the lock. Returns whether it exited (``exitcode`` is then set)."""
        proc = self._proc
        if not mp.connection.wait([proc.sentinel], timeout_s):  # readable (EOF) from its exit on
            return False
        with self._reap_lock:
            proc.join()  # it has exited: waitpid returns at once
        return True

    async def aclose(self) -> None:
        """Close every stream and the engine in the child, then join the child (terminate, then kill,
        if it does not exit within 30 s). Idempotent."""
        if self._closing or self._proc is None:
            return
        self._closing = True
        if self.failure is None:
            try:
                await asyncio.wait_for(self._call(("shutdown", None), closing_ok=True), 30)
            except (EngineProcessError, asyncio.TimeoutError):
                pass
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self, timeout_s: float = 30.0) -> None:
        """Blocking close: ask the child to shut down (unless :meth:`aclose` did), join it, kill it
        after ``timeout_s``, then close our end of the pipe."""
        if not self._closing and self._threads:
            self._post(("shutdown", 0))  # nobody waits for the reply
        self._closing = True
        self._out.put(None)  # ends the writer thread
        proc = self._proc
        if proc is not None and proc.pid is not None:
            if not self._threads:  # still loading (the server stops meanwhile): nothing to drain
                self._cancelled.set()
                self._kill()  # nothing to drain while loading; it reads no request until loaded
            if not self._wait_exit(timeout_s):
                logger.warning("engine process %d did not exit in %g s: killing it", proc.pid, timeout_s)
                self._kill()
                self._wait_exit(5)
        for t in self._threads:  # the reader ends at the pipe's EOF (the child exited)
            t.join(5)
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
        _live.discard(self)

    # -- Engine ----------------------------------------------------------------------------------
    async def open_stream(self, stream_id: str, config: StreamConfig) -> _StreamProxy:
        """Open a stream in the engine process. Raises what the engine's ``open_stream`` raised, or
        :class:`EngineProcessError` when the process is gone."""
        if stream_id in self._streams:
            raise ValueError(f"stream {stream_id!r} already open")
        proxy = _StreamProxy(self, stream_id)
        self._streams[stream_id] = proxy
        try:
            await self._call(("open", None, stream_id, config))
        except BaseException:
            self._streams.pop(stream_id, None)
            raise
        return proxy

    @property
    def num_streams(self) -> int:
        """Open streams (server-side view)."""
        return len(self._streams)

    open_streams = num_streams

    def kv_usage(self) -> dict:
        """The engine's ``kv_usage()`` as last reported by the child (empty when it has none)."""
        return dict(self._stats.get("kv_usage") or {})

    def gpu_memory(self) -> dict:
        """The engine process's CUDA memory as last reported (``{"cuda:N": {"allocated", "reserved",
        "total"}}`` bytes; empty without torch/CUDA there): the server's ``duplexkit_gpu_memory_bytes``."""
        return dict(self._stats.get("gpu_memory") or {})

    async def generate(self, request: ChatRequest) -> ChatResult:
        """Turn-based generation in the engine process (see the engine's ``generate``)."""
        return await self._call(("gen", None, request))

    async def generate_stream(self, request: ChatRequest) -> AsyncIterator[ChatDelta]:
        """Streamed generation in the engine process; closing the iterator early cancels it there."""
        self._check()
        rid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._gens[rid] = q
        fut = self._future(rid)
        fut.add_done_callback(lambda f: q.put_nowait(("end", f.exception() if not f.cancelled() else None)))
        self._post(("gens", rid, request))
        done = False
        try:
            while True:
                kind, value = await q.get()
                if kind == "delta":
                    yield value
                    continue
                done = True
                if value is not None:
                    raise value
                return
        finally:
            self._gens.pop(rid, None)
            if not done and self.failure is None and not self._closing:
                self._post(("cancel", rid))

    # -- plumbing --------------------------------------------------------------------------------
    def _check(self, closing_ok: bool = False) -> None:
        if self.failure is not None:
            raise EngineProcessError(self.failure)
        if self._proc is None:
            raise EngineProcessError("the engine process was not started (call start())")
        if self._closing and not closing_ok:
            raise EngineProcessError("the engine process is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("EngineProcess is bound to another event loop")

    def _future(self, rid: int) -> asyncio.Future:
        fut = self._loop.create_future()
        self._pending[rid] = fut
        return fut

    async def _call(self, msg: tuple, closing_ok: bool = False) -> Any:
        self._check(closing_ok)
        rid = next(self._ids)
        fut = self._future(rid)
        self._post((msg[0], rid, *msg[2:]))
        try:
            return await fut
        finally:
            self._pending.pop(rid, None)

    def _post(self, msg: tuple) -> None:
        self._out.put(msg)

    def _writer(self) -> None:
        while True:
            batch = [self._out.get()]
            while len(batch) < BATCH_MAX:
                try:
                    batch.append(self._out.get_nowait())
                except queue.Empty:
                    break
            stop = any(m is None for m in batch)
            batch = [m for m in batch if m is not None]
            try:
                if batch:
                    self._conn.send(batch)
            except (OSError, EOFError, ValueError):  # the child is gone: the reader reports it
                return
            if stop:
                return

    def _reader(self) -> None:
        conn = self._conn
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError, ValueError):
                break
            except Exception:  # pragma: no cover - a batch that does not unpickle
                logger.exception("engine process: unreadable message")
                continue
            rest = []
            for m in batch:
                if m[0] == "stats":
                    self._stats = m[1]
                else:
                    rest.append(m)
            if not rest:
                continue
            self._inflight.acquire()
            if not self._hand_over(self._dispatch, rest):
                return
        if self._proc is not None:
            self._wait_exit(5)  # EOF: the child exited or is exiting; its code names the cause
        self._hand_over(self._gone)

    def _hand_over(self, fn, *args) -> bool:
        loop = self._loop
        if loop is None:  # no async call yet: nothing waits on the loop
            fn(*args)
            return True
        try:
            loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the loop is closed
            if args:
                self._inflight.release()
            return False

    def _dispatch(self, batch: list) -> None:
        try:
            for m in batch:
                kind = m[0]
                if kind == "out":
                    proxy = self._streams.get(m[1])
                    if proxy is not None:
                        proxy._deliver(m[2])
                elif kind == "end":
                    proxy = self._streams.pop(m[1], None)
                    if proxy is not None:
                        proxy._deliver(None)
                elif kind == "delta":
                    q = self._gens.get(m[1])
                    if q is not None:
                        q.put_nowait(("delta", m[2]))
                elif kind == "reply":
                    fut = self._pending.pop(m[1], None)
                    if fut is not None and not fut.done():
                        if m[2]:
                            fut.set_result(m[3])
                        else:
                            fut.set_exception(m[3])
        finally:
            self._inflight.release()

    def _gone(self) -> None:
        """The pipe reached EOF: fail every open stream and every pending call."""
        code = self.exitcode
        if self._closing:
            message = "the engine process is closed"
        else:
            message = f"the engine process (pid {self.pid}) died with exit code {code}"
            logger.error("%s: failing %d open stream(s); new sessions and chat requests are refused "
                         "(restart the server)", message, len(self._streams))
        if self.failure is None:
            self.failure = message
        for sid, proxy in list(self._streams.items()):
            if not self._closing:
                proxy._deliver(EngineFailure(sid, proxy.epoch, -1, code=ErrorCode.SERVER_ERROR.value, message=message,
                                             fatal=True))
            proxy._deliver(None)
        self._streams.clear()
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(EngineProcessError(message))
        self._pending.clear()


_live: "weakref.WeakSet[EngineProcess]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit (before multiprocessing joins its children), close what was not closed."""
    for eng in list(_live):
        eng._close_sync(timeout_s=5.0)
