"""Streaming voice activity detection for ``server_vad`` (docs/protocol.md §7.2) on webrtcvad.

Per frame (10, 20 or 30 ms) a frame counts as *speech* only if all of these hold:

1. webrtcvad says speech, at aggressiveness ``mode``;
2. its RMS level is at least ``energy_floor_dbfs`` (an energy floor);
3. its spectral flatness over 100-7000 Hz is at most ``max_flatness`` (white/broadband noise has a
   flatness around 0.56, speech frames a median around 0.002: the noise guard);
4. at most ``max_tone_concentration`` of its power lies within +-2 FFT bins of the strongest bin
   (a pure tone puts ~100 % there, speech at most ~0.9: the tone guard).

webrtcvad alone fires on white noise and steady tones; guards 2-4 stop that.

**Start confirmation.** Speech starts when, within the last ``start_confirm_ms`` of frames (ending
with a speech frame), at least ``start_fraction`` of the frames are speech. The reported onset is
the first speech frame of that window, refined to the first 2 ms block above the energy floor.

**Hangover.** Speech stops after ``silence_duration_ms`` without a speech frame; the reported
offset is the end of the last speech frame (refined to the last 2 ms block above the floor).

**Pre-roll.** The detector keeps at least the effective pre-roll ``max(prefix_padding_ms, 300)`` ms
of audio before the onset (docs/protocol.md §7.2); ``speech_started`` events carry
``audio_start_ms = max(0, onset_ms - pre-roll)`` and the audio from there on.

**Mapping of ``threshold`` (0..1, the ``server_vad`` field) onto the detector** (higher = stricter):

=========================  ==========================================  ==========
quantity                   formula                                     at 0.5
=========================  ==========================================  ==========
webrtcvad aggressiveness   ``min(3, floor(4 * threshold))``            2
voiced fraction to start   ``0.5 + 0.4 * threshold``                   0.7 (4 of 5 frames)
energy floor               ``-60 + 20 * threshold`` dBFS               -50 dBFS
=========================  ==========================================  ==========

**Echo gate** (optional, speakers without headphones). ``StreamingVAD(cfg, echo=ctl)`` with an
:class:`EchoGate` (duplexkit.audio.echo.EchoControl) adds a fifth condition: while the assistant's
playback is audible, a frame counts as speech only if ``echo.gate_frame(frame)`` says its level is
at least ``margin_db`` above the estimated echo level. The VAD must then be fed exactly the audio
``EchoControl.capture`` returned, in order; ``gate_frame`` is called once for every frame.

All times are integer ms from the start of the stream (``reset()`` restarts it), computed from
sample counts: ``samples * 1000 // sample_rate``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Optional, Protocol

import numpy as np

__all__ = ["VadConfig", "VadEvent", "StreamingVAD", "FrameDecision", "EchoGate", "MIN_PREROLL_MS"]

#: The effective pre-roll is at least this many ms (docs/protocol.md §7.2).
MIN_PREROLL_MS = 300
_WEBRTC_RATES = (8000, 16000, 32000, 48000)
_REFINE_MS = 2  # onset/offset refinement block


@dataclass(frozen=True)
class VadConfig:
    """Server VAD settings; the first three are docs/protocol.md §4.1 ``turn_detection`` fields.

    Attributes:
        threshold: 0..1, mapped as in the module docstring (default 0.5).
        prefix_padding_ms: requested pre-roll, 0..2000 ms; effective pre-roll = max(value, 300).
        silence_duration_ms: silence that ends an utterance, 100..5000 ms (default 500).
        sample_rate: Hz, one of 8000, 16000, 32000, 48000 (webrtcvad rates; default 16000).
        frame_ms: 10, 20 or 30 (webrtcvad frame sizes; default 20).
        start_confirm_ms: confirmation window for a start (default 100 ms, >= frame_ms).
        energy_floor_dbfs: RMS floor in dBFS; ``None`` derives it from ``threshold``.
        max_flatness: spectral-flatness ceiling of a speech frame (noise guard, default 0.45).
        max_tone_concentration: ceiling on the power fraction near the spectral peak (tone guard, 0.95).
    Raises:
        ValueError on out-of-range values.
    """

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    sample_rate: int = 16000
    frame_ms: int = 20
    start_confirm_ms: int = 100
    energy_floor_dbfs: float | None = None
    max_flatness: float = 0.45
    max_tone_concentration: float = 0.95

    def __post_init__(self) -> None:
        if not (0.0 <= float(self.threshold) <= 1.0) or math.isnan(float(self.threshold)):
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if not (0 <= self.prefix_padding_ms <= 2000):
            raise ValueError(f"prefix_padding_ms must be in [0, 2000], got {self.prefix_padding_ms}")
        if not (100 <= self.silence_duration_ms <= 5000):
            raise ValueError(f"silence_duration_ms must be in [100, 5000], got {self.silence_duration_ms}")
        if self.sample_rate not in _WEBRTC_RATES:
            raise ValueError(f"sample_rate must be one of {_WEBRTC_RATES}, got {self.sample_rate}")
        if self.frame_ms not in (10, 20, 30):
            raise ValueError(f"frame_ms must be 10, 20 or 30, got {self.frame_ms}")
        if not (self.frame_ms <= self.start_confirm_ms <= 1000):
            raise ValueError(f"start_confirm_ms must be in [frame_ms, 1000], got {self.start_confirm_ms}")
        if not (0.0 < self.max_flatness <= 1.0) or not (0.0 < self.max_tone_concentration <= 1.0):
            raise ValueError("max_flatness and max_tone_concentration must be in (0, 1]")

    # derived ------------------------------------------------------------------------------
    @property
    def mode(self) -> int:
        """webrtcvad aggressiveness 0..3 = min(3, floor(4 * threshold))."""
        return min(3, int(4 * float(self.threshold)))

    @property
    def start_fraction(self) -> float:
        """Fraction of speech frames in the confirmation window needed to start = 0.5 + 0.4 * threshold."""
        return 0.5 + 0.4 * float(self.threshold)

    @property
    def floor_dbfs(self) -> float:
        """Energy floor, dBFS: ``energy_floor_dbfs`` or -60 + 20 * threshold."""
        if self.energy_floor_dbfs is not None:
            return float(self.energy_floor_dbfs)
        return -60.0 + 20.0 * float(self.threshold)

    @property
    def preroll_ms(self) -> int:
        """Effective pre-roll, ms = max(prefix_padding_ms, 300) (docs/protocol.md §7.2)."""
        return max(int(self.prefix_padding_ms), MIN_PREROLL_MS)

    @property
    def frame_samples(self) -> int:
        return self.sample_rate * self.frame_ms // 1000

    @property
    def confirm_frames(self) -> int:
        return max(1, self.start_confirm_ms // self.frame_ms)

    @property
    def confirm_needed(self) -> int:
        """Speech frames needed within the confirmation window."""
        return max(1, math.ceil(self.start_fraction * self.confirm_frames - 1e-9))

    @property
    def silence_frames(self) -> int:
        return max(1, math.ceil(self.silence_duration_ms / self.frame_ms))


@dataclass(frozen=True)
class VadEvent:
    """A VAD transition.

    Attributes:
        kind: ``"speech_started"`` or ``"speech_stopped"``.
        audio_ms: the onset (started) or offset (stopped), integer ms from stream start.
        audio_start_ms: onset minus the effective pre-roll, >= 0 (for ``speech_stopped``: the same
            value as its utterance's ``speech_started``).
        sample: the onset / offset as a sample index from stream start.
        audio: for ``speech_started``: float32 [n] from ``audio_start_ms`` up to the end of the
            audio processed so far (pre-roll + the confirmed speech); ``None`` for ``speech_stopped``.
        decided_sample: the sample index from stream start at which the event was decided (the
            end of the frame that confirmed the start or completed the hangover); later than
            ``sample`` by the confirmation or the hangover.
    """

    kind: Literal["speech_started", "speech_stopped"]
    audio_ms: int
    audio_start_ms: int
    sample: int = 0
    audio: np.ndarray | None = field(default=None, repr=False, compare=False)
    decided_sample: int = 0

    @property
    def audio_end_ms(self) -> int:
        """Alias of ``audio_ms`` (the docs/protocol.md name for speech_stopped)."""
        return self.audio_ms


@dataclass(frozen=True)
class FrameDecision:
    """Why a frame was (not) speech. ``speech`` = webrtc and loud and not noise and not tone."""

    webrtc: bool
    rms_dbfs: float
    flatness: float
    tone_concentration: float
    loud: bool
    noise: bool
    tone: bool

    @property
    def speech(self) -> bool:
        return self.webrtc and self.loud and not self.noise and not self.tone


class EchoGate(Protocol):
    """What the VAD asks of an echo control (implemented by ``duplexkit.audio.echo.EchoControl``).

    ``gate_frame(frame)`` is called once per VAD frame (float32 [frame_samples]), in stream order;
    it returns False when the frame is not well above the estimated playback echo level.
    """

    def gate_frame(self, frame: np.ndarray) -> bool: ...


class StreamingVAD:
    """Streaming speech detector over float32 mono audio at ``cfg.sample_rate``.

    ``process`` takes chunks of any size (remainders are carried to the next call) and returns the
    events the chunk completed. Not thread-safe; use one per stream.

    Args:
        cfg: :class:`VadConfig` (default ``VadConfig()``).
        echo: optional :class:`EchoGate` (an ``EchoControl`` at the same sample rate): while it
            reports the frame below its echo margin, the frame is not speech (module docstring).
            ``reset()`` does not reset it (the echo path outlives a VAD stream).
    """

    def __init__(self, cfg: VadConfig | None = None, echo: Optional[EchoGate] = None) -> None:
        self.cfg = cfg or VadConfig()
        self.echo = echo
        rate = getattr(echo, "capture_rate", self.cfg.sample_rate)
        if rate != self.cfg.sample_rate:
            raise ValueError(f"echo control runs at {rate} Hz but the VAD at {self.cfg.sample_rate} Hz")
        try:
            import webrtcvad  # webrtcvad-wheels; imported here so the rest of duplexkit works without it
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("server VAD needs webrtcvad: pip install webrtcvad-wheels") from e
        self._vad = webrtcvad.Vad(self.cfg.mode)
        n = self.cfg.frame_samples
        self._win = np.hanning(n).astype(np.float32)
        freqs = np.fft.rfftfreq(n, 1.0 / self.cfg.sample_rate)
        self._band = (freqs >= 100.0) & (freqs <= min(7000.0, self.cfg.sample_rate / 2 - 500.0))
        self._floor_rms = 10.0 ** (self.cfg.floor_dbfs / 20.0)
        # audio kept: pre-roll + confirmation window + 2 frames + 1 s margin
        keep_ms = self.cfg.preroll_ms + self.cfg.start_confirm_ms + 2 * self.cfg.frame_ms + 1000
        self._keep = keep_ms * self.cfg.sample_rate // 1000
        self.reset()

    # -- state ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything: a new stream starting at 0 ms, not speaking."""
        self._pending = np.zeros(0, np.float32)
        self._ring = np.zeros(0, np.float32)
        self._ring_start = 0  # stream sample index of _ring[0]
        self._pos = 0  # samples framed so far (stream sample index of the next frame)
        self._recent: deque[tuple[int, bool]] = deque(maxlen=self.cfg.confirm_frames)
        self._speaking = False
        self._silent_frames = 0
        self._last_speech_end = 0
        self._utt_start_ms = 0
        self.frames = 0
        self.echo_rejected_frames = 0  # speech frames the echo gate turned down

    @property
    def speaking(self) -> bool:
        """True between ``speech_started`` and ``speech_stopped``."""
        return self._speaking

    @property
    def position_ms(self) -> int:
        """Audio processed so far (framed samples), integer ms."""
        return self._ms(self._pos)

    @property
    def position_samples(self) -> int:
        """Audio processed so far: framed samples from stream start (a remainder shorter than a
        frame, carried to the next :meth:`process`, is not counted)."""
        return self._pos

    @property
    def start_pending(self) -> bool:
        """True while not speaking and a frame of the current confirmation window
        (``start_confirm_ms``) is speech: the next frames may still confirm a start. False once
        the window holds no speech frame (or while speaking)."""
        return not self._speaking and any(v for _, v in self._recent)

    def _ms(self, samples: int) -> int:
        return samples * 1000 // self.cfg.sample_rate

    # -- per-frame decision --------------------------------------------------------------------
    def classify_frame(self, frame: np.ndarray) -> FrameDecision:
        """Decide one frame (float32 [frame_samples]); exposed for diagnostics and tests."""
        f = np.asarray(frame, dtype=np.float32)
        if f.shape != (self.cfg.frame_samples,):
            raise ValueError(f"frame must have shape ({self.cfg.frame_samples},), got {f.shape}")
        rms = float(np.sqrt(np.mean(np.square(f, dtype=np.float64)) + 1e-20))
        loud = rms >= self._floor_rms
        pcm = (np.clip(f, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
        web = bool(self._vad.is_speech(pcm, self.cfg.sample_rate))
        flat, conc = 1.0, 0.0
        if loud:
            p = np.abs(np.fft.rfft(f * self._win)) ** 2 + 1e-20
            pb = p[self._band]
            flat = float(np.exp(np.mean(np.log(pb))) / np.mean(pb))
            k = int(np.argmax(p))
            conc = float(p[max(0, k - 2) : k + 3].sum() / p.sum())
        return FrameDecision(
            webrtc=web,
            rms_dbfs=20.0 * math.log10(rms),
            flatness=flat,
            tone_concentration=conc,
            loud=loud,
            noise=loud and flat > self.cfg.max_flatness,
            tone=loud and conc > self.cfg.max_tone_concentration,
        )

    # -- ring buffer ------------------------------------------------------------------------
    def _ring_append(self, x: np.ndarray) -> None:
        self._ring = np.concatenate([self._ring, x]) if self._ring.size else x.copy()
        extra = self._ring.size - self._keep
        if extra > 0:
            self._ring = self._ring[extra:]
            self._ring_start += extra

    def audio_between(self, start_sample: int, end_sample: int | None = None) -> np.ndarray:
        """Kept audio for stream samples [start, end) (clipped to what is kept), float32 copy."""
        end = self._ring_start + self._ring.size if end_sample is None else end_sample
        a = max(start_sample, self._ring_start) - self._ring_start
        b = min(end, self._ring_start + self._ring.size) - self._ring_start
        return self._ring[a:b].copy() if b > a else np.zeros(0, np.float32)

    def _refine_onset(self, frame_start: int) -> int:
        blk = self.cfg.sample_rate * _REFINE_MS // 1000
        lo = max(frame_start - self.cfg.frame_samples, self._ring_start)
        seg = self.audio_between(lo, frame_start + self.cfg.frame_samples)
        nb = seg.size // blk
        if nb:
            e = np.sqrt(np.mean(np.square(seg[: nb * blk].reshape(nb, blk)), axis=1))
            hits = np.nonzero(e >= self._floor_rms)[0]
            if hits.size:
                return lo + int(hits[0]) * blk
        return frame_start

    def _refine_offset(self, frame_end: int) -> int:
        blk = self.cfg.sample_rate * _REFINE_MS // 1000
        lo = frame_end - self.cfg.frame_samples
        seg = self.audio_between(lo, frame_end)
        nb = seg.size // blk
        if nb:
            e = np.sqrt(np.mean(np.square(seg[: nb * blk].reshape(nb, blk)), axis=1))
            hits = np.nonzero(e >= self._floor_rms)[0]
            if hits.size:
                return lo + (int(hits[-1]) + 1) * blk
        return frame_end

    # -- streaming ----------------------------------------------------------------------------
    def process(self, x: np.ndarray) -> list[VadEvent]:
        """Feed float32 [n] mono audio at ``cfg.sample_rate``; return the events it completes.

        Raises ValueError for non-1-D input or non-finite samples.
        """
        a = np.asarray(x, dtype=np.float32)
        if a.ndim != 1:
            raise ValueError(f"expected mono audio of shape [n], got shape {a.shape}")
        if a.size and not np.isfinite(a).all():
            raise ValueError("audio contains NaN or inf")
        buf = np.concatenate([self._pending, a]) if self._pending.size else a
        n = self.cfg.frame_samples
        nfr = buf.size // n
        events: list[VadEvent] = []
        for i in range(nfr):
            frame = buf[i * n : (i + 1) * n]
            self._ring_append(frame)
            ev = self._step(frame)
            if ev is not None:
                events.append(ev)
        self._pending = buf[nfr * n :].copy()
        return events

    def _step(self, frame: np.ndarray) -> VadEvent | None:
        cfg = self.cfg
        start = self._pos
        self._pos += cfg.frame_samples
        self.frames += 1
        speech = self.classify_frame(frame).speech
        if self.echo is not None and not self.echo.gate_frame(frame) and speech:
            speech = False
            self.echo_rejected_frames += 1
        self._recent.append((start, speech))
        if not self._speaking:
            if not speech:
                return None
            voiced = [s for s, v in self._recent if v]
            if len(voiced) < cfg.confirm_needed:
                return None
            onset = self._refine_onset(voiced[0])
            onset_ms = self._ms(onset)
            start_ms = max(0, onset_ms - cfg.preroll_ms)
            self._speaking = True
            self._silent_frames = 0
            self._last_speech_end = self._pos
            self._utt_start_ms = start_ms
            start_sample = start_ms * cfg.sample_rate // 1000
            return VadEvent(
                "speech_started",
                audio_ms=onset_ms,
                audio_start_ms=start_ms,
                sample=onset,
                audio=self.audio_between(start_sample),
                decided_sample=self._pos,
            )
        if speech:
            self._silent_frames = 0
            self._last_speech_end = self._pos
            return None
        self._silent_frames += 1
        if self._silent_frames < cfg.silence_frames:
            return None
        offset = self._refine_offset(self._last_speech_end)
        self._speaking = False
        self._recent.clear()
        return VadEvent("speech_stopped", audio_ms=self._ms(offset), audio_start_ms=self._utt_start_ms, sample=offset,
                        decided_sample=self._pos)
