"""Attention masks: which keys each query may look at.

Where this sits: tokens -> batches -> *model* (attention) -> logits. A mask is a boolean tensor,
True where a query may attend to a key (the convention of PyTorch's
``scaled_dot_product_attention(attn_mask=...)``); :func:`additive_mask` gives the same rule as
numbers to add to the attention scores (0 or -inf). The model builds one mask per forward pass
(:func:`slot_mask`) and every layer shares it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["causal_mask", "additive_mask", "combine_masks", "slot_mask"]


def causal_mask(T: int, device: torch.device | str | None = None) -> Tensor:
    """Boolean (T, T) lower-triangular mask, True where attention is allowed.

    Query ``i`` may attend to key ``j`` iff ``j <= i``: this is the convention of PyTorch's
    ``scaled_dot_product_attention(attn_mask=...)`` (True = take part in attention).
    """
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"causal_mask: T must be a positive int, got {T!r}")
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def additive_mask(T: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """The causal mask as numbers to add to the scores: (T, T), 0 where query ``i`` may attend to
    key ``j`` (``j <= i``), ``-inf`` elsewhere (so softmax gives those keys weight exactly 0)."""
    if not dtype.is_floating_point:
        raise TypeError(f"additive_mask: dtype must be a floating-point dtype, got {dtype}")
    allowed = causal_mask(T, device=device)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


def combine_masks(causal: Tensor, key_padding: Tensor) -> Tensor:
    """Causal mask and padding mask in one: causal (T, T) bool, key_padding (B, T) bool (True =
    real token) -> (B, 1, T, T) bool, True iff ``causal[i, j]`` and ``key_padding[b, j]``.

    The head dimension is 1 so the result broadcasts over heads. A padded query may find no key
    at all (a row of False): attention over it is undefined, which is why the model itself lets a
    padded query attend to itself (:func:`slot_mask`); its output is never used.
    """
    if causal.dim() != 2 or causal.shape[0] != causal.shape[1]:
        raise ValueError(f"combine_masks: causal must have shape (T, T), got {tuple(causal.shape)}")
    if key_padding.dim() != 2 or key_padding.shape[1] != causal.shape[1]:
        raise ValueError(
            f"combine_masks: key_padding must have shape (B, T) with T={causal.shape[1]}, got {tuple(key_padding.shape)}"
        )
    return causal.bool()[None, None] & key_padding.bool()[:, None, None, :]


def slot_mask(
    q_start: int,
    T: int,
    k_start: int,
    S: int,
    *,
    window: int | None = None,
    key_padding: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The general attention mask for queries at slots ``q_start..q_start+T-1`` over keys at slots
    ``k_start..k_start+S-1``: causal, optionally windowed, optionally without padded keys.

    Returns a bool mask of shape (T, S), or (B, 1, T, S) when ``key_padding`` (B, S) is given
    (True = real token). True = may attend.
    """
    q = torch.arange(q_start, q_start + T, device=device)[:, None]
    k = torch.arange(k_start, k_start + S, device=device)[None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (k > q - window)
    if key_padding is not None:
        # A padded query attends to itself only, so no row is fully masked (which would give NaN);
        # real queries never see padded keys.
        mask = mask[None, None] & (key_padding[:, None, None, :].bool() | (k == q)[None, None])
    return mask
