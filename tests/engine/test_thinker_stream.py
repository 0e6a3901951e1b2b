"""``DUPLEXKIT_THINKER_STREAM``: the thinker's work on its own high-priority CUDA stream.

CPU: the setting is parsed strictly and ignored on a CPU thinker (same outputs as without it).
CUDA (skipped without a GPU): an engine on the tiny random checkpoint with the flag on captures the
thinker's graphs and runs every thinker step from the dedicated stream (the talker stays on the
default stream), serves several streams batched together, and gives the same decisions, text and
audio as the same model's engine with the flag off (streams one at a time, so both engines meet the
same batch buckets, and a turn-based chat reply).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # docs/model.md §7.5: before stepaudio2 is imported
torch = pytest.importorskip("torch")

from duplexkit.engine.api import (  # noqa: E402
    FIRST_UNIT_SAMPLES, UNIT_SAMPLES, AppendUnit, AudioChunk, ChatMessage, ChatRequest, Decision, EngineFailure,
    ForceSpeak, StreamConfig, TextDelta, UnitTimings,
)
from duplexkit.engine.thinker_stream import ENV_VAR, thinker_stream_requested  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_setting_is_parsed_strictly(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert thinker_stream_requested() is False
    for v in ("1", "true", "ON", " yes "):
        assert thinker_stream_requested(v) is True
    for v in ("", "0", "false", "Off", "no"):
        assert thinker_stream_requested(v) is False
    monkeypatch.setenv(ENV_VAR, "1")
    assert thinker_stream_requested() is True
    with pytest.raises(ValueError, match=ENV_VAR):
        thinker_stream_requested("2")


def _units(k: int, n: int) -> list:
    """``n`` duplex units of quiet noise (float32 16 kHz; unit 0 is the longer first unit)."""
    rng = np.random.default_rng(1000 + k)
    return [(0.05 * rng.standard_normal(FIRST_UNIT_SAMPLES if i == 0 else UNIT_SAMPLES)).astype(np.float32)
            for i in range(n)]


async def _speak(engine, ks: list, n_units: int) -> list:
    """Streams ``t{k}`` for ``k`` in ``ks`` opened with ForceSpeak, fed unit by unit together (so the
    thinker batches them); returns each stream's outputs up to its ``n_units``-th UnitTimings."""
    streams = [await engine.open_stream(f"t{k}", StreamConfig(instructions=f"Assistant {k}.", seed=10 + k))
               for k in ks]
    for k, s in zip(ks, streams):
        s.submit(ForceSpeak(f"t{k}", 0))
    inputs = [_units(k, n_units) for k in ks]
    for i in range(n_units):
        for j, (k, s) in enumerate(zip(ks, streams)):
            s.submit(AppendUnit(f"t{k}", 0, unit_index=i, audio=inputs[j][i]))

    async def collect(s) -> list:
        outs = []
        async for o in s.outputs():
            outs.append(o)
            if sum(isinstance(x, UnitTimings) for x in outs) >= n_units:
                break
        return outs

    outs = await asyncio.gather(*[collect(s) for s in streams])
    for s in streams:
        await s.aclose()
    return outs


def _split(outs: list):
    """(what was decided and said, the audio chunks) of one stream's outputs."""
    said = []
    for o in outs:
        if isinstance(o, Decision):
            said.append(("decision", o.unit_index, o.decision, o.turn_start))
        elif isinstance(o, TextDelta):
            said.append(("text", o.unit_index, o.text, o.n_tokens))
        elif isinstance(o, AudioChunk):
            said.append(("audio", o.unit_index, o.text, o.final, len(o.audio)))
        elif isinstance(o, EngineFailure):
            said.append(("failure", o.unit_index, o.message))
    return said, [o.audio for o in outs if isinstance(o, AudioChunk)]


def _assert_same_audio(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and np.isfinite(x).all()
        # the thinker's ids and the talker's codes are equal (checked through the text and the chunk
        # sizes); the vocoder may autotune other cuDNN plans in the second engine's fresh threads
        assert np.max(np.abs(x - y), initial=0.0) <= 1e-3 * max(1.0, float(np.max(np.abs(y), initial=0.0)))


async def test_cpu_thinker_ignores_the_setting(engine, monkeypatch):
    from duplexkit.engine import DuplexEngine
    from duplexkit.engine.minicpmo45 import MiniCPMO45Stages

    monkeypatch.setenv(ENV_VAR, "1")
    st = MiniCPMO45Stages(engine.model)
    assert st.thinker_stream is None
    with st.stage_scope("thinker"):  # a no-op on the CPU
        pass
    flagged = DuplexEngine(engine.model, "cpu")
    try:
        assert flagged.stages.thinker_stream is None
        on = await _speak(flagged, [0], 2)
    finally:
        await flagged.aclose()
    off = await _speak(engine, [0], 2)
    assert _split(on[0])[0] == _split(off[0])[0] and any(x[0] == "audio" for x in _split(on[0])[0])
    for x, y in zip(_split(on[0])[1], _split(off[0])[1]):
        assert np.array_equal(x, y)


@pytest.fixture(scope="module")
def cuda_model():
    """The tiny checkpoint on cuda:0 loaded by an engine with the thinker stream on (its start-up
    warm-up captures the thinker's graphs from that stream); yields (engine, capture streams)."""
    pytest.importorskip("stepaudio2")
    from duplexkit.engine import DuplexEngine
    from duplexkit.models.minicpmo45 import fast_thinker

    seen = []
    real = fast_thinker.capture_graph

    def recording(fn, device, **kw):
        seen.append(torch.cuda.current_stream(device))
        return real(fn, device, **kw)

    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "1"
    fast_thinker.capture_graph = recording
    try:
        eng = DuplexEngine.from_pretrained("tiny", layout="1gpu", progress=False)
    finally:
        fast_thinker.capture_graph = real
        if old is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = old
    yield eng, seen
    asyncio.run(eng.aclose())


@needs_cuda
async def test_thinker_runs_on_its_own_stream_with_the_same_outputs(cuda_model, monkeypatch):
    from duplexkit.engine import DuplexEngine

    on_engine, captured_on = cuda_model
    model = on_engine.model
    dev = model.thinker.device
    th_stream = on_engine.stages.thinker_stream
    assert th_stream is not None and th_stream != torch.cuda.default_stream(dev)
    assert th_stream.priority == torch.cuda.Stream.priority_range()[1]
    assert hasattr(model.thinker, "stats") and model.thinker.stats["graph_captures"] > 0
    assert captured_on and all(s == th_stream for s in captured_on)  # warm-up captures from the thinker stream

    where = {"thinker": [], "talker": []}
    step, gen = model.thinker.step_units, model.talker.generate_units

    def thinker_step(items):
        where["thinker"].append(torch.cuda.current_stream(dev))
        return step(items)

    def talker_step(items):
        where["talker"].append(torch.cuda.current_stream(dev))
        return gen(items)

    monkeypatch.setattr(model.thinker, "step_units", thinker_step)
    monkeypatch.setattr(model.talker, "generate_units", talker_step)
    steps0 = model.thinker.stats["decode_steps"]
    # three streams at once: batched thinker steps, hand-overs to the talker while the thinker goes on
    together = await _speak(on_engine, [0, 1, 2], 3)
    assert model.thinker.stats["decode_steps"] > steps0
    for outs in together:
        said, audio = _split(outs)
        assert not any(x[0] == "failure" for x in said) and audio and all(np.isfinite(a).all() for a in audio)
    assert max(o.timings.get("thinker_batch", 1) for outs in together for o in outs
               if isinstance(o, UnitTimings)) >= 2, "the thinker never served two streams in one step"
    assert where["thinker"] and all(s == th_stream for s in where["thinker"])
    assert where["talker"] and all(s == torch.cuda.default_stream(dev) for s in where["talker"])
    # one stream at a time (the same batch buckets in both engines): compared with the flag off below
    on = [(await _speak(on_engine, [k], 3))[0] for k in range(2)]
    on_engine.chat_max_codes = 50
    req = ChatRequest(messages=[ChatMessage("user", ["Say something short."])], output_audio=True, max_tokens=6, seed=3)
    chat_on = await on_engine.generate(req)

    torch.cuda.synchronize()  # the same model now serves from the default stream: the thinker stream's work is done
    monkeypatch.delenv(ENV_VAR, raising=False)
    off_engine = DuplexEngine(model, "1gpu")
    try:
        assert off_engine.stages.thinker_stream is None
        off_engine.warmup()  # the vocoder's cuDNN plans for this engine's threads (the graphs exist)
        where["thinker"].clear()
        off = [(await _speak(off_engine, [k], 3))[0] for k in range(2)]
        assert where["thinker"] and all(s == torch.cuda.default_stream(dev) for s in where["thinker"])
        off_engine.chat_max_codes = 50
        chat_off = await off_engine.generate(req)
    finally:
        await off_engine.aclose()
    for k in range(2):
        said_on, audio_on = _split(on[k])
        said_off, audio_off = _split(off[k])
        assert not any(x[0] == "failure" for x in said_on)
        assert said_on == said_off, f"stream {k}: decisions or text differ with the thinker stream"
        assert any(x[0] == "audio" for x in said_on)
        _assert_same_audio(audio_on, audio_off)
    assert (chat_on.text, chat_on.completion_tokens) == (chat_off.text, chat_off.completion_tokens)
    assert chat_on.audio is not None and chat_off.audio is not None
    _assert_same_audio([chat_on.audio], [chat_off.audio])
