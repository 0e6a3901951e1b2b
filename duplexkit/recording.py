"""Conversation recordings: one folder per session with its audio, events, transcripts and metadata.

Opt-in, off by default (docs/debugging.md): ``duplexkit serve --record DIR``, ``record=DIR`` on
:class:`~duplexkit.clients.InlineDuplexClient` and :class:`~duplexkit.clients.DuplexClient`.
``duplexkit replay DIR`` (:mod:`duplexkit.replay`) turns a folder into a timeline page.

Per session, ``DIR/<session_id>/`` holds:

* ``user.wav``: 16 kHz mono PCM16. Server and inline side: the audio the Session fed the model
  (every ``AppendUnit``, padding and silence units included); remote client side: the appends the
  client sent, resampled to 16 kHz. Each piece is placed on the session clock where it ends at the
  moment it was handed over (``start = max(t_ms - duration, end of the previous piece)``).
* ``assistant_generated.wav`` and ``assistant_heard.wav``: 24 kHz mono PCM16. Each response starts
  at the session-clock time of its first audio delta, its chunks back to back; overlapping
  responses are mixed in the generated track. The heard track cuts each response at its playback
  truth (docs/concepts.md, "Playback truth"): the final ``playback.ack{truncate}`` /
  ``conversation.item.truncate`` / ``conversation.item.truncated`` value, else the highest ack or
  ``response.done.committed_ms``; a response nobody acknowledged counts as not heard.
  All three WAVs start at session time 0 and have the same length (the session's end or the last
  audio, whichever is later), so sample ``n`` of ``user.wav`` and ``n * 1.5`` of the others are the
  same instant.
* ``events.jsonl``: one JSON object a line, ``{"t_ms", "dir", "type", "event"}``; ``t_ms`` is the
  session clock (ms since the driver or the connection started), ``dir`` is ``"client"`` (client ->
  server), ``"server"`` (server -> client) or ``"engine"`` (engine commands and outputs: units,
  decisions, unit timings; server and inline side only). Audio and image payloads (base64 strings,
  data URLs) are replaced by ``{"omitted": "base64", "bytes": n}`` (the decoded size).
* ``transcript.json`` (a list: role, item and response ids, ``t_ms``, ``text``, ``heard_text``,
  ``generated_ms``, ``heard_ms``, ``status``) and ``transcript.txt`` (the same as readable lines).
* ``meta.json``: format version, session id, side, model id, the last session settings (as
  echoed, payloads omitted), ``ref_voice_sha256`` (the sha256 of the reference voice's samples as
  the session echoes it; never the audio), duplexkit / torch / Python versions, ``random_weights``,
  durations, per-response figures, and the ``capped`` / ``failed`` / ``dropped_items`` flags.
  Rewritten when the session ends (``complete: true``).

Costs and failure rules: the hooks run on the event loop and only copy small dicts (payloads are
referenced, not decoded) into a bounded queue; one writer thread per :class:`Recorder` decodes,
writes ``events.jsonl`` as it goes and the WAVs when the session ends (audio is held in memory as
int16 until then, bounded by ``max_bytes``). A full queue drops the item (counted in
``meta.json``). An ``OSError`` (disk full, permission denied) logs one warning and stops that
session's recording; the session never sees it. Over ``max_bytes`` (events + audio) recording stops
for that session and what was kept is written (``capped: true``). Retention (``keep_count`` /
``keep_days``) removes the oldest finished recording folders (those holding an ``events.jsonl``)
when a new one is created.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import datetime as _dt
import json
import logging
import os
import queue
import re
import secrets
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

from duplexkit.audio.playback import OUTPUT_RATE
from duplexkit.errors import DuplexkitError

logger = logging.getLogger("duplexkit.recording")

__all__ = ["Recorder", "SessionRecording", "RecordingError", "parse_keep", "recorder_for", "FORMAT_VERSION",
           "USER_RATE", "ASSISTANT_RATE"]

FORMAT_VERSION = 1
USER_RATE = 16_000
"""Hz of ``user.wav``."""
ASSISTANT_RATE = OUTPUT_RATE
"""Hz (the model's output rate) of ``assistant_generated.wav`` and ``assistant_heard.wav``."""

_PAYLOAD_KEYS = frozenset({"audio", "delta", "data", "ref_audio", "url", "image_url", "frame", "image"})
_B64 = re.compile(r"[A-Za-z0-9+/=_-]+")
_AUDIO_DELTAS = ("response.output_audio.delta", "response.audio.delta")
_APPENDS = ("input_audio_buffer.append",)


class RecordingError(DuplexkitError, ValueError):
    """A bad recording option (``keep``, ``max_bytes``) or a folder that is not a recording
    (:mod:`duplexkit.replay`). Code ``bad_recording``."""

    default_code = "bad_recording"


def parse_keep(text: Union[str, int, None]) -> tuple[Optional[int], Optional[float]]:
    """Parse a retention rule: ``"50"`` (keep the 50 newest recordings) or ``"7d"`` (keep 7 days).

    Returns:
        ``(keep_count, keep_days)``, one of them None; ``(None, None)`` for None or ``""``.
    Raises:
        RecordingError: anything else (a count < 1, days <= 0, an unknown suffix).
    """
    if text is None or text == "":
        return None, None
    s = str(text).strip().lower()
    try:
        if s.endswith("d"):
            days = float(s[:-1])
            if days > 0:
                return None, days
        else:
            count = int(s)
            if count >= 1:
                return count, None
    except ValueError:
        pass
    raise RecordingError(f"expected a recording retention like '50' (newest recordings kept) or '7d' (days), "
                         f"got {text!r}")


def _b64_bytes(s: str) -> int:
    if s.startswith("data:"):
        s = s.partition(",")[2]
    n = len(s)
    return max(0, n * 3 // 4 - (2 if s.endswith("==") else 1 if s.endswith("=") else 0))


def _is_payload(key: str, v: Any) -> bool:
    return (isinstance(v, str) and key in _PAYLOAD_KEYS and len(v) > 128
            and (v.startswith("data:") or bool(_B64.fullmatch(v[:64])) and bool(_B64.fullmatch(v[-8:]))))


def scrub(obj: Any, depth: int = 0) -> Any:
    """A copy of a JSON-ready event with base64 payloads and data URLs replaced by
    ``{"omitted": "base64", "bytes": n}`` (n = decoded bytes). Small dicts only are copied."""
    if depth > 12:
        return "…"
    if isinstance(obj, dict):
        return {k: ({"omitted": "base64", "bytes": _b64_bytes(v)} if _is_payload(k, v) else scrub(v, depth + 1))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v, depth + 1) for v in obj]
    return obj


def _versions() -> dict:
    from importlib import metadata

    from duplexkit import __version__

    torch = sys.modules.get("torch")
    tv = getattr(torch, "__version__", None)
    if tv is None:
        try:
            tv = metadata.version("torch")
        except Exception:
            tv = None
    return {"duplexkit": __version__, "torch": str(tv) if tv else None, "python": sys.version.split()[0]}


class Recorder:
    """Writes session recordings under ``directory`` with one writer thread and one bounded queue.

    Args:
        directory: the recordings root; ``<session_id>/`` folders are made under it (created on
            first use; a failure is a logged warning, never an exception).
        max_bytes: per-session cap on events + audio bytes (default 100 MiB); ``None`` = no cap.
        keep_count / keep_days: retention of finished recordings (see :func:`parse_keep`).
        queue_items: bound of the queue between the event loop and the writer thread.
    Raises:
        RecordingError: a non-positive ``max_bytes``, ``keep_count`` or ``keep_days``.
    """

    def __init__(self, directory: Union[str, os.PathLike], *, max_bytes: Optional[int] = 100 * 2**20,
                 keep_count: Optional[int] = None, keep_days: Optional[float] = None,
                 queue_items: int = 8192) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise RecordingError(f"max_bytes must be > 0, got {max_bytes}")
        if keep_count is not None and keep_count < 1:
            raise RecordingError(f"keep_count must be >= 1, got {keep_count}")
        if keep_days is not None and keep_days <= 0:
            raise RecordingError(f"keep_days must be > 0, got {keep_days}")
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes
        self.keep_count = keep_count
        self.keep_days = keep_days
        self._q: "queue.Queue" = queue.Queue(maxsize=queue_items)
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._active: set = set()  # folder names of sessions being recorded (never removed by retention)
        self.recorded: list[Path] = []
        """The folders of the sessions this recorder has finished writing, in order (retention may
        have removed some since: :meth:`summary` counts those still there)."""
        self._closed = False
        atexit.register(self.close)

    def open_session(self, clock: Callable[[], int], *, side: str, model_id: Optional[str] = None,
                     random_weights: Optional[bool] = None) -> "SessionRecording":
        """A recording for one session.

        Args:
            clock: the session clock in ms (``SessionDriver.now_ms``, or the client's own).
            side: ``"server"``, ``"inline"`` or ``"client"`` (the remote client's view).
            model_id: the served model id when known (else taken from ``session.created``).
            random_weights: whether the engine runs random weights (None: unknown, remote side).
        """
        return SessionRecording(self, clock, side=side, model_id=model_id, random_weights=random_weights)

    # -- the queue ------------------------------------------------------------------------------
    def _put(self, rec: "SessionRecording", item: tuple) -> None:
        if self._closed:
            return
        self._ensure_thread()
        try:
            self._q.put_nowait((rec._w, item))
        except queue.Full:
            rec._w.dropped += 1
            if not rec._w.warned_drop:
                rec._w.warned_drop = True
                logger.warning("recording fell behind (queue of %d items full): items of this session are being "
                               "dropped; the session is not affected", self._q.maxsize)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="duplexkit-recorder", daemon=True)
                    self._thread.start()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued so far is written (True) or ``timeout_s`` passed (False)."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._q.put((None, ("barrier", done)), timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def summary(self) -> tuple[int, int]:
        """``(sessions, bytes)``: the recordings this recorder finished that are still on disk, and
        the bytes of their files. Call after :meth:`close` (or :meth:`flush`) to count everything."""
        count = size = 0
        for folder in list(self.recorded):
            try:
                files = [p for p in folder.iterdir() if p.is_file()]
                size += sum(p.stat().st_size for p in files)
            except OSError:  # removed by retention (or by hand) since
                continue
            count += 1
        return count, size

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (up to ``timeout_s``) and stop the writer thread. Idempotent."""
        if self._closed:
            return
        self.flush(timeout_s)
        self._closed = True
        if self._thread is not None:
            try:
                self._q.put((None, ("stop",)), timeout=1.0)
            except queue.Full:
                pass
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            w, item = self._q.get()
            if w is None:
                if item[0] == "barrier":
                    item[1].set()
                    continue
                return
            try:
                w.handle(item)
            except OSError as exc:
                w.fail(exc)
            except Exception:  # a recorder bug must never reach a session
                logger.exception("recording item failed")

    # -- retention (writer thread) ----------------------------------------------------------------
    def _retain(self) -> None:
        if self.keep_count is None and self.keep_days is None:
            return
        try:
            folders = [p for p in self.directory.iterdir()
                       if p.is_dir() and (p / "events.jsonl").is_file() and p.name not in self._active]
        except OSError:
            return
        folders.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        doomed = []
        if self.keep_days is not None:
            limit = time.time() - self.keep_days * 86400
            doomed += [p for p in folders if p.stat().st_mtime < limit]
        if self.keep_count is not None:
            # the new session's folder counts as one of the kept
            doomed += folders[max(0, self.keep_count - len(self._active)):]
        for p in set(doomed):
            shutil.rmtree(p, ignore_errors=True)
            logger.info("recording %s removed (retention)", p.name)


_CLIENT_RECORDERS: dict = {}
_CLIENT_LOCK = threading.Lock()


def recorder_for(record: Union[str, os.PathLike, Recorder]) -> Recorder:
    """The :class:`Recorder` a client's ``record=`` option names: the object itself, or one shared
    recorder per resolved directory in this process (default caps)."""
    if isinstance(record, Recorder):
        return record
    key = str(Path(record).expanduser().resolve())
    with _CLIENT_LOCK:
        rec = _CLIENT_RECORDERS.get(key)
        if rec is None or rec._closed:
            rec = _CLIENT_RECORDERS[key] = Recorder(key)
        return rec


class SessionRecording:
    """One session's recording: an observer for :class:`duplexkit.driver.SessionDriver`
    (``engine_command``, ``engine_output``, ``server_event``, ``client_event``) that the remote client
    also feeds by hand. Every method is cheap, runs on the caller's thread and never raises.

    ``client_event(raw, input_format=None)``: a client event (dict, or its JSON text); with an
    ``input_format`` (:class:`duplexkit.audio.InputFormat`, the remote client side) appends are
    decoded as the user's audio. ``server_event(ev)``: a server event (dict or JSON text).
    """

    def __init__(self, recorder: Recorder, clock: Callable[[], int], *, side: str, model_id: Optional[str],
                 random_weights: Optional[bool]) -> None:
        self.recorder = recorder
        self.clock = clock
        self.closed = False
        self._w = _Writer(recorder, side, model_id, random_weights)

    def _now(self) -> int:
        try:
            return int(self.clock())
        except Exception:
            return 0

    def _put(self, *item) -> None:
        if not self.closed and not self._w.stopped:
            self.recorder._put(self, item)

    @property
    def folder(self) -> Optional[Path]:
        """The session's folder once known (after ``session.created`` was seen by the writer)."""
        return self._w.folder

    # -- driver observer hooks ------------------------------------------------------------------
    def engine_command(self, cmd: Any) -> None:
        try:
            kind = type(cmd).__name__
            t = self._now()
            if kind == "AppendUnit":
                self._put("unit", t, {"unit_index": int(cmd.unit_index), "epoch": int(cmd.epoch),
                                      "is_silence": bool(cmd.is_silence), "force_listen": bool(cmd.force_listen),
                                      "force_speak": bool(cmd.force_speak)}, cmd.audio)
            else:
                ev = {"type": "engine." + _snake(kind), "epoch": getattr(cmd, "epoch", None)}
                for f in ("request_id", "item_id", "text"):
                    if getattr(cmd, f, None):
                        ev[f] = getattr(cmd, f)
                self._put("engine", t, ev)
        except Exception:
            logger.debug("recording engine_command failed", exc_info=True)

    def engine_output(self, out: Any) -> None:
        try:
            kind = type(out).__name__
            if kind in ("AudioChunk", "TextDelta"):
                return  # the server events carry them
            ev: dict = {"type": "engine." + _snake(kind), "epoch": getattr(out, "epoch", None),
                        "unit_index": getattr(out, "unit_index", None)}
            if kind == "Decision":
                ev.update(decision=out.decision, turn_start=bool(out.turn_start))
            elif kind == "UnitTimings":
                ev["timings"] = {k: v for k, v in (out.timings or {}).items() if isinstance(v, (int, float, str))}
            elif kind == "TurnEnd":
                ev["reason"] = out.reason
            elif kind == "EngineFailure":
                ev.update(code=out.code, message=out.message, fatal=bool(out.fatal))
            elif kind == "ToolDecision":
                ev.update(request_id=out.request_id, calls=[getattr(c, "name", str(c)) for c in out.calls],
                          error=out.error, elapsed_ms=out.elapsed_ms, final=bool(out.final))
            elif kind == "Transcription":
                ev.update(item_id=out.item_id, text=out.text, error=out.error, elapsed_ms=out.elapsed_ms)
            self._put("engine", self._now(), ev)
        except Exception:
            logger.debug("recording engine_output failed", exc_info=True)

    def server_event(self, ev: Any) -> None:
        try:
            t = self._now()
            if isinstance(ev, (str, bytes)):
                self._put("server_text", t, ev)
                return
            if not isinstance(ev, dict):
                ev = ev.model_dump(exclude_none=True) if hasattr(ev, "model_dump") else dict(ev)
            payload = ev.get("delta") if ev.get("type") in _AUDIO_DELTAS else None
            self._put("server", t, scrub(ev), payload)
        except Exception:
            logger.debug("recording server_event failed", exc_info=True)

    def client_event(self, raw: Any, input_format: Any = None) -> None:
        try:
            t = self._now()
            if isinstance(raw, (str, bytes, bytearray)):
                self._put("client_text", t, bytes(raw) if isinstance(raw, bytearray) else raw, input_format)
            elif isinstance(raw, dict):
                payload = raw.get("audio") if raw.get("type") in _APPENDS and input_format is not None else None
                self._put("client", t, scrub(raw), payload, input_format)
        except Exception:
            logger.debug("recording client_event failed", exc_info=True)

    def close(self) -> None:
        """End the recording: the writer writes the WAVs, transcripts and final ``meta.json``."""
        if self.closed:
            return
        t = self._now()
        self.closed = True
        if not self._w.stopped:
            self.recorder._put(self, ("close", t))


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class _Track:
    """Pieces of int16 audio placed on the session clock (samples at ``rate``)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.pieces: list = []  # (start sample, int16 array)
        self.end = 0

    def place_ending_at(self, t_ms: int, x: np.ndarray) -> int:
        start = max(int(t_ms) * self.rate // 1000 - len(x), self.end, 0)
        self.pieces.append((start, x))
        self.end = start + len(x)
        return start

    def render(self, n: int, mix: bool = False) -> np.ndarray:
        out = np.zeros(n, np.int32 if mix else np.int16)
        for start, x in self.pieces:
            seg = x[: max(0, n - start)]
            if mix:
                out[start:start + len(seg)] += seg
            else:
                out[start:start + len(seg)] = seg
        return np.clip(out, -32768, 32767).astype(np.int16) if mix else out


def _i16(x: np.ndarray) -> np.ndarray:
    return (np.clip(np.asarray(x, np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)


class _Writer:
    """The writer thread's state of one session (touched by that thread only, except the flags)."""

    def __init__(self, recorder: Recorder, side: str, model_id: Optional[str], random_weights: Optional[bool]) -> None:
        self.recorder = recorder
        self.side = side
        self.model_id = model_id
        self.random_weights = random_weights
        self.started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.folder: Optional[Path] = None
        self.session_id: Optional[str] = None
        self.pending: list = []
        self.fh = None
        self.stopped = False  # failed or closed: nothing more is queued
        self.failed: Optional[str] = None
        self.capped = False
        self.dropped = 0
        self.warned_drop = False
        self.bytes = 0
        self.last_t = 0
        self.session_obj: Optional[dict] = None
        self.user = _Track(USER_RATE)
        self.decoder = None
        self.resampler = None
        self.fmt = None
        self.responses: dict = {}  # response id -> figures and audio
        self.order: list = []
        self.item_to_resp: dict = {}
        self.transcript: list = []  # user items and assistant responses, in order

    # -- dispatch -----------------------------------------------------------------------------------
    def handle(self, item: tuple) -> None:
        if self.stopped:
            return
        kind, t = item[0], item[1]
        self.last_t = max(self.last_t, t)
        if kind == "close":
            self.finish(t)
            return
        if kind == "server_text":
            ev = _loads(item[2])
            payload = ev.get("delta") if ev.get("type") in _AUDIO_DELTAS else None
            kind, item = "server", ("server", t, scrub(ev), payload)
        elif kind == "client_text":
            ev = _loads(item[2])
            fmt = item[3]
            payload = ev.get("audio") if ev.get("type") in _APPENDS and fmt is not None else None
            kind, item = "client", ("client", t, scrub(ev), payload, fmt)
        if kind == "server":
            self.on_server(t, item[2], item[3])
        elif kind == "client":
            self.on_client(t, item[2], item[3], item[4])
        elif kind == "unit":
            meta, audio = item[2], item[3]
            x = _i16(audio)
            if self.keep_bytes(2 * len(x)):
                start = self.user.place_ending_at(t, x)
                meta = dict(meta, audio_start_ms=start * 1000 // USER_RATE, audio_ms=len(x) * 1000 // USER_RATE)
            self.record(t, "engine", {"type": "engine.append_unit", **meta})
        elif kind == "engine":
            self.record(t, "engine", item[2])

    def keep_bytes(self, n: int) -> bool:
        cap = self.recorder.max_bytes
        if self.capped:
            return False
        if cap is not None and self.bytes + n > cap:
            self.capped = True
            logger.warning("recording of %s reached its size cap (%d bytes): nothing more is recorded for this "
                           "session", self.session_id or "a session", cap)
            return False
        self.bytes += n
        return True

    def record(self, t: int, direction: str, ev: dict) -> None:
        line = json.dumps({"t_ms": t, "dir": direction, "type": ev.get("type"), "event": ev},
                          separators=(",", ":"), default=str) + "\n"
        if not self.keep_bytes(len(line)):
            return
        if self.folder is None:
            self.pending.append(line)
            if len(self.pending) > 10_000:  # no session.created ever: give it a name now
                self.open_folder("rec_" + secrets.token_hex(8))
            return
        self.fh.write(line)

    def open_folder(self, session_id: str) -> None:
        rec = self.recorder
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", session_id)[:80] or "session"
        folder = rec.directory / name
        if folder.exists():
            folder = rec.directory / f"{name}_{secrets.token_hex(3)}"
        self.session_id = session_id
        rec._active.add(folder.name)
        folder.mkdir(parents=True)
        self.folder = folder
        rec._retain()
        self.fh = open(folder / "events.jsonl", "w", encoding="utf-8")
        for line in self.pending:
            self.fh.write(line)
        self.pending = []
        self.write_meta(complete=False)

    def fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning("recording of %s stopped: %s (the session goes on)", self.session_id or "a session",
                           self.failed)
        self.stopped = True
        self.pending, self.user.pieces, self.responses = [], [], {}
        if self.fh is not None:
            try:
                self.fh.close()
            except OSError:
                pass
        if self.folder is not None:
            self.recorder._active.discard(self.folder.name)

    # -- events -------------------------------------------------------------------------------------
    def resp(self, rid: Optional[str]) -> Optional[dict]:
        if not rid:
            return None
        r = self.responses.get(rid)
        if r is None:
            r = self.responses[rid] = {"id": rid, "item_id": None, "created_ms": None, "start_ms": None,
                                       "chunks": [], "samples": 0, "sent_ms": 0, "heard_ms": 0, "final": False,
                                       "text": "", "marks": [], "status": None, "trigger": None}
            self.order.append(rid)
            self.transcript.append(("assistant", rid))
        return r

    def heard(self, r: dict, ms: Any, final: bool) -> None:
        if not isinstance(ms, (int, float)) or r["final"] and not final:
            return
        ms = int(min(ms, r["sent_ms"])) if r["sent_ms"] else int(ms)
        r["heard_ms"] = ms if final else max(r["heard_ms"], ms)
        r["final"] = r["final"] or final

    def on_server(self, t: int, ev: dict, payload: Optional[str]) -> None:
        typ = ev.get("type")
        if typ in ("session.created", "session.updated") and isinstance(ev.get("session"), dict):
            self.session_obj = ev["session"]
            if self.folder is None and typ == "session.created":
                self.record(t, "server", ev)
                self.open_folder(str(ev["session"].get("id") or "sess_" + secrets.token_hex(12)))
                return
        elif typ == "response.created":
            r = self.resp((ev.get("response") or {}).get("id"))
            if r is not None:
                r["created_ms"] = t
                r["trigger"] = (ev.get("response") or {}).get("trigger")
        elif typ in _AUDIO_DELTAS:
            r = self.resp(ev.get("response_id"))
            if r is not None:
                r["item_id"] = r["item_id"] or ev.get("item_id")
                if ev.get("item_id"):
                    self.item_to_resp[ev["item_id"]] = r["id"]
                if r["start_ms"] is None:
                    r["start_ms"] = t
                md = ev.get("metadata") or {}
                if isinstance(payload, str):
                    try:
                        raw = base64.b64decode(payload)
                        x = np.frombuffer(raw[: len(raw) // 2 * 2], "<i2").copy()
                    except (binascii.Error, ValueError):
                        x = np.zeros(0, np.int16)
                    if self.keep_bytes(2 * len(x)):
                        r["chunks"].append(x)
                    r["samples"] += len(x)
                r["sent_ms"] = int(md.get("audio_duration_ms") or r["samples"] * 1000 // ASSISTANT_RATE)
                r["marks"] += [m for m in (md.get("audio_text_marks") or []) if isinstance(m, dict)]
        elif typ in ("response.output_audio_transcript.delta", "response.audio_transcript.delta",
                     "response.output_text.delta", "response.text.delta"):
            r = self.resp(ev.get("response_id"))
            if r is not None and isinstance(ev.get("delta"), str):
                r["text"] += ev["delta"]
        elif typ == "response.output_item.added":
            item = ev.get("item") or {}
            if item.get("id") and ev.get("response_id"):
                self.item_to_resp[item["id"]] = ev["response_id"]
        elif typ == "response.done":
            resp = ev.get("response") or {}
            r = self.resp(resp.get("id"))
            if r is not None:
                r["status"] = resp.get("status")
                self.heard(r, resp.get("committed_ms"), False)
        elif typ == "conversation.item.truncated":
            r = self.responses.get(self.item_to_resp.get(ev.get("item_id")))
            if r is not None:
                self.heard(r, ev.get("audio_end_ms"), True)
        elif typ == "conversation.item.input_audio_transcription.completed":
            self.transcript.append(("user", {"item_id": ev.get("item_id"), "t_ms": t,
                                             "text": ev.get("transcript") or ""}))
        self.record(t, "server", ev)

    def on_client(self, t: int, ev: dict, payload: Optional[str], fmt: Any) -> None:
        typ = ev.get("type")
        if typ in ("playback.ack", "audio.playback_ack"):
            r = self.responses.get(ev.get("response_id"))
            if r is not None:
                self.heard(r, ev.get("played_ms"), bool(ev.get("truncate")))
        elif typ == "conversation.item.truncate":
            r = self.responses.get(self.item_to_resp.get(ev.get("item_id")))
            if r is not None:
                self.heard(r, ev.get("audio_end_ms"), True)
        elif typ in _APPENDS and isinstance(payload, str) and fmt is not None:
            self.user_append(t, payload, fmt)
        self.record(t, "client", ev)

    def user_append(self, t: int, payload: str, fmt: Any) -> None:
        from duplexkit.audio import StreamDecoder, StreamResampler

        if fmt != self.fmt:
            self.fmt, self.decoder, self.resampler = fmt, StreamDecoder(fmt), StreamResampler(fmt.rate, USER_RATE)
        try:
            x = self.decoder.decode(base64.b64decode(payload))
        except Exception:
            return
        y = _i16(self.resampler.process(x))
        if len(y) and self.keep_bytes(2 * len(y)):
            self.user.place_ending_at(t, y)

    # -- the end ------------------------------------------------------------------------------------
    def finish(self, t_end: int) -> None:
        if self.folder is None:
            self.open_folder("rec_" + secrets.token_hex(8))
        self.stopped = True
        self.fh.close()
        import soundfile as sf

        gen, heard = _Track(ASSISTANT_RATE), _Track(ASSISTANT_RATE)
        n_a = 0
        for rid in self.order:
            r = self.responses[rid]
            if r["start_ms"] is None or not r["chunks"]:
                continue
            x = np.concatenate(r["chunks"])
            start = r["start_ms"] * ASSISTANT_RATE // 1000
            gen.pieces.append((start, x))
            cut = x[: r["heard_ms"] * ASSISTANT_RATE // 1000]
            if len(cut):
                heard.pieces.append((start, cut))
            n_a = max(n_a, start + len(x))
        dur_ms = max(t_end, self.last_t, self.user.end * 1000 // USER_RATE, -(-n_a * 1000 // ASSISTANT_RATE))
        sf.write(self.folder / "user.wav", self.user.render(dur_ms * USER_RATE // 1000), USER_RATE, subtype="PCM_16")
        n = dur_ms * ASSISTANT_RATE // 1000
        sf.write(self.folder / "assistant_generated.wav", gen.render(n, mix=True), ASSISTANT_RATE, subtype="PCM_16")
        sf.write(self.folder / "assistant_heard.wav", heard.render(n, mix=True), ASSISTANT_RATE, subtype="PCM_16")
        self.write_transcripts()
        self.write_meta(complete=True, duration_ms=dur_ms)
        self.recorder._active.discard(self.folder.name)
        self.recorder.recorded.append(self.folder)
        self.user.pieces, self.responses = [], {}
        logger.info("recording of %s written to %s", self.session_id, self.folder)

    def response_rows(self) -> list:
        rows = []
        for rid in self.order:
            r = self.responses[rid]
            chars = 0
            for m in r["marks"]:
                if isinstance(m.get("audio_end_ms"), (int, float)) and m["audio_end_ms"] <= r["heard_ms"]:
                    chars = max(chars, int(m.get("text_chars") or 0))
            rows.append({"role": "assistant", "response_id": rid, "item_id": r["item_id"],
                         "t_ms": r["start_ms"] if r["start_ms"] is not None else r["created_ms"],
                         "created_ms": r["created_ms"], "first_audio_ms": r["start_ms"],
                         "text": r["text"], "heard_text": r["text"][:chars] if r["marks"] else r["text"],
                         "generated_ms": r["sent_ms"], "heard_ms": r["heard_ms"], "heard_final": r["final"],
                         "status": r["status"], "trigger": r["trigger"]})
        return rows

    def write_transcripts(self) -> None:
        by_id = {row["response_id"]: row for row in self.response_rows()}
        rows = []
        for role, x in self.transcript:
            if role == "user":
                rows.append({"role": "user", "item_id": x["item_id"], "t_ms": x["t_ms"], "text": x["text"]})
            elif x in by_id:
                rows.append(by_id[x])
        _write_whole(self.folder / "transcript.json", json.dumps(rows, indent=1, ensure_ascii=False))
        lines = []
        for row in rows:
            t = row.get("t_ms") or 0
            stamp = f"[{t // 60000:02d}:{t % 60000 / 1000:06.3f}]"
            if row["role"] == "user":
                lines.append(f"{stamp} user: {row['text']}")
            else:
                cut = "" if row["heard_text"] == row["text"] else f"  (heard: {row['heard_text']!r})"
                lines.append(f"{stamp} assistant [{row['status']}, generated {row['generated_ms']} ms, heard "
                             f"{row['heard_ms']} ms]: {row['text']}{cut}")
        _write_whole(self.folder / "transcript.txt", "\n".join(lines) + "\n")

    def write_meta(self, *, complete: bool, duration_ms: Optional[int] = None) -> None:
        s = self.session_obj or {}
        ref = s.get("ref_audio") if isinstance(s.get("ref_audio"), dict) else None
        meta = {
            "format": "duplexkit-recording", "format_version": FORMAT_VERSION, "complete": complete,
            "session_id": self.session_id, "side": self.side, "started_at": self.started_at,
            "model": self.model_id or s.get("model"), "random_weights": self.random_weights,
            "ref_voice_sha256": (ref or {}).get("sha256"), "ref_voice_duration_ms": (ref or {}).get("duration_ms"),
            "versions": _versions(), "duration_ms": duration_ms, "session": s,
            "files": {"user": "user.wav", "assistant_generated": "assistant_generated.wav",
                      "assistant_heard": "assistant_heard.wav", "events": "events.jsonl",
                      "transcript": "transcript.json"},
            "rates_hz": {"user": USER_RATE, "assistant": ASSISTANT_RATE},
            "responses": [{k: row[k] for k in ("response_id", "first_audio_ms", "generated_ms", "heard_ms",
                                                 "status", "trigger")} for row in self.response_rows()]
            if complete else [],
            "bytes": self.bytes, "max_bytes": self.recorder.max_bytes, "capped": self.capped,
            "dropped_items": self.dropped, "failed": self.failed,
        }
        _write_whole(self.folder / "meta.json", json.dumps(meta, indent=1, default=str))


def _write_whole(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` so that a reader sees the old file or the whole new one, never
    a part: into a temporary file beside it, then ``os.replace`` (atomic on POSIX). ``meta.json`` is
    rewritten while a session runs and read by ``duplexkit replay`` and by tools watching the folder."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _loads(raw: Union[str, bytes]) -> dict:
    try:
        ev = json.loads(raw)
    except ValueError:
        return {"type": "<invalid_json>", "bytes": len(raw)}
    return ev if isinstance(ev, dict) else {"type": "<not_an_object>", "bytes": len(raw)}


# -- the server's side ----------------------------------------------------------------------------

RECORD_POLICIES = ("all", "opt-in", "always")
"""``duplexkit serve --record-policy`` values (docs/server.md, "Recording")."""

_YES = {"1", "true", "on", "yes"}
_NO = {"0", "false", "off", "no"}


def session_record_choice(settings: Any, raw: Optional[str]) -> tuple[bool, Optional[str]]:
    """Whether a realtime session is recorded, from the server settings (``record_dir``,
    ``record_policy``) and the handshake's ``record`` query parameter (``raw``, None when absent).

    Returns:
        ``(record, refusal)``: ``refusal`` is a message for a handshake ``bad_event`` (param
        ``record``) when the request cannot be honoured: ``record=1`` on a server without
        ``--record``, ``record=0`` under policy ``always``, or a value that is not 1/0/true/false/on/off.
        The override is honoured or refused, never silently ignored.
    """
    want = None
    if raw is not None:
        v = raw.strip().lower()
        if v in _YES:
            want = True
        elif v in _NO:
            want = False
        else:
            return False, f"record must be 1 or 0 (true/false, on/off), got {raw[:32]!r}"
    if getattr(settings, "record_dir", None) is None:
        if want:
            return False, "this server does not record sessions (it runs without --record): record=1 refused"
        return False, None
    policy = getattr(settings, "record_policy", "all")
    if policy == "always":
        if want is False:
            return False, ("this server records every session (--record-policy always): record=0 refused; "
                           "connect elsewhere if the session must not be recorded")
        return True, None
    if policy == "opt-in":
        return bool(want), None
    return want is not False, None


def server_recorder(state: Any) -> Recorder:
    """The server's :class:`Recorder` (one per server state, made on first use from its settings).

    Raises:
        RecordingError: a bad ``record_keep`` or ``record_max_mb``.
    """
    rec = getattr(state, "recorder", None)
    if rec is None:
        s = state.settings
        count, days = parse_keep(getattr(s, "record_keep", None))
        mb = getattr(s, "record_max_mb", 100.0)
        rec = Recorder(s.record_dir, max_bytes=int(mb * 2**20) if mb else None, keep_count=count, keep_days=days)
        state.recorder = rec
    return rec


def attach_server_recording(state: Any, driver: Any) -> Optional[SessionRecording]:
    """Record the session ``driver`` runs (an observer added to it); None if the recorder cannot be
    made (a bad setting: logged once, the session goes on)."""
    try:
        rec = server_recorder(state)
    except RecordingError as exc:
        if not getattr(state, "_record_warned", False):
            state._record_warned = True
            logger.warning("recording is off: %s", exc)
        return None
    engine = getattr(state, "engine", None)
    r = rec.open_session(driver.now_ms, side="server", model_id=getattr(state, "model_id", None),
                         random_weights=getattr(engine, "random_weights", None))
    driver.add_observer(r)
    return r
