"""The echo scenario (speakers without headphones, docs/protocol.md §8.7), shared by tests/unit/audio/test_echo.py
and benchmarks/echo_compare.py.

A ~10 s assistant answer (real speech fixtures, 24 kHz float32) is "played": handed to
``EchoControl.render`` in 20 ms blocks. The microphone hears it back resampled to 16 kHz, attenuated
by ``atten_db`` (20 dB), delayed by ``delay_ms`` (40-120 ms), plus white room noise at ``noise_dbfs``,
and optionally a user utterance at its recorded level starting at ``user_at_s``. The mic is fed to
``EchoControl.capture`` in 20 ms blocks, interleaved with the render calls, and the echo-reduced
capture goes to the echo-aware VAD (default server VAD config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from duplexkit.audio import StreamingVAD, VadConfig, read_wav
from duplexkit.audio.resample import resample

CAPTURE_RATE = 16000
RENDER_RATE = 24000
BLOCK_MS = 20
ONSET_RMS = 300 / 32768  # fixtures/audio/README.md: speech onset = first 10 ms block with RMS > 300


def _load(fixtures: Path, name: str) -> np.ndarray:
    audio, rate = read_wav(str(fixtures / name))
    assert rate == CAPTURE_RATE, (name, rate)
    return np.asarray(audio, np.float32).reshape(-1)


def assistant_answer(fixtures: Path, seconds: float = 10.0) -> np.ndarray:
    """The played answer: ref_voice + long_question fixtures (two sentences, real pauses), float32 at 24 kHz."""
    a = np.concatenate([_load(fixtures, "ref_voice_16k.wav"), _load(fixtures, "long_question_16k.wav")])
    return resample(a, CAPTURE_RATE, RENDER_RATE)[: int(seconds * RENDER_RATE)]


def user_utterance(fixtures: Path) -> tuple[np.ndarray, float]:
    """The user's interruption as recorded (interrupt_16k.wav) and its speech onset in s (energy rise)."""
    u = _load(fixtures, "interrupt_16k.wav")
    hop = CAPTURE_RATE // 100
    nb = u.size // hop
    rms = np.sqrt(np.mean(np.square(u[: nb * hop].reshape(nb, hop)), axis=1))
    return u, float(np.nonzero(rms > ONSET_RMS)[0][0]) * 0.01


def rms_dbfs(x: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(np.square(x, dtype=np.float64)) + 1e-20))


@dataclass
class Mic:
    """The microphone signal and its parts (all float32 at 16 kHz, same length)."""

    mic: np.ndarray
    echo: np.ndarray
    user_onset_s: Optional[float] = None  # absolute, in the mic timeline


def build_mic(played24: np.ndarray, delay_ms: int, *, atten_db: float = 20.0, noise_dbfs: Optional[float] = -60.0,
              user: Optional[tuple[np.ndarray, float]] = None, user_at_s: float = 4.0, seed: int = 0) -> Mic:
    ref = resample(played24, RENDER_RATE, CAPTURE_RATE)
    d = delay_ms * CAPTURE_RATE // 1000
    echo = np.zeros_like(ref)
    echo[d:] = ref[: ref.size - d] * 10 ** (-atten_db / 20)
    mic = echo.copy()
    if noise_dbfs is not None:
        mic += np.random.default_rng(seed).normal(0.0, 10 ** (noise_dbfs / 20), mic.size).astype(np.float32)
    onset = None
    if user is not None:
        u, u_onset = user
        s = int(user_at_s * CAPTURE_RATE)
        k = min(u.size, mic.size - s)
        mic[s : s + k] += u[:k]
        onset = user_at_s + u_onset
    return Mic(mic.astype(np.float32), echo.astype(np.float32), onset)


@dataclass
class Run:
    """What happened: speech starts (capture input time in s when the event came out, and whether the
    echo was active then), the echo-reduced capture, and starts of a plain VAD on that capture."""

    starts: list[tuple[float, bool]] = field(default_factory=list)
    out: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    plain_starts: list[float] = field(default_factory=list)
    latency_samples: int = 0


def run_scenario(ctl, played24: np.ndarray, mic: np.ndarray, vad_cfg: Optional[VadConfig] = None,
                 plain_vad: bool = False) -> Run:
    """Render and capture in 20 ms blocks as a speaker and microphone would; VAD over the capture.

    ``ctl`` is an EchoControl, or None for no echo control (the raw mic goes to the VAD).
    """
    cfg = vad_cfg or VadConfig()
    vad = StreamingVAD(cfg, echo=ctl)
    plain = StreamingVAD(cfg) if plain_vad else None
    rb, cb = RENDER_RATE * BLOCK_MS // 1000, CAPTURE_RATE * BLOCK_MS // 1000
    run = Run(latency_samples=0 if ctl is None else ctl.latency_samples)
    outs = []
    for k in range(mic.size // cb):
        if ctl is not None:
            ctl.render(played24[k * rb : (k + 1) * rb])
            y = ctl.capture(mic[k * cb : (k + 1) * cb])
        else:
            y = mic[k * cb : (k + 1) * cb]
        outs.append(y)
        t = (k + 1) * cb / CAPTURE_RATE
        for ev in vad.process(y):
            if ev.kind == "speech_started":
                run.starts.append((t, bool(ctl is not None and ctl.echo_active)))
        if plain is not None:
            run.plain_starts += [t for ev in plain.process(y) if ev.kind == "speech_started"]
    run.out = np.concatenate(outs) if outs else np.zeros(0, np.float32)
    return run


def erle_db(echo: np.ndarray, out: np.ndarray, latency: int, start_s: float = 0.0) -> float:
    """Echo return loss enhancement, dB: echo power over residual power (noise-free run), from ``start_s``."""
    s = int(start_s * CAPTURE_RATE)
    res = out[latency + s :]
    e = echo[s : s + res.size]
    return 10 * np.log10(np.sum(np.square(e, dtype=np.float64)) / (np.sum(np.square(res, dtype=np.float64)) + 1e-20))
