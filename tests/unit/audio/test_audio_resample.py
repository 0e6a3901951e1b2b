from __future__ import annotations

import numpy as np
import pytest
import soxr
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexkit.audio import StreamResampler, read_wav
from duplexkit.audio.resample import expected_output_samples, resample

RATES = [8000, 11025, 16000, 22050, 24000, 44100, 48000]


def _chunks(x: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    out, i, k = [], 0, 0
    while i < x.size:
        n = sizes[k % len(sizes)] if sizes else x.size
        out.append(x[i : i + n])
        i += n
        k += 1
    return out


def _run(rs: StreamResampler, parts: list[np.ndarray]) -> np.ndarray:
    outs = [rs.process(p) for p in parts] + [rs.flush()]
    return np.concatenate(outs)


@settings(max_examples=50, deadline=None)
@given(
    in_rate=st.sampled_from(RATES),
    out_rate=st.sampled_from(RATES),
    n=st.integers(0, 6000),
    sizes=st.lists(st.integers(1, 1500), min_size=1, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_exact_counts_and_same_as_one_shot(in_rate, out_rate, n, sizes, seed):
    x = (np.random.default_rng(seed).standard_normal(n) * 0.2).astype(np.float32)
    rs = StreamResampler(in_rate, out_rate)
    y = _run(rs, _chunks(x, sizes))
    assert y.dtype == np.float32
    assert y.size == expected_output_samples(n, in_rate, out_rate)
    ref = resample(x, in_rate, out_rate)
    assert ref.size == y.size
    np.testing.assert_allclose(y, ref, atol=1e-5)


def test_expected_count_matches_soxr_one_shot():
    for a in RATES:
        for b in RATES:
            for n in (1, 2, 3, 7, 480, 12345):
                x = np.ones(n, np.float32)
                want = n if a == b else soxr.resample(x, a, b).shape[0]
                assert expected_output_samples(n, a, b) == want


def test_identity_and_reuse_after_flush():
    rs = StreamResampler(16000, 16000)
    x = np.arange(10, dtype=np.float32) / 10
    np.testing.assert_array_equal(rs.process(x), x)
    assert rs.flush().size == 0
    rs = StreamResampler(24000, 16000)
    x = np.sin(np.arange(2400) * 0.05).astype(np.float32)
    a = _run(rs, [x])
    b = _run(rs, [x])  # flush resets: a second stream gives the same output
    np.testing.assert_array_equal(a, b)


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        StreamResampler(0, 16000)
    with pytest.raises(ValueError):
        StreamResampler(24000, 16000).process(np.zeros((2, 10), np.float32))


def _freq(y: np.ndarray, rate: int) -> float:
    w = np.hanning(y.size)
    spec = np.abs(np.fft.rfft(y * w, n=8 * y.size))
    k = int(np.argmax(spec))
    # parabolic interpolation on the log spectrum
    a, b, c = np.log(spec[k - 1 : k + 2] + 1e-12)
    k = k + 0.5 * (a - c) / (a - 2 * b + c)
    return k * rate / (8 * y.size)


@settings(max_examples=15, deadline=None)
@given(
    pair=st.sampled_from([(24000, 16000), (48000, 16000), (8000, 16000), (44100, 16000), (16000, 24000)]),
    f0=st.floats(150.0, 3000.0),
    sizes=st.lists(st.integers(1, 997), min_size=1, max_size=6),
)
def test_sine_keeps_frequency_and_has_no_seam(pair, f0, sizes):
    in_rate, out_rate = pair
    n = in_rate  # 1 s
    t = np.arange(n) / in_rate
    x = (0.5 * np.sin(2 * np.pi * f0 * t)).astype(np.float32)
    y = _run(StreamResampler(in_rate, out_rate), _chunks(x, sizes))
    assert y.size == expected_output_samples(n, in_rate, out_rate)
    mid = y[out_rate // 10 : -out_rate // 10]  # skip filter edges
    assert abs(_freq(mid, out_rate) - f0) / f0 < 0.01
    # no seam discontinuity: compare with the ideal sine at the output rate everywhere
    tt = np.arange(y.size) / out_rate
    ideal = 0.5 * np.sin(2 * np.pi * f0 * tt)
    err = np.abs(y - ideal)[out_rate // 20 : -out_rate // 20]
    assert err.max() < 5e-3
    # the largest sample-to-sample step is bounded by the sine's own slope
    steps = np.abs(np.diff(mid))
    assert steps.max() <= 0.5 * 2 * np.pi * f0 / out_rate * 1.05 + 1e-3


def test_real_speech_chunked_24k_to_16k(fixtures_dir):
    x24, _ = read_wav(fixtures_dir / "question_16k.wav", 24000)
    y = _run(StreamResampler(24000, 16000), _chunks(x24, [480, 481, 7, 2400]))
    ref = resample(x24, 24000, 16000)
    np.testing.assert_allclose(y, ref, atol=1e-5)
    x16, _ = read_wav(fixtures_dir / "question_16k.wav")
    assert abs(y.size - x16.size) <= 1
