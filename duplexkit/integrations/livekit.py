"""A LiveKit Agents realtime model backed by a duplexkit session (docs/integrations.md, "LiveKit Agents").

``RealtimeModel`` implements ``livekit.agents.llm.RealtimeModel`` (tested with livekit-agents 1.8.9), so
``AgentSession(llm=RealtimeModel(...))`` runs a full-duplex duplexkit session:

* **inline**: ``RealtimeModel(engine=engine)`` drives a :class:`~duplexkit.clients.InlineDuplexClient`
  over an engine in this process (a ``DuplexEngine`` or the torch-free
  :class:`~duplexkit.testing.ScriptedEngine`); no server, no socket;
* **remote**: ``RealtimeModel(url="ws://host:8000")`` drives a :class:`~duplexkit.clients.DuplexClient`
  against ``duplexkit serve`` (or any server speaking docs/protocol.md).

What maps to what (LiveKit's names on the left):

========================================  ==================================================================
``push_audio(rtc.AudioFrame)``            ``input_audio_buffer.append`` (any rate 8-48 kHz, mono or mixed down
                                          to mono; the client resamples to the session's 16 kHz)
``input_speech_started`` / ``_stopped``   the session's server VAD (``input_audio_buffer.speech_started`` /
                                          ``speech_stopped``): a barge-in detected by duplexkit becomes
                                          LiveKit's interruption, so LiveKit stops the playout
``input_audio_transcription_completed``   ``conversation.item.input_audio_transcription.delta`` (partial,
                                          ``is_final=False``) and ``.completed`` (final)
``generation_created``                    ``response.created`` (every trigger: ``model``, ``server_vad``,
                                          ``tool``, ``filler``, ``progress``, ``client``); its message stream
                                          carries 24 kHz mono pcm16 ``rtc.AudioFrame`` s and the transcript,
                                          its function stream the decider's ``function_call`` items
``update_chat_ctx``                       ``conversation.item.create`` for new ``FunctionCallOutput`` s and
                                          text messages (tool results go back this way),
                                          ``conversation.item.delete`` for assistant messages LiveKit dropped
``generate_reply``                        ``response.create`` (per-response ``tools`` / ``tool_choice``); after
                                          tool outputs duplexkit answers from them (docs/tools.md)
``interrupt``                             ``response.cancel`` of the active response
``truncate``                              ``playback.ack{played_ms, truncate:true}``: the history keeps what
                                          LiveKit played (docs/concepts.md, playback truth)
``update_tools`` / ``update_options``     ``session.update{tools, tool_choice}``
``update_instructions``                   ``session.update{instructions}`` (accepted before the first unit
                                          reaches the model; later ones raise :class:`DuplexRealtimeError`)
``error``                                 the session's ``error`` events and failed responses
========================================  ==================================================================

The tools run in LiveKit (``@function_tool``, its normal function-call path): the duplexkit client
is created without ``tools=`` and only declares their schemas, so nothing runs a tool twice.

Playback truth: duplexkit keeps in its history only what the user heard. This plugin reports a
response as heard in full when it is done (``playback.ack``, not final) and corrects that with
LiveKit's own playout position when LiveKit truncates an interrupted message (final).

The module imports without ``livekit-agents``; using a class then raises
:class:`~duplexkit.errors.OptionalDependencyError` (``pip install 'duplexkit[livekit]'``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from duplexkit.engine.api import OUTPUT_SAMPLE_RATE
from duplexkit.errors import DuplexError, DuplexkitError, ErrorCode, OptionalDependencyError, canonical_error_code

try:  # the extra: pip install 'duplexkit[livekit]'
    from livekit import rtc
    from livekit.agents import llm, utils as lk_utils
    from livekit.agents.llm.remote_chat_context import RemoteChatContext

    _LIVEKIT_IMPORT_ERROR: Optional[ModuleNotFoundError] = None
    _ModelBase: Any = llm.RealtimeModel
    _SessionBase: Any = llm.RealtimeSession
    _RealtimeErrorBase: Any = llm.RealtimeError
except ModuleNotFoundError as _exc:  # pragma: no cover - exercised in the main venv only
    if not (_exc.name or "").startswith("livekit"):
        raise
    _LIVEKIT_IMPORT_ERROR = _exc
    rtc = llm = lk_utils = RemoteChatContext = None  # type: ignore[assignment]

    class _Missing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise OptionalDependencyError("livekit.agents", "livekit", "duplexkit.integrations.livekit")

    _ModelBase = _SessionBase = _Missing
    _RealtimeErrorBase = Exception

logger = logging.getLogger("duplexkit.integrations.livekit")

__all__ = ["RealtimeModel", "RealtimeSession", "DuplexRealtimeError", "OUTPUT_SAMPLE_RATE", "DEFAULT_TURN_DETECTION"]

# OUTPUT_SAMPLE_RATE (duplexkit.engine.api): rate in Hz of the audio frames this plugin hands to LiveKit
# (mono pcm16; docs/protocol.md §6.2)

DEFAULT_TURN_DETECTION: dict = {"type": "server_vad", "create_response": False, "interrupt_response": True}
"""The session's turn detection unless the model is given another: duplexkit's server VAD finds the
user's turns and barge-ins, the full-duplex model decides when to answer (docs/concepts.md, mode 2)."""

_REPLY_TIMEOUT_S = 15.0  # generate_reply: response.created must come by then (a filler may go first)
_ITEM_TIMEOUT_S = 5.0  # update_chat_ctx: conversation.item.added per created item


class DuplexRealtimeError(DuplexkitError, _RealtimeErrorBase):
    """A request of LiveKit's realtime interface that the duplexkit session refused or did not answer
    in time (``generate_reply``, ``update_chat_ctx``, ``update_instructions``, ``update_tools``).

    It is a ``livekit.agents.llm.RealtimeError`` too, so LiveKit's ``AgentSession`` handles it as
    it handles any realtime model's failure.

    Attributes:
        code: the session's error code (docs/protocol.md §9, e.g. ``bad_event``), or ``timeout``.
        message: what was refused.
    """

    def __init__(self, message: str, *, code: str = ErrorCode.SERVER_ERROR.value) -> None:
        Exception.__init__(self, message)
        self.code = code
        self.message = message


@dataclass
class _Message:
    item_id: str
    text_ch: Any
    audio_ch: Any
    modalities: "asyncio.Future[list]"
    transcript: str = ""
    samples: int = 0


@dataclass
class _Generation:
    response_id: str
    message_ch: Any
    function_ch: Any
    messages: dict = field(default_factory=dict)
    samples: int = 0
    item_id: Optional[str] = None

    def close(self) -> None:
        for m in self.messages.values():
            if not m.modalities.done():
                m.modalities.set_result(["audio", "text"])
            m.text_ch.close()
            m.audio_ch.close()
        self.function_ch.close()
        self.message_ch.close()


def _tool_schemas(tools: list) -> list:
    """LiveKit tools -> OpenAI-style function tool dicts (``{type, name, description, parameters}``)."""
    out = []
    for t in tools:
        if isinstance(t, llm.FunctionTool):
            out.append(llm.utils.build_legacy_openai_schema(t, internally_tagged=True))
        elif isinstance(t, llm.RawFunctionTool):
            d = dict(t.info.raw_schema)
            d.pop("meta", None)
            d["type"] = "function"
            out.append(d)
        else:
            logger.warning("duplexkit sessions take function tools only; ignoring %r", t)
    return out


def _tool_choice(choice: Any) -> Union[str, dict, None]:
    """LiveKit's ``ToolChoice`` -> the session's ``tool_choice``."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function") or {}
        return {"type": "function", "name": fn.get("name") or choice.get("name")}
    return "auto"


def _item_to_livekit(item: dict) -> Any:
    """A session conversation item (dict) -> a LiveKit chat item, or None for kinds LiveKit lacks."""
    kind = item.get("type")
    iid = item["id"]
    if kind == "message":
        texts = []
        for c in item.get("content") or []:
            t = c.get("transcript") if c.get("transcript") is not None else c.get("text")
            if t:
                texts.append(t)
        role = item.get("role") or "user"
        return llm.ChatMessage(id=iid, role=role, content=texts)
    if kind == "function_call":
        return llm.FunctionCall(id=iid, call_id=item.get("call_id") or "", name=item.get("name") or "",
                                arguments=item.get("arguments") or "")
    if kind == "function_call_output":
        return llm.FunctionCallOutput(id=iid, call_id=item.get("call_id") or "", output=item.get("output") or "",
                                      is_error=False)
    return None


class RealtimeModel(_ModelBase):
    """A LiveKit realtime model that runs a duplexkit session; give ``engine`` or ``url``.

    Args:
        engine: an in-process :class:`duplexkit.engine.api.Engine` (``DuplexEngine.from_pretrained``,
            or a :class:`duplexkit.testing.ScriptedEngine`); sessions use an
            :class:`~duplexkit.clients.InlineDuplexClient`. The engine is shared and not closed here.
        url: a ``duplexkit serve`` address (``ws://host:port``, ``http://host:port`` or the full
            ``/v1/realtime`` URL); sessions use a :class:`~duplexkit.clients.DuplexClient`.
        api_key: the server's ``--api-key`` (remote only).
        model: the served model id to ask for (remote only; None: the server's default).
        profile: ``"duplex"`` (default: the model decides when to answer) or ``"compat"``
            (docs/protocol.md §1.2).
        turn_detection: the session's ``turn_detection`` (default :data:`DEFAULT_TURN_DETECTION`);
            ``None`` leaves turns to the model alone (no barge-in events then).
        input_audio_transcription: the recogniser of user turns (``"minicpm-o"``, the model's own ASR;
            ``"faster-whisper"``; docs/tools.md); None: no user transcripts.
        tool_choice: ``"auto"`` (default), ``"required"``, ``"none"`` or a named function.
        session: more initial ``session.update`` fields (``extra_body``, ``voice``, ...).
        ref_audio: the reference voice (a WAV path, bytes, a float32 array at 16 kHz).
        client_options: more keyword options of the duplexkit client (``request_timeout_s``, ...).

    Raises:
        ValueError: neither or both of ``engine`` and ``url``.
        OptionalDependencyError: livekit-agents is not installed.
    """

    def __init__(self, *, engine: Any = None, url: Optional[str] = None, api_key: Optional[str] = None,
                 model: Optional[str] = None, profile: str = "duplex",
                 turn_detection: Optional[dict] = DEFAULT_TURN_DETECTION,
                 input_audio_transcription: Optional[str] = "minicpm-o", tool_choice: Any = "auto",
                 session: Optional[dict] = None, ref_audio: Any = None,
                 client_options: Optional[dict] = None) -> None:
        if _LIVEKIT_IMPORT_ERROR is not None:
            raise OptionalDependencyError("livekit.agents", "livekit", "duplexkit.integrations.livekit")
        if (engine is None) == (url is None):
            raise ValueError("give exactly one of engine= (inline) or url= (a duplexkit serve address)")
        super().__init__(capabilities=llm.RealtimeCapabilities(
            message_truncation=True,
            turn_detection=turn_detection is not None,
            user_transcription=input_audio_transcription is not None,
            auto_tool_reply_generation=False,
            audio_output=True,
            manual_function_calls=True,
            mutable_chat_context=True,
            mutable_instructions=True,
            mutable_tools=True,
            per_response_tool_choice=True,
        ))
        self.engine = engine
        self.url = url
        self.api_key = api_key
        self.model_id = model
        self.profile = profile
        self.turn_detection = None if turn_detection is None else dict(turn_detection)
        self.input_audio_transcription = input_audio_transcription
        self.tool_choice = tool_choice
        self.session_fields = dict(session or {})
        self.ref_audio = ref_audio
        self.client_options = dict(client_options or {})
        self._sessions: list = []

    @property
    def model(self) -> str:
        if self.model_id:
            return self.model_id
        return str(getattr(self.engine, "model_id", None) or "duplexkit")

    @property
    def provider(self) -> str:
        return "duplexkit"

    def session(self, *, turn_detection_disabled: bool = False) -> "RealtimeSession":
        """A new :class:`RealtimeSession` (one duplexkit session; it connects in the background)."""
        s = RealtimeSession(self)
        self._sessions.append(s)
        return s

    async def aclose(self) -> None:
        """Close every session this model opened (the engine stays open: it is the caller's)."""
        for s in list(self._sessions):
            await s.aclose()
        self._sessions.clear()

    def _make_client(self) -> Any:
        fields: dict = dict(self.session_fields)
        fields.setdefault("turn_detection", self.turn_detection)
        if self.input_audio_transcription is not None:
            fields.setdefault("audio", {}).setdefault("input", {}).setdefault(
                "transcription", {"model": self.input_audio_transcription})
        if self.tool_choice is not None:
            fields.setdefault("tool_choice", _tool_choice(self.tool_choice))
        opts = dict(self.client_options)
        # LiveKit plays the audio and says what was heard (truncate): no acks from the virtual player
        opts.setdefault("auto_ack", False)
        if self.engine is not None:
            from duplexkit.clients import InlineDuplexClient

            return InlineDuplexClient(self.engine, profile=self.profile, session=fields, ref_audio=self.ref_audio,
                                      **opts)
        from duplexkit.clients import DuplexClient

        return DuplexClient(self.url, self.api_key, profile=self.profile, model=self.model_id, session=fields,
                            ref_audio=self.ref_audio, **opts)


class RealtimeSession(_SessionBase):
    """One duplexkit session seen through LiveKit's ``RealtimeSession`` interface (module docstring).

    Made by :meth:`RealtimeModel.session`; it connects at once in the background. Calls made before
    the session is open wait for it; calls are carried out in the order they were made. Extra
    attributes: ``client`` (the duplexkit client), ``connected`` (an ``asyncio.Event``).
    """

    def __init__(self, realtime_model: RealtimeModel) -> None:
        super().__init__(realtime_model)
        self._model: RealtimeModel = realtime_model
        self.client = realtime_model._make_client()
        self.connected = asyncio.Event()
        self._tools = llm.ToolContext.empty()
        self._remote = RemoteChatContext()
        self._ops: asyncio.Queue = asyncio.Queue()
        self._gen: Optional[_Generation] = None
        self._replies: dict[str, asyncio.Future] = {}
        self._item_futs: dict[str, asyncio.Future] = {}
        self._transcripts: dict[str, str] = {}
        self._item_response: dict[str, str] = {}
        self._response_samples: dict[str, int] = {}
        self._closing = False
        self._main = asyncio.create_task(self._run(), name="duplexkit-livekit-session")

    # ------------------------------------------------------------------ LiveKit's interface
    @property
    def chat_ctx(self) -> Any:
        return self._remote.to_chat_ctx()

    @property
    def tools(self) -> Any:
        return self._tools.copy()

    async def update_instructions(self, instructions: str) -> None:
        await self._call(self.client.update(instructions=instructions))

    async def update_tools(self, tools: list) -> None:
        schemas = _tool_schemas(tools)
        await self._call(self.client.update(tools=schemas))
        names = {s["name"] for s in schemas}
        self._tools = llm.ToolContext([t for t in tools if getattr(getattr(t, "info", None), "name", None) in names])

    def update_options(self, *, tool_choice: Any = None) -> None:
        if tool_choice is None or not isinstance(tool_choice, (str, dict)):
            return
        self._enqueue(self.client.update(tool_choice=_tool_choice(tool_choice)))

    async def update_chat_ctx(self, chat_ctx: Any) -> None:
        remote = self._remote.to_chat_ctx()
        remote_ids = {it.id for it in remote.items}
        answered = {it.call_id for it in remote.items if it.type == "function_call_output"}
        local_ids = {it.id for it in chat_ctx.items}
        waits = []
        for it in chat_ctx.items:
            if it.id in remote_ids or it.id.startswith("lk."):  # LiveKit's own instructions messages
                continue
            event: Optional[dict] = None
            if it.type == "function_call_output":
                if it.call_id in answered:
                    continue
                event = {"type": "function_call_output", "id": it.id, "call_id": it.call_id, "output": it.output}
            elif it.type == "message" and it.role in ("user", "system", "developer", "assistant") and it.text_content:
                part = "output_text" if it.role == "assistant" else "input_text"
                role = "system" if it.role == "developer" else it.role
                event = {"type": "message", "id": it.id, "role": role,
                         "content": [{"type": part, "text": it.text_content}]}
            if event is None:
                continue
            fut = asyncio.get_running_loop().create_future()
            key = "call:" + it.call_id if it.type == "function_call_output" else it.id
            eid = "lk_" + uuid.uuid4().hex[:16]
            self._item_futs[key] = self._item_futs[eid] = fut
            waits.append(fut)
            self._enqueue(self.client.send_event({"type": "conversation.item.create", "event_id": eid, "item": event}))
        for it in remote.items:  # assistant audio LiveKit dropped (never played): out of the history too
            if it.id not in local_ids and it.type == "message" and it.role == "assistant":
                self._enqueue(self.client.send_event({"type": "conversation.item.delete", "item_id": it.id}))
        if waits:
            done, pending = await asyncio.wait(waits, timeout=_ITEM_TIMEOUT_S)
            for f in pending:
                f.cancel()
            if pending:
                raise DuplexRealtimeError("update_chat_ctx: the session did not add every item in time", code="timeout")
            failed = [f.exception() for f in done if f.exception() is not None]
            if failed:
                raise DuplexRealtimeError(f"update_chat_ctx: the session refused an item: {failed[0]}",
                                          code=getattr(failed[0], "code", ErrorCode.BAD_EVENT.value))

    def push_audio(self, frame: Any) -> None:
        pcm = np.frombuffer(bytes(frame.data), dtype=np.int16)
        if frame.num_channels > 1:  # mixed down to mono
            pcm = pcm.reshape(-1, frame.num_channels).astype(np.float32).mean(axis=1).astype(np.int16)
        if pcm.size:
            self._enqueue(self.client.send_audio(pcm.tobytes(), rate=frame.sample_rate))

    def push_video(self, frame: Any) -> None:
        logger.debug("duplexkit.integrations.livekit: video frames are not sent (audio sessions only)")

    def generate_reply(self, *, instructions: Any = None, tool_choice: Any = None, tools: Any = None) -> "asyncio.Future":
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        eid = "lk_" + uuid.uuid4().hex[:16]
        self._replies[eid] = fut
        resp: dict = {"metadata": {"client_event_id": eid}}
        if isinstance(tool_choice, (str, dict)):
            resp["tool_choice"] = _tool_choice(tool_choice)
        if isinstance(tools, list):
            resp["tools"] = _tool_schemas(tools)
        if isinstance(instructions, str) and instructions:
            logger.debug("generate_reply(instructions=...) is not sent: duplexkit sessions take instructions "
                         "before the first unit only")
        self._enqueue(self.client.send_event({"type": "response.create", "event_id": eid, "response": resp}))

        def on_timeout() -> None:
            self._replies.pop(eid, None)
            if not fut.done():
                fut.set_exception(DuplexRealtimeError("generate_reply: no response.created in time", code="timeout"))

        handle = loop.call_later(_REPLY_TIMEOUT_S, on_timeout)

        def on_done(f: asyncio.Future) -> None:
            handle.cancel()
            self._replies.pop(eid, None)
            if f.cancelled():  # LiveKit gave up on it: the response must not speak
                self._enqueue(self.client.cancel())

        fut.add_done_callback(on_done)
        return fut

    def commit_audio(self) -> None:
        self._enqueue(self._commit())

    def clear_audio(self) -> None:
        self._enqueue(self.client.clear_input())

    def interrupt(self) -> None:
        if self._gen is not None or self._replies:
            self._enqueue(self.client.cancel())

    def truncate(self, *, message_id: str, modalities: list, audio_end_ms: int, audio_transcript: Any = None) -> None:
        rid = self._item_response.get(message_id)
        if rid is None:
            return
        self._enqueue(self.client.ack_playback(rid, max(0, int(audio_end_ms)), item_id=message_id, truncate=True))

    async def aclose(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._gen is not None:
            self._gen.close()
            self._gen = None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.close(), 10)
        self._main.cancel()
        with contextlib.suppress(BaseException):
            await self._main
        self._drain_ops(DuplexRealtimeError("the session closed", code="session_closed"))

    # ------------------------------------------------------------------ internals: calls in order
    def _enqueue(self, coro: Any) -> "asyncio.Future":
        fut = asyncio.get_running_loop().create_future()
        if self._closing:
            coro.close()
            fut.cancel()
            return fut
        self._ops.put_nowait((coro, fut))
        return fut

    async def _call(self, coro: Any) -> Any:
        try:
            return await self._enqueue(coro)
        except DuplexError as exc:
            raise DuplexRealtimeError(str(exc), code=str(exc.code)) from exc

    async def _commit(self) -> None:
        try:
            await self.client.commit()
        except DuplexError as exc:  # input_audio_buffer_empty: the server VAD committed the turn itself
            logger.debug("commit refused: %s", exc)

    async def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            await self.client.connect()
        except Exception as exc:
            self._emit_error(exc, recoverable=False)
            self._drain_ops(exc)
            return
        self._report_connection_acquired(time.perf_counter() - t0)
        self.connected.set()
        sender = asyncio.create_task(self._send_loop())
        try:
            async for ev in self.client.events():
                if hasattr(ev, "model_dump"):
                    self._on_event(ev.model_dump(mode="json", exclude_none=True))
        except Exception as exc:
            if not self._closing:
                self._emit_error(exc, recoverable=False)
        finally:
            sender.cancel()
            if self._gen is not None:
                self._gen.close()
                self._gen = None
            for f in list(self._replies.values()):
                if not f.done():
                    f.set_exception(DuplexRealtimeError("the session closed", code="session_closed"))

    async def _send_loop(self) -> None:
        while True:
            coro, fut = await self._ops.get()
            try:
                res = await coro
            except Exception as exc:
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # nobody may be waiting (fire-and-forget calls)
                logger.debug("duplexkit call failed: %r", exc)
            else:
                if not fut.done():
                    fut.set_result(res)

    def _drain_ops(self, exc: BaseException) -> None:
        while not self._ops.empty():
            coro, fut = self._ops.get_nowait()
            coro.close()
            if not fut.done():
                fut.set_exception(exc if isinstance(exc, DuplexRealtimeError) else
                                  DuplexRealtimeError(f"the session did not open: {exc}", code="connection_failed"))
                fut.exception()

    def _emit_error(self, exc: BaseException, *, recoverable: bool) -> None:
        self.emit("error", llm.RealtimeModelError(timestamp=time.time(), label=self._model.label,
                                                  error=exc, recoverable=recoverable))

    # ------------------------------------------------------------------ internals: server events
    def _on_event(self, ev: dict) -> None:
        handler = getattr(self, "_ev_" + ev.get("type", "").replace(".", "_"), None)
        if handler is not None:
            try:
                handler(ev)
            except Exception:  # a plugin bug must not end the session
                logger.exception("failed to handle %s", ev.get("type"))

    def _ev_input_audio_buffer_speech_started(self, ev: dict) -> None:
        self.emit("input_speech_started", llm.InputSpeechStartedEvent())

    def _ev_input_audio_buffer_speech_stopped(self, ev: dict) -> None:
        self.emit("input_speech_stopped", llm.InputSpeechStoppedEvent(
            user_transcription_enabled=self._model.input_audio_transcription is not None))

    def _ev_conversation_item_input_audio_transcription_delta(self, ev: dict) -> None:
        text = self._transcripts.get(ev["item_id"], "") + (ev.get("delta") or "")
        self._transcripts[ev["item_id"]] = text
        self.emit("input_audio_transcription_completed",
                  llm.InputTranscriptionCompleted(item_id=ev["item_id"], transcript=text, is_final=False))

    def _ev_conversation_item_input_audio_transcription_completed(self, ev: dict) -> None:
        self._transcripts.pop(ev["item_id"], None)
        transcript = ev.get("transcript") or ""
        if (it := self._remote.get(ev["item_id"])) is not None and it.item.type == "message":
            it.item.content = [transcript]
        self.emit("input_audio_transcription_completed",
                  llm.InputTranscriptionCompleted(item_id=ev["item_id"], transcript=transcript, is_final=True))

    def _ev_conversation_item_added(self, ev: dict) -> None:
        item = ev.get("item") or {}
        lk_item = _item_to_livekit(item)
        if lk_item is not None and self._remote.get(item["id"]) is None:
            prev = ev.get("previous_item_id")
            if prev is not None and self._remote.get(prev) is None:
                prev = self._remote.tail_id if hasattr(self._remote, "tail_id") else None
            try:
                self._remote.insert(prev, lk_item)
                self.emit("remote_item_added", llm.RemoteItemAddedEvent(previous_item_id=prev, item=lk_item))
            except ValueError as exc:
                logger.debug("item %s not mirrored: %s", item.get("id"), exc)
        for key in (item.get("id"), "call:" + str(item.get("call_id"))):
            fut = self._item_futs.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _ev_conversation_item_done(self, ev: dict) -> None:
        item = ev.get("item") or {}
        it = self._remote.get(item.get("id"))
        if it is None:
            return self._ev_conversation_item_added(ev)
        fresh = _item_to_livekit(item)
        if fresh is None:
            return
        if fresh.type == "function_call":
            it.item.arguments = fresh.arguments
        elif fresh.type == "message" and fresh.role == "assistant":
            it.item.content = fresh.content

    def _ev_conversation_item_deleted(self, ev: dict) -> None:
        with contextlib.suppress(ValueError):
            self._remote.delete(ev.get("item_id"))

    def _ev_conversation_item_truncated(self, ev: dict) -> None:
        pass

    def _ev_response_created(self, ev: dict) -> None:
        resp = ev.get("response") or {}
        if self._gen is not None:  # a response.created without the previous response.done
            self._gen.close()
        gen = _Generation(response_id=resp.get("id") or "", message_ch=lk_utils.aio.Chan(),
                          function_ch=lk_utils.aio.Chan())
        self._gen = gen
        created = llm.GenerationCreatedEvent(message_stream=gen.message_ch, function_stream=gen.function_ch,
                                             user_initiated=False, response_id=gen.response_id)
        eid = (resp.get("metadata") or {}).get("client_event_id")
        fut = self._replies.pop(eid, None) if eid else None
        if fut is not None and not fut.done():
            created.user_initiated = True
            fut.set_result(created)
        self.emit("generation_created", created)

    def _ev_response_output_item_added(self, ev: dict) -> None:
        gen, item = self._gen, ev.get("item") or {}
        if gen is None or item.get("type") != "message" or item.get("id") in gen.messages:
            return
        msg = _Message(item_id=item["id"], text_ch=lk_utils.aio.Chan(), audio_ch=lk_utils.aio.Chan(),
                       modalities=asyncio.get_running_loop().create_future())
        gen.messages[msg.item_id] = msg
        gen.item_id = msg.item_id
        self._item_response[msg.item_id] = gen.response_id
        gen.message_ch.send_nowait(llm.MessageGeneration(message_id=msg.item_id, text_stream=msg.text_ch,
                                                         audio_stream=msg.audio_ch, modalities=msg.modalities))

    def _message(self, ev: dict) -> Optional[_Message]:
        gen = self._gen
        if gen is None or gen.response_id != ev.get("response_id"):
            return None
        return gen.messages.get(ev.get("item_id"))

    def _ev_response_output_audio_delta(self, ev: dict) -> None:
        msg = self._message(ev)
        if msg is None:
            return
        data = base64.b64decode(ev.get("delta") or "")
        n = len(data) // 2
        if not n:
            return
        if not msg.modalities.done():
            msg.modalities.set_result(["audio", "text"])
        msg.samples += n
        self._gen.samples += n
        with contextlib.suppress(lk_utils.aio.channel.ChanClosed):
            msg.audio_ch.send_nowait(rtc.AudioFrame(data=data[:2 * n], sample_rate=OUTPUT_SAMPLE_RATE,
                                                    num_channels=1, samples_per_channel=n))

    def _ev_response_output_audio_transcript_delta(self, ev: dict) -> None:
        msg = self._message(ev)
        if msg is None or not ev.get("delta"):
            return
        msg.transcript += ev["delta"]
        with contextlib.suppress(lk_utils.aio.channel.ChanClosed):
            msg.text_ch.send_nowait(ev["delta"])

    def _ev_response_output_text_delta(self, ev: dict) -> None:
        msg = self._message(ev)
        if msg is not None and not msg.modalities.done():
            msg.modalities.set_result(["text"])
        self._ev_response_output_audio_transcript_delta(ev)

    def _ev_response_output_item_done(self, ev: dict) -> None:
        gen, item = self._gen, ev.get("item") or {}
        if gen is None:
            return
        if item.get("type") == "function_call":
            gen.function_ch.send_nowait(llm.FunctionCall(id=item["id"], call_id=item.get("call_id") or "",
                                                         name=item.get("name") or "",
                                                         arguments=item.get("arguments") or "{}"))
        elif item.get("type") == "message" and (msg := gen.messages.get(item.get("id"))) is not None:
            if not msg.modalities.done():
                msg.modalities.set_result(["audio", "text"])
            msg.text_ch.close()
            msg.audio_ch.close()

    def _ev_response_done(self, ev: dict) -> None:
        resp = ev.get("response") or {}
        gen = self._gen
        if gen is None or gen.response_id != resp.get("id"):
            return
        self._gen = None
        for m in gen.messages.values():
            if (it := self._remote.get(m.item_id)) is not None and it.item.type == "message" and m.transcript:
                it.item.content = [m.transcript]
        gen.close()
        if gen.samples and gen.item_id:
            # heard in full unless LiveKit truncates it later (truncate(): final)
            played_ms = gen.samples * 1000 // OUTPUT_SAMPLE_RATE
            self._enqueue(self.client.ack_playback(gen.response_id, played_ms, item_id=gen.item_id))
        if resp.get("status") == "failed":
            err = (resp.get("status_details") or {}).get("error") or {}
            self._emit_error(DuplexRealtimeError(f"response failed: {err.get('code') or 'unknown'}",
                                                 code=str(err.get("code") or ErrorCode.SERVER_ERROR.value)),
                             recoverable=True)

    def _ev_error(self, ev: dict) -> None:
        err = ev.get("error") or {}
        code = str(err.get("code") or ErrorCode.SERVER_ERROR.value)
        exc = DuplexRealtimeError(str(err.get("message") or code), code=code)
        eid = err.get("event_id")
        for fut in (self._replies.pop(eid, None), self._item_futs.pop(eid, None)) if eid else ():
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        if canonical_error_code(code) in (ErrorCode.RESPONSE_NOT_ACTIVE.value, ErrorCode.INPUT_AUDIO_BUFFER_EMPTY.value):
            return  # benign races of interrupt() and commit_audio()
        self._emit_error(exc, recoverable=True)
