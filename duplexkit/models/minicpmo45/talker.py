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

**Batching.** :meth:`Talker.generate_units` prefills each item into its own cache, then runs the decode
steps of all items as one batch (caches left-padded to a common length plus an attention mask, per-row
RoPE positions, per-row generators) and splits the caches back; results equal one-by-one decoding.

The per-step work is fixed-size tensor work (one position per row, a fixed 16-code penalty window, the
fixed codec vocabulary) plus one host sync for the EOS/budget bookkeeping; no Python work grows with the
sequence length (the KV cache is a ``transformers.DynamicCache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from duplexkit.errors import DuplexkitError

from .meta import meta_device

__all__ = [
    "TalkerConfig",
    "TalkerSampling",
    "TalkerTurn",
    "TalkerInput",
    "Talker",
    "TalkerError",
    "DUPLEX_BUDGET",
    "CODEC_EOS",
    "SILENCE_CODE",
]

#: Talker steps per duplex unit; the last sample is dropped, so 25 codes come back (docs/model.md §6).
DUPLEX_BUDGET = 26
#: Codec EOS id (6561 S3 codes 0..6560, then EOS; docs/model.md §2 "Codec ids").
CODEC_EOS = 6561
#: Silence code used to pad / prefix Code2Wav streams (docs/model.md §2).
SILENCE_CODE = 4218
#: L2 normalisation epsilon of the projected hidden state (parity README case e).
_L2_EPS = 1e-12


class TalkerError(DuplexkitError, ValueError):
    """Bad talker input (shapes, ids out of range, prefix longer than the position budget)."""


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True)
class TalkerConfig:
    """Talker dimensions and ids, read from the checkpoint's ``tts_config`` (docs/model.md §9).

    Attributes:
        llm_dim: thinker hidden size (input of ``projector_semantic``); 4096 real.
        hidden_size / intermediate_size / num_attention_heads / num_key_value_heads / num_hidden_layers:
            Llama backbone (real: 768 / 3072 / 12 / 12 / 20).
        max_position_embeddings: trained positions, 4096.
        num_audio_tokens: 6562 = 6561 S3 codes + EOS.
        num_text_tokens: rows of ``emb_text`` (152064), indexed by LLM token ids.
        audio_bos_token_id / text_eos_token_id: ``emb_text`` rows (151687 / 151692 real).
        rope_theta / rms_norm_eps: LlamaConfig defaults the reference keeps (10000 / 1e-6).
    """

    llm_dim: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    max_position_embeddings: int = 4096
    num_audio_tokens: int = 6562
    num_text_tokens: int = 152064
    num_vq: int = 1
    audio_bos_token_id: int = 151687
    text_eos_token_id: int = 151692
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    projector_type: str = "mlp"
    condition_type: str = "hidden_text_merge"

    @classmethod
    def from_tts_config(cls, tts: Any) -> "TalkerConfig":
        """Build from the ``tts_config`` sub-config (a mapping or an attribute object).

        Raises:
            TalkerError: a required key is missing, the ids are absent (the class defaults 21132/21133
                are stale, docs/model.md §2), or an unsupported variant is configured.
        """
        required = ["llm_dim", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                    "audio_bos_token_id", "text_eos_token_id"]
        missing = [k for k in required if _cfg_get(tts, k) is None]
        if missing:
            raise TalkerError(f"tts_config lacks {missing}")
        heads = int(_cfg_get(tts, "num_attention_heads"))
        kw = dict(
            llm_dim=int(_cfg_get(tts, "llm_dim")),
            hidden_size=int(_cfg_get(tts, "hidden_size")),
            intermediate_size=int(_cfg_get(tts, "intermediate_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(_cfg_get(tts, "num_key_value_heads", heads) or heads),
            num_hidden_layers=int(_cfg_get(tts, "num_hidden_layers")),
            max_position_embeddings=int(_cfg_get(tts, "max_position_embeddings", 4096)),
            num_audio_tokens=int(_cfg_get(tts, "num_audio_tokens", 6562)),
            num_text_tokens=int(_cfg_get(tts, "num_text_tokens", 152064)),
            num_vq=int(_cfg_get(tts, "num_vq", 1)),
            audio_bos_token_id=int(_cfg_get(tts, "audio_bos_token_id")),
            text_eos_token_id=int(_cfg_get(tts, "text_eos_token_id")),
            projector_type=str(_cfg_get(tts, "projector_type", "mlp")),
            condition_type=str(_cfg_get(tts, "condition_type", "hidden_text_merge")),
        )
        cfg = cls(**kw)
        if cfg.num_vq != 1:
            raise TalkerError(f"num_vq={cfg.num_vq} is not supported (MiniCPM-o 4.5 has one codebook)")
        if cfg.projector_type != "mlp":
            raise TalkerError(f"projector_type={cfg.projector_type!r} is not supported (expected 'mlp')")
        if cfg.condition_type != "hidden_text_merge":
            raise TalkerError(f"condition_type={cfg.condition_type!r} is not supported")
        for name in ("audio_bos_token_id", "text_eos_token_id"):
            if not 0 <= getattr(cfg, name) < cfg.num_text_tokens:
                raise TalkerError(f"{name}={getattr(cfg, name)} outside emb_text ({cfg.num_text_tokens} rows)")
        return cfg

    @property
    def eos_code(self) -> int:
        """Codec EOS id = ``num_audio_tokens - 1`` (6561)."""
        return self.num_audio_tokens - 1

    def llama_config(self):
        """The :class:`transformers.LlamaConfig` of the backbone (defaults for everything not in tts_config)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=1,  # tts.model.embed_tokens is never read (always fed inputs_embeds); not loaded
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )


@dataclass(frozen=True)
class TalkerSampling:
    """Codec-token sampling parameters (docs/model.md §6 "Sampling").

    Default = the reference duplex ``generate_chunk`` path: temperature 0.8, repetition penalty 1.05
    over the last 16 codes of the current call (sign-aware, ``penalty ** count``), full distribution.

    Attributes:
        temperature: > 0; logits are divided by it.
        repetition_penalty: 1.0 disables the penalty.
        repetition_window: number of most recent codes of this call that are counted.
        top_k: keep the k most likely codes (None = off; the reference TTSSamplingParams uses 25).
        top_p: nucleus mass (None = off; reference 0.85).
        min_p: drop codes below ``min_p * max_prob`` (None = off; reference 0.01, never applied by the Demo).
        greedy: argmax of the raw logits, no penalty/temperature (parity case e "greedy").
    """

    temperature: float = 0.8
    repetition_penalty: float = 1.05
    repetition_window: int = 16
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    greedy: bool = False

    def __post_init__(self) -> None:
        if not self.greedy and not self.temperature > 0:
            raise TalkerError(f"temperature must be > 0 (got {self.temperature}); use greedy=True for argmax")
        if self.repetition_penalty <= 0:
            raise TalkerError("repetition_penalty must be > 0")
        if self.repetition_window < 1:
            raise TalkerError("repetition_window must be >= 1")
        if self.top_k is not None and self.top_k < 1:
            raise TalkerError("top_k must be >= 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise TalkerError("top_p must be in (0, 1]")
        if self.min_p is not None and not 0 <= self.min_p < 1:
            raise TalkerError("min_p must be in [0, 1)")


GREEDY = TalkerSampling(greedy=True)


@dataclass
class TalkerTurn:
    """Per-stream talker state for one model turn (docs/model.md §6 "State").

    Attributes:
        cache: the Llama KV cache (``None`` until the first unit).
        text_start_pos: next free position = condition rows + returned codes of earlier units.
        units: units generated in this turn.
        window_resets: times the 4096-position limit forced a KV reset inside this turn.
        finished_codes: True once the talker sampled EOS in this turn (informational).
    """

    cache: Any = None
    text_start_pos: int = 0
    units: int = 0
    window_resets: int = 0
    finished_codes: bool = False

    def reset(self) -> None:
        """Drop the KV cache and rewind ``text_start_pos`` to 0 (turn end)."""
        self.cache = None
        self.text_start_pos = 0
        self.units = 0
        self.finished_codes = False


@dataclass
class TalkerInput:
    """One speaking unit (or simplex chunk) for :meth:`Talker.generate_units`.

    Attributes:
        turn: the stream's :class:`TalkerTurn`.
        token_ids: int [L] spoken LLM token ids of the unit (may be empty: ``[audio_bos]`` alone is fed).
        hidden: float [L, llm_dim] final-norm thinker hidden states, input-position aligned (docs/model.md §8).
        turn_start / turn_end: first / last unit of the turn (``min_new_tokens`` 0 instead of 26; the turn
            state is reset after a ``turn_end`` unit).
        temperature: sampling temperature (default 0.8); ``<= 0`` selects greedy decoding.
        generator: optional ``torch.Generator`` on the talker's device for reproducible sampling.
        budget: talker steps (26 -> at most 25 codes; docs/model.md §6).
        min_new_tokens: override of the 26/0 rule (None = the rule).
        sampling: full sampling override (None = :class:`TalkerSampling` with ``temperature``).
    """

    turn: TalkerTurn
    token_ids: Any
    hidden: Any
    turn_start: bool = False
    turn_end: bool = False
    temperature: float = 0.8
    generator: Optional[torch.Generator] = None
    budget: int = DUPLEX_BUDGET
    min_new_tokens: Optional[int] = None
    sampling: Optional[TalkerSampling] = None



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
        tail = self.emb_text(torch.tensor(tail_ids, dtype=torch.long, device=self.device))
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
        x = logits.float() / sampling.temperature
        if sampling.repetition_penalty != 1.0:
            x = _apply_repetition_penalty(x, recent_codes, sampling.repetition_penalty)
        return _filtered_softmax(x, sampling)

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
        codes = self._run(jobs)
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
        job = _Job(turn=turn, embeds=embeds, steps=max_codes, min_new=min_codes, sampling=sampling,
                   generator=generator, drop_last=False)
        return self._run([job])[0]

    # ------------------------------------------------------------------ internals
    def _prepare(self, it: TalkerInput) -> "_Job":
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
        return _Job(turn=it.turn, embeds=embeds, steps=int(it.budget), min_new=min_new, sampling=sampling,
                    generator=it.generator, drop_last=True, turn_start=bool(it.turn_start),
                    turn_end=bool(it.turn_end))

    def _start(self, job: "_Job") -> None:
        turn = job.turn
        if job.turn_start and turn.units > 0:
            turn.reset()
        need = job.embeds.shape[0] + job.steps - 1
        if turn.text_start_pos + need > self.config.max_position_embeddings:
            # 4096-position window full: restart the turn's talker context at this unit boundary
            turn.cache = None
            turn.text_start_pos = 0
            turn.window_resets += 1

    def _run(self, jobs: list) -> list[np.ndarray]:
        """Prefill each job, then decode all jobs together.

        With ``drop_last`` the ``steps``-th sample is never drawn nor fed (the reference draws and drops
        it): at most ``steps - 1`` codes come back and every returned code is in the KV cache. Without it
        (offline) up to ``steps`` codes come back and the last one is not fed.
        """
        from transformers import DynamicCache

        B = len(jobs)
        if B == 0:
            return []
        V = self.config.num_audio_tokens
        eos = self.config.eos_code
        dev = self.device
        logits = torch.stack([self.forward_embeds(j.turn, j.embeds)[-1] for j in jobs])  # [B, V]
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
            for li in range(self.config.num_hidden_layers):
                ks = [F.pad(j.turn.cache.layers[li].keys, (0, 0, p, 0)) for j, p in zip(jobs, pads)]
                vs = [F.pad(j.turn.cache.layers[li].values, (0, 0, p, 0)) for j, p in zip(jobs, pads)]
                data.append((torch.cat(ks, 0), torch.cat(vs, 0)))
            cache = _cache_from(data)
            mask = torch.ones(B, lmax, dtype=torch.long, device=dev)
            for i, p in enumerate(pads):
                mask[i, :p] = 0
        pos = torch.tensor([j.turn.text_start_pos for j in jobs], dtype=torch.long, device=dev)
        fed = [0] * B
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
                    probs = self.sampling_probs(logits[i], window[i, -j.sampling.repetition_window:], j.sampling)
                    picks.append(torch.multinomial(probs, 1, generator=j.generator)[0])
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
                    self._feed(jobs, cache, mask, pos, code, feed, fed, B)
                break
            logits = self._feed(jobs, cache, mask, pos, code, feed, fed, B)
            if mask is not None:
                mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], dim=1)
        if B == 1:
            jobs[0].turn.cache = cache
        else:
            lmax = max(pads[i] + jobs[i].turn.cache.get_seq_length() for i in range(B))
            for i, j in enumerate(jobs):
                data = []
                for li in range(self.config.num_hidden_layers):
                    layer = cache.layers[li]
                    data.append((layer.keys[i:i + 1, :, pads[i]:lmax + fed[i]].clone(),
                                 layer.values[i:i + 1, :, pads[i]:lmax + fed[i]].clone()))
                j.turn.cache = _cache_from(data)
        for i, j in enumerate(jobs):
            if B > 1:
                j.turn.text_start_pos += fed[i]
        return [out[i, :n[i]].cpu().numpy().astype(np.int64) for i in range(B)]

    def _feed(self, jobs, cache, mask, pos, code, feed, fed, B) -> torch.Tensor:
        """Feed ``emb_code[0](code)`` for every row at its next position; returns the next logits [B, V].
        Rows not in ``feed`` are fed a placeholder that is cut off when the caches are split back."""
        if B == 1:
            return self.forward_embeds(jobs[0].turn, self.code_embed(code.view(1)))[-1:]
        positions = pos + torch.tensor(fed, dtype=torch.long, device=pos.device)
        out = self.model(inputs_embeds=self.code_embed(code)[:, None].to(self.dtype), position_ids=positions[:, None],
                         attention_mask=torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=mask.device)], 1),
                         use_cache=True, **{_cache_arg(self.model): cache})
        for i in range(B):
            if feed[i]:
                fed[i] += 1
        return F.linear(out.last_hidden_state[:, -1], self.head_weight()).float()

    def _as_ids(self, token_ids: Any) -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(token_ids) if not torch.is_tensor(token_ids) else token_ids)
        if ids.ndim != 1:
            raise TalkerError(f"token_ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.numel() and ids.dtype.is_floating_point:
            raise TalkerError("token_ids must be integers")
        ids = ids.to(device=self.device, dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.num_text_tokens):
            raise TalkerError(f"token id outside emb_text range [0, {self.config.num_text_tokens})")
        return ids

    def _as_hidden(self, hidden: Any, n: int) -> torch.Tensor:
        h = hidden if torch.is_tensor(hidden) else torch.as_tensor(np.asarray(hidden, dtype=np.float32))
        if n == 0 and h.numel() == 0:
            return h.reshape(0, self.config.llm_dim).to(device=self.device, dtype=self.dtype)
        if h.ndim != 2 or h.shape[0] != n or h.shape[1] != self.config.llm_dim:
            raise TalkerError(f"hidden must be [{n}, {self.config.llm_dim}], got {tuple(h.shape)}")
        return h.to(device=self.device, dtype=self.dtype)


@dataclass
class _Job:
    turn: TalkerTurn
    embeds: torch.Tensor
    steps: int
    min_new: int
    sampling: TalkerSampling
    generator: Optional[torch.Generator]
    drop_last: bool
    turn_start: bool = False
    turn_end: bool = False


class _MLPProjector(nn.Module):
    """``linear1`` -> ReLU -> ``linear2`` (keys ``projector_semantic.linear1/2``)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(x)))


def _apply_repetition_penalty(logits: torch.Tensor, recent: torch.Tensor, penalty: float) -> torch.Tensor:
    """Sign-aware penalty ``penalty ** count`` (negative logits multiplied, positive divided).

    ``recent`` is a fixed-size window of codes; entries equal to ``V`` are padding and ignored.
    """
    V = logits.shape[-1]
    counts = torch.zeros(V + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(0, recent, torch.ones_like(recent, dtype=logits.dtype))
    alpha = torch.pow(torch.tensor(penalty, dtype=logits.dtype, device=logits.device), counts[:V])
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def _filtered_softmax(x: torch.Tensor, s: TalkerSampling) -> torch.Tensor:
    if s.top_k is not None and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        remove = cum - torch.softmax(sorted_x, dim=-1) >= s.top_p  # keep the token that crosses top_p
        x = x.masked_fill(torch.zeros_like(remove).scatter(0, idx, remove), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if s.min_p is not None and s.min_p > 0:
        probs = probs.masked_fill(probs < s.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs
