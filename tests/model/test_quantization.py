"""Quantized weights (duplexkit/models/minicpmo45/quantization.py) on the CPU with the tiny
checkpoint: the quantized thinker and talker against the float32 path (relative logit error,
greedy agreement), the fast paths over quantized layers against the eager ones, the module shapes
and dtypes, the memory report, AutoAWQ 4-bit checkpoints and the typed errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from duplexkit.models.minicpmo45 import DuplexPolicy, UnitInput, load
from duplexkit.models.minicpmo45.quant_check import compare_logits, talker_check, thinker_checks
from duplexkit.models.minicpmo45.quantization import (AWQ_ORDER, QuantizationError, QuantLinear, QuantReport,
                                                      awq_dequantize, awq_pack, parse_mode, quantize_weight,
                                                      slow_kernel_warning)

# Bounds measured on the tiny checkpoint (docs/model.md "Quantized weights": int8 1.4 % / fp8 7.7 %
# thinker prefill, 0.3 % / 1.5 % talker), with headroom; a wrong scale on one layer breaks them.
BOUNDS = {"int8": dict(rel=0.03, agree=0.9, talker_rel=0.01, talker_agree=0.95),
          "fp8": dict(rel=0.12, agree=0.7, talker_rel=0.04, talker_agree=0.85)}
PROMPT = "Hello there, how are you doing today? Tell me a story about a cat."


@pytest.fixture(scope="module")
def quantized(tiny_dir):
    return {m: load(tiny_dir, progress=False, with_code2wav=False, quantization=m) for m in ("int8", "fp8")}


def _ids(model):
    return model.tokenizer(PROMPT)["input_ids"]


def _hidden(model, ids):
    th = model.thinker
    with torch.inference_mode():
        return th.forward_embeds(th.embed_ids(ids), th.new_cache()).float()


# ---------------------------------------------------------------------------------------------- weights


def test_int8_weight_rounding_is_within_half_a_step_per_row():
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different ranges
    q, s = quantize_weight(w, "int8")
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (48,)
    assert int(q.abs().max()) == 127
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7).all())


def test_fp8_weight_rounding_is_within_e4m3_precision():
    w = torch.randn(32, 64) * torch.logspace(-2, 2, 32)[:, None]
    q, s = quantize_weight(w, "fp8")
    assert q.dtype == torch.float8_e4m3fn and s.shape == (32,)
    assert float(q.float().abs().amax(1).min()) == 448.0  # each row's largest value maps to e4m3's max
    deq = q.float() * s[:, None]
    normal = w.abs() >= s[:, None] * 2 ** -6  # e4m3 normal range: 3 mantissa bits -> rel. error <= 2^-4
    assert bool(((deq - w).abs() <= w.abs() * 2 ** -4 + 1e-9)[normal].all())


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quant_linear_matches_the_dequantized_product(mode):
    lin = nn.Linear(64, 48, bias=True).requires_grad_(False)
    ql = QuantLinear.from_linear(lin, mode)
    x = torch.randn(2, 5, 64)
    y = ql(x)
    assert y.shape == (2, 5, 48) and y.dtype == torch.float32
    ref = lin(x)
    rel = float((y - ref).norm() / ref.norm().detach())
    assert rel < (0.01 if mode == "int8" else 0.06)
    if mode == "int8":  # weight-only: exactly x · (q·s)^T + b up to float rounding
        exact = x @ ql.dequantized_weight().T + lin.bias
        torch.testing.assert_close(y, exact, atol=1e-5, rtol=1e-5)


def test_fused_quant_linear_equals_its_parts():
    parts = [QuantLinear.from_linear(nn.Linear(64, n, bias=False), "int8") for n in (32, 16, 16)]
    x = torch.randn(3, 64)
    separate = torch.cat([p(x) for p in parts], dim=-1)
    fused = QuantLinear.concat(parts)
    torch.testing.assert_close(fused(x), separate)
    assert parts[1].qweight.untyped_storage().data_ptr() == fused.qweight.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------- errors


def test_bad_mode_is_a_typed_error(tiny_dir):
    for bad in ("int4", "bf16", 8):
        with pytest.raises(QuantizationError, match="unknown quantization"):
            parse_mode(bad)
    assert parse_mode(None) == parse_mode("") == "none" and parse_mode("FP8") == "fp8"
    with pytest.raises(QuantizationError):
        load(tiny_dir, progress=False, with_code2wav=False, with_talker=False, quantization="int4")
    assert issubclass(QuantizationError, ValueError)
    with pytest.raises(QuantizationError, match="dtype"):
        QuantLinear(torch.zeros(4, 4), torch.ones(4), None, "int8", torch.float32)


# ---------------------------------------------------------------------------------------------- modules


def test_quantized_modules_shapes_dtypes_and_memory(tiny_model, quantized):
    ref_llm = tiny_model.thinker.m.llm
    for mode, m in quantized.items():
        llm = m.thinker.m.llm
        want = torch.int8 if mode == "int8" else torch.float8_e4m3fn
        saved = 0
        for i, layer in enumerate(llm.model.layers):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                q = layer.get_submodule(name)
                r = ref_llm.model.layers[i].get_submodule(name)
                assert isinstance(q, QuantLinear), name
                assert q.qweight.dtype == want and tuple(q.qweight.shape) == tuple(r.weight.shape)
                assert q.weight_scale.dtype == torch.float32 and q.weight_scale.shape == (r.weight.shape[0],)
                saved += r.weight.numel() * 4 - (q.qweight.numel() + q.weight_scale.numel() * 4)
        # kept in the stage dtype: lm_head, embeddings, norms, audio/vision towers, talker head/projector
        assert type(llm.lm_head) is nn.Linear and llm.lm_head.weight.dtype == torch.float32
        assert llm.model.embed_tokens.weight.dtype == torch.float32
        assert not any(isinstance(x, QuantLinear) for x in m.thinker.m.apm.modules())
        tk = m.talker
        assert all(isinstance(layer.mlp.down_proj, QuantLinear) for layer in tk.model.layers)
        assert type(tk.projector_semantic.linear1) is nn.Linear
        assert not any(isinstance(x, QuantLinear) for x in tk.head_code.modules())
        rep = m.quantization["thinker"]
        assert rep.layers == 7 * len(llm.model.layers)
        assert rep.bytes_before - rep.bytes_after == saved  # exactly the replaced weights' bytes
        assert m.quantization["talker"].bytes_after < m.quantization["talker"].bytes_before
    assert tiny_model.quantization == {}


def test_report_line_shows_what_was_saved(quantized):
    """A small stage's sizes can round to the same MiB: the line gives the bytes saved and the share."""
    rep = QuantReport("int8", 7, 1_866_696, 1_837_128, {"int8pack": 7})
    assert rep.line("talker") == ("talker: int8 on 7 linear layers (int8pack 7), weights 1.78 MiB -> 1.75 MiB "
                                  "(28.9 KiB saved, 1.6%)")
    for m in quantized.values():
        for stage, r in m.quantization.items():
            pct = 100 * (r.bytes_before - r.bytes_after) / r.bytes_before
            assert r.line(stage).endswith(f" saved, {pct:.1f}%)") and pct > 0


def test_a_slow_kernel_logs_one_warning_at_load(tiny_dir, caplog):
    """fp8 on the CPU runs emulated in float32: the load logs one warning saying so (stages, layer
    counts, what FP8 matmuls need); int8's dequant fallback gets one as well; fast kernels none."""
    with caplog.at_level("WARNING", logger="duplexkit.quantization"):
        m = load(tiny_dir, progress=False, with_code2wav=False, quantization="fp8")
    warns = [r.getMessage() for r in caplog.records if r.name == "duplexkit.quantization"]
    n_th, n_tk = m.quantization["thinker"].layers, m.quantization["talker"].layers
    assert len(warns) == 1, warns
    assert "fp8 runs emulated in float32" in warns[0] and "compute capability >= 8.9" in warns[0]
    assert f"thinker {n_th}/{n_th} layers, talker {n_tk}/{n_tk} layers" in warns[0]
    assert "slower than unquantized" in warns[0]
    assert slow_kernel_warning({"talker": QuantReport("int8", 7, 10, 5, {"int8pack": 7})}) is None
    w = slow_kernel_warning({"thinker": QuantReport("int8", 14, 10, 5, {"dequant": 2, "int8pack": 12})})
    assert w is not None and "int8 is dequantized before every matmul on thinker 2/14 layers" in w


def test_serve_help_says_what_fp8_does_on_the_cpu():
    from duplexkit.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and "serve" in a.choices).choices["serve"]
    text = " ".join(sub.format_help().split())
    assert "CUDA compute capability >= 8.9 with bfloat16: FP8 matmuls" in text
    assert "on the CPU: emulated in float32, for testing, not faster" in text


# ---------------------------------------------------------------------------------------------- quality


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_thinker_quality_against_float32(tiny_model, quantized, mode):
    b = BOUNDS[mode]
    pre, dec = thinker_checks(tiny_model.thinker, quantized[mode].thinker, _ids(tiny_model), steps=20)
    assert pre.rows == len(_ids(tiny_model)) and dec.rows == 20
    for chk in (pre, dec):
        assert 0 < chk.rel_err < b["rel"], chk
        assert chk.agreement >= b["agree"], chk
    if mode == "int8":
        assert dec.free_run == 20  # the whole greedy run is the reference's


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_talker_quality_against_float32(tiny_model, quantized, mode):
    b = BOUNDS[mode]
    ids = _ids(tiny_model)[:12]
    chk = talker_check(tiny_model.talker, quantized[mode].talker, ids, _hidden(tiny_model, ids), steps=25)
    assert chk.rows == 25
    assert 0 < chk.rel_err < b["talker_rel"], chk
    assert chk.agreement >= b["talker_agree"], chk


def test_a_wrong_scale_fails_the_quality_bounds(tiny_dir, tiny_model):
    """The checks can fail: one layer's scales off by 25 % breaks the int8 bounds."""
    m = load(tiny_dir, progress=False, with_code2wav=False, quantization="int8")
    down = m.thinker.m.llm.model.layers[0].mlp.down_proj
    with torch.no_grad():
        down.weight_scale.mul_(1.25)
    down._pick_kernel()
    pre, _ = thinker_checks(tiny_model.thinker, m.thinker, _ids(tiny_model), steps=4)
    assert pre.rel_err > BOUNDS["int8"]["rel"]
    tdown = m.talker.model.layers[0].mlp.down_proj
    with torch.no_grad():
        tdown.weight_scale.mul_(1.25)
    tdown._pick_kernel()
    ids = _ids(tiny_model)[:12]
    chk = talker_check(tiny_model.talker, m.talker, ids, _hidden(tiny_model, ids), steps=8)
    assert chk.rel_err > BOUNDS["int8"]["talker_rel"]


def test_compare_logits():
    r = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]])
    c = compare_logits("x", r, r.clone())
    assert c.rel_err == 0 and c.agreement == 1 and c.rows == 2
    c = compare_logits("x", r, torch.tensor([[1.0, 2.0, 0.0], [0.0, 3.0, 1.0]]))
    assert c.agreement == 0.5 and c.rel_err == pytest.approx(float(np.sqrt(18) / np.sqrt(15)))
    with pytest.raises(ValueError):
        compare_logits("x", r, r[:1])


# ---------------------------------------------------------------------------------------------- fast paths


def _units(k: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(16560 if i == 0 else 16000)).astype(np.float32) for i in range(k)]


def _duplex(th, units):
    st = th.new_stream(policy=DuplexPolicy(temperature=0.0, min_unit_tokens=8, max_unit_tokens=8))
    out = [th.step_units([UnitInput(st, u, force_speak=i == 0)])[0] for i, u in enumerate(units)]
    th.close(st)
    return out


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_fast_paths_over_quantized_layers_match_the_eager_ones(tiny_dir, mode):
    """FastThinker / FastTalker fuse the quantized q/k/v and gate/up layers; greedy ids equal the
    eager quantized paths'."""
    from duplexkit.models.minicpmo45.fast_talker import FastTalker
    from duplexkit.models.minicpmo45.fast_thinker import FastThinker
    from duplexkit.models.minicpmo45.talker import TalkerInput

    m = load(tiny_dir, progress=False, with_code2wav=False, quantization=mode)
    ft = FastThinker.from_thinker(m.thinker, cuda_graphs=False, slots=1)
    layer = m.thinker.m.llm.model.layers[0]
    assert isinstance(layer._dk_qkv, QuantLinear) and isinstance(layer._dk_gu, QuantLinear)
    assert "_dk_qkv" not in dict(layer.named_children())  # not a registered submodule
    units = _units(3, 1)
    ref, fast = _duplex(m.thinker, units), _duplex(ft, units)
    for a, b in zip(ref, fast):
        assert a.generated_ids == b.generated_ids
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    tk = m.talker
    ftk = FastTalker(tk, cuda_graphs=False, slots=1)
    rt, fturn = tk.new_turn(), ftk.new_turn()
    for k, r in enumerate(ref):
        kw = dict(token_ids=r.token_ids, hidden=r.hidden, turn_start=k == 0, turn_end=k == len(ref) - 1,
                  temperature=0.0)
        (a,) = tk.generate_units([TalkerInput(turn=rt, **kw)])
        (b,) = ftk.generate_units([TalkerInput(turn=fturn, **kw)])
        np.testing.assert_array_equal(a, b)


def test_quantizing_a_fused_decoder_is_refused(tiny_dir):
    from duplexkit.models.minicpmo45.fast_thinker import FastThinker
    from duplexkit.models.minicpmo45.quantization import quantize_thinker

    m = load(tiny_dir, progress=False, with_code2wav=False, with_talker=False)
    FastThinker.from_thinker(m.thinker, cuda_graphs=False, slots=1)
    with pytest.raises(QuantizationError, match="already fused"):
        quantize_thinker(m.thinker.m, "int8")


# ---------------------------------------------------------------------------------------------- AutoAWQ


def test_awq_packing_follows_the_autoawq_order():
    """Eight columns holding 0..7 pack into one int32 whose nibble i holds column AWQ_ORDER[i]:
    0x75316420, the AutoAWQ GEMM word."""
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    # W [out=8, in=16], one group: input 0 holds the output index, input 2 holds 15, the rest 0, so
    # every output's group spans 0..15: scale 1, zero point 0, and q[input 0, o] = o
    w = torch.zeros(8, 16)
    w[:, 0] = torch.arange(8.0)
    w[:, 2] = 15.0
    qw, qz, s = awq_pack(w, group_size=16)
    assert qw.dtype == torch.int32 and qw.shape == (16, 1) and qz.shape == (1, 1) and s.shape == (1, 8)
    assert int(qw[0, 0]) == 0x75316420 and int(qz[0, 0]) == 0 and int(qw[2, 0]) == -1  # 0xFFFFFFFF
    torch.testing.assert_close(awq_dequantize(qw, qz, s, 16), w)


def _write_awq_checkpoint(src, dst, group: int) -> list:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in list(dst.glob("*.safetensors*")):
        f.unlink()
    sd = load_file(str(src / "model.safetensors")) if (src / "model.safetensors").is_file() else None
    assert sd is not None, "the tiny builder writes one model.safetensors"
    layers = []
    out = {}
    for k, v in sd.items():
        parts = k.split(".")
        is_dec = k.endswith("_proj.weight") and (k.startswith("llm.model.layers.") or k.startswith("tts.model.layers."))
        if is_dec and v.shape[1] % group == 0 and v.shape[0] % 8 == 0:
            p = k[: -len(".weight")]
            out[p + ".qweight"], out[p + ".qzeros"], out[p + ".scales"] = awq_pack(v, group)
            layers.append(p)
        else:
            out[k] = v
        del parts
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return layers


@pytest.fixture(scope="module")
def awq_dir(tiny_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("awq") / "ckpt"
    layers = _write_awq_checkpoint(tiny_dir, dst, group=32)
    assert any(p.startswith("llm.") for p in layers) and any(p.startswith("tts.") for p in layers)
    return dst


def test_awq_checkpoint_loads_as_its_dequantized_weights(awq_dir, tiny_model):
    from safetensors.torch import load_file

    m = load(awq_dir, progress=False, with_code2wav=False)
    sd = load_file(str(awq_dir / "model.safetensors"))
    p = "llm.model.layers.1.mlp.down_proj"
    want = awq_dequantize(sd[p + ".qweight"], sd[p + ".qzeros"], sd[p + ".scales"], 32)
    got = m.thinker.m.llm.model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(got, want)
    orig = tiny_model.thinker.m.llm.model.layers[1].mlp.down_proj.weight
    step = sd[p + ".scales"].float().repeat_interleave(32, dim=0).T  # per-element quantization step
    # within one 4-bit step of the original (half a step from rounding, half from the integer zero point)
    assert bool(((got - orig).abs() <= step + 1e-6).all())
    tw = m.talker.model.layers[0].self_attn.q_proj.weight
    assert tw.shape == tiny_model.talker.model.layers[0].self_attn.q_proj.weight.shape
    # logits follow the unquantized model's (4-bit groups of 32 on random weights: a coarse bound)
    pre, dec = thinker_checks(tiny_model.thinker, m.thinker, _ids(tiny_model), steps=8)
    assert pre.rel_err < 0.25 and pre.agreement >= 0.6
    # and it can be re-quantized to int8 on load
    m8 = load(awq_dir, progress=False, with_code2wav=False, with_talker=False, quantization="int8")
    assert isinstance(m8.thinker.m.llm.model.layers[1].mlp.down_proj, QuantLinear)


def test_awq_checkpoint_errors(awq_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from duplexkit.models.minicpmo45 import CheckpointError

    bad = tmp_path / "bad"
    shutil.copytree(awq_dir, bad)
    sd = load_file(str(bad / "model.safetensors"))
    p = "llm.model.layers.0.self_attn.o_proj"
    sd[p + ".scales"] = sd[p + ".scales"][:, :-8].contiguous()
    del sd["llm.model.layers.0.mlp.up_proj.qzeros"]
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as ei:
        load(bad, progress=False, with_code2wav=False)
    assert p + ".scales" in str(ei.value) and "llm.model.layers.0.mlp.up_proj.qzeros" in str(ei.value)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gptq"):
        load(bad, progress=False, with_code2wav=False)


# ---------------------------------------------------------------------------------------------- capturable


_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


@pytest.fixture
def no_host_reads(monkeypatch):
    """Every way a tensor's value reaches the host (what would sync a CUDA stream and break a CUDA-graph
    capture) raises while the fixture is active."""
    def trap(name):
        def f(self, *a, **k):
            raise AssertionError(f"host read Tensor.{name} inside a captured forward")
        return f

    def arm():
        for name in _HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, trap(name))
    return arm


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_forward_reads_nothing_back_to_the_host(tiny_dir, no_host_reads, mode):
    """A QuantLinear forward and a whole fast-path decoder step over quantized layers (what the CUDA
    graphs capture) run without reading a tensor value on the host."""
    from duplexkit.models.minicpmo45.fast_thinker import FastThinker

    m = load(tiny_dir, progress=False, with_code2wav=False, with_talker=False, quantization=mode)
    ft = FastThinker.from_thinker(m.thinker, cuda_graphs=False, slots=1)
    H = ft.hidden_size
    x = torch.randn(2, 1, H)
    pos = torch.tensor([[5], [9]])
    slots = torch.full((2,), ft.pool.scratch, dtype=torch.long)
    ql = m.thinker.m.llm.model.layers[0].mlp.down_proj
    xin = torch.randn(3, ql.in_features)
    no_host_reads()
    with torch.inference_mode():
        ql(xin)
        h, logits = ft._forward_eager(x, pos, slots, 256)
    assert h.shape == (2, 1, H) and logits.shape[0] == 2


def test_the_host_read_trap_catches_a_sync(no_host_reads):
    no_host_reads()
    with pytest.raises(AssertionError, match="host read"):
        float(torch.ones(1).max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quant_linear_captures_in_a_cuda_graph(mode):
    from duplexkit.models.minicpmo45.quantization import fp8_supported

    dev = torch.device("cuda")
    if mode == "fp8" and not fp8_supported(dev):
        with pytest.raises(QuantizationError, match="8.9"):
            QuantLinear.from_linear(nn.Linear(256, 128, bias=False).to(dev, torch.bfloat16), mode)
        return
    ql = QuantLinear.from_linear(nn.Linear(256, 128, bias=False).to(dev, torch.bfloat16).requires_grad_(False), mode)
    assert ql.kernel in (("int8pack", "dequant") if mode == "int8" else ("scaled_mm",))
    x = torch.randn(4, 256, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        eager = ql(x)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ql(x)  # warm-up off the default stream, as capture_graph does
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = ql(x)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.testing.assert_close(out, ql(x))
    assert eager.shape == (4, 128)


def test_random_model_quantizes_the_same_random_weights():
    """build_random_model(quantization=...) draws the same weights as the unquantized build of the
    same seed, then quantizes them (the benchmarks compare like for like)."""
    from duplexkit.models.minicpmo45.random_init import build_random_model

    kw = dict(dtype=torch.float32, device="cpu", with_code2wav=False, fast=False, seed=3)
    ref = build_random_model("tiny", **kw)
    q = build_random_model("tiny", quantization="int8", **kw)
    assert q.quantization["thinker"].mode == "int8" and ref.quantization == {}
    a = ref.thinker.m.llm.model.layers[1].self_attn.o_proj.weight
    b = q.thinker.m.llm.model.layers[1].self_attn.o_proj
    qw, s = quantize_weight(a, "int8")
    assert torch.equal(b.qweight, qw) and torch.equal(b.weight_scale, s)
    tq = q.talker.model.layers[0].mlp.up_proj
    assert torch.equal(tq.qweight, quantize_weight(ref.talker.model.layers[0].mlp.up_proj.weight, "int8")[0])
    with pytest.raises(QuantizationError):
        build_random_model("tiny", quantization="nf4", **kw)


def test_quant_linear_follows_to():
    """``.to()`` keeps the layer working: the kernel (and its cached scale) follow the buffers."""
    ql = QuantLinear.from_linear(nn.Linear(64, 32, bias=False).requires_grad_(False), "int8")
    x = torch.randn(2, 64)
    before = ql(x)
    ql.to(torch.device("cpu"))
    torch.testing.assert_close(ql(x), before)
    assert ql.kernel in ("int8pack", "dequant")
    for mode in ("int8", "fp8"):
        q = QuantLinear.from_linear(nn.Linear(64, 32, bias=False).requires_grad_(False), mode)
        with pytest.raises(QuantizationError, match="cannot be cast"):
            q.to(torch.bfloat16)
