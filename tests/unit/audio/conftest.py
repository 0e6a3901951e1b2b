from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "audio"



@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not (FIXTURES / "question_16k.wav").exists():
        pytest.skip(f"speech fixtures missing: {FIXTURES} (copy them from ../shared/fixtures/audio)")
    return FIXTURES
