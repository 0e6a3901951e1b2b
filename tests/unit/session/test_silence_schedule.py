"""Silence units follow the unit schedule: while a response is active and input has run dry
(the client sent a whole file at once, or stopped sending), the Session feeds one silence unit per unit
period, so an answer carried by silence arrives at 1 s of audio per second. The grace
``silence_slack_ms`` is paid once per dry spell, not once per unit (it was: a unit every 1.30 s, 2.9 s of
gaps in a 10 s answer).

Sans-I/O Session with a simulated clock (``Driver.t``, ms; ticks of 50 ms as the driver's clock task)."""

from __future__ import annotations

import numpy as np
import pytest

from duplexkit.engine.api import AppendUnit, Decision
from duplexkit.session.config import SessionConfig

from _driver import Driver, fixture_audio, pcm16_b64

TICK_MS = 50



def _dry_answer(d: Driver, ms: int) -> list[int]:
    """Tick for ``ms`` with no input; the times (ms) at which units were appended."""
    times = []
    for _ in range(ms // TICK_MS):
        new = d.tick(TICK_MS)
        times += [d.t for c in new if isinstance(c, AppendUnit)]
    return times


def _burst_then_answer(d: Driver) -> int:
    """A whole file in one append (input ahead of real time), then response.create; returns the time of
    the forced unit, which the engine decides ``speak`` at once."""
    speech = fixture_audio("question_16k.wav")
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(speech)})
    new = d.send({"type": "response.create"})
    forced = [c for c in new if isinstance(c, AppendUnit)]
    assert len(forced) == 1 and forced[0].force_speak
    d.engine(Decision(d.sid, d.s.epoch, forced[0].unit_index, decision="speak", turn_start=True))
    return d.t


def test_silence_units_come_once_per_unit_period_after_the_first():
    d = Driver(answer_policy="on_request")
    t0 = _burst_then_answer(d)
    slack = d.s.cfg.silence_slack_ms
    times = _dry_answer(d, 10_300)
    gaps = np.diff([t0] + times).tolist()
    # the first silence unit waits for the grace; every later one comes one unit period after the one
    # before (at 1.30 s each, 10 s of answer took 13 s)
    assert 1000 + slack <= gaps[0] <= 1000 + slack + TICK_MS, gaps
    assert gaps[1:] == [1000] * (len(gaps) - 1), gaps
    assert len(times) == 10


def test_input_that_comes_back_restarts_the_schedule_and_a_stall_does_not_burst():
    d = Driver(answer_policy="on_request")
    _burst_then_answer(d)
    _dry_answer(d, 3_000)
    # real input again: one whole unit, in real time; the silence schedule restarts after it
    unit = np.zeros(16_000, np.float32)
    for i in range(10):
        d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(unit[i * 1600:(i + 1) * 1600])})
        d.t += 100
    real_at = d.t
    assert [c for c in d.cmds if isinstance(c, AppendUnit)][-1].is_silence is False
    slack = d.s.cfg.silence_slack_ms
    times = _dry_answer(d, 2_500)
    assert times and 1000 + slack <= times[0] - real_at + 100 <= 1000 + slack + TICK_MS, (real_at, times)
    # the event loop stalled for 5 s: one silence unit at the next tick, the next one after the grace,
    # then one per period (never a burst of the units the stall skipped)
    last = d.t
    d.t += 5_000
    stalled = [c for c in d.tick(0) if isinstance(c, AppendUnit)]
    assert len(stalled) == 1
    after = _dry_answer(d, 2_400)
    assert np.diff([d.t - 2_400] + after).tolist()[0] <= slack + TICK_MS and len(after) == 3, (last, after)
