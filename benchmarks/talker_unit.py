"""Benchmark: one speaking unit of the batched talker (``FastTalker.generate_units``), wall time per
call, two ways on CUDA, side by side in one process:

* ``eager-prefill``: the unit's prefill runs eagerly, then one CUDA graph of the 25 decode steps
  (``prefill_rows=0``; the path without prefill rows);
* ``graph``: the prefill padded to ``PREFILL_ROWS`` inside the unit's graph (the default).

Run (from the repository root)::

    duplexkit bench talker_unit                              # one GPU: the table
    duplexkit bench talker_unit --batches 1,8 --tokens 5,19
    duplexkit bench talker_unit --device cpu --units 2       # smoke run (tiny sizes on the CPU)

(``python3 benchmarks/talker_unit.py ...`` with the project's environment does the same; on the lent
GPU machine, with the wheels of docs/benchmarks.md installed and ``PYTHONPATH`` set.)

The talker is built alone with random weights (``random_init.build_random_talker``; real sizes:
Llama 768 x 20 layers, bf16). Each case runs ``--units`` mid-turn units (25 codes, EOS masked) for
B turns at once, each unit conditioned on N random text tokens and random thinker hidden states
(the prefill is N + 1 rows), with seeded sampling (the reference duplex sampling). The first pass
over the units captures every graph the second pass needs (the KV-length buckets grow with the
turn); the table gives the second pass: ms per ``generate_units`` call (host to codes on the host,
the unit's one sync included), median and p90. On the CPU it only checks that the script runs
(nothing is captured; the times are not a measurement).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import int_list, positive_int, torch_device  # noqa: E402


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda[:N] (default: cuda when available)")
    ap.add_argument("--size", choices=("real", "tiny"), default=None,
                    help="talker sizes (default: real on CUDA, tiny on the CPU)")
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32], metavar="B,...",
                    help="turns per call (default 1,8,32)")
    ap.add_argument("--tokens", type=int_list, default=[19], metavar="N,...",
                    help="text tokens per unit (default 19; above PREFILL_ROWS - 1 = 31 both ways run the eager prefill)")
    ap.add_argument("--units", type=positive_int, default=12, help="units per turn in each pass (default 12)")
    args = ap.parse_args(argv)
    if args.size is None:
        args.size = "real" if args.device.type == "cuda" else "tiny"

    from duplexkit.models.minicpmo45.fast_talker import PREFILL_ROWS, FastTalker
    from duplexkit.models.minicpmo45.random_init import build_random_talker
    from duplexkit.models.minicpmo45.talker import TalkerInput, TalkerSampling

    dev = args.device
    if max(args.tokens) + 1 > PREFILL_ROWS:
        print(f"note: N + 1 > PREFILL_ROWS ({PREFILL_ROWS}): those units run the eager prefill in every way")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tk = build_random_talker(args.size, dtype=dtype, device=dev)
    cfg = tk.config
    print(f"talker: {args.size} sizes, random weights ({cfg.num_hidden_layers} layers x {cfg.hidden_size}), "
          f"{dtype}, {dev}" + ("" if dev.type == "cuda" else " -- CPU: a smoke run, not a measurement"))
    ways = [("eager-prefill", dict(prefill_rows=0)), ("graph", dict())]
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for N in args.tokens:
        inputs = [(torch.randint(0, min(150000, cfg.num_text_tokens), (N,), generator=gen, device=dev).tolist(),
                   torch.randn(N, cfg.llm_dim, generator=gen, device=dev, dtype=dtype)) for _ in range(args.units)]
        for B in args.batches:
            for name, kw in ways:
                ft = FastTalker(tk, slots=B, **kw)
                t0 = time.perf_counter()
                times = []
                for rep in range(2):
                    turns = [ft.new_turn() for _ in range(B)]
                    gens = [torch.Generator(device=dev).manual_seed(b) for b in range(B)]
                    for k, (ids, hid) in enumerate(inputs):
                        items = [TalkerInput(turn=t, token_ids=ids, hidden=hid, generator=g, sampling=TalkerSampling(),
                                             min_new_tokens=25, turn_start=k == 0) for t, g in zip(turns, gens)]
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        t = time.perf_counter()
                        out = ft.generate_units(items)
                        if rep == 1:
                            times.append((time.perf_counter() - t) * 1e3)
                        bad = [r for r in out if isinstance(r, BaseException)]
                        if bad:
                            raise bad[0]
                    if rep == 0:
                        warm_s = time.perf_counter() - t0
                times.sort()
                rows.append((N, B, name, statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))],
                             ft.stats["graph_captures"], warm_s))
                print(f"  N={N} B={B} {name}: {rows[-1][3]:.2f} ms", flush=True)
                del ft, turns
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    print()
    print(f"{'N':>3} {'B':>3}  {'way':<14} {'unit p50':>9} {'p90':>8} {'vs eager-prefill':>17} {'graphs':>7} {'pass 1 s':>9}")
    base = {(r[0], r[1]): r[3] for r in rows if r[2] == "eager-prefill"}
    for N, B, name, p50, p90, caps, warm in rows:
        print(f"{N:>3} {B:>3}  {name:<14} {p50:>9.2f} {p90:>8.2f} {base[(N, B)] / p50:>16.2f}x {caps:>7} {warm:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
