"""Arrival-rate check of a live input stream: does audio arrive at the rate it was declared at?

A client that declares 24 kHz but sends 16 kHz microphone audio in real time delivers
16 000 samples per wall-clock second while the server reads them as 24 000 Hz audio: the model
hears every word 1.5x too fast and an octave-ish too high, and nothing in the bytes themselves
shows it. The wall clock does: over a few seconds of continuous appends, a real-time source
delivers ``declared_rate`` samples per second.

The rule (:class:`ArrivalRateMonitor`):

* only **continuous** streaming is judged: a gap between two appends longer than
  ``max(min(gap_factor x the previous append's duration, max_gap_ms), min_gap_ms)`` (a paused
  microphone, a client-side VAD that sends only speech, a stalled network or event loop, a client
  idle after sending a whole file at once) starts a new run;
* over the shortest window of at least ``window_ms`` (3 s) of wall time ending at the latest
  append, with at least ``min_appends`` appends, ``ratio = (frames received + lead) / (elapsed s x
  declared rate)``, where ``lead`` is how far the run was ahead of the wall clock when the window
  opened (frames delivered since the run began minus its elapsed time x rate, at least 0): audio
  sent ahead (a file sent at once, then live appends) covers the wall time that follows it;
* ``ratio < min_ratio`` (0.8) is reported, once. That catches a rate declared too high by any common
  factor (16 kHz sent as 24 kHz: 0.67; 8 kHz as 16 kHz: 0.5; 16 kHz as 48 kHz: 0.33) and a
  client that drops audio, while real-time jitter (up to ~600 ms late within 3 s) stays above it;
* a ratio **above** 1 is never reported: sending faster than real time (streaming a file, a client
  catching up after a stall) is legitimate and looks exactly like a rate declared too low, so the
  wall clock cannot tell them apart. ``input_backpressure`` bounds how far ahead a client runs.

Times are milliseconds on any monotonic clock (the Session's ``now_ms``); counts are frames (one
sample per channel) at the declared rate. Pure logic: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

__all__ = ["ArrivalRateMonitor", "RateWarning", "COMMON_RATES"]

#: Sample rates a misdeclared stream is most likely captured at, Hz (telephony, wideband, CD, video).
COMMON_RATES: tuple[int, ...] = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)


@dataclass(frozen=True)
class RateWarning:
    """A stream that arrives too slowly for its declared rate.

    Attributes:
        declared_rate: the declared sample rate, Hz.
        ratio: frames received / (elapsed wall time x declared rate) over the window (< ``min_ratio``).
        window_ms: the wall-clock span the ratio was measured over, ms (>= ``window_ms``).
        apparent_rate: ``declared_rate x ratio``, frames per wall-clock second.
        likely_rate: the :data:`COMMON_RATES` entry within 5 % of ``apparent_rate`` (None if none is).
    """

    declared_rate: int
    ratio: float
    window_ms: float
    apparent_rate: float
    likely_rate: Optional[int]


class ArrivalRateMonitor:
    """Watches one input stream's arrival rate against its declared rate (see the module docstring).

    Args:
        declared_rate: Hz the client declared (``audio.input.format.rate`` / ``sample_rate_hz``).
        window_ms: shortest wall-clock span judged, ms (default 3000).
        min_ratio: report when frames arrive at less than this fraction of the declared rate (0.8).
        min_appends: fewest appends inside the window before it is judged (5).
        gap_factor, min_gap_ms, max_gap_ms: a gap between appends longer than
            ``max(min(gap_factor x previous append's duration, max_gap_ms), min_gap_ms)`` ends a
            continuous run (4, 200 ms, 1500 ms).
    Raises:
        ValueError: a non-positive rate or window, or ``min_ratio`` outside (0, 1].

    Example::

        mon = ArrivalRateMonitor(24000)
        for k in range(40):                       # 16 kHz audio, 100 ms appends, in real time
            w = mon.observe(1600, now_ms=100 * k)
        # w (returned once, at the first judged window) has ratio ~0.667, likely_rate 16000
    """

    def __init__(self, declared_rate: int, *, window_ms: float = 3000.0, min_ratio: float = 0.8,
                 min_appends: int = 5, gap_factor: float = 4.0, min_gap_ms: float = 200.0,
                 max_gap_ms: float = 1500.0) -> None:
        if declared_rate <= 0 or window_ms <= 0:
            raise ValueError(f"declared_rate and window_ms must be > 0, got {declared_rate}, {window_ms}")
        if not (0.0 < min_ratio <= 1.0):
            raise ValueError(f"min_ratio must be in (0, 1], got {min_ratio}")
        self.declared_rate = int(declared_rate)
        self.window_ms = float(window_ms)
        self.min_ratio = float(min_ratio)
        self.min_appends = int(min_appends)
        self.gap_factor = float(gap_factor)
        self.min_gap_ms = float(min_gap_ms)
        self.max_gap_ms = float(max_gap_ms)
        self.warned = False
        self._points: deque = deque()  # (t_ms, cumulative frames, lead frames) of the current run
        self._frames = 0
        self._last_t: Optional[float] = None
        self._last_dur_ms = 0.0
        self._run_t0 = 0.0  # wall time of the run's first append, ms

    def reset(self) -> None:
        """Forget the current run (a new declared format makes a new monitor instead)."""
        self._points.clear()
        self._frames = 0
        self._last_t = None
        self._last_dur_ms = 0.0

    def observe(self, frames: int, now_ms: float) -> Optional[RateWarning]:
        """Record one accepted append of ``frames`` frames at wall time ``now_ms`` (ms).

        Returns a :class:`RateWarning` the first time the rule fires, else None (also every time
        after the first warning: one report per monitor).
        """
        if self.warned or frames <= 0:
            return None
        now = float(now_ms)
        if self._last_t is not None:
            gap = now - self._last_t
            allowed = max(min(self.gap_factor * self._last_dur_ms, self.max_gap_ms), self.min_gap_ms)
            if gap < 0 or gap > allowed:
                self.reset()
        if not self._points:
            self._run_t0 = now
        self._last_t = now
        self._last_dur_ms = frames * 1000.0 / self.declared_rate
        self._frames += frames
        pts = self._points
        lead = max(0.0, self._frames - (now - self._run_t0) * self.declared_rate / 1000.0)
        pts.append((now, self._frames, lead))
        # keep the shortest window of >= window_ms ending now: drop the oldest anchor while the
        # next one still spans the window
        while len(pts) >= 2 and now - pts[1][0] >= self.window_ms:
            pts.popleft()
        t0, f0, lead0 = pts[0]
        span = now - t0
        if span < self.window_ms or len(pts) - 1 < self.min_appends:
            return None
        ratio = (self._frames - f0 + lead0) / (span / 1000.0 * self.declared_rate)
        if ratio >= self.min_ratio:
            return None
        self.warned = True
        apparent = self.declared_rate * ratio
        likely = min(COMMON_RATES, key=lambda r: abs(r - apparent))
        return RateWarning(self.declared_rate, ratio, span, apparent,
                           likely if abs(likely - apparent) <= 0.05 * likely else None)
