"""Cheap checks of a model argument before anything heavy loads: no torch, no model code, no
server, no socket (a checkpoint directory's ``config.json`` and weight files, a layout and its CUDA
devices).

:func:`~duplexkit.engine.loading.load_engine` runs :func:`check_model` first, and the ``duplexkit``
CLI runs it before it binds a port or imports torch, so a wrong path, a broken ``config.json``,
missing weight files or a GPU layout on a machine without a GPU are refused within a second instead
of after a long import. :mod:`duplexkit.preflight` re-exports these checks beside its remote-server
helpers.

Everything here imports only the standard library, the torch-free config module of the model port
and :mod:`.layout` (pyyaml).
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from typing import Optional

from duplexkit.errors import DuplexkitError, LayoutNotSupportedError

from .layout import check_supported, load_layout
from .plugins import engine_plugins

RANDOM_WEIGHTS_NOTICE = ("NOTE: this model has RANDOM weights (the 'tiny' test checkpoint): the text is gibberish and "
                         "the speech is noise. Use a real MiniCPM-o 4.5 checkpoint directory for real answers.")
"""The line printed when an engine (local, or remote per ``/health``'s ``random_weights``) is random:
by :meth:`DuplexEngine.from_pretrained` with ``progress`` and by the CLI (re-exported by
:mod:`duplexkit.preflight`)."""

__all__ = ["BUILTIN_MODELS", "PreflightError", "check_checkpoint_dir", "check_layout", "check_model",
           "visible_cuda_devices"]

BUILTIN_MODELS = ("tiny",)
"""Model names that are no directory and need no plugin: ``tiny`` (the random-weight test model).
Engine plugins (:mod:`.plugins`, e.g. ``scripted``) are names too."""


class PreflightError(DuplexkitError, ValueError):
    """A model argument that cannot work: missing directory, no or bad ``config.json``, no weight
    files, or shards named in the index missing. The message names the path and the fix."""

    default_code = "bad_checkpoint"


def check_checkpoint_dir(path: Path) -> None:
    """Check a checkpoint directory without reading any tensor.

    Checks, in order: the directory exists; ``config.json`` exists, is JSON and passes
    :meth:`MiniCPMOConfig.validate` (model_type ``minicpmo``, version 4.5, shapes); the weights are
    present (``model.safetensors``, or ``model.safetensors.index.json`` whose shards all exist).
    The full key check happens at load (``CheckpointError``).

    Raises:
        PreflightError: with the first problem found.
    """
    from duplexkit.models.minicpmo45.config import ConfigError, MiniCPMOConfig  # torch-free module

    hint = "(pass a MiniCPM-o 4.5 checkpoint directory, or 'tiny' / 'scripted')"
    if path.exists() and not path.is_dir():
        raise PreflightError(f"expected a checkpoint directory, got a file: {path} {hint}")
    if not path.is_dir():
        raise PreflightError(f"checkpoint directory not found: {path} {hint}")
    if not (path / "config.json").is_file():
        raise PreflightError(f"{path} is not a MiniCPM-o 4.5 checkpoint directory: it has no config.json {hint}")
    try:
        MiniCPMOConfig.from_file(path).validate()
    except ConfigError as exc:
        raise PreflightError(f"bad config.json in {path}: {exc}") from exc
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PreflightError(f"{index}: unreadable weight index ({exc})") from exc
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise PreflightError(f"{path}: {len(missing)} of {len(files)} shard file(s) named in the index are missing "
                                 f"(an interrupted download? run the download again): {missing[:4]}"
                                 f"{' ...' if len(missing) > 4 else ''}")
    elif not (path / "model.safetensors").is_file():
        raise PreflightError(f"{path}: no model.safetensors and no model.safetensors.index.json (weights not downloaded?)")


def visible_cuda_devices() -> Optional[int]:
    """Number of CUDA devices the NVIDIA driver shows this process, without importing torch.

    Asks the driver library (``libcuda.so.1``: ``cuInit`` + ``cuDeviceGetCount``), which honours
    ``CUDA_VISIBLE_DEVICES`` like torch does. Returns 0 when the library is absent or finds no
    device, None off Linux (unknown: the caller skips the check).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    try:
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
    except AttributeError:  # pragma: no cover - not a CUDA driver library
        return 0
    return int(count.value)


def check_layout(layout: str, *, cuda_devices: Optional[int] = None) -> None:
    """Load and validate ``layout`` (a bundled name or a YAML path) and check that its CUDA devices exist.

    Args:
        cuda_devices: visible CUDA devices; None asks :func:`visible_cuda_devices`.
    Raises:
        LayoutError: unknown name, unreadable or invalid YAML.
        LayoutNotSupportedError: a stage wants a CUDA device that is not visible (e.g. ``1gpu`` on a
            CPU-only machine), or a ``vllm`` thinker backend while vllm cannot be imported.
    """
    lay = load_layout(layout)
    n = visible_cuda_devices() if cuda_devices is None else cuda_devices
    if n is None:
        return
    wants = sorted({d for s in lay.stages.values() for d in s.devices if d != "cpu"})
    if wants and n == 0:
        raise LayoutNotSupportedError(
            f"layout {lay.name!r} places stages on {', '.join(wants)} but this machine shows no CUDA device "
            "(no NVIDIA GPU or driver, or CUDA_VISIBLE_DEVICES hides them); use --layout cpu, or omit --layout",
            lay.source or lay.name)
    check_supported(lay, cuda_devices=n)


def check_model(model: str, layout: Optional[str] = None) -> None:
    """All pre-load checks for a CLI model argument (a directory, ``tiny`` or ``scripted``) and ``--layout``.

    Raises:
        PreflightError, LayoutError, LayoutNotSupportedError (see above).
    """
    plugin = model in engine_plugins()
    if model not in BUILTIN_MODELS and not plugin:
        check_checkpoint_dir(Path(model).expanduser())
    if layout is not None and not plugin:
        check_layout(layout)
