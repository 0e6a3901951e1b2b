"""Pipecat's OpenAI Realtime service running a function tool against ``duplexkit serve`` (run with the
frameworks venv's python, scripts/setup_frameworks.sh; driven by tests/e2e/test_framework_tools.py).

A minimal Pipecat pipeline without transport or audio devices:

    user aggregator -> OpenAIRealtimeLLMService(base_url=ws://.../v1/realtime) -> recorder -> assistant aggregator

The pipeline starts with ``LLMRunFrame`` as Pipecat's realtime examples do (the service greets: a
spoken response); then a speech WAV is fed as ``InputAudioRawFrame`` s (16 kHz pcm16, 20 ms each,
then silence so that the server VAD ends the turn). The tool ``get_weather`` is given as a
provider-native dict with duplexkit's ``"filler": ""`` and registered with ``register_function``; the
run ends when a spoken response whose transcript is ``--expect-answer`` has completed (or at
``--timeout``). Writes a JSON report to ``--out``: the handler's calls, the timeline of frames the
service pushed, the responses (transcript, audio bytes), the items the server added, the server event
types received, and Pipecat's own context messages at the end.

With ``--provoke-errors``, between the greeting and the speech: a ``response.cancel`` with nothing
active and two ``response.create`` back to back (:func:`provoke_benign_errors`).

Usage: python _pipecat_tools.py --url http://127.0.0.1:PORT --wav question_16k.wav --expect-answer TEXT --out report.json
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

from loguru import logger

from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.frames.frames import (
    EndFrame, ErrorFrame, FunctionCallResultFrame, FunctionCallsStartedFrame, InputAudioRawFrame,
    LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMRunFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.llm_service import FunctionCallParams
from pipecat.services.openai.realtime import events as rt_events
from pipecat.services.openai.realtime.events import (
    AudioConfiguration, AudioInput, InputAudioTranscription, SessionProperties,
)
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

#: the tool as Pipecat declares it; its JSON Schema (``parameters``) goes into the report
WEATHER = FunctionSchema(
    name="get_weather",
    description="The current weather in a city.",
    properties={"city": {"type": "string", "description": "The city, e.g. Paris."}},
    required=["city"],
)
TOOL_RESULT = {"temperature_c": 21, "conditions": "sunny"}
CHUNK_S = 0.02  # 20 ms input frames, as a transport would push them
TOOL_LATENCY_S = 0.3  # the simulated lookup (see get_weather)


def read_pcm16(path: Path) -> tuple[bytes, int]:
    """A mono pcm16 WAV: (bytes, sample rate)."""
    with wave.open(str(path), "rb") as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2, (w.getnchannels(), w.getsampwidth())
        return w.readframes(w.getnframes()), w.getframerate()


class Recorder(FrameProcessor):
    """Records what the realtime service pushes downstream, with times relative to the start, and
    groups it into responses (one per ``LLMFullResponseEndFrame``: its transcript and audio bytes)."""

    def __init__(self, t0: float, expect_answer: str) -> None:
        super().__init__()
        self.t0, self.expect_answer = t0, expect_answer
        self.timeline: list[list] = []
        self.responses: list[dict] = []  # {"text", "audio_bytes", "sample_rates", "t_end"}
        self.spoken = asyncio.Event()  # a response with audio completed
        self.answered = asyncio.Event()  # the expected answer completed with audio
        self._cur = {"text": "", "audio_bytes": 0, "sample_rates": []}

    def _log(self, *entry) -> None:
        self.timeline.append([round(time.monotonic() - self.t0, 3), *entry])

    async def process_frame(self, frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            if isinstance(frame, TTSAudioRawFrame):
                self._cur["audio_bytes"] += len(frame.audio)
                if frame.sample_rate not in self._cur["sample_rates"]:
                    self._cur["sample_rates"].append(frame.sample_rate)
            elif isinstance(frame, TTSTextFrame):
                self._cur["text"] += frame.text
            elif isinstance(frame, (TTSStartedFrame, TTSStoppedFrame, LLMFullResponseStartFrame)):
                self._log(type(frame).__name__)
            elif isinstance(frame, LLMFullResponseEndFrame):
                self._log(type(frame).__name__)
                if self._cur["audio_bytes"] or self._cur["text"]:
                    self.responses.append(dict(self._cur, t_end=self.timeline[-1][0]))
                    self._cur = {"text": "", "audio_bytes": 0, "sample_rates": []}
                    if self.responses[-1]["audio_bytes"]:
                        self.spoken.set()
                        if self.responses[-1]["text"].strip() == self.expect_answer:
                            self.answered.set()
            elif isinstance(frame, FunctionCallsStartedFrame):
                self._log("FunctionCallsStartedFrame", [f.function_name for f in frame.function_calls])
            elif isinstance(frame, FunctionCallResultFrame):
                self._log("FunctionCallResultFrame", frame.tool_call_id, frame.function_name, frame.result)
            elif isinstance(frame, ErrorFrame):
                self._log("ErrorFrame", str(frame.error), bool(frame.fatal))
        await self.push_frame(frame, direction)


def record_server_events(into: list, error_codes: list) -> None:
    """Note the type of every server event the service parses, and the code of every ``error`` (an
    observer only: the service's own parser still decides; types it has no model for come back
    ``None`` and it skips them)."""
    parse = rt_events.parse_server_event

    def recording(message):
        ev = json.loads(message)
        into.append(ev.get("type"))
        if ev.get("type") == "error":
            error_codes.append((ev.get("error") or {}).get("code"))
        return parse(message)

    rt_events.parse_server_event = recording


async def provoke_benign_errors(llm: OpenAIRealtimeLLMService, recorder: "Recorder", timeout: float) -> None:
    """Through the service's own send path: a ``response.cancel`` with no response active, then two
    ``response.create`` back to back (the second meets the first). OpenAI answers these with
    ``response_cancel_not_active`` and ``conversation_already_has_active_response``, which Pipecat's
    receive loop logs and passes over; any other code ends the loop (duplexkit's own names
    would, and every later answer would be lost)."""
    await llm.send_client_event(rt_events.ResponseCancelEvent())
    n = len(recorder.responses)
    await llm.send_client_event(rt_events.ResponseCreateEvent())
    await llm.send_client_event(rt_events.ResponseCreateEvent())
    async with asyncio.timeout(timeout):
        while len(recorder.responses) == n:  # the first create's response plays to its end
            await asyncio.sleep(0.05)


async def run(url: str, wav: Path, expect_answer: str, timeout: float, provoke_errors: bool = False) -> dict:
    t0 = time.monotonic()
    calls: list[dict] = []
    items: list[dict] = []
    server_events: list[str] = []
    error_codes: list[str] = []
    record_server_events(server_events, error_codes)

    async def get_weather(params: FunctionCallParams) -> None:
        calls.append({"t": round(time.monotonic() - t0, 3), "tool_call_id": params.tool_call_id,
                      "function_name": params.function_name, "arguments": dict(params.arguments)})
        # a lookup takes a moment (a weather API). With duplexkit's filler on, a result delivered within
        # the few ms between the call's response.done and the filler's response.created being handled
        # is taken by Pipecat 1.14 as taken in by the filler, and no response.create follows; hence the
        # tool's "filler": "" (docs/tools.md, "Pipecat and LiveKit")
        await asyncio.sleep(TOOL_LATENCY_S)
        await params.result_callback(dict(TOOL_RESULT, city=params.arguments.get("city")))

    ws_base = url.replace("http://", "ws://").replace("https://", "wss://").rstrip("/") + "/v1/realtime"
    llm = OpenAIRealtimeLLMService(
        api_key="sk-unused",  # duplexkit serve without --api-key ignores it
        base_url=ws_base,
        settings=OpenAIRealtimeLLMService.Settings(
            model="gpt-realtime",
            system_instruction="You are a helpful voice assistant. Use get_weather for weather questions.",
            # Pipecat's default transcription model (gpt-realtime-whisper): the user's turns reach the context.
            # The tool as a provider-native dict with duplexkit's "filler": "" (no filler response: see
            # get_weather and docs/tools.md, "Pipecat and LiveKit")
            session_properties=SessionProperties(
                tool_choice="auto", audio=AudioConfiguration(input=AudioInput(transcription=InputAudioTranscription())),
                tools=[{"type": "function", **WEATHER.to_default_dict(), "filler": ""}]),
        ),
    )
    llm.register_function("get_weather", get_weather)

    @llm.event_handler("on_conversation_item_created")
    async def on_item(_service, item_id, item):
        items.append({"t": round(time.monotonic() - t0, 3), "id": item_id, "type": item.type,
                      "role": getattr(item, "role", None), "call_id": getattr(item, "call_id", None),
                      "name": getattr(item, "name", None), "output": getattr(item, "output", None)})

    # no tools in the context: the service's own (above) are sent
    context = LLMContext([])
    user_agg, assistant_agg = LLMContextAggregatorPair(context)
    recorder = Recorder(t0, expect_answer)
    worker = PipelineWorker(Pipeline([user_agg, llm, recorder, assistant_agg]), params=PipelineParams(),
                            idle_timeout_secs=None)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run_task = asyncio.create_task(runner.run())
    timed_out = None
    try:
        # as a bot starts: the context goes to the service, which greets (a spoken response)
        await worker.queue_frames([LLMRunFrame()])
        await asyncio.wait_for(recorder.spoken.wait(), timeout)
        if provoke_errors:
            await provoke_benign_errors(llm, recorder, timeout)
        audio, rate = read_pcm16(wav)
        step = int(rate * CHUNK_S) * 2
        pcm = audio + bytes(int(rate * 1.5) * 2)  # 1.5 s of silence: the server VAD ends the turn
        recorder._log("speech_start")
        for i in range(0, len(pcm), step):
            await worker.queue_frame(InputAudioRawFrame(audio=pcm[i:i + step], sample_rate=rate, num_channels=1))
            await asyncio.sleep(CHUNK_S / 4)  # faster than real time, in order, without flooding the queue
        recorder._log("speech_end")
        await asyncio.wait_for(recorder.answered.wait(), timeout)
        timed_out = False
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        await worker.queue_frame(EndFrame())
        try:
            await asyncio.wait_for(asyncio.shield(run_task), 20)
        except asyncio.TimeoutError:
            await worker.cancel()
            await asyncio.wait_for(run_task, 10)
    return {"timed_out": timed_out, "calls": calls, "items": items, "timeline": recorder.timeline,
            "responses": recorder.responses, "server_events": server_events, "error_codes": error_codes,
            "parameters": WEATHER.to_default_dict()["parameters"],
            "context": [m if isinstance(m, dict) else repr(m) for m in context.get_messages()],
            "versions": versions()}


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("pipecat-ai", "openai", "websockets")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--wav", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--expect-answer", required=True, help="the transcript of the answer to the tool's output")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--provoke-errors", action="store_true",
                    help="after the greeting, send a response.cancel with nothing active and two response.create "
                         "back to back (the benign errors Pipecat must survive), then the tool turn")
    args = ap.parse_args()
    logger.remove()
    logger.add(sys.stderr, level="DEBUG")
    try:
        report = asyncio.run(run(args.url, args.wav, args.expect_answer, args.timeout, args.provoke_errors))
    except Exception:
        traceback.print_exc()
        return 1
    args.out.write_text(json.dumps(report, indent=1, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
