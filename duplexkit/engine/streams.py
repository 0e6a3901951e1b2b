"""Per-stream records of the stage runtime (:mod:`duplexkit.engine.runtime`): the output
sequencer slot of one unit, stage-queue items, a stream's runtime state, and the public
:class:`RuntimeStream` handle. Everything here is guarded by the runtime's lock."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from .api import FIRST_UNIT_SAMPLES, UNIT_SAMPLES, CloseStream, EngineCommand, EngineOutput, StreamConfig
from .layout import STAGES

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import StageRuntime

__all__ = ["RuntimeStream", "FIRST_UNIT_SAMPLES", "UNIT_SAMPLES"]

# the model contract's unit sizes live in .api (one home); re-exported here for the runtime


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

    kind: str  # unit | open | update | end_turn | reset | close
    slot: Optional[_Slot] = None
    payload: Any = None
    t_enqueue: float = field(default_factory=time.perf_counter)


class _StreamState:
    """One stream's state inside the runtime (the public handle is :class:`RuntimeStream`)."""

    def __init__(self, stream_id: str, config: StreamConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.id = stream_id
        self.config = config  # as submitted (event-loop side)
        self.thinker_config = config  # in effect at the thinker
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed_event = asyncio.Event()
        self.opened: Optional[asyncio.Future] = None
        self.epoch = 0
        self.q = {s: deque() for s in STAGES}
        self.busy = {s: False for s in STAGES}
        self.open_left = set(STAGES)
        self.close_left: set = set()
        self.thinker_handle: Any = None
        self.talker_turn: Any = None
        self.c2w_handle: Any = None
        self.c2w_voice = config.ref_voice
        self.force_speak_epoch: Optional[int] = None
        self.slots: deque = deque()
        self.pending_text = ""
        self.closing = False
        self.failed = False
        self.finished = False
        self.ended = False  # event-loop side: the end-of-outputs marker was consumed
        self.turn_count = 0
        self.fault: Optional[str] = None
        self.last_unit = -1


def _voice_key(v) -> Optional[str]:
    return None if v is None else v.sha256


def _ms(t0: float, t1: float) -> float:
    return round((t1 - t0) * 1000.0, 3)


# ---------------------------------------------------------------------------------------------
# the public stream handle
# ---------------------------------------------------------------------------------------------


class RuntimeStream:
    """:class:`duplexkit.engine.api.EngineStream` of the built-in runtime.

    ``submit`` is non-blocking and event-loop safe; ``outputs()`` yields the stream's outputs in
    order and ends once the stream is closed (or failed fatally).
    """

    def __init__(self, runtime: "StageRuntime", state: _StreamState) -> None:
        self._rt = runtime
        self._st = state
        self.stream_id = state.id

    @property
    def epoch(self) -> int:
        """The stream's current epoch."""
        return self._st.epoch

    @property
    def closed(self) -> bool:
        return self._st.finished

    def submit(self, command: EngineCommand) -> None:
        """Queue one command (AppendUnit, ForceSpeak, CancelEpoch, UpdateStream, CloseStream).

        Commands to a closed or failed stream are ignored (the failure was already reported).

        Raises:
            EngineInputError: an AppendUnit whose audio is not float32-convertible 1-D finite
                samples of length 16560 (unit 0) or 16000 (later units), a command for another
                stream, or an OpenStream / unknown command.
        """
        self._rt._submit(self._st, command)

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        """Async iterator of :class:`~duplexkit.engine.api.EngineOutput`; ends after close."""
        st = self._st
        while not st.ended:
            out = await st.queue.get()
            if out is None:
                st.ended = True
                return
            yield out

    async def aclose(self) -> None:
        """Close the stream (drops its queued work) and wait until every stage freed its state."""
        if not self._st.finished:
            self._rt._submit(self._st, CloseStream(self._st.id, self._st.epoch))
        await self._st.closed_event.wait()

    def inject_fault(self, stage: Optional[str]) -> None:
        """Test hook: make ``stage`` (thinker | talker | code2wav) fail this stream's next work
        item with :class:`~duplexkit.engine.stages.InjectedFault`, exactly as if the model had
        raised for it inside a batch. ``None`` clears the hook."""
        if stage is not None and stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}")
        self._st.fault = stage
