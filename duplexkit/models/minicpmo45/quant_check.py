"""Quality of quantized weights against the unquantized model, per stage (docs/model.md
"Quantized weights"; used by ``benchmarks/quant_quality.py`` and tests/model/test_quantization.py).

Each check feeds the same inputs to a reference and a quantized stage and compares their float32
logits:

* ``rel_err``: ``‖L_q − L_ref‖_F / ‖L_ref‖_F`` over all compared rows;
* ``agreement``: the fraction of rows whose argmax (the greedy choice) is the same;
* ``free_run``: (decode checks) greedy steps the quantized stage runs on its own choices before its
  first id differs from the reference's own greedy run (``steps`` when none differs).

Decode steps are teacher-forced: both stages are fed the reference's greedy id at every step, so
one early difference does not make every later row incomparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

__all__ = ["LogitCheck", "compare_logits", "thinker_checks", "talker_check"]


@dataclass
class LogitCheck:
    """One stage's comparison (module doc). ``rows``: logit rows compared."""

    stage: str
    rel_err: float
    agreement: float
    rows: int
    free_run: int = -1


def compare_logits(stage: str, ref: torch.Tensor, got: torch.Tensor) -> LogitCheck:
    """``ref`` / ``got`` [N, V] logits -> :class:`LogitCheck` (relative Frobenius error, argmax agreement).

    Raises:
        ValueError: shapes differ.
    """
    if ref.shape != got.shape:
        raise ValueError(f"{stage}: logits of shape {tuple(got.shape)} vs reference {tuple(ref.shape)}")
    r, g = ref.double().reshape(-1, ref.shape[-1]), got.double().reshape(-1, ref.shape[-1])
    rel = float((g - r).norm() / r.norm().clamp_min(1e-30))
    agree = float((g.argmax(-1) == r.argmax(-1)).double().mean())
    return LogitCheck(stage, rel, agree, int(r.shape[0]))


@torch.inference_mode()
def _thinker_run(th, ids: Sequence[int], feed: Sequence[int]):
    """Prefill ``ids``, then feed ``feed`` one by one: (prefill logits [T, V], decode logits [S, V], hidden [T, H])."""
    kv = th.new_cache()
    h = th.forward_embeds(th.embed_ids(list(ids)), kv)
    pre = th.logits(h)
    dec = []
    last = pre[-1:]
    for t in feed:
        dec.append(last)
        last = th.logits(th.forward_embeds(th.embed_ids([int(t)]), kv))[-1:]
    return pre, torch.cat(dec) if dec else pre[:0], h


@torch.inference_mode()
def _thinker_greedy(th, ids: Sequence[int], steps: int) -> List[int]:
    kv = th.new_cache()
    last = th.logits(th.forward_embeds(th.embed_ids(list(ids)), kv))[-1]
    out = []
    for _ in range(steps):
        t = int(last.argmax())
        out.append(t)
        last = th.logits(th.forward_embeds(th.embed_ids([t]), kv))[-1]
    return out


def _prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def thinker_checks(ref, quant, ids: Sequence[int], steps: int = 20) -> List[LogitCheck]:
    """The thinker's prefill and decode checks (module doc) for prompt ``ids`` and ``steps`` greedy
    decode steps. ``ref`` / ``quant``: :class:`~.thinker.Thinker` (or a fast thinker: its eager
    ``DynamicCache`` path over the same layers)."""
    ref_ids = _thinker_greedy(ref, ids, steps)
    pre_r, dec_r, _ = _thinker_run(ref, ids, ref_ids)
    pre_q, dec_q, _ = _thinker_run(quant, ids, ref_ids)
    dec = compare_logits("thinker decode", dec_r, dec_q)
    dec.free_run = _prefix(ref_ids, _thinker_greedy(quant, ids, steps))
    return [compare_logits("thinker prefill", pre_r, pre_q), dec]


@torch.inference_mode()
def _talker_run(tk, token_ids, hidden, feed: Sequence[int]):
    turn = tk.new_turn()
    logits = tk.forward_embeds(turn, tk.prefill_embeds(token_ids, hidden))
    rows = [logits[-1:]]
    for c in feed[:-1]:
        emb = tk.code_embed(torch.tensor([int(c)], device=tk.device))
        rows.append(tk.forward_embeds(turn, emb)[-1:])
    return torch.cat(rows)


@torch.inference_mode()
def _talker_greedy(tk, token_ids, hidden, steps: int) -> List[int]:
    turn = tk.new_turn()
    last = tk.forward_embeds(turn, tk.prefill_embeds(token_ids, hidden))[-1]
    out = []
    for _ in range(steps):
        c = int(last.argmax())
        out.append(c)
        last = tk.forward_embeds(turn, tk.code_embed(torch.tensor([c], device=tk.device)))[-1]
    return out


def talker_check(ref, quant, token_ids, hidden: torch.Tensor, steps: int = 25) -> LogitCheck:
    """The talker's check (module doc): condition ``token_ids`` [L] + thinker ``hidden`` [L, llm_dim]
    (the same for both), then ``steps`` codec tokens (a duplex unit: 25). ``ref`` / ``quant``:
    :class:`~.talker.Talker` (a ``FastTalker``'s ``.talker``)."""
    ref = getattr(ref, "talker", ref)
    quant = getattr(quant, "talker", quant)
    codes = _talker_greedy(ref, token_ids, hidden, steps)
    chk = compare_logits("talker", _talker_run(ref, token_ids, hidden, codes),
                         _talker_run(quant, token_ids, hidden.to(quant.dtype), codes))
    chk.free_run = _prefix(codes, _talker_greedy(quant, token_ids, hidden.to(quant.dtype), steps))
    return chk
