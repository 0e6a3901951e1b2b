"""Ctrl+C (SIGINT) and SIGTERM at every phase of every ``duplexkit`` command, each run as a real
process: while the model loads, while serving idle, during a response, during a drain.

Each command starts in a session of its own and the signal goes to its whole process group, as a
terminal's Ctrl+C (and systemd's ``KillMode=control-group``) deliver it: the engine process gets it
too. Every run must end with the documented status (docs/cli.md, "Exit status": ``serve`` 0,
``mic`` 0 once ready, the others 130 / 143), print no traceback, no asyncio complaint and no false
"did not exit" warning, and leave no process behind (the engine process and multiprocessing's
resource tracker included: checked in /proc by session id).

Every wait is for an event (a line printed, ``/health``, a server event) under a bound for a loaded
2-core machine (tests/_timing.py). The scripted engine serves wherever the model does not matter;
the tiny model where the phase is the model load itself.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from _liveproc import LiveProc, command_env, duplexkit_argv
from _serverproc import REPO, free_port
from _timing import bound

pytestmark = pytest.mark.e2e

FIXTURES = REPO / "tests" / "fixtures" / "audio"
NOISE = ("Traceback", "never retrieved", "did not exit", "Task was destroyed", "Exception ignored",
         "was never awaited", "engine failed to load")
"""Text that must never appear on a stopped command's output."""
SIGS = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143)}


def _session_members(sid: int) -> dict[int, str]:
    """Processes (pid -> state letter) whose session id is ``sid`` (the command and everything it started)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid:  # fields after "(comm)": state ppid pgrp session ...
            out[int(d.name)] = fields[0]
    return out


class Cmd(LiveProc):
    """One ``duplexkit`` command in a session of its own; its stdout and stderr are read live."""

    def __init__(self, *argv: str, env: dict | None = None) -> None:
        self.argv = argv
        self.members: set[int] = set()  # every process seen in the command's session
        super().__init__(duplexkit_argv(*argv), command_env(env, drop=("DUPLEXKIT_DEBUG", "DUPLEXKIT_API_KEY")),
                         new_session=True, what=str(argv))
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while self.proc.poll() is None:
            self.members.update(_session_members(self.proc.pid))
            time.sleep(0.05)

    def wait_health(self, port: int, status: int = 200, bound_s: float = 120) -> None:
        deadline = time.monotonic() + bound(bound_s)
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=bound(10)).status_code == status:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail(f"/health never answered {status}:\n{self.text()}")

    def kill_group(self, sig: int) -> None:
        """``sig`` to the whole process group, as a terminal sends Ctrl+C."""
        self.members.update(_session_members(self.proc.pid))
        os.killpg(self.proc.pid, sig)

    def finish(self, bound_s: float = 60) -> int:
        """Wait for the exit; then nothing of the command may be left (bounded wait for the last ones)."""
        try:
            rc = self.proc.wait(bound(bound_s))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            pytest.fail(f"{self.argv} did not stop within {bound(bound_s):.0f} s of the signal:\n{self.text()}")
        deadline = time.monotonic() + bound(10)
        left = _session_members(self.proc.pid)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = _session_members(self.proc.pid)
        assert not left, f"processes left behind by {self.argv}: {left} (seen: {sorted(self.members)}):\n{self.text()}"
        return rc

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def assert_clean(self) -> None:
        out = self.text()
        for bad in NOISE:
            assert bad not in out, f"{bad!r} in the output of {self.argv}:\n{out}"


def _stopped(cmd: Cmd, sig: int, status: int, bound_s: float = 60) -> str:
    cmd.kill_group(sig)
    rc = cmd.finish(bound_s)
    assert rc == status, f"{cmd.argv}: status {rc}, expected {status}:\n{cmd.text()}"
    cmd.assert_clean()
    return cmd.text()


# ---------------------------------------------------------------------------------------------
# serve: 0 in every phase (a stop signal is how a server ends)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SIGS))
def test_serve_stopped_while_the_engine_process_loads(name):
    port = free_port()
    cmd = Cmd("serve", "tiny", "--port", str(port))
    try:
        cmd.wait_line("loading the tiny random-weight model")  # printed by the engine process as it loads
        out = _stopped(cmd, SIGS[name][0], 0, bound_s=30)
    finally:
        cmd.close()
    assert "model ready" not in out or "engine ready" in out, out


def test_serve_stopped_while_the_model_loads_in_process():
    """``--no-engine-process``: the load runs in a thread of the server, which interrupts it."""
    port = free_port()
    cmd = Cmd("serve", "tiny", "--port", str(port), "--no-engine-process")
    try:
        cmd.wait_line("loading the tiny random-weight model")
        _stopped(cmd, signal.SIGINT, 0, bound_s=60)
    finally:
        cmd.close()


@pytest.mark.parametrize("phase", ["loading the tiny random-weight model", "loading thinker"])
def test_serve_stopped_while_the_model_loads_in_process_exits_promptly(phase):
    """``--no-engine-process``, Ctrl+C at two points of the load: the load is stopped, not finished
    ("model ready" never printed, though the tiny load takes 8-11 s here), and once the server has
    finished (uvicorn's last line) the process is gone at once: no final garbage collection of the
    half-loaded model, which held the exit 1.7 s on an idle machine and several seconds on a busy one.
    Wall time from the signal to the exit is bounded loosely (what is left of a load step and the
    shutdown itself vary with the machine's load)."""
    port = free_port()
    cmd = Cmd("serve", "tiny", "--port", str(port), "--no-engine-process")
    try:
        cmd.wait_line(phase)
        t0 = time.monotonic()
        cmd.kill_group(signal.SIGINT)
        cmd.wait_line("Finished server process", bound_s=30)
        t_finished = time.monotonic()
        rc = cmd.finish(60)
        t_exit = time.monotonic()
    finally:
        cmd.close()
    out = cmd.text()
    assert rc == 0, out
    cmd.assert_clean()
    assert "model ready" not in out, out
    assert t_exit - t_finished < bound(1.2), f"{t_exit - t_finished:.2f} s from the server's end to the exit:\n{out}"
    assert t_exit - t0 < bound(6), f"{t_exit - t0:.2f} s from Ctrl+C to the exit:\n{out}"


@pytest.mark.parametrize("name", list(SIGS))
def test_serve_stopped_while_idle(name):
    port = free_port()
    cmd = Cmd("serve", "scripted", "--port", str(port))
    try:
        cmd.wait_health(port)
        assert len(cmd.members) >= 2, cmd.members  # the engine runs in its own process
        _stopped(cmd, SIGS[name][0], 0)
    finally:
        cmd.close()


async def _response_in_progress(port: int):
    """A realtime session (the question fixture as input) whose answer is streaming audio."""
    from duplexkit.audio import read_wav
    from duplexkit.clients import DuplexClient

    audio, _ = read_wav(FIXTURES / "question_16k.wav", 16_000)
    client = DuplexClient(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1", session={"turn_detection": None},
                          request_timeout_s=bound(60))
    await client.connect()
    await client.send_audio(np.asarray(audio, np.float32), rate=16_000)
    await client.commit()
    handle = await client.create_response()
    chunks = handle.audio().__aiter__()
    await asyncio.wait_for(chunks.__anext__(), bound(60))  # the answer is being spoken
    return client, handle


async def _closed_reason(client) -> str:
    """The reason of the ``session.closed`` the server sent (waits for it)."""
    async def first():
        async for ev in client.events():
            if ev.type == "session.closed":
                return ev.reason
        return None
    return await asyncio.wait_for(first(), bound(60))


@pytest.mark.parametrize("name", list(SIGS))
async def test_serve_stopped_during_a_response(name):
    port = free_port()
    # SIGTERM drains: with no drain time the live session is closed at once, as with SIGINT
    cmd = Cmd("serve", "scripted", "--port", str(port), "--scripted", "units_per_turn=40", "--drain-s", "0")
    try:
        await asyncio.to_thread(cmd.wait_health, port)
        client, handle = await _response_in_progress(port)
        try:
            reason = asyncio.ensure_future(_closed_reason(client))
            await asyncio.sleep(0)
            await asyncio.to_thread(_stopped, cmd, SIGS[name][0], 0)
            assert await reason == "shutdown"
        finally:
            await client.close()
    finally:
        cmd.close()


@pytest.mark.parametrize("second", list(SIGS))
async def test_serve_second_signal_during_the_drain_closes_at_once(second):
    port = free_port()
    cmd = Cmd("serve", "scripted", "--port", str(port), "--scripted", "units_per_turn=40", "--drain-s", "10m")
    try:
        await asyncio.to_thread(cmd.wait_health, port)
        client, handle = await _response_in_progress(port)
        try:
            reason = asyncio.ensure_future(_closed_reason(client))
            cmd.kill_group(signal.SIGTERM)
            await asyncio.to_thread(cmd.wait_line, "draining: 1 session slot(s) in use")
            t0 = time.monotonic()
            await asyncio.to_thread(_stopped, cmd, SIGS[second][0], 0)
            assert time.monotonic() - t0 < bound(60)  # not the 10-minute drain
            assert await reason == "shutdown"
        finally:
            await client.close()
    finally:
        cmd.close()


async def test_serve_drain_ends_when_the_session_ends():
    port = free_port()
    cmd = Cmd("serve", "scripted", "--port", str(port), "--scripted", "units_per_turn=40", "--drain-s", "10m")
    try:
        await asyncio.to_thread(cmd.wait_health, port)
        client, handle = await _response_in_progress(port)
        cmd.kill_group(signal.SIGTERM)
        await asyncio.to_thread(cmd.wait_line, "draining: 1 session slot(s) in use")
        await client.close()  # the last session ends by itself: the drain is over
        rc = await asyncio.to_thread(cmd.finish)
        assert rc == 0, cmd.text()
        cmd.assert_clean()
    finally:
        cmd.close()


# ---------------------------------------------------------------------------------------------
# demo and chat: 130 (SIGINT) / 143 (SIGTERM) in every phase
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SIGS))
def test_demo_stopped_while_the_model_loads(name, tmp_path):
    cmd = Cmd("demo", "tiny", "--output", str(tmp_path / "out.wav"))
    try:
        cmd.wait_line("loading the tiny random-weight model")
        t0 = time.monotonic()
        out = _stopped(cmd, *SIGS[name], bound_s=30)
    finally:
        cmd.close()
    assert "model ready" not in out, out  # stopped the load, did not wait for it
    assert time.monotonic() - t0 < bound(30)
    assert not (tmp_path / "out.wav").exists()


@pytest.fixture(scope="module")
def long_wav(tmp_path_factory) -> Path:
    """30 s of input: ``demo`` prints its progress while it sends it (a session in progress)."""
    from duplexkit.audio import read_wav, write_wav

    q, _ = read_wav(FIXTURES / "question_16k.wav", 16_000)
    path = tmp_path_factory.mktemp("interrupt") / "long_16k.wav"
    write_wav(path, np.tile(q, int(np.ceil(30 * 16_000 / len(q))))[: 30 * 16_000], 16_000)
    return path


@pytest.mark.parametrize("name", list(SIGS))
def test_demo_stopped_during_the_session(name, tmp_path, long_wav):
    cmd = Cmd("demo", "scripted", "--input", str(long_wav), "--output", str(tmp_path / "out.wav"))
    try:
        cmd.wait_line("sending:")  # the session is open and streaming input
        _stopped(cmd, *SIGS[name])
    finally:
        cmd.close()


@pytest.mark.parametrize("name", list(SIGS))
def test_demo_against_a_server_stopped_during_the_session(name, tmp_path, long_wav):
    port = free_port()
    srv = Cmd("serve", "scripted", "--port", str(port))
    try:
        srv.wait_health(port)
        cmd = Cmd("demo", "--url", f"ws://127.0.0.1:{port}", "--input", str(long_wav),
                  "--output", str(tmp_path / "out.wav"))
        try:
            cmd.wait_line("sending:")
            _stopped(cmd, *SIGS[name])
        finally:
            cmd.close()
        _stopped(srv, signal.SIGINT, 0)  # the server saw the client go and is still clean
    finally:
        srv.close()


@pytest.mark.parametrize("name", list(SIGS))
def test_chat_stopped_while_the_model_loads(name, tmp_path):
    cmd = Cmd("chat", "tiny", "-t", "hello", "--output", str(tmp_path / "out.wav"))
    try:
        cmd.wait_line("loading the tiny random-weight model")
        out = _stopped(cmd, *SIGS[name], bound_s=30)
    finally:
        cmd.close()
    assert "model ready" not in out, out


@pytest.mark.parametrize("name", list(SIGS))
def test_chat_stopped_while_it_answers(name, tmp_path):
    cmd = Cmd("chat", "tiny", "-t", "hello", "--max-tokens", "8192", "--output", str(tmp_path / "out.wav"))
    try:
        cmd.wait_line("model ready", bound_s=300)  # then generation starts
        _stopped(cmd, *SIGS[name], bound_s=30)
    finally:
        cmd.close()
    assert not (tmp_path / "out.wav").exists()


@pytest.mark.parametrize("name", list(SIGS))
def test_chat_against_a_server_stopped_while_it_waits_for_the_answer(name, tmp_path):
    port = free_port()
    # the answer never comes; SIGTERM: no drain (the request's slot would hold it for --drain-s)
    srv = Cmd("serve", "scripted", "--port", str(port), "--scripted", "unit_delay_s=600", "--drain-s", "0")
    try:
        srv.wait_health(port)
        cmd = Cmd("chat", "--url", f"http://127.0.0.1:{port}", "-t", "hello", "--output", str(tmp_path / "out.wav"))
        try:
            deadline = time.monotonic() + bound(60)  # the request holds a session slot while it runs
            while httpx.get(f"http://127.0.0.1:{port}/health", timeout=bound(10)).json()["sessions_active"] < 1:
                assert time.monotonic() < deadline and cmd.proc.poll() is None, cmd.text()
                time.sleep(0.05)
            _stopped(cmd, *SIGS[name])
        finally:
            cmd.close()
        _stopped(srv, SIGS[name][0], 0)  # the server, a generation in progress, stops as cleanly
    finally:
        srv.close()


@pytest.mark.parametrize("stream", [False, True])
def test_serve_stopped_during_a_chat_generation_answers_it(stream):
    """A chat request in progress when the server stops gets an answer (HTTP 503, or an error event
    on the stream) instead of holding the shutdown until uvicorn cancels it with a traceback."""
    import json

    port = free_port()
    srv = Cmd("serve", "scripted", "--port", str(port), "--scripted", "unit_delay_s=600")
    try:
        srv.wait_health(port)
        box: dict = {}

        def request() -> None:
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                              timeout=bound(120)) as r:
                box["status"] = r.status_code
                box["text"] = r.read().decode()

        t = threading.Thread(target=request, daemon=True)
        t.start()
        deadline = time.monotonic() + bound(60)
        while httpx.get(f"http://127.0.0.1:{port}/health", timeout=bound(10)).json()["sessions_active"] < 1:
            assert time.monotonic() < deadline, srv.text()
            time.sleep(0.05)
        _stopped(srv, signal.SIGINT, 0, bound_s=30)
        t.join(bound(30))
    finally:
        srv.close()
    if stream:
        assert box["status"] == 200 and "the server is shutting down" in box["text"], box
    else:
        assert box["status"] == 503, box
        assert "the server is shutting down" in json.loads(box["text"])["error"]["message"]


@pytest.mark.parametrize("name", list(SIGS))
def test_replay_stopped_while_it_reads(name, tmp_path):
    # a meta.json that is a FIFO nobody writes: the command blocks opening it until stopped
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "events.jsonl").write_text('{"type": "session.created", "t_ms": 0}\n')
    os.mkfifo(rec / "meta.json")
    cmd = Cmd("replay", str(rec))
    try:
        deadline = time.monotonic() + bound(60)
        while time.monotonic() < deadline and cmd.proc.poll() is None:
            try:
                if Path(f"/proc/{cmd.proc.pid}/wchan").read_text().strip() in ("wait_for_partner", "fifo_open"):
                    break
            except OSError:
                pass
            time.sleep(0.05)
        else:
            pytest.fail(f"replay never opened the FIFO:\n{cmd.text()}")
        _stopped(cmd, *SIGS[name])
    finally:
        cmd.close()


@pytest.mark.parametrize("name", list(SIGS))
def test_serve_stopped_in_its_first_second(name):
    """A signal while the CLI starts (its imports, the parser, ``serve``'s re-execution with the
    malloc allocator) ends it cleanly too: 130 / 143 before the command runs, 0 once ``serve`` runs."""
    sig, status = SIGS[name]
    for delay in (0.3, 0.45, 0.6, 0.8):  # after the interpreter itself has started
        cmd = Cmd("serve", "scripted", "--port", "0")
        try:
            time.sleep(delay)
            cmd.kill_group(sig)
            rc = cmd.finish()
            if rc == -sig and "duplexkit" not in cmd.text():
                continue  # a loaded machine: still in the interpreter's own start-up (docs/cli.md)
            assert rc in (0, status), f"{cmd.argv} after {delay} s: status {rc}:\n{cmd.text()}"
            cmd.assert_clean()
            assert "Panic" not in cmd.text(), cmd.text()
        finally:
            cmd.close()
