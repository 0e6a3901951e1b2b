"""The ``duplexkit`` command line: ``serve``, ``demo``, ``mic``, ``chat``, ``bench``.

Every subcommand has ``--help``. Heavy imports (torch, the model port, the server) happen only
inside the command that needs them, so ``duplexkit --help`` is instant.

Model argument (``serve``, ``demo``, ``mic``, ``chat``):
  * a MiniCPM-o 4.5 checkpoint directory;
  * ``tiny``: a small random-weight checkpoint in the real layout (built once, cached). Random
    weights never choose to listen or to end a turn, so with ``tiny`` sessions default to the
    ``on_request`` answer policy and a small token cap (``TINY_MAX_OUTPUT_TOKENS``);
  * ``scripted``: the torch-free :class:`duplexkit.testing.ScriptedEngine` (tests, protocol work).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from duplexkit.errors import DuplexkitError

__all__ = ["main", "build_parser", "load_engine", "TINY_MAX_OUTPUT_TOKENS"]

TINY_MAX_OUTPUT_TOKENS = 40
"""Default per-response token cap with the ``tiny`` model: random weights never emit
``<|turn_eos|>``; at up to 19 decoded tokens per unit (docs/model.md §5.3) this ends a response after
2-3 units (docs/protocol.md §4.1)."""

MIN_TURN_SAMPLES = 1600
"""The shortest input ``demo`` sends, in 16 kHz samples: 100 ms, the least a commit accepts
(``input_audio_buffer_empty`` below it, docs/protocol.md §9)."""

ASSET_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_DEMO_WAV = ASSET_DIR / "question_16k.wav"


def _eprint(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


DEBUG_ENV = "DUPLEXKIT_DEBUG"
"""Set to 1 to let errors show their full traceback instead of one ``error: …`` line."""

EXIT_OK = 0
"""Success (``demo``: the answer ended ``completed`` or ``incomplete``)."""
EXIT_FAILURE = 1
"""The run failed: the answer ended ``cancelled``/``failed``, a timeout, a server-side error, an
unexpected exception."""
EXIT_USAGE = 2
"""Bad arguments or input, refused before anything heavy runs: an option out of range, a missing or
invalid checkpoint directory (no/bad ``config.json``, no weight files), an unknown or invalid
``--layout``, a GPU layout on a machine without a visible GPU, an unreadable WAV, input under 100 ms."""
EXIT_BAD_INPUT = EXIT_USAGE  # the older name
EXIT_CONNECTION = 3
"""Network: a client cannot reach the server or is refused (connection refused, unauthorized, no
free session slot); ``serve`` cannot listen on ``--host``/``--port`` (port in use, address not
available)."""
EXIT_LOAD = 4
"""The model or engine failed to load after the pre-load checks passed (``CheckpointError``, out of
memory, a missing package such as torch)."""
EXIT_DEVICE = 5
"""``mic``: no usable audio device (none found, the named one missing, or it cannot be opened)."""
EXIT_INTERRUPTED = 130
"""Ctrl+C (SIGINT) stopped a command that ends by itself (``demo``, ``chat``, ``bench``). For the
commands that run until stopped (``serve``, ``mic`` without ``--duration``) Ctrl+C / SIGTERM is the
normal way to end them: they shut down cleanly and exit 0."""

EXIT_CODES = {EXIT_OK: "ok", EXIT_FAILURE: "run failed", EXIT_USAGE: "usage or invalid input",
              EXIT_CONNECTION: "network (connect / listen)", EXIT_LOAD: "model load failed",
              EXIT_DEVICE: "audio device unavailable", EXIT_INTERRUPTED: "interrupted"}
"""The one exit-status table every subcommand uses (docs/cli.md)."""


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _int_range(lo: int, hi: Optional[int] = None, *, allow_inf: bool = False):
    """An argparse type: an integer in ``lo..hi`` (the wire's limits), optionally the string ``inf``."""
    def parse(text: str):
        if allow_inf and text.strip().lower() == "inf":
            return "inf"
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer{' or inf' if allow_inf else ''}, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {rng}{' or inf' if allow_inf else ''}, got {v}")
        return v
    return parse


def _float_min(lo: float, *, strict: bool = False):
    """An argparse type: a finite float ``>= lo`` (``> lo`` when ``strict``)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if v != v or v in (float("inf"), float("-inf")) or v < lo or (strict and v == lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lo:g}, got {text}")
        return v
    return parse


class CliError(DuplexkitError):
    """A failure reported as one ``error: <message>`` line with exit status ``exit_status``."""

    default_code = "cli_error"

    def __init__(self, message: str, exit_status: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def _error_line(exc: BaseException) -> tuple[str, int]:
    """The message and exit status for an exception that ends a command (see EXIT_*)."""
    from duplexkit.errors import (AudioFormatError, DeviceError, DuplexConnectionError, DuplexError,
                                  DuplexTimeout, EngineLoadError, LayoutError)
    from duplexkit.preflight import PreflightError

    if isinstance(exc, CliError):
        return str(exc), exc.exit_status
    if isinstance(exc, EngineLoadError):
        return str(exc), EXIT_LOAD
    if isinstance(exc, PreflightError):
        return str(exc), EXIT_USAGE
    if isinstance(exc, FileNotFoundError):
        return str(exc), EXIT_BAD_INPUT
    if isinstance(exc, DuplexTimeout):
        return f"timed out: {exc.message}", EXIT_FAILURE
    if isinstance(exc, DuplexConnectionError):
        hints = {"unauthorized": "the server refused the API key (pass --api-key KEY)",
                 "session_capacity_exhausted": "the server has no free session slot; retry later"}
        msg = hints.get(exc.code, exc.message or exc.code)
        return (f"{msg} ({exc.message})" if exc.code in hints and exc.message else msg), EXIT_CONNECTION
    if isinstance(exc, DuplexError):
        if exc.code == "input_audio_buffer_empty":
            return "input too short: need at least 100 ms of audio", EXIT_BAD_INPUT
        return f"the server rejected the request: {exc.code}: {exc.message}", EXIT_FAILURE
    if isinstance(exc, AudioFormatError):
        return f"bad audio: {exc}", EXIT_BAD_INPUT
    if isinstance(exc, LayoutError):
        return f"bad layout: {exc}", EXIT_BAD_INPUT
    if isinstance(exc, DeviceError):
        return f"audio device error: {exc}", EXIT_DEVICE
    chat_mod = sys.modules.get("duplexkit_server.chat")
    if chat_mod is not None and isinstance(exc, getattr(chat_mod, "ChatRequestError", ())):
        return f"bad chat request: {exc}", EXIT_BAD_INPUT
    httpx = sys.modules.get("httpx")
    if httpx is not None:
        if isinstance(exc, httpx.TimeoutException):
            return f"timed out: {exc}", EXIT_FAILURE
        if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.UnsupportedProtocol)):
            return f"cannot connect: {exc}", EXIT_CONNECTION
        if isinstance(exc, httpx.HTTPError):
            return f"HTTP request failed: {exc}", EXIT_CONNECTION
    if isinstance(exc, (ConnectionError, OSError)):
        return f"{type(exc).__name__}: {exc}", EXIT_CONNECTION if isinstance(exc, ConnectionError) else EXIT_FAILURE
    return f"{type(exc).__name__}: {exc}", EXIT_FAILURE


# ---------------------------------------------------------------------------------------------
# engine loading
# ---------------------------------------------------------------------------------------------


def _parse_voice(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise CliError(f"--voice expects NAME=PATH, got {spec!r}", EXIT_BAD_INPUT)
    return name, Path(path)


def _parse_scripted(pairs: list[str]) -> dict:
    out: dict[str, Any] = {}
    for p in pairs or []:
        key, sep, val = p.partition("=")
        if not sep:
            raise CliError(f"--scripted expects KEY=VALUE, got {p!r}", EXIT_BAD_INPUT)
        try:
            out[key] = json.loads(val)
        except ValueError:
            out[key] = val
    return out


def load_engine(model: str, **kwargs):
    """:func:`duplexkit.engine.load_engine` for the CLI: a load failure becomes a :class:`CliError`
    with :data:`EXIT_LOAD` (the message keeps the loader's text). Other code imports
    ``load_engine`` from :mod:`duplexkit.engine`."""
    from duplexkit.engine.loading import load_engine as _load
    from duplexkit.errors import EngineLoadError

    try:
        return _load(model, **kwargs)
    except EngineLoadError as exc:
        raise CliError(str(exc), EXIT_LOAD) from exc.__cause__


def _check_model_arg(model: str, layout: Optional[str]) -> None:
    """Cheap checks before anything heavy loads and before ``serve`` binds its port
    (:func:`duplexkit.engine.loading.check_model_arg`)."""
    from duplexkit.engine.loading import check_model_arg

    check_model_arg(model, layout)


def _random_weights_notice(engine) -> None:
    from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE

    if getattr(engine, "random_weights", False):
        _eprint(RANDOM_WEIGHTS_NOTICE)
    if not getattr(engine, "supports_audio", True):
        _eprint("NOTE: the checkpoint has no assets/token2wav (no vocoder): answers are text only.")


def _remote_notice(url: str) -> bool:
    """Print the random-weights notice when the server at ``url`` reports ``random_weights`` in
    ``/health``. Returns whether it did."""
    from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, remote_random_weights

    if remote_random_weights(url):
        _eprint(RANDOM_WEIGHTS_NOTICE.replace("this model has", "the server's model has"))
        return True
    return False


def _bind(host: str, port: int):
    """Bind the listening socket before the banner and before the engine loads, so a port in use is
    one error line (exit :data:`EXIT_CONNECTION`) and nothing else. Returns the bound socket."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CliError(f"cannot listen on {host}:{port}: unknown host ({exc.strerror})", EXIT_CONNECTION) from exc
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: allows TIME_WAIT, not a live listener
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        import errno

        why = {errno.EADDRINUSE: "the port is already in use (another server? stop it or pass --port N)",
               errno.EADDRNOTAVAIL: "this machine has no such address (check --host)",
               errno.EACCES: "permission denied (ports below 1024 need privileges; pass --port N)"}
        raise CliError(f"cannot listen on {host}:{port}: {why.get(exc.errno, exc.strerror or exc)}",
                       EXIT_CONNECTION) from exc
    sock.set_inheritable(True)
    return sock


def _session_defaults(args, engine_name: str) -> dict:
    """SessionConfig overrides implied by the model choice and flags."""
    out: dict[str, Any] = {}
    policy = getattr(args, "answer_policy", None)
    if policy is None and engine_name == "tiny":
        policy = "on_request"
    if policy is not None:
        out["answer_policy"] = policy
    cap = getattr(args, "max_output_tokens", None)
    if cap is None and engine_name == "tiny":
        cap = TINY_MAX_OUTPUT_TOKENS
    if cap is not None:
        out["max_output_tokens"] = cap
    return out


# ---------------------------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------------------------


def _add_hardening_args(p) -> None:
    """``serve`` options of the server's security and quota layer (docs/server.md, "Security")."""
    p.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                   help="browser origin allowed to open sessions and POST, e.g. https://app.example.com "
                        "(repeatable; '*' = any; default: the server's own origin only)")
    p.add_argument("--max-body-bytes", type=_int_range(1024), default=16 * 2**20,
                   help="largest HTTP request body in bytes (default 16 MiB; larger: HTTP 413)")
    p.add_argument("--max-sessions-per-client", type=_int_range(0), default=None,
                   help="slots one client (API key, or address when auth is off) may hold; 0 = no limit "
                        "(default: half of --max-sessions, at least 1)")
    p.add_argument("--header-timeout-s", type=_float_min(0, strict=True), default=10.0,
                   help="close a connection whose request head is not complete after this many s (default 10)")
    p.add_argument("--no-session-resume", dest="session_resume", action="store_false",
                   help="do not offer session resume (capabilities.supports_session_resume: false)")
    p.add_argument("--resume-window-s", type=_float_min(0, strict=True), default=30.0,
                   help="how long a session whose connection dropped waits for session.resume, s (default 30)")
    p.add_argument("--resume-journal-events", type=_int_range(1), default=4096,
                   help="server events kept per session for replay on resume (default 4096)")
    p.add_argument("--resume-journal-bytes", type=_int_range(1024), default=16 * 2**20,
                   help="bytes of server events kept per session for replay on resume (default 16 MiB)")


def _hardening_settings(args) -> dict:
    return {"allow_origins": list(args.allow_origin or []), "max_body_bytes": args.max_body_bytes,
            "max_sessions_per_client": args.max_sessions_per_client, "header_timeout_s": args.header_timeout_s,
            "session_resume": args.session_resume, "resume_window_s": args.resume_window_s,
            "resume_journal_events": args.resume_journal_events, "resume_journal_bytes": args.resume_journal_bytes}


def cmd_serve(args) -> int:
    _check_model_arg(args.model, getattr(args, "layout", None))  # before importing the server or binding
    sock = _bind(args.host, args.port)
    import logging

    from duplexkit_server import ServerSettings, create_app, serve

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    defaults = _session_defaults(args, args.model)
    settings = ServerSettings(
        model_id=args.served_model_name, aliases=list(args.alias or []), api_keys=list(args.api_key or []),
        openai_model_ids=args.openai_model_ids,
        max_sessions=args.max_sessions, max_event_bytes=args.max_event_bytes, idle_timeout_s=args.idle_timeout_s,
        ping_interval_s=args.ping_interval_s, max_pending_input_s=args.max_pending_input_s,
        silence_slack_ms=args.silence_slack_ms,
        max_ref_audio_s=args.max_ref_audio_s, max_input_audio_s=args.max_input_audio_s,
        ref_audio_dir=Path(args.ref_audio_dir) if args.ref_audio_dir else None,
        max_output_tokens=defaults.get("max_output_tokens", 1024), answer_policy=defaults.get("answer_policy"),
        default_input_rate=args.default_input_rate, default_instructions=args.instructions,
        default_voice=Path(args.default_voice) if args.default_voice else None,
        voices=dict(_parse_voice(v) for v in (args.voice or [])),
        **_hardening_settings(args))
    scripted = _parse_scripted(args.scripted)

    def loader():
        try:
            engine = load_engine(args.model, layout=args.layout, dtype=args.dtype, seed=args.weights_seed,
                                 scripted=scripted, checked=True)
        except CliError as exc:  # the server prints "error: engine failed to load: <message>"
            prefix = "engine failed to load: "
            raise type(exc)(str(exc)[len(prefix):] if str(exc).startswith(prefix) else str(exc),
                            exc.exit_status) from exc.__cause__
        _random_weights_notice(engine)
        return engine

    app = create_app(engine_loader=loader, settings=settings)
    port = sock.getsockname()[1]
    _eprint(f"duplexkit serving {args.model} on http://{args.host}:{port} "
            f"(realtime: ws://{args.host}:{port}/v1/realtime?duplex=1 or /v1/duplex; OpenAI-compatible: "
            f"/v1/realtime; auth {'on' if settings.api_keys else 'off'})")
    rc = serve(app, host=args.host, port=port, log_level=args.log_level, sockets=[sock])
    err = app.state.duplexkit.load_error
    if err is not None:
        from duplexkit.errors import LayoutError

        return EXIT_USAGE if isinstance(err, LayoutError) else EXIT_LOAD
    return rc


# ---------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------


async def run_wav_turn(client, audio, *, chunk_ms: int = 100, pace: float = 0.0, response_timeout_s: float = 600.0,
                       modalities: Optional[list] = None) -> dict:
    """Stream ``audio`` (float32 16 kHz) into ``client``, commit, request a response and collect it.

    Returns a dict with the response handle and timings (seconds, monotonic): ``t_audio_end``,
    ``t_create``, ``t_first_audio``, ``t_done``.
    """
    import numpy as np

    step = 16 * chunk_ms
    t0 = time.monotonic()
    for i in range(0, len(audio), step):
        await client.send_audio(np.asarray(audio[i:i + step], np.float32), rate=16_000)
        if pace > 0:
            target = t0 + (i + step) / 16_000 / pace
            await asyncio.sleep(max(0.0, target - time.monotonic()))
    t_audio_end = time.monotonic()
    await client.commit()
    t_create = time.monotonic()
    handle = await client.create_response(modalities=modalities)
    await handle.wait(timeout=response_timeout_s)
    return {"handle": handle, "t_start": t0, "t_audio_end": t_audio_end, "t_create": t_create,
            "t_first_audio": handle.first_audio_at, "t_done": handle.done_at}


def _demo_timing_rows(r: dict, h, load_s: Optional[float], audio_s: float) -> list[tuple[str, str]]:
    """The demo's timing rows, each labelled with what it measures (wall-clock seconds).

    ``load_s`` is None with ``--url`` (the server loaded the model; no row). The last row is the
    wall-clock real-time factor of the answer: (create -> done) / seconds of answer audio; under 1
    means the answer was produced faster than it plays. It includes network and queueing time, not
    only model compute.
    """
    rows = []
    if load_s is not None:
        rows.append(("model load", f"{load_s:8.2f} s"))
    rows.append(("send input (wall)", f"{r['t_audio_end'] - r['t_start']:8.2f} s"))
    rows.append(("commit -> response.created", f"{(h.created_at - r['t_create']):8.2f} s"))
    if r["t_first_audio"]:
        rows.append(("TTFP (create -> first audio)", f"{r['t_first_audio'] - r['t_create']:8.2f} s"))
    done_s = (r["t_done"] - r["t_create"]) if r["t_done"] else float("nan")
    rows.append(("create -> response.done", f"{done_s:8.2f} s"))
    if audio_s > 0:
        rows.append(("answer audio", f"{audio_s:8.2f} s"))
        rows.append(("wall RTF (create -> done / audio)", f"{done_s / audio_s:8.2f}"))
    return rows


def _timing_table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


async def _demo_async(args) -> int:
    import numpy as np

    from duplexkit.audio import read_wav, write_wav
    from duplexkit.clients import DuplexClient, InlineDuplexClient

    audio, _ = read_wav(args.input, 16_000)
    if len(audio) < MIN_TURN_SAMPLES:
        raise CliError(f"input too short: need at least 100 ms of audio, {args.input} has "
                       f"{len(audio) * 1000 // 16_000} ms", EXIT_BAD_INPUT)
    session = {}
    if args.instructions:
        session["instructions"] = args.instructions
    engine = None
    load_s = None
    if args.url:
        random_weights = _remote_notice(args.url)
        client = DuplexClient(args.url, api_key=args.api_key, session=session, request_timeout_s=args.timeout)
    else:
        t_load = time.monotonic()
        engine = load_engine(args.model, layout=args.layout, seed=args.weights_seed)
        load_s = time.monotonic() - t_load
        random_weights = bool(getattr(engine, "random_weights", False))
        _random_weights_notice(engine)
        opts = _session_defaults(args, args.model)
        client = InlineDuplexClient(engine, session=session, request_timeout_s=args.timeout, **opts)
    try:
        async with client:
            r = await run_wav_turn(client, audio, pace=args.pace, response_timeout_s=args.timeout)
    finally:
        if engine is not None:
            await engine.aclose()
    h = r["handle"]
    out = h.audio_array()
    if args.output:
        write_wav(args.output, out if out.size else np.zeros(0, np.float32), 24_000)
    print(f"input:      {args.input} ({len(audio) / 16000:.2f} s)")
    print(f"response:   {h.id} status={h.status} trigger={h.trigger} epoch={h.epoch}")
    print(f"transcript: {h.transcript or h.text!r}")
    if args.output:
        print(f"audio:      {args.output} ({len(out) / 24000:.2f} s at 24 kHz, chunks {h.chunk_sizes})")
    print("timings (wall clock on this machine):")
    print(_timing_table(_demo_timing_rows(r, h, load_s, len(out) / 24_000)))
    if random_weights:
        print("note: random weights -> the transcript is gibberish and the audio is noise (expected).")
    return 0 if h.status in ("completed", "incomplete") else 1


def cmd_demo(args) -> int:
    return asyncio.run(_demo_async(args))


# ---------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------


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

    if not chunks or not path:
        return None
    parts = [read_wav(io.BytesIO(c), 24_000)[0] for c in chunks]
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    write_wav(path, audio, 24_000)
    return len(audio) / 24_000


def cmd_chat(args) -> int:
    if not args.url:
        _check_model_arg(args.model, args.layout)  # before importing the server modules or torch
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
            raise CliError(f"cannot connect to {url}: {exc}", EXIT_CONNECTION) from exc
        except httpx.TimeoutException as exc:
            raise CliError(f"timed out after {args.timeout:g} s waiting for {url}", EXIT_FAILURE) from exc
    else:
        text, wavs = asyncio.run(_chat_inline(args, body))
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
    from duplexkit_server.app import ServerSettings, ServerState
    from duplexkit_server.chat import parse_chat_request

    engine = load_engine(args.model, layout=args.layout, seed=args.weights_seed, checked=True)
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
    wavs = [wav_bytes(res.audio, 24_000)] if res.audio is not None and len(res.audio) else []
    return res.text, wavs


# ---------------------------------------------------------------------------------------------
# mic
# ---------------------------------------------------------------------------------------------


def _echo_config(choice: str):
    """``--echo`` -> the client's ``echo=`` option: an ``EchoConfig``, or None for ``off``.

    ``auto`` is ``aec`` when the AEC package (``duplexkit[echo]``) imports, else ``gate``.
    Raises CliError for ``aec`` without the package.
    """
    if choice == "off":
        return None
    from duplexkit.audio.echo import EchoConfig, aec_available

    if choice == "auto":
        choice = "aec" if aec_available() else "gate"
    elif choice == "aec" and not aec_available():
        raise CliError("--echo aec needs the AEC package: pip install 'duplexkit[echo]' (or use --echo gate)")
    return EchoConfig(mode=choice)


MIC_DEVICE_HELP = ("Fix: on a headless machine or in a container, start a PulseAudio server with virtual devices "
                   "(docs/troubleshooting.md, 'Audio devices'); or run `duplexkit mic --url ws://SERVER:PORT` on a "
                   "machine that has a microphone and speakers; or pick devices with --input-device / "
                   "--output-device (an index or a name substring from the list above).")


def _describe_devices(devices: list[dict]) -> str:
    if not devices:
        return "PortAudio sees no audio device at all."
    lines = ["PortAudio sees:"]
    for d in devices:
        mark = (" (default input)" if d["is_default_input"] else "") + (" (default output)" if d["is_default_output"] else "")
        lines.append(f"  [{d['index']}] {d['name']} ({d['hostapi']}, {d['max_input_channels']} in / "
                     f"{d['max_output_channels']} out){mark}")
    return "\n".join(lines)


def _check_audio_devices(input_spec: Optional[str], output_spec: Optional[str]) -> None:
    """Before loading anything: is there an input and an output device (the named ones, or defaults)?

    Raises:
        CliError(EXIT_DEVICE) naming what is missing, the fix, and every device PortAudio lists;
        DeviceError (also exit 5) when sounddevice/PortAudio itself is missing.
    """
    from duplexkit.audio import list_devices

    devices = list_devices()
    problems = []
    for kind, spec, chan in (("input", input_spec, "max_input_channels"), ("output", output_spec, "max_output_channels")):
        usable = [d for d in devices if d[chan] > 0]
        if spec is None:
            if not any(d[f"is_default_{kind}"] for d in usable):
                problems.append(f"no default audio {kind} device" if usable else f"no audio {kind} device")
        elif spec.strip().isdigit():
            if not any(d["index"] == int(spec) for d in usable):
                problems.append(f"--{kind}-device {spec} is not an {kind} device")
        elif not any(spec.lower() in d["name"].lower() for d in usable):
            problems.append(f"no {kind} device matching --{kind}-device {spec!r}")
    if problems:
        raise CliError(f"{', '.join(problems)}.\n{_describe_devices(devices)}\n{MIC_DEVICE_HELP}", EXIT_DEVICE)


async def _mic_async(args) -> int:
    import signal

    import numpy as np

    if not args.url:
        _check_model_arg(args.model, args.layout)  # before the device query and before loading the model
    _check_audio_devices(args.input_device, args.output_device)

    from duplexkit.audio import MicStream, PlaybackBuffer, SpeakerStream
    from duplexkit.clients import DuplexClient, InlineDuplexClient

    player = PlaybackBuffer(24_000)
    session: dict[str, Any] = {}
    if args.instructions:
        session["instructions"] = args.instructions
    if args.vad_responses:
        session["turn_detection"] = {"type": "server_vad", "create_response": True, "interrupt_response": True,
                                     "silence_duration_ms": args.silence_ms}
    common = dict(session=session, player=player, barge_in=not args.no_barge_in, input_rate=16_000,
                  request_timeout_s=60.0)
    echo = _echo_config(args.echo)
    if echo is not None:  # the client's echo option (EchoConfig); "off" leaves the client as it was
        common["echo"] = echo
    engine = None
    if args.url:
        _remote_notice(args.url)
        client = DuplexClient(args.url, api_key=args.api_key, **common)
    else:  # Ctrl+C while loading interrupts (status 130)
        engine = load_engine(args.model, layout=args.layout, seed=args.weights_seed, checked=True)
        _random_weights_notice(engine)
        client = InlineDuplexClient(engine, **common, **_session_defaults(args, args.model))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # from here Ctrl+C / SIGTERM end the conversation (exit 0)
        loop.add_signal_handler(sig, stop.set)
    ready = [False]

    mic_q: asyncio.Queue = asyncio.Queue()
    out_audio: list = []
    transcript_lines: list[str] = []
    heard = [0]
    tty = sys.stdout.isatty()
    level = [0.0]

    def on_block(block):  # called from the audio thread: hand the samples to the event loop
        loop.call_soon_threadsafe(mic_q.put_nowait, block.audio)

    speaker = SpeakerStream(player, rate=24_000, device=_device(args.output_device))
    mic = MicStream(rate=16_000, block_ms=args.block_ms, device=_device(args.input_device), on_block=on_block)
    try:
        async with client:

            async def pump_mic():
                while True:
                    x = await mic_q.get()
                    level[0] = float(np.sqrt(np.mean(x * x))) if len(x) else 0.0
                    await client.send_audio(x, rate=16_000)

            async def show_events():
                current = ""
                async for ev in client.events():
                    t = ev.type
                    if t == "response.output_audio_transcript.delta" or t == "response.output_text.delta":
                        current += ev.delta or ""
                        if tty:
                            print(f"\rassistant: {current[-70:]}  [mic {20 * np.log10(level[0] + 1e-9):6.1f} dBFS]",
                                  end="", flush=True)
                    elif t == "response.done":
                        line = f"assistant ({ev.response.status}): {current}"
                        transcript_lines.append(line)
                        print(("\r" if tty else "") + line, flush=True)
                        current = ""
                    elif t == "input_audio_buffer.speech_started":
                        heard[0] += 1
                        print(("\n" if tty and current else "") + "[you are speaking]", flush=True)
                    elif t == "error":
                        print(f"[error] {ev.error.code}: {ev.error.message}", flush=True)

            async def collect_output():
                async for h in client.responses():
                    async def grab(h=h):
                        try:
                            async for pcm in h.audio():
                                out_audio.append(pcm)
                        except Exception:
                            pass
                    asyncio.ensure_future(grab())

            speaker.start()
            mic.start()
            tasks = [asyncio.ensure_future(pump_mic()), asyncio.ensure_future(show_events()),
                     asyncio.ensure_future(collect_output())]
            # "ready" only once the model is loaded, the session is open and the microphone records:
            # audio played from now on is heard. --duration counts from here.
            _eprint(f"session {client.session_id} ready; speak (Ctrl+C to quit)")
            ready[0] = True
            t_end = time.monotonic() + args.duration if args.duration else None
            try:
                while not stop.is_set() and (t_end is None or time.monotonic() < t_end):
                    try:
                        await asyncio.wait_for(stop.wait(), 0.1)
                    except asyncio.TimeoutError:
                        pass
                    if any(t.done() for t in tasks):
                        break
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        mic.stop()
        speaker.stop()
        if engine is not None:
            await engine.aclose()
        if ready[0]:
            _mic_outputs(args, out_audio, transcript_lines, client, heard[0])
    return 0


def _mic_outputs(args, out_audio: list, transcript_lines: list, client, heard: int) -> None:
    """Write ``--save-output`` and ``--summary`` (also after Ctrl+C) and a closing line on stderr."""
    import numpy as np

    if args.save_output and out_audio:
        from duplexkit.audio import write_wav
        write_wav(args.save_output, np.concatenate(out_audio), 24_000)
    if args.summary:
        Path(args.summary).write_text(json.dumps({
            "responses": transcript_lines, "output_samples": int(sum(len(a) for a in out_audio)),
            "speech_started": heard, "barge_ins": getattr(client, "barge_ins", 0)}, indent=2))
    _eprint(f"mic: heard speech {heard} time(s), {len(transcript_lines)} response(s)"
            + ("" if heard else " (nothing heard: check the input device and its level, see --input-device)"))


def _device(spec: Optional[str]):
    """A sounddevice device argument: an index when numeric, else a name substring (None = default)."""
    if spec is None:
        return None
    return int(spec) if spec.strip().isdigit() else spec


def cmd_mic(args) -> int:
    # Ctrl+C / SIGTERM end the conversation with status 0 (signal handlers in _mic_async); DeviceError
    # and device checks -> 5, a server that cannot be reached -> 3: reported by main() (_error_line)
    return asyncio.run(_mic_async(args))


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------


def cmd_bench(args) -> int:
    import runpy

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    scripts = sorted(p.stem for p in root.glob("*.py") if not p.name.startswith("_")) if root.is_dir() else []
    if not args.name:
        print("available benchmarks:", ", ".join(scripts) or "(none found in a source checkout)")
        return 0
    path = root / f"{args.name}.py"
    if not path.is_file():
        raise CliError(f"unknown benchmark {args.name!r}; available: {', '.join(scripts) or 'none'}", EXIT_USAGE)
    sys.argv = [str(path), *args.rest]
    runpy.run_path(str(path), run_name="__main__")
    return 0


# ---------------------------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------------------------


def _add_model_args(p: argparse.ArgumentParser, *, default: Optional[str] = "tiny", session: bool = True) -> None:
    p.add_argument("model", nargs="?" if default else None, default=default,
                   help="checkpoint directory, 'tiny' (random weights, built once and cached) or 'scripted' "
                        f"(torch-free fake engine){' (default: ' + default + ')' if default else ''}")
    p.add_argument("--layout", default=None,
                   help="device layout: 'cpu', '1gpu', '2gpu', ... or a YAML path (default: 1gpu with CUDA, else cpu)")
    p.add_argument("--weights-seed", type=int, default=0,
                   help="seed of the tiny checkpoint's random weights (default 0; ignored for real checkpoints)")
    if not session:
        return
    p.add_argument("--answer-policy", choices=["model", "on_request"], default=None,
                   help="when the model may speak: 'model' decides per unit, 'on_request' only answers "
                        "response.create / VAD commits (default: on_request for tiny, else the profile default)")
    p.add_argument("--max-output-tokens", type=_int_range(1, 8192, allow_inf=True), default=None,
                   help=f"per-response token cap, 1..8192 or inf (default: {TINY_MAX_OUTPUT_TOKENS} for tiny, "
                        "else 1024)")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``error: …``, exit 2), like every other CLI failure."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(EXIT_BAD_INPUT, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="duplexkit", description="Realtime full-duplex voice agents "
                                     "(MiniCPM-o 4.5): server, demos and tools.")
    parser.add_argument("--version", action="version", version=f"duplexkit {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("serve", help="run the OpenAI-Realtime-compatible server",
                       description="Serve /v1/realtime, /v1/duplex, /v1/chat/completions, /v1/models and /health.")
    _add_model_args(p, default=None)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_int_range(0, 65535), default=8000, help="TCP port, 0..65535 (default 8000)")
    p.add_argument("--api-key", action="append", default=None,
                   help="accepted API key (repeatable; also $DUPLEXKIT_API_KEY); none = auth off")
    p.add_argument("--max-sessions", type=_int_range(1), default=8,
                   help="session slots shared by realtime sessions and chat requests (default 8)")
    p.add_argument("--ref-audio-dir", default=None,
                   help="directory whose files may be named as ref_audio paths (default: paths refused)")
    p.add_argument("--max-ref-audio-s", type=_float_min(0.5), default=30.0, help="longest reference voice in s (default 30)")
    p.add_argument("--max-input-audio-s", type=_float_min(0, strict=True), default=60.0,
                   help="longest chat-completions input audio in s (default 60)")
    p.add_argument("--max-event-bytes", type=_int_range(1024), default=16 * 2**20,
                   help="largest client event in bytes (default 16 MiB; frames over twice this close with 1009)")
    p.add_argument("--max-pending-input-s", type=_float_min(0, strict=True), default=10.0,
                   help="unconsumed input before input_backpressure, in s (default 10)")
    p.add_argument("--silence-slack-ms", type=_int_range(0, 3_600_000), default=250,
                   help="grace after a unit deadline before silence is fed to an active response, ms (default 250)")
    p.add_argument("--idle-timeout-s", type=_float_min(0, strict=True), default=300.0,
                   help="close sessions without client events after this many s (default 300)")
    p.add_argument("--ping-interval-s", type=_float_min(0, strict=True), default=20.0, help="WebSocket ping period in s (default 20)")
    p.add_argument("--default-input-rate", type=_int_range(8000, 48000), default=16_000,
                   help="rate of a bare 'pcm16' input format in the duplex profile, Hz (default 16000)")
    p.add_argument("--instructions", default=None, help="default system prompt (default: the model's own)")
    p.add_argument("--default-voice", default=None, metavar="WAV",
                   help="default reference voice clip, 0.5-30 s (default: the checkpoint's bundled voice)")
    p.add_argument("--voice", action="append", default=None, metavar="NAME=WAV",
                   help="register a named voice selectable with session.voice (repeatable)")
    p.add_argument("--served-model-name", default=None, help="model id reported to clients (default: the engine's)")
    p.add_argument("--alias", action="append", default=None, help="another accepted model id (repeatable)")
    p.add_argument("--openai-model-ids", default="map", choices=["map", "refuse"],
                   help="gpt-realtime*/gpt-4o* model ids: serve them with this model, logged (map, default) "
                        "or refuse them with model_not_found")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="thinker dtype override (default: the layout's)")
    p.add_argument("--scripted", action="append", default=None, metavar="KEY=VALUE",
                   help="ScriptedEngine option for the 'scripted' model, e.g. units_per_turn=3 (repeatable)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level (default info)")
    _add_hardening_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="WAV in -> transcript + WAV out + timing table",
                       description="Send a WAV as one user turn, request an answer, save it, print timings. "
                                   "Default: the tiny random-weight model and the bundled question.")
    _add_model_args(p)
    p.add_argument("--input", "-i", default=str(DEFAULT_DEMO_WAV),
                   help="input WAV (any rate; default: the bundled 'What is the weather like today in Paris?')")
    p.add_argument("--output", "-o", default="demo_output.wav", help="output WAV, 24 kHz (default demo_output.wav)")
    p.add_argument("--url", default=None, help="talk to a running server instead of loading the model in-process")
    p.add_argument("--api-key", default=None, help="API key for --url")
    p.add_argument("--instructions", default=None, help="system prompt")
    p.add_argument("--pace", type=_float_min(0), default=0.0,
                   help="send the input at this multiple of real time (0 = as fast as possible, default)")
    p.add_argument("--timeout", type=_float_min(0, strict=True), default=600.0,
                   help="seconds to wait for the answer (default 600)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("mic", help="talk to the model: microphone in, speaker out, barge-in by speaking",
                       description="Live conversation with local barge-in (webrtcvad) and a live transcript.")
    _add_model_args(p)
    p.add_argument("--url", default=None, help="server URL (default: run the model in-process)")
    p.add_argument("--api-key", default=None, help="API key for --url")
    p.add_argument("--input-device", default=None, help="sounddevice input device (index or name substring)")
    p.add_argument("--output-device", default=None, help="sounddevice output device (index or name substring)")
    p.add_argument("--block-ms", type=_int_range(10, 1000), default=100, help="microphone block size in ms (default 100)")
    p.add_argument("--no-barge-in", action="store_true", help="do not interrupt the assistant when you speak")
    p.add_argument("--no-vad-responses", dest="vad_responses", action="store_false",
                   help="do not ask for an answer after each utterance (let the model decide)")
    p.add_argument("--silence-ms", type=_int_range(0), default=500, help="silence that ends an utterance, ms (default 500)")
    p.add_argument("--echo", choices=["off", "gate", "aec", "auto"], default="auto",
                   help="echo control for speakers without headphones: 'gate' = barge-in needs speech well above "
                        "the playback echo level; 'aec' = WebRTC echo cancellation (pip install 'duplexkit[echo]') "
                        "plus the gate; 'auto' = aec when installed, else gate; 'off' = none (headphones). "
                        "Default auto: a headset cannot be detected reliably, so echo control is always on "
                        "unless you pass --echo off")
    p.add_argument("--instructions", default=None, help="system prompt")
    p.add_argument("--duration", type=_float_min(0, strict=True), default=None, help="stop after this many seconds (default: Ctrl+C)")
    p.add_argument("--save-output", default=None, help="also write everything the assistant said to this WAV")
    p.add_argument("--summary", default=None, help="write a JSON summary (responses, barge-ins) here at exit")
    p.set_defaults(func=cmd_mic)

    p = sub.add_parser("chat", help="one /v1/chat/completions call (text and/or audio in, text + WAV out)",
                       description="Send one chat-completions request (text and/or a WAV) and print the answer; "
                                   "the spoken answer is saved as a 24 kHz WAV. Runs the model in-process, or "
                                   "talks to a running server with --url. Default: the tiny random-weight model.")
    _add_model_args(p, session=False)
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed sent with the request (repeatable answers on the same hardware; default: none)")
    p.add_argument("--url", default=None, help="server URL (default: run the model in-process)")
    p.add_argument("--api-key", default=None, help="API key for --url")
    p.add_argument("--text", "-t", default=None, help="user text")
    p.add_argument("--audio", "-a", default=None, help="user audio WAV")
    p.add_argument("--output", "-o", default="chat_output.wav", help="where to save the spoken answer (24 kHz WAV)")
    p.add_argument("--no-audio", action="store_true", help="text answer only")
    p.add_argument("--stream", action="store_true", help="stream the answer (SSE)")
    p.add_argument("--max-tokens", type=_int_range(1, 8192), default=None,
                   help="max answer tokens, 1..8192 (default: not sent; the server's default applies, which keeps "
                        f"its --max-output-tokens cap: {TINY_MAX_OUTPUT_TOKENS} for tiny, else up to 256)")
    p.add_argument("--served-model", default=None, help="model id to send (default: the server's)")
    p.add_argument("--timeout", type=_float_min(0, strict=True), default=600.0, help="HTTP timeout in s (default 600)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="run a benchmark script from benchmarks/ (prints tables)")
    p.add_argument("name", nargs="?", default=None, help="benchmark name (omit to list them)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=cmd_bench)
    return parser


def _version() -> str:
    from duplexkit import __version__

    return __version__


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        _eprint("interrupted")
        return EXIT_INTERRUPTED
    except SystemExit:
        raise
    except Exception as exc:
        # one clean line (and a documented status, see EXIT_*); DUPLEXKIT_DEBUG=1 shows the traceback
        message, code = _error_line(exc)
        if _debug():
            import traceback

            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        _eprint(f"error: {message}")
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
