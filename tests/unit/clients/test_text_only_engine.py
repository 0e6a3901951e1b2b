"""An engine without a vocoder (checkpoint lacking assets/token2wav): the inline client's session is
text-only, and chat completions refuse audio with a 400 that says why."""

from __future__ import annotations

import pytest

from duplexkit.clients import InlineDuplexClient
from duplexkit.testing import ScriptedEngine


async def test_inline_session_is_text_only_without_a_vocoder():
    eng = ScriptedEngine()
    eng.supports_audio = False
    async with InlineDuplexClient(eng) as c:
        assert c.session["output_modalities"] == ["text"]
    await eng.aclose()


def test_chat_refuses_audio_without_a_vocoder():
    from duplexkit_server.app import ServerSettings, ServerState
    from duplexkit_server.chat import ChatRequestError, parse_chat_request

    eng = ScriptedEngine()
    eng.supports_audio = False
    state = ServerState(ServerSettings(), eng)
    body = {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}
    with pytest.raises(ChatRequestError, match="assets/token2wav"):
        parse_chat_request(body, state)
    req, _ = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, state)
    assert req.output_audio is False
