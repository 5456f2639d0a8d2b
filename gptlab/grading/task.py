"""A graded function as data: its name, the package's reference, what it may not call, its cases,
its tolerance and its catalogue of known mistakes.

Where this sits: beside the pipeline, inside the grading framework (:mod:`gptlab.grading.core`
holds the tools: :func:`~gptlab.grading.core.call`, :func:`~gptlab.grading.core.expect_close`).
Most checks of the assignments are the same loop: call the learner's function on each case,
check what came back (type, shape, dtype), compute the package's answer on the same input, and
compare; when they differ, run each known mistake on that input and name the one that gives the
learner's answer. A :class:`Task` is that loop's data, so a check reads as its cases and its
catalogue::

    TOP_K = Task(
        name="top_k_filter",
        reference=gptlab.sampling.top_k_filter,        # the package's own function
        forbidden=_GPTLAB_FILTERS,                      # entry points the learner may not call
        cases=_top_k_cases,                             # seed -> [Case(args, text, what), ...]
        atol=1e-6, rtol=1e-5,
        mistakes=_top_k_mistakes,                       # (*args) -> [(diagnosis, thunk), ...]
    )
    TOP_K.check(learner_top_k_filter, seed=0)          # None, or ExerciseError naming the mistake

Checks that are not one call compared with one answer (a class whose weights are copied in, a
sampler judged by its distribution, a training run, a beam search scored on a toy model) keep
their own loop, built from the same tools.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from .core import (Candidate, DelegationError, ExerciseError, Forbidden, as_number, call, expect_close,
                   expect_tensor, require_function, show_tensor)

__all__ = ["Case", "Task", "same_as_first", "call_with_hint"]


@dataclass(frozen=True)
class Case:
    """One input of a check: the arguments, and how a message shows them."""

    args: tuple
    """Positional arguments of the learner's function (and of the reference)."""
    text: str
    """The input as a message shows it (e.g. ``"logits (3, 10) float32, k=3"``)."""
    what: str = ""
    """The call as a message names it (e.g. ``"top_k_filter(logits, k=3)"``); the task's name if empty
    in the comparison's message."""


def same_as_first(got: Any, case: Case) -> Tensor:
    """The default check of what came back: a finite floating tensor shaped like, and on the device
    of, the first argument."""
    like = case.args[0]
    return expect_tensor(got, case.what, shape=like.shape, dtype="float", device=like.device, finite=True).float()


def call_with_hint(hint: Callable[[ExerciseError, tuple], str | None]) -> Callable[..., Any]:
    """A :attr:`Task.caller`: :func:`~gptlab.grading.core.call`, whose failure (other than a delegation)
    gets "Most likely mistake: ``hint(error, args)``" where the hint names one (the usual cause of a crash)."""

    def caller(fn: Callable[..., Any], name: str, *args: Any, forbidden: Sequence[Forbidden] = ()) -> Any:
        try:
            return call(fn, name, *args, forbidden=forbidden)
        except DelegationError:
            raise
        except ExerciseError as e:
            reason = hint(e, args)
            if reason is None:
                raise
            raise ExerciseError(f"{e}\n  Most likely mistake: {reason}") from None

    return caller


def _no_mistakes(*args: Any) -> list[Candidate]:
    return []


@dataclass(frozen=True)
class Task:
    """A graded function: ``check(fn, seed)`` compares ``fn`` with ``reference`` on ``cases(seed)``.

    For each case: ``got = fn(*case.args)`` (run through :func:`~gptlab.grading.core.call` with
    ``forbidden`` instrumented), ``got = expect(got, case)`` (the type, shape and dtype
    checks, which raise with a hint), ``want = reference(*case.args)``, then
    :func:`~gptlab.grading.core.expect_close` within ``atol + rtol * |want|``, trying
    ``mistakes(*case.args)`` in order and then ``diagnose(got, want, case)`` to name the mistake.
    A reference that answers a Python number (``math.exp``) is compared as a float64 0-d tensor;
    ``expect`` then turns the learner's number into one too.
    """

    name: str
    """The learner's function, as the notebook names it."""
    reference: Callable[..., Any]
    """The package's own function: ``reference(*case.args)`` is the expected answer."""
    forbidden: Sequence[Forbidden]
    """Entry points the learner's function may not call (gptlab's reference, PyTorch's fused op)."""
    cases: Callable[..., Sequence[Case]]
    """``(seed, **options) -> cases``: the seed draws the random inputs (the autograder's hidden run
    uses its own)."""
    atol: float = 0.0
    rtol: float = 0.0
    mistakes: Callable[..., Sequence[Candidate]] = _no_mistakes
    """``(*case.args) -> [(diagnosis, thunk)]``: each thunk computes what one known mistake returns."""
    expect: Callable[[Any, Case], Tensor] = same_as_first
    """``(got, case) -> tensor``: checks what came back (type, shape, dtype) before the values are compared."""
    diagnose: Callable[[Tensor, Tensor, Case], str | None] | None = None
    """``(got, want, case) -> diagnosis``: mistakes recognised by a property rather than an output."""
    caller: Callable[..., Any] = field(default=call)
    """How the learner's function is called (``call``, or a wrapper that forbids more)."""
    show: Callable[[Tensor], str] = show_tensor
    """How a message shows the expected and the obtained tensors."""
    legend: str = ""
    """How to read what :attr:`show` shows, after "expected" in a message (e.g. ``"1 = may attend"``)."""

    def check(self, fn: Callable[..., Any], seed: int = 0, **options: Any) -> None:
        """Raise :class:`~gptlab.grading.core.ExerciseError` naming the mistake unless ``fn`` agrees
        with :attr:`reference` on every case of ``cases(seed, **options)`` (``options``: a check's
        own settings, e.g. the mask sizes)."""
        require_function(fn, self.name)
        for case in self.cases(seed, **options):
            self.check_case(fn, case)

    def check_case(self, fn: Callable[..., Any], case: Case) -> None:
        """One case of :meth:`check`."""
        got = self.caller(fn, self.name, *case.args, forbidden=tuple(self.forbidden))
        got = self.expect(got, case)
        want = self.reference(*case.args)
        if isinstance(want, (int, float)):
            want = as_number(want)
        diagnose = None
        if self.diagnose is not None:
            diagnose = lambda g, w=want, c=case: self.diagnose(g, w, c)  # noqa: E731
        expect_close(got, want, case.what or self.name, case.text, self.atol, self.rtol,
                     mistakes=self.mistakes(*case.args), diagnose=diagnose, show=self.show, legend=self.legend)
