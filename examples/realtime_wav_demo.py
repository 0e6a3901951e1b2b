"""Realtime WAV demo: stream a WAV into a duplexkit server, get the spoken answer back.

    duplexkit serve tiny --port 8000            # in another terminal (or a real checkpoint)
    python examples/realtime_wav_demo.py --url ws://127.0.0.1:8000 --input question.wav --output answer.wav

The input is sent in 100 ms appends paced in real time (docs/protocol.md §6.1), then committed, and an
answer is requested with ``response.create``. The answer's 24 kHz audio is written to ``--output``
and its transcript printed as it arrives. ``--inline tiny`` runs the model in-process instead.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from duplexkit.audio import read_wav, write_wav
from duplexkit.clients import DuplexClient, DuplexConnectionError, DuplexError, InlineDuplexClient
from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, remote_random_weights
from duplexkit import ASSETS_DIR

DEFAULT_WAV = ASSETS_DIR / "question_16k.wav"


async def main(args: argparse.Namespace) -> int:
    audio, _ = read_wav(args.input, 16_000)
    engine = None
    if args.inline:
        from duplexkit.engine import load_engine

        engine = load_engine(args.inline)
        client = InlineDuplexClient(engine, answer_policy="on_request" if args.inline == "tiny" else None,
                                    max_output_tokens=40 if args.inline == "tiny" else 1024)
    else:
        if remote_random_weights(args.url):  # the server's /health says so
            print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
        client = DuplexClient(args.url, api_key=args.api_key)
    try:
        async with client:
            print(f"session {client.session_id}")
            t0 = time.monotonic()
            step = 1600  # 100 ms at 16 kHz
            for i in range(0, len(audio), step):
                await client.send_audio(audio[i:i + step], rate=16_000)
                if args.realtime:
                    await asyncio.sleep(max(0.0, t0 + (i + step) / 16_000 - time.monotonic()))
            await client.commit()
            t_req = time.monotonic()
            response = await client.create_response()
            first = None
            async for ev in client.events():
                t = ev.type
                if t == "response.output_audio.delta" and first is None:
                    first = time.monotonic() - t_req
                if t == "response.output_audio_transcript.delta":
                    print(ev.delta, end="", flush=True)
                if t == "response.done" and ev.response.id == response.id:
                    break
            print()
            await response.wait(args.timeout)
    finally:
        if engine is not None:
            await engine.aclose()
    out = response.audio_array()
    write_wav(args.output, out if out.size else np.zeros(0, np.float32), 24_000)
    print(f"status={response.status} audio={len(out) / 24000:.2f} s -> {args.output}"
          + (f", first audio after {first:.2f} s" if first is not None else ""))
    return 0 if response.status in ("completed", "incomplete") else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8000", help="server URL")
    p.add_argument("--api-key", default=None, help="API key (if the server has one)")
    p.add_argument("--inline", default=None, metavar="MODEL", help="run MODEL in-process instead ('tiny' or a path)")
    p.add_argument("--input", default=str(DEFAULT_WAV), help="input WAV (any rate)")
    p.add_argument("--output", default="answer.wav", help="output WAV (24 kHz)")
    p.add_argument("--no-realtime", dest="realtime", action="store_false", help="send the input as fast as possible")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")
    try:
        sys.exit(asyncio.run(main(p.parse_args())))
    except DuplexError as exc:  # the server's (or the connection's) error, without a traceback
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        # 3: could not connect or the connection was refused/lost (as the CLI); 1: the server's error
        sys.exit(3 if isinstance(exc, DuplexConnectionError) else 1)
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        print("interrupted", file=sys.stderr)
        sys.exit(130)
