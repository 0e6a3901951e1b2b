"""The fast thinker's Whisper streaming encoder: one batched pass per round for every stream, over a
static K/V pool, captured as CUDA graphs on CUDA.

Same function as :meth:`.audio_encoder.AudioEncoder.encode_stream` + the audio projector and 5x
pooling (:meth:`.thinker.Thinker.audio_embeds_stream`, the parity-checked per-stream path), laid out
so that streams at *different* unit indices share one pass. Sessions of a server start at different
times, so their Whisper caches have different lengths; a pass per cache length (what grouping by
length gives) meant one eager 24-layer pass per stream and round at real load, and every unit
re-copied each stream's whole cache with ``torch.cat``.

**Pool** (:class:`~.fast_kv.KVPool`, one per thinker): K and V of shape ``[layers, slots + 1,
P, heads, head_dim]`` in the thinker's dtype, with ``P`` = ``max_source_positions`` (1500 = 30 s)
rounded up to a multiple of 32 (1504; the 4 extra positions are never written and always masked),
slot ``slots`` the scratch slot of a graph's padding rows. Each stream owns one slot through
:class:`PooledWhisperCache` (a shared :class:`~.fast_kv.KVSlot` handle), taken at the stream's first
audio unit and given back when the stream closes (:meth:`.fast_thinker.FastThinker.close`) or, as a
last resort, when the stream's state is garbage-collected. Memory on the real model (24 layers,
16 heads x 64 = 1024): 24 x 1504 x 1024 x 2 (k, v) x 2 B = 147.8 MB per slot in bf16 (296 MB in
float32), plus one scratch slot; the pool grows by whole slots (``grow_by``, reallocating: the old
and new pool coexist during the copy) and never shrinks. ``nbytes()`` is reported beside the
thinker KV (``DuplexEngine.kv_usage()["thinker_audio"]``, ``benchmarks/gpu_engine.py``).

**Batching rule**: rows are grouped only by what changes shapes: the mel length and whether it is
the stream's first unit (the convolutions see 102 or 104 frames; unit 0 keeps its first output
frame, later units drop it). Each group runs the two convolutions eagerly; groups that end with the
same block length ``n`` (50 frames for every unit of :class:`.processor.StreamingMel`) are
concatenated and run through the 24 layers **once**. Row ``r`` at cache length ``p_r`` adds
``embed_positions[p_r : p_r + n]``, writes its block's K/V at positions ``p_r .. p_r + n - 1`` of its
slot and attends keys ``0 .. p_r + n - 1`` of its slot (the streaming path has no mask inside the
block: cached keys + the whole block), through an additive mask over a KV-length bucket of 256
positions (capped at ``P``). Reset rule as the reference: a row whose ``p_r + n`` would pass
``max_source_positions`` clears its cache first (``positions`` = 0, ``resets`` + 1), so its block
starts at position 0 and its stale keys are masked. ``stats["audio_passes"]`` counts layer passes.

**CUDA graphs** (when the thinker captures its decode steps): one graph per (batch bucket, block
length ``n``, KV-length bucket) over the layers, the final LayerNorm, the projector and the pooling;
the convolutions stay eager in front of it (their cuDNN plans are warmed by the thinker). Padding
rows write and read only the scratch slot. Graphs are captured into the thinker's graph pool with
:func:`~.fast_kv.capture_graph` and dropped when the pool grows (``KVPool.version``). Batches larger
than the largest bucket run eagerly. On the CPU the same function runs eagerly.

A stream's step that raises is undone by the thinker restoring ``positions`` / ``resets`` (a
shallow copy of the :class:`PooledWhisperCache`). Positions at or past the restored length that the
failed pass wrote are overwritten before they are read; when the failed pass had reset the cache
(overwriting positions ``0 .. n-1``), the retried unit resets again, because the reset decision
depends only on the restored length and the block length, which the restored mel state fixes. A
slot the failed step took (the stream's first audio unit) is given back as the stream gets its plain
cache back. A closed stream's audio is refused (``ValueError``): it never takes a new slot.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from . import sampling as S
from .audio_encoder import AudioEncoder, WhisperStreamCache
from .fast_kv import GraphCache, KVPool, KVSlot, bucket, capture_graph, kv_bucket

__all__ = ["BatchedWhisper", "PooledWhisperCache", "WHISPER_KV_BUCKET"]

WHISPER_KV_BUCKET = 256
"""KV-length bucket of the batched pass (positions); the last bucket is the pool's slot length."""

_ALIGN = 32


class PooledWhisperCache:
    """A stream's Whisper streaming cache held in a :class:`BatchedWhisper` pool slot.

    Attributes:
        handle: the :class:`~.fast_kv.KVSlot` owning the slot (shared by shallow copies).
        positions: cached positions (the next block starts here), 0 .. ``max_source_positions``.
        resets: times the cache was dropped at ``max_source_positions``.

    Has no per-layer ``keys`` / ``values`` lists: reading them raises ``TypeError`` (the per-stream
    :meth:`.audio_encoder.AudioEncoder.encode_stream` cannot run on it; the fast thinker's
    ``audio_embeds_stream`` does).
    """

    def __init__(self, handle: KVSlot, positions: int = 0, resets: int = 0) -> None:
        self.handle = handle
        self.positions = int(positions)
        self.resets = int(resets)

    @property
    def slot(self) -> Optional[int]:
        """The pool slot index (None once released)."""
        return self.handle.slot

    @property
    def keys(self):
        raise TypeError("this Whisper cache lives in the fast thinker's pool; encode it with "
                        "FastThinker.audio_embeds_stream, not AudioEncoder.encode_stream")

    values = keys

    def clear(self) -> None:
        """Drop the cached positions (the slot stays this stream's)."""
        self.positions = 0

    def release(self) -> None:
        """Give the slot back to the pool (idempotent)."""
        self.handle.release()


class _AudioGraph:
    """One captured batched pass for a (batch bucket B, block length n, KV length) key: conv output
    x [B, n, d] at start positions pos0 [B] into slots [B] -> pooled embeddings [B, n / pool, H]."""

    def __init__(self, bw: "BatchedWhisper", B: int, n: int, kv_len: int) -> None:
        dev = bw.device
        self.scratch = bw.pool.scratch
        self.x = torch.zeros(B, n, bw.d_model, dtype=bw.dtype, device=dev)
        self.pos0 = torch.zeros(B, dtype=torch.long, device=dev)
        self.slots = torch.full((B,), self.scratch, dtype=torch.long, device=dev)
        # two warm-up runs (they write only the scratch slot), then the capture
        self.graph, self.out = capture_graph(lambda: bw.forward(self.x, self.pos0, self.slots, kv_len), dev,
                                             pool=bw.graph_pool, warmup=2)

    def run(self, x: torch.Tensor, pos0: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        self.x[:b].copy_(x)
        self.pos0[:b].copy_(pos0)
        self.slots[:b].copy_(slots)
        if b < self.x.shape[0]:
            self.pos0[b:].zero_()
            self.slots[b:].fill_(self.scratch)
        self.graph.replay()
        return self.out[:b].clone()  # the static output is overwritten by the next replay


class BatchedWhisper:
    """The batched streaming Whisper pass of the fast thinker (see module doc).

    Args:
        encoder: the thinker's :class:`~.audio_encoder.AudioEncoder` (its ``apm`` weights are used
            as they are; ``max_positions`` is read at every pass).
        projector: the ``audio_projection_layer`` module (d_model -> hidden).
        pool_step: the average-pooling step (``audio_pool_step``, 5).
        dtype / device: the thinker's.
        slots: initial pool slots (0 allocates only the scratch slot); ``grow_by`` slots are added
            when a stream needs one and none is free.
        use_graphs: capture the pass as CUDA graphs (CUDA only).
        graph_pool: the graph memory pool shared with the thinker's other graphs.
        batch_buckets: the graph batch sizes (ascending).
        stats: the dict counting ``audio_passes`` and ``audio_graph_captures`` (the thinker's).
        max_slots: cap of the pool (:class:`~.fast_kv.KVPool` ``max_slots``; None: none).
    """

    def __init__(self, encoder: AudioEncoder, projector: torch.nn.Module, pool_step: int, *, dtype: torch.dtype,
                 device, slots: int = 4, grow_by: int = 8, use_graphs: bool = False, graph_pool=None,
                 batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), stats: Optional[dict] = None,
                 max_slots: Optional[int] = None) -> None:
        self.enc = encoder
        self.projector = projector
        self.pool_step = int(pool_step)
        self.dtype, self.device = dtype, torch.device(device)
        apm = encoder.apm
        self.d_model = apm.embed_positions.weight.shape[1]
        max_len = -(-encoder.max_positions // _ALIGN) * _ALIGN
        self.pool = KVPool(len(apm.layers), encoder.num_heads, encoder.head_dim, max_len, dtype=dtype,
                           device=self.device, slots=slots, grow_by=grow_by, max_slots=max_slots)
        self.use_graphs = bool(use_graphs)
        self.graph_pool = graph_pool
        self.batch_buckets = tuple(batch_buckets)
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("audio_passes", 0)
        self.stats.setdefault("audio_graph_captures", 0)
        self._graphs = GraphCache(self.pool, self.stats, "audio_graph_captures", lambda g: (g.x, g.pos0, g.slots))

    # ------------------------------------------------------------------ per-stream state
    def adopt(self, cache) -> PooledWhisperCache:
        """The pooled cache for a stream's ``whisper`` attribute: ``cache`` itself when it is one of
        this pool's, else a new slot holding a copy of a :class:`~.audio_encoder.WhisperStreamCache`'s
        cached keys/values, positions and reset count (a stream made by the reference path, or
        one that has not had audio yet). May grow the pool.

        Raises:
            ValueError: ``cache`` was released (its stream was closed) or belongs to another pool.
        """
        if isinstance(cache, PooledWhisperCache):
            if cache.handle.pool is not self.pool:
                raise ValueError("this Whisper cache belongs to another thinker's pool")
            if cache.slot is None:
                raise ValueError("this stream's Whisper cache was released (the stream is closed)")
            return cache
        if not isinstance(cache, WhisperStreamCache):
            raise TypeError(f"expected a WhisperStreamCache, got {type(cache).__name__}")
        if cache.positions > self.enc.max_positions:
            raise ValueError(f"Whisper cache of {cache.positions} positions exceeds {self.enc.max_positions}")
        new = PooledWhisperCache(KVSlot(self.pool), cache.positions, cache.resets)
        if cache.positions and cache.keys:
            s, p = new.slot, cache.positions
            for li, (k, v) in enumerate(zip(cache.keys, cache.values)):  # [1, heads, P, head_dim] each
                self.pool.k[li, s, :p] = k[0].transpose(0, 1).to(self.dtype)
                self.pool.v[li, s, :p] = v[0].transpose(0, 1).to(self.dtype)
        elif cache.positions:
            new.positions = 0  # positions without cached keys: nothing to attend to
        return new

    # ------------------------------------------------------------------ the batched pass
    def kv_bucket(self, need: int) -> int:
        """KV length attended by a pass whose longest row ends at ``need`` positions."""
        return kv_bucket(need, WHISPER_KV_BUCKET, self.pool.max_len)

    def kv_buckets(self) -> List[int]:
        """Every KV length :meth:`kv_bucket` can return (256, 512, ..., and the slot length)."""
        out = list(range(WHISPER_KV_BUCKET, self.pool.max_len, WHISPER_KV_BUCKET))
        return out + [self.pool.max_len]

    @torch.inference_mode()
    def encode(self, caches: List[PooledWhisperCache], mels: List[np.ndarray],
               firsts: List[bool]) -> List[torch.Tensor]:
        """One unit for each row: float32 mel blocks [80, T_r] (T = 102 for a stream's unit 0, 104
        after) with ``firsts[r]`` True for unit 0 -> the unit's audio embeddings [n / pool_step, H]
        per row (model dtype; 10 x H for a 1-s unit). Advances each cache (resetting it at
        ``max_source_positions``, module doc). One layer pass per distinct block length (one for
        every round of :class:`.processor.StreamingMel` units).

        Raises:
            ValueError: a block longer than ``max_source_positions`` frames, or lengths that differ.
        """
        if not (len(caches) == len(mels) == len(firsts)):
            raise ValueError("caches, mels and firsts must have the same length")
        enc = self.enc
        maxp = enc.max_positions
        if maxp > self.pool.max_len:
            raise ValueError(f"encoder max_positions {maxp} exceeds the pool's {self.pool.max_len} positions")
        groups: Dict[tuple, List[int]] = {}
        for r, (mel, first) in enumerate(zip(mels, firsts)):
            groups.setdefault((bool(first), tuple(np.shape(mel))), []).append(r)
        by_n: Dict[int, list] = {}
        for (first, _shape), rows in groups.items():
            mel = S.device_tensor(np.stack([mels[r] for r in rows]), self.device).to(self.dtype)  # no host sync
            x = enc.stream_frames(mel, first)
            by_n.setdefault(x.shape[1], []).append((rows, x))
        out: List[Optional[torch.Tensor]] = [None] * len(mels)
        for n, parts in by_n.items():
            if n > maxp:
                raise ValueError(f"audio block of {n} encoder frames exceeds {maxp} positions")
            rows = [r for rs, _ in parts for r in rs]
            x = parts[0][1] if len(parts) == 1 else torch.cat([x for _, x in parts])
            pos0 = [enc.stream_start(caches[r], n) for r in rows]
            idx = S.device_tensor([pos0, [caches[r].slot for r in rows]], self.device, torch.long)
            y = self._run(x, idx[0], idx[1], self.kv_bucket(max(pos0) + n))
            for b, r in enumerate(rows):
                caches[r].positions = pos0[b] + n
                out[r] = y[b]
            self.stats["audio_passes"] += 1
        return out

    def _run(self, x: torch.Tensor, pos0: torch.Tensor, slots: torch.Tensor, kv_len: int) -> torch.Tensor:
        B = x.shape[0]
        if self.use_graphs and B <= self.batch_buckets[-1]:
            return self._graph(bucket(B, self.batch_buckets), x.shape[1], kv_len).run(x, pos0, slots)
        return self.forward(x, pos0, slots, kv_len)

    def forward(self, x: torch.Tensor, pos0: torch.Tensor, slots: torch.Tensor, kv_len: int) -> torch.Tensor:
        """The pass itself (eager; what the graphs capture). ``x`` [B, n, d_model] conv output
        (model dtype), ``pos0`` int64 [B] each row's first position (``pos0 + n`` <= ``kv_len``),
        ``slots`` int64 [B] pool slots -> pooled audio embeddings [B, n / pool_step, H]. Writes each
        row's K/V at ``pos0 .. pos0 + n - 1`` of its slot. No host sync."""
        enc, pool = self.enc, self.pool
        apm = enc.apm
        B, n, _ = x.shape
        H, D = enc.num_heads, enc.head_dim
        pos = pos0[:, None] + torch.arange(n, device=x.device)[None]  # [B, n]
        h = x + apm.embed_positions.weight[pos]
        j = torch.arange(kv_len, device=x.device)
        hidden = j[None, :] >= (pos0 + n)[:, None]  # [B, L]: keys past the row's block
        bias = torch.zeros(B, 1, 1, kv_len, dtype=x.dtype, device=x.device).masked_fill(
            hidden[:, None, None, :], float("-inf"))
        idx_s = slots[:, None].expand(B, n)
        for li, layer in enumerate(apm.layers):
            sa = layer.self_attn
            r = h
            hn = layer.self_attn_layer_norm(h)
            q = (sa.q_proj(hn) * sa.scaling).view(B, n, H, D).transpose(1, 2)
            pool.k[li].index_put_((idx_s, pos), sa.k_proj(hn).view(B, n, H, D))
            pool.v[li].index_put_((idx_s, pos), sa.v_proj(hn).view(B, n, H, D))
            K = pool.k[li][:, :kv_len].index_select(0, slots).transpose(1, 2)  # [B, H, L, D]
            V = pool.v[li][:, :kv_len].index_select(0, slots).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=bias, scale=1.0)
            h = enc._mlp(layer, r + sa.out_proj(o.transpose(1, 2).reshape(B, n, H * D)))
        h = apm.layer_norm(h)
        p = self.projector(h)  # [B, n, hidden]
        k = self.pool_step
        return F.avg_pool1d(p.transpose(1, 2), kernel_size=k, stride=k).transpose(1, 2)

    # ------------------------------------------------------------------ graphs
    def _graph(self, B: int, n: int, kv_len: int) -> _AudioGraph:
        return self._graphs.get_or_build((B, n, kv_len), lambda: _AudioGraph(self, B, n, kv_len))

    def warmup(self, batch_sizes) -> int:
        """Capture the graphs of every batch bucket of ``batch_sizes`` x every KV-length bucket
        (:meth:`kv_buckets`: 6 for 1500 positions) at the 1-s block length (``block_frames``, 50):
        e.g. 36 graphs for batch sizes 1..32. Every stream passes through every KV bucket in its
        first 30 s, so all of them are met. Returns the number captured (0 without graphs)."""
        if not self.use_graphs:
            return 0
        n0 = self.stats["audio_graph_captures"]
        with torch.inference_mode():
            for B in sorted({bucket(int(b), self.batch_buckets) for b in batch_sizes}):
                for L in self.kv_buckets():
                    self._graph(B, self.enc.block_frames, L)
        return self.stats["audio_graph_captures"] - n0

    def nbytes(self) -> int:
        """Bytes of the pool's K and V storage."""
        return self.pool.nbytes()
