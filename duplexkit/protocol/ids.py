"""Identifiers of docs/protocol.md §3: ``sess_<24 hex>``, ``event_<hex>``, ``resp_<hex>``, ``item_<hex>``.

An :class:`IdFactory` makes ids unique within its session (a random 48-bit prefix plus a counter),
never reused, and cheap (no syscall per id).
"""

from __future__ import annotations

import itertools
import secrets

__all__ = ["new_session_id", "IdFactory"]


def new_session_id() -> str:
    """A fresh ``sess_<24 hex>`` session id (96 random bits; docs/protocol.md §3)."""
    return "sess_" + secrets.token_hex(12)


class IdFactory:
    """Per-session id generator: ``event_<hex>``, ``resp_<hex>``, ``item_<hex>``, ``call_<hex>``, ``dec_<hex>``."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(6)
        self._counter = itertools.count(1)

    def _next(self, kind: str) -> str:
        return f"{kind}_{self._prefix}{next(self._counter):08x}"

    def event(self) -> str:
        return self._next("event")

    def response(self) -> str:
        return self._next("resp")

    def item(self) -> str:
        return self._next("item")

    def call(self) -> str:
        """A function call id, ``call_<hex>`` (docs/tools.md)."""
        return self._next("call")

    def decision(self) -> str:
        """A tool decision id, ``dec_<hex>`` (the Session's DecideTools requests)."""
        return self._next("dec")
