"""DuplexEngine on the tiny random-weight checkpoint (CPU), fed the real speech fixtures.

ONE engine for the whole test process (the session fixture ``engine`` of tests/engine/conftest.py, shared
with the contract suite): each Code2Wav flow costs ~2.24 GB
(docs/model.md §7.5). Assertions are in units and epochs, never wall-clock. The tiny model has random
weights, so turns are started with ForceSpeak and ended by cancel (it rarely emits <|turn_eos|>).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import io
import os
import weakref
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # docs/model.md §7.5: before stepaudio2 is imported
pytest.importorskip("torch")
pytest.importorskip("stepaudio2")

from duplexkit.audio import UnitFramer, read_wav, wav_bytes  # noqa: E402
from duplexkit.engine.api import (  # noqa: E402
    AppendUnit, AudioChunk, CancelEpoch, ChatMessage, ChatRequest, Decision, EngineFailure, ForceSpeak,
    ReferenceVoice, StreamConfig, TextDelta, UnitTimings, UpdateStream,
)
from duplexkit.testing import inject_fault  # noqa: E402

pytestmark = pytest.mark.engine

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
WAVS = ["question_16k.wav", "interrupt_16k.wav", "long_question_16k.wav", "ref_voice_16k.wav"]


def _need_fixtures() -> None:
    missing = [w for w in WAVS if not (FIX / w).is_file()]
    if missing:
        pytest.skip(f"speech fixtures missing in {FIX}: {missing}")


def speech_units(name: str, n: int) -> list:
    """The first ``n`` duplex units of a fixture WAV (UnitFramer; silence-padded)."""
    audio, _ = read_wav(FIX / name, rate=16000)
    framer = UnitFramer()
    units = [u.audio for u in framer.push(audio)]
    last = framer.flush()
    if last is not None:
        units.append(last.audio)
    while len(units) < n:
        units.append(np.zeros(16560 if not units else 16000, np.float32))
    return units[:n]


def voice(name: str, seconds: float = 3.0) -> ReferenceVoice:
    audio, _ = read_wav(FIX / name, rate=16000)
    audio = np.ascontiguousarray(audio[: int(seconds * 10) * 1600], dtype=np.float32)
    return ReferenceVoice(audio=audio, sha256=hashlib.sha256(audio.tobytes()).hexdigest())


async def collect(stream, until) -> list:
    outs: list = []
    async for o in stream.outputs():
        outs.append(o)
        if until(outs):
            break
    return outs


def units_done(n: int):
    return lambda outs: sum(isinstance(o, UnitTimings) for o in outs) >= n


def signature(outs: list) -> list:
    """What a stream heard, without timings: comparable across runs."""
    sig = []
    for o in outs:
        if isinstance(o, Decision):
            sig.append(("decision", o.unit_index, o.decision, o.turn_start))
        elif isinstance(o, TextDelta):
            sig.append(("text", o.unit_index, o.text, o.n_tokens))
        elif isinstance(o, AudioChunk):
            sig.append(("audio", o.unit_index, o.text, o.final, hashlib.sha256(o.audio.tobytes()).hexdigest()))
        elif not isinstance(o, UnitTimings):
            sig.append((type(o).__name__, o.unit_index))
    return sig


async def run_speaking(engine, sid: str, cfg: StreamConfig, units: list) -> list:
    s = await engine.open_stream(sid, cfg)
    s.submit(ForceSpeak(sid, 0))
    for i, u in enumerate(units):
        s.submit(AppendUnit(sid, 0, unit_index=i, audio=u))
    outs = await collect(s, units_done(len(units)))
    await s.aclose()
    return outs


async def test_four_streams_no_crosstalk_and_same_as_alone(engine):
    _need_fixtures()
    n = 3
    cfgs = [StreamConfig(instructions=f"You are assistant number {k}.", ref_voice=voice(WAVS[(k + 1) % 4]),
                         seed=100 + k) for k in range(4)]
    inputs = [speech_units(w, n) for w in WAVS]
    streams = await asyncio.gather(*[engine.open_stream(f"s{k}", cfgs[k]) for k in range(4)])
    for k, s in enumerate(streams):
        s.submit(ForceSpeak(f"s{k}", 0))
    for i in range(n):  # unit by unit, all four streams
        for k, s in enumerate(streams):
            s.submit(AppendUnit(f"s{k}", 0, unit_index=i, audio=inputs[k][i]))
    together = await asyncio.gather(*[collect(s, units_done(n)) for s in streams])
    for s in streams:
        await s.aclose()
    alone = [await run_speaking(engine, f"alone{k}", cfgs[k], inputs[k]) for k in range(4)]
    batched = 0
    for k in range(4):
        outs = together[k]
        assert {o.stream_id for o in outs} == {f"s{k}"}
        assert {o.epoch for o in outs} == {0}
        decisions = [o for o in outs if isinstance(o, Decision)]
        assert [d.unit_index for d in decisions] == list(range(n))
        assert decisions[0].decision == "speak" and decisions[0].turn_start
        chunks = [o for o in outs if isinstance(o, AudioChunk)]
        sizes = [len(c.audio) for c in chunks if not c.final]
        assert sizes and sizes[0] == 20160 and all(x == 24000 for x in sizes[1:])  # docs/model.md §7.3
        assert all(c.audio.dtype == np.float32 and np.isfinite(c.audio).all() for c in chunks)
        # the audio carries the transcript of the units it voices, append-only and in order
        spoken = "".join(o.text for o in outs if isinstance(o, TextDelta))
        assert spoken.startswith("".join(c.text for c in chunks))
        # outputs strictly unit by unit
        assert [o.unit_index for o in outs] == sorted(o.unit_index for o in outs)
        # each stream alone (same seed, voice, input) hears exactly the same thing
        assert signature(outs) == signature(alone[k]), f"stream {k} differs when run with others"
        batched = max(batched, max(o.timings.get("thinker_batch", 1) for o in outs if isinstance(o, UnitTimings)))
    # the streams really differed (distinct voices/instructions/seeds)
    assert len({tuple(signature(o)) for o in together}) == 4
    assert batched >= 2, "the thinker never served two streams in one step"
    assert engine.num_streams == 0


async def test_cancel_one_stream_mid_turn_others_continue(engine):
    _need_fixtures()
    ua, ub = speech_units("long_question_16k.wav", 6), speech_units("question_16k.wav", 6)
    a = await engine.open_stream("ca", StreamConfig(ref_voice=voice("ref_voice_16k.wav"), seed=7))
    b = await engine.open_stream("cb", StreamConfig(ref_voice=voice("question_16k.wav"), seed=8))
    for s, sid, u in ((a, "ca", ua), (b, "cb", ub)):
        s.submit(ForceSpeak(sid, 0))
        for i in range(2):
            s.submit(AppendUnit(sid, 0, unit_index=i, audio=u[i]))
    before = await collect(a, lambda o: any(isinstance(x, AudioChunk) for x in o))
    a.submit(CancelEpoch("ca", 1))  # barge-in: units 0 and 1 were submitted in epoch 0
    for i in range(2, 5):
        a.submit(AppendUnit("ca", 1, unit_index=i, audio=ua[i], force_listen=True))
        b.submit(AppendUnit("cb", 0, unit_index=i, audio=ub[i]))
    after_a, outs_b = await asyncio.gather(
        collect(a, lambda o: any(isinstance(x, UnitTimings) and x.unit_index == 4 for x in o)),
        collect(b, units_done(5)),
    )
    old = [o for o in after_a if o.epoch == 0]
    assert all(o.unit_index <= 1 for o in old)  # nothing of epoch 0 beyond the unit in flight
    assert sum(isinstance(o, AudioChunk) for o in old) <= 1  # audio stops within one unit
    new = [o for o in after_a if o.epoch == 1]
    assert [o.decision for o in new if isinstance(o, Decision)] == ["listen"] * 3
    assert not any(isinstance(o, AudioChunk) for o in new)
    assert not any(isinstance(o, EngineFailure) for o in before + after_a + outs_b)
    # the other stream kept speaking through and after the cancel
    assert {o.unit_index for o in outs_b if isinstance(o, AudioChunk)} >= {2, 3, 4}
    assert {o.epoch for o in outs_b} == {0}
    # the cancelled stream's model turn is over: ForceSpeak in epoch 1 opens a fresh turn with audio
    a.submit(ForceSpeak("ca", 1))
    a.submit(AppendUnit("ca", 1, unit_index=5, audio=ua[5]))
    more = await collect(a, units_done(1))
    d = [o for o in more if isinstance(o, Decision)][0]
    assert (d.decision, d.turn_start, d.epoch) == ("speak", True, 1)
    chunk = [o for o in more if isinstance(o, AudioChunk)][0]
    assert len(chunk.audio) == 20160  # the vocoder restarted the turn (first chunk again)
    await a.aclose()
    await b.aclose()


async def test_fault_in_one_stream_leaves_the_others_working(engine):
    _need_fixtures()
    ua, ub = speech_units("interrupt_16k.wav", 3), speech_units("question_16k.wav", 3)
    a = await engine.open_stream("fa", StreamConfig(seed=1))
    b = await engine.open_stream("fb", StreamConfig(seed=2))
    inject_fault(a, "talker")
    for s, sid, u in ((a, "fa", ua), (b, "fb", ub)):
        s.submit(ForceSpeak(sid, 0))
        for i in range(2):
            s.submit(AppendUnit(sid, 0, unit_index=i, audio=u[i]))
    outs_a = await collect(a, units_done(2))
    errs = [o for o in outs_a if isinstance(o, EngineFailure)]
    # a talker failure costs the turn, not the stream (docs/protocol.md §9)
    assert len(errs) == 1 and not errs[0].fatal and errs[0].code == "server_error" and "talker" in errs[0].message
    outs_b = await collect(b, units_done(2))
    assert not any(isinstance(o, EngineFailure) for o in outs_b)
    assert sum(isinstance(o, AudioChunk) for o in outs_b) >= 1
    # what the Session does after a failed response: new epoch, the stream answers again
    a.submit(CancelEpoch("fa", 1))
    a.submit(ForceSpeak("fa", 1))
    a.submit(AppendUnit("fa", 1, unit_index=2, audio=ua[2]))
    b.submit(AppendUnit("fb", 0, unit_index=2, audio=ub[2]))
    more_a = await collect(a, units_done(1))
    assert [o.decision for o in more_a if isinstance(o, Decision)] == ["speak"]
    assert not any(isinstance(o, EngineFailure) for o in more_a)
    more = await collect(b, units_done(1))
    assert [o.decision for o in more if isinstance(o, Decision)] == ["speak"]
    await a.aclose()
    await b.aclose()
    # a new stream works too
    c = await engine.open_stream("fc", StreamConfig(seed=3))
    c.submit(AppendUnit("fc", 0, unit_index=0, audio=ua[0], force_listen=True))
    outs_c = await collect(c, units_done(1))
    assert [o.decision for o in outs_c if isinstance(o, Decision)] == ["listen"]
    await c.aclose()
    assert engine.num_streams == 0


async def test_update_rebuilds_prefix_and_voice(engine):
    _need_fixtures()
    u = speech_units("question_16k.wav", 2)
    s = await engine.open_stream("up", StreamConfig(instructions="First.", ref_voice=voice("ref_voice_16k.wav"), seed=3))
    s.submit(AppendUnit("up", 0, unit_index=0, audio=u[0], force_listen=True))
    await collect(s, units_done(1))
    th, c2w = s._st.handles["thinker"], s._st.handles["code2wav"]
    s.submit(UpdateStream("up", 0, config=StreamConfig(instructions="Second.", ref_voice=voice("interrupt_16k.wav"),
                                                       seed=3)))
    s.submit(ForceSpeak("up", 0))
    s.submit(AppendUnit("up", 0, unit_index=1, audio=u[1]))
    outs = await collect(s, units_done(1))
    assert [o.decision for o in outs if isinstance(o, Decision)] == ["speak"]
    assert [len(o.audio) for o in outs if isinstance(o, AudioChunk)] == [20160]
    assert s._st.handles["thinker"] is not th and s._st.handles["code2wav"] is not c2w  # rebuilt from the new prefix / voice
    await s.aclose()


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def test_open_close_100_streams_returns_memory(engine):
    _need_fixtures()
    units = speech_units("question_16k.wav", 1)
    voices = [voice("ref_voice_16k.wav"), voice("interrupt_16k.wav")]

    async def cycle(k: int):
        sid = f"m{k}"
        s = await engine.open_stream(sid, StreamConfig(ref_voice=voices[k % 2], seed=k))
        refs = [weakref.ref(s._st.handles["thinker"]), weakref.ref(s._st.handles["code2wav"])]
        speak = k % 25 == 0
        if speak:
            s.submit(ForceSpeak(sid, 0))
        s.submit(AppendUnit(sid, 0, unit_index=0, audio=units[0], force_listen=not speak))
        await collect(s, units_done(1))
        await s.aclose()
        return refs

    for k in range(10):  # warm-up: allocator pools, voice caches
        await cycle(k)
    gc.collect()
    base = _rss_kb()
    refs = []
    for k in range(100):
        refs += await cycle(k)
    gc.collect()
    after = _rss_kb()
    assert engine.num_streams == 0
    assert all(r() is None for r in refs), "a closed stream's thinker or vocoder state is still referenced"
    assert after <= base * 1.05, f"RSS grew from {base} kB to {after} kB over 100 streams"


@pytest.fixture
def short_replies(engine):
    """Random talker weights rarely sample EOS: cap turn-based audio at 100 codes (4 s)."""
    old = engine.chat_max_codes
    engine.chat_max_codes = 100
    yield engine
    engine.chat_max_codes = old


async def test_generate_text_prompt_streamed_and_whole(short_replies):
    engine = short_replies
    sf = pytest.importorskip("soundfile")
    req = ChatRequest(messages=[ChatMessage("user", ["What is the weather like today in Paris?"])],
                      output_audio=True, max_tokens=12, seed=5)
    deltas = [d async for d in engine.generate_stream(req)]
    res = await engine.generate(req)
    assert isinstance(res.text, str) and res.text
    assert res.finish_reason in ("stop", "length") and res.prompt_tokens > 0 and 0 < res.completion_tokens <= 12
    assert res.audio is not None and res.audio.dtype == np.float32 and res.audio.ndim == 1 and res.audio.size > 0
    # streamed pieces add up to the whole result (same seed)
    assert "".join(d.text for d in deltas) == res.text
    streamed = np.concatenate([d.audio for d in deltas if d.audio is not None])
    assert np.array_equal(streamed, res.audio)
    data, rate = sf.read(io.BytesIO(wav_bytes(res.audio, 24000)), dtype="float32")
    assert rate == 24000 and len(data) == len(res.audio)
    text_only = await engine.generate(ChatRequest(messages=req.messages, output_audio=False, max_tokens=4, seed=5))
    assert text_only.audio is None and text_only.text


async def test_generate_audio_prompt(short_replies):
    engine = short_replies
    _need_fixtures()
    audio, _ = read_wav(FIX / "question_16k.wav", rate=16000)
    req = ChatRequest(messages=[ChatMessage("user", [audio])], output_audio=True, max_tokens=8, seed=1,
                      ref_voice=voice("ref_voice_16k.wav"))
    res = await engine.generate(req)
    assert res.text and res.prompt_tokens > 30  # 3.5 s of audio = ~35 audio embeddings (docs/model.md §3.1)
    assert res.audio is not None and res.audio.size > 0 and np.isfinite(res.audio).all()
    assert res.audio.size <= (100 + 3) * 960 + 3840  # the code cap holds (docs/model.md §7.1 flush sizes)
