"""Load and soak benchmark of the bundled server.

Usage: python benchmarks/load.py [--sessions 64] [--seconds 300] [--burners 3] [--mode process|inprocess]
       [--warmup-s 20] [--allocator serve|pymalloc] [--mmap-threshold fixed|adaptive] [--json out.json]

Starts ``duplexkit``'s server with a ScriptedEngine in a child process, ``--burners`` threads that
burn CPU in pure Python (they model the engine's three stage threads' Python work), and an
event-loop lag probe in the server process (``asyncio.sleep(0.01)``, lag = how late it wakes).

* ``--mode process`` (default, what ``duplexkit serve`` does): the ScriptedEngine runs in the engine
  process (:mod:`duplexkit.engine.process`) and the burner threads run there too, where engine threads
  now live; the server process has its GIL to itself.
* ``--mode inprocess`` (the old layout, for comparison; ``serve --no-engine-process``): engine and
  burners share the server process and its GIL.

Then ``--sessions`` WebSocket sessions run for ``--seconds`` each, in real time: real speech
(tests/fixtures/audio/question_16k.wav) in 100 ms appends on an absolute real-time schedule, then
1.5-4 s of silence appends during which the server VAD ends the turn and the answer plays (a
``response.cancel`` at random), then the next utterance, which barges in when an answer still plays.

RSS: before the measured load, a warm-up runs all ``--sessions`` sessions for ``--warmup-s`` s and the
server settles 10 s; the baseline is taken then, so that "after" measures growth over the soak, not
the first-use high-water of N sessions' buffers (imports, allocator arenas, per-session caches).
Reported for the server process (the acceptance number) and, in process mode, the engine process;
with where it sits (``/proc/PID/smaps``: anonymous memory, of it the brk heap and glibc's per-thread
arenas; mapped files) and the thread count, at the baseline and after. The server runs as
``duplexkit serve`` does: re-executed with ``PYTHONMALLOC=malloc`` and glibc's tcache off
(:func:`duplexkit.memory.use_malloc_for_objects`), glibc's mmap threshold fixed
(:func:`duplexkit.memory.fix_mmap_threshold`), numpy without its small-block cache
(:func:`duplexkit.memory.numpy_without_block_cache`). For comparison: ``--allocator pymalloc`` keeps
CPython's default small-object allocator (and no re-execution: glibc's tcache stays on);
``--mmap-threshold adaptive`` keeps glibc's default threshold; ``DUPLEXKIT_LOAD_NUMPY_CACHE=1`` keeps
numpy's cache.

Diagnostics: ``DUPLEXKIT_LOAD_TRACEMALLOC=DIR`` writes tracemalloc snapshots of the server at the
baseline and after (``server-1.snap``, ``server-2.snap``); ``DUPLEXKIT_LOAD_DIAG=DIR`` writes the
server's ``/proc/PID/smaps`` (``smaps-1.txt``, ``smaps-2.txt``) and, from inside it, glibc's heap
chunk by chunk and ``malloc_info`` on ``PYTHONMALLOC=malloc`` (:mod:`benchmarks.heap_diag`:
``heap-N.txt``, ``malloc_info-N.xml``), its Python threads, ``sys._debugmallocstats()`` (pymalloc's
arenas and pools) and, after the load, the live small objects that sit in memory mapped since the
baseline (``server-1.txt``, ``server-2.txt``).

Checked per session: the §12 event-stream invariants (ordering, sequence numbers: the project's
EventStreamChecker), no ``input_backpressure`` (appends refused), no ``server_error``, no close that
is not preceded by ``session.closed``. Reported: sessions lost, TTFA (the first
output audio delta after ``speech_stopped``; p50/p99 ms), event-loop lag (p50/p99/max ms), RSS at the
baseline, at peak and after the load (read 10 s after the last session closed: the server's
collect-and-trim runs 1 s after the last close; relative to the baseline), and the server's CPU
seconds over the load.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import base64
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT / "tests" / "fixtures" / "audio" / "question_16k.wav"


# ---------------------------------------------------------------------------------------------
# the server child
# ---------------------------------------------------------------------------------------------

def _burn() -> None:
    x = 0
    while True:
        for i in range(10_000):
            x += i * i  # pure Python: holds the GIL like an engine thread's Python parts
        time.sleep(0)


def start_burners(n: int) -> None:
    for _ in range(n):
        threading.Thread(target=_burn, name="burner", daemon=True).start()


def burning_scripted_engine(burners: int, **script):
    """The engine-process factory of ``--mode process``: a ScriptedEngine plus ``burners`` threads in
    the engine process (``EngineSpec("benchmarks.load:burning_scripted_engine", ...)``)."""
    from duplexkit.testing import ScriptedEngine

    start_burners(burners)
    return ScriptedEngine(**script)


SCRIPT = {"units_per_turn": 3, "speak_after_units": None}


def serve_child(port: int, burners: int, lag_file: str, max_sessions: int, mode: str,
                mmap_threshold: str = "fixed") -> None:
    from duplexkit.memory import fix_mmap_threshold, numpy_without_block_cache, use_malloc_for_objects

    use_malloc_for_objects()  # as ``duplexkit serve`` does (--allocator pymalloc: PYTHONMALLOC=pymalloc)
    if mmap_threshold == "fixed":
        fix_mmap_threshold()  # as ``duplexkit serve`` does (MALLOC_MMAP_THRESHOLD_=N keeps N)
    if os.environ.get("DUPLEXKIT_LOAD_NUMPY_CACHE") != "1":  # as serve does; =1 keeps numpy's block cache
        numpy_without_block_cache()
    import uvicorn  # noqa: F401

    from duplexkit.testing import ScriptedEngine
    from duplexkit_server.app import ServerSettings, create_app, serve

    # the samples live in one flat buffer, not as a list of float objects: ~100 objects a second kept
    # for the whole run would be scattered over the small-object allocator's arenas that the sessions'
    # transient objects fill, pinning each (an arena is given back only when empty) and showing in the
    # RSS measured here as if the server held the memory
    lags = array.array("d")

    async def probe() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append((time.perf_counter() - t - 0.01) * 1000)
            if len(lags) % 100 == 0:
                Path(lag_file).write_bytes(lags.tobytes())

    snaps = os.environ.get("DUPLEXKIT_LOAD_TRACEMALLOC")  # diagnostics: a directory for snapshots
    if snaps:
        import signal
        import tracemalloc

        tracemalloc.start(12)
        taken = [0]

        def snapshot(*_a) -> None:
            taken[0] += 1
            tracemalloc.take_snapshot().dump(str(Path(snaps) / f"server-{taken[0]}.snap"))

        signal.signal(signal.SIGUSR1, snapshot)

    diag = os.environ.get("DUPLEXKIT_LOAD_DIAG")  # diagnostics: a directory for allocator reports
    if diag:
        import signal

        dtaken = [0]
        base_maps: list = []

        def mapped_ranges() -> list:
            return [tuple(int(x, 16) for x in line.split(None, 1)[0].split("-"))
                    for line in Path("/proc/self/maps").read_text().splitlines()]

        def pinned(f) -> None:
            # which live small objects sit in memory mapped after the baseline (they keep the
            # small-object allocator's 1 MiB arenas of the load mapped)
            import collections
            import gc

            objs = gc.get_objects()
            seen, tally, examples = set(), collections.Counter(), {}
            for o in objs:
                for x in [o, *gc.get_referents(o)]:
                    a = id(x)
                    if a in seen:
                        continue
                    seen.add(a)
                    if sys.getsizeof(x) > 512 or any(lo <= a < hi for lo, hi in base_maps):
                        continue
                    t = type(x).__qualname__
                    tally[t] += 1
                    examples.setdefault(t, repr(x)[:160])
            f.write(f"small objects in memory mapped after the baseline: {sum(tally.values())}\n")
            for t, n in tally.most_common(40):
                f.write(f"  {n:6d} {t}: {examples[t]}\n")

        heap = None
        if sys.platform.startswith("linux") and os.environ.get("PYTHONMALLOC") == "malloc":
            from benchmarks.heap_diag import HeapDiag

            heap = HeapDiag(diag)  # glibc's heap chunk by chunk, malloc_info (heap-N.txt, malloc_info-N.xml)

        def mallocstats(*_a) -> None:
            # sys._debugmallocstats() writes pymalloc's arena/pool report to C stderr (fd 2)
            if heap is not None:
                heap.snapshot()
            dtaken[0] += 1
            out = Path(diag) / f"server-{dtaken[0]}.txt"
            with open(out, "w") as f:
                f.write("threads: " + ", ".join(sorted(t.name for t in threading.enumerate())) + "\n")
                if dtaken[0] == 1:
                    base_maps[:] = mapped_ranges()
                else:
                    pinned(f)
                f.flush()
                saved = os.dup(2)
                os.dup2(f.fileno(), 2)
                try:
                    sys._debugmallocstats()
                finally:
                    os.dup2(saved, 2)
                    os.close(saved)

        signal.signal(signal.SIGUSR2, mallocstats)

    settings = ServerSettings(max_sessions=max_sessions, max_sessions_per_client=0, answer_policy="on_request")
    if mode == "process":
        from duplexkit.engine.process import EngineProcess, EngineSpec

        spec = EngineSpec("benchmarks.load:burning_scripted_engine", (burners,), dict(SCRIPT))
        app = create_app(engine_loader=lambda: EngineProcess(spec).start(), settings=settings)
    else:
        start_burners(burners)
        app = create_app(ScriptedEngine(**SCRIPT), settings)
    orig = app.router.lifespan_context

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(a):
        task = asyncio.get_running_loop().create_task(probe())
        async with orig(a):
            yield
        task.cancel()

    app.router.lifespan_context = lifespan
    serve(app, "127.0.0.1", port, log_level="warning")


# ---------------------------------------------------------------------------------------------
# clients
# ---------------------------------------------------------------------------------------------

def _rss_mib(pid: Optional[int]) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, TypeError):
        pass
    return float("nan")


def _cpu_s(pid: Optional[int]) -> float:
    """User + system CPU seconds a process has used (``/proc/PID/stat``), NaN when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        f = stat[stat.rindex(")") + 2:].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, ValueError):
        return float("nan")


def _proc_mem(pid: Optional[int]) -> dict:
    """RSS split of a process from ``/proc/PID/smaps``, MiB: ``anon`` (private anonymous pages: heap,
    allocator arenas, thread stacks, pymalloc arenas), ``file`` (mapped files: code, libraries),
    ``heap`` (the brk heap, part of anon), ``arenas`` (anonymous mappings inside glibc's 64 MiB
    per-thread arena reservations, part of anon), plus ``threads`` (from /proc/PID/status) and
    ``maps`` (the number of mappings). Empty when the process is gone."""
    out = {"anon": 0.0, "file": 0.0, "heap": 0.0, "arenas": 0.0, "maps": 0}
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, TypeError):
        return {}
    name, size, anon_kb = "", 0, 0
    maps: list = []
    for line in text.splitlines():
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            maps.append([parts[5].strip() if len(parts) > 5 else "", hi - lo, parts[1], 0, 0])
        elif head == "Rss:":
            maps[-1][3] = int(line.split()[1])
        elif head == "Anonymous:":
            maps[-1][4] = int(line.split()[1])
    # glibc's non-main arenas: a 64 MiB (HEAP_MAX_SIZE) reservation split into a rw part and a ---p rest
    for i, (name, size, perms, rss, anon_kb) in enumerate(maps):
        out["anon"] += anon_kb / 1024
        out["file"] += (rss - anon_kb) / 1024
        if name == "[heap]":
            out["heap"] += anon_kb / 1024
        elif (not name and perms.startswith("rw") and i + 1 < len(maps) and not maps[i + 1][0]
              and maps[i + 1][2].startswith("---") and size + maps[i + 1][1] == 64 << 20):
            out["arenas"] += anon_kb / 1024
    out["maps"] = len(maps)
    for line in status.splitlines():
        if line.startswith("Threads:"):
            out["threads"] = int(line.split()[1])
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in out.items()}


def _engine_pid(server_pid: int) -> Optional[int]:
    """The server's engine process (its multiprocessing spawn child), or None (in-process mode)."""
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit():
                continue
            stat = (d / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[1]) != server_pid:
                continue
            cmd = (d / "cmdline").read_bytes()
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return int(d.name)
        except (OSError, ValueError):
            continue
    return None


async def run_session(url: str, seconds: float, chunks: list[str], silence: str, rng: random.Random,
                      stats: dict) -> None:
    import websockets

    from duplexkit.protocol.conformance import ConformanceError, EventStreamChecker

    checker: "EventStreamChecker | None" = EventStreamChecker()
    pending_create: list[float] = []
    closed_seen = False
    active = False
    try:
        async with websockets.connect(url, max_size=None, open_timeout=60) as ws:
            async def reader() -> None:
                nonlocal closed_seen, active, checker
                async for raw in ws:
                    ev = json.loads(raw)
                    if checker is not None:
                        try:
                            checker.feed(ev)
                        except ConformanceError as exc:
                            stats["violations"].append(str(exc)[:200])
                            checker = None
                    t = ev["type"]
                    if t == "session.closed":
                        closed_seen = True
                    elif t == "error":
                        stats["errors"][ev["error"]["code"]] = stats["errors"].get(ev["error"]["code"], 0) + 1
                    elif t == "input_audio_buffer.speech_stopped":
                        pending_create[:] = [time.perf_counter()]  # server VAD answers this turn
                    elif t == "response.created":
                        active = True
                    elif t == "response.done":
                        active = False
                        pending_create.clear()  # cancelled or barged in before its audio
                    elif t in ("response.output_audio.delta", "response.audio.delta") and pending_create:
                        stats["ttfa_ms"].append((time.perf_counter() - pending_create.pop()) * 1000)

            rtask = asyncio.get_running_loop().create_task(reader())
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end and not rtask.done():
                # one utterance at exactly real time (absolute schedule, so a slow loop does not
                # make the input look slower than its declared rate); a barge-in when an answer plays
                t_next = time.perf_counter()
                for c in chunks:
                    await ws.send(c)
                    t_next += 0.1
                    await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
                if active:
                    stats["barge_ins"] += 1
                # silence while the server VAD ends the turn and the answer plays (input keeps flowing)
                for _ in range(int(rng.uniform(1.5, 4.0) / 0.1)):
                    await ws.send(silence)
                    t_next += 0.1
                    await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
                    if active and rng.random() < 0.01:
                        await ws.send(json.dumps({"type": "response.cancel"}))
                        stats["cancels"] += 1
            await ws.send(json.dumps({"type": "session.close"}))
            await asyncio.wait_for(rtask, 60)
    except websockets.ConnectionClosed as exc:
        if not closed_seen:
            stats["lost"].append(f"closed {exc.rcvd.code if exc.rcvd else None} without session.closed")
    except Exception as exc:  # noqa: BLE001 - reported
        stats["lost"].append(f"{type(exc).__name__}: {exc}")
    else:
        if not closed_seen:
            stats["lost"].append("no session.closed")


def _pct(xs: list, p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def main_async(args) -> dict:
    import httpx

    from duplexkit.audio import read_wav

    audio, _ = read_wav(FIXTURE, 16_000)
    pcm = (audio.clip(-1, 1) * 32767).astype("<i2").tobytes()
    chunks = [json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + 3200]).decode()})
              for i in range(0, len(pcm), 3200)]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lag_file = f"/tmp/duplexkit-load-lag-{os.getpid()}.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / '.wtpath'}:" + os.environ.get("PYTHONPATH", ""))
    if args.allocator == "pymalloc":
        env["PYTHONMALLOC"] = "pymalloc"
    child = subprocess.Popen([sys.executable, __file__, "--child", str(port), "--burners", str(args.burners),
                              "--lag-file", lag_file, "--sessions", str(args.sessions), "--mode", args.mode,
                              "--mmap-threshold", args.mmap_threshold],
                             env=env)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        silence = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(3200)).decode()})
        warm: dict = {"errors": {}, "ttfa_ms": [], "lost": [], "violations": [], "cancels": 0, "barge_ins": 0}
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        # warm-up at the full session count, so that first-use high-water (imports, allocator arenas,
        # N sessions' buffers) is in the baseline and "after" measures growth over the soak
        await asyncio.gather(*(run_session(url, args.warmup_s, chunks, silence, random.Random(-k - 1), warm)
                               for k in range(args.sessions)))
        await asyncio.sleep(10)
        epid = _engine_pid(child.pid)
        rss0, erss0 = _rss_mib(child.pid), _rss_mib(epid)
        cpu0 = _cpu_s(child.pid)
        # what the server runs with, read from the process itself (after its re-exec)
        env_now = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        allocator = env_now.get(b"PYTHONMALLOC", b"pymalloc (default)").decode()
        mem0, emem0 = _proc_mem(child.pid), _proc_mem(epid)
        if os.environ.get("DUPLEXKIT_LOAD_TRACEMALLOC"):
            os.kill(child.pid, signal.SIGUSR1)
        if os.environ.get("DUPLEXKIT_LOAD_DIAG"):
            Path(os.environ["DUPLEXKIT_LOAD_DIAG"], "smaps-1.txt").write_text(Path(f"/proc/{child.pid}/smaps").read_text())
            os.kill(child.pid, signal.SIGUSR2)
        stats: dict = {"errors": {}, "ttfa_ms": [], "lost": [], "violations": [], "cancels": 0, "barge_ins": 0}
        peak, epeak = [rss0], [erss0]
        peak_threads = [mem0.get("threads", 0)]

        async def watch() -> None:
            while True:
                peak[0] = max(peak[0], _rss_mib(child.pid))
                peak_threads[0] = max(peak_threads[0], _proc_mem(child.pid).get("threads", 0))
                epeak[0] = max(epeak[0], _rss_mib(epid))
                await asyncio.sleep(1)

        w = asyncio.get_running_loop().create_task(watch())
        t0 = time.perf_counter()
        await asyncio.gather(*(run_session(url, args.seconds, chunks, silence, random.Random(k), stats)
                               for k in range(args.sessions)))
        wall = time.perf_counter() - t0
        cpu1 = _cpu_s(child.pid)
        w.cancel()
        await asyncio.sleep(10)  # settle: the allocator trim runs after the last close
        rss1, erss1 = _rss_mib(child.pid), _rss_mib(epid)
        mem1, emem1 = _proc_mem(child.pid), _proc_mem(epid)
        if os.environ.get("DUPLEXKIT_LOAD_TRACEMALLOC"):
            os.kill(child.pid, signal.SIGUSR1)
            await asyncio.sleep(5)
        if os.environ.get("DUPLEXKIT_LOAD_DIAG"):
            Path(os.environ["DUPLEXKIT_LOAD_DIAG"], "smaps-2.txt").write_text(Path(f"/proc/{child.pid}/smaps").read_text())
            os.kill(child.pid, signal.SIGUSR2)
            report, size = Path(os.environ["DUPLEXKIT_LOAD_DIAG"], "server-2.txt"), -1
            for _ in range(600):  # the heap walk takes a while; then wait until the report stops growing
                await asyncio.sleep(2)
                if report.exists() and report.stat().st_size == size:
                    break
                size = report.stat().st_size if report.exists() else -1
        lags = array.array("d", Path(lag_file).read_bytes()).tolist() if Path(lag_file).exists() else []
    finally:
        child.terminate()
        child.wait(30)
        Path(lag_file).unlink(missing_ok=True)
    return {"mode": args.mode, "burners_in": "engine process" if args.mode == "process" else "server process",
            "sessions": args.sessions, "seconds": args.seconds, "burners": args.burners, "warmup_s": args.warmup_s,
            "wall_s": round(wall, 1), "warmup_lost": len(warm["lost"]),
            "sessions_lost": len(stats["lost"]), "lost_reasons": stats["lost"][:5],
            "appends_refused": stats["errors"].get("input_backpressure", 0),
            "server_errors": stats["errors"].get("server_error", 0), "errors": stats["errors"],
            "ordering_violations": len(stats["violations"]), "violation_examples": stats["violations"][:3], "cancels": stats["cancels"], "barge_ins": stats["barge_ins"],
            "responses_with_audio": len(stats["ttfa_ms"]),
            "ttfa_p50_ms": round(_pct(stats["ttfa_ms"], 50), 1), "ttfa_p99_ms": round(_pct(stats["ttfa_ms"], 99), 1),
            "loop_lag_p50_ms": round(_pct(lags, 50), 2), "loop_lag_p99_ms": round(_pct(lags, 99), 2),
            "loop_lag_max_ms": round(max(lags), 2) if lags else None,
            "rss_baseline_mib": round(rss0, 1), "rss_peak_mib": round(peak[0], 1), "rss_after_mib": round(rss1, 1),
            "rss_after_vs_baseline_pct": round((rss1 / rss0 - 1) * 100, 1),
            "engine_rss_baseline_mib": round(erss0, 1), "engine_rss_peak_mib": round(epeak[0], 1),
            "engine_rss_after_mib": round(erss1, 1),
            "engine_rss_after_vs_baseline_pct": round((erss1 / erss0 - 1) * 100, 1) if epid else None,
            "server_allocator": allocator, "server_mmap_threshold": args.mmap_threshold,
            "server_cpu_s_during_load": round(cpu1 - cpu0, 1),
            "server_peak_threads": peak_threads[0],
            "server_mem_baseline": mem0, "server_mem_after": mem1,
            "engine_mem_baseline": emem0, "engine_mem_after": emem1}


def rss_table(res: dict) -> str:
    """The memory part of a result as a text table: RSS at the baseline, at peak and after the load,
    the change, and where the memory sits, baseline>after (anonymous, of it the brk heap and glibc's
    thread arenas; mapped files, which the kernel may evict under memory pressure; threads)."""
    rows = [("server", "", "server_mem_"), ("engine process", "engine_", "engine_mem_")]
    out = [f"{'MiB':<15}{'baseline':>9}{'peak':>9}{'after':>9}{'delta %':>9}   "
           f"{'anon':>13}{'heap':>13}{'arenas':>13}{'file':>13}{'threads':>9}"]
    for name, k, m in rows:
        if res.get(f"{k}rss_after_vs_baseline_pct") is None:
            continue
        b, a = res.get(m + "baseline") or {}, res.get(m + "after") or {}

        def pair(f: str) -> str:
            return f"{b.get(f, float('nan')):.1f}>{a.get(f, float('nan')):.1f}"
        out.append(f"{name:<15}{res[k + 'rss_baseline_mib']:>9.1f}{res[k + 'rss_peak_mib']:>9.1f}"
                   f"{res[k + 'rss_after_mib']:>9.1f}{res[k + 'rss_after_vs_baseline_pct']:>+9.1f}   "
                   f"{pair('anon'):>13}{pair('heap'):>13}{pair('arenas'):>13}{pair('file'):>13}"
                   f"{str(b.get('threads', '?')) + '>' + str(a.get('threads', '?')):>9}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--burners", type=int, default=3,
                    help="CPU-burning threads modelling the engine threads (where: --mode)")
    ap.add_argument("--mode", default="process", choices=["process", "inprocess"],
                    help="process: engine and burners in the engine process (serve's default); inprocess: "
                         "both in the server process (serve --no-engine-process, the old layout)")
    ap.add_argument("--warmup-s", type=float, default=20.0,
                    help="warm-up with all --sessions before the RSS baseline, s (default 20)")
    ap.add_argument("--allocator", default="serve", choices=["serve", "pymalloc"],
                    help="the server's small-object allocator: serve (what `duplexkit serve` picks: glibc "
                         "malloc unless PYTHONMALLOC is set) or pymalloc (CPython's default, for comparison)")
    ap.add_argument("--mmap-threshold", default="fixed", choices=["fixed", "adaptive"],
                    help="the server's glibc mmap threshold: fixed (what `duplexkit serve` sets, "
                         "duplexkit.memory.MMAP_THRESHOLD) or adaptive (glibc's default, for comparison)")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lag-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        serve_child(args.child, args.burners, args.lag_file, max(8, args.sessions), args.mode, args.mmap_threshold)
        return 0
    res = asyncio.run(main_async(args))
    print(json.dumps(res, indent=2))
    print(f"\nRSS, read 10 s after the last session closed (server allocator: {res['server_allocator']}, "
          f"glibc mmap threshold: {res['server_mmap_threshold']}):")
    print(rss_table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    ok = (res["sessions_lost"] == 0 and res["appends_refused"] == 0 and res["server_errors"] == 0
          and res["ordering_violations"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
