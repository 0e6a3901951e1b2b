"""A model load stopped by Ctrl+C stops even when the first interrupt is swallowed.

The in-process load (``serve --no-engine-process``, ``demo``, ``mic``, ``chat``) runs in a thread
that is stopped by an asynchronous KeyboardInterrupt (``duplexkit.cli.common.interrupt_thread``).
Python drops such an exception where it lands in a ``__del__`` or a weakref callback (seen: in the
tokenizer's regex objects, after which the load ran to its end), so the interrupt is repeated
while the thread is still inside the load. Real threads; the "load" is a stand-in for
``duplexkit.engine.loading.load_engine`` that swallows the first interrupt and would then go on
for 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import pytest

from _timing import bound

LOAD_S = 30.0


def _swallowing_load(started: threading.Event, finished: threading.Event):
    def load(model, **kwargs):
        started.set()
        try:
            while True:  # short sleeps: an asynchronous exception is raised between them
                time.sleep(0.01)
        except KeyboardInterrupt:
            pass  # as a __del__ or a callback would drop it
        t_end = time.monotonic() + LOAD_S
        while time.monotonic() < t_end:  # the rest of the load
            time.sleep(0.01)
        finished.set()
        return object()

    return load


@pytest.fixture
def slow_load(monkeypatch):
    started, finished = threading.Event(), threading.Event()
    monkeypatch.setattr("duplexkit.engine.loading.load_engine", _swallowing_load(started, finished))
    return started, finished


def test_serve_loader_cancel_stops_a_load_that_swallows_an_interrupt(slow_load):
    from duplexkit.cli.serve import _Loader

    started, finished = slow_load
    args = argparse.Namespace(engine_process=False, model="tiny", layout=None, dtype=None, weights_seed=0)
    loader = _Loader(args, {})
    box: dict = {}

    def run() -> None:
        try:
            box["engine"] = loader()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(bound(30))
    t0 = time.monotonic()
    loader.cancel()
    t.join(bound(5))
    assert not t.is_alive(), "the load went on after cancel()"
    assert time.monotonic() - t0 < bound(5)
    assert isinstance(box.get("error"), KeyboardInterrupt) and not finished.is_set(), box


def test_load_engine_async_cancel_stops_a_load_that_swallows_an_interrupt(slow_load):
    from duplexkit.cli.common import load_engine_async

    started, finished = slow_load

    async def main() -> float:
        task = asyncio.ensure_future(load_engine_async("tiny"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, bound(5))
        return time.monotonic() - t0

    assert asyncio.run(main()) < bound(5)
    assert not finished.is_set()
    assert not any(t.name == "duplexkit-engine-loader" for t in threading.enumerate())


def test_no_interrupt_reaches_the_thread_after_the_load_returned(monkeypatch):
    """The repeated interrupt only lands inside the load: a thread that has returned from it and
    goes on with other work is left alone."""
    from duplexkit.cli import common

    lock = threading.Lock()
    state = {"thread": None}
    hits: list = []

    def after_the_load() -> None:
        t_end = time.monotonic() + 1.0
        try:
            while time.monotonic() < t_end:
                time.sleep(0.01)
        except KeyboardInterrupt as exc:
            hits.append(exc)

    t = threading.Thread(target=after_the_load, daemon=True)
    state["thread"] = t
    t.start()
    # still "loading" by the flag, but not running the load's code: no interrupt
    common.interrupt_until_stopped(lambda: state["thread"], lock, common.load_engine.__code__)
    t.join(bound(10))
    assert not hits
