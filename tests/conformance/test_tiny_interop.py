"""The third-party clients of the conformance suite once against the REAL tiny engine (random
weights, the real three-stage runtime) behind ``duplexkit serve tiny`` (docs/server.md, "Interop").

Random weights never end a turn: a response ends ``incomplete`` at the token cap (or ``cancelled``).
The tests assert on statuses, audio and event order, never on time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _serverproc import ServerProc  # noqa: E402
from _thirdparty import agents_sdk, vllm_omni_clients  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.engine]
pytest.importorskip("torch")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
ENDED = ("completed", "incomplete")


@pytest.fixture(scope="module")
def tiny_server():
    with ServerProc("tiny", "--max-output-tokens", "40", "--layout", "cpu", ready_timeout_s=600) as srv:
        assert httpx.get(srv.url + "/health").json()["random_weights"] is True
        yield srv


async def test_tiny_vllm_omni_turn_and_barge_in(tiny_server):
    vllm_omni_clients()
    from vllm_omni_flows import barge_in, duplex_turn

    s = await duplex_turn(tiny_server.ws_url, FIXTURES / "question_16k.wav", timeout=600)
    assert s["status"] in ENDED and s["audio_bytes"] > 0
    assert "error" not in [e["type"] for e in s["events"]]
    b = await barge_in(tiny_server.ws_url, FIXTURES / "question_16k.wav", FIXTURES / "interrupt_16k.wav", timeout=600)
    assert b["first_status"] in ("cancelled", *ENDED) and b["second_status"] in ENDED
    assert b["second_audio_bytes"] > 0 and "error" not in [e["type"] for e in b["events"]]


async def test_tiny_openai_sdk_beta_turn(tiny_server):
    from openai_sdk_turns import beta_commit_driven_turn

    s = await beta_commit_driven_turn(tiny_server.url, "gpt-4o-realtime-preview", FIXTURES / "question_16k.wav",
                                      timeout=600)
    assert s["status"] in ENDED and s["audio_samples"] > 0


async def test_tiny_agents_sdk_turn(tiny_server):
    agents_sdk()
    from agents_sdk_flows import voice_turn

    s = await voice_turn(tiny_server.ws_url, FIXTURES / "question_16k.wav", timeout=600)
    assert not s["errors"], s["errors"]
    assert s["audio"] and all(len(a) > 0 for a in s["audio"].values())
