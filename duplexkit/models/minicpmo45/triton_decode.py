"""Triton kernels for the one-token decode step of :func:`.fast_kv.decoder_forward` (opt-in).

Used by :func:`.fast_kv.decoder_forward` only when ``DUPLEXKIT_TRITON_DECODE=1`` and the input is on
CUDA (or Triton's CPU interpreter is on, ``TRITON_INTERPRET=1``, for the tests); the default path
is unchanged. Every function here launches kernels only: no host synchronisation and no
data-dependent host work, so each is capturable in a CUDA graph (the number of key splits
depends on the host ints ``B`` and ``kv_len`` only, which are fixed per captured graph).

* :func:`decode_attention` — grouped-query attention of one new query token per row over the row's
  KV slot, read **in place** from the static pool ``[S+1, Lmax, Hkv, D]`` (no gather of the cached
  keys). Flash-decoding: the key range ``[0, kv_len)`` is cut into splits, one program per
  (row, KV head, split) handles all ``H // Hkv`` query heads of its KV head with an online softmax
  over key blocks; a second kernel merges the splits. fp32 scores, softmax and accumulation.
* :func:`qk_norm_rope_write` — per-head q/k RMSNorm (Qwen3; optional), rotary embedding, the new
  token's K/V written into its slot at ``pos`` and the rotated queries returned: replaces the
  norm, the rotary element-wise ops and the two ``index_put_`` of the torch path.
* :func:`add_rms_norm` — ``x = x + y; h = rms_norm(x) * w`` in one pass, returning both.

Numerics: inputs and outputs in the model dtype (bf16 on the GPU, fp32 in the tests); every
reduction and the softmax in fp32. Against the torch path the results differ by rounding only
(the torch path rounds to the model dtype between its element-wise ops, these kernels once).
"""

from __future__ import annotations

import contextlib
import os
from typing import Tuple

import torch
import triton
import triton.language as tl

__all__ = ["decode_attention", "qk_norm_rope_write", "add_rms_norm", "num_splits"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's CPU interpreter is on: its ``tl.dot`` is wrong on bf16 operands (triton 3.5), so the
dots then run on fp32 copies of the (bf16-rounded) operands, which gives the same values."""

BLOCK_N = 64
"""Keys per block of the attention loop."""
_MIN_SPLIT_BLOCKS = 2
"""A split covers at least this many key blocks (fewer splits for short contexts)."""


@triton.jit
def _attn_split_kernel(Q, K, V, Slots, Pos, O, Mp, Lp, Ap,
                       stride_qb, stride_qh, stride_ks, stride_kn, stride_kh, stride_vs, stride_vn, stride_vh,
                       stride_ob, kv_len, chunk, n_split, scale,
                       G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                       SPLIT: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    slot = tl.load(Slots + b).to(tl.int64)
    n_valid = tl.minimum(tl.load(Pos + b).to(tl.int64) + 1, kv_len)  # keys j <= pos (and < kv_len)
    start = sp.to(tl.int64) * chunk
    end = tl.minimum(start + chunk, n_valid)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    k_base = K + slot * stride_ks + kvh * stride_kh
    v_base = V + slot * stride_vs + kvh * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=nmask[:, None], other=0.0)
        p = p.to(v.dtype)  # as flash attention: probabilities in the value dtype, fp32 accumulation
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    if SPLIT:
        row = (b.to(tl.int64) * (G * tl.num_programs(1)) + heads) * n_split + sp  # [B, H, n_split]
        tl.store(Mp + row, m_i, mask=gmask)
        tl.store(Lp + row, l_i, mask=gmask)
        tl.store(Ap + row[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(O + b.to(tl.int64) * stride_ob + heads[:, None] * D + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _attn_combine_kernel(O, Mp, Lp, Ap, stride_ob, n_split, D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b.to(tl.int64) * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    smask = offs_s < n_split
    m = tl.load(Mp + row * n_split + offs_s, mask=smask, other=float("-inf"))
    l = tl.load(Lp + row * n_split + offs_s, mask=smask, other=0.0)
    m_max = tl.max(m, axis=0)  # finite: split 0 always holds key 0
    w = tl.where(smask & (m > float("-inf")), tl.exp(m - m_max), 0.0)
    a = tl.load(Ap + (row * n_split + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(a * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(O + b.to(tl.int64) * stride_ob + h * D + offs_d, out.to(O.dtype.element_ty))


def _on_device(t: torch.Tensor):
    """Make ``t``'s CUDA device current for a launch: Triton launches on the calling thread's current
    device and its current stream (``torch.cuda.current_device()``), not on the device of the
    tensors, and every new thread starts on device 0 (the talker of the ``2gpu`` layout is on
    cuda:1). A no-op context for CPU tensors (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


_SM_COUNT = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: an H200's count, so the tests split as the GPU would
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def num_splits(batch: int, kv_heads: int, kv_len: int, sms: int) -> Tuple[int, int]:
    """How :func:`decode_attention` cuts ``[0, kv_len)``: about two programs per multiprocessor
    over ``batch * kv_heads * splits`` programs, each split at least ``_MIN_SPLIT_BLOCKS`` key
    blocks long. Returns ``(n_split, chunk)``: ``n_split`` splits of ``chunk`` keys (a multiple
    of :data:`BLOCK_N`), ``n_split * chunk >= kv_len``."""
    blocks = triton.cdiv(max(int(kv_len), 1), BLOCK_N)
    want = triton.cdiv(2 * sms, max(batch * kv_heads, 1))
    n = max(1, min(want, blocks // _MIN_SPLIT_BLOCKS))
    chunk = triton.cdiv(blocks, n) * BLOCK_N
    return triton.cdiv(blocks * BLOCK_N, chunk), chunk


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                     kv_len: int, scale: float, n_split: int = 0) -> torch.Tensor:
    """Attention of one query token per row over the row's cached keys, read in place.

    Row ``b`` attends keys ``j <= pos[b]`` (and ``j < kv_len``) of slot ``slots[b]``; the new
    token's K/V must already be in the cache at ``pos[b]``. Query head ``h`` uses KV head
    ``h // (H // Hkv)`` (grouped-query attention).

    Args:
        q: [B, H, D] queries (model dtype; the last dim contiguous, any other strides).
        kc / vc: [S+1, Lmax, Hkv, D] one layer's key / value pool (same dtype as ``q``, the last dim
            contiguous). ``H`` must be a multiple of ``Hkv``; ``D`` a power of two >= 16.
        slots: [B] integer slot per row. pos: [B] integer position of each row's query token (any
            stride: the kernels index them densely, so strided views are made contiguous).
        kv_len: keys considered (host int; ``pos < kv_len`` is expected).
        scale: score scale (usually ``D ** -0.5``).
        n_split: key-range splits (0: :func:`num_splits` chooses; 1: one pass without a merge).

    Returns:
        [B, H * D] in ``q``'s dtype (head-major, as the torch path's ``o`` before ``o_proj``).

    Raises:
        ValueError: mismatched shapes, ``H`` not a multiple of ``Hkv``, ``D`` not a power of two
            >= 16, or a non-contiguous last dim.
    """
    B, H, D = q.shape
    if kc.dim() != 4 or vc.shape != kc.shape or kc.shape[3] != D:
        raise ValueError(f"kc/vc must be [S+1, Lmax, Hkv, {D}], got {tuple(kc.shape)} / {tuple(vc.shape)}")
    hkv = kc.shape[2]
    if H % hkv or D < 16 or D & (D - 1):
        raise ValueError(f"need H % Hkv == 0 and D a power of two >= 16 (H={H}, Hkv={hkv}, D={D})")
    if q.stride(2) != 1 or kc.stride(3) != 1 or vc.stride(3) != 1:
        raise ValueError("q, kc and vc need a contiguous last dim")
    if slots.shape != (B,) or pos.shape != (B,):
        raise ValueError(f"slots and pos must be [{B}], got {tuple(slots.shape)} / {tuple(pos.shape)}")
    G = H // hkv
    slots, pos = slots.contiguous(), pos.contiguous()  # the kernel reads Slots + b, Pos + b
    kv_len = int(kv_len)
    if n_split <= 0:
        n_split, chunk = num_splits(B, hkv, kv_len, _sm_count(q.device))
    else:
        chunk = triton.cdiv(triton.cdiv(kv_len, n_split), BLOCK_N) * BLOCK_N
        n_split = triton.cdiv(kv_len, chunk)
    out = torch.empty(B, H * D, dtype=q.dtype, device=q.device)
    split = n_split > 1
    if split:
        mp = torch.empty(B, H, n_split, dtype=torch.float32, device=q.device)
        lp = torch.empty_like(mp)
        ap = torch.empty(B, H, n_split, D, dtype=torch.float32, device=q.device)
    else:
        mp = lp = ap = out  # unused
    dot_f32 = _INTERPRET or q.dtype == torch.float32
    with _on_device(q):
        _attn_split_kernel[(B, hkv, n_split)](
            q, kc, vc, slots, pos, out, mp, lp, ap,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
            out.stride(0), kv_len, chunk, n_split, float(scale),
            G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=BLOCK_N, SPLIT=split, DOT_F32=dot_f32,
            num_warps=4, num_stages=2)
        if split:
            _attn_combine_kernel[(B, H)](out, mp, lp, ap, out.stride(0), n_split, D=D,
                                         BLOCK_S=max(2, triton.next_power_of_2(n_split)), num_warps=4)
    return out


@triton.jit
def _norm_rope(x_ptr, g_ptr, cos1, sin1, cos2, sin2, eps, offs, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """One head vector: optional RMSNorm with gain, then rotary; returns both halves (fp32)."""
    x1 = tl.load(x_ptr + offs).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + offs).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        x1 = x1 * rstd * tl.load(g_ptr + offs).to(tl.float32)
        x2 = x2 * rstd * tl.load(g_ptr + HALF + offs).to(tl.float32)
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _qk_rope_write_kernel(Q, K, V, Cos, Sin, QG, KG, Qout, Kc, Vc, Slots, Pos,
                          stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb, stride_sb,
                          stride_ks, stride_kn, stride_kkh, stride_vs, stride_vn, stride_vvh, eps,
                          H: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    b64 = b.to(tl.int64)
    offs = tl.arange(0, HALF)
    cos1 = tl.load(Cos + b64 * stride_cb + offs).to(tl.float32)
    cos2 = tl.load(Cos + b64 * stride_cb + HALF + offs).to(tl.float32)
    sin1 = tl.load(Sin + b64 * stride_sb + offs).to(tl.float32)
    sin2 = tl.load(Sin + b64 * stride_sb + HALF + offs).to(tl.float32)
    if h < H:
        o1, o2 = _norm_rope(Q + b64 * stride_qb + h * stride_qh, QG, cos1, sin1, cos2, sin2, eps, offs, HALF, HAS_NORM)
        dst = Qout + (b64 * H + h) * (2 * HALF)
        tl.store(dst + offs, o1.to(Qout.dtype.element_ty))
        tl.store(dst + HALF + offs, o2.to(Qout.dtype.element_ty))
    else:
        kh = h - H
        slot = tl.load(Slots + b).to(tl.int64)
        p = tl.load(Pos + b).to(tl.int64)
        o1, o2 = _norm_rope(K + b64 * stride_kb + kh * stride_kh, KG, cos1, sin1, cos2, sin2, eps, offs, HALF, HAS_NORM)
        kdst = Kc + slot * stride_ks + p * stride_kn + kh * stride_kkh
        tl.store(kdst + offs, o1.to(Kc.dtype.element_ty))
        tl.store(kdst + HALF + offs, o2.to(Kc.dtype.element_ty))
        vsrc = V + b64 * stride_vb + kh * stride_vh
        vdst = Vc + slot * stride_vs + p * stride_vn + kh * stride_vvh
        tl.store(vdst + offs, tl.load(vsrc + offs))
        tl.store(vdst + HALF + offs, tl.load(vsrc + HALF + offs))


def qk_norm_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_gain, k_gain, eps: float, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor,
                       pos: torch.Tensor) -> torch.Tensor:
    """The one-token step's per-head q/k RMSNorm (if gains are given), rotary embedding
    (``x * cos + rotate_half(x) * sin``) and KV-cache write, in one launch.

    Args:
        q: [B, H, D]; k / v: [B, Hkv, D] (model dtype; views into the fused QKV output are fine:
            the last dim contiguous, any other strides).
        cos / sin: [B, D] rotary tables at each row's position (the last dim contiguous).
        q_gain / k_gain: [D] RMSNorm gains (Qwen3 ``q_norm`` / ``k_norm``), or both None (Llama:
            no norm). eps: the norms' epsilon.
        kc / vc: [S+1, Lmax, Hkv, D] one layer's pool; row ``b``'s rotated K and its V are written at
            ``[slots[b], pos[b]]``. slots / pos: [B] integer (any stride; made contiguous).

    Returns:
        the rotated queries [B, H, D] (contiguous, ``q``'s dtype).

    Raises:
        ValueError: shapes that do not match, an odd or non-power-of-two ``D``, or a
            non-contiguous last dim.
    """
    B, H, D = q.shape
    hkv = k.shape[1]
    if k.shape != (B, hkv, D) or v.shape != k.shape or kc.shape[2:] != (hkv, D) or vc.shape != kc.shape:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"kc {tuple(kc.shape)}")
    if cos.shape != (B, D) or sin.shape != (B, D):
        raise ValueError(f"cos/sin must be [{B}, {D}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if D < 2 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two, got {D}")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, kc, vc)):
        raise ValueError("every tensor needs a contiguous last dim")
    if (q_gain is None) != (k_gain is None):
        raise ValueError("give both q_gain and k_gain or neither")
    has_norm = q_gain is not None
    slots, pos = slots.contiguous(), pos.contiguous()  # the kernel reads Slots + b, Pos + b
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    with _on_device(q):
        _qk_rope_write_kernel[(B, H + hkv)](
            q, k, v, cos, sin, q_gain if has_norm else q, k_gain if has_norm else k, out, kc, vc, slots, pos,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
            kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), float(eps),
            H=H, HALF=D // 2, HAS_NORM=has_norm, num_warps=1)
    return out


@triton.jit
def _add_rms_kernel(X, Y, W, Xout, Hout, N, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    s = tl.load(X + r * N + offs, mask=mask, other=0.0).to(tl.float32) \
        + tl.load(Y + r * N + offs, mask=mask, other=0.0).to(tl.float32)
    s = s.to(Xout.dtype.element_ty)  # the residual stream in the model dtype, as the torch path keeps it
    tl.store(Xout + r * N + offs, s, mask=mask)
    xf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    h = xf * rstd * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Hout + r * N + offs, h.to(Hout.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``s = x + y`` (rounded to the model dtype) and ``rms_norm(s) * weight`` in one pass.

    Args:
        x / y: [..., N] same shape and dtype (made contiguous if they are not).
        weight: [N] RMSNorm gain. eps: the norm's epsilon.

    Returns:
        ``(s, h)``, both [..., N] in ``x``'s dtype; the norm is computed in fp32 from the rounded ``s``.

    Raises:
        ValueError: ``x`` and ``y`` differ in shape or ``weight`` is not [N].
    """
    if x.shape != y.shape or weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, y {tuple(y.shape)}, weight {tuple(weight.shape)}")
    x, y = x.contiguous(), y.contiguous()
    N = x.shape[-1]
    rows = x.numel() // N
    s = torch.empty_like(x)
    h = torch.empty_like(x)
    block = triton.next_power_of_2(N)
    with _on_device(x):
        _add_rms_kernel[(rows,)](x, y, weight, s, h, N, float(eps), BLOCK=block,
                                 num_warps=8 if block >= 4096 else (4 if block >= 1024 else 1))
    return s, h
