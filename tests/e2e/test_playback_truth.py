"""What the user hears is what history keeps: the client half of barge-in, end to end.

In-process (``InlineDuplexClient``) and over a real socket (``DuplexClient`` against the bundled
server run by uvicorn in this process, so the server's Session can be inspected), both profiles,
the scripted engine (no torch) for timing, a :class:`~duplexkit.audio.VirtualPlayer` playing in
real time, and real speech from the fixtures:

* a 10 s answer delivered faster than real time is interrupted by the server VAD at ~2 s of
  playback: at most 100 ms of it plays after ``response.done`` and the stored assistant item
  covers what was heard (2.0 s +- 0.1 s on an idle machine; on a busy one, plus the time the
  machine demonstrably did not run this process, measured by a ticker on its event loop);
* the tail of an answer (after ``response.done``, 5 s still queued) is barge-in-able and stops
  within one player block;
* a fully heard answer is stored whole, reported when its last sample played.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import numpy as np
import pytest

from duplexkit.audio import VirtualPlayer, read_wav
from duplexkit.clients import DuplexClient, InlineDuplexClient
from duplexkit.testing import ScriptedEngine
from _timing import bound

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
TD = {"type": "server_vad", "create_response": False, "interrupt_response": True, "silence_duration_ms": 500}
BLOCK_MS = 20


def _speech(name: str) -> np.ndarray:
    return read_wav(FIX / name, 16_000)[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def _server(engine, profile: str):
    """The bundled server on loopback, in this process; yields (ws_url, server state)."""
    import uvicorn

    from duplexkit_server.app import ServerSettings, create_app

    app = create_app(engine, ServerSettings())
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.get_running_loop().create_task(server.serve())
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.02)
    path = "/v1/realtime?duplex=1" if profile == "duplex" else "/v1/realtime"
    try:
        yield f"ws://127.0.0.1:{port}{path}", app.state.duplexkit
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, bound(10))


@contextlib.asynccontextmanager
async def _client(transport: str, profile: str, player, **kw):
    """(client, a callable returning the server-side Session)."""
    engine = ScriptedEngine(units_per_turn=kw.pop("units", 10))
    opts = dict(session={"turn_detection": TD}, player=player, input_rate=16_000, request_timeout_s=bound(20), **kw)
    if transport == "inline":
        async with InlineDuplexClient(engine, profile=profile, **opts) as c:
            yield c, (lambda: c.session_machine)
    else:
        async with _server(engine, profile) as (url, state):
            async with DuplexClient(url, profile=profile, **opts) as c:
                yield c, (lambda: next(iter(state.connections)).session)


async def _answer(c, seconds: int):
    """A forced answer whose audio arrives faster than real time: the scripted engine speaks one
    1-s unit per input unit, and silence is appended far faster than real time."""
    await c.send_audio(np.zeros(16_000, np.float32))
    h = await c.create_response()
    for _ in range(seconds + 1):  # 1-s appends (the pending-input quota refuses larger bursts)
        await c.send_audio(np.zeros(16_000, np.float32))
    return h


async def _lateness(total: list) -> None:
    """Add to ``total[0]`` how late (ms) a 10 ms ticker on this event loop wakes, until cancelled:
    time the machine did not give this process, whose loop runs the client, the server (remote:
    uvicorn in this process) and the virtual player alike. About 0-1 ms per tick on an idle machine."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(0.01)
        total[0] += max(0.0, loop.time() - t - 0.01) * 1000


async def _played_at_least(h, ms: int, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while h.played_ms < ms:
            await asyncio.sleep(0.005)


async def _settled(get_session, item_id: str, timeout: float = 5):
    async with asyncio.timeout(timeout):
        while True:
            sent, committed, final = get_session().item_playback(item_id)
            if final:
                return sent, committed
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("generating", [True, False], ids=["server-cancels", "tail-after-done"])
@pytest.mark.parametrize("profile", ["duplex", "compat"])
@pytest.mark.parametrize("transport", ["inline", "remote"])
async def test_server_vad_interrupt_at_2s_of_a_10s_answer(transport, profile, generating):
    """``server-cancels``: the model turn is still open (like real weights mid-answer), so the
    server answers the VAD barge-in with ``response.done{cancelled, turn_detected}``.
    ``tail-after-done``: the server already finished the response; only the client can stop
    the 8 s still queued, on the server's ``speech_started``."""
    player = VirtualPlayer(block_ms=BLOCK_MS)
    async with _client(transport, profile, player, units=None if generating else 10) as (c, session):
        h = await _answer(c, 10)
        async with asyncio.timeout(bound(20)):
            # the answer is (almost) all here long before it has played; tail-after-done: and its
            # response.done too (it follows the last delta: on a loaded machine a moment later)
            while h.audio_ms < 9_000 or (not generating and h.status != "completed"):
                await asyncio.sleep(0.01)
        assert h.played_ms < 1_500
        assert h.generating is generating or not generating and h.status == "completed"
        speech = _speech("interrupt_16k.wav")
        onset = int(np.argmax(np.abs(speech) > 0.05))
        # the user starts talking (20 ms chunks in real time) so that the server VAD confirms the
        # barge-in (~100 ms after the speech onset) at ~2 s of playback
        await _played_at_least(h, 2_000 - onset * 1000 // 16_000 - 100)
        # the microphone runs on the player's (wall) clock: a late loop turn on a busy machine sends
        # all the samples now due, so the speech reaches the VAD when the player says it should
        loop = asyncio.get_running_loop()
        late_ms = [0.0]
        ticker = loop.create_task(_lateness(late_ms))
        t0, sent, at_onset = loop.time(), 0, None
        while sent < onset + 16_000 // 2:
            n = max(320, int((loop.time() - t0) * 16_000) + 320 - sent)
            await c.send_audio(speech[sent:sent + n])
            if at_onset is None and sent + n > onset:
                at_onset = h.played_ms  # the speech onset reached the server at this playback position
            sent += n
            await asyncio.sleep(0.02)
            if not h.audible:
                break
        if generating:
            await h.wait(bound(10))
            assert h.status == "cancelled" and h.status_details["reason"] == "turn_detected"
        else:
            async with asyncio.timeout(bound(10)):
                while h.audible:
                    await asyncio.sleep(0.005)
        ticker.cancel()
        at_end = h.played_ms
        await asyncio.sleep(0.3)
        assert h.played_ms - at_end <= 100, "audio kept playing after the interruption"
        assert not h.audible and not c.speaking
        sent, committed = await _settled(session, h.item_id)
        assert sent >= 9_000
        assert abs(committed - h.played_ms) <= 5  # history = what was heard ...
        # ... which ends after the user began to speak, within 200 ms of it (2.0 s +- 0.1 s on an
        # idle machine: the VAD confirms ~100 ms of speech) plus the time this busy machine did not
        # run the process (measured, not guessed: ~0 on an idle machine)
        assert at_onset is not None and at_onset <= committed <= at_onset + 200 + late_ms[0], \
            (committed, at_onset, round(late_ms[0]))


@pytest.mark.parametrize("profile", ["duplex", "compat"])
@pytest.mark.parametrize("transport", ["inline", "remote"])
async def test_tail_after_done_is_barge_inable_and_a_heard_answer_is_stored_whole(transport, profile):
    player = VirtualPlayer(block_ms=BLOCK_MS)
    player.output = []
    async with _client(transport, profile, player, units=6) as (c, session):
        # 1. a fully heard answer: reported when its last sample has played, stored whole
        h1 = await _answer(c, 3)
        await h1.wait(bound(10))
        assert h1.status == "completed" and h1.audio_ms > 2_900
        assert h1.played_ms < h1.audio_ms  # done arrived long before playback ended
        heard = await h1.wait_heard(bound(20))
        assert heard == h1.audio_ms
        sent, committed = (await asyncio.sleep(0.1)) or session().item_playback(h1.item_id)[:2]
        assert committed == sent == h1.audio_ms
        # 2. the tail: response.done has arrived with ~5 s still queued; barge_in() stops it
        h2 = await _answer(c, 6)
        await h2.wait(bound(10))
        assert h2.status == "completed" and not h2.generating
        await _played_at_least(h2, 500)
        assert h2.audible and c.speaking and player.queued_samples(h2.id) >= 24_000 * 4
        assert await c.barge_in() is h2
        at_barge = h2.played_ms
        n_blocks = len(player.output)
        await asyncio.sleep(0.3)
        assert h2.played_ms - at_barge <= BLOCK_MS  # stops within one player block
        later = np.concatenate(player.output[n_blocks:])
        assert np.abs(later).max() == 0.0  # nothing of it is heard afterwards
        sent, committed = await _settled(session, h2.item_id)
        assert sent > 5_000 and abs(committed - at_barge) <= BLOCK_MS


async def test_local_vad_barges_in_on_the_tail():
    """Local VAD (no server turn detection) interrupts audio still playing after response.done."""
    player = VirtualPlayer(block_ms=BLOCK_MS)
    engine = ScriptedEngine(units_per_turn=6)
    async with InlineDuplexClient(engine, session={"turn_detection": None}, player=player, barge_in=True,
                                  request_timeout_s=bound(20)) as c:
        h = await _answer(c, 6)
        await h.wait(bound(10))
        await _played_at_least(h, 300)
        speech = _speech("interrupt_16k.wav")
        for i in range(0, 16_000, 320):  # 1 s of real speech in 20 ms chunks
            await c.send_audio(speech[i:i + 320])
            if not h.audible:
                break
        assert c.barge_ins == 1 and not h.audible
        sent, committed, final = c.session_machine.item_playback(h.item_id)
        assert final and committed == h.played_ms < sent
