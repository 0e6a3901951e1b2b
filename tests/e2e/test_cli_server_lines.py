"""What the CLI tells a user about the server, each run as real processes over real sockets:

* ``demo --url`` and ``mic --url`` when the server shuts down mid-session: one ``error:`` line with
  the close code, the ``session.closed`` reason and the next step, status 3, and no "what next" or
  "nothing heard" hint that no longer fits (docs/cli.md, "When the server ends the session");
* ``mic --save-output`` when the assistant said nothing: an empty, valid WAV and a line saying so;
* ``serve --record DIR``: one summary line at exit with the ``duplexkit replay`` command;
* ``serve``'s first lines: no allocator set-up line unless ``--log-level debug``.

Every wait is for an event (a line printed, ``/health``) under a bound for a loaded 2-core machine
(tests/_timing.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
import soundfile as sf
from _liveproc import LiveProc, command_env, duplexkit_argv
from _serverproc import REPO, ServerProc
from _timing import bound

pytestmark = pytest.mark.e2e

SHUTDOWN_LINE = ("error: the server closed the connection (close code 1001, session.closed reason 'shutdown'): "
                 "the server is shutting down; start it again")


class Run(LiveProc):
    """A ``duplexkit`` client command whose output (stdout and stderr) is read live."""

    def __init__(self, *argv: str, env: dict | None = None) -> None:
        super().__init__(duplexkit_argv(*argv), command_env(env), what="the command")

    def finish(self, bound_s: float = 60) -> int:
        rc = self.proc.wait(bound(bound_s))
        self.join_reader(10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _wait_session(srv: ServerProc, answering: bool, bound_s: float = 60) -> None:
    """Until the client's session is open; with ``answering`` until its answer has begun (the first
    audio sent: ``duplexkit_ttfp_seconds_count`` in ``/metrics``), so the client sends nothing more."""
    deadline = time.monotonic() + bound(bound_s)
    while True:
        if answering:
            m = re.search(r"^duplexkit_ttfp_seconds_count\S* (\S+)$",
                          httpx.get(srv.url + "/metrics", timeout=bound(10)).text, re.M)
            if m and float(m.group(1)) >= 1:
                return
        elif httpx.get(srv.url + "/health", timeout=bound(10)).json()["sessions_active"] >= 1:
            return
        assert time.monotonic() < deadline, f"the client's session never got there:\n{srv.output()[-3000:]}"
        time.sleep(0.05)


@pytest.mark.parametrize("pace", ["0", "0.2"], ids=["during-the-answer", "while-sending"])
def test_demo_says_the_server_shut_down(pace, tmp_path, question_wav):
    """The server stops (Ctrl+C) while the demo's session is open: with ``--pace 0.2`` while the
    3.5-s question is still being sent, with ``--pace 0`` once the 20-s answer has begun."""
    srv = ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=40",
                     "--scripted", "unit_delay_s=0.5")
    run = None
    try:
        run = Run("demo", "--url", srv.ws_url, "--input", str(question_wav), "--pace", pace,
                  "--output", str(tmp_path / "out.wav"))
        _wait_session(srv, answering=pace == "0")
        assert srv.stop() == 0, srv.output()
        rc = run.finish()
        out = run.text()
    finally:
        if run is not None:
            run.kill()
        srv.__exit__(None, None, None)
    assert rc == 3, out
    # with appends still in flight too: the server waits for the client's close frame before it closes
    # the connection, so the client reads session.closed and 1001, not a reset connection (1006)
    assert SHUTDOWN_LINE in out, out
    assert "what next" not in out and "already running at" not in out, out  # the server is not running
    assert "Traceback" not in out, out


@pytest.mark.device
def test_mic_says_the_server_shut_down_and_saves_an_empty_wav(tmp_path):
    """``mic --url`` with nothing said to it: the server stops while the session is ready. The
    conversation's files are still written (an empty WAV: the assistant said nothing), the line
    says why it ended, status 3, and no "check the input device" hint (the device was not the
    problem)."""
    sys.path.insert(0, str(REPO / "tests"))
    from _pulse import PulseUnavailable, pulse_server

    wav, summary = tmp_path / "said.wav", tmp_path / "summary.json"
    try:
        with pulse_server(prefix="dkend") as pulse:
            srv = ServerProc("scripted", "--answer-policy", "on_request")
            run = None
            try:
                run = Run("mic", "--url", srv.ws_url, "--duration", "3600", "--save-output", str(wav),
                          "--summary", str(summary), env=pulse.env)
                run.wait_line("ready; speak")
                assert srv.stop() == 0, srv.output()
                rc = run.finish()
                out = run.text()
            finally:
                if run is not None:
                    run.kill()
                srv.__exit__(None, None, None)
    except PulseUnavailable as exc:
        pytest.fail(f"virtual audio device unavailable: {exc}")
    assert rc == 3, out
    assert SHUTDOWN_LINE in out, out
    assert "nothing heard" not in out, out
    assert f"mic: no assistant audio: wrote an empty WAV (0 s, 24 kHz) to {wav}" in out, out
    info = sf.info(str(wav))
    assert (info.frames, info.samplerate) == (0, 24000)
    assert summary.exists(), out


def test_serve_record_prints_a_summary_at_exit(tmp_path, question_wav):
    rec = tmp_path / "rec"
    with ServerProc("scripted", "--answer-policy", "on_request", "--record", str(rec)) as srv:
        for _ in range(2):
            r = subprocess.run([sys.executable, "-m", "duplexkit", "demo", "--url", srv.ws_url, "--input",
                                str(question_wav), "--output", str(tmp_path / "out.wav")],
                               cwd=str(REPO), capture_output=True, text=True, timeout=bound(120))
            assert r.returncode == 0, r.stdout + r.stderr
        assert srv.stop() == 0
        out = srv.output()
    lines = [ln for ln in out.splitlines() if ln.startswith("recordings:")]
    assert len(lines) == 1, out
    m = re.fullmatch(r"recordings: 2 session\(s\) recorded into (\S+) this run \(([\d.]+) (B|kB|MB)\); "
                     r"open them with: (\S*duplexkit) replay (\S+)", lines[0])
    assert m, lines[0]
    assert m.group(1) == m.group(5) == str(rec)
    written = sum(p.stat().st_size for p in rec.rglob("*") if p.is_file())
    shown = float(m.group(2)) * {"B": 1, "kB": 1e3, "MB": 1e6}[m.group(3)]
    assert abs(shown - written) <= 0.06 * written, (lines[0], written)
    # the command it names opens them
    r = subprocess.run([sys.executable, "-m", "duplexkit", "replay", m.group(5)], cwd=str(REPO),
                       capture_output=True, text=True, timeout=bound(120))
    assert r.returncode == 0 and len(r.stdout.split()) == 2, r.stdout + r.stderr


def test_serve_record_with_no_session_says_so(tmp_path):
    with ServerProc("scripted", "--record", str(tmp_path / "rec")) as srv:
        assert srv.stop() == 0
        out = srv.output()
    assert f"recordings: no session was recorded into {tmp_path / 'rec'} this run" in out, out
    assert "replay" not in out, out


@pytest.mark.parametrize("level", ["info", "debug"])
def test_serve_start_has_no_allocator_line_unless_debug(level):
    """The memory set-up (``duplexkit/memory.py``) is a detail for ``--log-level debug``."""
    with ServerProc("scripted", "--log-level", level) as srv:
        out = srv.output()
    head = out.split("duplexkit serving", 1)[0]
    if level == "info":
        assert "allocator" not in out, head
    else:
        assert "DEBUG duplexkit.memory: allocator: PYTHONMALLOC=" in head, head
