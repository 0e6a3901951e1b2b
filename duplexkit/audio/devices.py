"""Microphone and speaker streams on sounddevice (PortAudio), callback based.

``sounddevice`` is imported lazily, on first use, so the core install does not need it
(``pip install duplexkit[mic]``; it also needs the system PortAudio library, Debian ``libportaudio2``).

* :class:`MicStream` captures float32 mono blocks into a thread-safe queue, each with its PortAudio
  ADC timestamp (``inputBufferAdcTime``, seconds on the stream clock) and its sample index.
* :class:`SpeakerStream` pulls float32 mono blocks from a :class:`~duplexkit.audio.PlaybackBuffer`
  (or any ``read(n) -> float32 [n]`` source) inside the PortAudio callback, keeping the DAC
  timestamp (``outputBufferDacTime``) of the last block and the number of samples played.
* :func:`list_devices` lists devices; ``device`` arguments take an index, a name substring (as
  sounddevice matches it) or ``None`` for the host default.
"""

from __future__ import annotations

import abc

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Union

import numpy as np

from duplexkit.engine.api import OUTPUT_SAMPLE_RATE
from duplexkit.errors import DeviceError

__all__ = ["MicStream", "SpeakerStream", "AudioBlock", "list_devices", "find_device", "DeviceError"]

Device = Union[int, str, None]


def _sd() -> Any:
    try:
        import sounddevice as sd
    except ImportError as exc:  # the package, or the PortAudio shared library (OSError is wrapped)
        raise DeviceError(
            "audio devices need the 'sounddevice' package and the PortAudio library: "
            "pip install 'duplexkit[mic]' (and e.g. apt-get install libportaudio2)"
        ) from exc
    except OSError as exc:
        raise DeviceError(f"PortAudio library could not be loaded: {exc}") from exc
    return sd


def rescan_devices() -> None:
    """Re-initialise PortAudio so devices that appeared after import (e.g. a just-started audio
    server) are listed. Do not call while streams are open."""
    sd = _sd()
    sd._terminate()  # noqa: SLF001 - sounddevice has no public re-scan
    sd._initialize()  # noqa: SLF001


def list_devices(kind: str | None = None) -> list[dict]:
    """Available devices as dicts: index, name, hostapi (name), max_input_channels,
    max_output_channels, default_samplerate (Hz), is_default_input, is_default_output.

    Args:
        kind: ``"input"`` / ``"output"`` keeps only devices with such channels; ``None`` lists all.
    Raises:
        DeviceError if sounddevice/PortAudio is unavailable; ValueError for a bad ``kind``.
    """
    if kind not in (None, "input", "output"):
        raise ValueError(f"kind must be None, 'input' or 'output', got {kind!r}")
    sd = _sd()
    apis = sd.query_hostapis()
    d_in, d_out = sd.default.device
    out = []
    for i, d in enumerate(sd.query_devices()):
        if kind == "input" and d["max_input_channels"] < 1:
            continue
        if kind == "output" and d["max_output_channels"] < 1:
            continue
        out.append(
            {
                "index": i,
                "name": d["name"],
                "hostapi": apis[d["hostapi"]]["name"],
                "max_input_channels": int(d["max_input_channels"]),
                "max_output_channels": int(d["max_output_channels"]),
                "default_samplerate": float(d["default_samplerate"]),
                "is_default_input": i == d_in,
                "is_default_output": i == d_out,
            }
        )
    return out


def find_device(name: str, kind: str = "input") -> int:
    """Index of the first ``kind`` device whose name contains ``name`` (case-insensitive).

    Raises DeviceError when none matches.
    """
    for d in list_devices(kind):
        if name.lower() in d["name"].lower():
            return int(d["index"])
    raise DeviceError(f"no {kind} device matching {name!r}; have: {[d['name'] for d in list_devices(kind)]}")


@dataclass(frozen=True)
class AudioBlock:
    """One captured block.

    Attributes:
        audio: float32 [n] mono at the stream rate (channels averaged).
        start_sample: index of ``audio[0]`` since the stream started (counts every captured sample).
        adc_time: PortAudio ``inputBufferAdcTime`` of the first sample, seconds (stream clock).
        callback_time: PortAudio ``currentTime`` when the callback ran, seconds (same clock).
        status: PortAudio status flags as text ("" when clean, e.g. "input overflow").
    """

    audio: np.ndarray
    start_sample: int
    adc_time: float
    callback_time: float
    status: str = ""


class _Source(Protocol):
    def read(self, n: int) -> np.ndarray: ...


class _PortAudioStream(abc.ABC):
    """What :class:`MicStream` and :class:`SpeakerStream` share: the PortAudio stream's clock and
    state, ``stop``/``close`` and the context-manager protocol (``start`` is the subclass's)."""

    _stream = None
    _lock: threading.Lock

    @abc.abstractmethod
    def start(self):
        """Open and start the PortAudio stream; returns ``self``."""

    @property
    def time(self) -> float:
        """The stream clock now (PortAudio ``Stream.time``), seconds; 0.0 when not running."""
        return float(self._stream.time) if self._stream is not None else 0.0

    @property
    def active(self) -> bool:
        return self._stream is not None and bool(self._stream.active)

    def stop(self) -> None:
        """Stop and close the stream (a microphone's blocks already captured stay readable)."""
        with self._lock:
            if self._stream is not None:
                try:
                    self._stream.stop()
                finally:
                    self._stream.close()
                    self._stream = None

    def close(self) -> None:
        self.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MicStream(_PortAudioStream):
    """Microphone capture into a queue of :class:`AudioBlock` (callback based).

    Args:
        rate: Hz (default 16 000, the model's input rate).
        block_ms: block size, ms (default 20).
        device: index, name substring or ``None`` (default input).
        channels: channels to open (downmixed to mono); default 1.
        on_block: optional callable(AudioBlock) run *in the audio thread* (keep it short).
        max_queued_blocks: queue bound; when full the oldest block is dropped and ``dropped_blocks``
            is incremented (the audio thread never blocks).
        latency: PortAudio latency hint ("low", "high" or seconds).
    Raises:
        DeviceError when sounddevice is missing or the device cannot be opened (on :meth:`start`).
    """

    def __init__(
        self,
        rate: int = 16000,
        block_ms: int = 20,
        device: Device = None,
        channels: int = 1,
        on_block: Callable[[AudioBlock], None] | None = None,
        max_queued_blocks: int = 1000,
        latency: str | float = "low",
    ) -> None:
        if rate <= 0 or block_ms <= 0 or channels <= 0:
            raise ValueError("rate, block_ms and channels must be positive")
        self.rate = int(rate)
        self.block_samples = self.rate * int(block_ms) // 1000
        self.device = device
        self.channels = int(channels)
        self.on_block = on_block
        self.latency = latency
        self._q: queue.Queue[AudioBlock] = queue.Queue(maxsize=max_queued_blocks)
        self._stream: Any = None
        self._lock = threading.Lock()
        self.samples_captured = 0
        self.dropped_blocks = 0
        self.status_count = 0

    def _callback(self, indata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        x = indata[:, 0].copy() if indata.shape[1] == 1 else indata.mean(axis=1, dtype=np.float32)
        block = AudioBlock(
            audio=np.ascontiguousarray(x, dtype=np.float32),
            start_sample=self.samples_captured,
            adc_time=float(time_info.inputBufferAdcTime),
            callback_time=float(time_info.currentTime),
            status=str(status) if status else "",
        )
        self.samples_captured += frames
        if status:
            self.status_count += 1
        while True:
            try:
                self._q.put_nowait(block)
                break
            except queue.Full:
                try:
                    self._q.get_nowait()
                    self.dropped_blocks += 1
                except queue.Empty:
                    pass
        if self.on_block is not None:
            self.on_block(block)

    def start(self) -> "MicStream":
        """Open and start the PortAudio input stream. Returns self."""
        sd = _sd()
        with self._lock:
            if self._stream is not None:
                return self
            try:
                self._stream = sd.InputStream(
                    samplerate=self.rate,
                    blocksize=self.block_samples,
                    device=self.device,
                    channels=self.channels,
                    dtype="float32",
                    latency=self.latency,
                    callback=self._callback,
                )
                self._stream.start()
            except (sd.PortAudioError, ValueError) as exc:
                self._stream = None
                raise DeviceError(f"cannot open input device {self.device!r}: {exc}") from exc
        return self

    def read(self, timeout: float | None = None) -> AudioBlock | None:
        """Next captured block, waiting up to ``timeout`` s (``None`` = forever); ``None`` on timeout."""
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self) -> list[AudioBlock]:
        """All blocks captured and not yet read, without waiting."""
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out



class SpeakerStream(_PortAudioStream):
    """Speaker output pulling from a source in the PortAudio callback.

    It is a :class:`~duplexkit.audio.Player`: ``enqueue``/``flush``/``played_ms``/``queued_samples``/
    ``on_drained`` go to its :class:`~duplexkit.audio.PlaybackBuffer` (the ``source``, or one it
    creates), so a client can be given the speaker itself as its ``player``.

    Args:
        source: a :class:`~duplexkit.audio.PlaybackBuffer` or any object with ``read(n) -> float32 [n]``
            (zero-filled when short); ``None`` creates a PlaybackBuffer at ``rate``. Each callback
            reads exactly the block's frame count, which advances the buffer's played-ms cursor.
        rate: Hz (default 24 000, docs/protocol.md §6.2 output rate).
        block_ms: block size, ms (default 20).
        device: index, name substring or ``None`` (default output).
        channels: output channels (the mono signal is copied to each).
        latency: PortAudio latency hint.
    Raises:
        DeviceError when sounddevice is missing or the device cannot be opened (on :meth:`start`).
    """

    def __init__(
        self,
        source: _Source | None = None,
        rate: int = OUTPUT_SAMPLE_RATE,
        block_ms: int = 20,
        device: Device = None,
        channels: int = 1,
        latency: str | float = "low",
    ) -> None:
        if rate <= 0 or block_ms <= 0 or channels <= 0:
            raise ValueError("rate, block_ms and channels must be positive")
        if source is None:
            from .playback import PlaybackBuffer

            source = PlaybackBuffer(int(rate))
        self.source = source
        self.rate = int(rate)
        self.block_samples = self.rate * int(block_ms) // 1000
        self.device = device
        self.channels = int(channels)
        self.latency = latency
        self._stream: Any = None
        self._lock = threading.Lock()
        self.samples_played = 0  #: samples handed to PortAudio
        self.last_dac_time = 0.0  #: PortAudio outputBufferDacTime of the last block, seconds
        self.last_block_start = 0  #: sample index of the last block's first sample
        self.status_count = 0

    # -- Player (delegated to the PlaybackBuffer source) -----------------------------------------
    @property
    def sample_rate(self) -> int:
        return self.rate

    def enqueue(self, response_id: str, pcm: np.ndarray) -> int:
        return self.source.enqueue(response_id, pcm)

    def flush(self, response_id: str | None = None) -> int:
        return self.source.flush(response_id)

    def played_ms(self, response_id: str) -> int:
        return self.source.played_ms(response_id)

    def queued_samples(self, response_id: str | None = None) -> int:
        return self.source.queued_samples(response_id)

    def on_drained(self, callback) -> None:
        self.source.on_drained(callback)

    def on_render(self, callback) -> None:
        self.source.on_render(callback)

    def forget(self, response_id: str) -> None:
        forget = getattr(self.source, "forget", None)
        if forget is not None:
            forget(response_id)

    def _callback(self, outdata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        x = np.asarray(self.source.read(frames), dtype=np.float32)
        if x.shape[0] != frames:  # a misbehaving source must not crash the audio thread
            y = np.zeros(frames, np.float32)
            y[: min(frames, x.shape[0])] = x[:frames]
            x = y
        outdata[:] = x[:, None]
        self.last_block_start = self.samples_played
        self.samples_played += frames
        self.last_dac_time = float(time_info.outputBufferDacTime)
        if status:
            self.status_count += 1

    def start(self) -> "SpeakerStream":
        """Open and start the PortAudio output stream. Returns self."""
        sd = _sd()
        with self._lock:
            if self._stream is not None:
                return self
            try:
                self._stream = sd.OutputStream(
                    samplerate=self.rate,
                    blocksize=self.block_samples,
                    device=self.device,
                    channels=self.channels,
                    dtype="float32",
                    latency=self.latency,
                    callback=self._callback,
                )
                self._stream.start()
            except (sd.PortAudioError, ValueError) as exc:
                self._stream = None
                raise DeviceError(f"cannot open output device {self.device!r}: {exc}") from exc
        return self

