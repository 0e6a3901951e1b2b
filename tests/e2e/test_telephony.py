"""Phone calls through the telephony bridges (server/telephony.py, docs/telephony.md), real sockets.

A websockets client plays the provider: Twilio's (and Telnyx's) message shapes, the speech fixtures
converted to 8 kHz mu-law in 20 ms ``media`` messages at real-time pace, marks echoed back as a
phone would once the audio played. Against ``duplexkit serve scripted`` (a subprocess):

* a recorded conversation: the question is answered with 8 kHz mu-law ``media`` naming the
  streamSid, each piece followed by a ``mark``; the caller echoes the first marks (that audio was
  heard), then talks over the answer: the bridge sends ``clear`` and the session truncates the
  assistant item at the last echoed mark (the session's own ``conversation.item.truncated``, logged
  by the server); a DTMF digit becomes a conversation item; a missing token is refused;
* Telnyx's shapes (``stream_id``, ``custom_parameters``, PCMU): answered, DTMF taken.

And in-process (uvicorn on loopback, so the engine can be inspected): the start message's custom
parameters set the persona (instructions) and the reference voice the engine stream gets.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import contextlib
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import websockets
from fastapi import Request

from duplexkit.audio import read_wav
from duplexkit.audio.codecs import float32_to_ulaw, ulaw_to_float32
from _serverproc import ServerProc
from _timing import bound

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
KEY = "tel-test-key"
FRAME = 160  # 20 ms at 8 kHz, one byte per mu-law sample
SILENCE = float32_to_ulaw(np.zeros(FRAME, np.float32))


def _frames(name: str) -> list[bytes]:
    a = read_wav(FIX / name, 8000)[0]
    data = float32_to_ulaw(a)
    data += SILENCE[: (-len(data)) % FRAME]
    return [data[i:i + FRAME] for i in range(0, len(data), FRAME)]


def twilio_start(sid: str, params: dict) -> dict:
    return {"event": "start", "sequenceNumber": "1", "streamSid": sid,
            "start": {"accountSid": "AC" + "0" * 32, "streamSid": sid, "callSid": "CA" + "1" * 32,
                      "tracks": ["inbound"], "customParameters": params,
                      "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}


class FakeTwilio:
    """The provider side of one media stream: sends 20 ms frames in real time, collects what comes back."""

    def __init__(self, ws, sid: str, key: str = "streamSid", style: str = "twilio") -> None:
        self.ws, self.sid, self.key, self.style = ws, sid, key, style
        self.seq = 1
        self.chunk = 0
        self.received: list[dict] = []
        self.pieces: list[tuple[str, int]] = []  # (mark name after it, media bytes)
        self.clears = 0
        self.marks: list[str] = []
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            await self._read_all()

    async def _read_all(self) -> None:
        async for raw in self.ws:
            m = json.loads(raw)
            self.received.append(m)
            if m["event"] == "media":
                self.pieces.append(("", len(base64.b64decode(m["media"]["payload"]))))
            elif m["event"] == "mark":
                self.marks.append(m["mark"]["name"])
                self.pieces[-1] = (m["mark"]["name"], self.pieces[-1][1])
            elif m["event"] == "clear":
                self.clears += 1

    async def send(self, msg: dict) -> None:
        self.seq += 1
        msg = {**msg, ("sequenceNumber" if self.style == "twilio" else "sequence_number"): str(self.seq),
               self.key: self.sid}
        await self.ws.send(json.dumps(msg))

    async def media(self, frames: list[bytes]) -> None:
        t0 = time.monotonic()
        for i, f in enumerate(frames):
            self.chunk += 1
            await self.send({"event": "media", "media": {"track": "inbound", "chunk": str(self.chunk),
                                                         "timestamp": str(self.chunk * 20),
                                                         "payload": base64.b64encode(f).decode()}})
            await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.02 - time.monotonic()))

    async def silence_until(self, cond, timeout_s: float) -> None:
        deadline = time.monotonic() + bound(timeout_s)
        while not cond():
            assert time.monotonic() < deadline, f"timed out; received {[m['event'] for m in self.received][-20:]}"
            await self.media([SILENCE] * 5)

    async def echo_mark(self, name: str) -> None:
        await self.send({"event": "mark", "mark": {"name": name}})


@pytest.fixture(scope="module")
def server():
    with ServerProc("scripted", "--api-key", KEY, "--scripted", "units_per_turn=8") as srv:
        yield srv


def _wait_log(srv, pattern: str, timeout_s: float = 20) -> re.Match:
    deadline = time.monotonic() + bound(timeout_s)
    while time.monotonic() < deadline:
        m = re.search(pattern, srv.output())
        if m:
            return m
        time.sleep(0.05)
    raise AssertionError(f"no log line {pattern!r}:\n{srv.output()[-3000:]}")


async def test_twilio_call_marks_barge_in_dtmf(server):
    sid = "MZ" + "a" * 32
    url = f"{server.ws_url}/v1/telephony/twilio?token={KEY}"
    async with websockets.connect(url) as ws:
        tw = FakeTwilio(ws, sid)
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await ws.send(json.dumps(twilio_start(sid, {"instructions": "You answer the phone for a bakery.",
                                                    "from": "+15550001111", "to": "+15550002222"})))
        await tw.send({"event": "dtmf", "dtmf": {"track": "inbound_track", "digit": "5"}})
        await tw.media(_frames("question_16k.wav"))
        # silence until the answer has sent at least 6 pieces (1.2 s of audio)
        await tw.silence_until(lambda: len(tw.marks) >= 6, 30)
        media = [m for m in tw.received if m["event"] == "media"]
        assert all(m["streamSid"] == sid for m in tw.received)
        audio = ulaw_to_float32(b"".join(base64.b64decode(m["media"]["payload"]) for m in media))
        assert np.abs(audio).max() > 0.05  # the scripted answer's tone, decoded from mu-law ...
        spec = np.abs(np.fft.rfft(audio[:8000]))
        assert abs(np.argmax(spec) * 8000 / 8000 - 440) < 5  # ... at 440 Hz when read at 8 kHz
        # each media piece is followed by its mark; marks are unique
        assert [m["event"] for m in tw.received[:4]] == ["media", "mark", "media", "mark"]
        assert len(set(tw.marks)) == len(tw.marks)
        # the phone played the first 3 pieces: echo their marks (in order, as Twilio does)
        heard_bytes = sum(n for _, n in tw.pieces[:3])
        for name, _ in tw.pieces[:3]:
            await tw.echo_mark(name)
        await asyncio.sleep(0.1)
        # the caller talks over the rest of the answer
        clears_before = tw.clears
        assert clears_before == 0
        talk = asyncio.get_running_loop().create_task(tw.media(_frames("interrupt_16k.wav")))
        deadline = time.monotonic() + bound(20)
        while tw.clears == 0 and not talk.done():
            await asyncio.sleep(0.02)
        if tw.clears == 0:
            await tw.silence_until(lambda: tw.clears > 0, 10)
        n_media_at_clear = sum(1 for m in tw.received if m["event"] == "media")
        # marks echoed after the clear (Twilio returns the cleared ones) do not count as heard
        for name, _ in tw.pieces[3:]:
            await tw.echo_mark(name)
        await talk
        expected_ms = heard_bytes * 1000 // 8000
        m = _wait_log(server, r"barge-in: item (\S+) truncated at audio_end_ms=(\d+)")
        assert int(m.group(2)) == expected_ms, server.output()[-3000:]
        _wait_log(server, r"DTMF item \S+ added: DTMF: 5")
        # after the clear the old answer sends no more audio (a new answer may follow the interruption)
        await tw.send({"event": "stop", "stop": {"accountSid": "AC", "callSid": "CA"}})
        assert time.monotonic() < deadline + bound(60)
        assert n_media_at_clear >= 6
    m = _wait_log(server, r"telephony call CA1+ ended: (\{.*\})")
    stats = ast.literal_eval(m.group(1))  # the counters dict of the bridge's "ended" log line
    assert "token=***" in server.output() and f"token={KEY}" not in server.output()
    assert stats["marks_played"] == 3 and stats["clears"] >= 1 and stats["dtmf"] == 1
    assert stats["media_in"] > 150  # 3.5 s of question + silence + interruption, 20 ms each


async def test_refused_token_and_media_format(server):
    with pytest.raises(websockets.exceptions.InvalidStatus):
        async with websockets.connect(f"{server.ws_url}/v1/telephony/twilio?token=wrong") as ws:
            await ws.recv()
    # a stream in a format the bridge cannot speak (Telnyx G722) is closed at its start
    async with websockets.connect(f"{server.ws_url}/v1/telephony/telnyx?token={KEY}") as ws:
        await ws.send(json.dumps({"event": "start", "stream_id": "S", "start": {
            "call_control_id": "v3:g722", "media_format": {"encoding": "G722", "sample_rate": 16000, "channels": 1}}}))
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), bound(20))
        assert info.value.rcvd.code == 1003
    assert "telephony telnyx stream refused: unsupported media format 'G722'" in server.output()


async def test_telnyx_call(server):
    sid = "32DE0DEA-53CB-4B21-89A4-9E1819C043BC"
    async with websockets.connect(f"{server.ws_url}/v1/telephony/telnyx",
                                  additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        tx = FakeTwilio(ws, sid, key="stream_id", style="telnyx")
        await ws.send(json.dumps({"event": "connected", "version": "1.0.0"}))
        await ws.send(json.dumps({"event": "start", "sequence_number": "1", "stream_id": sid, "start": {
            "user_id": "u", "call_control_id": "v3:telnyx-call", "call_session_id": "s", "from": "+13122010094",
            "to": "+13122123456", "client_state": "", "custom_parameters": {"voice": "nobody"},
            "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1}}}))
        await tx.send({"event": "dtmf", "occurred_at": "2026-01-01T00:00:00Z", "dtmf": {"digit": "#"}})
        # messages the bridge cannot use are skipped (one log line each); the call goes on
        await ws.send("not json")
        await tx.send({"event": "media", "media": {"track": "inbound"}})
        await tx.send({"event": "media", "media": {"track": "inbound", "payload": "***"}})
        await tx.media(_frames("question_16k.wav"))
        await tx.silence_until(lambda: len(tx.marks) >= 2, 30)
        assert all(m["stream_id"] == sid for m in tx.received)
        assert {m["event"] for m in tx.received} <= {"media", "mark", "clear"}
        await tx.echo_mark(tx.marks[0])
        await tx.send({"event": "stop", "stop": {"user_id": "u", "call_control_id": "v3:telnyx-call"}})
    m = _wait_log(server, r"telephony call v3:telnyx-call ended: (\{.*\})")
    stats = ast.literal_eval(m.group(1))
    assert stats["marks_played"] == 1 and stats["dtmf"] == 1
    assert "voice 'nobody' is not a server voice" in server.output()
    assert "provider message skipped: media message without a base64 payload" in server.output()
    assert "session error bad_audio" in server.output()  # the session's own answer to bad base64


async def test_custom_parameters_reach_the_engine():
    """Instructions and a named voice from TwiML <Parameter>s are what the engine stream opens with."""
    from _loopback import inprocess_server

    from duplexkit.testing import ScriptedEngine
    from duplexkit_server.app import ServerSettings, create_app, load_reference_voice

    engine = ScriptedEngine(units_per_turn=2)
    voice_wav = FIX / "ref_voice_16k.wav"
    app = create_app(engine, ServerSettings(voices={"baker": voice_wav}, default_instructions="server default"))
    sid = "MZ" + "b" * 32
    async with inprocess_server(app) as port:
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/telephony/twilio") as ws:
            tw = FakeTwilio(ws, sid)
            await ws.send(json.dumps(twilio_start(sid, {"instructions": "You are Ada, the bakery's assistant.",
                                                        "voice": "baker", "From": "+15550003333"})))
            await tw.media(_frames("question_16k.wav")[:10])
            deadline = time.monotonic() + bound(20)
            while not engine._streams and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            stream = next(iter(engine._streams.values()))
            await tw.silence_until(lambda: len(stream.units_seen) >= 1, 20)
            cfg = stream.config
            assert cfg.instructions.startswith("You are Ada, the bakery's assistant.")
            assert "+15550003333" in (cfg.instructions + str(getattr(cfg, "seed_text", "")))
            assert cfg.ref_voice is not None
            assert cfg.ref_voice.sha256 == load_reference_voice(voice_wav).sha256
            await tw.send({"event": "stop", "stop": {}})


async def test_webhook_sets_the_call_session():
    """``--telephony-webhook``: the start metadata is POSTed; the answer's session fields win over the
    custom parameters (a second session.update) and reach the engine; its tools' decider reads DTMF."""
    from fastapi import FastAPI
    from _loopback import inprocess_server

    from duplexkit.testing import ScriptedEngine
    from duplexkit_server.app import ServerSettings, create_app

    posted: list[dict] = []
    hook = FastAPI()

    @hook.post("/call")
    async def call(request: Request):
        posted.append(await request.json())
        return {"session": {"instructions": "Webhook persona for " + posted[-1]["custom_parameters"]["tenant"],
                            "tools": [{"type": "function", "name": "route_call", "description": "Route the call",
                                       "parameters": {"type": "object", "properties": {}}}],
                            "input_audio_format": "pcm16"}}  # a reserved field: ignored

    engine = ScriptedEngine(units_per_turn=2)
    sid = "MZ" + "d" * 32
    async with inprocess_server(hook) as hook_port:
        app = create_app(engine, ServerSettings(telephony_webhook=f"http://127.0.0.1:{hook_port}/call"))
        async with inprocess_server(app) as port:
            async with websockets.connect(f"ws://127.0.0.1:{port}/v1/telephony/twilio") as ws:
                tw = FakeTwilio(ws, sid)
                await ws.send(json.dumps(twilio_start(sid, {"tenant": "acme", "instructions": "param persona"})))
                deadline = time.monotonic() + bound(20)
                while not engine._streams and time.monotonic() < deadline:
                    await tw.media([SILENCE] * 5)
                stream = next(iter(engine._streams.values()))
                await tw.silence_until(lambda: len(stream.units_seen) >= 1, 20)
                assert stream.config.instructions.startswith("Webhook persona for acme")
                assert posted == [{"provider": "twilio", "stream_id": sid, "call_id": "CA" + "1" * 32, "from": None,
                                   "to": None, "custom_parameters": {"tenant": "acme",
                                                                     "instructions": "param persona"}}]
                # a keypad digit, then a question: the tool decider (the engine's, here) reads the digit
                await tw.send({"event": "dtmf", "dtmf": {"track": "inbound_track", "digit": "1"}})
                await tw.media(_frames("question_16k.wav"))
                await tw.silence_until(lambda: bool(engine.chat_requests), 30)
                assert "DTMF: 1" in str(engine.chat_requests[0].messages)
                await tw.send({"event": "stop", "stop": {}})
