"""The client's input path, end to end through the Session to the engine (scripted, in-process).

* Formats follow the session: after ``update()`` to 24 kHz pcm16 and to pcm_f32le, a 440 Hz tone
  given to ``send_audio`` at 16 kHz in 20 ms chunks reaches the engine as 440 Hz with the right
  duration (a client that kept sending pcm16 at its constructor's rate would deliver 293 Hz or
  noise).
* Echo: the assistant's own speech (a real speech fixture as the scripted voice) is fed back into
  the microphone at -20 dB with 40-120 ms delay, in real time, with ``echo="aec"``: over a 10 s
  answer there are zero barge-ins and zero user turns (server VAD ``speech_started``); in the same
  setup a user speaking at normal level over the answer barges in within 300 ms of the speech onset.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from duplexkit.audio import StreamResampler, VirtualPlayer, read_wav, resample
from duplexkit.clients import InlineDuplexClient
from duplexkit.testing import ScriptedEngine
from _timing import bound

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"


def _engine_audio(client) -> np.ndarray:
    units = client.stream.units_seen
    return np.concatenate([u.audio for u in units]) if units else np.zeros(0, np.float32)


def _peak_hz(x: np.ndarray, rate: int = 16_000) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spec) * rate / len(x))


@pytest.mark.parametrize("fmt", [
    {"type": "audio/pcm", "rate": 24000},
    {"type": "audio/pcm_f32le", "rate": 16000},
    {"type": "audio/pcm_f32le", "rate": 48000},
    {"type": "audio/pcmu"},
], ids=["pcm16-24k", "f32-16k", "f32-48k", "g711u-8k"])
async def test_a_tone_reaches_the_engine_at_its_pitch_after_a_format_update(fmt):
    engine = ScriptedEngine(units_per_turn=None)
    async with InlineDuplexClient(engine, session={"turn_detection": None}, input_rate=16_000) as c:
        await c.update(audio={"input": {"format": fmt}})
        want = {"audio/pcm": "pcm16", "audio/pcm_f32le": "pcm_f32le", "audio/pcmu": "g711_ulaw"}[fmt["type"]]
        assert (c.state.input_format.encoding, c.state.input_format.rate) == (want, fmt.get("rate", 8000))
        t = np.arange(32_000) / 16_000
        x = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)  # 2 s of 440 Hz at 16 kHz
        for i in range(0, x.size, 320):  # 20 ms chunks, one streaming resampler underneath
            await c.send_audio(x[i:i + 320], rate=16_000)
        await c.commit()
        await asyncio.sleep(0.1)
        y = _engine_audio(c)
    voiced = np.flatnonzero(np.abs(y) > 0.05)
    dur = (voiced[-1] - voiced[0] + 1) / 16_000
    assert abs(dur - 2.0) < 0.02, dur
    seg = y[voiced[0] + 1600: voiced[-1] - 1600]
    assert abs(_peak_hz(seg) - 440) < 3
    # no seams: the tone's envelope is flat across chunk boundaries
    env = np.abs(seg[: seg.size // 160 * 160]).reshape(-1, 160).max(axis=1)
    assert env.min() > 0.25, "a chunk seam dips the tone"


def _speech24(name: str) -> np.ndarray:
    return read_wav(FIX / name, 24_000)[0]


class Room:
    """A speaker and a microphone in one room, in real time: the mic hears the player's output
    ``delay_ms`` later at ``gain_db``, plus room noise, plus (optionally) the user."""

    def __init__(self, player: VirtualPlayer, delay_ms: int, gain_db: float = -20.0) -> None:
        self.player = player
        player.output = []
        self._taken = 0
        self.delay = np.zeros(delay_ms * 16, np.float32)
        self.gain = 10 ** (gain_db / 20)
        self.down = StreamResampler(24_000, 16_000)
        self.rng = np.random.default_rng(0)

    def mic(self, n: int, user: np.ndarray | None = None) -> np.ndarray:
        # the speaker has played everything real time made due (a late loop turn must not find the
        # room's echo missing: speaker and microphone share one clock)
        self.player.advance()
        played = self.player.output[self._taken:]
        self._taken += len(played)
        echo16 = self.down.process(np.concatenate(played)) if played else np.zeros(0, np.float32)
        self.delay = np.concatenate([self.delay, echo16 * self.gain])
        out, self.delay = self.delay[:n], self.delay[n:]
        if out.size < n:
            out = np.concatenate([out, np.zeros(n - out.size, np.float32)])
        out = out + (10 ** (-60 / 20)) * self.rng.standard_normal(n).astype(np.float32)
        if user is not None:
            out = out + user
        return out.astype(np.float32)


async def _talk(delay_ms: int, user_at_s: float | None):
    voice = np.concatenate([_speech24("ref_voice_16k.wav"), _speech24("long_question_16k.wav")])
    engine = ScriptedEngine(units_per_turn=10, speech=voice * (0.5 / max(1e-6, np.abs(voice).max())))
    player = VirtualPlayer(block_ms=20)
    room = Room(player, delay_ms)
    user = read_wav(FIX / "interrupt_16k.wav", 16_000)[0]
    onset = int(np.flatnonzero(np.abs(user) > 0.05)[0])
    td = {"type": "server_vad", "create_response": False, "interrupt_response": True}
    stats = {"barge_at": None, "onset_at": None}
    async with InlineDuplexClient(engine, session={"turn_detection": td}, player=player, barge_in=True,
                                  echo="aec", input_rate=16_000, request_timeout_s=bound(20)) as c:
        for _ in range(25):  # 0.5 s of room before the question is answered
            await c.send_audio(room.mic(320))
            await asyncio.sleep(0.02)
        h = await c.create_response()
        t0 = time.monotonic()
        user_pos = None
        k = 0
        sent = 0
        while time.monotonic() - t0 < 11.0:
            t = time.monotonic() - t0
            # the microphone runs on the same wall clock as the (virtual) speaker: on a busy machine
            # a late loop turn sends the samples that are due, it does not slow the room's clock
            n = max(160, int(t * 16_000) - sent)
            sent += n
            u = None
            if user_at_s is not None and t >= user_at_s:
                user_pos = 0 if user_pos is None else user_pos
                u = user[user_pos:user_pos + n]
                u = np.pad(u, (0, n - u.size))
                if stats["onset_at"] is None and user_pos + n > onset:
                    stats["onset_at"] = time.monotonic()
                user_pos += n
            await c.send_audio(room.mic(n, u))
            await asyncio.sleep(0)
            if h.flushed and stats["barge_at"] is None:  # by local VAD or by the server VAD's cancel
                stats["barge_at"] = time.monotonic()
                stats["barge_t"] = round(time.monotonic() - t0, 3)
            if user_pos is not None and stats["barge_at"] is not None and user_pos > onset + 8000:
                break
            k += 1
            await asyncio.sleep(max(0.0, t0 + k * 0.02 - time.monotonic()))  # real-time pacing
        events = []
        while True:
            try:
                events.append(await asyncio.wait_for(c.events().get(), 0.05))
            except (asyncio.TimeoutError, StopAsyncIteration):
                break
        return c, h, events, stats


@pytest.mark.parametrize("delay_ms", [40, 80, 120])
async def test_own_voice_through_the_speakers_neither_barges_in_nor_starts_a_turn(delay_ms):
    c, h, events, _ = await _talk(delay_ms, user_at_s=None)
    assert h.audio_ms >= 9_000 and h.played_ms >= 9_000  # the 10 s answer played (and echoed back)
    assert c.barge_ins == 0
    assert [e for e in events if e.type == "input_audio_buffer.speech_started"] == []
    assert h.status == "completed"


@pytest.mark.parametrize("delay_ms", [40, 120])
async def test_the_user_over_the_answer_still_barges_in_within_300_ms(delay_ms):
    c, h, events, stats = await _talk(delay_ms, user_at_s=4.0)
    assert stats["barge_at"] is not None, "no barge-in"
    assert stats["onset_at"] is not None, f"interrupted before the user spoke: {stats}, {c.barge_ins} barge-ins"
    latency = stats["barge_at"] - stats["onset_at"]
    assert 0 <= latency <= 0.3, (latency, stats)
    assert not h.audible and h.heard_final
    assert c.barge_ins + len([e for e in events if e.type == "input_audio_buffer.speech_started"]) >= 1
