"""Stateful stream resampling on soxr (one resampler per stream and direction)."""

from __future__ import annotations

import numpy as np
import soxr

__all__ = ["StreamResampler", "resample", "expected_output_samples"]


def expected_output_samples(n_in: int, in_rate: int, out_rate: int) -> int:
    """Total output samples for ``n_in`` input samples: ``floor(n_in / (in_rate / out_rate) + 0.5)``.

    Evaluated in double precision exactly as libsoxr does (its I/O ratio is the double
    ``in_rate / out_rate``), so an exact ``.5`` tie may round either way (e.g. 480 samples
    24 000 -> 11 025 Hz give 220). This is what soxr's one-shot :func:`soxr.resample` returns, and
    what :class:`StreamResampler` returns in total (``process`` calls plus ``flush``) for any chunking.
    """
    if in_rate == out_rate:
        return int(n_in)
    return int(n_in / (in_rate / out_rate) + 0.5)


def _as_mono_f32(x: np.ndarray) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 1:
        raise ValueError(f"expected mono audio of shape [n], got shape {a.shape}")
    return np.ascontiguousarray(a)


def resample(x: np.ndarray, in_rate: int, out_rate: int, quality: str = "HQ") -> np.ndarray:
    """One-shot resampling of mono float32 [n] from ``in_rate`` to ``out_rate`` Hz (soxr).

    Returns float32 [expected_output_samples(n, in_rate, out_rate)]; ``x`` itself (as float32) when
    the rates are equal.
    """
    a = _as_mono_f32(x)
    if in_rate == out_rate:
        return a
    if a.size == 0:
        return np.zeros(0, np.float32)
    return np.asarray(soxr.resample(a, in_rate, out_rate, quality=quality), dtype=np.float32)


class StreamResampler:
    """Streaming resampler for one stream and one direction (soxr ``ResampleStream``).

    Feed mono float32 chunks of any size to :meth:`process`; call :meth:`flush` at the end of the
    stream. The concatenated output equals soxr's one-shot result for the whole stream (so there is
    no discontinuity at chunk seams) and its total length is exactly
    :func:`expected_output_samples` for any chunking. ``process`` may return fewer samples than
    ``n * out/in`` (the filter delay is held back until later chunks or ``flush``).

    When ``in_rate == out_rate`` it is the identity (input returned as float32, nothing held back).

    Args:
        in_rate, out_rate: Hz, positive integers.
        quality: soxr quality recipe ("HQ" by default; "VHQ", "MQ", "LQ", "QQ").
    Raises:
        ValueError on non-positive rates or non-1-D input.
    """

    def __init__(self, in_rate: int, out_rate: int, quality: str = "HQ") -> None:
        if int(in_rate) <= 0 or int(out_rate) <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
        self.in_rate = int(in_rate)
        self.out_rate = int(out_rate)
        self.quality = quality
        self._stream: soxr.ResampleStream | None = None
        self.samples_in = 0
        self.samples_out = 0
        self.reset()

    @property
    def identity(self) -> bool:
        """True when input and output rates are equal (no filtering)."""
        return self.in_rate == self.out_rate

    def reset(self) -> None:
        """Forget all state (a fresh stream); held-back samples are discarded."""
        self._stream = (
            None
            if self.identity
            else soxr.ResampleStream(self.in_rate, self.out_rate, 1, dtype="float32", quality=self.quality)
        )
        self.samples_in = 0
        self.samples_out = 0

    def process(self, x: np.ndarray) -> np.ndarray:
        """Resample the next chunk. x: float32 [n] at ``in_rate``. Returns float32 [m] at ``out_rate``."""
        a = _as_mono_f32(x)
        self.samples_in += a.size
        if self._stream is None:
            out = a.copy()
        elif a.size == 0:
            out = np.zeros(0, np.float32)
        else:
            out = np.asarray(self._stream.resample_chunk(a, last=False), dtype=np.float32)
        self.samples_out += out.size
        return out

    def flush(self) -> np.ndarray:
        """End the stream: return the held-back tail so the total count is exact, then reset.

        Returns float32 [k] at ``out_rate`` (empty for the identity or an empty stream).
        """
        if self._stream is None or self.samples_in == 0:
            out = np.zeros(0, np.float32)
        else:
            out = np.asarray(self._stream.resample_chunk(np.zeros(0, np.float32), last=True), dtype=np.float32)
            # soxr already yields the exact total; guard against library drift without dropping audio.
            want = expected_output_samples(self.samples_in, self.in_rate, self.out_rate) - self.samples_out
            if out.size < want:
                out = np.concatenate([out, np.zeros(want - out.size, np.float32)])
            elif out.size > want >= 0:
                out = out[:want]
        self.reset()
        return out
