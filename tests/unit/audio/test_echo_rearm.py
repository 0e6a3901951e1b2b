"""The echo gate after barge-ins: answers that follow barge-ins are not cut by their own echo.

A speaker and a microphone in one room, closed loop, in 20 ms blocks: the assistant's answer (real
speech fixtures at 24 kHz, starting at a word as a vocoder's first chunk can, not in a fade-in) is
handed to ``EchoControl.render`` and comes back into the mic resampled to 16 kHz, 20 dB down (10 dB:
a laptop speaker at full volume), 40 or 120 ms later, over -60 dBFS room noise. The echo-aware VAD (default server VAD config) listens to
``EchoControl.capture``; its ``speech_started`` is a barge-in: playback stops at once (a flushed
player renders silence). Three times in a row the user interrupts an answer (interrupt_16k.wav at
its recorded level) and talks to the end of the utterance; each next answer starts 0.6 s after the
user stops (the server VAD's 500 ms of silence + latency), i.e. more than ``gain_window_ms`` after
the last echo. Then three answers play in full with their echo coming back: none may be cut.

Before the fix the gain window was wall time: after the user's turn it was empty, the first frames
of the next answer (the speaker-to-mic delay, mic still quiet) set the echo-path gain ~20 dB too low,
the echo then counted as speech above the echo, was never learned, and the answer cut itself: at
10 dB every answer after the first barge-in was cut 120-220 ms in (the same setup at 20 dB passed
only by a few dB of margin).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _echo_scenario import assistant_answer, user_utterance  # noqa: E402

from duplexkit.audio import EchoConfig, EchoControl, StreamingVAD, StreamResampler, VadConfig  # noqa: E402
from duplexkit.audio.echo import aec_available  # noqa: E402

needs_aec = pytest.mark.skipif(not aec_available(), reason="livekit (duplexkit[echo]) not installed")
RB, CB = 480, 320  # 20 ms at 24 kHz (render) and 16 kHz (capture)


class Room:
    """Render -> speaker -> room (delay, attenuation, noise) -> mic -> capture -> echo-aware VAD."""

    def __init__(self, mode: str, delay_ms: int, atten_db: float = 20.0) -> None:
        self.ctl = EchoControl(EchoConfig(mode=mode))
        self.vad = StreamingVAD(VadConfig(), echo=self.ctl)
        self.down = StreamResampler(24_000, 16_000)
        self.line = np.zeros(delay_ms * 16, np.float32)  # the acoustic delay, 16 kHz
        self.gain = 10 ** (-atten_db / 20)
        self.rng = np.random.default_rng(0)
        self.t = 0  # 20 ms blocks so far

    def step(self, played: np.ndarray, user: np.ndarray) -> bool:
        """One 20 ms block: ``played`` (24 kHz, <= RB samples) goes out, ``user`` (16 kHz) is spoken.
        Returns whether the VAD started speech in this block."""
        p = np.zeros(RB, np.float32)
        p[: played.size] = played
        self.ctl.render(p)  # a player renders every block it hands out, silence included
        self.line = np.concatenate([self.line, self.down.process(p) * self.gain])
        echo, self.line = self.line[:CB], self.line[CB:]
        mic = np.zeros(CB, np.float32)
        mic[: echo.size] += echo
        mic += self.rng.normal(0.0, 1e-3, CB).astype(np.float32)
        mic[: user.size] += user
        self.t += 1
        return any(e.kind == "speech_started" for e in self.vad.process(self.ctl.capture(mic)))

    def answer(self, audio: np.ndarray, user: np.ndarray | None = None, user_at_s: float = 0.0,
               after_s: float = 0.6) -> tuple[int, int | None]:
        """Play ``audio`` until it ends or the VAD starts speech (the barge-in: playback stops);
        the user (if any) speaks from ``user_at_s`` to the end of the utterance; ``after_s`` of room
        follows. Returns (ms of the answer played, block of the first speech start relative to the
        user's start, or None)."""
        pos, k, started, u_pos, barged = 0, 0, None, None, False
        ublocks = 0 if user is None else -(-user.size // CB)
        while (not barged and pos < audio.size) or (u_pos is not None and u_pos < ublocks):
            out = audio[pos:pos + RB] if not barged else np.zeros(0, np.float32)
            if not barged:
                pos += RB
            spoken = np.zeros(0, np.float32)
            if user is not None and k * 0.02 >= user_at_s:
                u_pos = 0 if u_pos is None else u_pos
                spoken = user[u_pos * CB:(u_pos + 1) * CB]
                u_pos += 1
            if self.step(out, spoken) and started is None:
                started = k - int(round(user_at_s / 0.02)) if user is not None else k
                barged = True
            k += 1
        for _ in range(int(after_s / 0.02)):
            self.step(np.zeros(0, np.float32), np.zeros(0, np.float32))
        return min(pos, audio.size) * 1000 // 24_000, started


@pytest.fixture(scope="module")
def answer(fixtures_dir):
    a = assistant_answer(fixtures_dir)
    return a[int(np.flatnonzero(np.abs(a) > 0.3)[0]):]  # starts at a word, at full level


@pytest.mark.parametrize("mode", ["gate", pytest.param("aec", marks=needs_aec)])
@pytest.mark.parametrize("delay_ms", [40, 120])
@pytest.mark.parametrize("atten_db", [10, 20])
def test_answers_after_barge_ins_play_in_full(fixtures_dir, answer, mode, delay_ms, atten_db):
    user, onset_s = user_utterance(fixtures_dir)
    room = Room(mode, delay_ms, atten_db)
    for _ in range(25):
        room.step(np.zeros(0, np.float32), np.zeros(0, np.float32))
    first_ms, started = room.answer(answer[: 4 * 24_000])
    assert started is None and first_ms == 4000  # the first answer: its own echo never starts speech
    onset_block = int(onset_s / 0.02)
    for i in range(3):  # three genuine barge-ins in a row, each over a fresh answer
        played_ms, started = room.answer(answer, user=user, user_at_s=1.5)
        assert started is not None, f"barge-in {i}: the user over the answer was not heard"
        assert onset_block <= started <= onset_block + 15, (i, started, onset_block)  # within 300 ms
        assert played_ms < 1500 + 1000 * onset_s + 400, (i, played_ms)
    for i in range(3):  # then answers with nobody talking: each plays in full over its own echo
        played_ms, started = room.answer(answer[: 5 * 24_000], after_s=2.5)
        assert started is None, f"answer {i} after the barge-ins was cut by its own echo at {started * 20} ms"
        assert played_ms == 5000
    if mode == "gate":  # the gate still knows the echo path (the AEC's residual is far lower)
        assert -atten_db - 6 < room.ctl.echo_gain_db < -atten_db + 6, room.ctl.echo_gain_db


# ------------------------------------------------------------------ no local VAD (server barge-in)


def _server_side(ctl: EchoControl, played: np.ndarray, mic: np.ndarray) -> list[float]:
    """A client without a local VAD: capture then suppress, a plain server VAD on what is sent;
    returns the server's speech starts (s)."""
    server = StreamingVAD(VadConfig())
    starts = []
    for k in range(mic.size // CB):
        ctl.render(played[k * RB:(k + 1) * RB])
        sent = ctl.suppress(ctl.capture(mic[k * CB:(k + 1) * CB]))
        starts += [(k + 1) * CB / 16_000 for e in server.process(sent) if e.kind == "speech_started"]
    return starts


@pytest.mark.parametrize("mode", ["gate", pytest.param("aec", marks=needs_aec)])
def test_suppress_learns_the_echo_path_when_no_vad_feeds_the_gate(fixtures_dir, mode):
    """The clients' default (barge_in off, echo on): nothing calls gate_frame, so the estimate
    stayed at the 0 dB prior and suppress attenuated the user over an answer as if it were echo
    (the server heard the interruption 1.5 s late, in both modes). suppress now learns the echo
    path itself: the echo alone still never reaches the server VAD, the estimate is the measured
    path, and with the AEC the user barges in within 300 ms of the onset."""
    from _echo_scenario import build_mic  # noqa: E402

    played = assistant_answer(fixtures_dir)
    user = user_utterance(fixtures_dir)
    ctl = EchoControl(EchoConfig(mode=mode))
    assert _server_side(ctl, played, build_mic(played, 80).mic) == []
    if mode == "gate":
        assert -26.0 < ctl.echo_gain_db < -14.0, ctl.echo_gain_db  # the -20 dB room, not the 0 dB prior
        return
    assert ctl.echo_gain_db < -30.0  # the AEC's residual
    mic = build_mic(played, 80, user=user, user_at_s=4.0)
    starts = _server_side(EchoControl(EchoConfig(mode=mode)), played, mic.mic)
    assert starts and mic.user_onset_s <= starts[0] <= mic.user_onset_s + 0.300, (starts, mic.user_onset_s)
