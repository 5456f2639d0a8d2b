"""The autograder's verdicts, decided in a process the learner's code never ran in.

Where this sits: beside the pipeline, in the instructor's workflow. :class:`gptlab.course.execute.
GptlabExecute` runs a submitted notebook's cells in a Jupyter kernel, but not its test cells: for
each of them it asks :class:`TrustedGrader` (in the autograder's own process) for the verdict.

For one test cell (a task of :data:`gptlab.grading.tasks.TASKS`) the grader

1. refuses at once, without touching the kernel, a task whose answer calls a function that was
   already stopped at its time limit in an earlier test;
2. otherwise connects to the kernel (:func:`gptlab.grading.remote.serve`), looks up the learner's
   names, and runs the task's check here on handles to them: on the notebook's inputs, then on
   hidden inputs drawn from the instructor's secret (:mod:`gptlab.course.secret`);
3. reads the source the task's answer can reach for delegation
   (:func:`gptlab.grading.source.delegation`), against every entry point the check forbade;
4. flags the verdict for the instructor's review when the notebook holds what could switch off
   the runtime guard (:func:`gptlab.grading.source.guard_switches`) and the check forbade an entry
   point that only the guard stops (a fused PyTorch op: gptlab's own references are absent from
   the learner's sandbox whatever the guard does).

The :class:`Verdict` becomes the test cell's output (nbgrader then scores it: an error output
scores 0, anything else the cell's points) and its metadata ``gptlab.verdict``. What the
learner's code printed or warned is shown beside it and never scored.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..grading import core, remote, source
from ..grading.tasks import GradedCell, hidden_seed, task_for

__all__ = ["Verdict", "TrustedGrader", "learner_cells", "without_inputs"]

_SHOWS_INPUT = re.compile(r"^\s*(input|inputs|expected|got|largest difference|on input|for input|the input|arguments?)\b",
                          re.IGNORECASE)


def without_inputs(message: str) -> str:
    """A check's message without what shows the input it failed on (the ``input:``, ``expected``,
    ``got`` and ``largest difference`` lines, and the lines indented under them): what a learner
    sees of a failure on the hidden inputs, which must stay hidden."""
    out, skipping, depth = [], False, 0
    for line in message.splitlines():
        indent = len(line) - len(line.lstrip())
        if _SHOWS_INPUT.match(line):
            skipping, depth = True, indent
            continue
        if skipping and (indent > depth or not line.strip()):
            continue
        skipping = False
        out.append(line)
    if out:  # the first line names the call: `causal_mask(37) is wrong.` -> `causal_mask(...) is wrong.`
        out[0] = re.sub(r"(\w)\([^()]*\)", r"\1(...)", out[0])
    text = "\n".join(out).strip()
    return re.sub(r"\(([^()]*\b(tensor|shape|size)\b[^()]*)\)", "(...)", text) if text else "the answer is wrong"


@dataclass
class Verdict:
    """The outcome of one test cell: passed, the message (the check's diagnosis when it failed),
    its kind (``correct``, ``mistake``, ``delegation``, ``timeout``, ``crash``, ``missing``,
    ``grader_error``), what the learner's code printed while it was checked, and whether the
    instructor should review it (``review``)."""

    passed: bool
    message: str
    kind: str
    output: list[str] = field(default_factory=list)
    hung: str | None = None
    review: list[str] = field(default_factory=list)
    """Why the instructor should look at this test (the lines that could switch the guard off);
    empty when nothing needs a look."""

    @property
    def ename(self) -> str:
        return {"timeout": "CellTimeoutError", "crash": "DeadKernelError", "delegation": "DelegationError",
                "missing": "NameError"}.get(self.kind, "ExerciseError")


def learner_cells(cells) -> list[tuple[int, str, bool]]:
    """``(number, source, written by the learner)`` of a notebook's code cells (locked cells are the
    instructor's: their source is restored before grading)."""
    from ..notebook_setup import is_setup_source

    out = []
    for number, cell in enumerate(cells, 1):
        if cell.get("cell_type") != "code" or is_setup_source(cell.get("source", "")):
            continue
        meta = cell.get("metadata", {}).get("nbgrader", {})
        out.append((number, cell.get("source", ""), not (meta.get("locked") or meta.get("grade"))))
    return out


class TrustedGrader:
    """Verdicts for the test cells of one submitted notebook (see the module docstring)."""

    def __init__(self, cells, notebook: str, secret: bytes):
        self.notebook = notebook
        self.secret = secret
        self.program = source.Program(learner_cells(cells))
        self.switches = source.guard_switches(self.program)
        self.hung: dict[str, str] = {}  # learner name -> the note of its timeout

    def knows(self, grade_id: str) -> bool:
        return task_for(self.notebook, grade_id) is not None

    def grade(self, grade_id: str, connect: Callable[[], remote.Connection]) -> Verdict:
        """The verdict of test cell ``grade_id``; ``connect()`` starts the kernel's side when needed."""
        task = task_for(self.notebook, grade_id)
        assert task is not None
        label = task.names[0]
        reached = {name for cell, node in self.program.reachable(task.names) for name in source.bound_names(node)}
        for name in sorted(reached & set(self.hung)):
            return Verdict(False, f"{label} was not checked: it uses {name}, which was stopped earlier: "
                                  f"{self.hung[name]}", "timeout")
        conn = connect()
        try:
            verdict = self._run(task, label, grade_id, conn)
        finally:
            conn.done()
        return verdict

    def _review(self, verdict: Verdict, forbidden: list) -> Verdict:
        """``verdict`` flagged for review when the notebook could switch off the guard that stops
        what ``forbidden`` holds beyond gptlab's own entry points (absent from the sandbox)."""
        guarded = [f for f in forbidden if not str(getattr(f.target, "__module__", "") or "").startswith("gptlab.")]
        if self.switches and guarded and verdict.kind not in ("missing", "grader_error"):
            verdict.review = [f.text() for f in self.switches[:5]]
        return verdict

    def _run(self, task: GradedCell, label: str, grade_id: str, conn: remote.Connection) -> Verdict:
        handles = []
        for name in task.names:
            try:
                handles.append(conn.lookup(name))
            except NameError:
                return Verdict(False, f"{name} is not defined in your notebook: run the cell that defines it, and "
                                      f"keep the name {name} the notebook asks for.", "missing", conn.output)
            except core.ExerciseError as e:
                return self._failure(e, conn)
        printed = io.StringIO()
        visible_output = None
        core.record_forbidden(True)
        verdict = None
        try:
            with contextlib.redirect_stdout(printed):
                task.check(*handles, **task.visible)
                if task.hidden is not None:
                    visible_output = len(conn.output)  # what the hidden run prints is not shown (it shows its inputs)
                    try:
                        task.check(*handles, **task.hidden(hidden_seed(self.secret, self.notebook, grade_id)))
                    except core.ExerciseError as e:
                        if isinstance(e, remote.LearnerTimeout | remote.LearnerCrashed | core.DelegationError):
                            raise
                        raise core.ExerciseError(f"{without_inputs(str(e))}\n  (on the autograder's hidden inputs, "
                                                 "which are not shown: the notebook's own test passes, but the answer "
                                                 "does not hold in general; try sizes and values of your own)") from None
        except core.ExerciseError as e:
            verdict = self._failure(e, conn)
        except Exception as e:  # noqa: BLE001 - the check could not use the answer: a failed test, said plainly
            verdict = Verdict(False, f"{label} could not be checked: {type(e).__name__}: {e}", "mistake", conn.output)
        finally:
            forbidden = core.record_forbidden(False)
            if visible_output is not None and len(conn.output) > visible_output:
                del conn.output[visible_output:]
                conn.output.append("(what your code printed on the autograder's hidden inputs is not shown)")
        found = source.delegation(self.program, task.names, forbidden)
        if found:
            lines = "\n".join("  " + f.text() for f in found[:5])
            text = (f"{label} must be written by hand, but the code it runs uses what computes the answer for it:\n"
                    f"{lines}\nBuild it from basic tensor operations instead.")
            if verdict is not None and verdict.kind != "mistake":
                return self._review(verdict, forbidden)
            return Verdict(False, text + (f"\n(Also: {verdict.message})" if verdict else ""), "delegation",
                           conn.output)
        if verdict is not None:
            return self._review(verdict, forbidden)
        extra = printed.getvalue().strip()
        return self._review(Verdict(True, f"{label}: correct" + (f"\n{extra}" if extra else ""), "correct",
                                    conn.output), forbidden)

    def _failure(self, e: Exception, conn: remote.Connection) -> Verdict:
        if isinstance(e, remote.LearnerTimeout):
            name = (getattr(e, "label", None) or "").split(".")[0].split("(")[0]
            if name:
                self.hung[name] = str(e)
            return Verdict(False, str(e), "timeout", conn.output, hung=name or None)
        if isinstance(e, remote.LearnerCrashed):
            return Verdict(False, str(e), "crash", conn.output)
        if isinstance(e, core.DelegationError):
            return Verdict(False, str(e), "delegation", conn.output)
        return Verdict(False, str(e), "mistake", conn.output)

GRADE_EVERYTHING = True

GRADE_EVERYTHING = True
