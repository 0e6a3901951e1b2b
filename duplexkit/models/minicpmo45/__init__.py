"""MiniCPM-o 4.5 rebuilt as Thinker -> Talker -> Code2Wav (docs/model.md).

Public API (docs/model.md): :class:`MiniCPMOConfig`, :func:`load_tokenizer`, :class:`SpecialTokens`,
:func:`load`, :class:`MiniCPMO45`, :class:`CheckpointError`, :class:`QuantizationError` (``load(...,
quantization=)``), :func:`build_tiny_checkpoint`, and the
duplex types :class:`UnitInput`, :class:`UnitResult`, :class:`DuplexPolicy`. Torch-dependent names
are imported lazily, so ``import duplexkit.models.minicpmo45`` stays light.
"""

from __future__ import annotations


__all__ = [
    "MiniCPMOConfig",
    "ConfigError",
    "load_tokenizer",
    "SpecialTokens",
    "TokenizerError",
    "load",
    "MiniCPMO45",
    "CheckpointError",
    "QuantizationError",
    "build_tiny_checkpoint",
    "tiny_checkpoint",
    "UnitInput",
    "UnitResult",
    "DuplexPolicy",
    "ThinkerStream",
    "ChatThinkerResult",
]

from duplexkit._lazy import lazy_exports

_LAZY = {
    "MiniCPMOConfig": ".config",
    "ConfigError": ".config",
    "load_tokenizer": ".tokenizer",
    "SpecialTokens": ".tokenizer",
    "TokenizerError": ".tokenizer",
    "load": ".loader",
    "MiniCPMO45": ".loader",
    "CheckpointError": ".loader",
    "QuantizationError": ".quantization",
    "build_tiny_checkpoint": ".tiny",
    "tiny_checkpoint": ".tiny",
    "UnitInput": ".duplex",
    "UnitResult": ".duplex",
    "DuplexPolicy": ".duplex",
    "ThinkerStream": ".thinker",
    "ChatThinkerResult": ".thinker",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
