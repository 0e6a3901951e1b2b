"""``InlineDuplexClient``: the server without the socket (docs/architecture.md).

It drives a :class:`duplexkit.session.Session` over an in-process
:class:`~duplexkit.engine.api.Engine` with the same :class:`duplexkit.driver.SessionDriver` as the
server's WebSocket shell, minus JSON and the network: client events go to the Session as dicts and
the dicts it produces come back as server events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from .base import BaseDuplexClient, DuplexConnectionError

logger = logging.getLogger("duplexkit.clients.inline")

__all__ = ["InlineDuplexClient"]


class InlineDuplexClient(BaseDuplexClient):
    """An in-process duplex client.

    Args:
        engine: any :class:`duplexkit.engine.api.Engine` (``DuplexEngine`` or ``ScriptedEngine``);
            it is shared, not closed by this client.
        profile: ``"duplex"`` (default; extension events, model-native answering) or ``"compat"``
            (docs/protocol.md §1.2).
        config: a ready :class:`duplexkit.session.SessionConfig`; otherwise keyword arguments that
            name ``SessionConfig`` fields (``answer_policy``, ``max_output_tokens``,
            ``default_instructions``, ``limits``, ...) build one.
        tick_interval_s: how often ``Session.tick`` runs (silence feeding, idle timeout).
        decider: the tool decider the session asks at each user turn end (a
            :class:`duplexkit.agent.ToolDecider`); None = the engine's own
            (:class:`~duplexkit.agent.EngineToolDecider`).
        transcriber: the recogniser for ``input_audio_transcription`` (a
            :class:`duplexkit.agent.Transcriber`); None = one per requested model name
            (:func:`duplexkit.agent.make_transcriber`).
        record: a directory (or a :class:`duplexkit.recording.Recorder`) to record this session into,
            ``DIR/<session_id>/`` (docs/debugging.md); None (default) records nothing.
        tracer_provider: an OpenTelemetry ``TracerProvider`` this session's spans go to
            (docs/debugging.md, "Traces"); None (default): the process's (:func:`duplexkit.tracing.configure`,
            or the ``OTEL_EXPORTER_OTLP_*`` environment), and no tracing when neither is set.
        **options: the client options of :class:`~duplexkit.clients.base.BaseDuplexClient`
            (``session``, ``ref_audio``, ``input_rate``, ``player``, ``auto_ack``, ``barge_in``,
            ``request_timeout_s``, ``tools``, ``tool_choice``).
    """

    def __init__(self, engine, *, profile: str = "duplex", config=None, tick_interval_s: float = 0.05,
                 decider: Any = None, transcriber: Any = None, record: Any = None, tracer_provider: Any = None,
                 **options: Any) -> None:
        from duplexkit.session import SessionConfig

        cfg_fields = {f.name for f in dataclasses.fields(SessionConfig)}
        cfg_kwargs = {k: options.pop(k) for k in list(options) if k in cfg_fields}
        super().__init__(**options)
        if config is None:
            cfg_kwargs.setdefault("profile", profile)
            cfg_kwargs.setdefault("model_id", getattr(engine, "model_id", "duplexkit"))
            cfg_kwargs.setdefault("audio_output_available", bool(getattr(engine, "supports_audio", True)))
            config = SessionConfig(**cfg_kwargs)
        elif cfg_kwargs:
            config = dataclasses.replace(config, **cfg_kwargs)
        self.engine = engine
        self.config = config
        self.tick_interval_s = tick_interval_s
        self.decider = decider
        self.transcriber = transcriber
        self._driver = None
        self.record = record
        self.recording = None  # duplexkit.recording.SessionRecording while recording
        self.tracer_provider = tracer_provider

    @property
    def session_machine(self):
        """The underlying :class:`duplexkit.session.Session` (for inspection)."""
        return self._driver.session if self._driver is not None else None

    @property
    def stream(self):
        """The engine stream of this session (None before it is opened)."""
        return self._driver.stream if self._driver is not None else None

    def now_ms(self) -> int:
        return self._driver.now_ms() if self._driver is not None else 0

    # -- transport: a SessionDriver, as the server uses, with no socket -------------------------
    async def _open(self) -> None:
        from duplexkit.driver import SessionDriver
        from duplexkit.session import Session

        self._driver = SessionDriver(Session(self.config, now_ms=0), self.engine, on_event=self._on_server_event,
                                     on_close=self._on_close, tick_interval_s=self.tick_interval_s,
                                     decider=self.decider, transcriber=self.transcriber,
                                     tracer_provider=self.tracer_provider)
        if self.record is not None:
            from duplexkit.recording import recorder_for

            self.recording = recorder_for(self.record).open_session(
                self._driver.now_ms, side="inline", model_id=self.config.model_id,
                random_weights=getattr(self.engine, "random_weights", None))
            self._driver.add_observer(self.recording)
        self._driver.start()
        # autostart=0 semantics: the first session.update (sent by connect()) is applied before
        # session.created (docs/protocol.md §5.1).

    async def _transmit(self, event: dict) -> None:
        d = self._driver
        if d is None or getattr(d.session, "closed", False):
            raise DuplexConnectionError("the session is closed", code="session_closed")
        d.client_event(event)
        await asyncio.sleep(0)

    async def _shutdown(self) -> None:
        if self._driver is not None:
            await self._driver.aclose()
        if self.recording is not None:
            self.recording.close()

    def _on_close(self, item) -> None:
        self.close_code = item.code
        if item.code in (1000, 1001):
            self._finish_all(None)
        else:
            self._on_transport_lost(DuplexConnectionError(
                f"session closed with {item.code} {item.reason}", code=item.reason or "closed",
                close_code=item.code))
