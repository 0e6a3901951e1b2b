"""The one module of duplexkit's exception hierarchy and of the docs/protocol.md §9 error codes.

Every exception duplexkit raises derives from :class:`DuplexkitError`, which carries a ``code``
(a docs/protocol.md §9 code string such as ``"bad_audio"``; a few client-side conditions that have no
wire code use their own names, e.g. ``"timeout"``) and a ``message`` that says what was expected.
Classes keep their historical standard-library bases as well (``AudioFormatError`` is still a
``ValueError``, ``DuplexTimeout`` a ``TimeoutError``, ...), so ``except ValueError`` keeps working.

The old locations re-export these names (``duplexkit.audio.codecs.AudioFormatError``,
``duplexkit.protocol.errors.ProtocolError``, ``duplexkit.engine.runtime.EngineInputError``,
``duplexkit.clients.base.DuplexError``, ...). This module imports nothing from duplexkit, so any
layer may import it without a cycle.

Hierarchy::

    DuplexkitError(Exception)
    ├── AudioFormatError(ValueError)        bad_audio | unsupported_audio_format
    │   └── AudioTooLongError               bad_audio (readable audio over a length limit)
    ├── ProtocolError                       any ErrorCode (a rejected client event)
    │   └── TransitionError                 response_already_active | response_not_active
    ├── EngineInputError(ValueError)        server_error (a command the engine cannot run)
    ├── InjectedFault(RuntimeError)         server_error (test fault hook of a stage worker)
    ├── LayoutError(ValueError)             server_error (a bad engine layout file)
    │   └── LayoutNotSupportedError
    ├── DeviceError(RuntimeError)           server_error (sounddevice/PortAudio)
    ├── ConformanceError(AssertionError)    server_error (a §12 invariant violated by a server)
    ├── DuplexError                         the server's error code (an ``error`` event)
    │   ├── DuplexConnectionError(ConnectionError)   connection_closed | unauthorized | ...
    │   └── DuplexTimeout(TimeoutError)               timeout
    ├── ToolError                           tool_error (``duplexkit.agent``: function tools)
    │   ├── ToolDefinitionError(TypeError)  invalid_tools (a function that cannot be a tool)
    │   ├── ToolArgumentsError(ValueError)  tool_arguments_invalid (bad JSON or arguments)
    │   ├── ToolTimeoutError(TimeoutError)  tool_timeout (a call ran past its ``timeout_s``)
    │   └── ToolOutputError(TypeError)      tool_output_invalid (a result that is not JSON)
    └── OptionalDependencyError(ImportError)  missing_dependency (an extra is not installed)

The model port's errors derive from :class:`DuplexkitError` where they are defined (they belong to
their modules): ``CheckpointError``, ``ConfigError``, ``TokenizerError``, ``ChatInputError``,
``AudioInputError``, ``ImageInputError``, ``TalkerError``, ``ContextFullError``, ``QuantizationError`` and the
``Code2WavError`` family in ``duplexkit.models.minicpmo45``; ``ChatRequestError`` in the server.
"""

from __future__ import annotations

import traceback
from enum import Enum
from typing import Optional

__all__ = [
    "ErrorCode",
    "ERROR_TYPES",
    "ERROR_CODE_NAMINGS",
    "OPENAI_ERROR_CODES",
    "OPENAI_ERROR_CODES_BY_EVENT",
    "BINARY_FRAME",
    "wire_error_code",
    "canonical_error_code",
    "DuplexkitError",
    "AudioFormatError",
    "AudioTooLongError",
    "ProtocolError",
    "TransitionError",
    "EngineInputError",
    "InjectedFault",
    "EngineProcessError",
    "LayoutError",
    "LayoutNotSupportedError",
    "DeviceError",
    "ConformanceError",
    "DuplexError",
    "DuplexConnectionError",
    "DuplexTimeout",
    "ToolError",
    "ToolDefinitionError",
    "ToolArgumentsError",
    "ToolTimeoutError",
    "ToolOutputError",
    "OptionalDependencyError",
    "RefAudioLengthError",
    "detach_traceback",
]


class ErrorCode(str, Enum):
    """Every error code of docs/protocol.md §9 (values are the wire strings).

    ``input_rate_mismatch`` (duplexkit extension, docs/protocol.md §6.1) is a warning, not a rejection: sent at
    most once per declared input format when continuous input arrives far slower than its declared
    rate (``duplexkit.audio.arrival``); the audio is still used and nothing else changes.
    """

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
    INPUT_RATE_MISMATCH = "input_rate_mismatch"
    UNAUTHORIZED = "unauthorized"
    MODEL_NOT_FOUND = "model_not_found"
    SERVER_ERROR = "server_error"
    RESUME_NOT_FOUND = "resume_not_found"
    RESUME_EXPIRED = "resume_expired"
    RESUME_UNAUTHORIZED = "resume_unauthorized"
    RESUME_JOURNAL_OVERFLOW = "resume_journal_overflow"
    INVALID_TOOLS = "invalid_tools"
    CALL_NOT_FOUND = "call_not_found"
    CALL_ALREADY_ANSWERED = "call_already_answered"
    CALL_CANCELLED = "call_cancelled"


#: error code -> OpenAI error ``type`` (docs/protocol.md §9, column "Type").
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
    ErrorCode.INPUT_RATE_MISMATCH: "invalid_request_error",
    ErrorCode.UNAUTHORIZED: "invalid_request_error",
    ErrorCode.MODEL_NOT_FOUND: "invalid_request_error",
    ErrorCode.RESUME_NOT_FOUND: "invalid_request_error",
    ErrorCode.RESUME_EXPIRED: "invalid_request_error",
    ErrorCode.RESUME_UNAUTHORIZED: "invalid_request_error",
    ErrorCode.RESUME_JOURNAL_OVERFLOW: "server_error",
    ErrorCode.INVALID_TOOLS: "invalid_request_error",
    ErrorCode.CALL_NOT_FOUND: "invalid_request_error",
    ErrorCode.CALL_ALREADY_ANSWERED: "invalid_request_error",
    ErrorCode.CALL_CANCELLED: "invalid_request_error",
    ErrorCode.SERVER_ERROR: "server_error",
}


#: The two namings of error codes on the wire (docs/protocol.md §9, "Which code is sent"):
#: ``duplexkit`` sends :class:`ErrorCode` values as they are; ``openai`` sends OpenAI's Realtime
#: code for each condition OpenAI also has (:data:`OPENAI_ERROR_CODES`), so unmodified OpenAI
#: clients (Pipecat, LiveKit, the Agents SDK) recognise the benign races they already handle.
ERROR_CODE_NAMINGS = ("duplexkit", "openai")

#: Pseudo client-event type of a binary WebSocket frame (docs/protocol.md §1.3), for
#: :data:`OPENAI_ERROR_CODES_BY_EVENT`.
BINARY_FRAME = "<binary frame>"

#: duplexkit code -> the code OpenAI's Realtime API sends for the same condition. The one table of
#: the ``openai`` naming (with :data:`OPENAI_ERROR_CODES_BY_EVENT`); codes not listed have no OpenAI
#: counterpart (duplexkit extensions, limits OpenAI does not have) and are sent as they are. Sources:
#: OpenAI's Realtime API as observed on the wire (``invalid_value`` with ``param: "type"`` for an
#: unknown event type, ``invalid_event`` for a binary frame) and the codes
#: OpenAI clients match on: Pipecat's ``OpenAIRealtimeLLMService`` ignores
#: ``response_cancel_not_active`` and ``conversation_already_has_active_response`` and ends its
#: receive loop on any other error; it matches ``item_retrieve_invalid_item_id`` to fail a pending
#: retrieve. ``openai.types.realtime.RealtimeError.code`` is a free string (no enum to check against).
OPENAI_ERROR_CODES: dict[ErrorCode, str] = {
    ErrorCode.UNKNOWN_EVENT: "invalid_value",
    ErrorCode.BAD_EVENT: "invalid_value",
    ErrorCode.UNSUPPORTED_AUDIO_FORMAT: "invalid_value",
    ErrorCode.UNSUPPORTED_TURN_DETECTION: "invalid_value",
    ErrorCode.INPUT_AUDIO_BUFFER_EMPTY: "input_audio_buffer_commit_empty",
    ErrorCode.RESPONSE_ALREADY_ACTIVE: "conversation_already_has_active_response",
    ErrorCode.RESPONSE_NOT_ACTIVE: "response_cancel_not_active",
    # the realtime handshake's bad key (an ``error`` event, then the close); LiveKit's realtime
    # plugin stops reconnecting on ``invalid_api_key`` and would retry ``unauthorized`` forever
    ErrorCode.UNAUTHORIZED: "invalid_api_key",
}

#: (duplexkit code, client event type) -> OpenAI code, where OpenAI's code depends on the event
#: that was refused; looked up before :data:`OPENAI_ERROR_CODES`.
OPENAI_ERROR_CODES_BY_EVENT: dict[tuple[ErrorCode, str], str] = {
    (ErrorCode.ITEM_NOT_FOUND, "conversation.item.retrieve"): "item_retrieve_invalid_item_id",
    (ErrorCode.ITEM_NOT_FOUND, "conversation.item.delete"): "item_delete_invalid_item_id",
    (ErrorCode.ITEM_NOT_FOUND, "conversation.item.truncate"): "item_truncate_invalid_item_id",
    (ErrorCode.BAD_EVENT, BINARY_FRAME): "invalid_event",
}


def wire_error_code(code: "ErrorCode | str", naming: str = "duplexkit", event_type: Optional[str] = None) -> str:
    """The code string to send for ``code`` in ``naming`` (one of :data:`ERROR_CODE_NAMINGS`).

    Args:
        code: an :class:`ErrorCode` (or its value); other strings are returned unchanged.
        naming: ``"duplexkit"`` (the value itself) or ``"openai"`` (OpenAI's code where one exists).
        event_type: the refused client event's ``type`` (or :data:`BINARY_FRAME`), for the codes
            OpenAI names per event (``item_not_found`` -> ``item_retrieve_invalid_item_id``, ...).

    Raises:
        ValueError: ``naming`` is not one of :data:`ERROR_CODE_NAMINGS`.
    """
    if naming not in ERROR_CODE_NAMINGS:
        raise ValueError(f"naming must be one of {ERROR_CODE_NAMINGS}, got {naming!r}")
    try:
        ec = ErrorCode(code)
    except ValueError:
        return str(code)
    if naming == "duplexkit":
        return ec.value
    if event_type is not None and (ec, event_type) in OPENAI_ERROR_CODES_BY_EVENT:
        return OPENAI_ERROR_CODES_BY_EVENT[(ec, event_type)]
    return OPENAI_ERROR_CODES.get(ec, ec.value)


def _reverse_openai_codes() -> dict[str, str]:
    out: dict[str, set] = {}
    for ec, oc in OPENAI_ERROR_CODES.items():
        out.setdefault(oc, set()).add(ec.value)
    for (ec, _), oc in OPENAI_ERROR_CODES_BY_EVENT.items():
        out.setdefault(oc, set()).add(ec.value)
    return {oc: next(iter(v)) for oc, v in out.items() if len(v) == 1}  # only unambiguous names


_FROM_OPENAI = _reverse_openai_codes()


def canonical_error_code(code: str) -> str:
    """duplexkit's name for a code received on the wire: an OpenAI code that stands for exactly one
    :class:`ErrorCode` becomes that code's value (``response_cancel_not_active`` ->
    ``response_not_active``, ``item_delete_invalid_item_id`` -> ``item_not_found``); anything else
    (duplexkit codes, ``invalid_value``, which several codes share, unknown codes) is returned as is.
    The duplexkit clients use it, so ``DuplexError.code`` does not depend on the server's naming."""
    return _FROM_OPENAI.get(code, code)


# ------------------------------------------------------------------------------------------ base


class DuplexkitError(Exception):
    """Base of every duplexkit exception.

    Attributes:
        code: the docs/protocol.md §9 error code (``str``; an :class:`ErrorCode` for protocol errors).
            Subclasses without a more specific code use :attr:`default_code` (``"server_error"``).
        message: human-readable text saying what was expected and what was got.
    """

    default_code: str = ErrorCode.SERVER_ERROR.value

    def __init__(self, message: str = "", *args: object, code: Optional[str] = None) -> None:
        # ``args`` go to the standard-library base (e.g. OSError-style bases); normally empty.
        if not hasattr(self, "code") or code is not None:
            self.code = code if code is not None else self.default_code
        if not hasattr(self, "message"):
            self.message = message
        super().__init__(message, *args)


# ------------------------------------------------------------------------------------------ audio

_AUDIO_CODES = ("bad_audio", "unsupported_audio_format")


class AudioFormatError(DuplexkitError, ValueError):
    """Bad or unsupported audio input (``duplexkit.audio``).

    ``code`` is the docs/protocol.md §9 error code: ``"bad_audio"`` (undecodable content: bad base64,
    non-finite floats, a zero-length append, a broken WAV) or ``"unsupported_audio_format"`` (a
    format/rate/channel count duplexkit does not accept, docs/protocol.md §6.1). ``str(err)`` is the
    message, which says what was expected.

    Raises:
        TypeError: on construction with any other ``code``.
    """

    def __init__(self, code: str, message: Optional[str] = None) -> None:
        code = code.value if isinstance(code, ErrorCode) else code
        if code not in _AUDIO_CODES:
            raise TypeError(f"AudioFormatError code must be one of {_AUDIO_CODES}, got {code!r}")
        self.code = code
        self.message = message or code
        super().__init__(self.message)


class AudioTooLongError(AudioFormatError):
    """Readable audio longer than the caller's limit (:func:`duplexkit.audio.read_wav`'s ``max_s``).

    Its code stays ``"bad_audio"`` (docs/protocol.md §9 has no separate code for it); the message
    says the audio is too long rather than undecodable: ``audio too long: 300.5 s, at most 60 s``.

    Attributes:
        duration_s: the audio's length in s from its header, or None when the header does not
            say (then it is known only to be over ``max_s``).
        max_s: the limit in s.
    """

    def __init__(self, duration_s: Optional[float], max_s: float) -> None:
        self.duration_s = None if duration_s is None else float(duration_s)
        self.max_s = float(max_s)
        got = f"{self.duration_s:.1f} s" if self.duration_s is not None else f"over {self.max_s:g} s"
        super().__init__("bad_audio", f"audio too long: {got}, at most {self.max_s:g} s")


# ------------------------------------------------------------------------------------------ protocol


class ProtocolError(DuplexkitError):
    """A rejected client event (or a malformed server event seen by a client).

    Every rejected client event produces exactly one ``error`` server event built from a
    ProtocolError; the session stays alive (docs/protocol.md §9 "Principle").

    Attributes:
        code: the :class:`ErrorCode` (a ``str`` enum: ``err.code == "bad_audio"`` works).
        message: human-readable text.
        param: dotted path of the offending field (e.g. ``session.audio.input.format``) or None.
        event_id: the offending client event's ``event_id`` (echoed as ``error.event_id``) or None.
        event_type: the refused client event's ``type`` (or :data:`BINARY_FRAME`) when known; set
            by the Session, it picks OpenAI's per-event codes (:func:`wire_error_code`).
    Raises:
        ValueError: on construction with a code that is not in docs/protocol.md §9.
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
        self.event_type: Optional[str] = None
        super().__init__(f"{self.code.value}: {message}")

    @property
    def type(self) -> str:
        """The OpenAI error type of :attr:`code` (docs/protocol.md §9)."""
        return ERROR_TYPES[self.code]

    def to_error_dict(self, naming: str = "duplexkit") -> dict:
        """The ``error{type, code, message, param?, event_id?}`` object of docs/protocol.md §5.3,
        its ``code`` in ``naming`` (:func:`wire_error_code`; ``"duplexkit"`` or ``"openai"``)."""
        d = {"type": self.type, "code": wire_error_code(self.code, naming, self.event_type), "message": self.message}
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


# ------------------------------------------------------------------------------------------ engine


class EngineInputError(DuplexkitError, ValueError):
    """An engine command with invalid content (wrong unit length, non-finite audio, unknown
    command, a command for another stream). Code ``server_error``: the Session never sends one,
    so reaching it is an internal failure (docs/protocol.md §9)."""

    def __init__(self, message: str, code: str = "server_error") -> None:
        super().__init__(message, code=code)


class EngineLoadError(DuplexkitError):
    """The model or engine failed to load after the pre-load checks passed (``CheckpointError``,
    out of memory, a missing package such as torch, a bad scripted-engine option); raised by
    :func:`duplexkit.engine.load_engine` with the loader's text. The CLI exits with status 4."""


class EngineProcessError(DuplexkitError, RuntimeError):
    """The engine process (:class:`duplexkit.engine.process.EngineProcess`) is gone: it died (killed,
    crashed, out of memory) or was closed, so a call that needs it cannot be served (code
    ``server_error``). Raised by ``open_stream``, ``generate`` and ``generate_stream``; open streams get
    a fatal :class:`~duplexkit.engine.api.EngineFailure` instead."""


class EngineCapacityError(DuplexkitError, RuntimeError):
    """Every stream slot of the engine's memory plan (``DuplexEngine.from_pretrained(memory_gib=...)``,
    :mod:`duplexkit.engine.memory_plan`) is taken: ``open_stream`` refuses one more (code
    ``session_capacity_exhausted``). The server never gets here: its ``max_sessions`` is capped at the
    planned streams and refuses first."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=ErrorCode.SESSION_CAPACITY_EXHAUSTED.value)


class InjectedFault(DuplexkitError, RuntimeError):
    """The failure a stage worker produces for a stream whose test fault plan
    (:func:`duplexkit.testing.inject_fault`, :class:`duplexkit.testing.faults.StageFaults`) names
    that stage (code ``server_error``)."""


class LayoutError(DuplexkitError, ValueError):
    """A layout file is missing, unreadable or invalid. ``.source`` names the file or name
    (code ``server_error``: a server configuration problem, never a client's)."""

    def __init__(self, message: str, source: str = "") -> None:
        super().__init__(f"{source}: {message}" if source else message)
        self.source = source


class LayoutNotSupportedError(LayoutError):
    """A valid layout that this engine cannot build (e.g. thinker tensor parallelism > 1, or a
    CUDA device on a machine without one)."""


# ------------------------------------------------------------------------------------------ devices


class DeviceError(DuplexkitError, RuntimeError):
    """sounddevice/PortAudio is missing, or a device cannot be found or opened (code ``server_error``)."""


# ------------------------------------------------------------------------------------------ conformance


class ConformanceError(DuplexkitError, AssertionError):
    """A docs/protocol.md §12 invariant was violated by a server's event stream (the message names it
    and the event). Still an ``AssertionError``, so test runners report it as a failure."""


# ------------------------------------------------------------------------------------------ clients


class DuplexError(DuplexkitError):
    """A server ``error`` answering one of this client's events (docs/protocol.md §9).

    Attributes: ``code`` (§9 code: an OpenAI code that stands for one duplexkit code is read as that
    code, :func:`canonical_error_code`), ``wire_code`` (the code as the server sent it), ``message``,
    ``param``, ``event_id`` (the client's), ``event`` (raw).
    """

    def __init__(self, code: str, message: str = "", param: Optional[str] = None,
                 event_id: Optional[str] = None, event: Optional[dict] = None) -> None:
        self.wire_code = code
        code = canonical_error_code(code)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.event = event or {}
        super().__init__(f"{code}: {message}" + (f" (param {param})" if param else ""))

    @classmethod
    def from_event(cls, ev: dict) -> "DuplexError":
        """Build one from a server ``error`` event dict (``error{code, type, message, param, event_id}``)."""
        err = ev.get("error") or {}
        return cls(str(err.get("code") or err.get("type") or "server_error"), str(err.get("message") or ""),
                   err.get("param"), err.get("event_id"), ev)


class DuplexConnectionError(DuplexError, ConnectionError):
    """The connection is gone (transport loss, close frame, or a handshake rejection).

    ``close_code`` is the WebSocket close code when known (1008 unauthorized, 1013 capacity, ...).
    """

    def __init__(self, message: str, *, code: str = "connection_closed", close_code: Optional[int] = None,
                 event: Optional[dict] = None) -> None:
        super().__init__(code, message, event=event)
        self.close_code = close_code


class DuplexTimeout(DuplexError, TimeoutError):
    """A call waited longer than ``request_timeout_s`` for its answer."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)


# ------------------------------------------------------------------------------------------ agent (tools)


class ToolError(DuplexkitError):
    """A function tool could not be defined or run (``duplexkit.agent``; code ``tool_error``).

    Errors raised by a tool's own function are not wrapped: they propagate from
    ``FunctionTool.invoke`` as they are, and the clients' tool runner turns any of them into an error
    output (``{"error": "..."}``) for the model.

    Attributes:
        tool: the tool's name, or ``""`` when unknown.
    """

    default_code = "tool_error"

    def __init__(self, message: str, *, tool: str = "", code: Optional[str] = None) -> None:
        self.tool = tool
        super().__init__(message, code=code)


class ToolDefinitionError(ToolError, TypeError):
    """A callable that cannot become a function tool: ``*args`` / ``**kwargs`` parameters, a name
    that is not 1-64 characters of ``[A-Za-z0-9_-]``, a type pydantic cannot describe as JSON Schema,
    or a bad option (``late_result``, ``timeout_s``). Code ``invalid_tools``."""

    default_code = "invalid_tools"


class ToolArgumentsError(ToolError, ValueError):
    """A call's arguments are not JSON, or do not validate against the tool's parameters
    (code ``tool_arguments_invalid``).

    Attributes:
        errors: pydantic's error list (``ValidationError.errors()``: dicts with ``loc``, ``msg``,
            ``type``), empty when the text was not JSON at all.
    """

    default_code = "tool_arguments_invalid"

    def __init__(self, message: str, *, tool: str = "", errors: Optional[list] = None) -> None:
        self.errors = list(errors or [])
        super().__init__(message, tool=tool)


class ToolTimeoutError(ToolError, TimeoutError):
    """A tool call ran longer than its ``timeout_s`` (code ``tool_timeout``).

    Attributes:
        timeout_s: the limit in s.
    """

    default_code = "tool_timeout"

    def __init__(self, tool: str, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        super().__init__(f"tool {tool!r} did not finish within {self.timeout_s:g} s", tool=tool)


class ToolOutputError(ToolError, TypeError):
    """A tool returned a value that cannot be encoded as JSON (code ``tool_output_invalid``)."""

    default_code = "tool_output_invalid"


class RefAudioLengthError(DuplexkitError, ValueError):
    """A reference voice clip shorter or longer than allowed (code ``ref_audio_invalid``,
    docs/protocol.md §8.2), raised by :func:`duplexkit.engine.api.reference_voice`.

    Attributes:
        duration_s: the clip's length in s (before the trim to whole 100 ms).
        min_s / max_s: the allowed range in s.
    """

    default_code = ErrorCode.REF_AUDIO_INVALID.value

    def __init__(self, duration_s: float, min_s: float, max_s: float) -> None:
        self.duration_s, self.min_s, self.max_s = float(duration_s), float(min_s), float(max_s)
        super().__init__(f"reference voice must last {self.min_s:g}..{self.max_s:g} s, got {self.duration_s:.2f} s")


class OptionalDependencyError(DuplexkitError, ImportError):
    """A feature needs a package of an optional extra that is not installed (code ``missing_dependency``).

    The message names the command that installs it, e.g. ``pip install 'duplexkit[transcribe]'``.

    Attributes:
        package: the missing import name (``"faster_whisper"``).
        extra: the duplexkit extra that provides it (``"transcribe"``).
    """

    default_code = "missing_dependency"

    def __init__(self, package: str, extra: str, feature: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(f"{feature} needs the package {package!r}, which is not installed: "
                         f"pip install 'duplexkit[{extra}]'")


def detach_traceback(exc: BaseException) -> BaseException:
    """Return ``exc`` with its traceback (and its causes' and contexts') replaced by a note.

    A stage function that catches an exception and hands it back in a result list makes a
    reference cycle: the traceback holds the catching frame (and every frame holds its caller),
    whose locals hold the list that holds the exception. Until Python's cyclic collector runs, the
    failed call's locals stay alive with it, and on a GPU those are tensors: after an
    out-of-memory error in the vocoder, the very memory the next call needs (measured:
    68 GiB of the Code2Wav warm-up kept until ``gc.collect()``, benchmarks/results/2026-12-02-cudnn-per-thread-h200.md).
    The frames are dropped at once; the note (``raised at:`` plus the formatted frames) keeps the
    place for logs, since ``traceback.format_exception`` prints notes.
    """
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        if tb is not None:
            note = "raised at:\n" + "".join(traceback.format_tb(tb)).rstrip()
            if hasattr(e, "add_note"):
                e.add_note(note)
            else:  # Python 3.10: no add_note (and format_exception does not print notes there)
                e.__notes__ = [*getattr(e, "__notes__", []), note]
            e.__traceback__ = None
        stack.extend((e.__cause__, e.__context__))
    return exc
