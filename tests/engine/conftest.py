"""Fixtures shared by the engine tests.

``engine`` is THE tiny random-weight ``DuplexEngine`` of the test process (CPU): each Code2Wav flow
costs ~2.24 GB (docs/model.md §7.5), so every module that needs the tiny engine asks for this
session fixture instead of building its own (test_engine_tiny.py, test_contract.py).
"""

from __future__ import annotations

import asyncio
import os

import pytest


@pytest.fixture(scope="session")
def engine():
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # docs/model.md §7.5: before stepaudio2 is imported
    pytest.importorskip("torch")
    pytest.importorskip("stepaudio2")
    from duplexkit.engine import DuplexEngine

    eng = DuplexEngine.from_pretrained("tiny", layout="cpu", progress=False)
    yield eng
    asyncio.run(eng.aclose())
