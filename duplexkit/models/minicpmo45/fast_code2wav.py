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

Why: one flow call costs ~0.3-0.4 s of CPU (launch bound); HiFT per stream cost ~25 ms of CPU each,
so 32 streams spent ~1.5 s per round in Code2Wav (benchmarks/results/2026-11-30-gpu-engine-h200.md, step 7).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ...errors import detach_traceback
from .code2wav import CHUNK_CODES, FLOW_CACHE_TAIL_FRAMES, SILENCE_CODE, Code2Wav, Code2WavStream, _check_codes
from .code2wav_graphs import ENCODER_BUCKETS, DiTGraph, EncoderGraph
from .code2wav_hift import RowNoise, group_rows, hift_rows

__all__ = ["BatchedCode2Wav", "DiTTable", "FusedQKV", "GRAPH_MAX_BATCH", "HIFT_BUCKETS", "LAST_SUB_BATCH",
           "att_cache_dtype_default", "gather_caches",
           "matmul_tf32_default"]

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

LAST_SUB_BATCH = 8
"""On CUDA a turn's last chunks (eager: their length varies) run the Euler loop in sub-batches of at
most this many streams: each row needs its caches gathered (~0.4-0.6 GB per stream at real size). Up
to :attr:`BatchedCode2Wav.graph_rows` rows they use the graphs' shared scratch (no new memory); a
bigger sub-batch gets its own buffer."""


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


class BatchedCode2Wav(Code2Wav):
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

    # ------------------------------------------------------------------ public
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

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _key(st: Code2WavStream, new: np.ndarray, last: bool) -> tuple:
        shapes = tuple(tuple(v.shape) for _, v in sorted(st.flow_cache.items()))
        hc = st.hift_cache
        return (len(new), bool(last), shapes, int(st.prompt.mel.shape[1]), hc is None,
                None if hc is None else tuple(hc["mel"].shape))

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

    def _encode(self, tok, cnn, att, last: bool):
        """Token embedding + conformer encoder + projection for B rows: (mu [B, 80, T'], new conformer
        cnn / att caches). Non-final chunks of <= 32 rows replay a captured graph on CUDA (outputs are
        graph buffers: copy before the next call)."""
        flow = self.flow
        B = tok.shape[0]
        if self._use_graphs and not last and B <= ENCODER_BUCKETS[-1]:
            Bb = next(b for b in ENCODER_BUCKETS if b >= B)
            key = (Bb, tok.shape[1], tuple(cnn.shape[1:]), att.shape[0], tuple(att.shape[2:]))
            g = self._enc_graphs.get(key)
            if g is None:
                g = self._capture(EncoderGraph, self, Bb, tok.shape, cnn.shape, att.shape)
                if g is not None:
                    self._enc_graphs[key] = g
                    self.stats["encoder_graph_captures"] = self.stats.get("encoder_graph_captures", 0) + 1
            if g is not None:
                return g.run(tok, cnn, att)
        h, c_cnn, c_att = flow.encoder.forward_chunk(xs=flow.input_embedding(tok), last_chunk=last,
                                                     cnn_cache=cnn, att_cache=att)
        return flow.encoder_proj(h).transpose(1, 2).contiguous(), c_cnn, c_att

    def _capture(self, cls, *args):
        """Build a graph object; on failure log once and run eagerly from now on."""
        try:
            return cls(*args)
        except Exception as exc:  # noqa: BLE001 - fall back to the eager path for good
            import logging

            logging.getLogger("duplexkit.code2wav").warning("%s capture failed (%s); eager from now", cls.__name__, exc)
            self._use_graphs = False
            self.euler_sub_batch = None
            return None

    def _euler_batch(self, mu, spk, caches: list, last: bool):
        """The CFM Euler loop for the B streams of ``caches`` (each a stream's flow caches: estimator
        att [n, depth, 2, h, L, 2hd] and cnn [n, depth, 2, C, 2], CFG rows conditional first), ``mu``
        [B, 80, T], projected ``spk`` [B, 80]. Returns (x [B, 80, T], cnn [n, depth, 2Bb, C, 2], kv
        [n, depth, 2Bb, h, T + L, 2hd]) with Bb >= B rows per CFG half (stream j: rows j and Bb + j;
        kv in the package's order, see :meth:`_euler`); both are scratch views (copy before the next
        call)."""
        torch = self.torch
        B, T = mu.shape[0], mu.shape[2]
        dec = self.flow.decoder
        self._dit_table()  # built (once) here, outside any graph capture
        L = caches[0]["estimator_att_cache"].shape[4]
        x0 = dec.rand_noise[:, :, L:L + T].expand(B, -1, -1)
        mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)
        spks_in = torch.cat([spk, torch.zeros_like(spk)], dim=0)
        if self._use_graphs and not last and B <= self.graph_rows:
            Bb = 1 << (B - 1).bit_length()  # graphs for 1, 2, 4, ... rows (graph_rows is a power of two)
            key = (Bb, T, L)
            g = self._dit_graphs.get(key)
            if g is None:
                g = self._capture(DiTGraph, self, Bb, T, L)
                if g is not None:
                    self._dit_graphs[key] = g
                    self.stats["dit_graph_captures"] = self.stats.get("dit_graph_captures", 0) + 1
            if g is not None:
                return g.run(B, x0, mu_in, spks_in, caches)
        buf = lambda role, frames=T: self.dit_scratch(role, B, frames)  # noqa: E731
        cnn, cnn_out, kv = buf("cnn", 0), buf("cnn_out", 0), buf("kv", T + L)
        gather_caches(caches, cnn, kv, B, T)
        cond = buf("cond_in")
        cond.zero_()
        x = self._euler(B, x0, mu_in, spks_in, cond, cnn, kv, cnn_out)
        return x, cnn_out, kv

    def _stream_caches(self, st: Code2WavStream, c_cnn, c_att, new_cnn, kv, i: int, j: int, Bb: int) -> dict:
        """Stream ``st``'s new flow caches (copies) from a group's outputs: conformer row ``i``, Euler
        rows ``j`` and ``Bb + j``. The estimator's attention cache is trimmed to the prompt frames + the
        last 100 as it is copied out (:meth:`_trim_flow_cache`'s rule, Token2wav 0.1.1), in one copy,
        into the stream's own tensor of last chunk (:attr:`Code2WavStream.own_att`) when it has the same
        shape: its old frames are already in ``kv``, and a new tensor per stream would hold two caches
        per stream until the round commits (~24 GB more at 48 streams, real size). The stream's caches
        then show the new chunk before it commits, so a failed call resets its turn (:meth:`push_batch`).
        The cache keeps ``kv``'s dtype (:attr:`att_cache_dtype`)."""
        torch = self.torch
        keep = st.prompt.mel.shape[1]
        LT = kv.shape[4]
        shape = (*kv.shape[:2], 2, kv.shape[3], min(LT, keep + FLOW_CACHE_TAIL_FRAMES), kv.shape[5])
        att = st.own_att
        if att is None or att is not st.flow_cache.get("estimator_att_cache") or tuple(att.shape) != shape \
                or att.dtype != kv.dtype:
            att = st.own_att = torch.empty(shape, device=kv.device, dtype=kv.dtype)
        for r, row in enumerate((j, Bb + j)):
            if LT > keep + FLOW_CACHE_TAIL_FRAMES:
                att[:, :, r, :, :keep].copy_(kv[:, :, row, :, :keep])
                att[:, :, r, :, keep:].copy_(kv[:, :, row, :, LT - FLOW_CACHE_TAIL_FRAMES:])
            else:
                att[:, :, r].copy_(kv[:, :, row])
        return {
            "conformer_cnn_cache": c_cnn[i:i + 1].clone(),
            "conformer_att_cache": c_att[:, i:i + 1].clone(),
            "estimator_cnn_cache": torch.stack([new_cnn[:, :, j], new_cnn[:, :, Bb + j]], dim=2),
            "estimator_att_cache": att,
        }

    def _flow_one(self, stream: Code2WavStream, new: np.ndarray, last: bool):
        """The package's single-stream flow (:meth:`Code2Wav._flow_one`: a lone stream on the CPU, or
        :meth:`~.code2wav.Code2Wav.push`), on a stream whose attention cache the batched path may have
        left in :attr:`att_cache_dtype`: cast back to the flow's dtype first (the package concatenates
        it with the new frames' float32 keys)."""
        att = stream.flow_cache.get("estimator_att_cache")
        stream.own_att = None  # the package returns a new cache: do not keep the batched path's tensor alive
        if att is not None and att.dtype != self.dtype:
            stream.flow_cache = {**stream.flow_cache, "estimator_att_cache": att.to(self.dtype)}
        return super()._flow_one(stream, new, last)

    def _flow_group(self, group: List[Tuple[Code2WavStream, np.ndarray]], last: bool) -> list:
        """The flow for streams with equal cache shapes (caller holds the lock): one encoder call for
        the group, the Euler loop in sub-batches of <= graph_rows when graphs are on (a turn's last
        chunks: <= ``last_sub_batch``, halved while one runs out of GPU memory). Returns per stream
        (mel [1, 80, T], its new flow caches, tokens), all copies (no graph buffers)."""
        torch = self.torch
        F = torch.nn.functional
        flow = self.flow
        B = len(group)
        for st, _ in group:
            self._ensure_capacity(st.prompt.mel.shape[1])
        tokens = [np.concatenate([st.carry, new]) for st, new in group]
        cs = [st.flow_cache for st, _ in group]
        out = []
        with torch.inference_mode(), self.flow_autocast():
            tok = torch.from_numpy(np.stack(tokens).astype(np.int64)).to(self.device)
            spk = flow.spk_embed_affine_layer(F.normalize(torch.cat([st.prompt.spk for st, _ in group], dim=0), dim=1))
            mu, c_cnn, c_att = self._encode(tok, torch.cat([c["conformer_cnn_cache"] for c in cs], dim=0),
                                            torch.cat([c["conformer_att_cache"] for c in cs], dim=1), last)
            step = (self.euler_sub_batch or B) if not last else (self.last_sub_batch or B)
            k = 0
            while k < B:
                sub = cs[k:k + step]
                b = len(sub)
                try:
                    x, new_cnn, kv = self._euler_batch(mu[k:k + b], spk[k:k + b], sub, last)
                except torch.OutOfMemoryError:
                    if not last or b == 1:
                        raise
                    x = None
                if x is None:
                    # a burst of turn ends larger than the graph rows runs on the eager scratch (~0.25-0.5 GB
                    # per stream at real size) and did not fit beside the rest; redo it in halves
                    # (outside the except block: its traceback no longer holds the failed call's tensors)
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
                    step = b // 2
                    self.stats["last_oom_splits"] = self.stats.get("last_oom_splits", 0) + 1
                    continue
                Bb = kv.shape[2] // 2
                for j in range(b):
                    i = k + j
                    if last:  # unchanged: reset to the voice's base cache after this chunk
                        out.append((x[j:j + 1].clone(), dict(sub[j]), tokens[i]))
                        continue
                    cache = self._stream_caches(group[i][0], c_cnn, c_att, new_cnn, kv, i, j, Bb)
                    out.append((x[j:j + 1].clone(), cache, tokens[i]))
                k += b
        self.stats["flow_calls"] += 1
        self.stats["batched_streams"] += B
        return out

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
        vocoder (issue 19 step 8).

        cuDNN autotuning (``cudnn.benchmark``) is on only inside :meth:`warmup`, for the steady chunk
        shapes: ~25 % less CPU per chunk on the H200 (benchmarks/results/2026-11-30-gpu-engine-h200.md,
        step 4). cuDNN keeps the plan of
        each shape per thread after its first call, tuned or not, so the warmed shapes keep their
        tuned plans and the rest (a turn's variable-length last chunk, a shape met later) get the
        heuristic plan. The flag is process wide: set while serving, it also made the other stage
        threads autotune their own new shapes in the middle of a unit."""
        from .fast_kv import CAPTURE_GATE

        torch = self.torch
        stack = contextlib.ExitStack()
        stack.enter_context(CAPTURE_GATE.shared())
        tune = self._tuning and not last and self.device.type == "cuda"
        stack.enter_context(torch.backends.cudnn.flags(enabled=True, benchmark=tune))
        return stack
