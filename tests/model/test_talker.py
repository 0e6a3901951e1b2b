"""Talker tests: parity case e (../shared/parity) and the duplex decode contract (docs/model.md §6)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from duplexkit.models.minicpmo45.talker import (  # noqa: E402
    CODEC_EOS,
    Talker,
    TalkerConfig,
    TalkerError,
    TalkerInput,
    TalkerSampling,
    TalkerTurn,
)

REPO = Path(__file__).resolve().parents[2]
PARITY = (REPO / ".." / "shared" / "parity").resolve()
PARITY_SHA256 = "0896f40ae743f65654ead47b9cb8ddf636be1231150f78224ae853f236d4c42b"

# README "Suggested tolerances"
TOL_EMB = dict(atol=1e-4, rtol=1e-4)
TOL_LOGITS = dict(atol=2e-4, rtol=1e-4)
TOL_PROBS = dict(atol=1e-6, rtol=0)


def _need_parity() -> Path:
    if not (PARITY / "make_tiny_checkpoint.py").is_file() or not (PARITY / "goldens.npz").is_file():
        pytest.skip(f"parity pack not found at {PARITY} (../shared/parity): talker parity case e skipped")
    return PARITY


@pytest.fixture(scope="session")
def parity_ckpt(request, tmp_path_factory) -> Path:
    """The parity checkpoint (config.json + model.safetensors) built by make_tiny_checkpoint.py, kept in
    pytest's cache dir (verified by sha256) so later runs reuse it."""
    parity = _need_parity()
    import hashlib

    cache_dir = Path(request.config.cache.mkdir("minicpmo45_parity_ckpt"))
    st = cache_dir / "model.safetensors"
    ok = cache_dir / "sha256.ok"
    if not (ok.is_file() and st.is_file() and ok.read_text().strip() == PARITY_SHA256):
        subprocess.run([sys.executable, str(parity / "make_tiny_checkpoint.py"), str(cache_dir)], check=True,
                       capture_output=True)
        h = hashlib.sha256()
        with open(st, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        assert h.hexdigest() == PARITY_SHA256, "make_tiny_checkpoint.py produced an unexpected checkpoint"
        ok.write_text(PARITY_SHA256)
    return cache_dir


@pytest.fixture(scope="session")
def talker(parity_ckpt) -> Talker:
    from safetensors import safe_open

    cfg = json.loads((parity_ckpt / "config.json").read_text())
    sd = {}
    with safe_open(str(parity_ckpt / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            if k.startswith("tts."):
                sd[k] = f.get_tensor(k)
    torch.manual_seed(0)
    return Talker.from_state_dict(cfg["tts_config"], sd)


@pytest.fixture(scope="session")
def goldens():
    _need_parity()
    return np.load(PARITY / "goldens.npz")


@pytest.fixture(scope="session")
def case_e():
    _need_parity()
    return json.loads((PARITY / "cases.json").read_text())["cases"]["e_talker"]


# ----------------------------------------------------------------------------- parity (case e)
@pytest.mark.parity
def test_condition_parts_match_goldens(talker, goldens):
    ids = goldens["e_text_ids"]
    h = torch.from_numpy(goldens["e_llm_hidden"])
    with torch.no_grad():
        emb = talker.emb_text(torch.from_numpy(ids))
        raw = talker.projector_semantic(h)
        l2 = torch.nn.functional.normalize(raw, dim=-1, eps=1e-12)
        bos = talker.emb_text(torch.tensor([talker.config.audio_bos_token_id]))[0]
        cond = talker.prefill_embeds(ids, h)
    np.testing.assert_allclose(emb.numpy(), goldens["e_emb_text_part"], **TOL_EMB)
    np.testing.assert_allclose(raw.numpy(), goldens["e_projected_hidden_raw"], **TOL_EMB)
    np.testing.assert_allclose(l2.numpy(), goldens["e_projected_hidden_l2norm"], **TOL_EMB)
    np.testing.assert_allclose(bos.numpy(), goldens["e_audio_bos_embed"], **TOL_EMB)
    assert cond.shape == (7, 32)
    np.testing.assert_allclose(cond.numpy(), goldens["e_condition"], **TOL_EMB)


def _teacher_force(talker, turn, cond, forced):
    """Row 0 from the prefill, row k after feeding forced[:k]; returns logits [n, V] and probs [n, V]."""
    V = talker.config.num_audio_tokens
    sampling = TalkerSampling()  # reference duplex path: T 0.8, penalty 1.05 over window 16
    logits_rows, prob_rows = [], []
    logits = talker.forward_embeds(turn, cond)[-1]
    for k in range(len(forced)):
        window = torch.full((16,), V, dtype=torch.long)
        prev = torch.as_tensor(forced[:k][-16:], dtype=torch.long)
        if len(prev):
            window[-len(prev):] = prev
        logits_rows.append(logits)
        prob_rows.append(talker.sampling_probs(logits, window, sampling))
        if k + 1 < len(forced):  # the last sample is dropped and never fed
            logits = talker.forward_embeds(turn, talker.code_embed(torch.tensor([forced[k]])))[-1]
    return torch.stack(logits_rows).numpy(), torch.stack(prob_rows).numpy()


@pytest.mark.parity
def test_teacher_forced_logits_and_probs_two_chunks(talker, goldens, case_e):
    ids = goldens["e_text_ids"]
    h = torch.from_numpy(goldens["e_llm_hidden"])
    turn = talker.new_turn()
    cond = talker.prefill_embeds(ids, h)
    logits, probs = _teacher_force(talker, turn, cond, list(goldens["e_forced_codes"]))
    np.testing.assert_allclose(logits, goldens["e_talker_logits"], **TOL_LOGITS)
    np.testing.assert_allclose(probs, goldens["e_talker_probs"], **TOL_PROBS)
    # 7 condition rows + 5 returned codes are cached (cases.json: "7+5=12 positions")
    assert turn.text_start_pos == 12 == turn.cache.get_seq_length()
    assert case_e["second_chunk"]["text_start_pos"] == 12

    cond2 = talker.prefill_embeds(ids[3:6], h[3:6])
    np.testing.assert_allclose(cond2.numpy(), goldens["e2_condition"], **TOL_EMB)
    logits2, probs2 = _teacher_force(talker, turn, cond2, list(goldens["e2_forced_codes"]))
    np.testing.assert_allclose(logits2, goldens["e2_talker_logits"], **TOL_LOGITS)
    np.testing.assert_allclose(probs2, goldens["e2_talker_probs"], **TOL_PROBS)


@pytest.mark.parity
def test_greedy_codes_and_logits(talker, goldens):
    ids = goldens["e_text_ids"]
    h = torch.from_numpy(goldens["e_llm_hidden"])
    turn = talker.new_turn()
    logits = talker.forward_embeds(turn, talker.prefill_embeds(ids, h))[-1]
    got_codes, got_logits = [], []
    for _ in range(6):
        got_logits.append(logits.numpy())
        c = int(torch.argmax(logits))
        got_codes.append(c)
        logits = talker.forward_embeds(turn, talker.code_embed(torch.tensor([c])))[-1]
    assert got_codes == list(goldens["e_greedy_codes"])
    np.testing.assert_allclose(np.stack(got_logits), goldens["e_greedy_logits"], **TOL_LOGITS)

    # the public API with greedy sampling: 7-step budget -> 6 codes, identical to the reference argmax
    turn = talker.new_turn()
    codes = talker.generate_units([TalkerInput(turn, ids, h, turn_start=True, temperature=0.0, budget=7)])[0]
    assert codes.dtype == np.int64
    assert list(codes) == list(goldens["e_greedy_codes"])
    assert turn.text_start_pos == 7 + 6


# ----------------------------------------------------------------------------- decode contract
# Run twice: on a seeded random tiny talker (always) and on the parity weights (when ../shared exists).
TINY_TTS = dict(llm_dim=128, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                num_hidden_layers=1, max_position_embeddings=4096, num_audio_tokens=6562, num_text_tokens=152064,
                num_vq=1, audio_bos_token_id=151687, text_eos_token_id=151692)


@pytest.fixture(scope="session")
def random_talker() -> Talker:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Talker(TalkerConfig.from_tts_config(TINY_TTS))


@pytest.fixture(scope="session", params=["random", "parity"])
def tk_unit(request):
    """(talker, token_ids int64 [6], hidden float32 [6, 128])."""
    if request.param == "random":
        rng = np.random.default_rng(0)
        return (request.getfixturevalue("random_talker"), rng.integers(0, 151748, 6).astype(np.int64),
                rng.standard_normal((6, 128)).astype(np.float32))
    g = request.getfixturevalue("goldens")
    return request.getfixturevalue("talker"), g["e_text_ids"], g["e_llm_hidden"]


def test_duplex_unit_returns_25_codes_and_state_persists(tk_unit):
    talker, ids, h = tk_unit
    turn = talker.new_turn()
    g = torch.Generator().manual_seed(7)
    # mid-turn unit: EOS masked for all 26 steps -> exactly 25 codes
    c1 = talker.generate_units([TalkerInput(turn, ids, h, generator=g)])[0]
    assert c1.shape == (25,) and c1.dtype == np.int64
    assert (c1 >= 0).all() and (c1 < CODEC_EOS).all()
    assert turn.text_start_pos == 7 + 25 == turn.cache.get_seq_length()
    c2 = talker.generate_units([TalkerInput(turn, ids[:2], h[:2], generator=g)])[0]
    assert c2.shape == (25,)
    assert turn.text_start_pos == 32 + 3 + 25
    # empty unit: [audio_bos] alone keeps speech going (docs/model.md §6)
    c3 = talker.generate_units([TalkerInput(turn, np.zeros(0, np.int64), np.zeros((0, talker.config.llm_dim), np.float32),
                                            generator=g)])[0]
    assert c3.shape == (25,)
    assert turn.text_start_pos == 60 + 1 + 25
    # turn end: state reset afterwards
    talker.generate_units([TalkerInput(turn, ids, h, turn_end=True, generator=g)])
    assert turn.cache is None and turn.text_start_pos == 0


def test_state_carries_across_units(tk_unit):
    """Unit 2 after unit 1 differs from unit 2 on a fresh turn (the KV of unit 1 is attended)."""
    talker, ids, h = tk_unit
    t1 = talker.new_turn()
    talker.generate_units([TalkerInput(t1, ids, h, temperature=0.0)])
    a = talker.generate_units([TalkerInput(t1, ids[3:], h[3:], temperature=0.0)])[0]
    t2 = talker.new_turn()
    b = talker.generate_units([TalkerInput(t2, ids[3:], h[3:], temperature=0.0)])[0]
    assert a.shape == b.shape == (25,)
    assert not np.array_equal(a, b)


def test_seeded_sampling_is_reproducible_and_batched_equals_single(tk_unit):
    talker, ids, h = tk_unit
    outs = []
    for _ in range(2):
        turn = talker.new_turn()
        outs.append(talker.generate_units([TalkerInput(turn, ids, h, generator=torch.Generator().manual_seed(3))])[0])
    np.testing.assert_array_equal(outs[0], outs[1])
    ta, tb = talker.new_turn(), talker.new_turn()
    both = talker.generate_units([
        TalkerInput(ta, ids, h, generator=torch.Generator().manual_seed(3)),
        TalkerInput(tb, ids[:3], h[:3], generator=torch.Generator().manual_seed(4)),
    ])
    np.testing.assert_array_equal(both[0], outs[0])
    tc = talker.new_turn()
    alone = talker.generate_units([TalkerInput(tc, ids[:3], h[:3], generator=torch.Generator().manual_seed(4))])[0]
    np.testing.assert_array_equal(both[1], alone)


def test_eos_allowed_only_on_first_and_last_unit(tk_unit):
    """Force a high EOS logit by biasing the head: mid-turn units still return 25 codes, first/last stop."""
    talker, ids, h = tk_unit
    g0 = talker.head_code[0].parametrizations.weight.original0
    saved = g0.detach().clone()
    try:
        with torch.no_grad():
            # scale the EOS row's gain so that EOS dominates the distribution
            talker.head_code[0].parametrizations.weight.original0[CODEC_EOS] = 1e4
            talker._folded_head = None
        for flags in ({"turn_start": True}, {"turn_end": True}):
            turn = talker.new_turn()
            codes = talker.generate_units([TalkerInput(turn, ids, h, temperature=0.0, **flags)])[0]
            assert len(codes) < 25
        turn = talker.new_turn()
        codes = talker.generate_units([TalkerInput(turn, ids, h, temperature=0.0)])[0]
        assert len(codes) == 25 and CODEC_EOS not in codes
    finally:
        with torch.no_grad():
            talker.head_code[0].parametrizations.weight.original0.copy_(saved)
            talker._folded_head = None


def test_offline_tail_and_limits(tk_unit):
    talker, ids, h = tk_unit
    emb = talker.prefill_embeds(ids, h, offline=True)
    assert emb.shape == (8, 32)
    tail = talker.emb_text(torch.tensor([151692, 151687]))
    torch.testing.assert_close(emb[-2:], tail)
    codes = talker.generate_offline(ids, h, max_codes=12, min_codes=12, generator=torch.Generator().manual_seed(1))
    assert codes.shape == (12,) and (codes < CODEC_EOS).all()


def test_max_position_window_resets_turn(tk_unit):
    talker, ids, h = tk_unit
    turn = talker.new_turn()
    turn_pos = talker.config.max_position_embeddings - 10
    # simulate a turn whose window is almost full
    talker.generate_units([TalkerInput(turn, ids, h, temperature=0.0)])
    turn.text_start_pos = turn_pos  # positions beyond the cache are what the limit guards
    codes = talker.generate_units([TalkerInput(turn, ids, h, temperature=0.0)])[0]
    assert len(codes) == 25
    assert turn.window_resets == 1
    assert turn.text_start_pos == 7 + 25


def test_bad_inputs_raise_typed_errors(tk_unit):
    talker, ids, h = tk_unit
    turn = talker.new_turn()
    with pytest.raises(TalkerError):
        talker.generate_units([TalkerInput(turn, ids, h[:3])])
    with pytest.raises(TalkerError):
        talker.generate_units([TalkerInput(turn, np.array([10 ** 7]), h[:1])])
    with pytest.raises(TalkerError):
        talker.generate_units([TalkerInput(turn, ids, h[:, :64])])
    assert turn.cache is None and turn.text_start_pos == 0  # nothing consumed


# ----------------------------------------------------------------------------- no ../shared needed
def test_config_from_tts_config_and_strict_loading():
    tts = dict(llm_dim=128, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
               num_hidden_layers=1, max_position_embeddings=4096, num_audio_tokens=6562, num_text_tokens=152064,
               num_vq=1, audio_bos_token_id=151687, text_eos_token_id=151692)
    cfg = TalkerConfig.from_tts_config(tts)
    assert cfg.eos_code == 6561
    with pytest.raises(TalkerError):
        TalkerConfig.from_tts_config({k: v for k, v in tts.items() if k != "audio_bos_token_id"})
    torch.manual_seed(0)
    ref = Talker(cfg)
    sd = {"tts." + k: v for k, v in ref.state_dict().items() if not k.startswith("model.embed_tokens")}
    sd["tts.model.embed_tokens.weight"] = torch.zeros(32000, 32)  # present in the checkpoint, ignored
    sd["tts.projector_spk.linear1.weight"] = torch.zeros(32, 128)  # ignored
    sd["llm.lm_head.weight"] = torch.zeros(1)  # other prefixes are not the talker's business
    t = Talker.from_state_dict(tts, sd)
    torch.testing.assert_close(t.head_weight(), ref.head_weight())
    missing = {k: v for k, v in sd.items() if "emb_code" not in k}
    with pytest.raises(TalkerError, match="missing"):
        Talker.from_state_dict(tts, missing)
    extra = dict(sd)
    extra["tts.bogus.weight"] = torch.zeros(1)
    with pytest.raises(TalkerError, match="unexpected"):
        Talker.from_state_dict(tts, extra)
    bad = dict(sd)
    bad["tts.emb_code.0.weight"] = torch.zeros(6562, 16)
    with pytest.raises(TalkerError, match="shape"):
        Talker.from_state_dict(tts, bad)


def test_weight_norm_head_is_g_v_over_row_norm():
    cfg = TalkerConfig(llm_dim=128, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       num_key_value_heads=2, num_hidden_layers=1)
    t = Talker(cfg)
    g = t.head_code[0].parametrizations.weight.original0
    v = t.head_code[0].parametrizations.weight.original1
    torch.testing.assert_close(t.head_weight(), g * v / v.norm(dim=1, keepdim=True))


def test_repetition_penalty_is_sign_aware_and_counted():
    from duplexkit.models.minicpmo45.sampling import repetition_penalty_counted as _apply_repetition_penalty

    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    recent = torch.tensor([4, 0, 0, 1])  # 4 == V: padding
    out = _apply_repetition_penalty(logits, recent, 1.05)
    torch.testing.assert_close(out, torch.tensor([2.0 / 1.05 ** 2, -2.0 * 1.05, 1.0, -1.0]))


def test_top_k_top_p_min_p_filters():
    cfg = TalkerConfig(llm_dim=128, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       num_key_value_heads=2, num_hidden_layers=1, num_audio_tokens=8)
    t = Talker(cfg)
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    pad = torch.full((16,), 8)
    p = t.sampling_probs(logits, pad, TalkerSampling(temperature=1.0, repetition_penalty=1.0, top_k=2))
    assert (p[2:] == 0).all() and p[:2].sum().item() == pytest.approx(1.0)
    p = t.sampling_probs(logits, pad, TalkerSampling(temperature=1.0, repetition_penalty=1.0, top_p=0.5))
    assert (p > 0).sum() == 1  # p(4.0) = 0.64 > 0.5 already
    p = t.sampling_probs(logits, pad, TalkerSampling(temperature=1.0, repetition_penalty=1.0, min_p=0.1))
    full = torch.softmax(logits, -1)
    assert ((p > 0) == (full >= 0.1 * full.max())).all()
    with pytest.raises(TalkerError):
        TalkerSampling(temperature=0.0)


def test_batched_decode_equals_one_by_one(tk_unit):
    """Items with different cache lengths decode together (left-padded KV + mask); codes, positions and
    the split-back caches equal running each item alone (greedy, so any numeric drift would show)."""
    talker, ids, h = tk_unit

    def run(batch: bool):
        ta, tb, tc = talker.new_turn(), talker.new_turn(), talker.new_turn()
        # give turn a a history so the three caches have different lengths (0, 32, 32+...)
        talker.generate_units([TalkerInput(ta, ids, h, temperature=0.0)])
        talker.generate_units([TalkerInput(tb, ids[:2], h[:2], temperature=0.0, turn_start=True)])
        items = [TalkerInput(ta, ids[1:4], h[1:4], temperature=0.0),
                 TalkerInput(tb, ids, h, temperature=0.0),
                 TalkerInput(tc, ids[2:], h[2:], temperature=0.0, budget=9)]
        first = talker.generate_units(items) if batch else [talker.generate_units([it])[0] for it in items]
        state = [(t.text_start_pos, t.cache.get_seq_length()) for t in (ta, tb, tc)]
        # a follow-up unit on each turn reads the split-back caches
        follow = [talker.generate_units([TalkerInput(t, ids[:3], h[:3], temperature=0.0)])[0] for t in (ta, tb, tc)]
        return first, state, follow

    one = run(False)
    bat = run(True)
    for x, y in zip(one[0] + one[2], bat[0] + bat[2]):
        np.testing.assert_array_equal(x, y)
    assert one[1] == bat[1]
    assert [len(c) for c in bat[0]] == [25, 25, 8]


def test_batched_sampling_uses_each_items_generator(tk_unit):
    talker, ids, h = tk_unit
    alone = []
    for seed in (21, 22):
        t = talker.new_turn()
        alone.append(talker.generate_units([TalkerInput(t, ids, h, generator=torch.Generator().manual_seed(seed))])[0])
    ta, tb = talker.new_turn(), talker.new_turn()
    both = talker.generate_units([TalkerInput(ta, ids, h, generator=torch.Generator().manual_seed(21)),
                                  TalkerInput(tb, ids, h, generator=torch.Generator().manual_seed(22))])
    np.testing.assert_array_equal(both[0], alone[0])
    np.testing.assert_array_equal(both[1], alone[1])
    with pytest.raises(TalkerError, match="twice"):
        talker.generate_units([TalkerInput(ta, ids, h), TalkerInput(ta, ids, h)])


def test_bfloat16_talker_generates(random_talker):
    sd = {"tts." + k: v for k, v in random_talker.state_dict().items()}
    t = Talker.from_state_dict(TINY_TTS, sd, dtype=torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.head_weight().dtype == torch.bfloat16
    rng = np.random.default_rng(1)
    ids, h = rng.integers(0, 151748, 4), rng.standard_normal((4, 128)).astype(np.float32)
    turn = t.new_turn()
    codes = t.generate_units([TalkerInput(turn, ids, h, generator=torch.Generator().manual_seed(0))])[0]
    assert codes.shape == (25,) and (codes < CODEC_EOS).all()
    assert turn.text_start_pos == 5 + 25


def test_batched_new_turns_then_batched_again(tk_unit):
    """Four new turns decoded in one batch, then again in one batch from the split-back caches (the
    engine's usual pattern with concurrent streams): equals running each turn alone, both units."""
    talker, ids, h = tk_unit

    def run(batch: bool):
        turns = [talker.new_turn() for _ in range(4)]
        units = []
        for first in (True, False):
            items = [TalkerInput(t, ids[k:], h[k:], temperature=0.0, turn_start=first) for k, t in enumerate(turns)]
            units.append(talker.generate_units(items) if batch else [talker.generate_units([it])[0] for it in items])
        return units, [(t.text_start_pos, t.cache.get_seq_length()) for t in turns]

    one, bat = run(False), run(True)
    for ua, ub in zip(one[0], bat[0]):
        for x, y in zip(ua, ub):
            np.testing.assert_array_equal(x, y)
    assert one[1] == bat[1]


def test_meta_construction_does_not_poison_lazy_imports():
    """Building a talker on the meta device must not turn module constants of lazily imported modules
    into meta tensors (torchaudio's kaldi EPSILON did, breaking every later fbank in the process)."""
    import subprocess
    import sys

    code = (
        "import os; os.environ['TORCHDYNAMO_DISABLE']='1'\n"
        "import torch\n"
        "from duplexkit.models.minicpmo45.talker import Talker, TalkerConfig\n"
        "from duplexkit.models.minicpmo45.meta import meta_device\n"
        "cfg = TalkerConfig.from_tts_config({'llm_dim': 128, 'hidden_size': 32, 'intermediate_size': 64,"
        " 'num_attention_heads': 2, 'num_key_value_heads': 2, 'num_hidden_layers': 1,"
        " 'audio_bos_token_id': 151687, 'text_eos_token_id': 151692})\n"
        "with meta_device():\n"
        "    Talker(cfg)\n"
        "import torchaudio.compliance.kaldi as kaldi\n"
        "assert not kaldi.EPSILON.is_meta\n"
        "x = kaldi.fbank(torch.randn(1, 16000), num_mel_bins=80, dither=0)\n"
        "print('ok', tuple(x.shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]
