"""duplexkit clients: one public API, two transports (docs/architecture.md).

* :class:`InlineDuplexClient` — runs a :class:`duplexkit.session.Session` over an in-process engine.
* :class:`DuplexClient` — talks to a server speaking docs/protocol.md over a WebSocket.

Both are async context managers with ``send_audio``, ``commit``, ``create_response``, ``cancel``,
``ack_playback``, ``update``, ``events()`` / ``responses()`` and ``close()``.
"""

from .base import (
    BaseDuplexClient,
    DuplexConnectionError,
    DuplexError,
    DuplexTimeout,
    ResponseHandle,
    ref_audio_data_url,
)
from .inline import InlineDuplexClient
from .state import ClientState, ResponseRecord, response_id_of
from .remote import DuplexClient, build_url
from .continuation import ContinuationSeed
from .records import played_transcript
from .tools import ToolCallFinished, ToolCallRecord, ToolCallStarted, ToolRunner

__all__ = [
    "BaseDuplexClient",
    "InlineDuplexClient",
    "DuplexClient",
    "ResponseHandle",
    "DuplexError",
    "DuplexConnectionError",
    "DuplexTimeout",
    "ref_audio_data_url",
    "build_url",
    "ClientState",
    "ResponseRecord",
    "response_id_of",
    "ContinuationSeed",
    "played_transcript",
    "ToolRunner",
    "ToolCallRecord",
    "ToolCallStarted",
    "ToolCallFinished",
]
