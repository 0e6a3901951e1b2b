"""Turn-based chat audio is bounded by the reply length (``chat_code_budget``): a talker that never
samples EOS (random weights) stops at 2 s + 1 s per text token instead of ``chat_max_codes``.

The first tests use a torch-free toy stage model whose talker never ends (it emits every code it
is allowed); the last one runs the real tiny checkpoint (marked ``engine``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from duplexkit.engine import DuplexEngine
from duplexkit.engine.api import ChatMessage, ChatRequest
from duplexkit.engine.engine import CHAT_CODES_BASE, CHAT_CODES_PER_TEXT_TOKEN, chat_code_budget
from duplexkit.engine.minicpmo45 import ChatThinkerOut

from .toy import ToyStages


class NeverEndingChatStages(ToyStages):
    """ToyStages plus a chat pass: ``reply_tokens`` text tokens, and a talker that never samples
    EOS, so it returns exactly ``max_codes`` codes (what random weights do)."""

    def __init__(self, reply_tokens: int) -> None:
        super().__init__(delay_s=0.0)
        self.reply_tokens = reply_tokens
        self.max_codes_seen: list[int] = []

    def chat_thinker(self, request, on_text=None):
        text = " ".join(f"w{i}" for i in range(self.reply_tokens))
        if on_text is not None:
            on_text(text)
        return ChatThinkerOut(text=text, talker_input=(np.arange(self.reply_tokens), None), finish_reason="length",
                              prompt_tokens=5, completion_tokens=self.reply_tokens)

    def chat_talker(self, talker_input, seed, max_codes=2048):
        self.max_codes_seen.append(int(max_codes))
        return np.zeros(int(max_codes), np.int64)


def test_budget_formula():
    assert (CHAT_CODES_BASE, CHAT_CODES_PER_TEXT_TOKEN) == (50, 25)
    assert chat_code_budget(0, 2048) == 50
    assert chat_code_budget(4, 2048) == 150
    assert chat_code_budget(64, 2048) == 1650  # 66 s: still far above real speech for 64 tokens
    assert chat_code_budget(100, 2048) == 2048  # the absolute cap still applies
    assert chat_code_budget(10, 100) == 100
    assert chat_code_budget(0, 1) == 1


@pytest.mark.parametrize("reply_tokens, chat_max_codes", [(4, 2048), (64, 2048), (100, 2048), (10, 120)])
async def test_chat_audio_is_bounded_by_the_reply_length(reply_tokens, chat_max_codes):
    stages = NeverEndingChatStages(reply_tokens)
    engine = DuplexEngine(stages, layout="cpu", chat_max_codes=chat_max_codes)
    try:
        res = await engine.generate(ChatRequest(messages=[ChatMessage("user", ["hi"])], output_audio=True,
                                                max_tokens=reply_tokens))
    finally:
        await engine.aclose()
    budget = min(chat_max_codes, 50 + 25 * reply_tokens)
    assert stages.max_codes_seen == [budget]
    # every code became audio (about 960 samples per code, docs/model.md §7.1), and no more
    assert (budget - 1) * 960 <= res.audio.size <= budget * 960 + 3840
    assert res.audio.size / 24_000 <= 2 + reply_tokens + 0.2  # 2 s + 1 s per text token (+ flush)


@pytest.mark.engine
async def test_tiny_chat_audio_is_bounded_by_the_reply_length():
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # docs/model.md §7.5
    pytest.importorskip("torch")
    pytest.importorskip("stepaudio2")
    engine = DuplexEngine.from_pretrained("tiny", layout="cpu", progress=False)
    try:
        assert engine.chat_max_codes == 2048
        res = await engine.generate(ChatRequest(messages=[ChatMessage("user", ["What is the weather like in Paris?"])],
                                                output_audio=True, max_tokens=4, seed=3))
    finally:
        await engine.aclose()
    assert 0 < res.completion_tokens <= 4
    budget = chat_code_budget(res.completion_tokens, 2048)
    assert res.audio is not None and 0 < res.audio.size <= (budget + 3) * 960 + 3840, res.audio.size
