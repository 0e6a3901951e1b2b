"""Runtime machinery on a torch-free toy StageModel: ordering, epochs, failures, batching, freeing."""

from __future__ import annotations

import asyncio
import hashlib
import threading

import numpy as np
import pytest

from duplexkit.engine import DuplexEngine, EngineInputError, load_layout
from duplexkit.engine.api import (
    AppendUnit, AudioChunk, CancelEpoch, Decision, EngineFailure, ForceSpeak, ReferenceVoice, StreamConfig,
    TextDelta, TurnEnd, UnitTimings, UpdateStream,
)
from duplexkit.engine.layout import Layout
from duplexkit.testing import inject_fault

from .toy import ToyStages, tag_value


def _layout(max_num_seqs: int = 4) -> Layout:
    d = {"name": "t", "stages": {s: {"device": "cpu", "max_num_seqs": max_num_seqs} for s in ("thinker", "talker", "code2wav")}}
    return Layout.from_dict(d)


def _unit(i: int, value: float = 0.0) -> np.ndarray:
    return np.full(16560 if i == 0 else 16000, value, np.float32)


def _voice(name: str) -> ReferenceVoice:
    a = np.full(1600, 0.1, np.float32)
    return ReferenceVoice(audio=a, sha256=hashlib.sha256(name.encode()).hexdigest())


async def _collect(stream, until, timeout: float = 20.0) -> list:
    """Collect outputs until ``until(outputs)`` is true."""
    outs: list = []

    async def run():
        async for o in stream.outputs():
            outs.append(o)
            if until(outs):
                return

    await asyncio.wait_for(run(), timeout)
    return outs


def _units_done(n: int):
    return lambda outs: sum(isinstance(o, UnitTimings) for o in outs) >= n


async def test_turn_order_and_chunk_sizes():
    toy = ToyStages(turn_units=3)
    eng = DuplexEngine(toy, _layout())
    s = await eng.open_stream("a", StreamConfig(instructions="A", ref_voice=_voice("va")))
    s.submit(ForceSpeak("a", 0))
    for i in range(5):
        s.submit(AppendUnit("a", 0, unit_index=i, audio=_unit(i)))
    outs = await _collect(s, _units_done(5))
    # strictly unit by unit; within a unit: Decision, TextDelta, AudioChunk*, TurnEnd?, UnitTimings
    idx = [o.unit_index for o in outs]
    assert idx == sorted(idx)
    for u in range(5):
        kinds = [type(o).__name__ for o in outs if o.unit_index == u]
        assert kinds[0] == "Decision" and kinds[-1] == "UnitTimings"
    dec = [o for o in outs if isinstance(o, Decision)]
    assert [d.decision for d in dec] == ["speak"] * 3 + ["listen"] * 2
    assert dec[0].turn_start and not dec[1].turn_start
    chunks = [o for o in outs if isinstance(o, AudioChunk)]
    assert [len(c.audio) for c in chunks[:-1]] == [20160, 24000]
    assert chunks[-1].final and chunks[-1].unit_index == 2
    assert all(np.all(c.audio == np.float32(tag_value(_voice("va").sha256))) for c in chunks)
    assert "".join(c.text for c in chunks) == "A0 A1 A2 " == "".join(o.text for o in outs if isinstance(o, TextDelta))
    ends = [o for o in outs if isinstance(o, TurnEnd)]
    assert len(ends) == 1 and ends[0].reason == "turn_eos" and ends[0].unit_index == 2
    pos = {type(o).__name__: k for k, o in enumerate(outs) if o.unit_index == 2}
    assert outs.index(chunks[-1]) < pos["TurnEnd"] < pos["UnitTimings"]
    t = [o for o in outs if isinstance(o, UnitTimings)][0].timings
    for key in ("thinker_prefill_ms", "thinker_decode_ms", "decode_steps", "talker_ms", "talker_steps",
                "code2wav_ms", "queue_ms", "total_ms", "thinker_done_ms", "talker_done_ms", "first_audio_ms"):
        assert key in t
    # submit -> each stage's hand-over, in stage order, each at least the stage's own time
    assert t["thinker_ms"] <= t["thinker_done_ms"] <= t["talker_done_ms"] <= t["first_audio_ms"] <= t["total_ms"]
    assert t["talker_done_ms"] - t["thinker_done_ms"] >= t["talker_ms"] - 0.002  # each rounded to 1 µs
    await s.aclose()
    await eng.aclose()
    assert toy.live == {"thinker": 0, "talker": 0, "code2wav": 0}


async def test_text_only_stream_skips_talker_and_code2wav():
    toy = ToyStages(turn_units=2)
    eng = DuplexEngine(toy, _layout())
    s = await eng.open_stream("t", StreamConfig(instructions="T", output_audio=False))
    s.submit(ForceSpeak("t", 0))
    for i in range(3):
        s.submit(AppendUnit("t", 0, unit_index=i, audio=_unit(i)))
    outs = await _collect(s, _units_done(3))
    assert not any(isinstance(o, AudioChunk) for o in outs)
    names = [type(o).__name__ for o in outs if o.unit_index == 1]
    assert names == ["Decision", "TextDelta", "TurnEnd", "UnitTimings"]
    assert not any(st == "talker" or st == "code2wav" for st, _ in toy.calls)
    assert toy.live["code2wav"] == 0
    await eng.aclose()


async def test_cancel_drops_old_epoch_and_ends_turn():
    toy = ToyStages(turn_units=100, delay_s=0.02)
    eng = DuplexEngine(toy, _layout())
    s = await eng.open_stream("c", StreamConfig(instructions="C"))
    s.submit(ForceSpeak("c", 0))
    for i in range(3):
        s.submit(AppendUnit("c", 0, unit_index=i, audio=_unit(i)))
    first = await _collect(s, lambda o: any(isinstance(x, AudioChunk) for x in o))
    s.submit(CancelEpoch("c", 1))
    for i in range(3, 6):
        s.submit(AppendUnit("c", 1, unit_index=i, audio=_unit(i), force_listen=True))
    rest = await _collect(s, lambda o: any(isinstance(x, UnitTimings) and x.unit_index == 5 for x in o))
    old = [o for o in rest if o.epoch == 0]
    # nothing of epoch 0 beyond the units that were submitted before the cancel
    assert all(o.unit_index < 3 for o in old)
    new = [o for o in rest if o.epoch == 1]
    assert not any(isinstance(o, (AudioChunk, TurnEnd)) for o in new)
    # queued input units were kept (re-tagged with the new epoch), never lost
    got = {o.unit_index for o in first + rest if isinstance(o, Decision)}
    assert {3, 4, 5} <= got
    assert ("end_turn", "C") in toy.events and ("c2w_reset", None) in toy.events
    # the model turn is over: ForceSpeak in epoch 1 starts a fresh turn
    s.submit(ForceSpeak("c", 1))
    s.submit(AppendUnit("c", 1, unit_index=6, audio=_unit(6)))
    more = await _collect(s, _units_done(1))
    d = [o for o in more if isinstance(o, Decision)][0]
    assert d.decision == "speak" and d.turn_start and d.epoch == 1
    await eng.aclose()


async def test_fault_in_one_stream_leaves_others_working():
    for stage in ("thinker", "talker", "code2wav"):
        toy = ToyStages(turn_units=100)
        eng = DuplexEngine(toy, _layout())
        a = await eng.open_stream("a", StreamConfig(instructions="A"))
        b = await eng.open_stream("b", StreamConfig(instructions="B"))
        for s, sid in ((a, "a"), (b, "b")):
            s.submit(ForceSpeak(sid, 0))
        inject_fault(a, stage)
        for i in range(3):
            a.submit(AppendUnit("a", 0, unit_index=i, audio=_unit(i)))
            b.submit(AppendUnit("b", 0, unit_index=i, audio=_unit(i)))
        if stage == "thinker":  # the KV may be half-updated: the stream fails fatally
            outs_a = [o async for o in a.outputs()]  # ends after the fatal error
            assert isinstance(outs_a[-1], EngineFailure) and outs_a[-1].fatal and stage in outs_a[-1].message
        else:  # talker / vocoder: only the turn is lost, the stream keeps serving
            outs_a = await _collect(a, _units_done(3))
            errs = [o for o in outs_a if isinstance(o, EngineFailure)]
            assert len(errs) == 1 and not errs[0].fatal and stage in errs[0].message and errs[0].unit_index == 0
        outs_b = await _collect(b, _units_done(3))
        assert [len(o.audio) for o in outs_b if isinstance(o, AudioChunk)] == [20160, 24000, 24000]
        if stage == "thinker":
            a.submit(AppendUnit("a", 0, unit_index=3, audio=_unit(3)))  # ignored, no raise
            assert eng.num_streams == 1
        else:  # as the Session does after a failed response: new epoch, new turn, audio again
            a.submit(CancelEpoch("a", 1))
            a.submit(ForceSpeak("a", 1))
            a.submit(AppendUnit("a", 1, unit_index=3, audio=_unit(3)))
            more = await _collect(a, _units_done(1))
            chunks = [o for o in more if isinstance(o, AudioChunk)]
            assert chunks and chunks[0].epoch == 1 and len(chunks[0].audio) == 20160
            assert not any(isinstance(o, EngineFailure) for o in more)
            assert eng.num_streams == 2
        await eng.aclose()
        assert toy.live == {"thinker": 0, "talker": 0, "code2wav": 0}, stage


async def test_batches_respect_max_num_seqs_and_streams_stay_separate():
    toy = ToyStages(turn_units=100, delay_s=0.01)
    eng = DuplexEngine(toy, _layout(max_num_seqs=2))
    streams = []
    for k in range(4):
        s = await eng.open_stream(f"s{k}", StreamConfig(instructions=f"S{k}-", ref_voice=_voice(f"v{k}")))
        s.submit(ForceSpeak(f"s{k}", 0))
        streams.append(s)
    for i in range(3):
        for k, s in enumerate(streams):
            s.submit(AppendUnit(f"s{k}", 0, unit_index=i, audio=_unit(i)))
    results = await asyncio.gather(*[_collect(s, _units_done(3)) for s in streams])
    for k, outs in enumerate(results):
        assert all(o.stream_id == f"s{k}" for o in outs)
        text = "".join(o.text for o in outs if isinstance(o, TextDelta))
        assert text == f"S{k}-0 S{k}-1 S{k}-2 "
        for c in (o for o in outs if isinstance(o, AudioChunk)):
            assert np.all(c.audio == np.float32(tag_value(_voice(f"v{k}").sha256)))
    sizes = [n for st, n in toy.calls if st == "thinker"]
    assert max(sizes) == 2 and all(n <= 2 for n in sizes)
    await eng.aclose()


async def test_open_close_many_frees_state():
    toy = ToyStages()
    eng = DuplexEngine(toy, _layout())
    for k in range(50):
        s = await eng.open_stream(f"o{k}", StreamConfig(instructions="O"))
        s.submit(ForceSpeak(f"o{k}", 0))
        s.submit(AppendUnit(f"o{k}", 0, unit_index=0, audio=_unit(0)))
        await s.aclose()
        assert s.closed
    assert eng.num_streams == 0
    assert toy.live == {"thinker": 0, "talker": 0, "code2wav": 0}
    await eng.aclose()


async def test_open_failure_is_a_fatal_output_and_bad_input_is_typed():
    toy = ToyStages()
    eng = DuplexEngine(toy, _layout())
    s = await eng.open_stream("f", StreamConfig(instructions="fail-open"))
    outs = [o async for o in s.outputs()]
    assert len(outs) == 1 and isinstance(outs[0], EngineFailure) and outs[0].fatal and outs[0].unit_index == -1
    ok = await eng.open_stream("g", StreamConfig(instructions="G"))
    with pytest.raises(EngineInputError):
        ok.submit(AppendUnit("g", 0, unit_index=0, audio=np.zeros(16000, np.float32)))
    with pytest.raises(EngineInputError):
        ok.submit(AppendUnit("g", 0, unit_index=1, audio=np.full(16000, np.nan, np.float32)))
    with pytest.raises(EngineInputError):
        ok.submit(AppendUnit("other", 0, unit_index=0, audio=_unit(0)))
    with pytest.raises(ValueError):
        await eng.open_stream("g", StreamConfig())
    ok.submit(UpdateStream("g", 0, config=StreamConfig(instructions="H")))
    ok.submit(ForceSpeak("g", 0))
    ok.submit(AppendUnit("g", 0, unit_index=0, audio=_unit(0)))
    outs = await _collect(ok, _units_done(1))
    assert [o.text for o in outs if isinstance(o, TextDelta)] == ["H0 "]
    await eng.aclose()


def test_warmup_turn_runs_one_turn_through_the_three_stages_and_frees_it():
    toy = ToyStages(turn_units=3)
    eng = DuplexEngine(toy, _layout())
    ms = eng.warmup_turn(timeout_s=30)
    assert ms is not None and ms > 0  # a forced unit 0 of zeros reached the vocoder
    assert eng.num_streams == 0


def test_warmup_tools_runs_on_the_thinker_thread():
    class Tooled(ToyStages):
        def tools_warmup(self):
            self.warmed_on = threading.current_thread().name
            return 1.5

    toy = Tooled(turn_units=1)
    eng = DuplexEngine(toy, _layout())
    assert eng.warmup_tools() == 1.5
    assert "thinker" in toy.warmed_on
    assert DuplexEngine(ToyStages(turn_units=1), _layout()).warmup_tools() is None  # nothing to warm


async def test_warmup_turn_works_under_a_running_loop():
    eng = DuplexEngine(ToyStages(turn_units=1), _layout())
    assert eng.warmup_turn(timeout_s=30) is not None
    s = await eng.open_stream("a", StreamConfig())  # the engine still serves this loop's streams
    s.submit(AppendUnit("a", 0, unit_index=0, audio=_unit(0), force_speak=True))
    outs = await _collect(s, lambda o: any(isinstance(x, AudioChunk) for x in o))
    assert any(isinstance(x, AudioChunk) for x in outs)
    await s.aclose()


def test_warmup_runs_each_stage_warmup_on_its_own_worker_thread():
    """DuplexEngine.warmup runs the thinker's, talker's and vocoder's warm-ups on their stage
    threads, one after the other: cuDNN's autotuned convolution plans are kept per thread, so the
    vocoder's tuned on the caller's thread were tuned again mid-conversation (8 new streams waited
    2.4-2.8 s for their first audio on the H200, benchmarks/results/2026-12-02-cudnn-per-thread-h200.md)."""
    import threading
    from types import SimpleNamespace

    seen: list = []

    class Part:
        def __init__(self, name):
            self.name = name

        def warmup(self, sizes, *rest):
            seen.append((self.name, threading.current_thread().name, tuple(sizes)))
            return 1

        def warmup_sizes(self, n):
            return (1, 2, n)

    toy = ToyStages(turn_units=1)
    toy.model = SimpleNamespace(thinker=Part("thinker"), talker=Part("talker"), code2wav=Part("code2wav"))
    eng = DuplexEngine(toy, _layout(3))
    try:
        assert eng.warmup(256) == 3
        assert seen == [("thinker", "duplexkit-thinker", (1, 2, 3)), ("talker", "duplexkit-talker", (1, 2, 3)),
                        ("code2wav", "duplexkit-code2wav", (1, 2, 3))]
        seen.clear()
        eng.warmup(256, code2wav_sizes=(4,))
        assert seen[-1] == ("code2wav", "duplexkit-code2wav", (4,))
    finally:
        asyncio.run(eng.aclose())


def test_warmup_refuses_a_stage_thread_and_queued_jobs_fail_on_close():
    """warmup() called on a stage worker would wait for itself: it raises instead. Jobs still queued
    when the engine closes get an error instead of leaving their callers waiting for ever."""
    import threading

    toy = ToyStages(turn_units=1)
    eng = DuplexEngine(toy, _layout(2))
    try:
        fut = eng._runtime.run_job("thinker", lambda: eng.warmup())
        with pytest.raises(RuntimeError, match="stage worker thread"):
            fut.result(timeout=10)
        gate, started = threading.Event(), threading.Event()
        first = eng._runtime.run_job("talker", lambda: started.set() or gate.wait(10))  # holds the talker thread
        queued = eng._runtime.run_job("talker", lambda: "never")
        # the talker thread is inside the first job before the engine closes (on a loaded machine it
        # may not have picked it up yet, and a job never started fails on close: that is `queued`)
        assert started.wait(30)
    finally:
        closing = threading.Thread(target=lambda: asyncio.run(eng.aclose()))
        closing.start()
    import time as _t
    deadline = _t.monotonic() + 30
    while not eng._runtime._stop and _t.monotonic() < deadline:  # aclose has stopped the runtime while
        _t.sleep(0.01)  # the talker thread is still in the first job
    assert eng._runtime._stop
    gate.set()
    closing.join(30)
    assert first.result(timeout=10) is True
    with pytest.raises(RuntimeError, match="closed"):
        queued.result(timeout=10)


# ------------------------------------------------------------------ the batching window


def _window_layout(window_ms: float, max_num_seqs: int = 4) -> Layout:
    d = {"name": "t", "stages": {s: {"device": "cpu", "max_num_seqs": max_num_seqs} for s in ("thinker", "talker", "code2wav")}}
    d["stages"]["thinker"]["batch_window_ms"] = window_ms
    return Layout.from_dict(d)


async def _listeners(eng, n: int) -> list:
    """``n`` open streams; without ForceSpeak their units are listen units (thinker only). An open
    is a control item: the window never holds it, so each open gets 30 s at most."""
    return [await asyncio.wait_for(eng.open_stream(f"w{k}", StreamConfig(instructions=f"W{k}-")), 30)
            for k in range(n)]


def _send_unit(s, i: int = 0) -> None:
    s.submit(AppendUnit(s.stream_id, 0, unit_index=i, audio=_unit(i)))


def _thinker_batches(toy: ToyStages) -> list:
    return [n for st, n in toy.calls if st == "thinker"]


def _timings(outs: list) -> dict:
    return [o for o in outs if isinstance(o, UnitTimings)][0].timings


async def test_batch_window_gathers_units_that_arrive_a_few_ms_apart():
    import time

    toy = ToyStages()
    eng = DuplexEngine(toy, _window_layout(20000))
    streams = await _listeners(eng, 4)

    def submit_all():  # like sessions whose units arrive a few ms apart
        for s in streams:
            _send_unit(s)
            time.sleep(0.005)

    await asyncio.to_thread(submit_all)
    results = await asyncio.gather(*[_collect(s, _units_done(1), timeout=60) for s in streams])
    assert _thinker_batches(toy) == [4]
    # picked once the fourth unit came, long before the window ran out; the wait counts as queueing
    waits = [_timings(outs)["thinker_queue_ms"] for outs in results]
    assert max(waits) < 10000 and waits[0] >= waits[3]
    await eng.aclose()


async def test_without_window_the_first_unit_is_picked_at_once():
    toy = ToyStages()
    eng = DuplexEngine(toy, _window_layout(0))
    streams = await _listeners(eng, 4)
    _send_unit(streams[0])
    await _collect(streams[0], _units_done(1), timeout=30)  # the other three have sent nothing yet
    for s in streams[1:]:
        _send_unit(s)
    await asyncio.gather(*[_collect(s, _units_done(1), timeout=30) for s in streams[1:]])
    sizes = _thinker_batches(toy)
    assert sizes[0] == 1 and sum(sizes) == 4
    await eng.aclose()


async def test_a_single_open_stream_never_waits_for_the_window():
    toy = ToyStages()
    eng = DuplexEngine(toy, _window_layout(60000))  # a wait would outlast the 30 s timeout below
    (s,) = await _listeners(eng, 1)
    for i in range(3):
        _send_unit(s, i)
    await _collect(s, _units_done(3), timeout=30)
    assert _thinker_batches(toy) == [1, 1, 1]
    await eng.aclose()


async def test_a_stream_that_sends_nothing_holds_the_others_only_for_the_window():
    toy = ToyStages()
    eng = DuplexEngine(toy, _window_layout(300))
    a, b, _silent = await _listeners(eng, 3)
    _send_unit(a)
    _send_unit(b)
    outs = await asyncio.gather(_collect(a, _units_done(1), timeout=30), _collect(b, _units_done(1), timeout=30))
    assert _thinker_batches(toy) == [2]
    assert _timings(outs[0])["thinker_queue_ms"] >= 299.0  # held the whole window (1 ms for the rounding)
    await eng.aclose()


async def test_a_control_item_or_a_job_is_never_held_by_the_window():
    toy = ToyStages()
    eng = DuplexEngine(toy, _window_layout(60000))  # a wait would outlast the 30 s timeouts below
    a, b, _silent = await _listeners(eng, 3)
    _send_unit(b)  # held: a and the third stream have not sent their units
    job = await asyncio.wait_for(asyncio.wrap_future(eng._runtime.run_job("thinker", lambda: "ran")), 30)
    assert job == "ran" and _thinker_batches(toy) == []
    # a control item at a's head: picked at once, and b's unit with it (2 of 3 streams queued)
    a.submit(UpdateStream("w0", 0, config=StreamConfig(instructions="A2-")))
    await _collect(b, _units_done(1), timeout=30)
    assert _thinker_batches(toy) == [1]
    await eng.aclose()


class _SlowChatToy(ToyStages):
    """A toy whose turn-based reply takes ``steps`` thinker steps of ``step_s`` each."""

    def __init__(self, steps: int, step_s: float) -> None:
        super().__init__()
        self.steps, self.step_s = steps, step_s

    def chat_thinker_steps(self, request, on_text=None):
        import time as _time

        from duplexkit.engine.minicpmo45 import ChatThinkerOut

        for _ in range(self.steps):
            _time.sleep(self.step_s)
            yield
        return ChatThinkerOut(text="done", talker_input=None, finish_reason="stop", prompt_tokens=1,
                              completion_tokens=self.steps)

    def chat_thinker(self, request, on_text=None):  # the whole reply in one call
        return self.chat_thinker_slice(self.chat_thinker_steps(request, on_text), float("inf"))[1]

    def chat_thinker_slice(self, steps, budget_s):
        import time as _time

        t0 = _time.perf_counter()
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return True, stop.value
            if _time.perf_counter() - t0 >= budget_s:
                return False, None


async def test_a_long_reply_runs_in_slices_between_unit_steps():
    """A turn-based reply (the tool decider's, a chat completion) of ~1.2 s on the thinker thread does
    not hold a live stream's unit for its whole length: the unit's step runs between two slices."""
    from duplexkit.engine.api import ChatMessage, ChatRequest

    toy = _SlowChatToy(steps=60, step_s=0.02)
    eng = DuplexEngine(toy, _layout())
    (a,) = await _listeners(eng, 1)
    reply = asyncio.ensure_future(eng.generate(ChatRequest(messages=[ChatMessage("user", ["hi"])])))
    await asyncio.sleep(0.1)  # the reply is under way
    _send_unit(a)
    await _collect(a, _units_done(1), timeout=30)
    assert not reply.done()  # the unit was served while the reply still ran
    res = await asyncio.wait_for(reply, 30)
    assert res.text == "done" and res.completion_tokens == 60
    await eng.aclose()


def test_stream_status_moves_only_along_the_table():
    """Every move the table allows goes through; every other one raises (a runtime bug, never input)."""
    import asyncio as _asyncio

    from duplexkit.engine.streams import TRANSITIONS, StreamStateError, StreamStatus, _StreamState

    loop = _asyncio.new_event_loop()
    try:
        for src in StreamStatus:
            for dst in StreamStatus:
                st = _StreamState("s", StreamConfig(), loop)
                st.status = src
                if dst in TRANSITIONS[src]:
                    st.move(dst)
                    assert st.status is dst
                else:
                    with pytest.raises(StreamStateError):
                        st.move(dst)
                    assert st.status is src
    finally:
        loop.close()
    assert set(TRANSITIONS) == set(StreamStatus)


def test_every_queued_control_item_has_a_handler():
    """The (stage, kind) table covers what the runtime queues: open, end turn and close at every stage,
    update at the thinker and the vocoder, forced speech at the thinker; and nothing for units."""
    from duplexkit.engine.layout import STAGES
    from duplexkit.engine.steps import CONTROL, STAGE_OPS
    from duplexkit.engine.streams import WorkKind

    want = {(s, k) for s in STAGES for k in (WorkKind.OPEN, WorkKind.END_TURN, WorkKind.CLOSE)}
    want |= {("thinker", WorkKind.UPDATE), ("code2wav", WorkKind.UPDATE), ("thinker", WorkKind.SPEAK_TEXT)}
    assert set(CONTROL) == want
    assert set(STAGE_OPS) == set(STAGES)


async def test_status_follows_the_stream_and_faults_live_in_the_tests_hook():
    from duplexkit.engine.streams import StreamStatus
    from duplexkit.testing import StageFaults

    toy = ToyStages()
    eng = DuplexEngine(toy, _layout())
    s = await eng.open_stream("a", StreamConfig(instructions="A"))
    assert s.status is StreamStatus.OPEN and s.runtime.fault_hook is None
    inject_fault(s, "talker")
    hook = s.runtime.fault_hook
    assert isinstance(hook, StageFaults) and not hasattr(s._st, "fault")
    assert hook.take("thinker", "a") is None and hook.take("talker", "b") is None
    inject_fault(s, None)  # cleared: the next talker item runs
    assert hook.take("talker", "a") is None
    with pytest.raises(ValueError):
        inject_fault(s, "vocoder")
    s.submit(ForceSpeak("a", 0))
    s.submit(AppendUnit("a", 0, unit_index=0, audio=_unit(0)))
    await _collect(s, _units_done(1))
    await s.aclose()
    assert s.status is StreamStatus.CLOSED and s.closed
    assert [o async for o in s.outputs()] == [] and s.status is StreamStatus.ENDED
    f = await eng.open_stream("f", StreamConfig(instructions="fail-open"))  # fails while opening
    outs = [o async for o in f.outputs()]
    assert isinstance(outs[0], EngineFailure) and f.status is StreamStatus.ENDED
    await eng.aclose()
