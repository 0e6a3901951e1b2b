"""A Pipecat voice agent on duplexkit: ``DuplexkitLLMService`` in a pipeline, with a function tool
registered through Pipecat's ``register_function`` (docs/integrations.md, "Pipecat").

    .venv-frameworks/bin/python examples/pipecat_agent.py                               # inline, scripted engine
    .venv-frameworks/bin/python examples/pipecat_agent.py --url ws://127.0.0.1:8000     # a duplexkit serve
    python examples/pipecat_agent.py --engine tiny          # inline tiny random-weight model (needs torch too)
    python examples/pipecat_agent.py --engine /models/MiniCPM-o-4_5 --input my_question.wav

The pipeline is the usual speech-to-speech one::

    microphone (WAV) -> user aggregator -> DuplexkitLLMService -> WavOutput -> assistant aggregator

The script plays ``--input`` (a speech WAV, any rate) as 20 ms ``InputAudioRawFrame`` s at real-time
pace, then silence, as a microphone would; ``WavOutput`` is a Pipecat output transport that "plays"
the bot's speech in real time into ``--output`` (so barge-in and playout behave as with a speaker).
For a real call, replace both with a Pipecat transport (``transport.input()`` /
``transport.output()`` of Daily, SmallWebRTC, a WebSocket or the local audio transport).

The tool ``get_weather(city)`` answers from a table. The script prints the user's transcript, the
tool calls and results, and what the bot says. With the **scripted** engine (the default here: no
model, torch-free) the call and every word are scripted: the decider always calls
``get_weather({"city": "Paris"})``, the user transcript and the answer are the fixed
``This is a scripted chat reply.`` and the speech is a 440 Hz tone. With **random weights**
(``tiny``, or a server whose ``/health`` says ``random_weights``) the text is gibberish and the
speech noise, and ``--tool-choice`` defaults to ``required`` so that a call happens at all.

``scripts/setup_frameworks.sh`` builds ``.venv-frameworks`` (pipecat-ai 1.14 and this checkout of
duplexkit, no torch): there, inline runs take ``--engine scripted``; ``tiny`` and real checkpoints
need a venv with ``duplexkit[engine,pipecat]``, or a server (``--url``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import wave
from pathlib import Path

import numpy as np

try:  # Pipecat takes seconds to import: Ctrl+C meanwhile ends as it does later
    from loguru import logger

    logger.remove()  # warnings and errors only, from the import on (not Pipecat's INFO banner)
    logger.add(sys.stderr, level="WARNING")
    from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
    from pipecat.frames.frames import (
        EndFrame, InputAudioRawFrame, InterruptionFrame, LLMFullResponseEndFrame, LLMRunFrame, OutputAudioRawFrame,
        TranscriptionFrame, TTSAudioRawFrame, TTSTextFrame,
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
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
except ImportError as exc:
    sys.exit(f"error: this example needs pipecat-ai ({exc}): run scripts/setup_frameworks.sh and use "
             ".venv-frameworks/bin/python, or pip install 'duplexkit[pipecat]'")

from duplexkit import ASSETS_DIR
from duplexkit.audio import read_wav
from duplexkit.integrations.pipecat import DuplexkitLLMService
from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, fetch_health, http_base_url

SCRIPTED_NOTICE = ("NOTE: the SCRIPTED engine (a fake, torch-free engine for tests and demos): no model runs, the "
                   "tool call and every word are scripted and the speech is a 440 Hz tone. Use --engine with a "
                   "MiniCPM-o 4.5 checkpoint directory, or --url a server running one, for real answers.")
WEATHER_TABLE = {"paris": {"temperature_c": 21, "conditions": "sunny"},
                 "london": {"temperature_c": 14, "conditions": "light rain"}}
WEATHER = FunctionSchema(name="get_weather", description="The current weather in a city.",
                         properties={"city": {"type": "string", "description": "The city, e.g. Paris."}},
                         required=["city"])


async def get_weather(params: FunctionCallParams) -> None:
    """The tool's handler, as any Pipecat LLM service calls it."""
    city = str(params.arguments.get("city", ""))
    print(f"[tool] get_weather({dict(params.arguments)})")
    result = dict(WEATHER_TABLE.get(city.lower(), {"temperature_c": None, "conditions": "unknown"}), city=city)
    await params.result_callback(result)
    print(f"[tool] -> {result}")


class WavOutput(BaseOutputTransport):
    """An output transport that plays the bot's speech in real time into a 24 kHz WAV file."""

    def __init__(self, path: Path) -> None:
        super().__init__(TransportParams(audio_out_enabled=True, audio_out_sample_rate=24_000))
        self.path = path
        self.pcm = bytearray()

    async def start(self, frame):
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        if isinstance(frame, TTSAudioRawFrame):  # not the transport's own end-of-session silence
            self.pcm += frame.audio
        await asyncio.sleep(len(frame.audio) / 2 / frame.sample_rate)  # a speaker takes its time
        return True

    def save(self) -> None:
        with wave.open(str(self.path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(24_000)
            w.writeframes(bytes(self.pcm))


class Printer(FrameProcessor):
    """Prints what the user said (upstream ``TranscriptionFrame``) and what the bot says."""

    def __init__(self) -> None:
        super().__init__()
        self.said = ""
        self.answers = 0

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            print(f"[user] {frame.text}")
        elif isinstance(frame, TTSTextFrame):
            self.said += frame.text
        elif isinstance(frame, InterruptionFrame) and direction == FrameDirection.DOWNSTREAM:
            print("[barge-in] the user talked over the bot: its queued audio is dropped")
        elif isinstance(frame, LLMFullResponseEndFrame):
            if self.said.strip():
                print(f"[bot] {self.said.strip()}")
                self.answers += 1
            self.said = ""
        await self.push_frame(frame, direction)


def server_health(url: str) -> dict:
    """The server's ``/health``. Raises ConnectionError when nothing answers (said at once: the pipeline
    would only log its failed connections). Called before the event loop runs, so Ctrl+C stops it at once."""
    health = fetch_health(url)
    if health is None:
        raise ConnectionError(f"no duplexkit server answers at {http_base_url(url)}/health")
    return health


def build_service(args, health: dict | None) -> tuple:
    """The service and whether its engine is random / scripted (printed). ``health``: the server's
    ``/health`` with ``--url``."""
    tool_choice = args.tool_choice
    if args.url:
        random_w, scripted = bool(health.get("random_weights")), health.get("model") == "scripted"
        # a scripted or random-weight server only speaks when asked: its decider must call the tool
        svc = DuplexkitLLMService(url=args.url, api_key=args.api_key, tools=[WEATHER],
                                  tool_choice=tool_choice or ("required" if random_w or scripted else "auto"))
        return svc, random_w, scripted, None
    if args.engine == "scripted":
        from duplexkit.testing import ScriptConfig, ScriptedEngine

        engine = ScriptedEngine(ScriptConfig(tool_script=[("get_weather", {"city": "Paris"})]))
    else:
        from duplexkit.engine import load_engine

        engine = load_engine(args.engine)
    random_w = bool(getattr(engine, "random_weights", False))
    scripted = args.engine == "scripted"
    opts = {"max_output_tokens": 40} if random_w else {}  # random weights never end a turn
    svc = DuplexkitLLMService(engine=engine, tools=[WEATHER], client_options=opts,
                              tool_choice=tool_choice or ("required" if random_w else "auto"))
    return svc, random_w, scripted, engine


async def _cancel_on(interrupted: asyncio.Event, runner: WorkerRunner) -> None:
    await interrupted.wait()
    await runner.cancel(reason="Ctrl+C")


async def main(args, health: dict | None = None) -> int:
    svc, random_w, scripted, engine = build_service(args, health)
    if scripted:
        print(SCRIPTED_NOTICE)
    if random_w:
        print(RANDOM_WEIGHTS_NOTICE)
    svc.register_function("get_weather", get_weather)
    context = LLMContext([])
    user_agg, assistant_agg = LLMContextAggregatorPair(context)
    # one printer on each side: the service pushes the user's transcript upstream, its speech downstream
    heard, printer, out = Printer(), Printer(), WavOutput(args.output)
    worker = PipelineWorker(Pipeline([user_agg, heard, svc, printer, out, assistant_agg]), params=PipelineParams(),
                            idle_timeout_secs=None)
    # Ctrl+C: the script's own handler (not the runner's, which logs a warning) cancels the pipeline
    # and the script ends with one line and status 130
    runner = WorkerRunner(handle_sigint=False)
    interrupted = asyncio.Event()
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, interrupted.set)
    except NotImplementedError:  # Windows: Ctrl+C stays a KeyboardInterrupt
        pass
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    stopping = asyncio.create_task(_cancel_on(interrupted, runner))
    if args.greet:
        await worker.queue_frame(LLMRunFrame())  # the bot speaks first
    audio, rate = read_wav(str(args.input))
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    pcm += bytes(int(rate * args.listen_s) * 2)  # then silence: the session ends the turn and answers
    step = int(rate * 0.02) * 2
    for i in range(0, len(pcm), step):  # a microphone: 20 ms frames in real time
        if interrupted.is_set():
            break
        await worker.queue_frame(InputAudioRawFrame(audio=pcm[i:i + step], sample_rate=rate, num_channels=1))
        await asyncio.sleep(0.02)
    if not interrupted.is_set():
        await worker.queue_frame(EndFrame())
    await running
    stopping.cancel()
    if engine is not None:
        await engine.aclose()
    if interrupted.is_set():
        raise KeyboardInterrupt
    out.save()
    print(f"wrote {args.output} ({len(out.pcm) / 48_000:.2f} s of the bot's speech, {printer.answers} answers)")
    if not printer.answers:
        print("error: no answer came (see the log above: a refused key, an unreachable server, or a "
              "model that did not answer)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="scripted",
                    help="in-process engine when no --url: 'scripted' (default), 'tiny' (random weights) or a checkpoint directory")
    ap.add_argument("--url", help="a duplexkit serve URL (ws://host:port); the engine runs there")
    ap.add_argument("--api-key", help="the server's --api-key")
    ap.add_argument("--input", type=Path, default=ASSETS_DIR / "question_16k.wav", help="the user's speech (WAV)")
    ap.add_argument("--output", type=Path, default=Path("pipecat_answer.wav"), help="the bot's speech (24 kHz WAV)")
    ap.add_argument("--listen-s", type=float, default=6.0, help="silence after the speech while the bot answers (s)")
    ap.add_argument("--tool-choice", help="auto, required or none (default: required with random weights or the "
                    "scripted engine, else auto)")
    ap.add_argument("--greet", action="store_true", help="let the bot speak first (LLMRunFrame)")
    a = ap.parse_args()
    try:
        sys.exit(asyncio.run(main(a, server_health(a.url) if a.url else None)))
    except ConnectionError as exc:  # no server at --url
        print(f"error: cannot connect to {a.url}: {exc}", file=sys.stderr)
        sys.exit(3)  # as the CLI and the other examples
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        print("interrupted", file=sys.stderr)
        sys.exit(130)
