"""The stage steps of :class:`~duplexkit.engine.runtime.StageRuntime` (a mixin): control items
(open, update, end turn, speak text, close) dispatched through one ``(stage, kind)`` handler table,
one batched step per stage (thinker, talker, code2wav), and the batch-call helpers that keep a
failing stream's error its own (retry in halves).

Every stage has the same operations on a stream's state, under one name each (:class:`StageOps`):
``open``, ``update``, ``end_turn`` and ``close``; :data:`STAGE_OPS` spells each one in the
:class:`~duplexkit.engine.stages.StageModel` calls of that stage.

Runs on the stage worker threads; the methods that touch stream state take the runtime's lock
(``self._cond``) as the runtime module docstring describes."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from duplexkit.errors import ErrorCode, detach_traceback

from .api import AudioChunk, Decision, EngineFailure, StreamConfig, TextDelta, TurnEnd
from .stages import StageModel, TalkerWork, ThinkerWork, VocoderWork
from .streams import WorkKind, _ms, _Slot, _StreamState, _WorkItem

log = logging.getLogger("duplexkit.engine")

__all__ = ["StageOps", "STAGE_OPS", "CONTROL", "StageSteps"]


def _none(*_a: Any) -> None:
    return None


@dataclass(frozen=True)
class StageOps:
    """One stage's operations on a stream's state ``h`` (its handle: ``_StreamState.handles[stage]``),
    each returning the handle to keep (None: the stage holds nothing for the stream now).

    Attributes:
        open: ``(model, config) -> handle``: create the state when the stream opens.
        update: ``(model, handle, old, new) -> handle``: a new :class:`StreamConfig`.
        end_turn: ``(model, handle) -> handle``: end the model turn (after a cancel or a failed turn).
        close: ``(model, handle) -> None``: free the state (called only with a handle).
        end_turn_frees / update_frees: the call frees the whole state (the talker's ``end_turn``, the
            vocoder's ``update``: a new voice reopens it at the next unit): the stream lets go of the
            handle before the call, so a call that raises leaves nothing to free twice.
    """

    open: Callable[[StageModel, StreamConfig], Any]
    update: Callable[[StageModel, Any, StreamConfig, StreamConfig], Any]
    end_turn: Callable[[StageModel, Any], Any]
    close: Callable[[StageModel, Any], None]
    end_turn_frees: bool = False
    update_frees: bool = False


def _end_and_keep(end: Callable[[StageModel, Any], None]) -> Callable[[StageModel, Any], Any]:
    def run(m: StageModel, h: Any) -> Any:
        end(m, h)
        return h
    return run


def _close_and_drop(m: StageModel, h: Any) -> None:
    m.talker_close(h)  # a talker turn is its whole state: ending the turn frees it


def _code2wav_update(m: StageModel, h: Any, old: StreamConfig, new: StreamConfig) -> None:
    m.code2wav_close(h)  # another voice: the next unit reopens it (_code2wav_step)


STAGE_OPS = {
    "thinker": StageOps(
        open=lambda m, cfg: m.thinker_open(cfg),
        update=lambda m, h, old, new: m.thinker_update(h, old, new),
        end_turn=_end_and_keep(lambda m, h: m.thinker_end_turn(h)),  # generated tokens stay in the KV
        close=lambda m, h: m.thinker_close(h),
    ),
    "talker": StageOps(
        open=_none,  # a talker turn is made by the first speaking unit (_talker_step)
        update=lambda m, h, old, new: h,
        end_turn=_close_and_drop,
        close=lambda m, h: m.talker_close(h),
        end_turn_frees=True,
    ),
    "code2wav": StageOps(
        open=lambda m, cfg: m.code2wav_open(cfg.ref_voice) if cfg.output_audio else None,
        update=_code2wav_update,
        end_turn=_end_and_keep(lambda m, h: m.code2wav_end_turn(h)),
        close=lambda m, h: m.code2wav_close(h),
        update_frees=True,
    ),
}
"""stage -> its :class:`StageOps` (the one place that names the per-stage StageModel calls)."""


class StageSteps:
    """Stage-thread side of :class:`~duplexkit.engine.runtime.StageRuntime`: needs ``model``,
    ``fault_hook``, ``_cond`` and the runtime's locked helpers (``_fail``, ``_fail_turn``, ``_emit``,
    ``_finish_slot``, ``_flush``, ``_stage_opened``, ``_stage_closed``)."""

    def _control(self, stage: str, st: _StreamState, it: _WorkItem) -> None:
        """Run one control item through :data:`CONTROL`; an exception fails the stream."""
        try:
            handler = CONTROL.get((stage, it.kind))
            if handler is None:
                raise RuntimeError(f"no {stage} handler for a {it.kind.value} item")
            handler(self, stage, st, it)
        except Exception as exc:  # noqa: BLE001 - confined to this stream
            with self._cond:
                if it.kind is WorkKind.OPEN:
                    self._stage_opened(st, stage)
                self._fail(st, stage, exc, -1)

    def _open(self, stage: str, st: _StreamState, it: _WorkItem) -> None:
        st.handles[stage] = STAGE_OPS[stage].open(self.model, it.payload)
        with self._cond:
            self._stage_opened(st, stage)

    def _close(self, stage: str, st: _StreamState, it: _WorkItem) -> None:
        try:
            if st.handles[stage] is not None:
                STAGE_OPS[stage].close(self.model, st.handles[stage])
        except Exception:  # noqa: BLE001 - freeing must go on
            log.exception("closing %s state of stream %s", stage, st.id)
        finally:
            st.handles[stage] = None
            with self._cond:
                self._stage_opened(st, stage)
                self._stage_closed(st, stage)

    def _end_turn(self, stage: str, st: _StreamState, it: Optional[_WorkItem] = None) -> None:
        """End the stream's model turn at ``stage`` (a control item after a cancel; also called by the
        talker step between turns and by ``_fail_turn``). Raises what the model raises."""
        ops, h = STAGE_OPS[stage], st.handles[stage]
        if h is None:
            return
        if ops.end_turn_frees:
            st.handles[stage] = None
        st.handles[stage] = ops.end_turn(self.model, h)

    def _update(self, stage: str, st: _StreamState, it: _WorkItem) -> None:
        """A new :class:`StreamConfig` at ``stage``: the stage's ``update`` on its state, then the
        config is the one in effect there (``applied[stage]``). Raises what the model raises."""
        old, new = it.payload
        ops, h = STAGE_OPS[stage], st.handles[stage]
        if h is not None:
            if ops.update_frees:
                st.handles[stage] = None
            st.handles[stage] = ops.update(self.model, h, old, new)
        st.applied[stage] = new

    def _speak_text(self, stage: str, st: _StreamState, it: _WorkItem) -> None:
        """Queue a ``SpeakText`` on the stream's thinker state (thinker thread). A model without
        ``thinker_speak_text``, or one that refuses the text, answers with a non-fatal
        ``EngineFailure`` in the command's slot (nothing was queued; the stream goes on)."""
        text, per_unit = it.payload
        fn = getattr(self.model, "thinker_speak_text", None)
        err = None
        if fn is None:
            err = f"SpeakText is not supported by this engine's thinker ({type(self.model).__name__})"
        elif st.handles["thinker"] is not None:
            try:
                fn(st.handles["thinker"], text, per_unit)
            except Exception as exc:  # noqa: BLE001 - nothing was queued: the stream is as it was
                err = f"SpeakText failed: {type(exc).__name__}: {exc}"
        with self._cond:
            slot = it.slot
            if err is not None and slot.epoch == st.epoch and st.live:
                log.warning("stream %s: %s", st.id, err)
                self._emit(st, slot, EngineFailure(st.id, slot.epoch, -1, code=ErrorCode.SERVER_ERROR.value, message=err,
                                                   fatal=False))
            self._finish_slot(st, slot, timings=False)
            self._flush(st)

    def _run_batch(self, stage: str, fn: Callable[[list], list], work: list, items: list,
                   pre: Optional[dict] = None) -> tuple:
        """Call the stage function on the items that have no result yet (``pre`` maps an index to
        an exception already known for it; a test's :class:`~duplexkit.engine.stages.FaultHook`, when
        one is installed, adds its own); returns ``(results, t0, t1)``."""
        results: list = [None] * len(work)
        for i, exc in (pre or {}).items():
            results[i] = exc
        run_idx = []
        hook = self.fault_hook
        for i, (st, _it) in enumerate(work):
            if results[i] is not None:
                continue
            injected = hook.take(stage, st.id) if hook is not None else None
            if injected is not None:
                results[i] = injected
            else:
                run_idx.append(i)
        t0 = time.perf_counter()
        if run_idx:
            self._call_split(stage, fn, items, run_idx, results)
        return results, t0, time.perf_counter()

    def _call_split(self, stage: str, fn: Callable[[list], list], items: list, idx: list, results: list) -> None:
        """Run ``fn`` on ``items[idx]``; when the batch call raises, retry it in halves until the
        failing stream(s) are alone, so that one bad stream fails only itself (co-batched streams
        go on). Costs at most ``2·log2(n)`` extra calls per failing stream. Stage functions must
        leave a stream's state untouched when they raise for the batch (validate, then mutate)."""
        try:
            out = fn([items[i] for i in idx])
            if len(out) != len(idx):
                raise RuntimeError(f"{stage} returned {len(out)} results for {len(idx)} items")
        except Exception as exc:  # noqa: BLE001 - isolated below
            # no frames kept: the failed call's tensors are freed before the retries run
            err = detach_traceback(exc)
        else:
            for i, r in zip(idx, out):
                results[i] = r
            return
        if len(idx) == 1:
            results[idx[0]] = err
            return
        log.warning("%s batch of %d raised %s: %s; retrying in halves to isolate the stream",
                    stage, len(idx), type(err).__name__, err)
        del err
        mid = len(idx) // 2
        self._call_split(stage, fn, items, idx[:mid], results)
        self._call_split(stage, fn, items, idx[mid:], results)

    def _mark_queue_wait(self, work: list, stage: str) -> None:
        """Add the time each item waited in its stage queue to its unit's ``queue_ms`` (and to
        ``<stage>_queue_ms``)."""
        with self._cond:
            now = time.perf_counter()
            for _st, it in work:
                w = (now - it.t_enqueue) * 1000.0
                it.slot.timings["queue_ms"] += w
                it.slot.timings[f"{stage}_queue_ms"] = round(w, 3)

    def _current_results(self, stage: str, work: list, results: list, on_error: Callable) -> Any:
        """(Caller holds the lock.) Yield ``(stream, item, result)`` for the results that still
        matter: skips failed or closing streams, hands exceptions to ``on_error(st, stage, exc,
        slot)``, and finishes (without emitting) units whose epoch was cancelled while they ran."""
        for (st, it), res in zip(work, results):
            slot = it.slot
            if not st.live:
                continue
            if isinstance(res, BaseException):
                on_error(st, stage, res, slot)
                continue
            if slot.epoch != st.epoch:  # cancelled while running: discard
                self._finish_slot(st, slot, timings=False)
                self._flush(st)
                continue
            yield st, it, res

    def _fail_stream(self, st: _StreamState, stage: str, exc: BaseException, slot: "_Slot") -> None:
        self._fail(st, stage, exc, slot.unit_index)

    def _thinker_step(self, work: list) -> None:
        items = []
        with self._cond:
            now = time.perf_counter()
            for st, it in work:
                cmd, audio = it.payload
                force_speak = st.force_speak_epoch is not None and st.force_speak_epoch == it.slot.epoch
                if force_speak:
                    st.force_speak_epoch = None
                # a unit's force_speak belongs to the epoch it was submitted in: decided in a later one (a
                # cancel re-tagged it while queued), it was a cancelled response's forced unit: it listens
                cancelled_force = bool(cmd.force_speak) and cmd.epoch != it.slot.epoch
                force_speak = force_speak or (bool(cmd.force_speak) and not cancelled_force)
                it.slot.timings["queue_ms"] += (now - it.t_enqueue) * 1000.0
                it.slot.timings["thinker_queue_ms"] = _ms(it.t_enqueue, now)
                items.append(ThinkerWork(handle=st.handles["thinker"], audio=audio,
                                         force_listen=bool(cmd.force_listen) or cancelled_force,
                                         force_speak=force_speak, frame=cmd.frame, unit_index=cmd.unit_index))
        results, t0, t1 = self._run_batch("thinker", self.model.thinker_step, work, items)
        with self._cond:
            for st, it, res in self._current_results("thinker", work, results, self._fail_stream):
                slot = it.slot
                tm = slot.timings
                tm["thinker_prefill_ms"] = round(float(res.timings.get("prefill_ms", 0.0)), 3)
                tm["thinker_decode_ms"] = round(float(res.timings.get("decode_ms", _ms(t0, t1))), 3)
                tm["decode_steps"] = int(res.timings.get("decode_steps", res.n_tokens))
                tm["thinker_ms"] = _ms(t0, t1)
                tm["thinker_done_ms"] = _ms(slot.t_submit, time.perf_counter())
                tm["thinker_batch"] = len(work)
                speak = res.decision == "speak"
                self._emit(st, slot, Decision(st.id, slot.epoch, slot.unit_index, decision=res.decision,
                                              turn_start=bool(res.turn_start)))
                if speak:
                    self._emit(st, slot, TextDelta(st.id, slot.epoch, slot.unit_index, text=res.text,
                                                   n_tokens=int(res.n_tokens)))
                    if st.applied["thinker"].output_audio:
                        st.q["talker"].append(_WorkItem(WorkKind.UNIT, slot, res))
                    else:
                        if res.end_of_turn:
                            self._emit(st, slot, TurnEnd(st.id, slot.epoch, slot.unit_index, reason="turn_eos"))
                        self._finish_slot(st, slot)
                else:
                    self._finish_slot(st, slot)
                self._flush(st)
            self._cond.notify_all()

    def _talker_step(self, work: list) -> None:
        items = []
        pre = {}
        m = self.model
        for i, (st, it) in enumerate(work):  # talker turns are created on this thread only
            res = it.payload
            turn_start = st.handles["talker"] is None or bool(res.turn_start)
            try:
                if turn_start:
                    self._end_turn("talker", st)
                    seed = st.applied["thinker"].seed
                    st.turn_count += 1
                    st.handles["talker"] = m.talker_open(
                        None if seed is None else (int(seed) * 1_000_003 + st.turn_count) % (2**63))
            except Exception as exc:  # noqa: BLE001
                pre[i] = detach_traceback(exc)
            items.append(TalkerWork(turn=st.handles["talker"], talker_input=res.talker_input, turn_start=turn_start,
                                    turn_end=bool(res.end_of_turn)))
        self._mark_queue_wait(work, "talker")
        results, t0, t1 = self._run_batch("talker", m.talker_step, work, items, pre)
        for (st, it), res in zip(work, results):
            if it.payload.end_of_turn and not isinstance(res, BaseException):
                self._end_turn("talker", st)  # turn over: free its KV now
        with self._cond:
            for st, it, res in self._current_results("talker", work, results, self._fail_turn):
                slot = it.slot
                slot.timings["talker_ms"] = _ms(t0, t1)
                slot.timings["talker_done_ms"] = _ms(slot.t_submit, time.perf_counter())
                slot.timings["talker_steps"] = int(res.steps)
                slot.timings["talker_codes"] = int(len(res.codes))
                slot.timings["talker_batch"] = len(work)
                st.q["code2wav"].append(_WorkItem(WorkKind.UNIT, slot, (res.codes, bool(it.payload.end_of_turn), it.payload.text)))
            self._cond.notify_all()

    def _code2wav_step(self, work: list) -> None:
        items = []
        pre = {}
        m = self.model
        for i, (st, it) in enumerate(work):
            if st.handles["code2wav"] is None:  # opened lazily (text-only stream switched to audio, or new voice)
                try:
                    st.handles["code2wav"] = m.code2wav_open(st.applied["code2wav"].ref_voice)
                except Exception as exc:  # noqa: BLE001
                    pre[i] = detach_traceback(exc)
            codes, last, _text = it.payload
            items.append(VocoderWork(handle=st.handles["code2wav"], codes=np.asarray(codes, dtype=np.int64), last=last))
        self._mark_queue_wait(work, "code2wav")
        results, t0, t1 = self._run_batch("code2wav", m.code2wav_step, work, items, pre)
        with self._cond:
            for st, it, res in self._current_results("code2wav", work, results, self._fail_turn):
                slot = it.slot
                codes, last, text = it.payload
                audio = np.asarray(res.audio, dtype=np.float32).reshape(-1)
                st.pending_text += text
                slot.timings["code2wav_ms"] = _ms(t0, t1)
                slot.timings["code2wav_batch"] = len(work)
                if audio.size and "first_audio_ms" not in slot.timings:
                    slot.timings["first_audio_ms"] = _ms(slot.t_submit, time.perf_counter())
                if audio.size or last:
                    self._emit(st, slot, AudioChunk(st.id, slot.epoch, slot.unit_index, audio=audio,
                                                    text=st.pending_text, final=last))
                    st.pending_text = ""
                if last:
                    self._emit(st, slot, TurnEnd(st.id, slot.epoch, slot.unit_index, reason="turn_eos"))
                self._finish_slot(st, slot)
                self._flush(st)
            self._cond.notify_all()


_Handler = Callable[[StageSteps, str, _StreamState, _WorkItem], None]

CONTROL: dict = {
    **{(s, WorkKind.OPEN): StageSteps._open for s in STAGE_OPS},
    **{(s, WorkKind.END_TURN): StageSteps._end_turn for s in STAGE_OPS},
    **{(s, WorkKind.CLOSE): StageSteps._close for s in STAGE_OPS},
    ("thinker", WorkKind.UPDATE): StageSteps._update,
    ("code2wav", WorkKind.UPDATE): StageSteps._update,
    ("thinker", WorkKind.SPEAK_TEXT): StageSteps._speak_text,
}
"""(stage, kind) -> the handler of a control item; a pair missing here fails the stream (a runtime
bug). ``UNIT`` items are no control items: they go to the stage's batched step."""
