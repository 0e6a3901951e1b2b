"""Forced speech (``SpeakText``, docs/model.md "Forced speech") in the duplex unit loop, on the tiny
checkpoint: the rule (``duplex.forced_plan`` / ``start_unit`` / ``plan_step`` / ``decide``), the eager
``run_unit`` and the batched ``FastThinker.step_units`` (with and without the one-step lookahead)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duplexkit.models.minicpmo45 import DuplexPolicy, UnitInput
from duplexkit.models.minicpmo45 import duplex as D
from duplexkit.models.minicpmo45.fast_thinker import FastThinker
from duplexkit.models.minicpmo45.tokenizer import encode_text

TEXT = "Hello there, the train leaves at ten. See you tomorrow morning!"


def _audio(unit: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * seed + unit)
    return (0.1 * rng.standard_normal(16560 if unit == 0 else 16000)).astype(np.float32)


def _run(th, policy, n_units, speak_at=None, text=TEXT, per_unit=4, seed=7, force_listen=(), extra=None):
    """``n_units`` units of one stream; ``speak_text`` before unit ``speak_at``. Returns (results, stream
    state summary)."""
    st = th.new_stream(policy=policy, seed=seed)
    out = []
    for i in range(n_units):
        if i == speak_at:
            th.speak_text(st, text, per_unit)
            if extra:
                th.speak_text(st, *extra)
        (r,) = th.step_units([UnitInput(st, _audio(i), force_listen=i in force_listen)])
        assert not isinstance(r, Exception), r
        out.append(r)
    state = dict(forced=list(st.forced), history=list(st.history), pending=list(st.pending_ids),
                 turn_ended=st.turn_ended, gen=None if st.generator is None else st.generator.get_state().clone())
    th.close(st)
    return out, state


@pytest.fixture(scope="module")
def fast(tiny_model):
    return (FastThinker.from_thinker(tiny_model.thinker, cuda_graphs=False, slots=3, lookahead=False),
            FastThinker.from_thinker(tiny_model.thinker, cuda_graphs=False, slots=3, lookahead=True))


# ------------------------------------------------------------------------------ the rule (pure)
class _Sp:
    speak, turn_eos, chunk_eos, listen, tts_bos = 1, 2, 3, 4, 5
    terminators = frozenset((3, 4, 6))


def test_forced_plan_layout_and_turn_end():
    pol = DuplexPolicy()
    ids = [10, 11, 12, 13, 14, 15, 16]
    p = D.forced_plan(_Sp, pol, ids, 3, lambda x: "x" * len(x))
    assert p.tokens == (1, 10, 11, 12) and p.taken == 3 and not p.ends_text
    p = D.forced_plan(_Sp, pol, ids[6:], 3, lambda x: "x")
    assert p.tokens == (1, 16, 2) and p.taken == 1 and p.ends_text  # <|speak|>, the last id, <|turn_eos|>
    # a unit of 4 steps decides 3 tokens: <|speak|> + 2 ids; the turn end moves to a unit of its own
    small = DuplexPolicy(max_unit_tokens=3)
    p = D.forced_plan(_Sp, small, [10, 11], 6, lambda x: "x")
    assert p.tokens == (1, 10, 11) and not p.ends_text
    assert D.forced_plan(_Sp, small, [], 6, lambda x: "").tokens == (1, 2)


def test_forced_plan_never_cuts_a_utf8_character():
    # ids 20-22 are the three bytes of one character: a cut after 20 or 21 would end in U+FFFD
    def decode(x):
        whole = [i for i in x if i < 20 or i == 22]
        return "y" * len(whole) + ("\ufffd" if x and x[-1] in (20, 21) else "")

    p = D.forced_plan(_Sp, DuplexPolicy(), [10, 20, 21, 22, 11], 2, decode)
    assert p.taken == 1  # shortened to the clean cut
    p = D.forced_plan(_Sp, DuplexPolicy(), [20, 21, 22, 11], 2, decode)
    assert p.taken == 3  # nothing shorter is clean: lengthened


def test_start_plan_decide_for_forced_rows():
    pol = DuplexPolicy(force_listen_count=5, min_unit_tokens=4)
    s = D.start_unit(pol, 0, True, False, True, True, forced_text=True)
    assert not s.forced_listen and s.force_speak and not s.force_speak_pending and s.turn_start
    assert not D.start_unit(pol, 0, False, False, False, False, forced_text=True).turn_start  # turn was open
    plan = D.plan_step(pol, 0, True, True, forced=(1, 10, 2))
    assert plan.forced == 1 and not plan.boundary and not plan.cut and not plan.must_continue
    assert D.plan_step(pol, 3, True, False, forced=(1, 10, 2)).cut
    d = D.decide(_Sp, plan, 0, 3, 99, True)  # the passes' choices are ignored
    assert d.token == 1 and not d.record and not d.terminator and d.turn_start
    d = D.decide(_Sp, D.plan_step(pol, 2, True, False, forced=(1, 10, 2)), 2, 3, 99, False)
    assert d.token == 2 and d.end_of_turn and d.record and d.turn_ended


# ------------------------------------------------------------------------------ eager and batched
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_forced_units_decide_exactly_the_text(tiny_model, temperature):
    th = tiny_model.thinker
    sp = th.special
    ids = encode_text(th.tokenizer, TEXT)
    per = 4
    n_forced = -(-len(ids) // per)
    res, state = _run(th, DuplexPolicy(temperature=temperature), 2 + n_forced + 2, speak_at=2, per_unit=per,
                      force_listen={0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20})
    forced = res[2:2 + n_forced]
    spoken = []
    for k, r in enumerate(forced):
        assert r.decision == "speak" and r.turn_start == (k == 0)
        chunk = ids[k * per:(k + 1) * per]
        last = k == n_forced - 1
        assert r.generated_ids == [sp.speak] + chunk + ([sp.turn_eos] if last else []) + [sp.chunk_eos, sp.unit_end]
        assert list(r.token_ids) == chunk + ([sp.turn_eos] if last else [])
        assert r.end_of_turn == last and r.n_tokens == len(r.token_ids)
        assert r.hidden.shape == (len(r.token_ids), th.hidden_size) and torch.isfinite(r.hidden).all()
        spoken.append(r.text)
    assert "".join(spoken) == TEXT
    assert state["forced"] == []
    # force_listen held every other unit (units 0-1 before, the rest after the text): forced text won
    assert [r.decision for r in res[:2] + res[2 + n_forced:]] == ["listen"] * 4
    # the forced tokens joined the repetition history like sampled ones
    assert state["history"][-(len(ids) + 1 + n_forced):].count(sp.speak) >= 1


def test_forced_hidden_rows_are_the_fed_tokens_states(tiny_model):
    """The recorded rows are the final-norm states at the forced tokens' own positions: feeding the
    same ids into a copy of the KV reproduces them."""
    th = tiny_model.thinker
    st = th.new_stream(policy=DuplexPolicy(temperature=0.0))
    th.speak_text(st, "Good night, sleep well.", 3)
    logits = th.prefill_unit(st, _audio(0), None)
    import copy
    kv0 = copy.deepcopy(st.kv)
    row = D.begin_row(th, 0, UnitInput(st, _audio(0)), 0)

    def feed(sts, toks):
        h, lg = th.feed_token(sts[0], toks[0])
        return h[None], lg[None]

    D.decode_rows(th, [row], logits[None], feed, lambda s: s.generator)
    r = D.finish_row(th, row, {})
    ids = encode_text(th.tokenizer, "Good night, sleep well.")[:3]
    h = th.forward_embeds(th.embed_ids([th.special.speak] + ids), kv0)
    np.testing.assert_allclose(r.hidden.numpy(), h[1:].float().numpy(), atol=1e-5)
    th.close(st)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_eager_equals_batched_and_lookahead(tiny_model, fast, temperature):
    pol = dict(temperature=temperature)
    kw = dict(n_units=9, speak_at=1, per_unit=5, extra=("Thank you.", 2))
    ref, s_ref = _run(tiny_model.thinker, DuplexPolicy(**pol), **kw)
    for th in fast:
        hits = th.stats["lookahead_hits"]
        got, s_got = _run(th, DuplexPolicy(**pol), **kw)
        assert (th.stats["lookahead_hits"] > hits) == th.lookahead  # forced rows ride the launched steps
        for a, b in zip(ref, got):
            assert a.generated_ids == b.generated_ids
            assert (a.decision, a.turn_start, a.end_of_turn, a.text) == (b.decision, b.turn_start, b.end_of_turn, b.text)
            np.testing.assert_allclose(a.hidden.numpy(), b.hidden.numpy(), atol=1e-4)
        assert (s_ref["forced"], s_ref["history"], s_ref["pending"], s_ref["turn_ended"]) == \
               (s_got["forced"], s_got["history"], s_got["pending"], s_got["turn_ended"])
        assert (s_ref["gen"] is None) == (s_got["gen"] is None)
        assert s_ref["gen"] is None or torch.equal(s_ref["gen"], s_got["gen"])
    texts = "".join(r.text for r in ref)
    assert TEXT in texts and "Thank you." in texts
    assert sum(r.end_of_turn for r in ref) >= 2  # two texts, two turns


def test_batch_of_forced_and_free_streams(tiny_model, fast):
    """One batch with a forced stream beside sampling ones: each gets its single-stream result."""
    pol = DuplexPolicy(temperature=0.0, min_unit_tokens=2)
    single_forced, _ = _run(tiny_model.thinker, pol, 3, speak_at=0, per_unit=6)
    single_free, _ = _run(tiny_model.thinker, DuplexPolicy(temperature=0.0, min_unit_tokens=2), 3, seed=7)
    for th in fast:
        a = th.new_stream(policy=DuplexPolicy(temperature=0.0, min_unit_tokens=2), seed=7)
        b = th.new_stream(policy=DuplexPolicy(temperature=0.0, min_unit_tokens=2), seed=7)
        th.speak_text(a, TEXT, 6)
        for i in range(3):
            ra, rb = th.step_units([UnitInput(a, _audio(i)), UnitInput(b, _audio(i))])
            assert ra.generated_ids == single_forced[i].generated_ids
            assert rb.generated_ids == single_free[i].generated_ids
        th.close(a)
        th.close(b)


def test_end_turn_drops_the_forced_text_and_the_next_unit_is_free(tiny_model):
    th = tiny_model.thinker
    sp = th.special
    st = th.new_stream(policy=DuplexPolicy(temperature=0.0))
    th.speak_text(st, TEXT, 3)
    (r,) = th.step_units([UnitInput(st, _audio(0))])
    assert r.generated_ids[0] == sp.speak and st.forced
    th.end_turn(st)  # a CancelEpoch
    assert st.forced == [] and st.turn_ended
    (r,) = th.step_units([UnitInput(st, _audio(1), force_listen=True)])
    assert r.decision == "listen"
    th.close(st)


def test_speak_text_refuses_what_it_cannot_speak(tiny_model):
    th = tiny_model.thinker
    st = th.new_stream(policy=DuplexPolicy(temperature=0.0))
    for text, per, match in (("", 4, "non-empty"), (None, 4, "non-empty"), ("hi", 0, "tokens_per_unit")):
        with pytest.raises(ValueError, match=match):
            th.speak_text(st, text, per)
    assert st.forced == []
    tight = th.new_stream(policy=DuplexPolicy(temperature=0.0, max_unit_tokens=1))
    with pytest.raises(ValueError, match="cannot hold forced speech"):
        th.speak_text(tight, "hi", 4)
    th.close(tight)
    th.close(st)
    with pytest.raises(ValueError, match="closed"):
        th.speak_text(st, "hi", 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_forced_units_with_cuda_graphs_and_lookahead(tiny_dir, temperature):
    """On a GPU: forced rows through the captured decode graphs, with and without the lookahead (the
    forced ids written into the launched choices on the device) give the same units, and the forced
    units hold exactly the text's ids."""
    from duplexkit.models.minicpmo45 import load

    model = load(tiny_dir, devices="cuda", with_code2wav=False, with_talker=False, progress=False)
    sp = model.thinker.special
    ids = encode_text(model.thinker.tokenizer, TEXT)
    runs = []
    for lookahead in (False, True):
        th = FastThinker.from_thinker(model.thinker, cuda_graphs=True, slots=3, lookahead=lookahead)
        st = th.new_stream(policy=DuplexPolicy(temperature=temperature), seed=5)
        free = th.new_stream(policy=DuplexPolicy(temperature=temperature, min_unit_tokens=3), seed=6)
        th.speak_text(st, TEXT, 5)
        res = []
        for i in range(6):
            a, b = th.step_units([UnitInput(st, _audio(i)), UnitInput(free, _audio(i, 1), force_speak=i == 0)])
            res.append((a.generated_ids, b.generated_ids, a.hidden.cpu()))
        torch.cuda.synchronize()
        th.close(st)
        th.close(free)
        runs.append(res)
    for (ga, gb, ha), (la, lb, hl) in zip(*runs):
        assert ga == la and gb == lb
        torch.testing.assert_close(ha, hl, atol=1e-4, rtol=0)
    forced = [r[0] for r in runs[0]][: -(-len(ids) // 5)]
    assert [t for g in forced for t in g if t not in (sp.speak, sp.turn_eos, sp.chunk_eos, sp.unit_end)] == ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_short_session_prefix_after_graph_warmup_opens_on_cuda(tiny_dir):
    """On a GPU: the captured graphs' input buffers are inference tensors (warmed under inference
    mode); a stream whose session prefix fits the prefill graph (no instructions, at most
    ``PREFILL_TOKENS`` positions) opened after the warm-up writes into them (a RuntimeError
    "Inplace update to inference tensor outside InferenceMode" before the fix, seen in
    benchmarks/tools_latency.py at real size)."""
    from duplexkit.models.minicpmo45 import load
    from duplexkit.models.minicpmo45.fast_thinker import PREFILL_TOKENS

    model = load(tiny_dir, devices="cuda", with_code2wav=False, with_talker=False, progress=False)
    th = FastThinker.from_thinker(model.thinker, cuda_graphs=True, slots=2)
    th.warmup(batch_sizes=(1,), max_kv_len=256)
    prefix = th.session_prefix("", None, None)
    n = sum(len(p) if isinstance(p, list) else p.shape[0] for p in prefix)
    assert n <= PREFILL_TOKENS, "this case needs a prefix the prefill graph takes"
    st = th.new_stream(instructions="", policy=DuplexPolicy(temperature=0.0), seed=1)
    (r,) = th.step_units([UnitInput(st, _audio(0), force_speak=True)])
    torch.cuda.synchronize()
    assert r.generated_ids
    th.close(st)
