"""Checks for the graded exercises: compare a learner's function with gptlab's and say what the
mistake most likely is.

Where this sits: beside the pipeline (text -> tokens -> batches -> model -> logits -> loss or
samples -> text). Each exercise notebook (``solutions/`` for instructors, ``exercises/`` for
learners, see ``nbgrader_config.py``) asks the learner to write one piece of that pipeline by hand;
its autograded test cells call a ``check_*`` function from here, so the diagnosis logic lives in
one tested place instead of being copied into every notebook.

A check returns ``None`` when the learner's function agrees with the reference on several inputs,
and otherwise raises :class:`ExerciseError` (an ``AssertionError``, so nbgrader counts the test
cell as failed) whose message names the input, what was expected, what came, and the most likely
mistake in plain words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .model import causal_mask as _reference_causal_mask

__all__ = [
    "ExerciseError",
    "check_causal_mask",
    "diagnose_mask",
    "check_causal_attention_weights",
    "reference_causal_attention_weights",
]


class ExerciseError(AssertionError):
    """A learner's answer differs from the reference; the message says how and most likely why."""


def _fail(msg: str) -> None:
    raise ExerciseError(msg)


def _call(fn: Callable, name: str, *args) -> object:
    """Call the learner's function, turning its exceptions into a clear diagnosis."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise ExerciseError(
            f"{name} is not written yet: it raised NotImplementedError. Replace the line "
            "`raise NotImplementedError()` with your code."
        ) from None
    except Exception as e:  # the learner's code crashed: show what and where
        arg_txt = ", ".join(_short(a) for a in args)
        raise ExerciseError(f"{name}({arg_txt}) raised {type(e).__name__}: {e}") from e


def _short(a: object) -> str:
    if isinstance(a, Tensor):
        return f"<tensor of shape {tuple(a.shape)}, dtype {a.dtype}>"
    return repr(a)


def _show(t: Tensor) -> str:
    """A small 0/1 picture of a 2-D mask (rows = queries, columns = keys)."""
    rows = ["".join("1" if v else "." for v in row) for row in t.tolist()]
    return "\n".join("    " + r for r in rows)


# --------------------------------------------------------------------------- causal mask


def diagnose_mask(got: Tensor, T: int) -> str | None:
    """Name the most likely mistake in a boolean (T, T) mask meant to equal ``causal_mask(T)``.

    ``got`` must already be a bool tensor of shape (T, T). Returns ``None`` if it is correct, else
    a sentence describing the mistake.
    """
    want = _reference_causal_mask(T)
    if torch.equal(got, want):
        return None
    ones = torch.ones(T, T, dtype=torch.bool)
    if torch.equal(got, ~want):
        return (
            "your mask is inverted: it is True where attention must be blocked. gptlab (like "
            "PyTorch's scaled_dot_product_attention) uses the convention True = may attend, so "
            "query i may attend to keys j <= i (the lower triangle, diagonal included)."
        )
    if torch.equal(got, ones.triu()):
        return (
            "you let tokens attend to the future: your mask is the upper triangle (torch.triu), "
            "so row i allows keys j >= i. A row is a query; query i may only see keys j <= i, "
            "the lower triangle (torch.tril)."
        )
    if torch.equal(got, ones.tril(-1)):
        return (
            "the diagonal is excluded: a token must be able to attend to itself (j == i). "
            "With it excluded, the first token may attend to nothing at all and its softmax is "
            "0/0 = NaN. Use torch.tril(..., diagonal=0)."
        )
    if torch.equal(got, ones):
        return "your mask allows everything: every token can attend to the future. Keep only j <= i."
    if not got.any():
        return "your mask blocks everything: no token may attend to anything, not even itself."
    if torch.equal(got, want.T):
        return (
            "your mask is transposed (rows are keys, columns are queries): you let tokens attend "
            "to the future. Row i is query i and must allow keys j <= i."
        )
    for d in range(1, T):
        if torch.equal(got, ones.tril(d)):
            return (
                f"your mask lets each token see {d} token(s) ahead (torch.tril with diagonal={d}): "
                "that leaks the future. Use diagonal=0."
            )
    for w in range(1, T):
        if torch.equal(got, ones.tril() & ~ones.tril(-w)):
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


def check_causal_mask(fn: Callable[[int], Tensor], sizes: Sequence[int] = (5, 1, 2, 3, 8)) -> None:
    """Check a learner's ``causal_mask(T) -> Tensor`` against :func:`gptlab.causal_mask`.

    The expected answer for each ``T`` in ``sizes`` is a bool tensor of shape (T, T), True where
    query i may attend to key j (j <= i). Raises :class:`ExerciseError` with a diagnosis otherwise.
    """
    if not callable(fn):
        raise TypeError(f"check_causal_mask expects a function causal_mask(T), got {type(fn).__name__}")
    for T in sizes:
        got = _call(fn, "causal_mask", T)
        want = _reference_causal_mask(T)
        if not isinstance(got, Tensor):
            _fail(f"causal_mask({T}) should return a torch.Tensor, got {type(got).__name__}.")
        if tuple(got.shape) != (T, T):
            _fail(
                f"causal_mask({T}) should have shape (T, T) = ({T}, {T}), got {tuple(got.shape)}."
                + (" Did you hard-code the size instead of using T?" if got.dim() == 2 else "")
            )
        got = got.detach().cpu()
        if got.dtype != torch.bool:
            values = set(torch.unique(got.float()).tolist())
            as_bool = got != 0
            additive = values <= {0.0, float("-inf")} and float("-inf") in values
            if additive:
                hint = (
                    "it looks like an additive mask (0 where allowed, -inf where blocked). That is a "
                    "fine way to mask scores, but this exercise asks for the boolean mask"
                )
            elif values <= {0.0, 1.0} and diagnose_mask(as_bool, T) is None:
                hint = (
                    "its 0/1 pattern is right, but PyTorch treats a float mask as numbers to ADD to the "
                    "scores, so a 0./1. mask would block nothing; convert it with .bool() or build it "
                    "with dtype=torch.bool"
                )
            else:
                hint = "build it with dtype=torch.bool"
            _fail(
                f"causal_mask({T}) should be a bool tensor (True = may attend), got dtype {got.dtype}: "
                f"{hint}."
            )
        problem = diagnose_mask(got, T)
        if problem is not None:
            _fail(
                f"causal_mask({T}) is wrong: {problem}\n  expected (1 = may attend):\n{_show(want)}\n"
                f"  got:\n{_show(got)}"
            )


# --------------------------------------------------------------------------- masked attention weights


def reference_causal_attention_weights(scores: Tensor) -> Tensor:
    """The reference answer: causal attention weights from raw scores.

    scores (..., T, T), query positions along dim -2 and key positions along dim -1. Returns
    softmax over keys of the scores with future keys (j > i) set to -inf, shape (..., T, T).
    """
    T = scores.shape[-1]
    mask = _reference_causal_mask(T, device=scores.device)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def _weights_diagnosis(got: Tensor, scores: Tensor) -> str:
    """Name the most likely mistake for wrong attention weights ``got`` computed from ``scores``."""
    T = scores.shape[-1]
    mask = _reference_causal_mask(T)
    tol = dict(atol=1e-5, rtol=1e-4)

    def same(x: Tensor) -> bool:
        return torch.allclose(got, x, equal_nan=True, **tol)

    if same(torch.softmax(scores, dim=-1)):
        return "you did not mask anything: every token gives weight to its future. Mask the scores before the softmax."
    if same(torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)):
        return "you masked the wrong entries: True in causal_mask means may attend, so fill where the mask is False (~mask)."
    if same(torch.softmax(scores.masked_fill(~mask.T, float("-inf")), dim=-1)):
        return "you used the upper triangle: tokens attend to the future. Query i may only see keys j <= i."
    if same(torch.softmax(scores.masked_fill(~mask, 0.0), dim=-1)):
        return (
            "you set the masked scores to 0, but exp(0) = 1, so future tokens still get weight. "
            "Set them to -inf (exp(-inf) = 0)."
        )
    if same(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-2)):
        return (
            "you took the softmax over the wrong dimension (the queries, dim=-2). Each query's "
            "weights over the keys must sum to 1: use dim=-1."
        )
    if same(torch.softmax(scores, dim=-1) * mask):
        return (
            "you masked after the softmax: the weights are zero in the future but the rows no longer "
            "sum to 1. Mask the scores with -inf before the softmax."
        )
    if same(scores.masked_fill(~mask, float("-inf"))) or same(scores.masked_fill(~mask, 0.0)):
        return "you returned the masked scores: apply the softmax over the keys (dim=-1) to get weights."
    if same(reference_causal_attention_weights(scores / scores.shape[-1] ** 0.5)) or same(
        reference_causal_attention_weights(scores * scores.shape[-1] ** 0.5)
    ):
        return "you rescaled the scores: they are already scaled, apply the mask and the softmax only."
    if torch.isnan(got).any():
        return "your weights contain NaN: a row in which every key is masked gives softmax(-inf, ..., -inf) = NaN."
    leak = (got.abs() > 1e-6) & ~mask
    if leak.any():
        return "some weight falls on future keys (j > i): the mask is not applied correctly."
    rows = got.sum(-1)
    if not torch.allclose(rows, torch.ones_like(rows), atol=1e-4):
        return "the weights of a query do not sum to 1: take the softmax over the keys (dim=-1), after masking."
    return "the weights differ from softmax(scores masked with -inf where j > i, dim=-1)."


def check_causal_attention_weights(
    fn: Callable[[Tensor], Tensor], sizes: Sequence[int] = (5, 8, 1), seed: int = 0
) -> None:
    """Check a learner's ``causal_attention_weights(scores) -> weights``.

    ``scores`` (B, H, T, T) are raw (already scaled) attention scores, queries along dim -2 and
    keys along dim -1. The expected weights (B, H, T, T) are the softmax over keys of the scores
    with future keys (j > i) masked out, as :func:`reference_causal_attention_weights` computes.
    The learner's function must not change ``scores`` in place. Raises :class:`ExerciseError` with
    a diagnosis otherwise.
    """
    if not callable(fn):
        raise TypeError(f"check_causal_attention_weights expects a function, got {type(fn).__name__}")
    g = torch.Generator().manual_seed(seed)
    for T in sizes:
        scores = torch.randn(2, 3, T, T, generator=g)
        before = scores.clone()
        got = _call(fn, "causal_attention_weights", scores)
        if not torch.equal(scores, before):
            _fail(
                "causal_attention_weights changed its input scores in place (e.g. masked_fill_ with an "
                "underscore). Use the out-of-place masked_fill so the caller's tensor is untouched."
            )
        if not isinstance(got, Tensor):
            _fail(f"causal_attention_weights should return a torch.Tensor, got {type(got).__name__}.")
        if tuple(got.shape) != tuple(scores.shape):
            _fail(
                f"for scores of shape {tuple(scores.shape)} the weights should have the same shape, "
                f"got {tuple(got.shape)}."
            )
        if not got.is_floating_point():
            _fail(f"the weights should be floating point, got dtype {got.dtype}.")
        got = got.detach().float().cpu()
        want = reference_causal_attention_weights(scores)
        if torch.allclose(got, want, atol=1e-5, rtol=1e-4):
            continue
        _fail(f"causal_attention_weights is wrong for T={T}: {_weights_diagnosis(got, scores)}")
