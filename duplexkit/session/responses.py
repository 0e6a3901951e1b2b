"""The response job of a Session: ``response.create``/``cancel``, the envelope (item, output item,
content part, ``response.speak``/``listen``), text and audio deltas, the token cap, engine
failures, epochs (``CancelEpoch``), ``response.done`` and the latency trace. Every phase change
goes through ``self._fire`` (:mod:`duplexkit.session.machine`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Optional, Union

from duplexkit.audio import b64encode_audio, float32_to_pcm16
from duplexkit.engine.api import (
    AudioChunk,
    CancelEpoch,
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
from duplexkit.session.config import CloseConnection
from duplexkit.session.conversation import _ConvItem
from duplexkit.session.settings import _NO_VOCODER
from duplexkit.session.machine import PhaseEvent
from duplexkit.session.wire import response_model

trace_log = logging.getLogger("duplexkit.latency")
"""Latency trace (debug option, docs/benchmarks.md "Latency trace"): at DEBUG level the Session logs
one JSON line per finished response with its request -> forced unit -> decision -> first audio
stamps (Session clock, ms) and the forced unit's engine ``UnitTimings``. ``first_audio_ms`` is when
the first audio delta went out to the client (for a server-VAD answer held by the turn confirmation,
its release), ``engine_audio_ms`` when the engine's first audio of the response arrived."""


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


class ResponsesMixin:
    """The response job of :class:`~duplexkit.session.Session` (state: ``_resp``, ``epoch``,
    ``_trace_wait``)."""

    # latency trace (debug option: the ``duplexkit.latency`` logger at DEBUG)
    def _trace_output(self, r: _Response, out: EngineOutput, now_ms: float) -> None:
        t = r.trace
        if isinstance(out, Decision) and r.forced_unit is not None and out.unit_index >= r.forced_unit:
            t.setdefault("decision_ms", float(now_ms))
            t.setdefault("decision_unit", out.unit_index)
        elif isinstance(out, AudioChunk) and out.audio.size:
            # when the engine's audio arrived; first_audio_ms is stamped when it goes out (_on_audio),
            # later than this for an answer held by the turn confirmation (docs/concepts.md)
            t.setdefault("engine_audio_ms", float(now_ms))
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
            self._tools_for_response(params, ev.event_id)  # invalid_tools before anything changes
        if self._resp is not None and self._resp.trigger in ("filler", "progress") and self._queued_create is None:
            # a filler speaks: this response starts when it ends (docs/tools.md)
            self._queued_create = (params, ev.event_id)
            return
        self._create_response(params, "client", ev.event_id, now_ms)

    def _create_response(self, params, trigger: str, event_id: Optional[str], now_ms: float = 0) -> None:
        """Pre-create a response and run its forced unit at once on the audio already buffered
        (an early unit close with ``force_speak``; docs/concepts.md "Early unit close")."""
        self._fire(PhaseEvent.CREATE, event_id)  # response_already_active unless idle
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
        tools, choice = self._tools_for_response(params, event_id)
        if self._plan_response(trigger, tools, choice, now_ms):
            return  # the tool decider answers first (docs/tools.md); the forced unit waits for it
        self._resp.forced_unit = self._close_unit(now_ms, force_speak=True)

    def _new_response(self, trigger, mods, metadata, cap, forced_unit) -> _Response:
        stream_audio = "audio" in self.settings.output_modalities
        audio = "audio" in mods and stream_audio
        if not audio:
            mods = ["text"]
        rid = self._ids.response()
        self.conv.issue_response(rid)
        return _Response(
            id=rid, item_id=self.conv.new_item_id(), epoch=self.epoch, trigger=trigger, audio=audio,
            modalities=mods, metadata=metadata, max_tokens=None if cap == "inf" else int(cap), forced_unit=forced_unit,
        )

    def _on_response_cancel(self, ev: ResponseCancelEvent, now_ms: float) -> None:
        if ev.response_id is not None and self._resp is not None and ev.response_id != self._resp.id:
            raise TransitionError(ErrorCode.RESPONSE_NOT_ACTIVE, self.phase.value, PhaseEvent.CANCEL.value,
                                  message=f"response {ev.response_id!r} is not active", event_id=ev.event_id)
        self._fire(PhaseEvent.CANCEL, ev.event_id)
        self._cancel_active("client_cancelled")

    def _on_output_clear(self, ev: OutputAudioBufferClearEvent, now_ms: float) -> None:
        if self._resp is None:
            self._emit(OutputAudioBufferCleared())
            return
        self._fire(PhaseEvent.CANCEL, ev.event_id)
        self._emit(OutputAudioBufferCleared(response_id=self._resp.id))
        self._cancel_active("client_cancelled")

    def _advance_epoch(self) -> None:
        self.out.advance_epoch()

    def _response_model(self, r: _Response, status: str, details=None, output=None):
        return response_model(r, status, details, output, self.conv.committed_ms(r.id))

    def _cancel_active(self, reason: str) -> None:
        """Epoch +1, CancelEpoch, close the active response as cancelled (``reason``)."""
        self._advance_epoch()
        self._finish("cancelled", StatusDetails(type="cancelled", reason=reason))

    def _open_envelope(self, r: _Response) -> None:
        r.opened = True
        it = _ConvItem(id=r.item_id, role="assistant", kind="output_audio" if r.audio else "output_text",
                       status="in_progress", response_id=r.id)
        prev = self.conv.open_response_item(r.id, it)
        self._emit(ConversationItemAdded(previous_item_id=prev, item=self.conv.model(it)))
        self._emit(OutputItemAdded(response_id=r.id, item=self.conv.model(it)))
        part = Part(type="audio", transcript="") if r.audio else Part(type="text", text="")
        self._emit(ContentPartAdded(response_id=r.id, item_id=r.item_id, part=part))
        if self._duplex:
            self._emit(ResponseSpeak(response_id=r.id, item_id=r.item_id, metadata=DeltaMetadata(epoch=self.epoch)))

    def _ensure_open(self) -> _Response:
        """SPEAK: open a model response (idle) or the pre-created one's envelope (requested)."""
        self._fire(PhaseEvent.SPEAK)
        if self._resp is None:
            self._resp = self._new_response("model", list(self.settings.output_modalities), None,
                                            self.settings.max_output_tokens, forced_unit=None)
            self._emit(ResponseCreated(response=self._response_model(self._resp, "in_progress")))
        r = self._resp
        if not r.opened:
            self._open_envelope(r)
        return r

    def _on_decision(self, d: Decision) -> None:
        if d.decision == "speak":
            self._ensure_open()
            return
        r = self._resp
        if r is None:
            self._fire(PhaseEvent.LISTEN)  # a beat: stays idle
            if self._duplex:
                self._emit(ResponseListen(epoch=self.epoch, response=ResponseObject(
                    status="listening", metadata={"reason": "model_listen"})))
            return
        if r.opened or r.forced_unit is None or d.unit_index < r.forced_unit:
            self._fire(PhaseEvent.LISTEN)  # speaking, or a unit before the forced one: no change
            return
        self._fire(PhaseEvent.FORCED_LISTEN)
        if self._duplex:
            self._emit(ResponseListen(epoch=self.epoch, response_id=r.id, response=ResponseObject(
                id=r.id, status="listening", metadata={"reason": "model_listen"}, epoch=self.epoch)))
        r.metadata = {**(r.metadata or {}), "decision": "listen"}
        self._finish("completed", None)

    def _on_text(self, t: TextDelta) -> None:
        r = self._resp
        if r is None and not t.text:
            return
        if r is None or not r.opened:
            r = self._ensure_open()
        r.tokens += int(t.n_tokens)
        if not r.audio and t.text:
            it = self.conv.response_item(r.id)
            it.text += t.text
            r.parts.append(t.text)
            r.chars += len(t.text)
            self._emit(OutputTextDelta(response_id=r.id, item_id=r.item_id, delta=t.text,
                                       metadata=DeltaMetadata(epoch=self.epoch)))
        if r.max_tokens is not None and r.tokens >= r.max_tokens:
            self._fire(PhaseEvent.TOKEN_CAP)
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
        it = self.conv.response_item(r.id)
        it.text += text
        r.parts.append(text)
        r.chars += len(text)
        it.marks.append((r.chars, ms))
        it.sent_ms = ms
        self._audio_started = True
        if r.trace is not None:
            r.trace.setdefault("first_audio_ms", self._now_ms)  # sent now (a held answer: its release)
        meta = DeltaMetadata(epoch=self.epoch, audio_duration_ms=ms,
                             audio_text_marks=[TextMark(text_chars=r.chars, audio_end_ms=ms)], end_of_turn=bool(c.final))
        self._emit(OutputAudioDelta(response_id=r.id, item_id=r.item_id, delta=b64encode_audio(pcm), format="pcm16",
                                    sample_rate_hz=OUTPUT_SAMPLE_RATE, metadata=meta))
        self._emit(OutputAudioTranscriptDelta(response_id=r.id, item_id=r.item_id, delta=text,
                                              metadata=DeltaMetadata(epoch=self.epoch)))

    def _on_turn_end(self, t: TurnEnd) -> None:
        if self._resp is None:
            return
        if self._answer_holds(t.reason):  # an answer spoken piece by piece goes on (docs/tools.md)
            return
        self._fire(PhaseEvent.TURN_END)
        if t.reason == "cancelled":
            self._finish("cancelled", StatusDetails(type="cancelled", reason="client_cancelled"))
        else:
            self._finish("completed", None)

    def _engine_failed(self, e: EngineFailure) -> None:
        if self._resp is None:
            self._error(ProtocolError(ErrorCode.SERVER_ERROR, e.message or "engine error"))
            return
        self._fire(PhaseEvent.FAIL)
        self._advance_epoch()
        self._finish("failed", StatusDetails(type="failed", error=StatusError(
            type=ERROR_TYPES[ErrorCode.SERVER_ERROR], code=e.code or ErrorCode.SERVER_ERROR.value, message=e.message or "engine error")))

    def _engine_fatal(self, e: EngineFailure) -> None:
        self._fire(PhaseEvent.CLOSE)  # the move to closed ends the active response (response.done)
        if self._resp is not None:
            self._advance_epoch()
            self._finish("failed", StatusDetails(type="failed", error=StatusError(
                type=ERROR_TYPES[ErrorCode.SERVER_ERROR], code=ErrorCode.SERVER_ERROR.value, message=e.message or "engine failure")))
        self._error(ProtocolError(ErrorCode.SERVER_ERROR, e.message or "the engine failed and cannot continue"))
        self._emit(SessionClosed(session_id=self.session_id, epoch=self.epoch, reason=ErrorCode.SERVER_ERROR.value))
        self._cmd(CloseStream(self.stream_id, self.epoch))
        self.out.close_connection(1011, ErrorCode.SERVER_ERROR.value)

    def _finish(self, status: str, details: Optional[StatusDetails]) -> None:
        """Close the parts the active response opened (§5.3 steps 7–12) and emit response.done."""
        r = self._resp
        assert r is not None
        output = []
        if r.opened:
            it = self.conv.response_item(r.id)
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
            model = self.conv.model(it)
            self._emit(OutputItemDone(response_id=r.id, item=model))
            self._emit(ConversationItemDone(previous_item_id=self.conv.previous_of(it.id), item=model))
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
        self._force_listen_left = self.settings.force_listen_count
        self._tools_response_finished(r, self._now_ms)
