"""The vLLM decision processor's rule (duplexkit.engine.vllm_duplex.decide_token, step by step from a
unit's output tokens) and the host-side replay (VllmDuplexThinker._finish) against the native unit
loop (duplex.decode_rows / finish_row) on scripted logits: the same tokens, terminators, recorded ids,
turn state and repetition history, greedy and sampled. No vLLM needed (torch only)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from duplexkit.engine.vllm_duplex import (  # noqa: E402
    EXTRA_KEY,
    VllmDuplexThinker,
    _Rule,
    decide_token,
    decide_tokens,
    decision_args,
)
from duplexkit.models.minicpmo45 import duplex as D  # noqa: E402
from duplexkit.models.minicpmo45.thinker import ThinkerStream  # noqa: E402

V = 64
SP = SimpleNamespace(listen=1, speak=2, tts_bos=3, turn_eos=4, chunk_eos=5, chunk_tts_eos=6, im_end=7, unit_end=8,
                     unk=9, tts_pad=10, terminators=(1, 5, 6))


def _thinker():
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    return SimpleNamespace(special=SP, config=SimpleNamespace(vocab_size=V), forbidden_ids=[5, 10, 11],
                           continue_mask_ids=[1, 4, 5, 6], tokenizer=tok, hidden_size=4, device=torch.device("cpu"))


def _logits(rng, n: int) -> list:
    """Step logits: noise plus random boosts of the special ids, so units end in every way."""
    out = []
    for _ in range(n):
        x = rng.normal(0, 1.0, V).astype(np.float32)
        for t, p in ((1, 0.15), (4, 0.1), (5, 0.1), (6, 0.05), (3, 0.1)):
            if rng.random() < p:
                x[t] += 6.0
        out.append(torch.from_numpy(x))
    return out


def _native_unit(th, st, flags, steps):
    row = D.begin_row(th, 0, D.UnitInput(stream=st, audio=np.zeros(16000, np.float32), force_listen=flags[0],
                                         force_speak=flags[1]), 0)
    k = [0]

    def feed(sts, toks):
        k[0] += 1
        return torch.zeros(1, 4), steps[k[0]][None]

    D.decode_rows(th, [row], steps[0][None], feed, lambda s: s.generator)
    return D.finish_row(th, row, {})


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_decide_token_and_replay_equal_the_native_unit_loop(temperature):
    th = _thinker()
    rng = np.random.default_rng(3)
    pol = dict(temperature=temperature, force_listen_count=1, min_unit_tokens=0)
    a = ThinkerStream("a", D.DuplexPolicy(**pol), kv=None, generator=torch.Generator().manual_seed(5) if temperature else None)
    b = ThinkerStream("b", D.DuplexPolicy(**pol), kv=None, generator=None)
    gen_b = torch.Generator().manual_seed(5) if temperature else None
    vt = VllmDuplexThinker(th, engine=None, max_model_len=10**6, hidden=False)
    kinds = set()
    for u in range(40):
        flags = (u % 11 == 7, u % 5 == 3)  # forced listen / forced speak now and then
        steps = _logits(rng, 21)
        a.pending_ids = []  # the native prefill consumes them
        want = _native_unit(th, a, flags, steps)
        s = D.start_unit(b.policy, b.units_done, flags[0], flags[1], b.force_speak_pending, b.turn_ended)
        b.force_speak_pending, b.turn_ended = s.force_speak_pending, s.turn_ended
        args = decision_args(th, b, s, "b", 5)
        assert set(args) >= {"policy", "history", "key"} and EXTRA_KEY == "duplexkit"
        rule, out = _Rule(args, V), []
        limit = 1 if s.forced_listen else b.policy.unit_limit()
        while len(out) < limit:
            out.append(decide_token(rule, steps[len(out)], out, gen_b))
            if out[-1] in SP.terminators:
                break
        got = vt._finish(b, s, [0], out, None, {})
        assert got.generated_ids == want.generated_ids, u
        assert got.token_ids.tolist() == want.token_ids.tolist()
        assert (got.decision, got.turn_start, got.end_of_turn) == (want.decision, want.turn_start, want.end_of_turn)
        assert (b.turn_ended, b.history, b.pending_ids, b.units_done) == (a.turn_ended, a.history, a.pending_ids, a.units_done)
        kinds.add((want.decision, want.generated_ids[-2], want.end_of_turn))
    # every way a unit ends occurred: forced listen, listen, chunk_eos (boundary or cut), turn_eos, chunk_tts_eos
    assert {k[1] for k in kinds} >= {1, 5} and any(k[2] for k in kinds) and any(k[0] == "listen" for k in kinds)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_decide_tokens_of_a_step_equal_row_by_row(temperature):
    """The processor decides every row of an engine step in one batch (decide_tokens); each row must
    get the token decide_token gives it alone, with its own generator, over many steps of 6 streams
    in mixed states (forced listen, forced speak, after a turn end, mid-unit)."""
    th = _thinker()
    rng = np.random.default_rng(11)
    n = 6
    pol = D.DuplexPolicy(temperature=temperature, min_unit_tokens=2, max_unit_tokens=6)
    gens_a = [torch.Generator().manual_seed(100 + r) if temperature else None for r in range(n)]
    gens_b = [torch.Generator().manual_seed(100 + r) if temperature else None for r in range(n)]
    seen = set()
    for step in range(60):
        rules, outs = [], []
        for r in range(n):
            st = ThinkerStream(f"s{r}", pol, kv=None, generator=None)
            st.turn_ended = bool(rng.random() < 0.3)
            st.history = [int(t) for t in rng.integers(12, V, 5)]
            flags = (bool(rng.random() < 0.15), bool(rng.random() < 0.3))
            s = D.start_unit(pol, 3, flags[0], flags[1], False, st.turn_ended)
            rules.append(_Rule(decision_args(th, st, s, f"s{r}", r), V))
            outs.append([int(t) for t in rng.integers(12, V, int(rng.integers(0, 7)))])
        logits = torch.stack(_logits(rng, n))
        batched = decide_tokens(rules, logits, outs, gens_a)
        alone = [decide_token(rules[r], logits[r], outs[r], gens_b[r]) for r in range(n)]
        assert batched == alone, step
        seen.update(batched)
    assert {SP.listen, SP.chunk_eos} <= seen and len(seen) > 8  # forced listens, cuts and model choices
