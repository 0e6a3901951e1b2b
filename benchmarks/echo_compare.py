"""Compare echo cancellers on the echo scenario of tests/_echo_scenario.py (speakers without headphones).

Usage: python benchmarks/echo_compare.py [--delays 40 80 120]

For every AEC package that imports here (LiveKit's ``livekit`` rtc APM = WebRTC AEC3, ``pywebrtc-audio``
= WebRTC AEC3, ``aec-audio-processing`` = WebRTC APM, ``speexdsp`` = Debian's libspeexdsp through its
SWIG binding, ``pyaec`` = a Rust port of the Speex AEC) and for the echo gate alone, prints one row
per echo delay:

- ERLE (dB) over the whole 10 s answer and over its last 5 s, on a noise-free mic (echo power over
  residual power);
- speech starts of the echo-aware VAD over the 10 s answer (must be 0), and of a plain server VAD on
  the echo-reduced capture (what a server without the gate would see);
- barge-in: ms from the user's speech onset (4.3 s) to ``speech_started`` of the echo-aware VAD, and
  whether the echo was still active then;
- CPU seconds for the 10 s scenario.

Packages that are missing are listed as such. Numbers go to docs/concepts.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _echo_scenario import (  # noqa: E402
    assistant_answer,
    build_mic,
    erle_db,
    run_scenario,
    user_utterance,
)

from duplexkit.audio.echo import EchoConfig, EchoControl, LiveKitAec  # noqa: E402

RATE = 16000
BLOCK = RATE // 100


def _i16(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype(np.int16)


class PyWebrtcAudio:
    block = BLOCK

    def __init__(self) -> None:
        from pywebrtc_audio import EchoCanceller

        self._ec = EchoCanceller(RATE, 1, 0)

    def process(self, near, far):
        return np.asarray(self._ec.process(near.astype(np.float32), far.astype(np.float32)), np.float32)


class AecAudioProcessing:
    block = BLOCK

    def __init__(self) -> None:
        from aec_audio_processing import AudioProcessor

        self._ap = AudioProcessor(enable_aec=True, enable_ns=False, enable_agc=False, enable_vad=False)
        self._ap.set_stream_format(RATE, 1)
        self._ap.set_reverse_stream_format(RATE, 1)
        self._ap.set_stream_delay(0)

    def process(self, near, far):
        self._ap.process_reverse_stream(_i16(far).tobytes())
        return np.frombuffer(self._ap.process_stream(_i16(near).tobytes()), np.int16).astype(np.float32) / 32768


class SpeexDsp:
    block = BLOCK

    def __init__(self) -> None:
        from speexdsp import EchoCanceller

        self._ec = EchoCanceller.create(BLOCK, RATE * 300 // 1000, RATE)  # 300 ms filter tail

    def process(self, near, far):
        out = self._ec.process(_i16(near).tobytes(), _i16(far).tobytes())
        return np.frombuffer(out, np.int16).astype(np.float32) / 32768


class PyAec:
    block = BLOCK

    def __init__(self) -> None:
        from pyaec import Aec

        self._ec = Aec(BLOCK, RATE * 300 // 1000, RATE, True)

    def process(self, near, far):
        return np.asarray(self._ec.cancel_echo(_i16(near).tolist(), _i16(far).tolist()), np.float32) / 32768


BACKENDS = {
    "gate only (no AEC)": None,
    "livekit (WebRTC AEC3)": lambda: LiveKitAec(RATE),
    "pywebrtc-audio (WebRTC AEC3)": PyWebrtcAudio,
    "aec-audio-processing (WebRTC APM)": AecAudioProcessing,
    "speexdsp (Debian libspeexdsp)": SpeexDsp,
    "pyaec (Rust Speex port)": PyAec,
}


def make(name: str) -> EchoControl:
    factory = BACKENDS[name]
    if factory is None:
        return EchoControl(EchoConfig(mode="gate"))
    return EchoControl(EchoConfig(mode="aec"), aec=factory())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays", type=int, nargs="+", default=[40, 80, 120])
    ap.add_argument("--fixtures", default=str(ROOT / "tests" / "fixtures" / "audio"))
    args = ap.parse_args()
    fx = Path(args.fixtures)
    played = assistant_answer(fx)
    user = user_utterance(fx)
    print("| canceller | delay ms | ERLE 10 s dB | ERLE last 5 s dB | echo-only starts (gated VAD) "
          "| echo-only starts (plain VAD on output) | barge-in ms after onset | echo active at barge-in | CPU s / 10 s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in BACKENDS:
        try:
            make(name)
        except Exception as e:  # a package that does not install/import here
            print(f"| {name} | - | not available: {type(e).__name__}: {str(e)[:60]} | | | | | | |")
            continue
        for d in args.delays:
            clean = build_mic(played, d, noise_dbfs=None)
            ctl = make(name)
            r0 = run_scenario(ctl, played, clean.mic)
            erle_all = erle_db(clean.echo, r0.out, r0.latency_samples) if ctl.mode == "aec" else 0.0
            erle_last = erle_db(clean.echo, r0.out, r0.latency_samples, 5.0) if ctl.mode == "aec" else 0.0
            noisy = build_mic(played, d)
            t0 = time.process_time()
            r1 = run_scenario(make(name), played, noisy.mic, plain_vad=True)
            cpu = time.process_time() - t0
            talk = build_mic(played, d, user=user)
            r2 = run_scenario(make(name), played, talk.mic)
            after = [(t, a) for t, a in r2.starts if t >= talk.user_onset_s - 0.3]
            lat = f"{(after[0][0] - talk.user_onset_s) * 1000:.0f}" if after else "none"
            act = str(after[0][1]) if after else "-"
            print(f"| {name} | {d} | {erle_all:.1f} | {erle_last:.1f} | {len(r1.starts)} | {len(r1.plain_starts)} "
                  f"| {lat} | {act} | {cpu:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
