"""The client half of a duplex conversation as a sans-I/O state machine.

:class:`ClientState` is to the clients what :class:`duplexkit.session.Session` is to the server
(and what ``websockets.protocol.Protocol`` is to its asyncio and sync shells): typed server events
go in (:func:`duplexkit.protocol.parse_server_event` models, GA or beta names), *actions* come out,
and it does no I/O: no sockets, no asyncio, no threads, no clock. Both asyncio clients
(:class:`~duplexkit.clients.InlineDuplexClient`, :class:`~duplexkit.clients.DuplexClient`) are thin
shells that feed it and carry out its actions.

It owns:

* **one correlation map** from the ``event_id`` of each client request to the reply type it waits
  for (``session.update`` -> ``session.updated``, ``response.create`` -> a client-triggered
  ``response.created``, ``input_audio_buffer.commit`` -> ``.committed`` that is not the server
  VAD's own, ...). Replies that echo no ``event_id`` resolve the oldest request waiting for that type
  (the server answers in order); an ``error`` echoing an ``event_id`` rejects exactly that request;
  cancel races (``response_not_active`` for our own ``response.cancel``) are swallowed
  (docs/protocol.md §7.3);
* **responses** (:class:`ResponseRecord`): identity, text, transcript, audio, status, and two
  separate truths: ``generating`` (the server is still producing it) and ``audible`` (the player
  still holds unplayed audio of it). Client state follows playback, not generation:
  :attr:`ClientState.speaking` is true while audio of any response is audible;
* **playback truth** (docs/protocol.md §7.5) through a :class:`~duplexkit.audio.Player`, a
  sans-I/O object itself (queues and counters; a speaker thread or a virtual clock reads it):

  ===========================================  ====================================================
  what happens                                 what the state does
  ===========================================  ====================================================
  audio delta of a response not flushed        ``player.enqueue``
  ``response.done`` ``cancelled`` (any         flush that response's unplayed audio at once and send
  reason), ``output_audio_buffer.cleared``      ``playback.ack{played_ms, truncate:true}``
  with its id, server-VAD ``speech_started``
  while audible and ``interrupt_response``
  on, :meth:`barge_in` / local VAD speech
  response done and its audio all played       ``playback.ack{played_ms = all of it, truncate:true}``
  (``on_drained``, or already drained at done)  *then* (not at ``response.done``)
  ===========================================  ====================================================

  :meth:`barge_in` works on whatever is audible, including the tail of a response the server
  already finished (``response.cancel`` is only sent while it is generating);
* the **input format** of the session (:attr:`ClientState.input_format`, from the last
  ``session.created``/``session.updated``), which the shells encode and resample for;
* the **resume handshake** (docs/protocol.md §1.6) of a transport that can reconnect: the token,
  the frames sent (to re-send what a dropped connection lost), and every decision after a drop:

  ===========================================  ====================================================
  the shell reports                            the state decides
  ===========================================  ====================================================
  :meth:`connection_ended` (the socket closed)  after ``session.closed``: the session ended cleanly;
                                               a handshake refusal before ``session.created``: fail
                                               with it; resumable (``resume_enabled``, the server
                                               advertises it, the session is open): deliver
                                               ``client.reconnecting`` and :class:`Reconnect`;
                                               else fail with ``connection_lost``
  :meth:`reconnect_failed` (no connection, or   the next :class:`Reconnect` (0.2 s doubling to 5 s
  no answer, or the new one dropped)           between attempts) until ``resume_attempts``, then
                                               fail with ``connection_lost``
  :meth:`resume_answer` (the first frame the   ``session.resumed``: take its rotated token and
  server sent on the new connection)           answer :class:`ResumeAccepted` with the frames after
                                               its ``client_frames_received``; an ``error``: the
                                               resume was refused, fail with its code; anything
                                               else (vLLM-Omni replays at once): deliver
                                               ``client.resumed`` and accept with that event
  ===========================================  ====================================================

Server events are dispatched through one explicit table, :data:`HANDLERS` (event type -> method);
types not in it are only delivered.

Actions (all frozen dataclasses, :mod:`duplexkit.clients.actions`): :class:`Send`, :class:`Resolve`,
:class:`Reject`, :class:`ResponseStarted`, :class:`ResponseAudio`, :class:`ResponseEnded`,
:class:`PlaybackFlushed`, :class:`PlaybackHeard`, :class:`Deliver`, :class:`SessionEnded`, and the
transport directives :class:`Reconnect`, :class:`ResumeAccepted`.
"""

from __future__ import annotations

import base64
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

import numpy as np

from duplexkit.errors import DuplexConnectionError, DuplexError, ErrorCode, canonical_error_code
from duplexkit.protocol import UnknownServerEvent, parse_server_event
from duplexkit.protocol.vocabulary import ENCODINGS, FORMAT_TYPE_ENCODINGS, default_rate

from .actions import (Action, Deliver, PlaybackFlushed, PlaybackHeard, Reconnect, Reconnecting, Reject, Resolve,
                      ResponseAudio, ResponseEnded, ResponseStarted, Resumed, ResumeAccepted, SessionEnded, Send)
from .records import OUTPUT_RATE, ResponseRecord  # re-exported (ResponseRecord lives in records.py)

if TYPE_CHECKING:  # duplexkit.audio is imported when first used (it loads soxr, soundfile, webrtcvad)
    from duplexkit.audio.playback import Player

__all__ = [
    "ClientState", "ResponseRecord", "Action", "Send", "Resolve", "Reject", "ResponseStarted", "ResponseAudio",
    "ResponseEnded", "PlaybackFlushed", "PlaybackHeard", "Deliver", "SessionEnded", "Reconnecting", "Resumed",
    "Reconnect", "ResumeAccepted", "REPLY_TYPES", "HANDLERS", "require_player", "response_id_of", "OUTPUT_RATE",
    "OUTBOX_FRAMES",
]

REPLY_TYPES: dict[str, tuple[str, ...]] = {
    "session.update": ("session.updated", "session.created"),
    "response.create": ("response.created",),
    "input_audio_buffer.commit": ("input_audio_buffer.committed",),
    "input_audio_buffer.clear": ("input_audio_buffer.cleared",),
    "output_audio_buffer.clear": ("output_audio_buffer.cleared",),
    "conversation.item.truncate": ("conversation.item.truncated",),
    "conversation.item.create": ("conversation.item.added",),
    "conversation.item.retrieve": ("conversation.item.retrieved",),
    "conversation.item.delete": ("conversation.item.deleted",),
    "session.heartbeat": ("session.heartbeat_ack",),
}
"""Client event type -> the server event types that answer it (first match resolves)."""

QUIET_ERRORS = frozenset({ErrorCode.RESPONSE_NOT_ACTIVE.value})
"""Error codes (duplexkit's names) swallowed for this client's own ``response.cancel``
(docs/protocol.md §7.3 races). Wire codes are compared through
:func:`duplexkit.errors.canonical_error_code`, so the compat profile's OpenAI code
(``response_cancel_not_active``) is swallowed too."""

MAX_KEPT_RESPONSES = 256
"""Finished responses kept for lookup; older finished ones are forgotten (player bookkeeping too)."""

OUTBOX_FRAMES = 1024
"""Client frames kept for re-sending after a resume (docs/protocol.md §1.6); older ones are lost
with a dropped connection if the server had not processed them."""

RESUME_FIRST_DELAY_S = 0.2
RESUME_MAX_DELAY_S = 5.0
"""Delay before the second reconnect attempt, doubled before each later one up to the maximum
(the first attempt starts at once; docs/clients.md, "Resume")."""

HANDSHAKE_CODES = frozenset({ErrorCode.UNAUTHORIZED, ErrorCode.SESSION_CAPACITY_EXHAUSTED,
                             ErrorCode.MODEL_NOT_FOUND})
"""Codes of an ``error`` before ``session.created`` that refuse the connection itself (the server
closes next); with :data:`HANDSHAKE_PARAMS` the failure names them instead of ``connection_lost``."""

HANDSHAKE_PARAMS = frozenset({"model", "dialect", "record"})
"""Query parameters whose bad value (``bad_event``/``invalid_value`` with that ``param`` and no
``event_id``, before ``session.created``) refuses the connection."""

_QUIET_KEEP = 256


# ------------------------------------------------------------------------------------------------
# the machine
# ------------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    replies: tuple[str, ...]
    quiet: bool = False


@dataclass
class ClientState:
    """The sans-I/O client state (see the module docstring).

    Args:
        player: a :class:`~duplexkit.audio.Player` (required: playback truth needs a playback clock;
            the shells give a :class:`~duplexkit.audio.VirtualPlayer` when the user gives none).
        auto_ack: report playback to the server (``playback.ack``) as described above; False leaves
            acknowledging to the application (flushes still happen).
        new_record: factory of response records (the asyncio shells pass their ``ResponseHandle``).
        new_event_id: factory of client ``event_id`` strings.
        resume_enabled: resume the session after a dropped connection when the server advertises
            ``capabilities.supports_session_resume`` (the WebSocket client's ``resume``; an
            in-process transport never drops).
        resume_attempts: reconnect attempts per drop before giving up.

    Raises:
        TypeError: ``player`` is not a :class:`~duplexkit.audio.Player` (the message names what it lacks).
    """

    player: Player
    auto_ack: bool = True
    new_record: Callable[[Any], ResponseRecord] = ResponseRecord
    new_event_id: Callable[[], str] = field(default=None)  # type: ignore[assignment]
    resume_enabled: bool = False
    resume_attempts: int = 5
    session: Any = None
    session_id: Optional[str] = None
    epoch: int = 0
    opened: bool = False
    closed: bool = False
    close_reason: Optional[str] = None
    last_server_event_seq: int = 0
    barge_ins: int = 0
    resumes: int = 0
    reconnecting: bool = False
    resume_token: Optional[str] = None
    resume_failures: int = 0
    frames_sent: int = 0
    handshake_error: Optional[dict] = None

    def __post_init__(self) -> None:
        require_player(self.player)
        if self.new_event_id is None:
            self.new_event_id = new_event_id
        self._pending: "OrderedDict[str, _Pending]" = OrderedDict()
        self._quiet_done: deque = deque(maxlen=_QUIET_KEEP)
        self.responses: "OrderedDict[str, ResponseRecord]" = OrderedDict()
        self._items_added: set[str] = set()
        self._vad_items: set[str] = set()
        self._out: list = []
        self._outbox: "deque[tuple[int, str]]" = deque(maxlen=OUTBOX_FRAMES)  # (frame number, frame)
        self._attempt = 0  # reconnect attempts made since the last drop
        self._drop: tuple[Optional[int], str] = (None, "")  # close code and detail of the last drop

    # -------------------------------------------------------------- inputs: the application
    def request(self, event: dict, *, quiet: bool = False) -> Send:
        """Register an outgoing client event in the correlation map and return its :class:`Send`.

        An ``event_id`` is added when missing. Events with a reply type (:data:`REPLY_TYPES`)
        later produce exactly one :class:`Resolve` or :class:`Reject` for that id; ``quiet``
        (``response.cancel``) swallows the cancel-race errors of :data:`QUIET_ERRORS`.
        Raises :class:`~duplexkit.errors.DuplexConnectionError` once the session is over.
        """
        if self.closed:
            raise DuplexConnectionError("the session is closed: the server ended it"
                                        + (f" ({self.close_reason})" if self.close_reason else ""),
                                        code="connection_lost")
        ev = dict(event)
        eid = ev.setdefault("event_id", self.new_event_id())
        replies = REPLY_TYPES.get(str(ev.get("type")), ())
        if replies or quiet:
            self._pending[eid] = _Pending(replies, quiet)
        return Send(ev)

    def ack(self, response_id: str, played_ms: int, *, item_id: Optional[str] = None,
            truncate: bool = False) -> Send:
        """A ``playback.ack`` for ``response_id`` (cumulative ``played_ms``), recorded on its record.
        Raises ValueError for a negative ``played_ms``."""
        played_ms = int(played_ms)
        if played_ms < 0:
            raise ValueError(f"played_ms must be >= 0, got {played_ms}")
        ev: dict[str, Any] = {"type": "playback.ack", "response_id": response_id, "played_ms": played_ms}
        rec = self.responses.get(response_id)
        item_id = item_id or (rec.item_id if rec is not None else None)
        if item_id:
            ev["item_id"] = item_id
        if truncate:
            ev["truncate"] = True
        if rec is not None:
            rec.acked_ms = max(rec.acked_ms, played_ms)
            if truncate:
                rec.heard_final = True
        return self.request(ev)

    def barge_in(self, reason: str = "barge_in") -> tuple[Optional[ResponseRecord], list]:
        """Interrupt what the user hears now: the newest response that is generating or audible.

        Sends ``response.cancel`` when it is still generating, flushes its unplayed audio (and any
        older audible audio) and reports ``playback.ack{played_ms, truncate:true}``. Returns
        ``(record or None, actions)``.
        """
        target = None
        for rec in reversed(self.responses.values()):
            if (rec.generating or rec.audible) and not rec.heard_final:
                target = rec
                break
        if target is None:
            return None, self._take()
        self.barge_ins += 1
        if target.generating and not self.closed:  # a closed session: stop the audio, send nothing
            self._out.append(self.request({"type": "response.cancel", "response_id": target.id}, quiet=True))
        for rec in list(self.responses.values()):
            if rec is target or (rec.audible and not rec.heard_final):
                self._flush(rec, reason)
        return target, self._take()

    def local_speech_started(self) -> tuple[Optional[ResponseRecord], list]:
        """The client's own VAD heard the user start speaking: barge in if anything is audible or
        generating (see :meth:`barge_in`)."""
        return self.barge_in("barge_in")

    # -------------------------------------------------------------- inputs: the player
    def playback_drained(self, response_id: str) -> list:
        """The player played the last queued sample of ``response_id``. When the response is done
        generating (and was not flushed), it was fully heard: report it now."""
        rec = self.responses.get(response_id)
        if rec is not None and not rec.generating:
            self._heard(rec)
        return self._take()

    # -------------------------------------------------------------- inputs: the server
    def receive(self, event: Union[dict, Any]) -> list:
        """Handle one server event (a dict or a parsed model). Returns the actions. Never raises
        for a well-formed or malformed event (unknown events are delivered as they are).

        The event's handler comes from :data:`HANDLERS`; a type without one, or a body that did not
        validate (:class:`~duplexkit.protocol.UnknownServerEvent`, except the session events,
        which other servers send partial), is only delivered."""
        ev = parse_server_event(event) if isinstance(event, dict) else event
        t = ev.type
        if t == "conversation.item.added":
            iid = getattr(getattr(ev, "item", None), "id", None)
            if iid and iid in self._items_added:
                return []  # created + added of one item (beta and GA names, §2.1): the second is dropped
            if iid:
                self._items_added.add(iid)
        seq = getattr(ev, "server_event_seq", None)
        if isinstance(seq, int):
            if self.resumes and seq <= self.last_server_event_seq:
                return []  # replayed after a resume and already seen (docs/protocol.md §1.6)
            self.last_server_event_seq = max(self.last_server_event_seq, seq)
        ep = _epoch_of(ev)
        if ep is not None and ep > self.epoch:
            self.epoch = ep
        if t == "error" and not self.opened:
            self._note_handshake_refusal(ev)
        handler = HANDLERS.get(t)
        if isinstance(ev, UnknownServerEvent) and t not in _LENIENT_TYPES:
            handler = None  # a body that did not validate: delivered as it is, nothing else
        rec = self._record_of(ev)
        deliver = True
        if handler is not None:
            deliver = handler(self, ev, rec) is not False
            if t == "response.created":
                rec = self.responses.get(getattr(ev.response, "id", None) or "")
        if rec is not None:
            rec.events.append(ev.model_copy(update={"delta": f"<{rec.chunk_sizes[-1]} samples>"})
                              if t == "response.output_audio.delta" and rec.chunk_sizes else ev)
        self._resolve_reply(ev)
        if deliver:
            self._out.append(Deliver(ev))
        if t == "session.closed":
            self._end(None)
        return self._take()

    # -------------------------------------------------------------- inputs: the transport (resume, §1.6)
    def frame_sent(self, frame: str) -> None:
        """The shell wrote ``frame`` (one client frame, as sent) to the transport: counted and kept
        (the last :data:`OUTBOX_FRAMES`) for re-sending after a resume."""
        self.frames_sent += 1
        self._outbox.append((self.frames_sent, frame))

    @property
    def supports_resume(self) -> bool:
        """The server advertises ``capabilities.supports_session_resume`` (docs/protocol.md §1.6)."""
        caps = (self.session or {}).get("capabilities") or {}
        return bool(caps.get("supports_session_resume"))

    @property
    def resumable(self) -> bool:
        """A drop now would be resumed: resume is enabled, the server offers it, and the session
        is open (``session.created`` arrived; no ``session.closed``)."""
        return (self.resume_enabled and self.opened and self.supports_resume and not self.closed
                and self.close_reason is None)

    def connection_ended(self, close_code: Optional[int], detail: str = "") -> list:
        """The transport closed (``close_code``: the WebSocket close code, None when unknown;
        ``detail``: what the transport said). Returns the session-ending actions, or, when the
        session is :attr:`resumable`, a ``client.reconnecting`` notice and a :class:`Reconnect`
        (nothing fails meanwhile). See the module docstring's table."""
        self._drop = (close_code, detail)
        if self.closed or self.close_reason is not None:
            return self.close()
        if self.handshake_error is not None:
            err = self.handshake_error.get("error") or {}
            return self.connection_lost(DuplexConnectionError(
                str(err.get("message") or "handshake rejected"), code=str(err.get("code")),
                close_code=close_code, event=self.handshake_error))
        if not self.resumable:
            return self.connection_lost(self._lost_error())
        self._attempt = 0
        return self.transport_interrupted(close_code) + self._reconnect_or_fail()

    def reconnect_failed(self) -> list:
        """The last :class:`Reconnect` got no answer (the connection could not be opened, the send
        failed, no reply came in time, or the new connection dropped before it was the session's).
        Returns the next :class:`Reconnect`, or the session-ending actions after
        ``resume_attempts`` attempts. Nothing when no resume is under way."""
        return self._reconnect_or_fail() if self.reconnecting else []

    def resume_answer(self, reply: Any) -> list:
        """The first frame the server sent on the new connection (its decoded JSON value), after
        our ``session.resume``. Returns :class:`ResumeAccepted`, or the session-ending actions of
        a refusal (the error's code; ``resume_failures`` counts them). See the module docstring.
        Nothing when no resume is under way."""
        if not self.reconnecting:
            return []
        if not isinstance(reply, dict) or reply.get("type") not in ("session.resumed", "error"):
            # a server that replays without session.resumed (vLLM-Omni): its first replayed event is
            # the answer
            return self.resume_accepted() + [ResumeAccepted(event=reply if isinstance(reply, dict) else None)]
        if reply["type"] == "error":
            self.resume_failures += 1
            self.reconnecting = False
            err = reply.get("error") if isinstance(reply.get("error"), dict) else {}
            return self.connection_lost(DuplexConnectionError(
                f"the server refused to resume the session: {err.get('message') or reply}",
                code=str(err.get("code") or "resume_refused"), close_code=self._drop[0], event=reply))
        token = reply.get("resume_token")
        if isinstance(token, str):
            self.resume_token = token  # rotated: the old one no longer works (§1.6)
        frames, lost = self._frames_after(reply.get("client_frames_received"))
        self._out.append(ResumeAccepted(frames=frames, event=reply, lost=lost))
        return self._take()

    def transport_interrupted(self, close_code: Optional[int]) -> list:
        """The transport dropped and the shell is reconnecting to resume (docs/protocol.md §1.6):
        nothing is failed; a :class:`Reconnecting` notice is delivered to ``events()``.
        (:meth:`connection_ended` calls it when it decides to resume.)"""
        self.reconnecting = True
        self._out.append(Deliver(Reconnecting(close_code=close_code, last_server_event_seq=self.last_server_event_seq)))
        return self._take()

    def resume_accepted(self) -> list:
        """A server without ``session.resumed`` took the resume (its replay started): count it and
        deliver a :class:`Resumed` notice. (With ``session.resumed``, :meth:`receive` does this;
        :meth:`resume_answer` calls it.)"""
        self.resumes += 1
        self.reconnecting = False
        self._out.append(Deliver(Resumed(last_server_event_seq=self.last_server_event_seq)))
        return self._take()

    def _reconnect_or_fail(self) -> list:
        if self._attempt >= self.resume_attempts:
            self.reconnecting = False
            return self.connection_lost(self._lost_error())
        delay = 0.0 if self._attempt == 0 else min(RESUME_FIRST_DELAY_S * 2 ** (self._attempt - 1),
                                                     RESUME_MAX_DELAY_S)
        self._attempt += 1
        self._out.append(Reconnect(self._attempt, delay, {
            "type": "session.resume", "event_id": self.new_event_id(), "session_id": self.session_id,
            "resume_token": self.resume_token, "last_server_event_seq": self.last_server_event_seq}))
        return self._take()

    def _lost_error(self) -> DuplexConnectionError:
        close_code, detail = self._drop
        return DuplexConnectionError(f"connection lost (close code {close_code}){': ' + detail if detail else ''}",
                                     code="connection_lost", close_code=close_code)

    def _frames_after(self, received: Any) -> tuple[tuple[str, ...], Optional[tuple[int, int]]]:
        """The kept frames after the ``received``-th, and the numbers of the frames after it that
        are no longer kept (None when none are)."""
        if not isinstance(received, int) or isinstance(received, bool) or received >= self.frames_sent:
            return (), None
        oldest = self._outbox[0][0] if self._outbox else self.frames_sent + 1
        lost = (received + 1, oldest - 1) if received + 1 < oldest else None
        return tuple(f for n, f in self._outbox if n > received), lost

    def _note_handshake_refusal(self, ev: Any) -> None:
        """An ``error`` before ``session.created``: remember it when it refuses the connection
        itself (:data:`HANDSHAKE_CODES`, or a bad query parameter :data:`HANDSHAKE_PARAMS`)."""
        data = ev.raw if isinstance(ev, UnknownServerEvent) else ev.model_dump(mode="json", exclude_unset=True)
        err = data.get("error") if isinstance(data.get("error"), dict) else {}
        code = canonical_error_code(str(err.get("code")))  # the compat profile's OpenAI names too
        if code in HANDSHAKE_CODES or (code in (ErrorCode.BAD_EVENT, "invalid_value")
                                       and err.get("param") in HANDSHAKE_PARAMS and not err.get("event_id")):
            self.handshake_error = data

    def close(self) -> list:
        """The client ended the session itself (after ``session.close``, or releasing the
        transport): requests still waiting are rejected, generating responses end, no error."""
        self._end(None)
        return self._take()

    def connection_lost(self, error: BaseException) -> list:
        """The transport died: every waiting request is rejected, generating responses end with
        ``error``, and the session ends."""
        self._end(error)
        return self._take()

    # -------------------------------------------------------------- queries
    @property
    def speaking(self) -> bool:
        """True while audio of any response is audible (queued in the player, not flushed)."""
        return any(r.audible for r in self.responses.values())

    @property
    def active_response(self) -> Optional[ResponseRecord]:
        """The newest response still generating (None when none is)."""
        for rec in reversed(self.responses.values()):
            if rec.generating:
                return rec
        return None

    @property
    def pending_requests(self) -> list[str]:
        """``event_id`` of every request still waiting for its reply, oldest first."""
        return [eid for eid, p in self._pending.items() if p.replies]

    @property
    def input_format(self):
        """The session's input format (:class:`~duplexkit.audio.InputFormat`) from the last
        ``session.created``/``session.updated``; None before the first."""
        return _input_format_of(self.session)

    @property
    def interrupt_on_speech(self) -> bool:
        """True when the session's server VAD interrupts responses on speech (the default when
        turn detection is on)."""
        s = self.session or {}
        td = ((s.get("audio") or {}).get("input") or {}).get("turn_detection", s.get("turn_detection"))
        return isinstance(td, dict) and td.get("interrupt_response") is not False

    # -------------------------------------------------------------- handlers (HANDLERS; return False: not delivered)
    def _on_session_created(self, ev, rec) -> None:
        self._on_session_updated(ev, rec)
        token = _top_level(ev, "resume_token")
        if isinstance(token, str):
            self.resume_token = token

    def _on_session_updated(self, ev, rec) -> None:
        self.session = _session_dict(ev)
        self.session_id = self.session.get("id") or self.session_id
        self.opened = True

    def _on_session_resumed(self, ev, rec) -> None:
        self.resumes += 1
        self.reconnecting = False
        token = _top_level(ev, "resume_token")
        if isinstance(token, str):
            self.resume_token = token  # rotated by each session.resumed (docs/protocol.md §1.6)

    def _on_session_closed(self, ev, rec) -> None:
        self.close_reason = ev.reason

    def _on_error(self, ev, rec) -> Optional[bool]:
        err = ev.error
        eid = err.event_id
        quiet_code = canonical_error_code(err.code or "") in QUIET_ERRORS
        p = self._pending.get(eid) if eid else None
        if p is None:
            if eid and eid in self._quiet_done and quiet_code:
                return False
            return None
        del self._pending[eid]
        if p.quiet:
            self._quiet_done.append(eid)
            if quiet_code:
                return False  # a cancel race (§7.3): nothing to report
            return None
        self._out.append(Reject(eid, DuplexError.from_event(ev.model_dump(mode="json"))))
        return None

    def _on_conversation_item_added(self, ev, rec) -> None:
        item = ev.item
        if rec is not None and item.role == "assistant" and rec.item_id is None:
            rec.item_id = item.id

    def _on_response_created(self, ev, rec) -> None:
        rec = self.new_record(ev)
        rec._player = self.player
        self.responses[rec.id] = rec
        self._forget_old()
        self._out.append(ResponseStarted(rec))
        if rec.trigger in (None, "client"):
            self._resolve_first(("response.created",), rec)

    def _on_response_output_item_added(self, ev, rec) -> None:
        if rec is not None:
            rec.item_id = rec.item_id or ev.item.id

    def _on_response_output_audio_delta(self, ev, rec) -> None:
        if rec is None or not rec.generating:
            return
        pcm = _decode_pcm16(ev.delta)
        rec.item_id = rec.item_id or ev.item_id
        rec.audio_samples += len(pcm)
        rec.chunk_sizes.append(len(pcm))
        if not rec.flushed:
            self.player.enqueue(rec.id, pcm)
        self._out.append(ResponseAudio(rec, pcm))

    def _on_response_output_audio_transcript_delta(self, ev, rec) -> None:
        if rec is not None and rec.generating:
            rec.transcript += ev.delta

    def _on_response_output_audio_transcript_done(self, ev, rec) -> None:
        if rec is not None:
            rec.transcript = ev.transcript

    def _on_response_output_text_delta(self, ev, rec) -> None:
        if rec is not None and rec.generating:
            rec.text += ev.delta

    def _on_response_output_text_done(self, ev, rec) -> None:
        if rec is not None:
            rec.text = ev.text

    def _on_response_listen(self, ev, rec) -> None:
        if rec is not None:
            rec.decision = "listen"

    def _on_response_done(self, ev, rec) -> None:
        if rec is None or not rec.generating:
            return
        r = ev.response
        rec.final = ev
        rec.status = r.status or "completed"
        sd = r.status_details
        rec.status_details = sd.model_dump(mode="json", exclude_none=True) if sd is not None else None
        rec.item_id = rec.item_id or next((it.id for it in (r.output or []) if it.id), None)
        self._out.append(ResponseEnded(rec))
        if rec.status == "cancelled":
            self._flush(rec, "cancelled")
        elif self.player.queued_samples(rec.id) == 0:
            self._heard(rec)  # everything received has already played

    def _on_output_audio_buffer_cleared(self, ev, rec) -> None:
        if rec is not None:
            self._flush(rec, "cleared")

    def _on_input_audio_buffer_speech_started(self, ev, rec) -> None:
        # not yet a VAD item: a client commit while the user is still speaking commits this item
        # id (the server keeps the turn's id) and is our reply; the VAD commits only after
        # speech_stopped (docs/protocol.md §5)
        if self.interrupt_on_speech:
            for r in list(self.responses.values()):
                if r.audible and not r.heard_final:
                    self._flush(r, "speech_started")

    def _on_input_audio_buffer_speech_stopped(self, ev, rec) -> None:
        if ev.item_id:
            self._vad_items.add(ev.item_id)

    # -------------------------------------------------------------- internals
    def _record_of(self, ev) -> Optional[ResponseRecord]:
        rid = getattr(ev, "response_id", None)
        if rid is None:
            r = getattr(ev, "response", None)
            rid = getattr(r, "id", None) if r is not None else None
        if rid:
            return self.responses.get(rid)
        if ev.type in ("conversation.item.added", "conversation.item.done"):
            item = ev.item
            if item.role == "assistant":
                for rec in reversed(self.responses.values()):
                    if rec.item_id == item.id:
                        return rec
                act = self.active_response
                if ev.type == "conversation.item.added" and act is not None and act.item_id is None:
                    return act
        return None

    def _resolve_reply(self, ev) -> None:
        t = ev.type
        if t == "response.created":
            return  # resolved with its record in _on_response_created
        if t == "input_audio_buffer.committed" and getattr(ev, "item_id", None) in self._vad_items:
            return  # the server VAD's automatic commit, not our reply
        value = self.session if t in ("session.created", "session.updated") else ev
        self._resolve_first((t,), value)

    def _resolve_first(self, types: tuple[str, ...], value: Any) -> None:
        for eid, p in self._pending.items():
            if any(t in p.replies for t in types):
                del self._pending[eid]
                self._out.append(Resolve(eid, value))
                return

    def _flush(self, rec: ResponseRecord, reason: str) -> None:
        """Drop the unplayed audio of ``rec`` now and report where playback stopped (final)."""
        if rec.flushed:
            return
        dropped = self.player.flush(rec.id)
        rec.flushed = True
        played = rec.played_ms
        self._out.append(PlaybackFlushed(rec.id, played, dropped, reason))
        if self.auto_ack and not rec.heard_final and rec.audio_samples and not self.closed:
            self._out.append(self.ack(rec.id, played, truncate=True))
        rec.heard_final = True

    def _heard(self, rec: ResponseRecord) -> None:
        """``rec`` is done and every sample of it has played: report it fully heard, now."""
        if rec.heard_final or rec.flushed or not rec.audio_samples:
            return
        played = rec.played_ms
        rec.heard_final = True
        self._out.append(PlaybackHeard(rec.id, played))
        if self.auto_ack and not self.closed:
            self._out.append(self.ack(rec.id, played, truncate=True))  # final: it has all played

    def _end(self, error: Optional[BaseException]) -> None:
        if self.closed and not self._pending and not any(r.generating for r in self.responses.values()):
            return
        self.closed = True
        exc = error or DuplexConnectionError("the session closed", code="session_closed")
        for eid, p in list(self._pending.items()):
            if p.replies:
                self._out.append(Reject(eid, exc))
        self._pending.clear()
        for rec in self.responses.values():
            if rec.generating:
                self._out.append(ResponseEnded(rec, error or DuplexConnectionError(
                    f"the session closed before response {rec.id} ended", code="session_closed")))
        self._out.append(SessionEnded(self.close_reason, error))

    def _forget_old(self) -> None:
        if len(self.responses) <= MAX_KEPT_RESPONSES:
            return
        old = [k for k, r in self.responses.items() if not r.generating and not r.audible]
        for k in old[: len(self.responses) - MAX_KEPT_RESPONSES // 2]:
            del self.responses[k]
            from duplexkit.audio.playback import ForgettingPlayer

            if isinstance(self.player, ForgettingPlayer):
                self.player.forget(k)

    def _take(self) -> list:
        out, self._out = self._out, []
        return out


Handler = Callable[[ClientState, Any, Optional[ResponseRecord]], Optional[bool]]

HANDLERS: dict[str, Handler] = {
    "session.created": ClientState._on_session_created,
    "session.updated": ClientState._on_session_updated,
    "session.resumed": ClientState._on_session_resumed,
    "session.closed": ClientState._on_session_closed,
    "error": ClientState._on_error,
    "conversation.item.added": ClientState._on_conversation_item_added,
    "response.created": ClientState._on_response_created,
    "response.output_item.added": ClientState._on_response_output_item_added,
    "response.output_audio.delta": ClientState._on_response_output_audio_delta,
    "response.output_audio_transcript.delta": ClientState._on_response_output_audio_transcript_delta,
    "response.output_audio_transcript.done": ClientState._on_response_output_audio_transcript_done,
    "response.output_text.delta": ClientState._on_response_output_text_delta,
    "response.output_text.done": ClientState._on_response_output_text_done,
    "response.listen": ClientState._on_response_listen,
    "response.done": ClientState._on_response_done,
    "output_audio_buffer.cleared": ClientState._on_output_audio_buffer_cleared,
    "input_audio_buffer.speech_started": ClientState._on_input_audio_buffer_speech_started,
    "input_audio_buffer.speech_stopped": ClientState._on_input_audio_buffer_speech_stopped,
}
"""Server event type (GA name; :func:`~duplexkit.protocol.parse_server_event` maps beta names) ->
the :class:`ClientState` method that handles it, called as ``handler(state, event, record)``
(``record``: the response the event belongs to, or None). A handler returning False keeps the
event from ``events()``. Types not listed are only delivered."""

_LENIENT_TYPES = frozenset({"session.created", "session.updated", "session.resumed"})
"""Types whose handler also runs for a body that did not validate (other servers send partial
sessions); their handlers read such a body through :func:`_session_dict` / :func:`_top_level`."""


def require_player(player: Any, *, rendering: bool = False) -> "Player":
    """``player`` when it is a :class:`~duplexkit.audio.Player` (a
    :class:`~duplexkit.audio.RenderingPlayer` too when ``rendering``: echo control needs
    ``on_render``). Raises TypeError naming what it lacks."""
    from duplexkit.audio.playback import Player, RenderingPlayer

    if not isinstance(player, Player):
        members = sorted((set(vars(Player)) | set(Player.__annotations__)) - set(vars(Protocol)))
        missing = [m for m in members if not m.startswith("_") and not hasattr(player, m)]
        raise TypeError(f"player must be a duplexkit.audio.Player; {type(player).__name__} has no "
                        + ", ".join(missing))
    if rendering and not isinstance(player, RenderingPlayer):
        raise TypeError(f"echo control needs a player with on_render(callback) (duplexkit.audio.RenderingPlayer): "
                        f"{type(player).__name__} has none; use echo='off' or a player that reports what it plays")
    return player


def response_id_of(ev: Any) -> Optional[str]:
    """The response a typed server event belongs to (``response_id`` or ``response.id``), or None."""
    rid = getattr(ev, "response_id", None)
    if rid is None:
        r = getattr(ev, "response", None)
        rid = getattr(r, "id", None) if r is not None else None
    return rid


def new_event_id() -> str:
    """A fresh client ``event_id``: ``cevt_`` + 16 hex digits."""
    return "cevt_" + secrets.token_hex(8)


def _epoch_of(ev) -> Optional[int]:
    for src in (ev, getattr(ev, "metadata", None), getattr(ev, "response", None), getattr(ev, "session", None)):
        v = getattr(src, "epoch", None) if src is not None else None
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


_ENCODING_OF_TYPE = FORMAT_TYPE_ENCODINGS


def _top_level(ev: Any, key: str) -> Any:
    """A top-level key of a server event beyond its model's fields (the extras a model keeps, or the
    raw body of one that did not validate); None when absent."""
    if isinstance(ev, UnknownServerEvent):
        return ev.raw.get(key)
    return getattr(ev, key, None)


def _session_dict(ev) -> dict:
    """The session object of a ``session.created``/``.updated`` as a JSON dict (also for a body
    that did not validate: other servers send partial sessions)."""
    if isinstance(ev, UnknownServerEvent):
        sess = ev.raw.get("session")
        return dict(sess) if isinstance(sess, dict) else {}
    return ev.session.model_dump(mode="json")


def _input_format_of(session: Optional[dict]):
    """The :class:`~duplexkit.audio.InputFormat` a session dict declares (None when unknown).

    Reads ``audio.input.format`` (``type``, ``rate``, the extra keys ``sample_rate_hz``,
    ``encoding``, ``channels``), then the flat beta mirrors ``input_audio_format`` and
    ``sample_rate_hz`` (docs/protocol.md §4.1, §6.1).
    """
    if not session:
        return None
    from duplexkit.audio import InputFormat

    fmt = ((session.get("audio") or {}).get("input") or {}).get("format")
    fmt = fmt if isinstance(fmt, dict) else {}
    enc = fmt.get("encoding") or _ENCODING_OF_TYPE.get(str(fmt.get("type")))
    if enc is None:
        flat = session.get("input_audio_format")
        enc = flat if flat in ENCODINGS else "pcm16"
    rate = fmt.get("sample_rate_hz") or fmt.get("rate") or session.get("sample_rate_hz")
    if not isinstance(rate, int) or isinstance(rate, bool):
        rate = default_rate(enc)
    channels = fmt.get("channels", 1)
    try:
        return InputFormat(enc, rate, channels if isinstance(channels, int) else 1)
    except Exception:  # a format this client cannot produce: declare nothing, send pcm16 16 kHz
        return None


def _decode_pcm16(b64: str) -> np.ndarray:
    from duplexkit.audio import pcm16_to_float32

    data = base64.b64decode(b64) if b64 else b""
    if len(data) % 2:
        data = data[:-1]
    return pcm16_to_float32(data)
