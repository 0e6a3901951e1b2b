"""Talker records: dimensions and ids (:class:`TalkerConfig`, read from ``tts_config``), codec-token
sampling parameters (:class:`TalkerSampling`), the per-stream turn state (:class:`TalkerTurn`) and one
unit's input (:class:`TalkerInput`), with the codec constants (docs/model.md §2, §6, §9).

Import them from :mod:`.talker` (re-exported there) or from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from duplexkit.units import SILENCE_CODE  # the silence code pads / prefixes Code2Wav streams (docs/model.md §2)
from duplexkit.errors import DuplexkitError

from .config import TTSConfig

__all__ = [
    "TalkerConfig",
    "TalkerSampling",
    "TalkerTurn",
    "TalkerInput",
    "TalkerError",
    "GREEDY",
    "DUPLEX_BUDGET",
    "CODEC_EOS",
    "SILENCE_CODE",
]

#: Talker steps per duplex unit; the last sample is dropped, so 25 codes come back (docs/model.md §6).
DUPLEX_BUDGET = 26
#: Codec EOS id (6561 S3 codes 0..6560, then EOS; docs/model.md §2 "Codec ids").
CODEC_EOS = 6561
#: L2 normalisation epsilon of the projected hidden state (parity README case e).
_L2_EPS = 1e-12


class TalkerError(DuplexkitError, ValueError):
    """Bad talker input (shapes, ids out of range, prefix longer than the position budget)."""


_TTS_KEYS = ("llm_dim", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "num_hidden_layers", "max_position_embeddings", "num_audio_tokens", "num_text_tokens", "num_vq",
             "audio_bos_token_id", "text_eos_token_id", "projector_type", "condition_type")
"""The ``tts_config`` fields a :class:`TalkerConfig` takes from :class:`~.config.TTSConfig`."""


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
        # one parser of tts_config: the top-level config's (docs/model.md §9); this class adds the
        # required keys above and the talker's own checks below
        t = tts if isinstance(tts, TTSConfig) else TTSConfig.from_dict(
            {k: _cfg_get(tts, k) for k in _TTS_KEYS if _cfg_get(tts, k) is not None})
        kw = {k: getattr(t, k) for k in _TTS_KEYS}
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
