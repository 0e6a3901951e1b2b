"""The server's small-object allocator (issue 13, deliverable 6): ``duplexkit.memory.use_malloc_for_objects``.

Why it exists (benchmarks/NOTES.md, "Server load"): after a burst of sessions a few surviving objects
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
    assert new_env == {"PATH": "/usr/bin", "PYTHONPATH": "x", "PYTHONMALLOC": "malloc"}
    assert "PYTHONMALLOC" not in env  # the caller's mapping is not changed


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
            "use_malloc_for_objects()\nprint(os.getpid(), os.environ.get('PYTHONMALLOC'), sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    p = subprocess.Popen([sys.executable, "-c", code, "a", "b"], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0
    assert out.split(None, 2) == [str(p.pid), "malloc", "['a', 'b']\n"]


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
