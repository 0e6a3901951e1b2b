"""Playback truth in both profiles, as (events in -> events out) tables (docs/protocol.md §7.4-§7.5).

The stored assistant item must end up covering exactly what the client reports it heard:

* an answer of 10 s is sent faster than real time, the client stops playing it at 2 s (a
  ``response.cancel``, a cancelling ``output_audio_buffer.clear`` or a server-VAD barge-in on real
  speech), then reports ``playback.ack{played_ms:2000, truncate:true}`` or
  ``conversation.item.truncate{audio_end_ms:2000}``: the item covers 2000 ms and its history
  transcript is the mark-cut prefix of what was sent, in the duplex profile (``ack_only``) AND in
  the compat profile (``commit_on_done``, where ``response.done`` first committed all 10 s);
* a fully heard answer acknowledged at its full length covers all of it;
* acks after finalisation change nothing; a plain ack (no ``truncate``) never lowers the cursor.

The step vocabulary and the runner are those of ``test_session_scenarios.py``.
"""

from __future__ import annotations

from typing import Callable

import pytest

from _driver import Driver
from test_session_scenarios import CANCEL_CLOSE, Step, assistant_item, client, resp_id, run, speech

N_UNITS = 10
"""Length of the scripted answer: 10 units of 24 000 samples at 24 kHz = 10 000 ms."""
WORDS = [f"w{i} " for i in range(N_UNITS)]  # one word per 1000 ms of audio
SENT_MS = N_UNITS * 1000
HEARD_MS = 2000

FORMAT_16K = {"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}


def _open(profile: str, n: int) -> list[str]:
    head = ["conversation.item.added", "response.output_item.added", "response.content_part.added"]
    if profile == "duplex":
        head.append("response.speak")
    return head + ["response.output_audio.delta", "response.output_audio_transcript.delta"] * n


def speak_answer(profile: str, end: bool) -> Step:
    """The scripted engine sends the whole 10 s answer at once (faster than real time)."""
    out = _open(profile, N_UNITS)
    if end:
        out += [*CANCEL_CLOSE, "response.done:completed"]
    return Step(lambda d: d.speak(WORDS, end=end, chunk=24000), out, [], None, f"engine speaks {SENT_MS} ms")


def playback_is(committed: int, final: bool, transcript: str) -> Callable[[Driver, list], None]:
    """The item's (sent, committed, final) and its transcript in history() and in retrieve."""
    def check(d: Driver, new: list) -> None:
        iid = assistant_item(-1)(d)
        assert d.s.item_playback(iid) == (SENT_MS, committed, final)
        h = [it for it in d.s.history() if it["id"] == iid][0]
        assert h["content"][0]["transcript"] == transcript
        got = d.s.conv.find(iid)
        assert "".join(WORDS).startswith(transcript)  # a prefix of what was sent
        # the cut is at the last mark <= committed_ms (one word per 1000 ms here)
        assert transcript == "".join(WORDS[: committed // 1000]), (transcript, committed)
        assert got.text == "".join(WORDS)  # the sent transcript itself is untouched
        ev = d.send({"type": "conversation.item.retrieve", "item_id": iid})
        assert ev[0]["type"] == "conversation.item.retrieved" and ev[0]["item"]["content"][0]["transcript"] == transcript
    return check


def done_committed(ms: int) -> Callable[[Driver, list], None]:
    def check(d: Driver, new: list) -> None:
        done = [o for o in new if isinstance(o, dict) and o["type"] == "response.done"][0]["response"]
        assert done["audio_duration_ms"] == SENT_MS and done["committed_ms"] == ms, done
    return check


# the three server-side ends of a response that was not fully heard
CANCELS = {
    "response.cancel": lambda committed: client(
        {"type": "response.cancel"}, out=[*CANCEL_CLOSE, "response.done:cancelled/client_cancelled"],
        cmds=["CancelEpoch"], check=done_committed(committed)),
    "output_audio_buffer.clear": lambda committed: client(
        {"type": "output_audio_buffer.clear"},
        out=["output_audio_buffer.cleared", *CANCEL_CLOSE, "response.done:cancelled/client_cancelled"],
        cmds=["CancelEpoch"], check=done_committed(committed)),
    "server_vad": lambda committed: speech(
        "interrupt_16k.wav", 0, 1500,
        out=["input_audio_buffer.speech_started", *CANCEL_CLOSE, "response.done:cancelled/turn_detected"],
        cmds=["CancelEpoch"], check=done_committed(committed)),
}

# the two ways a client reports what it heard, finally
REPORTS = {
    "playback.ack": lambda ms: client(
        {"type": "playback.ack", "response_id": resp_id(-1), "item_id": assistant_item(-1), "played_ms": ms,
         "truncate": True}, out=[]),
    "conversation.item.truncate": lambda ms: client(
        {"type": "conversation.item.truncate", "item_id": assistant_item(-1), "content_index": 0, "audio_end_ms": ms},
        out=["conversation.item.truncated"],
        check=lambda d, new: (new[0]["audio_end_ms"] == ms) or pytest.fail(f"truncated echoes {new[0]}")),
}


def interrupted(profile: str, cancel: str, report: str) -> list[Step]:
    on_done = SENT_MS if profile == "compat" else 0  # commit_on_done vs ack_only
    return [
        client(FORMAT_16K, out=["session.updated"]),
        client({"type": "response.create"}, out=["response.created"], cmds=["AppendUnit(force_speak)"]),
        speak_answer(profile, end=False),
        CANCELS[cancel](on_done),
        Step(lambda d: [], [], check=playback_is(on_done, False, "".join(WORDS[: on_done // 1000])),
             label="before the report"),
        REPORTS[report](HEARD_MS),
        Step(lambda d: [], [], check=playback_is(HEARD_MS, True, "w0 w1 "), label="after the report"),
        # finalised: later acks, plain or truncating, higher or lower, change nothing
        client({"type": "playback.ack", "response_id": resp_id(-1), "played_ms": SENT_MS}, out=[],
               check=playback_is(HEARD_MS, True, "w0 w1 ")),
        client({"type": "playback.ack", "response_id": resp_id(-1), "played_ms": 500, "truncate": True}, out=[],
               check=playback_is(HEARD_MS, True, "w0 w1 ")),
    ]


@pytest.mark.parametrize("report", list(REPORTS))
@pytest.mark.parametrize("cancel", list(CANCELS))
@pytest.mark.parametrize("profile", ["duplex", "compat"])
def test_interrupted_answer_history_covers_what_was_heard(profile, cancel, report):
    run(interrupted(profile, cancel, report), profile=profile)


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("profile", ["duplex", "compat"])
def test_fully_heard_answer_covers_all_of_it(profile, truncate):
    on_done = SENT_MS if profile == "compat" else 0
    run([
        client(FORMAT_16K, out=["session.updated"]),
        client({"type": "response.create"}, out=["response.created"], cmds=["AppendUnit(force_speak)"]),
        speak_answer(profile, end=True),
        Step(lambda d: [], [], check=playback_is(on_done, False, "".join(WORDS[: on_done // 1000])),
             label="at response.done"),
        # the player drained: the client reports the whole answer heard (played_ms may overshoot
        # sent_ms by a rounding ms: it is clamped)
        client({"type": "playback.ack", "response_id": resp_id(-1), "played_ms": SENT_MS + 1, "truncate": truncate},
               out=[], check=playback_is(SENT_MS, truncate, "".join(WORDS))),
    ], profile=profile)


@pytest.mark.parametrize("profile", ["duplex", "compat"])
def test_plain_ack_only_raises(profile):
    on_done = SENT_MS if profile == "compat" else 0
    run([
        client(FORMAT_16K, out=["session.updated"]),
        client({"type": "response.create"}, out=["response.created"], cmds=["AppendUnit(force_speak)"]),
        speak_answer(profile, end=False),
        client({"type": "playback.ack", "response_id": resp_id(-1), "played_ms": 3000}, out=[],
               check=playback_is(3000, False, "w0 w1 w2 ")),
        client({"type": "response.cancel"}, out=[*CANCEL_CLOSE, "response.done:cancelled/client_cancelled"],
               cmds=["CancelEpoch"], check=done_committed(max(on_done, 3000))),
        # lower plain acks never lower the cursor (compat: response.done committed all 10 s)
        client({"type": "playback.ack", "response_id": resp_id(-1), "played_ms": 2000}, out=[],
               check=playback_is(max(on_done, 3000), False, "".join(WORDS[: max(on_done, 3000) // 1000]))),
        # a truncating one does, once
        client({"type": "playback.ack", "response_id": resp_id(-1), "played_ms": 2000, "truncate": True}, out=[],
               check=playback_is(2000, True, "w0 w1 ")),
        # conversation.item.truncate may still move a finalised cursor (§7.5: "even below an earlier ack")
        client({"type": "conversation.item.truncate", "item_id": assistant_item(-1), "content_index": 0,
                "audio_end_ms": 1000}, out=["conversation.item.truncated"], check=playback_is(1000, True, "w0 ")),
    ], profile=profile)


def test_the_tables_can_fail():
    # a wrong expected cursor fails the check (the tables are not vacuous)
    with pytest.raises(AssertionError):
        steps = interrupted("compat", "response.cancel", "playback.ack")
        steps[6] = Step(lambda d: [], [], check=playback_is(SENT_MS, False, "".join(WORDS)), label="wrong")
        run(steps, profile="compat")
