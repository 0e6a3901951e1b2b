"""Test tools for code built on duplexkit (torch-free; nothing here runs a model).

* :class:`ScriptedEngine` — a deterministic scripted :class:`~duplexkit.engine.api.Engine` with the
  runtime's epoch and failure rules (:mod:`duplexkit.testing.scripted`);
* :class:`EventStreamChecker` — the docs/protocol.md §12 invariants of a server-event stream
  (defined in :mod:`duplexkit.protocol.conformance`);
* :func:`inject_fault` — make a stage fail a stream's next work item, on either engine
  (:mod:`duplexkit.testing.faults`).

The engine contract both engines meet is tests/engine/test_contract.py.
"""

from duplexkit.protocol.conformance import ConformanceError, EventStreamChecker
from duplexkit.testing.faults import FAULT_STAGES, InjectedFault, StageFaults, inject_fault
from duplexkit.testing.scripted import (
    CHUNK_SAMPLES,
    FIRST_CHUNK_SAMPLES,
    TAIL_SAMPLES,
    ScriptConfig,
    ScriptedEngine,
    ScriptedStream,
    tone,
)

__all__ = [
    "ScriptedEngine",
    "ScriptedStream",
    "ScriptConfig",
    "FIRST_CHUNK_SAMPLES",
    "CHUNK_SAMPLES",
    "TAIL_SAMPLES",
    "tone",
    "EventStreamChecker",
    "ConformanceError",
    "FAULT_STAGES",
    "InjectedFault",
    "inject_fault",
    "StageFaults",
]
