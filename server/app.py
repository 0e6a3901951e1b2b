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
from pathlib import Path
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, Response

from duplexkit.errors import ErrorCode
from duplexkit.settings import ServerSettings  # re-exported: duplexkit_server.ServerSettings
from .responses import ServerClosing, openai_error  # noqa: F401  (re-exported: the routes' error body)

logger = logging.getLogger("duplexkit.server")

__all__ = ["ServerSettings", "ServerState", "SlotPool", "create_app", "serve", "openai_error"]

#: The Hugging Face repo id of MiniCPM-o 4.5: the default model of vLLM-Omni's MiniCPM-o clients,
#: served by every engine (they all speak for this model) and listed by ``/v1/models``.
HF_REPO_ID = "openbmb/MiniCPM-o-4_5"
#: Prefixes of OpenAI model ids mapped to the served model (ServerSettings.openai_model_ids).
OPENAI_MODEL_PREFIXES = ("gpt-realtime", "gpt-4o")

STATIC_DIR = Path(__file__).resolve().parent / "static"


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
    from duplexkit.audio import read_wav
    from duplexkit.engine.api import INPUT_SAMPLE_RATE, REF_AUDIO_MIN_S, reference_voice
    from duplexkit.errors import RefAudioLengthError

    audio, _ = read_wav(Path(path), INPUT_SAMPLE_RATE)
    try:
        return reference_voice(audio, max_s)
    except RefAudioLengthError as exc:
        raise ValueError(f"reference voice {path} must last {REF_AUDIO_MIN_S:g}-{max_s:g} s, "
                         f"got {exc.duration_s:.2f} s") from None


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
        self.closing = asyncio.Event()  # the open sessions are being closed (shutdown, after any drain)
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
            self.engine = await _in_daemon_thread(self.engine_loader, "duplexkit-engine-loader",
                                                  cancel=getattr(self.engine_loader, "cancel", None))
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
        """Send ``session.closed{reason}`` and close 1001 on every open session (docs/protocol.md §1.5);
        chat generations in progress end too (:meth:`until_closing`)."""
        self.shutting_down = True
        self.closing.set()
        conns = list(self.connections)
        if not conns:
            return
        await asyncio.wait([asyncio.ensure_future(c.shutdown(reason)) for c in conns],
                           timeout=self.settings.shutdown_grace_s)

    async def until_closing(self, aw: Any) -> Any:
        """``await aw`` (a chat generation), unless the server closes its sessions first (shutdown,
        after any drain): then ``aw`` is cancelled and :class:`ServerClosing` raised, so that the
        request ends with an answer instead of holding the shutdown until uvicorn cancels it."""
        task = asyncio.ensure_future(aw)
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            await asyncio.wait({task, closing}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            closing.cancel()
        if task.done():
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - cancelled on purpose; its outcome no longer matters
            pass
        raise ServerClosing("the server is shutting down")

    async def iter_until_closing(self, agen: Any) -> Any:
        """The items of the async iterator ``agen`` (a streamed chat generation) until the server
        closes its sessions (:meth:`until_closing`): then ``agen`` is closed and :class:`ServerClosing`
        raised."""
        it = agen.__aiter__()
        try:
            while True:
                try:
                    item = await self.until_closing(it.__anext__())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            close = getattr(it, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:  # pragma: no cover - a generator broken by the cancel
                    pass

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
            self._load_task.cancel()  # stops the loader (its cancel()) and waits for it, bounded
            try:
                await self._load_task
            except asyncio.CancelledError:
                pass
        if self.engine is not None:
            try:
                await self.engine.aclose()
            except Exception:  # pragma: no cover
                logger.exception("engine close failed")


LOADER_STOP_S = 10.0
"""How long a cancelled load waits for the loader thread to end after asking it to stop (its
``cancel()``): an engine process is killed at once, an in-process load stops at its next Python
step. A loader without ``cancel()`` is not waited for."""


async def _in_daemon_thread(fn: Callable[[], Any], name: str, *, cancel: Optional[Callable[[], None]] = None) -> Any:
    """``await`` ``fn()`` run on a daemon thread: unlike ``asyncio.to_thread`` (whose executor thread
    the interpreter joins at exit), a server stopped while a model loads exits at once instead of
    finishing the load first. Cancelling the await calls ``cancel()`` (when given; from the loop's
    thread), which must make ``fn`` return or raise soon, and waits up to :data:`LOADER_STOP_S` for
    the thread to end, so that what it started (an engine process) is gone when the server exits;
    without ``cancel`` the thread is left to finish on its own."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()
    ended = asyncio.Event()

    def settle(value: Any, exc: Optional[BaseException]) -> None:
        ended.set()
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
    try:
        return await fut
    except asyncio.CancelledError:
        if cancel is not None:
            try:
                cancel()
                await asyncio.wait_for(ended.wait(), LOADER_STOP_S)
            except asyncio.TimeoutError:
                logger.warning("the engine loader did not stop within %g s of its cancel()", LOADER_STOP_S)
            except Exception:  # pragma: no cover - a broken cancel hook must not break the shutdown
                logger.exception("stopping the engine loader failed")
        raise


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
        return openai_error(401, "missing or invalid API key", ErrorCode.UNAUTHORIZED.value)

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

    def model_object(mid: str) -> dict:
        # OpenAI's Model object plus ``random_weights`` (docs/protocol.md §10.2): every id of a
        # random-weight engine ('tiny'), the Hugging Face repo id included, says so
        return {"id": mid, "object": "model", "created": state.started_at, "owned_by": "duplexkit",
                "random_weights": bool(getattr(state.engine, "random_weights", False))}

    @app.get("/v1/models")
    async def models(request: Request):
        if (err := http_auth(request)) is not None:
            return err
        return {"object": "list", "data": [model_object(mid) for mid in state.model_ids]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request):
        # OpenAI's models.retrieve: a listed id, or an OpenAI id this server maps (ServerState.resolve_model)
        if (err := http_auth(request)) is not None:
            return err
        if model_id and state.resolve_model(model_id) is not None:
            return model_object(model_id)
        return openai_error(404, f"The model '{model_id[:200]}' does not exist; served ids: "
                                 f"{', '.join(state.model_ids)}", ErrorCode.MODEL_NOT_FOUND.value, param="model")

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
