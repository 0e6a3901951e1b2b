"""A fused one-token decoder step for a small Llama (the talker): five kernels per layer.

The talker's decode step is launch-bound: at B <= 64 rows and hidden 768 every GEMM is a GEMV of
a few hundred KB of weights, and the ~12 kernels per layer of :func:`.fast_kv.decoder_forward`'s
Triton path spend more time in the gaps between kernels (inside the captured CUDA graph) than in
the kernels. :func:`fused_decode_step` runs each layer as

* K1 :func:`rms_qkv_rope_write` — RMSNorm of the residual (each program recomputes its rows' norm)
  + the fused QKV GEMV for one tile of one head (q, k and v columns of that head) + rotary on q and
  k + the new K/V written into the pool at ``(slot, pos)`` + the rotated q written out;
* K2 :func:`.triton_decode.decode_attention` over the row's slot, in place (one split without the
  merge kernel when ``kv_len <= ONE_SPLIT_MAX_KV``);
* K3 :func:`gemv_residual` — o_proj GEMV + residual add;
* K4 :func:`rms_gate_up_silu` — RMSNorm + the fused gate/up GEMV + ``silu(g) * u``;
* K5 :func:`gemv_residual` — down GEMV + residual add;

then one RMSNorm (the final norm) per step. Every function only launches kernels (no host sync,
no data-dependent host work): capturable in a CUDA graph.

GEMV layout: for ``B`` rows (1..64) the grid is output-column tiles x row blocks of
``BLOCK_M`` rows (at least 16, as ``tl.dot`` needs); each program loops over the reduction dim in
``BLOCK_K`` steps and reads its weight tile once for all rows of its block; fp32 accumulation,
inputs and outputs in the model dtype, intermediate values rounded to the model dtype where the
PyTorch path rounds them (the GEMM outputs, ``silu(g)``). Block sizes are module constants (and
keyword arguments of the wrappers) to be tuned on the GPU.

Numerics against :func:`.fast_kv.decoder_forward`: rounding only (fp32: reduction order; bf16:
one rounding instead of several in the norms and the rotary).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .triton_decode import _INTERPRET, _on_device, decode_attention

__all__ = ["rms_qkv_rope_write", "gemv_residual", "rms_gate_up_silu", "fused_decode_step", "fused_step_supported",
           "BLOCK_HALF", "BLOCK_N_OUT", "BLOCK_N_FFN", "BLOCK_K", "NUM_WARPS", "MAX_BLOCK_M", "ONE_SPLIT_MAX_KV"]

BLOCK_HALF = 8
"""K1: rotary pairs per program (the program computes ``2 * BLOCK_HALF`` columns of each of q, k, v
of one head: pairs ``j`` and ``j + D/2``); D = 64 gives ``D / 2 / 8 = 4`` programs per head (48 for
the talker's 12 heads)."""
BLOCK_N_OUT = 16
"""K3 / K5: output columns per program (hidden 768 -> 48 programs per row block)."""
BLOCK_N_FFN = 32
"""K4: gate (and as many up) columns per program (FFN 3072 -> 96 programs per row block)."""
BLOCK_K = 64
"""Reduction-dim step of every GEMV loop."""
NUM_WARPS = 4
"""Warps per program of K1, K3, K4, K5."""
MAX_BLOCK_M = 64
"""Largest row block (``B`` above it adds row blocks to the grid)."""
ONE_SPLIT_MAX_KV = 512
"""The attention runs one key split (no merge kernel) up to this ``kv_len``."""


def _block_m(B: int) -> int:
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(B)))


@triton.jit
def _row_rstd(X, stride_xb, rows, rmask, eps, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """1 / rms of rows ``rows`` of X [B, K] (fp32, [BLOCK_M])."""
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * stride_xb + offs_k[None, :], mask=rmask[:, None] & (offs_k < K)[None, :],
                    other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _normed_block(X, G, stride_xb, rows, rmask, offs_k, kmask, rstd):
    """RMSNorm-ed block [BLOCK_M, BLOCK_K] of X (rounded to X's dtype, as the norm's output is)."""
    x = tl.load(X + rows[:, None] * stride_xb + offs_k[None, :], mask=rmask[:, None] & kmask[None, :],
                other=0.0).to(tl.float32)
    g = tl.load(G + offs_k, mask=kmask, other=0.0).to(tl.float32)
    return (x * rstd[:, None] * g[None, :]).to(X.dtype.element_ty)


@triton.jit
def _mm(a, w, DOT_F32: tl.constexpr):
    """a [M, K] @ w[N, K]^T in fp32 (``DOT_F32``: on fp32 copies, exact fp32 products)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(w))


@triton.jit
def _rope_split(y, c_lo, c_hi, s_lo, s_hi, BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """y [BLOCK_M, 2 * BLOCK_HALF] (fp32) with columns interleaved (pair j's low half, then its high
    half), rotated; returns the two halves (fp32)."""
    lo, hi = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_HALF, 2]))
    return lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi


@triton.jit
def _qkv_rope_kernel(X, G, W, Cos, Sin, Q, Kc, Vc, Slots, Pos, B, eps,
                     stride_xb, stride_wn, stride_cb, stride_sb, stride_ks, stride_kn, stride_kh,
                     stride_vs, stride_vn, stride_vh,
                     H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    h = tl.program_id(0)
    jb = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    D = 2 * HALF
    t = tl.arange(0, 2 * BLOCK_HALF)
    col = jb * BLOCK_HALF + t // 2 + (t % 2) * HALF  # interleaved: pair j low, pair j high, ...
    has_kv = h < HKV  # grouped-query heads: only the first HKV programs' heads have k and v
    wq = W + (h * D + col)[:, None] * stride_wn
    wk = W + ((H + h) * D + col)[:, None] * stride_wn
    wv = W + ((H + HKV + h) * D + col)[:, None] * stride_wn
    rstd = _row_rstd(X, stride_xb, rows64, rmask, eps, K, BLOCK_K, BLOCK_M)
    acc_q = tl.zeros([BLOCK_M, 2 * BLOCK_HALF], tl.float32)
    acc_k = tl.zeros([BLOCK_M, 2 * BLOCK_HALF], tl.float32)
    acc_v = tl.zeros([BLOCK_M, 2 * BLOCK_HALF], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        a = _normed_block(X, G, stride_xb, rows64, rmask, offs_k, kmask, rstd)
        acc_q += _mm(a, tl.load(wq + offs_k[None, :], mask=kmask[None, :], other=0.0), DOT_F32)
        kvmask = kmask[None, :] & has_kv
        acc_k += _mm(a, tl.load(wk + offs_k[None, :], mask=kvmask, other=0.0), DOT_F32)
        acc_v += _mm(a, tl.load(wv + offs_k[None, :], mask=kvmask, other=0.0), DOT_F32)
    DT = Q.dtype.element_ty
    j = jb * BLOCK_HALF + tl.arange(0, BLOCK_HALF)  # this program's pairs: columns j and j + HALF
    m2 = rmask[:, None]
    c_lo = tl.load(Cos + rows64[:, None] * stride_cb + j[None, :], mask=m2, other=0.0).to(tl.float32)
    c_hi = tl.load(Cos + rows64[:, None] * stride_cb + HALF + j[None, :], mask=m2, other=0.0).to(tl.float32)
    s_lo = tl.load(Sin + rows64[:, None] * stride_sb + j[None, :], mask=m2, other=0.0).to(tl.float32)
    s_hi = tl.load(Sin + rows64[:, None] * stride_sb + HALF + j[None, :], mask=m2, other=0.0).to(tl.float32)
    # the GEMM outputs rounded to the model dtype (as F.linear returns them), then rotated in fp32
    q_lo, q_hi = _rope_split(acc_q.to(DT).to(tl.float32), c_lo, c_hi, s_lo, s_hi, BLOCK_M, BLOCK_HALF)
    qdst = Q + rows64[:, None] * (H * D) + h * D + j[None, :]
    tl.store(qdst, q_lo.to(DT), mask=m2)
    tl.store(qdst + HALF, q_hi.to(DT), mask=m2)
    slot = tl.load(Slots + rows, mask=rmask, other=0).to(tl.int64)
    p = tl.load(Pos + rows, mask=rmask, other=0).to(tl.int64)
    mkv = m2 & has_kv
    k_lo, k_hi = _rope_split(acc_k.to(DT).to(tl.float32), c_lo, c_hi, s_lo, s_hi, BLOCK_M, BLOCK_HALF)
    kdst = Kc + (slot * stride_ks + p * stride_kn + h * stride_kh)[:, None] + j[None, :]
    tl.store(kdst, k_lo.to(Kc.dtype.element_ty), mask=mkv)
    tl.store(kdst + HALF, k_hi.to(Kc.dtype.element_ty), mask=mkv)
    v_lo, v_hi = tl.split(tl.reshape(acc_v, [BLOCK_M, BLOCK_HALF, 2]))
    vdst = Vc + (slot * stride_vs + p * stride_vn + h * stride_vh)[:, None] + j[None, :]
    tl.store(vdst, v_lo.to(Vc.dtype.element_ty), mask=mkv)
    tl.store(vdst + HALF, v_hi.to(Vc.dtype.element_ty), mask=mkv)


def rms_qkv_rope_write(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w_qkv: torch.Tensor, n_heads: int,
                       cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor,
                       pos: torch.Tensor, *, block_half: Optional[int] = None,
                       block_k: Optional[int] = None) -> torch.Tensor:
    """K1: ``h = rms_norm(x) * norm_w``; ``q, k, v = h @ w_qkv^T`` split by heads; rotary on q and k
    (Llama rotate-half: ``y * cos + rotate_half(y) * sin``); k and v written at ``[slots[b], pos[b]]``
    of ``kc`` / ``vc``; the rotated q returned. One launch.

    Args:
        x: [B, K] residual stream (model dtype, last dim contiguous).
        norm_w: [K] the input RMSNorm gain. eps: its epsilon.
        w_qkv: [(H + 2 Hkv) * D, K] fused projection weight, q heads then k heads then v heads
            (``layer._dk_qkv``; last dim contiguous).
        n_heads: H (query heads); ``Hkv`` and ``D`` come from ``kc``.
        cos / sin: [B, D] rotary tables at each row's position (last dim contiguous).
        kc / vc: [S+1, Lmax, Hkv, D] one layer's pool (last dim contiguous).
        slots / pos: [B] integer (made contiguous).
        block_half / block_k: tile sizes (None: :data:`BLOCK_HALF` / :data:`BLOCK_K` at call time;
            ``block_half`` is capped at ``D / 2``, ``2 * block_half`` must be >= 16, ``block_k`` >= 16).

    Returns:
        q [B, H, D] rotated, in ``x``'s dtype.

    Raises:
        ValueError: shapes that do not match, ``D`` not a power of two >= 16, ``H`` not a multiple
            of ``Hkv``, a non-contiguous last dim.
    """
    B, K = x.shape
    hkv, D = kc.shape[2], kc.shape[3]
    H = int(n_heads)
    if D < 16 or D & (D - 1) or H % hkv:
        raise ValueError(f"need D a power of two >= 16 and H % Hkv == 0 (D={D}, H={H}, Hkv={hkv})")
    if w_qkv.shape != ((H + 2 * hkv) * D, K) or norm_w.shape != (K,) or vc.shape != kc.shape:
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, w_qkv {tuple(w_qkv.shape)}, "
                         f"norm_w {tuple(norm_w.shape)}, kc {tuple(kc.shape)}, vc {tuple(vc.shape)}")
    if cos.shape != (B, D) or sin.shape != (B, D) or slots.shape != (B,) or pos.shape != (B,):
        raise ValueError(f"cos/sin must be [{B}, {D}] and slots/pos [{B}]")
    if any(t.stride(-1) != 1 for t in (x, w_qkv, cos, sin, kc, vc)):
        raise ValueError("every tensor needs a contiguous last dim")
    half = D // 2
    bh = min(int(block_half or BLOCK_HALF), half)
    if 2 * bh < 16 or half % bh:
        raise ValueError(f"block_half {block_half} must divide D/2 = {half} with 2 * block_half >= 16")
    bm = _block_m(B)
    slots, pos = slots.contiguous(), pos.contiguous()
    q = torch.empty(B, H, D, dtype=x.dtype, device=x.device)
    with _on_device(x):
        _qkv_rope_kernel[(H, half // bh, triton.cdiv(B, bm))](
            x, norm_w, w_qkv, cos, sin, q, kc, vc, slots, pos, B, float(eps),
            x.stride(0), w_qkv.stride(0), cos.stride(0), sin.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
            vc.stride(0), vc.stride(1), vc.stride(2),
            H=H, HKV=hkv, HALF=half, K=K, BLOCK_M=bm, BLOCK_HALF=bh, BLOCK_K=int(block_k or BLOCK_K),
            DOT_F32=_INTERPRET or x.dtype == torch.float32, num_warps=NUM_WARPS)
    return q


@triton.jit
def _gemv_residual_kernel(A, W, R, Out, B, stride_ab, stride_wn, stride_rb, stride_ob,
                          N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M))
    rmask = rows < B
    nmask = cols < N
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        a = tl.load(A + rows64[:, None] * stride_ab + offs_k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + cols[:, None] * stride_wn + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += _mm(a, w, DOT_F32)
    DT = Out.dtype.element_ty
    m2 = rmask[:, None] & nmask[None, :]
    r = tl.load(R + rows64[:, None] * stride_rb + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    out = r + acc.to(DT).to(tl.float32)  # the projection's output in the model dtype, then the add
    tl.store(Out + rows64[:, None] * stride_ob + cols[None, :], out.to(DT), mask=m2)


def gemv_residual(a: torch.Tensor, w: torch.Tensor, res: torch.Tensor, *, block_n: Optional[int] = None,
                  block_k: Optional[int] = None) -> torch.Tensor:
    """K3 / K5: ``res + a @ w^T`` (the product rounded to the model dtype first, as ``x + linear(a)``).

    Args:
        a: [B, K] (model dtype, last dim contiguous). w: [N, K] weight (last dim contiguous).
        res: [B, N] residual (last dim contiguous).
        block_n / block_k: tile sizes, >= 16 (None: :data:`BLOCK_N_OUT` / :data:`BLOCK_K` at call time).

    Returns:
        [B, N] new tensor in ``res``'s dtype.

    Raises:
        ValueError: shapes that do not match or a non-contiguous last dim.
    """
    B, K = a.shape
    N = w.shape[0]
    if w.shape != (N, K) or res.shape != (B, N):
        raise ValueError(f"gemv_residual: a {tuple(a.shape)}, w {tuple(w.shape)}, res {tuple(res.shape)}")
    if any(t.stride(-1) != 1 for t in (a, w, res)):
        raise ValueError("every tensor needs a contiguous last dim")
    bm = _block_m(B)
    block_n, block_k = int(block_n or BLOCK_N_OUT), int(block_k or BLOCK_K)
    out = torch.empty(B, N, dtype=res.dtype, device=res.device)
    with _on_device(a):
        _gemv_residual_kernel[(triton.cdiv(N, int(block_n)), triton.cdiv(B, bm))](
            a, w, res, out, B, a.stride(0), w.stride(0), res.stride(0), out.stride(0),
            N=N, K=K, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_F32=_INTERPRET or a.dtype == torch.float32, num_warps=NUM_WARPS)
    return out


@triton.jit
def _gate_up_kernel(X, G, W, Act, B, eps, stride_xb, stride_wn, stride_ab,
                    FF: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    nmask = cols < FF
    rows64 = rows.to(tl.int64)
    rstd = _row_rstd(X, stride_xb, rows64, rmask, eps, K, BLOCK_K, BLOCK_M)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    wg = W + cols[:, None] * stride_wn
    wu = W + (FF + cols)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        a = _normed_block(X, G, stride_xb, rows64, rmask, offs_k, kmask, rstd)
        wmask = nmask[:, None] & kmask[None, :]
        acc_g += _mm(a, tl.load(wg + offs_k[None, :], mask=wmask, other=0.0), DOT_F32)
        acc_u += _mm(a, tl.load(wu + offs_k[None, :], mask=wmask, other=0.0), DOT_F32)
    DT = Act.dtype.element_ty
    g = acc_g.to(DT).to(tl.float32)
    u = acc_u.to(DT).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)  # silu(g) in the model dtype, as F.silu returns it
    tl.store(Act + rows64[:, None] * stride_ab + cols[None, :], (s * u).to(DT), mask=rmask[:, None] & nmask[None, :])


def rms_gate_up_silu(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w_gu: torch.Tensor, *,
                     block_n: Optional[int] = None, block_k: Optional[int] = None) -> torch.Tensor:
    """K4: ``h = rms_norm(x) * norm_w``; ``g, u = h @ w_gu^T`` halves; returns ``silu(g) * u``.

    Args:
        x: [B, K] residual stream (model dtype, last dim contiguous). norm_w: [K] gain; eps: epsilon.
        w_gu: [2 F, K] fused gate (rows ``[0, F)``) and up (rows ``[F, 2F)``) weight (``layer._dk_gu``).
        block_n / block_k: tile sizes, >= 16 (None: :data:`BLOCK_N_FFN` / :data:`BLOCK_K` at call time).

    Returns:
        [B, F] in ``x``'s dtype.

    Raises:
        ValueError: shapes that do not match or a non-contiguous last dim.
    """
    B, K = x.shape
    if w_gu.dim() != 2 or w_gu.shape[1] != K or w_gu.shape[0] % 2 or norm_w.shape != (K,):
        raise ValueError(f"rms_gate_up_silu: x {tuple(x.shape)}, w_gu {tuple(w_gu.shape)}, norm_w {tuple(norm_w.shape)}")
    if x.stride(-1) != 1 or w_gu.stride(-1) != 1:
        raise ValueError("x and w_gu need a contiguous last dim")
    FF = w_gu.shape[0] // 2
    bm = _block_m(B)
    block_n, block_k = int(block_n or BLOCK_N_FFN), int(block_k or BLOCK_K)
    act = torch.empty(B, FF, dtype=x.dtype, device=x.device)
    with _on_device(x):
        _gate_up_kernel[(triton.cdiv(FF, int(block_n)), triton.cdiv(B, bm))](
            x, norm_w, w_gu, act, B, float(eps), x.stride(0), w_gu.stride(0), act.stride(0),
            FF=FF, K=K, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_F32=_INTERPRET or x.dtype == torch.float32, num_warps=NUM_WARPS)
    return act


def fused_step_supported(model) -> Optional[str]:
    """Why :func:`fused_decode_step` cannot run ``model`` (a reason string), or None when it can: a
    Llama-style model (no q/k norm), SiLU MLP, every layer with fused projections
    (:func:`.fast_kv.fuse_projections`, which skips layers with biases) and no o/down bias, head
    dim a power of two >= 16."""
    cfg = model.config
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r} (needs 'silu')"
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        if hasattr(a, "q_norm"):
            return f"layer {i} has q/k norms (Qwen3); the fused step is for Llama layers"
        if not (hasattr(layer, "_dk_qkv") and hasattr(layer, "_dk_gu")):
            return f"layer {i} has no fused projections (fast_kv.fuse_projections)"
        if a.o_proj.bias is not None or layer.mlp.down_proj.bias is not None:
            return f"layer {i} has an o_proj / down_proj bias"
        D = a.head_dim
        if D < 16 or D & (D - 1):
            return f"head_dim {D} is not a power of two >= 16"
    return None


def fused_decode_step(model, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, pool, kv_len: int) -> torch.Tensor:
    """One decode token per row through ``model``'s layers with five kernels per layer (module doc):
    the contract of :func:`.fast_kv.decoder_forward` for ``T == 1``.

    Args:
        model: a transformers ``LlamaModel`` passed through :func:`.fast_kv.fuse_projections`.
        x: [B, 1, hidden] input embeddings (model dtype). pos: [B, 1] long positions.
        slots: [B] long KV slots of ``pool`` (a :class:`.fast_kv.KVPool`). kv_len: keys considered
            (host int, > every ``pos``).

    Returns:
        [B, 1, hidden] final-norm hidden states; each row's K/V written at ``(slots[b], pos[b])`` of
        every layer of ``pool``.

    Raises:
        ValueError: ``T != 1``, or a model :func:`fused_step_supported` refuses.
    """
    from .fast_kv import _rms

    if x.dim() != 3 or x.shape[1] != 1 or pos.shape != (x.shape[0], 1):
        raise ValueError(f"fused_decode_step takes one token per row: x {tuple(x.shape)}, pos {tuple(pos.shape)}")
    why = fused_step_supported(model)
    if why is not None:
        raise ValueError(f"fused_decode_step cannot run this model: {why}")
    B = x.shape[0]
    cos, sin = model.rotary_emb(x, pos)  # [B, 1, D]
    cos, sin = cos[:, 0], sin[:, 0]
    p = pos[:, 0]
    n_heads = model.config.num_attention_heads
    one_split = 1 if int(kv_len) <= ONE_SPLIT_MAX_KV else 0
    h = x.reshape(B, -1)
    for i, layer in enumerate(model.layers):
        a, ln1, ln2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
        kc, vc = pool.k[i], pool.v[i]
        q = rms_qkv_rope_write(h, ln1.weight, ln1.variance_epsilon, layer._dk_qkv, n_heads, cos, sin, kc, vc, slots, p)
        o = decode_attention(q, kc, vc, slots, p, kv_len, a.scaling, n_split=one_split)
        h = gemv_residual(o, a.o_proj.weight, h)
        act = rms_gate_up_silu(h, ln2.weight, ln2.variance_epsilon, layer._dk_gu)
        h = gemv_residual(act, layer.mlp.down_proj.weight, h)
    return _rms(model.norm, h.view(B, 1, -1))
