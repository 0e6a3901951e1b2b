"""Server -> client events (docs/protocol.md §5): strict outbound models, tolerant client-side parsing.

Outbound: the Session builds every event from these models and serialises it with
:meth:`ServerEvent.to_wire` (= ``model_dump(mode="json", exclude_none=True)`` after checking that no
undeclared key slipped in, recursively). Only OpenAI GA names are emitted (docs/protocol.md §2).
duplexkit additions (``epoch``, ``trigger``, ``audio_duration_ms``, ``committed_ms`` on response
objects, ``metadata{…}`` on deltas and extension events) are declared fields here and ride as
*extra keys* next to the fields OpenAI types (checked against ``openai.types.realtime`` by
``tests/conformance``).

Inbound (clients): :func:`parse_server_event` accepts GA and beta/vLLM-Omni names (docs/protocol.md
§2.1), keeps unknown keys (``model_extra``) and unknown enum values as plain strings, and surfaces
unknown event types as :class:`UnknownServerEvent` instead of raising.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, model_serializer

from .errors import ErrorCode, ProtocolError
from .vocabulary import BETA_TO_GA_EVENTS, EXTENSION_EVENT_TYPES

__all__ = [
    "ServerEvent", "ErrorInfo", "ContentPart", "Item", "Part", "StatusDetails", "Usage", "ResponseObject",
    "TextMark", "DeltaMetadata", "AudioFormatObject", "TurnDetectionObject", "AudioInputConfig",
    "AudioOutputConfig", "AudioConfig", "RefAudioInfo", "Capabilities", "SessionObject", "SessionCreated",
    "SessionUpdated", "SessionClosed", "SessionResumed", "SessionHeartbeatAck", "SessionWarning",
    "ErrorEvent", "SpeechStarted", "SpeechStopped", "InputAudioBufferCommitted", "InputAudioBufferCleared",
    "OutputAudioBufferCleared", "ConversationItemAdded", "ConversationItemDone", "ConversationItemRetrieved",
    "ConversationItemDeleted", "ConversationItemTruncated", "InputAudioTranscriptionCompleted",
    "InputAudioTranscriptionDelta", "InputAudioTranscriptionFailed", "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone", "TranscriptionObject", "ResponseCreated", "ResponseDone", "OutputItemAdded", "OutputItemDone", "ContentPartAdded",
    "ContentPartDone", "OutputAudioDelta", "OutputAudioDone", "OutputAudioTranscriptDelta",
    "OutputAudioTranscriptDone", "OutputTextDelta", "OutputTextDone", "ResponseSpeak", "ResponseListen",
    "UnknownServerEvent", "SERVER_EVENT_MODELS", "BETA_EVENT_ALIASES", "EXTENSION_EVENT_TYPES",
    "parse_server_event",
]


class _Out(BaseModel):
    """Base of every server-side model: unknown keys are kept (tolerant parse) and refused by
    :meth:`to_wire` (strict serialisation)."""

    model_config = ConfigDict(extra="allow")

    def _check_strict(self, path: str) -> None:
        if self.model_extra:
            raise ValueError(f"undeclared keys {sorted(self.model_extra)} in outbound {path or type(self).__name__}")
        for name in type(self).model_fields:
            v = getattr(self, name)
            if isinstance(v, _Out):
                v._check_strict(f"{path}.{name}")
            elif isinstance(v, list):
                for i, x in enumerate(v):
                    if isinstance(x, _Out):
                        x._check_strict(f"{path}.{name}[{i}]")

    def to_wire(self) -> dict:
        """JSON-ready dict (``exclude_none``); raises ValueError if an undeclared key is present."""
        self._check_strict("")
        return self.model_dump(mode="json", exclude_none=True)


# ------------------------------------------------------------------------------------------------
# nested objects
# ------------------------------------------------------------------------------------------------


class ErrorInfo(_Out):
    type: str
    code: Optional[str] = None
    message: str
    param: Optional[str] = None
    event_id: Optional[str] = None


class ContentPart(_Out):
    """One content part of an item: ``input_audio``/``input_text`` (user, system) or
    ``output_audio``/``output_text`` (assistant)."""

    type: str
    text: Optional[str] = None
    audio: Optional[str] = None
    transcript: Optional[str] = None


class Item(_Out):
    """A conversation item: ``message`` (``role``, ``content``), ``function_call`` (``call_id``,
    ``name``, ``arguments``: JSON text) or ``function_call_output`` (``call_id``, ``output``)."""

    id: str
    object: str = "realtime.item"
    type: str = "message"
    role: Optional[str] = None
    status: Optional[str] = "completed"
    content: Optional[List[ContentPart]] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Optional[str] = None


class Part(_Out):
    """``part`` of ``response.content_part.*``: ``{type:"audio", transcript}`` or ``{type:"text", text}``."""

    type: str
    text: Optional[str] = None
    transcript: Optional[str] = None
    audio: Optional[str] = None


class StatusError(_Out):
    type: Optional[str] = None
    code: Optional[str] = None
    message: Optional[str] = None


class StatusDetails(_Out):
    type: str
    reason: Optional[str] = None
    error: Optional[StatusError] = None


class Usage(_Out):
    total_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class ResponseObject(_Out):
    """``response`` of ``response.created``/``.done`` (docs/protocol.md §5.3). ``epoch``, ``trigger``,
    ``audio_duration_ms`` and ``committed_ms`` are duplexkit extra keys; ``metadata`` is the
    client's string map."""

    id: Optional[str] = None
    object: str = "realtime.response"
    status: str
    status_details: Optional[StatusDetails] = None
    output: Optional[List[Item]] = None
    output_modalities: Optional[List[str]] = None
    metadata: Optional[Dict[str, str]] = None
    usage: Optional[Usage] = None
    max_output_tokens: Optional[Union[int, str]] = None
    conversation_id: Optional[str] = None
    epoch: Optional[int] = None
    trigger: Optional[str] = None
    audio_duration_ms: Optional[int] = None
    committed_ms: Optional[int] = None


class TextMark(_Out):
    """The first ``text_chars`` code points of the transcript are spoken by ``audio_end_ms`` (§6.2)."""

    text_chars: int
    audio_end_ms: int


class DeltaMetadata(_Out):
    epoch: int
    audio_duration_ms: Optional[int] = None
    audio_text_marks: Optional[List[TextMark]] = None
    end_of_turn: Optional[bool] = None
    reason: Optional[str] = None
    decision: Optional[str] = None


class AudioFormatObject(_Out):
    """A GA audio format object. OpenAI types ``rate`` as 24000 only, so other rates and encodings
    ride in the extra keys ``sample_rate_hz`` and ``encoding`` (docs/protocol.md §2) and ``rate`` is only
    set when it is 24000. ``channels`` (extension) is set only for interleaved multi-channel input
    (downmixed to mono by the server)."""

    type: str = "audio/pcm"
    rate: Optional[int] = None
    sample_rate_hz: Optional[int] = None
    encoding: Optional[str] = None
    channels: Optional[int] = None


class TurnDetectionObject(_Out):
    type: str = "server_vad"
    threshold: Optional[float] = None
    prefix_padding_ms: Optional[int] = None
    silence_duration_ms: Optional[int] = None
    interrupt_response: Optional[bool] = None
    create_response: Optional[bool] = None


class TranscriptionObject(_Out):
    """``audio.input.transcription`` (GA) / ``input_audio_transcription`` (beta): the recogniser of
    the user's speech (docs/tools.md, "What the user said")."""

    model: str
    language: Optional[str] = None
    prompt: Optional[str] = None


class AudioInputConfig(_Out):
    format: Optional[AudioFormatObject] = None
    turn_detection: Optional[TurnDetectionObject] = None
    transcription: Optional[TranscriptionObject] = None

    @model_serializer(mode="wrap")
    def _keep_null_turn_detection(self, handler):  # turn_detection: null is meaningful
        d = handler(self)
        d.setdefault("turn_detection", None)
        return d


class AudioOutputConfig(_Out):
    format: Optional[AudioFormatObject] = None
    voice: Optional[str] = None


class AudioConfig(_Out):
    input: AudioInputConfig
    output: AudioOutputConfig


class RefAudioInfo(_Out):
    sha256: str
    duration_ms: int


class Capabilities(_Out):
    implementation_level: str = "model_native_duplex"
    chunk_period_ms: int = 1000
    supports_barge_in: bool = True
    supports_audio_truncate: bool = True
    supports_session_resume: bool = False
    extension_events: List[str] = []


class SessionObject(_Out):
    """The effective session (docs/protocol.md §5.1). Flat beta mirrors: ``modalities``,
    ``input_audio_format``, ``output_audio_format``, ``sample_rate_hz``, ``turn_detection``,
    ``max_response_output_tokens``; ``channels`` (extension) only for multi-channel input. ``instructions``, ``ref_audio`` and ``turn_detection`` are always
    present (``null`` when unset)."""

    type: str = "realtime"
    id: str
    object: str = "realtime.session"
    model: str
    instructions: Optional[str] = None
    output_modalities: List[str]
    modalities: List[str]
    voice: str
    audio: AudioConfig
    input_audio_format: str
    output_audio_format: str
    sample_rate_hz: int
    channels: Optional[int] = None
    turn_detection: Optional[TurnDetectionObject] = None
    temperature: float
    max_output_tokens: Union[int, str]
    max_response_output_tokens: Union[int, str]
    epoch: int
    ref_audio: Optional[RefAudioInfo] = None
    extra_body: Dict[str, Any]
    capabilities: Capabilities
    tools: List[Any] = []
    tool_choice: Union[str, Dict[str, Any]] = "auto"
    input_audio_transcription: Optional[TranscriptionObject] = None

    @model_serializer(mode="wrap")
    def _keep_nulls(self, handler):
        d = handler(self)
        for k in ("instructions", "ref_audio", "turn_detection"):
            d.setdefault(k, None)
        return d


# ------------------------------------------------------------------------------------------------
# events
# ------------------------------------------------------------------------------------------------


class ServerEvent(_Out):
    """Base of every server event: ``type``, ``event_id``, ``server_event_seq`` (docs/protocol.md §5)."""

    type: str
    event_id: str = ""
    server_event_seq: Optional[int] = None
    _raw_type: Optional[str] = PrivateAttr(default=None)

    @property
    def raw_type(self) -> str:
        """The event name as received (a beta alias for events parsed from a beta server)."""
        return self._raw_type or self.type


class SessionCreated(ServerEvent):
    type: Literal["session.created"] = "session.created"
    session: SessionObject


class SessionUpdated(ServerEvent):
    type: Literal["session.updated"] = "session.updated"
    session: SessionObject


class SessionClosed(ServerEvent):
    """Ext. ``reason``: ``client_close``, ``timeout``, ``shutdown`` or ``server_error``."""

    type: Literal["session.closed"] = "session.closed"
    session_id: Optional[str] = None
    epoch: Optional[int] = None  # always sent by duplexkit; optional for other servers
    reason: str = "client_close"


class SessionResumed(ServerEvent):
    """Ext. (docs/protocol.md §1.6): the resume was accepted; events after ``last_server_event_seq``
    follow (``replayed`` of them from the journal), then live ones. ``resume_token`` replaces the
    previous token; ``client_frames_received`` counts the client frames the session processed (the
    client re-sends later ones). Has no ``server_event_seq`` of its own."""

    type: Literal["session.resumed"] = "session.resumed"
    session_id: str
    last_server_event_seq: int = 0
    replayed: int = 0
    client_frames_received: Optional[int] = None
    resume_token: Optional[str] = None


class SessionHeartbeatAck(ServerEvent):
    type: Literal["session.heartbeat_ack"] = "session.heartbeat_ack"
    session_id: str


class SessionWarning(ServerEvent):
    """``session.warning`` (ext): a request field was accepted but not (fully) honoured.

    Sent once per ``param`` per session, never closes anything and, unlike ``error``, does not
    reject the event it refers to (vLLM-Omni's client treats every ``error`` as a failed request).
    """

    type: Literal["session.warning"] = "session.warning"
    code: str
    message: str
    param: Optional[str] = None


class ErrorEvent(ServerEvent):
    """``error`` (docs/protocol.md §5.3, §9). Build one with :meth:`of` from an :class:`ErrorCode`:
    the only way duplexkit writes an error event (the Session, the server's handshake refusals)."""

    type: Literal["error"] = "error"
    error: ErrorInfo

    @classmethod
    def of(cls, code: Union[ErrorCode, str], message: str, param: Optional[str] = None, *,
           naming: str = "duplexkit", event_id: str = "", server_event_seq: Optional[int] = None,
           client_event_id: Optional[str] = None) -> "ErrorEvent":
        """The ``error`` event of ``code`` (its OpenAI ``type`` from :data:`~duplexkit.errors.ERROR_TYPES`,
        its code string in ``naming``: :func:`~duplexkit.errors.wire_error_code`).

        Args:
            code: an :class:`ErrorCode` (or its value).
            message: what was expected and what was got.
            param: the offending field, or None.
            naming: ``"duplexkit"`` or ``"openai"`` (:data:`~duplexkit.errors.ERROR_CODE_NAMINGS`).
            event_id / server_event_seq: of the event itself.
            client_event_id: the refused client event's ``event_id`` (``error.event_id``), or None.

        Raises:
            ValueError: ``code`` is not a docs/protocol.md §9 code, or ``naming`` is unknown.
        """
        err = ProtocolError(code, message, param, client_event_id)
        return cls(event_id=event_id, server_event_seq=server_event_seq, error=ErrorInfo(**err.to_error_dict(naming)))


class SpeechStarted(ServerEvent):
    type: Literal["input_audio_buffer.speech_started"] = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str


class SpeechStopped(ServerEvent):
    type: Literal["input_audio_buffer.speech_stopped"] = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


class InputAudioBufferCommitted(ServerEvent):
    type: Literal["input_audio_buffer.committed"] = "input_audio_buffer.committed"
    item_id: str
    previous_item_id: Optional[str] = None


class InputAudioBufferCleared(ServerEvent):
    type: Literal["input_audio_buffer.cleared"] = "input_audio_buffer.cleared"


class OutputAudioBufferCleared(ServerEvent):
    """Answer to ``output_audio_buffer.clear``; ``response_id`` only when it cancelled one (§2.3)."""

    type: Literal["output_audio_buffer.cleared"] = "output_audio_buffer.cleared"
    response_id: Optional[str] = None


class ConversationItemAdded(ServerEvent):
    type: Literal["conversation.item.added"] = "conversation.item.added"
    previous_item_id: Optional[str] = None
    item: Item


class ConversationItemDone(ServerEvent):
    type: Literal["conversation.item.done"] = "conversation.item.done"
    previous_item_id: Optional[str] = None
    item: Item


class ConversationItemRetrieved(ServerEvent):
    type: Literal["conversation.item.retrieved"] = "conversation.item.retrieved"
    item: Item


class ConversationItemDeleted(ServerEvent):
    type: Literal["conversation.item.deleted"] = "conversation.item.deleted"
    item_id: str


class ConversationItemTruncated(ServerEvent):
    type: Literal["conversation.item.truncated"] = "conversation.item.truncated"
    item_id: str
    content_index: int = 0
    audio_end_ms: int


class InputAudioTranscriptionCompleted(ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.completed"] = (
        "conversation.item.input_audio_transcription.completed"
    )
    item_id: str
    content_index: int = 0
    transcript: str
    usage: Optional[Dict[str, Any]] = None
    """OpenAI's transcription usage; here ``{"type": "duration", "seconds": <the turn's audio, s>}``."""


class InputAudioTranscriptionDelta(ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.delta"] = (
        "conversation.item.input_audio_transcription.delta"
    )
    item_id: str
    content_index: int = 0
    delta: str


class InputAudioTranscriptionFailed(ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.failed"] = (
        "conversation.item.input_audio_transcription.failed"
    )
    item_id: str
    content_index: int = 0
    error: ErrorInfo


class FunctionCallArgumentsDelta(ServerEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    response_id: str
    item_id: str
    output_index: int = 0
    call_id: str
    delta: str


class FunctionCallArgumentsDone(ServerEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    response_id: str
    item_id: str
    output_index: int = 0
    call_id: str
    name: str
    arguments: str


class ResponseCreated(ServerEvent):
    type: Literal["response.created"] = "response.created"
    response: ResponseObject


class ResponseDone(ServerEvent):
    type: Literal["response.done"] = "response.done"
    response: ResponseObject


class OutputItemAdded(ServerEvent):
    type: Literal["response.output_item.added"] = "response.output_item.added"
    response_id: str
    output_index: int = 0
    item: Item


class OutputItemDone(ServerEvent):
    type: Literal["response.output_item.done"] = "response.output_item.done"
    response_id: str
    output_index: int = 0
    item: Item


class _PartRef(ServerEvent):
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0


class ContentPartAdded(_PartRef):
    type: Literal["response.content_part.added"] = "response.content_part.added"
    part: Part


class ContentPartDone(_PartRef):
    type: Literal["response.content_part.done"] = "response.content_part.done"
    part: Part


class OutputAudioDelta(_PartRef):
    """pcm16 LE base64 at 24 kHz; ``format``/``sample_rate_hz``/``metadata`` are extra keys (§5.3)."""

    type: Literal["response.output_audio.delta"] = "response.output_audio.delta"
    delta: str
    format: Optional[str] = None
    sample_rate_hz: Optional[int] = None
    metadata: Optional[DeltaMetadata] = None


class OutputAudioDone(_PartRef):
    type: Literal["response.output_audio.done"] = "response.output_audio.done"


class OutputAudioTranscriptDelta(_PartRef):
    type: Literal["response.output_audio_transcript.delta"] = "response.output_audio_transcript.delta"
    delta: str
    metadata: Optional[DeltaMetadata] = None


class OutputAudioTranscriptDone(_PartRef):
    type: Literal["response.output_audio_transcript.done"] = "response.output_audio_transcript.done"
    transcript: str


class OutputTextDelta(_PartRef):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    metadata: Optional[DeltaMetadata] = None


class OutputTextDone(_PartRef):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str


class ResponseSpeak(_PartRef):
    """Ext (duplex profile): the model starts speaking response ``response_id`` (§5.3 step 5)."""

    type: Literal["response.speak"] = "response.speak"
    metadata: Optional[DeltaMetadata] = None


class ResponseListen(ServerEvent):
    """Ext (duplex profile). Beat form: no ``response_id``; terminating form: ``response_id`` of a
    pre-created response whose forced unit yielded listen (§5.3)."""

    type: Literal["response.listen"] = "response.listen"
    epoch: Optional[int] = None
    response_id: Optional[str] = None
    response: Optional[ResponseObject] = None
    metadata: Optional[DeltaMetadata] = None


class UnknownServerEvent(BaseModel):
    """A server event this parser does not know (or could not validate), surfaced raw."""

    model_config = ConfigDict(extra="forbid")
    type: str
    raw: Dict[str, Any]
    validation_error: Optional[str] = None

    @property
    def raw_type(self) -> str:
        return self.type


_ALL = [
    SessionCreated, SessionUpdated, SessionClosed, SessionResumed, SessionHeartbeatAck, SessionWarning, ErrorEvent,
    SpeechStarted,
    SpeechStopped, InputAudioBufferCommitted, InputAudioBufferCleared, OutputAudioBufferCleared,
    ConversationItemAdded, ConversationItemDone, ConversationItemRetrieved, ConversationItemDeleted,
    ConversationItemTruncated, InputAudioTranscriptionCompleted, InputAudioTranscriptionDelta,
    InputAudioTranscriptionFailed, FunctionCallArgumentsDelta, FunctionCallArgumentsDone, ResponseCreated, ResponseDone,
    OutputItemAdded, OutputItemDone, ContentPartAdded, ContentPartDone, OutputAudioDelta,
    OutputAudioDone, OutputAudioTranscriptDelta, OutputAudioTranscriptDone, OutputTextDelta,
    OutputTextDone, ResponseSpeak, ResponseListen,
]

#: GA event type -> model
SERVER_EVENT_MODELS: dict[str, type[ServerEvent]] = {m.model_fields["type"].default: m for m in _ALL}

#: beta / vLLM-Omni name -> GA name (docs/protocol.md §2.1): :data:`.vocabulary.BETA_TO_GA_EVENTS`
BETA_EVENT_ALIASES = BETA_TO_GA_EVENTS


def parse_server_event(raw: Union[str, bytes, bytearray, dict]) -> Union[ServerEvent, UnknownServerEvent]:
    """Parse one server event on the client side (docs/protocol.md §2, "Inbound to clients").

    GA and beta names are accepted; the returned model's ``type`` is the GA name and
    ``raw_type`` the name as received (so a client can ignore a ``conversation.item.created``
    duplicating a ``conversation.item.added`` of the same item id). Unknown keys stay in
    ``model_extra``; unknown enum values stay strings. An unknown type, or a known type whose body
    does not validate, is returned as :class:`UnknownServerEvent` (never raised).

    Raises:
        ProtocolError(``invalid_json``): the frame is not a JSON object.
    """
    if isinstance(raw, dict):
        data = raw
    else:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(ErrorCode.INVALID_JSON, f"server frame is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ProtocolError(ErrorCode.INVALID_JSON, "server frame is not a JSON object")
    rtype = data.get("type")
    if not isinstance(rtype, str):
        return UnknownServerEvent(type=str(rtype), raw=data, validation_error="missing string 'type'")
    gtype = BETA_EVENT_ALIASES.get(rtype, rtype)
    model = SERVER_EVENT_MODELS.get(gtype)
    if model is None:
        return UnknownServerEvent(type=rtype, raw=data)
    body = data if gtype == rtype else {**data, "type": gtype}
    try:
        ev = model.model_validate(body)
    except ValidationError as exc:
        return UnknownServerEvent(type=rtype, raw=data, validation_error=str(exc))
    ev._raw_type = rtype
    return ev
