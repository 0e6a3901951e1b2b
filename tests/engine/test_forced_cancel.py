"""A response cancelled before its forced unit is decided never speaks.

The Session sends a requested response's forced unit as ``AppendUnit(force_speak=True)`` in epoch E. A
``response.cancel`` that comes before the engine decided it sends ``CancelEpoch(E + 1)``: the queued unit is
kept (it carries the user's input) and re-tagged with E + 1. Its ``force_speak`` belonged to the cancelled
response, so it must not open a turn in E + 1 (the Session would read it as a new model-triggered response
and play it in full). The unit is decided ``listen`` instead.

Each engine is held so that the forced unit is certainly still queued when the cancel comes: the runtime's
thinker thread runs a job that waits on an event (``StageRuntime.run_job``), the scripted engine decides
units on its own task, which does not run between two ``submit`` calls. Assertions are in units and epochs.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from duplexkit.engine import DuplexEngine
from duplexkit.engine.api import (
    AppendUnit, AudioChunk, CancelEpoch, Decision, EngineFailure, StreamConfig, TextDelta, TurnEnd, UnitTimings,
)
from duplexkit.engine.layout import Layout
from duplexkit.testing import ScriptedEngine

from .toy import ToyStages

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"


def _unit(i: int) -> np.ndarray:
    return np.zeros(16560 if i == 0 else 16000, np.float32)


async def _collect(stream, until, timeout: float = 120.0) -> list:
    outs: list = []

    async def run():
        async for o in stream.outputs():
            outs.append(o)
            if until(outs):
                return

    await asyncio.wait_for(run(), timeout)
    return outs


def _unit_done(index: int):
    return lambda outs: any(isinstance(o, UnitTimings) and o.unit_index == index for o in outs)


def _held_thinker(runtime):
    """Hold the runtime's thinker thread (a job waiting on an event) until the returned event is set."""
    release = threading.Event()
    started = threading.Event()

    def hold():
        started.set()
        release.wait(60)

    fut = runtime.run_job("thinker", hold)
    assert started.wait(60), "the thinker thread did not take the holding job"
    return release, fut


async def _cancel_queued_forced_unit(runtime, stream, sid: str, speech: list) -> list:
    """Unit 0 is a response's forced unit (epoch 0), cancelled (epoch 1) while queued; unit 1 follows in
    epoch 1 as the Session sends it after a cancel (``force_listen`` under ``on_request``). Returns the
    outputs up to unit 1's timings."""
    release, fut = _held_thinker(runtime)
    stream.submit(AppendUnit(sid, 0, unit_index=0, audio=speech[0], force_speak=True))
    stream.submit(CancelEpoch(sid, 1))
    stream.submit(AppendUnit(sid, 1, unit_index=1, audio=speech[1], force_listen=True))
    release.set()
    await asyncio.wrap_future(fut)
    return await _collect(stream, _unit_done(1))


def _assert_silent(outs: list) -> None:
    dec = {(o.unit_index, o.epoch): o.decision for o in outs if isinstance(o, Decision)}
    assert dec == {(0, 1): "listen", (1, 1): "listen"}, dec
    assert not any(isinstance(o, (TextDelta, AudioChunk, TurnEnd, EngineFailure)) for o in outs), outs


async def _next_forced_unit_speaks(stream, sid: str, index: int, audio: np.ndarray) -> list:
    stream.submit(AppendUnit(sid, 1, unit_index=index, audio=audio, force_speak=True))
    outs = await _collect(stream, _unit_done(index))
    d = [o for o in outs if isinstance(o, Decision)]
    assert [(o.unit_index, o.epoch, o.decision, o.turn_start) for o in d] == [(index, 1, "speak", True)]
    return outs


async def test_toy_runtime_cancelled_forced_unit_listens():
    layout = Layout.from_dict({"name": "t", "stages": {s: {"device": "cpu", "max_num_seqs": 2}
                                                       for s in ("thinker", "talker", "code2wav")}})
    toy = ToyStages(turn_units=3)
    eng = DuplexEngine(toy, layout)
    try:
        s = await eng.open_stream("fc", StreamConfig(instructions="F"))
        outs = await _cancel_queued_forced_unit(eng._runtime, s, "fc", [_unit(0), _unit(1)])
        _assert_silent(outs)
        assert ("end_turn", "F") in toy.events
        more = await _next_forced_unit_speaks(s, "fc", 2, _unit(2))  # the next response.create works
        assert any(isinstance(o, AudioChunk) and o.epoch == 1 for o in more)
    finally:
        await eng.aclose()


async def test_scripted_engine_cancelled_forced_unit_listens():
    eng = ScriptedEngine(units_per_turn=3)
    s = await eng.open_stream("fs", StreamConfig())
    s.submit(AppendUnit("fs", 0, unit_index=0, audio=_unit(0), force_speak=True))
    s.submit(CancelEpoch("fs", 1))
    s.submit(AppendUnit("fs", 1, unit_index=1, audio=_unit(1), force_listen=True))
    _assert_silent(await _collect(s, _unit_done(1), timeout=10))
    # a stale unit (an older epoch than the stream's) keeps no force either
    s.submit(AppendUnit("fs", 0, unit_index=2, audio=_unit(2), force_speak=True))
    late = await _collect(s, _unit_done(2), timeout=10)
    assert [(o.epoch, o.decision) for o in late if isinstance(o, Decision)] == [(1, "listen")]
    more = await _next_forced_unit_speaks(s, "fs", 3, _unit(3))
    assert sum(len(o.audio) for o in more if isinstance(o, AudioChunk)) == 20_160
    await eng.aclose()


@pytest.mark.engine
async def test_tiny_engine_cancelled_forced_unit_listens(engine):
    """The real thinker with random weights speaks whenever it may: only the forced listen keeps the
    cancelled forced unit silent (before the fix it opened a turn in the new epoch, with audio)."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from duplexkit.audio import UnitFramer, read_wav

    audio, _ = read_wav(FIX / "question_16k.wav", rate=16000)
    speech = [u.audio for u in UnitFramer().push(audio)][:3]
    s = await engine.open_stream("ft", StreamConfig(seed=3))
    try:
        _assert_silent(await _cancel_queued_forced_unit(engine._runtime, s, "ft", speech))
        more = await _next_forced_unit_speaks(s, "ft", 2, speech[2])
        chunks = [o for o in more if isinstance(o, AudioChunk)]
        assert chunks and chunks[0].epoch == 1 and len(chunks[0].audio) > 0
    finally:
        await s.aclose()
