"""The Session's machines: what is emitted follows the transition taken (machine.py, MOVE_EMITS /
PHASE_EMITS), and the small machines (VAD item, held commit, unit hold, padding debt, trace wait,
turn hold) refuse what their tables do not list."""

from __future__ import annotations

import numpy as np
import pytest

from duplexkit.engine.api import TurnEnd
from duplexkit.session import TRANSITIONS, Phase, PhaseEvent, PhaseMachine
from duplexkit.session.machine import DELTA_EVENTS, LIFECYCLE_EVENTS, MOVE_EMITS, EmissionError, Machine

from _driver import Driver


def _requested() -> Driver:
    d = Driver()
    d.append(np.zeros(24000, np.float32))
    d.send({"type": "response.create"})
    assert d.s.phase is Phase.REQUESTED
    return d


def test_cancel_emits_response_done_per_the_table():
    d = _requested()
    out = d.send({"type": "response.cancel"})
    assert [e["response"]["status"] for e in out if isinstance(e, dict) and e["type"] == "response.done"] == ["cancelled"]
    assert d.s.phase is Phase.IDLE


def test_patched_table_makes_the_response_done_of_a_cancel_fail(monkeypatch):
    """``REQUESTED.cancel -> REQUESTED``: the cancel's response.done no longer follows the move the
    table made, so the Session fails with an internal error instead of emitting it."""
    d = _requested()
    monkeypatch.setitem(TRANSITIONS[Phase.REQUESTED], PhaseEvent.CANCEL, Phase.REQUESTED)
    out = d.send({"type": "response.cancel"})
    assert "response.done" not in [e["type"] for e in out if isinstance(e, dict)]
    errors = [e["error"] for e in out if isinstance(e, dict) and e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == "server_error" and "EmissionError" in errors[0]["message"]


def test_patched_table_fails_an_engine_turn_end(monkeypatch):
    """An engine output is not client input: the internal error propagates to the shell."""
    d = Driver()
    d.append(np.zeros(24000, np.float32))
    d.speak(["Once upon "], end=False)
    assert d.s.phase is Phase.SPEAKING
    monkeypatch.setitem(TRANSITIONS[Phase.SPEAKING], PhaseEvent.TURN_END, Phase.SPEAKING)
    with pytest.raises(EmissionError, match="response.output_audio.done"):
        d.s.receive_engine_output(TurnEnd(d.sid, d.s.epoch, d.last_unit(), reason="turn_eos"))


def test_patched_emits_fail_a_model_answer(monkeypatch):
    """The declared emissions are checked too: a move that no longer declares response.created."""
    d = Driver()
    d.append(np.zeros(24000, np.float32))
    monkeypatch.setitem(MOVE_EMITS, (Phase.IDLE, Phase.SPEAKING), MOVE_EMITS[(Phase.REQUESTED, Phase.SPEAKING)])
    with pytest.raises(EmissionError, match="response.created"):
        d.speak(["Hi "], end=False)


def test_check_emit_rules():
    m = PhaseMachine(Phase.IDLE)
    m.check_emit("session.updated")  # not a lifecycle event: always allowed
    for t in sorted(DELTA_EVENTS):
        with pytest.raises(EmissionError):
            m.check_emit(t)
    with pytest.raises(EmissionError, match="no transition"):
        m.check_emit("response.done")
    m.fire(PhaseEvent.CREATE)
    m.check_emit("response.created")
    with pytest.raises(EmissionError):
        m.check_emit("response.done")
    m.begin_step()  # a new input: the move of the last one no longer counts
    with pytest.raises(EmissionError):
        m.check_emit("response.created")
    m.fire(PhaseEvent.SPEAK)
    for t in sorted(DELTA_EVENTS):
        m.check_emit(t)


def test_every_declared_emission_is_a_lifecycle_event_of_a_real_move():
    moves = {(ph, nxt) for ph in Phase for nxt in TRANSITIONS[ph].values() if isinstance(nxt, Phase)}
    for move, events in MOVE_EMITS.items():
        assert move in moves, move
        assert events <= LIFECYCLE_EVENTS, events - LIFECYCLE_EVENTS


def test_small_machine_refuses_an_unlisted_pair():
    from enum import Enum

    class S(str, Enum):
        A = "a"
        B = "b"

    class E(str, Enum):
        GO = "go"
        BACK = "back"

    m = Machine("demo", {S.A: {E.GO: S.B}, S.B: {E.BACK: S.A}}, S.A)
    assert m.fire(E.GO) is S.B and m.state is S.B
    with pytest.raises(EmissionError, match="demo: event 'go' is not legal in state 'b'"):
        m.fire(E.GO)
    assert m.state is S.B
