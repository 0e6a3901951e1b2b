"""The one sampler of MiniCPM-o 4.5 decoding: logit penalties, filters and Gumbel-max sampling.

Every decoding loop of the package (the duplex unit loop in :mod:`.duplex` and :mod:`.fast_thinker`,
offline chat in :mod:`.chat`, the talker in :mod:`.talker_decode` and :mod:`.fast_talker`) uses these
functions, on every device; no other module writes a penalty formula, a filter or a sampling draw
(``tests/unit/test_import_rules.py`` checks it).

Shapes: logits are float ``[V]`` or ``[N, V]`` (one row per stream); every function works on the last
axis and keeps the leading ones.

**Penalties, named by their semantics** (docs/model.md §4-§6):

* :func:`repetition_penalty_hf` -- HF ``RepetitionPenaltyLogitsProcessor``: each id of a *seen set* is
  divided by the penalty when its logit is positive and multiplied when negative (offline chat, 1.02
  over prompt and generated ids).
* :func:`repetition_penalty_divide` -- the reference duplex loop: each id of a seen set is *divided*
  by the penalty whatever its sign (1.05 over the distinct ids among the last 512 main-pass choices).
* :func:`repetition_penalty_counted` -- the reference talker: sign-aware like HF but with factor
  ``penalty ** count``, ``count`` = occurrences in a fixed window of recent codes (1.05 over 16 codes).
* :func:`sign_aware_scale` -- the sign-aware formula the other two sign-aware penalties and the duplex
  ``<|turn_eos|>`` length penalty (÷1.1 if positive, ×1.1 otherwise) share.

**Filters** (:func:`filter_logits`) set removed ids to ``-inf`` and keep vocabulary order: top-k keeps
the logits ``>=`` the k-th largest, top-p the smallest set of largest logits whose mass reaches
``top_p`` (the largest always), min-p the ids whose probability is at least ``min_p`` times the
largest. Each is off when None (top-k also at 0 or ``>= V``, top-p at ``>= 1``, min-p at 0).

**Sampling** is the Gumbel-max trick: ``argmax(x - log(E))`` with ``E ~ Exp(1)`` drawn from the
stream's own :class:`torch.Generator` (:func:`exp_noise`); this picks id ``i`` with probability
``softmax(x)[i]``, like ``torch.multinomial``, and runs without a host sync (so inside CUDA graphs).
The noise has one entry per vocabulary id, in vocabulary order, whatever the filters: two paths that
draw the same numbers pick the same id unless their logits differ by more than the winning margin.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "Factor",
    "device_tensor",
    "sign_aware_scale",
    "repetition_penalty_hf",
    "repetition_penalty_divide",
    "repetition_penalty_counted",
    "seen_mask_rows",
    "apply_temperature",
    "top_k_filter",
    "top_p_filter",
    "min_p_filter",
    "filter_logits",
    "filtered_probs",
    "exp_noise",
    "sample_with_noise",
    "sample",
]

Factor = Union[float, torch.Tensor]
"""A penalty / temperature: a Python float, or a float tensor broadcastable to the logits (e.g. ``[N, 1]``
per row)."""

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------- penalties
def sign_aware_scale(x: torch.Tensor, factor: Factor) -> torch.Tensor:
    """``x / factor`` where ``x > 0``, else ``x * factor`` (elementwise; HF's repetition-penalty formula)."""
    return torch.where(x > 0, x / factor, x * factor)


def repetition_penalty_hf(logits: torch.Tensor, seen: torch.Tensor, penalty: Factor) -> torch.Tensor:
    """HF repetition penalty: :func:`sign_aware_scale` on the ids of ``seen`` (bool ``[..., V]``),
    the other logits unchanged. Returns a new tensor."""
    return torch.where(seen, sign_aware_scale(logits, penalty), logits)


def repetition_penalty_divide(logits: torch.Tensor, seen: torch.Tensor, penalty: Factor) -> torch.Tensor:
    """Reference duplex penalty: the logits of the ids in ``seen`` (bool ``[..., V]``) divided by
    ``penalty`` whatever their sign (a negative logit moves *up*). Returns a new tensor."""
    return torch.where(seen, logits / penalty, logits)


def repetition_penalty_counted(logits: torch.Tensor, window: torch.Tensor, penalty: Factor) -> torch.Tensor:
    """Reference talker penalty: :func:`sign_aware_scale` with factor ``penalty ** count``.

    Args:
        logits: float ``[..., V]``.
        window: int64 ``[..., W]`` recent ids; entries equal to ``V`` are padding (not counted).
        penalty: float, or a float tensor ``[..., 1]`` per row.
    """
    V = logits.shape[-1]
    counts = torch.zeros(*logits.shape[:-1], V + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(-1, window, torch.ones_like(window, dtype=logits.dtype))
    if not torch.is_tensor(penalty):
        penalty = torch.tensor(penalty, dtype=logits.dtype, device=logits.device)
    return sign_aware_scale(logits, torch.pow(penalty, counts[..., :V]))


def device_tensor(data: Any, device: Union[str, torch.device], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.tensor(data)`` on ``device`` without a host sync: on CUDA the host copy is pinned and
    copied with ``non_blocking=True`` (a plain ``torch.tensor(..., device="cuda")`` from pageable
    memory waits until the stream's queued kernels are done, once per call, which on a stream shared
    with other stages means waiting for their work too)."""
    device = torch.device(device)
    host = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def seen_mask_rows(id_lists: Sequence[Sequence[int]], vocab_size: int,
                   device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """Bool ``[len(id_lists), vocab_size]``: row ``r`` marks the ids of ``id_lists[r]`` (repeats and
    order do not matter; every id must be in ``[0, vocab_size)``)."""
    n = len(id_lists)
    W = max((len(ids) for ids in id_lists), default=0)
    idx = torch.full((n, max(W, 1)), vocab_size, dtype=torch.long)
    for r, ids in enumerate(id_lists):
        if len(ids):
            idx[r, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
    m = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=device)
    if torch.device(device).type == "cuda":
        idx = idx.pin_memory()
    m.scatter_(1, idx.to(device, non_blocking=True), True)
    return m[:, :vocab_size]


# ---------------------------------------------------------------------------------------- filters
def apply_temperature(logits: torch.Tensor, temperature: Factor) -> torch.Tensor:
    """``logits / temperature`` (temperature > 0; a float or a ``[N, 1]`` tensor)."""
    return logits / temperature


def _on(top_k: Optional[int], top_p: Optional[float], min_p: Optional[float], V: int) -> Tuple[bool, bool, bool]:
    return bool(top_k) and 0 < int(top_k) < V, top_p is not None and top_p < 1.0, bool(min_p) and min_p > 0


def top_k_filter(x: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the logits ``>=`` the ``top_k``-th largest (ties at the boundary kept), the rest ``-inf``."""
    kth = torch.topk(x, int(top_k), dim=-1).values[..., -1:]
    return x.masked_fill(x < kth, _NEG_INF)


def top_p_filter(x: torch.Tensor, top_p: float, top_k: Optional[int] = None) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of largest logits whose probability mass reaches ``top_p``
    (the largest always; logits equal to the last kept one kept too), the rest ``-inf``. ``top_k``:
    the logits are already top-k filtered (only the ``top_k`` largest are sorted)."""
    if top_k and 0 < int(top_k) < x.shape[-1]:
        vals = torch.topk(x, int(top_k), dim=-1).values
    else:
        vals = torch.sort(x, dim=-1, descending=True).values
    pr = torch.softmax(vals, dim=-1)
    remove = (pr.cumsum(-1) - pr) >= top_p
    remove[..., 0] = False
    last = vals.gather(-1, ((~remove).sum(-1, keepdim=True) - 1))
    return x.masked_fill(x < last, _NEG_INF)


def min_p_filter(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the ids whose probability is below ``min_p`` times the largest one (``-inf``)."""
    pr = torch.softmax(x, dim=-1)
    return x.masked_fill(pr < min_p * pr.amax(dim=-1, keepdim=True), _NEG_INF)


def filter_logits(x: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None,
                  min_p: Optional[float] = None) -> torch.Tensor:
    """Top-k, then top-p, then min-p (each off when None / 0 / its neutral value); removed ids ``-inf``,
    the others unchanged, in vocabulary order."""
    use_k, use_p, use_m = _on(top_k, top_p, min_p, x.shape[-1])
    if use_k:
        x = top_k_filter(x, int(top_k))
    if use_p:
        x = top_p_filter(x, float(top_p), top_k if use_k else None)
    if use_m:
        x = min_p_filter(x, float(min_p))
    return x


def filtered_probs(x: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None,
                   min_p: Optional[float] = None) -> torch.Tensor:
    """The sampling distribution ``[..., V]`` (float32) of penalised / temperature-scaled logits after
    the filters (0 for removed ids)."""
    return torch.softmax(filter_logits(x.float(), top_k, top_p, min_p), dim=-1)


# ---------------------------------------------------------------------------------------- sampling
def exp_noise(generators: Sequence[Optional[torch.Generator]], width: int,
              device: Union[str, torch.device]) -> torch.Tensor:
    """Exp(1) noise float32 ``[len(generators), width]`` on ``device``, row ``r`` drawn from
    ``generators[r]`` (on that generator's device, then moved; ``None`` = the default generator)."""
    device = torch.device(device)
    out = torch.empty(len(generators), width, dtype=torch.float32, device=device)
    for r, g in enumerate(generators):
        if g is None or g.device == out.device:
            out[r].exponential_(generator=g)
        else:
            out[r].copy_(torch.empty(width, dtype=torch.float32, device=g.device).exponential_(generator=g))
    return out


def sample_with_noise(x: torch.Tensor, noise: torch.Tensor, top_k: Optional[int] = None,
                      top_p: Optional[float] = None, min_p: Optional[float] = None) -> torch.Tensor:
    """Gumbel-max sample of temperature-scaled logits ``x [..., V]`` after the filters, with Exp(1)
    noise ``[..., V]`` (entry ``i`` belongs to id ``i``): ``argmax(filter(x) - log(noise))``. Returns
    int64 ids ``[...]``. Graph-capturable (no host sync)."""
    return torch.argmax(filter_logits(x, top_k, top_p, min_p) - torch.log(noise), dim=-1)


def sample(x: torch.Tensor, generators: Sequence[Optional[torch.Generator]], *, temperature: Factor = 1.0,
           top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None) -> torch.Tensor:
    """Sample one id per row of logits ``x [N, V]``: temperature, the filters, then Gumbel-max with
    row ``r``'s noise ``[V]`` drawn from ``generators[r]``. Returns int64 ``[N]`` on ``x.device``.

    Raises:
        ValueError: ``x`` is not ``[N, V]`` with ``N == len(generators)``.
    """
    if x.dim() != 2 or len(generators) != x.shape[0]:
        raise ValueError(f"need logits [N, V] and N generators, got {tuple(x.shape)} and {len(generators)}")
    noise = exp_noise(generators, x.shape[-1], x.device)
    return sample_with_noise(apply_temperature(x, temperature), noise, top_k, top_p, min_p)
