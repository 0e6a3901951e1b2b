"""The sans-I/O Session: all conversation logic of one realtime connection, without I/O.

The Session is a core that composes owned parts, each with its state declared in its own module
and reached by the others only through its public methods (docs/architecture.md, "The sans-I/O
Session"):

* :mod:`~duplexkit.session.core` — :class:`Session`: public API and dispatch (h11 ``Connection`` style);
* :mod:`~duplexkit.session.outbox` — the output queue, the phase machine, the epoch, the clock;
* :mod:`~duplexkit.session.machine` — phases, phase events, the transition table, the only
  function that assigns a phase, the emissions each move declares, and the small-machine runner;
* :mod:`~duplexkit.session.settings` — the ``session.update`` part (formats, turn detection,
  the engine stream's configuration);
* :mod:`~duplexkit.session.pipeline` — the input pipeline part (decoder to units, VAD, commits)
  with its VAD-item and held-commit machines; :mod:`~duplexkit.session.holds` — the padding debt
  and the barge-in unit hold, each with its machine;
* :mod:`~duplexkit.session.responses` — the response part (envelope, deltas, end, turn hold);
  :mod:`~duplexkit.session.trace` — the latency trace and its wait machine;
* :mod:`~duplexkit.session.conversation` — the conversation part (items, playback truth);
* :mod:`~duplexkit.session.tools` — the tools and transcription part;
* :mod:`~duplexkit.session.wire` — wire objects (plain functions);
  :mod:`~duplexkit.session.voice` — the reference voice of ``session.update`` (plain functions);
* :mod:`~duplexkit.session.config` — :class:`SessionConfig`, :class:`SessionLimits`,
  :class:`CloseConnection`.

``from duplexkit.session import Session, SessionConfig, ...`` is the public import path.
"""

from duplexkit.session.config import MIN_COMMIT_SAMPLES, UNIT_PERIOD_MS, CloseConnection, SessionConfig, SessionLimits
from duplexkit.session.core import Session
from duplexkit.session.machine import TRANSITIONS, Phase, PhaseEvent, PhaseMachine, TEvent
from duplexkit.session.responses import reason_to_cancel
from duplexkit.session.settings import SEMANTIC_VAD_SILENCE_MS
from duplexkit.session.voice import REF_AUDIO_MIN_S, REF_TRIM_SAMPLES
from duplexkit.session.wire import EXTENSION_EVENTS

__all__ = [
    "Session",
    "SessionConfig",
    "SessionLimits",
    "CloseConnection",
    "Phase",
    "PhaseEvent",
    "PhaseMachine",
    "TEvent",
    "TRANSITIONS",
    "UNIT_PERIOD_MS",
    "MIN_COMMIT_SAMPLES",
    "SEMANTIC_VAD_SILENCE_MS",
    "REF_AUDIO_MIN_S",
    "REF_TRIM_SAMPLES",
    "EXTENSION_EVENTS",
    "reason_to_cancel",
]
