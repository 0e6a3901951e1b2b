from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "audio"



@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not (FIXTURES / "question_16k.wav").exists():
        # committed with the repository: missing means a broken checkout, not an optional extra
        pytest.fail(f"speech fixtures missing: {FIXTURES} (they are part of the repository: "
                    "git checkout -- tests/fixtures/audio)")
    return FIXTURES
