"""``conversation.item.create`` audio counts against ``max_pending_input_s`` like appends do:
a client cannot queue unbounded audio through items."""

from __future__ import annotations

import numpy as np
from _driver import Driver, fixture_audio, pcm16_b64

from duplexkit.engine.api import AppendUnit
from duplexkit.session import SessionConfig, SessionLimits


def _item(audio: np.ndarray) -> dict:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": pcm16_b64(audio)}]}}


def _errors(new) -> list[str]:
    return [o["error"]["code"] for o in new if isinstance(o, dict) and o["type"] == "error"]


def test_item_audio_is_counted_before_it_is_decoded():
    speech = fixture_audio("long_question_16k.wav")
    limit_s = 2 * len(speech) / 16_000 + 2.0  # two items with their unit padding (< 1 s each), not three
    d = Driver(SessionConfig(limits=SessionLimits(max_pending_input_s=limit_s)))
    added = []
    for _ in range(3):
        new = d.send(_item(speech))
        added.append([o["type"] for o in new if isinstance(o, dict)])
    assert "conversation.item.added" in added[0] and "conversation.item.added" in added[1]
    assert _errors(d.pump()) == [] and "conversation.item.added" not in added[2]
    # the third was refused as backpressure, with no state change
    assert [e for e in d.events if e["type"] == "error"][-1]["error"]["code"] == "input_backpressure"
    queued = d.s.input._framer.pending_samples + d.s.input._inflight_samples + d.s.input.debt.held_samples() + d.s.input._unit_hold.samples()
    assert queued <= limit_s * 16_000  # the cap holds


def test_one_oversized_item_refused():
    speech = fixture_audio("long_question_16k.wav")
    d = Driver(SessionConfig(limits=SessionLimits(max_pending_input_s=len(speech) / 16_000 / 2)))
    new = d.send(_item(speech))
    assert _errors(new) == ["input_backpressure"]
    assert not any(isinstance(c, AppendUnit) for c in d.cmds)
