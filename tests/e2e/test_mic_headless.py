"""``duplexkit mic`` run headless against a virtual audio device: a private PulseAudio server whose
"microphone" is the monitor of a null sink we play fixture WAVs into, and whose speaker is another
null sink. The mic command runs as a real subprocess connected to a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _serverproc import REPO, ServerProc

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


def run_mic(pulse, url, tmp_path: Path, plays: list[tuple[Path, float]], duration: float,
            extra: list[str] = ()) -> dict:
    summary = tmp_path / "summary.json"
    out_wav = tmp_path / "heard.wav"
    env = {**os.environ, **pulse.env, "PYTHONUNBUFFERED": "1"}
    target = ["--url", url] if url else []
    cmd = [sys.executable, "-m", "duplexkit.cli", "mic", *target, "--duration", str(duration),
           "--summary", str(summary), "--save-output", str(out_wav), *extra]
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    players = [pulse.play(wav, delay_s=delay) for wav, delay in plays]
    out, _ = proc.communicate(timeout=duration + 60)
    for p in players:
        p.wait(30)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    assert summary.exists(), text
    data = json.loads(summary.read_text())
    data["stdout"] = text
    data["heard_wav"] = out_wav
    return data


def test_mic_answers_a_spoken_question(pulse, tmp_path, question_wav):
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=2") as srv:
        data = run_mic(pulse, srv.ws_url, tmp_path, [(question_wav, 1.0)], duration=12)
    assert any("(completed)" in r for r in data["responses"]), data["stdout"]
    assert data["output_samples"] == 48000  # 2 units of the scripted answer reached the speaker queue
    assert "[you are speaking]" in data["stdout"]


def test_mic_barge_in_by_speaking(pulse, tmp_path, question_wav, interrupt_wav):
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=10") as srv:
        # the question ends at ~4.5 s; the answer starts ~1 s later; the user talks over it at 7.5 s
        data = run_mic(pulse, srv.ws_url, tmp_path, [(question_wav, 1.0), (interrupt_wav, 7.5)], duration=16)
    statuses = [r.split("(")[1].split(")")[0] for r in data["responses"]]
    assert statuses and statuses[0] == "cancelled", data["stdout"]
    assert data["barge_ins"] >= 1


def test_mic_inline_engine(pulse, tmp_path, question_wav):
    """``duplexkit mic MODEL`` without --url runs the engine in-process (here the ScriptedEngine)."""
    data = run_mic(pulse, None, tmp_path, [(question_wav, 1.0)], duration=12,
                   extra=["scripted", "--answer-policy", "on_request"])
    assert any("(completed)" in r for r in data["responses"]), data["stdout"]
    assert data["output_samples"] == 72000
