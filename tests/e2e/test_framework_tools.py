"""Pipecat's and LiveKit Agents' OpenAI Realtime services run a function tool end to end against a real
``duplexkit serve scripted`` process (docs/tools.md, "Pipecat and LiveKit").

The frameworks live in their own venv (scripts/setup_frameworks.sh: pipecat-ai, livekit-agents and
livekit-plugins-openai pin their own openai / websockets / aiohttp), so each flow runs as a helper
script with that venv's python (``DUPLEXKIT_FRAMEWORKS_PYTHON``, default ``.venv-frameworks/bin/python``)
and writes a JSON report that this module checks; skipped, with the reason, where that venv is
missing. Each server scripts one decision (``tool_script``): the user's turn calls ``get_weather``
with ``{"city": "Paris"}``; the answer to the tool's output is the scripted chat reply.

* Pipecat (tests/e2e/_pipecat_tools.py): ``OpenAIRealtimeLLMService(base_url=...)`` in a pipeline
  without transport (started with ``LLMRunFrame``: the service greets first), the tool given as a
  provider-native dict with duplexkit's ``"filler": ""`` and registered with ``register_function``, real speech as
  ``InputAudioRawFrame`` s; the handler runs with schema-valid arguments, its result goes back as a
  ``function_call_output``, and a spoken answer (audio frames) follows.
* LiveKit (tests/e2e/_livekit_tools.py): ``livekit.plugins.openai.realtime.RealtimeModel(base_url=...)``
  and its ``RealtimeSession`` driven as ``AgentSession`` drives them, with a ``@function_tool`` (the
  default filler is spoken while it runs; LiveKit interrupts it for the reply).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _serverproc import REPO, ServerProc
from _timing import bound

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.e2e

FIXTURES = REPO / "tests" / "fixtures" / "audio"
QUESTION = FIXTURES / "question_16k.wav"
SCRIPTED_ANSWER = "This is a scripted chat reply."  # ScriptConfig.chat_text: the decider's answer
FILLER = "One moment, I'll check."  # the default tool filler (docs/tools.md)
SCRIPTED_ARGS = {"city": "Paris"}
_IMPORTS = {
    "pipecat": "from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService",
    "livekit": "from livekit.plugins.openai.realtime import RealtimeModel",
}


def _frameworks_python(framework: str) -> str:
    py = os.environ.get("DUPLEXKIT_FRAMEWORKS_PYTHON") or str(REPO / ".venv-frameworks" / "bin" / "python")
    if not Path(py).is_file():
        pytest.skip(f"no frameworks venv at {py} (run scripts/setup_frameworks.sh or set DUPLEXKIT_FRAMEWORKS_PYTHON)")
    r = subprocess.run([py, "-c", _IMPORTS[framework]], capture_output=True, text=True, timeout=bound(120))
    if r.returncode != 0:
        pytest.skip(f"{framework} is not importable in {py}: {r.stderr.strip().splitlines()[-1:]}")
    return py


def _scripted_server() -> ServerProc:
    return ServerProc("scripted", "--scripted", "units_per_turn=3",
                      "--scripted", f"tool_script=[[\"get_weather\", {json.dumps(SCRIPTED_ARGS)}]]")


def _run(py: str, script: str, server: ServerProc, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "report.json"
    cmd = [py, str(Path(__file__).with_name(script)), "--url", server.url, "--wav", str(QUESTION),
           "--expect-answer", SCRIPTED_ANSWER, "--out", str(out), "--timeout", str(bound(60)), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=bound(240), cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["timed_out"] is False and not report.get("failure"), (
        f"no spoken answer after the tool's output:\n{json.dumps(report, indent=1)[-6000:]}\n"
        f"--- client log\n{r.stderr[-4000:]}\n--- server log\n{server.output()[-3000:]}")
    return report


def test_pipecat_openai_realtime_service_runs_a_function_tool(tmp_path):
    py = _frameworks_python("pipecat")
    with _scripted_server() as server:
        rep = _run(py, "_pipecat_tools.py", server, tmp_path)
    # the handler ran once, with the scripted arguments, valid against the schema Pipecat declared
    (call,) = rep["calls"]
    assert call["function_name"] == "get_weather" and call["arguments"] == SCRIPTED_ARGS
    jsonschema.validate(call["arguments"], rep["parameters"])
    # the result went back: the server added the function_call_output item for that call, with it
    by_type = {}
    for item in rep["items"]:
        by_type.setdefault(item["type"], []).append(item)
    (fc,) = by_type["function_call"]
    (out,) = by_type["function_call_output"]
    assert fc["call_id"] == out["call_id"] == call["tool_call_id"] and fc["name"] == "get_weather"
    assert json.loads(out["output"]) == {"temperature_c": 21, "conditions": "sunny", "city": "Paris"}
    # a spoken answer followed: audio frames (24 kHz pcm16) and the answer's transcript, after the output
    answer = rep["responses"][-1]
    assert answer["text"].strip() == SCRIPTED_ANSWER and answer["audio_bytes"] > 0
    assert answer["sample_rates"] == [24000] and answer["t_end"] > out["t"]
    assert not any(r["text"].strip() == FILLER for r in rep["responses"])  # the tool's "filler": ""
    # nothing on the wire stopped the service: no error event, no ErrorFrame
    assert "error" not in rep["server_events"], rep["server_events"]
    assert not [e for e in rep["timeline"] if e[1] == "ErrorFrame"], rep["timeline"]
    # Pipecat's own context: the call, its result, the spoken answer
    ctx = rep["context"]
    calls_in_ctx = [m for m in ctx if m.get("tool_calls")]
    assert [tc["id"] for m in calls_in_ctx for tc in m["tool_calls"]] == [call["tool_call_id"]]
    assert [m["tool_call_id"] for m in ctx if m.get("role") == "tool"] == [call["tool_call_id"]]
    assert ctx[-1] == {"role": "assistant", "content": SCRIPTED_ANSWER}


def test_pipecat_survives_the_benign_errors_and_answers_later_turns(tmp_path):
    """Pipecat's receive loop passes over ``response_cancel_not_active`` and
    ``conversation_already_has_active_response`` and ends on any other code. The compat profile sends
    OpenAI's names, so after a cancel with nothing active and a create that meets another, the
    service still takes the user's turn, runs the tool and speaks the answer."""
    py = _frameworks_python("pipecat")
    with _scripted_server() as server:
        rep = _run(py, "_pipecat_tools.py", server, tmp_path, "--provoke-errors")
    assert sorted(rep["error_codes"]) == ["conversation_already_has_active_response", "response_cancel_not_active"]
    assert [c["function_name"] for c in rep["calls"]] == ["get_weather"]
    assert rep["responses"][-1]["text"].strip() == SCRIPTED_ANSWER and rep["responses"][-1]["audio_bytes"] > 0
    assert not [e for e in rep["timeline"] if e[1] == "ErrorFrame"], rep["timeline"]


def test_livekit_openai_realtime_model_runs_a_function_tool(tmp_path):
    py = _frameworks_python("livekit")
    with _scripted_server() as server:
        rep = _run(py, "_livekit_tools.py", server, tmp_path)
    assert rep["errors"] == [] and "error" not in rep["server_events"], (rep["errors"], rep["server_events"])
    # the @function_tool ran once, with the scripted arguments, valid against its schema
    assert rep["calls"] == [SCRIPTED_ARGS]
    (gen_call,) = [g for g in rep["generations"] if g["function_calls"]]
    (fc,) = gen_call["function_calls"]
    assert fc["name"] == "get_weather" and json.loads(fc["arguments"]) == SCRIPTED_ARGS
    jsonschema.validate(json.loads(fc["arguments"]), rep["parameters"])
    assert not gen_call["user_initiated"] and gen_call["audio_samples"] == 0  # the server's turn decision
    # the result went back: the server's conversation (LiveKit's remote chat context) holds the output
    (res,) = rep["tool_results"]
    assert res["call_id"] == fc["call_id"] and not res["is_error"] and "Paris" in res["output"]
    outs = [i for i in rep["chat_ctx"] if i["type"] == "function_call_output"]
    assert [(o["call_id"], o["output"]) for o in outs] == [(fc["call_id"], res["output"])]
    # a spoken answer followed: the reply LiveKit asked for, with audio frames and the answer's transcript
    (answer,) = [g for g in rep["generations"] if g["response_id"] == res["reply_response_id"]]
    assert answer["user_initiated"] and answer["text"].strip() == SCRIPTED_ANSWER
    assert answer["audio_samples"] > 0 and answer["sample_rates"] == [24000]
    assert any(g["text"].strip() == FILLER and g["audio_samples"] > 0 for g in rep["generations"])
    last = rep["chat_ctx"][-1]
    assert last["type"] == "message" and last["role"] == "assistant" and last["content"] == [SCRIPTED_ANSWER]
