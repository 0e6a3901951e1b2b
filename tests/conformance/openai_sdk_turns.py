"""Turns driven by the unmodified OpenAI Python SDK realtime client (``client.realtime.connect``).

Shared by ``tests/conformance/test_openai_sdk_realtime.py`` (ScriptedEngine server) and
``tests/e2e/test_tiny_e2e.py`` (the real tiny engine). Every received event is also validated
against ``openai.types.realtime.RealtimeServerEvent`` (the conformance oracle, docs/protocol.md §2),
except duplexkit extension events, which the SDK surfaces untyped.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from pydantic import TypeAdapter

from duplexkit.audio import float32_to_pcm16, read_wav
from duplexkit.protocol import EXTENSION_EVENT_TYPES

EXTENSION_EVENTS = EXTENSION_EVENT_TYPES  # duplexkit.protocol.vocabulary


def _adapter():
    from openai.types.realtime import RealtimeServerEvent

    return TypeAdapter(RealtimeServerEvent)


def sdk_client(http_url: str, api_key: str = "sk-unused"):
    from openai import AsyncOpenAI

    ws = http_url.replace("http://", "ws://").replace("https://", "wss://")
    return AsyncOpenAI(api_key=api_key, base_url=http_url + "/v1", websocket_base_url=ws + "/v1")


def pcm24k_b64(path, seconds_of_silence: float = 0.0, chunk_s: float = 0.2) -> list[str]:
    """A WAV as 24 kHz pcm16 base64 appends (the compat profile's OpenAI default rate)."""
    audio, _ = read_wav(path, 24_000)
    if seconds_of_silence:
        audio = np.concatenate([audio, np.zeros(int(24_000 * seconds_of_silence), np.float32)])
    step = int(24_000 * chunk_s)
    return [base64.b64encode(float32_to_pcm16(audio[i:i + step])).decode() for i in range(0, len(audio), step)]


async def collect_until_done(conn, adapter, timeout: float) -> list:
    """Receive (and validate) events until ``response.done``; returns the SDK event objects."""
    events = []
    async with asyncio.timeout(timeout):
        while True:
            ev = await conn.recv()
            raw = ev.model_dump(exclude_unset=True) if hasattr(ev, "model_dump") else dict(ev)
            if raw.get("type") not in EXTENSION_EVENTS:
                adapter.validate_python(raw)
            events.append(ev)
            if ev.type == "error":
                raise AssertionError(f"server error: {raw}")
            if ev.type == "response.done":
                return events


async def commit_driven_turn(http_url: str, model: str, wav, *, timeout: float = 60.0) -> dict:
    """append + commit + response.create with the SDK; returns a summary of the response."""
    adapter = _adapter()
    client = sdk_client(http_url)
    async with client.realtime.connect(model=model) as conn:
        first = await conn.recv()
        assert first.type == "session.created", first.type
        adapter.validate_python(first.model_dump(exclude_unset=True))
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                           "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                                               "turn_detection": None}}})
        upd = await conn.recv()
        assert upd.type == "session.updated", upd
        for chunk in pcm24k_b64(wav):
            await conn.input_audio_buffer.append(audio=chunk)
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        events = await collect_until_done(conn, adapter, timeout)
    return summarize(events)


async def server_vad_turn(http_url: str, model: str, wav, *, timeout: float = 60.0) -> dict:
    """The compat profile's default server_vad (create_response: true): speech then silence
    triggers a response without any commit or response.create."""
    adapter = _adapter()
    client = sdk_client(http_url)
    async with client.realtime.connect(model=model) as conn:
        first = await conn.recv()
        assert first.type == "session.created"
        td = first.session.audio.input.turn_detection
        assert td is not None and td.type == "server_vad"
        for chunk in pcm24k_b64(wav, seconds_of_silence=1.5):
            await conn.input_audio_buffer.append(audio=chunk)
        events = await collect_until_done(conn, adapter, timeout)
    return summarize(events)


def summarize(events: list) -> dict:
    types = [e.type for e in events]
    done = events[-1]
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    created = next(e for e in events if e.type == "response.created")
    return {"types": types, "status": done.response.status, "audio_samples": len(audio) // 2,
            "transcript": transcript, "response_id": created.response.id,
            "first_chunk_samples": next((len(base64.b64decode(e.delta)) // 2 for e in events
                                         if e.type == "response.output_audio.delta"), 0)}


def _beta_adapter():
    from openai.types.beta.realtime import RealtimeServerEvent as BetaEvent

    return TypeAdapter(BetaEvent)


async def beta_commit_driven_turn(http_url: str, model: str, wav, *, timeout: float = 60.0) -> dict:
    """The SDK's beta realtime client (``client.beta.realtime.connect``, header ``OpenAI-Beta:
    realtime=v1``): beta-shaped session.update, append + commit + response.create; every event is
    validated against ``openai.types.beta.realtime.RealtimeServerEvent``."""
    adapter = _beta_adapter()
    client = sdk_client(http_url)
    events = []
    async with client.beta.realtime.connect(model=model) as conn:
        first = await conn.recv()
        assert first.type == "session.created", first.type
        adapter.validate_python(first.model_dump(exclude_unset=True))
        await conn.session.update(session={"modalities": ["audio", "text"], "input_audio_format": "pcm16",
                                           "output_audio_format": "pcm16", "turn_detection": None,
                                           "instructions": "Answer briefly."})
        upd = await conn.recv()
        assert upd.type == "session.updated", upd
        adapter.validate_python(upd.model_dump(exclude_unset=True))
        for chunk in pcm24k_b64(wav):
            await conn.input_audio_buffer.append(audio=chunk)
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        async with asyncio.timeout(timeout):
            while True:
                ev = await conn.recv()
                raw = ev.model_dump(exclude_unset=True)
                if raw.get("type") not in EXTENSION_EVENTS:
                    adapter.validate_python(raw)
                events.append(ev)
                if ev.type == "error":
                    raise AssertionError(f"server error: {raw}")
                if ev.type == "response.done":
                    break
    types = [e.type for e in events]
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.audio.delta")
    transcript = "".join(e.delta for e in events if e.type == "response.audio_transcript.delta")
    return {"types": types, "status": events[-1].response.status, "audio_samples": len(audio) // 2,
            "transcript": transcript, "instructions": upd.session.instructions}


async def semantic_vad_turn(http_url: str, model: str, wav, *, timeout: float = 60.0) -> dict:
    """OpenAI's default GA turn detection of the Agents SDK (``semantic_vad``) with instructions and
    a voice in the same update: all applied, the turn answered after the speech ends."""
    adapter = _adapter()
    client = sdk_client(http_url)
    async with client.realtime.connect(model=model) as conn:
        first = await conn.recv()
        assert first.type == "session.created"
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                           "audio": {"input": {"turn_detection": {"type": "semantic_vad",
                                                                                  "eagerness": "high"}},
                                                     "output": {"voice": "ash"}}})
        upd = await conn.recv()
        assert upd.type == "session.updated", upd
        adapter.validate_python(upd.model_dump(exclude_unset=True))
        for chunk in pcm24k_b64(wav, seconds_of_silence=1.5):
            await conn.input_audio_buffer.append(audio=chunk)
        events = await collect_until_done(conn, adapter, timeout)
    s = summarize(events)
    s["session"] = upd.session
    return s


async def server_vad_barge_in(http_url: str, model: str, wav, interrupt_wav, *,
                              pause_s: float = 0.8, timeout: float = 60.0) -> dict:
    """A barge-in as OpenAI documents it for a WebSocket client with the default ``server_vad``
    (``interrupt_response: true``): speak; once the answer's first audio arrives, speak over it; on
    ``input_audio_buffer.speech_started`` the client stops its playback and sends
    ``conversation.item.truncate`` with the ms of the answer it received (all of it "played": this
    client plays instantly). ``pause_s`` (s) of silence after the first utterance: enough for the
    server VAD to end the turn, short enough that the answer still runs when the user speaks again
    (the duplex engine advances with the input it is sent). The server cancels the answer and
    answers the second utterance. Every event is validated against ``openai.types.realtime.RealtimeServerEvent``; returns both
    responses' statuses, audio sample counts, the truncate reply and the event types in order."""
    adapter = _adapter()
    client = sdk_client(http_url)
    events: list = []
    audio: dict[str, int] = {}  # item_id -> samples received (24 kHz pcm16)
    done: list = []
    truncated = None
    async with client.realtime.connect(model=model) as conn:
        first = await conn.recv()
        assert first.type == "session.created", first.type
        adapter.validate_python(first.model_dump(exclude_unset=True))
        td = first.session.audio.input.turn_detection
        assert td is not None and td.type == "server_vad" and td.interrupt_response, td

        async def speak(path, silence_s):
            for chunk in pcm24k_b64(path, seconds_of_silence=silence_s):
                await conn.input_audio_buffer.append(audio=chunk)

        sender = asyncio.create_task(speak(wav, pause_s))
        first_item = None
        async with asyncio.timeout(timeout):
            while len(done) < 2:
                ev = await conn.recv()
                raw = ev.model_dump(exclude_unset=True)
                if raw.get("type") not in EXTENSION_EVENTS:
                    adapter.validate_python(raw)
                events.append(ev)
                if ev.type == "error":
                    raise AssertionError(f"server error: {raw}")
                if ev.type == "response.output_audio.delta":
                    audio[ev.item_id] = audio.get(ev.item_id, 0) + len(base64.b64decode(ev.delta)) // 2
                    if first_item is None:  # the answer is playing: speak over it
                        first_item = ev.item_id
                        await sender
                        sender = asyncio.create_task(speak(interrupt_wav, 1.5))
                elif ev.type == "input_audio_buffer.speech_started" and first_item is not None and not done \
                        and truncated is None:
                    await conn.conversation.item.truncate(item_id=first_item, content_index=0,
                                                          audio_end_ms=audio[first_item] * 1000 // 24_000)
                    truncated = "sent"
                elif ev.type == "conversation.item.truncated":
                    truncated = ev
                elif ev.type == "response.done":
                    done.append(ev.response)
        await sender
    items = [r.output[0].id if r.output else None for r in done]
    return {"types": [e.type for e in events], "statuses": [r.status for r in done],
            "audio_samples": [audio.get(i, 0) for i in items], "items": items, "first_item": first_item,
            "truncated": truncated}
