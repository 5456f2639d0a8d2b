"""Checks of the ``lm_basics`` assignment (chapter 1, language modelling and tokens).

Tasks, each compared with its reference on seeded inputs and edge cases:

* ``encode(text, stoi) -> list[int]`` and ``decode(ids, itos) -> str``: gptlab's
  :class:`~gptlab.tokenizers.CharTokenizer`; an unknown character (or id) must raise ``KeyError``.
* ``next_token_batch(ids, block_size, starts) -> (x, y)``: :func:`gptlab.data.batch_at`, compared
  exactly (they are token ids).
* ``cross_entropy(logits, targets) -> 0-d tensor``: PyTorch's ``F.cross_entropy``, atol 1e-5 and
  rtol 1e-4 (one log-softmax and a mean in float32), on logits up to 1e4 in size (numerical
  stability), and its gradient against ``(softmax - onehot) / N`` with the same tolerance.
* ``perplexity(mean_nll) -> float``: ``math.exp``, relative tolerance 1e-6.

Each task forbids gptlab's own function for it; ``cross_entropy`` also forbids PyTorch's fused
losses (``F.cross_entropy``, ``F.nll_loss``, ``nn.CrossEntropyLoss``, ``nn.NLLLoss``) and the two
functions that do the log-sum-exp shift for you (``torch.logsumexp`` and ``log_softmax``, in any
spelling: ``torch.``, ``F.``, or the tensor method).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import bigram as _bigram
from .. import data as _data
from ..tokenizers import CharTokenizer
from .core import (
    DelegationError,
    ExerciseError,
    Forbidden,
    torch_family,
    call,
    describe,
    expect_close,
    expect_tensor,
    require_function,
    same,
    show_tensor,
)
from .task import Case, Task, call_with_hint

__all__ = [
    "check_encode",
    "check_decode",
    "check_next_token_batch",
    "check_cross_entropy",
    "check_perplexity",
    "reference_cross_entropy",
]

# --------------------------------------------------------------------------- forbidding tensor methods


# PyTorch builtins that do the log-sum-exp shift for the learner, recognised by name whichever way
# they are reached (torch.logsumexp, x.logsumexp(), torch.log_softmax, x.log_softmax(),
# F.log_softmax, which calls the method). gptlab.grading.core's Forbidden recognises a builtin by
# identity, and a tensor method is a new bound object at every call, hence this local hook.
# What does the log-sum-exp shift for the learner: forbidden in cross_entropy, in every spelling.
_SHIFT_FORBIDDEN = (
    Forbidden(torch.logsumexp, "torch.logsumexp"),
    Forbidden(torch.Tensor.logsumexp, "torch.logsumexp (the tensor method)"),
    Forbidden(torch.special.logsumexp, "torch.special.logsumexp"),
    Forbidden(torch.log_softmax, "log_softmax"),
    Forbidden(torch.Tensor.log_softmax, "log_softmax (the tensor method)"),
    Forbidden(torch.special.log_softmax, "torch.special.log_softmax"),
    Forbidden(F.log_softmax, "F.log_softmax"),
)
_SHIFT_FORBIDDEN += torch_family("logsumexp", "log_softmax", "logcumsumexp",  # x.logcumsumexp(-1)[..., -1]
                                 but=[f.target for f in _SHIFT_FORBIDDEN])


# --------------------------------------------------------------------------- encode / decode

_TEXTS = ("hello world", "", "To be, or not to be:\nthat is the question.", "a")
_VOCAB_TEXT = "To be, or not to be:\nthat is the question. hello world! Zany"
_TOKENIZER_FORBIDDEN = (
    Forbidden(CharTokenizer.encode, "gptlab's CharTokenizer.encode"),
    Forbidden(CharTokenizer.decode, "gptlab's CharTokenizer.decode"),
)


def _vocabularies() -> list[CharTokenizer]:
    """The sorted vocabulary of a text, and the same characters in another (shuffled) order."""
    sorted_tok = CharTokenizer.from_text(_VOCAB_TEXT)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(sorted_tok.vocab_size, generator=g).tolist()
    return [sorted_tok, CharTokenizer([sorted_tok.chars[i] for i in order])]


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def _expect_key_error(fn: Callable, name: str, args: tuple, forbidden: Sequence[Forbidden], what: str, hint: str) -> None:
    """``fn(*args)`` must raise KeyError (an unknown character or id)."""
    try:
        out = call(fn, name, *args, forbidden=forbidden)
    except DelegationError:
        raise
    except ExerciseError as e:
        cause = e.__cause__
        if isinstance(cause, KeyError):
            return
        if cause is None:
            raise
        raise ExerciseError(
            f"{name}({', '.join(describe(a) for a in args)}) should raise KeyError ({what}), but it raised "
            f"{type(cause).__name__}: {cause}. Look the value up with [ ] (a dict raises KeyError by itself)."
        ) from None
    raise ExerciseError(
        f"{name}({', '.join(describe(a) for a in args)}) returned {describe(out)}, but {what}: it must raise "
        f"KeyError. {hint}"
    )


def check_encode(fn: Callable[[str, dict], list]) -> None:
    """Check a learner's ``encode(text, stoi) -> list[int]`` against :class:`CharTokenizer`.

    ``stoi`` maps every character of the vocabulary to its id; ``encode`` returns one id per
    character of ``text`` (a list of ``int``), and raises ``KeyError`` for a character that is not
    in ``stoi``. Tried on a sorted vocabulary and on a shuffled one (the ids must come from
    ``stoi``, not from the characters' order).
    """
    require_function(fn, "encode")
    for tok in _vocabularies():
        stoi = dict(tok.stoi)
        for text in _TEXTS:
            got = call(fn, "encode", text, stoi, forbidden=_TOKENIZER_FORBIDDEN)
            want = tok.encode(text)
            if isinstance(got, Tensor):
                raise ExerciseError(f"encode({text!r}, stoi) returned a tensor; return a plain list of ints "
                                    "(e.g. a list comprehension), the type decode expects.")
            if got is None:
                raise ExerciseError(f"encode({text!r}, stoi) returned None (did you forget a return statement?).")
            if isinstance(got, str):
                raise ExerciseError(f"encode({text!r}, stoi) returned a string {got[:40]!r}; it must return the "
                                    "list of token ids, one per character.")
            if not _is_int_list(got):
                raise ExerciseError(f"encode({text!r}, stoi) should return a list of ints, got {describe(got)}.")
            if got == want:
                continue
            candidates = [
                ("your ids are off by one: the id of a character is exactly stoi[c]; do not add 1.",
                 [i + 1 for i in want]),
                ("your ids are off by one: the id of a character is exactly stoi[c]; do not subtract 1.",
                 [i - 1 for i in want]),
                ("your ids are positions in the sorted characters, not stoi's ids: use stoi[c].",
                 [sorted(stoi).index(c) for c in text]),
                ("you encoded each distinct character once (a set): encode every character of the text, in order, "
                 "repeats included.", got if len(set(text)) < len(text) and sorted(got) == sorted(stoi[c] for c in set(text))
                 else None),
                ("you skipped the spaces (text.split()?): a space is a character with its own id.",
                 [stoi[c] for c in text if c != " "]),
                ("your ids come out in reverse order.", want[::-1]),
            ]
            reason = next((r for r, c in candidates if c is not None and got == c),
                          "each character c must become stoi[c], in order.")
            raise ExerciseError(
                f"encode({text!r}, stoi) is wrong: {reason}\n  expected: {want}\n  got:      {got}"
            )
    _expect_key_error(
        fn, "encode", ("hi~", stoi), _TOKENIZER_FORBIDDEN, "'~' is not in the vocabulary",
        "Did you skip unknown characters (if c in stoi) or use stoi.get(c, 0)? Silently mapping an unknown "
        "character to some id hides the problem; look it up with stoi[c].",
    )


def check_decode(fn: Callable[[list, dict], str]) -> None:
    """Check a learner's ``decode(ids, itos) -> str`` against :class:`CharTokenizer`.

    ``itos`` maps every id to its character; ``decode`` returns the characters of ``ids`` joined
    with nothing in between, and raises ``KeyError`` for an id that is not in ``itos``.
    """
    require_function(fn, "decode")
    for tok in _vocabularies():
        itos = dict(tok.itos)
        V = tok.vocab_size
        for text in _TEXTS:
            ids = tok.encode(text)
            got = call(fn, "decode", list(ids), itos, forbidden=_TOKENIZER_FORBIDDEN)
            want = tok.decode(ids)
            if got is None:
                raise ExerciseError(f"decode({ids}, itos) returned None (did you forget a return statement?).")
            if isinstance(got, list):
                raise ExerciseError(f"decode({ids}, itos) returned a list {got[:12]}...; join the characters into "
                                    "one string with ''.join(...).")
            if not isinstance(got, str):
                raise ExerciseError(f"decode({ids}, itos) should return a str, got {describe(got)}.")
            if got == want:
                continue

            def shifted(d: int) -> str | None:
                return "".join(itos[i + d] for i in ids) if all(0 <= i + d < V for i in ids) else None

            candidates = [
                ("you joined the characters with spaces: use ''.join(...), since the spaces of the text are "
                 "characters of their own.", " ".join(itos[i] for i in ids)),
                ("you added a newline between characters: use ''.join(...).", "\n".join(itos[i] for i in ids)),
                ("your lookup is off by one: the character of id i is exactly itos[i].", shifted(1)),
                ("your lookup is off by one: the character of id i is exactly itos[i].", shifted(-1)),
                ("the characters come out in reverse order.", want[::-1]),
                ("you decoded each distinct id once (a set): decode every id, in order.",
                 "".join(itos[i] for i in dict.fromkeys(ids))),
            ]
            reason = next((r for r, c in candidates if c is not None and got == c),
                          "each id i must become itos[i], all joined with nothing between them.")
            raise ExerciseError(f"decode({ids}, itos) is wrong: {reason}\n  expected: {want!r}\n  got:      {got!r}")
        # a round trip of every character, then an unknown id
        every = list(range(V))
        got = call(fn, "decode", every, itos, forbidden=_TOKENIZER_FORBIDDEN)
        if got != tok.decode(every):
            raise ExerciseError(f"decode(every id 0..{V - 1}, itos) is wrong:\n  expected: {tok.decode(every)!r}\n"
                                f"  got:      {got!r}")
        _expect_key_error(
            fn, "decode", ([0, V], itos), _TOKENIZER_FORBIDDEN, f"id {V} is not in itos (ids run 0..{V - 1})",
            "Did you skip unknown ids or use itos.get(i, '')? Look the id up with itos[i].",
        )


# --------------------------------------------------------------------------- next_token_batch

_BATCH_FORBIDDEN = (
    Forbidden(_data.get_batch, "gptlab.data.get_batch"),
    Forbidden(_data.batch_at, "gptlab.data.batch_at"),
    Forbidden(_data.TokenDataset, "gptlab.data.TokenDataset"),
)


def _batch_cases(seed: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 65, (20,), generator=g)
    big = torch.randint(0, 65, (1000,), generator=g)
    big_starts = torch.cat([torch.randint(0, 1000 - 16, (7,), generator=g), torch.tensor([1000 - 16 - 1])])
    cases = [
        (ids, 4, torch.tensor([2, 5, 9])),
        (ids, 1, torch.tensor([3])),  # T = 1
        (ids, 4, torch.tensor([15, 7])),  # 15 = N - T - 1: the last window that fits
        (ids, 8, torch.tensor([11])),  # a batch of 1 ending at the last token
        (ids, 3, torch.tensor([0, 0, 16])),  # start 0, repeated starts
        (big, 16, big_starts),
    ]
    return [Case(c, f"ids = {describe(c[0])}, block_size = {c[1]}, starts = {c[2].tolist()}") for c in cases]


def _crash_hint(e: ExerciseError, args: tuple) -> str | None:
    """The usual cause of a crash on the last window that fits."""
    ids, T, starts = args
    last = len(ids) - T - 1
    if e.__cause__ is None or last not in starts.tolist():
        return None
    return (f"a slice reads past the end of ids. Start {last} = N - block_size - 1 is the last window that fits "
            f"(N = {len(ids)}): its y ends exactly at the last token, ids[N - 1]. Slices that go further come out "
            "shorter than block_size: x = ids[s : s + block_size], y = ids[s + 1 : s + block_size + 1].")


def _expect_batch(got: Any, case: Case) -> Tensor:
    """The pair (x, y), checked and stacked into one (2, B, T) int64 tensor."""
    ids, T, starts = case.args
    B = len(starts)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise ExerciseError(f"next_token_batch should return a pair (x, y) of tensors, got {describe(got)}.")
    for name, t in zip("xy", got):
        if isinstance(t, Tensor) and t.dim() == 2 and t.shape[0] == B and t.shape[1] != T:
            d = t.shape[1] - T
            hint = (f"{name} has {t.shape[1]} = block_size {'+' if d > 0 else '-'} {abs(d)} columns: "
                    "x and y are both block_size long, x = ids[s : s + block_size] and "
                    "y = ids[s + 1 : s + block_size + 1].")
            raise ExerciseError(f"for {case.text}: {hint}")
        if isinstance(t, Tensor) and t.dim() == 2 and tuple(t.shape) == (T, B) and T != B:
            raise ExerciseError(f"for {case.text}: {name} has shape {(T, B)}, the transpose of (B, T) = {(B, T)}: "
                                "stack the windows along a new first dimension (torch.stack(windows) or dim=0).")
        expect_tensor(t, f"{name} of next_token_batch", shape=(B, T), device="cpu",
                      hint_shape="Each row is one window of block_size tokens; there is one row per start.")
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ExerciseError(f"{name} of next_token_batch should hold integer token ids (dtype {ids.dtype}), "
                                f"got dtype {t.dtype}: slice ids instead of building new float tensors.")
    return torch.stack([t.detach().cpu().long() for t in got])


def _batch_mistakes(ids: Tensor, T: int, starts: Tensor) -> list[tuple[str, Callable[[], Tensor]]]:
    """Known mistakes of next_token_batch, each as (diagnosis, thunk of the stacked (x, y))."""
    x, y = _data.batch_at(ids, starts, T)

    def w(shift: int) -> Tensor:  # the windows that start `shift` tokens after each start
        return torch.stack([ids[int(s) + shift : int(s) + shift + T] for s in starts])

    stack = torch.stack
    late = "x starts one token late: x = ids[s : s + block_size] starts AT s, and y one token later."
    early = "x starts one token early: x = ids[s : s + block_size] starts AT s."
    return [
        ("your targets are not shifted: y equals x, so the model would be asked to copy its input. "
         "y[b, t] is the token AFTER x[b, t]: y = ids[s + 1 : s + block_size + 1].", lambda: stack([x, x])),
        ("your targets are shifted the wrong way (the token before, ids[s - 1 : ...]): y must be the NEXT "
         "tokens, ids[s + 1 : s + block_size + 1].", lambda: stack([x, w(-1)])),
        ("your targets are shifted by 2: y = ids[s + 1 : s + block_size + 1], one step after x.",
         lambda: stack([x, w(2)])),
        ("x and y are swapped: x = ids[s : s + block_size] is the input, y (one step later) the target.",
         lambda: stack([y, x])),
        (late, lambda: stack([y, w(2)])), (late, lambda: stack([y, y])),
        (early, lambda: stack([w(-1), x])), (early, lambda: stack([w(-1), y])),
    ]


def _batch_diagnosis(got: Tensor, want: Tensor, case: Case) -> str:
    return (f"{'y' if same(got[0], want[0]) else 'x'} differs: x[b] must be ids[s_b : s_b + block_size] and "
            "y[b] = ids[s_b + 1 : s_b + block_size + 1], with s_b = starts[b].")


def _rows(t: Tensor, max_rows: int = 4) -> str:
    lines = [str(row) for row in t[:max_rows].tolist()] + ([f"... ({t.shape[0]} rows)"] if t.shape[0] > max_rows else [])
    return "\n".join(lines)


NEXT_TOKEN_BATCH = Task(
    "next_token_batch", lambda ids, T, starts: torch.stack(_data.batch_at(ids, starts, T)), _BATCH_FORBIDDEN,
    _batch_cases, mistakes=_batch_mistakes, expect=_expect_batch, diagnose=_batch_diagnosis, caller=call_with_hint(_crash_hint),
    show=lambda t: f"x:\n{_rows(t[0])}\ny:\n{_rows(t[1])}")


def check_next_token_batch(fn: Callable[[Tensor, int, Tensor], tuple], seed: int = 0) -> None:
    """Check a learner's ``next_token_batch(ids, block_size, starts) -> (x, y)``.

    ``ids`` (N,) int64 token ids, ``starts`` (B,) int64 window starts; the answer is ``x`` (B, T)
    with ``x[b] = ids[s_b : s_b + T]`` and ``y`` (B, T) with ``y[b] = ids[s_b + 1 : s_b + T + 1]``
    (T = ``block_size``), compared exactly with :func:`gptlab.data.batch_at`. The cases include the
    last start that fits (N - T - 1), T = 1 and a batch of one.
    """
    NEXT_TOKEN_BATCH.check(fn, seed)


# --------------------------------------------------------------------------- cross_entropy

_CE_FORBIDDEN = (
    Forbidden(F.cross_entropy, "F.cross_entropy"),
    Forbidden(F.nll_loss, "F.nll_loss"),
    Forbidden(torch.nn.CrossEntropyLoss, "nn.CrossEntropyLoss"),
    Forbidden(torch.nn.NLLLoss, "nn.NLLLoss"),
    Forbidden(_bigram.BigramModel.loss, "gptlab.bigram.BigramModel.loss"),
)
_CE_FORBIDDEN += torch_family("cross_entropy", "nll_loss",  # F.linear_cross_entropy with an identity weight
                              but=[f.target for f in _CE_FORBIDDEN])


def reference_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """The reference: ``F.cross_entropy(logits, targets)``, logits (N, V), targets (N,) -> 0-d mean NLL."""
    return F.cross_entropy(logits, targets)


def _ce_cases(seed: int) -> list[Case]:
    """Seeded logits (leaves that require grad: the gradient is checked too) and targets."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for N, V, scale in ((6, 5, 2.0), (1, 3, 1.0), (32, 65, 3.0)):
        logits = (torch.randn(N, V, generator=g) * scale).requires_grad_(True)
        cases.append(Case((logits, torch.randint(0, V, (N,), generator=g)),
                          f"logits of shape ({N}, {V}) (seeded, values up to about {3 * scale:g})"))
    # large logits: exp(1e4) overflows float32; targets avoid the argmax so that log(softmax) underflows
    big = torch.randn(4, 7, generator=g) * 1e4
    targets = (big.argmax(dim=1) + 1 + torch.randint(0, 6, (4,), generator=g)) % 7
    cases.append(Case((big.requires_grad_(True), targets), "logits of shape (4, 7) with values about 1e4 in size"))
    return cases


def _ce_mistakes(logits: Tensor, targets: Tensor) -> list:
    N = logits.shape[0]
    rows = torch.arange(N)
    logp = logits - logits.max(dim=1, keepdim=True).values
    logp = logp - logp.exp().sum(dim=1, keepdim=True).log()  # log-softmax over the vocabulary
    logp0 = logits - logits.max(dim=0, keepdim=True).values
    logp0 = logp0 - logp0.exp().sum(dim=0, keepdim=True).log()  # over the wrong dimension
    picked = logp[rows, targets]
    return [
        ("you summed the losses instead of averaging them: divide by N (use .mean()).", lambda: -picked.sum()),
        ("you took the softmax over the wrong dimension (dim=0, the positions): normalise each row over the "
         "vocabulary, dim=1 (or -1).", lambda: -logp0[rows, targets].mean()),
        ("you picked the log-probability of the most likely token (argmax) instead of the target's: index "
         "with targets, logp[torch.arange(N), targets].", lambda: -logp[rows, logits.argmax(dim=1)].mean()),
        ("the sign is flipped: the loss is the NEGATIVE mean log-probability of the targets (it is >= 0).",
         lambda: picked.mean()),
        ("you averaged the log-probabilities of every token, not only the targets': pick one entry per row, "
         "logp[torch.arange(N), targets].", lambda: -logp.mean()),
        ("you indexed logp[:, targets], which picks an (N, N) block (every row at every target): pick one "
         "entry per row with logp[torch.arange(N), targets].", lambda: -logp[:, targets].mean()),
        ("you used log base 2 (bits): the loss here is in nats, natural log (torch.log).",
         lambda: -picked.mean() / math.log(2)),
        ("you forgot the log: the loss is -log p(target), not -p(target).", lambda: -picked.exp().mean()),
        ("you used the raw logits of the targets without normalising them: a log-probability is "
         "logit - log(sum(exp(logits of the row))).", lambda: -logits[rows, targets].mean()),
    ]


def _show_number(t: Tensor) -> str:
    return f"{t.item():.6g}" if t.dim() == 0 else show_tensor(t, decimals=6)


def _expect_loss(got: Any, case: Case) -> Tensor:
    logits, targets = case.args
    N = logits.shape[0]
    if isinstance(got, (float, int)) and not isinstance(got, bool):
        raise ExerciseError(
            f"cross_entropy returned a Python number ({got:.4g}); return the 0-d tensor instead (no .item()), "
            "so that loss.backward() can compute the gradient."
        )
    if isinstance(got, Tensor) and got.dim() == 1 and got.shape[0] == N and N > 1:
        raise ExerciseError(
            f"cross_entropy returned shape ({N},), one loss per row: return their mean, a 0-d tensor (.mean())."
        )
    got = expect_tensor(got, "cross_entropy", shape=(), dtype="float", device="cpu",
                        hint_shape="The loss is one number: the mean over the N rows, a 0-d tensor.")
    if not bool(torch.isfinite(got)):
        raise ExerciseError(
            f"cross_entropy is {got.item()} for {case.text}; expected {reference_cross_entropy(*case.args).item():.6g}. "
            "It is not numerically stable: exp(1e4) overflows to inf (and inf/inf = nan), and a probability that "
            "underflows to 0 gives log(0) = -inf. Subtract each row's maximum before exp (the log-sum-exp shift) and "
            "compute log-probabilities as (logits - max) - log(sum(exp(logits - max))), never log(softmax)."
        )
    return got


CROSS_ENTROPY = Task("cross_entropy", reference_cross_entropy, _CE_FORBIDDEN + _SHIFT_FORBIDDEN, _ce_cases,
                     atol=1e-5, rtol=1e-4, mistakes=_ce_mistakes, expect=_expect_loss, show=_show_number)


def check_cross_entropy(fn: Callable[[Tensor, Tensor], Tensor], seed: int = 0) -> None:
    """Check a learner's ``cross_entropy(logits, targets) -> 0-d tensor``.

    ``logits`` (N, V) float32, ``targets`` (N,) int64; the answer is the mean over the N rows of
    ``-log softmax(logits[n])[targets[n]]``, a 0-d tensor, compared with ``F.cross_entropy`` (atol
    1e-5, rtol 1e-4), on small and large (1e4) logits, and its gradient with respect to the logits
    with ``(softmax(logits) - onehot(targets)) / N`` (same tolerance). Forbids the fused losses,
    ``torch.logsumexp`` and ``log_softmax``.
    """
    CROSS_ENTROPY.check(fn, seed)
    for case in CROSS_ENTROPY.cases(seed):  # the gradient: backward through the learner's graph
        logits, targets = case.args
        loss = call(fn, "cross_entropy", logits, targets, forbidden=CROSS_ENTROPY.forbidden)
        if not loss.requires_grad:
            raise ExerciseError(
                "cross_entropy's result is cut off from the logits: it has no gradient (did you use .item(), "
                ".detach(), torch.tensor(...) on a result, or numpy?). Compute it with tensor operations on logits."
            )
        (grad,) = torch.autograd.grad(loss, logits)
        want_grad = (torch.softmax(logits.detach(), dim=1) - F.one_hot(targets, logits.shape[1]).float()) / len(targets)
        expect_close(grad, want_grad, "the gradient of cross_entropy with respect to the logits", case.text,
                     atol=1e-5, rtol=1e-4,
                     diagnose=lambda g: "it should be (softmax(logits) - onehot(targets)) / N; a value that is right "
                                        "but whose gradient is wrong usually comes from a detached piece (e.g. the "
                                        "row maximum is fine detached, the log-sum-exp is not).")


# --------------------------------------------------------------------------- perplexity

_PPL_FORBIDDEN = (Forbidden(_bigram.perplexity, "gptlab.bigram.perplexity"),)
_NLLS = (0.0, 1.0, math.log(65), 2.4818894, 0.25, 4.5)


def _ppl_cases(seed: int | None) -> list[Case]:
    """The fixed mean losses, and three drawn from ``seed`` (none when it is None)."""
    values = list(_NLLS) + ([random.Random(seed).uniform(0.05, 6.0) for _ in range(3)] if seed is not None else [])
    return [Case((x,), f"mean_nll = {x!r}", f"perplexity({x:.6g})") for x in values]


def _expect_number(got: Any, case: Case) -> Tensor:
    if isinstance(got, Tensor):
        raise ExerciseError(f"{case.what} returned a tensor; return a Python float (math.exp, or .item()).")
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        extra = " (did you forget a return statement?)" if got is None else ""
        raise ExerciseError(f"{case.what} should return a float, got {describe(got)}{extra}.")
    return torch.tensor(float(got), dtype=torch.float64)


def _ppl_mistakes(x: float) -> list[tuple[str, Callable[[], float]]]:
    return [
        ("you used base 2 (2 ** loss): the loss is in nats (natural log), so the perplexity is e ** loss, "
         "math.exp(loss).", lambda: 2.0**x),
        ("you used base 10 (10 ** loss): the loss is in nats (natural log), so the perplexity is math.exp(loss).",
         lambda: 10.0**x),
        ("you took exp(-loss), the geometric-mean probability of the targets; the perplexity is its inverse, "
         "exp(+loss).", lambda: math.exp(-x)),
        ("you returned the loss itself: the perplexity is exp(loss).", lambda: x),
        ("you took the log of the loss: the perplexity is exp(loss).", lambda: math.log(x)),
    ]


PERPLEXITY = Task("perplexity", math.exp, _PPL_FORBIDDEN, _ppl_cases, rtol=1e-6, mistakes=_ppl_mistakes,
                  expect=_expect_number, show=_show_number,
                  diagnose=lambda got, want, case: "the perplexity of a mean loss L (nats) is exp(L).")


def check_perplexity(fn: Callable[[float], float], seed: int | None = None) -> None:
    """Check a learner's ``perplexity(mean_nll) -> float`` against ``math.exp`` (relative 1e-6).

    ``mean_nll`` is a mean negative log-likelihood in nats (natural log), as ``cross_entropy``
    returns; the perplexity is ``exp(mean_nll)``, a Python float.
    """
    PERPLEXITY.check(fn, seed)
