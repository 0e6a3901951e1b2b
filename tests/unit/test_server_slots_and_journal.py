"""The slot pool (server/app.py SlotPool) and the resume journal's trimming (server/resume.py):
a new session waits for a slot an ending session gives back, parked sessions leave their
client's share, the journal drops acknowledged events and sent events older than keep_sent_s."""

from __future__ import annotations

import asyncio

import pytest

from duplexkit_server.app import SlotPool
from duplexkit_server.resume import JournalOverflow, ReplayJournal


def _ev(seq: int) -> dict:
    return {"type": "response.output_audio.delta", "server_event_seq": seq, "delta": "A" * 100}


async def test_acquire_waits_only_for_a_slot_being_given_back():
    pool = SlotPool(1, per_client=1)
    assert await pool.acquire("a")
    assert not await pool.acquire("b", wait_s=5)  # nothing is ending: refused at once
    pool.ending += 1  # the holder's peer closed; its teardown gives the slot back shortly
    waiter = asyncio.ensure_future(pool.acquire("b", wait_s=5))
    await asyncio.sleep(0)
    assert not waiter.done()
    pool.ending -= 1
    pool.release("a")
    assert await waiter and pool.used == 1 and pool.by_client == {"b": 1}


async def test_a_parked_slot_leaves_the_client_share_but_not_the_pool():
    pool = SlotPool(3, per_client=1)
    assert pool.try_acquire("a")
    pool.leave_share("a")  # parked
    assert pool.try_acquire("a")  # the reloaded page gets a slot of its own
    assert pool.used == 2 and pool.by_client == {"a": 1}
    pool.join_share("a")  # the parked one resumed: it counts again, above the share
    assert pool.by_client == {"a": 2} and not pool.try_acquire("a")
    pool.release("a")
    pool.release("a")
    assert pool.used == 0 and pool.by_client == {}


def test_journal_drops_acknowledged_events_clamped_to_what_was_sent():
    j = ReplayJournal(100, 10**9)
    for s in range(1, 11):
        j.append(_ev(s))
    j.mark_sent(6)
    assert j.ack(9) == 6  # only what was written can be acknowledged
    assert [e["server_event_seq"] for e in j.since(6)] == [7, 8, 9, 10]
    assert j.ack("7") == 0 and j.ack(True) == 0  # not an integer: ignored
    with pytest.raises(JournalOverflow):
        j.since(5)


def test_journal_keeps_sent_events_for_keep_sent_s_only():
    j = ReplayJournal(100, 10**9, keep_sent_s=10.0)
    for s in range(1, 6):
        j.append(_ev(s), now=100.0 + s)  # appended at t = 101..105
    j.mark_sent(3)
    j.append(_ev(6), now=112.5)  # 11.5 s after event 1, 10.5 after 2: both sent, both dropped
    assert [e["server_event_seq"] for e in j.since(2)] == [3, 4, 5, 6] and j.dropped_through == 2
    j.trim(now=200.0)  # long after: unsent events (4..6) stay, whatever their age
    assert [e["server_event_seq"] for e in j.since(3)] == [4, 5, 6]
