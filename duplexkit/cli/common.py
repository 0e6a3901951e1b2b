"""Shared pieces of the ``duplexkit`` command: exit codes, the one-line error report, model/engine helpers."""

from __future__ import annotations

import argparse
import json
import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Optional

from duplexkit.errors import DuplexkitError, ErrorCode


TINY_MAX_OUTPUT_TOKENS = 40
"""Default per-response token cap with the ``tiny`` model: random weights never emit
``<|turn_eos|>``; at up to 19 decoded tokens per unit (docs/model.md §5.3) this ends a response after
2-3 units (docs/protocol.md §4.1)."""

MIN_TURN_SAMPLES = 1600
"""The shortest input ``demo`` sends, in 16 kHz samples: 100 ms, the least a commit accepts
(``input_audio_buffer_empty`` below it, docs/protocol.md §9)."""

ASSET_DIR = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_DEMO_WAV = ASSET_DIR / "question_16k.wav"


def _eprint(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


DEBUG_ENV = "DUPLEXKIT_DEBUG"
"""Set to 1 to let errors show their full traceback instead of one ``error: …`` line."""

EXIT_OK = 0
"""Success (``demo``: the answer ended ``completed`` or ``incomplete``)."""
EXIT_FAILURE = 1
"""The run failed: the answer ended ``cancelled``/``failed``, a timeout, a server-side error, an
unexpected exception."""
EXIT_USAGE = 2
"""Bad arguments or input, refused before anything heavy runs: an option out of range, a missing or
invalid checkpoint directory (no/bad ``config.json``, no weight files), an unknown or invalid
``--layout``, a GPU layout on a machine without a visible GPU, an unreadable WAV, input under 100 ms."""
EXIT_BAD_INPUT = EXIT_USAGE  # the older name
EXIT_CONNECTION = 3
"""Network: a client cannot reach the server or is refused (connection refused, unauthorized, no
free session slot), or the server ends its session (shut down, engine failure, idle timeout, lost
connection: :func:`session_end_line`); ``serve`` cannot listen on ``--host``/``--port`` (port in
use, address not available)."""
EXIT_LOAD = 4
"""The model or engine failed to load after the pre-load checks passed (``CheckpointError``, out of
memory, a missing package such as torch)."""
EXIT_DEVICE = 5
"""``mic``: no usable audio device (none found, the named one missing, or it cannot be opened)."""
EXIT_INTERRUPTED = 130
"""Ctrl+C (SIGINT) stopped a command that ends by itself (``demo``, ``chat``, ``bench``, ``replay``;
``mic`` before its session is ready), in any phase, the model load included: 128 + 2, the status a
shell shows for a process killed by SIGINT. For the commands that run until stopped Ctrl+C / SIGTERM
is the normal way to end them: ``serve`` shuts down cleanly and exits 0 in every phase (loading,
serving, draining), ``mic`` exits 0 once its session is ready."""
EXIT_TERMINATED = 143
"""SIGTERM stopped a command that ends by itself (as :data:`EXIT_INTERRUPTED`, for SIGTERM: 128 + 15)."""

EXIT_BROKEN_PIPE = 141
"""The reader of stdout went away (``duplexkit demo | head -2``): the command stops quietly with the
status a shell gives a process killed by SIGPIPE (128 + 13), as ``yes | head`` does; no error line."""

EXIT_CODES = {EXIT_OK: "ok", EXIT_FAILURE: "run failed", EXIT_USAGE: "usage or invalid input",
              EXIT_CONNECTION: "network (connect / listen)", EXIT_LOAD: "model load failed",
              EXIT_DEVICE: "audio device unavailable", EXIT_INTERRUPTED: "interrupted (SIGINT, Ctrl+C)",
              EXIT_TERMINATED: "terminated (SIGTERM)",
              EXIT_BROKEN_PIPE: "stdout closed by its reader"}
"""The one exit-status table every subcommand uses (docs/cli.md)."""


API_KEY_ENV = "DUPLEXKIT_API_KEY"
"""The API key variable: ``serve`` accepts it as one more key, the client subcommands send it by
default (``--api-key``), ``examples/curl_chat.sh`` sends it."""


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (writing fails with EPIPE).

    Seen either as a BrokenPipeError from flushing what is still buffered, or (nothing buffered) as
    ``POLLERR`` on fd 1, which Linux reports for a pipe without readers. If so, points fd 1 at
    ``os.devnull`` so the interpreter's final flush does not print ``Exception ignored …
    BrokenPipeError`` (the recipe in Python's ``signal`` docs) and returns True. A BrokenPipeError
    from anything else (a socket to the server) returns False and is reported as an error.
    """
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    try:
        sys.stdout.flush()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        gone = any(ev & select.POLLERR for _, ev in poller.poll(0))
    except BrokenPipeError:
        gone = True
    except (AttributeError, OSError, ValueError):
        gone = False
    if gone:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except OSError:
            pass
    return gone


# ---------------------------------------------------------------------------------------------
# signals: SIGINT and SIGTERM stop every phase of every command at once and cleanly
# ---------------------------------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python raises KeyboardInterrupt for SIGINT (a KeyboardInterrupt, so every
    path that stops cleanly on Ctrl+C stops the same way on SIGTERM); ``main`` exits
    :data:`EXIT_TERMINATED` for it."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def held_signals():
    """SIGINT and SIGTERM held while the block runs (main thread only): the block is not interrupted,
    and the list it yields holds the signal numbers that arrived (in order) once it ends. The handlers
    in force before are restored on exit."""
    import signal

    got: list = []
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue  # nohup and friends: an ignored signal stays ignored
        old[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
    # a process re-executed by `serve` (duplexkit.memory.use_malloc_for_objects) starts with both
    # blocked, so that a signal during its start-up waits: it is delivered here, to the handlers above
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield got
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def install_sigterm() -> None:
    """SIGTERM raises :class:`Terminated` in the main thread, as SIGINT raises KeyboardInterrupt;
    left alone when SIGTERM is ignored (``nohup``, a parent that ignores it) or already handled."""
    import signal

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)


def run_async(coro):
    """:func:`asyncio.run` for a command: SIGINT and SIGTERM cancel the command's coroutine (its
    ``finally`` blocks and ``async with`` exits run: engines closed, clients closed), then raise
    KeyboardInterrupt or :class:`Terminated` (exit 130 / 143). A second signal while that cleanup
    runs raises at once. asyncio's own runner does the same for SIGINT only; a signal that is
    ignored (started under ``nohup`` or in the background) stays ignored.

    Blocking work inside ``coro`` must run in a thread (:func:`load_engine_async` for a model load):
    a cancel reaches a coroutine only when it awaits.
    """
    import asyncio
    import signal

    seen: list[int] = []
    box: list = []

    async def main():
        box.append(asyncio.current_task())
        return await coro

    def on_signal(signum, frame) -> None:
        seen.append(signum)
        task = box[0] if box else None
        if len(seen) > 1 or task is None or task.done():
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        task.cancel()
        loop.call_soon_threadsafe(lambda: None)  # wakes the loop if it sleeps in select()

    with asyncio.Runner() as runner:
        loop = runner.get_loop()
        previous = {}
        for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, _raise_terminated)):
            if signal.getsignal(sig) in (default, signal.SIG_DFL):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            return runner.run(main())
        except asyncio.CancelledError:
            if not seen:
                raise
            raise (Terminated() if seen[0] == signal.SIGTERM else KeyboardInterrupt()) from None
        finally:
            for sig, handler in previous.items():
                if signal.getsignal(sig) is on_signal:
                    signal.signal(sig, handler)


def interrupt_thread(thread, exc: type = KeyboardInterrupt) -> bool:
    """Raise ``exc`` in ``thread`` (a :class:`threading.Thread`) at its next Python step, as SIGINT
    does in the main thread (``PyThreadState_SetAsyncExc``): how a model load running in a thread
    is stopped. Blocking C calls finish first (one tensor read, one matmul). Returns whether the
    thread was found."""
    import ctypes

    ident = getattr(thread, "ident", None)
    if ident is None or not thread.is_alive():
        return False
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc)) == 1


LOADER_STOP_S = 10.0
"""How long an interrupted load may take to stop (it stops at its next Python step)."""

INTERRUPT_EVERY_S = 0.05
"""How often :func:`interrupt_until_stopped` raises the interrupt again in a load that goes on."""


def _inside(thread, code) -> bool:
    """Whether ``thread`` is running ``code`` (a code object) somewhere in its current stack."""
    frame = sys._current_frames().get(getattr(thread, "ident", None))
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def interrupt_until_stopped(target, lock, inside, exc: type = KeyboardInterrupt, *,
                            every_s: float = INTERRUPT_EVERY_S, limit_s: float = LOADER_STOP_S) -> None:
    """Interrupt a loading thread (:func:`interrupt_thread`) now and again every ``every_s`` while it
    is still in the load, for at most ``limit_s``; returns at once (a daemon thread repeats it).

    One asynchronous exception is not enough: it may land where Python swallows it (a ``__del__``,
    a weakref callback, a library's ``except BaseException``), and the load then runs to its end.
    ``target()`` (called with ``lock`` held) gives the loading thread, None once it is done; the
    interrupt is raised only while that thread runs ``inside`` (the load function's code object),
    so that none reaches it after the load has returned.
    """
    import threading
    import time

    def once() -> bool:  # whether to go on
        with lock:
            thread = target()
            if thread is None or not thread.is_alive():
                return False
            if _inside(thread, inside):
                interrupt_thread(thread, exc)
            return True

    def repeat() -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            time.sleep(every_s)
            if not once():
                return

    if once():
        threading.Thread(target=repeat, name="duplexkit-load-interrupter", daemon=True).start()


async def load_engine_async(model: str, **kwargs):
    """:func:`load_engine` in a daemon thread, awaited: the event loop keeps running, so Ctrl+C or
    SIGTERM (:func:`run_async`) stops the load at once. On cancellation the load is interrupted
    (:func:`interrupt_thread`) and waited for (up to :data:`LOADER_STOP_S`), so that nothing of it
    runs on; an engine that finished loading meanwhile is closed."""
    import asyncio
    import threading

    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    box: dict = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            try:
                with lock:
                    box["loading"] = True
                box["engine"] = load_engine(model, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                box["error"] = exc
            finally:
                with lock:
                    box["loading"] = False
            loop.call_soon_threadsafe(done.set)
        except BaseException:  # an interrupt that came as the load returned, or a closed loop
            pass

    thread = threading.Thread(target=run, name="duplexkit-engine-loader", daemon=True)
    thread.start()
    try:
        await done.wait()
    except asyncio.CancelledError:
        interrupt_until_stopped(lambda: thread if box.get("loading") else None, lock, load_engine.__code__)
        deadline = loop.time() + LOADER_STOP_S
        while thread.is_alive() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        engine = box.get("engine")
        if engine is not None:
            await engine.aclose()
        raise
    if "error" in box:
        raise box.pop("error")
    return box["engine"]


def _stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker, if this process started one (an engine process is
    spawned through it), so that it does not outlive the command: it would otherwise exit only after
    this process, as an orphan (a zombie under a container's PID 1 that does not reap)."""
    import sys

    rt = sys.modules.get("multiprocessing.resource_tracker")
    stop = getattr(getattr(rt, "_resource_tracker", None), "_stop", None)
    process = sys.modules.get("duplexkit.engine.process")
    if process is not None:
        process._close_all()  # the tracker ends once every process that holds its pipe has exited
        if process._live:  # pragma: no cover - one would not exit: leave the tracker be
            return
    if stop is not None:
        try:
            stop()
        except Exception:  # pragma: no cover - best effort at exit
            pass


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _int_range(lo: int, hi: Optional[int] = None, *, allow_inf: bool = False):
    """An argparse type: an integer in ``lo..hi`` (the wire's limits), optionally the string ``inf``."""
    def parse(text: str):
        if allow_inf and text.strip().lower() == "inf":
            return "inf"
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer{' or inf' if allow_inf else ''}, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {rng}{' or inf' if allow_inf else ''}, got {v}")
        return v
    return parse


def _float_min(lo: float, *, strict: bool = False):
    """An argparse type: a finite float ``>= lo`` (``> lo`` when ``strict``)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if v != v or v in (float("inf"), float("-inf")) or v < lo or (strict and v == lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lo:g}, got {text}")
        return v
    return parse


class CliError(DuplexkitError):
    """A failure reported as one ``error: <message>`` line with exit status ``exit_status``."""

    default_code = "cli_error"

    def __init__(self, message: str, exit_status: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.exit_status = exit_status


UNAUTHORIZED_HINT = "the server refused the API key (pass --api-key KEY)"
"""The message of a client command whose server answered 401 (``demo``/``mic``/``chat --url``)."""


def no_server_hint() -> str:
    """The next step after a ``--url`` where nothing answered (connection refused, unknown host)."""
    return f"is a server running there? start one with: {command_name()} serve tiny (or check --url)"


def _error_line(exc: BaseException) -> tuple[str, int]:
    """The message and exit status for an exception that ends a command (see EXIT_*)."""
    from duplexkit.errors import (AudioFormatError, DeviceError, DuplexConnectionError, DuplexError,
                                  DuplexTimeout, EngineLoadError, LayoutError)
    from duplexkit.preflight import PreflightError

    if isinstance(exc, CliError):
        return str(exc), exc.exit_status
    from duplexkit.engine.memory_plan import MemoryBudgetError

    if isinstance(exc, MemoryBudgetError):  # a LayoutError whose message is the plan's table
        return str(exc), EXIT_USAGE
    if isinstance(exc, EngineLoadError):
        return str(exc), EXIT_LOAD
    if isinstance(exc, PreflightError):
        return str(exc), EXIT_USAGE
    if isinstance(exc, FileNotFoundError):
        return str(exc), EXIT_BAD_INPUT
    if isinstance(exc, DuplexTimeout):
        return f"timed out: {exc.message}", EXIT_FAILURE
    if isinstance(exc, DuplexConnectionError):
        hints = {ErrorCode.UNAUTHORIZED.value: UNAUTHORIZED_HINT,
                 ErrorCode.SESSION_CAPACITY_EXHAUSTED.value: "the server has no free session slot; retry later"}
        msg = hints.get(exc.code, exc.message or exc.code)
        if exc.code == "connection_failed" and isinstance(exc.__cause__, OSError):  # nothing answered there
            msg = f"{msg}; {no_server_hint()}"
        return (f"{msg} ({exc.message})" if exc.code in hints and exc.message else msg), EXIT_CONNECTION
    if isinstance(exc, DuplexError):
        if exc.code == ErrorCode.INPUT_AUDIO_BUFFER_EMPTY.value:
            return "input too short: need at least 100 ms of audio", EXIT_BAD_INPUT
        return f"the server rejected the request: {exc.code}: {exc.message}", EXIT_FAILURE
    if isinstance(exc, AudioFormatError):
        return f"bad audio: {exc}", EXIT_BAD_INPUT
    if isinstance(exc, LayoutError):
        return f"bad layout: {exc}", EXIT_BAD_INPUT
    if isinstance(exc, DeviceError):
        return f"audio device error: {exc}", EXIT_DEVICE
    chat_mod = sys.modules.get("duplexkit_server.chat")
    if chat_mod is not None and isinstance(exc, getattr(chat_mod, "ChatRequestError", ())):
        return f"bad chat request: {exc}", EXIT_BAD_INPUT
    httpx = sys.modules.get("httpx")
    if httpx is not None:
        if isinstance(exc, httpx.TimeoutException):
            return f"timed out: {exc}", EXIT_FAILURE
        if isinstance(exc, httpx.ConnectError):
            return f"cannot connect: {exc}; {no_server_hint()}", EXIT_CONNECTION
        if isinstance(exc, (httpx.RemoteProtocolError, httpx.UnsupportedProtocol)):
            return f"cannot connect: {exc}", EXIT_CONNECTION
        if isinstance(exc, httpx.HTTPError):
            return f"HTTP request failed: {exc}", EXIT_CONNECTION
    if isinstance(exc, (ConnectionError, OSError)):
        return f"{type(exc).__name__}: {exc}", EXIT_CONNECTION if isinstance(exc, ConnectionError) else EXIT_FAILURE
    return f"{type(exc).__name__}: {exc}", EXIT_FAILURE


DEFAULT_CLIENT_MODEL = "tiny"
"""The MODEL of ``demo``, ``mic`` and ``chat`` when none is named."""


def check_url_args(args, command: str) -> None:
    """``demo``, ``mic``, ``chat`` with ``--url``: the server's model answers, so a MODEL other than
    the default, or a ``--layout``, would be ignored without a word; refused instead.

    Raises:
        CliError: :data:`EXIT_USAGE`, naming what to drop.
    """
    if not getattr(args, "url", None):
        return
    named = []
    if args.model != DEFAULT_CLIENT_MODEL:
        named.append(f"MODEL {args.model!r}")
    if getattr(args, "layout", None):
        named.append(f"--layout {args.layout}")
    if named:
        raise CliError(f"duplexkit {command}: {' and '.join(named)} cannot be used with --url (the server's model "
                       f"answers); drop {'it' if len(named) == 1 else 'them'}, or drop --url to run the model in "
                       "this process", EXIT_USAGE)


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created in the existing directory ``folder``: a temporary file is made
    and removed (``os.access`` says yes to root on a read-only file system)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def check_output_file(path, option: str) -> None:
    """Refuse an output file the command could not write, before anything heavy runs (``demo
    --output``, ``chat --output``, ``mic --save-output`` / ``--summary``): a directory, an existing
    file that cannot be opened for writing, or a parent that is not a writable directory.

    Raises:
        CliError: :data:`EXIT_USAGE`, one line naming the option and what to pass.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise CliError(f"cannot write {option} {path}: it is a directory; pass a file path "
                       f"(e.g. {p / 'answer.wav'})", EXIT_USAGE)
    parent = p.resolve().parent
    if not parent.is_dir() or not _can_create_in(parent):
        raise CliError(f"cannot write {option} {path}: {parent} is not a writable directory", EXIT_USAGE)
    if p.exists():
        try:
            with open(p, "ab"):
                pass
        except OSError as exc:
            raise CliError(f"cannot write {option} {path}: {exc.strerror or exc}", EXIT_USAGE) from exc


def check_output_dir(path, option: str) -> None:
    """Refuse an output directory the command could not write (``serve --record DIR``), before the
    port is bound: an existing file, a directory where no file can be created, or (a missing
    directory, created on first use) a nearest existing ancestor that is not a writable directory.

    Raises:
        CliError: :data:`EXIT_USAGE`, one line naming the option and what to pass.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise CliError(f"cannot use {option} {path}: it is a file, not a directory; pass a directory "
                       "(created if missing)", EXIT_USAGE)
    base = p.absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise CliError(f"cannot use {option} {path}: {base} is a file, not a directory; pass a directory "
                       "(created if missing)", EXIT_USAGE)
    if not _can_create_in(base):
        raise CliError(f"cannot use {option} {path}: {base} is not writable; pass a writable directory",
                       EXIT_USAGE)


def command_name() -> str:
    """The ``duplexkit`` command as the user can type it: ``duplexkit`` when it is the one on ``PATH``,
    else the path of the one next to this interpreter (``.venv/bin/duplexkit`` after
    scripts/demo.sh), relative to the working directory when it is under it."""
    import shutil

    exe = Path(sys.executable).with_name("duplexkit")
    if not exe.is_file() or shutil.which("duplexkit") == str(exe):
        return "duplexkit"
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def _size(n: int) -> str:
    """Bytes as a short decimal size (``812 B``, ``3.4 kB``, ``1.2 MB``, ``5.0 GB``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def recording_summary(directory, sessions: int, size: int) -> str:
    """``serve --record DIR``'s line at exit: how many sessions this run recorded, where, how many
    bytes, and the ``duplexkit replay`` command that opens them (docs/debugging.md)."""
    import shlex

    where = shlex.quote(str(directory))
    if not sessions:
        return f"recordings: no session was recorded into {where} this run"
    return (f"recordings: {sessions} session(s) recorded into {where} this run ({_size(size)}); "
            f"open them with: {command_name()} replay {where}")


def session_end_line(client, exc: Optional[BaseException] = None) -> str:
    """The ``error:`` message for a client whose session ended without the command ending it: what
    happened (the WebSocket close code and the ``session.closed`` reason, docs/protocol.md §1.5) and
    the next step. ``exc`` is the error a call raised when the connection went (its ``close_code``
    is used when the client saw none). Exit status :data:`EXIT_CONNECTION` (docs/cli.md, "When the
    server ends the session")."""
    from duplexkit.clients import DuplexClient
    from duplexkit.clients.base import CLOSE_CODES  # session.closed reason -> close code

    shutdown, timeout, server_error = "shutdown", "timeout", ErrorCode.SERVER_ERROR.value
    policy_violation = 1008  # RFC 6455: here "peer not reading" (docs/protocol.md §1.5)
    reason = client.close_reason
    code = getattr(client, "close_code", None) or getattr(exc, "close_code", None)
    remote = isinstance(client, DuplexClient)
    said = ", ".join(x for x in (f"close code {code}" if code else "",
                                 f"session.closed reason {reason!r}" if reason else "") if x)
    who = "the server closed the connection" if remote else "the session ended"
    head = f"{who} ({said})" if said else who
    if reason == shutdown or (reason is None and code == CLOSE_CODES[shutdown]):
        return f"{head}: the server is shutting down; start it again (or wait for its restart) and rerun this command"
    if reason == server_error or (reason is None and code == CLOSE_CODES[server_error]):
        where = "the server's log says why; restart it" if remote else "the error it sent says why"
        return f"{head}: the engine failed and cannot go on; {where}, then rerun this command"
    if reason == timeout:
        return (f"{head}: the session was idle longer than the server's --idle-timeout-s (default 300 s); "
                "rerun this command")
    if remote and reason is None and code == policy_violation:
        return (f"{head}: this client did not take the server's events in time (peer not reading, "
                "--outbound-stall-s); rerun it on a less loaded machine or network")
    if remote and reason is None:
        return (f"the connection to the server was lost{f' ({said})' if said else ''}: check that the server is "
                f"still running and reachable, then rerun this command")
    return f"{head}; rerun this command"


# ---------------------------------------------------------------------------------------------
# engine loading
# ---------------------------------------------------------------------------------------------


def _parse_voice(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise CliError(f"--voice expects NAME=PATH, got {spec!r}", EXIT_BAD_INPUT)
    return name, Path(path)


def _parse_scripted(pairs: list[str]) -> dict:
    out: dict[str, Any] = {}
    for p in pairs or []:
        key, sep, val = p.partition("=")
        if not sep:
            raise CliError(f"--scripted expects KEY=VALUE, got {p!r}", EXIT_BAD_INPUT)
        try:
            out[key] = json.loads(val)
        except ValueError:
            out[key] = val
    return out


def load_engine(model: str, **kwargs):
    """:func:`duplexkit.engine.load_engine` for the CLI: a load failure becomes a :class:`CliError`
    with :data:`EXIT_LOAD` (the message keeps the loader's text). Other code imports
    ``load_engine`` from :mod:`duplexkit.engine`."""
    from duplexkit.engine.loading import load_engine as _load
    from duplexkit.errors import EngineLoadError

    try:
        return _load(model, **kwargs)
    except EngineLoadError as exc:
        raise CliError(str(exc), EXIT_LOAD) from exc.__cause__


def _check_model_arg(model: str, layout: Optional[str]) -> None:
    """Cheap checks before anything heavy loads and before ``serve`` binds its port
    (:func:`duplexkit.engine.loading.check_model_arg`)."""
    from duplexkit.engine.loading import check_model_arg

    check_model_arg(model, layout)


def _random_weights_notice(engine) -> None:
    from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE

    # DuplexEngine.from_pretrained printed it already when it loaded with progress
    if getattr(engine, "random_weights", False) and not getattr(engine, "random_weights_noticed", False):
        _eprint(RANDOM_WEIGHTS_NOTICE)
    if not getattr(engine, "supports_audio", True):
        _eprint("NOTE: the checkpoint has no assets/token2wav (no vocoder): answers are text only.")


def _remote_notice(url: str) -> bool:
    """Print the random-weights notice when the server at ``url`` reports ``random_weights`` in
    ``/health``. Returns whether it did."""
    from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, remote_random_weights

    if remote_random_weights(url):
        _eprint(RANDOM_WEIGHTS_NOTICE.replace("this model has", "the server's model has"))
        return True
    return False


def _bind(host: str, port: int):
    """Bind the listening socket before the banner and before the engine loads, so a port in use is
    one error line (exit :data:`EXIT_CONNECTION`) and nothing else. Returns the bound socket."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CliError(f"cannot listen on {host}:{port}: unknown host ({exc.strerror})", EXIT_CONNECTION) from exc
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: allows TIME_WAIT, not a live listener
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        import errno

        why = {errno.EADDRINUSE: "the port is already in use (another server? stop it or pass --port N)",
               errno.EADDRNOTAVAIL: "this machine has no such address (check --host)",
               errno.EACCES: "permission denied (ports below 1024 need privileges; pass --port N)"}
        raise CliError(f"cannot listen on {host}:{port}: {why.get(exc.errno, exc.strerror or exc)}",
                       EXIT_CONNECTION) from exc
    sock.set_inheritable(True)
    return sock


def _session_defaults(args, engine_name: str) -> dict:
    """SessionConfig overrides implied by the model choice and flags."""
    out: dict[str, Any] = {}
    policy = getattr(args, "answer_policy", None)
    if policy is None and engine_name == "tiny":
        policy = "on_request"
    if policy is not None:
        out["answer_policy"] = policy
    cap = getattr(args, "max_output_tokens", None)
    if cap is None and engine_name == "tiny":
        cap = TINY_MAX_OUTPUT_TOKENS
    if cap is not None:
        out["max_output_tokens"] = cap
    return out
