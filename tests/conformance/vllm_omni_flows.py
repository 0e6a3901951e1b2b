"""Flows of vLLM-Omni's MiniCPM-o 4.5 clients, driven through their unmodified ``vllm_omni.clients``
library (installed by ``_thirdparty.vllm_omni_clients``; nothing of theirs is copied here).

The calls follow the library's documented use for MiniCPM-o 4.5 (the ``DuplexClient`` docstring and
``vllm_omni.clients.minicpmo_4_5``): the preset session config (``overlap_policy: listen_only``,
``playback_commit_policy: ack_only``, ``extra_body.auto_response``), default model
``openbmb/MiniCPM-o-4_5``, ``stream_pcm`` + ``commit``, ``responses()`` skipping listen decisions,
``audio()`` with ``ack_playback`` naming the item ``"item_" + response_id`` (as their
``acknowledge_collected_playback`` does), and ``cancel_response`` for a client barge-in after which
the model answers on its own (no ``response.create``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

DEFAULT_MODEL = "openbmb/MiniCPM-o-4_5"  # the default of vLLM-Omni's MiniCPM-o examples


def _pcm(wav: Path, silence_s: float) -> bytes:
    from vllm_omni.clients.duplex import read_pcm16_wav

    return read_pcm16_wav(Path(wav)) + b"\0\0" * int(16_000 * silence_s)


async def _next_spoken(client, *, exclude: set, timeout: float):
    async with asyncio.timeout(timeout):
        async for response in client.responses():
            if response.decision == "listen" or response.response_id in exclude:
                continue
            return response
    raise AssertionError("the session ended before a spoken response")


async def _play(client, response, *, stop_after_chunks: int | None = None) -> bytes:
    """Consume a response's audio as their examples do: ack cumulative playback after each chunk."""
    audio = b""
    n = 0
    async for chunk in response.audio():
        audio += chunk
        n += 1
        await client.ack_playback(response.played_ms, response_id=response.response_id,
                                  item_id=f"item_{response.response_id}")
        if stop_after_chunks is not None and n >= stop_after_chunks:
            break
    return audio


async def _collect(client, into: list) -> None:
    async for ev in client.events():
        into.append(ev.raw)


async def duplex_turn(ws_url: str, wav: Path, *, model: str = DEFAULT_MODEL, timeout: float = 120.0) -> dict:
    """One model-native turn: speech, commit, the model's spoken answer played and acked."""
    from vllm_omni.clients.duplex import DuplexClient
    from vllm_omni.clients.minicpmo_4_5 import create_duplex_session_config

    events: list = []
    async with DuplexClient(ws_url, model=model, config=create_duplex_session_config()) as client:
        collector = asyncio.create_task(_collect(client, events))
        await client.stream_pcm(_pcm(wav, 1.0), realtime=False)
        await client.commit()
        response = await _next_spoken(client, exclude=set(), timeout=timeout)
        audio = await _play(client, response)
        await asyncio.wait_for(response.wait(), timeout)
        await asyncio.sleep(0.3)  # let a late error (e.g. a refused ack) arrive before closing
        collector.cancel()
    return {"session_id": client.session_id, "response_id": response.response_id, "audio_bytes": len(audio),
            "transcript": response.transcript, "status": (response.done_event.raw.get("response") or {}).get("status")
            if response.done_event is not None else None, "events": events}


async def barge_in(ws_url: str, wav: Path, interrupt_wav: Path, *, model: str = DEFAULT_MODEL,
                   timeout: float = 120.0) -> dict:
    """A client barge-in: while the first answer plays, cancel it and speak again; the model then
    answers the new speech on its own."""
    from vllm_omni.clients.duplex import DuplexClient
    from vllm_omni.clients.minicpmo_4_5 import create_duplex_session_config

    events: list = []
    async with DuplexClient(ws_url, model=model, config=create_duplex_session_config()) as client:
        collector = asyncio.create_task(_collect(client, events))
        await client.stream_pcm(_pcm(wav, 1.0), realtime=False)
        await client.commit()
        first = await _next_spoken(client, exclude=set(), timeout=timeout)
        first_audio = await _play(client, first, stop_after_chunks=1)
        await client.cancel_response(first.response_id)
        await asyncio.wait_for(first.wait(), timeout)
        await client.stream_pcm(_pcm(interrupt_wav, 1.0), realtime=False)
        await client.commit()
        second = await _next_spoken(client, exclude={first.response_id}, timeout=timeout)
        second_audio = await _play(client, second)
        await asyncio.wait_for(second.wait(), timeout)
        await asyncio.sleep(0.3)
        collector.cancel()

    def status(h):
        return (h.done_event.raw.get("response") or {}).get("status") if h.done_event is not None else None

    return {"first_id": first.response_id, "first_status": status(first), "first_audio_bytes": len(first_audio),
            "second_id": second.response_id, "second_status": status(second),
            "second_audio_bytes": len(second_audio), "second_transcript": second.transcript, "events": events}
