"""HTTP error bodies shared by the server's routes (docs/protocol.md §10.1).

Its own module so that the route modules (:mod:`.chat`, :mod:`.metrics`, :mod:`.webrtc`) and the app
factory (:mod:`.app`) all import it downwards: the factory imports the routes, never the other way.
"""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

from duplexkit.errors import ERROR_TYPES, DuplexkitError, ErrorCode

__all__ = ["ServerClosing", "openai_error"]


class ServerClosing(DuplexkitError):
    """A request cut short because the server is shutting down (``ServerState.until_closing`` in
    :mod:`.app`)."""

    default_code = ErrorCode.SESSION_CAPACITY_EXHAUSTED.value  # retry: another replica takes it


def openai_error(status: int, message: str, code: str, *, type_: Optional[str] = None,
                 param: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    """An OpenAI error body ``{error{message, type, param, code}}`` (docs/protocol.md §10.1).

    ``type_`` defaults by status: 401 -> ``invalid_request_error``, 503 -> ``rate_limit_error``,
    500 -> ``server_error``, anything else ``invalid_request_error``."""
    if type_ is None:
        type_ = {401: ERROR_TYPES[ErrorCode.UNAUTHORIZED], 503: ERROR_TYPES[ErrorCode.SESSION_CAPACITY_EXHAUSTED],
                 500: ERROR_TYPES[ErrorCode.SERVER_ERROR]}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)
