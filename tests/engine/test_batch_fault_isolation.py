"""A batch-level exception in a stage fails only the stream that caused it.

The poisoned toy thinker raises for the *whole batch* whenever a stream tagged ``poison`` is in it
(as a shape error in a batched forward would), before touching any state. The runtime splits the
batch until the poisoned stream is alone: it gets a fatal EngineFailure, the others get every unit."""

from __future__ import annotations

import asyncio

import numpy as np

from duplexkit.engine import DuplexEngine
from duplexkit.engine.api import AppendUnit, EngineFailure, ForceSpeak, StreamConfig, TextDelta, UnitTimings
from duplexkit.engine.layout import Layout

from .toy import ToyStages


class PoisonedToy(ToyStages):
    def thinker_step(self, items):
        if any(w.handle["tag"] == "poison" for w in items):
            self.calls.append(("thinker-raised", len(items)))
            raise RuntimeError("batched forward failed")
        return super().thinker_step(items)


def _unit(i: int) -> np.ndarray:
    return np.zeros(16560 if i == 0 else 16000, np.float32)


async def test_batch_exception_fails_only_the_poisoned_stream():
    toy = PoisonedToy(turn_units=100, delay_s=0.02)
    layout = Layout.from_dict({"name": "t", "stages": {s: {"device": "cpu", "max_num_seqs": 8}
                                                       for s in ("thinker", "talker", "code2wav")}})
    eng = DuplexEngine(toy, layout)
    names = ["A", "B", "poison", "C"]
    streams = {n: await eng.open_stream(n, StreamConfig(instructions=n)) for n in names}
    for n, s in streams.items():
        s.submit(ForceSpeak(n, 0))
    for i in range(4):
        for n, s in streams.items():
            s.submit(AppendUnit(n, 0, unit_index=i, audio=_unit(i)))

    async def collect(n):
        outs = []
        async for o in streams[n].outputs():
            outs.append(o)
            if n != "poison" and sum(isinstance(x, UnitTimings) for x in outs) >= 4:
                break
        return outs

    results = dict(zip(names, await asyncio.wait_for(asyncio.gather(*(collect(n) for n in names)), 60)))
    bad = results["poison"]
    assert isinstance(bad[-1], EngineFailure) and bad[-1].fatal and "batched forward failed" in bad[-1].message
    for n in ("A", "B", "C"):
        assert not any(isinstance(o, EngineFailure) for o in results[n]), n
        texts = [o.text for o in results[n] if isinstance(o, TextDelta)]
        assert len(texts) == 4 and all(t.startswith(n) for t in texts), (n, texts)
    # the poisoned stream really was co-batched with others at least once, and split out
    assert any(k == "thinker-raised" and size > 1 for k, size in toy.calls)
    assert eng.num_streams == 3
    await eng.aclose()
    assert toy.live == {"thinker": 0, "talker": 0, "code2wav": 0}
