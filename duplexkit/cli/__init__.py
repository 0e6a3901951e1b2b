"""The ``duplexkit`` command line: ``serve``, ``demo``, ``mic``, ``chat``, ``bench``, ``replay``, ``plan-memory``.

Every subcommand has ``--help``. Heavy imports (torch, the model port, the server) happen only
inside the command that needs them, so ``duplexkit --help`` is instant.

Model argument (``serve``, ``demo``, ``mic``, ``chat``):
  * a MiniCPM-o 4.5 checkpoint directory;
  * ``tiny``: a small random-weight checkpoint in the real layout (built once, cached). Random
    weights never choose to listen or to end a turn, so with ``tiny`` sessions default to the
    ``on_request`` answer policy and a small token cap (``TINY_MAX_OUTPUT_TOKENS``);
  * ``scripted``: the torch-free :class:`duplexkit.testing.ScriptedEngine` (tests, protocol work).

The package: ``common`` (exit codes, errors, engine helpers), one module per subcommand
(``serve``, ``demo``, ``chat``, ``mic``), and here the parser, ``bench`` and :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from .common import (
    API_KEY_ENV,
    CliError,
    DEFAULT_CLIENT_MODEL,
    DEFAULT_DEMO_WAV,
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    TINY_MAX_OUTPUT_TOKENS,
    Terminated,
    held_signals,
    install_sigterm,
    _debug,
    _eprint,
    _error_line,
    _float_min,
    _int_range,
    _stdout_gone,
)
from .serve import (_add_hardening_args, _add_ray_args, _add_record_args, _add_settings_args, _add_tool_args,
                    cmd_serve)
from .demo import (cmd_demo)
from .chat import (cmd_chat)
from .mic import (cmd_mic)

from .common import (  # re-exported: the documented exit codes and helpers callers use
    DEBUG_ENV,
    EXIT_CODES,
    EXIT_CONNECTION,
    EXIT_DEVICE,
    EXIT_FAILURE,
    EXIT_LOAD,
    EXIT_OK,
    load_engine,
)
from .chat import _chat_body
from .demo import run_wav_turn
from .mic import _echo_config

__all__ = [
    "main", "build_parser", "load_engine", "run_wav_turn", "TINY_MAX_OUTPUT_TOKENS", "CliError", "DEBUG_ENV",
    "EXIT_CODES", "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_BAD_INPUT", "EXIT_CONNECTION", "EXIT_LOAD",
    "EXIT_DEVICE", "EXIT_INTERRUPTED", "EXIT_TERMINATED", "EXIT_BROKEN_PIPE", "_chat_body", "_echo_config", "_error_line",
]


def cmd_bench(args) -> int:
    import runpy

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    scripts = sorted(p.stem for p in root.glob("*.py") if not p.name.startswith("_")) if root.is_dir() else []
    if not args.name:
        print("available benchmarks:", ", ".join(scripts) or "(none found in a source checkout)")
        return 0
    path = root / f"{args.name}.py"
    if not path.is_file():
        raise CliError(f"unknown benchmark {args.name!r}; available: {', '.join(scripts) or 'none'}", EXIT_USAGE)
    sys.argv = [str(path), *args.rest]
    runpy.run_path(str(path), run_name="__main__")
    return 0


# ---------------------------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------------------------


def _add_model_args(p: argparse.ArgumentParser, *, default: Optional[str] = DEFAULT_CLIENT_MODEL,
                    session: bool = True) -> None:
    p.add_argument("model", nargs="?" if default else None, default=default,
                   help="checkpoint directory, 'tiny' (random weights, built once and cached) or 'scripted' "
                        f"(torch-free fake engine){' (default: ' + default + ')' if default else ''}")
    p.add_argument("--layout", default=None,
                   help="device layout: 'cpu', '1gpu', '2gpu', ... or a YAML path (default: 1gpu with CUDA, else cpu)")
    p.add_argument("--weights-seed", type=int, default=0,
                   help="seed of the tiny checkpoint's random weights (default 0; ignored for real checkpoints)")
    if not session:
        return
    p.add_argument("--answer-policy", choices=["model", "on_request"], default=None,
                   help="when the model may speak: 'model' decides per unit, 'on_request' only answers "
                        "response.create / VAD commits (default: on_request for tiny, else the profile default)")
    p.add_argument("--max-output-tokens", type=_int_range(1, 8192, allow_inf=True), default=None,
                   help=f"per-response token cap, 1..8192 or inf (default: {TINY_MAX_OUTPUT_TOKENS} for tiny, "
                        "else 1024)")


def _add_client_api_key(p: argparse.ArgumentParser) -> None:
    """``--api-key`` of the client subcommands (``demo``, ``mic``, ``chat`` with ``--url``).

    Defaults to ``$DUPLEXKIT_API_KEY``, the variable ``serve`` and ``examples/curl_chat.sh`` read, so
    one exported key serves both sides; an empty variable means no key.
    """
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"API key for --url, sent as 'Authorization: Bearer KEY' "
                        f"(default: ${API_KEY_ENV} when set, else none)")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``error: …``, exit 2), like every other CLI failure.

    Each error names the help of the (sub)command it concerns: ``see duplexkit serve --help``.
    """

    commands: dict = {}
    """The subcommand parsers by name (set by :func:`build_parser` on the top-level parser)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        # argparse hands a subcommand's unknown arguments back to the top-level parser, whose error
        # would point at `duplexkit --help`; report them from the subcommand's parser instead
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.commands.get(getattr(ns, "command", None), self).error(
                f"unrecognized arguments: {' '.join(extras)}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="duplexkit", description="Realtime full-duplex voice agents "
                                     "(MiniCPM-o 4.5): server, demos and tools.")
    parser.add_argument("--version", action="version", version=f"duplexkit {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("serve", help="run the OpenAI-Realtime-compatible server",
                       description="Serve /v1/realtime, /v1/duplex, /v1/chat/completions, /v1/models and /health.")
    _add_model_args(p, default=None)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_int_range(0, 65535), default=8000, help="TCP port, 0..65535 (default 8000)")
    _add_settings_args(p, "server")  # the ServerSettings fields (duplexkit/settings.py)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="thinker and talker dtype override (default: the layout's; Code2Wav keeps the layout's)")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "fp8"],
                   help="quantized weights for the thinker's and talker's decoder layers: int8 (weight-only, "
                        "any device) or fp8 (CUDA compute capability >= 8.9 with bfloat16: FP8 matmuls; on the "
                        "CPU: emulated in float32, for testing, not faster; CUDA below 8.9: refused). Thinker + "
                        "talker weights 10.8 GiB instead of 17.4 in bf16. A slow path (emulated fp8, int8 "
                        "dequantized per matmul) logs one warning at load (default none; docs/model.md "
                        "'Quantized weights')")
    p.add_argument("--scripted", action="append", default=None, metavar="KEY=VALUE",
                   help="ScriptedEngine option for the 'scripted' model, e.g. units_per_turn=3 (repeatable)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level (default info)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process, so its threads never share the server's GIL "
                        "(default on; --no-engine-process: one process, as before; Ray Serve replicas "
                        "always run it in-process)")
    _add_hardening_args(p)
    _add_tool_args(p)
    _add_record_args(p)
    _add_ray_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="WAV in -> transcript + WAV out + timing table",
                       description="Send a WAV as one user turn, request an answer, save it, print timings. "
                                   "Default: the tiny random-weight model and the bundled question.")
    _add_model_args(p)
    p.add_argument("--input", "-i", default=str(DEFAULT_DEMO_WAV),
                   help="input WAV (any rate; default: the bundled 'What is the weather like today in Paris?')")
    p.add_argument("--output", "-o", default="demo_output.wav", help="output WAV, 24 kHz (default demo_output.wav)")
    p.add_argument("--url", default=None, help="talk to a running server instead of loading the model in-process")
    _add_client_api_key(p)
    p.add_argument("--instructions", default=None, help="system prompt")
    p.add_argument("--pace", type=_float_min(0), default=0.0,
                   help="send the input at this multiple of real time (0 = as fast as the server takes it: the "
                        "first 4 s at once, then real time; the default)")
    p.add_argument("--timeout", type=_float_min(0, strict=True), default=600.0,
                   help="seconds to wait for the answer (default 600)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("mic", help="talk to the model: microphone in, speaker out, barge-in by speaking",
                       description="Live conversation with local barge-in (webrtcvad) and a live transcript.")
    _add_model_args(p)
    p.add_argument("--url", default=None, help="server URL (default: run the model in-process)")
    _add_client_api_key(p)
    p.add_argument("--input-device", default=None, help="sounddevice input device (index or name substring)")
    p.add_argument("--output-device", default=None, help="sounddevice output device (index or name substring)")
    p.add_argument("--block-ms", type=_int_range(10, 1000), default=100, help="microphone block size in ms (default 100)")
    p.add_argument("--no-barge-in", action="store_true", help="do not interrupt the assistant when you speak")
    p.add_argument("--no-vad-responses", dest="vad_responses", action="store_false",
                   help="do not ask for an answer after each utterance (let the model decide)")
    p.add_argument("--silence-ms", type=_int_range(0), default=500, help="silence that ends an utterance, ms (default 500)")
    p.add_argument("--echo", choices=["off", "gate", "aec", "auto"], default="auto",
                   help="echo control for speakers without headphones: 'gate' = barge-in needs speech well above "
                        "the playback echo level; 'aec' = WebRTC echo cancellation (pip install 'duplexkit[echo]') "
                        "plus the gate; 'auto' = aec when installed, else gate; 'off' = none (headphones). "
                        "Default auto: a headset cannot be detected reliably, so echo control is always on "
                        "unless you pass --echo off")
    p.add_argument("--instructions", default=None, help="system prompt")
    p.add_argument("--duration", type=_float_min(0, strict=True), default=None, help="stop after this many seconds (default: Ctrl+C)")
    p.add_argument("--save-output", default=None, help="also write everything the assistant said to this WAV")
    p.add_argument("--summary", default=None, help="write a JSON summary (responses, barge-ins) here at exit")
    p.set_defaults(func=cmd_mic)

    p = sub.add_parser("chat", help="one /v1/chat/completions call (text and/or audio in, text + WAV out)",
                       description="Send one chat-completions request (text and/or a WAV) and print the answer; "
                                   "the spoken answer is saved as a 24 kHz WAV. Runs the model in-process, or "
                                   "talks to a running server with --url. Default: the tiny random-weight model.")
    _add_model_args(p, session=False)
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed sent with the request (repeatable answers on the same hardware; default: none)")
    p.add_argument("--url", default=None, help="server URL (default: run the model in-process)")
    _add_client_api_key(p)
    p.add_argument("--text", "-t", default=None, help="user text")
    p.add_argument("--audio", "--input", "-a", "-i", dest="audio", default=None,
                   help="user audio WAV (--input is the same option, the name demo and the examples use)")
    p.add_argument("--output", "-o", default="chat_output.wav", help="where to save the spoken answer (24 kHz WAV)")
    p.add_argument("--no-audio", action="store_true", help="text answer only")
    p.add_argument("--stream", action="store_true", help="stream the answer (SSE)")
    p.add_argument("--max-tokens", type=_int_range(1, 8192), default=None,
                   help="max answer tokens, 1..8192 (default: not sent; the server's default applies, which keeps "
                        f"its --max-output-tokens cap: {TINY_MAX_OUTPUT_TOKENS} for tiny, else up to 256)")
    p.add_argument("--served-model", default=None, help="model id to send (default: the server's)")
    p.add_argument("--timeout", type=_float_min(0, strict=True), default=600.0, help="HTTP timeout in s (default 600)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="run a benchmark script from benchmarks/ (prints tables)")
    p.add_argument("name", nargs="?", default=None, help="benchmark name (omit to list them)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=cmd_bench)
    from .replay import add_replay_parser

    add_replay_parser(sub)
    from .plan_memory import add_plan_memory_parser

    add_plan_memory_parser(sub)
    parser.commands = dict(sub.choices)
    return parser


def _version() -> str:
    from duplexkit import __version__

    return __version__


def main(argv: Optional[list[str]] = None) -> int:
    code = _main(argv)
    if argv is None:
        # the process's own command ends here: its objects need no final garbage collection, which
        # with a model loaded in this process (serve --no-engine-process, demo, mic, chat) held
        # the exit for seconds after everything was closed; atexit handlers still run
        import gc

        gc.freeze()
    return code


def _main(argv: Optional[list[str]]) -> int:
    if argv is None:  # the process's own command: SIGTERM stops it as Ctrl+C does (exit 143)
        # building the parser imports pydantic and numpy (~1 s): a signal then is held until the
        # imports are done (an exception raised inside an extension module's import can panic it),
        # and the command ends at once with the same line and status as in any later phase
        with held_signals() as held:
            parser = build_parser()
        install_sigterm()
        if held:
            terminated = held[0] == signal.SIGTERM
            _eprint("terminated" if terminated else "interrupted")
            return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    else:
        parser = build_parser()
    args = parser.parse_args(argv)
    # the process's own command line (the console script, python -m duplexkit[.cli]), not a call from
    # another program (tests, embedding): only then may `serve` re-execute the process
    own = sys.argv[1:]
    args.process_command_line = argv is None and (not own or sys.orig_argv[-len(own):] == own)
    if not getattr(args, "command", None):
        # a usage error like any other (docs/cli.md, "Exit status"): the help on stderr, then one
        # error line, status 2; `duplexkit --help` prints the help on stdout with status 0
        parser.print_help(sys.stderr)
        _eprint(f"error: duplexkit: a command is required: {', '.join(parser.commands)} "
                "(see duplexkit COMMAND --help)")
        return EXIT_USAGE
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at interpreter exit
        return code
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM (Terminated); cleanup has run on the way
        if isinstance(exc, Terminated):
            _eprint("terminated")
            return EXIT_TERMINATED
        _eprint("interrupted")
        return EXIT_INTERRUPTED
    except SystemExit:
        raise
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            # `duplexkit demo | head -2`: the reader of stdout has gone; end quietly, as a command
            # killed by SIGPIPE would (docs/cli.md, "Exit status")
            return EXIT_BROKEN_PIPE
        # one clean line (and a documented status, see EXIT_*); DUPLEXKIT_DEBUG=1 shows the traceback
        message, code = _error_line(exc)
        if _debug():
            import traceback

            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        _eprint(f"error: {message}")
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
