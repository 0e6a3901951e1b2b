"""The sans-I/O ToolRunner (duplexkit.clients.tools) fed scripted server event dicts: starts, outputs,
error outputs, response.create and the floor, barge-in cancellation, late results."""

from __future__ import annotations

import json

import pytest

from duplexkit.agent import ToolArgumentsError, ToolDefinitionError, ToolTimeoutError, tool
from duplexkit.clients.tools import (
    CancelCall,
    Notify,
    SendEvent,
    StartCall,
    ToolCallFinished,
    ToolCallStarted,
    ToolRunner,
)


@tool
def add_note(text: str) -> str:
    """Add a note."""
    return "ok"


@tool(cancellable=False, late_result="speak")
def book(city: str) -> str:
    """Book a room (not interruptible; a late result is still spoken)."""
    return "booked"


@tool(late_result="drop", cancellable=False)
def lookup(q: str) -> str:
    """Look something up (a late result is dropped)."""
    return "found"


def fc_item(call_id, name="add_note", args='{"text": "milk"}', item_id=None, status="completed") -> dict:
    return {"type": "function_call", "id": item_id or f"item_{call_id}", "call_id": call_id, "name": name,
            "arguments": args, "status": status}


def created(rid, trigger="tool") -> dict:
    return {"type": "response.created", "response": {"id": rid, "status": "in_progress", "trigger": trigger}}


def item_done(rid, item) -> dict:
    return {"type": "response.output_item.done", "response_id": rid, "output_index": 0, "item": item}


def done(rid, items=(), status="completed") -> dict:
    return {"type": "response.done", "response": {"id": rid, "status": status, "output": list(items)}}


SPEECH = {"type": "input_audio_buffer.speech_started", "audio_start_ms": 100, "item_id": "item_u2"}


def kinds(actions) -> list:
    out = []
    for a in actions:
        if isinstance(a, SendEvent):
            out.append(("send", a.event["type"]))
        elif isinstance(a, StartCall):
            out.append(("start", a.call.call_id))
        elif isinstance(a, CancelCall):
            out.append(("cancel", a.call.call_id))
        elif isinstance(a, Notify):
            out.append((a.record.type, a.record.call.call_id))
    return out


def issue(r: ToolRunner, rid="resp_1", *items) -> list:
    """A tool response issuing ``items``; returns every action (the response is done at the end)."""
    acts = r.receive(created(rid))
    for it in items:
        acts += r.receive(item_done(rid, it))
    acts += r.receive(done(rid, items))
    return acts


def test_session_fields_and_definition_errors():
    r = ToolRunner([add_note, tool(filler="Booking.")(lambda_city)], tool_choice="required")
    f = r.session_fields()
    assert f["tool_choice"] == "required"
    assert [t["name"] for t in f["tools"]] == ["add_note", "lambda_city"]
    assert "filler" not in f["tools"][0] and f["tools"][1]["filler"] == "Booking."
    with pytest.raises(ToolDefinitionError, match="two tools"):
        ToolRunner([add_note, add_note])


def lambda_city(city: str) -> str:
    return city


def test_one_call_on_time_output_then_response_create():
    r = ToolRunner([add_note])
    acts = issue(r, "resp_1", fc_item("call_1"))
    # started once although response.done lists the item again
    assert kinds(acts) == [("client.tool_call.started", "call_1"), ("start", "call_1")]
    c = acts[1].call
    assert (c.name, c.arguments, c.item_id, c.response_id, c.status) == (
        "add_note", '{"text": "milk"}', "item_call_1", "resp_1", "running")
    assert c.tool is add_note
    acts = r.call_finished("call_1", output="ok")
    assert kinds(acts) == [("send", "conversation.item.create"), ("client.tool_call.finished", "call_1"),
                           ("send", "response.create")]
    assert acts[0].event["item"] == {"type": "function_call_output", "call_id": "call_1", "output": "ok"}
    assert c.status == "completed" and c.sent and not c.late
    assert r.call_finished("call_1", output="again") == []  # a second report changes nothing


def test_call_listed_only_in_response_done_still_runs_and_incomplete_items_do_not():
    r = ToolRunner([add_note])
    acts = r.receive(created("resp_1")) + r.receive(done("resp_1", [fc_item("call_1")]))
    assert ("start", "call_1") in kinds(acts)
    acts = r.receive(item_done("resp_2", fc_item("call_2", status="incomplete")))
    assert acts == [] and "call_2" not in r.calls
    assert r.receive(item_done("resp_2", {"type": "message", "id": "m1", "role": "assistant"})) == []


def test_errors_become_error_outputs():
    r = ToolRunner([add_note])
    issue(r, "resp_1", fc_item("call_1"))
    acts = r.call_finished("call_1", error=KeyError("no notebook"))
    out = json.loads(acts[0].event["item"]["output"])
    assert out == {"error": "KeyError: 'no notebook'"}
    assert r.calls["call_1"].status == "failed" and r.calls["call_1"].error == "KeyError: 'no notebook'"
    assert kinds(acts)[-1] == ("send", "response.create")

    issue(r, "resp_2", fc_item("call_2"))
    acts = r.call_finished("call_2", error=ToolTimeoutError("add_note", 2))
    assert json.loads(acts[0].event["item"]["output"]) == {"error": "tool 'add_note' did not finish within 2 s"}
    assert r.calls["call_2"].status == "timed_out"

    issue(r, "resp_3", fc_item("call_3", args='{"txt": 1}'))
    acts = r.call_finished("call_3", error=ToolArgumentsError("tool 'add_note': bad arguments: text: Field required"))
    assert "bad arguments" in json.loads(acts[0].event["item"]["output"])["error"]


def test_unknown_tool_is_answered_at_once_with_an_error_output():
    r = ToolRunner([add_note])
    acts = issue(r, "resp_1", fc_item("call_1", name="weather", args="{}"))
    assert kinds(acts) == [("client.tool_call.started", "call_1"), ("send", "conversation.item.create"),
                           ("client.tool_call.finished", "call_1"), ("send", "response.create")]
    assert "no tool named 'weather'" in json.loads(acts[1].event["item"]["output"])["error"]
    assert r.calls["call_1"].status == "failed"


def test_two_calls_of_one_response_get_one_response_create():
    r = ToolRunner([add_note, lookup])
    issue(r, "resp_1", fc_item("call_a"), fc_item("call_b", name="lookup", args='{"q": "x"}'))
    acts = r.call_finished("call_b", output="found")
    assert kinds(acts) == [("send", "conversation.item.create"), ("client.tool_call.finished", "call_b")]
    acts = r.call_finished("call_a", output="ok")
    assert kinds(acts) == [("send", "conversation.item.create"), ("client.tool_call.finished", "call_a"),
                           ("send", "response.create")]


def test_response_create_waits_for_the_floor_but_not_behind_a_filler():
    r = ToolRunner([add_note])
    issue(r, "resp_1", fc_item("call_1"))
    r.receive(created("resp_f", trigger="filler"))  # the server speaks its filler: it queues a create
    acts = r.call_finished("call_1", output="ok")
    assert kinds(acts)[-1] == ("send", "response.create")

    issue(r, "resp_2", fc_item("call_2"))
    r.receive(created("resp_m", trigger="model"))  # something else speaks: wait for its end
    acts = r.call_finished("call_2", output="ok")
    assert kinds(acts) == [("send", "conversation.item.create"), ("client.tool_call.finished", "call_2")]
    assert kinds(r.receive(done("resp_m"))) == [("send", "response.create")]
    assert r.receive(done("resp_f")) == []  # nothing left waiting


def test_barge_in_cancels_cancellable_calls_and_marks_the_others_late():
    r = ToolRunner([add_note, book, lookup])
    issue(r, "resp_1", fc_item("c_note"), fc_item("c_book", name="book", args='{"city": "Oslo"}'),
          fc_item("c_look", name="lookup", args='{"q": "x"}'))
    acts = r.receive(SPEECH)
    assert kinds(acts) == [("cancel", "c_note"), ("client.tool_call.finished", "c_note")]  # no item.delete
    assert r.calls["c_note"].status == "cancelled" and not r.calls["c_note"].late
    assert r.calls["c_book"].late and r.calls["c_look"].late
    assert r.call_finished("c_note", output="ok") == []  # a cancelled call's result is ignored
    # late + drop: nothing is sent
    acts = r.call_finished("c_look", output="found")
    assert kinds(acts) == [("client.tool_call.finished", "c_look")]
    assert r.calls["c_look"].status == "dropped" and r.calls["c_look"].output is None
    # late + speak while the user's new turn is answered: held until no response is active
    r.receive(created("resp_2", trigger="server_vad"))
    acts = r.call_finished("c_book", output="booked")
    assert acts == [] and not r.calls["c_book"].sent
    acts = r.receive(done("resp_2"))
    assert kinds(acts) == [("send", "conversation.item.create"), ("client.tool_call.finished", "c_book"),
                           ("send", "response.create")]
    assert acts[0].event["item"]["output"] == "booked"


def test_late_speak_result_is_held_even_behind_a_filler():
    r = ToolRunner([book])
    issue(r, "resp_1", fc_item("c1", name="book", args='{"city": "Oslo"}'))
    r.receive({"type": "conversation.item.added", "item": {"id": "u2", "type": "message", "role": "user",
                                                            "content": []}})  # a new user turn
    r.receive(created("resp_f", trigger="filler"))
    assert r.call_finished("c1", output="booked") == []
    assert kinds(r.receive(done("resp_f")))[-1] == ("send", "response.create")


def test_client_cancel_deletes_the_items_of_cancelled_calls():
    r = ToolRunner([add_note, book])
    issue(r, "resp_1", fc_item("c1"), fc_item("c2", name="book", args='{"city": "Oslo"}'))
    acts = r.client_cancelled()
    assert kinds(acts) == [("cancel", "c1"), ("send", "conversation.item.delete"), ("client.tool_call.finished", "c1")]
    assert acts[1].event == {"type": "conversation.item.delete", "item_id": "item_c1"}
    assert r.calls["c2"].status == "running" and not r.calls["c2"].late  # the user did not start a turn
    acts = r.call_finished("c2", output="booked")
    assert ("send", "response.create") in kinds(acts)


def test_deleted_item_and_session_close_cancel_running_calls():
    r = ToolRunner([add_note, book])
    issue(r, "resp_1", fc_item("c1"), fc_item("c2", name="book", args='{"city": "Oslo"}'))
    acts = r.receive({"type": "conversation.item.deleted", "item_id": "item_c2"})
    assert kinds(acts)[:1] == [("cancel", "c2")]  # even a non-cancellable tool: its call is gone
    acts = r.receive({"type": "session.closed", "reason": "client_close"})
    assert kinds(acts)[:1] == [("cancel", "c1")]
    assert [c.status for c in r.calls.values()] == ["cancelled", "cancelled"]


def test_replayed_items_do_not_run_twice_and_typed_events_are_accepted():
    from duplexkit.protocol import parse_server_event

    r = ToolRunner([add_note])
    ev = parse_server_event(item_done("resp_1", fc_item("call_1")))
    acts = r.receive(ev)
    assert ("start", "call_1") in kinds(acts)
    assert r.receive(ev) == [] and r.receive(item_done("resp_1", fc_item("call_1"))) == []
    assert isinstance(acts[0].record, ToolCallStarted)
    fin = r.call_finished("call_1", output="ok")
    assert isinstance(fin[1].record, ToolCallFinished) and fin[1].record.call is r.calls["call_1"]
