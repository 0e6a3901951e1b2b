"""The docs/protocol.md §9 error table and the typed protocol error (re-exported from :mod:`duplexkit.errors`).

Every rejected client event produces exactly one ``error`` server event built from a
:class:`ProtocolError`; the session stays alive (docs/protocol.md §9 "Principle"). The definitions live
in :mod:`duplexkit.errors`, the one module of duplexkit's exception hierarchy.
"""

from __future__ import annotations

from duplexkit.errors import ERROR_TYPES, ErrorCode, ProtocolError, TransitionError

__all__ = ["ErrorCode", "ERROR_TYPES", "ProtocolError", "TransitionError"]
