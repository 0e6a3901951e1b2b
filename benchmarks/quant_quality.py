"""Benchmark: quantized weights (int8, fp8) against the unquantized model, per stage: relative
logit error and greedy agreement, weight memory, and on CUDA the time per unit side by side.

Run (from the repository root)::

    duplexkit bench quant_quality --model tiny --device cpu              # the CPU table (docs)
    duplexkit bench quant_quality --model random-real --device cuda      # real sizes, random bf16 weights

(``python3 benchmarks/quant_quality.py ...`` with the project's environment does the same.)

Models: ``tiny`` is the deterministic tiny checkpoint (``build_tiny_checkpoint``, seed 0; float32 on
the CPU, bf16 on CUDA); ``random-real`` is the real-size model with random weights
(``random_init.build_random_model``, seed 0, bf16, CUDA only: docs/model.md §1.1 sizes), its
outputs meaningless but its arithmetic the real one. The quantized models are built from the same
seed, so they quantize exactly the reference's weights.

Quality (:mod:`duplexkit.models.minicpmo45.quant_check`): the thinker prefills a fixed prompt
(``thinker prefill``: every position's logits), then decodes ``--steps`` greedy steps fed the
reference's ids (``thinker decode``); the talker is conditioned on the first 12 prompt tokens and the
reference thinker's hidden states and decodes 25 codec tokens the same way (``talker``). Columns:
``rel err`` = ‖L_q − L_ref‖ / ‖L_ref‖ over the compared rows, ``agree`` = rows with the same
argmax, ``free run`` = greedy steps before the quantized model's own run first differs.

Memory: the stage's weight bytes (parameters and buffers; the thinker's includes its audio and
vision towers and ``lm_head``, kept unquantized). Time (CUDA only): the fast paths with CUDA graphs,
one stream, ``--units`` units after one warm-up pass: a thinker speaking unit (unit prefill + 20
decode steps, forced) and a talker unit (19 text tokens, 25 codes), median ms.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import positive_int, torch_device  # noqa: E402

PROMPT = "Hello there, how are you doing today? Tell me a story about a cat that lives on a boat."


def _modes(s: str) -> list:
    out = [m.strip() for m in s.split(",") if m.strip()]
    bad = [m for m in out if m not in ("int8", "fp8")]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of int8, fp8; got {s!r}")
    return out


def _build(kind: str, dev, dtype, mode: str, tiny_dir):
    from duplexkit.models.minicpmo45 import load
    from duplexkit.models.minicpmo45.random_init import build_random_model

    q = None if mode == "none" else mode
    if kind == "tiny":
        return load(tiny_dir, dtype=dtype, devices=str(dev), with_code2wav=False, progress=False, quantization=q,
                    fast=dev.type == "cuda")
    return build_random_model("real", dtype=dtype, device=dev, seed=0, with_code2wav=False, fast=True,
                              kv_slots=1, thinker_max_len=2048, quantization=q)


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _unit_times(model, dev, units: int) -> dict:
    """Median ms of a forced thinker speaking unit and of a talker unit (fast paths, one stream)."""
    import numpy as np
    import torch

    from duplexkit.models.minicpmo45 import DuplexPolicy, UnitInput
    from duplexkit.models.minicpmo45.talker import TalkerInput, TalkerSampling

    th, tk = model.thinker, model.talker
    rng = np.random.default_rng(0)
    audio = [(0.1 * rng.standard_normal(16560 if i == 0 else 16000)).astype(np.float32) for i in range(units)]
    th_ms, tk_ms = [], []
    for rep in range(2):  # the first pass captures the graphs
        st = th.new_stream(policy=DuplexPolicy(temperature=0.0, min_unit_tokens=19, max_unit_tokens=19))
        turn = tk.new_turn()
        gen = torch.Generator(device=dev).manual_seed(0)
        for k, a in enumerate(audio):
            _sync(dev)
            t = time.perf_counter()
            (r,) = th.step_units([UnitInput(st, a, force_speak=True)])
            _sync(dev)
            t1 = time.perf_counter()
            out = tk.generate_units([TalkerInput(turn=turn, token_ids=r.token_ids[:19], hidden=r.hidden[:19],
                                                 generator=gen, sampling=TalkerSampling(), min_new_tokens=25,
                                                 turn_start=k == 0)])
            _sync(dev)
            t2 = time.perf_counter()
            if isinstance(out[0], BaseException):
                raise out[0]
            if rep == 1:
                th_ms.append((t1 - t) * 1e3)
                tk_ms.append((t2 - t1) * 1e3)
        th.close(st)
    return {"thinker unit": statistics.median(th_ms), "talker unit": statistics.median(tk_ms)}


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:1]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "random-real"), default="tiny",
                    help="tiny checkpoint or real-size random weights (CUDA) (default tiny)")
    ap.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda[:N] (default: cuda when available)")
    ap.add_argument("--modes", type=_modes, default=["int8", "fp8"], help="comma list of int8, fp8 (default both)")
    ap.add_argument("--steps", type=positive_int, default=20, help="thinker decode steps compared (default 20)")
    ap.add_argument("--units", type=positive_int, default=8, help="timed units per stage on CUDA (default 8)")
    a = ap.parse_args(argv)
    dev = a.device
    if a.model == "random-real" and dev.type != "cuda":
        ap.error("--model random-real needs --device cuda (the real-size model is 17.6 GiB in bf16)")

    import tempfile

    from duplexkit.models.minicpmo45 import build_tiny_checkpoint
    from duplexkit.models.minicpmo45.quant_check import talker_check, thinker_checks
    from duplexkit.models.minicpmo45.quantization import fp8_supported, weight_bytes

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    modes = [m for m in a.modes if m != "fp8" or dev.type == "cpu" or fp8_supported(dev)]
    if len(modes) < len(a.modes):
        print("note: fp8 skipped (needs CUDA compute capability >= 8.9)")
    with tempfile.TemporaryDirectory(prefix="duplexkit-quant-") as td:
        tiny_dir = build_tiny_checkpoint(Path(td) / "ckpt", seed=0) if a.model == "tiny" else None
        t0 = time.perf_counter()
        ref = _build(a.model, dev, dtype, "none", tiny_dir)
        dname = str(dtype).replace("torch.", "")
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}; "
              f"model {a.model} ({dname} reference built in {time.perf_counter() - t0:.1f} s)", flush=True)
        ids = ref.tokenizer(PROMPT)["input_ids"]
        with torch.inference_mode():
            hidden = ref.thinker.forward_embeds(ref.thinker.embed_ids(ids[:12]), ref.thinker.new_cache())
        mem = {"none": (weight_bytes(ref.thinker.m), weight_bytes(getattr(ref.talker, "talker", ref.talker)))}
        times = {"none": _unit_times(ref, dev, a.units)} if dev.type == "cuda" else {}
        quality = []
        for mode in modes:
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            qm = _build(a.model, dev, dtype, mode, tiny_dir)
            for stage, qrep in qm.quantization.items():
                print(f"  {qrep.line(stage)}", flush=True)
            for chk in thinker_checks(ref.thinker, qm.thinker, ids, steps=a.steps):
                quality.append((mode, chk))
            quality.append((mode, talker_check(ref.talker, qm.talker, ids[:12], hidden, steps=25)))
            mem[mode] = (weight_bytes(qm.thinker.m), weight_bytes(getattr(qm.talker, "talker", qm.talker)))
            if dev.type == "cuda":
                times[mode] = _unit_times(qm, dev, a.units)
            print(f"  {mode} done", flush=True)
            del qm

    print()
    print(f"Quality vs {dname} ({a.model}, {dev.type}; prompt {len(ids)} tokens, {a.steps} thinker / 25 talker "
          "decode steps)")
    print(f"{'stage':<16} {'mode':<5} {'rel err':>8} {'agree':>13} {'free run':>9}")
    for mode, c in quality:
        fr = "-" if c.free_run < 0 else f"{c.free_run}/{c.rows}"
        print(f"{c.stage:<16} {mode:<5} {100 * c.rel_err:>7.2f}% {100 * c.agreement:>6.1f}% ({c.rows:>3}) {fr:>9}")
    print()
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"  # noqa: E731
    print(f"Weights per stage{' and ms per unit (median of ' + str(a.units) + ')' if times else ''}")
    head = f"{'mode':<8} {'thinker':>11} {'talker':>11}"
    if times:
        head += f" {'thinker unit':>13} {'talker unit':>12}"
    print(head)
    for mode in ["none"] + modes:
        row = f"{mode if mode != 'none' else dname:<8} {gib(mem[mode][0]):>11} {gib(mem[mode][1]):>11}"
        if times:
            row += f" {times[mode]['thinker unit']:>10.1f} ms {times[mode]['talker unit']:>9.1f} ms"
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
