"""``duplexkit demo``: one spoken turn from a WAV file, with a timing table."""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from .common import (
    CliError,
    EXIT_BAD_INPUT,
    EXIT_CONNECTION,
    EXIT_FAILURE,
    MIN_TURN_SAMPLES,
    _random_weights_notice,
    _remote_notice,
    _session_defaults,
    check_output_file,
    check_url_args,
    command_name,
    load_engine_async,
    run_async,
    session_end_line,
)
from duplexkit.errors import ErrorCode


BURST_S = 4.0
"""With ``pace`` 0, the seconds of input sent at once before the rest goes at real time: the server
drops input more than ``max_pending_input_s`` (10 s by default) ahead of the model with
``input_backpressure`` (docs/protocol.md §6.1, which also asks clients to send at real-time pace)."""

PROGRESS_EVERY_S = 10.0
"""Seconds of input between two progress calls of :func:`run_wav_turn`."""


async def run_wav_turn(client, audio, *, chunk_ms: int = 100, pace: float = 0.0, response_timeout_s: float = 600.0,
                       modalities: Optional[list] = None, progress=None) -> dict:
    """Stream ``audio`` (float32 [n], 16 kHz) into ``client``, commit, request a response and collect it.

    Args:
        pace: multiple of real time for sending. 0 (as fast as the server takes it): the first
            :data:`BURST_S` s at once, then real time, since the server drops input that runs more
            than its pending-input cap ahead of the model.
        progress: called as ``progress(sent_s, total_s)`` about every :data:`PROGRESS_EVERY_S` s of
            input sent (None: silent).

    Returns a dict with the response handle and timings (seconds, monotonic): ``t_start``,
    ``t_audio_end``, ``t_create``, ``t_first_audio``, ``t_done``.

    Raises:
        DuplexError: ``input_backpressure``: the server dropped part of the input (it consumes audio
            more slowly than it is sent); the turn is not committed, since the model did not hear
            all of it. Other client errors as :meth:`DuplexClient.commit` / ``create_response``.
    """
    import numpy as np

    from duplexkit.errors import DuplexError

    dropped: list = []

    async def watch() -> None:  # the server answers a refused append with an error event only
        async for ev in client.events():
            if getattr(ev, "type", None) == "error" and ev.error.code == ErrorCode.INPUT_BACKPRESSURE.value:
                dropped.append(DuplexError.from_event(ev.model_dump(mode="json")))
                return

    watcher = asyncio.create_task(watch())
    step = 16 * chunk_ms
    total_s = len(audio) / 16_000
    t0 = time.monotonic()
    next_report = PROGRESS_EVERY_S
    try:
        for i in range(0, len(audio), step):
            if dropped:
                break
            await client.send_audio(np.asarray(audio[i:i + step], np.float32), rate=16_000)
            sent_s = min(i + step, len(audio)) / 16_000
            if progress is not None and sent_s >= next_report and sent_s < total_s:
                progress(sent_s, total_s)
                next_report += PROGRESS_EVERY_S
            if pace > 0:
                target = t0 + sent_s / pace
            elif sent_s > BURST_S:
                target = t0 + sent_s - BURST_S
            else:
                continue
            await asyncio.sleep(max(0.0, target - time.monotonic()))
        t_audio_end = time.monotonic()
        if not dropped:  # a refusal of one of the last appends arrives within a round trip
            await asyncio.sleep(0.2)
        if dropped:
            err = dropped[0]
            raise DuplexError(ErrorCode.INPUT_BACKPRESSURE.value, f"the server dropped input after about "
                              f"{sent_s:.1f} s of {total_s:.1f} s: it consumes audio more slowly than it was sent ({err.message})",
                              event=err.event)
    finally:
        watcher.cancel()
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

    from duplexkit.audio.playback import OUTPUT_RATE

    from duplexkit.audio import read_wav, write_wav
    from duplexkit.clients import DuplexClient, InlineDuplexClient
    from duplexkit.errors import DuplexConnectionError, DuplexError

    audio, _ = read_wav(args.input, 16_000)
    if len(audio) < MIN_TURN_SAMPLES:
        raise CliError(f"input too short: need at least 100 ms of audio, {args.input} has "
                       f"{len(audio) * 1000 // 16_000} ms", EXIT_BAD_INPUT)
    if args.output:  # before the model loads and the turn runs, not after
        check_output_file(args.output, "--output")
    print(f"input:      {args.input} ({len(audio) / 16000:.2f} s)", flush=True)
    # the WAV is one user turn that this demo commits itself: with the server VAD on, a pause inside
    # the file would commit part of it first (and the demo's own commit would find < 100 ms left)
    session: dict = {"turn_detection": None}
    if args.instructions:
        session["instructions"] = args.instructions
    engine = None
    load_s = None
    if args.url:
        random_weights = _remote_notice(args.url)
        client = DuplexClient(args.url, api_key=args.api_key, session=session, request_timeout_s=args.timeout)
    else:
        t_load = time.monotonic()
        engine = await load_engine_async(args.model, layout=args.layout, seed=args.weights_seed)
        load_s = time.monotonic() - t_load
        random_weights = bool(getattr(engine, "random_weights", False))
        _random_weights_notice(engine)
        opts = _session_defaults(args, args.model)
        client = InlineDuplexClient(engine, session=session, request_timeout_s=args.timeout, **opts)
    try:
        async with client:
            try:
                r = await run_wav_turn(client, audio, pace=args.pace, response_timeout_s=args.timeout,
                                       progress=_print_progress if len(audio) > 2 * PROGRESS_EVERY_S * 16_000 else None)
            except DuplexConnectionError as exc:  # the server closed the session, or the connection went
                raise CliError(session_end_line(client, exc), EXIT_CONNECTION) from None
            except DuplexError as exc:
                if exc.code != ErrorCode.INPUT_BACKPRESSURE.value:
                    raise
                raise CliError(f"{exc.message}; send it more slowly (--pace 0.5), use a shorter input, or "
                               "start the server with a larger --max-pending-input-s", EXIT_FAILURE) from None
    finally:
        if engine is not None:
            await engine.aclose()
    # the server ended the session while the demo ran (e.g. it shut down during the answer): the
    # partial answer is still shown, then that line and status 3 instead of "what next"
    ended = session_end_line(client) if client.close_reason not in (None, "client_close") else None
    h = r["handle"]
    out = h.audio_array()
    if args.output:
        write_wav(args.output, out if out.size else np.zeros(0, np.float32), OUTPUT_RATE)
    print(f"response:   {h.id} status={h.status} trigger={h.trigger} epoch={h.epoch}")
    print(f"transcript: {h.transcript or h.text!r}")
    if args.output:
        print(f"audio:      {args.output} ({len(out) / OUTPUT_RATE:.2f} s at 24 kHz, chunks {h.chunk_sizes})")
    print("timings (wall clock on this machine):")
    print(_timing_table(_demo_timing_rows(r, h, load_s, len(out) / OUTPUT_RATE)))
    if random_weights:
        print("note: random weights -> the transcript is gibberish and the audio is noise (expected).")
    if ended is not None:
        raise CliError(ended, EXIT_CONNECTION)
    print(_what_next(args))
    return 0 if h.status in ("completed", "incomplete") else 1


def _print_progress(sent_s: float, total_s: float) -> None:
    print(f"sending:    {sent_s:.0f} / {total_s:.0f} s of input (real time after the first {BURST_S:g} s)", flush=True)


def cmd_demo(args) -> int:
    check_url_args(args, "demo")  # a MODEL or --layout would be ignored with --url
    return run_async(_demo_async(args))


def _what_next(args) -> str:
    """The three lines the demo ends with: serve the model, open the browser page, talk from a terminal.

    The ``duplexkit`` command is named as the user can type it: ``duplexkit`` when it is the one on
    ``PATH``, else the path of the one next to this interpreter (``.venv/bin/duplexkit`` after
    scripts/demo.sh), relative to the working directory when it is under it. With ``--url`` the server
    already runs, so its address is used; else ``duplexkit serve``'s default (127.0.0.1:8000).
    """
    from urllib.parse import urlsplit

    cmd = command_name()
    if args.url:
        u = urlsplit(args.url if "://" in args.url else "ws://" + args.url)
        host = u.netloc or "127.0.0.1:8000"
        http = "https" if u.scheme in ("wss", "https") else "http"
        ws = "wss" if http == "https" else "ws"
        serve = f"already running at {http}://{host}"
    else:
        host, http, ws = "127.0.0.1:8000", "http", "ws"
        model = args.model if " " not in str(args.model) else f"'{args.model}'"
        layout = f" --layout {args.layout}" if args.layout else ""
        serve = f"{cmd} serve {model}{layout}"
    return ("what next:\n"
            f"  serve it:              {serve}\n"
            f"  open the page:         {http}://{host}/  (talk through the browser's microphone)\n"
            f"  talk from a terminal:  {cmd} mic --url '{ws}://{host}/v1/realtime?duplex=1'")
