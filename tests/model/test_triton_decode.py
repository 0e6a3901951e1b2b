"""The Triton decode kernels (duplexkit/models/minicpmo45/triton_decode.py) against the torch path of
fast_kv.py, and decoder_forward with DUPLEXKIT_TRITON_DECODE on against off.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before anything imports triton); with CUDA they are compiled and run on the GPU (then
bf16 is covered as well, and a CUDA-graph capture). Tolerances (max abs error on O(1) values):
fp32 1e-4 (reduction order only), bf16 2e-2 for one op (the torch path rounds to bf16 between its
element-wise ops, the kernels once at the end) and 6e-2 for a whole two-layer forward. Under the
interpreter (triton 3.5) fp32 -> bf16 conversions truncate instead of rounding to nearest, which
these tolerances cover; the residual sum ``x + y`` is checked bit-exact on CUDA only.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
# without CUDA, tests/conftest.py has set TRITON_INTERPRET=1 before anything imported triton
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1 (tests/conftest.py sets it unless told otherwise)",
                allow_module_level=True)

triton = pytest.importorskip("triton")

from duplexkit.models.minicpmo45 import fast_kv  # noqa: E402
from duplexkit.models.minicpmo45.fast_kv import KVPool, attention_bias, decoder_forward, fuse_projections  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True, scope="module")
def _interpreter_numpy_fix():
    """Triton 3.5's interpreter turns a scalar into a Python int through ``int(1-element array)``,
    which NumPy >= 2.3 refuses; loops with tensor bounds need it. Patched for this module only."""
    if CUDA:
        yield
        return
    import triton.runtime.interpreter as ti

    orig = ti._patch_lang_tensor

    def patched(tensor, *args, **kwargs):  # the signature differs between Triton versions
        orig(tensor, *args, **kwargs)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    ti._patch_lang_tensor = patched
    yield
    ti._patch_lang_tensor = orig


@pytest.fixture(scope="module")
def td():
    from duplexkit.models.minicpmo45 import triton_decode

    return triton_decode


def _cache(S, L, hkv, D, dtype, gen):
    kc = torch.randn(S + 1, L, hkv, D, generator=gen).to(DEV, dtype)
    vc = torch.randn(S + 1, L, hkv, D, generator=gen).to(DEV, dtype)
    return kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,hkv,D", [(8, 2, 32), (4, 4, 16)])
@pytest.mark.parametrize("n_split", [0, 1, 4])
def test_decode_attention_matches_sdpa_path(td, dtype, H, hkv, D, n_split):
    gen = torch.Generator().manual_seed(H * 100 + D + n_split)
    S, L, kv_len = 3, 300, 256
    kc, vc = _cache(S, L, hkv, D, dtype, gen)
    # rows: two real slots at different positions, a row at position 0, a padding row in the scratch slot
    slots = torch.tensor([2, 0, 1, S], device=DEV)
    pos = torch.tensor([37, 255, 0, 0], device=DEV)
    B = slots.shape[0]
    q = torch.randn(B, 1, H, D, generator=gen).to(DEV, dtype)
    kn = torch.randn(B, 1, hkv, D, generator=gen).to(DEV, dtype)
    vn = torch.randn(B, 1, hkv, D, generator=gen).to(DEV, dtype)
    kr, vr = kc.clone(), vc.clone()
    bias = attention_bias(pos[:, None], kv_len, H // hkv, dtype)
    ref = fast_kv._attention(q, kn, vn, kr, vr, slots, pos[:, None], kv_len, D ** -0.5, bias)[:, 0]
    kc[slots, pos] = kn[:, 0]
    vc[slots, pos] = vn[:, 0]
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    k0, v0 = kc.clone(), vc.clone()
    out = td.decode_attention(q[:, 0], kc, vc, slots, pos, kv_len, D ** -0.5, n_split=n_split)
    assert out.shape == (B, H * D) and out.dtype == dtype
    assert torch.equal(kc, k0) and torch.equal(vc, v0)  # the pool is only read
    err = (out.float() - ref.float()).abs().max().item()
    assert err < TOL[dtype], err


def test_decode_attention_long_context_splits(td):
    """Many splits, one row far into a long slot, fp32: against a float64 softmax reference."""
    gen = torch.Generator().manual_seed(7)
    H, hkv, D, S, L = 4, 2, 16, 2, 1100
    kc, vc = _cache(S, L, hkv, D, torch.float32, gen)
    slots = torch.tensor([1, 0], device=DEV)
    pos = torch.tensor([1029, 64], device=DEV)
    q = torch.randn(2, H, D, generator=gen).to(DEV)
    out = td.decode_attention(q, kc, vc, slots, pos, 1088, D ** -0.5, n_split=9)
    for b in range(2):
        K = kc[slots[b], : pos[b] + 1].double().repeat_interleave(H // hkv, dim=1)  # [n, H, D]
        V = vc[slots[b], : pos[b] + 1].double().repeat_interleave(H // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), K) * D ** -0.5, dim=-1)
        ref = torch.einsum("hn,nhd->hd", w, V).reshape(-1)
        assert (out[b].double() - ref).abs().max().item() < 1e-5


def test_strided_slots_and_pos_are_read_by_row(td):
    """``slots`` / ``pos`` as column views of a [B, 2] table (stride 2): row b's own values are used
    (the kernels index ``ptr + b``; a strided view read that way gives another row's values or
    an out-of-range slot)."""
    gen = torch.Generator().manual_seed(5)
    H, hkv, D, S, L = 4, 2, 16, 2, 100
    kc, vc = _cache(S, L, hkv, D, torch.float32, gen)
    q = torch.randn(2, H, D, generator=gen).to(DEV)
    table_s = torch.tensor([[0, 9], [1, 9]], device=DEV)  # 9: no such slot
    table_p = torch.tensor([[5, 90], [40, 3]], device=DEV)
    slots, pos = table_s[:, 0], table_p[:, 1]
    assert slots.stride(0) == 2
    ref = td.decode_attention(q, kc, vc, slots.clone(), pos.clone(), L, D ** -0.5)
    out = td.decode_attention(q, kc, vc, slots, pos, L, D ** -0.5)
    assert torch.equal(out, ref)
    k = torch.randn(2, hkv, D, generator=gen).to(DEV)
    v = torch.randn(2, hkv, D, generator=gen).to(DEV)
    cs = torch.ones(2, D, device=DEV)
    sn = torch.zeros(2, D, device=DEV)
    kr, vr = kc.clone(), vc.clone()
    td.qk_norm_rope_write(q, k, v, cs, sn, None, None, 0.0, kr, vr, slots.clone(), pos.clone())
    td.qk_norm_rope_write(q, k, v, cs, sn, None, None, 0.0, kc, vc, slots, pos)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_decode_attention_rejects_bad_shapes(td):
    kc = torch.zeros(2, 8, 3, 16, device=DEV)
    q = torch.zeros(1, 4, 16, device=DEV)
    one = torch.zeros(1, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError):
        td.decode_attention(q, kc, kc, one, one, 8, 0.25)  # 4 q-heads over 3 kv-heads
    with pytest.raises(ValueError):
        td.decode_attention(torch.zeros(1, 3, 24, device=DEV), torch.zeros(2, 8, 3, 24, device=DEV),
                            torch.zeros(2, 8, 3, 24, device=DEV), one, one, 8, 0.25)  # D not a power of two


def test_num_splits_cover_the_range(td):
    for B in (1, 8, 32, 64):
        for kv_len in (1, 64, 256, 2048, 8192):
            n, chunk = td.num_splits(B, 8, kv_len, 132)
            assert n >= 1 and chunk % td.BLOCK_N == 0 and n * chunk >= kv_len and (n - 1) * chunk < kv_len


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_write_matches_torch(td, dtype, norm):
    gen = torch.Generator().manual_seed(3 + norm)
    H, hkv, D, S, L = 4, 2, 32, 3, 40
    B = 3
    kc, vc = _cache(S, L, hkv, D, dtype, gen)
    slots = torch.tensor([1, S, 0], device=DEV)
    pos = torch.tensor([5, 0, 39], device=DEV)
    qkv = torch.randn(B, H + 2 * hkv, D, generator=gen).to(DEV, dtype)  # as the fused QKV output's view
    q, k, v = qkv[:, :H], qkv[:, H: H + hkv], qkv[:, H + hkv:]
    ang = torch.rand(B, D // 2, generator=gen).to(DEV) * 6.0
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    gq = (1 + 0.1 * torch.randn(D, generator=gen)).to(DEV, dtype) if norm else None
    gk = (1 + 0.1 * torch.randn(D, generator=gen)).to(DEV, dtype) if norm else None

    def ref(x, g):
        x = x.float()
        if g is not None:
            x = F.rms_norm(x, (D,), g.float(), 1e-6)
        c, s = cos.float()[:, None], sin.float()[:, None]
        return x * c + fast_kv._rotate_half(x) * s

    kr, vr = kc.clone(), vc.clone()
    kr[slots, pos] = ref(k, gk).to(dtype)
    vr[slots, pos] = v
    out = td.qk_norm_rope_write(q, k, v, cos, sin, gq, gk, 1e-6, kc, vc, slots, pos)
    assert out.shape == (B, H, D) and out.dtype == dtype
    assert (out.float() - ref(q, gq)).abs().max().item() < TOL[dtype]
    assert torch.equal(vc, vr)
    assert (kc.float() - kr.float()).abs().max().item() < TOL[dtype]
    mask = torch.ones(S + 1, L, dtype=torch.bool, device=DEV)
    mask[slots, pos] = False
    assert torch.equal(kc[mask], kr[mask])  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [48, 64])
def test_add_rms_norm_matches_torch(td, dtype, N):
    gen = torch.Generator().manual_seed(N)
    x = torch.randn(3, 2, N, generator=gen).to(DEV, dtype)
    y = torch.randn(3, 2, N, generator=gen).to(DEV, dtype)
    w = (1 + 0.1 * torch.randn(N, generator=gen)).to(DEV, dtype)
    s, h = td.add_rms_norm(x, y, w, 1e-6)
    s_ref = x + y
    if CUDA or dtype == torch.float32:
        assert torch.equal(s, s_ref)
    else:  # the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest): one bf16 ulp
        assert ((s.float() - s_ref.float()).abs() <= s_ref.float().abs() * 2 ** -7).all()
    h_ref = F.rms_norm(s_ref.float(), (N,), w.float(), 1e-6)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -6  # two bf16 ulps: h reaches |3|
    torch.testing.assert_close(h.float(), h_ref, atol=TOL[dtype], rtol=rtol)
    with pytest.raises(ValueError):
        td.add_rms_norm(x, y[:, :1], w, 1e-6)


# ---------------------------------------------------------------- decoder_forward, flag on vs off

def _model(kind: str, dtype, device=DEV):
    from transformers import LlamaConfig, LlamaModel, Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    kw = dict(vocab_size=8, hidden_size=48, intermediate_size=64, num_hidden_layers=2, rms_norm_eps=1e-6,
              max_position_embeddings=512)
    if kind.startswith("llama"):  # the talker's layout: no GQA, no q/k norm
        m = LlamaModel(LlamaConfig(num_attention_heads=3, num_key_value_heads=3, head_dim=16, **kw))
    else:
        m = Qwen3Model(Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, **kw))
    m = m.to(device, dtype).eval()
    with torch.no_grad():  # non-trivial norm gains
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    if kind.endswith(("-int8", "-fp8")):  # quantized decoder linears (quantization.py), fused as QuantLinear
        from duplexkit.models.minicpmo45.quantization import quantize_linears

        mode = kind.rsplit("-", 1)[1]
        quantize_linears(m, mode, lambda name, _m: name.startswith("layers."))
    if kind != "qwen3-unfused":
        fuse_projections(m)
    return m


def _run(model, pool, steps, monkeypatch, on: bool):
    """decoder_forward over ``steps`` with the flag ``on`` / off; checks which path ran."""
    from duplexkit.models.minicpmo45 import triton_decode

    monkeypatch.setattr(fast_kv, "_TRITON_DECODE", on)
    monkeypatch.setattr(fast_kv, "_TRITON_ON_CPU", not CUDA)
    calls = []
    orig = triton_decode.decode_attention
    monkeypatch.setattr(triton_decode, "decode_attention", lambda *a, **k: calls.append(1) or orig(*a, **k))
    outs = []
    for x, pos, slots, kv_len in steps:
        outs.append(decoder_forward(model, x, pos, slots, pool, kv_len))
    n_decode = sum(x.shape[1] == 1 for x, *_ in steps) * model.config.num_hidden_layers
    assert len(calls) == (n_decode if on else 0)
    monkeypatch.setattr(triton_decode, "decode_attention", orig)
    return outs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-unfused", "llama", "qwen3-int8", "llama-fp8"])
def test_decoder_forward_flag_on_equals_off(kind, dtype, monkeypatch):
    model = _model(kind, dtype)
    cfg = model.config
    hd = cfg.head_dim
    pool = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, hd, 192, dtype=dtype, device=DEV, slots=3)
    gen = torch.Generator().manual_seed(11)
    # a prefill of two streams (T = 5), then three one-token steps with a padding row in the scratch slot
    steps = [(torch.randn(2, 5, 48, generator=gen).to(DEV, dtype),
              torch.tensor([[0, 1, 2, 3, 4], [60, 61, 62, 63, 64]], device=DEV), torch.tensor([0, 2], device=DEV), 128)]
    for s in range(3):
        steps.append((torch.randn(3, 1, 48, generator=gen).to(DEV, dtype),
                      torch.tensor([[5 + s], [65 + s], [0]], device=DEV),
                      torch.tensor([0, 2, pool.scratch], device=DEV), 128))
    k0, v0 = pool.k.clone(), pool.v.clone()
    with torch.no_grad():
        off = _run(model, pool, steps, monkeypatch, False)
        k_off, v_off = pool.k.clone(), pool.v.clone()
        pool.k.copy_(k0)
        pool.v.copy_(v0)
        on = _run(model, pool, steps, monkeypatch, True)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    for a, b in zip(off, on):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a.float() - b.float()).abs().max().item() < tol
    real = torch.arange(pool.n_slots, device=DEV)  # the scratch slot's contents are not compared
    assert (k_off[:, real].float() - pool.k[:, real].float()).abs().max().item() < tol
    assert (v_off[:, real].float() - pool.v[:, real].float()).abs().max().item() < tol


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA")
def test_triton_decode_step_captures_in_a_cuda_graph(monkeypatch):
    monkeypatch.setattr(fast_kv, "_TRITON_DECODE", True)
    model = _model("qwen3", torch.bfloat16)
    cfg = model.config
    pool = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 1024, dtype=torch.bfloat16,
                  device=DEV, slots=4)
    pool.k.normal_()
    pool.v.normal_()
    x = torch.randn(4, 1, 48, device=DEV, dtype=torch.bfloat16)
    pos = torch.zeros(4, 1, dtype=torch.long, device=DEV)
    slots = torch.full((4,), pool.scratch, dtype=torch.long, device=DEV)
    with torch.no_grad():
        graph, out = fast_kv.capture_graph(lambda: decoder_forward(model, x, pos, slots, pool, 1024), DEV)
        pos.copy_(torch.tensor([[700], [3], [1000], [0]]))
        slots.copy_(torch.tensor([0, 1, 3, pool.scratch]))
        x.normal_()
        k0, v0 = pool.k.clone(), pool.v.clone()
        graph.replay()
        got = out.clone()
        pool.k.copy_(k0)
        pool.v.copy_(v0)
        eager = decoder_forward(model, x, pos, slots, pool, 1024)
    # the same kernels replayed: equal up to cuBLAS picking another GEMM algorithm under capture
    torch.testing.assert_close(got.float(), eager.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernels_launch_on_the_tensors_device_from_a_stage_thread(monkeypatch):
    """The ``2gpu`` layout's talker is on cuda:1 and runs on a stage thread, whose current device is
    0. Triton launches on the current device, so the kernels must switch to the tensors' device: a
    decode step (eager and captured with capture_graph) equals the torch path on cuda:1."""
    import threading

    dev = torch.device("cuda:1")
    monkeypatch.setattr(fast_kv, "_TRITON_DECODE", True)
    model = _model("llama", torch.bfloat16, dev)
    cfg = model.config
    pool = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 512, dtype=torch.bfloat16,
                  device=dev, slots=3)
    pool.k.normal_()
    pool.v.normal_()
    x = torch.randn(3, 1, 48, device=dev, dtype=torch.bfloat16)
    pos = torch.tensor([[300], [7], [0]], device=dev)
    slots = torch.tensor([0, 2, pool.scratch], device=dev)
    k0, v0 = pool.k.clone(), pool.v.clone()
    res = {}

    def run():
        try:
            assert torch.cuda.current_device() == 0
            with torch.no_grad():
                monkeypatch.setattr(fast_kv, "_TRITON_DECODE", False)
                res["ref"] = decoder_forward(model, x, pos, slots, pool, 512).clone()
                monkeypatch.setattr(fast_kv, "_TRITON_DECODE", True)
                pool.k.copy_(k0)
                pool.v.copy_(v0)
                res["eager"] = decoder_forward(model, x, pos, slots, pool, 512).clone()
                pool.k.copy_(k0)
                pool.v.copy_(v0)
                graph, out = fast_kv.capture_graph(lambda: decoder_forward(model, x, pos, slots, pool, 512), dev)
                pool.k.copy_(k0)
                pool.v.copy_(v0)
                graph.replay()
                res["graph"] = out.clone()
            torch.cuda.synchronize(dev)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            res["error"] = exc

    th = threading.Thread(target=run)
    th.start()
    th.join()
    if "error" in res:
        raise res["error"]
    for key in ("eager", "graph"):
        torch.testing.assert_close(res[key].float(), res["ref"].float(), atol=6e-2, rtol=2e-2)


@pytest.mark.parametrize("value,expected", [(None, True), ("0", False), ("1", True)])
def test_flag_is_read_from_the_environment_at_import(value, expected):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DUPLEXKIT_TRITON_DECODE"}
    if value is not None:
        env["DUPLEXKIT_TRITON_DECODE"] = value
    code = ("import sys; from duplexkit.models.minicpmo45 import fast_kv; "
            "print(fast_kv.triton_decode_enabled(), 'duplexkit.models.minicpmo45.triton_decode' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(expected), "False"]  # the kernels are imported only when first used


def test_cpu_tensors_never_take_the_triton_path_by_default(monkeypatch):
    """On by default means on for CUDA: a CPU forward stays the torch path even with the interpreter
    variable set in this process (this module sets it), unless a test opts in."""
    monkeypatch.setattr(fast_kv, "_TRITON_DECODE", True)
    monkeypatch.setattr(fast_kv, "_TRITON_ON_CPU", False)
    assert not fast_kv._use_triton(torch.zeros(1, 1, 4))
    monkeypatch.setattr(fast_kv, "_TRITON_ON_CPU", True)
    assert fast_kv._use_triton(torch.zeros(1, 1, 4))
    monkeypatch.setattr(fast_kv, "_TRITON_DECODE", False)
    assert not fast_kv._use_triton(torch.zeros(1, 1, 4))


def test_pre_ampere_gpus_keep_the_torch_ops(monkeypatch):
    """The kernels' bf16 tl.dot needs compute capability 8.0: an older GPU takes PyTorch's ops."""
    fast_kv._triton_capable.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: (7, 5))
    try:
        assert not fast_kv._triton_capable(0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: (9, 0))
        fast_kv._triton_capable.cache_clear()
        assert fast_kv._triton_capable(0)
    finally:
        fast_kv._triton_capable.cache_clear()
