"""GPU memory budget planner: how many duplex streams fit a memory budget, and what takes the memory.

``duplexkit plan-memory``, ``duplexkit serve --memory GIB`` and ``benchmarks/gpu_engine.py --memory GIB``
use it. From the model's sizes (:class:`ModelSizes`, counted from the config without weights:
:func:`model_sizes`), the thinker/talker dtype, the weight quantization mode and a budget in GiB,
:func:`plan_memory` chooses the number of stream slots, the thinker's KV positions per stream and the
Code2Wav Euler-loop graph rows, and returns a :class:`MemoryPlan` (``str(plan)`` is its table). When
the weights alone, or one stream, do not fit, it raises :class:`MemoryBudgetError` with the same table
and the smallest budget that fits.

What is computed and what is measured:

* **computed from the config** (exact, byte for byte with what the code allocates): the weights of each
  stage (parameter counts of the modules built on the ``meta`` device; quantized linears at 1 byte per
  weight + :data:`QUANT_SCALE_BYTES` per output channel), the static KV pools of the fast paths
  (:class:`~duplexkit.models.minicpmo45.fast_kv.KVPool`: thinker LLM, its Whisper streaming cache and the
  talker, each ``streams + 1`` slots: one is the graphs' scratch slot), Code2Wav's per-stream flow
  caches, its voice base cache, its single-stream flow buffers and the Euler-loop graphs' shared
  scratch (:meth:`~duplexkit.models.minicpmo45.fast_code2wav.BatchedCode2Wav.dit_scratch` shapes);
* **measured** (named constants below, each with its results file): the fixed reserve for CUDA-graph
  pools, cuBLAS/cuDNN workspaces and allocator slack, and the per-stream activation reserve
  (temporaries of a round: gathered caches, HiFT activations, logits), calibrated so that the plan of
  the 64-stream acceptance run equals its measured peak;
* **estimated**: the CUDA context outside PyTorch's allocator (:data:`CUDA_CONTEXT_GIB`, 0.5 GiB), until
  ``benchmarks/gpu_engine.py --memory`` has measured it.

Budget semantics: ``budget_gib`` is the device memory the engine may use, as a card of that size has
it: the CUDA context comes out of it, and the rest caps PyTorch's allocator
(:func:`apply_memory_cap`: ``torch.cuda.set_per_process_memory_fraction``), so a 24 GiB card can be
emulated on a bigger one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from duplexkit.errors import LayoutError

__all__ = ["MemoryBudgetError", "MemoryPlan", "ModelSizes", "Code2WavSizes", "PlanItem", "plan_memory",
           "model_sizes", "model_sizes_for", "plan_for_model", "apply_memory_cap", "sizing_table",
           "layout_for_plan", "fast_options", "apply_plan_to_model",
           "QUANTIZATION_MODES", "DTYPE_BYTES", "QUANT_SCALE_BYTES", "CUDA_CONTEXT_GIB", "FIXED_RESERVE_GIB",
           "activation_per_stream_gib", "MIN_THINKER_POSITIONS", "MIN_GRAPH_ROWS", "DEFAULT_THINKER_POSITIONS", "MAX_STREAMS",
           "CODE2WAV_REAL", "CODE2WAV_TINY", "GiB"]

GiB = 2 ** 30

QUANTIZATION_MODES = ("none", "int8", "fp8")
"""Weight quantization modes: ``none`` keeps every weight in the model dtype; ``int8`` and ``fp8``
store the decoder-layer linears of the thinker's LLM and of the talker (attention and MLP projections)
at 1 byte per weight plus one scale per output channel; embeddings, ``lm_head``, norms, the vision and
audio encoders and Code2Wav keep their dtype."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the dtypes a layout may name."""

QUANT_SCALE_BYTES = 4
"""Bytes of one per-output-channel scale of a quantized linear (float32; a bf16 scale would take 2: the
difference is under 2 MB for the whole model)."""

DEFAULT_THINKER_POSITIONS = 2048
"""Thinker KV positions per stream the planner starts from (the GPU benchmarks' ``--kv-len 2048``:
about 2.6 min of audio-only duplex before the sliding window drops old units, docs/model.md §10)."""

MIN_THINKER_POSITIONS = 1024
"""The fewest thinker KV positions the planner shrinks to (halving from the wanted count): a session
prefix with a 30 s reference voice (~330 positions) plus a sliding window of ~500 positions (the
reference window drops 500 positions at a time, 4000 -> 3500), with room for a 97-position unit."""

WINDOW_MARGIN = 128
"""Positions kept free above the sliding window's top when the planner shrinks the thinker's KV below
the default window (``DuplexPolicy.window_high`` 4000): a unit takes at most 77 + 20 positions
(docs/model.md §5.2)."""

WINDOW_DROP = 500
"""Positions one slide drops (the reference's 4000 -> 3500)."""

MAX_STREAMS = 64
"""The most streams the planner gives: the largest CUDA-graph batch bucket of the thinker and talker
(``fast_thinker.BATCH_BUCKETS``)."""

MIN_GRAPH_ROWS = 4
"""The fewest Code2Wav Euler-loop graph rows the planner chooses by itself (when more streams than
this are planned): fewer rows make a round's Euler loop run as more sub-batches (each ~30 ms at one
stream on the H200, benchmarks/results/2026-12-03-code2wav-caches-acceptance-h200.md), which the
real-time budget of a 1-s unit does not hold at several speaking streams; the planner gives fewer
streams instead. ``graph_rows`` given to :func:`plan_memory` overrides it."""

WHISPER_ALIGN = 32
"""The Whisper K/V pool's positions are the encoder's source positions rounded up to this
(``fast_whisper._ALIGN``: 1500 -> 1504)."""

# ------------------------------------------------------------------------------------------ measured
CUDA_CONTEXT_GIB = 0.5
"""CUDA context, kernels' modules and cuBLAS/cuDNN handles: device memory outside PyTorch's allocator
(not capped by ``set_per_process_memory_fraction``). An estimate, not yet measured in this project:
``benchmarks/gpu_engine.py --memory`` prints the measured value (``mem_get_info`` used minus
``memory_reserved``) as ``outside the allocator`` in its ``memory plan check`` line; replace this
figure with that one, naming the results file."""

FIXED_RESERVE_GIB = 1.5
"""CUDA-graph pools of every captured graph (thinker steps, Whisper passes, talker units, Code2Wav
encoder), cuBLAS/cuDNN workspaces and allocator slack, at any stream count: 57.8 GiB allocated after
the warm-up at 48 streams against 56.3 GiB of weights, KV pools and Code2Wav buffers
(benchmarks/results/2026-12-02-cudnn-per-thread-h200.md, call 4)."""

ACCEPTANCE_PEAK_GIB = 116.3
"""Peak allocated of the acceptance run: 64 streams, thinker KV 2048 positions, bf16, 16 Euler-loop
graph rows, float16 Code2Wav attention caches, default voice
(benchmarks/results/2026-12-03-code2wav-caches-acceptance-h200.md)."""

ACCEPTANCE_STREAMS = 64

# ------------------------------------------------------------------------------------------ errors


class MemoryBudgetError(LayoutError):
    """The memory budget cannot hold the weights, or not even one stream (or the streams asked for).

    A server configuration problem (code ``server_error``; the CLI exits with status 2, as for a layout
    error). The message holds the plan's table (what was needed against the budget) and the smallest
    budget that fits.

    Attributes:
        plan: the :class:`MemoryPlan` that did not fit (the smallest configuration tried).
        needed_gib: the smallest budget that fits ``streams`` streams (GiB), None when nothing can
            (e.g. a quantization mode the model cannot use).
        streams: the stream count that was asked for (1 when none was).
    """

    def __init__(self, message: str, plan: Optional["MemoryPlan"] = None, needed_gib: Optional[float] = None,
                 streams: int = 1) -> None:
        super().__init__(message)
        self.plan = plan
        self.needed_gib = needed_gib
        self.streams = streams


# ------------------------------------------------------------------------------------------ sizes


@dataclass(frozen=True)
class Code2WavSizes:
    """Code2Wav's geometry (docs/model.md §7.2) as the planner needs it.

    Attributes:
        flow_params / hift_params: parameter counts (counted from ``random_init._random_code2wav``: real
            155,802,352 / 20,821,295; tiny 21,879,024 / 392,271).
        steps / depth / heads / head_dim: Euler steps, DiT blocks, attention heads and head width.
        conv_ch: channels of a DiT block's causal conv cache (in + out: 1024).
        encoder_layers: conformer blocks + up-blocks (cached K/V, 512 wide each).
        width: the flow's width (512).
        mel_bins: 80.
    """

    flow_params: int
    hift_params: int
    steps: int = 10
    depth: int = 16
    heads: int = 8
    head_dim: int = 64
    conv_ch: int = 1024
    encoder_layers: int = 10
    width: int = 512
    mel_bins: int = 80


CODE2WAV_REAL = Code2WavSizes(flow_params=155_802_352, hift_params=20_821_295)
"""The released token2wav (docs/model.md §7.2)."""

CODE2WAV_TINY = Code2WavSizes(flow_params=21_879_024, hift_params=392_271, depth=2, encoder_layers=2)
"""The tiny builder's flow (docs/model.md §9: 512 / 8 x 64, DiT depth 2, 1 + 1 encoder blocks)."""


@dataclass(frozen=True)
class ModelSizes:
    """What the planner needs of a MiniCPM-o 4.5 configuration (:func:`model_sizes` counts it).

    Attributes:
        name: a label for the table (``real``, ``tiny``, a checkpoint folder).
        thinker_params / talker_params: parameters of each stage (thinker = ``llm`` + ``vpm`` +
            ``resampler`` + ``apm`` + ``audio_projection_layer``; talker = ``tts``).
        thinker_quant_params / talker_quant_params: of those, the weights of the decoder-layer linears
            (what ``int8`` / ``fp8`` store at 1 byte).
        thinker_quant_rows / talker_quant_rows: their output channels (one scale each).
        llm_layers / llm_kv_heads / llm_head_dim: the thinker's KV geometry.
        whisper_layers / whisper_heads / whisper_head_dim / whisper_positions: the Whisper K/V pool's.
        talker_layers / talker_kv_heads / talker_head_dim / talker_positions: the talker's KV geometry
            (its pool holds ``max_position_embeddings`` positions per slot).
        code2wav: :class:`Code2WavSizes`.
    """

    name: str
    thinker_params: int
    talker_params: int
    thinker_quant_params: int
    talker_quant_params: int
    thinker_quant_rows: int
    talker_quant_rows: int
    llm_layers: int
    llm_kv_heads: int
    llm_head_dim: int
    whisper_layers: int
    whisper_heads: int
    whisper_head_dim: int
    whisper_positions: int
    talker_layers: int
    talker_kv_heads: int
    talker_head_dim: int
    talker_positions: int
    code2wav: Code2WavSizes = CODE2WAV_REAL


def _linear_counts(layers) -> Tuple[int, int]:
    """(weights, output channels) of every ``nn.Linear`` under ``layers``."""
    from torch import nn

    w = rows = 0
    for mod in layers.modules():
        if isinstance(mod, nn.Linear):
            w += mod.weight.numel()
            rows += mod.weight.shape[0]
    return w, rows


def model_sizes(config: Any, name: str = "model", code2wav: Optional[Code2WavSizes] = None) -> ModelSizes:
    """Count a configuration's sizes without weights: the thinker's modules and the talker are built
    on the ``meta`` device (no memory, ~3 s at real size on a CPU) and their parameters counted.

    Args:
        config: a :class:`~duplexkit.models.minicpmo45.config.MiniCPMOConfig` or a ``config.json`` dict.
        name: the label of the plan's table.
        code2wav: the vocoder's sizes (default: :data:`CODE2WAV_REAL` when the LLM is 4096 wide, else
            :data:`CODE2WAV_TINY`).
    Raises:
        ConfigError: a config the model cannot be built from.
    """
    from duplexkit.models.minicpmo45.config import MiniCPMOConfig
    from duplexkit.models.minicpmo45.loader import _build_on_meta
    from duplexkit.models.minicpmo45.meta import meta_device
    from duplexkit.models.minicpmo45.talker import Talker, TalkerConfig

    cfg = config if isinstance(config, MiniCPMOConfig) else MiniCPMOConfig.from_dict(dict(config))
    mods = _build_on_meta(cfg)
    tc = TalkerConfig.from_tts_config(cfg.tts_config.raw or {})
    with meta_device():
        tk = Talker(tc)
    th_params = sum(p.numel() for p in mods.parameters())
    tk_params = sum(p.numel() for p in tk.parameters())
    th_q, th_rows = _linear_counts(mods.llm.model.layers)
    tk_q, tk_rows = _linear_counts(tk.model.layers)
    a0 = mods.llm.model.layers[0].self_attn
    apm = mods.apm
    a_cfg = cfg.audio_config
    w_heads = int(getattr(a_cfg, "encoder_attention_heads"))
    w_dim = int(getattr(a_cfg, "d_model")) // w_heads
    w_pos = -(-int(getattr(a_cfg, "max_source_positions", 1500)) // WHISPER_ALIGN) * WHISPER_ALIGN
    t0 = tk.model.layers[0].self_attn
    if code2wav is None:
        code2wav = CODE2WAV_REAL if cfg.hidden_size >= 4096 else CODE2WAV_TINY
    return ModelSizes(
        name=name, thinker_params=int(th_params), talker_params=int(tk_params),
        thinker_quant_params=int(th_q), talker_quant_params=int(tk_q),
        thinker_quant_rows=int(th_rows), talker_quant_rows=int(tk_rows),
        llm_layers=len(mods.llm.model.layers), llm_kv_heads=int(cfg.num_key_value_heads), llm_head_dim=int(a0.head_dim),
        whisper_layers=len(apm.layers), whisper_heads=w_heads, whisper_head_dim=w_dim, whisper_positions=w_pos,
        talker_layers=len(tk.model.layers), talker_kv_heads=int(tc.num_key_value_heads),
        talker_head_dim=int(t0.head_dim), talker_positions=int(tc.max_position_embeddings),
        code2wav=code2wav)


_SIZES_CACHE: Dict[str, ModelSizes] = {}


def model_sizes_for(model: str) -> ModelSizes:
    """:func:`model_sizes` of a model argument as the CLI takes it: ``real`` / ``random-real`` (the
    real configuration, ``random_init.real_config_dict``), ``tiny`` (the tiny builder's configuration,
    its vocabulary sized to the tiny tokenizer as the cached tiny checkpoint has it) or a checkpoint
    directory (its ``config.json``; no weights are read). Cached per argument.

    Raises:
        LayoutError: ``scripted`` or another engine plugin (no model to plan for).
        CheckpointError: a directory without a readable ``config.json``.
    """
    key = str(model)
    if key in _SIZES_CACHE:
        return _SIZES_CACHE[key]
    if key in ("real", "random-real"):
        from duplexkit.models.minicpmo45.random_init import real_config_dict

        sizes = model_sizes(real_config_dict(), name="MiniCPM-o 4.5 (real sizes)", code2wav=CODE2WAV_REAL)
    else:
        import json
        from pathlib import Path

        from duplexkit.models.minicpmo45.loader import CheckpointError

        if key == "tiny":  # the cached tiny checkpoint (built once, as the engine builds it)
            from duplexkit.models.minicpmo45 import tiny_checkpoint

            d = Path(tiny_checkpoint(0))
        else:
            d = Path(key).expanduser()
        if not (d / "config.json").is_file():
            if not d.exists() and "/" not in key:
                raise LayoutError(f"--memory plans a MiniCPM-o 4.5 model (a checkpoint directory, 'tiny' or "
                                  f"'random-real'); {key!r} is none of them")
            raise CheckpointError(f"{d}: no config.json to plan the memory from")
        try:
            cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{d / 'config.json'}: {exc}") from exc
        sizes = model_sizes(cfg, name="tiny" if key == "tiny" else d.name)
    _SIZES_CACHE[key] = sizes
    return sizes


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class PlanItem:
    """One row of a plan: ``count`` x ``each`` bytes (``count`` 1 for fixed items), and where the
    figure comes from (``computed`` or the results file of a measurement)."""

    name: str
    each: int
    count: int
    source: str
    per_stream: bool = False

    @property
    def bytes(self) -> int:
        return int(self.each) * int(self.count)


@dataclass(frozen=True)
class MemoryPlan:
    """A memory plan (:func:`plan_memory`). ``str(plan)`` is its table.

    Attributes:
        budget_gib: the device memory budget (GiB, 2**30 bytes).
        streams: stream slots (the stages' ``max_num_seqs``, the KV pools' slots, the server's
            ``max_sessions`` cap).
        thinker_positions / talker_positions: KV positions per stream.
        graph_rows: Code2Wav's Euler-loop graph rows (its shared scratch is sized for this many).
        dtype / quantization: the thinker and talker dtype and weight quantization mode.
        items: the rows of the table.
        model: the sizes' label.
        notes: what the planner changed from what was asked (shrunk positions, fewer graph rows).
    """

    budget_gib: float
    streams: int
    thinker_positions: int
    talker_positions: int
    graph_rows: int
    dtype: str
    quantization: str
    items: Tuple[PlanItem, ...]
    model: str = "model"
    voice_s: float = 6.04
    notes: Tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(it.bytes for it in self.items)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    @property
    def weights_gib(self) -> float:
        return sum(it.bytes for it in self.items if it.name.startswith("weights")) / GiB

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_gib * GiB

    @property
    def allocator_gib(self) -> float:
        """The budget less the CUDA context: what PyTorch's allocator is capped at."""
        return self.budget_gib - CUDA_CONTEXT_GIB

    def window(self) -> Optional[Tuple[int, int]]:
        """``(window_high, window_low)`` for the thinker's sliding window when the planned positions
        are below the default window's needs (None: the default 4000 -> 3500 fits)."""
        from duplexkit.models.minicpmo45.duplex import DuplexPolicy

        d = DuplexPolicy()
        if d.window_high is None or d.window_high + WINDOW_MARGIN <= self.thinker_positions:
            return None
        high = self.thinker_positions - WINDOW_MARGIN
        return high, max(1, high - WINDOW_DROP)

    def table(self) -> str:
        """The plan as a text table: each item's bytes per stream, count, GiB and source, the total
        against the budget and what is left."""
        head = ("item", "each", "x", "GiB", "source")
        rows = []
        for it in self.items:
            each = f"{it.each / GiB:.3f}" if it.per_stream else ""
            cnt = str(it.count) if it.per_stream else ""
            rows.append((it.name, each, cnt, f"{it.bytes / GiB:.2f}", it.source))
        rows.append(("total", "", "", f"{self.total_gib:.2f}", ""))
        rows.append(("budget", "", "", f"{self.budget_gib:.2f}", ""))
        left = self.budget_gib - self.total_gib
        rows.append(("left" if left >= 0 else "over budget", "", "", f"{abs(left):.2f}", ""))
        w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        line = lambda r: "  ".join(c.ljust(w[i]) if i in (0, 4) else c.rjust(w[i]) for i, c in enumerate(r)).rstrip()  # noqa: E731
        out = [f"memory plan: {self.model}, {self.dtype}, quantization {self.quantization}, budget {self.budget_gib:g} GiB",
               f"  {self.streams} stream slot{'s' if self.streams != 1 else ''}, thinker KV {self.thinker_positions} "
               f"positions, talker KV {self.talker_positions} positions, Code2Wav graph rows {self.graph_rows}, "
               f"voice {self.voice_s:g} s",
               line(head), line(tuple("-" * x for x in w))]
        out += [line(r) for r in rows]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def as_dict(self) -> dict:
        """JSON-ready: the plan's fields, total and items in bytes."""
        d = {k: getattr(self, k) for k in ("budget_gib", "streams", "thinker_positions", "talker_positions",
                                            "graph_rows", "dtype", "quantization", "model", "voice_s")}
        d.update(total_bytes=self.total_bytes, fits=self.fits, notes=list(self.notes),
                 items=[dataclasses.asdict(it) | {"bytes": it.bytes} for it in self.items])
        return d


def _check_args(dtype: str, quantization: str, budget_gib: float) -> None:
    if dtype not in DTYPE_BYTES:
        raise LayoutError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if quantization not in QUANTIZATION_MODES:
        raise LayoutError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {quantization!r}")
    if not (isinstance(budget_gib, (int, float)) and math.isfinite(budget_gib) and budget_gib > 0):
        raise LayoutError(f"the memory budget must be a positive number of GiB, got {budget_gib!r}")


def _weights(sizes: ModelSizes, dtype: str, quantization: str) -> List[PlanItem]:
    b = DTYPE_BYTES[dtype]
    out = []
    for stage, params, qp, rows in (("thinker", sizes.thinker_params, sizes.thinker_quant_params, sizes.thinker_quant_rows),
                                    ("talker", sizes.talker_params, sizes.talker_quant_params, sizes.talker_quant_rows)):
        if quantization == "none":
            n, src = params * b, f"computed: {params / 1e6:.1f} M parameters x {b} B"
        else:
            n = (params - qp) * b + qp * 1 + rows * QUANT_SCALE_BYTES
            src = (f"computed: {qp / 1e6:.1f} M linear weights x 1 B + {rows} scales, "
                   f"{(params - qp) / 1e6:.1f} M x {b} B")
        out.append(PlanItem(f"weights {stage}", n, 1, src))
    c = sizes.code2wav
    out.append(PlanItem("weights code2wav", (c.flow_params + c.hift_params) * 4, 1,
                        f"computed: flow {c.flow_params / 1e6:.1f} M + HiFT {c.hift_params / 1e6:.1f} M x 4 B (float32)"))
    return out


def _prompt_frames(voice_s: float) -> int:
    """Mel frames of a reference voice's flow prompt: 2 per prompt token, 25 tokens per second (the
    default voice: 6.04 s -> 151 tokens -> 302 frames)."""
    return 2 * int(round(25 * float(voice_s)))


def _items(sizes: ModelSizes, *, streams: int, thinker_positions: int, graph_rows: int, dtype: str,
           quantization: str, voice_s: float, att_bytes: int,
           activation_each: Optional[int] = None) -> Tuple[PlanItem, ...]:
    b = DTYPE_BYTES[dtype]
    c = sizes.code2wav
    items = _weights(sizes, dtype, quantization)
    prompt = _prompt_frames(voice_s)
    cap = -(-(prompt + 100 + 56) // 64) * 64  # Code2Wav._ensure_capacity: prompt + 100 kept + 56 of a chunk
    flow_b = 4
    # the single-stream flow buffers (Code2Wav._ensure_capacity) and the voice's base cache
    fixed_flow = (c.steps * c.depth * 2 * c.heads * cap * 2 * c.head_dim + c.depth * 2 * c.heads * cap * 2 * c.head_dim
                  + (c.steps + 1) * c.depth * 2 * c.conv_ch * 2) * flow_b
    items.append(PlanItem("code2wav flow buffers", fixed_flow, 1, f"computed: capacity {cap} frames, float32"))
    base = c.steps * c.depth * 2 * c.heads * prompt * 2 * c.head_dim * att_bytes + \
        c.encoder_layers * 2 * c.width * prompt * flow_b
    items.append(PlanItem("code2wav voice base cache", base, 1, f"computed: {prompt} prompt frames"))
    R = graph_rows
    scratch = (c.steps * c.depth * 2 * R * c.heads * cap * 2 * c.head_dim * att_bytes
               + (R + 4 * R) * c.mel_bins * cap * flow_b + 2 * R * c.mel_bins * flow_b
               + 2 * c.steps * c.depth * 2 * R * c.conv_ch * 2 * flow_b)
    items.append(PlanItem(f"code2wav graph scratch ({R} rows)", scratch, 1,
                          f"computed: dit_scratch shapes, {att_bytes} B attention caches"))
    items.append(PlanItem("CUDA graph pools + workspaces", int(FIXED_RESERVE_GIB * GiB), 1,
                          "measured: benchmarks/results/2026-12-02-cudnn-per-thread-h200.md"))
    items.append(PlanItem("CUDA context (outside the allocator)", int(CUDA_CONTEXT_GIB * GiB), 1,
                          "estimate: gpu_engine.py --memory measures it"))
    slots = streams + 1
    items.append(PlanItem("KV thinker (LLM)", 2 * sizes.llm_layers * thinker_positions * sizes.llm_kv_heads * sizes.llm_head_dim * b,
                          slots, f"computed: {thinker_positions} positions, +1 scratch slot", per_stream=True))
    items.append(PlanItem("KV thinker audio (Whisper)",
                          2 * sizes.whisper_layers * sizes.whisper_positions * sizes.whisper_heads * sizes.whisper_head_dim * b,
                          slots, f"computed: {sizes.whisper_positions} positions, +1 scratch slot", per_stream=True))
    items.append(PlanItem("KV talker", 2 * sizes.talker_layers * sizes.talker_positions * sizes.talker_kv_heads * sizes.talker_head_dim * b,
                          slots, f"computed: {sizes.talker_positions} positions, +1 scratch slot", per_stream=True))
    own = prompt + 100
    items.append(PlanItem("code2wav stream caches",
                          c.steps * c.depth * 2 * c.heads * own * 2 * c.head_dim * att_bytes
                          + c.encoder_layers * 2 * c.width * own * flow_b,
                          streams, f"computed: prompt + 100 frames", per_stream=True))
    act = int(activation_per_stream_gib() * GiB) if activation_each is None else int(activation_each)
    items.append(PlanItem("activations per stream", act, streams,
                          "measured: benchmarks/results/2026-12-03-code2wav-caches-acceptance-h200.md", per_stream=True))
    return tuple(items)


_ACT_CACHE: List[float] = []


def activation_per_stream_gib() -> float:
    """The per-stream activation reserve (GiB): the acceptance run's measured peak
    (:data:`ACCEPTANCE_PEAK_GIB`, 64 streams) less everything else its plan holds (the CUDA context
    aside: the peak is the allocator's), over 64. The run's settings: the real model, bf16, no
    quantization, 2048 thinker positions, 16 graph rows, float16 attention caches, the default voice.
    So a plan of that run totals its measured peak plus the CUDA context."""
    if not _ACT_CACHE:
        rest = sum(it.bytes for it in _items(_REAL_ARITHMETIC, streams=ACCEPTANCE_STREAMS, thinker_positions=2048,
                                             graph_rows=16, dtype="bfloat16", quantization="none", voice_s=6.04,
                                             att_bytes=2, activation_each=0)
                   if not it.name.startswith("CUDA context"))
        _ACT_CACHE.append(max(0.0, (ACCEPTANCE_PEAK_GIB * GiB - rest) / ACCEPTANCE_STREAMS / GiB))
    return _ACT_CACHE[0]


_REAL_ARITHMETIC = ModelSizes(
    name="real", thinker_params=9_024_091_376, talker_params=319_383_970,
    thinker_quant_params=0, talker_quant_params=0, thinker_quant_rows=0, talker_quant_rows=0,
    llm_layers=36, llm_kv_heads=8, llm_head_dim=128, whisper_layers=24, whisper_heads=16, whisper_head_dim=64,
    whisper_positions=1504, talker_layers=20, talker_kv_heads=12, talker_head_dim=64, talker_positions=4096)
"""The real model's sizes (parameter counts of :func:`model_sizes` on ``real_config_dict``; the
quantization fields are unused here), for the calibration of :func:`activation_per_stream_gib`
without a meta build. ``tests/unit/test_memory_plan.py`` checks them against :func:`model_sizes`."""


def _pow2_at_least(n: int, cap: int = 16) -> int:
    r = 1
    while r < n and r < cap:
        r *= 2
    return r


def _candidates_positions(wanted: int, shrink: bool) -> List[int]:
    out = [int(wanted)]
    if shrink:
        p = int(wanted)
        while p // 2 >= MIN_THINKER_POSITIONS:
            p //= 2
            out.append(p)
        if out[-1] > MIN_THINKER_POSITIONS and MIN_THINKER_POSITIONS < wanted:
            out.append(MIN_THINKER_POSITIONS)
    return out


def plan_memory(sizes: ModelSizes, budget_gib: float, *, dtype: str = "bfloat16", quantization: str = "none",
                streams: Optional[int] = None, thinker_positions: int = DEFAULT_THINKER_POSITIONS,
                shrink_positions: bool = True, graph_rows: Optional[int] = None, voice_s: float = 6.04,
                att_cache_bytes: int = 2, max_streams: int = MAX_STREAMS) -> MemoryPlan:
    """Choose stream slots, thinker KV positions and Code2Wav graph rows that fit ``budget_gib``.

    Args:
        sizes: the model's sizes (:func:`model_sizes` / :func:`model_sizes_for`).
        budget_gib: device memory for the engine, GiB (2**30 bytes), > 0.
        dtype: thinker / talker dtype (``bfloat16``, ``float16``, ``float32``); KV pools take it too.
        quantization: ``none``, ``int8`` or ``fp8`` (:data:`QUANTIZATION_MODES`).
        streams: the stream count wanted; None: as many as fit (at most ``max_streams``).
        thinker_positions: thinker KV positions per stream wanted (>= 256).
        shrink_positions: halve the positions (down to :data:`MIN_THINKER_POSITIONS`) when the streams
            do not fit at the wanted count (for ``streams`` None: when not even one fits).
        graph_rows: Code2Wav Euler-loop graph rows (1..32, a power of two); None: the smallest power of
            two >= streams, at most 16 (the default), fewer when that does not fit.
        voice_s: the longest reference voice the plan holds caches for, s (default: the bundled
            voice, 6.04 s; the server accepts up to 30 s, ``--max-ref-audio-s``).
        att_cache_bytes: bytes of Code2Wav's attention caches (2: float16, the CUDA default with TF32;
            4: float32).
        max_streams: the most streams given.
    Returns:
        the largest :class:`MemoryPlan` that fits: most streams first, then most positions, then most
        graph rows (never more rows than streams need).
    Raises:
        MemoryBudgetError: the weights alone, one stream, or ``streams`` streams do not fit (the message
            holds the table of the smallest configuration tried and the smallest budget that fits).
        LayoutError: a bad dtype, quantization mode, budget or count.
    """
    _check_args(dtype, quantization, budget_gib)
    if streams is not None and not 1 <= int(streams) <= max_streams:
        raise LayoutError(f"streams must be 1..{max_streams}, got {streams}")
    if int(thinker_positions) < 256:
        raise LayoutError(f"thinker KV positions must be >= 256, got {thinker_positions}")
    if graph_rows is not None and graph_rows not in (1, 2, 4, 8, 16, 32):
        raise LayoutError(f"graph rows must be 1, 2, 4, 8, 16 or 32, got {graph_rows}")
    kw = dict(dtype=dtype, quantization=quantization, voice_s=voice_s, att_bytes=att_cache_bytes)

    def make(n: int, pos: int, rows: int, notes=()) -> MemoryPlan:
        return MemoryPlan(budget_gib=float(budget_gib), streams=n, thinker_positions=pos,
                          talker_positions=sizes.talker_positions, graph_rows=rows, dtype=dtype,
                          quantization=quantization, items=_items(sizes, streams=n, thinker_positions=pos,
                                                                  graph_rows=rows, **kw),
                          model=sizes.name, voice_s=voice_s, notes=tuple(notes))

    def rows_for(n: int) -> List[int]:
        if graph_rows is not None:
            return [graph_rows]
        top = _pow2_at_least(n)
        out = [top]
        while out[-1] > min(top, MIN_GRAPH_ROWS):
            out.append(out[-1] // 2)
        return out

    def best(n: int, positions: Sequence[int]) -> Optional[MemoryPlan]:
        for pos in positions:
            for rows in rows_for(n):
                p = make(n, pos, rows)
                if p.fits:
                    notes = []
                    if pos < thinker_positions:
                        notes.append(f"thinker KV shrunk from {thinker_positions} to {pos} positions per stream "
                                     "to fit")
                    if graph_rows is None and rows < _pow2_at_least(n):
                        notes.append(f"Code2Wav graph rows {rows} (< {_pow2_at_least(n)}): rounds of more streams "
                                     "run the Euler loop in sub-batches")
                    return dataclasses.replace(p, notes=tuple(notes))
        return None

    positions = _candidates_positions(int(thinker_positions), shrink_positions)
    weights = _weights(sizes, dtype, quantization)
    w_bytes = sum(it.bytes for it in weights)
    if streams is not None:
        plan = best(int(streams), positions)
        if plan is None:
            _refuse(make(int(streams), positions[-1], rows_for(int(streams))[-1]), int(streams), positions[-1],
                    w_bytes)
        return plan
    plan = None
    for pos in positions:  # most streams at the wanted positions; shrink only when none fits
        n_fit = 0
        lo, hi = 1, max_streams
        if make(1, pos, 1).fits:
            while lo < hi:  # the total grows with n: bisect the largest n that fits with some row count
                mid = (lo + hi + 1) // 2
                if best(mid, [pos]) is not None:
                    lo = mid
                else:
                    hi = mid - 1
            n_fit = lo
        if n_fit:
            plan = best(n_fit, [pos])
            break
    if plan is None:
        _refuse(make(1, positions[-1], 1), 1, positions[-1], w_bytes)
    return plan


def _refuse(plan: MemoryPlan, n: int, pos: int, w_bytes: int) -> None:
    """Raise :class:`MemoryBudgetError` for ``plan``, the smallest configuration of ``n`` streams the
    planner would take (fewest positions and graph rows): its total, rounded up to 0.1 GiB, is the
    smallest budget that fits them."""
    need = math.ceil(plan.total_bytes / GiB * 10) / 10
    what = (f"the weights alone ({w_bytes / GiB:.2f} GiB) do not fit" if w_bytes > plan.budget_gib * GiB
            else f"{n} streams do not fit" if n > 1 else "not even one stream fits")
    raise MemoryBudgetError(
        f"memory budget {plan.budget_gib:g} GiB: {what} ({plan.model}, {plan.dtype}, quantization "
        f"{plan.quantization}); {n} stream{'s' if n != 1 else ''} at {pos} thinker KV positions need at least "
        f"{need:g} GiB\n{plan.table()}", plan=plan, needed_gib=need, streams=n)


# ------------------------------------------------------------------------------------------ applying


def apply_memory_cap(plan: MemoryPlan, device: Any = None) -> Optional[float]:
    """Cap PyTorch's allocator on a CUDA ``device`` at the plan's budget less the CUDA context
    (``torch.cuda.set_per_process_memory_fraction``), so a smaller card is emulated on a bigger one.
    Returns the fraction set (None on a CPU device or without CUDA).

    Raises:
        MemoryBudgetError: the budget is larger than the device's memory.
    """
    import torch

    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda":
        return None
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(idx).total_memory
    if plan.budget_gib * GiB > total:
        raise MemoryBudgetError(f"memory budget {plan.budget_gib:g} GiB is more than cuda:{idx} has "
                                f"({total / GiB:.1f} GiB)", plan=plan)
    frac = max(0.0, plan.allocator_gib) * GiB / total
    torch.cuda.set_per_process_memory_fraction(frac, idx)
    return frac


def plan_for_model(model: str, budget_gib: float, **kw: Any) -> MemoryPlan:
    """:func:`plan_memory` for a model argument (:func:`model_sizes_for`)."""
    return plan_memory(model_sizes_for(model), budget_gib, **kw)


def sizing_table(sizes: ModelSizes, budgets: Sequence[float] = (24, 48, 80, 141),
                 modes: Sequence[str] = QUANTIZATION_MODES, dtype: str = "bfloat16",
                 thinker_positions: int = DEFAULT_THINKER_POSITIONS) -> str:
    """A Markdown table of the plans for each budget and quantization mode: stream slots, thinker KV
    positions, Code2Wav graph rows, weights and total (GiB); ``-`` where not one stream fits."""
    lines = ["| budget (GiB) | weights | streams | thinker KV positions | graph rows | weights GiB | planned GiB |",
             "|---|---|---|---|---|---|---|"]
    for b in budgets:
        for m in modes:
            label = dtype if m == "none" else m
            try:
                p = plan_memory(sizes, b, dtype=dtype, quantization=m, thinker_positions=thinker_positions)
            except MemoryBudgetError as exc:
                w = sum(it.bytes for it in _weights(sizes, dtype, m)) / GiB
                lines.append(f"| {b:g} | {label} | - (needs {exc.needed_gib:g}) | - | - | {w:.1f} | - |")
                continue
            lines.append(f"| {b:g} | {label} | {p.streams} | {p.thinker_positions} | {p.graph_rows} | "
                         f"{p.weights_gib:.1f} | {p.total_gib:.1f} |")
    return "\n".join(lines)


def layout_for_plan(layout: Any, plan: MemoryPlan) -> Any:
    """``layout`` with every stage's ``max_num_seqs`` set to the plan's stream slots (the batch sizes
    whose CUDA graphs the warm-up captures) and no ``memory_fraction`` (the plan caps the process as a
    whole, :func:`apply_memory_cap`).

    Raises:
        LayoutError: the layout places its stages on more than one device, or uses the vLLM thinker
            backend (a plan covers one device of the native engine).
    """
    devs = {d for st in layout.stages.values() for d in st.devices}
    if len(devs) != 1:
        raise LayoutError(f"--memory plans one device; layout {layout.name!r} uses {', '.join(sorted(devs))}")
    if layout.thinker.backend != "native":
        raise LayoutError(f"--memory plans the native engine; layout {layout.name!r} has a "
                          f"{layout.thinker.backend} thinker")
    stages = {name: dataclasses.replace(st, max_num_seqs=plan.streams, memory_fraction=None)
              for name, st in layout.stages.items()}
    return dataclasses.replace(layout, stages=stages, name=f"{layout.name}+memory-{plan.budget_gib:g}GiB")


def fast_options(plan: MemoryPlan) -> dict:
    """The fast paths' keyword arguments for ``duplexkit.models.minicpmo45.load(fast_options=...)``:
    the thinker's KV positions and slots capped at the plan's streams (thinker LLM and Whisper pools),
    the talker's slots reserved (grown one at a time: a stream's new turn may open before its old one
    is given back) and Code2Wav's graph rows."""
    n = plan.streams
    return {"thinker": {"max_len": plan.thinker_positions, "slots": n, "max_slots": n},
            "talker": {"slots": n, "grow_by": 1},
            "code2wav": {"graph_rows": plan.graph_rows}}


def apply_plan_to_model(model: Any, plan: MemoryPlan) -> None:
    """What the load cannot set: the thinker's sliding window when the planned positions are below the
    default window (:meth:`MemoryPlan.window`), as engine-wide policy defaults."""
    win = plan.window()
    th = getattr(model, "thinker", None)
    if win is not None and th is not None and hasattr(th, "policy_defaults"):
        th.policy_defaults = {**th.policy_defaults, "window_high": win[0], "window_low": win[1]}
