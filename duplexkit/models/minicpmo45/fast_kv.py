"""Static KV caches, a batched decoder-layer forward over them, and CUDA-graph helpers.

Shared by the fast thinker (:mod:`.fast_thinker`) and the fast talker (:mod:`.fast_talker`):

* :class:`KVPool` — one preallocated K and V tensor per model, ``[layers, slots + 1, max_len,
  kv_heads, head_dim]``; each stream (thinker) or talker turn owns one slot, the extra last slot is
  scratch for the padding rows of a CUDA-graph batch bucket. Slots are handed out and returned
  under a lock; the pool grows (reallocating, which invalidates captured graphs: see ``version``).
* :func:`decoder_forward` — Qwen3 / Llama decoder layers (the ``transformers`` modules' own
  weights and norms) over ``[B, T]`` rows at arbitrary per-row positions: each row writes its K/V
  at ``pos`` in its slot and attends keys ``j <= pos`` of its slot, over the first ``kv_len``
  cached positions (a bucket ≥ every row's last position + 1). Attention is written out
  as Hkv-head SDPA with g·T query rows and an additive position mask (no host sync, capturable in
  a CUDA graph; on CUDA the RMSNorms go through ``F.rms_norm``).
* on CUDA (default; ``DUPLEXKIT_TRITON_DECODE=0`` at import turns it off) the one-token step's
  attention reads the pool in place (no gather) and the norms / rotary / KV write run fused, as
  Triton kernels (:mod:`.triton_decode`); the CPU path never uses them.
* positions beyond a row's valid length may hold garbage (padding writes): they are never
  attended, because a row only attends ``j <= pos`` and every later write overwrites them.

Numbers (docs/model.md §10): thinker KV = 36 layers x 8 heads x 128 x 2 x 2 B = 144 KiB per position
in bf16, so 8192 positions x 16 slots = 19.3 GB; talker KV = 20 x 12 x 64 x 2 x 2 B = 60 KiB per
position (4096 positions = 252 MB per slot).
"""

from __future__ import annotations

import functools
import os
import threading
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from duplexkit.errors import DuplexkitError, ErrorCode

__all__ = ["CAPTURE_GATE", "capture_graph", "keep_for_current_stream", "KVPool", "KVSlot", "ContextFullError", "KVCapacityError",
           "reserve_for_warmup", "GraphCache", "kv_bucket",
           "decoder_forward",
           "fuse_projections", "bucket", "pin_sdpa_backend", "cuda_graphs_enabled", "triton_decode_enabled"]

_TRITON_DECODE = os.environ.get("DUPLEXKIT_TRITON_DECODE", "1") != "0"
"""The Triton decode kernels on CUDA: on unless ``DUPLEXKIT_TRITON_DECODE=0`` when this module is
imported (a benchmark compares the two paths in separate processes)."""

_TRITON_ON_CPU = False
"""Tests only: also run the kernels on CPU tensors, under Triton's interpreter (``TRITON_INTERPRET=1``
set before triton is imported). Never on by itself: the CPU path stays the reference-checked one."""


from .capture_gate import CAPTURE_GATE  # noqa: E402 - re-exported: captures hold it exclusive, stage work shared


def capture_graph(fn, device, *, pool=None, warmup: int = 1):
    """Warm ``fn`` up ``warmup`` times on a side stream, then capture it into a new CUDA graph holding
    :data:`CAPTURE_GATE` exclusive (no other stage thread launches while the capture is open).

    Args:
        fn: zero-argument callable launching the work; its return value (the graph's static output
            tensors) is returned with the graph.
        device: the CUDA device.
        pool: a graph memory pool to share (``torch.cuda.graph_pool_handle()``), or None (private).
        warmup: eager runs before the capture (lazy initialisation, autotuning).

    Returns:
        ``(graph, out)``: the ``torch.cuda.CUDAGraph`` and what ``fn`` returned during the capture.

    ``device`` is made current for the warm-up and the capture (a stage thread starts on device 0,
    and ``torch.cuda.graph`` syncs the current device and begins the capture on a stream of it), and
    the capture runs on :func:`_capture_stream` of ``device``.
    """
    with torch.cuda.device(device):
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_GATE.exclusive(), torch.cuda.graph(graph, pool=pool, stream=_capture_stream(),
                                                        capture_error_mode="thread_local"):
            out = fn()
    return graph, out


_CAPTURE_STREAMS = {}


def _capture_stream() -> "torch.cuda.Stream":
    """The capture stream of the current CUDA device, one per device for every capture of the
    process (call it holding :data:`CAPTURE_GATE` exclusive). torch's own default is one stream for
    the whole process, made on whichever device was current at the first capture, so a model on
    another device (the ``2gpu`` layout's talker and Code2Wav on cuda:1) was captured from a stream
    of the wrong device. One stream per device, not one per capture: a graph pool shared by several
    captures reuses the blocks an earlier capture freed only on the same stream."""
    idx = torch.cuda.current_device()
    if idx not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[idx] = torch.cuda.Stream(idx)
    return _CAPTURE_STREAMS[idx]


def keep_for_current_stream(*tensors) -> None:
    """Before dropping tensors: ``record_stream`` each CUDA tensor of ``tensors`` on its device's
    current stream, so the caching allocator does not reuse its memory until the work queued there
    by then has run. Needed when a tensor allocated on one stream was last used on another (the
    opt-in thinker stream, :mod:`duplexkit.engine.thinker_stream`: the KV pool is made on the default
    stream at load and grown on the thinker's). A no-op in the allocator when the current stream is
    the tensor's own, and for None and CPU tensors."""
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


class KVCapacityError(DuplexkitError, RuntimeError):
    """Every slot of a capped :class:`KVPool` (``max_slots``: a memory plan's stream slots) is taken:
    one more stream would need memory the plan does not have (code ``session_capacity_exhausted``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=ErrorCode.SESSION_CAPACITY_EXHAUSTED.value)


class ContextFullError(DuplexkitError, ValueError):
    """A stream's static KV slot has no room for the positions a step needs."""


def kv_bucket(need: int, step: int, max_len: int) -> int:
    """The KV length a call attends: ``need`` positions rounded up to a multiple of ``step`` (the
    graphs' KV-length buckets), at most ``max_len``."""
    return min(-(-int(need) // step) * step, max_len)


def bucket(n: int, sizes: Sequence[int]) -> int:
    """Smallest entry of ``sizes`` that is >= n (the last one if none)."""
    for s in sizes:
        if s >= n:
            return s
    return sizes[-1]


def pin_sdpa_backend() -> None:
    """Disable PyTorch's cuDNN SDPA backend (docs/model.md §10: on torch 2.11 + cuDNN 9.19 it spends
    ~2 ms of CPU per call on every new KV length); flash / memory-efficient / math stay enabled.
    Process-wide; a no-op without CUDA."""
    if torch.cuda.is_available() and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


_SWITCH_ON = ("1", "true", "on", "yes")
_SWITCH_OFF = ("0", "false", "off", "no")


def env_switch(name: str, default: bool, value: Optional[str] = None) -> bool:
    """An on/off setting strictly parsed (``DUPLEXKIT_THINKER_STREAM``, ``DUPLEXKIT_THINKER_LOOKAHEAD``).

    Args:
        name: the environment variable (read when ``value`` is None; named in the error).
        default: the result when the setting is unset or empty.
        value: the setting to parse instead of the environment.

    Returns:
        True for ``1`` / ``true`` / ``on`` / ``yes``, False for ``0`` / ``false`` / ``off`` / ``no``
        (case-insensitive, surrounding blanks ignored), ``default`` when unset or empty.

    Raises:
        ValueError: any other value (a typo should not silently measure the wrong configuration).
    """
    v = (os.environ.get(name, "") if value is None else value).strip().lower()
    if v == "":
        return bool(default)
    if v in _SWITCH_ON:
        return True
    if v in _SWITCH_OFF:
        return False
    raise ValueError(f"{name} must be 1/0 (or true/false, on/off, yes/no), got {v!r}")


def cuda_graphs_enabled(device: torch.device) -> bool:
    """CUDA graphs are used on CUDA devices unless ``DUPLEXKIT_CUDA_GRAPHS=0``."""
    import os

    return device.type == "cuda" and os.environ.get("DUPLEXKIT_CUDA_GRAPHS", "1") != "0"


class KVPool:
    """Preallocated per-slot KV storage (see module doc).

    Also the fast thinker's Whisper streaming cache (:mod:`.fast_whisper`: ``n_kv_heads`` = the
    encoder's attention heads, ``max_len`` = its 1500 source positions rounded up).

    Args:
        n_layers / n_kv_heads / head_dim: model geometry.
        max_len: positions per slot.
        slots: initial slot count (0: only the scratch slot until the first :meth:`alloc`; grows by
            ``grow_by`` when exhausted).
        max_slots: the most slots the pool may hold (a memory plan's stream slots,
            :mod:`duplexkit.engine.memory_plan`); :meth:`alloc` beyond it raises
            :class:`KVCapacityError` instead of growing. None: no cap.

    The slot lock is re-entrant: a slot handle's ``__del__`` (:class:`KVSlot`) may run from a
    garbage collection triggered inside :meth:`alloc` on the same thread.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, *, dtype: torch.dtype,
                 device, slots: int = 4, grow_by: int = 8, max_slots: Optional[int] = None) -> None:
        self.n_layers, self.n_kv, self.head_dim, self.max_len = n_layers, n_kv_heads, head_dim, int(max_len)
        self.max_slots = None if max_slots is None else max(1, int(max_slots))
        if self.max_slots is not None:
            slots = min(int(slots), self.max_slots)
        self.dtype, self.device = dtype, torch.device(device)
        self.grow_by = max(1, int(grow_by))
        self._lock = threading.RLock()
        self.version = 0
        self.n_slots = 0
        self.k = self.v = None
        self.free: List[int] = []
        self._resize(max(0, int(slots)))

    @property
    def scratch(self) -> int:
        """Index of the scratch slot (padding rows of graph batches)."""
        return self.n_slots

    def _resize(self, n: int) -> None:
        shape = (self.n_layers, n + 1, self.max_len, self.n_kv, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.k is not None:
            k[:, : self.n_slots].copy_(self.k[:, : self.n_slots])
            v[:, : self.n_slots].copy_(self.v[:, : self.n_slots])
            keep_for_current_stream(self.k, self.v)  # the copies above may run on another stream than the old pool's
        old = self.n_slots
        self.k, self.v, self.n_slots = k, v, n
        self.free.extend(range(old, n))
        self.version += 1

    def reserve(self, n: int) -> bool:
        """Grow the pool to at least ``n`` slots now, in one reallocation (engine start-up, before
        the graphs are captured: a pool that grows while streams are live drops every captured
        graph of the model, and the next rounds capture them again, seconds of stalled audio).
        Returns False, leaving the pool as it was, when the device has no memory for it (it then
        grows on demand as before)."""
        with self._lock:
            if self.max_slots is not None:
                n = min(int(n), self.max_slots)
            if n <= self.n_slots:
                return True
            try:
                self._resize(int(n))
            except torch.OutOfMemoryError:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                return False
        return True

    def alloc(self) -> int:
        """A free slot index (grows the pool when none is free)."""
        with self._lock:
            if not self.free:
                if self.max_slots is not None and self.n_slots >= self.max_slots:
                    raise KVCapacityError(f"all {self.max_slots} KV slots of the memory plan are taken "
                                          f"({self.slot_bytes() / 2**30:.3f} GiB each); close a stream first")
                n = self.n_slots + self.grow_by
                self._resize(n if self.max_slots is None else min(n, self.max_slots))
            return self.free.pop(0)

    def release(self, slot: Optional[int]) -> None:
        if slot is None:
            return
        with self._lock:
            if 0 <= slot < self.n_slots and slot not in self.free:
                self.free.append(slot)
                self.free.sort()

    def nbytes(self) -> int:
        """Bytes of the K and V storage (every slot and the scratch slot)."""
        return 2 * self.k.numel() * self.k.element_size()

    def slot_bytes(self) -> int:
        """Bytes of K and V one slot holds (``2 * layers * max_len * heads * head_dim * itemsize``)."""
        return 2 * self.n_layers * self.max_len * self.n_kv * self.head_dim * self.k.element_size()


class GraphCache(dict):
    """Captured graphs by key over one KV pool (the fast thinker's step graphs, its Whisper passes,
    the talker's units). :meth:`get_or_build` drops every entry once the pool was reallocated (a
    growth: the graphs read the old tensors), first keeping each dropped graph's static inputs
    (``static_inputs(graph)``) alive for the replays already queued on this thread's stream."""

    def __init__(self, pool: "KVPool", stats: dict, counter: str, static_inputs) -> None:
        super().__init__()
        self.pool, self.stats, self.counter = pool, stats, counter
        self._static_inputs = static_inputs
        self._version = pool.version

    def get_or_build(self, key, build):
        """The graph of ``key``; ``build()`` captures it when missing (counted in ``stats[counter]``)."""
        if self._version != self.pool.version:
            for old in self.values():
                keep_for_current_stream(*self._static_inputs(old))
            self.clear()
            self._version = self.pool.version
        g = self.get(key)
        if g is None:
            g = self[key] = build()
            self.stats[self.counter] = self.stats.get(self.counter, 0) + 1
        return g


def reserve_for_warmup(pool: "KVPool", batch_sizes, what: str) -> None:
    """:meth:`KVPool.reserve` for the largest of ``batch_sizes`` (a stage's ``max_num_seqs``
    streams), logging a warning on ``duplexkit.engine`` when the device has no memory for it."""
    sizes = [int(b) for b in batch_sizes]
    if sizes and not pool.reserve(max(sizes)):
        import logging

        logging.getLogger("duplexkit.engine").warning(
            "%s: no GPU memory to reserve %d KV slots at start-up (%.2f GB each); the pool grows on demand, "
            "and each growth recaptures the CUDA graphs while streams are live", what, max(sizes),
            pool.slot_bytes() / 1e9)


class KVSlot:
    """Ownership of one slot of a :class:`KVPool`: allocated at construction, given back by
    :meth:`release` (idempotent) or, as a last resort, when the handle is garbage-collected.
    Share the handle object, never copy it (each copy would give the slot back)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.slot: Optional[int] = pool.alloc()

    def release(self) -> None:
        if self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None

    def __del__(self):  # noqa: D401 - best effort (streams are normally closed explicitly)
        try:
            self.release()
        except Exception:  # noqa: BLE001
            pass


def attention_bias(pos: torch.Tensor, kv_len: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, group*T, kv_len]: 0 where key j <= pos[b, t], -inf elsewhere (query
    rows ordered (group, t) as :func:`_attention` lays them out)."""
    B, T = pos.shape
    j = torch.arange(kv_len, device=pos.device)
    allowed = j[None, None, :] <= pos[:, :, None]  # [B, T, L]
    bias = torch.zeros(B, T, kv_len, dtype=dtype, device=pos.device).masked_fill(~allowed, float("-inf"))
    return bias[:, None, None].expand(B, 1, group, T, kv_len).reshape(B, 1, group * T, kv_len)


def _attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               slots: torch.Tensor, pos: torch.Tensor, kv_len: int, scaling: float, bias: torch.Tensor) -> torch.Tensor:
    """q [B,T,H,D], k_new/v_new [B,T,Hkv,D]; kc/vc [S+1, Lmax, Hkv, D] (one layer); bias from
    :func:`attention_bias`. Grouped-query attention as Hkv-head attention with g*T query rows,
    through PyTorch SDPA (flash / memory-efficient / math; cuDNN is pinned off). Returns [B,T,H*D]."""
    B, T, H, D = q.shape
    hkv = k_new.shape[2]
    g = H // hkv
    idx_s = slots[:, None].expand(B, T)
    kc.index_put_((idx_s, pos), k_new)
    vc.index_put_((idx_s, pos), v_new)
    K = kc[:, :kv_len].index_select(0, slots).transpose(1, 2)  # [B, Hkv, L, D]
    V = vc[:, :kv_len].index_select(0, slots).transpose(1, 2)
    qg = q.view(B, T, hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, hkv, g * T, D)
    o = F.scaled_dot_product_attention(qg, K, V, attn_mask=bias, scale=scaling)  # [B, Hkv, gT, D]
    return o.view(B, hkv, g, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)


def _rms(mod, x: torch.Tensor) -> torch.Tensor:
    """The module's RMSNorm; on CUDA through ``F.rms_norm`` (one fused op where PyTorch has it)."""
    if x.is_cuda:
        return F.rms_norm(x, (x.shape[-1],), mod.weight, mod.variance_epsilon)
    return mod(x)


def fuse_projections(model) -> None:
    """Give each decoder layer one fused QKV weight and one fused gate/up weight, and rebind the
    original ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj`` weights as views
    into them (no extra memory; every other user of the modules sees the same values). Layers
    with biases are left alone. Idempotent.

    Quantized layers (:class:`~.quantization.QuantLinear`, all five of a layer) fuse the same way:
    the fused projection is a ``QuantLinear`` over the concatenated int8/fp8 rows and per-row
    scales (:meth:`~.quantization.QuantLinear.concat`); :func:`project` applies either form."""
    from torch import nn

    from .quantization import QuantLinear

    for layer in model.layers:
        if hasattr(layer, "_dk_qkv"):
            continue
        a, m = layer.self_attn, layer.mlp
        mods5 = (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj)
        if any(getattr(x, "bias", None) is not None for x in mods5):
            continue
        quant = [isinstance(x, QuantLinear) for x in mods5]
        if any(quant) and not all(quant):
            continue  # partly quantized: keep the separate projections
        with torch.no_grad():
            for name, mods in (("_dk_qkv", (a.q_proj, a.k_proj, a.v_proj)), ("_dk_gu", (m.gate_proj, m.up_proj))):
                if all(quant):
                    # a plain attribute (not a registered submodule): the state dict and module walks
                    # keep seeing the per-projection layers, whose buffers are views into this one
                    object.__setattr__(layer, name, QuantLinear.concat(mods))
                    continue
                w = torch.cat([x.weight for x in mods], dim=0)
                o = 0
                for x in mods:
                    n = x.weight.shape[0]
                    x.weight = nn.Parameter(w[o:o + n], requires_grad=False)
                    o += n
                setattr(layer, name, w)
            if hasattr(a, "q_norm"):  # Qwen3: per-head q/k RMSNorm gains as one [Hq + Hkv, D] table
                hq = a.q_proj.out_features // a.head_dim
                hk = a.k_proj.out_features // a.head_dim
                layer._dk_qk_gain = torch.cat([a.q_norm.weight.expand(hq, -1), a.k_norm.weight.expand(hk, -1)])


def project(h: torch.Tensor, w) -> torch.Tensor:
    """``h`` [..., in] through a fused projection of :func:`fuse_projections`: a weight tensor
    [out, in] (``F.linear``) or a :class:`~.quantization.QuantLinear`."""
    return F.linear(h, w) if isinstance(w, torch.Tensor) else w(h)


def triton_decode_enabled() -> bool:
    """Whether :func:`decoder_forward` on CUDA runs the Triton kernels of :mod:`.triton_decode`: yes
    unless ``DUPLEXKIT_TRITON_DECODE=0`` was set when this module was imported, and Triton is
    installed (PyTorch's CUDA wheels bring it)."""
    return _TRITON_DECODE and _triton_installed()


@functools.lru_cache(maxsize=1)
def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor) -> bool:
    if not _TRITON_DECODE:
        return False
    if x.is_cuda:
        return _triton_installed() and _triton_capable(x.device.index if x.device.index is not None
                                                       else torch.cuda.current_device())
    return _TRITON_ON_CPU and x.device.type == "cpu"


@functools.lru_cache(maxsize=None)
def _triton_capable(device_index: int) -> bool:
    """Compute capability 8.0 or newer (Ampere on): the kernels' bf16 ``tl.dot`` needs it; older
    GPUs keep PyTorch's ops. Measured only on an H200 (9.0)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def decoder_forward(model, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, pool: KVPool,
                    kv_len: int) -> torch.Tensor:
    """Run ``model``'s decoder layers (a transformers ``Qwen3Model`` or ``LlamaModel``) and final
    norm on ``x`` [B, T, hidden] at positions ``pos`` [B, T] (long) writing into / attending the
    ``slots`` [B] (long) of ``pool``. Returns the final-norm hidden states [B, T, hidden].

    With ``x`` on CUDA and :func:`triton_decode_enabled` (the default; on the CPU only for the
    tests, under Triton's interpreter), the
    residual adds and RMSNorms run fused, and a one-token step (T == 1) runs q/k norm + rotary +
    KV write and the attention (in place over the pool, no gather) as Triton kernels
    (:mod:`.triton_decode`); same function, rounding differences only."""
    if _use_triton(x):
        return _decoder_forward_triton(model, x, pos, slots, pool, kv_len)
    cos, sin = model.rotary_emb(x, pos)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, D]
    B, T, _ = x.shape
    n_heads = model.config.num_attention_heads
    bias = attention_bias(pos, kv_len, n_heads // model.config.num_key_value_heads, x.dtype)
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        h = _rms(layer.input_layernorm, x)
        q, k, v = _qkv_rope(layer, h, cos, sin, x.is_cuda)
        o = _attention(q, k, v, pool.k[i], pool.v[i], slots, pos, kv_len, a.scaling, bias)
        x = x + a.o_proj(o)
        h = _rms(layer.post_attention_layernorm, x)
        mlp = layer.mlp
        if hasattr(layer, "_dk_gu"):
            g, u = project(h, layer._dk_gu).chunk(2, dim=-1)
            x = x + mlp.down_proj(mlp.act_fn(g) * u)
        else:
            x = x + mlp(h)
    return _rms(model.norm, x)


def _fused_qkv(layer, h: torch.Tensor):
    """The fused QKV projection of ``h`` [B, T, hidden] (a layer with ``_dk_qkv``): (qkv [B, T,
    H + 2 Hkv, D], H, Hkv), query heads first, then key heads, then value heads."""
    a = layer.self_attn
    hd = a.head_dim
    B, T, _ = h.shape
    qkv = project(h, layer._dk_qkv).view(B, T, -1, hd)
    nk = a.k_proj.out_features // hd
    return qkv, qkv.shape[2] - 2 * nk, nk


def _qkv_projections(layer, h: torch.Tensor):
    """The layer's projections of ``h`` [B, T, hidden]: q [B,T,H,D], k/v [B,T,Hkv,D] before norm
    and rotary (views into the fused QKV output when the layer has one)."""
    if hasattr(layer, "_dk_qkv"):
        qkv, nq, nk = _fused_qkv(layer, h)
        return qkv[:, :, :nq], qkv[:, :, nq: nq + nk], qkv[:, :, nq + nk:]
    a = layer.self_attn
    hd = a.head_dim
    B, T, _ = h.shape
    return a.q_proj(h).view(B, T, -1, hd), a.k_proj(h).view(B, T, -1, hd), a.v_proj(h).view(B, T, -1, hd)


def _decoder_forward_triton(model, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, pool: KVPool,
                            kv_len: int) -> torch.Tensor:
    """:func:`decoder_forward` through the kernels of :mod:`.triton_decode` (see there)."""
    from . import triton_decode as td

    cos, sin = model.rotary_emb(x, pos)  # [B, T, D]
    B, T, _ = x.shape
    decode = T == 1
    if decode:
        pos1, cos1, sin1 = pos[:, 0], cos[:, 0], sin[:, 0]
    else:
        cos4, sin4 = cos.unsqueeze(2), sin.unsqueeze(2)
        n_heads = model.config.num_attention_heads
        bias = attention_bias(pos, kv_len, n_heads // model.config.num_key_value_heads, x.dtype)
    res = None
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        ln = layer.input_layernorm
        if res is None:
            h = F.rms_norm(x, (x.shape[-1],), ln.weight, ln.variance_epsilon)
        else:
            x, h = td.add_rms_norm(x, res, ln.weight, ln.variance_epsilon)
        if decode:
            q, k, v = _qkv_projections(layer, h)
            if hasattr(a, "q_norm"):
                gq, gk, eps = a.q_norm.weight, a.k_norm.weight, a.q_norm.variance_epsilon
            else:
                gq = gk = None
                eps = 0.0
            qr = td.qk_norm_rope_write(q[:, 0], k[:, 0], v[:, 0], cos1, sin1, gq, gk, eps, pool.k[i], pool.v[i],
                                       slots, pos1)
            o = td.decode_attention(qr, pool.k[i], pool.v[i], slots, pos1, kv_len, a.scaling).view(B, 1, -1)
        else:
            q, k, v = _qkv_rope(layer, h, cos4, sin4, x.is_cuda)
            o = _attention(q, k, v, pool.k[i], pool.v[i], slots, pos, kv_len, a.scaling, bias)
        ln = layer.post_attention_layernorm
        x, h = td.add_rms_norm(x, a.o_proj(o), ln.weight, ln.variance_epsilon)
        mlp = layer.mlp
        if hasattr(layer, "_dk_gu"):
            g, u = project(h, layer._dk_gu).chunk(2, dim=-1)
            res = mlp.down_proj(mlp.act_fn(g) * u)
        else:
            res = mlp(h)
    if res is None:
        return F.rms_norm(x, (x.shape[-1],), model.norm.weight, model.norm.variance_epsilon)
    return td.add_rms_norm(x, res, model.norm.weight, model.norm.variance_epsilon)[1]


def _qkv_rope(layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cuda: bool):
    """The torch path's projections, Qwen3 q/k norms and rotary: q [B,T,H,D], k/v [B,T,Hkv,D]
    (``cos`` / ``sin`` [B, T, 1, D]; ``cuda`` picks the fused-norm form)."""
    a = layer.self_attn
    hd = a.head_dim
    if hasattr(layer, "_dk_qkv"):
        qkv, nq, nk = _fused_qkv(layer, h)
        qk, v = qkv[:, :, : nq + nk], qkv[:, :, nq + nk:]
        if hasattr(layer, "_dk_qk_gain"):
            if cuda:
                qk = F.rms_norm(qk, (hd,), None, a.q_norm.variance_epsilon) * layer._dk_qk_gain
            else:
                qk = torch.cat([a.q_norm(qk[:, :, :nq]), a.k_norm(qk[:, :, nq:])], dim=2)
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk[:, :, :nq], qk[:, :, nq:]
    else:
        q, k, v = _qkv_projections(layer, h)
        if hasattr(a, "q_norm"):  # Qwen3
            q = _rms(a.q_norm, q)
            k = _rms(a.k_norm, k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
    return q, k, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)
