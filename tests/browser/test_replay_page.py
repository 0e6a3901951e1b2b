"""``duplexkit replay`` pages in the real headless Chromium: a session recorded through a real
``duplexkit serve scripted --record`` (remote client, server-VAD barge-in) and one recorded by the
inline client; each page loads without a JS error, draws every lane, decodes its embedded audio
and moves its cursor when seeking."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from duplexkit.audio import VirtualPlayer, read_wav
from duplexkit.clients import DuplexClient
from duplexkit.recording import Recorder
from duplexkit.replay import LANES, render_html
from _serverproc import ServerProc
from _timing import bound

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_recording_inline import _one_turn  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
TD = {"type": "server_vad", "create_response": False, "interrupt_response": True, "silence_duration_ms": 500}


async def _remote_barge_in(url: str) -> str:
    async with DuplexClient(url, player=VirtualPlayer(block_ms=20), session={"turn_detection": TD},
                            request_timeout_s=bound(30)) as c:
        q = read_wav(FIX / "question_16k.wav", 16_000)[0]
        for i in range(0, len(q), 1600):
            await c.send_audio(q[i:i + 1600])
            await asyncio.sleep(0.02)
        await c.commit()
        h = await c.create_response()
        for _ in range(8):
            await c.send_audio(np.zeros(16_000, np.float32))
        async with asyncio.timeout(bound(30)):
            while h.played_ms < 1_000:
                await asyncio.sleep(0.01)
        s = read_wav(FIX / "interrupt_16k.wav", 16_000)[0]
        for i in range(0, len(s), 320):
            await c.send_audio(s[i:i + 320])
            await asyncio.sleep(0.02)
        await h.wait_heard(bound(30))
        await asyncio.sleep(0.3)
        return c.session["id"]


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    root = tmp_path_factory.mktemp("recs")
    with ServerProc("scripted", "--record", str(root / "server"), "--scripted", "units_per_turn=null") as srv:
        sid = asyncio.run(_remote_barge_in(srv.ws_url + "/v1/realtime?duplex=1"))
        srv.wait_idle()
    server_folder = root / "server" / sid
    for _ in range(int(bound(20) / 0.1)):
        meta = server_folder / "meta.json"
        if meta.is_file() and json.loads(meta.read_text())["complete"]:
            break
        asyncio.run(asyncio.sleep(0.1))
    r = Recorder(root / "inline")
    rec, *_ = asyncio.run(_one_turn(r))
    assert r.flush(20)
    return {"server": server_folder, "inline": rec.folder}


@pytest.mark.parametrize("side", ["server", "inline"])
def test_replay_page_in_chromium(side, recordings, browser, tmp_path):
    page_path = render_html(recordings[side], tmp_path / "page.html")
    ctx = browser.new_context()
    page = ctx.new_page()
    errors: list = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(page_path.as_uri())
    page.wait_for_function("window.duplexkitReplay !== undefined", timeout=bound(20) * 1000)
    assert page.evaluate("window.duplexkitReplay.lanes") == list(LANES)
    spans = page.evaluate("""() => Array.from(document.querySelectorAll('g[data-lane]')).map(
        g => [g.dataset.lane, g.querySelectorAll('rect.span').length, g.querySelectorAll('.mark').length])""")
    by_lane = {lane: (n, m) for lane, n, m in spans}
    assert by_lane["model decisions"][0] > 0 and by_lane["assistant generated"][0] > 0
    assert by_lane["assistant heard"][0] > 0 and by_lane["latency"][1] > 0
    if side == "server":
        assert by_lane["user speech"][0] > 0 and by_lane["events"][1] > 0  # VAD speech and the barge-in
    # the embedded WAVs decode, and all tracks are as long as the session
    page.wait_for_function("Array.from(document.querySelectorAll('audio')).every(a => a.readyState >= 1)",
                           timeout=bound(20) * 1000)
    durs = page.evaluate("Array.from(document.querySelectorAll('audio')).map(a => a.duration)")
    assert len(durs) == 3 and max(durs) - min(durs) < 0.01
    dur_ms = page.evaluate("window.duplexkitReplay.durationMs")
    assert abs(durs[0] * 1000 - dur_ms) < 1000
    x0 = float(page.get_attribute("#cursor", "x1"))
    page.evaluate(f"window.duplexkitReplay.seek({dur_ms // 2})")
    page.wait_for_timeout(200)
    x1 = float(page.get_attribute("#cursor", "x1"))
    assert x1 > x0 + 100
    ctx.close()
    assert errors == []
