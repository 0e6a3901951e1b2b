"""The asyncio shell that drives one :class:`duplexkit.session.Session` over an engine.

The Session does no I/O (docs/architecture.md, "The sans-I/O Session"); something has to move its inputs and outputs.
Both the server's WebSocket handler and :class:`~duplexkit.clients.InlineDuplexClient` do exactly
the same thing, so it lives here once:

* client events go in with :meth:`SessionDriver.client_event`;
* engine outputs of the stream are pumped into ``Session.receive_engine_output``;
* a clock task calls ``Session.tick`` every ``tick_interval_s`` (silence feeding, idle timeout);
* what ``Session.drain()`` returns goes to two queues, each drained by its own task, so that a slow
  socket never delays the engine (and an engine that is slow to open never delays events):
  engine commands, in order: ``OpenStream`` opens the stream on the (shared) engine, the others go
  to the stream with :func:`duplexkit.engine.api.apply_command`; server events (JSON-ready dicts),
  in order, to ``on_event``, and a final ``CloseConnection`` to ``on_close`` after every event
  before it (that ends the event dispatch).

The shells only differ in what ``on_event`` / ``on_close`` do (send a text frame and close the
socket, or hand the dict to the client's event machinery) and in where client events come from.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any, Awaitable, Callable, Optional, Union

import dataclasses

from duplexkit import tracing
from duplexkit.engine.api import (
    DecideTools,
    Engine,
    EngineCommand,
    EngineFailure,
    EngineStream,
    OpenStream,
    ShellCommand,
    ToolDecision,
    TranscribeAudio,
    Transcription,
    apply_command,
)
from duplexkit.errors import ErrorCode

logger = logging.getLogger("duplexkit.driver")

__all__ = ["SessionDriver"]

EventSink = Callable[[dict], Union[None, Awaitable[None]]]


class SessionDriver:
    """Drives one Session over one engine stream on the running event loop.

    Args:
        session: a fresh :class:`duplexkit.session.Session`.
        engine: the :class:`~duplexkit.engine.api.Engine` the stream is opened on (shared; never
            closed here).
        on_event: called with each server event dict, in order (sync or async).
        on_close: called with the Session's ``CloseConnection`` (sync or async); dispatch ends after it.
        tick_interval_s: clock period in seconds (default 50 ms: well under one 1-s unit).
        tracer_provider: an OpenTelemetry ``TracerProvider`` to trace this session into (None: the
            process's, :mod:`duplexkit.tracing`; tracing is off unless one is configured or the
            ``OTEL_EXPORTER_OTLP_*ENDPOINT`` environment is set).

    Time is milliseconds since the driver was created (monotonic clock), passed to every Session call.

    Shell commands (docs/tools.md): the Session's :class:`~duplexkit.engine.api.DecideTools` and
    :class:`~duplexkit.engine.api.TranscribeAudio` are served here, each in its own task, and answered
    through ``Session.receive_engine_output`` (never raised):

    * ``decider``: a :class:`duplexkit.agent.decider.ToolDecider`; None = the engine's own
      (:class:`~duplexkit.agent.decider.EngineToolDecider`: the thinker in text mode, constrained
      decoding). A decider that does not accept audio gets the turn's audio as its transcript first.
    * ``transcriber``: a :class:`duplexkit.agent.transcribe.Transcriber` used for every request;
      None = one per requested model name (:func:`duplexkit.agent.transcribe.make_transcriber`:
      ``minicpm-o`` = the engine's own ASR, ``faster-whisper[:SIZE]``), made on first use.

    ``observer`` (optional, set after construction; the server's metrics use it): an object with
    ``engine_command(cmd)``, ``engine_output(out)`` and ``server_event(event_dict)``, called for each
    command forwarded to the stream, each output pumped from it and each event sent, and optionally
    ``client_event(raw)``, called with each client event (the JSON text or dict as given to
    :meth:`client_event`) before the Session applies it, and ``driver_closed(None)``, called once by
    :meth:`aclose`. More observers (a recording,
    :mod:`duplexkit.recording`) go in with :meth:`add_observer`; each is called after ``observer``, in
    the order added, and a hook an observer lacks is skipped. An exception raised by an observer is
    logged and otherwise ignored.
    """

    def __init__(self, session, engine: Engine, *, on_event: EventSink,
                 on_close: Callable[[Any], Union[None, Awaitable[None]]], tick_interval_s: float = 0.05,
                 decider: Any = None, transcriber: Any = None, tracer_provider: Any = None) -> None:
        self.session = session
        self.engine = engine
        self.stream: Optional[EngineStream] = None
        self.tick_interval_s = tick_interval_s
        self._on_event = on_event
        self._on_close = on_close
        self._t0 = time.monotonic()
        self._out: asyncio.Queue = asyncio.Queue()  # server events and the final CloseConnection
        self._cmds: asyncio.Queue = asyncio.Queue()  # engine commands (OpenStream first)
        self._tasks: list[asyncio.Task] = []
        self._pump_task: Optional[asyncio.Task] = None
        self.dispatch_done = asyncio.Event()
        self.observer: Any = None
        self.observers: list = []  # further observers (add_observer), after ``observer``
        self.decider = decider
        self.transcriber = transcriber
        self._transcribers: dict = {}  # model name -> transcriber (when none was given)
        self._shell_tasks: set[asyncio.Task] = set()
        # OpenTelemetry spans (duplexkit.tracing): None, and nothing imported, while tracing is off
        self.tracer = tracing.session_tracer(session, tracer_provider)
        if self.tracer is not None:
            session.tracing_honoured = True  # the ``tracing`` field then gets no field_ignored warning
            self.add_observer(self.tracer)

    def add_observer(self, observer: Any) -> None:
        """Add an observer (see the class docstring) called after ``observer``."""
        self.observers.append(observer)

    def _observe(self, hook: str, arg) -> None:
        for obs in ((self.observer, *self.observers) if self.observers else (self.observer,)):
            fn = getattr(obs, hook, None) if obs is not None else None
            if fn is not None:
                try:
                    fn(arg)
                except Exception:  # metrics and recordings never break a session
                    logger.exception("session observer %s failed", hook)

    # -- clock and Session calls ------------------------------------------------------------------
    def now_ms(self) -> int:
        return int((time.monotonic() - self._t0) * 1000)

    def flush(self) -> None:
        """Move everything the Session has produced to the event and command queues."""
        for item in self.session.drain():
            (self._cmds if isinstance(item, (EngineCommand, OpenStream)) else self._out).put_nowait(item)

    def start_session(self) -> None:
        """``Session.start`` (emits ``session.created`` and opens the engine stream)."""
        self.session.start(self.now_ms())
        self.flush()

    def client_event(self, raw: Union[str, bytes, dict]) -> None:
        """Apply one client event (a JSON text frame or an already-parsed dict)."""
        self._observe("client_event", raw)
        self.session.receive_client_event(raw, self.now_ms())
        self.flush()

    def close_session(self, reason: str, code: int) -> None:
        """Server-side close (shutdown): ``session.closed{reason}`` then ``CloseConnection(code)``."""
        self.session.close(reason, code, self.now_ms())
        self.flush()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the dispatch and clock tasks (call once, inside the running loop)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._dispatch(), name="session-dispatch"),
                       loop.create_task(self._dispatch_commands(), name="session-commands"),
                       loop.create_task(self._tick(), name="session-tick")]

    async def aclose(self) -> None:
        """Stop the tasks and close the engine stream (its per-stream state is freed)."""
        tasks = list(self._tasks) + list(self._shell_tasks) + ([self._pump_task] if self._pump_task is not None else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._pump_task = [], None
        stream, self.stream = self.stream, None
        if stream is not None:
            try:
                await asyncio.wait_for(stream.aclose(), timeout=30)
            except Exception:  # engine trouble must not leak the caller's resources
                logger.exception("closing the engine stream failed")
        self._observe("driver_closed", None)

    # -- tasks ----------------------------------------------------------------------------------
    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval_s)
            self.session.tick(self.now_ms())
            self.flush()

    async def _pump(self, stream: EngineStream) -> None:
        try:
            async for out in stream.outputs():
                self._observe("engine_output", out)
                self.session.receive_engine_output(out, self.now_ms())
                self.flush()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("engine stream failed")
            self._engine_failed(stream.stream_id, self.session.epoch, f"engine stream failed: {exc}")

    def _engine_failed(self, stream_id: str, epoch: int, message: str) -> None:
        self.session.receive_engine_output(
            EngineFailure(stream_id, epoch, -1, code=ErrorCode.SERVER_ERROR.value, message=message, fatal=True),
            self.now_ms())
        self.flush()

    async def _open_stream(self, cmd: OpenStream) -> None:
        try:
            self.stream = await self.engine.open_stream(cmd.stream_id, cmd.config)
        except Exception as exc:
            logger.exception("open_stream failed")
            self._engine_failed(cmd.stream_id, cmd.epoch, f"engine could not open the stream: {exc}")
            return
        self._pump_task = asyncio.get_running_loop().create_task(self._pump(self.stream), name="session-pump")

    @staticmethod
    async def _call(fn, arg) -> None:
        res = fn(arg)
        if inspect.isawaitable(res):
            await res

    async def _dispatch_commands(self) -> None:
        while True:
            item = await self._cmds.get()
            if isinstance(item, OpenStream):
                await self._open_stream(item)
            elif isinstance(item, ShellCommand):
                self._observe("engine_command", item)
                task = asyncio.get_running_loop().create_task(self._serve_shell(item), name="session-shell")
                self._shell_tasks.add(task)
                task.add_done_callback(self._shell_tasks.discard)
            elif self.stream is not None:
                try:
                    apply_command(self.stream, item)
                    self._observe("engine_command", item)
                except Exception as exc:  # a broken stream fails this session only
                    logger.exception("engine command failed")
                    self._engine_failed(self.stream.stream_id, self.session.epoch, f"engine command failed: {exc}")

    # -- shell commands: the tool decider and the recogniser (docs/tools.md) ----------------------
    def _get_decider(self) -> Any:
        if self.decider is None:
            from duplexkit.agent.decider import EngineToolDecider

            self.decider = EngineToolDecider(self.engine)
        return self.decider

    def _get_transcriber(self, model: Optional[str]) -> Any:
        if self.transcriber is not None:
            return self.transcriber
        key = model or "minicpm-o"
        t = self._transcribers.get(key)
        if t is None:
            from duplexkit.agent.transcribe import make_transcriber

            t = self._transcribers[key] = make_transcriber(key, self.engine)
        return t

    async def _decide(self, cmd: DecideTools) -> ToolDecision:
        decider = self._get_decider()
        if not getattr(decider, "accepts_audio", True):
            from duplexkit.agent.decider import text_messages

            async def transcribe(audio) -> str:
                t = await self._get_transcriber(None).transcribe(
                    TranscribeAudio(cmd.stream_id, cmd.epoch, item_id=cmd.request_id, audio=audio))
                if t.error:
                    raise RuntimeError(f"transcription for the decider failed: {t.error}")
                return t.text

            cmd = dataclasses.replace(cmd, messages=tuple(await text_messages(cmd.messages, transcribe)))
        if cmd.tool_choice != "none" or "on_text" not in inspect.signature(decider.decide).parameters:
            return await decider.decide(cmd)

        def on_text(piece: str) -> None:  # an answer being written: the Session speaks it as it comes
            if piece:
                self.session.receive_engine_output(ToolDecision(cmd.stream_id, cmd.epoch, -1, request_id=cmd.request_id,
                                                                text=piece, final=False), self.now_ms())
                self.flush()

        return await decider.decide(cmd, on_text=on_text)

    async def _serve_shell(self, cmd: ShellCommand) -> None:
        t0 = time.monotonic()
        try:
            if isinstance(cmd, DecideTools):
                out = await self._decide(cmd)
            elif isinstance(cmd, TranscribeAudio):
                out = await self._get_transcriber(cmd.model).transcribe(cmd)
            else:
                raise TypeError(f"unknown shell command {type(cmd).__name__}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed decider/recogniser fails this request only
            logger.exception("%s failed", type(cmd).__name__)
            ms = (time.monotonic() - t0) * 1000
            msg = f"{type(exc).__name__}: {exc}"
            if isinstance(cmd, DecideTools):
                out = ToolDecision(cmd.stream_id, cmd.epoch, -1, request_id=cmd.request_id, error=msg, elapsed_ms=ms)
            else:
                out = Transcription(cmd.stream_id, cmd.epoch, -1, item_id=cmd.item_id, error=msg, elapsed_ms=ms)
        self._observe("engine_output", out)
        self.session.receive_engine_output(out, self.now_ms())
        self.flush()

    async def _dispatch(self) -> None:
        from duplexkit.session import CloseConnection

        try:
            while True:
                item = await self._out.get()
                if isinstance(item, dict):
                    self._observe("server_event", item)
                    await self._call(self._on_event, item)
                elif isinstance(item, CloseConnection):
                    await self._call(self._on_close, item)
                    return
                else:
                    raise TypeError(f"unexpected item from Session.drain(): {type(item).__name__}")
        finally:
            self.dispatch_done.set()
