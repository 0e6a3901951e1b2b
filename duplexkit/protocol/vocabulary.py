"""The one home of the realtime wire's names and numbers (docs/protocol.md §1.5, §2, §5.1, §6).

Every other module that needs one of these facts imports it from here: the protocol models and
parsers, the Session, the server's dialects and transports, the clients. Only :mod:`duplexkit.errors` is imported
(the ``protocol`` room imports no other room, docs/architecture.md).

* Event names: :data:`EXTENSION_EVENT_TYPES` (duplexkit's own server events), the GA <-> beta event
  names in ONE table (:data:`GA_TO_BETA_EVENTS`; :data:`BETA_TO_GA_EVENTS` and
  :data:`BETA_MIRRORED_EVENTS` are derived from it), client-event aliases.
* Audio formats: GA format ``type`` <-> encoding (:data:`FORMAT_TYPE_ENCODINGS`, inverse derived),
  the beta format strings, and the default rate of each encoding (:func:`default_rate`).
* Close: WebSocket close codes (:class:`CloseCode`), the ``session.closed`` reasons
  (:class:`CloseReason`) and the code that follows each (:data:`CLOSE_CODE_OF_REASON`).
"""

from __future__ import annotations

from enum import Enum, IntEnum
from types import MappingProxyType
from typing import Mapping

from duplexkit.errors import ErrorCode

__all__ = [
    "EXTENSION_EVENT_TYPES",
    "ALWAYS_ADVERTISED_EXTENSION_EVENTS",
    "GA_TO_BETA_EVENTS",
    "BETA_TO_GA_EVENTS",
    "BETA_MIRRORED_EVENTS",
    "CLIENT_EVENT_ALIASES",
    "FORMAT_TYPE_ENCODINGS",
    "ENCODING_FORMAT_TYPES",
    "ENCODINGS",
    "PCM_RATE",
    "G711_RATE",
    "default_rate",
    "CloseCode",
    "CloseReason",
    "CLOSE_REASONS",
    "CLOSE_CODE_OF_REASON",
]

# ------------------------------------------------------------------------------------------ events

#: duplexkit extension server events (not in OpenAI Realtime); validated by their own models only.
#: The duplex profile sends them and advertises them in ``session.capabilities.extension_events``
#: (``session.resumed`` only where resume is offered); the compat profile sends none
#: (docs/protocol.md §1.2, §5.1).
EXTENSION_EVENT_TYPES: frozenset[str] = frozenset({
    "session.closed",
    "session.resumed",
    "session.heartbeat_ack",
    "session.warning",
    "response.speak",
    "response.listen",
})

#: the extension events every duplex-profile session advertises; ``session.resumed`` is added only
#: when the shell offers resume (``SessionConfig.supports_session_resume``)
ALWAYS_ADVERTISED_EXTENSION_EVENTS: tuple[str, ...] = tuple(sorted(EXTENSION_EVENT_TYPES - {"session.resumed"}))

#: GA server event name -> OpenAI beta realtime name (``openai.types.beta.realtime``, vLLM-Omni's
#: clients; docs/protocol.md §2.1, §2.4). The one table of the two namings: the client-side parser
#: reads it backwards (:data:`BETA_TO_GA_EVENTS`), the server's ``beta`` and ``both`` dialects forwards.
GA_TO_BETA_EVENTS: Mapping[str, str] = MappingProxyType({
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
})

#: beta name -> GA name (derived from :data:`GA_TO_BETA_EVENTS`)
BETA_TO_GA_EVENTS: Mapping[str, str] = MappingProxyType({b: g for g, b in GA_TO_BETA_EVENTS.items()})

#: the GA events the ``both`` dialect follows with a copy under their beta name (the six
#: ``response.*`` output events; ``conversation.item.added`` is renamed only in the ``beta``
#: dialect, since ``both`` clients dedupe items by id and would see each item twice)
BETA_MIRRORED_EVENTS: frozenset[str] = frozenset(g for g in GA_TO_BETA_EVENTS if g.startswith("response."))

#: client event alias -> canonical type (docs/protocol.md §2.3)
CLIENT_EVENT_ALIASES: Mapping[str, str] = MappingProxyType({
    "audio.playback_ack": "playback.ack",
    "close": "session.close",
})

# ------------------------------------------------------------------------------------ audio formats

#: GA ``audio.input.format.type`` -> encoding (docs/protocol.md §6.1). ``audio/pcm`` with the extra
#: key ``encoding: "pcm_f32le"`` is float32 as well.
FORMAT_TYPE_ENCODINGS: Mapping[str, str] = MappingProxyType({
    "audio/pcm": "pcm16",
    "audio/pcm_f32le": "pcm_f32le",
    "audio/pcmu": "g711_ulaw",
    "audio/pcma": "g711_alaw",
})

#: encoding -> the GA format ``type`` the server echoes for it (derived). float32 is echoed as
#: ``{type: "audio/pcm", encoding: "pcm_f32le"}`` (OpenAI's types know no ``audio/pcm_f32le``).
ENCODING_FORMAT_TYPES: Mapping[str, str] = MappingProxyType(
    {e: ("audio/pcm" if e.startswith("pcm") else t) for t, e in FORMAT_TYPE_ENCODINGS.items()})

#: the encodings, which are also the beta format strings (``input_audio_format``)
ENCODINGS: tuple[str, ...] = tuple(FORMAT_TYPE_ENCODINGS.values())

#: default rate of PCM (pcm16 and pcm_f32le) in Hz: OpenAI's GA ``audio/pcm`` is 24 kHz only, and the
#: output is always 24 kHz pcm16 (docs/protocol.md §6.1, §6.2). The compat profile's bare ``pcm16``.
PCM_RATE = 24_000
#: the G.711 rate in Hz (``audio/pcmu``, ``audio/pcma``; telephony)
G711_RATE = 8_000


def default_rate(encoding: str) -> int:
    """The rate in Hz a format of ``encoding`` has when none is given: :data:`G711_RATE` for
    ``g711_ulaw`` / ``g711_alaw``, else :data:`PCM_RATE` (the duplex profile's bare ``pcm16``
    default, ``SessionLimits.input_default_rate``, is a server setting and applies before this)."""
    return G711_RATE if encoding.startswith("g711") else PCM_RATE


# ------------------------------------------------------------------------------------------ close


class CloseCode(IntEnum):
    """The WebSocket close codes the realtime endpoints send (RFC 6455 §7.4.1, docs/protocol.md §1.5)."""

    NORMAL = 1000  # session.closed{client_close | timeout}
    GOING_AWAY = 1001  # session.closed{shutdown}
    POLICY_VIOLATION = 1008  # refused handshake (key, origin, path), peer not reading, resume refused
    MESSAGE_TOO_BIG = 1009  # a frame over twice max_event_bytes
    INTERNAL_ERROR = 1011  # session.closed{server_error}
    TRY_AGAIN_LATER = 1013  # no engine yet, no free slot, draining


class CloseReason(str, Enum):
    """``session.closed{reason}`` (docs/protocol.md §1.5)."""

    CLIENT_CLOSE = "client_close"
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"
    SERVER_ERROR = ErrorCode.SERVER_ERROR.value  # the session failed (the same word as the error code)


#: WebSocket close code that follows ``session.closed{reason}`` (docs/protocol.md §1.5)
CLOSE_CODE_OF_REASON: Mapping[str, int] = MappingProxyType({
    CloseReason.CLIENT_CLOSE.value: int(CloseCode.NORMAL),
    CloseReason.TIMEOUT.value: int(CloseCode.NORMAL),
    CloseReason.SHUTDOWN.value: int(CloseCode.GOING_AWAY),
    CloseReason.SERVER_ERROR.value: int(CloseCode.INTERNAL_ERROR),
})

#: the ``session.closed{reason}`` values (docs/protocol.md §1.5; derived)
CLOSE_REASONS: tuple[str, ...] = tuple(r.value for r in CloseReason)
