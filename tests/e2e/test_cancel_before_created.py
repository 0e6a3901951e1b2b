"""Over a real socket: ``response.create`` then ``response.cancel`` at once, before the response's
forced unit was decided. The cancelled response plays nothing, no model-triggered response comes back in
its place, and the next ``response.create`` is answered.

``duplexkit serve scripted`` (answer policy ``on_request``, 1 s of simulated compute per unit, in process
and with ``--engine-process``), raw WebSocket client, duplex profile (``response.listen`` beats). The
client sends one whole unit (decided: a beat), then in one burst another whole unit and 0.5 s more,
``response.create`` and ``response.cancel``: the forced unit (the 0.5 s, zero-padded) is queued behind the
unit the engine is computing when the cancel comes, so the cancel re-tags it with the new epoch. Before
the fix it spoke there (a new response, trigger ``model``, 3 s of audio); now it is decided ``listen``.
Measured in units and events, never wall time.
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import websockets

from duplexkit.audio import read_wav

from _serverproc import ServerProc

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["inline", "engine-process"])
def delay_server(request):
    extra = ["--engine-process"] if request.param == "engine-process" else []
    with ServerProc("scripted", *extra, "--answer-policy", "on_request", "--scripted", "units_per_turn=3",
                    "--scripted", "unit_delay_s=1.0") as srv:
        yield srv


def _append(x: np.ndarray) -> str:
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})


async def _recv_until(ws, got: list, pred, timeout_s: float = 60.0) -> list[dict]:
    """Events until ``pred(event)``, appended to ``got`` too; a failure shows as a timeout, not a flake."""
    mine: list = []

    async def loop():
        while True:
            ev = json.loads(await ws.recv())
            got.append(ev)
            mine.append(ev)
            if pred(ev):
                return

    await asyncio.wait_for(loop(), timeout_s)
    return mine


async def test_cancel_before_created_plays_nothing_and_the_next_create_works(delay_server, fixtures_audio):
    speech, _ = read_wav(fixtures_audio / "long_question_16k.wav", 16_000)
    everything: list = []
    async with websockets.connect(delay_server.ws_url + "/v1/realtime?duplex=1", max_size=None) as ws:
        await _recv_until(ws, everything, lambda e: e["type"] == "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
        await _recv_until(ws, everything, lambda e: e["type"] == "session.updated")
        await ws.send(_append(speech[:16560]))  # unit 0
        await _recv_until(ws, everything, lambda e: e["type"] == "response.listen")  # unit 0 decided
        # unit 1 (computing for 1 s) and 0.5 s pending; the forced unit 2 queues behind unit 1
        await ws.send(_append(speech[16560:16560 + 16000 + 8000]))
        await ws.send(json.dumps({"type": "response.create", "event_id": "c1"}))
        await ws.send(json.dumps({"type": "response.cancel", "event_id": "c2"}))
        first = await _recv_until(ws, everything, lambda e: e["type"] in ("response.done", "error"))
        done = first[-1]
        assert done["type"] == "response.done", done
        assert done["response"]["status"] == "cancelled", done
        rid = done["response"]["id"]
        # 2.5 s more: at least two whole units (3, 4) even when the forced unit's 0.5 s of padding is taken
        # back from this audio (docs/concepts.md "Early unit close"). Units 1 (when it was still queued, not
        # computing), 2, 3 and 4 give a beat each, in order, so after two beats unit 2 (the cancelled forced
        # unit) has certainly been decided
        await ws.send(_append(speech[16560 + 24000:16560 + 24000 + 40000]))
        beats: list = []
        after = await _recv_until(ws, everything, lambda e: e["type"] in ("response.created", "error")
                                  or (e["type"] == "response.listen" and beats.append(e) is None and len(beats) == 2))
        assert after[-1]["type"] == "response.listen", f"a stray response or an error after the cancel: {after[-1]}"
        # the next response.create is answered in full
        await ws.send(json.dumps({"type": "response.create", "event_id": "c3"}))
        second = await _recv_until(ws, everything, lambda e: e["type"] in ("response.done", "error"))
        assert second[-1]["type"] == "response.done", second[-1]
        assert second[-1]["response"]["status"] == "completed", second[-1]
        created = [e for e in second if e["type"] == "response.created"]
        assert len(created) == 1 and created[0]["response"]["id"] != rid
        deltas = [e for e in second if e["type"] == "response.output_audio.delta"]
        assert sum(len(base64.b64decode(e["delta"])) // 2 for e in deltas) == 72_000  # the scripted turn
        await ws.send(json.dumps({"type": "session.close"}))
        await _recv_until(ws, everything, lambda e: e["type"] == "session.closed")
    # nothing of the cancelled response ever played, and no response but the two requested ones
    assert not [e for e in everything if e.get("response_id") == rid and e["type"].startswith("response.output_")]
    assert [e["response"]["trigger"] for e in everything if e["type"] == "response.created"] == ["client", "client"]
    assert not [e for e in everything if e["type"] == "error"]
