"""Early unit close and the barge-in epoch fence (docs/protocol.md §3), on the sans-I/O
Session with a simulated clock (``Driver.t``, ms) and real speech from tests/fixtures/audio.

What the model hears is reconstructed from the ``AppendUnit`` commands: their audio, epoch and
force flags, in order."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from duplexkit.engine.api import AppendUnit, Decision, TextDelta

from _driver import Driver, fixture_audio

SR = 16000


def units(cmds) -> list[AppendUnit]:
    return [c for c in cmds if isinstance(c, AppendUnit)]


def heard(cmds) -> np.ndarray:
    """Everything the model was given, in order (unit 0's 80 re-read samples included)."""
    us = units(cmds)
    return np.concatenate([u.audio for u in us]) if us else np.zeros(0, np.float32)


def q16(x: np.ndarray) -> np.ndarray:
    """Audio exactly representable in pcm16 (k / 32768), so the wire round trip is lossless."""
    return (np.clip(np.round(x * 32768), -32768, 32767) / 32768).astype(np.float32)


def append(d: Driver, x: np.ndarray, chunk_ms: int = 100) -> list:
    """Append ``x`` (from :func:`q16`) in ``chunk_ms`` chunks, losslessly, advancing the clock."""
    n = SR * chunk_ms // 1000
    new = []
    for i in range(0, x.size, n):
        pcm = np.round(x[i:i + n] * 32768).astype("<i2").tobytes()
        new += d.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
        d.t += chunk_ms
    return new


# ------------------------------------------------------------------------------- deliverable A


def test_response_create_runs_the_forced_unit_at_once_on_buffered_audio():
    speech = q16(fixture_audio("question_16k.wav"))
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    x = speech[: 2 * SR + 4240 + 560]  # units 0 and 1 (32 560 samples) + 4 240 buffered
    append(d, x)
    before = units(d.cmds)
    assert [u.unit_index for u in before] == [0, 1]
    new = d.send({"type": "response.create"})
    forced = units(new)
    assert len(forced) == 1, "the forced unit goes out in the same call as response.created"
    f = forced[0]
    assert f.unit_index == 2 and f.force_speak and not f.force_listen and not f.is_silence
    assert f.audio.shape == (16000,)
    np.testing.assert_array_equal(f.audio[:4240], x[32560:])  # the buffered audio, nothing lost
    assert not f.audio[4240:].any()  # then zero padding to the unit length
    assert d.s.input.debt.owed() == 16000 - 4240
    # the engine speaks in that unit: audio follows without one more sample of input
    out = d.engine(Decision(d.sid, 0, 2, decision="speak", turn_start=True))
    out += d.engine(TextDelta(d.sid, 0, 2, text="Hi.", n_tokens=2))
    assert "response.speak" in d.types(out)


def test_next_units_stay_aligned_padding_stands_in_for_the_silence_that_follows():
    """After the response ends, the first P samples of the following silence are not fed (the model
    heard P zeros in their place); everything after them, speech included, is fed unchanged."""
    speech = q16(fixture_audio("question_16k.wav"))
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    append(d, speech[: SR + 560 + 8000])  # unit 0 + 8 000 buffered
    d.send({"type": "response.create"})
    p = d.s.input.debt.owed()
    assert p == 8000
    d.speak(end=True)  # the answer ends: idle, the model listens
    n0 = len(units(d.cmds))
    rest = np.concatenate([np.zeros(int(1.5 * SR), np.float32), speech, np.zeros(SR, np.float32)])
    append(d, rest)
    fed = np.concatenate([u.audio for u in units(d.cmds)[n0:]])
    # silence[P:] + speech + ... : the real timeline is kept (no shift), no speech is lost
    np.testing.assert_array_equal(fed, rest[p: p + fed.size])
    assert fed.size >= rest.size - p - 16000
    assert d.s.input.debt.owed() == 0


def test_speech_inside_the_padding_forgives_the_rest_no_speech_is_dropped():
    speech = q16(fixture_audio("question_16k.wav"))
    loud = int(np.argmax(np.abs(speech) > 0.01))
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    append(d, speech[: SR + 560 + 2000])
    d.send({"type": "response.create"})
    d.speak(end=True)
    n0 = len(units(d.cmds))
    rest = np.concatenate([np.zeros(1600, np.float32), speech, np.zeros(SR, np.float32)])
    append(d, rest)
    fed = np.concatenate([u.audio for u in units(d.cmds)[n0:]])
    k = rest.size - fed.size - d.s.input._framer.pending_samples  # samples dropped
    assert 0 <= k
    # only silence before the speech's 300 ms pre-roll was dropped
    assert k <= max(0, 1600 + loud - 300 * 16)
    np.testing.assert_array_equal(fed, rest[k: k + fed.size])
    assert d.s.input.debt.owed() == 0


def test_commit_then_create_is_one_forced_unit():
    """commit + response.create back to back: the commit's partial unit IS the forced unit (one
    unit, not a padded listen unit and then an all-zero forced one)."""
    speech = q16(fixture_audio("question_16k.wav"))
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    x = speech[: SR + 560 + 3000]
    append(d, x)
    n0 = len(units(d.cmds))
    c = d.send({"type": "input_audio_buffer.commit"})
    assert "input_audio_buffer.committed" in d.types(c) and units(c) == []
    d.t += 5
    d.send({"type": "session.heartbeat"})  # acks/heartbeats keep the window open
    f = units(d.send({"type": "response.create"}))
    assert len(f) == 1 and f[0].force_speak and not f[0].is_silence and f[0].unit_index == 1
    np.testing.assert_array_equal(f[0].audio[:3000], x[SR + 560:])
    assert not f[0].audio[3000:].any()
    assert len(units(d.cmds)) == n0 + 1
    assert d.s.input.debt.owed() == 13000
    # nothing more goes out for that commit
    assert units(d.tick(100)) == []


def test_lone_commit_closes_its_unit_at_the_next_tick():
    speech = q16(fixture_audio("question_16k.wav"))
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    append(d, speech[: SR + 560 + 3000])
    assert units(d.send({"type": "input_audio_buffer.commit"})) == []
    assert units(d.tick(5)) == [], "held back for COMMIT_MERGE_MS"
    u = units(d.tick(50))
    assert len(u) == 1 and not u[0].force_speak and u[0].unit_index == 1
    assert u[0].audio[:3000].any() and not u[0].audio[3000:].any()
    assert d.s.input.debt.owed() == 13000


def test_commit_then_append_closes_the_unit_before_the_new_audio():
    """Any other client event sends the commit's unit first: the audio after the commit is never
    mixed into the committed unit."""
    speech = q16(fixture_audio("question_16k.wav"))
    d = Driver()
    d.send({"type": "session.update", "session": {"turn_detection": None}})
    x = speech[: SR + 560 + 3000]
    append(d, x)
    d.send({"type": "input_audio_buffer.commit"})
    new = append(d, speech[SR:SR + 1600])
    u = units(new)
    assert len(u) == 1 and u[0].unit_index == 1
    np.testing.assert_array_equal(u[0].audio[:3000], x[SR + 560:])
    assert not u[0].audio[3000:].any()
    # the committed unit is a listen unit; a create now forces a unit of its own
    f = units(d.send({"type": "response.create"}))
    assert len(f) == 1 and f[0].force_speak and f[0].unit_index == 2


# ------------------------------------------------------------------------------- deliverable B


def _vad_turn(early: bool | None, profile: str = "duplex"):
    speech = q16(fixture_audio("question_16k.wav"))
    d = Driver(profile=profile)
    sess: dict = {"turn_detection": {"type": "server_vad", "create_response": False}}
    if early is not None:
        sess["extra_body"] = {"early_unit_close": early}
    d.send({"type": "session.update", "session": sess})
    x = np.concatenate([speech, np.zeros(3 * SR, np.float32)])
    stop_call = None
    n = 1600
    for i in range(0, x.size, n):
        new = append(d, x[i:i + n])
        if "input_audio_buffer.speech_stopped" in d.types(new) and stop_call is None:
            stop_call = (i + n, new)
    return d, x, stop_call


def test_speech_stopped_closes_the_unit_early_when_on():
    d, x, (end, new) = _vad_turn(True)
    assert d.s._session_object().extra_body["early_unit_close"] is True
    closed = units(new)
    assert closed, "the unit is closed in the same call as speech_stopped"
    u = closed[-1]
    assert not u.force_speak and not u.is_silence
    all_units = units(d.cmds)
    n_before = sum(c.audio.shape[0] for c in all_units[: all_units.index(u) + 1])
    pad = n_before - end  # everything received up to speech_stopped went in, then zeros
    assert 0 < pad < u.audio.shape[0] and not u.audio[-pad:].any()
    stream = heard(d.cmds)
    np.testing.assert_array_equal(stream[:end], x[:end])
    # aligned: input resumes at end + pad (the padding stood in for the first pad samples of silence)
    later = stream[n_before:]
    assert later.size >= SR
    np.testing.assert_array_equal(later, x[end + pad: end + pad + later.size])
    assert d.s.input.debt.owed() == 0


def test_speech_stopped_does_not_close_early_when_off():
    d, x, (end, new) = _vad_turn(False)
    assert d.s._session_object().extra_body["early_unit_close"] is False
    assert all(u.audio[-160:].any() for u in units(new))  # no unit closed early (no trailing padding)
    # every unit is plain input: the model's stream is the input itself (unit 0 re-reads 80)
    stream = heard(d.cmds)
    np.testing.assert_array_equal(stream, x[: stream.size])  # the framer's slices are contiguous
    assert stream.size > x.size - 16000


def test_early_unit_close_defaults_per_profile_and_validation():
    assert Driver().s._session_object().extra_body["early_unit_close"] is True
    assert Driver(profile="compat").s._session_object().extra_body["early_unit_close"] is False
    d = Driver()
    new = d.send({"type": "session.update", "session": {"extra_body": {"early_unit_close": "yes"}}})
    assert d.types(new) == ["error"] and d.s.settings.early_unit_close is True


# ------------------------------------------------------------------------------- deliverable C


def _barge_in(chunk_ms: int, lead_samples: int, fence: bool = True):
    """A model response speaking at epoch 0; the client streams silence then the interrupting
    speech starting ``lead_samples`` after unit 0; returns (driver, input after unit 0, VAD start
    sample = onset minus pre-roll, in that input)."""
    speech = q16(fixture_audio("interrupt_16k.wav"))
    d = Driver()  # duplex, server_vad, interrupt_response true
    # no early close at the utterance's end: the units then carry the input contiguously
    d.send({"type": "session.update", "session": {"extra_body": {"early_unit_close": False}}})
    if not fence:
        d.s.input._holding_units = lambda: False  # type: ignore[method-assign]
    append(d, np.zeros(16560, np.float32))  # unit 0, then the model starts answering on its own
    d.speak(end=False)
    assert d.s.state == "speaking"
    x = np.concatenate([np.zeros(lead_samples, np.float32), speech, np.zeros(2 * SR, np.float32)])
    append(d, x, chunk_ms=chunk_ms)
    started = d.of("input_audio_buffer.speech_started")
    assert len(started) >= 1
    assert d.s.input.debt.owed() == 0  # no early close here: units after unit 0 carry x contiguously
    return d, x, started[0]["audio_start_ms"] * SR // 1000 - 16560


CHUNKS = [20, 100, 333, 1000]
LEADS = [SR + k for k in (0, 2000, 6000, 9000, 12000, 15000)]


@pytest.mark.parametrize("chunk_ms", CHUNKS)
@pytest.mark.parametrize("lead", LEADS)
def test_interrupting_speech_lands_in_the_new_epoch(chunk_ms, lead):
    d, x, start = _barge_in(chunk_ms, lead)
    assert d.s.epoch == 1
    us = units(d.cmds)[1:]
    pos = 0
    for u in us:
        a, b = pos, pos + u.audio.shape[0]
        real = min(b, x.size) - a
        np.testing.assert_array_equal(u.audio[:max(0, real)], x[a:a + max(0, real)])  # nothing lost or doubled
        if b > start:
            assert u.epoch == 1, f"unit {u.unit_index} [{a},{b}) holds audio from {start} but has epoch {u.epoch}"
        pos = b
    assert pos >= start + SR  # the interrupting speech was fed


def test_without_the_fence_some_onsets_leak_into_the_old_epoch():
    leaked = 0
    for lead in LEADS:
        d, x, start = _barge_in(100, lead, fence=False)
        pos = 0
        for u in units(d.cmds)[1:]:
            b = pos + u.audio.shape[0]
            leaked += b > start and u.epoch == 0
            pos = b
    assert leaked > 0  # the test above is not vacuous


def test_units_held_for_the_fence_are_released_when_input_stalls():
    d = Driver()
    append(d, np.zeros(16560, np.float32))
    d.speak(end=False)
    n0 = len(units(d.cmds))
    append(d, np.zeros(SR, np.float32))  # completes unit 1, held for the fence
    assert len(units(d.cmds)) == n0
    d.tick(500)  # no input for > 440 ms: no onset can come, the unit goes out
    assert len(units(d.cmds)) == n0 + 1
