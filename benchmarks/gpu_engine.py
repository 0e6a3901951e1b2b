"""Engine speed at real model size on one GPU, with random bf16 weights (no checkpoint needed).

    # on one H200 (see benchmarks/README.md for the wheels to carry):
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_engine.py --size real --out $OUT/gpu_engine.json
    # A/B of the thinker's own CUDA stream (two processes; the header line says which):
    DUPLEXKIT_THINKER_STREAM=1 python3 benchmarks/gpu_engine.py --streams 1,8,32 --tokens 19 --kv-len 2048
    python3 benchmarks/gpu_engine.py --streams 1,8,32 --tokens 19 --kv-len 2048
    # A/B of the thinker's one-step decode lookahead (on by default on CUDA; the build line says which):
    DUPLEXKIT_THINKER_LOOKAHEAD=0 python3 benchmarks/gpu_engine.py --streams 1,8,32 --tokens 19 --kv-len 2048 --units 5
    DUPLEXKIT_THINKER_LOOKAHEAD=1 python3 benchmarks/gpu_engine.py --streams 1,8,32 --tokens 19 --kv-len 2048 --units 5
    # sessions at different unit indices (stream k first runs k % 8 listen-only units), as on a real server:
    python3 benchmarks/gpu_engine.py --streams 8,32 --tokens 5 --units 6 --stagger 8
    # debug run on a CPU:
    python benchmarks/gpu_engine.py --size tiny --device cpu --streams 1,2 --units 3
    # a 24 GiB card emulated on a bigger one (the memory plan's KV slots, positions and graph rows; the
    # process capped at 24 GiB less the CUDA context; refused with the plan's table if 4 streams do not fit):
    python3 benchmarks/gpu_engine.py --memory 24 --quantization int8 --streams 1,4 --tokens 19,5 --kv-len 2048 --units 6

Builds MiniCPM-o 4.5 at real size (docs/model.md §1.1; ``duplexkit.models.minicpmo45.random_init``)
directly on the device, and drives :class:`duplexkit.engine.DuplexEngine` — the same runtime and
stage code as every other engine user — with 1/4/8/16 concurrent duplex streams. Random weights
decide nothing meaningful, so every stream opens its turn with ``ForceSpeak`` and the thinker's
engine-wide policy option ``DuplexPolicy.min_unit_tokens = max_unit_tokens = N`` fixes the
decided tokens of every speaking unit (N = 19 is the full 20-step budget, docs/model.md §5.3; N = 5 a
short unit). Units are fed in real time (one 1-s unit per second per stream).

Printed per mode (``baseline`` = the reference-checked eager path: transformers DynamicCache,
per-stream loops; ``fast`` = static KV slots, batched decode, CUDA graphs, GPU sampling) and N:

* per-stage time per unit (medians over all units, ms): thinker prefill and decode, talker (26
  steps), code2wav chunk; their floors (weight bytes per step / HBM copy bandwidth measured in
  this run) and the ratio measured / floor at 1 stream;
* per level: TTFP (the first unit's submit -> its first audio chunk, median / max over streams),
  per-unit latency (submit -> last output, p50 / p90), per-unit compute (thinker + talker +
  code2wav stage time), thinker tokens/s (all streams), audio RTF, errors;
* GPU memory (weights, peak); with ``--memory`` the plan's table and, after the run, the peak and the
  memory outside PyTorch's allocator against the plan (:mod:`duplexkit.engine.memory_plan`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from duplexkit.engine import DuplexEngine  # noqa: E402
from duplexkit.engine.api import (  # noqa: E402
    OUTPUT_SAMPLE_RATE, AppendUnit, AudioChunk, EngineFailure, ForceSpeak, StreamConfig, UnitTimings,
)
from duplexkit.engine.layout import Layout  # noqa: E402


def input_units(n: int) -> list:
    """``n`` units of 16 kHz speech (the packaged question WAV, then silence)."""
    from duplexkit.audio import UnitFramer, read_wav

    wav = Path(__file__).resolve().parents[1] / "duplexkit" / "assets" / "question_16k.wav"
    audio, _ = read_wav(wav, rate=16000)
    audio = np.concatenate([audio, np.zeros(16000 * (n + 1), np.float32)])
    return [u.audio for u in UnitFramer().push(audio)][:n]


def copy_bandwidth(device) -> float:
    """HBM copy bandwidth in bytes/s (read + write counted), median of 10 copies of 2 GiB."""
    if device.type != "cuda":
        return float("nan")
    n = 1 << 30
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1000.0)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(ts)


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def floors(model, bw: float) -> dict:
    """Bandwidth floors in ms (docs/model.md §10 arithmetic, with this run's bandwidth)."""
    th = model.thinker
    llm = th.m.llm
    emb = llm.model.embed_tokens.weight
    # buffers too: quantized layers keep their int8 / fp8 weights and scales as buffers
    llm_b = _bytes(p for p in [*llm.parameters(), *llm.buffers()] if p is not emb)
    apm_b = _bytes(th.m.apm.parameters()) + _bytes(th.m.audio_projection_layer.parameters())
    tk = getattr(model.talker, "talker", model.talker)
    tk_b = _bytes([*tk.model.parameters(), *tk.model.buffers()]) + _bytes(tk.head_code.parameters())
    out = {"llm_GB": llm_b / 1e9, "talker_GB": tk_b / 1e9, "bw_TBs": bw / 1e12}
    ms = lambda b: b / bw * 1000.0  # noqa: E731
    out["prefill"] = ms(llm_b + apm_b)
    out["decode_step"] = ms(llm_b)
    out["talker_unit"] = 26 * ms(tk_b)
    if model.code2wav is not None:
        f = model.code2wav.flow
        c2w_b = 10 * _bytes(f.decoder.estimator.parameters()) + _bytes(f.encoder.parameters()) + \
            _bytes(model.code2wav.hift.parameters())
        out["c2w_chunk"] = ms(c2w_b)
    return out


def _pct(vals, q):
    if not vals:
        return float("nan")
    v = sorted(vals)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def lead_in_units(k: int, stagger: int) -> int:
    """``--stagger K``: stream ``k`` runs ``k % K`` listen-only units before its measured units
    (0 for every stream when K <= 1)."""
    return k % stagger if stagger > 1 else 0


async def run_level(engine, n_streams: int, n_units: int, pace: str, audio: bool, stagger: int = 0) -> dict:
    """One concurrency level. With ``stagger`` K > 1, stream ``k`` first runs :func:`lead_in_units`
    units (burst, ``force_listen``: no talker / vocoder work, not measured), so at the measured units
    the streams sit at different unit indices (Whisper cache lengths), as sessions of a real
    server do; the measured units then start together (realtime or burst)."""
    leads = [lead_in_units(k, stagger) for k in range(n_streams)]
    units = input_units(n_units + max(leads))
    streams = await asyncio.gather(*[engine.open_stream(f"g{n_streams}-{k}-{time.monotonic_ns()}",
                                                        StreamConfig(seed=k, output_audio=audio))
                                     for k in range(n_streams)])
    lead_of = {s.stream_id: n for s, n in zip(streams, leads)}
    led = {s.stream_id: asyncio.Event() for s in streams}
    timings, ttfp, audio_s, errors = [], [], [], []
    submit0: dict = {}

    async def consume(s):
        got, first, samples, skip = 0, None, 0, lead_of[s.stream_id]
        if skip == 0:
            led[s.stream_id].set()
        async for o in s.outputs():
            if skip > 0:  # a lead-in unit (listen): not measured
                if isinstance(o, UnitTimings):
                    skip -= 1
                    if skip == 0:
                        led[s.stream_id].set()
                elif isinstance(o, EngineFailure):
                    errors.append(o.message)
                    led[s.stream_id].set()
                    break
                continue
            if isinstance(o, AudioChunk):
                samples += len(o.audio)
                if first is None:
                    first = (time.perf_counter() - submit0[s.stream_id]) * 1000.0
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

    t0 = time.perf_counter()

    async def feed():
        nonlocal t0
        for s, n in zip(streams, leads):
            for i in range(n):
                s.submit(AppendUnit(s.stream_id, 0, unit_index=i, audio=units[i], force_listen=True))
        for ev in led.values():
            await ev.wait()
        t0 = time.perf_counter()
        for i in range(n_units):
            if pace == "realtime":
                await asyncio.sleep(max(0.0, t0 + i - time.perf_counter()))
            for s, n in zip(streams, leads):
                if i == 0:
                    s.submit(ForceSpeak(s.stream_id, 0))
                    submit0[s.stream_id] = time.perf_counter()
                s.submit(AppendUnit(s.stream_id, 0, unit_index=n + i, audio=units[n + i]))

    await asyncio.gather(feed(), *[consume(s) for s in streams])
    wall = time.perf_counter() - t0
    for s in streams:
        await s.aclose()
    g = lambda k: [t[k] for t in timings if k in t]  # noqa: E731
    row = {"streams": n_streams, "units": len(timings), "errors": len(errors), "error_msgs": errors[:3],
           "stagger": stagger}
    for name, key in (("total", "total_ms"), ("queue", "queue_ms"), ("prefill", "thinker_prefill_ms"),
                      ("decode", "thinker_decode_ms"), ("thinker", "thinker_ms"), ("talker", "talker_ms"),
                      ("c2w", "code2wav_ms"), ("q_thinker", "thinker_queue_ms"), ("q_talker", "talker_queue_ms"),
                      ("q_c2w", "code2wav_queue_ms")):
        v = g(key)
        row[name] = (_pct(v, 0.5), _pct(v, 0.9))
    comp = [t.get("thinker_ms", 0) + t.get("talker_ms", 0) + t.get("code2wav_ms", 0) for t in timings]
    row["compute"] = (_pct(comp, 0.5), _pct(comp, 0.9))
    row["steps"] = statistics.median(g("decode_steps") or [0])
    row["batch"] = max(g("thinker_batch") or [0])
    tps = [t["decode_steps"] * t.get("thinker_batch", 1) / t["thinker_decode_ms"] * 1000.0
           for t in timings if t.get("thinker_decode_ms", 0) > 0]
    row["tok_s"] = statistics.median(tps) if tps else float("nan")
    ok = [x for x in ttfp if x == x]
    row["ttfp"] = (statistics.median(ok) if ok else float("nan"), max(ok) if ok else float("nan"))
    row["rtf"] = statistics.median([wall / a if a > 0 else float("inf") for a in audio_s]) if audio_s else float("nan")
    return row


def print_level_table(rows: list, title: str) -> None:
    head = ["streams", "units", "TTFP p50/max", "unit p50/p90", "compute p50", "thinker", "prefill", "decode",
            "steps", "talker", "c2w", "queue p50 th/tk/c2w", "tok/s", "RTF", "err"]
    lines = []
    for r in rows:
        lines.append([str(r["streams"]), str(r["units"]), f"{r['ttfp'][0]:.0f}/{r['ttfp'][1]:.0f}",
                      f"{r['total'][0]:.0f}/{r['total'][1]:.0f}", f"{r['compute'][0]:.0f}",
                      f"{r['thinker'][0]:.1f}", f"{r['prefill'][0]:.1f}", f"{r['decode'][0]:.1f}", f"{r['steps']:.0f}",
                      f"{r['talker'][0]:.1f}", f"{r['c2w'][0]:.1f}",
                      f"{r['q_thinker'][0]:.0f}/{r['q_talker'][0]:.0f}/{r['q_c2w'][0]:.0f}", f"{r['tok_s']:.0f}",
                      f"{r['rtf']:.2f}", str(r["errors"])])
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    print(title)
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for c in lines:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))
    for r in rows:
        if r["error_msgs"]:
            print(f"  errors at {r['streams']} streams: {r['error_msgs']}")


def print_floor_table(fl: dict, row1: dict, n_tokens: int) -> None:
    """Each stage's measured median against its floor, at the first stream count of the run."""
    steps = row1["steps"] or n_tokens
    meas = {"thinker prefill": row1["prefill"][0], "thinker decode (per step)": row1["decode"][0] / max(1, steps),
            "talker unit (26 steps)": row1["talker"][0], "code2wav chunk": row1["c2w"][0]}
    flo = {"thinker prefill": fl["prefill"], "thinker decode (per step)": fl["decode_step"],
           "talker unit (26 steps)": fl["talker_unit"], "code2wav chunk": fl.get("c2w_chunk", float("nan"))}
    n = row1["streams"]
    label = f"  stage ({n} stream{'s' if n != 1 else ''}, N={n_tokens})"
    print(f"{label:<35}measured ms   floor ms   ratio")
    for k in meas:
        print(f"  {k:<32} {meas[k]:>11.2f} {flo[k]:>10.2f} {meas[k] / flo[k]:>7.1f}x")


def profile_stages(model, out_path, n_tok: int = 19) -> None:
    """torch.profiler over one speaking unit of each stage at 1 stream (model calls, not the engine):
    wall time, GPU kernel time and kernel count; full tables to ``out_path``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from duplexkit.models.minicpmo45.duplex import UnitInput
    from duplexkit.models.minicpmo45.talker import TalkerInput

    th, tk, c2w = model.thinker, model.talker, model.code2wav
    th.policy_defaults = {"min_unit_tokens": n_tok, "max_unit_tokens": n_tok}
    units = input_units(4)
    st = th.new_stream(seed=0)
    (r,) = th.step_units([UnitInput(st, units[0], force_speak=True)])
    turn = tk.new_turn()
    tk.generate_units([TalkerInput(turn=turn, token_ids=r.token_ids, hidden=r.hidden, turn_start=True)])
    vs = c2w.new_stream(None) if c2w is not None else None
    codes = np.random.default_rng(0).integers(0, 6561, 25)
    def c2w_push(stream, c):  # the engine's call: push_batch when the vocoder is batched
        if hasattr(c2w, "push_batch"):
            from types import SimpleNamespace

            return c2w.push_batch([SimpleNamespace(handle=stream, codes=c, last=False)])[0]
        return c2w.push(stream, c)

    if vs is not None:
        for _ in range(3):  # the cache grows for two chunks, then is trimmed: steady shapes after that
            c2w_push(vs, codes)
    jobs = [("thinker unit", lambda: th.step_units([UnitInput(st, units[1])])),
            ("talker unit", lambda: tk.generate_units([TalkerInput(turn=turn, token_ids=r.token_ids, hidden=r.hidden)]))]
    if vs is not None:
        jobs.append(("code2wav chunk", lambda: c2w_push(vs, codes)))

        def bench_cudnn():  # A/B: cuDNN autotuned conv plans (warmed on this shape first)
            with torch.backends.cudnn.flags(enabled=True, benchmark=True):
                return c2w_push(vs, codes)

        def no_cudnn():  # A/B: PyTorch's own convolutions
            with torch.backends.cudnn.flags(enabled=False):
                return c2w_push(vs, codes)

        jobs.append(("c2w cudnn.bench", bench_cudnn))
    text = []
    for name, fn in jobs:
        if name.startswith("c2w "):
            fn()
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) * 1000.0
        ka = prof.key_averages()
        dev_t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
        kern = [e for e in ka if getattr(e, "device_type", None) == DeviceType.CUDA]
        n_k = sum(e.count for e in kern)
        busy = sum(dev_t(e) for e in kern) / 1000.0
        print(f"  profile {name:<15} wall {wall:7.1f} ms  GPU kernels {n_k:6d}  kernel time {busy:7.1f} ms "
              f"({100 * busy / wall:4.0f} % busy)", flush=True)
        top = sorted(kern, key=dev_t, reverse=True)[:5]
        for e in top:
            print(f"      {dev_t(e) / 1000.0:7.2f} ms x{e.count:5d}  {e.key[:90]}")
        text.append(f"==== {name}: wall {wall:.1f} ms, {n_k} kernels, {busy:.1f} ms kernel time\n")
        text.append(ka.table(sort_by="self_cpu_time_total", row_limit=25))
        text.append(ka.table(sort_by="self_cuda_time_total", row_limit=25))
    th.close(st)
    turn.reset()
    if vs is not None:
        c2w.close(vs)
    if out_path:
        Path(out_path).write_text("\n".join(text))


class StackSampler:
    """Where the engine's stage threads spend wall time: every ``interval_s`` the innermost frame of
    each ``duplexkit-*`` thread (``sys._current_frames``) is counted, with the innermost frame inside
    duplexkit. A thread blocked in C code shows its Python call site; one waiting for the GIL shows
    where it last ran Python. Diagnostics only (``--sample-stacks``)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        import threading
        from collections import Counter

        self.interval_s = interval_s
        self.counts: dict = {}
        self._Counter = Counter
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def _run(self) -> None:
        import threading

        names = {}
        while not self._stop.wait(self.interval_s):
            for t in threading.enumerate():
                names[t.ident] = t.name
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "")
                if not name.startswith("duplexkit-"):
                    continue
                inner = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
                f, own = frame, None
                while f is not None:
                    if "duplexkit" in f.f_code.co_filename:
                        own = f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"
                        break
                    f = f.f_back
                self.counts.setdefault(name, self._Counter())[f"{inner}  <-  {own}"] += 1

    def __enter__(self) -> "StackSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, top: int = 12) -> str:
        lines = []
        for name in sorted(self.counts):
            c = self.counts[name]
            n = sum(c.values())
            lines.append(f"  {name}: {n} samples")
            for where, k in c.most_common(top):
                lines.append(f"    {100.0 * k / n:5.1f}%  {where}")
        return "\n".join(lines)


def memory_line(model, dev) -> str:
    """One line of where GPU memory sits (GiB): allocated / reserved / peak since the last reset, the
    static KV pools, Code2Wav's shared Euler-loop scratch and its captured graphs."""
    if dev.type != "cuda":
        return "memory: (CPU run)"
    g = 2 ** 30
    parts = [f"allocated {torch.cuda.memory_allocated(dev) / g:.1f}", f"reserved {torch.cuda.memory_reserved(dev) / g:.1f}",
             f"peak {torch.cuda.max_memory_allocated(dev) / g:.1f}",
             f"KV thinker {model.thinker.pool.nbytes() / g:.1f} + talker {model.talker.pool.nbytes() / g:.1f}"
             + whisper_kv_text(model, g)]
    c2w = getattr(model, "code2wav", None)
    if c2w is not None and hasattr(c2w, "scratch_bytes"):
        parts.append(f"code2wav scratch {c2w.scratch_bytes() / g:.2f} ({len(c2w._dit_graphs)} Euler-loop graphs, "
                     f"{len(c2w._enc_graphs)} encoder graphs)")
    return "memory (GiB): " + ", ".join(parts)


def whisper_kv_text(model, g: float = 2 ** 30) -> str:
    """`` + Whisper K/V X (N slots)``: the fast thinker's Whisper streaming-cache pool in units of
    ``g`` bytes (empty for a thinker without one)."""
    pool = getattr(model.thinker, "whisper_pool", None)
    if pool is None:
        return ""
    return f" + Whisper {pool.nbytes() / g:.2f} ({pool.n_slots} slots)"


def snapshot_summary(snap: dict, top: int = 15) -> str:
    """Live CUDA blocks of a ``torch.cuda.memory._snapshot()`` grouped by where they were allocated:
    the project's own frames of each block's stack (``duplexkit/`` and ``benchmarks/``; "torch" when
    none), largest groups first, with the graph pools' share. Needs the allocation history recorded
    (``torch.cuda.memory._record_memory_history``) before the blocks were allocated."""
    groups: dict = {}
    pooled = total = 0
    for seg in snap.get("segments", []):
        in_pool = tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0)
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            size = int(blk.get("size", 0))
            total += size
            pooled += size if in_pool else 0
            own = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in blk.get("frames", [])
                   if "duplexkit" in f.get("filename", "") or "benchmarks" in f.get("filename", "")]
            key = " <- ".join(own[:4]) or "torch"
            n, b = groups.get(key, (0, 0))
            groups[key] = (n + 1, b + size)
    g = 2 ** 30
    lines = [f"  live blocks {total / g:.2f} GiB, of which in CUDA graph pools {pooled / g:.2f} GiB"]
    for key, (n, b) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {b / g:8.2f} GiB {n:6d} blocks  {key}")
    return "\n".join(lines)


def garbage_report(dev) -> str:
    """Run ``gc.collect()`` and say what it freed: objects in reference cycles (by type, largest
    counts first) and the CUDA memory that was held only by them."""
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        n = gc.collect()
        kinds: dict = {}
        for o in gc.garbage:
            kinds[type(o).__name__] = kinds.get(type(o).__name__, 0) + 1
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    gc.collect()
    freed = (before - torch.cuda.memory_allocated(dev)) / 2**30 if dev.type == "cuda" else 0.0
    top = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:8])
    return f"gc.collect(): {n} objects in reference cycles ({top or 'none'}); CUDA memory freed {freed:.2f} GiB"


def dump_memory(directory: Optional[str], name: str) -> None:
    """``--memory-snapshot``: write ``torch.cuda.memory._snapshot()`` as DIR/NAME.pickle (for
    https://pytorch.org/memory_viz) and print :func:`snapshot_summary`."""
    if not directory or not torch.cuda.is_available():
        return
    import pickle

    gc.collect()
    snap = torch.cuda.memory._snapshot()
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / f"{name}.pickle", "wb") as f:
        pickle.dump(snap, f)
    print(f"memory snapshot {name} (after gc.collect()):\n{snapshot_summary(snap)}", flush=True)


def make_layout(device: str, max_seqs: int, thinker_window_ms: Optional[float] = None,
                fractions: bool = True) -> Layout:
    """The benchmark's layout: every stage on ``device`` with ``max_seqs`` streams per step; the
    thinker's ``batch_window_ms`` is the layout default unless ``thinker_window_ms`` is given. Without
    ``fractions`` (a memory plan caps the process instead) the stages name no ``memory_fraction``."""
    st = lambda dt, frac: {"device": device, "dtype": dt, "max_num_seqs": max_seqs,  # noqa: E731
                           **({"memory_fraction": frac} if device != "cpu" and fractions else {})}
    thinker = st("bfloat16", 0.6)
    if thinker_window_ms is not None:
        thinker["batch_window_ms"] = thinker_window_ms
    return Layout.from_dict({"name": "gpu-bench", "description": "benchmarks/gpu_engine.py",
                             "stages": {"thinker": thinker, "talker": st("bfloat16", 0.15),
                                        "code2wav": st("float32", 0.2)}})


async def bench_mode(model, mode: str, args, levels: list, fl: dict, results: dict) -> None:
    dev = torch.device(args.device)
    layout = make_layout(str(args.device), max(levels), args.thinker_window_ms, fractions=args.memory is None)
    print(f"engine layout: thinker batching window {layout.stages['thinker'].batch_window_ms:g} ms", flush=True)
    engine = DuplexEngine(model, layout)
    try:
        # every batch bucket the runtime can form (no capture mid-run), each stage's on its own
        # worker thread (cuDNN keeps autotuned plans per thread), as DuplexEngine.from_pretrained does
        t = time.perf_counter()
        if args.warmup_on == "caller":  # the previous way, for A/B: plans tuned on this thread only
            m = model
            every = list(range(1, max(levels) + 1))
            nt = 0
            for stage, obj in (("thinker", m.thinker), ("talker", m.talker)):
                if hasattr(obj, "warmup"):
                    with engine.stages.stage_scope(stage):  # the thinker's own stream when it has one
                        nt += int(obj.warmup(every, 512))
            if m.code2wav is not None and hasattr(m.code2wav, "warmup_sizes"):
                nt += m.code2wav.warmup(batch_sizes=m.code2wav.warmup_sizes(max(levels)))
        else:
            nt = engine.warmup(512)
        ts = engine.stages.thinker_stream
        print(f"[{mode}] thinker stream: " + ("default (shared with talker and code2wav)" if ts is None else
                                               f"own, priority {ts.priority}"), flush=True)
        print(f"[{mode}] warm-up on the {args.warmup_on} thread(s): captured {nt} CUDA graphs in {time.perf_counter() - t:.1f} s; "
              f"{memory_line(model, dev)}", flush=True)
        print(f"[{mode}] {garbage_report(dev)}", flush=True)
        dump_memory(args.memory_snapshot, f"{mode}_after_warmup")
        for n_tok in args.tokens:
            model.thinker.policy_defaults = {"min_unit_tokens": n_tok, "max_unit_tokens": n_tok}
            t = time.perf_counter()
            await run_level(engine, 1, 2, "burst", not args.no_audio)  # warm-up (kernels, voice cache)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            print(f"[{mode} N={n_tok}] warm-up {time.perf_counter() - t:.1f} s", flush=True)
            rows = []
            for n in levels:
                t = time.perf_counter()
                sampler = StackSampler() if args.sample_stacks else None
                if sampler:
                    sampler.__enter__()
                rows.append(await run_level(engine, n, args.units if mode != "baseline" else args.baseline_units,
                                            args.pace, not args.no_audio, args.stagger))
                if sampler:
                    sampler.__exit__(None, None, None)
                    print(f"[{mode} N={n_tok}] {n} streams: stage-thread stacks\n{sampler.report()}", flush=True)
                print(f"[{mode} N={n_tok}] {n} streams done in {time.perf_counter() - t:.1f} s; {memory_line(model, dev)}",
                      flush=True)
                dump_memory(args.memory_snapshot, f"{mode}_N{n_tok}_{n}streams")
            mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
            print_level_table(rows, f"\n== {mode}: N={n_tok} decided tokens per speaking unit, size={args.size}, "
                                    f"pace={args.pace}, stagger={args.stagger}, peak GPU memory {mem:.1f} GiB "
                                    "(times in ms)")
            print_floor_table(fl, rows[0], n_tok)
            results[f"{mode}/N={n_tok}"] = {"rows": rows, "peak_GiB": mem}
    finally:
        await engine.aclose()


def memory_plan_for(a, dev, streams: int):
    """``--memory``: the plan for ``streams`` streams (printed), with the process capped at it on CUDA;
    None (the refusal printed) when they do not fit."""
    from duplexkit.engine.memory_plan import MemoryBudgetError, apply_memory_cap, model_sizes_for, plan_memory

    sizes = model_sizes_for("real" if a.size == "real" else "tiny")
    cuda = dev.type == "cuda"
    try:
        plan = plan_memory(sizes, a.memory, dtype="bfloat16" if cuda else "float32", quantization=a.quantization,
                           streams=streams, thinker_positions=a.kv_len,
                           att_cache_bytes=2 if cuda and a.code2wav_dtype == "float32" or a.code2wav_dtype == "float16" else 4)
        frac = apply_memory_cap(plan, dev)
    except MemoryBudgetError as exc:
        print(f"error: {exc}", flush=True)
        return None
    print(plan.table(), flush=True)
    if frac is not None:
        print(f"allocator capped at {plan.allocator_gib:.2f} GiB ({frac:.4f} of the device)", flush=True)
    return plan


def plan_build_kwargs(plan) -> dict:
    """``build_random_model`` keyword arguments of a memory plan: the fast paths' sizes, the stream
    slots and the thinker's KV positions."""
    from duplexkit.engine.memory_plan import fast_options

    return {"fast_options": fast_options(plan), "kv_slots": plan.streams, "thinker_max_len": plan.thinker_positions}


def print_plan_check(plan, dev) -> dict:
    """After the run: the measured peak (allocated), reserved and memory outside PyTorch's allocator
    (``mem_get_info`` used - reserved: the CUDA context, kernels, cuBLAS/cuDNN handles) against the
    plan (GiB). Returns them."""
    if dev.type != "cuda":
        return {}
    g = 2 ** 30
    free, total = torch.cuda.mem_get_info(dev)
    reserved = torch.cuda.memory_reserved(dev)
    out = {"peak_allocated": torch.cuda.max_memory_allocated(dev) / g, "peak_reserved": torch.cuda.max_memory_reserved(dev) / g,
           "outside_allocator": (total - free - reserved) / g, "planned_total": plan.total_gib,
           "budget": plan.budget_gib}
    print(f"memory plan check (GiB): planned {plan.total_gib:.2f} of budget {plan.budget_gib:g}; measured peak allocated "
          f"{out['peak_allocated']:.2f}, peak reserved {out['peak_reserved']:.2f}, outside the allocator "
          f"{out['outside_allocator']:.2f} (planned {plan.budget_gib - plan.allocator_gib:.2f}); peak reserved + outside "
          f"{out['peak_reserved'] + out['outside_allocator']:.2f}", flush=True)
    return out


def _modes(s: str) -> list:
    out = [m.strip() for m in s.split(",") if m.strip()]
    bad = [m for m in out if m not in ("fast", "baseline")]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of fast, baseline; got {s!r}")
    return out


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _cli import (int_at_least, int_list, no_nan, non_negative_float, non_negative_int, positive_float, positive_int,
                      torch_device)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=("real", "tiny"), default="real")
    ap.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda[:N] (default: cuda when available)")
    ap.add_argument("--streams", type=int_list, default="1,4,8,16", help="comma list of stream counts (default 1,4,8,16)")
    ap.add_argument("--code2wav-dtype", choices=("float32", "float16"), default="float32",
                    help="the Code2Wav flow's dtype (float16: the reference's Token2wav(float16=True))")
    ap.add_argument("--quantization", choices=("none", "int8", "fp8"), default="none",
                    help="quantized weights for the thinker's and talker's decoder linears (docs/model.md "
                         "'Quantized weights'; fp8 needs compute capability >= 8.9); --memory plans with it")
    ap.add_argument("--units", type=positive_int, default=6, help="units per stream (fast mode)")
    ap.add_argument("--tokens", type=int_list, default="19,5", help="decided tokens per speaking unit (comma list)")
    ap.add_argument("--modes", type=_modes, default="fast",
                    help="comma list of fast, baseline")
    ap.add_argument("--baseline-streams", type=int_list, default="1,4")
    ap.add_argument("--baseline-units", type=positive_int, default=3)
    ap.add_argument("--pace", choices=("realtime", "burst"), default="realtime")
    ap.add_argument("--stagger", type=non_negative_int, default=0, metavar="K",
                    help="stream k first runs k %% K listen-only lead-in units (not measured), so the streams "
                         "sit at different unit indices, as sessions of a real server do (0/1: all start together)")
    ap.add_argument("--no-audio", action="store_true", help="text-only streams (no talker / code2wav)")
    ap.add_argument("--kv-len", type=int_at_least(256, " (a unit's prefill and decode need room)"), default=4096, help="thinker KV positions per stream (fast; >= 256)")
    ap.add_argument("--thinker-window-ms", type=non_negative_float, default=None, metavar="MS",
                    help="the thinker stage's batching window (layout batch_window_ms; default: the layout "
                         "default, 8 ms; 0 = pick at once, no window)")
    ap.add_argument("--profile", action="store_true", help="profile one unit of each stage (CUDA only)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--sample-stacks", action="store_true",
                    help="print where each stage thread spent its wall time per level (stack sampling)")
    ap.add_argument("--memory-snapshot", default=None, metavar="DIR",
                    help="record CUDA allocations with their Python stacks; after the start-up captures and after "
                         "each level write DIR/<when>.pickle and print the live memory by allocation site")
    ap.add_argument("--c2w-hift", choices=("batched", "per-stream"), default="batched",
                    help="Code2Wav HiFT: one call for all streams of a round (per-row noise) or one per stream")
    ap.add_argument("--thinker-stream", choices=("env", "on", "off"), default="env",
                    help="run the thinker on its own high-priority CUDA stream (sets DUPLEXKIT_THINKER_STREAM "
                         "for this process; env: keep the variable as it is, unset = off)")
    ap.add_argument("--warmup-on", choices=("stage", "caller"), default="stage",
                    help="run the start-up warm-ups on the engine's stage threads (as DuplexEngine does) or on "
                         "the calling thread (the previous way; cuDNN's tuned plans are per thread)")
    ap.add_argument("--memory", type=positive_float, default=None, metavar="GIB",
                    help="device memory budget in GiB: the memory plan (duplexkit.engine.memory_plan) for the "
                         "largest --streams level sizes the KV slots, thinker positions (from --kv-len) and "
                         "Code2Wav graph rows, and the process is capped at the budget less the CUDA context "
                         "(emulates a card of that size); exit status 2 with the plan's table when it does not fit")
    a = ap.parse_args(argv)
    from duplexkit.engine.thinker_stream import ENV_VAR, thinker_stream_requested

    if a.thinker_stream != "env":
        os.environ[ENV_VAR] = "1" if a.thinker_stream == "on" else "0"
    th_stream = thinker_stream_requested()
    dev = a.device
    from duplexkit.models.minicpmo45.fast_kv import pin_sdpa_backend, triton_decode_enabled
    from duplexkit.models.minicpmo45.random_init import build_random_model
    from duplexkit.models.minicpmo45.thinker import Thinker

    pin_sdpa_backend()
    levels = a.streams
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, "
          f"thinker stream {'on' if th_stream else 'off'} ({ENV_VAR}={os.environ.get(ENV_VAR, '')!r}"
          f"{'' if dev.type == 'cuda' or not th_stream else ', ignored on the CPU'}), "
          f"Triton decode kernels {'on' if triton_decode_enabled() and dev.type == 'cuda' else 'off'}", flush=True)
    if a.memory_snapshot and dev.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    bw = copy_bandwidth(dev)
    t = time.perf_counter()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    plan, build_kw = None, {}
    if a.memory is not None:
        plan = memory_plan_for(a, dev, max(levels))
        if plan is None:
            return 2
        build_kw = plan_build_kwargs(plan)
    build_kw = {"thinker_max_len": a.kv_len, "kv_slots": max(levels), **build_kw}
    model = build_random_model(a.size, dtype=dtype, device=dev, fast=True, with_code2wav=not a.no_audio,
                               code2wav_dtype=getattr(torch, a.code2wav_dtype), quantization=a.quantization,
                               **build_kw)
    for stage, qrep in model.quantization.items():
        print(f"quantization: {qrep.line(stage)}", flush=True)
    if plan is not None:
        from duplexkit.engine.memory_plan import apply_plan_to_model

        apply_plan_to_model(model, plan)
    c2w = model.code2wav
    if c2w is not None:
        att = getattr(c2w, "att_cache_dtype", None)
        print(f"code2wav: flow {a.code2wav_dtype}, TF32 matmuls {'on' if getattr(c2w, 'matmul_tf32', False) else 'off'}, "
              f"DiT attention caches {str(att).replace('torch.', '') if att is not None else 'n/a'}", flush=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    print(f"built {a.size} model in {time.perf_counter() - t:.1f} s; GPU memory after build {weights:.1f} GiB "
          f"(incl. static KV {model.thinker.pool.nbytes() / 2**30:.1f} + {model.talker.pool.nbytes() / 2**30:.1f}"
          f"{whisper_kv_text(model)} GiB); "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; thinker decode lookahead "
          f"{'on' if getattr(model.thinker, 'lookahead', False) else 'off'}", flush=True)
    fl = floors(model, bw if bw == bw else 1e11)
    print("floors (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in fl.items()), flush=True)
    results = {"size": a.size, "device": str(dev), "bw": bw, "floors": fl, "weights_GiB": weights,
               "quantization": {k: dataclasses.asdict(v) for k, v in model.quantization.items()},
               "thinker_stream": th_stream and dev.type == "cuda",
               "thinker_lookahead": bool(getattr(model.thinker, "lookahead", False))}
    fast_th, fast_tk = model.thinker, model.talker
    if model.code2wav is not None and hasattr(model.code2wav, "hift_batched"):
        model.code2wav.hift_batched = a.c2w_hift == "batched"

    if a.profile and dev.type == "cuda":
        try:
            profile_stages(model, str(Path(a.out).with_name("profile.txt")) if a.out else None)
        except Exception as exc:  # noqa: BLE001 - the profile is diagnostics; the benchmark goes on
            print(f"  profile failed: {type(exc).__name__}: {exc}", flush=True)

    async def go():
        for mode in a.modes:
            if mode == "fast":
                view = model
                lv = levels
            elif mode == "baseline":
                ref = Thinker(fast_th.m, fast_th.config, fast_th.tokenizer, fast_th.special, device=fast_th.device,
                              dtype=fast_th.dtype)
                view = dataclasses.replace(model, thinker=ref, talker=fast_tk.talker)
                lv = a.baseline_streams
            await bench_mode(view, mode, a, lv, fl, results)

    asyncio.run(go())
    if hasattr(model.thinker, "stats"):  # decode steps, lookahead launches kept / discarded
        print(f"thinker: {model.thinker.stats}", flush=True)
        results["thinker_stats"] = dict(model.thinker.stats)
    if model.code2wav is not None and hasattr(model.code2wav, "stats"):
        st = model.code2wav.stats
        print(f"code2wav calls: {st}", flush=True)
        results["code2wav_stats"] = dict(st)
    if plan is not None:
        results["memory_plan"] = plan.as_dict()
        results["memory_measured"] = print_plan_check(plan, dev)
    if a.out:
        Path(a.out).write_text(json.dumps(no_nan(results), indent=1, default=str, allow_nan=False))
    errors = sum(r["errors"] for res in results.values() if isinstance(res, dict) and "rows" in res
                 for r in res["rows"])
    if errors:
        print(f"{errors} unit(s) failed (see the err column): exit status 1", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
