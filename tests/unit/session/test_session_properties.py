"""Property tests: random interleavings of client events, engine outputs, VAD-triggering speech and
clock ticks; every emitted event stream must satisfy docs/protocol.md §12 (checked incrementally by
duplexkit.protocol.conformance.EventStreamChecker inside the driver)."""

from __future__ import annotations

import base64

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from _driver import Driver, fixture_audio
from duplexkit.engine.api import AudioChunk, CancelEpoch, Decision, EngineFailure, TextDelta, TurnEnd
from duplexkit.session import SessionConfig, SessionLimits

SPEECH = fixture_audio("interrupt_16k.wav")
SPEECH_PCM = (np.clip(SPEECH, -1, 1) * 32767).astype("<i2").tobytes()


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.d = Driver(SessionConfig(max_output_tokens=40, limits=SessionLimits(idle_timeout_s=10**6, max_pending_input_s=6)))
        self.pos = 0  # byte position in the speech clip
        self.carry = b""

    # ------------------------------------------------------------------ client events
    @rule(n=st.one_of(st.integers(1, 9000), st.integers(20000, 60000)), speech=st.booleans())
    def append(self, n, speech):
        if speech:
            if self.pos >= len(SPEECH_PCM):
                self.pos = 0
            raw = SPEECH_PCM[self.pos : self.pos + n]
            self.pos += n
        else:
            raw = bytes(n)
        self.d.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(raw).decode()})
        self.d.t += len(raw) // 32

    @rule()
    def commit(self):
        self.d.send({"type": "input_audio_buffer.commit"})

    @rule()
    def clear(self):
        e = self.d.s.epoch
        self.d.send({"type": "input_audio_buffer.clear"})
        assert self.d.s.epoch == e

    @rule(mods=st.sampled_from([None, ["text"], ["audio", "text"]]))
    def create(self, mods):
        self.d.send({"type": "response.create", "response": {"output_modalities": mods} if mods else {}})

    @rule(which=st.sampled_from(["active", "none", "stale", "bogus"]))
    def cancel(self, which):
        ev = {"type": "response.cancel"}
        if which == "active" and self.d.s.active_response_id:
            ev["response_id"] = self.d.s.active_response_id
        elif which == "stale" and self.d.checker.done:
            ev["response_id"] = next(iter(self.d.checker.done))
        elif which == "bogus":
            ev["response_id"] = "resp_bogus"
        self.d.send(ev)

    @rule()
    def output_clear(self):
        self.d.send({"type": "output_audio_buffer.clear"})

    @rule(played=st.integers(0, 6000), truncate=st.booleans(), pick=st.integers(0, 5))
    def ack(self, played, truncate, pick):
        rids = list(self.d.checker.created)
        rid = rids[pick % len(rids)] if rids else "resp_none"
        self.d.send({"type": "playback.ack", "response_id": rid, "played_ms": played, "truncate": truncate})

    @rule(end=st.one_of(st.integers(0, 6000), st.floats(0, 10), st.just("x")), pick=st.integers(0, 9), op=st.sampled_from(["truncate", "retrieve", "delete"]))
    def item_op(self, end, pick, op):
        items = [it.id for it in self.d.s.conv.items()] or ["item_none"]
        iid = items[pick % len(items)]
        if op == "truncate":
            self.d.send({"type": "conversation.item.truncate", "item_id": iid, "content_index": 0, "audio_end_ms": end})
        else:
            self.d.send({"type": f"conversation.item.{op}", "item_id": iid})

    @rule(sess=st.sampled_from([
        {"turn_detection": None},
        {"turn_detection": {"type": "server_vad"}},
        {"turn_detection": {"type": "server_vad", "interrupt_response": False, "create_response": True}},
        {"output_modalities": ["text"]},
        {"modalities": ["audio", "text"]},
        {"max_response_output_tokens": 5},
        {"extra_body": {"answer_policy": "on_request"}},
        {"extra_body": {"playback_commit_policy": "commit_on_done"}},
        {"temperature": 5},
        {"turn_detection": {"type": "near_field_vad"}},
    ]))
    def update(self, sess):
        self.d.send({"type": "session.update", "session": sess})

    @rule(raw=st.sampled_from(['{"type":"nope"}', '{"type":', "[]", '{"type":"input_audio_buffer.append","audio":"@@"}',
                               '{"type":"session.heartbeat"}', '{"type":"session.event_ack"}']))
    def garbage(self, raw):
        self.d.send(raw, event_id=None)

    # ------------------------------------------------------------------ engine outputs
    def _epoch(self, stale):
        return max(0, self.d.s.epoch - 1) if stale else self.d.s.epoch

    @rule(speak=st.booleans(), stale=st.booleans())
    def decision(self, speak, stale):
        self.d.engine(Decision(self.d.sid, self._epoch(stale), self.d.last_unit(), decision="speak" if speak else "listen"))

    @rule(text=st.text(max_size=6), n=st.integers(0, 4), stale=st.booleans())
    def text_delta(self, text, n, stale):
        self.d.engine(TextDelta(self.d.sid, self._epoch(stale), self.d.last_unit(), text=text, n_tokens=n))

    @rule(samples=st.integers(0, 30000), text=st.text(max_size=6), stale=st.booleans(), final=st.booleans())
    def audio_chunk(self, samples, text, stale, final):
        a = (0.2 * np.sin(np.arange(samples) / 7)).astype(np.float32)
        self.d.engine(AudioChunk(self.d.sid, self._epoch(stale), self.d.last_unit(), audio=a, text=text, final=final))

    @rule(stale=st.booleans())
    def turn_end(self, stale):
        self.d.engine(TurnEnd(self.d.sid, self._epoch(stale), self.d.last_unit()))

    @rule()
    def engine_error(self):
        self.d.engine(EngineFailure(self.d.sid, self.d.s.epoch, self.d.last_unit(), message="transient"))

    @rule(dt=st.integers(0, 2500))
    def tick(self, dt):
        self.d.tick(dt)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def never_closed(self):
        assert not self.d.s.closed and not self.d.closes

    @invariant()
    def epoch_advances_only_with_cancel_epoch(self):
        assert self.d.s.epoch == sum(isinstance(c, CancelEpoch) for c in self.d.cmds)

    @invariant()
    def history_within_committed(self):
        s = self.d.s
        for it in s.conv.items():
            if it.kind != "output_audio":
                continue
            assert 0 <= it.committed_ms <= it.sent_ms
            truth = s.conv.truth_text(it)
            assert it.text.startswith(truth)
            allowed = max([c for c, ms in it.marks if ms <= it.committed_ms], default=0)
            assert len(truth) <= allowed
        for h in s.history():
            it = s.conv.find(h["id"])
            if it.kind == "output_audio":
                assert h["content"][0].get("transcript", "") == s.conv.truth_text(it)

    @invariant()
    def small_machines_agree_with_their_data(self):
        """Each small machine's state is what the data it names says (duplexkit/session/machine.py)."""
        inp, resp = self.d.s.input, self.d.s.resp
        assert (inp._vad_state.state.value == "none") == (inp._vad_item is None)
        assert (inp._held_commit.state.value == "held") == (inp._close_pending_ms is not None)
        debt = inp.debt
        want = "holding" if debt.held_samples() else "owed" if debt.owed() else "clear"
        assert debt.state.value == want
        assert (inp._unit_hold.state.value == "holding") == (len(inp._unit_hold) > 0)
        assert (resp._hold_state.state.value == "holding") == (resp._turn_hold is not None)
        if resp.active() is None:
            assert self.d.s.phase.value in ("idle", "closed")
        else:
            assert self.d.s.phase.value in ("requested", "speaking")

    @invariant()
    def heartbeat_answered(self):
        new = self.d.send({"type": "session.heartbeat"})
        assert [e["type"] for e in new] == ["session.heartbeat_ack"]

    def teardown(self):
        d = self.d
        if d.s.active_response_id:
            d.send({"type": "response.cancel"})
        d.send({"type": "session.update", "session": {"output_modalities": ["audio", "text"], "max_output_tokens": 1000}})
        new = d.speak(["Fine ", "thanks."])
        assert new[-1]["type"] == "response.done" and new[-1]["response"]["status"] == "completed"
        assert d.of("response.output_audio_transcript.done", new)[0]["transcript"] == "Fine thanks."
        # every created response got exactly one done
        assert set(d.checker.created) == set(d.checker.done)


TestSessionMachine = SessionMachine.TestCase
TestSessionMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
