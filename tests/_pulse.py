"""A private, headless PulseAudio server for tests that need (virtual) audio devices.

:func:`pulse_server` starts ``pulseaudio`` in a temporary runtime directory with null sinks:

* ``<prefix>_speaker``: the default sink (what a program "plays" ends here, discarded);
* ``<prefix>_mic``: a sink whose monitor is the default source, so anything played into it with
  :meth:`PulseServer.play` (``paplay``) is what a program's microphone captures.

PortAudio reaches it through ALSA's ``pulse`` PCM (Debian: pulseaudio, pulseaudio-utils,
libasound2-plugins, libportaudio2). :attr:`PulseServer.env` holds ``PULSE_SERVER`` /
``PULSE_SINK`` / ``PULSE_SOURCE`` for subprocesses. Shared by tests/e2e (``duplexkit mic``); the
device tests in tests/device have a similar fixture of their own.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from _timing import bound


class PulseUnavailable(RuntimeError):
    """pulseaudio or paplay is missing, or the server did not start."""


class PulseServer:
    def __init__(self, run_dir: Path, proc: subprocess.Popen, prefix: str) -> None:
        self.run_dir = run_dir
        self.proc = proc
        self.socket = run_dir / "native"
        self.speaker = f"{prefix}_speaker"
        self.mic_sink = f"{prefix}_mic"
        self.source = f"{prefix}_mic.monitor"
        self.env = {"PULSE_SERVER": f"unix:{self.socket}", "PULSE_SINK": self.speaker,
                    "PULSE_SOURCE": self.source, "XDG_RUNTIME_DIR": str(run_dir)}

    def play(self, wav: Path, *, delay_s: float = 0.0) -> subprocess.Popen:
        """Play ``wav`` into the microphone sink (non-blocking; returns the ``paplay`` process)."""
        paplay = shutil.which("paplay")
        if paplay is None:
            raise PulseUnavailable("paplay is not installed (Debian: pulseaudio-utils)")
        cmd = [paplay, f"--device={self.mic_sink}", str(wav)]
        if delay_s:
            cmd = ["sh", "-c", f"sleep {delay_s} && exec \"$@\"", "sh", *cmd]
        return subprocess.Popen(cmd, env={**os.environ, **self.env}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)

    def log(self) -> str:
        p = self.run_dir / "log"
        return p.read_text(errors="replace") if p.exists() else ""


@contextmanager
def pulse_server(prefix: str = "dk", rate: int = 48000, timeout_s: float = 60.0) -> Iterator[PulseServer]:
    """Start a private PulseAudio server (see the module docstring); stopped on exit.

    Raises :class:`PulseUnavailable` when pulseaudio is missing or does not come up within
    ``timeout_s`` (a bound, scaled by ``DUPLEXKIT_TEST_TIME_SCALE``).
    """
    timeout_s = bound(timeout_s)
    exe = shutil.which("pulseaudio")
    if exe is None:
        raise PulseUnavailable("pulseaudio is not installed (Debian: apt-get install pulseaudio)")
    run_dir = Path(tempfile.mkdtemp(prefix="duplexkit-pulse-"))
    sock = run_dir / "native"
    env = dict(os.environ, XDG_RUNTIME_DIR=str(run_dir), HOME=str(run_dir), PULSE_RUNTIME_PATH=str(run_dir))
    env.pop("PULSE_SERVER", None)
    cmd = [exe, "--daemonize=no", "-n", "--exit-idle-time=-1", "--disallow-exit", "--system=no",
           "--use-pid-file=no", "--log-target=file:" + str(run_dir / "log"),
           f"--load=module-native-protocol-unix socket={sock} auth-anonymous=1",
           f"--load=module-null-sink sink_name={prefix}_speaker rate={rate}",
           f"--load=module-null-sink sink_name={prefix}_mic rate={rate}",
           "--load=module-always-sink"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    server: Optional[PulseServer] = None
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not sock.exists():
            if proc.poll() is not None:
                raise PulseUnavailable(f"pulseaudio exited with {proc.returncode}: "
                                       f"{proc.stderr.read().decode(errors='replace')}")
            time.sleep(0.05)
        if not sock.exists():
            raise PulseUnavailable(f"pulseaudio did not create its socket within {timeout_s} s")
        server = PulseServer(run_dir, proc, prefix)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(bound(30))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(run_dir, ignore_errors=True)
