"""Client -> server events (docs/protocol.md §4): tolerant inbound parsing.

* GA and beta field spellings are both accepted (docs/protocol.md §2.2) and normalised into one model;
  giving both spellings of one concept with different values is ``bad_event``.
* Event aliases of §2.3 are mapped to their canonical type (``audio.playback_ack`` ->
  ``playback.ack``, ``close`` -> ``session.close``).
* Unknown extra fields are ignored; an unknown ``type`` is ``unknown_event``; a missing, mistyped or
  out-of-range field is ``bad_event`` with ``param`` naming the dotted path.
* Values whose validity depends on the session (audio formats, turn detection, voices, reference
  audio, the truncate position) are kept raw here and checked by the Session, which owns the codes
  ``unsupported_audio_format``, ``unsupported_turn_detection``, ``ref_audio_invalid`` and
  ``invalid_truncate``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from .errors import ErrorCode, ProtocolError
from .vocabulary import CLIENT_EVENT_ALIASES

__all__ = [
    "ClientEvent",
    "CLIENT_EVENT_MODELS",
    "CLIENT_EVENT_ALIASES",
    "SessionPatch",
    "UNHONOURED_SESSION_FIELDS",
    "IGNORED_RESPONSE_FIELDS",
    "SessionUpdateEvent",
    "InputAudioBufferAppendEvent",
    "InputAudioBufferCommitEvent",
    "InputAudioBufferClearEvent",
    "ResponseParams",
    "ResponseCreateEvent",
    "ResponseCancelEvent",
    "ItemParam",
    "ContentPartParam",
    "ConversationItemCreateEvent",
    "ConversationItemRetrieveEvent",
    "ConversationItemDeleteEvent",
    "ConversationItemTruncateEvent",
    "PlaybackAckEvent",
    "SessionHeartbeatEvent",
    "SessionCloseEvent",
    "SessionEventAckEvent",
    "OutputAudioBufferClearEvent",
    "parse_client_event",
    "sniff_event_id",
]

MAX_CLIENT_EVENT_ID = 128
MAX_INSTRUCTIONS_CHARS = 16_384  # docs/protocol.md §4.1

_MISSING = object()


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _InEvent(_In):
    event_id: Optional[str] = Field(default=None, max_length=MAX_CLIENT_EVENT_ID)


# ------------------------------------------------------------------------------------------------
# session.update
# ------------------------------------------------------------------------------------------------

#: Fields accepted with no effect (docs/protocol.md §4.1, last rows).
IGNORED_SESSION_FIELDS = (
    "input_audio_noise_reduction",
    "tracing",
    "truncation",
    "include",
    "model",
)

#: Accepted fields this server does not honour -> (the values that ask for nothing it lacks, why it
#: is not honoured). :attr:`SessionPatch.ignored` lists the paths of an update that hold any other
#: value; the Session answers each with one ``session.warning{code:"field_ignored"}`` per session
#: (docs/protocol.md §4.1). ``model`` is not among them: the connection already chose the served
#: model, and an update's ``model`` names it again (OpenAI ids are mapped to it).
UNHONOURED_SESSION_FIELDS: Dict[str, tuple] = {
    "input_audio_noise_reduction": ((None,), "input noise reduction is not applied: the audio reaches the "
                                    "model as sent (use echo cancellation on the client)"),
    "audio.input.noise_reduction": ((None,), "input noise reduction is not applied: the audio reaches the "
                                    "model as sent (use echo cancellation on the client)"),
    "audio.input.turn_detection.idle_timeout_ms": ((None,), "the server VAD has no idle timeout"),
    "turn_detection.idle_timeout_ms": ((None,), "the server VAD has no idle timeout"),
    "audio.output.speed": ((None, 1, 1.0), "the speaking rate is the model's own"),
    "speed": ((None, 1, 1.0), "the speaking rate is the model's own"),
    "tracing": ((None,), "this server exports no traces (OpenTelemetry tracing is off: "
                "docs/debugging.md, \"Traces\")"),
    "truncation": ((None, "auto"), "the model's context is slid or reset at a unit boundary when it runs out "
                   "(docs/model.md); other truncation settings are not available"),
    "include": ((None,), "no extra properties are added to server events"),
    "prompt": ((None,), "stored prompts are an OpenAI service; send the text as instructions"),
}


#: ``response.create{response}`` fields accepted and not honoured (listed in
#: ``response.metadata.ignored_fields``; one ``session.warning`` each, docs/protocol.md §4).
IGNORED_RESPONSE_FIELDS = ("instructions", "input", "prompt", "voice", "audio.output.voice")


def _get_path(d: Any, path: str) -> Any:
    """``d[path]`` (dotted), or :data:`_MISSING`."""
    cur = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _unhonoured(data: dict) -> List[str]:
    out = []
    for path, (neutral, _) in UNHONOURED_SESSION_FIELDS.items():
        v = _get_path(data, path)
        if v is _MISSING or v == [] or any(v is n or (n is not None and v == n and not isinstance(v, bool))
                                           for n in neutral):
            continue
        out.append(path)
    return out


def _pick(d: dict, path: str, out: dict, key: str, sources: dict) -> None:
    """Copy ``d[path]`` (dotted) into ``out[key]``; a second spelling with another value conflicts."""
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return
        cur = cur[part]
    if key in out and out[key] != cur:
        raise ValueError(
            f"conflicting values for one setting: session.{sources[key]} and session.{path}"
        )
    if key not in out:
        out[key] = cur
        sources[key] = path


class SessionPatch(_In):
    """A normalised ``session.update`` body (docs/protocol.md §4.1 / §2.2).

    Only concepts the client gave are set (see :attr:`given`); ``None`` values of
    ``turn_detection`` are meaningful (model-native mode) and distinguished by :attr:`given`.

    Attributes:
        output_modalities: subset of ``audio``/``text`` (validated by the Session).
        input_format: GA object ``{type, rate, channels?}`` or beta string; ``input_sample_rate_hz``
            the beta rate; ``input_channels`` the flat ``channels`` (interleaved channels, downmixed).
        output_format: GA object or beta string.
        voice: a voice name (``{id}`` objects are unwrapped).
        turn_detection: ``None`` or the raw ``server_vad`` object.
        max_output_tokens: 1..8192 or ``"inf"``.
        given: the normalised concept names present in the update.
        sources: concept -> the dotted field path the client used (for ``param``).
        ignored: the dotted paths of accepted fields this server does not honour whose values ask
            for something (:data:`UNHONOURED_SESSION_FIELDS`), e.g. ``audio.input.noise_reduction``.
    """

    output_modalities: Optional[List[str]] = None
    instructions: Optional[str] = Field(default=None, max_length=MAX_INSTRUCTIONS_CHARS)
    voice: Optional[str] = None
    ref_audio: Optional[str] = None
    input_format: Optional[Union[str, Dict[str, Any]]] = None
    input_sample_rate_hz: Optional[int] = None
    input_channels: Optional[int] = Field(default=None, strict=True)
    output_format: Optional[Union[str, Dict[str, Any]]] = None
    turn_detection: Optional[Dict[str, Any]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    max_output_tokens: Optional[Union[Literal["inf"], int]] = None
    force_listen_count: Optional[int] = Field(default=None, ge=0, le=10)
    answer_policy: Optional[Literal["model", "on_request"]] = None
    seed: Optional[int] = Field(default=None, ge=0, le=2**63 - 1)
    playback_commit_policy: Optional[Literal["ack_only", "commit_on_done"]] = None
    early_unit_close: Optional[StrictBool] = None
    auto_response: Optional[StrictBool] = None
    overlap_policy: Optional[str] = None
    native_duplex: Optional[StrictBool] = None
    output_sample_rate_hz: Optional[int] = Field(default=None, strict=True)
    tools: Optional[Any] = None  # checked by duplexkit.session.tools.parse_tools (invalid_tools)
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    transcription: Optional[Dict[str, Any]] = None
    tool_filler: Optional[str] = Field(default=None, max_length=500)
    tool_progress: Optional[Dict[str, Any]] = None
    given: List[str] = Field(default_factory=list)
    sources: Dict[str, str] = Field(default_factory=dict)
    ignored: List[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError("session must be an object")
        out: dict = {}
        src: dict = {}
        spellings = {
            "output_modalities": ("output_modalities", "modalities"),
            "instructions": ("instructions",),
            "ref_audio": ("ref_audio", "extra_body.ref_audio"),
            "input_format": ("audio.input.format", "input_audio_format"),
            "input_sample_rate_hz": ("sample_rate_hz", "input_sample_rate_hz", "audio.input.sample_rate_hz"),
            "input_channels": ("channels", "input_audio_channels"),
            "output_format": ("audio.output.format", "output_audio_format"),
            "voice": ("audio.output.voice", "voice"),
            "turn_detection": ("audio.input.turn_detection", "turn_detection"),
            "temperature": ("temperature",),
            "max_output_tokens": ("max_output_tokens", "max_response_output_tokens"),
            "force_listen_count": ("extra_body.force_listen_count", "force_listen_count"),
            "answer_policy": ("extra_body.answer_policy", "answer_policy"),
            "seed": ("extra_body.seed", "seed"),
            "playback_commit_policy": ("extra_body.playback_commit_policy", "playback_commit_policy"),
            "early_unit_close": ("extra_body.early_unit_close", "early_unit_close"),
            # vLLM-Omni's session fields (docs/server.md, "Interop")
            "auto_response": ("extra_body.auto_response", "auto_response"),
            "overlap_policy": ("overlap_policy", "extra_body.overlap_policy"),
            "native_duplex": ("extra_body.native_duplex", "native_duplex", "extra_body.minicpmo45_native_duplex"),
            "output_sample_rate_hz": ("audio.output.sample_rate_hz", "output_sample_rate_hz"),
            # tools (docs/tools.md): OpenAI's function tools, and the user-transcription settings
            "tools": ("tools",),
            "tool_choice": ("tool_choice",),
            "transcription": ("audio.input.transcription", "input_audio_transcription"),
            "tool_filler": ("extra_body.tool_filler", "tool_filler"),
            "tool_progress": ("extra_body.tool_progress", "tool_progress"),
        }
        for key, paths in spellings.items():
            for p in paths:
                _pick(data, p, out, key, src)
        # null means "not given" for everything except turn_detection (null = model-native mode) and
        # transcription (null = off)
        for key in list(out):
            if out[key] is None and key not in ("turn_detection", "transcription", "tool_progress"):
                del out[key]
                del src[key]
        v = out.get("voice")
        if isinstance(v, dict):
            if not isinstance(v.get("id"), str):
                raise ValueError("session.audio.output.voice must be a string or {id: string}")
            out["voice"] = v["id"]
        mot = out.get("max_output_tokens")
        if isinstance(mot, bool) or (mot is not None and not isinstance(mot, (int, str))):
            raise ValueError("max_output_tokens must be an integer 1..8192 or \"inf\"")
        if isinstance(mot, int) and not (1 <= mot <= 8192):
            raise ValueError(f"max_output_tokens must be 1..8192 or \"inf\", got {mot}")
        td = out.get("turn_detection", _MISSING)
        if td is not _MISSING and td is not None and not isinstance(td, dict):
            raise ValueError("turn_detection must be null or an object")
        tr = out.get("transcription", _MISSING)
        if tr is not _MISSING and tr is not None and not isinstance(tr, dict):
            raise ValueError("audio.input.transcription must be null or an object")
        for k in ("force_listen_count", "input_sample_rate_hz", "input_channels", "seed"):
            if isinstance(out.get(k), bool):
                raise ValueError(f"{k} must be an integer")
        trc = data.get("tracing")
        if trc is not None and trc != "auto" and not (
                isinstance(trc, dict) and all(isinstance(trc.get(k), (str, type(None))) for k in ("workflow_name", "group_id"))
                and isinstance(trc.get("metadata"), (dict, type(None)))):
            raise ValueError('tracing must be null, "auto" or {workflow_name, group_id, metadata}')
        out["given"] = list(src)
        out["sources"] = src
        out["ignored"] = _unhonoured(data)
        return out


class SessionUpdateEvent(_InEvent):
    type: Literal["session.update"] = "session.update"
    session: SessionPatch


# ------------------------------------------------------------------------------------------------
# input audio buffer
# ------------------------------------------------------------------------------------------------


class InputAudioBufferAppendEvent(_InEvent):
    type: Literal["input_audio_buffer.append"] = "input_audio_buffer.append"
    audio: str
    """base64 of the raw input bytes in the session's input format (decoded by the Session)."""
    sample_rate_hz: Optional[int] = None
    """vLLM-Omni's per-append rate (Hz); must match the session's input rate (else a warning)."""
    video_frames: Optional[List[Any]] = None
    """vLLM-Omni's per-append image frames; this server takes audio only (a warning, once)."""


class InputAudioBufferCommitEvent(_InEvent):
    type: Literal["input_audio_buffer.commit"] = "input_audio_buffer.commit"


class InputAudioBufferClearEvent(_InEvent):
    type: Literal["input_audio_buffer.clear"] = "input_audio_buffer.clear"


# ------------------------------------------------------------------------------------------------
# responses
# ------------------------------------------------------------------------------------------------


class ResponseParams(_In):
    """``response.create{response}`` (docs/protocol.md §4). ``tools``/``tool_choice`` override the
    session's for this response (docs/tools.md); the fields of :data:`IGNORED_RESPONSE_FIELDS` are
    accepted and not honoured (their paths in :attr:`ignored`)."""

    output_modalities: Optional[List[str]] = None
    tools: Optional[Any] = None  # checked by duplexkit.session.tools.parse_tools (invalid_tools)
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    max_output_tokens: Optional[Union[Literal["inf"], int]] = None
    metadata: Optional[Dict[str, str]] = None
    conversation: Optional[str] = None
    ignored: List[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError("response must be an object")
        out = dict(data)
        for ga, beta in (("output_modalities", "modalities"), ("max_output_tokens", "max_response_output_tokens")):
            if beta in data:
                b = out.pop(beta)
                if ga in data and data[ga] is not None and b is not None and data[ga] != b:
                    raise ValueError(f"conflicting values for response.{ga} and response.{beta}")
                if out.get(ga) is None:
                    out[ga] = b
        mot = out.get("max_output_tokens")
        if isinstance(mot, bool) or (isinstance(mot, int) and not (1 <= mot <= 8192)):
            raise ValueError("max_output_tokens must be an integer 1..8192 or \"inf\"")
        out["ignored"] = [k for k in IGNORED_RESPONSE_FIELDS if _get_path(data, k) not in (None, _MISSING)]
        return out


class ResponseCreateEvent(_InEvent):
    type: Literal["response.create"] = "response.create"
    response: Optional[ResponseParams] = None


class ResponseCancelEvent(_InEvent):
    type: Literal["response.cancel"] = "response.cancel"
    response_id: Optional[str] = None


# ------------------------------------------------------------------------------------------------
# conversation items
# ------------------------------------------------------------------------------------------------


class ContentPartParam(_In):
    type: str
    text: Optional[str] = None
    audio: Optional[str] = None
    transcript: Optional[str] = None


class ItemParam(_In):
    """An item of ``conversation.item.create`` (docs/protocol.md §4.2); the Session decides what it accepts.
    ``function_call_output`` items carry ``call_id`` and ``output`` (docs/tools.md)."""

    id: Optional[str] = None
    type: str = "message"
    role: Optional[str] = None
    content: List[ContentPartParam] = Field(default_factory=list)
    call_id: Optional[str] = None
    output: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None


class ConversationItemCreateEvent(_InEvent):
    type: Literal["conversation.item.create"] = "conversation.item.create"
    item: ItemParam
    previous_item_id: Optional[str] = None


class ConversationItemRetrieveEvent(_InEvent):
    type: Literal["conversation.item.retrieve"] = "conversation.item.retrieve"
    item_id: str


class ConversationItemDeleteEvent(_InEvent):
    type: Literal["conversation.item.delete"] = "conversation.item.delete"
    item_id: str


class ConversationItemTruncateEvent(_InEvent):
    """``content_index`` and ``audio_end_ms`` are kept raw: bad values are ``invalid_truncate``."""

    type: Literal["conversation.item.truncate"] = "conversation.item.truncate"
    item_id: str
    content_index: Any = 0
    audio_end_ms: Any = None


class PlaybackAckEvent(_InEvent):
    """``playback.ack`` (ext, alias ``audio.playback_ack``): cumulative ``played_ms`` within the response."""

    type: Literal["playback.ack"] = "playback.ack"
    response_id: Optional[str] = None
    """None: taken from an ``item_id`` of the form ``"item_" + response_id`` (vLLM-Omni's naming),
    else the latest response that sent audio (vLLM-Omni's ``ack_playback(played_ms)``)."""
    item_id: Optional[str] = None
    played_ms: int = Field(ge=0, strict=True)
    truncate: bool = False


class SessionHeartbeatEvent(_InEvent):
    type: Literal["session.heartbeat"] = "session.heartbeat"


class SessionCloseEvent(_InEvent):
    type: Literal["session.close"] = "session.close"
    reason: str = "client_close"


class SessionEventAckEvent(_InEvent):
    """``session.event_ack`` (sent by vLLM-Omni's client): a silent no-op."""

    type: Literal["session.event_ack"] = "session.event_ack"


class OutputAudioBufferClearEvent(_InEvent):
    type: Literal["output_audio_buffer.clear"] = "output_audio_buffer.clear"


ClientEvent = Union[
    SessionUpdateEvent,
    InputAudioBufferAppendEvent,
    InputAudioBufferCommitEvent,
    InputAudioBufferClearEvent,
    ResponseCreateEvent,
    ResponseCancelEvent,
    ConversationItemCreateEvent,
    ConversationItemRetrieveEvent,
    ConversationItemDeleteEvent,
    ConversationItemTruncateEvent,
    PlaybackAckEvent,
    SessionHeartbeatEvent,
    SessionCloseEvent,
    SessionEventAckEvent,
    OutputAudioBufferClearEvent,
]

#: canonical client event type -> model
CLIENT_EVENT_MODELS: dict[str, type[_InEvent]] = {
    m.model_fields["type"].default: m  # type: ignore[misc]
    for m in ClientEvent.__args__  # type: ignore[attr-defined]
}


_EVENT_ID_RE = re.compile(rb'"event_id"\s*:\s*"((?:[^"\\]|\\.){0,128})"')


def sniff_event_id(raw: Union[str, bytes, bytearray]) -> Optional[str]:
    """Best-effort ``event_id`` of a frame that cannot be parsed (too large or invalid JSON).

    Looks only at the first 4 KiB; returns None when not found.
    """
    head = raw[:4096]
    if isinstance(head, str):
        head = head.encode("utf-8", "replace")
    m = _EVENT_ID_RE.search(bytes(head))
    if not m:
        return None
    try:
        return json.loads(b'"' + m.group(1) + b'"')
    except ValueError:
        return None


def parse_client_event(
    raw: Union[str, bytes, bytearray, dict], *, max_event_bytes: Optional[int] = None
) -> ClientEvent:
    """Parse one client event frame.

    Args:
        raw: a text frame (``str``), its UTF-8 ``bytes``, or an already decoded ``dict``.
        max_event_bytes: size limit in bytes of a str/bytes frame (docs/protocol.md §1.3); None = no limit.
    Returns:
        the typed event model (aliases normalised to their canonical ``type``).
    Raises:
        ProtocolError: ``event_too_large``, ``invalid_json`` (not JSON, or not an object),
        ``unknown_event`` (unrecognised ``type``) or ``bad_event`` (missing/mistyped/out-of-range
        field; ``param`` is the dotted path). ``event_id`` is the client's, when it can be read.
    """
    if isinstance(raw, dict):
        data = raw
    else:
        if max_event_bytes is not None:
            size = len(raw.encode("utf-8")) if isinstance(raw, str) and len(raw) * 4 > max_event_bytes else len(raw)
            if size > max_event_bytes:
                raise ProtocolError(
                    ErrorCode.EVENT_TOO_LARGE,
                    f"event of {size} bytes exceeds the {max_event_bytes}-byte limit",
                    event_id=sniff_event_id(raw),
                )
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(ErrorCode.INVALID_JSON, f"frame is not valid JSON: {exc}", event_id=sniff_event_id(raw)) from None
        except RecursionError:
            raise ProtocolError(ErrorCode.INVALID_JSON, "frame is nested too deeply to parse",
                                event_id=sniff_event_id(raw)) from None
        if not isinstance(data, dict):
            raise ProtocolError(ErrorCode.INVALID_JSON, "frame is not a JSON object")
    eid = data.get("event_id")
    echo_id = eid[:MAX_CLIENT_EVENT_ID] if isinstance(eid, str) else None
    etype = data.get("type")
    if not isinstance(etype, str):
        raise ProtocolError(ErrorCode.BAD_EVENT, "event has no string 'type'", param="type", event_id=echo_id)
    etype = CLIENT_EVENT_ALIASES.get(etype, etype)
    model = CLIENT_EVENT_MODELS.get(etype)
    if model is None:
        raise ProtocolError(ErrorCode.UNKNOWN_EVENT, f"unknown event type {data.get('type')!r}", param="type", event_id=echo_id)
    if data.get("type") != etype:
        data = {**data, "type": etype}
    try:
        return model.model_validate(data)
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_EVENT, f"{etype}: nested too deeply", event_id=echo_id) from None
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msg = first.get("msg", "invalid event")
        raise ProtocolError(
            ErrorCode.BAD_EVENT, f"{etype}: {loc + ': ' if loc else ''}{msg}", param=loc or None, event_id=echo_id
        ) from None
