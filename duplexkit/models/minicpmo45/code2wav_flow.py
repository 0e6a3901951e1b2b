"""The batched Code2Wav's flow (:mod:`.fast_code2wav`): one conformer-encoder call for the streams
whose flow caches have the same shapes, the CFM Euler loop in sub-batches (captured graphs on CUDA,
:mod:`.code2wav_graphs`), and each stream's new flow caches copied out of the group's buffers.

:class:`BatchedFlow` is a mixin of :class:`~.fast_code2wav.BatchedCode2Wav` (it reads the wrapper's
graph tables, sub-batch sizes and ``stats``, and the :class:`~.code2wav.Code2Wav` attributes).
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from .code2wav import FLOW_CACHE_TAIL_FRAMES, Code2WavStream
from .code2wav_graphs import ENCODER_BUCKETS, DiTGraph, EncoderGraph, gather_caches

__all__ = ["BatchedFlow"]


class BatchedFlow:
    """The flow of a round for a group of streams (see module doc)."""

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
