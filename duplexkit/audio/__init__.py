"""duplexkit.audio: codecs, resampling, WAV I/O, unit framing, VAD, echo control, playback buffer, devices.

Core dependencies only (numpy, soxr, soundfile, webrtcvad); ``sounddevice`` is imported lazily by
:class:`MicStream`, :class:`SpeakerStream` and :func:`list_devices` (install ``duplexkit[mic]``).
The threaded parts (:mod:`.devices`, :mod:`.playback`) are imported on first attribute access
(PEP 562), and so is the echo control (:mod:`.echo`, whose ``"aec"`` mode imports ``livekit`` on use,
``duplexkit[echo]``), so the sans-I/O Session, which only needs the codecs, framer, resampler and VAD, does
not load them.
"""

from __future__ import annotations


from duplexkit.errors import DeviceError

from .codecs import (
    AudioFormatError,
    InputFormat,
    StreamDecoder,
    b64decode_audio,
    b64encode_audio,
    float32_to_pcm16,
    pcm16_to_float32,
)
from .encoder import StreamEncoder
from .framer import Unit, UnitFramer
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
    "StreamEncoder",
    "read_wav",
    "write_wav",
    "wav_bytes",
    "UnitFramer",
    "Unit",
    "PlaybackBuffer",
    "Player",
    "RenderingPlayer",
    "ForgettingPlayer",
    "VirtualPlayer",
    "VadConfig",
    "StreamingVAD",
    "VadEvent",
    "MicStream",
    "SpeakerStream",
    "list_devices",
    "AudioBlock",
    "DeviceError",
    "EchoConfig",
    "EchoControl",
    "EchoUnavailableError",
]

from duplexkit._lazy import lazy_exports

#: lazily imported name -> submodule that defines it (threaded code)
_LAZY = {
    "AudioBlock": ".devices",
    "MicStream": ".devices",
    "SpeakerStream": ".devices",
    "list_devices": ".devices",
    "find_device": ".devices",
    "PlaybackBuffer": ".playback",
    "Player": ".playback",
    "RenderingPlayer": ".playback",
    "ForgettingPlayer": ".playback",
    "VirtualPlayer": ".playback",
    "EchoConfig": ".echo",
    "EchoControl": ".echo",
    "EchoUnavailableError": ".echo",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
