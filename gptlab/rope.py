"""Rotary position embeddings (RoPE, Su et al. 2021; Llama's layout).

Where this sits: tokens -> *model* (inside attention) -> logits. Instead of adding a position
vector to the token embedding, RoPE rotates each query and key head by angles proportional to the
token's position, so that ``q . k`` depends on the two positions only through their difference.
The head's two halves are the rotated pairs (``x[i]`` with ``x[i + d/2]``), Hugging Face's and
Llama's convention.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rope_cache", "apply_rope"]


def rope_cache(
    max_len: int,
    head_dim: int,
    theta: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """cos and sin tables, each (max_len, head_dim): row ``t`` holds position ``t``'s angles
    ``t * theta^(-2i / head_dim)``, i < head_dim / 2, repeated for the two halves of a head."""
    if head_dim % 2:
        raise ValueError(f"rope_cache: head_dim must be even, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (max_len, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (max_len, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, H, T, D) by the angles of its positions: ``x * cos + rotate_half(x) * sin``
    with ``rotate_half([x1, x2]) = [-x2, x1]``. cos, sin broadcast against x: (T, D), or
    (B or 1, 1, T, D) when rows have their own positions."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin
