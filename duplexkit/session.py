"""The sans-I/O Session: all conversation logic of one realtime connection, without I/O.

Inputs are *client events* (:meth:`Session.receive_client_event`), *engine outputs*
(:meth:`Session.receive_engine_output`, ``duplexkit.engine.api``) and *clock ticks*
(:meth:`Session.tick`); outputs are collected in order and taken with :meth:`Session.drain`:
JSON-ready server event dicts, engine commands (``OpenStream``, ``AppendUnit``, ``ForceSpeak``,
``CancelEpoch``, ``UpdateStream``, ``CloseStream``) and, last, a :class:`CloseConnection` when the
socket must close. No sockets, asyncio, threads or torch (docs/architecture.md, "The sans-I/O Session").

State machine
-------------
The response lifecycle is one table, :data:`TRANSITIONS` (h11 ``_state.py`` style): ``phase ->
event -> next phase | error code``. Phases:

* ``idle`` — no response is active (the model listens; ``response.listen`` beats in duplex profile);
* ``requested`` — a response was pre-created by ``response.create`` or a VAD ``create_response``
  commit: ``response.created`` is out, its forced unit (``AppendUnit.force_speak``) went out at once;
* ``speaking`` — the envelope is open (item, output item, content part, ``response.speak``) and
  deltas flow;
* ``closed`` — the session is closed; everything is ignored.

Events: ``create``, ``speak`` (a speak decision or output content), ``listen`` (a listen decision
before the forced unit), ``forced_listen`` (the forced unit decided listen), ``turn_end``,
``cancel`` (``response.cancel`` / cancelling ``output_audio_buffer.clear``), ``barge_in`` (server
VAD speech over a response), ``token_cap``, ``fail``, ``close``. An illegal pair raises a
:class:`~duplexkit.protocol.TransitionError` naming phase and event, which becomes one ``error``
event (``response_already_active``, ``response_not_active``).

Epochs (docs/protocol.md §3) advance on every accepted cancel, barge-in, token cap and engine failure
of an active response, each paired with a ``CancelEpoch`` command; engine outputs of an older epoch
are dropped here, so no stale delta is ever emitted.

Input: every append is decoded (``StreamDecoder``; declared interleaved channels are downmixed to
mono), checked for its arrival rate against the declared rate (``ArrivalRateMonitor``: one
non-fatal ``input_rate_mismatch`` error per declared format), resampled to 16 kHz (``StreamResampler``),
watched by the server VAD (``StreamingVAD``) and cut into units (``UnitFramer``). While a response
is active and input runs dry, :meth:`Session.tick` appends a silence unit once a unit's deadline
(1 unit period + ``silence_slack_ms`` after the previous unit) has passed, so an answer never stalls.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Optional, Union

import numpy as np

from duplexkit.audio import (
    AudioFormatError,
    InputFormat,
    StreamDecoder,
    StreamResampler,
    UnitFramer,
    b64decode_audio,
    b64encode_audio,
    float32_to_pcm16,
    read_wav,
)
from duplexkit.audio.arrival import ArrivalRateMonitor
from duplexkit.engine.api import (
    INPUT_SAMPLE_RATE,
    OUTPUT_SAMPLE_RATE,
    AppendUnit,
    AudioChunk,
    CancelEpoch,
    CloseStream,
    Decision,
    EngineCommand,
    EngineError,
    EngineOutput,
    ForceSpeak,
    OpenStream,
    ReferenceVoice,
    StreamConfig,
    TextDelta,
    TurnEnd,
    UnitTimings,
    UpdateStream,
)
from duplexkit.protocol import (
    AudioConfig,
    AudioFormatObject,
    AudioInputConfig,
    AudioOutputConfig,
    Capabilities,
    ContentPart,
    ContentPartAdded,
    ContentPartDone,
    ConversationItemAdded,
    ConversationItemCreateEvent,
    ConversationItemDeleted,
    ConversationItemDeleteEvent,
    ConversationItemDone,
    ConversationItemRetrieved,
    ConversationItemRetrieveEvent,
    ConversationItemTruncated,
    ConversationItemTruncateEvent,
    DeltaMetadata,
    ErrorCode,
    ErrorEvent,
    ErrorInfo,
    IdFactory,
    InputAudioBufferAppendEvent,
    InputAudioBufferClearEvent,
    InputAudioBufferCleared,
    InputAudioBufferCommitEvent,
    InputAudioBufferCommitted,
    Item,
    OutputAudioBufferCleared,
    OutputAudioBufferClearEvent,
    OutputAudioDelta,
    OutputAudioDone,
    OutputAudioTranscriptDelta,
    OutputAudioTranscriptDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    Part,
    PlaybackAckEvent,
    ProtocolError,
    RefAudioInfo,
    ResponseCancelEvent,
    ResponseCreated,
    ResponseCreateEvent,
    ResponseDone,
    ResponseListen,
    ResponseObject,
    ResponseSpeak,
    ServerEvent,
    SessionClosed,
    SessionCloseEvent,
    SessionCreated,
    SessionEventAckEvent,
    SessionHeartbeatAck,
    SessionWarning,
    SessionHeartbeatEvent,
    SessionObject,
    SessionPatch,
    SessionUpdated,
    SessionUpdateEvent,
    SpeechStarted,
    SpeechStopped,
    StatusDetails,
    TextMark,
    TransitionError,
    TurnDetectionObject,
    Usage,
    new_session_id,
    parse_client_event,
)
from duplexkit.protocol.server_events import StatusError

__all__ = [
    "Session",
    "SessionConfig",
    "SessionLimits",
    "CloseConnection",
    "Phase",
    "TEvent",
    "TRANSITIONS",
    "UNIT_PERIOD_MS",
]

log = logging.getLogger(__name__)
trace_log = logging.getLogger("duplexkit.latency")
"""Latency trace (debug option, docs/benchmarks.md "Latency trace"): at DEBUG level the Session logs
one JSON line per finished response with its request -> forced unit -> decision -> first audio
stamps (Session clock, ms) and the forced unit's engine ``UnitTimings``."""

UNIT_PERIOD_MS = 1000
"""One duplex unit = 1 s of input (docs/model.md §3.1, docs/protocol.md §5.1 ``chunk_period_ms``)."""

MIN_COMMIT_SAMPLES = INPUT_SAMPLE_RATE // 10
"""100 ms at 16 kHz: a commit needs at least this much input since the last commit/clear (§4)."""

REF_AUDIO_MIN_S = 0.5
"""Shortest reference voice clip, seconds (docs/protocol.md §8.2)."""

REF_TRIM_SAMPLES = INPUT_SAMPLE_RATE // 10
"""Reference voice is trimmed to whole 100 ms = 1600 samples at 16 kHz (docs/protocol.md §8.3)."""

EXTENSION_EVENTS = ["response.speak", "response.listen", "session.closed", "session.heartbeat_ack"]


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------


@dataclass
class SessionLimits:
    """Per-session limits (docs/protocol.md §1.3, §1.5, §6.1, §8.2).

    Attributes:
        max_event_bytes: largest accepted client event, bytes (``--max-event-bytes``, 16 MiB).
        max_pending_input_s: input not yet consumed by the model before ``input_backpressure``, s.
        idle_timeout_s: close with reason ``timeout`` after this long without a client event, s.
        max_ref_audio_s: longest reference voice clip, s (``--max-ref-audio-s``).
        input_default_rate: Hz of a bare ``pcm16`` in the duplex profile (``--default-input-rate``).
    """

    max_event_bytes: int = 16 * 1024 * 1024
    max_pending_input_s: float = 10.0
    idle_timeout_s: float = 300.0
    max_ref_audio_s: float = 30.0
    input_default_rate: int = 16000


@dataclass
class SessionConfig:
    """Server-side configuration of a Session.

    Attributes:
        profile: ``"duplex"`` (extension events, ``ack_only``, model-native answering) or
            ``"compat"`` (OpenAI turn-based defaults, docs/protocol.md §1.2).
        model_id: echoed as ``session.model``.
        default_instructions: the server's default system prompt (None = the model default).
        answer_policy: ``"model"`` | ``"on_request"`` | None (profile default, §4.1).
        max_output_tokens: server default token cap per response (``--max-output-tokens``).
        default_voice: the default reference voice (None = the engine's bundled one).
        voices: voice table name -> ReferenceVoice.
        ref_audio_loader: callable(path) -> WAV bytes enforcing ``--ref-audio-dir``; None = paths refused.
        vad_available: False when the server VAD cannot run (turn detection defaults to null).
        temperature: default sampling temperature (0–2).
        silence_slack_ms: grace after a unit deadline before silence is fed (ms).
        audio_output_available: False when the engine has no vocoder (a checkpoint without
            ``assets/token2wav``): sessions default to ``["text"]`` and asking for audio is a
            ``bad_event`` that says why.
        seed: default sampling seed (None = nondeterministic); clients may set
            ``extra_body.seed`` (duplexkit extension) to make sampling repeatable on the same hardware.
        limits: :class:`SessionLimits`.
    """

    profile: str = "duplex"
    model_id: str = "minicpm-o-4.5"
    default_instructions: Optional[str] = None
    answer_policy: Optional[str] = None
    max_output_tokens: Union[int, str] = 1024
    default_voice: Optional[ReferenceVoice] = None
    voices: dict = field(default_factory=dict)
    ref_audio_loader: Optional[Callable[[str], bytes]] = None
    vad_available: bool = True
    temperature: float = 0.7
    silence_slack_ms: int = 250
    seed: Optional[int] = None
    audio_output_available: bool = True
    limits: SessionLimits = field(default_factory=SessionLimits)

    def __post_init__(self) -> None:
        if self.profile not in ("duplex", "compat"):
            raise ValueError(f"profile must be 'duplex' or 'compat', got {self.profile!r}")
        if self.answer_policy not in (None, "model", "on_request"):
            raise ValueError(f"answer_policy must be None, 'model' or 'on_request', got {self.answer_policy!r}")


@dataclass(frozen=True)
class CloseConnection:
    """The socket must close with WebSocket ``code`` (docs/protocol.md §1.5) after sending what precedes."""

    code: int
    reason: str


# ------------------------------------------------------------------------------------------------
# the transition table
# ------------------------------------------------------------------------------------------------


class Phase(str, Enum):
    IDLE = "idle"
    REQUESTED = "requested"
    SPEAKING = "speaking"
    CLOSED = "closed"


class TEvent(str, Enum):
    CREATE = "create"
    SPEAK = "speak"
    LISTEN = "listen"
    FORCED_LISTEN = "forced_listen"
    TURN_END = "turn_end"
    CANCEL = "cancel"
    BARGE_IN = "barge_in"
    TOKEN_CAP = "token_cap"
    FAIL = "fail"
    CLOSE = "close"


_I, _R, _S, _C = Phase.IDLE, Phase.REQUESTED, Phase.SPEAKING, Phase.CLOSED
_ALREADY = ErrorCode.RESPONSE_ALREADY_ACTIVE
_NOT_ACTIVE = ErrorCode.RESPONSE_NOT_ACTIVE

#: phase -> event -> next phase, or the error code answering an illegal client event.
#: ``None`` = ignored (no state change, nothing emitted by the transition itself).
TRANSITIONS: dict[Phase, dict[TEvent, Union[Phase, ErrorCode, None]]] = {
    _I: {
        TEvent.CREATE: _R,
        TEvent.SPEAK: _S,  # the model starts answering on its own (trigger=model)
        TEvent.LISTEN: _I,  # beat
        TEvent.FORCED_LISTEN: None,
        TEvent.TURN_END: None,
        TEvent.CANCEL: _NOT_ACTIVE,
        TEvent.BARGE_IN: _I,  # speech_started with nothing active: no epoch change
        TEvent.TOKEN_CAP: None,
        TEvent.FAIL: _I,
        TEvent.CLOSE: _C,
    },
    _R: {
        TEvent.CREATE: _ALREADY,
        TEvent.SPEAK: _S,  # continue the pre-created response's envelope
        TEvent.LISTEN: _R,  # a unit before the forced one
        TEvent.FORCED_LISTEN: _I,  # terminating listen + response.done(completed, output [])
        TEvent.TURN_END: _I,
        TEvent.CANCEL: _I,
        TEvent.BARGE_IN: _I,
        TEvent.TOKEN_CAP: _I,
        TEvent.FAIL: _I,
        TEvent.CLOSE: _C,
    },
    _S: {
        TEvent.CREATE: _ALREADY,
        TEvent.SPEAK: _S,
        TEvent.LISTEN: _S,
        TEvent.FORCED_LISTEN: _S,
        TEvent.TURN_END: _I,
        TEvent.CANCEL: _I,
        TEvent.BARGE_IN: _I,
        TEvent.TOKEN_CAP: _I,
        TEvent.FAIL: _I,
        TEvent.CLOSE: _C,
    },
    _C: {ev: None for ev in TEvent},
}


# ------------------------------------------------------------------------------------------------
# records
# ------------------------------------------------------------------------------------------------


@dataclass
class _Item:
    id: str
    role: str
    kind: str  # "input_audio" | "input_text" | "output_audio" | "output_text"
    status: str = "completed"
    text: str = ""  # user/system text, or the assistant transcript/text sent so far
    response_id: Optional[str] = None
    marks: list = field(default_factory=list)  # [(text_chars, audio_end_ms)]
    sent_ms: int = 0
    committed_ms: int = 0
    final: bool = False


@dataclass
class _Response:
    id: str
    item_id: str
    epoch: int
    trigger: str
    audio: bool
    modalities: list
    metadata: Optional[dict]
    max_tokens: Optional[int]
    forced_unit: Optional[int]
    opened: bool = False
    parts: list = field(default_factory=list)
    chars: int = 0
    samples: int = 0
    tokens: int = 0
    pending_pcm: bytes = b""  # < 1 ms of audio held for the next chunk
    pending_text: str = ""
    trace: Optional[dict] = None  # latency trace stamps (trace_log at DEBUG only)


@dataclass
class _Settings:
    output_modalities: list
    instructions: Optional[str]
    voice: str
    ref_voice: Optional[ReferenceVoice]
    ref_from_client: bool
    input_format: InputFormat
    turn_detection: Optional[dict]
    temperature: float
    max_output_tokens: Union[int, str]
    force_listen_count: int
    answer_policy: str
    playback_commit_policy: str
    seed: Optional[int] = None
    early_unit_close: bool = True

    def copy(self) -> "_Settings":
        s = _Settings(**self.__dict__)
        s.output_modalities = list(self.output_modalities)
        s.turn_detection = dict(self.turn_detection) if self.turn_detection is not None else None
        return s


#: OpenAI semantic_vad eagerness -> server VAD silence_duration_ms (ms). Our choice: OpenAI documents
#: only the order (high answers soonest, low waits longest; auto = medium), not durations.
SEMANTIC_VAD_SILENCE_MS = {"high": 300, "medium": 500, "auto": 500, "low": 1000}

_NO_VOCODER = ("this server has no vocoder (its checkpoint lacks assets/token2wav), so it answers in text only: "
               "expected output_modalities ['text']")


def _vad_classes():
    """The server VAD from duplexkit.audio (None when it is not available)."""
    try:
        import webrtcvad  # noqa: F401  (webrtcvad-wheels)

        from duplexkit.audio import StreamingVAD, VadConfig  # noqa: WPS433
    except ImportError:
        return None
    return StreamingVAD, VadConfig


_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://")


# ------------------------------------------------------------------------------------------------
# the Session
# ------------------------------------------------------------------------------------------------


class Session:
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
        self.phase = Phase.IDLE
        self.closed = False
        self._started = False
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
            input_format=InputFormat("pcm16", self.cfg.limits.input_default_rate if duplex else 24000),
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
        # conversation
        self._items: "OrderedDict[str, _Item]" = OrderedDict()
        self._used_ids: set = set()
        self._responses: dict[str, _Item] = {}  # response id -> assistant item (responses that opened one)
        self._issued: set = set()  # every response id this session issued
        self._warned: set = set()  # params that already got a session.warning
        self._update_warnings: list = []
        self._resp: Optional[_Response] = None
        self._audio_started = False
        self._stream_open = False
        self.timings: dict = {}
        self._trace_wait: Optional[_Response] = None  # finished, waiting for its forced unit's UnitTimings

    # -------------------------------------------------------------------------------- public API

    @property
    def state(self) -> str:
        """``closed`` | ``speaking`` | ``requested`` | ``user_speaking`` | ``idle`` (``new`` before start)."""
        if self.closed:
            return "closed"
        if not self._started:
            return "new"
        if self.phase in (Phase.SPEAKING, Phase.REQUESTED):
            return self.phase.value
        if self._vad_item is not None:
            return "user_speaking"
        return "idle"

    @property
    def started(self) -> bool:
        return self._started

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
        if self._started or self.closed:
            return
        self._started = True
        self._last_client_ms = float(now_ms)
        self._last_unit_ms = float(now_ms)
        self._force_listen_left = self.settings.force_listen_count
        self._emit(SessionCreated(session=self._session_object()))
        self._cmd(OpenStream(self.stream_id, self.epoch, config=self._stream_config()))
        self._stream_open = True

    def close(self, reason: str = "shutdown", code: int = 1001, now_ms: float = 0) -> None:
        """Close from the server side (shutdown: ``session.closed{reason}`` then close ``code``)."""
        if self.closed:
            return
        if not self._started:
            self.start(now_ms)
        self._close(reason, code)

    def receive_client_event(self, raw: Union[str, bytes, bytearray, dict], now_ms: float = 0) -> None:
        """Apply one client event (a text frame, its bytes, or a decoded dict). Never raises."""
        if self.closed:
            return
        self._last_client_ms = float(now_ms)
        event_id = raw.get("event_id") if isinstance(raw, dict) and isinstance(raw.get("event_id"), str) else None
        first_update = not self._started and (
            isinstance(raw, dict) and raw.get("type") == "session.update"
            or isinstance(raw, (str, bytes, bytearray)) and _looks_like_session_update(raw))
        try:
            ev = parse_client_event(raw, max_event_bytes=self.cfg.limits.max_event_bytes)
            event_id = ev.event_id
            if not self._started:
                if isinstance(ev, SessionUpdateEvent):
                    self._on_session_update(ev, now_ms, first=True)
                    return
                self.start(now_ms)
            self._dispatch(ev, now_ms)
        except ProtocolError as pe:
            if not self._started and first_update:
                # a rejected first session.update (autostart=0): the error (echoing its event_id)
                # comes BEFORE session.created, so a client's connect() can fail on it; the
                # session then starts with the defaults (docs/protocol.md §5.1)
                self._error(pe)
                self.start(now_ms)
                return
            if not self._started:
                self.start(now_ms)
            self._error(pe)
        except Exception as exc:  # a bug must not kill the connection (docs/protocol.md §9)
            log.exception("session %s: internal error on a client event", self.session_id)
            if not self._started:
                self.start(now_ms)
            self._error(ProtocolError(ErrorCode.SERVER_ERROR, f"internal error: {type(exc).__name__}", event_id=event_id))

    def receive_binary_frame(self, now_ms: float = 0) -> None:
        """A binary WebSocket frame: answered with ``error{bad_event}`` and otherwise ignored
        (docs/protocol.md §1.3, §9). Never raises."""
        if self.closed:
            return
        self._last_client_ms = float(now_ms)
        if not self._started:
            self.start(now_ms)
        self._error(ProtocolError(ErrorCode.BAD_EVENT,
                                  "binary frames are not supported: send each event as a JSON text frame"))

    def receive_engine_output(self, out: EngineOutput, now_ms: float = 0) -> None:
        """Apply one engine output. Outputs of other streams or older epochs are dropped."""
        if self.closed or not self._started or out.stream_id != self.stream_id:
            return
        if isinstance(out, Decision):
            self._consumed(out.unit_index)
        if isinstance(out, EngineError) and out.fatal:
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
        elif isinstance(out, EngineError):
            self._engine_failed(out)
        elif isinstance(out, UnitTimings):
            self.timings = dict(out.timings)

    # latency trace (debug option: the ``duplexkit.latency`` logger at DEBUG)
    def _trace_output(self, r: _Response, out: EngineOutput, now_ms: float) -> None:
        t = r.trace
        if isinstance(out, Decision) and r.forced_unit is not None and out.unit_index >= r.forced_unit:
            t.setdefault("decision_ms", float(now_ms))
            t.setdefault("decision_unit", out.unit_index)
        elif isinstance(out, AudioChunk) and out.audio.size:
            t.setdefault("first_audio_ms", float(now_ms))
            t.setdefault("first_audio_unit", out.unit_index)
        elif isinstance(out, UnitTimings):
            self._trace_engine(r, out)

    def _trace_engine(self, r: _Response, out: UnitTimings) -> None:
        if out.unit_index == r.forced_unit and "engine" not in r.trace:
            r.trace["engine"] = dict(out.timings)
            if r is self._trace_wait:
                self._trace_emit(r)

    def _trace_emit(self, r: _Response) -> None:
        if r is self._trace_wait:
            self._trace_wait = None
        rec = {"session": self.session_id, "response": r.id, "trigger": r.trigger, "forced_unit": r.forced_unit, **r.trace}
        trace_log.debug("%s", json.dumps(rec))

    def tick(self, now_ms: float) -> None:
        """Advance the clock: idle timeout, and silence feeding while a response is active."""
        if self.closed or not self._started:
            return
        if now_ms - self._last_client_ms >= self.cfg.limits.idle_timeout_s * 1000:
            self._close("timeout", 1000)
            return
        self._release_units(now_ms)
        if self._resp is not None and now_ms - self._last_unit_ms >= UNIT_PERIOD_MS + self.cfg.silence_slack_ms:
            self._feed_silence(now_ms)

    # playback truth helpers (for clients, tests and context rebuilds)
    def item_playback(self, item_id: str) -> tuple[int, int, bool]:
        """``(sent_ms, committed_ms, final)`` of an assistant item. KeyError if unknown."""
        it = self._find_item(item_id)
        return it.sent_ms, it.committed_ms, it.final

    def history(self) -> list[dict]:
        """The conversation history at playback truth (docs/protocol.md §7.5): list of item dicts."""
        return [self._item_model(it, truth=True).model_dump(mode="json", exclude_none=True) for it in self._items.values()]

    # ------------------------------------------------------------------------------ emit helpers

    def _emit(self, ev: ServerEvent) -> None:
        self._seq += 1
        ev.event_id = self._ids.event()
        ev.server_event_seq = self._seq
        self._out.append(ev.to_wire())

    def _cmd(self, cmd: EngineCommand) -> None:
        self._out.append(cmd)

    def _error(self, pe: ProtocolError) -> None:
        self._emit(ErrorEvent(error=ErrorInfo(**pe.to_error_dict())))

    @property
    def _duplex(self) -> bool:
        return self.cfg.profile == "duplex"

    def _transition(self, ev: TEvent, event_id: Optional[str] = None) -> Optional[Phase]:
        nxt = TRANSITIONS[self.phase][ev]
        if isinstance(nxt, ErrorCode):
            raise TransitionError(nxt, self.phase.value, ev.value, event_id=event_id,
                                  message=_TRANSITION_MESSAGES.get(nxt, ""))
        return nxt

    # ------------------------------------------------------------------------------ dispatch

    def _dispatch(self, ev: Any, now_ms: float) -> None:
        handler = self._HANDLERS[type(ev)]
        handler(self, ev, now_ms)

    # --- session -----------------------------------------------------------------------------

    def _on_session_update(self, ev: SessionUpdateEvent, now_ms: float, first: bool = False) -> None:
        self._update_warnings = []
        new = self._validated_settings(ev.session, ev.event_id)  # a first update's error precedes session.created
        warnings, self._update_warnings = self._update_warnings, []
        old = self.settings
        old_stream = self._stream_config()
        self.settings = new
        if new.input_format != old.input_format:
            self._decoder = StreamDecoder(new.input_format)
            self._resampler = StreamResampler(new.input_format.rate, INPUT_SAMPLE_RATE)
            self._arrival = ArrivalRateMonitor(new.input_format.rate)  # a new declaration: re-armed
        if new.turn_detection != old.turn_detection:
            self._make_vad()
        if first and not self._started:
            self.start(now_ms)
            for w in warnings:
                self._warn(*w)
            return
        self._emit(SessionUpdated(session=self._session_object()))
        for w in warnings:
            self._warn(*w)
        cfg = self._stream_config()
        if self._stream_open and _config_key(cfg) != _config_key(old_stream):
            self._cmd(UpdateStream(self.stream_id, self.epoch, config=cfg))

    def _validated_settings(self, p: SessionPatch, event_id: Optional[str]) -> _Settings:
        s = self.settings.copy()
        given = set(p.given)

        def err(code: ErrorCode, msg: str, concept: str, field: Optional[str] = None) -> ProtocolError:
            param = "session." + p.sources.get(concept, concept) + ("." + field if field else "")
            return ProtocolError(code, msg, param=param, event_id=event_id)

        def warn(code: str, msg: str, concept: str) -> None:
            self._update_warnings.append((code, msg, "session." + p.sources.get(concept, concept)))

        if "output_modalities" in given:
            mods = p.output_modalities or []
            if not mods or any(m not in ("audio", "text") for m in mods):
                raise err(ErrorCode.BAD_EVENT, "output_modalities must be a non-empty subset of ['audio', 'text']", "output_modalities")
            if "audio" in mods and not self.cfg.audio_output_available:
                raise err(ErrorCode.BAD_EVENT, _NO_VOCODER, "output_modalities")
            s.output_modalities = list(dict.fromkeys(mods))
        if "instructions" in given and p.instructions != s.instructions:
            if self._units_appended > 0:
                raise err(ErrorCode.BAD_EVENT, "instructions can only change before the first unit is consumed", "instructions")
            s.instructions = p.instructions
        if "input_format" in given or "input_sample_rate_hz" in given or "input_channels" in given:
            s.input_format = self._parse_input_format(p, err)
        if "output_format" in given:
            of = p.output_format
            ok = of == "pcm16" or (
                isinstance(of, dict) and of.get("type") == "audio/pcm" and of.get("rate", OUTPUT_SAMPLE_RATE) == OUTPUT_SAMPLE_RATE
            )
            if not ok:
                raise err(ErrorCode.UNSUPPORTED_AUDIO_FORMAT, "output is fixed at 24 kHz PCM16 ('pcm16' or {type:'audio/pcm', rate:24000})", "output_format")
        if "turn_detection" in given:
            s.turn_detection = self._parse_turn_detection(p.turn_detection, err)
        if "temperature" in given:
            s.temperature = float(p.temperature)
        if "max_output_tokens" in given:
            s.max_output_tokens = p.max_output_tokens
        if "force_listen_count" in given:
            s.force_listen_count = int(p.force_listen_count)
        if "answer_policy" in given:
            s.answer_policy = p.answer_policy
        if "seed" in given:
            s.seed = int(p.seed)
        if "playback_commit_policy" in given:
            s.playback_commit_policy = p.playback_commit_policy
        if "early_unit_close" in given:
            s.early_unit_close = bool(p.early_unit_close)
        self._apply_vllm_omni_fields(p, s, given, err, warn)
        # voice and reference audio (docs/protocol.md §8)
        voice_changed = False
        if "voice" in given:
            s.voice = p.voice
            if not s.ref_from_client or "ref_audio" not in given:
                s.ref_voice = self.cfg.voices.get(p.voice, self.cfg.default_voice)
                s.ref_from_client = False
            voice_changed = True
        if "ref_audio" in given:
            s.ref_voice = self._load_ref_audio(p.ref_audio, err)
            s.ref_from_client = True
            voice_changed = True
        if voice_changed and self._audio_started:
            old_sha = self.settings.ref_voice.sha256 if self.settings.ref_voice is not None else None
            new_sha = s.ref_voice.sha256 if s.ref_voice is not None else None
            if old_sha != new_sha:
                raise err(ErrorCode.REF_AUDIO_UPDATE_UNSUPPORTED, "the voice cannot change after audio output has started",
                          "ref_audio" if "ref_audio" in given else "voice")
        return s

    def _parse_input_format(self, p: SessionPatch, err) -> InputFormat:
        """The input format of a ``session.update`` (docs/protocol.md §6.1; issue 10 for channels).

        Spellings: a beta string (``pcm16`` | ``pcm_f32le`` | ``g711_ulaw`` | ``g711_alaw`` |
        ``audio/pcm``) with the flat ``sample_rate_hz``; a GA object ``{type, rate}`` which also
        takes the keys the server itself echoes (``sample_rate_hz``, ``encoding: "pcm_f32le"``), so
        a client may send the session object back unchanged. Channels: ``channels`` in the GA
        object or flat (``channels`` / ``input_audio_channels``), 1..8 interleaved channels
        downmixed to mono by their mean (:class:`~duplexkit.audio.InputFormat`); a format given
        without a channel count is mono, a channel count given alone keeps the current encoding
        and rate. Anything else is ``unsupported_audio_format`` (never read as mono).
        """
        cur = self.settings.input_format
        flat_ch = p.input_channels if "input_channels" in p.given else None
        if p.input_format is None and "input_sample_rate_hz" not in p.given:
            # only a channel count: same encoding and rate
            try:
                return InputFormat(cur.encoding, cur.rate, flat_ch if flat_ch is not None else cur.channels)
            except AudioFormatError as e:
                raise err(ErrorCode.UNSUPPORTED_AUDIO_FORMAT, str(e), "input_channels") from None
        f = p.input_format if p.input_format is not None else "pcm16"
        explicit = p.input_sample_rate_hz
        duplex_default = self.cfg.limits.input_default_rate if self._duplex else 24000
        bad = ErrorCode.UNSUPPORTED_AUDIO_FORMAT
        try:
            if isinstance(f, str):
                enc = {"pcm16": "pcm16", "pcm_f32le": "pcm_f32le", "g711_ulaw": "g711_ulaw", "g711_alaw": "g711_alaw",
                       "audio/pcm": "pcm16"}.get(f)
                if enc is None:
                    raise err(bad, f"expected an input format of pcm16, pcm_f32le, g711_ulaw, g711_alaw or audio/pcm, got {f!r}", "input_format")
                if enc.startswith("g711"):
                    rate = 8000 if explicit is None else explicit
                else:
                    rate = explicit if explicit is not None else duplex_default
                return InputFormat(enc, rate, 1 if flat_ch is None else flat_ch)
            t = f.get("type")
            enc = {"audio/pcm": "pcm16", "audio/pcm_f32le": "pcm_f32le", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}.get(t)
            if enc is None:
                raise err(bad, f"expected an input format type of audio/pcm, audio/pcm_f32le, audio/pcmu or audio/pcma, got {t!r}", "input_format")
            if enc == "pcm16" and f.get("encoding") is not None:
                if f["encoding"] not in ("pcm16", "pcm_f32le"):
                    raise err(bad, f"expected encoding pcm16 or pcm_f32le with type audio/pcm, got {f['encoding']!r}", "input_format")
                enc = f["encoding"]
            rates = [v for v in (f.get("rate"), f.get("sample_rate_hz"), explicit) if v is not None]
            for v in rates:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise err(bad, f"expected an integer input rate in Hz, got {v!r}", "input_format")
            if len(set(rates)) > 1:
                raise err(bad, f"conflicting input rates {sorted(set(rates))} Hz (rate, sample_rate_hz)", "input_format")
            rate = rates[0] if rates else (8000 if enc.startswith("g711") else 24000)
            ch = f.get("channels")
            if ch is not None and flat_ch is not None and ch != flat_ch:
                raise err(bad, f"conflicting channel counts {ch!r} (format.channels) and {flat_ch!r} (channels)", "input_format")
            ch = ch if ch is not None else (1 if flat_ch is None else flat_ch)
            return InputFormat(enc, rate, ch)
        except AudioFormatError as e:
            raise err(bad, str(e), "input_format") from None

    def _apply_vllm_omni_fields(self, p: SessionPatch, s: "_Settings", given: set, err, warn) -> None:
        """vLLM-Omni's session fields (docs/server.md, "Interop"): honoured where this server has
        the behaviour, otherwise a ``session.warning`` (never silently dropped).

        * ``extra_body.auto_response``: true -> ``answer_policy: model``, false -> ``on_request``
          (an explicit ``answer_policy`` wins);
        * ``overlap_policy``: ``listen_only`` -> the VAD does not interrupt (``interrupt_response:
          false``; with ``turn_detection: null`` overlap is the model's anyway); ``barge_in`` ->
          ``interrupt_response: true`` (needs server VAD); other values -> warning;
        * ``extra_body.native_duplex`` / ``minicpmo45_native_duplex``: true is what this server
          always does; false -> warning;
        * ``audio.output.sample_rate_hz``: must be 24000 (``unsupported_audio_format`` otherwise).
        """
        if "auto_response" in given and "answer_policy" not in given:
            s.answer_policy = "model" if p.auto_response else "on_request"
        if "overlap_policy" in given:
            pol = p.overlap_policy
            if pol == "listen_only":
                if s.turn_detection is not None:
                    s.turn_detection["interrupt_response"] = False
            elif pol in ("barge_in", "interrupt") and s.turn_detection is not None:
                s.turn_detection["interrupt_response"] = True
            else:
                warn("unsupported_overlap_policy", f"overlap_policy {pol!r} is not honoured: this server supports "
                     "'listen_only' and, with server VAD, 'barge_in'; overlap is left to the model", "overlap_policy")
        if "native_duplex" in given and p.native_duplex is False:
            warn("native_duplex_always_on", "this server always runs MiniCPM-o's model-native duplex loop; "
                 "native_duplex: false is not honoured", "native_duplex")
        if "output_sample_rate_hz" in given and p.output_sample_rate_hz != OUTPUT_SAMPLE_RATE:
            raise err(ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
                      f"output is fixed at {OUTPUT_SAMPLE_RATE} Hz, got {p.output_sample_rate_hz}", "output_sample_rate_hz")

    def _warn(self, code: str, message: str, param: str, event_id: Optional[str] = None) -> None:
        """Emit ``session.warning`` once per ``param`` per session."""
        if param in self._warned:
            return
        self._warned.add(param)
        self._emit(SessionWarning(code=code, message=message, param=param))

    def _parse_turn_detection(self, td: Optional[dict], err) -> Optional[dict]:
        if td is None:
            return None
        code = ErrorCode.UNSUPPORTED_TURN_DETECTION
        t = td.get("type", "server_vad")
        if t == "semantic_vad":
            # OpenAI's semantic_vad: served by the server VAD, its eagerness translated to a
            # silence duration (SEMANTIC_VAD_SILENCE_MS, docs/protocol.md §4.1)
            eager = td.get("eagerness") or "auto"
            if eager not in SEMANTIC_VAD_SILENCE_MS:
                raise err(code, f"turn_detection.eagerness must be one of {sorted(SEMANTIC_VAD_SILENCE_MS)}, "
                          f"got {eager!r}", "turn_detection", "eagerness")
            td = {"type": "server_vad", "silence_duration_ms": SEMANTIC_VAD_SILENCE_MS[eager],
                  **{k: td[k] for k in ("interrupt_response", "create_response") if k in td}}
            t = "server_vad"
        if t != "server_vad":
            raise err(code, f"turn_detection type {t!r} is not supported (server_vad, semantic_vad or null)",
                      "turn_detection", "type")
        if self._vad_cls is None:
            raise err(code, "server VAD is not available on this server", "turn_detection")
        out = {
            "type": "server_vad",
            "threshold": 0.5,
            "prefix_padding_ms": 300,
            "silence_duration_ms": 500,
            "interrupt_response": True,
            "create_response": not self._duplex,
        }
        num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        for k, lo, hi, integer in (("threshold", 0.0, 1.0, False), ("prefix_padding_ms", 0, 2000, True),
                                   ("silence_duration_ms", 100, 5000, True)):
            if td.get(k) is not None:
                v = td[k]
                if not num(v) or (integer and float(v) != int(v)) or not (lo <= v <= hi):
                    raise err(code, f"turn_detection.{k} must be in {lo}..{hi}, got {v!r}", "turn_detection", k)
                out[k] = int(v) if integer else float(v)
        for k in ("interrupt_response", "create_response"):
            if td.get(k) is not None:
                if not isinstance(td[k], bool):
                    raise err(code, f"turn_detection.{k} must be a boolean", "turn_detection", k)
                out[k] = td[k]
        return out

    def _load_ref_audio(self, value: str, err) -> ReferenceVoice:
        code = ErrorCode.REF_AUDIO_INVALID
        if value.startswith("data:"):
            head, sep, payload = value.partition(",")
            if not sep or ";base64" not in head:
                raise err(code, "ref_audio data URL must be 'data:audio/wav;base64,...'", "ref_audio")
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise err(code, "ref_audio data URL is not valid base64", "ref_audio") from None
        elif _SCHEME_RE.match(value) and not value.startswith("file://"):
            raise err(code, "remote ref_audio URLs are refused; send a data URL", "ref_audio")
        else:
            path = value[len("file://"):] if value.startswith("file://") else value
            if self.cfg.ref_audio_loader is None:
                raise err(code, "ref_audio paths are not allowed on this server (no --ref-audio-dir)", "ref_audio")
            try:
                data = self.cfg.ref_audio_loader(path)
            except Exception as exc:  # the loader enforces the allow-list
                raise err(code, f"ref_audio path refused: {exc}", "ref_audio") from None
        try:
            audio, _ = read_wav(data, rate=INPUT_SAMPLE_RATE, max_s=self.cfg.limits.max_ref_audio_s)
        except (AudioFormatError, ValueError, RuntimeError) as exc:
            raise err(code, f"ref_audio is not decodable audio: {exc}", "ref_audio") from None
        dur = len(audio) / INPUT_SAMPLE_RATE
        if dur < REF_AUDIO_MIN_S or dur > self.cfg.limits.max_ref_audio_s:
            raise err(code, f"ref_audio must last {REF_AUDIO_MIN_S}..{self.cfg.limits.max_ref_audio_s} s, got {dur:.2f} s", "ref_audio")
        n = len(audio) // REF_TRIM_SAMPLES * REF_TRIM_SAMPLES
        clip = np.ascontiguousarray(audio[:n], dtype=np.float32)
        return ReferenceVoice(audio=clip, sha256=hashlib.sha256(clip.tobytes()).hexdigest())

    def _make_vad(self) -> None:
        td = self.settings.turn_detection
        self._vad_base_samples = self._real_samples
        if td is None or self._vad_cls is None:
            self._vad = None
            return
        StreamingVAD, VadConfig = self._vad_cls
        self._vad = StreamingVAD(VadConfig(threshold=td["threshold"], prefix_padding_ms=td["prefix_padding_ms"],
                                           silence_duration_ms=td["silence_duration_ms"]))
        self._vad_item = None

    def _on_heartbeat(self, ev: SessionHeartbeatEvent, now_ms: float) -> None:
        self._emit(SessionHeartbeatAck(session_id=self.session_id))

    def _on_event_ack(self, ev: SessionEventAckEvent, now_ms: float) -> None:
        return

    def _check_arrival(self, frames: int, now_ms: float, event_id: Optional[str]) -> None:
        """Arrival-rate check of an accepted append of ``frames`` frames at the declared rate.

        Continuous input that arrives far slower than its declared rate over >= 3 s of wall time
        (``duplexkit.audio.arrival``: frames / (elapsed x rate) < 0.8) gets ONE non-fatal
        ``error{input_rate_mismatch}`` per declared input format, echoing the append's
        ``event_id``; the audio is still used. Faster-than-real-time input is never flagged.
        """
        w = self._arrival.observe(frames, now_ms)
        if w is None:
            return
        fmt = self.settings.input_format
        guess = (f"; it looks like {w.likely_rate} Hz audio" if w.likely_rate is not None
                 and w.likely_rate != w.declared_rate else "")
        self._error(ProtocolError(
            ErrorCode.INPUT_RATE_MISMATCH,
            f"input audio arrives at {w.ratio:.2f}x its declared rate: {w.apparent_rate:.0f} frames per second "
            f"over the last {w.window_ms / 1000:.1f} s of continuous appends, declared {fmt.describe()}{guess}. "
            f"Declare the rate the audio was captured at (audio.input.format.rate or sample_rate_hz) and send it "
            f"at least in real time; the audio is still used (this warning is sent once)",
            event_id=event_id))

    def _on_close(self, ev: SessionCloseEvent, now_ms: float) -> None:
        self._close(ev.reason or "client_close", 1000)

    def _close(self, reason: str, code: int) -> None:
        if self._resp is not None:
            self._cancel_active("client_cancelled" if reason == "client_close" else reason_to_cancel(reason))
        self.phase = TRANSITIONS[self.phase][TEvent.CLOSE] or Phase.CLOSED
        self._emit(SessionClosed(session_id=self.session_id, epoch=self.epoch, reason=reason))
        self._cmd(CloseStream(self.stream_id, self.epoch))
        self._out.append(CloseConnection(code, reason))
        self.closed = True

    # --- input audio -------------------------------------------------------------------------

    def _on_append(self, ev: InputAudioBufferAppendEvent, now_ms: float) -> None:
        # bad base64, a zero-length append or non-finite floats: one bad_audio error, no state change
        fmt = self.settings.input_format
        try:
            data = b64decode_audio(ev.audio, allow_empty=False, what=fmt.describe())
        except AudioFormatError as e:
            raise ProtocolError(ErrorCode.BAD_AUDIO, str(e), param="audio", event_id=ev.event_id) from None
        incoming = (len(data) + self._decoder.carried_bytes) // fmt.frame_bytes * INPUT_SAMPLE_RATE // fmt.rate
        self._check_pending(incoming, ev.event_id)
        try:
            x = self._decoder.decode(data, allow_empty=False)
        except AudioFormatError as e:
            raise ProtocolError(ErrorCode.BAD_AUDIO, str(e), param="audio", event_id=ev.event_id) from None
        self._push_real(self._resampler.process(x), now_ms)
        self.input_appends += 1
        self._check_arrival(x.size, now_ms, ev.event_id)
        if ev.video_frames:
            self._warn("video_frames_ignored", "this server takes audio only: video_frames of appends are ignored "
                       "(this warning is sent once)", "video_frames", ev.event_id)
        if ev.sample_rate_hz is not None and ev.sample_rate_hz != fmt.rate:
            self._warn("append_rate_ignored", f"append sample_rate_hz {ev.sample_rate_hz} differs from the session's "
                       f"input rate {fmt.rate} Hz; the audio is read at {fmt.rate} Hz (declare the rate with "
                       "session.update; this warning is sent once)", "sample_rate_hz", ev.event_id)

    def _check_pending(self, incoming: int, event_id: Optional[str]) -> None:
        """``input_backpressure`` when ``incoming`` more 16 kHz samples would exceed
        ``max_pending_input_s`` of unconsumed input (docs/protocol.md §6.1). Every path that queues
        input audio (appends, ``conversation.item.create`` audio) calls this before decoding."""
        pending = self._framer.pending_samples + self._inflight_samples + self._debt_hold_n + self._unit_hold_samples
        limit = int(self.cfg.limits.max_pending_input_s * INPUT_SAMPLE_RATE)
        if pending + incoming > limit:
            raise ProtocolError(ErrorCode.INPUT_BACKPRESSURE,
                                f"more than {self.cfg.limits.max_pending_input_s:g} s of input not yet consumed; "
                                "audio dropped", event_id=event_id)

    def _push_real(self, x16: np.ndarray, now_ms: float) -> None:
        """Feed real 16 kHz input: VAD (speech_started before framing, speech_stopped after).

        A barge-in's speech_started advances the epoch before any of this chunk (or a unit held
        for the fence, :meth:`_frame`) is appended, so the interrupting audio from its onset minus
        pre-roll on is tagged with the new epoch. After an early unit close the chunk may first go
        through the padding account (:meth:`_settle_debt`).
        """
        if x16.size == 0:
            return
        events = self._vad.process(x16) if self._vad is not None else []
        start_real = self._real_samples
        self._real_samples += x16.size
        self._last_real_ms = float(now_ms)
        stops = []
        for e in events:
            if e.kind == "speech_started":
                onset = self._vad_base_samples + e.audio_start_ms * INPUT_SAMPLE_RATE // 1000
                if self._debt_onset is None or onset < self._debt_onset:
                    self._debt_onset = onset
                self._on_speech_started(e)
                self._release_units(now_ms)
            else:
                stops.append(e)
        self._since_commit += x16.size
        if self._resp is None and self._pad_debt > 0:
            if self._debt_hold_n == 0:
                self._debt_hold_start = start_real
            self._debt_hold.append(x16)
            self._debt_hold_n += x16.size
            self._settle_debt(now_ms)
        else:
            self._settle_debt(now_ms, keep=True)
            self._frame(self._framer.push(x16), now_ms, silence=False)
        self._release_units(now_ms)
        for e in stops:
            self._on_speech_stopped(e, now_ms)

    # --- early unit close: the padding account ------------------------------------------------

    def _debt_guard(self) -> int:
        """Held samples past the padding needed before a speech onset inside them is surely known:
        the VAD's pre-roll + start confirmation + 2 frames (440 ms at defaults); without a VAD the
        300 ms pre-roll + one 10 ms energy block."""
        if self._vad is not None:
            c = self._vad.cfg
            return (c.preroll_ms + c.start_confirm_ms + 2 * c.frame_ms) * INPUT_SAMPLE_RATE // 1000
        return (300 + 10) * INPUT_SAMPLE_RATE // 1000

    def _energy_onset(self, held: np.ndarray) -> Optional[int]:
        """Without a VAD: first 10 ms block of ``held`` at or above -50 dBFS RMS (the VAD's floor at
        threshold 0.5), minus a 300 ms pre-roll, as a real-sample index; None when all is quieter."""
        blk = INPUT_SAMPLE_RATE // 100
        nb = held.size // blk
        if nb == 0:
            return None
        e = np.sqrt(np.mean(np.square(held[: nb * blk].reshape(nb, blk), dtype=np.float64), axis=1))
        hits = np.nonzero(e >= 10.0 ** (-50.0 / 20.0))[0]
        if hits.size == 0:
            return None
        return self._debt_hold_start + int(hits[0]) * blk - 300 * INPUT_SAMPLE_RATE // 1000

    def _settle_debt(self, now_ms: float, keep: bool = False) -> None:
        """Decide what the held samples after an early unit close become (docs/concepts.md
        "Early unit close"): the first ``_pad_debt`` of them are dropped (the model already heard
        zeros in their place) unless speech starts earlier, in which case only the samples before
        the speech's pre-roll are dropped and the rest of the debt is forgiven. ``keep``: a
        response is active, so nothing is dropped (the debt stays owed) and the hold is framed."""
        if self._debt_hold_n == 0:
            if keep:
                self._debt_onset = None
            return
        held = np.concatenate(self._debt_hold) if len(self._debt_hold) > 1 else self._debt_hold[0]
        h0 = self._debt_hold_start
        drop = 0
        if not keep:
            onset = self._debt_onset
            if self._vad is None:
                onset = self._energy_onset(held)
            elif onset is None and self._vad.speaking:
                onset = h0  # speech already under way: nothing here is silence
            if onset is None and self._debt_hold_n < self._pad_debt + self._debt_guard():
                return  # not decided yet: keep holding (the next unit needs these samples anyway)
            if onset is None:
                drop = self._pad_debt
                self._pad_debt = 0
            else:
                drop = min(self._pad_debt, max(0, onset - h0))
                self._pad_debt = 0  # speech: the rest of the padding is forgiven (audio shifts)
        self._debt_hold, self._debt_hold_n, self._debt_onset = [], 0, None
        rest = held[drop:]
        if rest.size:
            self._frame(self._framer.push(rest), now_ms, silence=False)

    # --- framing and the barge-in fence -----------------------------------------------------------

    def _holding_units(self) -> bool:
        """Units complete during a response wait for the VAD to look past them (barge-in fence)."""
        td = self.settings.turn_detection or {}
        return self._resp is not None and self._vad is not None and td.get("interrupt_response", True)

    def _frame(self, units: list, now_ms: float, silence: bool) -> None:
        """Append units in order. While a response can be interrupted by the server VAD a unit is
        held until the VAD has classified ``_debt_guard()`` samples past its end (440 ms at the
        defaults), so a speech onset whose pre-roll reaches into it advances the epoch first and
        the unit is tagged with the new epoch (issue 10 item 6)."""
        end_real = self._real_samples
        for u in units:
            if self._holding_units() or self._unit_hold:
                self._unit_hold.append((u, end_real, silence))
                self._unit_hold_samples += u.audio.shape[0]
            else:
                self._append_unit(u, now_ms, silence)
        self._release_units(now_ms)

    def _release_units(self, now_ms: float, force: bool = False) -> None:
        """Append held units: all when ``force``, no response is active, or input stalled for
        the guard time (no more audio can carry an onset); else those the VAD has looked past."""
        if not self._unit_hold:
            return
        guard = self._debt_guard()
        stalled = now_ms - self._last_real_ms >= guard * 1000 // INPUT_SAMPLE_RATE
        everything = force or not self._holding_units() or stalled
        vad_pos = self._vad_base_samples + self._vad.position_ms * INPUT_SAMPLE_RATE // 1000 if self._vad else 0
        while self._unit_hold:
            u, end_real, silence = self._unit_hold[0]
            if not everything and vad_pos < end_real + guard:
                break
            self._unit_hold.popleft()
            self._unit_hold_samples -= u.audio.shape[0]
            self._append_unit(u, now_ms, silence)

    def _append_unit(self, u, now_ms: float, silence: bool, force_speak: bool = False) -> None:
        self._units_appended += 1
        self._last_unit_ms = float(now_ms)
        self._inflight.append((u.index, u.audio.shape[0]))
        self._inflight_samples += u.audio.shape[0]
        self._cmd(AppendUnit(self.stream_id, self.epoch, unit_index=u.index, audio=u.audio,
                             force_listen=False if force_speak else self._force_listen_now(), is_silence=silence,
                             force_speak=force_speak))

    def _force_listen_now(self) -> bool:
        if self._force_listen_left > 0:
            self._force_listen_left -= 1
            return True
        if self.settings.answer_policy == "on_request":
            r = self._resp
            return not (r is not None and r.trigger in ("client", "server_vad"))
        return False

    def _consumed(self, unit_index: int) -> None:
        while self._inflight and self._inflight[0][0] <= unit_index:
            self._inflight_samples -= self._inflight.popleft()[1]

    def _feed_silence(self, now_ms: float) -> None:
        self._settle_debt(now_ms, keep=True)
        if self._unit_hold:
            self._release_units(now_ms, force=True)
            return
        pending = self._framer.pending_samples
        need = self._framer.needed_samples - pending
        units = self._framer.push(np.zeros(need, np.float32))
        self._frame(units, now_ms, silence=pending == 0)

    def _close_unit(self, now_ms: float, force_speak: bool = False) -> Optional[int]:
        """Early unit close: the partial unit (after anything held) goes out now, zero-padded to the
        length the model needs; the padding is owed to the silence that follows (``_pad_debt``).
        ``force_speak``: this is a requested response's forced unit, made even from zeros only.
        Returns the closed unit's index (None when nothing was pending and not forced)."""
        self._settle_debt(now_ms, keep=True)
        self._release_units(now_ms, force=True)
        u = self._framer.flush(allow_empty=force_speak)
        if u is None:
            return None
        self._pad_debt += u.padded_samples
        self._append_unit(u, now_ms, silence=u.real_samples == 0, force_speak=force_speak)
        return u.index

    def _flush_input(self, now_ms: float, drop_carry: bool = True) -> None:
        """End the user turn's audio: resampler tail and the zero-padded partial unit (an early
        unit close, :meth:`_close_unit`).

        ``drop_carry``: drop the 1-3 carried bytes of an incomplete sample (docs/protocol.md §6.1: on a
        client commit or clear). A server-VAD commit passes False: it happens at a point of the
        byte stream the client does not know, so its next append still completes that sample.
        """
        self._settle_debt(now_ms, keep=True)
        tail = self._resampler.flush()
        if tail.size:
            self._since_commit += tail.size
            self._frame(self._framer.push(tail), now_ms, silence=False)
        self._close_unit(now_ms)
        if drop_carry:
            self._decoder.reset()

    def _on_commit(self, ev: InputAudioBufferCommitEvent, now_ms: float) -> None:
        if self._since_commit + self._resampler_pending() < MIN_COMMIT_SAMPLES:
            raise ProtocolError(ErrorCode.INPUT_AUDIO_BUFFER_EMPTY,
                                "less than 100 ms of audio since the last commit or clear", event_id=ev.event_id)
        item_id = self._vad_item if self._vad_item is not None and not self._vad_item_committed else None
        if item_id is not None:
            self._vad_item_committed = True
        self._commit(now_ms, item_id)

    def _resampler_pending(self) -> int:
        r = self._resampler
        if r.identity:
            return 0
        return max(0, r.samples_in * INPUT_SAMPLE_RATE // r.in_rate - r.samples_out)

    def _commit(self, now_ms: float, item_id: Optional[str] = None, drop_carry: bool = True,
                flush: bool = True) -> str:
        if flush:
            self._flush_input(now_ms, drop_carry)
        self._since_commit = 0
        uid = item_id or self._new_item_id()
        prev = self._last_item_id()
        it = _Item(id=uid, role="user", kind="input_audio")
        self._add_item(it)
        self._emit(InputAudioBufferCommitted(item_id=uid, previous_item_id=prev))
        self._emit(ConversationItemAdded(previous_item_id=prev, item=self._item_model(it)))
        self._emit(ConversationItemDone(previous_item_id=prev, item=self._item_model(it)))
        return uid

    def _on_clear(self, ev: InputAudioBufferClearEvent, now_ms: float) -> None:
        self._framer.clear()
        self._debt_hold, self._debt_hold_n, self._debt_onset = [], 0, None
        self._decoder.reset()
        self._resampler.reset()
        self._since_commit = 0
        self._emit(InputAudioBufferCleared())

    # --- server VAD ----------------------------------------------------------------------------

    def _vad_ms(self, ms: int) -> int:
        return self._vad_base_samples * 1000 // INPUT_SAMPLE_RATE + int(ms)

    def _on_speech_started(self, e) -> None:
        self._vad_item = self._new_item_id()
        self._vad_item_committed = False
        self._emit(SpeechStarted(audio_start_ms=self._vad_ms(e.audio_start_ms), item_id=self._vad_item))
        td = self.settings.turn_detection or {}
        if self._resp is not None and td.get("interrupt_response", True):
            self._transition(TEvent.BARGE_IN)
            self._cancel_active("turn_detected")

    def _on_speech_stopped(self, e, now_ms: float) -> None:
        uid = self._vad_item or self._new_item_id()
        committed = self._vad_item_committed
        self._vad_item = None
        self._vad_item_committed = False
        self._emit(SpeechStopped(audio_end_ms=self._vad_ms(e.audio_ms), item_id=uid))
        if committed or self._since_commit + self._resampler_pending() < MIN_COMMIT_SAMPLES:
            return
        td = self.settings.turn_detection or {}
        creates = bool(td.get("create_response")) and self._resp is None
        # early unit close (docs/concepts.md): the creating commit closes the unit as the forced
        # one; otherwise extra_body.early_unit_close decides whether the partial unit goes now
        self._commit(now_ms, uid, drop_carry=False, flush=self.settings.early_unit_close and not creates)
        if creates:
            self._create_response(None, "server_vad", None, now_ms)

    # --- responses -----------------------------------------------------------------------------

    def _on_response_create(self, ev: ResponseCreateEvent, now_ms: float) -> None:
        params = ev.response
        if params is not None:
            if params.conversation is not None and params.conversation != "auto":
                raise ProtocolError(ErrorCode.BAD_EVENT, "only conversation 'auto' is supported",
                                    param="response.conversation", event_id=ev.event_id)
            if params.output_modalities is not None and (
                not params.output_modalities or any(m not in ("audio", "text") for m in params.output_modalities)
            ):
                raise ProtocolError(ErrorCode.BAD_EVENT, "output_modalities must be a non-empty subset of ['audio', 'text']",
                                    param="response.output_modalities", event_id=ev.event_id)
            if params.output_modalities and "audio" in params.output_modalities and not self.cfg.audio_output_available:
                raise ProtocolError(ErrorCode.BAD_EVENT, _NO_VOCODER, param="response.output_modalities",
                                    event_id=ev.event_id)
        self._transition(TEvent.CREATE, ev.event_id)
        self._create_response(params, "client", ev.event_id, now_ms)

    def _create_response(self, params, trigger: str, event_id: Optional[str], now_ms: float = 0) -> None:
        """Pre-create a response and run its forced unit at once on the audio already buffered
        (an early unit close with ``force_speak``; docs/concepts.md "Early unit close")."""
        self.phase = TRANSITIONS[self.phase][TEvent.CREATE]  # type: ignore[assignment]
        mods = list(self.settings.output_modalities)
        metadata = None
        cap: Union[int, str] = self.settings.max_output_tokens
        if params is not None:
            if params.output_modalities:
                mods = list(dict.fromkeys(params.output_modalities))
            if params.max_output_tokens is not None:
                cap = params.max_output_tokens
            if params.metadata is not None:
                metadata = dict(params.metadata)
            if params.ignored:
                metadata = dict(metadata or {})
                metadata["ignored_fields"] = ",".join(params.ignored)
        self._resp = self._new_response(trigger, mods, metadata, cap, forced_unit=None)
        self._emit(ResponseCreated(response=self._response_model(self._resp, "in_progress")))
        if trace_log.isEnabledFor(logging.DEBUG):
            self._resp.trace = {"request_ms": float(now_ms), "units_ahead": len(self._inflight) + len(self._unit_hold)}
        self._resp.forced_unit = self._close_unit(now_ms, force_speak=True)

    def _new_response(self, trigger, mods, metadata, cap, forced_unit) -> _Response:
        stream_audio = "audio" in self.settings.output_modalities
        audio = "audio" in mods and stream_audio
        if not audio:
            mods = ["text"]
        rid = self._ids.response()
        self._issued.add(rid)
        return _Response(
            id=rid, item_id=self._new_item_id(), epoch=self.epoch, trigger=trigger, audio=audio,
            modalities=mods, metadata=metadata, max_tokens=None if cap == "inf" else int(cap), forced_unit=forced_unit,
        )

    def _on_response_cancel(self, ev: ResponseCancelEvent, now_ms: float) -> None:
        if ev.response_id is not None and self._resp is not None and ev.response_id != self._resp.id:
            raise TransitionError(ErrorCode.RESPONSE_NOT_ACTIVE, self.phase.value, TEvent.CANCEL.value,
                                  message=f"response {ev.response_id!r} is not active", event_id=ev.event_id)
        self._transition(TEvent.CANCEL, ev.event_id)
        self._cancel_active("client_cancelled")

    def _on_output_clear(self, ev: OutputAudioBufferClearEvent, now_ms: float) -> None:
        if self._resp is None:
            self._emit(OutputAudioBufferCleared())
            return
        self._transition(TEvent.CANCEL, ev.event_id)
        self._emit(OutputAudioBufferCleared(response_id=self._resp.id))
        self._cancel_active("client_cancelled")

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self._cmd(CancelEpoch(self.stream_id, self.epoch))

    def _cancel_active(self, reason: str) -> None:
        """Epoch +1, CancelEpoch, close the active response as cancelled (``reason``)."""
        self._advance_epoch()
        self._finish("cancelled", StatusDetails(type="cancelled", reason=reason))

    def _open_envelope(self, r: _Response) -> None:
        r.opened = True
        prev = self._last_item_id()
        it = _Item(id=r.item_id, role="assistant", kind="output_audio" if r.audio else "output_text",
                   status="in_progress", response_id=r.id)
        self._add_item(it)
        self._responses[r.id] = it
        self._emit(ConversationItemAdded(previous_item_id=prev, item=self._item_model(it)))
        self._emit(OutputItemAdded(response_id=r.id, item=self._item_model(it)))
        part = Part(type="audio", transcript="") if r.audio else Part(type="text", text="")
        self._emit(ContentPartAdded(response_id=r.id, item_id=r.item_id, part=part))
        if self._duplex:
            self._emit(ResponseSpeak(response_id=r.id, item_id=r.item_id, metadata=DeltaMetadata(epoch=self.epoch)))

    def _ensure_open(self) -> _Response:
        """SPEAK: open a model response (idle) or the pre-created one's envelope (requested)."""
        nxt = self._transition(TEvent.SPEAK)
        if self._resp is None:
            self._resp = self._new_response("model", list(self.settings.output_modalities), None,
                                            self.settings.max_output_tokens, forced_unit=None)
            self._emit(ResponseCreated(response=self._response_model(self._resp, "in_progress")))
        r = self._resp
        if not r.opened:
            self._open_envelope(r)
        self.phase = nxt  # type: ignore[assignment]
        return r

    def _on_decision(self, d: Decision) -> None:
        if d.decision == "speak":
            self._ensure_open()
            return
        r = self._resp
        if r is None:
            if self._duplex:
                self._emit(ResponseListen(epoch=self.epoch, response=ResponseObject(
                    status="listening", metadata={"reason": "model_listen"})))
            return
        if r.opened or r.forced_unit is None or d.unit_index < r.forced_unit:
            return
        self.phase = self._transition(TEvent.FORCED_LISTEN)  # type: ignore[assignment]
        if self._duplex:
            self._emit(ResponseListen(epoch=self.epoch, response_id=r.id, response=ResponseObject(
                id=r.id, status="listening", metadata={"reason": "model_listen"}, epoch=self.epoch)))
        r.metadata = {**(r.metadata or {}), "decision": "listen"}
        self._finish("completed", None, to_idle=False)

    def _on_text(self, t: TextDelta) -> None:
        r = self._resp
        if r is None and not t.text:
            return
        if r is None or not r.opened:
            r = self._ensure_open()
        r.tokens += int(t.n_tokens)
        if not r.audio and t.text:
            it = self._responses[r.id]
            it.text += t.text
            r.parts.append(t.text)
            r.chars += len(t.text)
            self._emit(OutputTextDelta(response_id=r.id, item_id=r.item_id, delta=t.text,
                                       metadata=DeltaMetadata(epoch=self.epoch)))
        if r.max_tokens is not None and r.tokens >= r.max_tokens:
            self._transition(TEvent.TOKEN_CAP)
            self._advance_epoch()
            self._finish("incomplete", StatusDetails(type="incomplete", reason="max_output_tokens"))

    def _on_audio(self, c: AudioChunk) -> None:
        r = self._resp
        if r is not None and not r.audio:
            return  # text-only response: audio is not requested
        if r is None and c.audio.size == 0 and not c.text:
            return
        r = self._ensure_open() if (r is None or not r.opened) else r
        if not r.audio:
            return
        pcm = r.pending_pcm + float32_to_pcm16(c.audio)
        text = r.pending_text + c.text
        ms = (r.samples + len(pcm) // 2) * 1000 // OUTPUT_SAMPLE_RATE
        if ms <= r.samples * 1000 // OUTPUT_SAMPLE_RATE:
            # less than 1 ms of new audio: hold it (and its text) for the next chunk so that
            # audio_duration_ms increases strictly (docs/protocol.md §12.12)
            r.pending_pcm, r.pending_text = pcm, text
            return
        r.pending_pcm, r.pending_text = b"", ""
        r.samples += len(pcm) // 2
        it = self._responses[r.id]
        it.text += text
        r.parts.append(text)
        r.chars += len(text)
        it.marks.append((r.chars, ms))
        it.sent_ms = ms
        self._audio_started = True
        meta = DeltaMetadata(epoch=self.epoch, audio_duration_ms=ms,
                             audio_text_marks=[TextMark(text_chars=r.chars, audio_end_ms=ms)], end_of_turn=bool(c.final))
        self._emit(OutputAudioDelta(response_id=r.id, item_id=r.item_id, delta=b64encode_audio(pcm), format="pcm16",
                                    sample_rate_hz=OUTPUT_SAMPLE_RATE, metadata=meta))
        self._emit(OutputAudioTranscriptDelta(response_id=r.id, item_id=r.item_id, delta=text,
                                              metadata=DeltaMetadata(epoch=self.epoch)))

    def _on_turn_end(self, t: TurnEnd) -> None:
        if self._resp is None:
            return
        self.phase = self._transition(TEvent.TURN_END)  # type: ignore[assignment]
        if t.reason == "cancelled":
            self._finish("cancelled", StatusDetails(type="cancelled", reason="client_cancelled"), to_idle=False)
        else:
            self._finish("completed", None, to_idle=False)

    def _engine_failed(self, e: EngineError) -> None:
        if self._resp is None:
            self._error(ProtocolError(ErrorCode.SERVER_ERROR, e.message or "engine error"))
            return
        self._transition(TEvent.FAIL)
        self._advance_epoch()
        self._finish("failed", StatusDetails(type="failed", error=StatusError(
            type="server_error", code=e.code or "server_error", message=e.message or "engine error")))

    def _engine_fatal(self, e: EngineError) -> None:
        if self._resp is not None:
            self._advance_epoch()
            self._finish("failed", StatusDetails(type="failed", error=StatusError(
                type="server_error", code="server_error", message=e.message or "engine failure")))
        self._error(ProtocolError(ErrorCode.SERVER_ERROR, e.message or "the engine failed and cannot continue"))
        self.phase = Phase.CLOSED
        self._emit(SessionClosed(session_id=self.session_id, epoch=self.epoch, reason="server_error"))
        self._cmd(CloseStream(self.stream_id, self.epoch))
        self._out.append(CloseConnection(1011, "server_error"))
        self.closed = True

    def _finish(self, status: str, details: Optional[StatusDetails], to_idle: bool = True) -> None:
        """Close the parts the active response opened (§5.3 steps 7–12) and emit response.done."""
        r = self._resp
        assert r is not None
        output = []
        if r.opened:
            it = self._responses[r.id]
            it.status = "completed" if status == "completed" else "incomplete"
            text = "".join(r.parts)
            if r.audio:
                self._emit(OutputAudioDone(response_id=r.id, item_id=r.item_id))
                self._emit(OutputAudioTranscriptDone(response_id=r.id, item_id=r.item_id, transcript=text))
                part = Part(type="audio", transcript=text)
            else:
                self._emit(OutputTextDone(response_id=r.id, item_id=r.item_id, text=text))
                part = Part(type="text", text=text)
            self._emit(ContentPartDone(response_id=r.id, item_id=r.item_id, part=part))
            model = self._item_model(it)
            self._emit(OutputItemDone(response_id=r.id, item=model))
            self._emit(ConversationItemDone(previous_item_id=self._previous_of(it.id), item=model))
            if self.settings.playback_commit_policy == "commit_on_done" and not it.final:
                it.committed_ms = max(it.committed_ms, it.sent_ms)
            output = [model]
        self._emit(ResponseDone(response=self._response_model(r, status, details, output)))
        if r.trace is not None:
            r.trace["status"] = status
            if self._trace_wait is not None:
                self._trace_emit(self._trace_wait)
            self._trace_wait = r
            if "engine" in r.trace or r.forced_unit is None or status == "cancelled":
                self._trace_emit(r)
        self._resp = None
        if to_idle and self.phase != Phase.CLOSED:
            self.phase = Phase.IDLE
        self._force_listen_left = self.settings.force_listen_count

    # --- conversation items ------------------------------------------------------------------

    def _new_item_id(self) -> str:
        iid = self._ids.item()
        self._used_ids.add(iid)
        return iid

    def _last_item_id(self) -> Optional[str]:
        return next(reversed(self._items)) if self._items else None

    def _previous_of(self, item_id: str) -> Optional[str]:
        prev = None
        for k in self._items:
            if k == item_id:
                return prev
            prev = k
        return None

    def _add_item(self, it: _Item) -> None:
        self._used_ids.add(it.id)
        self._items[it.id] = it

    def _find_item(self, item_id: str) -> _Item:
        it = self._items.get(item_id)
        if it is None:
            raise KeyError(item_id)
        return it

    def _truth_text(self, it: _Item) -> str:
        if it.kind != "output_audio":
            return it.text
        chars = 0
        for c, ms in it.marks:
            if ms <= it.committed_ms:
                chars = c
            else:
                break
        return it.text[:chars]

    def _item_model(self, it: _Item, truth: bool = False) -> Item:
        if it.kind == "input_audio":
            content = [ContentPart(type="input_audio")]
        elif it.kind == "input_text":
            content = [ContentPart(type="input_text", text=it.text)]
        elif it.kind == "output_audio":
            content = [ContentPart(type="output_audio", transcript=self._truth_text(it) if truth else it.text)]
        else:
            content = [ContentPart(type="output_text", text=it.text)]
        return Item(id=it.id, role=it.role, status=it.status, content=content)

    def _response_model(self, r: _Response, status: str, details: Optional[StatusDetails] = None,
                        output: Optional[list] = None) -> ResponseObject:
        done = status != "in_progress"
        it = self._responses.get(r.id)
        return ResponseObject(
            id=r.id, status=status, status_details=details, output=output if done else [],
            output_modalities=r.modalities, metadata=r.metadata,
            usage=Usage(total_tokens=r.tokens, output_tokens=r.tokens) if done else None,
            max_output_tokens="inf" if r.max_tokens is None else r.max_tokens,
            epoch=r.epoch, trigger=r.trigger,
            audio_duration_ms=(r.samples * 1000 // OUTPUT_SAMPLE_RATE) if done else None,
            committed_ms=(it.committed_ms if it is not None else 0) if done else None,
        )

    def _on_item_create(self, ev: ConversationItemCreateEvent, now_ms: float) -> None:
        item = ev.item

        def bad(msg: str, param: str = "item") -> ProtocolError:
            return ProtocolError(ErrorCode.BAD_EVENT, msg, param=param, event_id=ev.event_id)

        if ev.previous_item_id is not None:
            if ev.previous_item_id not in self._items:
                raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"item {ev.previous_item_id!r} not found",
                                    param="previous_item_id", event_id=ev.event_id)
            if ev.previous_item_id != self._last_item_id():
                raise bad("previous_item_id may only name the last item", "previous_item_id")
        if item.type != "message" or item.role not in ("user", "system"):
            raise bad("only user and system message items are accepted", "item.role" if item.type == "message" else "item.type")
        if item.id is not None and item.id in self._used_ids:
            raise bad(f"item id {item.id!r} is already used", "item.id")
        if not item.content:
            raise bad("item.content must not be empty", "item.content")
        kinds = {c.type for c in item.content}
        if kinds == {"input_text"}:
            if self._units_appended > 0:
                raise bad("text items are accepted only before the first unit is consumed", "item.content")
            text = "".join(c.text or "" for c in item.content)
            it = _Item(id=item.id or self._new_item_id(), role=item.role, kind="input_text", text=text)
            (self._system_text if item.role == "system" else self._seed_text).append(text)
            prev = self._last_item_id()
            self._add_item(it)
            self._emit(ConversationItemAdded(previous_item_id=prev, item=self._item_model(it)))
            self._emit(ConversationItemDone(previous_item_id=prev, item=self._item_model(it)))
            if self._stream_open:
                self._cmd(UpdateStream(self.stream_id, self.epoch, config=self._stream_config()))
            return
        if kinds == {"input_audio"} and item.role == "user":
            fmt = self.settings.input_format
            b64_len = sum(len(c.audio or "") for c in item.content)  # counted before anything is decoded
            self._check_pending(b64_len * 3 // 4 // fmt.frame_bytes * INPUT_SAMPLE_RATE // fmt.rate, ev.event_id)
            chunks = []
            dec = StreamDecoder(fmt)
            for i, c in enumerate(item.content):
                try:
                    chunks.append(dec.decode(b64decode_audio(c.audio or "", what=fmt.describe())))
                except AudioFormatError as e:
                    raise ProtocolError(ErrorCode.BAD_AUDIO, str(e), param=f"item.content.{i}.audio", event_id=ev.event_id) from None
            x = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
            if x.size == 0:
                raise bad("input_audio item has no audio", "item.content")
            self._push_real(self._resampler.process(x), now_ms)
            self._flush_input(now_ms)
            self._since_commit = 0
            it = _Item(id=item.id or self._new_item_id(), role="user", kind="input_audio")
            prev = self._last_item_id()
            self._add_item(it)
            self._emit(ConversationItemAdded(previous_item_id=prev, item=self._item_model(it)))
            self._emit(ConversationItemDone(previous_item_id=prev, item=self._item_model(it)))
            return
        raise bad(f"unsupported content {sorted(kinds)} (input_text, or user input_audio)", "item.content")

    def _on_item_retrieve(self, ev: ConversationItemRetrieveEvent, now_ms: float) -> None:
        it = self._items.get(ev.item_id)
        if it is None:
            raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"item {ev.item_id!r} not found", param="item_id", event_id=ev.event_id)
        self._emit(ConversationItemRetrieved(item=self._item_model(it, truth=True)))

    def _on_item_delete(self, ev: ConversationItemDeleteEvent, now_ms: float) -> None:
        it = self._items.get(ev.item_id)
        if it is None:
            raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"item {ev.item_id!r} not found", param="item_id", event_id=ev.event_id)
        if self._resp is not None and self._resp.item_id == ev.item_id:
            raise ProtocolError(ErrorCode.BAD_EVENT, "the active response's item cannot be deleted", param="item_id", event_id=ev.event_id)
        del self._items[ev.item_id]
        self._emit(ConversationItemDeleted(item_id=ev.item_id))

    def _on_item_truncate(self, ev: ConversationItemTruncateEvent, now_ms: float) -> None:
        it = self._items.get(ev.item_id)
        if it is None:
            raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"item {ev.item_id!r} not found", param="item_id", event_id=ev.event_id)

        def invalid(msg: str, param: str) -> ProtocolError:
            return ProtocolError(ErrorCode.INVALID_TRUNCATE, msg, param=param, event_id=ev.event_id)

        if it.kind != "output_audio":
            raise invalid("only assistant audio items can be truncated", "item_id")
        ci = ev.content_index
        if isinstance(ci, bool) or not isinstance(ci, int) or ci != 0:
            raise invalid("content_index must be 0", "content_index")
        v = ev.audio_end_ms
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise invalid(f"audio_end_ms must be an integer >= 0, got {v!r}", "audio_end_ms")
        if it.sent_ms == 0:
            self._emit(ConversationItemTruncated(item_id=it.id, content_index=0, audio_end_ms=0))
            return
        it.committed_ms = min(v, it.sent_ms)
        it.final = True
        self._emit(ConversationItemTruncated(item_id=it.id, content_index=0, audio_end_ms=it.committed_ms))

    def _on_playback_ack(self, ev: PlaybackAckEvent, now_ms: float) -> None:
        """``playback.ack`` (docs/protocol.md §7.5). ``heard = min(played_ms, sent_ms)`` (ms):

        * plain ack: ``committed_ms = max(committed_ms, heard)`` (never lowers);
        * ``truncate: true``: ``committed_ms = heard`` and final, even below an earlier ack or what
          ``commit_on_done`` committed at ``response.done``;
        * after finalisation (a truncate ack or ``conversation.item.truncate``): ignored.
        """
        if ev.response_id is None:
            iid = ev.item_id or ""
            rid = iid[len("item_"):] if iid.startswith("item_resp_") else None
            if rid is None and iid:
                rid = next((r for r, item in self._responses.items() if item.id == iid), None)
            if rid is None and not iid and self._responses:
                rid = next(reversed(self._responses))  # the latest response that sent audio
            if rid is None:
                raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, "playback.ack without response_id names no audio item "
                                    "of this session", param="response_id", event_id=ev.event_id)
            ev = ev.model_copy(update={"response_id": rid})
        it = self._responses.get(ev.response_id)
        if it is None:
            if self._resp is not None and self._resp.id == ev.response_id:
                return  # issued, no audio yet
            if ev.response_id in self._issued_response_ids():
                return
            raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"response {ev.response_id!r} was never issued by this session",
                                param="response_id", event_id=ev.event_id)
        # vLLM-Omni's clients name the assistant item "item_" + response_id (their server's convention)
        if ev.item_id is not None and ev.item_id != it.id and ev.item_id != "item_" + ev.response_id:
            if ev.item_id not in self._used_ids:
                raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"item {ev.item_id!r} was never issued by this session",
                                    param="item_id", event_id=ev.event_id)
            return
        if it.final:
            return  # finalised by an earlier truncate: acks change nothing
        heard = min(ev.played_ms, it.sent_ms)
        if ev.truncate:
            # the client's final word on what was heard: it may cut back below what an earlier ack
            # or commit_on_done's response.done committed (docs/protocol.md §7.5, issue 10)
            it.committed_ms = heard
            it.final = True
        else:
            it.committed_ms = max(it.committed_ms, heard)

    def _issued_response_ids(self) -> set:
        return self._issued

    # --- stream config / session echo ----------------------------------------------------------

    def _stream_config(self) -> StreamConfig:
        s = self.settings
        instr = s.instructions
        if self._system_text:
            instr = "\n".join([x for x in [instr, *self._system_text] if x])
        return StreamConfig(
            instructions=instr,
            ref_voice=s.ref_voice,
            output_audio="audio" in s.output_modalities,
            temperature=s.temperature,
            seed=s.seed,
            force_listen_count=s.force_listen_count,
            seed_text="\n".join(self._seed_text) if self._seed_text else None,
        )

    def _session_object(self) -> SessionObject:
        s = self.settings
        fmt = s.input_format
        if fmt.encoding == "pcm16":
            fobj = AudioFormatObject(type="audio/pcm", rate=24000) if fmt.rate == 24000 else AudioFormatObject(
                type="audio/pcm", sample_rate_hz=fmt.rate)
            beta = "pcm16"
        elif fmt.encoding == "pcm_f32le":
            fobj = AudioFormatObject(type="audio/pcm", encoding="pcm_f32le", sample_rate_hz=fmt.rate)
            beta = "pcm_f32le"
        elif fmt.encoding == "g711_ulaw":
            fobj, beta = AudioFormatObject(type="audio/pcmu"), "g711_ulaw"
        else:
            fobj, beta = AudioFormatObject(type="audio/pcma"), "g711_alaw"
        channels = fmt.channels if fmt.channels != 1 else None  # echoed only for multi-channel input
        fobj.channels = channels
        td = TurnDetectionObject(**s.turn_detection) if s.turn_detection is not None else None
        rv = s.ref_voice
        return SessionObject(
            id=self.session_id,
            model=self.cfg.model_id,
            instructions=s.instructions,
            output_modalities=list(s.output_modalities),
            modalities=list(s.output_modalities),
            voice=s.voice,
            audio=AudioConfig(
                input=AudioInputConfig(format=fobj, turn_detection=td),
                output=AudioOutputConfig(format=AudioFormatObject(type="audio/pcm", rate=OUTPUT_SAMPLE_RATE), voice=s.voice),
            ),
            input_audio_format=beta,
            output_audio_format="pcm16",
            sample_rate_hz=fmt.rate,
            channels=channels,
            turn_detection=td,
            temperature=s.temperature,
            max_output_tokens=s.max_output_tokens,
            max_response_output_tokens=s.max_output_tokens,
            epoch=self.epoch,
            ref_audio=RefAudioInfo(sha256=rv.sha256, duration_ms=rv.duration_ms) if rv is not None else None,
            extra_body={
                "force_listen_count": s.force_listen_count,
                "answer_policy": s.answer_policy,
                "playback_commit_policy": s.playback_commit_policy,
                "seed": s.seed,
                "early_unit_close": s.early_unit_close,
            },
            capabilities=Capabilities(extension_events=EXTENSION_EVENTS if self._duplex else []),
        )

    _HANDLERS: dict = {}


def _looks_like_session_update(raw: Union[str, bytes, bytearray]) -> bool:
    """Whether a raw text frame is a ``session.update`` (checked only for a session's first event)."""
    import json

    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("type") == "session.update"


def _config_key(c: StreamConfig) -> tuple:
    """StreamConfig identity without comparing numpy arrays (the voice compares by sha256)."""
    return (c.instructions, c.ref_voice.sha256 if c.ref_voice is not None else None, c.output_audio,
            c.temperature, c.seed, c.force_listen_count, c.seed_text)


def reason_to_cancel(reason: str) -> str:
    """``response.done`` cancel reason for a server-side close (OpenAI's enum has two values)."""
    return "client_cancelled"


_TRANSITION_MESSAGES = {
    ErrorCode.RESPONSE_ALREADY_ACTIVE: "a response is already active; cancel it or wait for response.done",
    ErrorCode.RESPONSE_NOT_ACTIVE: "no response is active",
}

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
