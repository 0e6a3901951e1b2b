"""duplexkit.audio: codecs, resampling, WAV I/O, unit framing, VAD, playback buffer, devices.

Core dependencies only (numpy, soxr, soundfile, webrtcvad); ``sounddevice`` is imported lazily by
:class:`MicStream`, :class:`SpeakerStream` and :func:`list_devices` (install ``duplexkit[mic]``).
"""

from __future__ import annotations

from .codecs import (
    AudioFormatError,
    InputFormat,
    StreamDecoder,
    b64decode_audio,
    b64encode_audio,
    float32_to_pcm16,
    pcm16_to_float32,
)
from .devices import AudioBlock, DeviceError, MicStream, SpeakerStream, list_devices
from .framer import Unit, UnitFramer
from .playback import PlaybackBuffer
from .resample import StreamResampler
from .vad import StreamingVAD, VadConfig, VadEvent
from .wav import read_wav, wav_bytes, write_wav

__all__ = [
    "pcm16_to_float32",
    "float32_to_pcm16",
    "b64encode_audio",
    "b64decode_audio",
    "AudioFormatError",
    "InputFormat",
    "StreamDecoder",
    "StreamResampler",
    "read_wav",
    "write_wav",
    "wav_bytes",
    "UnitFramer",
    "Unit",
    "PlaybackBuffer",
    "VadConfig",
    "StreamingVAD",
    "VadEvent",
    "MicStream",
    "SpeakerStream",
    "list_devices",
    "AudioBlock",
    "DeviceError",
]
