from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexkit.audio import StreamingVAD, VadConfig, VadEvent, read_wav


SR = 16000
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "audio"
# Speech onset / offset in seconds from tests/fixtures/audio/README.md ("10 ms RMS > 300").
ONSETS = {
    "question_16k.wav": (0.30, 2.55),
    "interrupt_16k.wav": (0.30, 3.07),
    "long_question_16k.wav": (0.34, 5.07),
    "ref_voice_16k.wav": (0.33, 5.03),
}


def run(vad: StreamingVAD, x: np.ndarray, chunk: int | list[int] = 320) -> list[VadEvent]:
    sizes = [chunk] if isinstance(chunk, int) else chunk
    out, i, k = [], 0, 0
    while i < x.size:
        n = sizes[k % len(sizes)]
        out += vad.process(x[i : i + n])
        i += n
        k += 1
    return out


def _tail(ms: int = 1500) -> np.ndarray:
    return np.zeros(SR * ms // 1000, np.float32)


@pytest.mark.parametrize("name", sorted(ONSETS))
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.9])
def test_real_speech_onset_and_offset(fixtures_dir, name, threshold):
    x, _ = read_wav(fixtures_dir / name)
    onset, offset = ONSETS[name]
    ev = run(StreamingVAD(VadConfig(threshold=threshold)), np.concatenate([x, _tail()]))
    kinds = [e.kind for e in ev]
    assert kinds == ["speech_started", "speech_stopped"], ev
    start, stop = ev
    assert abs(start.audio_ms - onset * 1000) <= 100
    assert abs(stop.audio_ms - offset * 1000) <= 150
    assert start.audio_start_ms == max(0, start.audio_ms - 300)
    assert stop.audio_start_ms == start.audio_start_ms


def test_onset_in_a_longer_stream_and_sample_accuracy(fixtures_dir):
    x, _ = read_wav(fixtures_dir / "question_16k.wav")
    lead = 2.0 + 7 / SR  # an offset that is not a whole frame or ms
    sig = np.concatenate([np.zeros(int(lead * SR), np.float32), x, _tail()])
    ev = run(StreamingVAD(), sig, chunk=[333, 17, 1000])
    assert [e.kind for e in ev] == ["speech_started", "speech_stopped"]
    true_onset_ms = (int(lead * SR) / SR + 0.30) * 1000
    assert abs(ev[0].audio_ms - true_onset_ms) <= 100
    assert ev[0].audio_ms == ev[0].sample * 1000 // SR  # ms derived from the sample index


def test_two_utterances(fixtures_dir):
    q, _ = read_wav(fixtures_dir / "question_16k.wav")
    i, _ = read_wav(fixtures_dir / "interrupt_16k.wav")
    sig = np.concatenate([q, _tail(1000), i, _tail()])
    ev = run(StreamingVAD(), sig)
    assert [e.kind for e in ev] == ["speech_started", "speech_stopped"] * 2
    second = (q.size + SR) / SR + 0.30
    assert abs(ev[2].audio_ms - second * 1000) <= 100


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=6))
def test_events_do_not_depend_on_chunking(sizes):
    x, _ = read_wav(_fixture("interrupt_16k.wav"))
    sig = np.concatenate([x, _tail()])
    ref = run(StreamingVAD(), sig, chunk=SR)
    got = run(StreamingVAD(), sig, chunk=sizes)
    assert [(e.kind, e.audio_ms, e.audio_start_ms, e.sample) for e in got] == [
        (e.kind, e.audio_ms, e.audio_start_ms, e.sample) for e in ref
    ]


def _fixture(name: str):
    p = FIXTURES / name
    if not p.exists():
        pytest.skip(f"speech fixture missing: {p}")
    return p


def _white(level: float, seconds: float = 4.0, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * SR)) * level).astype(np.float32)


def _tone(freq: float, amp: float, seconds: float = 4.0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0])
@pytest.mark.parametrize(
    "kind,sig",
    [
        ("silence", np.zeros(4 * SR, np.float32)),
        ("white 0.02", _white(0.02)),
        ("white 0.1", _white(0.1, seed=1)),
        ("white 0.3", _white(0.3, seed=2)),
        ("tone 440 Hz 0.05", _tone(440, 0.05)),
        ("tone 440 Hz 0.3", _tone(440, 0.3)),
        ("tone 440 Hz 0.9", _tone(440, 0.9)),
        ("tone 1 kHz 0.5", _tone(1000, 0.5)),
    ],
)
def test_no_start_on_non_speech(kind, sig, threshold):
    vad = StreamingVAD(VadConfig(threshold=threshold))
    assert run(vad, sig) == []
    assert not vad.speaking


def test_guards_are_what_reject_noise_and_tone():
    # webrtcvad alone calls loud white noise and a 440 Hz tone speech; the guards must veto it.
    vad = StreamingVAD()
    n = vad.cfg.frame_samples
    for sig, guard in ((_white(0.1), "noise"), (_tone(440, 0.3), "tone")):
        decisions = [vad.classify_frame(sig[i : i + n]) for i in range(0, 50 * n, n)]
        assert np.mean([d.webrtc for d in decisions]) > 0.8
        assert np.mean([getattr(d, guard) for d in decisions]) > 0.95
        assert not any(d.speech for d in decisions)


def test_speech_in_noise_still_starts(fixtures_dir):
    x, _ = read_wav(fixtures_dir / "question_16k.wav")
    sig = np.concatenate([x, _tail()])
    sig = sig + _white(0.003, sig.size / SR, seed=5)[: sig.size]  # about -50 dBFS background
    ev = run(StreamingVAD(), sig)
    assert ev and ev[0].kind == "speech_started"
    assert abs(ev[0].audio_ms - 300) <= 100


def test_preroll_audio_and_padding(fixtures_dir):
    x, _ = read_wav(fixtures_dir / "question_16k.wav")
    sig = np.concatenate([np.zeros(SR, np.float32), x])  # onset at 1.30 s
    for prefix, eff in ((0, 300), (300, 300), (800, 800)):
        vad = StreamingVAD(VadConfig(prefix_padding_ms=prefix))
        ev, fed = [], 0
        for i in range(0, sig.size, 320):
            out = vad.process(sig[i : i + 320])
            fed = i + 320
            if out:
                ev = out
                break
        start = ev[0]
        assert start.kind == "speech_started"
        assert start.audio_start_ms == start.audio_ms - eff
        a0 = start.audio_start_ms * SR // 1000
        np.testing.assert_array_equal(start.audio, sig[a0:fed])  # pre-roll kept, nothing lost
        assert start.audio.size >= eff * SR // 1000


def test_hangover_short_gap_keeps_speaking(fixtures_dir):
    x, _ = read_wav(fixtures_dir / "question_16k.wav")
    speech = x[int(0.3 * SR) : int(2.5 * SR)]
    gap = np.zeros(int(0.3 * SR), np.float32)
    sig = np.concatenate([speech, gap, speech, _tail()])
    ev = run(StreamingVAD(VadConfig(silence_duration_ms=500)), sig)
    assert [e.kind for e in ev] == ["speech_started", "speech_stopped"]
    ev = run(StreamingVAD(VadConfig(silence_duration_ms=200)), sig)
    assert [e.kind for e in ev] == ["speech_started", "speech_stopped"] * 2


def test_stop_is_emitted_after_silence_duration(fixtures_dir):
    x, _ = read_wav(fixtures_dir / "question_16k.wav")
    vad = StreamingVAD(VadConfig(silence_duration_ms=700))
    sig = np.concatenate([x, _tail(2000)])
    for i in range(0, sig.size, 320):
        for e in vad.process(sig[i : i + 320]):
            if e.kind == "speech_stopped":
                emitted_ms = (i + 320) * 1000 // SR
                assert 700 <= emitted_ms - e.audio_ms <= 700 + 2 * vad.cfg.frame_ms
                return
    pytest.fail("no speech_stopped")


def test_threshold_mapping_and_validation():
    assert [VadConfig(threshold=t).mode for t in (0.0, 0.3, 0.5, 0.8, 1.0)] == [0, 1, 2, 3, 3]
    c = VadConfig()
    assert c.confirm_frames == 5 and c.confirm_needed == 4 and c.floor_dbfs == -50.0
    assert VadConfig(threshold=1.0).confirm_needed == 5
    assert VadConfig(threshold=0.0).confirm_needed == 3
    assert VadConfig(prefix_padding_ms=100).preroll_ms == 300
    for bad in (dict(threshold=1.5), dict(prefix_padding_ms=2001), dict(silence_duration_ms=50),
                dict(sample_rate=22050), dict(frame_ms=25), dict(threshold=float("nan"))):
        with pytest.raises(ValueError):
            VadConfig(**bad)
    with pytest.raises(ValueError):
        StreamingVAD().process(np.array([np.nan], np.float32))


@pytest.mark.parametrize("rate,frame_ms", [(8000, 10), (16000, 30), (48000, 20)])
def test_other_rates_and_frames(fixtures_dir, rate, frame_ms):
    x, _ = read_wav(fixtures_dir / "question_16k.wav", rate)
    sig = np.concatenate([x, np.zeros(rate, np.float32)])
    vad = StreamingVAD(VadConfig(sample_rate=rate, frame_ms=frame_ms))
    ev = run(vad, sig, chunk=rate // 50)
    assert [e.kind for e in ev] == ["speech_started", "speech_stopped"]
    assert abs(ev[0].audio_ms - 300) <= 100


def test_reset_restarts_the_clock(fixtures_dir):
    x, _ = read_wav(fixtures_dir / "question_16k.wav")
    vad = StreamingVAD()
    run(vad, x[: SR])
    assert vad.speaking
    vad.reset()
    assert not vad.speaking and vad.position_ms == 0
    ev = run(vad, np.concatenate([x, _tail()]))
    assert abs(ev[0].audio_ms - 300) <= 100


def test_without_guards_webrtcvad_would_start_on_noise_and_tone():
    # the control for test_no_start_on_non_speech: switching the guards off makes it start
    off = VadConfig(max_flatness=1.0, max_tone_concentration=1.0)
    assert [e.kind for e in run(StreamingVAD(off), _white(0.1))][:1] == ["speech_started"]
    assert [e.kind for e in run(StreamingVAD(off), _tone(440, 0.3))][:1] == ["speech_started"]
