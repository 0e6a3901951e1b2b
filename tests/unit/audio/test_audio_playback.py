from __future__ import annotations

import threading

import numpy as np
import pytest

from duplexkit.audio import PlaybackBuffer


def test_order_cursor_and_zero_fill():
    pb = PlaybackBuffer()
    a = np.full(2400, 0.1, np.float32)  # 100 ms at 24 kHz
    b = np.full(1200, 0.2, np.float32)
    assert pb.enqueue("r1", a[:1000]) == 1000
    pb.enqueue("r2", b)
    pb.enqueue("r1", a[1000:])  # r1 keeps its place before r2
    assert pb.pending_ms == 150
    assert pb.current_response == "r1"
    out = pb.read(2000)
    assert np.all(out == np.float32(0.1))
    assert pb.played_ms("r1") == 2000 * 1000 // 24000 == 83
    out = pb.read(1000)
    np.testing.assert_array_equal(out[:400], np.float32(0.1))
    np.testing.assert_array_equal(out[400:], np.float32(0.2))
    assert pb.played_samples("r1") == 2400 and pb.played_ms("r1") == 100
    assert pb.played_samples("r2") == 600
    out = pb.read(1000)
    np.testing.assert_array_equal(out[:600], np.float32(0.2))
    assert not out[600:].any()  # underrun: zero-filled
    assert pb.underrun_samples == 400
    assert pb.played_ms("r2") == 50 and pb.pending_ms == 0
    assert pb.played_ms("unknown") == 0


def test_flush_on_cancel():
    pb = PlaybackBuffer()
    pb.enqueue("r1", np.ones(4800, np.float32))
    pb.enqueue("r2", np.full(480, 0.5, np.float32))
    pb.read(1200)
    assert pb.flush("r1") == 3600
    assert pb.played_ms("r1") == 50  # the cursor survives the flush
    assert pb.enqueue("r1", np.ones(100, np.float32)) == 0  # late audio of a cancelled response is dropped
    np.testing.assert_array_equal(pb.read(480), np.float32(0.5))
    pb.enqueue("r3", np.ones(10, np.float32))
    assert pb.flush() == 10
    assert pb.pending_ms == 0
    assert pb.flush("never-seen") == 0


def test_bad_input():
    pb = PlaybackBuffer()
    with pytest.raises(ValueError):
        pb.enqueue("r", np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError):
        pb.read(-1)


def test_threaded_reader_gets_every_sample_once():
    pb = PlaybackBuffer()
    total = 24000 * 2
    x = ((np.arange(total) % 1000 + 1) / 1001).astype(np.float32)  # never 0
    got: list[np.ndarray] = []
    done = threading.Event()

    def reader():
        while not done.is_set() or pb.queued_samples():
            got.append(pb.read(256))

    t = threading.Thread(target=reader)
    t.start()
    for i in range(0, total, 777):
        pb.enqueue("r", x[i : i + 777])
    done.set()
    t.join(10)
    assert pb.played_samples("r") == total
    y = np.concatenate(got)
    assert y.size - pb.underrun_samples == total
    # removing the underrun zeros that came between chunks leaves x, in order
    np.testing.assert_array_equal(y[y != 0], x)
