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

**Filters** work on the candidates of :func:`candidates` (the ``top_k`` largest logits, or all of them
sorted, descending): :func:`top_p_filter` keeps the smallest prefix whose mass reaches ``top_p`` (the
first candidate always), :func:`min_p_filter` drops candidates below ``min_p`` times the largest
probability. A removed candidate gets ``-inf``.

**Sampling** is the Gumbel-max trick: ``argmax(x - log(E))`` with ``E ~ Exp(1)`` drawn from the
stream's own :class:`torch.Generator` (:func:`exp_noise`); this picks id ``i`` with probability
``softmax(x)[i]``, like ``torch.multinomial``, and runs without a host sync (so inside CUDA graphs).
Noise layout (the contract that makes the eager and the batched paths draw the same numbers): with no
filter the noise has one entry per vocabulary id in vocabulary order; with a filter, entry ``j`` belongs
to the ``j``-th largest candidate and only the first ``C`` entries (``C`` candidates) are read.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "Factor",
    "sign_aware_scale",
    "repetition_penalty_hf",
    "repetition_penalty_divide",
    "repetition_penalty_counted",
    "seen_mask_rows",
    "apply_temperature",
    "candidates",
    "top_p_filter",
    "min_p_filter",
    "filtered_probs",
    "exp_noise",
    "noise_width",
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
    m.scatter_(1, idx.to(device), True)
    return m[:, :vocab_size]


# ---------------------------------------------------------------------------------------- filters
def apply_temperature(logits: torch.Tensor, temperature: Factor) -> torch.Tensor:
    """``logits / temperature`` (temperature > 0; a float or a ``[N, 1]`` tensor)."""
    return logits / temperature


def _on(top_k: Optional[int], top_p: Optional[float], min_p: Optional[float], V: int) -> Tuple[bool, bool, bool]:
    return bool(top_k) and 0 < int(top_k) < V, top_p is not None and top_p < 1.0, bool(min_p) and min_p > 0


def candidates(x: torch.Tensor, top_k: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest logits (all of them when ``top_k`` is None/0 or ``>= V``), descending:
    ``(values [..., C], ids [..., C])``."""
    V = x.shape[-1]
    if top_k and 0 < int(top_k) < V:
        return torch.topk(x, int(top_k), dim=-1)
    return torch.sort(x, dim=-1, descending=True)


def top_p_filter(vals: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter on descending candidate logits ``[..., C]``: keep the smallest prefix whose
    probability mass reaches ``top_p`` (the first candidate always); the rest become ``-inf``."""
    pr = torch.softmax(vals, dim=-1)
    remove = (pr.cumsum(-1) - pr) >= top_p
    remove[..., 0] = False
    return vals.masked_fill(remove, _NEG_INF)


def min_p_filter(vals: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop candidates whose probability is below ``min_p`` times the largest one (``-inf``)."""
    pr = torch.softmax(vals, dim=-1)
    return vals.masked_fill(pr < min_p * pr.amax(dim=-1, keepdim=True), _NEG_INF)


def _filter(x: torch.Tensor, top_k, top_p, min_p) -> Tuple[torch.Tensor, torch.Tensor]:
    use_k, use_p, use_m = _on(top_k, top_p, min_p, x.shape[-1])
    vals, ids = candidates(x, top_k if use_k else None)
    if use_p:
        vals = top_p_filter(vals, float(top_p))
    if use_m:
        vals = min_p_filter(vals, float(min_p))
    return vals, ids


def filtered_probs(x: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None,
                   min_p: Optional[float] = None) -> torch.Tensor:
    """The sampling distribution ``[..., V]`` (float32) of already penalised / temperature-scaled
    logits after the filters (0 for removed ids); plain ``softmax`` when no filter is on."""
    x = x.float()
    if not any(_on(top_k, top_p, min_p, x.shape[-1])):
        return torch.softmax(x, dim=-1)
    vals, ids = _filter(x, top_k, top_p, min_p)
    return torch.zeros_like(x).scatter(-1, ids, torch.softmax(vals, dim=-1))


# ---------------------------------------------------------------------------------------- sampling
def noise_width(vocab_size: int, top_k: Optional[int] = None, top_p: Optional[float] = None,
                min_p: Optional[float] = None) -> int:
    """Noise entries one draw reads: ``top_k`` when the top-k filter is on, else ``vocab_size``."""
    use_k, _, _ = _on(top_k, top_p, min_p, vocab_size)
    return int(top_k) if use_k else vocab_size


def exp_noise(generators: Sequence[Optional[torch.Generator]], width: int,
              device: Union[str, torch.device]) -> torch.Tensor:
    """Exp(1) noise float32 ``[len(generators), width]`` on ``device``, row ``r`` drawn from
    ``generators[r]`` (on that generator's device, then moved; ``None`` = the default generator)."""
    device = torch.device(device)
    out = torch.empty(len(generators), width, dtype=torch.float32, device=device)
    for r, g in enumerate(generators):
        if g is None or g.device == device or g.device.type == device.type == "cpu":
            out[r].exponential_(generator=g)
        else:
            out[r].copy_(torch.empty(width, dtype=torch.float32, device=g.device).exponential_(generator=g))
    return out


def sample_with_noise(x: torch.Tensor, noise: torch.Tensor, top_k: Optional[int] = None,
                      top_p: Optional[float] = None, min_p: Optional[float] = None) -> torch.Tensor:
    """Gumbel-max sample of temperature-scaled logits ``x [..., V]`` after the filters, with given
    Exp(1) noise ``[..., >= noise_width]`` (layout in the module doc). Returns int64 ids ``[...]``.
    Graph-capturable (no host sync)."""
    if not any(_on(top_k, top_p, min_p, x.shape[-1])):
        return torch.argmax(x - torch.log(noise[..., : x.shape[-1]]), dim=-1)
    vals, ids = _filter(x, top_k, top_p, min_p)
    pick = torch.argmax(vals - torch.log(noise[..., : vals.shape[-1]]), dim=-1)
    return ids.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


def sample(x: torch.Tensor, generators: Sequence[Optional[torch.Generator]], *, temperature: Factor = 1.0,
           top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None) -> torch.Tensor:
    """Sample one id per row of logits ``x [N, V]`` (temperature, then the filters, then Gumbel-max
    with row ``r``'s noise from ``generators[r]``). Returns int64 ``[N]`` on ``x.device``.

    Raises:
        ValueError: ``len(generators) != N``.
    """
    if x.dim() != 2 or len(generators) != x.shape[0]:
        raise ValueError(f"need logits [N, V] and N generators, got {tuple(x.shape)} and {len(generators)}")
    noise = exp_noise(generators, noise_width(x.shape[-1], top_k, top_p, min_p), x.device)
    return sample_with_noise(apply_temperature(x, temperature), noise, top_k, top_p, min_p)
