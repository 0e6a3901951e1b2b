"""The engine: the Engine interface (:mod:`.api`) and the built-in three-stage runtime.

``from duplexkit.engine import DuplexEngine, load_layout, Layout`` — the runtime parts (asyncio,
threads, and torch through the model port) are imported lazily on first attribute access
(PEP 562), so importing this package — as the sans-I/O Session does for :mod:`.api` — stays light
and free of asyncio.
"""

from __future__ import annotations

import importlib
from typing import Any

from .api import *  # noqa: F401,F403 - the Session<->engine contract
from .api import __all__ as _api_all

#: lazily imported name -> submodule that defines it
_LAZY = {
    "DuplexEngine": ".engine",
    "tiny_checkpoint_dir": ".engine",
    "EngineInputError": ".runtime",
    "RuntimeStream": ".runtime",
    "StageRuntime": ".runtime",
    "Layout": ".layout",
    "LayoutError": ".layout",
    "LayoutNotSupportedError": ".layout",
    "StageLayout": ".layout",
    "available_layouts": ".layout",
    "load_layout": ".layout",
}

__all__ = list(_api_all) + sorted(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
