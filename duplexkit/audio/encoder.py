"""Client-side input encoding: float32 audio at any rate -> the session's declared input format.

:class:`StreamEncoder` is the send half of docs/protocol.md §6.1: it follows the format of the last
``session.updated`` (pcm16, pcm_f32le, G.711 mu-law/A-law; any declared rate and channel count),
resampling with ONE streaming resampler per input stream (soxr ``ResampleStream`` through
:class:`~duplexkit.audio.StreamResampler`), never per chunk: the concatenated output equals a
one-shot resample of the whole stream, so 20 ms chunks have no seams.

The resampler is rebuilt (its held-back tail flushed into the old format first) only when the
source rate or the declared format changes.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .codecs import InputFormat, float32_to_alaw, float32_to_f32le, float32_to_pcm16, float32_to_ulaw
from .resample import StreamResampler

__all__ = ["StreamEncoder"]

_ENCODE = {
    "pcm16": float32_to_pcm16,
    "pcm_f32le": float32_to_f32le,
    "g711_ulaw": float32_to_ulaw,
    "g711_alaw": float32_to_alaw,
}


class StreamEncoder:
    """Encode a mono float32 stream for one :class:`~duplexkit.audio.InputFormat`.

    Args:
        fmt: the target format (default pcm16 at 16 000 Hz, mono).
    """

    def __init__(self, fmt: Optional[InputFormat] = None) -> None:
        self.format = fmt or InputFormat("pcm16", 16000)
        self.source_rate: Optional[int] = None
        self._resampler: Optional[StreamResampler] = None
        self.samples_in = 0  #: source samples consumed
        self.samples_out = 0  #: target samples produced (per channel)

    def set_format(self, fmt: InputFormat) -> bytes:
        """Switch to ``fmt``. Returns the bytes still owed in the OLD format (the resampler's
        held-back tail), which the caller sends before any audio in the new one."""
        if fmt == self.format:
            return b""
        tail = self.flush()
        self.format = fmt
        self._resampler = None
        return tail

    def encode(self, x: np.ndarray, rate: int) -> bytes:
        """Encode float32 [n] mono samples at ``rate`` Hz for the current format.

        Returns the encoded bytes (possibly fewer frames than ``n * format.rate / rate`` while the
        resampler's filter fills; the rest comes with later chunks or :meth:`flush`).
        Raises ValueError for non-1-D input or a non-positive rate.
        """
        a = np.asarray(x, np.float32)
        if a.ndim != 1:
            raise ValueError(f"expected mono float32 [n], got shape {a.shape}")
        rate = int(rate)
        if rate <= 0:
            raise ValueError(f"expected a positive sample rate in Hz, got {rate}")
        if self._resampler is None or self.source_rate != rate:
            tail = self.flush() if self._resampler is not None else b""
            self.source_rate = rate
            self._resampler = StreamResampler(rate, self.format.rate)
        else:
            tail = b""
        self.samples_in += a.size
        return tail + self._pack(self._resampler.process(a))

    def flush(self) -> bytes:
        """End the stream: the resampler's held-back tail, encoded (b"" when nothing is held)."""
        if self._resampler is None:
            return b""
        return self._pack(self._resampler.flush())

    def _pack(self, y: np.ndarray) -> bytes:
        if y.size == 0:
            return b""
        self.samples_out += y.size
        ch = self.format.channels
        if ch > 1:  # the same mono signal on every declared channel, interleaved
            y = np.repeat(y, ch)
        return _ENCODE[self.format.encoding](y)
