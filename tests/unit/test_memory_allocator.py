"""The server's small-object allocator: ``duplexkit.memory.use_malloc_for_objects``.

Why it exists (benchmarks/results/2026-12-01-server-load.md, "Server load"): after a burst of sessions a few surviving objects
are scattered over the 1 MiB arenas of CPython's pymalloc that the burst filled; an arena is given back
only when empty, so RSS stays up although the objects are gone. On glibc's malloc the same free
memory is given back page by page by ``malloc_trim``. The pattern is reproduced here in a child
process (RSS is per process): many small objects, one in 512 kept, the rest freed, collect, trim.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from duplexkit import memory

glibc = pytest.mark.skipif(memory._libc is None, reason="malloc_trim is glibc-only")

# ~150 MB of 100-byte objects (all under pymalloc's 512-byte limit); every 512th survives
_BURST = textwrap.dedent("""
    import gc, json, os, sys
    from duplexkit.memory import malloc_trim

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    gc.collect(); malloc_trim()
    before = rss()
    burst = [os.urandom(1) * 100 for _ in range(1_500_000)]
    peak = rss()
    survivors = burst[::512]
    del burst
    gc.collect(); malloc_trim()
    after = rss()
    print(json.dumps({"allocator": os.environ.get("PYTHONMALLOC", "pymalloc"), "grown": peak - before,
                      "kept": after - before, "survivors": len(survivors)}))
""")


def _burst(allocator: str) -> dict:
    import json

    env = dict(os.environ, PYTHONMALLOC=allocator)
    out = subprocess.run([sys.executable, "-c", _BURST], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@glibc
def test_malloc_gives_back_a_burst_that_pymalloc_keeps_for_a_few_survivors():
    py, gl = _burst("pymalloc"), _burst("malloc")
    for r in (py, gl):
        assert r["grown"] > 100 * 2**20, r  # the burst really was allocated
        assert r["survivors"] == 2930
    # pymalloc: every arena holds a survivor, so (nearly) all of the burst stays resident
    assert py["kept"] > 0.7 * py["grown"], py
    # malloc + malloc_trim: the pages without a survivor go back (survivors: ~0.3 MB)
    assert gl["kept"] < 0.25 * gl["grown"], gl


def test_re_executes_with_malloc_when_unset(monkeypatch):
    monkeypatch.setattr(memory, "_libc", object())
    calls = []
    env = {"PATH": "/usr/bin", "PYTHONPATH": "x"}
    assert memory.use_malloc_for_objects(env, execve=lambda *a: calls.append(a)) is True
    (exe, argv, new_env), = calls
    assert exe == sys.executable and argv == list(sys.orig_argv)
    assert new_env == {"PATH": "/usr/bin", "PYTHONPATH": "x", "PYTHONMALLOC": "malloc",
                       "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0", "DUPLEXKIT_OPERATOR_GLIBC_TUNABLES": ""}
    assert "PYTHONMALLOC" not in env  # the caller's mapping is not changed


def _re_exec_env(monkeypatch, env: dict) -> dict:
    """The environment ``use_malloc_for_objects`` re-executes with (glibc assumed)."""
    monkeypatch.setattr(memory, "_libc", object())
    calls = []
    assert memory.use_malloc_for_objects(env, execve=lambda *a: calls.append(a)) is True
    (_, _, new_env), = calls
    return new_env


def test_re_exec_extends_an_operator_tunables_and_children_get_them_back(monkeypatch):
    new_env = _re_exec_env(monkeypatch, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    calls = []
    assert new_env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"
    # the re-executed process: the same call restores the operator's value for its children
    assert memory.use_malloc_for_objects(new_env, execve=lambda *a: calls.append(a)) is False
    assert new_env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    assert "DUPLEXKIT_OPERATOR_GLIBC_TUNABLES" not in new_env
    assert calls == []  # no second re-execution


def test_an_operator_tcache_setting_is_kept(monkeypatch):
    new_env = _re_exec_env(monkeypatch, {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"})
    assert new_env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=3"
    assert "DUPLEXKIT_OPERATOR_GLIBC_TUNABLES" not in new_env


@pytest.mark.parametrize("value", ["malloc", "pymalloc", "malloc_debug"])
def test_an_allocator_already_chosen_is_kept(monkeypatch, value):
    monkeypatch.setattr(memory, "_libc", object())
    calls = []
    assert memory.use_malloc_for_objects({"PYTHONMALLOC": value}, execve=lambda *a: calls.append(a)) is False
    assert calls == []


def test_no_re_exec_without_glibc(monkeypatch):
    monkeypatch.setattr(memory, "_libc", None)
    calls = []
    assert memory.use_malloc_for_objects({}, execve=lambda *a: calls.append(a)) is False
    assert calls == []


@glibc
def test_real_re_exec_keeps_pid_and_arguments():
    code = ("import os, sys\nfrom duplexkit.memory import use_malloc_for_objects\n"
            "use_malloc_for_objects()\n"
            "exec_env = dict(kv.split(b'=', 1) for kv in open('/proc/self/environ', 'rb').read().split(b'\\0') if kv)\n"
            "print(os.getpid(), os.environ.get('PYTHONMALLOC'), exec_env[b'GLIBC_TUNABLES'].decode(),\n"
            "      os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONMALLOC", "GLIBC_TUNABLES")}
    p = subprocess.Popen([sys.executable, "-c", code, "a", "b"], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0
    # same pid; glibc started with the tcache off; the process's children would not inherit it
    assert out.split(None, 4) == [str(p.pid), "malloc", "glibc.malloc.tcache_count=0", "None", "['a', 'b']\n"]


def test_serve_called_from_another_program_does_not_re_execute(monkeypatch):
    # tests and embedding programs call duplexkit.cli.main(argv): never replace their process
    from duplexkit import cli
    from duplexkit.cli import serve as serve_mod

    monkeypatch.setattr(memory, "_libc", object())
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    calls = []
    monkeypatch.setattr(memory.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(serve_mod, "_bind", lambda *a: (_ for _ in ()).throw(RuntimeError("stop here")))
    assert cli.main(["serve", "scripted", "--port", "0"]) != 0  # stopped at _bind, after the allocator step
    monkeypatch.setattr(sys, "argv", ["duplexkit", "serve", "scripted", "--port", "0"])  # not orig_argv
    assert cli.main() != 0
    assert calls == []
    # the process's own command line does (python -m duplexkit serve ...)
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "duplexkit", "serve", "scripted", "--port", "0"])
    assert cli.main() != 0
    assert len(calls) == 1 and calls[0][1] == sys.orig_argv and calls[0][2]["PYTHONMALLOC"] == "malloc"


# glibc raises its mmap threshold to the size of each mmapped chunk freed (up to 32 MiB), after which a
# session's 64 000-character base64 strings come from the brk heap and spread it; the fixed threshold
# keeps them mmapped (duplexkit.memory.fix_mmap_threshold; benchmarks/results/2026-12-01-server-load.md "what pins the brk heap")
_THRESHOLD = textwrap.dedent("""
    import json, sys
    from duplexkit import memory

    def heap():
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith("[heap]"):
                return tuple(int(x, 16) for x in line.split()[0].split("-"))
        return (0, 0)

    fixed = memory.fix_mmap_threshold() if sys.argv[1] == "fixed" else None
    big = bytearray(8 << 20)  # mmapped at any threshold; freeing it raises glibc's dynamic one to 8 MiB
    del big
    lo, hi = heap()
    bufs = [bytes(64_000 + i) for i in range(64)]  # 4 MB of a journal's base64 strings
    lo2, hi2 = heap()
    print(json.dumps({"fixed": fixed, "heap_growth": (hi2 - lo2) - (hi - lo),
                      "in_heap": sum(lo2 <= id(b) < hi2 for b in bufs)}))
""")


def _probe(code: str, mode: str, env: dict, timeout: float) -> dict:
    """Run a measuring script in a fresh interpreter; its last line of stdout is a JSON dict."""
    import json

    out = subprocess.run([sys.executable, "-c", code, mode], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _threshold_run(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    return _probe(_THRESHOLD, mode, env, 120)


@glibc
def test_fixed_mmap_threshold_keeps_large_buffers_out_of_the_heap():
    default, fixed = _threshold_run("default"), _threshold_run("fixed")
    # glibc's adapted threshold: all 64 on the heap, which grows by their 4 MB
    assert default["fixed"] is None and default["in_heap"] == 64 and default["heap_growth"] >= 4_000_000, default
    # fixed: the heap serves what its free space holds (the threshold applies when it would have to
    # grow); the rest is mmapped, and unmapped when freed
    assert fixed["fixed"] == memory.MMAP_THRESHOLD, fixed
    # (the heap may still grow by a top-pad step or two, 128 KiB each, for the interpreter's own
    # small allocations: far below the 4 MB the buffers would take)
    assert fixed["heap_growth"] < 1_000_000 and fixed["in_heap"] <= 4, fixed


class _FakeLibc:
    def __init__(self, ok: int = 1) -> None:
        self.calls, self.ok = [], ok

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.ok


def test_fix_mmap_threshold_sets_m_mmap_threshold(monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(memory, "_libc", libc)
    assert memory.fix_mmap_threshold({}) == 32 * 1024
    assert libc.calls == [(-3, 32 * 1024)]  # M_MMAP_THRESHOLD (glibc malloc.h)


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.mmap_threshold=65536"}])
def test_an_operator_mmap_threshold_is_kept(monkeypatch, env):
    libc = _FakeLibc()
    monkeypatch.setattr(memory, "_libc", libc)
    assert memory.fix_mmap_threshold(env) is None
    assert libc.calls == []


def test_mmap_threshold_not_set_without_glibc_or_when_refused(monkeypatch):
    monkeypatch.setattr(memory, "_libc", None)
    assert memory.fix_mmap_threshold({}) is None
    libc = _FakeLibc(ok=0)
    monkeypatch.setattr(memory, "_libc", libc)
    assert memory.fix_mmap_threshold({}, threshold=64 << 20) is None
    assert libc.calls == [(-3, 64 << 20)]


# numpy's default data handler keeps up to 7 freed blocks of each size under 1024 bytes and never gives
# them back; after a load they pin one heap page each (benchmarks/results/2026-12-01-server-load.md "what pins the brk heap").
# Here: 7 arrays of each size, each followed by 4 KiB of other data (so that each sits on a page of its
# own, as a load's short audio frames do), all freed, collect + trim.
_NUMPY_BLOCKS = textwrap.dedent("""
    import gc, json, sys
    import numpy as np
    from duplexkit.memory import malloc_trim, numpy_without_block_cache

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    handler = numpy_without_block_cache() if sys.argv[1] == "raw" else None
    gc.collect(); malloc_trim()
    before = rss()
    arrays, filler = [], []
    for n in range(1, 1024):
        for _ in range(7):
            arrays.append(np.full(n, 1, np.uint8))
            filler.append(bytes(4096))
    peak = rss()
    del arrays, filler
    gc.collect(); malloc_trim()
    print(json.dumps({"handler": handler, "grown": peak - before, "kept": rss() - before}))
""")


def _numpy_blocks(mode: str) -> dict:
    return _probe(_NUMPY_BLOCKS, mode, dict(os.environ, PYTHONMALLOC="malloc"), 300)


@glibc
def test_numpy_without_block_cache_gives_freed_small_arrays_back():
    cached, raw = _numpy_blocks("default"), _numpy_blocks("raw")
    for r in (cached, raw):
        assert r["grown"] > 7161 * 4096, r  # the 7 161 arrays and their neighbours were resident
    assert raw["handler"] == memory.NUMPY_HANDLER_NAME
    # numpy's cache: every cached block keeps its page (~28 MiB); raw: the pages go back
    assert cached["kept"] > 0.6 * 7161 * 4096, cached
    assert raw["kept"] < 0.15 * 7161 * 4096, raw


def test_numpy_handler_reaches_tasks_and_workers_of_the_loop():
    code = textwrap.dedent("""
        import asyncio, json
        import numpy as np
        from numpy._core import multiarray
        from duplexkit.memory import numpy_without_block_cache

        numpy_without_block_cache()
        name = lambda: multiarray.get_handler_name(np.ones(3))
        async def main():
            return [name(), await asyncio.to_thread(name)]
        print(json.dumps(asyncio.run(main())))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ['["duplexkit_raw",', '"duplexkit_raw"]']
