"""The duplex unit loop on a vLLM thinker (docs/vllm.md, "Duplex units on vLLM").

One duplex stream is one vLLM streaming-input request (:class:`~duplexkit.engine.vllm_thinker.VllmSession`);
one unit is one chunk of it:

* **Input.** ``pending terminator, </unit>`` + ``<unit>`` + the unit's audio embeddings, which
  duplexkit's own audio front end computes (:meth:`Thinker.audio_embeds_stream`, the native
  thinker's streaming mel / Whisper cache / projector) and which reach vLLM as multimodal
  embeddings on placeholder ids (:mod:`duplexkit.engine.vllm_model`). The first unit also carries
  the session prefix (:meth:`Thinker.session_prefix`, reference-voice embeddings included).
* **Decisions.** The duplex rule (:mod:`duplexkit.models.minicpmo45.duplex`: forced listen / speak,
  the step cut, the boundary pass, the main pass with its masks and penalties, ``<|listen|>`` →
  ``<|tts_bos|>`` while the turn is open) runs inside vLLM as a v1 logits processor
  (:class:`duplexkit.engine.vllm_model.DuplexDecisionProcessor`) on the raw logits of each step:
  it computes the native decision with the same functions (:func:`decide_token`) and leaves only
  that token finite, so vLLM's greedy sampler picks it. The request's per-unit state (turn state,
  forced speak, repetition history, policy, special ids) travels in ``SamplingParams.extra_args``;
  the state inside the unit follows from the chunk's output tokens, which the processor sees.
* **End of the unit.** The terminators (``<|listen|>``, ``<|chunk_eos|>``, ``<|chunk_tts_eos|>``)
  are stop ids and ``max_tokens`` is the unit's step limit (the processor feeds ``<|chunk_eos|>``
  at the last step). vLLM keeps every decoded token but the last in the session's context, which
  is the native rule: the terminator is not fed now, it starts the next unit's prefill.
* **Talker input.** With ``hidden=True`` the final-norm rows of the tokens after the first decided
  one come from :class:`~duplexkit.engine.vllm_thinker.HiddenRowsExtension` in its per-request
  mode, so units of several streams may run at once (vLLM batches them).

The host side keeps a :class:`~duplexkit.models.minicpmo45.thinker.ThinkerStream` without KV (audio
caches, turn state, history, pending ids) and returns the native :class:`UnitResult`.

Sampling (``temperature`` > 0) draws inside the processor from a per-stream CPU generator seeded by
the host, in the native order (boundary draw, main draw), so a seeded stream gives the native
thinker's tokens on the CPU.

The sliding window (``DuplexPolicy.window_high`` / ``window_low``, capped by ``max_model_len``)
drops the same whole units as the native window, by re-prefill: the vLLM session is closed and a
new one re-sends the prefix and the kept units (:meth:`VllmDuplexThinker._slide`). Not supported
here: ``max_unit_chars``, images in chat.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from duplexkit.errors import detach_traceback
from duplexkit.engine.vllm_thinker import UnitTokens, VllmBackendError, VllmSession, hidden_rows
from duplexkit.models.minicpmo45 import duplex as D
from duplexkit.models.minicpmo45.duplex import DuplexPolicy, UnitResult
from duplexkit.models.minicpmo45.thinker import Thinker, ThinkerStream

__all__ = ["decision_args", "decide_token", "decide_tokens", "VllmDuplexThinker", "VllmStream", "EXTRA_KEY"]

EXTRA_KEY = "duplexkit"
"""The ``SamplingParams.extra_args`` key of the decision processor's per-unit state."""

_POLICY_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty", "repetition_window", "length_penalty",
                  "listen_prob_scale", "budget", "max_unit_chars", "force_listen_count", "min_unit_tokens",
                  "max_unit_tokens")
_SPECIAL_FIELDS = ("listen", "tts_bos", "chunk_eos", "chunk_tts_eos", "turn_eos", "im_end", "unit_end")


def decision_args(th: Thinker, st: ThinkerStream, start: D.UnitStart, key: str = "", seed: int = 0) -> dict:
    """The decision processor's state of one unit (``extra_args[EXTRA_KEY]``, JSON-able): the
    stream's policy, its turn state and forced speak after :func:`duplex.start_unit`, the last
    ``repetition_window`` main-pass choices, the special ids, the forbidden and ``min_unit_tokens``
    sets, and for sampling the stream's generator key and seed (the processor keeps one CPU
    ``torch.Generator`` per key, seeded once, across units)."""
    sp = th.special
    w = st.policy.repetition_window
    return {
        "policy": {k: getattr(st.policy, k) for k in _POLICY_FIELDS},
        "special": {k: int(getattr(sp, k)) for k in _SPECIAL_FIELDS},
        "terminators": [int(t) for t in sp.terminators],
        "forbidden": [int(t) for t in th.forbidden_ids],
        "continue": [int(t) for t in th.continue_mask_ids],
        "forced_listen": bool(start.forced_listen),
        "force_speak": bool(start.force_speak),
        "turn_ended": bool(st.turn_ended),
        "history": [int(t) for t in st.history[-w:]],
        "key": str(key),
        "seed": int(seed),
    }


class _Rule:
    """The decision rule's inputs rebuilt from :func:`decision_args` (cached per unit by the processor):
    a thinker-like namespace for :func:`duplex.choose_tokens` and the unit's start state."""

    def __init__(self, args: dict, vocab_size: int) -> None:
        sp = args["special"]
        self.special = SimpleNamespace(terminators=tuple(args["terminators"]), **sp)
        self.policy = DuplexPolicy(**args["policy"], window_high=None, window_low=None)
        self.th = SimpleNamespace(special=self.special, config=SimpleNamespace(vocab_size=int(vocab_size)),
                                  forbidden_ids=[i for i in args["forbidden"] if 0 <= i < vocab_size],
                                  continue_mask_ids=list(args["continue"]))
        self.args = args
        # rows whose rules share these (every row of one engine does) are decided in one batch
        self.group = (tuple(self.th.forbidden_ids), tuple(args["continue"]), tuple(args["terminators"]),
                      tuple(sorted(sp.items())), int(vocab_size))


def decide_token(rule: _Rule, raw_logits: torch.Tensor, out: Sequence[int],
                 generator: Optional[torch.Generator] = None) -> int:
    """The native decision of the next step of a unit (``duplex`` module doc).

    Args:
        rule: the unit's :class:`_Rule`.
        raw_logits: float32 [V] raw logits of this step.
        out: the tokens this unit decided so far (all fed: a terminator ends the chunk).
        generator: the stream's generator when its policy samples (temperature > 0): the boundary
            draw, then the main draw, as the native thinker draws them.
    Returns:
        the token id to emit (a terminator ends the unit; vLLM then stops the chunk).
    """
    return decide_tokens([rule], raw_logits[None], [out], [generator])[0]


def decide_tokens(rules: Sequence[_Rule], raw_logits: torch.Tensor, outs: Sequence[Sequence[int]],
                  generators: Sequence[Optional[torch.Generator]], rows: Optional[Sequence[int]] = None) -> List[int]:
    """:func:`decide_token` for the rows of one engine step at once: raw logits [M, V], one rule,
    token list and generator per decided row; ``rows[r]`` is the logits row of rule ``r`` (default
    ``r``), so a caller passes the step's whole logits without gathering them first. Rows that need the model's choice go through one
    :func:`duplex.choose_tokens` call (one host sync) per group of rules sharing the model's id sets
    (all rows of one engine), as the native batched thinker decides its rows; each row still draws
    from its own generator, so the result is the row-by-row one."""
    toks: List[Optional[int]] = [None] * len(rules)
    groups: Dict[tuple, list] = {}
    for r, (rule, out) in enumerate(zip(rules, outs)):
        a, sp = rule.args, rule.special
        if a["forced_listen"]:
            toks[r] = sp.listen
            continue
        j = len(out)
        turn_ended = a["turn_ended"]
        for t in out:  # every fed token ends (turn_eos) or opens the turn (decide())
            turn_ended = t == sp.turn_eos
        plan = D.plan_step(rule.policy, j, a["force_speak"], turn_ended)
        if plan.cut:
            toks[r] = sp.chunk_eos
            continue
        stream = SimpleNamespace(policy=rule.policy, history=list(a["history"]) + [int(t) for t in out])
        groups.setdefault(rule.group, []).append((r, plan, stream, turn_ended, j))
    for items in groups.values():
        idx = [it[0] for it in items]
        src = idx if rows is None else [int(rows[r]) for r in idx]
        x = raw_logits.index_select(0, torch.tensor(src, device=raw_logits.device)).float()
        bnd, main = D.choose_tokens(rules[idx[0]].th, [it[2] for it in items], x, [it[1] for it in items],
                                    [generators[r] for r in idx])
        for k, (r, plan, _stream, turn_ended, j) in enumerate(items):
            toks[r] = D.decide(rules[r].special, plan, j, bnd[k], main[k], turn_ended).token
    return toks  # type: ignore[return-value]


class VllmStream:
    """A duplex stream on the vLLM thinker: the host-side :class:`ThinkerStream` (no KV), its vLLM
    session, the session prefix pieces, and the units in the session's context as segments
    (``[<unit>] + placeholders + fed tokens + [terminator, </unit>]`` ids with the unit's audio
    rows), which a sliding-window re-prefill sends again."""

    def __init__(self, st: ThinkerStream, session: VllmSession, prefix: List[Any], seed: int) -> None:
        self.st = st
        self.session = session
        self.prefix = prefix
        self.seed = seed
        self.key = session.request_id  # the decision processor's generator key (kept across re-opens)
        self.segments: List[tuple] = []
        self.fresh = True  # the session has seen nothing yet: the next chunk carries the prefix (+ kept units)
        self._reopens = 0

    @property
    def epoch(self) -> int:
        return self.session.epoch


class VllmDuplexThinker:
    """Duplex units of MiniCPM-o 4.5 with the thinker's language model on a vLLM engine (module doc).

    Args:
        thinker: the native :class:`Thinker` (its audio front end, tokenizer, special ids and prompt
            builder run here; its language model is not used).
        engine: a started ``AsyncLLM`` on the checkpoint of
            ``export_thinker_llm(..., audio_token_id=thinker.special.unk, image_start_id=thinker.special.image)``
            (``image_start_id`` only for frames), built with
            ``enable_mm_embeds=True``, ``limit_mm_per_prompt={"audio": 0, "image": 0}``,
            ``logits_processors=["duplexkit.engine.vllm_model:DuplexDecisionProcessor"]`` and, for
            ``hidden=True``, ``worker_extension_cls`` :class:`HiddenRowsExtension` (or a subclass)
            and prefix caching off. All calls come from the engine's event loop; units of
            different streams may run concurrently.
        max_model_len: the engine's context cap (units past it raise ``VllmBackendError``).
        hidden: fetch the talker's hidden rows of each unit (the extension's ``"request"`` mode;
            another user of the same engine must not switch it to ``"all"``).
    """

    def __init__(self, thinker: Thinker, engine: Any, max_model_len: int, hidden: bool = True) -> None:
        self.th = thinker
        self.engine = engine
        self.max_model_len = int(max_model_len)
        self.hidden = bool(hidden)
        self._n = 0
        self._hidden_started = False

    def new_stream(self, instructions: Optional[str] = None, ref_audio: Optional[np.ndarray] = None,
                   seed_text: Optional[str] = None, temperature: float = 0.7, seed: Optional[int] = None,
                   force_listen_count: int = 0, policy: Optional[DuplexPolicy] = None) -> VllmStream:
        """Open a stream (arguments as :meth:`Thinker.new_stream`; the policy's ``window_high`` /
        ``window_low`` drive :meth:`_slide`). The prefix is sent with the first unit. ``seed`` None picks a random one here (every tensor-parallel rank must draw the
        same numbers, so the engine never seeds on its own).

        Raises:
            ValueError: bad argument values.
            VllmBackendError: ``max_unit_chars`` (not supported on vLLM).
        """
        th = self.th
        policy = th.stream_policy(temperature, force_listen_count, policy)
        if policy.max_unit_chars is not None:
            raise VllmBackendError("max_unit_chars is not supported by the vLLM thinker")
        st = ThinkerStream(stream_id=f"vllm{self._n}", policy=policy, kv=None, generator=None)
        prefix = th.session_prefix(instructions, ref_audio, seed_text)
        st.prefix_len = sum(len(p) for p in prefix)
        self._n += 1
        seed = secrets.randbits(63) if seed is None else int(seed)
        return VllmStream(st, VllmSession(self.engine, f"dk-{st.stream_id}-{id(st):x}", self.max_model_len), prefix, seed)

    def embed_units(self, streams: Sequence[VllmStream], audios: Sequence[np.ndarray]) -> List[torch.Tensor]:
        """The audio rows of one unit for each stream (the native front end: float32 [10, H] each
        for a 1-s unit of 16 kHz audio, docs/model.md §3.2), advancing each stream's mel and Whisper
        caches. With a native thinker that batches its front end (:class:`FastThinker`: one Whisper
        pass for all streams, whatever their cache lengths, over its Whisper pool) the streams go together;
        otherwise (the reference :class:`Thinker`, one stream) one after the other, which gives the
        same rows.

        Raises:
            ValueError: a stream appears twice, or the checkpoint has no audio encoder.
        """
        if len({id(vs) for vs in streams}) != len(streams):
            raise ValueError("embed_units got the same stream twice")
        th = self.th
        batch = getattr(th, "_audio_embeds_batch", None)
        if batch is not None and len(streams) > 1:
            rows = batch([vs.st for vs in streams], list(audios))
        else:
            rows = [th.audio_embeds_stream(vs.st, a) for vs, a in zip(streams, audios)]
        return [r.float() for r in rows]

    async def units(self, items: Sequence[tuple]) -> list:
        """Several streams' units at once. ``items``: ``(stream, audio, force_listen, force_speak,
        frame)`` tuples, each stream at most once. Every open stream's audio rows are computed first
        (:meth:`embed_units`), then all chunks are submitted together, so vLLM schedules them in the
        same engine steps and decodes the streams in lockstep. (Run inside each :meth:`unit`, the
        front end staggers the submissions by one Whisper pass per stream: at 32 streams on an H200
        that made the vLLM unit 3.6x the native one, benchmarks/results/2026-12-02-vllm-units-h200.md.)

        Returns one ``(UnitResult, epoch)`` per item, in order, or the exception of an item that
        failed on its own (a closed stream, the context full, ...). An exception of the batched
        front end is every open item's result (their caches may have advanced part way).
        """
        out: list = [None] * len(items)
        live = []
        for i, it in enumerate(items):
            if it[0].session.closed:
                out[i] = VllmBackendError(f"session {it[0].session.request_id} is closed")
            else:
                live.append(i)
        try:
            rows = self.embed_units([items[i][0] for i in live], [items[i][1] for i in live])
        except Exception as exc:  # noqa: BLE001 - reported per item, like the engine's other failures
            detach_traceback(exc)
            for i in live:
                out[i] = exc
            return out

        async def one(i: int, aud: torch.Tensor):
            vs, audio, force_listen, force_speak, frame = items[i]
            return await self.unit(vs, audio, bool(force_listen), bool(force_speak), frame, audio_rows=aud)

        got = await asyncio.gather(*(one(i, r) for i, r in zip(live, rows)), return_exceptions=True)
        for i, r in zip(live, got):
            out[i] = r
        return out

    async def unit(self, vs: VllmStream, audio: np.ndarray, force_listen: bool = False,
                   force_speak: bool = False, frame: Optional[np.ndarray] = None,
                   audio_rows: Optional[torch.Tensor] = None) -> "tuple[UnitResult, int]":
        """Run one unit: returns the native :class:`UnitResult` and the epoch the unit was submitted
        in (the caller drops a result whose epoch is stale, see :meth:`barge_in`). ``frame``: an
        optional RGB uint8 [H, W, 3] video frame riding the unit (docs/model.md §3.3; its 64 rows
        from the native vision tower go as an image item; needs the export's ``image_start_id``).
        ``audio_rows``: the unit's audio rows already computed by :meth:`embed_units` (then
        ``audio`` is not read again); None runs the front end here.

        Raises:
            VllmBackendError: the session is closed, the unit would pass ``max_model_len``, or the
                engine ended the unit without a terminator.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        th, st = self.th, vs.st
        sp = th.special
        ph = int(sp.unk)
        t0 = time.perf_counter()
        aud = th.audio_embeds_stream(st, audio).float() if audio_rows is None else audio_rows.float()
        st.last_audio_embeds = aud
        img = th.image_embeds(frame).float() if frame is not None else None
        n_img = 0 if img is None else int(img.shape[0]) + 2
        await self._slide(vs, int(aud.shape[0]) + n_img + st.policy.unit_limit())
        s = D.open_unit(st, force_listen, force_speak)
        ids: List[int] = []
        embeds: List[torch.Tensor] = []
        images: List[torch.Tensor] = []
        if vs.fresh:  # a new session: the prefix, then the units kept by the sliding window
            for p in vs.prefix:
                if isinstance(p, list):
                    ids += p
                else:
                    ids += [ph] * int(p.shape[0])
                    embeds.append(p.float())
            for seg_ids, seg_embeds, seg_images in vs.segments:
                ids += seg_ids
                embeds += seg_embeds
                images += seg_images
            vs.fresh = False
        else:
            ids += st.pending_ids
        unit_ids = [sp.unit]
        if img is not None:
            unit_ids += [sp.image] + [ph] * int(img.shape[0]) + [sp.image_end]
            images.append(img)
        unit_ids += [ph] * int(aud.shape[0])
        ids += unit_ids
        embeds.append(aud)
        limit = 1 if s.forced_listen else st.policy.unit_limit()
        params = SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True,
                                stop_token_ids=[int(t) for t in sp.terminators], output_kind=RequestOutputKind.DELTA,
                                extra_args={EXTRA_KEY: decision_args(th, st, s, vs.key, vs.seed)})
        if self.hidden and not self._hidden_started:
            await self.engine.collective_rpc("dk_hidden_start", args=("request",))
            self._hidden_started = True
        mm = {"audio": embeds, **({"image": images} if images else {})}
        res: UnitTokens = await vs.session.unit(ids, limit, params=params, mm_data=mm)
        t1 = time.perf_counter()
        rows = None
        if self.hidden:
            reply = await self.engine.collective_rpc("dk_hidden_take_request", args=(vs.session.request_id,))
            rows = hidden_rows(reply[0])
        out = list(res.token_ids)
        if not out or out[-1] not in sp.terminators:
            raise VllmBackendError(f"stream {st.stream_id}: unit ended without a terminator ({out})")
        vs.segments.append((unit_ids + out + [sp.unit_end], [aud], [img] if img is not None else []))
        return self._finish(st, s, ids, out, rows, {"prefill_ms": 0.0, "decode_ms": (t1 - t0) * 1000.0}), res.epoch

    async def _slide(self, vs: VllmStream, upcoming: int) -> int:
        """The sliding window on vLLM (docs/vllm.md): before a unit, when the session's context plus
        the pending ids plus ``upcoming`` (the unit's audio rows + its step limit) would pass
        ``min(window_high, max_model_len - 1)``, keep the session prefix and the newest whole units
        that fit in ``min(window_low, high - upcoming)`` (the native window plan,
        :meth:`Thinker.window_plan`), close the vLLM session and open a new one whose first chunk
        re-sends them (a re-prefill: the kept units' states are recomputed without the dropped
        ones, where the native thinker re-rotates its cached keys). Returns the positions dropped.

        Raises:
            VllmBackendError: the prefix plus one unit does not fit.
        """
        st, pol = vs.st, vs.st.policy
        if pol.window_high is None or vs.fresh:
            return 0
        high = min(int(pol.window_high), self.max_model_len - 1)
        cur = vs.session.length + len(st.pending_ids)
        if cur + upcoming <= high:
            return 0
        p = st.prefix_len
        if p + upcoming > high:
            raise VllmBackendError(f"sliding window too small: session prefix {p} + a unit of up to {upcoming} "
                                   f"positions exceeds {high}")
        target = min(int(pol.window_low), high - upcoming)
        keep: List[tuple] = []
        total = p
        for seg in reversed(vs.segments):
            if total + len(seg[0]) > target:
                break
            keep.insert(0, seg)
            total += len(seg[0])
        epoch = vs.session.epoch
        await vs.session.close()
        if self.hidden:
            await self.engine.collective_rpc("dk_hidden_take_request", args=(vs.session.request_id,))
        vs._reopens += 1
        vs.session = VllmSession(self.engine, f"{vs.key}-w{vs._reopens}", self.max_model_len)
        vs.session.epoch = epoch
        vs.segments, vs.fresh = keep, True
        st.pending_ids = []  # inside the last kept segment, or dropped with it
        st.window_slides += 1
        st.window_dropped += cur - total
        return cur - total

    def _finish(self, st: ThinkerStream, s: D.UnitStart, ids: List[int], out: List[int],
                rows: Optional[np.ndarray], timings: Dict[str, float]) -> UnitResult:
        """Replay the unit's tokens on the host state (``duplex.decode_rows`` / ``finish_row``)."""
        sp = self.th.special
        term, fed = out[-1], out[:-1]
        turn_start, end_of_turn = D.replay_decided(self.th, st, fed, s.turn_start)
        if not s.forced_listen and term != sp.chunk_eos:  # a main-pass terminator joins the history
            D.remember(st, term)
        rec = fed[1:]
        if rows is not None and len(rec):
            n_in = len(ids)
            if rows.shape[0] != n_in + len(fed):
                raise VllmBackendError(f"stream {st.stream_id}: {rows.shape[0]} hidden rows for {n_in} inputs and "
                                       f"{len(fed)} fed tokens")
            hidden = torch.from_numpy(rows[n_in + 1:n_in + len(fed)])
        else:
            hidden = torch.zeros(0, self.th.hidden_size, dtype=torch.float32)
        st.pending_ids = [term, sp.unit_end]
        st.units_done += 1
        return UnitResult(
            decision="listen" if (term == sp.listen and not fed) else "speak",
            token_ids=np.asarray(rec, dtype=np.int64), hidden=hidden,
            text=self.th.tokenizer.decode(rec, skip_special_tokens=True) if rec else "",
            turn_start=turn_start, end_of_turn=end_of_turn, n_tokens=len(rec),
            timings=dict(timings, decode_steps=len(fed)), generated_ids=out + [sp.unit_end])

    def barge_in(self, vs: VllmStream) -> int:
        """A barge-in: a new epoch. A unit in flight still runs to its end (its KV stays) and its
        result carries the old epoch; the caller drops it and then ends the model turn
        (:meth:`end_turn`), as the runtime does with the native thinker. Returns the new epoch."""
        return vs.session.barge_in()

    def end_turn(self, vs: VllmStream) -> None:
        """Close the open model turn (:meth:`Thinker.end_turn`)."""
        self.th.end_turn(vs.st)

    async def close(self, vs: VllmStream) -> None:
        """End the session (the engine frees its KV) and the host state."""
        await vs.session.close()
        if self.hidden:  # rows the engine computed for this request after its last unit (none expected)
            await self.engine.collective_rpc("dk_hidden_take_request", args=(vs.session.request_id,))
        self.th.close(vs.st)
