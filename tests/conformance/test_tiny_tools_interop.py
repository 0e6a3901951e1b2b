"""Function tools with the OpenAI Agents SDK (unmodified) once against the REAL tiny engine (random
weights, the real three-stage runtime) behind ``duplexkit serve tiny`` (docs/tools.md, "Random
weights"): with ``tool_choice: required`` the built-in decider's constrained decoding must still give
arguments that are valid against the tool's JSON Schema, the tool runs, and the answer to its output
is spoken. What the random weights say is noise: the test asserts validity, order and audio only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from _timing import bound

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _serverproc import ServerProc  # noqa: E402
from _thirdparty import agents_sdk  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.engine]
pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
ENDED = ("completed", "incomplete")


@pytest.fixture(scope="module")
def tiny_server():
    # as in test_tiny_interop.py: on 2 shared cores the tiny engine can be slower than real time, so
    # allow a minute of unconsumed input instead of ending the turn with input_backpressure
    with ServerProc("tiny", "--max-output-tokens", "40", "--layout", "cpu", "--max-pending-input-s", "60",
                    ready_timeout_s=600) as srv:
        assert httpx.get(srv.url + "/health").json()["random_weights"] is True
        yield srv


async def test_tiny_agents_sdk_required_tool_call_is_schema_valid(tiny_server):
    agents_sdk()
    from agents_sdk_tool_flows import answered_call, check_answer_after_tool, check_no_errors

    log, tool = await answered_call(tiny_server.ws_url, FIXTURES / "question_16k.wav", tool_choice="required",
                                    timeout=bound(300))
    check_no_errors(log)
    assert len(log.calls) == 1, log.calls
    (start_args,) = [p for k, p in log.entries if k == "tool_start"]
    jsonschema.validate(json.loads(start_args), tool.params_json_schema)  # constrained decoding, random weights
    (call,) = log.server("response.function_call_arguments.done")
    assert call["name"] == "get_weather" and call["arguments"] == start_args
    assert not log.server("session.warning") or all(
        w["code"] == "transcription_model_substituted" for w in log.server("session.warning"))
    check_answer_after_tool(log, ENDED)
