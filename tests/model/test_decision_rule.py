"""The pure duplex decision rule (duplex.start_unit / plan_step / decide) on hand-made rows, against
the rule as docs/model.md "The duplex unit policy" states it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from duplexkit.models.minicpmo45.duplex import DuplexPolicy, decide, plan_step, start_unit  # noqa: E402

SP = SimpleNamespace(listen=1, speak=2, tts_bos=3, turn_eos=4, chunk_eos=5, chunk_tts_eos=6, im_end=7,
                     terminators=frozenset({1, 5, 6}))
WORD = 100


def test_start_unit_forced_listen_keeps_a_force_speak_pending():
    pol = DuplexPolicy(force_listen_count=2)
    s = start_unit(pol, units_done=1, force_listen=False, force_speak=True, force_speak_pending=False, turn_ended=True)
    assert s.forced_listen and not s.force_speak and s.force_speak_pending and s.turn_ended and not s.turn_start
    s = start_unit(pol, units_done=2, force_listen=False, force_speak=False, force_speak_pending=True, turn_ended=True)
    assert not s.forced_listen and s.force_speak and not s.force_speak_pending
    assert s.turn_start and not s.turn_ended  # a forced speak opens an ended turn
    s = start_unit(pol, units_done=5, force_listen=False, force_speak=True, force_speak_pending=False, turn_ended=False)
    assert s.force_speak and not s.turn_start and not s.turn_ended  # already open: not a new turn


def test_plan_step_budget_cut_forced_first_step_and_min_tokens():
    pol = DuplexPolicy(budget=20)
    assert plan_step(pol, 19, False, False).cut and not plan_step(pol, 18, False, False).cut
    first = plan_step(pol, 0, True, True)
    assert not first.boundary and first.mask_listen and not first.must_continue
    assert plan_step(pol, 1, True, False).boundary and not plan_step(pol, 1, True, False).mask_listen
    pol = DuplexPolicy(min_unit_tokens=3, max_unit_tokens=4)
    assert plan_step(pol, 4, False, False).cut  # max_unit_tokens 4 -> step 4 feeds <|chunk_eos|>
    assert plan_step(pol, 0, False, True) == plan_step(DuplexPolicy(), 0, False, True)  # a listening unit is free
    p = plan_step(pol, 0, False, False)  # an open turn speaks: no boundary, terminators masked
    assert p.must_continue and not p.boundary
    assert plan_step(pol, 2, False, True).must_continue and not plan_step(pol, 3, False, True).must_continue


def test_decide_boundary_chunk_eos_ends_the_unit_before_the_main_pass():
    p = plan_step(DuplexPolicy(), 2, False, False)
    d = decide(SP, p, 2, SP.chunk_eos, WORD, turn_ended=False)
    assert d.token == SP.chunk_eos and d.terminator and not d.from_main and not d.turn_ended
    d = decide(SP, p, 2, WORD + 1, WORD, turn_ended=False)  # any other boundary id: the main pass decides
    assert d.token == WORD and d.from_main and not d.terminator and d.record


def test_decide_listen_becomes_tts_bos_while_the_turn_is_open():
    p = plan_step(DuplexPolicy(), 1, False, False)
    d = decide(SP, p, 1, WORD, SP.listen, turn_ended=False)
    assert d.token == SP.tts_bos and not d.terminator and d.record and not d.turn_ended
    d = decide(SP, p, 1, WORD, SP.listen, turn_ended=True)
    assert d.token == SP.listen and d.terminator and d.from_main  # turn ended: listen ends the unit


def test_decide_turn_eos_ends_the_turn_any_other_token_opens_it_recording_after_the_first():
    p = plan_step(DuplexPolicy(), 0, False, True)
    d = decide(SP, p, 0, WORD, WORD, turn_ended=True)
    assert d.turn_start and not d.turn_ended and not d.record  # the unit's first decided token is not recorded
    d = decide(SP, plan_step(DuplexPolicy(), 3, False, False), 3, WORD, SP.turn_eos, turn_ended=False)
    assert d.end_of_turn and d.turn_ended and not d.terminator and d.record
    d = decide(SP, plan_step(DuplexPolicy(), 3, False, False), 3, WORD, SP.chunk_tts_eos, turn_ended=False)
    assert d.terminator and d.token == SP.chunk_tts_eos
