"""The transformer's small layers: norms, activations and feed-forward blocks.

Where this sits: tokens -> *model* -> logits. Each idea comes twice, on purpose:

* a plain function that *is* the definition, written out in tensor operations (``layer_norm``,
  ``rms_norm``, ``gelu``): what the chapters derive and the graders compare against;
* a module (``LayerNorm``, ``RMSNorm``, ``MLP``, ``SwiGLU``) holding the weights, which calls
  PyTorch's fused kernel for the same formula (faster, and its backward too). ``tests/test_layers.py``
  checks each function against the kernel.

The linear layers are PyTorch's own ``nn.Linear``. Decoding on a CPU can run them faster on a
packed copy of their weights: that lives apart, in :mod:`gptlab.fast.cpu`, which swaps its
``PackedLinear`` in for the length of a decode (``generate(..., fast=True)``) and never changes
what these modules compute.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from .config import GPTConfig

__all__ = [
    "layer_norm",
    "rms_norm",
    "gelu",
    "new_gelu",
    "LayerNorm",
    "RMSNorm",
    "MLP",
    "SwiGLU",
]


# --------------------------------------------------------------------------- the definitions


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Layer normalisation over the last dimension: x (..., C) -> (..., C).

    ``(x - mean) / sqrt(var + eps) * weight + bias``, mean and (biased) variance over the C
    features of each position. Equals ``F.layer_norm(x, (C,), weight, bias, eps)``.
    """
    mean = x.mean(dim=-1, keepdim=True)
    var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * weight
    return y + bias if bias is not None else y


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """Root-mean-square normalisation (Llama): x (..., C) -> (..., C),
    ``x / sqrt(mean(x^2) + eps) * weight``: LayerNorm without the centring and the bias.
    Equals ``F.rms_norm(x, (C,), weight, eps)``."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def gelu(x: Tensor) -> Tensor:
    """GPT-2's GELU, the tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``,
    elementwise, any shape. Equals ``F.gelu(x, approximate="tanh")``."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def new_gelu(x: Tensor) -> Tensor:
    """:func:`gelu` in PyTorch's fused kernel (GPT-2's code calls it ``new_gelu``); what
    :class:`MLP` runs."""
    return F.gelu(x, approximate="tanh")


# --------------------------------------------------------------------------- modules


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension with an optional bias (GPT-2 trains with one; nanoGPT's
    ``bias=False`` variant drops it): :func:`layer_norm` in PyTorch's fused kernel."""

    def __init__(self, ndim: int, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None
        self.eps = eps
        self.normalized_shape = (ndim,)

    def forward(self, x: Tensor) -> Tensor:
        params = self._parameters  # the kernel F.layer_norm calls, without its Python wrapper
        return torch.layer_norm(x, self.normalized_shape, params["weight"], params.get("bias"), self.eps)


class _RMSNormFunction(torch.autograd.Function):
    """:func:`rms_norm` (float32) with a backward written out, for training on a CPU (:class:`RMSNorm`).

    Forward ``xhat = x * r``, ``r = 1 / sqrt(mean(x^2) + eps)``, output ``xhat * weight``; it keeps
    ``xhat`` and ``r``. Backward, with ``gw = g * weight``: ``dx = r * (gw - xhat * mean(gw * xhat))``
    and ``dweight = sum(g * xhat)`` over every position. PyTorch's own CPU backward of
    ``F.rms_norm`` differentiates the formula op by op (pow, mean, rsqrt, two products), about half
    as fast again; the numbers are the same up to float rounding (``tests/test_layers.py``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        r = torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True).add_(eps))
        xhat = x * r
        ctx.save_for_backward(xhat, r, weight)
        return xhat * weight

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        xhat, r, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gw = g * weight
            dot = torch.mean(gw * xhat, dim=-1, keepdim=True)
            dx = torch.addcmul(gw, xhat, dot, value=-1.0).mul_(r)
        if ctx.needs_input_grad[1]:
            dw = (g * xhat).sum(dim=tuple(range(g.dim() - 1)))
        return dx, dw, None


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama): :func:`rms_norm`, computed in float32 for low-precision inputs."""

    def __init__(self, ndim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad) and x.device.type == "cpu"
                    and not torch.compiler.is_compiling()
                    and not torch.is_autocast_enabled("cpu")):
                # CPU training: the same formula with a backward of its own (_RMSNormFunction)
                return _RMSNormFunction.apply(x, self.weight, self.eps)
            # the same formula in PyTorch's kernel
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _dropout(x: Tensor, p: float, training: bool) -> Tensor:
    return F.dropout(x, p) if training and p > 0.0 else x


class MLP(nn.Module):
    """GPT-2's feed-forward: Linear(C, 4C) -> GELU(tanh) -> Linear(4C, C) -> dropout.
    x (B, T, C) -> (B, T, C)."""

    def __init__(self, config: "GPTConfig"):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.inner_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.inner_dim, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        y = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # new_gelu
        return F.dropout(y, self.dropout) if self.training and self.dropout > 0.0 else y


class _SwiGLUFunction(torch.autograd.Function):
    """:class:`SwiGLU` without biases, ``c_proj(silu(x W_gate^T) * (x W_up^T))``, with a backward
    of its own, for training on a CPU. ``W`` is ``c_fc.weight`` (gate rows, then up rows), ``P``
    ``c_proj.weight``. The gate and the up projection are two products (each output contiguous),
    and the backward never joins the two activation gradients (autograd's backward of ``chunk``
    copies both into one tensor of twice their size), only the two halves of ``W``'s small gradient.
    The numbers are the module's up to float rounding (``tests/test_layers.py``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, p: Tensor) -> Tensor:
        inner = p.shape[1]
        x2 = x.reshape(-1, x.shape[-1])
        gate = x2 @ w[:inner].t()
        up = x2 @ w[inner:].t()
        act = F.silu(gate)
        h = act * up
        ctx.save_for_backward(x2, w, p, gate, up, act, h)
        return (h @ p.t()).view(*x.shape[:-1], p.shape[0])

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x2, w, p, gate, up, act, h = ctx.saved_tensors
        inner = p.shape[1]
        g2 = g.reshape(-1, g.shape[-1])
        dp = g2.t() @ h if ctx.needs_input_grad[2] else None
        dh = g2 @ p
        d_up = dh * act
        d_gate = torch.ops.aten.silu_backward(dh * up, gate)
        dw = torch.cat([d_gate.t() @ x2, d_up.t() @ x2]) if ctx.needs_input_grad[1] else None  # (2 inner, C): small
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.addmm(d_gate @ w[:inner], d_up, w[inner:]).view(*g.shape[:-1], w.shape[1])
        return dx, dw, dp


class SwiGLU(nn.Module):
    """Llama's feed-forward: ``c_proj(silu(x W_gate) * (x W_up))``; gate and up fused in ``c_fc``
    (its first half is the gate, its second half the up projection). x (B, T, C) -> (B, T, C)."""

    def __init__(self, config: "GPTConfig"):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 2 * config.inner_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.inner_dim, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        w, p = self.c_fc.weight, self.c_proj.weight
        if (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or p.requires_grad)
                and self.c_fc.bias is None and self.c_proj.bias is None and x.dtype == w.dtype == p.dtype
                and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()):
            # training on a CPU: the same formula with a backward of its own (_SwiGLUFunction)
            y = _SwiGLUFunction.apply(x, w, p)
        else:
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            y = self.c_proj(F.silu(gate) * up)
        return _dropout(y, self.dropout, self.training)
