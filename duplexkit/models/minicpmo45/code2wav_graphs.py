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

from duplexkit.engine.api import SILENCE_CODE

if TYPE_CHECKING:  # pragma: no cover
    from .fast_code2wav import BatchedCode2Wav

__all__ = ["DiTGraph", "EncoderGraph", "ENCODER_BUCKETS"]

ENCODER_BUCKETS = (1, 2, 4, 8, 16, 32)
"""Batch buckets of the captured encoder (a batch above 32 runs it eagerly)."""


def _capture(c2w: "BatchedCode2Wav", fn, pool: str):
    """Warm ``fn`` up on a side stream, then capture it (:func:`.fast_kv.capture_graph`) into the
    Code2Wav's memory pool ``pool`` ("encoder" or "dit", one each: graphs of one pool replay one at a
    time and their outputs are copied before the next replay of that pool)."""
    import torch

    from .fast_kv import capture_graph

    handle = c2w._graph_pools.get(pool)
    if handle is None:
        handle = c2w._graph_pools[pool] = torch.cuda.graph_pool_handle()
    return capture_graph(fn, c2w.device, pool=handle)


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
        self.tok = torch.full((Bb, tok_shape[1]), SILENCE_CODE, dtype=torch.long, device=c2w.device)
        self.cnn = torch.zeros(Bb, *cnn_shape[1:], **kw)
        self.att = torch.zeros(att_shape[0], Bb, *att_shape[2:], **kw)

        def fn():
            h, c_cnn, c_att = flow.encoder.forward_chunk(xs=flow.input_embedding(self.tok), last_chunk=False,
                                                         cnn_cache=self.cnn, att_cache=self.att)
            return flow.encoder_proj(h).transpose(1, 2).contiguous(), c_cnn, c_att

        with torch.inference_mode():
            self.graph, (self.mu, self.new_cnn, self.new_att) = _capture(c2w, fn, "encoder")

    def run(self, tok, cnn, att):
        B = tok.shape[0]
        self.tok[:B].copy_(tok)
        self.cnn[:B].copy_(cnn)
        self.att[:, :B].copy_(att)
        self.graph.replay()
        return self.mu[:B], self.new_cnn[:B], self.new_att[:, :B]


class DiTGraph:
    """The 10-step Euler loop over the DiT for (Bb streams, T chunk frames, L cached frames).

    Its static buffers are views of the Code2Wav's shared scratch (:meth:`BatchedCode2Wav.dit_scratch`),
    which every Euler-loop graph uses: ``run`` copies the live rows in, replays, and returns views
    the caller copies before the next replay of any of them. The attention caches are one buffer,
    read and written in place (:meth:`BatchedCode2Wav._euler`)."""

    def __init__(self, c2w: "BatchedCode2Wav", Bb: int, T: int, L: int) -> None:
        buf = c2w.dit_scratch
        self.Bb, self.T = Bb, T
        self.x0, self.mu_in, self.cond_in = buf("x0", Bb, T), buf("mu_in", Bb, T), buf("cond_in", Bb, T)
        self.spks_in = buf("spks_in", Bb, 0)
        self.cnn, self.cnn_out = buf("cnn", Bb, 0), buf("cnn_out", Bb, 0)
        self.kv = buf("kv", Bb, T + L)
        self.cond_in.zero_()  # read, never written (the package's zero conditioning)
        args = (Bb, self.x0, self.mu_in, self.spks_in, self.cond_in, self.cnn, self.kv, self.cnn_out)
        self.graph, self.x = _capture(c2w, lambda: c2w._euler(*args), "dit")

    def run(self, B: int, x0, mu_in, spks_in, caches):
        """Replay for the B <= Bb streams of ``caches`` (:func:`.fast_code2wav.gather_caches`); ``mu_in``
        and ``spks_in`` hold 2B CFG rows. Returns (x [B, 80, T], cnn_out, kv): scratch views with
        stream j at rows j and Bb + j of the last two."""
        from .fast_code2wav import gather_caches

        Bb = self.Bb
        self.x0[:B].copy_(x0)
        for dst, src in ((self.mu_in, mu_in), (self.spks_in, spks_in)):
            dst[:B].copy_(src[:B])
            dst[Bb:Bb + B].copy_(src[B:2 * B])
        gather_caches(caches, self.cnn, self.kv, Bb, self.T)
        self.graph.replay()
        return self.x[:B], self.cnn_out, self.kv
