"""The client core's dispatch table and its import graph.

* every handler of :class:`duplexkit.clients.ClientState` is reached through
  :data:`duplexkit.clients.state.HANDLERS` (event type -> method, written out), every key is a
  server event type the protocol defines, and an event type without a handler is only delivered;
* no module of ``duplexkit/clients`` takes part in an import cycle with another one, counting
  imports under ``TYPE_CHECKING`` and inside functions.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from duplexkit.audio import PlaybackBuffer
from duplexkit.clients import state as cs
from duplexkit.protocol.server_events import SERVER_EVENT_MODELS

CLIENTS = Path(cs.__file__).resolve().parent


def test_every_handler_is_in_the_table_and_every_key_is_a_server_event():
    methods = {name for name, _ in inspect.getmembers(cs.ClientState, inspect.isfunction) if name.startswith("_on_")}
    assert methods == {f.__name__ for f in cs.HANDLERS.values()}
    assert set(cs.HANDLERS) <= set(SERVER_EVENT_MODELS)


def test_the_table_is_written_out_and_no_handler_name_is_built():
    source = (CLIENTS / "state.py").read_text()
    for t in cs.HANDLERS:
        assert f'"{t}": ClientState._on_' in source  # what a search for the event type finds
    for path in CLIENTS.glob("*.py"):
        text = path.read_text()
        assert '"_on_" +' not in text and "f\"_on_{" not in text, path.name


def test_a_type_without_a_handler_is_delivered_and_changes_nothing():
    st = cs.ClientState(PlaybackBuffer())
    before = {k: v for k, v in vars(st).items() if k != "_out"}
    assert "session.heartbeat_ack" not in cs.HANDLERS
    acts = st.receive({"type": "session.heartbeat_ack", "session_id": "s", "server_event_seq": 4})
    assert [type(a) for a in acts] == [cs.Deliver] and acts[0].event.type == "session.heartbeat_ack"
    after = {k: v for k, v in vars(st).items() if k != "_out"}
    assert after.pop("last_server_event_seq") == 4
    before.pop("last_server_event_seq")
    assert after == before


def test_a_handler_is_looked_up_in_the_table(monkeypatch):
    seen = []
    monkeypatch.setitem(cs.HANDLERS, "session.heartbeat_ack", lambda state, ev, rec: seen.append(ev.type) or False)
    st = cs.ClientState(PlaybackBuffer())
    assert st.receive({"type": "session.heartbeat_ack", "session_id": "s"}) == []  # False: not delivered
    assert seen == ["session.heartbeat_ack"]
    # a body that did not validate gets no handler (only the session events are read leniently)
    assert [type(a) for a in st.receive({"type": "session.heartbeat_ack"})] == [cs.Deliver]
    assert seen == ["session.heartbeat_ack"]


# ------------------------------------------------------------------------------------------------
# import cycles
# ------------------------------------------------------------------------------------------------


def _client_imports(path: Path) -> set[str]:
    """Modules of duplexkit.clients that ``path`` imports anywhere (``__init__`` for the package)."""
    mods = {p.stem for p in CLIENTS.glob("*.py")}
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = node.module
            elif node.level == 0 and node.module and node.module.startswith("duplexkit.clients"):
                rest = node.module[len("duplexkit.clients"):].lstrip(".")
                base = rest or None
            else:
                continue
            if base is None:  # from . import x / from duplexkit.clients import x
                named = [a.name for a in node.names if a.name in mods]
                out.update(named or ["__init__"])
                if len(named) < len(node.names):
                    out.add("__init__")
            else:
                out.add(base.split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("duplexkit.clients"):
                    rest = a.name[len("duplexkit.clients"):].lstrip(".")
                    out.add(rest.split(".")[0] if rest else "__init__")
    out.discard(path.stem)
    return out


def test_no_import_cycles_in_the_client_package():
    graph = {p.stem: _client_imports(p) for p in CLIENTS.glob("*.py")}
    cycles: list[str] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == "__init__" and node != "__init__":
                cycles.append(f"{node} -> __init__ (the package itself)")
            elif state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []
    assert graph["actions"] == {"records"} and "base" not in graph["handles"]
