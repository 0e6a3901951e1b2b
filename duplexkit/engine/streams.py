"""Per-stream records of the stage runtime (:mod:`duplexkit.engine.runtime`): the work kinds of
the stage queues, the stream status and its allowed transitions, the output sequencer slot of one
unit, stage-queue items and a stream's runtime state. Everything here is guarded by the runtime's
lock (the public handle, :class:`~duplexkit.engine.runtime.RuntimeStream`, lives in the runtime)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from ..errors import DuplexkitError
from .api import StreamConfig
from .layout import STAGES

__all__ = ["WorkKind", "StreamStatus", "TRANSITIONS", "StreamStateError"]


class WorkKind(Enum):
    """What a stage-queue item asks of its stage. ``UNIT`` items of a step go to the model as one
    batch; every other kind is a control step run on its own (the runtime's handler table,
    :data:`duplexkit.engine.steps.CONTROL`, maps ``(stage, kind)`` to the code that runs it)."""

    UNIT = "unit"  # one unit (thinker), its speaking result (talker) or its codes (code2wav)
    OPEN = "open"  # create the stream's state at the stage
    UPDATE = "update"  # a new StreamConfig (thinker: the prefix; code2wav: the voice)
    END_TURN = "end_turn"  # after a cancel: end the model turn at the stage
    SPEAK_TEXT = "speak_text"  # thinker: queue forced speech
    CLOSE = "close"  # free the stream's state at the stage


class StreamStatus(Enum):
    """Where a stream is in its life (one value instead of separate flags). :data:`TRANSITIONS` lists
    the moves; :meth:`_StreamState.move` is the only code that changes it."""

    OPENING = "opening"  # open items queued; not every stage has created its state yet
    OPEN = "open"  # every stage opened it; serving
    CLOSING = "closing"  # close items queued (a CloseStream, the engine closing, a cancelled open)
    FAILED = "failed"  # a fatal failure was reported; closing at every stage
    CLOSED = "closed"  # every stage freed its state; the end-of-outputs marker is queued
    ENDED = "ended"  # event-loop side: the consumer read the end-of-outputs marker


TRANSITIONS: dict = {
    StreamStatus.OPENING: frozenset({StreamStatus.OPEN, StreamStatus.CLOSING, StreamStatus.FAILED}),
    StreamStatus.OPEN: frozenset({StreamStatus.CLOSING, StreamStatus.FAILED}),
    StreamStatus.CLOSING: frozenset({StreamStatus.FAILED, StreamStatus.CLOSED}),
    StreamStatus.FAILED: frozenset({StreamStatus.CLOSED}),
    StreamStatus.CLOSED: frozenset({StreamStatus.ENDED}),
    StreamStatus.ENDED: frozenset(),
}
"""status -> the statuses it may move to. A failure while closing still reports (CLOSING -> FAILED);
a failed stream is already closing (FAILED -> CLOSED)."""

_LIVE = frozenset({StreamStatus.OPENING, StreamStatus.OPEN})
_DONE = frozenset({StreamStatus.CLOSED, StreamStatus.ENDED})


class StreamStateError(DuplexkitError, RuntimeError):
    """A status move :data:`TRANSITIONS` does not allow (a bug in the runtime, never user input)."""


# ---------------------------------------------------------------------------------------------
# internal records
# ---------------------------------------------------------------------------------------------


class _Slot:
    """One unit's place in the stream's output sequencer."""

    __slots__ = ("unit_index", "epoch", "outputs", "done", "t_submit", "timings")

    def __init__(self, unit_index: int, epoch: int, t_submit: float) -> None:
        self.unit_index = unit_index
        self.epoch = epoch
        self.outputs: list = []
        self.done = False
        self.t_submit = t_submit
        self.timings: dict = {"queue_ms": 0.0}


@dataclass
class _WorkItem:
    """One entry of a stage queue (a unit, or a control step of the stream)."""

    kind: WorkKind
    slot: Optional[_Slot] = None
    payload: Any = None
    t_enqueue: float = field(default_factory=time.perf_counter)


class _StreamState:
    """One stream's state inside the runtime (the public handle is :class:`RuntimeStream`)."""

    def __init__(self, stream_id: str, config: StreamConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.id = stream_id
        self.config = config  # as submitted (event-loop side)
        #: the config in effect at each stage (an UpdateStream reaches each stage in queue order)
        self.applied: dict = {s: config for s in STAGES}
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed_event = asyncio.Event()
        self.opened: Optional[asyncio.Future] = None
        self.epoch = 0
        self.q = {s: deque() for s in STAGES}
        self.busy = {s: False for s in STAGES}
        self.status = StreamStatus.OPENING
        self.to_open = set(STAGES)  # stages whose open item has not run yet
        self.to_close: set = set()  # stages whose close item has not run yet (once closing)
        #: the stream's state at each stage, opaque to the runtime: the thinker's stream state, the
        #: talker's current turn (None between turns), the vocoder's stream (None until opened)
        self.handles: dict = {s: None for s in STAGES}
        self.force_speak_epoch: Optional[int] = None
        self.slots: deque = deque()
        self.pending_text = ""
        self.turn_count = 0
        self.last_unit = -1

    def move(self, status: StreamStatus) -> None:
        """Change the status along :data:`TRANSITIONS`.

        Raises:
            StreamStateError: the move is not in the table."""
        if status not in TRANSITIONS[self.status]:
            raise StreamStateError(f"stream {self.id}: {self.status.value} -> {status.value} is not allowed")
        self.status = status

    @property
    def live(self) -> bool:
        """Opening or open: neither closing, failed nor closed (commands and results still count)."""
        return self.status in _LIVE

    @property
    def done(self) -> bool:
        """Every stage freed the stream (closed, or closed and its outputs read to the end)."""
        return self.status in _DONE


def _voice_key(v) -> Optional[str]:
    return None if v is None else v.sha256


def _ms(t0: float, t1: float) -> float:
    return round((t1 - t0) * 1000.0, 3)
