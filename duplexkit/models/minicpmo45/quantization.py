"""Quantized weights for the thinker's and the talker's decoder layers (docs/model.md "Quantized weights").

Modes (:data:`MODES`):

* ``none``: the layers keep the stage dtype (bf16 on the GPU).
* ``int8``: weight-only int8, symmetric, one float32 scale per output channel
  (``scale = max|W[row]| / 127``, ``q = round(W / scale)`` clamped to ±127). The matmul runs
  PyTorch's int8 weight-only kernel ``aten._weight_int8pack_mm`` where the device has one and a
  one-time probe at construction agrees with the reference product (CPU; CUDA in torch ≥ 2.9),
  else it dequantizes ``q · scale`` to the compute dtype and multiplies (every device).
* ``fp8``: ``torch.float8_e4m3fn`` weights with one float32 scale per output channel
  (``scale = max|W[row]| / 448``, 448 = the largest finite e4m3 value) and dynamic per-token
  activation scales (``max|x[token]| / 448``, computed on the device, no host sync). On CUDA with
  compute capability ≥ 8.9 (Ada, Hopper) and a bf16 compute dtype the product is one
  ``torch._scaled_mm`` with row-wise scales; on the CPU (tests, development) the same arithmetic is
  emulated in float32 (activations and weights rounded to e4m3, then dequantized and multiplied), so
  the CPU numbers describe the GPU path's rounding (layers whose sizes are not multiples of 16, or a
  float16 / float32 stage dtype on CUDA, take the same emulated path). CUDA devices below 8.9
  (Ampere, e.g. the RTX 3090 / A100) have no e4m3 matmul, and a torch build without row-wise
  ``_scaled_mm`` scales has none usable: ``fp8`` raises :class:`QuantizationError` there (use
  ``int8``).

When some layers run a slow kernel (emulated fp8, int8 dequantized per matmul) the loader logs one
warning (:func:`slow_kernel_warning`, logger ``duplexkit.quantization``).

What is quantized (:func:`quantize_thinker`, :func:`quantize_talker`): the ``nn.Linear`` layers of
the decoder layers only: the thinker's ``llm.model.layers.N.{self_attn.{q,k,v,o}_proj,
mlp.{gate,up,down}_proj}`` (6.95 B of its 8.19 B parameters, docs/model.md §1.1) and the talker's
``model.layers.N`` projections (189 M). Kept in the stage dtype: embeddings, norms, the audio
encoder, the vision tower and resampler, the projectors, the talker's weight-normed
``head_code``, Code2Wav, and the thinker's ``lm_head`` (1.24 GB in bf16): its logits drive the
duplex listen/speak decision directly (the boundary pass samples the raw softmax, docs/model.md
§5.3), where a per-channel rounding error is not averaged over later layers; 4-bit releases
commonly keep it unquantized as well (openbmb's MiniCPM-o 2.6 int4 GPTQ config: ``lm_head: false``).

Every :class:`QuantLinear` forward is a fixed sequence of device ops (no ``.item()``, no
data-dependent shapes), so the fast paths' CUDA graphs capture it like an ``nn.Linear``.
:func:`~.fast_kv.fuse_projections` fuses quantized q/k/v and gate/up layers by concatenating their
int8/fp8 rows and per-row scales (exact: scales are per output row).

Published 4-bit checkpoints: :func:`awq_dequantize` / :func:`awq_pack` implement the AutoAWQ "GEMM"
layout (``<linear>.qweight`` int32 [in, out/8], ``.qzeros`` int32 [in/group, out/8], ``.scales``
[in/group, out]; eight 4-bit values per int32, nibble i holding column ``8c + AWQ_ORDER[i]``);
the loader dequantizes such layers at load (:func:`awq_linear_prefixes`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from duplexkit.errors import DuplexkitError

__all__ = ["MODES", "QuantizationError", "QuantLinear", "QuantReport", "parse_mode", "fp8_supported",
           "quantize_linears", "quantize_thinker", "quantize_talker", "weight_bytes", "AWQ_ORDER",
           "awq_pack", "awq_dequantize", "awq_linear_prefixes", "awq_config", "SLOW_KERNELS",
           "slow_kernel_warning"]

MODES = ("none", "int8", "fp8")
"""Quantization modes (module doc)."""

INT8_MAX = 127.0
FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value (OCP FP8 spec: S.1111.110 = 448)."""

_SCALE_FLOOR = 1e-12
"""Smallest scale (an all-zero row or token would otherwise divide by zero)."""

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ GEMM packing: nibble i (bits 4i..4i+3) of packed column c holds column ``8c + AWQ_ORDER[i]``."""


class QuantizationError(DuplexkitError, ValueError):
    """A quantization mode that is unknown or unavailable on the device, or a quantized checkpoint
    layout that cannot be read (:class:`~duplexkit.errors.DuplexkitError`'s default code,
    ``server_error``, when it reaches the wire)."""


def parse_mode(mode: Optional[str]) -> str:
    """``None`` / ``""`` -> ``"none"``; a mode of :data:`MODES` (case-insensitive) -> itself.

    Raises:
        QuantizationError: any other value.
    """
    if mode is None or mode == "":
        return "none"
    m = str(mode).strip().lower()
    if m not in MODES:
        raise QuantizationError(f"unknown quantization {mode!r} (use one of {', '.join(MODES)})")
    return m


def fp8_supported(device) -> bool:
    """Whether ``device`` runs the fp8 path natively: CUDA with compute capability ≥ 8.9 (e4m3
    tensor-core matmuls: Ada, Hopper and later)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
        return False
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx) >= (8, 9)


def check_mode(mode: str, device) -> str:
    """:func:`parse_mode`, then the device check of the module doc.

    Raises:
        QuantizationError: unknown mode; ``fp8`` on a CUDA device below compute capability 8.9.
    """
    m = parse_mode(mode)
    dev = torch.device(device)
    if m == "fp8" and dev.type == "cuda" and not fp8_supported(dev):
        cap = torch.cuda.get_device_capability(dev.index if dev.index is not None else torch.cuda.current_device())
        raise QuantizationError(f"fp8 weights need a CUDA device of compute capability >= 8.9 (this one is "
                                f"{cap[0]}.{cap[1]}); use --quantization int8")
    if m == "fp8" and dev.type not in ("cuda", "cpu"):
        raise QuantizationError(f"fp8 weights run on CUDA (>= 8.9) or, emulated, on the CPU; not on {dev.type}")
    return m


# ------------------------------------------------------------------------------------------------
# weights


def quantize_weight(w: torch.Tensor, mode: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric quantization of ``w`` [N, K] (module doc).

    Returns:
        (q [N, K] int8 or float8_e4m3fn, scale [N] float32) with ``w ≈ q · scale[:, None]``.
    Raises:
        QuantizationError: ``mode`` not ``int8`` / ``fp8``; ``w`` not 2-D.
    """
    if w.ndim != 2:
        raise QuantizationError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    if mode == "int8":
        scale = (amax / INT8_MAX).clamp_min(_SCALE_FLOOR)
        q = torch.round(wf / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif mode == "fp8":
        scale = (amax / FP8_MAX).clamp_min(_SCALE_FLOOR)
        q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        raise QuantizationError(f"no weight format for quantization {mode!r}")
    return q.contiguous(), scale.contiguous()


def _fp8_act(x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token e4m3 quantization of activations [M, K] -> (xq [M, K] fp8, scale [M, 1] f32)."""
    xf = x2.float()
    s = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_SCALE_FLOOR)
    return (xf / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


@functools.lru_cache(maxsize=None)
def _int8_kernel_ok(device: str, dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    """One probe per (device, dtype, layer shape): does ``aten._weight_int8pack_mm`` run here and
    agree with the dequantized product? (Run at construction, never inside a CUDA-graph capture.)"""
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, in_features, generator=g).to(device=device, dtype=dtype)
        q = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8).to(device)
        s = (torch.rand(out_features, generator=g) * 0.01 + 1e-3).to(device=device, dtype=dtype)
        got = op(x, q, s).float()
        ref = x.float() @ (q.float() * s.float()[:, None]).T
        return bool(torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max())))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.lru_cache(maxsize=None)
def _fp8_rowwise_ok(device: str) -> bool:
    """One probe per CUDA device: does ``torch._scaled_mm`` take row-wise scales (an [M, 1] and a
    [1, N] float32 scale, bf16 out) here and agree with the dequantized product?"""
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 64, generator=g).to(device=device, dtype=torch.bfloat16)
        w = torch.randn(32, 64, generator=g).to(device)
        q, s = quantize_weight(w, "fp8")
        xq, sx = _fp8_act(x)
        got = torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=s[None, :], out_dtype=torch.bfloat16).float()
        ref = (xq.float() * sx) @ (q.float() * s[:, None]).T
        return bool(torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max())))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class QuantLinear(nn.Module):
    """A bias-optional linear layer with int8 or fp8 weights and per-output-channel scales.

    Buffers: ``qweight`` [out, in] (int8 or float8_e4m3fn), ``weight_scale`` [out] float32;
    ``bias`` [out] in the compute dtype or None. ``forward(x [..., in]) -> [..., out]`` in ``x``'s dtype.

    Args:
        qweight / weight_scale / bias: as above (see :func:`quantize_weight`).
        mode: ``int8`` or ``fp8``.
        compute_dtype: the dtype of the activations it will see (the stage dtype); picks the kernel.

    Raises:
        QuantizationError: a mode / dtype mismatch, or ``fp8`` on a CUDA device below 8.9.
    """

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor], mode: str,
                 compute_dtype: torch.dtype) -> None:
        super().__init__()
        want = torch.int8 if mode == "int8" else getattr(torch, "float8_e4m3fn", None)
        if mode not in ("int8", "fp8") or qweight.dtype != want:
            raise QuantizationError(f"QuantLinear({mode!r}) got weights of dtype {qweight.dtype}")
        check_mode(mode, qweight.device)
        self.mode = mode
        self.out_features, self.in_features = int(qweight.shape[0]), int(qweight.shape[1])
        self.compute_dtype = compute_dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)
        self._pick_kernel()

    def _pick_kernel(self) -> None:
        dev = self.qweight.device
        if self.mode == "int8":
            ok = _int8_kernel_ok(str(dev), self.compute_dtype, self.in_features, self.out_features)
            self.kernel = "int8pack" if ok else "dequant"
        elif dev.type == "cuda" and self.compute_dtype == torch.bfloat16 and self.in_features % 16 == 0 \
                and self.out_features % 16 == 0:
            if not _fp8_rowwise_ok(str(dev)):
                raise QuantizationError(f"this torch build ({torch.__version__}) has no row-wise fp8 matmul "
                                        f"(torch._scaled_mm) on {dev}; use int8")
            self.kernel = "scaled_mm"
        else:
            self.kernel = "emulated"
        self._scale_c = self.weight_scale.to(self.compute_dtype) if self.kernel == "int8pack" else None

    def _apply(self, fn, recurse=True):
        """``.to(device)`` / ``.cuda()``: the kernel is picked again for the new device. A dtype cast
        (``.to(torch.bfloat16)``, ``.half()``) would turn the 8-bit weights into plain floats and
        raises :class:`QuantizationError` instead."""
        want = (self.qweight.dtype, self.weight_scale.dtype)
        out = super()._apply(fn, recurse)
        if (self.qweight.dtype, self.weight_scale.dtype) != want:
            raise QuantizationError(f"a quantized layer's dtype cannot be cast (its {self.mode} weights became "
                                    f"{self.qweight.dtype}); quantize after choosing the stage dtype")
        self._pick_kernel()
        return out

    @classmethod
    def from_linear(cls, lin: nn.Linear, mode: str) -> "QuantLinear":
        """Quantize an ``nn.Linear`` (its weight dtype becomes the compute dtype)."""
        q, s = quantize_weight(lin.weight, mode)
        return cls(q, s, lin.bias, mode, lin.weight.dtype)

    @classmethod
    def concat(cls, parts: Sequence["QuantLinear"]) -> "QuantLinear":
        """One layer computing ``parts`` side by side (rows concatenated); each part's buffers are
        rebound as views into the result's (no extra memory). Used by :func:`.fast_kv.fuse_projections`.

        Raises:
            QuantizationError: parts of different modes / inputs / dtypes, or with biases.
        """
        p0 = parts[0]
        if any(p.mode != p0.mode or p.in_features != p0.in_features or p.compute_dtype != p0.compute_dtype
               or p.bias is not None for p in parts):
            raise QuantizationError("cannot fuse quantized layers of different modes, inputs or dtypes, or with biases")
        fused = cls(torch.cat([p.qweight for p in parts]), torch.cat([p.weight_scale for p in parts]), None,
                    p0.mode, p0.compute_dtype)
        o = 0
        for p in parts:
            n = p.out_features
            p.qweight = fused.qweight[o:o + n]
            p.weight_scale = fused.weight_scale[o:o + n]
            p._pick_kernel()
            o += n
        return fused

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the layer multiplies by, [out, in] in the compute dtype."""
        return (self.qweight.float() * self.weight_scale[:, None]).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kernel == "int8pack":
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self._scale_c)
        elif self.kernel == "dequant":
            y = (x2 @ self.qweight.to(x2.dtype).T) * self.weight_scale.to(x2.dtype)
        elif self.kernel == "scaled_mm":
            xq, sx = _fp8_act(x2)
            y = torch._scaled_mm(xq, self.qweight.t(), scale_a=sx, scale_b=self.weight_scale[None, :],
                                 out_dtype=torch.bfloat16)
        else:  # emulated fp8: the scaled_mm arithmetic in float32
            xq, sx = _fp8_act(x2)
            y = ((xq.float() @ self.qweight.float().T) * sx * self.weight_scale[None, :]).to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, kernel={self.kernel}"


# ------------------------------------------------------------------------------------------------
# applying it


@dataclass
class QuantReport:
    """What :func:`quantize_linears` did: ``layers`` replaced, weight bytes of the module tree
    before and after (parameters + buffers, shared storage counted once), and how many layers run
    each matmul kernel (``QuantLinear.kernel``: ``int8pack`` / ``dequant`` / ``scaled_mm`` /
    ``emulated``)."""

    mode: str
    layers: int
    bytes_before: int
    bytes_after: int
    kernels: Dict[str, int] = field(default_factory=dict)

    def line(self, stage: str) -> str:
        """One line for the load log, e.g. ``talker: int8 on 7 linear layers (int8pack 7), weights
        1.78 MiB -> 1.75 MiB (28.9 KiB saved, 1.6%)``: the saved bytes and share of the stage's
        weights are given, since a small model's sizes can round to the same figure."""
        ks = ", ".join(f"{k} {n}" for k, n in sorted(self.kernels.items()))
        saved = self.bytes_before - self.bytes_after
        pct = 100.0 * saved / self.bytes_before if self.bytes_before else 0.0
        return (f"{stage}: {self.mode} on {self.layers} linear layers ({ks or 'none'}), weights "
                f"{_size(self.bytes_before)} -> {_size(self.bytes_after)} ({_size(saved)} saved, {pct:.1f}%)")


#: :class:`QuantLinear` kernels that are slower than the unquantized layer (``emulated`` fp8 in
#: float32; ``dequant`` int8: the weights are dequantized before every matmul).
SLOW_KERNELS = ("emulated", "dequant")


def slow_kernel_warning(reports: Dict[str, "QuantReport"]) -> Optional[str]:
    """The one load warning when some quantized layers run a slow kernel (:data:`SLOW_KERNELS`),
    naming the stages and layer counts; None when every layer runs ``scaled_mm`` / ``int8pack``.
    ``reports``: stage name -> :class:`QuantReport` (``MiniCPMO45.quantization``)."""
    why = {"emulated": "fp8 runs emulated in float32 on {where} (FP8 matmuls need CUDA compute capability "
                       ">= 8.9, a bfloat16 stage and layer sizes that are multiples of 16): for testing, "
                       "slower than unquantized",
           "dequant": "int8 is dequantized before every matmul on {where} (no int8 kernel here): it saves "
                      "memory, not time"}
    parts = []
    for k in SLOW_KERNELS:
        where = [f"{stage} {rep.kernels[k]}/{rep.layers} layers" for stage, rep in reports.items() if rep.kernels.get(k)]
        if where:
            parts.append(why[k].format(where=", ".join(where)))
    return "quantized weights: " + "; ".join(parts) if parts else None


def _size(n: int) -> str:
    if n >= 1024 ** 3:
        return f"{n / 1024 ** 3:.2f} GiB"
    if n >= 1024 ** 2:
        return f"{n / 1024 ** 2:.2f} MiB"
    return f"{n / 1024:.1f} KiB"


def weight_bytes(module: nn.Module) -> int:
    """Bytes held by ``module``'s parameters and buffers (each storage counted once)."""
    seen = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        st = t.untyped_storage()
        key = (t.device, st.data_ptr())
        if key in seen or t.device.type == "meta":
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def quantize_linears(root: nn.Module, mode: str, select: Callable[[str, nn.Linear], bool]) -> QuantReport:
    """Replace every ``nn.Linear`` under ``root`` whose qualified name passes ``select`` by a
    :class:`QuantLinear` (one layer at a time, so the peak is the unquantized size plus one layer).

    Raises:
        QuantizationError: unknown / unavailable mode; a decoder already fused by the fast path
            (quantize before building ``FastThinker`` / ``FastTalker``).
    """
    before = weight_bytes(root)
    if parse_mode(mode) == "none":
        return QuantReport("none", 0, before, before)
    targets: List[Tuple[str, nn.Linear]] = [(n, m) for n, m in root.named_modules()
                                            if type(m) is nn.Linear and select(n, m)]
    if not targets:
        return QuantReport(mode, 0, before, before)
    check_mode(mode, targets[0][1].weight.device)
    for n, m in root.named_modules():
        if hasattr(m, "_dk_qkv") or hasattr(m, "_dk_gu"):
            raise QuantizationError(f"{n or 'module'} is already fused by the fast path; quantize before "
                                    "building FastThinker / FastTalker")
    kernels: Dict[str, int] = {}
    for name, lin in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        with torch.no_grad():
            ql = QuantLinear.from_linear(lin, mode)
        setattr(parent, attr, ql)
        kernels[ql.kernel] = kernels.get(ql.kernel, 0) + 1
        del lin
    return QuantReport(mode, len(targets), before, weight_bytes(root), kernels)


_DECODER_LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _decoder_linear(prefix: str) -> Callable[[str, nn.Linear], bool]:
    def sel(name: str, _m) -> bool:
        if not name.startswith(prefix):
            return False
        parts = name[len(prefix):].split(".", 1)
        return len(parts) == 2 and parts[0].isdigit() and parts[1] in _DECODER_LINEAR
    return sel


def quantize_thinker(modules: nn.Module, mode: str) -> QuantReport:
    """Quantize the thinker's decoder linears (``llm.model.layers.N.*``; module doc) in place.
    ``modules`` is a :class:`~.thinker.ThinkerModules`; the report covers its whole tree."""
    return quantize_linears(modules, mode, _decoder_linear("llm.model.layers."))


def quantize_talker(talker: nn.Module, mode: str) -> QuantReport:
    """Quantize the talker's decoder linears (``model.layers.N.*``; module doc) in place."""
    tk = getattr(talker, "talker", talker)  # a FastTalker wraps the Talker
    rep = quantize_linears(tk, mode, _decoder_linear("model.layers."))
    tk._folded_head = None
    return rep


# ------------------------------------------------------------------------------------------------
# AutoAWQ GEMM checkpoints


def awq_config(config: dict) -> Optional[dict]:
    """The ``quantization_config`` of a ``config.json`` dict when it describes AWQ, else None.

    Returns:
        ``{"bits": 4, "group_size": g, "zero_point": bool}``.
    Raises:
        QuantizationError: an AWQ config this loader cannot read (bits other than 4, a version other
            than ``gemm``), or a quantization method other than AWQ.
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method != "awq":
        raise QuantizationError(f"checkpoint quantization {method or qc!r} is not supported (AutoAWQ 'gemm' is)")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if bits != 4 or version != "gemm" or group <= 0:
        raise QuantizationError(f"AWQ checkpoint with bits={bits}, version={version!r}, group_size={group}: "
                                "only 4-bit 'gemm' with a positive group size is supported")
    return {"bits": 4, "group_size": group, "zero_point": bool(qc.get("zero_point", True))}


def _pack_cols(v: torch.Tensor) -> torch.Tensor:
    """[R, C] ints in 0..15 -> [R, C/8] int32, AutoAWQ order."""
    r, c = v.shape
    v = v.to(torch.int64).view(r, c // 8, 8)
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        out |= v[:, :, col] << (4 * i)
    return (out - ((out >> 31) & 1) * (1 << 32)).to(torch.int32)  # two's complement into int32


def _unpack_cols(p: torch.Tensor) -> torch.Tensor:
    """[R, C/8] int32 -> [R, C] ints 0..15 (inverse of :func:`_pack_cols`)."""
    r, c8 = p.shape
    shifts = torch.arange(0, 32, 4, device=p.device, dtype=torch.int32)
    nib = torch.bitwise_and(torch.bitwise_right_shift(p[:, :, None], shifts), 15)  # [R, C/8, 8] by nibble
    out = torch.empty_like(nib)
    out[:, :, list(AWQ_ORDER)] = nib
    return out.reshape(r, c8 * 8)


def awq_pack(weight: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a linear weight [out, in] to AutoAWQ GEMM tensors (asymmetric 4-bit per group of
    ``group_size`` input channels, zero point in 0..15) without the activation-aware scaling search.

    Returns:
        (qweight int32 [in, out/8], qzeros int32 [in/group, out/8], scales float16 [in/group, out]).
    Raises:
        QuantizationError: ``out`` not a multiple of 8 or ``in`` not a multiple of ``group_size``.
    """
    out_f, in_f = weight.shape
    if out_f % 8 or in_f % group_size:
        raise QuantizationError(f"AWQ packing needs out % 8 == 0 and in % group_size == 0, got {tuple(weight.shape)}")
    w = weight.detach().float().T.reshape(in_f // group_size, group_size, out_f)  # [G, g, out]
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    scales = ((hi - lo).clamp_min(1e-5) / 15.0).half()
    s = scales.float()
    zeros = torch.round(-lo / s).clamp(0, 15)
    q = torch.round(w / s[:, None] + zeros[:, None]).clamp(0, 15).reshape(in_f, out_f)
    return _pack_cols(q), _pack_cols(zeros), scales


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """AutoAWQ GEMM tensors -> the linear weight [out, in] in ``dtype``: ``W[i, o] = (q[i, o] −
    z[i // g, o]) · s[i // g, o]``, transposed.

    Raises:
        QuantizationError: shapes that do not fit one another.
    """
    in_f, o8 = qweight.shape
    if qzeros.shape != (in_f // group_size, o8) or scales.shape != (in_f // group_size, o8 * 8) or in_f % group_size:
        raise QuantizationError(f"AWQ tensors do not fit: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                                f"scales {tuple(scales.shape)}, group_size {group_size}")
    q = _unpack_cols(qweight.to(torch.int32)).float()
    z = _unpack_cols(qzeros.to(torch.int32)).float().repeat_interleave(group_size, dim=0)
    s = scales.float().repeat_interleave(group_size, dim=0)
    return ((q - z) * s).T.contiguous().to(dtype)


AWQ_SUFFIXES = (".qweight", ".qzeros", ".scales")


def awq_linear_prefixes(keys: Iterable[str]) -> List[str]:
    """Module prefixes holding an AWQ linear (``<prefix>.qweight`` present), sorted."""
    ks = set(keys)
    return sorted(k[: -len(".qweight")] for k in ks if k.endswith(".qweight"))


def awq_expected_shapes(prefix: str, weight_shape: Tuple[int, int], group_size: int) -> Dict[str, tuple]:
    """The AWQ tensors a linear of ``weight_shape`` [out, in] must have."""
    out_f, in_f = weight_shape
    return {prefix + ".qweight": (in_f, out_f // 8), prefix + ".qzeros": (in_f // group_size, out_f // 8),
            prefix + ".scales": (in_f // group_size, out_f)}
