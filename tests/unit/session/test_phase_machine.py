"""The Session's phase machine (duplexkit/session/machine.py): every (phase, event) cell of the
table, the machine driven alone and the real Session driven by real client events and engine
outputs, the one-assigner rule, and the generated diagram in docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from duplexkit.engine.api import DecideTools, Decision, EngineFailure, TextDelta, ToolCall, ToolDecision, TurnEnd
from duplexkit.protocol import ErrorCode, TransitionError
from duplexkit.session import TRANSITIONS, Phase, PhaseEvent, PhaseMachine
from duplexkit.session.machine import mermaid_diagram

from _driver import Driver, fixture_audio

ROOT = Path(__file__).resolve().parents[3]
CELLS = [(ph, ev) for ph in Phase for ev in PhaseEvent]


@pytest.mark.parametrize("phase,event", CELLS, ids=[f"{p.value}-{e.value}" for p, e in CELLS])
def test_machine_cell(phase, event):
    m = PhaseMachine(phase)
    want = TRANSITIONS[phase][event]
    if isinstance(want, ErrorCode):
        with pytest.raises(TransitionError) as ei:
            m.fire(event, event_id="evt_1")
        assert ei.value.code == want and ei.value.event_id == "evt_1"
        assert m.phase is phase
    elif want is None:
        assert m.fire(event) is None and m.phase is phase
    else:
        assert m.fire(event) is want and m.phase is want


def test_table_is_total_and_closed_absorbs():
    for ph in Phase:
        assert set(TRANSITIONS[ph]) == set(PhaseEvent)
    assert all(v is None for v in TRANSITIONS[Phase.CLOSED].values())
    # every phase but new is reachable and closed is reachable from every phase
    reach = {Phase.NEW}
    for _ in Phase:
        reach |= {v for ph in reach for v in TRANSITIONS[ph].values() if isinstance(v, Phase)}
    assert reach == set(Phase)
    assert all(TRANSITIONS[ph][PhaseEvent.CLOSE] is Phase.CLOSED for ph in Phase if ph is not Phase.CLOSED)


def test_only_the_machine_assigns_the_phase():
    """Outside ``PhaseMachine.__init__``/``fire`` no code in duplexkit/session assigns a phase (or
    the ``closed``/``_started`` flags the phases replaced)."""
    assigners = []
    for path in sorted((ROOT / "duplexkit" / "session").glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in ("phase", "_phase", "closed", "_started"):
                        assigners.append((path.name, fn.name))
    assert sorted(set(assigners)) == [("machine.py", "__init__"), ("machine.py", "fire")], assigners


# -------------------------------------------------------------------- the real Session, cell by cell
# Each phase is reached through the Session's inputs; each event is produced by the input that
# the Session maps to it. The Session must land where the table says, answer an error code with
# one ``error`` event of that code, and ignore what the table ignores.


def _to_new() -> Driver:
    return Driver(start=False)


def _to_idle() -> Driver:
    d = Driver()
    d.append(np.zeros(24000, np.float32))  # unit 0 (16,560 samples) exists, so a created response's forced unit is 1
    return d


def _to_requested(**create) -> Driver:
    d = _to_idle()
    d.send({"type": "response.create", **({"response": create} if create else {})})
    assert d.s.active_response_id is not None
    return d


def _to_speaking() -> Driver:
    d = _to_idle()
    d.speak(["Once upon "], end=False)
    return d


def _to_closed() -> Driver:
    d = _to_idle()
    d.send({"type": "close"})
    return d


REACH: dict[Phase, Callable[[], Driver]] = {
    Phase.NEW: _to_new, Phase.IDLE: _to_idle, Phase.REQUESTED: _to_requested,
    Phase.SPEAKING: _to_speaking, Phase.CLOSED: _to_closed,
}


def _forced_unit(d: Driver) -> int:
    r = d.s.resp.active()
    return r.forced_unit if r is not None and r.forced_unit is not None else d.last_unit()


def _barge_in(d: Driver) -> None:
    d.append(fixture_audio("interrupt_16k.wav")[:16000])


def _token_cap(d: Driver) -> None:
    r = d.s.resp.active()
    if r is not None:
        r.max_tokens = 1  # as response.create{max_output_tokens: 1} would have set it
    d.engine(TextDelta(d.sid, d.s.epoch, d.last_unit(), text="Hi", n_tokens=1))


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _tool_call(d: Driver) -> None:
    """The tool decider's call. In idle: a user turn with tools ends and the decider calls (the
    Session creates the response, then its output is the call). In requested: the response was
    created with ``tool_choice: required`` and waits for the decision."""
    if d.s.phase is Phase.IDLE:
        d.send({"type": "session.update", "session": {"tools": [WEATHER]}})
        d.append(fixture_audio("question_16k.wav")[:8000])
        d.send({"type": "input_audio_buffer.commit"})
    elif d.s.phase is Phase.REQUESTED and d.s.tools._decision is None:
        d.send({"type": "response.cancel"})
        d.send({"type": "session.update", "session": {"tools": [WEATHER]}})
        d.append(fixture_audio("question_16k.wav")[:8000])
        d.send({"type": "input_audio_buffer.commit"})
        d.send({"type": "response.create", "response": {"tool_choice": "required"}})
    asks = [c for c in d.cmds if isinstance(c, DecideTools)]
    rid = asks[-1].request_id if asks else "dec_none"
    d.engine(ToolDecision(d.sid, d.s.epoch, -1, request_id=rid, calls=(ToolCall("get_weather", '{"city": "Paris"}'),)))


STIMULI: dict[PhaseEvent, Callable[[Driver], None]] = {
    PhaseEvent.START: lambda d: (d.s.start(d.t), d.pump()),
    PhaseEvent.CREATE: lambda d: d.send({"type": "response.create"}),
    PhaseEvent.SPEAK: lambda d: d.engine(Decision(d.sid, d.s.epoch, d.last_unit(), decision="speak", turn_start=True)),
    PhaseEvent.LISTEN: lambda d: d.engine(Decision(d.sid, d.s.epoch, 0, decision="listen")),
    PhaseEvent.FORCED_LISTEN: lambda d: d.engine(Decision(d.sid, d.s.epoch, _forced_unit(d), decision="listen")),
    PhaseEvent.TURN_END: lambda d: d.engine(TurnEnd(d.sid, d.s.epoch, d.last_unit())),
    PhaseEvent.CANCEL: lambda d: d.send({"type": "response.cancel"}),
    PhaseEvent.BARGE_IN: _barge_in,
    PhaseEvent.TOKEN_CAP: _token_cap,
    PhaseEvent.FAIL: lambda d: d.engine(EngineFailure(d.sid, d.s.epoch, d.last_unit(), message="boom")),
    PhaseEvent.CLOSE: lambda d: d.send({"type": "close"}),
    PhaseEvent.TOOL_CALL: _tool_call,
}

# Cells whose input the Session maps to an earlier event first (the event needs an open response):
# the expected phase is the table's, applied in this order.
COMPOSED = {
    (Phase.REQUESTED, PhaseEvent.TOKEN_CAP): [PhaseEvent.SPEAK, PhaseEvent.TOKEN_CAP],
    (Phase.IDLE, PhaseEvent.TOKEN_CAP): [PhaseEvent.SPEAK],  # no response to cap: the text opens one
    # the decider's call creates the response first (then its filler response is created: requested)
    (Phase.IDLE, PhaseEvent.TOOL_CALL): [PhaseEvent.CREATE, PhaseEvent.TOOL_CALL, PhaseEvent.CREATE],
    (Phase.REQUESTED, PhaseEvent.TOOL_CALL): [PhaseEvent.TOOL_CALL, PhaseEvent.CREATE],
}
# Cells the Session never reaches through its inputs (a client event autostarts a new session;
# the input that would be the event is another event in that phase). Walked by test_machine_cell.
UNREACHABLE = {(Phase.NEW, ev) for ev in PhaseEvent if ev not in (PhaseEvent.START, PhaseEvent.CLOSE)}
UNREACHABLE |= {(Phase.SPEAKING, PhaseEvent.FORCED_LISTEN)}  # an opened response maps it to listen
UNREACHABLE |= {(Phase.SPEAKING, PhaseEvent.TOOL_CALL)}  # a response that speaks drops the decider's calls
SESSION_CELLS = [c for c in CELLS if c not in UNREACHABLE]


def _expected(phase: Phase, events: list) -> Phase:
    for ev in events:
        nxt = TRANSITIONS[phase][ev]
        phase = nxt if isinstance(nxt, Phase) else phase
    return phase


@pytest.mark.parametrize("phase,event", SESSION_CELLS, ids=[f"{p.value}-{e.value}" for p, e in SESSION_CELLS])
def test_session_cell(phase, event):
    d = REACH[phase]()
    assert d.s.phase is phase
    seen = len(d.events)
    STIMULI[event](d)
    want = TRANSITIONS[phase][event]
    errors = [e for e in d.events[seen:] if e["type"] == "error"]
    if isinstance(want, ErrorCode):
        assert d.s.phase is phase
        assert [e["error"]["code"] for e in errors] == [want.value]
        return
    assert d.s.phase is _expected(phase, COMPOSED.get((phase, event), [event]))
    if phase is not Phase.IDLE or event is not PhaseEvent.FAIL:  # a failure with nothing active is reported
        assert errors == []
    if phase is Phase.CLOSED:
        assert d.events[seen:] == []  # closed ignores everything


def test_requested_listen_before_forced_unit_keeps_the_response():
    d = _to_requested()
    assert _forced_unit(d) == 1
    d.engine(Decision(d.sid, d.s.epoch, 0, decision="listen"))
    assert d.s.phase is Phase.REQUESTED and d.s.active_response_id is not None


# -------------------------------------------------------------------------------- the diagram


def test_architecture_diagram_is_generated_from_the_table():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    start = "<!-- state-diagram:begin"
    assert start in doc, "docs/architecture.md lacks the generated state diagram (scripts/gen_state_diagram.py)"
    block = doc.split(start, 1)[1].split("-->", 1)[1].split("<!-- state-diagram:end -->", 1)[0]
    assert block.strip() == f"```mermaid\n{mermaid_diagram()}```".strip(), (
        "the diagram is stale: run python scripts/gen_state_diagram.py")
