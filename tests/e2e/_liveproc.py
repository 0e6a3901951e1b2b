"""A subprocess whose output (stdout and stderr together) is read live by a thread, so a test can wait
for a line it prints instead of guessing how long a step takes on a busy machine. Shared by the CLI
tests that drive ``duplexkit`` commands (tests/e2e/test_interrupt.py, test_cli_server_lines.py,
test_mic_headless.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Iterable, Optional, Sequence

from _serverproc import REPO
from _timing import bound


def duplexkit_argv(*argv: str, module: str = "duplexkit") -> list:
    """``python -m duplexkit ARGV...`` with this interpreter."""
    return [sys.executable, "-m", module, *argv]


def command_env(env: Optional[dict] = None, drop: Iterable[str] = ("DUPLEXKIT_API_KEY",)) -> dict:
    """This process's environment, unbuffered and without TorchDynamo, plus ``env``, less ``drop``."""
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHDYNAMO_DISABLE": "1", **(env or {})}
    for k in drop:
        full.pop(k, None)
    return full


class LiveProc:
    """``cmd`` started in the repository root (in a session of its own with ``new_session``); its
    output lines collect in :attr:`lines` as they come. ``what`` names it in failure messages."""

    def __init__(self, cmd: Sequence[str], env: dict, *, new_session: bool = False, what: str = "") -> None:
        self.what = what or " ".join(cmd[3:4])
        self.proc = subprocess.Popen(list(cmd), cwd=str(REPO), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=new_session)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            with self._cond:
                self.lines.append(raw.decode(errors="replace"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def text(self) -> str:
        with self._cond:
            return "".join(self.lines)

    def wait_line(self, needle: str, bound_s: float = 120) -> None:
        """Until a line containing ``needle`` is printed (fails when the command ends first or after
        ``bound_s``, scaled by ``DUPLEXKIT_TEST_TIME_SCALE``)."""
        with self._cond:
            self._cond.wait_for(lambda: any(needle in ln for ln in self.lines) or self.proc.poll() is not None,
                                timeout=bound(bound_s))
        assert any(needle in ln for ln in self.lines), f"{self.what} never printed {needle!r}:\n{self.text()}"

    def join_reader(self, bound_s: float) -> None:
        self._reader.join(bound(bound_s))
