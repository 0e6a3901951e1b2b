"""The unmodified OpenAI Python SDK realtime client against a real ``duplexkit serve scripted``
process (compat profile, docs/protocol.md §11): a commit-driven turn and a server_vad turn, every event
validated against ``openai.types.realtime``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _timing import bound

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _serverproc import ServerProc  # noqa: E402
from openai_sdk_turns import commit_driven_turn, server_vad_turn  # noqa: E402

pytest.importorskip("openai")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"


@pytest.fixture(scope="module")
def server():
    with ServerProc("scripted", "--scripted", "units_per_turn=2") as srv:
        yield srv


async def test_sdk_commit_driven_turn(server):
    s = await commit_driven_turn(server.url, "scripted", FIXTURES / "question_16k.wav", timeout=bound(30))
    assert s["status"] == "completed"
    assert s["audio_samples"] == 48000 and s["first_chunk_samples"] == 20160
    assert s["transcript"] == "Hello there, this is "
    assert "response.speak" not in s["types"]  # compat profile: no extension events
    assert s["types"][0] == "input_audio_buffer.committed"


async def test_sdk_server_vad_turn(server):
    s = await server_vad_turn(server.url, "scripted", FIXTURES / "question_16k.wav", timeout=bound(30))
    assert s["status"] == "completed" and s["audio_samples"] == 48000
    assert "input_audio_buffer.speech_started" in s["types"]
    assert "input_audio_buffer.speech_stopped" in s["types"]
    assert s["types"].index("input_audio_buffer.committed") < s["types"].index("response.created")


async def test_sdk_ga_with_an_openai_model_id_is_served(server):
    # OpenAI ids are mapped to the served model by default (docs/server.md, "Model ids")
    s = await commit_driven_turn(server.url, "gpt-realtime", FIXTURES / "question_16k.wav", timeout=bound(30))
    assert s["status"] == "completed" and s["audio_samples"] == 48000
    assert "model 'gpt-realtime' is an OpenAI model id" in server.output()


async def test_sdk_beta_realtime_turn_strict_beta_types(server):
    from openai_sdk_turns import beta_commit_driven_turn

    s = await beta_commit_driven_turn(server.url, "gpt-4o-realtime-preview", FIXTURES / "question_16k.wav", timeout=bound(30))
    assert s["status"] == "completed" and s["audio_samples"] == 48000
    assert s["transcript"] == "Hello there, this is " and s["instructions"] == "Answer briefly."
    assert "response.audio.delta" in s["types"] and "response.output_audio.delta" not in s["types"]
    assert "conversation.item.created" in s["types"] and "conversation.item.done" not in s["types"]


async def test_sdk_semantic_vad_update_applies_everything(server):
    from openai_sdk_turns import semantic_vad_turn

    s = await semantic_vad_turn(server.url, "gpt-realtime", FIXTURES / "question_16k.wav", timeout=bound(30))
    td = s["session"].audio.input.turn_detection
    assert td.type == "server_vad" and td.silence_duration_ms == 300  # eagerness high
    assert s["session"].instructions == "Be brief." and s["session"].audio.output.voice == "ash"
    assert s["status"] == "completed" and s["audio_samples"] == 48000
    assert "input_audio_buffer.speech_stopped" in s["types"]


@pytest.fixture(scope="module")
def long_server():
    # 6-unit answers: between the answer's first audio and the user's speech over it the server feeds
    # silence once input runs dry (one unit per ~1.25 s of wall time); a 2-unit answer could finish
    # before a client slowed by a loaded machine speaks, a 6-unit one cannot (~6 s)
    with ServerProc("scripted", "--scripted", "units_per_turn=6") as srv:
        yield srv


async def test_sdk_server_vad_barge_in_with_client_truncate(long_server):
    from openai_sdk_turns import server_vad_barge_in

    s = await server_vad_barge_in(long_server.url, "gpt-realtime", FIXTURES / "question_16k.wav",
                                  FIXTURES / "interrupt_16k.wav", timeout=bound(90))
    assert s["statuses"] == ["cancelled", "completed"]
    cut, answer = s["audio_samples"]
    assert 0 < cut < 144000 and answer == 144000  # the first answer cut inside its 6 s; the second whole
    assert s["items"][0] == s["first_item"] and s["items"][1] != s["first_item"]
    t = s["truncated"]
    assert t != "sent" and t.item_id == s["first_item"] and 0 <= t.audio_end_ms <= cut * 1000 // 24000
    types = s["types"]
    stop = types.index("input_audio_buffer.speech_started", types.index("response.output_audio.delta"))
    assert types.index("response.done") > stop  # cancelled after the user spoke over it
