"""examples/voice_notes_agent.py as a real subprocess: against ``duplexkit serve scripted`` whose
tool_script picks the calls (add a note, then find it), and once in-process on the tiny random-weight
model (the default), which must say that its weights are random."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _serverproc import REPO, ServerProc
from _timing import bound

pytestmark = pytest.mark.e2e

SCRIPT = "examples/voice_notes_agent.py"


def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=str(REPO), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})


def test_voice_notes_agent_adds_then_finds_a_note(tmp_path):
    notes = tmp_path / "notes.json"
    script = ('tool_script=[["add_note", {"text": "buy milk", "tags": ["shopping"]}], '
              '["list_notes", {"query": "shop"}]]')
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=3",
                    "--scripted", script) as srv:
        first = run("--url", srv.ws_url, "--notes", str(notes), timeout=bound(120))
        assert first.returncode == 0, first.stdout + first.stderr
        saved = json.loads(notes.read_text())
        assert [(n["id"], n["text"], n["tags"]) for n in saved] == [(1, "buy milk", ["shopping"])]
        out = first.stdout
        assert 'tool_choice "auto"' in out  # scripted weights are not random
        assert 'tool call: add_note({"text": "buy milk", "tags": ["shopping"]})' in out
        assert "tool result: add_note completed" in out and '"total_notes":1' in out
        assert "'Let me write that down.'" in out  # the tool's own filler was spoken
        assert "(trigger client)" in out and "notes file:" in out and "(1 notes)" in out
        assert "RANDOM weights" not in first.stderr

        second = run("--url", srv.ws_url, "--notes", str(notes), timeout=bound(120))
        assert second.returncode == 0, second.stdout + second.stderr
        line = next(l for l in second.stdout.splitlines() if l.startswith("tool result: list_notes"))
        result = json.loads(line.split("-> ", 1)[1])
        assert result["count"] == 1 and result["notes"][0]["text"] == "buy milk"
        assert len(json.loads(notes.read_text())) == 1  # finding changed nothing


@pytest.mark.engine
def test_voice_notes_agent_on_the_tiny_model_says_its_weights_are_random(tmp_path):
    pytest.importorskip("torch")
    notes = tmp_path / "notes.json"
    r = run("--notes", str(notes), timeout=bound(600))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RANDOM weights" in r.stderr and "random weights also pick the tool" in r.stderr
    assert 'tool_choice "required"' in r.stdout and "tool call: " in r.stdout
    assert "tool result: " in r.stdout
    # whichever tool random weights chose, the notes file is valid JSON (add_note) or untouched (list_notes)
    if notes.exists():
        assert isinstance(json.loads(notes.read_text()), list)
