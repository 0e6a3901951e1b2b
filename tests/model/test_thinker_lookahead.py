"""The fast thinker's one-step lookahead (duplexkit/models/minicpmo45/fast_thinker.py, ``decode_rows``
in duplex.py): the next decode step is launched with every row's main-pass choice before the host
reads the choices, and kept only when it is what the plain step computes. On vs off must give the
same tokens, decisions, recorded hidden states, KV lengths and contents, and generator states; the
counters show that the launched step is both kept and redone. CPU with the tiny checkpoint (no
graphs: the logic is what is tested); the last test compares on vs off with CUDA graphs on a GPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from duplexkit.models.minicpmo45 import DuplexPolicy, UnitInput
from duplexkit.models.minicpmo45 import duplex as D
from duplexkit.models.minicpmo45.fast_thinker import LOOKAHEAD_ENV, FastThinker, lookahead_enabled


def _speech(n: int, seed: int) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


N_UNITS = 5


def _audio(stream: int, unit: int) -> np.ndarray:
    return _speech(16560 if unit == 0 else 16000, 1000 * stream + unit)


def _streams(temperature: float):
    """Three streams of different policies: (policy, seed, force_speak units, force_listen units)."""
    return [
        # forced speak, a fixed token count per speaking unit: the launched step is always kept
        (DuplexPolicy(temperature=temperature, min_unit_tokens=5, max_unit_tokens=5), 11, {0, 3}, set()),
        # forced listen (first unit by count, units 2-3 by input), free to stop at any step otherwise
        (DuplexPolicy(temperature=temperature, force_listen_count=1), 12, {1}, {2, 3}),
        # stops early (at most 2 tokens, or at 3 characters of text) while the first row goes on
        (DuplexPolicy(temperature=temperature, min_unit_tokens=1, max_unit_tokens=2, max_unit_chars=3), 13,
         {0, 2, 4}, set()),
    ]


def _run(th, temperature: float, order=(0, 1, 2)):
    """Run N_UNITS units of the three streams (of :func:`_streams`, in batch order ``order``) in one
    batch each; returns the per-unit results and the final state of every stream (before closing it)."""
    cfg = [_streams(temperature)[k] for k in order]
    sts = [th.new_stream(policy=pol, seed=seed) for pol, seed, _, _ in cfg]
    units = []
    for i in range(N_UNITS):
        items = [UnitInput(st, _audio(k, i), force_speak=i in fs, force_listen=i in fl)
                 for k, (st, (_, _, fs, fl)) in enumerate(zip(sts, cfg))]
        res = th.step_units(items)
        for r in res:
            assert not isinstance(r, Exception), r
        units.append(res)
    final = []
    for st in sts:
        L = st.kv.length
        final.append(dict(length=L, history=list(st.history), pending=list(st.pending_ids),
                          turn_ended=st.turn_ended,
                          gen=None if st.generator is None else st.generator.get_state().clone(),
                          dev_gen=None if getattr(st, "_dev_gen", None) is None else st._dev_gen.get_state().clone(),
                          k=th.pool.k[:, st.kv.slot, :L].clone(), v=th.pool.v[:, st.kv.slot, :L].clone()))
        th.close(st)
    return units, final


def _assert_same(off, on):
    (u_off, f_off), (u_on, f_on) = off, on
    for res_off, res_on in zip(u_off, u_on):
        for a, b in zip(res_off, res_on):
            assert a.generated_ids == b.generated_ids
            assert (a.decision, a.turn_start, a.end_of_turn, a.n_tokens, a.text) == \
                   (b.decision, b.turn_start, b.end_of_turn, b.n_tokens, b.text)
            np.testing.assert_array_equal(a.token_ids, b.token_ids)
            assert a.hidden.shape == b.hidden.shape and torch.equal(a.hidden, b.hidden)
            assert a.timings["decode_steps"] == b.timings["decode_steps"]
            assert a.timings["batch"] == b.timings["batch"]
    for a, b in zip(f_off, f_on):
        assert (a["length"], a["history"], a["pending"], a["turn_ended"]) == \
               (b["length"], b["history"], b["pending"], b["turn_ended"])
        assert (a["gen"] is None) == (b["gen"] is None)  # None when greedy
        assert a["gen"] is None or torch.equal(a["gen"], b["gen"])  # the same draws, in the same order
        assert (a["dev_gen"] is None) == (b["dev_gen"] is None)
        assert a["dev_gen"] is None or torch.equal(a["dev_gen"], b["dev_gen"])  # a CUDA stream's draws
        assert torch.equal(a["k"], b["k"]) and torch.equal(a["v"], b["v"])


@pytest.fixture(scope="module")
def thinkers(tiny_model):
    """(lookahead off, lookahead on) fast thinkers sharing the tiny checkpoint's weights."""
    return (FastThinker.from_thinker(tiny_model.thinker, cuda_graphs=False, slots=3, lookahead=False),
            FastThinker.from_thinker(tiny_model.thinker, cuda_graphs=False, slots=3, lookahead=True))


def _counts(th):
    return {k: th.stats[k] for k in ("decode_steps", "lookahead_hits", "lookahead_misses")}


def _boundary_fires_on(divisor: int, monkeypatch) -> None:
    """Make the boundary pass choose ``<|chunk_eos|>`` whenever the main-pass choice is a multiple
    of ``divisor`` (the tiny random checkpoint almost never picks a terminator itself), so rows stop
    mid-unit by a decision -- after the step that would feed them was launched."""
    real = D.decide

    def decide(sp, plan, j, bnd, main, turn_ended):
        return real(sp, plan, j, sp.chunk_eos if main % divisor == 0 else bnd, main, turn_ended)

    monkeypatch.setattr(D, "decide", decide)


def _row_stops_at(index: int, step: int, monkeypatch) -> None:
    """Make the ``index``-th deciding row of every batch step ``step`` stop (its boundary pass
    choosing ``<|chunk_eos|>``), whatever its plan: a row leaves the batch while the others go on."""
    real_plan, real_decide = D.plan_step, D.decide
    seen = {"k": 0}

    def plan_step(*a, **kw):
        seen["k"] = 0  # a new batch step: its plans come before its decisions
        return real_plan(*a, **kw)

    def decide(sp, plan, j, bnd, main, turn_ended):
        k, seen["k"] = seen["k"], seen["k"] + 1
        if j == step and k == index:
            return real_decide(sp, dataclasses.replace(plan, boundary=True), j, sp.chunk_eos, main, turn_ended)
        return real_decide(sp, plan, j, bnd, main, turn_ended)

    monkeypatch.setattr(D, "plan_step", plan_step)
    monkeypatch.setattr(D, "decide", decide)


@pytest.mark.parametrize("stops", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.2])
def test_lookahead_on_equals_off(thinkers, temperature, stops, monkeypatch):
    off_th, on_th = thinkers
    if stops:
        _boundary_fires_on(4, monkeypatch)
    c_off, c_on = _counts(off_th), _counts(on_th)
    off = _run(off_th, temperature)
    on = _run(on_th, temperature)
    _assert_same(off, on)
    d_off = {k: off_th.stats[k] - v for k, v in c_off.items()}
    d_on = {k: on_th.stats[k] - v for k, v in c_on.items()}
    assert d_off["lookahead_hits"] == d_off["lookahead_misses"] == 0  # off: nothing launched ahead
    assert d_on["decode_steps"] == d_off["decode_steps"]  # steps whose results were used
    # a kept launch is one plain step fewer; a row that stops by a decision changes the batch: redo
    assert d_on["lookahead_hits"] > 0
    if stops:
        assert d_on["lookahead_misses"] > 0
        free = [r for res in off[0] for r in res[1:2]]  # the stream without min / max unit tokens
        assert any(r.generated_ids[-2] == off_th.special.chunk_eos and 0 < r.timings["decode_steps"] < 19
                   for r in free)  # stopped mid-unit by the boundary pass
    assert d_on["lookahead_hits"] <= d_on["decode_steps"]
    spoke = sum(r.n_tokens for res in off[0] for r in res)
    assert spoke > 2 * N_UNITS  # units spoke: there was decoding to speculate on
    stopped_early = [r for res in off[0] for r in res[2:3] if r.decision == "speak"]
    assert stopped_early and all(len(r.generated_ids) <= 2 + 2 for r in stopped_early)


def test_fixed_length_units_keep_every_launch(thinkers):
    """One stream speaking 5 tokens per unit (terminators masked): every decode step's forward is
    the launched one (fails if speculation never hits)."""
    _, th = thinkers
    st = th.new_stream(policy=DuplexPolicy(temperature=0.7, min_unit_tokens=5, max_unit_tokens=5), seed=3)
    before = _counts(th)
    for i in range(3):
        (r,) = th.step_units([UnitInput(st, _audio(7, i), force_speak=i == 0)])
        assert r.n_tokens == 4 and r.timings["decode_steps"] == 5  # 5 fed (the first is not recorded)
    th.close(st)
    d = {k: th.stats[k] - v for k, v in before.items()}
    assert d == {"decode_steps": 15, "lookahead_hits": 15, "lookahead_misses": 0}


def test_no_launch_ahead_of_a_listening_streams_first_decision(thinkers, monkeypatch):
    """Listen units (the stream's turn has ended; the model answers <|listen|> at its first decision):
    nothing is launched ahead of that decision, so no step is thrown away; a unit that speaks instead
    is launched ahead from its second step on. Results equal the plain path either way."""
    off_th, on_th = thinkers
    sp = off_th.special
    real = D.decide
    speak_at = {3}  # unit index that speaks; the others listen

    def decide(spc, plan, j, bnd, main, turn_ended):
        if j == 0 and turn_ended and seen["unit"] not in speak_at:
            return real(spc, plan, j, bnd, sp.listen, turn_ended)
        return real(spc, plan, j, bnd, main, turn_ended)

    monkeypatch.setattr(D, "decide", decide)

    def run(th):
        st = th.new_stream(policy=DuplexPolicy(temperature=0.7, max_unit_tokens=4), seed=5)
        out = []
        before = _counts(th)
        for i in range(5):
            seen["unit"] = i
            (r,) = th.step_units([UnitInput(st, _audio(9, i))])
            out.append((r.decision, r.generated_ids, r.timings["decode_steps"]))
        th.close(st)
        return out, {k: th.stats[k] - v for k, v in before.items()}

    seen = {"unit": 0}
    off, _ = run(off_th)
    on, d = run(on_th)
    assert on == off
    assert [x[0] for x in off[:4]] == ["listen", "listen", "listen", "speak"]
    assert d["lookahead_misses"] <= 1  # at most the speaking unit's last launch (it ends by a decision)
    assert d["lookahead_hits"] >= 1  # the speaking unit's later steps were launched ahead


def test_a_decision_other_than_the_launched_token_redoes_the_step(thinkers, monkeypatch):
    """A row that goes on with another token than its main-pass choice (as ``<|listen|>`` becoming
    ``<|tts_bos|>``): the launched step is dropped and the step is fed again at the same positions
    (the launched KV rows are overwritten), so everything after it matches the plain path."""
    off_th, on_th = thinkers
    sp = off_th.special
    real = D.decide

    def decide(spc, plan, j, bnd, main, turn_ended):
        d = real(spc, plan, j, bnd, main, turn_ended)
        if j == 2 and not d.terminator:
            swap = sp.tts_bos if d.token != sp.tts_bos else sp.unit
            d = dataclasses.replace(d, token=swap)
        return d

    monkeypatch.setattr(D, "decide", decide)
    before = _counts(on_th)
    off = _run(off_th, 0.7)
    on = _run(on_th, 0.7)
    _assert_same(off, on)
    d = {k: on_th.stats[k] - v for k, v in before.items()}
    swapped = sum(1 for res in off[0] if max(r.timings["decode_steps"] for r in res) >= 3)  # batch steps
    assert swapped > 0 and d["lookahead_misses"] >= swapped and d["lookahead_hits"] > 0


def test_no_launch_past_the_pool(tiny_model):
    """A row without a free position is not launched ahead: the plain step raises
    ContextFullError as without lookahead (the step is undone for the stream)."""
    from duplexkit.models.minicpmo45.fast_kv import ContextFullError

    th = FastThinker.from_thinker(tiny_model.thinker, cuda_graphs=False, slots=1, lookahead=True)
    st = th.new_stream(policy=DuplexPolicy(temperature=0.0, min_unit_tokens=5, max_unit_tokens=5, window_high=None,
                                           window_low=None))
    assert th._speculate([st], torch.zeros(1, dtype=torch.long)) is not None  # room: launched
    st.kv.length = th.pool.max_len
    assert th._speculate([st], torch.zeros(1, dtype=torch.long)) is None
    with pytest.raises(ContextFullError):
        th._decode_step([st.kv], [0])
    th.close(st)


def test_lookahead_setting(monkeypatch):
    monkeypatch.delenv(LOOKAHEAD_ENV, raising=False)
    assert lookahead_enabled("cpu") is False and lookahead_enabled("cuda") is True
    for v, want in (("0", False), ("off", False), ("1", True), ("Yes", True), ("", False)):
        monkeypatch.setenv(LOOKAHEAD_ENV, v)
        assert lookahead_enabled("cpu") is want
    monkeypatch.setenv(LOOKAHEAD_ENV, "0")
    assert lookahead_enabled("cuda") is False
    monkeypatch.setenv(LOOKAHEAD_ENV, "maybe")
    with pytest.raises(ValueError, match=LOOKAHEAD_ENV):
        lookahead_enabled("cuda")


def test_host_read_on_cpu():
    t = torch.tensor([[1, 2], [3, 4]])
    r = D.HostRead(t)
    t.fill_(0)  # the read holds its own copy
    assert r.wait() == [[1, 2], [3, 4]]


def test_a_launch_kept_for_the_rows_that_go_on(thinkers, monkeypatch):
    """With CUDA graphs a launch is kept for a subset of its rows when the subset's graph is the
    launch's (rows that stopped leave their row unused). On the CPU every batch size is a forward of
    its own; here the step key is made to ignore the batch size, so subsets are kept and each row
    must find its own results (``logits_row`` / hidden row bookkeeping)."""
    from duplexkit.models.minicpmo45 import fast_thinker as FT

    off_th, on_th = thinkers
    _boundary_fires_on(4, monkeypatch)
    real = FastThinker._step_key
    monkeypatch.setattr(on_th, "_step_key", lambda kvs: (0, real(on_th, kvs)[1]))
    kept_rows = []
    real_reuse = FT._Speculation.reuse

    def reuse(self, sts):
        out = real_reuse(self, sts)
        if out is not None:
            kept_rows.append(out[2])
        return out

    monkeypatch.setattr(FT._Speculation, "reuse", reuse)
    before = _counts(on_th)
    order = (1, 2, 0)  # the streams that stop first lead the batch
    off = _run(off_th, 0.7, order)
    on = _run(on_th, 0.7, order)
    d = {k: on_th.stats[k] - v for k, v in before.items()}
    assert d["lookahead_misses"] <= 1 and d["lookahead_hits"] == d["decode_steps"]  # kept though rows stopped
    assert any(rows != list(range(len(rows))) for rows in kept_rows)  # a row other than the first stopped
    (u_off, f_off), (u_on, f_on) = off, on
    for res_off, res_on in zip(u_off, u_on):
        for a, b in zip(res_off, res_on):
            assert a.generated_ids == b.generated_ids
            torch.testing.assert_close(a.hidden, b.hidden, atol=1e-5, rtol=0)  # another batch size's forward
    for a, b in zip(f_off, f_on):
        assert (a["length"], a["history"]) == (b["length"], b["history"]) and torch.equal(a["gen"], b["gen"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("case", ["one_row_stops", "mixed"])
def test_lookahead_on_equals_off_with_cuda_graphs(tiny_dir, dtype, temperature, case, monkeypatch):
    """On a GPU with captured decode steps: every result is the plain path's, bit for bit, also on
    a dedicated thinker CUDA stream. ``one_row_stops``: four streams speaking 5 tokens a unit (graph
    bucket 4), the second row stops at step 2: the launch is kept for the three rows that go on (the
    same graph). ``mixed``: the three policies of the CPU test and a fourth stream, rows stopping
    by the boundary pass."""
    from duplexkit.engine.thinker_stream import ThinkerCudaStream
    from duplexkit.models.minicpmo45 import fast_thinker as FT
    from duplexkit.models.minicpmo45 import load

    model = load(tiny_dir, devices="cuda", dtype=dtype, with_code2wav=False, with_talker=False, progress=False)
    off_th = FastThinker.from_thinker(model.thinker, cuda_graphs=True, slots=4, lookahead=False)
    on_th = FastThinker.from_thinker(model.thinker, cuda_graphs=True, slots=4, lookahead=True)
    if case == "one_row_stops":
        order = (0, 0, 0, 0)
        _row_stops_at(1, 2, monkeypatch)
    else:
        order = (1, 2, 0, 1)
        _boundary_fires_on(4, monkeypatch)
    kept_subsets = []
    real_reuse = FT._Speculation.reuse

    def reuse(self, sts):
        out = real_reuse(self, sts)
        if out is not None and len(out[2]) < len(self.row_of):
            kept_subsets.append(out[2])
        return out

    monkeypatch.setattr(FT._Speculation, "reuse", reuse)
    off = _run(off_th, temperature, order)
    on = _run(on_th, temperature, order)
    torch.cuda.synchronize()
    _assert_same(off, on)
    assert on_th.stats["lookahead_hits"] > 0
    assert on_th.stats["decode_steps"] == off_th.stats["decode_steps"]
    if case == "one_row_stops":
        assert [0, 2, 3] in kept_subsets  # the launch served the rows that went on after row 1 stopped
    ts = ThinkerCudaStream("cuda")
    with ts.scope():
        on2 = _run(on_th, temperature, order)
    torch.cuda.synchronize()
    _assert_same(off, on2)
