"""Code2Wav streaming wrapper tests on the tiny random-weight asset set (docs/model.md §7).

One flow is built per test process (session fixture); its cache buffers are sized to use, so the flow
costs tens of MB instead of the package's fixed 2.24 GB.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("stepaudio2")

from duplexkit.models.minicpmo45.code2wav import (  # noqa: E402
    HOLDBACK_SAMPLES,
    SAMPLES_PER_CODE,
    SILENCE_CODE,
    ChunkBelowLookaheadError,
    Code2Wav,
    Code2WavInputError,
    Code2WavLayoutError,
    StreamClosedError,
    detect_token2wav_layout,
    write_tiny_token2wav,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "audio"

FIRST_BLOCK = 25 * SAMPLES_PER_CODE - HOLDBACK_SAMPLES  # 20160
LATER_BLOCK = 25 * SAMPLES_PER_CODE  # 24000


def _voice(name: str, seconds: float, offset: float = 0.0) -> np.ndarray:
    import soundfile as sf

    data, rate = sf.read(str(FIXTURES / name), dtype="float32")
    assert rate == 16000
    a = data[int(offset * rate): int((offset + seconds) * rate)]
    return np.ascontiguousarray(a, dtype=np.float32)


@pytest.fixture(scope="session")
def tiny_t2w(tmp_path_factory) -> Path:
    return write_tiny_token2wav(tmp_path_factory.mktemp("ckpt") / "assets", seed=0)


@pytest.fixture(scope="session")
def c2w(tiny_t2w) -> Code2Wav:
    return Code2Wav.from_pretrained(tiny_t2w)


@pytest.fixture(scope="session")
def voice_a() -> np.ndarray:
    return _voice("ref_voice_16k.wav", 2.0)


@pytest.fixture(scope="session")
def voice_b() -> np.ndarray:
    return _voice("question_16k.wav", 1.6, offset=0.2)


def _codes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 6561, n).astype(np.int64)


# ----------------------------------------------------------------------------- layout / assets
def test_tiny_asset_set_layout(tiny_t2w):
    names = sorted(p.name for p in tiny_t2w.iterdir())
    assert names == ["TINY_RANDOM_WEIGHTS", "flow.pt", "flow.yaml", "hift.pt"]
    assert tiny_t2w.name == "token2wav" and tiny_t2w.parent.name == "assets"
    assert detect_token2wav_layout(tiny_t2w) == "tiny"
    sd = torch.load(tiny_t2w / "hift.pt", weights_only=True)
    assert all(k.startswith("generator.") for k in sd)


def test_seven_file_layout_rejected(tiny_t2w, tmp_path):
    d = tmp_path / "assets" / "token2wav"
    shutil.copytree(tiny_t2w, d)
    (d / "hift_original.pt").write_bytes(b"x")
    (d / "config.yaml").write_text("x: 1\n")
    with pytest.raises(Code2WavLayoutError, match="7-file"):
        Code2Wav.from_pretrained(d)


def test_missing_prompt_encoders_rejected_without_tiny_marker(tiny_t2w, tmp_path):
    d = tmp_path / "token2wav"
    shutil.copytree(tiny_t2w, d)
    (d / "TINY_RANDOM_WEIGHTS").unlink()
    with pytest.raises(Code2WavLayoutError, match="speech_tokenizer_v2_25hz.onnx"):
        Code2Wav.from_pretrained(d)
    (d / "campplus.onnx").write_bytes(b"")  # only one of the two encoders
    with pytest.raises(Code2WavLayoutError, match="speech_tokenizer_v2_25hz.onnx"):
        detect_token2wav_layout(d)
    (d / "flow.pt").unlink()
    with pytest.raises(Code2WavLayoutError, match="flow.pt"):
        detect_token2wav_layout(d)


def test_flow_buffers_are_sized_to_use(c2w, voice_a):
    c2w.new_stream(voice_a)
    dec = c2w.flow.decoder
    total = sum(b.numel() * b.element_size() for b in
                (dec.att_cache_buffer, dec.cnn_cache_buffer, dec.estimator.att_cache_buffer,
                 dec.estimator.cnn_cache_buffer))
    assert total < 256 * 2 ** 20  # vs 2.24 GB fixed in the package
    assert dec.att_cache_buffer.shape[0] == c2w.n_timesteps


# ----------------------------------------------------------------------------- chunk contract
def test_chunk_sizes_and_terminal_flush(c2w, voice_a):
    st = c2w.new_stream(voice_a)
    codes = _codes(60, 1)
    a1 = c2w.push(st, codes[:25])
    assert a1.dtype == np.float32 and len(a1) == FIRST_BLOCK == 20160
    np.testing.assert_array_equal(st.carry, codes[22:25])
    a2 = c2w.push(st, codes[25:50])
    assert len(a2) == LATER_BLOCK == 24000
    np.testing.assert_array_equal(st.carry, codes[47:50])
    a3 = c2w.push(st, codes[50:60], last=True)
    assert len(a3) == (3 + 10) * SAMPLES_PER_CODE + HOLDBACK_SAMPLES
    # a turn of N codes renders (N + 3 silence codes) * 960 samples
    assert len(a1) + len(a2) + len(a3) == (60 + 3) * SAMPLES_PER_CODE
    for a in (a1, a2, a3):
        assert np.isfinite(a).all() and np.abs(a).max() <= 0.99 + 1e-6 and np.abs(a).max() > 0
    # back to the turn-start state
    np.testing.assert_array_equal(st.carry, np.full(3, SILENCE_CODE))
    assert len(st.pending) == 0 and st.hift_cache is None and st.chunks == 0


def test_buffering_emits_only_full_blocks(c2w, voice_a):
    st = c2w.new_stream(voice_a)
    codes = _codes(80, 2)
    assert len(c2w.push(st, codes[:10])) == 0
    assert len(c2w.push(st, codes[10:24])) == 0
    assert len(st.pending) == 24
    a = c2w.push(st, codes[24:30])
    assert len(a) == FIRST_BLOCK and len(st.pending) == 5
    b = c2w.push(st, codes[30:80])  # 55 pending -> two blocks, 5 left
    assert len(b) == 2 * LATER_BLOCK and len(st.pending) == 5
    c = c2w.push(st, np.zeros(0, np.int64), last=True)
    assert len(c) == (3 + 5) * SAMPLES_PER_CODE + HOLDBACK_SAMPLES


def test_split_pushes_equal_one_big_push(c2w, voice_a):
    codes = _codes(57, 3)
    s1 = c2w.new_stream(voice_a, seed=5)
    whole = np.concatenate([c2w.push(s1, codes[:50]), c2w.push(s1, codes[50:], last=True)])
    s2 = c2w.new_stream(voice_a, seed=5)
    parts = [c2w.push(s2, codes[i:i + 7]) for i in range(0, 57, 7)] + [c2w.push(s2, [], last=True)]
    np.testing.assert_array_equal(whole, np.concatenate(parts))


def test_first_call_last_and_empty_flush(c2w, voice_a):
    st = c2w.new_stream(voice_a)
    a = c2w.push(st, _codes(25, 4), last=True)
    assert len(a) == (3 + 25) * SAMPLES_PER_CODE  # nothing held back before, nothing withheld now
    b = c2w.push(st, [], last=True)  # empty turn: the 3-code silence carry is still rendered
    assert len(b) == 3 * SAMPLES_PER_CODE


def test_lookahead_codes_shape_the_chunk_and_open_the_next(c2w, voice_a):
    base = _codes(50, 5)
    alt = base.copy()
    alt[24] = (alt[24] + 1000) % 6561  # a lookahead code of the first block
    s1, s2 = c2w.new_stream(voice_a), c2w.new_stream(voice_a)
    a1, b1 = c2w.push(s1, base[:25]), c2w.push(s2, alt[:25])
    assert not np.array_equal(a1, b1)
    np.testing.assert_array_equal(s2.carry, alt[22:25])
    # a code after the first block does not change the first block's audio
    s3 = c2w.new_stream(voice_a)
    alt2 = base.copy()
    alt2[30] = (alt2[30] + 1) % 6561
    np.testing.assert_array_equal(c2w.push(s3, alt2[:25]), a1)


def test_early_flush_needs_four_codes(c2w, voice_a):
    st = c2w.new_stream(voice_a)
    codes = _codes(29, 6)
    with pytest.raises(ChunkBelowLookaheadError):
        c2w.push(st, codes[:3], flush=True)
    assert len(st.pending) == 0 and st.chunks == 0  # nothing consumed
    a = c2w.push(st, codes[:4], flush=True)  # 3 carry + 1 new rendered = 3840 samples, all held back
    assert len(a) == 4 * 2 * 480 - HOLDBACK_SAMPLES == 0
    np.testing.assert_array_equal(st.carry, codes[1:4])
    b = c2w.push(st, codes[4:29])
    assert len(b) == LATER_BLOCK
    # a flush whose remainder after full blocks is 1..3 codes is refused as a whole
    st2 = c2w.new_stream(voice_a)
    with pytest.raises(ChunkBelowLookaheadError):
        c2w.push(st2, _codes(27, 7), flush=True)
    assert len(st2.pending) == 0 and st2.chunks == 0


def test_bad_codes_raise_and_consume_nothing(c2w, voice_a):
    st = c2w.new_stream(voice_a)
    c2w.push(st, _codes(5, 7))
    for bad in ([1, 2, 6561], [151687], [-1], np.array([1.0, 2.0]), np.zeros((2, 2), np.int64)):
        with pytest.raises(Code2WavInputError):
            c2w.push(st, bad)
    assert len(st.pending) == 5


# ----------------------------------------------------------------------------- state isolation
def test_turn_reset_restores_state(c2w, voice_a):
    st = c2w.new_stream(voice_a, seed=11)
    codes = _codes(55, 8)

    def turn():
        return [c2w.push(st, codes[:25]), c2w.push(st, codes[25:50]), c2w.push(st, codes[50:], last=True)]

    first, second = turn(), turn()  # the terminal flush reset the stream
    for x, y in zip(first, second):
        np.testing.assert_array_equal(x, y)
    c2w.push(st, codes[:30])
    c2w.reset_turn(st)  # cancel mid-turn
    assert len(st.pending) == 0
    np.testing.assert_array_equal(c2w.push(st, codes[:25]), first[0])


def test_streams_of_one_voice_share_its_base_cache_until_they_speak(c2w, voice_a):
    """A new (or reset) stream holds the voice's base cache tensors themselves, no copy; speaking
    replaces them with the stream's own, and never writes into the shared ones (a second stream of
    the voice then still says exactly what the first said)."""
    codes = _codes(55, 12)
    a, b = c2w.new_stream(voice_a, seed=3), c2w.new_stream(voice_a, seed=3)
    base = {k: (v.data_ptr(), v.clone()) for k, v in a.base_cache.items()}
    for st in (a, b):
        assert {k: v.data_ptr() for k, v in st.flow_cache.items()} == {k: p for k, (p, _) in base.items()}
    out_a = [c2w.push(a, codes[:25]), c2w.push(a, codes[25:], last=True)]
    assert all(a.base_cache[k].data_ptr() == p and torch.equal(a.base_cache[k], v) for k, (p, v) in base.items())
    out_b = [c2w.push(b, codes[:25]), c2w.push(b, codes[25:], last=True)]
    for x, y in zip(out_a, out_b):
        np.testing.assert_array_equal(x, y)


def test_interleaved_streams_do_not_cross_talk(c2w, voice_a, voice_b):
    ca, cb = _codes(60, 9), _codes(60, 10)

    def run_alone(voice, codes, seed):
        s = c2w.new_stream(voice, seed=seed)
        return [c2w.push(s, codes[:25]), c2w.push(s, codes[25:50]), c2w.push(s, codes[50:], last=True)]

    alone_a = run_alone(voice_a, ca, 1)
    alone_b = run_alone(voice_b, cb, 2)
    sa, sb = c2w.new_stream(voice_a, seed=1), c2w.new_stream(voice_b, seed=2)
    got_a, got_b = [], []
    got_a.append(c2w.push(sa, ca[:25]))
    got_b.append(c2w.push(sb, cb[:25]))
    got_b.append(c2w.push(sb, cb[25:50]))
    got_a.append(c2w.push(sa, ca[25:50]))
    got_a.append(c2w.push(sa, ca[50:], last=True))
    got_b.append(c2w.push(sb, cb[50:], last=True))
    for x, y in zip(alone_a + alone_b, got_a + got_b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(alone_a[1], alone_b[1])


def test_closed_stream_refuses(c2w, voice_a):
    st = c2w.new_stream(voice_a)
    c2w.close(st)
    with pytest.raises(StreamClosedError):
        c2w.push(st, _codes(25, 1))
    with pytest.raises(StreamClosedError):
        c2w.reset_turn(st)


# ----------------------------------------------------------------------------- prompt features
def test_prompt_features_cached_by_content_hash(c2w, voice_a, voice_b):
    before = c2w.prompt_cache_misses
    fresh = np.concatenate([voice_a[:16000], voice_b[:8000]])  # 1.5 s, not seen before
    pf1 = c2w.prompt_features(fresh)
    assert c2w.prompt_cache_misses == before + 1
    pf2 = c2w.prompt_features(fresh.copy())  # same bytes, other array: cache hit
    assert pf2 is pf1 and c2w.prompt_cache_misses == before + 1
    assert pf1.source == "standin"
    p = len(fresh) // 640
    assert pf1.tokens.shape == (1, p) and pf1.tokens.dtype == torch.int32
    assert int(pf1.tokens.min()) >= 0 and int(pf1.tokens.max()) < 6561
    assert pf1.mel.shape == (1, 2 * p, 80)
    assert pf1.spk.shape == (1, 192) and torch.isfinite(pf1.spk).all()
    other = c2w.prompt_features(fresh * 0.5)
    assert c2w.prompt_cache_misses == before + 2
    assert not torch.equal(other.tokens, pf1.tokens) and not torch.allclose(other.mel, pf1.mel)


def test_reference_voice_object_and_default_voice(c2w, voice_a):
    from duplexkit.engine.api import ReferenceVoice
    from duplexkit.models.minicpmo45.code2wav import audio_sha256

    rv = ReferenceVoice(audio=voice_a, sha256=audio_sha256(voice_a))
    st = c2w.new_stream(rv)
    assert st.prompt.key == rv.sha256
    st2 = c2w.new_stream(None)  # default voice
    assert st2.prompt.key != rv.sha256 and st2.prompt.num_tokens >= 3


def test_bad_reference_audio(c2w):
    with pytest.raises(Code2WavInputError):
        c2w.new_stream(np.zeros(100, np.float32))  # < 3 prompt tokens
    with pytest.raises(Code2WavInputError):
        c2w.new_stream(np.full(16000, np.nan, np.float32))
    with pytest.raises(Code2WavInputError):
        c2w.new_stream(np.zeros((2, 16000), np.float32))


# ----------------------------------------------------------------------------- real prompt-encoder path
def _tiny_campplus_session(w: np.ndarray):
    """A stand-in CAM++ graph: x [1, T, 80] -> mean over T of x^2 -> @ W [80, 192]."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["m"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["m", "W"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "campplus_standin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, 80])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 192])],
        initializer=[numpy_helper.from_array(w, name="W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_onnx_prompt_encoder_path(tiny_t2w, voice_b):
    """The 5-file path's call sequence on a random S3TokenizerV2 and a stand-in CAM++ ONNX graph."""
    import torchaudio.compliance.kaldi as kaldi
    from s3tokenizer.model_v2 import S3TokenizerV2

    from duplexkit.models.minicpmo45.code2wav import OnnxPromptEncoder

    w = (np.random.default_rng(0).standard_normal((80, 192)) * 0.01).astype(np.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tok = S3TokenizerV2("speech_tokenizer_v2_25hz")
    enc = OnnxPromptEncoder(tok, _tiny_campplus_session(w))
    tokens, spk = enc(voice_b, "unused")
    assert tokens.dtype == torch.int32 and tokens.shape == (1, len(voice_b) // 640)
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 6561
    fb = kaldi.fbank(torch.from_numpy(voice_b)[None], num_mel_bins=80, dither=0, sample_frequency=16000)
    fb = fb - fb.mean(0, keepdim=True)
    expected = ((fb ** 2).mean(0).numpy() @ w)[None]
    np.testing.assert_allclose(spk.numpy(), expected, rtol=1e-4, atol=1e-5)

    other = Code2Wav.from_pretrained(tiny_t2w, prompt_encoder=enc)
    st = other.new_stream(voice_b)
    assert st.prompt.source == "onnx" and torch.equal(st.prompt.tokens, tokens)
    assert len(other.push(st, _codes(25, 12))) == FIRST_BLOCK


def test_broken_onnx_files_give_a_layout_error(tiny_t2w, tmp_path):
    d = tmp_path / "token2wav"
    shutil.copytree(tiny_t2w, d)
    (d / "TINY_RANDOM_WEIGHTS").unlink()
    (d / "speech_tokenizer_v2_25hz.onnx").write_bytes(b"not an onnx file")
    (d / "campplus.onnx").write_bytes(b"not an onnx file")
    assert detect_token2wav_layout(d) == "5-file"
    with pytest.raises(Code2WavLayoutError, match="cannot load"):
        Code2Wav.from_pretrained(d)
