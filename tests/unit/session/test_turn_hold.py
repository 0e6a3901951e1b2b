"""Turn confirmation: a server-VAD answer is not heard before the VAD has confirmed the
turn ended, so a false end of turn ("My name is John" [pause] "Doe") is withheld, not played.

The sans-I/O Session with a simulated clock (``Driver.t``, ms) and real speech (espeak-ng
fixtures name_john_16k.wav, name_doe_16k.wav, question_16k.wav) streamed in 20 ms appends as a
microphone would. The engine is emulated in units and answers at once: the forced unit of a
response speaks (decision, text, the first 20 160 samples of audio) in the same step the unit
arrives, faster than any real engine, so a hold that waited on nothing would show.
What the client gets is read from the server events.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from duplexkit.audio import StreamingVAD, VadConfig
from duplexkit.engine.api import AppendUnit, AudioChunk, Decision, TextDelta, TurnEnd, UnitTimings
from duplexkit.session.responses import TURN_HOLD_STALL_MS

from _driver import Driver, fixture_audio, pcm16_b64

SR = 16000
CHUNK_MS = 20
TD = {"type": "server_vad", "create_response": True, "interrupt_response": True, "silence_duration_ms": 500}


def speech(name: str) -> np.ndarray:
    """A fixture cut to its speech (10 ms blocks with RMS > 300/32768, fixtures/audio/README.md)."""
    x = fixture_audio(name)
    nb = x.size // 160
    rms = np.sqrt(np.mean(np.square(x[: nb * 160].reshape(nb, 160)), axis=1))
    on = np.flatnonzero(rms > 300 / 32768)
    return x[on[0] * 160 : (on[-1] + 1) * 160]


def silence(ms: int) -> np.ndarray:
    return np.zeros(ms * SR // 1000, np.float32)


class Conversation:
    """A Session fed in real time, with an engine emulated in units: a response's forced unit
    speaks at once (decision, text, 20 160 samples), the next unit of its epoch speaks 24 000 more
    and ends the turn (final flush, ``TurnEnd``); every other unit listens."""

    def __init__(self) -> None:
        self.d = Driver()
        self.d.send({"type": "session.update", "session": {"turn_detection": TD}})
        self.stop_ms: list[int] = []  # clock when each speech_stopped was emitted
        self._speaking: dict[int, int] = {}  # epoch -> units spoken in its turn

    def _engine(self, new: list) -> None:
        sid = self.d.sid
        for c in [o for o in new if isinstance(o, AppendUnit)]:
            e, u = c.epoch, c.unit_index
            if e != self.d.s.epoch:
                continue  # cancelled before it was decided
            if c.force_speak:
                self._speaking[e] = 1
                self.d.engine(Decision(sid, e, u, decision="speak", turn_start=True))
                self.d.engine(TextDelta(sid, e, u, text="Nice to ", n_tokens=2))
                self.d.engine(AudioChunk(sid, e, u, audio=np.full(20160, 0.1, np.float32), text="Nice to "))
                self.d.engine(UnitTimings(sid, e, u, timings={"total_ms": 1.0}))
            elif self._speaking.get(e) == 1:
                self._speaking[e] = 2
                self.d.engine(Decision(sid, e, u, decision="speak"))
                self.d.engine(TextDelta(sid, e, u, text="meet you.", n_tokens=3))
                self.d.engine(AudioChunk(sid, e, u, audio=np.full(24000, 0.1, np.float32), text="meet you."))
                self.d.engine(AudioChunk(sid, e, u, audio=np.full(3840, 0.1, np.float32), final=True))
                self.d.engine(TurnEnd(sid, e, u))
            else:
                self.d.engine(Decision(sid, e, u, decision="listen"))

    def stream(self, x: np.ndarray, chunk_ms: int = CHUNK_MS) -> None:
        n = SR * chunk_ms // 1000
        for i in range(0, x.size, n):
            new = self.d.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i:i + n])})
            if any(isinstance(o, dict) and o["type"] == "input_audio_buffer.speech_stopped" for o in new):
                self.stop_ms.append(self.d.t)
            self._engine(new)
            self.d.t += chunk_ms
            self._engine(self.d.tick(0))

    def idle(self, ms: int) -> None:
        for _ in range(ms // CHUNK_MS):
            self.d.t += CHUNK_MS
            self._engine(self.d.tick(0))

    # what the client got ---------------------------------------------------------------------
    def responses(self) -> list[dict]:
        """Per response, in order: trigger, status, reason, and the audio and transcript deltas sent."""
        out: dict[str, dict] = {}
        for ev in self.d.events:
            t = ev["type"]
            if t == "response.created":
                r = ev["response"]
                out[r["id"]] = {"trigger": (r.get("metadata") or {}).get("trigger") or r.get("trigger"),
                                "audio": 0, "transcript": 0, "status": None, "reason": None}
            elif t == "response.output_audio.delta":
                out[ev["response_id"]]["audio"] += 1
            elif t == "response.output_audio_transcript.delta":
                out[ev["response_id"]]["transcript"] += 1
            elif t == "response.done":
                r = ev["response"]
                out[r["id"]]["status"] = r["status"]
                out[r["id"]]["reason"] = (r.get("status_details") or {}).get("reason")
        return list(out.values())


def stop_decided_ms(x: np.ndarray) -> int:
    """Where (ms into ``x``) the default server VAD decides a speech stop (its ``decided_sample``)."""
    v = StreamingVAD(VadConfig(silence_duration_ms=TD["silence_duration_ms"]))
    stops = [e.decided_sample for e in v.process(x) if e.kind == "speech_stopped"]
    assert stops, "no stop"
    return stops[0] * 1000 // SR


@pytest.fixture(scope="module")
def john():
    return np.concatenate([silence(300), speech("name_john_16k.wav")])


@pytest.fixture(scope="module")
def doe():
    return speech("name_doe_16k.wav")


def test_a_300_ms_pause_is_inside_the_turn(john, doe):
    c = Conversation()
    c.stream(np.concatenate([john, silence(300), doe, silence(2500)]))
    rs = c.responses()
    assert len(rs) == 1 and rs[0]["status"] == "completed" and rs[0]["audio"] > 0  # answered once, after "Doe"
    assert len(c.stop_ms) == 1


@pytest.mark.parametrize("resume_ms", [0, 40, 80])
def test_a_false_end_of_turn_is_withheld(john, doe, resume_ms):
    """ "Doe" starts ``resume_ms`` after the VAD decided that "My name is John" ended (the pause is
    500-600 ms: longer than silence_duration_ms). The response that decision created is cancelled
    by the resumed speech (turn_detected) before any of its audio or transcript was sent; the turn
    goes on and "Doe" is answered."""
    decided = stop_decided_ms(np.concatenate([john, silence(1000)]))
    pause_ms = decided - john.size * 1000 // SR + resume_ms
    c = Conversation()
    c.stream(np.concatenate([john, silence(pause_ms), doe, silence(2500)]))
    rs = c.responses()
    assert len(rs) == 2, rs
    false, real = rs
    assert (false["status"], false["reason"]) == ("cancelled", "turn_detected"), false
    assert false["audio"] == 0 and false["transcript"] == 0, f"the false start was sent: {false}"
    assert real["status"] == "completed" and real["audio"] > 0
    assert c.d.types().count("input_audio_buffer.speech_started") == 2


@pytest.mark.parametrize("chunk_ms", [250, 60_000])
def test_a_false_end_of_turn_sent_faster_than_real_time_is_withheld(john, doe, chunk_ms):
    """The same turn in 250 ms appends, or as one append of the whole file: the VAD's events are
    applied in stream order (stop, commit, response, then the resumed start cancels it), never
    two starts before a stop."""
    decided = stop_decided_ms(np.concatenate([john, silence(1000)]))
    c = Conversation()
    c.stream(np.concatenate([john, silence(decided - john.size * 1000 // SR + 40), doe, silence(2500)]), chunk_ms)
    c.idle(3000)
    vad = [t.rsplit(".", 1)[-1] for t in c.d.types() if t.startswith("input_audio_buffer.")]
    assert vad == ["speech_started", "speech_stopped", "committed"] * 2, vad
    false, real = c.responses()
    assert (false["status"], false["reason"], false["audio"]) == ("cancelled", "turn_detected", 0), false
    assert real["status"] == "completed" and real["audio"] > 0


def test_an_ordinary_end_of_turn_answers_after_the_confirmation_window():
    """The answer's first audio goes out once the VAD has looked 100 ms (start_confirm_ms) past its
    decision: within one 20 ms append of that, although the engine answered at once."""
    c = Conversation()
    q = np.concatenate([silence(300), speech("question_16k.wav")])
    n = SR * CHUNK_MS // 1000
    x = np.concatenate([q, silence(2500)])
    first_audio = None
    for i in range(0, x.size, n):
        c.stream(x[i:i + n])
        if first_audio is None and "response.output_audio.delta" in c.d.types():
            first_audio = c.d.t  # the clock after the append that released it
    decided = stop_decided_ms(x)
    rs = c.responses()
    assert len(rs) == 1 and rs[0]["status"] == "completed" and rs[0]["audio"] > 0
    # clock after append k = (k + 1) * 20 ms of audio: released by the append covering decided + 100 ms
    assert decided + 100 <= first_audio <= decided + 100 + 2 * CHUNK_MS, (decided, first_audio)


def test_the_latency_trace_stamps_first_audio_at_the_release(caplog):
    """The latency trace (``duplexkit.latency`` at DEBUG) of a held answer: ``first_audio_ms`` is
    when the first audio delta went out (the hold's release), ``engine_audio_ms`` when the engine's
    audio arrived (at once here, so 100 ms of confirmation earlier)."""
    caplog.set_level(logging.DEBUG, logger="duplexkit.latency")
    c = Conversation()
    x = np.concatenate([silence(300), speech("question_16k.wav"), silence(2500)])
    n = SR * CHUNK_MS // 1000
    sent_ms = None
    for i in range(0, x.size, n):
        t0 = c.d.t  # the Session's clock while this append is applied
        c.stream(x[i:i + n])
        if sent_ms is None and "response.output_audio.delta" in c.d.types():
            sent_ms = t0
    recs = [json.loads(r.getMessage()) for r in caplog.records if r.name == "duplexkit.latency"]
    assert len(recs) == 1 and recs[0]["trigger"] == "server_vad", recs
    tr = recs[0]
    assert tr["first_audio_ms"] == sent_ms, tr
    assert tr["first_audio_ms"] - tr["engine_audio_ms"] >= 100 - 2 * CHUNK_MS, tr  # held for the confirmation
    assert tr["request_ms"] <= tr["engine_audio_ms"], tr


def test_a_client_that_stops_streaming_still_gets_its_answer(john):
    """No input after the stop: the hold ends after TURN_HOLD_STALL_MS of input silence (ticks)."""
    decided = stop_decided_ms(np.concatenate([john, silence(1000)]))
    c = Conversation()
    c.stream(np.concatenate([john, silence(decided - john.size * 1000 // SR + CHUNK_MS)]))
    assert c.stop_ms and "response.output_audio.delta" not in c.d.types()
    last_append = c.d.t - CHUNK_MS
    c.idle(TURN_HOLD_STALL_MS - 2 * CHUNK_MS)
    assert "response.output_audio.delta" not in c.d.types()
    c.idle(2 * CHUNK_MS)
    assert "response.output_audio.delta" in c.d.types() and c.d.t - last_append <= TURN_HOLD_STALL_MS + CHUNK_MS
    c.idle(2000)  # the rest of the answer rides the silence units the Session feeds itself
    assert c.responses()[0]["status"] == "completed"


def test_a_pause_past_the_window_ends_the_turn_and_the_resumed_speech_barges_in(john, doe):
    """700 ms of silence between "John" and "Doe": "Doe" starts ~190 ms after the VAD decided the
    turn ended, past the 100 ms window, so the answer is released (the turn ended by the
    configured silence_duration_ms) and "Doe" barges in: the answer is cancelled (turn_detected),
    the client flushes what it had, and "Doe" is answered."""
    c = Conversation()
    c.stream(np.concatenate([john, silence(700), doe, silence(2500)]))
    rs = c.responses()
    assert len(rs) == 2, rs
    assert (rs[0]["status"], rs[0]["reason"]) == ("cancelled", "turn_detected") and rs[0]["audio"] > 0
    assert rs[1]["status"] == "completed" and rs[1]["audio"] > 0
