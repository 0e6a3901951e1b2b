"""Micro-benchmark: the talker's one-token decode step, ``fast_kv.decoder_forward`` (its Triton path)
vs the fused step of duplexkit/models/minicpmo45/triton_talker.py (five kernels per layer).

Run (from the repository root)::

    PYTHONPATH=$PWD python3 benchmarks/talker_step.py                       # one GPU, the table
    PYTHONPATH=$PWD python3 benchmarks/talker_step.py --batches 1,8 --kv 512
    PYTHONPATH=$PWD python3 benchmarks/talker_step.py --blocks 16,32,32,128,4   # other tile sizes
    PYTHONPATH=$PWD python3 benchmarks/talker_step.py --tiny --device cpu    # smoke (Triton interpreter)

At the real talker shapes (Llama, hidden 768, 20 layers, 12 heads x 64, FFN 3072, random bf16
weights, fused projections as FastTalker has them), for B rows in ``--batches`` (each in its own
slot) and each ``kv_len`` of ``--kv`` (the unit graph's KV bucket; the 25 steps sit at positions
``kv_len - 26 ...``, each step fed the previous step's output), both paths are captured as a CUDA
graph of 25 steps, as FastTalker captures a unit; the table gives the median ms per step over
replays, the CUDA kernels per step (torch.profiler over one eager unit, without memcpy / memset),
and the max abs difference of the two paths' outputs after one step.

``--tiny --device cpu`` runs the same code on a tiny model (hidden 128, 2 layers, 2 heads x 64, FFN 256)
on the CPU under Triton's interpreter, eagerly (no graphs, no profiler, a few steps): a check that the
script still runs, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

STEPS = 25


def build(tiny: bool, dev, dtype):
    import torch
    from transformers import LlamaConfig, LlamaModel

    from duplexkit.models.minicpmo45 import fast_kv

    if tiny:
        geo = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2)
    else:
        geo = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=20, num_attention_heads=12)
    cfg = LlamaConfig(vocab_size=16, num_key_value_heads=geo["num_attention_heads"], head_dim=64, rms_norm_eps=1e-6,
                      max_position_embeddings=4096, hidden_act="silu", **geo)
    torch.manual_seed(0)
    with torch.device(dev):
        m = LlamaModel(cfg).to(dtype).eval()
    fast_kv.fuse_projections(m)
    return m


def case(model, B: int, kv_len: int, dev, dtype, graphs: bool, profile: bool, replays: int):
    """{path: (ms per step, kernels per step or None)}, max |diff| after one step."""
    import torch

    from duplexkit.models.minicpmo45 import fast_kv, triton_talker

    cfg = model.config
    pool = fast_kv.KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, kv_len, dtype=dtype, device=dev, slots=B)
    pool.k.normal_()
    pool.v.normal_()
    x = torch.randn(B, 1, cfg.hidden_size, device=dev, dtype=dtype)
    base = torch.full((B,), max(kv_len - STEPS - 1, 0), dtype=torch.long, device=dev)
    slots = torch.arange(B, device=dev)
    paths = {"decoder_forward": fast_kv.decoder_forward, "fused": triton_talker.fused_decode_step}

    def unit(fn, steps=STEPS):
        h = x
        for s in range(steps):
            h = fn(model, h, (base + s)[:, None], slots, pool, kv_len)
        return h

    res = {}
    with torch.no_grad():
        k0, v0 = pool.k.clone(), pool.v.clone()
        one = {}
        for name, fn in paths.items():
            pool.k.copy_(k0)
            pool.v.copy_(v0)
            one[name] = fn(model, x, base[:, None], slots, pool, kv_len).float()
        diff = (one["decoder_forward"] - one["fused"]).abs().max().item()
        for name, fn in paths.items():
            kernels = None
            if profile:
                from torch.profiler import ProfilerActivity, profile as prof_ctx

                unit(fn)  # warm (compiles, autotunes) outside the profile
                torch.cuda.synchronize()
                with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
                    unit(fn)
                    torch.cuda.synchronize()
                evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                       and not e.name.lower().startswith(("memcpy", "memset"))]
                kernels = len(evs) / STEPS
            if graphs:
                graph, _ = fast_kv.capture_graph(lambda: unit(fn), dev)
                graph.replay()
                torch.cuda.synchronize()
                times = []
                for _ in range(replays):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graph.replay()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) / STEPS)
                del graph
            else:  # the CPU smoke: a few eager steps, wall clock
                times = []
                for _ in range(replays):
                    t0 = time.perf_counter()
                    unit(fn, steps=2)
                    times.append((time.perf_counter() - t0) * 1000.0 / 2)
            res[name] = (statistics.median(times), kernels)
    del pool
    return res, diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: interpreter smoke)")
    ap.add_argument("--tiny", action="store_true", help="tiny model (hidden 128, 2 layers)")
    ap.add_argument("--batches", default=None, help="comma list of B (default 1,8,32; tiny: 1,3)")
    ap.add_argument("--kv", default=None, help="comma list of kv_len (default 256,512; tiny: 64)")
    ap.add_argument("--replays", type=int, default=None, help="timed replays per case (default 50; cpu 1)")
    ap.add_argument("--no-profile", action="store_true", help="skip the kernel count")
    ap.add_argument("--blocks", default=None, metavar="HALF,N_OUT,N_FFN,K[,WARPS]",
                    help="the fused kernels' tile sizes (triton_talker.BLOCK_HALF, BLOCK_N_OUT, BLOCK_N_FFN, "
                         "BLOCK_K, NUM_WARPS), for tuning")
    ap.add_argument("--one-split-kv", type=int, default=None,
                    help="triton_talker.ONE_SPLIT_MAX_KV: the largest kv_len whose attention runs one split")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    if cpu:
        if not args.tiny:
            raise SystemExit("--device cpu runs only with --tiny (Triton's interpreter is slow)")
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    from duplexkit.models.minicpmo45 import fast_kv

    if cpu:
        fast_kv._TRITON_ON_CPU = True  # decoder_forward's Triton path on CPU tensors (interpreter)
        _interpreter_numpy_fix()
    elif not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --tiny --device cpu)")
    if not fast_kv.triton_decode_enabled():
        raise SystemExit("DUPLEXKIT_TRITON_DECODE=0: this compares against decoder_forward's Triton path")
    from duplexkit.models.minicpmo45 import triton_talker

    if args.blocks:
        vals = [int(v) for v in args.blocks.split(",")]
        for name, v in zip(("BLOCK_HALF", "BLOCK_N_OUT", "BLOCK_N_FFN", "BLOCK_K", "NUM_WARPS"), vals):
            setattr(triton_talker, name, v)
    if args.one_split_kv is not None:
        triton_talker.ONE_SPLIT_MAX_KV = args.one_split_kv
    dev = torch.device(args.device)
    dtype = torch.float32 if cpu else torch.bfloat16
    batches = [int(b) for b in (args.batches or ("1,3" if args.tiny else "1,8,32")).split(",")]
    kvs = [int(k) for k in (args.kv or ("64" if args.tiny else "256,512")).split(",")]
    replays = args.replays or (1 if cpu else 50)
    fast_kv.pin_sdpa_backend()
    model = build(args.tiny, dev, dtype)
    cfg = model.config
    name = "cpu (Triton interpreter)" if cpu else torch.cuda.get_device_name()
    print(f"{name}  torch {torch.__version__}  triton {triton_talker.triton.__version__}  "
          f"{'tiny' if args.tiny else 'talker'} {cfg.num_hidden_layers} layers x hidden {cfg.hidden_size}  {dtype}")
    print(f"blocks: half {triton_talker.BLOCK_HALF}  n_out {triton_talker.BLOCK_N_OUT}  n_ffn {triton_talker.BLOCK_N_FFN}"
          f"  k {triton_talker.BLOCK_K}  warps {triton_talker.NUM_WARPS}  one-split kv <= "
          f"{triton_talker.ONE_SPLIT_MAX_KV}")
    unit = "ms/step" + (" (eager wall)" if cpu else " (graph of 25)")
    print(f"\n{'B':>3} {'kv':>5} {'decoder_forward':>16} {'fused':>9} {'speedup':>8} {'kern/step':>15} {'max|diff|':>10}"
          f"   [{unit}]")
    for B in batches:
        for kv in kvs:
            res, diff = case(model, B, kv, dev, dtype, graphs=not cpu, profile=not cpu and not args.no_profile,
                             replays=replays)
            (ta, ka), (tb, kb) = res["decoder_forward"], res["fused"]
            kern = f"{ka:6.0f} -> {kb:5.0f}" if ka is not None else "-"
            print(f"{B:>3} {kv:>5} {ta:16.3f} {tb:9.3f} {ta / tb:7.2f}x {kern:>15} {diff:10.2e}", flush=True)
            if not cpu:
                torch.cuda.empty_cache()


def _interpreter_numpy_fix() -> None:
    """Triton 3.5's interpreter turns a scalar into a Python int through ``int(1-element array)``,
    which NumPy >= 2.3 refuses (the attention's key loop has tensor bounds); give its tensors an
    ``__index__`` (as tests/model/test_triton_decode.py does). CPU smoke only."""
    import triton.runtime.interpreter as ti

    orig = ti._patch_lang_tensor

    def patched(tensor, *args, **kwargs):  # the signature differs between Triton versions
        orig(tensor, *args, **kwargs)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    ti._patch_lang_tensor = patched


if __name__ == "__main__":
    sys.exit(main())
