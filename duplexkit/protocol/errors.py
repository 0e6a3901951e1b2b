"""The one table of error codes (PROTOCOL.md §9) and the typed protocol error.

Every rejected client event produces exactly one ``error`` server event built from a
:class:`ProtocolError`; the session stays alive (PROTOCOL.md §9 "Principle").
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

__all__ = ["ErrorCode", "ERROR_TYPES", "ProtocolError", "TransitionError"]


class ErrorCode(str, Enum):
    """Every error code of PROTOCOL.md §9 (values are the wire strings)."""

    INVALID_JSON = "invalid_json"
    UNKNOWN_EVENT = "unknown_event"
    BAD_EVENT = "bad_event"
    BAD_AUDIO = "bad_audio"
    EVENT_TOO_LARGE = "event_too_large"
    UNSUPPORTED_AUDIO_FORMAT = "unsupported_audio_format"
    UNSUPPORTED_TURN_DETECTION = "unsupported_turn_detection"
    INPUT_AUDIO_BUFFER_EMPTY = "input_audio_buffer_empty"
    RESPONSE_ALREADY_ACTIVE = "response_already_active"
    RESPONSE_NOT_ACTIVE = "response_not_active"
    ITEM_NOT_FOUND = "item_not_found"
    INVALID_TRUNCATE = "invalid_truncate"
    REF_AUDIO_INVALID = "ref_audio_invalid"
    REF_AUDIO_UPDATE_UNSUPPORTED = "ref_audio_update_unsupported"
    SESSION_CAPACITY_EXHAUSTED = "session_capacity_exhausted"
    INPUT_BACKPRESSURE = "input_backpressure"
    UNAUTHORIZED = "unauthorized"
    SERVER_ERROR = "server_error"


#: error code -> OpenAI error ``type`` (PROTOCOL.md §9, column "Type").
ERROR_TYPES: dict[ErrorCode, str] = {
    ErrorCode.INVALID_JSON: "invalid_request_error",
    ErrorCode.UNKNOWN_EVENT: "invalid_request_error",
    ErrorCode.BAD_EVENT: "invalid_request_error",
    ErrorCode.BAD_AUDIO: "invalid_request_error",
    ErrorCode.EVENT_TOO_LARGE: "invalid_request_error",
    ErrorCode.UNSUPPORTED_AUDIO_FORMAT: "invalid_request_error",
    ErrorCode.UNSUPPORTED_TURN_DETECTION: "invalid_request_error",
    ErrorCode.INPUT_AUDIO_BUFFER_EMPTY: "invalid_request_error",
    ErrorCode.RESPONSE_ALREADY_ACTIVE: "invalid_request_error",
    ErrorCode.RESPONSE_NOT_ACTIVE: "invalid_request_error",
    ErrorCode.ITEM_NOT_FOUND: "invalid_request_error",
    ErrorCode.INVALID_TRUNCATE: "invalid_request_error",
    ErrorCode.REF_AUDIO_INVALID: "invalid_request_error",
    ErrorCode.REF_AUDIO_UPDATE_UNSUPPORTED: "invalid_request_error",
    ErrorCode.SESSION_CAPACITY_EXHAUSTED: "rate_limit_error",
    ErrorCode.INPUT_BACKPRESSURE: "rate_limit_error",
    ErrorCode.UNAUTHORIZED: "invalid_request_error",
    ErrorCode.SERVER_ERROR: "server_error",
}


class ProtocolError(Exception):
    """A rejected client event (or a malformed server event seen by a client).

    Attributes:
        code: the :class:`ErrorCode`.
        message: human-readable text.
        param: dotted path of the offending field (e.g. ``session.audio.input.format``) or None.
        event_id: the offending client event's ``event_id`` (echoed as ``error.event_id``) or None.
    """

    def __init__(
        self,
        code: ErrorCode | str,
        message: str,
        param: Optional[str] = None,
        event_id: Optional[str] = None,
    ) -> None:
        self.code = ErrorCode(code)
        self.message = message
        self.param = param
        self.event_id = event_id
        super().__init__(f"{self.code.value}: {message}")

    @property
    def type(self) -> str:
        """The OpenAI error type of :attr:`code` (PROTOCOL.md §9)."""
        return ERROR_TYPES[self.code]

    def to_error_dict(self) -> dict:
        """The ``error{type, code, message, param?, event_id?}`` object of PROTOCOL.md §5.3."""
        d = {"type": self.type, "code": self.code.value, "message": self.message}
        if self.param is not None:
            d["param"] = self.param
        if self.event_id is not None:
            d["event_id"] = self.event_id
        return d


class TransitionError(ProtocolError):
    """A protocol violation detected by the Session's transition table.

    Names the session ``state`` and the ``event`` (transition-table event name) that was illegal in it.
    """

    def __init__(self, code: ErrorCode | str, state: str, event: str, message: str = "", **kw) -> None:
        self.state = state
        self.event = event
        super().__init__(code, message or f"{event} is not allowed in state {state!r}", **kw)
