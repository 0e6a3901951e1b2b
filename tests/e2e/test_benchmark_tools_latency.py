"""``benchmarks/tools_latency.py`` end to end with the scripted engine (torch-free): the real server
in-process over WebSockets, one session, two turns that each call the tool, the client answering
with an output. It must print its table with every row, with finite numbers, write strict JSON and
exit 0 (a smoke test, not a measurement)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from _serverproc import REPO

pytestmark = pytest.mark.e2e

ROWS = ("call ", "filler ", "answer ", "decider   call", "decider   answer", "Session   committed -> call",
        "Session   committed -> first filler", "units     engine per unit", "units     most units behind",
        "real time", "turns without a call", "errors / warnings")


def _run(tmp_path, *args):
    out = tmp_path / "tools.json"
    r = subprocess.run([sys.executable, "benchmarks/tools_latency.py", "--model", "scripted", "--sessions", "1",
                        "--turns", "2", "--warmup-turns", "0", "--timeout", "30", "--json", str(out), *args],
                       cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout, out


@pytest.mark.parametrize("commit", ["vad", "client"])
def test_tools_latency_scripted_prints_every_row_with_finite_numbers(tmp_path, commit):
    stdout, out = _run(tmp_path, "--commit", commit)
    table = stdout[stdout.index("tools latency: model scripted"):]
    lines = table.splitlines()
    for row in ROWS:
        assert any(line.startswith(row) for line in lines), (row, table)
    assert ("eos_call" in table) == (commit == "vad")
    # the latency rows: "p50 / p90 (n)" with n == 2 turns for the client-side metrics, never nan / "-"
    for row in ("call ", "filler ", "answer ", "decider   call", "decider   answer"):
        line = next(x for x in lines if x.startswith(row))
        cell = line.split("|")[1].strip()
        p50, rest = cell.split(" / ")
        p90, n = rest.split(" (")
        assert math.isfinite(float(p50)) and math.isfinite(float(p90)) and int(n.rstrip(")")) == 2, line
    assert next(x for x in lines if x.startswith("real time")).split("|")[1].strip() == "yes"
    assert next(x for x in lines if x.startswith("turns without a call")).split("|")[1].strip() == "0"
    assert next(x for x in lines if x.startswith("errors / warnings")).split("|")[1].strip() == "0 / 0"

    data = json.loads(out.read_text())  # strict JSON: no NaN
    level = data["levels"][0]
    assert data["model"] == "scripted" and data["commit"] == commit and level["sessions"] == 1
    for key in ("call", "filler", "answer", "answer_free", "decide_call", "decide_answer", "unit_ms"):
        s = level["summary"][key]
        assert s["n"] >= 2 and all(math.isfinite(s[q]) and s[q] >= 0 for q in ("p50", "p90")), (key, s)
    assert level["real_time"] is True and level["errors"] == {} and level["missed"] == []
