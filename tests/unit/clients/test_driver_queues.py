"""SessionDriver: engine commands never wait behind socket writes.

A client whose socket stalls (``on_event`` never returns) must not stop its own input from reaching
the engine: before the fix both went through one queue and appends were refused with
``input_backpressure`` while the engine sat idle."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import numpy as np

from duplexkit.audio import read_wav
from duplexkit.driver import SessionDriver
from duplexkit.engine.api import AppendUnit
from duplexkit.session import Session, SessionConfig

SPEECH = Path(__file__).resolve().parents[2] / "fixtures" / "audio" / "long_question_16k.wav"


class _RecordingStream:
    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.commands: list = []

    def submit(self, cmd) -> None:
        self.commands.append(cmd)

    async def outputs(self):
        await asyncio.Event().wait()  # no outputs: the engine is idle
        yield None  # pragma: no cover

    async def aclose(self) -> None:
        pass


class _RecordingEngine:
    def __init__(self) -> None:
        self.stream: _RecordingStream | None = None

    async def open_stream(self, stream_id, config):
        self.stream = _RecordingStream(stream_id)
        return self.stream


async def test_commands_flow_while_the_socket_is_stuck():
    audio, _ = read_wav(SPEECH, 16_000)
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    engine = _RecordingEngine()
    stuck = asyncio.Event()
    sent: list[str] = []

    async def on_event(ev: dict) -> None:
        sent.append(ev["type"])
        if len(sent) >= 2:
            await stuck.wait()  # the socket's send buffer is full and stays full

    driver = SessionDriver(Session(SessionConfig(), now_ms=0), engine, on_event=on_event,
                           on_close=lambda item: None, tick_interval_s=0.05)
    driver.start_session()
    driver.start()
    try:
        step = 3200  # 100 ms
        for i in range(0, len(pcm), step):
            driver.client_event({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + step]).decode()})
            await asyncio.sleep(0)
        for _ in range(200):
            await asyncio.sleep(0.01)
            units = [c for c in (engine.stream.commands if engine.stream else []) if isinstance(c, AppendUnit)]
            if len(units) >= len(audio) // 16_000:
                break
        assert len(units) >= len(audio) // 16_000, (len(units), sent)
        assert len(sent) == 2  # events are still stuck behind the socket
    finally:
        stuck.set()
        await driver.aclose()
