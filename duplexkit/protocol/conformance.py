"""An incremental checker of the server-event invariants of docs/protocol.md §12.

Feed every server event dict a session (or server) emits, in order, to
:meth:`EventStreamChecker.feed`; it raises :class:`ConformanceError` at the first violation of:

1. ``server_event_seq`` 1, 2, 3, … and unique ``event_id`` (§12.1);
5./6. the response envelope grammar of §5.3 (or its early-termination form), exactly one
   ``response.done`` per ``response.created``, and no event referencing R after ``response.done(R)``;
7. epoch monotonicity: no delta with an epoch lower than the highest epoch shown so far;
9. response ids and item ids never reused;
10. every delta references an open response and carries ``metadata.epoch`` equal to its epoch;
11. audio and transcript deltas alternate (audio first); ``transcript``/``text`` done equals the
    concatenated deltas;
12. ``audio_duration_ms`` strictly increasing and equal to floor(samples × 1000 / 24000); audio
    deltas are whole pcm16 samples;
13. ``audio_text_marks`` non-decreasing, ``text_chars`` ≤ transcript length sent so far;
14. at most one active response;
15. function calls (docs/tools.md): a ``function_call`` item is added to the conversation before its
    ``response.output_item.added``, its argument deltas and done reference it, the done ``arguments``
    equal the joined deltas, and its ``response.output_item.done`` comes after the done; a response
    whose output is calls has no assistant message.

Used by the Session's property tests and usable by server/client conformance tests.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Optional

from duplexkit.errors import ConformanceError

from .vocabulary import PCM_RATE

__all__ = ["ConformanceError", "EventStreamChecker"]

_DELTA_TYPES = {
    "response.output_audio.delta",
    "response.output_audio_transcript.delta",
    "response.output_text.delta",
}

# envelope step of each event type (docs/protocol.md §5.3); deltas are step 6
_STEP = {
    "response.created": 1,
    "conversation.item.added": 2,
    "response.output_item.added": 3,
    "response.content_part.added": 4,
    "response.speak": 5,
    "response.output_audio.delta": 6,
    "response.output_audio_transcript.delta": 6,
    "response.output_text.delta": 6,
    "response.output_audio.done": 7,
    "response.output_audio_transcript.done": 8,
    "response.output_text.done": 8,
    "response.content_part.done": 9,
    "response.output_item.done": 10,
    "conversation.item.done": 11,
    "response.listen": 11,
    "response.function_call_arguments.delta": 6,  # function calls: rule 15 (checked apart from the envelope)
    "response.function_call_arguments.done": 6,
    "response.done": 12,
}


@dataclass
class _Resp:
    id: str
    epoch: int
    item_id: Optional[str] = None
    step: int = 1
    expect_transcript: bool = False
    transcript: str = ""
    text: str = ""
    samples: int = 0
    last_ms: int = -1
    mark_chars: int = 0
    mark_ms: int = 0
    audio_deltas: int = 0
    calls: dict = field(default_factory=dict)  # function_call item id -> [arguments so far, done]


@dataclass
class EventStreamChecker:
    """Incremental §12 checker. ``events`` keeps every event fed; ``done`` maps response id ->
    its ``response.done`` event."""

    events: list = field(default_factory=list)
    done: dict = field(default_factory=dict)
    created: dict = field(default_factory=dict)
    max_epoch: int = 0
    _seq: int = 0
    _event_ids: set = field(default_factory=set)
    _items: set = field(default_factory=set)
    _active: Optional[_Resp] = None
    _by_item: dict = field(default_factory=dict)

    def fail(self, msg: str, ev: dict) -> None:
        raise ConformanceError(f"{msg} (event #{ev.get('server_event_seq')} {ev.get('type')})")

    def feed_all(self, events) -> None:
        for ev in events:
            if isinstance(ev, dict):
                self.feed(ev)

    def feed(self, ev: dict) -> None:
        self.events.append(ev)
        t = ev.get("type")
        # 1. sequence and event ids
        seq = ev.get("server_event_seq")
        if seq != self._seq + 1:
            self.fail(f"server_event_seq {seq} after {self._seq}", ev)
        self._seq = seq
        eid = ev.get("event_id")
        if not isinstance(eid, str) or not eid or eid in self._event_ids:
            self.fail(f"missing or repeated event_id {eid!r}", ev)
        self._event_ids.add(eid)
        # 7. epoch monotonicity (every place an epoch is shown)
        shown = []
        if isinstance(ev.get("epoch"), int):
            shown.append(ev["epoch"])
        for key in ("session", "response"):
            obj = ev.get(key)
            if isinstance(obj, dict) and isinstance(obj.get("epoch"), int):
                shown.append(obj["epoch"])
        meta = ev.get("metadata")
        if isinstance(meta, dict) and isinstance(meta.get("epoch"), int):
            shown.append(meta["epoch"])
        for e in shown:
            if t in _DELTA_TYPES and e < self.max_epoch:
                self.fail(f"delta of epoch {e} after epoch {self.max_epoch} was shown", ev)
        # 6. silence after done
        rid = ev.get("response_id")
        if rid is None and isinstance(ev.get("response"), dict):
            rid = ev["response"].get("id")
        if rid is not None and rid in self.done:
            self.fail(f"event references response {rid} after its response.done", ev)
        if t == "response.created":
            self._on_created(ev)
        elif rid is not None and t in _STEP:
            self._on_response_event(ev, rid, t)
        elif t == "conversation.item.added":
            iid = self._new_item(ev)
            if self._active is not None and ev["item"].get("type") == "function_call":
                if self._active.item_id is not None:
                    self.fail("a function_call item in a response that has an assistant message", ev)
                self._active.calls[iid] = ["", False]
            elif self._active is not None and ev["item"].get("role") == "assistant":
                if self._active.item_id is not None:
                    self.fail("a second assistant item for one response", ev)
                self._active.item_id = iid
                self._step(self._active, t, ev)
        elif t == "conversation.item.done" and self._active is not None and ev["item"]["id"] == self._active.item_id:
            self._step(self._active, t, ev)
        elif t in _DELTA_TYPES:
            self.fail("delta without response_id", ev)
        if shown:
            self.max_epoch = max(self.max_epoch, *shown)

    # --------------------------------------------------------------------------------------

    def _new_item(self, ev: dict) -> str:
        iid = ev["item"]["id"]
        if iid in self._items:
            self.fail(f"item id {iid} reused", ev)
        self._items.add(iid)
        return iid

    def _on_created(self, ev: dict) -> None:
        r = ev["response"]
        rid = r["id"]
        if rid in self.created:
            self.fail(f"response id {rid} reused", ev)
        if self._active is not None:
            self.fail(f"response {rid} created while {self._active.id} is active", ev)
        if r.get("status") != "in_progress":
            self.fail("response.created status is not in_progress", ev)
        self.created[rid] = ev
        self._active = _Resp(id=rid, epoch=int(r.get("epoch", 0)))

    def _call_event(self, r: _Resp, t: str, ev: dict) -> bool:
        """Rule 15 for one event of response ``r``; True when the event was a function-call event."""
        if t in ("response.output_item.added", "response.output_item.done"):
            item = ev.get("item") or {}
            if item.get("type") != "function_call":
                return False
            c = r.calls.get(item.get("id"))
            if c is None:
                self.fail(f"{t} of a function_call item not added to the conversation first", ev)
            if t == "response.output_item.done" and not c[1]:
                self.fail("function_call output item done before its arguments are done", ev)
            return True
        if t in ("response.function_call_arguments.delta", "response.function_call_arguments.done"):
            c = r.calls.get(ev.get("item_id"))
            if c is None:
                self.fail(f"{t} for an item that is not a function call of this response", ev)
            if c[1]:
                self.fail(f"{t} after the arguments were done", ev)
            if t.endswith(".delta"):
                c[0] += ev["delta"]
            else:
                if ev["arguments"] != c[0]:
                    self.fail("function_call_arguments.done differs from the joined deltas", ev)
                c[1] = True
            return True
        return False

    def _step(self, r: _Resp, t: str, ev: dict) -> None:
        s = _STEP[t]
        if s < r.step or (s == r.step and s != 6):
            self.fail(f"envelope order: {t} (step {s}) after step {r.step}", ev)
        if t == "conversation.item.added" and r.step != 1:
            self.fail("assistant item added out of order", ev)
        r.step = s

    def _on_response_event(self, ev: dict, rid: str, t: str) -> None:
        r = self._active
        if r is None or r.id != rid:
            self.fail(f"event for response {rid} which is not active", ev)
        if r.expect_transcript and t != "response.output_audio_transcript.delta":
            self.fail("an audio delta must be followed by exactly one transcript delta", ev)
        if self._call_event(r, t, ev):
            return
        if t == "response.output_item.added":
            iid = ev["item"]["id"]
            if r.item_id is None:
                self.fail("output item added before its conversation.item.added", ev)
            elif iid != r.item_id:
                self.fail("output item differs from the assistant item", ev)
        if t in _DELTA_TYPES or t in ("response.output_audio.done", "response.output_audio_transcript.done",
                                      "response.output_text.done", "response.content_part.added",
                                      "response.content_part.done", "response.speak"):
            if ev.get("item_id") != r.item_id or r.item_id is None:
                self.fail("event item_id does not match the response's item", ev)
        if t in _DELTA_TYPES:
            meta = ev.get("metadata") or {}
            if meta.get("epoch") != r.epoch:
                self.fail(f"delta metadata.epoch {meta.get('epoch')} != response epoch {r.epoch}", ev)
        if t == "response.output_audio.delta":
            raw = base64.b64decode(ev["delta"], validate=True)
            if len(raw) % 2:
                self.fail("audio delta is not whole pcm16 samples", ev)
            r.samples += len(raw) // 2
            ms = meta["audio_duration_ms"]
            if ms != r.samples * 1000 // PCM_RATE:
                self.fail(f"audio_duration_ms {ms} != floor(samples*1000/24000)", ev)
            if ms <= r.last_ms:
                self.fail("audio_duration_ms does not increase strictly", ev)
            r.last_ms = ms
            r.expect_transcript = True
            r.audio_deltas += 1
            marks = meta.get("audio_text_marks") or []
            for m in marks:
                if m["text_chars"] < r.mark_chars or m["audio_end_ms"] < r.mark_ms:
                    self.fail("audio_text_marks decrease", ev)
                r.mark_chars, r.mark_ms = m["text_chars"], m["audio_end_ms"]
            r._pending_marks = marks  # checked against the transcript after its delta
        elif t == "response.output_audio_transcript.delta":
            if not r.expect_transcript:
                self.fail("transcript delta without a preceding audio delta", ev)
            r.expect_transcript = False
            r.transcript += ev["delta"]
            for m in getattr(r, "_pending_marks", []):
                if m["text_chars"] > len(r.transcript):
                    self.fail("audio_text_marks text_chars exceeds the transcript sent", ev)
        elif t == "response.output_text.delta":
            r.text += ev["delta"]
        elif t == "response.output_audio_transcript.done":
            if ev["transcript"] != r.transcript:
                self.fail("transcript done differs from the joined deltas", ev)
        elif t == "response.output_text.done":
            if ev["text"] != r.text:
                self.fail("text done differs from the joined deltas", ev)
        self._step(r, t, ev)
        if t == "response.done":
            if ev["response"].get("status") not in ("completed", "cancelled", "incomplete", "failed"):
                self.fail("response.done has no final status", ev)
            self.done[rid] = ev
            self._active = None
