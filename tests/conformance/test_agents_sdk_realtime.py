"""The OpenAI Agents SDK realtime runner (``openai-agents`` from PyPI, installed test-only with
``--no-deps``) against a real ``duplexkit serve scripted`` process, default settings except the URL
(docs/server.md, "Interop"): its ``semantic_vad`` default, voice and instructions are accepted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _serverproc import ServerProc  # noqa: E402
from _thirdparty import agents_sdk  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"


@pytest.fixture(scope="module")
def sdk():
    agents_sdk()
    import agents.realtime  # noqa: F401


@pytest.fixture(scope="module")
def server():
    with ServerProc("scripted", "--scripted", "units_per_turn=3") as srv:
        yield srv


def _assistant_transcripts(history: list) -> list[str]:
    return ["".join(c.get("transcript") or c.get("text") or "" for c in h.get("content", []) if isinstance(c, dict))
            for h in history if h.get("role") == "assistant"]


async def test_agents_sdk_voice_turn(sdk, server):
    from agents_sdk_flows import voice_turn

    s = await voice_turn(server.ws_url, FIXTURES / "question_16k.wav")
    assert not s["errors"], s["errors"]
    assert [len(a) for a in s["audio"].values()] == [3 * 48000]  # 3 units of 1 s, 24 kHz pcm16
    assert _assistant_transcripts(s["history"]) == ["Hello there, this is a scripted "]
    assert "audio_end" in s["types"] and not s["interrupted"]
    assert "WebSocket /v1/realtime\" [accepted]" in server.output()


async def test_agents_sdk_barge_in(sdk, server):
    from agents_sdk_flows import voice_turn

    s = await voice_turn(server.ws_url, FIXTURES / "question_16k.wav", interrupt_wav=FIXTURES / "interrupt_16k.wav")
    assert not s["errors"], s["errors"]
    assert s["interrupted"]  # the server VAD (its semantic_vad, mapped) cut the first answer
    sizes = list(s["audio"].values())
    assert len(sizes) == 2 and len(sizes[0]) < 3 * 48000 and len(sizes[1]) == 3 * 48000
    first, second = _assistant_transcripts(s["history"])
    assert "Hello there, this is a scripted ".startswith(first) and second == "Hello there, this is a scripted "
