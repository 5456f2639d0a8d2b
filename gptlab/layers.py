"""The transformer's small layers: norms, activations, feed-forward blocks, and the linear layer.

Where this sits: tokens -> *model* -> logits. Each idea comes twice, on purpose:

* a plain function that *is* the definition, written out in tensor operations (``layer_norm``,
  ``rms_norm``, ``gelu``): what the chapters derive and the graders compare against;
* a module (``LayerNorm``, ``RMSNorm``, ``MLP``, ``SwiGLU``) holding the weights, which calls
  PyTorch's fused kernel for the same formula (faster, and its backward too). ``tests/test_layers.py``
  checks each function against the kernel.

:class:`Linear` is ``nn.Linear`` with one addition for decoding on a CPU: with only a few tokens
and no autograd, its matrix product is split in row blocks over the cores
(:func:`row_split_linear`). Every linear layer of :class:`gptlab.GPT` is one, so prefill, decode
steps and speculative verification all go through the same layers.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from .model import GPTConfig

__all__ = [
    "layer_norm",
    "rms_norm",
    "gelu",
    "new_gelu",
    "LayerNorm",
    "RMSNorm",
    "MLP",
    "SwiGLU",
    "Linear",
    "row_split_linear",
    "row_blocks",
    "blocks_product",
    "row_split",
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


# --------------------------------------------------------------------------- linear layers for decoding

_ROW_PARTS: int | None = None  # None: torch.get_num_threads() (see row_split)
ROW_SPLIT_MAX_ROWS = 32  # row-split products with at most this many input vectors


def _row_parts(out_features: int, parts: int) -> int:
    """The largest count <= ``parts`` of equal row blocks, none thinner than 16 rows."""
    p = max(1, parts)
    while p > 1 and (out_features % p or out_features // p < 16):
        p -= 1
    return p


def row_split_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, parts: int = 2) -> Tensor:
    """``F.linear(x, weight, bias)`` computed as ``parts`` row blocks of ``weight`` in one batched
    matrix product: x (..., in), weight (out, in), bias (out,) -> (..., out).

    Why: decoding multiplies a handful of vectors by each weight matrix, so a step is memory-bound
    (every weight is read once) and BLAS runs such a product on one core. Split in row blocks,
    ``torch.bmm`` hands each core its own block to stream, and a 2-core CPU reads the weights
    about 1.6x faster (``python -m gptlab bench generate`` reports the bare chains both ways). The
    blocks are views of ``weight`` (no copy) and each output is the same dot product, so the
    result equals ``F.linear``'s up to float rounding. Fewer parts are used when ``out`` is not
    divisible or the blocks would be thinner than 16 rows; a non-contiguous weight is not split.
    """
    blocks = row_blocks(weight, bias, parts)
    if blocks is None:
        return F.linear(x, weight, bias)
    return blocks_product(x, *blocks)


def row_blocks(weight: Tensor, bias: Tensor | None, parts: int) -> tuple[Tensor, Tensor | None] | None:
    """The row blocks :func:`row_split_linear` multiplies by: weight (out, in) -> (P, in, out/P)
    and bias (out,) -> (P, 1, out/P), views of the same memory (detached: an optimiser's in-place
    update shows through). None when the product is not split (one part, or a non-contiguous
    weight)."""
    out, inp = weight.shape
    p = _row_parts(out, parts) if weight.is_contiguous() else 1
    if p == 1:
        return None
    w = weight.detach().view(p, out // p, inp).transpose(1, 2)  # (P, in, out/P): a view
    b = None if bias is None else bias.detach().view(p, 1, out // p)
    return w, b


def blocks_product(x: Tensor, blocks: Tensor, bias_blocks: Tensor | None) -> Tensor:
    """x (..., in) times the row blocks (P, in, out/P) (+ bias blocks (P, 1, out/P)) of
    :func:`row_blocks`, in one batched product -> (..., out), outputs in the weight's row order."""
    p, inp, part = blocks.shape
    lead = x.shape[:-1]
    # (P, N, in): views of x's N = B * T vectors (one batch row, as in decoding, needs no reshape)
    x2 = (x if x.dim() == 3 and lead[0] == 1 else x.reshape(1, -1, inp)).expand(p, -1, -1)
    if bias_blocks is None:
        y = torch.bmm(x2, blocks)  # (P, N, out/P)
    else:
        y = torch.baddbmm(bias_blocks, x2, blocks)
    if x2.shape[1] == 1:  # one vector: (P, 1, out/P) is already the outputs in order
        return y.view(*lead, p * part)
    return y.transpose(0, 1).reshape(*lead, p * part)  # block p holds outputs p*out/P..


@contextmanager
def row_split(parts: int | None) -> Iterator[None]:
    """Within the block, :class:`Linear` splits its small products in ``parts`` row blocks
    (``1``: never; ``None``: ``torch.get_num_threads()``, the default)."""
    global _ROW_PARTS
    if parts is not None and (isinstance(parts, bool) or not isinstance(parts, int) or parts < 1):
        raise ValueError(f"parts must be None or an int >= 1, got {parts!r}")
    old, _ROW_PARTS = _ROW_PARTS, parts
    try:
        yield
    finally:
        _ROW_PARTS = old


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose product, when it is small (at most
    ``ROW_SPLIT_MAX_ROWS`` input vectors), on a CPU, without autograd (``torch.no_grad`` or
    ``torch.inference_mode``: decoding), is split over the cores as :func:`row_split_linear` does.
    The row-block views are made once and kept until the weight, the bias or the part count
    changes (a decode step runs a few dozen of these products; re-slicing the weight each time
    cost as much as a small product itself). Training and long prefills run ``F.linear``
    unchanged."""

    _blocks: tuple | None = None  # (key, row_blocks(...)) of the last split

    def forward(self, x: Tensor) -> Tensor:
        params = self._parameters  # (plain dict reads: a decode step runs this a few dozen times)
        w, b = params["weight"], params.get("bias")
        if not torch.is_grad_enabled() and x.is_cpu and x.numel() <= ROW_SPLIT_MAX_ROWS * self.in_features:
            parts = torch.get_num_threads() if _ROW_PARTS is None else _ROW_PARTS
            if parts > 1:
                key = (parts, w.data_ptr(), None if b is None else b.data_ptr())
                cached = self._blocks
                if cached is None or cached[0] != key:  # first call, or the weights were replaced
                    cached = self._blocks = (key, row_blocks(w, b, parts))
                if cached[1] is not None:
                    return blocks_product(x, *cached[1])
        return F.linear(x, w, b)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_blocks", None)  # views, remade on demand: never pickled or deep-copied
        return state


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


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama): :func:`rms_norm`, computed in float32 for low-precision inputs."""

    def __init__(self, ndim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same formula in one fused kernel (its backward too): ~25% faster CPU training
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
        self.c_fc = Linear(config.n_embd, config.inner_dim, bias=config.bias)
        self.c_proj = Linear(config.inner_dim, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        y = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # new_gelu
        return F.dropout(y, self.dropout) if self.training and self.dropout > 0.0 else y


class SwiGLU(nn.Module):
    """Llama's feed-forward: ``c_proj(silu(x W_gate) * (x W_up))``; gate and up fused in ``c_fc``
    (its first half is the gate, its second half the up projection). x (B, T, C) -> (B, T, C)."""

    def __init__(self, config: "GPTConfig"):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 2 * config.inner_dim, bias=config.bias)
        self.c_proj = Linear(config.inner_dim, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return _dropout(self.c_proj(F.silu(gate) * up), self.dropout, self.training)
