"""Echo control (docs/protocol.md §8.7): speakers without headphones.

Acceptance: with the assistant's own 10 s answer fed back into the mic at -20 dB with 40/80/120 ms
delay plus room noise, the echo-aware VAD (default server VAD config) starts ZERO utterances; in the
same setup a user speaking at the recorded level from 4 s barges in within 300 ms of the speech
onset, while the echo is still active (an echo option that muted barge-in during playback would fail).
The scenario is tests/_echo_scenario.py (real speech fixtures), shared with benchmarks/echo_compare.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _echo_scenario import (  # noqa: E402
    assistant_answer,
    build_mic,
    erle_db,
    rms_dbfs,
    run_scenario,
    user_utterance,
)

from duplexkit.audio import EchoConfig, EchoControl, EchoUnavailableError, StreamingVAD, VadConfig  # noqa: E402
from duplexkit.audio.echo import aec_available  # noqa: E402
from duplexkit.errors import DuplexkitError  # noqa: E402

needs_aec = pytest.mark.skipif(not aec_available(), reason="livekit (duplexkit[echo]) not installed")
MODES = ["gate", pytest.param("aec", marks=needs_aec)]
DELAYS = [40, 80, 120]


@pytest.fixture(scope="module")
def played(fixtures_dir):
    a = assistant_answer(fixtures_dir)
    assert a.size == 10 * 24000 and a.dtype == np.float32
    return a


@pytest.fixture(scope="module")
def user(fixtures_dir):
    u, onset = user_utterance(fixtures_dir)
    assert -26.0 < rms_dbfs(u) < -18.0  # "normal level": the fixture as recorded, ~-20 dBFS RMS
    return u, onset


# ------------------------------------------------------------------------------------ acceptance


@pytest.mark.parametrize("delay_ms", DELAYS)
def test_echo_is_real_without_echo_control(played, delay_ms):
    """The scenario can fail: the plain server VAD takes the -20 dB echo for user speech."""
    run = run_scenario(None, played, build_mic(played, delay_ms).mic)
    assert len(run.starts) >= 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("delay_ms", DELAYS)
def test_own_voice_never_starts_speech(played, mode, delay_ms):
    ctl = EchoControl(EchoConfig(mode=mode))
    run = run_scenario(ctl, played, build_mic(played, delay_ms).mic)
    assert run.starts == []
    assert run.out.size == played.size * 2 // 3  # capture returns as many samples as it gets


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("delay_ms", DELAYS)
def test_user_over_the_answer_barges_in_fast(played, user, mode, delay_ms):
    ctl = EchoControl(EchoConfig(mode=mode))
    mic = build_mic(played, delay_ms, user=user, user_at_s=4.0)
    run = run_scenario(ctl, played, mic.mic)
    assert run.starts, "the user's speech over the answer never started an utterance"
    t, echo_active = run.starts[0]  # no start before the user: the echo alone never starts one
    assert mic.user_onset_s <= t <= mic.user_onset_s + 0.300, (t, mic.user_onset_s)
    # the answer was still audible when the user barged in: muting barge-in during playback fails this
    assert echo_active


def test_muting_during_playback_would_fail(played, user):
    """An echo option that suppresses every frame while the echo is active never lets the user in."""

    class MuteWhilePlaying(EchoControl):
        def gate_frame(self, frame):
            super().gate_frame(frame)
            return not self.echo_active

    ctl = MuteWhilePlaying(EchoConfig(mode="gate"))
    mic = build_mic(played, 80, user=user, user_at_s=4.0)
    run = run_scenario(ctl, played, mic.mic)
    early = [t for t, _ in run.starts if t <= mic.user_onset_s + 0.300]
    assert early == []


@needs_aec
@pytest.mark.parametrize("delay_ms", DELAYS)
def test_aec_erle(played, delay_ms):
    """WebRTC AEC3 (livekit) removes the echo: ERLE >= 30 dB once converged (measured ~54 dB)."""
    clean = build_mic(played, delay_ms, noise_dbfs=None)
    ctl = EchoControl(EchoConfig(mode="aec"))
    run = run_scenario(ctl, played, clean.mic)
    assert erle_db(clean.echo, run.out, ctl.latency_samples, start_s=5.0) >= 30.0
    assert erle_db(clean.echo, run.out, ctl.latency_samples) >= 20.0


# ------------------------------------------------------------------------------------ units


def test_config_validation():
    with pytest.raises(ValueError):
        EchoConfig(mode="loud")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        EchoConfig(margin_db=-1)
    with pytest.raises(ValueError):
        EchoConfig(tail_ms=5)
    with pytest.raises(ValueError):
        EchoConfig(gain_percentile=10)
    with pytest.raises(ValueError):
        EchoControl(EchoConfig(mode="gate"), capture_rate=16001)


def test_aec_missing_package_is_a_typed_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "livekit", None)  # import livekit -> ImportError
    with pytest.raises(EchoUnavailableError) as ei:
        EchoControl(EchoConfig(mode="aec"))
    assert isinstance(ei.value, DuplexkitError) and isinstance(ei.value, ImportError)
    assert "duplexkit[echo]" in str(ei.value) and "gate" in str(ei.value)
    assert not aec_available()
    ctl = EchoControl(EchoConfig(mode="gate"))  # the gate needs no extra package
    x = np.full(320, 0.01, np.float32)
    assert np.array_equal(ctl.capture(x), x) and ctl.latency_samples == 0


@pytest.mark.parametrize("mode", MODES)
def test_capture_keeps_length_for_any_chunking(mode):
    ctl = EchoControl(EchoConfig(mode=mode))
    rng = np.random.default_rng(1)
    total = 0
    for n in [1, 7, 159, 160, 161, 333, 1600, 0, 50]:
        ctl.render(rng.normal(0, 0.05, n * 3 // 2).astype(np.float32))
        y = ctl.capture(rng.normal(0, 0.01, n).astype(np.float32))
        assert y.shape == (n,) and y.dtype == np.float32
        total += n
    assert ctl.in_samples == ctl.out_samples == total
    assert ctl.latency_samples == (160 if mode == "aec" else 0)


def test_bad_input_raises_value_error():
    ctl = EchoControl(EchoConfig(mode="gate"))
    with pytest.raises(ValueError):
        ctl.render(np.zeros((2, 10), np.float32))
    with pytest.raises(ValueError):
        ctl.capture(np.array([0.0, np.nan], np.float32))
    ctl.capture(np.zeros(320, np.float32))  # still usable afterwards


def test_echo_active_follows_the_reference_with_a_tail():
    ctl = EchoControl(EchoConfig(mode="gate", tail_ms=400))
    assert not ctl.echo_active
    tone = (0.1 * np.sin(2 * np.pi * 300 * np.arange(4800) / 24000)).astype(np.float32)  # 200 ms
    ctl.render(tone)
    ctl.capture(np.zeros(3200, np.float32))  # the 200 ms are played
    assert ctl.echo_active
    ctl.capture(np.zeros(16 * 300, np.float32))  # 300 ms of silence: within the 400 ms tail
    assert ctl.echo_active
    ctl.capture(np.zeros(16 * 200, np.float32))  # 500 ms after the end
    assert not ctl.echo_active


def test_reference_far_ahead_is_dropped():
    ctl = EchoControl(EchoConfig(mode="gate", max_reference_lead_ms=500))
    ctl.render(np.full(24000 * 2, 0.1, np.float32))  # 2 s handed over at once
    assert ctl.reference_lead_dropped > 0


def test_vad_hook_rejects_rate_mismatch_and_counts_rejections(played):
    with pytest.raises(ValueError):
        StreamingVAD(VadConfig(sample_rate=8000), echo=EchoControl(EchoConfig(mode="gate")))
    ctl = EchoControl(EchoConfig(mode="gate"))
    vad = StreamingVAD(VadConfig(), echo=ctl)
    mic = build_mic(played, 80).mic
    for k in range(mic.size // 320):
        ctl.render(played[k * 480 : (k + 1) * 480])
        vad.process(ctl.capture(mic[k * 320 : (k + 1) * 320]))
    assert vad.echo_rejected_frames > 50  # the echo was speech to the plain detector, frame by frame
    assert -30.0 < ctl.echo_gain_db < -10.0  # the -20 dB echo path, against a 400 ms envelope maximum
