"""``SpeakText`` in the runtime on the torch-free toy StageModel: its order with the units, its input
checks, and the non-fatal answer of a stage model without forced speech (the vLLM thinker)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from duplexkit.engine import DuplexEngine, EngineInputError
from duplexkit.engine.api import AppendUnit, CancelEpoch, Decision, EngineFailure, SpeakText, StreamConfig, UnitTimings
from duplexkit.engine.layout import Layout

from .toy import ToyStages


def _layout() -> Layout:
    return Layout.from_dict({"name": "t", "stages": {s: {"device": "cpu", "max_num_seqs": 4}
                                                     for s in ("thinker", "talker", "code2wav")}})


def _unit(i: int) -> np.ndarray:
    return np.zeros(16560 if i == 0 else 16000, np.float32)


async def _collect(stream, n_units: int, timeout: float = 20.0) -> list:
    outs: list = []

    async def run():
        async for o in stream.outputs():
            outs.append(o)
            if sum(isinstance(x, UnitTimings) for x in outs) >= n_units:
                return

    await asyncio.wait_for(run(), timeout)
    return outs


class _ForcedToy(ToyStages):
    """The toy thinker with forced speech: a queued text makes the next units speak."""

    def __init__(self) -> None:
        super().__init__(turn_units=2)
        self.spoken: list = []

    def thinker_speak_text(self, handle, text, tokens_per_unit):
        if text == "refuse":
            raise ValueError("cannot say that")
        self.spoken.append((text, tokens_per_unit))


async def test_without_forced_speech_the_answer_is_a_non_fatal_failure_in_order():
    eng = DuplexEngine(ToyStages(), _layout())  # like the vLLM thinker: no thinker_speak_text
    try:
        s = await eng.open_stream("a", StreamConfig())
        s.submit(AppendUnit("a", 0, unit_index=0, audio=_unit(0), force_listen=True))
        s.submit(SpeakText("a", 0, text="hello"))
        s.submit(AppendUnit("a", 0, unit_index=1, audio=_unit(1), force_listen=True))
        outs = await _collect(s, 2)
        errs = [o for o in outs if isinstance(o, EngineFailure)]
        assert len(errs) == 1 and not errs[0].fatal and errs[0].unit_index == -1
        assert "SpeakText is not supported" in errs[0].message
        kinds = [(type(o).__name__, o.unit_index) for o in outs]
        # after unit 0's outputs, before unit 1's: the command's place in the stream
        assert kinds.index(("EngineFailure", -1)) == kinds.index(("UnitTimings", 0)) + 1
        assert kinds.index(("EngineFailure", -1)) < kinds.index(("Decision", 1))
        s.submit(AppendUnit("a", 0, unit_index=2, audio=_unit(2), force_listen=True))  # the stream goes on
        more = await _collect(s, 1)
        assert [o.decision for o in more if isinstance(o, Decision)] == ["listen"]
        await s.aclose()
    finally:
        await eng.aclose()


async def test_speak_text_reaches_the_thinker_in_order_and_cancel_drops_queued_ones():
    toy = _ForcedToy()
    eng = DuplexEngine(toy, _layout())
    try:
        s = await eng.open_stream("b", StreamConfig())
        with pytest.raises(EngineInputError, match="non-empty"):
            s.submit(SpeakText("b", 0, text=""))
        with pytest.raises(EngineInputError, match="tokens_per_unit"):
            s.submit(SpeakText("b", 0, text="x", tokens_per_unit=0))
        s.submit(SpeakText("b", 0, text="first", tokens_per_unit=3))
        s.submit(SpeakText("b", 0, text="refuse"))
        s.submit(AppendUnit("b", 0, unit_index=0, audio=_unit(0), force_listen=True))
        outs = await _collect(s, 1)
        assert toy.spoken == [("first", 3)]
        errs = [o for o in outs if isinstance(o, EngineFailure)]
        assert len(errs) == 1 and not errs[0].fatal and "cannot say that" in errs[0].message
        # a SpeakText still queued when a cancel comes is dropped; an older epoch's is ignored
        toy.delay_s = 0.2
        s.submit(AppendUnit("b", 0, unit_index=1, audio=_unit(1), force_listen=True))
        s.submit(SpeakText("b", 0, text="queued"))
        s.submit(CancelEpoch("b", 1))
        s.submit(SpeakText("b", 0, text="stale"))
        s.submit(AppendUnit("b", 1, unit_index=2, audio=_unit(2), force_listen=True))
        await _collect(s, 1)
        toy.delay_s = 0.002
        s.submit(SpeakText("b", 1, text="fresh"))
        s.submit(AppendUnit("b", 1, unit_index=3, audio=_unit(3), force_listen=True))
        await _collect(s, 1)
        assert [t for t, _ in toy.spoken] == ["first", "fresh"]
        await s.aclose()
    finally:
        await eng.aclose()


def test_the_vllm_thinker_refuses_forced_speech_with_a_clear_error():
    from duplexkit.engine.vllm_stages import VllmStages
    from duplexkit.engine.vllm_thinker import VllmBackendError

    with pytest.raises(VllmBackendError, match="not supported by the vLLM thinker backend"):
        VllmStages.thinker_speak_text(object.__new__(VllmStages), None, "hi", 6)
