"""The GPU memory budget planner (duplexkit/engine/memory_plan.py), on the CPU.

Plan arithmetic against sizes computed by hand from docs/model.md's dimensions (real) and against what
the code allocates (KV pools, the tiny model's parameters); monotonic stream slots in the budget; the
refusal below the weights and its message; the options of ``serve --memory``, ``plan-memory`` and
``benchmarks/gpu_engine.py --memory``; the tiny engine built on the CPU to a plan honours its slot cap;
the sizing table in docs/memory.md is the one the planner prints today.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from duplexkit.engine import memory_plan as mp  # noqa: E402
from duplexkit.engine.memory_plan import GiB, MemoryBudgetError, plan_memory  # noqa: E402
from duplexkit.engine.checks import PreflightError  # noqa: E402
from duplexkit.errors import LayoutError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def real():
    return mp.model_sizes_for("random-real")


@pytest.fixture(scope="module")
def tiny():
    return mp.model_sizes_for("tiny")


def _item(plan, prefix):
    (it,) = [it for it in plan.items if it.name.startswith(prefix)]
    return it


# ------------------------------------------------------------------------------------------ sizes


def test_real_sizes_match_the_hand_arithmetic(real):
    """docs/model.md §1.1: Qwen3 4096 wide, 36 layers, 32 q / 8 KV heads of 128, FFN 12,288, vocab 151,748,
    untied lm_head; talker Llama 768 x 20 layers, 12 heads, FFN 3072."""
    H, F, V, L = 4096, 12288, 151748, 36
    layer_linears = 2 * H * H + 2 * H * 1024 + 3 * H * F
    llm = L * (layer_linears + 2 * H + 2 * 128) + 2 * V * H + H
    assert llm == 8_189_195_264  # docs/model.md: 8,189.2 M
    assert real.thinker_quant_params == L * layer_linears == 6_945_767_424
    assert real.thinker_quant_rows == L * (H + 1024 + 1024 + H + F + F + H)
    # + vpm 417.8 M, resampler 88.9 M, apm 307.2 M, projection 21.0 M (docs/model.md §1.1)
    assert real.thinker_params - llm == 417_792_240 + 88_907_776 + 307_216_384 + 20_979_712
    t = 768
    assert real.talker_quant_params == 20 * (4 * t * t + 3 * t * 3072) == 188_743_680
    assert (real.llm_layers, real.llm_kv_heads, real.llm_head_dim) == (36, 8, 128)
    assert (real.whisper_layers, real.whisper_heads, real.whisper_head_dim, real.whisper_positions) == (24, 16, 64, 1504)
    assert (real.talker_layers, real.talker_kv_heads, real.talker_head_dim, real.talker_positions) == (20, 12, 64, 4096)


def test_the_calibration_sizes_are_the_counted_ones(real):
    """The activation reserve is calibrated on a copy of the real sizes (no meta build at import):
    it must equal what model_sizes counts."""
    c = mp._REAL_ARITHMETIC
    for f in ("thinker_params", "talker_params", "llm_layers", "llm_kv_heads", "llm_head_dim", "whisper_layers",
              "whisper_heads", "whisper_head_dim", "whisper_positions", "talker_layers", "talker_kv_heads",
              "talker_head_dim", "talker_positions"):
        assert getattr(c, f) == getattr(real, f), f


def test_real_plan_bytes_by_hand(real):
    """Every computed row of a 4-stream bf16 plan at 2048 positions, by hand."""
    p = plan_memory(real, 141, streams=4, graph_rows=4)
    assert p.streams == 4 and p.thinker_positions == 2048 and p.graph_rows == 4
    assert _item(p, "weights thinker").bytes == 9_024_091_376 * 2  # 16.81 GiB
    assert _item(p, "weights talker").bytes == 319_383_970 * 2
    assert _item(p, "weights code2wav").bytes == (155_802_352 + 20_821_295) * 4
    kv = _item(p, "KV thinker (LLM)")
    assert kv.each == 2 * 36 * 2048 * 8 * 128 * 2 == 301_989_888 and kv.count == 5  # 144 KiB per position
    assert _item(p, "KV thinker audio").each == 2 * 24 * 1504 * 16 * 64 * 2 == 147_849_216  # 147.8 MB
    assert _item(p, "KV talker").each == 2 * 20 * 4096 * 12 * 64 * 2 == 251_658_240  # 252 MB per slot
    # a stream's own DiT attention caches: 10 steps x 16 blocks x 2 CFG x 8 heads x (302 + 100) frames x 128
    own = 10 * 16 * 2 * 8 * 402 * 128 * 2 + 10 * 2 * 512 * 402 * 4
    assert _item(p, "code2wav stream caches").each == own
    assert _item(p, "code2wav graph scratch").bytes >= 10 * 16 * 8 * 8 * 512 * 128 * 2  # kv: 4 rows x 2 CFG
    assert p.total_bytes == sum(it.bytes for it in p.items)


def test_code2wav_scratch_matches_the_measured_figure(real):
    """16 graph rows with float16 attention caches: 5.09 GiB measured on the H200
    (benchmarks/results/2026-12-03-code2wav-caches-acceptance-h200.md); the float32 caches' 10.09."""
    p16 = plan_memory(real, 141, streams=16, graph_rows=16)
    assert _item(p16, "code2wav graph scratch").bytes / GiB == pytest.approx(5.09, abs=0.03)
    p32 = plan_memory(real, 141, streams=16, graph_rows=16, att_cache_bytes=4)
    assert _item(p32, "code2wav graph scratch").bytes / GiB == pytest.approx(10.09, abs=0.05)


def test_the_acceptance_run_plans_to_its_measured_peak(real):
    """The per-stream activation reserve is calibrated so that the 64-stream acceptance run's plan is its
    measured peak (116.3 GiB) plus the CUDA context; the static parts of that run at 48 streams were
    measured at 56.3 GiB of KV + weights + buffers (results/2026-12-02-gpu-engine-48-64-streams-h200.md:
    KV thinker 13.8 + talker 11.5 GiB)."""
    p = plan_memory(real, 141, streams=64, graph_rows=16)
    assert p.total_gib == pytest.approx(mp.ACCEPTANCE_PEAK_GIB + mp.CUDA_CONTEXT_GIB, abs=0.01)
    p48 = plan_memory(real, 141, streams=48, graph_rows=16)
    assert _item(p48, "KV thinker (LLM)").bytes / GiB == pytest.approx(13.8, abs=0.05)
    assert _item(p48, "KV talker").bytes / GiB == pytest.approx(11.5, abs=0.05)
    assert 0.2 < mp.activation_per_stream_gib() < 1.0


def test_tiny_sizes_are_what_the_tiny_model_holds(tiny):
    """The tiny checkpoint's parameters, loaded on the CPU, are the counted ones; a KV pool of the tiny
    geometry allocates the planned bytes per slot."""
    from duplexkit.engine.engine import tiny_checkpoint_dir
    from duplexkit.models.minicpmo45 import load
    from duplexkit.models.minicpmo45.fast_kv import KVPool

    m = load(tiny_checkpoint_dir(0), dtype=torch.float32, devices="cpu", with_code2wav=False, progress=False)
    th = sum(p.numel() for p in m.thinker.m.parameters())
    tk = sum(p.numel() for p in m.talker.parameters())
    assert (th, tk) == (tiny.thinker_params, tiny.talker_params)
    p = plan_memory(tiny, 8, dtype="float32", streams=2, thinker_positions=512)
    pool = KVPool(tiny.llm_layers, tiny.llm_kv_heads, tiny.llm_head_dim, 512, dtype=torch.float32, device="cpu", slots=2)
    assert pool.nbytes() == _item(p, "KV thinker (LLM)").bytes  # 2 slots + the scratch slot
    tpool = KVPool(tiny.talker_layers, tiny.talker_kv_heads, tiny.talker_head_dim, tiny.talker_positions,
                   dtype=torch.float32, device="cpu", slots=2)
    assert tpool.nbytes() == _item(p, "KV talker").bytes


def test_quantized_weights_by_hand(real):
    """int8 / fp8: 1 byte per decoder-linear weight + a float32 scale per output channel; the rest bf16."""
    for mode in ("int8", "fp8"):
        p = plan_memory(real, 141, quantization=mode, streams=1)
        q, rows = real.thinker_quant_params, real.thinker_quant_rows
        assert _item(p, "weights thinker").bytes == (real.thinker_params - q) * 2 + q + rows * 4
        assert p.quantization == mode
    none = plan_memory(real, 141, streams=1)
    assert none.weights_gib - p.weights_gib == pytest.approx((6_945_767_424 + 188_743_680) / GiB, abs=0.01)


# ------------------------------------------------------------------------------------------ choosing


@pytest.mark.parametrize("mode", mp.QUANTIZATION_MODES)
def test_stream_slots_never_fall_as_the_budget_grows(real, mode):
    last = 0
    for budget in range(20, 160, 3):
        try:
            n = plan_memory(real, budget, quantization=mode).streams
        except MemoryBudgetError:
            n = 0
        assert n >= last, (budget, n, last)
        last = n
    assert last == mp.MAX_STREAMS


def test_every_plan_fits_and_one_more_stream_would_not(real):
    for budget in (24, 37.5, 48, 80):
        p = plan_memory(real, budget, quantization="int8")
        assert p.fits and p.total_gib <= budget
        with pytest.raises(MemoryBudgetError):
            plan_memory(real, budget, quantization="int8", streams=p.streams + 1, shrink_positions=False)


def test_refusal_below_the_weights_names_the_smallest_budget(real):
    with pytest.raises(MemoryBudgetError) as ei:
        plan_memory(real, 16)
    e = ei.value
    msg = str(e)
    assert isinstance(e, LayoutError) and e.code == "server_error"
    assert "memory budget 16 GiB: the weights alone (18.06 GiB) do not fit" in msg
    assert f"need at least {e.needed_gib:g} GiB" in msg
    for row in ("weights thinker", "KV thinker", "activations per stream", "over budget"):
        assert row in msg
    assert plan_memory(real, e.needed_gib).streams >= 1  # the named budget fits one stream
    with pytest.raises(MemoryBudgetError):
        plan_memory(real, e.needed_gib - 0.1)


def test_refusal_of_a_stream_count_names_its_budget(real):
    with pytest.raises(MemoryBudgetError) as ei:
        plan_memory(real, 24, streams=4)
    assert "4 streams do not fit" in str(ei.value) and ei.value.streams == 4
    assert plan_memory(real, ei.value.needed_gib, streams=4).streams == 4


def test_positions_shrink_only_when_nothing_fits(real):
    p = plan_memory(real, 23.2, thinker_positions=8192)  # one stream at 8192 positions needs ~24.2 GiB
    assert p.streams == 1 and mp.MIN_THINKER_POSITIONS <= p.thinker_positions < 8192
    assert any("shrunk" in n for n in p.notes)
    with pytest.raises(MemoryBudgetError):
        plan_memory(real, 23.2, thinker_positions=8192, shrink_positions=False)
    assert plan_memory(real, 141, thinker_positions=8192).thinker_positions == 8192


def test_window_follows_the_positions(real):
    assert plan_memory(real, 141, streams=1, thinker_positions=2048).window() == (1920, 1420)
    assert plan_memory(real, 141, streams=1, thinker_positions=8192).window() is None


@pytest.mark.parametrize("kw", [dict(dtype="int4"), dict(quantization="int4"), dict(streams=0), dict(streams=65),
                                dict(thinker_positions=100), dict(graph_rows=3)])
def test_bad_arguments_are_layout_errors(real, kw):
    with pytest.raises(LayoutError):
        plan_memory(real, 80, **kw)
    with pytest.raises(LayoutError):
        plan_memory(real, -1)


def test_graph_rows_follow_the_streams(real):
    assert plan_memory(real, 141, streams=3).graph_rows == 4
    assert plan_memory(real, 141, streams=40).graph_rows == 16
    assert plan_memory(real, 141, streams=1).graph_rows == 1


# ------------------------------------------------------------------------------------------ options


def test_serve_memory_option_parses_into_the_settings():
    from duplexkit.cli import build_parser
    from duplexkit.cli.serve import _settings_from_args
    from duplexkit.settings import ServerSettings

    args = build_parser().parse_args(["serve", "tiny", "--memory", "24"])
    assert args.memory == 24.0 and _settings_from_args(args)["memory_gib"] == 24.0
    assert _settings_from_args(build_parser().parse_args(["serve", "tiny"]))["memory_gib"] is None
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["serve", "tiny", "--memory", "0"])
    assert ei.value.code == 2
    with pytest.raises(ValueError):
        ServerSettings(memory_gib=0)


def test_serve_caps_max_sessions_at_the_planned_streams():
    from duplexkit.cli.serve import _planned_sessions

    ns = argparse.Namespace(model="tiny", layout="cpu", dtype=None, weights_seed=0)
    plan = mp.plan_memory(mp.model_sizes_for(str(_tiny_dir())), 4, dtype="float32", att_cache_bytes=4)
    assert _planned_sessions(ns, 4, 8) == min(8, plan.streams) and plan.streams < 8
    assert _planned_sessions(ns, 4, 1) == 1
    with pytest.raises(PreflightError, match="scripted"):  # a usage error (exit 2), before anything loads
        _planned_sessions(argparse.Namespace(model="scripted", layout=None, dtype=None, weights_seed=0), 4, 8)
    with pytest.raises(MemoryBudgetError):
        _planned_sessions(ns, 1, 8)


def test_load_engine_refuses_memory_for_an_engine_plugin():
    from duplexkit.engine.loading import load_engine

    with pytest.raises(PreflightError, match="--memory"):
        load_engine("scripted", memory_gib=4, progress=False)
    with pytest.raises(PreflightError, match="--quantization"):
        load_engine("scripted", quantization="int8", progress=False)
    assert load_engine("scripted", quantization="none", progress=False).model_id == "scripted"


def test_plan_memory_command(capsys):
    from duplexkit.cli import main

    assert main(["plan-memory", "--memory", "24", "--quantization", "int8"]) == 0
    out = capsys.readouterr().out
    assert "budget 24 GiB" in out and re.search(r"\b5 stream slots\b", out), out
    assert main(["plan-memory", "--memory", "16"]) == 2
    err = capsys.readouterr().err
    assert "the weights alone" in err and "over budget" in err
    assert main(["plan-memory", "tiny", "--memory", "4", "--dtype", "float32", "--json"]) == 0
    assert '"streams"' in capsys.readouterr().out
    with pytest.raises(SystemExit) as ei:
        main(["plan-memory", "--memory", "x"])
    assert ei.value.code == 2


def test_gpu_engine_memory_option(capsys):
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_engine_mem", ROOT / "benchmarks" / "gpu_engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as ei:
        mod.main(["--memory", "0", "--device", "cpu"])
    assert ei.value.code == 2 and "--memory" in capsys.readouterr().err
    # refused with the plan's table before any weight is built
    assert mod.main(["--size", "tiny", "--device", "cpu", "--memory", "1", "--streams", "2"]) == 2
    assert "do not fit" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ engine


def _tiny_dir():
    from duplexkit.engine.engine import tiny_checkpoint_dir

    return tiny_checkpoint_dir(0)


def test_tiny_engine_on_the_cpu_honours_the_planned_slot_cap():
    from duplexkit.engine import DuplexEngine
    from duplexkit.engine.api import StreamConfig
    from duplexkit.errors import EngineCapacityError

    eng = DuplexEngine.from_pretrained("tiny", layout="cpu", memory_gib=4, progress=False)

    async def go():
        n = eng.memory_plan.streams
        assert eng.max_streams == n and 1 <= n < 8
        assert all(eng.layout.stages[s].max_num_seqs == n for s in ("thinker", "talker", "code2wav"))
        assert eng.model.thinker.policy_defaults["window_high"] == eng.memory_plan.thinker_positions - mp.WINDOW_MARGIN
        w = sum(p.numel() * p.element_size() for p in eng.model.thinker.m.parameters())
        assert w == _item(eng.memory_plan, "weights thinker").bytes
        streams = [await eng.open_stream(f"s{i}", StreamConfig(output_audio=False)) for i in range(n)]
        with pytest.raises(EngineCapacityError) as ei:
            await eng.open_stream("one-more", StreamConfig(output_audio=False))
        assert ei.value.code == "session_capacity_exhausted"
        await streams[0].aclose()
        again = await eng.open_stream("again", StreamConfig(output_audio=False))
        for s in [again, *streams[1:]]:
            await s.aclose()
        await eng.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_quantized_tiny_engine_holds_the_weight_bytes_its_plan_counts(mode):
    """The planner's quantized weight rows against what the quantized build really holds (tiny, CPU)."""
    from duplexkit.engine import DuplexEngine
    from duplexkit.models.minicpmo45.quantization import QuantLinear, weight_bytes

    eng = DuplexEngine.from_pretrained("tiny", layout="cpu", memory_gib=4, quantization=mode, progress=False)
    try:
        assert eng.memory_plan.quantization == mode
        assert eng.model.quantization["thinker"].mode == mode and eng.model.quantization["thinker"].layers > 0
        m = eng.model.thinker.m
        held = sum(p.numel() * p.element_size() for p in m.parameters()) + sum(  # parameters + 8-bit weights, scales
            weight_bytes(q) - sum(p.numel() * p.element_size() for p in q.parameters())
            for q in m.modules() if isinstance(q, QuantLinear))
        assert held == _item(eng.memory_plan, "weights thinker").bytes
    finally:
        asyncio.run(eng.aclose())


def test_tiny_engine_refuses_a_budget_below_one_stream():
    from duplexkit.engine import DuplexEngine

    with pytest.raises(MemoryBudgetError, match="need at least"):
        DuplexEngine.from_pretrained("tiny", layout="cpu", memory_gib=1, progress=False)


def test_capped_kv_pool_refuses_beyond_its_slots():
    from duplexkit.models.minicpmo45.fast_kv import KVCapacityError, KVPool

    pool = KVPool(1, 1, 4, 8, dtype=torch.float32, device="cpu", slots=1, max_slots=2)
    assert pool.reserve(5) and pool.n_slots == 2
    a, b = pool.alloc(), pool.alloc()
    with pytest.raises(KVCapacityError) as ei:
        pool.alloc()
    assert ei.value.code == "session_capacity_exhausted" and pool.n_slots == 2
    pool.release(a)
    assert pool.alloc() == a and b != a


def test_plan_fast_options_reach_the_fast_paths(tiny):
    """A memory plan's fast options build the fast thinker / talker / Code2Wav to the plan (CPU)."""
    from duplexkit.models.minicpmo45.random_init import build_random_model

    p = plan_memory(tiny, 8, dtype="float32", streams=3, thinker_positions=512)
    m = build_random_model("tiny", dtype=torch.float32, device="cpu", fast=True, with_code2wav=False,
                           fast_options=mp.fast_options(p))
    assert m.thinker.pool.max_len == 512 and m.thinker.pool.n_slots == 3 and m.thinker.pool.max_slots == 3
    assert m.thinker.whisper_pool.max_slots == 3 and m.talker.pool.grow_by == 1 and m.talker.pool.n_slots == 3


# ------------------------------------------------------------------------------------------ docs


def test_docs_sizing_table_is_current(real):
    """docs/memory.md holds the table `duplexkit plan-memory --table --memory 24,48,80,141` prints."""
    text = (ROOT / "docs" / "memory.md").read_text()
    m = re.search(r"<!-- sizing-table: begin -->\n(.*?)\n<!-- sizing-table: end -->", text, re.S)
    assert m, "docs/memory.md lost its sizing-table markers"
    want = mp.sizing_table(real, (24, 48, 80, 141))
    assert m.group(1).strip() == want, "run: python -m duplexkit plan-memory --table --memory 24,48,80,141"


def test_docs_example_plan_is_current(real):
    """docs/memory.md's example is what `duplexkit plan-memory --memory 24 --quantization int8` prints."""
    text = (ROOT / "docs" / "memory.md").read_text()
    m = re.search(r"--quantization int8` prints:\n\n```\n(.*?)\n```", text, re.S)
    assert m and m.group(1) == plan_memory(real, 24, quantization="int8").table()
