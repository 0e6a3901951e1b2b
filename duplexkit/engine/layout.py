"""Deployment layouts: which device each stage runs on, its dtype, memory budget and batch size.

A layout is a small YAML file (``duplexkit/engine/layouts/*.yaml``)::

    name: 1gpu
    description: ...
    stages:
      thinker:  {device: cuda:0, dtype: bfloat16, memory_fraction: 0.55, max_num_seqs: 4}
      talker:   {device: cuda:0, dtype: bfloat16, memory_fraction: 0.15, max_num_seqs: 4}
      code2wav: {device: cuda:0, dtype: float32,  memory_fraction: 0.15, max_num_seqs: 4}

Per stage:

* ``device``: ``cpu``, ``cuda`` or ``cuda:N``; the thinker may list several devices together with
  ``tensor_parallel_size`` (the 8x RTX 4090 layout).
* ``dtype``: ``float32`` | ``bfloat16`` | ``float16``.
* ``memory_fraction``: share of the device's memory the stage may use, in (0, 1]; ignored on the
  CPU. The stages placed on one CUDA device must not add up to more than 1.0.
* ``max_num_seqs``: the most streams one stage step serves (>= 1).
* ``tensor_parallel_size`` (thinker only, default 1): the built-in engine runs TP = 1 only;
  larger values need the later vLLM thinker backend and are refused by
  :func:`check_supported` with :class:`LayoutNotSupportedError`.
* ``max_model_len`` (optional): thinker context cap in tokens.

Bundled layouts: ``cpu``, ``1gpu`` (default on a GPU), ``2gpu``, ``3gpu``, ``8x4090``.
This module does not import torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from duplexkit.errors import LayoutError, LayoutNotSupportedError

__all__ = [
    "STAGES",
    "LAYOUT_DIR",
    "LayoutError",
    "LayoutNotSupportedError",
    "StageLayout",
    "Layout",
    "load_layout",
    "available_layouts",
    "check_supported",
]

STAGES = ("thinker", "talker", "code2wav")
LAYOUT_DIR = Path(__file__).resolve().parent / "layouts"
_DTYPES = ("float32", "bfloat16", "float16")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_STAGE_KEYS = {"device", "dtype", "memory_fraction", "max_num_seqs", "tensor_parallel_size", "max_model_len"}
_TOP_KEYS = {"name", "description", "stages"}


@dataclass(frozen=True)
class StageLayout:
    """Placement of one stage.

    Attributes:
        devices: one device string per tensor-parallel rank (``("cpu",)``, ``("cuda:0",)``).
        dtype: ``float32`` | ``bfloat16`` | ``float16``.
        max_num_seqs: most streams per stage step.
        memory_fraction: share of device memory in (0, 1], or None (no budget; CPU).
        tensor_parallel_size: ranks (== len(devices)).
        max_model_len: optional context cap in tokens (thinker).
    """

    devices: tuple
    dtype: str = "float32"
    max_num_seqs: int = 4
    memory_fraction: Optional[float] = None
    tensor_parallel_size: int = 1
    max_model_len: Optional[int] = None

    @property
    def device(self) -> str:
        """The stage's (first) device."""
        return self.devices[0]


@dataclass(frozen=True)
class Layout:
    """A validated deployment layout (see the module docstring). ``stages`` maps each of
    ``thinker``, ``talker``, ``code2wav`` to a :class:`StageLayout`."""

    name: str
    stages: dict
    description: str = ""
    source: str = ""

    @property
    def thinker(self) -> StageLayout:
        return self.stages["thinker"]

    @property
    def talker(self) -> StageLayout:
        return self.stages["talker"]

    @property
    def code2wav(self) -> StageLayout:
        return self.stages["code2wav"]

    def devices(self) -> dict:
        """``{"thinker": "cpu", "talker": ..., "code2wav": ...}`` (first device per stage), the
        form ``duplexkit.models.minicpmo45.load(devices=...)`` takes."""
        return {s: self.stages[s].device for s in STAGES}

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "Layout":
        """Validate a parsed layout mapping. Raises :class:`LayoutError` naming the bad field."""
        if not isinstance(data, dict):
            raise LayoutError("a layout must be a mapping with 'name' and 'stages'", source)
        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise LayoutError(f"unknown top-level keys {sorted(unknown)} (allowed: {sorted(_TOP_KEYS)})", source)
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise LayoutError("'name' must be a non-empty string", source)
        stages_raw = data.get("stages")
        if not isinstance(stages_raw, dict):
            raise LayoutError("'stages' must be a mapping of thinker/talker/code2wav", source)
        missing = [s for s in STAGES if s not in stages_raw]
        extra = sorted(set(stages_raw) - set(STAGES))
        if missing or extra:
            raise LayoutError(f"stages must be exactly {list(STAGES)} (missing {missing}, unknown {extra})", source)
        stages = {s: _parse_stage(s, stages_raw[s], source) for s in STAGES}
        _check_budgets(stages, source)
        return cls(name=name, stages=stages, description=str(data.get("description") or ""), source=source)


def _parse_stage(stage: str, raw, source: str) -> StageLayout:
    where = f"stages.{stage}"
    if not isinstance(raw, dict):
        raise LayoutError(f"{where} must be a mapping", source)
    unknown = set(raw) - _STAGE_KEYS
    if unknown:
        raise LayoutError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_STAGE_KEYS)})", source)
    dev = raw.get("device")
    devices = tuple(dev) if isinstance(dev, (list, tuple)) else (dev,)
    if not devices or not all(isinstance(d, str) and _DEVICE_RE.match(d) for d in devices):
        raise LayoutError(f"{where}.device must be 'cpu', 'cuda' or 'cuda:N' (or a list of them), got {dev!r}", source)
    if len(set(devices)) != len(devices):
        raise LayoutError(f"{where}.device lists a device twice: {list(devices)}", source)
    dtype = raw.get("dtype", "float32")
    if dtype not in _DTYPES:
        raise LayoutError(f"{where}.dtype must be one of {list(_DTYPES)}, got {dtype!r}", source)
    mns = raw.get("max_num_seqs", 4)
    if not isinstance(mns, int) or isinstance(mns, bool) or mns < 1:
        raise LayoutError(f"{where}.max_num_seqs must be an integer >= 1, got {mns!r}", source)
    frac = raw.get("memory_fraction")
    if frac is not None:
        if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not (0.0 < float(frac) <= 1.0):
            raise LayoutError(f"{where}.memory_fraction must be in (0, 1], got {frac!r}", source)
        frac = float(frac)
    tp = raw.get("tensor_parallel_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise LayoutError(f"{where}.tensor_parallel_size must be an integer >= 1, got {tp!r}", source)
    if tp > 1 and stage != "thinker":
        raise LayoutError(f"{where}: only the thinker may be tensor-parallel", source)
    if tp != len(devices):
        raise LayoutError(f"{where}: tensor_parallel_size {tp} needs {tp} devices, got {list(devices)}", source)
    if any(d == "cpu" for d in devices) and len(devices) > 1:
        raise LayoutError(f"{where}: tensor parallelism needs CUDA devices", source)
    mml = raw.get("max_model_len")
    if mml is not None and (not isinstance(mml, int) or isinstance(mml, bool) or mml < 1):
        raise LayoutError(f"{where}.max_model_len must be an integer >= 1, got {mml!r}", source)
    return StageLayout(devices=devices, dtype=dtype, max_num_seqs=mns, memory_fraction=frac,
                       tensor_parallel_size=tp, max_model_len=mml)


def _normal(dev: str) -> str:
    return "cuda:0" if dev == "cuda" else dev


def _check_budgets(stages: dict, source: str) -> None:
    total: dict = {}
    for st in stages.values():
        for d in st.devices:
            if d != "cpu" and st.memory_fraction is not None:
                total[_normal(d)] = total.get(_normal(d), 0.0) + st.memory_fraction
    over = {d: round(f, 3) for d, f in total.items() if f > 1.0 + 1e-9}
    if over:
        raise LayoutError(f"memory_fraction of the stages sharing a device adds up to more than 1.0: {over}", source)


def available_layouts() -> list:
    """Names of the bundled layouts."""
    return sorted(p.stem for p in LAYOUT_DIR.glob("*.yaml"))


def load_layout(name_or_path: Union[str, Path, "Layout"]) -> Layout:
    """Load and validate a layout.

    Args:
        name_or_path: a bundled layout name (``cpu``, ``1gpu``, ``2gpu``, ``3gpu``, ``8x4090``), a
            path to a YAML file, or a :class:`Layout` (returned as is).

    Raises:
        LayoutError: unknown name, missing/unreadable file, bad YAML, or an invalid field.
    """
    if isinstance(name_or_path, Layout):
        return name_or_path
    import yaml  # pyyaml: engine extra

    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith((".yaml", ".yml")) or path.exists()):
        path = LAYOUT_DIR / f"{text}.yaml"
        if not path.is_file():
            raise LayoutError(f"unknown layout {text!r}; bundled layouts: {available_layouts()} (or pass a .yaml path)")
    if not path.is_file():
        raise LayoutError("layout file not found", str(path))
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise LayoutError(f"cannot read layout: {exc}", str(path)) from exc
    return Layout.from_dict(data, source=str(path))


def check_supported(layout: Layout, *, cuda_devices: int) -> None:
    """Refuse layouts the built-in engine cannot run.

    Args:
        cuda_devices: number of visible CUDA devices (``torch.cuda.device_count()``).

    Raises:
        LayoutNotSupportedError: thinker ``tensor_parallel_size`` > 1 (needs the vLLM thinker
            backend, not part of the built-in engine), or a CUDA device index beyond those visible.
    """
    tp = layout.thinker.tensor_parallel_size
    if tp > 1:
        raise LayoutNotSupportedError(
            f"thinker tensor_parallel_size={tp} needs the vLLM thinker backend, which the built-in "
            "engine does not have yet; use a layout with tensor_parallel_size 1 (cpu, 1gpu, 2gpu, 3gpu)",
            layout.source or layout.name,
        )
    for stage in STAGES:
        for d in layout.stages[stage].devices:
            if d == "cpu":
                continue
            idx = int(d.split(":")[1]) if ":" in d else 0
            if idx >= cuda_devices:
                raise LayoutNotSupportedError(
                    f"stages.{stage} wants {d} but {cuda_devices} CUDA device(s) are visible",
                    layout.source or layout.name,
                )
