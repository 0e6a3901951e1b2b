"""Placement plan: where every stage of a layout goes, checked against a checkpoint, built without GPUs.

:func:`plan_placement` turns a validated :class:`~duplexkit.engine.layout.Layout` plus the
checkpoint's ``config.json`` into a :class:`PlacementPlan`: per stage its backend, devices,
tensor-parallel size and, for a ``vllm`` thinker, the keyword arguments of vLLM's
``AsyncEngineArgs``. It raises before any weight is read when the layout cannot hold that
checkpoint (tensor-parallel size not dividing the attention heads, a device index out of range).
Neither torch nor vllm is imported here, so the plan of the ``8x4090`` layout can be built and
checked on a machine without GPUs (tests/engine/test_placement.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from duplexkit.errors import LayoutError, LayoutNotSupportedError

from .layout import STAGES, Layout, load_layout

__all__ = ["StagePlacement", "PlacementPlan", "plan_placement", "check_heads"]


@dataclass(frozen=True)
class StagePlacement:
    """One stage's placement.

    Attributes:
        stage: ``thinker`` | ``talker`` | ``code2wav``.
        backend: ``native`` | ``vllm``.
        devices: device strings, one per tensor-parallel rank (``"cuda"`` normalised to ``"cuda:0"``).
        dtype: ``float32`` | ``bfloat16`` | ``float16``.
        memory_fraction: share of each device's memory, or None (CPU, no budget).
        max_num_seqs: most streams per stage step.
        tensor_parallel_size: ranks.
        engine_args: for a ``vllm`` thinker, the ``vllm.AsyncEngineArgs`` keyword arguments; else None.
    """

    stage: str
    backend: str
    devices: tuple
    dtype: str
    memory_fraction: Optional[float]
    max_num_seqs: int
    tensor_parallel_size: int = 1
    engine_args: Optional[dict] = None


@dataclass(frozen=True)
class PlacementPlan:
    """The whole layout's placement.

    Attributes:
        layout: the layout name.
        stages: ``{stage: StagePlacement}``.
        by_device: ``{device: ((stage, memory_fraction or None), ...)}`` in stage order.
        heads: ``(num_attention_heads, num_key_value_heads)`` of the thinker checkpoint, or None
            when the plan was built without a checkpoint.
    """

    layout: str
    stages: dict
    by_device: dict = field(default_factory=dict)
    heads: Optional[tuple] = None

    def devices_used(self) -> list:
        """Sorted distinct devices of all stages."""
        return sorted(self.by_device)

    def describe(self) -> str:
        """One line per stage, e.g. ``thinker  vllm    TP=4 cuda:0,cuda:1,cuda:2,cuda:3 bfloat16 0.85``."""
        lines = []
        for s in STAGES:
            p = self.stages[s]
            frac = "-" if p.memory_fraction is None else f"{p.memory_fraction:g}"
            lines.append(f"{s:<9}{p.backend:<7} TP={p.tensor_parallel_size} {','.join(p.devices)} {p.dtype} {frac}")
        return "\n".join(lines)


def _norm(dev: str) -> str:
    return "cuda:0" if dev == "cuda" else dev


def check_heads(tp: int, num_attention_heads: int, num_key_value_heads: int, where: str = "") -> None:
    """Refuse a thinker tensor-parallel size the checkpoint's attention cannot be split by.

    vLLM shards the query heads evenly (``num_attention_heads % tp == 0``) and either shards the
    key/value heads (``num_key_value_heads % tp == 0``) or replicates them when there are fewer
    than ranks (``tp % num_key_value_heads == 0``).

    Raises:
        LayoutNotSupportedError: naming the head counts and the size.
    """
    if num_attention_heads % tp:
        raise LayoutNotSupportedError(
            f"stages.thinker.tensor_parallel_size {tp} does not divide the checkpoint's "
            f"num_attention_heads {num_attention_heads}", where)
    if num_key_value_heads % tp and tp % num_key_value_heads:
        raise LayoutNotSupportedError(
            f"stages.thinker.tensor_parallel_size {tp} neither divides nor is a multiple of the checkpoint's "
            f"num_key_value_heads {num_key_value_heads}", where)


def _heads(checkpoint: Union[str, Path, dict, Any, None]) -> Optional[tuple]:
    if checkpoint is None:
        return None
    from duplexkit.models.minicpmo45.config import MiniCPMOConfig

    if isinstance(checkpoint, dict):
        cfg = MiniCPMOConfig.from_dict(checkpoint)
    elif isinstance(checkpoint, (str, Path)):
        cfg = MiniCPMOConfig.from_file(checkpoint)
    else:
        cfg = checkpoint
    return int(cfg.num_attention_heads), int(cfg.num_key_value_heads)


def plan_placement(layout: Union[Layout, str, Path], checkpoint: Union[str, Path, dict, Any, None] = None, *,
                   cuda_devices: Optional[int] = None, model_path: Optional[str] = None) -> PlacementPlan:
    """Build and check the placement of ``layout`` for ``checkpoint`` (no torch, no vllm, no GPU).

    Args:
        layout: a :class:`Layout`, bundled name or YAML path.
        checkpoint: the thinker checkpoint's config: a checkpoint directory, a ``config.json``
            path, its parsed dict, or a ``MiniCPMOConfig``; None skips the head check.
        cuda_devices: visible CUDA devices; None skips the index range check.
        model_path: the ``model`` argument put into a vllm thinker's engine args (default: the
            checkpoint directory when ``checkpoint`` is a path, else None).

    Returns:
        the :class:`PlacementPlan`.

    Raises:
        LayoutError: invalid layout (from :func:`load_layout`).
        LayoutNotSupportedError: tensor-parallel size not fitting the checkpoint's heads, or a
            device index beyond ``cuda_devices``.
        duplexkit.models.minicpmo45.config.ConfigError: unreadable checkpoint config.
    """
    lay = load_layout(layout)
    where = lay.source or lay.name
    heads = _heads(checkpoint)
    if model_path is None and isinstance(checkpoint, (str, Path)):
        p = Path(checkpoint)
        model_path = str(p if p.is_dir() else p.parent)
    stages = {}
    by_device: dict = {}
    for s in STAGES:
        st = lay.stages[s]
        devices = tuple(_norm(d) for d in st.devices)
        if cuda_devices is not None:
            for d in devices:
                if d != "cpu" and int(d.split(":")[1]) >= cuda_devices:
                    raise LayoutNotSupportedError(
                        f"stages.{s} wants {d} but {cuda_devices} CUDA device(s) are visible", where)
        args = None
        if st.backend == "vllm":
            if heads is not None:
                check_heads(st.tensor_parallel_size, heads[0], heads[1], where)
            args = {
                "model": model_path,
                "tensor_parallel_size": st.tensor_parallel_size,
                "dtype": st.dtype,
                "max_num_seqs": st.max_num_seqs,
                "trust_remote_code": True,
            }
            if st.max_model_len is not None:
                args["max_model_len"] = st.max_model_len
            if devices != ("cpu",):
                args["gpu_memory_utilization"] = st.memory_fraction
                if st.tensor_parallel_size > 1:
                    args["distributed_executor_backend"] = "mp"
        elif st.tensor_parallel_size != 1:  # pragma: no cover - Layout.from_dict refuses it
            raise LayoutError("tensor parallelism needs backend: vllm", where)
        stages[s] = StagePlacement(stage=s, backend=st.backend, devices=devices, dtype=st.dtype,
                                   memory_fraction=st.memory_fraction, max_num_seqs=st.max_num_seqs,
                                   tensor_parallel_size=st.tensor_parallel_size, engine_args=args)
        for d in devices:
            by_device.setdefault(d, []).append((s, st.memory_fraction))
    return PlacementPlan(layout=lay.name, stages=stages,
                         by_device={d: tuple(v) for d, v in by_device.items()}, heads=heads)
