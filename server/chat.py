"""``POST /v1/chat/completions`` (docs/protocol.md §10.1): turn-based text and speech.

Each request takes one slot from the same pool as realtime sessions (a full pool answers 503 with
``Retry-After``), converts the OpenAI request into a :class:`duplexkit.engine.api.ChatRequest` and
runs :meth:`Engine.generate` (or :meth:`Engine.generate_stream` with ``stream:true``).

Two response shapes (docs/server.md, "Chat completions"): a request with OpenAI's ``audio`` object
(``{voice, format}``: it names a ``voice``) gets **OpenAI's shape**: one choice, ``message.audio{id, data, transcript,
expires_at}`` with ``content: null`` (stream: ``delta.audio{id, transcript | data}``). Any other
request gets **vLLM-Omni's shape**: choice 0 carries the text, choice 1 (only with audio) carries
``message.audio``; the stream has a top-level ``modality`` (``"text"`` at index 0, ``"audio"`` at
index 1 with the audio in ``delta.content``). Audio is 24 kHz mono in ``audio.format`` (wav default,
pcm16, flac, mp3, opus). Without ``modalities`` or ``audio`` the answer is text only, except in the
``vllm_omni`` chat dialect (``?dialect=vllm_omni``, or ``model: "openbmb/MiniCPM-o-4_5"``), where it is
text and audio (vLLM-Omni's meaning for MiniCPM-o; :func:`duplexkit_server.dialect.pick_chat_dialect`).
Streams end with ``finish_reason`` chunks, an optional usage chunk, ``data: [DONE]``.

Limits (docs/server.md, "Limits"): a ``Content-Length`` over ``max_body_bytes`` is refused (413)
before anything else; then the slot is taken (503 when none frees within ``slot_wait_s``), and only
then is the body read (408 ``request_timeout`` when it is not complete within ``body_timeout_s``)
and parsed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import logging
import secrets
import time
from typing import Annotated, Any, Literal, Optional, Union

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError)

from duplexkit.errors import (ERROR_TYPES, AudioTooLongError, DuplexkitError, EngineProcessError, ErrorCode,
                              RefAudioLengthError)
from duplexkit.engine.api import (INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE, REF_AUDIO_MIN_S, ChatMessage, ChatRequest,
                                  ReferenceVoice, reference_voice)

from .responses import ServerClosing, openai_error
from .dialect import pick_chat_dialect

logger = logging.getLogger("duplexkit.server.chat")

__all__ = ["handle", "parse_chat_request", "validate_chat_body", "ChatBody", "ChatRequestError"]

INPUT_RATE = INPUT_SAMPLE_RATE
MAX_IMAGE_PIXELS = 4096 * 4096  # decoded before the vision encoder resizes it; bigger: a decompression bomb


class ChatRequestError(DuplexkitError, ValueError):
    """A request the route answers with 400 ``invalid_request_error`` (docs/protocol.md §10.1).

    ``code`` is the OpenAI error code of the body: ``bad_request`` by default, or a §9 code
    (``bad_audio``, ``ref_audio_invalid``) or ``model_not_found`` where one applies.
    """

    def __init__(self, message: str, param: Optional[str] = None, code: str = "bad_request") -> None:
        super().__init__(message, code=code.value if isinstance(code, ErrorCode) else code)
        self.param = param


def _decode_data_url(url: str, param: str) -> bytes:
    if not url.startswith("data:"):
        raise ChatRequestError("only data: URLs are accepted here", param)
    head, sep, data = url.partition(",")
    if not sep:
        raise ChatRequestError("malformed data URL", param)
    try:
        if ";base64" in head:
            return base64.b64decode(data, validate=True)
        from urllib.parse import unquote_to_bytes
        return unquote_to_bytes(data)
    except (binascii.Error, ValueError) as exc:
        raise ChatRequestError(f"undecodable data URL: {exc}", param) from exc


def _decode_audio(raw: bytes, param: str, max_s: float, code: str = ErrorCode.BAD_AUDIO.value) -> np.ndarray:
    """Bytes of an audio file -> float32 [n] at 16 kHz; the length is checked from the container
    header before decoding, and decoding stops after ``max_s`` (:func:`duplexkit.audio.read_wav`)."""
    from duplexkit.audio import read_wav

    try:
        audio, _ = read_wav(raw, INPUT_RATE, max_s=max_s)
    except AudioTooLongError as exc:  # it decodes; it is only too long
        raise ChatRequestError(str(exc), param, code) from None
    except Exception as exc:
        raise ChatRequestError(f"undecodable audio: {exc}", param, code) from None
    if len(audio) == 0:
        raise ChatRequestError("empty audio", param, ErrorCode.BAD_AUDIO.value)
    if len(audio) > max_s * INPUT_RATE:
        raise ChatRequestError(str(AudioTooLongError(len(audio) / INPUT_RATE, max_s)), param, code)
    return audio


def _decode_image(url: str, param: str, state) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - pillow ships with the engine extra
        raise ChatRequestError("image input needs pillow", param) from exc
    accepted = ("accepted: a data URL (data:image/png;base64,...)"
                + (" or a file:// / plain path under the server's --ref-audio-dir"
                   if state.settings.ref_audio_dir is not None else
                   "; local paths need a server started with --ref-audio-dir"))
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if url.startswith("data:"):
        raw = _decode_data_url(url, param)
    elif scheme and scheme != "file":
        # docs/protocol.md §8.1: the server never fetches remote hosts (no SSRF, no hidden latency)
        raise ChatRequestError(f"image_url {scheme}:// URLs are never fetched by this server; {accepted}", param)
    elif state.settings.ref_audio_dir is None:
        raise ChatRequestError(f"image paths are disabled on this server; {accepted}", param)
    else:
        try:
            raw = state.load_ref_audio_path(url)  # same allow-list as reference voices
        except FileNotFoundError as exc:
            raise ChatRequestError(f"image file not found: {url!r}", param) from exc
        except (PermissionError, OSError) as exc:
            raise ChatRequestError(f"image not allowed: {exc}; {accepted}", param) from exc
    try:
        img = Image.open(io.BytesIO(raw))  # lazy: only the header is read here
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise ChatRequestError(f"image of {img.width}x{img.height} pixels is larger than "
                                   f"{MAX_IMAGE_PIXELS} pixels", param)
        img = img.convert("RGB")
    except ChatRequestError:
        raise
    except Exception as exc:
        raise ChatRequestError(f"undecodable image: {type(exc).__name__}", param) from None
    return np.asarray(img, dtype=np.uint8)


def _ref_voice(audio: np.ndarray, max_s: float, param: str) -> ReferenceVoice:
    try:
        return reference_voice(audio, max_s)  # the one trim (whole 100 ms) and bound check
    except RefAudioLengthError:
        raise ChatRequestError(f"reference voice must last {REF_AUDIO_MIN_S}-{max_s:g} s", param,
                               ErrorCode.REF_AUDIO_INVALID) from None


# -- the request body (pydantic, like the realtime wire: duplexkit.protocol.client_events) -----------

class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI fields this server does not use are ignored


class _TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class _InputAudio(_Model):
    data: StrictStr
    format: Literal["wav", "mp3"] = "wav"


class _InputAudioPart(_Model):
    type: Literal["input_audio"]
    input_audio: _InputAudio


class _Url(_Model):
    url: StrictStr


class _AudioUrlPart(_Model):
    type: Literal["audio_url"]
    audio_url: _Url


class _ImageUrlPart(_Model):
    type: Literal["image_url"]
    image_url: _Url


_UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "none", "list"})
_PART_TYPES = ("text", "input_audio", "audio_url", "image_url")
_Part = Annotated[Union[_TextPart, _InputAudioPart, _AudioUrlPart, _ImageUrlPart], Field(discriminator="type")]


class _Message(_Model):
    role: Literal["system", "user", "assistant"]
    content: Union[StrictStr, list[_Part], None] = None


class _AudioOptions(_Model):
    voice: Optional[StrictStr] = None
    format: Literal["wav", "pcm16", "flac", "mp3", "opus"] = "wav"  # AUDIO_FORMATS


class _TemplateKwargs(_Model):
    use_tts_template: Optional[StrictBool] = None
    enable_thinking: StrictBool = False


class _StreamOptions(_Model):
    include_usage: Optional[StrictBool] = None


class ChatBody(_Model):
    """The accepted ``POST /v1/chat/completions`` body (docs/protocol.md §10.1). Unknown fields are
    ignored; ``n > 1``, ``tools``/``functions``/``logprobs`` are refused by :func:`parse_chat_request`."""

    model: Optional[StrictStr] = None
    messages: list[_Message] = Field(min_length=1, max_length=4096)
    modalities: Optional[list[Literal["text", "audio"]]] = None
    audio: Optional[_AudioOptions] = None
    chat_template_kwargs: Optional[_TemplateKwargs] = None
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    temperature: Optional[Union[StrictInt, StrictFloat]] = None
    seed: Optional[StrictInt] = None
    n: Optional[StrictInt] = None
    stream: Optional[StrictBool] = None
    stream_options: Optional[_StreamOptions] = None
    tools: Any = None
    functions: Any = None
    logprobs: Any = None
    top_logprobs: Any = None


def _loc(loc: tuple) -> str:
    out = ""
    prev = None
    for p in loc:
        if isinstance(p, str) and ("[" in p or p in _UNION_BRANCHES):
            continue  # pydantic names the union branch it tried: not a field of the body
        tag_level = p in _PART_TYPES and isinstance(prev, int)
        prev = p
        if isinstance(p, int):
            out += f"[{p}]"
        elif tag_level:
            continue  # the discriminator's own level: messages[0].content[1].input_audio... reads better
        else:
            out += ("." if out else "") + str(p)
    return out


def _validation_error(exc: ValidationError) -> ChatRequestError:
    errors = exc.errors(include_url=False)
    # a union reports one error per branch: the deepest one is the branch the client meant
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _loc(tuple(first.get("loc", ()))) or None
    if first.get("type") == "union_tag_invalid":
        tag = (first.get("ctx") or {}).get("tag")
        return ChatRequestError(f"unsupported content part type {tag!r}; accepted: {', '.join(_PART_TYPES)}", param)
    if first.get("type") == "union_tag_not_found":
        return ChatRequestError("each content part needs a 'type'", param)
    msg = first.get("msg", "invalid value")
    return ChatRequestError(f"{param + ': ' if param else ''}{msg}", param)


def validate_chat_body(body: Any) -> ChatBody:
    """The body as :class:`ChatBody`; raises :class:`ChatRequestError` (400) for any other shape."""
    if not isinstance(body, dict):
        raise ChatRequestError("the body must be a JSON object")
    try:
        return ChatBody.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    except RecursionError:
        raise ChatRequestError("the body is nested too deeply") from None


def parse_chat_request(body: Any, state, dialect: str = "openai") -> tuple[ChatRequest, dict]:
    """Convert an OpenAI chat-completions body into a :class:`ChatRequest`.

    ``body`` is the decoded JSON (or an already validated :class:`ChatBody`); ``dialect`` (``openai`` or
    ``vllm_omni``, :func:`duplexkit_server.dialect.pick_chat_dialect`) decides the output modalities of a
    request without ``modalities`` or ``audio``: text, or text and speech. Audio and images are
    decoded here (blocking: the route runs this in a worker thread, after taking a slot); audio
    length is checked from the container header before decoding (``max_input_audio_s``,
    ``max_ref_audio_s``).

    Returns ``(request, options)`` with options ``stream``, ``include_usage``, ``audio_format``,
    ``model``. Raises :class:`ChatRequestError` for every 400 case of docs/protocol.md §10.1.
    """
    s = state.settings
    b = body if isinstance(body, ChatBody) else validate_chat_body(body)
    model = b.model
    if model is not None and not state.accepts_model(model):
        raise ChatRequestError(f"unknown model {model!r}", "model", ErrorCode.MODEL_NOT_FOUND.value)
    if b.n not in (None, 1):
        raise ChatRequestError("n > 1 is not supported", "n")
    for unsupported in ("tools", "functions", "logprobs", "top_logprobs"):
        if getattr(b, unsupported) not in (None, False, [], {}):
            raise ChatRequestError(f"{unsupported} is not supported", unsupported)
    # audio only when asked for: OpenAI's modalities/audio, or the vllm_omni dialect's default
    # (text and speech, what vLLM-Omni means for MiniCPM-o; text alone without a vocoder)
    has_vocoder = bool(getattr(state.engine, "supports_audio", True))
    if b.modalities:
        modalities = list(b.modalities)
    elif b.audio is not None or (dialect == "vllm_omni" and has_vocoder):
        modalities = ["text", "audio"]
    else:
        modalities = ["text"]
    output_audio = "audio" in modalities
    if output_audio and not bool(getattr(state.engine, "supports_audio", True)):
        raise ChatRequestError("this server has no vocoder (its checkpoint lacks assets/token2wav): "
                               "expected modalities ['text']", "modalities")
    audio_opts = b.audio or _AudioOptions()
    audio_format = audio_opts.format
    kw = b.chat_template_kwargs or _TemplateKwargs()
    use_tts_template = kw.use_tts_template
    enable_thinking = kw.enable_thinking

    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    if max_tokens is None:
        cap = s.max_output_tokens
        max_tokens = min(256, cap) if isinstance(cap, int) and not isinstance(cap, bool) else 256  # None/"inf": 256
    if not 1 <= max_tokens <= 8192:
        raise ChatRequestError("max_tokens must be an integer in 1..8192", "max_tokens")
    temperature = 0.7 if b.temperature is None else b.temperature
    if not 0 <= temperature <= 2:
        raise ChatRequestError("temperature must be in 0..2", "temperature")
    seed = b.seed

    messages: list[ChatMessage] = []
    ref_voice: Optional[ReferenceVoice] = None
    any_audio_in = False
    for i, m in enumerate(b.messages):
        p = f"messages[{i}]"
        role = m.role
        content = m.content
        parts: list = []
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                pp = f"{p}.content[{j}]"
                if isinstance(part, _TextPart):
                    parts.append(part.text)
                elif isinstance(part, (_InputAudioPart, _AudioUrlPart)):
                    if role == "assistant":
                        raise ChatRequestError("assistant messages are text only", pp)
                    if isinstance(part, _InputAudioPart):
                        try:
                            raw = base64.b64decode(part.input_audio.data, validate=True)
                        except (binascii.Error, ValueError) as exc:
                            raise ChatRequestError(f"input_audio.data is not base64: {exc}", pp, ErrorCode.BAD_AUDIO.value) from exc
                    else:
                        raw = _decode_data_url(part.audio_url.url, pp)
                    if role == "system":
                        ref_voice = _ref_voice(_decode_audio(raw, pp, s.max_ref_audio_s, ErrorCode.REF_AUDIO_INVALID.value),
                                               s.max_ref_audio_s, pp)
                    else:
                        any_audio_in = True
                        parts.append(_decode_audio(raw, pp, s.max_input_audio_s))
                else:  # _ImageUrlPart
                    if role == "assistant":
                        raise ChatRequestError("assistant messages are text only", pp)
                    parts.append(_decode_image(part.image_url.url, pp, state))
        elif content is None and role == "assistant":
            pass
        else:
            raise ChatRequestError("content must be a string or a list of parts", f"{p}.content")
        if parts or role != "system":
            messages.append(ChatMessage(role=role, content=parts))
    if ref_voice is None:
        voice = audio_opts.voice
        voices = getattr(state, "voices", None) or {}
        ref_voice = voices.get(voice) if isinstance(voice, str) else None
        if ref_voice is None:
            ref_voice = getattr(state, "default_voice", None)
    if use_tts_template is None:
        use_tts_template = output_audio or any_audio_in
    stream = bool(b.stream)
    include_usage = bool(b.stream_options and b.stream_options.include_usage)
    req = ChatRequest(messages=messages, output_audio=output_audio, max_tokens=max_tokens,
                      temperature=float(temperature), seed=seed, use_tts_template=use_tts_template,
                      enable_thinking=enable_thinking, ref_voice=ref_voice)
    return req, {"stream": stream, "include_usage": include_usage,
                 "audio_format": audio_format, "model": model or state.model_id,
                 # OpenAI's audio param has both voice and format (both required there)
                 "openai_audio": b.audio is not None and b.audio.voice is not None}


#: ``audio.format`` values -> (soundfile format, subtype); ``pcm16`` is raw little-endian PCM16.
#: OpenAI's list is wav, mp3, flac, opus, pcm16, aac; libsndfile (soundfile) writes all but aac.
_SF_FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
               "opus": ("OGG", "OPUS")}
AUDIO_FORMATS = ("wav", "pcm16", "flac", "mp3", "opus")


def encode_audio_b64(audio: np.ndarray, fmt: str) -> str:
    """Base64 of ``audio`` (float32 [n], 24 kHz mono) in ``fmt`` (one of :data:`AUDIO_FORMATS`):
    a whole file for wav/flac/mp3/opus, raw little-endian PCM16 for pcm16."""
    x = np.asarray(audio, np.float32)
    if fmt == "pcm16":
        from duplexkit.audio import float32_to_pcm16

        return base64.b64encode(float32_to_pcm16(x)).decode("ascii")
    if fmt == "wav":
        from duplexkit.audio import wav_bytes

        return base64.b64encode(wav_bytes(x, OUTPUT_SAMPLE_RATE)).decode("ascii")
    import soundfile as sf

    container, subtype = _SF_FORMATS[fmt]
    buf = io.BytesIO()
    sf.write(buf, np.clip(x, -1.0, 1.0), OUTPUT_SAMPLE_RATE, format=container, subtype=subtype)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class BodyTooLarge(DuplexkitError):
    """The request body exceeds ``max_body_bytes`` (answered with HTTP 413)."""

    default_code = ErrorCode.EVENT_TOO_LARGE.value


class BodyTimeout(DuplexkitError):
    """The request body did not arrive in time (answered with HTTP 408)."""

    default_code = "request_timeout"


def declared_too_large(request: Request, limit: int) -> bool:
    """Whether the ``Content-Length`` header declares more than ``limit`` bytes."""
    declared = request.headers.get("content-length")
    return declared is not None and declared.strip().isdigit() and int(declared) > limit


async def read_body(request: Request, limit: int, timeout_s: Optional[float] = None) -> bytes:
    """The request body, refusing (``BodyTooLarge``) a declared or actual size above ``limit`` bytes
    before reading more than ``limit`` bytes of it, and (``BodyTimeout``) a body not complete within
    ``timeout_s`` seconds (None: no bound)."""
    if declared_too_large(request, limit):
        raise BodyTooLarge()

    async def read() -> bytes:
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise BodyTooLarge()
            chunks.append(chunk)
        return b"".join(chunks)

    if timeout_s is None:
        return await read()
    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyTimeout() from None


def _load_and_validate(raw: bytes) -> ChatBody:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ChatRequestError(f"malformed JSON: {exc}", code=ErrorCode.INVALID_JSON.value) from None
    except RecursionError:
        raise ChatRequestError("malformed JSON: nested too deeply", code=ErrorCode.INVALID_JSON.value) from None
    return validate_chat_body(body)


def _log_generation_failure(what: str, exc: BaseException) -> None:
    """A traceback for an engine bug; one line for a dead engine process (logged once by
    :mod:`duplexkit.engine.process` already, with its exit code)."""
    if isinstance(exc, EngineProcessError):
        logger.error("%s: %s", what, exc)
    else:
        logger.exception(what)


async def handle(state, request: Request):
    """The route body (auth already checked by the app)."""
    if not state.ready:
        failure = getattr(state, "engine_failure", None)
        msg = ("this replica is draining for shutdown; retry (another replica will take it)"
               if state.shutting_down else f"the engine failed: {failure}" if failure
               else "the model is loading; retry later")
        return openai_error(503, msg, ErrorCode.SESSION_CAPACITY_EXHAUSTED.value,
                            headers={"Retry-After": str(state.settings.retry_after_s)})
    s = state.settings
    limit = s.max_body_bytes
    if declared_too_large(request, limit):  # refused before a byte of it is read
        return openai_error(413, f"the request body is larger than {limit} bytes (--max-body-bytes)",
                            "request_too_large")
    try:
        dialect = pick_chat_dialect(request.query_params.get("dialect"), None)
    except ValueError as exc:
        return openai_error(400, str(exc), "bad_request", param="dialect")
    # the slot first: a refused request never has its body read or parsed (docs/server.md, "Limits")
    client = state.client_id(state.bearer(request.headers.get("authorization")), request.scope)
    if not await state.slots.acquire(client, getattr(s, "slot_wait_s", 0.0)):
        return openai_error(503, state.capacity_message(client), ErrorCode.SESSION_CAPACITY_EXHAUSTED.value,
                            headers={"Retry-After": str(s.retry_after_s), "Connection": "close"})
    released = False

    def release_slot() -> None:
        nonlocal released
        if not released:
            released = True
            state.slots.release(client)
            try:
                from .memory import schedule_trim

                schedule_trim()
            except RuntimeError:  # no running loop (a background task after the response)
                pass

    try:
        try:
            raw = await read_body(request, limit, getattr(s, "body_timeout_s", None))
        except BodyTooLarge:
            release_slot()
            return openai_error(413, f"the request body is larger than {limit} bytes (--max-body-bytes)",
                                "request_too_large", headers={"Connection": "close"})
        except BodyTimeout:
            release_slot()
            logger.info("chat request body from %s not complete after %g s: 408",
                        (request.scope.get("client") or ("?",))[0], s.body_timeout_s)
            return openai_error(408, f"the request body was not received within {s.body_timeout_s:g} s "
                                     "(--body-timeout-s)", "request_timeout", headers={"Connection": "close"})
        except ClientDisconnect:
            release_slot()
            return Response(status_code=400)
        try:  # JSON and shape checks in a worker thread: a 16 MiB body must not stall other sessions
            body = await asyncio.to_thread(_load_and_validate, raw)
        except ChatRequestError as exc:
            release_slot()
            return openai_error(400, str(exc), exc.code, param=exc.param)
        del raw
        if not request.query_params.get("dialect"):
            dialect = pick_chat_dialect(None, body.model)
        # audio/image decoding holds the slot and runs off the event loop (bounded by the limits)
        req, opts = await asyncio.to_thread(parse_chat_request, body, state, dialect)
    except ChatRequestError as exc:
        release_slot()
        return openai_error(400, str(exc), exc.code, param=exc.param)
    except BaseException:
        release_slot()
        raise

    created = int(time.time())
    cid = "chatcmpl-" + secrets.token_hex(12)
    if not opts["stream"]:
        try:
            result = await state.until_closing(state.engine.generate(req))
        except ServerClosing:
            return openai_error(503, "the server is shutting down; retry (another replica will take it)",
                                ErrorCode.SESSION_CAPACITY_EXHAUSTED.value, headers={"Retry-After": str(s.retry_after_s)})
        except Exception as exc:
            _log_generation_failure("chat generation failed", exc)
            return openai_error(500, f"generation failed: {exc}", ErrorCode.SERVER_ERROR.value)
        finally:
            release_slot()
        has_audio = req.output_audio and result.audio is not None
        audio_obj = {"id": "audio_" + secrets.token_hex(12), "transcript": result.text, "expires_at": created + 3600,
                     "data": encode_audio_b64(result.audio, opts["audio_format"]) if has_audio else None}
        if opts["openai_audio"]:
            # OpenAI's shape: one choice; with audio, content is null and the text is the transcript
            msg: dict[str, Any] = {"role": "assistant", "content": None if has_audio else result.text}
            if has_audio:
                msg["audio"] = audio_obj
            choices: list[dict] = [{"index": 0, "message": msg, "finish_reason": result.finish_reason}]
        else:
            # vLLM-Omni's shape: choice 0 text, choice 1 audio
            choices = [{"index": 0, "message": {"role": "assistant", "content": result.text},
                        "finish_reason": result.finish_reason}]
            if has_audio:
                choices.append({"index": 1, "finish_reason": result.finish_reason,
                                "message": {"role": "assistant", "content": None, "audio": audio_obj}})
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": opts["model"],
            "choices": choices,
            "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                      "total_tokens": result.prompt_tokens + result.completion_tokens}})

    async def sse():
        def chunk(choices: list, modality: Optional[str] = None, usage: Optional[dict] = None) -> str:
            obj: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created,
                                   "model": opts["model"], "choices": choices}
            if modality is not None:
                obj["modality"] = modality
            if usage is not None:
                obj["usage"] = usage
            return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"

        n_text = 0
        finish = "stop"
        usage: Optional[dict] = None
        openai_audio = opts["openai_audio"] and req.output_audio
        audio_id = "audio_" + secrets.token_hex(12)
        try:
            if openai_audio:
                # OpenAI's shape: choice 0 only; text as delta.audio.transcript, audio as delta.audio.data
                yield chunk([{"index": 0, "delta": {"role": "assistant", "audio": {
                    "id": audio_id, "expires_at": created + 3600}}, "finish_reason": None}])
            else:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}], "text")
            async for d in state.iter_until_closing(state.engine.generate_stream(req)):
                if d.text:
                    n_text += 1
                    if openai_audio:
                        yield chunk([{"index": 0, "delta": {"audio": {"id": audio_id, "transcript": d.text}},
                                      "finish_reason": None}])
                    else:
                        yield chunk([{"index": 0, "delta": {"content": d.text}, "finish_reason": None}], "text")
                if req.output_audio and d.audio is not None and len(d.audio):
                    data = encode_audio_b64(d.audio, opts["audio_format"])
                    if openai_audio:
                        yield chunk([{"index": 0, "delta": {"audio": {"id": audio_id, "data": data}},
                                      "finish_reason": None}])
                    else:
                        yield chunk([{"index": 1, "delta": {"role": "assistant", "content": data},
                                      "finish_reason": None}], "audio")
                finish = getattr(d, "finish_reason", None) or finish
                usage = getattr(d, "usage", None) or usage
            if openai_audio:
                yield chunk([{"index": 0, "delta": {}, "finish_reason": finish}])
            else:
                yield chunk([{"index": 0, "delta": {}, "finish_reason": finish}], "text")
                if req.output_audio:
                    yield chunk([{"index": 1, "delta": {}, "finish_reason": finish}], "audio")
            if opts["include_usage"]:
                if usage is None:
                    usage = {"prompt_tokens": 0, "completion_tokens": n_text, "total_tokens": n_text}
                yield chunk([], None, usage)
            yield "data: [DONE]\n\n"
        except ServerClosing:
            err = {"error": {"message": "the server is shutting down; retry (another replica will take it)",
                             "type": ERROR_TYPES[ErrorCode.SERVER_ERROR], "param": None,
                             "code": ErrorCode.SESSION_CAPACITY_EXHAUSTED.value}}
            yield "data: " + json.dumps(err) + "\n\n"
        except Exception as exc:
            _log_generation_failure("chat stream failed", exc)
            err = {"error": {"message": f"generation failed: {exc}", "type": ERROR_TYPES[ErrorCode.SERVER_ERROR],
                             "param": None, "code": ErrorCode.SERVER_ERROR.value}}
            yield "data: " + json.dumps(err) + "\n\n"
        finally:
            release_slot()

    from starlette.background import BackgroundTask

    return StreamingResponse(sse(), media_type="text/event-stream", background=BackgroundTask(release_slot),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
