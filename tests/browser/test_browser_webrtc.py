"""The page's WebRTC transport (docs/webrtc.md) in headless Chromium against ``duplexkit serve scripted``.

The fake microphone says a question, pauses, then interrupts (tests/browser/conftest.py). With
"Transport: WebRTC" the page opens an RTCPeerConnection (microphone track + ``oai-events`` data
channel), POSTs the offer as OpenAI's multipart form (``sdp`` + ``session``) and plays the remote
track. Checked: the call's id, the microphone's audio reaching the session (``/health``
``input_appends``), the answer arriving on the remote track (the receiver's ``inbound-rtp``
audio energy), the events on the channel (``output_audio_buffer.started``), the barge-in over the
first answer (cancelled, the track cleared) and a second answer, no audio deltas and no acks from
the page (the server reports playback), and Stop ending the call (``sessions_open`` back to 0, the
microphone released).
"""

from __future__ import annotations

import pytest

from _page import TRACK_MIC, TRACK_STATES, health, wait_health
from _serverproc import ServerProc
from _timing import bound

pytest.importorskip("aiortc")

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

KEY = "browser-rtc-key"
UNITS_PER_TURN = 6  # 6 s answers: the interruption lands inside the first one

INBOUND = """async () => {
  const rtc = window.duplexkit.rtc;
  if (!rtc) return null;
  let out = null;
  (await rtc.pc.getStats()).forEach((r) => {
    if (r.type === "inbound-rtp" && r.kind === "audio")
      out = { energy: r.totalAudioEnergy || 0, samples: r.totalSamplesReceived || 0, packets: r.packetsReceived || 0 };
  });
  return out;
}"""


@pytest.fixture(scope="module")
def server():
    with ServerProc("scripted", "--api-key", KEY, "--scripted", f"units_per_turn={UNITS_PER_TURN}") as srv:
        yield srv


def test_webrtc_call_from_the_page(browser, server):
    before = health(server)
    ctx = browser.new_context(permissions=["microphone"])
    ctx.add_init_script(TRACK_MIC)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(server.url + "/")
        page.fill("#key", KEY)
        page.dispatch_event("#key", "change")
        page.select_option("#transport", "webrtc")
        page.click("#start")
        page.wait_for_function("() => window.duplexkit.sessionId !== null || window.duplexkit.state === 'error'",
                               timeout=bound(60_000))
        assert page.evaluate("() => window.duplexkit.state") != "error", page.inner_text("#error")
        assert page.evaluate("() => window.duplexkit.callId").startswith("rtc_")
        assert page.evaluate("() => window.duplexkit.ws") is None
        # the microphone track reaches the session as appends
        wait_health(server, lambda h: h["input_appends"] > before["input_appends"], 15, "no append in 15 s")
        assert health(server)["sessions_open"] == 1
        # the answer plays on the remote track
        page.wait_for_function(
            "() => window.duplexkit.trackEvents.some(e => e.type === 'output_audio_buffer.started')",
            timeout=bound(60_000))
        page.wait_for_function(f"async () => {{ const s = await ({INBOUND})(); return s && s.energy > 0.01; }}",
                               timeout=bound(30_000))
        # barge-in over the first answer, then the next utterance is answered
        page.wait_for_function(
            "() => { const r = window.duplexkit.responses; return r.length >= 2 && r[1].status !== 'in_progress'; }",
            timeout=bound(120_000))
        dk = page.evaluate("""() => ({ states: window.duplexkit.states, acks: window.duplexkit.acks,
            track: window.duplexkit.trackEvents.map(e => e.type),
            responses: window.duplexkit.responses.map(r => ({ id: r.id, status: r.status, text: r.el.textContent })) })""")
        first, second = dk["responses"][:2]
        assert first["status"] == "cancelled", dk
        assert second["status"] == "completed", dk
        assert "output_audio_buffer.cleared" in dk["track"], dk
        assert "speaking" in dk["states"] and "interrupted" in dk["states"], dk["states"]
        assert dk["acks"] == []  # the server reports what its track played
        assert first["text"].startswith("assistant: ") and len(first["text"]) > len("assistant: ")
        stats = page.evaluate(INBOUND)
        assert stats["packets"] > 100 and stats["energy"] > 0.01, stats
        # Stop ends the call: the session is closed, the slot free, the microphone released
        page.click("#stop")
        wait_health(server, lambda h: h["sessions_open"] == 0 and h["sessions_active"] == 0, 30,
                    "the call did not end")
        page.wait_for_function("() => window.__mic.done >= 1", timeout=bound(30_000))
        assert all(s == "ended" for s in page.evaluate(TRACK_STATES))
        assert page.evaluate("() => window.duplexkit.rtc === null && window.duplexkit.state === 'idle'")
        assert errors == []
    finally:
        ctx.close()
    out = server.output()
    assert "webrtc call" in out and "session settings from the request" in out, out[-3000:]
