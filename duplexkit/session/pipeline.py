"""The input pipeline of a Session: decode (``StreamDecoder``), arrival-rate check, resample to
16 kHz, server VAD, unit framing, early unit close, the barge-in fence, silence feeding,
commit/clear and input backpressure (docs/concepts.md "Early unit close", "Barge-in"): the
:class:`InputPipeline` part, and its small machines (the VAD item, the held commit, the barge-in
unit hold, the padding debt; :class:`~duplexkit.session.machine.Machine` tables)."""

from __future__ import annotations

import numpy as np
from collections import deque
from enum import Enum
from typing import Optional

from duplexkit.audio import AudioFormatError, StreamDecoder, StreamResampler, UnitFramer, b64decode_audio
from duplexkit.audio.arrival import ArrivalRateMonitor
from duplexkit.engine.api import AppendUnit, INPUT_SAMPLE_RATE
from duplexkit.protocol import (
    ConversationItemAdded,
    ConversationItemDone,
    ErrorCode,
    InputAudioBufferAppendEvent,
    InputAudioBufferClearEvent,
    InputAudioBufferCleared,
    InputAudioBufferCommitEvent,
    InputAudioBufferCommitted,
    ProtocolError,
    SpeechStarted,
    SpeechStopped,
)
from duplexkit.session.config import COMMIT_MERGE_MS, MIN_COMMIT_SAMPLES, UNIT_PERIOD_MS
from duplexkit.session.conversation import _ConvItem
from duplexkit.session.holds import PadDebt, UnitHold
from duplexkit.session.machine import Machine, PhaseEvent


def _resampler_pending(r) -> int:
    """Input samples a resampler holds that it has not put out yet, in 16 kHz samples."""
    if r.identity:
        return 0
    return max(0, r.samples_in * INPUT_SAMPLE_RATE // r.in_rate - r.samples_out)


def _vad_pieces(vad, x16: np.ndarray):
    """Run the VAD over ``x16`` two frames at a time and yield ``(audio, starts, stops)`` in stream
    order (lazily: each piece is classified after the previous one was applied). A speech_stopped
    is yielded after the rest of the chunk, or, when a later piece starts speech again, before it;
    two frames, so a stop and the next start (>= 3 voiced frames after it) never share a piece."""
    step = 2 * vad.cfg.frame_samples
    stop, tail = None, []  # a speech_stopped not applied yet, and the pieces after it
    for i in range(0, x16.size, step):
        piece = x16[i:i + step]
        events = vad.process(piece)
        if stop is not None and events:
            yield (np.concatenate(tail) if tail else piece[:0]), [], [stop]
            stop, tail = None, []
        if stop is not None:
            tail.append(piece)
            continue
        yield piece, [e for e in events if e.kind == "speech_started"], []
        stops = [e for e in events if e.kind == "speech_stopped"]
        if stops:
            stop = stops[-1]
    if stop is not None:
        yield (np.concatenate(tail) if tail else x16[:0]), [], [stop]


def _rate_message(w, fmt) -> str:
    """The ``input_rate_mismatch`` message of an arrival-rate warning ``w`` for declared format ``fmt``."""
    guess = (f"; it looks like {w.likely_rate} Hz audio" if w.likely_rate is not None
             and w.likely_rate != w.declared_rate else "")
    return (f"input audio arrives at {w.ratio:.2f}x its declared rate: {w.apparent_rate:.0f} frames per second "
            f"over the last {w.window_ms / 1000:.1f} s of continuous appends, declared {fmt.describe()}{guess}. "
            f"Declare the rate the audio was captured at (audio.input.format.rate or sample_rate_hz) and send it "
            f"at least in real time; the audio is still used (this warning is sent once)")


class VadItem(str, Enum):
    """The item of the speech the server VAD hears: ``none``; ``open`` (speech_started gave it an
    id); ``committed`` (a client commit took the open item while the user still speaks, so its
    speech_stopped commits nothing more)."""

    NONE = "none"
    OPEN = "open"
    COMMITTED = "committed"


class VadItemEvent(str, Enum):
    STARTED = "started"
    COMMIT = "commit"
    STOPPED = "stopped"
    RESET = "reset"  # a new VAD (turn_detection changed)


VAD_ITEM_TABLE = {
    VadItem.NONE: {VadItemEvent.STARTED: VadItem.OPEN, VadItemEvent.STOPPED: VadItem.NONE,
                   VadItemEvent.RESET: VadItem.NONE},
    VadItem.OPEN: {VadItemEvent.STARTED: VadItem.OPEN, VadItemEvent.COMMIT: VadItem.COMMITTED,
                   VadItemEvent.STOPPED: VadItem.NONE, VadItemEvent.RESET: VadItem.NONE},
    VadItem.COMMITTED: {VadItemEvent.STARTED: VadItem.OPEN, VadItemEvent.STOPPED: VadItem.NONE,
                        VadItemEvent.RESET: VadItem.NONE},
}
"""The VAD item's machine: state -> event -> next state (a missing pair is an internal error)."""


class HeldCommit(str, Enum):
    """A client commit's early-closed unit: ``none``, or ``held`` back for
    :data:`~duplexkit.session.config.COMMIT_MERGE_MS` in case ``response.create`` follows."""

    NONE = "none"
    HELD = "held"


class HeldCommitEvent(str, Enum):
    DEFER = "defer"  # a client commit held its unit back
    CLOSE = "close"  # the unit went out (as a listen unit, or as a response's forced unit)


HELD_COMMIT_TABLE = {
    HeldCommit.NONE: {HeldCommitEvent.DEFER: HeldCommit.HELD},
    HeldCommit.HELD: {HeldCommitEvent.DEFER: HeldCommit.HELD, HeldCommitEvent.CLOSE: HeldCommit.NONE},
}
"""The held commit's machine: state -> event -> next state."""


class InputPipeline:
    """The input pipeline part of :class:`~duplexkit.session.Session`: client audio in,
    ``AppendUnit`` commands and VAD events out.

    Args:
        s: the Session (its ``out`` outbox and the other parts' methods).
        now_ms: the clock at creation (ms).
    """

    def __init__(self, s, now_ms: float) -> None:
        self._s = s
        self._o = s.out
        fmt = s.settings.input_format
        self._decoder = StreamDecoder(fmt)
        self._resampler = StreamResampler(fmt.rate, INPUT_SAMPLE_RATE)
        self._arrival = ArrivalRateMonitor(fmt.rate)
        self._framer = UnitFramer()
        self.debt = PadDebt()  # the padding account of early unit closes (its own machine)
        self._unit_hold = UnitHold()  # units held for the barge-in fence (its own machine)
        self._last_real_ms = float(now_ms)
        self._vad = None
        self._vad_base_samples = 0
        self._real_samples = 0  # real 16 kHz input samples seen (the VAD timeline)
        self._since_commit = 0  # real 16 kHz samples pushed since the last commit/clear
        self._vad_item: Optional[str] = None  # the item id of the speech the VAD hears
        self._vad_state = Machine("VAD item", VAD_ITEM_TABLE, VadItem.NONE)
        self._units_appended = 0
        self.input_appends = 0  # accepted input_audio_buffer.append events (read-only counter)
        self._last_unit_ms = float(now_ms)
        self._inflight: deque = deque()  # (unit_index, samples) appended, not yet decided
        self._inflight_samples = 0
        self._force_listen_left = 0
        self._close_pending_ms: Optional[float] = None  # when a client commit's early close was held back
        self._held_commit = Machine("held commit", HELD_COMMIT_TABLE, HeldCommit.NONE)
        self.make_vad()

    # -- what the other parts ask -----------------------------------------------------------------
    def started(self, now_ms: float) -> None:
        """The session started: the input schedule and ``force_listen_count`` begin now."""
        self._last_unit_ms = float(now_ms)
        self.reset_force_listen()

    def reset_force_listen(self) -> None:
        """A response ended: the next ``force_listen_count`` units are forced to listen again."""
        self._force_listen_left = self._s.settings.force_listen_count

    def set_format(self, fmt) -> None:
        """A new input format declaration: new decoder and resampler, the arrival check re-armed."""
        self._decoder = StreamDecoder(fmt)
        self._resampler = StreamResampler(fmt.rate, INPUT_SAMPLE_RATE)
        self._arrival = ArrivalRateMonitor(fmt.rate)

    def units_appended(self) -> int:
        return self._units_appended

    def units_in_flight(self) -> set:
        """Indices of the appended units still awaiting their decision."""
        return {u for u, _ in self._inflight}

    def units_ahead(self) -> int:
        """Units appended or held that the engine has not decided yet."""
        return len(self._inflight) + len(self._unit_hold)

    def user_speaking(self) -> bool:
        """The server VAD hears speech (an open VAD item)."""
        return self._vad_item is not None

    def input_ms(self) -> int:
        """Real input audio so far, ms of 16 kHz audio."""
        return self._real_samples * 1000 // INPUT_SAMPLE_RATE

    def vad_looked_past(self, until: int) -> bool:
        """The VAD has classified input up to real-sample ``until`` and has no start pending."""
        vad = self._vad
        return vad is None or (self._vad_base_samples + vad.position_samples >= until and not vad.start_pending)

    def quiet_for(self, ms: float, now_ms: float) -> bool:
        """No real input for ``ms`` (a client that stopped streaming)."""
        return now_ms - self._last_real_ms >= ms

    def flush_held(self, now_ms: float) -> None:
        """Send what is held (padding account, barge-in fence) before a ``SpeakText``."""
        self._settle_debt(now_ms, keep=True)
        self.release_units(now_ms, force=True)

    def close_held_commit(self, now_ms: float, due_only: bool = False) -> None:
        """Send a client commit's held-back unit (``due_only``: once :data:`COMMIT_MERGE_MS` passed)."""
        if self._held_commit.state is HeldCommit.NONE:
            return
        if due_only and now_ms - self._close_pending_ms < COMMIT_MERGE_MS:
            return
        self._close_committed(now_ms)

    def tick(self, now_ms: float) -> None:
        """Release held units; while a response is active and input runs dry, feed a silence unit
        once a unit's deadline (1 period + ``silence_slack_ms``) has passed (core module docstring)."""
        self.release_units(now_ms)
        slack = self._o.cfg.silence_slack_ms
        if self._s.resp.active() is not None and now_ms - self._last_unit_ms >= UNIT_PERIOD_MS + slack:
            due = self._last_unit_ms + UNIT_PERIOD_MS  # where this unit ends on the input schedule
            self._feed_silence(now_ms)
            # the next silence unit is due one unit period after this one's place on the schedule, not after
            # the tick that fed it: the slack and the tick's lag are paid once per dry spell, not once per unit,
            # so an answer driven by silence arrives at 1 s of audio per second; more than one
            # period behind (a stalled loop), the schedule restarts from now instead of bursting
            self._last_unit_ms = max(due, now_ms - UNIT_PERIOD_MS)

    def item_audio(self, x: np.ndarray, now_ms: float) -> None:
        """A user ``input_audio`` item's decoded audio: a whole user turn of its own, pushed and
        closed (the turn's earlier audio is dropped from the tools' capture)."""
        self._s.tools.drop_turn_audio()
        self._push_real(self._resampler.process(x), now_ms)
        self._s.tools.user_turn_ending(now_ms)
        self._flush_input(now_ms)
        self._since_commit = 0

    def make_vad(self) -> None:
        td = self._s.settings.turn_detection
        self._vad_base_samples = self._real_samples
        vad_cls = self._s.opts.vad_classes()
        if td is None or vad_cls is None:
            self._vad = None
            return
        StreamingVAD, VadConfig = vad_cls
        self._vad = StreamingVAD(VadConfig(threshold=td["threshold"], prefix_padding_ms=td["prefix_padding_ms"],
                                           silence_duration_ms=td["silence_duration_ms"]))
        self._vad_state.fire(VadItemEvent.RESET)
        self._vad_item = None

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
        self._o.error(ProtocolError(ErrorCode.INPUT_RATE_MISMATCH, _rate_message(w, self._s.settings.input_format),
                                    event_id=event_id))

    def on_append(self, ev: InputAudioBufferAppendEvent, now_ms: float) -> None:
        # bad base64, a zero-length append or non-finite floats: one bad_audio error, no state change
        fmt = self._s.settings.input_format
        try:
            data = b64decode_audio(ev.audio, allow_empty=False, what=fmt.describe())
        except AudioFormatError as e:
            raise ProtocolError(ErrorCode.BAD_AUDIO, str(e), param="audio", event_id=ev.event_id) from None
        incoming = (len(data) + self._decoder.carried_bytes) // fmt.frame_bytes * INPUT_SAMPLE_RATE // fmt.rate
        self.check_pending(incoming, ev.event_id)
        try:
            x = self._decoder.decode(data, allow_empty=False)
        except AudioFormatError as e:
            raise ProtocolError(ErrorCode.BAD_AUDIO, str(e), param="audio", event_id=ev.event_id) from None
        self._push_real(self._resampler.process(x), now_ms)
        self.input_appends += 1
        self._check_arrival(x.size, now_ms, ev.event_id)
        if ev.video_frames:
            self._o.warn("video_frames_ignored", "this server takes audio only: video_frames of appends are ignored "
                       "(this warning is sent once)", "video_frames", ev.event_id)
        if ev.sample_rate_hz is not None and ev.sample_rate_hz != fmt.rate:
            self._o.warn("append_rate_ignored", f"append sample_rate_hz {ev.sample_rate_hz} differs from the session's "
                       f"input rate {fmt.rate} Hz; the audio is read at {fmt.rate} Hz (declare the rate with "
                       "session.update; this warning is sent once)", "sample_rate_hz", ev.event_id)

    def check_pending(self, incoming: int, event_id: Optional[str]) -> None:
        """``input_backpressure`` when ``incoming`` more 16 kHz samples would exceed
        ``max_pending_input_s`` of unconsumed input (docs/protocol.md §6.1). Every path that queues
        input audio (appends, ``conversation.item.create`` audio) calls this before decoding."""
        pending = self._framer.pending_samples + self._inflight_samples + self.debt.held_samples() + self._unit_hold.samples()
        limit = int(self._o.cfg.limits.max_pending_input_s * INPUT_SAMPLE_RATE)
        if pending + incoming > limit:
            raise ProtocolError(ErrorCode.INPUT_BACKPRESSURE,
                                f"more than {self._o.cfg.limits.max_pending_input_s:g} s of input not yet consumed; "
                                "audio dropped", event_id=event_id)

    def _push_real(self, x16: np.ndarray, now_ms: float) -> None:
        """Feed real 16 kHz input: VAD (speech_started before framing, speech_stopped after).

        A barge-in's speech_started advances the epoch before any of this chunk (or a unit held
        for the fence, :meth:`_frame`) is appended, so the interrupting audio from its onset minus
        pre-roll on is tagged with the new epoch. After an early unit close the chunk may first go
        through the padding account (:meth:`_settle_debt`).

        The VAD takes the chunk two frames at a time, so that a chunk holding several events (a
        file sent at once) has them applied in stream order, each at its place in the audio: a
        speech_stopped is applied after the rest of the chunk is framed, or, when a later piece
        of the chunk starts speech again, before that piece.
        """
        if x16.size == 0:
            return
        if self._vad is None:
            self._feed_real(x16, [], [], now_ms)
            return
        for piece, starts, stops in _vad_pieces(self._vad, x16):
            self._feed_real(piece, starts, stops, now_ms)

    def _feed_real(self, x16: np.ndarray, starts: list, stops: list, now_ms: float) -> None:
        """Apply ``starts``, frame ``x16`` (may be empty), then apply ``stops`` (VAD events)."""
        start_real = self._real_samples
        if x16.size:
            self._real_samples += x16.size
            self._s.tools.capture_turn_audio(x16)
            self._last_real_ms = float(now_ms)
        for e in starts:
            onset = self._vad_base_samples + e.audio_start_ms * INPUT_SAMPLE_RATE // 1000
            self.debt.note_onset(onset)
            self._on_speech_started(e)
            self.release_units(now_ms)
        if x16.size:
            self._since_commit += x16.size
            if self._s.resp.active() is None and self.debt.owed() > 0:
                self.debt.hold(x16, start_real)
                self._settle_debt(now_ms)
            else:
                self._settle_debt(now_ms, keep=True)
                self._frame(self._framer.push(x16), now_ms, silence=False)
        self.release_units(now_ms)
        for e in stops:
            self._on_speech_stopped(e, now_ms)

    def _debt_guard(self) -> int:
        """Held samples past the padding needed before a speech onset inside them is surely known:
        the VAD's pre-roll + start confirmation + 2 frames (440 ms at defaults); without a VAD the
        300 ms pre-roll + one 10 ms energy block."""
        if self._vad is not None:
            c = self._vad.cfg
            return (c.preroll_ms + c.start_confirm_ms + 2 * c.frame_ms) * INPUT_SAMPLE_RATE // 1000
        return (300 + 10) * INPUT_SAMPLE_RATE // 1000

    def _settle_debt(self, now_ms: float, keep: bool = False) -> None:
        """Settle the padding account (:meth:`PadDebt.settle`) and frame what it gives back.
        ``keep``: a response is active, so nothing is dropped (the debt stays owed)."""
        vad_speaking = self._vad.speaking if self._vad is not None else None
        rest = self.debt.settle(keep, vad_speaking, self._debt_guard())
        if rest is not None:
            self._frame(self._framer.push(rest), now_ms, silence=False)

    def _holding_units(self) -> bool:
        """Units complete during a response wait for the VAD to look past them (barge-in fence)."""
        td = self._s.settings.turn_detection or {}
        return self._s.resp.active() is not None and self._vad is not None and td.get("interrupt_response", True)

    def _frame(self, units: list, now_ms: float, silence: bool) -> None:
        """Append units in order. While a response can be interrupted by the server VAD a unit is
        held until the VAD has classified ``_debt_guard()`` samples past its end (440 ms at the
        defaults), so a speech onset whose pre-roll reaches into it advances the epoch first and
        the unit is tagged with the new epoch (docs/protocol.md §3)."""
        end_real = self._real_samples
        for u in units:
            if self._holding_units() or len(self._unit_hold):
                self._unit_hold.hold(u, end_real, silence)
            else:
                self._append_unit(u, now_ms, silence)
        self.release_units(now_ms)

    def release_units(self, now_ms: float, force: bool = False) -> None:
        """Append held units: all when ``force``, no response is active, or input stalled for
        the guard time (no more audio can carry an onset); else those the VAD has looked past.
        Also settles a held server-VAD answer (:meth:`Responses.check_turn_hold`; this runs on every tick)."""
        self._s.resp.check_turn_hold(now_ms)
        if not len(self._unit_hold):
            return
        guard = self._debt_guard()
        stalled = now_ms - self._last_real_ms >= guard * 1000 // INPUT_SAMPLE_RATE
        everything = force or not self._holding_units() or stalled
        vad_pos = self._vad_base_samples + self._vad.position_ms * INPUT_SAMPLE_RATE // 1000 if self._vad else 0
        for u, silence in self._unit_hold.release(lambda end_real: everything or vad_pos >= end_real + guard):
            self._append_unit(u, now_ms, silence)

    def _append_unit(self, u, now_ms: float, silence: bool, force_speak: bool = False) -> None:
        self._units_appended += 1
        self._last_unit_ms = float(now_ms)
        self._inflight.append((u.index, u.audio.shape[0]))
        self._inflight_samples += u.audio.shape[0]
        listen = False if force_speak else self._force_listen_now()
        if not listen:  # a unit the model may start a turn in
            self._s.opts.note_free_unit(u.index, self.units_in_flight())
        self._o.cmd(AppendUnit(self._o.stream_id, self._o.epoch, unit_index=u.index, audio=u.audio,
                               force_listen=listen, is_silence=silence, force_speak=force_speak))

    def _force_listen_now(self) -> bool:
        if self._s.tools.gate():  # the tool decider or a call's output is awaited (docs/tools.md)
            return True
        if self._force_listen_left > 0:
            self._force_listen_left -= 1
            return True
        if self._s.settings.answer_policy == "on_request":
            r = self._s.resp.active()
            return not (r is not None and r.trigger in ("client", "server_vad"))
        return False

    def consumed(self, unit_index: int) -> None:
        while self._inflight and self._inflight[0][0] <= unit_index:
            self._inflight_samples -= self._inflight.popleft()[1]

    def _feed_silence(self, now_ms: float) -> None:
        self._settle_debt(now_ms, keep=True)
        if len(self._unit_hold):
            self.release_units(now_ms, force=True)
            return
        pending = self._framer.pending_samples
        need = self._framer.needed_samples - pending
        units = self._framer.push(np.zeros(need, np.float32))
        self._frame(units, now_ms, silence=pending == 0)

    def close_unit(self, now_ms: float, force_speak: bool = False) -> Optional[int]:
        """Early unit close: the partial unit (after anything held) goes out now, zero-padded to the
        length the model needs; the padding is owed to the silence that follows (:class:`PadDebt`).
        ``force_speak``: this is a requested response's forced unit, made even from zeros only.
        Returns the closed unit's index (None when nothing was pending and not forced)."""
        if self._held_commit.state is HeldCommit.HELD:  # a commit's held-back unit is this one
            self._held_commit.fire(HeldCommitEvent.CLOSE)
            self._close_pending_ms = None
        self._settle_debt(now_ms, keep=True)
        self.release_units(now_ms, force=True)
        u = self._framer.flush(allow_empty=force_speak)
        if u is None:
            return None
        self.debt.pad(u.padded_samples)
        self._append_unit(u, now_ms, silence=u.real_samples == 0, force_speak=force_speak)
        return u.index

    def _flush_input(self, now_ms: float, drop_carry: bool = True, defer: bool = False) -> None:
        """End the user turn's audio: resampler tail and the zero-padded partial unit (an early
        unit close, :meth:`close_unit`).

        ``drop_carry``: drop the 1-3 carried bytes of an incomplete sample (docs/protocol.md §6.1: on a
        client commit or clear). A server-VAD commit passes False: it happens at a point of the
        byte stream the client does not know, so its next append still completes that sample.
        ``defer``: keep the closed unit back for :data:`~duplexkit.session.config.COMMIT_MERGE_MS`
        (a client commit): a ``response.create`` in that window makes it the forced unit.
        """
        self._settle_debt(now_ms, keep=True)
        tail = self._resampler.flush()
        if tail.size:
            self._since_commit += tail.size
            self._frame(self._framer.push(tail), now_ms, silence=False)
        if defer and self._framer.pending_samples > 0:
            self._held_commit.fire(HeldCommitEvent.DEFER)
            self._close_pending_ms = float(now_ms)
        else:
            self.close_unit(now_ms)
        if drop_carry:
            self._decoder.reset()

    def _close_committed(self, now_ms: float) -> None:
        """Send a client commit's held-back unit as an ordinary (listen/decide) unit."""
        self.close_unit(now_ms)

    def on_commit(self, ev: InputAudioBufferCommitEvent, now_ms: float) -> None:
        if self._since_commit + _resampler_pending(self._resampler) < MIN_COMMIT_SAMPLES:
            raise ProtocolError(ErrorCode.INPUT_AUDIO_BUFFER_EMPTY,
                                "less than 100 ms of audio since the last commit or clear", event_id=ev.event_id)
        item_id = self._vad_item if self._vad_state.state is VadItem.OPEN else None
        if item_id is not None:
            self._vad_state.fire(VadItemEvent.COMMIT)
        self._commit(now_ms, item_id, defer=True)

    def _commit(self, now_ms: float, item_id: Optional[str] = None, drop_carry: bool = True,
                flush: bool = True, defer: bool = False) -> str:
        self._s.tools.user_turn_ending(now_ms)
        if flush:
            self._flush_input(now_ms, drop_carry, defer=defer)
        self._since_commit = 0
        uid = item_id or self._s.conv.new_item_id()
        it = _ConvItem(id=uid, role="user", kind="input_audio")
        prev = self._s.conv.add(it)
        self._o.emit(InputAudioBufferCommitted(item_id=uid, previous_item_id=prev))
        self._o.emit(ConversationItemAdded(previous_item_id=prev, item=self._s.conv.model(it)))
        self._o.emit(ConversationItemDone(previous_item_id=prev, item=self._s.conv.model(it)))
        self._s.tools.user_turn_ended(uid, now_ms)
        return uid

    def on_clear(self, ev: InputAudioBufferClearEvent, now_ms: float) -> None:
        self._framer.clear()
        self.debt.clear()
        self._decoder.reset()
        self._resampler.reset()
        self._since_commit = 0
        self._s.tools.drop_turn_audio()
        self._o.emit(InputAudioBufferCleared())

    def _vad_ms(self, ms: int) -> int:
        return self._vad_base_samples * 1000 // INPUT_SAMPLE_RATE + int(ms)

    def _on_speech_started(self, e) -> None:
        self._vad_state.fire(VadItemEvent.STARTED)
        self._vad_item = self._s.conv.new_item_id()
        self._o.emit(SpeechStarted(audio_start_ms=self._vad_ms(e.audio_start_ms), item_id=self._vad_item))
        td = self._s.settings.turn_detection or {}
        if self._s.resp.active() is not None and td.get("interrupt_response", True):
            self._o.fire(PhaseEvent.BARGE_IN)
            self._s.resp.cancel_active("turn_detected")

    def _on_speech_stopped(self, e, now_ms: float) -> None:
        uid = self._vad_item or self._s.conv.new_item_id()
        committed = self._vad_state.state is VadItem.COMMITTED
        self._vad_state.fire(VadItemEvent.STOPPED)
        self._vad_item = None
        self._o.emit(SpeechStopped(audio_end_ms=self._vad_ms(e.audio_ms), item_id=uid))
        if committed or self._since_commit + _resampler_pending(self._resampler) < MIN_COMMIT_SAMPLES:
            return
        td = self._s.settings.turn_detection or {}
        creates = bool(td.get("create_response")) and self._s.resp.active() is None
        # early unit close (docs/concepts.md): the creating commit closes the unit as the forced
        # one; otherwise extra_body.early_unit_close decides whether the partial unit goes now
        self._commit(now_ms, uid, drop_carry=False, flush=self._s.settings.early_unit_close and not creates)
        if creates:
            self._s.resp.create(None, "server_vad", None, now_ms)
            r = self._s.resp.active()
            if r is not None and r.trigger == "server_vad" and self._vad is not None and td.get("interrupt_response", True):
                window = self._vad.cfg.start_confirm_ms * INPUT_SAMPLE_RATE // 1000
                self._s.resp.hold_answer(self._vad_base_samples + e.decided_sample + window, now_ms)
