"""The transformer's small layers: norms, activations, feed-forward blocks, and the linear layer.

Where this sits: tokens -> *model* -> logits. Each idea comes twice, on purpose:

* a plain function that *is* the definition, written out in tensor operations (``layer_norm``,
  ``rms_norm``, ``gelu``): what the chapters derive and the graders compare against;
* a module (``LayerNorm``, ``RMSNorm``, ``MLP``, ``SwiGLU``) holding the weights, which calls
  PyTorch's fused kernel for the same formula (faster, and its backward too). ``tests/test_layers.py``
  checks each function against the kernel.

:class:`Linear` is ``nn.Linear`` with one addition for decoding on a CPU: with only a few tokens
and no autograd, its matrix product runs on a copy of the weight packed in row blocks, one
contiguous block per core and more, in the layout the fastest kernel for the job reads
(:func:`row_split_linear`). Every linear layer of :class:`gptlab.GPT` is one, so prefill, decode
steps and speculative verification all go through the same layers.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, NamedTuple

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
    "RowBlocks",
    "row_blocks",
    "blocks_product",
    "bag_product",
    "batched_product",
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

_ROW_PARTS: int | None = None  # None: 2 * torch.get_num_threads() (see row_split)
ROW_SPLIT_MAX_ROWS = 32  # packed products for at most this many input vectors ...
ROW_SPLIT_MIN_WEIGHT = 1 << 17  # ... and weights of at least this many numbers (512 KB in float32)
# One vector's product as an embedding-bag sum where PyTorch has FBGEMM's kernel for it (x86 CPUs);
# elsewhere the bag is a plain loop, and the batched product is faster.
EMBEDDING_BAG_PRODUCT = "fbgemm" in torch.backends.quantized.supported_engines


class RowBlocks(NamedTuple):
    """A weight (out, in) and bias (out,) packed for decoding's products (:func:`row_blocks`)."""

    weight: Tensor  # (P, in, part): block p is rows p*part .. (p+1)*part - 1 of the weight, transposed
    bias: Tensor | None  # (P, 1, part): the same slices of the bias
    out_features: int  # out <= P * part: the last block is padded with zero rows
    indices: Tensor  # (P * in,) int64: 0, 1, ..., P*in - 1, every row of every block, in order
    offsets: Tensor  # (P,) int64: 0, in, 2 in, ..., where each block's rows start


def row_blocks(weight: Tensor, bias: Tensor | None, parts: int) -> RowBlocks:
    """Pack ``weight`` (out, in) and ``bias`` (out,) for :func:`blocks_product`: the weight's rows
    in ``parts`` equal blocks of ``part = ceil(out / P)`` rows (zero rows pad the last block), each
    stored transposed and contiguous, (P, in, part), the bias likewise (P, 1, part). A copy,
    detached from autograd: :class:`Linear` makes it once and remakes it when the weight changes."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an int >= 1, got {parts!r}")
    out, inp = weight.shape
    part = -(-out // parts)
    with torch.no_grad():
        padded = weight.new_zeros(parts * part, inp)
        padded[:out] = weight
        blocks = padded.view(parts, part, inp).transpose(1, 2).contiguous()  # (P, in, part)
        bias_blocks = None
        if bias is not None:
            bias_blocks = bias.new_zeros(parts * part)
            bias_blocks[:out] = bias
            bias_blocks = bias_blocks.view(parts, 1, part)
    indices = torch.arange(parts * inp, device=weight.device)
    offsets = torch.arange(0, parts * inp, max(inp, 1), device=weight.device)
    return RowBlocks(blocks, bias_blocks, out, indices, offsets)


def blocks_product(x: Tensor, blocks: RowBlocks) -> Tensor:
    """``F.linear(x, weight, bias)`` from the packed weight of :func:`row_blocks`: x (..., in) ->
    (..., out), the P blocks in one call that spreads them over the cores.

    One vector (a batch-1 decode step, the case that matters) runs :func:`bag_product` where
    FBGEMM's embedding-bag kernel exists (``EMBEDDING_BAG_PRODUCT``: x86 CPUs); several vectors, or
    one where that kernel is missing, run :func:`batched_product`. ``python -m gptlab bench
    generate`` measures both on one vector.
    """
    if EMBEDDING_BAG_PRODUCT and x.numel() == blocks.weight.shape[1] > 0:
        return bag_product(x, blocks)
    return batched_product(x, blocks)


def bag_product(x: Tensor, blocks: RowBlocks) -> Tensor:
    """One vector's product from the packed blocks: x (..., in) holding one vector -> (..., out).

    ``y = sum_i x_i W^T[i, :]`` is a weighted sum of the rows of ``W^T``, exactly what
    ``torch.embedding_bag`` computes (mode sum with ``per_sample_weights``, one bag per block). Its
    kernel streams the table from memory several times faster than a BLAS matrix-vector product on
    the CPUs measured, and a decode step spends most of its time reading weights.
    """
    w = blocks.weight
    P, inp, part = w.shape
    weights = torch.cat([x.reshape(inp)] * P)  # (P * in,): x once per block
    y = torch.embedding_bag(w.view(P * inp, part), blocks.indices, blocks.offsets, per_sample_weights=weights)[0]
    if blocks.bias is not None:  # y (P, part) is a new tensor: add in place
        y = y.add_(blocks.bias.view(P, part))
    y = y.view(*x.shape[:-1], P * part)
    return y if P * part == blocks.out_features else y.narrow(-1, 0, blocks.out_features)


def batched_product(x: Tensor, blocks: RowBlocks) -> Tensor:
    """Any number of vectors' product from the packed blocks: x (..., in) -> (..., out), one
    batched matrix product (``torch.baddbmm``) that reads each block once for all the vectors."""
    w = blocks.weight
    P, inp, part = w.shape
    lead = x.shape[:-1]
    n = math.prod(lead)
    x2 = x.reshape(1, n, inp).expand(P, n, inp)
    y = torch.bmm(x2, w) if blocks.bias is None else torch.baddbmm(blocks.bias, x2, w)  # (P, n, part)
    y = y.transpose(0, 1).reshape(*lead, P * part)  # (n, P, part): block p holds outputs p*part ..
    return y if P * part == blocks.out_features else y.narrow(-1, 0, blocks.out_features)


def row_split_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, parts: int = 2) -> Tensor:
    """``F.linear(x, weight, bias)`` computed as :class:`Linear` computes a decode step's product:
    x (..., in), weight (out, in), bias (out,) -> (..., out), the weight's rows split in ``parts``
    blocks (:func:`row_blocks`) multiplied in one call (:func:`blocks_product`).

    Why: decoding multiplies a handful of vectors by each weight matrix, so a step is memory-bound
    (every 4-byte weight is read once per token for two floating-point operations per vector) and
    what counts is how fast the weights stream from memory. ``F.linear`` runs one vector's
    product on one core; the blocks put every core to work, each reading its own contiguous block.
    Each output is the same dot product, summed in another order, so the result equals
    ``F.linear``'s up to float rounding. (This packs the weight on every call; :class:`Linear`
    packs it once.)
    """
    return blocks_product(x, row_blocks(weight, bias, parts))


@contextmanager
def row_split(parts: int | None) -> Iterator[None]:
    """Within the block, :class:`Linear` packs its decode-step products in ``parts`` row blocks
    (``1``: never, plain ``F.linear``; ``None``: twice ``torch.get_num_threads()``, the default)."""
    global _ROW_PARTS
    if parts is not None and (isinstance(parts, bool) or not isinstance(parts, int) or parts < 1):
        raise ValueError(f"parts must be None or an int >= 1, got {parts!r}")
    old, _ROW_PARTS = _ROW_PARTS, parts
    try:
        yield
    finally:
        _ROW_PARTS = old


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) that runs a decode step's products fast on
    a CPU.

    When the product is small (at most ``ROW_SPLIT_MAX_ROWS`` input vectors), the weight large (at
    least ``ROW_SPLIT_MIN_WEIGHT`` numbers; smaller ones stay in the caches between tokens and are
    faster whole) and float32, and autograd off (``torch.no_grad`` or ``torch.inference_mode``:
    decoding), it runs :func:`blocks_product` on a packed copy of its weight (:func:`row_blocks`),
    which costs as much memory again as the weight. The copy is made on the first such call and
    remade when the weight or bias changes: replaced (tying,
    ``.data =``, ``load_state_dict(assign=True)``, ``.to()``) or modified in place (an optimiser
    step, ``load_state_dict``, anything under ``torch.no_grad``: PyTorch counts these in the
    tensor's ``_version``). PyTorch does not count changes made through ``.data`` (``w.data.mul_``),
    so after one of those call :meth:`unpack`. Training and long prefills run ``F.linear``
    unchanged; so does everything off the CPU.
    """

    _packed: tuple | None = None  # (key, RowBlocks) of the last packed product

    def forward(self, x: Tensor) -> Tensor:
        params = self._parameters  # (plain dict reads: a decode step runs this a few dozen times)
        w, b = params["weight"], params.get("bias")
        if (not torch.is_grad_enabled() and x.is_cpu and x.numel() <= ROW_SPLIT_MAX_ROWS * self.in_features
                and w.numel() >= ROW_SPLIT_MIN_WEIGHT and w.dtype == torch.float32 and not w.is_inference()):
            parts = 2 * torch.get_num_threads() if _ROW_PARTS is None else _ROW_PARTS
            if parts > 1:
                key = (parts, w.data_ptr(), w._version) if b is None else \
                    (parts, w.data_ptr(), w._version, b.data_ptr(), b._version)
                packed = self._packed
                if packed is None or packed[0] != key:  # first call, or the weights changed
                    packed = self._packed = (key, row_blocks(w, b, parts))
                return blocks_product(x, packed[1])
        return F.linear(x, w, b)

    def unpack(self) -> None:
        """Drop the packed copy of the weight (remade at the next decode-step product)."""
        self.__dict__.pop("_packed", None)

    def _apply(self, fn, recurse=True):
        self.unpack()  # .to(), .cuda(), .half(): the copy of the old weights goes with them
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_packed", None)  # a copy, remade on demand: never pickled or deep-copied
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
