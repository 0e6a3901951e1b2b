"""Odd but plausible ways of misusing the clients, kept as tests.

In-process (``InlineDuplexClient`` + the scripted engine): odd pcm16 bytes, bad inputs, calls after
``close()``, a barge-in when the session is already gone.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from duplexkit.audio import PlaybackBuffer
from duplexkit.clients import InlineDuplexClient
from duplexkit.testing import ScriptedEngine
from duplexkit.errors import DuplexConnectionError


def _engine_audio(c) -> np.ndarray:
    return np.concatenate([u.audio for u in c.stream.units_seen])


async def _commit_sent(c, timeout_s: float = 10.0) -> None:
    """Wait until the Session has sent the last commit's unit (held back COMMIT_MERGE_MS for a
    possible response.create, then closed at the next clock tick)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while c.session_machine._close_pending_ms is not None and loop.time() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)


async def test_an_odd_trailing_byte_is_dropped_at_commit_and_clear():
    """A stray byte must not shift every later append (it would turn the speech into noise)."""
    async with InlineDuplexClient(ScriptedEngine(units_per_turn=None), session={"turn_detection": None}) as c:
        tone = (0.25 * np.ones(1600) * 32767).astype("<i2").tobytes()
        await c.send_audio(tone + b"\x01")  # 1600 samples and half of one more
        await c.commit()
        await c.send_audio(b"\x02")  # an odd byte, then cleared
        await c.clear_input()
        await c.send_audio(tone * 10)  # 1 s of a constant +0.25
        await c.commit()
        await _commit_sent(c)
        y = _engine_audio(c)
    voiced = y[np.abs(y) > 0.1]
    assert voiced.size >= 16_000 + 1600 - 10
    assert np.allclose(voiced, 0.25, atol=0.01), "later appends were byte-shifted"


@pytest.mark.parametrize("bad,exc", [
    (np.float32(0.5), TypeError),
    ([0.1, 0.2], TypeError),
    (np.zeros((2, 160), np.float32), ValueError),
    (np.zeros(160, np.int32), TypeError),
    (np.full(160, np.nan, np.float32), ValueError),
])
async def test_bad_audio_is_a_clear_typed_error_and_the_session_lives(bad, exc):
    async with InlineDuplexClient(ScriptedEngine(), session={"turn_detection": None}) as c:
        with pytest.raises(exc):
            await c.send_audio(bad)
        assert (await c.heartbeat()).type == "session.heartbeat_ack"


async def test_int16_arrays_are_pcm16_samples_and_rates_are_checked():
    async with InlineDuplexClient(ScriptedEngine(units_per_turn=None), session={"turn_detection": None}) as c:
        await c.send_audio((0.25 * np.ones(16_000) * 32767).astype(np.int16))
        for rate in (1000, 16000.5, 96_000):
            with pytest.raises(ValueError):
                await c.send_audio(np.zeros(160, np.float32), rate=rate)
        await c.commit()
        await _commit_sent(c)
        y = _engine_audio(c)
        with pytest.raises(ValueError):
            await c.ack_playback("resp_x", 1.5)
    assert np.allclose(y[np.abs(y) > 0.1], 0.25, atol=0.01)


def test_an_invalid_echo_option_is_refused_at_construction():
    for bad in ("bogus", "AEC", 5):
        with pytest.raises(ValueError):
            InlineDuplexClient(ScriptedEngine(), echo=bad)


async def test_calls_after_close_say_client_closed_and_connect_does_not_reopen():
    c = InlineDuplexClient(ScriptedEngine(), session={"turn_detection": None})
    await c.connect()
    await c.close()
    for call in (lambda: c.send_audio(np.zeros(160, np.float32)), c.commit, c.create_response,
                 lambda: c.update(temperature=0.3), lambda: c.ack_playback("resp_x", 10), c.connect):
        with pytest.raises(DuplexConnectionError) as ei:
            await call()
        assert ei.value.code == "client_closed"


async def test_barge_in_stops_the_audio_even_when_the_session_is_gone():
    player = PlaybackBuffer()
    c = InlineDuplexClient(ScriptedEngine(units_per_turn=4), session={"turn_detection": None}, player=player)
    await c.connect()
    await c.send_audio(np.zeros(16_000, np.float32))
    h = await c.create_response()
    for _ in range(5):
        await c.send_audio(np.zeros(16_000, np.float32))
    await h.wait(10)
    player.read(24_000)  # 1 s heard, ~2 s still queued
    assert h.audible and c.speaking
    c._on_transport_lost(DuplexConnectionError("gone", code="connection_lost"))  # the transport dies
    assert await c.barge_in() is h  # no error: the user's "stop" always works locally
    assert not h.audible and not c.speaking and h.played_ms == 1000
    assert await h.wait_heard(1) == 1000
    await c.close()
