"""Shared test paths. Subfolders keep their own fixtures in their own conftest.py files."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES_AUDIO = REPO / "tests" / "fixtures" / "audio"


@pytest.fixture(scope="session")
def fixtures_audio() -> Path:
    """Folder of real speech WAVs (16 kHz mono pcm16; onsets/offsets in its README.md)."""
    return FIXTURES_AUDIO

