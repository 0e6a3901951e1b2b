"""duplexkit.protocol: pydantic v2 models of every wire event of docs/protocol.md.

* :func:`parse_client_event` — tolerant inbound parsing of client events (GA + beta spellings,
  aliases, extra fields ignored) raising :class:`ProtocolError` with a §9 :class:`ErrorCode`.
* Server event models (``SessionCreated``, ``ResponseDone``, ``OutputAudioDelta``, …) — strict
  outbound serialisation with ``.to_wire()`` (``model_dump(mode="json", exclude_none=True)``).
* :func:`parse_server_event` — client-side parsing of GA and beta server events; unknown events
  surface as :class:`UnknownServerEvent`.
* :mod:`.vocabulary` — the one home of the wire's names and numbers: extension events, GA <-> beta
  event names, audio format types and rates, close codes and reasons.
"""

from __future__ import annotations

from .client_events import *  # noqa: F401,F403
from .client_events import __all__ as _client_all
from .errors import ERROR_TYPES, ErrorCode, ProtocolError, TransitionError
from .ids import IdFactory, new_session_id
from .server_events import *  # noqa: F401,F403
from .server_events import __all__ as _server_all
from .vocabulary import *  # noqa: F401,F403
from .vocabulary import __all__ as _vocabulary_all

__all__ = [
    "ErrorCode",
    "ERROR_TYPES",
    "ProtocolError",
    "TransitionError",
    "IdFactory",
    "new_session_id",
    *_client_all,
    *_server_all,
    *(n for n in _vocabulary_all if n not in _server_all and n not in _client_all),
]
