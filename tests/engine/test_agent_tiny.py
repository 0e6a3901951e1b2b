"""duplexkit.agent on the real tiny random-weight engine (CPU): the thinker's own speech recognition
and the engine decider with constrained decoding. Random weights write gibberish, so only the shapes
are checked: a transcript is text (or a typed error), a decided call fits its schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from duplexkit.agent import EngineToolDecider, EngineTranscriber, tool
from duplexkit.audio import read_wav
from duplexkit.engine.api import ChatMessage, DecideTools, TranscribeAudio

pytestmark = pytest.mark.engine

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"


@tool
def add_note(text: str, priority: int = 1) -> str:
    """Add a note.

    Args:
        text: what to write down.
        priority: 1 (low) to 3 (high).
    """
    return "ok"


async def test_engine_transcriber_on_real_speech(engine):
    audio, _ = read_wav(FIX / "question_16k.wav", rate=16000)
    t = EngineTranscriber(engine)
    out = await t.transcribe(TranscribeAudio(stream_id="s", epoch=0, item_id="item_1", audio=audio))
    assert out.item_id == "item_1" and out.elapsed_ms > 0
    if out.error is None:
        assert isinstance(out.text, str) and out.text == out.text.strip()
    else:  # a typed failure, never an exception
        assert out.text == "" and isinstance(out.error, str) and out.error


async def test_engine_decider_required_call_fits_the_schema(engine):
    audio, _ = read_wav(FIX / "question_16k.wav", rate=16000)
    cmd = DecideTools(stream_id="s", epoch=0, request_id="dec_1",
                      messages=(ChatMessage("system", ["You take notes."]), ChatMessage("user", [audio])),
                      tools=(add_note.session_tool(),), tool_choice="required")
    out = await EngineToolDecider(engine, max_tokens=48).decide(cmd)
    assert out.request_id == "dec_1" and out.elapsed_ms > 0
    assert out.error is None, out.error
    (call,) = out.calls
    assert call.name == "add_note"
    jsonschema.validate(json.loads(call.arguments), add_note.parameters)
