"""The bundled server's settings, defined once: :class:`ServerSettings` (a pydantic dataclass: its
field types are validated on construction, and each option's bounds and choices too).

Each field that ``duplexkit serve`` exposes is declared with :func:`option`, which keeps the option's
help, flag spelling, bounds and choices beside the field's type and default; ``duplexkit serve``
builds its argparse options from :func:`cli_options` and the settings call from the parsed values
(duplexkit/cli/serve.py), so an option is written once. The module is light (no FastAPI, no
server package) because the CLI builds every subcommand's parser before it runs one.
``duplexkit_server.ServerSettings`` is this class.
"""

from __future__ import annotations

import os
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass

from duplexkit.engine.api import SILENCE_SLACK_MS

__all__ = ["ServerSettings", "CliOption", "option", "cli_options"]

KiB, MiB = 2**10, 2**20


@dataclass(frozen=True)
class CliOption:
    """How a :class:`ServerSettings` field appears on ``duplexkit serve``.

    Attributes:
        help: the option's help text (``duplexkit serve --help``).
        group: the part of the command it belongs to (``server``, ``hardening``, ``tools``,
            ``telephony``, ``record``): the CLI adds each group where its options belong.
        flag: the option string when it is not ``--`` + the field name with ``-`` for ``_``; a
            ``--no-...`` flag on a ``bool`` field turns it off.
        ge / gt / le: bounds of an ``int`` or ``float`` value (checked when the command line is parsed).
        choices: the accepted values of a ``str`` field.
        metavar: the value's name in the help.
        syntax: a value written in its own syntax, parsed by the CLI: ``duration`` (seconds, or a number
            with s/m/h), ``http_url``, ``retention`` (``N`` or ``Nd``), ``name=path`` (repeatable
            ``NAME=PATH`` pairs into a dict).
    """

    help: str
    group: str = "server"
    flag: Optional[str] = None
    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    choices: Optional[tuple] = None
    metavar: Optional[str] = None
    syntax: Optional[str] = None


def option(default: Any = MISSING, *, default_factory: Any = MISSING, help: str, **cli: Any) -> Any:
    """A :class:`ServerSettings` field that is also a ``duplexkit serve`` option (:class:`CliOption`)."""
    meta = {"cli": CliOption(help=help, **cli)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@pydantic_dataclass(config=ConfigDict(arbitrary_types_allowed=True))
class ServerSettings:
    """Server options. A field made with :func:`option` is also a ``duplexkit serve`` option, generated
    from it (name, type, default, bounds, choices, help: :func:`cli_options`).

    Attributes:
        model_id: the served id (default: the engine's ``model_id``).
        aliases: other accepted ids, each listed by ``/v1/models`` (docs/protocol.md §10.2).
        openai_model_ids: what a request naming an OpenAI model (``gpt-realtime*``, ``gpt-4o*``)
            gets: ``"map"`` (default) serves it with this model and logs the mapping once per id;
            ``"refuse"`` answers ``model_not_found`` listing the served ids (docs/server.md, "Model ids").
        api_keys: accepted keys; empty = auth off (docs/protocol.md §1.4). ``DUPLEXKIT_API_KEY`` adds one.
        max_sessions: slot pool size shared by realtime sessions and chat requests.
        memory_gib: a device memory budget in GiB (``--memory``): the engine is built to the memory
            plan for it (:mod:`duplexkit.engine.memory_plan`: stream slots, KV positions, graph rows;
            on CUDA the process is capped at it) and ``max_sessions`` is capped at the planned streams
            (``duplexkit serve`` does both). None: the layout's sizes.
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
        shutdown_grace_s: seconds shutdown waits for ``session.closed`` and close 1001 to be sent and
            for the clients' close frames in reply (docs/server.md, "Graceful shutdown").
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

    model_id: Optional[str] = option(None, flag="--served-model-name",
                                     help="model id reported to clients (default: the engine's)")
    aliases: list[str] = option(default_factory=list, flag="--alias",
                                help="another accepted model id (repeatable)")
    openai_model_ids: str = option("map", choices=("map", "refuse"),
                                   help="gpt-realtime*/gpt-4o* model ids: serve them with this model, logged (map, "
                                        "default) or refuse them with model_not_found")
    api_keys: list[str] = option(default_factory=list, flag="--api-key",
                                 help="accepted API key (repeatable; also $DUPLEXKIT_API_KEY); none = auth off")
    max_sessions: int = option(8, ge=1, help="session slots shared by realtime sessions and chat requests (default 8)")
    memory_gib: Optional[float] = option(None, flag="--memory", metavar="GIB", gt=0,
                                         help="device memory budget in GiB: KV slots, graphs and caches are sized to "
                                              "fit it, the GPU process is capped at it, and --max-sessions is capped at "
                                              "the planned streams; refused with the plan's table when the model does "
                                              "not fit (see `duplexkit plan-memory`; default: the layout's sizes)")
    max_event_bytes: int = option(16 * MiB, ge=1024,
                                  help="largest client event in bytes (default 16 MiB; frames over twice this close "
                                       "with 1009)")
    idle_timeout_s: float = option(300.0, gt=0,
                                   help="close sessions without client events after this many s (default 300)")
    ping_interval_s: float = option(20.0, gt=0, help="WebSocket ping period in s (default 20)")
    max_pending_input_s: float = option(10.0, gt=0,
                                        help="unconsumed input before input_backpressure, in s (default 10)")
    silence_slack_ms: int = option(SILENCE_SLACK_MS, ge=0, le=3_600_000,
                                   help="grace after a unit deadline before silence is fed to an active response, ms "
                                        f"(default {SILENCE_SLACK_MS})")
    max_ref_audio_s: float = option(30.0, ge=0.5, help="longest reference voice in s (default 30)")
    max_input_audio_s: float = option(60.0, gt=0, help="longest chat-completions input audio in s (default 60)")
    ref_audio_dir: Optional[Path] = option(None, help="directory whose files may be named as ref_audio paths "
                                                      "(default: paths refused)")
    max_output_tokens: Union[int, str, None] = 1024
    answer_policy: Optional[str] = None
    default_input_rate: int = option(16_000, ge=8000, le=48000,
                                     help="rate of a bare 'pcm16' input format in the duplex profile, Hz (default 16000)")
    default_instructions: Optional[str] = option(None, flag="--instructions",
                                                 help="default system prompt (default: the model's own)")
    default_voice: Optional[Path] = option(None, metavar="WAV", help="default reference voice clip, 0.5-30 s "
                                                                     "(default: the checkpoint's bundled voice)")
    voices: dict = option(default_factory=dict, flag="--voice", metavar="NAME=WAV", syntax="name=path",
                          help="register a named voice selectable with session.voice (repeatable)")
    tick_interval_s: float = 0.1
    retry_after_s: int = 1
    shutdown_grace_s: float = 5.0
    drain_s: float = option(300.0, group="hardening", syntax="duration", metavar="DURATION",
                            help="on SIGTERM, let live sessions go on this long (new ones refused, /ready 503) before "
                                 "closing them with session.closed{shutdown}: seconds, or 10m / 1h (default 300; "
                                 "SIGINT or a second signal closes at once)")
    metrics: str = option("auth", group="hardening", choices=("auth", "public", "off"),
                          help="GET /metrics (Prometheus): auth = needs the API key when keys are set (default), "
                               "public = no key (scrapers on a private network), off = no route")
    allow_origins: list[str] = option(default_factory=list, group="hardening", flag="--allow-origin", metavar="ORIGIN",
                                      help="browser origin allowed to open sessions and POST, e.g. "
                                           "https://app.example.com (repeatable; '*' = any; default: the server's own "
                                           "origin only)")
    bind_host: Optional[str] = None
    bind_port: Optional[int] = None
    max_body_bytes: int = option(16 * MiB, group="hardening", ge=1024,
                                 help="largest HTTP request body in bytes (default 16 MiB; larger: HTTP 413)")
    max_sessions_per_client: Optional[int] = option(None, group="hardening", ge=0,
                                                    help="slots one client (API key, or address when auth is off) may "
                                                         "hold; 0 = no limit (default: half of --max-sessions, at "
                                                         "least 1)")
    header_timeout_s: float = option(10.0, group="hardening", gt=0,
                                     help="close a connection whose request head is not complete after this many s "
                                          "(default 10)")
    session_resume: bool = option(True, group="hardening", flag="--no-session-resume",
                                  help="do not offer session resume (capabilities.supports_session_resume: false)")
    resume_window_s: float = option(30.0, group="hardening", gt=0,
                                    help="how long a session whose connection dropped waits for session.resume, s "
                                         "(default 30)")
    resume_journal_events: int = option(4096, group="hardening", ge=1,
                                        help="server events kept per session for replay on resume (default 4096)")
    resume_journal_bytes: int = option(4 * MiB, group="hardening", ge=1024,
                                       help="bytes of server events kept per session for replay on resume "
                                            "(default 4 MiB)")
    replica_id: Optional[str] = None
    tool_model_url: Optional[str] = option(None, group="tools", flag="--tool-model", metavar="URL", syntax="http_url",
                                           help="an OpenAI-compatible chat endpoint (e.g. http://host:8001/v1) that "
                                                "decides tool calls and writes tool answers, instead of this model's "
                                                "thinker in text mode (default)")
    tool_model_key: Optional[str] = option(None, group="tools", metavar="KEY",
                                           help="API key for --tool-model (default: $DUPLEXKIT_TOOL_MODEL_KEY)")
    tool_model_name: Optional[str] = option(None, group="tools", metavar="NAME",
                                            help="the model name sent to --tool-model (default: the endpoint's own "
                                                 "default)")
    slot_wait_s: float = option(1.0, group="hardening", ge=0,
                                help="how long a new session or chat request waits for a slot that an ending session "
                                     "is giving back before it is refused, s (default 1)")
    body_timeout_s: float = option(30.0, group="hardening", gt=0,
                                   help="a chat request body not complete this many s after its slot was taken gets "
                                        "HTTP 408 (default 30)")
    max_header_bytes: int = option(64 * KiB, group="hardening", ge=1024,
                                   help="largest HTTP request head (request line + headers, WebSocket handshakes too) "
                                        "in bytes (default 64 KiB; larger: HTTP 431)")
    max_outbound_bytes: int = option(8 * MiB, group="hardening", ge=64 * KiB,
                                     help="server events queued for a WebSocket peer that does not read, in bytes, "
                                          "before the session is closed with 1008 (default 8 MiB)")
    outbound_stall_s: float = option(30.0, group="hardening", gt=0,
                                     help="close a session (1008) whose peer has not taken a queued event for this "
                                          "many s (default 30)")
    resume_keep_sent_s: float = option(10.0, group="hardening", ge=0,
                                       help="while connected, how long events already written to the socket stay in "
                                            "the resume journal, s (default 10; session.event_ack trims sooner)")
    telephony_webhook: Optional[str] = option(None, group="telephony", metavar="URL", syntax="http_url",
                                              help="POST each phone call's start metadata (provider, call id, from, "
                                                   "to, custom parameters) to URL; its JSON answer "
                                                   "({\"session\": {...}}) sets that call's session (instructions, "
                                                   "voice, tools...); a failure keeps the defaults")
    telephony_webhook_timeout_s: float = option(3.0, group="telephony", gt=0, metavar="S",
                                                help="how long a call waits for the webhook's answer (default 3 s)")
    record_dir: Optional[Path] = option(None, group="record", flag="--record", metavar="DIR",
                                        help="record realtime sessions into DIR/<session_id>/ (audio, events, "
                                             "transcripts, meta; view with `duplexkit replay DIR`); default off")
    record_policy: str = option("all", group="record", choices=("all", "opt-in", "always"),
                                help="which sessions --record records: all (default; a client may opt out with "
                                     "?record=0), opt-in (only ?record=1), always (?record=0 is refused)")
    record_max_mb: float = option(100.0, group="record", gt=0, metavar="MB",
                                  help="per-session recording cap in MiB, events + audio (default 100); over it "
                                       "recording stops")
    record_keep: Optional[str] = option(None, group="record", metavar="N|Nd", syntax="retention",
                                        help="retention: keep the N newest recordings, or those of the last N days "
                                             "(e.g. 7d); default: keep all")

    def __post_init__(self) -> None:
        # the field types are checked by pydantic on construction; the bounds and choices each option
        # declares hold for settings built in code too, not only for the command line
        for f in fields(self):
            cli = f.metadata.get("cli")
            v = getattr(self, f.name)
            if cli is None or v is None or isinstance(v, bool):
                continue
            if cli.choices is not None and v not in cli.choices:
                raise ValueError(f"ServerSettings.{f.name}: expected one of {', '.join(map(str, cli.choices))}, got {v!r}")
            if isinstance(v, (int, float)):
                if (cli.ge is not None and v < cli.ge) or (cli.gt is not None and v <= cli.gt) or (
                        cli.le is not None and v > cli.le):
                    bounds = " and ".join(f"{op} {b}" for op, b in ((">=", cli.ge), (">", cli.gt), ("<=", cli.le))
                                          if b is not None)
                    raise ValueError(f"ServerSettings.{f.name}: must be {bounds}, got {v!r}")
        env_key = os.environ.get("DUPLEXKIT_API_KEY")
        if env_key and env_key not in self.api_keys:
            self.api_keys = [*self.api_keys, env_key]
        if self.ref_audio_dir is not None:
            self.ref_audio_dir = Path(self.ref_audio_dir).resolve()


def cli_options(group: Optional[str] = None) -> list[tuple[str, Any, CliOption]]:
    """``(field name, type, CliOption)`` of every :class:`ServerSettings` field that is a
    ``duplexkit serve`` option, in field order; only those of ``group`` when given. The type is
    the field's resolved annotation (``int``, ``float``, ``str``, ``bool``, ``list[str]``, ``dict``,
    ``Optional[...]``)."""
    hints = typing.get_type_hints(ServerSettings)
    return [(f.name, hints[f.name], f.metadata["cli"]) for f in fields(ServerSettings)
            if "cli" in f.metadata and (group is None or f.metadata["cli"].group == group)]
