from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexkit.audio import UnitFramer, read_wav


def _ramp(n: int) -> np.ndarray:
    # distinct values so slices can be located exactly
    return (np.arange(n, dtype=np.float64) / 2**20).astype(np.float32)


def test_parity_case_f_slices():
    # parity README: user units [0,16560), [16560,32560), [32560,48560), [48560,64560)
    x = _ramp(64560)
    units = UnitFramer().push(x)
    assert [u.index for u in units] == [0, 1, 2, 3]
    bounds = [(0, 16560), (16560, 32560), (32560, 48560), (48560, 64560)]
    for u, (a, b) in zip(units, bounds):
        assert u.start_sample == a
        np.testing.assert_array_equal(u.audio, x[a:b])
        assert u.audio.dtype == np.float32
        assert u.padded_samples == 0
    # consumed bookkeeping: 16480 then 16000 each (docs/model.md §3.1)
    assert [(u.consumed_start, u.consumed_samples) for u in units] == [
        (0, 16480), (16480, 16000), (32480, 16000), (48480, 16000)
    ]
    assert [(u.start_ms, u.end_ms) for u in units] == [(0, 1030), (1030, 2030), (2030, 3030), (3030, 4030)]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 70000),
    sizes=st.lists(st.integers(1, 20000), min_size=1, max_size=10),
    unit=st.integers(1, 5000),
    extra=st.integers(0, 3000),
    under=st.integers(0, 3000),
)
def test_any_chunking_gives_same_units(n, sizes, unit, extra, under):
    first_window = unit + extra
    first_consume = max(1, first_window - under)
    x = _ramp(n)
    ref = UnitFramer(unit, first_window, first_consume).push(x)
    f = UnitFramer(unit, first_window, first_consume)
    got, i, k = [], 0, 0
    while i < n:
        s = sizes[k % len(sizes)]
        got += f.push(x[i : i + s])
        i += s
        k += 1
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert a.index == b.index and a.start_sample == b.start_sample
        np.testing.assert_array_equal(a.audio, b.audio)
    framed = sum(u.audio.size for u in got)
    assert framed + f.pending_samples == n  # nothing lost, nothing padded
    # every sample appears exactly once, in order
    if got:
        np.testing.assert_array_equal(np.concatenate([u.audio for u in got]), x[:framed])
    tail = f.flush()
    if f.pending_samples == 0 and (n - framed) == 0:
        assert tail is None
    else:
        assert tail is not None
        assert tail.padded_samples == tail.audio.size - (n - framed)
        np.testing.assert_array_equal(tail.audio[: n - framed], x[framed:])
        assert not tail.audio[n - framed :].any()


def test_flush_pads_only_on_request_and_continues():
    f = UnitFramer()
    assert f.flush() is None
    assert f.push(np.ones(10000, np.float32)) == []
    assert f.pending_samples == 10000
    u0 = f.flush()
    assert u0.index == 0 and u0.audio.size == 16560 and u0.padded_samples == 6560
    assert u0.real_samples == 10000
    assert f.pending_samples == 0
    assert f.flush() is None
    units = f.push(np.ones(16001, np.float32))
    assert len(units) == 1 and units[0].index == 1 and units[0].audio.size == 16000
    assert units[0].padded_samples == 0 and f.pending_samples == 1
    u2 = f.flush()
    assert u2.index == 2 and u2.padded_samples == 15999


def test_clear_and_reset():
    f = UnitFramer()
    f.push(np.ones(20000, np.float32))
    assert f.pending_samples == 20000 - 16560
    assert f.clear() == 20000 - 16560
    assert f.pending_samples == 0 and f.next_index == 1
    assert f.samples_dropped == 20000 - 16560
    f.reset()
    assert f.next_index == 0 and f.needed_samples == 16560


def test_bad_config_and_input():
    with pytest.raises(ValueError):
        UnitFramer(16000, 100, 200)
    with pytest.raises(ValueError):
        UnitFramer(0)
    with pytest.raises(ValueError):
        UnitFramer().push(np.zeros((2, 2), np.float32))


def test_real_speech_units(fixtures_dir):
    x, sr = read_wav(fixtures_dir / "long_question_16k.wav")
    assert sr == 16000
    f = UnitFramer()
    units = []
    for i in range(0, x.size, 320):  # 20 ms appends
        units += f.push(x[i : i + 320])
    last = f.flush()
    units.append(last)
    assert sum(u.real_samples for u in units) == x.size
    np.testing.assert_array_equal(np.concatenate([u.audio for u in units])[: x.size], x)
