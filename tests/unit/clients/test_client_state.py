"""The sans-I/O client state: table scenarios (inputs -> actions) and a hypothesis state machine.

No sockets, no asyncio: server events (dicts, GA and beta names) go into
:class:`duplexkit.clients.ClientState`, a :class:`duplexkit.audio.PlaybackBuffer` is "played" by
reading it in blocks, and what comes out is compared as compact strings:

* ``send:<type>`` (``send:ack(<ms>)`` / ``send:ack(<ms>,truncate)`` for ``playback.ack``,
  ``send:cancel(<rid>)``), ``flush:<rid>@<ms>(<reason>)``, ``heard:<rid>@<ms>``,
  ``resolve:<name>``, ``reject:<name>:<code>``, ``started:<rid>``, ``ended:<rid>``.

``Deliver`` and ``ResponseAudio`` actions are left out of the tables (every event is delivered;
that is checked once separately).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from duplexkit.audio import PlaybackBuffer
from duplexkit.clients import state as cs

RATE = 24_000


# ------------------------------------------------------------------------------------------------
# event builders (server events as they arrive on the wire)
# ------------------------------------------------------------------------------------------------


def pcm_b64(ms: int, amp: float = 0.1) -> str:
    n = ms * RATE // 1000
    x = (amp * np.sin(np.arange(n) * 2 * np.pi * 220 / RATE) * 32767).astype("<i2")
    return base64.b64encode(x.tobytes()).decode()


def created(rid: str, trigger: str = "client", epoch: int = 0) -> dict:
    return {"type": "response.created", "response": {"id": rid, "object": "realtime.response",
                                                     "status": "in_progress", "trigger": trigger, "epoch": epoch}}


def audio(rid: str, ms: int, beta: bool = False) -> dict:
    return {"type": "response.audio.delta" if beta else "response.output_audio.delta", "response_id": rid,
            "item_id": "item_" + rid, "output_index": 0, "content_index": 0, "delta": pcm_b64(ms)}


def done(rid: str, status: str = "completed", reason: Optional[str] = None) -> dict:
    r: dict[str, Any] = {"id": rid, "object": "realtime.response", "status": status}
    if reason:
        r["status_details"] = {"type": status, "reason": reason}
    return {"type": "response.done", "response": r}


def session_updated(turn_detection: Any = None, fmt: Optional[dict] = None, flat: Optional[str] = None) -> dict:
    s: dict[str, Any] = {"id": "sess_1", "turn_detection": turn_detection,
                         "audio": {"input": {"format": fmt or {"type": "audio/pcm", "sample_rate_hz": 16000},
                                             "turn_detection": turn_detection}}}
    if flat:
        s["input_audio_format"] = flat
    return {"type": "session.updated", "session": s}


TD_ON = {"type": "server_vad", "interrupt_response": True, "create_response": False}


# ------------------------------------------------------------------------------------------------
# the harness
# ------------------------------------------------------------------------------------------------


class Harness:
    def __init__(self, auto_ack: bool = True) -> None:
        self.player = PlaybackBuffer(RATE)
        self.state = cs.ClientState(self.player, auto_ack=auto_ack)
        self.player.on_drained(lambda rid: self._drained.append(rid))
        self._drained: list[str] = []
        self.names: dict[str, str] = {}  # event_id -> name given in the table
        self.actions: list = []
        self.sent: list[dict] = []

    def take(self, actions: list) -> list:
        self.actions += actions
        self.sent += [a.event for a in actions if isinstance(a, cs.Send)]
        return actions

    # inputs
    def server(self, ev: dict) -> list:
        return self.take(self.state.receive(ev))

    def play(self, ms: int) -> list:
        self.player.read(ms * RATE // 1000)
        out = []
        while self._drained:
            out += self.state.playback_drained(self._drained.pop(0))
        return self.take(out)

    def request(self, name: str, event: dict, quiet: bool = False) -> list:
        send = self.state.request(event, quiet=quiet)
        self.names[send.event["event_id"]] = name
        return self.take([send])

    def barge_in(self) -> list:
        return self.take(self.state.barge_in()[1])

    def summary(self, actions: list) -> list[str]:
        out = []
        for a in actions:
            if isinstance(a, cs.Send):
                e = a.event
                if e["type"] == "playback.ack":
                    out.append(f"send:ack({e['played_ms']}{',truncate' if e.get('truncate') else ''})")
                elif e["type"] == "response.cancel":
                    out.append(f"send:cancel({e.get('response_id')})")
                else:
                    out.append(f"send:{self.names.get(e['event_id'], e['type'])}")
            elif isinstance(a, cs.PlaybackFlushed):
                out.append(f"flush:{a.response_id}@{a.played_ms}({a.reason})")
            elif isinstance(a, cs.PlaybackHeard):
                out.append(f"heard:{a.response_id}@{a.played_ms}")
            elif isinstance(a, cs.Resolve):
                out.append(f"resolve:{self.names.get(a.event_id, a.event_id)}")
            elif isinstance(a, cs.Reject):
                out.append(f"reject:{self.names.get(a.event_id, a.event_id)}:{a.error.code}")
            elif isinstance(a, cs.ResponseStarted):
                out.append(f"started:{a.response.id}")
            elif isinstance(a, cs.ResponseEnded):
                out.append(f"ended:{a.response.id}")
            elif isinstance(a, cs.SessionEnded):
                out.append(f"session_ended:{a.reason}")
        return out


@dataclass
class S:
    """One step: an input and the actions it must produce (in order)."""

    do: Callable[[Harness], list]
    out: list[str] = field(default_factory=list)
    check: Optional[Callable[[Harness], Any]] = None


def srv(ev: dict) -> Callable[[Harness], list]:
    return lambda h: h.server(ev)


def play(ms: int) -> Callable[[Harness], list]:
    return lambda h: h.play(ms)


def req(name: str, ev: dict, quiet: bool = False) -> Callable[[Harness], list]:
    return lambda h: h.request(name, ev, quiet)


def barge(h: Harness) -> list:
    return h.barge_in()


def queued(rid: str, ms: int) -> Callable[[Harness], None]:
    def check(h: Harness) -> None:
        assert h.player.queued_samples(rid) * 1000 // RATE == ms

    return check


SCENARIOS: dict[str, list[S]] = {
    "fully heard: reported when the last sample plays, not at response.done": [
        S(srv(created("r1")), ["started:r1"]),
        S(srv(audio("r1", 1000))),
        S(srv(audio("r1", 1000))),
        S(srv(done("r1")), ["ended:r1"], check=queued("r1", 2000)),
        S(play(1500), [], check=lambda h: h.state.speaking is True),
        S(play(600), ["heard:r1@2000", "send:ack(2000,truncate)"], check=lambda h: h.state.speaking is False),
        S(play(500), []),
    ],
    "already played out when done arrives (audio slower than real time): heard at done": [
        S(srv(created("r1")), ["started:r1"]),
        S(srv(audio("r1", 500))),
        S(play(700), []),  # drained while generating: not yet fully heard
        S(srv(done("r1", "incomplete", "max_output_tokens")), ["ended:r1", "heard:r1@500", "send:ack(500,truncate)"]),
    ],
    "server cancel (turn_detected) while playing: flush at once, report the heard position": [
        S(srv(created("r1")), ["started:r1"]),
        S(srv(audio("r1", 3000))),
        S(play(800)),
        S(srv(done("r1", "cancelled", "turn_detected")),
          ["ended:r1", "flush:r1@800(cancelled)", "send:ack(800,truncate)"], check=queued("r1", 0)),
        S(play(100), [], check=lambda h: h.player.underrun_samples == 100 * RATE // 1000),
        S(srv(audio("r1", 1000)), [], check=queued("r1", 0)),  # late audio of a done response: never played
    ],
    "cancelling output_audio_buffer.cleared flushes; the later done adds nothing": [
        S(srv(created("r1")), ["started:r1"]),
        S(srv(audio("r1", 2000))),
        S(play(300)),
        S(srv({"type": "output_audio_buffer.cleared", "response_id": "r1"}),
          ["flush:r1@300(cleared)", "send:ack(300,truncate)"]),
        S(srv(done("r1", "cancelled", "client_cancelled")), ["ended:r1"]),
    ],
    "barge-in on the tail after response.done: no cancel, flush, truncating ack": [
        S(srv(created("r1")), ["started:r1"]),
        S(srv(audio("r1", 5000))),
        S(srv(done("r1")), ["ended:r1"]),
        S(play(1000), [], check=lambda h: h.state.speaking),
        S(barge, ["flush:r1@1000(barge_in)", "send:ack(1000,truncate)"],
          check=lambda h: not h.state.speaking and h.state.barge_ins == 1),
        S(play(20), [], check=queued("r1", 0)),
    ],
    "barge-in while generating: cancel + flush + one final ack; the cancelled done adds nothing": [
        S(srv(created("r1")), ["started:r1"]),
        S(srv(audio("r1", 1000))),
        S(play(200)),
        S(barge, ["send:cancel(r1)", "flush:r1@200(barge_in)", "send:ack(200,truncate)"]),
        S(srv(audio("r1", 1000)), [], check=queued("r1", 0)),
        S(srv(done("r1", "cancelled", "client_cancelled")), ["ended:r1"]),
        S(barge, []),  # nothing audible or generating any more
    ],
    "barge-in before any audio: cancel only (nothing heard, nothing to report)": [
        S(srv(created("r1")), ["started:r1"]),
        S(barge, ["send:cancel(r1)", "flush:r1@0(barge_in)"]),
    ],
    "server VAD speech_started over an audible tail (interrupt_response on): flush + report": [
        S(srv(session_updated(TD_ON))),
        S(srv(created("r1", "model")), ["started:r1"]),
        S(srv(audio("r1", 4000))),
        S(srv(done("r1")), ["ended:r1"]),
        S(play(1200)),
        S(srv({"type": "input_audio_buffer.speech_started", "audio_start_ms": 100, "item_id": "it_u"}),
          ["flush:r1@1200(speech_started)", "send:ack(1200,truncate)"]),
    ],
    "speech_started with turn detection off leaves playback alone": [
        S(srv(session_updated(None))),
        S(srv(created("r1")), ["started:r1"]),
        S(srv(audio("r1", 1000))),
        S(srv({"type": "input_audio_buffer.speech_started", "audio_start_ms": 0, "item_id": "it_u"}), [],
          check=queued("r1", 1000)),
    ],
    "barge-in stops the newest response and every older audible tail": [
        S(srv(created("r1", "model")), ["started:r1"]),
        S(srv(audio("r1", 2000))),
        S(srv(done("r1")), ["ended:r1"]),
        S(srv(created("r2", "model")), ["started:r2"]),
        S(srv(audio("r2", 1000))),
        S(play(500)),
        S(barge, ["send:cancel(r2)", "flush:r1@500(barge_in)", "send:ack(500,truncate)", "flush:r2@0(barge_in)",
                  "send:ack(0,truncate)"]),
    ],
    "correlation: the VAD's own commit is not our reply; replies resolve in order": [
        S(req("commit", {"type": "input_audio_buffer.commit"}), ["send:commit"]),
        S(req("hb", {"type": "session.heartbeat"}), ["send:hb"]),
        S(srv({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": 900, "item_id": "it_vad"})),
        S(srv({"type": "input_audio_buffer.committed", "item_id": "it_vad"}), []),
        S(srv({"type": "input_audio_buffer.committed", "item_id": "it_mine"}), ["resolve:commit"]),
        S(srv({"type": "session.heartbeat_ack", "session_id": "sess_1"}), ["resolve:hb"],
          check=lambda h: h.state.pending_requests == []),
    ],
    "correlation: a commit while the user still speaks resolves with the VAD turn's item id": [
        S(srv({"type": "input_audio_buffer.speech_started", "audio_start_ms": 100, "item_id": "it_vad"})),
        S(req("commit", {"type": "input_audio_buffer.commit"}), ["send:commit"]),
        S(srv({"type": "input_audio_buffer.committed", "item_id": "it_vad"}), ["resolve:commit"],
          check=lambda h: h.state.pending_requests == []),
        S(srv({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": 900, "item_id": "it_vad"})),
    ],
    "correlation: an error rejects exactly its request; a model-triggered response resolves no create": [
        S(req("create", {"type": "response.create"}), ["send:create"]),
        S(req("update", {"type": "session.update", "session": {"temperature": 9}}), ["send:update"]),
        S(srv(created("r_model", "model")), ["started:r_model"],
          check=lambda h: len(h.state.pending_requests) == 2),
        S(srv({"type": "error", "error": {"type": "invalid_request_error", "code": "invalid_value",
                                          "message": "expected a temperature in 0..2",
                                          "event_id": next(iter([]), None)}}), []),
        S(lambda h: h.server({"type": "error", "error": {
            "type": "invalid_request_error", "code": "invalid_value", "message": "temperature out of range",
            "event_id": [k for k, v in h.names.items() if v == "update"][0]}}), ["reject:update:invalid_value"]),
        S(srv(done("r_model")), ["ended:r_model"]),
        S(srv(created("r_mine", "client")), ["started:r_mine", "resolve:create"]),
    ],
    "cancel races are swallowed; other errors of a cancel are delivered": [
        S(req("cancel", {"type": "response.cancel"}, quiet=True), ["send:cancel(None)"]),
        S(lambda h: h.server({"type": "error", "error": {
            "type": "invalid_request_error", "code": "response_not_active", "message": "nothing active",
            "event_id": [k for k, v in h.names.items() if v == "cancel"][0]}}), [],
          check=lambda h: not any(isinstance(a, cs.Deliver) and a.event.type == "error" for a in h.actions)),
    ],
    "compat profile: OpenAI's cancel-race code is swallowed too, and a repeat of it": [
        S(req("cancel", {"type": "response.cancel"}, quiet=True), ["send:cancel(None)"]),
        S(lambda h: h.server({"type": "error", "error": {
            "type": "invalid_request_error", "code": "response_cancel_not_active", "message": "nothing active",
            "event_id": [k for k, v in h.names.items() if v == "cancel"][0]}}), [],
          check=lambda h: not any(isinstance(a, cs.Deliver) and a.event.type == "error" for a in h.actions)),
        S(lambda h: h.server({"type": "error", "error": {
            "type": "invalid_request_error", "code": "response_cancel_not_active", "message": "nothing active",
            "event_id": [k for k, v in h.names.items() if v == "cancel"][0]}}), [],
          check=lambda h: not any(isinstance(a, cs.Deliver) and a.event.type == "error" for a in h.actions)),
        # a request the caller waits on is rejected under duplexkit's name
        S(req("delete", {"type": "conversation.item.delete", "item_id": "nope"}), ["send:delete"]),
        S(lambda h: h.server({"type": "error", "error": {
            "type": "invalid_request_error", "code": "item_delete_invalid_item_id", "message": "no such item",
            "event_id": [k for k, v in h.names.items() if v == "delete"][0]}}),
          ["reject:delete:item_not_found"]),
    ],
    "beta (vLLM-Omni) names drive the same machine": [
        S(srv(created("r1")), ["started:r1"]),
        S(srv(audio("r1", 1000, beta=True)), [], check=queued("r1", 1000)),
        S(srv({"type": "response.audio_transcript.delta", "response_id": "r1", "item_id": "item_r1",
               "delta": "hi"}), [], check=lambda h: h.state.responses["r1"].transcript == "hi"),
        S(srv(done("r1")), ["ended:r1"]),
        S(play(1000), ["heard:r1@1000", "send:ack(1000,truncate)"]),
    ],
    "auto_ack off: flushes still happen, no acks are sent": [
        S(lambda h: (setattr(h.state, "auto_ack", False), [])[1]),
        S(srv(created("r1")), ["started:r1"]),
        S(srv(audio("r1", 1000))),
        S(play(400)),
        S(srv(done("r1", "cancelled", "turn_detected")), ["ended:r1", "flush:r1@400(cancelled)"]),
    ],
    "session.closed rejects waiting requests and ends generating responses": [
        S(req("commit", {"type": "input_audio_buffer.commit"}), ["send:commit"]),
        S(srv(created("r1")), ["started:r1"]),
        S(srv({"type": "session.closed", "session_id": "sess_1", "epoch": 0, "reason": "timeout"}),
          ["reject:commit:session_closed", "ended:r1", "session_ended:timeout"],
          check=lambda h: h.state.closed),
    ],
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name):
    h = Harness()
    for i, step in enumerate(SCENARIOS[name]):
        got = h.summary(step.do(h))
        assert got == step.out, f"step {i} of {name!r}"
        if step.check is not None:
            assert step.check(h) is not False, f"check of step {i} of {name!r}"


def test_every_event_is_delivered_typed_and_duplicates_of_an_item_are_dropped():
    h = Harness()
    item = {"id": "it_1", "type": "message", "role": "user", "content": []}
    acts = h.server({"type": "conversation.item.created", "item": item})
    acts += h.server({"type": "conversation.item.added", "item": item})
    acts += h.server({"type": "vendor.custom", "x": 1})
    delivered = [a.event for a in acts if isinstance(a, cs.Deliver)]
    assert [e.type for e in delivered] == ["conversation.item.added", "vendor.custom"]
    assert delivered[0].raw_type == "conversation.item.created"
    assert type(delivered[1]).__name__ == "UnknownServerEvent"


@pytest.mark.parametrize("session,expected", [
    (session_updated(fmt={"type": "audio/pcm", "rate": 24000}), ("pcm16", 24000)),
    (session_updated(fmt={"type": "audio/pcm", "sample_rate_hz": 16000}), ("pcm16", 16000)),
    (session_updated(fmt={"type": "audio/pcm_f32le", "sample_rate_hz": 16000}), ("pcm_f32le", 16000)),
    (session_updated(fmt={"type": "audio/pcmu"}), ("g711_ulaw", 8000)),
    ({"type": "session.updated", "session": {"id": "s", "input_audio_format": "pcm_f32le",
                                             "sample_rate_hz": 48000}}, ("pcm_f32le", 48000)),
])
def test_input_format_follows_the_last_session_update(session, expected):
    h = Harness()
    assert h.state.input_format is None
    h.server(session)
    f = h.state.input_format
    assert (f.encoding, f.rate) == expected


# ------------------------------------------------------------------------------------------------
# property test: any interleaving of server events, playback and barge-ins keeps playback truth
# ------------------------------------------------------------------------------------------------


class PlaybackTruth(RuleBasedStateMachine):
    """The server opens at most one generating response at a time (docs/protocol.md §5.3); the
    client plays, barges in and hears server cancels in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness()
        self.n = 0
        self.gen: Optional[str] = None
        self.turn_detection = False

    def _acks(self, rid: str) -> list[dict]:
        return [e for e in self.h.sent if e["type"] == "playback.ack" and e["response_id"] == rid]

    @rule(td=st.booleans())
    def update(self, td):
        self.turn_detection = td
        self.h.server(session_updated(TD_ON if td else None))

    @precondition(lambda self: self.gen is None)
    @rule()
    def create(self):
        self.n += 1
        self.gen = f"r{self.n}"
        self.h.server(created(self.gen, "model"))

    @precondition(lambda self: self.gen is not None)
    @rule(ms=st.integers(10, 1500))
    def delta(self, ms):
        self.h.server(audio(self.gen, ms))

    @precondition(lambda self: self.gen is not None)
    @rule(status=st.sampled_from(["completed", "cancelled", "incomplete", "failed"]))
    def finish(self, status):
        self.h.server(done(self.gen, status, "turn_detected" if status == "cancelled" else None))
        self.gen = None

    @precondition(lambda self: self.gen is not None)
    @rule()
    def clear(self):
        self.h.server({"type": "output_audio_buffer.cleared", "response_id": self.gen})

    @rule(ms=st.integers(1, 2500))
    def play(self, ms):
        self.h.play(ms)

    @rule()
    def barge(self):
        self.h.barge_in()

    @rule()
    def speech(self):
        self.h.server({"type": "input_audio_buffer.speech_started", "audio_start_ms": 0, "item_id": "it_u"})

    @invariant()
    def truth(self):
        st_ = self.h.state
        for rid, rec in st_.responses.items():
            played = rec.played_ms
            assert played <= rec.audio_ms
            acks = self._acks(rid)
            # acknowledged positions never go down, never exceed what played, at most one final
            pos = [a["played_ms"] for a in acks]
            assert pos == sorted(pos) and all(p <= played for p in pos)
            assert sum(1 for a in acks if a.get("truncate")) <= 1
            if any(a.get("truncate") for a in acks):
                assert acks[-1].get("truncate") and rec.heard_final
            if rec.flushed:
                assert self.h.player.queued_samples(rid) == 0
            if not rec.generating and rec.audio_samples and not rec.flushed and \
                    self.h.player.queued_samples(rid) == 0:
                # done and played out: reported fully heard, exactly at its full length
                assert rec.heard_final and acks and acks[-1]["played_ms"] == rec.audio_ms
            if rec.heard_final and rec.audio_samples and acks:
                assert acks[-1]["played_ms"] == played
        assert st_.speaking == any(self.h.player.queued_samples(r) > 0 for r in st_.responses)
        assert sum(1 for e in self.h.sent if e["type"] == "response.cancel") <= self.n


TestPlaybackTruth = PlaybackTruth.TestCase
TestPlaybackTruth.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
