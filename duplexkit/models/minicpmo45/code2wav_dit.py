"""The batched Code2Wav's DiT arithmetic (:mod:`.fast_code2wav`): the time table, the fused QKV
weights, the Euler loop and the DiT blocks in fewer kernels than the package's, and the precision
defaults of the vocoder's matmuls and attention caches.

:class:`DiTKernels` is a mixin of :class:`~.fast_code2wav.BatchedCode2Wav`: it reads the
:class:`~.code2wav.Code2Wav` attributes (``flow``, ``device``, ``dtype``, ``torch``, ``n_timesteps``,
``flow_autocast``) and keeps ``_dit_tab`` / ``_qkv``, which the wrapper's constructor creates.
Everything here is capturable in a CUDA graph once the table exists (:meth:`DiTKernels._dit_table`).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

__all__ = ["DiTKernels", "DiTTable", "FusedQKV", "att_cache_dtype_default", "matmul_tf32_default"]


class DiTTable(NamedTuple):
    """What the Euler loop's DiT takes from the time step, for all n steps and every block
    (:meth:`BatchedCode2Wav._dit_table`): one row, broadcast over the 2B CFG rows (the package gives
    every row the same time). Modulations in the order a block applies them: 0 attention (``msa``),
    1 convolution, 2 MLP. ``norm_w``/``norm_b``/``final_*`` are in the dtype ``F.layer_norm`` computes
    in under the flow's autocast; ``gate`` in the adaLN Linear's output dtype."""

    norm_w: Any
    """[n, depth, 3, hidden]: ``1 + scale``, the weight of the fused norm + modulate LayerNorm."""
    norm_b: Any
    """[n, depth, 3, hidden]: ``shift``, its bias."""
    gate: Any
    """[n, depth, 3, hidden]: the residual gates."""
    final_w: Any
    """[n, hidden]: the final layer's ``1 + scale``."""
    final_b: Any
    """[n, hidden]: the final layer's ``shift``."""
    dt: Any
    """[n]: the Euler step sizes (flow dtype)."""


class FusedQKV(NamedTuple):
    """One DiT block's attention input weights, fused (:meth:`BatchedCode2Wav._fused_qkv`); h heads of
    hd, inner = h * hd."""

    weight: Any
    """[3 inner, hidden]: ``to_q``, ``to_k``, ``to_v`` weights stacked (parameter dtype)."""
    bias: Any
    """[3 inner] or None: their biases."""
    norm_w: Any
    """[2h, hd]: ``q_norm``'s weight for each query head, then ``k_norm``'s for each key head."""
    norm_b: Any
    """[2h, hd]: the same for the biases."""
    eps: float
    """The head norms' eps."""


def matmul_tf32_default(device) -> bool:
    """Whether the vocoder's fp32 matmuls run on TF32 tensor cores: on for CUDA devices unless the
    environment sets ``DUPLEXKIT_CODE2WAV_TF32=0``; never on the CPU.

    Measured on an H200 at real size with random weights (benchmarks/results/2026-12-02-tf32-triton-h200.md,
    ``benchmarks/code2wav_batch.py --compare-to``): audio within 2.8e-5 (max abs) of full fp32, SNR
    75 dB, for 67.2 -> 49.7 ms per chunk at 1 stream and 660 -> 498 ms per round at 32. The
    reference runs these matmuls in fp32 (``Token2wav(float16=False)``), PyTorch's default."""
    import torch

    return torch.device(device).type == "cuda" and os.environ.get("DUPLEXKIT_CODE2WAV_TF32", "1") != "0"


def att_cache_dtype_default(device, flow_dtype, matmul_tf32: bool):
    """The dtype the batched path keeps the DiT's attention caches (K and V of every Euler step and
    block) in: ``DUPLEXKIT_CODE2WAV_ATT_CACHE`` (``float16`` or ``float32``) when set; else float16 for
    a float32 flow with TF32 matmuls on CUDA (:func:`matmul_tf32_default`), else the flow's dtype.

    Why float16 there: with TF32 on, the flow's matmuls already round their float32 inputs to 10
    mantissa bits, float16's precision, so caches stored in float16 lose no more than the matmuls
    that made them; they take half the memory (~0.25 GB per stream at real size instead of 504
    MiB, where 64 streams ran out of memory on the H200) and half the copy traffic, and attention
    runs on the tensor cores instead of float32 SIMT (~27 ms of a 32-stream round;
    benchmarks/results/2026-12-03-code2wav-caches-acceptance-h200.md). The attention then takes
    float16 queries (softmax accumulated in float32 by the kernel);
    its float16 output is copied into the float32 activations. ``DUPLEXKIT_CODE2WAV_TF32=0`` gives
    the reference's float32 arithmetic everywhere, caches included.

    Raises:
        ValueError: the variable names another dtype."""
    import torch

    env = os.environ.get("DUPLEXKIT_CODE2WAV_ATT_CACHE", "").strip()
    if env:
        if env not in ("float16", "float32"):
            raise ValueError(f"DUPLEXKIT_CODE2WAV_ATT_CACHE must be float16 or float32, got {env!r}")
        return getattr(torch, env)
    if torch.device(device).type == "cuda" and flow_dtype == torch.float32 and matmul_tf32:
        return torch.float16
    return flow_dtype


class DiTKernels:
    """The Euler loop over the DiT for the batched Code2Wav (see module doc)."""

    def _dit_table(self) -> DiTTable:
        """The Euler loop's time-dependent DiT inputs (:class:`DiTTable`), built once (not per batch
        size: the time is the same on every row) and kept; also builds every block's fused QKV
        weights (:meth:`_fused_qkv`). Call it outside any CUDA graph (:meth:`_euler_batch` does, before
        a capture or a replay): ``timestep_embedding`` builds its frequencies on the CPU, and tensors
        made inside a capture would hold nothing until the first replay.

        The times follow the package's ``solve_euler_chunk`` recurrence on the cosine schedule (``t +=
        dt; dt = t_span[k+1] - t``, in the flow's dtype); each step's embedding is the package's
        ``t_embedder`` on one row and each modulation its block's ``adaLN_modulation`` (SiLU +
        Linear), computed under :meth:`flow_autocast` and inference mode, as the package computes them
        inside the loop. ``1 + scale`` is added here in the modulation's dtype (the package's
        ``modulate`` adds it in the same dtype).

        Raises:
            RuntimeError: called for the first time while a CUDA graph capture is open.
            ValueError: a DiT layout this rewrite does not cover (see :meth:`_fused_qkv`; the blocks'
                ``norm1``/``norm2``/``norm3`` and the final ``norm_final`` must be LayerNorms without
                their own affine, the package's ``DiTBlock``/``FinalLayer``)."""
        hit = self._dit_tab
        if hit is not None:
            return hit
        torch = self.torch
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("Code2Wav DiT tables must be built before a CUDA graph capture "
                               "(_euler_batch builds them)")
        F = torch.nn.functional
        est = self.flow.decoder.estimator
        fl = est.final_layer
        for norm in [m for blk in est.blocks for m in (blk.norm1, blk.norm2, blk.norm3)] + [fl.norm_final]:
            if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is not None or norm.bias is not None:
                raise ValueError(f"Code2Wav DiT: expected LayerNorms without affine before the modulations "
                                 f"(stepaudio2 DiTBlock / FinalLayer), got {norm!r}")
        n, depth = self.n_timesteps, len(est.blocks)
        t_span = torch.linspace(0, 1, n + 1, device=self.device, dtype=self.dtype)
        t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        t, dt = t_span[0].reshape(1), t_span[1] - t_span[0]
        ts, dts = [], []
        for step in range(1, n + 1):
            ts.append(t)
            dts.append(dt.reshape(1))
            t = t + dt
            if step < n:
                dt = t_span[step + 1] - t
        with torch.inference_mode(), self.flow_autocast():
            emb = est.t_embedder(torch.cat(ts))  # [n, hidden]: step k's embedding on one row
            hidden = emb.shape[-1]
            m = torch.stack([blk.adaLN_modulation(emb) for blk in est.blocks], dim=1).view(n, depth, 9, hidden)
            f = fl.adaLN_modulation(emb).view(n, 2, hidden)
            # the dtype F.layer_norm computes in under the flow's autocast for inputs of the
            # modulations' dtype (the DiT's activations): float32 for a float16 flow on CUDA (autocast
            # runs layer_norm in float32), else that dtype. Weights already in it are not cast per call
            ln_dtype = F.layer_norm(torch.zeros(1, hidden, device=self.device, dtype=m.dtype), (hidden,)).dtype
            # chunk(9) order: shift, scale, gate of msa (0-2), mlp (3-5), conv (6-8); stored in the
            # order the block applies them: msa, conv, mlp
            tab = DiTTable(
                norm_w=(1 + m[:, :, [1, 7, 4]]).to(ln_dtype).contiguous(),
                norm_b=m[:, :, [0, 6, 3]].to(ln_dtype).contiguous(),
                gate=m[:, :, [2, 8, 5]].contiguous(),
                final_w=(1 + f[:, 1]).to(ln_dtype).contiguous(),
                final_b=f[:, 0].to(ln_dtype).contiguous(),
                dt=torch.cat(dts),
            )
            for b in range(depth):
                self._fused_qkv(b, ln_dtype)
        self._dit_tab = tab
        return tab

    def _fused_qkv(self, b: int, ln_dtype=None) -> FusedQKV:
        """Block ``b``'s attention input weights fused (:class:`FusedQKV`), built on first use from the
        package's ``to_q``/``to_k``/``to_v`` and ``q_norm``/``k_norm`` (copies: the package's modules and
        parameters are left as they are) and kept in a dict on this object (at real size 16 x 3 MB in
        float32). ``ln_dtype``: the dtype of the head norms' affine (see :meth:`_dit_table`, which builds
        them all; later calls read the dict).

        Raises:
            ValueError: ``q_norm``/``k_norm`` are not LayerNorms with affine of equal eps over the head
                dimension (the package's ``Attention(qk_norm=True)``)."""
        hit = self._qkv.get(b)
        if hit is not None:
            return hit
        torch = self.torch
        attn = self.flow.decoder.estimator.blocks[b].attn
        h, hd = attn.num_heads, attn.head_dim
        qn, kn = attn.q_norm, attn.k_norm
        for norm in (qn, kn):
            if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is None or norm.bias is None \
                    or tuple(norm.normalized_shape) != (hd,) or norm.eps != qn.eps:
                raise ValueError(f"Code2Wav DiT block {b}: expected q_norm/k_norm LayerNorm({hd}) with affine "
                                 f"and equal eps (stepaudio2 Attention(qk_norm=True)), got {qn!r} / {kn!r}")
        lins = (attn.to_q, attn.to_k, attn.to_v)
        with torch.no_grad():
            bias = None
            if all(lin.bias is not None for lin in lins):
                bias = torch.cat([lin.bias for lin in lins])
            elif any(lin.bias is not None for lin in lins):
                bias = torch.cat([lin.bias if lin.bias is not None else torch.zeros_like(lin.weight[:, 0])
                                  for lin in lins])
            dt = ln_dtype or qn.weight.dtype
            hit = FusedQKV(
                weight=torch.cat([lin.weight for lin in lins]),
                bias=bias,
                norm_w=torch.cat([qn.weight.expand(h, hd), kn.weight.expand(h, hd)]).to(dt).contiguous(),
                norm_b=torch.cat([qn.bias.expand(h, hd), kn.bias.expand(h, hd)]).to(dt).contiguous(),
                eps=float(qn.eps),
            )
        self._qkv[b] = hit
        return hit

    def _euler(self, B: int, x, mu_in, spks_in, cond_in, cnn, kv, cnn_out):
        """The package's ``solve_euler_chunk`` arithmetic for B streams (2B CFG rows: conditional
        first), with the DiT's blocks run by :meth:`_dit_blocks` (``DiT.forward_chunk``'s arithmetic:
        inputs packed along the channel axis, no mask) on the precomputed time table
        (:meth:`_dit_table`): no host work, capturable.

        ``kv`` [n, depth, 2B, h, T + L, 2hd]: step s's attention caches, the L cached frames at
        ``[..., T:, :]`` on entry; each step writes its T new frames at ``[..., :T, :]``, so on return
        ``kv`` holds the new caches in the package's order (new frames first). ``cnn`` [n, depth, 2B,
        C, 2] in, ``cnn_out`` out. Returns x [B, 80, T]."""
        torch = self.torch
        n = self.n_timesteps
        dec = self.flow.decoder
        dts = self._dit_table().dt
        rate = dec.inference_cfg_rate
        T = x.shape[2]
        spk_rep = spks_in[:, :, None].expand(-1, -1, T)
        for step in range(1, n + 1):
            xin = torch.cat([torch.cat([x, x], dim=0), mu_in, spk_rep, cond_in], dim=1)
            d = self._dit_blocks(xin, step - 1, cnn[step - 1], cnn_out[step - 1], kv[step - 1], T)
            dc, du = d.chunk(2, dim=0)
            x = x + dts[step - 1] * ((1.0 + rate) * dc - rate * du)
        return x

    def _dit_blocks(self, xin, s: int, cnn, cnn_out, kv, T: int):
        """``DiT.blocks_forward_chunk`` (stepaudio2-minicpmo 0.1.1) for Euler step ``s`` (0-based), the
        same arithmetic within float rounding, in fewer kernels.

        Args:
            xin: [2B, 320, T] the packed DiT input (x, mu, spks, cond) of the 2B CFG rows.
            s: the step, indexing :meth:`_dit_table` (the time embedding is not an input: everything
                that depends on it is in the table).
            cnn: [depth, 2B, C, 2] the blocks' convolution caches; block b's new one is copied to
                ``cnn_out[b]``.
            kv: [depth, 2B, h, T + L, 2hd] the blocks' attention caches, used in place: ``kv[b]`` holds
                the L cached frames (K then V on the last axis) at ``[:, :, T:]``; the new frames' keys
                and values are written at ``[:, :, :T]`` and attention reads the whole of it. The
                package instead concatenates ``[new, cached]`` three times per block and step and
                copies the result into its buffer: the same keys in the same order, so the same
                attention, without ~4 copies of every cache per step
                (benchmarks/results/2026-12-02-code2wav-in-place-h200.md).
            T: the chunk's frames.

        Returns:
            [2B, 80, T] (a transposed view), in the activations' dtype.

        What differs from the package (the graph replay was launch bound: ~10 steps x 16 blocks x
        ~45 small kernels, ~35 ms per replay whatever the rows, on the H200):

        * the 9 adaLN modulations of every (step, block) and the final layer's 2 come from
          :meth:`_dit_table` (the package runs SiLU + Linear on ``t`` in every block of every step,
          though ``t`` is the same on every row); ``1 + scale`` is stored added;
        * ``modulate(norm(x), shift, scale)`` is ONE ``F.layer_norm(x, weight=1 + scale, bias=shift)``:
          the norms have no affine of their own and the modulation is the same on every row, so it
          is exactly a LayerNorm affine (same arithmetic within float rounding);
        * one QKV GEMM on the fused weight (:meth:`_fused_qkv`, ``F.linear`` inside the caller's
          autocast as the package's Linears are); the head norms run on the GEMM output viewed
          [2B, T, 3h, hd], which is contiguous: ONE ``F.layer_norm`` without affine over all 3h heads
          (the values' normalisation is unused), then one ``addcmul`` with the stacked q_norm /
          k_norm weights for the 2h query and key heads. (``F.layer_norm`` copies a non-contiguous
          input first: the package's norms on transposed heads cost a copy each, and so would a norm
          on a slice of the fused output);
        * gated residuals ``x + gate * y`` are one ``torch.addcmul(x, gate, y)``;
        * the final layer is one ``F.layer_norm`` with the table's weight and bias, then its Linear.

        Kernels per block-step, counted by reading the code (CUDA, float32; each convolution counted
        as one kernel, the conv block as 7: 2 cats, 2 convs, LayerNorm, Mish, the cache cat), NOT a
        measurement: the package's arithmetic as this method ran it before had 42 (adaLN 2; 3 norms;
        3 modulates x 3; 3 GEMMs; 2 head norms x (copy + norm); 2 cache writes; SDPA; out proj; 3
        gated residuals x 2; conv block 7 + cache copy; fc1, GELU, fc2); this one has 24 (3 fused
        norm-modulates; QKV GEMM; head norm; head affine; 2 cache writes; SDPA; out proj; 3
        ``addcmul`` residuals; conv block 7 + cache copy; fc1, GELU, fc2). The final layer per step:
        7 -> 2. At real size (16 blocks) that is ~672 -> ~384 launches per Euler step.

        Capturable: no host syncs, no CPU-built tensors, nothing persistent allocated (the table and
        the fused weights exist before the loop runs)."""
        torch = self.torch
        F = torch.nn.functional
        est = self.flow.decoder.estimator
        tab = self._dit_table()
        W, Bn, G = tab.norm_w[s], tab.norm_b[s], tab.gate[s]  # [depth, 3 (msa, conv, mlp), hidden]
        x = est.in_proj(xin.transpose(1, 2))  # [2B, T, hidden]
        R, C = x.shape[0], x.shape[2]
        for b, block in enumerate(est.blocks):
            attn, kvb, qkv_w = block.attn, kv[b], self._qkv[b]
            h, hd = attn.num_heads, attn.head_dim
            y = F.layer_norm(x, (C,), W[b, 0], Bn[b, 0], block.norm1.eps)  # modulate(norm1(x), msa)
            qkv = F.linear(y, qkv_w.weight, qkv_w.bias).view(R, T, 3 * h, hd)  # heads: q, k, v
            qk = torch.addcmul(qkv_w.norm_b, F.layer_norm(qkv, (hd,), eps=qkv_w.eps)[:, :, :2 * h], qkv_w.norm_w)
            kvb[:, :, :T, :hd].copy_(qk[:, :, h:].transpose(1, 2))
            kvb[:, :, :T, hd:].copy_(qkv[:, :, 2 * h:].transpose(1, 2))
            q = qk[:, :, :h].transpose(1, 2)
            o = F.scaled_dot_product_attention(q.to(kvb.dtype), kvb[..., :hd], kvb[..., hd:]).transpose(1, 2)
            if o.dtype != x.dtype:  # float16 caches (att_cache_dtype): cast while making heads contiguous
                o = torch.empty(R, T, h, hd, device=x.device, dtype=x.dtype).copy_(o)
            x = torch.addcmul(x, G[b, 0], attn.proj(o.reshape(R, T, -1)))
            y = F.layer_norm(x, (C,), W[b, 1], Bn[b, 1], block.norm3.eps)  # modulate(norm3(x), conv)
            x_conv, new_cnn = block.conv.forward_chunk(y, cnn[b])
            cnn_out[b].copy_(new_cnn)
            x = torch.addcmul(x, G[b, 1], x_conv)
            y = F.layer_norm(x, (C,), W[b, 2], Bn[b, 2], block.norm2.eps)  # modulate(norm2(x), mlp)
            x = torch.addcmul(x, G[b, 2], block.mlp(y))
        fl = est.final_layer
        y = F.layer_norm(x, (C,), tab.final_w[s], tab.final_b[s], fl.norm_final.eps)
        return fl.linear(y).transpose(1, 2)
