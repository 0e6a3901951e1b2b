"""Whisper audio encoder (``apm.*``) with the offline block-causal path and a streaming KV cache,
plus the audio projector (``audio_projection_layer.*``) and 5× average pooling.

Built from transformers' ``WhisperEncoder`` (same module tree and state-dict keys); only the
forward passes are ours (docs/model.md §3.1, parity README case b and "Whisper streaming"):

* offline: conv1 → GELU → conv2 (stride 2) → GELU → + ``embed_positions[0:T]`` → layers with a
  1-second block-causal mask (frame i sees j < (i//50+1)·50) → final LayerNorm;
* streaming: the unit's mel block alone through the convs, drop the first output frame (units ≥ 1)
  and the last one (→ 50 frames), positions continue from the cached count, every layer attends
  to its cached keys/values plus the block without a mask; the cache is dropped when it would pass
  ``max_source_positions`` (1500 = 30 s; docs/model.md §3.1, vO #7457).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import AudioConfig

__all__ = ["AudioEncoder", "AudioProjector", "WhisperStreamCache"]


class AudioProjector(nn.Module):
    """``linear1`` (d_model→hidden) → ReLU → ``linear2`` (hidden→hidden) (docs/model.md §1.1)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(x)))


@dataclass
class WhisperStreamCache:
    """Per-stream Whisper KV cache: per layer (k, v) of shape [1, heads, P, head_dim]; ``positions`` = P."""

    keys: List[Optional[torch.Tensor]] = field(default_factory=list)
    values: List[Optional[torch.Tensor]] = field(default_factory=list)
    positions: int = 0
    resets: int = 0

    def clear(self) -> None:
        self.keys = []
        self.values = []
        self.positions = 0


def _build_whisper_encoder(cfg: AudioConfig) -> nn.Module:
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    wc = cfg.to_whisper_config()
    wc._attn_implementation = "sdpa"
    return WhisperEncoder(wc)


class AudioEncoder:
    """Wraps ``apm`` (a transformers ``WhisperEncoder``) and exposes the two forward paths.

    A plain object, not an ``nn.Module``: the thinker registers ``apm`` itself, so state-dict keys
    stay ``apm.*``.
    """

    def __init__(self, apm: nn.Module, block_frames: int = 50) -> None:
        self.apm = apm
        self.block_frames = block_frames
        first = apm.layers[0].self_attn
        self.num_heads = first.num_heads
        self.head_dim = first.head_dim
        self.max_positions = apm.embed_positions.weight.shape[0]

    @staticmethod
    def build(cfg: AudioConfig) -> nn.Module:
        """A randomly initialised ``WhisperEncoder`` with the ``apm.*`` module tree."""
        return _build_whisper_encoder(cfg)

    # -------------------------------------------------------------------------------------------
    def _convs(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [1, 80, T] -> [1, (T−1)//2+1, d]."""
        apm = self.apm
        x = F.gelu(apm.conv1(mel))
        x = F.gelu(apm.conv2(x))
        return x.transpose(1, 2)

    def _attn(self, layer, h: torch.Tensor, past: Optional[Tuple[torch.Tensor, torch.Tensor]], mask):
        sa = layer.self_attn
        b, t, _ = h.shape
        q = (sa.q_proj(h) * sa.scaling).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = sa.k_proj(h).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = sa.v_proj(h).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        o = o.transpose(1, 2).reshape(b, t, -1)
        return sa.out_proj(o), (k, v)

    def _layer(self, layer, h, past, mask):
        a, kv = self._attn(layer, layer.self_attn_layer_norm(h), past, mask)
        return self._mlp(layer, h + a), kv

    @staticmethod
    def _mlp(layer, h: torch.Tensor) -> torch.Tensor:
        """A layer's second half: ``h + fc2(act(fc1(final_layer_norm(h))))``."""
        return h + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(h))))

    def stream_frames(self, mel: torch.Tensor, first: bool) -> torch.Tensor:
        """A streaming unit's encoder input: the convs over mel blocks [B, 80, 102|104], then the
        first output frame dropped (units >= 1: left context) and the last one -> [B, 50, d]."""
        x = self._convs(mel)
        return x[:, (0 if first else 1): x.shape[1] - 1]

    def stream_start(self, cache, n: int) -> int:
        """Where a streaming block of ``n`` frames starts in ``cache`` (anything with ``positions``,
        ``resets`` and ``clear()``): its cached count, or 0 after dropping the cache (``resets`` + 1)
        when the block would pass ``max_source_positions``."""
        if cache.positions + n > self.max_positions:
            cache.clear()
            cache.resets += 1
        return cache.positions

    # -------------------------------------------------------------------------------------------
    def conv_and_positions(self, mel: torch.Tensor) -> torch.Tensor:
        """Offline input of layer 0: convs + ``embed_positions[0:T']``. mel [80, T] -> [T', d]."""
        x = self._convs(mel.unsqueeze(0))[0]
        t = x.shape[0]
        if t > self.max_positions:
            raise ValueError(f"audio longer than {self.max_positions} encoder frames; split into 30 s pieces")
        return x + self.apm.embed_positions.weight[:t]

    def encode_offline(self, mel: torch.Tensor, block_mask: bool = True) -> torch.Tensor:
        """Offline encoder (chat()/prepare()). mel float [80, T] (T ≤ 3000) -> final-LN states [(T−1)//2+1, d].

        ``block_mask``: the 1-second block-causal mask of ``audio_chunk_length = 1.0`` (parity case b).
        """
        h = self.conv_and_positions(mel).unsqueeze(0)
        t = h.shape[1]
        mask = None
        if block_mask:
            i = torch.arange(t, device=h.device)
            allowed = i[None, :] < ((i[:, None] // self.block_frames) + 1) * self.block_frames
            mask = torch.zeros(t, t, dtype=h.dtype, device=h.device).masked_fill(~allowed, float("-inf"))
        for layer in self.apm.layers:
            h, _ = self._layer(layer, h, None, mask)
        return self.apm.layer_norm(h)[0]

    def encode_stream(self, mel_block: torch.Tensor, cache: WhisperStreamCache, first: bool) -> torch.Tensor:
        """Streaming encoder for one unit. mel_block [80, 102|104] -> final-LN states [50, d].

        ``first``: unit 0 (no left context frame to trim). Updates ``cache`` in place; drops it
        (positions restart at 0) when ``positions + n`` would exceed ``max_source_positions``.
        """
        x = self.stream_frames(mel_block.unsqueeze(0), first)
        n = x.shape[1]
        p = self.stream_start(cache, n)
        h = x + self.apm.embed_positions.weight[p : p + n].unsqueeze(0)
        new_k, new_v = [], []
        for li, layer in enumerate(self.apm.layers):
            past = (cache.keys[li], cache.values[li]) if cache.keys else None
            h, (k, v) = self._layer(layer, h, past, None)
            new_k.append(k)
            new_v.append(v)
        cache.keys, cache.values = new_k, new_v
        cache.positions = p + n
        return self.apm.layer_norm(h)[0]
