"""Shared test paths and the wait-bound factor (tests/_timing.py). Subfolders keep their own fixtures in their own conftest.py files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import ENV as TIME_SCALE_ENV, TIME_SCALE  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES_AUDIO = REPO / "tests" / "fixtures" / "audio"


def pytest_report_header(config):
    """Name the factor every wait bound around real processes, sockets and devices is scaled by."""
    return f"wait bounds scaled by {TIME_SCALE:g} (${TIME_SCALE_ENV}; tests/_timing.py)"


@pytest.fixture(scope="session")
def fixtures_audio() -> Path:
    """Folder of real speech WAVs (16 kHz mono pcm16; onsets/offsets in its README.md)."""
    return FIXTURES_AUDIO

