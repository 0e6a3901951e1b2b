"""``benchmarks/e2e_latency.py`` end to end on the CPU: the real server in-process over WebSockets,
a random-weight tiny engine, one session and one round of each scenario. It must print its table
and exit 0: it used to leave the process while the engine's threads were still inside torch calls
(the server thread was a daemon that was never joined), which ended it with SIGABRT, exit 134
("terminate called without an active exception"), after the results."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _serverproc import REPO

pytest.importorskip("torch")
pytest.importorskip("stepaudio2")

pytestmark = pytest.mark.e2e


def test_e2e_latency_random_tiny_prints_its_table_and_exits_cleanly(tmp_path):
    out = tmp_path / "e2e.json"
    r = subprocess.run([sys.executable, "benchmarks/e2e_latency.py", "--model", "random-tiny", "--device", "cpu",
                        "--sessions", "1", "--rounds", "1", "--warmup-rounds", "0", "--timeout", "60",
                        "--out", str(out)],
                       cwd=str(REPO), capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "terminate called" not in r.stderr
    assert "model random-tiny" in r.stdout and "latency trace" in r.stdout
    import json

    levels = json.loads(out.read_text())["levels"]
    assert levels[0]["sessions"] == 1 and len(levels[0]["create"]) == 1
