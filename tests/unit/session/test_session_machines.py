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


# ------------------------------------------------------------------ the small machines, tabled
import ast  # noqa: E402
from pathlib import Path  # noqa: E402

from duplexkit.session.holds import (  # noqa: E402
    DEBT_TABLE, HOLD_TABLE, DebtState, HoldState, PadDebt, UnitHold,
)
from duplexkit.session.pipeline import (  # noqa: E402
    HELD_COMMIT_TABLE, VAD_ITEM_TABLE, HeldCommit, VadItem,
)
from duplexkit.session.responses import TURN_HOLD_TABLE, TurnHold  # noqa: E402
from duplexkit.session.trace import TRACE_TABLE, TraceWait  # noqa: E402

from _driver import fixture_audio  # noqa: E402

TABLES = [(VAD_ITEM_TABLE, VadItem, VadItem.NONE), (HELD_COMMIT_TABLE, HeldCommit, HeldCommit.NONE),
          (DEBT_TABLE, DebtState, DebtState.CLEAR), (HOLD_TABLE, HoldState, HoldState.PASSING),
          (TRACE_TABLE, TraceWait, TraceWait.NONE), (TURN_HOLD_TABLE, TurnHold, TurnHold.NONE)]


@pytest.mark.parametrize("table,states,initial", TABLES, ids=[t[1].__name__ for t in TABLES])
def test_small_tables_are_closed_and_reachable(table, states, initial):
    assert set(table) == set(states)
    assert all(nxt in set(states) for row in table.values() for nxt in row.values())
    reach = {initial}
    for _ in states:
        reach |= {nxt for st in reach for nxt in table[st].values()}
    assert reach == set(states)


def test_pad_debt_machine_follows_a_real_early_close():
    """An early close owes its padding; silence after it pays it; holding from ``clear`` is refused."""
    sr = 16000
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    assert d.s.input.debt.state is DebtState.CLEAR
    d.append(np.zeros(2 * sr + 560 + 4240, np.float32))  # units 0 (16 560 samples) and 1, + 4 240
    d.send({"type": "input_audio_buffer.commit"})
    d.tick(100)  # the held commit's unit goes out (COMMIT_MERGE_MS)
    assert d.s.input.debt.state is DebtState.OWED and d.s.input.debt.owed() == sr - 4240
    d.append(np.zeros(sr // 2, np.float32))  # held: not yet known what the padding stood in for
    assert d.s.input.debt.state is DebtState.HOLDING
    d.append(np.zeros(sr, np.float32))  # past the debt + guard, no speech: the padding stood in for silence
    assert d.s.input.debt.state is DebtState.CLEAR and d.s.input.debt.owed() == 0
    with pytest.raises(EmissionError, match="padding debt: event 'hold' is not legal in state 'clear'"):
        PadDebt().hold(np.zeros(10, np.float32), 0)


def test_held_commit_machine():
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    d.append(np.zeros(4000, np.float32))
    d.send({"type": "input_audio_buffer.commit"})
    assert d.s.input._held_commit.state is HeldCommit.HELD
    d.tick(100)
    assert d.s.input._held_commit.state is HeldCommit.NONE


def test_vad_item_machine_follows_speech():
    d = Driver()
    speech = fixture_audio("question_16k.wav")
    d.append(speech[: len(speech) // 2])
    assert d.of("input_audio_buffer.speech_started") and d.s.state == "user_speaking"
    assert d.s.input._vad_state.state is VadItem.OPEN
    d.send({"type": "input_audio_buffer.commit"})  # the client commits the speech the VAD still hears
    assert d.s.input._vad_state.state is VadItem.COMMITTED
    d.append(np.zeros(16000, np.float32))
    assert d.of("input_audio_buffer.speech_stopped") and d.s.input._vad_state.state is VadItem.NONE


def test_unit_hold_machine():
    class U:
        audio = np.zeros(16000, np.float32)

    h = UnitHold()
    assert h.release(lambda end: True) == [] and h.state is HoldState.PASSING
    h.hold(U(), 100, False)
    h.hold(U(), 200, True)
    assert h.state is HoldState.HOLDING and h.samples() == 32000
    assert [s for _, s in h.release(lambda end: end <= 100)] == [False] and h.state is HoldState.HOLDING
    assert [s for _, s in h.release(lambda end: True)] == [True] and h.state is HoldState.PASSING
    assert h.samples() == 0


# ------------------------------------------------------------------ parts talk through methods
def _part_classes() -> dict:
    from duplexkit.session.conversation import Conversation
    from duplexkit.session.pipeline import InputPipeline
    from duplexkit.session.responses import Responses
    from duplexkit.session.settings import Settings
    from duplexkit.session.tools import Tools

    return {"opts": Settings, "conv": Conversation, "resp": Responses, "tools": Tools, "input": InputPipeline}


PARTS = _part_classes()
SESSION_DIR = Path(__file__).resolve().parents[3] / "duplexkit" / "session"


def _chain(node: ast.AST) -> list:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def test_parts_talk_through_methods():
    """In duplexkit/session, a part reaches another part only by calling a public method of it
    (``self._s.<part>.<method>(...)``): no reads or writes of another part's attributes, and
    nothing private of the Session (``self._s._x``)."""
    bad = []
    for path in sorted(SESSION_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            c = _chain(node)
            if c[:2] != ["self", "_s"] or len(c) < 3:
                continue
            if c[2].startswith("_"):
                bad.append((path.name, node.lineno, ".".join(c)))
            elif c[2] in PARTS and len(c) == 4 and (c[3].startswith("_") or not callable(getattr(PARTS[c[2]], c[3], None))):
                bad.append((path.name, node.lineno, ".".join(c)))
            elif isinstance(getattr(node, "ctx", None), ast.Store):
                bad.append((path.name, node.lineno, ".".join(c)))
    assert bad == []
