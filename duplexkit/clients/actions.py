"""The actions :class:`~duplexkit.clients.state.ClientState` returns (frozen dataclasses).

The asyncio shells (:mod:`duplexkit.clients.base`) carry them out: :class:`Send` is transmitted,
:class:`Resolve`/:class:`Reject` settle the waiting call of that ``event_id``, the response actions
feed :class:`~duplexkit.clients.ResponseHandle` iterators, :class:`Deliver` feeds ``events()``.
:class:`PlaybackFlushed` and :class:`PlaybackHeard` record what the state did to the player (for
tests, logs and metrics). :class:`Reconnect` and :class:`ResumeAccepted` tell a shell whose transport
can reconnect (the WebSocket client) what to do after a dropped connection (docs/protocol.md §1.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from .records import ResponseRecord

__all__ = ["Action", "Send", "Resolve", "Reject", "ResponseStarted", "ResponseAudio", "ResponseEnded",
           "PlaybackFlushed", "PlaybackHeard", "Deliver", "SessionEnded", "Reconnecting", "Resumed", "Reconnect",
           "ResumeAccepted", "TransportStep"]


# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Transmit this client event (a JSON-ready dict with an ``event_id``)."""

    event: dict


@dataclass(frozen=True)
class Resolve:
    """The request sent with ``event_id`` succeeded; ``value`` is its answer (a typed event, the
    :class:`~duplexkit.protocol.SessionObject`, or the :class:`ResponseRecord` of a create)."""

    event_id: str
    value: Any


@dataclass(frozen=True)
class Reject:
    """The request sent with ``event_id`` failed with ``error``."""

    event_id: str
    error: BaseException


@dataclass(frozen=True)
class ResponseStarted:
    """A ``response.created`` (model-, client- or VAD-triggered) opened ``response``."""

    response: ResponseRecord


@dataclass(frozen=True)
class ResponseAudio:
    """Decoded audio of ``response``: float32 [n] at 24 kHz (also queued on the player unless
    the response was flushed)."""

    response: ResponseRecord
    pcm: np.ndarray


@dataclass(frozen=True)
class ResponseEnded:
    """``response`` stopped generating (``response.done``, or ``error`` set when the session ended
    first)."""

    response: ResponseRecord
    error: Optional[BaseException] = None


@dataclass(frozen=True)
class PlaybackFlushed:
    """The player's unplayed audio of ``response_id`` was dropped at ``played_ms``; ``reason``:
    ``barge_in`` (API or local VAD), ``cancelled`` (response.done), ``cleared``
    (output_audio_buffer.cleared) or ``speech_started`` (server VAD)."""

    response_id: str
    played_ms: int
    dropped_samples: int
    reason: str


@dataclass(frozen=True)
class PlaybackHeard:
    """Every sample of ``response_id`` has played (reported to the server now)."""

    response_id: str
    played_ms: int


@dataclass(frozen=True)
class Deliver:
    """Hand ``event`` (a typed server event) to ``events()``."""

    event: Any


@dataclass(frozen=True)
class SessionEnded:
    """The session is over: ``reason`` from ``session.closed``, or ``error`` on transport loss."""

    reason: Optional[str]
    error: Optional[BaseException] = None


@dataclass(frozen=True)
class Reconnecting:
    """Delivered to ``events()`` (type ``client.reconnecting``, not a server event) when the
    transport dropped and the client is reconnecting to resume the session (docs/protocol.md
    §1.6). A ``session.resumed`` event follows on success; on failure ``events()`` raises
    :class:`~duplexkit.errors.DuplexConnectionError`. ``close_code``: how the old connection
    ended (1006: no close frame); ``last_server_event_seq``: the last event seen before it."""

    close_code: Optional[int] = None
    last_server_event_seq: int = 0
    type: str = "client.reconnecting"


@dataclass(frozen=True)
class Resumed:
    """Delivered to ``events()`` (type ``client.resumed``) when a server that sends no
    ``session.resumed`` (vLLM-Omni) took the resume: its first replayed event arrived."""

    last_server_event_seq: int = 0
    type: str = "client.resumed"


@dataclass(frozen=True)
class Reconnect:
    """Transport directive (docs/protocol.md §1.6): wait ``delay_s`` seconds, open a new connection
    and send ``event`` (a ``session.resume``) as its first frame; then hand the first frame the server
    answers (a decoded JSON value) to :meth:`~duplexkit.clients.state.ClientState.resume_answer`, or
    call :meth:`~duplexkit.clients.state.ClientState.reconnect_failed` when the connection could
    not be opened, the send failed or no answer came. ``attempt`` counts from 1."""

    attempt: int
    delay_s: float
    event: dict


@dataclass(frozen=True)
class ResumeAccepted:
    """Transport directive: the new connection carries the session. Send ``frames`` (client frames
    the dropped connection lost, as they were first sent) in order on it; if that fails, call
    :meth:`~duplexkit.clients.state.ClientState.reconnect_failed`. Otherwise the new connection is
    the session's: hand ``event`` (the server's answer, when it was an event) to
    :meth:`~duplexkit.clients.state.ClientState.receive` like any server event and read on.
    ``lost``: ``(first, last)`` frame numbers that were lost and are no longer kept (None: none)."""

    frames: tuple[str, ...] = ()
    event: Optional[dict] = None
    lost: Optional[tuple[int, int]] = None


TransportStep = Union[Reconnect, ResumeAccepted]
"""The directives a shell with a reconnecting transport carries out (only the remote client)."""

Action = Union[Send, Resolve, Reject, ResponseStarted, ResponseAudio, ResponseEnded, PlaybackFlushed,
               PlaybackHeard, Deliver, SessionEnded, Reconnect, ResumeAccepted]
