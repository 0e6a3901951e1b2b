"""The latency ``DuplexkitLLMService`` adds over the raw duplexkit client (docs/integrations.md,
"Pipecat"). Run with the frameworks venv's python (scripts/setup_frameworks.sh), from the repo root:

    PYTHONPATH=. .venv-frameworks/bin/python tests/e2e/_pipecat_plug_latency.py --trials 7

Inline, the scripted engine (``ScriptedEngine()``: no compute, so only the plumbing is timed), one
process, the two paths alternating trial by trial, a fresh session each trial:

* **opening answer, request -> first audio**: raw: ``client.create_response()`` called -> the first
  ``response.output_audio.delta`` read from ``client.events()``; plug: ``LLMRunFrame`` queued into
  the pipeline (user aggregator -> service -> recorder) -> the first ``TTSAudioRawFrame`` at the
  recorder right after the service.
* **input hop**: an ``InputAudioRawFrame`` (20 ms, 16 kHz) queued into the pipeline -> the service
  calling ``client.send_audio`` with it (the raw client has no such hop), over question_16k.wav
  pushed in real time.

Prints medians and ranges (ms) and a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from loguru import logger

from pipecat.frames.frames import EndFrame, InputAudioRawFrame, LLMRunFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.workers.runner import WorkerRunner

sys.path.insert(0, str(Path(__file__).parent))
from _pipecat_plug_flows import CHUNK_S, Clock, Recorder, read_pcm16  # noqa: E402

from duplexkit.clients import InlineDuplexClient  # noqa: E402
from duplexkit.integrations.pipecat import DuplexkitLLMService  # noqa: E402
from duplexkit.testing import ScriptedEngine  # noqa: E402

WAV = Path(__file__).resolve().parents[1] / "fixtures" / "audio" / "question_16k.wav"


async def raw_trial(engine) -> float:
    """ms from create_response() called to the first audio delta read from events()."""
    async with InlineDuplexClient(engine, session={"audio": {"input": {"transcription": None}}}) as client:
        first = asyncio.get_running_loop().create_future()

        async def read() -> None:
            async for ev in client.events():
                if ev.type == "response.output_audio.delta" and not first.done():
                    first.set_result(time.perf_counter())

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        await client.create_response()
        t1 = await asyncio.wait_for(first, 10)
        reader.cancel()
        return (t1 - t0) * 1000


async def plug_trial(engine, feed_wav: bool) -> tuple:
    """(ms from LLMRunFrame queued to the first TTSAudioRawFrame after the service, [input hops ms])."""
    clock = Clock()
    svc = DuplexkitLLMService(engine=engine, transcription=None)
    user_agg, assistant_agg = LLMContextAggregatorPair(LLMContext([]))
    rec = Recorder(clock, "down")
    worker = PipelineWorker(Pipeline([user_agg, svc, rec, assistant_agg]), params=PipelineParams(),
                            idle_timeout_secs=None)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    task = asyncio.create_task(runner.run())
    while svc.client is None:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    t0 = time.perf_counter()
    await worker.queue_frame(LLMRunFrame())  # the opening answer (before the user spoke)
    deadline = time.monotonic() + 10
    while rec.first_audio_t is None:
        if time.monotonic() > deadline:
            raise TimeoutError("no audio from the plug")
        await asyncio.sleep(0.0005)
    ms = (rec.first_audio_t - t0) * 1000
    hops: list = []
    queued: dict = {}
    if feed_wav:  # then the user speaks: time each frame from the queue to the client call
        send = svc.client.send_audio

        async def timed_send(audio, *, rate=None):
            t = queued.pop(id(audio), None) if isinstance(audio, bytes) else None
            if t is not None:
                hops.append((time.perf_counter() - t) * 1000)
            await send(audio, rate=rate)

        svc.client.send_audio = timed_send
        pcm, rate = read_pcm16(WAV)
        step = int(rate * CHUNK_S) * 2
        for i in range(0, len(pcm), step):
            frame = InputAudioRawFrame(audio=pcm[i:i + step], sample_rate=rate, num_channels=1)
            queued[id(frame.audio)] = time.perf_counter()
            await worker.queue_frame(frame)
            await asyncio.sleep(CHUNK_S)
        await asyncio.sleep(0.2)
    await worker.queue_frame(EndFrame())
    await asyncio.wait_for(task, 20)
    return ms, hops


async def main(trials: int) -> dict:
    engine = ScriptedEngine()
    raw, plug, hops = [], [], []
    for i in range(trials):
        raw.append(await raw_trial(engine))
        ms, h = await plug_trial(engine, feed_wav=True)
        plug.append(ms)
        hops += h
    await engine.aclose()
    return {"trials": trials, "raw_request_to_first_audio_ms": raw, "plug_request_to_first_audio_ms": plug,
            "input_hop_ms_n": len(hops), "input_hop_ms_median": statistics.median(hops),
            "input_hop_ms_p90": sorted(hops)[int(0.9 * len(hops))], "input_hop_ms_max": max(hops)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=7)
    args = ap.parse_args()
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    r = asyncio.run(main(args.trials))
    med = statistics.median
    raw, plug = r["raw_request_to_first_audio_ms"], r["plug_request_to_first_audio_ms"]
    print(f"request -> first audio, n={r['trials']} each: raw client median {med(raw):.2f} ms "
          f"(range {min(raw):.2f}-{max(raw):.2f}); plug median {med(plug):.2f} ms (range {min(plug):.2f}-{max(plug):.2f}); "
          f"added {med(plug) - med(raw):.2f} ms")
    print(f"input hop (InputAudioRawFrame queued -> client.send_audio), n={r['input_hop_ms_n']}: median "
          f"{r['input_hop_ms_median']:.3f} ms, p90 {r['input_hop_ms_p90']:.3f} ms, max {r['input_hop_ms_max']:.3f} ms")
    print(json.dumps(r))
