"""Micro-benchmark: the one-token decode step's non-GEMM work, torch path vs the Triton kernels of
duplexkit/models/minicpmo45/triton_decode.py, on CUDA.

Run (from the repository root, one GPU)::

    PYTHONPATH=$PWD python3 benchmarks/decode_kernels.py            # the full table (~1-2 min)
    PYTHONPATH=$PWD python3 benchmarks/decode_kernels.py --quick    # B 1 and 32, kv 2048 only

Part 1, per layer at the real thinker shapes (hidden 4096, 32 query / 8 KV heads, head_dim 128, bf16), for
B rows in {1, 8, 32} at KV position {512, 2048} (every row at that position in its own slot of a
pool with a scratch slot; ``kv_len`` is the 256-bucket above it, as fast_thinker captures it):

* ``attn``: torch ``_attention`` (index_put KV write + index_select gather + SDPA with the additive
  mask; the mask itself is built once per step and not counted) vs ``decode_attention`` (the
  Triton path's KV write is fused into the rope kernel, counted in ``rope+write``);
* ``rope+write``: torch q/k RMSNorm x gain + rotary (the CUDA path of ``decoder_forward``) vs
  ``qk_norm_rope_write`` (norm + rotary + KV write);
* ``2x add+rms``: two ``x = x + y; h = F.rms_norm(x)`` pairs vs two ``add_rms_norm``;
* ``sum``: the three rows together (everything in a layer but the GEMMs and the MLP activation).

Each entry is the median over replays of a CUDA graph holding 20 calls (launch gaps as in the
production graphs), in microseconds per call.

Part 2: ``decoder_forward`` decode steps (T = 1) of a random 4-layer model with the thinker's layer
shapes (bf16, fused projections as FastThinker has them), captured as a CUDA graph, with
``DUPLEXKIT_TRITON_DECODE`` off and on (the module flag is switched in-process), in ms per step and
per layer, plus the max abs difference of the two outputs.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from duplexkit.models.minicpmo45 import fast_kv
from duplexkit.models.minicpmo45 import triton_decode as td

H, HKV, D, HIDDEN, FFN = 32, 8, 128, 4096, 12288
DT = torch.bfloat16
REPS = 20


def time_graph(fn, replays: int = 30) -> float:
    """Median µs per ``fn`` call: ``REPS`` calls captured in one CUDA graph, replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / REPS)
    return statistics.median(times)


def layer_parts(B: int, kv: int):
    dev = torch.device("cuda")
    kv_len = -(-(kv + 1) // 256) * 256
    S = B
    kc = torch.randn(S + 1, kv_len, HKV, D, device=dev, dtype=DT)
    vc = torch.randn_like(kc)
    slots = torch.randperm(S, device=dev)
    pos = torch.full((B,), kv, dtype=torch.long, device=dev)
    qkv = torch.randn(B, 1, H + 2 * HKV, D, device=dev, dtype=DT)
    q, k, v = qkv[:, :, :H], qkv[:, :, H:H + HKV], qkv[:, :, H + HKV:]
    gain = torch.ones(H + HKV, D, device=dev, dtype=DT)
    gq, gk = gain[0], gain[H]
    ang = torch.rand(B, 1, D, device=dev)
    cos, sin = ang.cos().to(DT), ang.sin().to(DT)
    cos4, sin4 = cos.unsqueeze(2), sin.unsqueeze(2)
    bias = fast_kv.attention_bias(pos[:, None], kv_len, H // HKV, DT)
    x = torch.randn(B, 1, HIDDEN, device=dev, dtype=DT)
    y = torch.randn_like(x)
    w = torch.ones(HIDDEN, device=dev, dtype=DT)
    scale = D ** -0.5
    qr = q[:, 0].contiguous()

    def t_rope():
        qk = qkv[:, :, :H + HKV]
        qk = F.rms_norm(qk, (D,), None, 1e-6) * gain
        qk = qk * cos4 + fast_kv._rotate_half(qk) * sin4
        return qk

    def t_attn():
        return fast_kv._attention(q, k, v, kc, vc, slots, pos[:, None], kv_len, scale, bias)

    def t_norms():
        for _ in range(2):
            s = x + y
            F.rms_norm(s, (HIDDEN,), w, 1e-6)

    def k_rope():
        return td.qk_norm_rope_write(q[:, 0], k[:, 0], v[:, 0], cos[:, 0], sin[:, 0], gq, gk, 1e-6, kc, vc, slots, pos)

    def k_attn():
        return td.decode_attention(qr, kc, vc, slots, pos, kv_len, scale)

    def k_norms():
        for _ in range(2):
            td.add_rms_norm(x, y, w, 1e-6)

    # correctness at these shapes: Triton attention vs the torch path on the same cache
    ref = t_attn()[:, 0].float()  # writes the new k/v into the cache, then attends
    got = td.decode_attention(qr, kc, vc, slots, pos, kv_len, scale).float()
    err = (ref - got).abs().max().item()
    out = {}
    for name, tf, kf in (("attn", t_attn, k_attn), ("rope+write", t_rope, k_rope), ("2x add+rms", t_norms, k_norms)):
        out[name] = (time_graph(tf), time_graph(kf))
    n_split, _ = td.num_splits(B, HKV, kv_len, td._sm_count(dev))
    return out, err, n_split


def model_step(B: int, kv: int, layers: int = 4):
    from transformers import Qwen3Config, Qwen3Model

    dev = torch.device("cuda")
    cfg = Qwen3Config(vocab_size=16, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                      num_attention_heads=H, num_key_value_heads=HKV, head_dim=D, rms_norm_eps=1e-6,
                      max_position_embeddings=40960)
    torch.manual_seed(0)
    with torch.device(dev):
        m = Qwen3Model(cfg).to(DT).eval()
    fast_kv.fuse_projections(m)
    kv_len = -(-(kv + 1) // 256) * 256
    pool = fast_kv.KVPool(layers, HKV, D, kv_len, dtype=DT, device=dev, slots=B)
    pool.k.normal_()
    pool.v.normal_()
    x = torch.randn(B, 1, HIDDEN, device=dev, dtype=DT)
    pos = torch.full((B, 1), kv, dtype=torch.long, device=dev)
    slots = torch.arange(B, device=dev)
    res, outs = {}, {}
    with torch.no_grad():
        for on in (False, True):
            fast_kv._TRITON_DECODE = on
            k0, v0 = pool.k.clone(), pool.v.clone()
            outs[on] = fast_kv.decoder_forward(m, x, pos, slots, pool, kv_len).float()
            pool.k.copy_(k0)
            pool.v.copy_(v0)
            res[on] = time_graph(lambda: fast_kv.decoder_forward(m, x, pos, slots, pool, kv_len), replays=10) / 1000.0
    fast_kv._TRITON_DECODE = False
    del m, pool
    torch.cuda.empty_cache()
    return res, (outs[False] - outs[True]).abs().max().item(), layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="B 1 and 32 at kv 2048 only")
    ap.add_argument("--no-model", action="store_true", help="skip part 2 (decoder_forward steps)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    fast_kv.pin_sdpa_backend()
    cases = [(1, 2048), (32, 2048)] if args.quick else [(b, kv) for b in (1, 8, 32) for kv in (512, 2048)]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {td.triton.__version__}")
    print("\nper layer, µs per call (torch -> triton), thinker shapes, bf16")
    print(f"{'B':>3} {'kv':>5} {'splits':>6} {'attn':>17} {'rope+write':>17} {'2x add+rms':>17} {'sum':>17} {'attn err':>9}")
    for B, kv in cases:
        out, err, ns = layer_parts(B, kv)
        tt = sum(a for a, _ in out.values())
        kt = sum(b for _, b in out.values())
        cells = " ".join(f"{a:7.1f} -> {b:6.1f}" for a, b in out.values())
        print(f"{B:>3} {kv:>5} {ns:>6} {cells} {tt:7.1f} -> {kt:6.1f} {err:9.2e}", flush=True)
    if args.no_model:
        return
    print("\ndecoder_forward decode step (random 4-layer model, thinker layer shapes), CUDA graph, ms")
    print(f"{'B':>3} {'kv':>5} {'off':>8} {'on':>8} {'off/layer':>10} {'on/layer':>10} {'max|diff|':>10}")
    for B, kv in cases:
        res, diff, L = model_step(B, kv)
        print(f"{B:>3} {kv:>5} {res[False]:8.3f} {res[True]:8.3f} {res[False] / L:10.3f} {res[True] / L:10.3f} "
              f"{diff:10.2e}", flush=True)


if __name__ == "__main__":
    main()
