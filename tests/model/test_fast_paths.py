"""The batched fast paths (static KV slots, batched decode; CUDA graphs only on a GPU) against the
reference-checked paths, on the CPU with the tiny checkpoint: greedy decoding must give the same
ids, and the hidden rows / logits must agree to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duplexkit.models.minicpmo45 import DuplexPolicy, UnitInput


def _speech(n: int, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def _units(k: int, seed: int) -> list:
    return [_speech(16560 if i == 0 else 16000, seed * 100 + i) for i in range(k)]


@pytest.fixture(scope="module")
def fast_thinker(tiny_model):
    from duplexkit.models.minicpmo45.fast_thinker import FastThinker

    return FastThinker.from_thinker(tiny_model.thinker, cuda_graphs=False, slots=2)


def _run(th, policy, units, force_speak_at=(0,), batch_with=None):
    st = th.new_stream(policy=policy)
    out = []
    for i, u in enumerate(units):
        (r,) = th.step_units([UnitInput(st, u, force_speak=i in force_speak_at)])
        out.append(r)
    out[-1].window_slides = st.window_slides  # for the sliding-window case
    th.close(st)
    return out


@pytest.mark.parametrize("policy_kw", [dict(), dict(min_unit_tokens=5, max_unit_tokens=5),
                                       dict(min_unit_tokens=19),
                                       dict(min_unit_tokens=4, max_unit_tokens=6, window_high=70, window_low=50)])
def test_fast_thinker_greedy_matches_reference(tiny_model, fast_thinker, policy_kw):
    units = _units(7 if "window_high" in policy_kw else 4, 1)
    ref = _run(tiny_model.thinker, DuplexPolicy(temperature=0.0, **policy_kw), units, force_speak_at=(0, 2))
    fast = _run(fast_thinker, DuplexPolicy(temperature=0.0, **policy_kw), units, force_speak_at=(0, 2))
    for a, b in zip(ref, fast):
        assert a.generated_ids == b.generated_ids
        assert a.decision == b.decision and a.turn_start == b.turn_start and a.end_of_turn == b.end_of_turn
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.hidden.numpy(), b.hidden.numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(a.pending_logits.numpy(), b.pending_logits.numpy(), atol=1e-4, rtol=0)
    if policy_kw.get("max_unit_tokens") == 5:
        assert all(len(r.generated_ids) == 5 + 2 for r in fast)  # 5 decided + chunk_eos + </unit>
    if "window_high" in policy_kw:  # the window slid on both paths, the same number of times
        assert ref[-1].window_slides >= 2 and fast[-1].window_slides == ref[-1].window_slides


def test_fixed_unit_tokens_policy(tiny_model):
    """min/max_unit_tokens fix the decided tokens of every speaking unit (reference path)."""
    pol = DuplexPolicy(temperature=0.7, min_unit_tokens=19)
    res = _run(tiny_model.thinker, pol, _units(3, 2), force_speak_at=(0,))
    sp = tiny_model.special
    for r in res:  # the turn stays open (turn_eos masked), so every unit speaks the full budget
        assert r.decision == "speak" and r.n_tokens == 18
        assert r.generated_ids[-2:] == [sp.chunk_eos, sp.unit_end]
    with pytest.raises(ValueError):
        DuplexPolicy(min_unit_tokens=6, max_unit_tokens=5)


def test_fast_thinker_batch_equals_single_streams(tiny_model, fast_thinker):
    """Three streams in one step_units call give each stream's single-stream ids."""
    pol = dict(temperature=0.0, min_unit_tokens=3)
    seqs = [_units(3, s) for s in (3, 4, 5)]
    singles = [[r.generated_ids for r in _run(tiny_model.thinker, DuplexPolicy(**pol), u)] for u in seqs]
    sts = [fast_thinker.new_stream(policy=DuplexPolicy(**pol)) for _ in seqs]
    got = [[] for _ in seqs]
    for i in range(3):
        res = fast_thinker.step_units([UnitInput(st, u[i], force_speak=i == 0) for st, u in zip(sts, seqs)])
        for k, r in enumerate(res):
            got[k].append(r.generated_ids)
    for st in sts:
        fast_thinker.close(st)
    assert got == singles
    assert len(fast_thinker.pool.free) == fast_thinker.pool.n_slots  # every slot came back


def _seeded(th, policy_kw, units, seeds):
    """Run ``units`` on one stream per seed, all streams in each step_units call; ids per stream."""
    sts = [th.new_stream(policy=DuplexPolicy(**policy_kw), seed=s) for s in seeds]
    out = [[] for _ in seeds]
    for i, u in enumerate(units):
        for k, r in enumerate(th.step_units([UnitInput(st, u, force_speak=i == 0) for st in sts])):
            out[k].append(r.generated_ids)
    for st in sts:
        th.close(st)
    return out


@pytest.mark.parametrize("policy_kw", [dict(temperature=0.7, min_unit_tokens=4),
                                       dict(temperature=1.0, top_k=0, top_p=0.6, min_unit_tokens=2),
                                       dict(temperature=1.3, top_k=5, top_p=1.0, repetition_penalty=1.3)])
def test_fast_thinker_seeded_sampling_matches_reference(tiny_model, fast_thinker, policy_kw):
    """Same seeds -> same sampled ids on the eager path (one stream at a time) and the batched path
    (two streams per step), on the CPU: both run one decision rule and one sampler."""
    units = _units(3, 6)
    ref = [_seeded(tiny_model.thinker, policy_kw, units, [s])[0] for s in (17, 18)]
    fast = _seeded(fast_thinker, policy_kw, units, [17, 18])
    assert fast == ref
    assert ref[0] != ref[1]  # the seeds matter: the ids are sampled, not forced
    assert _seeded(fast_thinker, policy_kw, units, [17])[0] == ref[0]
    assert sum(len(ids) for ids in ref[0]) > 4 * len(units)  # units spoke (sampled tokens, not just terminators)


# ---------------------------------------------------------------------------------------------- talker


def _talker_units(model, n_units: int, seed: int):
    th = model.thinker
    pol = DuplexPolicy(temperature=0.0, min_unit_tokens=8, max_unit_tokens=8)
    st = th.new_stream(policy=pol)
    out = []
    for i, u in enumerate(_units(n_units, seed)):
        (r,) = th.step_units([UnitInput(st, u, force_speak=i == 0)])
        out.append(r)
    th.close(st)
    return out


def test_fast_talker_greedy_matches_reference(tiny_model):
    from duplexkit.models.minicpmo45.fast_talker import FastTalker
    from duplexkit.models.minicpmo45.talker import TalkerInput

    tk = tiny_model.talker
    ft = FastTalker(tk, cuda_graphs=False, slots=1)
    units = _talker_units(tiny_model, 4, 7)
    rt, fturn = tk.new_turn(), ft.new_turn()
    for k, r in enumerate(units):
        kw = dict(token_ids=r.token_ids, hidden=r.hidden, turn_start=k == 0, turn_end=k == len(units) - 1, temperature=0.0)
        (a,) = tk.generate_units([TalkerInput(turn=rt, **kw)])
        (b,) = ft.generate_units([TalkerInput(turn=fturn, **kw)])
        np.testing.assert_array_equal(a, b)
        if k < len(units) - 1:
            assert fturn.text_start_pos == rt.text_start_pos
    assert fturn.slot is None and len(ft.pool.free) == ft.pool.n_slots  # turn_end returned the slot


def test_fast_talker_batch_and_sampling(tiny_model):
    from duplexkit.models.minicpmo45.fast_talker import FastTalker
    from duplexkit.models.minicpmo45.talker import TalkerError, TalkerInput, TalkerSampling

    tk = tiny_model.talker
    ft = FastTalker(tk, cuda_graphs=False, slots=1)
    units = _talker_units(tiny_model, 2, 8)
    # greedy: a batch of 3 turns gives each turn's single result
    single = []
    for _ in range(3):
        t = ft.new_turn()
        single.append([ft.generate_units([TalkerInput(turn=t, token_ids=r.token_ids, hidden=r.hidden, temperature=0.0)])[0]
                       for r in units])
    turns = [ft.new_turn() for _ in range(3)]
    batched = [[], [], []]
    for r in units:
        res = ft.generate_units([TalkerInput(turn=t, token_ids=r.token_ids, hidden=r.hidden, temperature=0.0) for t in turns])
        for k in range(3):
            batched[k].append(res[k])
    for k in range(3):
        for a, b in zip(single[k], batched[k]):
            np.testing.assert_array_equal(a, b)
    # mid-turn sampling: EOS masked, 25 codes, seeded generators repeat
    def sample(seed):
        t = ft.new_turn()
        g = torch.Generator().manual_seed(seed)
        return ft.generate_units([TalkerInput(turn=t, token_ids=units[0].token_ids, hidden=units[0].hidden, generator=g)])[0]
    a, b = sample(1), sample(1)
    assert len(a) == 25 and (a == b).all() and ((0 <= a) & (a < 6561)).all()
    bad = ft.generate_units([TalkerInput(turn=ft.new_turn(), token_ids=units[0].token_ids, hidden=units[0].hidden,
                                         budget=0)])
    assert isinstance(bad[0], TalkerError)


@pytest.mark.parametrize("sampling_kw", [dict(), dict(top_k=25), dict(top_p=0.85), dict(top_k=25, top_p=0.85, min_p=0.01),
                                         dict(temperature=1.5, repetition_penalty=1.5, repetition_window=8)])
def test_fast_talker_seeded_sampling_matches_reference(tiny_model, sampling_kw):
    """Same seeds -> same codes on the eager talker and the batched one (CPU), for the reference
    sampling and with top-k / top-p / min-p (now on the batched path too); a batch of two turns
    gives each turn's own codes."""
    from duplexkit.models.minicpmo45.fast_talker import FastTalker
    from duplexkit.models.minicpmo45.talker import TalkerInput, TalkerSampling

    tk = tiny_model.talker
    ft = FastTalker(tk, cuda_graphs=False, slots=2)
    units = _talker_units(tiny_model, 3, 9)
    s = TalkerSampling(**sampling_kw)

    def run(model, seeds):
        turns = [model.new_turn() for _ in seeds]
        gens = [torch.Generator().manual_seed(k) for k in seeds]
        out = [[] for _ in seeds]
        for k, r in enumerate(units):
            res = model.generate_units([TalkerInput(turn=t, token_ids=r.token_ids, hidden=r.hidden, generator=g,
                                                    sampling=s, turn_start=k == 0, turn_end=k == len(units) - 1)
                                        for t, g in zip(turns, gens)])
            for i, codes in enumerate(res):
                out[i].append(codes.tolist())
        return out

    ref = [run(tk, [seed])[0] for seed in (5, 6)]
    assert run(ft, [5, 6]) == ref
    assert ref[0] != ref[1] and len(ref[0][1]) == 25  # sampled (seed-dependent); a mid-turn unit is 25 codes


# ---------------------------------------------------------------------------------------------- code2wav


def test_batched_code2wav_matches_single_streams():
    """push_batch over 3 streams (one flow call per round) gives each stream's own push output."""
    from types import SimpleNamespace

    from duplexkit.models.minicpmo45.random_init import _random_code2wav

    pytest.importorskip("stepaudio2")
    import tempfile
    from pathlib import Path

    gen = torch.Generator().manual_seed(0)
    c2w = _random_code2wav(Path(tempfile.mkdtemp()), torch.device("cpu"), gen, real=False, batched=True)
    rng = np.random.default_rng(0)
    rounds = [(rng.integers(0, 6561, (3, 25)), False), (rng.integers(0, 6561, (3, 25)), False),
              (rng.integers(0, 6561, (3, 7)), True)]
    singles = []
    for k in range(3):
        st = c2w.new_stream(None, seed=k)
        singles.append([c2w.push(st, codes[k], last=last) for codes, last in rounds])
        c2w.close(st)
    sts = [c2w.new_stream(None, seed=k) for k in range(3)]
    calls = c2w.stats["flow_calls"]
    for r, (codes, last) in enumerate(rounds):
        outs = c2w.push_batch([SimpleNamespace(handle=st, codes=codes[k], last=last) for k, st in enumerate(sts)])
        for k in range(3):
            assert outs[k].shape == singles[k][r].shape
            np.testing.assert_allclose(outs[k], singles[k][r], atol=2e-4, rtol=0)
    assert c2w.stats["flow_calls"] - calls == 3  # one batched flow call per round
    bad = c2w.push_batch([SimpleNamespace(handle=sts[0], codes=np.array([6561]), last=False)])
    assert isinstance(bad[0], ValueError)


@pytest.mark.parametrize("lookahead", [False, True])
def test_fast_thinker_step_that_raises_leaves_every_stream_as_it_was(tiny_model, fast_thinker, monkeypatch, lookahead):
    """A batch-level failure mid-decode (after the prefill wrote KV and tokens were drawn) is undone
    for every stream, so the runtime's retry in halves (duplexkit/engine/steps.py) gives exactly the
    ids of a run that never failed, seeded sampling included; with and without the one-step
    lookahead (whose speculative launch is a forward too)."""
    monkeypatch.setattr(fast_thinker, "lookahead", lookahead)
    policy_kw = dict(temperature=0.7, min_unit_tokens=4)
    units = _units(3, 6)
    ref = _seeded(fast_thinker, policy_kw, units, [17, 18])
    sts = [fast_thinker.new_stream(policy=DuplexPolicy(**policy_kw), seed=s) for s in (17, 18)]
    got = [[], []]
    real_step = fast_thinker._step_forward
    for i, u in enumerate(units):
        inputs = [UnitInput(st, u, force_speak=i == 0) for st in sts]
        if i == 1:
            calls = {"n": 0}

            def failing(kvs, ids, pos, slots):
                calls["n"] += 1
                if calls["n"] == 3:  # two decode forwards of the batch already ran
                    raise RuntimeError("injected batch failure")
                return real_step(kvs, ids, pos, slots)

            monkeypatch.setattr(fast_thinker, "_step_forward", failing)
            before = [(st.kv.length, list(st.history), list(st.unit_starts)) for st in sts]
            with pytest.raises(RuntimeError, match="injected"):
                fast_thinker.step_units(inputs)
            assert [(st.kv.length, list(st.history), list(st.unit_starts)) for st in sts] == before
            monkeypatch.setattr(fast_thinker, "_step_forward", real_step)
            # the runtime's retry: each half alone
            results = fast_thinker.step_units(inputs[:1]) + fast_thinker.step_units(inputs[1:])
        else:
            results = fast_thinker.step_units(inputs)
        for k, r in enumerate(results):
            got[k].append(r.generated_ids)
    for st in sts:
        fast_thinker.close(st)
    assert got == ref


def test_audio_conv_warmup_shapes_are_the_units_mel_blocks():
    """The thinker's start-up warm-up runs its audio convolutions for every batch size at the mel
    block lengths the streams really produce (unit 0 and later units of StreamingMel), so cuDNN's
    per-thread plan for each shape is chosen at start-up, not in a live unit."""
    from duplexkit.models.minicpmo45.fast_thinker import audio_conv_shapes
    from duplexkit.models.minicpmo45.processor import FIRST_UNIT_WINDOW, UNIT_SAMPLES, StreamingMel

    mel = StreamingMel()
    t0 = mel.push(np.zeros(FIRST_UNIT_WINDOW, np.float32)).shape[1]
    t1 = mel.push(np.full(UNIT_SAMPLES, 0.1, np.float32)).shape[1]
    assert audio_conv_shapes([3, 1, 3]) == sorted({(b, 80, t) for b in (1, 3) for t in (t0, t1)})
    assert {t0, t1} == {102, 104}


def test_prefill_span_is_the_host_clock_on_the_cpu():
    from duplexkit.models.minicpmo45.fast_thinker import _GpuSpan

    span = _GpuSpan(torch.device("cpu"))
    span.mark()
    assert span.ms(3.5, 10.0) == 3.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_span_times_the_queued_work_on_cuda():
    """The prefill only queues kernels: the span ends when the last one ran, not when it was queued."""
    import time

    from duplexkit.models.minicpmo45.fast_thinker import _GpuSpan

    dev = torch.device("cuda")
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    span = _GpuSpan(dev)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time at ~2 GHz, queued without waiting
    host_ms = (time.perf_counter() - t0) * 1e3
    span.mark()
    torch.cuda.synchronize(dev)
    total_ms = (time.perf_counter() - t0) * 1e3
    got = span.ms(host_ms, total_ms)
    assert host_ms < 20 and 40 < got <= total_ms


def test_warmup_reserves_the_pools_for_the_largest_batch(tiny_model, monkeypatch, caplog):
    """Start-up reserves KV slots (thinker, its Whisper pool, talker) for max_num_seqs streams, so
    opening that many streams never grows a pool (a growth drops every captured graph while streams
    are live); a device without the memory leaves the pool as it was and says so."""
    import logging

    from duplexkit.models.minicpmo45.fast_kv import KVPool
    from duplexkit.models.minicpmo45.fast_talker import FastTalker
    from duplexkit.models.minicpmo45.fast_thinker import FastThinker

    th = FastThinker.from_thinker(tiny_model.thinker, cuda_graphs=False, slots=2)
    tk = FastTalker(tiny_model.talker, cuda_graphs=False, slots=1)
    th.warmup(range(1, 7))
    tk.warmup(range(1, 7))
    pools = [th.pool, tk.pool] + ([th.audio_batch.pool] if th.audio_batch is not None else [])
    assert all(p.n_slots == 6 for p in pools)
    versions = [p.version for p in pools]
    sts = [th.new_stream() for _ in range(6)]
    for st in sts:
        th.step_units([UnitInput(st, _speech(16560, 3))])
    turns = [tk.new_turn() for _ in range(6)]
    for t in turns:
        t.ensure_slot()
    assert [p.version for p in pools] == versions  # no growth
    for st in sts:
        th.close(st)

    pool = KVPool(2, 1, 8, 16, dtype=torch.float32, device="cpu", slots=1)

    def no_memory(n):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(pool, "_resize", no_memory)
    with caplog.at_level(logging.WARNING, logger="duplexkit.engine"):
        from duplexkit.models.minicpmo45.fast_kv import reserve_for_warmup

        reserve_for_warmup(pool, [1, 4], "talker")
    assert pool.n_slots == 1 and "reserve 4 KV slots" in caplog.text


def test_graph_cache_drops_every_graph_when_its_pool_grows(monkeypatch):
    """The one graph cache of the thinker, its Whisper pass and the talker: built once per key and
    counted, all dropped after the pool was reallocated, the dropped graphs' static inputs handed to
    keep_for_current_stream (replays queued on the stream may still read them)."""
    from types import SimpleNamespace

    from duplexkit.models.minicpmo45 import fast_kv

    kept = []
    monkeypatch.setattr(fast_kv, "keep_for_current_stream", lambda *t: kept.extend(t))
    pool = fast_kv.KVPool(1, 1, 4, 8, dtype=torch.float32, device="cpu", slots=1)
    stats = {}
    cache = fast_kv.GraphCache(pool, stats, "captures", lambda g: (g.x,))
    built = []

    def build(tag):
        built.append(tag)
        return SimpleNamespace(x=torch.zeros(1), tag=tag)

    a = cache.get_or_build((1, 256), lambda: build("a"))
    assert cache.get_or_build((1, 256), lambda: build("again")) is a and built == ["a"] and stats["captures"] == 1
    b = cache.get_or_build((2, 256), lambda: build("b"))
    pool.alloc(), pool.alloc()  # the second alloc grows the pool: version changes
    c = cache.get_or_build((1, 256), lambda: build("c"))
    assert c.tag == "c" and list(cache) == [(1, 256)] and stats["captures"] == 3
    assert any(t is a.x for t in kept) and any(t is b.x for t in kept)
