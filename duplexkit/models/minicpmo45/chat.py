"""Turn-based (chat) prompts and generation on the thinker (docs/model.md §4, parity cases a and d).

Prompt building:

* messages: ``{"role", "content"}`` dicts or ``engine.api.ChatMessage``; ``content`` is a string or
  a list of parts — ``str`` text, float32 1-D ``np.ndarray`` audio (16 kHz), uint8 [H, W, 3]
  ``np.ndarray`` or PIL image, or ``{"type": "text"|"audio"|"image", ...}`` dicts;
* parts are joined with ``"\\n"``, or with nothing when ``omni_mode`` (whitespace preserved);
* the checkpoint's own chat template renders the conversation (``enable_thinking=False`` adds the
  empty think block, ``use_tts_template=True`` adds ``<|tts_bos|>``; audio input forces it on);
* images become ``<image_id>k</image_id><image>`` + 64 ``<unk>`` + ``</image>`` (one 448 px slice),
  audio ``<|audio_start|>`` + n ``<unk>`` + ``<|audio_end|>`` with n from the offline encoder; the
  ``<unk>`` rows of the input embeddings are replaced by the image / audio embeddings;
* user text is encoded so that special-token strings inside it stay plain text (docs/model.md §2),
  while the template's own special tokens become their ids;
* ``tools`` (:class:`~.tools.ToolSpec`) go to the template's own tools section (Qwen3's
  ``apply_chat_template(..., tools=[...])``, chat-completions nesting); each tool's JSON text is
  encoded as plain text like user text (a description holding ``<|im_end|>`` stays text).

Generation with ``tools`` and ``tool_choice`` other than ``none`` is constrained by the call grammar
(:mod:`.tools`): the reply is a text answer (``auto``) or one call, parsed into
``ChatThinkerResult.tool_calls`` with ``finish_reason`` ``"tool_calls"``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import sampling as S
from .chat_types import ChatInputError, ChatThinkerResult
from .tokenizer import encode_control, encode_text

__all__ = ["ChatPrompt", "ChatReply", "build_chat_prompt", "chat_generate", "chat_steps", "step_replies",
           "ChatInputError"]

_TXT = ("\ue000", "\ue001")
_MED = ("\ue002", "\ue003")
_MARK = re.compile("\ue000(\\d+)\ue001|\ue002(\\d+)\ue003")


@dataclass
class ChatPrompt:
    """A built prompt: ``ids`` int list, ``replacements`` [(start_row, embeddings [n, H])], the rendered text."""

    ids: List[int]
    replacements: List[Tuple[int, torch.Tensor]] = field(default_factory=list)
    rendered: str = ""
    has_audio: bool = False
    use_tts_template: bool = False


def _classify(part) -> Tuple[str, Any]:
    if isinstance(part, str):
        return "text", part
    if isinstance(part, dict):
        t = part.get("type")
        if t == "text":
            return "text", str(part.get("text", ""))
        if t in ("audio", "input_audio"):
            return "audio", part.get("audio")
        if t in ("image", "input_image"):
            return "image", part.get("image")
        raise ChatInputError(f"unknown content part type {t!r}")
    if isinstance(part, np.ndarray):
        if part.ndim == 1:
            if not np.issubdtype(part.dtype, np.floating):
                raise ChatInputError("audio parts must be float32 1-D arrays at 16 kHz")
            return "audio", part
        if part.ndim == 3 and part.shape[2] == 3 and part.dtype == np.uint8:
            return "image", part
        raise ChatInputError(f"array part of shape {part.shape} / {part.dtype} is neither audio nor an RGB image")
    try:
        from PIL import Image

        if isinstance(part, Image.Image):
            return "image", part
    except ImportError:  # pragma: no cover
        pass
    raise ChatInputError(f"unsupported content part {type(part).__name__}")


def _norm_messages(messages) -> List[Tuple[str, list]]:
    out = []
    for m in messages:
        if isinstance(m, dict):
            role, content = m.get("role"), m.get("content")
        else:
            role, content = getattr(m, "role", None), getattr(m, "content", None)
        if role not in ("system", "user", "assistant"):
            raise ChatInputError(f"bad message role {role!r}")
        parts = [content] if isinstance(content, (str, np.ndarray)) or content is None else list(content)
        out.append((role, [_classify(p) for p in parts if p is not None]))
    if not out:
        raise ChatInputError("no messages")
    return out


def _fallback_render(msgs, add_generation_prompt, enable_thinking, use_tts_template) -> str:
    s = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in ((m["role"], m["content"]) for m in msgs))
    if add_generation_prompt:
        s += "<|im_start|>assistant\n"
        if enable_thinking is False:
            s += "<think>\n\n</think>\n\n"
        if use_tts_template:
            s += "<|tts_bos|>"
    return s


def _special_regex(tokenizer) -> re.Pattern:
    cached = getattr(tokenizer, "_duplexkit_special_re", None)
    if cached is not None:
        return cached
    names = sorted({t.content for t in tokenizer.added_tokens_decoder.values()}, key=len, reverse=True)
    pat = re.compile("|".join(re.escape(n) for n in names)) if names else re.compile("(?!x)x")
    tokenizer._duplexkit_special_re = pat
    return pat


def build_chat_prompt(th, messages, *, use_tts_template: Optional[bool] = None, enable_thinking: bool = False,
                      omni_mode: bool = False, add_generation_prompt: bool = True, tools: Sequence = ()) -> ChatPrompt:
    """Build ids and embedding replacements for ``messages`` (see module doc).

    ``tools``: :class:`~.tools.ToolSpec` objects rendered by the template's tools section (as
    ``tool.template_entry()``). Where the rendered text holds a tool's JSON as the template's
    ``tojson`` writes it (``json.dumps``, ``ensure_ascii=False``), that text is encoded as plain text.

    Raises:
        ChatInputError: a bad message, or ``tools`` with a tokenizer that has no chat template.
    """
    tok = th.tokenizer
    sp = th.special
    msgs = _norm_messages(messages)
    texts: List[str] = []
    media: List[Tuple[str, Any]] = []
    rendered_msgs = []
    has_audio = False
    for role, parts in msgs:
        pieces = []
        for kind, val in parts:
            if kind == "text":
                texts.append(val)
                pieces.append(f"{_TXT[0]}{len(texts) - 1}{_TXT[1]}")
            else:
                if kind == "audio":
                    has_audio = True
                media.append((kind, val))
                pieces.append(f"{_MED[0]}{len(media) - 1}{_MED[1]}")
        rendered_msgs.append({"role": role, "content": ("" if omni_mode else "\n").join(pieces)})
    if use_tts_template is None or has_audio:
        use_tts_template = bool(use_tts_template) or has_audio
    template = getattr(tok, "chat_template", None)
    kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
              use_tts_template=use_tts_template)
    if tools and not template:
        raise ChatInputError("this checkpoint's tokenizer has no chat template: it cannot be given tools")
    if tools:
        rendered = tok.apply_chat_template(rendered_msgs, tools=[t.template_entry() for t in tools], **kw)
        for t in tools:  # each tool's JSON as plain text (the template's tojson is this json.dumps)
            js = json.dumps(t.template_entry(), ensure_ascii=False)
            if js in rendered:
                texts.append(js)
                rendered = rendered.replace(js, f"{_TXT[0]}{len(texts) - 1}{_TXT[1]}")
    elif template:
        rendered = tok.apply_chat_template(rendered_msgs, **kw)
    else:
        rendered = _fallback_render(rendered_msgs, add_generation_prompt, enable_thinking, use_tts_template)

    # items: ("t", text) plain text, ("i", [ids]) control ids, ("m", media index)
    items: List[Tuple[str, Any]] = []
    special_re = _special_regex(tok)

    def add_template_text(s: str):
        pos = 0
        for mt in special_re.finditer(s):
            if mt.start() > pos:
                items.append(("t", s[pos:mt.start()]))
            items.append(("i", [tok.convert_tokens_to_ids(mt.group(0))]))
            pos = mt.end()
        if pos < len(s):
            items.append(("t", s[pos:]))

    pos = 0
    for mt in _MARK.finditer(rendered):
        if mt.start() > pos:
            add_template_text(rendered[pos:mt.start()])
        if mt.group(1) is not None:
            items.append(("t", texts[int(mt.group(1))]))
        else:
            items.append(("m", int(mt.group(2))))
        pos = mt.end()
    if pos < len(rendered):
        add_template_text(rendered[pos:])

    ids: List[int] = []
    repl: List[Tuple[int, torch.Tensor]] = []
    run: List[str] = []
    image_index = 0

    def flush():
        if run:
            ids.extend(encode_text(tok, "".join(run)))
            run.clear()

    for kind, val in items:
        if kind == "t":
            run.append(val)
            continue
        flush()
        if kind == "i":
            ids.extend(val)
            continue
        mkind, mval = media[val]
        if mkind == "audio":
            emb = th.audio_embeds_offline(np.asarray(mval, np.float32))
            ids.append(sp.audio_start)
            repl.append((len(ids), emb))
            ids.extend([sp.unk] * emb.shape[0])
            ids.append(sp.audio_end)
        else:
            emb = th.image_embeds(mval)
            ph, off = th.image_placeholder_ids(image_index)
            image_index += 1
            repl.append((len(ids) + off, emb))
            ids.extend(ph)
    flush()

    def _show(mt):
        if mt.group(1) is not None:
            return texts[int(mt.group(1))]
        return "<image>./</image>" if media[int(mt.group(2))][0] == "image" else "<audio>./</audio>"

    shown = _MARK.sub(_show, rendered)
    return ChatPrompt(ids=ids, replacements=repl, rendered=shown, has_audio=has_audio, use_tts_template=use_tts_template)


def prompt_embeds(th, prompt: ChatPrompt) -> torch.Tensor:
    """Input embeddings [T, H] of a prompt with the media rows replaced (parity case d)."""
    e = th.embed_ids(prompt.ids).clone()
    for start, emb in prompt.replacements:
        e[start : start + emb.shape[0]] = emb.to(e.dtype)
    return e


def chat_generate(th, messages, **kw):
    """Generate one assistant reply at once: :func:`chat_steps` run to its end (same arguments, same
    result)."""
    steps = chat_steps(th, messages, **kw)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


@torch.inference_mode()
def chat_steps(th, messages, *, use_tts_template: Optional[bool] = None, enable_thinking: bool = False,
               max_tokens: int = 512, temperature: float = 0.7, seed: Optional[int] = None,
               top_p: float = 0.8, top_k: int = 100, repetition_penalty: float = 1.02, omni_mode: bool = False,
               on_token: Optional[Callable[[int], None]] = None, tools: Sequence = (), tool_choice: Any = "auto",
               jump_forward: bool = True, static_kv: Optional[bool] = None):
    """A generator that generates one assistant reply one step at a time: it yields (None) after the
    prompt's prefill and after each step but the last (a sampled token, or a forced run of tokens),
    and returns the result (``StopIteration.value``). It drives one :class:`ChatReply` with
    :func:`step_replies`; the engine drives many replies at once the same way, in slices on the
    thinker's stage thread between the duplex units' steps, so a reply (e.g. a tool decision) never
    holds the other sessions' units for its whole length
    (:meth:`duplexkit.engine.engine.DuplexEngine.generate`). Arguments are those of the reply:

    Generate one assistant reply (docs/model.md §4 defaults: T 0.7, top_p 0.8, top_k 100, repetition 1.02).

    ``temperature`` 0 = greedy. The repetition penalty is HF's (:func:`.sampling.repetition_penalty_hf`)
    over prompt and generated ids; sampling is :func:`.sampling.sample` with the call's seeded
    generator. ``on_token(id)`` is called for each generated id (not for the final eos, nor for the
    ids of a tool call).

    ``tools`` (OpenAI function tools, see :func:`.tools.normalize_tools`) with ``tool_choice``
    ``auto`` / ``required`` / ``{"type": "function", "name": X}`` render the template's tools section
    and constrain every step to the call grammar (:class:`.tools.ToolConstraint`: the grammar's token
    mask on the logits before the penalties and the sampler); the reply is then text (``auto`` only)
    or one call, finished within ``max_tokens`` in any case. ``tool_choice`` ``none`` (or no tools)
    generates as without tools (the tools are not shown to the model).

    ``jump_forward``: with a call grammar, the tokens it forces (the call's ``<tool_call>{"name": "``,
    a lone tool's name, the JSON between free values: llguidance's fast-forward tokens) are taken
    without sampling and fed in one forward pass per run of them, not one decode step each.

    ``static_kv``: hold the reply's KV in a free slot of the batched thinker's pool
    (:class:`~.fast_thinker.FastThinker`), so that each decode step is its captured CUDA graph instead
    of the eager Hugging Face forward (benchmarks/decider_steps.py measures both); None (default): when the thinker captures CUDA graphs and its
    pool has a free slot with room for the prompt plus ``max_tokens`` (a chat never grows the pool);
    True: the same without graphs (the CPU's static path is slower than the ``DynamicCache``);
    otherwise, and with ``False``, a ``DynamicCache``. The slot is given back when the reply ends or
    the generator is closed.

    ``ChatThinkerResult.stats`` counts ``decode_steps`` (one-token forward passes),
    ``forced_tokens`` (taken by ``jump_forward``) and ``forced_passes``, with ``prefill_ms`` /
    ``decode_ms`` (host wall time, ms; the decode includes the grammar's work) and ``kv``
    (``"static"`` | ``"dynamic"``).

    Returns :class:`~.thinker.ChatThinkerResult` (``finish_reason`` ``"tool_calls"`` with the parsed
    calls in ``tool_calls``; then ``text`` is the text before the call and nothing is spoken).
    Raises ChatInputError (:class:`.tools.ToolSpecError` for bad tools) / ValueError on bad input.
    """
    reply = ChatReply(th, messages, use_tts_template=use_tts_template, enable_thinking=enable_thinking,
                      max_tokens=max_tokens, temperature=temperature, seed=seed, top_p=top_p, top_k=top_k,
                      repetition_penalty=repetition_penalty, omni_mode=omni_mode, on_token=on_token, tools=tools,
                      tool_choice=tool_choice, jump_forward=jump_forward, static_kv=static_kv)
    try:
        step_replies(th, [reply])  # the prefill
        while not reply.done:
            yield
            step_replies(th, [reply])
        if reply.error is not None:
            raise reply.error
        return reply.result
    finally:
        reply.close()  # a static slot goes back (also when the generator is closed early)


def _chat_kv(th, need: int, static_kv: Optional[bool]):
    """The reply's KV (:func:`chat_steps`' ``static_kv``): a slot of the batched thinker's pool when
    asked or allowed and one is free with ``need`` positions, else a ``DynamicCache``."""
    pool = getattr(th, "pool", None)
    if static_kv is False or pool is None or not hasattr(th, "_decode_step") \
            or (static_kv is None and not getattr(th, "use_graphs", False)):
        return th.new_cache()
    if pool.free and need <= pool.max_len:
        try:
            return th._stream_cache()
        except Exception:  # noqa: BLE001 - taken meanwhile (a capped pool): the dynamic cache does the same work
            pass
    return th.new_cache()


class ChatReply:
    """One assistant reply being generated: the prompt, the grammar, the KV and the choice of each
    next token (:func:`chat_steps`' arguments and rules), with the forward passes left to a driver,
    :func:`step_replies`, which runs those of several replies together.

    The reply is built (prompt, grammar: ``ChatInputError`` / ``ToolSpecError``) at construction; its
    KV is taken then and given back by :meth:`close` (idempotent; also when the reply is abandoned).

    Attributes:
        kv: the reply's KV (a pool slot, ``static``, or a ``DynamicCache``).
        static: the KV is a slot of the fast thinker's pool (single-token steps can share its graphs).
        done: the reply is complete; ``result`` then holds the :class:`ChatThinkerResult`, or
            ``error`` the exception that ended it (:func:`step_replies`).
        stats: ``ChatThinkerResult.stats`` so far.
    """

    def __init__(self, th, messages, *, use_tts_template: Optional[bool] = None, enable_thinking: bool = False,
                 max_tokens: int = 512, temperature: float = 0.7, seed: Optional[int] = None, top_p: float = 0.8,
                 top_k: int = 100, repetition_penalty: float = 1.02, omni_mode: bool = False,
                 on_token: Optional[Callable[[int], None]] = None, tools: Sequence = (), tool_choice: Any = "auto",
                 jump_forward: bool = True, static_kv: Optional[bool] = None) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.th = th
        self.constraint = None
        specs: list = []
        if tools:
            from .tools import ToolConstraint, llg_tokenizer, normalize_tool_choice, normalize_tools

            lt = llg_tokenizer(th)
            specs = normalize_tools(tools, lt)
            mode, names = normalize_tool_choice(tool_choice, specs)
            if mode == "none":
                specs = []
            else:
                self.constraint = ToolConstraint(th, specs, mode, names, thinking=bool(enable_thinking),
                                                 max_tokens=max_tokens)
        self.prompt = build_chat_prompt(th, messages, use_tts_template=use_tts_template,
                                        enable_thinking=enable_thinking, omni_mode=omni_mode, tools=specs)
        self.max_tokens = int(max_tokens)
        self.temperature, self.top_p, self.top_k = float(temperature), top_p, top_k
        self.repetition_penalty = repetition_penalty
        self.on_token = on_token
        self.jump_forward = bool(jump_forward)
        self.gen = None
        if temperature > 0:
            self.gen = torch.Generator()
            self.gen.manual_seed(int(seed)) if seed is not None else self.gen.seed()
        self.kv = _chat_kv(th, len(self.prompt.ids) + self.max_tokens, static_kv)
        self.static = hasattr(self.kv, "slot")
        self.stats = {"kv": "static" if self.static else "dynamic", "decode_steps": 0, "forced_tokens": 0,
                      "forced_passes": 0, "prefill_ms": 0.0, "decode_ms": 0.0}
        self.logits: Optional[torch.Tensor] = None  # the next token's logits [V] (None before the prefill)
        self.seen: Optional[torch.Tensor] = None
        self.out_ids: List[int] = []
        self.hidden: List[torch.Tensor] = []
        self.finish = "length"
        self.in_call = False
        self.done = False
        self.result = None
        self.error: Optional[BaseException] = None
        self._pending: Optional[Tuple[List[int], bool, float]] = None
        self._eos = set(th.special.eos_ids)

    # -- the driver's side
    def prefill_embeds(self) -> torch.Tensor:
        """The prompt's input embeddings [T, H] (media rows replaced)."""
        return prompt_embeds(self.th, self.prompt)

    def prefilled(self, logits: torch.Tensor, ms: float) -> None:
        """The prompt was run on :attr:`kv`: ``logits`` [V] float32 of its last position."""
        self.logits = logits
        self.seen = torch.zeros(self.th.config.vocab_size, dtype=torch.bool, device=logits.device)
        self.seen[torch.as_tensor(self.prompt.ids, device=logits.device)] = True
        self.stats["prefill_ms"] += float(ms)

    def choose(self) -> Optional[Tuple[List[int], bool]]:
        """The ids to feed next and whether they are a forced run (the grammar's fast-forward tokens)
        rather than one sampled token; None when the reply is complete (:attr:`result` is set)."""
        t1 = time.perf_counter()
        c = self.constraint
        if len(self.out_ids) >= self.max_tokens:
            return self._end()
        if c is not None and self.jump_forward:
            ff = c.forced(self.max_tokens - len(self.out_ids))
            if ff:
                if c.finished:  # the forced run closes the reply: nothing more is generated
                    self.out_ids += ff
                    self.stats["forced_tokens"] += len(ff)
                    return self._end()
                self._pending = (ff, True, t1)
                return ff, True
        x = c.mask(self.logits) if c is not None else self.logits
        if self.repetition_penalty != 1.0:
            x = S.repetition_penalty_hf(x, self.seen, self.repetition_penalty)
        if self.temperature <= 0:
            t = int(torch.argmax(x))
        else:
            t = int(S.sample(x[None], [self.gen], temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)[0])
        if t in self._eos:
            self.finish = "stop"
            return self._end()
        if c is not None:
            tail = c.advance(t, self.max_tokens - len(self.out_ids))
            if tail is not None:  # the budget ends the reply along the grammar's closing path
                self.out_ids += tail
                return self._end()
            if c.finished:
                self.out_ids.append(t)
                return self._end()
        self._pending = ([t], False, t1)
        return [t], False

    def fed(self, rows: torch.Tensor, logits: torch.Tensor) -> None:
        """The chosen ids were run on :attr:`kv`: ``rows`` [n, H] their final-norm hidden states (kept:
        not a graph's static output), ``logits`` [V] float32 of the last one."""
        ids, forced, t1 = self._pending
        self._pending = None
        for k, t in enumerate(ids):
            self.in_call |= self.constraint is not None and t == self.constraint.open_id
            self.out_ids.append(t)
            if self.on_token is not None and not self.in_call:
                self.on_token(t)
            self.seen[t] = True
            self.hidden.append(rows[k])
        self.logits = logits
        if forced:
            self.stats["forced_tokens"] += len(ids)
            self.stats["forced_passes"] += 1
        else:
            self.stats["decode_steps"] += 1
        self.stats["decode_ms"] += (time.perf_counter() - t1) * 1000.0

    def fail(self, exc: BaseException) -> None:
        """End the reply with ``exc`` (:attr:`error`; no result) and give its slot back."""
        self.error = exc
        self.done = True
        self.close()

    def close(self) -> None:
        """Give the KV's pool slot back (idempotent)."""
        release = getattr(self.kv, "release", None)
        if release is not None:
            release()

    # -- the result
    def _end(self) -> None:
        self.done = True
        self.result = self._result()
        self.close()
        return None

    def _result(self) -> ChatThinkerResult:
        th, sp = self.th, self.th.special
        out_ids, hidden = self.out_ids, self.hidden
        calls: list = []
        out_ids_text = out_ids
        finish = self.finish
        if self.constraint is not None:
            out_ids_text, calls = self.constraint.parse(out_ids)
            if calls:
                finish = "tool_calls"
        # spoken span: strictly inside the last <|tts_bos|> ... <|tts_eos|> (or end) of the fed ids (a closing
        # path's ids are not fed); nothing for a call
        spoken = out_ids_text[:len(hidden)] if not calls else []
        start = None
        for i in range(len(spoken) - 1, -1, -1):
            if spoken[i] == sp.tts_bos:
                start = i + 1
                break
        if start is None and self.prompt.use_tts_template and not calls:
            start = 0
        if start is None:
            span = (0, 0)
        else:
            end = len(spoken)
            for i in range(start, len(spoken)):
                if spoken[i] in (sp.tts_eos, sp.im_end):
                    end = i
                    break
            span = (start, end)
        tts_ids = np.asarray(spoken[span[0]:span[1]], dtype=np.int64)
        H = th.hidden_size
        tts_hidden = torch.stack(hidden[span[0]:span[1]]).float() if span[1] > span[0] else torch.zeros(0, H)
        return ChatThinkerResult(
            text=th.tokenizer.decode(out_ids_text, skip_special_tokens=True),
            token_ids=np.asarray(out_ids, dtype=np.int64),
            tts_token_ids=tts_ids,
            tts_hidden=tts_hidden,
            finish_reason=finish,
            prompt_tokens=len(self.prompt.ids),
            tool_calls=tuple(calls),
            stats=dict(self.stats),
        )


PREFILL_ROWS = 8
"""The most replies whose prompts :func:`step_replies` runs in one batched forward (a longer batch
would hold the thinker's units for longer: the units run between steps)."""

DECODE_ROWS = 32
"""The most single-token rows of one batched decode step (the fast thinker's graph buckets go to 64)."""


@torch.inference_mode()
def step_replies(th, replies: Sequence[ChatReply]) -> None:
    """Advance every unfinished reply of ``replies`` by one step, their forward passes together.

    Replies not yet prefilled are prefilled, and that is the step: those holding pool slots in
    batched forwards of up to :data:`PREFILL_ROWS` rows (rows padded to the longest prompt), the
    others one by one. Otherwise each reply chooses its next ids (:meth:`ChatReply.choose`); the
    single sampled tokens of replies with pool slots go through one batched decode step of the fast
    thinker (its CUDA graph per batch bucket on a GPU), up to :data:`DECODE_ROWS` rows at a time;
    forced runs and ``DynamicCache`` replies run one by one. A reply that completes gives its slot back.

    Never raises: a reply whose own work fails (its token choice, its own forward pass) ends with
    that exception in :attr:`ChatReply.error` (``done``, its slot given back) and the others go on;
    a batched forward pass that fails ends every reply of that batch so.
    """
    todo = [r for r in replies if not r.done]
    fresh = [r for r in todo if r.logits is None]
    if fresh:
        t0 = time.perf_counter()
        static = []
        for r in fresh:
            try:
                embeds = r.prefill_embeds()
            except Exception as exc:  # noqa: BLE001 - this reply's own input
                r.fail(exc)
                continue
            if r.static:
                static.append((r, embeds))
                continue
            try:
                h = th.forward_embeds(embeds, r.kv)
                r.prefilled(th.logits(h[-1]), (time.perf_counter() - t0) * 1000.0)
            except Exception as exc:  # noqa: BLE001
                r.fail(exc)
        for i in range(0, len(static), PREFILL_ROWS):
            group = static[i:i + PREFILL_ROWS]
            try:
                rows = th._prefill([r.kv for r, _ in group], [e for _, e in group])
                lasts = th.logits(torch.stack([h[-1] for h in rows]))
            except Exception as exc:  # noqa: BLE001 - the batch's KV rows are not to be trusted
                for r, _ in group:
                    r.fail(exc)
                continue
            for (r, _), lg in zip(group, lasts):
                r.prefilled(lg, (time.perf_counter() - t0) * 1000.0)
        return
    singles, others = [], []
    for r in todo:
        try:
            picked = r.choose()
        except Exception as exc:  # noqa: BLE001 - e.g. a sampler fed non-finite logits
            r.fail(exc)
            continue
        if picked is None:
            continue
        ids, forced = picked
        (singles if r.static and not forced else others).append((r, ids))
    for i in range(0, len(singles), DECODE_ROWS):
        group = singles[i:i + DECODE_ROWS]
        try:
            hh, logits = th._decode_step([r.kv for r, _ in group], [ids[0] for _, ids in group])
            logits = logits[:len(group)].clone()  # the graph's static output: read before its next replay
        except Exception as exc:  # noqa: BLE001
            for r, _ in group:
                r.fail(exc)
            continue
        for k, (r, _) in enumerate(group):
            r.fed(hh[k:k + 1], logits[k])
    for r, ids in others:
        try:
            rows = th.forward_embeds(th.embed_ids(ids), r.kv)
            rows = rows.clone() if r.static else rows  # a graph's output is overwritten by its next replay
            r.fed(rows, th.logits(rows[-1]))
        except Exception as exc:  # noqa: BLE001
            r.fail(exc)
