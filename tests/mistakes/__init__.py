"""The catalogue of learners' mistakes, one module per assignment (``tests/mistakes/<assignment>.py``).

Each entry is a buggy implementation written the way a learner would write it: the whole source
of one solution cell of the assignment's notebook. The mutation test (``tests/test_mutations.py``)
puts every entry in place of the instructor's solution cell, runs the notebook's cells up to and
including the task's test cell, and asserts that the test cell fails with a message that names the
mistake (``says``). The nbgrader round trip plants some of them in submissions as well.

Notebook convention (every assignment follows it): a task ``f`` has one solution cell with
nbgrader ``grade_id`` ``solution_f`` and one or more graded test cells whose ``grade_id`` starts
with ``test_f``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mistake:
    """One buggy learner answer for one task, and what the grader must say about it."""

    task: str
    """The task (function) name: the solution cell with grade_id ``solution_<task>`` is replaced."""
    name: str
    """A short name for the mistake (used as the test id)."""
    code: str
    """The full replacement source of the solution cell."""
    says: str
    """A phrase the failing test cell's message must contain (the diagnosis)."""
    delegation: bool = False
    """True when the entry calls a forbidden reference (gptlab's, or the fused PyTorch op)."""


def catalogue(assignment: str) -> list[Mistake]:
    """The catalogue of ``assignment`` (``tests/mistakes/<assignment>.py``'s ``MISTAKES``)."""
    return list(importlib.import_module(f"{__name__}.{assignment}").MISTAKES)


def no_delegation(assignment: str) -> dict[str, str]:
    """Tasks of ``assignment`` with nothing to delegate to, each with the reason (a module's
    optional ``NO_DELEGATION``); every other task needs a delegation entry."""
    return dict(getattr(importlib.import_module(f"{__name__}.{assignment}"), "NO_DELEGATION", {}))


def assignments_with_catalogues() -> list[str]:
    """Names of the assignments that have a catalogue module here."""
    here = Path(__file__).parent
    return sorted(p.stem for p in here.glob("*.py") if p.stem != "__init__")
