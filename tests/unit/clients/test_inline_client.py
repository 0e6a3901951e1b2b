"""InlineDuplexClient over the ScriptedEngine: the public client API without a socket."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from duplexkit.audio import PlaybackBuffer, read_wav, wav_bytes
from duplexkit.clients import DuplexError, InlineDuplexClient, ref_audio_data_url
from duplexkit.testing import ScriptedEngine

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


def speech(name: str = "question_16k.wav") -> np.ndarray:
    return read_wav(FIXTURES / name, 16_000)[0]


async def send(c, audio: np.ndarray, chunk: int = 1600) -> None:
    for i in range(0, len(audio), chunk):
        await c.send_audio(audio[i:i + chunk])


def client(**kw) -> InlineDuplexClient:
    kw.setdefault("answer_policy", "on_request")
    return InlineDuplexClient(ScriptedEngine(units_per_turn=kw.pop("units_per_turn", 3)), **kw)


async def test_commit_driven_turn_and_events():
    async with client() as c:
        assert c.session["extra_body"]["answer_policy"] == "on_request"
        assert c.session["sample_rate_hz"] == 16000
        await send(c, speech())
        await c.commit()
        h = await c.create_response()
        await h.wait(10)
        assert h.status == "completed" and h.trigger == "client"
        assert h.chunk_sizes == [20160, 24000, 24000, 3840]
        chunks = [x async for x in h.audio()]
        assert sum(len(x) for x in chunks) == 72000
        assert h.transcript == "Hello there, this is a scripted "
        # ack_only: auto_ack reports the answer fully heard once the (virtual, real-time) player
        # has played all of it, not at response.done
        sent, committed, _ = c.session_machine.item_playback(h.item_id)
        assert committed < 3000
        assert await h.wait_heard(10) == 3000
        await asyncio.sleep(0.05)
        sent, committed, _ = c.session_machine.item_playback(h.item_id)
        assert sent == 3000 and committed == 3000
        types = []
        while True:
            try:
                types.append((await asyncio.wait_for(c.events().get(), 0.1)).type)
            except (asyncio.TimeoutError, StopAsyncIteration):
                break
        assert types[0] == "session.created" and types[-1] == "response.done"
    assert c.close_reason == "client_close"
    # the event iterator ends after session.closed
    rest = [ev.type async for ev in c.events()]
    assert rest[-1] == "session.closed"


async def test_errors_reach_the_waiting_call_and_cancel_races_are_swallowed():
    async with client(units_per_turn=50) as c:
        with pytest.raises(DuplexError) as ei:
            await c.commit()
        assert ei.value.code == "input_audio_buffer_empty"
        h = await c.create_response()
        with pytest.raises(DuplexError) as ei:
            await c.create_response()
        assert ei.value.code == "response_already_active"
        await c.cancel(h.id)
        await c.cancel(h.id)  # race: response_not_active is swallowed
        await h.wait(5)
        assert h.status == "cancelled"
        with pytest.raises(DuplexError) as ei:
            await c.update(temperature=5.0)
        assert ei.value.code == "bad_event"
        s = await c.update(temperature=0.2)
        assert s["temperature"] == pytest.approx(0.2)
        ack = await c.heartbeat()
        assert ack.session_id == c.session_id


async def test_text_only_response():
    async with client() as c:
        await send(c, speech())
        await c.commit()
        h = await c.create_response(modalities=["text"])
        await h.wait(10)
        assert h.status == "completed" and h.audio_samples == 0
        assert h.text == "Hello there, this is a scripted "


@pytest.mark.parametrize("form", ["path", "bytes", "array", "tuple"])
async def test_reference_voice_forms(form):
    audio, rate = read_wav(FIXTURES / "ref_voice_16k.wav")
    ref = {"path": str(FIXTURES / "ref_voice_16k.wav"), "bytes": wav_bytes(audio, rate), "array": audio,
           "tuple": (audio, rate)}[form]
    async with client(ref_audio=ref) as c:
        info = c.session["ref_audio"]
        assert len(info["sha256"]) == 64
        assert info["duration_ms"] == (len(audio) // 1600) * 100
    assert ref_audio_data_url("file:///srv/voices/a.wav") == "file:///srv/voices/a.wav"


async def test_local_barge_in_flushes_player_and_acks_what_was_heard():
    player = PlaybackBuffer(24_000)
    session = {"turn_detection": None}  # only the client's own VAD may interrupt
    async with client(units_per_turn=50, player=player, barge_in=True, session=session) as c:
        await send(c, speech())
        await c.commit()
        h = await c.create_response()
        async for _ in h.audio():
            break
        played = player.read(12_000)  # the speaker played 500 ms
        assert len(played) == 12_000 and player.played_ms(h.id) == 500
        await send(c, speech("interrupt_16k.wav")[:16000])  # the user talks over it
        await h.wait(5)
        assert c.barge_ins == 1
        assert h.status == "cancelled" and h.status_details["reason"] == "client_cancelled"
        assert player.queued_samples(h.id) == 0  # flushed
        await asyncio.sleep(0.05)
        sent, committed, final = c.session_machine.item_playback(h.item_id)
        assert committed == 500 and final and sent >= 500


async def test_send_audio_rejects_stereo_arrays():
    async with client() as c:
        with pytest.raises(ValueError):
            await c.send_audio(np.zeros((10, 2), np.float32))
        await c.send_audio(np.zeros(4800, np.float32), rate=48_000)  # resampled to 16 kHz
