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

__all__ = ["rope_cache", "apply_rope", "apply_rope_into", "apply_rope_train", "rope_qkv_train"]


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


class _RopeRotation(torch.autograd.Function):
    """:func:`apply_rope` with a backward of its own, for training (:func:`apply_rope_train`).

    The two halves are updated in place (``x * cos``, then ``-x2 * sin1`` added to the first half
    and ``x1 * sin2`` to the second, ``sin = [sin1, sin2]``), so neither the forward nor the backward
    builds the rotated copy ``[-x2, x1]``; the backward is the transposed rotation: ``g * cos``, plus
    ``g2 * sin2`` in the first half and ``-g1 * sin1`` in the second.
    """

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_into(torch.empty_like(x), x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate_into(torch.empty_like(g), g, cos, sin, -1.0), None, None


def apply_rope_train(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rope` (the same numbers up to float rounding), faster to train through.

    Where ``x`` needs a gradient and the tables do not (a model's own tables), it runs a fused
    rotation with its own backward (about half the elementwise passes of the written-out
    formula's forward and backward); anywhere else (inference, tables that need gradients, a GPU,
    under ``torch.compile``, which fuses the formula itself) it is :func:`apply_rope`, to the last bit.
    """
    if (torch.is_grad_enabled() and x.requires_grad and not cos.requires_grad and not sin.requires_grad
            and _eager_cpu(x) and x.shape[-1] % 2 == 0 and x.is_floating_point() and x.dtype == cos.dtype == sin.dtype):
        return _RopeRotation.apply(x, cos, sin)
    return apply_rope(x, cos, sin)


def _eager_cpu(x: Tensor) -> bool:
    """The fast training paths' domain: eager CPU tensors. They were measured on CPUs only, and
    ``torch.compile`` fuses the plain formula itself (it would break its graph at their ``out=``
    writes into strided views)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def apply_rope_into(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rope`'s rotation of x (..., T, D) written into ``out`` (x's shape, any strides)
    and returned: ``x * cos``, then the halves' multiply-adds (``- x2 sin1`` and ``+ x1 sin2``),
    three calls where :func:`apply_rope` makes five and builds the rotated copy ``[-x2, x1]``. The
    same numbers up to float rounding (a multiply-add may round once), not bit for bit: for code
    that already accepts rounding, such as :meth:`gptlab.fast.native.LlamaPythonDecoder.chunk`'s
    lean path."""
    return _rotate_into(out, x, cos, sin, 1.0)


def _rotate_into(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    """Into ``out`` (any strides), with ``x = [x1, x2]`` and ``sin = [sin1, sin2]`` in halves: sign 1
    writes :func:`apply_rope`'s rotation ``[x1 cos1 - x2 sin1, x2 cos2 + x1 sin2]``, sign -1 its
    transpose ``[x1 cos1 + x2 sin2, x2 cos2 - x1 sin1]`` (the backward)."""
    h = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    if sign > 0:
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1.0)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:])
    else:
        out[..., :h].addcmul_(x[..., h:], sin[..., h:])
        out[..., h:].addcmul_(x[..., :h], sin[..., :h], value=-1.0)
    return out


class _RopeQKV(torch.autograd.Function):
    """q, k, v from a fused projection ``qkv`` (B, T, (nq + 2 nkv) d), q and k rotated by RoPE:
    (:func:`rope_qkv_train`). The backward writes the three gradients straight into one gradient
    of ``qkv``, in its own layout: no concatenation, no zero-filled tensors added up, no copy."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor, nq: int, nkv: int) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = qkv.shape
        d = qkv.shape[-1] // (nq + 2 * nkv)
        heads = qkv.view(B, T, nq + 2 * nkv, d).transpose(1, 2)  # (B, nq + 2 nkv, T, d), a view
        qk_in = heads.narrow(1, 0, nq + nkv)
        qk = _rotate_into(torch.empty_like(qk_in), qk_in, cos, sin, 1.0)
        ctx.save_for_backward(cos, sin)
        ctx.shape = (B, T, nq, nkv, d)
        return qk.narrow(1, 0, nq), qk.narrow(1, nq, nkv), heads.narrow(1, nq + nkv, nkv)

    @staticmethod
    def backward(ctx, gq: Tensor, gk: Tensor, gv: Tensor):
        cos, sin = ctx.saved_tensors
        B, T, nq, nkv, d = ctx.shape
        dqkv = gq.new_empty(B, T, nq + 2 * nkv, d)
        dheads = dqkv.transpose(1, 2)  # (B, nq + 2 nkv, T, d), a view of dqkv
        for g, start, n in ((gq, 0, nq), (gk, nq, nkv)):
            dst = dheads.narrow(1, start, n)
            if g is None:
                dst.zero_()
            else:
                _rotate_into(dst, g, cos, sin, -1.0)
        dv = dheads.narrow(1, nq + nkv, nkv)
        dv.copy_(gv) if gv is not None else dv.zero_()
        return dqkv.view(B, T, -1), None, None, None, None


def rope_qkv_train(qkv: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_kv: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """Training's fast path of :class:`gptlab.attention.CausalSelfAttention`: from the fused
    projection ``qkv`` (B, T, (n_q + 2 n_kv) d), the heads q (B, n_q, T, d), k and v (B, n_kv, T, d),
    with q and k rotated by :func:`apply_rope` (the same numbers up to float rounding) and a
    backward that writes ``qkv``'s gradient in one pass. None where it does not apply (no
    gradient needed, tables that need one, other dtypes, a GPU, under ``torch.compile``): the
    caller then takes the general path.
    """
    if not (torch.is_grad_enabled() and qkv.requires_grad and not cos.requires_grad and not sin.requires_grad
            and _eager_cpu(qkv) and qkv.is_contiguous() and qkv.dtype == cos.dtype == sin.dtype and qkv.is_floating_point()):
        return None
    d = qkv.shape[-1] // (n_q + 2 * n_kv)
    if d % 2 or d * (n_q + 2 * n_kv) != qkv.shape[-1]:
        return None
    return _RopeQKV.apply(qkv, cos, sin, n_q, n_kv)
