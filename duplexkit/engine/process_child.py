"""The engine-process side of :class:`duplexkit.engine.process.EngineProcess` (the child).

Spawned by :meth:`EngineProcess.start` with :func:`child_main` as its target: builds the engine from
an :class:`EngineSpec`, then serves the pipe on its own event loop (messages and flow control:
:mod:`duplexkit.engine.process`). Also the home of what both sides share: the spec, the limits and
:func:`portable` (exceptions that cross the pipe).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import pickle
import queue
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from duplexkit.errors import EngineLoadError, EngineProcessError, ErrorCode
from duplexkit.memory import cuda_memory as _cuda_memory

from .api import ChatRequest, EngineCommand, EngineFailure, StreamConfig

logger = logging.getLogger("duplexkit.engine.process")

__all__ = ["EngineSpec", "OUTPUT_CREDITS", "MAX_BATCHES_IN_FLIGHT", "BATCH_MAX", "STATS_INTERVAL_S",
           "portable", "child_main"]

OUTPUT_CREDITS = 256
"""Stream outputs and chat deltas the engine process may have queued or in the pipe at once (at most
~24 MB: a full vocoder chunk is 24 000 float32 samples, docs/model.md §7.3)."""

MAX_BATCHES_IN_FLIGHT = 64
"""Batches the server's reader thread hands to a loop that has not dispatched them yet before it stops
reading the pipe."""

BATCH_MAX = 64
"""Messages a writer thread puts in one pickled batch."""

_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
"""The signals the engine process ignores (the server stops it)."""

STATS_INTERVAL_S = 1.0
"""How often the engine process pushes ``kv_usage()`` and the stream count when they changed."""


@dataclass(frozen=True)
class EngineSpec:
    """How the child builds its engine: ``factory`` is ``"package.module:callable"`` (importable in a
    fresh interpreter), called as ``factory(*args, **kwargs)`` in the child's main thread, before its
    event loop starts (as the server's loader thread calls it in-process). Everything must be picklable.

    Example: ``EngineSpec("duplexkit.engine.loading:load_engine", ("scripted",), {"scripted": {"units_per_turn": 3}})``.
    """

    factory: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    log_level: Optional[int] = None  # the child's root logging level (None: the server's at start)

    def build(self) -> Any:
        mod, sep, name = self.factory.partition(":")
        if not sep or not mod or not name:
            raise ValueError(f"EngineSpec.factory must be 'module:callable', got {self.factory!r}")
        return getattr(importlib.import_module(mod), name)(*self.args, **self.kwargs)


def portable(exc: BaseException, fallback=EngineProcessError) -> BaseException:
    """``exc`` when it survives pickling with its type and text, else ``fallback`` with its text."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:
        pass
    text = str(exc)
    if fallback is EngineLoadError and not text.startswith("engine failed to load"):
        text = f"engine failed to load: {type(exc).__name__}: {text}"
    return fallback(text if fallback is EngineLoadError else f"{type(exc).__name__}: {text}")


# =============================================================================================
# the child (engine) side
# =============================================================================================




class _ChildServer:
    """The engine process: serves one pipe on its own event loop."""

    def __init__(self, conn, engine: Any) -> None:
        self.conn = conn
        self.engine = engine
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.out: queue.Queue = queue.Queue()
        self.credits = asyncio.Semaphore(OUTPUT_CREDITS)  # bound to the loop on first use
        self.streams: dict[str, Any] = {}
        self.pumps: dict[str, asyncio.Task] = {}
        self.early: dict[str, list] = {}  # commands that arrived while the stream was opening
        self.epochs: dict[str, int] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        self.stop = asyncio.Event()
        self.engine_closed = False

    # -- threads ---------------------------------------------------------------------------------
    def writer(self) -> None:
        while True:
            batch = [self.out.get()]
            while len(batch) < BATCH_MAX:
                try:
                    batch.append(self.out.get_nowait())
                except queue.Empty:
                    break
            if any(m is None for m in batch):
                batch = [m for m in batch if m is not None]
                self._send(batch)
                return
            self._send(batch)
            n = sum(1 for m in batch if m[0] in ("out", "delta"))
            if n and self.loop is not None:
                try:
                    self.loop.call_soon_threadsafe(self._release, n)
                except RuntimeError:  # loop closed
                    return

    def _send(self, batch: list) -> None:
        if not batch:
            return
        try:
            self.conn.send(batch)
        except (OSError, EOFError):
            os._exit(0)  # the server is gone
        except Exception:  # something in the batch does not pickle: send item by item
            for m in batch:
                try:
                    self.conn.send([m])
                except (OSError, EOFError):
                    os._exit(0)
                except Exception as exc:
                    logger.exception("engine process: cannot send %s", m[0])
                    if m[0] == "reply":
                        self.conn.send([("reply", m[1], False, EngineProcessError(f"result not picklable: {exc}"))])

    def _release(self, n: int) -> None:
        for _ in range(n):
            self.credits.release()

    def on_batch(self, batch: list) -> None:
        for msg in batch:
            try:
                self.handle(msg)
            except Exception:
                logger.exception("engine process: bad message %r", msg[:1])

    def on_eof(self) -> None:
        """The server is gone: close the engine and exit (hard exit after 10 s)."""
        timer = threading.Timer(10.0, os._exit, (0,))
        timer.daemon = True
        timer.start()
        self.stop.set()

    # -- messages ----------------------------------------------------------------------------------
    def post(self, msg: tuple) -> None:
        self.out.put(msg)

    def _spawn(self, rid: int, coro) -> None:
        task = self.loop.create_task(coro)
        self.tasks[rid] = task
        task.add_done_callback(lambda _t: self.tasks.pop(rid, None))

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "cmd":
            _, sid, cmd = msg
            if sid in self.early:
                self.early[sid].append(cmd)
            elif sid in self.streams:
                self.epochs[sid] = max(self.epochs.get(sid, 0), cmd.epoch)
                self._submit(sid, cmd)  # a command to a stream closed here is dropped, as the runtime does
        elif kind == "open":
            _, rid, sid, config = msg
            self.early[sid] = []
            self._spawn(rid, self._reply(rid, self._open(sid, config)))
        elif kind == "close":
            self._spawn(msg[1], self._reply(msg[1], self._close(msg[2])))
        elif kind == "gen":
            self._spawn(msg[1], self._reply(msg[1], self.engine.generate(msg[2])))
        elif kind == "gens":
            self._spawn(msg[1], self._reply(msg[1], self._gen_stream(msg[1], msg[2])))
        elif kind == "cancel":
            task = self.tasks.get(msg[1])
            if task is not None:
                task.cancel()
        elif kind == "shutdown":
            self._spawn(msg[1], self._reply(msg[1], self._shutdown()))
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _submit(self, sid: str, cmd: EngineCommand) -> None:
        try:
            self.streams[sid].submit(cmd)
        except Exception as exc:  # as the driver does in-process: this stream fails, fatally
            logger.exception("engine command failed")
            self.post(("out", sid, EngineFailure(sid, cmd.epoch, -1, code=ErrorCode.SERVER_ERROR.value,
                                                 message=f"engine command failed: {exc}", fatal=True)))

    async def _reply(self, rid: int, coro) -> None:
        try:
            value = await coro
        except asyncio.CancelledError:
            self.post(("reply", rid, False, EngineProcessError("cancelled")))
            return
        except Exception as exc:
            self.post(("reply", rid, False, portable(exc)))
            return
        self.post(("reply", rid, True, value))

    async def _open(self, sid: str, config: StreamConfig) -> None:
        try:
            stream = await self.engine.open_stream(sid, config)
        except BaseException:
            self.early.pop(sid, None)
            raise
        self.streams[sid] = stream
        self.pumps[sid] = self.loop.create_task(self._pump(sid, stream))
        for cmd in self.early.pop(sid, []):
            self.epochs[sid] = max(self.epochs.get(sid, 0), cmd.epoch)
            self._submit(sid, cmd)

    async def _pump(self, sid: str, stream: Any) -> None:
        try:
            async for out in stream.outputs():
                await self.credits.acquire()
                self.post(("out", sid, out))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # as the driver's pump does in-process: a fatal failure of this stream
            logger.exception("engine stream failed")
            self.post(("out", sid, EngineFailure(sid, self.epochs.get(sid, 0), -1, code=ErrorCode.SERVER_ERROR.value,
                                                 message=f"engine stream failed: {exc}", fatal=True)))
        finally:
            self.post(("end", sid))

    async def _close(self, sid: str) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        try:
            await stream.aclose()
            pump = self.pumps.get(sid)
            if pump is not None:
                await pump  # the "end" marker is posted before this reply
        finally:
            self.streams.pop(sid, None)
            self.pumps.pop(sid, None)
            self.epochs.pop(sid, None)
            from duplexkit.memory import schedule_trim

            schedule_trim()  # the stream's freed buffers back to the OS (cycles collected first)

    async def _gen_stream(self, rid: int, request: ChatRequest) -> None:
        agen = self.engine.generate_stream(request)
        try:
            async for delta in agen:
                await self.credits.acquire()
                self.post(("delta", rid, delta))
        finally:
            close = getattr(agen, "aclose", None)
            if close is not None:
                await close()

    async def _shutdown(self) -> None:
        try:
            self.engine_closed = True
            await self.engine.aclose()
        finally:
            self.loop.call_later(0, self.stop.set)

    async def _stats(self) -> None:
        last = None
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            fn = getattr(self.engine, "kv_usage", None)
            try:
                stats = {"kv_usage": (fn() or {}) if fn is not None else None, "num_streams": len(self.streams),
                         "gpu_memory": _cuda_memory()}
            except Exception as exc:  # pragma: no cover - metrics never break the engine
                logger.debug("kv usage unavailable: %r", exc)
                continue
            if stats != last:
                self.post(("stats", stats))
                last = stats

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        stats = self.loop.create_task(self._stats())
        await self.stop.wait()
        stats.cancel()
        for task in list(self.tasks.values()) + list(self.pumps.values()):
            task.cancel()
        if not self.engine_closed:
            try:
                await asyncio.wait_for(self.engine.aclose(), 30)
            except Exception:  # pragma: no cover
                logger.exception("engine close failed")


class _ChildReader:
    """The child's reader thread: batches go to the loop; EOF (the server died) ends the process."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.server: Optional[_ChildServer] = None
        self.lock = threading.Lock()

    def run(self) -> None:
        while True:
            try:
                batch = self.conn.recv()
            except (EOFError, OSError):
                batch = None
            with self.lock:
                srv = self.server
            if srv is None or srv.loop is None:  # still loading: only EOF or a shutdown can come
                os._exit(0)
            try:
                srv.loop.call_soon_threadsafe(srv.on_eof if batch is None else srv.on_batch, *([] if batch is None else [batch]))
            except RuntimeError:  # the loop is closed: the process is exiting
                return
            if batch is None:
                return


def child_main(conn, spec: EngineSpec) -> None:
    """Entry point of the engine process (spawned)."""
    # The server alone decides when the engine stops, in every phase. A terminal's Ctrl+C and a
    # service manager's SIGTERM reach the whole process group, this process included: were it to
    # act on them, a load would end by itself with a status the server cannot tell from a crash
    # (a spurious "engine failed to load"), and a loaded engine would stop under a draining server.
    # The server stops a load by killing this process (EngineProcess.cancel) and a loaded engine
    # with the "shutdown" message; the pipe's EOF ends it when the server died.
    # (EngineProcess.start spawns this process with both blocked, so that none arrives before this point.)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # a pending one is discarded: ignored
    if spec.log_level is not None:
        logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    reader = _ChildReader(conn)
    threading.Thread(target=reader.run, name="engine-pipe-reader", daemon=True).start()
    try:
        engine = spec.build()
    except BaseException as exc:
        try:
            conn.send([("load_error", portable(exc, EngineLoadError))])
        except (OSError, EOFError):
            pass  # the server is gone
        finally:
            conn.close()
        return
    info = {"model_id": getattr(engine, "model_id", None) or "duplexkit",
            "random_weights": bool(getattr(engine, "random_weights", False)),
            "random_weights_noticed": bool(getattr(engine, "random_weights_noticed", False)),
            "supports_audio": bool(getattr(engine, "supports_audio", True)),
            "has_kv_usage": callable(getattr(engine, "kv_usage", None)),
            "engine_class": type(engine).__name__}
    srv = _ChildServer(conn, engine)
    # the loop exists before "ready" goes out: the server's first messages may arrive at once, and
    # the reader queues them on the loop (they run once it runs, in order)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    srv.loop = loop
    with reader.lock:
        reader.server = srv
    writer = threading.Thread(target=srv.writer, name="engine-pipe-writer", daemon=True)
    writer.start()
    srv.post(("ready", info))
    try:
        loop.run_until_complete(srv.run())
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
    srv.post(None)
    writer.join(10)
