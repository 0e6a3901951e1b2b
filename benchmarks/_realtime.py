"""Client and server pieces shared by the end-to-end benchmarks (``e2e_latency.py``,
``tools_latency.py``): a microphone that paces the fixture speech in real time, a reader of server
events, percentiles, and the real server served in this process (not a benchmark: ``duplexkit bench``
lists only scripts whose names do not start with ``_``)."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures" / "audio"
SR = 16000
CHUNK = 1600  # 100 ms appends
FLOOR = 10 ** (-50 / 20)


def speech_edges(x: np.ndarray) -> tuple[int, int]:
    """First and last sample of the 10 ms blocks at or above -50 dBFS (the VAD floor at 0.5)."""
    nb = x.size // 160
    e = np.sqrt(np.mean(np.square(x[: nb * 160].reshape(nb, 160), dtype=np.float64), axis=1))
    hit = np.nonzero(e >= FLOOR)[0]
    return int(hit[0]) * 160, (int(hit[-1]) + 1) * 160


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


class Mic:
    """Sends 100 ms appends paced in real time; silence unless an utterance is queued."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.queue: list[np.ndarray] = []
        self.sent_at: dict[int, float] = {}  # utterance sample index (chunk end) -> send time
        self._cur: np.ndarray | None = None
        self._pos = 0
        self.done = asyncio.Event()

    def say(self, x: np.ndarray) -> asyncio.Event:
        self._cur, self._pos, self.sent_at = x, 0, {}
        self.done = asyncio.Event()
        return self.done

    def spoken_at(self, s: int) -> float:
        """Wall time the sample ``s`` of the current utterance was 'spoken' (sent in real time)."""
        end = (s // CHUNK + 1) * CHUNK
        return self.sent_at[end] - (end - s) / SR

    async def run(self) -> None:
        t0 = time.perf_counter()
        k = 0
        while True:
            if self._cur is not None:
                x = self._cur[self._pos: self._pos + CHUNK]
                self._pos += CHUNK
                if x.size < CHUNK:
                    x = np.concatenate([x, np.zeros(CHUNK - x.size, np.float32)])
            else:
                x = np.zeros(CHUNK, np.float32)
            await self.ws.send(json.dumps({"type": "input_audio_buffer.append",
                                           "audio": base64.b64encode(pcm16(x)).decode()}))
            if self._cur is not None:
                self.sent_at[self._pos] = time.perf_counter()
                if self._pos >= self._cur.size:
                    self._cur = None
                    self.done.set()
            k += 1
            await asyncio.sleep(max(0.0, t0 + k * CHUNK / SR - time.perf_counter()))


class Inbox:
    """Reads server events; ``wait(pred)`` returns (event, receive time) of the next match."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.waiters: list = []
        self.errors: list = []
        self.created: dict = {}  # response id -> (receive time, response metadata)
        self.trigger: dict = {}  # response id -> its trigger (duplexkit: client, server_vad, tool, filler, ...)
        self.active: set = set()  # responses created and not yet done

    async def run(self) -> None:
        async for raw in self.ws:
            t = time.perf_counter()
            ev = json.loads(raw)
            ev["_t"] = t  # receive time
            if ev["type"] == "error" and ev["error"].get("code") != "response_not_active":
                self.errors.append(ev)
            if ev["type"] == "response.created":
                self.created[ev["response"]["id"]] = (t, ev["response"].get("metadata") or {})
                self.trigger[ev["response"]["id"]] = ev["response"].get("trigger")
                self.active.add(ev["response"]["id"])
            elif ev["type"] == "response.done":
                self.active.discard(ev["response"]["id"])
            for w in list(self.waiters):
                pred, fut = w
                if not fut.done() and pred(ev):
                    fut.set_result((ev, t))
                    if w in self.waiters:
                        self.waiters.remove(w)

    def expect(self, pred) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append((pred, fut))
        return fut


def is_type(t: str):
    return lambda e: e["type"] == t


def delta_of(inbox: Inbox, match):
    """First audio delta of a response whose ``response.created`` satisfies ``match(t, metadata)``
    (a late delta of an earlier response never counts)."""
    def pred(e) -> bool:
        if e["type"] != "response.output_audio.delta" or e["response_id"] not in inbox.created:
            return False
        return match(*inbox.created[e["response_id"]])
    return pred


def error_kinds(errors: list):
    """Counter of error kinds: the server's ``error.code: message`` or the client-side timeout text."""
    from collections import Counter

    def kind(e: dict) -> str:
        if "timeout" in e:
            return "client timeout: " + e["timeout"][:160]
        err = e.get("error") or {}
        return f"server error {err.get('code')}: {str(err.get('message'))[:160]}"

    return Counter(kind(e) for e in errors)


def pct(v: list, q: float) -> float:
    return float(np.percentile(v, q)) if v else float("nan")


def wait_idle(url: str, timeout: float = 120.0) -> float:
    """Wait until the server holds no session slot (``/health`` ``sessions_active`` 0): a closed
    session keeps its slot until its engine stream has closed, so a level that starts right after
    the previous one could be refused with ``session_capacity_exhausted``. Returns the seconds waited."""
    import httpx

    base = url.replace("ws://", "http://").replace("wss://", "https://")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            if httpx.get(base + "/health", timeout=5).json().get("sessions_active", 0) == 0:
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_inprocess(engine, max_sessions: int):
    """Serve ``engine`` with create_app + uvicorn on a thread of this process. The returned server's
    ``duplexkit_state`` is the app's ``ServerState`` (its ``metrics`` make each session's driver
    observer); stop it with :func:`stop_server`."""
    import uvicorn

    from duplexkit_server import ServerSettings, create_app

    app = create_app(engine, ServerSettings(max_sessions=max_sessions + 2, answer_policy="on_request",
                                            max_output_tokens=200, max_sessions_per_client=0))  # one address
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    server.duplexkit_thread = th  # joined at the end, after the app's shutdown has closed the engine
    server.duplexkit_state = app.state.duplexkit
    while not server.started:
        time.sleep(0.1)
    return server, f"ws://127.0.0.1:{port}"


def stop_server(server) -> None:
    """Stop a :func:`serve_inprocess` server: let uvicorn run the app's shutdown (sessions closed,
    engine closed) and join its thread. Leaving the process with the engine's threads still in
    torch/onnxruntime calls ended it with SIGABRT ("terminate called without an active exception",
    exit 134)."""
    server.should_exit = True
    th = getattr(server, "duplexkit_thread", None)
    if th is not None:
        th.join(120)
