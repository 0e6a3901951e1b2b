"""The fast talker's unit graph (duplexkit/models/minicpmo45/fast_talker.py ``_UnitGraph``): the
unit's prefill padded to ``PREFILL_ROWS`` inside the graph, batch padding rows, and the eager fallbacks (a prefill longer than ``PREFILL_ROWS``; a slot too close to
the 4096-position window's end for the padded rows) give the codes of the plain path.

On the CPU the unit code runs eagerly (``capture_units = False``), the same functions a CUDA graph
captures; the CUDA test captures them and compares with the plain path on the GPU."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from duplexkit.models.minicpmo45 import DuplexPolicy, UnitInput
from duplexkit.models.minicpmo45.fast_talker import PREFILL_ROWS, FastTalker
from duplexkit.models.minicpmo45.talker import TalkerInput, TalkerSampling

CUDA = torch.cuda.is_available()


def _speech(n: int, seed: int) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


@pytest.fixture(scope="module")
def units(tiny_model):
    """Three speaking units of the tiny thinker (8 tokens each: prefill 9 rows)."""
    th = tiny_model.thinker
    st = th.new_stream(policy=DuplexPolicy(temperature=0.0, min_unit_tokens=8, max_unit_tokens=8))
    out = []
    for i in range(3):
        (r,) = th.step_units([UnitInput(st, _speech(16560 if i == 0 else 16000, 900 + i), force_speak=i == 0)])
        out.append(r)
    th.close(st)
    return out


def _graph_shaped(tk) -> FastTalker:
    ft = FastTalker(tk, cuda_graphs=False, slots=2)
    ft.use_graphs, ft.capture_units = True, False  # the unit-graph code, run eagerly
    return ft


def _run(ft, units, seeds, sampling, start_at=None, long_ids=False, n_ids=None):
    turns = [ft.new_turn() for _ in seeds]
    gens = [None if s is None else torch.Generator(device=ft.device).manual_seed(s) for s in seeds]
    out = [[] for _ in seeds]
    for k, r in enumerate(units):
        ids, hid = r.token_ids, r.hidden
        if long_ids:  # a prefill longer than PREFILL_ROWS: the eager prefill before a decode-only unit
            reps = PREFILL_ROWS // len(ids) + 1
            ids, hid = np.tile(np.asarray(ids), reps), torch.as_tensor(hid).repeat(reps, 1)
        if n_ids is not None:
            ids, hid = np.asarray(ids)[:n_ids], torch.as_tensor(hid)[:n_ids]
        if start_at is not None and k == 0:
            for t in turns:
                t.ensure_slot()
                t.text_start_pos = start_at
        res = ft.generate_units([TalkerInput(turn=t, token_ids=ids, hidden=hid, generator=g, sampling=sampling,
                                             turn_start=k == 0 and start_at is None, turn_end=k == len(units) - 1)
                                 for t, g in zip(turns, gens)])
        for i, codes in enumerate(res):
            assert not isinstance(codes, BaseException), codes
            out[i].append(codes.tolist())
    return out


@pytest.mark.parametrize("sampling", [TalkerSampling(greedy=True), TalkerSampling(),
                                      TalkerSampling(top_k=25, top_p=0.9)], ids=["greedy", "reference", "filtered"])
def test_unit_graph_code_equals_the_plain_path(tiny_model, units, sampling):
    """Three turns in a batch bucket of 4 (one padding row), prefill padded from 9 to 32 rows: the
    codes of the plain CPU path, unit after unit."""
    tk = tiny_model.talker
    plain = FastTalker(tk, cuda_graphs=False, slots=2)
    ft = _graph_shaped(tk)
    seeds = [None, None, None] if sampling.greedy else [3, 4, 5]
    ref = _run(plain, units, seeds, sampling)
    got = _run(ft, units, seeds, sampling)
    assert got == ref
    assert sum(len(u) for u in ref[0]) > 25  # units spoke
    keys = list(ft._graphs)
    assert keys and all(k[0] == 4 and k[1] == PREFILL_ROWS for k in keys)  # prefill inside, bucket 4


def test_long_prefill_and_window_end_fall_back_to_the_eager_prefill(tiny_model, units):
    """A prefill of more than PREFILL_ROWS rows, and a slot whose padded rows would pass the
    4096-position window, run the prefill eagerly and a decode-only unit (key T = 0): same codes."""
    tk = tiny_model.talker
    s = TalkerSampling()
    plain = FastTalker(tk, cuda_graphs=False, slots=2)
    ft = _graph_shaped(tk)
    assert _run(ft, units[:1], [7], s, long_ids=True) == _run(plain, units[:1], [7], s, long_ids=True)
    assert {k[1] for k in ft._graphs} == {0}
    ft._graphs.clear()
    max_pos = tk.config.max_position_embeddings
    start = max_pos - 30  # 3 tokens + audio_bos + 24 steps fit; 32 padded prefill rows do not
    kw = dict(start_at=start, n_ids=3)
    assert _run(ft, units[:1], [8], s, **kw) == _run(plain, units[:1], [8], s, **kw)
    assert {k[1] for k in ft._graphs} == {0}


def test_prefill_rows_are_checked(tiny_model):
    with pytest.raises(ValueError, match="prefill_rows"):
        FastTalker(tiny_model.talker, cuda_graphs=False, prefill_rows=-1)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_captured_unit_equals_the_plain_path_on_cuda(tiny_model, units):
    """The captured unit (prefill in the graph) against the uncaptured fast path
    on the GPU in float32: the same codes for greedy and seeded sampling, two turns at different
    positions, then a second batch of one turn (a smaller batch in the same bucket's graph)."""
    tk = copy.deepcopy(tiny_model.talker).to("cuda")
    for layer in tk.model.layers:  # fused weights of an earlier FastTalker are plain attributes: refuse on CUDA
        for name in ("_dk_qkv", "_dk_gu", "_dk_qk_gain"):
            layer.__dict__.pop(name, None)
    plain = FastTalker(tk, cuda_graphs=False, slots=2)
    ft = FastTalker(tk, cuda_graphs=True, slots=2)
    for sampling, seeds in ((TalkerSampling(greedy=True), [None, None]), (TalkerSampling(), [11, 12])):
        assert _run(ft, units, seeds, sampling) == _run(plain, units, seeds, sampling)
        assert _run(ft, units[:2], seeds[:1], sampling) == _run(plain, units[:2], seeds[:1], sampling)
    assert ft.stats["graph_captures"] >= 1 and all(k[1] == PREFILL_ROWS for k in ft._graphs)
