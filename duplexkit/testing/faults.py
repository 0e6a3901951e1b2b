"""Fault injection for engine streams, the same call for the runtime and the scripted engine.

A fault named after a stage makes that stage fail the stream's next work item, exactly as if the
model had raised inside a batch (:class:`~duplexkit.errors.InjectedFault`):

* ``thinker`` — fatal: one ``EngineFailure(fatal=True)``, then the stream's outputs end and later
  commands are ignored (the Session closes with 1011);
* ``talker`` / ``code2wav`` — the turn only: the next speaking unit with audio gets a non-fatal
  ``EngineFailure`` after its ``Decision`` (and ``TextDelta``), then its ``UnitTimings``; the stream
  keeps serving (the Session ends the response ``failed`` and advances the epoch).
"""

from __future__ import annotations

from typing import Dict, Optional

from duplexkit.errors import InjectedFault

__all__ = ["FAULT_STAGES", "InjectedFault", "StageFaults", "inject_fault"]

FAULT_STAGES = ("thinker", "talker", "code2wav")
"""Stage names a fault can target (``duplexkit.engine.stages.STAGES``)."""


class StageFaults:
    """A fault plan for the stage runtime: the :class:`~duplexkit.engine.stages.FaultHook` a test
    installs as ``StageRuntime.fault_hook``. It holds, per stream id, the stage whose next work item
    fails; the runtime asks :meth:`take` before each batch call. The runtime's stream records hold
    nothing of it."""

    def __init__(self) -> None:
        self._armed: Dict[str, str] = {}

    def arm(self, stream_id: str, stage: Optional[str]) -> None:
        """Make ``stage`` fail ``stream_id``'s next work item (``None`` clears it).

        Raises:
            ValueError: an unknown stage."""
        if stage is not None and stage not in FAULT_STAGES:
            raise ValueError(f"stage must be one of {FAULT_STAGES}, got {stage!r}")
        if stage is None:
            self._armed.pop(stream_id, None)
        else:
            self._armed[stream_id] = stage

    def take(self, stage: str, stream_id: str) -> Optional[BaseException]:
        """An :class:`~duplexkit.errors.InjectedFault` when ``stream_id``'s fault names ``stage``
        (consumed: it fails one work item), else None."""
        if self._armed.get(stream_id) != stage:
            return None
        del self._armed[stream_id]
        return InjectedFault(f"injected fault in {stage} for stream {stream_id}")


def inject_fault(stream, stage: Optional[str]) -> None:
    """Make ``stage`` fail ``stream``'s next work item (``None`` clears a pending fault).

    Args:
        stream: a :class:`~duplexkit.engine.runtime.RuntimeStream` (``DuplexEngine``: a
            :class:`StageFaults` is installed on its runtime, once) or a
            :class:`~duplexkit.testing.scripted.ScriptedStream` (its own hook).
        stage: ``"thinker"`` | ``"talker"`` | ``"code2wav"`` | None.

    Raises:
        ValueError: an unknown stage.
        TypeError: the stream has no fault hook.
    """
    if stage is not None and stage not in FAULT_STAGES:
        raise ValueError(f"stage must be one of {FAULT_STAGES}, got {stage!r}")
    runtime = getattr(stream, "runtime", None)
    if runtime is not None and hasattr(runtime, "fault_hook"):
        faults = runtime.fault_hook
        if not isinstance(faults, StageFaults):
            faults = runtime.fault_hook = StageFaults()
        faults.arm(stream.stream_id, stage)
        return
    hook = getattr(stream, "inject_fault", None)
    if hook is None:
        raise TypeError(f"{type(stream).__name__} has no fault hook (inject_fault)")
    hook(stage)
