"""The ScriptedEngine follows its script exactly (it is the oracle of the fast protocol tests)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from duplexkit.engine.api import (
    AppendUnit,
    AudioChunk,
    CancelEpoch,
    ChatMessage,
    ChatRequest,
    Decision,
    Engine,
    EngineFailure,
    EngineStream,
    ForceSpeak,
    StreamConfig,
    TextDelta,
    TurnEnd,
    UnitTimings,
    UpdateStream,
)
from duplexkit.testing import ScriptedEngine, tone


def _unit(i: int, epoch: int = 0, **kw) -> AppendUnit:
    return AppendUnit("s", epoch, unit_index=i, audio=np.zeros(16560 if i == 0 else 16000, np.float32), **kw)


async def _run(engine: ScriptedEngine, commands, config: StreamConfig = StreamConfig()) -> list:
    st = await engine.open_stream("s", config)
    assert isinstance(st, EngineStream)
    for c in commands:
        st.submit(c)
    await st.aclose()
    return [o async for o in st.outputs()]


def test_is_an_engine():
    assert isinstance(ScriptedEngine(), Engine)
    with pytest.raises(TypeError):
        ScriptedEngine(no_such_field=1)


async def test_listens_until_forced_then_speaks_with_real_chunk_sizes():
    outs = await _run(ScriptedEngine(units_per_turn=3),
                      [_unit(0), _unit(1, force_speak=True), _unit(2), _unit(3), _unit(4)])
    decisions = [(o.unit_index, o.decision, o.turn_start) for o in outs if isinstance(o, Decision)]
    assert decisions == [(0, "listen", False), (1, "speak", True), (2, "speak", False), (3, "speak", False),
                         (4, "listen", False)]
    chunks = [o for o in outs if isinstance(o, AudioChunk)]
    assert [len(c.audio) for c in chunks] == [20160, 24000, 24000, 3840]
    assert [c.final for c in chunks] == [False, False, False, True]
    assert all(c.audio.dtype == np.float32 for c in chunks)
    # phase-continuous tone across the turn
    whole = np.concatenate([c.audio for c in chunks])
    np.testing.assert_allclose(whole, tone(72000), atol=1e-6)
    ends = [o for o in outs if isinstance(o, TurnEnd)]
    assert len(ends) == 1 and ends[0].unit_index == 3 and ends[0].reason == "turn_eos"
    texts = [o.text for o in outs if isinstance(o, TextDelta)]
    assert texts == ["Hello there, ", "this is ", "a scripted "]


async def test_model_native_speaking_and_force_listen():
    outs = await _run(ScriptedEngine(speak_after_units=2, units_per_turn=1),
                      [_unit(0), _unit(1), _unit(2, force_listen=True), _unit(3)])
    assert [o.decision for o in outs if isinstance(o, Decision)] == ["listen", "listen", "listen", "speak"]


async def _until_units(st, n: int) -> list:
    outs = []
    async for o in st.outputs():
        outs.append(o)
        if sum(isinstance(x, UnitTimings) for x in outs) >= n:
            return outs
    return outs


async def test_cancel_ends_the_turn_and_retags_queued_units():
    """The runtime's rules (docs/concepts.md "Epochs"): units decided before the cancel keep their
    epoch; units still queued when it is submitted, and stale appends after it, are decided in the
    new epoch; the pending ForceSpeak is dropped and the cancelled turn gets no TurnEnd."""
    st = await ScriptedEngine(units_per_turn=None).open_stream("s", StreamConfig())
    st.submit(ForceSpeak("s", 0))
    st.submit(_unit(0))
    st.submit(_unit(1))
    outs = await _until_units(st, 2)
    st.submit(ForceSpeak("s", 0))  # pending when the cancel comes: dropped
    st.submit(_unit(2))  # queued when the cancel comes: re-tagged
    st.submit(CancelEpoch("s", 1))
    st.submit(_unit(3, epoch=0))  # stale append: decided in the current epoch
    assert st.epoch == 1
    outs += await _until_units(st, 2)
    st.submit(ForceSpeak("s", 0))  # an old epoch's ForceSpeak is ignored
    st.submit(_unit(4, epoch=1))
    outs += await _until_units(st, 1)
    st.submit(ForceSpeak("s", 1))  # binds to the next unit decided
    st.submit(_unit(5, epoch=1))
    await st.aclose()
    outs += [o async for o in st.outputs()]
    dec = [(o.unit_index, o.epoch, o.decision) for o in outs if isinstance(o, Decision)]
    assert dec == [(0, 0, "speak"), (1, 0, "speak"), (2, 1, "listen"), (3, 1, "listen"), (4, 1, "listen"),
                   (5, 1, "speak")]
    assert not [o for o in outs if isinstance(o, TurnEnd)]


async def test_cancel_while_computing_discards_the_unit():
    eng = ScriptedEngine(units_per_turn=None, unit_delay_s=0.05)
    st = await eng.open_stream("s", StreamConfig())
    st.submit(_unit(0, force_speak=True))
    await asyncio.sleep(0.01)  # unit 0 is being computed (any later point only shrinks the window)
    st.submit(CancelEpoch("s", 1))
    st.submit(_unit(1, epoch=1))
    await st.aclose()
    outs = [o async for o in st.outputs()]
    assert {o.epoch for o in outs} == {1}
    assert [(o.unit_index, o.decision) for o in outs if isinstance(o, Decision)] == [(1, "listen")]


async def test_text_only_stream_has_no_audio():
    outs = await _run(ScriptedEngine(), [ForceSpeak("s", 0), _unit(0)], StreamConfig(output_audio=False))
    assert not [o for o in outs if isinstance(o, AudioChunk)]
    assert [o.text for o in outs if isinstance(o, TextDelta)] == ["Hello there, "]


async def test_update_stream_switches_audio_off():
    outs = await _run(ScriptedEngine(units_per_turn=None),
                      [ForceSpeak("s", 0), _unit(0), UpdateStream("s", 0, config=StreamConfig(output_audio=False)),
                       _unit(1)])
    assert [o.unit_index for o in outs if isinstance(o, AudioChunk)] == [0]


async def test_failure_injection():
    outs = await _run(ScriptedEngine(fail_at_unit=1, fail_fatal=True), [_unit(0), _unit(1)])
    errs = [o for o in outs if isinstance(o, EngineFailure)]
    assert len(errs) == 1 and errs[0].fatal and errs[0].unit_index == 1


async def test_stream_rules():
    eng = ScriptedEngine()
    st = await eng.open_stream("s", StreamConfig())
    with pytest.raises(ValueError):
        await eng.open_stream("s", StreamConfig())
    assert eng.open_streams == 1
    await st.aclose()
    assert eng.open_streams == 0
    st.submit(_unit(0))  # commands to a closed stream are ignored, as in the runtime
    assert [o async for o in st.outputs()] == []


def test_scripted_is_an_engine_plugin():
    """``load_engine("scripted")`` reaches duplexkit.testing through the ``duplexkit.engines`` plugin
    table (no engine module imports the testing package), and passes the options and the model id."""
    import duplexkit.testing as testing
    from duplexkit.engine.loading import load_engine
    from duplexkit.engine.plugins import engine_plugins, load_plugin
    from duplexkit.errors import EngineLoadError

    assert engine_plugins()["scripted"] == "duplexkit.testing.scripted:ScriptedEngine"
    assert load_plugin("scripted") is testing.ScriptedEngine
    eng = load_engine("scripted", scripted={"units_per_turn": 3}, model_id="m1", progress=False)
    assert isinstance(eng, testing.ScriptedEngine) and eng.model_id == "m1"
    with pytest.raises(EngineLoadError):
        load_engine("scripted", scripted={"no_such_option": 1}, progress=False)


async def test_generate_and_stream():
    eng = ScriptedEngine()
    req = ChatRequest(messages=[ChatMessage("user", ["hi there"])], output_audio=True, max_tokens=3)
    res = await eng.generate(req)
    assert res.text == "This is a" and res.finish_reason == "length"
    assert res.audio is not None and len(res.audio) == 3 * 9600
    assert res.completion_tokens == 3 and res.prompt_tokens == 2
    deltas = [d async for d in eng.generate_stream(req)]
    assert "".join(d.text for d in deltas) == res.text
    np.testing.assert_allclose(np.concatenate([d.audio for d in deltas if d.audio is not None]), res.audio, atol=1e-6)
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage == {
        "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert all(d.finish_reason is None for d in deltas[:-1])
    full = await eng.generate(ChatRequest(messages=[ChatMessage("user", ["x"])], max_tokens=100))
    assert full.finish_reason == "stop" and full.audio is None
