"""The fast thinker's batched Whisper streaming pass (:mod:`duplexkit.models.minicpmo45.fast_whisper`)
against the per-stream reference path (:meth:`Thinker.audio_embeds_stream`), on the CPU with the
tiny checkpoint and real speech: streams at different unit indices share one layer pass per round,
give each stream's own embeddings unit after unit (across the 1500-position reset), and give their
pool slots back. The CUDA test (graph replay against eager) is skipped without a GPU."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from duplexkit.models.minicpmo45 import DuplexPolicy, UnitInput
from duplexkit.models.minicpmo45.audio_encoder import WhisperStreamCache
from duplexkit.models.minicpmo45.fast_thinker import FastThinker
from duplexkit.models.minicpmo45.fast_whisper import PooledWhisperCache
from duplexkit.models.minicpmo45.processor import AudioInputError

ASSETS = Path(__file__).resolve().parents[2] / "duplexkit" / "assets"


@pytest.fixture(scope="module")
def speech_units():
    """Real speech framed into units (unit 0: 16 560 samples, then 16 000), the question WAV then
    the interruption WAV, repeated to 48 units."""
    from duplexkit.audio import UnitFramer, read_wav

    parts = [read_wav(ASSETS / name, rate=16000)[0] for name in ("question_16k.wav", "interrupt_16k.wav")]
    audio = np.concatenate(parts)
    audio = np.tile(audio, int(np.ceil(50 * 16000 / audio.size)))
    units = [u.audio for u in UnitFramer().push(audio)]
    assert len(units) >= 48 and units[0].size == 16560 and units[1].size == 16000
    return units[:48]


def _unit(units, k: int, i: int) -> np.ndarray:
    """Stream k's unit i: the speech shifted by k units (unit 0 has unit 0's length)."""
    u = units[(i + 5 * k) % len(units)]
    if i == 0:
        return units[0] if k == 0 else np.concatenate([np.zeros(560, np.float32), u])[-16560:]
    return u if u.size == 16000 else u[-16000:]


def _fast(tiny_model, **kw) -> FastThinker:
    kw.setdefault("cuda_graphs", False)
    return FastThinker.from_thinker(tiny_model.thinker, **kw)


def _staggered(ref, ft, units, offsets, rounds, monkeypatch=None):
    """Streams of ``ft`` (one per offset) each advanced alone by ``offset`` units, then ``rounds``
    rounds of one batched call for all; a reference stream per offset through
    ``Thinker.audio_embeds_stream``. Yields (round, k, fast row, reference row, fast cache, ref cache)."""
    pol = DuplexPolicy(temperature=0.0)
    fs = [ft.new_stream(policy=pol) for _ in offsets]
    rs = [ref.new_stream(policy=pol) for _ in offsets]
    idx = [0] * len(offsets)
    for k, off in enumerate(offsets):
        for _ in range(off):
            a = _unit(units, k, idx[k])
            got = ft._audio_embeds_batch([fs[k]], [a])[0]
            want = ref.audio_embeds_stream(rs[k], a)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
            idx[k] += 1
    out = []
    for rnd in range(rounds):
        audios = [_unit(units, k, idx[k]) for k in range(len(offsets))]
        got = ft._audio_embeds_batch(fs, audios)
        for k, a in enumerate(audios):
            want = ref.audio_embeds_stream(rs[k], a)
            out.append((rnd, k, got[k], want, fs[k].whisper, rs[k].whisper))
            idx[k] += 1
    return fs, rs, out


def _check_rows(rows):
    for rnd, k, got, want, fc, rc in rows:
        assert got.shape == want.shape == (10, got.shape[1])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=lambda m: f"round {rnd} stream {k}: {m}")


def test_staggered_streams_equal_their_own_reference_across_the_1500_position_reset(tiny_model, speech_units):
    """Streams at units 0, 3 and 7 share one pass per round for 26 rounds; every row equals the
    stream's own reference path, including the rounds where one stream's cache resets at 1500
    positions (30 units) while the others go on."""
    ref = tiny_model.thinker
    ft = _fast(tiny_model, slots=1)
    fs, rs, rows = _staggered(ref, ft, speech_units, (0, 3, 7), 26)
    _check_rows(rows)
    for f, r in zip(fs, rs):
        assert (f.whisper.positions, f.whisper.resets) == (r.whisper.positions, r.whisper.resets)
    assert [f.whisper.resets for f in fs] == [0, 0, 1]  # unit 30 of the stream started at unit 7
    assert fs[2].whisper.positions == 50 * 3 and fs[1].whisper.positions == 50 * 29
    for st in fs + rs:
        (ft if st in fs else ref).close(st)


def test_reset_with_a_small_source_length_every_few_units(tiny_model, speech_units, monkeypatch):
    """With ``max_positions`` lowered to 230 on both paths, caches reset every 4 units, at different
    rounds per stream (rows that reset beside rows that do not, in one pass)."""
    ref = tiny_model.thinker
    ft = _fast(tiny_model, slots=1)
    monkeypatch.setattr(ref.audio, "max_positions", 230)
    monkeypatch.setattr(ft.audio, "max_positions", 230)
    fs, rs, rows = _staggered(ref, ft, speech_units, (0, 1, 2, 6), 10)
    _check_rows(rows)
    assert [f.whisper.resets for f in fs] == [r.whisper.resets for r in rs] == [2, 2, 2, 3]
    assert [f.whisper.positions for f in fs] == [r.whisper.positions for r in rs]


def test_one_layer_pass_per_round_for_streams_at_different_positions(tiny_model, speech_units):
    """A round with a stream at unit 0 (102-frame mel) and streams at units 2 and 5 runs the
    convolutions per mel length but the encoder layers once (counted by the stats and by a hook on
    layer 0's query projection), in step_units as in the audio call."""
    ft = _fast(tiny_model, slots=4)
    calls = {"q": 0}
    hook = ft.audio.apm.layers[0].self_attn.q_proj.register_forward_hook(
        lambda *a: calls.__setitem__("q", calls["q"] + 1))
    try:
        pol = DuplexPolicy(temperature=0.0, min_unit_tokens=2, max_unit_tokens=2)
        sts = [ft.new_stream(policy=pol) for _ in range(3)]
        for k, off in enumerate((2, 5)):
            for i in range(off):
                ft._audio_embeds_batch([sts[k + 1]], [_unit(speech_units, k + 1, i)])
        assert [st.whisper.positions for st in sts] == [0, 100, 250]
        p0, q0 = ft.stats["audio_passes"], calls["q"]
        ft._audio_embeds_batch(sts, [_unit(speech_units, 0, 0), _unit(speech_units, 1, 2), _unit(speech_units, 2, 5)])
        assert (ft.stats["audio_passes"] - p0, calls["q"] - q0) == (1, 1)
        assert [st.whisper.positions for st in sts] == [50, 150, 300]
        p0, q0 = ft.stats["audio_passes"], calls["q"]
        res = ft.step_units([UnitInput(st, _unit(speech_units, k, 1 + (0, 2, 5)[k])) for k, st in enumerate(sts)])
        assert all(not isinstance(r, Exception) for r in res)
        assert (ft.stats["audio_passes"] - p0, calls["q"] - q0) == (1, 1)
        for st in sts:
            ft.close(st)
    finally:
        hook.remove()


def test_pool_slots_are_taken_at_the_first_audio_unit_grow_and_come_back(tiny_model, speech_units):
    """A slot per stream from its first audio unit; the pool grows (reallocation: ``version`` + 1)
    when none is free, keeps the cached K/V of the streams it moved, and every slot comes back on
    close or when a stream is dropped without closing."""
    ref = tiny_model.thinker
    ft = _fast(tiny_model, slots=1)
    pool = ft.whisper_pool
    assert pool is ft.audio_batch.pool and (pool.n_slots, len(pool.free)) == (1, 1)
    d = ft.audio.apm.embed_positions.weight.shape[1]
    assert pool.max_len == 1504 and pool.nbytes() == 2 * 1 * 2 * 1504 * d * 4  # K+V, 1 layer, slot+scratch, fp32
    assert pool.slot_bytes() == 2 * 1 * 1504 * d * 4
    pol = DuplexPolicy(temperature=0.0)
    a = ft.new_stream(policy=pol)
    assert isinstance(a.whisper, WhisperStreamCache) and len(pool.free) == 1  # no audio yet: no slot
    ra = ref.new_stream(policy=pol)
    for i in range(2):
        torch.testing.assert_close(ft.audio_embeds_stream(a, _unit(speech_units, 0, i)),
                                   ref.audio_embeds_stream(ra, _unit(speech_units, 0, i)), atol=2e-5, rtol=1e-5)
    assert isinstance(a.whisper, PooledWhisperCache) and pool.free == []
    v0 = pool.version
    others = [ft.new_stream(policy=pol) for _ in range(3)]
    ft._audio_embeds_batch(others, [_unit(speech_units, 1, 0)] * 3)
    assert pool.version == v0 + 1 and pool.n_slots == 9 and len(pool.free) == 5
    # the stream whose slot was copied by the growth goes on as its reference does
    torch.testing.assert_close(ft.audio_embeds_stream(a, _unit(speech_units, 0, 2)),
                               ref.audio_embeds_stream(ra, _unit(speech_units, 0, 2)), atol=2e-5, rtol=1e-5)
    ft.close(a)
    assert isinstance(a.whisper, WhisperStreamCache) and a.whisper.positions == 0 and len(pool.free) == 6
    ft.close(others[0])
    del others[0]
    others.pop()  # dropped without close: the slot handle gives it back when collected
    gc.collect()
    assert len(pool.free) == 8
    ft.close(others[0])
    assert len(pool.free) == pool.n_slots == 9  # back to every slot free
    ref.close(ra)


def test_a_reference_path_cache_is_copied_into_the_pool(tiny_model, speech_units):
    """A stream whose first units went through the per-stream path (a plain WhisperStreamCache)
    continues on the batched path from the same cache."""
    from duplexkit.models.minicpmo45.thinker import Thinker

    ref = tiny_model.thinker
    ft = _fast(tiny_model, slots=2)
    pol = DuplexPolicy(temperature=0.0)
    st, rst = ft.new_stream(policy=pol), ref.new_stream(policy=pol)
    for i in range(4):
        Thinker.audio_embeds_stream(ft, st, _unit(speech_units, 2, i))  # the reference method itself
        ref.audio_embeds_stream(rst, _unit(speech_units, 2, i))
    assert isinstance(st.whisper, WhisperStreamCache) and st.whisper.positions == 200
    for i in range(4, 7):
        torch.testing.assert_close(ft._audio_embeds_batch([st], [_unit(speech_units, 2, i)])[0],
                                   ref.audio_embeds_stream(rst, _unit(speech_units, 2, i)), atol=2e-5, rtol=1e-5)
    assert isinstance(st.whisper, PooledWhisperCache) and st.whisper.positions == 350
    ft.close(st)
    ref.close(rst)


def test_bad_input_gives_the_same_typed_errors(tiny_model, speech_units):
    """A unit of the wrong size raises AudioInputError from the batched call and from step_units,
    before any stream's audio state changes (the good stream then steps as if nothing happened);
    no audio encoder gives ValueError; the reference encoder refuses a pooled cache (TypeError);
    a released cache is refused (ValueError)."""
    ref = tiny_model.thinker
    ft = _fast(tiny_model, slots=2)
    pol = DuplexPolicy(temperature=0.0, min_unit_tokens=2, max_unit_tokens=2)
    good, bad = ft.new_stream(policy=pol), ft.new_stream(policy=pol)
    rgood = ref.new_stream(policy=pol)
    for i in range(2):
        ft.step_units([UnitInput(good, _unit(speech_units, 0, i))])
        ref.audio_embeds_stream(rgood, _unit(speech_units, 0, i))
    free0 = list(ft.whisper_pool.free)
    state0 = (good.whisper.positions, good.mel.unit_index, bad.mel.unit_index)
    too_long = np.zeros(17000, np.float32)
    with pytest.raises(AudioInputError):  # the bad row first: raised before the good row's mel is pushed
        ft._audio_embeds_batch([bad, good], [too_long, _unit(speech_units, 0, 2)])
    assert (good.whisper.positions, good.mel.unit_index, bad.mel.unit_index) == state0
    with pytest.raises(AudioInputError):  # step_units undoes the good row's mel push
        ft.step_units([UnitInput(good, _unit(speech_units, 0, 2)), UnitInput(bad, too_long)])
    assert (good.whisper.positions, good.mel.unit_index, bad.mel.unit_index) == state0
    assert ft.whisper_pool.free == free0 and isinstance(bad.whisper, WhisperStreamCache)
    with pytest.raises(AudioInputError):
        ft.audio_embeds_stream(bad, np.zeros(16561, np.float32))
    ft.step_units([UnitInput(good, _unit(speech_units, 0, 2))])
    torch.testing.assert_close(good.last_audio_embeds, ref.audio_embeds_stream(rgood, _unit(speech_units, 0, 2)),
                               atol=2e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="pool"):
        ref.audio.encode_stream(torch.zeros(80, 104), good.whisper, False)
    stale = good.whisper
    ft.close(good)
    with pytest.raises(ValueError, match="released"):
        ft.audio_batch.adopt(stale)
    no_audio = _fast(tiny_model, slots=1)
    no_audio.audio = None
    with pytest.raises(ValueError, match="no audio encoder"):
        no_audio._audio_embeds_batch([bad], [_unit(speech_units, 0, 0)])
    ft.close(bad)
    ref.close(rgood)


def test_a_step_that_raises_after_a_reset_is_retried_to_the_reference(tiny_model, speech_units, monkeypatch):
    """step_units raising after the audio pass (which reset a cache and overwrote its first
    positions) restores positions and reset counts; the retry gives the reference embeddings."""
    ref = tiny_model.thinker
    ft = _fast(tiny_model, slots=2)
    monkeypatch.setattr(ref.audio, "max_positions", 200)
    monkeypatch.setattr(ft.audio, "max_positions", 200)
    pol = DuplexPolicy(temperature=0.0, min_unit_tokens=2, max_unit_tokens=2)
    sts, rss = [ft.new_stream(policy=pol) for _ in range(2)], [ref.new_stream(policy=pol) for _ in range(2)]
    for k, n in enumerate((4, 2)):  # stream 0 at 200 positions: its next unit resets
        for i in range(n):
            ft.step_units([UnitInput(sts[k], _unit(speech_units, k, i))])
            ref.audio_embeds_stream(rss[k], _unit(speech_units, k, i))
    before = [(st.whisper.positions, st.whisper.resets, st.mel.unit_index) for st in sts]
    assert before[0][:2] == (200, 0)
    audios = [_unit(speech_units, 0, 4), _unit(speech_units, 1, 2)]
    real = ft._prefill

    def failing(*a, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(ft, "_prefill", failing)
    with pytest.raises(RuntimeError, match="injected"):
        ft.step_units([UnitInput(st, a) for st, a in zip(sts, audios)])
    assert [(st.whisper.positions, st.whisper.resets, st.mel.unit_index) for st in sts] == before
    monkeypatch.setattr(ft, "_prefill", real)
    ft.step_units([UnitInput(sts[0], audios[0])])
    ft.step_units([UnitInput(sts[1], audios[1])])
    for st, rs, a in zip(sts, rss, audios):
        torch.testing.assert_close(st.last_audio_embeds, ref.audio_embeds_stream(rs, a), atol=2e-5, rtol=1e-5)
    assert sts[0].whisper.resets == rss[0].whisper.resets == 1
    for st in sts:
        ft.close(st)
    for rs in rss:
        ref.close(rs)


class _RerunGraph:
    """A stand-in for a captured CUDA graph on the CPU: ``replay()`` runs the captured function again
    on the same static input buffers and copies into the same static output."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())


def test_graph_plumbing_with_padding_rows_on_the_cpu(tiny_model, speech_units, monkeypatch):
    """The graph path's static buffers, padding rows (scratch slot, position 0), batch / KV buckets
    and invalidation on pool growth, with the capture replaced by a re-run (no GPU here): three
    staggered streams in the batch bucket of 4 give the reference rows; a pool growth recaptures."""
    from duplexkit.models.minicpmo45 import fast_whisper as FW

    keys = []

    def fake_capture(fn, device, *, pool=None, warmup=1):
        for _ in range(warmup):
            fn()
        out = fn()
        return _RerunGraph(fn, out), out

    monkeypatch.setattr(FW, "capture_graph", fake_capture)
    real_graph = FW._AudioGraph.__init__

    def init(self, bw, B, n, kv_len):
        keys.append((B, n, kv_len))
        real_graph(self, bw, B, n, kv_len)

    monkeypatch.setattr(FW._AudioGraph, "__init__", init)
    ref = tiny_model.thinker
    ft = _fast(tiny_model, slots=3)
    ft.audio_batch.use_graphs = True
    assert ft.audio_batch.warmup([3]) == 6 and keys == [(4, 50, L) for L in (256, 512, 768, 1024, 1280, 1504)]
    fs, rs, rows = _staggered(ref, ft, speech_units, (0, 4, 9), 4)
    _check_rows(rows)
    assert len(keys) == 6 + 2  # the single-stream lead-in units: bucket 1 at KV 256 and 512
    used = [g for (B, _, _), g in ft.audio_batch._graphs.items() if B == 4 and g.slots[0] != ft.whisper_pool.scratch]
    assert used and all(g.slots[3] == ft.whisper_pool.scratch and g.pos0[3] == 0 for g in used)  # the padding row
    v = ft.whisper_pool.version
    more = [ft.new_stream() for _ in range(2)]
    ft._audio_embeds_batch(more, [_unit(speech_units, 3, 0)] * 2)  # the pool grows: graphs are stale
    assert ft.whisper_pool.version == v + 1 and keys[-1] == (2, 50, 256)
    _, _, rows = _staggered(ref, ft, speech_units, (1, 2), 2)
    _check_rows(rows)
    for st in fs + more:
        ft.close(st)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager_for_staggered_streams(tiny_dir, speech_units, dtype):
    """On a GPU: the captured batched pass (graph per batch bucket x KV bucket, captured at warm-up)
    gives the eager pass's rows for streams at units 0, 3, 7 and 12 over 22 rounds (one crosses the
    1500-position reset), and both match the per-stream reference path; no capture after warm-up."""
    from duplexkit.models.minicpmo45 import load
    from duplexkit.models.minicpmo45.thinker import Thinker

    model = load(tiny_dir, devices="cuda", dtype=dtype, with_code2wav=False, with_talker=False, progress=False)
    th = model.thinker
    ref = Thinker(th.m, th.config, th.tokenizer, th.special, device=th.device, dtype=th.dtype)
    graphs = FastThinker.from_thinker(th, cuda_graphs=True, slots=4)
    eager = FastThinker.from_thinker(th, cuda_graphs=False, slots=4)
    n = graphs.warmup([1, 2, 4])
    assert graphs.stats["audio_graph_captures"] == 3 * 6 and n >= 18
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == "float32" else dict(atol=1e-2, rtol=1e-2)

    def near_reference(got, want):
        if dtype == "float32":
            torch.testing.assert_close(got, want, **tol)
        else:  # bf16: other GEMM shapes and attention lengths than the per-stream path round differently
            assert ((got - want).norm() / want.norm()).item() < 2e-2

    offsets = (0, 3, 7, 12)
    g_sts = [graphs.new_stream() for _ in offsets]
    e_sts = [eager.new_stream() for _ in offsets]
    r_sts = [ref.new_stream() for _ in offsets]
    idx = [0] * len(offsets)
    for k, off in enumerate(offsets):
        for _ in range(off):
            a = _unit(speech_units, k, idx[k])
            graphs._audio_embeds_batch([g_sts[k]], [a])
            eager._audio_embeds_batch([e_sts[k]], [a])
            ref.audio_embeds_stream(r_sts[k], a)
            idx[k] += 1
    for rnd in range(22):
        audios = [_unit(speech_units, k, idx[k]) for k in range(len(offsets))]
        g = graphs._audio_embeds_batch(g_sts, audios)
        e = eager._audio_embeds_batch(e_sts, audios)
        for k, a in enumerate(audios):
            r = ref.audio_embeds_stream(r_sts[k], a)
            torch.testing.assert_close(g[k].float(), e[k].float(), **tol)
            near_reference(g[k].float(), r.float())
            idx[k] += 1
    torch.cuda.synchronize()
    assert [st.whisper.resets for st in g_sts] == [st.whisper.resets for st in r_sts] == [0, 0, 0, 1]
    assert graphs.stats["audio_graph_captures"] == 18  # every key was captured at warm-up
    for st in g_sts:
        graphs.close(st)
    assert len(graphs.whisper_pool.free) == graphs.whisper_pool.n_slots


def test_a_closed_stream_is_refused_and_takes_no_pool_slot(tiny_model, speech_units):
    """Audio for a closed stream (``FastThinker.close`` gave its slot back) raises ValueError, as
    any later use of a closed stream does, instead of taking a fresh pool slot that only the
    stream's garbage collection would give back; nothing of the other streams in the call changes."""
    ft = _fast(tiny_model, slots=2)
    pool = ft.whisper_pool
    pol = DuplexPolicy(temperature=0.0)
    gone, live = ft.new_stream(policy=pol), ft.new_stream(policy=pol)
    ft._audio_embeds_batch([gone, live], [_unit(speech_units, 0, 0), _unit(speech_units, 1, 0)])
    ft.close(gone)
    free0 = list(pool.free)
    state0 = (live.whisper.positions, live.mel.unit_index, gone.mel.unit_index)
    with pytest.raises(ValueError, match="closed"):
        ft.audio_embeds_stream(gone, _unit(speech_units, 0, 1))
    with pytest.raises(ValueError, match="closed"):
        ft._audio_embeds_batch([live, gone], [_unit(speech_units, 1, 1), _unit(speech_units, 0, 1)])
    assert pool.free == free0 and isinstance(gone.whisper, WhisperStreamCache)
    assert (live.whisper.positions, live.mel.unit_index, gone.mel.unit_index) == state0
    ft.close(live)
    assert len(pool.free) == pool.n_slots


def test_a_failed_first_audio_step_gives_its_new_slot_back_at_once(tiny_model, speech_units, monkeypatch):
    """A step that raises after a stream's first audio unit took a pool slot restores the stream's
    plain cache and gives that slot back when it restores, not when the exception holding the
    failed call's frames is collected (a caller that keeps the exception kept the slot)."""
    ft = _fast(tiny_model, slots=1)
    pool = ft.whisper_pool
    pol = DuplexPolicy(temperature=0.0, min_unit_tokens=2, max_unit_tokens=2)
    st = ft.new_stream(policy=pol)
    assert isinstance(st.whisper, WhisperStreamCache) and len(pool.free) == 1

    def failing(*a, **kw):
        raise RuntimeError("injected")

    real = ft.audio_batch.forward
    monkeypatch.setattr(ft.audio_batch, "forward", failing)  # the Whisper pass itself (e.g. out of memory)
    kept = []
    try:
        ft.step_units([UnitInput(st, _unit(speech_units, 0, 0))])
    except RuntimeError as exc:
        kept.append(exc)  # the traceback (and the failed call's frames) stay alive
    assert kept and isinstance(st.whisper, WhisperStreamCache) and st.mel.unit_index == 0
    assert len(pool.free) == 1 and pool.n_slots == 1  # the slot is back: no growth on the retry
    monkeypatch.setattr(ft.audio_batch, "forward", real)
    (res,) = ft.step_units([UnitInput(st, _unit(speech_units, 0, 0))])
    assert not isinstance(res, Exception) and pool.n_slots == 1 and pool.free == []
    ft.close(st)
    assert pool.free == [0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_on_a_side_stream_across_a_pool_growth(tiny_dir, speech_units):
    """On a GPU, on a non-default stream (as the thinker runs with ``DUPLEXKIT_THINKER_STREAM=1``):
    two streams replay the captured pass, then two more streams make the pool grow (reallocated on
    that stream; every graph is dropped and captured again against the new pool): every round gives
    the eager rows, and the first streams' cached K/V survived the move."""
    from duplexkit.models.minicpmo45 import load

    model = load(tiny_dir, devices="cuda", dtype="float32", with_code2wav=False, with_talker=False, progress=False)
    th = model.thinker
    graphs = FastThinker.from_thinker(th, cuda_graphs=True, slots=2)
    eager = FastThinker.from_thinker(th, cuda_graphs=False, slots=2)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        graphs.warmup([1, 2])  # reserves 2 Whisper slots (a warm-up for 4 would reserve 4: no growth below)
    torch.cuda.synchronize()
    g_sts, e_sts, idx = [], [], []

    def add(n):
        g_sts.extend(graphs.new_stream() for _ in range(n))
        e_sts.extend(eager.new_stream() for _ in range(n))
        idx.extend([0] * n)

    def round_():
        audios = [_unit(speech_units, k, idx[k]) for k in range(len(g_sts))]
        with torch.cuda.stream(side):
            got = graphs._audio_embeds_batch(g_sts, audios)
        want = eager._audio_embeds_batch(e_sts, audios)
        torch.cuda.synchronize()
        for k, (g, e) in enumerate(zip(got, want)):
            torch.testing.assert_close(g.float(), e.float(), atol=2e-5, rtol=1e-5, msg=lambda m: f"stream {k}: {m}")
            idx[k] += 1

    add(2)
    for _ in range(3):
        round_()
    pool = graphs.whisper_pool
    v, caps = pool.version, graphs.stats["audio_graph_captures"]
    add(2)
    for _ in range(3):
        round_()
    assert pool.version == v + 1 and graphs.stats["audio_graph_captures"] > caps
    for st in g_sts:
        graphs.close(st)
    assert len(pool.free) == pool.n_slots
