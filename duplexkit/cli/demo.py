"""``duplexkit demo``: one spoken turn from a WAV file, with a timing table."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Optional

from .common import (
    CliError,
    EXIT_BAD_INPUT,
    MIN_TURN_SAMPLES,
    _random_weights_notice,
    _remote_notice,
    _session_defaults,
    load_engine,
)


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
    if args.output:  # before the model loads and the turn runs, not after
        out_dir = Path(args.output).resolve().parent
        if not out_dir.is_dir() or not os.access(out_dir, os.W_OK):
            raise CliError(f"cannot write --output {args.output}: {out_dir} is not a writable directory",
                           EXIT_BAD_INPUT)
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
