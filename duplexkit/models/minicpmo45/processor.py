"""Input processing for MiniCPM-o 4.5: Whisper log-mel features and image pixels.

Audio (docs/model.md §3.1, parity README case b and "Streaming audio front-end"):

* :func:`log_mel_offline` — the chat()/prepare() path: zero-pad to 30 s, dynamic ``max − 8``
  floor over the whole padded spectrogram, keep ``ceil(samples/160)`` frames.
* :class:`StreamingMel` — the duplex path: the mel of the whole stream buffer (no 30 s padding,
  centre reflect padding at the stream start), no floor while the buffer is shorter than 5 s;
  unit k yields frames ``[max(0, 100k−2), 100k+102)``.
* :func:`audio_embed_count` — ``n = ceil(samples/160)``, ``m = (n−1)//2+1``, ``out = (m−5)//5+1``.

Images (docs/model.md §3.2, parity case c): :func:`image_to_pixels` resizes to the 448 px slice,
normalises with mean = std = 0.5 and returns CHW float32 plus the patch grid.

Everything here is numpy (float64 STFT) except the returned arrays, which are float32.
"""

from __future__ import annotations

from duplexkit.errors import DuplexkitError

import math
from functools import lru_cache
from typing import Tuple

import numpy as np

from duplexkit.units import FIRST_UNIT_CONSUME, FIRST_UNIT_SAMPLES, INPUT_SAMPLE_RATE, UNIT_SAMPLES

__all__ = [
    "SAMPLE_RATE",
    "N_FFT",
    "HOP",
    "N_MELS",
    "FIRST_UNIT_WINDOW",
    "FIRST_UNIT_CONSUME",
    "UNIT_SAMPLES",
    "AudioInputError",
    "ImageInputError",
    "mel_filters",
    "log_mel_offline",
    "StreamingMel",
    "audio_embed_count",
    "image_to_pixels",
]

SAMPLE_RATE = INPUT_SAMPLE_RATE
"""Model input rate in Hz (docs/model.md §3.1; the contract's ``INPUT_SAMPLE_RATE``)."""
N_FFT = 400
HOP = 160
N_MELS = 80
FIRST_UNIT_WINDOW = FIRST_UNIT_SAMPLES
"""Samples read by the first duplex unit (the contract's ``FIRST_UNIT_SAMPLES``, 1035 ms; parity case f)."""
_STREAM_FLOOR_SAMPLES = 5 * SAMPLE_RATE  # dynamic floor from 5 s of buffer on (parity README)
_STREAM_MAX_SAMPLES = 30 * SAMPLE_RATE  # mel window slides by 10 s at 30 s (docs/model.md §3.1)
_STREAM_SLIDE_SAMPLES = 10 * SAMPLE_RATE


class AudioInputError(DuplexkitError, ValueError):
    """Audio input with a bad shape, dtype or non-finite values."""


class ImageInputError(DuplexkitError, ValueError):
    """Image input that is not an RGB uint8 [H, W, 3] array or PIL image."""


@lru_cache(maxsize=1)
def mel_filters() -> np.ndarray:
    """Slaney 80-band mel filterbank over 0–8000 Hz, float64 [201, 80] (= librosa.filters.mel(16000, 400, 80).T)."""
    from transformers.audio_utils import mel_filter_bank

    return mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1,
        num_mel_filters=N_MELS,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )


@lru_cache(maxsize=1)
def _hann() -> np.ndarray:
    n = np.arange(N_FFT, dtype=np.float64)
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * n / N_FFT)  # periodic Hann


def _check_audio(audio) -> np.ndarray:
    if audio is None or isinstance(audio, (str, bytes)):
        raise AudioInputError(f"audio must be a 1-D float32 array at 16 kHz, got {type(audio).__name__}")
    a = np.asarray(audio)
    if a.ndim != 1:
        raise AudioInputError(f"audio must be 1-D mono float32 at 16 kHz, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise AudioInputError(f"audio must be floating point (float32 in [-1, 1]), got {a.dtype}")
    if a.size and not np.all(np.isfinite(a)):
        raise AudioInputError("audio contains NaN or Inf")
    with np.errstate(over="ignore"):
        a = a.astype(np.float32, copy=False)
    if a.size and not np.all(np.isfinite(a)):  # finite float64 beyond float32's range
        raise AudioInputError("audio has values beyond float32's range (expected samples in [-1, 1])")
    return a


def _power_mel(padded: np.ndarray, n_frames: int) -> np.ndarray:
    """Mel power of frames 0..n_frames-1 of an already centre-padded float64 signal -> [80, n_frames]."""
    if n_frames <= 0:
        return np.zeros((N_MELS, 0), np.float64)
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][:n_frames]
    spec = np.fft.rfft(frames * _hann(), axis=-1)
    power = spec.real**2 + spec.imag**2  # [T, 201]
    return (power @ mel_filters()).T  # [80, T]


def log_mel_offline(audio: np.ndarray) -> np.ndarray:
    """Offline Whisper log-mel of one clip (chat()/prepare() path; parity case b step 1).

    Args:
        audio: float32 [N] mono at 16 kHz, N ≤ 480 000 (30 s; split longer audio first).
    Returns:
        float32 [80, ceil(N/160)].
    Raises:
        AudioInputError: bad shape/dtype, non-finite values or longer than 30 s.
    """
    a = _check_audio(audio).astype(np.float64)
    if a.size > _STREAM_MAX_SAMPLES:
        raise AudioInputError(f"offline mel takes at most 30 s ({_STREAM_MAX_SAMPLES} samples); split first")
    x = np.zeros(_STREAM_MAX_SAMPLES, np.float64)
    x[: a.size] = a
    padded = np.pad(x, N_FFT // 2, mode="reflect")
    n_all = 1 + _STREAM_MAX_SAMPLES // HOP  # centred frames; the last one is dropped
    mel = _power_mel(padded, n_all - 1)
    log = np.log10(np.maximum(mel, 1e-10))
    log = np.maximum(log, log.max() - 8.0)
    log = (log + 4.0) / 4.0
    keep = int(math.ceil(a.size / HOP))
    return log[:, :keep].astype(np.float32)


def audio_embed_count(samples: int, pool_step: int = 5) -> int:
    """Embeddings the offline encoder yields for ``samples`` 16 kHz samples (docs/model.md §3.1, §11).

    ``n = ceil(samples/160)``, ``m = (n−1)//2+1``, ``out = (m−pool)//pool+1``; under about
    80 ms this is 0.
    """
    if samples <= 0:
        return 0
    n = -(-samples // HOP)
    m = (n - 1) // 2 + 1
    if m < pool_step:
        return 0
    return (m - pool_step) // pool_step + 1


class StreamingMel:
    """Log-mel of a duplex audio stream, one block per unit (parity README "Streaming audio front-end").

    The buffer holds every sample handed in since the stream started (unit 0: the 16 560-sample
    window; unit k ≥ 1: the next 16 000 samples), up to 30 s; past 30 s the buffer slides by 10 s.
    ``push(audio)`` returns the mel block of the unit just pushed: float32 [80, 102] for unit 0,
    [80, 104] afterwards (100 new frames + 2 context frames per side, none on the left for unit 0).

    The reference computes the STFT of the whole buffer at every unit (from 5 s of buffer on, the
    log floor is the buffer's maximum − 8). A frame's power mel depends only on its own 400
    samples, so it is kept once its window no longer reaches the buffer's right edge (where the
    centre padding reflects): each push computes the frames of the new audio and the few edge
    frames again, and the floor from the kept frames' running maximum. Same numbers as the whole
    buffer's STFT, ~100 frames of work per unit instead of up to 3 000 (30 s). After a slide the
    first two frames of the new buffer are computed again (their left padding reflects the new
    start). ``push`` never writes the kept columns in place, so a shallow copy of a stream's mel
    state (the thinker's step snapshot) stays valid.
    """

    def __init__(self) -> None:
        self._buf = np.zeros(0, np.float64)
        self._buf_start = 0  # absolute sample index of _buf[0] (multiple of HOP)
        self.unit_index = 0
        self._pm = np.zeros((N_MELS, 0), np.float64)  # power mel of the buffer's frames 0.. (capacity grows)
        self._n_final = 0  # frames 0.._n_final-1 of _pm are final (window inside the buffer)
        self._final_max = 0.0  # max of _pm[:, :_n_final]

    def reset(self) -> None:
        self.__init__()

    def push(self, audio: np.ndarray) -> np.ndarray:
        """Append one unit and return its mel block (see class doc). Raises AudioInputError."""
        a = _check_audio(audio).astype(np.float64)
        k = self.unit_index
        if k == 0:
            if a.size > FIRST_UNIT_WINDOW:
                raise AudioInputError(f"unit 0 takes at most {FIRST_UNIT_WINDOW} samples, got {a.size}")
            if a.size < FIRST_UNIT_WINDOW:  # session start: left-pad with zeros (docs/model.md §3.1)
                a = np.concatenate([np.zeros(FIRST_UNIT_WINDOW - a.size), a])
        else:
            if a.size > UNIT_SAMPLES:
                raise AudioInputError(f"unit {k} takes at most {UNIT_SAMPLES} samples, got {a.size}")
            if a.size < UNIT_SAMPLES:
                a = np.concatenate([a, np.zeros(UNIT_SAMPLES - a.size)])
        self._buf = np.concatenate([self._buf, a])
        # absolute frame range of this unit
        f0 = max(0, 100 * k - 2)
        f1 = 100 * k + 102
        # slide the buffer once it passes 30 s, keeping what this unit needs
        if self._buf.size > _STREAM_MAX_SAMPLES:
            drop = _STREAM_SLIDE_SAMPLES
            need_from = f0 * HOP - N_FFT  # a little before the first needed frame
            drop = min(drop, max(0, need_from - self._buf_start))
            drop -= drop % HOP
            if drop > 0:
                self._buf = self._buf[drop:]
                self._buf_start += drop
                self._slide(drop // HOP)
        n_frames = 1 + self._buf.size // HOP
        pm = self._frames(n_frames)
        rel0 = f0 - self._buf_start // HOP
        rel1 = f1 - self._buf_start // HOP
        log = np.log10(np.maximum(pm[:, rel0:rel1], 1e-10))
        if self._buf.size >= _STREAM_FLOOR_SAMPLES:
            top = max(self._final_max, float(pm[:, self._n_final:n_frames].max(initial=0.0)))
            log = np.maximum(log, np.log10(max(top, 1e-10)) - 8.0)
        self.unit_index += 1
        return ((log + 4.0) / 4.0).astype(np.float32)

    def _slide(self, k: int) -> None:
        """The buffer lost its first ``k`` frames' samples: keep the final frames from frame 2 of the
        new buffer on (a new array), frames 0 and 1 are computed again by :meth:`_frames`."""
        keep = max(0, self._n_final - k)
        if keep > 2:
            self._pm = self._pm[:, k:k + keep].copy()
            self._pm[:, :2] = _power_mel(np.pad(self._buf[:N_FFT + HOP], N_FFT // 2, mode="reflect"), 2)
        else:
            keep = 0
            self._pm = np.zeros((N_MELS, 0), np.float64)
        self._n_final = keep
        self._final_max = float(self._pm[:, :keep].max(initial=0.0))

    def _frames(self, n_frames: int) -> np.ndarray:
        """Power mel [80, >= n_frames] of the buffer's frames 0..n_frames-1 (centre reflect padding at
        both ends): the final ones kept, the rest computed now; updates the final count and max."""
        buf, lo = self._buf, self._n_final
        if self._pm.shape[1] < n_frames:  # grow (a new array: kept columns are never written in place)
            pm = np.zeros((N_MELS, max(n_frames + 512, 2 * self._pm.shape[1])), np.float64)
            pm[:, :lo] = self._pm[:, :lo]
            self._pm = pm
        start = lo * HOP - N_FFT // 2
        if start < 0:
            seg = np.pad(buf, N_FFT // 2, mode="reflect")[lo * HOP:]
        else:
            seg = np.pad(buf[start:], (0, N_FFT // 2), mode="reflect")
        self._pm[:, lo:n_frames] = _power_mel(seg, n_frames - lo)
        # frames whose window ends inside the buffer no longer change
        n_final = min(n_frames, max(0, (buf.size - N_FFT // 2) // HOP + 1))
        if n_final > lo:
            self._final_max = max(self._final_max, float(self._pm[:, lo:n_final].max()))
            self._n_final = n_final
        return self._pm


# ------------------------------------------------------------------------------------------------
# Images
# ------------------------------------------------------------------------------------------------


def _best_size(w: int, h: int, scale: int = 448, patch: int = 14) -> Tuple[int, int]:
    """Keep the aspect ratio, area ≈ scale², sides rounded to whole patches (≥ 1 patch)."""
    r = w / h
    hh = scale / math.sqrt(r)
    ww = hh * r
    ww = max(patch, int(round(ww / patch)) * patch)
    hh = max(patch, int(round(hh / patch)) * patch)
    return ww, hh


def image_to_pixels(image, scale: int = 448, patch: int = 14) -> Tuple[np.ndarray, Tuple[int, int]]:
    """One image (a single slice, ``max_slice_nums = 1``) -> normalised pixels (docs/model.md §3.2).

    Args:
        image: RGB uint8 ndarray [H, W, 3] or a PIL image.
        scale: slice side (448, ``slice_config.scale_resolution``).
    Returns:
        (pixels float32 [3, H', W'] with ``(p/255 − 0.5)/0.5``, (H'/14, W'/14) patch grid). A
        448×448 input is not resized (parity case c).
    Raises:
        ImageInputError: not an RGB image.
    """
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ImageInputError(f"image must be RGB uint8 [H, W, 3], got {image.dtype} {image.shape}")
        img = Image.fromarray(image, "RGB")
    elif isinstance(image, Image.Image):
        img = image.convert("RGB")
    else:
        raise ImageInputError(f"unsupported image type {type(image).__name__}")
    w, h = img.size
    tw, th = _best_size(w, h, scale, patch)
    if (tw, th) != (w, h):
        img = img.resize((tw, th), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(img, dtype=np.float32) / 255.0
    arr = (arr - 0.5) / 0.5
    return np.ascontiguousarray(arr.transpose(2, 0, 1)), (th // patch, tw // patch)
