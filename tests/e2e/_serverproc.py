"""Start ``duplexkit serve`` as a real subprocess on a free loopback port and wait for ``/health``.

Bounds (``ready_timeout_s``, ``stop``'s ``timeout``) are for a loaded 2-core machine and are
multiplied by ``DUPLEXKIT_TEST_TIME_SCALE`` (tests/_timing.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx
from _timing import bound

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """A ``duplexkit serve`` subprocess. ``url`` is ``http://127.0.0.1:<port>``, ``ws_url`` the ws one."""

    def __init__(self, model: str, *args: str, env: Optional[dict] = None, ready_timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="duplexkit-serve-", suffix=".log", delete=False)
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHDYNAMO_DISABLE="1")
        full_env.pop("DUPLEXKIT_API_KEY", None)
        full_env.update(env or {})
        cmd = [sys.executable, "-m", "duplexkit.cli", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "info", *args]
        self.proc = subprocess.Popen(cmd, cwd=str(REPO), env=full_env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(bound(ready_timeout_s))

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = httpx.get(self.url + "/health", timeout=bound(10))
                last = r.status_code
                if r.status_code == 200:
                    return
                if r.json().get("status") == "error":
                    raise RuntimeError(f"engine failed to load:\n{self.output()}")
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s (last /health {last}):\n{self.output()}")

    def wait_idle(self, bound_s: float = 60.0) -> None:
        """Wait until ``/health`` reports no active session. A session the server closes
        (``session.close``, idle timeout, shutdown) has given its slot back before its close frame is
        sent; one the client closes frees it a moment later, when the server notices (later still on
        a busy machine; the per-client cap counts it till then); one whose connection dropped without
        a close handshake is parked and keeps its slot for ``--resume-window-s`` (docs/server.md,
        "Limits and close codes")."""
        for _ in range(int(bound(bound_s) / 0.05)):
            if httpx.get(self.url + "/health", timeout=bound(10)).json()["sessions_active"] == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"sessions still active after {bound(bound_s):.0f} s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(bound(timeout))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> "ServerProc":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
