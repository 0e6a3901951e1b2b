"""The page ``duplexkit serve`` serves at ``/``, driven in headless Chromium with a fake microphone
against real ``duplexkit serve scripted`` processes (one test against ``tiny`` is in
test_browser_tiny.py).

Server-side truth comes from ``/health``: ``input_appends`` / ``input_audio_ms`` (accepted appends
and the audio they carried) and ``sessions_open``. Page-side truth comes from ``window.duplexkit``
(state history, responses, the playback acks it sent) and from every ``MediaStream`` the page got
from ``getUserMedia`` (recorded by an init script, so a leaked microphone cannot hide).

Timeouts are generous upper bounds for a loaded machine; nothing asserts on how fast things are.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from _page import TRACK_MIC, TRACK_STATES, health, wait_health
from _serverproc import ServerProc
from _timing import bound

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "docs" / "img" / "browser-page.png"
_spec = importlib.util.spec_from_file_location("make_figures", REPO / "scripts" / "make_figures.py")
make_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_figures)
KEY = "browser-test-key"
UNITS_PER_TURN = 6  # 6 s answers: long enough to speak over the first one

@pytest.fixture(scope="module")
def server():
    with ServerProc("scripted", "--api-key", KEY, "--scripted", f"units_per_turn={UNITS_PER_TURN}") as srv:
        yield srv


def open_page(browser, srv, *, mic: bool = True, url: str = None):
    ctx = browser.new_context(permissions=["microphone"] if mic else [])
    ctx.add_init_script(TRACK_MIC)
    page = ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url or srv.url + "/")
    return ctx, page, errors


def assert_mic_released(page):
    page.wait_for_function("() => window.__mic.done >= 1", timeout=bound(30_000))
    states = page.evaluate(TRACK_STATES)
    assert states and all(s == "ended" for s in states), states


def assert_error_state(page, needle: str):
    page.wait_for_function("() => window.duplexkit.state === 'error'", timeout=bound(30_000))
    msg = page.inner_text("#error")
    assert needle in msg, msg
    assert page.get_attribute("#state", "data-state") == "error"
    assert page.evaluate("() => window.duplexkit.ws === null && window.duplexkit.mic === null")
    assert page.is_enabled("#start")


def test_page_markup_survives_the_parser(browser, server):
    """Every element of the served HTML is where it was written (the old meter was a <div> in a <p>)."""
    ctx, page, errors = open_page(browser, server)
    try:
        assert page.evaluate("() => document.querySelector('#bar > label > #level').tagName") == "METER"
        ids = ["key", "model", "profile", "answer", "voice", "start", "stop", "state", "level", "played",
               "error", "transcript", "notice"]
        assert page.evaluate("ids => ids.every(i => document.getElementById(i))", ids)
        assert page.get_attribute("#state", "data-state") == "idle"
        assert errors == []
    finally:
        ctx.close()


def test_random_weights_notice(browser, server):
    """The page shows a visible notice when ``/health`` says the model's weights are random, none otherwise."""
    ctx, page, errors = open_page(browser, server)
    try:
        page.wait_for_timeout(500)
        assert not page.is_visible("#notice") and page.text_content("#notice") == ""
    finally:
        ctx.close()
    with ServerProc("scripted", "--scripted", "random_weights=true") as srv:
        ctx, page, errors = open_page(browser, srv)
        try:
            page.wait_for_selector("#notice", state="visible", timeout=bound(10_000))
            assert "RANDOM weights" in page.text_content("#notice")
            assert errors == []
        finally:
            ctx.close()


def test_conversation_barge_in_and_playback_truth(browser, server, fixtures_audio, tmp_path):
    """The whole user path: key, model list, reference voice, capture (appends counted on the
    server), transcript, playback, barge-in over the first answer (cancelled, flushed, truncating
    ack of what was heard), the second answer played out and acknowledged in full only then."""
    before = health(server)
    ctx, page, errors = open_page(browser, server)
    try:
        page.fill("#key", KEY)
        page.dispatch_event("#key", "change")
        page.wait_for_function("() => [...document.querySelectorAll('#model option')].some(o => o.value === 'scripted')",
                               timeout=bound(30_000))
        page.select_option("#model", "scripted")
        page.set_input_files("#voice", str(fixtures_audio / "ref_voice_16k.wav"))
        page.click("#start")
        page.wait_for_function("() => window.duplexkit.state === 'listening'", timeout=bound(60_000))
        # acceptance: appends reach the server within 10 s of fake-mic speech
        wait_health(server, lambda h: h["input_appends"] > before["input_appends"], 10, "no append in 10 s")
        assert "reference voice 6.0 s" in page.inner_text("#voiceInfo")
        mic = page.evaluate("() => window.__mic.constraints[0].audio")
        assert mic["echoCancellation"] is True and mic["noiseSuppression"] is True

        page.wait_for_function(
            "() => { const r = window.duplexkit.responses; return r.length >= 2 && r[1].status !== 'in_progress'"
            " && r[1].acked !== null; }", timeout=bound(120_000))
        dk = page.evaluate("""() => ({
            states: window.duplexkit.states, acks: window.duplexkit.acks, appendsSent: window.duplexkit.appendsSent,
            responses: window.duplexkit.responses.map(r => ({id: r.id, status: r.status, sentMs: r.sentMs,
                acked: r.acked, playedAtDone: r.playedAtDone, doneAt: r.doneAt, text: r.el.textContent,
                shownMs: r.el.dataset.playedMs})),
            users: document.querySelectorAll('#transcript .user').length })""")
        first, second = dk["responses"][:2]
        # barge-in: the first answer ends cancelled, after some of it was heard; one truncating ack
        assert first["status"] == "cancelled", dk
        acks1 = [a for a in dk["acks"] if a["response_id"] == first["id"]]
        assert len(acks1) == 1 and acks1[0]["truncate"] is True, dk["acks"]
        assert 0 < acks1[0]["played_ms"] <= first["sentMs"], (acks1, first)
        assert first["sentMs"] < UNITS_PER_TURN * 1000  # it was cut short
        # the next utterance is answered and played to the end; its ack is the full length and is
        # sent when playback ends, not at response.done (which came while audio was still queued)
        assert second["status"] == "completed", dk
        assert second["sentMs"] == UNITS_PER_TURN * 1000
        acks2 = [a for a in dk["acks"] if a["response_id"] == second["id"]]
        assert acks2 == [{"response_id": second["id"], "played_ms": second["sentMs"], "truncate": False,
                          "at": acks2[0]["at"]}], dk["acks"]
        # response.done came with audio still queued; the ack waited for it to play out
        queued_at_done = second["sentMs"] - second["playedAtDone"]
        assert queued_at_done > 0 and acks2[0]["at"] - second["doneAt"] >= queued_at_done - 100, (second, acks2)
        assert second["shownMs"] == str(second["sentMs"])
        assert "scripted reply" in second["text"]
        assert dk["users"] >= 2
        for s in ("connecting", "listening", "speaking", "interrupted"):
            assert s in dk["states"], dk["states"]

        # server-side counts: 100 ms appends of 16 kHz audio, as many as the page sent
        h = health(server)
        appends = h["input_appends"] - before["input_appends"]
        audio_ms = h["input_audio_ms"] - before["input_audio_ms"]
        assert appends >= 100 and abs(audio_ms - 100 * appends) <= 100, h
        assert h["sessions_open"] == 1
        assert page.evaluate("() => window.duplexkit.appendsSent") >= appends  # read after /health

        # the docs' screenshot, stamped with the digest of server/static/ (scripts/make_figures.py):
        # written when missing, when the page changed since it was taken (tests/unit/test_figures.py
        # fails until then), or with DUPLEXKIT_UPDATE_SCREENSHOT=1
        shot = tmp_path / "browser-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if make_figures.screenshot_is_stale(SCREENSHOT) or os.environ.get("DUPLEXKIT_UPDATE_SCREENSHOT") == "1":
            make_figures.write_screenshot(shot, SCREENSHOT)
            assert not make_figures.screenshot_is_stale(SCREENSHOT)

        page.click("#stop")
        assert page.get_attribute("#state", "data-state") == "idle"
        assert_mic_released(page)
        wait_health(server, lambda h: h["sessions_open"] == 0, 30, "session left open after Stop")
        assert errors == []
    finally:
        ctx.close()


def test_permission_denied(browser, server):
    before = health(server)
    ctx, page, errors = open_page(browser, server, mic=False)
    try:
        page.fill("#key", KEY)
        page.click("#start")
        assert_error_state(page, "microphone permission denied")
        assert page.evaluate("() => window.__mic.errors") == ["NotAllowedError"]
        assert page.evaluate(TRACK_STATES) == []
        # the socket opened next to the permission request was closed: no session stays open,
        # and clicking again does not pile them up
        page.click("#start")
        page.wait_for_function("() => window.__mic.errors.length === 2 && window.duplexkit.state === 'error'",
                               timeout=bound(30_000))
        wait_health(server, lambda h: h["sessions_open"] == 0, 30, "session leaked")
        assert health(server)["input_appends"] == before["input_appends"]
        assert errors == []
    finally:
        ctx.close()


def test_bad_key_then_good_key(browser, server):
    ctx, page, errors = open_page(browser, server)
    try:
        page.fill("#key", "wrong-key")
        page.click("#start")
        assert_error_state(page, "missing or invalid API key (unauthorized)")
        assert_mic_released(page)
        wait_health(server, lambda h: h["sessions_open"] == 0, 30, "session left open")
        # the same page recovers with the right key
        page.fill("#key", KEY)
        page.click("#start")
        page.wait_for_function("() => window.duplexkit.state === 'listening'", timeout=bound(60_000))
        assert page.inner_text("#error") == ""
        wait_health(server, lambda h: h["sessions_open"] == 1, 30, "no session")
        page.click("#stop")
        wait_health(server, lambda h: h["sessions_open"] == 0, 30, "session left open after Stop")
        states = page.evaluate(TRACK_STATES)
        assert len(states) == 2 and all(s == "ended" for s in states), states
        assert errors == []
    finally:
        ctx.close()


def test_compat_cancel_race_is_benign(browser, server):
    """In the compat profile the server names a cancel race with OpenAI's code
    (``response_cancel_not_active``); the page takes it as benign like ``response_not_active``:
    no "server error" note, the session stays up."""
    ctx, page, errors = open_page(browser, server)
    try:
        page.fill("#key", KEY)
        page.select_option("#profile", "compat")
        page.click("#start")
        page.wait_for_function("() => window.duplexkit.state === 'listening'", timeout=bound(60_000))
        # two cancels: if an answer was running the first ends it, the second always races
        page.evaluate("""() => {
            const ws = window.duplexkit.ws;
            window.__codes = [];
            ws.addEventListener("message", (m) => {
                const ev = JSON.parse(m.data);
                if (ev.type === "error") window.__codes.push(ev.error.code);
            });
            for (const id of ["evt_race_1", "evt_race_2"]) ws.send(JSON.stringify({type: "response.cancel", event_id: id}));
        }""")
        page.wait_for_function("() => window.__codes.includes('response_cancel_not_active')", timeout=bound(30_000))
        notes = page.eval_on_selector_all("#transcript .note", "els => els.map(e => e.textContent)")
        assert not [n for n in notes if "server error" in n], notes
        assert page.evaluate("() => window.duplexkit.state") != "error"
        assert page.inner_text("#error") == ""
        page.click("#stop")
        assert errors == []
    finally:
        ctx.close()


def test_server_down(browser):
    srv = ServerProc("scripted")
    try:
        ctx, page, errors = open_page(browser, srv)
        try:
            srv.stop()
            page.click("#start")
            assert_error_state(page, "cannot reach the server")
            assert_mic_released(page)
            assert errors == []
        finally:
            ctx.close()
    finally:
        srv.__exit__(None, None, None)
