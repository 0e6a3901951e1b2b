"""The batched thinker: static KV slots, one batched decode step per token for all streams,
CUDA-graph-captured decode steps and sampling on the GPU (one host sync per decode step).

:class:`FastThinker` is a :class:`~.thinker.Thinker` (same public API, docs/model.md) whose
``step_units`` runs every stream of the batch together:

1. **Prefill** (per unit): the Whisper streaming encode of every stream in one batched pass
   (:mod:`.fast_whisper`: a static Whisper K/V pool with a slot per stream, per-row positions, so
   streams at different unit indices share the pass; a CUDA graph per (batch bucket, block length,
   KV-length bucket) on CUDA), then one batched LLM forward over ``[pending terminator, </unit>]
   <unit> [image] 10 audio`` of all streams (rows padded to the longest), writing into each
   stream's KV slot.
2. **Decode** (lock step over j = 0..budget−1): the unit loop of :mod:`.duplex` (``decode_rows``:
   the one decision rule ``plan_step`` / ``decide`` per row, the boundary and main passes of
   ``choose_tokens`` over all rows at once with the samplers of :mod:`.sampling`, Gumbel-max with each
   stream's own generator, one ``.tolist()`` of the chosen ids per step), then one batched decode step
   for the streams that go on. On CUDA that step is a captured CUDA graph per (batch bucket
   1/2/4/8/16/32, KV-length bucket of 256 positions).

   **One-step lookahead** (``lookahead``, default on CUDA, ``DUPLEXKIT_THINKER_LOOKAHEAD=0`` off): the
   step's choices are computed on the device, their copy to pinned host memory is started with an
   event, and the next decode step is launched at once with every row's main-pass choice; the host
   then waits on the event only, runs the policy, and keeps the launched step when every row that
   goes on was fed what was launched and the step's graph key (batch bucket, KV-length bucket) is
   the one the plain step would use (:class:`_Speculation`), else runs the plain step over the same
   positions. The GPU runs that forward while the host reads the choices and decides.
   ``stats["lookahead_hits"]`` / ``["lookahead_misses"]`` count kept / discarded launches.

The eager :func:`.duplex.run_unit` runs the same loop with one row, so greedy decoding gives the same
ids as the reference path, and seeded sampling the same ids on the CPU (tests/model/test_fast_paths.py;
on CUDA the stream's generator is a device generator seeded like its CPU one, another random stream).
The stream prefix (``new_stream``) is prefilled by the same batched forward.

KV capacity: ``max_len`` positions per stream (default 8192, about 10 minutes of audio-only
duplex at ≥ 780 positions/min, docs/model.md §10). The sliding window (``DuplexPolicy.window_high``)
drops old units as on the eager path; a unit that still would not fit (window off) fails that stream
with :class:`~.fast_kv.ContextFullError`.
"""

from __future__ import annotations

import copy
import time
from typing import List, Optional, Tuple

import numpy as np
import torch

from ...errors import detach_traceback
from . import sampling as S
from .audio_encoder import WhisperStreamCache
from .duplex import UnitInput, begin_row, decode_rows, finish_row
from .fast_kv import (ContextFullError, KVPool, KVSlot, bucket, capture_graph, cuda_graphs_enabled, decoder_forward,
                      GraphCache, env_switch, fuse_projections, kv_bucket, reserve_for_warmup)
from .fast_whisper import BatchedWhisper, PooledWhisperCache
from .thinker import Thinker, ThinkerStream

__all__ = ["FastThinker", "StaticKV", "BATCH_BUCKETS", "LOOKAHEAD_ENV", "lookahead_enabled"]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
KV_BUCKET = 256
PREFILL_TOKENS = 16
"""Unit prefills of at most this many positions (audio-only units: 11-13) run as a captured graph."""


LOOKAHEAD_ENV = "DUPLEXKIT_THINKER_LOOKAHEAD"


def lookahead_enabled(device, value: Optional[str] = None) -> bool:
    """Whether the fast thinker runs its decode with the one-step lookahead (module doc).

    Args:
        device: the thinker's ``torch.device`` (or string); the default when the setting is unset or
            empty is on for CUDA and off otherwise.
        value: the setting to parse (default: ``DUPLEXKIT_THINKER_LOOKAHEAD``).

    Returns:
        True for ``1`` / ``true`` / ``on`` / ``yes``, False for ``0`` / ``false`` / ``off`` / ``no``
        (case-insensitive), the device default when unset or empty.

    Raises:
        ValueError: any other value (a typo should not silently measure the wrong configuration).
    """
    return env_switch(LOOKAHEAD_ENV, torch.device(device).type == "cuda", value)


class StaticKV(KVSlot):
    """A stream's KV handle: a slot of the thinker's :class:`KVPool` (:class:`~.fast_kv.KVSlot`:
    ``release()`` gives it back) and its valid length."""

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length


class _StepGraph:
    """One captured LLM forward for a (batch, tokens, kv_len) bucket: embeddings [B, T, H] at
    positions [B, T] into slots [B] -> final-norm hidden [B, T, H] (+ float32 logits when T = 1)."""

    def __init__(self, th: "FastThinker", B: int, T: int, kv_len: int) -> None:
        dev = th.device
        self.scratch = th.pool.scratch
        self.x = torch.zeros(B, T, th.hidden_size, dtype=th.dtype, device=dev)
        self.pos = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.pos.copy_(torch.arange(T, device=dev)[None])
        self.slots = torch.full((B,), self.scratch, dtype=torch.long, device=dev)
        # two warm-up runs (they write only the scratch slot), then the capture
        self.graph, (self.h, self.logits) = capture_graph(
            lambda: th._forward_eager(self.x, self.pos, self.slots, kv_len), dev, pool=th.graph_pool, warmup=2)

    def run(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor):
        n, t = x.shape[0], x.shape[1]
        self.x[:n, :t].copy_(x)
        self.pos[:n, :t].copy_(pos)
        if t < self.x.shape[1]:  # pad tokens: positions after the row's last (overwritten later, never read)
            self.pos[:n, t:] = pos[:, -1:] + torch.arange(1, self.x.shape[1] - t + 1, device=pos.device)[None]
        self.slots[:n].copy_(slots)
        if n < self.x.shape[0]:
            self.slots[n:].fill_(self.scratch)
            self.pos[n:].copy_(torch.arange(self.x.shape[1], device=pos.device)[None])
        self.graph.replay()
        return self.h[:n, :t], (None if self.logits is None else self.logits[:n])


def audio_conv_shapes(batch_sizes) -> List[Tuple[int, int, int]]:
    """The mel batches [B, 80, T] the thinker's audio encoder meets: every batch size B of
    ``batch_sizes`` with the unit-0 and the later units' block length T of
    :class:`~.processor.StreamingMel` (102 and 104 frames)."""
    from .processor import FIRST_UNIT_WINDOW, UNIT_SAMPLES, StreamingMel

    mel = StreamingMel()
    frames = sorted({mel.push(np.zeros(FIRST_UNIT_WINDOW, np.float32)).shape[1],
                     mel.push(np.zeros(UNIT_SAMPLES, np.float32)).shape[1]})
    return [(B, 80, T) for B in sorted({int(b) for b in batch_sizes}) for T in frames]


class FastThinker(Thinker):
    """Batched :class:`Thinker` (see module doc). ``batched = True`` tells the engine to hand it
    the whole batch in one ``step_units`` call.

    Args (besides the :class:`Thinker` ones):
        max_len: KV positions per stream (default 8192).
        slots: initial KV slots (grows by 8 when exhausted).
        cuda_graphs: capture decode steps (default: on CUDA unless ``DUPLEXKIT_CUDA_GRAPHS=0``).
        lookahead: one-step lookahead in the decode loop (module doc; default
            :func:`lookahead_enabled`: on CUDA unless ``DUPLEXKIT_THINKER_LOOKAHEAD=0``). The
            attribute ``lookahead`` may be changed between ``step_units`` calls.
        whisper_slots: initial slots of the Whisper K/V pool (:mod:`.fast_whisper`; default
            ``slots``; 147.8 MB each in bf16 on the real model; grows by 8 when exhausted). Taken
            at a stream's first audio unit, given back by :meth:`close`.
        max_slots: cap of both pools (a memory plan's stream slots, :mod:`duplexkit.engine.memory_plan`):
            a stream beyond it fails with :class:`~.fast_kv.KVCapacityError` instead of growing them.
            None: no cap.

    Attributes:
        audio_batch: the :class:`~.fast_whisper.BatchedWhisper` (None without an audio encoder).
        whisper_pool: its :class:`~.fast_kv.KVPool` (None without an audio encoder).
        stats: counters: ``graph_captures`` / ``decode_steps`` / ``lookahead_hits`` /
            ``lookahead_misses`` (LLM), ``audio_passes`` (batched Whisper layer passes: one per
            round) and ``audio_graph_captures``.
    """

    batched = True

    def __init__(self, modules, config, tokenizer, special, device="cpu", dtype=torch.float32, *,
                 max_len: int = 8192, slots: int = 4, cuda_graphs: Optional[bool] = None,
                 lookahead: Optional[bool] = None, whisper_slots: Optional[int] = None,
                 max_slots: Optional[int] = None) -> None:
        super().__init__(modules, config, tokenizer, special, device=device, dtype=dtype)
        lm = modules.llm.model
        fuse_projections(lm)
        a0 = lm.layers[0].self_attn
        self.pool = KVPool(len(lm.layers), config.num_key_value_heads, a0.head_dim, max_len, dtype=dtype,
                           device=self.device, slots=slots, max_slots=max_slots)
        self.use_graphs = cuda_graphs_enabled(self.device) if cuda_graphs is None else bool(cuda_graphs)
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.lookahead = lookahead_enabled(self.device) if lookahead is None else bool(lookahead)
        self.stats = {"graph_captures": 0, "decode_steps": 0, "lookahead_hits": 0, "lookahead_misses": 0,
                      "audio_passes": 0, "audio_graph_captures": 0}
        self._graphs = GraphCache(self.pool, self.stats, "graph_captures", lambda g: (g.x, g.pos, g.slots))
        self.audio_batch: Optional[BatchedWhisper] = None
        if self.audio is not None:
            self.audio_batch = BatchedWhisper(
                self.audio, modules.audio_projection_layer, config.audio_pool_step, dtype=dtype, device=self.device,
                slots=slots if whisper_slots is None else whisper_slots, use_graphs=self.use_graphs,
                graph_pool=self.graph_pool, batch_buckets=BATCH_BUCKETS, stats=self.stats, max_slots=max_slots)

    @property
    def whisper_pool(self) -> Optional[KVPool]:
        """The Whisper K/V pool (:mod:`.fast_whisper`), None without an audio encoder."""
        return None if self.audio_batch is None else self.audio_batch.pool

    @classmethod
    def from_thinker(cls, th: Thinker, **kw) -> "FastThinker":
        """Wrap an existing thinker's modules (weights shared)."""
        ft = cls(th.m, th.config, th.tokenizer, th.special, device=th.device, dtype=th.dtype, **kw)
        ft.policy_defaults = dict(th.policy_defaults)
        return ft

    # ------------------------------------------------------------------ KV
    def _stream_cache(self):
        return StaticKV(self.pool)

    def forward_embeds(self, embeds: torch.Tensor, kv) -> torch.Tensor:
        if not isinstance(kv, StaticKV):
            return super().forward_embeds(embeds, kv)
        return self._prefill([kv], [embeds])[0]

    def _drop_kv_range(self, kv, lo: int, hi: int) -> None:
        """The sliding window on a static slot: positions ``[lo, hi)`` removed, the keys after ``hi``
        re-rotated by ``−(hi − lo)`` and moved down (as :meth:`Thinker._drop_kv_range`)."""
        if not isinstance(kv, StaticKV):
            return super()._drop_kv_range(kv, lo, hi)
        from .thinker import rerotate_keys

        n, s = kv.length, kv.slot
        inv_freq = self.m.llm.model.rotary_emb.inv_freq
        k_tail = rerotate_keys(self.pool.k[:, s, hi:n].transpose(1, 2), lo - hi, inv_freq).transpose(1, 2)
        v_tail = self.pool.v[:, s, hi:n].clone()
        self.pool.k[:, s, lo:lo + (n - hi)] = k_tail
        self.pool.v[:, s, lo:lo + (n - hi)] = v_tail
        kv.length = n - (hi - lo)

    def close(self, st: ThinkerStream) -> None:
        """:meth:`Thinker.close`, also giving back the stream's LLM KV slot and Whisper pool slot."""
        if isinstance(st.kv, StaticKV):
            st.kv.release()
        if isinstance(st.whisper, PooledWhisperCache):
            st.whisper.release()
            st.whisper = WhisperStreamCache(resets=st.whisper.resets)
        super().close(st)

    def _prefill(self, kvs: List[StaticKV], embeds: List[torch.Tensor]) -> List[torch.Tensor]:
        """Batched forward of per-row embeddings [T_b, H] appended to each row's KV; returns the
        final-norm hidden states [T_b, H] per row and advances the lengths."""
        B = len(kvs)
        T = max(e.shape[0] for e in embeds)
        H = self.hidden_size
        for kv, e in zip(kvs, embeds):
            if kv.slot is None:
                raise ValueError("stream is closed")
            if kv.length + T > self.pool.max_len:
                raise ContextFullError(f"thinker context full: {kv.length} + {T} > {self.pool.max_len} positions")
        x = torch.zeros(B, T, H, dtype=self.dtype, device=self.device)
        for b, e in enumerate(embeds):
            x[b, : e.shape[0]] = e.to(self.dtype)
        base = S.device_tensor([kv.length for kv in kvs], self.device, torch.long)
        pos = base[:, None] + torch.arange(T, device=self.device)[None]
        slots = S.device_tensor([kv.slot for kv in kvs], self.device, torch.long)
        if self.use_graphs and T <= PREFILL_TOKENS and B <= BATCH_BUCKETS[-1] \
                and max(kv.length for kv in kvs) + PREFILL_TOKENS <= self.pool.max_len:
            kv_len = kv_bucket(max(kv.length for kv in kvs) + PREFILL_TOKENS, KV_BUCKET, self.pool.max_len)
            h, _ = self._graph(bucket(B, BATCH_BUCKETS), PREFILL_TOKENS, kv_len).run(x, pos, slots)
        else:
            kv_len = kv_bucket(max(kv.length for kv in kvs) + T, 64, self.pool.max_len)
            h = decoder_forward(self.m.llm.model, x, pos, slots, self.pool, kv_len)
        out = []
        for b, (kv, e) in enumerate(zip(kvs, embeds)):
            kv.length += e.shape[0]
            out.append(h[b, : e.shape[0]])
        return out

    def _forward_eager(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, kv_len: int):
        h = decoder_forward(self.m.llm.model, x, pos, slots, self.pool, kv_len)
        logits = self.m.llm.lm_head(h[:, 0]).float() if x.shape[1] == 1 else None
        return h, logits

    def _graph(self, B: int, T: int, kv_len: int) -> "_StepGraph":
        return self._graphs.get_or_build((B, T, kv_len), lambda: _StepGraph(self, B, T, kv_len))

    def _step_key(self, kvs: List[StaticKV]) -> Tuple[int, int]:
        """What fixes a decode step's computation besides its rows' own inputs: (rows, or the graph's
        batch bucket with CUDA graphs; the KV-length bucket of the longest row + 1)."""
        n = len(kvs)
        need = max(kv.length for kv in kvs) + 1
        kv_len = kv_bucket(need, KV_BUCKET, self.pool.max_len)
        return (bucket(n, BATCH_BUCKETS) if self.use_graphs else n), kv_len

    def _step_forward(self, kvs: List[StaticKV], ids: torch.Tensor, pos: torch.Tensor,
                      slots: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """One decode step: int64 [n] device ``ids`` at positions [n] into slots [n] -> (hidden
        [n, H] (a copy of the graph's output), float32 logits [n, V] (the graph's static output with
        CUDA graphs: read it before the next replay)). Lengths unchanged. Raises ``RuntimeError``
        when n exceeds the largest graph bucket."""
        n = len(kvs)
        _, kv_len = self._step_key(kvs)
        x = self.m.llm.model.embed_tokens(ids)[:, None]
        if self.use_graphs:
            B = bucket(n, BATCH_BUCKETS)
            if n > B:
                raise RuntimeError(f"batch of {n} exceeds the largest graph bucket {B}")
            h, logits = self._graph(B, 1, kv_len).run(x, pos[:, None], slots)
            return h[:, 0].clone(), logits
        h, logits = self._forward_eager(x, pos[:, None], slots, kv_len)
        return h[:, 0], logits

    def _decode_step(self, kvs: List[StaticKV], toks: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Feed one token per row -> (hidden [n, H], float32 logits [n, V]); advances lengths.
        Raises :class:`ContextFullError` when a row has no position left."""
        for kv in kvs:
            if kv.length + 1 > self.pool.max_len:
                raise ContextFullError(f"thinker context full at {kv.length} positions")
        dev = S.device_tensor([toks, [kv.length for kv in kvs], [kv.slot for kv in kvs]], self.device, torch.long)
        self.stats["decode_steps"] += 1
        h, logits = self._step_forward(kvs, dev[0], dev[1], dev[2])
        for kv in kvs:
            kv.length += 1
        return h, logits

    def _speculate(self, sts: List[ThinkerStream], ids: torch.Tensor) -> Optional["_Speculation"]:
        """Launch the decode step of ``sts`` fed int64 [n] device ``ids`` (no host sync; lengths
        unchanged) for :func:`.duplex.decode_rows`' lookahead. None (nothing launched) when a row has
        no position left or the batch is larger than the largest graph bucket: the plain step then
        runs (and raises) as without lookahead."""
        kvs = [st.kv for st in sts]
        if any(kv.slot is None or kv.length + 1 > self.pool.max_len for kv in kvs) \
                or (self.use_graphs and len(kvs) > BATCH_BUCKETS[-1]):
            return None
        dev = S.device_tensor([[kv.length for kv in kvs], [kv.slot for kv in kvs]], self.device, torch.long)
        h, logits = self._step_forward(kvs, ids, dev[0], dev[1])
        return _Speculation(self, sts, self._step_key(kvs), h, logits)

    def warmup(self, batch_sizes=(1, 2, 4, 8, 16), max_kv_len: int = 1024) -> int:
        """Capture the decode-step graphs of these batch buckets for KV lengths up to
        ``max_kv_len`` now (engine start-up) instead of at a stream's first unit (after reserving
        KV and Whisper slots for the largest batch size: :func:`.fast_kv.reserve_for_warmup`), run the audio
        encoder's convolutions once per batch size (:meth:`_warm_audio_convs`), and capture the
        batched Whisper pass for every batch bucket x each of its 6 KV-length buckets
        (:meth:`.fast_whisper.BatchedWhisper.warmup`: 36 graphs for batch sizes 1..32). Run it on
        the thread that will step the streams (the engine's thinker worker). Returns the number of
        graphs captured, LLM and Whisper (0 without CUDA graphs)."""
        reserve_for_warmup(self.pool, batch_sizes, "thinker")
        if self.audio_batch is not None:
            reserve_for_warmup(self.audio_batch.pool, batch_sizes, "thinker audio (Whisper)")
        self._warm_audio_convs(batch_sizes)
        if not self.use_graphs:
            return 0
        n0 = self.stats["graph_captures"]
        with torch.inference_mode():
            for B in sorted({bucket(b, BATCH_BUCKETS) for b in batch_sizes}):
                for L in range(KV_BUCKET, min(max_kv_len, self.pool.max_len) + 1, KV_BUCKET):
                    self._graph(B, 1, L)
                    self._graph(B, PREFILL_TOKENS, L)
        n = self.stats["graph_captures"] - n0
        if self.audio_batch is not None:
            n += self.audio_batch.warmup(batch_sizes)
        return n

    def _warm_audio_convs(self, batch_sizes) -> None:
        """Run the Whisper front convolutions once for every batch size and both unit mel lengths
        (unit 0 and the later units) on CUDA. cuDNN picks a convolution plan at the first call of a
        shape on each thread and keeps it for that thread (ATen's ``thread_local`` plan cache); a
        first call that meets the process-wide ``cudnn.benchmark`` flag on (another thread's
        autotuned region) autotunes, which takes a live unit's time. Warmed here, the thinker's
        plans are chosen at start-up. The units' audio is grouped by mel length, not bucketed, so
        every size from 1 to the stage's ``max_num_seqs`` is a shape of its own."""
        if self.audio is None or self.device.type != "cuda":
            return
        with torch.inference_mode():
            for shape in audio_conv_shapes(batch_sizes):
                self.audio._convs(torch.zeros(shape, device=self.device, dtype=self.dtype))

    @torch.inference_mode()
    def _audio_embeds_batch(self, sts: List[ThinkerStream], audios: list) -> List[torch.Tensor]:
        """:meth:`Thinker.audio_embeds_stream` for several streams (each at most once): the
        streaming mel per stream (CPU), then one batched Whisper pass for all of them, whatever
        their unit index (:meth:`.fast_whisper.BatchedWhisper.encode`). Each stream's ``whisper``
        becomes a :class:`~.fast_whisper.PooledWhisperCache` (a pool slot taken at its first audio
        unit; a reference-path cache is copied in). ``audios``: float32 16 kHz [16560] for a
        stream's unit 0, [16000] after (shorter is zero-padded). Returns [10, H] per stream (model
        dtype).

        Raises:
            ValueError: no audio encoder in this checkpoint, a stream is closed (both raised before
                any stream's state changes), or a stream's cache was released.
            AudioInputError: a unit of the wrong size (:meth:`.processor.StreamingMel.push`); raised
                before any stream's Whisper cache changes.
        """
        if self.audio is None:
            raise ValueError("this checkpoint has no audio encoder (init_audio false)")
        for st in sts:  # close() gave the slot back: a closed stream must not take a new one
            if st.closed:
                raise ValueError(f"stream {st.stream_id} is closed")
        mels, firsts = [], []
        for st, a in zip(sts, audios):
            firsts.append(st.mel.unit_index == 0)
            mel = st.mel.push(a)
            st.last_mel = mel
            mels.append(mel)
        caches = []
        for st in sts:
            st.whisper = self.audio_batch.adopt(st.whisper)
            caches.append(st.whisper)
        return self.audio_batch.encode(caches, mels, firsts)

    @torch.inference_mode()
    def audio_embeds_stream(self, st: ThinkerStream, audio: np.ndarray) -> torch.Tensor:
        """Streaming audio embeddings of one unit -> [10, H] (model dtype), through the batched pool
        path with one row (:meth:`_audio_embeds_batch`, same errors); the same values as
        :meth:`Thinker.audio_embeds_stream` up to float rounding."""
        return self._audio_embeds_batch([st], [audio])[0]

    # ------------------------------------------------------------------ sampling on the GPU
    def _gen(self, st: ThinkerStream) -> Optional[torch.Generator]:
        g = st.generator
        if g is None:
            return None
        if g.device == self.device or (g.device.type == self.device.type == "cpu"):
            return g
        cached = getattr(st, "_dev_gen", None)
        if cached is None or getattr(st, "_dev_gen_src", None) is not g:
            cached = torch.Generator(device=self.device)
            cached.manual_seed(g.initial_seed())
            st._dev_gen = cached
            st._dev_gen_src = g
        return cached

    # ------------------------------------------------------------------ the batched unit loop
    @torch.inference_mode()
    def step_units(self, items: List[UnitInput]) -> list:
        """Run one unit for each item together (each a different stream). Returns one
        :class:`UnitResult` per item, or an exception object in the slot of an item that failed
        on its own (closed stream, context full); the engine fails only that stream."""
        seen = set()
        for it in items:
            if id(it.stream) in seen:
                raise ValueError("step_units got the same stream twice in one batch")
            seen.add(id(it.stream))
        results: list = [None] * len(items)
        live = []
        for i, it in enumerate(items):
            st = it.stream
            if st.closed or not isinstance(st.kv, StaticKV):
                results[i] = ValueError(f"stream {st.stream_id} is closed or not a fast-thinker stream")
            else:
                live.append(i)
        if not live:
            return results
        snaps = {i: _StepSnapshot(items[i].stream) for i in live}
        try:
            return self._step_units(items, live, results, snaps)
        except Exception:
            # the runtime retries a raising batch in halves to find the stream at fault
            # (duplexkit/engine/steps.py): undo what this call did to every stream first
            for i, snap in snaps.items():
                snap.restore(items[i].stream)
            raise

    def _step_units(self, items: List[UnitInput], live: list, results: list, snaps: dict) -> list:
        sp = self.special
        t0 = time.perf_counter()
        span = _GpuSpan(self.device)
        # ---- prefill: audio, sliding window (as Thinker.prefill_unit), one batched LLM forward
        auds = self._audio_embeds_batch([items[i].stream for i in live], [items[i].audio for i in live])
        embeds, kept = [], []
        for i, aud in zip(live, auds):
            it, st = items[i], items[i].stream
            aud = aud.to(self.dtype)
            st.last_audio_embeds = aud
            upcoming = 1 + aud.shape[0] + (self.config.query_num + 2 if it.frame is not None else 0) \
                + st.policy.unit_limit() - 1
            try:
                self.slide_window(st, upcoming)
                snaps[i].after_slide(st)  # a slide rewrote the KV cache in place: keep its result
                need = st.kv.length + len(st.pending_ids) + max(upcoming, PREFILL_TOKENS) + 1
                if need > self.pool.max_len:
                    raise ContextFullError(f"stream {st.stream_id}: thinker context full ({st.kv.length} of "
                                           f"{self.pool.max_len} positions; enable the sliding window)")
            except ValueError as exc:
                results[i] = detach_traceback(exc)
                continue
            st.unit_starts.append(st.kv.length + len(st.pending_ids))
            pieces = [self.embed_ids(st.pending_ids + [sp.unit])]
            if it.frame is not None:
                img = self.image_embeds(it.frame).to(self.dtype)
                pieces += [self.embed_ids([sp.image]), img, self.embed_ids([sp.image_end])]
            pieces.append(aud)
            embeds.append(torch.cat(pieces))
            kept.append(i)
        live = kept
        if not live:
            return results
        hs = self._prefill([items[i].stream.kv for i in live], embeds)
        last = torch.stack([h[-1] for h in hs])
        logits_all = self.m.llm.lm_head(last).float()
        t1 = time.perf_counter()
        span.mark()
        rows = []
        for r, i in enumerate(live):
            st = items[i].stream
            st.pending_ids = []
            st.last_prefill_logits = logits_all[r]
            rows.append(begin_row(self, i, items[i], r))
        decode_rows(self, rows, logits_all, lambda sts, toks: self._decode_step([s.kv for s in sts], toks), self._gen,
                    speculate=self._speculate if self.lookahead else None)
        t2 = time.perf_counter()
        prefill_ms = span.ms((t1 - t0) * 1000.0, (t2 - t0) * 1000.0)
        timings = {"prefill_ms": prefill_ms, "decode_ms": (t2 - t0) * 1000.0 - prefill_ms, "batch": len(live)}
        for row in rows:
            results[row.index] = finish_row(self, row, timings)
        return results


class _GpuSpan:
    """Where the prefill ends on the GPU. The prefill only queues its work (no host sync), so the
    host's clock at its end says when the launches were done, not the work: the decode's first
    read of the tokens then waits for the rest. On CUDA this times the prefill from the call's start
    to its last kernel with two CUDA events (the rest of the call is the decode); on the CPU the
    host's clock is the work's."""

    def __init__(self, device: torch.device) -> None:
        self._ev = None
        if device.type == "cuda":
            self._stream = torch.cuda.current_stream(device)
            self._ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._ev[0].record(self._stream)

    def mark(self) -> None:
        """The prefill's work is queued: record its end."""
        if self._ev is not None:
            self._ev[1].record(self._stream)

    def ms(self, host_ms: float, total_ms: float) -> float:
        """Prefill ms: the events' span (at most the call's ``total_ms``) on CUDA, else ``host_ms``."""
        if self._ev is None:
            return host_ms
        self._ev[1].synchronize()  # done already: the decode read tokens computed after it
        return min(float(self._ev[0].elapsed_time(self._ev[1])), total_ms)


class _Speculation:
    """A decode step launched by :meth:`FastThinker._speculate` (the :class:`.duplex.Speculation` of
    the fast thinker). Its rows' results are the plain step's when the rows that go on are a subset
    of the launch, in launch order, fed the launched tokens, and the step key
    (:meth:`FastThinker._step_key`) of that subset is the launch's: without graphs that means the
    same rows (the same forward); with graphs the same captured graph, where a row's outputs depend
    only on its own inputs (the plain path already runs padding rows of other content beside it).
    A row left out wrote its KV at its next position, past its length: overwritten before it is read."""

    def __init__(self, th: FastThinker, sts: List[ThinkerStream], key: Tuple[int, int], h: torch.Tensor,
                 logits: torch.Tensor) -> None:
        self.th, self.key, self.h, self.logits = th, key, h, logits
        self.row_of = {id(st): r for r, st in enumerate(sts)}

    def reuse(self, sts: List[ThinkerStream]) -> Optional[Tuple[torch.Tensor, torch.Tensor, List[int]]]:
        rows = [self.row_of.get(id(st)) for st in sts]
        if not sts or None in rows or rows != sorted(rows) or self.th._step_key([st.kv for st in sts]) != self.key:
            return None
        for st in sts:
            st.kv.length += 1
        self.th.stats["decode_steps"] += 1
        self.th.stats["lookahead_hits"] += 1
        return self.h, self.logits, rows

    def drop(self) -> None:
        self.th.stats["lookahead_misses"] += 1


class _StepSnapshot:
    """What one batched unit step changes in a stream, kept to undo it when the batch call raises.

    The audio front end's state (streaming mel, Whisper cache: a shallow copy, so a pooled cache
    keeps its slot handle and gets its positions / reset count back; :mod:`.fast_whisper` on why the
    slot's contents need no undo) and the sampling generators are taken before the audio is encoded; everything else (KV length, pending ids, history, unit
    starts, turn flags, window counters, the forced-speech queue) after the sliding window, because a slide rewrites the KV
    cache in place and its result must stay. Positions written past the restored KV length are
    overwritten by the next prefill and never read. Costs a shallow copy of the stream's fields and
    of three id lists per stream and step."""

    _FRONT = ("mel", "whisper", "last_mel")
    _LISTS = ("pending_ids", "history", "unit_starts", "forced")

    def __init__(self, st: ThinkerStream) -> None:
        self.front = {k: copy.copy(getattr(st, k)) for k in self._FRONT}
        self.gens = [(g, g.get_state()) for g in (st.generator, getattr(st, "_dev_gen", None)) if g is not None]
        self.after_slide(st)

    def after_slide(self, st: ThinkerStream) -> None:
        d = {k: v for k, v in vars(st).items() if k not in self._FRONT}
        for k in self._LISTS:
            d[k] = list(d[k])
        self.state = d
        self.kv_length = st.kv.length

    def restore(self, st: ThinkerStream) -> None:
        for k in set(vars(st)) - set(self.state) - set(self._FRONT):
            delattr(st, k)  # made during the step (e.g. a device generator): made again on retry
        for k, v in self.state.items():
            setattr(st, k, v)
        cur, old = getattr(st, "whisper", None), self.front["whisper"]
        if isinstance(cur, PooledWhisperCache) and getattr(old, "handle", None) is not cur.handle:
            # a slot this step took (the stream's first audio unit): back now, not when the failed
            # call's frames (held by the exception's traceback) are collected
            cur.release()
        for k, v in self.front.items():
            setattr(st, k, v)
        st.kv.length = self.kv_length
        for g, state in self.gens:
            g.set_state(state)
