"""Telephony media-stream bridges: Twilio Media Streams and Telnyx media streaming (docs/telephony.md).

A phone provider opens a WebSocket to ``/v1/telephony/twilio`` or ``/v1/telephony/telnyx`` and speaks
its own JSON messages (``connected``, ``start``, ``media``, ``dtmf``, ``mark``, ``stop``; the server
sends ``media``, ``mark`` and ``clear``). This module is a transport adapter only: it drives the same
sans-I/O :class:`duplexkit.session.Session` with the same :class:`duplexkit.driver.SessionDriver`
as the realtime WebSocket (:mod:`duplexkit_server.realtime`), feeding it ordinary client events and
reading its ordinary server events. The session machine is not changed.

Two layers:

* :class:`ProviderAdapter` (:class:`TwilioAdapter`, :class:`TelnyxAdapter`): the provider's message
  shapes, in and out (field names: Twilio ``streamSid`` / ``start.customParameters`` /
  ``start.mediaFormat``; Telnyx ``stream_id`` / ``start.custom_parameters`` / ``start.media_format``).
* :class:`CallBridge`: the translation, sans-I/O (unit-tested without sockets). Provider messages
  -> client events (:meth:`CallBridge.provider_message`); session server events -> provider messages
  and client events (:meth:`CallBridge.server_event`). It keeps the playback truth of the call:

  - inbound ``media`` (8 kHz G.711, 20 ms per message) -> ``input_audio_buffer.append`` as is (the
    session's input format is ``g711_ulaw``, or ``g711_alaw`` for a Telnyx PCMA stream);
  - ``response.output_audio.delta`` (24 kHz PCM16, docs/protocol.md §6.2) -> resampled to 8 kHz
    (one soxr stream per response), G.711-encoded, sent as ``media`` pieces of at most
    ``mark_every_ms`` each followed by a ``mark`` whose name the bridge maps to
    ``(response_id, item_id, played_ms)``;
  - a ``mark`` the provider echoes (its audio has been played to the caller) -> ``playback.ack``
    (docs/protocol.md §7.5), the same playback truth a realtime client reports;
  - barge-in (``input_audio_buffer.speech_started`` while sent audio is not yet played, a cancelled
    ``response.done``, ``output_audio_buffer.cleared``) -> ``clear`` to the provider (it drops the
    audio it queued) and ``conversation.item.truncate`` of the assistant item at the last echoed
    mark (what the caller heard); echoes of marks the ``clear`` dropped are ignored;
  - ``dtmf`` -> a user text item ``"DTMF: <digit>"`` (``conversation.item.create``): the tool
    decider and the history read it; the duplex model does not hear text (docs/protocol.md §4.2).

Call settings: the base ``session.update`` sets the telephony formats, server VAD with
``create_response`` and ``interrupt_response`` on, then the per-call persona: ``instructions``
and ``voice`` (a name of the server's voice table, ``serve --voice NAME=WAV``) from the start
message's custom parameters (TwiML ``<Parameter>``), and whatever the ``--telephony-webhook``
answers (a second ``session.update``; refused or failed -> the defaults stay, one log line).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from duplexkit.audio.codecs import float32_to_alaw, float32_to_ulaw, pcm16_to_float32
from duplexkit.audio.resample import StreamResampler
from duplexkit.engine.api import OUTPUT_SAMPLE_RATE
from duplexkit.errors import DuplexkitError, ErrorCode
from duplexkit.protocol.vocabulary import CloseCode, CloseReason

logger = logging.getLogger("duplexkit.server.telephony")

__all__ = ["ProviderAdapter", "TwilioAdapter", "TelnyxAdapter", "ADAPTERS", "CallStart", "CallBridge",
           "TelephonyConnection", "handle", "fetch_webhook_settings", "TELEPHONY_RATE", "OUTPUT_RATE"]

#: The phone network's sample rate (G.711, ITU-T G.711), Hz.
TELEPHONY_RATE = 8000
#: The session's output rate (docs/protocol.md §6.2), Hz.
OUTPUT_RATE = OUTPUT_SAMPLE_RATE
#: Longest outbound ``media`` piece before a ``mark``, ms: the granularity of the playback truth.
DEFAULT_MARK_EVERY_MS = 200
#: Marks sent and not yet echoed that are remembered (an hour of answer audio at 200 ms a mark).
MAX_PENDING_MARKS = 18_000
#: Custom parameters the bridge reads (the rest are call metadata only).
PARAM_INSTRUCTIONS = "instructions"
PARAM_VOICE = "voice"
#: Longest custom-parameter value taken, characters (instructions are capped by the session at 16 384).
MAX_PARAM_CHARS = 16_384
#: Session fields the telephony bridge owns; a webhook answer cannot change them.
RESERVED_FIELDS = frozenset({"input_audio_format", "output_audio_format", "audio", "turn_detection", "type",
                             "output_modalities", "modalities"})


@dataclass
class CallStart:
    """The ``start`` message of a media stream, provider-neutral.

    Attributes:
        provider: ``"twilio"`` or ``"telnyx"``.
        stream_id: Twilio ``streamSid`` / Telnyx ``stream_id``; every outbound message names it.
        call_id: Twilio ``callSid`` / Telnyx ``call_control_id``.
        from_, to: the caller's and the called number when the provider sends them (Telnyx does;
            Twilio's start message does not: pass ``<Parameter name="from" value="{{From}}"/>``).
        custom_parameters: string -> string (TwiML ``<Parameter>``, Telnyx ``custom_parameters``).
        encoding: the session input format, ``"g711_ulaw"`` or ``"g711_alaw"`` (Telnyx PCMA).
        sample_rate: Hz (8000; anything else is refused by :meth:`ProviderAdapter.parse_start`).
    """

    provider: str
    stream_id: str
    call_id: Optional[str] = None
    from_: Optional[str] = None
    to: Optional[str] = None
    custom_parameters: dict = field(default_factory=dict)
    encoding: str = "g711_ulaw"
    sample_rate: int = TELEPHONY_RATE

    def metadata(self) -> dict:
        """The JSON object POSTed to ``--telephony-webhook`` (docs/telephony.md, "Webhook")."""
        return {"provider": self.provider, "stream_id": self.stream_id, "call_id": self.call_id,
                "from": self.from_, "to": self.to, "custom_parameters": dict(self.custom_parameters)}


class BadProviderMessage(DuplexkitError, ValueError):
    """A provider message the bridge cannot use (logged and skipped; the call goes on).
    Code ``bad_event`` (docs/protocol.md §9)."""

    default_code = ErrorCode.BAD_EVENT.value


def _str(v: Any) -> Optional[str]:
    return v[:MAX_PARAM_CHARS] if isinstance(v, str) else (str(v) if isinstance(v, (int, float)) else None)


class ProviderAdapter:
    """One provider's message shapes. Subclasses set :attr:`name` and :attr:`stream_key` and
    implement :meth:`parse_start`. Every provider message is a JSON object with a string ``event``."""

    name = "?"
    stream_key = "stream_id"

    def stream_id(self, msg: dict) -> Optional[str]:
        return _str(msg.get(self.stream_key))

    def parse_start(self, msg: dict) -> CallStart:  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def media_payload(msg: dict) -> Optional[str]:
        """The base64 payload of an inbound ``media`` message (None: another track, or no payload)."""
        media = msg.get("media")
        if not isinstance(media, dict):
            raise BadProviderMessage("media message without a media object")
        track = media.get("track")
        if track not in (None, "inbound", "inbound_track"):
            return None  # the bridge listens to the caller only
        payload = media.get("payload")
        if not isinstance(payload, str):
            raise BadProviderMessage("media message without a base64 payload")
        return payload

    @staticmethod
    def dtmf_digit(msg: dict) -> Optional[str]:
        d = msg.get("dtmf")
        digit = d.get("digit") if isinstance(d, dict) else None
        return digit if isinstance(digit, str) and len(digit) == 1 and digit in "0123456789*#ABCDabcd" else None

    @staticmethod
    def mark_name(msg: dict) -> Optional[str]:
        m = msg.get("mark")
        name = m.get("name") if isinstance(m, dict) else None
        return name if isinstance(name, str) else None

    # -- outbound ---------------------------------------------------------------------------------
    def out_media(self, stream_id: str, payload_b64: str) -> dict:
        return {"event": "media", self.stream_key: stream_id, "media": {"payload": payload_b64}}

    def out_mark(self, stream_id: str, name: str) -> dict:
        return {"event": "mark", self.stream_key: stream_id, "mark": {"name": name}}

    def out_clear(self, stream_id: str) -> dict:
        return {"event": "clear", self.stream_key: stream_id}


class TwilioAdapter(ProviderAdapter):
    """Twilio Media Streams (bidirectional, ``<Connect><Stream>``): ``streamSid``, mu-law 8 kHz only."""

    name = "twilio"
    stream_key = "streamSid"

    def parse_start(self, msg: dict) -> CallStart:
        start = msg.get("start")
        if not isinstance(start, dict):
            raise BadProviderMessage("start message without a start object")
        sid = _str(start.get("streamSid")) or self.stream_id(msg)
        if not sid:
            raise BadProviderMessage("start message without a streamSid")
        fmt = start.get("mediaFormat") or {}
        enc = fmt.get("encoding", "audio/x-mulaw") if isinstance(fmt, dict) else "audio/x-mulaw"
        rate = fmt.get("sampleRate", TELEPHONY_RATE) if isinstance(fmt, dict) else TELEPHONY_RATE
        if enc != "audio/x-mulaw" or int(rate) != TELEPHONY_RATE:
            raise BadProviderMessage(f"unsupported media format {enc!r} at {rate} Hz (audio/x-mulaw 8000 expected)")
        params = _params(start.get("customParameters"))
        return CallStart("twilio", sid, call_id=_str(start.get("callSid")),
                         from_=params.get("from") or params.get("From"), to=params.get("to") or params.get("To"),
                         custom_parameters=params)


class TelnyxAdapter(ProviderAdapter):
    """Telnyx media streaming (``stream_bidirectional_mode: rtp``): ``stream_id``, PCMU or PCMA 8 kHz."""

    name = "telnyx"
    stream_key = "stream_id"

    def parse_start(self, msg: dict) -> CallStart:
        start = msg.get("start")
        if not isinstance(start, dict):
            raise BadProviderMessage("start message without a start object")
        sid = self.stream_id(msg) or _str(start.get("stream_id"))
        if not sid:
            raise BadProviderMessage("start message without a stream_id")
        fmt = start.get("media_format") or {}
        enc = str(fmt.get("encoding", "PCMU")).upper() if isinstance(fmt, dict) else "PCMU"
        rate = fmt.get("sample_rate", TELEPHONY_RATE) if isinstance(fmt, dict) else TELEPHONY_RATE
        encoding = {"PCMU": "g711_ulaw", "PCMA": "g711_alaw"}.get(enc)
        if encoding is None or int(rate) != TELEPHONY_RATE:
            raise BadProviderMessage(f"unsupported media format {enc!r} at {rate} Hz (PCMU or PCMA 8000 expected; "
                                     "set stream_bidirectional_codec PCMU)")
        params = _params(start.get("custom_parameters"))
        return CallStart("telnyx", sid, call_id=_str(start.get("call_control_id")), from_=_str(start.get("from")),
                         to=_str(start.get("to")), custom_parameters=params, encoding=encoding)


ADAPTERS: dict[str, ProviderAdapter] = {"twilio": TwilioAdapter(), "telnyx": TelnyxAdapter()}


def _params(raw: Any) -> dict:
    if not isinstance(raw, dict):
        return {}
    out = {}
    for k, v in list(raw.items())[:64]:
        s = _str(v)
        if isinstance(k, str) and s is not None:
            out[k[:128]] = s
    return out


def _eid() -> str:
    return "event_" + secrets.token_hex(12)


@dataclass
class _Played:
    """Playback bookkeeping of one assistant response (ms at 8 kHz, counted from its first sample)."""

    response_id: str
    item_id: Optional[str]
    sent_samples: int = 0  # 8 kHz samples sent to the provider
    heard_ms: int = 0  # the last echoed mark
    cleared: bool = False
    resampler: Optional[StreamResampler] = None


class CallBridge:
    """Sans-I/O translation between one provider media stream and one session (module docstring).

    Args:
        adapter: the provider's :class:`ProviderAdapter`.
        mark_every_ms: longest outbound ``media`` piece before a ``mark``, ms (> 0).

    Each method returns ``(client_events, provider_messages)``: client events (dicts) for
    ``SessionDriver.client_event``, provider messages (dicts) to send as JSON text frames, in order.
    """

    def __init__(self, adapter: ProviderAdapter, *, mark_every_ms: int = DEFAULT_MARK_EVERY_MS) -> None:
        if mark_every_ms <= 0:
            raise ValueError("mark_every_ms must be > 0")
        self.adapter = adapter
        self.mark_every_ms = int(mark_every_ms)
        self.call: Optional[CallStart] = None
        self.stopped = False
        self._responses: dict[str, _Played] = {}
        self._marks: dict[str, tuple[str, int]] = {}  # mark name -> (response_id, played_ms)
        self._mark_seq = 0
        #: counters (docs/telephony.md): media in/out messages, marks sent/echoed, clears sent, DTMF digits
        self.stats = {"media_in": 0, "media_out": 0, "marks_sent": 0, "marks_played": 0, "clears": 0, "dtmf": 0}

    # -- provider -> session ----------------------------------------------------------------------
    def provider_message(self, msg: dict) -> tuple[list[dict], list[dict]]:
        """One provider message. ``start`` sets :attr:`call` (settings are the caller's job:
        :meth:`session_update`); ``stop`` sets :attr:`stopped`. Raises :class:`BadProviderMessage`."""
        if not isinstance(msg, dict) or not isinstance(msg.get("event"), str):
            raise BadProviderMessage("a provider message is a JSON object with a string event")
        ev = msg["event"]
        if ev == "media":
            if self.call is None:
                return [], []  # audio before start: nothing to route it to yet
            payload = self.adapter.media_payload(msg)
            if payload is None:
                return [], []
            self.stats["media_in"] += 1
            return [{"type": "input_audio_buffer.append", "audio": payload}], []
        if ev == "mark":
            name = self.adapter.mark_name(msg)
            hit = self._marks.pop(name, None) if name is not None else None
            if hit is None:
                return [], []  # a mark a clear dropped, or not ours
            rid, played_ms = hit
            resp = self._responses.get(rid)
            if resp is None or resp.cleared:
                return [], []
            resp.heard_ms = max(resp.heard_ms, played_ms)
            self.stats["marks_played"] += 1
            ack = {"type": "playback.ack", "response_id": rid, "played_ms": played_ms}
            if resp.item_id:
                ack["item_id"] = resp.item_id
            return [ack], []
        if ev == "dtmf":
            digit = self.adapter.dtmf_digit(msg)
            if digit is None:
                raise BadProviderMessage("dtmf message without a digit")
            self.stats["dtmf"] += 1
            return [{"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": f"DTMF: {digit}"}]}}], []
        if ev == "start":
            self.call = self.adapter.parse_start(msg)
            return [], []
        if ev == "stop":
            self.stopped = True
            return [], []
        return [], []  # connected, error (logged by the caller), and events added later

    # -- session -> provider ----------------------------------------------------------------------
    def server_event(self, event: dict) -> tuple[list[dict], list[dict]]:
        """One session server event (the dict ``SessionDriver`` hands to ``on_event``)."""
        t = event.get("type")
        if self.call is None:
            return [], []
        if t == "response.output_audio.delta":
            return [], self._audio(event)
        if t == "response.output_audio.done":
            resp = self._responses.get(event.get("response_id"))
            if resp is None or resp.cleared or resp.resampler is None:
                return [], []
            tail = resp.resampler.flush()
            return [], self._send_pcm(resp, tail)
        if t == "input_audio_buffer.speech_started":
            return self.barge_in()
        if t == "output_audio_buffer.cleared":
            rid = event.get("response_id")
            return self.barge_in(rid) if rid else ([], [])
        if t == "response.done":
            resp = event.get("response") or {}
            if resp.get("status") == "cancelled" and resp.get("id") in self._responses:
                return self.barge_in(resp.get("id"))
        return [], []

    def barge_in(self, response_id: Optional[str] = None) -> tuple[list[dict], list[dict]]:
        """The caller talks over the assistant: ``clear`` (when sent audio may still be queued at the
        provider) and truncate every such response's item at its last echoed mark."""
        targets = [r for r in self._responses.values() if not r.cleared and r.sent_samples
                   and (response_id is None or r.response_id == response_id)
                   and (r.response_id == response_id or self._unplayed(r))]
        if not targets:
            return [], []
        events = []
        for r in targets:
            r.cleared = True
            r.resampler = None
            if r.item_id:
                events.append({"type": "conversation.item.truncate", "item_id": r.item_id, "content_index": 0,
                               "audio_end_ms": r.heard_ms})
        self._marks = {n: v for n, v in self._marks.items() if v[0] not in {r.response_id for r in targets}}
        self.stats["clears"] += 1
        return events, [self.adapter.out_clear(self.call.stream_id)]

    def _unplayed(self, r: _Played) -> bool:
        return any(v[0] == r.response_id for v in self._marks.values())

    def _audio(self, event: dict) -> list[dict]:
        rid = event.get("response_id")
        if not isinstance(rid, str):
            return []
        resp = self._responses.get(rid)
        if resp is None:
            resp = self._responses[rid] = _Played(rid, event.get("item_id"),
                                                  resampler=StreamResampler(OUTPUT_RATE, TELEPHONY_RATE))
            self._forget_old()
        if resp.cleared or resp.resampler is None:
            return []
        try:
            pcm = base64.b64decode(event.get("delta") or "", validate=True)
        except (binascii.Error, ValueError):
            logger.warning("telephony: undecodable output audio of %s skipped", rid)
            return []
        return self._send_pcm(resp, resp.resampler.process(pcm16_to_float32(pcm[: len(pcm) // 2 * 2])))

    def _send_pcm(self, resp: _Played, x8k: np.ndarray) -> list[dict]:
        if x8k.size == 0:
            return []
        enc = float32_to_alaw if self.call.encoding == "g711_alaw" else float32_to_ulaw
        data = enc(x8k)
        step = TELEPHONY_RATE * self.mark_every_ms // 1000  # one byte per sample
        out = []
        for i in range(0, len(data), step):
            piece = data[i:i + step]
            resp.sent_samples += len(piece)
            self._mark_seq += 1
            name = f"dk{self._mark_seq}"
            self._marks[name] = (resp.response_id, resp.sent_samples * 1000 // TELEPHONY_RATE)
            if len(self._marks) > MAX_PENDING_MARKS:  # a provider that does not echo marks: forget the oldest
                del self._marks[next(iter(self._marks))]
            out.append(self.adapter.out_media(self.call.stream_id, base64.b64encode(piece).decode("ascii")))
            out.append(self.adapter.out_mark(self.call.stream_id, name))
            self.stats["media_out"] += 1
            self.stats["marks_sent"] += 1
        return out

    def _forget_old(self, keep: int = 8) -> None:
        """Bound the per-response bookkeeping of a long call (responses whose marks all came back)."""
        if len(self._responses) <= keep:
            return
        live = {v[0] for v in self._marks.values()}
        for rid in list(self._responses)[:-keep]:
            if rid not in live:
                del self._responses[rid]

    def heard_ms(self, response_id: str) -> Optional[int]:
        """The last echoed mark of a response, ms of audio (None: unknown response)."""
        r = self._responses.get(response_id)
        return None if r is None else r.heard_ms

    # -- session settings -------------------------------------------------------------------------
    def session_update(self, voices: Optional[set] = None) -> dict:
        """The base ``session.update`` of a call (beta field spellings, docs/protocol.md §4.1): the
        telephony input format, server VAD that answers (``create_response``) and interrupts, and the
        per-call ``instructions`` / ``voice`` custom parameters (a voice the server does not know is
        left out, with a log line)."""
        call = self.call
        s: dict[str, Any] = {"input_audio_format": call.encoding,
                             "turn_detection": {"type": "server_vad", "create_response": True,
                                                "interrupt_response": True}}
        p = call.custom_parameters
        if p.get(PARAM_INSTRUCTIONS):
            s["instructions"] = p[PARAM_INSTRUCTIONS]
        v = p.get(PARAM_VOICE)
        if v:
            if voices is not None and v not in voices and v != "default":
                logger.warning("telephony call %s: voice %r is not a server voice (serve --voice); default kept",
                               call.call_id, v[:64])
            else:
                s["voice"] = v
        return {"type": "session.update", "event_id": _eid(), "session": s}


def webhook_session(answer: Any) -> Optional[dict]:
    """The session fields of a webhook answer: ``{"session": {...}}`` or the bare object, less
    :data:`RESERVED_FIELDS` (None: nothing usable)."""
    if not isinstance(answer, dict):
        return None
    s = answer.get("session", answer)
    if not isinstance(s, dict):
        return None
    s = {k: v for k, v in s.items() if k not in RESERVED_FIELDS}
    return s or None


async def fetch_webhook_settings(url: str, call: CallStart, timeout_s: float) -> Optional[dict]:
    """POST the call's :meth:`CallStart.metadata` to ``url`` and return the session fields it
    answers (:func:`webhook_session`). Any failure (connection, timeout, non-2xx status, not JSON)
    returns None and logs one line: the call goes on with the defaults."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.post(url, json=call.metadata())
        r.raise_for_status()
        out = webhook_session(r.json())
    except Exception as exc:  # noqa: BLE001 - any failure means defaults
        logger.warning("telephony webhook failed for call %s (%s: %s); the call uses the defaults",
                       call.call_id, type(exc).__name__, str(exc)[:200])
        return None
    return out


class TelephonyConnection:
    """Drives one Session over one provider media-stream WebSocket (module docstring). Registered in
    ``ServerState.connections`` like a realtime connection (``session``, :meth:`shutdown`)."""

    def __init__(self, state, ws: WebSocket, adapter: ProviderAdapter) -> None:
        from duplexkit.driver import SessionDriver
        from duplexkit.session import Session

        from .realtime import session_config

        self.state = state
        self.ws = ws
        self.bridge = CallBridge(adapter, mark_every_ms=getattr(state.settings, "telephony_mark_every_ms",
                                                                DEFAULT_MARK_EVERY_MS))
        self.session = Session(session_config(state, "duplex"), now_ms=0)
        self.driver = SessionDriver(self.session, state.engine, on_event=self._on_event, on_close=self._on_close,
                                    tick_interval_s=state.settings.tick_interval_s, decider=state.tool_decider)
        if getattr(state, "metrics", None) is not None:
            self.driver.observer = state.metrics.session_observer()
        self._send_lock = asyncio.Lock()
        self._closed = asyncio.Event()
        self._started = False

    async def _send_provider(self, msgs: list[dict]) -> None:
        if not msgs:
            return
        async with self._send_lock:
            for m in msgs:
                try:
                    await self.ws.send_text(json.dumps(m, separators=(",", ":")))
                except (WebSocketDisconnect, RuntimeError, ConnectionError):
                    return

    def _client_events(self, events: list[dict]) -> None:
        for e in events:
            self.driver.client_event(e)

    async def _on_event(self, event: dict) -> None:
        t = event.get("type")
        if t == "error":
            err = event.get("error") or {}
            logger.warning("telephony call %s: session error %s: %s", self._call_id(), err.get("code"),
                           str(err.get("message"))[:200])
        elif t == "conversation.item.truncated":
            logger.info("telephony call %s: barge-in: item %s truncated at audio_end_ms=%s", self._call_id(),
                        event.get("item_id"), event.get("audio_end_ms"))
        elif t == "conversation.item.added":
            item = event.get("item") or {}
            text = next((c.get("text") for c in item.get("content") or () if isinstance(c, dict)), None)
            if item.get("role") == "user" and isinstance(text, str) and text.startswith("DTMF: "):
                logger.info("telephony call %s: DTMF item %s added: %s", self._call_id(), item.get("id"), text)
        elif t == "session.updated" and logger.isEnabledFor(logging.DEBUG):
            logger.debug("telephony call %s: session %s", self._call_id(), json.dumps(event.get("session"))[:2000])
        events, out = self.bridge.server_event(event)
        await self._send_provider(out)
        self._client_events(events)

    async def _on_close(self, item) -> None:
        try:
            await self.ws.close(code=getattr(item, "code", CloseCode.NORMAL) or CloseCode.NORMAL)
        except Exception:
            pass

    def _call_id(self) -> str:
        call = self.bridge.call
        return (call.call_id or call.stream_id) if call else "?"

    async def _begin(self, call: CallStart) -> None:
        """``start``: settings (custom parameters, then the webhook), then the session starts."""
        s = self.state.settings
        extra = None
        if getattr(s, "telephony_webhook", None):
            extra = await fetch_webhook_settings(s.telephony_webhook, call, getattr(s, "telephony_webhook_timeout_s", 3.0))
        self.driver.start_session()
        self.driver.start()
        self._client_events([self.bridge.session_update(set(getattr(self.state, "voices", {}) or {}))])
        if extra:
            self._client_events([{"type": "session.update", "event_id": _eid(), "session": extra}])
        if call.custom_parameters.get("call_context", "1") not in ("0", "false", "off"):
            text = (f"This is a phone call ({call.provider}); call id {call.call_id or '?'}, from "
                    f"{call.from_ or 'unknown'}, to {call.to or 'unknown'}.")
            self._client_events([{"type": "conversation.item.create", "item": {
                "type": "message", "role": "system", "content": [{"type": "input_text", "text": text}]}}])
        self._started = True
        logger.info("telephony call %s (%s) started: stream %s, %s, instructions %s, voice %s, webhook %s",
                    call.call_id, call.provider, call.stream_id, call.encoding,
                    "from parameters" if call.custom_parameters.get(PARAM_INSTRUCTIONS) else "default",
                    call.custom_parameters.get(PARAM_VOICE) or "default",
                    "applied" if extra else ("none" if not getattr(s, "telephony_webhook", None) else "failed"))

    async def run(self) -> None:
        """Read provider messages until ``stop``, the socket ends, or the session closes."""
        loop = asyncio.get_running_loop()
        dispatched = loop.create_task(self.driver.dispatch_done.wait())
        reader = loop.create_task(self._read())
        try:
            await asyncio.wait({reader, dispatched}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if self._started and not self.session.closed:
                self.driver.close_session(CloseReason.CLIENT_CLOSE.value, CloseCode.NORMAL)
                await asyncio.wait({dispatched}, timeout=5)
            for t in (reader, dispatched):
                t.cancel()
            await asyncio.gather(reader, dispatched, return_exceptions=True)
            await self.driver.aclose()
            if self.driver.observer is not None:
                self.driver.observer.close()
            self._closed.set()
            if self.ws.application_state != WebSocketState.DISCONNECTED:
                try:
                    await self.ws.close(code=CloseCode.NORMAL)
                except Exception:
                    pass
            call = self.bridge.call
            logger.info("telephony call %s ended: %s", call.call_id if call else "?", self.bridge.stats)

    async def _read(self) -> None:
        max_bytes = self.state.settings.max_event_bytes
        try:
            while True:
                msg = await self.ws.receive()
                if msg.get("type") == "websocket.disconnect":
                    return
                text = msg.get("text")
                if text is None or len(text) > max_bytes:
                    logger.info("telephony call %s: a binary or oversized frame was skipped", self._call_id())
                    continue
                data = None
                try:
                    data = json.loads(text)
                    was_started = self.bridge.call is not None
                    events, out = self.bridge.provider_message(data)
                except (ValueError, RecursionError) as exc:  # BadProviderMessage is a ValueError
                    if isinstance(data, dict) and data.get("event") == "start" and self.bridge.call is None:
                        logger.warning("telephony %s stream refused: %s", self.bridge.adapter.name, str(exc)[:200])
                        await self._on_close(type("C", (), {"code": 1003})())
                        return
                    logger.info("telephony call %s: provider message skipped: %s", self._call_id(), str(exc)[:200])
                    continue
                if data.get("event") == "error":
                    logger.warning("telephony call %s: provider error %s", self._call_id(), text[:500])
                if not was_started and self.bridge.call is not None:
                    await self._begin(self.bridge.call)
                if self._started:
                    self._client_events(events)
                await self._send_provider(out)
                if self.bridge.stopped:
                    return
        except (WebSocketDisconnect, RuntimeError):
            return

    async def shutdown(self, reason: str = "shutdown") -> None:
        """Server shutdown: the session closes (1001) and the provider's socket with it."""
        if self._closed.is_set():
            return
        if self._started:
            self.driver.close_session(reason, CloseCode.GOING_AWAY)
        else:
            await self._on_close(type("C", (), {"code": CloseCode.GOING_AWAY})())
        await self._closed.wait()


class _RedactToken(logging.Filter):
    """Hides the ``token`` query parameter of telephony stream URLs in uvicorn's handshake log lines
    (``"WebSocket /v1/telephony/twilio?token=..." [accepted]``): the key must not land in logs."""

    _re = __import__("re").compile(r"([?&]token=)[^&\s\"]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, str) and "token=" in a for a in record.args):
            record.args = tuple(self._re.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        return True


def _install_redaction() -> None:
    lg = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _RedactToken) for f in lg.filters):
        lg.addFilter(_RedactToken())


async def handle(state, ws: WebSocket, provider: str) -> None:
    """ASGI WebSocket entry point of ``/v1/telephony/{provider}``.

    Auth (docs/telephony.md, "Authentication"): with API keys set, the key comes in the stream URL's
    ``token`` query parameter (providers cannot set headers on their WebSocket) or an
    ``Authorization: Bearer`` header; otherwise close 1008. No ready engine: close 1013. No free
    slot: close 1013 (the provider ends the stream; the caller hears what the TwiML does next).
    """
    from .realtime import _take_slot

    _install_redaction()
    adapter = ADAPTERS[provider]
    key = ws.query_params.get("token") or state.bearer(ws.headers.get("authorization"))
    if not state.check_key(key):
        logger.info("telephony %s stream refused: missing or invalid token", provider)
        await ws.close(code=CloseCode.POLICY_VIOLATION, reason=ErrorCode.UNAUTHORIZED.value)
        return
    if not state.ready:
        await ws.close(code=CloseCode.TRY_AGAIN_LATER, reason="server not ready")
        return
    client = state.client_id(key, ws.scope)
    if not (state.slots.try_acquire(client) or await _take_slot(state, client)):
        logger.warning("telephony %s stream refused: %s", provider, state.capacity_message(client))
        await ws.close(code=CloseCode.TRY_AGAIN_LATER, reason=ErrorCode.SESSION_CAPACITY_EXHAUSTED.value)
        return
    try:
        await ws.accept()
        conn = TelephonyConnection(state, ws, adapter)
        state.connections.add(conn)
        try:
            await conn.run()
        finally:
            state.connections.discard(conn)
            state.session_closed(conn.session)
    finally:
        state.slots.release(client)
