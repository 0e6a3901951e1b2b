from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from duplexkit.audio import AudioFormatError, read_wav, wav_bytes, write_wav
from duplexkit.audio.resample import resample


def test_read_fixture(fixtures_dir):
    x, sr = read_wav(fixtures_dir / "question_16k.wav")
    assert sr == 16000 and x.dtype == np.float32 and x.ndim == 1
    assert abs(x.size / sr - 3.54) < 0.01
    assert np.abs(x).max() > 0.05


@pytest.mark.parametrize("subtype,fmt", [("PCM_16", "WAV"), ("PCM_24", "WAV"), ("FLOAT", "WAV"),
                                         ("PCM_U8", "WAV"), ("PCM_16", "FLAC")])
@pytest.mark.parametrize("rate,channels", [(8000, 1), (44100, 2), (48000, 2), (22050, 1)])
def test_any_format_to_mono_16k(fixtures_dir, subtype, fmt, rate, channels, tmp_path):
    x16, _ = read_wav(fixtures_dir / "question_16k.wav")
    x, _ = read_wav(fixtures_dir / "question_16k.wav", rate)
    data = np.stack([x] * channels, axis=1) if channels > 1 else x
    p = tmp_path / f"a.{fmt.lower()}"
    sf.write(str(p), data, rate, subtype=subtype, format=fmt)
    ref = resample(x, rate, 16000)  # what an exact reader must return
    tol = 0.15 if subtype == "PCM_U8" else 1e-3  # relative RMS error: 8-bit quantisation vs ~none
    for src in (p, str(p), p.read_bytes(), io.BytesIO(p.read_bytes())):
        y, sr = read_wav(src, 16000)
        assert sr == 16000 and y.dtype == np.float32 and y.ndim == 1
        assert y.size == ref.size and abs(y.size - x16.size) <= 2
        err = np.sqrt(np.mean((y - ref) ** 2)) / np.sqrt(np.mean(ref**2))
        assert err < tol, err
        assert np.abs(y).max() <= 1.0


def test_stereo_downmix(tmp_path):
    t = np.arange(1600) / 16000
    left = 0.5 * np.sin(2 * np.pi * 300 * t)
    right = -left
    p = tmp_path / "s.wav"
    sf.write(str(p), np.stack([left, right], 1), 16000, subtype="FLOAT")
    y, _ = read_wav(p)
    assert np.abs(y).max() < 1e-6  # opposite channels cancel: it was averaged, not read as mono


def test_write_roundtrip(tmp_path):
    x = (0.3 * np.sin(np.arange(4800) * 0.1)).astype(np.float32)
    p = tmp_path / "w.wav"
    write_wav(p, x, 24000)
    info = sf.info(str(p))
    assert info.samplerate == 24000 and info.channels == 1 and info.subtype == "PCM_16"
    y, sr = read_wav(p)
    assert sr == 24000 and np.abs(y - x).max() < 1e-4
    b = wav_bytes(x, 24000)
    assert b[:4] == b"RIFF" and b[8:12] == b"WAVE"
    y2, _ = read_wav(b)
    np.testing.assert_array_equal(y, y2)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_wav(tmp_path / "missing.wav")
    with pytest.raises(AudioFormatError) as ei:
        read_wav(b"this is not a wav file at all")
    assert ei.value.code == "bad_audio"
    with pytest.raises(AudioFormatError):
        wav_bytes(np.array([np.nan], np.float32), 16000)
    with pytest.raises(ValueError):
        wav_bytes(np.zeros((2, 3), np.float32), 16000)
