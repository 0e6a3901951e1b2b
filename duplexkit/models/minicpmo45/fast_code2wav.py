"""Batched Code2Wav: one flow call and one HiFT call for the streams of a step.

:class:`BatchedCode2Wav` is a :class:`~.code2wav.Code2Wav` (same streams, chunk contract, holdback,
carry and turn resets, docs/model.md §7) with ``batched = True`` and :meth:`push_batch`, which the
engine's code2wav stage calls with all its streams at once. Per round (one synthesis call per stream):

* **Flow.** Calls whose flow caches have the same shapes (same prompt length, same position in the
  turn, same chunk size) run as ONE flow call: the conformer encoder on the whole group, then our own
  Euler loop (the package's ``solve_euler_chunk`` arithmetic: cosine schedule, CFG 0.7, conditional
  rows first then the unconditional ones) over the package's DiT ``forward_chunk`` on 2B rows. The CFM
  noise table is shared by all streams (as in the single-stream path: a fixed table indexed by the
  cache offset), so each stream gets its own call's flow output.
* **HiFT.** All streams of the round whose HiFT input has the same length (first chunk 50 mel
  frames, later chunks 8 cached + 50; the turn's last chunk varies) run as ONE HiFT call across flow
  groups, each row with its own NSF noise (:mod:`.code2wav_hift`: row ``i`` draws what the stream's own
  seeded call draws) and its own HiFT cache / cross-fade tail.

On CUDA (:mod:`.code2wav_graphs`) the encoder of non-final chunks replays a graph per (batch bucket
1..32, cache shape), and the Euler loop a graph per (batch bucket 1, 2, 4, ... up to
:attr:`BatchedCode2Wav.graph_rows`, 16 by default; chunk frames, cached frames); larger groups run
the loop as sub-batches of that many streams. A voice has a few cache shapes (the caches grow to
prompt + 100 frames, then are trimmed). Everything of the DiT that depends only on the time step
(the time embedding, built on the CPU by the package, and every block's adaLN modulations) is
precomputed once outside the graphs, and each block-step runs in fewer kernels than the package's
(fused QKV GEMM, norm + modulate as one LayerNorm: :meth:`BatchedCode2Wav._dit_blocks`). Captures hold
:data:`~.fast_kv.CAPTURE_GATE` exclusive; every other call holds it shared. :meth:`BatchedCode2Wav.warmup` captures the default voice's shapes.

**Memory.** The Euler-loop graphs replay one at a time (under the Code2Wav lock) and their callers
copy the outputs before the next replay, so all of them take their static inputs, outputs and DiT
caches as views of ONE set of flat buffers sized for :attr:`BatchedCode2Wav.graph_rows` streams at the
frame capacity (:meth:`BatchedCode2Wav.scratch_bytes`), and capture into one shared memory pool (the
encoder graphs into another: their outputs are read across Euler-loop replays). The per-step
attention caches (10 steps x 16 blocks x 2 CFG rows x 8 heads x 128 x up to prompt + 100 frames;
float16 on CUDA with TF32 on, :func:`att_cache_dtype_default`: ~0.25 GB per stream at real size,
504 MiB in float32) are ONE buffer per call, read and written in place: the streams' cached frames
are copied in, each step writes its new frames beside them, and the new caches (trimmed) are copied
out (:meth:`BatchedCode2Wav._euler`). Before the in-place caches the graphs held them three times (input, output
and the blocks' scratch) and the package's concatenations copied them ~4 more times per step; a
graph of its own per shape held ~1 GB per row, and 48 streams ran out of memory on the H200
(benchmarks/results/2026-12-02-gpu-engine-48-64-streams-h200.md).
A turn's last chunk writes no new flow cache (the stream returns to its voice's base cache after it)
and runs in sub-batches of :data:`LAST_SUB_BATCH` streams on CUDA, so many turns ending in one round
do not allocate every stream's caches at once.

Files: this module holds the streaming wrapper (:meth:`BatchedCode2Wav.push_batch`, the batched HiFT
and the turn bookkeeping); :mod:`.code2wav_flow` the batched flow, :mod:`.code2wav_dit` the DiT
arithmetic of the Euler loop, :mod:`.code2wav_graphs` the CUDA graphs, their shared buffers and the
warm-up that captures them.

Why: one flow call costs ~0.3-0.4 s of CPU (launch bound); HiFT per stream cost ~25 ms of CPU each,
so 32 streams spent ~1.5 s per round in Code2Wav (benchmarks/results/2026-11-30-gpu-engine-h200.md, step 7).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ...errors import detach_traceback
from .capture_gate import CAPTURE_GATE
from .code2wav import CHUNK_CODES, Code2Wav, Code2WavStream, _check_codes
from .code2wav_dit import DiTKernels, DiTTable, FusedQKV, att_cache_dtype_default, matmul_tf32_default
from .code2wav_flow import BatchedFlow
# _graph_rows and gather_caches: re-exported (benchmarks/code2wav_batch.py, the tests)
from .code2wav_graphs import (GRAPH_MAX_BATCH, HIFT_BUCKETS, DiTGraph, EncoderGraph, GraphSetup,  # noqa: F401
                              _graph_rows, gather_caches)
from .code2wav_hift import RowNoise, group_rows, hift_rows

__all__ = ["BatchedCode2Wav", "DiTTable", "FusedQKV", "GRAPH_MAX_BATCH", "HIFT_BUCKETS", "LAST_SUB_BATCH",
           "att_cache_dtype_default", "gather_caches",
           "matmul_tf32_default"]

LAST_SUB_BATCH = 8
"""On CUDA a turn's last chunks (eager: their length varies) run the Euler loop in sub-batches of at
most this many streams: each row needs its caches gathered (~0.4-0.6 GB per stream at real size). Up
to :attr:`BatchedCode2Wav.graph_rows` rows they use the graphs' shared scratch (no new memory); a
bigger sub-batch gets its own buffer."""


class BatchedCode2Wav(BatchedFlow, DiTKernels, GraphSetup, Code2Wav):
    """:class:`Code2Wav` with a batched :meth:`push_batch` (see module doc).

    Attributes:
        hift_batched: one HiFT call per round for all streams of equal HiFT input length (default);
            ``False`` runs the package's HiFT per stream (the previous path, for A/B measurements).
        stats: ``flow_calls``, ``batched_streams``, ``hift_calls``, ``hift_rows``, graph captures.
    """

    batched = True

    def __init__(self, *a, hift_batched: bool = True, graph_rows: Optional[int] = None, att_cache_dtype=None,
                 **kw) -> None:
        super().__init__(*a, **kw)
        self.hift_batched = bool(hift_batched)
        #: rows of the Euler-loop graphs and of their shared scratch (:data:`GRAPH_MAX_BATCH`)
        self.graph_rows = _graph_rows(graph_rows)
        #: flat device buffers by role, shared by every Euler-loop graph and eager call (_scratch_view)
        self._scratch: Dict[str, Any] = {}
        self._scratch_capacity = 0
        #: CUDA graph memory pools: "encoder" and "dit" (see module doc)
        self._graph_pools: Dict[str, Any] = {}
        self._dit_graphs: Dict[Tuple[int, int, int], DiTGraph] = {}
        self._enc_graphs: Dict[tuple, EncoderGraph] = {}
        #: the Euler loop's time table and fused QKV weights (_dit_table, _fused_qkv), built once
        self._dit_tab: Optional[DiTTable] = None
        self._qkv: Dict[int, FusedQKV] = {}
        self._row_noise = RowNoise(self.device, self.hift.m_source.l_sin_gen.dim)
        self._use_graphs = self.device.type == "cuda" and os.environ.get("DUPLEXKIT_CUDA_GRAPHS", "1") != "0"
        #: non-final Euler loops run in sub-batches of this many streams (None: the whole group);
        #: the captured graphs' size on CUDA
        self.euler_sub_batch = self.graph_rows if self._use_graphs else None
        #: a turn's last chunks run the Euler loop in sub-batches of this many streams (None: whole group)
        self.last_sub_batch = LAST_SUB_BATCH if self.device.type == "cuda" else None
        #: HiFT calls are padded to these row counts (None: no padding). On CUDA the conv plans are
        #: autotuned per shape (cudnn.benchmark): padding keeps the shapes to the few that warmup()
        #: tunes, instead of a new tuning for each batch size met mid-run
        self.hift_buckets = HIFT_BUCKETS if self.device.type == "cuda" else None
        #: fp32 matmuls on TF32 tensor cores during this vocoder's calls and captures (CUDA only;
        #: :func:`matmul_tf32_default`). cuDNN's convolutions already use TF32 by PyTorch's default. The
        #: flag is process wide: while the vocoder works, other threads' fp32 matmuls (a float32 thinker
        #: layout, the application's own) may run TF32 too; graphs captured under it keep it
        self.matmul_tf32 = matmul_tf32_default(self.device)
        self.att_cache_dtype = att_cache_dtype or att_cache_dtype_default(self.device, self.dtype, self.matmul_tf32)
        self.stats = {"flow_calls": 0, "batched_streams": 0, "hift_calls": 0, "hift_rows": 0}
        #: True inside warmup(): HiFT's convolutions are autotuned (cudnn.benchmark) only then
        self._tuning = False

    def set_graph_rows(self, rows: int) -> None:
        """Size the Euler-loop graphs and their shared scratch for ``rows`` streams (a memory plan's
        choice, :mod:`duplexkit.engine.memory_plan`): drops the scratch and the captured Euler-loop
        graphs (made again at the next call or :meth:`warmup`); on CUDA larger groups then run as
        sub-batches of ``rows``.

        Raises:
            ValueError: not a power of two from 1 to 32."""
        self.graph_rows = _graph_rows(int(rows))
        self._scratch.clear()
        self._dit_graphs.clear()
        if self._use_graphs:
            self.euler_sub_batch = self.graph_rows

    @property
    def att_cache_dtype(self):
        """The dtype of the batched path's DiT attention caches (:func:`att_cache_dtype_default`, or
        the constructor's ``att_cache_dtype``). Setting it drops the Euler-loop graphs (their buffers
        have the old dtype); the scratch buffers are remade at the next call. Streams keep the caches
        they have until their next chunk (cast as they are read)."""
        return self._att_cache_dtype

    @att_cache_dtype.setter
    def att_cache_dtype(self, dtype) -> None:
        self._att_cache_dtype = dtype
        self._dit_graphs.clear()

    def push_batch(self, items: Sequence[Any]) -> list:
        """``push`` for several streams at once. ``items``: objects with ``handle``
        (:class:`Code2WavStream`), ``codes`` (int [n]) and ``last`` (bool), each a different stream.
        Returns one float32 24 kHz array per item (maybe empty), or the exception of an item that
        failed (bad codes, closed stream: nothing consumed for it; a failed flow or HiFT call: the
        exception of every stream in that call, and those streams' turns are reset (:meth:`reset_turn`:
        pending codes dropped, the voice's base caches), since their flow caches are advanced in place
        before the round commits)."""
        results: list = [None] * len(items)
        plans = []
        for i, w in enumerate(items):
            try:
                self._check_open(w.handle)
                new = _check_codes(w.codes)
            except Exception as exc:  # noqa: BLE001 - this item only
                results[i] = detach_traceback(exc)
                continue
            st = w.handle
            pending = np.concatenate([st.pending, new])
            n_blocks = max(0, (len(pending) - 1) // CHUNK_CODES) if w.last else len(pending) // CHUNK_CODES
            jobs = [(pending[k * CHUNK_CODES:(k + 1) * CHUNK_CODES], False) for k in range(n_blocks)]
            rest = pending[n_blocks * CHUNK_CODES:]
            if w.last:
                jobs.append((rest, True))
            plans.append(dict(i=i, st=st, jobs=jobs, rest=rest, last=bool(w.last), out=[], err=None))
        with self._lock, self._matmul_precision():
            r = 0
            while True:
                live = [p for p in plans if p["err"] is None and len(p["jobs"]) > r]
                if not live:
                    break
                groups: Dict[tuple, list] = {}
                for p in live:
                    new, last = p["jobs"][r]
                    groups.setdefault(self._key(p["st"], new, last), []).append(p)
                ready = []  # (plan, mel [1, 80, T], flow caches, tokens, last) of this round
                for key, g in groups.items():
                    last = key[1]
                    try:
                        if len(g) == 1 and not self._use_graphs:
                            p = g[0]
                            flows = [self._flow_one(p["st"], p["jobs"][r][0], last)]
                        else:
                            flows = self._flow_group([(p["st"], p["jobs"][r][0]) for p in g], last)
                    except Exception as exc:  # noqa: BLE001 - the streams of this group
                        detach_traceback(exc)
                        for p in g:
                            p["err"] = exc
                        continue
                    ready.extend((p, *f, last) for p, f in zip(g, flows))
                try:
                    self._vocode(ready)
                except Exception as exc:  # noqa: BLE001 - not one call's: fail every stream still live
                    detach_traceback(exc)
                    for p in plans:
                        if p["err"] is None:
                            p["err"] = exc
                    break
                r += 1
            for p in plans:
                if p["err"] is not None:
                    results[p["i"]] = p["err"]
                    # its flow cache may already hold this round's chunk (_stream_caches): start the
                    # turn over, as the engine does after any vocoder failure
                    self._end_turn(p["st"])
                    continue
                p["st"].pending = p["rest"] if not p["last"] else p["rest"][:0]
                if p["last"]:
                    self._end_turn(p["st"])
                results[p["i"]] = np.concatenate(p["out"]).astype(np.float32, copy=False) if p["out"] \
                    else np.zeros(0, np.float32)
        return results

    def _end_turn(self, st: Code2WavStream) -> None:
        """:meth:`reset_turn` after a round; a stream another thread closed during the round (``close``
        takes no lock) is closed again instead, dropping what the round gave it."""
        (self.close if st.closed else self.reset_turn)(st)

    @staticmethod
    def _key(st: Code2WavStream, new: np.ndarray, last: bool) -> tuple:
        shapes = tuple(tuple(v.shape) for _, v in sorted(st.flow_cache.items()))
        hc = st.hift_cache
        return (len(new), bool(last), shapes, int(st.prompt.mel.shape[1]), hc is None,
                None if hc is None else tuple(hc["mel"].shape))

    def _vocode(self, ready: list) -> None:
        """HiFT + cross-fade + state commit for this round's flow outputs ``(plan, mel, cache, tokens,
        last)``: one batched HiFT call per equal input length (or per stream when ``hift_batched`` is
        off). Appends audio to ``plan["out"]`` or sets ``plan["err"]`` for the streams of a failed call."""
        torch = self.torch
        if not self.hift_batched:
            for p, mel, cache, tokens, last in ready:
                try:
                    p["out"].append(self._finish(p["st"], mel, cache, tokens, last))
                except Exception as exc:  # noqa: BLE001 - this stream
                    p["err"] = detach_traceback(exc)
                self.stats["hift_calls"] += 1
                self.stats["hift_rows"] += 1
            return
        prepared, keys = [], []
        for p, mel, cache, tokens, last in ready:
            try:
                with torch.inference_mode():
                    cache = self._trim_flow_cache(p["st"], cache)
                    mel_in, src = self._hift_input(p["st"], mel)
            except Exception as exc:  # noqa: BLE001 - this stream (its flow cache may already be advanced)
                p["err"] = detach_traceback(exc)
                continue
            prepared.append((p, mel_in, src, cache, tokens, last))
            keys.append((mel_in.shape[2], src.shape[2], last))
        for rows in group_rows(keys):
            group = [prepared[i] for i in rows]
            sts = [g[0]["st"] for g in group]
            last = group[0][5]
            try:
                with torch.inference_mode():
                    B = len(group)
                    pad = next((b for b in self.hift_buckets or () if b >= B), B) - B
                    mels = [g[1] for g in group] + [torch.zeros_like(group[0][1])] * pad
                    mel = torch.cat(mels, dim=0)
                    src = None
                    if group[0][2].shape[2]:
                        src = torch.cat([g[2] for g in group] + [torch.zeros_like(group[0][2])] * pad, dim=0)
                    seeds = [self._hift_seed(st) for st in sts] + [0] * pad
                    with self._hift_guard(last):  # private per-row generators
                        speech, source = hift_rows(self.hift, mel, src, seeds, self._row_noise)
                    speech = self._crossfade_and_hold(sts, mel[:B], speech[:B], source[:B], last)
                audio = speech.float().cpu().numpy()
            except Exception as exc:  # noqa: BLE001 - the streams of this HiFT call
                detach_traceback(exc)
                for g in group:
                    g[0]["err"] = exc
                continue
            self.stats["hift_calls"] += 1
            self.stats["hift_rows"] += len(group)
            for b, (p, _m, _s, cache, tokens, _l) in enumerate(group):
                p["out"].append(self._commit_chunk(p["st"], cache, tokens, last, audio[b].copy()))

    @contextlib.contextmanager
    def _matmul_precision(self):
        """TF32 fp32 matmuls for the duration of a call when :attr:`matmul_tf32` (the flag is process
        wide: the engine's other stages run bf16, which it does not touch); a no-op otherwise."""
        if not self.matmul_tf32:
            yield
            return
        flags = self.torch.backends.cuda.matmul
        prev, flags.allow_tf32 = flags.allow_tf32, True
        try:
            yield
        finally:
            flags.allow_tf32 = prev

    def _hift_guard(self, last: bool):
        """HiFT holding the capture gate shared (:mod:`.capture_gate`): no graph capture on another
        thread may be open while HiFT launches kernels or (the per-stream path) draws from the default
        CUDA generator. Shared holds never wait for each other, so the talker does not wait for the
        vocoder.

        cuDNN autotuning (``cudnn.benchmark``) is on only inside :meth:`warmup`, for the steady chunk
        shapes: ~25 % less CPU per chunk on the H200 (benchmarks/results/2026-11-30-gpu-engine-h200.md,
        step 4). cuDNN keeps the plan of
        each shape per thread after its first call, tuned or not, so the warmed shapes keep their
        tuned plans and the rest (a turn's variable-length last chunk, a shape met later) get the
        heuristic plan. The flag is process wide: set while serving, it also made the other stage
        threads autotune their own new shapes in the middle of a unit."""
        torch = self.torch
        stack = contextlib.ExitStack()
        stack.enter_context(CAPTURE_GATE.shared())
        tune = self._tuning and not last and self.device.type == "cuda"
        stack.enter_context(torch.backends.cudnn.flags(enabled=True, benchmark=tune))
        return stack
