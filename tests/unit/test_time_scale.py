"""DUPLEXKIT_TEST_TIME_SCALE (tests/_timing.py): the one factor on every wait bound around real
processes, sockets and audio devices; read once at import, never below 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _bound_of(scale: str | None, seconds: float = 10.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DUPLEXKIT_TEST_TIME_SCALE"}
    if scale is not None:
        env["DUPLEXKIT_TEST_TIME_SCALE"] = scale
    code = f"import _timing; print(_timing.bound({seconds}))"
    return subprocess.run([sys.executable, "-c", code], cwd=TESTS, env=env, capture_output=True, text=True,
                          timeout=120)


def test_default_is_one_and_the_factor_multiplies_every_bound():
    assert float(_bound_of(None).stdout) == 10.0
    assert float(_bound_of("2.5").stdout) == 25.0


def test_a_factor_below_one_or_not_a_number_is_refused():
    for bad in ("0.5", "fast", "nan"):
        r = _bound_of(bad)
        assert r.returncode != 0 and "DUPLEXKIT_TEST_TIME_SCALE must be a number >= 1" in r.stderr, (bad, r.stderr)
