"""Client-side function tools: the sans-I/O :class:`ToolRunner` that decides what to do with the
server's ``function_call`` items, and the typed records the clients deliver for UIs.

The server (any server following OpenAI Realtime's function-calling flow) issues a call as a
``function_call`` output item of a response (``response.output_item.done`` with
``item.type == "function_call"`` and ``call_id``, ``name``, ``arguments``; the item is listed again in
``response.done.response.output``). The client runs the function and answers with
``conversation.item.create{item: {type: "function_call_output", call_id, output}}`` followed by one
``response.create`` so the model says the result.

:class:`ToolRunner` holds every rule and does no I/O (like :class:`~duplexkit.clients.state.ClientState`):
server event dicts go in through :meth:`ToolRunner.receive`, the shell reports finished calls
through :meth:`ToolRunner.call_finished` and the client's own interruptions through
:meth:`ToolRunner.client_cancelled`; each returns actions (:class:`StartCall`, :class:`CancelCall`,
:class:`SendEvent`, :class:`Notify`) that the asyncio shell (:mod:`duplexkit.clients.base`) carries out.

Rules:

* **Start.** A ``function_call`` item that completed (``status`` completed or absent) starts its tool
  once per ``call_id`` (replays and the ``response.done`` listing do not start it again). A name the
  client has no tool for is answered at once with an error output.
* **Answer.** A finished call's output (or ``{"error": ...}`` for a tool error, bad arguments or a
  timeout) is sent at once; the ``response.create`` follows when the last call of the same response
  is settled, and only while the floor allows it: no response is active, or the active one is the
  server's ``filler`` / ``progress`` line (a duplexkit server queues a ``response.create`` behind
  those). Otherwise it waits for that response's ``response.done``.
* **Barge-in.** ``input_audio_buffer.speech_started`` while a call runs, or the client's own
  ``cancel()`` / ``barge_in()``, cancels the running calls of ``cancellable`` tools: nothing is sent
  for them. The client's own cancel also deletes their ``function_call`` items
  (``conversation.item.delete``), so a duplexkit server stops holding the model for them (a server
  VAD's new turn already does). A ``conversation.item.deleted`` of a running call's item cancels it too.
* **Late results.** A result that arrives after the user started a new turn
  (``input_audio_buffer.speech_started`` or a new user item after the call was issued) follows the
  tool's ``late_result``: ``"drop"`` sends nothing; ``"speak"`` sends the output and the
  ``response.create`` once no response is active at all.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from duplexkit.agent.tools import FunctionTool, as_tool, error_output
from duplexkit.errors import ToolDefinitionError, ToolTimeoutError

__all__ = ["ToolRunner", "ToolCallRecord", "ToolCallStarted", "ToolCallFinished", "StartCall", "CancelCall",
           "SendEvent", "Notify", "FLOOR_TRIGGERS", "MAX_KEPT_CALLS"]

FLOOR_TRIGGERS = frozenset({"filler", "progress"})
"""Triggers of server responses that a duplexkit server queues a ``response.create`` behind."""

MAX_KEPT_CALLS = 256
"""Settled calls kept in :attr:`ToolRunner.calls`; older settled ones are forgotten."""


@dataclass
class ToolCallRecord:
    """One function call as the client sees it.

    Attributes:
        call_id, name, arguments: from the server's ``function_call`` item (``arguments``: JSON text).
        item_id: the ``function_call`` item's id; response_id: the response that issued it.
        status: ``running``; then ``completed`` (output sent or queued), ``failed`` (the tool raised,
            the arguments were bad or no such tool: an error output), ``timed_out`` (an error
            output), ``cancelled`` (barge-in: nothing sent) or ``dropped`` (a late result of a
            ``late_result="drop"`` tool: nothing sent).
        output: the output text sent (or to be sent) for it, None when nothing is.
        error: the error text for ``failed`` / ``timed_out``; late: the user started a new turn after
            the call was issued; sent: its output went to the server; elapsed_ms: run time, ms (set
            by the shell).
    """

    call_id: str
    name: str
    arguments: str
    item_id: Optional[str] = None
    response_id: Optional[str] = None
    status: str = "running"
    output: Optional[str] = None
    error: Optional[str] = None
    late: bool = False
    sent: bool = False
    elapsed_ms: Optional[float] = None
    tool: Optional[FunctionTool] = field(default=None, repr=False)

    @property
    def settled(self) -> bool:
        """True once the call is no longer running."""
        return self.status != "running"


# ------------------------------------------------------------------------------ records for events()


@dataclass(frozen=True)
class ToolCallStarted:
    """Delivered to ``events()`` (type ``client.tool_call.started``, not a server event) when the
    client starts running a call; ``call`` is its live :class:`ToolCallRecord`."""

    call: ToolCallRecord
    type: str = "client.tool_call.started"


@dataclass(frozen=True)
class ToolCallFinished:
    """Delivered to ``events()`` (type ``client.tool_call.finished``) when a call is settled;
    ``call.status`` says how (see :class:`ToolCallRecord`)."""

    call: ToolCallRecord
    type: str = "client.tool_call.finished"


# ------------------------------------------------------------------------------ actions


@dataclass(frozen=True)
class StartCall:
    """Run ``call.tool.invoke(call.arguments)`` and report with :meth:`ToolRunner.call_finished`."""

    call: ToolCallRecord


@dataclass(frozen=True)
class CancelCall:
    """Cancel the running task of ``call`` (its result, if any, is ignored)."""

    call: ToolCallRecord


@dataclass(frozen=True)
class SendEvent:
    """Send this client event (a JSON-ready dict), in order with the other SendEvents."""

    event: dict


@dataclass(frozen=True)
class Notify:
    """Deliver this record (:class:`ToolCallStarted` / :class:`ToolCallFinished`) to ``events()``."""

    record: Union[ToolCallStarted, ToolCallFinished]


ToolAction = Union[StartCall, CancelCall, SendEvent, Notify]


# ------------------------------------------------------------------------------ the runner


class ToolRunner:
    """The sans-I/O rules of client-side tools (see the module doc).

    Args:
        tools: plain sync/async functions or :class:`~duplexkit.agent.FunctionTool` objects.
        tool_choice: ``auto`` | ``required`` | ``none`` | ``{"type": "function", "name": ...}``,
            sent with the tools.

    Attributes:
        tools: name -> :class:`~duplexkit.agent.FunctionTool`.
        calls: call_id -> :class:`ToolCallRecord`, oldest first.

    Raises:
        ToolDefinitionError: a function that cannot be a tool, or two tools with one name.
    """

    def __init__(self, tools: Iterable[Any], tool_choice: Union[str, dict] = "auto") -> None:
        self.tools: dict = {}
        for t in tools:
            ft = as_tool(t)
            if ft.name in self.tools:
                raise ToolDefinitionError(f"two tools are named {ft.name!r}", tool=ft.name)
            self.tools[ft.name] = ft
        self.tool_choice = tool_choice
        self.calls: "OrderedDict[str, ToolCallRecord]" = OrderedDict()
        self._active: dict = {}  # response_id -> trigger, of responses still generating
        self._waiting: list = []  # response ids whose response.create waits for the floor
        self._late_ready: list = []  # late "speak" records whose output waits for a free floor
        self._out: list = []

    # -------------------------------------------------------------- session fields
    def session_fields(self) -> dict:
        """``{"tools": [...], "tool_choice": ...}`` for a ``session.update`` (each tool's schema plus
        its ``filler`` when set)."""
        return {"tools": [t.session_tool() for t in self.tools.values()], "tool_choice": self.tool_choice}

    # -------------------------------------------------------------- queries
    @property
    def running(self) -> list:
        """Records of the calls still running."""
        return [c for c in self.calls.values() if c.status == "running"]

    # -------------------------------------------------------------- inputs
    def receive(self, event: Any) -> list:
        """Handle one server event (a dict, or a pydantic model of one). Returns the actions."""
        ev = event if isinstance(event, dict) else _as_dict(event)
        t = ev.get("type")
        if t == "response.created":
            r = ev.get("response") or {}
            if r.get("id"):
                self._active[r["id"]] = r.get("trigger")
        elif t == "response.output_item.done":
            self._function_item(ev.get("item") or {}, ev.get("response_id"))
        elif t == "response.done":
            r = ev.get("response") or {}
            for item in r.get("output") or ():
                if isinstance(item, dict):
                    self._function_item(item, r.get("id"))
            self._active.pop(r.get("id"), None)
            self._floor_changed()
        elif t == "input_audio_buffer.speech_started":
            self._new_user_turn(barge_in=True, delete_items=False)
        elif t in ("conversation.item.added", "conversation.item.created"):
            item = ev.get("item") or {}
            if item.get("role") == "user" and item.get("type", "message") == "message":
                self._new_user_turn(barge_in=False, delete_items=False)
        elif t == "conversation.item.deleted":
            for c in self.running:
                if c.item_id and c.item_id == ev.get("item_id"):
                    self._cancel(c, delete_item=False)
        elif t == "session.closed":
            for c in self.running:
                self._cancel(c, delete_item=False)
            self._waiting.clear()
            self._late_ready.clear()
        return self._take()

    def client_cancelled(self) -> list:
        """The client's own ``cancel()`` or ``barge_in()``: cancel the running calls of
        ``cancellable`` tools and delete their ``function_call`` items. Returns the actions."""
        self._new_user_turn(barge_in=True, delete_items=True, mark_late=False)
        return self._take()

    def call_finished(self, call_id: str, output: Optional[str] = None,
                      error: Optional[BaseException] = None) -> list:
        """The shell's report: ``call_id``'s tool returned ``output`` or raised ``error``
        (``ToolArgumentsError``, ``ToolTimeoutError``, ``ToolOutputError`` or the function's own).
        A cancelled call's report is ignored. Returns the actions."""
        c = self.calls.get(call_id)
        if c is None or c.status != "running":
            return self._take()
        if error is not None:
            c.status = "timed_out" if isinstance(error, ToolTimeoutError) else "failed"
            c.output = error_output(error)
            c.error = _error_text(c.output)
        else:
            c.status, c.output = "completed", output if output is not None else ""
        self._settled(c)
        return self._take()

    # -------------------------------------------------------------- rules
    def _function_item(self, item: dict, response_id: Optional[str]) -> None:
        if item.get("type") != "function_call" or item.get("status") not in (None, "completed"):
            return
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id or call_id in self.calls:
            return
        c = ToolCallRecord(call_id=call_id, name=str(item.get("name") or ""), arguments=item.get("arguments") or "",
                           item_id=item.get("id"), response_id=response_id)
        self.calls[call_id] = c
        self._forget_old()
        c.tool = self.tools.get(c.name)
        self._out.append(Notify(ToolCallStarted(c)))
        if c.tool is None:
            c.status = "failed"
            c.output = error_output(LookupError(f"no tool named {c.name!r} on this client "
                                                f"(it has {sorted(self.tools)})"))
            c.error = _error_text(c.output)
            self._settled(c)
            return
        self._out.append(StartCall(c))

    def _new_user_turn(self, *, barge_in: bool, delete_items: bool, mark_late: bool = True) -> None:
        for c in self.running:
            if barge_in and c.tool is not None and c.tool.cancellable:
                self._cancel(c, delete_item=delete_items)
            elif mark_late:
                c.late = True

    def _cancel(self, c: ToolCallRecord, *, delete_item: bool) -> None:
        c.status = "cancelled"
        self._out.append(CancelCall(c))
        if delete_item and c.item_id:
            self._out.append(SendEvent({"type": "conversation.item.delete", "item_id": c.item_id}))
        self._out.append(Notify(ToolCallFinished(c)))
        self._group_settled(c.response_id)

    def _settled(self, c: ToolCallRecord) -> None:
        if c.late and c.tool is not None and c.tool.late_result == "drop":
            c.status, c.output = "dropped", None
            self._out.append(Notify(ToolCallFinished(c)))
            self._group_settled(c.response_id)
            return
        if c.late:  # "speak": output and response.create once no response is active
            self._late_ready.append(c)
            self._floor_changed()
            return
        self._send_output(c)
        self._out.append(Notify(ToolCallFinished(c)))
        self._group_settled(c.response_id)

    def _send_output(self, c: ToolCallRecord) -> None:
        c.sent = True
        self._out.append(SendEvent({"type": "conversation.item.create",
                                    "item": {"type": "function_call_output", "call_id": c.call_id,
                                             "output": c.output or ""}}))

    def _group_settled(self, response_id: Optional[str]) -> None:
        """A call of ``response_id`` settled: when none of its calls runs any more and at least one
        output went out on time, its ``response.create`` is due."""
        group = [c for c in self.calls.values() if c.response_id == response_id]
        if any(c.status == "running" for c in group):
            return
        if any(c.sent and not c.late for c in group) and response_id not in self._waiting:
            self._waiting.append(response_id)
        self._floor_changed()

    def _floor_changed(self) -> None:
        if not self._active and self._late_ready:
            for c in self._late_ready:
                self._send_output(c)
                self._out.append(Notify(ToolCallFinished(c)))
            self._late_ready.clear()
            self._out.append(SendEvent({"type": "response.create"}))
            self._waiting.clear()  # one response answers every output sent so far
            return
        if self._waiting and all(trig in FLOOR_TRIGGERS for trig in self._active.values()):
            self._waiting.clear()
            self._out.append(SendEvent({"type": "response.create"}))

    def _forget_old(self) -> None:
        if len(self.calls) <= MAX_KEPT_CALLS:
            return
        old = [k for k, c in self.calls.items() if c.settled]
        for k in old[: len(self.calls) - MAX_KEPT_CALLS // 2]:
            del self.calls[k]

    def _take(self) -> list:
        out, self._out = self._out, []
        return out


def _as_dict(ev: Any) -> dict:
    raw = getattr(ev, "raw", None)
    if isinstance(raw, dict):
        return raw
    dump = getattr(ev, "model_dump", None)
    return dump(mode="json", exclude_none=True) if dump is not None else {}


def _error_text(output: str) -> str:
    import json

    try:
        return str(json.loads(output).get("error"))
    except (ValueError, AttributeError):
        return output
