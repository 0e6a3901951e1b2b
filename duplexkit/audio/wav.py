"""WAV (and any libsndfile format) read/write: anything in -> mono float32 at the rate asked for."""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
import soundfile as sf

from duplexkit.errors import AudioTooLongError, ErrorCode

from .codecs import AudioFormatError
from .resample import resample

__all__ = ["read_wav", "write_wav", "wav_bytes"]

Source = Union[str, Path, bytes, bytearray, memoryview, BinaryIO]


def read_wav(src: Source, rate: int | None = None, *, max_s: float | None = None) -> tuple[np.ndarray, int]:
    """Read an audio file (WAV, FLAC, OGG, ... whatever libsndfile reads) as mono float32.

    Args:
        src: a path, the file's bytes, or a binary file object.
        rate: output rate in Hz; ``None`` keeps the file's rate. Resampling uses soxr (HQ).
        max_s: longest accepted duration in seconds, or None. The length is read from the container
            header *before* anything is decoded, and decoding stops after ``max_s`` anyway (a header
            that lies cannot make it decode more): a small compressed file of a long silence costs
            no memory.
    Returns:
        ``(audio, rate)``: float32 [n] in [-1, 1] (channels averaged), and its rate in Hz.
    Raises:
        FileNotFoundError for a missing path; AudioFormatError("bad_audio") for data libsndfile
        cannot read or non-finite samples; AudioTooLongError (an AudioFormatError, code
        ``bad_audio``, message ``audio too long: 300.5 s, at most 60 s``) for audio longer than
        ``max_s``; ValueError for a
        non-positive ``rate``.
    """
    if rate is not None and int(rate) <= 0:
        raise ValueError(f"expected a positive rate in Hz, got {rate}")
    if isinstance(src, (bytes, bytearray, memoryview)):
        src = io.BytesIO(bytes(src))
    elif isinstance(src, (str, Path)):
        p = Path(src)
        if not p.exists():
            raise FileNotFoundError(f"audio file not found: {p}")
        if p.is_dir():
            raise AudioFormatError(ErrorCode.BAD_AUDIO, f"expected an audio file, got a directory: {p}")
        src = str(p)
    try:
        if max_s is None:
            data, sr = sf.read(src, dtype="float32", always_2d=True)
        else:
            with sf.SoundFile(src) as f:
                sr = f.samplerate
                limit = int(np.ceil(max_s * sr))
                if f.frames > limit:  # from the header: nothing decoded yet
                    raise AudioTooLongError(f.frames / sr, max_s)
                data = f.read(limit + 1, dtype="float32", always_2d=True)
                if len(data) > limit:
                    raise AudioTooLongError(None, max_s)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        # libsndfile's own reason ("Format not recognised"), without soundfile's "Error opening
        # <_io.BytesIO object at 0x...>:" prefix for in-memory sources
        why = getattr(exc, "error_string", None) or str(exc)
        where = f"{src}: " if isinstance(src, str) else ""
        raise AudioFormatError(ErrorCode.BAD_AUDIO, f"expected an audio file libsndfile can read (WAV, FLAC, OGG, ...), "
                                            f"got: {where}{why}") from exc
    if data.size and not np.isfinite(data).all():
        raise AudioFormatError(ErrorCode.BAD_AUDIO, "expected finite samples in the audio file, got NaN or inf")
    mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    mono = np.clip(np.ascontiguousarray(mono, dtype=np.float32), -1.0, 1.0)
    if rate is not None and int(rate) != sr:
        mono = resample(mono, int(sr), int(rate))
        sr = int(rate)
    return mono, int(sr)


def _check_audio(audio: np.ndarray, rate: int) -> np.ndarray:
    a = np.asarray(audio, dtype=np.float32)
    if a.ndim != 1:
        raise ValueError(f"expected mono audio of shape [n], got shape {a.shape}")
    if int(rate) <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if a.size and not np.isfinite(a).all():
        raise AudioFormatError(ErrorCode.BAD_AUDIO, "expected finite float samples, got NaN or inf")
    return np.clip(a, -1.0, 1.0)


def write_wav(dst: str | Path | BinaryIO, audio: np.ndarray, rate: int) -> None:
    """Write mono float32 [n] audio as a 16-bit PCM WAV at ``rate`` Hz (values clipped to [-1, 1]).

    Raises ValueError for non-1-D audio or a non-positive rate, AudioFormatError("bad_audio") for NaN/inf.
    """
    a = _check_audio(audio, rate)
    if isinstance(dst, Path):
        dst = str(dst)
    sf.write(dst, a, int(rate), subtype="PCM_16", format="WAV")


def wav_bytes(audio: np.ndarray, rate: int) -> bytes:
    """The bytes of a 16-bit PCM mono WAV file holding ``audio`` (float32 [n]) at ``rate`` Hz."""
    buf = io.BytesIO()
    write_wav(buf, audio, rate)
    return buf.getvalue()
