"""Tools and user transcripts in a Session (docs/tools.md): the OpenAI Realtime function-calling flow
on top of a full-duplex model that was not trained to call tools.

Delegation
----------
MiniCPM-o 4.5 was trained with tool use in text (turn-based) mode only, so the duplex loop never
decides a call by itself. When a user turn ends (a server-VAD or client commit, or a user audio item)
and the session has tools with a ``tool_choice`` other than ``none``, the Session asks the *tool
decider* with a :class:`~duplexkit.engine.api.DecideTools` shell command (the conversation as text,
the turn itself as audio). The shell (``duplexkit.driver``) serves it, by default with the same
thinker weights in text mode and constrained decoding, and answers with a
:class:`~duplexkit.engine.api.ToolDecision`.

While a decision is pending the duplex model is held: units go out with ``force_listen`` (the *tool
gate*), so it cannot start an answer that the call would contradict. The gate also stays closed while
calls issued for the current user turn wait for their outputs. It opens when the decision says "no
call", when the outputs arrive, when the user starts a new turn, or after
:data:`TOOL_DECISION_TIMEOUT_MS` without a decision (then ``session.warning{tool_decision_timeout}``
and a late decision is dropped).

A decision with calls becomes a response whose output items are ``function_call`` items
(``conversation.item.added`` → ``response.output_item.added`` →
``response.function_call_arguments.delta`` / ``.done`` → ``response.output_item.done`` →
``conversation.item.done``, then ``response.done`` listing them). The arguments are checked against the
tool's JSON Schema before they go out; a call that fails the check is dropped with a
``session.warning{tool_call_invalid}``.

Speaking what the decider wrote
-------------------------------
A *filler* (``extra_body.tool_filler``, or the tool's own ``filler``; ``""`` = off) is spoken at once
after a call is issued, and the *answer* to a ``response.create`` that follows
``function_call_output`` items is written by the decider (``tool_choice`` none) and spoken; both go to
the engine as :class:`~duplexkit.engine.api.SpeakText` (teacher-forced speech in the session's voice),
inside ordinary responses: epoch-fenced, cancelled by barge-in, truncated to what was heard, in history.
A ``response.create`` that arrives while a filler speaks is queued and starts when the filler ends.

What the user said
------------------
With ``audio.input.transcription`` (beta ``input_audio_transcription``) set, each user turn's audio
goes to the recogniser as a :class:`~duplexkit.engine.api.TranscribeAudio` shell command; its
:class:`~duplexkit.engine.api.Transcription` becomes
``conversation.item.input_audio_transcription.delta`` + ``.completed`` (or ``.failed``) and the
transcript of the user item. Model names an OpenAI client sends (``whisper-1``, ``gpt-4o-transcribe``,
...) get the default recogniser and a ``session.warning{transcription_model_substituted}``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from duplexkit.engine.api import (
    INPUT_SAMPLE_RATE,
    ChatMessage,
    DecideTools,
    SpeakText,
    ToolDecision,
    TranscribeAudio,
    Transcription,
)
from duplexkit.protocol import (
    ConversationItemAdded,
    ConversationItemDone,
    ErrorCode,
    ErrorInfo,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    InputAudioTranscriptionCompleted,
    InputAudioTranscriptionDelta,
    InputAudioTranscriptionFailed,
    OutputItemAdded,
    OutputItemDone,
    ProtocolError,
    SessionWarning,
)
from duplexkit.session.conversation import _ConvItem
from duplexkit.session.machine import PhaseEvent

log = logging.getLogger("duplexkit.session")

__all__ = [
    "MAX_TOOLS", "MAX_TOOLS_BYTES", "MAX_TOOL_OUTPUT_CHARS", "DEFAULT_TOOL_FILLER", "DEFAULT_TOOL_PROGRESS",
    "TOOL_DECISION_TIMEOUT_MS", "TOOL_OUTPUT_WAIT_MS",
    "MAX_TURN_AUDIO_S", "DEFAULT_TRANSCRIPTION_MODEL", "Tools", "parse_tools", "parse_tool_choice",
    "parse_transcription", "decider_messages", "checked_calls",
]

MAX_TOOLS = 128
"""Most function tools per session or response (OpenAI Realtime accepts 128)."""

MAX_TOOLS_BYTES = 64 * 1024
"""Largest tool list, bytes of its compact JSON (names, descriptions and schemas together)."""

MAX_TOOL_OUTPUT_CHARS = 64 * 1024
"""Longest ``function_call_output.output``, characters."""

DEFAULT_TOOL_FILLER = "One moment, I'll check."
"""Spoken at once when a call is issued, unless the tool's ``filler`` or ``extra_body.tool_filler``
says otherwise (``""`` turns it off)."""

DEFAULT_TOOL_PROGRESS = {"after_ms": 6000, "text": "Still working on it."}
"""A progress line spoken while a call of the current turn has had no output for ``after_ms`` (ms
since the call was issued or the last progress line) and nothing else speaks
(``extra_body.tool_progress``; null turns it off)."""

TOOL_OUTPUT_WAIT_MS = 60_000
"""Longest a call's missing output holds the duplex model (ms since the call was issued): then the
gate opens, progress lines stop and ``session.warning{tool_output_timeout}`` is sent; a later output is
still accepted (a client that never answers calls, or dropped one, must not mute the model for good)."""

TOOL_DECISION_TIMEOUT_MS = 3000
"""Longest the tool gate holds the duplex model for one decision (ms of the Session clock)."""

MAX_TURN_AUDIO_S = 30
"""Longest user turn kept for the decider and the recogniser (s); older audio of a longer turn is dropped."""

DEFAULT_TRANSCRIPTION_MODEL = "minicpm-o"
"""The default recogniser: the thinker's own ASR in text mode (docs/tools.md)."""

_OWN_TRANSCRIPTION_MODELS = re.compile(r"^(minicpm-o|faster-whisper(:[A-Za-z0-9._-]+)?)$")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HISTORY_ITEMS = 24  # most recent conversation items given to the decider


def _err(code: ErrorCode, message: str, param: str, event_id: Optional[str]) -> ProtocolError:
    return ProtocolError(code, message, param=param, event_id=event_id)


def _remote_ref(schema: Any, depth: int = 0) -> Optional[str]:
    """The first ``$ref`` / ``$dynamicRef`` in ``schema`` that is not a local ``#...`` pointer (None if
    all are local). Depth-bounded: the tool list is at most :data:`MAX_TOOLS_BYTES` of JSON."""
    if depth > 64:
        return None
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k in ("$ref", "$dynamicRef") and isinstance(v, str) and not v.startswith("#"):
                return v
            found = _remote_ref(v, depth + 1)
            if found is not None:
                return found
    elif isinstance(schema, list):
        for v in schema:
            found = _remote_ref(v, depth + 1)
            if found is not None:
                return found
    return None


def parse_tools(tools: Any, param: str = "tools", event_id: Optional[str] = None) -> list:
    """Validate a list of OpenAI function tools and return them in the Realtime flat shape
    ``{"type": "function", "name", "description", "parameters"}`` (plus a duplexkit ``filler`` string
    when given). The chat-completions nesting ``{"type": "function", "function": {...}}`` is accepted.

    Raises:
        ProtocolError(``invalid_tools``): not a list, more than :data:`MAX_TOOLS` tools or
            :data:`MAX_TOOLS_BYTES` bytes, a tool that is not a function, a bad or duplicate name, a
            ``parameters`` that is not a valid JSON Schema of an object, or one with a non-local
            ``$ref`` (the server fetches no schema).
    """
    import jsonschema

    code = ErrorCode.INVALID_TOOLS
    if not isinstance(tools, list):
        raise _err(code, "tools must be a list of function tools", param, event_id)
    if len(tools) > MAX_TOOLS:
        raise _err(code, f"at most {MAX_TOOLS} tools are accepted, got {len(tools)}", param, event_id)
    try:
        size = len(json.dumps(tools, separators=(",", ":"), ensure_ascii=False).encode())
    except (TypeError, ValueError):
        raise _err(code, "tools must be JSON data", param, event_id) from None
    if size > MAX_TOOLS_BYTES:
        raise _err(code, f"the tool list is {size} bytes of JSON, over the {MAX_TOOLS_BYTES}-byte limit", param, event_id)
    out, names = [], set()
    for i, t in enumerate(tools):
        p = f"{param}[{i}]"
        if not isinstance(t, dict):
            raise _err(code, "each tool must be an object", p, event_id)
        if t.get("type", "function") != "function":
            raise _err(code, f"only function tools are supported, got type {t.get('type')!r}", f"{p}.type", event_id)
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise _err(code, "a tool name must be 1-64 letters, digits, '_' or '-'", f"{p}.name", event_id)
        if name in names:
            raise _err(code, f"duplicate tool name {name!r}", f"{p}.name", event_id)
        names.add(name)
        desc = fn.get("description", "")
        if desc is None:
            desc = ""
        if not isinstance(desc, str):
            raise _err(code, "a tool description must be a string", f"{p}.description", event_id)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise _err(code, "parameters must be a JSON Schema of an object ({\"type\": \"object\", ...})",
                       f"{p}.parameters", event_id)
        ref = _remote_ref(params)
        if ref is not None:
            raise _err(code, f"parameters may only use local references ('#/...'), got {ref!r}: the server fetches "
                       "no schema", f"{p}.parameters", event_id)
        try:
            jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator).check_schema(params)
        except jsonschema.SchemaError as e:
            raise _err(code, f"parameters is not a valid JSON Schema: {e.message}", f"{p}.parameters", event_id) from None
        tool = {"type": "function", "name": name, "description": desc, "parameters": params}
        filler = t.get("filler", fn.get("filler"))
        if filler is not None:
            if not isinstance(filler, str) or len(filler) > 500:
                raise _err(code, "a tool's filler must be a string of at most 500 characters", f"{p}.filler", event_id)
            tool["filler"] = filler
        out.append(tool)
    return out


def parse_tool_choice(choice: Any, tools: list, param: str = "tool_choice", event_id: Optional[str] = None):
    """Validate ``tool_choice``: ``auto`` | ``none`` | ``required`` | ``{"type": "function", "name": X}``
    (also ``{"type": "function", "function": {"name": X}}``) with X among ``tools``. Returns the string
    or ``{"type": "function", "name": X}``.

    Raises:
        ProtocolError(``invalid_tools``): any other value, or a named tool that is not in ``tools``.
    """
    code = ErrorCode.INVALID_TOOLS
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _err(code, f"tool_choice must be 'auto', 'none', 'required' or {{type: 'function', name}}, got {choice!r}",
                       param, event_id)
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if name is None and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
        if not isinstance(name, str):
            raise _err(code, "tool_choice {type: 'function'} needs a tool name", f"{param}.name", event_id)
        if name not in {t["name"] for t in tools}:
            raise _err(code, f"tool_choice names {name!r}, which is not among the tools", f"{param}.name", event_id)
        return {"type": "function", "name": name}
    raise _err(code, "tool_choice must be 'auto', 'none', 'required' or {type: 'function', name}", param, event_id)


def parse_transcription(tr: Optional[dict], err, warn) -> Optional[dict]:
    """``audio.input.transcription``: ``{model?, language?, prompt?}`` or null (off)."""
    if tr is None:
        return None
    model = tr.get("model") or DEFAULT_TRANSCRIPTION_MODEL
    if not isinstance(model, str):
        raise err(ErrorCode.BAD_EVENT, "transcription.model must be a string", "audio.input.transcription", "model")
    for k in ("language", "prompt"):
        if tr.get(k) is not None and not isinstance(tr[k], str):
            raise err(ErrorCode.BAD_EVENT, f"transcription.{k} must be a string", "audio.input.transcription", k)
    effective = model
    if not _OWN_TRANSCRIPTION_MODELS.match(model):
        effective = DEFAULT_TRANSCRIPTION_MODEL
    if effective != model and not model.startswith(("whisper", "gpt-4o")):
        # OpenAI's own names (whisper-1, gpt-4o-*-transcribe: what unmodified clients such as the Agents
        # SDK send by default) are served by the default silently: those clients reject unknown events
        warn("transcription_model_substituted",
             f"transcription model {model!r} is not served here: the user's speech is transcribed by "
             f"{DEFAULT_TRANSCRIPTION_MODEL!r} (the thinker's own ASR; 'faster-whisper' is the other choice)",
             "audio.input.transcription.model")
    return {"model": model, "effective_model": effective, "language": tr.get("language"),
            "prompt": tr.get("prompt")}


def decider_messages(instructions: Optional[str], items: list, truth_text, audio: Optional[np.ndarray]) -> list:
    """The conversation for the decider: the instructions, the recent items as text (user
    transcripts, what the assistant said as far as it was heard, calls and their outputs in the
    model's ``<tool_call>`` / ``<tool_response>`` text form), and the current turn's audio.
    ``items``: the conversation's items in order; ``truth_text(item)``: an assistant audio item's
    text as far as it was heard."""
    msgs = []
    if instructions:
        msgs.append(ChatMessage("system", [instructions]))
    for it in items[-_HISTORY_ITEMS:]:
        if it.kind == "function_call":
            msgs.append(ChatMessage("assistant", [
                "<tool_call>\n" + json.dumps({"name": it.name, "arguments": _loads(it.text)}) + "\n</tool_call>"]))
        elif it.kind == "function_call_output":
            msgs.append(ChatMessage("user", ["<tool_response>\n" + it.text + "\n</tool_response>"]))
        elif it.role == "assistant":
            text = truth_text(it) if it.kind == "output_audio" else it.text
            if text:
                msgs.append(ChatMessage("assistant", [text]))
        elif it.role in ("user", "system") and it.text:
            msgs.append(ChatMessage(it.role, [it.text]))
    if audio is not None and audio.size:
        # the turn being decided: its audio (the last user item has no transcript yet)
        if msgs and msgs[-1].role == "user" and items and items[-1].text:
            msgs.pop()
        msgs.append(ChatMessage("user", [audio]))
    return msgs


def checked_calls(calls: tuple, tools: list, notice) -> list:
    """The decider's calls whose tool exists and whose arguments are valid against its schema;
    the others are dropped with ``session.warning{tool_call_invalid}`` (``notice(warning)``)."""
    import jsonschema

    by_name = {t["name"]: t for t in tools}
    ok = []
    for c in calls:
        tool = by_name.get(c.name)
        why = None
        if tool is None:
            why = f"unknown tool {c.name!r}"
        else:
            try:
                args = json.loads(c.arguments or "{}")
                jsonschema.validate(args, tool["parameters"])
            except ValueError as e:
                why = f"arguments are not JSON: {e}"
            except jsonschema.ValidationError as e:
                why = f"arguments do not match the schema: {e.message}"
        if why is not None:
            notice(SessionWarning(code="tool_call_invalid", param="tools",
                                      message=f"the tool decider's call was dropped: {why}"))
            continue
        ok.append(c)
    return ok


class TurnAudio:
    """The current user turn's 16 kHz audio, float32, at most :data:`MAX_TURN_AUDIO_S` (older audio
    of a longer turn is dropped)."""

    def __init__(self) -> None:
        self._chunks: list = []
        self._n = 0

    def samples(self) -> int:
        return self._n

    def add(self, x16: np.ndarray) -> None:
        self._chunks.append(x16)
        self._n += x16.size
        cap = MAX_TURN_AUDIO_S * INPUT_SAMPLE_RATE
        while self._n - self._chunks[0].size >= cap:
            self._n -= self._chunks.pop(0).size

    def take(self) -> np.ndarray:
        """The turn's audio (float32 [n] at 16 kHz, n <= 30 s); the capture starts over."""
        a = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        self.drop()
        cap = MAX_TURN_AUDIO_S * INPUT_SAMPLE_RATE
        return np.ascontiguousarray(a[-cap:], dtype=np.float32)

    def drop(self) -> None:
        self._chunks, self._n = [], 0


@dataclass
class _Decision:
    """A pending DecideTools request."""

    id: str
    kind: str  # "turn" (a user turn ended), "response" (a response waits for it), "answer" (speak tool results)
    started_ms: float
    tools: list
    response_id: Optional[str] = None


@dataclass
class _Call:
    """A function call the Session issued."""

    call_id: str
    item_id: str
    name: str
    turn: int
    issued_ms: float = 0.0
    status: str = "pending"  # pending | answered | cancelled
    overdue: bool = False  # waited TOOL_OUTPUT_WAIT_MS: no longer holds the model


class Tools:
    """The tools and transcription part of :class:`~duplexkit.session.Session` (see the module
    docstring): the tool decider's requests, the calls issued, the tool gate, the current user
    turn's audio, transcriptions, fillers and answers spoken piece by piece.

    Args:
        s: the Session (its ``out`` outbox and the other parts' methods).
    """

    def __init__(self, s) -> None:
        self._s = s
        self._o = s.out
        self._decision: Optional[_Decision] = None
        self._calls: dict = {}
        self._turn_seq = 0
        self._turn_audio = TurnAudio()  # the current user turn's audio, while the decider or recogniser needs it
        self._queued_create = None  # (params, event_id) of a response.create waiting for a filler
        self._outputs_pending = False  # function_call_output items arrived since the last response
        self._last_audio: Optional[np.ndarray] = None
        self._progress_ms = 0.0  # when the last progress line was spoken
        self._transcribing: dict = {}  # user item id -> its audio's duration (s), until the transcript comes
        self._answer: Optional[dict] = None  # the answer being spoken piece by piece (_answer_piece)

    def queue_create(self, params, event_id: Optional[str]) -> bool:
        """A ``response.create`` while a filler speaks: queued (True) unless one already is."""
        if self._queued_create is not None:
            return False
        self._queued_create = (params, event_id)
        return True


    # -- settings -------------------------------------------------------------------------------
    def _tools_active(self, tools: Optional[list] = None, choice: Any = None) -> bool:
        tools = self._s.settings.tools if tools is None else tools
        choice = self._s.settings.tool_choice if choice is None else choice
        return bool(tools) and choice != "none"

    def _capturing_turn_audio(self) -> bool:
        return self._s.settings.transcription is not None or self._tools_active()

    # -- turn audio -----------------------------------------------------------------------------
    def capture_turn_audio(self, x16: np.ndarray) -> None:
        """Keep the current user turn's 16 kHz audio (at most :data:`MAX_TURN_AUDIO_S`) while the
        recogniser or the decider needs it."""
        if self._capturing_turn_audio():
            self._turn_audio.add(x16)

    def drop_turn_audio(self) -> None:
        self._turn_audio.drop()

    # -- the end of a user turn -----------------------------------------------------------------
    def user_turn_ending(self, now_ms: float) -> None:
        """Before a commit closes the turn's last unit: with tools, the turn's decision is opened now
        so that this unit already goes out under the tool gate (the DecideTools follows in
        :meth:`user_turn_ended`, once the turn's audio is complete)."""
        if self._tools_active() and self._s.resp.active() is None and self._decision is None and self._turn_audio.samples():
            self._decision = _Decision(id=self._o.ids.decision(), kind="turn", started_ms=float(now_ms),
                                       tools=self._s.settings.tools)

    def user_turn_ended(self, item_id: str, now_ms: float, audio: Optional[np.ndarray] = None) -> None:
        """A user item was committed: transcribe it and, with tools, ask the decider."""
        if audio is None:
            audio = self._turn_audio.take()
        self._turn_seq += 1
        self._last_audio = audio if audio.size and self._tools_active() else None
        tr = self._s.settings.transcription
        if tr is not None and audio.size:
            self._transcribing[item_id] = audio.size / INPUT_SAMPLE_RATE
            self._o.cmd(TranscribeAudio(self._o.stream_id, self._o.epoch, item_id=item_id, audio=audio,
                                      model=tr["effective_model"], language=tr["language"], prompt=tr["prompt"]))
        opened = self._decision if self._decision is not None and self._decision.kind == "turn" else None
        if self._tools_active() and audio.size and (self._s.resp.active() is None or self._s.resp.active().trigger == "model"):
            self._start_decision("turn", now_ms, self._s.settings.tools, self._s.settings.tool_choice, audio=audio,
                                 decision=opened)
        elif opened is not None:
            self._decision = None

    def _start_decision(self, kind: str, now_ms: float, tools: list, choice: Any,
                        audio: Optional[np.ndarray] = None, response_id: Optional[str] = None,
                        decision: Optional[_Decision] = None) -> None:
        d = decision or _Decision(id=self._o.ids.decision(), kind=kind, started_ms=float(now_ms), tools=tools,
                                  response_id=response_id)
        self._decision = d
        messages = decider_messages(self._s.settings.instructions, self._s.conv.items(), self._s.conv.truth_text, audio)
        self._o.cmd(DecideTools(self._o.stream_id, self._o.epoch, request_id=d.id, messages=tuple(messages),
                              tools=tuple({k: v for k, v in t.items() if k != "filler"} for t in tools),
                              tool_choice=choice))

    # -- gate, clock ----------------------------------------------------------------------------
    def gate(self) -> bool:
        """True while the duplex model must listen: a decision is pending; or the session has tools,
        no response is active and the user is speaking (server VAD) — the turn's decision comes at its
        end and no answer may start before it; or calls of the current user turn wait for their
        outputs and no response is active."""
        if self._decision is not None:
            return True
        if self._s.resp.active() is not None:
            return False
        if self._s.input.user_speaking() and self._tools_active():
            return True
        return bool(self._waiting_calls())

    def _waiting_calls(self) -> list:
        """Calls of the current user turn still waiting for their output (and not yet overdue)."""
        return [c for c in self._calls.values() if c.status == "pending" and c.turn == self._turn_seq and not c.overdue]

    def tick(self, now_ms: float) -> None:
        late = [c for c in self._waiting_calls() if now_ms - c.issued_ms >= TOOL_OUTPUT_WAIT_MS]
        for c in late:
            c.overdue = True
        if late:
            self._o.notice(SessionWarning(code="tool_output_timeout", param="tools", message=(
                f"no function_call_output for {', '.join(c.call_id for c in late)} after {TOOL_OUTPUT_WAIT_MS // 1000} s: "
                "the model is no longer held for it (a later output is still accepted)")))
        self._progress_tick(now_ms)
        d = self._decision
        if d is None or now_ms - d.started_ms < TOOL_DECISION_TIMEOUT_MS:
            return
        self._decision = None
        self._o.notice(SessionWarning(code="tool_decision_timeout", param="tools", message=(
            f"the tool decider gave no answer in {TOOL_DECISION_TIMEOUT_MS} ms: the model answers without tools "
            "this turn (a late decision is dropped)")))
        self._decision_without_call(d, now_ms)

    def _progress_tick(self, now_ms: float) -> None:
        """Speak the progress line (``extra_body.tool_progress``) when a call of the current turn has
        waited ``after_ms`` for its output since it was issued or since the last progress line, and
        nothing else is speaking or being decided."""
        tp = self._s.settings.tool_progress
        if tp is None or self._s.resp.active() is not None or self._decision is not None or self._s.input.user_speaking():
            return
        waiting = self._waiting_calls()
        if not waiting:
            return
        since = max(max(c.issued_ms for c in waiting), self._progress_ms)
        if now_ms - since >= tp["after_ms"]:
            self._progress_ms = float(now_ms)
            self._speak_response(tp["text"], "progress")

    def _decision_without_call(self, d: _Decision, now_ms: float) -> None:
        """Open the gate; a response waiting for the decision gets its forced unit now."""
        r = self._s.resp.active()
        if d.response_id is not None and r is not None and r.id == d.response_id and r.forced_unit is None:
            self._s.resp.set_forced_unit(self._s.input.close_unit(now_ms, force_speak=True))

    # -- decider and recogniser outputs ---------------------------------------------------------
    def on_tool_decision(self, out: ToolDecision, now_ms: float) -> None:
        d = self._decision
        if d is None or out.request_id != d.id:
            return  # stale: timed out, cancelled or superseded
        if not out.final:  # a piece of an answer being written: speak it as soon as it reads well
            if d.kind == "answer":
                self._answer_piece(d, out.text, now_ms)
            return
        self._decision = None
        if out.error:
            self._o.notice(SessionWarning(code="tool_decision_failed", param="tools",
                                      message=f"the tool decider failed ({out.error}); the model answers without tools"))
        if d.kind == "answer":
            self._answer_done(d, out, now_ms)
            return
        calls = checked_calls(out.calls, d.tools, self._o.notice)
        if not calls:
            self._decision_without_call(d, now_ms)
            return
        if d.kind == "response":
            r = self._s.resp.active()
            if r is None or r.id != d.response_id:
                return
            if r.opened:  # the model already answered in this response (a unit decided before the gate)
                self._o.notice(SessionWarning(code="tool_call_dropped", param="tools", message=(
                    "the tool decider's call came after the model had started answering; the call was dropped")))
                return
        else:
            if self._s.resp.active() is not None:
                # the model began an answer of its own (a unit decided before the gate closed): the
                # decider's call supersedes it
                self._o.fire(PhaseEvent.CANCEL)
                self._s.resp.cancel_active("turn_detected")
            self._s.resp.start("tool", self._s.settings.max_output_tokens)
        self._issue_calls(calls, d.tools)

    # -- answers, spoken as the decider writes them ---------------------------------------------
    def _answer_state(self, d: _Decision) -> Optional[dict]:
        r = self._s.resp.active()
        if r is None or r.id != d.response_id:
            return None
        if self._answer is None or self._answer["response_id"] != r.id:
            self._answer = {"response_id": r.id, "buf": "", "chunks": 0, "spoken": 0, "final": False}
        return self._answer

    def _answer_piece(self, d: _Decision, piece: str, now_ms: float) -> None:
        """Append a streamed piece of the answer; each stretch that reads well on its own (up to a
        sentence mark, or enough whole words) goes to the engine as its own ``SpeakText``."""
        a = self._answer_state(d)
        if a is None:
            return
        a["buf"] += piece
        chunk, a["buf"] = _speakable(a["buf"], first=a["chunks"] == 0)
        if chunk:
            self._answer_chunk(a, chunk, now_ms)

    def _answer_chunk(self, a: dict, text: str, now_ms: float) -> None:
        if not text.strip():
            return
        if a["chunks"] == 0:
            text = text.lstrip()
            self._speak_now(text, now_ms)  # the first one rides an early-closed unit at once
        else:
            self._o.cmd(SpeakText(self._o.stream_id, self._o.epoch, text=text))  # queued behind the previous
        a["chunks"] += 1

    def _answer_done(self, d: _Decision, out: ToolDecision, now_ms: float) -> None:
        """The decider finished the answer: speak what is left; with nothing spoken at all, the model
        answers itself (the response's forced unit); with everything spoken already, it ends now."""
        a = self._answer_state(d)
        if a is None:
            return
        rest = a["buf"] if a["chunks"] else (out.text or "")
        a["buf"] = ""
        self._answer_chunk(a, rest.rstrip(), now_ms)
        a["final"] = True
        if a["chunks"] == 0:
            self._answer = None
            self._decision_without_call(d, now_ms)
        elif a["spoken"] >= a["chunks"]:
            self._o.fire(PhaseEvent.TURN_END)
            self._s.resp.finish("completed", None)

    def answer_holds(self, reason: str) -> bool:
        """A model turn of the answer ended (one ``SpeakText`` spoken): True while more of the answer
        is still to come, so the response stays open across its pieces."""
        a, r = self._answer, self._s.resp.active()
        if a is None or r is None or r.id != a["response_id"] or reason != "turn_eos":
            return False
        a["spoken"] += 1
        return a["spoken"] < a["chunks"] or not a["final"]

    def _issue_calls(self, calls: list, tools: list) -> None:
        """The active response's output: one ``function_call`` item per call, then ``response.done``;
        then the filler."""
        r = self._s.resp.active()
        self._o.fire(PhaseEvent.TOOL_CALL)  # requested -> idle: the calls are the response's output
        outputs = []
        for i, c in enumerate(calls):
            call_id = c.call_id or self._o.ids.call()
            it = _ConvItem(id=self._s.conv.new_item_id(), role=None, kind="function_call", status="in_progress",
                           text=c.arguments or "{}", response_id=r.id, name=c.name, call_id=call_id)
            prev = self._s.conv.add(it)
            self._o.emit(ConversationItemAdded(previous_item_id=prev, item=self._s.conv.model(it).model_copy(
                update={"arguments": ""})))
            self._o.emit(OutputItemAdded(response_id=r.id, output_index=i, item=self._s.conv.model(it).model_copy(
                update={"arguments": ""})))
            self._o.emit(FunctionCallArgumentsDelta(response_id=r.id, item_id=it.id, output_index=i, call_id=call_id,
                                                  delta=it.text))
            self._o.emit(FunctionCallArgumentsDone(response_id=r.id, item_id=it.id, output_index=i, call_id=call_id,
                                                 name=c.name, arguments=it.text))
            it.status = "completed"
            model = self._s.conv.model(it)
            self._o.emit(OutputItemDone(response_id=r.id, output_index=i, item=model))
            self._o.emit(ConversationItemDone(previous_item_id=prev, item=model))
            self._calls[call_id] = _Call(call_id=call_id, item_id=it.id, name=c.name, turn=self._turn_seq,
                                         issued_ms=self._o.now_ms)
            outputs.append(model)
        self._s.resp.done_with_calls(outputs)
        by_name = {t["name"]: t for t in tools}
        fillers = [by_name[c.name].get("filler") for c in calls if c.name in by_name]
        filler = next((f for f in fillers if f is not None), self._s.settings.tool_filler)
        if filler:
            self._speak_response(filler, "filler")

    def _speak_response(self, text: str, trigger: str) -> None:
        """A response the Session speaks itself (teacher-forced ``SpeakText``): a filler or a progress line."""
        self._s.resp.start(trigger, "inf")
        self._speak_now(text, self._o.now_ms)

    def _speak_now(self, text: str, now_ms: float) -> None:
        """``SpeakText`` for the active response, then an early unit close (docs/concepts.md "Early
        unit close") so that the text rides a unit at once instead of waiting for the next 1-s
        boundary: the audio received so far (or zeros) goes out as the response's forced unit.

        Whole units still held back (input that arrived faster than real time, a barge-in hold) go
        out first, before the ``SpeakText``: the engine speaks queued text on the units after it in
        order, so otherwise a held unit would say the text and end its turn, and the forced unit
        after it would open a turn of the model's own while the call still waits (seen with Pipecat
        and the OpenAI SDK appending a whole utterance at once)."""
        self._s.input.flush_held(now_ms)
        self._o.cmd(SpeakText(self._o.stream_id, self._o.epoch, text=text))
        self._s.resp.set_forced_unit(self._s.input.close_unit(now_ms, force_speak=True))

    def on_transcription(self, out: Transcription) -> None:
        seconds = self._transcribing.pop(out.item_id, None)
        it = self._s.conv.get(out.item_id)
        if it is None or seconds is None:
            return  # the item was deleted meanwhile
        if out.error:
            self._o.emit(InputAudioTranscriptionFailed(item_id=it.id, content_index=0, error=ErrorInfo(
                type="transcription_error", code="transcription_failed", message=out.error)))
            return
        it.text = out.text
        if out.text:
            self._o.emit(InputAudioTranscriptionDelta(item_id=it.id, content_index=0, delta=out.text))
        self._o.emit(InputAudioTranscriptionCompleted(item_id=it.id, content_index=0, transcript=out.text,
                                                    usage={"type": "duration", "seconds": round(seconds, 3)}))

    # -- client events --------------------------------------------------------------------------
    def on_function_call_output(self, item, event_id: Optional[str]) -> None:
        """``conversation.item.create{type: function_call_output, call_id, output}``."""
        if not isinstance(item.call_id, str) or not item.call_id:
            raise _err(ErrorCode.BAD_EVENT, "a function_call_output item needs call_id", "item.call_id", event_id)
        if not isinstance(item.output, str):
            raise _err(ErrorCode.BAD_EVENT, "a function_call_output item needs output (a string)", "item.output", event_id)
        if len(item.output) > MAX_TOOL_OUTPUT_CHARS:
            raise _err(ErrorCode.BAD_EVENT, f"output is {len(item.output)} characters, over the "
                       f"{MAX_TOOL_OUTPUT_CHARS}-character limit", "item.output", event_id)
        c = self._calls.get(item.call_id)
        if c is None:
            raise _err(ErrorCode.CALL_NOT_FOUND, f"no function call with call_id {item.call_id!r} was issued in "
                       "this session", "item.call_id", event_id)
        if c.status == "answered":
            raise _err(ErrorCode.CALL_ALREADY_ANSWERED, f"call {item.call_id!r} already has an output",
                       "item.call_id", event_id)
        if c.status == "cancelled":
            raise _err(ErrorCode.CALL_CANCELLED, f"call {item.call_id!r} was cancelled (its function_call item "
                       "was deleted)", "item.call_id", event_id)
        if item.id is not None and self._s.conv.is_used(item.id):
            raise _err(ErrorCode.BAD_EVENT, f"item id {item.id!r} is already used", "item.id", event_id)
        c.status = "answered"
        it = _ConvItem(id=item.id or self._s.conv.new_item_id(), role=None, kind="function_call_output",
                       text=item.output, call_id=c.call_id)
        self._s.conv.add_done(it)
        self._outputs_pending = True

    def cancel_call_of(self, item_id: str) -> None:
        """A deleted ``function_call`` item cancels its call when no output came yet."""
        for c in self._calls.values():
            if c.item_id == item_id and c.status == "pending":
                c.status = "cancelled"

    def for_response(self, params, event_id: Optional[str]) -> tuple:
        """``response.create`` tools / tool_choice (validated), falling back to the session's."""
        tools = self._s.settings.tools
        if params is not None and params.tools is not None:
            tools = parse_tools(params.tools, "response.tools", event_id)
        choice = self._s.settings.tool_choice
        if params is not None and params.tool_choice is not None:
            choice = parse_tool_choice(params.tool_choice, tools, "response.tool_choice", event_id)
        elif choice != "none" and not isinstance(choice, str) and choice["name"] not in {t["name"] for t in tools}:
            choice = "auto"
        return tools, choice

    def plan_response(self, trigger: str, tools: list, choice: Any, now_ms: float) -> bool:
        """Decide how a response just created starts. Returns True when its forced unit must wait
        (the decider answers first), False for the usual forced unit at once.

        * after ``function_call_output`` items: the answer is written by the decider
          (``tool_choice`` none) and spoken (kind ``answer``);
        * a decision of the user turn that created it (server VAD ``create_response``) is still
          pending: the response takes it over;
        * a client ``response.create`` with ``tool_choice`` ``required`` or a named tool: decide first;
        * otherwise (``auto``): the model answers as usual.
        """
        r = self._s.resp.active()
        if self._outputs_pending:
            self._outputs_pending = False
            self._start_decision("answer", now_ms, [], "none", response_id=r.id)
            return True
        d = self._decision
        if d is not None and d.kind == "turn":
            d.kind, d.response_id = "response", r.id
            return True
        if trigger == "client" and tools and (choice == "required" or isinstance(choice, dict)):
            self._start_decision("response", now_ms, tools, choice, audio=self._last_turn_audio(), response_id=r.id)
            return True
        return False

    def _last_turn_audio(self) -> Optional[np.ndarray]:
        """The last user turn's audio (kept for a client ``response.create`` that must decide)."""
        return self._last_audio

    def response_finished(self, r, now_ms: float) -> None:
        """A response ended: a decision waiting for it is dropped; a queued ``response.create`` starts."""
        d = self._decision
        if d is not None and d.response_id == r.id:
            self._decision = None
        if self._answer is not None and self._answer["response_id"] == r.id:
            self._answer = None
        if self._queued_create is not None and r.trigger in ("filler", "progress") and not self._s.closed:
            params, event_id = self._queued_create
            self._queued_create = None
            self._s.resp.create(params, "client", event_id, now_ms)


_SENTENCE_END = re.compile(r"[.!?;:。！？；：\n]")
FIRST_PIECE_WORDS = 4
"""Whole words that make the first streamed piece of an answer speakable without a sentence mark
(a short first piece starts the audio soon; later pieces wait for a sentence mark or
:data:`PIECE_WORDS`)."""
PIECE_WORDS = 12


def _speakable(buf: str, first: bool) -> tuple:
    """Split ``buf`` into ``(piece to speak now, rest)``: up to its last sentence mark, else (when it
    has enough whole words) up to its last whole word; ``("", buf)`` when nothing reads well yet. The
    space between two pieces stays at the head of the rest, so the next piece is tokenized (and heard
    by the model) as the continuation it is."""
    marks = list(_SENTENCE_END.finditer(buf))
    if marks:
        cut = marks[-1].end()
        return buf[:cut].rstrip(), buf[cut:]
    words = buf.split()
    whole = words if buf[-1:].isspace() else words[:-1]
    if len(whole) >= (FIRST_PIECE_WORDS if first else PIECE_WORDS):
        cut = buf.rfind(whole[-1]) + len(whole[-1])
        return buf[:cut].rstrip(), buf[cut:]
    return "", buf


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
