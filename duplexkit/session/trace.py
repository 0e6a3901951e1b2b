"""The latency trace of a Session's responses (debug option, docs/benchmarks.md "Latency trace") and
its machine, the trace wait: a finished response whose forced unit's ``UnitTimings`` has not come
yet waits for them before its line is logged."""

from __future__ import annotations

import json
import logging
from enum import Enum

from duplexkit.engine.api import AudioChunk, Decision, EngineOutput, UnitTimings
from duplexkit.session.machine import Machine

trace_log = logging.getLogger("duplexkit.latency")
"""Latency trace (debug option, docs/benchmarks.md "Latency trace"): at DEBUG level the Session logs
one JSON line per finished response with its request -> forced unit -> decision -> first audio
stamps (Session clock, ms) and the forced unit's engine ``UnitTimings``. ``first_audio_ms`` is when
the first audio delta went out to the client (for a server-VAD answer held by the turn confirmation,
its release), ``engine_audio_ms`` when the engine's first audio of the response arrived."""


class TraceWait(str, Enum):
    """``none``: no finished response waits; ``waiting``: one waits for its forced unit's timings."""

    NONE = "none"
    WAITING = "waiting"


class TraceEvent(str, Enum):
    WAIT = "wait"  # a traced response finished before its forced unit's timings came
    LOG = "log"  # the waiting response's line was logged


TRACE_TABLE = {
    TraceWait.NONE: {TraceEvent.WAIT: TraceWait.WAITING},
    TraceWait.WAITING: {TraceEvent.LOG: TraceWait.NONE},
}
"""The trace wait's machine: state -> event -> next state (a missing pair is an internal error)."""


class LatencyTrace:
    """Stamps of traced responses (``_Response.trace``, set only while :meth:`enabled`).

    Args:
        session_id: logged with every line.
    """

    def __init__(self, session_id: str) -> None:
        self._session_id = session_id
        self._wait = None  # the finished response waiting for its timings
        self._m = Machine("trace wait", TRACE_TABLE, TraceWait.NONE)

    @staticmethod
    def enabled() -> bool:
        return trace_log.isEnabledFor(logging.DEBUG)

    @property
    def state(self) -> TraceWait:
        return self._m.state

    def output(self, r, out: EngineOutput, now_ms: float) -> None:
        """Stamp an engine output of the active traced response ``r``."""
        t = r.trace
        if isinstance(out, Decision) and r.forced_unit is not None and out.unit_index >= r.forced_unit:
            t.setdefault("decision_ms", float(now_ms))
            t.setdefault("decision_unit", out.unit_index)
        elif isinstance(out, AudioChunk) and out.audio.size:
            # when the engine's audio arrived; first_audio_ms is stamped when it goes out (Responses.on_audio),
            # later than this for an answer held by the turn confirmation (docs/concepts.md)
            t.setdefault("engine_audio_ms", float(now_ms))
            t.setdefault("first_audio_unit", out.unit_index)
        elif isinstance(out, UnitTimings):
            self._engine(r, out)

    def unit_timings(self, out: UnitTimings) -> None:
        """Timings of any epoch: they may complete the waiting response's line."""
        if self._wait is not None:
            self._engine(self._wait, out)

    def finished(self, r, status: str) -> None:
        """A traced response ended: its line is logged now, or once its forced unit's timings come
        (a response still waiting is logged first, without them)."""
        r.trace["status"] = status
        if self._wait is not None:
            self._log(self._wait)
        self._m.fire(TraceEvent.WAIT)
        self._wait = r
        if "engine" in r.trace or r.forced_unit is None or status == "cancelled":
            self._log(r)

    def _engine(self, r, out: UnitTimings) -> None:
        if out.unit_index == r.forced_unit and "engine" not in r.trace:
            r.trace["engine"] = dict(out.timings)
            if r is self._wait:
                self._log(r)

    def _log(self, r) -> None:
        if r is self._wait:
            self._m.fire(TraceEvent.LOG)
            self._wait = None
        rec = {"session": self._session_id, "response": r.id, "trigger": r.trigger, "forced_unit": r.forced_unit,
               **r.trace}
        trace_log.debug("%s", json.dumps(rec))
