"""``duplexkit serve --engine-process`` (the default): the engine runs in its own spawned process
(:mod:`duplexkit.engine.process`). Real server processes, real sockets, the speech fixture.

Shown here: a full realtime session with the §12 invariants and 24 kHz audio through the process,
chat completions through it, a killed engine process (the session gets ``session.closed`` and close
1011, ``/ready`` and ``/health`` report the error, one log line, no orphan process after the server
exits), a server killed with SIGKILL (its engine process exits by itself: pipe EOF), load failures
(same message and exit code 4 both ways), and ``--no-engine-process`` (no child).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets

from duplexkit.audio import read_wav
from duplexkit.protocol.conformance import EventStreamChecker

from _serverproc import REPO, ServerProc

pytestmark = pytest.mark.e2e


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _children(pid: int) -> dict[int, str]:
    """Live child processes of ``pid`` -> their command line (from /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            state = stat[stat.rindex(")") + 2:].split()[0]
            if ppid == pid and state != "Z":
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    return out


def _engine_child(pid: int) -> int:
    """The pid of the server's engine process (a multiprocessing spawn child, not its resource tracker)."""
    kids = [k for k, cmd in _children(pid).items() if "spawn_main" in cmd and "resource_tracker" not in cmd]
    assert len(kids) == 1, _children(pid)
    return kids[0]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def _wait_gone(pid: int, polls: int = 600) -> bool:
    for _ in range(polls):  # up to 60 s in 0.1 s polls (a loaded machine exits slowly)
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _speech_appends(wav: Path) -> list[str]:
    audio = read_wav(wav, 16_000)[0]
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    return [json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + 3200]).decode()})
            for i in range(0, len(pcm), 3200)]


async def _events_until(ws, checker: EventStreamChecker, pred, timeout: float = 120.0) -> list[dict]:
    got = []
    async with asyncio.timeout(timeout):
        while True:
            ev = json.loads(await ws.recv())
            checker.feed(ev)
            got.append(ev)
            if pred(ev):
                return got


def _pcm_samples(events: list[dict]) -> int:
    return sum(len(base64.b64decode(e["delta"])) // 2 for e in events if e["type"] == "response.output_audio.delta")


@pytest.fixture(scope="module")
def proc_server():
    with ServerProc("scripted", "--engine-process", "--answer-policy", "on_request",
                    "--scripted", "units_per_turn=3") as srv:
        yield srv


# ---------------------------------------------------------------------------------------------
# a server with the engine process
# ---------------------------------------------------------------------------------------------

async def test_realtime_session_with_speech_through_the_engine_process(proc_server, question_wav):
    child = _engine_child(proc_server.proc.pid)
    checker = EventStreamChecker()
    async with websockets.connect(proc_server.ws_url + "/v1/realtime?duplex=1", max_size=None) as ws:
        await _events_until(ws, checker, lambda e: e["type"] == "session.created")
        for a in _speech_appends(question_wav):
            await ws.send(a)
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        evs = await _events_until(ws, checker, lambda e: e["type"] == "response.done")
        done = evs[-1]
        assert done["response"]["status"] == "completed", done
        deltas = [e for e in evs if e["type"] == "response.output_audio.delta"]
        assert deltas and all(e["sample_rate_hz"] == 24000 and e["format"] == "pcm16" for e in deltas)
        # the scripted turn: 20 160 + 24 000 + 24 000 + the 3 840-sample flush, in order
        assert _pcm_samples(evs) == 72000
        # a second response: the same stream in the engine process keeps its state
        await ws.send(json.dumps({"type": "response.create"}))
        evs2 = await _events_until(ws, checker, lambda e: e["type"] == "response.done")
        assert evs2[-1]["response"]["status"] == "completed" and _pcm_samples(evs2) == 72000
        await ws.send(json.dumps({"type": "session.close"}))
        rest = await _events_until(ws, checker, lambda e: e["type"] == "session.closed")
        assert rest[-1]["reason"] == "client_close"
    assert _engine_child(proc_server.proc.pid) == child  # one engine process serves every session


def test_chat_completions_through_the_engine_process(proc_server):
    r = httpx.post(proc_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Say hello."}], "modalities": ["text", "audio"]})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert choices[0]["message"]["content"] == "This is a scripted chat reply."
    audio = [c["message"]["audio"]["data"] for c in choices if (c["message"].get("audio") or {}).get("data")]
    assert len(audio) == 1
    pcm, rate = read_wav(base64.b64decode(audio[0]))
    assert rate == 24000 and len(pcm) == 6 * 9600  # 0.4 s of tone per word
    chunks, done = [], False
    with httpx.stream("POST", proc_server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Say hello."}], "stream": True, "max_tokens": 3,
            "modalities": ["text"]}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert done and text == "This is a"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_health_and_metrics_through_the_engine_process(proc_server):
    h = httpx.get(proc_server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == "scripted" and h["random_weights"] is False
    assert httpx.get(proc_server.url + "/ready").status_code == 200


# ---------------------------------------------------------------------------------------------
# failures
# ---------------------------------------------------------------------------------------------

async def test_killed_engine_process_closes_sessions_and_marks_the_server_not_ready(question_wav):
    srv = ServerProc("scripted", "--engine-process", "--answer-policy", "on_request",
                     "--scripted", "units_per_turn=1000")  # the answer plays until the kill
    try:
        child = _engine_child(srv.proc.pid)
        checker = EventStreamChecker()
        async with websockets.connect(srv.ws_url + "/v1/realtime?duplex=1", max_size=None) as ws:
            await _events_until(ws, checker, lambda e: e["type"] == "session.created")
            for a in _speech_appends(question_wav):
                await ws.send(a)
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            await _events_until(ws, checker, lambda e: e["type"] == "response.output_audio.delta")
            os.kill(child, signal.SIGKILL)  # mid-answer

            async def feed() -> None:  # input keeps flowing, as from a live microphone
                silence = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(3200)).decode()})
                while True:
                    await ws.send(silence)
                    await asyncio.sleep(0.1)

            feeder = asyncio.get_running_loop().create_task(feed())
            try:
                evs = await _events_until(ws, checker, lambda e: e["type"] == "session.closed")
            finally:
                feeder.cancel()
            assert evs[-1]["reason"] == "server_error"
            assert any(e["type"] == "response.done" and e["response"]["status"] == "failed" for e in evs)
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 30)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1011
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and r.json()["status"] == "error"
        assert "engine process" in r.json()["reason"] and "died" in r.json()["reason"]
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "error"
        live = httpx.get(srv.url + "/live")  # nothing but a restart brings the engine back
        assert live.status_code == 503 and live.json()["status"] == "error"
        c = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert c.status_code == 503 and "error" in c.json()
        async with websockets.connect(srv.ws_url + "/v1/realtime") as ws2:  # refused: 1013 after the accept
            with pytest.raises(websockets.ConnectionClosed) as info2:
                while True:
                    await asyncio.wait_for(ws2.recv(), 30)
            assert info2.value.rcvd.code == 1013
    finally:
        rc = srv.stop()
    log = srv.output()
    assert len([ln for ln in log.splitlines() if "died with exit code -9" in ln]) == 1, log
    assert "Traceback" not in log, log
    assert rc == 0
    assert _children(srv.proc.pid) == {}


def test_sigint_joins_the_engine_process():
    srv = ServerProc("scripted", "--engine-process")
    child = _engine_child(srv.proc.pid)
    assert srv.stop(signal.SIGINT) == 0
    assert not _alive(child)  # joined by the server before it exited (no zombie, no orphan)


def test_engine_process_exits_when_the_server_is_killed():
    srv = ServerProc("scripted", "--engine-process")
    child = _engine_child(srv.proc.pid)
    srv.proc.kill()
    srv.proc.wait(30)
    assert _wait_gone(child), f"engine process {child} outlived its server"


@pytest.mark.parametrize("flag", ["--engine-process", "--no-engine-process"])
def test_load_failure_is_one_line_and_exit_4_both_ways(flag):
    r = subprocess.run([sys.executable, "-m", "duplexkit.cli", "serve", "scripted", "--port", "0", flag,
                        "--scripted", "no_such_option=1"], cwd=str(REPO), capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 4, r.stdout + r.stderr
    assert "error: engine failed to load: unknown ScriptConfig field 'no_such_option'" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_no_engine_process_keeps_one_process():
    with ServerProc("scripted", "--no-engine-process") as srv:
        assert not [k for k, cmd in _children(srv.proc.pid).items() if "spawn_main" in cmd]
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
