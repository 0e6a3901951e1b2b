"""Early unit close over a real socket: ``duplexkit serve scripted`` as a subprocess, raw WebSocket client.

Measured in units of input, not wall time: the server's silence feeder is pushed out of reach
(``--silence-slack-ms`` 10 min), so an answer can only come from audio the client actually sent.
The client sends 2.3 s of speech (two whole units and 0.27 s of a third), then ``response.create``,
then nothing more: the first audio delta must still arrive (the forced unit ran at once on the
buffered 0.27 s plus padding), and the duplex ``response.listen`` beats show it was unit 2.
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


@pytest.fixture(scope="module")
def slack_server():
    with ServerProc("scripted", "--scripted", "units_per_turn=2", "--silence-slack-ms", "600000") as srv:
        yield srv


async def _recv_until(ws, pred, timeout_s: float = 60.0) -> list[dict]:
    got = []
    async def loop():
        while True:
            ev = json.loads(await ws.recv())
            got.append(ev)
            if pred(ev):
                return
    await asyncio.wait_for(loop(), timeout_s)  # generous: a failure shows as a timeout, not a flake
    return got


@pytest.mark.parametrize("commit_first", [False, True])
async def test_answer_comes_without_another_unit_of_input(slack_server, fixtures_audio, commit_first):
    speech, _ = read_wav(fixtures_audio / "question_16k.wav", 16_000)
    x = speech[: 16560 + 16000 + 4320]
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
    url = slack_server.ws_url + "/v1/realtime?duplex=1"
    async with websockets.connect(url, max_size=None) as ws:
        await _recv_until(ws, lambda e: e["type"] == "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
        await _recv_until(ws, lambda e: e["type"] == "session.updated")
        for i in range(0, len(pcm), 3200):  # 100 ms appends
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(pcm[i:i + 3200]).decode()}))
        # both whole units are decided (listen beats) before the request: nothing else is pending
        beats = []
        await _recv_until(ws, lambda e: e["type"] == "response.listen" and beats.append(e) is None and len(beats) == 2)
        if commit_first:
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        evs = await _recv_until(ws, lambda e: e["type"] in ("response.output_audio.delta", "error"))
        assert evs[-1]["type"] == "response.output_audio.delta", evs[-1]
        assert [e for e in evs if e["type"] == "response.created"][0]["response"]["trigger"] == "client"
        # no further listening unit was needed between the request and the answer; with a commit
        # first, the commit's own padded unit (decided listen: answer policy on_request) may be
        # decided after the request arrived on a busy machine, so its one beat may land here
        late = [e for e in evs if e["type"] == "response.listen"]
        assert len(late) <= (1 if commit_first else 0), late

