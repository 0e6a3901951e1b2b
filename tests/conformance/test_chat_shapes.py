"""Chat completions through the unmodified OpenAI SDK (strict type validation) and in vLLM-Omni's
style, against a real ``duplexkit serve scripted`` process (docs/server.md, "Chat completions")."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from _timing import bound

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _serverproc import ServerProc  # noqa: E402

pytest.importorskip("openai")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
QUESTION = {"role": "user", "content": [
    {"type": "input_audio", "input_audio": {"data": base64.b64encode((FIXTURES / "question_16k.wav").read_bytes()).decode(),
                                            "format": "wav"}}]}
REPLY = "This is a scripted chat reply."  # ScriptConfig.chat_text
SAMPLES = 6 * 9600  # the scripted chat voice: 0.4 s of 24 kHz audio per word


@pytest.fixture(scope="module")
def server():
    with ServerProc("scripted", "--scripted", "units_per_turn=2") as srv:
        yield srv


def _client(server):
    from openai import OpenAI

    return OpenAI(api_key="sk-unused", base_url=server.url + "/v1")


@pytest.mark.parametrize("fmt", ["wav", "pcm16", "flac", "mp3", "opus"])
def test_openai_sdk_non_stream_audio_in_message_audio(server, fmt):
    from openai.types.chat import ChatCompletion

    c = _client(server).chat.completions.create(model="gpt-4o-audio-preview", modalities=["text", "audio"],
                                                 audio={"voice": "alloy", "format": fmt}, messages=[QUESTION])
    ChatCompletion.model_validate(c.model_dump(), strict=False)
    assert len(c.choices) == 1 and c.choices[0].message.content is None
    a = c.choices[0].message.audio
    assert a.id.startswith("audio_") and a.transcript == REPLY and a.expires_at > 0
    raw = base64.b64decode(a.data)
    if fmt == "pcm16":
        assert len(raw) == 2 * SAMPLES  # pcm16: 2 bytes a sample
    else:
        audio, rate = sf.read(io.BytesIO(raw), dtype="float32")
        assert rate == 24000 and abs(len(audio) - SAMPLES) <= 2000  # lossy codecs pad a little


def test_openai_sdk_stream_audio_in_delta_audio(server):
    from openai.types.chat import ChatCompletionChunk

    stream = _client(server).chat.completions.create(model="gpt-4o-audio-preview", modalities=["text", "audio"],
                                                      audio={"voice": "alloy", "format": "pcm16"},
                                                      messages=[QUESTION], stream=True)
    content, transcript, pcm, finish = "", "", b"", None
    for chunk in stream:
        ChatCompletionChunk.model_validate(chunk.model_dump())
        for ch in chunk.choices:
            assert ch.index == 0
            content += ch.delta.content or ""
            audio = ch.delta.audio  # openai.types.chat.chat_completion_chunk.ChoiceDeltaAudio
            if audio is not None:
                assert audio.id.startswith("audio_")
                transcript += audio.transcript or ""
                pcm += base64.b64decode(audio.data or "")
            finish = ch.finish_reason or finish
    assert content == ""  # no base64 in the text a consumer joins
    assert transcript == REPLY and len(pcm) == 2 * SAMPLES and finish == "stop"


def test_openai_sdk_text_only(server):
    c = _client(server).chat.completions.create(model="gpt-4o", modalities=["text"], messages=[
        {"role": "user", "content": "Hello"}])
    assert len(c.choices) == 1 and c.choices[0].message.content == REPLY
    assert c.choices[0].message.audio is None


def test_vllm_omni_style_without_modalities_speaks_two_choices(server):
    # vLLM-Omni's MiniCPM-o examples send no modalities and no audio object: text and speech
    r = httpx.post(server.url + "/v1/chat/completions", timeout=bound(60), json={
        "model": "openbmb/MiniCPM-o-4_5", "messages": [QUESTION]})
    body = r.json()
    assert r.status_code == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"]["content"] == REPLY
    audio, rate = sf.read(io.BytesIO(base64.b64decode(body["choices"][1]["message"]["audio"]["data"])), dtype="float32")
    assert rate == 24000 and len(audio) == SAMPLES
    # streaming in their style: modality-tagged chunks, audio in delta.content at index 1
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=bound(60), json={
            "model": "openbmb/MiniCPM-o-4_5", "messages": [QUESTION], "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    audio_chunks = [c for c in chunks if c.get("modality") == "audio" and c["choices"][0]["delta"].get("content")]
    assert audio_chunks and all(c["choices"][0]["index"] == 1 for c in audio_chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("modality") == "text")
    assert text == REPLY


def test_audio_object_without_voice_keeps_the_vllm_omni_shape(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=bound(60), json={
        "messages": [QUESTION], "modalities": ["text", "audio"], "audio": {"format": "flac"}})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and choices[0]["message"]["content"] == REPLY
    audio, rate = sf.read(io.BytesIO(base64.b64decode(choices[1]["message"]["audio"]["data"])), dtype="float32")
    assert rate == 24000 and len(audio) == SAMPLES  # format honoured in this shape too
