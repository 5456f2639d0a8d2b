"""Checks of the ``blocks`` assignment (chapter 4, transformer blocks).

Where this sits: beside the pipeline (text -> tokens -> batches -> *model* -> logits -> loss or
samples -> text); each task is one part of a transformer block, compared with gptlab's own:

* ``layer_norm(x, weight, bias, eps)``: x (..., C) -> (..., C), :func:`gptlab.layers.layer_norm`;
* ``gelu(x)``: GPT-2's tanh approximation, elementwise, :func:`gptlab.layers.gelu`;
* ``rms_norm(x, weight, eps)``: x (..., C) -> (..., C), :func:`gptlab.layers.rms_norm`;
* ``apply_rope(x, cos, sin)``: x (B, H, T, D) rotated by position, rotate-half convention,
  :func:`gptlab.rope.apply_rope`;
* ``Block(n_embd, n_head)``: a pre-norm GPT-2 block, compared with :class:`gptlab.model.Block` whose
  (randomised) weights are copied into the learner's block by name.

Tolerances: the four single ops are compared with a reference computed in float64 from the same
float32 inputs, within atol 1e-5 + rtol 1e-4 x |expected|; the composed block within atol 2e-5 +
rtol 2e-4 (float32 rounding of the whole test block stays below 5e-6, while GELU's exact form
instead of the tanh approximation moves its output by about 4e-4, so that mistake is caught).

The four functions must be written by hand: each check forbids gptlab's reference and PyTorch's
fused op for it (``F.layer_norm``/``nn.LayerNorm``, ``F.gelu``/``nn.GELU``, ``F.rms_norm``/
``nn.RMSNorm``). The block may use ``nn.LayerNorm`` and ``F.gelu(x, approximate="tanh")``, but not
gptlab's ``Block``, ``MLP`` or ``CausalSelfAttention``, nor PyTorch's ``nn.TransformerEncoderLayer``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import attention as _attention
from .. import layers as _layers
from .. import model as _model
from .. import rope as _rope
from .core import ExerciseError, call, entries_of, torch_family, describe, expect_close, expect_tensor
from .remote import is_module, is_module_class, load_params
from .task import Case, Task

__all__ = ["check_layer_norm", "check_gelu", "check_rms_norm", "check_apply_rope", "check_Block",
           "LAYER_NORM", "GELU", "RMS_NORM", "APPLY_ROPE"]

ATOL, RTOL = 1e-5, 1e-4  # single ops, float32 against a float64 reference
BLOCK_ATOL, BLOCK_RTOL = 2e-5, 2e-4  # the composed block

_FORBID_LAYER_NORM = (
    entries_of(_layers, "layer_norm", "LayerNorm")
    # the other normalisations compute a layer norm too when given the right shape
    + entries_of(F, "layer_norm", "group_norm", "instance_norm", "batch_norm", prefix="F")
    + entries_of(torch, "layer_norm", "native_layer_norm", "group_norm")
    + entries_of(nn, "LayerNorm", "GroupNorm", prefix="nn")
)
_FORBID_LAYER_NORM += torch_family("layer_norm", "batch_norm", "group_norm", "instance_norm",
                                   but=[f.target for f in _FORBID_LAYER_NORM])  # torch.batch_norm on (1, N, C)
_FORBID_GELU = entries_of(_layers, "gelu", "new_gelu") + entries_of(F, "gelu", prefix="F") + entries_of(nn, "GELU", prefix="nn")
_FORBID_GELU += torch_family("gelu", but=[f.target for f in _FORBID_GELU])
_FORBID_RMS_NORM = (entries_of(_layers, "rms_norm", "RMSNorm") + entries_of(F, "rms_norm", prefix="F")
                    + entries_of(torch, "rms_norm") + entries_of(nn, "RMSNorm", prefix="nn"))
_FORBID_RMS_NORM += torch_family("rms_norm", but=[f.target for f in _FORBID_RMS_NORM])  # torch._fused_rms_norm
_FORBID_ROPE = entries_of(_rope, "apply_rope")
_FORBID_BLOCK = (entries_of(_model, "Block") + entries_of(_layers, "MLP") + entries_of(_attention, "CausalSelfAttention")
                 + entries_of(nn, "TransformerEncoderLayer", "TransformerDecoderLayer", prefix="nn"))


def _f64(fn: Callable[..., Tensor], *args: Tensor | float) -> Tensor:
    """``fn`` on float64 copies of the tensor arguments, cast back to float32: an exact reference."""
    return fn(*(a.double() if isinstance(a, Tensor) else a for a in args)).float()


# --------------------------------------------------------------------------- layer_norm


def _scale(var: Tensor, eps: float, sqrt: bool, eps_outside: bool) -> Tensor:
    """What a norm divides by: sqrt(var + eps), or one of two mistakes (no square root; eps outside it)."""
    if not sqrt:
        return var + eps
    return var.sqrt() + eps if eps_outside else (var + eps).sqrt()


def _ln_variant(x, w, b, eps, *, dim=-1, unbiased=False, eps_outside=False, center=True, sqrt=True,
                affine="both"):
    """LayerNorm with one of the usual mistakes switched on (float64)."""
    x, w, b = x.double(), w.double(), b.double()
    if dim is None:
        mean, var = x.mean(), x.var(unbiased=unbiased)
    else:
        mean, var = x.mean(dim, keepdim=True), x.var(dim, keepdim=True, unbiased=unbiased)
    xc = x - mean if center else x
    xh = xc / _scale(var, eps, sqrt, eps_outside)
    out = {"both": xh * w + b, "none": xh, "weight": xh * w, "bias": xh + b, "swapped": xh * b + w}[affine]
    return out.float()


def _ln_mistakes(x: Tensor, w: Tensor, b: Tensor, eps: float) -> list:
    v = lambda **k: (lambda: _ln_variant(x, w, b, eps, **k))  # noqa: E731
    bessel = ("you used the unbiased variance (Bessel's correction, dividing by C - 1): x.var(dim=-1) and "
              "x.std(dim=-1) divide by C - 1 by default, LayerNorm divides by C. Use "
              "x.var(dim=-1, keepdim=True, unbiased=False) or ((x - mean) ** 2).mean(dim=-1, keepdim=True).")
    out = [
        (bessel, v(unbiased=True)),
        ("you added eps outside the square root, (x - mean) / (std + eps); LayerNorm divides by "
         "sqrt(var + eps). The two differ when the variance is small (try a nearly constant row).",
         v(eps_outside=True)),
        (bessel + " You also added eps outside the square root: divide by sqrt(var + eps).",
         v(eps_outside=True, unbiased=True)),
        ("you divided by the variance instead of the standard deviation: divide by sqrt(var + eps).", v(sqrt=False)),
        ("you did not subtract the mean: LayerNorm centres each position's features, (x - mean) / sqrt(var + eps).",
         v(center=False)),
        ("you forgot the weight and the bias: multiply by weight and add bias after normalising.", v(affine="none")),
        ("you forgot the bias: add it after multiplying by weight.", v(affine="weight")),
        ("you forgot the weight: multiply by it before adding the bias.", v(affine="bias")),
        ("you swapped weight and bias: the result is x_hat * weight + bias.", v(affine="swapped")),
        ("you normalised over all the numbers of the tensor at once; LayerNorm normalises each position "
         "separately, over its C features: mean and variance over dim=-1 with keepdim=True.", v(dim=None)),
    ]
    for d in range(x.dim() - 1):
        out.append((f"you normalised over the wrong dimension (dim={d}); LayerNorm normalises over the "
                    "features, the last dimension: mean(dim=-1, keepdim=True).", v(dim=d)))
        out.append((f"you normalised over the wrong dimension (dim={d}) and used the unbiased variance; "
                    "use dim=-1 and unbiased=False.", v(dim=d, unbiased=True)))
    return out


def _norm_cases(seed: int) -> list[tuple[str, Tensor, Tensor, Tensor, float]]:
    """(description, x, weight, bias, eps): seeded inputs and edge cases for the two norms."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [
        ("x (2, 5, 16) seeded, eps=1e-5", r(2, 5, 16) + 0.5, 1 + 0.3 * r(16), 0.2 * r(16), 1e-5),
        ("x (1, 1, 8): one sequence of one token", r(1, 1, 8), 1 + 0.3 * r(8), 0.2 * r(8), 1e-5),
        ("x (3, 4, 16) with tiny spread (0.01 x randn), eps=1e-5", 0.01 * r(3, 4, 16), 1 + 0.3 * r(16),
         0.2 * r(16), 1e-5),
        ("x (2, 3, 12) seeded, eps=0.1", r(2, 3, 12), 1 + 0.3 * r(12), 0.2 * r(12), 0.1),
        ("x (2, 4, 16) with large values (100 x randn + 50)", 100 * r(2, 4, 16) + 50, 1 + 0.3 * r(16),
         0.2 * r(16), 1e-5),
        ("x (6, 10): a 2-D input, normalised over its last dimension", r(6, 10) - 1, 1 + 0.3 * r(10),
         0.2 * r(10), 1e-5),
    ]


def _same_shape_as_x(got, case: Case, what: str = "") -> Tensor:
    """A finite float tensor of x's shape (x = the first argument)."""
    x = case.args[0]
    got = expect_tensor(got, what or f"{case.what} on {case.text}", shape=x.shape, dtype="float", device=x.device,
                        finite=True, hint_shape="It must keep the shape of x: reduce with keepdim=True so that the "
                                                "mean and the variance broadcast against x.")
    return got.float()


def _layer_norm_cases(seed: int) -> list[Case]:
    return [Case((x, w, b, eps), text, "layer_norm") for text, x, w, b, eps in _norm_cases(seed)]


def _rms_norm_cases(seed: int) -> list[Case]:
    # other inputs than layer_norm's (seed + 1); their rows do not have mean 0, so centring shows
    return [Case((x, w, eps), text, "rms_norm") for text, x, w, _, eps in _norm_cases(seed + 1)]


def _gelu_cases(seed: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    cases = [
        ("x = torch.linspace(-8, 8, 161).reshape(7, 23)", torch.linspace(-8, 8, 161).reshape(7, 23)),
        ("x (2, 3, 4) = 3 x randn, seeded", 3 * torch.randn(2, 3, 4, generator=g)),
        ("x = tensor([1.0])", torch.tensor([1.0])),
        ("x = tensor([-50., -20., -5., 5., 20., 50.])", torch.tensor([-50.0, -20.0, -5.0, 5.0, 20.0, 50.0])),
    ]
    return [Case((x,), text, "gelu") for text, x in cases]


def _expect_gelu(got, case: Case) -> Tensor:
    x = case.args[0]
    return expect_tensor(got, f"gelu({case.text})", shape=x.shape, dtype=x.dtype, device=x.device, finite=True,
                         hint_shape="GELU works elementwise: the result has the shape of x.")


def _rope_cases(seed: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    cos, sin = _rope.rope_cache(32, 8)
    cases = [
        ("x (2, 3, 5, 8) seeded, cos/sin of positions 0..4, shape (5, 8)", torch.randn(2, 3, 5, 8, generator=g),
         cos[:5], sin[:5]),
        ("x (1, 2, 6, 8) seeded, cos/sin of positions 7..12, shape (6, 8)", torch.randn(1, 2, 6, 8, generator=g),
         cos[7:13], sin[7:13]),
        ("x (1, 1, 1, 8): one token at position 20", torch.randn(1, 1, 1, 8, generator=g), cos[20:21], sin[20:21]),
    ]
    pos = torch.tensor([[3, 4, 5, 6], [0, 9, 17, 30]])
    cases.append(("x (2, 2, 4, 8), each row its own positions: cos/sin shaped (2, 1, 4, 8)",
                  torch.randn(2, 2, 4, 8, generator=g), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)))
    return [Case((x, c, s), text, "apply_rope") for text, x, c, s in cases]


def _expect_rope(got, case: Case) -> Tensor:
    x = case.args[0]
    return expect_tensor(got, f"apply_rope on {case.text}", shape=x.shape, dtype="float", device=x.device,
                         finite=True, hint_shape="The rotated x keeps the shape of x.").float()


LAYER_NORM = Task("layer_norm", lambda x, w, b, eps: _f64(_layers.layer_norm, x, w, b, eps), _FORBID_LAYER_NORM,
                  _layer_norm_cases, ATOL, RTOL, _ln_mistakes, _same_shape_as_x)


def check_layer_norm(fn: Callable[..., Tensor], seed: int = 0) -> None:
    """Check a learner's ``layer_norm(x, weight, bias, eps)``: x (..., C) -> (..., C).

    ``(x - mean) / sqrt(var + eps) * weight + bias`` with the mean and the biased variance (divided
    by C) over the last dimension, compared with :func:`gptlab.layers.layer_norm` computed in
    float64 (atol 1e-5, rtol 1e-4). Inputs: seeded (B, T, C) tensors, one token, a nearly constant
    input (where eps matters), eps=0.1, large values, a 2-D input. Forbids gptlab's layer_norm and
    LayerNorm, ``F.layer_norm``, ``torch.layer_norm`` and ``nn.LayerNorm``.
    """
    LAYER_NORM.check(fn, seed)


# --------------------------------------------------------------------------- gelu


def _gelu_tanh(x: Tensor, c: float = math.sqrt(2 / math.pi), k: float = 0.044715, p: int = 3,
               half: float = 0.5, times_x: bool = True) -> Tensor:
    inner = c * (x + k * x**p)
    return (half * x if times_x else half) * (1 + torch.tanh(inner))


def _gelu_mistakes(x: Tensor) -> list:
    x = x.double()
    f = lambda t: (lambda: t().float())  # noqa: E731
    return [
        ("you wrote the exact GELU, x * Phi(x) with the normal CDF (erf). This task asks for GPT-2's tanh "
         "approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); the two differ by up to about "
         "5e-4.", f(lambda: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))))),
        ("you left out the cubic term: the argument of tanh is sqrt(2/pi) * (x + 0.044715 * x**3).",
         f(lambda: _gelu_tanh(x, k=0.0))),
        ("you used x**2 instead of x**3 inside tanh: the argument is sqrt(2/pi) * (x + 0.044715 * x**3).",
         f(lambda: _gelu_tanh(x, p=2))),
        ("the constant is sqrt(2 / pi) (about 0.7979), not sqrt(2 * pi).",
         f(lambda: _gelu_tanh(x, c=math.sqrt(2 * math.pi)))),
        ("the constant is sqrt(2 / pi) (about 0.7979), not 2 / pi.", f(lambda: _gelu_tanh(x, c=2 / math.pi))),
        ("the constant is sqrt(2 / pi) (about 0.7979), not sqrt(pi / 2).",
         f(lambda: _gelu_tanh(x, c=math.sqrt(math.pi / 2)))),
        ("you forgot the factor 0.5: GELU is 0.5 * x * (1 + tanh(...)).", f(lambda: _gelu_tanh(x, half=1.0))),
        ("you returned the gate 0.5 * (1 + tanh(...)) without multiplying it by x.",
         f(lambda: _gelu_tanh(x, times_x=False))),
        ("you wrote the sigmoid approximation x * sigmoid(1.702 x); this task asks for the tanh one.",
         f(lambda: x * torch.sigmoid(1.702 * x))),
        ("you wrote ReLU (max(x, 0)); GELU is smooth and slightly negative for negative inputs.",
         f(lambda: x.clamp_min(0))),
    ]


GELU = Task("gelu", lambda x: _f64(_layers.gelu, x), _FORBID_GELU, _gelu_cases, ATOL, RTOL, _gelu_mistakes,
            _expect_gelu)


def check_gelu(fn: Callable[[Tensor], Tensor], seed: int = 0) -> None:
    """Check a learner's ``gelu(x)``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` elementwise.

    Compared with :func:`gptlab.layers.gelu` in float64 (atol 1e-5, rtol 1e-4) on a grid over
    [-8, 8] (where the exact GELU differs from the approximation by up to about 5e-4), seeded
    values, a single number and large values (+-50). The result must keep x's shape and dtype.
    Forbids gptlab's gelu, ``F.gelu`` and ``nn.GELU``.
    """
    GELU.check(fn, seed)


# --------------------------------------------------------------------------- rms_norm


def _rms_variant(x, w, eps, *, dim=-1, center=False, eps_outside=False, sqrt=True, weight=True, l2=False):
    x, w = x.double(), w.double()
    if center:
        x = x - x.mean(dim, keepdim=True)
    ms = x.pow(2).sum(dim, keepdim=True) if l2 else x.pow(2).mean(dim, keepdim=True)
    y = x / _scale(ms, eps, sqrt, eps_outside)
    return (y * w if weight else y).float()


def _rms_mistakes(x: Tensor, w: Tensor, eps: float) -> list:
    v = lambda **k: (lambda: _rms_variant(x, w, eps, **k))  # noqa: E731
    out = [
        ("you subtracted the mean: RMSNorm does not centre, it only divides by the root mean square, "
         "x / sqrt(mean(x**2) + eps) * weight (with the mean subtracted it is LayerNorm without bias).",
         v(center=True)),
        ("you added eps outside the square root: divide by sqrt(mean(x**2) + eps), not sqrt(mean(x**2)) + eps.",
         v(eps_outside=True)),
        ("you forgot the square root: divide by sqrt(mean(x**2) + eps), not by mean(x**2) + eps.", v(sqrt=False)),
        ("you divided by the Euclidean norm (a sum of squares): RMSNorm uses the MEAN of the squares, "
         "so that the result does not shrink as C grows.", v(l2=True)),
        ("you forgot to multiply by weight.", v(weight=False)),
    ]
    for d in range(x.dim() - 1):
        out.append((f"you normalised over the wrong dimension (dim={d}); RMSNorm normalises over the features, "
                    "the last dimension: mean(dim=-1, keepdim=True).", v(dim=d)))
    return out


RMS_NORM = Task("rms_norm", lambda x, w, eps: _f64(_layers.rms_norm, x, w, eps), _FORBID_RMS_NORM,
                _rms_norm_cases, ATOL, RTOL, _rms_mistakes, _same_shape_as_x)


def check_rms_norm(fn: Callable[..., Tensor], seed: int = 0) -> None:
    """Check a learner's ``rms_norm(x, weight, eps)``: x (..., C) -> ``x / sqrt(mean(x^2) + eps) * weight``.

    The mean of the squares is over the last dimension. Compared with :func:`gptlab.layers.rms_norm`
    in float64 (atol 1e-5, rtol 1e-4) on the inputs of :func:`check_layer_norm` (whose rows do not
    have mean 0, so subtracting the mean shows). Forbids gptlab's rms_norm and RMSNorm,
    ``F.rms_norm``, ``torch.rms_norm`` and ``nn.RMSNorm``.
    """
    RMS_NORM.check(fn, seed)


# --------------------------------------------------------------------------- apply_rope


def _rope_mistakes(x: Tensor, cos: Tensor, sin: Tensor) -> list:
    x, cos, sin = x.double(), cos.double(), sin.double()
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]

    def interleaved():
        a, b = x[..., 0::2], x[..., 1::2]  # pairs (x0, x1), (x2, x3), ... with the angles of cos[..., :h]
        c, s = cos[..., :h], sin[..., :h]
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)

    def every_two(c: Tensor, s: Tensor) -> Tensor:
        # Meta's / GPT-J's rotate_every_two: (x0, x1), (x2, x3), ... -> (-x1, x0), (-x3, x2), ...
        rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
        return x * c + rotated * s

    def repeated(t: Tensor) -> Tensor:
        # the tables read as if each angle were repeated for a pair (Meta's layout): every other column
        return t[..., 0::2].repeat_interleave(2, dim=-1)

    f = lambda t: (lambda: t().float())  # noqa: E731
    interleaved_text = (
        "you rotated interleaved pairs (x[..., 0::2], x[..., 1::2]), the convention of the RoPE paper and "
        "Meta's Llama code. gptlab (and Hugging Face) pair feature i with feature i + D/2: rotate_half(x) = "
        "cat([-x2, x1]) where x1, x2 = x.chunk(2, dim=-1), and the tables cos and sin are laid out for these "
        "halves (column i and column i + D/2 hold the same angle): use them as they are.")
    return [
        (interleaved_text, f(interleaved)),
        (interleaved_text, f(lambda: every_two(cos, sin))),
        (interleaved_text, f(lambda: every_two(repeated(cos), repeated(sin)))),
        ("the sign of the sine term is flipped (that rotates by -angle): rotate_half(x) is cat([-x2, x1]), "
         "not cat([x2, -x1]).", f(lambda: x * cos + torch.cat([x2, -x1], -1) * sin)),
        ("rotate_half(x) must negate the second half and put it first, cat([-x2, x1]); you left out the minus.",
         f(lambda: x * cos + torch.cat([x2, x1], -1) * sin)),
        ("rotate_half(x) is cat([-x2, x1]): you kept the halves in place, cat([-x1, x2]).",
         f(lambda: x * cos + torch.cat([-x1, x2], -1) * sin)),
        ("you swapped cos and sin: the result is x * cos + rotate_half(x) * sin.",
         f(lambda: x * sin + torch.cat([-x2, x1], -1) * cos)),
        ("you returned only x * cos: add rotate_half(x) * sin.", f(lambda: x * cos)),
        ("you returned only rotate_half(x) * sin: add x * cos.", f(lambda: torch.cat([-x2, x1], -1) * sin)),
    ]


APPLY_ROPE = Task("apply_rope", lambda x, c, s: _f64(_rope.apply_rope, x, c, s), _FORBID_ROPE, _rope_cases,
                  ATOL, RTOL, _rope_mistakes, _expect_rope)


def check_apply_rope(fn: Callable[..., Tensor], seed: int = 0) -> None:
    """Check a learner's ``apply_rope(x, cos, sin)``: ``x * cos + rotate_half(x) * sin``.

    x (B, H, T, D); cos and sin (T, D) tables from :func:`gptlab.rope.rope_cache` (also shaped
    (B, 1, T, D), one set of positions per row); rotate_half(x) = cat([-x2, x1]) with x1, x2 the two
    halves of the last dimension. Compared with :func:`gptlab.rope.apply_rope` in float64
    (atol 1e-5, rtol 1e-4) for positions 0.., positions 7.., one token, and per-row positions.
    Forbids gptlab's apply_rope.
    """
    APPLY_ROPE.check(fn, seed)


# --------------------------------------------------------------------------- Block


def _reference_block(n_embd: int, n_head: int, seed: int) -> nn.Module:
    """gptlab's pre-norm GPT-2 block with seeded weights of a useful size (float64, eval mode):
    norm weights near 1, biases near 0.1, linear weights ~ N(0, 1/fan_in), so that every part of the
    block (the norms, GELU's curve, both residual branches) visibly changes the output."""
    cfg = _model.GPTConfig(n_embd=n_embd, n_head=n_head, n_layer=1, vocab_size=16, block_size=64,
                           dropout=0.0, bias=True, prenorm=True, norm="layernorm", mlp="gelu")
    block = _model.Block(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.startswith("ln_") and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return block.double().eval()


def _block_mistakes(ref: nn.Module, x: Tensor) -> list:
    """Known wrong blocks, built from the reference block's own parts (float64)."""
    x = x.double()
    a, m, ln1, ln2 = ref.attn, ref.mlp, ref.ln_1, ref.ln_2
    mlp_with = lambda act: (lambda h: m.c_proj(act(m.c_fc(h))))  # noqa: E731
    tanh = lambda h: F.gelu(h, approximate="tanh")  # noqa: E731

    def pre(mlp=None, res_attn=True, res_mlp=True, ln_b=None):
        mlp, ln_b = mlp or mlp_with(tanh), ln_b or ln2
        h = (x if res_attn else 0) + a(ln1(x))
        return (h if res_mlp else 0) + mlp(ln_b(h))

    def thunk(fn):
        return lambda: fn().float()

    return [
        ("your block is post-norm (GPT-1, the original transformer): x = ln_1(x + attn(x)). GPT-2's block is "
         "pre-norm: x = x + attn(ln_1(x)), then x = x + mlp(ln_2(x)).",
         thunk(lambda: (lambda h: ln2(h + mlp_with(tanh)(h)))(ln1(x + a(x))))),
        ("the attention's residual connection is missing: x = x + attn(ln_1(x)), not x = attn(ln_1(x)).",
         thunk(lambda: pre(res_attn=False))),
        ("the MLP's residual connection is missing: x = x + mlp(ln_2(x)), not x = mlp(ln_2(x)).",
         thunk(lambda: pre(res_mlp=False))),
        ("both residual connections are missing: each sub-layer's output is ADDED to its input, "
         "x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)).", thunk(lambda: pre(res_attn=False, res_mlp=False))),
        ("you overwrote x with ln_1(x) before the residual: the normalised x goes into attn only, "
         "x = x + attn(ln_1(x)), and the residual carries the un-normalised x.",
         thunk(lambda: (lambda n: (lambda h: h + mlp_with(tanh)(ln2(h)))(n + a(n)))(ln1(x)))),
        ("the GELU is missing from the MLP: mlp(x) = c_proj(gelu(c_fc(x))). Without it the two linear layers "
         "collapse into one linear map.", thunk(lambda: pre(mlp=mlp_with(lambda h: h)))),
        ("the GELU is in the wrong place (after c_proj): mlp(x) = c_proj(gelu(c_fc(x))).",
         thunk(lambda: pre(mlp=lambda h: tanh(m.c_proj(m.c_fc(h)))))),
        ("the GELU is in the wrong place (before c_fc): mlp(x) = c_proj(gelu(c_fc(x))).",
         thunk(lambda: pre(mlp=lambda h: m.c_proj(m.c_fc(tanh(h)))))),
        ("you used the exact GELU (F.gelu(x) with its default approximate='none'); GPT-2's block uses the "
         "tanh approximation: F.gelu(x, approximate='tanh').", thunk(lambda: pre(mlp=mlp_with(F.gelu)))),
        ("you used ReLU in the MLP; GPT-2 uses GELU (tanh approximation): F.gelu(x, approximate='tanh').",
         thunk(lambda: pre(mlp=mlp_with(F.relu)))),
        ("you used ln_1 before the MLP too: the MLP has its own norm, x = x + mlp(ln_2(x)).",
         thunk(lambda: pre(ln_b=ln1))),
        ("you ran attention and the MLP in parallel on the same input (x + attn(ln_1(x)) + mlp(ln_2(x))); in "
         "GPT-2 the MLP reads the output of the attention step: x = x + attn(ln_1(x)), then x = x + mlp(ln_2(x)).",
         thunk(lambda: x + a(ln1(x)) + mlp_with(tanh)(ln2(x)))),
    ]


_BLOCK_HINTS = {
    "ln_1": "self.ln_1 = nn.LayerNorm(n_embd)",
    "ln_2": "self.ln_2 = nn.LayerNorm(n_embd)",
    "attn": "self.attn = CausalSelfAttention(n_embd, n_head)",
    "mlp": "self.mlp = MLP(n_embd), whose __init__ sets self.c_fc = nn.Linear(n_embd, 4 * n_embd) and "
           "self.c_proj = nn.Linear(4 * n_embd, n_embd)",
}


def _load_reference_weights(block: nn.Module, ref: nn.Module) -> None:
    """Copy ``ref``'s parameters into the learner's ``block`` by name; explain any mismatch."""
    mine = dict(block.named_parameters())
    want = {k: v for k, v in ref.named_parameters()}
    missing = [k for k in want if k not in mine]
    extra = [k for k in mine if k not in want]
    if missing or extra:
        lines = ["Block's parameters do not have the names of GPT-2's block, so its weights cannot be loaded."]
        if missing:
            lines.append(f"  missing: {missing}")
            tops = sorted({k.split('.')[0] for k in missing if k.split('.')[0] in _BLOCK_HINTS})
            lines += [f"    expected e.g. {_BLOCK_HINTS[t]}" for t in tops]
        if extra:
            lines.append(f"  not expected: {extra}")
        if any(k.endswith(".bias") and k[: -len("bias")] + "weight" in mine for k in missing):
            lines.append("  GPT-2's linear layers and norms have biases: keep bias=True (the default).")
        lines.append(f"  expected exactly: {list(want)}")
        raise ExerciseError("\n".join(lines))
    for k, p in want.items():
        q = mine[k]
        if tuple(q.shape) != tuple(p.shape):
            hint = ""
            if q.dim() == 2 and tuple(q.shape) == tuple(p.shape)[::-1]:
                hint = (" nn.Linear(in_features, out_features) stores its weight as (out_features, in_features): "
                        "did you swap in and out?")
            elif q.dim() == 2:
                hint = " c_fc maps C -> 4C, c_proj maps 4C -> C; c_attn maps C -> 3C."
            raise ExerciseError(f"Block's parameter {k} has shape {tuple(q.shape)}, expected {tuple(p.shape)}.{hint}")
    load_params(block, {k: p.to(dtype=mine[k].dtype) for k, p in want.items()})


def check_Block(cls: type, seed: int = 0) -> None:  # noqa: N802 - named after the learner's class
    """Check a learner's ``Block(n_embd, n_head)``: a pre-norm GPT-2 transformer block, x (B, T, C) -> (B, T, C).

    ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`` with ``mlp(h) = c_proj(gelu_tanh(c_fc(h)))``.
    The parameters of :class:`gptlab.model.Block` (seeded, of a useful size) are copied by name into
    the learner's block (``ln_1.weight``, ``attn.c_attn.weight``, ..., ``mlp.c_proj.bias``; a clear
    message if a name or a shape differs), which is then compared with the reference computed in
    float64 on seeded inputs, one token, a batch of one and large values (atol 2e-5, rtol 2e-4).
    Forbids gptlab's Block, MLP and CausalSelfAttention and PyTorch's transformer layers.
    """
    if not is_module_class(cls):
        raise TypeError(f"check_Block expects your Block class (a subclass of nn.Module), got {describe(cls)}")
    n_embd, n_head = 32, 4
    ref = _reference_block(n_embd, n_head, seed)
    block = call(cls, "Block", n_embd, n_head, forbidden=_FORBID_BLOCK)
    if not is_module(block):
        raise ExerciseError(f"Block({n_embd}, {n_head}) should create an nn.Module, got {describe(block)}.")
    _load_reference_weights(block, ref)
    block.eval()  # no dropout
    g = torch.Generator().manual_seed(seed + 1)
    cases = [
        ("x (2, 6, 32) seeded", torch.randn(2, 6, n_embd, generator=g)),
        ("x (1, 1, 32): one sequence of one token", torch.randn(1, 1, n_embd, generator=g)),
        ("x (1, 9, 32) with large values (20 x randn)", 20 * torch.randn(1, 9, n_embd, generator=g)),
    ]
    for text, x in cases:
        got = call(block, "Block", x, forbidden=_FORBID_BLOCK)
        got = expect_tensor(got, f"Block({n_embd}, {n_head}) on {text}", shape=x.shape, dtype="float",
                            device=x.device, finite=True, hint_shape="A block maps (B, T, C) to (B, T, C).").float()
        with torch.no_grad():
            want = ref(x.double()).float()
            expect_close(got, want, f"Block({n_embd}, {n_head}) with gptlab's weights", text, BLOCK_ATOL,
                         BLOCK_RTOL, mistakes=_block_mistakes(ref, x))
