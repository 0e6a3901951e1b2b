"""The sans-I/O Session: all conversation logic of one realtime connection, without I/O.

Inputs are *client events* (:meth:`Session.receive_client_event`), *engine outputs*
(:meth:`Session.receive_engine_output`, ``duplexkit.engine.api``) and *clock ticks*
(:meth:`Session.tick`); outputs are collected in order and taken with :meth:`Session.drain`:
JSON-ready server event dicts, engine commands (``OpenStream``, ``AppendUnit``, ``ForceSpeak``,
``CancelEpoch``, ``UpdateStream``, ``CloseStream``) and, last, a :class:`CloseConnection` when the
socket must close. No sockets, asyncio, threads or torch (docs/architecture.md, "The sans-I/O Session").

Parts
-----
Like h11's ``Connection``, the Session only composes and dispatches. The work is done by owned
parts, each declaring its state in its own module and talking to the others through narrow
methods (never reading another part's attributes):

* :class:`~duplexkit.session.outbox.Outbox` (``out``): the ordered output queue, the phase machine,
  the epoch and the clock, shared by every part;
* :class:`~duplexkit.session.settings.Settings` (``opts``): ``session.update`` and the engine
  stream's configuration (``Session.settings`` is its current value);
* :class:`~duplexkit.session.pipeline.InputPipeline` (``input``): client audio to units, the VAD,
  the barge-in fence, the padding debt, commit/clear;
* :class:`~duplexkit.session.conversation.Conversation` (``conv``): items and playback truth;
* :class:`~duplexkit.session.responses.Responses` (``resp``): the active response, its envelope and
  deltas, the turn confirmation hold, the latency trace;
* :class:`~duplexkit.session.tools.Tools` (``tools``): the tool decider, calls, transcripts.

State machine
-------------
The phase (``new``, ``idle``, ``requested``, ``speaking``, ``closed``) is owned by
:mod:`duplexkit.session.machine`: one table, :data:`~duplexkit.session.machine.TRANSITIONS`
(h11 ``_state.py`` style), and :meth:`PhaseMachine.fire`, the only code that assigns a phase. An
illegal pair raises a :class:`~duplexkit.protocol.TransitionError` naming phase and event, which
becomes one ``error`` event (``response_already_active``, ``response_not_active``). What is emitted
follows the move taken (:data:`~duplexkit.session.machine.MOVE_EMITS`); a mismatch is an internal
:class:`~duplexkit.session.machine.EmissionError`.

Epochs (docs/protocol.md §3) advance on every accepted cancel, barge-in, token cap and engine failure
of an active response, each paired with a ``CancelEpoch`` command; engine outputs of an older epoch
are dropped here, so no stale delta is ever emitted.

Input: every append is decoded (``StreamDecoder``; declared interleaved channels are downmixed to
mono), checked for its arrival rate against the declared rate (``ArrivalRateMonitor``: one
non-fatal ``input_rate_mismatch`` error per declared format), resampled to 16 kHz (``StreamResampler``),
watched by the server VAD (``StreamingVAD``) and cut into units (``UnitFramer``). While a response
is active and input runs dry, :meth:`Session.tick` appends a silence unit once a unit's deadline
(1 unit period + ``silence_slack_ms`` after the previous unit's place on the input schedule) has
passed, so an answer never stalls: the first silence unit of a dry spell comes 1 period + slack after
the last unit, every later one 1 period after the one before (the slack is not paid again).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional, Union

from duplexkit.engine.api import (
    CloseStream,
    Decision,
    EngineFailure,
    EngineOutput,
    OpenStream,
    ToolDecision,
    Transcription,
    UnitTimings,
)
from duplexkit.errors import BINARY_FRAME
from duplexkit.protocol import (
    ConversationItemCreateEvent,
    ConversationItemDeleteEvent,
    ConversationItemRetrieveEvent,
    ConversationItemTruncateEvent,
    ErrorCode,
    InputAudioBufferAppendEvent,
    InputAudioBufferClearEvent,
    InputAudioBufferCommitEvent,
    OutputAudioBufferClearEvent,
    PlaybackAckEvent,
    ProtocolError,
    ResponseCancelEvent,
    ResponseCreateEvent,
    SessionCloseEvent,
    SessionClosed,
    SessionCreated,
    SessionEventAckEvent,
    SessionHeartbeatAck,
    SessionHeartbeatEvent,
    SessionUpdateEvent,
    new_session_id,
    parse_client_event,
)
from duplexkit.session.config import SessionConfig
from duplexkit.session.conversation import Conversation
from duplexkit.session.machine import Phase, PhaseEvent
from duplexkit.session.outbox import Outbox
from duplexkit.session.pipeline import InputPipeline
from duplexkit.session.responses import Responses, reason_to_cancel
from duplexkit.session.settings import Settings
from duplexkit.session.tools import Tools

log = logging.getLogger("duplexkit.session")


class Session:
    """One realtime session (docs/protocol.md), as a pure state machine. See the module docstring.

    Args:
        cfg: server-side :class:`SessionConfig`.
        session_id: ``sess_<24 hex>``; None = a fresh one.
        now_ms: the clock at creation (ms, any monotonic origin).

    Every ``receive_*``/``tick`` method appends to an output queue taken by :meth:`drain`; none
    raises on client input (bad input becomes one ``error`` event and changes no state).

    ``tracing_honoured`` (default False) is set by a shell that traces this session
    (:mod:`duplexkit.tracing`): the ``tracing`` field then gets no ``field_ignored`` warning.
    """

    def __init__(self, cfg: Optional[SessionConfig] = None, session_id: Optional[str] = None, now_ms: float = 0) -> None:
        self.cfg = cfg or SessionConfig()
        self.session_id = session_id or new_session_id()
        self.stream_id = self.session_id
        self.out = Outbox(self.cfg, self.session_id, now_ms)
        self._last_client_ms = float(now_ms)
        self.timings: dict = {}  # the latest UnitTimings of the current epoch (read-only)
        self.opts = Settings(self)
        self.conv = Conversation(self)
        self.resp = Responses(self)
        self.tools = Tools(self)
        self.input = InputPipeline(self, now_ms)

    # -- state (read-only) ------------------------------------------------------------------------

    @property
    def tracing_honoured(self) -> bool:
        """Whether a shell traces this session (the ``tracing`` field then gets no warning)."""
        return self.opts.tracing_honoured

    @tracing_honoured.setter
    def tracing_honoured(self, value: bool) -> None:
        self.opts.tracing_honoured = bool(value)
    @property
    def settings(self):
        """The current settings (``session.update`` applied; read-only for callers)."""
        return self.opts.current

    @property
    def state(self) -> str:
        """``closed`` | ``speaking`` | ``requested`` | ``user_speaking`` | ``idle`` (``new`` before start)."""
        if self.phase is Phase.IDLE and self.input.user_speaking():
            return "user_speaking"
        return self.phase.value

    @property
    def phase(self) -> Phase:
        """The machine's phase (:mod:`duplexkit.session.machine`; read-only)."""
        return self.out.phase

    @property
    def closed(self) -> bool:
        return self.out.phase is Phase.CLOSED

    @property
    def started(self) -> bool:
        return self.out.phase is not Phase.NEW

    @property
    def epoch(self) -> int:
        """The current epoch (docs/protocol.md §3)."""
        return self.out.epoch

    @property
    def input_audio_ms(self) -> int:
        """Real input audio received so far, in ms of 16 kHz audio (silence fed by ``tick`` excluded)."""
        return self.input.input_ms()

    @property
    def input_appends(self) -> int:
        """Accepted ``input_audio_buffer.append`` events (read-only counter)."""
        return self.input.input_appends

    @property
    def active_response_id(self) -> Optional[str]:
        r = self.resp.active()
        return r.id if r is not None else None

    def item_playback(self, item_id: str) -> tuple[int, int, bool]:
        """``(sent_ms, committed_ms, final)`` of an assistant item. KeyError if unknown."""
        return self.conv.item_playback(item_id)

    def history(self) -> list[dict]:
        """The conversation history at playback truth (docs/protocol.md §7.5): list of item dicts."""
        return self.conv.history()

    # read-only views of the pipeline kept for tests and benchmarks that inspect it
    _framer = property(lambda self: self.input._framer)
    _decoder = property(lambda self: self.input._decoder)
    _since_commit = property(lambda self: self.input._since_commit)
    _units_appended = property(lambda self: self.input._units_appended)
    _close_pending_ms = property(lambda self: self.input._close_pending_ms)

    def _session_object(self):
        return self.opts.session_object()

    # -- inputs -----------------------------------------------------------------------------------
    def drain(self) -> list:
        """Take every pending output in order: server event dicts (with ``type``, ``event_id``,
        ``server_event_seq``), :class:`EngineCommand` objects, and finally a :class:`CloseConnection`."""
        return self.out.drain()

    def start(self, now_ms: float = 0) -> None:
        """Emit ``session.created`` and the ``OpenStream`` command (idempotent)."""
        if self.out.fire(PhaseEvent.START) is None:
            return
        self._last_client_ms = float(now_ms)
        self.input.started(now_ms)
        self.out.emit(SessionCreated(session=self.opts.session_object()))
        self.out.cmd(OpenStream(self.stream_id, self.epoch, config=self.opts.open_stream()))

    def close(self, reason: str = "shutdown", code: int = 1001, now_ms: float = 0) -> None:
        """Close from the server side (shutdown: ``session.closed{reason}`` then close ``code``)."""
        if self.closed:
            return
        if not self.started:
            self.start(now_ms)
        self.out.machine.begin_step()
        self._close(reason, code)

    def receive_client_event(self, raw: Union[str, bytes, bytearray, dict], now_ms: float = 0) -> None:
        """Apply one client event (a text frame, its bytes, or a decoded dict). Never raises."""
        if self.closed:
            return
        self.out.machine.begin_step()
        self._last_client_ms = self.out.now_ms = float(now_ms)
        event_id = raw.get("event_id") if isinstance(raw, dict) and isinstance(raw.get("event_id"), str) else None
        first_update = not self.started and (
            isinstance(raw, dict) and raw.get("type") == "session.update"
            or isinstance(raw, (str, bytes, bytearray)) and _looks_like_session_update(raw))
        ev_type: Optional[str] = None
        try:
            ev = parse_client_event(raw, max_event_bytes=self.cfg.limits.max_event_bytes)
            event_id, ev_type = ev.event_id, ev.type
            if not self.started:
                if isinstance(ev, SessionUpdateEvent):
                    self.opts.on_session_update(ev, now_ms, first=True)
                    return
                self.start(now_ms)
            self._dispatch(ev, now_ms)
        except ProtocolError as pe:
            if pe.event_type is None:
                pe.event_type = ev_type  # for OpenAI's per-event codes (None when it did not parse)
            if not self.started and first_update:
                # a rejected first session.update (autostart=0): the error (echoing its event_id)
                # comes BEFORE session.created, so a client's connect() can fail on it; the
                # session then starts with the defaults (docs/protocol.md §5.1)
                self.out.error(pe)
                self.start(now_ms)
                return
            if not self.started:
                self.start(now_ms)
            self.out.error(pe)
        except Exception as exc:  # a bug must not kill the connection (docs/protocol.md §9)
            log.exception("session %s: internal error on a client event", self.session_id)
            if not self.started:
                self.start(now_ms)
            self.out.error(ProtocolError(ErrorCode.SERVER_ERROR, f"internal error: {type(exc).__name__}",
                                         event_id=event_id))

    def receive_binary_frame(self, now_ms: float = 0) -> None:
        """A binary WebSocket frame: answered with ``error{bad_event}`` and otherwise ignored
        (docs/protocol.md §1.3, §9). Never raises."""
        if self.closed:
            return
        self._last_client_ms = float(now_ms)
        if not self.started:
            self.start(now_ms)
        pe = ProtocolError(ErrorCode.BAD_EVENT, "binary frames are not supported: send each event as a JSON text frame")
        pe.event_type = BINARY_FRAME
        self.out.error(pe)

    def receive_engine_output(self, out: EngineOutput, now_ms: float = 0) -> None:
        """Apply one engine output. Outputs of other streams or older epochs are dropped."""
        if self.closed or not self.started or out.stream_id != self.stream_id:
            return
        self.out.machine.begin_step()
        self.out.now_ms = float(now_ms)
        if isinstance(out, ToolDecision):  # matched by request id, not by epoch
            self.tools.on_tool_decision(out, now_ms)
            return
        if isinstance(out, Transcription):  # belongs to a user item, not to an epoch
            self.tools.on_transcription(out)
            return
        if isinstance(out, Decision):
            self.input.consumed(out.unit_index)
        if isinstance(out, EngineFailure) and out.fatal:
            self.resp.engine_fatal(out)
            return
        self.resp.on_output(out, now_ms)
        if isinstance(out, UnitTimings) and out.epoch == self.epoch:
            self.timings = dict(out.timings)
        if self.opts.prefix_pending():
            self.opts.sync_stream()

    def tick(self, now_ms: float) -> None:
        """Advance the clock: idle timeout, a held commit's unit, the tool clocks, and silence
        feeding while a response is active."""
        if self.closed or not self.started:
            return
        self.out.machine.begin_step()
        self.out.now_ms = float(now_ms)
        if now_ms - self._last_client_ms >= self.cfg.limits.idle_timeout_s * 1000:
            self._close("timeout", 1000)
            return
        self.input.close_held_commit(now_ms, due_only=True)
        self.tools.tick(now_ms)
        self.input.tick(now_ms)
        if self.opts.prefix_pending():
            self.opts.sync_stream()

    # -- dispatch ---------------------------------------------------------------------------------
    def _dispatch(self, ev: Any, now_ms: float) -> None:
        if not isinstance(ev, _KEEPS_COMMIT_OPEN):
            self.input.close_held_commit(now_ms)
        part, method = _HANDLERS[type(ev)]
        getattr(getattr(self, part) if part else self, method)(ev, now_ms)
        if isinstance(ev, ResponseCreateEvent) and ev.response is not None:
            for name in ev.response.ignored:  # accepted, not honoured (docs/protocol.md §4)
                self.out.warn("field_ignored", f"response.{name} is accepted but not honoured: "
                              + _IGNORED_RESPONSE_FIELDS.get(name, "this server has no such behaviour"),
                              "response." + name)

    def _on_heartbeat(self, ev: SessionHeartbeatEvent, now_ms: float) -> None:
        self.out.emit(SessionHeartbeatAck(session_id=self.session_id))

    def _on_event_ack(self, ev: SessionEventAckEvent, now_ms: float) -> None:
        return

    def _on_close(self, ev: SessionCloseEvent, now_ms: float) -> None:
        self._close(ev.reason or "client_close", 1000)

    def _close(self, reason: str, code: int) -> None:
        self.out.fire(PhaseEvent.CLOSE)  # the move to closed ends the active response (response.done)
        if self.resp.active() is not None:
            self.resp.cancel_active("client_cancelled" if reason == "client_close" else reason_to_cancel(reason))
        self.out.emit(SessionClosed(session_id=self.session_id, epoch=self.epoch, reason=reason))
        self.out.cmd(CloseStream(self.stream_id, self.epoch))
        self.out.close_connection(code, reason)


#: client event type -> (part attribute of the Session, or "" for the Session itself; method name).
_HANDLERS: dict = {
    SessionUpdateEvent: ("opts", "on_session_update"),
    InputAudioBufferAppendEvent: ("input", "on_append"),
    InputAudioBufferCommitEvent: ("input", "on_commit"),
    InputAudioBufferClearEvent: ("input", "on_clear"),
    ResponseCreateEvent: ("resp", "on_response_create"),
    ResponseCancelEvent: ("resp", "on_response_cancel"),
    OutputAudioBufferClearEvent: ("resp", "on_output_clear"),
    ConversationItemCreateEvent: ("conv", "on_item_create"),
    ConversationItemRetrieveEvent: ("conv", "on_item_retrieve"),
    ConversationItemDeleteEvent: ("conv", "on_item_delete"),
    ConversationItemTruncateEvent: ("conv", "on_item_truncate"),
    PlaybackAckEvent: ("conv", "on_playback_ack"),
    SessionHeartbeatEvent: ("", "_on_heartbeat"),
    SessionCloseEvent: ("", "_on_close"),
    SessionEventAckEvent: ("", "_on_event_ack"),
}


#: ``response.create`` fields that are accepted but not honoured, and why (the ``session.warning``).
_IGNORED_RESPONSE_FIELDS = {
    "instructions": "per-response instructions would need a new prefill of the duplex model's context "
                    "for one response; set session instructions instead (docs/protocol.md §4.1)",
    "input": "out-of-band input items are not supported: the response answers the conversation",
    "prompt": "stored prompts are an OpenAI service; send the text as session instructions",
    "voice": "the voice is the session's (a reference clip, docs/protocol.md §8); set it with session.update",
    "audio.output.voice": "the voice is the session's (a reference clip, docs/protocol.md §8); set it with "
                          "session.update",
}


def _looks_like_session_update(raw: Union[str, bytes, bytearray]) -> bool:
    """Whether a raw text frame is a ``session.update`` (checked only for a session's first event)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("type") == "session.update"


_KEEPS_COMMIT_OPEN = (ResponseCreateEvent, SessionHeartbeatEvent, SessionEventAckEvent, PlaybackAckEvent,
                      ConversationItemRetrieveEvent)
"""Client events that do not close a commit's held-back unit (:data:`COMMIT_MERGE_MS`)."""
