"""The line a client command prints when its session ends without it (docs/cli.md, "When the server
ends the session"): each close code and ``session.closed`` reason of docs/protocol.md §1.5 gets what
happened and a next step that fits it. The e2e test (tests/e2e/test_cli_server_lines.py) drives the
shutdown case through real processes."""

from __future__ import annotations

import pytest

from duplexkit.cli.common import session_end_line
from duplexkit.clients import DuplexClient, InlineDuplexClient
from duplexkit.errors import DuplexConnectionError
from duplexkit.testing import ScriptedEngine


def _remote(reason, code):
    c = DuplexClient("ws://127.0.0.1:9")  # never connected: only its state is set
    c.state.close_reason, c.close_code = reason, code
    return c


@pytest.mark.parametrize("reason,code,said,next_step", [
    ("shutdown", 1001, "(close code 1001, session.closed reason 'shutdown')", "start it again"),
    ("server_error", 1011, "(close code 1011, session.closed reason 'server_error')", "the server's log says why"),
    ("timeout", 1000, "(close code 1000, session.closed reason 'timeout')", "--idle-timeout-s"),
    (None, 1008, "(close code 1008)", "peer not reading"),
    (None, 1001, "(close code 1001)", "the server is shutting down"),
])
def test_each_server_close_names_its_code_reason_and_next_step(reason, code, said, next_step):
    line = session_end_line(_remote(reason, code))
    assert line.startswith(f"the server closed the connection {said}: "), line
    assert next_step in line and "rerun" in line, line


def test_a_dropped_connection_says_it_was_lost():
    line = session_end_line(_remote(None, None), DuplexConnectionError("gone", code="connection_lost", close_code=1006))
    assert line == ("the connection to the server was lost (close code 1006): check that the server is still "
                    "running and reachable, then rerun this command")


def test_in_process_the_session_ended():
    c = InlineDuplexClient(ScriptedEngine())
    c.state.close_reason, c.close_code = "server_error", 1011
    line = session_end_line(c)
    assert line.startswith("the session ended (close code 1011, session.closed reason 'server_error'): "
                           "the engine failed"), line
