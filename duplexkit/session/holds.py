"""Input the pipeline holds back, each with its machine (docs/concepts.md "Early unit close",
"Barge-in"): the padding debt of early unit closes (:class:`PadDebt`) and the barge-in unit hold
(:class:`UnitHold`). Owned by :class:`~duplexkit.session.pipeline.InputPipeline`; pure bookkeeping
(no outputs): the pipeline frames and appends what they give back."""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Callable, Optional

import numpy as np

from duplexkit.engine.api import INPUT_SAMPLE_RATE
from duplexkit.session.machine import Machine


class DebtState(str, Enum):
    """``clear``: nothing owed; ``owed``: zero padding the model heard ahead of the input, not yet
    paid; ``holding``: real samples held while deciding what the padding stood in for."""

    CLEAR = "clear"
    OWED = "owed"
    HOLDING = "holding"


class DebtEvent(str, Enum):
    PAD = "pad"  # an early unit close padded its unit with zeros
    HOLD = "hold"  # real input arrived while owing and no response is active
    KEEP = "keep"  # a response is active (or a unit is closed): the hold is framed, the debt stays owed
    SETTLE = "settle"  # decided: the padding is paid (samples dropped) or forgiven (speech)
    CLEAR = "clear"  # input_audio_buffer.clear: the hold is dropped, the debt stays owed


DEBT_TABLE = {
    DebtState.CLEAR: {DebtEvent.PAD: DebtState.OWED, DebtEvent.KEEP: DebtState.CLEAR, DebtEvent.CLEAR: DebtState.CLEAR},
    DebtState.OWED: {DebtEvent.PAD: DebtState.OWED, DebtEvent.HOLD: DebtState.HOLDING, DebtEvent.KEEP: DebtState.OWED,
                     DebtEvent.CLEAR: DebtState.OWED},
    DebtState.HOLDING: {DebtEvent.HOLD: DebtState.HOLDING, DebtEvent.KEEP: DebtState.OWED,
                        DebtEvent.SETTLE: DebtState.CLEAR, DebtEvent.CLEAR: DebtState.OWED},
}
"""The padding debt's machine: state -> event -> next state (a missing pair is an internal error)."""


class PadDebt:
    """The padding account of early unit closes (docs/concepts.md "Early unit close").

    A unit closed early goes out zero-padded; the model heard ``owed()`` samples of zeros ahead of
    the input. The real samples that follow are held (:meth:`hold`) until it is known what the
    padding stood in for: silence (the first ``owed`` held samples are dropped, the model already
    heard zeros in their place) or speech (only the samples before the speech's pre-roll are
    dropped; the rest of the debt is forgiven). Sample counts are 16 kHz samples.
    """

    def __init__(self) -> None:
        self._owed = 0
        self._held: list = []
        self._n = 0
        self._start = 0  # real-sample index of the first held sample
        self._onset: Optional[int] = None  # real-sample index where speech (with pre-roll) starts
        self._m = Machine("padding debt", DEBT_TABLE, DebtState.CLEAR)

    @property
    def state(self) -> DebtState:
        return self._m.state

    def owed(self) -> int:
        return self._owed

    def held_samples(self) -> int:
        return self._n

    def pad(self, samples: int) -> None:
        """An early unit close padded ``samples`` zeros."""
        if samples:
            self._m.fire(DebtEvent.PAD)
            self._owed += samples

    def hold(self, x16: np.ndarray, start_real: int) -> None:
        """Hold real samples ``x16`` (first at real-sample index ``start_real``)."""
        self._m.fire(DebtEvent.HOLD)
        if self._n == 0:
            self._start = start_real
        self._held.append(x16)
        self._n += x16.size

    def note_onset(self, onset: int) -> None:
        """The VAD found speech from real-sample ``onset`` (pre-roll included)."""
        if self._onset is None or onset < self._onset:
            self._onset = onset

    def clear(self) -> None:
        """``input_audio_buffer.clear``: the held samples are dropped (the debt stays owed)."""
        self._m.fire(DebtEvent.CLEAR)
        self._held, self._n, self._onset = [], 0, None

    def settle(self, keep: bool, vad_speaking: Optional[bool], guard: int) -> Optional[np.ndarray]:
        """Decide what the held samples become; returns those to frame (None: nothing yet).

        Args:
            keep: a response is active: nothing is dropped, the debt stays owed, the hold is framed.
            vad_speaking: the server VAD hears speech now; None without a VAD (then an energy
                onset is looked for in the held samples).
            guard: held samples past the debt needed before a speech onset inside them is surely
                known (the pipeline's guard).
        """
        if self._n == 0:
            if keep:
                self._m.fire(DebtEvent.KEEP)
                self._onset = None
            return None
        held = np.concatenate(self._held) if len(self._held) > 1 else self._held[0]
        h0 = self._start
        drop = 0
        if keep:
            self._m.fire(DebtEvent.KEEP)
        else:
            onset = self._onset
            if vad_speaking is None:
                onset = self._energy_onset(held)
            elif onset is None and vad_speaking:
                onset = h0  # speech already under way: nothing here is silence
            if onset is None and self._n < self._owed + guard:
                return None  # not decided yet: keep holding (the next unit needs these samples anyway)
            drop = self._owed if onset is None else min(self._owed, max(0, onset - h0))
            self._owed = 0  # paid, or (speech) the rest is forgiven: the audio shifts
            self._m.fire(DebtEvent.SETTLE)
        self._held, self._n, self._onset = [], 0, None
        rest = held[drop:]
        return rest if rest.size else None

    def _energy_onset(self, held: np.ndarray) -> Optional[int]:
        """Without a VAD: first 10 ms block of ``held`` at or above -50 dBFS RMS (the VAD's floor at
        threshold 0.5), minus a 300 ms pre-roll, as a real-sample index; None when all is quieter."""
        blk = INPUT_SAMPLE_RATE // 100
        nb = held.size // blk
        if nb == 0:
            return None
        e = np.sqrt(np.mean(np.square(held[: nb * blk].reshape(nb, blk), dtype=np.float64), axis=1))
        hits = np.nonzero(e >= 10.0 ** (-50.0 / 20.0))[0]
        if hits.size == 0:
            return None
        return self._start + int(hits[0]) * blk - 300 * INPUT_SAMPLE_RATE // 1000


class HoldState(str, Enum):
    """``passing``: units go out as they are framed; ``holding``: units wait behind the fence."""

    PASSING = "passing"
    HOLDING = "holding"


class HoldEvent(str, Enum):
    HOLD = "hold"  # a unit joins the hold
    DRAIN = "drain"  # the last held unit went out


HOLD_TABLE = {
    HoldState.PASSING: {HoldEvent.HOLD: HoldState.HOLDING},
    HoldState.HOLDING: {HoldEvent.HOLD: HoldState.HOLDING, HoldEvent.DRAIN: HoldState.PASSING},
}
"""The barge-in unit hold's machine: state -> event -> next state."""


class UnitHold:
    """Units complete during an interruptible response, held until the VAD has looked past them
    (the barge-in fence, docs/concepts.md "Barge-in"), in order."""

    def __init__(self) -> None:
        self._q: deque = deque()  # (Unit, end real-sample index, silence)
        self._samples = 0
        self._m = Machine("unit hold", HOLD_TABLE, HoldState.PASSING)

    @property
    def state(self) -> HoldState:
        return self._m.state

    def __len__(self) -> int:
        return len(self._q)

    def samples(self) -> int:
        """16 kHz samples held."""
        return self._samples

    def hold(self, unit, end_real: int, silence: bool) -> None:
        self._m.fire(HoldEvent.HOLD)
        self._q.append((unit, end_real, silence))
        self._samples += unit.audio.shape[0]

    def release(self, ready: Callable[[int], bool]) -> list:
        """Take, in order, the held units whose end (real-sample index) is ``ready``; stops at the
        first that is not. Returns ``[(unit, silence), ...]``."""
        out = []
        while self._q and ready(self._q[0][1]):
            u, _, silence = self._q.popleft()
            self._samples -= u.audio.shape[0]
            out.append((u, silence))
        if out and not self._q:
            self._m.fire(HoldEvent.DRAIN)
        return out
