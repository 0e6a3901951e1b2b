"""duplexkit.agent.transcribe: EngineTranscriber against a fake engine, FasterWhisperTranscriber against a
stand-in faster_whisper module (and its missing-package error), make_transcriber."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import threading
import types

import numpy as np
import pytest

from duplexkit.agent import (
    ASR_PROMPTS,
    EngineTranscriber,
    FasterWhisperTranscriber,
    OptionalDependencyError,
    Transcriber,
    make_transcriber,
)
from duplexkit.engine.api import ChatResult, TranscribeAudio


def _cmd(audio=None, **kw) -> TranscribeAudio:
    audio = np.full(32_000, 0.01, np.float32) if audio is None else audio
    return TranscribeAudio(stream_id="s1", epoch=2, item_id="item_7", audio=audio, **kw)


class FakeEngine:
    model_id = "fake"
    random_weights = False

    def __init__(self, text=" hello there \n", exc=None):
        self.text, self.exc, self.requests = text, exc, []

    async def generate(self, request):
        self.requests.append(request)
        if self.exc is not None:
            raise self.exc
        return ChatResult(text=self.text, audio=None, finish_reason="stop", prompt_tokens=40, completion_tokens=3)


async def test_engine_transcriber_request_and_result():
    eng = FakeEngine()
    t = EngineTranscriber(eng)
    assert isinstance(t, Transcriber)
    out = await t.transcribe(_cmd())
    assert (out.text, out.error, out.item_id, out.stream_id, out.epoch, out.unit_index) == (
        "hello there", None, "item_7", "s1", 2, -1)
    assert out.elapsed_ms >= 0
    req = eng.requests[0]
    (msg,) = req.messages
    assert msg.role == "user" and msg.content[0] == ASR_PROMPTS["en"]
    assert msg.content[1].dtype == np.float32 and msg.content[1].size == 32_000
    assert (req.temperature, req.use_tts_template, req.output_audio) == (0.0, False, False)
    assert req.max_tokens == 16 + 16  # 2 s at 8 tokens/s plus 16
    await t.transcribe(_cmd(language="zh-CN"))
    assert eng.requests[1].messages[0].content[0] == ASR_PROMPTS["zh"]


def test_engine_transcriber_token_budget_grows_with_the_audio_and_is_capped():
    t = EngineTranscriber(None, tokens_per_s=5, min_tokens=10, max_tokens=100)
    assert t.token_budget(0) == 10
    assert t.token_budget(16_000) == 15
    assert t.token_budget(16_001) == 16  # a started second counts
    assert t.token_budget(16_000 * 60) == 100


async def test_engine_transcriber_errors_never_raise():
    out = await EngineTranscriber(FakeEngine(exc=RuntimeError("thinker gone"))).transcribe(_cmd())
    assert out.text == "" and "RuntimeError: thinker gone" in out.error
    eng = FakeEngine()
    for audio, why in ((np.zeros(0, np.float32), "empty"), (np.array([np.nan], np.float32), "NaN"),
                       (np.zeros((2, 2), np.float32), "1-D"), (np.zeros(4, np.int16), "1-D float")):
        out = await EngineTranscriber(eng).transcribe(_cmd(audio))
        assert why in out.error and out.text == ""
    assert eng.requests == []  # bad audio never reaches the engine


# ------------------------------------------------------------------------------------------ faster-whisper


@pytest.fixture
def fake_faster_whisper(monkeypatch):
    """A stand-in ``faster_whisper`` module with the API duplexkit uses: WhisperModel(size, device,
    compute_type).transcribe(audio, language, initial_prompt, beam_size) -> (segments, info)."""
    mod = types.ModuleType("faster_whisper")
    mod.__spec__ = importlib.machinery.ModuleSpec("faster_whisper", None)
    mod.loaded, mod.calls = [], []

    class WhisperModel:
        def __init__(self, size, device="auto", compute_type="default"):
            mod.loaded.append((size, device, compute_type))

        def transcribe(self, audio, language=None, initial_prompt=None, beam_size=5):
            mod.calls.append((audio.dtype, audio.size, language, initial_prompt, beam_size,
                              threading.current_thread() is threading.main_thread()))
            if audio.size == 3:
                raise RuntimeError("decoder exploded")
            segs = (types.SimpleNamespace(text=" Five kilometres"), types.SimpleNamespace(text=" in miles?"))
            return iter(segs), types.SimpleNamespace(language="en")

    mod.WhisperModel = WhisperModel
    monkeypatch.setitem(sys.modules, "faster_whisper", mod)
    return mod


async def test_faster_whisper_runs_in_a_thread_and_loads_once(fake_faster_whisper):
    t = make_transcriber("faster-whisper:tiny.en", None)
    assert isinstance(t, FasterWhisperTranscriber) and isinstance(t, Transcriber)
    out = await t.transcribe(_cmd(language="en", prompt="distances"))
    assert out.text == "Five kilometres in miles?" and out.error is None and out.item_id == "item_7"
    out2 = await t.transcribe(_cmd(np.full(8000, 0.1, np.float64)))
    assert out2.text and fake_faster_whisper.loaded == [("tiny.en", "cpu", "int8")]
    assert fake_faster_whisper.calls[0] == (np.float32, 32_000, "en", "distances", 1, False)
    assert fake_faster_whisper.calls[1][:4] == (np.float32, 8000, None, None)
    bad = await t.transcribe(_cmd(np.zeros(3, np.float32)))
    assert bad.text == "" and "RuntimeError: decoder exploded" in bad.error
    assert make_transcriber("faster-whisper", None).model_size == "small"


@pytest.mark.skipif(importlib.util.find_spec("faster_whisper") is not None, reason="faster-whisper is installed")
def test_faster_whisper_missing_names_the_extra():
    with pytest.raises(OptionalDependencyError) as ei:
        FasterWhisperTranscriber()
    e = ei.value
    assert isinstance(e, ImportError) and e.code == "missing_dependency"
    assert (e.package, e.extra) == ("faster_whisper", "transcribe")
    assert "pip install 'duplexkit[transcribe]'" in str(e)
    with pytest.raises(OptionalDependencyError):
        make_transcriber("faster-whisper:base", None)


def test_make_transcriber_names():
    eng = FakeEngine()
    for name in (None, "minicpm-o", "default"):
        t = make_transcriber(name, eng)
        assert isinstance(t, EngineTranscriber) and t.engine is eng
    with pytest.raises(ValueError, match="unknown transcriber 'whisper-1'"):
        make_transcriber("whisper-1", eng)
