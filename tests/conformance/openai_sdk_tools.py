"""The function-calling flow (docs/tools.md, "The wire flow") driven by the unmodified OpenAI Python
SDK realtime client, GA (``client.realtime.connect``) and beta (``client.beta.realtime.connect``).

Every received server event is validated against the SDK's typed models of its dialect
(``openai.types.realtime.RealtimeServerEvent`` / ``openai.types.beta.realtime.RealtimeServerEvent``);
duplexkit's extension events (``session.warning``, ...) against their own models
(:func:`duplexkit.protocol.parse_server_event`). Waits are bounded by events: each ``until`` ends on
an event and fails only when it does not come within its (scaled) bound.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any, Callable, Optional

import jsonschema
from pydantic import TypeAdapter

from duplexkit.protocol import EXTENSION_EVENT_TYPES, UnknownServerEvent, parse_server_event
from openai_sdk_turns import pcm24k_b64, sdk_client

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                      "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
                "parameters": WEATHER_PARAMETERS}
FILLER = "One moment, I'll check."
#: duplexkit's own events (the SDKs surface them untyped): validated by duplexkit.protocol's models
EXTENSIONS = EXTENSION_EVENT_TYPES

#: the events of a response whose output is one function call, in order (docs/protocol.md §5.4)
CALL_RESPONSE_GA = ["response.created", "conversation.item.added", "response.output_item.added",
                    "response.function_call_arguments.delta", "response.function_call_arguments.done",
                    "response.output_item.done", "conversation.item.done", "response.done"]


def ga_adapter() -> TypeAdapter:
    from openai.types.realtime import RealtimeServerEvent

    return TypeAdapter(RealtimeServerEvent)


def beta_adapter() -> TypeAdapter:
    from openai.types.beta.realtime import RealtimeServerEvent

    return TypeAdapter(RealtimeServerEvent)


class Recorder:
    """Receives the events of one SDK connection, validates each and keeps them in order."""

    def __init__(self, conn: Any, adapter: TypeAdapter, timeout: float) -> None:
        self.conn, self.adapter, self.timeout = conn, adapter, timeout
        self.events: list = []  # SDK event objects (extension events: the SDK's untyped object)
        self.raw: list[dict] = []

    async def next(self) -> Any:
        ev = await self.conn.recv()
        raw = ev.model_dump(exclude_unset=True) if hasattr(ev, "model_dump") else dict(ev)
        if raw.get("type") in EXTENSIONS:
            parsed = parse_server_event(raw)
            assert not isinstance(parsed, UnknownServerEvent), raw
        else:
            self.adapter.validate_python(raw)
        self.events.append(ev)
        self.raw.append(raw)
        return ev

    async def until(self, pred: Callable[[Any], bool], *, errors_ok: bool = False) -> list:
        """Events up to and including the first for which ``pred`` is true; an ``error`` event that
        ``pred`` does not accept fails (unless ``errors_ok``)."""
        start = len(self.events)
        async with asyncio.timeout(self.timeout):
            while True:
                ev = await self.next()
                if pred(ev):
                    return self.events[start:]
                if ev.type == "error" and not errors_ok:
                    raise AssertionError(f"server error: {self.raw[-1]}")

    async def all_of(self, *types: str) -> list:
        """Events until each of ``types`` has come (in any order)."""
        want = set(types)

        def pred(ev):
            want.discard(ev.type)
            return not want

        return await self.until(pred)

    async def responses(self, n: int) -> list:
        """Events until the ``n``-th ``response.done`` from now."""
        seen = [0]

        def pred(ev):
            seen[0] += ev.type == "response.done"
            return seen[0] == n

        return await self.until(pred)


def trigger(response: Any) -> Optional[str]:
    """The duplexkit ``trigger`` of a typed response object (an extra key the SDK keeps)."""
    extra = getattr(response, "model_extra", None) or {}
    return extra.get("trigger")


def split_responses(events: list) -> list[list]:
    """The events of each response (``response.created`` .. ``response.done``), in order."""
    out, cur = [], None
    for ev in events:
        if ev.type == "response.created":
            cur = []
        if cur is not None:
            cur.append(ev)
        if ev.type == "response.done" and cur is not None:
            out.append(cur)
            cur = None
    return out


def audio_samples(events: list, delta_type: str = "response.output_audio.delta") -> int:
    return sum(len(base64.b64decode(e.delta)) // 2 for e in events if e.type == delta_type)


def transcript(events: list, delta_type: str = "response.output_audio_transcript.delta") -> str:
    return "".join(e.delta for e in events if e.type == delta_type)


def check_call_response(events: list, parameters: dict = WEATHER_PARAMETERS, *, beta: bool = False) -> dict:
    """Asserts a function-call response's events (docs/protocol.md §5.4); returns the call as a dict
    (``call_id``, ``name``, ``arguments``, ``item_id``, ``response_id``)."""
    types = [e.type for e in events]
    want = list(CALL_RESPONSE_GA)
    if beta:
        want = [t for t in want if t != "conversation.item.done"]
        want[1] = "conversation.item.created"
    assert types == want, types
    created, added, delta, done_args, item_done, done = (events[0], events[1], events[3], events[4],
                                                         events[5], events[-1])
    rid = created.response.id
    # "tool" after a commit; "server_vad" when the VAD's create_response made the response first and the
    # turn's decision took it over; "client" for a response.create under required
    assert trigger(created.response) in ("tool", "server_vad", "client"), created.response
    item = added.item
    assert item.type == "function_call" and item.name == done_args.name and item.call_id == done_args.call_id
    assert item.call_id.startswith("call_") and (item.arguments or "") == ""
    assert delta.call_id == item.call_id and delta.response_id == rid and delta.item_id == item.id
    assert delta.delta == done_args.arguments  # the whole arguments in one delta
    args = json.loads(done_args.arguments)
    jsonschema.validate(args, parameters)
    assert item_done.item.status == "completed" and item_done.item.arguments == done_args.arguments
    assert done.response.id == rid and done.response.status == "completed"
    assert [o.type for o in done.response.output] == ["function_call"]
    assert done.response.output[0].call_id == item.call_id
    return {"call_id": item.call_id, "name": item.name, "arguments": done_args.arguments, "args": args,
            "item_id": item.id, "response_id": rid}


def check_spoken_response(events: list, *, beta: bool = False) -> dict:
    """A response that speaks (audio deltas) and completes; returns its trigger, samples, transcript."""
    audio_t = "response.audio.delta" if beta else "response.output_audio.delta"
    text_t = "response.audio_transcript.delta" if beta else "response.output_audio_transcript.delta"
    assert events[0].type == "response.created" and events[-1].type == "response.done", [e.type for e in events]
    done = events[-1].response
    assert done.status == "completed", done
    n = audio_samples(events, audio_t)
    assert n > 0, [e.type for e in events]
    return {"trigger": trigger(events[0].response), "samples": n, "transcript": transcript(events, text_t),
            "response_id": events[0].response.id}


async def speak(conn: Any, wav, silence_s: float = 0.0) -> None:
    for chunk in pcm24k_b64(wav, seconds_of_silence=silence_s):
        await conn.input_audio_buffer.append(audio=chunk)
