"""A checkpoint loaded without Code2Wav: the engine says so (``supports_audio``), so the server and
the clients can answer in text only instead of failing the first audio unit."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
pytest.importorskip("torch")

from duplexkit.engine import DuplexEngine  # noqa: E402

pytestmark = pytest.mark.engine


async def test_supports_audio_follows_the_vocoder():
    eng = DuplexEngine.from_pretrained("tiny", layout="cpu", progress=False, with_code2wav=False)
    try:
        assert eng.supports_audio is False and eng.random_weights is True
    finally:
        await eng.aclose()


async def test_from_pretrained_tiny_says_the_weights_are_random(capsys):
    """The quickstart's inline load prints the CLI's notice (one line) with progress on, none without."""
    from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE

    eng = DuplexEngine.from_pretrained("tiny", layout="cpu", with_code2wav=False)
    try:
        err = capsys.readouterr().err
        assert err.count(RANDOM_WEIGHTS_NOTICE) == 1, err
        assert eng.random_weights_noticed is True
    finally:
        await eng.aclose()
    eng = DuplexEngine.from_pretrained("tiny", layout="cpu", progress=False, with_code2wav=False)
    try:
        assert "RANDOM" not in capsys.readouterr().err and eng.random_weights_noticed is False
    finally:
        await eng.aclose()
