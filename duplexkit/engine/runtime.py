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
  which docs/protocol.md §7.2 feeds to the model in the new epoch;
* no ``TurnEnd`` is emitted for the cancelled turn (the Session ends its response itself).

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
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import numpy as np

from duplexkit.errors import EngineInputError

from .api import (
    AppendUnit,
    AudioChunk,
    CancelEpoch,
    CloseStream,
    Decision,
    EngineCommand,
    EngineFailure,
    EngineOutput,
    ForceSpeak,
    OpenStream,
    StreamConfig,
    TextDelta,
    TurnEnd,
    UnitTimings,
    UpdateStream,
)
from .layout import STAGES, Layout
from .stages import InjectedFault, StageModel, TalkerWork, ThinkerWork, VocoderWork

__all__ = ["EngineInputError", "StageRuntime", "RuntimeStream", "FIRST_UNIT_SAMPLES", "UNIT_SAMPLES"]

log = logging.getLogger("duplexkit.engine")

FIRST_UNIT_SAMPLES = 16_560
"""Samples of unit 0 at 16 kHz (docs/model.md §3.1, parity case f: the first 1035 ms window)."""
UNIT_SAMPLES = 16_000
"""Samples of every later unit at 16 kHz (1 s)."""


# ---------------------------------------------------------------------------------------------
# internal records
# ---------------------------------------------------------------------------------------------


class _Slot:
    """One unit's place in the stream's output sequencer."""

    __slots__ = ("unit_index", "epoch", "outputs", "done", "t_submit", "timings")

    def __init__(self, unit_index: int, epoch: int, t_submit: float) -> None:
        self.unit_index = unit_index
        self.epoch = epoch
        self.outputs: list = []
        self.done = False
        self.t_submit = t_submit
        self.timings: dict = {"queue_ms": 0.0}


@dataclass
class _WorkItem:
    """One entry of a stage queue (a unit, or a control step of the stream)."""

    kind: str  # unit | open | update | end_turn | reset | close
    slot: Optional[_Slot] = None
    payload: Any = None
    t_enqueue: float = field(default_factory=time.perf_counter)


class _StreamState:
    """One stream's state inside the runtime (the public handle is :class:`RuntimeStream`)."""

    def __init__(self, stream_id: str, config: StreamConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.id = stream_id
        self.config = config  # as submitted (event-loop side)
        self.thinker_config = config  # in effect at the thinker
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed_event = asyncio.Event()
        self.opened: Optional[asyncio.Future] = None
        self.epoch = 0
        self.q = {s: deque() for s in STAGES}
        self.busy = {s: False for s in STAGES}
        self.open_left = set(STAGES)
        self.close_left: set = set()
        self.thinker_handle: Any = None
        self.talker_turn: Any = None
        self.c2w_handle: Any = None
        self.c2w_voice = config.ref_voice
        self.force_speak_epoch: Optional[int] = None
        self.slots: deque = deque()
        self.pending_text = ""
        self.closing = False
        self.failed = False
        self.finished = False
        self.ended = False  # event-loop side: the end-of-outputs marker was consumed
        self.turn_count = 0
        self.fault: Optional[str] = None
        self.last_unit = -1


def _voice_key(v) -> Optional[str]:
    return None if v is None else v.sha256


def _ms(t0: float, t1: float) -> float:
    return round((t1 - t0) * 1000.0, 3)


# ---------------------------------------------------------------------------------------------
# the public stream handle
# ---------------------------------------------------------------------------------------------


class RuntimeStream:
    """:class:`duplexkit.engine.api.EngineStream` of the built-in runtime.

    ``submit`` is non-blocking and event-loop safe; ``outputs()`` yields the stream's outputs in
    order and ends once the stream is closed (or failed fatally).
    """

    def __init__(self, runtime: "StageRuntime", state: _StreamState) -> None:
        self._rt = runtime
        self._st = state
        self.stream_id = state.id

    @property
    def epoch(self) -> int:
        """The stream's current epoch."""
        return self._st.epoch

    @property
    def closed(self) -> bool:
        return self._st.finished

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
        while not st.ended:
            out = await st.queue.get()
            if out is None:
                st.ended = True
                return
            yield out

    async def aclose(self) -> None:
        """Close the stream (drops its queued work) and wait until every stage freed its state."""
        if not self._st.finished:
            self._rt._submit(self._st, CloseStream(self._st.id, self._st.epoch))
        await self._st.closed_event.wait()

    def inject_fault(self, stage: Optional[str]) -> None:
        """Test hook: make ``stage`` (thinker | talker | code2wav) fail this stream's next work
        item with :class:`~duplexkit.engine.stages.InjectedFault`, exactly as if the model had
        raised for it inside a batch. ``None`` clears the hook."""
        if stage is not None and stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}")
        self._st.fault = stage


# ---------------------------------------------------------------------------------------------
# the runtime
# ---------------------------------------------------------------------------------------------


class StageRuntime:
    """Runs the three stage workers for one :class:`~duplexkit.engine.stages.StageModel`.

    Args:
        model: the batch-shaped stage functions.
        layout: gives ``max_num_seqs`` per stage.
    """

    def __init__(self, model: StageModel, layout: Layout) -> None:
        self.model = model
        self.layout = layout
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
                st.q[s].append(_WorkItem("open", payload=config))
            self._cond.notify_all()
        try:
            await asyncio.shield(st.opened)
        except asyncio.CancelledError:  # the caller gave up: free the half-opened stream
            with self._cond:
                if not (st.finished or st.closing):
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
        with self._cond:
            if st.finished or st.failed or st.closing:
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
                    st.q["thinker"].append(_WorkItem("unit", slot, (cmd, audio)))
                elif isinstance(cmd, ForceSpeak):
                    if cmd.epoch == st.epoch:
                        st.force_speak_epoch = st.epoch
                elif isinstance(cmd, UpdateStream):
                    old = st.config
                    st.config = cmd.config
                    st.q["thinker"].append(_WorkItem("update", payload=(old, cmd.config)))
                    if _voice_key(cmd.config.ref_voice) != _voice_key(old.ref_voice):
                        st.q["code2wav"].append(_WorkItem("update", payload=cmd.config.ref_voice))
                else:
                    raise EngineInputError(f"unknown engine command {type(cmd).__name__}")
            self._cond.notify_all()

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
                if not (st.finished or st.closing):
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
        for it in st.q["thinker"]:
            if it.kind == "unit":
                it.slot.epoch = epoch  # input is never discarded (docs/protocol.md §7.2)
        st.q["thinker"].appendleft(_WorkItem("end_turn"))
        for s in ("talker", "code2wav"):
            kept = deque()
            for it in st.q[s]:
                if it.kind == "unit":
                    it.slot.done = True
                else:
                    kept.append(it)
            kept.appendleft(_WorkItem("reset"))
            st.q[s] = kept
        for slot in st.slots:
            if slot.epoch < epoch:
                slot.outputs.clear()
        self._flush(st)

    def _begin_close(self, st: _StreamState) -> None:
        st.closing = True
        st.close_left = set(STAGES)
        for s in STAGES:
            st.q[s] = deque(it for it in st.q[s] if it.kind == "open")
            st.q[s].append(_WorkItem("close"))

    def _fail(self, st: _StreamState, stage: str, exc: BaseException, unit_index: int) -> None:
        if st.failed or st.finished:
            return
        log.error("stream %s failed in %s: %s", st.id, stage, "".join(traceback.format_exception(exc)).rstrip())
        st.failed = True
        st.slots.clear()
        self._deliver(st, EngineFailure(st.id, st.epoch, unit_index, code="server_error",
                                      message=f"{stage} failed: {type(exc).__name__}: {exc}", fatal=True))
        if not st.closing:
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
            if stage == "talker" and st.talker_turn is not None:
                turn, st.talker_turn = st.talker_turn, None
                self.model.talker_close_turn(turn)
            elif stage == "code2wav" and st.c2w_handle is not None:
                self.model.code2wav_reset_turn(st.c2w_handle)
        except Exception as reset_exc:  # noqa: BLE001 - the stream's state is unknown now
            self._fail(st, stage, reset_exc, slot.unit_index)
            return
        self._emit(st, slot, EngineFailure(st.id, slot.epoch, slot.unit_index, code="server_error",
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
        st.close_left.discard(stage)
        if not st.close_left and not st.finished:
            st.finished = True
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
        st.open_left.discard(stage)
        if not st.open_left and st.opened is not None:
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

    def _worker(self, stage: str) -> None:
        step = {"thinker": self._thinker_step, "talker": self._talker_step, "code2wav": self._code2wav_step}[stage]
        while True:
            job = None
            with self._cond:
                while True:
                    if self._stop:
                        return
                    if self._jobs[stage]:
                        job = self._jobs[stage].popleft()
                        break
                    picked = self._pick(stage)
                    if picked:
                        break
                    self._cond.wait()
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
                    if it.kind == "unit":
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

    def _control(self, stage: str, st: _StreamState, it: _WorkItem) -> None:
        m = self.model
        try:
            if it.kind == "open":
                cfg: StreamConfig = it.payload
                if stage == "thinker":
                    st.thinker_handle = m.thinker_open(cfg)
                elif stage == "code2wav" and cfg.output_audio:
                    st.c2w_handle = m.code2wav_open(cfg.ref_voice)
                with self._cond:
                    self._stage_opened(st, stage)
            elif it.kind == "close":
                try:
                    if stage == "thinker" and st.thinker_handle is not None:
                        m.thinker_close(st.thinker_handle)
                    elif stage == "talker" and st.talker_turn is not None:
                        m.talker_close_turn(st.talker_turn)
                    elif stage == "code2wav" and st.c2w_handle is not None:
                        m.code2wav_close(st.c2w_handle)
                except Exception:  # noqa: BLE001 - freeing must go on
                    log.exception("closing %s state of stream %s", stage, st.id)
                finally:
                    if stage == "thinker":
                        st.thinker_handle = None
                    elif stage == "talker":
                        st.talker_turn = None
                    else:
                        st.c2w_handle = None
                    with self._cond:
                        self._stage_opened(st, stage)
                        self._stage_closed(st, stage)
            elif it.kind == "end_turn":  # thinker, after a cancel
                if st.thinker_handle is not None:
                    m.thinker_end_turn(st.thinker_handle)
            elif it.kind == "reset":  # talker / code2wav, after a cancel
                if stage == "talker" and st.talker_turn is not None:
                    turn, st.talker_turn = st.talker_turn, None
                    m.talker_close_turn(turn)
                elif stage == "code2wav" and st.c2w_handle is not None:
                    m.code2wav_reset_turn(st.c2w_handle)
            elif it.kind == "update":
                if stage == "thinker":
                    old, new = it.payload
                    st.thinker_handle = m.thinker_update(st.thinker_handle, old, new)
                    st.thinker_config = new
                elif stage == "code2wav":
                    if st.c2w_handle is not None:
                        h, st.c2w_handle = st.c2w_handle, None
                        m.code2wav_close(h)
                    st.c2w_voice = it.payload
            else:
                raise RuntimeError(f"unknown control item {it.kind}")
        except Exception as exc:  # noqa: BLE001 - confined to this stream
            with self._cond:
                if it.kind == "open":
                    self._stage_opened(st, stage)
                self._fail(st, stage, exc, -1)

    def _run_batch(self, stage: str, fn: Callable[[list], list], work: list, items: list,
                   pre: Optional[dict] = None) -> tuple:
        """Call the stage function on the items that have no result yet (``pre`` maps an index to
        an exception already known for it; the fault hook adds InjectedFault); returns
        ``(results, t0, t1)``."""
        results: list = [None] * len(work)
        for i, exc in (pre or {}).items():
            results[i] = exc
        run_idx = []
        for i, (st, _it) in enumerate(work):
            if results[i] is not None:
                continue
            if st.fault == stage:
                st.fault = None
                results[i] = InjectedFault(f"injected fault in {stage} for stream {st.id}")
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
            if len(idx) == 1:
                results[idx[0]] = exc
                return
            log.warning("%s batch of %d raised %s: %s; retrying in halves to isolate the stream",
                        stage, len(idx), type(exc).__name__, exc)
            mid = len(idx) // 2
            self._call_split(stage, fn, items, idx[:mid], results)
            self._call_split(stage, fn, items, idx[mid:], results)
            return
        for i, r in zip(idx, out):
            results[i] = r

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
            if st.failed or st.closing:
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
                force_speak = force_speak or bool(cmd.force_speak)
                it.slot.timings["queue_ms"] += (now - it.t_enqueue) * 1000.0
                it.slot.timings["thinker_queue_ms"] = _ms(it.t_enqueue, now)
                items.append(ThinkerWork(handle=st.thinker_handle, audio=audio, force_listen=bool(cmd.force_listen),
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
                tm["thinker_batch"] = len(work)
                speak = res.decision == "speak"
                self._emit(st, slot, Decision(st.id, slot.epoch, slot.unit_index, decision=res.decision,
                                              turn_start=bool(res.turn_start)))
                if speak:
                    self._emit(st, slot, TextDelta(st.id, slot.epoch, slot.unit_index, text=res.text,
                                                   n_tokens=int(res.n_tokens)))
                    if st.thinker_config.output_audio:
                        st.q["talker"].append(_WorkItem("unit", slot, res))
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
            turn_start = st.talker_turn is None or bool(res.turn_start)
            try:
                if turn_start:
                    if st.talker_turn is not None:
                        turn, st.talker_turn = st.talker_turn, None
                        m.talker_close_turn(turn)
                    seed = st.thinker_config.seed
                    st.turn_count += 1
                    st.talker_turn = m.talker_new_turn(None if seed is None else (int(seed) * 1_000_003 + st.turn_count) % (2**63))
            except Exception as exc:  # noqa: BLE001
                pre[i] = exc
            items.append(TalkerWork(turn=st.talker_turn, talker_input=res.talker_input, turn_start=turn_start,
                                    turn_end=bool(res.end_of_turn)))
        self._mark_queue_wait(work, "talker")
        results, t0, t1 = self._run_batch("talker", m.talker_step, work, items, pre)
        for (st, it), res in zip(work, results):
            if it.payload.end_of_turn and not isinstance(res, BaseException) and st.talker_turn is not None:
                turn, st.talker_turn = st.talker_turn, None  # turn over: free its KV now
                m.talker_close_turn(turn)
        with self._cond:
            for st, it, res in self._current_results("talker", work, results, self._fail_turn):
                slot = it.slot
                slot.timings["talker_ms"] = _ms(t0, t1)
                slot.timings["talker_steps"] = int(res.steps)
                slot.timings["talker_codes"] = int(len(res.codes))
                slot.timings["talker_batch"] = len(work)
                st.q["code2wav"].append(_WorkItem("unit", slot, (res.codes, bool(it.payload.end_of_turn), it.payload.text)))
            self._cond.notify_all()

    def _code2wav_step(self, work: list) -> None:
        items = []
        pre = {}
        m = self.model
        for i, (st, it) in enumerate(work):
            if st.c2w_handle is None:  # opened lazily (text-only stream switched to audio, or new voice)
                try:
                    st.c2w_handle = m.code2wav_open(st.c2w_voice)
                except Exception as exc:  # noqa: BLE001
                    pre[i] = exc
            codes, last, _text = it.payload
            items.append(VocoderWork(handle=st.c2w_handle, codes=np.asarray(codes, dtype=np.int64), last=last))
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
