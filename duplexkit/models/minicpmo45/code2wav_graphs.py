"""CUDA graphs of the batched Code2Wav flow (:mod:`.fast_code2wav`): the conformer encoder of a
chunk and the 10-step Euler loop over the DiT, each captured per static shape with its own input and
output buffers (the style of :mod:`.fast_talker`: ``torch.cuda.CUDAGraph`` over preallocated
tensors, replayed after copying the live rows in). CUDA only; the CPU path runs the same calls eagerly.

A graph's outputs are its static buffers: callers copy what they keep before the next replay.
Rows past the live batch (bucket padding) hold stale but finite values; every op here is row-wise,
so they never touch the live rows.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Optional, Protocol, Sequence, Tuple

import numpy as np

from ...errors import detach_traceback
from ...units import SILENCE_CODE
from .code2wav import CHUNK_CODES

__all__ = ["DiTGraph", "EncoderGraph", "ENCODER_BUCKETS", "GRAPH_MAX_BATCH", "GraphHost", "GraphSetup",
           "HIFT_BUCKETS", "gather_caches"]

ENCODER_BUCKETS = (1, 2, 4, 8, 16, 32)
"""Batch buckets of the captured encoder (a batch above 32 runs it eagerly)."""

HIFT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Row counts HiFT calls are padded to on CUDA (a bigger call runs unpadded)."""


GRAPH_MAX_BATCH = 16
"""The default :attr:`BatchedCode2Wav.graph_rows`: flow calls of at most this many streams replay a
captured Euler-loop graph on CUDA (bigger groups run as sub-batches of this size). The graphs share
one scratch sized for this many rows (fp32 attention caches of every DiT step and block, read and
written in place: 10.09 GiB at 16 rows at real size, 5.05 at 8, 20.18 at 32). Measured on an H200 at
real size (benchmarks/results/2026-12-02-code2wav-in-place-h200.md, ``code2wav_batch.py --graph-rows``, one call): a 32-stream
round takes 282 ms with 8 rows, 215 with 16, 208 with 32 (before the in-place caches: 362 with 8
rows); an 8-stream round 92-100 ms at any of them; the audio of 32 rows is within 2.8e-5 (75.5 dB) of
16 rows'. 32 rows take 32 streams' unit p90 from 426 to 415 ms in the engine, but 48 streams then run
out of memory (they fit with 16), so 16 is the default.
``DUPLEXKIT_CODE2WAV_GRAPH_ROWS`` overrides it (1, 2, 4, 8, 16 or 32)."""


class GraphHost(Protocol):
    """What the graphs read of the batched Code2Wav (:class:`~.fast_code2wav.BatchedCode2Wav`): a
    structural type, so this module needs no import of the wrapper (which imports it)."""

    flow: Any
    device: Any
    dtype: Any
    _graph_pools: Dict[str, Any]

    def dit_scratch(self, role: str, rows: int, frames: int) -> Any: ...
    def _euler(self, B: int, x: Any, mu_in: Any, spks_in: Any, cond_in: Any, cnn: Any, kv: Any,
               cnn_out: Any) -> Any: ...


def _graph_rows(rows: Optional[int]) -> int:
    """The Euler-loop graph rows: ``rows``, else ``DUPLEXKIT_CODE2WAV_GRAPH_ROWS``, else
    :data:`GRAPH_MAX_BATCH`.

    Raises:
        ValueError: not a power of two from 1 to 32 (naming the variable when it came from there)."""
    source = "Code2Wav graph rows"
    if rows is None:
        env = os.environ.get("DUPLEXKIT_CODE2WAV_GRAPH_ROWS", "").strip()
        source = "DUPLEXKIT_CODE2WAV_GRAPH_ROWS"
        try:
            rows = int(env) if env else GRAPH_MAX_BATCH
        except ValueError:
            raise ValueError(f"{source} must be 1, 2, 4, 8, 16 or 32, got {env!r}") from None
    if rows not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"{source} must be 1, 2, 4, 8, 16 or 32, got {rows!r}")
    return int(rows)


def gather_caches(caches: Sequence[dict], cnn, kv, Bb: int, T: int) -> None:
    """Copy the estimator caches of streams ``caches`` (each: att [n, depth, 2, h, L, 2hd], cnn [n,
    depth, 2, C, 2], CFG rows conditional first) into an Euler loop's buffers: stream j's rows go to
    rows j and ``Bb + j`` of ``cnn`` [n, depth, 2Bb, C, 2] and, at frames ``T:``, of ``kv`` [n, depth,
    2Bb, h, T + L, 2hd] (the new frames' place ``:T`` is written by the loop). A cache of another
    dtype than ``kv`` (a voice's float32 base cache into float16 buffers) is cast as it is copied."""
    for j, c in enumerate(caches):
        att, conv = c["estimator_att_cache"], c["estimator_cnn_cache"]
        for r, row in enumerate((j, Bb + j)):
            kv[:, :, row, :, T:].copy_(att[:, :, r])
            cnn[:, :, row].copy_(conv[:, :, r])


def _capture(c2w: "GraphHost", fn, pool: str):
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

    def __init__(self, c2w: "GraphHost", Bb: int, tok_shape, cnn_shape, att_shape) -> None:
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

    def __init__(self, c2w: "GraphHost", Bb: int, T: int, L: int) -> None:
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
        """Replay for the B <= Bb streams of ``caches`` (:func:`gather_caches`); ``mu_in``
        and ``spks_in`` hold 2B CFG rows. Returns (x [B, 80, T], cnn_out, kv): scratch views with
        stream j at rows j and Bb + j of the last two."""
        Bb = self.Bb
        self.x0[:B].copy_(x0)
        for dst, src in ((self.mu_in, mu_in), (self.spks_in, spks_in)):
            dst[:B].copy_(src[:B])
            dst[Bb:Bb + B].copy_(src[B:2 * B])
        gather_caches(caches, self.cnn, self.kv, Bb, self.T)
        self.graph.replay()
        return self.x[:B], self.cnn_out, self.kv


class GraphSetup:
    """The static buffers the Euler-loop graphs share and the start-up warm-up that captures the
    graphs: a mixin of :class:`~.fast_code2wav.BatchedCode2Wav` (it reads ``_scratch``,
    ``_scratch_capacity``, ``_dit_graphs``, ``graph_rows``, ``att_cache_dtype``, ``stats`` and the
    :class:`~.code2wav.Code2Wav` attributes, and calls ``push_batch``)."""

    @staticmethod
    def warmup_sizes(max_streams: int) -> tuple:
        """The batch sizes :meth:`warmup` should run for rounds of up to ``max_streams`` streams: every
        :data:`HIFT_BUCKETS` row count up to the first one >= ``max_streams`` (HiFT calls are padded
        to these; the encoder graphs use the same buckets up to 32), the last one as ``max_streams``
        streams (padded to that bucket, as a real round of that many is: no memory for streams that
        cannot exist)."""
        n = max(1, int(max_streams))
        return tuple(min(b, n) for b in HIFT_BUCKETS if b < 2 * n)

    def warmup(self, batch_sizes=(1, 2, 4), chunks: int = 3, ref_voice: Any = None) -> int:
        """Capture the encoder and Euler-loop graphs (and tune HiFT's conv plans) for the default voice
        at these batch sizes now (engine start-up): ``chunks`` chunks of silence codes per size cover
        the growing-then-trimmed cache shapes. Returns the number of graphs captured.

        Run it on the thread that will call :meth:`push_batch` (the engine's Code2Wav worker:
        cuDNN's autotuned plans are kept per thread). A size whose chunks fail (out of GPU memory,
        say) is logged as a warning and the larger sizes are skipped: the engine still starts, and
        rounds of that size run on untuned plans or fail when they come."""

        def captured():
            return self.stats.get("dit_graph_captures", 0) + self.stats.get("encoder_graph_captures", 0)

        n0 = captured()
        codes = np.full(CHUNK_CODES, SILENCE_CODE, np.int64)
        self._tuning = True
        try:
            self._warm_sizes(batch_sizes, chunks, ref_voice, codes)
        finally:
            self._tuning = False
        return captured() - n0

    def _warm_sizes(self, batch_sizes, chunks: int, ref_voice: Any, codes) -> None:
        """:meth:`warmup`'s chunks: ``chunks`` pushes of ``codes`` for each batch size."""
        import logging
        from types import SimpleNamespace

        for B in batch_sizes:
            sts = []
            failed = None
            try:
                for k in range(B):
                    sts.append(self.new_stream(ref_voice, seed=k))
                for _ in range(chunks):
                    out = self.push_batch([SimpleNamespace(handle=st, codes=codes, last=False) for st in sts])
                    failed = next((r for r in out if isinstance(r, BaseException)), None)
                    del out
                    if failed is not None:
                        break
            except Exception as exc:  # noqa: BLE001 - out of memory opening streams, say: same as a failed chunk
                failed = detach_traceback(exc)
            finally:
                for st in sts:
                    self.close(st)
                del sts
            if failed is not None:
                logging.getLogger("duplexkit.code2wav").warning(
                    "code2wav warm-up stopped at %d streams: %s: %s", B, type(failed).__name__, failed)
                break

    def _scratch_view(self, role: str, shape: Tuple[int, ...], min_numel: int = 0, dtype=None):
        """A contiguous view with ``shape`` of the flat scratch buffer ``role`` (zero-filled when made),
        of ``dtype`` (default: the flow's).

        The buffers are sized at the current frame capacity; a buffer is made with at least
        ``min_numel`` elements (a role of the captured graphs: its size for :attr:`graph_rows`
        streams, so that no graph's view outgrows it). A capacity change (a voice with a longer prompt) or a request larger than the buffer
        makes a new buffer and drops the Euler-loop graphs (they point at the old one); so does a
        request in another dtype (:attr:`att_cache_dtype` changed)."""
        torch = self.torch
        dtype = dtype or self.dtype
        if self._scratch_capacity != self._capacity:
            self._scratch.clear()
            self._dit_graphs.clear()
            self._scratch_capacity = self._capacity
        n = math.prod(shape)
        flat = self._scratch.get(role)
        if flat is None or flat.numel() < n or flat.dtype != dtype:
            if flat is not None and not role.endswith("/eager"):  # eager buffers feed no graph
                self._dit_graphs.clear()
            flat = None  # the old buffer goes before the new one is made
            self._scratch.pop(role, None)
            flat = torch.zeros(max(n, min_numel), device=self.device, dtype=dtype)
            self._scratch[role] = flat
        return flat[:n].view(*shape)

    def scratch_bytes(self) -> int:
        """Bytes of the shared flat scratch buffers (graph inputs, outputs and DiT caches)."""
        return sum(t.numel() * t.element_size() for t in self._scratch.values())

    def dit_scratch(self, role: str, rows: int, frames: int):
        """The Euler loop's buffer ``role`` for ``rows`` streams (2 x rows CFG rows) and ``frames`` time
        frames (``x0``: [B, 80, T]; ``mu_in``, ``cond_in``: [2B, 80, T]; ``spks_in``: [2B, 80]; ``cnn``,
        ``cnn_out``: [n, depth, 2B, C, 2]; ``kv``: [n, depth, 2B, h, F, 2hd] with F = ``frames``, the
        per-step attention caches the DiT reads and writes in place, see :meth:`_euler`, in
        :attr:`att_cache_dtype`; the rest in the flow's dtype). Rows up to
        :attr:`graph_rows` share one buffer with the graphs; more rows (eager calls) use a second one,
        grown as needed."""
        dec = self.flow.decoder
        n, depth, h, hd2, C = self.n_timesteps, self._depth, self._heads, 2 * self._head_dim, dec.out_channels
        cap = self._capacity
        shapes = {
            "x0": lambda B, T: (B, C, T),
            "mu_in": lambda B, T: (2 * B, C, T),
            "cond_in": lambda B, T: (2 * B, C, T),
            "spks_in": lambda B, T: (2 * B, C),
            "cnn": lambda B, T: (n, depth, 2 * B, self._conv_ch, 2),
            "cnn_out": lambda B, T: (n, depth, 2 * B, self._conv_ch, 2),
            "kv": lambda B, T: (n, depth, 2 * B, h, T, hd2),
        }[role]
        dtype = self.att_cache_dtype if role == "kv" else self.dtype
        if rows <= self.graph_rows:
            return self._scratch_view(role, shapes(rows, frames), min_numel=math.prod(shapes(self.graph_rows, cap)),
                                      dtype=dtype)
        return self._scratch_view(role + "/eager", shapes(rows, frames), dtype=dtype)
