"""Configuration of a MiniCPM-o 4.5 checkpoint, read from its own ``config.json``.

The layout is the real one (docs/model.md §1.2, docs/model.md §9): Qwen3 LLM fields at
the top level, plus ``vision_config`` (SigLIP), ``audio_config`` (Whisper encoder) and
``tts_config`` (talker). Unknown keys are kept in ``raw`` so nothing is lost.

Only plain Python here (no torch import at module load); the ``to_*_config`` helpers build the
transformers config objects on demand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from duplexkit.errors import DuplexkitError

__all__ = [
    "ConfigError",
    "VisionConfig",
    "AudioConfig",
    "TTSConfig",
    "MiniCPMOConfig",
]


class ConfigError(DuplexkitError, ValueError):
    """A ``config.json`` is missing, malformed or violates a model constraint."""


SUPPORTED_VERSIONS = ("4.5",)
"""``config.json`` ``version`` values this port reads (docs/model.md §1.2: ``version "4.5"``)."""


def _get(d: dict, key: str, default: Any) -> Any:
    v = d.get(key, default)
    return default if v is None else v


@dataclass
class VisionConfig:
    """SigLIP NaViT vision tower (``vision_config``; docs/model.md §1.1)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 980
    patch_size: int = 14
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    attention_dropout: float = 0.0
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        return cls(
            hidden_size=int(_get(d, "hidden_size", 1152)),
            intermediate_size=int(_get(d, "intermediate_size", 4304)),
            num_hidden_layers=int(_get(d, "num_hidden_layers", 27)),
            num_attention_heads=int(_get(d, "num_attention_heads", 16)),
            num_channels=int(_get(d, "num_channels", 3)),
            image_size=int(_get(d, "image_size", 980)),
            patch_size=int(_get(d, "patch_size", 14)),
            layer_norm_eps=float(_get(d, "layer_norm_eps", 1e-6)),
            hidden_act=str(_get(d, "hidden_act", "gelu_pytorch_tanh")),
            attention_dropout=float(_get(d, "attention_dropout", 0.0)),
            raw=dict(d),
        )

    @property
    def num_patches_per_side(self) -> int:
        """Side of the position table grid (980/14 = 70; docs/model.md §9)."""
        return self.image_size // self.patch_size

    def to_siglip_config(self):
        from transformers import SiglipVisionConfig

        return SiglipVisionConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_channels=self.num_channels,
            image_size=self.image_size,
            patch_size=self.patch_size,
            layer_norm_eps=self.layer_norm_eps,
            hidden_act=self.hidden_act,
            attention_dropout=self.attention_dropout,
        )


@dataclass
class AudioConfig:
    """Whisper encoder (``audio_config``; docs/model.md §1.1). Decoder fields are ignored."""

    d_model: int = 1024
    encoder_layers: int = 24
    encoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    scale_embedding: bool = False
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "AudioConfig":
        return cls(
            d_model=int(_get(d, "d_model", 1024)),
            encoder_layers=int(_get(d, "encoder_layers", 24)),
            encoder_attention_heads=int(_get(d, "encoder_attention_heads", 16)),
            encoder_ffn_dim=int(_get(d, "encoder_ffn_dim", 4096)),
            num_mel_bins=int(_get(d, "num_mel_bins", 80)),
            max_source_positions=int(_get(d, "max_source_positions", 1500)),
            activation_function=str(_get(d, "activation_function", "gelu")),
            scale_embedding=bool(_get(d, "scale_embedding", False)),
            raw=dict(d),
        )

    def to_whisper_config(self):
        from transformers import WhisperConfig

        return WhisperConfig(
            d_model=self.d_model,
            encoder_layers=self.encoder_layers,
            encoder_attention_heads=self.encoder_attention_heads,
            encoder_ffn_dim=self.encoder_ffn_dim,
            decoder_layers=1,
            decoder_attention_heads=self.encoder_attention_heads,
            decoder_ffn_dim=self.encoder_ffn_dim,
            num_mel_bins=self.num_mel_bins,
            max_source_positions=self.max_source_positions,
            activation_function=self.activation_function,
            scale_embedding=self.scale_embedding,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=50257,
            bos_token_id=50257,
            eos_token_id=50257,
            decoder_start_token_id=50257,
        )


@dataclass
class TTSConfig:
    """Talker (``tts_config``; docs/model.md §1.1, §6). Talker ids come from here, not the tokenizer."""

    llm_dim: int = 4096
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    num_hidden_layers: int = 20
    max_position_embeddings: int = 4096
    num_audio_tokens: int = 6562
    num_text_tokens: int = 152064
    num_vq: int = 1
    audio_bos_token_id: int = 151687
    text_eos_token_id: int = 151692
    hidden_act: str = "silu"
    condition_type: str = "hidden_text_merge"
    normalize_projected_hidden: bool = True
    projector_type: str = "mlp"
    backbone_model: str = "llama"
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "TTSConfig":
        heads = int(_get(d, "num_attention_heads", 12))
        return cls(
            llm_dim=int(_get(d, "llm_dim", 4096)),
            hidden_size=int(_get(d, "hidden_size", 768)),
            intermediate_size=int(_get(d, "intermediate_size", 3072)),
            num_attention_heads=heads,
            num_key_value_heads=int(_get(d, "num_key_value_heads", heads)),
            num_hidden_layers=int(_get(d, "num_hidden_layers", 20)),
            max_position_embeddings=int(_get(d, "max_position_embeddings", 4096)),
            num_audio_tokens=int(_get(d, "num_audio_tokens", 6562)),
            num_text_tokens=int(_get(d, "num_text_tokens", 152064)),
            num_vq=int(_get(d, "num_vq", 1)),
            audio_bos_token_id=int(_get(d, "audio_bos_token_id", 151687)),
            text_eos_token_id=int(_get(d, "text_eos_token_id", 151692)),
            hidden_act=str(_get(d, "hidden_act", "silu")),
            condition_type=str(_get(d, "condition_type", "hidden_text_merge")),
            normalize_projected_hidden=bool(_get(d, "normalize_projected_hidden", True)),
            projector_type=str(_get(d, "projector_type", "mlp")),
            backbone_model=str(_get(d, "backbone_model", "llama")),
            raw=dict(d),
        )


@dataclass
class MiniCPMOConfig:
    """Top-level MiniCPM-o 4.5 config (``config.json``; docs/model.md §9).

    LLM fields mirror Qwen3. ``query_num`` must stay 64 and ``hidden_size`` must be a positive
    multiple of 128 (resampler heads = hidden/128); :meth:`validate` raises :class:`ConfigError`.
    """

    vocab_size: int = 151748
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: Optional[int] = 151643
    eos_token_id: Any = field(default_factory=lambda: [151645, 151643])
    pad_token_id: Optional[int] = 151643
    # multimodal
    query_num: int = 64
    image_size: int = 448
    patch_size: int = 14
    drop_vision_last_layer: bool = False
    audio_pool_step: int = 5
    audio_chunk_length: float = 1.0
    stream_input: bool = True
    use_image_id: bool = True
    slice_config: dict = field(default_factory=lambda: {"max_slice_nums": 1, "scale_resolution": 448, "patch_size": 14})
    init_vision: bool = True
    init_audio: bool = True
    init_tts: bool = True
    model_type: str = "minicpmo"
    version: str = "4.5"
    vision_config: VisionConfig = field(default_factory=VisionConfig)
    audio_config: AudioConfig = field(default_factory=AudioConfig)
    tts_config: TTSConfig = field(default_factory=TTSConfig)
    raw: dict = field(default_factory=dict)

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "MiniCPMOConfig":
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        heads = int(_get(d, "num_attention_heads", 32))
        hidden = int(_get(d, "hidden_size", 4096))
        if "drop_vision_last_layer" not in d:
            # The reference class default is True (docs/model.md §1.1); the key count check in the
            # loader catches a mismatch either way.
            drop = True
        else:
            drop = bool(d["drop_vision_last_layer"])
        cfg = cls(
            vocab_size=int(_get(d, "vocab_size", 151748)),
            hidden_size=hidden,
            intermediate_size=int(_get(d, "intermediate_size", 12288)),
            num_hidden_layers=int(_get(d, "num_hidden_layers", 36)),
            num_attention_heads=heads,
            num_key_value_heads=int(_get(d, "num_key_value_heads", heads)),
            head_dim=int(_get(d, "head_dim", hidden // heads)),
            hidden_act=str(_get(d, "hidden_act", "silu")),
            rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
            rope_theta=float(_get(d, "rope_theta", 1e6)),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=int(_get(d, "max_position_embeddings", 40960)),
            tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False)),
            attention_bias=bool(_get(d, "attention_bias", False)),
            bos_token_id=d.get("bos_token_id", 151643),
            eos_token_id=d.get("eos_token_id", [151645, 151643]),
            pad_token_id=d.get("pad_token_id", 151643),
            query_num=int(_get(d, "query_num", 64)),
            image_size=int(_get(d, "image_size", 448)),
            patch_size=int(_get(d, "patch_size", 14)),
            drop_vision_last_layer=drop,
            audio_pool_step=int(_get(d, "audio_pool_step", 5)),
            audio_chunk_length=float(_get(d, "audio_chunk_length", 1.0)),
            stream_input=bool(_get(d, "stream_input", True)),
            use_image_id=bool(_get(d, "use_image_id", True)),
            slice_config=dict(_get(d, "slice_config", {"max_slice_nums": 1, "scale_resolution": 448, "patch_size": 14})),
            init_vision=bool(_get(d, "init_vision", True)),
            init_audio=bool(_get(d, "init_audio", True)),
            init_tts=bool(_get(d, "init_tts", True)),
            model_type=str(_get(d, "model_type", "minicpmo")),
            version=str(_get(d, "version", "4.5")),
            vision_config=VisionConfig.from_dict(dict(_get(d, "vision_config", {}))),
            audio_config=AudioConfig.from_dict(dict(_get(d, "audio_config", {}))),
            tts_config=TTSConfig.from_dict(dict(_get(d, "tts_config", {}))),
            raw=dict(d),
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "MiniCPMOConfig":
        """Read ``path`` (a ``config.json`` or a checkpoint directory). Raises :class:`ConfigError`."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"config.json not found: {p}")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: invalid JSON ({e})") from e
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        """The raw dict this config was read from (round-trips through ``from_dict``)."""
        return dict(self.raw)

    def validate(self) -> None:
        """Check the constraints of docs/model.md §9; raises :class:`ConfigError`."""
        if self.model_type != "minicpmo":
            raise ConfigError(f"model_type must be 'minicpmo', got {self.model_type!r}")
        if "version" not in self.raw and self.raw:
            raise ConfigError("config.json has no 'version'; MiniCPM-o 4.5 checkpoints carry \"version\": \"4.5\" "
                              "(docs/model.md §1.2) and older releases such as 2.6 are not supported")
        if self.version.strip() not in SUPPORTED_VERSIONS:
            raise ConfigError(f"unsupported MiniCPM-o version {self.version!r}: duplexkit's minicpmo45 port reads "
                              f"version 4.5 checkpoints only (docs/model.md §1.2); 2.6 and other releases differ in "
                              "architecture and token ids")
        if self.hidden_size < 128 or self.hidden_size % 128:
            raise ConfigError(f"hidden_size must be a positive multiple of 128 (resampler heads = hidden/128), got {self.hidden_size}")
        if self.query_num != 64:
            raise ConfigError(f"query_num must be 64 (the processor inserts 64 placeholders), got {self.query_num}")
        if self.init_audio:
            a = self.audio_config
            if a.encoder_ffn_dim != 4 * a.d_model:
                raise ConfigError(f"audio_config.encoder_ffn_dim must be 4*d_model ({4 * a.d_model}), got {a.encoder_ffn_dim}")
            if a.num_mel_bins != 80:
                raise ConfigError(f"audio_config.num_mel_bins must be 80, got {a.num_mel_bins}")
        if self.init_tts:
            t = self.tts_config
            if t.llm_dim != self.hidden_size:
                raise ConfigError(f"tts_config.llm_dim ({t.llm_dim}) must equal hidden_size ({self.hidden_size})")
            if t.num_text_tokens < self.vocab_size:
                raise ConfigError(f"tts_config.num_text_tokens ({t.num_text_tokens}) must be >= vocab_size ({self.vocab_size})")
            for name in ("audio_bos_token_id", "text_eos_token_id"):
                if not 0 <= getattr(t, name) < t.num_text_tokens:
                    raise ConfigError(f"tts_config.{name} out of range of num_text_tokens")

    @property
    def vision_layers_used(self) -> int:
        """SigLIP layers built (one fewer when ``drop_vision_last_layer``; docs/model.md §1.1)."""
        n = self.vision_config.num_hidden_layers
        return n - 1 if self.drop_vision_last_layer else n

    @property
    def resampler_heads(self) -> int:
        return self.hidden_size // 128

    def to_qwen3_config(self):
        """A ``transformers.Qwen3Config`` for the ``llm.`` module (docs/model.md §1.1)."""
        from transformers import Qwen3Config

        kw = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            use_sliding_window=False,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
            rope.setdefault("rope_theta", self.rope_theta)
        try:
            c = Qwen3Config(rope_parameters=rope, **kw)
        except TypeError:  # transformers 4.x
            c = Qwen3Config(rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, **kw)
        c._attn_implementation = "sdpa"
        return c
