"""A real LiveKit ``AgentSession`` on ``duplexkit.integrations.livekit.RealtimeModel`` with in-memory audio
I/O (run with the frameworks venv's python, scripts/setup_frameworks.sh; driven by
tests/e2e/test_livekit_plug.py). No LiveKit room or server.

* input: a 16 kHz microphone made of 20 ms ``rtc.AudioFrame`` s at real-time pace, silence unless a
  WAV is being "spoken";
* output: an ``AudioOutput`` that plays on a virtual real-time clock (what was pushed is "played"
  at 1x from the first frame of a segment; ``clear_buffer`` stops it there and reports the position).

Scenario (one session): the user asks the question WAV; duplexkit's VAD ends the turn, the scripted
decider calls ``get_weather`` (a ``@function_tool``), LiveKit runs it and feeds the output back, and
the answer plays. Then ``generate_reply()`` starts a long answer; 1 s into its playout the user
speaks the interrupt WAV over it: duplexkit's barge-in must stop LiveKit's playout.

Writes a JSON report to ``--out``. ``--bench N`` instead measures, N times each on the same engine
or server, the time from asking for a reply to its first audio frame: the raw duplexkit client
(``create_response`` -> first chunk of ``ResponseHandle.audio()``) and through the plugin
(``generate_reply`` -> first frame of the generation's audio stream).

Usage: python _livekit_plug_agent.py (--inline | --url ws://127.0.0.1:PORT) --wav Q.wav --interrupt I.wav --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
import traceback
import wave
from pathlib import Path

import numpy as np
from livekit import rtc
from livekit.agents import Agent, AgentSession, function_tool, llm
from livekit.agents.voice import io

from duplexkit.integrations.livekit import RealtimeModel

FRAME_S = 0.02
BARGE_IN_S = 1.0  # the user starts talking this far into the long reply's playout
IN_RATE = 16_000
CALLS: list = []


@function_tool
async def get_weather(city: str) -> dict:
    """The current weather in a city.

    Args:
        city: The city, e.g. Paris.
    """
    CALLS.append({"city": city, "t": time.monotonic()})
    return {"city": city, "temperature_c": 21, "conditions": "sunny"}


def read_pcm16(path: Path) -> np.ndarray:
    with wave.open(str(path), "rb") as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2 and w.getframerate() == IN_RATE
        return np.frombuffer(w.readframes(w.getnframes()), np.int16)


class Microphone(io.AudioInput):
    """20 ms frames at real-time pace: silence, or the samples given to :meth:`say`."""

    def __init__(self) -> None:
        super().__init__(label="duplexkit-test-mic")
        self._q: asyncio.Queue = asyncio.Queue()
        self._pending = np.zeros(0, np.int16)
        self._said = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    def say(self, pcm: np.ndarray) -> asyncio.Event:
        self._pending = np.concatenate([self._pending, pcm])
        self._said.clear()
        return self._said

    async def _run(self) -> None:
        n = int(IN_RATE * FRAME_S)
        t_next = time.monotonic()
        while True:
            if self._pending.size:
                chunk, self._pending = self._pending[:n], self._pending[n:]
                if not self._pending.size:
                    self._said.set()
                chunk = np.pad(chunk, (0, n - chunk.size))
            else:
                chunk = np.zeros(n, np.int16)
            self._q.put_nowait(rtc.AudioFrame(chunk.tobytes(), IN_RATE, 1, n))
            t_next += FRAME_S
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))

    async def __anext__(self) -> rtc.AudioFrame:
        return await self._q.get()

    def close(self) -> None:
        self._task.cancel()


class ClockSpeaker(io.AudioOutput):
    """Plays on a virtual real-time clock; records each segment (samples, rates, position, interrupted)."""

    def __init__(self) -> None:
        super().__init__(label="duplexkit-test-speaker", capabilities=io.AudioOutputCapabilities(pause=False),
                         sample_rate=None)
        self.segments: list = []
        self._cur: dict | None = None
        self._waiting: list = []

    def position(self, seg: dict) -> float:
        return min(time.monotonic() - seg["t0"], seg["pushed_s"])

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._cur is None:
            self._cur = {"t0": time.monotonic(), "t_start_wall": time.time(), "pushed_s": 0.0, "samples": 0,
                         "rates": [], "interrupted": False, "position_s": None, "cleared": asyncio.Event()}
            self.segments.append(self._cur)
            self.on_playback_started(created_at=time.time())
        seg = self._cur
        seg["pushed_s"] += frame.samples_per_channel / frame.sample_rate
        seg["samples"] += frame.samples_per_channel
        if frame.sample_rate not in seg["rates"]:
            seg["rates"].append(frame.sample_rate)

    def flush(self) -> None:
        super().flush()
        seg, self._cur = self._cur, None
        if seg is not None:
            self._waiting.append(asyncio.create_task(self._play_out(seg)))

    async def _play_out(self, seg: dict) -> None:
        left = seg["t0"] + seg["pushed_s"] - time.monotonic()
        if not seg["cleared"].is_set() and left > 0:
            try:
                await asyncio.wait_for(seg["cleared"].wait(), left)
            except asyncio.TimeoutError:
                pass
        if seg["position_s"] is None:
            seg["position_s"] = seg["pushed_s"]
        seg["t_end"] = time.monotonic()
        self.on_playback_finished(playback_position=seg["position_s"], interrupted=seg["interrupted"])

    def clear_buffer(self) -> None:
        for seg in self.segments:
            if seg["position_s"] is None and not seg["cleared"].is_set():
                seg["position_s"] = self.position(seg)
                seg["cleared_at"] = time.monotonic()
                seg["interrupted"] = seg["position_s"] < seg["pushed_s"] - 1e-3
                seg["cleared"].set()

    def playing(self) -> dict | None:
        for seg in self.segments:
            if seg["position_s"] is None and self.position(seg) < seg["pushed_s"]:
                return seg
        return None


async def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def make_model(args, engine) -> RealtimeModel:
    if engine is not None:
        return RealtimeModel(engine=engine)
    return RealtimeModel(url=args.url)


def make_engine(args):
    if not args.inline:
        return None
    from duplexkit.testing import ScriptConfig, ScriptedEngine

    print("[livekit-plug] inline engine: duplexkit ScriptedEngine (scripted tone answers, no model weights)",
          file=sys.stderr)
    return ScriptedEngine(ScriptConfig(units_per_turn=args.units_per_turn,
                                       tool_script=[("get_weather", {"city": "Paris"})]))


async def scenario(args) -> dict:
    engine = make_engine(args)
    model = make_model(args, engine)
    t0 = time.monotonic()
    now = lambda: round(time.monotonic() - t0, 3)  # noqa: E731
    mic, speaker = Microphone(), ClockSpeaker()
    session = AgentSession(llm=model, aec_warmup_duration=None)
    session.input.audio = mic
    session.output.audio = speaker
    agent = Agent(instructions="You are a helpful voice assistant. Use get_weather for weather questions.",
                  tools=[get_weather])
    rep: dict = {"transcripts": [], "items": [], "tools_executed": [], "speech_started": [], "generations": [],
                 "errors": [], "acks": [], "agent_states": [], "failure": None}
    session.on("user_input_transcribed", lambda ev: rep["transcripts"].append(
        {"t": now(), "transcript": ev.transcript, "is_final": ev.is_final}))
    session.on("conversation_item_added", lambda ev: rep["items"].append(
        {"t": now(), **ev.item.model_dump(mode="json", include={"id", "type", "role", "content", "interrupted",
                                                                 "call_id", "name", "arguments", "output"})}))
    session.on("function_tools_executed", lambda ev: rep["tools_executed"].append(
        {"t": now(), "calls": [{"call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                               for c in ev.function_calls],
         "outputs": [{"call_id": o.call_id, "output": o.output, "is_error": o.is_error}
                     for o in ev.function_call_outputs]}))
    session.on("agent_state_changed", lambda ev: rep["agent_states"].append((now(), ev.new_state)))
    session.on("error", lambda ev: rep["errors"].append({"t": now(), "error": repr(ev.error)}))
    try:
        await session.start(agent=agent, record=False)
        (rt,) = model._sessions
        rt.on("input_speech_started", lambda _: rep["speech_started"].append(now()))
        rt.on("generation_created", lambda ev: rep["generations"].append(
            {"t": now(), "response_id": ev.response_id, "user_initiated": ev.user_initiated}))
        raw_ack = rt.client.ack_playback

        async def ack(response_id, played_ms, **kw):
            rep["acks"].append({"t": now(), "response_id": response_id, "played_ms": played_ms,
                                "truncate": kw.get("truncate", False)})
            return await raw_ack(response_id, played_ms, **kw)

        rt.client.ack_playback = ack
        await asyncio.wait_for(rt.connected.wait(), args.timeout)
        # 1. the question: transcript, the tool, its answer played
        rep["t_question"] = now()
        await mic.say(read_pcm16(args.wav)).wait()
        rep["t_question_end"] = now()
        await wait_for(lambda: any(i["type"] == "message" and i["role"] == "assistant"
                                   and args.expect_answer in " ".join(i["content"]) for i in rep["items"]),
                       args.timeout, "the spoken answer to the tool's output")
        rep["t_answered"] = now()
        await wait_for(lambda: speaker.playing() is None, args.timeout, "the end of the answer's playout")
        # 2. a long reply, interrupted by the user BARGE_IN_S into its playout
        n_seg = len(speaker.segments)
        rep["t_long_reply"] = now()
        handle = session.generate_reply()
        await wait_for(lambda: len(speaker.segments) > n_seg and speaker.position(speaker.segments[n_seg]) >= BARGE_IN_S,
                       args.timeout, "the long reply's playout")
        rep["t_barge_in"] = now()
        rep["long_reply_segment"] = n_seg
        mic.say(read_pcm16(args.interrupt))
        await asyncio.wait_for(handle.wait_for_playout(), args.timeout)
        rep["t_long_reply_done"] = now()
        await wait_for(lambda: any(a["truncate"] for a in rep["acks"]), 10, "the truncate ack")
        await asyncio.sleep(0.5)
    except Exception:
        rep["failure"] = traceback.format_exc()
    finally:
        rep["calls"] = [{"city": c["city"], "t": round(c["t"] - t0, 3)} for c in CALLS]
        rep["segments"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()
                            if k not in ("cleared", "t0", "t_end", "t_start_wall", "cleared_at")}
                           | {"t_start": round(s["t0"] - t0, 3),
                              "t_cleared": round(s["cleared_at"] - t0, 3) if "cleared_at" in s else None} for s in speaker.segments]
        rep["parameters"] = llm.utils.build_legacy_openai_schema(get_weather, internally_tagged=True)["parameters"]
        rep["history"] = _history(model)
        mic.close()
        await session.aclose()
        await model.aclose()
        if engine is not None:
            await engine.aclose()
    return rep


def _history(model) -> list:
    """The duplexkit session's conversation as LiveKit's mirror holds it (item type, role, text)."""
    out = []
    for s in model._sessions:
        for it in s.chat_ctx.items:
            out.append({"id": it.id, "type": it.type, "role": getattr(it, "role", None),
                        "text": getattr(it, "text_content", None) if it.type == "message" else None})
    return out


async def bench(args) -> dict:
    """First-audio latency of a requested reply: raw client vs the plugin, on one engine/server."""
    from duplexkit.clients import DuplexClient, InlineDuplexClient

    engine = make_engine(args)
    raw_ms, plug_ms = [], []
    session_fields = {"turn_detection": None}
    for i in range(args.bench):
        # raw duplexkit client
        client = (InlineDuplexClient(engine, session=session_fields, auto_ack=False) if engine is not None
                  else DuplexClient(args.url, session=session_fields, auto_ack=False))
        async with client:
            await client.send_audio(np.zeros(3200, np.int16).tobytes())
            t = time.perf_counter()
            h = await client.create_response()
            async for _ in h.audio():
                raw_ms.append((time.perf_counter() - t) * 1000)
                break
            await client.cancel()
        # the plugin (a RealtimeSession, as AgentSession drives it)
        model = (RealtimeModel(engine=engine, turn_detection=None) if engine is not None
                 else RealtimeModel(url=args.url, turn_detection=None))
        rt = model.session()
        await asyncio.wait_for(rt.connected.wait(), 30)
        rt.push_audio(rtc.AudioFrame(np.zeros(3200, np.int16).tobytes(), IN_RATE, 1, 3200))
        t = time.perf_counter()
        gen = await rt.generate_reply()
        async for msg in gen.message_stream:
            async for _ in msg.audio_stream:
                plug_ms.append((time.perf_counter() - t) * 1000)
                break
            break
        rt.interrupt()
        await model.aclose()
    if engine is not None:
        await engine.aclose()
    return {"raw_ms": [round(x, 2) for x in raw_ms], "plugin_ms": [round(x, 2) for x in plug_ms],
            "raw_median_ms": round(statistics.median(raw_ms), 2),
            "plugin_median_ms": round(statistics.median(plug_ms), 2),
            "mode": "inline" if args.inline else "remote"}


def main() -> int:
    ap = argparse.ArgumentParser()
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--inline", action="store_true", help="InlineDuplexClient over a ScriptedEngine")
    mode.add_argument("--url", help="a duplexkit serve address")
    ap.add_argument("--wav", type=Path)
    ap.add_argument("--interrupt", type=Path)
    ap.add_argument("--expect-answer", default="This is a scripted chat reply.")
    ap.add_argument("--units-per-turn", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--bench", type=int, default=0, help="measure first-audio latency N times instead")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        report = asyncio.run(bench(args) if args.bench else scenario(args))
    except Exception:
        traceback.print_exc()
        return 1
    args.out.write_text(json.dumps(report, indent=1, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
