"""duplexkit's own tiny checkpoint: builder, loader, duplex units, chat (no ../shared needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from duplexkit.models.minicpmo45 import DuplexPolicy, UnitInput


def _speech(n: int, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def test_tiny_checkpoint_layout_and_tokenizer(tiny_dir, tiny_model):
    names = {p.name for p in tiny_dir.iterdir()}
    for f in ("config.json", "model.safetensors", "generation_config.json", "preprocessor_config.json",
              "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "duplexkit_random_weights.json"):
        assert f in names
    assert "vocab.json" not in names  # its own tokenizer, never the reference files
    assert tiny_model.random_weights is True
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["model_type"] == "minicpmo" and cfg["hidden_size"] % 128 == 0 and cfg["query_num"] == 64
    tok = tiny_model.tokenizer
    assert len(tok) <= cfg["vocab_size"] <= cfg["tts_config"]["num_text_tokens"]
    sp = tiny_model.special
    assert sp.unit != 151683  # other ids than the real tokenizer: resolved by string
    assert tok.decode(tok.encode("Hello, how are you?")) == "Hello, how are you?"
    assert tok.encode("<unit>", add_special_tokens=False) == [sp.unit]
    from duplexkit.models.minicpmo45.tokenizer import encode_text

    assert sp.unit not in encode_text(tok, "say <unit> please")


def test_tiny_builder_is_deterministic(tiny_dir, tmp_path):
    from duplexkit.models.minicpmo45 import build_tiny_checkpoint

    again = build_tiny_checkpoint(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    other = build_tiny_checkpoint(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()


def test_tiny_checkpoint_cache(tmp_path, monkeypatch):
    from duplexkit.models.minicpmo45.tiny import tiny_checkpoint

    p1 = tiny_checkpoint(3, cache_dir=tmp_path)
    stamp = (p1 / "model.safetensors").stat().st_mtime_ns
    p2 = tiny_checkpoint(3, cache_dir=tmp_path)
    assert p1 == p2 and (p2 / "model.safetensors").stat().st_mtime_ns == stamp
    assert p1.name.startswith("tiny-") and p1.name.endswith("-3")


def test_duplex_units_shapes_and_state(tiny_model):
    th = tiny_model.thinker
    H = tiny_model.config.hidden_size
    st = th.new_stream(instructions="Be brief.", ref_audio=_speech(32000), temperature=0.7, seed=5)
    p0 = st.position
    assert p0 == st.prefix_len > 20
    a = _speech(16560 + 3 * 16000, seed=1)
    units = [a[:16560]] + [a[16560 + 16000 * i: 16560 + 16000 * (i + 1)] for i in range(3)]
    results = [th.step_units([UnitInput(stream=st, audio=u)])[0] for u in units]
    pos = p0
    for r in results:
        assert r.decision in ("listen", "speak")
        assert r.token_ids.dtype == np.int64 and r.hidden.dtype == torch.float32
        assert r.hidden.shape == (r.n_tokens, H) and len(r.token_ids) == r.n_tokens
        assert r.n_tokens <= 18  # budget 20: at most 19 decided tokens, the first is never recorded
        assert r.generated_ids[-1] == tiny_model.special.unit_end
        assert r.generated_ids[-2] in tiny_model.special.terminators
        assert set(r.timings) >= {"prefill_ms", "decode_ms", "decode_steps"}
        # <unit> + 10 audio embeddings + decided tokens + terminator + </unit>
        pos += 11 + len(r.generated_ids)
    assert st.position == pos
    assert st.whisper.positions == 200


def test_seeded_sampling_is_repeatable_and_batched_equals_single(tiny_model):
    th = tiny_model.thinker
    audio = _speech(16560, seed=2)

    def run(batch):
        s1 = th.new_stream(temperature=0.9, seed=11)
        s2 = th.new_stream(temperature=0.9, seed=12)
        if batch:
            return th.step_units([UnitInput(stream=s1, audio=audio), UnitInput(stream=s2, audio=audio)])
        return [th.step_units([UnitInput(stream=s, audio=audio)])[0] for s in (s1, s2)]

    a, b = run(True), run(False)
    for x, y in zip(a, b):
        assert x.generated_ids == y.generated_ids
        assert torch.allclose(x.hidden, y.hidden, atol=1e-5)
    with pytest.raises(ValueError):
        s = th.new_stream(temperature=0.0)
        th.step_units([UnitInput(stream=s, audio=audio), UnitInput(stream=s, audio=audio)])


def test_force_listen_force_speak_and_turn_state(tiny_model):
    th = tiny_model.thinker
    sp = tiny_model.special
    st = th.new_stream(temperature=0.0, force_listen_count=1)
    r0 = th.step_units([UnitInput(stream=st, audio=_speech(16560))])[0]
    assert r0.decision == "listen" and r0.generated_ids == [sp.listen, sp.unit_end] and r0.n_tokens == 0
    r1 = th.step_units([UnitInput(stream=st, audio=_speech(16000), force_listen=True)])[0]
    assert r1.decision == "listen" and r1.timings["decode_steps"] == 0
    assert st.turn_ended
    # force_speak: listen masked at the first decision, the turn opens
    r2 = th.step_units([UnitInput(stream=st, audio=_speech(16000), force_speak=True)])[0]
    assert r2.turn_start and r2.generated_ids[0] not in (sp.listen, sp.chunk_eos)
    assert r2.decision == "speak"
    if not r2.end_of_turn:
        assert st.turn_open
    th.end_turn(st)
    assert st.turn_ended
    # force_speak on a forced-listen unit carries over to the next unit
    th.step_units([UnitInput(stream=st, audio=_speech(16000), force_listen=True, force_speak=True)])
    assert st.force_speak_pending
    r4 = th.step_units([UnitInput(stream=st, audio=_speech(16000))])[0]
    assert r4.turn_start and not st.force_speak_pending
    th.close(st)
    with pytest.raises(ValueError):
        th.step_units([UnitInput(stream=st, audio=_speech(16000))])


def test_listen_rewritten_to_tts_bos_while_turn_open(tiny_model, monkeypatch):
    """A <|listen|> chosen by the main pass while the turn is open is fed as <|tts_bos|>."""
    from duplexkit.models.minicpmo45 import duplex

    th = tiny_model.thinker
    sp = tiny_model.special
    st = th.new_stream(temperature=0.0)
    calls = {"n": 0}
    real = duplex.choose_tokens

    def scripted(*a, **k):  # the main pass's choice replaced by a script (one row)
        calls["n"] += 1
        bnd, main = real(*a, **k)
        script = {1: sp.speak, 2: sp.listen, 3: sp.turn_eos, 4: sp.listen}
        return bnd, [script.get(calls["n"], main[0])]

    monkeypatch.setattr(duplex, "choose_tokens", scripted)
    st.policy = DuplexPolicy(temperature=0.0, budget=8)
    r = th.step_units([UnitInput(stream=st, audio=_speech(16560), force_speak=True)])[0]
    # listen while open -> tts_bos; after <|turn_eos|> a listen terminates the unit
    assert r.generated_ids == [sp.speak, sp.tts_bos, sp.turn_eos, sp.listen, sp.unit_end]
    assert r.token_ids.tolist() == [sp.tts_bos, sp.turn_eos]
    assert r.end_of_turn and st.turn_ended and r.turn_start
    assert r.decision == "speak"  # it spoke: the talker gets its tokens
    # budget 3: at most 2 decided tokens, then <|chunk_eos|> is fed
    calls["n"] = 10
    st.policy = DuplexPolicy(temperature=0.0, budget=3)
    r2 = th.step_units([UnitInput(stream=st, audio=_speech(16000), force_speak=True)])[0]
    assert len(r2.generated_ids) <= 4 and r2.generated_ids[-2:] == [sp.chunk_eos, sp.unit_end]


def test_repetition_penalty_divides_whatever_the_sign(tiny_model):
    from duplexkit.models.minicpmo45.duplex import main_pass_logits

    th = tiny_model.thinker
    sp = tiny_model.special
    st = th.new_stream(policy=DuplexPolicy(temperature=0.0, repetition_penalty=2.0))
    logits = torch.zeros(tiny_model.config.vocab_size)
    logits[5], logits[6], logits[sp.turn_eos] = 4.0, -4.0, -1.0
    st.history = [5, 6, 6]
    x = main_pass_logits(th, [st], logits[None], mask_listen=[True], must_continue=[False])[0]
    assert x[5] == 2.0 and x[6] == -2.0  # divided, even when negative
    assert torch.isclose(x[sp.turn_eos], torch.tensor(-1.1))
    assert x[sp.listen] == float("-inf") and x[sp.chunk_eos] == float("-inf") and x[sp.tts_pad] == float("-inf")


def test_tiny_chat_text_and_audio(tiny_model):
    th = tiny_model.thinker
    r = th.chat([{"role": "user", "content": "Hello there."}], use_tts_template=False, max_tokens=5, temperature=0.0)
    assert r.finish_reason in ("stop", "length") and len(r.token_ids) <= 5
    assert r.tts_token_ids.size == 0
    r2 = th.chat([{"role": "user", "content": [_speech(24000), "What did you hear?"]}], max_tokens=4, temperature=0.7, seed=3)
    assert r2.prompt_tokens > 15  # 15 audio placeholders for 1.5 s
    assert r2.tts_hidden.shape == (len(r2.tts_token_ids), tiny_model.config.hidden_size)
    r3 = th.chat([{"role": "user", "content": [_speech(24000), "What did you hear?"]}], max_tokens=4, temperature=0.7, seed=3)
    assert r3.token_ids.tolist() == r2.token_ids.tolist()


def test_tiny_frame_rides_unit(tiny_model):
    th = tiny_model.thinker
    st = th.new_stream(temperature=0.0)
    frame = np.random.default_rng(0).integers(0, 255, (300, 400, 3), dtype=np.uint8)
    p = st.position
    r = th.step_units([UnitInput(stream=st, audio=_speech(16560), frame=frame)])[0]
    # <unit> <image> 64 </image> 10 audio + tokens + terminator + </unit>
    assert st.position == p + 1 + 66 + 10 + len(r.generated_ids)
