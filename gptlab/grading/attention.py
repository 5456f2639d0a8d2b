"""Checks of the ``attention`` assignment (chapter 3, attention).

Tasks, each compared with :mod:`gptlab.attention` on seeded inputs and edge cases (T = 1, a batch
of 1, one head, keys longer than queries, large values):

* ``attention_weights(q, k, mask=None)``: q (B, H, T, d), k (B, H, S, d), bool mask broadcastable
  to (B, H, T, S) (True = may attend) -> ``softmax(q k^T / sqrt(d))`` over the keys, (B, H, T, S);
* ``attend(q, k, v, mask=None)``: the weights times v, (B, H, T, d);
* ``split_heads(x, n_head)``: (B, T, C) -> (B, n_head, T, C // n_head), and ``merge_heads(x)``, its
  inverse (compared exactly: they only move numbers);
* ``CausalSelfAttention(n_embd, n_head)``: an ``nn.Module`` with ``c_attn`` (Linear C -> 3C: q, k, v
  in that order) and ``c_proj`` (Linear C -> C). The check builds gptlab's layer from a
  :class:`~gptlab.model.GPTConfig` (dropout 0, bias True), copies its ``c_attn`` / ``c_proj``
  weights into the learner's module by name and compares the outputs.

Tolerances: one attention (weights, or weights times v) atol 1e-5, rtol 1e-4 in float32; the whole
layer (two linear layers around an attention) atol 1e-4, rtol 1e-3.

The masks of the checks leave every query at least one key it may attend to: with a fully masked
row the softmax is 0/0, which gptlab's reference turns into zeros and a plain softmax into NaN;
the task text says the learner does not have to handle it.

Every task forbids gptlab's own piece, and the attention tasks also PyTorch's fused
``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch._C import _VariableFunctions as _VF

from .. import attention as _att
from .. import GPTConfig
from .causal_mask import low_precision_diagnosis
from .core import ExerciseError, Forbidden, call, entries_of, torch_family, describe, expect_close, expect_tensor
from .remote import is_module, is_module_class, load_params
from .task import Case, Task, call_with_hint

__all__ = [
    "check_attention_weights",
    "check_attend",
    "check_split_heads",
    "check_merge_heads",
    "check_causal_self_attention",
]

NINF = float("-inf")
WEIGHTS_TOL = dict(atol=1e-5, rtol=1e-4)
LAYER_TOL = dict(atol=1e-4, rtol=1e-3)

_FUSED = (
    Forbidden(F.scaled_dot_product_attention, "F.scaled_dot_product_attention"),
    Forbidden(nn.MultiheadAttention, "nn.MultiheadAttention"),
    Forbidden(F.multi_head_attention_forward, "F.multi_head_attention_forward"),
)
_FUSED += torch_family("scaled_dot_product", "multi_head_attention", "scaled_dot_attention",
                       but=[f.target for f in _FUSED])  # torch._scaled_dot_product_flash_attention_for_cpu, ...
_GPTLAB_ATTENTION = entries_of(_att, "attention_weights", "attention", "CausalSelfAttention")
_GPTLAB_HEADS = entries_of(_att, "split_heads", "merge_heads")
_FORBIDDEN_ATTENTION = _GPTLAB_ATTENTION + _FUSED
_FORBIDDEN_LAYER = _GPTLAB_ATTENTION + _GPTLAB_HEADS + _FUSED


# --------------------------------------------------------------------------- inputs


def _causal(T: int, S: int) -> Tensor:
    """(T, S) causal mask for T queries that are the last T of S positions (True = may attend)."""
    return torch.ones(T, S, dtype=torch.bool).tril(S - T)


def _random_mask(shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    """A random bool mask in which every query row allows at least one key (its last one)."""
    m = torch.rand(shape, generator=g) > 0.4
    m[..., -1] = True
    return m


def _attention_cases(seed: int) -> list[tuple[str, Tensor, Tensor, Tensor, Tensor | None]]:
    """(description, q, k, v, mask) cases. The first has T == S == d: a k used without transposing
    it still gives a (T, S) matrix there, so that mistake is named instead of crashing."""
    g = torch.Generator().manual_seed(seed)

    def qkv(B, H, T, S, d, scale=1.0):
        q = torch.randn(B, H, T, d, generator=g) * scale
        k = torch.randn(B, H, S, d, generator=g) * scale
        v = torch.randn(B, H, S, d, generator=g)
        return q, k, v

    cases = []
    q, k, v = qkv(2, 3, 6, 6, 6)
    cases.append(("q, k, v of shape (2, 3, 6, 6), no mask", q, k, v, None))
    q, k, v = qkv(2, 2, 5, 7, 16)
    cases.append(("q (2, 2, 5, 16), k and v (2, 2, 7, 16) (more keys than queries), no mask", q, k, v, None))
    q, k, v = qkv(2, 3, 6, 6, 8)
    cases.append(("q, k, v of shape (2, 3, 6, 8), causal mask of shape (6, 6)", q, k, v, _causal(6, 6)))
    q, k, v = qkv(3, 2, 4, 5, 8)
    cases.append(("q (3, 2, 4, 8), k and v (3, 2, 5, 8), random mask of shape (3, 1, 4, 5)", q, k, v,
                  _random_mask((3, 1, 4, 5), g)))
    q, k, v = qkv(1, 1, 1, 1, 4)
    cases.append(("one query and one key: q, k, v of shape (1, 1, 1, 4), causal mask (1, 1)", q, k, v, _causal(1, 1)))
    q, k, v = qkv(1, 4, 5, 5, 32, scale=4.0)
    cases.append(("large values: q, k of shape (1, 4, 5, 32) with entries of size ~4, causal mask (5, 5)", q, k, v,
                  _causal(5, 5)))
    return cases


# --------------------------------------------------------------------------- attention_weights


def _softmax_masked(scores: Tensor, mask: Tensor | None, fill: float = NINF, dim: int = -1) -> Tensor:
    if mask is not None:
        scores = scores.masked_fill(~mask, fill)
    return torch.softmax(scores, dim=dim)


def _weights_mistakes(q: Tensor, k: Tensor, mask: Tensor | None = None) -> list[tuple[str, Callable[[], Tensor]]]:
    """Known mistakes of attention weights, each as (diagnosis, thunk) on this input."""
    T, d, S = q.shape[-2], q.shape[-1], k.shape[-2]
    kt = k.transpose(-2, -1)
    raw = q @ kt
    scaled = raw / math.sqrt(d)
    out = [
        ("you did not divide the scores by sqrt(d): scores = q @ k^T / sqrt(d), with d = q.shape[-1] the size "
         "of one query vector. Without it the softmax saturates when d is large.",
         lambda: _softmax_masked(raw, mask)),
        ("you divided the scores by d instead of sqrt(d) (d ** 0.5, or math.sqrt(d)), or by sqrt(d) twice.",
         lambda: _softmax_masked(raw / d, mask)),
        ("you multiplied the scores by sqrt(d) instead of dividing by it.",
         lambda: _softmax_masked(raw * math.sqrt(d), mask)),
        (f"you divided by the square root of the wrong size: sqrt(d) uses d = q.shape[-1] (the size of one "
         f"query vector, {d} here), not the number of keys ({S}) or queries ({T}).",
         lambda: _softmax_masked(raw / math.sqrt(S), mask)),
        (f"you divided by the square root of the wrong size: sqrt(d) uses d = q.shape[-1] (the size of one "
         f"query vector, {d} here), not the number of queries ({T}) or keys ({S}).",
         lambda: _softmax_masked(raw / math.sqrt(T), mask)),
        ("rows are queries and columns are keys: compute q @ k.transpose(-2, -1), not k @ q.transpose(-2, -1).",
         lambda: _softmax_masked((k @ q.transpose(-2, -1)) / math.sqrt(d), None if mask is None else mask.transpose(-2, -1))),
        ("you did not transpose k: the scores are q @ k.transpose(-2, -1), a dot product of every query "
         "with every key (q @ k only has the right shape by accident when S == d).",
         lambda: _softmax_masked((q @ k) / math.sqrt(d), mask)),
        ("you took the softmax over the queries (dim=-2): each query's weights over the keys must sum to 1, "
         "so use dim=-1.",
         lambda: _softmax_masked(scaled, mask, dim=-2)),
        ("you returned the scores: apply the softmax over the keys (dim=-1) to turn them into weights.",
         lambda: scaled if mask is None else scaled.masked_fill(~mask, NINF)),
    ]
    if mask is not None:
        m = mask
        out += [
            ("you ignored the mask: the keys where mask is False must get weight 0.",
             lambda: torch.softmax(scaled, dim=-1)),
            ("you applied the mask after the softmax: the blocked keys get weight 0, but then a query's weights "
             "no longer sum to 1. Set the blocked scores to -inf BEFORE the softmax.",
             lambda: torch.softmax(scaled, dim=-1) * m),
            ("you set the blocked scores to 0 instead of -inf: exp(0) = 1, so blocked keys still get weight. "
             "Use masked_fill(~mask, float('-inf')).",
             lambda: _softmax_masked(scaled, m, fill=0.0)),
            ("your mask is inverted: True means 'may attend', so fill the scores where the mask is False "
             "(masked_fill(~mask, ...)), not where it is True.",
             lambda: torch.softmax(scaled.masked_fill(m, NINF), dim=-1)),
            ("you masked the scores before dividing by sqrt(d) and used 0 as the fill value; use -inf.",
             lambda: torch.softmax(raw.masked_fill(~m, 0.0) / math.sqrt(d), dim=-1)),
        ]
    return out


def _weights_diagnosis(w: Tensor, mask: Tensor | None, want: Tensor) -> str | None:
    if torch.isnan(w).any():
        return "your weights contain NaN."
    if mask is not None and ((w.abs() > 1e-6) & ~mask).any():
        return "some weight falls on a key the mask blocks: set those scores to -inf before the softmax."
    low = low_precision_diagnosis(w, want)  # right, but in float16 / bfloat16: not "do not sum to 1"
    if low is not None:
        return low
    sums = w.sum(-1)
    if not _VF.allclose(sums, torch.ones_like(sums), 0.0, 1e-4):
        return "the weights of a query do not sum to 1: take the softmax over the keys (dim=-1)."
    return None


def _close_enough(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.is_floating_point() and bool(_VF.allclose(a.detach().float(), b, WEIGHTS_TOL["rtol"], WEIGHTS_TOL["atol"]))


def _show(t: Tensor) -> str:
    """A tensor in a failure message: its shape and its first 4 rows (last axis), 4 significant digits."""
    rows = t.detach().float().reshape(-1, t.shape[-1]).tolist()
    text = ["  [" + ", ".join(f"{v:.4g}" for v in r) + "]" for r in rows[:4]] + (["  ..."] if len(rows) > 4 else [])
    return f"shape {tuple(t.shape)}, first rows:\n" + "\n".join(text)


def _expect_shape(got: Any, what: str, want: tuple[int, ...], hints: dict[tuple[int, ...], str], **kw: Any) -> Tensor:
    """``got`` checked by :func:`expect_tensor` (shape ``want``, on the CPU, ``kw``); a wrong shape found in
    ``hints`` gets its hint."""
    if isinstance(got, Tensor) and tuple(got.shape) != want:
        hint = hints.get(tuple(got.shape), "")
        raise ExerciseError(f"{what} should have shape {want}, got {tuple(got.shape)}." + (f" {hint}" if hint else ""))
    return expect_tensor(got, what, shape=want, device="cpu", **kw)


def _cases_for(name: str, seed: int, with_v: bool) -> list[Case]:
    """The attention cases as :class:`Case` records (the mask left out when there is none)."""
    out = []
    for text, q, k, v, mask in _attention_cases(seed):
        args = (q, k, v) if with_v else (q, k)
        out.append(Case(args if mask is None else (*args, mask), text, f"{name} for {text}"))
    return out


def _expect_weights(got: Any, case: Case) -> Tensor:
    q, k = case.args[:2]
    B, H, T, d = q.shape
    S = k.shape[-2]
    return _expect_shape(got, case.what, (B, H, T, S), {
        (B, H, T, d): "That is the shape of the output of attention (weights @ v); this function returns the "
                      "weights, one per query and key.",
        (B, H, S, T): "Rows are queries and columns are keys: compute q @ k.transpose(-2, -1), not k @ q^T.",
    }, dtype="float").float()


ATTENTION_WEIGHTS = Task(
    "attention_weights", _att.attention_weights, _FORBIDDEN_ATTENTION, lambda seed: _cases_for("attention_weights", seed, False),
    mistakes=_weights_mistakes, expect=_expect_weights, show=_show,
    diagnose=lambda got, want, case: _weights_diagnosis(got, case.args[2] if len(case.args) > 2 else None, want),
    **WEIGHTS_TOL)


def check_attention_weights(fn: Callable[..., Tensor], seed: int = 0) -> None:
    """Check a learner's ``attention_weights(q, k, mask=None) -> (B, H, T, S)``.

    q (B, H, T, d), k (B, H, S, d); ``mask`` None or bool broadcastable to (B, H, T, S), True = may
    attend. Expected: :func:`gptlab.attention.attention_weights`, i.e. the softmax over the keys of
    ``q k^T / sqrt(d)`` with blocked scores at -inf (atol 1e-5, rtol 1e-4). No mask of the check
    blocks a whole row. Raises :class:`ExerciseError` naming the mistake.
    """
    ATTENTION_WEIGHTS.check(fn, seed)


# --------------------------------------------------------------------------- attend


def _expect_output(got: Any, case: Case) -> Tensor:
    q, k = case.args[:2]
    mask = case.args[3] if len(case.args) > 3 else None
    B, H, T, d = q.shape
    S = k.shape[-2]
    if isinstance(got, tuple):
        raise ExerciseError(f"attend should return one tensor, the output (B, H, T, d), got a tuple of {len(got)}.")
    got = _expect_shape(got, case.what, (B, H, T, d), {
        (B, H, T, S): "That is the shape of the weights: multiply them by v (weights @ v) to get the output.",
    }, dtype="float")
    if S == d and _close_enough(got, _att.attention_weights(q, k, mask)):
        raise ExerciseError(f"{case.what} returned the attention weights: multiply them by v "
                            "(weights @ v) to get the output.")
    return got.float()


def _attend_mistakes(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> list:
    """Known mistakes of attend: its own, then every mistake of the weights, multiplied by v."""
    d = q.shape[-1]
    w = _att.attention_weights(q, k, mask)
    mistakes = [("you forgot to pass the mask on to attention_weights (or ignored it): blocked keys get weight.",
                 lambda: _att.attention_weights(q, k) @ v)] if mask is not None else []
    mistakes.append(("you multiplied by the transposed weights: the output is weights @ v, with the weights "
                     "(B, H, T, S) (queries by keys) and v (B, H, S, d).",
                     lambda: w.transpose(-2, -1) @ v))
    mistakes.append(("you divided the scores by sqrt(d) twice (by d in all): attention_weights already divides "
                     "q @ k^T by sqrt(d), so attend must not scale q, k or the scores again; call "
                     "attention_weights(q, k, mask) as it is and multiply by v. (If your attention_weights "
                     "divides by d, fix it there: the scale is 1 / sqrt(d).)",
                     lambda: _softmax_masked((q @ k.transpose(-2, -1)) / d, mask) @ v))
    mistakes += [(f"your weights are wrong: {why}", (lambda t=thunk: t() @ v))
                 for why, thunk in _weights_mistakes(q, k, mask)]
    return mistakes


ATTEND = Task("attend", _att.attention, _FORBIDDEN_ATTENTION, lambda seed: _cases_for("attend", seed, True),
              mistakes=_attend_mistakes, expect=_expect_output, show=_show, **WEIGHTS_TOL)


def check_attend(fn: Callable[..., Tensor], seed: int = 0) -> None:
    """Check a learner's ``attend(q, k, v, mask=None) -> (B, H, T, d)``.

    The attention weights of :func:`check_attention_weights` times ``v`` (B, H, S, d), compared with
    :func:`gptlab.attention.attention` (atol 1e-5, rtol 1e-4). A mistake in the weights is named
    too (the same catalogue, multiplied by v).
    """
    ATTEND.check(fn, seed + 1)


# --------------------------------------------------------------------------- split_heads / merge_heads


def _heads_cases(seed: int, merge: bool) -> list[Case]:
    """x (B, T, C) and n_head, the first x holding 0, 1, 2, ... (every value says where it came from);
    for merge_heads, the heads of x, contiguous like the output of attention (a transposed view could
    be merged with .view)."""
    g = torch.Generator().manual_seed(seed)
    drawn = [(torch.randn(shape, generator=g), n) for shape, n in (((2, 5, 12), 3), ((1, 1, 8), 2), ((3, 4, 6), 1),
                                                                   ((2, 3, 16), 4))]
    out = []
    for x, n in [(torch.arange(48.0).reshape(2, 3, 8), 2)] + drawn:
        if merge:
            h = _att.split_heads(x, n).contiguous()
            out.append(Case((h,), f"x of shape {tuple(h.shape)}, the heads of a (B, T, C) = {tuple(x.shape)} "
                                  "tensor: merge_heads(split_heads(x, n_head)) must give x back",
                            f"merge_heads(x of shape {tuple(h.shape)})"))
        else:
            out.append(Case((x, n), f"x of shape {tuple(x.shape)}, n_head={n}",
                            f"split_heads(x of shape {tuple(x.shape)}, n_head={n})"))
    return out


def _expect_split(got: Any, case: Case) -> Tensor:
    x, n = case.args
    B, T, C = x.shape
    d = C // n
    return _expect_shape(got, case.what, (B, n, T, d), {
        (B, T, n, d): "You split C into (n_head, d) but did not move the head axis before the time axis: "
                      "add .transpose(1, 2).",
        (B, d, T, n): "Your axes are in the wrong order: view x as (B, T, n_head, d), then swap axes 1 and 2.",
    }, dtype=x.dtype)


def _split_mistakes(x: Tensor, n: int) -> list[tuple[str, Callable[[], Tensor]]]:
    B, T, C = x.shape
    d = C // n
    return [
        ("you reshaped (B, T, C) straight into (B, n_head, T, d) without a transpose: that cuts the sequence "
         "in pieces instead of cutting each position's features. View it as (B, T, n_head, d) first, then "
         "transpose(1, 2).", lambda: x.reshape(B, n, T, d)),
        ("your heads take every n_head-th feature (you viewed C as (d, n_head)): head h must hold the "
         "consecutive features h*d .. (h+1)*d - 1, so view C as (n_head, d).",
         lambda: x.reshape(B, T, d, n).permute(0, 3, 1, 2)),
    ]


SPLIT_HEADS = Task(
    "split_heads", _att.split_heads, _GPTLAB_HEADS + _FORBIDDEN_ATTENTION, lambda seed: _heads_cases(seed, False),
    mistakes=_split_mistakes, expect=_expect_split, show=_show,
    diagnose=lambda got, want, case: "head h of position t must hold features h*d .. (h+1)*d - 1 of x[:, t].")


def check_split_heads(fn: Callable[[Tensor, int], Tensor], seed: int = 0) -> None:
    """Check a learner's ``split_heads(x, n_head)``: (B, T, C) -> (B, n_head, T, C // n_head).

    Head h of position t holds features ``h*d .. (h+1)*d - 1`` of x[:, t] (d = C // n_head): compared
    exactly with :func:`gptlab.attention.split_heads`.
    """
    SPLIT_HEADS.check(fn, seed)


def _expect_merged(got: Any, case: Case) -> Tensor:
    (h,) = case.args
    B, H, T, d = h.shape
    return _expect_shape(got, case.what, (B, T, H * d), {
        (B, H, T * d): "You merged the wrong axes: move the head axis after the time axis first "
                       "(transpose(1, 2)), then merge the last two.",
        (B, T, H, d): "Merge the last two axes too: reshape to (B, T, H * d).",
    }, dtype=h.dtype)


def _merge_mistakes(h: Tensor) -> list[tuple[str, Callable[[], Tensor]]]:
    B, H, T, d = h.shape
    return [
        ("you reshaped (B, H, T, d) straight into (B, T, H * d) without a transpose: that mixes positions. "
         "Transpose to (B, T, H, d) first (transpose(1, 2)), then reshape.", lambda: h.reshape(B, T, H * d)),
        ("your features come out in the wrong order (d, H): position t must hold head 0's d features, then "
         "head 1's, and so on. Transpose with transpose(1, 2) (to (B, T, H, d)), not to (B, T, d, H).",
         lambda: h.permute(0, 2, 3, 1).reshape(B, T, H * d)),
    ]


MERGE_HEADS = Task(
    "merge_heads", _att.merge_heads, _GPTLAB_HEADS + _FORBIDDEN_ATTENTION, lambda seed: _heads_cases(seed + 1, True),
    mistakes=_merge_mistakes, expect=_expect_merged, show=_show,
    caller=call_with_hint(lambda e, args: "after transpose(1, 2) the tensor is not contiguous in memory, so .view "
                          "cannot merge its last two axes. Use .reshape(B, T, H * d) (or .contiguous().view(...))."
                          if "view size is not compatible" in str(e) else None),
    diagnose=lambda got, want, case: "position t must hold the features of head 0, then head 1, ... (H * d in all).")


def check_merge_heads(fn: Callable[[Tensor], Tensor], seed: int = 0) -> None:
    """Check a learner's ``merge_heads(x)``: (B, H, T, d) -> (B, T, H * d), the inverse of
    ``split_heads``. Compared exactly with :func:`gptlab.attention.merge_heads`."""
    MERGE_HEADS.check(fn, seed)


# --------------------------------------------------------------------------- CausalSelfAttention


def _reference_layer(n_embd: int, n_head: int, g: torch.Generator) -> _att.CausalSelfAttention:
    """gptlab's layer (dropout 0, bias True) with seeded weights of a size that makes mistakes visible."""
    cfg = GPTConfig(vocab_size=16, block_size=16, n_layer=1, n_head=n_head, n_embd=n_embd, dropout=0.0, bias=True)
    ref = _att.CausalSelfAttention(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.5 / math.sqrt(n_embd) if p.dim() > 1 else 0.1))
    return ref


def _variant(x: Tensor, ref: nn.Module, n_head: int, order=(0, 1, 2), mask: bool = True, proj: bool = True,
             scale: str = "d", split: str = "right", merge: str = "right") -> Tensor:
    """The layer with one known mistake: q, k, v taken in another ``order``, no causal ``mask``, no
    output projection, another ``scale`` ("d", "none", "C"), heads split/merged without a transpose."""
    B, T, C = x.shape
    hd = C // n_head
    parts = ref.c_attn(x).split(C, dim=-1)
    q, k, v = (parts[i] for i in order)

    def heads(t):
        return t.reshape(B, n_head, T, hd) if split == "view" else _att.split_heads(t, n_head)

    q, k, v = heads(q), heads(k), heads(v)
    s = q @ k.transpose(-2, -1)
    s = s / {"d": math.sqrt(hd), "none": 1.0, "C": math.sqrt(C)}[scale]
    if mask:
        s = s.masked_fill(~_causal(T, T), NINF)
    y = torch.softmax(s, dim=-1) @ v
    y = y.reshape(B, T, C) if merge == "view" else _att.merge_heads(y)
    return ref.c_proj(y) if proj else y


def _layer_mistakes(x: Tensor, ref: nn.Module, n_head: int) -> list[tuple[str, Callable[[], Tensor]]]:
    v = _variant
    order = ("you took q, k and v from c_attn's output in the wrong order: its first C features are the "
             "queries, the next C the keys, the last C the values (q, k, v = qkv.split(C, dim=-1)).")
    return [
        (order, lambda: v(x, ref, n_head, order=(1, 0, 2))),
        (order, lambda: v(x, ref, n_head, order=(0, 2, 1))),
        (order, lambda: v(x, ref, n_head, order=(2, 1, 0))),
        (order, lambda: v(x, ref, n_head, order=(1, 2, 0))),
        (order, lambda: v(x, ref, n_head, order=(2, 0, 1))),
        ("you did not apply the causal mask: every position attends to the future. Mask the scores with a "
         "(T, T) lower-triangular mask before the softmax.", lambda: v(x, ref, n_head, mask=False)),
        ("you forgot the output projection: pass the merged heads through self.c_proj.",
         lambda: v(x, ref, n_head, proj=False)),
        ("you did not divide the scores by sqrt(head_dim).", lambda: v(x, ref, n_head, scale="none")),
        ("you divided the scores by sqrt(n_embd); the scale is 1 / sqrt(head_dim), head_dim = n_embd // n_head, "
         "the size of the vectors one head compares.", lambda: v(x, ref, n_head, scale="C")),
        ("your heads are merged wrong: (B, n_head, T, d) must be transposed to (B, T, n_head, d) before it is "
         "reshaped to (B, T, C).", lambda: v(x, ref, n_head, merge="view")),
        ("your heads are split wrong: (B, T, C) must be viewed as (B, T, n_head, d) and then transposed, not "
         "reshaped straight into (B, n_head, T, d).", lambda: v(x, ref, n_head, split="view")),
        ("your heads are split and merged without transposes: each 'head' then holds pieces of the sequence, "
         "not features of each position. Split as (B, T, n_head, d).transpose(1, 2).",
         lambda: v(x, ref, n_head, split="view", merge="view")),
    ]


def _linear_parts(module: nn.Module, name: str, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """The weight and bias of ``module.<name>``, checked against gptlab's shapes."""
    layer = getattr(module, name, None)
    if layer is None:
        raise ExerciseError(
            f"your CausalSelfAttention has no attribute {name!r}. The check copies gptlab's weights into "
            f"self.c_attn (nn.Linear(n_embd, 3 * n_embd): q, k, v in that order) and self.c_proj "
            f"(nn.Linear(n_embd, n_embd)): create both in __init__ under these names."
        )
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    if not isinstance(weight, Tensor):
        raise ExerciseError(f"self.{name} should be an nn.Linear (with a .weight), got {type(layer).__name__}.")
    out_f, in_f = shape
    if tuple(weight.shape) != shape:
        raise ExerciseError(
            f"self.{name}.weight has shape {tuple(weight.shape)}, expected {shape}: self.{name} should be "
            f"nn.Linear({in_f}, {out_f}) for n_embd={in_f} (nn.Linear(in, out) stores its weight as (out, in))."
        )
    if not isinstance(bias, Tensor) or tuple(bias.shape) != (out_f,):
        raise ExerciseError(
            f"self.{name} has no bias of shape ({out_f},): use nn.Linear({in_f}, {out_f}) with its default bias=True."
        )
    return weight, bias


def check_causal_self_attention(cls: type, seed: int = 0) -> None:
    """Check a learner's ``CausalSelfAttention(n_embd, n_head)`` module: x (B, T, C) -> (B, T, C).

    For each case, gptlab's :class:`~gptlab.attention.CausalSelfAttention` (built from a GPTConfig
    with dropout 0 and bias True, seeded weights) lends its ``c_attn`` and ``c_proj`` weights and
    biases to the learner's module by name; both run on the same seeded input (atol 1e-4, rtol 1e-3:
    a composed block). Cases: (B, T, C, n_head) = (2, 6, 16, 4), (1, 5, 12, 1), (3, 1, 8, 2),
    (2, 9, 24, 3). A difference is explained by re-running known buggy variants with the same weights.
    """
    if not is_module_class(cls):
        raise ExerciseError(
            f"the check expects your class CausalSelfAttention (a subclass of nn.Module), got {describe(cls)}."
        )
    g = torch.Generator().manual_seed(seed)
    for B, T, C, H in ((2, 6, 16, 4), (1, 5, 12, 1), (3, 1, 8, 2), (2, 9, 24, 3)):
        ref = _reference_layer(C, H, g)
        x = torch.randn(B, T, C, generator=g)
        module = call(cls, "CausalSelfAttention", C, H, forbidden=_FORBIDDEN_LAYER)
        if not is_module(module):
            raise ExerciseError(f"CausalSelfAttention({C}, {H}) should be an nn.Module, got {describe(module)}.")
        w_attn, b_attn = _linear_parts(module, "c_attn", (3 * C, C))
        w_proj, b_proj = _linear_parts(module, "c_proj", (C, C))
        load_params(module, {"c_attn.weight": ref.c_attn.weight, "c_attn.bias": ref.c_attn.bias,
                             "c_proj.weight": ref.c_proj.weight, "c_proj.bias": ref.c_proj.bias})
        module.eval()
        text = f"x of shape {(B, T, C)}, n_head={H} (seeded), with gptlab's c_attn and c_proj weights"
        with torch.no_grad():
            got = call(module, "CausalSelfAttention.forward", x, forbidden=_FORBIDDEN_LAYER)
            got = _expect_shape(got, f"CausalSelfAttention({C}, {H})(x)", (B, T, C), {
                (B, H, T, C // H): "Merge the heads back into (B, T, C) and apply self.c_proj.",
            }, dtype="float", finite=True)
            want = ref(x)
            extra = [n for n, _ in module.named_parameters() if not n.startswith(("c_attn.", "c_proj."))]
            mistakes = _layer_mistakes(x, ref, H)
            try:
                expect_close(got.float(), want, f"CausalSelfAttention({C}, {H})(x)", text, **LAYER_TOL, show=_show,
                             mistakes=mistakes)
            except ExerciseError as e:
                if extra:
                    raise ExerciseError(
                        f"{e}\n  Note: your module also has the parameters {extra}, which the check cannot set from "
                        "gptlab's layer. The layer needs only c_attn and c_proj."
                    ) from None
                raise
