"""Deprecated: the scripted engine moved to :mod:`duplexkit.testing` (``duplexkit.testing.scripted``).

``from duplexkit.engine.fake import ScriptedEngine`` keeps working for existing code; new code
imports ``from duplexkit.testing import ScriptedEngine``. This module will be removed in a later
release.
"""

from duplexkit.testing.scripted import (  # noqa: F401  (re-exported)
    CHUNK_SAMPLES,
    FAULT_STAGES,
    FIRST_CHUNK_SAMPLES,
    TAIL_SAMPLES,
    ScriptConfig,
    ScriptedEngine,
    ScriptedStream,
    tone,
)

__all__ = ["ScriptedEngine", "ScriptedStream", "ScriptConfig", "FIRST_CHUNK_SAMPLES", "CHUNK_SAMPLES",
           "TAIL_SAMPLES", "FAULT_STAGES", "tone"]
