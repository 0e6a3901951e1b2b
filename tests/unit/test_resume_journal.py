"""The replay journal and resume bookkeeping of the server (server/resume.py) and the client's
side of a resume (ClientState: de-duplication by seq, reconnecting/resumed notices)."""

from __future__ import annotations

import pytest

from duplexkit.audio import VirtualPlayer
from duplexkit.clients.state import ClientState
from duplexkit_server.resume import (EVENT_OVERHEAD_BYTES, JournalOverflow, ReplayJournal, ResumeRefused,
                                     check_resume_fields, parse_resume, token_digest, token_matches)


def _ev(seq: int, delta: str = "") -> dict:
    return {"type": "response.output_audio.delta", "server_event_seq": seq, "delta": delta}


def test_journal_keeps_the_last_events_by_count():
    j = ReplayJournal(max_events=3, max_bytes=10**9)
    for s in range(1, 6):
        j.append(_ev(s))
    assert [e["server_event_seq"] for e in j.since(2)] == [3, 4, 5]
    assert j.since(5) == [] and j.last_seq == 5 and j.dropped_through == 2
    with pytest.raises(JournalOverflow) as ei:
        j.since(1)  # event 2 is gone
    assert ei.value.code == "resume_journal_overflow"


def test_journal_bounded_by_bytes_of_the_audio_it_holds():
    j = ReplayJournal(max_events=100, max_bytes=3 * (EVENT_OVERHEAD_BYTES + 1000))
    for s in range(1, 5):
        j.append(_ev(s, "A" * 1000))  # "A"*1000 + "response.output_audio.delta" > 1000 bytes
    assert len(j) == 2 and j.dropped_through == 2 and j.bytes <= j.max_bytes
    j.append({"type": "x"})  # no seq: not journaled
    assert len(j) == 2


def test_resume_frame_parsing_and_tokens():
    assert parse_resume('{"type":"session.update"}') is None
    assert parse_resume('{"type":"session.resume"') is None  # truncated JSON
    ev = parse_resume('{"type":"session.resume","session_id":"s","resume_token":"t","last_server_event_seq":4}')
    assert check_resume_fields(ev) == ("s", "t", 4)
    for bad, code in [({"session_id": "s", "resume_token": "t", "last_server_event_seq": -1}, "bad_event"),
                      ({"session_id": "s", "resume_token": "t", "last_server_event_seq": True}, "bad_event"),
                      ({"session_id": "s"}, "resume_unauthorized"), ({"resume_token": "t"}, "bad_event")]:
        with pytest.raises(ResumeRefused) as ei:
            check_resume_fields(bad)
        assert ei.value.code == code
    d = token_digest("abc")
    assert token_matches("abc", d) and not token_matches("abd", d)


def _state() -> ClientState:
    return ClientState(VirtualPlayer())


def test_client_state_drops_replayed_events_only_after_a_resume():
    st = _state()
    st.receive({"type": "session.heartbeat_ack", "session_id": "s", "server_event_seq": 1})
    st.receive({"type": "session.heartbeat_ack", "session_id": "s", "server_event_seq": 2})
    acts = st.transport_interrupted(1006)
    assert acts[0].event.type == "client.reconnecting" and acts[0].event.close_code == 1006
    assert st.reconnecting
    acts = st.receive({"type": "session.resumed", "session_id": "s", "last_server_event_seq": 1, "replayed": 1})
    assert acts[0].event.type == "session.resumed" and st.resumes == 1 and not st.reconnecting
    assert st.receive({"type": "session.heartbeat_ack", "session_id": "s", "server_event_seq": 2}) == []  # seen
    acts = st.receive({"type": "session.heartbeat_ack", "session_id": "s", "server_event_seq": 3})
    assert acts and st.last_server_event_seq == 3


def test_client_state_resume_without_a_resumed_event():
    st = _state()
    st.receive({"type": "session.heartbeat_ack", "session_id": "s", "server_event_seq": 1})
    st.transport_interrupted(None)
    acts = st.resume_accepted()
    assert acts[0].event.type == "client.resumed" and st.resumes == 1
    assert st.receive({"type": "session.heartbeat_ack", "session_id": "s", "server_event_seq": 1}) == []


def test_clear_drops_every_event_and_a_later_resume_is_an_overflow():
    j = ReplayJournal(max_events=100, max_bytes=1 << 20)
    for seq in range(1, 6):
        j.append({"type": "x", "server_event_seq": seq, "delta": "A" * 1000})
    assert len(j) == 5 and j.bytes > 5000
    j.clear()
    assert len(j) == 0 and j.bytes == 0 and j.dropped_through == 5
    with pytest.raises(JournalOverflow):
        j.since(2)
    assert j.since(5) == []


def test_scheduled_trim_frees_reference_cycles_the_collector_has_not_reached():
    """A closed session's objects sit in reference cycles; with the cyclic collector idle (a quiet
    server) only the trim's gc.collect() frees them."""
    import asyncio
    import gc
    import weakref

    from duplexkit import memory

    class Node:
        pass

    async def run() -> bool:
        a, b = Node(), Node()
        a.other, b.other = b, a
        a.payload = bytearray(1 << 20)
        dead = weakref.ref(a)
        del a, b
        memory._last = 0.0
        memory.schedule_trim(delay_s=0.01, min_interval_s=0.0)
        await asyncio.sleep(0.2)
        return dead() is None

    was = gc.isenabled()
    gc.disable()
    try:
        assert asyncio.run(run())
    finally:
        if was:
            gc.enable()


def test_scheduled_trim_drops_attribute_names_held_by_the_type_cache():
    """CPython's method cache holds a reference to the name string of a cached attribute lookup; a
    library that builds the name afresh per object (soxr's ``getattr(obj, f"process_{dtype}")`` per
    resampler) leaves such strings alive on pages the load touched. The trim clears the cache."""
    import asyncio
    import sys

    from duplexkit import memory

    class Resampler:
        def process_float32(self):
            return None

    name = "".join(["process_", "float32"])  # a new str object, not the interned one
    before = sys.getrefcount(name)
    getattr(Resampler(), name)
    if sys.getrefcount(name) == before:
        pytest.skip("this interpreter's type cache keeps no reference to lookup names")

    async def run() -> None:
        memory._last = 0.0
        memory.schedule_trim(delay_s=0.01, min_interval_s=0.0)
        await asyncio.sleep(0.2)

    asyncio.run(run())
    assert sys.getrefcount(name) == before
