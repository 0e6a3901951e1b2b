"""Per-stage CUDA streams (duplexkit/engine/minicpmo45.py) change when stages run, not what they
compute: one stream on CUDA gives the same decisions, text and audio as with every stage on the
default CUDA stream. CUDA only (skipped on a CPU)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


async def _run(stage_streams: str) -> tuple:
    from duplexkit.audio import UnitFramer, read_wav
    from duplexkit.engine import DuplexEngine
    from duplexkit.engine.api import AppendUnit, AudioChunk, Decision, StreamConfig, TextDelta, UnitTimings
    from pathlib import Path

    os.environ["DUPLEXKIT_CUDA_STAGE_STREAMS"] = stage_streams
    try:
        eng = DuplexEngine.from_pretrained("tiny", "1gpu", progress=False)
    finally:
        os.environ.pop("DUPLEXKIT_CUDA_STAGE_STREAMS", None)
    wav = Path(__file__).resolve().parents[1] / "fixtures" / "audio" / "question_16k.wav"
    audio, _ = read_wav(wav, rate=16000)
    units = [u.audio for u in UnitFramer().push(np.concatenate([audio, np.zeros(16000 * 6, np.float32)]))][:5]
    s = await eng.open_stream("a", StreamConfig(temperature=0.0, seed=1234))
    for i, u in enumerate(units):
        s.submit(AppendUnit("a", 0, unit_index=i, audio=u, force_speak=(i == 1)))
    decisions, text, audio_out, done = [], [], [], 0

    async def collect():
        nonlocal done
        async for o in s.outputs():
            if isinstance(o, Decision):
                decisions.append(o.decision)
            elif isinstance(o, TextDelta):
                text.append(o.text)
            elif isinstance(o, AudioChunk):
                audio_out.append(o.audio)
            elif isinstance(o, UnitTimings):
                done += 1
                if done == len(units):
                    return

    await asyncio.wait_for(collect(), 300)
    streams_made = dict(eng.stages.cuda_streams)  # every stage thread has run its init by now
    await s.aclose()
    await eng.aclose()
    return decisions, "".join(text), np.concatenate(audio_out) if audio_out else np.zeros(0), streams_made


def test_per_stage_cuda_streams_give_the_default_stream_results():
    one = asyncio.run(_run("0"))
    own = asyncio.run(_run("1"))
    assert one[3] == {} and set(own[3]) == {"thinker", "talker", "code2wav"}
    assert "speak" in own[0]  # the forced unit spoke, so the talker and Code2Wav ran
    assert own[0] == one[0] and own[1] == one[1]
    assert own[2].shape == one[2].shape and own[2].size > 0
    assert float(np.max(np.abs(own[2] - one[2]))) <= 1e-3
