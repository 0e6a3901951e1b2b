"""Tools during a full-duplex conversation: how long after the user stops speaking the call
goes out and the filler is heard, and how long after the tool's output the answer is heard.

Serves the engine with the real server in this process (create_app + uvicorn, as
``e2e_latency.py --trace`` does) and opens N realtime sessions at once over WebSockets. Each session
has one function tool with ``tool_choice: "required"`` (so every user turn calls it, with random
weights too: the decider's constrained decoding), streams the fixture speech
(``tests/fixtures/audio/question_16k.wav``) in real time (100 ms appends, silence after it; the mic
is never off), and the turn is ended by the server VAD (``--commit vad``, ``create_response: true``)
or by an ``input_audio_buffer.commit`` sent right after the speech (``--commit client``, turn
detection off). When ``response.function_call_arguments.done`` arrives the client answers at once
(or after ``--tool-ms``) with a fixed ``function_call_output`` and ``response.create``, waits for the
answer's first audio and cancels the rest. Per turn, in ms (client receive times, perf_counter):

* ``call``: end of the user's turn -> ``response.function_call_arguments.done``. The end of the
  turn is the ``input_audio_buffer.speech_stopped`` received (vad: after the VAD's silence) or the
  ``commit`` sent (client);
* ``filler``: the same end of turn -> the first audio delta of the filler response
  (``trigger: "filler"``);
* ``answer``: ``function_call_output`` sent -> the first audio delta of the answer response (it
  waits for the filler to end: a ``response.create`` during a filler is queued); ``answer_free``:
  from the later of the output sent and the filler's ``response.done``;
* ``eos_call`` (vad): the acoustic end of the speech (last 10 ms block above -50 dBFS, when the
  client sent it) -> the call, the VAD's silence included;

and from the server side, through each session driver's observer (``SessionDriver.observer``,
wrapped around the metrics observer): the decider's own time (``ToolDecision.elapsed_ms``) for the
call and for the answer, the call and the filler at the Session (``input_audio_buffer.committed``
-> arguments done / filler's first audio delta, as the events leave the Session), and whether the
duplex units keep up with real time: the engine's per-unit ``UnitTimings.total_ms`` (submit ->
the unit's last output) and the most units submitted and not yet decided in any session
(the ``duplexkit_units_behind_max`` gauge): real time = unit p90 < 1000 ms and at most 2 behind.

Models: ``scripted`` (torch-free; ``--unit-delay-ms`` simulates engine compute per unit), ``tiny``,
a checkpoint path, or ``random-real`` / ``random-tiny`` (MiniCPM-o 4.5 with random weights at real /
tiny size on ``--device``, built like ``e2e_latency.py`` does; ``--engine-process``).

Examples::

    python benchmarks/tools_latency.py --model scripted --sessions 1 --turns 2
    python benchmarks/tools_latency.py --model tiny --sessions 1 --turns 3
    python benchmarks/tools_latency.py --model random-real --device cuda --sessions 1,32 --turns 3 --level-warmup \\
        --json tools.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _cli import int_list, no_nan, non_negative_float, positive_int  # noqa: E402
from _realtime import CHUNK, FIX, SR, Inbox, Mic, delta_of, error_kinds, is_type, pct, speech_edges  # noqa: E402
from _realtime import stop_server, wait_idle  # noqa: E402

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "the city's name", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
NO_CALL = ("tool_decision_timeout", "tool_decision_failed", "tool_call_invalid", "tool_call_dropped")
OUTPUT = json.dumps({"temperature": 21, "unit": "celsius", "condition": "sunny"})

# metric key -> label (the table's rows, in order)
CLIENT_METRICS = {
    "call": "call      end of turn -> call issued (arguments.done)",
    "filler": "filler    end of turn -> first filler audio",
    "answer": "answer    output sent -> first answer audio",
    "answer_free": "answer    later of output sent, filler done -> audio",
    "eos_call": "eos_call  end of speech (acoustic) -> call",
}
SERVER_METRICS = {
    "decide_call": "decider   call (ToolDecision.elapsed_ms)",
    "decide_answer": "decider   answer (ToolDecision.elapsed_ms)",
    "session_call": "Session   committed -> call issued",
    "session_filler": "Session   committed -> first filler audio",
    "unit_ms": "units     engine per unit (UnitTimings total_ms)",
}
TARGETS = {  # on one H200 (docs/benchmarks.md, "Tools latency")
    "call": "p50 <= 500 at 1 session",
    "filler": "p50 <= 300 at 1 session",
    "answer": "p50 <= 400 after the output arrives",
    "answer_free": "p50 <= 400 (the filler not waited for)",
    "unit_ms": "p90 < 1000 at 32 sessions",
    "behind": "<= 2 at 32 sessions",
    "real_time": "yes at 32 sessions",
}
REAL_TIME_UNIT_MS = 1000.0
REAL_TIME_BEHIND = 2


class Collector:
    """What the sessions' driver observers saw, for one level (the server thread appends; the
    main thread reads between levels)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.data: dict = {k: [] for k in SERVER_METRICS}
        self.behind_max = 0
        self.units = 0


class BenchObserver:
    """A ``SessionDriver.observer`` that records the tool and unit timings of one session and
    forwards every call to the server's own (metrics) observer."""

    def __init__(self, inner, col: Collector) -> None:
        self.inner = inner
        self.col = col
        self.kind: dict = {}  # DecideTools request id -> "call" | "answer"
        self.submitted = -1
        self.decided = -1
        self.committed: Optional[float] = None
        self.filler_ids: set = set()
        self.filler_seen = False

    def __getattr__(self, name):  # anything else the server asks of its observer
        return getattr(self.inner, name)

    def engine_command(self, cmd) -> None:
        if self.inner is not None:
            self.inner.engine_command(cmd)
        kind = type(cmd).__name__
        if kind == "DecideTools":
            self.kind[cmd.request_id] = "answer" if cmd.tool_choice == "none" else "call"
        elif kind == "AppendUnit":
            self.submitted = max(self.submitted, cmd.unit_index)
            self.col.behind_max = max(self.col.behind_max, self.submitted - self.decided)

    def engine_output(self, out) -> None:
        if self.inner is not None:
            self.inner.engine_output(out)
        kind = type(out).__name__
        if kind == "ToolDecision":
            k = self.kind.pop(out.request_id, "call")
            self.col.data["decide_" + k].append(float(out.elapsed_ms))
        elif kind == "Decision":
            self.decided = max(self.decided, out.unit_index)
        elif kind == "UnitTimings" and "total_ms" in (out.timings or {}):
            self.col.data["unit_ms"].append(float(out.timings["total_ms"]))
            self.col.units += 1

    def server_event(self, ev: dict) -> None:
        if self.inner is not None:
            self.inner.server_event(ev)
        t, now = ev.get("type"), time.perf_counter()
        if t == "input_audio_buffer.committed":
            self.committed, self.filler_seen = now, False
        elif t == "response.function_call_arguments.done" and self.committed is not None:
            self.col.data["session_call"].append((now - self.committed) * 1000)
        elif t == "response.created" and (ev.get("response") or {}).get("trigger") == "filler":
            self.filler_ids.add(ev["response"]["id"])
        elif (t == "response.output_audio.delta" and ev.get("response_id") in self.filler_ids
              and not self.filler_seen and self.committed is not None):
            self.filler_seen = True
            self.col.data["session_filler"].append((now - self.committed) * 1000)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def install_observer(server, col: Collector) -> None:
    """Every realtime session's driver gets a :class:`BenchObserver` (the server sets
    ``driver.observer = state.metrics.session_observer()``; the metrics keep working through it)."""
    metrics = server.duplexkit_state.metrics
    if metrics is None:
        raise SystemExit("the server's metrics are off (prometheus-client missing?): the driver observer "
                         "this benchmark hooks into is made by them")
    make = metrics.session_observer
    metrics.session_observer = lambda: BenchObserver(make(), col)


async def _session(url: str, k: int, turns: int, res: dict, question, a, phase: list) -> None:
    """One client: ``turns`` user turns, each calling the tool (``phase[0]`` names the wait in progress)."""
    import websockets

    q_end = speech_edges(question)[1]
    vad = a.commit == "vad"
    async with websockets.connect(url + "/v1/realtime?duplex=1", max_size=None) as ws:
        inbox = Inbox(ws)
        warnings: list = []

        def note_warning(e) -> bool:  # a waiter that never resolves: it only keeps the warnings
            if e["type"] == "session.warning":
                warnings.append(e)
            return False

        inbox.waiters.append((note_warning, asyncio.get_running_loop().create_future()))
        rx = asyncio.create_task(inbox.run())
        mic: Optional[Mic] = None
        tx = None

        async def wait(fut, what: str):
            phase[0] = what
            return await asyncio.wait_for(fut, a.timeout)

        async def idle() -> None:
            """Cancel whatever response is still active (the answer's tail, a response the model began)."""
            while inbox.active:
                done = inbox.expect(is_type("response.done"))
                await ws.send(json.dumps({"type": "response.cancel"}))
                await wait(done, "response.done after response.cancel")

        try:
            await wait(inbox.expect(is_type("session.created")), "session.created")
            td = ({"type": "server_vad", "create_response": True, "interrupt_response": True,
                   "silence_duration_ms": a.silence_ms} if vad else None)
            upd = inbox.expect(is_type("session.updated"))
            await ws.send(json.dumps({"type": "session.update", "session": {
                "tools": [TOOL], "tool_choice": "required", "turn_detection": td}}))
            await wait(upd, "session.updated")
            mic = Mic(ws)
            tx = asyncio.create_task(mic.run())
            await asyncio.sleep(0.5)
            for turn in range(turns):
                await idle()
                t_say = time.perf_counter()

                def created_after(rid) -> bool:
                    return rid in inbox.created and inbox.created[rid][0] >= t_say

                stopped = inbox.expect(is_type("input_audio_buffer.speech_stopped")) if vad else None
                call = inbox.expect(is_type("response.function_call_arguments.done"))
                filler_first = inbox.expect(lambda e: e["type"] == "response.output_audio.delta"
                                            and inbox.trigger.get(e["response_id"]) == "filler"
                                            and created_after(e["response_id"]))
                filler_done = inbox.expect(lambda e: e["type"] == "response.done"
                                           and e["response"].get("trigger") == "filler"
                                           and created_after(e["response"]["id"]))
                mic.say(question)
                if vad:
                    _, t_end = await wait(stopped, f"turn {turn}: speech_stopped")
                else:
                    await wait(mic.done.wait(), f"turn {turn}: the speech sent")
                    t_end = time.perf_counter()
                    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                phase[0] = f"turn {turn}: response.function_call_arguments.done"
                no_call = inbox.expect(lambda e: e["type"] == "session.warning" and e.get("code") in NO_CALL)
                await asyncio.wait({call, no_call}, timeout=a.timeout, return_when=asyncio.FIRST_COMPLETED)
                if not call.done() and no_call.done():
                    # the decider timed out, failed or its call was dropped: no call this turn (counted);
                    # the model answers by itself, which the next turn's idle() cancels
                    res["missed"].append(no_call.result()[0]["code"])
                    stale = (call, filler_first, filler_done, no_call)
                    inbox.waiters = [w for w in inbox.waiters if w[1] not in stale]
                    await wait(mic.done.wait(), f"turn {turn}: the speech sent")
                    await asyncio.sleep(0.5)
                    continue
                inbox.waiters = [w for w in inbox.waiters if w[1] is not no_call]
                ev, t_call = await wait(call, phase[0])
                res["call"].append((t_call - t_end) * 1000)
                q_chunk = (q_end - 1) // CHUNK * CHUNK + CHUNK
                if vad and q_chunk in mic.sent_at:
                    res["eos_call"].append((t_call - mic.spoken_at(q_end - 1)) * 1000)
                if a.tool_ms > 0:
                    await asyncio.sleep(a.tool_ms / 1000)
                tag = f"tools-{k}-{turn}-{time.perf_counter_ns()}"
                ans_first = inbox.expect(delta_of(inbox, lambda t, md: md.get("bench") == tag))
                ans_done = inbox.expect(lambda e: e["type"] == "response.done"
                                        and (e["response"].get("metadata") or {}).get("bench") == tag)
                t_out = time.perf_counter()
                await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                    "type": "function_call_output", "call_id": ev["call_id"], "output": OUTPUT}}))
                await ws.send(json.dumps({"type": "response.create", "response": {"metadata": {"bench": tag}}}))
                _, t_fill = await wait(filler_first, f"turn {turn}: the filler's first audio")
                res["filler"].append((t_fill - t_end) * 1000)
                _, t_ans = await wait(ans_first, f"turn {turn}: the answer's first audio")
                res["answer"].append((t_ans - t_out) * 1000)
                _, t_fdone = await wait(filler_done, f"turn {turn}: the filler's response.done")
                res["answer_free"].append((t_ans - max(t_out, t_fdone)) * 1000)
                await ws.send(json.dumps({"type": "response.cancel"}))
                await wait(ans_done, f"turn {turn}: the answer's response.done")
                await wait(mic.done.wait(), f"turn {turn}: the speech sent")
                await asyncio.sleep(0.5)
        finally:
            for t in (tx, rx):
                if t is not None:
                    t.cancel()
            res["errors"] += inbox.errors
            res["warnings"] += [w.get("code") for w in warnings]
            for w in warnings:  # the first message of each code, for the report
                res["warning_text"].setdefault(w.get("code"), str(w.get("message"))[:300])


async def run_level(url: str, n: int, turns: int, a) -> dict:
    from duplexkit.audio import read_wav

    question = read_wav(FIX / "question_16k.wav", SR)[0]
    res: dict = {k: [] for k in CLIENT_METRICS}
    res.update(errors=[], warnings=[], missed=[], warning_text={})

    async def one(k: int) -> None:
        await asyncio.sleep(k / max(1, n))  # turn ends spread over one unit (users do not stop in step)
        phase = [""]
        try:
            await _session(url, k, turns, res, question, a, phase)
        except asyncio.TimeoutError:
            res["errors"].append({"session": k, "timeout": f"no {phase[0]} within {a.timeout} s"})
        except Exception as exc:  # noqa: BLE001 - e.g. the server closed the socket: report, go on
            res["errors"].append({"session": k, "timeout": f"{type(exc).__name__} while waiting for {phase[0]}: "
                                                           f"{str(exc)[:300]}"})

    await asyncio.gather(*[one(k) for k in range(n)])
    return res


def summarize(res: dict, col: Collector) -> dict:
    """p50 / p90 / n per metric, the most units behind and the real-time verdict."""
    data = {**{k: res[k] for k in CLIENT_METRICS}, **col.data}
    out = {"summary": {k: {"p50": pct(v, 50), "p90": pct(v, 90), "n": len(v)} for k, v in data.items()},
           "samples": data, "units_behind_max": col.behind_max}
    u90 = out["summary"]["unit_ms"]["p90"]
    out["real_time"] = bool(col.units) and u90 < REAL_TIME_UNIT_MS and col.behind_max <= REAL_TIME_BEHIND
    return out


def _cell(s: dict) -> str:
    if not s["n"]:
        return "-"
    return f"{s['p50']:.0f} / {s['p90']:.0f} ({s['n']})"


def print_table(rows: list, header: str) -> None:
    """Rows are metrics, columns the session counts (p50 / p90 (samples), ms), then the target."""
    w = max(len(x) for x in (*CLIENT_METRICS.values(), *SERVER_METRICS.values()))
    cols = [f"{n} session{'s' if n > 1 else ''}" for n, _ in rows]
    cw = max([20] + [len(c) for c in cols])
    print(header)
    hdr = f"{'metric (ms, p50 / p90 (n))':<{w}} | " + " | ".join(f"{c:>{cw}}" for c in cols) + " | target (one H200)"
    print(hdr)
    print("-" * len(hdr))
    for key, label in {**CLIENT_METRICS, **SERVER_METRICS}.items():
        cells = [_cell(r["summary"][key]) for _, r in rows]
        if key == "eos_call" and all(c == "-" for c in cells):
            continue
        print(f"{label:<{w}} | " + " | ".join(f"{c:>{cw}}" for c in cells) + f" | {TARGETS.get(key, '')}")
    print(f"{'units     most units behind (any session)':<{w}} | "
          + " | ".join(f"{r['units_behind_max']:>{cw}}" for _, r in rows) + f" | {TARGETS['behind']}")
    print(f"{'real time (unit p90 < 1000 ms, <= 2 behind)':<{w}} | "
          + " | ".join(f"{'yes' if r['real_time'] else 'NO':>{cw}}" for _, r in rows) + f" | {TARGETS['real_time']}")
    print(f"{'turns without a call (decider timeout/failure)':<{w}} | "
          + " | ".join(f"{len(r['missed']):>{cw}}" for _, r in rows) + " | 0")
    print(f"{'errors / warnings':<{w}} | "
          + " | ".join(f"{str(len(r['errors'])) + ' / ' + str(len(r['warnings'])):>{cw}}" for _, r in rows) + " | 0 / 0")
    sys.stdout.flush()


def device_label(server, a) -> str:
    """Where the engine runs: the thinker's device (and the GPU's name), and this machine's cores."""
    cores = f"{os.cpu_count()} CPU cores"
    if a.model == "scripted":
        return f"cpu (scripted engine, no model; {cores})"
    dev = a.device if a.model.startswith("random-") else None
    layout = getattr(server.duplexkit_state.engine, "layout", None)
    if layout is not None:
        dev = layout.stages["thinker"].device
    dev = dev or "?"
    if dev.startswith("cuda"):
        try:
            import torch

            return f"{dev} ({torch.cuda.get_device_name(torch.device(dev))}; {cores})"
        except Exception:  # noqa: BLE001 - the name is a nicety
            pass
    return f"{dev} ({cores})"


def start(a, max_sessions: int):
    """The in-process server for ``a.model`` (the same builders as e2e_latency.py)."""
    from e2e_latency import _start_local, _start_random

    if a.model.startswith("random-"):
        return _start_random(a, max_sessions)
    return _start_local(a, max_sessions)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Examples:\n" + __doc__.split("Examples::\n")[1])
    ap.add_argument("--model", default="scripted", help="scripted | tiny | <checkpoint dir> | random-real | random-tiny")
    ap.add_argument("--device", default="cuda", help="random-*: torch device (cpu for a smoke run)")
    ap.add_argument("--sessions", type=int_list, default=[1], help="comma list of concurrency levels (e.g. 1,32)")
    ap.add_argument("--turns", type=positive_int, default=3, help="user turns (each calls the tool) per session")
    ap.add_argument("--commit", choices=("vad", "client"), default="vad",
                    help="what ends the user's turn: the server VAD (create_response true) or a client commit")
    ap.add_argument("--silence-ms", type=positive_int, default=500, help="--commit vad: silence_duration_ms")
    ap.add_argument("--tool-ms", type=non_negative_float, default=0.0,
                    help="the tool's run time: the output is sent this long after the call (0: at once)")
    ap.add_argument("--warmup-turns", type=int, default=1,
                    help="turns of one session first, reported apart as the cold start, not counted")
    ap.add_argument("--level-warmup", action="store_true",
                    help="before each level of more than one session, one turn at that concurrency, not counted "
                         "(lazily built kernels and graph buckets of a batch size are paid the first time it is met)")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-wait timeout, s")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results (and the samples) as JSON here")
    ap.add_argument("--unit-delay-ms", type=non_negative_float, default=0.0,
                    help="scripted: simulated engine compute per unit")
    ap.add_argument("--tokens", default="19", help="random-*: decided tokens per speaking unit")
    ap.add_argument("--code2wav-dtype", choices=("float32", "float16"), default="float32",
                    help="random-*: the Code2Wav flow's dtype")
    ap.add_argument("--tokenizer-dir", default=None, metavar="DIR",
                    help="random-real: a checkpoint's tokenizer files (the real MiniCPM-o 4.5 tokenizer), so the "
                         "call, the filler and the answer cost as many tokens as with the released model "
                         "(default: the tiny builder's small BPE)")
    ap.add_argument("--no-warm-turn", action="store_true", help="random-* on CUDA: skip the engine's warm-up turn")
    ap.add_argument("--engine-process", action="store_true",
                    help="random-*: the engine in its own process (as `duplexkit serve` runs it)")
    a = ap.parse_args(argv)
    if a.tokenizer_dir and a.model != "random-real":
        ap.error("--tokenizer-dir needs --model random-real")
    levels = a.sessions
    server, url = start(a, max(levels))
    col = Collector()
    install_observer(server, col)
    device = device_label(server, a)
    turn_end = (f"server VAD, silence_duration_ms {a.silence_ms}; end of turn = speech_stopped received"
                if a.commit == "vad" else "client commit; end of turn = commit sent")
    tok = f" (tokenizer {a.tokenizer_dir})" if a.tokenizer_dir else ""
    header = (f"tools latency: model {a.model}{tok}, device {device}\n  {turn_end}; tool {TOOL['name']!r}, tool_choice "
              f"required; output sent {a.tool_ms:.0f} ms after the call; {a.turns} turn(s) per session")
    rows: list = []
    cold = None
    try:
        if a.warmup_turns > 0:
            col.reset()
            w = asyncio.run(run_level(url, 1, a.warmup_turns, a))
            cold = summarize(w, col)
            cold["errors"] = dict(error_kinds(w["errors"]))
            print(f"cold start ({a.warmup_turns} turn(s) of one session, not counted): call "
                  f"{[round(x) for x in w['call']]} ms, filler {[round(x) for x in w['filler']]} ms, answer "
                  f"{[round(x) for x in w['answer']]} ms, errors {len(w['errors'])}", flush=True)
        for n in levels:
            t = time.perf_counter()
            wait_idle(url)
            if a.level_warmup and n > 1:
                w = asyncio.run(run_level(url, n, 1, a))
                wait_idle(url)
                print(f"level {n} warm-up turn (not counted): call p50 {pct(w['call'], 50):.0f} ms, filler p50 "
                      f"{pct(w['filler'], 50):.0f} ms, errors {len(w['errors'])}", flush=True)
            col.reset()
            r = asyncio.run(run_level(url, n, a.turns, a))
            wait_idle(url)
            s = summarize(r, col)
            s["errors"], s["warnings"], s["missed"] = r["errors"], r["warnings"], r["missed"]
            s["warning_text"] = r["warning_text"]
            rows.append((n, s))
            print(f"level {n}: {time.perf_counter() - t:.0f} s, {len(r['call'])} calls, {len(r['answer'])} answers, "
                  f"{col.units} units, turns without a call {len(r['missed'])}, errors {len(r['errors'])}, "
                  f"warnings {len(r['warnings'])}",
                  flush=True)
            for kind, count in error_kinds(r["errors"]).most_common():
                print(f"  error x{count}: {kind}", flush=True)
            for code in sorted(set(r["warnings"]), key=str):
                print(f"  session.warning x{r['warnings'].count(code)}: {code}: {r['warning_text'].get(code)}",
                      flush=True)
    finally:
        stop_server(server)
    print()
    print_table(rows, header)
    if a.json:
        out = {"model": a.model, "tokenizer_dir": a.tokenizer_dir, "device": device, "commit": a.commit,
               "silence_ms": a.silence_ms, "tool_ms": a.tool_ms, "turns": a.turns, "tool": TOOL, "targets": TARGETS,
               "cold_start": cold,
               "levels": [{"sessions": n, **{k: v for k, v in s.items() if k not in ("errors", "warnings")},
                           "errors": dict(error_kinds(s["errors"])), "warnings": s["warnings"]} for n, s in rows]}
        Path(a.json).write_text(json.dumps(no_nan(out), indent=1, allow_nan=False))
    failed = any(not s["summary"]["call"]["n"] for _, s in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
