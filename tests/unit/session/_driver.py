"""Test driver for the sans-I/O Session: feeds events, splits outputs, checks §12 invariants."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np

from duplexkit.audio import read_wav
from duplexkit.engine.api import AudioChunk, Decision, EngineCommand, TextDelta, TurnEnd, AppendUnit
from duplexkit.protocol.conformance import EventStreamChecker
from duplexkit.session import CloseConnection, Session, SessionConfig

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


def fixture_audio(name: str) -> np.ndarray:
    audio, rate = read_wav(FIXTURES / name)
    assert rate == 16000
    return audio


def pcm16_b64(x: np.ndarray) -> str:
    return base64.b64encode((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()).decode()


class Driver:
    def __init__(self, cfg: SessionConfig | None = None, start: bool = True, **kw) -> None:
        self.s = Session(cfg or SessionConfig(**kw), now_ms=0)
        self.t = 0
        self.checker = EventStreamChecker()
        self.events: list[dict] = []
        self.cmds: list[EngineCommand] = []
        self.closes: list[CloseConnection] = []
        self._n = 0
        if start:
            self.s.start(0)
            self.pump()

    @property
    def sid(self) -> str:
        return self.s.stream_id

    def pump(self) -> list:
        out = self.s.drain()
        new = []
        for o in out:
            if isinstance(o, dict):
                self.checker.feed(o)
                self.events.append(o)
                new.append(o)
            elif isinstance(o, CloseConnection):
                self.closes.append(o)
                new.append(o)
            else:
                assert isinstance(o, EngineCommand), o
                self.cmds.append(o)
                new.append(o)
        return new

    def send(self, ev, *, event_id: str | None = "auto") -> list:
        if isinstance(ev, dict) and event_id is not None and "event_id" not in ev:
            self._n += 1
            ev = {**ev, "event_id": f"c{self._n}" if event_id == "auto" else event_id}
        self.s.receive_client_event(ev, self.t)
        new = self.pump()
        eid = ev.get("event_id") if isinstance(ev, dict) else None
        for o in new:
            if isinstance(o, dict) and o["type"] == "error" and eid is not None:
                assert o["error"].get("event_id") == eid, (o, eid)
        return new

    def engine(self, out) -> list:
        self.s.receive_engine_output(out, self.t)
        return self.pump()

    def tick(self, dt: int = 0) -> list:
        self.t += dt
        self.s.tick(self.t)
        return self.pump()

    def append(self, x: np.ndarray, chunk_ms: int = 100) -> list:
        n = 16 * chunk_ms
        new = []
        for i in range(0, len(x), n):
            new += self.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i : i + n])})
            self.t += chunk_ms
        return new

    # engine emulation --------------------------------------------------------------------------
    def last_unit(self) -> int:
        units = [c.unit_index for c in self.cmds if isinstance(c, AppendUnit)]
        return units[-1] if units else 0

    def speak(self, texts=("Hello ", "world."), epoch: int | None = None, end: bool = True, chunk=20160) -> list:
        e = self.s.epoch if epoch is None else epoch
        u = self.last_unit()
        new = self.engine(Decision(self.sid, e, u, decision="speak", turn_start=True))
        for i, tx in enumerate(texts):
            new += self.engine(TextDelta(self.sid, e, u + i, text=tx, n_tokens=max(1, len(tx) // 3)))
            new += self.engine(AudioChunk(self.sid, e, u + i, audio=0.1 * np.ones(chunk if i == 0 else 24000, np.float32), text=tx,
                                          final=end and i == len(texts) - 1))
        if end:
            new += self.engine(TurnEnd(self.sid, e, u + len(texts)))
        return new

    def types(self, new=None) -> list[str]:
        return [o["type"] for o in (self.events if new is None else new) if isinstance(o, dict)]

    def of(self, t: str, new=None) -> list[dict]:
        return [o for o in (self.events if new is None else new) if isinstance(o, dict) and o["type"] == t]

    def cmds_of(self, cls, new) -> list:
        return [o for o in new if isinstance(o, cls)]
