"""Code2Wav per stream vs batched, side by side in one run.

For each stream count N, N streams (default voice, different seeds and random codes) push one
25-code block per round, in steady state (two warm-up rounds: the flow caches are trimmed after the
second). Three ways, alternated round by round on the same object so machine load hits them alike:

* ``per-stream``: ``Code2Wav.push`` for each stream (the package's HiFT, one flow call per stream);
* ``flow-batched``: ``push_batch`` with HiFT per stream (``hift_batched = False``: the previous path);
* ``batched``: ``push_batch`` with one HiFT call for all rows (per-row noise).

Prints ms per round (median over ``--rounds``) and the ratios. CPU by default with the tiny flow
(``--size tiny``); ``--device cuda --size real`` measures the real-size flow and HiFT with random weights.

    python benchmarks/code2wav_batch.py --streams 1,4,8 --rounds 5

``--save-audio FILE`` keeps the batched way's audio of every round (``.npz``); ``--compare-to FILE``
prints, per level, how far this run's batched audio is from a saved run's (max |diff| and SNR in dB).
The model, codes and seeds are the same in every run, so two processes that differ in one setting
(e.g. ``DUPLEXKIT_CODE2WAV_TF32=0``, full fp32 matmuls instead of the CUDA default TF32, which must be
set before the CUDA graphs are captured, or ``--dtype float16``: the same random flow cast to half
precision) measure that setting's numerical effect:

    DUPLEXKIT_CODE2WAV_TF32=0 python benchmarks/code2wav_batch.py --device cuda --size real --save-audio /tmp/fp32.npz
    python benchmarks/code2wav_batch.py --device cuda --size real --compare-to /tmp/fp32.npz
    python benchmarks/code2wav_batch.py --device cuda --size real --dtype float16 --compare-to /tmp/fp32.npz
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                    help="the flow's dtype (float16: the reference's Token2wav(float16=True); HiFT stays float32)")
    ap.add_argument("--ways", default="per-stream,flow-batched,batched",
                    help="comma list of per-stream, flow-batched, batched (the per-stream way is slow at 32)")
    ap.add_argument("--graph-rows", type=int, default=None, choices=(1, 2, 4, 8, 16, 32),
                    help="rows of the Euler-loop CUDA graphs (sub-batch size; default 16 or DUPLEXKIT_CODE2WAV_GRAPH_ROWS)")
    ap.add_argument("--phases", action="store_true",
                    help="also print the batched way's ms per round in the encoder, the Euler loop and "
                         "HiFT + cross-fade (synchronised around each call: adds a few syncs; a single stream "
                         "on the CPU takes the per-stream flow, which is not split: 0 there)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed rounds of each level, profile one more batched round (torch.profiler, "
                         "CUDA only): wall, GPU kernel count and time, and the largest kernels")
    ap.add_argument("--save-audio", default=None, metavar="FILE", help="write the batched way's audio (.npz)")
    ap.add_argument("--compare-to", default=None, metavar="FILE",
                    help="compare the batched way's audio with a file written by --save-audio")
    a = ap.parse_args()
    wanted = [w.strip() for w in a.ways.split(",") if w.strip()]
    if set(wanted) - {"per-stream", "flow-batched", "batched"} or "batched" not in wanted:
        ap.error(f"--ways: choose from per-stream, flow-batched, batched (batched always), got {a.ways!r}")

    import torch

    from duplexkit.models.minicpmo45.random_init import _random_code2wav

    dev = torch.device(a.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    c2w = _random_code2wav(Path(tempfile.mkdtemp()), dev, gen, real=a.size == "real", batched=True,
                           dtype=getattr(torch, a.dtype))
    if a.graph_rows is not None:
        from duplexkit.models.minicpmo45.fast_code2wav import _graph_rows

        c2w.graph_rows = _graph_rows(a.graph_rows)
        if c2w.euler_sub_batch is not None:
            c2w.euler_sub_batch = c2w.graph_rows
    levels = [int(x) for x in a.streams.split(",") if x.strip()]
    if hasattr(c2w, "warmup") and dev.type == "cuda":
        c2w.warmup(batch_sizes=tuple(levels))
    rng = np.random.default_rng(0)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def per_stream(sts, codes):
        for st, c in zip(sts, codes):
            c2w.push(st, c)

    audio: dict = {}  # "<streams>/<round>" -> float32 [streams, samples] of the batched way

    def batched(flag, keep=False):
        def run(sts, codes, key=None):
            c2w.hift_batched = flag
            try:
                res = c2w.push_batch([SimpleNamespace(handle=st, codes=c, last=False) for st, c in zip(sts, codes)])
            finally:
                c2w.hift_batched = True
            bad = [r for r in res if isinstance(r, BaseException)]
            if bad:
                raise bad[0]
            if keep and key is not None:
                audio[key] = np.stack(res).astype(np.float32)
        return run

    ways = [("per-stream", per_stream), ("flow-batched", batched(False)), ("batched", batched(True, keep=True))]
    ways = [w for w in ways if w[0] in wanted]
    phase_ms: dict = {}  # phase -> ms accumulated in the current batched round
    if a.phases:
        for meth, phase in (("_encode", "encoder"), ("_euler_batch", "euler"), ("_vocode", "hift")):
            orig = getattr(c2w, meth)

            def timed(*args, _orig=orig, _phase=phase, **kw):
                sync()
                t = time.perf_counter()
                try:
                    return _orig(*args, **kw)
                finally:
                    sync()
                    phase_ms[_phase] = phase_ms.get(_phase, 0.0) + (time.perf_counter() - t) * 1000.0

            setattr(c2w, meth, timed)
    print(f"device {dev}, size {a.size}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"flow {a.dtype}, code2wav TF32 matmuls {'on' if getattr(c2w, 'matmul_tf32', False) else 'off'}", flush=True)
    print(f"device {dev}: Euler-loop graph rows {c2w.graph_rows}, sub-batch {c2w.euler_sub_batch}, "
          f"DiT attention caches {str(c2w.att_cache_dtype).replace('torch.', '')}", flush=True)
    print(f"{'streams':>7} {'per-stream ms':>14} {'flow-batched ms':>16} {'batched ms':>11} "
          f"{'per-stream/batched':>19} {'flow-batched/batched':>21}"
          + (f" {'encoder':>8} {'euler':>8} {'hift':>8}" if a.phases else ""), flush=True)
    for n in levels:
        sts = {name: [c2w.new_stream(None, seed=k) for k in range(n)] for name, _ in ways}
        times = {name: [] for name, _ in ways}
        phases: dict = {}
        for r in range(a.rounds + 2):
            codes = [rng.integers(0, 6561, 25) for _ in range(n)]
            for name, fn in ways:
                sync()
                t = time.perf_counter()
                phase_ms.clear()
                if name == "batched":
                    fn(sts[name], codes, f"{n}/{r}")
                else:
                    fn(sts[name], codes)
                sync()
                if r >= 2:
                    times[name].append((time.perf_counter() - t) * 1000.0)
                    if name == "batched":
                        for k, v in phase_ms.items():
                            phases.setdefault(k, []).append(v)
        med = {k: statistics.median(v) if v else float("nan") for k, v in times.items()}
        for k in ("per-stream", "flow-batched"):
            med.setdefault(k, float("nan"))
        ph = {k: statistics.median(v) for k, v in phases.items()}
        print(f"{n:>7} {med['per-stream']:>14.1f} {med['flow-batched']:>16.1f} {med['batched']:>11.1f} "
              f"{med['per-stream'] / med['batched']:>18.2f}x {med['flow-batched'] / med['batched']:>20.2f}x"
              + (f" {ph.get('encoder', 0):>8.1f} {ph.get('euler', 0):>8.1f} {ph.get('hift', 0):>8.1f}" if a.phases else ""),
              flush=True)
        if a.profile and dev.type == "cuda" and "batched" in sts:
            prof_rng = np.random.default_rng(1_000 + n)  # not `rng`: the next levels' codes stay those of a run without --profile
            codes = [prof_rng.integers(0, 6561, 25) for _ in range(n)]
            print(profile_round(torch, lambda: dict(ways)["batched"](sts["batched"], codes), sync), flush=True)
        for v in sts.values():
            for st in v:
                c2w.close(st)
    if dev.type == "cuda":
        g = 2 ** 30
        print(f"memory: Euler-loop scratch {c2w.scratch_bytes() / g:.2f} GiB ({len(c2w._dit_graphs)} graphs), "
              f"peak allocated {torch.cuda.max_memory_allocated(dev) / g:.2f} GiB", flush=True)
    if a.save_audio:
        np.savez(a.save_audio, **audio)
        print(f"batched audio of {len(audio)} rounds written to {a.save_audio}", flush=True)
    if a.compare_to:
        print(compare(audio, dict(np.load(a.compare_to))), flush=True)
    return 0


def profile_round(torch, fn, sync, top: int = 12) -> str:
    """torch.profiler over one call of ``fn`` (CUDA kernels, those replayed by CUDA graphs included):
    wall ms, kernel count, kernel time and share of the wall, and the ``top`` kernels by GPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        sync()
        wall = (time.perf_counter() - t) * 1000.0
    dev_t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    kern = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]
    n_k = sum(e.count for e in kern)
    busy = sum(dev_t(e) for e in kern) / 1000.0
    lines = [f"  profile: wall {wall:.1f} ms, {n_k} GPU kernels, kernel time {busy:.1f} ms "
             f"({100 * busy / max(wall, 1e-9):.0f} % busy)"]
    for e in sorted(kern, key=dev_t, reverse=True)[:top]:
        lines.append(f"    {dev_t(e) / 1000.0:8.2f} ms x{e.count:6d}  {e.key[:100]}")
    return "\n".join(lines)


def compare(mine: dict, ref: dict) -> str:
    """Per level: max |mine - ref| and the SNR of mine against ref (dB, over all rounds and streams),
    and the stream and round with the lowest SNR (a fault confined to some rows shows there)."""
    lines = [f"{'streams':>7} {'rounds':>6} {'max |diff|':>11} {'SNR dB':>7} {'worst stream/round':>19} {'its SNR':>8}"
             "  (against the saved run)"]
    levels = sorted({int(k.split("/")[0]) for k in mine if k in ref})

    def snr_db(x, y):
        e2 = np.sum((x - y) ** 2)
        return float("inf") if e2 == 0 else 10 * np.log10(np.sum(y * y) / e2)

    for n in levels:
        keys = [k for k in mine if k.startswith(f"{n}/") and k in ref and mine[k].shape == ref[k].shape]
        x = np.concatenate([mine[k].ravel() for k in keys]).astype(np.float64)
        y = np.concatenate([ref[k].ravel() for k in keys]).astype(np.float64)
        rows = [(snr_db(mine[k][i].astype(np.float64), ref[k][i].astype(np.float64)), i, k.split("/")[1])
                for k in keys for i in range(mine[k].shape[0])]
        worst = min(rows) if rows else (float("nan"), -1, "-")
        lines.append(f"{n:>7} {len(keys):>6} {np.abs(x - y).max():>11.2e} {snr_db(x, y):>7.1f} "
                     f"{f'{worst[1]}/{worst[2]}':>19} {worst[0]:>8.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
