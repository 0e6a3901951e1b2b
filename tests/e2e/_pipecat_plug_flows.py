"""Flows of ``duplexkit.integrations.pipecat.DuplexkitLLMService`` in a real Pipecat pipeline (run with
the frameworks venv's python, scripts/setup_frameworks.sh; driven by tests/e2e/test_pipecat_plug.py).

The pipeline, as a voice bot has it (no devices)::

    user aggregator -> up recorder -> DuplexkitLLMService -> down recorder -> Speaker -> assistant aggregator

``Speaker`` is a real Pipecat ``BaseOutputTransport`` whose ``write_audio_frame`` plays in real time
(it sleeps each 20 ms chunk's length, as a sound card blocks) and logs what it wrote, so audio the
transport had queued when an ``InterruptionFrame`` came is audibly never written. The recorders log
every frame class with its direction and time. Input is a speech WAV pushed as 20 ms
``InputAudioRawFrame`` s (``--input-rate`` resamples it first: the service resamples back).

Flows (``--flow``):

* ``tool``: the user asks (question_16k.wav), the session's decider calls ``get_weather`` (scripted),
  the handler registered with ``register_function`` runs and its result goes back; the spoken answer
  follows (audio frames + bot transcript). The session transcribes the user's turn.
* ``tool_cancel``: as ``tool``, but the handler takes ``--tool-delay-s`` and the user talks again
  (``--wav2``) while it runs: the call is cancelled (the handler sees ``CancelledError``).
* ``barge_in``: the bot speaks first (``LLMRunFrame``: an 8 s scripted answer, input streamed in
  real time), and the user talks over it after ``--barge-after-s`` of written audio.

``--engine scripted[:k=v,...]`` runs inline (``ScriptConfig`` fields; ``tool_script`` as JSON), or
``--url`` a ``duplexkit serve``. Writes a JSON report to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import traceback
import wave
from pathlib import Path

import numpy as np
from loguru import logger

from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.frames.frames import (
    EndFrame, ErrorFrame, FunctionCallCancelFrame, FunctionCallInProgressFrame, FunctionCallResultFrame, FunctionCallsStartedFrame,
    InputAudioRawFrame, InterruptionFrame, LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMRunFrame,
    OutputAudioRawFrame, TranscriptionFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame, TTSTextFrame,
    UserStartedSpeakingFrame, UserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.llm_service import FunctionCallParams
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams
from pipecat.workers.runner import WorkerRunner

from duplexkit.integrations.pipecat import DuplexkitLLMService

WEATHER = FunctionSchema(
    name="get_weather",
    description="The current weather in a city.",
    properties={"city": {"type": "string", "description": "The city, e.g. Paris."}},
    required=["city"],
)
TOOL_RESULT = {"temperature_c": 21, "conditions": "sunny"}
CHUNK_S = 0.02
LOGGED = (InterruptionFrame, UserStartedSpeakingFrame, UserStoppedSpeakingFrame, TranscriptionFrame,
          TTSStartedFrame, TTSStoppedFrame, LLMFullResponseStartFrame, LLMFullResponseEndFrame,
          FunctionCallsStartedFrame, FunctionCallInProgressFrame, FunctionCallResultFrame, FunctionCallCancelFrame,
          ErrorFrame)


def read_pcm16(path: Path) -> tuple[bytes, int]:
    with wave.open(str(path), "rb") as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        return w.readframes(w.getnframes()), w.getframerate()


def resample_pcm16(pcm: bytes, rate: int, to: int) -> bytes:
    """Linear-interpolation resampling (test input only; the service resamples with soxr)."""
    if rate == to:
        return pcm
    x = np.frombuffer(pcm, "<i2").astype(np.float64)
    n = int(len(x) * to / rate)
    y = np.interp(np.arange(n) * rate / to, np.arange(len(x)), x)
    return np.clip(np.round(y), -32768, 32767).astype("<i2").tobytes()


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 4)


class Recorder(FrameProcessor):
    """Logs the frames passing by (class, direction, time) and groups the bot's audio and transcript
    per response (``TTSAudioRawFrame.context_id``)."""

    def __init__(self, clock: Clock, label: str) -> None:
        super().__init__(name=label)
        self.clock, self.label = clock, label
        self.timeline: list = []
        self.responses: dict = {}  # context_id -> {"audio_bytes", "sample_rates", "text", "t_first", "t_last"}
        self.transcripts: list = []
        self.audio_frames = 0
        self.first_audio_t = None

    def _resp(self, cid) -> dict:
        return self.responses.setdefault(str(cid), {"audio_bytes": 0, "sample_rates": [], "text": "",
                                                    "t_first": None, "t_last": None, "done": False})

    async def process_frame(self, frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        d = "down" if direction == FrameDirection.DOWNSTREAM else "up"
        if isinstance(frame, TTSAudioRawFrame):
            r = self._resp(frame.context_id)
            r["audio_bytes"] += len(frame.audio)
            if frame.sample_rate not in r["sample_rates"]:
                r["sample_rates"].append(frame.sample_rate)
            t = self.clock.now()
            r["t_first"] = r["t_first"] if r["t_first"] is not None else t
            r["t_last"] = t
            self.audio_frames += 1
            if self.first_audio_t is None:
                self.first_audio_t = time.perf_counter()
        elif isinstance(frame, TTSTextFrame):
            self._resp(frame.context_id)["text"] += frame.text
        elif isinstance(frame, TTSStoppedFrame) and direction == FrameDirection.DOWNSTREAM:
            self._resp(frame.context_id)["done"] = True
        elif isinstance(frame, TranscriptionFrame):
            self.transcripts.append({"t": self.clock.now(), "dir": d, "text": frame.text})
        if isinstance(frame, LOGGED):
            entry = [self.clock.now(), d, type(frame).__name__]
            if isinstance(frame, FunctionCallResultFrame):
                entry += [frame.tool_call_id, frame.result]
            elif isinstance(frame, FunctionCallCancelFrame):
                entry += [frame.tool_call_id]
            elif isinstance(frame, ErrorFrame):
                entry += [str(frame.error), bool(frame.fatal)]
            self.timeline.append(entry)
        await self.push_frame(frame, direction)


class Speaker(BaseOutputTransport):
    """An output transport that plays in real time: each written chunk takes its duration."""

    def __init__(self, clock: Clock, rate: int = 24_000) -> None:
        super().__init__(TransportParams(audio_out_enabled=True, audio_out_sample_rate=rate))
        self.clock = clock
        self.writes: list = []  # [t, bytes, frame class] of every write
        self.written = 0  # bytes of the bot's speech (TTSAudioRawFrame) written

    async def start(self, frame):
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        self.writes.append([self.clock.now(), len(frame.audio), type(frame).__name__])
        if isinstance(frame, TTSAudioRawFrame):  # not the transport's own end silence
            self.written += len(frame.audio)
        await asyncio.sleep(len(frame.audio) / 2 / frame.sample_rate / max(1, frame.num_channels))
        return True


def scripted_engine(spec: str):
    """``scripted[:k=v,...]`` -> a ScriptedEngine (values parsed as JSON when they parse)."""
    from duplexkit.testing import ScriptConfig, ScriptedEngine

    kw = {}
    _, _, rest = spec.partition(":")
    for part in filter(None, rest.split(";")):
        k, _, v = part.partition("=")
        try:
            kw[k] = json.loads(v)
        except ValueError:
            kw[k] = v
    if "tool_script" in kw:
        kw["tool_script"] = [tuple(e) if isinstance(e, list) else e for e in kw["tool_script"]]
    return ScriptedEngine(ScriptConfig(**kw))


async def run(args) -> dict:
    clock = Clock()
    calls: list = []
    events: list = []
    items: list = []

    async def get_weather(params: FunctionCallParams) -> None:
        call = {"t": clock.now(), "tool_call_id": params.tool_call_id, "function_name": params.function_name,
                "arguments": dict(params.arguments), "cancelled": False}
        calls.append(call)
        try:
            await asyncio.sleep(args.tool_delay_s)  # a lookup takes a moment
        except asyncio.CancelledError:
            call["cancelled"] = clock.now()
            raise
        await params.result_callback(dict(TOOL_RESULT, city=params.arguments.get("city")))

    engine = scripted_engine(args.engine) if args.engine else None
    svc = DuplexkitLLMService(engine=engine, url=args.url, tools=[WEATHER] if args.flow != "barge_in" else None,
                              instructions="You are a helpful voice assistant.",
                              client_options={"request_timeout_s": args.timeout})
    svc.register_function("get_weather", get_weather)

    @svc.event_handler("on_duplexkit_event")
    async def on_event(_svc, ev):
        t = getattr(ev, "type", "?")
        if t not in ("response.output_audio.delta", "response.output_audio_transcript.delta", "response.listen"):
            events.append([clock.now(), t])
        if t == "conversation.item.input_audio_transcription.completed":
            events[-1].append(ev.transcript)
        if t == "conversation.item.added":
            it = ev.item
            items.append({"t": clock.now(), "type": it.type, "role": getattr(it, "role", None),
                          "call_id": getattr(it, "call_id", None), "output": getattr(it, "output", None)})

    context = LLMContext([])
    user_agg, assistant_agg = LLMContextAggregatorPair(context)
    up, down, speaker = Recorder(clock, "up"), Recorder(clock, "down"), Speaker(clock)
    worker = PipelineWorker(Pipeline([user_agg, up, svc, down, speaker, assistant_agg]), params=PipelineParams(),
                            idle_timeout_secs=None)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run_task = asyncio.create_task(runner.run())

    rate, ch = args.input_rate, args.input_channels

    def prep(path: Path) -> bytes:  # at --input-rate, the same signal on every channel (the service downmixes)
        pcm, r = read_pcm16(path)
        pcm = resample_pcm16(pcm, r, rate)
        return np.repeat(np.frombuffer(pcm, "<i2"), ch).astype("<i2").tobytes() if ch > 1 else pcm

    speech = prep(args.wav)
    step = int(rate * CHUNK_S) * 2 * ch
    silence = bytes(step)
    stop_feed = asyncio.Event()
    marks: dict = {}

    async def feed(pcm: bytes, pace: float) -> None:
        for i in range(0, len(pcm), step):
            await worker.queue_frame(InputAudioRawFrame(audio=pcm[i:i + step], sample_rate=rate, num_channels=ch))
            await asyncio.sleep(CHUNK_S * pace)

    async def feed_silence() -> None:  # a live microphone: silence in real time until told to stop
        while not stop_feed.is_set():
            await worker.queue_frame(InputAudioRawFrame(audio=silence, sample_rate=rate, num_channels=ch))
            await asyncio.sleep(CHUNK_S)

    timed_out, failure = False, None
    try:
        deadline = time.monotonic() + args.timeout
        while svc.client is None:  # the session opens with the pipeline's StartFrame
            if time.monotonic() > deadline:
                raise TimeoutError("the duplexkit session did not open")
            await asyncio.sleep(0.02)
        if args.flow == "tool":
            marks["speech_start"] = clock.now()
            await feed(speech, 0.25)  # faster than real time, in order
            marks["speech_end"] = clock.now()
            bg = asyncio.create_task(feed_silence())
            while not any(r["text"].strip() == args.expect_answer and r["audio_bytes"] and r["done"]
                          for r in down.responses.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError("no spoken answer")
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
        elif args.flow == "tool_cancel":  # the user talks again while the tool runs
            await feed(speech, 0.25)
            bg = asyncio.create_task(feed_silence())
            while not calls:
                if time.monotonic() > deadline:
                    raise TimeoutError("no tool call")
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            stop_feed.set()
            await bg
            marks["speech_start"] = clock.now()
            await feed(prep(args.wav2), 1.0)
            marks["speech_end"] = clock.now()
            stop_feed.clear()
            bg = asyncio.create_task(feed_silence())
            await asyncio.sleep(1.5)
        else:  # barge_in
            bg = asyncio.create_task(feed_silence())
            await worker.queue_frame(LLMRunFrame())
            while speaker.written < args.barge_after_s * 24_000 * 2:
                if time.monotonic() > deadline:
                    raise TimeoutError("the bot did not speak")
                await asyncio.sleep(0.01)
            stop_feed.set()
            await bg
            marks["speech_start"] = clock.now()
            marks["written_at_speech_start"] = speaker.written
            await feed(speech, 1.0)  # the user talks over the bot, in real time
            marks["speech_end"] = clock.now()
            stop_feed.clear()
            bg = asyncio.create_task(feed_silence())
            await asyncio.sleep(1.5)  # anything that would still play has had time to
        stop_feed.set()
        await bg
    except TimeoutError as exc:
        timed_out, failure = True, str(exc)
    except Exception:  # noqa: BLE001 - reported
        failure = traceback.format_exc()
    finally:
        stop_feed.set()
        client = svc.client
        tool_calls = [{"call_id": c.call_id, "name": c.name, "arguments": c.arguments, "status": c.status,
                       "output": c.output, "sent": c.sent} for c in (client.tool_calls.values() if client else [])]
        await worker.queue_frame(EndFrame())
        try:
            await asyncio.wait_for(asyncio.shield(run_task), 20)
        except asyncio.TimeoutError:
            await worker.cancel()
            await asyncio.wait_for(run_task, 10)
        if engine is not None:
            await engine.aclose()
    return {"timed_out": timed_out, "failure": failure, "calls": calls, "tool_calls": tool_calls, "items": items,
            "events": events, "marks": marks, "up": up.timeline, "down": down.timeline,
            "responses": down.responses, "transcripts": up.transcripts + down.transcripts,
            "speaker_writes": speaker.writes, "speaker_bytes": speaker.written, "input_rates": svc.input_rates,
            "parameters": WEATHER.to_default_dict()["parameters"],
            "context": [m if isinstance(m, dict) else repr(m) for m in context.get_messages()]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flow", choices=["tool", "barge_in", "tool_cancel"], required=True)
    ap.add_argument("--wav2", type=Path, help="tool_cancel: what the user says while the tool runs (16 kHz)")
    ap.add_argument("--tool-delay-s", type=float, default=0.2, help="how long the tool's handler takes")
    ap.add_argument("--input-channels", type=int, default=1)
    ap.add_argument("--engine", help="scripted[:k=v;...] (inline)")
    ap.add_argument("--url", help="a duplexkit serve URL (remote)")
    ap.add_argument("--wav", type=Path, required=True)
    ap.add_argument("--input-rate", type=int, default=16_000)
    ap.add_argument("--expect-answer", default="")
    ap.add_argument("--barge-after-s", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    logger.remove()
    logger.add(sys.stderr, level="DEBUG")
    try:
        report = asyncio.run(run(args))
    except Exception:
        traceback.print_exc()
        return 1
    args.out.write_text(json.dumps(report, indent=1, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
