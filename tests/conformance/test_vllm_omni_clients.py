"""vLLM-Omni's own client library (``vllm_omni.clients`` from the ``vllm-omni`` PyPI wheel,
installed test-only with ``--no-deps``) against a real ``duplexkit serve scripted`` process, with
default arguments except the URL (docs/server.md, "Interop")."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import websockets
from _timing import bound

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _serverproc import ServerProc  # noqa: E402
from _thirdparty import vllm_omni_clients  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
# the scripted model answers on its own after 2 listening units, 3 units per answer (1 s each)
SCRIPT = ("--scripted", "speak_after_units=2", "--scripted", "units_per_turn=3")


@pytest.fixture(scope="module")
def clients():
    vllm_omni_clients()
    import vllm_omni.clients.duplex  # noqa: F401  (fails here, not mid-test, when the package is broken)


@pytest.fixture(scope="module")
def server():
    with ServerProc("scripted", *SCRIPT) as srv:
        yield srv


async def test_vllm_omni_duplex_turn(clients, server):
    from vllm_omni_flows import duplex_turn

    s = await duplex_turn(server.ws_url, FIXTURES / "question_16k.wav")
    assert s["status"] == "completed"
    assert s["audio_bytes"] == 3 * 48000  # 3 units of 1 s at 24 kHz pcm16
    assert s["transcript"]
    types = [e["type"] for e in s["events"]]
    assert "error" not in types, [e for e in s["events"] if e["type"] == "error"]  # acks with item_<rid> accepted
    assert "session.warning" not in types  # every field of their MiniCPM-o preset is honoured
    # their library drops the beta copies of the "both" dialect as replays (same server_event_seq)
    assert "response.audio.delta" not in types


@pytest.fixture(scope="module")
def long_server():
    """6-unit answers: the cancel after the first chunk always finds the answer still going, even
    on a machine so busy that the server feeds several silence units at once after a stall."""
    with ServerProc("scripted", "--scripted", "speak_after_units=2", "--scripted", "units_per_turn=6") as srv:
        yield srv


async def test_vllm_omni_barge_in(clients, long_server):
    from vllm_omni_flows import barge_in

    s = await barge_in(long_server.ws_url, FIXTURES / "question_16k.wav", FIXTURES / "interrupt_16k.wav")
    assert s["first_status"] == "cancelled" and s["first_audio_bytes"] > 0
    assert s["second_status"] == "completed" and s["second_audio_bytes"] == 6 * 48000
    assert s["second_transcript"] and s["second_id"] != s["first_id"]
    assert "error" not in [e["type"] for e in s["events"]]


async def _raw_turn(url: str, session: dict) -> list[dict]:
    """A raw-socket duplex turn; returns every frame up to response.done."""
    frames = []
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        pcm = b"\x10\x00" * 16_000 * 4
        import base64

        for i in range(0, len(pcm), 6400):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + 6400]).decode(),
                                      "sample_rate_hz": 16000}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        async with asyncio.timeout(bound(120)):
            while True:
                f = json.loads(await ws.recv())
                frames.append(f)
                if f["type"] == "response.done":
                    return frames


async def test_beta_shaped_session_gets_both_names_with_one_sequence_number(server):
    beta_shaped = {"modalities": ["audio", "text"], "input_audio_format": "pcm16", "turn_detection": None}
    frames = await _raw_turn(server.ws_url + "/v1/realtime?duplex=1&autostart=0", beta_shaped)
    ga = [f for f in frames if f["type"] == "response.output_audio.delta"]
    beta = [f for f in frames if f["type"] == "response.audio.delta"]
    assert ga and [(f["server_event_seq"], f["event_id"], f["delta"]) for f in ga] == \
        [(f["server_event_seq"], f["event_id"], f["delta"]) for f in beta]
    assert any(f["type"] == "response.audio_transcript.delta" for f in frames)
    # ?dialect=ga opts out; a GA-shaped update gets GA names only
    for url, sess in ((server.ws_url + "/v1/realtime?duplex=1&autostart=0&dialect=ga", beta_shaped),
                      (server.ws_url + "/v1/realtime?duplex=1&autostart=0", {"type": "realtime", "audio": {
                          "input": {"turn_detection": None}}})):
        frames = await _raw_turn(url, sess)
        assert not [f for f in frames if f["type"].startswith(("response.audio", "response.text"))]
        assert any(f["type"] == "response.output_audio.delta" for f in frames)


async def test_bad_dialect_is_refused_naming_the_parameter(server):
    # the code in the profile's naming (docs/protocol.md §9): OpenAI's invalid_value in compat
    for query, code in (("dialect=v0", "invalid_value"), ("duplex=1&dialect=v0", "bad_event")):
        async with websockets.connect(server.ws_url + "/v1/realtime?" + query) as ws:
            ev = json.loads(await ws.recv())
            assert ev["error"]["param"] == "dialect" and "ga, beta, both" in ev["error"]["message"]
            assert ev["error"]["code"] == code, ev
            with pytest.raises(websockets.ConnectionClosed) as ei:
                await ws.recv()
            assert ei.value.rcvd.code == 1008
