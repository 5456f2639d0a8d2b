"""Causal self-attention: the one place the model mixes information between positions.

Where this sits: tokens -> *model* (each block: norm -> **attention** -> norm -> MLP) -> logits.

* :func:`attention_weights` and :func:`attention`: ``softmax(q k^T / sqrt(d)) v`` written out, the
  formula the chapters derive (the model's default runs PyTorch's fused
  ``scaled_dot_product_attention`` for the same numbers).
* :func:`split_heads` / :func:`merge_heads`: (B, T, C) <-> (B, n_head, T, C / n_head).
* :class:`CausalSelfAttention`: the layer. It is the single attention code path of
  :class:`gptlab.GPT`: training, a full forward, a prompt prefill and decode steps of one or several
  tokens over any KV cache (:mod:`gptlab.kvcache`), with grouped-query attention, RoPE, a sliding
  window and padding masks, all run this ``forward``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .masks import slot_mask
from .rope import apply_rope_train, rope_qkv_train

if TYPE_CHECKING:
    from .kvcache import KVCache
    from .config import GPTConfig

__all__ = ["attention_weights", "attention", "split_heads", "merge_heads", "CausalSelfAttention"]


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None = None) -> Tensor:
    """``softmax(q k^T / sqrt(d))`` over the keys: q (B, H, T, d), k (B, H, S, d) -> (B, H, T, S).

    ``mask`` (bool, broadcastable to (B, H, T, S), True = may attend) sets the scores of the other
    keys to ``-inf`` before the softmax, so they get weight exactly 0. A query whose keys are all
    masked gets all-zero weights (not NaN). Leading dimensions other than (B, H) work too.
    """
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (..., T, S)
    if mask is None:
        return torch.softmax(scores, dim=-1)
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.nan_to_num(weights, nan=0.0)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention written out: ``softmax(q k^T / sqrt(d) + mask) v``.

    q (..., T, d), k and v (..., S, d); ``mask`` broadcastable to (..., T, S), True where allowed.
    Returns the output (..., T, d), and the attention weights (..., T, S) if ``return_weights``.
    A query row whose keys are all masked gets all-zero weights (not NaN). Equals
    ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask)``.
    """
    weights = attention_weights(q, k, mask)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = weights @ v
    return (out, weights) if return_weights else out


def split_heads(x: Tensor, n_head: int) -> Tensor:
    """(B, T, C) -> (B, n_head, T, C // n_head): head ``h`` takes features ``h*d .. (h+1)*d - 1``."""
    B, T, C = x.shape
    if C % n_head:
        raise ValueError(f"split_heads: C={C} is not divisible by n_head={n_head}")
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, d) -> (B, T, H * d), the inverse of :func:`split_heads`."""
    B, H, T, d = x.shape
    if T == 1:  # one position: (B, H, 1, d) already has (B, 1, H, d)'s memory order
        return x.reshape(B, 1, H * d)
    return x.transpose(1, 2).reshape(B, T, H * d)


def _fused(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, is_causal: bool) -> Tensor:
    """``F.scaled_dot_product_attention``; q (B, nh, T, hd), k and v (B, nh, S, hd) -> (B, nh, T, hd).

    PyTorch 2.13's fused CPU kernel for 16-bit inputs fails on a CPU with AMX when its AVX-512
    kernels are switched off (``ATEN_CPU_CAPABILITY=default`` or ``avx2``: "pack_vnni2 is only
    supported when avx512 is supported"); the same attention then runs on PyTorch's math backend.
    """
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    except RuntimeError as e:
        if "pack_vnni2" not in str(e):
            raise
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention. x (B, T, C) -> (B, T, C).

    ``c_attn`` projects to queries (n_head heads), keys and values (n_kv_head heads each), in
    that order, in one matrix product; ``c_proj`` mixes the heads back. Set
    ``record_weights = True`` to keep the last attention weights in ``last_weights``
    (B, n_head, T, S) (it runs the written-out :func:`attention`).

    What one call does, whatever the situation:

    1. project x to q, k, v and split them in heads;
    2. rotate q and k by their positions (RoPE models: ``rope = (cos, sin)``);
    3. with a ``kv_cache``: store k, v at the cache's next slots and take every cached key and
       value from slot ``key_start`` on (the older ones are outside a sliding window);
    4. attend, under ``mask`` (bool, True = may attend) or, without one, causally
       (``is_causal``) or to every key (one new token over its cache);
    5. merge the heads and project back.

    The model (:meth:`gptlab.GPT.forward`) works out ``rope``, ``mask``, ``is_causal`` and
    ``key_start`` once per forward pass and hands the same ones to every layer.
    """

    def __init__(self, config: "GPTConfig", layer_idx: int = 0):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.layer_idx = layer_idx
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, q_dim + 2 * kv_dim, bias=config.bias)
        self.c_proj = nn.Linear(q_dim, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.impl = config.attn_impl
        self.record_weights = False
        self.last_weights: Tensor | None = None

    def forward(
        self,
        x: Tensor,
        *,
        rope: tuple[Tensor, Tensor] | None = None,
        mask: Tensor | None = None,
        is_causal: bool = True,
        kv_cache: "KVCache | None" = None,
        key_start: int = 0,
    ) -> Tensor:
        B, T, _ = x.shape
        nh, nkv, hd = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.c_attn(x)  # (B, T, (nh + 2 nkv) hd)
        # 1-2. heads, as views of qkv: (B, T, nh + 2 nkv, hd) -> (B, nh + 2 nkv, T, hd)
        if T == 1 and rope is None and nkv == nh:
            # one token (a decode step): (B, 1, 3, nh, hd) and (B, 3, nh, 1, hd) are the same memory,
            # so one view and one unbind give q, k, v (B, nh, 1, hd) (the general case's five views)
            q, k, v = qkv.view(B, 3, nh, 1, hd).unbind(1)
        elif rope is not None and kv_cache is None and (fast := rope_qkv_train(qkv, *rope, nh, nkv)) is not None:
            q, k, v = fast  # training: the same heads, with a backward that writes qkv's gradient at once
        else:
            heads = qkv.view(B, T, nh + 2 * nkv, hd).transpose(1, 2)
            # split, not narrow: in training, split's backward writes each gradient once into one
            # tensor, where each narrow's would fill a zero tensor of all the heads, then add them up
            qk, v = heads.split((nh + nkv, nkv), dim=1)
            if rope is not None:  # rotate the query and key heads in one go
                qk = apply_rope_train(qk, *rope)
            q, k = qk.split((nh, nkv), dim=1)
        # 3. the cache: append, then read back every key the new queries may see
        if kv_cache is not None:
            k, v, first = kv_cache.update(self.layer_idx, k, v)  # (B, nkv, S, hd), S from slot `first`
            if key_start > first:
                skip = key_start - first
                k, v = k.narrow(2, skip, k.shape[2] - skip), v.narrow(2, skip, v.shape[2] - skip)
        if nkv != nh:  # grouped-query attention: each key/value head serves nh / nkv query heads
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
        # 4. attend
        dropout_p = self.dropout if self.training else 0.0
        if self.impl == "explicit" or self.record_weights:
            if mask is None and is_causal:
                mask = slot_mask(k.shape[2] - T, T, 0, k.shape[2], device=x.device)
            y, w = attention(q, k, v, mask, dropout_p, return_weights=True)
            if self.record_weights:
                self.last_weights = w.detach()
        else:
            y = _fused(q, k, v, mask, dropout_p, is_causal and mask is None)
        # 5. (B, nh, T, hd) -> (B, T, nh hd) -> (B, T, C)
        y = self.c_proj(merge_heads(y))
        return F.dropout(y, dropout_p) if dropout_p > 0.0 else y
