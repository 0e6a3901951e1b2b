"""The contract between the Session and an engine.

The Session (``duplexkit.session``) never touches an engine directly: it emits *engine commands*
(the dataclasses below deriving from :class:`EngineCommand`) and consumes *engine outputs*
(deriving from :class:`EngineOutput`). A thin I/O shell (the server's WebSocket handler or the
``InlineDuplexClient``) forwards commands to an :class:`EngineStream` with :func:`apply_command`
and feeds the stream's outputs back into the Session.

Units and tags
--------------
* Input audio is **16 kHz mono float32** in [-1, 1], in whole duplex *units* framed by the Session
  (``duplexkit.audio.UnitFramer``): unit 0 carries the first 1035 ms window (16 560 samples),
  every later unit the next 16 000 new samples (docs/model.md §3.1, parity case f).
* Output audio is **24 kHz mono float32** (docs/model.md §8); pcm16 conversion happens at the wire edge.
* Every command and output carries ``stream_id`` and ``epoch``. The epoch is the interruption
  fence of docs/protocol.md §3: the engine drops queued work of older epochs, and the Session drops any
  output whose epoch is older than its current one, so stale audio can never be emitted.
* Response and item ids belong to the Session; the engine only knows streams, epochs, units and
  model turns.

Nothing here imports torch; this module is shared by the pure Session and every engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Optional, Protocol, Union, runtime_checkable

import numpy as np

from duplexkit.errors import ErrorCode
# the unit sizes, rates and codec facts have one home, duplexkit.units (the model port imports them
# from there); re-exported here as part of the contract
from duplexkit.units import (CODES_PER_CHUNK, FIRST_UNIT_CONSUME, FIRST_UNIT_SAMPLES, INPUT_SAMPLE_RATE,
                             OUTPUT_SAMPLE_RATE, SAMPLES_PER_CODE, SILENCE_CODE, UNIT_SAMPLES)

__all__ = [
    "INPUT_SAMPLE_RATE",
    "OUTPUT_SAMPLE_RATE",
    "CODES_PER_CHUNK",
    "SAMPLES_PER_CODE",
    "SILENCE_CODE",
    "SILENCE_SLACK_MS",
    "FIRST_UNIT_SAMPLES",
    "FIRST_UNIT_CONSUME",
    "UNIT_SAMPLES",
    "ReferenceVoice",
    "REF_AUDIO_MIN_S",
    "REF_TRIM_SAMPLES",
    "reference_voice",
    "StreamConfig",
    "EngineCommand",
    "OpenStream",
    "AppendUnit",
    "ForceSpeak",
    "CancelEpoch",
    "UpdateStream",
    "CloseStream",
    "SpeakText",
    "ShellCommand",
    "DecideTools",
    "TranscribeAudio",
    "EngineOutput",
    "ToolDecision",
    "Transcription",
    "Decision",
    "TextDelta",
    "AudioChunk",
    "TurnEnd",
    "UnitTimings",
    "EngineFailure",
    "EngineError",
    "ChatMessage",
    "ChatRequest",
    "ChatResult",
    "ChatDelta",
    "ToolCall",
    "TOOL_CHOICES",
    "Engine",
    "EngineStream",
    "apply_command",
]

SILENCE_SLACK_MS = 250
"""Default grace (ms) after a unit deadline before the Session feeds silence to an active response
(``SessionConfig.silence_slack_ms``, ``ServerSettings.silence_slack_ms``, ``duplexkit serve
--silence-slack-ms``)."""


@dataclass(frozen=True)
class ReferenceVoice:
    """A reference voice clip (docs/protocol.md §8), already validated and processed by the Session.

    Attributes:
        audio: float32 [N] mono at 16 kHz, trimmed to whole 100 ms (N % 1600 == 0).
        sha256: hex digest of ``audio.tobytes()`` (the cache key of the engine's prompt features).
    """

    audio: np.ndarray
    sha256: str

    @property
    def duration_ms(self) -> int:
        return int(len(self.audio) * 1000 // INPUT_SAMPLE_RATE)


REF_AUDIO_MIN_S = 0.5
"""Shortest reference voice clip, seconds (docs/protocol.md §8.2)."""

REF_TRIM_SAMPLES = INPUT_SAMPLE_RATE // 10
"""A reference voice is trimmed to whole 100 ms = 1600 samples at 16 kHz (docs/protocol.md §8.3)."""


def reference_voice(audio: np.ndarray, max_s: float) -> ReferenceVoice:
    """The one reference-voice trim: a decoded clip -> :class:`ReferenceVoice` (docs/protocol.md §8.2-8.3).

    The bound check reads the clip as given: it must last :data:`REF_AUDIO_MIN_S` to ``max_s`` s
    (both inclusive). The clip is then cut to whole 100 ms (a multiple of :data:`REF_TRIM_SAMPLES`;
    0.5 s is whole, so an accepted clip keeps at least 0.5 s) and hashed.

    Args:
        audio: float32 [N] mono at :data:`INPUT_SAMPLE_RATE` (16 kHz), already decoded.
        max_s: the longest clip accepted, s.

    Returns:
        :class:`ReferenceVoice` with float32 [n] audio, n = N // 1600 * 1600, and its sha256.

    Raises:
        RefAudioLengthError: (code ``ref_audio_invalid``, a ``ValueError``) shorter than
            :data:`REF_AUDIO_MIN_S` or longer than ``max_s``.
    """
    import hashlib

    from duplexkit.errors import RefAudioLengthError

    dur = len(audio) / INPUT_SAMPLE_RATE
    if dur < REF_AUDIO_MIN_S or dur > max_s:
        raise RefAudioLengthError(dur, REF_AUDIO_MIN_S, max_s)
    n = len(audio) // REF_TRIM_SAMPLES * REF_TRIM_SAMPLES
    clip = np.ascontiguousarray(audio[:n], dtype=np.float32)
    return ReferenceVoice(audio=clip, sha256=hashlib.sha256(clip.tobytes()).hexdigest())


@dataclass(frozen=True)
class StreamConfig:
    """Per-stream model configuration. All fields have server-side defaults.

    Attributes:
        instructions: system prompt text (docs/model.md §5.1; ``None`` = the model default,
            "Streaming Omni Conversation.").
        ref_voice: reference voice for both the LLM prefix and the vocoder prompt; ``None`` =
            the engine's default voice.
        output_audio: False for ``output_modalities == ["text"]``: talker and code2wav are skipped.
        temperature: thinker sampling temperature (0.0 = greedy), docs/protocol.md §4.1 range 0–2.
        seed: optional RNG seed making sampling repeatable on the same hardware.
        force_listen_count: forced listen for the first N units after the stream starts and after
            each assistant turn ends (docs/protocol.md §4.1).
        seed_text: optional user text seeding the session prefix (docs/protocol.md §4.2).
    """

    instructions: Optional[str] = None
    ref_voice: Optional[ReferenceVoice] = None
    output_audio: bool = True
    temperature: float = 0.7
    seed: Optional[int] = None
    force_listen_count: int = 0
    seed_text: Optional[str] = None

    def replace(self, **changes) -> "StreamConfig":
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------
# Commands: Session -> engine
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineCommand:
    stream_id: str
    epoch: int


@dataclass(frozen=True)
class OpenStream(EngineCommand):
    """Open the stream (issued once, before any other command)."""

    config: StreamConfig = field(default_factory=StreamConfig)


@dataclass(frozen=True)
class AppendUnit(EngineCommand):
    """One duplex unit of input.

    Attributes:
        unit_index: 0, 1, 2, … per stream (never reset by epochs).
        audio: float32 [16560] for unit 0, float32 [16000] afterwards; 16 kHz mono.
        force_listen: the model must decide ``listen`` for this unit (answer policy
            ``on_request`` outside a requested response, or ``force_listen_count``).
        is_silence: True when the Session fed silence because input ran dry (§ "input running dry").
        force_speak: the model must decide ``speak`` for this unit (the forced unit of a requested
            response, docs/model.md §5.4: listen masked, boundary pass skipped, turn opened). Bound to the
            unit, unlike the older :class:`ForceSpeak` command, so it cannot race queued units.
            ``force_listen`` wins when both are set. It belongs to the command's ``epoch``: a unit
            decided in a later epoch (moved there by a :class:`CancelEpoch` while queued, or sent
            with an older epoch) is decided as ``force_listen``, so a cancelled response's forced
            unit never speaks.
        frame: optional RGB uint8 [H, W, 3] image riding this unit (docs/model.md §3.3).
    """

    unit_index: int = 0
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    force_listen: bool = False
    is_silence: bool = False
    frame: Optional[np.ndarray] = None
    force_speak: bool = False


@dataclass(frozen=True)
class ForceSpeak(EngineCommand):
    """``response.create``: the next decision must be ``speak`` (docs/model.md §5.4): the listen token is
    masked at the next decision, the boundary pass is skipped and the turn is marked open."""


@dataclass(frozen=True)
class CancelEpoch(EngineCommand):
    """Cancel everything of epochs older than ``epoch`` (the new epoch).

    The engine drops the stream's queued work at every stage, discards in-flight results, ends the
    model's current turn (talker KV and code2wav caches reset) and keeps the thinker's context
    consistent (the generated tokens stay in its KV, docs/model.md §5.2).
    """


@dataclass(frozen=True)
class UpdateStream(EngineCommand):
    """Replace the stream configuration. A changed ``instructions`` / ``ref_voice`` after units
    were consumed rebuilds the model context from the session prefix (docs/protocol.md §8.6)."""

    config: StreamConfig = field(default_factory=StreamConfig)


@dataclass(frozen=True)
class CloseStream(EngineCommand):
    """Free every per-stream state (KV caches, talker state, vocoder caches)."""


@dataclass(frozen=True)
class SpeakText(EngineCommand):
    """Say ``text`` in the stream's voice as the model's own words (teacher-forced speech, docs/tools.md).

    From the next unit the engine processes on, each unit is a forced ``speak`` whose decided tokens are
    the next tokens of ``text`` (at most ``tokens_per_unit`` per unit; the listen token and the
    boundary pass are skipped, as for ``force_speak``) instead of sampled ones. The tokens go into the
    thinker's KV with the hidden states of their own positions, so the talker speaks them and later
    units know what was said (docs/model.md §5.3, §6). After the last token ``<|turn_eos|>`` is fed
    and the turn ends: the outputs are the usual ``Decision`` (``speak``, ``turn_start`` on the first
    unit), ``TextDelta`` per unit, ``AudioChunk`` and ``TurnEnd("turn_eos")``, all tagged with this
    command's epoch. The unit's input audio is still heard (prefilled) as always.

    A ``CancelEpoch`` drops the text not yet spoken (the tokens already fed stay in the KV, like any
    cancelled turn). A second ``SpeakText`` of the same epoch is queued behind the first.

    Attributes:
        text: the text to speak (non-empty; plain text, special-token strings stay text).
        tokens_per_unit: tokens forced per 1-s unit (default 6: about a speaking pace of 2-3 English
            words per second; duplexkit's choice, the released model has no text-to-duplex rate).
    """

    text: str = ""
    tokens_per_unit: int = 6


@dataclass(frozen=True)
class ShellCommand(EngineCommand):
    """A request of the Session that the I/O shell (``duplexkit.driver.SessionDriver``) serves itself,
    not the engine stream: like ``OpenStream``, it never goes through :func:`apply_command`. The shell
    answers each with one output (below) fed back through ``Session.receive_engine_output``."""


@dataclass(frozen=True)
class DecideTools(ShellCommand):
    """Ask the tool decider whether the user's turn calls a tool (docs/tools.md, "Delegation").

    Attributes:
        request_id: the Session's id of this decision (echoed by :class:`ToolDecision`).
        messages: the conversation as :class:`ChatMessage` objects: text for earlier turns (the
            user's transcripts and the assistant's own transcripts) and, for the turn being decided,
            the user's audio (float32 16 kHz) and/or its transcript.
        tools: OpenAI function tools ``{"type": "function", "name", "description", "parameters"}``.
        tool_choice: ``auto`` | ``required`` | ``{"type": "function", "name": ...}`` (``none`` never
            asks).
    """

    request_id: str = ""
    messages: tuple = ()
    tools: tuple = ()
    tool_choice: Union[str, dict] = "auto"


@dataclass(frozen=True)
class TranscribeAudio(ShellCommand):
    """Transcribe one user turn's audio (``input_audio_transcription``, docs/tools.md).

    Attributes:
        item_id: the user item the transcript belongs to.
        audio: float32 [N] mono at 16 kHz (the turn's speech with the VAD's pre-roll).
        model: the recogniser asked for (``None`` = the server's default).
        language: optional ISO-639-1 hint; ``prompt``: optional text hint.
    """

    item_id: str = ""
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    model: Optional[str] = None
    language: Optional[str] = None
    prompt: Optional[str] = None


# --------------------------------------------------------------------------------------------
# Outputs: engine -> Session
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineOutput:
    stream_id: str
    epoch: int
    unit_index: int


@dataclass(frozen=True)
class Decision(EngineOutput):
    """The model's decision for one unit: ``listen`` or ``speak``.

    ``turn_start`` is True on the first speaking unit of a model turn.
    """

    decision: Literal["listen", "speak"] = "listen"
    turn_start: bool = False


@dataclass(frozen=True)
class TextDelta(EngineOutput):
    """Text the thinker decided to say in this unit (already detokenized, may be empty).

    Attributes:
        text: the unit's spoken text (the tokens after the unit's first decided token, docs/model.md §5.3).
        n_tokens: number of LLM tokens this delta accounts for (counted against the token cap).
    """

    text: str = ""
    n_tokens: int = 0


@dataclass(frozen=True)
class AudioChunk(EngineOutput):
    """One vocoder chunk.

    Attributes:
        audio: float32 [N] mono at 24 kHz. N is 20 160 for the first chunk of a turn made from a
            full 25-code block, 24 000 for later full blocks, variable for the final flush
            (docs/model.md §7.3).
        text: the transcript text spoken in this chunk (append-only; may be empty).
        final: True for the terminal flush of a model turn.
    """

    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    text: str = ""
    final: bool = False


@dataclass(frozen=True)
class TurnEnd(EngineOutput):
    """The model turn is over and all its audio has been emitted.

    ``reason``: ``turn_eos`` (the model ended it), ``cancelled`` (an epoch cancel ended it).
    """

    reason: Literal["turn_eos", "cancelled"] = "turn_eos"


@dataclass(frozen=True)
class UnitTimings(EngineOutput):
    """Per-unit stage timings in milliseconds, for metrics (never used for decisions).

    Keys used by the built-in engine: ``thinker_prefill_ms``, ``thinker_decode_ms``,
    ``decode_steps``, ``talker_ms``, ``talker_steps``, ``code2wav_ms``, ``queue_ms`` (sum of the
    stage queue waits), ``thinker_queue_ms`` / ``talker_queue_ms`` / ``code2wav_queue_ms`` (each
    stage's wait), ``thinker_done_ms`` / ``talker_done_ms`` (submit -> that stage's result handed
    on: with the stage times and queue waits they show any time spent between the stages),
    ``first_audio_ms`` (submit -> the unit's first audio chunk), ``total_ms``.
    """

    timings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineFailure(EngineOutput):
    """An output record: a failure confined to one stream (not an exception; formerly ``EngineError``).

    Attributes:
        code: a docs/protocol.md §9 error code (normally ``server_error``).
        message: human-readable text.
        fatal: True when the stream cannot continue (the Session then closes with 1011).
    """

    code: str = ErrorCode.SERVER_ERROR.value
    message: str = ""
    fatal: bool = False


@dataclass(frozen=True)
class ToolDecision(EngineOutput):
    """The tool decider's answer to :class:`DecideTools` (``unit_index`` is -1).

    Attributes:
        request_id: the decision's id.
        calls: :class:`ToolCall` objects (empty: no tool is called; the duplex model answers itself).
        text: text the decider wrote instead of (or before) a call; informational.
        error: set when the decider failed (then ``calls`` is empty).
        elapsed_ms: decider wall time, ms.
        final: False for a partial answer while the decider still writes: ``text`` is then the next
            piece of the reply (streamed answers to tool outputs, ``tool_choice`` none); the final
            decision (True) follows with the whole text.
    """

    request_id: str = ""
    calls: tuple = ()
    text: str = ""
    error: Optional[str] = None
    elapsed_ms: float = 0.0
    final: bool = True


@dataclass(frozen=True)
class Transcription(EngineOutput):
    """The transcript of one user turn (:class:`TranscribeAudio`; ``unit_index`` is -1).

    Attributes:
        item_id: the user item.
        text: the transcript ('' when ``error`` is set).
        error: why transcription failed, or None.
        elapsed_ms: recogniser wall time, ms.
    """

    item_id: str = ""
    text: str = ""
    error: Optional[str] = None
    elapsed_ms: float = 0.0


EngineError = EngineFailure
"""Deprecated alias of :class:`EngineFailure` (an output record, not an exception; the old name)."""


# --------------------------------------------------------------------------------------------
# Turn-based generation (chat completions, offline use)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    """One chat message. ``content`` is a list of parts: ``str`` (text), float32 16 kHz
    ``np.ndarray`` (audio) or uint8 ``np.ndarray`` [H, W, 3] (image)."""

    role: Literal["system", "user", "assistant"]
    content: list


@dataclass(frozen=True)
class ChatRequest:
    messages: list
    output_audio: bool = False
    max_tokens: int = 256
    temperature: float = 0.7
    seed: Optional[int] = None
    use_tts_template: Optional[bool] = None  # default: True when audio is requested or given
    enable_thinking: bool = False
    ref_voice: Optional[ReferenceVoice] = None
    tools: tuple = ()
    tool_choice: Union[str, dict] = "auto"


TOOL_CHOICES = ("auto", "none", "required")
"""The string values of :attr:`ChatRequest.tool_choice` (OpenAI's; a dict ``{"type": "function",
"name": ...}`` names one tool)."""


@dataclass(frozen=True)
class ToolCall:
    """One function call the model decided (docs/tools.md).

    Attributes:
        name: the tool's name (one of the request's ``tools``).
        arguments: the arguments as JSON text, valid against the tool's ``parameters`` schema
            (constrained decoding guarantees it for the built-in decider).
        call_id: optional id; the Session assigns ``call_<hex>`` ids when empty.
    """

    name: str
    arguments: str = "{}"
    call_id: str = ""


@dataclass(frozen=True)
class ChatDelta:
    """Streamed piece of a chat result: text and/or float32 24 kHz audio.

    The last delta of a stream carries ``finish_reason`` (``stop`` | ``length`` | ``tool_calls``) and ``usage``
    (``{"prompt_tokens", "completion_tokens", "total_tokens"}``, LLM tokens); earlier ones carry None.
    """

    text: str = ""
    audio: Optional[np.ndarray] = None
    finish_reason: Optional[Literal["stop", "length", "tool_calls"]] = None
    usage: Optional[dict] = None
    tool_calls: tuple = ()


@dataclass(frozen=True)
class ChatResult:
    """Whole chat result. ``audio`` is float32 [N] at 24 kHz or None; ``finish_reason`` is
    ``stop``, ``length`` or ``tool_calls`` (then ``tool_calls`` holds :class:`ToolCall` objects and
    ``text`` any text before them)."""

    text: str
    audio: Optional[np.ndarray]
    finish_reason: Literal["stop", "length", "tool_calls"]
    prompt_tokens: int
    completion_tokens: int
    tool_calls: tuple = ()


# --------------------------------------------------------------------------------------------
# Interfaces
# --------------------------------------------------------------------------------------------


@runtime_checkable
class EngineStream(Protocol):
    """One live duplex stream inside an engine.

    Every method is non-blocking and safe to call from the asyncio event loop: work is queued to
    the engine's stage workers. Outputs arrive through :meth:`outputs`, in order per stream.
    """

    stream_id: str

    def submit(self, command: EngineCommand) -> None:
        """Queue one command (AppendUnit, ForceSpeak, CancelEpoch, UpdateStream, CloseStream)."""

    def outputs(self) -> AsyncIterator[EngineOutput]:
        """Async iterator of outputs; ends after the stream is closed."""

    async def aclose(self) -> None:
        """Close the stream and wait until its state is freed."""


@runtime_checkable
class Engine(Protocol):
    """A duplex engine: many streams, one model."""

    model_id: str
    random_weights: bool

    async def open_stream(self, stream_id: str, config: StreamConfig) -> EngineStream: ...

    async def generate(self, request: ChatRequest) -> ChatResult: ...

    def generate_stream(self, request: ChatRequest) -> AsyncIterator[ChatDelta]: ...

    async def aclose(self) -> None: ...


def apply_command(stream: EngineStream, command: EngineCommand) -> None:
    """Forward one Session command to an open stream (OpenStream is handled by the shell, which
    calls :meth:`Engine.open_stream` itself)."""
    if isinstance(command, OpenStream):
        raise TypeError("OpenStream is handled by the shell via Engine.open_stream")
    if isinstance(command, ShellCommand):
        raise TypeError(f"{type(command).__name__} is served by the shell (SessionDriver), not the engine stream")
    stream.submit(command)


EngineCommandT = Union[OpenStream, AppendUnit, ForceSpeak, CancelEpoch, UpdateStream, CloseStream, SpeakText]
EngineOutputT = Union[Decision, TextDelta, AudioChunk, TurnEnd, UnitTimings, EngineFailure, ToolDecision, Transcription]
