"""SigLIP NaViT vision tower (``vpm.*``) and the perceiver resampler (``resampler.*``).

docs/model.md §1.1, §3.2 and parity README case c:

* patches: a stride-14 ``Conv2d`` (``embeddings.patch_embedding``), row-major;
* positions: bucketised fractional coordinates of the (h, w) patch grid onto the 70×70
  ``embeddings.position_embedding`` table;
* encoder: transformers ``SiglipEncoderLayer`` blocks (pre-LN, tanh GELU, eps 1e-6), then
  ``post_layernorm``; the last layer is not built when ``drop_vision_last_layer``;
* resampler: 64 learned queries, ``kv = ln_kv(kv_proj(x))``, one ``nn.MultiheadAttention`` with
  hidden/128 heads (query without position term, key = kv + 2-D sin-cos position with the column
  half first, value = kv), ``ln_post`` then ``@ proj``.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from .config import MiniCPMOConfig

__all__ = ["VisionEmbeddings", "VisionTower", "Resampler", "navit_position_ids", "sincos_pos_2d"]


def navit_position_ids(nh: int, nw: int, side: int = 70) -> torch.Tensor:
    """Rows of the ``side×side`` position table for an nh×nw patch grid (int64 [nh·nw], row-major)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    fh = torch.arange(0, 1 - 1e-6, 1 / nh)
    fw = torch.arange(0, 1 - 1e-6, 1 / nw)
    bh = torch.bucketize(fh, boundaries, right=True)
    bw = torch.bucketize(fw, boundaries, right=True)
    return (bh[:, None] * side + bw[None, :]).reshape(-1)


def sincos_pos_2d(dim: int, nh: int, nw: int, device=None) -> torch.Tensor:
    """2-D sin-cos position for the resampler keys, float32 [nh·nw, dim] (parity README case c).

    For patch (r, c): ``[sin(c·ω) ‖ cos(c·ω) ‖ sin(r·ω) ‖ cos(r·ω)]`` with ``ω_k = 10000^(−k/(dim/4))``.
    """
    q = dim // 4
    omega = 1.0 / (10000.0 ** (torch.arange(q, dtype=torch.float32, device=device) / q))
    rows = torch.arange(nh, dtype=torch.float32, device=device)
    cols = torch.arange(nw, dtype=torch.float32, device=device)
    r = rows[:, None].expand(nh, nw).reshape(-1)
    c = cols[None, :].expand(nh, nw).reshape(-1)
    oc = c[:, None] * omega[None, :]
    orr = r[:, None] * omega[None, :]
    return torch.cat([torch.sin(oc), torch.cos(oc), torch.sin(orr), torch.cos(orr)], dim=1)


class VisionEmbeddings(nn.Module):
    def __init__(self, hidden: int, channels: int, patch: int, n_positions: int) -> None:
        super().__init__()
        self.patch_size = patch
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch, padding=0)
        self.position_embedding = nn.Embedding(n_positions, hidden)


class _Encoder(nn.Module):
    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers


class VisionTower(nn.Module):
    """SigLIP NaViT with keys ``embeddings.*``, ``encoder.layers.N.*``, ``post_layernorm.*`` (no head)."""

    def __init__(self, cfg: MiniCPMOConfig) -> None:
        super().__init__()
        from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

        vc = cfg.vision_config
        sc = vc.to_siglip_config()
        sc._attn_implementation = "sdpa"
        self.side = vc.num_patches_per_side
        self.embeddings = VisionEmbeddings(vc.hidden_size, vc.num_channels, vc.patch_size, self.side * self.side)
        self.encoder = _Encoder(nn.ModuleList([SiglipEncoderLayer(sc) for _ in range(cfg.vision_layers_used)]))
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
        """pixels [3, H, W] (normalised) with grid (H/14, W/14) -> [nh·nw, vision_hidden]."""
        nh, nw = grid
        x = self.embeddings.patch_embedding(pixels.unsqueeze(0))  # [1, D, nh, nw]
        x = x.flatten(2).transpose(1, 2)  # [1, nh*nw, D], row-major
        pos = navit_position_ids(nh, nw, self.side).to(x.device)
        x = x + self.embeddings.position_embedding(pos).unsqueeze(0)
        for layer in self.encoder.layers:
            x = layer(x, attention_mask=None)
        return self.post_layernorm(x)[0]


class Resampler(nn.Module):
    """Perceiver resampler: 64 queries over the patch features (keys ``query``, ``kv_proj``, ``attn``,
    ``ln_q``, ``ln_kv``, ``ln_post``, ``proj``; docs/model.md §1.1)."""

    def __init__(self, num_queries: int, embed_dim: int, kv_dim: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.query = nn.Parameter(torch.zeros(num_queries, embed_dim))
        self.kv_proj = nn.Linear(kv_dim, embed_dim, bias=False)
        self.attn = nn.MultiheadAttention(embed_dim, embed_dim // 128)
        self.ln_q = nn.LayerNorm(embed_dim, eps=1e-6)
        self.ln_kv = nn.LayerNorm(embed_dim, eps=1e-6)
        self.ln_post = nn.LayerNorm(embed_dim, eps=1e-6)
        self.proj = nn.Parameter(torch.zeros(embed_dim, embed_dim))

    def forward(self, x: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
        """x [N, kv_dim] patch features of one image -> [64, embed_dim]."""
        kv = self.ln_kv(self.kv_proj(x))  # [N, D]
        pos = sincos_pos_2d(self.embed_dim, grid[0], grid[1], device=x.device).to(kv.dtype)
        q = self.ln_q(self.query)  # [Q, D]
        out, _ = self.attn(q.unsqueeze(1), (kv + pos).unsqueeze(1), kv.unsqueeze(1), need_weights=False)
        out = self.ln_post(out[:, 0])
        return out @ self.proj
