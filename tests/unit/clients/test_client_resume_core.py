"""The resume handshake of the sans-I/O client core (docs/protocol.md §1.6), without sockets.

:class:`duplexkit.clients.ClientState` decides everything after a dropped connection: whether to
reconnect, when, the ``session.resume`` to send, what the server's first answer means and which
frames to send again. These tests feed it what a shell would report (``connection_ended``,
``reconnect_failed``, ``resume_answer``) and check the actions; the asyncio shell is covered by
tests/unit/clients/test_remote_client.py and tests/e2e/test_session_resume.py.
"""

from __future__ import annotations

import pytest

from duplexkit.audio import PlaybackBuffer
from duplexkit.clients import state as cs
from duplexkit.errors import DuplexConnectionError

SID = "sess_" + "a" * 24


def created(resume: bool = True, token: str = "tok1") -> dict:
    return {"type": "session.created", "event_id": "event_1", "server_event_seq": 1, "resume_token": token,
            "session": {"id": SID, "capabilities": {"supports_session_resume": resume}}}


def beat(seq: int) -> dict:
    return {"type": "session.heartbeat_ack", "session_id": SID, "server_event_seq": seq}


def opened(resume_enabled: bool = True, attempts: int = 5, caps: bool = True) -> cs.ClientState:
    st = cs.ClientState(PlaybackBuffer(), resume_enabled=resume_enabled, resume_attempts=attempts)
    st.request({"type": "session.update", "session": {}})
    st.receive(created(caps))
    st.receive(beat(2))
    return st


def kinds(actions: list) -> list[str]:
    out = []
    for a in actions:
        if isinstance(a, cs.Deliver):
            out.append("deliver:" + a.event.type)
        elif isinstance(a, cs.Reconnect):
            out.append(f"reconnect#{a.attempt}@{a.delay_s:g}")
        elif isinstance(a, cs.ResumeAccepted):
            out.append(f"accepted:{len(a.frames)}")
        elif isinstance(a, cs.Reject):
            out.append("reject:" + getattr(a.error, "code", "?"))
        elif isinstance(a, cs.SessionEnded):
            out.append("ended:" + (a.error.code if a.error is not None else str(a.reason)))
        else:
            out.append(type(a).__name__)
    return out


def ended_error(actions: list) -> DuplexConnectionError:
    ends = [a for a in actions if isinstance(a, cs.SessionEnded)]
    assert len(ends) == 1 and ends[0].error is not None, kinds(actions)
    return ends[0].error


def test_a_drop_of_a_resumable_session_reconnects_and_asks_to_resume_from_the_last_event():
    st = opened()
    assert st.opened and st.supports_resume and st.resumable and st.resume_token == "tok1"
    pending = st.request({"type": "input_audio_buffer.commit"}).event["event_id"]
    acts = st.connection_ended(1006, "no close frame")
    assert kinds(acts) == ["deliver:client.reconnecting", "reconnect#1@0"]
    assert acts[0].event.close_code == 1006 and acts[0].event.last_server_event_seq == 2
    ev = acts[1].event
    assert ev["type"] == "session.resume" and ev["event_id"].startswith("cevt_")
    assert (ev["session_id"], ev["resume_token"], ev["last_server_event_seq"]) == (SID, "tok1", 2)
    assert st.reconnecting and not st.closed
    assert pending in st.pending_requests  # nothing fails while reconnecting


def test_failed_attempts_back_off_then_the_session_is_lost():
    st = opened(attempts=5)
    st.request({"type": "input_audio_buffer.commit"})
    steps = [kinds(st.connection_ended(1006))[-1]]
    for _ in range(4):
        steps.append(kinds(st.reconnect_failed())[-1])
    assert steps == ["reconnect#1@0", "reconnect#2@0.2", "reconnect#3@0.4", "reconnect#4@0.8", "reconnect#5@1.6"]
    acts = st.reconnect_failed()
    assert kinds(acts) == ["reject:connection_lost", "ended:connection_lost"]
    err = ended_error(acts)
    assert err.close_code == 1006 and "close code 1006" in str(err)
    assert st.closed and not st.reconnecting and st.pending_requests == []


def test_the_delay_between_attempts_stops_growing_at_five_seconds():
    st = opened(attempts=9)
    delays = [st.connection_ended(1006)[-1].delay_s] + [st.reconnect_failed()[-1].delay_s for _ in range(8)]
    assert delays == [0.0, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]


def test_session_resumed_rotates_the_token_and_names_the_frames_to_send_again():
    st = opened()
    for i in range(1, 11):
        st.frame_sent(f"frame {i}")
    st.connection_ended(1006)
    reply = {"type": "session.resumed", "session_id": SID, "last_server_event_seq": 2, "replayed": 0,
             "client_frames_received": 7, "resume_token": "tok2"}
    acts = st.resume_answer(reply)
    assert kinds(acts) == ["accepted:3"]
    assert acts[0].frames == ("frame 8", "frame 9", "frame 10") and acts[0].lost is None
    assert acts[0].event is reply and st.resume_token == "tok2"
    assert st.reconnecting and st.resumes == 0  # the shell hands the event over once the frames are out
    acts = st.receive(acts[0].event)
    assert kinds(acts) == ["deliver:session.resumed"] and st.resumes == 1 and not st.reconnecting
    assert st.receive(beat(2)) == []  # replayed and already seen
    # the next drop resumes with the rotated token
    assert st.connection_ended(1006)[-1].event["resume_token"] == "tok2"


@pytest.mark.parametrize("received", [10, 12, None, "7", True])
def test_nothing_is_sent_again_when_the_server_got_every_frame_or_does_not_say(received):
    st = opened()
    for i in range(1, 11):
        st.frame_sent(f"frame {i}")
    st.connection_ended(1006)
    acts = st.resume_answer({"type": "session.resumed", "session_id": SID, "client_frames_received": received})
    assert acts[0].frames == () and acts[0].lost is None


def test_frames_older_than_the_outbox_are_reported_lost():
    st = opened()
    n = cs.OUTBOX_FRAMES + 10
    for i in range(1, n + 1):
        st.frame_sent(f"f{i}")
    st.connection_ended(1006)
    acts = st.resume_answer({"type": "session.resumed", "session_id": SID, "client_frames_received": 5})
    assert acts[0].lost == (6, 10)
    assert acts[0].frames[0] == "f11" and acts[0].frames[-1] == f"f{n}" and len(acts[0].frames) == cs.OUTBOX_FRAMES


def test_a_dropped_resend_counts_as_a_failed_attempt():
    st = opened(attempts=2)
    st.frame_sent("x")
    st.connection_ended(1006)
    st.resume_answer({"type": "session.resumed", "session_id": SID, "client_frames_received": 0})
    assert kinds(st.reconnect_failed()) == ["reconnect#2@0.2"]


@pytest.mark.parametrize("code", ["resume_unauthorized", "resume_expired", "resume_journal_overflow"])
def test_a_refusal_ends_the_session_with_its_code(code):
    st = opened()
    eid = st.request({"type": "input_audio_buffer.commit"}).event["event_id"]
    st.connection_ended(1006)
    reply = {"type": "error", "error": {"type": "invalid_request_error", "code": code, "message": "no"}}
    acts = st.resume_answer(reply)
    assert kinds(acts) == [f"reject:{code}", f"ended:{code}"]
    assert acts[0].event_id == eid
    err = ended_error(acts)
    assert "refused to resume" in str(err) and err.event == reply and err.close_code == 1006
    assert st.resume_failures == 1 and st.closed and not st.reconnecting


def test_a_refusal_without_a_code_is_resume_refused():
    st = opened()
    st.connection_ended(1006)
    assert ended_error(st.resume_answer({"type": "error", "error": "garbled"})).code == "resume_refused"


def test_a_server_without_session_resumed_is_taken_at_its_first_replayed_event():
    st = opened()
    st.connection_ended(1006)
    replayed = beat(2)  # vLLM-Omni replays at once: its first event is the answer
    acts = st.resume_answer(replayed)
    assert kinds(acts) == ["deliver:client.resumed", "accepted:0"]
    assert acts[1].event is replayed and st.resumes == 1 and not st.reconnecting
    assert st.receive(replayed) == []  # already seen before the drop
    assert kinds(st.receive(beat(3))) == ["deliver:session.heartbeat_ack"]
    # an answer that is no event at all still counts as taken
    st.connection_ended(1006)
    acts = st.resume_answer([1, 2])
    assert kinds(acts) == ["deliver:client.resumed", "accepted:0"] and acts[1].event is None


@pytest.mark.parametrize("setup", ["resume off", "server does not offer it", "never opened"])
def test_a_drop_that_cannot_be_resumed_ends_the_session_as_lost(setup):
    if setup == "never opened":
        st = cs.ClientState(PlaybackBuffer(), resume_enabled=True)
        st.request({"type": "session.update", "session": {}})
    else:
        st = opened(resume_enabled=setup != "resume off", caps=setup != "server does not offer it")
    assert not st.resumable
    acts = st.connection_ended(1011, "boom")
    err = ended_error(acts)
    assert err.code == "connection_lost" and err.close_code == 1011 and str(err).endswith("(close code 1011): boom")
    assert not any(isinstance(a, cs.Reconnect) for a in acts)


def test_a_drop_after_session_closed_ends_cleanly():
    st = opened()
    st.receive({"type": "session.closed", "session_id": SID, "reason": "client_close", "server_event_seq": 3})
    assert not st.resumable
    acts = st.connection_ended(1000)
    assert not any(isinstance(a, (cs.Reconnect, cs.Reject)) for a in acts)
    assert all(a.error is None for a in acts if isinstance(a, cs.SessionEnded))


@pytest.mark.parametrize("error, code", [
    ({"code": "unauthorized", "message": "bad key"}, "unauthorized"),
    ({"code": "invalid_api_key", "message": "bad key"}, "unauthorized"),  # the compat profile's name
    ({"code": "session_capacity_exhausted", "message": "full"}, "session_capacity_exhausted"),
    ({"code": "bad_event", "message": "unknown dialect", "param": "dialect"}, "bad_event"),
    ({"code": "invalid_value", "message": "no such model", "param": "model"}, "invalid_value"),
])
def test_a_handshake_refusal_before_session_created_is_the_failure(error, code):
    st = cs.ClientState(PlaybackBuffer(), resume_enabled=True)
    eid = st.request({"type": "session.update", "session": {}}).event["event_id"]
    st.receive({"type": "error", "error": {"type": "invalid_request_error", **error}})
    assert st.handshake_error is not None
    acts = st.connection_ended(1008)
    err = ended_error(acts)
    assert err.code == code and err.message == error["message"] and err.close_code == 1008
    assert [a.event_id for a in acts if isinstance(a, cs.Reject)] == [eid]


def test_an_error_answering_a_request_is_no_handshake_refusal():
    st = cs.ClientState(PlaybackBuffer())
    eid = st.request({"type": "session.update", "session": {}}).event["event_id"]
    st.receive({"type": "error", "error": {"type": "invalid_request_error", "code": "bad_event",
                                           "message": "x", "param": "model", "event_id": eid}})
    assert st.handshake_error is None
    assert ended_error(st.connection_ended(1006)).code == "connection_lost"


def test_answers_and_failures_outside_a_resume_change_nothing():
    st = opened()
    assert st.reconnect_failed() == [] and st.resume_answer({"type": "session.resumed", "session_id": SID}) == []
    assert st.resumes == 0 and not st.reconnecting and not st.closed and st.resume_token == "tok1"
