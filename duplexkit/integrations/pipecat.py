"""A Pipecat service that runs a duplexkit session (docs/integrations.md, "Pipecat").

:class:`DuplexkitLLMService` is a Pipecat ``LLMService`` that sits where a speech-to-speech service
sits (``transport.input() -> [user aggregator] -> service -> transport.output() -> [assistant
aggregator]``) and drives one duplexkit session, either

* **inline**: ``DuplexkitLLMService(engine=...)`` runs an :class:`~duplexkit.clients.InlineDuplexClient`
  over an engine in this process (a ``DuplexEngine`` or the scripted engine; no server hop), or
* **remote**: ``DuplexkitLLMService(url="ws://host:8000")`` runs a :class:`~duplexkit.clients.DuplexClient`
  against ``duplexkit serve`` (or any server following docs/protocol.md).

What flows where:

===============================================  ==================================================
Pipecat frame in                                 duplexkit
===============================================  ==================================================
``InputAudioRawFrame`` (pcm16, any rate 8-48 kHz,  ``client.send_audio`` (downmixed to mono, resampled
any channel count)                                 by the client's streaming resampler)
``LLMRunFrame``; a downstream ``LLMContextFrame``  ``client.create_response()``: the bot speaks first
before the conversation started (what the user
aggregator makes of ``LLMRunFrame``)
``InterruptionFrame`` from elsewhere (a local      ``client.barge_in()`` while the bot speaks
VAD, the application)
===============================================  ==================================================

===============================================  ==================================================
duplexkit event                                  Pipecat frames pushed
===============================================  ==================================================
``response.output_audio.delta`` (24 kHz pcm16)   ``TTSAudioRawFrame`` (24 000 Hz, mono), after
                                                 ``LLMFullResponseStartFrame`` + ``TTSStartedFrame``
                                                 on a response's first audio or text
``response.output_audio_transcript.delta``       ``TTSTextFrame`` (the bot's transcript; the assistant
                                                 aggregator keeps it) and ``LLMTextFrame``
                                                 (``append_to_context=False``, for RTVI)
``response.output_text.delta`` (text modality)   ``LLMTextFrame``
``response.done``                                ``TTSStoppedFrame`` + ``LLMFullResponseEndFrame``
``input_audio_buffer.speech_started``            ``UserStartedSpeakingFrame`` (both directions); a
                                                 **barge-in** (a response active, or its audio still
                                                 playing) also broadcasts ``InterruptionFrame``, so
                                                 the output transport drops the audio it queued
``input_audio_buffer.speech_stopped``            ``UserStoppedSpeakingFrame`` (both directions)
``...input_audio_transcription.delta/completed`` ``InterimTranscriptionFrame`` / ``TranscriptionFrame``
                                                 upstream (to the user aggregator), as Pipecat's
                                                 realtime services push them
``error``                                        a non-fatal ``ErrorFrame`` (the session lives on)
===============================================  ==================================================

The session decides turns (its server VAD) and barge-in, so the service announces user turns itself
and recommends ``ExternalUserTurnStrategies`` to a context aggregator (``LLMServiceMetadataFrame``).

Function tools: give their schemas as ``tools=`` (``FunctionSchema`` objects, a ``ToolsSchema`` or
OpenAI function-tool dicts) and their handlers with Pipecat's own ``register_function`` (or as a
``FunctionSchema``'s ``handler``). The session's tool decider issues a call; the duplexkit client's
tool runner (:class:`duplexkit.clients.ToolRunner`) checks the arguments against the schema and runs
the call through Pipecat's ``run_function_calls`` (so ``FunctionCallsStartedFrame``,
``FunctionCallInProgressFrame`` and ``FunctionCallResultFrame`` flow as with any Pipecat LLM); the
handler's ``result_callback`` value goes back as the call's ``function_call_output`` and the client
asks for the spoken answer (one ``response.create`` per response's calls, after a filler if any).
A barge-in cancels running calls registered with ``cancel_on_interruption=True`` (the default).
A context frame the assistant aggregator pushes back upstream after a result is not needed and is
ignored: the client already asked for the answer.

Importing this module does not need Pipecat; constructing the service does
(``pip install 'duplexkit[pipecat]'``; :class:`~duplexkit.errors.OptionalDependencyError` otherwise).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import Any, Optional, Union

import numpy as np

from duplexkit.agent.tools import FunctionTool
from duplexkit.engine.api import OUTPUT_SAMPLE_RATE
from duplexkit.errors import DuplexError, DuplexkitError, OptionalDependencyError, ToolArgumentsError, ToolError

try:  # Pipecat is an optional extra: the module imports without it (the service needs it)
    from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
    from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
    from pipecat.frames.frames import (
        BotStartedSpeakingFrame,
        BotStoppedSpeakingFrame,
        CancelFrame,
        EndFrame,
        Frame,
        FunctionCallCancelFrame,
        FunctionCallResultFrame,
        InputAudioRawFrame,
        InterimTranscriptionFrame,
        InterruptionFrame,
        LLMContextFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMRunFrame,
        LLMServiceMetadataFrame,
        LLMTextFrame,
        StartFrame,
        TranscriptionFrame,
        TTSAudioRawFrame,
        TTSStartedFrame,
        TTSStoppedFrame,
        TTSTextFrame,
        UserStartedSpeakingFrame,
        UserStoppedSpeakingFrame,
    )
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.services.llm_service import FunctionCallFromLLM, LLMService
    from pipecat.services.settings import LLMSettings
    from pipecat.turns.user_turn_strategies import ExternalUserTurnStrategies
    from pipecat.utils.text.base_text_aggregator import TextType
    from pipecat.utils.time import time_now_iso8601

    _PIPECAT_MISSING: Optional[BaseException] = None
except ModuleNotFoundError as _exc:  # pragma: no cover - exercised only without the extra
    _PIPECAT_MISSING = _exc
    LLMService = object  # a placeholder base, so the class below can be defined (and never built)

logger = logging.getLogger("duplexkit.integrations.pipecat")

__all__ = ["DuplexkitLLMService", "PipecatPlugError", "OUTPUT_RATE"]

OUTPUT_RATE = OUTPUT_SAMPLE_RATE
"""Rate in Hz of the audio frames the service pushes (the session's output, docs/protocol.md §6.2)."""


class PipecatPlugError(DuplexkitError, ValueError):
    """A :class:`DuplexkitLLMService` that cannot be built as asked (code ``bad_config``): neither or
    both of ``engine`` and ``url``, a tool that is not a function tool with a name, or parameters
    that are not a valid JSON Schema."""

    default_code = "bad_config"


# ------------------------------------------------------------------------------------------ tools


class _PipecatTool(FunctionTool):
    """A function tool whose schema comes from Pipecat and whose handler runs in Pipecat.

    The duplexkit client's :class:`~duplexkit.clients.ToolRunner` treats it as any
    :class:`~duplexkit.agent.FunctionTool` (schema, filler, ``cancellable``, ``late_result``); its
    :meth:`invoke` checks the arguments against the JSON Schema and hands the call to the service,
    which runs the handler registered with ``register_function``. No pydantic model is built: the
    schema is the one the application wrote.
    """

    def __init__(self, service: "DuplexkitLLMService", name: str, description: str, parameters: dict,
                 filler: Optional[str]) -> None:  # noqa: D107 - FunctionTool's own init is not used
        import jsonschema

        self._service = service
        self.func = None
        self.name = name
        self.description = description
        self.parameters = parameters
        self.filler = filler
        self.timeout_s = None  # Pipecat's timeout_secs applies (a timed-out call gets an error output)
        self.late_result = "drop"
        self.arguments_model = None
        try:
            jsonschema.Draft202012Validator.check_schema(parameters)
        except jsonschema.SchemaError as exc:
            raise PipecatPlugError(f"tool {name!r}: parameters are not a valid JSON Schema: {exc.message}") from None
        self._validator = jsonschema.Draft202012Validator(parameters)

    @property
    def cancellable(self) -> bool:
        """A barge-in cancels the call unless its handler was registered with
        ``cancel_on_interruption=False``."""
        return self._service._cancel_on_interruption(self.name)

    def parse_arguments(self, arguments_json: str) -> dict:
        """The arguments as a dict, valid against the tool's JSON Schema.

        Raises:
            ToolArgumentsError: not a JSON object, or not valid against the schema.
        """
        text = arguments_json if arguments_json and arguments_json.strip() else "{}"
        try:
            args = json.loads(text)
        except ValueError as exc:
            raise ToolArgumentsError(f"tool {self.name!r}: arguments are not JSON: {exc}", tool=self.name) from None
        if not isinstance(args, dict):
            raise ToolArgumentsError(f"tool {self.name!r}: arguments must be a JSON object", tool=self.name)
        errors = sorted(self._validator.iter_errors(args), key=lambda e: list(e.path))
        if errors:
            raise ToolArgumentsError(
                f"tool {self.name!r}: bad arguments: " + "; ".join(
                    f"{'.'.join(map(str, e.path)) or '(root)'}: {e.message}" for e in errors),
                tool=self.name, errors=[{"loc": list(e.path), "msg": e.message} for e in errors])
        return args

    async def invoke(self, arguments_json: str) -> str:
        """Run the call through the Pipecat handler and return the output text (JSON unless the
        handler's result is a ``str``).

        Raises:
            ToolArgumentsError: see :meth:`parse_arguments` (the handler is not called).
            ToolError: Pipecat cancelled the call (its ``timeout_secs``), or no call of this tool
                is running on the client.
        """
        args = self.parse_arguments(arguments_json)
        return await self._service._run_pipecat_call(self, args)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"tool {self.name!r} runs through the Pipecat service, not by calling it")

    def __repr__(self) -> str:
        return f"_PipecatTool(name={self.name!r})"


def _tool_entries(tools: Any) -> list:
    """``(name, description, parameters, filler)`` of every function tool in ``tools`` (a
    ``ToolsSchema``, or a list of ``FunctionSchema`` / OpenAI function-tool dicts)."""
    if tools is None:
        return []
    items = list(tools.standard_tools) if isinstance(tools, ToolsSchema) else list(tools)
    out = []
    for t in items:
        if isinstance(t, FunctionSchema):
            d = t.to_default_dict()
            out.append((d["name"], d.get("description") or "", d["parameters"], None))
        elif isinstance(t, dict):
            fn = t.get("function") if isinstance(t.get("function"), dict) else t
            if t.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
                raise PipecatPlugError(f"not a function tool: {t!r}")
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            out.append((fn["name"], fn.get("description") or "", params, t.get("filler", fn.get("filler"))))
        else:
            raise PipecatPlugError(f"a tool must be a FunctionSchema or a function-tool dict, got {type(t).__name__}")
    return out


# ------------------------------------------------------------------------------------------ the service


class DuplexkitLLMService(LLMService):
    """A Pipecat speech-to-speech service over one duplexkit session (module doc).

    Args:
        engine: run inline: any :class:`duplexkit.engine.api.Engine` (``DuplexEngine.from_pretrained(...)``,
            ``duplexkit.testing.ScriptedEngine()``); shared, never closed by the service.
        url: run remote: the ``duplexkit serve`` URL (``ws://host:port``, ``http://host:port`` or a
            ``/v1/realtime`` URL; :func:`duplexkit.clients.build_url`).
        api_key: the server's ``--api-key`` (remote only).
        tools: the function tools the session may call: a ``ToolsSchema``, or a list of
            ``FunctionSchema`` / OpenAI function-tool dicts (a dict may carry duplexkit's ``filler``).
            Register each tool's handler with ``register_function`` (or give it as the
            ``FunctionSchema``'s ``handler``).
        tool_choice: ``"auto"`` (default), ``"required"``, ``"none"`` or ``{"type": "function", "name": ...}``.
        tool_filler: what the session says while a ``FunctionSchema`` tool runs (``None``: the
            session's default filler, ``""``: nothing).
        instructions: the session's instructions (system prompt), or None.
        transcription: the user-transcript model (``"minicpm-o"``, the default: the model's own
            recogniser; ``"faster-whisper"``; docs/tools.md), or None for no user transcripts.
        session: further ``session.update`` fields (GA or beta spellings), applied before the above.
        client_options: further keyword options of the duplexkit client (``request_timeout_s``,
            ``ref_audio``, ``profile``, ``player``, ...; docs/clients.md). ``InlineDuplexClient``
            also takes ``SessionConfig`` fields here (``answer_policy``, ``limits``, ...).
        **kwargs: Pipecat's ``LLMService`` options (``run_in_parallel``, ``function_call_timeout_secs``, ...).

    Events (Pipecat's ``@service.event_handler(...)``):
        ``on_duplexkit_event(service, event)``: every event of the session, in order, before the
        frames it makes are pushed (:mod:`duplexkit.protocol` models, and the client's
        ``ToolCallStarted`` / ``ToolCallFinished`` records).

    Attributes:
        client: the running duplexkit client (None before the pipeline starts and after it ends).
        input_rates: the sample rates in Hz of the input audio frames seen so far.

    Raises:
        PipecatPlugError: neither or both of ``engine`` and ``url``; a tool that is not a function tool,
            or whose parameters are not a valid JSON Schema.
        OptionalDependencyError: Pipecat is not installed.
    """

    def __init__(self, *, engine: Any = None, url: Optional[str] = None, api_key: Optional[str] = None,
                 tools: Any = None, tool_choice: Union[str, dict] = "auto", tool_filler: Optional[str] = None,
                 instructions: Optional[str] = None, transcription: Optional[str] = "minicpm-o",
                 session: Optional[dict] = None, client_options: Optional[dict] = None, **kwargs: Any) -> None:
        if _PIPECAT_MISSING is not None:
            raise OptionalDependencyError("pipecat", "pipecat", "duplexkit.integrations.pipecat")
        if (engine is None) == (url is None):
            raise PipecatPlugError("give exactly one of engine= (inline) and url= (remote)")
        if "settings" not in kwargs:  # Pipecat wants every field set; the session owns these
            model = getattr(engine, "model_id", None) if engine is not None else None
            kwargs["settings"] = LLMSettings(
                model=model or "duplexkit", system_instruction=instructions, temperature=None, max_tokens=None,
                top_p=None, top_k=None, frequency_penalty=None, presence_penalty=None, seed=None,
                filter_incomplete_user_turns=False, user_turn_completion_config=None)
        super().__init__(**kwargs)
        self._engine, self._url, self._api_key = engine, url, api_key
        self._tools_arg = tools
        self._tools = [_PipecatTool(self, n, d, p, f if f is not None else tool_filler)
                       for n, d, p, f in _tool_entries(tools)]
        self._tool_choice = tool_choice
        upd = dict(session or {})
        if instructions is not None:
            upd["instructions"] = instructions
        if transcription is not None:
            audio = dict(upd.get("audio") or {})
            inp = dict(audio.get("input") or {})
            inp.setdefault("transcription", {"model": transcription})
            audio["input"] = inp
            upd["audio"] = audio
        self._session_fields = upd
        self._client_options = dict(client_options or {})
        self.client: Any = None
        self.input_rates: list = []
        self._pump: Optional[asyncio.Task] = None
        self._context: Any = None
        self._greeted = False
        self._closing = False
        self._claimed: set = set()
        self._results: dict = {}  # tool_call_id -> future of the FunctionCallResultFrame
        self._response_id: Optional[str] = None  # the response still generating
        self._frames_open: Optional[str] = None  # the response whose Start frames went out
        self._audible_until = 0.0  # monotonic s: when the audio pushed so far has played out
        self._bot_speaking = False  # from the output transport's Bot*SpeakingFrame
        # every duplexkit event (a duplexkit.protocol model, or a client record such as
        # ToolCallStarted), in order, before its frames are pushed: handler(service, event)
        self._register_event_handler("on_duplexkit_event", sync=True)

    # ------------------------------------------------------------------ Pipecat hooks
    def can_generate_metrics(self) -> bool:
        return True

    def service_metadata_frame(self):
        """A realtime service that announces user turns itself (the session's VAD)."""
        return LLMServiceMetadataFrame(service_name=self.name, is_realtime_service=True,
                                       user_turn_strategies=ExternalUserTurnStrategies())

    def _service_tools(self):
        """The tools given to the constructor, so handlers carried by ``FunctionSchema`` objects
        (or direct functions in a ``ToolsSchema``) are registered as Pipecat registers them."""
        if isinstance(self._tools_arg, ToolsSchema):
            return self._tools_arg
        schemas = [t for t in (self._tools_arg or []) if isinstance(t, FunctionSchema)]
        return ToolsSchema(standard_tools=schemas) if schemas else None

    async def start(self, frame: "StartFrame"):
        """Open the duplexkit session (inline: the Session over the engine; remote: the WebSocket).
        A failure is pushed as a fatal ``ErrorFrame``."""
        await super().start(frame)
        await self._open()

    async def stop(self, frame: "EndFrame"):
        await super().stop(frame)
        await self._close()

    async def cancel(self, frame: "CancelFrame"):
        await super().cancel(frame)
        await self._close()

    async def cleanup(self):
        await super().cleanup()
        await self._close()

    async def process_frame(self, frame: "Frame", direction: "FrameDirection"):
        await super().process_frame(frame, direction)
        if isinstance(frame, InputAudioRawFrame):
            await self._send_input(frame)
        elif isinstance(frame, LLMRunFrame):
            await self._create_response()
        elif isinstance(frame, LLMContextFrame):
            self._context = frame.context
            # the bot's opening turn (Pipecat bots start with LLMRunFrame, which the user aggregator
            # turns into this frame); later context frames (a user turn written down, a tool result)
            # ask for nothing: the session answers by itself and the client asks after tool outputs
            if direction == FrameDirection.DOWNSTREAM and not self._greeted:
                await self._create_response()
        elif isinstance(frame, InterruptionFrame):
            await self._interrupted_elsewhere()
        elif isinstance(frame, BotStartedSpeakingFrame):
            self._bot_speaking = True
        elif isinstance(frame, BotStoppedSpeakingFrame):
            self._bot_speaking = False
        if isinstance(frame, (LLMRunFrame, LLMContextFrame)):
            return  # taken here, like an LLM service takes its context
        await self.push_frame(frame, direction)

    async def push_frame(self, frame: "Frame", direction: "Optional[FrameDirection]" = None):
        """Push a frame (downstream unless ``direction`` says otherwise); a function call's final
        result (or Pipecat's cancellation of the call) on its way downstream settles the duplexkit
        tool call waiting for it."""
        if direction is None:
            direction = FrameDirection.DOWNSTREAM
        if direction == FrameDirection.DOWNSTREAM:
            if isinstance(frame, FunctionCallResultFrame):
                props = frame.properties
                if props is None or getattr(props, "is_final", True):
                    fut = self._results.get(frame.tool_call_id)
                    if fut is not None and not fut.done():
                        fut.set_result(frame)
            elif isinstance(frame, FunctionCallCancelFrame):
                fut = self._results.get(frame.tool_call_id)
                if fut is not None and not fut.done():
                    fut.set_exception(ToolError(f"Pipecat cancelled the call of {frame.function_name!r}",
                                                tool=frame.function_name))
        await super().push_frame(frame, direction)

    # ------------------------------------------------------------------ session lifecycle
    def _make_client(self):
        from duplexkit.clients import DuplexClient, InlineDuplexClient

        opts = dict(self._client_options)
        if self._session_fields:
            merged = dict(self._session_fields)
            merged.update(opts.pop("session", None) or {})
            opts["session"] = merged
        if self._tools:
            opts["tools"] = self._tools
            opts["tool_choice"] = self._tool_choice
        if self._engine is not None:
            return InlineDuplexClient(self._engine, **opts)
        return DuplexClient(self._url, self._api_key, **opts)

    async def _open(self) -> None:
        if self.client is not None:
            return
        client = self._make_client()
        try:
            await client.connect()
        except DuplexkitError as exc:
            await self.push_error(error_msg=f"duplexkit session did not open: {exc}", exception=exc, force_treat_as_permanent=True)
            return
        self.client = client
        self._closing = False
        self._pump = self.create_task(self._pump_events(client), name=f"{self}::duplexkit-events")

    async def _close(self) -> None:
        client, self.client = self.client, None
        self._closing = True
        if client is not None:
            await client.close()
        if self._pump is not None:
            pump, self._pump = self._pump, None
            await self.cancel_task(pump)
        for fut in self._results.values():
            if not fut.done():
                fut.cancel()

    # ------------------------------------------------------------------ input
    async def _send_input(self, frame) -> None:
        client = self.client
        if client is None or client.closed:
            return
        pcm = np.frombuffer(frame.audio, dtype="<i2")
        if frame.num_channels > 1:  # the session hears mono
            pcm = pcm[: len(pcm) - len(pcm) % frame.num_channels].reshape(-1, frame.num_channels)
            audio: Any = pcm.astype(np.float32).mean(axis=1) / 32768.0
        else:
            audio = bytes(frame.audio)
        if frame.sample_rate not in self.input_rates:
            self.input_rates.append(frame.sample_rate)
        try:
            await client.send_audio(audio, rate=frame.sample_rate)
        except (DuplexkitError, ValueError) as exc:
            await self.push_error(error_msg=f"duplexkit refused the input audio: {exc}", exception=exc)

    async def _create_response(self) -> None:
        self._greeted = True
        client = self.client
        if client is None or client.closed:
            return
        try:
            await client.create_response()
        except DuplexError as exc:  # e.g. the model already answers: nothing to ask for
            logger.debug("response.create not taken: %s", exc)

    async def _interrupted_elsewhere(self) -> None:
        """An ``InterruptionFrame`` this service did not broadcast (a local VAD upstream, the
        application): stop what the bot says, as the session's own barge-in would."""
        client = self.client
        if client is None or client.closed or not self._audible():
            return
        await client.barge_in()
        await self._close_response_frames()

    # ------------------------------------------------------------------ output
    def _audible(self) -> bool:
        return self._response_id is not None or self._bot_speaking or time.monotonic() < self._audible_until

    async def _open_response_frames(self, response_id: str) -> None:
        if self._frames_open == response_id:
            return
        self._frames_open = response_id
        await self.push_frame(LLMFullResponseStartFrame())
        await self.push_frame(TTSStartedFrame(context_id=response_id))

    async def _close_response_frames(self) -> None:
        if self._frames_open is None:
            return
        rid, self._frames_open = self._frames_open, None
        await self.push_frame(TTSStoppedFrame(context_id=rid))
        await self.push_frame(LLMFullResponseEndFrame())

    async def _pump_events(self, client) -> None:
        try:
            async for ev in client.events():
                await self._on_event(ev)
        except DuplexkitError as exc:
            if not self._closing:
                await self.push_error(error_msg=f"duplexkit session lost: {exc}", exception=exc, force_treat_as_permanent=True)
            return
        if not self._closing:
            await self.push_error(error_msg=f"duplexkit session closed ({client.close_reason})", force_treat_as_permanent=True)

    async def _on_event(self, ev) -> None:
        await self._call_event_handler("on_duplexkit_event", ev)
        t = getattr(ev, "type", None)
        if t == "response.output_audio.delta":
            audio = base64.b64decode(ev.delta)
            if not audio:
                return
            await self.stop_ttfb_metrics()
            await self._open_response_frames(ev.response_id)
            rate = ev.sample_rate_hz or OUTPUT_RATE
            now = time.monotonic()
            self._audible_until = max(now, self._audible_until) + len(audio) / 2 / rate
            await self.push_frame(TTSAudioRawFrame(audio=audio, sample_rate=rate, num_channels=1,
                                                   context_id=ev.response_id))
        elif t == "response.output_audio_transcript.delta":
            if ev.delta:
                await self._open_response_frames(ev.response_id)
                text = LLMTextFrame(ev.delta)
                text.append_to_context = False  # the TTSTextFrame below is what the context keeps
                await self.push_frame(text)
                spoken = TTSTextFrame(ev.delta, text_type=TextType.SENTENCE, context_id=ev.response_id)
                spoken.includes_inter_frame_spaces = True
                await self.push_frame(spoken)
        elif t == "response.output_text.delta":
            if ev.delta:
                await self._open_response_frames(ev.response_id)
                await self.push_frame(LLMTextFrame(ev.delta))
        elif t == "response.created":
            self._response_id = ev.response.id
            self._greeted = True
        elif t == "response.done":
            if self._response_id == ev.response.id:
                self._response_id = None
            if self._frames_open == ev.response.id:
                await self._close_response_frames()
        elif t == "input_audio_buffer.speech_started":
            self._greeted = True  # the conversation is under way: no opening turn any more
            await self.broadcast_frame(UserStartedSpeakingFrame)
            if self._audible():  # barge-in: the session cancelled the response; drop what is queued
                self._response_id = None
                self._audible_until = 0.0
                await self.broadcast_interruption()
                await self._close_response_frames()
        elif t == "input_audio_buffer.speech_stopped":
            await self.broadcast_frame(UserStoppedSpeakingFrame)
            await self.start_ttfb_metrics()
        elif t == "conversation.item.input_audio_transcription.delta":
            if ev.delta:
                await self.push_frame(InterimTranscriptionFrame(ev.delta, "", time_now_iso8601(), result=ev),
                                      FrameDirection.UPSTREAM)
        elif t == "conversation.item.input_audio_transcription.completed":
            await self.push_frame(TranscriptionFrame(ev.transcript, "", time_now_iso8601(), result=ev),
                                  FrameDirection.UPSTREAM)
        elif t == "error":
            err = ev.error
            await self.push_error(error_msg=f"duplexkit error {err.code}: {err.message}")

    # ------------------------------------------------------------------ tools (called by _PipecatTool)
    def _cancel_on_interruption(self, name: str) -> bool:
        item = self._functions.get(name) or self._functions.get(None)
        return True if item is None else bool(item.cancel_on_interruption)

    def _claim_call(self, tool: _PipecatTool):
        """The client's running call of ``tool`` that no invocation has taken yet (the runner
        starts calls in the order it issues them, so the oldest is this one)."""
        client = self.client
        runner = getattr(client, "tool_runner", None)
        for rec in (runner.calls.values() if runner is not None else ()):
            if rec.tool is tool and rec.status == "running" and rec.call_id not in self._claimed:
                self._claimed.add(rec.call_id)
                return rec
        raise ToolError(f"no running call of {tool.name!r} on the client", tool=tool.name)

    async def _run_pipecat_call(self, tool: _PipecatTool, args: dict) -> str:
        """Run one call through Pipecat's function-call machinery and wait for its final result."""
        rec = self._claim_call(tool)
        fut = asyncio.get_running_loop().create_future()
        self._results[rec.call_id] = fut
        if self._context is None:
            self._context = LLMContext()
        try:
            await self.run_function_calls([FunctionCallFromLLM(function_name=tool.name, tool_call_id=rec.call_id,
                                                               arguments=args, context=self._context)])
            frame = await fut
        except asyncio.CancelledError:  # a barge-in (the client's tool runner): stop the handler too
            await self._cancel_function_calls_by_tool_call_id(rec.call_id)
            raise
        finally:
            self._results.pop(rec.call_id, None)
            self._claimed.discard(rec.call_id)
        if frame.error:
            raise ToolError(frame.error, tool=tool.name)
        return _tool_output_text(frame.result)


def _tool_output_text(result: Any) -> str:
    """A handler's result as ``function_call_output.output`` text: a ``str`` as it is, anything
    else as JSON (non-JSON values through ``str``)."""
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=str)
