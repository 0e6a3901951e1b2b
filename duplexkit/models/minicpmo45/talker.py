"""MiniCPM-o 4.5 Talker: text/hidden condition -> S3 codec tokens (docs/model.md §6).

The talker is a Llama backbone (``tts.model.*``, built with :class:`transformers.LlamaModel`) driven
only through ``inputs_embeds``:

* **Condition** (``condition_type hidden_text_merge``, docs/model.md §6):
  ``cond_t = emb_text(t) + L2normalize(projector_semantic(h_t))`` with ``eps = 1e-12``, where ``h_t``
  is the thinker's final-norm hidden state at the position where ``t`` is the *input* token.
* **Prefill tail**: duplex units / simplex chunks feed ``[cond..., emb_text(audio_bos)]``; the offline
  chat path feeds ``[cond..., emb_text(text_eos), emb_text(audio_bos)]``. ``audio_bos`` (151687) and
  ``text_eos`` (151692) are indices into ``emb_text`` read from ``tts_config``, never from the tokenizer.
* **Decode**: each step feeds ``emb_code[0](previous code)`` at the next position and reads logits from
  the weight-normed ``head_code[0]`` (``g * v / ||v||_row``).
* **Duplex budget**: 26 steps per unit; the last sample is dropped and never fed, so a full unit returns
  25 codes and the KV cache holds exactly the returned codes. ``min_new_tokens`` is 26 mid-turn (EOS
  6561 masked) and 0 on a turn's first and last unit.
* **Sampling default** (the reference duplex path, docs/model.md §6): temperature 0.8 and a sign-aware
  repetition penalty 1.05 (``penalty ** count``) over the last 16 codes of the *current call*, sampling
  the full distribution. ``top_k`` / ``top_p`` / ``min_p`` are options; ``greedy`` takes the argmax of the
  raw logits (no penalty), as parity case e does.
* **State**: the KV cache and ``text_start_pos`` persist across the units of one turn
  (:class:`TalkerTurn`) and are reset after a unit with ``turn_end=True``. The backbone was trained on
  4096 positions (``max_position_embeddings``): when a unit would not fit, the turn's KV cache is reset
  at that unit boundary and the unit is prefilled at position 0 (``TalkerTurn.window_resets`` counts it).

**Layout.** :mod:`.talker_config` holds the records (config, sampling, turn, input; re-exported here),
:mod:`.talker_decode` the decode loop, this module the network and the public generation API.

**Batching.** :meth:`Talker.generate_units` prefills each item into its own cache, then runs the decode
steps of all items as one batch (caches left-padded to a common length plus an attention mask, per-row
RoPE positions, per-row generators) and splits the caches back; results equal one-by-one decoding.

The per-step work is fixed-size tensor work (one position per row, a fixed 16-code penalty window, the
fixed codec vocabulary) plus one host sync for the EOS/budget bookkeeping; no Python work grows with the
sequence length (the KV cache is a ``transformers.DynamicCache``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import sampling as S
from .meta import meta_device
from .talker_config import (CODEC_EOS, DUPLEX_BUDGET, GREEDY, SILENCE_CODE, TalkerConfig, TalkerError, TalkerInput,
                            TalkerSampling, TalkerTurn)
from .talker_decode import Job, _cache_arg, penalised_logits, run_jobs

__all__ = [
    "TalkerConfig",
    "TalkerSampling",
    "TalkerTurn",
    "TalkerInput",
    "Talker",
    "TalkerError",
    "GREEDY",
    "DUPLEX_BUDGET",
    "CODEC_EOS",
    "SILENCE_CODE",
]

#: L2 normalisation epsilon of the projected hidden state (parity README case e).
_L2_EPS = 1e-12


class Talker(nn.Module):
    """MiniCPM-o 4.5 talker (``tts.`` keys, docs/model.md §1.1 and §6).

    Submodules (state-dict keys without the ``tts.`` prefix):
        ``emb_text`` Embedding [num_text_tokens, hidden]; ``model`` LlamaModel; ``projector_semantic``
        (``linear1`` llm_dim->hidden, ReLU, ``linear2`` hidden->hidden); ``emb_code.0`` Embedding
        [num_audio_tokens, hidden]; ``head_code.0`` weight-normed Linear hidden->num_audio_tokens (no bias,
        keys ``parametrizations.weight.original0`` (g [V,1]) / ``original1`` (v [V,hidden])).
    """

    #: generate_units decodes its items as one batch (the engine then hands it whole batches; a bad item
    #: raises TalkerError for the call before any turn state changes)
    batched = True

    #: state-dict keys present in the checkpoint that the talker accepts and ignores (docs/model.md §1.1)
    IGNORED_PREFIXES = ("model.embed_tokens.", "projector_spk.")

    def __init__(self, config: TalkerConfig, *, attn_implementation: str = "sdpa"):
        super().__init__()
        from transformers import LlamaModel

        self.config = config
        h = config.hidden_size
        self.emb_text = nn.Embedding(config.num_text_tokens, h)
        llama_cfg = config.llama_config()
        llama_cfg._attn_implementation = attn_implementation
        self.model = LlamaModel(llama_cfg)
        self.projector_semantic = _MLPProjector(config.llm_dim, h)
        self.emb_code = nn.ModuleList([nn.Embedding(config.num_audio_tokens, h)])
        head = nn.Linear(h, config.num_audio_tokens, bias=False)
        self.head_code = nn.ModuleList([torch.nn.utils.parametrizations.weight_norm(head, name="weight", dim=0)])
        self._folded_head: Optional[torch.Tensor] = None
        self.eval()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_state_dict(
        cls,
        tts_config: Any,
        state_dict: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        prefix: str = "tts.",
        attn_implementation: str = "sdpa",
    ) -> "Talker":
        """Build the talker from ``tts_config`` and the checkpoint tensors.

        Args:
            tts_config: mapping or object with the ``tts_config`` fields.
            state_dict: tensors keyed ``tts.*`` (other prefixes are ignored); ``prefix`` is stripped.
            dtype / device: parameter dtype and device.

        Raises:
            TalkerError: missing keys, unexpected ``tts.`` keys, or shape mismatches (strict on every key
                the talker uses; ``tts.model.embed_tokens`` and ``tts.projector_spk.*`` are accepted and
                ignored, docs/model.md §1.1).
        """
        cfg = tts_config if isinstance(tts_config, TalkerConfig) else TalkerConfig.from_tts_config(tts_config)
        with meta_device():
            probe = cls(cfg, attn_implementation=attn_implementation)
        expected = {k: tuple(v.shape) for k, v in probe.state_dict().items() if not k.startswith(cls.IGNORED_PREFIXES)}
        del probe
        given = {}
        unexpected = []
        for k, v in state_dict.items():
            if not k.startswith(prefix):
                continue
            sub = k[len(prefix):]
            if sub.startswith(cls.IGNORED_PREFIXES):
                continue
            if sub not in expected:
                unexpected.append(k)
                continue
            given[sub] = v
        missing = sorted(prefix + k for k in expected if k not in given)
        bad_shape = sorted(f"{prefix}{k}: got {tuple(v.shape)}, expected {expected[k]}"
                           for k, v in given.items() if tuple(v.shape) != expected[k])
        if missing or unexpected or bad_shape:
            raise TalkerError("talker checkpoint mismatch: "
                              + "; ".join(p for p in (
                                  f"missing {missing}" if missing else "",
                                  f"unexpected {sorted(unexpected)}" if unexpected else "",
                                  f"bad shapes {bad_shape}" if bad_shape else "") if p))
        model = cls(cfg, attn_implementation=attn_implementation)
        result = model.load_state_dict(given, strict=False)
        leftover = [k for k in result.missing_keys if not k.startswith(cls.IGNORED_PREFIXES)]
        if leftover or result.unexpected_keys:  # pragma: no cover - guarded by the checks above
            raise TalkerError(f"talker load failed: missing {leftover}, unexpected {result.unexpected_keys}")
        model.to(device=device, dtype=dtype)
        model.eval()
        model.requires_grad_(False)
        return model

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.emb_text.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.emb_text.weight.dtype

    def head_weight(self) -> torch.Tensor:
        """Effective head weight ``g * v / ||v||_row`` [num_audio_tokens, hidden] (folded once, cached)."""
        if self._folded_head is None or self._folded_head.device != self.device or self._folded_head.dtype != self.dtype:
            with torch.no_grad():
                self._folded_head = self.head_code[0].weight.detach().clone()
        return self._folded_head

    def _apply(self, fn, recurse=True):  # invalidate the folded head on .to()/.half()
        self._folded_head = None
        return super()._apply(fn, recurse)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        self._folded_head = None
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # ------------------------------------------------------------------ building blocks
    def condition(self, token_ids: Any, hidden: Any) -> torch.Tensor:
        """Condition rows ``emb_text(t) + L2normalize(projector_semantic(h_t))``.

        Args:
            token_ids: int [L] LLM ids (< num_text_tokens).
            hidden: float [L, llm_dim] thinker hidden states (any float dtype; cast to the talker dtype).

        Returns:
            Tensor [L, hidden_size] in the talker dtype on its device (L may be 0).

        Raises:
            TalkerError: shape or id-range problems.
        """
        ids = self._as_ids(token_ids)
        h = self._as_hidden(hidden, ids.shape[0])
        if ids.numel() == 0:
            return torch.zeros(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
        proj = self.projector_semantic(h)
        proj = F.normalize(proj, p=2, dim=-1, eps=_L2_EPS)
        return self.emb_text(ids) + proj

    def prefill_embeds(self, token_ids: Any, hidden: Any, *, offline: bool = False) -> torch.Tensor:
        """The prefill sequence: ``[cond..., (text_eos,) audio_bos]`` [L+1 (+1), hidden] (docs/model.md §6)."""
        cond = self.condition(token_ids, hidden)
        tail_ids = [self.config.text_eos_token_id, self.config.audio_bos_token_id] if offline \
            else [self.config.audio_bos_token_id]
        tail = self.emb_text(S.device_tensor(tail_ids, self.device, torch.long))
        return torch.cat([cond, tail], dim=0)

    def code_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """``emb_code[0]`` rows for int codes (any shape) -> [..., hidden]."""
        return self.emb_code[0](codes)

    @torch.no_grad()
    def forward_embeds(self, turn: TalkerTurn, embeds: torch.Tensor) -> torch.Tensor:
        """Feed ``embeds`` [T, hidden] at positions ``turn.text_start_pos ...`` and return the logits
        [T, num_audio_tokens] (float32, raw head output). Advances ``turn.text_start_pos`` by T.

        Raises:
            TalkerError: the positions would exceed ``max_position_embeddings``.
        """
        from transformers import DynamicCache

        t = embeds.shape[0]
        start = turn.text_start_pos
        if start + t > self.config.max_position_embeddings:
            raise TalkerError(f"talker positions {start}..{start + t - 1} exceed max_position_embeddings "
                              f"{self.config.max_position_embeddings}")
        if turn.cache is None:
            turn.cache = DynamicCache()
        pos = torch.arange(start, start + t, device=self.device).unsqueeze(0)
        out = self.model(inputs_embeds=embeds.unsqueeze(0).to(self.dtype), position_ids=pos,
                         use_cache=True, **{_cache_arg(self.model): turn.cache})
        turn.cache = out.cache if getattr(out, "cache", None) is not None else turn.cache
        turn.text_start_pos = start + t
        hs = out.last_hidden_state[0]
        return F.linear(hs, self.head_weight()).float()

    # ------------------------------------------------------------------ sampling
    def sampling_probs(self, logits: torch.Tensor, recent_codes: torch.Tensor,
                       sampling: TalkerSampling = TalkerSampling()) -> torch.Tensor:
        """The sampling distribution for one step (parity ``e_talker_probs``).

        Args:
            logits: float [V] raw head logits.
            recent_codes: int [W] the last ``repetition_window`` codes of this call, padded with the
                sentinel ``V`` (ignored) on the left; fixed shape.
            sampling: parameters (not greedy).

        Returns:
            float32 [V] probabilities.
        """
        x = penalised_logits(logits, recent_codes, sampling.temperature, sampling.repetition_penalty)
        return S.filtered_probs(x, sampling.top_k, sampling.top_p, sampling.min_p)

    # ------------------------------------------------------------------ public generation API
    def new_turn(self) -> TalkerTurn:
        """A fresh per-stream talker turn state (empty KV, ``text_start_pos`` 0)."""
        return TalkerTurn()

    @torch.no_grad()
    def generate_units(self, items: Sequence[TalkerInput]) -> list[np.ndarray]:
        """Generate the codes of one speaking unit for each item (docs/model.md §6, duplex path).

        Every item is validated first; then each item's condition is prefilled into its own KV cache and
        the decode steps of all items run as one batch (caches left-padded to a common length with an
        attention mask, per-row positions, per-row sampling generators). Each turn's cache is split back
        afterwards, so results equal running the items one by one (up to float reduction order).

        Returns:
            list of int64 arrays [<= budget-1] (25 for a full mid-turn unit), codes in 0..6560 (EOS is
            never returned), in the order of ``items``.

        Raises:
            TalkerError: a bad item, or the same turn twice; raised before any turn state changes.
        """
        jobs = [self._prepare(it) for it in items]
        if len({id(j.turn) for j in jobs}) != len(jobs):
            raise TalkerError("the same TalkerTurn appears twice in one generate_units call")
        for j in jobs:
            self._start(j)
        codes = run_jobs(self, jobs)
        for j in jobs:
            j.turn.units += 1
            if j.turn_end:
                j.turn.reset()
        return codes

    @torch.no_grad()
    def generate_offline(
        self,
        token_ids: Any,
        hidden: Any,
        max_codes: int = 2048,
        *,
        min_codes: int = 50,
        sampling: Optional[TalkerSampling] = None,
        generator: Optional[torch.Generator] = None,
    ) -> np.ndarray:
        """Chat path: ``[cond..., text_eos, audio_bos]`` then decode until EOS or ``max_codes``.

        Args:
            token_ids / hidden: the spoken span (tokens strictly between the last ``<|tts_bos|>`` and
                ``<|tts_eos|>``) and its hidden rows.
            max_codes: code cap (reference 2048); clamped to the positions left in the 4096 window.
            min_codes: EOS is masked before this many codes (reference 50; clamped to ``max_codes``).

        Returns:
            int64 [n] codes (no EOS).

        Raises:
            TalkerError: the prefix does not fit in ``max_position_embeddings``.
        """
        sampling = sampling or TalkerSampling()
        turn = TalkerTurn()
        embeds = self.prefill_embeds(token_ids, hidden, offline=True)
        room = self.config.max_position_embeddings - embeds.shape[0]
        if room < 1:
            raise TalkerError(f"offline talker prefix of {embeds.shape[0]} rows does not fit in "
                              f"{self.config.max_position_embeddings} positions")
        max_codes = min(int(max_codes), room + 1)
        min_codes = min(int(min_codes), max_codes)
        job = Job(turn=turn, embeds=embeds, steps=max_codes, min_new=min_codes, sampling=sampling,
                   generator=generator, drop_last=False)
        return run_jobs(self, [job])[0]

    # ------------------------------------------------------------------ internals
    def _prepare(self, it: TalkerInput) -> "Job":
        """Validate one item and plan its decode (no state change)."""
        if not isinstance(it.turn, TalkerTurn):
            raise TalkerError("TalkerInput.turn must be a TalkerTurn (from Talker.new_turn())")
        if it.budget < 1:
            raise TalkerError("budget must be >= 1")
        sampling = it.sampling
        if sampling is None:
            sampling = GREEDY if it.temperature <= 0 else TalkerSampling(temperature=float(it.temperature))
        embeds = self.prefill_embeds(it.token_ids, it.hidden)
        need = embeds.shape[0] + it.budget - 1  # prefill rows + fed codes
        if need > self.config.max_position_embeddings:
            raise TalkerError(f"one unit needs {need} positions > max_position_embeddings "
                              f"{self.config.max_position_embeddings}")
        if it.min_new_tokens is not None:
            min_new = int(it.min_new_tokens)
        else:
            min_new = 0 if (it.turn_start or it.turn_end) else it.budget
        return Job(turn=it.turn, embeds=embeds, steps=int(it.budget), min_new=min_new, sampling=sampling,
                    generator=it.generator, drop_last=True, turn_start=bool(it.turn_start),
                    turn_end=bool(it.turn_end))

    def _start(self, job: "Job") -> None:
        turn = job.turn
        if job.turn_start and turn.units > 0:
            turn.reset()
        need = job.embeds.shape[0] + job.steps - 1
        if turn.text_start_pos + need > self.config.max_position_embeddings:
            # 4096-position window full: restart the turn's talker context at this unit boundary
            turn.cache = None
            turn.text_start_pos = 0
            turn.window_resets += 1

    def _as_ids(self, token_ids: Any) -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(token_ids) if not torch.is_tensor(token_ids) else token_ids)
        if ids.ndim != 1:
            raise TalkerError(f"token_ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.numel() and ids.dtype.is_floating_point:
            raise TalkerError("token_ids must be integers")
        if ids.numel():
            # range-checked where the ids are (host ids, the engine's case: no device sync per item)
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or hi >= self.config.num_text_tokens:
                raise TalkerError(f"token id outside emb_text range [0, {self.config.num_text_tokens})")
        if self.device.type == "cuda" and ids.device.type == "cpu":
            ids = ids.to(torch.long).pin_memory()  # an async copy (from pageable memory it waits for the stream)
        return ids.to(device=self.device, dtype=torch.long, non_blocking=True)

    def _as_hidden(self, hidden: Any, n: int) -> torch.Tensor:
        h = hidden if torch.is_tensor(hidden) else torch.as_tensor(np.asarray(hidden, dtype=np.float32))
        if n == 0 and h.numel() == 0:
            return h.reshape(0, self.config.llm_dim).to(device=self.device, dtype=self.dtype)
        if h.ndim != 2 or h.shape[0] != n or h.shape[1] != self.config.llm_dim:
            raise TalkerError(f"hidden must be [{n}, {self.config.llm_dim}], got {tuple(h.shape)}")
        return h.to(device=self.device, dtype=self.dtype)


class _MLPProjector(nn.Module):
    """``linear1`` -> ReLU -> ``linear2`` (keys ``projector_semantic.linear1/2``)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(x)))
