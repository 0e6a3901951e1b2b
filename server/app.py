"""The bundled duplexkit server: a FastAPI app factory (docs/protocol.md §1, §10).

Routes: ``/v1/realtime`` and ``/v1/duplex`` (WebSocket, :mod:`duplexkit_server.realtime`),
``/v1/telephony/twilio`` and ``/v1/telephony/telnyx`` (phone media streams, :mod:`duplexkit_server.telephony`),
``POST /v1/realtime/calls`` (WebRTC, :mod:`duplexkit_server.webrtc`),
``POST /v1/chat/completions`` (:mod:`duplexkit_server.chat`), ``GET /v1/models``, ``GET /health``,
the probes ``GET /ready`` and ``GET /live`` (:mod:`duplexkit_server.lifecycle`), ``GET /metrics``
(:mod:`duplexkit_server.metrics`) and the browser page at ``/`` (``static/index.html``).

One :class:`~duplexkit.engine.api.Engine` is shared by every connection; each WebSocket drives its
own :class:`duplexkit.session.Session`. Realtime sessions and chat requests take slots from one
pool of ``max_sessions``.

Run it with :func:`serve` (``duplexkit serve``, in :mod:`duplexkit_server.lifecycle`) to get the
SIGTERM drain and a graceful shutdown that sends ``session.closed{reason:"shutdown"}`` and close
code 1001 to every open session before uvicorn tears connections down (uvicorn alone would close
them with 1012).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, Response

from .responses import openai_error  # noqa: F401  (re-exported: the routes' error body)

logger = logging.getLogger("duplexkit.server")

__all__ = ["ServerSettings", "ServerState", "SlotPool", "create_app", "serve", "openai_error"]

#: The Hugging Face repo id of MiniCPM-o 4.5: the default model of vLLM-Omni's MiniCPM-o clients,
#: served by every engine (they all speak for this model) and listed by ``/v1/models``.
HF_REPO_ID = "openbmb/MiniCPM-o-4_5"
#: Prefixes of OpenAI model ids mapped to the served model (ServerSettings.openai_model_ids).
OPENAI_MODEL_PREFIXES = ("gpt-realtime", "gpt-4o")

STATIC_DIR = Path(__file__).resolve().parent / "static"


@dataclass
class ServerSettings:
    """Server options (each maps to a ``duplexkit serve`` flag).

    Attributes:
        model_id: the served id (default: the engine's ``model_id``).
        aliases: other accepted ids, each listed by ``/v1/models`` (docs/protocol.md §10.2).
        openai_model_ids: what a request naming an OpenAI model (``gpt-realtime*``, ``gpt-4o*``)
            gets: ``"map"`` (default) serves it with this model and logs the mapping once per id;
            ``"refuse"`` answers ``model_not_found`` listing the served ids (docs/server.md, "Model ids").
        api_keys: accepted keys; empty = auth off (docs/protocol.md §1.4). ``DUPLEXKIT_API_KEY`` adds one.
        max_sessions: slot pool size shared by realtime sessions and chat requests.
        max_event_bytes: largest client event accepted (docs/protocol.md §1.3, default 16 MiB); the
            transport limit (uvicorn ``ws_max_size``) is set to twice this.
        idle_timeout_s: close a session with no client event for this long (docs/protocol.md §1.5).
        ping_interval_s: WebSocket ping period in seconds (uvicorn ``ws_ping_interval``).
        max_pending_input_s: input backpressure threshold in seconds (docs/protocol.md §6.1).
        silence_slack_ms: grace after a unit deadline before silence is fed to an active response, ms.
        max_ref_audio_s: longest reference voice accepted in seconds (docs/protocol.md §8).
        max_input_audio_s: longest chat-completions input audio in seconds (docs/protocol.md §10.1).
        ref_audio_dir: allow-listed directory for reference-voice paths (None: paths refused).
        max_output_tokens: the default per-response token cap, 1..8192 or ``"inf"`` (docs/protocol.md §4.1).
        answer_policy: default ``extra_body.answer_policy`` (None: the profile default);
            ``duplexkit serve tiny`` sets ``on_request`` because random weights never listen.
        default_input_rate: the duplex profile's bare-``pcm16`` rate in Hz.
        default_instructions: the default system prompt (None: the model default).
        default_voice: a WAV used as the default reference voice (None: the engine's own).
        voices: voice name -> WAV path, selectable with ``session.voice`` (docs/protocol.md §8.5).
        tick_interval_s: how often the shell calls ``Session.tick`` (idle timeout, silence feeding).
        retry_after_s: ``Retry-After`` seconds on HTTP 503 (capacity exhausted).
        shutdown_grace_s: how long shutdown waits for ``session.closed`` to be sent.
        drain_s: on SIGTERM, how long live sessions may go on (new ones refused) before they are
            closed with ``session.closed{reason:"shutdown"}`` (``--drain-s``, default 300 s;
            docs/deployment.md, "Runbook").
        metrics: ``GET /metrics``: ``"auth"`` (default; the API key is required when keys are set),
            ``"public"`` (no key) or ``"off"`` (no route). See :mod:`duplexkit_server.metrics`.
        allow_origins: browser origins allowed besides the server's own (``--allow-origin``;
            ``"*"`` = any). See :mod:`duplexkit_server.security`.
        bind_host: the listening address, set by :func:`serve` (None: loopback, as in-process).
        bind_port: the listening port, set by :func:`serve` (None: any loopback port is "own").
        max_body_bytes: largest HTTP request body (default 16 MiB); larger -> 413 before it is read.
        max_sessions_per_client: slots one client may hold (keyed by API key when auth is on, else by
            address); None = half of ``max_sessions`` (at least 1), 0 = no limit.
        header_timeout_s: a connection whose HTTP request head is incomplete after this long is closed.
        max_header_bytes: largest HTTP request head (request line and headers, WebSocket handshakes
            included), bytes; a larger one is answered 431 before more of it is parsed (default 64 KiB).
        body_timeout_s: a chat-completions body not fully received this long after its slot was
            taken is answered 408 ``request_timeout`` (slow bodies), seconds.
        slot_wait_s: how long a new session or chat request that finds every slot (or its client's
            share) taken waits for one being given back before it is refused, seconds.
        max_outbound_bytes / outbound_stall_s: bounds of each WebSocket's outbound queue (server
            events not yet written to a peer that reads slowly or not at all): over ``max_outbound_bytes``
            queued, or an event unsent for ``outbound_stall_s``, the session is closed with 1008
            ``peer not reading`` (docs/server.md, "Limits").
        session_resume: offer session resume (``capabilities.supports_session_resume``; docs/protocol.md §1.6).
        resume_window_s: how long a session whose connection dropped waits for a ``session.resume``, s.
        resume_journal_events / resume_journal_bytes: bounds of each session's replay journal (events,
            bytes of the events' string fields + 256 per event; :mod:`duplexkit_server.resume`).
        resume_keep_sent_s: while connected, events written to the socket are kept in the journal for
            this long (what a dropped connection may have lost in flight); ``session.event_ack`` trims
            sooner.
        tool_model_url: base URL of an OpenAI-compatible chat endpoint (``.../v1``) that decides tool
            calls and writes answers instead of the thinker in text mode (``--tool-model``;
            docs/tools.md, "Delegation"); None = the engine's own decider.
        tool_model_key: its API key (``--tool-model-key``; ``DUPLEXKIT_TOOL_MODEL_KEY`` when unset).
        tool_model_name: the ``model`` sent to it (``--tool-model-name``; None = the endpoint's default).
        replica_id: this replica's identity when it is one of many (set by
            :mod:`duplexkit_server.ray_serve` from Ray Serve's replica context); reported as
            ``replica`` by ``/health`` and ``/ready`` and in the ``x-duplexkit-replica`` response and
            WebSocket-handshake header. None: not reported.
        telephony_webhook: URL POSTed each phone call's start metadata; its JSON answer is applied as
            session settings (``--telephony-webhook``; docs/telephony.md, "Webhook"). None: off.
        telephony_webhook_timeout_s: how long a call waits for that answer before it goes on with the
            defaults, seconds.
        record_dir: record realtime sessions into ``DIR/<session_id>/`` (``--record``;
            :mod:`duplexkit.recording`, docs/debugging.md). None: off.
        record_policy: ``"all"`` (every session; ``?record=0`` opts out), ``"opt-in"`` (only sessions
            connecting with ``?record=1``) or ``"always"`` (every session; ``?record=0`` is refused).
        record_max_mb: per-session recording cap in MiB (events + audio).
        record_keep: retention, ``"N"`` newest recordings or ``"Nd"`` days (None: keep all).
    """

    model_id: Optional[str] = None
    aliases: list[str] = field(default_factory=list)
    openai_model_ids: str = "map"
    api_keys: list[str] = field(default_factory=list)
    max_sessions: int = 8
    max_event_bytes: int = 16 * 1024 * 1024
    idle_timeout_s: float = 300.0
    ping_interval_s: float = 20.0
    max_pending_input_s: float = 10.0
    silence_slack_ms: int = 250
    max_ref_audio_s: float = 30.0
    max_input_audio_s: float = 60.0
    ref_audio_dir: Optional[Path] = None
    max_output_tokens: Union[int, str, None] = 1024
    answer_policy: Optional[str] = None
    default_input_rate: int = 16_000
    default_instructions: Optional[str] = None
    default_voice: Optional[Path] = None
    voices: dict = field(default_factory=dict)
    tick_interval_s: float = 0.1
    retry_after_s: int = 1
    shutdown_grace_s: float = 5.0
    drain_s: float = 300.0
    metrics: str = "auth"
    allow_origins: list[str] = field(default_factory=list)
    bind_host: Optional[str] = None
    bind_port: Optional[int] = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_sessions_per_client: Optional[int] = None
    header_timeout_s: float = 10.0
    session_resume: bool = True
    resume_window_s: float = 30.0
    resume_journal_events: int = 4096
    resume_journal_bytes: int = 4 * 1024 * 1024
    replica_id: Optional[str] = None
    tool_model_url: Optional[str] = None
    tool_model_key: Optional[str] = None
    tool_model_name: Optional[str] = None
    slot_wait_s: float = 1.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    max_outbound_bytes: int = 8 * 1024 * 1024
    outbound_stall_s: float = 30.0
    resume_keep_sent_s: float = 10.0
    telephony_webhook: Optional[str] = None
    telephony_webhook_timeout_s: float = 3.0
    record_dir: Optional[Path] = None
    record_policy: str = "all"
    record_max_mb: float = 100.0
    record_keep: Optional[str] = None

    def __post_init__(self) -> None:
        env_key = os.environ.get("DUPLEXKIT_API_KEY")
        if env_key and env_key not in self.api_keys:
            self.api_keys = [*self.api_keys, env_key]
        if self.ref_audio_dir is not None:
            self.ref_audio_dir = Path(self.ref_audio_dir).resolve()


class SlotPool:
    """A counting pool of session slots, with an optional per-client cap.

    Args:
        size: slots in all (``max_sessions``).
        per_client: slots one client may hold at once; 0 = no cap. A client is any hashable id
            (the server uses ``("key", api_key)`` with auth on, else ``("addr", ip)``).

    :meth:`try_acquire` never waits; :meth:`acquire` waits up to ``wait_s`` for a slot that is being
    given back while some holder is :attr:`ending` (a session whose peer closed its socket a moment
    ago, not yet torn down), so a client that opens its next session right after its previous one
    closed is never refused for a slot about to be free. With no holder ending it refuses at once.

    A slot may leave its client's share while it stays in use (:meth:`leave_share`): a parked
    session, whose connection dropped, keeps its slot in the pool but no longer counts against
    ``per_client``.
    """

    def __init__(self, size: int, per_client: int = 0) -> None:
        if size < 1:
            raise ValueError("max_sessions must be >= 1")
        if per_client < 0:
            raise ValueError("max_sessions_per_client must be >= 0")
        self.size = size
        self.per_client = per_client
        self.used = 0
        self.by_client: dict = {}
        #: slots whose holder is ending (they are about to be released); see :meth:`acquire`
        self.ending = 0
        self._freed: Optional[asyncio.Event] = None  # set (and replaced) on each release

    def client_full(self, client=None) -> bool:
        """Whether ``client`` already holds its share of slots."""
        return bool(self.per_client) and client is not None and self.by_client.get(client, 0) >= self.per_client

    def try_acquire(self, client=None) -> bool:
        if self.used >= self.size or self.client_full(client):
            return False
        self.used += 1
        if client is not None:
            self.by_client[client] = self.by_client.get(client, 0) + 1
        return True

    async def acquire(self, client=None, wait_s: float = 0.0) -> bool:
        """:meth:`try_acquire`, waiting up to ``wait_s`` seconds for a release when it fails while a
        holder is :attr:`ending`."""
        if self.try_acquire(client):
            return True
        if wait_s <= 0:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            left = deadline - loop.time()
            if left <= 0 or self.ending <= 0:
                return False
            if self._freed is None:
                self._freed = asyncio.Event()
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except asyncio.TimeoutError:
                return self.try_acquire(client)
            if self.try_acquire(client):
                return True

    def leave_share(self, client=None) -> None:
        """A held slot stops counting against ``client``'s share (it stays in use in the pool)."""
        self._uncount(client)

    def join_share(self, client=None) -> None:
        """A held slot counts against ``client``'s share again (even above it: never refused)."""
        if client is not None:
            self.by_client[client] = self.by_client.get(client, 0) + 1

    def _uncount(self, client) -> None:
        if client is not None and client in self.by_client:
            n = self.by_client[client] - 1
            if n > 0:
                self.by_client[client] = n
            else:
                del self.by_client[client]

    def release(self, client=None) -> None:
        self.used = max(0, self.used - 1)
        self._uncount(client)
        freed, self._freed = self._freed, None
        if freed is not None:
            freed.set()


def load_reference_voice(path, max_s: float = 30.0):
    """A server-side voice file -> :class:`duplexkit.engine.api.ReferenceVoice` (docs/protocol.md §8.3:
    mono, 16 kHz, trimmed to whole 100 ms; 0.5 s to ``max_s`` long).

    Raises ``FileNotFoundError``; ``ValueError`` for a clip out of range or undecodable.
    """
    import hashlib

    import numpy as np

    from duplexkit.audio import read_wav
    from duplexkit.engine.api import ReferenceVoice

    audio, _ = read_wav(Path(path), 16_000)
    n = (len(audio) // 1600) * 1600
    if n < 8000 or len(audio) > max_s * 16_000:
        raise ValueError(f"reference voice {path} must last 0.5-{max_s:g} s, got {len(audio) / 16000:.2f} s")
    a = np.ascontiguousarray(audio[:n], dtype=np.float32)
    return ReferenceVoice(audio=a, sha256=hashlib.sha256(a.tobytes()).hexdigest())


class ServerState:
    """What every route shares: the engine, the settings, the slot pool and open connections."""

    def __init__(self, settings: ServerSettings, engine=None,
                 engine_loader: Optional[Callable[[], Any]] = None) -> None:
        self.settings = settings
        self.engine = engine
        self.engine_loader = engine_loader
        self.load_error: Optional[BaseException] = None
        per_client = settings.max_sessions_per_client
        if per_client is None:
            per_client = max(1, settings.max_sessions // 2)
        self.slots = SlotPool(settings.max_sessions, per_client)
        self.connections: set = set()
        from .resume import ResumeRegistry  # session resume (docs/protocol.md §1.6); None when off

        self.resumes = ResumeRegistry(settings.resume_window_s, settings.resume_journal_events,
                                      settings.resume_journal_bytes, settings.resume_keep_sent_s) \
            if settings.session_resume else None
        # counters of finished realtime sessions; open ones are added by :meth:`counters`
        self._closed_counts = {"sessions_opened": 0, "input_appends": 0, "input_audio_ms": 0}
        self.shutting_down = False
        self.draining = False  # SIGTERM received: /ready 503 (duplexkit_server.lifecycle.drain)
        self.metrics = None  # duplexkit_server.metrics.ServerMetrics (None: --metrics off)
        self._mapped_models: set[str] = set()
        self.started_at = int(time.time())
        self._load_task: Optional[asyncio.Task] = None
        self.on_load_error: Optional[Callable[[BaseException], None]] = None
        self.default_voice = load_reference_voice(settings.default_voice, settings.max_ref_audio_s) \
            if settings.default_voice else None
        self._tool_decider: Any = None  # the shared --tool-model decider, made on first use
        self.voices = {name: load_reference_voice(path, settings.max_ref_audio_s)
                       for name, path in (settings.voices or {}).items()}

    # -- identity ----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.shutting_down and self.engine_failure is None

    @property
    def engine_failure(self) -> Optional[str]:
        """Why a loaded engine can no longer serve (an engine process that died:
        :attr:`duplexkit.engine.process.EngineProcess.failure`); None while it serves."""
        return getattr(self.engine, "failure", None) if self.engine is not None else None

    @property
    def model_id(self) -> str:
        if self.settings.model_id:
            return self.settings.model_id
        return getattr(self.engine, "model_id", None) or "duplexkit"

    @property
    def model_ids(self) -> list[str]:
        ids = [self.model_id]
        for a in [*self.settings.aliases, HF_REPO_ID]:
            if a not in ids:
                ids.append(a)
        engine_id = getattr(self.engine, "model_id", None)
        if engine_id and engine_id not in ids:
            ids.append(engine_id)
        return ids

    def accepts_model(self, model: Optional[str]) -> bool:
        """Whether a request's ``model`` is served (see :meth:`resolve_model`)."""
        return self.resolve_model(model) is not None

    def resolve_model(self, model: Optional[str]) -> Optional[str]:
        """The served id a request's ``model`` maps to, or None when it is refused.

        Served: no model, any of :attr:`model_ids` (the served id, the Hugging Face repo id
        ``openbmb/MiniCPM-o-4_5``, ``--alias`` ids, the engine's id). An OpenAI model id
        (``gpt-realtime*``, ``gpt-4o*``: what unmodified OpenAI clients send) maps to the served id
        when ``settings.openai_model_ids == "map"``, logged once per id; anything else is refused.
        """
        if model is None or model == "" or model in self.model_ids:
            return self.model_id
        if self.settings.openai_model_ids == "map" and model.startswith(OPENAI_MODEL_PREFIXES):
            if model not in self._mapped_models:
                self._mapped_models.add(model)
                logger.info("model %r is an OpenAI model id: served by %r", model, self.model_id)
            return self.model_id
        return None

    def unknown_model_message(self, model: Optional[str]) -> str:
        """The ``model_not_found`` message: names the refused id and lists the served ones."""
        hint = ("; OpenAI model ids are refused by this server (--openai-model-ids refuse)"
                if isinstance(model, str) and model.startswith(OPENAI_MODEL_PREFIXES) else "")
        return f"model {model!r} is not served; served ids: {', '.join(self.model_ids)}{hint}"

    # -- counters -------------------------------------------------------------------------------
    def session_closed(self, session) -> None:
        """Fold a finished realtime :class:`duplexkit.session.Session` into the totals."""
        c = self._closed_counts
        c["sessions_opened"] += 1
        c["input_appends"] += session.input_appends
        c["input_audio_ms"] += session.input_audio_ms

    def counters(self) -> dict:
        """Read-only totals since start (``/health``): ``sessions_open`` (realtime sessions that exist
        now, parked ones included: the :attr:`connections` set), ``sessions_opened`` (all created so
        far), ``input_appends`` (accepted ``input_audio_buffer.append`` events) and ``input_audio_ms``
        (input audio they carried, ms). ``sessions_open`` is not ``/health``'s ``sessions_active``
        (:attr:`slots` in use), which also counts chat-completions requests in progress and
        ``autostart=0`` sockets awaiting their first frame (docs/server.md, ``/health``)."""
        out = dict(self._closed_counts)
        conns = list(self.connections)
        out["sessions_open"] = len(conns)
        out["sessions_opened"] += len(conns)
        for conn in conns:
            out["input_appends"] += conn.session.input_appends
            out["input_audio_ms"] += conn.session.input_audio_ms
        return out

    def client_id(self, key: Optional[str], scope: dict):
        """Who holds a slot, for ``max_sessions_per_client``: the API key when auth is on, else the
        peer address (uvicorn resolves ``X-Forwarded-For`` from ``--forwarded-allow-ips`` proxies)."""
        if self.settings.api_keys and key:
            return ("key", key)
        client = scope.get("client")
        return ("addr", client[0]) if client else None

    def capacity_message(self, client) -> str:
        if self.slots.client_full(client):
            return (f"this client already holds {self.slots.per_client} session(s), the per-client limit "
                    "(--max-sessions-per-client)")
        return f"all {self.slots.size} session slots are in use"

    # -- auth ---------------------------------------------------------------------------------
    def check_key(self, key: Optional[str]) -> bool:
        keys = self.settings.api_keys
        if not keys:
            return True
        if not key:
            return False
        return any(hmac.compare_digest(key.encode(), k.encode()) for k in keys)

    @staticmethod
    def bearer(header: Optional[str]) -> Optional[str]:
        if not header:
            return None
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return value.strip() or None

    # -- reference voice ------------------------------------------------------------------------
    def load_ref_audio_path(self, path: str) -> bytes:
        """The Session's ``ref_audio_loader``: bytes of an allow-listed local file (docs/protocol.md §8.1).

        Raises ``PermissionError`` when no ``ref_audio_dir`` is configured or the real path lies
        outside it, ``FileNotFoundError`` when it does not exist.
        """
        root = self.settings.ref_audio_dir
        if root is None:
            raise PermissionError("reference-voice paths are disabled (no --ref-audio-dir)")
        if path.startswith("file://"):
            path = path[len("file://"):]
        try:
            real = Path(path).resolve()
        except (ValueError, OSError):
            raise PermissionError(f"{path[:200]!r} is not a usable path") from None
        if not real.is_relative_to(root):
            raise PermissionError(f"{path[:200]!r} is outside the allowed reference-voice directory")
        try:  # messages name the client's path only, never the server's absolute one
            if not real.is_file():
                raise FileNotFoundError(f"{path[:200]!r} does not exist")
            if real.stat().st_size > self.settings.max_body_bytes:
                raise PermissionError(f"{path[:200]!r} is larger than {self.settings.max_body_bytes} bytes")
            return real.read_bytes()
        except OSError as exc:
            if isinstance(exc, (FileNotFoundError, PermissionError)) and str(path)[:200] in str(exc):
                raise
            raise PermissionError(f"{path[:200]!r} cannot be read") from None

    # -- loading --------------------------------------------------------------------------------
    async def load(self) -> None:
        if self.engine is not None or self.engine_loader is None:
            return
        try:
            self.engine = await _in_daemon_thread(self.engine_loader, "duplexkit-engine-loader")
            logger.info("engine ready: %s", getattr(self.engine, "model_id", "?"))
        except asyncio.CancelledError:  # the server is stopping (Ctrl+C, SIGTERM) while it loads
            logger.warning("engine loading interrupted: the server is shutting down")
            raise
        except BaseException as exc:  # surfaced by /health
            self.load_error = exc
            debug = os.environ.get("DUPLEXKIT_DEBUG", "") not in ("", "0")
            if self.on_load_error is not None:  # e.g. `duplexkit serve` prints one error line and exits 1
                if debug:
                    logger.error("engine failed to load", exc_info=exc)
                self.on_load_error(exc)
            else:
                logger.error("engine failed to load: %s: %s", type(exc).__name__, exc, exc_info=exc if debug else None)

    # -- shutdown -----------------------------------------------------------------------------
    async def shutdown_sessions(self, reason: str = "shutdown") -> None:
        """Send ``session.closed{reason}`` and close 1001 on every open session (docs/protocol.md §1.5)."""
        self.shutting_down = True
        conns = list(self.connections)
        if not conns:
            return
        await asyncio.wait([asyncio.ensure_future(c.shutdown(reason)) for c in conns],
                           timeout=self.settings.shutdown_grace_s)

    @property
    def tool_decider(self) -> Any:
        """The decider every realtime session uses: None = the engine's own (each session's driver
        makes an :class:`~duplexkit.agent.decider.EngineToolDecider`), else one shared
        :class:`~duplexkit.agent.decider.ChatEndpointToolDecider` for ``--tool-model``."""
        s = self.settings
        if s.tool_model_url is None:
            return None
        if self._tool_decider is None:
            from duplexkit.agent.decider import ChatEndpointToolDecider

            key = s.tool_model_key or os.environ.get("DUPLEXKIT_TOOL_MODEL_KEY")
            self._tool_decider = ChatEndpointToolDecider(s.tool_model_url, api_key=key, model=s.tool_model_name)
        return self._tool_decider

    async def aclose(self) -> None:
        await self.shutdown_sessions()
        if self._tool_decider is not None:
            try:
                await self._tool_decider.aclose()
            except Exception:  # pragma: no cover
                logger.exception("closing the tool decider failed")
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self.engine is not None:
            try:
                await self.engine.aclose()
            except Exception:  # pragma: no cover
                logger.exception("engine close failed")


async def _in_daemon_thread(fn: Callable[[], Any], name: str) -> Any:
    """``await`` ``fn()`` run on a daemon thread: unlike ``asyncio.to_thread`` (whose executor thread
    the interpreter joins at exit), a server stopped while a model loads exits at once instead of
    finishing the load first. Cancelling the await leaves the thread to finish on its own."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(value: Any, exc: Optional[BaseException]) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(value)

    def run() -> None:
        try:
            value, exc = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            value, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await fut


def create_app(engine=None, settings: Optional[ServerSettings] = None, *,
               engine_loader: Optional[Callable[[], Any]] = None) -> FastAPI:
    """Build the FastAPI app.

    Args:
        engine: a ready :class:`~duplexkit.engine.api.Engine` (e.g. ``DuplexEngine`` or
            ``ScriptedEngine``), or None together with ``engine_loader``.
        settings: :class:`ServerSettings` (defaults when None).
        engine_loader: a blocking zero-argument callable returning the engine; it runs in a
            worker thread at startup while ``/health`` answers 503 ``loading``.

    Raises:
        ValueError: neither ``engine`` nor ``engine_loader`` was given.
    """
    from contextlib import asynccontextmanager

    from . import chat, realtime

    if engine is None and engine_loader is None:
        raise ValueError("create_app needs an engine or an engine_loader")
    settings = settings or ServerSettings()
    state = ServerState(settings, engine, engine_loader)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.engine is None:
            state._load_task = asyncio.create_task(state.load())
        try:
            yield
        finally:
            await state.aclose()

    app = FastAPI(title="duplexkit", version=_version(), lifespan=lifespan)
    app.state.duplexkit = state
    _install_security(app, state)
    from . import lifecycle, metrics

    lifecycle.install(app, state)
    metrics.install(app, state)

    def http_auth(request: Request) -> Optional[JSONResponse]:
        if state.check_key(state.bearer(request.headers.get("authorization"))):
            return None
        return openai_error(401, "missing or invalid API key", "unauthorized")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if state.load_error is not None:
            return JSONResponse({"status": "error", "error": repr(state.load_error)}, status_code=503)
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if state.engine_failure is not None:
            return JSONResponse({"status": "error", "error": state.engine_failure}, status_code=503)
        if state.shutting_down:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        # sessions_active: slots in use (realtime sessions, chat requests, autostart=0 sockets not yet
        # started), as /ready and the duplexkit_sessions_active gauge; sessions_open (from counters()):
        # realtime sessions only (docs/server.md, "/health")
        return {"status": "ok", "model": state.model_id, "sessions_active": state.slots.used,
                "sessions_max": state.slots.size,
                "random_weights": bool(getattr(state.engine, "random_weights", False)),
                **state.counters(),
                **({"resume_journal_bytes": state.resumes.journal_bytes_total} if state.resumes is not None else {}),
                **({"replica": settings.replica_id} if settings.replica_id else {})}

    @app.get("/v1/models")
    async def models(request: Request):
        if (err := http_auth(request)) is not None:
            return err
        return {"object": "list", "data": [
            {"id": mid, "object": "model", "created": state.started_at, "owned_by": "duplexkit"}
            for mid in state.model_ids]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request):
        # OpenAI's models.retrieve: a listed id, or an OpenAI id this server maps (ServerState.resolve_model)
        if (err := http_auth(request)) is not None:
            return err
        if model_id and state.resolve_model(model_id) is not None:
            return {"id": model_id, "object": "model", "created": state.started_at, "owned_by": "duplexkit"}
        return openai_error(404, f"The model '{model_id[:200]}' does not exist; served ids: "
                                 f"{', '.join(state.model_ids)}", "model_not_found", param="model")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        if (err := http_auth(request)) is not None:
            return err
        return await chat.handle(state, request)

    @app.websocket("/v1/realtime")
    async def ws_realtime(websocket: WebSocket):
        await realtime.handle(state, websocket, force_duplex=False)

    @app.websocket("/v1/duplex")
    async def ws_duplex(websocket: WebSocket):
        await realtime.handle(state, websocket, force_duplex=True)

    from . import telephony

    @app.websocket("/v1/telephony/twilio")
    async def ws_telephony_twilio(websocket: WebSocket):
        await telephony.handle(state, websocket, "twilio")

    @app.websocket("/v1/telephony/telnyx")
    async def ws_telephony_telnyx(websocket: WebSocket):
        await telephony.handle(state, websocket, "telnyx")

    from . import webrtc

    # POST /v1/realtime/calls (WebRTC, docs/webrtc.md); answers 501 without aiortc
    webrtc.install(app, state, http_auth)

    @app.websocket("/{path:path}")
    async def ws_unknown_path(websocket: WebSocket, path: str):
        # Starlette refuses a WebSocket to an unknown path with a bare HTTP 403, which clients read
        # as a refused API key; say 404 and name the endpoints instead
        await realtime.reject_unknown_path(websocket)

    from .security import page_headers, style_hashes

    index_page = STATIC_DIR / "index.html"
    styles = style_hashes(index_page.read_text()) if index_page.exists() else []

    @app.get("/")
    async def index(request: Request):
        if not index_page.exists():
            return Response("duplexkit server: no browser page bundled", media_type="text/plain")
        return FileResponse(index_page, headers=page_headers(request.headers.get("host"), styles))

    @app.get("/static/{name}")
    async def static(name: str, request: Request):
        try:
            page = (STATIC_DIR / name).resolve()
            ok = page.is_relative_to(STATIC_DIR) and page.is_file()
        except (ValueError, OSError):  # NUL bytes, over-long names
            ok = False
        if not ok:
            return Response(status_code=404)
        return FileResponse(page, headers=page_headers(request.headers.get("host"), styles))

    return app


def _install_security(app: FastAPI, state: ServerState) -> None:
    """The Origin/Host policy (:mod:`duplexkit_server.security`) and, for ``--allow-origin``
    entries, CORS answers so that those pages can read HTTP responses."""
    from .security import OriginPolicy, OriginPolicyMiddleware

    s = state.settings
    OriginPolicy(s.allow_origins)  # validate the entries now (ValueError)
    cache: dict = {}

    def policy() -> OriginPolicy:
        key = (tuple(s.allow_origins), s.bind_host, s.bind_port)
        if cache.get("key") != key:
            cache["key"], cache["policy"] = key, OriginPolicy(s.allow_origins, s.bind_host, s.bind_port)
        return cache["policy"]

    if s.allow_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(s.allow_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(OriginPolicyMiddleware, policy=policy)


def _version() -> str:
    try:
        from duplexkit import __version__
        return __version__
    except Exception:  # pragma: no cover
        return "0"


from .lifecycle import serve  # noqa: E402  (re-exported: duplexkit_server.serve)
