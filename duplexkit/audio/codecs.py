"""Sample codecs: PCM16, float32 LE, G.711 mu-law / A-law, base64, and a streaming decoder.

Input formats follow docs/protocol.md §6.1:

=============  ==============  ================
encoding       rates (Hz)      bytes per sample
=============  ==============  ================
``pcm16``      8 000-48 000    2 (int16 LE)
``pcm_f32le``  8 000-48 000    4 (float32 LE)
``g711_ulaw``  8 000 only      1
``g711_alaw``  8 000 only      1
=============  ==============  ================

Float audio inside duplexkit is always ``np.float32`` in [-1, 1].
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Literal

import numpy as np

from duplexkit.errors import AudioFormatError, ErrorCode

__all__ = [
    "AudioFormatError",
    "InputFormat",
    "StreamDecoder",
    "pcm16_to_float32",
    "float32_to_pcm16",
    "float32_to_f32le",
    "f32le_to_float32",
    "ulaw_to_float32",
    "alaw_to_float32",
    "float32_to_ulaw",
    "float32_to_alaw",
    "b64encode_audio",
    "b64decode_audio",
    "ENCODINGS",
    "BYTES_PER_SAMPLE",
]

Encoding = Literal["pcm16", "pcm_f32le", "g711_ulaw", "g711_alaw"]

#: Bytes per (mono) sample for each input encoding (docs/protocol.md §6.1).
BYTES_PER_SAMPLE: dict[str, int] = {"pcm16": 2, "pcm_f32le": 4, "g711_ulaw": 1, "g711_alaw": 1}
ENCODINGS: tuple[str, ...] = tuple(BYTES_PER_SAMPLE)

#: Accepted rate range for the PCM encodings, Hz (docs/protocol.md §6.1).
PCM_RATE_MIN = 8000
PCM_RATE_MAX = 48000
#: G.711 is 8 kHz only (docs/protocol.md §6.1).
G711_RATE = 8000
#: Most interleaved channels a StreamDecoder accepts (downmixed to mono).
MAX_CHANNELS = 8

# --------------------------------------------------------------------------- PCM16 / float32


def _check_finite(a: np.ndarray, what: str) -> None:
    """AudioFormatError("bad_audio") unless every sample of float array ``a`` is finite (docs/protocol.md §6.1)."""
    if a.size:
        bad = ~np.isfinite(a)
        if bad.any():
            raise AudioFormatError(
                ErrorCode.BAD_AUDIO,
                f"expected finite {what} samples (out-of-range values are clipped to [-1, 1]), "
                f"got {int(bad.sum())} NaN/inf of {a.size}",
            )


def pcm16_to_float32(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Decode little-endian int16 PCM to float32.

    Args:
        data: raw bytes, an even number of them (2 bytes per sample).
    Returns:
        ``np.float32`` array [len(data)//2], ``int16 / 32768`` so values lie in [-1, 1).
    Raises:
        ValueError (an :class:`AudioFormatError` with code ``bad_audio``) if ``len(data)`` is odd.
    """
    mv = memoryview(data).cast("B")
    if len(mv) % 2:
        raise AudioFormatError(
            ErrorCode.BAD_AUDIO, f"expected an even number of pcm16 bytes (2 per sample), got {len(mv)} bytes"
        )
    return np.frombuffer(mv, dtype="<i2").astype(np.float32) * np.float32(1.0 / 32768.0)


def float32_to_pcm16(x: np.ndarray) -> bytes:
    """Encode float audio as little-endian int16 PCM bytes.

    Values are clipped to [-1, 1], scaled by 32767 and rounded to nearest.
    Args:
        x: float array of any shape (flattened, C order). Non-finite values raise.
    Returns:
        ``bytes`` of length ``2 * x.size``.
    Raises:
        AudioFormatError("bad_audio") if ``x`` holds NaN or inf.
    """
    a = np.asarray(x, dtype=np.float32).reshape(-1)
    _check_finite(a, "float")
    return np.round(np.clip(a, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def f32le_to_float32(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Decode little-endian float32 bytes (``pcm_f32le``), validating and clipping.

    Returns float32 [len(data)//4], clipped to [-1, 1].
    Raises AudioFormatError("bad_audio") if the byte count is not a multiple of 4 or a value is
    NaN/inf (docs/protocol.md §6.1: non-finite floats are ``bad_audio``; out-of-range ones are clipped).
    """
    mv = memoryview(data).cast("B")
    if len(mv) % 4:
        raise AudioFormatError(
            ErrorCode.BAD_AUDIO, f"expected a multiple of 4 pcm_f32le bytes (4 per sample), got {len(mv)} bytes"
        )
    a = np.frombuffer(mv, dtype="<f4")
    _check_finite(a, "pcm_f32le")
    return np.clip(a, -1.0, 1.0).astype(np.float32)


def float32_to_f32le(x: np.ndarray) -> bytes:
    """Encode float audio as little-endian float32 bytes (clipped to [-1, 1])."""
    a = np.asarray(x, dtype=np.float32).reshape(-1)
    _check_finite(a, "float")
    return np.clip(a, -1.0, 1.0).astype("<f4").tobytes()


# --------------------------------------------------------------------------- G.711 (ITU-T G.711)


def _ulaw_decode_table() -> np.ndarray:
    u = (~np.arange(256, dtype=np.int32)) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(sign != 0, -magnitude, magnitude).astype(np.int16)


def _alaw_decode_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    sign = a & 0x80
    exponent = (a >> 4) & 0x07
    mantissa = a & 0x0F
    magnitude = np.where(
        exponent == 0,
        (mantissa << 4) + 8,
        ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0),
    )
    # In A-law a set sign bit means a positive sample.
    return np.where(sign != 0, magnitude, -magnitude).astype(np.int16)


def _top_bit(v: np.ndarray) -> np.ndarray:
    """floor(log2(v)) for v >= 1 (int32 array)."""
    out = np.zeros(v.shape, dtype=np.int32)
    w = v.copy()
    for shift in (8, 4, 2, 1):
        m = w >= (1 << shift)
        out[m] += shift
        w[m] >>= shift
    return out


def _ulaw_encode_table() -> np.ndarray:
    x = np.arange(-32768, 32768, dtype=np.int32)
    sign = np.where(x < 0, 0x80, 0)
    mag = np.minimum(np.abs(x), 32635) + 0x84
    exponent = np.clip(_top_bit(mag) - 7, 0, 7)
    mantissa = (mag >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)


def _alaw_encode_table() -> np.ndarray:
    x = np.arange(-32768, 32768, dtype=np.int32)
    sign = np.where(x >= 0, 0x80, 0)
    mag = np.minimum(np.where(x >= 0, x, -x - 1), 32767)
    big = mag >= 256
    exponent = np.where(big, np.clip(_top_bit(np.maximum(mag, 1)) - 7, 1, 7), 0)
    mantissa = np.where(big, (mag >> (exponent + 3)) & 0x0F, (mag >> 4) & 0x0F)
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8)


_ULAW_DEC = _ulaw_decode_table()
_ALAW_DEC = _alaw_decode_table()
_ULAW_DEC_F = _ULAW_DEC.astype(np.float32) / np.float32(32768.0)
_ALAW_DEC_F = _ALAW_DEC.astype(np.float32) / np.float32(32768.0)
_ULAW_ENC = _ulaw_encode_table()
_ALAW_ENC = _alaw_encode_table()


def ulaw_to_int16(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Decode G.711 mu-law bytes to int16 [len(data)] (ITU-T G.711 expansion, 14-bit range scaled to 16)."""
    return _ULAW_DEC[np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)]


def alaw_to_int16(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Decode G.711 A-law bytes to int16 [len(data)] (ITU-T G.711 expansion, 13-bit range scaled to 16)."""
    return _ALAW_DEC[np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)]


def ulaw_to_float32(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Decode G.711 mu-law bytes (1 byte per sample, 8 kHz) to float32 [len(data)] in [-1, 1)."""
    return _ULAW_DEC_F[np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)]


def alaw_to_float32(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Decode G.711 A-law bytes (1 byte per sample, 8 kHz) to float32 [len(data)] in [-1, 1)."""
    return _ALAW_DEC_F[np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)]


def _to_int16(x: np.ndarray) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32).reshape(-1)
    _check_finite(a, "float")
    return np.round(np.clip(a, -1.0, 1.0) * 32767.0).astype(np.int16)


def float32_to_ulaw(x: np.ndarray) -> bytes:
    """Encode float audio in [-1, 1] (clipped) to G.711 mu-law bytes, one per sample."""
    return _ULAW_ENC[_to_int16(x).astype(np.int32) + 32768].tobytes()


def float32_to_alaw(x: np.ndarray) -> bytes:
    """Encode float audio in [-1, 1] (clipped) to G.711 A-law bytes, one per sample."""
    return _ALAW_ENC[_to_int16(x).astype(np.int32) + 32768].tobytes()


# --------------------------------------------------------------------------- base64


def b64encode_audio(data: bytes | bytearray | memoryview) -> str:
    """Standard base64 (RFC 4648, with padding) of raw audio bytes, as ``str``."""
    return base64.b64encode(bytes(data)).decode("ascii")


def b64decode_audio(s: str | bytes, *, allow_empty: bool = True, what: str = "audio") -> bytes:
    """Decode standard base64 audio (docs/protocol.md §6.1).

    Args:
        s: base64 text (RFC 4648 standard alphabet, with padding). Leading/trailing whitespace is
            ignored.
        allow_empty: False rejects an empty string (a zero-length ``input_audio_buffer.append``).
        what: how the audio is named in error messages, e.g. ``"pcm16 at 16000 Hz"``
            (:meth:`InputFormat.describe`).
    Returns:
        the decoded bytes.
    Raises:
        AudioFormatError("bad_audio"): characters outside the base64 alphabet, wrong padding, a
        value that is not a string, or (``allow_empty=False``) no data. The message says what was
        expected, e.g. ``expected base64 pcm16 at 16000 Hz, got ...``.
    """
    if isinstance(s, str):
        try:
            raw = s.strip().encode("ascii")
        except UnicodeEncodeError as exc:
            raise AudioFormatError(ErrorCode.BAD_AUDIO, f"expected base64 {what}, got non-ASCII characters") from exc
    elif isinstance(s, (bytes, bytearray, memoryview)):
        raw = bytes(s).strip()
    else:
        raise AudioFormatError(ErrorCode.BAD_AUDIO, f"expected base64 {what} as a string, got {type(s).__name__}")
    if not raw and not allow_empty:
        raise AudioFormatError(ErrorCode.BAD_AUDIO, f"expected base64 {what} of at least one byte, got an empty string")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioFormatError(ErrorCode.BAD_AUDIO, f"expected base64 {what}, got invalid base64 ({exc})") from exc


# --------------------------------------------------------------------------- formats and streaming


@dataclass(frozen=True)
class InputFormat:
    """An input audio format (docs/protocol.md §6.1).

    Attributes:
        encoding: ``"pcm16" | "pcm_f32le" | "g711_ulaw" | "g711_alaw"``.
        rate: sample rate, Hz. PCM: 8 000-48 000; G.711: 8 000 only.
        channels: interleaved channels (1..8); more than one is downmixed to mono by averaging.
    Raises:
        AudioFormatError("unsupported_audio_format") on construction for anything else.
    """

    encoding: str = "pcm16"
    rate: int = 16000
    channels: int = 1

    def __post_init__(self) -> None:
        if self.encoding not in BYTES_PER_SAMPLE:
            raise AudioFormatError(
                ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
                f"unsupported audio encoding {self.encoding!r}; expected one of {list(ENCODINGS)}",
            )
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, np.integer)):
            raise AudioFormatError(
                ErrorCode.UNSUPPORTED_AUDIO_FORMAT, f"expected an integer sample rate in Hz, got {self.rate!r}"
            )
        if self.encoding in ("g711_ulaw", "g711_alaw"):
            if self.rate != G711_RATE:
                raise AudioFormatError(
                    ErrorCode.UNSUPPORTED_AUDIO_FORMAT, f"expected {G711_RATE} Hz for {self.encoding}, got {self.rate} Hz"
                )
        elif not (PCM_RATE_MIN <= self.rate <= PCM_RATE_MAX):
            raise AudioFormatError(
                ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
                f"expected a {self.encoding} sample rate in {PCM_RATE_MIN}-{PCM_RATE_MAX} Hz, got {self.rate} Hz",
            )
        if isinstance(self.channels, bool) or not isinstance(self.channels, (int, np.integer)) or not (
            1 <= self.channels <= MAX_CHANNELS
        ):
            raise AudioFormatError(
                ErrorCode.UNSUPPORTED_AUDIO_FORMAT, f"expected an integer channel count in 1..{MAX_CHANNELS}, got {self.channels!r}"
            )

    def describe(self) -> str:
        """The format in words for messages, e.g. ``"pcm16 at 16000 Hz"`` (``", 2 channels"`` appended if > 1)."""
        return f"{self.encoding} at {self.rate} Hz" + (f", {self.channels} channels" if self.channels > 1 else "")

    @property
    def bytes_per_sample(self) -> int:
        """Bytes of one sample of one channel."""
        return BYTES_PER_SAMPLE[self.encoding]

    @property
    def frame_bytes(self) -> int:
        """Bytes of one interleaved frame (one sample of every channel)."""
        return BYTES_PER_SAMPLE[self.encoding] * self.channels


def decode_frames(data: bytes | bytearray | memoryview, fmt: InputFormat) -> np.ndarray:
    """Decode whole interleaved frames of ``fmt`` to mono float32 at ``fmt.rate``.

    ``len(data)`` must be a multiple of ``fmt.frame_bytes`` (AudioFormatError("bad_audio") otherwise).
    Multi-channel input is downmixed by the mean of the channels.
    """
    mv = memoryview(data).cast("B")
    if len(mv) % fmt.frame_bytes:
        raise AudioFormatError(
            ErrorCode.BAD_AUDIO, f"expected whole {fmt.frame_bytes}-byte frames of {fmt.describe()}, got {len(mv)} bytes"
        )
    enc = fmt.encoding
    if enc == "pcm16":
        x = pcm16_to_float32(mv)
    elif enc == "pcm_f32le":
        x = f32le_to_float32(mv)
    elif enc == "g711_ulaw":
        x = ulaw_to_float32(mv)
    else:
        x = alaw_to_float32(mv)
    if fmt.channels > 1:
        x = x.reshape(-1, fmt.channels).mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(x, dtype=np.float32)


class StreamDecoder:
    """Stateful decoder for one input stream: bytes in arbitrary chunks -> mono float32.

    An incomplete trailing frame (1-3 bytes of a sample, or the partial samples of an interleaved
    multi-channel frame) is carried into the next :meth:`decode` call, never dropped or zero-padded
    mid-stream (docs/protocol.md §6.1 "Odd byte counts"); :meth:`reset` drops it (commit, clear or format
    change). Interleaved multi-channel input is downmixed by averaging, never read as mono.

    Example::

        dec = StreamDecoder(InputFormat("pcm16", 24000))
        x = dec.decode(b"\\x01\\x02\\x03")   # 1 sample, 1 byte carried
    """

    def __init__(self, fmt: InputFormat) -> None:
        if not isinstance(fmt, InputFormat):
            raise TypeError(f"fmt must be an InputFormat, got {type(fmt).__name__}")
        self.fmt = fmt
        self._carry = b""

    @property
    def carried_bytes(self) -> int:
        """Bytes of an incomplete frame waiting for the next :meth:`decode` (0..frame_bytes-1)."""
        return len(self._carry)

    def decode(self, data: bytes | bytearray | memoryview, *, allow_empty: bool = True) -> np.ndarray:
        """Decode the next chunk.

        Args:
            data: raw bytes of ``self.fmt`` (any length; 0 only with ``allow_empty``).
            allow_empty: False makes a zero-length chunk an error (a zero-length append).
        Returns:
            float32 [n] mono at ``fmt.rate``; ``n`` = whole frames available so far.
        Raises:
            AudioFormatError("bad_audio") on non-finite ``pcm_f32le`` values or (``allow_empty=False``)
            an empty chunk; the decoder state is then unchanged (the chunk is not used and no bytes
            are carried from it).
        """
        fb = self.fmt.frame_bytes
        mv = memoryview(data).cast("B")
        if not len(mv) and not allow_empty:
            raise AudioFormatError(
                ErrorCode.BAD_AUDIO, f"expected at least one byte of {self.fmt.describe()} audio, got 0 bytes"
            )
        if self._carry:
            buf = self._carry + bytes(mv)
            mv = memoryview(buf)
        usable = len(mv) - (len(mv) % fb)
        out = decode_frames(mv[:usable], self.fmt)  # may raise: state untouched
        self._carry = bytes(mv[usable:])
        return out

    def reset(self) -> int:
        """Drop carried bytes of an incomplete frame. Returns how many were dropped."""
        n = len(self._carry)
        self._carry = b""
        return n
