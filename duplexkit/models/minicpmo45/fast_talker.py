"""The batched talker: static KV slots per talker turn, one batched prefill and one batched
26-step decode for all speaking streams, captured as a single CUDA graph per (batch, KV-length)
bucket with sampling on the GPU (no host sync inside the unit).

:class:`FastTalker` wraps a :class:`~.talker.Talker` (weights shared) and exposes the same API
(docs/model.md, "Talker"): ``new_turn``, ``generate_units`` (batched: ``batched = True``),
``generate_offline`` (delegated to the wrapped talker, the chat path), ``device``, ``dtype``,
``config``. The duplex algorithm is the talker's (docs/model.md §6): prefill ``[cond..., audio_bos]``
at ``text_start_pos``, then ``budget − 1`` (25) samples, each fed back (so the KV holds exactly the
returned codes), EOS masked for ``min_new_tokens`` steps (26 mid-turn, 0 on a turn's first and
last unit), temperature 0.8 and the sign-aware repetition penalty 1.05 over the call's last 16
codes (:func:`.talker_decode.penalised_logits`), sampling the full distribution; ``top_k`` /
``top_p`` / ``min_p`` and another penalty window are options (items are grouped by them, one graph
per group). Sampling is :func:`.sampling.sample_with_noise` (Gumbel-max) with the noise ``[25, V]``
drawn before the graph from each turn's generator, as the eager talker draws it for a duplex unit:
on the CPU both give the same codes for the same seed. The graph always runs all 25 steps; codes
after a sampled EOS are discarded and their KV positions are beyond the turn's length (overwritten
later, never read).
"""

from __future__ import annotations


import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import detach_traceback
from .fast_kv import (CAPTURE_GATE, KVPool, bucket, capture_graph, cuda_graphs_enabled, decoder_forward,
                      fuse_projections, GraphCache, kv_bucket, reserve_for_warmup)
from . import sampling as S
from .talker import DUPLEX_BUDGET, GREEDY, Talker, TalkerError, TalkerInput, TalkerSampling
from .talker_decode import penalised_logits

__all__ = ["FastTalker", "FastTalkerTurn"]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
KV_BUCKET = 256
PREFILL_ROWS = 32
"""A unit's prefill ``[cond..., audio_bos]`` of at most this many positions runs inside its CUDA
graph, zero-padded to this length (a duplex unit has ~5-20 text tokens + ``audio_bos``:
docs/model.md "30-45 positions per unit" with 25 codes); a longer one runs eagerly before a
decode-only graph."""


class FastTalkerTurn:
    """Per-stream talker state of one model turn (the :class:`~.talker.TalkerTurn` fields) over a
    KV slot of the fast talker's pool; :meth:`reset` returns the slot."""

    def __init__(self, pool: KVPool) -> None:
        self._pool = pool
        self.slot: Optional[int] = None
        self.text_start_pos = 0
        self.units = 0
        self.window_resets = 0
        self.finished_codes = False
        self._cell: list = [None]  # the slot, seen by the finalizer (returns it when the turn is dropped)
        weakref.finalize(self, FastTalkerTurn._free, pool, self._cell)

    @staticmethod
    def _free(pool: KVPool, cell: list) -> None:
        pool.release(cell[0])
        cell[0] = None

    @property
    def cache(self):
        return self.slot

    def ensure_slot(self) -> int:
        if self.slot is None:
            self.slot = self._pool.alloc()
            self._cell[0] = self.slot
        return self.slot

    def reset(self) -> None:
        """Return the KV slot and rewind ``text_start_pos`` to 0 (turn end)."""
        if self.slot is not None:
            self._pool.release(self.slot)
        self.slot = None
        self._cell[0] = None
        self.text_start_pos = 0
        self.units = 0
        self.finished_codes = False


class _UnitGraph:
    """One speaking unit for a (batch bucket ``B``, prefill rows ``T``, KV-length bucket, steps,
    filter) key, over static input buffers (:attr:`inp`).

    With ``T > 0`` the unit's prefill runs inside: inputs ``x`` [B, T, hidden] (each row's
    ``[cond..., audio_bos]``, zero-padded), ``starts`` and ``lens`` [B]; with ``T == 0`` the
    prefill ran before (inputs ``logits0`` [B, V] float32 and ``base`` [B]). Both then take
    ``slots``, ``min_new``, ``temp``, ``greedy``, ``penalty`` and the noise [B, steps, V] and return
    the codes [B, steps] (int64). ``capture=False`` runs the same code eagerly (the CPU tests).
    """

    def __init__(self, ft: "FastTalker", B: int, T: int, kv_len: int, steps: int, filt: tuple, *,
                 capture: bool = True) -> None:
        dev = ft.device
        V = ft.config.num_audio_tokens
        self.ft, self.T, self.kv_len, self.filt, self.steps = ft, T, kv_len, filt, steps
        self.scratch = ft.pool.scratch
        self.inp = dict(
            slots=torch.full((B,), self.scratch, dtype=torch.long, device=dev),
            min_new=torch.zeros(B, dtype=torch.long, device=dev),
            temp=torch.ones(B, 1, dtype=torch.float32, device=dev),
            greedy=torch.ones(B, dtype=torch.bool, device=dev),
            penalty=torch.ones(B, 1, dtype=torch.float32, device=dev),
            noise=torch.ones(B, steps, V, dtype=torch.float32, device=dev),
        )
        if T:
            self.inp.update(x=torch.zeros(B, T, ft.config.hidden_size, dtype=ft.dtype, device=dev),
                            starts=torch.zeros(B, dtype=torch.long, device=dev),
                            lens=torch.ones(B, dtype=torch.long, device=dev))
        else:
            self.inp.update(logits0=torch.zeros(B, V, dtype=torch.float32, device=dev),
                            base=torch.zeros(B, dtype=torch.long, device=dev))
        self.capture = capture
        if capture:
            self.graph, self.codes = capture_graph(self._unit, dev, pool=ft.graph_pool)

    def _unit(self) -> torch.Tensor:
        """The unit on the static inputs: the prefill (or the given ``logits0``/``base``), then the
        steps. Returns codes [B, steps]."""
        inp = self.inp
        if self.T:
            logits, base = self.ft._prefill(inp["x"], inp["starts"], inp["lens"], inp["slots"], self.kv_len)
        else:
            logits, base = inp["logits0"], inp["base"]
        return self.ft._decode(logits, base, inp["slots"], inp["min_new"], inp["temp"], inp["greedy"],
                               inp["penalty"], inp["noise"], kv_len=self.kv_len, steps=self.steps, filt=self.filt)

    def run(self, embeds: Optional[Sequence[torch.Tensor]] = None, **kw) -> torch.Tensor:
        """Copy the inputs of ``n`` rows (``embeds``: n prefill tensors [len <= T, hidden] when ``T >
        0``; the other inputs [n, ...]) into the static buffers, pad the rest with harmless rows
        (scratch slot, greedy) and run the unit. Returns codes [n, steps] (int64; with graphs a view
        of static outputs, read before the next run)."""
        inp = self.inp
        n = kw["slots"].shape[0]
        for k, v in kw.items():
            inp[k][:n].copy_(v)
        if embeds is not None:
            for b, e in enumerate(embeds):
                inp["x"][b, : e.shape[0]].copy_(e)
        if n < inp["slots"].shape[0]:
            inp["slots"][n:].fill_(self.scratch)
            inp["greedy"][n:].fill_(True)
            inp["noise"][n:].fill_(1.0)
            if self.T:
                inp["starts"][n:].zero_()
                inp["lens"][n:].fill_(1)
            else:
                inp["base"][n:].zero_()
        if not self.capture:
            return self._unit()[:n]
        self.graph.replay()
        return self.codes[:n]


class FastTalker:
    """Batched talker over a wrapped :class:`Talker` (see module doc).

    Args:
        talker: the loaded talker (weights shared, not copied).
        slots: initial KV slots (one per live talker turn; grows by ``grow_by`` when exhausted).
        grow_by: slots added when every slot is taken (default 8; a memory plan uses 1: a stream's
            new turn may open before its old one is given back, so the pool is not capped).
        cuda_graphs: capture the unit (default: on CUDA unless ``DUPLEXKIT_CUDA_GRAPHS=0``): its
            prefill of at most :data:`PREFILL_ROWS` positions and its 25 decode steps.
        prefill_rows: prefills of at most this many positions run inside the unit's graph (default
            :data:`PREFILL_ROWS`; 0: every prefill eagerly before a decode-only graph, the
            A/B path of ``benchmarks/talker_unit.py``).

    Raises:
        ValueError: ``prefill_rows`` negative.
    """

    batched = True

    def __init__(self, talker: Talker, *, slots: int = 4, cuda_graphs: Optional[bool] = None,
                 prefill_rows: Optional[int] = None, grow_by: int = 8) -> None:
        self.talker = talker
        self.config = talker.config
        m = talker.model
        fuse_projections(m)
        a0 = m.layers[0].self_attn
        self.pool = KVPool(len(m.layers), talker.config.num_key_value_heads, a0.head_dim,
                           talker.config.max_position_embeddings, dtype=talker.dtype, device=talker.device,
                           slots=slots, grow_by=grow_by)
        self.use_graphs = cuda_graphs_enabled(self.device) if cuda_graphs is None else bool(cuda_graphs)
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        #: capture the unit graphs (False: run the same unit code eagerly, for tests on the CPU)
        self.capture_units = self.use_graphs
        self.prefill_rows = PREFILL_ROWS if prefill_rows is None else int(prefill_rows)
        if self.prefill_rows < 0:
            raise ValueError(f"prefill_rows must be >= 0, got {prefill_rows!r}")
        self.stats = {"graph_captures": 0, "units": 0}
        self._graphs = GraphCache(self.pool, self.stats, "graph_captures", lambda g: g.inp.values())

    # ------------------------------------------------------------------ the Talker API
    @property
    def device(self) -> torch.device:
        return self.talker.device

    @property
    def dtype(self) -> torch.dtype:
        return self.talker.dtype

    def new_turn(self) -> FastTalkerTurn:
        return FastTalkerTurn(self.pool)

    def generate_offline(self, *a, **kw) -> np.ndarray:
        """The chat path (delegated to the wrapped :class:`Talker`)."""
        return self.talker.generate_offline(*a, **kw)

    def __getattr__(self, name: str) -> Any:  # condition(), prefill_embeds(), head_weight(), ...
        return getattr(self.__dict__["talker"], name)

    def warmup(self, batch_sizes=(1, 2, 4, 8, 16), max_kv_len: int = 512, budget: int = DUPLEX_BUDGET) -> int:
        """Capture the unit graphs (prefill of :attr:`prefill_rows` rows + ``budget − 1`` steps) of
        these batch buckets for KV lengths up to ``max_kv_len`` now (engine start-up). Returns the
        number of units captured (0 without CUDA graphs). First reserves KV slots for the largest
        batch size (:func:`.fast_kv.reserve_for_warmup`)."""
        reserve_for_warmup(self.pool, batch_sizes, "talker")
        if not self.use_graphs:
            return 0
        n0 = self.stats["graph_captures"]
        with torch.no_grad():
            for B in sorted({bucket(b, BATCH_BUCKETS) for b in batch_sizes}):
                for L in range(KV_BUCKET, min(max_kv_len, self.config.max_position_embeddings) + 1, KV_BUCKET):
                    self._unit_graph(B, self.prefill_rows, L, budget - 1, _REFERENCE)
        return self.stats["graph_captures"] - n0

    def _unit_graph(self, B: int, T: int, kv_len: int, steps: int, filt: tuple) -> _UnitGraph:
        """The captured unit of this key (captured now if new; all dropped when the KV pool grew)."""
        return self._graphs.get_or_build((B, T, kv_len, steps, filt),
                                         lambda: _UnitGraph(self, B, T, kv_len, steps, filt, capture=self.capture_units))

    # ------------------------------------------------------------------ batched duplex units
    @torch.no_grad()
    def generate_units(self, items: Sequence[TalkerInput]) -> list:
        """Codes of one speaking unit per item, all items together. Returns int64 arrays
        [<= budget − 1] (25 for a full mid-turn unit), or a :class:`TalkerError` in the slot of an
        item with bad input (its turn is left unchanged)."""
        results: list = [None] * len(items)
        prep = []
        cfg = self.config
        for i, it in enumerate(items):
            try:
                if not isinstance(it.turn, FastTalkerTurn):
                    raise TalkerError("turn was not created by this FastTalker.new_turn()")
                if it.budget < 1:
                    raise TalkerError("budget must be >= 1")
                s = it.sampling
                if s is None:
                    s = GREEDY if it.temperature <= 0 else TalkerSampling(temperature=float(it.temperature))
                embeds = self.talker.prefill_embeds(it.token_ids, it.hidden)
                need = embeds.shape[0] + it.budget - 1
                if need > cfg.max_position_embeddings:
                    raise TalkerError(f"one unit needs {need} positions > max_position_embeddings "
                                      f"{cfg.max_position_embeddings}")
            except TalkerError as exc:
                results[i] = detach_traceback(exc)
                continue
            prep.append((i, it, s, embeds))
        groups: Dict[tuple, list] = {}
        for p in prep:
            groups.setdefault((p[1].budget, _filter_key(p[2])), []).append(p)
        for (budget, filt), group in groups.items():
            for (i, _it, _s, _e), codes in zip(group, self._run_group(group, budget, filt)):
                results[i] = codes
        return results

    def _run_group(self, group: list, budget: int, filt: tuple) -> List[np.ndarray]:
        cfg = self.config
        dev = self.device
        turns, embeds = [], []
        min_new, temp, greedy, penalty = [], [], [], []
        for i, it, s, e in group:
            turn: FastTalkerTurn = it.turn
            if it.turn_start and turn.units > 0:
                turn.reset()
            need = e.shape[0] + budget - 1
            if turn.text_start_pos + need > cfg.max_position_embeddings:
                turn.text_start_pos = 0  # 4096-position window full: restart at this unit boundary
                turn.window_resets += 1
            turn.ensure_slot()
            turns.append(turn)
            embeds.append(e)
            min_new.append(int(it.min_new_tokens) if it.min_new_tokens is not None
                           else (0 if (it.turn_start or it.turn_end) else budget))
            temp.append(1.0 if s.greedy else s.temperature)
            greedy.append(bool(s.greedy))
            penalty.append(float(s.repetition_penalty))
        B = len(group)
        T = max(e.shape[0] for e in embeds)
        steps = budget - 1
        V = cfg.num_audio_tokens
        max_pos = cfg.max_position_embeddings
        starts_h = [t.text_start_pos for t in turns]
        lens_h = [e.shape[0] for e in embeds]
        noise = torch.ones(B, max(steps, 1), V, dtype=torch.float32, device=dev)
        draws = [(b, it) for b, (_i, it, s, _e) in enumerate(group) if not s.greedy and steps > 0]
        # no graph capture may be open on another thread while the default CUDA generator (an
        # unseeded turn) is drawn from: hold the capture gate shared (never waits for other stages)
        with CAPTURE_GATE.shared():
            for b, it in draws:  # the eager talker's draw for a unit (talker_decode.run_jobs)
                noise[b] = S.exp_noise([it.generator], steps * V, dev).view(steps, V)
        kw = dict(
            slots=S.device_tensor([t.slot for t in turns], dev, torch.long),
            min_new=S.device_tensor(min_new, dev, torch.long),
            temp=S.device_tensor(temp, dev, torch.float32)[:, None],
            greedy=S.device_tensor(greedy, dev, torch.bool),
            penalty=S.device_tensor(penalty, dev, torch.float32)[:, None],
            noise=noise,
        )
        starts = S.device_tensor(starts_h, dev, torch.long)
        lens = S.device_tensor(lens_h, dev, torch.long)
        max_base = max(p + n for p, n in zip(starts_h, lens_h))
        # the prefill inside the unit's graph: its padded rows write KV up to start + P - 1
        P = self.prefill_rows
        if self.use_graphs and steps > 0 and T <= P and max(starts_h) + P <= max_pos:
            kvl = kv_bucket(max(max_base + steps, max(starts_h) + P), KV_BUCKET, max_pos)
            g = self._unit_graph(bucket(B, BATCH_BUCKETS), P, kvl, steps, filt)
            codes_t = g.run(embeds=embeds, starts=starts, lens=lens, **kw)
        else:
            x = torch.zeros(B, T, cfg.hidden_size, dtype=self.dtype, device=dev)
            for b, e in enumerate(embeds):
                x[b, : e.shape[0]] = e.to(self.dtype)
            logits0, base = self._prefill(x, starts, lens, kw["slots"], kv_bucket(max(starts_h) + T, 64, max_pos))
            if steps <= 0:
                codes_t = torch.zeros(B, 0, dtype=torch.long, device=dev)
            else:
                kvl = kv_bucket(max_base + steps, KV_BUCKET, max_pos)
                if self.use_graphs:
                    g = self._unit_graph(bucket(B, BATCH_BUCKETS), 0, kvl, steps, filt)
                    codes_t = g.run(logits0=logits0, base=base, **kw)
                else:
                    codes_t = self._decode(logits0, base, kw["slots"], kw["min_new"], kw["temp"], kw["greedy"],
                                           kw["penalty"], noise, kv_len=kvl, steps=steps, filt=filt)
        codes_all = codes_t.cpu().numpy()  # the one host sync of the unit
        self.stats["units"] += B
        eos = cfg.eos_code
        out = []
        for b, (turn, e) in enumerate(zip(turns, embeds)):
            row = codes_all[b]
            hit = np.nonzero(row == eos)[0]
            n = int(hit[0]) if hit.size else len(row)
            if hit.size:
                turn.finished_codes = True
            turn.text_start_pos += e.shape[0] + n
            turn.units += 1
            out.append(row[:n].astype(np.int64))
        for (_i, it, _s, _e), turn in zip(group, turns):
            if it.turn_end:
                turn.reset()
        return out

    def _prefill(self, x: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor,
                 kv_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Feed ``x`` [B, T, hidden] (row b's first ``lens[b]`` rows are its prefill, the rest
        padding) at positions ``starts[b] ...`` of each row's slot. Returns (float32 logits [B, V]
        of each row's last prefill position, ``base`` = starts + lens [B]: the position of the first
        fed code). Graph-capturable."""
        B, T = x.shape[:2]
        dev = x.device
        pos = starts[:, None] + torch.arange(T, device=dev)[None]
        h = decoder_forward(self.talker.model, x, pos, slots, self.pool, kv_len)
        last = h[torch.arange(B, device=dev), lens - 1]
        return F.linear(last, self.talker.head_weight()).float(), starts + lens

    def _decode(self, logits, base, slots, min_new, temp, greedy, penalty, noise, *, kv_len: int, steps: int,
                filt: tuple) -> torch.Tensor:
        """``steps`` samples, each from ``logits`` [B, V] (float32, then the fed code's) and fed back at
        ``base + s``; returns codes [B, steps] (int64). ``filt`` = (top_k, top_p, min_p,
        repetition_window) of every sampled row. Graph-capturable (no host sync)."""
        B, V = logits.shape
        dev = logits.device
        eos = self.config.eos_code
        top_k, top_p, min_p, W = filt
        head = self.talker.head_weight()
        window = torch.full((B, W), V, dtype=torch.long, device=dev)
        eos_col = torch.arange(V, device=dev)[None] == eos
        codes = []
        for s in range(steps):
            lg = logits.masked_fill(eos_col & (min_new[:, None] > s), float("-inf"))
            x = penalised_logits(lg, window, temp, penalty)
            pick = S.sample_with_noise(x, noise[:, s], top_k, top_p, min_p)
            code = torch.where(greedy, torch.argmax(lg, dim=-1), pick)
            codes.append(code)
            window = torch.cat([window[:, 1:], code[:, None]], dim=1)
            # every returned code is fed, so the KV holds exactly the returned codes (docs/model.md §6;
            # the budget's last sample is never drawn)
            xe = self.talker.code_embed(code)[:, None]
            h = decoder_forward(self.talker.model, xe, (base + s)[:, None], slots, self.pool, kv_len)[:, 0]
            logits = F.linear(h, head).float()
        return torch.stack(codes, dim=1)


_REFERENCE = (None, None, None, 16)
"""The filter key of the reference duplex sampling (no filter, 16-code penalty window) and of greedy items."""


def _filter_key(s: TalkerSampling) -> tuple:
    """Items of one graph share (top_k, top_p, min_p, repetition_window); greedy ignores them."""
    return _REFERENCE if s.greedy else (s.top_k, s.top_p, s.min_p, s.repetition_window)
