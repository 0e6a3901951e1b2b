"""CUDA graphs of the batched Code2Wav flow (:mod:`.fast_code2wav`): the conformer encoder of a
chunk and the 10-step Euler loop over the DiT, each captured per static shape with its own input and
output buffers (the style of :mod:`.fast_talker`: ``torch.cuda.CUDAGraph`` over preallocated
tensors, replayed after copying the live rows in). CUDA only; the CPU path runs the same calls eagerly.

A graph's outputs are its static buffers: callers copy what they keep before the next replay.
Rows past the live batch (bucket padding) hold stale but finite values; every op here is row-wise,
so they never touch the live rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .fast_code2wav import BatchedCode2Wav

__all__ = ["DiTGraph", "EncoderGraph", "ENCODER_BUCKETS"]

ENCODER_BUCKETS = (1, 2, 4, 8, 16, 32)
"""Batch buckets of the captured encoder (a batch above 32 runs it eagerly)."""


def _capture(c2w: "BatchedCode2Wav", fn):
    """Warm ``fn`` up on a side stream, then capture it (:func:`.fast_kv.capture_graph`, private pool)."""
    from .fast_kv import capture_graph

    return capture_graph(fn, c2w.device)


class EncoderGraph:
    """Token embedding + ``UpsampleConformerEncoderV2.forward_chunk`` (non-final chunk) +
    ``encoder_proj`` for (Bb rows, T tokens, conformer caches of a given shape).

    Static inputs: tok int64 [Bb, T], cnn [Bb, C, 6], att [blocks, Bb, heads, L, 2 * head_dim].
    Outputs (views of static buffers): mu [B, 80, 2 (T - 3)], new cnn cache, new att cache.
    """

    def __init__(self, c2w: "BatchedCode2Wav", Bb: int, tok_shape, cnn_shape, att_shape) -> None:
        import torch

        flow = c2w.flow
        kw = dict(device=c2w.device, dtype=c2w.dtype)
        self.Bb = Bb
        self.tok = torch.full((Bb, tok_shape[1]), 4218, dtype=torch.long, device=c2w.device)
        self.cnn = torch.zeros(Bb, *cnn_shape[1:], **kw)
        self.att = torch.zeros(att_shape[0], Bb, *att_shape[2:], **kw)

        def fn():
            h, c_cnn, c_att = flow.encoder.forward_chunk(xs=flow.input_embedding(self.tok), last_chunk=False,
                                                         cnn_cache=self.cnn, att_cache=self.att)
            return flow.encoder_proj(h).transpose(1, 2).contiguous(), c_cnn, c_att

        with torch.inference_mode():
            self.graph, (self.mu, self.new_cnn, self.new_att) = _capture(c2w, fn)

    def run(self, tok, cnn, att):
        B = tok.shape[0]
        self.tok[:B].copy_(tok)
        self.cnn[:B].copy_(cnn)
        self.att[:, :B].copy_(att)
        self.graph.replay()
        return self.mu[:B], self.new_cnn[:B], self.new_att[:, :B]


class DiTGraph:
    """The 10-step Euler loop over the DiT for (Bb streams, T chunk frames, L cached frames)."""

    def __init__(self, c2w: "BatchedCode2Wav", Bb: int, T: int, L: int) -> None:
        torch = c2w.torch
        dec = c2w.flow.decoder
        kw = dict(device=c2w.device, dtype=c2w.dtype)
        n, depth, h, hd2 = c2w.n_timesteps, c2w._depth, c2w._heads, 2 * c2w._head_dim
        self.Bb = Bb
        self.x0 = torch.zeros(Bb, dec.out_channels, T, **kw)
        self.mu_in = torch.zeros(2 * Bb, dec.out_channels, T, **kw)
        self.spks_in = torch.zeros(2 * Bb, dec.out_channels, **kw)
        self.cond_in = torch.zeros(2 * Bb, dec.out_channels, T, **kw)
        self.cnn = torch.zeros(n, depth, 2 * Bb, c2w._conv_ch, 2, **kw)
        self.att = torch.zeros(n, depth, 2 * Bb, h, L, hd2, **kw)
        self.att_out = torch.empty(n, depth, 2 * Bb, h, L + T, hd2, **kw)
        self.cnn_out = torch.empty(n, depth, 2 * Bb, c2w._conv_ch, 2, **kw)
        args = (Bb, self.x0, self.mu_in, self.spks_in, self.cond_in, self.cnn, self.att, self.att_out, self.cnn_out)
        self.graph, (self.x, self.new_cnn, self.new_att) = _capture(c2w, lambda: c2w._euler(*args))

    def run(self, B: int, x0, mu_in, spks_in, cnn, att):
        import torch

        Bb = self.Bb
        self.x0[:B].copy_(x0)
        for dst, src, dim in ((self.mu_in, mu_in, 0), (self.spks_in, spks_in, 0), (self.cnn, cnn, 2), (self.att, att, 2)):
            dst.narrow(dim, 0, B).copy_(src.narrow(dim, 0, B))
            dst.narrow(dim, Bb, B).copy_(src.narrow(dim, B, B))
        self.graph.replay()
        x = self.x[:B]
        if B == Bb:
            return x, self.new_cnn, self.new_att
        sel = lambda t: torch.cat([t.narrow(2, 0, B), t.narrow(2, Bb, B)], dim=2)  # noqa: E731
        return x, sel(self.new_cnn), sel(self.new_att)
