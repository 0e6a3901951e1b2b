"""``duplexkit demo --url`` with inputs longer than the server's pending-input cap, as real processes
over a real socket: the pace-0 default sends the first seconds at once and the rest in real time,
with progress lines, so nothing is dropped; when the server still cannot keep up (an engine slower
than real time), the demo stops with one clear error line and exit 1 instead of answering a turn the
model only heard part of."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from _serverproc import REPO, ServerProc
from _timing import bound

from duplexkit import cli
from duplexkit.audio import read_wav, write_wav

pytestmark = pytest.mark.e2e


def _long_wav(src, dst, seconds: float):
    a, _ = read_wav(str(src), 16_000)
    n = int(seconds * 16_000)
    write_wav(str(dst), np.tile(a, 1 + n // a.size)[:n], 16_000)
    return dst


def _demo(url: str, wav, *extra: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    return subprocess.run([sys.executable, "-m", "duplexkit", "demo", "--url", url, "--input", str(wav), "--output", "",
                           *extra], cwd=str(REPO), capture_output=True, text=True, timeout=timeout, env=env)


def test_long_input_is_paced_with_progress_and_answered(tmp_path, question_wav):
    wav = _long_wav(question_wav, tmp_path / "long.wav", 22.0)  # > 2 x 10 s: progress lines on
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=1",
                    "--max-pending-input-s", "6") as srv:
        r = _demo(srv.ws_url, wav, timeout=bound(180))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sending:    10 / 22 s of input" in r.stdout and "sending:    20 / 22 s of input" in r.stdout, r.stdout
    assert "status=completed" in r.stdout, r.stdout
    sent = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("send input (wall)")]
    assert sent and float(sent[0].split()[-2]) >= 22.0 - 4.0 - 0.5, r.stdout  # real time after the 4-s burst


def test_input_the_server_cannot_keep_up_with_fails_clearly(tmp_path, question_wav):
    wav = _long_wav(question_wav, tmp_path / "long.wav", 12.0)
    # an engine at a third of real time and a 3-s cap: the 4-s burst alone is over it
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "unit_delay_s=3.0",
                    "--max-pending-input-s", "3") as srv:
        r = _demo(srv.ws_url, wav, timeout=bound(180))
    assert r.returncode == cli.EXIT_FAILURE, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the server dropped input after about"), r.stderr
    assert "--max-pending-input-s" in lines[0] and "Traceback" not in r.stderr
    assert "response:" not in r.stdout  # no turn was committed on partial input
