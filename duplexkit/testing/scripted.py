"""A deterministic, torch-free scripted engine for protocol, client and server tests.

:class:`ScriptedEngine` implements the :class:`duplexkit.engine.api.Engine` protocol with a fixed
script instead of a model, so tests of the Session, the server and the clients run in milliseconds
and assert exact outcomes. It is *not* a model: every e2e test must also run the real tiny engine.

Script (per stream)
-------------------
* Each :class:`~duplexkit.engine.api.AppendUnit` yields one :class:`~duplexkit.engine.api.Decision`.
* ``listen`` when the unit is ``force_listen``; ``speak`` when the unit is ``force_speak``, when a
  :class:`ForceSpeak` is pending, when
  a model turn is open, or (model-native mode) after ``speak_after_units`` consecutive listening
  units; otherwise ``listen``.
* A speaking unit emits ``Decision(speak)``, one :class:`TextDelta` (``text_for_unit(k)``,
  ``tokens_per_unit`` tokens) and, when ``config.output_audio`` is true, one :class:`AudioChunk`
  of a sine tone with the real vocoder sizes (docs/model.md §7.3, docs/protocol.md §6.2): 20 160 samples on
  the first unit of a turn, 24 000 on later units. After ``units_per_turn`` speaking units the turn
  ends: a final flush chunk of 3 840 samples (the held-back cross-fade tail, ``final=True``) and
  :class:`TurnEnd` ``turn_eos``. The turn's total audio is therefore exactly
  ``24000 * units_per_turn`` samples at 24 kHz.
* :class:`SpeakText` (forced speech): from the next unit on, each unit speaks the next
  ``tokens_per_unit`` words of the given text instead of the script (forced listen does not stop it,
  as in the runtime): ``Decision(speak)`` (``turn_start`` when no turn was open), one
  :class:`TextDelta` with the unit's piece (the pieces concatenate to the text), the usual
  :class:`AudioChunk` sizes, and after the last piece the final flush and ``TurnEnd``. A second
  ``SpeakText`` is spoken after the first; a ``CancelEpoch`` drops what is not spoken yet; a
  ``SpeakText`` of an older epoch is ignored.
* :class:`UpdateStream` replaces the config; :class:`CloseStream` ends :meth:`outputs`.
* Every unit also emits :class:`UnitTimings` with ``total_ms`` = the simulated compute time.

Epochs and cancellation (the same rules as :class:`duplexkit.engine.runtime.StageRuntime`)
--------------------------------------------------------------------------------------------
``CancelEpoch(epoch=E)``, or any command carrying an epoch above the stream's, makes E current at
once, when it is *submitted*:

* a pending ``ForceSpeak`` is dropped, and the open turn ends without output (no ``TurnEnd``: the
  Session already closed the response);
* input units still queued are **kept and re-tagged with E** (they carry the user's barge-in
  speech, docs/concepts.md "Epochs") and are decided in E; a unit submitted later with an older
  epoch is also decided in the current one; such a unit's ``force_speak`` is void (it was the forced
  unit of a cancelled response): it is decided ``listen``, as a ``force_listen`` unit;
* a unit that was being computed (``unit_delay_s``) when the cancel came finishes without any
  output;
* a ``ForceSpeak`` for an epoch other than the current one is ignored.

Turn-based chat and tools
-------------------------
:meth:`ScriptedEngine.generate` answers ``chat_text``. With ``tools`` and ``tool_choice`` other than
``none`` each request takes the next entry of ``tool_script`` (a list, consumed one per request, or a
callable ``(messages, tools, tool_choice) -> entry``): ``None`` (no call) or ``(name, arguments
dict)`` (a call: ``finish_reason="tool_calls"``, no text, no audio). When ``required`` or a named
function is asked and the entry is ``None`` or the list ran out, the call goes to the named (or
first) tool with :func:`example_arguments` of its schema.

Failures and closing
--------------------
``fail_at_unit`` makes that unit fail (``fatal`` per ``fail_fatal``); :meth:`ScriptedStream.inject_fault`
fails the next unit of a stage as the runtime's hook does. A fatal failure (``thinker`` fault)
emits ``EngineFailure(fatal=True)`` and ends :meth:`ScriptedStream.outputs`; a ``talker`` or ``code2wav``
fault costs the turn only: the unit's ``Decision`` and ``TextDelta``, then a non-fatal
``EngineFailure``, then its ``UnitTimings``; the stream keeps serving. Commands to a closed or failed
stream are ignored, as in the runtime. Unlike the runtime, a ``CloseStream`` is taken in order:
units queued before it are still decided (so a test can submit a script and close at once).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, List, Optional, Union

import numpy as np

from duplexkit.testing.faults import FAULT_STAGES
from duplexkit.engine.api import (
    CODES_PER_CHUNK,
    SAMPLES_PER_CODE,
    OUTPUT_SAMPLE_RATE,
    AppendUnit,
    AudioChunk,
    CancelEpoch,
    ChatDelta,
    ChatRequest,
    ChatResult,
    CloseStream,
    Decision,
    EngineCommand,
    EngineFailure,
    EngineOutput,
    ForceSpeak,
    OpenStream,
    SpeakText,
    StreamConfig,
    TextDelta,
    ToolCall,
    TurnEnd,
    UnitTimings,
    UpdateStream,
)
from duplexkit.errors import ErrorCode

__all__ = ["ScriptedEngine", "ScriptedStream", "ScriptConfig", "FIRST_CHUNK_SAMPLES",
           "CHUNK_SAMPLES", "TAIL_SAMPLES", "FAULT_STAGES", "tone", "example_arguments", "speech_pieces"]



FIRST_CHUNK_SAMPLES = 20_160
"""First vocoder chunk of a turn: 840 ms at 24 kHz, 3 840 samples of cross-fade held back (docs/model.md §7.3)."""
CHUNK_SAMPLES = CODES_PER_CHUNK * SAMPLES_PER_CODE
"""Every later full 25-code chunk: 1 s at 24 kHz (docs/model.md §7.3)."""
TAIL_SAMPLES = CHUNK_SAMPLES - FIRST_CHUNK_SAMPLES
"""The held-back tail flushed by the final chunk of a turn (3 840 samples, 160 ms)."""


def _default_text(k: int) -> str:
    words = ["Hello", "there,", "this", "is", "a", "scripted", "reply", "from", "the", "fake", "engine."]
    return " ".join(words[(2 * k) % len(words):(2 * k) % len(words) + 2]) + " "


@dataclass
class ScriptConfig:
    """Parameters of the script (see the module docstring).

    Attributes:
        speak_after_units: model-native speaking after this many consecutive non-forced listening
            units (``None``: speak only when forced by ``ForceSpeak``).
        units_per_turn: speaking units per model turn before ``TurnEnd(turn_eos)``;
            ``None`` = never end a turn (like random weights).
        tokens_per_unit: LLM tokens each speaking unit accounts for (``TextDelta.n_tokens``).
        text_for_unit: ``k -> text`` for the k-th speaking unit of a turn (0-based).
        tone_hz: frequency of the sine tone in Hz; amplitude ``tone_amplitude`` (float32, [-1, 1]).
        unit_delay_s: simulated compute time per unit in seconds.
        fail_at_unit: unit index at which an ``EngineFailure`` is emitted instead of a decision.
        fail_fatal: whether that error is fatal (the Session then closes with 1011).
        speech: optional float32 [n] at 24 kHz spoken instead of the tone (looped,
            phase-continuous over the turn like the tone), e.g. a speech fixture for echo tests.
        chat_text / chat_tokens_per_word: the reply of :meth:`ScriptedEngine.generate`.
        tool_script: a list of ``None`` / ``(name, arguments dict)`` consumed one per chat request with
            tools, or a callable ``(messages, tools, tool_choice)`` returning one (module doc).
    """

    speak_after_units: Optional[int] = None
    units_per_turn: Optional[int] = 3
    tokens_per_unit: int = 4
    text_for_unit: Callable[[int], str] = _default_text
    tone_hz: float = 440.0
    tone_amplitude: float = 0.2
    unit_delay_s: float = 0.0
    fail_at_unit: Optional[int] = None
    fail_fatal: bool = False
    speech: Optional[np.ndarray] = None
    chat_text: str = "This is a scripted chat reply."
    chat_tokens_per_word: int = 1
    tool_script: Union[None, list, Callable[[list, tuple, Any], Any]] = None
    """Tool decisions of :meth:`ScriptedEngine.generate` (module doc, "Turn-based chat and tools")."""


def tone(n: int, start: int = 0, hz: float = 440.0, amplitude: float = 0.2,
         rate: int = OUTPUT_SAMPLE_RATE) -> np.ndarray:
    """A sine tone: float32 [n] at ``rate`` Hz, phase-continuous from sample ``start``."""
    t = (np.arange(n, dtype=np.float64) + start) / rate
    return (amplitude * np.sin(2 * math.pi * hz * t)).astype(np.float32)


def _voice(s: "ScriptConfig", n: int, start: int) -> np.ndarray:
    """The scripted voice: ``speech`` (looped) when given, else the tone; float32 [n] at 24 kHz."""
    if s.speech is None or len(s.speech) == 0:
        return tone(n, start, s.tone_hz, s.tone_amplitude)
    idx = (np.arange(n) + start) % len(s.speech)
    return np.asarray(s.speech, np.float32)[idx]


def speech_pieces(text: str, per_unit: int) -> List[tuple]:
    """``text`` cut into the pieces forced speech says per unit: ``(piece, n_words)`` of at most
    ``per_unit`` words each (a word with the whitespace before it; the text's trailing whitespace
    rides the last piece), so the pieces concatenate to ``text``."""
    words = re.findall(r"\s*\S+", text) or [text]
    words[-1] += text[len("".join(words)):]
    n = max(1, int(per_unit))
    return [("".join(words[i:i + n]), len(words[i:i + n])) for i in range(0, len(words), n)]


def _tool_entry(tool: Any) -> dict:
    if not isinstance(tool, dict):
        return {}
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return fn


def example_arguments(schema: Any) -> Any:
    """A small instance of a JSON Schema, valid for the common keywords (``examples``, ``default``,
    ``const`` and ``enum`` first; else the smallest value of the ``type``: an object of its required
    properties, ``minItems`` items, ``minLength`` letters, the number in range nearest 0, ``false``,
    ``null``; ``anyOf`` / ``oneOf`` take their first branch, ``allOf`` merges its object branches).
    ``pattern``, ``format`` and ``$ref`` are not followed: give such a schema ``examples``."""
    if not isinstance(schema, dict):
        return {}
    for key in ("examples",):
        if isinstance(schema.get(key), list) and schema[key]:
            return schema[key][0]
    for key in ("default", "const"):
        if key in schema:
            return schema[key]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return example_arguments(schema[key][0])
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        merged: dict = {"type": "object", "properties": {}, "required": []}
        for part in schema["allOf"]:
            if isinstance(part, dict):
                merged["properties"].update(part.get("properties") or {})
                merged["required"] += list(part.get("required") or [])
        return example_arguments(merged)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind is None:
        kind = "object" if "properties" in schema else None
    if kind == "object":
        props = schema.get("properties") or {}
        out = {k: example_arguments(props.get(k, {})) for k in schema.get("required") or []}
        extra = int(schema.get("minProperties", 0)) - len(out)
        for k in [k for k in props if k not in out][:max(0, extra)]:
            out[k] = example_arguments(props[k])
        return out
    if kind == "array":
        return [example_arguments(schema.get("items", {})) for _ in range(int(schema.get("minItems", 0)))]
    if kind == "string":
        return "a" * int(schema.get("minLength", 0))
    if kind in ("integer", "number"):
        lo, hi = schema.get("minimum"), schema.get("maximum")
        xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        v = 0
        if lo is not None and v < lo:
            v = math.ceil(lo)
        if xlo is not None and v <= xlo:
            v = math.floor(xlo) + 1
        if hi is not None and v > hi:
            v = math.floor(hi)
        if xhi is not None and v >= xhi:
            v = math.ceil(xhi) - 1
        return int(v) if kind == "integer" else float(v)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    return {}


class ScriptedStream:
    """One scripted duplex stream (implements :class:`duplexkit.engine.api.EngineStream`)."""

    def __init__(self, engine: "ScriptedEngine", stream_id: str, config: StreamConfig) -> None:
        self.stream_id = stream_id
        self.config = config
        self._engine = engine
        self._script = engine.script
        self._commands: deque = deque()  # [command, epoch tag] (units are re-tagged on cancel)
        self._wake = asyncio.Event()
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._failed = False
        self._ended = False  # the end-of-outputs marker was consumed
        self._done = asyncio.Event()
        self._fault: Optional[str] = None
        # script state
        self._epoch = 0  # the current epoch (advanced when a command is submitted)
        self._end_turn = False  # a cancel ended the turn; applied before the next unit
        self._force_speak_epoch: Optional[int] = None
        self._in_turn = False
        self._turn_units = 0
        self._turn_samples = 0
        self._listen_run = 0
        self._forced: deque = deque()  # forced speech: one deque of (piece, n_words) per SpeakText
        self.units_seen: list[AppendUnit] = []
        self.commands_seen: list[EngineCommand] = []
        self._task = asyncio.get_running_loop().create_task(self._run())

    # -- EngineStream -------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The stream's current epoch."""
        return self._epoch

    @property
    def closed(self) -> bool:
        return self._done.is_set()

    def submit(self, command: EngineCommand) -> None:
        """Queue one command; non-blocking. Commands to a closed or failed stream are ignored.

        Raises:
            TypeError: ``OpenStream`` (the shell calls :meth:`ScriptedEngine.open_stream`).
        """
        if isinstance(command, OpenStream):
            raise TypeError("OpenStream is handled by Engine.open_stream")
        if self._closed:
            return
        if isinstance(command, SpeakText) and command.epoch < self._epoch:
            return  # an older epoch's text is stale
        if isinstance(command, CloseStream):
            self._closed = True
        elif command.epoch > self._epoch:
            self._cancel(command.epoch)
        if isinstance(command, ForceSpeak):
            if command.epoch == self._epoch:
                self._force_speak_epoch = self._epoch
        elif not isinstance(command, CancelEpoch):
            self._commands.append([command, self._epoch])
            self._wake.set()

    def inject_fault(self, stage: Optional[str]) -> None:
        """Fail this stream's next work item in ``stage`` (thinker | talker | code2wav), as
        :func:`duplexkit.testing.inject_fault` does on the runtime; ``None`` clears it.
        A thinker fault is fatal; a talker/code2wav fault hits the next speaking unit with audio."""
        if stage is not None and stage not in FAULT_STAGES:
            raise ValueError(f"stage must be one of {FAULT_STAGES}")
        self._fault = stage

    def _cancel(self, epoch: int) -> None:
        self._epoch = epoch
        self._force_speak_epoch = None
        self._end_turn = True
        self._forced.clear()  # forced speech not yet spoken is dropped (queued SpeakText: by its tag)
        for item in self._commands:
            if isinstance(item[0], AppendUnit):
                item[1] = epoch  # input is never discarded (docs/protocol.md §7.2)

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        """Async iterator of outputs, in order; ends after close (at once when it already ended)."""
        while not self._ended:
            item = await self._outputs.get()
            if item is None:
                self._ended = True
                return
            yield item

    async def aclose(self) -> None:
        if not self._closed:
            self.submit(CloseStream(self.stream_id, self._epoch))
        await self._done.wait()

    # -- script -------------------------------------------------------------------------------
    def _emit(self, out: EngineOutput) -> None:
        self._outputs.put_nowait(out)

    async def _run(self) -> None:
        try:
            while True:
                if not self._commands:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                cmd, tag = self._commands.popleft()
                self.commands_seen.append(cmd)
                if isinstance(cmd, CloseStream):
                    break
                if isinstance(cmd, UpdateStream):
                    self.config = cmd.config
                elif isinstance(cmd, SpeakText):
                    if tag == self._epoch:
                        self._forced.append(deque(speech_pieces(cmd.text, cmd.tokens_per_unit)))
                elif isinstance(cmd, AppendUnit):
                    if self._end_turn:
                        self._end_turn = False
                        self._end_turn_silently()
                    await self._unit(cmd, tag)
                    if self._failed:
                        break
        except Exception as exc:  # pragma: no cover - defensive: surface as a fatal stream error
            self._emit(EngineFailure(self.stream_id, self._epoch, -1, code=ErrorCode.SERVER_ERROR.value,
                                   message=f"scripted engine crashed: {exc!r}", fatal=True))
        finally:
            self._closed = True
            self._engine._streams.pop(self.stream_id, None)
            self._outputs.put_nowait(None)
            self._done.set()

    def _end_turn_silently(self) -> None:
        self._in_turn = False
        self._turn_units = 0
        self._turn_samples = 0
        self._listen_run = 0

    def _fail(self, ep: int, ui: int, message: str) -> None:
        """A fatal failure: the error, then the end of :meth:`outputs` (as the runtime)."""
        self._emit(EngineFailure(self.stream_id, ep, ui, code=ErrorCode.SERVER_ERROR.value, message=message,
                                 fatal=True))
        self._failed = True
        self._closed = True

    async def _unit(self, cmd: AppendUnit, tag: int) -> None:
        s = self._script
        self.units_seen.append(cmd)
        if s.unit_delay_s:
            await asyncio.sleep(s.unit_delay_s)
        sid, ep, ui = self.stream_id, tag, cmd.unit_index
        if ep != self._epoch:
            return  # cancelled while computing: finishes without output (as the runtime)
        timings = {"total_ms": s.unit_delay_s * 1000.0, "queue_ms": 0.0}
        if self._fault == "thinker":
            self._fault = None
            self._fail(ep, ui, f"thinker failed: InjectedFault: injected fault in thinker for stream {sid}")
            return
        if s.fail_at_unit is not None and ui == s.fail_at_unit:
            if s.fail_fatal:
                self._fail(ep, ui, f"scripted failure at unit {ui}")
            else:
                self._emit(EngineFailure(sid, ep, ui, code=ErrorCode.SERVER_ERROR.value,
                                       message=f"scripted failure at unit {ui}", fatal=False))
            return
        force_speak = self._force_speak_epoch is not None and self._force_speak_epoch == ep
        # the unit's force_speak belongs to the epoch it was submitted in (as in the runtime): a unit
        # re-tagged by a cancel was a cancelled response's forced unit, and listens
        cancelled_force = cmd.force_speak and cmd.epoch != ep
        forced = bool(self._forced)
        speak = False
        if forced:
            speak = True
        elif cmd.force_listen or cancelled_force:
            speak = False
        elif cmd.force_speak or force_speak or self._in_turn:
            speak = True
        elif s.speak_after_units is not None and self._listen_run >= s.speak_after_units:
            speak = True
        if not speak:
            self._listen_run += 1
            self._emit(Decision(sid, ep, ui, decision="listen"))
            self._emit(UnitTimings(sid, ep, ui, timings=timings))
            return
        if force_speak:
            self._force_speak_epoch = None
        self._listen_run = 0
        turn_start = not self._in_turn
        if turn_start:
            self._in_turn = True
            self._turn_units = 0
            self._turn_samples = 0
        k = self._turn_units
        if forced:
            text, n_tokens = self._forced[0].popleft()
            end = not self._forced[0]
            if end:
                self._forced.popleft()
        else:
            text, n_tokens = s.text_for_unit(k), s.tokens_per_unit
            end = s.units_per_turn is not None and k + 1 >= s.units_per_turn
        self._emit(Decision(sid, ep, ui, decision="speak", turn_start=turn_start))
        self._emit(TextDelta(sid, ep, ui, text=text, n_tokens=n_tokens))
        if self.config.output_audio and self._fault in ("talker", "code2wav"):
            stage, self._fault = self._fault, None
            self._emit(EngineFailure(sid, ep, ui, code=ErrorCode.SERVER_ERROR.value,
                                   message=f"{stage} failed: InjectedFault: injected fault in {stage} for stream {sid}",
                                   fatal=False))
            self._turn_samples = 0  # the stage's turn state is dropped
            self._turn_units += 1
            self._emit(UnitTimings(sid, ep, ui, timings=timings))
            return
        if self.config.output_audio:
            n = FIRST_CHUNK_SAMPLES if k == 0 else CHUNK_SAMPLES
            self._emit(AudioChunk(sid, ep, ui, audio=_voice(s, n, self._turn_samples),
                                  text=text, final=False))
            self._turn_samples += n
            if end:
                self._emit(AudioChunk(sid, ep, ui, audio=_voice(s, TAIL_SAMPLES, self._turn_samples), text="",
                                      final=True))
                self._turn_samples += TAIL_SAMPLES
        self._turn_units += 1
        if end:  # the unit's outputs end with UnitTimings, as the runtime's (engine/api.py)
            self._emit(TurnEnd(sid, ep, ui, reason="turn_eos"))
            self._end_turn_silently()
        self._emit(UnitTimings(sid, ep, ui, timings=timings))


class ScriptedEngine:
    """A deterministic scripted :class:`duplexkit.engine.api.Engine` (no torch, no weights).

    Args:
        script: a :class:`ScriptConfig`; keyword arguments override its fields
            (e.g. ``ScriptedEngine(speak_after_units=2, units_per_turn=3)``).
        model_id: the served model id (default ``"scripted"``).
        random_weights: what the engine reports as ``random_weights`` (``/health``, the CLI notices);
            default False: the script does decide to listen and to end turns. True lets clients'
            random-weights notices be tested without torch (``serve scripted --scripted random_weights=true``).
    """

    random_weights = False
    supports_audio = True  # set False to act like a checkpoint without a vocoder

    def __init__(self, script: Optional[ScriptConfig] = None, *, model_id: str = "scripted",
                 random_weights: bool = False, **overrides) -> None:
        self.random_weights = bool(random_weights)
        self.script = script or ScriptConfig()
        for key, value in overrides.items():
            if not hasattr(self.script, key):
                raise TypeError(f"unknown ScriptConfig field {key!r}")
            setattr(self.script, key, value)
        self.model_id = model_id
        self._streams: dict[str, ScriptedStream] = {}
        self.streams_opened = 0
        self.chat_requests: list[ChatRequest] = []
        self._closed = False

    async def open_stream(self, stream_id: str, config: StreamConfig) -> ScriptedStream:
        """Open a stream. Raises ``ValueError`` for a duplicate open id, ``RuntimeError`` after aclose."""
        if self._closed:
            raise RuntimeError("engine is closed")
        if stream_id in self._streams:
            raise ValueError(f"stream {stream_id!r} already open")
        st = ScriptedStream(self, stream_id, config)
        self._streams[stream_id] = st
        self.streams_opened += 1
        return st

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # -- chat ---------------------------------------------------------------------------------
    def _chat_plan(self, request: ChatRequest) -> tuple[list[str], str]:
        words = self.script.chat_text.split()
        budget = max(1, request.max_tokens // max(1, self.script.chat_tokens_per_word))
        finish = "stop"
        if len(words) > budget:
            words, finish = words[:budget], "length"
        return [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)], finish

    @staticmethod
    def _prompt_tokens(request: ChatRequest) -> int:
        n = 0
        for m in request.messages:
            for part in getattr(m, "content", []) or []:
                if isinstance(part, str):
                    n += len(part.split())
                elif isinstance(part, np.ndarray):
                    n += int(math.ceil(part.shape[0] / 1600)) if part.ndim == 1 else 64
        return n

    def _audio_for(self, n_words: int) -> np.ndarray:
        # 0.4 s of tone per word, a whole number of samples at 24 kHz
        return tone(int(0.4 * OUTPUT_SAMPLE_RATE) * max(1, n_words), 0, self.script.tone_hz, self.script.tone_amplitude)

    def _tool_call(self, request: ChatRequest) -> Optional[ToolCall]:
        """The scripted tool decision of a chat request (module doc, "Turn-based chat and tools"), or
        None (answer in text). Consumes one ``tool_script`` entry per request with tools."""
        choice = request.tool_choice
        if not request.tools or choice == "none":
            return None
        script = self.script.tool_script
        entry = None
        if callable(script):
            entry = script(list(request.messages), tuple(request.tools), choice)
        elif script:
            entry = script.pop(0)
        if entry is not None:
            name, args = entry
            return ToolCall(name=str(name), arguments=json.dumps(args, ensure_ascii=False))
        if choice == "auto":
            return None
        tools = [_tool_entry(t) for t in request.tools]
        if isinstance(choice, dict):
            want = _tool_entry(choice).get("name")
            tools = [t for t in tools if t.get("name") == want] or tools
        tool = tools[0]
        return ToolCall(name=str(tool.get("name", "")),
                        arguments=json.dumps(example_arguments(tool.get("parameters") or {"type": "object"}),
                                             ensure_ascii=False))

    async def generate(self, request: ChatRequest) -> ChatResult:
        """Turn-based generation: the scripted chat text (cut to ``max_tokens`` words, then
        ``finish_reason="length"``) and, with ``output_audio``, 0.4 s of tone per word (float32 24 kHz).
        A scripted tool call (module doc) comes back in ``tool_calls`` with ``finish_reason="tool_calls"``,
        no text and no audio (an empty array with ``output_audio``)."""
        self.chat_requests.append(request)
        call = self._tool_call(request)
        if call is not None:
            if self.script.unit_delay_s:
                await asyncio.sleep(self.script.unit_delay_s)
            return ChatResult(text="", audio=np.zeros(0, np.float32) if request.output_audio else None,
                              finish_reason="tool_calls", prompt_tokens=self._prompt_tokens(request),
                              completion_tokens=max(1, len(call.arguments.split())), tool_calls=(call,))
        pieces, finish = self._chat_plan(request)
        if self.script.unit_delay_s:
            await asyncio.sleep(self.script.unit_delay_s)
        text = "".join(pieces)
        if request.enable_thinking:
            text = "<think>\nscripted thought\n</think>\n\n" + text
        audio = self._audio_for(len(pieces)) if request.output_audio else None
        return ChatResult(text=text, audio=audio, finish_reason=finish,  # type: ignore[arg-type]
                          prompt_tokens=self._prompt_tokens(request), completion_tokens=len(pieces))

    async def generate_stream(self, request: ChatRequest) -> AsyncIterator[ChatDelta]:
        """Streamed :meth:`generate`: one ``ChatDelta`` per word; with audio, each word's 0.4 s of
        tone rides the same delta. A scripted tool call is one last delta with ``tool_calls``."""
        self.chat_requests.append(request)
        call = self._tool_call(request)
        if call is not None:
            prompt, n = self._prompt_tokens(request), max(1, len(call.arguments.split()))
            yield ChatDelta(finish_reason="tool_calls", usage={"prompt_tokens": prompt, "completion_tokens": n,
                                                               "total_tokens": prompt + n}, tool_calls=(call,))
            return
        pieces, finish = self._chat_plan(request)
        if request.enable_thinking:
            yield ChatDelta(text="<think>\nscripted thought\n</think>\n\n")
        pos = 0
        n = int(0.4 * OUTPUT_SAMPLE_RATE)
        for p in pieces:
            if self.script.unit_delay_s:
                await asyncio.sleep(self.script.unit_delay_s / max(1, len(pieces)))
            audio = None
            if request.output_audio:
                audio = tone(n, pos, self.script.tone_hz, self.script.tone_amplitude)
                pos += n
            yield ChatDelta(text=p, audio=audio)
        prompt = self._prompt_tokens(request)
        yield ChatDelta(finish_reason=finish, usage={"prompt_tokens": prompt, "completion_tokens": len(pieces),  # type: ignore[arg-type]
                                                     "total_tokens": prompt + len(pieces)})

    def chat_finish_reason(self, request: ChatRequest) -> str:
        """The finish reason a text answer to ``request`` gets (``stop`` | ``length``; no tool decision)."""
        return self._chat_plan(request)[1]

    async def aclose(self) -> None:
        self._closed = True
        for st in list(self._streams.values()):
            await st.aclose()
