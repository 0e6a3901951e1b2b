"""Wire objects of a Session: the ``session`` object echoed by ``session.created``/``updated``,
``response`` objects and ``item`` objects (pydantic models of ``duplexkit.protocol``).

Plain functions of the values they are given; no state, no access to the Session's parts."""

from __future__ import annotations

from typing import Optional

from duplexkit.engine.api import OUTPUT_SAMPLE_RATE
from duplexkit.protocol.vocabulary import PCM_RATE
from duplexkit.protocol import (
    AudioConfig,
    AudioFormatObject,
    AudioInputConfig,
    AudioOutputConfig,
    Capabilities,
    ContentPart,
    EXTENSION_EVENT_TYPES,
    Item,
    RefAudioInfo,
    ResponseObject,
    SessionObject,
    StatusDetails,
    TranscriptionObject,
    TurnDetectionObject,
    Usage,
)


#: ``capabilities.extension_events`` of a duplex-profile session: every extension event of
#: :data:`duplexkit.protocol.EXTENSION_EVENT_TYPES` but ``session.resumed`` (listed only when the shell
#: offers resume, docs/protocol.md §1.6).
EXTENSION_EVENTS = sorted(EXTENSION_EVENT_TYPES - {"session.resumed"})


def extension_events(duplex: bool, supports_resume: bool) -> list[str]:
    """``capabilities.extension_events``: none in the compat profile; ``session.resumed`` when the
    shell offers resume (docs/protocol.md §1.6)."""
    if not duplex:
        return []
    return EXTENSION_EVENTS + (["session.resumed"] if supports_resume else [])


def item_model(it, transcript: Optional[str] = None) -> Item:
    """The wire ``item`` of a conversation item (``_ConvItem``); ``transcript`` replaces the text of
    an assistant audio item (its playback truth, docs/protocol.md §7.5)."""
    if it.kind == "function_call":
        return Item(id=it.id, type="function_call", status=it.status, call_id=it.call_id, name=it.name,
                    arguments=it.text)
    if it.kind == "function_call_output":
        return Item(id=it.id, type="function_call_output", status=it.status, call_id=it.call_id, output=it.text)
    if it.kind == "input_audio":
        content = [ContentPart(type="input_audio", transcript=it.text or None)]
    elif it.kind == "input_text":
        content = [ContentPart(type="input_text", text=it.text)]
    elif it.kind == "output_audio":
        content = [ContentPart(type="output_audio", transcript=it.text if transcript is None else transcript)]
    else:
        content = [ContentPart(type="output_text", text=it.text)]
    return Item(id=it.id, role=it.role, status=it.status, content=content)


def response_model(r, status: str, details: Optional[StatusDetails] = None, output: Optional[list] = None,
                   committed_ms: int = 0) -> ResponseObject:
    """The wire ``response`` of a response (``_Response``); ``committed_ms``: its item's playback truth."""
    done = status != "in_progress"
    return ResponseObject(
        id=r.id, status=status, status_details=details, output=output if done else [],
        output_modalities=r.modalities, metadata=r.metadata,
        usage=Usage(total_tokens=r.tokens, output_tokens=r.tokens) if done else None,
        max_output_tokens="inf" if r.max_tokens is None else r.max_tokens,
        epoch=r.epoch, trigger=r.trigger,
        audio_duration_ms=(r.samples * 1000 // OUTPUT_SAMPLE_RATE) if done else None,
        committed_ms=committed_ms if done else None,
    )


def session_object(s, session_id: str, cfg, epoch: int, duplex: bool) -> SessionObject:
    """The wire ``session`` of settings ``s`` (``_Settings``) under server config ``cfg``."""
    fmt = s.input_format
    if fmt.encoding == "pcm16":
        fobj = AudioFormatObject(type="audio/pcm", rate=PCM_RATE) if fmt.rate == PCM_RATE else AudioFormatObject(
            type="audio/pcm", sample_rate_hz=fmt.rate)
        beta = "pcm16"
    elif fmt.encoding == "pcm_f32le":
        fobj = AudioFormatObject(type="audio/pcm", encoding="pcm_f32le", sample_rate_hz=fmt.rate)
        beta = "pcm_f32le"
    elif fmt.encoding == "g711_ulaw":
        fobj, beta = AudioFormatObject(type="audio/pcmu"), "g711_ulaw"
    else:
        fobj, beta = AudioFormatObject(type="audio/pcma"), "g711_alaw"
    channels = fmt.channels if fmt.channels != 1 else None  # echoed only for multi-channel input
    fobj.channels = channels
    td = TurnDetectionObject(**s.turn_detection) if s.turn_detection is not None else None
    tr = (TranscriptionObject(model=s.transcription["model"], language=s.transcription["language"],
                              prompt=s.transcription["prompt"]) if s.transcription is not None else None)
    rv = s.ref_voice
    return SessionObject(
        id=session_id,
        model=cfg.model_id,
        instructions=s.instructions,
        output_modalities=list(s.output_modalities),
        modalities=list(s.output_modalities),
        voice=s.voice,
        audio=AudioConfig(
            input=AudioInputConfig(format=fobj, turn_detection=td, transcription=tr),
            output=AudioOutputConfig(format=AudioFormatObject(type="audio/pcm", rate=OUTPUT_SAMPLE_RATE), voice=s.voice),
        ),
        input_audio_format=beta,
        output_audio_format="pcm16",
        sample_rate_hz=fmt.rate,
        channels=channels,
        turn_detection=td,
        temperature=s.temperature,
        max_output_tokens=s.max_output_tokens,
        max_response_output_tokens=s.max_output_tokens,
        epoch=epoch,
        ref_audio=RefAudioInfo(sha256=rv.sha256, duration_ms=rv.duration_ms) if rv is not None else None,
        extra_body={
            "force_listen_count": s.force_listen_count,
            "answer_policy": s.answer_policy,
            "playback_commit_policy": s.playback_commit_policy,
            "seed": s.seed,
            "early_unit_close": s.early_unit_close,
            "tool_filler": s.tool_filler,
            "tool_progress": s.tool_progress,
        },
        capabilities=Capabilities(extension_events=extension_events(duplex, cfg.supports_session_resume),
                                  supports_session_resume=cfg.supports_session_resume),
        tools=[{k: v for k, v in t.items() if k != "filler"} for t in s.tools],
        tool_choice=s.tool_choice,
        input_audio_transcription=tr,
    )
