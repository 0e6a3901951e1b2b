"""Start ``duplexkit serve`` as a real subprocess on a free loopback port and wait for ``/health``."""

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

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """A ``duplexkit serve`` subprocess. ``url`` is ``http://127.0.0.1:<port>``, ``ws_url`` the ws one."""

    def __init__(self, model: str, *args: str, env: Optional[dict] = None, ready_timeout_s: float = 60.0) -> None:
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
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
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

    def output(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
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
