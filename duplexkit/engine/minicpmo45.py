"""MiniCPM-o 4.5 stage functions: :class:`~duplexkit.engine.stages.StageModel` over the model port.

Maps the runtime's batch-shaped stage calls onto ``duplexkit.models.minicpmo45``:

* thinker  -> ``model.thinker.new_stream`` / ``step_units`` / ``speak_text`` / ``end_turn`` / ``close``
* talker   -> ``model.talker.new_turn`` / ``generate_units`` (duplex budget 26 -> <= 25 codes, docs/model.md §6)
* code2wav -> ``model.code2wav.new_stream`` / ``push`` / ``reset_turn`` / ``close`` (docs/model.md §7)
* chat     -> ``model.thinker.chat`` then ``model.talker.generate_offline`` then one vocoder stream.

Per-item isolation: while a model component processes a batch by looping over its items (it
exposes no ``batched = True`` attribute), each item is passed on its own so an exception fails
only that item's stream. A component that declares ``batched = True`` gets the whole list in one
call (the GPU path), and an exception then fails the whole batch.

Every method here runs on the owning stage's worker thread (never on the event loop), holding the
model's CUDA-graph capture gate shared (:mod:`duplexkit.models.minicpmo45.capture_gate`): the three
stage threads run concurrently, and a graph captured lazily on one of them waits until no other is
launching GPU work, instead of breaking their launches and itself.

With ``DUPLEXKIT_THINKER_STREAM=1`` (opt-in, CUDA thinkers only) the thinker methods run on a
dedicated high-priority CUDA stream and hand the talker their hidden rows with a ready event:
``talker_input`` is then ``(token_ids, hidden, event)`` instead of ``(token_ids, hidden)``
(:mod:`duplexkit.engine.thinker_stream`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import time
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ..errors import detach_traceback
from ..models.minicpmo45.capture_gate import CAPTURE_GATE
from .api import CODES_PER_CHUNK, ChatMessage, ChatRequest, ReferenceVoice, StreamConfig, ToolCall
from .stages import TalkerOut, ThinkerOut, VocoderOut
from .thinker_stream import ThinkerCudaStream, accept, thinker_stream_requested

log = logging.getLogger(__name__)

__all__ = ["MiniCPMO45Stages", "TALKER_TEMPERATURE", "CODES_PER_CHUNK"]

TALKER_TEMPERATURE = 0.8
"""Talker sampling temperature of the reference duplex path (docs/model.md §6 "Sampling")."""


def _gpu_work(fn: Callable) -> Callable:
    """Run ``fn`` holding the capture gate shared (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CAPTURE_GATE.shared():
            return fn(*args, **kwargs)

    return wrapper


def _thinker_work(fn: Callable) -> Callable:
    """:func:`_gpu_work` on the thinker's own CUDA stream when it has one (:meth:`MiniCPMO45Stages.stage_scope`)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with CAPTURE_GATE.shared(), self.stage_scope("thinker"):
            return fn(self, *args, **kwargs)

    return wrapper


def _talker_payload(talker_input: Any) -> tuple:
    """``(token_ids, hidden)`` of a thinker's hand-over; a 3-tuple's ready event is waited for on the
    current stream of ``hidden``'s device first (:func:`~.thinker_stream.accept`)."""
    if len(talker_input) == 3:
        token_ids, hidden, ready = talker_input
        accept(hidden, ready)
        return token_ids, hidden
    token_ids, hidden = talker_input
    return token_ids, hidden


class _ChatJob:
    """One turn-based reply of :meth:`MiniCPMO45Stages.chat_thinker_steps`: its
    :class:`~duplexkit.models.minicpmo45.chat.ChatReply`, built at its first slice (on the thinker
    thread: the prompt's audio is encoded there), and what ended it."""

    def __init__(self, messages: list, kw: dict) -> None:
        self.messages, self.kw = messages, kw
        self.reply: Any = None
        self.error: Optional[BaseException] = None
        self.closed = False

    def start(self, thinker: Any, static_kv: Optional[bool]) -> None:
        from ..models.minicpmo45.chat import ChatReply

        self.reply = ChatReply(thinker, self.messages, static_kv=static_kv, **self.kw)

    def finish(self, stages: "MiniCPMO45Stages") -> "ChatThinkerOut":
        r = self.reply.result
        calls = tuple(ToolCall(name=c.name, arguments=c.arguments) for c in getattr(r, "tool_calls", ()))
        finish = "tool_calls" if calls else ("length" if r.finish_reason == "length" else "stop")
        return ChatThinkerOut(text=r.text, talker_input=stages._handover(r.tts_token_ids, r.tts_hidden),
                              finish_reason=finish, prompt_tokens=int(r.prompt_tokens),
                              completion_tokens=int(len(r.token_ids)), tool_calls=calls)

    def close(self) -> None:
        """Abandon the reply (thinker thread): its KV slot goes back; its next slice raises."""
        self.closed = True
        if self.reply is not None:
            self.reply.close()
            self.reply.done = True


@dataclass
class _TalkerTurnState:
    turn: Any
    generator: Any


@dataclass
class ChatThinkerOut:
    """Result of the chat thinker pass: reply text and the talker's spoken span."""

    text: str
    talker_input: Any  # (token_ids int64 [L], hidden float32 [L, H])
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: tuple = ()  # engine.api.ToolCall objects (finish_reason "tool_calls"; talker_input is then empty)


def _prefix_key(cfg: StreamConfig) -> tuple:
    return (cfg.instructions, None if cfg.ref_voice is None else cfg.ref_voice.sha256, cfg.seed_text)


def _loop_or_batch(component: Any, fn, items: list) -> list:
    if getattr(component, "batched", False):
        return list(fn(items))
    out = []
    for it in items:
        try:
            out.append(fn([it])[0])
        except Exception as exc:  # noqa: BLE001 - confined to this item's stream
            out.append(detach_traceback(exc))
    return out


class MiniCPMO45Stages:
    """Stage functions for a loaded :class:`duplexkit.models.minicpmo45.MiniCPMO45`.

    Args:
        model: the loaded model (``.thinker``, ``.talker``, ``.code2wav`` or None).
        model_id: reported id (default ``"minicpm-o-4.5"``).
        talker_temperature: talker sampling temperature (default 0.8, docs/model.md §6).
        thinker_stream: run the thinker's work on a dedicated high-priority CUDA stream
            (:mod:`duplexkit.engine.thinker_stream`); None (default) reads ``DUPLEXKIT_THINKER_STREAM``
            (unset = off). Ignored when the model's thinker is not on a CUDA device.

    Raises:
        ValueError: ``DUPLEXKIT_THINKER_STREAM`` holds something other than an on/off value.
    """

    _thinker_stream: Optional[ThinkerCudaStream] = None  # class default: none (also for objects built without __init__)

    def __init__(self, model: Any, *, model_id: str = "minicpm-o-4.5",
                 talker_temperature: float = TALKER_TEMPERATURE, thinker_stream: Optional[bool] = None) -> None:
        self.model = model
        self.model_id = model_id
        self.random_weights = bool(getattr(model, "random_weights", False))
        self.talker_temperature = float(talker_temperature)
        self._chats: list = []  # the turn-based replies in progress (_ChatJob), thinker thread only
        self.chat_static_kv: Optional[bool] = None
        """Turn-based replies hold their KV in a slot of the fast thinker's pool: None (default) when
        the thinker captures CUDA graphs (:func:`~duplexkit.models.minicpmo45.chat.chat_steps`'
        ``static_kv``), True / False to force it."""
        want = thinker_stream_requested() if thinker_stream is None else bool(thinker_stream)
        dev = getattr(getattr(model, "thinker", None), "device", None)
        if want and dev is not None and str(dev).startswith("cuda"):
            self._thinker_stream = ThinkerCudaStream(dev)

    @property
    def thinker_stream(self) -> Any:
        """The thinker's dedicated ``torch.cuda.Stream``, or None when the thinker runs on the
        current stream of its thread (the default: the legacy default stream; always on CPU)."""
        return None if self._thinker_stream is None else self._thinker_stream.stream

    def stage_scope(self, stage: str) -> Any:
        """Context manager under which ``stage``'s work runs: the thinker's dedicated CUDA stream
        for ``"thinker"`` when it has one, else a no-op. :meth:`DuplexEngine.warmup` runs each
        stage's warm-up under it, so the thinker's graphs are captured from its own stream."""
        if stage == "thinker" and self._thinker_stream is not None:
            return self._thinker_stream.scope()
        return contextlib.nullcontext()

    def tools_warmup(self) -> Optional[float]:
        """Build the tool-call constraint's tables of the thinker's tokenizer (the llguidance
        tokenizer and the per-token byte lengths, both cached on the tokenizer) on the calling thread;
        :meth:`DuplexEngine.warmup_tools` runs it on the thinker's worker thread at load.

        Returns the time taken in ms, or None without llguidance or a tokenizer. A failed build is
        logged as a warning and returned as None (the cache keeps the failure: tool decisions then
        fail at once with the same reason instead of paying the build again)."""
        th = getattr(self.model, "thinker", None)
        if th is None or getattr(th, "tokenizer", None) is None or importlib.util.find_spec("llguidance") is None:
            return None
        from ..models.minicpmo45.tools import llg_tokenizer, token_byte_lengths

        t0 = time.perf_counter()
        try:
            llg_tokenizer(th)
            token_byte_lengths(th)
        except Exception as exc:
            log.warning("tool calls will fail: the constrained decoder's tokenizer could not be built "
                        "(%s: %s); llguidance >= 1.7 is required (pip install 'duplexkit[agent]')",
                        type(exc).__name__, exc)
            return None
        return (time.perf_counter() - t0) * 1000

    def _handover(self, token_ids: Any, hidden: Any) -> tuple:
        """The talker's payload of a thinker result: ``(token_ids, hidden)``, plus a ready event
        recorded on the thinker stream when it has one (call it after the producing work)."""
        if self._thinker_stream is None or not getattr(hidden, "is_cuda", False):
            return (token_ids, hidden)
        return (token_ids, hidden, self._thinker_stream.mark_ready())

    # ------------------------------------------------------------------ thinker
    @_thinker_work
    def thinker_open(self, config: StreamConfig) -> Any:
        ref = None if config.ref_voice is None else np.asarray(config.ref_voice.audio, np.float32)
        return self.model.thinker.new_stream(
            instructions=config.instructions, ref_audio=ref, seed_text=config.seed_text,
            temperature=float(config.temperature), seed=config.seed,
            force_listen_count=int(config.force_listen_count),
        )

    @_thinker_work
    def thinker_update(self, handle: Any, old: StreamConfig, new: StreamConfig) -> Any:
        """A changed session prefix (instructions, reference voice, seed text) or seed rebuilds the
        context from the new prefix (docs/protocol.md §8.6); a changed temperature or
        force_listen_count only updates the stream's policy."""
        if _prefix_key(old) != _prefix_key(new) or old.seed != new.seed:
            fresh = self.thinker_open(new)
            if handle is not None:
                self.model.thinker.close(handle)
            return fresh
        pol = getattr(handle, "policy", None)
        if pol is not None:
            if new.temperature != old.temperature:
                if not 0.0 <= float(new.temperature) <= 2.0:
                    raise ValueError(f"temperature must be in [0, 2], got {new.temperature}")
                pol.temperature = float(new.temperature)
                if pol.temperature > 0 and getattr(handle, "generator", None) is None:
                    import torch

                    handle.generator = torch.Generator()
                    handle.generator.seed()
            pol.force_listen_count = int(new.force_listen_count)
        return handle

    @_thinker_work
    def thinker_step(self, items: list) -> list:
        from duplexkit.models.minicpmo45.duplex import UnitInput

        th = self.model.thinker
        inputs = [UnitInput(stream=w.handle, audio=w.audio, force_listen=w.force_listen,
                            force_speak=w.force_speak, frame=w.frame) for w in items]
        results = _loop_or_batch(th, th.step_units, inputs)
        ready = None
        if self._thinker_stream is not None and any(
                not isinstance(r, BaseException) and r.decision == "speak" and getattr(r.hidden, "is_cuda", False)
                for r in results):
            ready = self._thinker_stream.mark_ready()  # after every kernel that wrote the hidden rows
        out = []
        for r in results:
            if isinstance(r, BaseException):
                out.append(r)
                continue
            speak = r.decision == "speak"
            out.append(ThinkerOut(
                decision=r.decision, text=r.text if speak else "", n_tokens=int(r.n_tokens),
                turn_start=bool(r.turn_start), end_of_turn=bool(r.end_of_turn),
                talker_input=((r.token_ids, r.hidden) if ready is None else (r.token_ids, r.hidden, ready))
                if speak else None, timings=dict(r.timings),
            ))
        return out

    @_thinker_work
    def thinker_speak_text(self, handle: Any, text: str, tokens_per_unit: int) -> None:
        """Queue forced speech on the stream (``SpeakText``; :meth:`Thinker.speak_text`, docs/model.md
        "Forced speech"). Raises ``ValueError`` for a text or stream it cannot speak (nothing queued)."""
        self.model.thinker.speak_text(handle, text, int(tokens_per_unit))

    @_thinker_work
    def thinker_end_turn(self, handle: Any) -> None:
        self.model.thinker.end_turn(handle)

    @_thinker_work
    def thinker_close(self, handle: Any) -> None:
        self.model.thinker.close(handle)

    # ------------------------------------------------------------------ talker
    def _generator(self, seed: Optional[int]) -> Any:
        if seed is None:
            return None
        import torch

        dev = getattr(self.model.talker, "device", "cpu")
        g = torch.Generator(device=dev)
        g.manual_seed(int(seed))
        return g

    @_gpu_work
    def talker_open(self, seed: Optional[int]) -> Any:
        return _TalkerTurnState(self.model.talker.new_turn(), self._generator(seed))

    @_gpu_work
    def talker_step(self, items: list) -> list:
        from duplexkit.models.minicpmo45.talker import TalkerInput

        tk = self.model.talker
        inputs = []
        for w in items:
            token_ids, hidden = _talker_payload(w.talker_input)
            inputs.append(TalkerInput(turn=w.turn.turn, token_ids=token_ids, hidden=hidden,
                                      turn_start=w.turn_start, turn_end=w.turn_end,
                                      temperature=self.talker_temperature, generator=w.turn.generator))
        res = _loop_or_batch(tk, tk.generate_units, inputs)
        out = []
        for r in res:
            if isinstance(r, BaseException):
                out.append(r)
            else:
                codes = np.asarray(r, dtype=np.int64).reshape(-1)
                out.append(TalkerOut(codes=codes, steps=int(codes.size) + 1))
        return out

    @_gpu_work
    def talker_close(self, turn: Any) -> None:
        t = getattr(turn, "turn", None)
        if t is not None and hasattr(t, "reset"):
            t.reset()

    # ------------------------------------------------------------------ code2wav
    def _c2w(self) -> Any:
        c2w = getattr(self.model, "code2wav", None)
        if c2w is None:
            raise RuntimeError("this model was loaded without code2wav: open streams with output_audio=False")
        return c2w

    @_gpu_work
    def code2wav_open(self, ref_voice: Optional[ReferenceVoice]) -> Any:
        return self._c2w().new_stream(ref_voice)

    @_gpu_work
    def code2wav_step(self, items: list) -> list:
        c2w = self._c2w()

        def push(batch: list) -> list:
            return [c2w.push(w.handle, w.codes, last=w.last) for w in batch]

        res = _loop_or_batch(c2w, getattr(c2w, "push_batch", push) if getattr(c2w, "batched", False) else push, items)
        return [r if isinstance(r, BaseException) else VocoderOut(np.asarray(r, np.float32).reshape(-1)) for r in res]

    @_gpu_work
    def code2wav_end_turn(self, handle: Any) -> None:
        self._c2w().reset_turn(handle)

    @_gpu_work
    def code2wav_close(self, handle: Any) -> None:
        self._c2w().close(handle)

    # ------------------------------------------------------------------ chat (turn-based)
    @_thinker_work
    def chat_thinker(self, request: ChatRequest, on_text: Optional[Callable[[str], None]] = None) -> ChatThinkerOut:
        """:meth:`chat_thinker_steps` run to its end in one call (thinker stage thread)."""
        steps = self.chat_thinker_steps(request, on_text)
        try:
            while True:
                done, out = self.chat_thinker_slice(steps, float("inf"))
                if done:
                    return out
        finally:
            steps.close()

    @_thinker_work
    def chat_thinker_slice(self, steps: "_ChatJob", budget_s: float) -> tuple:
        """Advance the replies being generated for about ``budget_s`` seconds (at least one step) on
        the thinker stage thread, until ``steps`` (a :meth:`chat_thinker_steps` job) is done. Every
        reply in progress moves on together: each step is one batched forward for all of them
        (:func:`~duplexkit.models.minicpmo45.chat.step_replies`), so concurrent replies (several
        sessions' tool decisions at once) share the thinker's decode steps. Returns ``(True,
        ChatThinkerOut)`` when the reply is done, ``(False, None)`` when more slices are needed.

        Raises:
            duplexkit.models.minicpmo45.chat.ChatInputError: bad messages, tools or tool_choice (at
                the job's first slice).
            What ended the reply (:attr:`~duplexkit.models.minicpmo45.chat.ChatReply.error`): its own
                failure, or a batched forward pass it shared.
        """
        from ..models.minicpmo45.chat import step_replies

        t0 = time.perf_counter()
        th = self.model.thinker
        self._chats = [j for j in self._chats if not j.closed]  # abandoned by their callers
        if steps.closed:
            raise RuntimeError("this reply was closed")
        while True:
            if steps.reply is None and not self._waits_for_slot(th):
                steps.start(th, self.chat_static_kv)
                self._chats.append(steps)
            if steps.reply is not None:
                err = steps.error or steps.reply.error
                if err is not None:
                    self._forget(steps)
                    raise err
                if steps.reply.done:
                    self._forget(steps)
                    return True, steps.finish(self)
            live = [j for j in self._chats if j.error is None and not j.reply.done]
            if not live:  # nothing in progress to wait for (cannot happen while waiting): start it now
                steps.start(th, self.chat_static_kv)
                self._chats.append(steps)
                continue
            try:
                step_replies(self.model.thinker, [j.reply for j in live])
            except Exception as exc:  # noqa: BLE001 - a bug of the step itself: each reply of it gets it
                for j in live:
                    j.error = exc
                    j.reply.close()
                continue
            if time.perf_counter() - t0 >= budget_s and not (steps.reply is not None and steps.reply.done):
                return False, None

    def _waits_for_slot(self, th: Any) -> bool:
        """A new reply that would hold its KV in a slot of the fast thinker's pool waits while every
        slot is taken and another reply holds one (it gives it back within its few hundred ms: sooner
        than the same reply decoded eagerly in a ``DynamicCache``: benchmarks/decider_steps.py);
        with no reply holding one (the streams hold them all), it goes on with a ``DynamicCache``."""
        pool = getattr(th, "pool", None)
        wants = self.chat_static_kv if self.chat_static_kv is not None else bool(getattr(th, "use_graphs", False))
        if not wants or pool is None or pool.free:
            return False
        return any(j.reply is not None and j.reply.static and not j.reply.done and j.error is None for j in self._chats)

    def _forget(self, job: "_ChatJob") -> None:
        if job in self._chats:
            self._chats.remove(job)

    def chat_thinker_steps(self, request: ChatRequest, on_text: Optional[Callable[[str], None]] = None) -> "_ChatJob":
        """Text pass of :meth:`DuplexEngine.generate`: a job that :meth:`chat_thinker_slice` advances
        on the thinker stage thread (nothing runs until its first slice); ``close()`` it (on that
        thread) to abandon it, which gives its KV slot back.

        ``on_text(delta)`` receives the reply text as it is generated (incremental detokenization;
        a delta is held back while it ends in an incomplete UTF-8 sequence); the tokens of a tool call
        are not text. ``request.tools`` / ``tool_choice`` constrain the reply to the call grammar
        (docs/model.md, "Tool calls"); a call comes back in ``tool_calls`` with ``finish_reason``
        ``"tool_calls"`` and nothing to speak.
        """
        has_audio_in = any(isinstance(p, np.ndarray) and p.dtype != np.uint8
                           for m in request.messages for p in (m.content if isinstance(m, ChatMessage) else []))
        use_tts = request.use_tts_template
        if use_tts is None:
            use_tts = bool(request.output_audio or has_audio_in)
        kw = {}
        if on_text is not None:
            tok = self.model.tokenizer
            ids: list = []
            sent = [""]

            def on_token(t: int) -> None:
                ids.append(int(t))
                text = tok.decode(ids, skip_special_tokens=True)
                if text.endswith("\ufffd") or not text.startswith(sent[0]):
                    return
                delta = text[len(sent[0]):]
                if delta:
                    sent[0] = text
                    on_text(delta)

            kw["on_token"] = on_token
        if request.tools:
            kw["tools"] = list(request.tools)
            kw["tool_choice"] = request.tool_choice
        return _ChatJob(list(request.messages), dict(
            use_tts_template=use_tts, enable_thinking=request.enable_thinking, max_tokens=int(request.max_tokens),
            temperature=float(request.temperature), seed=request.seed, **kw))

    @_gpu_work
    def chat_talker(self, talker_input: Any, seed: Optional[int], max_codes: int = 2048) -> np.ndarray:
        """Codes for the whole spoken span (talker stage thread): int64 [n <= max_codes]
        (reference offline cap 2048, docs/model.md §6)."""
        token_ids, hidden = _talker_payload(talker_input)
        if token_ids is None or len(token_ids) == 0:
            return np.zeros(0, np.int64)
        codes = self.model.talker.generate_offline(token_ids, hidden, max_codes=int(max_codes),
                                                  generator=self._generator(seed))
        return np.asarray(codes, np.int64).reshape(-1)
