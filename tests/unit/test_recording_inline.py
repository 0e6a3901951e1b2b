"""Session recordings (duplexkit/recording.py, docs/debugging.md): the in-process client with the
scripted engine on real speech, the driver's observer hooks, disk errors, caps, retention, the
server's per-session override rule."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

from duplexkit.audio import VirtualPlayer, read_wav
from duplexkit.clients import InlineDuplexClient
from duplexkit.errors import DuplexkitError
from duplexkit.recording import (Recorder, RecordingError, parse_keep, scrub, session_record_choice)
from duplexkit.testing import ScriptedEngine

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
TD = {"type": "server_vad", "create_response": False, "interrupt_response": True, "silence_duration_ms": 500}


def _events(folder: Path) -> list:
    return [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]


async def _one_turn(record, *, units: int = 3, **kw) -> tuple:
    """Real speech in 100 ms appends (faster than real time), commit, a requested answer of
    ``units`` seconds played by a real-time virtual player to its end."""
    speech = read_wav(FIX / "question_16k.wav", 16_000)[0]
    async with InlineDuplexClient(ScriptedEngine(units_per_turn=units, random_weights=True), record=record,
                                  session={"turn_detection": TD}, player=VirtualPlayer(block_ms=20),
                                  request_timeout_s=30, **kw) as c:
        for i in range(0, len(speech), 1600):
            await c.send_audio(speech[i:i + 1600])
            await asyncio.sleep(0.005)
        await c.commit()
        h = await c.create_response()
        await h.wait(30)
        played = await h.wait_heard(30)
        await asyncio.sleep(0.1)  # the truncating ack goes out
        rec = c.recording
    return rec, h, played, len(speech)


def test_scrub_replaces_payloads_by_byte_counts():
    b64 = "QUJD" * 100  # 300 bytes
    ev = {"type": "input_audio_buffer.append", "audio": b64,
          "session": {"ref_audio": "data:audio/wav;base64," + b64, "instructions": "x" * 500},
          "delta": "a short transcript"}
    out = scrub(ev)
    assert out["audio"] == {"omitted": "base64", "bytes": 300}
    assert out["session"]["ref_audio"] == {"omitted": "base64", "bytes": 300}
    assert out["session"]["instructions"] == "x" * 500  # text is kept
    assert out["delta"] == "a short transcript"
    assert ev["audio"] == b64  # the original is not touched


def test_parse_keep():
    assert parse_keep(None) == (None, None)
    assert parse_keep("50") == (50, None)
    assert parse_keep("7d") == (None, 7.0)
    for bad in ("0", "-3", "x", "7w", "0d"):
        with pytest.raises(RecordingError) as e:
            parse_keep(bad)
        assert isinstance(e.value, DuplexkitError) and e.value.code == "bad_recording"


@pytest.mark.parametrize("record_dir,policy,query,expect", [
    (None, "all", None, (False, False)),
    (None, "all", "0", (False, False)),
    (None, "all", "1", (False, True)),  # asks for a recording the server cannot make: refused
    ("d", "all", None, (True, False)),
    ("d", "all", "0", (False, False)),  # opt-out
    ("d", "opt-in", None, (False, False)),
    ("d", "opt-in", "1", (True, False)),
    ("d", "always", None, (True, False)),
    ("d", "always", "0", (False, True)),  # opting out is forbidden: refused, never ignored
    ("d", "all", "maybe", (False, True)),
])
def test_server_override_rule(record_dir, policy, query, expect):
    rec, refusal = session_record_choice(SimpleNamespace(record_dir=record_dir, record_policy=policy), query)
    assert (rec, refusal is not None) == expect


async def test_inline_client_records_a_turn(tmp_path):
    rec, h, played, n_speech = await _one_turn(tmp_path)
    assert rec.recorder.flush(20)
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(folders) == 1 and folders[0] == rec.folder
    folder = folders[0]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["complete"] and meta["side"] == "inline" and meta["session_id"] == folder.name
    assert meta["model"] == "scripted" and meta["random_weights"] is True
    assert meta["versions"]["duplexkit"] and meta["failed"] is None and not meta["capped"]
    assert meta["session"]["id"] == folder.name
    # the three WAVs share the session clock: same duration, the session's length
    dur = meta["duration_ms"]
    infos = {n: sf.info(folder / f"{n}.wav") for n in ("user", "assistant_generated", "assistant_heard")}
    assert infos["user"].samplerate == 16_000 and infos["assistant_heard"].samplerate == 24_000
    for info in infos.values():
        assert abs(info.frames / info.samplerate * 1000 - dur) <= 1
    # the user's audio: the real speech the model got (on its units), not silence
    user, _ = sf.read(folder / "user.wav", dtype="float32")
    speech = read_wav(FIX / "question_16k.wav", 16_000)[0]
    assert np.abs(user).max() > 0.1
    assert abs(np.sum(user ** 2) - np.sum(speech ** 2)) / np.sum(speech ** 2) < 0.05
    # the answer, fully heard: generated == heard == what the player played
    (resp,) = meta["responses"]
    assert resp["response_id"] == h.id and resp["generated_ms"] == int(h.audio_ms)
    assert resp["heard_ms"] == played == resp["generated_ms"] > 0
    gen, _ = sf.read(folder / "assistant_generated.wav", dtype="int16")
    heard, _ = sf.read(folder / "assistant_heard.wav", dtype="int16")
    assert np.array_equal(gen, heard) and np.count_nonzero(gen) > 0
    # events: both directions and the engine's units and decisions, session-clock ordered
    ev = _events(folder)
    dirs = {e["dir"] for e in ev}
    assert dirs == {"client", "server", "engine"}
    types = [e["type"] for e in ev]
    for t in ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "response.create",
              "playback.ack", "session.created", "response.created", "response.output_audio.delta",
              "response.done", "engine.append_unit", "engine.decision"):
        assert t in types, t
    assert [e["t_ms"] for e in ev if e["dir"] != "engine"] == sorted(e["t_ms"] for e in ev if e["dir"] != "engine")
    append = next(e for e in ev if e["type"] == "input_audio_buffer.append")
    assert append["event"]["audio"]["omitted"] == "base64" and append["event"]["audio"]["bytes"] > 0
    delta = next(e for e in ev if e["type"] == "response.output_audio.delta")
    assert delta["event"]["delta"]["bytes"] > 0
    assert "speak" in {e["event"]["decision"] for e in ev if e["type"] == "engine.decision"}
    units = [e["event"] for e in ev if e["type"] == "engine.append_unit"]
    assert units[0]["audio_ms"] == 1035 and all(u["audio_ms"] == 1000 for u in units[1:])
    tr = json.loads((folder / "transcript.json").read_text())
    assert [r["role"] for r in tr] == ["assistant"] and tr[0]["text"] and tr[0]["heard_text"] == tr[0]["text"]
    assert "assistant" in (folder / "transcript.txt").read_text()


async def test_unwritable_directory_leaves_the_session_working(tmp_path, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    caplog.set_level(logging.WARNING, logger="duplexkit.recording")
    rec, h, played, _ = await _one_turn(Recorder(blocker / "recs"))
    assert h.status == "completed" and played > 0 and played == int(h.audio_ms)  # the session went on
    assert rec.recorder.flush(20)
    warnings = [r for r in caplog.records if r.name == "duplexkit.recording" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stopped" in warnings[0].getMessage()
    assert rec.folder is None and not (blocker / "recs").exists()


async def test_size_cap_stops_recording_and_keeps_what_fits(tmp_path):
    rec, h, played, _ = await _one_turn(Recorder(tmp_path, max_bytes=40_000))
    assert h.status == "completed" and played > 0
    assert rec.recorder.flush(20)
    meta = json.loads((rec.folder / "meta.json").read_text())
    assert meta["capped"] and meta["complete"] and meta["bytes"] <= 40_000
    assert (rec.folder / "user.wav").is_file()


async def test_retention_keeps_the_newest(tmp_path):
    r = Recorder(tmp_path, keep_count=2)
    names = []
    for _ in range(3):
        rec, *_ = await _one_turn(r, units=1)
        assert r.flush(20)
        names.append(rec.folder.name)
        await asyncio.sleep(0.05)  # distinct mtimes
    left = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert left == sorted(names[1:])


async def test_driver_observers_and_client_event_hook():
    """``add_observer``: several observers, each hook optional, a failing one ignored."""
    from duplexkit.driver import SessionDriver
    from duplexkit.session import Session, SessionConfig

    seen: list = []

    class Full:
        def client_event(self, raw):
            seen.append(("client", raw["type"]))

        def server_event(self, ev):
            seen.append(("server", ev["type"]))

    class Broken:
        def client_event(self, raw):
            raise RuntimeError("boom")

    class MetricsLike:  # no client_event hook (the server's metrics observer)
        def server_event(self, ev):
            seen.append(("metrics", ev["type"]))

    out: list = []
    d = SessionDriver(Session(SessionConfig(), now_ms=0), ScriptedEngine(), on_event=out.append,
                      on_close=lambda item: None)
    d.observer = MetricsLike()
    d.add_observer(Broken())
    d.add_observer(Full())
    d.start()
    d.client_event({"type": "session.update", "session": {}})
    for _ in range(100):
        if out:
            break
        await asyncio.sleep(0.01)
    await d.aclose()
    assert ("client", "session.update") in seen
    assert ("metrics", "session.created") in seen and ("server", "session.created") in seen
    assert seen.index(("metrics", "session.created")) < seen.index(("server", "session.created"))
