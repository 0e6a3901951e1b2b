"""MiniCPM-o 4.5 rebuilt as Thinker -> Talker -> Code2Wav (docs/model.md).

Public API (docs/model.md): :class:`MiniCPMOConfig`, :func:`load_tokenizer`, :class:`SpecialTokens`,
:func:`load`, :class:`MiniCPMO45`, :class:`CheckpointError`, :func:`build_tiny_checkpoint`, and the
duplex types :class:`UnitInput`, :class:`UnitResult`, :class:`DuplexPolicy`. Torch-dependent names
are imported lazily, so ``import duplexkit.models.minicpmo45`` stays light.
"""

from __future__ import annotations

import importlib

__all__ = [
    "MiniCPMOConfig",
    "ConfigError",
    "load_tokenizer",
    "SpecialTokens",
    "TokenizerError",
    "load",
    "MiniCPMO45",
    "CheckpointError",
    "build_tiny_checkpoint",
    "tiny_checkpoint",
    "UnitInput",
    "UnitResult",
    "DuplexPolicy",
    "ThinkerStream",
    "ChatThinkerResult",
]

_LAZY = {
    "MiniCPMOConfig": ".config",
    "ConfigError": ".config",
    "load_tokenizer": ".tokenizer",
    "SpecialTokens": ".tokenizer",
    "TokenizerError": ".tokenizer",
    "load": ".loader",
    "MiniCPMO45": ".loader",
    "CheckpointError": ".loader",
    "build_tiny_checkpoint": ".tiny",
    "tiny_checkpoint": ".tiny",
    "UnitInput": ".duplex",
    "UnitResult": ".duplex",
    "DuplexPolicy": ".duplex",
    "ThinkerStream": ".thinker",
    "ChatThinkerResult": ".thinker",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
