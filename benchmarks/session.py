"""Session throughput for a typical spoken turn, with no engine: how much a connection's conversation
logic costs, apart from the model.

Usage: python benchmarks/session.py [--repeat 20] [--fixture tests/fixtures/audio/question_16k.wav]
       (or ``duplexkit bench session``)

One turn = real speech (question_16k.wav, 3.54 s, 16 kHz pcm16) appended as JSON text frames in
20 ms or 100 ms chunks (a clock tick after each), ``input_audio_buffer.commit``, ``response.create``,
scripted engine outputs of a 3-unit answer (speak decision, per unit a TextDelta and a 1 s
AudioChunk at 24 kHz, TurnEnd) and three ``playback.ack``. Frames are JSON-encoded outside the timed
region; parsing them is timed (the server hands the Session text frames). Each scenario runs on a
fresh Session ``--repeat`` times; the table shows the median.

Columns: client events (frames in), server events (out), engine commands (out), total µs for the
turn, µs/event = total / client events, events/s = client events per second of Session time.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from duplexkit.audio import read_wav  # noqa: E402
from duplexkit.engine.api import AudioChunk, Decision, EngineCommand, TextDelta, TurnEnd  # noqa: E402
from duplexkit.session import Session, SessionConfig  # noqa: E402

ANSWER = ("It is sunny ", "in Paris ", "today.")


def _frames(x: np.ndarray, chunk_ms: int) -> list[str]:
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
    n = 32 * chunk_ms  # bytes per chunk at 16 kHz pcm16
    return [json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + n]).decode()})
            for i in range(0, len(pcm), n)]


def run_turn(frames: list[str], chunk_ms: int, vad: bool, answer_audio: list[np.ndarray]) -> tuple[float, int, int, int]:
    """One turn on a fresh Session. Returns (seconds, client events, server events, engine commands)."""
    s = Session(SessionConfig(), now_ms=0)
    n_client = n_server = n_cmd = 0

    def drain() -> list:
        nonlocal n_server, n_cmd
        out = s.drain()
        for o in out:
            if isinstance(o, dict):
                n_server += 1
            elif isinstance(o, EngineCommand):
                n_cmd += 1
        return out

    t0 = time.perf_counter()
    s.start(0)
    drain()
    t = 0
    if not vad:
        s.receive_client_event('{"type":"session.update","session":{"turn_detection":null}}', t)
        n_client += 1
        drain()
    for f in frames:
        s.receive_client_event(f, t)
        t += chunk_ms
        s.tick(t)
        n_client += 1
        drain()
    for f in ('{"type":"input_audio_buffer.commit"}', '{"type":"response.create"}'):
        s.receive_client_event(f, t)
        n_client += 1
        drain()
    sid, e = s.stream_id, s.epoch
    unit = s._units_appended  # the forced unit's index: the next one the engine decides
    s.receive_engine_output(Decision(sid, e, unit, decision="speak", turn_start=True), t)
    drain()
    for i, (text, audio) in enumerate(zip(ANSWER, answer_audio)):
        s.receive_engine_output(TextDelta(sid, e, unit + i, text=text, n_tokens=3), t)
        s.receive_engine_output(AudioChunk(sid, e, unit + i, audio=audio, text=text, final=i == len(ANSWER) - 1), t)
        drain()
    s.receive_engine_output(TurnEnd(sid, e, unit + len(ANSWER)), t)
    out = drain()
    rid = next(o["response"]["id"] for o in out if isinstance(o, dict) and o["type"] == "response.done")
    for played in (1000, 2000, 3000):
        s.receive_client_event(json.dumps({"type": "playback.ack", "response_id": rid, "played_ms": played}), t)
        n_client += 1
        drain()
    dt = time.perf_counter() - t0
    return dt, n_client, n_server, n_cmd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=20, help="turns per scenario (median reported; default 20)")
    ap.add_argument("--fixture", type=Path, default=ROOT / "tests" / "fixtures" / "audio" / "question_16k.wav")
    args = ap.parse_args()
    if args.fixture.exists():
        x, _ = read_wav(args.fixture, 16000)
        src = args.fixture.name
    else:  # a source-less install: a 3.5 s synthetic voiced signal
        tt = np.arange(int(3.5 * 16000)) / 16000
        x = (0.3 * np.sin(2 * np.pi * 180 * tt) * (1 + np.sin(2 * np.pi * 3 * tt)) / 2).astype(np.float32)
        src = "synthetic 3.5 s"
    rng = np.random.default_rng(0)
    answer_audio = [(0.1 * rng.standard_normal(24000)).astype(np.float32) for _ in ANSWER]

    print(f"Session throughput, one spoken turn ({src}, {len(x) / 16000:.2f} s), no engine; median of {args.repeat}")
    hdr = f"{'scenario':<26} {'client events':>13} {'server events':>13} {'engine commands':>15} " \
          f"{'total µs':>10} {'µs/event':>9} {'events/s':>9}"
    print(hdr)
    print("-" * len(hdr))
    for chunk_ms in (20, 100):
        frames = _frames(x, chunk_ms)
        for vad in (True, False):
            run_turn(frames, chunk_ms, vad, answer_audio)  # warm-up
            runs = [run_turn(frames, chunk_ms, vad, answer_audio) for _ in range(args.repeat)]
            dt = statistics.median(r[0] for r in runs)
            _, nc, ns, ncmd = runs[0]
            name = f"{chunk_ms} ms appends, VAD {'on' if vad else 'off'}"
            print(f"{name:<26} {nc:>13} {ns:>13} {ncmd:>15} {dt * 1e6:>10.0f} {dt * 1e6 / nc:>9.1f} {nc / dt:>9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
