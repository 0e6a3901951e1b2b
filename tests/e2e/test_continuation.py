"""Cross-replica continuation (docs/clients.md "Continuing elsewhere"):
two real ``duplexkit serve scripted`` processes; the first is killed (SIGKILL) in the middle of a
spoken answer; the client continues on the second, seeded with the instructions, the reference
voice and the transcript as the user heard it. Lossy by design: the second model gets text only.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from duplexkit.audio import read_wav
from duplexkit.clients import ContinuationSeed, DuplexClient, played_transcript
from duplexkit.clients.continuation import TRANSCRIPT_HEADER
from duplexkit.errors import DuplexConnectionError

from _serverproc import ServerProc
from _timing import bound

pytestmark = pytest.mark.e2e

ARGS = ("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=6", "--silence-slack-ms", "0")


async def test_continue_on_a_second_server_after_the_first_dies(fixtures_audio):
    ref = fixtures_audio / "ref_voice_16k.wav"
    with ServerProc(*ARGS) as first, ServerProc(*ARGS) as second:
        a = DuplexClient(first.ws_url, heartbeat_s=None, resume_attempts=2, input_rate=16_000,
                         ref_audio=ref, session={"instructions": "You are a ship's navigator.",
                                                 "turn_detection": None})
        await a.connect()
        sha = a.session["ref_audio"]["sha256"]
        speech, _ = read_wav(fixtures_audio / "question_16k.wav", 16_000)
        for i in range(0, 16_000 * 2, 1600):
            await a.send_audio(speech[i:i + 1600])
        await a.commit()  # the user turn becomes an item (as the server VAD would make it)
        h = await a.create_response()
        chunks = 0
        async for _ in h.audio():  # the answer plays (VirtualPlayer, real time) while it streams
            chunks += 1
            if chunks == 2:
                break
        first.stop(signal.SIGKILL)  # the replica dies mid-answer: no session.closed, no close frame
        with pytest.raises(DuplexConnectionError):
            await h.wait(timeout=bound(60))
        assert a.closed or a.connection_state == "closed"
        await a.close()  # the player is flushed: what was heard is final
        seed = a.continuation()

        # what the seed carries: instructions, the same reference clip, the transcript as heard
        assert seed.instructions == "You are a ship's navigator." and seed.ref_audio.startswith("data:audio/wav")
        assert seed.turns[0] == {"role": "user", "text": "[the user spoke; no transcript]"}
        played = played_transcript(h)
        assert seed.turns[1] == {"role": "assistant", "text": played} and played
        assert h.transcript.startswith(played) and len(played) <= len(h.transcript)
        assert 0 < h.played_ms <= h.audio_ms
        seed = ContinuationSeed.from_json(seed.to_json())  # e.g. kept by the application meanwhile

        async with DuplexClient(second.ws_url, heartbeat_s=None, continuation=seed,
                                session={"turn_detection": None}) as b:
            assert b.session["instructions"] == "You are a ship's navigator."
            assert b.session["ref_audio"]["sha256"] == sha  # the same voice clip
            assert b.session["id"] != a.session_id
            evs = b.events()
            seen = []
            while not any(e.type == "conversation.item.added" for e in seen):
                seen.append(await asyncio.wait_for(evs.__anext__(), bound(30)))
            item = next(e for e in seen if e.type == "conversation.item.added").item
            assert item.role == "system"
            text = item.content[0].text
            assert text.startswith(TRANSCRIPT_HEADER)
            assert text.splitlines()[1:] == ["User: [the user spoke; no transcript]", f"Assistant: {played}"]
            # the server holds it in the conversation (retrieved from the second server's history)
            await b.send_event({"type": "conversation.item.retrieve", "item_id": item.id})
            while True:
                ev = await asyncio.wait_for(evs.__anext__(), bound(30))
                if ev.type == "conversation.item.retrieved":
                    break
            assert ev.item.content[0].text == text
            # and the continued session talks: a spoken answer in the same voice
            for i in range(0, 16_000, 1600):
                await b.send_audio(speech[i:i + 1600])
            h2 = await b.create_response()
            await h2.wait(timeout=bound(120))
            assert h2.status == "completed" and h2.audio_samples == 24_000 * 6
