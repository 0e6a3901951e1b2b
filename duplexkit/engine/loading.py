"""Load an engine by name: a checkpoint directory, ``tiny`` (random weights) or ``scripted``.

``from duplexkit.engine import load_engine`` — used by the CLI, the examples and the benchmarks.
Nothing heavy is imported until :func:`load_engine` runs (torch only for a real checkpoint). Named
engines other than ``tiny`` are plugins (:mod:`.plugins`): the engine never imports
:mod:`duplexkit.testing` itself.
Loading a real model sets ``TORCHDYNAMO_DISABLE=1`` unless it is set already (docs/model.md §7.5).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

from duplexkit.errors import EngineLoadError, LayoutError

from .checks import PreflightError, check_model
from .plugins import engine_plugins, load_plugin

__all__ = ["load_engine", "check_model_arg"]


def _progress(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def load_engine(model: str, *, layout: Optional[str] = None, dtype: Optional[str] = None, seed: int = 0,
                progress: bool = True, scripted: Optional[dict] = None, model_id: Optional[str] = None,
                checked: bool = False, quantization: Optional[str] = None,
                memory_gib: Optional[float] = None):
    """Load the engine named by ``model``: a checkpoint path, ``tiny``, or an engine plugin's name
    (:mod:`.plugins`: ``scripted``, the torch-free scripted engine of :mod:`duplexkit.testing`,
    declared in the ``duplexkit.engines`` entry-point group). ``scripted`` holds the plugin's options
    (for ``scripted``: :class:`~duplexkit.testing.ScriptConfig` fields). ``quantization``
    (``none`` | ``int8`` | ``fp8``) quantizes the thinker's and talker's decoder weights of a
    checkpoint or ``tiny`` (docs/model.md "Quantized weights"); an engine plugin refuses any mode
    but ``none`` (LayoutError), as it refuses ``memory_gib``.

    Runs the pre-load checks first (unless ``checked``: the caller already ran them).

    ``memory_gib``: a device memory budget (``duplexkit serve --memory``): the engine is built to
    :mod:`~duplexkit.engine.memory_plan`'s plan for it (``DuplexEngine.from_pretrained(memory_gib=...)``).

    Raises:
        PreflightError / LayoutError (the CLI's exit 2) from the checks, and
        :class:`~duplexkit.engine.memory_plan.MemoryBudgetError` (a LayoutError) when ``memory_gib``
        cannot hold the model, and a PreflightError for ``memory_gib`` or a ``quantization`` other
        than ``none`` given for an engine plugin;
        :class:`~duplexkit.errors.EngineLoadError` (exit 4) when loading itself fails (the message
        keeps the loader's text).
    """
    if not checked:
        check_model_arg(model, layout)
    if model in engine_plugins():  # e.g. "scripted": duplexkit.testing's, through the entry point
        check_plugin_options(model, memory_gib=memory_gib, quantization=quantization)
        try:
            factory = load_plugin(model)
        except (ImportError, AttributeError) as exc:
            raise EngineLoadError(f"engine plugin {model!r} failed to load: {type(exc).__name__}: {exc}") from exc
        try:
            return factory(model_id=model_id or model, **(scripted or {}))
        except (TypeError, ValueError) as exc:
            raise EngineLoadError(f"engine failed to load: {exc}") from exc
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if progress:
        _progress(f"loading {'the tiny random-weight model' if model == 'tiny' else model} "
                f"(layout {layout or 'auto'}) ...")
    t0 = time.monotonic()
    try:
        from duplexkit.engine import DuplexEngine

        kwargs: dict[str, Any] = {"layout": layout, "dtype": dtype, "progress": progress, "seed": seed}
        if quantization not in (None, "", "none"):
            kwargs["quantization"] = quantization
        if model_id:
            kwargs["model_id"] = model_id
        if memory_gib is not None:
            kwargs["memory_gib"] = float(memory_gib)
        engine = DuplexEngine.from_pretrained(model, **kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        if isinstance(exc, LayoutError):  # e.g. torch sees fewer GPUs than the driver: still a usage error
            raise
        raise EngineLoadError(f"engine failed to load: {type(exc).__name__}: {exc}") from exc
    if progress:
        _progress(f"model ready in {time.monotonic() - t0:.1f} s")
    return engine


def check_plugin_options(model: str, *, memory_gib: Optional[float] = None, quantization: Optional[str] = None) -> None:
    """Refuse the MiniCPM-o 4.5 load options for an engine plugin (``serve scripted --memory 4`` or
    ``--quantization int8``): a usage error rather than an option silently ignored. No-op for a
    checkpoint or ``tiny``.

    Raises:
        PreflightError (the CLI's exit 2, the message as it is): ``memory_gib`` given, or
        ``quantization`` other than ``none``.
    """
    if model not in engine_plugins():
        return
    if memory_gib is not None:
        raise PreflightError(f"--memory plans a MiniCPM-o 4.5 model (a checkpoint or 'tiny'), not the {model!r} engine")
    if quantization not in (None, "", "none"):
        raise PreflightError(f"--quantization quantizes a MiniCPM-o 4.5 model's weights (a checkpoint or 'tiny'), "
                          f"not the {model!r} engine")


def check_model_arg(model: str, layout: Optional[str]) -> None:
    """Cheap checks before anything heavy loads and before ``serve`` binds its port
    (:func:`duplexkit.engine.checks.check_model`: directory, ``config.json``, weight files, layout and
    its CUDA devices). No torch, no server import.

    Raises:
        PreflightError, LayoutError, LayoutNotSupportedError: all reported with exit status 2.
    """
    check_model(model, layout)
