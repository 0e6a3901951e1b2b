"""Session settings: ``session.update`` validation (formats, modalities, voices, turn detection,
the vLLM-Omni fields, warnings) and the engine :class:`StreamConfig` derived from them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Union

from duplexkit.audio import AudioFormatError, InputFormat
from duplexkit.engine.api import (
    OUTPUT_SAMPLE_RATE,
    ReferenceVoice,
    StreamConfig,
    UpdateStream,
)
from duplexkit.protocol import (
    UNHONOURED_SESSION_FIELDS,
    ErrorCode,
    ProtocolError,
    SessionPatch,
    SessionUpdateEvent,
    SessionUpdated,
)
from duplexkit.protocol.vocabulary import ENCODINGS, FORMAT_TYPE_ENCODINGS, PCM_RATE
from duplexkit.protocol.vocabulary import default_rate as format_default_rate
from duplexkit.session.conversation import REPREFILL_WARNING
from duplexkit.session.machine import Phase
from duplexkit.session.tools import DEFAULT_TOOL_FILLER, DEFAULT_TOOL_PROGRESS, parse_tool_choice, parse_tools, \
    parse_transcription
from duplexkit.session.voice import apply_voice
from duplexkit.session.wire import session_object

log = logging.getLogger("duplexkit.session")


@dataclass
class _Settings:
    output_modalities: list
    instructions: Optional[str]
    voice: str
    ref_voice: Optional[ReferenceVoice]
    ref_from_client: bool
    input_format: InputFormat
    turn_detection: Optional[dict]
    temperature: float
    max_output_tokens: Union[int, str]
    force_listen_count: int
    answer_policy: str
    playback_commit_policy: str
    seed: Optional[int] = None
    early_unit_close: bool = True
    tools: list = field(default_factory=list)
    tool_choice: Union[str, dict] = "auto"
    transcription: Optional[dict] = None
    tool_filler: str = DEFAULT_TOOL_FILLER
    tool_progress: Optional[dict] = field(default_factory=lambda: dict(DEFAULT_TOOL_PROGRESS))

    def copy(self) -> "_Settings":
        s = _Settings(**self.__dict__)
        s.output_modalities = list(self.output_modalities)
        s.tools = list(self.tools)
        s.turn_detection = dict(self.turn_detection) if self.turn_detection is not None else None
        return s


#: OpenAI semantic_vad eagerness -> server VAD silence_duration_ms (ms). Our choice: OpenAI documents
#: only the order (high answers soonest, low waits longest; auto = medium), not durations.
SEMANTIC_VAD_SILENCE_MS = {"high": 300, "medium": 500, "auto": 500, "low": 1000}


_NO_VOCODER = ("this server has no vocoder (its checkpoint lacks assets/token2wav), so it answers in text only: "
               "expected output_modalities ['text']")


def _vad_classes():
    """The server VAD from duplexkit.audio (None when it is not available)."""
    try:
        import webrtcvad  # noqa: F401  (webrtcvad-wheels)

        from duplexkit.audio import StreamingVAD, VadConfig  # noqa: WPS433
    except ImportError:
        return None
    return StreamingVAD, VadConfig


def _prefix_key(c: StreamConfig) -> tuple:
    """The text parts of the session prefix the engine prefills (docs/model.md §5.1)."""
    return (c.instructions, c.seed_text)


#: First line of the conversation transcript a re-prefill adds to the system text (docs/protocol.md §4.1).
HISTORY_HEADER = ("The conversation so far (a text transcript of what was said and heard before these "
                  "instructions took effect, not the audio):")
#: At most this many characters of transcript lines (the most recent whole lines; about 1000 tokens).
HISTORY_MAX_CHARS = 4000
#: A user turn without a transcript (no ``transcription`` set).
USER_SPOKE = "[the user spoke; no transcript]"


def _config_key(c: StreamConfig) -> tuple:
    """StreamConfig identity without comparing numpy arrays (the voice compares by sha256)."""
    return (c.instructions, c.ref_voice.sha256 if c.ref_voice is not None else None, c.output_audio,
            c.temperature, c.seed, c.force_listen_count, c.seed_text)


_PLAIN_FIELDS = (
    ("temperature", float), ("max_output_tokens", lambda v: v), ("force_listen_count", int),
    ("answer_policy", lambda v: v), ("seed", int), ("playback_commit_policy", lambda v: v),
    ("early_unit_close", bool),
)
"""``session.update`` fields applied as they come (the pydantic model validated them), with the
conversion each gets."""

def parse_input_format(p: SessionPatch, cur: InputFormat, default_rate: int, err) -> InputFormat:
    """The input format of a ``session.update`` (docs/protocol.md §6.1, channels included).

    Spellings: a beta string (``pcm16`` | ``pcm_f32le`` | ``g711_ulaw`` | ``g711_alaw`` |
    ``audio/pcm``) with the flat ``sample_rate_hz``; a GA object ``{type, rate}`` which also
    takes the keys the server itself echoes (``sample_rate_hz``, ``encoding: "pcm_f32le"``), so
    a client may send the session object back unchanged. Channels: ``channels`` in the GA
    object or flat (``channels`` / ``input_audio_channels``), 1..8 interleaved channels
    downmixed to mono by their mean (:class:`~duplexkit.audio.InputFormat`); a format given
    without a channel count is mono, a channel count given alone keeps the current encoding
    and rate. Anything else is ``unsupported_audio_format`` (never read as mono).
    """
    flat_ch = p.input_channels if "input_channels" in p.given else None
    if p.input_format is None and "input_sample_rate_hz" not in p.given:
        # only a channel count: same encoding and rate
        try:
            return InputFormat(cur.encoding, cur.rate, flat_ch if flat_ch is not None else cur.channels)
        except AudioFormatError as e:
            raise err(ErrorCode.UNSUPPORTED_AUDIO_FORMAT, str(e), "input_channels") from None
    f = p.input_format if p.input_format is not None else "pcm16"
    explicit = p.input_sample_rate_hz
    duplex_default = default_rate
    bad = ErrorCode.UNSUPPORTED_AUDIO_FORMAT
    try:
        if isinstance(f, str):
            enc = f if f in ENCODINGS else (FORMAT_TYPE_ENCODINGS[f] if f == "audio/pcm" else None)
            if enc is None:
                raise err(bad, f"expected an input format of pcm16, pcm_f32le, g711_ulaw, g711_alaw or audio/pcm, got {f!r}", "input_format")
            if enc.startswith("g711"):
                rate = 8000 if explicit is None else explicit
            else:
                rate = explicit if explicit is not None else duplex_default
            return InputFormat(enc, rate, 1 if flat_ch is None else flat_ch)
        t = f.get("type")
        enc = FORMAT_TYPE_ENCODINGS.get(t)
        if enc is None:
            raise err(bad, f"expected an input format type of audio/pcm, audio/pcm_f32le, audio/pcmu or audio/pcma, got {t!r}", "input_format")
        if enc == "pcm16" and f.get("encoding") is not None:
            if f["encoding"] not in ("pcm16", "pcm_f32le"):
                raise err(bad, f"expected encoding pcm16 or pcm_f32le with type audio/pcm, got {f['encoding']!r}", "input_format")
            enc = f["encoding"]
        rates = [v for v in (f.get("rate"), f.get("sample_rate_hz"), explicit) if v is not None]
        for v in rates:
            if isinstance(v, bool) or not isinstance(v, int):
                raise err(bad, f"expected an integer input rate in Hz, got {v!r}", "input_format")
        if len(set(rates)) > 1:
            raise err(bad, f"conflicting input rates {sorted(set(rates))} Hz (rate, sample_rate_hz)", "input_format")
        rate = rates[0] if rates else format_default_rate(enc)
        ch = f.get("channels")
        if ch is not None and flat_ch is not None and ch != flat_ch:
            raise err(bad, f"conflicting channel counts {ch!r} (format.channels) and {flat_ch!r} (channels)", "input_format")
        ch = ch if ch is not None else (1 if flat_ch is None else flat_ch)
        return InputFormat(enc, rate, ch)
    except AudioFormatError as e:
        raise err(bad, str(e), "input_format") from None


class Settings:
    """The settings part of :class:`~duplexkit.session.Session`: the ``session.update`` job and the
    engine stream's configuration.

    Args:
        s: the Session (its ``out`` outbox and the other parts' methods).

    State: the current settings (:attr:`current`, what ``Session.settings`` returns), the session
    prefix's text parts (system text items, seed text), and what the engine stream was last given.
    """

    def __init__(self, s) -> None:
        self._s = s
        self._o = s.out
        self.tracing_honoured = False  # set by a shell that traces the session (duplexkit.tracing)
        cfg = self._o.cfg
        duplex = self._o.duplex
        self._vad_cls = _vad_classes() if cfg.vad_available else None
        td = None
        if self._vad_cls is not None:
            td = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
                  "interrupt_response": True, "create_response": not duplex}
        self.current = _Settings(
            output_modalities=["audio", "text"] if cfg.audio_output_available else ["text"],
            instructions=cfg.default_instructions,
            voice="default",
            ref_voice=cfg.default_voice,
            ref_from_client=False,
            input_format=InputFormat("pcm16", cfg.limits.input_default_rate if duplex else PCM_RATE),
            turn_detection=td,
            temperature=float(cfg.temperature),
            max_output_tokens=cfg.max_output_tokens,
            force_listen_count=0,
            answer_policy=cfg.answer_policy or ("model" if duplex else "on_request"),
            playback_commit_policy="ack_only" if duplex else "commit_on_done",
            seed=cfg.seed,
            early_unit_close=duplex,
        )
        self._seed_text: list[str] = []
        self._system_text: list[str] = []
        self._seed_item_ids: set = set()  # user text items that went into the seed text (before the first unit)
        self._engine_config: Optional[StreamConfig] = None  # the config the engine stream has (last sent)
        self._engine_prefix: tuple = (None, None)  # (instructions, seed text) the engine was last given
        self._prefix_pending = False  # a new session prefix waits for a turn boundary (sync_stream)
        self._free_units: set = set()  # appended units not forced to listen (pruned to those in flight)
        self._update_warnings: list = []

    # -- what the other parts ask -----------------------------------------------------------------
    def vad_classes(self):
        """``(StreamingVAD, VadConfig)``, or None when the server VAD cannot run."""
        return self._vad_cls

    def session_object(self):
        return session_object(self.current, self._o.session_id, self._o.cfg, self._o.epoch, self._o.duplex)

    def open_stream(self) -> StreamConfig:
        """The config of the engine stream being opened (``OpenStream``)."""
        self._engine_config = self._stream_config()
        self._engine_prefix = (self._engine_config.instructions, self._engine_config.seed_text)
        return self._engine_config

    def prefix_pending(self) -> bool:
        """A new session prefix waits for a turn boundary (:meth:`sync_stream`)."""
        return self._prefix_pending

    def note_free_unit(self, unit_index: int, in_flight: set) -> None:
        """An appended unit the model may start a turn in (not forced to listen); the set is kept
        bounded to the units still ``in_flight``."""
        self._free_units.add(unit_index)
        if len(self._free_units) > 64:
            self._free_units &= in_flight | {unit_index}

    def add_system_text(self, text: str) -> None:
        """A system message item: part of the session prefix."""
        self._system_text.append(text)

    def add_seed_text(self, text: str, item_id: str) -> None:
        """A user text item before the first unit: seeds the session prefix (docs/model.md §5.1)."""
        self._seed_text.append(text)
        self._seed_item_ids.add(item_id)

    def on_session_update(self, ev: SessionUpdateEvent, now_ms: float, first: bool = False) -> None:
        self._update_warnings = []
        new = self._validated_settings(ev.session, ev.event_id)  # a first update's error precedes session.created
        for path in ev.session.ignored:  # accepted, not honoured (docs/protocol.md §4.1)
            if path == "tracing" and self.tracing_honoured:
                continue
            self._update_warnings.append(("field_ignored", f"session.{path} is accepted but not honoured: "
                                          + UNHONOURED_SESSION_FIELDS[path][1], "session." + path))
        warnings, self._update_warnings = self._update_warnings, []
        old = self.current
        self.current = new
        if new.input_format != old.input_format:
            self._s.input.set_format(new.input_format)
        if new.turn_detection != old.turn_detection:
            self._s.input.make_vad()
        if first and not self._s.started:
            self._s.start(now_ms)
            for w in warnings:
                self._o.warn(*w)
            return
        self._o.emit(SessionUpdated(session=self.session_object()))
        for w in warnings:
            self._o.warn(*w)
        self.sync_stream()

    def _at_turn_boundary(self) -> bool:
        """True when the duplex model is between turns and cannot open one before a command sent
        now: no response is active (none requested, none speaking), the phase is idle, and every
        appended unit still awaiting its decision was forced to listen (answer policy ``on_request``,
        the tool gate, ``force_listen_count``), so none of them can start a turn ahead of it."""
        if self._o.phase is not Phase.IDLE or self._s.active_response_id is not None:
            return False
        waiting = self._s.input.units_in_flight()
        self._free_units &= waiting
        return not self._free_units

    def sync_stream(self) -> None:
        """Bring the engine stream's configuration up to the settings (one ``UpdateStream``).

        A new session prefix (instructions, system text items, seed text: docs/model.md §5.1) makes
        the engine re-prefill the model's context, which drops what the model heard and said. Before
        the first unit that costs nothing and is sent at once. After it, the prefix is held back
        until :meth:`_at_turn_boundary` (checked after every engine output and tick), so no turn is
        cut, and the re-prefilled system text ends with a transcript of the conversation so far
        (:meth:`_history_text`), so the model keeps it as text; changes of the other fields (voice,
        temperature, ...) are sent at once with the prefix the engine already has (docs/protocol.md
        §4.1, "Instructions after the first unit").
        """
        if self._engine_config is None:  # the stream is not open yet
            return
        want = self._stream_config()
        have = self._engine_config
        key = _prefix_key(want)
        self._prefix_pending = False
        if have is not None and key != self._engine_prefix:
            if self._s.input.units_appended() > 0 and not self._at_turn_boundary():
                self._prefix_pending = True
                want = want.replace(instructions=have.instructions, seed_text=have.seed_text)
            else:
                if self._s.input.units_appended() > 0:
                    history = self._history_text()
                    if history:
                        want = want.replace(instructions="\n\n".join(x for x in (want.instructions, history) if x))
                self._engine_prefix = key
        elif have is not None:
            want = want.replace(instructions=have.instructions, seed_text=have.seed_text)
        if have is not None and _config_key(want) == _config_key(have):
            return
        self._engine_config = want
        self._o.cmd(UpdateStream(self._o.stream_id, self._o.epoch, config=want))

    def _history_text(self) -> str:
        """What was said so far as text, for a re-prefill after the first unit: a header line, then
        ``User: ...`` / ``Assistant: ...`` lines in conversation order (user turns by their
        transcript, or a placeholder without one; user text items that were not in the seed;
        assistant responses as far as they were heard, docs/protocol.md §7.5), the last
        :data:`HISTORY_MAX_CHARS` characters of whole lines. Empty when nothing was said."""
        lines = []
        for it in self._s.conv.items():
            if it.role == "user" and it.kind == "input_audio":
                lines.append("User: " + (it.text or USER_SPOKE))
            elif it.role == "user" and it.kind == "input_text" and it.id not in self._seed_item_ids and it.text:
                lines.append("User: " + it.text)
            elif it.role == "assistant" and it.kind in ("output_audio", "output_text"):
                text = self._s.conv.truth_text(it) if it.kind == "output_audio" else it.text
                if text.strip():
                    lines.append("Assistant: " + text.strip())
        kept, size = [], 0
        for line in reversed(lines):
            if size + len(line) + 1 > HISTORY_MAX_CHARS:
                if not kept:  # one line longer than the budget: its end
                    kept.append("…" + line[-(HISTORY_MAX_CHARS - 1):])
                break
            kept.append(line)
            size += len(line) + 1
        return "\n".join([HISTORY_HEADER, *reversed(kept)]) if kept else ""

    def _validated_settings(self, p: SessionPatch, event_id: Optional[str]) -> _Settings:
        s = self.current.copy()
        given = set(p.given)

        def err(code: ErrorCode, msg: str, concept: str, field: Optional[str] = None) -> ProtocolError:
            param = "session." + p.sources.get(concept, concept) + ("." + field if field else "")
            return ProtocolError(code, msg, param=param, event_id=event_id)

        def warn(code: str, msg: str, concept: str) -> None:
            self._update_warnings.append((code, msg, "session." + p.sources.get(concept, concept)))

        if "output_modalities" in given:
            mods = p.output_modalities or []
            if not mods or any(m not in ("audio", "text") for m in mods):
                raise err(ErrorCode.BAD_EVENT, "output_modalities must be a non-empty subset of ['audio', 'text']", "output_modalities")
            if "audio" in mods and not self._o.cfg.audio_output_available:
                raise err(ErrorCode.BAD_EVENT, _NO_VOCODER, "output_modalities")
            s.output_modalities = list(dict.fromkeys(mods))
        if "instructions" in given and p.instructions != s.instructions:
            # after the first unit the duplex model gets them at the next turn boundary (sync_stream)
            s.instructions = p.instructions
            if self._s.input.units_appended() > 0:
                warn("instructions_reprefill", REPREFILL_WARNING.format(what="The instructions changed"), "instructions")
        if "input_format" in given or "input_sample_rate_hz" in given or "input_channels" in given:
            default_rate = self._o.cfg.limits.input_default_rate if self._o.duplex else PCM_RATE
            s.input_format = parse_input_format(p, self.current.input_format, default_rate, err)
        if "output_format" in given:
            of = p.output_format
            ok = of == "pcm16" or (
                isinstance(of, dict) and of.get("type") == "audio/pcm" and of.get("rate", OUTPUT_SAMPLE_RATE) == OUTPUT_SAMPLE_RATE
            )
            if not ok:
                raise err(ErrorCode.UNSUPPORTED_AUDIO_FORMAT, "output is fixed at 24 kHz PCM16 ('pcm16' or {type:'audio/pcm', rate:24000})", "output_format")
        if "turn_detection" in given:
            s.turn_detection = self._parse_turn_detection(p.turn_detection, err)
        for name, conv in _PLAIN_FIELDS:  # validated by the pydantic model; copied as given
            if name in given:
                setattr(s, name, conv(getattr(p, name)))
        self._apply_vllm_omni_fields(p, s, given, err, warn)
        # tools and transcription (docs/tools.md)
        if "tools" in given:
            s.tools = parse_tools(p.tools, "session." + p.sources["tools"], event_id)
        if "tool_choice" in given or "tools" in given:
            choice = p.tool_choice if "tool_choice" in given else s.tool_choice
            if "tool_choice" not in given and isinstance(choice, dict) and choice["name"] not in {t["name"] for t in s.tools}:
                choice = "auto"  # the named tool left the list
            s.tool_choice = parse_tool_choice(choice, s.tools, "session." + p.sources.get("tool_choice", "tool_choice"),
                                              event_id)
        if "transcription" in given:
            s.transcription = parse_transcription(p.transcription, err, warn)
        if "tool_filler" in given:
            s.tool_filler = p.tool_filler
        if "tool_progress" in given:
            tp = p.tool_progress
            if tp is not None:
                after, text = tp.get("after_ms", DEFAULT_TOOL_PROGRESS["after_ms"]), tp.get("text", DEFAULT_TOOL_PROGRESS["text"])
                if isinstance(after, bool) or not isinstance(after, int) or not 1000 <= after <= 60000:
                    raise err(ErrorCode.BAD_EVENT, "tool_progress.after_ms must be an integer 1000..60000", "tool_progress",
                              "after_ms")
                if not isinstance(text, str) or not text or len(text) > 500:
                    raise err(ErrorCode.BAD_EVENT, "tool_progress.text must be a non-empty string of at most 500 "
                              "characters", "tool_progress", "text")
                tp = {"after_ms": after, "text": text}
            s.tool_progress = tp
        # voice and reference audio (docs/protocol.md §8)
        apply_voice(s, p, given, self._o.cfg, self.current.ref_voice, self._s.resp.audio_started(), err)
        return s

    def _apply_vllm_omni_fields(self, p: SessionPatch, s: "_Settings", given: set, err, warn) -> None:
        """vLLM-Omni's session fields (docs/server.md, "Interop"): honoured where this server has
        the behaviour, otherwise a ``session.warning`` (never silently dropped).

        * ``extra_body.auto_response``: true -> ``answer_policy: model``, false -> ``on_request``
          (an explicit ``answer_policy`` wins);
        * ``overlap_policy``: ``listen_only`` -> the VAD does not interrupt (``interrupt_response:
          false``; with ``turn_detection: null`` overlap is the model's anyway); ``barge_in`` ->
          ``interrupt_response: true`` (needs server VAD); other values -> warning;
        * ``extra_body.native_duplex`` / ``minicpmo45_native_duplex``: true is what this server
          always does; false -> warning;
        * ``audio.output.sample_rate_hz``: must be 24000 (``unsupported_audio_format`` otherwise).
        """
        if "auto_response" in given and "answer_policy" not in given:
            s.answer_policy = "model" if p.auto_response else "on_request"
        if "overlap_policy" in given:
            pol = p.overlap_policy
            if pol == "listen_only":
                if s.turn_detection is not None:
                    s.turn_detection["interrupt_response"] = False
            elif pol in ("barge_in", "interrupt") and s.turn_detection is not None:
                s.turn_detection["interrupt_response"] = True
            else:
                warn("unsupported_overlap_policy", f"overlap_policy {pol!r} is not honoured: this server supports "
                     "'listen_only' and, with server VAD, 'barge_in'; overlap is left to the model", "overlap_policy")
        if "native_duplex" in given and p.native_duplex is False:
            warn("native_duplex_always_on", "this server always runs MiniCPM-o's model-native duplex loop; "
                 "native_duplex: false is not honoured", "native_duplex")
        if "output_sample_rate_hz" in given and p.output_sample_rate_hz != OUTPUT_SAMPLE_RATE:
            raise err(ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
                      f"output is fixed at {OUTPUT_SAMPLE_RATE} Hz, got {p.output_sample_rate_hz}", "output_sample_rate_hz")

    def _parse_turn_detection(self, td: Optional[dict], err) -> Optional[dict]:
        if td is None:
            return None
        code = ErrorCode.UNSUPPORTED_TURN_DETECTION
        t = td.get("type", "server_vad")
        if t == "semantic_vad":
            # OpenAI's semantic_vad: served by the server VAD, its eagerness translated to a
            # silence duration (SEMANTIC_VAD_SILENCE_MS, docs/protocol.md §4.1)
            eager = td.get("eagerness") or "auto"
            if eager not in SEMANTIC_VAD_SILENCE_MS:
                raise err(code, f"turn_detection.eagerness must be one of {sorted(SEMANTIC_VAD_SILENCE_MS)}, "
                          f"got {eager!r}", "turn_detection", "eagerness")
            td = {"type": "server_vad", "silence_duration_ms": SEMANTIC_VAD_SILENCE_MS[eager],
                  **{k: td[k] for k in ("interrupt_response", "create_response") if k in td}}
            t = "server_vad"
        if t != "server_vad":
            raise err(code, f"turn_detection type {t!r} is not supported (server_vad, semantic_vad or null)",
                      "turn_detection", "type")
        if self._vad_cls is None:
            raise err(code, "server VAD is not available on this server", "turn_detection")
        out = {
            "type": "server_vad",
            "threshold": 0.5,
            "prefix_padding_ms": 300,
            "silence_duration_ms": 500,
            "interrupt_response": True,
            "create_response": not self._o.duplex,
        }
        num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        for k, lo, hi, integer in (("threshold", 0.0, 1.0, False), ("prefix_padding_ms", 0, 2000, True),
                                   ("silence_duration_ms", 100, 5000, True)):
            if td.get(k) is not None:
                v = td[k]
                if not num(v) or (integer and float(v) != int(v)) or not (lo <= v <= hi):
                    raise err(code, f"turn_detection.{k} must be in {lo}..{hi}, got {v!r}", "turn_detection", k)
                out[k] = int(v) if integer else float(v)
        for k in ("interrupt_response", "create_response"):
            if td.get(k) is not None:
                if not isinstance(td[k], bool):
                    raise err(code, f"turn_detection.{k} must be a boolean", "turn_detection", k)
                out[k] = td[k]
        return out

    def _stream_config(self) -> StreamConfig:
        s = self.current
        instr = s.instructions
        if self._system_text:
            instr = "\n".join([x for x in [instr, *self._system_text] if x])
        return StreamConfig(
            instructions=instr,
            ref_voice=s.ref_voice,
            output_audio="audio" in s.output_modalities,
            temperature=s.temperature,
            seed=s.seed,
            force_listen_count=s.force_listen_count,
            seed_text="\n".join(self._seed_text) if self._seed_text else None,
        )
