"""The official OpenAI Python SDK's realtime client talking to a duplexkit server, unmodified.

    duplexkit serve tiny --port 8000
    pip install openai
    python examples/openai_sdk_realtime.py --url http://127.0.0.1:8000 --input question.wav --output answer.wav

Only ``base_url`` / ``websocket_base_url`` point at duplexkit. The connection uses the compat
profile (docs/protocol.md §1.2, §11): 24 kHz pcm16 input, GA event names, turn-based answering. With
``--vad`` the server VAD commits and answers on its own (no commit, no response.create).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
from pathlib import Path

import numpy as np

from duplexkit.audio import float32_to_pcm16, pcm16_to_float32, read_wav, write_wav
from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, remote_random_weights
from duplexkit import ASSETS_DIR

DEFAULT_WAV = ASSETS_DIR / "question_16k.wav"


async def main(args: argparse.Namespace) -> int:
    from openai import AsyncOpenAI

    ws_url = args.url.replace("http://", "ws://").replace("https://", "wss://")
    client = AsyncOpenAI(api_key=args.api_key or "sk-no-key", base_url=args.url + "/v1",
                         websocket_base_url=ws_url + "/v1")
    audio, _ = read_wav(args.input, 24_000)  # OpenAI's pcm16 is 24 kHz
    if args.vad:
        audio = np.concatenate([audio, np.zeros(36_000, np.float32)])  # 1.5 s of silence ends the turn
    out: list[bytes] = []
    if remote_random_weights(args.url):  # duplexkit's /health says so (not part of the OpenAI API)
        print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
    failed = False
    async with client.realtime.connect(model=args.model) as conn:
        ev = await conn.recv()
        if ev.type == "error":  # refused at the handshake (e.g. model_not_found): the server's text
            print(f"error: {ev.error.code}: {ev.error.message}", file=sys.stderr)
            return 1
        print("connected:", ev.type, ev.session.id if hasattr(ev, "session") else "")
        if not args.vad:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                               "audio": {"input": {"turn_detection": None}}})
        for i in range(0, len(audio), 4800):  # 200 ms appends
            await conn.input_audio_buffer.append(audio=base64.b64encode(float32_to_pcm16(audio[i:i + 4800])).decode())
        if not args.vad:
            await conn.input_audio_buffer.commit()
            await conn.response.create()
        async for ev in conn:
            if ev.type == "response.output_audio.delta":
                out.append(base64.b64decode(ev.delta))
            elif ev.type == "response.output_audio_transcript.delta":
                print(ev.delta, end="", flush=True)
            elif ev.type == "error":
                print(f"\nerror: {ev.error.code}: {ev.error.message}", file=sys.stderr)
            elif ev.type == "response.done":
                print(f"\nresponse {ev.response.id}: {ev.response.status}")
                failed = ev.response.status in ("cancelled", "failed")
                break
    pcm = pcm16_to_float32(b"".join(out))
    write_wav(args.output, pcm, 24_000)
    print(f"audio: {args.output} ({len(pcm) / 24000:.2f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (http)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default="minicpm-o-4.5", help="a served model id (see /v1/models)")
    p.add_argument("--input", default=str(DEFAULT_WAV))
    p.add_argument("--output", default="sdk_answer.wav")
    p.add_argument("--vad", action="store_true", help="let the server VAD end the turn and answer")
    args = p.parse_args()
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    try:
        sys.exit(asyncio.run(main(args)))
    except InvalidStatus as exc:  # refused before the WebSocket opened (e.g. 401 without a valid key)
        print(f"error: the server refused the connection: HTTP {exc.response.status_code} "
              f"{exc.response.body.decode(errors='replace').strip()}", file=sys.stderr)
        sys.exit(3)
    except ConnectionClosed as exc:  # the server ended the session (its close reason is the error code)
        print(f"error: the server closed the connection: {exc.rcvd.code if exc.rcvd else 1006} "
              f"{exc.rcvd.reason if exc.rcvd else ''}".rstrip(), file=sys.stderr)
        sys.exit(1)
    except OSError as exc:  # cannot connect (refused, unknown host)
        print(f"error: cannot connect to {args.url}: {exc}", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        print("interrupted", file=sys.stderr)
        sys.exit(130)
