"""``duplexkit plan-memory``: the memory plan for a budget, without a GPU (:mod:`duplexkit.engine.memory_plan`)."""

from __future__ import annotations

import argparse
import json

from .common import EXIT_USAGE, _float_min, _int_range

SIZING_BUDGETS = (24.0, 48.0, 80.0, 141.0)
"""The budgets of the docs' sizing table (GiB): a 24 GB card, a 48 GB card, an 80 GB H100, a 141 GB H200."""


def _budgets(text: str) -> list:
    out = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected GiB as a number or a comma list, got {text!r}") from None
        if not 0 < v < float("inf"):
            raise argparse.ArgumentTypeError(f"a budget must be > 0 GiB, got {part}")
        out.append(v)
    return out


def add_plan_memory_parser(sub) -> None:
    """The ``plan-memory`` subcommand's parser."""
    from duplexkit.engine.memory_plan import DEFAULT_THINKER_POSITIONS, QUANTIZATION_MODES

    p = sub.add_parser("plan-memory", help="print the GPU memory plan for a budget (no GPU needed)",
                       description="Size stream slots, KV caches, CUDA-graph buffers and Code2Wav caches to a "
                                   "memory budget, as `serve --memory` and benchmarks/gpu_engine.py --memory do, and "
                                   "print the plan's table. Exit status 2 (with the table) when the model does not "
                                   "fit. Weights and caches are computed from the config; the CUDA context, graph "
                                   "pools and per-stream activations are measured figures (docs/memory.md).")
    p.add_argument("model", nargs="?", default="random-real",
                   help="'random-real' (the real model's sizes, default), 'tiny', or a checkpoint directory (only its "
                        "config.json is read)")
    p.add_argument("--memory", type=_budgets, required=True, metavar="GIB[,GIB...]",
                   help="device memory budget in GiB (a comma list prints one plan per budget)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="thinker and talker dtype (default bfloat16)")
    p.add_argument("--quantization", choices=list(QUANTIZATION_MODES), default="none",
                   help="weight quantization of the thinker's and talker's decoder linears (default none)")
    p.add_argument("--streams", type=_int_range(1, 64), default=None,
                   help="the streams the plan must hold (default: as many as fit)")
    p.add_argument("--kv-len", type=_int_range(256), default=DEFAULT_THINKER_POSITIONS,
                   help=f"thinker KV positions per stream to start from (default {DEFAULT_THINKER_POSITIONS}; "
                        "halved down to 1024 when needed)")
    p.add_argument("--graph-rows", type=int, choices=[1, 2, 4, 8, 16, 32], default=None,
                   help="Code2Wav Euler-loop graph rows (default: chosen by the plan)")
    p.add_argument("--voice-s", type=_float_min(0.5), default=6.04,
                   help="longest reference voice to hold caches for, s (default 6.04, the bundled voice)")
    p.add_argument("--table", action="store_true",
                   help="print the Markdown sizing table (each budget x none/int8/fp8) instead of plans")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    p.set_defaults(func=cmd_plan_memory)


def cmd_plan_memory(args) -> int:
    """``duplexkit plan-memory``: print the plan (or the sizing table); a budget that cannot hold the
    model prints the refusal's table and exits 2 (``MemoryBudgetError`` is a ``LayoutError``)."""
    from duplexkit.engine.memory_plan import MemoryBudgetError, model_sizes_for, plan_memory, sizing_table

    sizes = model_sizes_for(args.model)
    if args.table:
        print(sizing_table(sizes, args.memory, dtype=args.dtype, thinker_positions=args.kv_len))
        return 0
    plans, status = [], 0
    for budget in args.memory:
        try:
            plans.append(plan_memory(sizes, budget, dtype=args.dtype, quantization=args.quantization,
                                     streams=args.streams, thinker_positions=args.kv_len,
                                     graph_rows=args.graph_rows, voice_s=args.voice_s))
        except MemoryBudgetError as exc:
            if len(args.memory) == 1:
                raise
            print(f"error: {exc}\n")
            status = EXIT_USAGE
    if args.json:
        print(json.dumps([p.as_dict() for p in plans], indent=1))
    else:
        print("\n\n".join(p.table() for p in plans))
    return status
