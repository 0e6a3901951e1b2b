"""Fixtures for the e2e tests: real ``duplexkit serve`` processes on loopback sockets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _serverproc import ServerProc  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"


@pytest.fixture(scope="session")
def question_wav() -> Path:
    return FIXTURES / "question_16k.wav"


@pytest.fixture(scope="session")
def interrupt_wav() -> Path:
    return FIXTURES / "interrupt_16k.wav"


@pytest.fixture(scope="module")
def scripted_server():
    """One ScriptedEngine server per module (on_request answers, 3 units per turn)."""
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=3") as srv:
        yield srv
