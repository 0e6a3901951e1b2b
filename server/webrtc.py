"""WebRTC transport: ``POST /v1/realtime/calls`` in OpenAI's shape, built on aiortc (docs/webrtc.md).

A browser (or any WebRTC peer) POSTs its SDP offer; the server answers with its SDP and the call
runs over the peer connection:

* the caller's microphone track (Opus, 48 kHz) is decoded by aiortc, downmixed, resampled to the
  session's input rate (:class:`~duplexkit.audio.resample.StreamResampler`) and fed to the session
  as ordinary ``input_audio_buffer.append`` events, 100 ms each;
* the session's answer audio (``response.output_audio.delta``, 24 kHz PCM16) is resampled to 48 kHz
  and played on an outbound audio track paced in real time (one 20 ms frame per 20 ms); those deltas
  are **not** sent on the data channel (OpenAI's WebRTC behaviour: the audio is on the track);
* the ``oai-events`` data channel carries the same JSON events as the realtime WebSocket: client
  events in, server events out. ``server_event_seq`` is renumbered per channel (1, 2, 3, ... with no
  gaps, since the audio deltas are left out), and three WebRTC-only events are added, as OpenAI does:
  ``output_audio_buffer.started{response_id}`` (a response's first audio went out on the track),
  ``output_audio_buffer.stopped{response_id}`` (all of it has been played out) and
  ``output_audio_buffer.cleared{response_id}`` (barge-in dropped what was still queued);
* playback truth (docs/protocol.md §7.5) is reported by the server itself: what the paced track has
  played goes to the session as ``playback.ack`` every :data:`ACK_EVERY_MS`, and a barge-in (the
  user's ``input_audio_buffer.speech_started``, a cancelled ``response.done``, the client's
  ``output_audio_buffer.clear``) clears the queued track audio at once and finalises the item with
  ``playback.ack{truncate:true}`` at what was played.

Like :mod:`duplexkit_server.telephony` this is a transport adapter only: the same sans-I/O
:class:`duplexkit.session.Session` is driven by the same :class:`duplexkit.driver.SessionDriver`
with ordinary client events; the session machine is not changed. Two sans-I/O parts are unit-testable
without a peer: :class:`Capture` (decoded frames -> append events) and :class:`Playout` (answer audio
-> track frames, acks and the ``output_audio_buffer.*`` events).

aiortc is optional (``pip install 'duplexkit[webrtc]'``): without it the route answers 501.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import email.parser
import email.policy
import importlib.util
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Optional

import numpy as np
from fastapi import Request

from duplexkit.audio.codecs import (float32_to_alaw, float32_to_f32le, float32_to_pcm16, float32_to_ulaw,
                                    pcm16_to_float32)
from duplexkit.audio.resample import StreamResampler
from duplexkit.engine.api import OUTPUT_SAMPLE_RATE
from duplexkit.errors import ERROR_TYPES, DuplexkitError, ErrorCode
from duplexkit.protocol.vocabulary import FORMAT_TYPE_ENCODINGS, PCM_RATE, CloseCode, CloseReason, default_rate

logger = logging.getLogger("duplexkit.server.webrtc")

__all__ = ["RTC_RATE", "FRAME_SAMPLES", "ACK_EVERY_MS", "APPEND_MS", "OUTPUT_RATE", "EVENTS_LABEL",
           "BadOffer", "WebRTCUnavailable", "available", "parse_offer", "input_format", "Capture", "Playout",
           "WebRTCCall", "install"]

#: aiortc's audio clock (Opus, RFC 7587), Hz.
RTC_RATE = 48_000
#: Samples of one outbound 20 ms frame at :data:`RTC_RATE`.
FRAME_SAMPLES = 960
#: The session's output rate (docs/protocol.md §6.2), Hz.
OUTPUT_RATE = OUTPUT_SAMPLE_RATE
#: Input audio per ``input_audio_buffer.append``, ms (docs/protocol.md §6.1: 100-200 ms).
APPEND_MS = 100
#: How often the played position of the track is reported with ``playback.ack``, ms of audio.
ACK_EVERY_MS = 200
#: The data channel OpenAI's clients open for events.
EVENTS_LABEL = "oai-events"
#: Frames aiortc's jitter buffer holds before it hands the microphone's audio on (aiortc's own
#: default is 4, i.e. 80 ms; see :func:`_shorten_jitter_buffer`).
INPUT_JITTER_FRAMES = 1
#: Largest SDP offer accepted, bytes.
MAX_SDP_BYTES = 64 * 1024
#: A call whose peer connection is not up this long after the answer ends, seconds.
CONNECT_TIMEOUT_S = 30.0
#: Server events held while the data channel is not open yet (older ones are dropped first).
MAX_HELD_EVENTS = 1024
#: Environment variable: comma-separated ``stun:``/``turn:`` URLs for the server's ICE agent (none by
#: default: host candidates only, which is what a server with a public address needs).
ICE_SERVERS_ENV = "DUPLEXKIT_WEBRTC_ICE_SERVERS"
INSTALL_HINT = "WebRTC needs aiortc on the server: pip install 'duplexkit[webrtc]' (or pip install aiortc)"


class BadOffer(DuplexkitError, ValueError):
    """A ``POST /v1/realtime/calls`` body the server cannot use (no SDP, not an SDP offer with an audio
    section, a ``session`` field that is not a JSON object). Answered with HTTP 400 and the server's
    error body ``{error{message, type:"invalid_request_error", param, code:"bad_request"}}``.

    Attributes:
        param: the request field at fault (``"sdp"`` or ``"session"``).
    """

    default_code = "bad_request"

    def __init__(self, message: str, param: str = "sdp") -> None:
        super().__init__(message)
        self.param = param


class WebRTCUnavailable(DuplexkitError, RuntimeError):
    """aiortc is not installed: the route answers HTTP 501 with :data:`INSTALL_HINT`."""

    default_code = "webrtc_unavailable"


def available() -> bool:
    """Whether aiortc (and PyAV) can be imported."""
    return importlib.util.find_spec("aiortc") is not None and importlib.util.find_spec("av") is not None


def _eid() -> str:
    return "event_" + secrets.token_hex(12)


# ------------------------------------------------------------------------------------ the offer
def parse_offer(content_type: Optional[str], body: bytes) -> tuple[str, Optional[dict]]:
    """The SDP offer and optional session settings of a ``POST /v1/realtime/calls`` body.

    Accepted bodies (docs/webrtc.md, "Request"):

    * ``application/sdp`` (or ``text/plain``): the SDP offer itself;
    * ``multipart/form-data`` (OpenAI's unified interface): a field ``sdp`` (the offer) and an optional
      field ``session`` (a JSON object, applied as the session's first ``session.update``);
    * ``application/json``: ``{"sdp": "...", "session": {...}}``.

    Returns:
        ``(sdp, session)``: the offer (str) and the session object (dict) or None.
    Raises:
        BadOffer: no usable offer (empty, over :data:`MAX_SDP_BYTES`, not SDP, no ``m=audio`` line),
            or a ``session`` that is not a JSON object.
    """
    ctype = (content_type or "").lower()
    session: Any = None
    if ctype.startswith("multipart/form-data"):
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type.encode("latin-1", "replace") + b"\r\n\r\n" + body)
        if not msg.is_multipart():
            raise BadOffer("a multipart/form-data body without parts (is the boundary right?)")
        fields: dict[str, str] = {}
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if isinstance(name, str) and name not in fields:
                payload = part.get_payload(decode=True) or b""
                fields[name] = payload.decode("utf-8", "replace")
        sdp = fields.get("sdp")
        if sdp is None:
            raise BadOffer("the form has no sdp field (OpenAI's shape: sdp=<offer>, session=<JSON>)")
        if "session" in fields:
            try:
                session = json.loads(fields["session"])
            except (ValueError, RecursionError):
                raise BadOffer("the session field is not JSON", "session") from None
    elif ctype.startswith("application/json"):
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            raise BadOffer("the body is not JSON") from None
        if not isinstance(data, dict) or not isinstance(data.get("sdp"), str):
            raise BadOffer('a JSON body must be {"sdp": "<offer>", "session": {...}}')
        sdp, session = data["sdp"], data.get("session")
    else:
        try:
            sdp = body.decode("utf-8")
        except UnicodeDecodeError:
            raise BadOffer("the SDP offer is not UTF-8 text") from None
    if session is not None and not isinstance(session, dict):
        raise BadOffer("session must be a JSON object (the fields of session.update)", "session")
    if len(sdp.encode("utf-8")) > MAX_SDP_BYTES:
        raise BadOffer(f"the SDP offer is larger than {MAX_SDP_BYTES} bytes")
    lines = [ln.strip() for ln in sdp.strip().splitlines()]
    if not lines or lines[0] != "v=0":
        raise BadOffer("the body is not an SDP offer (it must start with v=0; send Content-Type: application/sdp)")
    if not any(ln.startswith("m=audio ") for ln in lines):
        raise BadOffer("the SDP offer has no audio section (m=audio): add a microphone track or an audio transceiver")
    return sdp.strip() + "\r\n", session


def input_format(session: dict) -> tuple[str, int]:
    """The input encoding and rate (Hz) of a ``session`` object of ``session.created`` /
    ``session.updated``: ``("pcm16", rate)``, ``("pcm_f32le", rate)``, ``("g711_ulaw", 8000)`` or
    ``("g711_alaw", 8000)``."""
    fmt = ((session.get("audio") or {}).get("input") or {}).get("format") or {}
    t = fmt.get("type") if isinstance(fmt, dict) else None
    enc = FORMAT_TYPE_ENCODINGS.get(t) if isinstance(t, str) else None
    if enc is not None and enc.startswith("g711"):
        return enc, default_rate(enc)
    rate = (fmt.get("rate") or fmt.get("sample_rate_hz")) if isinstance(fmt, dict) else None
    enc = "pcm_f32le" if isinstance(fmt, dict) and fmt.get("encoding") == "pcm_f32le" else "pcm16"
    return enc, int(rate) if isinstance(rate, int) and rate > 0 else PCM_RATE


# ------------------------------------------------------------------------------------ capture
class Capture:
    """Decoded microphone audio -> ``input_audio_buffer.append`` events (sans-I/O).

    Feed mono float32 frames at any rate with :meth:`frame`; each full :data:`APPEND_MS` of audio at
    the session's input rate comes back as one append event (base64 in the session's encoding).
    :meth:`set_format` follows ``session.created`` / ``session.updated`` (a new rate restarts the
    resampler; audio held for the old format is dropped).
    """

    def __init__(self, encoding: str = "pcm16", rate: int = PCM_RATE) -> None:
        self.encoding, self.rate = encoding, rate
        self._rs: Optional[StreamResampler] = None
        self._rs_in: Optional[int] = None
        self._held: list[np.ndarray] = []
        self._held_n = 0
        #: appends produced and input samples seen (at the decoder's rate)
        self.appends = 0
        self.frames = 0

    def set_format(self, encoding: str, rate: int) -> None:
        if (encoding, rate) != (self.encoding, self.rate):
            self.encoding, self.rate = encoding, rate
            self._rs, self._rs_in, self._held, self._held_n = None, None, [], 0

    def frame(self, mono: np.ndarray, rate: int) -> list[dict]:
        """One decoded frame: float32 [n] in [-1, 1] at ``rate`` Hz. Returns 0 or more append events."""
        self.frames += 1
        if self._rs is None or self._rs_in != rate:
            self._rs, self._rs_in = StreamResampler(rate, self.rate), rate
        x = self._rs.process(np.asarray(mono, np.float32))
        if x.size:
            self._held.append(x)
            self._held_n += x.size
        step = self.rate * APPEND_MS // 1000
        out = []
        while self._held_n >= step:
            allx = np.concatenate(self._held)
            chunk, rest = allx[:step], allx[step:]
            self._held, self._held_n = ([rest] if rest.size else []), rest.size
            out.append({"type": "input_audio_buffer.append", "audio": base64.b64encode(self._encode(chunk)).decode("ascii")})
            self.appends += 1
        return out

    def _encode(self, x: np.ndarray) -> bytes:
        if self.encoding == "g711_ulaw":
            return float32_to_ulaw(x)
        if self.encoding == "g711_alaw":
            return float32_to_alaw(x)
        if self.encoding == "pcm_f32le":
            return float32_to_f32le(x)
        return float32_to_pcm16(x)


def frame_to_mono(frame) -> tuple[np.ndarray, int]:
    """A PyAV ``AudioFrame`` (s16/flt, packed or planar, any channel count) -> (float32 [n], rate Hz)."""
    a = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if frame.format.is_planar:
        a = a.reshape(channels, -1).astype(np.float32).mean(axis=0)
    else:
        a = a.reshape(-1, channels).astype(np.float32).mean(axis=1)
    if frame.format.name.startswith("s16"):
        a = a / 32768.0
    elif frame.format.name.startswith("s32"):
        a = a / 2147483648.0
    return a.astype(np.float32), int(frame.sample_rate)


# ------------------------------------------------------------------------------------ playout
@dataclass
class _Resp:
    """One response's audio on the track (samples at :data:`RTC_RATE`)."""

    response_id: str
    item_id: Optional[str]
    resampler: Optional[StreamResampler] = None
    queued: deque = field(default_factory=deque)  # int16 arrays not yet played
    queued_n: int = 0
    played: int = 0
    acked: int = 0  # samples reported with playback.ack
    audio_done: bool = False
    started: bool = False
    stopped: bool = False
    cleared: bool = False


class Playout:
    """The outbound track's queue and playback truth (sans-I/O).

    :meth:`audio` takes a ``response.output_audio.delta`` (24 kHz PCM16 bytes) and queues it at
    48 kHz; :meth:`take` gives the next frame of the track (int16 [n], zero-filled when nothing is
    queued) with the events it causes: client events for the session (``playback.ack`` every
    ``ack_every_ms`` played, and the final ack once a response has played out) and server events for
    the data channel (``output_audio_buffer.started`` / ``.stopped``). :meth:`clear` drops queued
    audio (barge-in). Responses play in the order their audio arrived.
    """

    def __init__(self, ack_every_ms: int = ACK_EVERY_MS, keep: int = 16) -> None:
        self.ack_every = RTC_RATE * ack_every_ms // 1000
        self.keep = keep
        self._resp: dict[str, _Resp] = {}
        self._order: deque[str] = deque()  # responses with queued audio, in arrival order
        #: counters (docs/webrtc.md): samples played (48 kHz), frames taken, clears
        self.stats = {"played_samples": 0, "frames": 0, "clears": 0}

    def _get(self, rid: str, item_id: Optional[str]) -> _Resp:
        r = self._resp.get(rid)
        if r is None:
            r = self._resp[rid] = _Resp(rid, item_id, StreamResampler(OUTPUT_RATE, RTC_RATE))
            if len(self._resp) > self.keep:  # forget old, finished responses
                for old in list(self._resp)[: len(self._resp) - self.keep]:
                    if old not in self._order and old != rid:
                        del self._resp[old]
        if r.item_id is None and item_id:
            r.item_id = item_id
        return r

    def queued_ms(self, rid: Optional[str] = None) -> int:
        """Audio queued and not yet played, ms (of one response, or of all)."""
        n = sum(r.queued_n for r in self._resp.values() if rid is None or r.response_id == rid)
        return n * 1000 // RTC_RATE

    def played_ms(self, rid: str) -> int:
        r = self._resp.get(rid)
        return 0 if r is None else r.played * 1000 // RTC_RATE

    def audio(self, rid: str, item_id: Optional[str], pcm16: bytes) -> None:
        """Queue one delta of response ``rid`` (24 kHz PCM16 little-endian bytes)."""
        r = self._get(rid, item_id)
        if r.cleared or r.audio_done:
            return
        self._push(r, r.resampler.process(pcm16_to_float32(pcm16[: len(pcm16) // 2 * 2])))

    def audio_done(self, rid: str) -> None:
        """The response's audio is complete (``response.output_audio.done`` or ``response.done``)."""
        r = self._resp.get(rid)
        if r is None or r.audio_done:
            return
        if not r.cleared and r.resampler is not None:
            self._push(r, r.resampler.flush())
        r.audio_done, r.resampler = True, None

    def _push(self, r: _Resp, x48: np.ndarray) -> None:
        if x48.size == 0:
            return
        r.queued.append(np.clip(np.round(x48 * 32767.0), -32768, 32767).astype(np.int16))
        r.queued_n += x48.size
        if r.response_id not in self._order:
            self._order.append(r.response_id)

    def _ack(self, r: _Resp, truncate: bool = False) -> dict:
        r.acked = r.played
        ev = {"type": "playback.ack", "response_id": r.response_id, "played_ms": r.played * 1000 // RTC_RATE}
        if r.item_id:
            ev["item_id"] = r.item_id
        if truncate:
            ev["truncate"] = True
        return ev

    def take(self, n: int = FRAME_SAMPLES) -> tuple[np.ndarray, list[dict], list[dict]]:
        """The next ``n`` samples of the track. Returns ``(int16 [n], client_events, server_events)``."""
        out = np.zeros(n, np.int16)
        client: list[dict] = []
        server: list[dict] = []
        filled = 0
        self.stats["frames"] += 1
        while filled < n and self._order:
            r = self._resp[self._order[0]]
            if not r.queued:
                self._order.popleft()
                continue
            if not r.started:
                r.started = True
                server.append({"type": "output_audio_buffer.started", "response_id": r.response_id})
            seg = r.queued[0]
            k = min(n - filled, seg.size)
            out[filled:filled + k] = seg[:k]
            filled += k
            r.played += k
            r.queued_n -= k
            self.stats["played_samples"] += k
            if k == seg.size:
                r.queued.popleft()
            else:
                r.queued[0] = seg[k:]
            if r.played - r.acked >= self.ack_every:
                client.append(self._ack(r))
            if not r.queued:
                self._order.popleft()
        for r in self._resp.values():  # responses whose whole audio has played out
            if r.started and not r.stopped and not r.cleared and r.audio_done and r.queued_n == 0:
                r.stopped = True
                if r.played > r.acked:
                    client.append(self._ack(r))
                server.append({"type": "output_audio_buffer.stopped", "response_id": r.response_id})
        return out, client, server

    def clear(self, rid: Optional[str] = None, *, announce: bool = True) -> tuple[list[dict], list[dict]]:
        """Barge-in: drop the queued audio of ``rid`` (None: of every response with audio still
        queued) at once. Each such response is finalised at what was played
        (``playback.ack{truncate:true}``) and, with ``announce``, ``output_audio_buffer.cleared`` is
        emitted for it. Returns ``(client_events, server_events)``; nothing for a response that has
        nothing queued and has not started, or was already cleared or fully played."""
        if rid is None:
            targets = [self._resp[x] for x in self._order if self._resp[x].queued_n and not self._resp[x].cleared]
        else:
            r = self._resp.get(rid)
            targets = [r] if r is not None and not r.cleared and not r.stopped and (r.queued_n or r.started) else []
        client, server = [], []
        for r in targets:
            r.cleared, r.resampler = True, None
            r.queued.clear()
            r.queued_n = 0
            if r.response_id in self._order:
                self._order.remove(r.response_id)
            client.append(self._ack(r, truncate=True))
            if announce:
                server.append({"type": "output_audio_buffer.cleared", "response_id": r.response_id})
        if targets:
            self.stats["clears"] += 1
        return client, server


# ------------------------------------------------------------------------------------ the call
def _ice_servers():
    import os

    from aiortc import RTCIceServer

    urls = [u.strip() for u in os.environ.get(ICE_SERVERS_ENV, "").split(",") if u.strip()]
    return [RTCIceServer(urls=u) for u in urls]


def _make_track(take: Callable[[], Any]):
    """An aiortc audio track that plays :class:`Playout` frames in real time (one 20 ms frame per
    20 ms of the monotonic clock; after a stall of the event loop it resumes at real time instead of
    bursting)."""
    from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
    from av import AudioFrame

    class PacedAudioTrack(MediaStreamTrack):
        kind = "audio"

        def __init__(self) -> None:
            super().__init__()
            self._t0: Optional[float] = None
            self._pts = 0

        async def recv(self):
            if self.readyState != "live":
                raise MediaStreamError
            now = time.monotonic()
            if self._t0 is None:
                self._t0, self._pts = now, 0
            else:
                self._pts += FRAME_SAMPLES
                wait = self._t0 + self._pts / RTC_RATE - now
                if wait > 0:
                    await asyncio.sleep(wait)
                elif wait < -0.1:  # the loop stalled: go on from now
                    self._t0 = now - self._pts / RTC_RATE
            pcm = take()
            frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = RTC_RATE
            frame.pts = self._pts
            frame.time_base = Fraction(1, RTC_RATE)
            return frame

    return PacedAudioTrack()


def _shorten_jitter_buffer(pc, track) -> None:
    """Hand the microphone's frames to the session after :data:`INPUT_JITTER_FRAMES` instead of
    aiortc's 4 (80 ms): the input feeds the model, not a speaker, so it needs no playout smoothing
    (a late frame is only late). Best effort: aiortc keeps the buffer in a private attribute."""
    try:
        from aiortc.jitterbuffer import JitterBuffer

        for t in pc.getTransceivers():
            rx = t.receiver
            if rx is not None and rx.track is track and hasattr(rx, "_RTCRtpReceiver__jitter_buffer"):
                rx._RTCRtpReceiver__jitter_buffer = JitterBuffer(capacity=16, prefetch=INPUT_JITTER_FRAMES)
    except Exception:  # another aiortc version: keep its default
        logger.debug("webrtc: the input jitter buffer could not be shortened", exc_info=True)


class WebRTCCall:
    """One WebRTC call: a peer connection driving one Session (module docstring). Registered in
    ``ServerState.connections`` like a realtime connection (``session``, :meth:`shutdown`).

    Args:
        state: the server's ``ServerState``.
        call_id: ``rtc_<24 hex>`` (the ``Location`` of the call).
        profile: ``"compat"`` (default of the route) or ``"duplex"`` (``?duplex=1``).
    """

    def __init__(self, state, call_id: str, *, profile: str = "compat") -> None:
        from aiortc import RTCConfiguration, RTCPeerConnection

        from duplexkit.driver import SessionDriver
        from duplexkit.session import Session

        from .realtime import session_config

        self.state = state
        self.call_id = call_id
        self.profile = profile
        self.session = Session(session_config(state, profile), now_ms=0)
        self.driver = SessionDriver(self.session, state.engine, on_event=self._on_event, on_close=self._on_close,
                                    tick_interval_s=state.settings.tick_interval_s, decider=state.tool_decider)
        if getattr(state, "metrics", None) is not None:
            self.driver.observer = state.metrics.session_observer()
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=_ice_servers()))
        self.capture = Capture()
        self.playout = Playout()
        self.track = _make_track(self._take)
        self.channel = None
        self._held: deque = deque()  # server events waiting for the channel to open
        self._seq = 0
        self._ended = asyncio.Event()
        self._closed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.end_reason = "?"
        #: counters logged at the end of the call
        self.stats = {"events_out": 0, "events_in": 0, "deltas_to_track": 0, "dropped_held": 0}

        @self.pc.on("datachannel")
        def on_datachannel(channel) -> None:
            if self.channel is not None and channel.label != EVENTS_LABEL:
                return  # one event channel per call; oai-events wins
            self.channel = channel

            @channel.on("message")
            def on_message(msg) -> None:
                if self.session.closed:
                    return
                self.stats["events_in"] += 1
                if isinstance(msg, str):
                    self.driver.client_event(msg)
                else:  # docs/protocol.md §1.3: binary messages get bad_event and are ignored
                    self.session.receive_binary_frame(self.driver.now_ms())
                    self.driver.flush()

            @channel.on("close")
            def on_close() -> None:
                if channel is self.channel:
                    self._end("data channel closed")

            if channel.readyState == "open":
                self._flush_held()
            else:
                channel.on("open", self._flush_held)

        @self.pc.on("track")
        def on_track(track) -> None:
            if track.kind == "audio":
                _shorten_jitter_buffer(self.pc, track)
                self._spawn(self._read_mic(track), "webrtc-mic")

        @self.pc.on("connectionstatechange")
        async def on_state() -> None:
            st = self.pc.connectionState
            logger.debug("webrtc call %s: connection %s", self.call_id, st)
            if st in ("failed", "closed"):
                self._end(f"peer connection {st}")

    def _spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _end(self, reason: str) -> None:
        if not self._ended.is_set():
            self.end_reason = reason
            self._ended.set()

    # -- offer / answer -----------------------------------------------------------------------------
    async def answer(self, sdp: str, session: Optional[dict]) -> str:
        """Apply the offer and return the SDP answer (str). Starts the session: with ``session`` it is
        applied as the first ``session.update`` (before ``session.created``, as with ``autostart=0``).

        Raises:
            BadOffer: aiortc refused the offer.
        """
        from aiortc import RTCSessionDescription

        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        except Exception as exc:  # aiortc raises ValueError, KeyError, ... on SDP it cannot use
            raise BadOffer(f"the SDP offer was refused: {type(exc).__name__}: {str(exc)[:300]}") from None
        audio = [t for t in self.pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            raise BadOffer("the SDP offer has no audio section (m=audio)")
        self.pc.addTrack(self.track)
        try:
            await self.pc.setLocalDescription(await self.pc.createAnswer())
        except Exception as exc:
            raise BadOffer(f"no answer to this offer: {type(exc).__name__}: {str(exc)[:300]}") from None
        if session is not None:
            self.driver.client_event({"type": "session.update", "event_id": _eid(), "session": session})
        else:
            self.driver.start_session()
        self.driver.start()
        return self.pc.localDescription.sdp

    # -- audio in --------------------------------------------------------------------------------------
    async def _read_mic(self, track) -> None:
        from aiortc.mediastreams import MediaStreamError

        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if self.session.closed:
                return
            mono, rate = frame_to_mono(frame)
            for ev in self.capture.frame(mono, rate):
                self.driver.client_event(ev)

    # -- audio out -------------------------------------------------------------------------------------
    def _take(self) -> np.ndarray:
        pcm, client, server = self.playout.take(FRAME_SAMPLES)
        for ev in server:
            self._send({**ev, "event_id": _eid()})
        if not self.session.closed:
            for ev in client:
                self.driver.client_event(ev)
        return pcm

    # -- events out -----------------------------------------------------------------------------------
    async def _on_event(self, event: dict) -> None:
        t = event.get("type")
        if t == "response.output_audio.delta":
            rid = event.get("response_id")
            if isinstance(rid, str):
                try:
                    pcm = base64.b64decode(event.get("delta") or "", validate=True)
                except (binascii.Error, ValueError):
                    logger.warning("webrtc call %s: undecodable output audio of %s skipped", self.call_id, rid)
                    return
                self.playout.audio(rid, event.get("item_id"), pcm)
                self.stats["deltas_to_track"] += 1
            return  # the audio is on the track, not on the data channel (as OpenAI's WebRTC)
        self._send(event)
        if t in ("session.created", "session.updated"):
            self.capture.set_format(*input_format(event.get("session") or {}))
        elif t == "response.output_audio.done":
            self.playout.audio_done(event.get("response_id"))
        elif t == "input_audio_buffer.speech_started":
            self._barge_in(None, announce=True)
        elif t == "output_audio_buffer.cleared":  # the session's answer to output_audio_buffer.clear
            if event.get("response_id"):
                self._barge_in(event["response_id"], announce=False)
            self._barge_in(None, announce=False)  # and the tail of a finished response still queued
        elif t == "response.done":
            resp = event.get("response") or {}
            rid = resp.get("id")
            if isinstance(rid, str):
                if resp.get("status") == "cancelled":
                    self._barge_in(rid, announce=True)
                self.playout.audio_done(rid)

    def _barge_in(self, rid: Optional[str], *, announce: bool) -> None:
        client, server = self.playout.clear(rid, announce=announce)
        for ev in server:
            self._send({**ev, "event_id": _eid()})
        if client:
            logger.info("webrtc call %s: barge-in: track audio cleared (%s)", self.call_id,
                        ", ".join(f"{e['response_id']} at {e['played_ms']} ms" for e in client))
        for ev in client:
            self.driver.client_event(ev)

    def _send(self, event: dict) -> None:
        """Send a server event on the data channel (renumbered ``server_event_seq``), or hold it until
        the channel opens."""
        ch = self.channel
        if ch is None or ch.readyState != "open":
            self._held.append(event)
            if len(self._held) > MAX_HELD_EVENTS:
                self._held.popleft()
                self.stats["dropped_held"] += 1
            return
        self._seq += 1
        try:
            ch.send(json.dumps({**event, "server_event_seq": self._seq}, separators=(",", ":")))
            self.stats["events_out"] += 1
        except Exception:  # the channel went away meanwhile
            self._end("data channel send failed")
            return
        limit = int(getattr(self.state.settings, "max_outbound_bytes", 8 * 2**20))
        if ch.bufferedAmount > limit:
            logger.warning("webrtc call %s: ending it, the peer is not reading (%d bytes queued on the data channel)",
                           self.call_id, ch.bufferedAmount)
            self._end("peer not reading")

    def _flush_held(self) -> None:
        held, self._held = list(self._held), deque()
        for ev in held:
            self._send(ev)

    async def _on_close(self, item) -> None:
        """The session closed (``session.close``, idle timeout, shutdown, engine failure)."""
        self._end(f"session closed (code {getattr(item, 'code', '?')})")

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the call until the peer leaves, the session closes, or a hangup; then tear down."""
        loop = asyncio.get_running_loop()
        dispatched = loop.create_task(self.driver.dispatch_done.wait())
        ended = loop.create_task(self._ended.wait())
        watchdog = loop.create_task(self._connect_watchdog())
        try:
            await asyncio.wait({dispatched, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if dispatched.done() and not self._ended.is_set():
                self.end_reason = "session closed"
            if self.session.started and not self.session.closed:
                self.driver.close_session(CloseReason.CLIENT_CLOSE.value, CloseCode.NORMAL)
                await asyncio.wait({dispatched}, timeout=5)
            await self._drain_channel()
            for t in (dispatched, ended, watchdog, *self._tasks):
                t.cancel()
            await asyncio.gather(dispatched, ended, watchdog, *self._tasks, return_exceptions=True)
            await self.driver.aclose()
            if self.driver.observer is not None:
                self.driver.observer.close()
            self.track.stop()
            try:
                await asyncio.wait_for(self.pc.close(), 5)
            except Exception:
                logger.debug("webrtc call %s: closing the peer connection failed", self.call_id, exc_info=True)
            self._closed.set()
            logger.info("webrtc call %s ended (%s): %s, capture %d appends, playout %s", self.call_id,
                        self.end_reason, self.stats, self.capture.appends, self.playout.stats)

    async def _connect_watchdog(self) -> None:
        await asyncio.sleep(CONNECT_TIMEOUT_S)
        if self.pc.connectionState != "connected":
            logger.warning("webrtc call %s: no connection %g s after the answer (state %s): ending it",
                           self.call_id, CONNECT_TIMEOUT_S, self.pc.connectionState)
            self._end("connect timeout")

    async def _drain_channel(self, timeout_s: float = 1.0) -> None:
        """Give the last events (``session.closed``) a moment to leave on the data channel."""
        ch = self.channel
        if ch is None or ch.readyState != "open":
            return
        deadline = time.monotonic() + timeout_s
        await asyncio.sleep(0.05)
        while ch.bufferedAmount > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def hangup(self) -> None:
        """``POST /v1/realtime/calls/{call_id}/hangup``: end the call and wait for the teardown."""
        self._end("hangup")
        await self._closed.wait()

    async def shutdown(self, reason: str = "shutdown") -> None:
        """Server shutdown: ``session.closed{reason}`` on the data channel, then the call ends."""
        if self._closed.is_set():
            return
        if self.session.started and not self.session.closed:
            self.driver.close_session(reason, CloseCode.GOING_AWAY)
        self._end(reason)
        await self._closed.wait()


# ------------------------------------------------------------------------------------ routes
def install(app, state, http_auth: Callable) -> None:
    """Register ``POST /v1/realtime/calls`` and ``POST /v1/realtime/calls/{call_id}/hangup`` on ``app``.

    ``http_auth(request)`` is the app's key check (None when allowed, else the 401 response).
    """
    from fastapi.responses import Response

    from .responses import openai_error

    calls: dict[str, WebRTCCall] = {}
    tasks: set[asyncio.Task] = set()

    @app.post("/v1/realtime/calls")
    async def create_call(request: Request):
        if (err := http_auth(request)) is not None:
            return err
        if not available():
            return openai_error(501, INSTALL_HINT, "webrtc_unavailable", type_=ERROR_TYPES[ErrorCode.SERVER_ERROR])
        q = request.query_params
        model = q.get("model")
        if not state.accepts_model(model):
            return openai_error(400, state.unknown_model_message(model), ErrorCode.MODEL_NOT_FOUND.value, param="model")
        limit = state.settings.max_body_bytes
        body = await request.body()
        if len(body) > limit:
            return openai_error(413, f"the request body is larger than {limit} bytes (--max-body-bytes)",
                                "request_too_large")
        try:
            sdp, session = parse_offer(request.headers.get("content-type"), body)
        except BadOffer as exc:
            return openai_error(400, str(exc), exc.code, param=exc.param)
        if isinstance(session, dict) and session.get("model") is not None and not state.accepts_model(session.get("model")):
            return openai_error(400, state.unknown_model_message(session.get("model")), ErrorCode.MODEL_NOT_FOUND.value,
                                param="session.model")
        if not state.ready:
            return openai_error(503, "the server is loading or shutting down; retry later", ErrorCode.SESSION_CAPACITY_EXHAUSTED.value,
                                headers={"Retry-After": str(state.settings.retry_after_s)})
        from .realtime import _take_slot

        key = state.bearer(request.headers.get("authorization"))
        client = state.client_id(key, request.scope)
        if not (state.slots.try_acquire(client) or await _take_slot(state, client)):
            return openai_error(503, state.capacity_message(client), ErrorCode.SESSION_CAPACITY_EXHAUSTED.value,
                                headers={"Retry-After": str(state.settings.retry_after_s)})
        duplex = (q.get("duplex") or "").strip().lower() in ("1", "true", "on", "yes")
        call_id = "rtc_" + secrets.token_hex(12)
        call: Optional[WebRTCCall] = None
        try:
            call = WebRTCCall(state, call_id, profile="duplex" if duplex else "compat")
            answer = await call.answer(sdp, session)
        except BadOffer as exc:
            state.slots.release(client)
            await _close_quietly(call)
            return openai_error(400, str(exc), exc.code, param=exc.param)
        except Exception as exc:
            state.slots.release(client)
            await _close_quietly(call)
            logger.exception("webrtc call setup failed")
            return openai_error(500, f"the call could not be set up: {type(exc).__name__}", ErrorCode.SERVER_ERROR.value)
        calls[call_id] = call
        state.connections.add(call)

        async def serve() -> None:
            try:
                await call.run()
            finally:
                calls.pop(call_id, None)
                state.connections.discard(call)
                state.session_closed(call.session)
                state.slots.release(client)

        t = asyncio.get_running_loop().create_task(serve(), name=f"webrtc-{call_id}")
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        logger.info("webrtc call %s started: session %s, %s profile%s", call_id, call.session.session_id,
                    call.profile, ", session settings from the request" if session else "")
        return Response(answer, status_code=201, media_type="application/sdp",
                        headers={"Location": f"/v1/realtime/calls/{call_id}"})

    @app.post("/v1/realtime/calls/{call_id}/hangup")
    async def hangup_call(call_id: str, request: Request):
        if (err := http_auth(request)) is not None:
            return err
        call = calls.get(call_id)
        if call is None:
            return openai_error(404, f"no call {call_id[:64]!r} (it ended, or never existed)", ErrorCode.CALL_NOT_FOUND.value,
                                param="call_id")
        await call.hangup()
        return Response(status_code=200)


async def _close_quietly(call: Optional[WebRTCCall]) -> None:
    if call is None:
        return
    try:
        await call.driver.aclose()
        await call.pc.close()
    except Exception:
        pass
