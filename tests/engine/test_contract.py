"""The engine contract (duplexkit/engine/api.py, docs/concepts.md "Epochs"), run against BOTH the
scripted engine (duplexkit.testing) and the tiny DuplexEngine (the shared session fixture
``engine`` of conftest.py; CPU, random weights, a handful of units per test).

What every engine must do: open/append/close; outputs in unit order with ``UnitTimings`` last for
each unit; ``CancelEpoch`` makes the new epoch current at once, re-tags queued input units (they are
decided in the new epoch, never dropped), takes stale appends into the current epoch, and no output
of an older epoch follows one of the newer; a thinker failure is fatal to the stream only (its
outputs end, later commands are ignored); a talker failure costs the turn, not the stream;
``SpeakText`` speaks its text in the following units (forced speak, also over ``force_listen``), ends
the turn with ``TurnEnd`` and is dropped by a ``CancelEpoch``.
Assertions are in units and epochs, never wall-clock. Decisions are pinned with ``force_listen`` /
``force_speak`` (the tiny model has random weights).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from duplexkit.audio import UnitFramer, read_wav
from duplexkit.engine.api import (
    AppendUnit,
    AudioChunk,
    CancelEpoch,
    Decision,
    Engine,
    EngineFailure,
    EngineStream,
    SpeakText,
    StreamConfig,
    TextDelta,
    TurnEnd,
    UnitTimings,
)
from duplexkit.testing import ScriptedEngine, inject_fault

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"


@pytest.fixture(params=["scripted", pytest.param("tiny", marks=pytest.mark.engine)])
def eng(request):
    if request.param == "scripted":
        return ScriptedEngine(units_per_turn=None)  # like random weights: turns do not end by themselves
    return request.getfixturevalue("engine")


def _units(n: int) -> list:
    """``n`` duplex units of real speech (long_question_16k.wav): float32 [16560], then [16000]."""
    audio, _ = read_wav(FIX / "long_question_16k.wav", rate=16000)
    framer = UnitFramer()
    units = [u.audio for u in framer.push(audio)]
    assert len(units) >= n
    return units[:n]


def _open_count(e) -> int:
    return e.open_streams if isinstance(e, ScriptedEngine) else e.num_streams


async def _collect(stream, until) -> list:
    outs: list = []
    async for o in stream.outputs():
        outs.append(o)
        if until(outs):
            break
    return outs


def _unit_done(k: int):
    return lambda outs: any(isinstance(o, UnitTimings) and o.unit_index == k for o in outs)


def _check_order(outs: list) -> None:
    """Outputs of unit k before any of unit k+1; UnitTimings last of its unit; epochs never go back."""
    units = [o.unit_index for o in outs if o.unit_index >= 0]
    assert units == sorted(units), units
    epochs = [o.epoch for o in outs]
    assert epochs == sorted(epochs), epochs
    for i, o in enumerate(outs):
        if isinstance(o, UnitTimings):
            assert all(x.unit_index != o.unit_index for x in outs[i + 1:]), (o, outs[i + 1:])
    for o in outs:
        if isinstance(o, AudioChunk):
            assert o.audio.dtype == np.float32 and o.audio.ndim == 1


def _decisions(outs: list) -> list:
    return [(o.unit_index, o.epoch, o.decision) for o in outs if isinstance(o, Decision)]


async def test_open_append_close_in_unit_order(eng):
    assert isinstance(eng, Engine)
    u = _units(2)
    before = _open_count(eng)
    st = await eng.open_stream("contract-order", StreamConfig(seed=1))
    assert isinstance(st, EngineStream) and _open_count(eng) == before + 1
    with pytest.raises(ValueError):
        await eng.open_stream("contract-order", StreamConfig())
    st.submit(AppendUnit("contract-order", 0, unit_index=0, audio=u[0], force_listen=True))
    st.submit(AppendUnit("contract-order", 0, unit_index=1, audio=u[1], force_speak=True))
    outs = await _collect(st, _unit_done(1))
    _check_order(outs)
    assert _decisions(outs) == [(0, 0, "listen"), (1, 0, "speak")]
    assert [o.turn_start for o in outs if isinstance(o, Decision)] == [False, True]
    assert {o.epoch for o in outs} == {0} and not any(isinstance(o, EngineFailure) for o in outs)
    await st.aclose()
    rest = [o async for o in st.outputs()]  # the iterator ends after close
    assert all(o.unit_index == 1 for o in rest)
    assert _open_count(eng) == before
    st.submit(AppendUnit("contract-order", 0, unit_index=2, audio=u[1]))  # ignored after close
    assert [o async for o in st.outputs()] == []


async def test_cancel_retags_queued_units_and_takes_stale_appends(eng):
    sid = "contract-cancel"
    u = _units(4)
    st = await eng.open_stream(sid, StreamConfig(seed=2))
    st.submit(AppendUnit(sid, 0, unit_index=0, audio=u[0], force_speak=True))
    st.submit(AppendUnit(sid, 0, unit_index=1, audio=u[1], force_listen=True))
    st.submit(AppendUnit(sid, 0, unit_index=2, audio=u[2], force_listen=True))
    st.submit(CancelEpoch(sid, 1))  # units 1 and 2 are still queued (one unit runs at a time)
    st.submit(AppendUnit(sid, 0, unit_index=3, audio=u[3], force_listen=True))  # stale append
    outs = await _collect(st, _unit_done(3))
    await st.aclose()
    _check_order(outs)
    dec = _decisions(outs)
    # input is never dropped: every queued or stale unit is decided once, in the new epoch
    assert [d for d in dec if d[0] >= 1] == [(1, 1, "listen"), (2, 1, "listen"), (3, 1, "listen")]
    # unit 0 was decided before the cancel (epoch 0), discarded while running, or re-tagged (epoch 1)
    assert len([d for d in dec if d[0] == 0]) <= 1
    first_new = next(i for i, o in enumerate(outs) if o.epoch == 1)
    assert all(o.epoch == 1 for o in outs[first_new:])  # nothing stale after the new epoch began
    assert not any(isinstance(o, TurnEnd) and o.epoch == 0 for o in outs)  # the cancelled turn ends silently
    assert not any(isinstance(o, EngineFailure) for o in outs)


async def test_thinker_failure_is_fatal_to_the_stream_only(eng):
    sid = "contract-fatal"
    u = _units(2)
    before = _open_count(eng)
    st = await eng.open_stream(sid, StreamConfig(seed=3))
    inject_fault(st, "thinker")
    st.submit(AppendUnit(sid, 0, unit_index=0, audio=u[0], force_listen=True))
    outs = [o async for o in st.outputs()]  # ends by itself after the fatal error
    errs = [o for o in outs if isinstance(o, EngineFailure)]
    assert len(errs) == 1 and errs[0].fatal and errs[0].code == "server_error" and "thinker" in errs[0].message
    assert outs[-1] is errs[0]
    st.submit(AppendUnit(sid, 0, unit_index=1, audio=u[1]))  # ignored, no raise
    await st.aclose()
    assert _open_count(eng) == before
    # the engine keeps serving other streams
    st2 = await eng.open_stream(sid + "-2", StreamConfig(seed=3))
    st2.submit(AppendUnit(sid + "-2", 0, unit_index=0, audio=u[0], force_listen=True))
    outs2 = await _collect(st2, _unit_done(0))
    assert _decisions(outs2) == [(0, 0, "listen")]
    await st2.aclose()


async def test_talker_failure_costs_the_turn_not_the_stream(eng):
    sid = "contract-turn"
    u = _units(3)
    st = await eng.open_stream(sid, StreamConfig(seed=4))
    inject_fault(st, "talker")
    st.submit(AppendUnit(sid, 0, unit_index=0, audio=u[0], force_speak=True))
    st.submit(AppendUnit(sid, 0, unit_index=1, audio=u[1], force_speak=True))
    outs = await _collect(st, _unit_done(1))
    _check_order(outs)
    errs = [o for o in outs if isinstance(o, EngineFailure)]
    assert len(errs) == 1 and not errs[0].fatal and "talker" in errs[0].message
    # the unit's decision precedes its error, and the unit still gets its UnitTimings
    k = errs[0].unit_index
    assert (k, 0, "speak") in _decisions(outs)
    # what the Session does after a failed response: a new epoch, and the stream answers again
    st.submit(CancelEpoch(sid, 1))
    st.submit(AppendUnit(sid, 1, unit_index=2, audio=u[2], force_speak=True))
    more = await _collect(st, _unit_done(2))
    await st.aclose()
    assert _decisions(more) == [(2, 1, "speak")] and not any(isinstance(o, EngineFailure) for o in more)


SPOKEN = "Sure, I booked the table for two at seven."


def _unit(u: list, i: int) -> np.ndarray:
    """Unit ``i`` of any length of stream: unit 0's window, then the later units of ``u`` in a cycle."""
    return u[0] if i == 0 else u[1 + (i - 1) % (len(u) - 1)]


async def test_speak_text_speaks_the_text_then_the_stream_goes_on(eng):
    sid = "contract-speak"
    u = _units(6)
    st = await eng.open_stream(sid, StreamConfig(seed=5))
    st.submit(AppendUnit(sid, 0, unit_index=0, audio=u[0], force_listen=True))
    st.submit(SpeakText(sid, 0, text=SPOKEN, tokens_per_unit=4))
    for i in range(1, 7):  # the Session's policy forces listen: the forced text still speaks
        st.submit(AppendUnit(sid, 0, unit_index=i, audio=_unit(u, i), force_listen=True))
    outs = await _collect(st, _unit_done(6))
    _check_order(outs)
    assert not any(isinstance(o, EngineFailure) for o in outs) and {o.epoch for o in outs} == {0}
    ends = [o for o in outs if isinstance(o, TurnEnd)]
    assert len(ends) == 1 and ends[0].reason == "turn_eos"
    last = ends[0].unit_index
    dec = _decisions(outs)
    assert dec[0] == (0, 0, "listen") and 1 < last < 6
    assert [d[2] for d in dec[1:last + 1]] == ["speak"] * last and [d[2] for d in dec[last + 1:]] == ["listen"] * (6 - last)
    assert [o.turn_start for o in outs if isinstance(o, Decision)][1:3] == [True, False]
    texts = [o for o in outs if isinstance(o, TextDelta)]
    assert [t.unit_index for t in texts] == list(range(1, last + 1))
    assert "".join(t.text for t in texts) == SPOKEN and all(t.n_tokens >= 1 for t in texts)
    chunks = [o for o in outs if isinstance(o, AudioChunk)]
    assert chunks and chunks[-1].final and chunks[-1].unit_index == last
    assert "".join(c.text for c in chunks) == SPOKEN
    # afterwards the model decides as usual: a forced speak opens a turn of its own
    st.submit(AppendUnit(sid, 0, unit_index=7, audio=_unit(u, 7), force_speak=True))
    more = await _collect(st, _unit_done(7))
    await st.aclose()
    assert _decisions(more) == [(7, 0, "speak")]
    assert [o.turn_start for o in more if isinstance(o, Decision)] == [True]


async def test_cancel_drops_the_unspoken_text(eng):
    sid = "contract-speak-cancel"
    u = _units(5)
    st = await eng.open_stream(sid, StreamConfig(seed=6))
    st.submit(SpeakText(sid, 0, text=SPOKEN * 3, tokens_per_unit=1))
    st.submit(AppendUnit(sid, 0, unit_index=0, audio=u[0], force_listen=True))
    first = await _collect(st, _unit_done(0))
    assert _decisions(first) == [(0, 0, "speak")]
    st.submit(CancelEpoch(sid, 1))  # barge-in: the rest of the text is not spoken
    st.submit(SpeakText(sid, 0, text="stale", tokens_per_unit=1))  # an older epoch's text: ignored
    for i in (1, 2):
        st.submit(AppendUnit(sid, 1, unit_index=i, audio=u[i], force_listen=True))
    outs = await _collect(st, _unit_done(2))
    _check_order(outs)
    assert [d for d in _decisions(outs) if d[1] == 1] == [(1, 1, "listen"), (2, 1, "listen")]
    assert not any(isinstance(o, (TextDelta, TurnEnd)) and o.epoch == 1 for o in outs)
    # a new text in the new epoch speaks again, tagged with that epoch
    st.submit(SpeakText(sid, 1, text="Okay.", tokens_per_unit=4))
    for i in (3, 4):
        st.submit(AppendUnit(sid, 1, unit_index=i, audio=u[i], force_listen=True))
    more = await _collect(st, lambda outs: any(isinstance(o, TurnEnd) for o in outs))
    await st.aclose()
    assert _decisions(more)[0] == (3, 1, "speak")
    assert "".join(o.text for o in more if isinstance(o, TextDelta)) == "Okay."
    assert all(o.epoch == 1 for o in more)
