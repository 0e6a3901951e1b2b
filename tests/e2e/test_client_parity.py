"""InlineDuplexClient and DuplexClient give the same result for the same input (the inline
client is the server without the socket, docs/clients.md): same event types, statuses, transcripts and audio
sample counts (timings aside). With the ScriptedEngine, and with the real tiny engine twice: greedy
(``temperature: 0``) and sampled at the default temperature with a fixed ``extra_body.seed``."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
from _serverproc import ServerProc

from duplexkit.audio import read_wav
from duplexkit.clients import DuplexClient, InlineDuplexClient
from _timing import bound

pytestmark = pytest.mark.e2e

SESSION = {"temperature": 0.0, "turn_detection": None}
SEEDED = {"turn_detection": None, "extra_body": {"seed": 1234}}  # default temperature 0.7, sampled


async def one_turn(client, audio: np.ndarray) -> dict:
    async with client:
        for i in range(0, len(audio), 3200):
            await client.send_audio(audio[i:i + 3200], rate=16_000)
        await client.commit()
        h = await client.create_response()
        await h.wait(bound(300))
        await asyncio.sleep(0.2)
        events = []
        while True:
            try:
                events.append(await asyncio.wait_for(client.events().get(), 0.2))
            except (asyncio.TimeoutError, StopAsyncIteration):
                break
    beats = {"response.listen", "session.heartbeat_ack"}
    return {
        "types": [e.type for e in events if e.type not in beats],
        "status": h.status, "status_details": h.status_details, "transcript": h.transcript,
        "chunks": h.chunk_sizes, "samples": h.audio_samples, "trigger": h.trigger, "epoch": h.epoch,
    }


async def test_parity_scripted(question_wav):
    from duplexkit.testing import ScriptedEngine

    audio = read_wav(question_wav, 16_000)[0]
    inline = await one_turn(InlineDuplexClient(ScriptedEngine(units_per_turn=3), answer_policy="on_request",
                                               session=SESSION), audio)
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=3") as srv:
        remote = await one_turn(DuplexClient(srv.ws_url, session=SESSION), audio)
    assert inline == remote
    assert inline["status"] == "completed" and inline["samples"] == 72000


@pytest.mark.engine
@pytest.mark.parametrize("session", [SESSION, SEEDED], ids=["greedy", "seeded"])
async def test_parity_tiny(question_wav, session):
    pytest.importorskip("torch")
    from duplexkit.engine import DuplexEngine

    audio = read_wav(question_wav, 16_000)[0]
    engine = DuplexEngine.from_pretrained("tiny", layout="cpu", progress=False)
    try:
        inline = await one_turn(InlineDuplexClient(engine, answer_policy="on_request", max_output_tokens=40,
                                                   session=session, request_timeout_s=bound(120)), audio)
    finally:
        await engine.aclose()
        del engine
        gc.collect()
    with ServerProc("tiny", "--layout", "cpu", "--max-output-tokens", "40", ready_timeout_s=600) as srv:
        remote = await one_turn(DuplexClient(srv.ws_url, session=session, request_timeout_s=bound(120)), audio)
    assert inline["status"] in ("completed", "incomplete")
    assert inline["chunks"] and inline["chunks"][0] == 20160
    assert inline == remote
