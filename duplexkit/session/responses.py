"""The response job of a Session: ``response.create``/``cancel``, the envelope (item, output item,
content part, ``response.speak``/``listen``), text and audio deltas, the token cap, engine
failures, epochs (``CancelEpoch``), ``response.done`` and the latency trace. Every phase change
goes through the outbox's phase machine (:mod:`duplexkit.session.machine`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Union

from duplexkit.audio import b64encode_audio, float32_to_pcm16
from duplexkit.engine.api import (
    AudioChunk,
    CloseStream,
    Decision,
    EngineFailure,
    EngineOutput,
    OUTPUT_SAMPLE_RATE,
    TextDelta,
    TurnEnd,
    UnitTimings,
)
from duplexkit.protocol import (
    ContentPartAdded,
    ContentPartDone,
    ConversationItemAdded,
    ConversationItemDone,
    DeltaMetadata,
    ErrorCode,
    OutputAudioBufferClearEvent,
    OutputAudioBufferCleared,
    OutputAudioDelta,
    OutputAudioDone,
    OutputAudioTranscriptDelta,
    OutputAudioTranscriptDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    Part,
    ProtocolError,
    ResponseCancelEvent,
    ResponseCreateEvent,
    ResponseCreated,
    ResponseDone,
    ResponseListen,
    ResponseObject,
    ResponseSpeak,
    SessionClosed,
    StatusDetails,
    TextMark,
    TransitionError,
)
from duplexkit.errors import ERROR_TYPES
from duplexkit.protocol.server_events import StatusError
from duplexkit.session.conversation import _ConvItem
from duplexkit.session.settings import _NO_VOCODER
from duplexkit.session.machine import Machine, PhaseEvent
from duplexkit.session.trace import LatencyTrace

from duplexkit.session.wire import response_model

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


def reason_to_cancel(reason: str) -> str:
    """``response.done`` cancel reason for a server-side close (OpenAI's enum has two values)."""
    return "client_cancelled"


#: Input silence (no append), ms, after which a held server-VAD answer is released although the
#: VAD has not yet looked past the confirmation window: a client that stopped streaming cannot
#: resume the turn before the answer plays (twice the default ``start_confirm_ms``).
TURN_HOLD_STALL_MS = 200


class TurnHold(str, Enum):
    """A server-VAD answer's outputs: ``none`` held, or ``holding`` until the VAD confirms the turn
    ended (:meth:`Responses.check_turn_hold`)."""

    NONE = "none"
    HOLDING = "holding"


class TurnHoldEvent(str, Enum):
    HOLD = "hold"  # a server-VAD commit created the answer
    DROP = "drop"  # the epoch moved on (resumed speech, a cancel): the held outputs go with it
    RELEASE = "release"  # the turn is confirmed (or the answer ended): the held outputs are applied


TURN_HOLD_TABLE = {
    TurnHold.NONE: {TurnHoldEvent.HOLD: TurnHold.HOLDING},
    TurnHold.HOLDING: {TurnHoldEvent.HOLD: TurnHold.HOLDING, TurnHoldEvent.DROP: TurnHold.NONE,
                       TurnHoldEvent.RELEASE: TurnHold.NONE},
}
"""The turn hold's machine: state -> event -> next state (a missing pair is an internal error)."""


class _TurnHold:
    """The outputs of a server-VAD answer held until the VAD confirms the turn ended (see
    :meth:`Responses.check_turn_hold`)."""

    __slots__ = ("response_id", "epoch", "until", "queued")

    def __init__(self, response_id: str, epoch: int, until: int) -> None:
        self.response_id = response_id
        self.epoch = epoch
        self.until = until  # real-sample index the VAD must have classified (commit + confirmation window)
        self.queued: list = []  # engine outputs of the response's epoch, in arrival order


class Responses:
    """The response part of :class:`~duplexkit.session.Session`: the active response and its
    envelope, deltas, the end of a response, the turn confirmation hold and the latency trace.
    Every phase change goes through the outbox's phase machine (``self._o.fire``), and every event
    emitted is checked against the move it took (:meth:`PhaseMachine.check_emit`).

    Args:
        s: the Session (its ``out`` outbox and the other parts' methods).
    """

    def __init__(self, s) -> None:
        self._s = s
        self._o = s.out
        self._resp: Optional[_Response] = None
        self._audio_started = False  # audio output has started: the voice is fixed (docs/protocol.md §8)
        self._trace = LatencyTrace(self._o.session_id)  # the latency trace (debug option; its own machine)
        self._turn_hold: Optional[_TurnHold] = None  # a server-VAD answer's outputs, held (check_turn_hold)
        self._hold_state = Machine("turn hold", TURN_HOLD_TABLE, TurnHold.NONE)

    def on_output(self, out: EngineOutput, now_ms: float) -> None:
        """A non-fatal engine output of this stream: traced, dropped when of an older epoch, held
        with a server-VAD answer (:meth:`turn_held`), else applied."""
        if isinstance(out, UnitTimings):
            self._trace.unit_timings(out)
        if out.epoch != self._o.epoch:
            return
        if self._resp is not None and self._resp.trace is not None:
            self._trace.output(self._resp, out, now_ms)
        apply = _APPLY.get(type(out))
        if apply is not None and not self.turn_held(out):
            apply(self, out)

    # -- what the other parts ask -----------------------------------------------------------------
    def active(self) -> Optional[_Response]:
        """The active response (None when idle); its record is read-only to the other parts."""
        return self._resp

    def audio_started(self) -> bool:
        return self._audio_started

    def set_forced_unit(self, unit: Optional[int]) -> None:
        """The active response's forced unit (``AppendUnit.force_speak``) went out."""
        self._resp.forced_unit = unit

    def start(self, trigger: str, cap) -> _Response:
        """A response the Session starts itself (a tool call's, a filler's): ``create`` ->
        requested, ``response.created``."""
        self._o.fire(PhaseEvent.CREATE)
        self._resp = self._new_response(trigger, list(self._s.settings.output_modalities), None, cap, forced_unit=None)
        self._o.emit(ResponseCreated(response=self._response_model(self._resp, "in_progress")))
        return self._resp

    def done_with_calls(self, outputs: list) -> None:
        """The active response's output is function calls (``tool_call`` fired before the items
        went out): ``response.done`` listing them."""
        r = self._resp
        self._o.emit(ResponseDone(response=self._response_model(r, "completed", None, outputs)))
        self._resp = None
        self._s.input.reset_force_listen()

    def on_response_create(self, ev: ResponseCreateEvent, now_ms: float) -> None:
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
            if params.output_modalities and "audio" in params.output_modalities and not self._o.cfg.audio_output_available:
                raise ProtocolError(ErrorCode.BAD_EVENT, _NO_VOCODER, param="response.output_modalities",
                                    event_id=ev.event_id)
            self._s.tools.for_response(params, ev.event_id)  # invalid_tools before anything changes
        if self._resp is not None and self._resp.trigger in ("filler", "progress") and self._s.tools.queue_create(params, ev.event_id):
            return  # a filler speaks: this response starts when it ends (docs/tools.md)
        self.create(params, "client", ev.event_id, now_ms)

    def create(self, params, trigger: str, event_id: Optional[str], now_ms: float = 0) -> None:
        """Pre-create a response and run its forced unit at once on the audio already buffered
        (an early unit close with ``force_speak``; docs/concepts.md "Early unit close")."""
        self._o.fire(PhaseEvent.CREATE, event_id)  # response_already_active unless idle
        mods = list(self._s.settings.output_modalities)
        metadata = None
        cap: Union[int, str] = self._s.settings.max_output_tokens
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
        self._o.emit(ResponseCreated(response=self._response_model(self._resp, "in_progress")))
        if LatencyTrace.enabled():
            self._resp.trace = {"request_ms": float(now_ms), "units_ahead": self._s.input.units_ahead()}
        tools, choice = self._s.tools.for_response(params, event_id)
        if self._s.tools.plan_response(trigger, tools, choice, now_ms):
            return  # the tool decider answers first (docs/tools.md); the forced unit waits for it
        self._resp.forced_unit = self._s.input.close_unit(now_ms, force_speak=True)

    def _new_response(self, trigger, mods, metadata, cap, forced_unit) -> _Response:
        stream_audio = "audio" in self._s.settings.output_modalities
        audio = "audio" in mods and stream_audio
        if not audio:
            mods = ["text"]
        rid = self._o.ids.response()
        self._s.conv.issue_response(rid)
        return _Response(
            id=rid, item_id=self._s.conv.new_item_id(), epoch=self._o.epoch, trigger=trigger, audio=audio,
            modalities=mods, metadata=metadata, max_tokens=None if cap == "inf" else int(cap), forced_unit=forced_unit,
        )

    def on_response_cancel(self, ev: ResponseCancelEvent, now_ms: float) -> None:
        if ev.response_id is not None and self._resp is not None and ev.response_id != self._resp.id:
            raise TransitionError(ErrorCode.RESPONSE_NOT_ACTIVE, self._o.phase.value, PhaseEvent.CANCEL.value,
                                  message=f"response {ev.response_id!r} is not active", event_id=ev.event_id)
        self._o.fire(PhaseEvent.CANCEL, ev.event_id)
        self.cancel_active("client_cancelled")

    def on_output_clear(self, ev: OutputAudioBufferClearEvent, now_ms: float) -> None:
        if self._resp is None:
            self._o.emit(OutputAudioBufferCleared())
            return
        self._o.fire(PhaseEvent.CANCEL, ev.event_id)
        self._o.emit(OutputAudioBufferCleared(response_id=self._resp.id))
        self.cancel_active("client_cancelled")

    def _response_model(self, r: _Response, status: str, details=None, output=None):
        return response_model(r, status, details, output, self._s.conv.committed_ms(r.id))

    def cancel_active(self, reason: str) -> None:
        """Epoch +1, CancelEpoch, close the active response as cancelled (``reason``)."""
        self._o.advance_epoch()
        self.finish("cancelled", StatusDetails(type="cancelled", reason=reason))

    def _open_envelope(self, r: _Response) -> None:
        r.opened = True
        it = _ConvItem(id=r.item_id, role="assistant", kind="output_audio" if r.audio else "output_text",
                       status="in_progress", response_id=r.id)
        prev = self._s.conv.open_response_item(r.id, it)
        self._o.emit(ConversationItemAdded(previous_item_id=prev, item=self._s.conv.model(it)))
        self._o.emit(OutputItemAdded(response_id=r.id, item=self._s.conv.model(it)))
        part = Part(type="audio", transcript="") if r.audio else Part(type="text", text="")
        self._o.emit(ContentPartAdded(response_id=r.id, item_id=r.item_id, part=part))
        if self._o.duplex:
            self._o.emit(ResponseSpeak(response_id=r.id, item_id=r.item_id, metadata=DeltaMetadata(epoch=self._o.epoch)))

    def _ensure_open(self) -> _Response:
        """SPEAK: open a model response (idle) or the pre-created one's envelope (requested)."""
        self._o.fire(PhaseEvent.SPEAK)
        if self._resp is None:
            self._resp = self._new_response("model", list(self._s.settings.output_modalities), None,
                                            self._s.settings.max_output_tokens, forced_unit=None)
            self._o.emit(ResponseCreated(response=self._response_model(self._resp, "in_progress")))
        r = self._resp
        if not r.opened:
            self._open_envelope(r)
        return r

    def on_decision(self, d: Decision) -> None:
        if d.decision == "speak":
            self._ensure_open()
            return
        r = self._resp
        if r is None:
            self._o.fire(PhaseEvent.LISTEN)  # a beat: stays idle
            if self._o.duplex:
                self._o.emit(ResponseListen(epoch=self._o.epoch, response=ResponseObject(
                    status="listening", metadata={"reason": "model_listen"})))
            return
        if r.opened or r.forced_unit is None or d.unit_index < r.forced_unit:
            self._o.fire(PhaseEvent.LISTEN)  # speaking, or a unit before the forced one: no change
            return
        self._o.fire(PhaseEvent.FORCED_LISTEN)
        if self._o.duplex:
            self._o.emit(ResponseListen(epoch=self._o.epoch, response_id=r.id, response=ResponseObject(
                id=r.id, status="listening", metadata={"reason": "model_listen"}, epoch=self._o.epoch)))
        r.metadata = {**(r.metadata or {}), "decision": "listen"}
        self.finish("completed", None)

    def on_text(self, t: TextDelta) -> None:
        r = self._resp
        if r is None and not t.text:
            return
        if r is None or not r.opened:
            r = self._ensure_open()
        r.tokens += int(t.n_tokens)
        if not r.audio and t.text:
            it = self._s.conv.response_item(r.id)
            it.text += t.text
            r.parts.append(t.text)
            r.chars += len(t.text)
            self._o.emit(OutputTextDelta(response_id=r.id, item_id=r.item_id, delta=t.text,
                                       metadata=DeltaMetadata(epoch=self._o.epoch)))
        if r.max_tokens is not None and r.tokens >= r.max_tokens:
            self._o.fire(PhaseEvent.TOKEN_CAP)
            self._o.advance_epoch()
            self.finish("incomplete", StatusDetails(type="incomplete", reason="max_output_tokens"))

    def on_audio(self, c: AudioChunk) -> None:
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
        it = self._s.conv.response_item(r.id)
        it.text += text
        r.parts.append(text)
        r.chars += len(text)
        it.marks.append((r.chars, ms))
        it.sent_ms = ms
        self._audio_started = True
        if r.trace is not None:
            r.trace.setdefault("first_audio_ms", self._o.now_ms)  # sent now (a held answer: its release)
        meta = DeltaMetadata(epoch=self._o.epoch, audio_duration_ms=ms,
                             audio_text_marks=[TextMark(text_chars=r.chars, audio_end_ms=ms)], end_of_turn=bool(c.final))
        self._o.emit(OutputAudioDelta(response_id=r.id, item_id=r.item_id, delta=b64encode_audio(pcm), format="pcm16",
                                    sample_rate_hz=OUTPUT_SAMPLE_RATE, metadata=meta))
        self._o.emit(OutputAudioTranscriptDelta(response_id=r.id, item_id=r.item_id, delta=text,
                                              metadata=DeltaMetadata(epoch=self._o.epoch)))

    def on_turn_end(self, t: TurnEnd) -> None:
        if self._resp is None:
            return
        if self._s.tools.answer_holds(t.reason):  # an answer spoken piece by piece goes on (docs/tools.md)
            return
        self._o.fire(PhaseEvent.TURN_END)
        if t.reason == "cancelled":
            self.finish("cancelled", StatusDetails(type="cancelled", reason="client_cancelled"))
        else:
            self.finish("completed", None)

    def engine_failed(self, e: EngineFailure) -> None:
        if self._resp is None:
            self._o.error(ProtocolError(ErrorCode.SERVER_ERROR, e.message or "engine error"))
            return
        self._o.fire(PhaseEvent.FAIL)
        self._o.advance_epoch()
        self.finish("failed", StatusDetails(type="failed", error=StatusError(
            type=ERROR_TYPES[ErrorCode.SERVER_ERROR], code=e.code or ErrorCode.SERVER_ERROR.value, message=e.message or "engine error")))

    def engine_fatal(self, e: EngineFailure) -> None:
        self._o.fire(PhaseEvent.CLOSE)  # the move to closed ends the active response (response.done)
        if self._resp is not None:
            self._o.advance_epoch()
            self.finish("failed", StatusDetails(type="failed", error=StatusError(
                type=ERROR_TYPES[ErrorCode.SERVER_ERROR], code=ErrorCode.SERVER_ERROR.value, message=e.message or "engine failure")))
        self._o.error(ProtocolError(ErrorCode.SERVER_ERROR, e.message or "the engine failed and cannot continue"))
        self._o.emit(SessionClosed(session_id=self._o.session_id, epoch=self._o.epoch, reason=ErrorCode.SERVER_ERROR.value))
        self._o.cmd(CloseStream(self._o.stream_id, self._o.epoch))
        self._o.close_connection(1011, ErrorCode.SERVER_ERROR.value)

    def finish(self, status: str, details: Optional[StatusDetails]) -> None:
        """Close the parts the active response opened (§5.3 steps 7–12) and emit response.done."""
        r = self._resp
        assert r is not None
        output = []
        if r.opened:
            it = self._s.conv.response_item(r.id)
            it.status = "completed" if status == "completed" else "incomplete"
            text = "".join(r.parts)
            if r.audio:
                self._o.emit(OutputAudioDone(response_id=r.id, item_id=r.item_id))
                self._o.emit(OutputAudioTranscriptDone(response_id=r.id, item_id=r.item_id, transcript=text))
                part = Part(type="audio", transcript=text)
            else:
                self._o.emit(OutputTextDone(response_id=r.id, item_id=r.item_id, text=text))
                part = Part(type="text", text=text)
            self._o.emit(ContentPartDone(response_id=r.id, item_id=r.item_id, part=part))
            model = self._s.conv.model(it)
            self._o.emit(OutputItemDone(response_id=r.id, item=model))
            self._o.emit(ConversationItemDone(previous_item_id=self._s.conv.previous_of(it.id), item=model))
            if self._s.settings.playback_commit_policy == "commit_on_done" and not it.final:
                it.committed_ms = max(it.committed_ms, it.sent_ms)
            output = [model]
        self._o.emit(ResponseDone(response=self._response_model(r, status, details, output)))
        if r.trace is not None:
            self._trace.finished(r, status)
        self._resp = None
        self._s.input.reset_force_listen()
        self._s.tools.response_finished(r, self._o.now_ms)

    # -- turn confirmation: a server-VAD answer is heard only once the turn surely ended ----------
    def hold_answer(self, until: int, now_ms: float) -> None:
        """Hold the outputs of the active (server-VAD) answer until the VAD has classified input up to
        real-sample ``until`` (:meth:`check_turn_hold`)."""
        r = self._resp
        self._hold_state.fire(TurnHoldEvent.HOLD)
        self._turn_hold = _TurnHold(r.id, self._o.epoch, until)
        self.check_turn_hold(now_ms)

    def check_turn_hold(self, now_ms: float) -> None:
        """Release or drop the held outputs of a server-VAD answer (docs/concepts.md "Turn confirmation").

        The commit of a server-VAD turn creates the response at once, so the engine computes the
        answer while the VAD goes on listening; its outputs (decisions, text, audio, turn end,
        failures of its epoch) are held until the VAD has classified ``start_confirm_ms`` (100 ms
        at the defaults) of input past the point where it decided the turn ended, with no speech
        frame left in its confirmation window. Speech that resumes in that window is confirmed
        as a new ``speech_started`` (a barge-in: the response is cancelled with ``turn_detected``)
        before anything of the answer was sent, so a false end of turn is never heard. The hold
        also ends when the input has been silent for :data:`TURN_HOLD_STALL_MS` (a client that
        stopped streaming). Nothing is added when the engine is slower than the window.
        """
        h = self._turn_hold
        if h is None:
            return
        if self._o.epoch != h.epoch:
            self._hold_state.fire(TurnHoldEvent.DROP)
            self._turn_hold = None  # cancelled (resumed speech, response.cancel): dropped with its epoch
            return
        r = self._resp
        if r is None or r.id != h.response_id:  # ended without a cancel (its tool calls): nothing to confirm
            self._hold_state.fire(TurnHoldEvent.RELEASE)
            self._turn_hold = None
            self._dispatch_held(h.queued)
            return
        looked = self._s.input.vad_looked_past(h.until)
        stalled = self._s.input.quiet_for(TURN_HOLD_STALL_MS, now_ms)
        if not (looked or stalled):
            return
        self._hold_state.fire(TurnHoldEvent.RELEASE)
        self._turn_hold = None
        self._dispatch_held(h.queued)

    def _dispatch_held(self, queued: list) -> None:
        for out in queued:
            if out.epoch != self._o.epoch:
                continue  # a held output ended the response and advanced the epoch (token cap)
            _APPLY[type(out)](self, out)

    def turn_held(self, out: EngineOutput) -> bool:
        """Whether ``out`` (an engine output of the current epoch) joins a held server-VAD answer."""
        if self._turn_hold is None:
            return False
        self.check_turn_hold(self._o.now_ms)
        h = self._turn_hold
        if h is None or out.epoch != h.epoch:
            return False
        h.queued.append(out)
        return True


_APPLY = {Decision: Responses.on_decision, TextDelta: Responses.on_text, AudioChunk: Responses.on_audio,
          TurnEnd: Responses.on_turn_end, EngineFailure: Responses.engine_failed}
"""Engine outputs that drive the active response, and the method each goes to."""
