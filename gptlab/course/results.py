"""Results of :func:`gptlab.course.grade_one.grade_one` merged into the course's gradebook.

Where this sits: beside the pipeline, in the instructor's workflow: ``python -m gptlab course
import-results FOLDER`` after grading on a cluster, in ``xargs -P`` lines or anywhere else, and
``course autograde`` after each of its own jobs (the same merge).

A result is merged only when it is one (:data:`~gptlab.course.grade_one.FORMAT`), its student is
known (in the gradebook or in ``submitted/``; ``add_students`` adds the others), its assignment is
in the gradebook, and its assignment version is the gradebook's (the same released notebook:
:func:`gptlab.course.grade_one.assignment_version`); anything else is named and skipped. Merging
sets the scores (so merging the same results twice changes nothing), the answer cells' comments,
the review flags (nbgrader's needs-manual-grade), the late penalty (nbgrader's, from the
submission's time, the due date and the course's ``LateSubmissionPlugin``), the notes shown in the feedback, and copies the
graded notebook (``RESULT.ipynb`` beside ``RESULT.json``) to ``autograded/`` for the feedback.
A manual score an instructor gave is never touched.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..files import atomic_write_text
from ._common import Course, CourseError
from .grade_one import FORMAT
from .notebooks import assignment_version, norm, quiet_sqlalchemy, released_text

__all__ = ["ImportReport", "assign_late_penalty", "import_results", "gradebook_version", "merge_result", "read_result"]


@dataclass
class ImportReport:
    """What :func:`import_results` did: the results merged, and the files it skipped with why."""

    merged: list[dict] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def gradebook_version(gb, assignment: str, notebook: str) -> str | None:
    """The version of ``notebook`` of ``assignment`` as the gradebook holds it (None: not there)."""
    from nbgrader.api import MissingEntry

    try:
        nb = gb.find_notebook(notebook, assignment)
    except MissingEntry:
        return None
    points = {c.name: float(c.max_score) for c in nb.grade_cells}
    return assignment_version([(c.name, points.get(c.name), norm(released_text(c.source)) if c.locked else None)
                               for c in nb.source_cells])


def read_result(path: Path) -> dict:
    """A result file's JSON, or ValueError saying why it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a readable JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a grade-one result (its format is {data.get('format') if isinstance(data, dict) else None!r}, "
                         f"expected {FORMAT!r})")
    for key in ("assignment", "notebook", "cells", "assignment_version"):
        if key not in data:
            raise ValueError(f"a grade-one result without {key!r}")
    if not isinstance(data["cells"], dict):
        raise ValueError("its 'cells' is not an object")
    return data


def merge_result(gb, course: Course, result: dict, notebook_file: Path | None = None) -> float:
    """Write one result (one notebook of one student's submission) into the gradebook ``gb`` and its
    notes beside it; returns the submission's total score. The caller has checked it
    (:func:`import_results`)."""
    assignment, student, nb_name = result["assignment"], result["student"], result["notebook"]
    gb.update_or_create_student(student)
    kwargs = {}
    if result.get("timestamp"):
        from nbgrader.utils import parse_utc

        try:  # naive UTC, as nbgrader stores it and compares it with the due date
            kwargs["timestamp"] = parse_utc(result["timestamp"])
        except (ValueError, OverflowError):
            pass
    sub = gb.update_or_create_submission(assignment, student, **kwargs)
    late_notebook = None
    for snb in sub.notebooks:
        if snb.name != nb_name:
            continue
        for grade in snb.grades:
            cell = result["cells"].get(grade.name)
            points = None if cell is None else cell.get("points")
            grade.auto_score = 0.0 if cell is None else (None if points is None else float(points))
            grade.needs_manual_grade = grade.manual_score is not None or grade.auto_score is None or bool(
                cell and cell.get("review"))
        for comment in snb.comments:
            comment.auto_comment = result.get("comments", {}).get(comment.name)
        late_notebook = snb
    gb.db.commit()
    if late_notebook is not None:
        assign_late_penalty(course, sub, late_notebook)
        gb.db.commit()
    notes_path = course.notes_path(assignment, student)
    old = course.read_notes(assignment, student)
    mine = [n for n in result.get("notes", []) if n.get("notebook") in (nb_name, None)]
    kept = [n for n in old if n.get("notebook") not in (nb_name, None)]
    atomic_write_text(notes_path, json.dumps(kept + mine, indent=1))
    if notebook_file is not None and notebook_file.is_file():
        dest = course.directory("autograded") / student / assignment / f"{nb_name}.ipynb"
        if notebook_file.resolve() != dest.resolve():
            dest.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(dest, notebook_file.read_text())
    return float(sum(g.score or 0.0 for snb in sub.notebooks for g in snb.grades)
                 - sum(snb.late_submission_penalty or 0.0 for snb in sub.notebooks))


def assign_late_penalty(course: Course, submission, notebook) -> float | None:
    """Set ``notebook``'s late penalty as ``nbgrader autograde`` does (its ``AssignLatePenalties``
    with the course's plugin: ``c.LateSubmissionPlugin.penalty_method = "zero"`` in
    ``nbgrader_config.py``, or a plugin of the instructor's own), from the submission's timestamp and
    the assignment's due date (``nbgrader db assignment add NAME --duedate=...``). None: no penalty
    (on time, no due date, or the plugin gives none); at most the notebook's score."""
    notebook.late_submission_penalty = None
    seconds_late = submission.total_seconds_late
    if not seconds_late or seconds_late <= 0:
        return None
    from nbgrader.preprocessors import AssignLatePenalties

    pre = AssignLatePenalties(config=course.config())
    pre.init_plugin()
    penalty = pre.plugin_inst.late_submission_penalty(submission.student.id, notebook.score, seconds_late)
    if penalty is not None:
        penalty = float(min(max(penalty, 0.0), notebook.score))
        notebook.late_submission_penalty = penalty
    return penalty


def _known_students(gb, course: Course) -> set[str]:
    known = {s.id for s in gb.students}
    folder = course.directory("submitted")
    if folder.is_dir():
        known |= {p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}
    return known


def import_results(course: Course, folder: str | Path, add_students: bool = False) -> ImportReport:
    """Merge every result file under ``folder`` (``*.json``, searched recursively) into the
    course's gradebook (see the module docstring). Returns what was merged and skipped."""
    from nbgrader.api import Gradebook, MissingEntry

    folder = Path(folder)
    if not folder.is_dir():
        raise CourseError(f"no folder {folder} (expected a folder of grade-one results, RESULT.json files)")
    quiet_sqlalchemy()
    report = ImportReport()
    paths = sorted(p for p in folder.rglob("*.json") if p.is_file())
    with Gradebook(course.gradebook_url) as gb:
        known = _known_students(gb, course)
        assignments = {a.name for a in gb.assignments}
        for path in paths:
            try:
                result = read_result(path)
            except ValueError as e:
                report.skipped.append((str(path), str(e)))
                continue
            student, assignment = result.get("student"), result["assignment"]
            if not student or not isinstance(student, str):
                report.skipped.append((str(path), "the result names no student (grade-one --student NAME)"))
                continue
            if assignment not in assignments:
                report.skipped.append((str(path), f"unknown assignment {assignment!r} (not in the gradebook: run "
                                                  "course release or course autograde first)"))
                continue
            if student not in known and not add_students:
                report.skipped.append((str(path), f"unknown student {student!r} (not in the gradebook nor in "
                                                  "submitted/; --add-students adds them)"))
                continue
            try:
                want = gradebook_version(gb, assignment, result["notebook"])
            except MissingEntry:
                want = None
            if want is None:
                report.skipped.append((str(path), f"the gradebook's {assignment!r} has no notebook {result['notebook']!r}"))
                continue
            if result["assignment_version"] != want:
                report.skipped.append((str(path), f"graded against another version of {assignment} "
                                                  f"({result['assignment_version']}, the gradebook's is {want}): "
                                                  "grade it again with the current release"))
                continue
            result["total"] = merge_result(gb, course, result, path.with_suffix(".ipynb"))
            report.merged.append(result)
            known.add(student)
    return report


def copy_results(results: list[tuple[Path, Path]]) -> None:
    """Copy (result file, destination) pairs (used to keep a run's results beside the course)."""
    for src, dest in results:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
