"""Coverage of the model-port issue's remaining items (tiny checkpoint, no ../shared needed):

* long sessions: the thinker's sliding window (reference "basic" window, docs/model.md §10/§11) and the
  talker's 4096-position window reset inside a long turn, with Code2Wav continuing across seams;
* real speech WAVs through the streaming and offline audio paths (10 embeddings per second);
* talker chunks of 25 codes below 6561, Code2Wav chunk sizes and continuity across seams;
* a checkpoint split into 3 shards with an index; clear errors for a version 2.6 checkpoint and a
  missing ``assets/token2wav`` file.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
torch = pytest.importorskip("torch")

from duplexkit.models.minicpmo45 import CheckpointError, DuplexPolicy, UnitInput, load  # noqa: E402
from duplexkit.models.minicpmo45.thinker import rerotate_keys  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "audio"
WAVS = ("question_16k.wav", "long_question_16k.wav", "interrupt_16k.wav", "ref_voice_16k.wav")


def _wav(name: str) -> np.ndarray:
    import soundfile as sf

    data, rate = sf.read(str(FIXTURES / name), dtype="float32")
    assert rate == 16000 and data.ndim == 1
    return np.ascontiguousarray(data)


def _units(audio: np.ndarray) -> list:
    """Split 16 kHz audio into duplex units: 16 560 samples, then 16 000 each (docs/model.md §3.1)."""
    out = [audio[:16560]]
    for s in range(16560, len(audio) - 16000 + 1, 16000):
        out.append(audio[s:s + 16000])
    return out


@pytest.fixture(scope="module")
def speech_units() -> list:
    a = np.concatenate([_wav("long_question_16k.wav"), _wav("question_16k.wav"), _wav("interrupt_16k.wav")])
    return _units(np.concatenate([a, a, a]))  # 40 units of real speech


def _greedy_window_policy(high: int, low: int) -> DuplexPolicy:
    # penalties off so that the greedy choice is the argmax of the masked logits (alignment check)
    return DuplexPolicy(temperature=0.0, repetition_penalty=1.0, length_penalty=1.0, window_high=high, window_low=low)


def _kv(st):
    return [(layer.keys, layer.values) for layer in st.kv.layers]


def _check_hidden_alignment(th, r) -> None:
    """hidden[i] is the state at token i's own input position: its greedy choice is token i+1."""
    forb = th.forbidden_ids_tensor(th.device)
    sp = th.special
    for i in range(r.n_tokens - 1):
        x = th.logits(r.hidden[i].to(th.dtype))
        x[forb] = float("-inf")
        a = int(torch.argmax(x))
        nxt = int(r.token_ids[i + 1])
        assert nxt == a or (nxt == sp.tts_bos and a == sp.listen), f"row {i}: hidden predicts {a}, next token {nxt}"


# ----------------------------------------------------------------------------- thinker sliding window
def test_rerotate_keys_equals_rope_at_the_new_position(tiny_model):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    rot = tiny_model.thinker.m.llm.model.rotary_emb
    k = torch.randn(1, 2, 7, tiny_model.config.head_dim, generator=torch.Generator().manual_seed(0))
    old = torch.arange(300, 307)[None]
    new = old - 137
    cos_o, sin_o = rot(k, old)
    cos_n, sin_n = rot(k, new)
    k_old, _ = apply_rotary_pos_emb(k, k, cos_o, sin_o)
    k_new, _ = apply_rotary_pos_emb(k, k, cos_n, sin_n)
    torch.testing.assert_close(rerotate_keys(k_old, -137, rot.inv_freq), k_new, atol=5e-5, rtol=1e-4)  # fp32 RoPE angles
    assert rerotate_keys(k_old, 0, rot.inv_freq) is k_old


def test_window_policy_validation(tiny_model):
    with pytest.raises(ValueError, match="both"):
        DuplexPolicy(window_high=300, window_low=None)
    with pytest.raises(ValueError, match="window_low < window_high"):
        DuplexPolicy(window_high=300, window_low=300)
    assert DuplexPolicy().window_high == 4000 and DuplexPolicy().window_low == 3500  # reference "basic"
    th = tiny_model.thinker
    with pytest.raises(ValueError, match="session prefix"):
        th.new_stream(ref_audio=_wav("ref_voice_16k.wav")[:32000], policy=_greedy_window_policy(60, 40))
    # a window too small for the prefix plus one unit
    st = th.new_stream(policy=_greedy_window_policy(40, 30))
    with pytest.raises(ValueError, match="sliding window too small"):
        th.step_units([UnitInput(stream=st, audio=_wav("question_16k.wav")[:16560])])


def test_sliding_window_keeps_prefix_bounds_cache_and_decodes(tiny_model, speech_units):
    th = tiny_model.thinker
    H = tiny_model.config.hidden_size
    sp = tiny_model.special
    high, low = 260, 150
    st = th.new_stream(ref_audio=_wav("ref_voice_16k.wav")[:32000], policy=_greedy_window_policy(high, low))
    P = st.prefix_len
    assert 20 < P < low
    prefix = [(k[..., :P, :].clone(), v[..., :P, :].clone()) for k, v in _kv(st)]
    slides_seen = 0
    units = speech_units[:26]
    for u, audio in enumerate(units):
        before = st.window_slides
        r = th.step_units([UnitInput(stream=st, audio=audio, force_speak=(u % 5 == 3))])[0]
        # the cache (with the pending terminator and </unit>) never passes window_high
        assert st.kv.get_seq_length() + len(st.pending_ids) <= high
        for (k, v), (k0, v0) in zip(_kv(st), prefix):
            assert torch.equal(k[..., :P, :], k0) and torch.equal(v[..., :P, :], v0)
        assert st.unit_starts and st.unit_starts[0] == P  # whole units: the oldest kept one follows the prefix
        assert st.unit_starts == sorted(st.unit_starts) and st.unit_starts[-1] < st.kv.get_seq_length()
        assert r.decision in ("listen", "speak")
        assert r.generated_ids[-1] == sp.unit_end and r.generated_ids[-2] in sp.terminators
        assert r.hidden.shape == (r.n_tokens, H) and len(r.token_ids) == r.n_tokens
        assert torch.isfinite(r.hidden).all()
        if st.window_slides > before:
            slides_seen += 1
            # after the slide at most window_low positions preceded this unit's <unit>
            assert st.unit_starts[-1] <= low
            _check_hidden_alignment(th, r)
    assert slides_seen >= 3 and st.window_slides == slides_seen
    assert st.window_dropped > 0
    assert st.whisper.positions == 50 * len(units) and st.whisper.resets == 0  # 26 units < 30 s


def test_unit_after_a_slide_equals_unit_on_an_equally_built_cache(tiny_model, speech_units):
    """Run a unit whose prefill slides the window (stream A) and the same unit on a copy of the
    stream taken before it whose cache was cut and re-rotated independently with transformers'
    own RoPE (stream B, window off): same decisions, hidden rows, logits and resulting KV."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, rotate_half

    th = tiny_model.thinker
    pol = _greedy_window_policy(260, 150)
    st = th.new_stream(ref_audio=_wav("ref_voice_16k.wav")[:32000], policy=pol)
    upcoming = 1 + 10 + pol.unit_limit() - 1
    snap = plan = None
    for u, audio in enumerate(speech_units):
        plan = th.window_plan(st, upcoming)
        if plan is not None and st.window_slides >= 1:  # the second slide of the session
            snap = copy.deepcopy(st)
            break
        th.step_units([UnitInput(stream=st, audio=audio)])
    assert snap is not None, "the window never slid twice"
    lo, cut, drop_pending = plan
    assert lo == st.prefix_len and cut in st.unit_starts and not drop_pending

    # stream B: the snapshot with an independently built cache and the window off
    b = snap
    b.policy = dataclasses.replace(pol, window_high=None, window_low=None)
    rot = th.m.llm.model.rotary_emb
    n_keep = b.kv.get_seq_length() - cut
    old = torch.arange(cut, cut + n_keep)[None]
    new = old - (cut - lo)
    for layer in b.kv.layers:
        k, v = layer.keys, layer.values
        tail = k[..., cut:, :]
        cos_o, sin_o = rot(tail, old)
        base = tail * cos_o[:, None] - rotate_half(tail) * sin_o[:, None]  # undo RoPE at the old positions
        cos_n, sin_n = rot(tail, new)
        tail_new, _ = apply_rotary_pos_emb(base, base, cos_n, sin_n)
        layer.keys = torch.cat([k[..., :lo, :], tail_new], dim=-2)
        layer.values = torch.cat([v[..., :lo, :], v[..., cut:, :]], dim=-2)

    audio = speech_units[u]
    slides = st.window_slides
    ra = th.step_units([UnitInput(stream=st, audio=audio)])[0]
    rb = th.step_units([UnitInput(stream=b, audio=audio)])[0]
    assert st.window_slides == slides + 1 and b.window_slides == slides
    assert st.window_dropped - snap.window_dropped == cut - lo
    assert ra.generated_ids == rb.generated_ids
    torch.testing.assert_close(ra.pending_logits, rb.pending_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ra.hidden, rb.hidden, atol=1e-4, rtol=1e-4)
    assert st.kv.get_seq_length() == b.kv.get_seq_length()
    for (ka, va), (kb, vb) in zip(_kv(st), _kv(b)):
        torch.testing.assert_close(ka, kb, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(va, vb, atol=1e-5, rtol=1e-5)
    _check_hidden_alignment(th, ra)


def test_window_that_never_fills_changes_nothing(tiny_model, speech_units):
    th = tiny_model.thinker
    outs = []
    for high, low in ((4000, 3500), (None, None)):
        st = th.new_stream(policy=_greedy_window_policy(high, low))
        outs.append([th.step_units([UnitInput(stream=st, audio=a)])[0] for a in speech_units[:4]])
        assert st.window_slides == 0
    for x, y in zip(*outs):
        assert x.generated_ids == y.generated_ids and torch.equal(x.hidden, y.hidden)


def test_whisper_stream_cache_resets_every_30_units(tiny_model, speech_units):
    """The Whisper streaming KV restarts before passing 1500 positions (50 per unit; docs/model.md §3.1)."""
    th = tiny_model.thinker
    st = th.new_stream()
    units = speech_units[:32]
    for i, a in enumerate(units):
        emb = th.audio_embeds_stream(st, a)
        assert emb.shape == (10, tiny_model.config.hidden_size)
        assert 0 < st.whisper.positions <= 1500
    assert st.whisper.resets == 1 and st.whisper.positions == 2 * 50


# ----------------------------------------------------------------------------- audio path on real speech
@pytest.mark.parametrize("name", WAVS)
def test_real_speech_streaming_audio_path(tiny_model, name):
    th = tiny_model.thinker
    H = tiny_model.config.hidden_size
    st = th.new_stream()
    units = _units(_wav(name))
    assert len(units[0]) == 16560 and all(len(u) == 16000 for u in units[1:])
    for a in units:
        emb = th.audio_embeds_stream(st, a)
        assert emb.shape == (10, H) and torch.isfinite(emb).all()
        assert st.last_mel.shape == (80, 102 if len(a) == 16560 else 104)
    assert st.whisper.positions == 50 * len(units)


def _offline_count(samples: int) -> int:
    n = math.ceil(samples / 160)
    m = (n - 1) // 2 + 1
    return (m - 5) // 5 + 1


@pytest.mark.parametrize("name", WAVS)
def test_real_speech_offline_audio_path(tiny_model, name):
    a = _wav(name)
    emb = tiny_model.thinker.audio_embeds_offline(a)
    assert emb.shape == (_offline_count(len(a)), tiny_model.config.hidden_size)
    assert abs(emb.shape[0] - len(a) / 1600) <= 1  # 10 embeddings per second
    assert torch.isfinite(emb).all()


def test_offline_audio_over_30s_is_split(tiny_model):
    a = np.concatenate([_wav(n) for n in WAVS])
    a = np.concatenate([a, a])[:35 * 16000 + 123]
    emb = tiny_model.thinker.audio_embeds_offline(a)
    assert emb.shape[0] == _offline_count(30 * 16000) + _offline_count(len(a) - 30 * 16000)


# ----------------------------------------------------------------------------- talker + code2wav, long turn
@pytest.fixture(scope="module")
def c2w(tmp_path_factory):
    pytest.importorskip("stepaudio2")
    from duplexkit.models.minicpmo45.code2wav import Code2Wav, write_tiny_token2wav

    return Code2Wav.from_pretrained(write_tiny_token2wav(tmp_path_factory.mktemp("c2w") / "assets", seed=0))


def _seam_energy_ratios(chunks: list) -> list:
    """RMS of the 3840-sample cross-fade region that opens each later chunk over the RMS of the
    3840 samples before the seam: about 1 when the held tail and the new chunk overlap-add
    coherently; a dropped tail or a missing fade gives about 0.6 or 2 (docs/model.md §7.3)."""
    from duplexkit.models.minicpmo45.code2wav import HOLDBACK_SAMPLES as n

    x = np.concatenate(chunks)
    out = []
    for s in np.cumsum([len(c) for c in chunks])[:-1]:
        if s - n < 0 or s + n > len(x):
            continue
        out.append(float(np.sqrt(np.mean(x[s:s + n] ** 2)) / np.sqrt(np.mean(x[s - n:s] ** 2))))
    return out


def test_code2wav_chunk_sizes_and_seam_continuity(c2w):
    from duplexkit.models.minicpmo45.code2wav import SAMPLES_PER_CODE

    v = _wav("ref_voice_16k.wav")[:32000]
    codes = np.random.default_rng(0).integers(0, 6561, 100)
    st = c2w.new_stream(v)
    chunks = [c2w.push(st, codes[i:i + 25]) for i in range(0, 100, 25)] + [c2w.push(st, [], last=True)]
    assert [len(c) for c in chunks[:4]] == [20160, 24000, 24000, 24000]
    assert sum(len(c) for c in chunks) == (100 + 3) * SAMPLES_PER_CODE
    ratios = _seam_energy_ratios(chunks[:4])
    assert len(ratios) == 3 and all(0.8 < r < 1.25 for r in ratios), ratios
    # the same check tells a broken cross-fade apart (the held tail dropped)
    saved = c2w.speech_window.clone()
    try:
        c2w.speech_window[len(saved) // 2:] = 0
        st = c2w.new_stream(v)
        bad = [c2w.push(st, codes[i:i + 25]) for i in range(0, 100, 25)]
        assert all(r < 0.8 for r in _seam_energy_ratios(bad))
    finally:
        c2w.speech_window.copy_(saved)


def test_long_turn_crosses_the_talker_window_without_breaking_audio(tiny_model, speech_units, c2w):
    """Thinker units -> talker with a 100-position window -> Code2Wav: the talker context resets at
    unit boundaries, every mid-turn unit still yields 25 codes below 6561 and the audio stream
    continues (chunk sizes, coherent seams, full terminal flush)."""
    from duplexkit.models.minicpmo45.code2wav import SAMPLES_PER_CODE
    from duplexkit.models.minicpmo45.talker import CODEC_EOS, Talker, TalkerInput

    src = tiny_model.talker
    talker = Talker(dataclasses.replace(src.config, max_position_embeddings=100))
    talker.load_state_dict(src.state_dict())
    th = tiny_model.thinker
    st = th.new_stream(policy=DuplexPolicy(temperature=0.0, min_unit_tokens=4, max_unit_tokens=6))
    turn = talker.new_turn()
    cs = c2w.new_stream(_wav("ref_voice_16k.wav")[:32000])
    g = torch.Generator().manual_seed(0)
    pos = resets = n_codes = 0
    chunks = []
    n_units = 12
    for u in range(n_units):
        r = th.step_units([UnitInput(stream=st, audio=speech_units[u], force_speak=(u == 0))])[0]
        assert r.decision == "speak" and 3 <= r.n_tokens <= 5 and not r.end_of_turn
        last = u == n_units - 1
        need = r.n_tokens + 1 + 26 - 1
        if pos + need > 100:
            pos, resets = 0, resets + 1
        codes = talker.generate_units([TalkerInput(turn, r.token_ids, r.hidden, turn_start=(u == 0), turn_end=last,
                                                   generator=g)])[0]
        assert codes.dtype == np.int64 and (codes >= 0).all() and (codes < CODEC_EOS).all()
        if 0 < u < n_units - 1:
            assert len(codes) == 25
        pos += r.n_tokens + 1 + len(codes)
        if not last:
            assert turn.text_start_pos == pos <= 100
        n_codes += len(codes)
        chunks.append(c2w.push(cs, codes, last=last))
    assert resets >= 3 and turn.window_resets == resets
    assert turn.cache is None and turn.text_start_pos == 0  # turn end resets the talker
    audio = [c for c in chunks if len(c)]
    assert len(audio[0]) == 20160 and all(len(c) % 24000 == 0 for c in audio[1:-1])
    assert sum(len(c) for c in chunks) == (n_codes + 3) * SAMPLES_PER_CODE
    blocks = np.concatenate(chunks[:-1])
    pieces = [blocks[:20160]] + [blocks[i:i + 24000] for i in range(20160, len(blocks), 24000)]
    ratios = _seam_energy_ratios(pieces)
    assert ratios and all(0.8 < r < 1.25 for r in ratios), ratios


# ----------------------------------------------------------------------------- checkpoint errors / shards
def _copy(tiny_dir, dst):
    shutil.copytree(tiny_dir, dst, ignore=shutil.ignore_patterns("assets"))
    return dst


def test_three_shard_checkpoint_via_index(tiny_dir, tiny_model, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(tiny_dir, tmp_path / "c")
    t = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    keys = sorted(t)
    wm = {}
    for i in range(3):
        fn = f"model-{i + 1:05d}-of-00003.safetensors"
        part = keys[i::3]
        save_file({k: t[k] for k in part}, str(d / fn), metadata={"format": "pt"})
        wm.update({k: fn for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    m = load(d, progress=False, with_code2wav=False)
    ref = dict(tiny_model.thinker.m.state_dict())
    got = dict(m.thinker.m.state_dict())
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    got_t = m.talker.state_dict()
    ref_t = tiny_model.talker.state_dict()
    used = [k for k in ref_t if k != "model.embed_tokens.weight"]  # tts.model.embed_tokens is ignored (unused)
    assert got_t.keys() == ref_t.keys() and all(torch.equal(got_t[k], ref_t[k]) for k in used)


@pytest.mark.parametrize("version", ["2.6", 2.6, None])
def test_version_other_than_45_is_a_clear_error(tiny_dir, tmp_path, version):
    d = _copy(tiny_dir, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    if version is None:
        del cfg["version"]
    else:
        cfg["version"] = version
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="version" if version is None else r"version '2\.6'"):
        load(d, progress=False, with_code2wav=False)


@pytest.mark.parametrize("missing", ["hift.pt", "flow.yaml"])
def test_missing_token2wav_asset_is_named(tiny_dir, tmp_path, missing):
    pytest.importorskip("stepaudio2")
    if not (tiny_dir / "assets" / "token2wav").is_dir():
        pytest.skip("the tiny builder wrote no assets/token2wav")
    d = tmp_path / "c"
    shutil.copytree(tiny_dir, d)
    (d / "assets" / "token2wav" / missing).unlink()
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load(d, progress=False)
