"""The sans-I/O Session: all conversation logic of one realtime connection, without I/O.

Inputs are *client events* (:meth:`Session.receive_client_event`), *engine outputs*
(:meth:`Session.receive_engine_output`, ``duplexkit.engine.api``) and *clock ticks*
(:meth:`Session.tick`); outputs are collected in order and taken with :meth:`Session.drain`:
JSON-ready server event dicts, engine commands (``OpenStream``, ``AppendUnit``, ``ForceSpeak``,
``CancelEpoch``, ``UpdateStream``, ``CloseStream``) and, last, a :class:`CloseConnection` when the
socket must close. No sockets, asyncio, threads or torch (docs/architecture.md, "The sans-I/O Session").

State machine
-------------
The phase (``new``, ``idle``, ``requested``, ``speaking``, ``closed``) is owned by
:mod:`duplexkit.session.machine`: one table, :data:`~duplexkit.session.machine.TRANSITIONS`
(h11 ``_state.py`` style), and :meth:`PhaseMachine.fire`, the only code that assigns a phase. An
illegal pair raises a :class:`~duplexkit.protocol.TransitionError` naming phase and event, which
becomes one ``error`` event (``response_already_active``, ``response_not_active``).

The Session class is put together from one mixin per job, each in its own module: settings
(``settings``: ``session.update`` validation, formats, turn detection), the input pipeline
(``pipeline``), responses (``responses``: the envelope, deltas, epochs, the latency trace), the
conversation and playback truth (``conversation``), wire objects (``wire``) and the reference voice
(``voice``). This module holds the public API, the output queue and the dispatch.

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
from collections import OrderedDict, deque
from typing import Any, Optional, Union

from duplexkit.audio import InputFormat, StreamDecoder, StreamResampler, UnitFramer
from duplexkit.audio.arrival import ArrivalRateMonitor
from duplexkit.engine.api import (
    AppendUnit,
    AudioChunk,
    ToolDecision,
    Transcription,
    CloseStream,
    Decision,
    EngineCommand,
    EngineFailure,
    EngineOutput,
    INPUT_SAMPLE_RATE,
    OpenStream,
    StreamConfig,
    TextDelta,
    TurnEnd,
    UnitTimings,
)
from duplexkit.protocol import (
    ConversationItemCreateEvent,
    ConversationItemDeleteEvent,
    ConversationItemRetrieveEvent,
    ConversationItemTruncateEvent,
    ErrorCode,
    ErrorEvent,
    ErrorInfo,
    IdFactory,
    InputAudioBufferAppendEvent,
    InputAudioBufferClearEvent,
    InputAudioBufferCommitEvent,
    OutputAudioBufferClearEvent,
    PlaybackAckEvent,
    ProtocolError,
    ResponseCancelEvent,
    ResponseCreateEvent,
    ServerEvent,
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
from duplexkit.errors import BINARY_FRAME
from duplexkit.protocol.vocabulary import PCM_RATE
from duplexkit.session.config import COMMIT_MERGE_MS, CloseConnection, SessionConfig, UNIT_PERIOD_MS
from duplexkit.session.conversation import _ConvItem
from duplexkit.session.responses import _Response, reason_to_cancel
from duplexkit.session.conversation import ConversationMixin
from duplexkit.session.machine import Phase, PhaseEvent, PhaseMachine
from duplexkit.session.pipeline import InputPipelineMixin
from duplexkit.session.responses import ResponsesMixin
from duplexkit.session.settings import SettingsMixin, _Settings, _vad_classes
from duplexkit.session.tools import ToolsMixin
from duplexkit.session.wire import WireObjectsMixin

log = logging.getLogger("duplexkit.session")


class Session(SettingsMixin, InputPipelineMixin, ResponsesMixin, ConversationMixin, ToolsMixin, WireObjectsMixin):
    """One realtime session (docs/protocol.md), as a pure state machine. See the module docstring.

    Args:
        cfg: server-side :class:`SessionConfig`.
        session_id: ``sess_<24 hex>``; None = a fresh one.
        now_ms: the clock at creation (ms, any monotonic origin).

    Every ``receive_*``/``tick`` method appends to an output queue taken by :meth:`drain`; none
    raises on client input (bad input becomes one ``error`` event and changes no state).
    """

    def __init__(self, cfg: Optional[SessionConfig] = None, session_id: Optional[str] = None, now_ms: float = 0) -> None:
        self.cfg = cfg or SessionConfig()
        self.session_id = session_id or new_session_id()
        self.stream_id = self.session_id
        self._ids = IdFactory()
        self._out: list = []
        self._seq = 0
        self.epoch = 0
        self._machine = PhaseMachine()
        self._last_client_ms = float(now_ms)
        duplex = self.cfg.profile == "duplex"
        self._vad_cls = _vad_classes() if self.cfg.vad_available else None
        vad_ok = self._vad_cls is not None
        td = (
            {
                "type": "server_vad",
                "threshold": 0.5,
                "prefix_padding_ms": 300,
                "silence_duration_ms": 500,
                "interrupt_response": True,
                "create_response": not duplex,
            }
            if vad_ok
            else None
        )
        self.settings = _Settings(
            output_modalities=["audio", "text"] if self.cfg.audio_output_available else ["text"],
            instructions=self.cfg.default_instructions,
            voice="default",
            ref_voice=self.cfg.default_voice,
            ref_from_client=False,
            input_format=InputFormat("pcm16", self.cfg.limits.input_default_rate if duplex else PCM_RATE),
            turn_detection=td,
            temperature=float(self.cfg.temperature),
            max_output_tokens=self.cfg.max_output_tokens,
            force_listen_count=0,
            answer_policy=self.cfg.answer_policy or ("model" if duplex else "on_request"),
            playback_commit_policy="ack_only" if duplex else "commit_on_done",
            seed=self.cfg.seed,
            early_unit_close=duplex,
        )
        self._seed_text: list[str] = []
        self._system_text: list[str] = []
        self._engine_config: Optional[StreamConfig] = None  # the config the engine stream has (last sent)
        self._prefix_pending = False  # a new session prefix waits for a turn boundary (settings._sync_stream)
        self._free_units: set = set()  # appended units not forced to listen (pruned to those in flight)
        self._engine_prefix: tuple = (None, None)  # settings' (instructions, seed text) the engine was last given
        self._seed_item_ids: set = set()  # user text items that went into the seed text (before the first unit)
        # input pipeline
        self._decoder = StreamDecoder(self.settings.input_format)
        self._resampler = StreamResampler(self.settings.input_format.rate, INPUT_SAMPLE_RATE)
        self._arrival = ArrivalRateMonitor(self.settings.input_format.rate)
        self._framer = UnitFramer()
        self._pad_debt = 0  # zero padding the model heard ahead of the input (early unit closes), samples
        self._debt_hold: list = []  # real samples held while deciding what the padding stood in for
        self._debt_hold_n = 0
        self._debt_hold_start = 0  # real-sample index of the first held sample
        self._debt_onset: Optional[int] = None  # real-sample index where speech (with pre-roll) starts
        self._unit_hold: deque = deque()  # (Unit, end real-sample index) held for a barge-in fence
        self._unit_hold_samples = 0
        self._last_real_ms = float(now_ms)
        self._vad = None
        self._vad_base_samples = 0
        self._real_samples = 0  # real 16 kHz input samples seen (the VAD timeline)
        self._since_commit = 0  # real 16 kHz samples pushed since the last commit/clear
        self._vad_item: Optional[str] = None
        self._vad_item_committed = False
        self._make_vad()
        self._units_appended = 0
        self.input_appends = 0  # accepted input_audio_buffer.append events (read-only counter)
        self._last_unit_ms = float(now_ms)
        self._inflight: deque = deque()  # (unit_index, samples) appended, not yet decided
        self._inflight_samples = 0
        self._force_listen_left = 0
        self._close_pending_ms: Optional[float] = None  # a client commit's early close, not yet sent
        # conversation
        self._items: "OrderedDict[str, _ConvItem]" = OrderedDict()
        self._used_ids: set = set()
        self._responses: dict[str, _ConvItem] = {}  # response id -> assistant item (responses that opened one)
        self._issued: set = set()  # every response id this session issued
        self._warned: set = set()  # params that already got a session.warning
        self._update_warnings: list = []
        self._resp: Optional[_Response] = None
        self._audio_started = False
        self._stream_open = False
        self.timings: dict = {}
        self._trace_wait: Optional[_Response] = None  # finished, waiting for its forced unit's UnitTimings
        self._now_ms = float(now_ms)  # the clock of the latest input (client event, engine output, tick)
        self._init_tools()

    @property
    def state(self) -> str:
        """``closed`` | ``speaking`` | ``requested`` | ``user_speaking`` | ``idle`` (``new`` before start)."""
        if self.phase is Phase.IDLE and self._vad_item is not None:
            return "user_speaking"
        return self.phase.value

    @property
    def phase(self) -> Phase:
        """The machine's phase (:mod:`duplexkit.session.machine`; read-only)."""
        return self._machine.phase

    @property
    def closed(self) -> bool:
        return self._machine.phase is Phase.CLOSED

    @property
    def started(self) -> bool:
        return self._machine.phase is not Phase.NEW

    @property
    def input_audio_ms(self) -> int:
        """Real input audio received so far, in ms of 16 kHz audio (silence fed by ``tick`` excluded)."""
        return self._real_samples * 1000 // INPUT_SAMPLE_RATE

    @property
    def active_response_id(self) -> Optional[str]:
        return self._resp.id if self._resp is not None else None

    def drain(self) -> list:
        """Take every pending output in order: server event dicts (with ``type``, ``event_id``,
        ``server_event_seq``), :class:`EngineCommand` objects, and finally a :class:`CloseConnection`."""
        out, self._out = self._out, []
        return out

    def start(self, now_ms: float = 0) -> None:
        """Emit ``session.created`` and the ``OpenStream`` command (idempotent)."""
        if self._machine.fire(PhaseEvent.START) is None:
            return
        self._last_client_ms = float(now_ms)
        self._last_unit_ms = float(now_ms)
        self._force_listen_left = self.settings.force_listen_count
        self._emit(SessionCreated(session=self._session_object()))
        self._engine_config = self._stream_config()
        self._engine_prefix = (self._engine_config.instructions, self._engine_config.seed_text)
        self._cmd(OpenStream(self.stream_id, self.epoch, config=self._engine_config))
        self._stream_open = True

    def close(self, reason: str = "shutdown", code: int = 1001, now_ms: float = 0) -> None:
        """Close from the server side (shutdown: ``session.closed{reason}`` then close ``code``)."""
        if self.closed:
            return
        if not self.started:
            self.start(now_ms)
        self._close(reason, code)

    def receive_client_event(self, raw: Union[str, bytes, bytearray, dict], now_ms: float = 0) -> None:
        """Apply one client event (a text frame, its bytes, or a decoded dict). Never raises."""
        if self.closed:
            return
        self._last_client_ms = float(now_ms)
        self._now_ms = float(now_ms)
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
                    self._on_session_update(ev, now_ms, first=True)
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
                self._error(pe)
                self.start(now_ms)
                return
            if not self.started:
                self.start(now_ms)
            self._error(pe)
        except Exception as exc:  # a bug must not kill the connection (docs/protocol.md §9)
            log.exception("session %s: internal error on a client event", self.session_id)
            if not self.started:
                self.start(now_ms)
            self._error(ProtocolError(ErrorCode.SERVER_ERROR, f"internal error: {type(exc).__name__}", event_id=event_id))

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
        self._error(pe)

    def receive_engine_output(self, out: EngineOutput, now_ms: float = 0) -> None:
        """Apply one engine output. Outputs of other streams or older epochs are dropped."""
        if self.closed or not self.started or out.stream_id != self.stream_id:
            return
        self._now_ms = float(now_ms)
        if isinstance(out, ToolDecision):  # matched by request id, not by epoch
            self._on_tool_decision(out, now_ms)
            return
        if isinstance(out, Transcription):  # belongs to a user item, not to an epoch
            self._on_transcription(out)
            return
        if isinstance(out, Decision):
            self._consumed(out.unit_index)
        if isinstance(out, EngineFailure) and out.fatal:
            self._engine_fatal(out)
            return
        if self._trace_wait is not None and isinstance(out, UnitTimings):
            self._trace_engine(self._trace_wait, out)
        if out.epoch != self.epoch:
            return
        if self._resp is not None and self._resp.trace is not None:
            self._trace_output(self._resp, out, now_ms)
        if isinstance(out, Decision):
            self._on_decision(out)
        elif isinstance(out, TextDelta):
            self._on_text(out)
        elif isinstance(out, AudioChunk):
            self._on_audio(out)
        elif isinstance(out, TurnEnd):
            self._on_turn_end(out)
        elif isinstance(out, EngineFailure):
            self._engine_failed(out)
        elif isinstance(out, UnitTimings):
            self.timings = dict(out.timings)
        if self._prefix_pending:
            self._sync_stream()

    def tick(self, now_ms: float) -> None:
        """Advance the clock: idle timeout, and silence feeding while a response is active."""
        if self.closed or not self.started:
            return
        self._now_ms = float(now_ms)
        if now_ms - self._last_client_ms >= self.cfg.limits.idle_timeout_s * 1000:
            self._close("timeout", 1000)
            return
        if self._close_pending_ms is not None and now_ms - self._close_pending_ms >= COMMIT_MERGE_MS:
            self._close_committed(now_ms)
        self._tools_tick(now_ms)
        self._release_units(now_ms)
        if self._resp is not None and now_ms - self._last_unit_ms >= UNIT_PERIOD_MS + self.cfg.silence_slack_ms:
            due = self._last_unit_ms + UNIT_PERIOD_MS  # where this unit ends on the input schedule
            self._feed_silence(now_ms)
            # the next silence unit is due one unit period after this one's place on the schedule, not after
            # the tick that fed it: the slack and the tick's lag are paid once per dry spell, not once per unit,
            # so an answer driven by silence arrives at 1 s of audio per second (issue 36); more than one
            # period behind (a stalled loop), the schedule restarts from now instead of bursting
            self._last_unit_ms = max(due, now_ms - UNIT_PERIOD_MS)
        if self._prefix_pending:
            self._sync_stream()

    def _emit(self, ev: ServerEvent) -> None:
        self._seq += 1
        ev.event_id = self._ids.event()
        ev.server_event_seq = self._seq
        self._out.append(ev.to_wire())

    def _cmd(self, cmd: EngineCommand) -> None:
        if isinstance(cmd, AppendUnit) and not cmd.force_listen:
            self._free_units.add(cmd.unit_index)  # a unit the model may start a turn in
            if len(self._free_units) > 64:  # keep only those still in flight (bounded)
                self._free_units &= {u for u, _ in self._inflight} | {cmd.unit_index}
        self._out.append(cmd)

    def _error(self, pe: ProtocolError) -> None:
        """One ``error`` event; its code in the session's naming (:attr:`SessionConfig.error_codes`,
        docs/protocol.md §9)."""
        self._emit(ErrorEvent(error=ErrorInfo(**pe.to_error_dict(self.cfg.wire_error_codes))))

    @property
    def _duplex(self) -> bool:
        return self.cfg.profile == "duplex"

    def _fire(self, ev: PhaseEvent, event_id: Optional[str] = None) -> Optional[Phase]:
        """Move the phase (:meth:`PhaseMachine.fire`; raises TransitionError where the table says)."""
        return self._machine.fire(ev, event_id)

    def _dispatch(self, ev: Any, now_ms: float) -> None:
        if self._close_pending_ms is not None and not isinstance(ev, _KEEPS_COMMIT_OPEN):
            self._close_committed(now_ms)
        handler = self._HANDLERS[type(ev)]
        handler(self, ev, now_ms)
        if isinstance(ev, ResponseCreateEvent) and ev.response is not None:
            for name in ev.response.ignored:  # accepted, not honoured (docs/protocol.md §4)
                self._warn("field_ignored", f"response.{name} is accepted but not honoured: "
                           + _IGNORED_RESPONSE_FIELDS.get(name, "this server has no such behaviour"), "response." + name)

    def _on_heartbeat(self, ev: SessionHeartbeatEvent, now_ms: float) -> None:
        self._emit(SessionHeartbeatAck(session_id=self.session_id))

    def _on_event_ack(self, ev: SessionEventAckEvent, now_ms: float) -> None:
        return

    def _on_close(self, ev: SessionCloseEvent, now_ms: float) -> None:
        self._close(ev.reason or "client_close", 1000)

    def _close(self, reason: str, code: int) -> None:
        if self._resp is not None:
            self._cancel_active("client_cancelled" if reason == "client_close" else reason_to_cancel(reason))
        self._fire(PhaseEvent.CLOSE)
        self._emit(SessionClosed(session_id=self.session_id, epoch=self.epoch, reason=reason))
        self._cmd(CloseStream(self.stream_id, self.epoch))
        self._out.append(CloseConnection(code, reason))

    _HANDLERS: dict = {}


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

Session._HANDLERS = {
    SessionUpdateEvent: Session._on_session_update,
    InputAudioBufferAppendEvent: Session._on_append,
    InputAudioBufferCommitEvent: Session._on_commit,
    InputAudioBufferClearEvent: Session._on_clear,
    ResponseCreateEvent: Session._on_response_create,
    ResponseCancelEvent: Session._on_response_cancel,
    ConversationItemCreateEvent: Session._on_item_create,
    ConversationItemRetrieveEvent: Session._on_item_retrieve,
    ConversationItemDeleteEvent: Session._on_item_delete,
    ConversationItemTruncateEvent: Session._on_item_truncate,
    PlaybackAckEvent: Session._on_playback_ack,
    SessionHeartbeatEvent: Session._on_heartbeat,
    SessionCloseEvent: Session._on_close,
    SessionEventAckEvent: Session._on_event_ack,
    OutputAudioBufferClearEvent: Session._on_output_clear,
}
