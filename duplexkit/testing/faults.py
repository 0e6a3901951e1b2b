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

from typing import Optional

from duplexkit.errors import InjectedFault

__all__ = ["FAULT_STAGES", "InjectedFault", "inject_fault"]

FAULT_STAGES = ("thinker", "talker", "code2wav")
"""Stage names a fault can target (``duplexkit.engine.stages.STAGES``)."""


def inject_fault(stream, stage: Optional[str]) -> None:
    """Make ``stage`` fail ``stream``'s next work item (``None`` clears a pending fault).

    Args:
        stream: a :class:`~duplexkit.engine.runtime.RuntimeStream` (``DuplexEngine``) or a
            :class:`~duplexkit.testing.scripted.ScriptedStream`.
        stage: ``"thinker"`` | ``"talker"`` | ``"code2wav"`` | None.

    Raises:
        ValueError: an unknown stage.
        TypeError: the stream has no fault hook.
    """
    if stage is not None and stage not in FAULT_STAGES:
        raise ValueError(f"stage must be one of {FAULT_STAGES}, got {stage!r}")
    hook = getattr(stream, "inject_fault", None)
    if hook is None:
        raise TypeError(f"{type(stream).__name__} has no fault hook (inject_fault)")
    hook(stage)
