"""The three-stage runtime: Thinker, Talker and Code2Wav workers joined by queues.

Threads and ownership
---------------------
Each stage is one worker thread. A stream's stage state (thinker KV, talker turn, vocoder caches)
is created, used and freed only on that stage's thread; the asyncio event loop only queues
commands (:meth:`RuntimeStream.submit` never blocks on model work) and receives outputs through
``loop.call_soon_threadsafe`` into the stream's ``asyncio.Queue``.

Scheduling
----------
Every stream has one FIFO queue per stage. A stage step takes the head item of up to
``max_num_seqs`` streams (round robin, one item per stream so per-stream order holds), runs the
control items (open, update, end-turn/reset, close) one by one, and hands the work items to the
:class:`~duplexkit.engine.stages.StageModel` as one batch (a list in, a list out).

Batching window: a stage with ``batch_window_ms`` > 0 (the thinker's default is 8 ms) does not pick
as soon as one unit is queued. While every queued head is a unit and fewer streams have one than
``min(open streams, max_num_seqs)`` (open: neither failed nor closing), the worker waits until the
rest have queued theirs, a job arrives, the engine stops, or ``batch_window_ms`` has passed since
the oldest queued head was enqueued (:meth:`StageRuntime._window_wait_s`). Units that arrive
together therefore run as one batch; a unit that already waited that long is never held, a control
item at a head is never held, and a single open stream never waits.

Per-stream output order
-----------------------
Outputs are delivered strictly unit by unit: all outputs of unit *k* (``Decision``, then
``TextDelta`` for a speaking unit, then ``AudioChunk``\\ s, ``TurnEnd``, and finally
``UnitTimings``) before any output of unit *k + 1*. Outputs of the head unit stream out as soon
as they exist; later units wait in a small per-stream sequencer. An ``AudioChunk`` carries the
transcript text of every unit whose codes were pushed into the vocoder since the previous chunk
(text therefore leads its audio by at most one chunk); the turn's last chunk has ``final=True``
and is followed by ``TurnEnd(reason="turn_eos")``. Streams with ``output_audio=False`` skip the
talker and vocoder: ``TurnEnd`` follows the turn's last ``TextDelta``.

Epochs and cancellation
-----------------------
``CancelEpoch(epoch=E)`` (or any command carrying an epoch above the stream's) makes E current:

* queued talker and vocoder work of older epochs is dropped, a pending ``ForceSpeak`` is dropped,
  and unsent outputs of older epochs are discarded;
* work already running in a stage completes, and its results are discarded;
* the model turn is ended on every stage, in order after any in-flight step: ``thinker_end_turn``
  (generated tokens stay in the KV, docs/model.md §5.2), the talker turn is dropped, the vocoder
  ``reset_turn``\\ s;
* queued **input units are kept** and re-tagged with E: they carry the user's (barge-in) speech,
  which docs/protocol.md §7.2 feeds to the model in the new epoch; a re-tagged unit submitted with
  ``force_speak`` (the forced unit of a response cancelled before it was decided) loses it and is
  decided as a forced ``listen``: a cancelled forced unit never speaks;
* no ``TurnEnd`` is emitted for the cancelled turn (the Session ends its response itself);
* forced speech (``SpeakText``) not yet spoken is dropped: queued ``SpeakText`` items are removed and
  the thinker's ``end_turn`` empties the stream's forced-text queue.

Forced speech
-------------
``SpeakText`` travels in the thinker queue in order with the stream's units, as a control item with
a sequencer slot of its own (``unit_index`` -1), so it is applied after the units submitted before it
and before any submitted after it; the thinker queues the text on the stream
(:meth:`~duplexkit.engine.stages.StageModel.thinker_speak_text`), and the following units speak it
(docs/model.md, "Forced speech"), their outputs tagged with the epoch in effect. A stage model without
forced speech (the vLLM thinker) or a text it refuses answers with a non-fatal ``EngineFailure`` in
that slot; the stream goes on.

Failures
--------
An exception in the thinker for one stream (returned in its result slot, or raised by a batch of
one) fails that stream only: it gets ``EngineFailure(code="server_error", fatal=True)`` (its KV may
be half-updated), its state is freed at every stage, and its output iterator ends. An exception in
the talker or the vocoder costs only the current turn: the unit gets a non-fatal ``EngineFailure``,
that stage's turn state is dropped, and the stream keeps serving (the Session ends the response
``failed`` and advances the epoch). A batch call that raises with several streams is retried in
halves until the failing stream is alone (:meth:`StageRuntime._call_split`): only that stream
fails, its co-batched streams get their results and keep running.
Errors not tied to a unit carry ``unit_index=-1``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import traceback
from collections import deque
from typing import Any, AsyncIterator, Callable, Optional

import numpy as np

from duplexkit.errors import EngineInputError, ErrorCode

from .api import (
    AppendUnit,
    CancelEpoch,
    CloseStream,
    EngineCommand,
    EngineFailure,
    EngineOutput,
    ForceSpeak,
    OpenStream,
    SpeakText,
    StreamConfig,
    UnitTimings,
    UpdateStream,
)
from .api import FIRST_UNIT_SAMPLES, UNIT_SAMPLES
from .layout import STAGES, Layout
from .stages import FaultHook, StageModel
from .steps import StageSteps
from .streams import StreamStatus, WorkKind, _ms, _Slot, _StreamState, _voice_key, _WorkItem

__all__ = ["EngineInputError", "StageRuntime", "RuntimeStream", "FIRST_UNIT_SAMPLES", "UNIT_SAMPLES"]

log = logging.getLogger("duplexkit.engine")


# ---------------------------------------------------------------------------------------------
# the runtime
# ---------------------------------------------------------------------------------------------


class StageRuntime(StageSteps):
    """Runs the three stage workers for one :class:`~duplexkit.engine.stages.StageModel`.

    Args:
        model: the batch-shaped stage functions.
        layout: gives ``max_num_seqs`` and ``batch_window_ms`` per stage.

    Attributes:
        fault_hook: a test's :class:`~duplexkit.engine.stages.FaultHook` (None: no faults), asked
            before each batch call; :func:`duplexkit.testing.inject_fault` installs one.
    """

    def __init__(self, model: StageModel, layout: Layout) -> None:
        self.model = model
        self.layout = layout
        self.fault_hook: Optional[FaultHook] = None
        self._cond = threading.Condition()
        self._streams: dict = {}
        self._rr = {s: 0 for s in STAGES}
        self._jobs = {s: deque() for s in STAGES}
        self._stop = False
        self._threads = [
            threading.Thread(target=self._worker, args=(s,), name=f"duplexkit-{s}", daemon=True) for s in STAGES
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ event-loop side

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def open_stream(self, stream_id: str, config: StreamConfig) -> RuntimeStream:
        """Open a stream and wait until every stage has created its state.

        An open failure does not raise: the stream's outputs yield a fatal ``EngineFailure``.

        Raises:
            ValueError: ``stream_id`` is already open. RuntimeError: the runtime is shut down.
        """
        loop = asyncio.get_running_loop()
        st = _StreamState(stream_id, config, loop)
        st.opened = loop.create_future()
        with self._cond:
            if self._stop:
                raise RuntimeError("engine is closed")
            if stream_id in self._streams:
                raise ValueError(f"stream {stream_id!r} is already open")
            self._streams[stream_id] = st
            for s in STAGES:
                st.q[s].append(_WorkItem(WorkKind.OPEN, payload=config))
            self._cond.notify_all()
        try:
            await asyncio.shield(st.opened)
        except asyncio.CancelledError:  # the caller gave up: free the half-opened stream
            with self._cond:
                if st.live:
                    self._begin_close(st)
                self._cond.notify_all()
            raise
        return RuntimeStream(self, st)

    def _submit(self, st: _StreamState, cmd: EngineCommand) -> None:
        if cmd.stream_id != st.id:
            raise EngineInputError(f"command for stream {cmd.stream_id!r} sent to stream {st.id!r}")
        if isinstance(cmd, OpenStream):
            raise EngineInputError("OpenStream is handled by Engine.open_stream")
        if isinstance(cmd, AppendUnit):
            audio = self._check_unit(cmd)
        if isinstance(cmd, SpeakText):
            self._check_speak_text(cmd)
        with self._cond:
            if not st.live:
                return
            if isinstance(cmd, CloseStream):
                self._begin_close(st)
            elif isinstance(cmd, CancelEpoch):
                if cmd.epoch > st.epoch:
                    self._cancel(st, cmd.epoch)
            else:
                if cmd.epoch > st.epoch:
                    self._cancel(st, cmd.epoch)
                if isinstance(cmd, AppendUnit):
                    st.last_unit = cmd.unit_index
                    slot = _Slot(cmd.unit_index, st.epoch, time.perf_counter())
                    st.slots.append(slot)
                    st.q["thinker"].append(_WorkItem(WorkKind.UNIT, slot, (cmd, audio)))
                elif isinstance(cmd, ForceSpeak):
                    if cmd.epoch == st.epoch:
                        st.force_speak_epoch = st.epoch
                elif isinstance(cmd, SpeakText):
                    if cmd.epoch == st.epoch:  # an older epoch's text is stale: dropped
                        slot = _Slot(-1, st.epoch, time.perf_counter())
                        st.slots.append(slot)
                        st.q["thinker"].append(_WorkItem(WorkKind.SPEAK_TEXT, slot, (cmd.text, int(cmd.tokens_per_unit))))
                elif isinstance(cmd, UpdateStream):
                    old = st.config
                    st.config = cmd.config
                    st.q["thinker"].append(_WorkItem(WorkKind.UPDATE, payload=(old, cmd.config)))
                    if _voice_key(cmd.config.ref_voice) != _voice_key(old.ref_voice):
                        st.q["code2wav"].append(_WorkItem(WorkKind.UPDATE, payload=(old, cmd.config)))
                else:
                    raise EngineInputError(f"unknown engine command {type(cmd).__name__}")
            self._cond.notify_all()

    @staticmethod
    def _check_speak_text(cmd: SpeakText) -> None:
        if not isinstance(cmd.text, str) or not cmd.text:
            raise EngineInputError("SpeakText: text must be a non-empty string")
        if isinstance(cmd.tokens_per_unit, bool) or not isinstance(cmd.tokens_per_unit, int) or cmd.tokens_per_unit < 1:
            raise EngineInputError(f"SpeakText: tokens_per_unit must be an int >= 1, got {cmd.tokens_per_unit!r}")

    @staticmethod
    def _check_unit(cmd: AppendUnit) -> np.ndarray:
        try:
            audio = np.asarray(cmd.audio, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise EngineInputError(f"unit {cmd.unit_index}: audio is not numeric: {exc}") from exc
        want = FIRST_UNIT_SAMPLES if cmd.unit_index == 0 else UNIT_SAMPLES
        if audio.ndim != 1 or audio.shape[0] != want:
            raise EngineInputError(
                f"unit {cmd.unit_index}: audio must be float32 [{want}] at 16 kHz "
                f"(docs/model.md §3.1), got shape {tuple(audio.shape)}"
            )
        if not np.isfinite(audio).all():
            raise EngineInputError(f"unit {cmd.unit_index}: audio has non-finite samples")
        if cmd.frame is not None:
            fr = np.asarray(cmd.frame)
            if fr.ndim != 3 or fr.shape[2] != 3 or fr.dtype != np.uint8:
                raise EngineInputError(f"unit {cmd.unit_index}: frame must be uint8 [H, W, 3], got {fr.dtype} {fr.shape}")
        return audio

    async def aclose(self) -> None:
        """Close every stream and stop the workers."""
        streams = list(self._streams.values())
        with self._cond:
            for st in streams:
                if st.live:
                    self._begin_close(st)
            self._cond.notify_all()
        for st in streams:
            if st.loop is asyncio.get_running_loop():
                try:
                    await asyncio.wait_for(st.closed_event.wait(), 60)
                except asyncio.TimeoutError:
                    log.warning("stream %s did not close in time", st.id)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        await asyncio.to_thread(lambda: [t.join(timeout=60) for t in self._threads])

    def run_job(self, stage: str, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on ``stage``'s worker thread between two steps (turn-based generation uses
        this so that all torch work stays on the stage threads). Returns a concurrent Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stop:
                raise RuntimeError("engine is closed")
            self._jobs[stage].append((fn, fut))
            self._cond.notify_all()
        return fut

    # ------------------------------------------------------------------ locked helpers

    def _cancel(self, st: _StreamState, epoch: int) -> None:
        st.epoch = epoch
        st.force_speak_epoch = None
        st.pending_text = ""
        kept = deque()
        for it in st.q["thinker"]:
            if it.kind is WorkKind.UNIT:
                it.slot.epoch = epoch  # input is never discarded (docs/protocol.md §7.2)
            elif it.kind is WorkKind.SPEAK_TEXT:  # forced speech not yet spoken is dropped
                it.slot.done = True
                continue
            kept.append(it)
        kept.appendleft(_WorkItem(WorkKind.END_TURN))
        st.q["thinker"] = kept
        for s in ("talker", "code2wav"):
            kept = deque()
            for it in st.q[s]:
                if it.kind is WorkKind.UNIT:
                    it.slot.done = True
                else:
                    kept.append(it)
            kept.appendleft(_WorkItem(WorkKind.END_TURN))
            st.q[s] = kept
        for slot in st.slots:
            if slot.epoch < epoch:
                slot.outputs.clear()
        self._flush(st)

    def _begin_close(self, st: _StreamState) -> None:
        """Queue the close of every stage (queued work is dropped, a queued open still runs first);
        a live stream moves to CLOSING (a failed one is closing already)."""
        if st.live:
            st.move(StreamStatus.CLOSING)
        st.to_close = set(STAGES)
        for s in STAGES:
            st.q[s] = deque(it for it in st.q[s] if it.kind is WorkKind.OPEN)
            st.q[s].append(_WorkItem(WorkKind.CLOSE))

    def _fail(self, st: _StreamState, stage: str, exc: BaseException, unit_index: int) -> None:
        if not (st.live or st.status is StreamStatus.CLOSING):  # failed or closed already
            return
        log.error("stream %s failed in %s: %s", st.id, stage, "".join(traceback.format_exception(exc)).rstrip())
        was_live = st.live
        st.move(StreamStatus.FAILED)
        st.slots.clear()
        self._deliver(st, EngineFailure(st.id, st.epoch, unit_index, code=ErrorCode.SERVER_ERROR.value,
                                      message=f"{stage} failed: {type(exc).__name__}: {exc}", fatal=True))
        if was_live:
            self._begin_close(st)
        self._cond.notify_all()

    def _fail_turn(self, st: _StreamState, stage: str, exc: BaseException, slot: "_Slot") -> None:
        """A talker or vocoder failure for one unit: the stream survives (docs/protocol.md §9: the
        response ends ``failed``, the session continues). The unit gets a non-fatal ``EngineFailure``
        in order with its other outputs, the stage's turn state is dropped (the next speaking unit
        opens a fresh talker turn / vocoder carry), and the Session's ``CancelEpoch`` that follows
        clears the rest of the turn. If even the reset fails, the stream fails fatally."""
        log.error("stream %s: %s failed on unit %s (turn dropped, stream kept): %s", st.id, stage,
                  slot.unit_index, "".join(traceback.format_exception(exc)).rstrip())
        try:
            self._end_turn(stage, st)
        except Exception as reset_exc:  # noqa: BLE001 - the stream's state is unknown now
            self._fail(st, stage, reset_exc, slot.unit_index)
            return
        self._emit(st, slot, EngineFailure(st.id, slot.epoch, slot.unit_index, code=ErrorCode.SERVER_ERROR.value,
                                         message=f"{stage} failed: {type(exc).__name__}: {exc}", fatal=False))
        self._finish_slot(st, slot)
        self._flush(st)

    def _deliver(self, st: _StreamState, out: Optional[EngineOutput]) -> None:
        try:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, out)
        except RuntimeError:  # the stream's event loop is closed: nobody listens any more
            pass

    def _emit(self, st: _StreamState, slot: _Slot, out: EngineOutput) -> None:
        slot.outputs.append(out)

    def _finish_slot(self, st: _StreamState, slot: _Slot, *, timings: bool = True) -> None:
        if slot.done:
            return
        slot.done = True
        if timings and slot.epoch == st.epoch:
            tm = slot.timings
            tm["total_ms"] = _ms(slot.t_submit, time.perf_counter())
            tm["queue_ms"] = round(tm["queue_ms"], 3)
            slot.outputs.append(UnitTimings(st.id, slot.epoch, slot.unit_index, timings=dict(tm)))

    def _flush(self, st: _StreamState) -> None:
        while st.slots:
            head = st.slots[0]
            for out in head.outputs:
                self._deliver(st, out)
            head.outputs.clear()
            if not head.done:
                break
            st.slots.popleft()

    def _stage_closed(self, st: _StreamState, stage: str) -> None:
        st.to_close.discard(stage)
        if not st.to_close and not st.done:
            st.move(StreamStatus.CLOSED)
            self._streams.pop(st.id, None)
            st.slots.clear()
            st.q = {s: deque() for s in STAGES}
            self._deliver(st, None)
            try:
                st.loop.call_soon_threadsafe(st.closed_event.set)
                if st.opened is not None:
                    st.loop.call_soon_threadsafe(lambda f=st.opened: f.done() or f.set_result(None))
            except RuntimeError:
                pass

    def _stage_opened(self, st: _StreamState, stage: str) -> None:
        st.to_open.discard(stage)
        if not st.to_open and st.status is StreamStatus.OPENING:
            st.move(StreamStatus.OPEN)
        if not st.to_open and st.opened is not None:
            try:
                st.loop.call_soon_threadsafe(lambda f=st.opened: f.done() or f.set_result(None))
            except RuntimeError:
                pass

    # ------------------------------------------------------------------ workers

    def _pick(self, stage: str) -> list:
        streams = list(self._streams.values())
        n = len(streams)
        if not n:
            return []
        start = self._rr[stage] % n
        limit = self.layout.stages[stage].max_num_seqs
        picked = []
        for k in range(n):
            st = streams[(start + k) % n]
            if st.busy[stage] or not st.q[stage]:
                continue
            picked.append((st, st.q[stage].popleft()))
            st.busy[stage] = True
            if len(picked) >= limit:
                break
        self._rr[stage] = start + 1
        return picked

    def _window_wait_s(self, stage: str) -> float:
        """Seconds the stage worker should still wait before picking, by the batching window
        (module docstring, "Scheduling"); 0.0 means pick now. Called with the lock held."""
        cfg = self.layout.stages[stage]
        if cfg.batch_window_ms <= 0:
            return 0.0
        heads = [st.q[stage][0] for st in self._streams.values() if st.q[stage]]  # none is busy between steps
        if not heads or any(it.kind is not WorkKind.UNIT for it in heads):
            return 0.0
        eligible = sum(1 for st in self._streams.values() if st.live)
        if len(heads) >= min(eligible, cfg.max_num_seqs):
            return 0.0
        oldest = min(it.t_enqueue for it in heads)
        return max(0.0, oldest + cfg.batch_window_ms / 1000.0 - time.perf_counter())

    def _worker(self, stage: str) -> None:
        step = {"thinker": self._thinker_step, "talker": self._talker_step, "code2wav": self._code2wav_step}[stage]
        after_job = False  # the last thing run was a job: ready units go first now (a long reply runs in
        # slices of jobs (docs/architecture.md, "Turn-based jobs"); units must not wait behind all of them)
        while True:
            job = None
            with self._cond:
                while True:
                    if self._stop:
                        while self._jobs[stage]:  # never started: their callers must not wait for ever
                            _fn, fut = self._jobs[stage].popleft()
                            if fut.set_running_or_notify_cancel():
                                fut.set_exception(RuntimeError("engine is closed"))
                        return
                    if self._jobs[stage] and not after_job:
                        job = self._jobs[stage].popleft()
                        break
                    wait_s = 0.0 if after_job and self._jobs[stage] else self._window_wait_s(stage)
                    if wait_s > 0.0:  # woken early by a submit, a job or the stop: decide again
                        self._cond.wait(wait_s)
                        continue
                    picked = self._pick(stage)
                    if picked:
                        break
                    if self._jobs[stage]:  # nothing ready: the job after all
                        job = self._jobs[stage].popleft()
                        break
                    after_job = False
                    self._cond.wait()
            after_job = job is not None
            if job is not None:
                fn, fut = job
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(exc)
                continue
            try:
                work = []
                for st, it in picked:
                    if it.kind is WorkKind.UNIT:
                        work.append((st, it))
                    else:
                        self._control(stage, st, it)
                if work:
                    step(work)
            except BaseException as exc:  # noqa: BLE001 - a bug in the runtime itself
                log.exception("%s worker error", stage)
                with self._cond:
                    for st, it in picked:
                        self._fail(st, stage, exc, it.slot.unit_index if it.slot else -1)
            finally:
                with self._cond:
                    for st, _ in picked:
                        st.busy[stage] = False
                    self._cond.notify_all()


# ---------------------------------------------------------------------------------------------
# the public stream handle
# ---------------------------------------------------------------------------------------------


class RuntimeStream:
    """:class:`duplexkit.engine.api.EngineStream` of the built-in runtime.

    ``submit`` is non-blocking and event-loop safe; ``outputs()`` yields the stream's outputs in
    order and ends once the stream is closed (or failed fatally).
    """

    def __init__(self, runtime: StageRuntime, state: _StreamState) -> None:
        self._rt = runtime
        self._st = state
        self.stream_id = state.id

    @property
    def runtime(self) -> StageRuntime:
        """The runtime serving this stream (tests install a ``fault_hook`` on it)."""
        return self._rt

    @property
    def epoch(self) -> int:
        """The stream's current epoch."""
        return self._st.epoch

    @property
    def status(self) -> StreamStatus:
        """Where the stream is in its life (:class:`~duplexkit.engine.streams.StreamStatus`)."""
        return self._st.status

    @property
    def closed(self) -> bool:
        return self._st.done

    def submit(self, command: EngineCommand) -> None:
        """Queue one command (AppendUnit, ForceSpeak, CancelEpoch, UpdateStream, CloseStream).

        Commands to a closed or failed stream are ignored (the failure was already reported).

        Raises:
            EngineInputError: an AppendUnit whose audio is not float32-convertible 1-D finite
                samples of length 16560 (unit 0) or 16000 (later units), a command for another
                stream, or an OpenStream / unknown command.
        """
        self._rt._submit(self._st, command)

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        """Async iterator of :class:`~duplexkit.engine.api.EngineOutput`; ends after close."""
        st = self._st
        while st.status is not StreamStatus.ENDED:
            out = await st.queue.get()
            if out is None:
                st.move(StreamStatus.ENDED)
                return
            yield out

    async def aclose(self) -> None:
        """Close the stream (drops its queued work) and wait until every stage freed its state."""
        if not self._st.done:
            self._rt._submit(self._st, CloseStream(self._st.id, self._st.epoch))
        await self._st.closed_event.wait()
