"""The chat records shared by :mod:`.chat` (prompts and generation), :mod:`.tools` (the call
grammar) and :mod:`.thinker` (``Thinker.chat``): the input error and the result of one reply.

Their own module so that those three import them downwards (torch-free apart from the tensor type).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from duplexkit.errors import DuplexkitError

__all__ = ["ChatInputError", "ChatThinkerResult"]


class ChatInputError(DuplexkitError, ValueError):
    """A chat message or part of an unsupported shape/type."""


@dataclass
class ChatThinkerResult:
    """Result of :meth:`Thinker.chat`.

    Attributes:
        text: decoded reply (special tokens skipped).
        token_ids: int64 [N] generated ids (without the final eos).
        tts_token_ids: int64 [L] ids strictly inside the last ``<|tts_bos|>``…``<|tts_eos|>``
            (or ``<|im_end|>``/end) span (docs/model.md §4).
        tts_hidden: float32 [L, H] final-norm hidden states at those tokens' input positions.
        finish_reason: "stop" (eos), "length" or "tool_calls".
        prompt_tokens: prompt length in tokens.
        tool_calls: :class:`~.tools.ParsedCall` objects (name, arguments JSON text) of a constrained
            tool call (docs/model.md, "Tool calls"); then ``text`` is the text before the call and
            the spoken span is empty.
        stats: how the reply was generated (:func:`.chat.chat_steps`): ``kv``, ``decode_steps``,
            ``forced_tokens``, ``forced_passes``, ``prefill_ms``, ``decode_ms``.
    """

    text: str
    token_ids: np.ndarray
    tts_token_ids: np.ndarray
    tts_hidden: torch.Tensor
    finish_reason: str
    prompt_tokens: int
    tool_calls: tuple = ()
    stats: dict = field(default_factory=dict)
