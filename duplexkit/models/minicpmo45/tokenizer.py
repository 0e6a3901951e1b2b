"""Tokenizer of a MiniCPM-o 4.5 checkpoint, built from the checkpoint's own files (docs/model.md §2).

* ``tokenizer.json`` when present and non-empty; otherwise ``vocab.json`` + ``merges.txt`` plus
  the added tokens of ``tokenizer_config.json["added_tokens_decoder"]`` in id order
  (docs/model.md §2). Never substitutes a stock Qwen tokenizer.
* Every special token is resolved **by string** (:class:`SpecialTokens`); a string that maps to the
  unk id is rejected with :class:`TokenizerError`. No id is hard-coded.
* ``bad_token_ids`` (duplex forbidden set) comes from ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, List, Sequence, Union

from duplexkit.errors import DuplexkitError

__all__ = [
    "TokenizerError",
    "SpecialTokens",
    "SPECIAL_TOKEN_STRINGS",
    "load_tokenizer",
    "encode_text",
]


class TokenizerError(DuplexkitError, ValueError):
    """Tokenizer files missing/broken, or a required special token is absent (maps to unk)."""


# field name -> token string (docs/model.md §2)
SPECIAL_TOKEN_STRINGS: Dict[str, str] = {
    "endoftext": "<|endoftext|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "think": "<think>",
    "think_end": "</think>",
    "image": "<image>",
    "image_end": "</image>",
    "slice": "<slice>",
    "slice_end": "</slice>",
    "image_id": "<image_id>",
    "image_id_end": "</image_id>",
    "unit": "<unit>",
    "unit_end": "</unit>",
    "audio_start": "<|audio_start|>",
    "audio": "<|audio|>",
    "audio_end": "<|audio_end|>",
    "tts_bos": "<|tts_bos|>",
    "tts_eos": "<|tts_eos|>",
    "listen": "<|listen|>",
    "speak": "<|speak|>",
    "turn_eos": "<|turn_eos|>",
    "chunk_eos": "<|chunk_eos|>",
    "chunk_tts_eos": "<|chunk_tts_eos|>",
    "tts_pad": "<|tts_pad|>",
    "unk": "<unk>",
}


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens, resolved by string from a tokenizer (docs/model.md §2)."""

    endoftext: int
    im_start: int
    im_end: int
    think: int
    think_end: int
    image: int
    image_end: int
    slice: int
    slice_end: int
    image_id: int
    image_id_end: int
    unit: int
    unit_end: int
    audio_start: int
    audio: int
    audio_end: int
    tts_bos: int
    tts_eos: int
    listen: int
    speak: int
    turn_eos: int
    chunk_eos: int
    chunk_tts_eos: int
    tts_pad: int
    unk: int

    @classmethod
    def resolve(cls, tokenizer) -> "SpecialTokens":
        """Resolve every field with ``convert_tokens_to_ids``; raises :class:`TokenizerError` on unk."""
        unk_id = tokenizer.unk_token_id
        ids = {}
        missing = []
        for f in fields(cls):
            s = SPECIAL_TOKEN_STRINGS[f.name]
            i = tokenizer.convert_tokens_to_ids(s)
            if i is None or (f.name != "unk" and unk_id is not None and i == unk_id):
                missing.append(s)
                continue
            if f.name != "unk" and tokenizer.convert_ids_to_tokens(int(i)) != s:
                missing.append(s)
                continue
            ids[f.name] = int(i)
        if missing:
            raise TokenizerError(f"tokenizer lacks required special tokens: {', '.join(missing)}")
        return cls(**ids)

    @property
    def terminators(self) -> frozenset:
        """Unit terminators (docs/model.md §5.3 step 7): listen, chunk_eos, chunk_tts_eos."""
        return frozenset((self.listen, self.chunk_eos, self.chunk_tts_eos))

    @property
    def eos_ids(self) -> tuple:
        """Chat generation stop ids (``<|im_end|>``, ``<|endoftext|>``)."""
        return (self.im_end, self.endoftext)


def _read_json(p: Path):
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {p}: {e}") from e


def load_tokenizer(ckpt_dir: Union[str, Path]):
    """Build the checkpoint's tokenizer (a ``transformers.PreTrainedTokenizerFast``).

    Extra attributes set on the returned object: ``bad_token_ids`` (list[int], may be empty),
    ``duplexkit_chat_template`` (str or None).

    Raises:
        TokenizerError: files missing or inconsistent (added token landing on another id).
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast, Qwen2TokenizerFast

    d = Path(ckpt_dir)
    cfg_path = d / "tokenizer_config.json"
    tcfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    tj = d / "tokenizer.json"
    if tj.is_file() and tj.stat().st_size > 0:
        try:
            tok = PreTrainedTokenizerFast(tokenizer_file=str(tj))
        except Exception as e:  # noqa: BLE001 - surface as a typed error
            raise TokenizerError(f"cannot load {tj}: {e}") from e
    elif (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        tok = Qwen2TokenizerFast(vocab=str(d / "vocab.json"), merges=str(d / "merges.txt"))
    else:
        raise TokenizerError(f"{d}: no tokenizer.json and no vocab.json + merges.txt")

    dec = tcfg.get("added_tokens_decoder") or {}
    if not dec and (d / "added_tokens.json").is_file():
        dec = {str(v): {"content": k, "special": True} for k, v in _read_json(d / "added_tokens.json").items()}
    for i, v in sorted(((int(k), v) for k, v in dec.items())):
        content = v["content"]
        have = tok.convert_tokens_to_ids(content)
        in_vocab = have is not None and tok.convert_ids_to_tokens(int(have)) == content
        if not in_vocab:
            at = AddedToken(
                content,
                special=bool(v.get("special", True)),
                normalized=bool(v.get("normalized", False)),
                lstrip=bool(v.get("lstrip", False)),
                rstrip=bool(v.get("rstrip", False)),
                single_word=bool(v.get("single_word", False)),
            )
            tok.add_tokens([at], special_tokens=bool(v.get("special", True)))
        got = tok.convert_tokens_to_ids(content)
        if got != i:
            raise TokenizerError(f"added token {content!r} landed on id {got}, tokenizer_config says {i}")

    smap = _read_json(d / "special_tokens_map.json") if (d / "special_tokens_map.json").is_file() else {}

    def _name(key):
        v = tcfg.get(key, smap.get(key))
        if isinstance(v, dict):
            v = v.get("content")
        return v

    kw = {k: _name(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token") if _name(k)}
    if kw:
        tok.add_special_tokens(kw)
    tok.bad_token_ids = [int(x) for x in (tcfg.get("bad_token_ids") or [])]
    tok.duplexkit_chat_template = tcfg.get("chat_template")
    if tok.duplexkit_chat_template and not getattr(tok, "chat_template", None):
        tok.chat_template = tok.duplexkit_chat_template
    return tok


_SPECIAL_CACHE: Dict[int, re.Pattern] = {}


def encode_text(tokenizer, text: str) -> List[int]:
    """Encode user text so that added-token strings (e.g. ``<unit>``) stay plain text (docs/model.md §2)."""
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def encode_control(tokenizer, text: str) -> List[int]:
    """Encode template/control text, where special-token strings become their ids."""
    return list(tokenizer.encode(text, add_special_tokens=False))
