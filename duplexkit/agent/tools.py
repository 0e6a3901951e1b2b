"""Function tools: a Python function, its OpenAI function-tool schema and a safe way to call it.

:func:`tool` (or :class:`FunctionTool` itself) wraps a plain sync or async function. The schema
comes from the signature through pydantic: a model is created with one field per parameter (type
hint, default, and the parameter's line of the docstring's ``Args:`` section as its description,
read with ``docstring_parser``), and its JSON Schema is the tool's ``parameters``. The docstring's
summary (and any further paragraphs before ``Args:``) is the tool's ``description``.

Calling a tool, :meth:`FunctionTool.invoke`, takes the model's argument text (JSON), validates it
with the same pydantic model, runs the function (async ones on the event loop, sync ones in a
worker thread), applies the tool's timeout and returns the output as text.

Example::

    @tool(timeout_s=5, filler="Let me write that down.")
    def add_note(text: str, tags: list[str] = ()) -> dict:
        '''Add a note to the notebook.

        Args:
            text: what to write down.
            tags: words to file the note under.
        '''
        ...

    add_note.schema          # {"type": "function", "name": "add_note", "description": ..., "parameters": ...}
    await add_note.invoke('{"text": "buy milk"}')   # '{"id": 3, ...}'
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
from typing import Any, Callable, Literal, Optional, Union, get_type_hints

import docstring_parser
import pydantic
import pydantic_core
from pydantic.json_schema import GenerateJsonSchema

from duplexkit.errors import (
    ToolArgumentsError,
    ToolDefinitionError,
    ToolError,
    ToolOutputError,
    ToolTimeoutError,
)

__all__ = ["FunctionTool", "tool", "as_tool", "error_output", "DEFAULT_TIMEOUT_S", "LATE_RESULTS"]

DEFAULT_TIMEOUT_S = 30.0
"""A tool call's time limit in s unless its ``timeout_s`` says otherwise."""

LATE_RESULTS = ("drop", "speak")
"""What happens to a result that arrives after the user started a new turn (``late_result``)."""

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class _ToolSchema(GenerateJsonSchema):
    """pydantic's JSON Schema generator with two changes for function tools: no ``title`` on fields
    (noise in the model's prompt; the description says it) and ``additionalProperties: false`` on
    every object made from a model, so the schema is usable with OpenAI's ``strict`` mode. (The
    arguments model forbids unknown top-level arguments; a nested pydantic model keeps its own
    ``extra`` policy when validating, so with pydantic's default an unknown nested key is ignored.)"""

    def field_title_should_be_set(self, schema) -> bool:
        return False

    def model_schema(self, schema):
        out = super().model_schema(schema)
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out


class FunctionTool:
    """A Python function the model may call.

    Args:
        func: a sync or async function (or any callable with a signature). Every parameter needs a
            JSON-describable type hint (``str``, ``int``, ``float``, ``bool``, ``Literal``, enums,
            ``Optional``, ``list``/``dict`` of those, pydantic models, dataclasses...); a parameter
            without a hint accepts any JSON value. ``*args`` / ``**kwargs`` are not allowed.
        name: the tool name the model sees (default ``func.__name__``); 1-64 characters of
            ``[A-Za-z0-9_-]``.
        description: the text the model reads (default: the docstring without its ``Args:`` /
            ``Returns:`` / ``Raises:`` sections).
        timeout_s: a call's limit in s (default :data:`DEFAULT_TIMEOUT_S`); None = no limit.
        cancellable: True (the default) lets a barge-in (the user talking over the answer, or the
            client's ``cancel()``) cancel a running call; then no output is sent for it. An async
            function gets ``asyncio.CancelledError`` at its next ``await``; a sync one keeps running in
            its thread, and its result is discarded. False: the call runs to its end whatever happens.
        late_result: what to do with a result that arrives after the user started a new turn:
            ``"drop"`` (the default: never send it) or ``"speak"`` (send it, and ask for an answer
            once no response is active).
        filler: what the server says while the call runs (``None``: the server's default,
            ``""``: nothing). Sent as the tool's ``filler`` field, a duplexkit extension.

    Attributes:
        name, description, func, timeout_s, cancellable, late_result, filler: as given.
        parameters: the JSON Schema of the arguments (``dict``).
        arguments_model: the pydantic model the arguments are validated with.

    Raises:
        ToolDefinitionError: a bad name or option, ``*args`` / ``**kwargs``, or a type pydantic cannot
            turn into JSON Schema.

    Calling the FunctionTool object itself calls ``func`` unchanged, so a decorated function stays
    usable as a function.
    """

    def __init__(self, func: Callable, *, name: Optional[str] = None, description: Optional[str] = None,
                 timeout_s: Optional[float] = DEFAULT_TIMEOUT_S, cancellable: bool = True,
                 late_result: Literal["drop", "speak"] = "drop", filler: Optional[str] = None) -> None:
        if not callable(func):
            raise ToolDefinitionError(f"a tool needs a callable, got {type(func).__name__}")
        self.func = func
        self.name = name if name is not None else getattr(func, "__name__", type(func).__name__)
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ToolDefinitionError(f"a tool name must be 1-64 characters of [A-Za-z0-9_-], got {self.name!r}",
                                      tool=str(self.name))
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ToolDefinitionError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}",
                                      tool=self.name)
        if late_result not in LATE_RESULTS:
            raise ToolDefinitionError(f"late_result must be one of {LATE_RESULTS}, got {late_result!r}", tool=self.name)
        if filler is not None and not isinstance(filler, str):
            raise ToolDefinitionError(f"filler must be a string or None, got {type(filler).__name__}", tool=self.name)
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.cancellable = bool(cancellable)
        self.late_result = late_result
        self.filler = filler
        doc = docstring_parser.parse(inspect.getdoc(func) or "")
        if description is None:
            description = "\n\n".join(p for p in (doc.short_description, doc.long_description) if p)
        self.description = description
        self.arguments_model = self._build_model(func, {p.arg_name: p.description for p in doc.params})
        self._is_async = _is_async_callable(func)
        try:
            params = self.arguments_model.model_json_schema(schema_generator=_ToolSchema)
        except pydantic.PydanticUserError as exc:  # e.g. a type with no JSON Schema (a callable)
            raise ToolDefinitionError(f"tool {self.name!r}: cannot describe its parameters as JSON Schema: {exc}",
                                      tool=self.name) from exc
        params.pop("title", None)
        params.setdefault("properties", {})
        self.parameters = params
        functools.update_wrapper(self, func, updated=())

    # ------------------------------------------------------------------ schema
    def _build_model(self, func: Callable, docs: dict) -> type:
        try:
            sig = inspect.signature(func)
        except (TypeError, ValueError) as exc:
            raise ToolDefinitionError(f"tool {self.name!r}: no signature: {exc}", tool=self.name) from exc
        try:
            hints = get_type_hints(func, include_extras=True)
        except Exception:  # unresolvable forward references: fall back to the raw annotations
            hints = {}
        fields: dict = {}
        for pname, p in sig.parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ToolDefinitionError(f"tool {self.name!r}: *{pname} / **{pname} parameters cannot be "
                                          "described to the model; name each parameter", tool=self.name)
            if p.kind is p.POSITIONAL_ONLY:
                raise ToolDefinitionError(f"tool {self.name!r}: positional-only parameter {pname!r} cannot be "
                                          "passed by name", tool=self.name)
            ann = hints.get(pname, p.annotation)
            if ann is inspect.Parameter.empty:
                ann = Any
            default = ... if p.default is inspect.Parameter.empty else p.default
            # each field is stored under a neutral name with the parameter name as its alias, so a
            # parameter may be called anything (``json``, ``schema``, ``model_config``, ``_x``)
            fields[f"p{len(fields)}"] = (ann, pydantic.Field(default, alias=pname,
                                                             description=docs.get(pname) or None))
        try:
            return pydantic.create_model(f"{self.name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"),
                                         **fields)
        except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, NameError, TypeError) as exc:
            raise ToolDefinitionError(f"tool {self.name!r}: cannot build its parameters: {exc}", tool=self.name) from exc

    @property
    def schema(self) -> dict:
        """The OpenAI function tool: ``{"type": "function", "name", "description", "parameters"}``."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters}

    def session_tool(self) -> dict:
        """The tool as a ``session.update`` lists it: :attr:`schema` plus ``filler`` when one is set
        (a duplexkit extension other servers ignore)."""
        out = self.schema
        if self.filler is not None:
            out["filler"] = self.filler
        return out

    # ------------------------------------------------------------------ calling
    def parse_arguments(self, arguments_json: str) -> dict:
        """Validate the model's argument text and return the keyword arguments for ``func``.

        Args:
            arguments_json: a JSON object as text; ``""`` is read as ``{}``.

        Returns:
            parameter name -> validated value (nested models as model instances).

        Raises:
            ToolArgumentsError: not JSON, not an object, a missing or unknown argument, or a value of
                the wrong type.
        """
        text = arguments_json if arguments_json and arguments_json.strip() else "{}"
        try:
            model = self.arguments_model.model_validate_json(text)
        except pydantic.ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            parts = []
            for e in errors:
                loc = ".".join(str(x) for x in e.get("loc", ()))
                parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
            raise ToolArgumentsError(f"tool {self.name!r}: bad arguments: " + "; ".join(parts), tool=self.name,
                                     errors=errors) from None
        return {f.alias: getattr(model, k) for k, f in type(model).model_fields.items()}

    async def invoke(self, arguments_json: str) -> str:
        """Run the tool on the model's argument text and return its output as text.

        Async functions run on the calling event loop, sync ones in a worker thread
        (``asyncio.to_thread``). A ``str`` result is returned as it is, a pydantic model as its
        ``model_dump_json()``, anything else JSON-encoded (pydantic's encoder: dataclasses, dates,
        sets and models inside containers work).

        Args:
            arguments_json: the call's ``arguments`` (JSON object text; ``""`` = no arguments).

        Returns:
            the output text for ``function_call_output.output``.

        Raises:
            ToolArgumentsError: the arguments do not validate (the function is not called).
            ToolTimeoutError: the call ran past :attr:`timeout_s` (an async function is cancelled; a
                sync one's thread runs on and its result is dropped).
            ToolOutputError: the result cannot be encoded as JSON.
            Exception: whatever the function itself raises, unchanged.
        """
        kwargs = self.parse_arguments(arguments_json)
        if self._is_async:
            work = self.func(**kwargs)
        else:
            work = asyncio.to_thread(self.func, **kwargs)
        try:
            if self.timeout_s is None:
                result = await work
            else:
                result = await asyncio.wait_for(work, self.timeout_s)
        except asyncio.TimeoutError:
            raise ToolTimeoutError(self.name, self.timeout_s) from None
        if inspect.isawaitable(result):  # a sync wrapper that returned a coroutine
            result = await result
        return self.encode_output(result)

    def encode_output(self, result: Any) -> str:
        """``result`` as output text (see :meth:`invoke`).

        Raises:
            ToolOutputError: the value cannot be encoded as JSON.
        """
        if isinstance(result, str):
            return result
        if isinstance(result, pydantic.BaseModel):
            return result.model_dump_json()
        try:
            return pydantic_core.to_json(result).decode()
        except pydantic_core.PydanticSerializationError as exc:
            raise ToolOutputError(f"tool {self.name!r} returned a {type(result).__name__} that is not JSON: {exc}",
                                  tool=self.name) from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)

    def __repr__(self) -> str:
        return (f"FunctionTool(name={self.name!r}, timeout_s={self.timeout_s}, cancellable={self.cancellable}, "
                f"late_result={self.late_result!r})")


def _is_async_callable(func: Callable) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def tool(func: Optional[Callable] = None, *, name: Optional[str] = None, description: Optional[str] = None,
         timeout_s: Optional[float] = DEFAULT_TIMEOUT_S, cancellable: bool = True,
         late_result: Literal["drop", "speak"] = "drop",
         filler: Optional[str] = None) -> Union[FunctionTool, Callable[[Callable], FunctionTool]]:
    """Make a function a :class:`FunctionTool`; use it bare (``@tool``) or with options
    (``@tool(timeout_s=5, late_result="drop")``). The options are :class:`FunctionTool`'s.

    Returns:
        the FunctionTool (bare use), or a decorator that makes one.

    Raises:
        ToolDefinitionError: see :class:`FunctionTool`.
    """
    def make(f: Callable) -> FunctionTool:
        return FunctionTool(f, name=name, description=description, timeout_s=timeout_s, cancellable=cancellable,
                            late_result=late_result, filler=filler)

    return make(func) if func is not None else make


def as_tool(obj: Any) -> FunctionTool:
    """A :class:`FunctionTool` as it is, or a plain sync/async function wrapped with the default options.

    Raises:
        ToolDefinitionError: ``obj`` is not callable or cannot be described (see :class:`FunctionTool`).
    """
    if isinstance(obj, FunctionTool):
        return obj
    return FunctionTool(obj)


def error_output(exc: BaseException) -> str:
    """The output text that tells the model a call failed: ``{"error": "<message>"}``.

    duplexkit's own tool errors (bad arguments, timeouts) give their message; an exception the
    function raised gives ``"<ExceptionType>: <message>"``.
    """
    if isinstance(exc, ToolError):
        text = exc.message or str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return json.dumps({"error": text}, ensure_ascii=False)
