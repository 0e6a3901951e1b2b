"""``duplexkit chat``: one chat-completions request (text + speech)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional
from .common import (
    CliError,
    UNAUTHORIZED_HINT,
    EXIT_BAD_INPUT,
    EXIT_CONNECTION,
    EXIT_FAILURE,
    _check_model_arg,
    _random_weights_notice,
    _remote_notice,
    _session_defaults,
    check_output_file,
    check_url_args,
    load_engine_async,
    no_server_hint,
    run_async,
)


def _chat_body(args) -> dict:
    import base64

    content: list[dict] = []
    if args.text:
        content.append({"type": "text", "text": args.text})
    if args.audio:
        from duplexkit.audio import read_wav

        path = Path(args.audio)
        if not path.is_file():
            raise CliError(f"audio file not found: {args.audio}", EXIT_BAD_INPUT)
        read_wav(path)  # an unreadable WAV is a local input error (AudioFormatError -> exit 2)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        content.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
    if not content:
        raise CliError("chat needs --text and/or --audio", EXIT_BAD_INPUT)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "stream": bool(args.stream)}
    if args.served_model is not None:
        body["model"] = args.served_model
    if args.max_tokens is not None:  # else the server's default, which respects its cap (tiny: 40)
        body["max_tokens"] = args.max_tokens
    if not args.no_audio:
        body["modalities"] = ["text", "audio"]
        body["audio"] = {"format": "wav"}
    if args.seed is not None:
        body["seed"] = args.seed
    return body


def _save_chat_audio(chunks: list, path: Optional[str]) -> Optional[float]:
    import io

    import numpy as np

    from duplexkit.audio import read_wav, write_wav
    from duplexkit.audio.playback import OUTPUT_RATE

    if not chunks or not path:
        return None
    parts = [read_wav(io.BytesIO(c), OUTPUT_RATE)[0] for c in chunks]
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    write_wav(path, audio, OUTPUT_RATE)
    return len(audio) / OUTPUT_RATE


def cmd_chat(args) -> int:
    check_url_args(args, "chat")  # a MODEL or --layout would be ignored with --url
    if not args.url:
        _check_model_arg(args.model, args.layout)  # before importing the server modules or torch
    if args.output and not args.no_audio:  # before the request, not after the answer
        check_output_file(args.output, "--output")
    body = _chat_body(args)
    if args.url:
        import httpx

        url = args.url.rstrip("/")
        if not url.endswith("/v1/chat/completions"):
            url = url.replace("ws://", "http://").replace("wss://", "https://")
            url = url.split("/v1/")[0] + "/v1/chat/completions"
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        _remote_notice(url)
        try:
            text, wavs = _chat_http(url, body, headers, args)
        except httpx.ConnectError as exc:
            raise CliError(f"cannot connect to {url}: {exc}; {no_server_hint()}", EXIT_CONNECTION) from exc
        except httpx.TimeoutException as exc:
            raise CliError(f"timed out after {args.timeout:g} s waiting for {url}", EXIT_FAILURE) from exc
    else:
        text, wavs = run_async(_chat_inline(args, body))
        print(text)
    secs = _save_chat_audio(wavs, args.output)
    if secs is not None:
        print(f"audio: {args.output} ({secs:.2f} s at 24 kHz)")
    return 0


def _http_error(status: int, body: str) -> CliError:
    try:
        err = json.loads(body).get("error") or {}
        msg = f"{err.get('code') or err.get('type')}: {err.get('message')}"
    except (ValueError, AttributeError):
        msg = body.strip()[:500]
    code = EXIT_CONNECTION if status in (401, 403, 503) else EXIT_FAILURE
    if status == 401:  # as demo and mic say it
        return CliError(f"{UNAUTHORIZED_HINT} (HTTP 401: {msg})", code)
    return CliError(f"the server answered HTTP {status}: {msg}", code)


def _chat_http(url: str, body: dict, headers: dict, args) -> tuple[str, list[bytes]]:
    import base64

    import httpx

    wavs: list[bytes] = []
    text = ""
    if args.stream:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=args.timeout) as r:
            if r.status_code != 200:
                r.read()
                raise _http_error(r.status_code, r.text)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                for ch in chunk.get("choices", []):
                    c = (ch.get("delta") or {}).get("content")
                    if not c:
                        continue
                    if chunk.get("modality") == "audio":
                        wavs.append(base64.b64decode(c))
                    else:
                        text += c
                        print(c, end="", flush=True)
            print()
    else:
        r = httpx.post(url, json=body, headers=headers, timeout=args.timeout)
        if r.status_code != 200:
            raise _http_error(r.status_code, r.text)
        data = r.json()
        for ch in data["choices"]:
            msg = ch.get("message") or {}
            if (msg.get("audio") or {}).get("data"):
                wavs.append(base64.b64decode(msg["audio"]["data"]))
            elif msg.get("content"):
                text = msg["content"]
        print(text)
    return text, wavs


async def _chat_inline(args, body: dict) -> tuple[str, list[bytes]]:
    from duplexkit.audio import wav_bytes
    from duplexkit.audio.playback import OUTPUT_RATE
    from duplexkit_server.app import ServerSettings, ServerState
    from duplexkit_server.chat import parse_chat_request

    engine = await load_engine_async(args.model, layout=args.layout, seed=args.weights_seed, checked=True)
    _random_weights_notice(engine)
    try:
        # the same per-response cap as `serve MODEL` (tiny: TINY_MAX_OUTPUT_TOKENS), so a request
        # without --max-tokens gets the server's default
        cap = _session_defaults(args, args.model).get("max_output_tokens", 1024)
        state = ServerState(ServerSettings(max_output_tokens=cap), engine)
        req, _ = parse_chat_request(body, state)
        res = await engine.generate(req)
    finally:
        await engine.aclose()
    wavs = [wav_bytes(res.audio, OUTPUT_RATE)] if res.audio is not None and len(res.audio) else []
    return res.text, wavs
