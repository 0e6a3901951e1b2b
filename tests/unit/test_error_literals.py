"""Error codes have one home: the ``ErrorCode`` enum of duplexkit/errors.py.

Every other module names a code as ``ErrorCode.X`` (``ErrorCode.X.value`` where a plain string is
needed) and builds ``error`` events through ``ErrorEvent.of`` / ``ProtocolError``, never as a
string literal or a hand-built dict. Checked on the source with ``ast`` (docstrings are prose and
do not count).
"""

from __future__ import annotations

import ast
from pathlib import Path

from duplexkit.errors import ErrorCode

ROOT = Path(__file__).resolve().parents[2]
HOME = "duplexkit/errors.py"
#: Modules still allowed to spell codes as literals, each with the reason (none today).
ALLOWLIST: dict = {}
CODES = {c.value for c in ErrorCode}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def code_literals(source: str) -> list[tuple[int, str]]:
    """(line, code) of every string literal in ``source`` that is an :class:`ErrorCode` value."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return sorted((n.lineno, n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in CODES
                  and id(n) not in docs)


def error_dicts(source: str) -> list[int]:
    """Lines of dict literals ``{"type": "error", ...}`` (an ``error`` event built by hand)."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Dict):
            for k, v in zip(n.keys, n.values):
                if (isinstance(k, ast.Constant) and k.value == "type" and isinstance(v, ast.Constant)
                        and v.value == "error"):
                    out.append(n.lineno)
    return out


def _files():
    for base in ("duplexkit", "server"):
        for path in sorted((ROOT / base).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == HOME or any(rel.startswith(prefix) for prefix in ALLOWLIST):
                continue
            yield rel, path.read_text()


def test_the_checks_find_what_they_look_for():
    src = '''
def f():
    """A docstring naming "bad_audio" is prose."""
    raise ProtocolError("bad_audio", "x")
x = {"type": "error", "error": {"code": ErrorCode.BAD_EVENT.value}}
'''
    assert code_literals(src) == [(4, "bad_audio")]
    assert error_dicts(src) == [5]
    assert code_literals('y = "bad_audio is a phrase"') == []


def test_no_error_code_literal_outside_errors_py():
    found = [f"{rel}:{line}: {code!r} (use ErrorCode.{ErrorCode(code).name})"
             for rel, src in _files() for line, code in code_literals(src)]
    assert found == []


def test_no_hand_built_error_event():
    found = [f"{rel}:{line}: build it with ErrorEvent.of" for rel, src in _files() for line in error_dicts(src)]
    assert found == []


def test_allowlisted_paths_exist():
    for prefix in ALLOWLIST:
        assert (ROOT / prefix).exists(), f"{prefix} is gone: drop it from ALLOWLIST"


def test_handshake_error_is_built_from_the_error_table():
    """A refused handshake's ``error`` event (server/realtime.py) comes from ``ErrorEvent.of``: its
    type is the §9 table's and its code follows the profile's naming."""
    from duplexkit_server.realtime import _handshake_error

    ev = _handshake_error(ErrorCode.UNAUTHORIZED, "missing or invalid API key", naming="openai")
    assert ev["type"] == "error" and ev["server_event_seq"] == 1
    assert ev["error"] == {"type": "invalid_request_error", "code": "invalid_api_key",
                           "message": "missing or invalid API key"}
    cap = _handshake_error(ErrorCode.SESSION_CAPACITY_EXHAUSTED, "full", naming="openai")
    assert cap["error"]["type"] == "rate_limit_error" and cap["error"]["code"] == "session_capacity_exhausted"
    resume = _handshake_error(ErrorCode.RESUME_JOURNAL_OVERFLOW, "gone", seq=None, client_event_id="c1")
    assert "server_event_seq" not in resume
    assert resume["error"] == {"type": "server_error", "code": "resume_journal_overflow", "message": "gone",
                               "event_id": "c1"}
    bad = _handshake_error(ErrorCode.BAD_EVENT, "dialect must be ...", "dialect")
    assert bad["error"]["param"] == "dialect" and bad["error"]["code"] == "bad_event"
