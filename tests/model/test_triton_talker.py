"""The talker's fused decode step (duplexkit/models/minicpmo45/triton_talker.py): each kernel against a
PyTorch reference, ``fused_decode_step`` against ``decoder_forward``'s torch path on the same pool,
and a FastTalker unit with the fused step against one without.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before anything imports triton), fp32 and tiny shapes (the interpreter is slow); with
CUDA they are compiled, and the bf16 step is also captured in a CUDA graph.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1 (tests/conftest.py sets it unless told otherwise)",
                allow_module_level=True)

triton = pytest.importorskip("triton")

from duplexkit.models.minicpmo45 import fast_kv  # noqa: E402
from duplexkit.models.minicpmo45.fast_kv import KVPool, decoder_forward, fuse_projections  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
F32 = torch.float32
TOL = 1e-4  # fp32: reduction order only


@pytest.fixture(autouse=True, scope="module")
def _interpreter_numpy_fix():
    """As in test_triton_decode.py: Triton 3.5's interpreter needs ``__index__`` on its scalars under
    NumPy >= 2.3 (loops with tensor bounds, e.g. the attention's key loop). Patched for this module."""
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
def tt():
    from duplexkit.models.minicpmo45 import triton_talker

    return triton_talker


def _rot(y, cos, sin):
    return y * cos + fast_kv._rotate_half(y) * sin


def _tables(B, D, gen, dtype=F32):
    ang = torch.rand(B, D // 2, generator=gen) * 6.0
    return (torch.cat([ang.cos(), ang.cos()], -1).to(DEV, dtype), torch.cat([ang.sin(), ang.sin()], -1).to(DEV, dtype))


@pytest.mark.parametrize("B", [1, 3, 5])
@pytest.mark.parametrize("H,hkv,block_half", [(2, 2, 16), (2, 2, 8), (4, 2, 16)])
def test_rms_qkv_rope_write_matches_torch(tt, B, H, hkv, block_half):
    gen = torch.Generator().manual_seed(B * 10 + H + block_half)
    K, D, S, L = 80, 64, 3, 40  # K not a multiple of the K block: the masked tail is covered
    x = torch.randn(B, K, generator=gen).to(DEV)
    g = (1 + 0.1 * torch.randn(K, generator=gen)).to(DEV)
    w = (0.1 * torch.randn((H + 2 * hkv) * D, K, generator=gen)).to(DEV)
    cos, sin = _tables(B, D, gen)
    kc = torch.randn(S + 1, L, hkv, D, generator=gen).to(DEV)
    vc = torch.randn_like(kc)
    slots = torch.tensor([1, S, 0, 2, S][:B], device=DEV)  # S: the scratch slot (padding rows)
    pos = torch.tensor([5, 0, 39, 0, 0][:B], device=DEV)
    h = F.rms_norm(x, (K,), g, 1e-6)
    qkv = (h @ w.T).view(B, H + 2 * hkv, D)
    q_ref = _rot(qkv[:, :H], cos[:, None], sin[:, None])
    kr, vr = kc.clone(), vc.clone()
    kr[slots, pos] = _rot(qkv[:, H:H + hkv], cos[:, None], sin[:, None])
    vr[slots, pos] = qkv[:, H + hkv:]
    q = tt.rms_qkv_rope_write(x, g, 1e-6, w, H, cos, sin, kc, vc, slots, pos, block_half=block_half)
    assert q.shape == (B, H, D) and q.dtype == F32
    assert (q - q_ref).abs().max().item() < TOL
    assert (kc - kr).abs().max().item() < TOL and (vc - vr).abs().max().item() < TOL
    mask = torch.ones(S + 1, L, dtype=torch.bool, device=DEV)
    mask[slots, pos] = False
    assert torch.equal(kc[mask], kr[mask])  # nothing else written


@pytest.mark.parametrize("B", [1, 5])
@pytest.mark.parametrize("N,K,block_n", [(128, 96, 32), (48, 256, 16)])
def test_gemv_residual_matches_torch(tt, B, N, K, block_n):
    gen = torch.Generator().manual_seed(N + K + B)
    a = torch.randn(B, K, generator=gen).to(DEV)
    w = (0.1 * torch.randn(N, K, generator=gen)).to(DEV)
    r = torch.randn(B, N, generator=gen).to(DEV)
    out = tt.gemv_residual(a, w, r, block_n=block_n)
    assert out.shape == (B, N) and (out - (r + a @ w.T)).abs().max().item() < TOL
    with pytest.raises(ValueError):
        tt.gemv_residual(a, w[:, :-1], r)


@pytest.mark.parametrize("B", [1, 3])
def test_rms_gate_up_silu_matches_torch(tt, B):
    gen = torch.Generator().manual_seed(B)
    K, FF = 96, 80  # FF not a multiple of the column block
    x = torch.randn(B, K, generator=gen).to(DEV)
    g = (1 + 0.1 * torch.randn(K, generator=gen)).to(DEV)
    w = (0.1 * torch.randn(2 * FF, K, generator=gen)).to(DEV)
    gate, up = (F.rms_norm(x, (K,), g, 1e-6) @ w.T).chunk(2, dim=-1)
    act = tt.rms_gate_up_silu(x, g, 1e-6, w)
    assert act.shape == (B, FF) and (act - F.silu(gate) * up).abs().max().item() < TOL


def _llama(layers=2, hidden=128, heads=2, ffn=256, dtype=F32, device=DEV):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    m = LlamaModel(LlamaConfig(vocab_size=8, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                               rms_norm_eps=1e-6, max_position_embeddings=512))
    m = m.to(device, dtype).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    fuse_projections(m)
    return m


def test_fused_decode_step_matches_decoder_forward(tt, monkeypatch):
    monkeypatch.setattr(fast_kv, "_TRITON_DECODE", False)  # the reference: decoder_forward's torch path
    model = _llama()
    cfg = model.config
    pool = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, 192, dtype=F32, device=DEV, slots=3)
    gen = torch.Generator().manual_seed(3)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    # three steps of 5 rows: position 0, near kv_len, mid; two padding rows in the scratch slot
    slots = torch.tensor([0, 2, 1, pool.scratch, pool.scratch], device=DEV)
    k0, v0 = pool.k.clone(), pool.v.clone()
    steps = [(torch.randn(5, 1, 128, generator=gen).to(DEV), torch.tensor([[s], [125 + s], [40 + s], [0], [0]],
                                                                          device=DEV)) for s in range(3)]
    kv_len = 128
    with torch.no_grad():
        ref = [decoder_forward(model, x, pos, slots, pool, kv_len) for x, pos in steps]
        k_ref, v_ref = pool.k.clone(), pool.v.clone()
        pool.k.copy_(k0)
        pool.v.copy_(v0)
        got = [tt.fused_decode_step(model, x, pos, slots, pool, kv_len) for x, pos in steps]
    for a, b in zip(ref, got):
        assert a.shape == b.shape == (5, 1, 128) and b.dtype == F32
        assert (a - b).abs().max().item() < TOL
    real = torch.arange(pool.n_slots, device=DEV)  # the scratch slot's contents are not compared
    assert (k_ref[:, real] - pool.k[:, real]).abs().max().item() < TOL
    assert (v_ref[:, real] - pool.v[:, real]).abs().max().item() < TOL
    # a long bucket takes the split attention (with the merge kernel): same values
    pool.k.copy_(k0)
    pool.v.copy_(v0)
    monkeypatch.setattr(tt, "ONE_SPLIT_MAX_KV", 64)
    with torch.no_grad():
        got = [tt.fused_decode_step(model, x, pos, slots, pool, kv_len) for x, pos in steps]
    for a, b in zip(ref, got):
        assert (a - b).abs().max().item() < TOL


def test_fused_decode_step_refuses_what_it_cannot_run(tt):
    from transformers import Qwen3Config, Qwen3Model

    m = Qwen3Model(Qwen3Config(vocab_size=8, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, head_dim=16)).eval()
    fuse_projections(m)
    assert "q/k norm" in tt.fused_step_supported(m)
    pool = KVPool(1, 2, 16, 8, dtype=F32, device="cpu", slots=1)
    one = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="q/k norm"):
        tt.fused_decode_step(m, torch.zeros(1, 1, 32), one, one[:, 0], pool, 8)
    llama = _llama(layers=1, device="cpu")
    assert tt.fused_step_supported(llama) is None
    with pytest.raises(ValueError, match="one token"):
        tt.fused_decode_step(llama, torch.zeros(1, 2, 128), torch.zeros(1, 2, dtype=torch.long), one[:, 0], pool, 8)
    unfused = _llama(layers=1, device="cpu")
    for layer in unfused.layers:
        del layer._dk_qkv
    assert "fused projections" in tt.fused_step_supported(unfused)


def test_fast_talker_unit_with_the_fused_step_gives_the_same_codes(tiny_model, monkeypatch):
    """Two greedy 25-code units (one turn, then two turns in one batch) through FastTalker with the
    fused step, against the torch path (``decoder_forward`` without the Triton kernels): the same
    codes, and the fused step ran for every decode step. (The tiny talker's attention is nearly
    uniform, so a rotary error can slip through here: the kernel tests above cover it.)"""
    from duplexkit.models.minicpmo45 import fast_talker, triton_talker
    from duplexkit.models.minicpmo45.fast_talker import FastTalker
    from duplexkit.models.minicpmo45.talker import TalkerInput

    tk = tiny_model.talker
    gen = np.random.default_rng(0)
    n_text = tk.config.num_text_tokens
    units = [(gen.integers(0, n_text, 4 + k), gen.standard_normal((4 + k, tk.config.llm_dim)).astype(np.float32))
             for k in range(2)]

    def run(fused: bool):
        monkeypatch.setattr(fast_kv, "_TRITON_DECODE", fused)
        monkeypatch.setattr(fast_kv, "_TRITON_ON_CPU", fused and not CUDA)
        monkeypatch.setattr(fast_talker, "_TALKER_FUSED", fused)
        ft = FastTalker(tk, cuda_graphs=False, slots=2)
        turns = [ft.new_turn() for _ in range(2)]
        out = [[], []]
        for k, (ids, hid) in enumerate(units):
            res = ft.generate_units([TalkerInput(turn=t, token_ids=ids, hidden=hid, temperature=0.0,
                                                 turn_start=k == 0, min_new_tokens=26) for t in turns[: 1 + k]])
            for i, codes in enumerate(res):
                out[i].append(codes.tolist())
        return out

    calls = []
    orig = triton_talker.fused_decode_step
    monkeypatch.setattr(triton_talker, "fused_decode_step", lambda *a, **k: calls.append(1) or orig(*a, **k))
    ref = run(False)
    assert not calls
    got = run(True)
    assert len(calls) == 2 * 25  # every decode step of both units
    assert got == ref and len(ref[0][0]) == 25


@pytest.mark.parametrize("value,expected", [(None, False), ("0", False), ("1", True)])
def test_switch_is_read_from_the_environment_at_import(value, expected):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DUPLEXKIT_TALKER_FUSED"}
    if value is not None:
        env["DUPLEXKIT_TALKER_FUSED"] = value
    code = ("import sys; from duplexkit.models.minicpmo45 import fast_talker; "
            "print(fast_talker.talker_fused_enabled(), 'duplexkit.models.minicpmo45.triton_talker' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(expected), "False"]  # the kernels are imported only when first used


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA")
def test_fused_step_bf16_in_a_cuda_graph_matches_the_triton_path(tt, monkeypatch):
    monkeypatch.setattr(fast_kv, "_TRITON_DECODE", True)
    bf = torch.bfloat16
    model = _llama(layers=3, hidden=768, heads=12, ffn=3072, dtype=bf)
    pool = KVPool(3, 12, 64, 1024, dtype=bf, device=DEV, slots=4)
    pool.k.normal_()
    pool.v.normal_()
    x = torch.randn(5, 1, 768, device=DEV, dtype=bf)
    pos = torch.zeros(5, 1, dtype=torch.long, device=DEV)
    slots = torch.full((5,), pool.scratch, dtype=torch.long, device=DEV)
    with torch.no_grad():
        for kv_len in (512, 1024):  # one split without the merge; split + merge
            graph, out = fast_kv.capture_graph(lambda: tt.fused_decode_step(model, x, pos, slots, pool, kv_len), DEV)
            pos.copy_(torch.tensor([[kv_len - 1], [3], [kv_len // 2], [0], [0]]))
            slots.copy_(torch.tensor([0, 1, 3, pool.scratch, pool.scratch]))
            x.normal_()
            k0, v0 = pool.k.clone(), pool.v.clone()
            graph.replay()
            got = out.clone()
            k_got, v_got = pool.k[:, :4].clone(), pool.v[:, :4].clone()
            pool.k.copy_(k0)
            pool.v.copy_(v0)
            ref = decoder_forward(model, x, pos, slots, pool, kv_len)
            torch.testing.assert_close(got.float(), ref.float(), atol=6e-2, rtol=2e-2)
            torch.testing.assert_close(k_got.float(), pool.k[:, :4].float(), atol=6e-2, rtol=2e-2)
            torch.testing.assert_close(v_got.float(), pool.v[:, :4].float(), atol=6e-2, rtol=2e-2)
            pool.k.copy_(k0)
            pool.v.copy_(v0)


def test_benchmark_smoke_runs_on_the_cpu():
    """``benchmarks/talker_step.py --tiny --device cpu`` still runs (interpreter, eager) and prints
    its table with both paths agreeing."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    r = subprocess.run([sys.executable, "benchmarks/talker_step.py", "--tiny", "--device", "cpu", "--batches", "2"],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = [ln.split() for ln in r.stdout.splitlines() if ln.split()[:2] == ["2", "64"]]
    assert len(row) == 1 and float(row[0][-1]) < 1e-4, r.stdout
