""":class:`duplexkit.engine.process.EngineProcess` closed from several threads at once: one reaper.

Two threads in ``multiprocessing.Process.join`` race in ``waitpid``: the loser sees the child as alive
after it exited, which printed "engine process N did not exit in 30 s: killing it" at once on every
clean shutdown where the server's reader thread (pipe EOF) and its close path joined together."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import pytest
from _timing import bound

from duplexkit.engine.process import EngineProcess, EngineSpec

pytestmark = pytest.mark.e2e


async def test_a_clean_close_while_other_threads_wait_logs_no_false_warning(caplog):
    eng = await asyncio.to_thread(EngineProcess(EngineSpec("duplexkit.engine.loading:load_engine", ("scripted",))).start)
    pid = eng.pid
    caplog.set_level(logging.WARNING, logger="duplexkit.engine.process")
    waiters = [threading.Thread(target=eng._wait_exit, args=(bound(30),)) for _ in range(4)]
    for w in waiters:  # more threads waiting on the same child as it exits
        w.start()
    t0 = time.monotonic()
    await eng.aclose()
    for w in waiters:
        w.join(bound(30))
    assert time.monotonic() - t0 < bound(30)
    assert eng.exitcode == 0
    assert not os.path.exists(f"/proc/{pid}")
    assert "did not exit" not in caplog.text, caplog.text


def test_close_while_loading_from_another_thread_is_not_a_load_failure(tmp_path):
    """The interpreter-exit path (or a server stopping) closes an engine whose start() another thread
    is still in: the child is killed and reaped once, start() reports a cancelled load."""
    from duplexkit.errors import EngineLoadError

    marker = tmp_path / "loading"
    proc = EngineProcess(EngineSpec("_engine_factories:slow_load", (str(marker), 120.0)))
    box: dict = {}

    def start() -> None:
        try:
            proc.start()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            box["error"] = exc

    t = threading.Thread(target=start)
    t.start()
    deadline = time.monotonic() + bound(60)
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc._close_sync(timeout_s=bound(10))
    t.join(bound(10))
    assert not t.is_alive()
    assert isinstance(box.get("error"), EngineLoadError) and "cancelled" in str(box["error"]), box
    assert not os.path.exists(f"/proc/{proc.pid}")
