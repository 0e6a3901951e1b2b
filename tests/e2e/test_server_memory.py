"""What keeps a real ``duplexkit serve`` process's memory bounded after load
(benchmarks/results/2026-12-01-server-load.md, "Server load"): the server runs with small objects on glibc's malloc (re-executed
with ``PYTHONMALLOC=malloc``, same pid), and sessions leave no per-session state behind in the one
registry that lives as long as the process: ``/metrics`` has the same series after 2 spoken sessions
as after 6, none labelled with a session id.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from duplexkit import memory
from duplexkit.audio import read_wav
from duplexkit.clients import DuplexClient

from _serverproc import ServerProc
from _timing import bound
from test_server_ops import scrape

pytestmark = pytest.mark.e2e


def _environ(pid: int) -> dict:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


async def _spoken_session(srv, speech) -> str:
    async with DuplexClient(srv.ws_url) as c:
        for i in range(0, len(speech), 3200):
            await c.send_audio(speech[i:i + 3200], rate=16_000)
        await c.commit()
        h = await c.create_response()
        final = await h.wait(bound(30))
        assert final.response.status == "completed"
        return c.session_id


async def _idle(srv) -> None:
    for _ in range(200):  # slots are released when the sockets end
        if httpx.get(srv.url + "/health", timeout=bound(10)).json()["sessions_active"] == 0:
            return
        await asyncio.sleep(0.05)


@pytest.mark.skipif(memory._libc is None, reason="the allocator switch applies on glibc only")
async def test_serve_runs_on_malloc_and_sessions_leave_no_series_behind(question_wav, monkeypatch):
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    speech = read_wav(question_wav, 16_000)[0]
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=3",
                    "--metrics", "public", "--log-level", "debug") as srv:  # the allocator lines are DEBUG
        # re-executed in place: the pid that was started, now with small objects on malloc
        assert _environ(srv.proc.pid).get("PYTHONMALLOC") == "malloc"
        # and glibc's mmap threshold fixed (mallopt accepted it: the line is logged only then), so that
        # large buffers do not spread the brk heap (tests/unit/test_memory_allocator.py shows the effect)
        assert f"glibc mmap threshold fixed at {memory.MMAP_THRESHOLD} bytes" in srv.output()
        # and numpy's arrays made without its small-block cache (same test file as the threshold's)
        assert f"numpy data handler {memory.NUMPY_HANDLER_NAME}" in srv.output()
        # and its engine process inherits it (on pymalloc it kept +11.9 % after 64 x 300 s: NOTES)
        children = [int(c) for t in Path(f"/proc/{srv.proc.pid}/task").iterdir()  # spawned by the loader thread
                    for c in (t / "children").read_text().split()]
        engines = [c for c in children if b"multiprocessing" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert engines and all(_environ(c).get("PYTHONMALLOC") == "malloc" for c in engines), children
        # the server runs without glibc's per-thread cache (its freed chunks pinned heap pages after
        # load); the engine process keeps it (the server's environment is restored for its children)
        assert memory.TCACHE_TUNABLE in _environ(srv.proc.pid).get("GLIBC_TUNABLES", "")
        assert all("tcache_count" not in _environ(c).get("GLIBC_TUNABLES", "") for c in engines)
        ids = [await _spoken_session(srv, speech) for _ in range(2)]
        await _idle(srv)
        after_two = set(scrape(srv.url))
        ids += await asyncio.gather(*(_spoken_session(srv, speech) for _ in range(4)))
        await _idle(srv)
        after_six = set(scrape(srv.url))
    assert len(set(ids)) == 6 and all(ids)
    assert after_six == after_two, after_six ^ after_two
    labels = {v for _, items in after_six for _, v in items}
    assert not any(sid in v for sid in ids for v in labels)


async def test_an_operator_choice_of_allocator_is_kept(monkeypatch):
    with ServerProc("scripted", "--log-level", "debug",
                    env={"PYTHONMALLOC": "pymalloc", "MALLOC_MMAP_THRESHOLD_": "131072"}) as srv:
        assert _environ(srv.proc.pid).get("PYTHONMALLOC") == "pymalloc"
        assert _environ(srv.proc.pid).get("MALLOC_MMAP_THRESHOLD_") == "131072"  # glibc applies it at start
        assert "glibc mmap threshold not set" in srv.output()  # and the server does not override it
