"""The browser page against the REAL tiny engine (random weights, the three-stage runtime) behind
``duplexkit serve tiny``: one scenario, in the compat profile, with generous timeouts (slow on CPU).

Random weights never end a turn: the server's tiny defaults (``on_request`` answers, a small token
cap) make the answer to the fake-mic question end ``incomplete`` (cap) or ``completed``. The test
checks that appends reach the server, the answer is played and, once played, acknowledged in full.
"""

from __future__ import annotations

import httpx
import pytest

from _serverproc import ServerProc
from _page import TRACK_MIC, TRACK_STATES, wait_health
from _timing import bound

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.engine]
pytest.importorskip("torch")


def test_tiny_turn_in_the_browser(question_browser):
    with ServerProc("tiny", "--max-output-tokens", "40", "--layout", "cpu", ready_timeout_s=600) as srv:
        assert httpx.get(srv.url + "/health").json()["random_weights"] is True
        ctx = question_browser.new_context(permissions=["microphone"])
        ctx.add_init_script(TRACK_MIC)
        page = ctx.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            page.goto(srv.url + "/")
            page.select_option("#profile", "compat")
            page.click("#start")
            page.wait_for_function("() => window.duplexkit.state === 'listening'", timeout=bound(120_000))
            wait_health(srv, lambda h: h["input_appends"] > 0, 10, "no append in 10 s")
            page.wait_for_function(
                "() => { const r = window.duplexkit.responses[0]; return r && r.status !== 'in_progress'"
                " && r.acked !== null; }", timeout=bound(600_000))
            r = page.evaluate("""() => { const r = window.duplexkit.responses[0];
                return {status: r.status, sentMs: r.sentMs, acks: window.duplexkit.acks,
                        states: window.duplexkit.states, shown: r.el.dataset.playedMs}; }""")
            assert r["status"] in ("completed", "incomplete"), r
            assert r["sentMs"] > 0, r
            assert [(a["played_ms"], a["truncate"]) for a in r["acks"]] == [(r["sentMs"], False)], r
            assert r["shown"] == str(r["sentMs"])
            assert "speaking" in r["states"], r
            page.click("#stop")
            states = page.evaluate(TRACK_STATES)
            assert states and all(s == "ended" for s in states), states
            wait_health(srv, lambda h: h["sessions_open"] == 0, 30, "session left open after Stop")
            assert errors == []
        finally:
            ctx.close()
