"""Session-level interop (docs/protocol.md §11): vLLM-Omni's session fields and item-id convention, OpenAI's
semantic_vad, field-naming errors of an all-or-nothing session.update (docs/server.md, "Interop")."""

from __future__ import annotations

import numpy as np

from _driver import Driver, pcm16_b64
from duplexkit.session import SEMANTIC_VAD_SILENCE_MS, SessionConfig


def _spoken(d: Driver) -> dict:
    d.send({"type": "session.update", "session": {"extra_body": {"playback_commit_policy": "ack_only"}}})
    d.speak(["One two ", "three four ", "five."])
    return d.of("response.done")[-1]["response"]


def test_playback_ack_with_vllm_omni_item_id_is_applied():
    d = Driver()
    r = _spoken(d)
    rid, iid = r["id"], r["output"][0]["id"]
    new = d.send({"type": "playback.ack", "response_id": rid, "item_id": "item_" + rid, "played_ms": 700,
                  "committed_ms": 700})
    assert not d.of("error", new)
    assert d.s.item_playback(iid)[1] == 700
    # an item id that is neither ours nor "item_" + response_id is still item_not_found
    new = d.send({"type": "playback.ack", "response_id": rid, "item_id": "item_other", "played_ms": 900})
    assert [e["error"]["code"] for e in d.of("error", new)] == ["item_not_found"]
    assert d.s.item_playback(iid)[1] == 700


def test_vllm_omni_minicpm_preset_session_update_is_honoured():
    # the payload shape of vLLM-Omni's MiniCPM-o 4.5 preset (described from their client, not copied)
    d = Driver(SessionConfig(profile="duplex"), start=False)
    d.send({"type": "session.update", "session": {
        "model": "openbmb/MiniCPM-o-4_5", "modalities": ["audio", "text"], "input_audio_format": "pcm16",
        "output_audio_format": "pcm16", "sample_rate_hz": 16000,
        "audio": {"input": {"sample_rate_hz": 16000}, "output": {"sample_rate_hz": 24000}},
        "turn_detection": None, "overlap_policy": "listen_only", "playback_commit_policy": "ack_only",
        "extra_body": {"auto_response": False, "force_listen_count": 0, "minicpmo45_native_duplex": True}}})
    assert d.types()[0] == "session.created"
    assert not d.of("error") and not d.of("session.warning")
    assert d.s.settings.answer_policy == "on_request"  # auto_response: false
    assert d.s.settings.turn_detection is None


def test_overlap_policy_listen_only_disables_vad_interrupt_and_unknown_warns_once():
    d = Driver(SessionConfig(profile="duplex"))
    d.send({"type": "session.update", "session": {"overlap_policy": "listen_only"}})
    assert d.s.settings.turn_detection["interrupt_response"] is False
    new = d.send({"type": "session.update", "session": {"overlap_policy": "short_ack", "instructions": "Be brief."}})
    assert d.types(new) == ["session.updated", "session.warning"]
    w = d.of("session.warning", new)[0]
    assert w["param"] == "session.overlap_policy" and "short_ack" in w["message"]
    assert d.s.settings.instructions == "Be brief."  # the rest of the update applies
    again = d.send({"type": "session.update", "session": {"overlap_policy": "short_ack"}})
    assert not d.of("session.warning", again)  # once per param


def test_native_duplex_false_and_video_frames_warn_and_wrong_output_rate_errors():
    d = Driver(SessionConfig(profile="duplex"))
    new = d.send({"type": "session.update", "session": {"extra_body": {"native_duplex": False}}})
    assert [w["param"] for w in d.of("session.warning", new)] == ["session.extra_body.native_duplex"]
    x = (0.1 * np.sin(np.arange(1600) / 5)).astype(np.float32)
    new = d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x), "sample_rate_hz": 16000,
                  "video_frames": ["aGVsbG8="]})
    assert [w["param"] for w in d.of("session.warning", new)] == ["video_frames"]
    new = d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x), "sample_rate_hz": 48000})
    assert [w["param"] for w in d.of("session.warning", new)] == ["sample_rate_hz"]
    new = d.send({"type": "session.update", "session": {"audio": {"output": {"sample_rate_hz": 16000}}}})
    e = d.of("error", new)[0]["error"]
    assert e["code"] == "unsupported_audio_format" and e["param"] == "session.audio.output.sample_rate_hz"


def test_semantic_vad_maps_to_server_vad_with_eagerness():
    d = Driver()
    upd = {"type": "realtime", "instructions": "Hi.", "audio": {"input": {"turn_detection": {
        "type": "semantic_vad", "eagerness": "low", "interrupt_response": True, "create_response": True}},
        "output": {"voice": "alloy"}}}
    new = d.send({"type": "session.update", "session": upd})
    assert d.types(new) == ["session.updated"]
    td = new[0]["session"]["audio"]["input"]["turn_detection"]
    assert td["type"] == "server_vad" and td["silence_duration_ms"] == SEMANTIC_VAD_SILENCE_MS["low"] == 1000
    assert d.s.settings.instructions == "Hi." and d.s.settings.voice == "alloy"


def test_invalid_field_names_the_field_and_applies_nothing():
    # OpenAI rejects an invalid session.update as a whole with an error naming the field; so do we
    d = Driver()
    before = d.s.settings.copy()
    new = d.send({"type": "session.update", "session": {"type": "realtime", "instructions": "X", "audio": {
        "input": {"turn_detection": {"type": "server_vad", "threshold": 7}}}}})
    e = d.of("error", new)[0]["error"]
    assert e["code"] == "unsupported_turn_detection"
    assert e["param"] == "session.audio.input.turn_detection.threshold"
    assert d.s.settings == before


def test_playback_ack_without_response_id_uses_item_id_or_latest_response():
    d = Driver()
    r = _spoken(d)
    rid, iid = r["id"], r["output"][0]["id"]
    assert not d.of("error", d.send({"type": "playback.ack", "item_id": "item_" + rid, "played_ms": 300}))
    assert d.s.item_playback(iid)[1] == 300
    assert not d.of("error", d.send({"type": "playback.ack", "played_ms": 600}))  # vLLM-Omni's ack_playback(ms)
    assert d.s.item_playback(iid)[1] == 600
    new = d.send({"type": "playback.ack", "item_id": "item_nope", "played_ms": 900})
    assert [e["error"]["code"] for e in d.of("error", new)] == ["item_not_found"]
