"""The latency the WebRTC transport adds, side by side with the WebSocket (docs/webrtc.md).

Starts ``duplexkit serve scripted`` (a subprocess; or targets ``--url``) and runs ``--rounds``
rounds, alternating the two transports on the same server, one new session per round:

* ``websocket``: ``/v1/realtime`` (compat profile), 100 ms ``input_audio_buffer.append`` events
  paced in real time (silence, the question, silence); latency = end of the user's speech (the
  moment its last sample above -50 dBFS was recorded, each 100 ms append being sent once recorded)
  -> the first ``response.output_audio.delta`` received;
* ``webrtc``: ``POST /v1/realtime/calls`` with an aiortc peer (examples/webrtc_client.py), the same
  audio on an Opus microphone track in 20 ms frames (each sent once recorded); latency = end of
  speech -> the first 20 ms frame above -34 dBFS decoded from the remote track.

The utterance (0.5 s of silence, then the question) starts each session's input on both transports,
so the scripted engine's 1 s units fall at the same place in the speech.

Both answers are the scripted engine's tone, started by the server VAD's commit
(``create_response``), so the difference is what the transport adds: Opus encode/decode, RTP,
aiortc's jitter buffer and the paced track against base64 JSON over a WebSocket. Prints median /
min / max per transport (ms) and writes the samples with ``--out``.

    python benchmarks/webrtc_latency.py --rounds 6
    python benchmarks/webrtc_latency.py --url http://127.0.0.1:8000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from duplexkit.audio import read_wav  # noqa: E402
from duplexkit.audio.resample import resample  # noqa: E402

from _realtime import speech_edges  # noqa: E402

SR = 16_000  # Hz, the fixture
WS_RATE = 24_000  # Hz, the compat profile's input rate (docs/protocol.md §4.1)
LOUD = 0.02  # rms of a received 20 ms frame that counts as answer audio (-34 dBFS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(units: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "duplexkit.cli", "serve", "scripted", "--host", "127.0.0.1",
                             "--port", str(port), "--scripted", f"units_per_turn={units}", "--log-level", "warning"],
                            cwd=str(REPO), env=dict(os.environ, TORCHDYNAMO_DISABLE="1"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready")


def _utterance(question: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lead silence + speech up to its last loud sample, the rest + 4 s of silence)."""
    _, end = speech_edges(question)
    lead = np.zeros(SR // 2, np.float32)
    return np.concatenate([lead, question[:end]]), np.concatenate([question[end:], np.zeros(4 * SR, np.float32)])


async def ws_round(url: str, speech: np.ndarray, rest: np.ndarray, timeout: float, key: Optional[str] = None) -> float:
    """Like a microphone client: the 100 ms append holding samples [i*0.1, (i+1)*0.1) s is sent once
    they are recorded, at t0 + (i+1)*0.1 s; the speech ends at t0 + len(speech)/SR."""
    import websockets

    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with websockets.connect(url.replace("http", "ws", 1) + "/v1/realtime", max_size=None,
                                  additional_headers=headers) as ws:
        first_audio: asyncio.Future = asyncio.get_running_loop().create_future()
        created: asyncio.Future = asyncio.get_running_loop().create_future()

        async def read() -> None:
            async for raw in ws:
                ev = json.loads(raw)
                if ev.get("type") == "session.created" and not created.done():
                    created.set_result(True)
                if ev.get("type") == "response.output_audio.delta" and not first_audio.done():
                    first_audio.set_result(time.monotonic())

        rx = asyncio.create_task(read())
        await asyncio.wait_for(created, timeout)
        audio = resample(np.concatenate([speech, rest]), SR, WS_RATE)  # the compat profile's pcm16 is 24 kHz
        step = WS_RATE // 10
        t0 = time.monotonic()
        t_end = t0 + speech.size / SR
        for i in range(-(-audio.size // step)):
            wait = t0 + (i + 1) * 0.1 - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            piece = audio[i * step:(i + 1) * step]
            pcm = (np.clip(piece, -1, 1) * 32767).astype("<i2").tobytes()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
            if first_audio.done():
                break
        t_first = await asyncio.wait_for(first_audio, timeout)
        rx.cancel()
        await ws.send(json.dumps({"type": "session.close"}))
        return (t_first - t_end) * 1000


async def rtc_round(url: str, speech: np.ndarray, rest: np.ndarray, timeout: float, key: Optional[str] = None) -> float:
    """The utterance is the microphone track's first audio (the session's input starts with it, as
    on the WebSocket); frame k (20 ms) is sent at t_first_frame + k*0.02 s, i.e. once recorded with
    t0 = t_first_frame - 0.02 s; the speech ends at t0 + len(speech)/SR."""
    from webrtc_client import RtcCall

    call = RtcCall(url, key=key)
    started = asyncio.get_running_loop().create_future()
    call.say(np.concatenate([speech, rest]), SR, started)
    await call.connect(timeout=timeout)
    try:
        t0 = await asyncio.wait_for(started, timeout) - 0.02
        t_end = t0 + speech.size / SR
        t_first = await call.wait_for(lambda c: c.first_sound(t_end, LOUD), timeout, "the answer audio")
        return (t_first - t_end) * 1000
    finally:
        await call.close()


async def run(url: str, rounds: int, timeout: float, key: Optional[str] = None) -> dict:
    q, _ = read_wav(REPO / "tests" / "fixtures" / "audio" / "question_16k.wav", SR)
    speech, rest = _utterance(q)
    res: dict[str, list[float]] = {"websocket": [], "webrtc": []}
    for r in range(rounds):
        for name, fn in (("websocket", ws_round), ("webrtc", rtc_round)) if r % 2 == 0 else \
                (("webrtc", rtc_round), ("websocket", ws_round)):
            ms = await fn(url, speech, rest, timeout, key)
            res[name].append(ms)
            print(f"round {r + 1} {name:9s} {ms:7.0f} ms", flush=True)
            await asyncio.sleep(0.5)
    return res


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="end of speech -> first answer audio, WebSocket vs WebRTC")
    ap.add_argument("--url", default=None, help="a running server (default: start duplexkit serve scripted)")
    ap.add_argument("--key", default=None, help="API key of --url (Bearer)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--units", type=int, default=1, help="scripted answer length, units (s)")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--out", default=None, help="write the samples as JSON here")
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = _start_server(args.units)
    try:
        res = asyncio.run(run(url, args.rounds, args.timeout, args.key))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(f"\nend of user speech -> first answer audio, ms ({args.rounds} rounds each, same server, alternating)")
    print(f"{'transport':10s} {'median':>7s} {'min':>7s} {'max':>7s}")
    for name, v in res.items():
        print(f"{name:10s} {statistics.median(v):7.0f} {min(v):7.0f} {max(v):7.0f}")
    d = statistics.median(res["webrtc"]) - statistics.median(res["websocket"])
    print(f"webrtc adds {d:+.0f} ms (median difference)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
