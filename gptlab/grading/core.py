"""The grading framework: run a learner's function, compare it with gptlab's, name the mistake.

Where this sits: beside the pipeline (text -> tokens -> batches -> model -> logits -> loss or
samples -> text). Every graded task of every assignment asks the learner to write one piece of that
pipeline; its test cell calls a check (one module per assignment in :mod:`gptlab.grading`), and
every check is built from the few tools here, so that all assignments fail the same way:

* :func:`call` runs the learner's function. A ``NotImplementedError`` becomes "not written yet",
  any other exception is shown with the input that raised it, and the entry points the task forbids
  (gptlab's own reference, or the fused PyTorch op named in the task) are instrumented while it
  runs: calling one raises :class:`DelegationError`, whatever name the learner imported it under.
* :func:`expect_tensor` checks the type, shape, dtype, device and finiteness of what came back.
* :func:`expect_close` compares it with the reference within a tolerance chosen per check (single
  ops tight, composed blocks looser) and, when it differs, tries each known mistake of the check's
  catalogue (the same input run through the buggy variant) to name the most likely one.
* :func:`expect_distribution` checks a random function by the distribution of many seeded draws
  (a chi-square test whose false-failure rate is stated, below 1e-6).

Every failure is an :class:`ExerciseError`, an ``AssertionError``, so nbgrader scores the test
cell 0; its message shows the input, what was expected, what came, and the likely mistake.

Comparisons use PyTorch's own C functions, not the ``torch.*`` names a notebook could replace.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Real
from types import CodeType, FunctionType, MethodDescriptorType, MethodType
from typing import Any

import torch
from torch import Tensor
from torch._C import _VariableFunctions as _VF

__all__ = [
    "ExerciseError",
    "DelegationError",
    "LearnerTimeout",
    "LearnerCrashed",
    "Forbidden",
    "forbid",
    "forbidden_specs",
    "resolve_forbidden",
    "torch_family",
    "entries_of",
    "call",
    "expect_tensor",
    "expect_close",
    "expect_distribution",
    "describe",
    "show_tensor",
    "require_function",
    "same",
    "close",
]


class ExerciseError(AssertionError):
    """A learner's answer differs from the reference; the message says how and most likely why."""


class DelegationError(ExerciseError):
    """The learner's function called the reference (or the fused PyTorch op) it must replace."""


class LearnerTimeout(ExerciseError):
    """The learner's function did not answer within the test's time limit (autograder)."""


class LearnerCrashed(ExerciseError):
    """The learner's process died, or sent something that is not plain data, while running a function."""


# --------------------------------------------------------------------------- showing values


def show_tensor(t: Tensor, decimals: int = 4, max_elems: int = 64) -> str:
    """A short, readable text of ``t``: the values when small (floats rounded to ``decimals``
    places: ``0.3333``, not ``0.33329999446868896``), else the shape and a few values."""
    t = t.detach()
    if t.device.type == "meta":
        return f"<meta tensor of shape {tuple(t.shape)}>"
    t = t.cpu()
    if t.numel() <= max_elems:
        if t.dim() <= 1:
            return str(_values(t, decimals))
        return "\n".join(str(_values(row, decimals)) for row in t.reshape(-1, t.shape[-1]))
    head = _values(t.flatten()[:6], decimals)
    return f"<tensor of shape {tuple(t.shape)}, dtype {t.dtype}; first values {head} ...>"


def _values(t: Tensor, decimals: int = 4) -> Any:
    """``t.tolist()`` with every float rounded to ``decimals`` places as a Python float (whose
    text is the shortest that reads back, so 0.1 prints as 0.1); a value that would round to 0
    keeps ``decimals`` significant digits instead (1e-07 is not 0)."""
    values = t.tolist()
    if not t.is_floating_point():
        return values

    def rnd(v):
        if isinstance(v, list):
            return [rnd(x) for x in v]
        r = round(v, decimals)
        return float(f"{v:.{decimals}g}") if r == 0 and v != 0 else r

    return rnd(values)


def describe(x: Any) -> str:
    """One line describing an argument in a message: tensors by shape and dtype, the rest by repr."""
    if isinstance(x, Tensor):
        if x.numel() <= 8 and x.device.type != "meta":
            return f"tensor({_values(x.detach().cpu())})"
        return f"<tensor of shape {tuple(x.shape)}, dtype {x.dtype}>"
    if isinstance(x, torch.nn.Module):
        return f"<{type(x).__name__} module>"
    if isinstance(x, torch.Generator):
        return "<torch.Generator>"
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _indent(text: str, by: str = "      ") -> str:
    return "\n".join(by + line for line in text.splitlines())


def require_function(fn: object, name: str) -> None:
    """Raise ``TypeError`` when a check is handed something that is not callable."""
    if not callable(fn):
        raise TypeError(f"the check for {name} expects a function (your {name}), got {type(fn).__name__}")


# --------------------------------------------------------------------------- delegation


@dataclass(frozen=True)
class Forbidden:
    """An entry point a task forbids, and the plain name a learner knows it by.

    ``target`` is a Python function or method (recognised by its code's file, line and name, so a
    fresh import of the same module, or an alias, is still recognised), a builtin (recognised by
    identity, which aliases share), a builtin method of a class such as ``torch.Tensor.logsumexp``
    (recognised by name on any instance of the class: ``x.logsumexp(1)``), or a class (its
    ``forward`` and ``__init__``).
    """

    target: Any
    name: str

    def spec(self) -> list[str]:
        """``[module, qualified name, name]``: how another process finds the same entry point
        (:func:`resolve_forbidden`)."""
        t = self.target.__func__ if isinstance(self.target, MethodType) else self.target
        if isinstance(t, MethodDescriptorType):
            owner = t.__objclass__
            return [owner.__module__, f"{owner.__qualname__}.{t.__name__}", self.name]
        module = getattr(t, "__module__", None) or "builtins"
        name = getattr(t, "__name__", "")
        candidates = [[module, getattr(t, "__qualname__", name)], [module, name], ["torch", name],
                      ["torch.nn.functional", name]]
        for cand in candidates:  # the first path that names this very object here
            try:
                if resolve_forbidden(cand) is t:
                    return [*cand, self.name]
            except (ImportError, AttributeError, ValueError):
                continue
        return [*candidates[0], self.name]

    def keys(self) -> set:
        """The code keys and builtin ids that identify this entry point when it is called."""
        out: set = set()
        targets = [self.target]
        if isinstance(self.target, type):
            targets = [getattr(self.target, a, None) for a in ("forward", "__init__")]
        for t in targets:
            if t is None:
                continue
            if isinstance(t, MethodType):
                t = t.__func__
            code = getattr(t, "__code__", None)
            if isinstance(code, CodeType):
                out.add(_code_key(code))
            elif isinstance(t, MethodDescriptorType):
                out.add(("method", t.__name__, t.__objclass__))
            else:
                out.add(("builtin", id(t)))
        return out


def resolve_forbidden(spec: Sequence[str]) -> Any:
    """The entry point a :meth:`Forbidden.spec` names, imported in this process."""
    import importlib

    module, qual = str(spec[0]), str(spec[1])
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def entries_of(module: Any, *names: str, prefix: str | None = None) -> tuple[Forbidden, ...]:
    """``module.<name>`` for each of ``names`` (dotted for a method, e.g. ``"ConcatKVCache.update"``)
    as forbidden entries named ``<prefix>.<name>`` (``prefix``: the module's name unless given, e.g.
    ``"F"`` for ``torch.nn.functional``): the package's references, or PyTorch's fused ops, that a
    learner's function may not call."""
    prefix = prefix or module.__name__
    out = []
    for name in names:
        target = module
        for part in name.split("."):
            target = getattr(target, part)
        out.append(Forbidden(target, f"{prefix}.{name}"))
    return tuple(out)


def torch_family(*parts: str, but: Sequence[Any] = ()) -> tuple[Forbidden, ...]:
    """Every function of ``torch``, ``torch.nn.functional`` and ``torch.special`` and every tensor
    method whose name contains one of ``parts``: the public op a task forbids and its siblings that
    compute the same answer (``torch._scaled_dot_product_flash_attention_for_cpu`` beside
    ``F.scaled_dot_product_attention``, ``torch.batch_norm`` on a reshaped input for a layer norm,
    ``x.logcumsumexp(-1)[..., -1]`` for a log-sum-exp). ``but``: objects left out."""
    import torch.nn.functional as F

    out: list[Forbidden] = []
    seen = {id(b) for b in but}
    for owner, prefix in ((torch, "torch"), (F, "F"), (torch.special, "torch.special"), (torch.Tensor, "torch.Tensor")):
        for name in sorted(dir(owner)):
            if not any(p in name for p in parts) or name.startswith("__"):
                continue
            obj = getattr(owner, name, None)
            if not callable(obj) or isinstance(obj, type) or id(obj) in seen:
                continue
            seen.add(id(obj))
            out.append(Forbidden(obj, f"{prefix}.{name}"))
    return tuple(out)


def forbidden_specs(entries: Sequence[Forbidden]) -> list[list[str]]:
    """:meth:`Forbidden.spec` of each entry (what the learner's process is told to forbid)."""
    return [e.spec() for e in entries]


def _code_key(code: CodeType) -> tuple:
    return ("code", code.co_filename, code.co_firstlineno, code.co_name)


@contextmanager
def forbid(entries: Sequence[Forbidden], task: str):
    """While active, calling any of ``entries`` raises :class:`DelegationError` naming it.

    Uses the interpreter's profiling hook, so it sees every Python and builtin call made on this
    thread, whatever name the learner imported the entry point under. A profiling function that
    was already installed (a debugger, coverage) keeps receiving its events.
    """
    if not entries:
        yield
        return
    index: dict = {}
    methods: dict[str, list] = {}  # method name -> [(class, entry)]
    for e in entries:
        for k in e.keys():
            if k[0] == "method":
                methods.setdefault(k[1], []).append((k[2], e))
            else:
                index[k] = e
    previous = sys.getprofile()
    hit: list[Forbidden] = []

    def profile(frame, event, arg):
        if previous is not None:
            previous(frame, event, arg)
        if hit:
            return
        if event == "call":
            e = index.get(_code_key(frame.f_code))
        elif event == "c_call":
            e = index.get(("builtin", id(arg)))
            if e is None and methods:
                owner = getattr(arg, "__self__", None)
                e = next((m for cls, m in methods.get(getattr(arg, "__name__", ""), ()) if isinstance(owner, cls)), None)
        else:
            return
        if e is not None:
            hit.append(e)
            sys.setprofile(previous)
            raise DelegationError(
                f"{task} must be written by hand, but your code called {e.name}, which computes the "
                f"answer for you. Build it from basic tensor operations instead."
            )

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)


# --------------------------------------------------------------------------- calling the learner


_recorded: list | None = None
"""While the autograder grades a task, every forbidden entry point its check passes to :func:`call`
(the list the source is then read against, :mod:`gptlab.grading.source`); None otherwise."""


def record_forbidden(start: bool) -> list:
    """Start (``True``) or stop recording the entry points checks forbid; returns what was recorded."""
    global _recorded
    got = list(_recorded or [])
    _recorded = [] if start else None
    return got


def call(
    fn: Callable,
    name: str,
    *args: Any,
    forbidden: Sequence[Forbidden] = (),
    check_inputs_unchanged: bool = True,
    **kwargs: Any,
) -> Any:
    """Call the learner's ``fn(*args, **kwargs)`` and return what it returned.

    Raises :class:`ExerciseError` with a clear message when it is not written yet
    (``NotImplementedError``), raises anything else (shown with its input), changes a tensor
    argument in place (when ``check_inputs_unchanged``), or calls a ``forbidden`` entry point
    (:class:`DelegationError`).
    """
    if _recorded is not None:
        _recorded.extend(forbidden)
    before = {i: a.detach().clone() for i, a in enumerate(args) if isinstance(a, Tensor) and a.device.type != "meta"}
    arg_text = ", ".join([describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()])
    try:
        if getattr(type(fn), "__gptlab_remote__", False):  # a handle (remote.Remote): the learner's process
            # forbids, runs and answers; the answer is judged here
            out = fn._conn.call(fn, args, kwargs, tuple(forbidden), name)
        else:
            with forbid(forbidden, name):
                out = fn(*args, **kwargs)
    except DelegationError:
        raise
    except NotImplementedError:
        raise ExerciseError(
            f"{name} is not written yet: it raised NotImplementedError. Replace the line "
            "`raise NotImplementedError()` with your code."
        ) from None
    except ExerciseError:
        raise
    except Exception as e:  # the learner's code crashed: show what and where
        raise ExerciseError(f"{name}({arg_text}) raised {type(e).__name__}: {e}") from e
    if check_inputs_unchanged:
        for i, old in before.items():
            new = args[i].detach()
            if new.shape != old.shape or new.dtype != old.dtype or not _same_nan(new, old):
                raise ExerciseError(
                    f"{name} changed its input (argument {i + 1}, {describe(old)}) in place, e.g. with an "
                    "underscore method such as masked_fill_ or an assignment into it. Work on a new tensor "
                    "so that the caller's data is untouched."
                )
    return out


def same(a: Tensor, b: Tensor) -> bool:
    """Exact equality of two tensors (shape, dtype and values), with PyTorch's own C function."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(_VF.equal(a, b))


def _same_nan(a: Tensor, b: Tensor) -> bool:
    if not a.is_floating_point():
        return bool(_VF.equal(a, b))
    both = torch.isnan(a) & torch.isnan(b)
    return bool(_VF.equal(a.masked_fill(both, 0), b.masked_fill(both, 0)))


# --------------------------------------------------------------------------- checking what came back


def expect_tensor(
    got: Any,
    what: str,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    finite: bool = False,
    hint_shape: str = "",
) -> Tensor:
    """Check that ``got`` is a tensor of the expected shape, dtype and device; return it detached.

    ``what`` names the value in messages (e.g. ``"causal_mask(4)"``). ``dtype`` may be a dtype, or
    ``"float"`` for any floating dtype. ``finite`` rejects NaN (and infinities) with a message that
    says where the first one is.
    """
    if not isinstance(got, Tensor):
        extra = " (did you forget a return statement?)" if got is None else ""
        raise ExerciseError(f"{what} should return a torch.Tensor, got {type(got).__name__}{extra}.")
    if device is not None and got.device != torch.device(device) and not (
        torch.device(device).type == got.device.type and torch.device(device).index is None
    ):
        raise ExerciseError(
            f"{what} returned a tensor on the device {got.device}, expected {torch.device(device)}: create new "
            "tensors on the input's device (e.g. device=x.device) instead of the default one."
        )
    if shape is not None and tuple(got.shape) != tuple(shape):
        raise ExerciseError(
            f"{what} should have shape {tuple(shape)}, got {tuple(got.shape)}." + (f" {hint_shape}" if hint_shape else "")
        )
    if dtype == "float":
        if not got.is_floating_point():
            raise ExerciseError(f"{what} should be a floating-point tensor, got dtype {got.dtype}.")
    elif dtype is not None and got.dtype != dtype:
        raise ExerciseError(f"{what} should have dtype {dtype}, got {got.dtype}.")
    got = got.detach()
    if finite and got.is_floating_point() and got.device.type != "meta":
        bad = ~torch.isfinite(got)
        if bad.any():
            where = tuple(int(v) for v in bad.nonzero()[0])
            raise ExerciseError(
                f"{what} contains {got[where].item()} at index {where}: the result must be finite. NaN usually "
                "comes from exp overflowing (subtract the maximum first), 0/0, or log(0)."
            )
    return got


Candidate = tuple[str, Callable[[], Any]]
"""A known mistake: its diagnosis, and a thunk computing what that mistake returns on this input."""


def close(a: Tensor, b: Any, atol: float, rtol: float) -> bool:
    """Whether ``a`` and ``b`` (a tensor or anything ``torch.as_tensor`` takes) have the same shape
    and values within ``atol + rtol * |b|`` (NaN equal to NaN; booleans exactly), compared in
    float64 on the CPU with PyTorch's own C function (a notebook that replaces ``torch.allclose``
    changes nothing)."""
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        b = torch.tensor(b, dtype=torch.float64)  # as_tensor would round a Python float to float32
    elif not isinstance(b, Tensor):
        try:
            b = torch.as_tensor(b)
        except Exception:
            return False
    if tuple(a.shape) != tuple(b.shape):
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype == torch.bool or b.dtype == torch.bool:
        return a.dtype == b.dtype and bool(_VF.equal(a, b))
    a, b = a.double(), b.double()
    return bool(_VF.allclose(a, b, rtol, atol, True))


def expect_close(
    got: Tensor,
    want: Tensor,
    what: str,
    inputs: str,
    atol: float,
    rtol: float,
    mistakes: Iterable[Candidate] = (),
    diagnose: Callable[[Tensor], str | None] | None = None,
    show: Callable[[Tensor], str] = show_tensor,
    legend: str = "",
) -> None:
    """Pass if ``got`` equals ``want`` within ``atol + rtol * |want|``; otherwise name the mistake.

    ``mistakes`` are tried in order: the first whose output on the same input equals ``got`` (same
    tolerance) names the mistake; a mistake whose thunk raises is skipped. ``diagnose`` is asked
    next, for mistakes that are recognised by a property rather than an output. The message shows
    ``inputs``, the expected and the obtained values (``legend``, if given, says how to read them:
    ``"1 = may attend"``), and the largest difference.
    """
    if close(got, want, atol, rtol):
        return
    reason = None
    for text, thunk in mistakes:
        try:
            candidate = thunk()
        except Exception:
            continue
        if close(got, candidate, atol, rtol):
            reason = text
            break
    if reason is None and diagnose is not None:
        reason = diagnose(got)
    lines = [f"{what} is wrong."]
    lines.append("  Most likely mistake: " + (reason or "none of the usual ones; compare your steps with the formula above."))
    lines.append(f"  input: {inputs}")
    lines.append(f"  expected{f' ({legend})' if legend else ''}:\n" + _indent(show(want)))
    lines.append("  got:\n" + _indent(show(got)))
    if got.is_floating_point() and want.is_floating_point() and got.shape == want.shape:
        g, w = got.double().cpu(), want.double().cpu()
        diff = (g - w).abs().masked_fill(g == w, 0.0).nan_to_num(nan=math.inf, posinf=math.inf)  # -inf == -inf: 0
        idx = _unravel(int(diff.argmax()), tuple(diff.shape))
        at = f" at index {idx}" if idx else ""  # a single number has no index
        lines.append(
            f"  largest difference: {diff.max().item():.3g}{at} "
            f"(allowed: {atol:g} + {rtol:g} x |expected|)"
        )
    raise ExerciseError("\n".join(lines))


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index of element ``flat`` of a row-major tensor of ``shape`` (torch.unravel_index
    imports sympy on its first call, which costs a learner's first failing check seconds)."""
    out = []
    for size in reversed(shape):
        flat, r = divmod(flat, size)
        out.append(r)
    return tuple(reversed(out))


# --------------------------------------------------------------------------- random functions

# Critical value chosen so that a correct sampler fails with probability below this.
FALSE_FAILURE_RATE = 1e-7


def expect_distribution(
    counts: Tensor,
    probs: Tensor,
    what: str,
    mistakes: Iterable[tuple[str, Tensor]] = (),
) -> None:
    """Check that ``counts`` (V,) of draws are distributed as ``probs`` (V,) (a chi-square test).

    A correct sampler fails with probability below :data:`FALSE_FAILURE_RATE` (1e-7). Categories
    with probability 0 must never be drawn (drawing one fails at once). ``mistakes`` are (diagnosis,
    probabilities) pairs; the one with the highest likelihood of the counts names the mistake.
    """
    from scipy.stats import chi2  # scipy is a test dependency; imported only where a sampler is checked

    counts = counts.detach().double().cpu()
    probs = probs.detach().double().cpu()
    n = counts.sum().item()
    impossible = (probs == 0) & (counts > 0)
    stat, dof, p_value = math.inf, 0, 0.0
    if not impossible.any():
        keep = probs > 0
        expected = probs[keep] * n
        stat = (((counts[keep] - expected) ** 2) / expected).sum().item()
        dof = int(keep.sum().item()) - 1
        p_value = float(chi2.sf(stat, dof)) if dof > 0 else 1.0
        if p_value >= FALSE_FAILURE_RATE:
            return
    best, best_ll = None, -math.inf
    for text, alt in mistakes:
        alt = alt.double().cpu()
        if ((alt == 0) & (counts > 0)).any():
            continue
        ll = (counts * torch.log(alt.clamp_min(1e-300))).sum().item()
        if ll > best_ll:
            best, best_ll = text, ll
    freq = counts / max(n, 1)
    top = torch.argsort(probs, descending=True)[:8].tolist()
    table = "\n".join(f"      token {i}: expected {probs[i].item():.3f}, got {freq[i].item():.3f}" for i in top)
    if impossible.any():
        i = int(impossible.nonzero()[0])
        head = f"{what} drew token {i}, whose probability is 0 (it must never be drawn)."
    else:
        head = (
            f"{what} draws tokens with the wrong frequencies: over {int(n)} seeded draws a chi-square test "
            f"gives p = {p_value:.2g} (a correct sampler fails with probability below {FALSE_FAILURE_RATE:g})."
        )
    raise ExerciseError(
        head + "\n  Most likely mistake: " + (best or "none of the usual ones.") + "\n  frequencies (most likely tokens first):\n" + table
    )


def is_function(x: object) -> bool:
    """True for a plain Python function (what a notebook's ``def`` makes)."""
    return isinstance(x, FunctionType)


# --------------------------------------------------------------------------- answers that are numbers


def expect_number(got: Any, what: str, integer: bool = False) -> Tensor:
    """The ``expect`` hook of a :class:`~gptlab.grading.task.Task` whose answer is one number: check
    that ``got`` is a Python or NumPy number or a 1-element tensor (not a bool), a whole one when
    ``integer`` (an int, or a float such as ``4.0``), and return it as a 0-d float64 tensor (exact
    for integers below 2**53, so ``atol = rtol = 0`` compares them exactly)."""
    if isinstance(got, Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, Real) or (integer and not float(got).is_integer()):
        raise ExerciseError(f"{what} should return {'an int' if integer else 'a number'}, got {type(got).__name__}.")
    return as_number(float(got))


def as_number(x: float) -> Tensor:
    """``x`` as a 0-d float64 tensor (exact for integers below 2**53): how :func:`expect_number` and
    :meth:`~gptlab.grading.task.Task.check_case` compare answers that are numbers; :func:`close`
    compares a mistake's number the same way."""
    return torch.tensor(x, dtype=torch.float64)


def show_number(t: Tensor) -> str:
    """A 0-d tensor as a message shows a number: a whole one with thousands separators
    (``10,788,929``), any other to 6 significant digits (``5.45455e-05``)."""
    v = t.item()
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:.6g}"


def call_by_keyword(fn: Callable, name: str, kwargs: dict, forbidden: Sequence[Forbidden] = ()) -> Any:
    """:func:`call` with the arguments of ``kwargs`` passed by keyword: the ``caller`` of a
    :class:`~gptlab.grading.task.Task` whose cases hold one dict of arguments (``Case((kwargs,), ...)``)."""
    return call(fn, name, forbidden=forbidden, **kwargs)
