"""``InlineDuplexClient``: the server without the socket (DESIGN.md).

It drives a :class:`duplexkit.session.Session` over an in-process
:class:`~duplexkit.engine.api.Engine` exactly like the server's WebSocket shell does, minus JSON and
the network: client events go to ``Session.receive_client_event`` as dicts, the dicts from
``Session.drain()`` come back as server events, engine commands go to the engine stream with
:func:`~duplexkit.engine.api.apply_command`, and a clock task calls ``Session.tick``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Optional

from duplexkit.engine.api import EngineCommand, EngineError, OpenStream, apply_command

from .base import BaseDuplexClient, DuplexConnectionError

logger = logging.getLogger("duplexkit.clients.inline")

__all__ = ["InlineDuplexClient"]


class InlineDuplexClient(BaseDuplexClient):
    """An in-process duplex client.

    Args:
        engine: any :class:`duplexkit.engine.api.Engine` (``DuplexEngine`` or ``ScriptedEngine``);
            it is shared, not closed by this client.
        profile: ``"duplex"`` (default; extension events, model-native answering) or ``"compat"``
            (PROTOCOL.md §1.2).
        config: a ready :class:`duplexkit.session.SessionConfig`; otherwise keyword arguments that
            name ``SessionConfig`` fields (``answer_policy``, ``max_output_tokens``,
            ``default_instructions``, ``limits``, ...) build one.
        tick_interval_s: how often ``Session.tick`` runs (silence feeding, idle timeout).
        **options: the client options of :class:`~duplexkit.clients.base.BaseDuplexClient`
            (``session``, ``ref_audio``, ``input_rate``, ``player``, ``auto_ack``, ``barge_in``,
            ``request_timeout_s``).
    """

    def __init__(self, engine, *, profile: str = "duplex", config=None, tick_interval_s: float = 0.05,
                 **options: Any) -> None:
        from duplexkit.session import SessionConfig

        cfg_fields = {f.name for f in dataclasses.fields(SessionConfig)}
        cfg_kwargs = {k: options.pop(k) for k in list(options) if k in cfg_fields}
        super().__init__(**options)
        if config is None:
            cfg_kwargs.setdefault("profile", profile)
            cfg_kwargs.setdefault("model_id", getattr(engine, "model_id", "duplexkit"))
            config = SessionConfig(**cfg_kwargs)
        elif cfg_kwargs:
            config = dataclasses.replace(config, **cfg_kwargs)
        self.engine = engine
        self.config = config
        self.tick_interval_s = tick_interval_s
        self._session = None
        self.stream = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._pump_task: Optional[asyncio.Task] = None
        self._t0 = time.monotonic()

    @property
    def session_machine(self):
        """The underlying :class:`duplexkit.session.Session` (for inspection)."""
        return self._session

    def now_ms(self) -> int:
        return int((time.monotonic() - self._t0) * 1000)

    # -- transport ----------------------------------------------------------------------------
    async def _open(self) -> None:
        from duplexkit.session import Session

        self._t0 = time.monotonic()
        self._session = Session(self.config, now_ms=0)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._dispatch_loop(), name="inline-dispatch"),
                       loop.create_task(self._tick_loop(), name="inline-tick")]
        # autostart=0 semantics: the first session.update (sent by connect()) is applied before
        # session.created (PROTOCOL.md §5.1).

    async def _transmit(self, event: dict) -> None:
        s = self._session
        if s is None or getattr(s, "closed", False):
            raise DuplexConnectionError("the session is closed", code="session_closed")
        s.receive_client_event(event, self.now_ms())
        self._flush()
        await asyncio.sleep(0)

    async def _shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._pump_task is not None:
            self._pump_task.cancel()
        await asyncio.gather(*self._tasks, *([self._pump_task] if self._pump_task else []),
                             return_exceptions=True)
        stream, self.stream = self.stream, None
        if stream is not None:
            try:
                await asyncio.wait_for(stream.aclose(), 30)
            except Exception:  # pragma: no cover
                logger.exception("closing the engine stream failed")

    # -- driving the Session --------------------------------------------------------------------
    def _flush(self) -> None:
        for item in self._session.drain():
            self._queue.put_nowait(item)

    async def _dispatch_loop(self) -> None:
        from duplexkit.session import CloseConnection

        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, dict):
                    self._on_server_event(item)
                elif isinstance(item, OpenStream):
                    await self._open_stream(item)
                elif isinstance(item, EngineCommand):
                    if self.stream is not None:
                        apply_command(self.stream, item)
                elif isinstance(item, CloseConnection):
                    self._on_close(item)
                    return
                else:
                    dump = getattr(item, "model_dump", None)
                    if callable(dump):
                        self._on_server_event(dump(exclude_none=True))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # pragma: no cover - defensive
            logger.exception("inline dispatch failed")
            self._on_transport_lost(DuplexConnectionError(f"inline client failed: {exc}"))

    def _on_close(self, item) -> None:
        if item.code in (1000, 1001):
            self._finish_all(None)
        else:
            self._on_transport_lost(DuplexConnectionError(
                f"session closed with {item.code} {item.reason}", code=item.reason or "closed",
                close_code=item.code))

    async def _open_stream(self, cmd: OpenStream) -> None:
        try:
            self.stream = await self.engine.open_stream(cmd.stream_id, cmd.config)
        except Exception as exc:
            logger.exception("open_stream failed")
            self._session.receive_engine_output(
                EngineError(cmd.stream_id, cmd.epoch, -1, code="server_error",
                            message=f"engine could not open the stream: {exc}", fatal=True), self.now_ms())
            self._flush()
            return
        self._pump_task = asyncio.get_running_loop().create_task(self._pump(self.stream), name="inline-pump")

    async def _pump(self, stream) -> None:
        try:
            async for out in stream.outputs():
                self._session.receive_engine_output(out, self.now_ms())
                self._flush()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("engine stream failed")
            self._session.receive_engine_output(
                EngineError(stream.stream_id, self._session.epoch, -1, code="server_error",
                            message=f"engine stream failed: {exc}", fatal=True), self.now_ms())
            self._flush()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval_s)
            if self._session is not None:
                self._session.tick(self.now_ms())
                self._flush()
