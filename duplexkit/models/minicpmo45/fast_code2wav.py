"""Batched Code2Wav: one flow call (encoder + 10-step Euler loop over the DiT) for several streams.

:class:`BatchedCode2Wav` is a :class:`~.code2wav.Code2Wav` (same streams, chunk contract, holdback,
carry and turn resets, docs/model.md §7) with ``batched = True`` and :meth:`push_batch`, which the
engine's code2wav stage calls with all its streams at once. Synthesis calls whose flow caches have
the same shapes (streams in step: same prompt length, same position in the turn, same chunk size)
run as ONE flow call: the conformer encoder on a batch of B, then our own Euler loop (the
package's ``solve_euler_chunk`` arithmetic: cosine schedule, CFG 0.7, conditional rows first then
the unconditional ones) over the package's DiT ``forward_chunk`` on a batch of 2B, with the DiT's
cache buffers sized for 2B. The CFM noise table is shared by all streams (as in the single-stream
path: a fixed table indexed by the cache offset), so each stream gets the same flow output as its
own call. HiFT then runs per stream (its NSF noise is seeded per stream and chunk, as in
:meth:`Code2Wav._synth`). Calls that match no other stream take the single-stream path.

On CUDA the Euler loop of non-final chunks is replayed from a captured CUDA graph per (batch bucket
<= 4, chunk frames, cached frames) — a few shapes per voice, since the cache grows to prompt + 100
frames and is then trimmed; larger groups are split into such sub-batches. The DiT's time embedding
(built on the CPU by the package) is precomputed once per batch size outside the graph. HiFT and
every capture run under :data:`~.fast_kv.CAPTURE_LOCK` (HiFT draws from the default CUDA generator).
:meth:`BatchedCode2Wav.warmup` captures the default voice's shapes at start-up.

Why: one flow call costs ~0.3-0.4 s of CPU (launch and dispatch bound, ~12,500 kernels with the GPU
~13 % busy; benchmarks/NOTES.md); batching shares that cost among the streams of a step, and the
graph takes a 1-stream chunk from ~0.4 s to ~0.1 s on the H200.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from .code2wav import CHUNK_CODES, Code2Wav, Code2WavStream, _check_codes

__all__ = ["BatchedCode2Wav", "GRAPH_MAX_BATCH"]

GRAPH_MAX_BATCH = 4
"""Flow calls of at most this many streams replay a captured Euler-loop graph on CUDA (bigger
batches already share the launch cost; their fp32 per-step caches would cost ~10 GB per graph)."""


class _DiTGraph:
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
        s = torch.cuda.Stream(c2w.device)
        s.wait_stream(torch.cuda.current_stream(c2w.device))
        with torch.cuda.stream(s):
            c2w._euler(*args)
        torch.cuda.current_stream(c2w.device).wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        from .fast_kv import CAPTURE_LOCK

        with CAPTURE_LOCK, torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.x, self.new_cnn, self.new_att = c2w._euler(*args)

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


class BatchedCode2Wav(Code2Wav):
    """:class:`Code2Wav` with a batched :meth:`push_batch` (see module doc)."""

    batched = True

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._batch_buffers: Dict[Tuple[int, int], tuple] = {}
        self._dit_graphs: Dict[Tuple[int, int, int], _DiTGraph] = {}
        self._time_tables: Dict[int, tuple] = {}
        import os

        self._use_graphs = self.device.type == "cuda" and os.environ.get("DUPLEXKIT_CUDA_GRAPHS", "1") != "0"
        self.stats = {"flow_calls": 0, "batched_streams": 0}

    # ------------------------------------------------------------------ public
    def push_batch(self, items: Sequence[Any]) -> list:
        """``push`` for several streams at once. ``items``: objects with ``handle``
        (:class:`Code2WavStream`), ``codes`` (int [n]) and ``last`` (bool), each a different stream.
        Returns one float32 24 kHz array per item (maybe empty), or the exception of an item that
        failed (bad codes, closed stream; nothing consumed for it)."""
        results: list = [None] * len(items)
        plans = []
        for i, w in enumerate(items):
            try:
                self._check_open(w.handle)
                new = _check_codes(w.codes)
            except Exception as exc:  # noqa: BLE001 - this item only
                results[i] = exc
                continue
            st = w.handle
            pending = np.concatenate([st.pending, new])
            n_blocks = max(0, (len(pending) - 1) // CHUNK_CODES) if w.last else len(pending) // CHUNK_CODES
            jobs = [(pending[k * CHUNK_CODES:(k + 1) * CHUNK_CODES], False) for k in range(n_blocks)]
            rest = pending[n_blocks * CHUNK_CODES:]
            if w.last:
                jobs.append((rest, True))
            plans.append(dict(i=i, st=st, jobs=jobs, rest=rest, last=bool(w.last), out=[], err=None))
        with self._lock:
            r = 0
            while True:
                live = [p for p in plans if p["err"] is None and len(p["jobs"]) > r]
                if not live:
                    break
                groups: Dict[tuple, list] = {}
                for p in live:
                    new, last = p["jobs"][r]
                    groups.setdefault(self._key(p["st"], new, last), []).append(p)
                if self._use_graphs:  # graph-sized sub-batches: replaying 4 graphs beats one eager loop of 16
                    split = {}
                    for key, g in groups.items():
                        for k in range(0, len(g), GRAPH_MAX_BATCH):
                            split[key + (k,)] = g[k:k + GRAPH_MAX_BATCH]
                    groups = split
                for key, g in groups.items():
                    try:
                        if len(g) == 1 and not self._use_graphs:
                            p = g[0]
                            new, last = p["jobs"][r]
                            p["out"].append(self._synth(p["st"], new, last=last))
                        else:
                            outs = self._synth_batch([(p["st"], p["jobs"][r][0]) for p in g], last=key[1])
                            for p, o in zip(g, outs):
                                p["out"].append(o)
                    except Exception as exc:  # noqa: BLE001 - the streams of this group
                        for p in g:
                            p["err"] = exc
                r += 1
            for p in plans:
                if p["err"] is not None:
                    results[p["i"]] = p["err"]
                    continue
                p["st"].pending = p["rest"] if not p["last"] else p["rest"][:0]
                if p["last"]:
                    self.reset_turn(p["st"])
                results[p["i"]] = np.concatenate(p["out"]).astype(np.float32, copy=False) if p["out"] \
                    else np.zeros(0, np.float32)
        return results

    def warmup(self, batch_sizes=(1, 2, 4), chunks: int = 3, ref_voice: Any = None) -> int:
        """Capture the Euler-loop graphs (and tune HiFT's conv plans) for the default voice at
        these batch sizes now (engine start-up): ``chunks`` chunks of silence codes per size cover
        the growing-then-trimmed cache shapes. Returns the number of graphs captured."""
        from types import SimpleNamespace

        n0 = self.stats.get("dit_graph_captures", 0)
        codes = np.full(CHUNK_CODES, 4218, np.int64)
        for B in batch_sizes:
            if B > GRAPH_MAX_BATCH:
                continue
            sts = [self.new_stream(ref_voice, seed=k) for k in range(B)]
            try:
                for _ in range(chunks):
                    self.push_batch([SimpleNamespace(handle=st, codes=codes, last=False) for st in sts])
            finally:
                for st in sts:
                    self.close(st)
        return self.stats.get("dit_graph_captures", 0) - n0

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _key(st: Code2WavStream, new: np.ndarray, last: bool) -> tuple:
        shapes = tuple(tuple(v.shape) for _, v in sorted(st.flow_cache.items()))
        hc = st.hift_cache
        return (len(new), bool(last), shapes, int(st.prompt.mel.shape[1]), hc is None,
                None if hc is None else tuple(hc["mel"].shape))

    def _buffers(self, B: int) -> tuple:
        """DiT cache buffers for a batch of 2B rows (CFG), sized like :meth:`_ensure_capacity`."""
        torch = self.torch
        key = (B, self._capacity)
        buf = self._batch_buffers.get(key)
        if buf is None:
            if any(k[1] != self._capacity for k in self._batch_buffers):
                self._dit_graphs.clear()  # captured with the old buffers
            self._batch_buffers = {k: v for k, v in self._batch_buffers.items() if k[1] == self._capacity}
            kw = dict(device=self.device, dtype=self.dtype)
            buf = (torch.empty(self._depth, 2 * B, self._heads, self._capacity, 2 * self._head_dim, **kw),
                   torch.zeros(self._depth, 2 * B, self._conv_ch, 2, **kw))
            self._batch_buffers[key] = buf
        return buf

    def _time_table(self, B: int):
        """(t embeddings [n, 2B, 1, hidden], dt [n]) of the cosine schedule, computed once per B with
        the package's recurrence (``t += dt; dt = t_span[k+1] - t``) and its ``t_embedder``. Done
        outside any graph: ``timestep_embedding`` builds its frequencies on the CPU."""
        torch = self.torch
        hit = self._time_tables.get(B)
        if hit is not None:
            return hit
        n = self.n_timesteps
        est = self.flow.decoder.estimator
        t_span = torch.linspace(0, 1, n + 1, device=self.device, dtype=self.dtype)
        t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        t, dt = t_span[0].reshape(1), t_span[1] - t_span[0]
        embs, dts = [], []
        with torch.inference_mode():
            for step in range(1, n + 1):
                embs.append(est.t_embedder(t.repeat(2 * B)).unsqueeze(1))
                dts.append(dt.reshape(1))
                t = t + dt
                if step < n:
                    dt = t_span[step + 1] - t
        hit = (torch.stack(embs), torch.cat(dts))
        self._time_tables[B] = hit
        return hit

    def _euler(self, B: int, x, mu_in, spks_in, cond_in, cnn, att, att_out, cnn_out):
        """The package's ``solve_euler_chunk`` arithmetic for B streams (2B CFG rows: conditional
        first), calling the DiT blocks the way ``DiT.forward_chunk`` does (inputs packed along the
        channel axis, no mask) with the precomputed time embeddings: no host work, capturable.
        Writes the per-step caches into ``att_out`` [n, depth, 2B, h, >= L+T, 2hd] and
        ``cnn_out``; returns (x [B, 80, T], cnn_out, att_out[..., :L+T, :])."""
        torch = self.torch
        n = self.n_timesteps
        dec = self.flow.decoder
        est = dec.estimator
        t_emb, dts = self._time_table(B)
        abuf, cbuf = self._buffers(B)
        rate = dec.inference_cfg_rate
        T = x.shape[2]
        LT = att.shape[4] + T
        spk_rep = spks_in[:, :, None].expand(-1, -1, T)
        for step in range(1, n + 1):
            xin = torch.cat([torch.cat([x, x], dim=0), mu_in, spk_rep, cond_in], dim=1)
            d = est.blocks_forward_chunk(xin, t_emb[step - 1], None, cnn[step - 1], att[step - 1], cbuf, abuf)
            cnn_out[step - 1].copy_(cbuf)
            att_out[step - 1, :, :, :, :LT].copy_(abuf[:, :, :, :LT])
            dc, du = d.chunk(2, dim=0)
            x = x + dts[step - 1] * ((1.0 + rate) * dc - rate * du)
        return x, cnn_out, att_out[:, :, :, :, :LT]

    def _flow_batch(self, tok, spk, cache: dict, last: bool):
        """``flow.inference_chunk`` for a batch (see module doc). Returns (mel [B, 80, T], caches).
        On CUDA, non-final chunks of up to :data:`GRAPH_MAX_BATCH` streams replay a captured graph
        of the 10-step Euler loop (the DiT is ~8,000 small kernels per chunk)."""
        torch = self.torch
        F = torch.nn.functional
        flow = self.flow
        spk = flow.spk_embed_affine_layer(F.normalize(spk, dim=1))
        h, c_cnn, c_att = flow.encoder.forward_chunk(xs=flow.input_embedding(tok), last_chunk=last,
                                                     cnn_cache=cache["conformer_cnn_cache"],
                                                     att_cache=cache["conformer_att_cache"])
        mu = flow.encoder_proj(h).transpose(1, 2).contiguous()
        B = mu.shape[0]
        dec = flow.decoder
        att, cnn = cache["estimator_att_cache"], cache["estimator_cnn_cache"]
        offset = att.shape[4]
        x0 = dec.rand_noise[:, :, offset:offset + mu.size(2)].expand(B, -1, -1)
        mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)
        spks_in = torch.cat([spk, torch.zeros_like(spk)], dim=0)
        g = None
        if self._use_graphs and not last and B <= GRAPH_MAX_BATCH:
            Bb = next(b for b in (1, 2, 4, 8, 16, 32) if b >= B)
            key = (Bb, mu.shape[2], att.shape[4])
            g = self._dit_graphs.get(key)
            if g is None:
                try:
                    g = _DiTGraph(self, Bb, mu.shape[2], att.shape[4])
                except Exception as exc:  # noqa: BLE001 - fall back to the eager loop for good
                    import logging

                    logging.getLogger("duplexkit.code2wav").warning("Euler-loop graph capture failed (%s); eager from now", exc)
                    self._use_graphs = False
                else:
                    self._dit_graphs[key] = g
                    self.stats["dit_graph_captures"] = self.stats.get("dit_graph_captures", 0) + 1
        if self._use_graphs and not last and B <= GRAPH_MAX_BATCH and g is not None:
            x, new_cnn, new_att = g.run(B, x0, mu_in, spks_in, cnn, att)
        else:
            n = self.n_timesteps
            att_out = torch.empty(n, *att.shape[1:4], att.shape[4] + mu.shape[2], att.shape[5], device=mu.device,
                                  dtype=att.dtype)
            cnn_out = torch.empty_like(cnn)
            x, new_cnn, new_att = self._euler(B, x0, mu_in, spks_in, torch.zeros_like(mu_in), cnn, att, att_out, cnn_out)
        return x, {"conformer_cnn_cache": c_cnn, "conformer_att_cache": c_att,
                   "estimator_cnn_cache": new_cnn, "estimator_att_cache": new_att}

    def _synth_batch(self, group: List[Tuple[Code2WavStream, np.ndarray]], last: bool) -> List[np.ndarray]:
        """:meth:`Code2Wav._synth` for streams with equal cache shapes (caller holds the lock)."""
        torch = self.torch
        B = len(group)
        for st, _ in group:
            self._ensure_capacity(st.prompt.mel.shape[1])
        tokens = [np.concatenate([st.carry, new]) for st, new in group]
        tok = torch.from_numpy(np.stack(tokens).astype(np.int64)).to(self.device)
        spk = torch.cat([st.prompt.spk for st, _ in group], dim=0)
        cs = [st.flow_cache for st, _ in group]
        cache = {
            "conformer_cnn_cache": torch.cat([c["conformer_cnn_cache"] for c in cs], dim=0),
            "conformer_att_cache": torch.cat([c["conformer_att_cache"] for c in cs], dim=1),
            # CFG layout: the B conditional rows, then the B unconditional rows
            "estimator_cnn_cache": torch.cat([c["estimator_cnn_cache"][:, :, 0:1] for c in cs]
                                             + [c["estimator_cnn_cache"][:, :, 1:2] for c in cs], dim=2),
            "estimator_att_cache": torch.cat([c["estimator_att_cache"][:, :, 0:1] for c in cs]
                                             + [c["estimator_att_cache"][:, :, 1:2] for c in cs], dim=2),
        }
        with torch.inference_mode():
            mel_all, nc = self._flow_batch(tok, spk, cache, last)
        self.stats["flow_calls"] += 1
        self.stats["batched_streams"] += B
        out = []
        for b, (st, _new) in enumerate(group):
            c = {
                "conformer_cnn_cache": nc["conformer_cnn_cache"][b:b + 1].clone(),
                "conformer_att_cache": nc["conformer_att_cache"][:, b:b + 1].clone(),
                "estimator_cnn_cache": torch.cat([nc["estimator_cnn_cache"][:, :, b:b + 1],
                                                  nc["estimator_cnn_cache"][:, :, B + b:B + b + 1]], dim=2),
                "estimator_att_cache": torch.cat([nc["estimator_att_cache"][:, :, b:b + 1],
                                                  nc["estimator_att_cache"][:, :, B + b:B + b + 1]], dim=2),
            }
            out.append(self._finish(st, mel_all[b:b + 1], c, tokens[b], last))
        return out

    def _hift_guard(self, last: bool):
        """HiFT under the CUDA-graph capture lock (it draws from the default CUDA generator, which a
        capture on another thread would break), with cuDNN autotuned conv plans for the steady chunk
        shapes (~25 % less CPU per chunk on the H200, benchmarks/NOTES.md); the turn's variable-length
        last chunk keeps the heuristics."""
        import contextlib

        from .fast_kv import CAPTURE_LOCK

        torch = self.torch
        stack = contextlib.ExitStack()
        stack.enter_context(CAPTURE_LOCK)
        stack.enter_context(torch.backends.cudnn.flags(enabled=True, benchmark=not last and self.device.type == "cuda"))
        return stack
