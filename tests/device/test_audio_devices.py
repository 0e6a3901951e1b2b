from __future__ import annotations

import time

import numpy as np
import pytest

from duplexkit.audio import MicStream, PlaybackBuffer, SpeakerStream, list_devices
from duplexkit.audio.devices import DeviceError, find_device

pytestmark = pytest.mark.device


def test_pulse_device_is_listed(pulse_server):
    names = [d["name"] for d in list_devices()]
    assert "pulse" in names, names
    idx = find_device("pulse", "input")
    assert list_devices("output")[[d["index"] for d in list_devices("output")].index(idx)]["name"] == "pulse"
    with pytest.raises(DeviceError):
        find_device("no-such-device-xyz", "output")


def _freq(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(x.size), n=4 * x.size))
    return float(np.argmax(spec)) * rate / (4 * x.size)


def test_round_trip_tone(pulse_server):
    out_rate, in_rate, f0 = 24000, 16000, 1000.0
    t = np.arange(out_rate) / out_rate  # 1 s
    tone = (0.5 * np.sin(2 * np.pi * f0 * t)).astype(np.float32)
    pb = PlaybackBuffer(out_rate)
    mic = MicStream(rate=in_rate, block_ms=20, device="pulse", latency="high")
    spk = SpeakerStream(pb, rate=out_rate, block_ms=20, device="pulse", latency="high")
    with mic:
        with spk:
            # a null sink's monitor only delivers audio once something plays into the sink:
            # wait until the mic captures the speaker's silence before sending the tone
            deadline = time.monotonic() + 10
            while mic.samples_captured < in_rate // 5 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert mic.samples_captured >= in_rate // 5, "no audio captured from the monitor source"
            pb.enqueue("resp_1", tone)
            deadline = time.monotonic() + 10
            while pb.queued_samples() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.8)  # let the tail reach the monitor
        assert spk.samples_played >= tone.size
        assert spk.last_dac_time > 0
        time.sleep(0.2)
    blocks = mic.drain()
    assert pb.played_ms("resp_1") == 1000
    assert len(blocks) > 50
    # PortAudio timestamps kept and increasing; sample indices contiguous
    adc = np.array([b.adc_time for b in blocks])
    assert np.all(np.diff(adc) > 0)
    assert [b.start_sample for b in blocks] == list(np.cumsum([0] + [b.audio.size for b in blocks[:-1]]))
    x = np.concatenate([b.audio for b in blocks])
    loud = np.abs(x) > 0.1
    assert loud.any(), "the tone never reached the monitor source"
    i0, i1 = int(np.argmax(loud)), int(loud.size - np.argmax(loud[::-1]))
    assert i0 > 0 and not loud[: in_rate // 10].any()  # silence before the tone was captured too
    dur = (i1 - i0) / in_rate
    assert 0.97 <= dur <= 1.03, dur  # the whole 1 s tone, nothing dropped
    seg = x[i0 + in_rate // 10 : i1 - in_rate // 10]
    assert abs(_freq(seg, in_rate) - f0) / f0 < 0.01
    assert 0.3 < np.sqrt(2 * np.mean(seg**2)) < 0.7  # amplitude ~0.5 survives the round trip
