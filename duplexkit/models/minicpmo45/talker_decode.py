"""The talker's decode loop (docs/model.md §6): prefill each job into its own KV cache, then decode
every job of a call as one batch (caches left-padded to a common length plus an attention mask, per-row
RoPE positions, per-row generators) and split the caches back.

Sampling uses :mod:`.sampling` (temperature, :func:`.sampling.repetition_penalty_counted`, the
filters, Gumbel-max). A duplex unit's noise ``[budget - 1, V]`` is drawn from the item's generator
before the first step, exactly as :class:`.fast_talker.FastTalker` draws it, so on the CPU both give
the same codes for the same seed; offline (chat) calls draw ``[V]`` per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from . import sampling as S
from .talker_config import TalkerSampling, TalkerTurn


class TalkerLike(Protocol):
    """What the decode loop reads of a talker (:class:`.talker.Talker`): a structural type, so this
    module needs no import of the talker (which imports it)."""

    config: Any
    model: Any
    device: Any
    dtype: Any

    def code_embed(self, *args: Any, **kwargs: Any) -> Any: ...
    def forward_embeds(self, *args: Any, **kwargs: Any) -> Any: ...
    def head_weight(self, *args: Any, **kwargs: Any) -> Any: ...

__all__ = ["penalised_logits", "run_jobs"]


def penalised_logits(logits: torch.Tensor, recent: torch.Tensor, temperature: S.Factor,
                     penalty: S.Factor) -> torch.Tensor:
    """The talker's pre-filter logits (docs/model.md §6): float32 ``logits [..., V]`` divided by the
    temperature, then :func:`.sampling.repetition_penalty_counted` over ``recent`` (int64 ``[..., W]``,
    padded with ``V``). Temperature and penalty: floats, or ``[N, 1]`` tensors per row."""
    x = S.apply_temperature(logits.float(), temperature)
    if torch.is_tensor(penalty) or penalty != 1.0:
        x = S.repetition_penalty_counted(x, recent, penalty)
    return x


def _cache_arg(model) -> str:
    """Name of the KV-cache keyword of ``LlamaModel.forward``: ``cache`` in recent transformers 5.x,
    ``past_key_values`` before (e.g. 5.17 on the GPU image, where a ``cache=`` keyword is silently
    swallowed by ``**kwargs`` and the model runs without our cache)."""
    import inspect

    fwd = type(model).forward
    name = _CACHE_ARG.get(fwd)
    if name is None:
        name = "cache" if "cache" in inspect.signature(fwd).parameters else "past_key_values"
        _CACHE_ARG[fwd] = name
    return name


_CACHE_ARG: dict = {}


def _cache_from(data: list):
    """A ``DynamicCache`` holding the given per-layer ``(keys, values)`` [B, H, T, D] tensors.

    Built with ``DynamicCache.update`` layer by layer, which every transformers release since 4.36
    supports (the ``ddp_cache_data`` constructor argument is not stable across 5.x releases: on the
    GPU image's transformers 5.17 it produced caches without layers, IndexError in batched decode)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for li, (k, v) in enumerate(data):
        cache.update(k, v, li)
    return cache


@dataclass
class Job:
    turn: TalkerTurn
    embeds: torch.Tensor
    steps: int
    min_new: int
    sampling: TalkerSampling
    generator: Optional[torch.Generator]
    drop_last: bool
    turn_start: bool = False
    turn_end: bool = False


def run_jobs(tk: "TalkerLike", jobs: list) -> list[np.ndarray]:
    """Prefill each job, then decode all jobs together.

    With ``drop_last`` the ``steps``-th sample is never drawn nor fed (the reference draws and drops
    it): at most ``steps - 1`` codes come back and every returned code is in the KV cache. Without it
    (offline) up to ``steps`` codes come back and the last one is not fed.
    """
    B = len(jobs)
    if B == 0:
        return []
    V = tk.config.num_audio_tokens
    eos = tk.config.eos_code
    dev = tk.device
    logits = torch.stack([tk.forward_embeds(j.turn, j.embeds)[-1] for j in jobs])  # [B, V]
    n_samples = [j.steps - 1 if j.drop_last else j.steps for j in jobs]
    max_steps = max(n_samples)
    W = max(j.sampling.repetition_window for j in jobs)
    window = torch.full((B, W), V, dtype=torch.long, device=dev)
    out = torch.zeros(B, max(max_steps, 1), dtype=torch.long, device=dev)
    n = [0] * B
    active = [s > 0 for s in n_samples]
    min_new = torch.tensor([j.min_new for j in jobs], device=dev)
    if B == 1:
        cache, mask, pads = jobs[0].turn.cache, None, [0]
    else:
        lens = [j.turn.cache.get_seq_length() for j in jobs]
        lmax = max(lens)
        pads = [lmax - ln for ln in lens]
        data = []
        for li in range(tk.config.num_hidden_layers):
            ks = [F.pad(j.turn.cache.layers[li].keys, (0, 0, p, 0)) for j, p in zip(jobs, pads)]
            vs = [F.pad(j.turn.cache.layers[li].values, (0, 0, p, 0)) for j, p in zip(jobs, pads)]
            data.append((torch.cat(ks, 0), torch.cat(vs, 0)))
        cache = _cache_from(data)
        mask = torch.ones(B, lmax, dtype=torch.long, device=dev)
        for i, p in enumerate(pads):
            mask[i, :p] = 0
    pos = torch.tensor([j.turn.text_start_pos for j in jobs], dtype=torch.long, device=dev)
    fed = [0] * B
    # noise: a duplex unit's whole budget at once (as the batched talker draws it), offline per step
    noise = [S.exp_noise([j.generator], n_samples[i] * V, dev).view(n_samples[i], V)
             if j.drop_last and not j.sampling.greedy and n_samples[i] > 0 else None for i, j in enumerate(jobs)]
    for step in range(max_steps):
        logits = logits.masked_fill(((step < min_new)[:, None]) & (torch.arange(V, device=dev) == eos)[None],
                                    float("-inf"))
        picks = []
        for i, j in enumerate(jobs):
            if not active[i]:
                picks.append(torch.zeros((), dtype=torch.long, device=dev))
            elif j.sampling.greedy:
                picks.append(torch.argmax(logits[i]))
            else:
                s = j.sampling
                x = penalised_logits(logits[i], window[i, -s.repetition_window:], s.temperature, s.repetition_penalty)
                e = noise[i][step] if noise[i] is not None else S.exp_noise([j.generator], V, dev)[0]
                picks.append(S.sample_with_noise(x, e, s.top_k, s.top_p, s.min_p))
        code = torch.stack(picks)
        code_host = code.tolist()  # one host sync per step (EOS / budget bookkeeping)
        feed = [False] * B
        for i, j in enumerate(jobs):
            if not active[i]:
                continue
            if code_host[i] == eos:
                j.turn.finished_codes = True
                active[i] = False
                continue
            out[i, n[i]] = code[i]
            n[i] += 1
            if n[i] >= n_samples[i]:
                active[i] = False
            feed[i] = step + 1 < j.steps
        window = torch.cat([window[:, 1:], code[:, None]], dim=1)
        if not any(feed) or not any(active):
            # nothing left to sample; still feed the last kept codes (they belong in the KV)
            if any(feed):
                _feed(tk, jobs, cache, mask, pos, code, feed, fed, B)
            break
        logits = _feed(tk, jobs, cache, mask, pos, code, feed, fed, B)
        if mask is not None:
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], dim=1)
    if B == 1:
        jobs[0].turn.cache = cache
    else:
        lmax = max(pads[i] + jobs[i].turn.cache.get_seq_length() for i in range(B))
        for i, j in enumerate(jobs):
            data = []
            for li in range(tk.config.num_hidden_layers):
                layer = cache.layers[li]
                data.append((layer.keys[i:i + 1, :, pads[i]:lmax + fed[i]].clone(),
                             layer.values[i:i + 1, :, pads[i]:lmax + fed[i]].clone()))
            j.turn.cache = _cache_from(data)
    for i, j in enumerate(jobs):
        if B > 1:
            j.turn.text_start_pos += fed[i]
    return [out[i, :n[i]].cpu().numpy().astype(np.int64) for i in range(B)]

def _feed(tk: "TalkerLike", jobs, cache, mask, pos, code, feed, fed, B) -> torch.Tensor:
    """Feed ``emb_code[0](code)`` for every row at its next position; returns the next logits [B, V].
    Rows not in ``feed`` are fed a placeholder that is cut off when the caches are split back."""
    if B == 1:
        return tk.forward_embeds(jobs[0].turn, tk.code_embed(code.view(1)))[-1:]
    positions = pos + torch.tensor(fed, dtype=torch.long, device=pos.device)
    out = tk.model(inputs_embeds=tk.code_embed(code)[:, None].to(tk.dtype), position_ids=positions[:, None],
                     attention_mask=torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=mask.device)], 1),
                     use_cache=True, **{_cache_arg(tk.model): cache})
    for i in range(B):
        if feed[i]:
            fed[i] += 1
    return F.linear(out.last_hidden_state[:, -1], tk.head_weight()).float()
