"""The realtime event-name dialects applied at the server's serialisation edge (server/dialect.py)."""

from __future__ import annotations

import pytest

from duplexkit_server.dialect import GA_TO_BETA, dialect_of_first_update, pick_dialect, translate


def test_pick_dialect_rule():
    assert pick_dialect(None, None) is None
    assert pick_dialect("BETA", None) == "beta" and pick_dialect("ga", "realtime=v1") == "ga"
    assert pick_dialect(None, "realtime=v1") == "beta"
    assert pick_dialect(None, "assistants=v2") is None
    with pytest.raises(ValueError, match="ga, beta, both"):
        pick_dialect("v0", None)


def test_first_update_shape():
    vllm_omni_like = {"type": "session.update", "session": {"modalities": ["audio", "text"], "input_audio_format": "pcm16",
                                                            "audio": {"input": {"sample_rate_hz": 16000}}}}
    assert dialect_of_first_update(vllm_omni_like) == "both"
    assert dialect_of_first_update({"type": "session.update", "session": {"type": "realtime", "modalities": ["audio"]}}) == "ga"
    assert dialect_of_first_update({"type": "session.update", "session": {"turn_detection": None}}) == "ga"
    assert dialect_of_first_update('{"type":"input_audio_buffer.append","audio":""}') == "ga"
    assert dialect_of_first_update("not json") is None


def test_translate():
    delta = {"type": "response.output_audio.delta", "event_id": "e1", "server_event_seq": 7, "delta": "AA=="}
    assert translate(delta, "ga") == [delta]
    both = translate(delta, "both")
    assert [f["type"] for f in both] == ["response.output_audio.delta", "response.audio.delta"]
    assert both[1]["server_event_seq"] == 7 and both[1]["event_id"] == "e1"
    assert [f["type"] for f in translate(delta, "beta")] == ["response.audio.delta"]
    assert translate({"type": "conversation.item.done", "item": {}}, "beta") == []
    added = translate({"type": "conversation.item.added", "item": {"content": [{"type": "output_audio"}]}}, "beta")[0]
    assert added["type"] == "conversation.item.created" and added["item"]["content"][0]["type"] == "audio"
    assert added["previous_item_id"] is None
    sess = translate({"type": "session.created", "session": {"model": "m", "output_modalities": ["audio"],
                                                             "audio": {"input": {"turn_detection": None}}}},
                     "beta", beta_model="gpt-realtime")[0]["session"]
    assert sess["model"] == "gpt-realtime" and sess["modalities"] == ["audio"] and sess["input_audio_format"] == "pcm16"
    assert len(GA_TO_BETA) == 6
