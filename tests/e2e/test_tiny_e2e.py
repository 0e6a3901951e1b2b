"""End to end with the REAL tiny engine (random weights, the real three-stage runtime) behind a real
``duplexkit serve tiny`` process: realtime turn, barge-in, the OpenAI SDK's realtime client, and
chat completions. One server for the whole module; responses are kept to 2-4 units.

Random weights never end a turn, so the server's tiny defaults apply: the ``on_request`` answer
policy and a small token cap; a requested response therefore ends ``incomplete`` (cap) unless it
was cancelled. The tests assert on units, chunk sizes, statuses and event order, never on time.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from duplexkit.audio import read_wav
from duplexkit.clients import DuplexClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))
from _serverproc import ServerProc  # noqa: E402
from openai_sdk_turns import commit_driven_turn, server_vad_turn  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.engine]
pytest.importorskip("torch")

ENDED = ("completed", "incomplete")  # incomplete = the token cap ended a random-weight turn


@pytest.fixture(scope="module")
def tiny_server():
    with ServerProc("tiny", "--max-output-tokens", "40", "--layout", "cpu", ready_timeout_s=600) as srv:
        h = httpx.get(srv.url + "/health").json()
        assert h["random_weights"] is True
        yield srv


async def _send(c, audio: np.ndarray, chunk: int = 3200) -> None:
    for i in range(0, len(audio), chunk):
        await c.send_audio(audio[i:i + chunk], rate=16_000)


async def _drain(c) -> list[dict]:
    out = []
    while True:
        try:
            out.append((await asyncio.wait_for(c.events().get(), 0.2)).model_dump(mode="json"))
        except (asyncio.TimeoutError, StopAsyncIteration):
            return out


async def test_realtime_turn(tiny_server, question_wav):
    async with DuplexClient(tiny_server.ws_url, request_timeout_s=120) as c:
        assert c.session["extra_body"]["answer_policy"] == "on_request"
        await _send(c, read_wav(question_wav, 16_000)[0])
        await c.commit()
        h = await c.create_response()
        await h.wait(300)
        evs = await _drain(c)
    assert h.status in ENDED, h.status_details
    assert h.chunk_sizes and h.chunk_sizes[0] == 20160  # first vocoder chunk: 840 ms at 24 kHz
    assert all(n == 24000 for n in h.chunk_sizes[1:-1])
    assert h.transcript  # transcript deltas arrived (gibberish with random weights)
    deltas = [e for e in evs if e["type"] == "response.output_audio.delta" and e["response_id"] == h.id]
    assert all(e["sample_rate_hz"] == 24000 and e["format"] == "pcm16" for e in deltas)
    ms = [e["metadata"]["audio_duration_ms"] for e in deltas]
    assert ms == sorted(set(ms)) and ms[-1] == h.audio_samples * 1000 // 24000
    tr = [e for e in evs if e["type"] == "response.output_audio_transcript.delta" and e["response_id"] == h.id]
    assert len(tr) == len(deltas)  # one transcript delta per audio delta (docs/protocol.md §5.3)


async def test_barge_in(tiny_server, question_wav, interrupt_wav):
    async with DuplexClient(tiny_server.ws_url, request_timeout_s=120, session={"turn_detection": None}) as c:
        await _send(c, read_wav(question_wav, 16_000)[0])
        await c.commit()
        first = await c.create_response()
        async for _ in first.audio():
            break
        await c.barge_in()
        await first.wait(120)
        assert first.status == "cancelled" and first.status_details["reason"] == "client_cancelled"
        at_done = first.audio_samples
        await _send(c, read_wav(interrupt_wav, 16_000)[0])
        await c.commit()
        second = await c.create_response()
        await second.wait(300)
        evs = await _drain(c)
    assert second.status in ENDED and len(second.chunk_sizes) >= 1
    assert second.epoch == first.epoch + 1
    assert first.audio_samples == at_done
    done_seen = False
    for e in evs:
        rid = e.get("response_id") or (e.get("response") or {}).get("id")
        if done_seen:
            assert rid != first.id, f"{e['type']} of the cancelled response after its response.done"
        done_seen = done_seen or (e["type"] == "response.done" and rid == first.id)
    assert done_seen


async def test_openai_sdk_commit_turn(tiny_server, question_wav):
    s = await commit_driven_turn(tiny_server.url, "minicpm-o-4.5", question_wav, timeout=300)
    assert s["status"] in ENDED and s["first_chunk_samples"] == 20160 and s["audio_samples"] > 0


async def test_openai_sdk_server_vad_turn(tiny_server, question_wav):
    s = await server_vad_turn(tiny_server.url, "minicpm-o-4.5", question_wav, timeout=300)
    assert s["status"] in ENDED and s["audio_samples"] > 0
    assert s["types"].index("input_audio_buffer.speech_stopped") < s["types"].index("response.created")


def test_chat_completions(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Say hello."}], "modalities": ["text", "audio"],
        "max_tokens": 8, "seed": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    audio = [c for c in choices if (c["message"].get("audio") or {}).get("data")]
    assert len(audio) == 1
    pcm, rate = read_wav(base64.b64decode(audio[0]["message"]["audio"]["data"]))
    assert rate == 24000 and len(pcm) > 0
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_chat_completions_stream(tiny_server, question_wav):
    wav = base64.b64encode(question_wav.read_bytes()).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                       "input_audio": {"data": wav, "format": "wav"}}]}],
            "modalities": ["text", "audio"], "max_tokens": 8, "stream": True}
    modalities, done = [], False
    with httpx.stream("POST", tiny_server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    modalities.append(chunk["modality"])
    assert done and "text" in modalities and "audio" in modalities


def test_random_weights_notice_is_printed_once(tiny_server):
    """The engine's load (``from_pretrained`` with progress, in the engine process or not) prints the
    notice; the CLI does not repeat it."""
    from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE

    assert tiny_server.output().count(RANDOM_WEIGHTS_NOTICE) == 1, tiny_server.output()[-3000:]
