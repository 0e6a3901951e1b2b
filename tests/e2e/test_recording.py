"""A server session recorded end to end: ``duplexkit serve scripted --record DIR`` as a real
subprocess, a ``DuplexClient`` on real speech with a server-VAD barge-in over a long answer; the
folder holds the audio on the session clock, the events, the transcripts and the metadata, and
the heard answer is shorter than the generated one. Also the ``?record`` override refusal."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from duplexkit.audio import VirtualPlayer, read_wav
from duplexkit.clients import DuplexClient, DuplexConnectionError
from duplexkit.recording import Recorder
from _serverproc import ServerProc
from _timing import bound

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
TD = {"type": "server_vad", "create_response": False, "interrupt_response": True, "silence_duration_ms": 500}


async def _barge_in_session(url: str, record=None) -> tuple:
    player = VirtualPlayer(block_ms=20)
    async with DuplexClient(url, player=player, session={"turn_detection": TD}, input_rate=16_000,
                            request_timeout_s=bound(30), record=record) as c:
        await c.send_audio(np.zeros(16_000, np.float32))
        h = await c.create_response()
        for _ in range(8):  # silence faster than real time carries the answer
            await c.send_audio(np.zeros(16_000, np.float32))
        async with asyncio.timeout(bound(30)):
            while h.played_ms < 1_500:
                await asyncio.sleep(0.01)
        speech = read_wav(FIX / "interrupt_16k.wav", 16_000)[0]
        for i in range(0, len(speech), 320):  # the user talks over it, 20 ms chunks in real time
            await c.send_audio(speech[i:i + 320])
            await asyncio.sleep(0.02)
        await h.wait(bound(30))
        await h.wait_heard(bound(30))
        await asyncio.sleep(0.3)
        sid = c.session["id"]
    return sid, h


def test_server_recording_with_a_barge_in(tmp_path):
    rec_dir = tmp_path / "recs"
    with ServerProc("scripted", "--record", str(rec_dir), "--scripted", "units_per_turn=null") as srv:
        client_rec = Recorder(tmp_path / "client")
        sid, h = asyncio.run(_barge_in_session(srv.ws_url + "/v1/realtime?duplex=1", client_rec))
        srv.wait_idle()
        folder = rec_dir / sid
        for _ in range(int(bound(20) / 0.1)):
            if (folder / "meta.json").is_file() and json.loads((folder / "meta.json").read_text())["complete"]:
                break
            asyncio.run(asyncio.sleep(0.1))
    assert h.status == "cancelled"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["complete"] and meta["side"] == "server" and meta["session_id"] == sid
    assert meta["model"] and "random_weights" in meta and meta["versions"]["duplexkit"]
    assert "ref_voice_sha256" in meta and meta["failed"] is None
    dur = meta["duration_ms"]
    for name, rate in (("user", 16_000), ("assistant_generated", 24_000), ("assistant_heard", 24_000)):
        info = sf.info(folder / f"{name}.wav")
        assert info.samplerate == rate and abs(info.frames * 1000 / rate - dur) <= 1
    # the user's audio sits on the session clock: the interruption is in the second half
    user, _ = sf.read(folder / "user.wav", dtype="float32")
    loud = np.flatnonzero(np.abs(user) > 0.05)
    assert len(loud) and loud[0] / 16 > 1_000
    (resp,) = [r for r in meta["responses"] if r["response_id"] == h.id]
    assert resp["status"] == "cancelled"
    assert 0 < resp["heard_ms"] < resp["generated_ms"]
    assert abs(resp["heard_ms"] - h.played_ms) <= 40
    gen, _ = sf.read(folder / "assistant_generated.wav", dtype="int16")
    heard, _ = sf.read(folder / "assistant_heard.wav", dtype="int16")
    assert np.count_nonzero(heard) < np.count_nonzero(gen)
    ev = [json.loads(x) for x in (folder / "events.jsonl").read_text().splitlines()]
    types = {e["type"] for e in ev}
    assert {"input_audio_buffer.speech_started", "response.done", "playback.ack", "engine.decision",
            "engine.append_unit", "input_audio_buffer.append"} <= types
    started = next(e for e in ev if e["type"] == "input_audio_buffer.speech_started")
    done = next(e for e in ev if e["type"] == "response.done")
    assert started["t_ms"] <= done["t_ms"]
    assert done["event"]["response"]["status_details"]["reason"] == "turn_detected"
    assert all("audio" not in e["event"] or isinstance(e["event"]["audio"], dict)
               for e in ev if e["type"] == "input_audio_buffer.append")
    # the same conversation as the remote client recorded it on its side
    assert client_rec.flush(20)
    cfolder = tmp_path / "client" / sid
    cmeta = json.loads((cfolder / "meta.json").read_text())
    assert cmeta["complete"] and cmeta["side"] == "client" and cmeta["random_weights"] is None
    (cresp,) = [r for r in cmeta["responses"] if r["response_id"] == h.id]
    assert cresp["status"] == "cancelled" and 0 < cresp["heard_ms"] < cresp["generated_ms"]
    assert abs(cresp["heard_ms"] - resp["heard_ms"]) <= 40
    cuser, _ = sf.read(cfolder / "user.wav", dtype="float32")
    speech = read_wav(FIX / "interrupt_16k.wav", 16_000)[0]
    assert abs(np.sum(cuser ** 2) - np.sum(speech ** 2)) / np.sum(speech ** 2) < 0.05  # what it sent
    cev = [json.loads(x) for x in (cfolder / "events.jsonl").read_text().splitlines()]
    assert {e["dir"] for e in cev} == {"client", "server"}


def test_record_override_refused_when_the_server_forbids_it(tmp_path):
    async def connect(url):
        async with DuplexClient(url, request_timeout_s=bound(20)):
            pass

    with ServerProc("scripted", "--record", str(tmp_path), "--record-policy", "always") as srv:
        with pytest.raises(DuplexConnectionError) as e:
            asyncio.run(connect(srv.ws_url + "/v1/realtime?duplex=1&record=0"))
        assert e.value.code == "bad_event" and "record" in str(e.value)
