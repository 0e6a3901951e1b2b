"""The third-party clients of the conformance suite once against the REAL tiny engine (random
weights, the real three-stage runtime) behind ``duplexkit serve tiny`` (docs/server.md, "Interop").

Random weights never end a turn: a response ends ``incomplete`` at the token cap (or ``cancelled``).
The tests assert on statuses, audio and event order, never on time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _serverproc import ServerProc  # noqa: E402
from _thirdparty import agents_sdk, vllm_omni_clients  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.engine]
pytest.importorskip("torch")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
ENDED = ("completed", "incomplete")


@pytest.fixture(scope="module")
def tiny_server():
    # the tiny engine on 2 shared CPU cores is often slower than real time (its vocoder takes 0.5-1.5 s
    # per 1-s chunk), and these clients stream in real time: the default 10 s of unconsumed input
    # then ends a turn with input_backpressure on a busy machine (seen once in a full run). These
    # tests are about interop, not backpressure (tested in tests/e2e), so allow a minute.
    with ServerProc("tiny", "--max-output-tokens", "40", "--layout", "cpu", "--max-pending-input-s", "60",
                    ready_timeout_s=600) as srv:
        assert httpx.get(srv.url + "/health").json()["random_weights"] is True
        yield srv


async def test_tiny_vllm_omni_turn_and_barge_in(tiny_server):
    vllm_omni_clients()
    from vllm_omni_flows import barge_in, duplex_turn

    s = await duplex_turn(tiny_server.ws_url, FIXTURES / "question_16k.wav", timeout=600)
    assert s["status"] in ENDED and s["audio_bytes"] > 0
    assert "error" not in [e["type"] for e in s["events"]]
    b = await barge_in(tiny_server.ws_url, FIXTURES / "question_16k.wav", FIXTURES / "interrupt_16k.wav", timeout=600)
    assert b["first_status"] in ("cancelled", *ENDED) and b["second_status"] in ENDED
    assert b["second_audio_bytes"] > 0 and "error" not in [e["type"] for e in b["events"]]


async def test_tiny_openai_sdk_beta_turn(tiny_server):
    from openai_sdk_turns import beta_commit_driven_turn

    s = await beta_commit_driven_turn(tiny_server.url, "gpt-4o-realtime-preview", FIXTURES / "question_16k.wav",
                                      timeout=600)
    assert s["status"] in ENDED and s["audio_samples"] > 0


async def test_tiny_agents_sdk_turn(tiny_server):
    agents_sdk()
    from agents_sdk_flows import voice_turn

    s = await voice_turn(tiny_server.ws_url, FIXTURES / "question_16k.wav", timeout=600)
    assert not s["errors"], s["errors"]
    assert s["audio"] and all(len(a) > 0 for a in s["audio"].values())


def test_tiny_chat_openai_sdk_and_vllm_omni_style(tiny_server):
    import base64

    from openai import OpenAI
    from openai.types.chat import ChatCompletion

    c = OpenAI(api_key="sk-unused", base_url=tiny_server.url + "/v1").chat.completions.create(
        model="gpt-4o-audio-preview", modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"},
        max_tokens=8, messages=[{"role": "user", "content": "Hello"}])
    ChatCompletion.model_validate(c.model_dump())
    assert len(c.choices) == 1 and len(base64.b64decode(c.choices[0].message.audio.data)) > 0
    r = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=600, json={
        "model": "openbmb/MiniCPM-o-4_5", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]})
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == [0, 1] and choices[1]["message"]["audio"]["data"]


async def test_tiny_openai_sdk_ga_barge_in(tiny_server):
    from openai_sdk_turns import server_vad_barge_in

    s = await server_vad_barge_in(tiny_server.url, "gpt-realtime", FIXTURES / "question_16k.wav",
                                  FIXTURES / "interrupt_16k.wav", timeout=600)
    assert s["statuses"][0] == "cancelled" and s["statuses"][1] in ENDED, s["statuses"]
    assert s["audio_samples"][0] > 0 and s["audio_samples"][1] > 0
    assert s["items"][1] != s["first_item"] and s["truncated"] not in (None, "sent")
    assert s["truncated"].item_id == s["first_item"]


async def test_tiny_agents_sdk_barge_in(tiny_server):
    agents_sdk()
    from agents_sdk_flows import voice_turn

    s = await voice_turn(tiny_server.ws_url, FIXTURES / "question_16k.wav",
                         interrupt_wav=FIXTURES / "interrupt_16k.wav", timeout=600)
    assert not s["errors"], s["errors"]
    assert s["interrupted"] and len(s["audio"]) == 2 and all(len(a) > 0 for a in s["audio"].values())


def test_tiny_chat_openai_sdk_stream_audio(tiny_server):
    import base64

    from openai import OpenAI
    from openai.types.chat import ChatCompletionChunk

    stream = OpenAI(api_key="sk-unused", base_url=tiny_server.url + "/v1", timeout=600).chat.completions.create(
        model="gpt-4o-audio-preview", modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"},
        max_tokens=8, messages=[{"role": "user", "content": "Hello"}], stream=True)
    content, pcm, finish = "", b"", None
    for chunk in stream:
        ChatCompletionChunk.model_validate(chunk.model_dump())
        for ch in chunk.choices:
            assert ch.index == 0
            content += ch.delta.content or ""
            if ch.delta.audio is not None:
                pcm += base64.b64decode(ch.delta.audio.data or "")
            finish = ch.finish_reason or finish
    assert content == "" and len(pcm) > 0 and len(pcm) % 2 == 0 and finish in ("stop", "length")
