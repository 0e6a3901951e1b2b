"""Tools during a conversation (docs/tools.md) with the OpenAI Agents SDK realtime runner
(``openai-agents`` from PyPI, test-only ``--no-deps`` install), unmodified: a ``RealtimeAgent`` with a
``@function_tool`` against a real ``duplexkit serve scripted`` process.

* ``tool_choice: required`` (the runner's model settings): the tool runs with schema-valid
  arguments and the answer to its output is spoken;
* ``auto`` with the scripted engine's ``tool_script``: calls happen exactly where scripted;
* a barge-in while a slow tool runs: the filler is cut, nothing of a cancelled response plays after
  the barge-in, the late result is answered by a new response.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _timing import bound

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

jsonschema = pytest.importorskip("jsonschema")

from _serverproc import ServerProc  # noqa: E402
from _thirdparty import agents_sdk  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
QUESTION = FIXTURES / "question_16k.wav"
INTERRUPT = FIXTURES / "interrupt_16k.wav"
SCRIPTED_ANSWER = "This is a scripted chat reply."
# about six words per unit (SpeakText's pace): 5 units, long enough to be spoken over
LONG_FILLER = ("One moment please, I am looking up the weather for you right now. It can take a little "
               "while, so thank you for waiting while I check the latest report for your city.")


@pytest.fixture(scope="module")
def sdk():
    agents_sdk()
    import agents.realtime  # noqa: F401


def _serve(*scripted: str) -> ServerProc:
    args = []
    for s in ("units_per_turn=3", *scripted):
        args += ["--scripted", s]
    return ServerProc("scripted", *args)


def _created(log, response_id: str) -> dict:
    return next(r["response"] for r in log.server("response.created") if r["response"]["id"] == response_id)


def _done(log, response_id: str) -> dict:
    return next(r["response"] for r in log.server("response.done") if r["response"]["id"] == response_id)


def _transcript(response: dict) -> str:
    return "".join(c.get("transcript") or "" for o in response["output"] for c in o.get("content") or [])


async def test_agents_sdk_required_tool_runs_and_answer_is_spoken(sdk):
    from agents_sdk_tool_flows import answered_call, check_answer_after_tool, check_no_errors

    with _serve() as server:
        log, tool = await answered_call(server.ws_url, QUESTION, tool_choice="required", timeout=bound(60))
    check_no_errors(log)
    assert len(log.calls) == 1, log.calls
    (start_args,) = [p for k, p in log.entries if k == "tool_start"]
    args = json.loads(start_args)
    jsonschema.validate(args, tool.params_json_schema)  # schema-valid, whatever the decider chose
    (call,) = log.server("response.function_call_arguments.done")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == args
    updated = log.server("session.updated")[-1]["session"]
    assert updated["tool_choice"] == "required" and [t["name"] for t in updated["tools"]] == ["get_weather"]
    answer = check_answer_after_tool(log)
    assert _transcript(answer) == SCRIPTED_ANSWER
    assert _created(log, answer["id"])["trigger"] == "client"


async def test_agents_sdk_auto_calls_exactly_where_scripted(sdk):
    from agents_sdk_tool_flows import check_answer_after_tool, check_no_errors, scripted_turns

    with _serve('tool_script=[null, ["get_weather", {"city": "Paris"}]]') as server:
        log = await scripted_turns(server.ws_url, QUESTION, QUESTION, timeout=bound(90))
    check_no_errors(log)
    assert log.calls == [{"city": "Paris"}]  # one call, with the scripted arguments
    assert len(log.server("response.function_call_arguments.done")) == 1
    second = log.kinds().index("second_turn")
    assert log.kinds().index("tool_start") > second  # on the second turn, not the first
    # the first turn was answered by the model (no call): a spoken response before the second turn
    first = [p["response"]["id"] for k, p in log.entries[:second] if k == "server" and p.get("type") == "response.created"]
    assert len(first) == 1, first
    done = _done(log, first[0])
    assert done["status"] == "completed" and [o["type"] for o in done["output"]] == ["message"], done
    assert any(k == "audio" and p[2] == first[0] for k, p in log.entries[:second])
    check_answer_after_tool(log)


async def test_agents_sdk_barge_in_while_a_slow_tool_runs(sdk):
    from agents_sdk_tool_flows import barge_in_during_slow_tool, check_answer_after_tool, check_no_errors

    with _serve('tool_script=[["get_weather", {"city": "Paris"}], null]') as server:
        log = await barge_in_during_slow_tool(server.ws_url, QUESTION, INTERRUPT, tool_wait_s=bound(60),
                                              filler=LONG_FILLER, timeout=bound(120))
    check_no_errors(log)
    assert log.calls == [{"city": "Paris"}]
    kinds = log.kinds()
    barge = kinds.index("barge_in")
    filler_item = log.entries[barge][1]
    # the server VAD heard the barge-in and cut the filler; the SDK stopped its playback
    started = log.index("server", lambda p: p.get("type") == "input_audio_buffer.speech_started", start=barge)
    assert "audio_interrupted" in kinds[barge:]
    filler_rid = next(p[2] for k, p in log.entries if k == "audio" and p[0] == filler_item)
    assert _created(log, filler_rid)["trigger"] == "filler"
    assert _done(log, filler_rid)["status"] == "cancelled"
    # nothing stale: every audio after the barge-in's speech_started belongs to a response created after it
    new = {p["response"]["id"] for k, p in log.entries[started:] if k == "server" and p.get("type") == "response.created"}
    stale = [p for k, p in log.entries[started:] if k == "server" and p.get("type") == "response.output_audio.delta"
             and p["response_id"] not in new]
    assert not stale, stale[:1]
    assert all(p[2] in new for k, p in log.entries[started:] if k == "audio")
    # the barge-in turn was answered by the model (script: no call) while the tool still ran
    release = kinds.index("release")
    assert kinds.index("tool_end") > release
    turn2 = [p["response"]["id"] for k, p in log.entries[started:release]
             if k == "server" and p.get("type") == "response.created"]
    assert len(turn2) == 1 and _created(log, turn2[0])["trigger"] == "server_vad", turn2
    done = _done(log, turn2[0])
    assert done["status"] == "completed" and [o["type"] for o in done["output"]] == ["message"], done
    # the late result: sent by the SDK once the tool returned, answered by a new response
    answer = check_answer_after_tool(log)
    assert _transcript(answer) == SCRIPTED_ANSWER
