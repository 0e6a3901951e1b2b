"""A tool loop with the unmodified OpenAI Python SDK against a duplexkit server (docs/tools.md).

    duplexkit serve tiny --port 8000          # or serve a real checkpoint
    pip install openai
    python examples/openai_sdk_tools.py --url http://127.0.0.1:8000 --input question.wav --output answer.wav

The flow is OpenAI Realtime's function calling, nothing duplexkit-specific on the client side:

1. ``session.update`` with ``tools`` (one ``get_weather`` function, JSON Schema parameters) and
   ``tool_choice``; the turn is the input WAV, ended by ``input_audio_buffer.commit``;
2. the server's tool decider answers the turn with a ``function_call`` output item
   (``response.function_call_arguments.done``, the item in ``response.done.output``); a short spoken
   filler follows while the tool runs;
3. this script runs the function locally and sends ``conversation.item.create{function_call_output}``
   then ``response.create``; the spoken answer uses the result and is written to ``--output``
   (24 kHz mono WAV).

``--tool-choice required`` (the default) makes the decider call the tool whatever the weights say,
so the loop runs against ``serve tiny`` (random weights: the spoken words are noise) and ``serve
scripted``; use ``auto`` with a real checkpoint. Exit status: 0 when the answer completed (or ended
``incomplete`` at a length cap, as tiny's does), 1 when a response failed or no call came, 3 when the server cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys

import numpy as np

from duplexkit import ASSETS_DIR
from duplexkit.audio import float32_to_pcm16, pcm16_to_float32, read_wav, write_wav
from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, remote_random_weights

DEFAULT_WAV = ASSETS_DIR / "question_16k.wav"

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Paris"}},
                   "required": ["city"], "additionalProperties": False},
}


def get_weather(city: str) -> dict:
    """The local function the model may call (a real agent would query a weather API here)."""
    return {"city": city, "temperature_c": 21, "sky": "clear"}


async def main(args: argparse.Namespace) -> int:
    from openai import AsyncOpenAI

    ws_url = args.url.replace("http://", "ws://").replace("https://", "wss://")
    client = AsyncOpenAI(api_key=args.api_key or "sk-no-key", base_url=args.url + "/v1",
                         websocket_base_url=ws_url + "/v1")
    if remote_random_weights(args.url):  # duplexkit's /health says so (not part of the OpenAI API)
        print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
    audio, _ = read_wav(args.input, 24_000)  # the compat profile's default input: pcm16 at 24 kHz
    answer: list[bytes] = []
    async with client.realtime.connect(model=args.model) as conn:
        ev = await conn.recv()
        if ev.type == "error":  # refused at the handshake: the server's text
            print(f"error: {ev.error.code}: {ev.error.message}", file=sys.stderr)
            return 1
        await conn.session.update(session={
            "type": "realtime", "output_modalities": ["audio"], "tools": [WEATHER_TOOL],
            "tool_choice": args.tool_choice, "audio": {"input": {"turn_detection": None}},
        })
        for i in range(0, len(audio), 4800):  # 200 ms appends
            await conn.input_audio_buffer.append(audio=base64.b64encode(float32_to_pcm16(audio[i:i + 4800])).decode())
        await conn.input_audio_buffer.commit()

        calls_answered = 0
        asked = False  # the response.create after the outputs has been sent
        audio_of: dict[str, list[bytes]] = {}  # response id -> its audio
        async for ev in conn:
            if ev.type == "error":
                print(f"error: {ev.error.code}: {ev.error.message}", file=sys.stderr)
            elif ev.type == "response.function_call_arguments.done":
                print(f"call {ev.call_id}: {ev.name}({ev.arguments})")
            elif ev.type == "response.output_audio_transcript.delta":
                print(ev.delta, end="", flush=True)
            elif ev.type == "response.output_audio.delta":
                audio_of.setdefault(ev.response_id, []).append(base64.b64decode(ev.delta))
            elif ev.type == "response.done":
                r = ev.response
                # duplexkit tags each response with what started it ("tool", "filler", "client", ...):
                # an extra key the SDK keeps; OpenAI's own server sends none (and speaks no filler)
                started_by = (getattr(r, "model_extra", None) or {}).get("trigger")
                print(f"\nresponse {r.id}: {r.status}" + (f" ({started_by})" if started_by else ""))
                if r.status == "failed":
                    return 1
                calls = [o for o in (r.output or []) if o.type == "function_call"]
                for call in calls:  # run each call, then ask for the answer once
                    result = (get_weather(**json.loads(call.arguments)) if call.name == "get_weather"
                              else {"error": f"unknown tool {call.name}"})
                    await conn.conversation.item.create(item={
                        "type": "function_call_output", "call_id": call.call_id, "output": json.dumps(result)})
                    calls_answered += 1
                if calls:
                    await conn.response.create()
                    asked = True
                elif asked and started_by != "filler":  # the spoken answer to the outputs
                    answer = audio_of.get(r.id, [])
                    if r.status == "incomplete":  # a length cap (serve tiny: 40 tokens) still answered
                        print(f"note: the answer ended {r.status} (a length cap); writing what was said")
                    elif r.status != "completed":
                        return 1
                    break
    if not calls_answered:
        print("error: the decider made no call (try --tool-choice required)", file=sys.stderr)
        return 1
    pcm = pcm16_to_float32(b"".join(answer))
    write_wav(args.output, pcm if pcm.size else np.zeros(0, np.float32), 24_000)
    print(f"answer audio: {args.output} ({len(pcm) / 24000:.2f} s)")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (http)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default="minicpm-o-4.5", help="a served model id (see /v1/models)")
    p.add_argument("--input", default=str(DEFAULT_WAV), help="the user's question, a WAV file")
    p.add_argument("--output", default="tool_answer.wav", help="where the spoken answer goes (24 kHz WAV)")
    p.add_argument("--tool-choice", default="required", choices=["auto", "required", "none"])
    args = p.parse_args()
    from websockets.exceptions import InvalidStatus

    try:
        sys.exit(asyncio.run(main(args)))
    except InvalidStatus as exc:  # refused before the WebSocket opened (e.g. 401 without a valid key)
        print(f"error: the server refused the connection: HTTP {exc.response.status_code}", file=sys.stderr)
        sys.exit(3)
    except OSError as exc:  # cannot connect (refused, unknown host)
        print(f"error: cannot connect to {args.url}: {exc}", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        print("interrupted", file=sys.stderr)
        sys.exit(130)
