"""``duplexkit mic`` (headless, on a private PulseAudio server's virtual devices) stopped by Ctrl+C
(SIGINT) or SIGTERM: while it loads the model, 130 / 143; once its session is ready, 0 with its
``--summary`` written (docs/cli.md, "Exit status"). The harness: tests/e2e/test_interrupt.py."""

from __future__ import annotations

import json
import sys

import pytest
from _serverproc import REPO
from test_interrupt import SIGS, Cmd, _stopped

sys.path.insert(0, str(REPO / "tests"))
from _pulse import PulseUnavailable, pulse_server  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.device]


@pytest.fixture(scope="module")
def pulse():
    try:
        with pulse_server(prefix="dkint") as srv:
            yield srv
    except PulseUnavailable as exc:
        pytest.fail(f"virtual audio device unavailable: {exc}")


@pytest.mark.parametrize("name", list(SIGS))
def test_mic_stopped_while_the_model_loads(name, pulse, tmp_path):
    cmd = Cmd("mic", "tiny", "--summary", str(tmp_path / "summary.json"), env=pulse.env)
    try:
        cmd.wait_line("loading the tiny random-weight model")
        out = _stopped(cmd, *SIGS[name], bound_s=30)
    finally:
        cmd.close()
    assert "ready; speak" not in out and "model ready" not in out, out
    assert not (tmp_path / "summary.json").exists()  # no session was ready


@pytest.mark.parametrize("name", list(SIGS))
def test_mic_stopped_once_ready_ends_the_conversation(name, pulse, tmp_path):
    cmd = Cmd("mic", "scripted", "--summary", str(tmp_path / "summary.json"), env=pulse.env)
    try:
        cmd.wait_line("ready; speak")
        out = _stopped(cmd, SIGS[name][0], 0)
    finally:
        cmd.close()
    assert "mic: heard speech" in out, out
    assert "responses" in json.loads((tmp_path / "summary.json").read_text())
