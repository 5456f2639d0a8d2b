"""Checks of the ``causal_mask`` assignment (chapter 2, causal masks).

Tasks, each compared with :mod:`gptlab.masks` on several sizes:

* ``causal_mask(T)``: bool (T, T), True where query i may attend to key j (j <= i);
* ``additive_mask(T)``: float (T, T), 0 where allowed and -inf elsewhere;
* ``causal_attention_weights(scores)``: scores (B, H, T, T) -> softmax over keys, future masked;
* ``combine_masks(causal, key_padding)``: bool (T, T) and bool (B, T) -> bool (B, 1, T, T).

Masks are compared exactly (they are booleans or 0/-inf); the weights, one softmax, with a tight
tolerance (atol 1e-5, rtol 1e-4). Each task forbids gptlab's own function for it, and the mask
tasks also PyTorch's ``nn.Transformer.generate_square_subsequent_mask``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._C import _VariableFunctions as _VF  # not torch.allclose, which a learner's cell may replace

from .. import causal_mask as _exported_causal_mask
from .. import masks as _masks
from .core import Candidate, ExerciseError, Forbidden, expect_tensor, same
from .task import Case, Task

__all__ = [
    "check_causal_mask",
    "check_additive_mask",
    "check_causal_attention_weights",
    "check_combine_masks",
    "diagnose_mask",
    "reference_causal_attention_weights",
]

NINF = float("-inf")

_GPTLAB_MASKS = (
    Forbidden(_masks.causal_mask, "gptlab.causal_mask"),
    Forbidden(_exported_causal_mask, "gptlab.causal_mask"),
    Forbidden(_masks.additive_mask, "gptlab.masks.additive_mask"),
    Forbidden(_masks.combine_masks, "gptlab.masks.combine_masks"),
    Forbidden(torch.nn.Transformer.generate_square_subsequent_mask, "nn.Transformer.generate_square_subsequent_mask"),
)


def _show(t: Tensor) -> str:
    """A small 0/1 picture of a 2-D mask (rows = queries, columns = keys)."""
    return "\n".join("".join("1" if v else "." for v in row) for row in t.tolist())


# --------------------------------------------------------------------------- causal_mask


def diagnose_mask(got: Tensor, T: int) -> str | None:
    """Name the most likely mistake in a boolean (T, T) mask meant to equal ``causal_mask(T)``.

    ``got`` must already be a bool tensor of shape (T, T). Returns ``None`` if it is correct, else
    a sentence describing the mistake.
    """
    want = _masks.causal_mask(T)
    if same(got, want):
        return None
    ones = torch.ones(T, T, dtype=torch.bool)
    if same(got, ~want):
        return (
            "your mask is inverted: it is True where attention must be blocked. gptlab (like "
            "PyTorch's scaled_dot_product_attention) uses the convention True = may attend, so "
            "query i may attend to keys j <= i (the lower triangle, diagonal included)."
        )
    if same(got, ones.triu()):
        return (
            "you let tokens attend to the future: your mask is the upper triangle (torch.triu), "
            "so row i allows keys j >= i. A row is a query; query i may only see keys j <= i, "
            "the lower triangle (torch.tril)."
        )
    if same(got, ones.tril(-1)):
        return (
            "the diagonal is excluded: a token must be able to attend to itself (j == i). "
            "With it excluded, the first token may attend to nothing at all and its softmax is "
            "0/0 = NaN. Use torch.tril(..., diagonal=0)."
        )
    if same(got, ones):
        return "your mask allows everything: every token can attend to the future. Keep only j <= i."
    if not got.any():
        return "your mask blocks everything: no token may attend to anything, not even itself."
    if same(got, want.T):
        return (
            "your mask is transposed (rows are keys, columns are queries): you let tokens attend "
            "to the future. Row i is query i and must allow keys j <= i."
        )
    for d in range(1, T):
        if same(got, ones.tril(d)):
            return (
                f"your mask lets each token see {d} token(s) ahead (torch.tril with diagonal={d}): "
                "that leaks the future. Use diagonal=0."
            )
    for w in range(1, T):
        if same(got, ones.tril() & ~ones.tril(-w)):
            return (
                f"your mask is a sliding window of {w} token(s): each token only sees the last {w}. "
                "A plain causal mask lets token i see every earlier token j <= i."
            )
    future = got & ~want
    if future.any():
        i, j = (int(v) for v in future.nonzero()[0])
        return f"query {i} may attend to key {j}, which is in its future (j > i): that leaks the future."
    i, j = (int(v) for v in (want & ~got).nonzero()[0])
    return f"query {i} may not attend to key {j}, an earlier (or the same) position it must be able to see."


def _size_cases(name: str) -> Callable[..., list[Case]]:
    """``(seed, sizes) -> [Case((T,), ...)]``: the cases of a task whose only argument is the size T."""
    return lambda seed, sizes: [Case((T,), f"T = {T}", f"{name}({T})") for T in sizes]


def _expect_bool_mask(got: Any, case: Case) -> Tensor:
    (T,) = case.args
    if isinstance(got, Tensor) and tuple(got.shape) != (T, T):
        raise ExerciseError(
            f"{case.what} should have shape (T, T) = ({T}, {T}), got {tuple(got.shape)}. "
            + ("Did you hard-code the size instead of using T?" if got.dim() == 2 else "")
        )
    got = expect_tensor(got, case.what, shape=(T, T), device="cpu").cpu()
    if got.dtype != torch.bool:
        values = set(torch.unique(got.float()).tolist())
        if values <= {0.0, NINF} and NINF in values:
            hint = (
                "it looks like an additive mask (0 where allowed, -inf where blocked). That is a "
                "fine way to mask scores, but this task asks for the boolean mask"
            )
        elif values <= {0.0, 1.0} and diagnose_mask(got != 0, T) is None:
            hint = (
                "its 0/1 pattern is right, but PyTorch treats a float mask as numbers to ADD to the "
                "scores, so a 0./1. mask would block nothing; convert it with .bool() or build it "
                "with dtype=torch.bool"
            )
        else:
            hint = "build it with dtype=torch.bool"
        raise ExerciseError(f"{case.what} should be a bool tensor (True = may attend), got dtype {got.dtype}: {hint}.")
    return got


CAUSAL_MASK = Task(
    "causal_mask", _masks.causal_mask, _GPTLAB_MASKS, _size_cases("causal_mask"), expect=_expect_bool_mask,
    diagnose=lambda got, want, case: diagnose_mask(got, *case.args), show=_show, legend="1 = may attend")


def check_causal_mask(fn: Callable[[int], Tensor], sizes: Sequence[int] = (5, 1, 2, 3, 8)) -> None:
    """Check a learner's ``causal_mask(T) -> Tensor`` against :func:`gptlab.causal_mask`.

    The expected answer for each ``T`` in ``sizes`` is a bool tensor of shape (T, T), True where
    query i may attend to key j (j <= i). Raises :class:`ExerciseError` with a diagnosis otherwise.
    """
    CAUSAL_MASK.check(fn, sizes=sizes)


# --------------------------------------------------------------------------- additive_mask


def _diagnose_additive(got: Tensor, T: int) -> str | None:
    """The likely mistake in a float (T, T) mask meant to be 0 where allowed and -inf elsewhere."""
    finite = torch.isfinite(got)
    values = set(torch.unique(got[finite]).tolist())
    if values <= {0.0, 1.0} and (got == 1).any() and bool(finite.all()):
        return (
            "you returned a 0/1 mask as floats. An additive mask is ADDED to the scores, and adding 1 "
            "blocks nothing: allowed positions must be 0 and blocked ones -inf."
        )
    if bool((got > 0).any()):
        return "an additive mask holds only 0 (allowed) and -inf (blocked); yours has positive entries."
    blocked = got != 0
    big_negative = blocked & finite
    if big_negative.any() and bool((got[big_negative] <= -1e3).all()):
        value = got[big_negative][0].item()
        pattern = diagnose_mask(~blocked, T)
        return (
            f"you used a large negative number ({value:g}) instead of -inf. After the softmax it is only "
            "almost 0, and in float16 (largest value 65504) such a number overflows to -inf on its own "
            "or, added to the scores, to NaN; this task asks for float('-inf')."
            + (f" Also, {pattern}" if pattern else "")
        )
    if values <= {0.0}:
        pattern = diagnose_mask(~blocked, T)
        if pattern:
            return f"reading 0 as 'may attend' and -inf as 'blocked': {pattern}"
    return None


def _expect_additive(got: Any, case: Case) -> Tensor:
    (T,) = case.args
    if isinstance(got, Tensor) and got.dtype == torch.bool:
        raise ExerciseError(
            f"{case.what} returned a bool tensor: that is the boolean mask of the first task. An "
            "additive mask is a float tensor that is added to the scores: 0 where a query may attend, "
            "-inf where it may not."
        )
    return expect_tensor(got, case.what, shape=(T, T), dtype="float", device="cpu").cpu().float()


ADDITIVE_MASK = Task(
    "additive_mask", _masks.additive_mask, _GPTLAB_MASKS, _size_cases("additive_mask"), expect=_expect_additive,
    diagnose=lambda got, want, case: _diagnose_additive(got, *case.args)
    or "it differs from 0 where j <= i and -inf where j > i.",
    show=lambda t: "\n".join(" ".join(f"{v:>5g}" for v in row) for row in t.tolist()))


def check_additive_mask(fn: Callable[[int], Tensor], sizes: Sequence[int] = (5, 1, 2, 4, 7)) -> None:
    """Check a learner's ``additive_mask(T)``: float (T, T), 0 where j <= i and -inf where j > i.

    Compared exactly with :func:`gptlab.masks.additive_mask`. Raises :class:`ExerciseError` naming
    the mistake (a large negative number instead of -inf, a boolean or 0/1 mask, the wrong triangle).
    """
    ADDITIVE_MASK.check(fn, sizes=sizes)


# --------------------------------------------------------------------------- masked attention weights


def reference_causal_attention_weights(scores: Tensor) -> Tensor:
    """The reference answer: causal attention weights from raw scores.

    scores (..., T, T), query positions along dim -2 and key positions along dim -1. Returns
    softmax over keys of the scores with future keys (j > i) set to -inf, shape (..., T, T).
    """
    T = scores.shape[-1]
    mask = _masks.causal_mask(T, device=scores.device)
    return torch.softmax(scores.masked_fill(~mask, NINF), dim=-1)


def _weights_mistakes(scores: Tensor) -> list:
    """Known mistakes for causal attention weights, each as (diagnosis, thunk) on these scores."""
    T = scores.shape[-1]
    mask = _masks.causal_mask(T)
    soft = torch.softmax
    return [
        ("you did not mask anything: every token gives weight to its future. Mask the scores before the softmax.",
         lambda: soft(scores, dim=-1)),
        ("you masked the wrong entries: True in causal_mask means may attend, so fill where the mask is False (~mask).",
         lambda: soft(scores.masked_fill(mask, NINF), dim=-1)),
        ("you used the upper triangle: tokens attend to the future. Query i may only see keys j <= i.",
         lambda: soft(scores.masked_fill(~mask.T, NINF), dim=-1)),
        ("you set the masked scores to 0, but exp(0) = 1, so future tokens still get weight. "
         "Set them to -inf (exp(-inf) = 0).",
         lambda: soft(scores.masked_fill(~mask, 0.0), dim=-1)),
        ("you took the softmax over the wrong dimension (the queries, dim=-2). Each query's "
         "weights over the keys must sum to 1: use dim=-1.",
         lambda: soft(scores.masked_fill(~mask, NINF), dim=-2)),
        ("you masked after the softmax: the weights are zero in the future but the rows no longer "
         "sum to 1. Mask the scores with -inf before the softmax.",
         lambda: soft(scores, dim=-1) * mask),
        ("you returned the masked scores: apply the softmax over the keys (dim=-1) to get weights.",
         lambda: scores.masked_fill(~mask, NINF)),
        ("you returned the masked scores: apply the softmax over the keys (dim=-1) to get weights.",
         lambda: scores.masked_fill(~mask, 0.0)),
        ("you rescaled the scores: they are already scaled, apply the mask and the softmax only.",
         lambda: reference_causal_attention_weights(scores / T**0.5)),
        ("you rescaled the scores: they are already scaled, apply the mask and the softmax only.",
         lambda: reference_causal_attention_weights(scores * T**0.5)),
    ]


# (dtype, its name, how far weights computed in it may be from float32's: a few of its ulps at 1)
_LOW_PRECISION = ((torch.bfloat16, "bfloat16", 3e-2), (torch.float16, "float16", 5e-3))


def low_precision_diagnosis(got: Tensor, want: Tensor) -> str | None:
    """What to say about weights ``got`` that are right, but computed in float16 or bfloat16: each
    value is one of that dtype's and within a few of its rounding steps of ``want`` (their rows
    then miss 1 by about that much, which is no mistake in the softmax). None otherwise."""
    for dtype, name, tol in _LOW_PRECISION:
        if _VF.equal(got, got.to(dtype).float()) and _VF.allclose(got, want.float(), 0.0, tol):
            return (f"your weights are right, but computed in {name}, whose precision is too low for this check "
                    f"(about {tol:g} per weight, the rows miss 1 by as much): compute them in the dtype of the "
                    "scores (float32), without .half(), .bfloat16() or an autocast.")
    return None


def _weights_diagnosis(got: Tensor, scores: Tensor, want: Tensor) -> str:
    """Name a mistake recognised by a property of the weights rather than by a known output."""
    mask = _masks.causal_mask(scores.shape[-1])
    if torch.isnan(got).any():
        return "your weights contain NaN: a row in which every key is masked gives softmax(-inf, ..., -inf) = NaN."
    if ((got.abs() > 1e-6) & ~mask).any():
        return "some weight falls on future keys (j > i): the mask is not applied correctly."
    low = low_precision_diagnosis(got, want)
    if low is not None:
        return low
    rows = got.sum(-1)
    if not torch.allclose(rows, torch.ones_like(rows), atol=1e-4):
        return "the weights of a query do not sum to 1: take the softmax over the keys (dim=-1), after masking."
    return "the weights differ from softmax(scores masked with -inf where j > i, dim=-1)."


def _weights_cases(seed: int, sizes: Sequence[int] = (5, 8, 1)) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in sizes:
        scores = torch.randn(2, 3, T, T, generator=g)
        out.append(Case((scores,), f"scores of shape {tuple(scores.shape)} (seeded)", f"causal_attention_weights for T={T}"))
    return out


def _expect_weights(got, case: Case) -> Tensor:
    scores = case.args[0]
    if isinstance(got, Tensor) and tuple(got.shape) != tuple(scores.shape):
        raise ExerciseError(
            f"for scores of shape {tuple(scores.shape)} the weights should have the same shape, "
            f"got {tuple(got.shape)}."
        )
    return expect_tensor(got, "causal_attention_weights", dtype="float", device="cpu").float()


CAUSAL_ATTENTION_WEIGHTS = Task(
    "causal_attention_weights", reference_causal_attention_weights,
    _GPTLAB_MASKS + (Forbidden(torch.nn.functional.scaled_dot_product_attention, "F.scaled_dot_product_attention"),),
    _weights_cases, atol=1e-5, rtol=1e-4, mistakes=_weights_mistakes, expect=_expect_weights,
    diagnose=lambda got, want, case: _weights_diagnosis(got, case.args[0], want))


def check_causal_attention_weights(
    fn: Callable[[Tensor], Tensor], sizes: Sequence[int] = (5, 8, 1), seed: int = 0
) -> None:
    """Check a learner's ``causal_attention_weights(scores) -> weights``.

    ``scores`` (B, H, T, T) are raw (already scaled) attention scores, queries along dim -2 and
    keys along dim -1. The expected weights (B, H, T, T) are the softmax over keys of the scores
    with future keys (j > i) masked out, as :func:`reference_causal_attention_weights` computes
    (tolerance atol 1e-5, rtol 1e-4: one softmax). The learner's function must not change
    ``scores`` in place. Raises :class:`ExerciseError` with a diagnosis otherwise.
    """
    CAUSAL_ATTENTION_WEIGHTS.check(fn, seed, sizes=sizes)


# --------------------------------------------------------------------------- combine_masks


def _combine_cases(seed: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    cases = []
    for B, T in ((3, 5), (2, 1), (4, 6)):
        pad = torch.ones(B, T, dtype=torch.bool)
        if T > 1:
            pad[0, : T // 2] = False  # left padding
            pad[-1, T - 1 :] = False  # right padding
            if B > 2:
                pad[1] = torch.rand(T, generator=g) > 0.3
                pad[1, -1] = True
        cases.append(Case((_masks.causal_mask(T), pad), f"causal_mask({T}) and key_padding = {pad.int().tolist()}"))
    return cases


def _expect_combined(got: Any, case: Case) -> Tensor:
    B, T = case.args[1].shape
    if isinstance(got, Tensor) and tuple(got.shape) == (B, T, T):
        raise ExerciseError(
            f"combine_masks returned shape {(B, T, T)}, expected (B, 1, T, T) = {(B, 1, T, T)}: keep an axis of "
            "size 1 for the heads, so that the mask broadcasts over (B, H, T, T) scores."
        )
    return expect_tensor(got, "combine_masks", shape=(B, 1, T, T), dtype=torch.bool, device="cpu").cpu()


def _combine_mistakes(causal: Tensor, pad: Tensor) -> list[Candidate]:
    """Known mistakes of combine_masks, each as (diagnosis, thunk) on this input."""
    B, T = pad.shape
    c, p = causal[None, None], pad[:, None, None, :]
    return [(text, lambda m=m: m.expand(B, 1, T, T)) for text, m in (
        ("you combined the masks with OR (|): a position must be allowed by BOTH masks, so use AND (&).", c | p),
        ("you applied the padding to the queries (rows) instead of the keys (columns): padding hides a "
         "key from every query, so key_padding must index the last axis, key_padding[:, None, None, :].",
         c & pad[:, None, :, None]),
        ("your padding convention is inverted: key_padding is True for real tokens and False for padding, "
         "so keep keys where it is True.", c & ~p),
        ("you ignored the causal mask: every query can see the future.", p),
        ("you ignored the padding mask: queries can attend to padding tokens.", c),
    )]


COMBINE_MASKS = Task(
    "combine_masks", _masks.combine_masks, _GPTLAB_MASKS, _combine_cases, mistakes=_combine_mistakes,
    expect=_expect_combined, legend="1 = may attend",
    diagnose=lambda got, want, case: "query i of sequence b may attend key j iff causal[i, j] and key_padding[b, j].",
    show=lambda t: "\n".join(f"sequence {b}:\n{_show(m[0])}" for b, m in enumerate(t)))


def check_combine_masks(fn: Callable[[Tensor, Tensor], Tensor], seed: int = 0) -> None:
    """Check a learner's ``combine_masks(causal, key_padding) -> (B, 1, T, T)`` bool mask.

    ``causal`` is bool (T, T) (True = may attend), ``key_padding`` bool (B, T) (True = a real token,
    False = padding). Query i of sequence b may attend key j iff ``causal[i, j]`` and
    ``key_padding[b, j]``; the head axis has size 1 so the mask broadcasts over heads. Compared
    exactly with :func:`gptlab.masks.combine_masks`.
    """
    COMBINE_MASKS.check(fn, seed)
