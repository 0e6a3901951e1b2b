"""Load and soak benchmark of the bundled server (issue 13, deliverables 4, 6, 7).

Usage: python benchmarks/load.py [--sessions 64] [--seconds 300] [--burners 3] [--mode process|inprocess]
       [--warmup-s 20] [--json out.json]

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
Reported for the server process (the acceptance number) and, in process mode, the engine process.

Checked per session: the §12 event-stream invariants (ordering, sequence numbers: the project's
EventStreamChecker), no ``input_backpressure`` (appends refused), no ``server_error``, no close that
is not preceded by ``session.closed``. Reported: sessions lost, TTFA (the first
output audio delta after ``speech_stopped``; p50/p99 ms), event-loop lag (p50/p99/max ms), RSS at the
baseline, at peak and after the load (after a 10 s settle, relative to the baseline; the server trims
the allocator after sessions end).
"""

from __future__ import annotations

import argparse
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


def serve_child(port: int, burners: int, lag_file: str, max_sessions: int, mode: str) -> None:
    import uvicorn  # noqa: F401

    from duplexkit.testing import ScriptedEngine
    from duplexkit_server.app import ServerSettings, create_app, serve

    lags: list[float] = []

    async def probe() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append((time.perf_counter() - t - 0.01) * 1000)
            if len(lags) % 100 == 0:
                Path(lag_file).write_text(json.dumps(lags))

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
    child = subprocess.Popen([sys.executable, __file__, "--child", str(port), "--burners", str(args.burners),
                              "--lag-file", lag_file, "--sessions", str(args.sessions), "--mode", args.mode],
                             env=dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / '.wtpath'}:" + os.environ.get("PYTHONPATH", "")))
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
        if os.environ.get("DUPLEXKIT_LOAD_TRACEMALLOC"):
            os.kill(child.pid, signal.SIGUSR1)
        stats: dict = {"errors": {}, "ttfa_ms": [], "lost": [], "violations": [], "cancels": 0, "barge_ins": 0}
        peak, epeak = [rss0], [erss0]

        async def watch() -> None:
            while True:
                peak[0] = max(peak[0], _rss_mib(child.pid))
                epeak[0] = max(epeak[0], _rss_mib(epid))
                await asyncio.sleep(1)

        w = asyncio.get_running_loop().create_task(watch())
        t0 = time.perf_counter()
        await asyncio.gather(*(run_session(url, args.seconds, chunks, silence, random.Random(k), stats)
                               for k in range(args.sessions)))
        wall = time.perf_counter() - t0
        w.cancel()
        await asyncio.sleep(10)  # settle: the allocator trim runs after the last close
        rss1, erss1 = _rss_mib(child.pid), _rss_mib(epid)
        if os.environ.get("DUPLEXKIT_LOAD_TRACEMALLOC"):
            os.kill(child.pid, signal.SIGUSR1)
            await asyncio.sleep(5)
        lags = json.loads(Path(lag_file).read_text()) if Path(lag_file).exists() else []
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
            "engine_rss_after_vs_baseline_pct": round((erss1 / erss0 - 1) * 100, 1) if epid else None}


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
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lag-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        serve_child(args.child, args.burners, args.lag_file, max(8, args.sessions), args.mode)
        return 0
    res = asyncio.run(main_async(args))
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    ok = (res["sessions_lost"] == 0 and res["appends_refused"] == 0 and res["server_errors"] == 0
          and res["ordering_violations"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
