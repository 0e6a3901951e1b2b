"""duplexkit.agent.tools: FunctionTool schemas from type hints and docstrings, validated and time-limited calls."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import threading
from typing import Annotated, Literal, Optional

import jsonschema
import pydantic
import pytest

from duplexkit.agent import (
    DEFAULT_TIMEOUT_S,
    FunctionTool,
    ToolArgumentsError,
    ToolDefinitionError,
    ToolOutputError,
    ToolTimeoutError,
    as_tool,
    error_output,
    tool,
)
from duplexkit.errors import DuplexkitError


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Address(pydantic.BaseModel):
    street: str
    number: int
    note: Optional[str] = None


def _params(t: FunctionTool) -> dict:
    jsonschema.Draft202012Validator.check_schema(t.parameters)
    return t.parameters


# ------------------------------------------------------------------------------------------ schemas


def test_scalar_types_descriptions_and_required():
    @tool
    def book(city: str, nights: int, budget: float, breakfast: bool = False) -> str:
        """Book a hotel room.

        Pays with the card on file.

        Args:
            city: where to stay.
            nights: how many nights, 1 or more.
            budget: most to pay per night, in euros.
            breakfast: include breakfast.
        """
        return "ok"

    assert isinstance(book, FunctionTool)
    assert book.schema["type"] == "function" and book.schema["name"] == "book"
    assert book.description == "Book a hotel room.\n\nPays with the card on file."
    p = _params(book)
    assert p["type"] == "object" and p["additionalProperties"] is False
    assert p["required"] == ["city", "nights", "budget"]
    props = p["properties"]
    assert props["city"] == {"type": "string", "description": "where to stay."}
    assert props["nights"] == {"type": "integer", "description": "how many nights, 1 or more."}
    assert props["budget"]["type"] == "number" and props["budget"]["description"].startswith("most to pay")
    assert props["breakfast"] == {"type": "boolean", "default": False, "description": "include breakfast."}
    assert "title" not in p and all("title" not in v for v in props.values())
    assert book("Paris", 2, 100.0) == "ok"  # the decorated function is still callable


def test_enum_literal_optional_list_and_nested_model():
    @tool
    def f(unit: Unit, mode: Literal["fast", "slow"], tag: Optional[str] = None, ids: list[int] = [],
          addr: Optional[Address] = None, limit: Annotated[int, pydantic.Field(ge=1, le=10)] = 3) -> str:
        """Try every kind of parameter."""
        return "x"

    p = _params(f)
    props = p["properties"]
    assert p["required"] == ["unit", "mode"]
    assert props["unit"] == {"$ref": "#/$defs/Unit"}
    assert p["$defs"]["Unit"]["enum"] == ["celsius", "fahrenheit"]
    assert props["mode"]["enum"] == ["fast", "slow"] and props["mode"]["type"] == "string"
    assert {"type": "null"} in props["tag"]["anyOf"] and {"type": "string"} in props["tag"]["anyOf"]
    assert props["ids"]["type"] == "array" and props["ids"]["items"] == {"type": "integer"}
    assert {"$ref": "#/$defs/Address"} in props["addr"]["anyOf"]
    addr = p["$defs"]["Address"]
    assert addr["additionalProperties"] is False and addr["required"] == ["street", "number"]
    assert (props["limit"]["minimum"], props["limit"]["maximum"]) == (1, 10)
    # the schema validates what the arguments model accepts, and rejects what it rejects
    v = jsonschema.Draft202012Validator(p)
    good = {"unit": "celsius", "mode": "fast", "addr": {"street": "Main", "number": 3}}
    assert v.is_valid(good)
    f.parse_arguments(json.dumps(good))
    for bad in ({"unit": "kelvin", "mode": "fast"}, {"unit": "celsius", "mode": "fast", "extra": 1},
                {"unit": "celsius", "mode": "fast", "limit": 11}, {"unit": "celsius"}):
        assert not v.is_valid(bad), bad
        with pytest.raises(ToolArgumentsError):
            f.parse_arguments(json.dumps(bad))
    # a nested model keeps its own extra policy (pydantic's default: ignore), while its schema says
    # additionalProperties false: validation accepts a superset of what the schema allows
    extra = {"unit": "celsius", "mode": "fast", "addr": {"street": "Main", "number": 3, "x": 1}}
    assert not v.is_valid(extra)
    assert f.parse_arguments(json.dumps(extra))["addr"] == Address(street="Main", number=3)


def test_options_name_and_session_tool():
    @tool(name="note-add", timeout_s=2.5, cancellable=False, late_result="speak", filler="Writing it down.")
    async def add(text: str) -> str:
        """Add a note."""
        return text

    assert (add.name, add.timeout_s, add.cancellable, add.late_result, add.filler) == (
        "note-add", 2.5, False, "speak", "Writing it down.")
    assert add.schema["name"] == "note-add" and "filler" not in add.schema
    assert add.session_tool()["filler"] == "Writing it down."
    plain = as_tool(lambda_free)
    assert (plain.timeout_s, plain.cancellable, plain.late_result, plain.filler) == (DEFAULT_TIMEOUT_S, True, "drop", None)
    assert as_tool(add) is add
    assert "filler" not in plain.session_tool()


def lambda_free(x: int) -> int:
    return x * 2


def test_parameter_names_that_shadow_pydantic_attributes_and_untyped_parameters():
    @tool
    def f(json: str, schema: int, anything=None) -> dict:
        """Odd names."""
        return {"json": json, "schema": schema, "anything": anything}

    assert set(f.parameters["properties"]) == {"json", "schema", "anything"}
    out = asyncio.run(f.invoke('{"json": "a", "schema": 2, "anything": [1, {"b": null}]}'))
    assert json.loads(out) == {"json": "a", "schema": 2, "anything": [1, {"b": None}]}


@pytest.mark.parametrize("bad, match", [
    (dict(name="has space"), "1-64 characters"),
    (dict(timeout_s=0), "timeout_s"),
    (dict(late_result="later"), "late_result"),
    (dict(filler=3), "filler"),
])
def test_bad_options_raise(bad, match):
    with pytest.raises(ToolDefinitionError, match=match) as ei:
        tool(**bad)(lambda_free)
    assert isinstance(ei.value, DuplexkitError) and ei.value.code == "invalid_tools"


def test_star_args_and_non_json_types_raise():
    def star(*args: int) -> None:
        pass

    def kw(**kw: int) -> None:
        pass

    def fn(cb: threading.Lock) -> None:  # an arbitrary class pydantic cannot describe
        pass

    for f in (star, kw, fn):
        with pytest.raises(ToolDefinitionError):
            as_tool(f)
    with pytest.raises(ToolDefinitionError):
        as_tool(42)


# ------------------------------------------------------------------------------------------ invoke


async def test_invoke_async_and_sync_outputs():
    seen_threads = []

    @tool
    async def a(x: int) -> str:
        """Async."""
        return f"x={x}"

    @tool
    def s(x: int, addr: Address) -> Address:
        """Sync, in a thread."""
        seen_threads.append(threading.current_thread())
        assert isinstance(addr, Address)  # nested models arrive as model instances
        return addr.model_copy(update={"number": addr.number + x})

    @dataclasses.dataclass
    class Point:
        x: int
        y: int

    @tool
    def d() -> dict:
        """Anything JSON."""
        return {"p": Point(1, 2), "n": None, "u": Unit.CELSIUS}

    assert await a.invoke('{"x": 3}') == "x=3"
    out = await s.invoke('{"x": 1, "addr": {"street": "Main", "number": 3}}')
    assert json.loads(out) == {"street": "Main", "number": 4, "note": None}
    assert seen_threads and seen_threads[0] is not threading.main_thread()
    assert json.loads(await d.invoke("")) == {"p": {"x": 1, "y": 2}, "n": None, "u": "celsius"}
    assert await tool(lambda_free).invoke('{"x": 21}') == "42"


async def test_invoke_bad_arguments_are_typed_and_the_function_is_not_called():
    calls = []

    @tool
    def f(n: int, unit: Unit = Unit.CELSIUS) -> str:
        """F."""
        calls.append(n)
        return "ok"

    for text in ("not json", "[1, 2]", '{"n": "many"}', '{}', '{"n": 1, "extra": 2}', '{"n": 1, "unit": "kelvin"}'):
        with pytest.raises(ToolArgumentsError) as ei:
            await f.invoke(text)
        assert ei.value.code == "tool_arguments_invalid" and ei.value.tool == "f" and "f" in str(ei.value)
    assert calls == []
    with pytest.raises(ToolArgumentsError) as ei:
        await f.invoke('{"n": "many"}')
    assert ei.value.errors and ei.value.errors[0]["loc"] == ("n",) and "n:" in ei.value.message


async def test_invoke_timeout_async_is_cancelled_and_sync_is_abandoned():
    cancelled = asyncio.Event()
    release = threading.Event()

    @tool(timeout_s=0.05)
    async def slow() -> str:
        """Slow."""
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    @tool(timeout_s=0.05)
    def slow_sync() -> str:
        """Slow, sync."""
        release.wait(30)
        return "late"

    with pytest.raises(ToolTimeoutError) as ei:
        await slow.invoke("{}")
    assert ei.value.code == "tool_timeout" and ei.value.timeout_s == 0.05 and isinstance(ei.value, TimeoutError)
    assert cancelled.is_set()
    with pytest.raises(ToolTimeoutError):
        await slow_sync.invoke("{}")
    release.set()

    @tool(timeout_s=None)
    async def no_limit() -> str:
        """No limit."""
        await asyncio.sleep(0.01)
        return "done"

    assert await no_limit.invoke("{}") == "done"


async def test_tool_errors_propagate_unchanged_and_become_error_outputs():
    @tool
    def boom(x: int) -> str:
        """Boom."""
        raise KeyError(f"no record {x}")

    @tool
    def not_json() -> object:
        """Returns something JSON cannot hold."""
        return threading.Lock()

    with pytest.raises(KeyError):
        await boom.invoke('{"x": 7}')
    with pytest.raises(ToolOutputError) as ei:
        await not_json.invoke("{}")
    assert ei.value.code == "tool_output_invalid"
    assert json.loads(error_output(KeyError("no record 7"))) == {"error": "KeyError: 'no record 7'"}
    assert json.loads(error_output(ToolTimeoutError("boom", 2))) == {"error": "tool 'boom' did not finish within 2 s"}
    assert json.loads(error_output(ValueError())) == {"error": "ValueError"}
