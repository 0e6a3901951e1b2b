"""Flows of the OpenAI Agents SDK realtime runner (``agents.realtime``: ``RealtimeAgent`` +
``RealtimeRunner``), unmodified, with default settings except the URL and a placeholder API key.

Its defaults are what a new user gets: model ``gpt-realtime-*`` (mapped to the served model),
``semantic_vad`` turn detection with ``interrupt_response``, voice ``ash``, 24 kHz pcm16 audio.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from duplexkit.audio import float32_to_pcm16, read_wav

CHUNK_S = 0.1


def pcm24k_chunks(wav: Path, silence_s: float) -> list[bytes]:
    audio, _ = read_wav(wav, 24_000)
    audio = np.concatenate([audio, np.zeros(int(24_000 * silence_s), np.float32)])
    step = int(24_000 * CHUNK_S)
    return [float32_to_pcm16(audio[i:i + step]) for i in range(0, len(audio), step)]


async def _send_paced(session, chunks: list[bytes]) -> None:
    for c in chunks:
        await session.send_audio(c)
        await asyncio.sleep(CHUNK_S / 4)  # faster than real time, but not one burst


async def voice_turn(ws_url: str, wav: Path, *, interrupt_wav: Path | None = None, timeout: float = 120.0) -> dict:
    """Speak; collect the agent's audio until it ends. With ``interrupt_wav``: speak again as soon as
    the first audio arrives (a barge-in), then collect the answer to that."""
    from agents.realtime import RealtimeAgent, RealtimeRunner

    agent = RealtimeAgent(name="Assistant", instructions="You are a helpful voice assistant. Keep answers short.")
    runner = RealtimeRunner(starting_agent=agent)
    session = await runner.run(model_config={"url": ws_url + "/v1/realtime", "api_key": "sk-unused"})
    types: list[str] = []
    audio: dict[str, bytes] = {}
    errors: list = []
    async with session:
        sender = asyncio.create_task(_send_paced(session, pcm24k_chunks(wav, 1.5)))
        interrupted = False
        barged = interrupt_wav is None
        async with asyncio.timeout(timeout):
            async for event in session:
                types.append(event.type)
                if event.type == "error":
                    errors.append(event.error)
                elif event.type == "raw_model_event" and getattr(event.data, "type", "") == "error":
                    errors.append(event.data)
                elif event.type == "audio":
                    audio[event.item_id] = audio.get(event.item_id, b"") + event.audio.data
                    if not barged:
                        barged = True
                        await sender
                        sender = asyncio.create_task(_send_paced(session, pcm24k_chunks(interrupt_wav, 1.5)))
                elif event.type == "audio_interrupted":
                    interrupted = True
                elif event.type == "audio_end" and barged and (interrupt_wav is None or len(audio) >= 2):
                    break
        await sender
    history = [item.model_dump() for item in session._history]  # noqa: SLF001 (read-only inspection)
    return {"types": types, "audio": audio, "errors": errors, "interrupted": interrupted, "history": history}
