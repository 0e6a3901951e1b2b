"""Declared input formats the Session must never misread (docs/protocol.md §6.1; the server's half).

* Channels: interleaved stereo (real speech: question_16k.wav left, interrupt_16k.wav right) declared
  with ``channels: 2`` reaches the engine as the mono downmix ``(L + R) / 2`` with the right duration,
  whatever the append sizes; a channel count outside 1..8 is ``unsupported_audio_format``.
* Arrival rate: 16 kHz speech declared as 24 kHz and sent in real time gets exactly one
  ``error{input_rate_mismatch}``; correct rates, jittery real time, faster-than-real-time streaming
  and a client that pauses between utterances get none.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import soxr

from _driver import Driver, fixture_audio
from duplexkit.audio.arrival import ArrivalRateMonitor
from duplexkit.audio.resample import StreamResampler
from duplexkit.engine.api import AppendUnit, Decision


def _int16(x: np.ndarray) -> np.ndarray:
    return np.round(np.clip(x, -1, 1) * 32767).astype("<i2")


def _stereo_speech() -> tuple[np.ndarray, np.ndarray]:
    """(L, R) int16 at 16 kHz: two different real utterances, the shorter one zero-padded."""
    a, b = fixture_audio("question_16k.wav"), fixture_audio("interrupt_16k.wav")
    n = max(len(a), len(b))
    a, b = np.pad(a, (0, n - len(a))), np.pad(b, (0, n - len(b)))
    return _int16(a), _int16(b)


def _interleave(*chans: np.ndarray) -> bytes:
    return np.stack(chans, axis=1).astype("<i2").tobytes()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _engine_audio(d: Driver) -> np.ndarray:
    return np.concatenate([c.audio for c in d.cmds if isinstance(c, AppendUnit)])


def _manual(d: Driver, fmt_update: dict) -> None:
    new = d.send({"type": "session.update", "session": {"turn_detection": None, **fmt_update}})
    assert [e["type"] for e in new if isinstance(e, dict)] == ["session.updated"], new


# ------------------------------------------------------------------------------------------ channels

STEREO_16K = [
    {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000, "channels": 2}}}},  # GA object
    {"input_audio_format": "pcm16", "sample_rate_hz": 16000, "channels": 2},  # beta, flat
    {"input_audio_format": "pcm16", "sample_rate_hz": 16000, "input_audio_channels": 2},
]


@pytest.mark.parametrize("update", STEREO_16K, ids=["ga", "beta_channels", "beta_input_audio_channels"])
@pytest.mark.parametrize("append_bytes", [6400, 3201, 777])  # 100 ms; odd; not a multiple of a frame
def test_stereo_speech_reaches_the_engine_as_the_mono_downmix(update, append_bytes):
    left, right = _stereo_speech()
    raw = _interleave(left, right)
    d = Driver()
    _manual(d, update)
    s = d.events[-1]["session"]
    assert s["audio"]["input"]["format"]["channels"] == 2 and s["channels"] == 2
    for i in range(0, len(raw), append_bytes):
        new = d.send({"type": "input_audio_buffer.append", "audio": _b64(raw[i:i + append_bytes])})
        assert not d.of("error", new), d.of("error", new)
    d.send({"type": "input_audio_buffer.commit"})
    d.tick(50)  # the commit's unit goes out after COMMIT_MERGE_MS
    got = _engine_audio(d)
    want = (left.astype(np.float32) + right.astype(np.float32)) / 2 / 32768
    n = len(left)
    assert n <= len(got) < n + 16000 + 1600  # n frames (the last unit zero-padded), not 2n samples
    np.testing.assert_array_equal(got[:n], want.astype(np.float32))
    assert not got[n:].any()
    # reading the same bytes as mono would have been something else entirely
    as_mono = np.frombuffer(raw, "<i2").astype(np.float32)[:n] / 32768
    assert np.abs(as_mono - want).max() > 0.1


def test_stereo_48k_is_downmixed_then_resampled():
    left, right = _stereo_speech()
    l48, r48 = (_int16(soxr.resample(c.astype(np.float32) / 32768, 16000, 48000)) for c in (left, right))
    raw = _interleave(l48, r48)
    d = Driver()
    _manual(d, {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 48000, "channels": 2}}}})
    step = 48000 * 2 * 2 // 10  # 100 ms of 48 kHz stereo pcm16
    for i in range(0, len(raw), step):
        d.send({"type": "input_audio_buffer.append", "audio": _b64(raw[i:i + step])})
    d.send({"type": "input_audio_buffer.commit"})
    d.tick(50)  # the commit's unit goes out after COMMIT_MERGE_MS
    got = _engine_audio(d)
    mono48 = (l48.astype(np.float32) + r48.astype(np.float32)) / 2 / 32768
    rs = StreamResampler(48000, 16000)
    want = np.concatenate([rs.process(mono48), rs.flush()])
    assert len(want) == len(left)
    np.testing.assert_allclose(got[:len(want)], want, atol=1e-5)
    # and it is the original speech (downmix of the two utterances), within resampling error
    ref = (left.astype(np.float32) + right.astype(np.float32)) / 2 / 32768
    err = got[:len(ref)] - ref
    snr = 10 * np.log10(np.sum(ref ** 2) / np.sum(err ** 2))
    assert snr > 30, snr


def test_stereo_input_audio_item_is_downmixed():
    left, right = _stereo_speech()
    d = Driver()
    _manual(d, {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000, "channels": 2}}}})
    raw = _interleave(left, right)
    new = d.send({"type": "conversation.item.create",
                  "item": {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": _b64(raw)}]}})
    assert not d.of("error", new)
    got = _engine_audio(d)
    want = (left.astype(np.float32) + right.astype(np.float32)) / 2 / 32768
    np.testing.assert_array_equal(got[:len(left)], want)


@pytest.mark.parametrize("update, param", [
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000, "channels": 9}}}}, "audio.input.format"),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000, "channels": 0}}}}, "audio.input.format"),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000, "channels": 1.5}}}}, "audio.input.format"),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000, "channels": True}}}}, "audio.input.format"),
    ({"channels": 12}, "channels"),
    ({"input_audio_format": "pcm16", "channels": -1}, "input_audio_format"),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "channels": 2}}}, "channels": 1}, "audio.input.format"),
])
def test_unsupported_channel_counts_are_refused(update, param):
    d = Driver()
    before = d.s.settings.input_format
    new = d.send({"type": "session.update", "session": update})
    err = d.of("error", new)[0]["error"]
    assert err["code"] == "unsupported_audio_format" and err["param"] == "session." + param, err
    assert "channel" in err["message"]
    assert d.s.settings.input_format == before  # nothing changed


def test_channels_alone_keep_encoding_and_rate_and_mono_is_the_default():
    d = Driver()
    d.send({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 48000}}}}})
    d.send({"type": "session.update", "session": {"channels": 2}})
    f = d.s.settings.input_format
    assert (f.encoding, f.rate, f.channels) == ("pcm16", 48000, 2)
    # a full format declaration without channels is mono again, and mono is not echoed
    new = d.send({"type": "session.update", "session": {"input_audio_format": "pcm16", "sample_rate_hz": 16000}})
    s = d.of("session.updated", new)[0]["session"]
    assert d.s.settings.input_format.channels == 1 and "channels" not in s and "channels" not in s["audio"]["input"]["format"]
    # a non-integer flat channel count is a bad_event (strict integer)
    assert d.of("error", d.send({"type": "session.update", "session": {"channels": "2"}}))[0]["error"]["code"] == "bad_event"


@pytest.mark.parametrize("fmt", [
    {"type": "audio/pcm", "rate": 16000, "channels": 2},
    {"type": "audio/pcm", "rate": 24000},
    {"type": "audio/pcm_f32le", "rate": 44100},
    {"type": "audio/pcmu"},
])
def test_the_echoed_format_object_round_trips(fmt):
    # a client may send the server's own echo back (docs/protocol.md §4.1): the keys the server writes
    # (sample_rate_hz, encoding, channels) are read back as the same format, never as 24 kHz pcm16 mono
    d = Driver()
    d.send({"type": "session.update", "session": {"audio": {"input": {"format": fmt}}}})
    f1 = d.s.settings.input_format
    echo = d.of("session.updated")[-1]["session"]["audio"]["input"]["format"]
    d.send({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 8000}}}}})
    new = d.send({"type": "session.update", "session": {"audio": {"input": {"format": echo}}}})
    assert not d.of("error", new), new
    assert d.s.settings.input_format == f1, (echo, d.s.settings.input_format, f1)


def test_conflicting_rates_in_a_format_object_are_refused():
    d = Driver()
    new = d.send({"type": "session.update",
                  "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000, "sample_rate_hz": 16000}}}}})
    assert d.of("error", new)[0]["error"]["code"] == "unsupported_audio_format"


# ------------------------------------------------------------------------------------------ arrival rate


def _stream(d: Driver, x: np.ndarray, rate: int, chunk_ms: int, wall_ms_per_chunk) -> list:
    """Append ``x`` (float, at ``rate``) as pcm16 in ``chunk_ms`` chunks; the clock advances by
    ``wall_ms_per_chunk(k)`` after chunk k. Each unit is answered with a listen decision at once (an
    engine keeping up), so faster-than-real-time input is not held back by input_backpressure."""
    n = rate * chunk_ms // 1000
    new = []
    for k, i in enumerate(range(0, len(x), n)):
        out = d.send({"type": "input_audio_buffer.append", "audio": _b64(_int16(x[i:i + n]).tobytes())})
        for c in [o for o in out if isinstance(o, AppendUnit)]:
            out += d.engine(Decision(d.sid, d.s.epoch, c.unit_index, decision="listen"))
        new += out
        d.t += wall_ms_per_chunk(k)
    return new


def _speech(seconds: float, rate: int = 16000) -> np.ndarray:
    """Real speech looped to ``seconds``, at ``rate``."""
    x = np.concatenate([fixture_audio("long_question_16k.wav")] * 4)[: int(16000 * seconds)]
    return x if rate == 16000 else soxr.resample(x, 16000, rate).astype(np.float32)


def test_16k_sent_as_24k_in_real_time_gets_exactly_one_warning():
    d = Driver(profile="compat")  # declares 24 kHz pcm16 (OpenAI's default)
    x = _speech(12.0)  # 16 kHz speech, sent as 100 ms = 1600-sample appends every 100 ms of wall time
    new = _stream(d, x, 16000, 100, lambda k: 100)
    errs = d.of("error", new)
    assert len(errs) == 1, errs
    e = errs[0]["error"]
    assert e["code"] == "input_rate_mismatch" and e["type"] == "invalid_request_error"
    assert "0.69x" in e["message"] and "16000 Hz" in e["message"] and "24000 Hz" in e["message"]
    # it answers the append that completed the first 3 s window (append 31 at t = 3000 ms), and
    # the audio was still used: all 12 s reached the engine (as 8 s of "24 kHz" audio)
    assert e["event_id"] == "c31"
    assert sum(c.audio.shape[0] for c in d.cmds if isinstance(c, AppendUnit)) >= 8 * 16000 - 16000
    assert not d.s.closed


@pytest.mark.parametrize("declared, actual", [(16000, 8000), (48000, 16000), (24000, 16000)])
def test_slow_arrival_is_flagged_for_common_misdeclarations(declared, actual):
    d = Driver()
    d.send({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": declared}}}}})
    new = _stream(d, _speech(6.0, actual), actual, 100, lambda k: 100)
    errs = [e["error"] for e in d.of("error", new)]
    assert [e["code"] for e in errs] == ["input_rate_mismatch"]
    assert f"looks like {actual} Hz" in errs[0]["message"]


@pytest.mark.parametrize("name, rate, chunk_ms, wall", [
    ("16k real time", 16000, 100, lambda k: 100),
    ("24k real time, 20 ms appends", 24000, 20, lambda k: 20),
    ("48k real time", 48000, 200, lambda k: 200),
    ("jitter: bursts of 3 after 300 ms", 16000, 100, lambda k: 300 if k % 3 == 2 else 0),
    ("jitter: +-40 ms", 16000, 100, lambda k: 100 + (40 if k % 2 else -40)),
    ("2x real time (file streaming)", 24000, 100, lambda k: 50),
    ("10x real time", 16000, 100, lambda k: 10),
    ("client VAD: 2 s of speech, 1.5 s pause", 16000, 100, lambda k: 1600 if k % 20 == 19 else 100),
])
def test_no_warning_for_correct_or_fast_streams(name, rate, chunk_ms, wall):
    d = Driver()
    d.send({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": rate}}}}})
    new = _stream(d, _speech(14.0, rate), rate, chunk_ms, wall)
    assert not d.of("error", new), (name, d.of("error", new))
    assert d.t >= 1400  # the stream did span wall time


@pytest.mark.parametrize("idle_ms", [5000, 1000, 100])
def test_no_warning_for_a_whole_file_then_live_appends(idle_ms):
    # a client sends a 10 s recording at once, waits, then streams its microphone in real time
    d = Driver()
    new = _stream(d, _speech(10.0), 16000, 10_000, lambda k: idle_ms)
    new += _stream(d, _speech(8.0), 16000, 100, lambda k: 100)
    assert not d.of("error", new), d.of("error", new)


def test_the_warning_is_rearmed_by_a_new_declared_format():
    d = Driver()
    d.send({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}}})
    first = _stream(d, _speech(8.0), 16000, 100, lambda k: 100)
    assert [e["error"]["code"] for e in d.of("error", first)] == ["input_rate_mismatch"]
    # the client fixes its declaration: no more warnings
    d.send({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}})
    assert not d.of("error", _stream(d, _speech(8.0), 16000, 100, lambda k: 100))
    # a new wrong declaration is reported again (once)
    d.send({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 32000}}}}})
    third = _stream(d, _speech(8.0), 16000, 100, lambda k: 100)
    assert [e["error"]["code"] for e in d.of("error", third)] == ["input_rate_mismatch"]


def test_monitor_rule_directly():
    # 16 kHz as 24 kHz, 100 ms appends: judged first at 3 s of wall time, reported once
    mon = ArrivalRateMonitor(24000)
    got = [(k, mon.observe(1600, 100 * k)) for k in range(60)]
    hits = [(k, w) for k, w in got if w is not None]
    assert len(hits) == 1 and hits[0][0] == 30
    w = hits[0][1]
    # the run's lead when the window opened (its first append, 1600 frames) counts as delivered
    assert abs(w.ratio - (30 * 1600 + 1600) / 72000) < 1e-9 and w.likely_rate == 16000 and w.window_ms == 3000
    # a stall longer than 4 appends' duration starts a new run: the slow-looking window is never judged
    mon = ArrivalRateMonitor(16000)
    for k in range(20):
        assert mon.observe(1600, 100 * k + (800 if k >= 10 else 0) + (800 if k >= 15 else 0)) is None
    # a whole file at once (10 s), then live appends: after an idle gap (a new run) or a short one
    # (the file's lead covers the wall time that follows it) nothing is flagged
    for idle_ms in (5000, 1000, 300):
        mon = ArrivalRateMonitor(16000)
        assert mon.observe(160_000, 0) is None
        for k in range(60):
            assert mon.observe(1600, idle_ms + 100 * k) is None, (idle_ms, k)
    # ... but a misdeclared live stream after a short file is still flagged once the lead is spent
    mon = ArrivalRateMonitor(24000)
    hits = [k for k in range(120) if mon.observe(48_000 if k == 0 else 1600, 100 * k) is not None]
    assert len(hits) == 1
    with pytest.raises(ValueError):
        ArrivalRateMonitor(0)
