"""The duplex unit policy of MiniCPM-o 4.5 (docs/model.md §5, parity README "Greedy decision rule" and
"Unit loop").

One unit: ``[pending terminator, </unit>] <unit> [<image> 64 emb </image>] 10 audio emb`` →
decisions → ``[tokens…]`` → terminator → ``</unit>``. The terminator and ``</unit>`` of a unit are
fed into the KV at the start of the next unit's prefill (one forward instead of two); positions and
attention are identical to feeding them at the end of the unit (docs/model.md §5.2).

Decision at each step j = 0..budget−1 (budget 20):

1. forced listen (``force_listen`` or the first ``force_listen_count`` units) → ``<|listen|>``;
2. at j = budget−1 ``<|chunk_eos|>`` is fed instead of deciding (≤ 19 decided tokens);
3. boundary pass on the raw logits (argmax when greedy, one sample of the raw softmax otherwise):
   ``<|chunk_eos|>`` ends the unit; skipped at the first decision after ``force_speak``;
4. main pass: forbidden set (``bad_token_ids`` + ``<|tts_pad|>`` + ``<|chunk_eos|>``) → −inf;
   repetition penalty dividing (whatever the sign) the logits of distinct ids among the last 512
   main-pass choices; ``<|turn_eos|>`` length penalty (÷1.1 if positive, ×1.1 otherwise);
   ``listen_prob_scale`` multiplies the ``<|im_end|>`` logit (as the reference; no-op at 1.0);
   ``force_speak`` masks ``<|listen|>``; then temperature / top-k / top-p sampling (argmax when
   temperature is 0); the main pass is computed at every step, also when the boundary pass ends the
   unit (its draw keeps the random stream aligned between paths);
5. ``<|listen|>`` while the turn is open becomes ``<|tts_bos|>``; terminators (listen, chunk_eos,
   chunk_tts_eos) end the unit; ``<|turn_eos|>`` is fed, recorded and ends the turn; any other
   token opens it. Tokens after the first decided one are recorded with their final-norm hidden
   state at their own input position (the talker condition, docs/model.md §6).

Forced speech (teacher forcing, ``engine.api.SpeakText``): while the stream has forced text queued
(:meth:`.thinker.Thinker.speak_text`), each unit is a forced speak whose decided tokens are given, not
chosen: ``<|speak|>``, then the next at most ``tokens_per_unit`` ids of the text (:func:`forced_plan`;
a chunk never ends inside a UTF-8 character), then, after the text's last id, ``<|turn_eos|>``; then
``<|chunk_eos|>`` ends the unit. Forced text wins over forced listen. The forced tokens are fed,
remembered and recorded with their hidden states exactly like sampled ones (step 5), so the talker
speaks them; both passes are still computed for a forced row (the random streams stay in step), and
its main-pass choice is replaced by the forced id on the device before the lookahead launches, so
the batched path and the lookahead take forced rows as they take sampled ones.

This module is the rule's one home: :func:`start_unit` (forced listen / speak), :func:`plan_step`
(what step j computes), :func:`decide` (one row's token and turn state) -- pure functions -- and the
loop :func:`decode_rows` with the two passes (:func:`choose_tokens`, :func:`main_pass_logits`, on the
samplers of :mod:`.sampling`), run by the eager :func:`run_unit` (one row) and by
:meth:`.fast_thinker.FastThinker.step_units` (all rows of a batch). Sampling is Gumbel-max with the
stream's generator (boundary draw first, then the main draw, every step), so both give the same ids
for the same seed on the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Literal, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from . import sampling as S


class ThinkerLike(Protocol):
    """What the unit loop reads of a thinker (:class:`.thinker.Thinker`, :class:`.fast_thinker.FastThinker`):
    a structural type, so this module needs no import of the thinker (which imports it)."""

    config: Any
    special: Any
    tokenizer: Any
    device: Any
    hidden_size: int
    forbidden_ids: List[int]
    continue_mask_ids: List[int]

    def prefill_unit(self, *args: Any, **kwargs: Any) -> Any: ...
    def feed_token(self, *args: Any, **kwargs: Any) -> Any: ...


class ThinkerStreamLike(Protocol):
    """What the unit loop reads and writes of one stream's thinker state (:class:`.thinker.ThinkerStream`)."""

    stream_id: str
    policy: "DuplexPolicy"
    generator: Optional[torch.Generator]
    pending_ids: List[int]
    history: List[int]
    turn_ended: bool
    force_speak_pending: bool
    units_done: int
    closed: bool
    last_prefill_logits: Optional[torch.Tensor]
    forced: List[Tuple[Tuple[int, ...], int]]

__all__ = ["DuplexPolicy", "UnitInput", "UnitResult", "run_unit", "start_unit", "plan_step", "decide", "StepPlan",
           "forced_plan", "ForcedPlan",
           "Decision", "UnitStart", "main_pass_logits", "choose_tokens", "choose_tokens_device", "decode_rows",
           "begin_row", "finish_row", "UnitRow", "HostRead", "Speculation"]


@dataclass
class DuplexPolicy:
    """Per-stream decoding settings of the duplex loop (docs/model.md §5.3; defaults = reference).

    Attributes:
        temperature: 0.0 = greedy (argmax), else sampling temperature (reference 0.7).
        top_k / top_p: sampling filters (20 / 0.8). Ignored when greedy.
        repetition_penalty: 1.05 over ``repetition_window`` (512) previous main-pass choices.
        length_penalty: 1.1 on ``<|turn_eos|>``.
        listen_prob_scale: multiplies the ``<|im_end|>`` logit (reference behaviour; 1.0 = off).
        budget: 20 — at step ``budget−1`` ``<|chunk_eos|>`` is fed instead of sampling.
        max_unit_chars: optional vO-style cut when a unit's text reaches this many characters
            (``None`` = off, the reference).
        force_listen_count: forced listen for the first N units of the stream.
        min_unit_tokens: a speaking unit decides at least this many tokens before it may end
            (duplexkit option, default 0 = off, the reference): while fewer are decided, the
            boundary pass is ignored and the terminators (``<|listen|>``, ``<|chunk_eos|>``,
            ``<|chunk_tts_eos|>``) and ``<|turn_eos|>`` are masked in the main pass (like a
            ``min_new_tokens``). Applies to units that speak (force_speak or an open turn).
        max_unit_tokens: a unit decides at most this many tokens; then ``<|chunk_eos|>`` is fed
            (duplexkit option, default None = only the ``budget`` cut). Together with
            ``min_unit_tokens`` it fixes the token count of speaking units (load tests).
        window_high / window_low: the thinker's sliding context window (the reference "basic"
            window, docs/model.md §10/§11; default 4000 → 3500 tokens; ``None`` = off). Before a unit's
            prefill, when the cache plus that unit's largest possible size would pass
            ``window_high`` positions, the oldest whole units after the session prefix are dropped
            until at most ``window_low`` positions remain (see :meth:`Thinker.slide_window`).
    """

    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    repetition_window: int = 512
    length_penalty: float = 1.1
    listen_prob_scale: float = 1.0
    budget: int = 20
    max_unit_chars: Optional[int] = None
    force_listen_count: int = 0
    min_unit_tokens: int = 0
    max_unit_tokens: Optional[int] = None
    window_high: Optional[int] = 4000
    window_low: Optional[int] = 3500

    def __post_init__(self) -> None:
        if (self.window_high is None) != (self.window_low is None):
            raise ValueError("window_high and window_low must both be set or both be None")
        if self.window_high is not None and not 0 < int(self.window_low) < int(self.window_high):
            raise ValueError(f"need 0 < window_low < window_high, got {self.window_low} / {self.window_high}")
        if self.min_unit_tokens < 0:
            raise ValueError("min_unit_tokens must be >= 0")
        if self.max_unit_tokens is not None and self.max_unit_tokens < 1:
            raise ValueError("max_unit_tokens must be >= 1 (or None)")
        if self.max_unit_tokens is not None and self.min_unit_tokens > self.max_unit_tokens:
            raise ValueError("min_unit_tokens must be <= max_unit_tokens")

    def unit_limit(self) -> int:
        """Decision steps of a unit: ``budget`` or ``max_unit_tokens + 1`` (the +1 step feeds
        ``<|chunk_eos|>``), whichever is smaller."""
        if self.max_unit_tokens is None:
            return self.budget
        return min(self.budget, self.max_unit_tokens + 1)


@dataclass
class UnitInput:
    """One duplex unit for one stream (docs/model.md).

    Attributes:
        stream: the :class:`~duplexkit.models.minicpmo45.thinker.ThinkerStream`.
        audio: float32 [16560] (unit 0; shorter is left-padded) or [16000], 16 kHz mono.
        force_listen: decide ``listen`` for this unit.
        force_speak: mask ``listen`` and skip the boundary pass at this unit's first decision, and
            open the turn (docs/model.md §5.4).
        frame: optional RGB uint8 [H, W, 3] riding this unit (docs/model.md §3.3).
    """

    stream: "ThinkerStreamLike"
    audio: np.ndarray
    force_listen: bool = False
    force_speak: bool = False
    frame: Optional[np.ndarray] = None


@dataclass
class UnitResult:
    """Outcome of one unit (docs/model.md).

    Attributes:
        decision: "listen" when the unit fed nothing but ``<|listen|>`` (incl. forced), else "speak".
            (The reference calls any unit ending with ``<|listen|>`` a listen unit; a unit that
            speaks, ends the turn and then listens is "speak" here so its tokens reach the talker.)
        token_ids: int64 [L] talker tokens (after the unit's first decided token, incl. ``<|turn_eos|>``).
        hidden: float32 [L, H] final-norm hidden states at each token's input position.
        text: transcript of ``token_ids`` (special tokens skipped).
        turn_start: this unit opened the model turn.
        end_of_turn: ``<|turn_eos|>`` was fed in this unit.
        n_tokens: L.
        timings: prefill_ms, decode_ms, decode_steps (LLM forwards in the decode loop).
        generated_ids: every id chosen in this unit incl. the terminator and ``</unit>`` (debug/parity).
        pending_logits: float32 [V] logits at the last prefill position (debug/parity; may be None).
    """

    decision: Literal["listen", "speak"]
    token_ids: np.ndarray
    hidden: torch.Tensor
    text: str
    turn_start: bool
    end_of_turn: bool
    n_tokens: int
    timings: Dict[str, float] = field(default_factory=dict)
    generated_ids: List[int] = field(default_factory=list)
    pending_logits: Optional[torch.Tensor] = None



# ------------------------------------------------------------------------------ the decision rule
@dataclass(frozen=True)
class UnitStart:
    """Row state at the start of a unit (:func:`start_unit`)."""

    forced_listen: bool
    force_speak: bool
    force_speak_pending: bool
    turn_ended: bool
    turn_start: bool


def start_unit(policy: DuplexPolicy, units_done: int, force_listen: bool, force_speak: bool,
               force_speak_pending: bool, turn_ended: bool, forced_text: bool = False) -> UnitStart:
    """Forced listen / forced speak of a unit (pure). A ``force_speak`` that meets a forced listen is
    kept pending for the next unit that may speak; a forced speak opens an ended turn. A unit with
    ``forced_text`` (forced speech queued) is a forced speak whatever else is asked: forced listen
    and a pending ``force_speak`` are dropped (the text answers it)."""
    if forced_text:
        return UnitStart(False, True, False, False, bool(turn_ended))
    forced_listen = bool(force_listen) or units_done < policy.force_listen_count
    speak = bool(force_speak) or force_speak_pending
    pending = False
    if forced_listen and speak:
        pending, speak = True, False
    opens = bool(not forced_listen and speak and turn_ended)
    return UnitStart(forced_listen, speak, pending, turn_ended and not opens, opens)


@dataclass(frozen=True)
class StepPlan:
    """What step ``j`` of a unit computes (:func:`plan_step`).

    Attributes:
        cut: feed ``<|chunk_eos|>`` without deciding (the unit's step limit).
        boundary: run the boundary pass (skipped at a forced speak's first step and while
            ``min_unit_tokens`` is not reached).
        mask_listen: mask ``<|listen|>`` in the main pass (a forced speak's first step).
        must_continue: mask terminators and ``<|turn_eos|>`` (``min_unit_tokens``).
        forced: the token this step decides regardless of the passes (forced speech), or None.
    """

    cut: bool
    boundary: bool
    mask_listen: bool
    must_continue: bool
    forced: Optional[int] = None


@dataclass(frozen=True)
class ForcedPlan:
    """The decided tokens of one forced-speech unit (:func:`forced_plan`).

    Attributes:
        tokens: ``<|speak|>``, the unit's text ids, and ``<|turn_eos|>`` when the text ends here.
        taken: how many text ids of the queue's head the unit speaks.
        ends_text: ``<|turn_eos|>`` is among ``tokens`` (the head's text is done).
    """

    tokens: Tuple[int, ...]
    taken: int
    ends_text: bool


def forced_plan(sp, policy: DuplexPolicy, ids: Sequence[int], per_unit: int,
                decode: Callable[[List[int]], str]) -> ForcedPlan:
    """The next unit of forced text ``ids`` (the rest of the queue's head) at ``per_unit`` ids a unit
    (pure given ``decode``, the tokenizer's ``ids -> text``): ``<|speak|>`` + k ids + ``<|turn_eos|>``
    when the text ends and the unit has room (the unit decides at most ``unit_limit() − 1`` tokens;
    else the turn ends in the next unit). k = min(``per_unit``, room − 1, ids left), moved to the
    nearest count whose text does not end inside a UTF-8 character (shorter first, then longer)."""
    room = policy.unit_limit() - 1
    left = len(ids)
    k = max(0, min(int(per_unit), room - 1, left))

    def broken(n: int) -> bool:
        return n > 0 and decode(list(ids[:n])).endswith("\ufffd")

    if broken(k):
        shorter = next((n for n in range(k - 1, 0, -1) if not broken(n)), None)
        longer = next((n for n in range(k + 1, min(room - 1, left) + 1) if not broken(n)), None)
        k = shorter if shorter is not None else (longer if longer is not None else k)
    ends = k == left and 1 + k + 1 <= room
    toks = (sp.speak,) + tuple(int(t) for t in ids[:k]) + ((sp.turn_eos,) if ends else ())
    return ForcedPlan(tokens=toks, taken=k, ends_text=ends)


def plan_step(policy: DuplexPolicy, j: int, force_speak: bool, turn_ended: bool,
              forced: Optional[Sequence[int]] = None) -> StepPlan:
    """The plan of decision step ``j`` (0-based) of a row (pure). ``forced``: the unit's forced tokens
    (:attr:`ForcedPlan.tokens`): step j decides ``forced[j]``, and the step after the last is the cut."""
    if forced is not None:
        if j < len(forced):
            return StepPlan(False, False, False, False, int(forced[j]))
        return StepPlan(True, False, False, False)
    if j == policy.unit_limit() - 1:
        return StepPlan(True, False, False, False)
    first_forced = force_speak and j == 0
    must = j < policy.min_unit_tokens and (j > 0 or first_forced or not turn_ended)
    return StepPlan(False, not first_forced and not must, first_forced, must)


@dataclass(frozen=True)
class Decision:
    """The outcome of one decision step of a row (:func:`decide`).

    Attributes:
        token: the id chosen (fed unless ``terminator``).
        from_main: the main pass chose it (it joins the repetition history).
        terminator: it ends the unit (not fed now; fed at the next unit's prefill).
        turn_ended: the row's turn state after this token.
        turn_start / end_of_turn: this token opened / ended the model turn.
        record: the token goes to the talker (every fed token after the unit's first decided one).
    """

    token: int
    from_main: bool
    terminator: bool
    turn_ended: bool
    turn_start: bool
    end_of_turn: bool
    record: bool


def decide(sp, plan: StepPlan, j: int, boundary_tok: int, main_tok: int, turn_ended: bool) -> Decision:
    """The per-row duplex rule (pure): a forced step's token (forced speech); else the boundary pass's
    ``<|chunk_eos|>`` ends the unit; else the main pass's token, ``<|listen|>`` becoming ``<|tts_bos|>``
    while the turn is open; terminators end the unit; ``<|turn_eos|>`` ends the turn, any other fed token
    opens it. ``sp``: the special ids."""
    if plan.forced is not None:
        tok, from_main = plan.forced, True
    elif plan.boundary and boundary_tok == sp.chunk_eos:
        tok, from_main = sp.chunk_eos, False
    else:
        tok, from_main = main_tok, True
        if tok == sp.listen and not turn_ended:
            tok = sp.tts_bos
    if tok in sp.terminators:
        return Decision(tok, from_main, True, turn_ended, False, False, False)
    if tok == sp.turn_eos:
        return Decision(tok, from_main, False, True, False, True, j >= 1)
    return Decision(tok, from_main, False, False, turn_ended, False, j >= 1)


def remember(st: "ThinkerStreamLike", tok: int) -> None:
    """Append a main-pass choice to the stream's repetition history (kept at most 4 windows long)."""
    st.history.append(tok)
    w = st.policy.repetition_window
    if len(st.history) > 4 * w:
        del st.history[:-w]


# ------------------------------------------------------------------------------ the two passes
def _masks(th: "ThinkerLike", device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bool [V] masks (forbidden set, ``min_unit_tokens`` set) on ``device``, cached on the thinker."""
    cache = th.__dict__.setdefault("_decision_masks", {})
    key = str(device)
    if key not in cache:
        V = th.config.vocab_size
        cache[key] = (S.seen_mask_rows([th.forbidden_ids], V, device)[0],
                      S.seen_mask_rows([[i for i in th.continue_mask_ids if 0 <= i < V]], V, device)[0])
    return cache[key]


def main_pass_logits(th: "ThinkerLike", sts: Sequence["ThinkerStreamLike"], logits: torch.Tensor,
                     mask_listen: Sequence[bool], must_continue: Sequence[bool]) -> torch.Tensor:
    """Main-pass logits [N, V] of rows of raw logits [N, V] (module doc, step 4): forbidden set,
    the duplex repetition penalty (:func:`.sampling.repetition_penalty_divide`), the ``<|turn_eos|>``
    length penalty (:func:`.sampling.sign_aware_scale`), ``listen_prob_scale``, the listen and
    ``min_unit_tokens`` masks."""
    sp = th.special
    n, V = logits.shape
    dev = logits.device
    pols = [st.policy for st in sts]
    forbid, cont = _masks(th, dev)
    x = logits.masked_fill(forbid, float("-inf"))
    hist = [st.history[-p.repetition_window:] if p.repetition_penalty != 1.0 else [] for st, p in zip(sts, pols)]
    if any(hist):
        pen = S.device_tensor([[p.repetition_penalty if h else 1.0] for p, h in zip(pols, hist)], dev)
        x = S.repetition_penalty_divide(x, S.seen_mask_rows(hist, V, dev), pen)
    lp = S.device_tensor([p.length_penalty for p in pols], dev)
    x[:, sp.turn_eos] = S.sign_aware_scale(x[:, sp.turn_eos], lp)
    scale = [p.listen_prob_scale for p in pols]
    if any(s != 1.0 for s in scale):
        x[:, sp.im_end] = x[:, sp.im_end] * S.device_tensor(scale, dev)
    if any(mask_listen):
        x[:, sp.listen] = x[:, sp.listen].masked_fill(S.device_tensor(list(mask_listen), dev), float("-inf"))
    if any(must_continue):
        x = x.masked_fill(S.device_tensor(list(must_continue), dev)[:, None] & cont[None], float("-inf"))
    return x


def choose_tokens(th: "ThinkerLike", sts: Sequence["ThinkerStreamLike"], logits: torch.Tensor, plans: Sequence[StepPlan],
                  generators: Sequence[Optional[torch.Generator]]) -> Tuple[List[int], List[int]]:
    """Boundary-pass and main-pass choices of rows of raw logits [N, V] (one host sync):
    :func:`choose_tokens_device`, then one ``.tolist()``. Returns ``(boundary ids, main ids)``, N each."""
    both = choose_tokens_device(th, sts, logits, plans, generators).tolist()
    return both[0], both[1]


def choose_tokens_device(th: "ThinkerLike", sts: Sequence["ThinkerStreamLike"], logits: torch.Tensor,
                         plans: Sequence[StepPlan], generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """The two passes of :func:`choose_tokens` without the host read: int64 [2, N] on ``logits``' device
    (row 0 the boundary choices, row 1 the main ones); queues kernels only, no host sync.

    Boundary pass: argmax of the raw logits when greedy, else one sample of their softmax. Main pass:
    :func:`main_pass_logits`, then argmax when greedy, else temperature / top-k / top-p sampling
    (:func:`.sampling.sample`). Row ``r`` draws its noise from ``generators[r]``: first the boundary
    draw (when planned), then the main one, so every path that calls this draws the same numbers."""
    n = logits.shape[0]
    dev = logits.device
    pols = [st.policy for st in sts]
    bnd = torch.argmax(logits, dim=-1)
    rs = [r for r in range(n) if plans[r].boundary and pols[r].temperature > 0]
    if rs:
        idx = S.device_tensor(rs, dev)
        bnd[idx] = S.sample(logits[idx], [generators[r] for r in rs])
    x = main_pass_logits(th, sts, logits, [p.mask_listen for p in plans], [p.must_continue for p in plans])
    main = torch.argmax(x, dim=-1)
    groups: Dict[tuple, List[int]] = {}
    for r, p in enumerate(pols):
        if p.temperature > 0:
            groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(r)
    for (temp, top_k, top_p), rs in groups.items():
        idx = S.device_tensor(rs, dev)
        main[idx] = S.sample(x[idx], [generators[r] for r in rs], temperature=temp, top_k=top_k, top_p=top_p)
    return torch.stack([bnd, main])


# ------------------------------------------------------------------------------ the unit loop
@dataclass
class UnitRow:
    """One stream's unit in progress (shared by the eager and the batched loops)."""

    index: int
    stream: "ThinkerStreamLike"
    force_speak: bool
    turn_start: bool = False
    end_of_turn: bool = False
    terminator: Optional[int] = None
    logits_row: int = 0
    steps: int = 0
    generated: List[int] = field(default_factory=list)
    rec_ids: List[int] = field(default_factory=list)
    rec_hidden: List[torch.Tensor] = field(default_factory=list)
    forced: Optional[ForcedPlan] = None


def open_unit(st: "ThinkerStreamLike", force_listen: bool, force_speak: bool, forced_text: bool = False) -> UnitStart:
    """:func:`start_unit` for the stream's next unit, applied to its turn state (the one place, with
    :func:`decode_rows` and :func:`replay_decided`, that writes ``force_speak_pending`` / ``turn_ended``)."""
    s = start_unit(st.policy, st.units_done, force_listen, force_speak, st.force_speak_pending, st.turn_ended,
                   forced_text)
    st.force_speak_pending = s.force_speak_pending
    st.turn_ended = s.turn_ended
    return s


def replay_decided(th: "ThinkerLike", st: "ThinkerStreamLike", fed: Sequence[int], turn_start: bool) -> Tuple[bool, bool]:
    """Apply tokens that were decided by :func:`decide` elsewhere (the vLLM thinker's logits
    processor) to the stream's host state, as :func:`decode_rows` does token by token: each fed token
    joins the history; ``<|turn_eos|>`` ends the turn, any other token opens one when the turn had
    ended. Returns ``(turn_start, end_of_turn)`` of the unit (``turn_start`` as given, or-ed)."""
    sp = th.special
    end_of_turn = False
    for t in fed:
        remember(st, t)
        if t == sp.turn_eos:
            st.turn_ended, end_of_turn = True, True
        else:
            turn_start |= st.turn_ended
            st.turn_ended = False
    return turn_start, end_of_turn


def begin_row(th: "ThinkerLike", index: int, inp: UnitInput, logits_row: int) -> UnitRow:
    """Apply :func:`start_unit` to the stream and return its :class:`UnitRow` (with the unit's
    :func:`forced_plan` when forced text is queued; the queue itself changes in :func:`finish_row`)."""
    st = inp.stream
    queue = getattr(st, "forced", None)
    plan = None
    if queue:
        ids, per_unit = queue[0]
        plan = forced_plan(th.special, st.policy, ids, per_unit,
                           lambda x: th.tokenizer.decode(x, skip_special_tokens=True))
    s = open_unit(st, inp.force_listen, inp.force_speak, plan is not None)
    row = UnitRow(index=index, stream=st, force_speak=s.force_speak, turn_start=s.turn_start, logits_row=logits_row,
                  forced=plan)
    if s.forced_listen:
        row.terminator = th.special.listen
    return row


FeedFn = Callable[[List["ThinkerStreamLike"], List[int]], Tuple[torch.Tensor, torch.Tensor]]


class Speculation(Protocol):
    """A decode step launched before the host knew the tokens (one-step lookahead, :func:`decode_rows`):
    every row of the launch was fed its main-pass choice at its next position, lengths not advanced."""

    def reuse(self, streams: List["ThinkerStreamLike"]) -> Optional[Tuple[torch.Tensor, torch.Tensor, List[int]]]:
        """The rows that go on (each fed its speculated token, in launch order, a subset of the
        launch): ``(hidden [n, H], logits [n, V], rows)``, the whole launch's n >= len(streams) rows,
        with ``rows[k]`` the row of stream ``k`` in those tensors, and the streams' lengths advanced
        by one -- when that is exactly what ``feed`` would compute for them; else None (nothing
        changed; the caller feeds)."""

    def drop(self) -> None:
        """The launch's results are not used."""


SpeculateFn = Callable[[List["ThinkerStreamLike"], torch.Tensor], Optional[Speculation]]
"""``speculate(streams, tokens)``: launch the decode step of ``streams`` fed int64 [n] device
``tokens`` (no host sync) and return its :class:`Speculation`, or None when it cannot (a row without a
free position or closed, a batch beyond the largest graph bucket)."""


class HostRead:
    """A device tensor's values brought to the host without waiting for the whole stream: on CUDA a
    non-blocking copy into pinned memory and an event recorded after it on the tensor's device's
    current stream (start it before queueing more work); on the CPU a plain copy.

    Args:
        t: the tensor to read (any dtype and shape; its values must be final when this is built).
    """

    def __init__(self, t: torch.Tensor) -> None:
        self.event = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(t.device))
        else:
            self.host = t.clone()

    def wait(self) -> list:
        """Wait for the copy (the event only, not the stream) and return the values as nested lists."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def _free_to_listen(plan: StepPlan, st: "ThinkerStreamLike") -> bool:
    """A row whose unit may end at this decision with ``<|listen|>``: its turn has ended (it is
    listening) and the step neither masks ``<|listen|>`` nor forces a token."""
    return st.turn_ended and not plan.mask_listen and not plan.must_continue and not plan.cut \
        and plan.forced is None


def decode_rows(th: "ThinkerLike", rows: List[UnitRow], logits: torch.Tensor, feed: FeedFn,
                generator: Callable[["ThinkerStreamLike"], Optional[torch.Generator]],
                speculate: Optional[SpeculateFn] = None) -> None:
    """The unit decode of every row in lock step (module doc): :func:`plan_step`, :func:`choose_tokens`,
    :func:`decide`, then ``feed(streams, tokens) -> (hidden [n, H], logits [n, V])`` for the rows that
    go on. ``logits`` [N, V]: row ``r.logits_row`` belongs to ``r``. Sets each row's terminator.

    ``speculate`` (optional; the fast thinker's one-step lookahead): after the choices are queued
    (:func:`choose_tokens_device`) their read to the host is started (:class:`HostRead`), then the
    next step is launched with every row's main-pass choice before the host waits for the read; when
    every row that goes on was fed what was launched and :meth:`Speculation.reuse` accepts them, that
    launch's (hidden, logits) are used, else ``feed`` runs as without it. Same draws, tokens, hidden
    rows and lengths either way. Nothing is launched ahead of a unit's first decision when every row
    is listening and free to stay so (most duplex units are listen units that end there)."""
    sp = th.special
    active = [r for r in rows if r.terminator is None]
    j = 0
    while active:
        plans = [plan_step(r.stream.policy, j, r.force_speak, r.stream.turn_ended,
                           None if r.forced is None else r.forced.tokens) for r in active]
        for r, p in zip(active, plans):
            if p.cut:
                r.terminator = sp.chunk_eos
        plans = [p for p in plans if not p.cut]
        active = [r for r in active if r.terminator is None]
        if not active:
            break
        sel = [r.logits_row for r in active]
        lg = logits if sel == list(range(logits.shape[0])) else logits[S.device_tensor(sel, logits.device)]
        sts = [r.stream for r in active]
        spec = None
        if speculate is None or (j == 0 and all(_free_to_listen(p, s) for p, s in zip(plans, sts))):
            # (no launch ahead of a listening stream's first decision: most such units end there
            # with <|listen|>, and the launched step would be thrown away)
            bnd, main = choose_tokens(th, sts, lg, plans, [generator(s) for s in sts])
        else:
            both = choose_tokens_device(th, sts, lg, plans, [generator(s) for s in sts])
            fr = [k for k, p in enumerate(plans) if p.forced is not None]
            if fr:  # forced speech: launch the forced ids (decide() takes them from the plan)
                both[1, S.device_tensor(fr, both.device)] = S.device_tensor([plans[k].forced for k in fr], both.device)
            read = HostRead(both)  # before the launch: the event must not wait for the next step
            spec = speculate(sts, both[1])
            bnd, main = read.wait()
        fed: List[Tuple[UnitRow, Decision]] = []
        as_launched = True
        for k, r in enumerate(active):
            d = decide(sp, plans[k], j, bnd[k], main[k], r.stream.turn_ended)
            if d.from_main:
                remember(r.stream, d.token)
            if d.terminator:
                r.terminator = d.token
            else:
                r.generated.append(d.token)
                fed.append((r, d))
                as_launched &= d.token == main[k]
        out = None
        if spec is not None:
            out = spec.reuse([r.stream for r, _ in fed]) if fed and as_launched else None
            if out is None:
                spec.drop()
        if not fed:
            break
        if out is None:
            h, logits = feed([r.stream for r, _ in fed], [d.token for _, d in fed])
            at = list(range(len(fed)))
        else:
            h, logits, at = out
        for k, (r, d) in enumerate(fed):
            r.logits_row = at[k]
            r.steps += 1
            r.stream.turn_ended = d.turn_ended
            r.turn_start |= d.turn_start
            r.end_of_turn |= d.end_of_turn
            if d.record:
                r.rec_ids.append(d.token)
                r.rec_hidden.append(h[at[k]])
                mx = r.stream.policy.max_unit_chars
                if mx is not None and r.forced is None \
                        and len(th.tokenizer.decode(r.rec_ids, skip_special_tokens=True)) >= mx:
                    r.terminator = sp.chunk_eos
        active = [r for r, _ in fed if r.terminator is None]
        j += 1


def finish_row(th: "ThinkerLike", row: UnitRow, timings: Dict[str, float]) -> UnitResult:
    """Queue the row's terminator and ``</unit>`` for the next prefill and build its :class:`UnitResult`."""
    sp = th.special
    st = row.stream
    term = row.terminator
    assert term is not None
    row.generated += [term, sp.unit_end]
    st.pending_ids += [term, sp.unit_end]
    st.units_done += 1
    if row.forced is not None:  # the queue's head loses what this unit spoke (a new list: step snapshots)
        (ids, per_unit), rest = st.forced[0], list(st.forced[1:])
        st.forced = rest if row.forced.ends_text else [(tuple(ids[row.forced.taken:]), per_unit)] + rest
    rec = row.rec_ids
    hidden = torch.stack(row.rec_hidden).float() if rec else \
        torch.zeros(0, th.hidden_size, dtype=torch.float32, device=th.device)
    return UnitResult(
        decision="listen" if (term == sp.listen and not row.steps) else "speak",
        token_ids=np.asarray(rec, dtype=np.int64),
        hidden=hidden,
        text=th.tokenizer.decode(rec, skip_special_tokens=True) if rec else "",
        turn_start=row.turn_start,
        end_of_turn=row.end_of_turn,
        n_tokens=len(rec),
        timings=dict(timings, decode_steps=row.steps),
        generated_ids=row.generated,
        pending_logits=st.last_prefill_logits,
    )


@torch.inference_mode()
def run_unit(th: "ThinkerLike", inp: UnitInput) -> UnitResult:
    """Run one duplex unit for one stream, eagerly (the reference-checked path; module doc).
    Raises ``ValueError`` on a closed stream."""
    st = inp.stream
    if st.closed:
        raise ValueError(f"stream {st.stream_id} is closed")
    t0 = time.perf_counter()
    logits = th.prefill_unit(st, inp.audio, inp.frame)
    t1 = time.perf_counter()
    row = begin_row(th, 0, inp, 0)

    def feed(sts, toks):
        h, lg = th.feed_token(sts[0], toks[0])
        return h[None], lg[None]

    decode_rows(th, [row], logits[None], feed, lambda s: s.generator)
    t2 = time.perf_counter()
    return finish_row(th, row, {"prefill_ms": (t1 - t0) * 1000.0, "decode_ms": (t2 - t1) * 1000.0})
