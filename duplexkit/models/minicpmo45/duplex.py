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
   temperature is 0);
5. ``<|listen|>`` while the turn is open becomes ``<|tts_bos|>``; terminators (listen, chunk_eos,
   chunk_tts_eos) end the unit; ``<|turn_eos|>`` is fed, recorded and ends the turn; any other
   token opens it. Tokens after the first decided one are recorded with their final-norm hidden
   state at their own input position (the talker condition, docs/model.md §6).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Literal, Optional

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    from .thinker import Thinker, ThinkerStream

__all__ = ["DuplexPolicy", "UnitInput", "UnitResult", "run_unit", "sample_logits"]


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

    stream: "ThinkerStream"
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


def sample_logits(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: Optional[torch.Generator],
) -> int:
    """Temperature → top-k → top-p sampling of float32 [V] logits; argmax when temperature ≤ 0."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    x = logits / temperature
    if top_k and 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p and top_p < 1.0:
        sv, si = torch.sort(x, descending=True)
        cp = torch.softmax(sv, dim=-1).cumsum(-1)
        remove = cp - torch.softmax(sv, dim=-1) >= top_p  # keep the smallest prefix reaching top_p
        remove[0] = False
        x = x.clone()
        x[si[remove]] = float("-inf")
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _main_pass_logits(th: "Thinker", st: "ThinkerStream", logits: torch.Tensor, mask_listen: bool,
                      must_continue: bool = False) -> torch.Tensor:
    sp = th.special
    pol = st.policy
    x = logits.clone()
    x[th.forbidden_ids_tensor(x.device)] = float("-inf")
    if pol.repetition_penalty != 1.0 and st.history:
        ids = torch.tensor(sorted(set(st.history[-pol.repetition_window :])), dtype=torch.long, device=x.device)
        x[ids] = x[ids] / pol.repetition_penalty
    te = x[sp.turn_eos]
    x[sp.turn_eos] = te / pol.length_penalty if te > 0 else te * pol.length_penalty
    if pol.listen_prob_scale != 1.0:
        x[sp.im_end] = x[sp.im_end] * pol.listen_prob_scale
    if mask_listen:
        x[sp.listen] = float("-inf")
    if must_continue:  # DuplexPolicy.min_unit_tokens
        x[th.continue_mask_ids_tensor(x.device)] = float("-inf")
    return x


@torch.inference_mode()
def run_unit(th: "Thinker", inp: UnitInput) -> UnitResult:
    """Run one duplex unit for one stream (see module doc). Raises ``ValueError`` on a closed stream."""
    st = inp.stream
    if st.closed:
        raise ValueError(f"stream {st.stream_id} is closed")
    sp = th.special
    pol = st.policy
    t0 = time.perf_counter()
    logits = th.prefill_unit(st, inp.audio, inp.frame)
    t1 = time.perf_counter()

    forced_listen = bool(inp.force_listen) or st.units_done < pol.force_listen_count
    force_speak = bool(inp.force_speak) or st.force_speak_pending
    st.force_speak_pending = False
    if forced_listen and force_speak:
        st.force_speak_pending = True  # applies at the next unit that may speak
        force_speak = False

    turn_start = False
    end_of_turn = False
    generated: List[int] = []
    rec_ids: List[int] = []
    rec_hidden: List[torch.Tensor] = []
    steps = 0
    terminator: Optional[int] = None
    text_chars = 0

    if forced_listen:
        terminator = sp.listen
    else:
        if force_speak and st.turn_ended:
            st.turn_ended = False
            turn_start = True
        limit = pol.unit_limit()
        for j in range(limit):
            if j == limit - 1:
                terminator = sp.chunk_eos
                break
            first_forced = force_speak and j == 0
            must_continue = j < pol.min_unit_tokens and (j > 0 or first_forced or not st.turn_ended)
            tok: Optional[int] = None
            if not first_forced and not must_continue:
                if pol.temperature <= 0:
                    b = int(torch.argmax(logits))
                else:
                    b = int(torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=st.generator))
                if b == sp.chunk_eos:
                    tok = b
            if tok is None:
                x = _main_pass_logits(th, st, logits, mask_listen=first_forced, must_continue=must_continue)
                tok = sample_logits(x, pol.temperature, pol.top_k, pol.top_p, st.generator)
                if tok == sp.listen and not st.turn_ended:
                    tok = sp.tts_bos
                st.history.append(tok)
                if len(st.history) > 4 * pol.repetition_window:
                    del st.history[: -pol.repetition_window]
            if tok in sp.terminators:
                terminator = tok
                break
            generated.append(tok)
            h, logits = th.feed_token(st, tok)
            steps += 1
            if tok == sp.turn_eos:
                st.turn_ended = True
                end_of_turn = True
            elif st.turn_ended:
                st.turn_ended = False
                turn_start = True
            if j >= 1:
                rec_ids.append(tok)
                rec_hidden.append(h)
                if pol.max_unit_chars is not None:
                    text_chars = len(th.tokenizer.decode(rec_ids, skip_special_tokens=True))
                    if text_chars >= pol.max_unit_chars:
                        terminator = sp.chunk_eos
                        break
    assert terminator is not None
    generated += [terminator, sp.unit_end]
    st.pending_ids += [terminator, sp.unit_end]
    st.units_done += 1
    t2 = time.perf_counter()

    H = th.hidden_size
    hidden = torch.stack(rec_hidden).float() if rec_hidden else torch.zeros(0, H, dtype=torch.float32, device=th.device)
    ids = np.asarray(rec_ids, dtype=np.int64)
    return UnitResult(
        decision="listen" if (terminator == sp.listen and not steps) else "speak",
        token_ids=ids,
        hidden=hidden,
        text=th.tokenizer.decode(rec_ids, skip_special_tokens=True) if rec_ids else "",
        turn_start=turn_start,
        end_of_turn=end_of_turn,
        n_tokens=len(rec_ids),
        timings={"prefill_ms": (t1 - t0) * 1000.0, "decode_ms": (t2 - t1) * 1000.0, "decode_steps": steps},
        generated_ids=generated,
        pending_logits=st.last_prefill_logits,
    )
