"""A private, headless PulseAudio server for the device tests.

The fixture starts ``pulseaudio`` with a null sink (whose monitor is the default source) in a
temporary XDG_RUNTIME_DIR and points PortAudio at it through ALSA's ``pulse`` PCM (Debian packages:
pulseaudio, libasound2-plugins, libportaudio2). If the server cannot start, the tests FAIL (they
are marked ``device``; deselect them with ``-m "not device"``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from _timing import bound

SINK = "duplexkit_null"


@pytest.fixture(scope="session")
def pulse_server():
    exe = shutil.which("pulseaudio")
    if exe is None:
        pytest.fail("pulseaudio is not installed (Debian: apt-get install pulseaudio libasound2-plugins)")
    run_dir = Path(tempfile.mkdtemp(prefix="duplexkit-pulse-"))
    sock = run_dir / "native"
    env = dict(os.environ, XDG_RUNTIME_DIR=str(run_dir), HOME=str(run_dir), PULSE_RUNTIME_PATH=str(run_dir))
    env.pop("PULSE_SERVER", None)
    cmd = [
        exe, "--daemonize=no", "-n", "--exit-idle-time=-1", "--disallow-exit", "--system=no",
        "--use-pid-file=no", "--log-target=file:" + str(run_dir / "log"),
        f"--load=module-native-protocol-unix socket={sock} auth-anonymous=1",
        f"--load=module-null-sink sink_name={SINK} rate=48000",
        "--load=module-always-sink",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    start_bound = bound(60)  # pulseaudio starts in well under a second on an idle machine
    deadline = time.monotonic() + start_bound
    while time.monotonic() < deadline and not sock.exists():
        if proc.poll() is not None:
            log = (run_dir / "log").read_text(errors="replace") if (run_dir / "log").exists() else ""
            pytest.fail(f"pulseaudio exited with {proc.returncode}: {proc.stderr.read().decode(errors='replace')}\n{log}")
        time.sleep(0.05)
    if not sock.exists():
        proc.kill()
        pytest.fail(f"pulseaudio did not create its socket within {start_bound:.0f} s")
    saved = {k: os.environ.get(k) for k in ("PULSE_SERVER", "PULSE_SINK", "PULSE_SOURCE")}
    os.environ["PULSE_SERVER"] = f"unix:{sock}"
    os.environ["PULSE_SINK"] = SINK
    os.environ["PULSE_SOURCE"] = f"{SINK}.monitor"
    from duplexkit.audio.devices import rescan_devices

    rescan_devices()  # PortAudio must see the ALSA "pulse" device now that the server runs
    try:
        yield {"socket": str(sock), "sink": SINK, "source": f"{SINK}.monitor", "pid": proc.pid}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(bound(30))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(run_dir, ignore_errors=True)
