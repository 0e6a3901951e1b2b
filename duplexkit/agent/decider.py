"""Tool deciders: given the conversation and the tools, does the user's turn call a tool?

MiniCPM-o 4.5 makes tool calls in its turn-based text mode only, so a duplex session delegates the
question to a *decider* each time a user turn ends (the Session's ``DecideTools`` shell command,
answered by a ``ToolDecision``). Two deciders ship:

* :class:`EngineToolDecider`: the same engine's ``generate`` (the thinker in text mode, greedy, with
  the engine's constrained decoding of calls). It hears the turn's audio itself.
* :class:`ChatEndpointToolDecider`: any OpenAI-compatible ``/chat/completions`` endpoint, e.g. a
  stronger text model (``--tool-model URL``). It reads text only: audio parts are replaced by their
  transcripts (:func:`text_messages`).

Both check every call's arguments against the tool's JSON Schema (``jsonschema``), fill
``elapsed_ms`` and never raise: a failure is the decision's ``error``, with no calls.
"""

from __future__ import annotations

import json
import time
from typing import Any, Awaitable, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np

from duplexkit.engine.api import (
    ChatMessage,
    ChatRequest,
    ChatResult,
    DecideTools,
    ToolCall,
    ToolDecision,
    TranscribeAudio,
)
from duplexkit.errors import OptionalDependencyError

__all__ = ["ToolDecider", "EngineToolDecider", "ChatEndpointToolDecider", "text_messages", "check_calls"]


@runtime_checkable
class ToolDecider(Protocol):
    """Answers :class:`~duplexkit.engine.api.DecideTools` with a :class:`~duplexkit.engine.api.ToolDecision`.

    Attributes:
        accepts_audio: True when :meth:`decide` understands audio parts in ``cmd.messages``; a shell
            gives a decider without it text only (:func:`text_messages`).
    """

    accepts_audio: bool

    async def decide(self, cmd: DecideTools, on_text: Optional[Callable[[str], None]] = None) -> ToolDecision:
        """The decision for ``cmd``; never raises (a failure is ``ToolDecision.error``). A decider that
        can stream calls ``on_text(piece)`` with the reply text as it is written (used for answers,
        ``tool_choice`` none, so that speech starts before the whole answer is written); others
        ignore it."""
        ...


def _is_audio(part: Any) -> bool:
    return isinstance(part, np.ndarray) and part.dtype != np.uint8


def _is_image(part: Any) -> bool:
    return isinstance(part, np.ndarray) and part.dtype == np.uint8


async def text_messages(messages: Sequence[ChatMessage],
                        transcribe: Optional[Union[Any, Callable[[np.ndarray], Awaitable[str]]]] = None,
                        ) -> list:
    """The conversation for a decider that reads text only.

    Each audio part (a float ``np.ndarray``, 16 kHz) becomes the text of its transcript; image parts
    (uint8 arrays) are dropped. With ``transcribe`` None, audio parts are dropped too, which is right
    when the turn's transcript is already among the parts.

    Args:
        messages: :class:`~duplexkit.engine.api.ChatMessage` objects.
        transcribe: a :class:`~duplexkit.agent.transcribe.Transcriber`, an ``async (audio) -> str``
            function, or None.

    Returns:
        new ChatMessage objects whose content holds ``str`` parts only; a message left with no part
        is left out.

    Raises:
        ValueError: a message whose only content was audio could not be put into words (no
            ``transcribe`` given, or the transcriber failed: its error is in the message).
    """
    out = []
    for m in messages:
        parts = []
        dropped_audio = False
        for p in m.content:
            if isinstance(p, str):
                parts.append(p)
            elif _is_audio(p):
                if transcribe is None:
                    dropped_audio = True
                    continue
                if hasattr(transcribe, "transcribe"):
                    tr = await transcribe.transcribe(TranscribeAudio(stream_id="", epoch=0, audio=p))
                    if tr.error:
                        raise ValueError(f"the user's audio could not be transcribed: {tr.error}")
                    text = tr.text
                else:
                    text = await transcribe(p)
                if text:
                    parts.append(text)
                else:
                    dropped_audio = True
            elif _is_image(p):
                continue
        if parts:
            out.append(ChatMessage(m.role, parts))
        elif dropped_audio:
            raise ValueError(f"a {m.role} message holds audio only, and this decider reads text: "
                             "give it a transcriber (or send the turn's transcript)")
    return out


def _tool_map(tools: Sequence[dict]) -> dict:
    out = {}
    for t in tools:
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        out[fn.get("name")] = fn.get("parameters") or {"type": "object", "properties": {}}
    return out


def check_calls(calls: Sequence[ToolCall], tools: Sequence[dict]) -> Optional[str]:
    """Why ``calls`` are not acceptable for ``tools``, or None when every call is.

    A call is acceptable when its ``name`` is one of ``tools`` and its ``arguments`` are a JSON object
    that validates against that tool's ``parameters`` (``jsonschema``, the schema's own draft;
    2020-12 when it names none).

    Args:
        calls: :class:`~duplexkit.engine.api.ToolCall` objects.
        tools: OpenAI function tools, flat (``{"type": "function", "name", "parameters"}``) or
            chat-completions nested (``{"type": "function", "function": {...}}``).
    """
    import jsonschema

    schemas = _tool_map(tools)
    for c in calls:
        if c.name not in schemas:
            return f"the decider called {c.name!r}, which is not among the tools {sorted(schemas)}"
        try:
            args = json.loads(c.arguments or "{}")
        except json.JSONDecodeError as exc:
            return f"the arguments of {c.name!r} are not JSON: {exc}"
        schema = schemas[c.name]
        try:
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            err = jsonschema.exceptions.best_match(cls(schema).iter_errors(args))
        except Exception as exc:  # a broken schema: SchemaError, an unresolvable $ref (referencing), ...
            return f"the schema of {c.name!r} cannot be checked: {exc}"
        if err is not None:
            where = "/".join(str(x) for x in err.absolute_path)
            return f"the arguments of {c.name!r} do not fit its schema{' at ' + where if where else ''}: {err.message}"
    return None


def _decision(cmd: DecideTools, t0: float, *, calls: tuple = (), text: str = "",
              error: Optional[str] = None) -> ToolDecision:
    return ToolDecision(stream_id=cmd.stream_id, epoch=cmd.epoch, unit_index=-1, request_id=cmd.request_id,
                        calls=() if error else tuple(calls), text=text, error=error,
                        elapsed_ms=(time.perf_counter() - t0) * 1000.0)


class EngineToolDecider:
    """Decide with the engine's own turn-based generation (the default decider).

    ``decide`` calls ``engine.generate(ChatRequest(messages, tools, tool_choice, temperature=0.0,
    max_tokens))``; the engine's constrained decoding makes a call's arguments fit its schema, and
    ``ChatResult.tool_calls`` become the decision's calls.

    Args:
        engine: any :class:`~duplexkit.engine.api.Engine`.
        max_tokens: the most LLM tokens the decision may generate (a call and its arguments).

    Attributes:
        accepts_audio: True (the thinker hears the turn's audio).
    """

    accepts_audio = True

    def __init__(self, engine: Any, max_tokens: int = 256) -> None:
        self.engine = engine
        self.max_tokens = int(max_tokens)

    async def decide(self, cmd: DecideTools, on_text: Optional[Callable[[str], None]] = None) -> ToolDecision:
        """The decision for ``cmd`` (never raises; an engine failure or an unacceptable call is the
        decision's ``error``). With ``on_text`` the reply is generated with ``engine.generate_stream``
        and each text piece is handed to ``on_text`` as it comes (the call's tokens are never text)."""
        t0 = time.perf_counter()
        req = ChatRequest(messages=list(cmd.messages), tools=tuple(cmd.tools), tool_choice=cmd.tool_choice,
                          temperature=0.0, max_tokens=self.max_tokens)
        try:
            if on_text is None:
                res = await self.engine.generate(req)
            else:
                text, tool_calls = "", ()
                async for d in self.engine.generate_stream(req):
                    if d.text:
                        text += d.text
                        on_text(d.text)
                    if d.tool_calls:
                        tool_calls = tuple(d.tool_calls)
                res = ChatResult(text=text, audio=None, finish_reason="tool_calls" if tool_calls else "stop",
                                 prompt_tokens=0, completion_tokens=0, tool_calls=tool_calls)
        except Exception as exc:  # the decision carries it; the session goes on without a call
            return _decision(cmd, t0, error=f"the engine failed to decide: {type(exc).__name__}: {exc}")
        try:
            calls = tuple(ToolCall(name=c.name, arguments=c.arguments or "{}", call_id=c.call_id)
                          for c in (res.tool_calls or ()))
            why = check_calls(calls, cmd.tools)
        except Exception as exc:  # a malformed result or tool list: no call
            return _decision(cmd, t0, error=f"the decision cannot be checked: {type(exc).__name__}: {exc}")
        return _decision(cmd, t0, calls=calls, text=res.text or "", error=why)


class ChatEndpointToolDecider:
    """Decide with an OpenAI-compatible ``/chat/completions`` endpoint (``httpx``, text only).

    The request is ``{"model"?, "messages", "tools", "tool_choice", "temperature": 0, "max_tokens"}``
    with the tools in chat-completions nesting; the answer's ``choices[0].message.tool_calls`` become
    the decision's calls after :func:`check_calls` (an unknown tool or arguments that fail the schema
    make the decision's ``error``, with no call).

    Args:
        base_url: the API root (``http://host:8000/v1``); ``/chat/completions`` is added unless the
            URL already ends with it.
        api_key: sent as ``Authorization: Bearer <key>``.
        model: the ``model`` field (many endpoints need it; left out when None).
        timeout_s: the HTTP request's limit in s.
        max_tokens: the ``max_tokens`` field.
        transcriber: turns audio parts into text (:func:`text_messages`); None drops them (enough when
            the turn's transcript is among the messages).

    Attributes:
        accepts_audio: False.

    Raises:
        OptionalDependencyError: ``httpx`` or ``jsonschema`` is not installed
            (``pip install 'duplexkit[agent]'``).
    """

    accepts_audio = False

    def __init__(self, base_url: str, api_key: Optional[str] = None, model: Optional[str] = None,
                 timeout_s: float = 10.0, *, max_tokens: int = 256, transcriber: Any = None) -> None:
        try:
            import httpx
            import jsonschema  # noqa: F401  (check_calls)
        except ImportError as exc:
            raise OptionalDependencyError(exc.name or "httpx", "agent", "ChatEndpointToolDecider") from None
        url = base_url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.api_key = api_key
        self.model = model
        self.timeout_s = float(timeout_s)
        self.max_tokens = int(max_tokens)
        self.transcriber = transcriber
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=headers)

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        await self._client.aclose()

    async def __aenter__(self) -> "ChatEndpointToolDecider":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def request_body(self, messages: Sequence[ChatMessage], tools: Sequence[dict],
                     tool_choice: Union[str, dict]) -> dict:
        """The JSON body for text-only ``messages`` (see the class doc)."""
        nested = []
        for t in tools:
            fn = t.get("function") if isinstance(t.get("function"), dict) else t
            nested.append({"type": "function", "function": {
                "name": fn["name"], "description": fn.get("description") or "",
                "parameters": fn.get("parameters") or {"type": "object", "properties": {}}}})
        if isinstance(tool_choice, dict):
            name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
            tool_choice = {"type": "function", "function": {"name": name}}
        body = {"messages": [{"role": m.role, "content": "\n".join(m.content)} for m in messages],
                "tools": nested, "tool_choice": tool_choice, "temperature": 0, "max_tokens": self.max_tokens}
        if self.model is not None:
            body["model"] = self.model
        return body

    async def decide(self, cmd: DecideTools, on_text: Optional[Callable[[str], None]] = None) -> ToolDecision:
        """The decision for ``cmd`` (never raises: transport errors, HTTP errors, a malformed answer
        and unacceptable calls are the decision's ``error``). ``on_text`` is not used: the answer
        comes whole (no streaming from the endpoint)."""
        import httpx

        t0 = time.perf_counter()
        try:
            messages = await text_messages(cmd.messages, self.transcriber)
            body = self.request_body(messages, cmd.tools, cmd.tool_choice)
        except Exception as exc:  # audio without a transcript, a failed transcriber, a malformed tool
            return _decision(cmd, t0, error=str(exc) or type(exc).__name__)
        try:
            r = await self._client.post(self.url, json=body)
        except httpx.HTTPError as exc:
            return _decision(cmd, t0, error=f"the tool endpoint {self.url} failed: {type(exc).__name__}: {exc}")
        if r.status_code != 200:
            return _decision(cmd, t0, error=f"the tool endpoint answered HTTP {r.status_code}: {r.text[:300]}")
        try:
            msg = r.json()["choices"][0]["message"]
            text = msg.get("content") or ""
            calls = tuple(ToolCall(name=tc["function"]["name"], arguments=_arguments_text(tc["function"]),
                                   call_id=tc.get("id") or "")
                          for tc in (msg.get("tool_calls") or ()))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            return _decision(cmd, t0, error=f"the tool endpoint's answer is not a chat completion: "
                                            f"{type(exc).__name__}: {exc}")
        try:
            why = check_calls(calls, cmd.tools)
        except Exception as exc:
            why = f"the decision cannot be checked: {type(exc).__name__}: {exc}"
        return _decision(cmd, t0, calls=calls, text=text, error=why)


def _arguments_text(fn: dict) -> str:
    args = fn.get("arguments")
    if args is None or args == "":
        return "{}"
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)  # some servers send an object
