"""Chat completions client: text (and optional audio) in, text + 24 kHz WAV out (docs/protocol.md §10).

    duplexkit serve tiny --port 8000
    python examples/chat_completions_client.py --url http://127.0.0.1:8000 --text "Tell me a joke" --output joke.wav
    python examples/chat_completions_client.py --url http://127.0.0.1:8000 --audio question.wav --stream

Non-stream: the audio choice is found by ``message.audio.data`` (not by index). Stream: SSE chunks
whose top-level ``modality`` says whether ``delta.content`` is text or a base64 WAV chunk.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys

import httpx
import numpy as np

from duplexkit.audio import read_wav, write_wav
from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, remote_random_weights


class ServerError(Exception):
    """A non-200 answer; the message is the server's own error text."""


def check(r: httpx.Response) -> None:
    """Raise :class:`ServerError` with the server's ``error.message`` for a non-200 response."""
    if r.status_code == 200:
        return
    r.read()
    try:
        err = r.json()["error"]
        text = f"{err.get('code') or err.get('type')}: {err.get('message')}"
    except (ValueError, KeyError, TypeError):
        text = r.text.strip()[:500]
    raise ServerError(f"HTTP {r.status_code}: {text}")


def build_body(args: argparse.Namespace) -> dict:
    content: list[dict] = []
    if args.text:
        content.append({"type": "text", "text": args.text})
    if args.audio:
        with open(args.audio, "rb") as f:
            content.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(f.read()).decode(),
                                                                   "format": "wav"}})
    body = {"messages": [{"role": "user", "content": content}], "modalities": ["text", "audio"],
            "audio": {"format": "wav"}, "stream": args.stream}
    if args.max_tokens is not None:  # else the server's default, which keeps its cap (tiny: 40 tokens)
        body["max_tokens"] = args.max_tokens
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def main(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = build_body(args)
    if remote_random_weights(args.url):  # the server's /health says so
        print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
    wavs: list[bytes] = []
    text = ""
    if not args.stream:
        r = httpx.post(url, json=body, headers=headers, timeout=args.timeout)
        check(r)
        data = r.json()
        for choice in data["choices"]:
            msg = choice["message"]
            if (msg.get("audio") or {}).get("data"):
                wavs.append(base64.b64decode(msg["audio"]["data"]))
            elif msg.get("content"):
                text = msg["content"]
        print(text)
        print("usage:", json.dumps(data.get("usage")))
    else:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=args.timeout) as r:
            check(r)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk["choices"]:
                    print("\nusage:", json.dumps(chunk.get("usage")))
                    continue
                c = chunk["choices"][0]["delta"].get("content")
                if not c:
                    continue
                if chunk.get("modality") == "audio":
                    wavs.append(base64.b64decode(c))
                else:
                    text += c
                    print(c, end="", flush=True)
        print()
    if wavs:
        audio = np.concatenate([read_wav(io.BytesIO(w), 24_000)[0] for w in wavs])
        write_wav(args.output, audio, 24_000)
        print(f"audio: {args.output} ({len(audio) / 24000:.2f} s)")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--text", default="Hello! Who are you?")
    p.add_argument("--audio", default=None, help="a WAV question (optional)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-tokens", type=int, default=None, help="answer token limit (default: the server's)")
    p.add_argument("--output", default="chat_answer.wav")
    p.add_argument("--timeout", type=float, default=600.0)
    try:
        sys.exit(main(p.parse_args()))
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except httpx.HTTPError as exc:  # cannot connect, timeout
        where = f" ({exc.request.url})" if getattr(exc, "_request", None) is not None else ""
        print(f"error: {type(exc).__name__}: {exc}{where}", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        print("interrupted", file=sys.stderr)
        sys.exit(130)
