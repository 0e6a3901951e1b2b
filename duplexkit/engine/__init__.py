"""The engine: the Engine interface (:mod:`.api`) and the built-in three-stage runtime.

``from duplexkit.engine import DuplexEngine, load_layout, Layout`` — the runtime parts import torch
lazily (through the model port), so importing this package stays light.
"""

from __future__ import annotations

from .api import *  # noqa: F401,F403 - the Session<->engine contract
from .api import __all__ as _api_all
from .layout import Layout, LayoutError, LayoutNotSupportedError, StageLayout, available_layouts, load_layout
from .runtime import EngineInputError, RuntimeStream, StageRuntime
from .engine import DuplexEngine, tiny_checkpoint_dir

__all__ = list(_api_all) + [
    "DuplexEngine",
    "EngineInputError",
    "Layout",
    "LayoutError",
    "LayoutNotSupportedError",
    "RuntimeStream",
    "StageLayout",
    "StageRuntime",
    "available_layouts",
    "load_layout",
    "tiny_checkpoint_dir",
]
