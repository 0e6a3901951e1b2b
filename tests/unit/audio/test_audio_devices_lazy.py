from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_core_import_does_not_need_sounddevice():
    code = (
        "import sys; sys.modules['sounddevice'] = None\n"  # importing it would now raise ImportError
        "import duplexkit.audio as a\n"
        "assert 'sounddevice' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n    a.list_devices()\nexcept a.DeviceError as e:\n    print('DeviceError', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "DeviceError" in r.stdout and "duplexkit[mic]" in r.stdout


def test_unknown_device_is_a_typed_error():
    pytest.importorskip("sounddevice")
    from duplexkit.audio import DeviceError, MicStream, PlaybackBuffer, SpeakerStream

    with pytest.raises(DeviceError):
        MicStream(device="no-such-device-xyz").start()
    with pytest.raises(DeviceError):
        SpeakerStream(PlaybackBuffer(), device="no-such-device-xyz").start()
    with pytest.raises(ValueError):
        MicStream(rate=0)


def test_callbacks_without_hardware():
    # the PortAudio callbacks are plain functions: drive them directly
    from types import SimpleNamespace

    from duplexkit.audio import MicStream, PlaybackBuffer, SpeakerStream

    pb = PlaybackBuffer(24000)
    pb.enqueue("r", np.full(700, 0.25, np.float32))
    spk = SpeakerStream(pb, channels=2)
    out = np.ones((480, 2), np.float32)
    spk._callback(out, 480, SimpleNamespace(outputBufferDacTime=1.5, currentTime=1.4), None)
    assert np.all(out == np.float32(0.25)) and spk.samples_played == 480 and spk.last_dac_time == 1.5
    spk._callback(out, 480, SimpleNamespace(outputBufferDacTime=1.52, currentTime=1.42), None)
    assert np.all(out[:220] == np.float32(0.25)) and not out[220:].any()
    assert pb.played_samples("r") == 700

    got = []
    mic = MicStream(rate=16000, channels=2, on_block=got.append, max_queued_blocks=2)
    for k in range(3):
        ind = np.stack([np.full(320, 0.5, np.float32), np.full(320, -0.1, np.float32)], 1)
        mic._callback(ind, 320, SimpleNamespace(inputBufferAdcTime=0.02 * k, currentTime=0.02 * k + 0.01), None)
    assert mic.dropped_blocks == 1  # bounded queue: the oldest block went
    blocks = mic.drain()
    assert [b.start_sample for b in blocks] == [320, 640]
    assert [b.adc_time for b in blocks] == [0.02, 0.04]
    np.testing.assert_allclose(blocks[0].audio, 0.2, atol=1e-7)  # stereo averaged
    assert len(got) == 3
