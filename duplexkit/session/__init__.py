"""The sans-I/O Session: all conversation logic of one realtime connection, without I/O.

The package splits the Session by job (docs/architecture.md, "The sans-I/O Session"):

* :mod:`~duplexkit.session.machine` — phases, phase events, the transition table and the only
  function that assigns a phase;
* :mod:`~duplexkit.session.core` — :class:`Session`: public API, output queue, dispatch;
* :mod:`~duplexkit.session.config` — :class:`SessionConfig`, :class:`SessionLimits`,
  :class:`CloseConnection`;
* :mod:`~duplexkit.session.settings` — ``session.update`` validation, formats, turn detection;
* :mod:`~duplexkit.session.pipeline` — the input pipeline (decoder to units, VAD, barge-in fence);
* :mod:`~duplexkit.session.responses` — responses, deltas, epochs, the latency trace;
* :mod:`~duplexkit.session.conversation` — items, playback acks, truncation, history;
* :mod:`~duplexkit.session.wire` — the session, response and item wire objects;
* :mod:`~duplexkit.session.voice` — the reference voice of ``session.update``.

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
