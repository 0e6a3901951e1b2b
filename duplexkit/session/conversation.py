"""The conversation of a Session and its playback truth (docs/protocol.md §7): the
:class:`Conversation` part owns the items, the ids issued, the response -> assistant item map;
it answers ``conversation.item.*`` events and ``output_audio_buffer.playback_ack``, truncates, and
gives the history at playback truth."""

from __future__ import annotations

import numpy as np
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from duplexkit.audio import AudioFormatError, StreamDecoder, b64decode_audio
from duplexkit.engine.api import INPUT_SAMPLE_RATE
from duplexkit.protocol import (
    ConversationItemAdded,
    ConversationItemCreateEvent,
    ConversationItemDeleteEvent,
    ConversationItemDeleted,
    ConversationItemDone,
    ConversationItemRetrieveEvent,
    ConversationItemRetrieved,
    ConversationItemTruncateEvent,
    ConversationItemTruncated,
    ErrorCode,
    PlaybackAckEvent,
    ProtocolError,
)
from duplexkit.protocol import Item
from duplexkit.session.wire import item_model


#: ``session.warning{code:"instructions_reprefill"}`` text (docs/protocol.md §4.1).
REPREFILL_WARNING = (
    "{what} after the conversation started. MiniCPM-o reads its system prompt only from the "
    "session prefix it prefilled, so the duplex model gets the new text at the next turn boundary (no "
    "response active, no unit the model could start a turn in awaiting its decision), when the engine "
    "re-prefills the session context. After it the model knows the conversation so far only as a text transcript "
    "added to its system text (the user's turns by their transcripts, with audio.input.transcription set; the "
    "assistant's as far as they were heard), not as audio. The tool decider uses the new text from its next "
    "decision.")


#: ``session.warning{code:"text_item_not_heard"}`` text (docs/protocol.md §4.2).
TEXT_NOT_HEARD = (
    "text items after the first unit are kept in the conversation, where the tool decider, chat and "
    "transcripts read them, but the duplex model does not hear them: it takes text only in the session prefix "
    "it prefilled (system text and instructions are re-prefilled at the next turn boundary; user and assistant "
    "text is not)")


@dataclass
class _ConvItem:
    """One conversation item as the Session keeps it (the wire object is ``protocol.Item``)."""

    id: str
    role: Optional[str]
    kind: str  # "input_audio" | "input_text" | "output_audio" | "output_text" | "function_call" | "function_call_output"
    status: str = "completed"
    text: str = ""  # user/system text or transcript, the assistant transcript/text sent so far, call arguments or output
    response_id: Optional[str] = None
    marks: list = field(default_factory=list)  # [(text_chars, audio_end_ms)]
    sent_ms: int = 0
    committed_ms: int = 0
    final: bool = False
    name: Optional[str] = None  # function_call: the tool's name
    call_id: Optional[str] = None  # function_call / function_call_output


class Conversation:
    """The conversation part of :class:`~duplexkit.session.Session`.

    Args:
        s: the Session (its ``out`` outbox and the other parts' methods).

    State: the items in order, every item id used, the assistant item of each response that opened
    one, every response id issued.
    """

    def __init__(self, s) -> None:
        self._s = s
        self._o = s.out
        self._items: "OrderedDict[str, _ConvItem]" = OrderedDict()
        self._used_ids: set = set()
        self._responses: dict[str, _ConvItem] = {}  # response id -> assistant item (responses that opened one)
        self._issued: set = set()  # every response id this session issued

    # -- the store ------------------------------------------------------------------------------
    def item_playback(self, item_id: str) -> tuple[int, int, bool]:
        """``(sent_ms, committed_ms, final)`` of an assistant item. KeyError if unknown."""
        it = self.find(item_id)
        return it.sent_ms, it.committed_ms, it.final

    def history(self) -> list[dict]:
        """The conversation history at playback truth (docs/protocol.md §7.5): list of item dicts."""
        return [self.model(it, truth=True).model_dump(mode="json", exclude_none=True) for it in self._items.values()]

    def items(self) -> list:
        """The items in conversation order."""
        return list(self._items.values())

    def get(self, item_id: str) -> Optional[_ConvItem]:
        return self._items.get(item_id)

    def is_used(self, item_id: str) -> bool:
        """Whether ``item_id`` was ever issued or taken in this session."""
        return item_id in self._used_ids

    def new_item_id(self) -> str:
        iid = self._o.ids.item()
        self._used_ids.add(iid)
        return iid

    def last_id(self) -> Optional[str]:
        return next(reversed(self._items)) if self._items else None

    def previous_of(self, item_id: str) -> Optional[str]:
        prev = None
        for k in self._items:
            if k == item_id:
                return prev
            prev = k
        return None

    def add(self, it: _ConvItem) -> Optional[str]:
        """Append ``it``; returns the id of the item before it."""
        prev = self.last_id()
        self._used_ids.add(it.id)
        self._items[it.id] = it
        return prev

    def add_done(self, it: _ConvItem) -> Optional[str]:
        """Append a finished item and emit ``conversation.item.added`` + ``.done``; returns the
        previous item's id."""
        prev = self.add(it)
        self._o.emit(ConversationItemAdded(previous_item_id=prev, item=self.model(it)))
        self._o.emit(ConversationItemDone(previous_item_id=prev, item=self.model(it)))
        return prev

    def find(self, item_id: str) -> _ConvItem:
        it = self._items.get(item_id)
        if it is None:
            raise KeyError(item_id)
        return it

    def model(self, it: _ConvItem, truth: bool = False) -> Item:
        """The wire item (``truth``: an assistant audio item's transcript as far as it was heard)."""
        return item_model(it, self.truth_text(it) if truth else None)

    # -- responses ------------------------------------------------------------------------------
    def issue_response(self, rid: str) -> None:
        self._issued.add(rid)

    def response_item(self, rid: str) -> Optional[_ConvItem]:
        """The assistant item of response ``rid`` (None when it opened none)."""
        return self._responses.get(rid)

    def open_response_item(self, rid: str, it: _ConvItem) -> Optional[str]:
        """Append the assistant item of response ``rid``; returns the previous item's id."""
        prev = self.add(it)
        self._responses[rid] = it
        return prev

    def committed_ms(self, rid: str) -> int:
        it = self._responses.get(rid)
        return it.committed_ms if it is not None else 0

    def truth_text(self, it: _ConvItem) -> str:
        if it.kind != "output_audio":
            return it.text
        chars = 0
        for c, ms in it.marks:
            if ms <= it.committed_ms:
                chars = c
            else:
                break
        return it.text[:chars]

    def on_item_create(self, ev: ConversationItemCreateEvent, now_ms: float) -> None:
        item = ev.item

        def bad(msg: str, param: str = "item") -> ProtocolError:
            return ProtocolError(ErrorCode.BAD_EVENT, msg, param=param, event_id=ev.event_id)

        if ev.previous_item_id is not None:
            if ev.previous_item_id not in self._items:
                raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"item {ev.previous_item_id!r} not found",
                                    param="previous_item_id", event_id=ev.event_id)
            if ev.previous_item_id != self.last_id():
                raise bad("previous_item_id may only name the last item", "previous_item_id")
        if item.type == "function_call_output":
            self._s.tools.on_function_call_output(item, ev.event_id)
            return
        if item.type != "message" or item.role not in ("user", "system", "assistant"):
            raise bad("only message items (user, system, assistant) and function_call_output items are accepted",
                      "item.role" if item.type == "message" else "item.type")
        if item.id is not None and item.id in self._used_ids:
            raise bad(f"item id {item.id!r} is already used", "item.id")
        if not item.content:
            raise bad("item.content must not be empty", "item.content")
        kinds = {c.type for c in item.content}
        if item.role == "assistant":
            self._assistant_text_item(item, bad)
            return
        if kinds == {"input_text"}:
            text = "".join(c.text or "" for c in item.content)
            it = _ConvItem(id=item.id or self.new_item_id(), role=item.role, kind="input_text", text=text)
            started = self._s.input.units_appended() > 0
            warning = None
            if item.role == "system":
                # part of the session prefix: after the first unit, re-prefilled at the next turn boundary
                self._s.opts.add_system_text(text)
                if started:
                    warning = ("instructions_reprefill", REPREFILL_WARNING.format(what="A system message arrived"),
                               "item.system")
            elif not started:
                self._s.opts.add_seed_text(text, it.id)  # seeds the session prefix (docs/model.md §5.1)
            else:
                warning = ("text_item_not_heard", TEXT_NOT_HEARD, "item.input_text")
            self.add_done(it)
            if warning is not None:
                self._o.warn(*warning)
            self._s.opts.sync_stream()
            return
        if kinds == {"input_audio"} and item.role == "user":
            fmt = self._s.settings.input_format
            b64_len = sum(len(c.audio or "") for c in item.content)  # counted before anything is decoded
            self._s.input.check_pending(b64_len * 3 // 4 // fmt.frame_bytes * INPUT_SAMPLE_RATE // fmt.rate, ev.event_id)
            chunks = []
            dec = StreamDecoder(fmt)
            for i, c in enumerate(item.content):
                try:
                    chunks.append(dec.decode(b64decode_audio(c.audio or "", what=fmt.describe())))
                except AudioFormatError as e:
                    raise ProtocolError(ErrorCode.BAD_AUDIO, str(e), param=f"item.content.{i}.audio", event_id=ev.event_id) from None
            x = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
            if x.size == 0:
                raise bad("input_audio item has no audio", "item.content")
            self._s.input.item_audio(x, now_ms)
            it = _ConvItem(id=item.id or self.new_item_id(), role="user", kind="input_audio")
            self.add_done(it)
            self._s.tools.user_turn_ended(it.id, now_ms)
            return
        raise bad(f"unsupported content {sorted(kinds)} (input_text, or user input_audio)", "item.content")

    def _assistant_text_item(self, item, bad) -> None:
        """An assistant message item from the client (a framework restoring its chat context): its
        text (``output_text`` / beta ``text`` parts, or the transcript of audio parts that carry no
        audio) goes into the conversation, where the tool decider reads it as something the
        assistant said; the duplex model never heard it (one ``session.warning``)."""
        parts = []
        for i, c in enumerate(item.content):
            if c.type in ("output_text", "text", "input_text"):
                parts.append(c.text or "")
            elif c.type in ("output_audio", "audio") and not c.audio:
                parts.append(c.transcript or "")
            else:
                raise bad(f"assistant items take text (output_text parts, or audio parts with a transcript and no "
                          f"audio), got a {c.type!r} part" + (" with audio" if c.audio else ""),
                          f"item.content.{i}.type" if not c.audio else f"item.content.{i}.audio")
        it = _ConvItem(id=item.id or self.new_item_id(), role="assistant", kind="output_text", text="".join(parts),
                       final=True)
        self.add_done(it)
        self._o.warn("text_item_not_heard", TEXT_NOT_HEARD, "item.assistant")

    def on_item_retrieve(self, ev: ConversationItemRetrieveEvent, now_ms: float) -> None:
        it = self._items.get(ev.item_id)
        if it is None:
            raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"item {ev.item_id!r} not found", param="item_id", event_id=ev.event_id)
        self._o.emit(ConversationItemRetrieved(item=self.model(it, truth=True)))

    def on_item_delete(self, ev: ConversationItemDeleteEvent, now_ms: float) -> None:
        it = self._items.get(ev.item_id)
        if it is None:
            raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"item {ev.item_id!r} not found", param="item_id", event_id=ev.event_id)
        if self._s.resp.active() is not None and self._s.resp.active().item_id == ev.item_id:
            raise ProtocolError(ErrorCode.BAD_EVENT, "the active response's item cannot be deleted", param="item_id", event_id=ev.event_id)
        del self._items[ev.item_id]
        if it.kind == "function_call":
            self._s.tools.cancel_call_of(it.id)
        self._o.emit(ConversationItemDeleted(item_id=ev.item_id))

    def on_item_truncate(self, ev: ConversationItemTruncateEvent, now_ms: float) -> None:
        it = self._items.get(ev.item_id)
        if it is None:
            raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"item {ev.item_id!r} not found", param="item_id", event_id=ev.event_id)

        def invalid(msg: str, param: str) -> ProtocolError:
            return ProtocolError(ErrorCode.INVALID_TRUNCATE, msg, param=param, event_id=ev.event_id)

        if it.kind != "output_audio":
            raise invalid("only assistant audio items can be truncated", "item_id")
        ci = ev.content_index
        if isinstance(ci, bool) or not isinstance(ci, int) or ci != 0:
            raise invalid("content_index must be 0", "content_index")
        v = ev.audio_end_ms
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise invalid(f"audio_end_ms must be an integer >= 0, got {v!r}", "audio_end_ms")
        if it.sent_ms == 0:
            self._o.emit(ConversationItemTruncated(item_id=it.id, content_index=0, audio_end_ms=0))
            return
        it.committed_ms = min(v, it.sent_ms)
        it.final = True
        self._o.emit(ConversationItemTruncated(item_id=it.id, content_index=0, audio_end_ms=it.committed_ms))

    def on_playback_ack(self, ev: PlaybackAckEvent, now_ms: float) -> None:
        """``playback.ack`` (docs/protocol.md §7.5). ``heard = min(played_ms, sent_ms)`` (ms):

        * plain ack: ``committed_ms = max(committed_ms, heard)`` (never lowers);
        * ``truncate: true``: ``committed_ms = heard`` and final, even below an earlier ack or what
          ``commit_on_done`` committed at ``response.done``;
        * after finalisation (a truncate ack or ``conversation.item.truncate``): ignored.
        """
        if ev.response_id is None:
            iid = ev.item_id or ""
            rid = iid[len("item_"):] if iid.startswith("item_resp_") else None
            if rid is None and iid:
                rid = next((r for r, item in self._responses.items() if item.id == iid), None)
            if rid is None and not iid and self._responses:
                rid = next(reversed(self._responses))  # the latest response that sent audio
            if rid is None:
                raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, "playback.ack without response_id names no audio item "
                                    "of this session", param="response_id", event_id=ev.event_id)
            ev = ev.model_copy(update={"response_id": rid})
        it = self._responses.get(ev.response_id)
        if it is None:
            if self._s.active_response_id == ev.response_id:
                return  # issued, no audio yet
            if ev.response_id in self._issued:
                return
            raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"response {ev.response_id!r} was never issued by this session",
                                param="response_id", event_id=ev.event_id)
        # vLLM-Omni's clients name the assistant item "item_" + response_id (their server's convention)
        if ev.item_id is not None and ev.item_id != it.id and ev.item_id != "item_" + ev.response_id:
            if ev.item_id not in self._used_ids:
                raise ProtocolError(ErrorCode.ITEM_NOT_FOUND, f"item {ev.item_id!r} was never issued by this session",
                                    param="item_id", event_id=ev.event_id)
            return
        if it.final:
            return  # finalised by an earlier truncate: acks change nothing
        heard = min(ev.played_ms, it.sent_ms)
        if ev.truncate:
            # the client's final word on what was heard: it may cut back below what an earlier ack
            # or commit_on_done's response.done committed (docs/protocol.md §7.5)
            it.committed_ms = heard
            it.final = True
        else:
            it.committed_ms = max(it.committed_ms, heard)
