from __future__ import annotations

import base64
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexkit.audio import (
    AudioFormatError,
    InputFormat,
    StreamDecoder,
    b64decode_audio,
    b64encode_audio,
    float32_to_pcm16,
    pcm16_to_float32,
    read_wav,
)
from duplexkit.audio.codecs import (
    alaw_to_int16,
    float32_to_alaw,
    float32_to_f32le,
    float32_to_ulaw,
    ulaw_to_int16,
)


def test_pcm16_known_values():
    data = struct.pack("<4h", 0, 16384, -32768, 32767)
    x = pcm16_to_float32(data)
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x, np.array([0.0, 0.5, -1.0, 32767 / 32768], np.float32))


def test_pcm16_odd_length_raises_valueerror():
    with pytest.raises(ValueError):
        pcm16_to_float32(b"\x00\x01\x02")


def test_float32_to_pcm16_clips_and_rounds():
    b = float32_to_pcm16(np.array([2.0, -2.0, 0.5, 1e-5, -1e-5, 0.0], np.float32))
    assert struct.unpack("<6h", b) == (32767, -32767, 16384, 0, 0, 0)


def test_float32_to_pcm16_rejects_nan():
    with pytest.raises(AudioFormatError) as ei:
        float32_to_pcm16(np.array([0.0, np.nan], np.float32))
    assert ei.value.code == "bad_audio"


def test_pcm16_roundtrip_on_real_speech(fixtures_dir):
    x, _ = read_wav(fixtures_dir / "question_16k.wav")
    y = pcm16_to_float32(float32_to_pcm16(x))
    assert np.max(np.abs(y - x)) <= 1.0 / 32767 + 1e-7


def test_b64_roundtrip_and_errors():
    raw = bytes(range(256))
    s = b64encode_audio(raw)
    assert s == base64.b64encode(raw).decode()
    assert b64decode_audio(s) == raw
    assert b64decode_audio(s.encode()) == raw
    assert b64decode_audio("  " + s + "\n") == raw
    for bad in ["abc", "ab$c", "a===", "é", "AAAA AAAA"]:
        with pytest.raises(AudioFormatError) as ei:
            b64decode_audio(bad)
        assert ei.value.code == "bad_audio"
        assert isinstance(ei.value, ValueError)
    with pytest.raises(AudioFormatError):
        b64decode_audio(123)  # type: ignore[arg-type]


# --- G.711: ITU-T G.711 reference points -----------------------------------------------


def test_ulaw_reference_values():
    vals = ulaw_to_int16(bytes([0xFF, 0x7F, 0x00, 0x80, 0xFE, 0x7E]))
    assert vals.tolist() == [0, 0, -32124, 32124, 8, -8]


def test_alaw_reference_values():
    vals = alaw_to_int16(bytes([0xD5, 0x55, 0xAA, 0x2A]))
    assert vals.tolist() == [8, -8, 32256, -32256]


@pytest.mark.parametrize("enc,encode,decode", [
    ("ulaw", float32_to_ulaw, ulaw_to_int16),
    ("alaw", float32_to_alaw, alaw_to_int16),
])
def test_g711_all_codes_roundtrip(enc, encode, decode):
    codes = bytes(range(256))
    x = decode(codes).astype(np.float32) / 32767.0
    back = encode(x)
    # every code re-encodes to itself except the two zeros of mu-law (0x7F and 0xFF both decode to 0)
    same = np.frombuffer(back, np.uint8) == np.frombuffer(codes, np.uint8)
    bad = [i for i in range(256) if not same[i]]
    if enc == "ulaw":
        assert bad == [0x7F]
    else:
        assert bad == []


@pytest.mark.parametrize("encode,decode", [(float32_to_ulaw, ulaw_to_int16), (float32_to_alaw, alaw_to_int16)])
def test_g711_speech_snr(fixtures_dir, encode, decode):
    x, _ = read_wav(fixtures_dir / "question_16k.wav", 8000)
    y = decode(encode(x)).astype(np.float32) / 32768.0
    speech = np.abs(x) > 0.01
    snr = 10 * np.log10(np.sum(x[speech] ** 2) / np.sum((x[speech] - y[speech]) ** 2))
    assert snr > 30  # companding noise is ~38 dB below signal


def test_audioop_agreement_if_available():
    audioop = pytest.importorskip("audioop")
    codes = bytes(range(256))
    assert ulaw_to_int16(codes).astype("<i2").tobytes() == audioop.ulaw2lin(codes, 2)
    assert alaw_to_int16(codes).astype("<i2").tobytes() == audioop.alaw2lin(codes, 2)


# --- InputFormat -------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [
    dict(encoding="mp3", rate=16000),
    dict(encoding="pcm16", rate=7999),
    dict(encoding="pcm16", rate=48001),
    dict(encoding="g711_ulaw", rate=16000),
    dict(encoding="pcm16", rate=16000, channels=0),
    dict(encoding="pcm16", rate=16000.0),
])
def test_input_format_rejects(kw):
    with pytest.raises(AudioFormatError) as ei:
        InputFormat(**kw)
    assert ei.value.code == "unsupported_audio_format"


# --- StreamDecoder -----------------------------------------------------------------------


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    pts = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in pts + [len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


FORMATS = [
    InputFormat("pcm16", 24000),
    InputFormat("pcm_f32le", 16000),
    InputFormat("g711_ulaw", 8000),
    InputFormat("g711_alaw", 8000),
    InputFormat("pcm16", 16000, channels=2),
    InputFormat("pcm_f32le", 48000, channels=2),
]


def _encode(x: np.ndarray, fmt: InputFormat) -> bytes:
    return {
        "pcm16": float32_to_pcm16,
        "pcm_f32le": float32_to_f32le,
        "g711_ulaw": float32_to_ulaw,
        "g711_alaw": float32_to_alaw,
    }[fmt.encoding](x)


@settings(max_examples=60, deadline=None)
@given(
    fmt_i=st.integers(0, len(FORMATS) - 1),
    n=st.integers(0, 400),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_stream_decoder_any_chunking_equals_one_shot(fmt_i, n, cuts, seed):
    fmt = FORMATS[fmt_i]
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n * fmt.channels) * 0.3).astype(np.float32)
    data = _encode(x, fmt)
    ref = StreamDecoder(fmt).decode(data)
    dec = StreamDecoder(fmt)
    parts = [dec.decode(p) for p in _split(data, cuts)]
    got = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    assert dec.carried_bytes == 0
    assert got.dtype == np.float32
    assert got.shape == (n,)
    np.testing.assert_array_equal(got, ref)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=0, max_size=301), cut=st.integers(0, 301))
def test_stream_decoder_carries_odd_byte(data, cut):
    fmt = InputFormat("pcm16", 16000)
    dec = StreamDecoder(fmt)
    cut = min(cut, len(data))
    a = dec.decode(data[:cut])
    assert a.shape == (cut // 2,)
    assert dec.carried_bytes == cut % 2
    b = dec.decode(data[cut:])
    whole = data[: len(data) - len(data) % 2]
    np.testing.assert_array_equal(np.concatenate([a, b]), pcm16_to_float32(whole))
    assert dec.carried_bytes == len(data) % 2


def test_stream_decoder_reset_drops_carry():
    dec = StreamDecoder(InputFormat("pcm16", 16000))
    assert dec.decode(b"\x00\x40\x00").tolist() == [0.5]
    assert dec.carried_bytes == 1
    assert dec.reset() == 1
    # after reset the next bytes start a fresh sample
    assert dec.decode(b"\x00\xc0").tolist() == [-0.5]


def test_stream_decoder_stereo_is_downmixed_not_mono():
    fmt = InputFormat("pcm16", 16000, channels=2)
    left = np.full(100, 0.5, np.float32)
    right = np.full(100, -0.25, np.float32)
    inter = np.stack([left, right], axis=1).reshape(-1)
    data = float32_to_pcm16(inter)
    dec = StreamDecoder(fmt)
    out = np.concatenate([dec.decode(data[:7]), dec.decode(data[7:])])
    assert out.shape == (100,)  # read as mono it would be 200 samples
    np.testing.assert_allclose(out, 0.125, atol=1e-4)


def test_stream_decoder_f32_nonfinite_and_clip():
    dec = StreamDecoder(InputFormat("pcm_f32le", 16000))
    good = np.array([2.0, -3.0, 0.25], "<f4").tobytes()
    np.testing.assert_array_equal(dec.decode(good), np.array([1.0, -1.0, 0.25], np.float32))
    dec.decode(good[:2])  # carry 2 bytes
    bad = np.array([np.nan], "<f4").tobytes() + np.array([np.inf], "<f4").tobytes()
    with pytest.raises(AudioFormatError) as ei:
        dec.decode(bad[2:] + bad)
    assert ei.value.code == "bad_audio"
    # nothing used: the earlier carry is still there
    assert dec.carried_bytes == 2
