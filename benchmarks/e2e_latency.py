"""What the user feels: end-to-end latency of the real server over WebSockets.

Starts ``duplexkit serve <model>`` as a subprocess (or targets ``--url``), opens N sessions at once
and streams the fixture speech into each in real time (100 ms appends, paced by the wall clock;
silence between utterances, the mic is never off). Every session runs ``--rounds`` rounds of three
scenarios and the script prints, per concurrency level, p50/p90 in ms of:

* ``vad_eos``: end of the user's speech (the last 10 ms block of the fixture above -50 dBFS, at the
  moment the client sent it) -> first ``response.output_audio.delta`` at the client, with the
  server VAD committing and creating the response (``create_response: true``: the model-native
  path with a forced decision; random weights never decide on their own);
* ``create``: ``input_audio_buffer.commit`` + ``response.create`` sent -> first audio delta;
* ``barge``: onset of the interrupting speech (sent while the answer plays) -> the cancelled
  ``response.done`` at the client (after it no delta of that response can arrive); ``barge_last``
  is the same onset -> the last audio delta of the interrupted response.

Models: ``scripted`` (torch-free; ``--unit-delay-ms`` simulates engine compute per unit, so with 0
every millisecond measured is session + server + socket overhead), ``tiny``, a checkpoint path, or
``random-real`` / ``random-tiny`` (MiniCPM-o 4.5 with random weights at real / tiny size, built
in-process like benchmarks/gpu_engine.py and served with create_app + uvicorn; ``--device``).

Examples::

    python benchmarks/e2e_latency.py --model scripted --sessions 1,16
    python benchmarks/e2e_latency.py --model tiny --sessions 1,2 --rounds 2
    python benchmarks/e2e_latency.py --model random-real --device cuda --sessions 1,8,16,32 --tokens 19
    python benchmarks/e2e_latency.py --url ws://127.0.0.1:8000 --sessions 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from duplexkit.audio import read_wav  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _realtime import CHUNK, FIX, SR, Inbox, Mic, stop_server, wait_idle  # noqa: E402
from _realtime import delta_of as _delta_of, error_kinds as _error_kinds, free_port as _free_port  # noqa: E402
from _realtime import is_type as _is, pct as _pct, serve_inprocess as _serve_inprocess  # noqa: E402
from _realtime import speech_edges as _speech_edges  # noqa: E402


async def _session(url: str, rounds: int, res: dict, question: np.ndarray, interrupt: np.ndarray,
                   timeout: float, silence_ms: int = 500, split_ms: float = 0.0, phase: Optional[list] = None) -> None:
    """One client: ``rounds`` of the three scenarios. ``phase[0]`` names the wait in progress (for the
    error report when a wait times out)."""
    import websockets

    phase = phase if phase is not None else [""]

    q_end = _speech_edges(question)[1]
    i_on = _speech_edges(interrupt)[0]
    async with websockets.connect(url + "/v1/realtime?duplex=1", max_size=None) as ws:
        inbox = Inbox(ws)
        rx = asyncio.create_task(inbox.run())
        phase[0] = "session.created"
        await asyncio.wait_for(inbox.expect(_is("session.created")), timeout)
        mic = Mic(ws)
        tx = asyncio.create_task(mic.run())

        async def update(td) -> None:
            phase[0] = "session.updated"
            f = inbox.expect(_is("session.updated"))
            await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": td}}))
            await asyncio.wait_for(f, timeout)

        async def until_done(fut=None) -> dict:
            phase[0] = phase[0].split(" -> ")[0] + " -> response.done"
            ev, _ = await asyncio.wait_for(fut or inbox.expect(_is("response.done")), timeout)
            return ev

        async def idle() -> None:
            """Cancel any response in progress: one the model started on its own (duplex turn-taking
            may speak during or after the question) or the VAD created in the last round; else the
            timed ``response.create`` is refused with ``response_already_active``."""
            while inbox.active:
                done = inbox.expect(_is("response.done"))
                await ws.send(json.dumps({"type": "response.cancel"}))
                await until_done(done)

        async def first_audio(fut) -> float:
            """Receive time of the timed response's first audio delta; a timeout names the server's
            errors so far (e.g. a refused ``response.create``)."""
            try:
                return (await asyncio.wait_for(fut, timeout))[1]
            except asyncio.TimeoutError:
                raise SystemExit(f"no audio of the requested response within {timeout} s; server errors: "
                                 f"{[e['error'].get('code') for e in inbox.errors]}") from None

        try:
            for _ in range(rounds):
                # 1. explicit commit + response.create
                await update(None)
                await idle()
                await mic.say(question).wait()
                await idle()
                tag = f"bench-{time.perf_counter_ns()}"
                first = inbox.expect(_delta_of(inbox, lambda t, md: md.get("bench") == tag))
                done = inbox.expect(_is("response.done"))
                phase[0] = "create: first audio"
                t0 = time.perf_counter()
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                await ws.send(json.dumps({"type": "response.create", "response": {"metadata": {"bench": tag}}}))
                t1 = await first_audio(first)
                res["create"].append((t1 - t0) * 1000)
                await ws.send(json.dumps({"type": "response.cancel"}))
                await until_done(done)
                await asyncio.sleep(0.5)
                if split_ms > 0:
                    # 1b. the same with a gap between commit and response.create (past the Session's
                    # COMMIT_MERGE_MS): the commit's unit goes out as a listen unit and the forced unit
                    # is a second, all-zero one (the behaviour before the merge), timed from the create
                    await mic.say(question).wait()
                    await idle()
                    tag = f"bench-{time.perf_counter_ns()}"
                    first = inbox.expect(_delta_of(inbox, lambda t, md: md.get("bench") == tag))
                    done = inbox.expect(_is("response.done"))
                    phase[0] = "create_split: first audio"
                    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                    await asyncio.sleep(split_ms / 1000)
                    t0 = time.perf_counter()
                    await ws.send(json.dumps({"type": "response.create", "response": {"metadata": {"bench": tag}}}))
                    t1 = await first_audio(first)
                    res["create_split"].append((t1 - t0) * 1000)
                    await ws.send(json.dumps({"type": "response.cancel"}))
                    await until_done(done)
                    await asyncio.sleep(0.5)
                # 2. server VAD: end of speech -> first audio
                await update({"type": "server_vad", "create_response": True, "interrupt_response": True,
                              "silence_duration_ms": silence_ms})
                q_chunk = (q_end - 1) // CHUNK * CHUNK + CHUNK  # the append that carries the end of speech

                def after_eos(t, md):
                    return q_chunk in mic.sent_at and t >= mic.sent_at[q_chunk]

                first = inbox.expect(_delta_of(inbox, after_eos))
                done = inbox.expect(_is("response.done"))
                stopped = inbox.expect(lambda e: e["type"] == "input_audio_buffer.speech_stopped"
                                       and q_chunk in mic.sent_at)
                phase[0] = "vad_eos: first audio"
                mic.say(question)
                t_say = time.perf_counter()
                await asyncio.wait({first, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not first.done() and stopped.done():
                    # the model started speaking on its own during the question (duplex turn-taking;
                    # random weights do): a response is active at the end of speech, so the VAD
                    # creates none. Not a latency sample: counted, then the next round
                    t_stop = stopped.result()[1]
                    if any(t_say <= inbox.created[r][0] < t_stop for r in inbox.active):
                        res["vad_preempted"].append(1)
                        await idle()
                        await mic.done.wait()
                        await asyncio.sleep(0.5)
                        continue
                t1 = await first_audio(first)
                res["vad_eos"].append((t1 - mic.spoken_at(q_end - 1)) * 1000)
                if stopped.done():
                    res["vad_stop"].append((t1 - stopped.result()[1]) * 1000)
                # 3. barge-in over that answer: speech onset -> silence at the client
                last = [t1]
                rid = None

                def mark(e):
                    if e["type"] == "response.output_audio.delta" and (rid is None or e["response_id"] == rid):
                        last[0] = time.perf_counter()
                    return False

                inbox.waiters.append((mark, asyncio.get_running_loop().create_future()))
                phase[0] = "barge"
                mic.say(interrupt)
                ev = await until_done(done)
                inbox.waiters = [w for w in inbox.waiters if w[0] is not mark]
                st = ev["response"]["status"]
                if st == "cancelled" and (i_on // CHUNK + 1) * CHUNK in mic.sent_at:
                    t_on = mic.spoken_at(i_on)
                    res["barge"].append((ev["_t"] - t_on) * 1000)
                    res["barge_last"].append((last[0] - t_on) * 1000)
                else:
                    res["barge_missed"].append(st)
                await mic.done.wait()
                # the interruption's own VAD turn creates a response: wait for it and cancel it
                for _w in range(2):
                    c = inbox.expect(_is("response.created"))
                    f = inbox.expect(_is("response.done"))
                    try:
                        await asyncio.wait_for(c, 3)
                    except asyncio.TimeoutError:
                        break
                    await asyncio.sleep(0.3)
                    await ws.send(json.dumps({"type": "response.cancel"}))
                    try:
                        await asyncio.wait_for(f, 5)
                    except asyncio.TimeoutError:
                        pass
                await asyncio.sleep(0.5)
        finally:
            tx.cancel()
            rx.cancel()
        res["errors"] += inbox.errors


async def run_level(url: str, n: int, rounds: int, timeout: float, silence_ms: int = 500,
                    split_ms: float = 0.0) -> dict:
    question = read_wav(FIX / "question_16k.wav", SR)[0]
    interrupt = read_wav(FIX / "interrupt_16k.wav", SR)[0]
    res: dict = {"create": [], "create_split": [], "vad_eos": [], "vad_stop": [], "barge": [], "barge_last": [], "barge_missed": [], "vad_preempted": [], "errors": []}

    async def one(k: int) -> None:
        await asyncio.sleep(0.1 * k / max(1, n))  # spread the unit phases a little
        phase = [""]
        try:
            await _session(url, rounds, res, question, interrupt, timeout, silence_ms, split_ms, phase)
        except (asyncio.TimeoutError, SystemExit) as exc:  # one stuck session does not end the level
            res["timeouts"] = res.get("timeouts", 0) + 1
            res["errors"].append({"session": k, "timeout": f"waiting for {phase[0]}: {str(exc)[:300]}"})
        except Exception as exc:  # noqa: BLE001 - e.g. the server closed the socket: report, go on
            res["errors"].append({"session": k, "timeout": f"{type(exc).__name__} while waiting for {phase[0]}: "
                                                           f"{str(exc)[:300]}"})

    await asyncio.gather(*[one(k) for k in range(n)])
    return res


def _start_subprocess(a, max_sessions: int):
    port = _free_port()
    cmd = [sys.executable, "-m", "duplexkit.cli", "serve", a.model, "--host", "127.0.0.1", "--port", str(port),
           "--max-sessions", str(max_sessions + 2), "--max-sessions-per-client", "0",  # every client is one address
           "--log-level", "warning", "--answer-policy", "on_request"]
    if a.model == "scripted":
        cmd += ["--scripted", f"unit_delay_s={a.unit_delay_ms / 1000}", "--scripted", "units_per_turn=4"]
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env)
    import httpx

    t_end = time.monotonic() + 600
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, f"ws://127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise SystemExit("server not ready")


def _start_local(a, max_sessions: int):
    """scripted / tiny in this process (``--trace``): the same engine ``duplexkit serve`` loads."""
    from duplexkit.engine import load_engine

    scripted = {"unit_delay_s": a.unit_delay_ms / 1000, "units_per_turn": 4} if a.model == "scripted" else None
    return _serve_inprocess(load_engine(a.model, progress=False, scripted=scripted), max_sessions)


def build_random_engine(model_name: str, device: str, tokens: int, max_sessions: int, warm_turn: bool = True,
                        code2wav_dtype: str = "float32", tokenizer_dir: Optional[str] = None):
    """random-real / random-tiny: build the model with random weights, capture its graphs for every
    batch size up to ``max_sessions + 2`` and run the warm-up turn (CUDA), as ``DuplexEngine.from_pretrained``
    would; returns the engine. Module-level so that an engine process can call it
    (``EngineSpec("e2e_latency:build_random_engine", ...)``). ``tokenizer_dir``: a checkpoint's
    tokenizer for random-real (text costs as many tokens as with the released model: tool calls).
    The thinker's KV pool holds ``min(8, max_sessions)`` slots beyond the sessions' for turn-based
    replies (tool decisions: they decode in pool slots, batched, and wait for one when all are taken)."""
    import torch

    from duplexkit.engine import DuplexEngine
    from duplexkit.models.minicpmo45.random_init import build_random_model

    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_engine import make_layout  # the same layout as the engine-only benchmark

    size = model_name.split("-", 1)[1]
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build_random_model(size, dtype=dtype, device=dev, fast=True, thinker_max_len=4096,
                               kv_slots=max_sessions + 2 + min(8, max_sessions), with_code2wav=True,
                               code2wav_dtype=getattr(torch, code2wav_dtype),
                               **({"tokenizer_dir": tokenizer_dir} if tokenizer_dir else {}))
    print(f"code2wav flow dtype {code2wav_dtype}", flush=True)

    def mem(what: str) -> None:
        if dev.type == "cuda":
            print(f"GPU memory after {what}: {torch.cuda.memory_allocated(dev) / 2**30:.1f} GiB allocated, "
                  f"{torch.cuda.memory_reserved(dev) / 2**30:.1f} GiB reserved", flush=True)

    mem("building the model")
    model.thinker.policy_defaults = {"min_unit_tokens": int(tokens), "max_unit_tokens": int(tokens)}
    engine = DuplexEngine(model, make_layout(device, max_sessions + 2))
    ms = engine.warmup_tools()  # what DuplexEngine.from_pretrained does: the tool constraint's tables now
    if ms is not None:
        print(f"tool-call tables built in {ms:.0f} ms", flush=True)
    if dev.type == "cuda":
        # every batch bucket, each stage's warm-up on its own worker thread (what
        # DuplexEngine.from_pretrained does: cuDNN keeps autotuned plans per thread)
        sizes = model.code2wav.warmup_sizes(max_sessions) if hasattr(model.code2wav, "warmup_sizes") else None
        engine.warmup(512, code2wav_sizes=sizes)
        mem("the stages' captures (on their threads)")
    if dev.type == "cuda" and warm_turn:
        ms = engine.warmup_turn()  # what DuplexEngine.from_pretrained does on CUDA
        print(f"warm-up turn: first audio after {ms or 0:.0f} ms", flush=True)
        mem("the warm-up turn")
    return engine


def _start_random(a, max_sessions: int):
    """random-real / random-tiny: serve a random-weight engine with create_app + uvicorn in this
    process; the engine in this process too, or (``--engine-process``) in its own process as
    ``duplexkit serve`` runs it by default."""
    args = (a.model, a.device, int(a.tokens), max_sessions, not a.no_warm_turn, a.code2wav_dtype,
            getattr(a, "tokenizer_dir", None))
    if a.engine_process:
        from duplexkit.engine.process import EngineProcess, EngineSpec

        engine = EngineProcess(EngineSpec("e2e_latency:build_random_engine", args)).start()
    else:
        engine = build_random_engine(*args)
    return _serve_inprocess(engine, max_sessions)


class TraceCollector(logging.Handler):
    """Collects the server's latency trace (the ``duplexkit.latency`` logger at DEBUG: one JSON
    record per response, docs/benchmarks.md "Latency trace")."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append(json.loads(record.getMessage()))
        except ValueError:
            pass

    def install(self) -> "TraceCollector":
        lg = logging.getLogger("duplexkit.latency")
        lg.setLevel(logging.DEBUG)
        lg.addHandler(self)
        lg.propagate = False
        return self


TRACE_KEYS = ("units_ahead", "decision", "first_audio", "engine.thinker_queue_ms", "engine.thinker_ms",
              "engine.thinker_done_ms", "engine.talker_queue_ms", "engine.talker_ms", "engine.talker_done_ms",
              "engine.code2wav_queue_ms", "engine.code2wav_ms", "engine.first_audio_ms")


def trace_summary(records: list) -> dict:
    """Per trigger (client = response.create, server_vad), the p50 of: units queued ahead of the
    forced unit, request -> forced unit's decision / first audio at the Session, and the forced
    unit's engine timings (stage queue waits, stage times, submit -> first audio chunk), ms."""
    out: dict = {}
    for trig in ("client", "server_vad"):
        rs = [r for r in records if r.get("trigger") == trig and "first_audio_ms" in r]
        row = {"n": len(rs)}
        for k in TRACE_KEYS:
            if k.startswith("engine."):
                v = [r["engine"][k[7:]] for r in rs if k[7:] in r.get("engine", {})]
            elif k == "units_ahead":
                v = [r[k] for r in rs]
            else:
                v = [r[k + "_ms"] - r["request_ms"] for r in rs if k + "_ms" in r]
            row[k] = _pct(v, 50)
        out[trig] = row
    return out


def print_table(rows: list) -> None:
    """The p50/p90 table (and the latency trace's p50s where collected)."""
    hdr = (f"{'sessions':>8} | {'create p50':>10} {'p90':>7} | {'vad_eos p50':>11} {'p90':>7} | {'vad_stop p50':>12} | "
           f"{'barge p50':>9} {'p90':>7} | {'barge_last p50':>14}")
    print(hdr)
    print("-" * len(hdr))
    if any(r.get("create_split") for _, r in rows):
        print("create_split (commit, gap, then response.create; from the create), p50 / p90 ms: " + ", ".join(
            f"{n}: {_pct(r['create_split'], 50):.0f} / {_pct(r['create_split'], 90):.0f}" for n, r in rows))
    for n, r in rows:
        print(f"{n:>8} | {_pct(r['create'], 50):>10.0f} {_pct(r['create'], 90):>7.0f} | {_pct(r['vad_eos'], 50):>11.0f} "
              f"{_pct(r['vad_eos'], 90):>7.0f} | {_pct(r['vad_stop'], 50):>12.0f} | {_pct(r['barge'], 50):>9.0f} "
              f"{_pct(r['barge'], 90):>7.0f} | {_pct(r['barge_last'], 50):>14.0f}")
    if any(r["trace"] for _, r in rows):
        print("\nlatency trace, p50 ms (server side; request = response.create / VAD speech_stopped at the Session):")
        print(f"{'sessions':>8} {'trigger':>10} {'n':>3} " + " ".join(f"{k.replace('engine.', ''):>17}" for k in TRACE_KEYS))
        for n, r in rows:
            for trig, row in (r["trace"] or {}).items():
                print(f"{n:>8} {trig:>10} {row['n']:>3} " + " ".join(f"{row[k]:>17.0f}" for k in TRACE_KEYS))
    sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="scripted", help="scripted | tiny | <checkpoint dir> | random-real | random-tiny")
    ap.add_argument("--url", default=None, help="target an existing server (ws://host:port) instead")
    ap.add_argument("--sessions", default="1", help="comma list of concurrency levels (e.g. 1,8,16,32)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three scenarios per session")
    ap.add_argument("--unit-delay-ms", type=float, default=0.0, help="scripted: simulated engine compute per unit")
    ap.add_argument("--tokens", default="19", help="random-*: decided tokens per speaking unit")
    ap.add_argument("--device", default="cuda", help="random-*: torch device")
    ap.add_argument("--code2wav-dtype", choices=("float32", "float16"), default="float32",
                    help="random-*: the Code2Wav flow's dtype (float16: the reference's Token2wav(float16=True))")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-wait timeout, s")
    ap.add_argument("--out", default=None, help="write the results as JSON here (with the raw latency-trace records where they are "
                         "collected: --trace, or a random-* model)")
    ap.add_argument("--trace", action="store_true",
                    help="serve in this process and print the server's latency trace per level "
                         "(the duplexkit.latency logger; scripted/tiny/random-*)")
    ap.add_argument("--silence-ms", type=int, default=500,
                    help="server VAD silence_duration_ms for the vad_eos scenario (the OpenAI default is 500)")
    ap.add_argument("--split-commit-ms", type=float, default=0.0,
                    help="also time commit, a gap of this many ms, then response.create (create_split: the "
                         "commit's unit and the forced unit go out separately, as before COMMIT_MERGE_MS)")
    ap.add_argument("--no-warm-turn", action="store_true",
                    help="skip DuplexEngine.warmup_turn() (random-* on CUDA): measure the cold start")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="rounds of one session run first and reported apart as the cold start (the first "
                         "response of a fresh process pays one-time lazy initialisation), not in the levels")
    ap.add_argument("--engine-process", action="store_true",
                    help="random-*: run the engine in its own process (as `duplexkit serve` does by default), "
                         "not on threads of the server's process")
    ap.add_argument("--level-warmup", action="store_true",
                    help="before each level, one round at that level's concurrency, not counted (the first "
                         "time a batch size is met, lazily built kernels and graph buckets for it are paid)")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.sessions.split(",") if x.strip()]
    server = None
    url = a.url
    if url is None:
        if a.model.startswith("random-"):
            server, url = _start_random(a, max(levels))
        elif a.trace:
            server, url = _start_local(a, max(levels))
        else:
            server, url = _start_subprocess(a, max(levels))
    rows = []
    tracer = TraceCollector().install() if (a.trace or a.model.startswith("random-")) and a.url is None else None
    try:
        if a.warmup_rounds > 0:
            w = asyncio.run(run_level(url, 1, a.warmup_rounds, a.timeout, a.silence_ms))
            print(f"cold start (first {a.warmup_rounds} round(s) of the process, not counted): create "
                  f"{[round(x) for x in w['create']]} ms, vad_eos {[round(x) for x in w['vad_eos']]} ms", flush=True)
        for n in levels:
            t = time.perf_counter()
            waited = wait_idle(url)
            if waited > 1:
                print(f"waited {waited:.1f} s for the previous level's sessions to release their slots", flush=True)
            if a.level_warmup and n > 1:
                w = asyncio.run(run_level(url, n, 1, a.timeout, a.silence_ms))
                wait_idle(url)
                print(f"level {n} warm-up round (not counted): create p50 {_pct(w['create'], 50):.0f} ms, "
                      f"{time.perf_counter() - t:.0f} s", flush=True)
            if tracer is not None:
                tracer.records = []
            r = asyncio.run(run_level(url, n, a.rounds, a.timeout, a.silence_ms, a.split_commit_ms))
            r["trace"] = trace_summary(tracer.records) if tracer is not None else None
            r["trace_records"] = list(tracer.records) if tracer is not None else []
            rows.append((n, r))
            print_table([(n, r)])
            print(f"level {n}: {time.perf_counter() - t:.0f} s, {len(r['create'])} create / {len(r['vad_eos'])} vad / "
                  f"{len(r['barge'])} barge samples, missed barge-ins {r['barge_missed']}, "
                  f"VAD rounds the model pre-empted (spoke during the question) {len(r['vad_preempted'])}, errors {len(r['errors'])}",
                  flush=True)
            for kind, count in _error_kinds(r["errors"]).most_common():
                print(f"  error x{count}: {kind}", flush=True)
    finally:
        if isinstance(server, subprocess.Popen):
            server.terminate()
            server.wait(30)
        elif server is not None:
            stop_server(server)  # the app's shutdown runs before the process ends (_realtime.stop_server)
    print(f"\nmodel {a.model if a.url is None else a.url}  (ms; 100 ms appends paced in real time; "
          f"VAD silence_duration_ms {a.silence_ms})")
    print_table(rows)
    out = [{"sessions": n, **{k: r[k] for k in ("create", "create_split", "vad_eos", "vad_stop", "barge", "barge_last",
                                                 "barge_missed", "vad_preempted", "trace", "trace_records")},
            "errors": dict(_error_kinds(r["errors"]))} for n, r in rows]
    if a.out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _cli import no_nan

        Path(a.out).write_text(json.dumps(no_nan({"model": a.model, "levels": out}), indent=1, allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
