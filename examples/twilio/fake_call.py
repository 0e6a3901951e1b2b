"""Simulate a phone call against ``duplexkit serve`` without a phone: act as Twilio (or Telnyx).

Plays a WAV file as 8 kHz mu-law ``media`` messages of 20 ms at real-time pace over
``/v1/telephony/twilio`` (what Twilio sends for a call), keeps sending silence as a phone line does,
echoes each ``mark`` once its audio would have played, saves what the assistant said to a WAV, and
prints the reply latency: from the ``media`` message carrying the last frame of speech (the last
20 ms frame above -40 dBFS) to the first ``media`` message back.

``--compare-realtime`` runs the same audio through the plain realtime WebSocket
(``/v1/realtime?duplex=1`` with the same session settings: g711_ulaw input in 20 ms appends, server
VAD with create_response) in the same run, from the append of the last speech frame to the first
``response.output_audio.delta``: the difference is what the telephony bridge adds (docs/telephony.md).

    duplexkit serve scripted --port 8000 &
    python examples/twilio/fake_call.py --url ws://127.0.0.1:8000 --runs 5 --compare-realtime

Needs ``websockets`` (installed with duplexkit's server extra).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import websockets

from duplexkit.audio import read_wav, write_wav
from duplexkit.audio.codecs import float32_to_ulaw, ulaw_to_float32

FRAME = 160  # 20 ms of 8 kHz mu-law
SILENCE = float32_to_ulaw(np.zeros(FRAME, np.float32))
DEFAULT_WAV = Path(__file__).resolve().parents[2] / "duplexkit" / "assets" / "question_16k.wav"


def frames_of(wav: Path) -> list[bytes]:
    data = float32_to_ulaw(read_wav(wav, 8000)[0])
    data += SILENCE[: (-len(data)) % FRAME]
    return [data[i:i + FRAME] for i in range(0, len(data), FRAME)]


def last_speech_frame(frames: list[bytes], floor_dbfs: float = -40.0) -> int:
    """Index of the last frame whose RMS is above ``floor_dbfs`` (the end of the speech; what
    follows is the file's trailing silence)."""
    rms = [float(np.sqrt(np.mean(ulaw_to_float32(f) ** 2))) for f in frames]
    loud = [i for i, r in enumerate(rms) if r > 10 ** (floor_dbfs / 20)]
    return loud[-1] if loud else len(frames) - 1


async def paced(frames: list[bytes], send, mark: int = -1) -> float:
    """Send ``frames`` every 20 ms; returns the monotonic time frame ``mark`` (default: the last)
    was sent."""
    t0 = time.monotonic()
    at = t0
    mark = mark % len(frames)
    for i, f in enumerate(frames):
        await send(f)
        if i == mark:
            at = time.monotonic()
        await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.02 - time.monotonic()))
    return at


async def _quiet_send(ws, text: str) -> None:
    try:
        await ws.send(text)
    except websockets.ConnectionClosed:
        pass


async def phone_call(url: str, frames: list[bytes], provider: str, params: dict, timeout_s: float,
                     listen_s: float) -> tuple[float, bytes]:
    """One call: returns (seconds from the last speech frame to the first outbound media, audio heard)."""
    key = "streamSid" if provider == "twilio" else "stream_id"
    sid = ("MZ" + uuid.uuid4().hex) if provider == "twilio" else str(uuid.uuid4())
    heard = bytearray()
    first_media = asyncio.get_running_loop().create_future()
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        if provider == "twilio":
            start = {"event": "start", "sequenceNumber": "1", "streamSid": sid, "start": {
                "streamSid": sid, "callSid": "CA" + uuid.uuid4().hex, "accountSid": "AC" + "0" * 32,
                "tracks": ["inbound"], "customParameters": params,
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}
        else:
            start = {"event": "start", "sequence_number": "1", "stream_id": sid, "start": {
                "call_control_id": "v3:" + uuid.uuid4().hex, "from": params.get("from"), "to": params.get("to"),
                "custom_parameters": params, "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1}}}
        await ws.send(json.dumps(start))
        play_until = [time.monotonic()]  # when the queued assistant audio will have played

        async def reader() -> None:
            async for raw in ws:
                m = json.loads(raw)
                if m["event"] == "media":
                    if not first_media.done():
                        first_media.set_result(time.monotonic())
                    chunk = base64.b64decode(m["media"]["payload"])
                    heard.extend(chunk)
                    play_until[0] = max(play_until[0], time.monotonic()) + len(chunk) / 8000
                elif m["event"] == "mark":  # echo once the audio before it has played
                    delay = max(0.0, play_until[0] - time.monotonic())
                    text = json.dumps({"event": "mark", key: sid, "mark": m["mark"]})
                    # the coroutine is made when the timer fires: one left unsent at hang-up is never created
                    asyncio.get_running_loop().call_later(
                        delay, lambda text=text: asyncio.ensure_future(_quiet_send(ws, text)))
                elif m["event"] == "clear":
                    play_until[0] = time.monotonic()

        async def send(f: bytes) -> None:
            await ws.send(json.dumps({"event": "media", key: sid, "media": {
                "track": "inbound", "payload": base64.b64encode(f).decode()}}))

        task = asyncio.get_running_loop().create_task(reader())
        try:  # the reader ends before the connection, however the call ends (Ctrl+C included)
            last = await paced(frames, send, last_speech_frame(frames))
            deadline = time.monotonic() + timeout_s
            while not first_media.done() and time.monotonic() < deadline:
                await paced([SILENCE] * 5, send)
            if not first_media.done():
                raise RuntimeError(f"no answer within {timeout_s} s")
            latency = first_media.result() - last
            await paced([SILENCE] * int(listen_s / 0.02), send)  # listen to the answer
            await ws.send(json.dumps({"event": "stop", key: sid}))
        finally:
            task.cancel()
    return latency, bytes(heard)


async def realtime_baseline(url: str, frames: list[bytes], timeout_s: float, token: str | None = None) -> float:
    """The same audio over /v1/realtime?duplex=1: last append -> first output audio delta, seconds."""
    first = asyncio.get_running_loop().create_future()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with websockets.connect(url, max_size=None, additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "input_audio_format": "g711_ulaw",
            "turn_detection": {"type": "server_vad", "create_response": True, "interrupt_response": True}}}))

        async def reader() -> None:
            async for raw in ws:
                ev = json.loads(raw)
                if ev.get("type") in ("response.output_audio.delta", "response.audio.delta") and not first.done():
                    first.set_result(time.monotonic())

        async def send(f: bytes) -> None:
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(f).decode()}))

        task = asyncio.get_running_loop().create_task(reader())
        try:
            last = await paced(frames, send, last_speech_frame(frames))
            deadline = time.monotonic() + timeout_s
            while not first.done() and time.monotonic() < deadline:
                await paced([SILENCE] * 5, send)
        finally:
            task.cancel()
        if not first.done():
            raise RuntimeError(f"no answer within {timeout_s} s")
        return first.result() - last


def _summary(name: str, xs: list[float]) -> str:
    ms = [x * 1000 for x in xs]
    return (f"{name}: median {statistics.median(ms):.0f} ms, min {min(ms):.0f}, max {max(ms):.0f} "
            f"(n={len(ms)}: {', '.join(f'{m:.0f}' for m in ms)})")


async def main(a: argparse.Namespace) -> None:
    frames = frames_of(a.wav)
    q = f"?token={a.token}" if a.token else ""
    params = {k: v for k, v in (("instructions", a.instructions), ("voice", a.voice)) if v}
    tel, rt, heard = [], [], b""
    for _ in range(a.runs):
        lat, heard = await phone_call(f"{a.url}/v1/telephony/{a.provider}{q}", frames, a.provider, params,
                                      a.timeout_s, a.listen_s)
        tel.append(lat)
        if a.compare_realtime:
            rt.append(await realtime_baseline(f"{a.url}/v1/realtime?duplex=1", frames, a.timeout_s, a.token))
    print(_summary(f"telephony ({a.provider}) last speech frame -> first media", tel))
    if rt:
        print(_summary("realtime WebSocket last append -> first audio delta", rt))
        print(f"bridge adds (median difference): {(statistics.median(tel) - statistics.median(rt)) * 1000:.0f} ms")
    if a.out is not None and heard:
        write_wav(a.out, ulaw_to_float32(heard), 8000)
        print(f"answer saved to {a.out} ({len(heard) / 8000:.1f} s)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000", help="the server's ws:// base URL")
    ap.add_argument("--token", default=None, help="the server's API key (sent as ?token=)")
    ap.add_argument("--provider", choices=["twilio", "telnyx"], default="twilio")
    ap.add_argument("--wav", type=Path, default=DEFAULT_WAV, help="what the caller says")
    ap.add_argument("--instructions", default=None, help="a per-call persona (the instructions parameter)")
    ap.add_argument("--voice", default=None, help="a server voice name (serve --voice NAME=WAV)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--listen-s", type=float, default=3.0, help="how long to listen to each answer")
    ap.add_argument("--out", type=Path, default=None, help="save the last answer heard as a WAV (8 kHz)")
    ap.add_argument("--compare-realtime", action="store_true",
                    help="also time the same audio over /v1/realtime?duplex=1 (the bridge's cost)")
    ap.add_argument("--timeout-s", type=float, default=30.0)
    a = ap.parse_args()
    try:
        asyncio.run(main(a))
    except websockets.InvalidStatus as exc:  # refused before the WebSocket opened (e.g. 403 without a valid key)
        code, body = exc.response.status_code, " ".join(exc.response.body.decode(errors="replace").split())
        print(f"error: the server refused the connection: HTTP {code}" + (f" {body}" if body else "")
              + (" (a wrong or missing --token?)" if code in (401, 403) else ""), file=sys.stderr)
        sys.exit(3)
    except websockets.ConnectionClosed as exc:  # the server ended the call (its close reason says why)
        print(f"error: the server closed the connection: {exc.rcvd.code if exc.rcvd else 1006} "
              f"{exc.rcvd.reason if exc.rcvd else ''}".rstrip(), file=sys.stderr)
        sys.exit(1)
    except (OSError, asyncio.TimeoutError) as exc:  # cannot connect (refused, unknown host, no handshake)
        print(f"error: cannot connect to {a.url}: {exc or 'no WebSocket handshake'}", file=sys.stderr)
        sys.exit(3)  # as the CLI and the other examples
    except RuntimeError as exc:  # no answer came within --timeout-s
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        print("interrupted", file=sys.stderr)
        sys.exit(130)
