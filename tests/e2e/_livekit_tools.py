"""LiveKit Agents' OpenAI Realtime model running a ``@function_tool`` against ``duplexkit serve`` (run with
the frameworks venv's python, scripts/setup_frameworks.sh; driven by tests/e2e/test_framework_tools.py).

No LiveKit room or server: ``livekit.plugins.openai.realtime.RealtimeModel(base_url=http://.../v1)``
and its ``RealtimeSession`` are driven directly, the way ``AgentSession`` drives them for a realtime
model (livekit/agents/voice/agent_activity.py): instructions and tools, the user's speech pushed as
``rtc.AudioFrame`` s (16 kHz, 20 ms each, then silence so that the server VAD ends the turn), the
function call read from the generation's ``function_stream``, run with LiveKit's own
``execute_function_call``, its ``FunctionCallOutput`` added with ``update_chat_ctx``, then
``interrupt()`` and ``generate_reply(tool_choice="auto")`` for the answer. Writes a JSON report to
``--out``: the tool's calls, each generation (response id, who started it, transcript, audio samples,
function calls), the errors the session emitted, the server event types received in order and the
session's chat context at the end.

Usage: python _livekit_tools.py --url http://127.0.0.1:PORT --wav question_16k.wav --expect-answer TEXT --out report.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import traceback
import wave
from pathlib import Path

from livekit import rtc
from livekit.agents import function_tool, llm
from livekit.agents.llm.utils import execute_function_call
from livekit.plugins.openai.realtime import RealtimeModel

CHUNK_S = 0.02  # 20 ms input frames, as a room's audio track delivers them
CALLS: list[dict] = []


@function_tool
async def get_weather(city: str) -> dict:
    """The current weather in a city.

    Args:
        city: The city, e.g. Paris.
    """
    CALLS.append({"city": city})
    return {"city": city, "temperature_c": 21, "conditions": "sunny"}


def read_pcm16(path: Path) -> tuple[bytes, int]:
    """A mono pcm16 WAV: (bytes, sample rate)."""
    with wave.open(str(path), "rb") as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2, (w.getnchannels(), w.getsampwidth())
        return w.readframes(w.getnframes()), w.getframerate()


async def run(url: str, wav: Path, expect_answer: str, timeout: float) -> dict:
    t0 = time.monotonic()
    now = lambda: round(time.monotonic() - t0, 3)  # noqa: E731
    model = RealtimeModel(base_url=url.rstrip("/") + "/v1", api_key="sk-unused", model="gpt-realtime",
                          tool_choice="auto")
    session = model.session()
    tools = llm.ToolContext([get_weather])
    generations: list[dict] = []
    errors: list[dict] = []
    server_events: list[str] = []
    tool_results: list[dict] = []
    answered = asyncio.Event()
    tasks: list[asyncio.Task] = []

    server_errors: list[dict] = []

    def on_server_event(ev: dict) -> None:
        server_events.append(ev.get("type"))
        if ev.get("type") == "error":
            server_errors.append(ev)

    session.on("openai_server_event_received", on_server_event)
    client_events: list[dict] = []
    session.on("openai_client_event_queued", lambda ev: client_events.append(
        {k: v for k, v in ev.items() if k != "audio"}) if ev.get("type") != "input_audio_buffer.append" else None)
    session.on("error", lambda ev: errors.append({"t": now(), "error": repr(ev.error),
                                                  "recoverable": ev.recoverable}))

    async def answer_calls(calls: list) -> None:
        """What AgentSession does with a realtime model's calls: run them, add the outputs to the
        remote chat context, interrupt what still speaks, ask for the reply."""
        outputs = []
        for fc in calls:
            res = await execute_function_call(
                llm.FunctionToolCall(name=fc.name, arguments=fc.arguments, call_id=fc.call_id), tools)
            tool_results.append({"t": now(), "call_id": fc.call_id, "output": res.fnc_call_out.output,
                                 "is_error": res.fnc_call_out.is_error})
            outputs.append(res.fnc_call_out)
        chat_ctx = session.chat_ctx.copy()
        chat_ctx.items.extend(outputs)
        await session.update_chat_ctx(chat_ctx)
        session.interrupt()
        gen = await session.generate_reply(tool_choice="auto")
        tool_results[-1]["reply_response_id"] = gen.response_id

    async def consume(ev: llm.GenerationCreatedEvent) -> None:
        rec = {"t": now(), "response_id": ev.response_id, "user_initiated": ev.user_initiated, "text": "",
               "audio_samples": 0, "sample_rates": [], "function_calls": []}
        generations.append(rec)

        async def message(msg: llm.MessageGeneration) -> None:
            async def text():
                async for piece in msg.text_stream:
                    rec["text"] += str(piece)

            async def audio():
                async for frame in msg.audio_stream:
                    rec["audio_samples"] += frame.samples_per_channel
                    if frame.sample_rate not in rec["sample_rates"]:
                        rec["sample_rates"].append(frame.sample_rate)

            await asyncio.gather(text(), audio())

        async def messages():
            await asyncio.gather(*[asyncio.create_task(message(m)) async for m in ev.message_stream])

        async def functions():
            async for fc in ev.function_stream:
                rec["function_calls"].append({"call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments})

        await asyncio.gather(messages(), functions())
        rec["t_done"] = now()
        if rec["function_calls"]:
            tasks.append(asyncio.create_task(answer_calls(
                [llm.FunctionCall(**{k: c[k] for k in ("call_id", "name", "arguments")})
                 for c in rec["function_calls"]])))
        if rec["audio_samples"] and ev.user_initiated and rec["text"].strip() == expect_answer:
            answered.set()

    session.on("generation_created", lambda ev: tasks.append(asyncio.create_task(consume(ev))))

    timed_out, failure = None, None
    try:
        await session.update_instructions("You are a helpful voice assistant. Use get_weather for weather questions.")
        await session.update_tools([get_weather])
        pcm, rate = read_pcm16(wav)
        pcm += bytes(int(rate * 1.5) * 2)  # 1.5 s of silence: the server VAD ends the turn
        step = int(rate * CHUNK_S)
        for i in range(0, len(pcm) // 2, step):
            chunk = pcm[2 * i:2 * (i + step)]
            session.push_audio(rtc.AudioFrame(chunk, rate, 1, len(chunk) // 2))
            await asyncio.sleep(CHUNK_S / 4)  # faster than real time, in order
        await asyncio.wait_for(answered.wait(), timeout)
        timed_out = False
    except asyncio.TimeoutError:
        timed_out = True
    except Exception:  # e.g. generate_reply timed out: the report still says what came
        failure = traceback.format_exc()
    finally:
        chat = [item.model_dump(mode="json", exclude_none=True) for item in session.chat_ctx.items]
        await session.aclose()
        await model.aclose()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"timed_out": timed_out, "failure": failure, "calls": list(CALLS), "tool_results": tool_results,
            "generations": generations, "errors": errors, "server_events": server_events,
            "server_errors": server_errors, "client_events": client_events, "chat_ctx": chat,
            "parameters": llm.utils.build_legacy_openai_schema(get_weather, internally_tagged=True)["parameters"],
            "versions": versions()}


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("livekit-agents", "livekit-plugins-openai", "livekit", "openai", "aiohttp")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--wav", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--expect-answer", required=True, help="the transcript of the answer to the tool's output")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        report = asyncio.run(run(args.url, args.wav, args.expect_answer, args.timeout))
    except Exception:
        traceback.print_exc()
        return 1
    args.out.write_text(json.dumps(report, indent=1, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
