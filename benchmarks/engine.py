"""Engine benchmark: per-unit latency and stage breakdown for 1/2/4 concurrent duplex streams.

    TORCHDYNAMO_DISABLE=1 python benchmarks/engine.py --model tiny --layout cpu --streams 1,2,4 --units 4
    python benchmarks/engine.py --model /ckpt/MiniCPM-o-4_5 --layout 1gpu --streams 1,2,4,8 --units 10

Every stream is forced to speak (ForceSpeak) and fed real speech (the packaged question WAV, then
silence), one 1-s unit per second of wall time (``--pace realtime``, what a live client does) or all
at once (``--pace burst``, throughput). Per concurrency level it prints medians and p90s over all
units of all streams of the engine's own per-unit timings (``UnitTimings``, milliseconds):

* ``total``: unit submitted -> its last output delivered; ``queue``: time waiting in stage queues;
* ``prefill`` / ``decode`` (+ steps): thinker; ``talker`` (+ steps); ``c2w``: vocoder;
* ``TTFP``: first unit submitted -> first audio chunk (ms), median over streams;
* ``RTF``: wall time of the run / seconds of audio each stream received (median over streams;
  < 1 keeps up with real time).

Other scripts (e.g. a GPU benchmark that builds real-size random weights in memory) can call
:func:`run_level` / :func:`main_async` with an engine built from ``DuplexEngine(model, layout)``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # docs/model.md §7.5 (CPU); harmless on the GPU

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from duplexkit.engine import DuplexEngine  # noqa: E402
from duplexkit.engine.api import (  # noqa: E402
    OUTPUT_SAMPLE_RATE, AppendUnit, AudioChunk, EngineFailure, ForceSpeak, StreamConfig, UnitTimings,
)

KEYS = [("total", "total_ms"), ("queue", "queue_ms"), ("prefill", "thinker_prefill_ms"),
        ("decode", "thinker_decode_ms"), ("talker", "talker_ms"), ("c2w", "code2wav_ms")]


def input_units(n: int) -> list:
    """``n`` units of 16 kHz speech (the packaged question WAV, then silence)."""
    from duplexkit.audio import UnitFramer, read_wav

    wav = Path(__file__).resolve().parents[1] / "duplexkit" / "assets" / "question_16k.wav"
    audio, _ = read_wav(wav, rate=16000)
    audio = np.concatenate([audio, np.zeros(16000 * (n + 1), np.float32)])
    units = [u.audio for u in UnitFramer().push(audio)]
    return units[:n]


async def run_level(engine, n_streams: int, n_units: int, pace: str = "realtime") -> dict:
    """Run ``n_streams`` concurrent speaking streams for ``n_units`` units; return a result row."""
    units = input_units(n_units)
    streams = await asyncio.gather(*[engine.open_stream(f"bench{n_streams}-{k}", StreamConfig(seed=k))
                                     for k in range(n_streams)])
    timings: list = []
    ttfp: list = []
    audio_s: list = []
    errors: list = []
    t0 = time.perf_counter()

    async def consume(s, k):
        got, first, samples = 0, None, 0
        async for o in s.outputs():
            if isinstance(o, AudioChunk):
                samples += len(o.audio)
                if first is None:
                    first = (time.perf_counter() - t0) * 1000.0
            elif isinstance(o, UnitTimings):
                timings.append(o.timings)
                got += 1
                if got >= n_units:
                    break
            elif isinstance(o, EngineFailure):
                errors.append(o.message)
                break
        ttfp.append(first if first is not None else float("nan"))
        audio_s.append(samples / OUTPUT_SAMPLE_RATE)

    async def feed():
        for k, s in enumerate(streams):
            s.submit(ForceSpeak(s.stream_id, 0))
        for i, u in enumerate(units):
            if pace == "realtime":
                await asyncio.sleep(max(0.0, t0 + i - time.perf_counter()))
            for s in streams:
                s.submit(AppendUnit(s.stream_id, 0, unit_index=i, audio=u))

    await asyncio.gather(feed(), *[consume(s, k) for k, s in enumerate(streams)])
    wall = time.perf_counter() - t0
    for s in streams:
        await s.aclose()
    row = {"streams": n_streams, "units": len(timings), "errors": len(errors)}
    for name, key in KEYS:
        vals = [t[key] for t in timings if key in t]
        row[name] = _pct(vals)
    row["steps"] = statistics.median([t.get("decode_steps", 0) for t in timings]) if timings else 0
    row["tsteps"] = statistics.median([t.get("talker_steps", 0) for t in timings if "talker_steps" in t] or [0])
    row["batch"] = max([t.get("thinker_batch", 1) for t in timings] or [0])
    row["ttfp"] = statistics.median(ttfp) if ttfp else float("nan")
    row["rtf"] = statistics.median([wall / a if a > 0 else float("inf") for a in audio_s]) if audio_s else float("nan")
    return row


def _pct(vals: list) -> tuple:
    if not vals:
        return (float("nan"), float("nan"))
    v = sorted(vals)
    return (statistics.median(v), v[min(len(v) - 1, int(round(0.9 * (len(v) - 1))))])


def print_table(rows: list, title: str) -> None:
    head = ["streams", "units"] + [f"{n} p50/p90" for n, _ in KEYS] + ["dec.steps", "tlk.steps", "max batch",
                                                                      "TTFP ms", "RTF", "errors"]
    lines = []
    for r in rows:
        cells = [str(r["streams"]), str(r["units"])]
        cells += [f"{r[n][0]:.0f}/{r[n][1]:.0f}" for n, _ in KEYS]
        cells += [f"{r['steps']:.0f}", f"{r['tsteps']:.0f}", str(r["batch"]), f"{r['ttfp']:.0f}", f"{r['rtf']:.2f}",
                  str(r["errors"])]
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    print(title)
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for c in lines:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))


async def main_async(engine, streams: list, units: int, pace: str, title: str) -> list:
    await run_level(engine, 1, 1, pace="burst")  # warm-up: voice cache, allocator, kernels
    rows = []
    for n in streams:
        rows.append(await run_level(engine, n, units, pace))
    print_table(rows, title)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (random weights) or a checkpoint directory")
    ap.add_argument("--layout", default="cpu", help="layout name (cpu, 1gpu, 2gpu, 3gpu) or YAML path")
    ap.add_argument("--streams", default="1,2,4", help="comma-separated concurrency levels")
    ap.add_argument("--units", type=int, default=4, help="units (seconds of input) per stream")
    ap.add_argument("--pace", choices=("realtime", "burst"), default="realtime")
    ap.add_argument("--dtype", default=None, help="override the thinker dtype (float32, bfloat16, float16)")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.streams.split(",") if x.strip()]
    t = time.perf_counter()
    engine = DuplexEngine.from_pretrained(a.model, layout=a.layout, dtype=a.dtype, progress=False)
    load_s = time.perf_counter() - t

    async def go():
        try:
            await main_async(engine, levels, a.units, a.pace,
                             f"duplexkit engine: model={a.model} random_weights={engine.random_weights} "
                             f"layout={engine.layout.name} pace={a.pace} units={a.units} (load {load_s:.1f} s; ms)")
        finally:
            await engine.aclose()

    asyncio.run(go())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
