"""Shared test paths and the wait-bound factor (tests/_timing.py). Subfolders keep their own fixtures in their own conftest.py files."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def _without_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


# Without CUDA the Triton decode kernels are tested under Triton's interpreter
# (tests/model/test_triton_decode.py). Triton reads TRITON_INTERPRET when a kernel is decorated, and
# stepaudio2 imports triton (and decorates its own kernels) as soon as any test imports it, so the
# variable must be set before the first test module is imported, not in that test module.
if "TRITON_INTERPRET" not in os.environ and _without_cuda():
    os.environ["TRITON_INTERPRET"] = "1"

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

