"""``duplexkit mic`` run headless against a virtual audio device: a private PulseAudio server whose
"microphone" is the monitor of a null sink we play fixture WAVs into, and whose speaker is another
null sink. The mic command runs as a real subprocess connected to a real server.

Robust on a loaded machine: nothing is scheduled by wall-clock guesses. Each step waits for an event
(the command printing "ready", its recording stream existing, the answer's audio reaching the
virtual speaker, the answer's status line) with generous bounds (tests/_timing.py), and a run is
ended by Ctrl+C (SIGINT) once the event it is about has been seen; ``--duration`` is a cap that a
passing run never reaches, and its own test ends a run in which nothing happens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import pytest
from _liveproc import LiveProc
from _serverproc import REPO, ServerProc
from _timing import bound

sys.path.insert(0, str(REPO / "tests"))
from _pulse import PulseUnavailable, pulse_server  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.device]


@pytest.fixture(scope="module")
def pulse():
    try:
        with pulse_server(prefix="dkmic") as srv:
            yield srv
    except PulseUnavailable as exc:
        pytest.fail(f"virtual audio device unavailable: {exc}")


class MicRun:
    """A ``duplexkit mic`` subprocess whose output is read live, so a test can wait for what it
    prints instead of guessing how long start-up takes on a busy machine.

    ``duration`` is only a cap for the whole run (``--duration``); a test ends the run with
    :meth:`stop_after` once what it waits for has happened, every step waiting on an event with a
    generous bound.
    """

    def __init__(self, pulse, url, tmp_path: Path, duration: float = 3600, extra: list[str] = ()) -> None:
        self.pulse = pulse
        self.summary = tmp_path / "summary.json"
        self.out_wav = tmp_path / "heard.wav"
        self.duration = duration
        env = {**os.environ, **pulse.env, "PYTHONUNBUFFERED": "1"}
        target = ["--url", url] if url else []
        cmd = [sys.executable, "-m", "duplexkit.cli", "mic", *target, "--duration", str(duration),
               "--summary", str(self.summary), "--save-output", str(self.out_wav), *extra]
        self._live = LiveProc(cmd, env, what="mic")
        self.proc = self._live.proc
        self.players: list[subprocess.Popen] = []

    def text(self) -> str:
        return self._live.text()

    def wait_line(self, needle: str, bound_s: float) -> None:
        """Wait until the command prints a line containing ``needle`` (fails after ``bound_s``,
        scaled by ``DUPLEXKIT_TEST_TIME_SCALE``)."""
        self._live.wait_line(needle, bound_s)

    def wait_capturing(self, bound_s: float) -> None:
        """Wait until the command's microphone stream records from the virtual mic (a pulse
        source-output exists), so nothing played into the mic is lost to a slow device start."""
        env = {**os.environ, **self.pulse.env}
        for _ in range(int(bound(bound_s) / 0.1)):
            r = subprocess.run(["pactl", "list", "short", "source-outputs"], env=env, capture_output=True, text=True)
            if r.stdout.strip():
                return
            assert self.proc.poll() is None, self.text()
            time.sleep(0.1)
        pytest.fail(f"the mic stream never started recording:\n{self.text()}")

    def play(self, wav: Path) -> None:
        self.players.append(self.pulse.play(wav))

    def stop_after(self, needle: str, bound_s: float) -> dict:
        """Wait for a line containing ``needle``, then press Ctrl+C (SIGINT): the command ends the
        conversation normally and writes its summary; returns :meth:`finish`'s result."""
        import signal

        self.wait_line(needle, bound_s)
        self.proc.send_signal(signal.SIGINT)
        return self.finish()

    def finish(self) -> dict:
        """Wait for the command to end (at the latest ``--duration`` after "ready"); its status 0
        and the summary it wrote (with ``stdout`` and ``heard_wav`` added)."""
        self.proc.wait(self.duration + bound(120))
        self._live.join_reader(30)
        for p in self.players:
            p.wait(bound(60))
        text = self.text()
        assert self.proc.returncode == 0, text
        assert self.summary.exists(), text
        data = json.loads(self.summary.read_text())
        data["stdout"] = text
        data["heard_wav"] = self.out_wav
        return data

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(bound(30))
        for p in self.players:
            if p.poll() is None:
                p.kill()


class SpeakerMonitor:
    """Records the virtual speaker's monitor (``parec``) and reports when the assistant's audio
    is actually playing: at least ``min_ms`` of consecutive 50 ms blocks above ``rms`` (the
    scripted answer is a 0.2-amplitude sine, RMS ~0.14; silence is 0)."""

    RATE = 16000

    def __init__(self, pulse, rms: float = 0.05, min_ms: int = 200) -> None:
        self.proc = subprocess.Popen(
            ["parec", f"--device={pulse.speaker}.monitor", "--raw", "--format=s16le", f"--rate={self.RATE}",
             "--channels=1", "--latency-msec=50"],
            env={**os.environ, **pulse.env}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.playing = threading.Event()
        self._need = max(1, min_ms // 50)
        self._rms = rms
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        block = self.RATE // 20 * 2  # 50 ms of s16le
        run = 0
        while True:
            buf = self.proc.stdout.read(block)
            if not buf or len(buf) < block:
                return
            x = np.frombuffer(buf, dtype="<i2").astype(np.float32) / 32768.0
            run = run + 1 if float(np.sqrt(np.mean(x * x))) > self._rms else 0
            if run >= self._need:
                self.playing.set()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _answer_after_question(pulse, url, tmp_path, question_wav, extra=()) -> dict:
    """Start ``mic``; once it is ready and recording, play the question; once the answer is
    complete, Ctrl+C; collect the summary."""
    run = MicRun(pulse, url, tmp_path, extra=list(extra))
    try:
        run.wait_line("ready", bound_s=120)
        run.wait_capturing(bound_s=60)
        run.play(question_wav)
        return run.stop_after("(completed)", bound_s=120)
    finally:
        run.kill()


def test_mic_answers_a_spoken_question(pulse, tmp_path, question_wav):
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=2") as srv:
        data = _answer_after_question(pulse, srv.ws_url, tmp_path, question_wav)
    assert any("(completed)" in r for r in data["responses"]), data["stdout"]
    assert data["output_samples"] == 48000  # 2 units of the scripted answer reached the speaker queue
    assert "[you are speaking]" in data["stdout"]


def test_mic_barge_in_by_speaking(pulse, tmp_path, question_wav, interrupt_wav):
    """The user talks over the answer: the interruption is played only once the answer is heard
    on the virtual speaker (an event, not a time guess), so a slow machine cannot make it land
    before the answer started."""
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=10") as srv:
        run = MicRun(pulse, srv.ws_url, tmp_path)
        monitor = SpeakerMonitor(pulse)
        try:
            run.wait_line("ready", bound_s=120)
            run.wait_capturing(bound_s=60)
            run.play(question_wav)
            # the question lasts ~3.5 s and the 10-unit answer ~10 s: wait for the answer's audio
            assert monitor.playing.wait(bound(60)), f"the answer was never heard on the speaker:\n{run.text()}"
            run.play(interrupt_wav)
            data = run.stop_after("(cancelled)", bound_s=120)
        finally:
            monitor.close()
            run.kill()
    statuses = [r.split("(")[1].split(")")[0] for r in data["responses"]]
    assert statuses and statuses[0] == "cancelled", data["stdout"]
    assert data["barge_ins"] >= 1


def test_mic_inline_engine(pulse, tmp_path, question_wav):
    """``duplexkit mic MODEL`` without --url runs the engine in-process (here the ScriptedEngine)."""
    data = _answer_after_question(pulse, None, tmp_path, question_wav,
                                  extra=["scripted", "--answer-policy", "on_request"])
    assert any("(completed)" in r for r in data["responses"]), data["stdout"]
    assert data["output_samples"] == 72000


def test_mic_ctrl_c_writes_the_summary(pulse, tmp_path, question_wav):
    """Ctrl+C (SIGINT) ends the conversation normally: status 0, --summary and --save-output written,
    a closing line. The test stops the command on an event (the answer done), not after --duration."""
    import signal

    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=2") as srv:
        run = MicRun(pulse, srv.ws_url, tmp_path)
        try:
            run.wait_line("ready", bound_s=120)
            run.wait_capturing(bound_s=60)
            run.play(question_wav)
            run.wait_line("(completed)", bound_s=120)
            run.proc.send_signal(signal.SIGINT)
            run.proc.wait(bound(60))
            run._live.join_reader(30)
        finally:
            run.kill()
    text = run.text()
    assert run.proc.returncode == 0, text
    data = json.loads(run.summary.read_text())
    assert any("(completed)" in r for r in data["responses"]) and data["speech_started"] >= 1, data
    assert data["output_samples"] == 48000 and run.out_wav.exists()
    assert "mic: heard speech" in text and "Traceback" not in text


def test_mic_duration_ends_the_run(pulse, tmp_path):
    """``--duration`` ends a conversation on its own, counted from "ready": status 0, the summary
    written, nothing heard (no sound is played into the virtual mic)."""
    with ServerProc("scripted", "--answer-policy", "on_request") as srv:
        run = MicRun(pulse, srv.ws_url, tmp_path, duration=2)
        try:
            run.wait_line("ready", bound_s=120)
            data = run.finish()
        finally:
            run.kill()
    assert data["responses"] == [] and data["speech_started"] == 0 and data["output_samples"] == 0, data
    assert "mic: heard speech 0 time(s), 0 response(s)" in data["stdout"]
