"""Function calling in turn-based generation: tool specs, the call grammar and constrained decoding
(docs/model.md, "Tool calls").

MiniCPM-o 4.5's LLM is Qwen3, whose chat template takes ``tools`` (chat-completions nesting
``{"type": "function", "function": {"name", "description", "parameters"}}``) and which writes a call as

    <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>

(``<tool_call>`` / ``</tool_call>`` are added tokens of the checkpoint's tokenizer). Here:

* :func:`normalize_tools` accepts OpenAI Realtime function tools ``{"type": "function", "name",
  "description", "parameters"}`` and the chat-completions nesting, and checks that every
  ``parameters`` schema compiles with llguidance (:class:`ToolSpecError` otherwise);
  :func:`normalize_tool_choice` reads ``auto`` / ``none`` / ``required`` / ``{"type": "function",
  "name": X}`` (also ``{"type": "function", "function": {"name": X}}``).
* :func:`tool_grammar` writes the llguidance Lark grammar of the reply: ``required`` and a named
  choice allow exactly one call (to one of the allowed tools, its arguments a ``%json`` of the tool's
  :func:`generation_schema`); ``auto`` allows a plain text answer or one call; with thinking an
  optional ``<think>…</think>\\n\\n`` block comes first.
* :class:`ToolConstraint` runs the grammar during decoding: :meth:`ToolConstraint.mask` sets the
  logits of every token the grammar forbids to −inf (llguidance's bitmask, unpacked in one
  vectorised step), :meth:`ToolConstraint.advance` consumes the chosen token and keeps the **budget
  invariant**: after every step the reply can still be finished within ``max_tokens`` along the
  grammar's *closing path* (:meth:`ToolConstraint.closing_path`: forced tokens first, then the first
  valid of a fixed list of closing tokens -- ``</think>``, ``}``, ``]``, ``"``, ``,``, digits --, else the
  longest valid token). When a sampled token would break it, the token is dropped and the reply ends
  along the closing path from the state before it, so even random weights end with a parseable,
  schema-valid call within the budget.

Nothing here samples: the caller masks, samples and feeds (:func:`.chat.chat_generate`).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .chat_types import ChatInputError

__all__ = ["ToolSpec", "ToolSpecError", "ParsedCall", "normalize_tools", "normalize_tool_choice", "generation_schema",
           "tool_grammar", "ToolConstraint", "llg_tokenizer", "token_byte_lengths", "CALL_OPEN", "CALL_CLOSE",
           "JSON_FORMAT"]

CALL_OPEN = "<tool_call>"
"""Token opening a call in Qwen3's format (an added token of the checkpoint's tokenizer)."""
CALL_CLOSE = "</tool_call>"
"""Token closing a call."""
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance JSON options of the arguments: the separators of Python's ``json.dumps`` (the form the
template writes past calls in), no free whitespace."""

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMS = {"type": "object", "properties": {}}


class ToolSpecError(ChatInputError):
    """A bad ``tools`` entry or ``tool_choice`` (not a dict, no name, a schema llguidance cannot compile…)."""


@dataclass(frozen=True)
class ToolSpec:
    """One function tool.

    Attributes:
        name: the function name (``[A-Za-z0-9_-]{1,64}``, unique in the request).
        description: free text (may be empty).
        parameters: the JSON Schema of the arguments (a dict; ``{"type": "object", "properties": {}}``
            when the tool gave none).
    """

    name: str
    description: str
    parameters: dict

    def template_entry(self) -> dict:
        """The tool as the chat template takes it (chat-completions nesting)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ParsedCall:
    """A decoded call: ``name`` and ``arguments`` as compact JSON text (``json.dumps`` separators)."""

    name: str
    arguments: str


# ------------------------------------------------------------------------------ specs
def llg_tokenizer(th) -> Any:
    """The thinker's ``llguidance.LLTokenizer`` (built once per tokenizer, ~1 s for the real vocabulary),
    with the model's vocabulary size and the chat stop ids (``<|im_end|>``, ``<|endoftext|>``) as EOS.

    Raises what ``llguidance.hf.from_tokenizer`` raises (``TypeError`` from llguidance < 1.7, which takes
    one EOS id only); a failed build is remembered, so later calls fail at once instead of paying it again."""
    tok = th.tokenizer
    cached = getattr(tok, "_duplexkit_llg", None)
    if cached is not None and cached[0] == th.config.vocab_size:
        if isinstance(cached[1], BaseException):  # a build that failed fails again at once (it costs ~1 s)
            raise cached[1]
        return cached[1]
    import llguidance.hf

    try:
        lt = llguidance.hf.from_tokenizer(tok, n_vocab=int(th.config.vocab_size), eos_token=list(th.special.eos_ids))
    except Exception as exc:  # e.g. llguidance < 1.7 refuses a list of EOS ids
        tok._duplexkit_llg = (th.config.vocab_size, exc)
        raise
    tok._duplexkit_llg = (th.config.vocab_size, lt)
    return lt


def token_byte_lengths(th) -> np.ndarray:
    """int32 [V]: the byte length of every token of the model's vocabulary (0 for ids without bytes),
    built once per tokenizer (the closing path's tie-break, :meth:`ToolConstraint.closing_path`)."""
    tok = th.tokenizer
    cached = getattr(tok, "_duplexkit_llg_lens", None)
    if cached is not None and cached.shape[0] == th.config.vocab_size:
        return cached
    lt = llg_tokenizer(th)
    lens = np.asarray([len(lt.decode_bytes([i])) for i in range(int(th.config.vocab_size))], dtype=np.int32)
    tok._duplexkit_llg_lens = lens
    return lens


def _check_schema(name: str, schema: dict, lt=None) -> None:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(generation_schema(schema))
    except (ValueError, TypeError) as exc:
        raise ToolSpecError(f"tool {name!r}: parameters is not a usable JSON Schema: {exc}") from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lt)
    if is_error:
        first = (messages[0] if messages else "unknown error").strip().splitlines()
        raise ToolSpecError(f"tool {name!r}: parameters schema cannot be compiled for constrained decoding: "
                            f"{' '.join(x.strip() for x in first[:3])}")


def normalize_tools(tools: Sequence, lt=None) -> List[ToolSpec]:
    """Tool specs of a request's ``tools`` (see module doc).

    Args:
        tools: dicts ``{"type": "function", "name", "description"?, "parameters"?}`` or
            ``{"type": "function", "function": {...}}``.
        lt: an ``llguidance.LLTokenizer`` to check the schemas against (None: tokenizer-free check).
    Raises:
        ToolSpecError: not a dict, another ``type``, a missing / malformed / repeated name, a
            ``parameters`` that is not an object schema dict, or a schema llguidance cannot compile.
    """
    specs: List[ToolSpec] = []
    seen = set()
    for k, raw in enumerate(tools or ()):
        if not isinstance(raw, dict):
            raise ToolSpecError(f"tools[{k}] must be a dict, got {type(raw).__name__}")
        kind = raw.get("type", "function")
        if kind != "function":
            raise ToolSpecError(f"tools[{k}]: only function tools are supported, got type {kind!r}")
        fn = raw.get("function") if isinstance(raw.get("function"), dict) else raw
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ToolSpecError(f"tools[{k}]: name must be 1-64 characters of [A-Za-z0-9_-], got {name!r}")
        if name in seen:
            raise ToolSpecError(f"tools[{k}]: tool name {name!r} is used twice")
        seen.add(name)
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise ToolSpecError(f"tool {name!r}: description must be a string")
        params = fn.get("parameters")
        if params is None:
            params = dict(_EMPTY_PARAMS)
        if not isinstance(params, dict):
            raise ToolSpecError(f"tool {name!r}: parameters must be a JSON Schema object (dict), "
                                f"got {type(params).__name__}")
        if params.get("type", "object") != "object":
            raise ToolSpecError(f"tool {name!r}: parameters must describe a JSON object (type 'object'), "
                                f"got type {params.get('type')!r}")
        try:
            json.dumps(params)
        except (TypeError, ValueError) as exc:
            raise ToolSpecError(f"tool {name!r}: parameters is not JSON: {exc}") from exc
        _check_schema(name, params, lt)
        specs.append(ToolSpec(name=name, description=desc, parameters=params))
    return specs


def normalize_tool_choice(choice: Any, specs: Sequence[ToolSpec]) -> Tuple[str, List[str]]:
    """``(mode, names)``: mode ``none`` | ``auto`` | ``required`` and the tool names a call may use.

    ``{"type": "function", "name": X}`` (or ``{"type": "function", "function": {"name": X}}``) is
    ``required`` with ``[X]``. No tools at all is ``none``.

    Raises:
        ToolSpecError: an unknown string, a malformed dict or a name that is not among the tools.
    """
    names = [s.name for s in specs]
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolSpecError(f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}")
        mode = choice
    elif isinstance(choice, dict):
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        name = fn.get("name")
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolSpecError(f"tool_choice must name a function as {{'type': 'function', 'name': ...}}, got {choice!r}")
        if name not in names:
            raise ToolSpecError(f"tool_choice names {name!r}, which is not one of the tools {names}")
        return "required", [name]
    else:
        raise ToolSpecError(f"tool_choice must be a string or a dict, got {type(choice).__name__}")
    if not specs:
        if mode == "required":
            raise ToolSpecError("tool_choice 'required' needs at least one tool")
        return "none", []
    return mode, names


# ------------------------------------------------------------------------------ grammar
_SCHEMA_KIDS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def generation_schema(schema: dict) -> dict:
    """The schema the grammar decodes with: a copy of ``schema`` that every instance of which is
    valid against ``schema`` too (it only narrows): an object node with ``properties`` and no word on
    extra keys gets ``additionalProperties: false`` (not inside ``allOf``, where it would contradict
    the other branches), and the llguidance JSON options :data:`JSON_FORMAT` are set."""

    def tighten(node: Any, in_all_of: bool) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        if ("properties" in out and not in_all_of and "additionalProperties" not in out
                and "patternProperties" not in out and "unevaluatedProperties" not in out):
            out["additionalProperties"] = False
        for key in _SCHEMA_KIDS:
            if isinstance(out.get(key), dict):
                out[key] = tighten(out[key], False)
        for key in _SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [tighten(v, False) for v in out[key]]
        if isinstance(out.get("allOf"), list):
            out["allOf"] = [tighten(v, True) for v in out["allOf"]]
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {k: tighten(v, False) for k, v in out[key].items()}
        if isinstance(out.get("additionalProperties"), dict):
            out["additionalProperties"] = tighten(out["additionalProperties"], False)
        return out

    out = tighten(copy.deepcopy(schema), False)
    out["x-guidance"] = dict(JSON_FORMAT)
    return out


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def tool_grammar(specs: Sequence[ToolSpec], mode: str, names: Sequence[str], thinking: bool = False) -> str:
    """The llguidance Lark grammar of a reply (module doc). ``mode``: ``auto`` | ``required``;
    ``names``: the tools a call may use. With ``thinking`` an optional think block comes first."""
    by_name = {s.name: s for s in specs}
    lines = []
    answer = "call" if mode == "required" else "text | call"
    lines.append(f"start: {'think? ' if thinking else ''}answer")
    lines.append(f"answer: {answer}")
    if thinking:
        lines.append('think: <think> THINK </think> "\\n\\n"')
        lines.append("THINK: /(?s:.*)/")
    if mode != "required":
        lines.append("text: TEXT")
        lines.append("TEXT: /(?s:.+)/")
    alts = []
    for k, name in enumerate(names):
        prefix = "\n" + '{"name": ' + json.dumps(name) + ', "arguments": '
        lines.append(f"call_{k}: <tool_call> {_lark_str(prefix)} args_{k} {_lark_str(chr(125) + chr(10))} </tool_call>")
        lines.append(f"args_{k}: %json {json.dumps(generation_schema(by_name[name].parameters), ensure_ascii=False)}")
        alts.append(f"call_{k}")
    lines.append("call: " + " | ".join(alts))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ decoding
_CLOSERS = ("}", "]", '"', ",", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9")


class ToolConstraint:
    """The call grammar over one generation (module doc).

    Args:
        th: the :class:`~.thinker.Thinker` (its tokenizer, special ids and vocabulary size).
        specs / mode / names: from :func:`normalize_tools` / :func:`normalize_tool_choice` (mode
            ``auto`` or ``required``).
        thinking: the reply may open with a think block (``enable_thinking``).
        max_tokens: the reply's token budget.
    Raises:
        ToolSpecError: the grammar does not compile, or ``max_tokens`` is shorter than the closing
            path from the start (no call fits).
    """

    def __init__(self, th, specs: Sequence[ToolSpec], mode: str, names: Sequence[str], *, thinking: bool,
                 max_tokens: int) -> None:
        import llguidance

        self.th = th
        self.specs = list(specs)
        self.mode = mode
        self.lt = llg_tokenizer(th)
        self.vocab = int(th.config.vocab_size)
        grammar = llguidance.LLMatcher.grammar_from_lark(tool_grammar(specs, mode, names, thinking))
        self.m = llguidance.LLMatcher(self.lt, grammar, log_level=0)
        if self.m.is_error():
            raise ToolSpecError(f"tool grammar does not compile: {self.m.get_error()}")
        self._bits = np.full(((self.vocab + 31) // 32,), -1, dtype=np.int32)
        self._closers = self._closing_ids(th)
        self.eos = set(th.special.eos_ids)
        self._eos_ids = np.asarray(sorted(i for i in self.eos if i < self.vocab), dtype=np.int64)
        self._lens = token_byte_lengths(th)
        tok = th.tokenizer
        self.open_id = tok.convert_tokens_to_ids(CALL_OPEN)
        self.close_id = tok.convert_tokens_to_ids(CALL_CLOSE)
        if self.open_id is None or tok.convert_ids_to_tokens(int(self.open_id)) != CALL_OPEN \
                or not self.lt.is_special_token(int(self.open_id)):
            raise ToolSpecError(f"this checkpoint's tokenizer has no {CALL_OPEN} token: it cannot call tools")
        path = self.closing_path(self.m, int(max_tokens))
        if path is None:
            need = self.closing_path(self.m, 1 << 16)
            raise ToolSpecError(f"max_tokens={max_tokens} is too small for a tool call: the shortest reply "
                                f"needs {len(need) if need is not None else 'more'} tokens")

    def _closing_ids(self, th) -> List[int]:
        ids = [th.special.think_end]
        for s in _CLOSERS:
            t = self.lt.tokenize_str(s)
            if len(t) == 1:
                ids.append(int(t[0]))
        one = {s: self.lt.tokenize_str(s) for s in ('"', "}", " ")}
        self._quote, self._brace, self._space = (int(v[0]) if len(v) == 1 else None for v in one.values())
        return ids

    def _in_string(self, m, ok: List[int]) -> bool:
        """Inside a free JSON string: ``"``, ``}`` and a space are all valid (outside a string a space is
        never valid, the JSON has no free whitespace, :data:`JSON_FORMAT`), so ``"`` closes it."""
        return (self._quote in ok and self._brace in ok and self._space is not None
                and m.validate_tokens([self._space]) == 1)

    # -- per step
    def allowed(self, device) -> torch.Tensor:
        """bool [V] on ``device``: the tokens the grammar allows next (EOS ids only when it accepts)."""
        self.m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab]
        return torch.from_numpy(bits.astype(np.bool_)).to(device)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [V] with every token the grammar forbids at −inf (a new tensor)."""
        return logits.masked_fill(~self.allowed(logits.device), float("-inf"))

    def advance(self, token: int, remaining: int) -> Optional[List[int]]:
        """Consume the chosen ``token`` with ``remaining`` tokens of budget left (``token`` included).

        Returns None when the token is taken and the reply can still be finished in ``remaining − 1``
        tokens; else the token is dropped and the tokens that finish the reply along the closing path
        from the state before it are returned (at most ``remaining``; then the reply is complete).
        Raises ``RuntimeError`` when the grammar rejects ``token`` (it was not masked)."""
        trial = self.m.deep_copy()
        if not trial.consume_token(int(token)):
            raise RuntimeError(f"token {token} is not allowed by the tool grammar: {trial.get_error()}")
        if self.closing_path(trial, remaining - 1) is not None:
            self.m = trial
            return None
        tail = self.closing_path(self.m, remaining)
        if tail is None:  # the invariant held before this step, so this cannot happen
            raise RuntimeError("tool grammar budget invariant broken")
        for t in tail:
            self.m.consume_token(t)
        return tail

    def forced(self, limit: int) -> List[int]:
        """Consume and return the tokens the grammar forces next (llguidance's fast-forward tokens:
        the only tokenization of the text that must come), at most ``limit`` of them; ``[]`` when the
        next token is a choice. A forced run starts every closing path, so the budget invariant of
        :meth:`advance` still holds after it."""
        ff = [int(t) for t in self.m.compute_ff_tokens()][: max(0, int(limit))]
        if ff and not self.m.consume_tokens(ff):
            raise RuntimeError(f"the tool grammar refused its own forced tokens: {self.m.get_error()}")
        return ff

    @property
    def accepting(self) -> bool:
        """The reply so far is complete (a call closed, or a text answer that may stop here)."""
        return self.m.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing but EOS can follow (a call closed)."""
        return self.m.is_stopped()

    def closing_path(self, m, limit: int) -> Optional[List[int]]:
        """Tokens that take matcher ``m`` (left unchanged) to an accepting state, at most ``limit`` of
        them, or None. Greedy: forced tokens; else ``"`` inside a free string; else the first valid
        of ``</think>``, ``}``, ``]``, ``"``, ``,``, ``0``-``9``; else the longest valid token (ties:
        lowest id). An object gets at most one optional member and an array one item beyond their
        minimum along it."""
        m = m.deep_copy()
        path: List[int] = []
        while not m.is_accepting():
            if len(path) >= limit or m.is_error():
                return None
            ff = m.compute_ff_tokens()
            if ff:
                take = ff[: limit - len(path)]
                if not m.consume_tokens(take):
                    return None
                path += take
                continue
            ok = [t for t in self._closers if m.validate_tokens([t]) == 1]
            tok = ok[0] if ok else None
            if self._in_string(m, ok):
                tok = self._quote
            if tok is None:
                m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
                ok_mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab].astype(np.bool_)
                ok_mask[self._eos_ids] = False
                ids = np.flatnonzero(ok_mask)
                if ids.size == 0:
                    return None
                tok = int(ids[np.argmax(self._lens[ids])])
            if not m.consume_token(tok):
                return None
            path.append(tok)
        return path

    # -- result
    def parse(self, ids: Sequence[int]) -> Tuple[List[int], List[ParsedCall]]:
        """Split generated ``ids`` at the first ``<tool_call>``: ``(text ids before it, calls)``. Each
        call's JSON is parsed and its arguments re-serialised compactly."""
        ids = list(ids)
        if self.open_id not in ids:
            return ids, []
        start = ids.index(self.open_id)
        calls: List[ParsedCall] = []
        i = start
        while i < len(ids) and ids[i] == self.open_id:
            j = ids.index(self.close_id, i + 1) if self.close_id in ids[i + 1:] else len(ids)
            body = self.th.tokenizer.decode(ids[i + 1:j], skip_special_tokens=False)
            obj = json.loads(body)
            calls.append(ParsedCall(name=str(obj["name"]), arguments=json.dumps(obj["arguments"], ensure_ascii=False)))
            i = j + 1
        return ids[:start], calls
