"""The engine: the Engine interface (:mod:`.api`) and the built-in three-stage runtime.

``from duplexkit.engine import DuplexEngine, load_layout, Layout`` — the runtime parts (asyncio,
threads, and torch through the model port) are imported lazily on first attribute access
(PEP 562), so importing this package — as the sans-I/O Session does for :mod:`.api` — stays light
and free of asyncio.
"""

from __future__ import annotations


from .api import *  # noqa: F401,F403 - the Session<->engine contract
from .api import __all__ as _api_all

from duplexkit._lazy import lazy_exports

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
    "PlacementPlan": ".placement",
    "plan_placement": ".placement",
    "load_engine": ".loading",
    "EngineProcess": ".process",
    "MemoryBudgetError": ".memory_plan",
    "MemoryPlan": ".memory_plan",
    "plan_memory": ".memory_plan",
    "EngineSpec": ".process",
}

__all__ = list(_api_all) + sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
