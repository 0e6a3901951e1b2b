"""The unit framer: 16 kHz input audio -> model units (docs/model.md §3.1, parity case f).

MiniCPM-o 4.5's streaming front-end reads a first window of 1035 ms (16 560 samples) but consumes
16 480 of it (rounded down to whole 160-sample hops); the 80 unconsumed samples are prepended by the
model to the next unit, and every later unit consumes 16 000 samples. The framer hands the model
exactly the slices the reference feeds in parity case f:

* unit 0 audio = samples ``[0, 16560)``;
* unit k >= 1 audio = the next 16 000 *new* samples ``[16560 + (k-1)*16000, 16560 + k*16000)``.

Separately it keeps the *consumed* bookkeeping used for millisecond accounting: unit 0 consumes
``[0, 16480)``, unit k consumes ``[16480 + (k-1)*16000, 16480 + k*16000)``.

Zero padding only happens on an explicit :meth:`UnitFramer.flush` (trailing zeros). How the Session
accounts that padding against the silence that follows (early unit close) is in docs/concepts.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from duplexkit.engine.api import FIRST_UNIT_CONSUME, FIRST_UNIT_SAMPLES, INPUT_SAMPLE_RATE, UNIT_SAMPLES

__all__ = ["Unit", "UnitFramer", "UNIT_SAMPLES", "FIRST_WINDOW", "FIRST_CONSUME", "UNIT_RATE"]

# The unit sizes are the model contract's (duplexkit.engine.api, docs/model.md §3.1), kept here
# under the framer's older names: UNIT_SAMPLES (unit k >= 1), FIRST_WINDOW (unit 0 reads),
# FIRST_CONSUME (unit 0 consumes), UNIT_RATE (16 kHz).
FIRST_WINDOW = FIRST_UNIT_SAMPLES
FIRST_CONSUME = FIRST_UNIT_CONSUME
UNIT_RATE = INPUT_SAMPLE_RATE


@dataclass(frozen=True)
class Unit:
    """One unit of model input audio.

    Attributes:
        index: 0, 1, 2, ... within the framer's stream (reset by :meth:`UnitFramer.reset`).
        audio: float32 [first_window] for unit 0, [unit_samples] after (16 560 / 16 000 by default).
        start_sample: position of ``audio[0]`` in the framer timeline (the concatenation of all unit
            audio slices; samples dropped by ``clear()`` are not in it, flush padding is).
        padded_samples: trailing zeros added by ``flush()`` (0 for a full unit).
        consumed_start: first sample this unit consumes (timeline samples).
        consumed_samples: samples this unit consumes (16 480 for unit 0, 16 000 after).
        sample_rate: Hz (16 000).
    """

    index: int
    audio: np.ndarray = field(repr=False)
    start_sample: int
    padded_samples: int = 0
    consumed_start: int = 0
    consumed_samples: int = 0
    sample_rate: int = UNIT_RATE

    @property
    def consumed_end(self) -> int:
        """One past the last consumed sample (timeline samples)."""
        return self.consumed_start + self.consumed_samples

    @property
    def start_ms(self) -> int:
        """Start of the consumed span, integer ms (floor) from the start of the framer timeline."""
        return self.consumed_start * 1000 // self.sample_rate

    @property
    def end_ms(self) -> int:
        """End of the consumed span, integer ms (floor): unit 0 ends at 1030 ms, unit 1 at 2030 ms, ..."""
        return self.consumed_end * 1000 // self.sample_rate

    @property
    def real_samples(self) -> int:
        """Samples of real (not padded) audio in ``audio``."""
        return int(self.audio.shape[0]) - self.padded_samples


class UnitFramer:
    """Cuts a stream of 16 kHz float32 audio into model units.

    Args:
        unit_samples: new samples per unit k >= 1 (default 16 000 = 1 s, docs/model.md §3.1).
        first_window: samples unit 0 reads (default 16 560 = 1035 ms).
        first_consume: samples unit 0 consumes (default 16 480); must be <= first_window.
        sample_rate: Hz, only used for the ms bookkeeping (default 16 000).
    Raises:
        ValueError on non-positive sizes or ``first_consume > first_window``.

    Remainders are carried across :meth:`push` calls; nothing is padded except by :meth:`flush`.
    """

    def __init__(
        self,
        unit_samples: int = UNIT_SAMPLES,
        first_window: int = FIRST_WINDOW,
        first_consume: int = FIRST_CONSUME,
        sample_rate: int = UNIT_RATE,
    ) -> None:
        if unit_samples <= 0 or first_window <= 0 or first_consume <= 0 or sample_rate <= 0:
            raise ValueError("unit_samples, first_window, first_consume and sample_rate must be positive")
        if first_consume > first_window:
            raise ValueError(f"first_consume ({first_consume}) must be <= first_window ({first_window})")
        self.unit_samples = int(unit_samples)
        self.first_window = int(first_window)
        self.first_consume = int(first_consume)
        self.sample_rate = int(sample_rate)
        self._buf = np.zeros(0, np.float32)
        self._index = 0
        self.samples_pushed = 0  #: real samples pushed since construction / reset
        self.samples_dropped = 0  #: real samples dropped by clear() since construction / reset

    # -- state -----------------------------------------------------------------------------
    @property
    def next_index(self) -> int:
        """Index of the next unit to be emitted."""
        return self._index

    @property
    def pending_samples(self) -> int:
        """Samples pushed but not yet framed."""
        return int(self._buf.shape[0])

    @property
    def needed_samples(self) -> int:
        """Samples the next unit reads (first_window for unit 0, unit_samples after)."""
        return self.first_window if self._index == 0 else self.unit_samples

    def _start_sample(self, index: int) -> int:
        return 0 if index == 0 else self.first_window + (index - 1) * self.unit_samples

    def _consumed(self, index: int) -> tuple[int, int]:
        if index == 0:
            return 0, self.first_consume
        return self.first_consume + (index - 1) * self.unit_samples, self.unit_samples

    def _make_unit(self, audio: np.ndarray, padded: int) -> Unit:
        i = self._index
        c0, cn = self._consumed(i)
        self._index += 1
        return Unit(
            index=i,
            audio=audio,
            start_sample=self._start_sample(i),
            padded_samples=padded,
            consumed_start=c0,
            consumed_samples=cn,
            sample_rate=self.sample_rate,
        )

    # -- operations ------------------------------------------------------------------------
    def push(self, x: np.ndarray) -> list[Unit]:
        """Append float32 [n] mono 16 kHz audio; return every unit now complete (possibly none).

        Raises ValueError for non-1-D input.
        """
        a = np.asarray(x, dtype=np.float32)
        if a.ndim != 1:
            raise ValueError(f"expected mono audio of shape [n], got shape {a.shape}")
        self.samples_pushed += a.shape[0]
        buf = np.concatenate([self._buf, a]) if self._buf.size else a.copy()
        units: list[Unit] = []
        pos = 0
        while buf.shape[0] - pos >= self.needed_samples:
            n = self.needed_samples
            units.append(self._make_unit(buf[pos : pos + n].copy(), 0))
            pos += n
        self._buf = buf[pos:].copy() if pos else buf
        return units

    def flush(self, allow_empty: bool = False) -> Unit | None:
        """Emit the pending samples as one unit, zero-padded at the end to full size.

        Returns ``None`` when nothing is pending, unless ``allow_empty``: then a unit of zeros only
        (``padded_samples`` = its full length) is made, for a forced unit that must run now.
        """
        n = self.pending_samples
        if n == 0 and not allow_empty:
            return None
        need = self.needed_samples
        audio = np.zeros(need, np.float32)
        audio[:n] = self._buf
        self._buf = np.zeros(0, np.float32)
        return self._make_unit(audio, need - n)

    def clear(self) -> int:
        """Drop pending samples (not yet framed). Returns how many were dropped."""
        n = self.pending_samples
        self.samples_dropped += n
        self._buf = np.zeros(0, np.float32)
        return n

    def reset(self) -> None:
        """Start a new stream: drop pending samples and restart at unit 0."""
        self._buf = np.zeros(0, np.float32)
        self._index = 0
        self.samples_pushed = 0
        self.samples_dropped = 0
