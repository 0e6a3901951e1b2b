"""Session resume within one replica (docs/protocol.md §1.6): the replay journal, resume tokens
and the registry of resumable sessions.

When the WebSocket of a session drops (any close but a normal 1000, or no close frame at all),
the session is not closed: it is *parked* for ``resume_window_s`` while its engine stream keeps
running, and every server event it emits goes into its :class:`ReplayJournal` (bounded by
``resume_journal_events`` events and ``resume_journal_bytes`` bytes). A new connection whose first
frame is ``session.resume{session_id, resume_token, last_server_event_seq}`` gets
``session.resumed``, then every journaled event after ``last_server_event_seq`` in order, then live
events. While connected, the journal keeps only what a drop may lose: events written to the socket
in the last ``resume_keep_sent_s`` seconds, minus those the client acknowledged with
``session.event_ack{server_event_seq}`` (vLLM-Omni's client and duplexkit's send it). The token is handed out with ``session.created`` and rotated by each ``session.resumed``
(the old one stops working); it is bound to the API key the session was opened with.

Refusals (one ``error`` event, then close 1008; 1011 for the journal):

* ``resume_not_found``: no such session on this replica (never existed, or resumed sessions of
  another principal: the two are not told apart);
* ``resume_unauthorized``: the token or the API key does not match;
* ``resume_expired``: the session was parked longer than the window and has been closed;
* ``resume_journal_overflow``: events the client has not seen were dropped from the journal; the
  session ends with ``session.closed{reason:"server_error"}``.

This module holds no sockets; :mod:`duplexkit_server.realtime` moves the frames.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict, deque
from typing import Any, Optional

from duplexkit.errors import DuplexkitError, ErrorCode
from duplexkit.protocol.vocabulary import CloseCode

__all__ = ["ReplayJournal", "JournalOverflow", "ResumeRegistry", "ResumeRefused", "parse_resume",
           "principal_of", "new_token", "EVENT_OVERHEAD_BYTES"]

EVENT_OVERHEAD_BYTES = 256
"""Bytes counted per journaled event besides its string fields (an estimate of the JSON keys and
numbers; the string fields, e.g. a base64 audio ``delta``, are counted exactly)."""

_TOMBSTONE_KEEP = 1024


class JournalOverflow(DuplexkitError):
    """Events after the requested sequence number were already dropped from the journal."""

    default_code = ErrorCode.RESUME_JOURNAL_OVERFLOW.value


class ResumeRefused(DuplexkitError):
    """A ``session.resume`` that is refused: ``code`` (docs/protocol.md §9), ``message``, and
    ``close_code`` of the WebSocket close that follows."""

    def __init__(self, code: "ErrorCode | str", message: str, close_code: int = CloseCode.POLICY_VIOLATION) -> None:
        super().__init__(message, code=ErrorCode(code).value)
        self.close_code = close_code


def _event_bytes(ev: dict) -> int:
    return EVENT_OVERHEAD_BYTES + sum(len(v) for v in ev.values() if isinstance(v, str))


class ReplayJournal:
    """The last server events of one session, by ``server_event_seq`` (oldest dropped first).

    Args:
        max_events: events kept at most (>= 1).
        max_bytes: bytes kept at most (string fields + :data:`EVENT_OVERHEAD_BYTES` per event).
        keep_sent_s: events already written to the socket (:meth:`mark_sent`) are dropped once they
            are older than this, seconds (None: kept until a bound or an ack drops them). A dropped
            connection can only have lost what was in flight, the last few seconds of it.

    Events are JSON-ready dicts with an integer ``server_event_seq`` (increasing by 1). The client's
    ``session.event_ack{server_event_seq}`` (:meth:`ack`) drops every event through that number.
    """

    def __init__(self, max_events: int, max_bytes: int, keep_sent_s: Optional[float] = None) -> None:
        if max_events < 1 or max_bytes < 1:
            raise ValueError("the resume journal needs room for at least one event and one byte")
        self.max_events = int(max_events)
        self.max_bytes = int(max_bytes)
        self.keep_sent_s = None if keep_sent_s is None else float(keep_sent_s)
        self._events: deque = deque()  # (seq, event, size, monotonic time appended)
        self.bytes = 0
        #: the highest sequence number dropped so far (0: nothing dropped)
        self.dropped_through = 0
        #: the highest sequence number appended so far
        self.last_seq = 0
        #: the highest sequence number written to a socket (:meth:`mark_sent`)
        self.sent_through = 0
        #: the highest sequence number the client acknowledged (:meth:`ack`)
        self.acked_through = 0

    def __len__(self) -> int:
        return len(self._events)

    def _drop_oldest(self) -> None:
        old_seq, _, old_size, _ = self._events.popleft()
        self.bytes -= old_size
        self.dropped_through = max(self.dropped_through, old_seq)

    def append(self, event: dict, now: Optional[float] = None) -> None:
        """Keep ``event`` (events without an integer ``server_event_seq`` are not journaled)."""
        seq = event.get("server_event_seq")
        if not isinstance(seq, int):
            return
        now = time.monotonic() if now is None else now
        size = _event_bytes(event)
        self._events.append((seq, event, size, now))
        self.bytes += size
        self.last_seq = max(self.last_seq, seq)
        while self._events and (len(self._events) > self.max_events or self.bytes > self.max_bytes):
            self._drop_oldest()
        self.trim(now)

    def mark_sent(self, seq: int) -> None:
        """Every event through ``seq`` has been written to a socket."""
        self.sent_through = max(self.sent_through, int(seq))

    def ack(self, seq: Any, now: Optional[float] = None) -> int:
        """The client received every event through ``seq`` (``session.event_ack``): drop them.
        An ack beyond what was written is clamped to it; a non-integer is ignored. Returns the
        number of events dropped."""
        if isinstance(seq, bool) or not isinstance(seq, int):
            return 0
        self.acked_through = max(self.acked_through, min(seq, self.sent_through))
        return self.trim(now)

    def trim(self, now: Optional[float] = None) -> int:
        """Drop acknowledged events and sent events older than ``keep_sent_s``; returns how many."""
        now = time.monotonic() if now is None else now
        n = 0
        while self._events:
            seq, _, _, t = self._events[0]
            if seq <= self.acked_through or (self.keep_sent_s is not None and seq <= self.sent_through
                                             and now - t > self.keep_sent_s):
                self._drop_oldest()
                n += 1
            else:
                break
        return n

    def clear(self) -> None:
        """Drop every kept event (the session is over); later appends are kept as before."""
        if self._events:
            self.dropped_through = max(self.dropped_through, self._events[-1][0])
        self._events.clear()
        self.bytes = 0

    def since(self, seq: int) -> list[dict]:
        """Every kept event with ``server_event_seq > seq``, in order.

        Raises:
            JournalOverflow: an event after ``seq`` was already dropped.
        """
        if seq < self.dropped_through:
            raise JournalOverflow(f"events {seq + 1}..{self.dropped_through} were dropped from the journal "
                                  f"({self.max_events} events / {self.max_bytes} bytes kept; events acknowledged "
                                  f"or written more than {self.keep_sent_s} s ago are dropped)")
        return [ev for s, ev, _, _ in self._events if s > seq]


def principal_of(key: Optional[str]) -> Optional[str]:
    """The principal a session is bound to: the SHA-256 of its API key (None when auth is off)."""
    return hashlib.sha256(key.encode()).hexdigest() if key else None


def new_token() -> str:
    """A fresh resume token: 32 URL-safe characters (192 random bits)."""
    return secrets.token_urlsafe(24)


def parse_resume(text: str) -> Optional[dict]:
    """The ``session.resume`` event of a text frame, or None when the frame is something else."""
    if '"session.resume"' not in text:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("type") != "session.resume":
        return None
    return data


def check_resume_fields(ev: dict) -> tuple[str, str, int]:
    """``(session_id, resume_token, last_server_event_seq)`` of a ``session.resume``.

    Raises ResumeRefused(``bad_event``) for missing or mistyped fields."""
    sid, token, seq = ev.get("session_id"), ev.get("resume_token"), ev.get("last_server_event_seq", 0)
    if not isinstance(sid, str) or not sid:
        raise ResumeRefused(ErrorCode.BAD_EVENT, "session.resume needs a string session_id")
    if not isinstance(token, str) or not token:
        raise ResumeRefused(ErrorCode.RESUME_UNAUTHORIZED, "session.resume needs the resume_token of the session "
                                                           "(sent with session.created and each session.resumed)")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ResumeRefused(ErrorCode.BAD_EVENT, "last_server_event_seq must be an integer >= 0")
    return sid, token, seq


class ResumeRegistry:
    """The resumable sessions of one replica, and tombstones of those that ended while parked.

    Args:
        window_s: how long a dropped session waits for a resume (seconds).
        journal_events / journal_bytes / keep_sent_s: bounds of each session's :class:`ReplayJournal`.
    """

    def __init__(self, window_s: float, journal_events: int, journal_bytes: int,
                 keep_sent_s: Optional[float] = None) -> None:
        self.window_s = float(window_s)
        self.journal_events = int(journal_events)
        self.journal_bytes = int(journal_bytes)
        self.keep_sent_s = keep_sent_s
        self._live: dict[str, Any] = {}  # session_id -> RealtimeConnection
        self._tombstones: "OrderedDict[str, tuple[str, Optional[str], float, str]]" = OrderedDict()
        self.resumes = 0
        self.refused: dict[str, int] = {}

    def new_journal(self) -> ReplayJournal:
        return ReplayJournal(self.journal_events, self.journal_bytes, self.keep_sent_s)

    @property
    def journal_bytes_total(self) -> int:
        """Bytes held by every live session's journal (``/health``'s ``resume_journal_bytes``)."""
        return sum(c.journal.bytes for c in self._live.values() if getattr(c, "journal", None) is not None)

    # -- membership ------------------------------------------------------------------------------
    def add(self, conn) -> None:
        self._live[conn.session.session_id] = conn

    def remove(self, conn) -> None:
        if self._live.get(conn.session.session_id) is conn:
            del self._live[conn.session.session_id]

    def bury(self, conn, code: str, message: str) -> None:
        """``conn``'s session ended while parked: later resumes of it get ``code``."""
        self._tombstones[conn.session.session_id] = (code, conn.principal, time.monotonic() + self.window_s, message)
        while len(self._tombstones) > _TOMBSTONE_KEEP:
            self._tombstones.popitem(last=False)

    @property
    def parked(self) -> int:
        """Sessions now parked (their connection dropped, waiting for a resume)."""
        return sum(1 for c in self._live.values() if c.parked)

    def has_parked(self, principal: Optional[str]) -> bool:
        """Whether a session of ``principal`` is parked (a resume may then come in over capacity)."""
        return any(c.parked and c.principal == principal for c in self._live.values())

    # -- the resume itself -------------------------------------------------------------------------
    def find(self, session_id: str, token: str, principal: Optional[str]):
        """The connection a ``session.resume`` names, checked. Raises :class:`ResumeRefused`."""
        conn = self._live.get(session_id)
        if conn is None:
            tomb = self._tombstones.get(session_id)
            if tomb is not None and tomb[2] >= time.monotonic() and tomb[1] == principal:
                code, _, _, message = tomb
                raise ResumeRefused(code, message, CloseCode.INTERNAL_ERROR if code == ErrorCode.RESUME_JOURNAL_OVERFLOW
                                    else CloseCode.POLICY_VIOLATION)
            raise ResumeRefused(ErrorCode.RESUME_NOT_FOUND, f"no resumable session {session_id[:64]!r} on this server")
        if conn.principal != principal:  # another API key: do not confirm that the session exists
            raise ResumeRefused(ErrorCode.RESUME_NOT_FOUND, f"no resumable session {session_id[:64]!r} on this server")
        if not conn.check_token(token):
            raise ResumeRefused(ErrorCode.RESUME_UNAUTHORIZED, "the resume token does not match (tokens are rotated "
                                                               "by each session.resumed)")
        return conn

    def count_refusal(self, code: str) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1


def token_matches(token: str, digest: str) -> bool:
    """Constant-time check of ``token`` against the stored SHA-256 ``digest``."""
    return hmac.compare_digest(hashlib.sha256(token.encode()).hexdigest(), digest)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
