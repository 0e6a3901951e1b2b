"""Echo control for speakers without headphones: reference-signal AEC plus an echo gate for the VAD.

When the assistant plays through a speaker, the microphone hears it again (the *echo*). Without
echo control the VAD takes that echo for user speech and the assistant interrupts itself. Per
input stream, :class:`EchoControl` does two things:

1. **AEC** (``mode="aec"``): the audio handed to the speaker (the *reference*, :meth:`EchoControl.render`)
   is subtracted from the microphone signal by WebRTC's AEC3 echo canceller, through LiveKit's
   ``livekit`` rtc package (``AudioProcessingModule``; install ``duplexkit[echo]``). The choice is
   measured in docs/concepts.md, "Echo: speakers without headphones" (benchmarks/echo_compare.py).
2. **Echo gate** (both modes): while the reference was audible within the last ``tail_ms``
   (:attr:`EchoControl.echo_active`), a VAD frame counts as speech only if its level (of the
   echo-reduced capture) is at least ``margin_db`` above the *estimated echo level*. The estimate is
   ``reference envelope + echo-path gain`` in dB: the envelope is the loudest 10 ms reference hop
   within the last ``tail_ms`` (this covers any speaker-to-mic delay up to ``tail_ms``), and the
   echo-path gain is the loudest level-to-envelope ratio (a high percentile) of the frames of the
   last ``gain_window_ms`` *of echo-active audio* that were *not* above the estimate (frames of user
   speech over the echo do not raise it). Pauses in playback do not age the estimate: after a
   barge-in or the user's turn the next answer is gated with the echo path measured on the last
   one (the acoustic path has not changed). Before ``adapt_ms`` of echo-active frames have been
   seen, the gain is at least ``initial_gain_db``.

   In ``"aec"`` mode the ratio is measured on the AEC output, so the gate follows the AEC's
   residual echo (tens of dB below the raw echo once converged); in ``"gate"`` mode it follows the
   raw echo. Speech of the user well above the echo passes at once, so barge-in over the
   assistant still works; a gate that muted barge-in during playback would not.

Use with the VAD: ``StreamingVAD(cfg, echo=ctl)`` (duplexkit.audio.vad) calls
:meth:`EchoControl.gate_frame` once per frame of exactly the audio that :meth:`EchoControl.capture`
returned, in order.

Timeline: capture and reference are aligned by sample count. Each captured sample is paired with
the next reference sample queued by :meth:`render` (silence when none is queued), so ``render`` must
be called when audio is handed to the output device (in play order), not when it is generated.

All levels are RMS in dBFS of float32 audio (full scale 1.0). Not thread-safe: call ``render`` and
``capture`` from one thread (or under one lock).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, Optional, Protocol

import numpy as np

from duplexkit.engine.api import OUTPUT_SAMPLE_RATE
from duplexkit.errors import DuplexkitError

from .resample import StreamResampler

__all__ = ["EchoConfig", "EchoControl", "EchoUnavailableError", "AecBackend", "LiveKitAec", "aec_available"]

_HOP_MS = 10  # reference envelope hop and AEC block (WebRTC's APM processes 10 ms frames)
_SILENT_DB = -120.0


class EchoUnavailableError(DuplexkitError, ImportError):
    """``mode="aec"`` was asked for but the AEC package is not installed (code ``server_error``).

    The message says how to install it (``pip install 'duplexkit[echo]'``) or to use ``mode="gate"``.
    """


@dataclass(frozen=True)
class EchoConfig:
    """Echo control settings (defaults measured in docs/concepts.md, "Echo: speakers without headphones").

    Attributes:
        mode: ``"aec"`` = reference AEC (WebRTC AEC3 through ``livekit``) + echo gate;
            ``"gate"`` = echo gate only (capture passes through unchanged; no extra package).
        margin_db: how far (dB) above the estimated echo level a frame must be to count as speech
            while the echo is active (default 10).
        tail_ms: echo window, ms: longest speaker-to-mic delay plus reverberation that the gate
            covers, and how long :attr:`EchoControl.echo_active` stays true after the reference
            goes silent (default 400).
        ref_floor_dbfs: a reference hop below this RMS level (dBFS) counts as silent (default -60).
        initial_gain_db: echo-path gain (mic level minus reference level, dB) assumed until
            ``adapt_ms`` of echo has been measured; 0 dB = "the echo may be as loud as what is
            played", the safe prior for a laptop at full volume (default 0).
        adapt_ms: echo-active audio, ms, after which only the measured gain counts (default 500).
        gain_window_ms: the gain estimate is taken over this much recent echo-active audio, ms
            (default 2000); time without audible playback does not count, so the estimate carries
            over from one answer to the next.
        gain_percentile: the gain estimate is this percentile of the level-to-envelope ratios
            (dB) in the window (default 90): robust against the first frames of user speech over
            the echo, which a maximum would take for echo.
        stream_delay_ms: delay hint for the AEC, ms (AEC3 estimates the delay itself; default 0).
        residual_suppression_db: attenuation, dB, that :meth:`EchoControl.suppress` applies to a 10 ms
            block of capture output that is not ``margin_db`` above the estimated echo level while the
            echo is active (residual echo suppression; 0 turns it off; default 40).
        suppression_margin_db: how far above the estimated echo level a 10 ms block must be to pass
            :meth:`EchoControl.suppress` unattenuated, dB (default 20: stricter than the gate's
            ``margin_db``, because an AEC's residual spikes while it re-converges; speech at a
            normal level is 25-30 dB above the echo of a speaker at -20 dB).
        max_reference_lead_ms: reference queued ahead of the capture by more than this is dropped
            (oldest first) to re-align after a stall, ms (default 3000: a client whose event loop
            stalls for up to 3 s while the speaker keeps rendering keeps its echo reference).
    Raises:
        ValueError on out-of-range values.
    """

    mode: Literal["gate", "aec"] = "aec"
    margin_db: float = 15.0
    tail_ms: int = 400
    ref_floor_dbfs: float = -60.0
    initial_gain_db: float = 0.0
    adapt_ms: int = 500
    gain_window_ms: int = 2000
    gain_percentile: float = 90.0
    stream_delay_ms: int = 0
    max_reference_lead_ms: int = 3000
    residual_suppression_db: float = 40.0
    suppression_margin_db: float = 20.0

    def __post_init__(self) -> None:
        if self.mode not in ("gate", "aec"):
            raise ValueError(f"mode must be 'gate' or 'aec', got {self.mode!r}")
        if not (0.0 <= float(self.margin_db) <= 60.0):
            raise ValueError(f"margin_db must be in [0, 60], got {self.margin_db}")
        if not (_HOP_MS <= self.tail_ms <= 2000):
            raise ValueError(f"tail_ms must be in [{_HOP_MS}, 2000], got {self.tail_ms}")
        if not (-120.0 <= float(self.ref_floor_dbfs) <= 0.0):
            raise ValueError(f"ref_floor_dbfs must be in [-120, 0], got {self.ref_floor_dbfs}")
        if not (-80.0 <= float(self.initial_gain_db) <= 40.0):
            raise ValueError(f"initial_gain_db must be in [-80, 40], got {self.initial_gain_db}")
        if not (0 <= self.adapt_ms <= 10_000) or not (100 <= self.gain_window_ms <= 30_000):
            raise ValueError("adapt_ms must be in [0, 10000] and gain_window_ms in [100, 30000]")
        if not (50.0 <= float(self.gain_percentile) <= 100.0):
            raise ValueError(f"gain_percentile must be in [50, 100], got {self.gain_percentile}")
        if not (0 <= self.stream_delay_ms <= 1000):
            raise ValueError(f"stream_delay_ms must be in [0, 1000], got {self.stream_delay_ms}")
        if not (0.0 <= float(self.suppression_margin_db) <= 60.0):
            raise ValueError(f"suppression_margin_db must be in [0, 60], got {self.suppression_margin_db}")
        if not (0.0 <= float(self.residual_suppression_db) <= 120.0):
            raise ValueError(f"residual_suppression_db must be in [0, 120], got {self.residual_suppression_db}")
        if not (100 <= self.max_reference_lead_ms <= 10_000):
            raise ValueError(f"max_reference_lead_ms must be in [100, 10000], got {self.max_reference_lead_ms}")


class AecBackend(Protocol):
    """An echo canceller: ``process(near, far)`` on blocks of ``block`` samples at the capture rate.

    ``near`` is the microphone block, ``far`` the reference that was played at the same time
    (float32 [block] each, full scale 1.0); returns the echo-reduced near block, float32 [block].
    """

    block: int

    def process(self, near: np.ndarray, far: np.ndarray) -> np.ndarray: ...


def aec_available() -> bool:
    """True when the AEC package of ``mode="aec"`` (``livekit``) can be imported."""
    try:
        from livekit import rtc  # noqa: F401
    except ImportError:
        return False
    return True


class LiveKitAec:
    """WebRTC AEC3 through ``livekit.rtc.AudioProcessingModule`` on 10 ms int16 frames.

    Echo cancellation and the high-pass filter are on; noise suppression and AGC are off (they
    would change the user's level, which the VAD's energy floor relies on).

    Raises:
        EchoUnavailableError: ``livekit`` is not installed.
        ValueError: ``rate`` is not a multiple of 100 Hz.
    """

    def __init__(self, rate: int = 16000, stream_delay_ms: int = 0) -> None:
        try:
            from livekit import rtc
        except ImportError as e:
            raise EchoUnavailableError(
                "echo mode 'aec' needs LiveKit's rtc package (WebRTC AEC3): pip install 'duplexkit[echo]' "
                "(or pip install livekit), or use echo mode 'gate'"
            ) from e
        if rate % 100:
            raise ValueError(f"AEC rate must be a multiple of 100 Hz, got {rate}")
        self._rtc = rtc
        self.rate = int(rate)
        self.block = self.rate * _HOP_MS // 1000
        self._apm = rtc.AudioProcessingModule(
            echo_cancellation=True, noise_suppression=False, high_pass_filter=True, auto_gain_control=False
        )
        if stream_delay_ms:
            self._apm.set_stream_delay_ms(int(stream_delay_ms))

    @staticmethod
    def _i16(x: np.ndarray) -> bytes:
        return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()

    def process(self, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        rtc = self._rtc
        ref = rtc.AudioFrame(self._i16(far), self.rate, 1, self.block)
        self._apm.process_reverse_stream(ref)
        mic = rtc.AudioFrame(self._i16(near), self.rate, 1, self.block)
        self._apm.process_stream(mic)
        return np.frombuffer(bytes(mic.data), dtype="<i2").astype(np.float32) / 32768.0


def _db(power: float) -> float:
    return 10.0 * math.log10(power) if power > 1e-12 else _SILENT_DB


def _mono(x: np.ndarray, what: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 1:
        raise ValueError(f"{what} must be mono float32 of shape [n], got shape {a.shape}")
    if a.size and not np.isfinite(a).all():
        raise ValueError(f"{what} contains NaN or inf")
    return a


class EchoControl:
    """Echo control for one input stream (see the module docstring).

    Args:
        cfg: :class:`EchoConfig` (default: ``mode="aec"``).
        capture_rate: Hz of the microphone audio (16000 for the duplexkit mic path); a multiple of 100.
        render_rate: Hz of the reference (what the speaker plays; 24000 for MiniCPM-o output).
        aec: an :class:`AecBackend` to use instead of :class:`LiveKitAec` in ``"aec"`` mode
            (its ``block`` must equal ``capture_rate / 100``); ignored in ``"gate"`` mode.
    Raises:
        EchoUnavailableError: ``mode="aec"``, no ``aec`` given and ``livekit`` is missing.
        ValueError: bad rates or a backend block size other than 10 ms.
    """

    def __init__(
        self,
        cfg: EchoConfig = EchoConfig(),
        capture_rate: int = 16000,
        render_rate: int = OUTPUT_SAMPLE_RATE,
        aec: Optional[AecBackend] = None,
    ) -> None:
        if int(capture_rate) <= 0 or int(capture_rate) % 100 or int(render_rate) <= 0:
            raise ValueError(f"capture_rate must be a positive multiple of 100 Hz and render_rate positive, "
                             f"got {capture_rate}, {render_rate}")
        self.cfg = cfg
        self.capture_rate = int(capture_rate)
        self.render_rate = int(render_rate)
        self._hop = self.capture_rate * _HOP_MS // 1000
        self._aec: Optional[AecBackend] = None
        if cfg.mode == "aec":
            self._aec = aec if aec is not None else LiveKitAec(self.capture_rate, cfg.stream_delay_ms)
            if self._aec.block != self._hop:
                raise ValueError(f"AEC block must be {self._hop} samples (10 ms), got {self._aec.block}")
        self._resampler = StreamResampler(self.render_rate, self.capture_rate)
        self._max_lead = cfg.max_reference_lead_ms * self.capture_rate // 1000
        self._tail_hops = max(1, cfg.tail_ms // _HOP_MS)
        self._floor_p = 10.0 ** (cfg.ref_floor_dbfs / 10.0)
        self.reset()

    # -- state ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the stream (reference queue, AEC blocks in flight, level history, gain estimate).

        The AEC's adapted filter is kept (the acoustic path has not changed).
        """
        self._resampler.reset()
        self._ref = np.zeros(0, np.float32)  # reference queued at capture_rate, not yet paired
        self._near = np.zeros(0, np.float32)  # capture not yet processed (less than one block)
        self._far = np.zeros(0, np.float32)  # the reference paired with _near
        # AEC output FIFO, primed with one block of silence: constant latency of one block
        self._out = np.zeros(self._hop if self._aec is not None else 0, np.float32)
        self.in_samples = 0  # capture samples received
        self.out_samples = 0  # capture samples returned
        # reference power per 10 ms hop of the output timeline: hop index -> mean square
        self._hop_power: deque[float] = deque(maxlen=self._tail_hops + 1000)
        self._hop_base = 0  # hop index of _hop_power[0]
        self._acc_p = 0.0  # partial hop accumulator (sum of squares) and its sample count
        self._acc_n = 0
        self._gate_pos = 0  # output sample index of the next frame gate_frame will see
        self._gate_fed = False  # gate_frame was called (a VAD learns the echo path; else suppress does)
        # (echo-active samples gated up to and including the frame, level - envelope dB)
        self._ratios: deque[tuple[int, float]] = deque()
        self._active_samples = 0  # echo-active samples gated so far (adapt_ms, gain_window_ms)
        self.echo_level_dbfs = _SILENT_DB  # estimate of the last gated frame
        self.frame_level_dbfs = _SILENT_DB
        self.reference_lead_dropped = 0  # reference samples dropped (max_reference_lead_ms)

    @property
    def latency_samples(self) -> int:
        """Samples by which :meth:`capture` output lags its input: one 10 ms block in ``"aec"``, else 0."""
        return self._hop if self._aec is not None else 0

    @property
    def mode(self) -> str:
        return self.cfg.mode

    # -- reference ----------------------------------------------------------------------------
    def render(self, x: np.ndarray) -> None:
        """Queue audio just handed to the speaker: float32 [n] mono at ``render_rate``, in play order.

        Silence needs no call (missing reference counts as silence). Raises ValueError for
        non-1-D or non-finite input.
        """
        a = _mono(x, "reference")
        if not a.size:
            return
        y = self._resampler.process(a)
        self._ref = np.concatenate([self._ref, y]) if self._ref.size else y
        extra = self._ref.size - self._max_lead
        if extra > 0:
            self._ref = self._ref[extra:]
            self.reference_lead_dropped += extra

    def _take_reference(self, n: int) -> np.ndarray:
        if self._ref.size >= n:
            out, self._ref = self._ref[:n], self._ref[n:]
            return out
        out = np.zeros(n, np.float32)
        out[: self._ref.size] = self._ref
        self._ref = np.zeros(0, np.float32)
        return out

    def _account_reference(self, far: np.ndarray) -> None:
        """Add paired reference samples to the hop-power history (output timeline)."""
        i = 0
        while i < far.size:
            take = min(self._hop - self._acc_n, far.size - i)
            seg = far[i : i + take]
            self._acc_p += float(np.dot(seg, seg))
            self._acc_n += take
            i += take
            if self._acc_n == self._hop:
                if len(self._hop_power) == self._hop_power.maxlen:
                    self._hop_base += 1
                self._hop_power.append(self._acc_p / self._hop)
                self._acc_p, self._acc_n = 0.0, 0

    # -- capture ------------------------------------------------------------------------------
    def capture(self, x: np.ndarray) -> np.ndarray:
        """Echo-reduce microphone audio: float32 [n] mono at ``capture_rate`` -> float32 [n].

        ``"aec"``: the AEC output, delayed by :attr:`latency_samples` (the first call starts with
        that much silence). ``"gate"``: ``x`` unchanged. Raises ValueError for non-1-D or
        non-finite input.
        """
        a = _mono(x, "capture")
        n = a.size
        if not n:
            return np.zeros(0, np.float32)
        far = self._take_reference(n)
        self.in_samples += n
        if self._aec is None:
            self._account_reference(far)
            self.out_samples += n
            return a.copy()
        # the reference of the latency block comes out with the output: account it as processed
        self._near = np.concatenate([self._near, a]) if self._near.size else a.copy()
        self._far = np.concatenate([self._far, far]) if self._far.size else far
        nb = self._near.size // self._hop
        outs = [self._out]
        for k in range(nb):
            s = slice(k * self._hop, (k + 1) * self._hop)
            outs.append(np.asarray(self._aec.process(self._near[s], self._far[s]), dtype=np.float32))
            self._account_reference(self._far[s])
        self._near = self._near[nb * self._hop :]
        self._far = self._far[nb * self._hop :]
        fifo = np.concatenate(outs)
        out, self._out = fifo[:n], fifo[n:]
        self.out_samples += n
        return out

    # -- gate ---------------------------------------------------------------------------------
    def _envelope_power(self, end_sample: int) -> float:
        """Loudest reference hop power in the ``tail_ms`` before output sample ``end_sample``."""
        # hops are in the input timeline; output = input + latency
        end_hop = (end_sample - self.latency_samples) // self._hop  # exclusive, partial hop counts
        end_hop = min(end_hop + 1, self._hop_base + len(self._hop_power))
        lo = max(self._hop_base, end_hop - self._tail_hops)
        if end_hop <= lo:
            return 0.0
        return max(self._hop_power[i - self._hop_base] for i in range(lo, end_hop))

    @property
    def echo_active(self) -> bool:
        """True when the reference was audible (above ``ref_floor_dbfs``) within the last ``tail_ms``."""
        return self._envelope_power(self.out_samples) >= self._floor_p

    @property
    def echo_gain_db(self) -> float:
        """Current echo-path gain estimate, dB (frame level minus reference envelope)."""
        cfg = self.cfg
        measured = (
            float(np.percentile(np.fromiter((r for _, r in self._ratios), float), cfg.gain_percentile))
            if self._ratios
            else -math.inf
        )
        if self._active_samples < cfg.adapt_ms * self.capture_rate // 1000:
            return max(cfg.initial_gain_db, measured)
        return measured if measured > -math.inf else cfg.initial_gain_db

    def suppress(self, y: np.ndarray) -> np.ndarray:
        """Residual echo suppression of what :meth:`capture` just returned (float32 [n], the last
        ``n`` output samples) -> float32 [n] to send on.

        While the echo is active, each 10 ms block whose level is not ``suppression_margin_db`` above the
        estimated echo level (the reference envelope plus :attr:`echo_gain_db`, as the gate uses)
        is attenuated by ``residual_suppression_db``: what an AEC leaves of the echo then stays
        below any VAD's floor, so a server-side VAD does not take it for the user, while speech
        well above the echo passes unchanged.

        The echo path is learned by the gate (:meth:`gate_frame`) from the unsuppressed capture:
        feed a VAD with it. Without one (no :meth:`gate_frame` call yet, e.g. a client that leaves
        barge-in to the server VAD), ``suppress`` learns from the 10 ms blocks it is given, so the
        estimate still drops from the ``initial_gain_db`` prior to the measured echo path and the
        user talking over an answer reaches the server (it would stay attenuated otherwise).
        """
        a = np.asarray(y, dtype=np.float32)
        att = float(self.cfg.residual_suppression_db)
        if not a.size or att <= 0.0:
            return a
        base = self.out_samples - a.size  # output index of a[0]
        hop = self._hop
        if not self._gate_fed:
            for i in range(0, a.size - hop + 1, hop):
                self._judge(a[i:i + hop], base + i)
        out = a.copy()
        gain = self.echo_gain_db
        scale = 10.0 ** (-att / 20.0)
        i = 0
        while i < a.size:
            j = min(a.size, i + hop)
            env = self._envelope_power(base + j)
            if env >= self._floor_p:
                blk = a[i:j]
                level = _db(float(np.dot(blk, blk)) / max(j - i, 1))
                if level < _db(env) + gain + self.cfg.suppression_margin_db:
                    out[i:j] *= scale
            i = j
        return out

    def gate_frame(self, frame: np.ndarray) -> bool:
        """Whether a VAD frame may count as speech; call once per frame, in order, on capture output.

        Args:
            frame: float32 [n], the next ``n`` samples of what :meth:`capture` returned.
        Returns:
            True when the echo is not active for this frame, or the frame's RMS level is at least
            ``margin_db`` above the estimated echo level (:attr:`echo_level_dbfs` after the call).
        """
        f = np.asarray(frame, dtype=np.float32)
        n = int(f.size)
        self._gate_fed = True
        start = self._gate_pos
        if start + n > self.out_samples:  # fed audio capture() has not returned: use the latest
            start = max(0, self.out_samples - n)
        self._gate_pos = start + n
        return self._judge(f, start)

    def _judge(self, f: np.ndarray, start: int) -> bool:
        """Gate decision and echo-path learning for capture output samples [start, start + n)."""
        n = int(f.size)
        env = self._envelope_power(start + n)
        level = _db(float(np.dot(f, f)) / max(n, 1))
        self.frame_level_dbfs = level
        if env < self._floor_p:
            self.echo_level_dbfs = _SILENT_DB
            return True
        env_db = _db(env)
        gain = self.echo_gain_db
        self.echo_level_dbfs = env_db + gain
        above = level >= self.echo_level_dbfs + self.cfg.margin_db
        # learn the echo path from frames that are not speech above the echo. The window counts
        # echo-active audio only: a pause in playback (a barge-in, the user's turn) does not age the
        # estimate out, so the next answer starts with the gain measured on the last one instead of
        # an empty window that its first frames (the speaker-to-mic delay: reference audible, mic
        # still quiet) would drag far below the real echo; echo frames that then pass as "above"
        # are never learned, and the gate stays open to the whole answer
        self._active_samples += n
        win = self.cfg.gain_window_ms * self.capture_rate // 1000
        while self._ratios and self._ratios[0][0] <= self._active_samples - win:
            self._ratios.popleft()
        if not above:
            self._ratios.append((self._active_samples, level - env_db))
        return above
