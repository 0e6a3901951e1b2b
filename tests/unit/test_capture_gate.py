"""The CUDA-graph capture gate (duplexkit/models/minicpmo45/capture_gate.py): a capture never overlaps
another thread's GPU work, stage work never waits for other stage work, and a stage thread that
captures while it holds shared work does not deadlock (a lazy capture at 8 sessions
on the H200 once broke the engine for the rest of the process)."""

from __future__ import annotations

import threading
import time

from duplexkit.models.minicpmo45.capture_gate import CaptureGate

WAIT = 10.0


def test_shared_holds_do_not_wait_for_each_other():
    gate = CaptureGate()
    inside = threading.Barrier(3, timeout=WAIT)

    def stage():
        with gate.shared():
            inside.wait()  # all three threads are inside at once, or the barrier times out

    ts = [threading.Thread(target=stage) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(WAIT)
    assert not inside.broken


def test_capture_waits_for_shared_work_and_blocks_new_work():
    gate = CaptureGate()
    log: list = []
    in_stage = threading.Event()
    release_stage = threading.Event()
    capture_waiting = threading.Event()

    def stage_a():
        with gate.shared():
            log.append("a-in")
            in_stage.set()
            release_stage.wait(WAIT)
            log.append("a-out")

    def capture():
        capture_waiting.set()
        with gate.exclusive():
            log.append("capture")

    def stage_b():  # arrives while the capture waits: must not slip in before it (writer preference)
        with gate.shared():
            log.append("b")

    ta = threading.Thread(target=stage_a)
    ta.start()
    assert in_stage.wait(WAIT)
    tc = threading.Thread(target=capture)
    tc.start()
    assert capture_waiting.wait(WAIT)
    deadline = time.monotonic() + WAIT
    while gate._waiting_writers == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    tb = threading.Thread(target=stage_b)
    tb.start()
    time.sleep(0.05)
    assert log == ["a-in"]  # neither the capture nor the new stage work ran yet
    release_stage.set()
    for t in (ta, tc, tb):
        t.join(WAIT)
    assert log == ["a-in", "a-out", "capture", "b"]


def test_a_stage_thread_may_capture_inside_its_own_shared_work():
    gate = CaptureGate()
    done = []

    def stage():
        with gate.shared():
            with gate.shared():  # nested share: no wait
                with gate.exclusive():  # gives its own shares up while it captures
                    with gate.shared():  # work inside the own capture: no wait
                        with gate.exclusive():  # re-entrant
                            done.append(threading.get_ident())

    t = threading.Thread(target=stage)
    t.start()
    t.join(WAIT)
    assert not t.is_alive() and len(done) == 1
    assert gate._shared == 0 and gate._writer is None


def test_two_stage_threads_capturing_at_once_never_overlap_or_deadlock():
    gate = CaptureGate()
    state = {"shared": 0, "capturing": 0, "violations": 0, "captures": 0}
    lock = threading.Lock()
    stop = time.monotonic() + 1.0

    def work(k: int):
        n = 0
        while time.monotonic() < stop:
            with gate.shared():
                with lock:
                    state["shared"] += 1
                    state["violations"] += state["capturing"] > 0
                time.sleep(0.0005)
                with lock:
                    state["shared"] -= 1
                n += 1
                if n % (3 + k) == 0:  # a lazy capture in the middle of this thread's stage work
                    with gate.exclusive():
                        with lock:
                            state["capturing"] += 1
                            state["violations"] += state["shared"] > 0 or state["capturing"] > 1
                        time.sleep(0.0005)
                        with lock:
                            state["capturing"] -= 1
                            state["captures"] += 1

    ts = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(WAIT)
    assert not any(t.is_alive() for t in ts), "deadlock"
    assert state["captures"] > 10
    assert state["violations"] == 0
    assert gate._shared == 0 and gate._writer is None and gate._waiting_writers == 0


def test_the_stage_functions_hold_the_gate():
    from duplexkit.engine import minicpmo45
    from duplexkit.models.minicpmo45.capture_gate import CAPTURE_GATE

    seen = []

    class Thinker:
        def close(self, handle):
            seen.append(bool(CAPTURE_GATE._tls().counted))

    class Model:
        thinker = Thinker()

    stages = minicpmo45.MiniCPMO45Stages.__new__(minicpmo45.MiniCPMO45Stages)
    stages.model = Model()
    stages.thinker_close("h")
    assert seen == [True]
    assert not CAPTURE_GATE._tls().counted
