"""A LiveKit Agents voice agent on duplexkit: ``AgentSession(llm=duplexkit.integrations.livekit.RealtimeModel(...))``
with a ``@function_tool`` (docs/integrations.md, "LiveKit Agents").

Two ways to run it:

1. **Without a LiveKit server** (the default): the agent hears a WAV file through an in-memory
   microphone (20 ms frames at real-time pace, then silence) and speaks into a WAV file (played on a
   virtual real-time clock, so LiveKit's interruption and playout logic run as with a room). It prints
   the user's transcript, the tool calls and the answers::

       .venv-frameworks/bin/python examples/livekit_agent.py                       # inline, scripted engine
       .venv-frameworks/bin/python examples/livekit_agent.py --url ws://127.0.0.1:8000   # a duplexkit serve
       python examples/livekit_agent.py --engine tiny      # inline tiny random-weight model (needs torch too)

2. **In a LiveKit room**, with LiveKit's own command line (``dev``, ``start``, ``connect``, ``console``)::

       LIVEKIT_URL=... LIVEKIT_API_KEY=... LIVEKIT_API_SECRET=... DUPLEXKIT_URL=ws://127.0.0.1:8000 \\
           .venv-frameworks/bin/python examples/livekit_agent.py dev

   ``dev``/``start``/``connect`` need a LiveKit server (LiveKit Cloud or ``livekit-server --dev``);
   ``console`` needs a microphone and speaker (sounddevice). The duplexkit side is ``DUPLEXKIT_URL`` (a
   server) or ``DUPLEXKIT_ENGINE`` (``scripted``, ``tiny`` or a checkpoint directory, in-process).

``scripts/setup_frameworks.sh`` builds ``.venv-frameworks`` (livekit-agents 1.8.9 and this checkout of
duplexkit, no torch): there, inline runs take ``--engine scripted``; ``tiny`` and real checkpoints
need a venv with ``duplexkit[engine,livekit]``, or a server (``--url``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import wave
from pathlib import Path

import numpy as np

try:  # LiveKit takes seconds to import: Ctrl+C meanwhile ends as it does later
    from livekit import rtc
    from livekit.agents import Agent, AgentSession, function_tool
    from livekit.agents.voice import io
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
except ImportError as exc:
    sys.exit(f"error: this example needs livekit-agents ({exc}): run scripts/setup_frameworks.sh and use "
             ".venv-frameworks/bin/python, or pip install 'duplexkit[livekit]'")

from duplexkit.errors import DuplexkitError
from duplexkit.integrations.livekit import OUTPUT_SAMPLE_RATE, RealtimeModel

ASSETS = Path(__file__).resolve().parents[1] / "duplexkit" / "assets"
LIVEKIT_COMMANDS = ("dev", "start", "connect", "console", "download-files")


@function_tool
async def get_weather(city: str) -> dict:
    """The current weather in a city.

    Args:
        city: The city, e.g. Paris.
    """
    print(f"[tool] get_weather(city={city!r})", flush=True)
    return {"city": city, "temperature_c": 21, "conditions": "sunny"}


class Assistant(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You are a helpful voice assistant. Use get_weather for weather questions.",
                         tools=[get_weather])


def server_health(url: str) -> dict:
    """The server's ``/health``. Raises ConnectionError when nothing answers (said at once: the agent
    session would only fail later). Called before the event loop runs, so Ctrl+C stops it at once."""
    from duplexkit.preflight import fetch_health, http_base_url

    health = fetch_health(url)
    if health is None:
        raise ConnectionError(f"no duplexkit server answers at {http_base_url(url)}/health")
    return health


def make_model(engine_name: str | None, url: str | None, api_key: str | None = None,
               health: dict | None = None) -> tuple[RealtimeModel, object]:
    """The duplexkit realtime model (and the in-process engine, or None); says when answers are not real.
    ``health``: the server's ``/health`` when already read (else it is read here)."""
    if url:
        from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, fetch_health

        health = health if health is not None else (fetch_health(url) or {})
        if health.get("random_weights"):
            print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
        # a scripted or random-weight server only speaks when asked: its decider must call the tool
        # (which then asks for the answer); a real checkpoint decides for itself
        weak = bool(health.get("random_weights")) or health.get("model") == "scripted"
        if health.get("model") == "scripted":
            print("NOTE: the server runs the SCRIPTED engine (no model): answers are a 440 Hz tone with "
                  "scripted text; tool_choice 'required'.", file=sys.stderr)
        return RealtimeModel(url=url, api_key=api_key, tool_choice="required" if weak else "auto"), None
    name = engine_name or "scripted"
    if name == "scripted":
        from duplexkit.testing import ScriptConfig, ScriptedEngine

        print("NOTE: the SCRIPTED engine (no model): answers are a 440 Hz tone with scripted text, and its decider "
              "calls get_weather(city='Paris') once.", file=sys.stderr)
        engine = ScriptedEngine(ScriptConfig(tool_script=[("get_weather", {"city": "Paris"})]))
    else:
        from duplexkit.engine import load_engine
        from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE

        if name == "tiny":
            print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
        engine = load_engine(name)
    return RealtimeModel(engine=engine), engine


class WavMicrophone(io.AudioInput):
    """A WAV file (16 kHz mono pcm16) as 20 ms frames at real-time pace, then silence."""

    def __init__(self, path: Path, lead_s: float = 0.5) -> None:
        super().__init__(label="wav-mic")
        with wave.open(str(path), "rb") as w:
            if w.getnchannels() != 1 or w.getsampwidth() != 2:
                raise SystemExit(f"{path}: need a mono 16-bit WAV")
            self.rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16)
        self._pcm = np.concatenate([np.zeros(int(self.rate * lead_s), np.int16), pcm])
        self._pos = 0
        self._t_next: float | None = None

    async def __anext__(self) -> rtc.AudioFrame:
        n = self.rate // 50
        now = time.monotonic()
        self._t_next = now if self._t_next is None else self._t_next
        await asyncio.sleep(max(0.0, self._t_next - now))
        self._t_next += 0.02
        chunk = self._pcm[self._pos:self._pos + n]
        self._pos += n
        chunk = np.pad(chunk, (0, n - chunk.size))
        return rtc.AudioFrame(chunk.tobytes(), self.rate, 1, n)


class WavSpeaker(io.AudioOutput):
    """Writes what the agent says to a 24 kHz WAV, played on a virtual real-time clock."""

    def __init__(self, path: Path) -> None:
        super().__init__(label="wav-speaker", capabilities=io.AudioOutputCapabilities(pause=False),
                         sample_rate=OUTPUT_SAMPLE_RATE)
        self._wav = wave.open(str(path), "wb")
        self._wav.setnchannels(1)
        self._wav.setsampwidth(2)
        self._wav.setframerate(OUTPUT_SAMPLE_RATE)
        self._t0: float | None = None
        self._pushed = 0.0
        self._cleared = asyncio.Event()

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._t0 is None:
            self._t0, self._pushed = time.monotonic(), 0.0
            self._cleared.clear()
            self.on_playback_started(created_at=time.time())
        self._pushed += frame.duration
        self._wav.writeframes(bytes(frame.data))

    def flush(self) -> None:
        super().flush()
        if self._t0 is not None:
            t0, pushed, self._t0 = self._t0, self._pushed, None
            asyncio.create_task(self._finish(t0, pushed))

    async def _finish(self, t0: float, pushed: float) -> None:
        try:
            await asyncio.wait_for(self._cleared.wait(), max(0.0, t0 + pushed - time.monotonic()))
            self.on_playback_finished(playback_position=min(time.monotonic() - t0, pushed), interrupted=True)
        except asyncio.TimeoutError:
            self.on_playback_finished(playback_position=pushed, interrupted=False)

    def clear_buffer(self) -> None:
        self._cleared.set()

    def close(self) -> None:
        self._wav.close()


async def run_offline(args: argparse.Namespace, health: dict | None = None) -> int:
    model, engine = make_model(args.engine, args.url, args.api_key, health)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    session.input.audio = WavMicrophone(args.input)
    speaker = WavSpeaker(args.output)
    session.output.audio = speaker
    state = {"agent": "initializing", "since": time.monotonic(), "answers": 0}

    @session.on("user_input_transcribed")
    def _on_transcript(ev) -> None:
        if ev.is_final:
            print(f"[user] {ev.transcript}", flush=True)

    @session.on("conversation_item_added")
    def _on_item(ev) -> None:
        item = ev.item
        if item.type == "message" and item.role == "assistant":
            state["answers"] += 1
            print(f"[agent] {item.text_content}{' (interrupted)' if item.interrupted else ''}", flush=True)

    @session.on("function_tools_executed")
    def _on_tools(ev) -> None:
        for out in ev.function_call_outputs:
            print(f"[tool result] {out.output}", flush=True)

    @session.on("agent_state_changed")
    def _on_state(ev) -> None:
        state["agent"], state["since"] = ev.new_state, time.monotonic()

    @session.on("close")
    def _on_close(ev) -> None:  # LiveKit closes the session on an unrecoverable error (e.g. a refused key)
        state["closed"] = getattr(ev, "error", None) or getattr(ev, "reason", None) or "closed"

    async def answered() -> None:  # something was said, and the agent has listened quietly for a while since
        while not (state["answers"] and state["agent"] == "listening" and time.monotonic() - state["since"] > args.idle_s):
            if state.get("closed"):
                raise RuntimeError(f"the agent session closed: {state['closed']}")
            await asyncio.sleep(0.1)

    try:
        await asyncio.wait_for(session.start(agent=Assistant(), record=False), args.timeout)
        await asyncio.wait_for(answered(), args.timeout)
    except asyncio.TimeoutError:
        print(f"no answer within {args.timeout} s", file=sys.stderr)
        return 1
    except (DuplexkitError, RuntimeError) as exc:  # the session did not open (a wrong key, a refused model, ...)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for closing in (session.aclose(), model.aclose()):
            try:
                await asyncio.wait_for(closing, 10)
            except Exception:  # already closed after an error: nothing more to release
                pass
        speaker.close()
        if engine is not None:
            await engine.aclose()
    print(f"wrote {args.output}")
    return 0


def run_livekit_cli() -> None:
    """LiveKit's own command line: the agent joins rooms of a LiveKit server (or the console)."""
    from livekit.agents import AgentServer, JobContext, cli

    server = AgentServer()

    @server.rtc_session()
    async def entrypoint(ctx: JobContext) -> None:
        model, _ = make_model(os.environ.get("DUPLEXKIT_ENGINE"), os.environ.get("DUPLEXKIT_URL"),
                              os.environ.get("DUPLEXKIT_API_KEY"))
        session = AgentSession(llm=model)
        await session.start(agent=Assistant(), room=ctx.room)

    cli.run_app(server)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in LIVEKIT_COMMANDS:
        run_livekit_cli()
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", help="in-process engine: scripted (default), tiny or a checkpoint directory")
    ap.add_argument("--url", help="a duplexkit serve address instead of an in-process engine")
    ap.add_argument("--api-key", default=os.environ.get("DUPLEXKIT_API_KEY"),
                    help="the server's --api-key (default: $DUPLEXKIT_API_KEY)")
    ap.add_argument("--input", type=Path, default=ASSETS / "question_16k.wav", help="what the user says (WAV)")
    ap.add_argument("--output", type=Path, default=Path("livekit_answer.wav"), help="what the agent says (24 kHz WAV)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--idle-s", type=float, default=3.0, help="stop after the agent listened this long (s) after answering")
    args = ap.parse_args()
    try:
        return asyncio.run(run_offline(args, server_health(args.url) if args.url else None))
    except ConnectionError as exc:  # no server at --url
        print(f"error: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 3  # as the CLI and the other examples
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
