"""The instructor's workflow, run by ``python -m gptlab course {release,collect,autograde,feedback,grades}``
(the commands' arguments are in :mod:`gptlab.cli`).

Where this sits: beside the pipeline (text -> tokens -> batches -> model -> logits -> loss |
samples -> text). Learners write pieces of that pipeline in nbgrader notebooks; these commands
hand the notebooks out, gather them back, grade them with the checks of :mod:`gptlab.grading`,
and return the feedback and the grades. They drive nbgrader (its Python API, in-process) with the
course's ``nbgrader_config.py`` and its SQLite gradebook:

* ``release [ASSIGNMENT ...]``: ``solutions/<a>/`` -> ``exercises/<a>/``, exactly what
  ``nbgrader generate_assignment`` makes (written beside and renamed into place).
* ``collect DIR``: submissions -> ``submitted/<student>/<a>/`` (:mod:`gptlab.course.collect`).
* ``autograde [ASSIGNMENT ...] --workers N``: students in parallel, a crash, hang, malformed
  or tampered notebook costing only the points it affects (:mod:`gptlab.course.autograde`).
* ``feedback [ASSIGNMENT ...]``: one HTML page per student and notebook, with the autograder's
  notes on top.
* ``grades``: a CSV, one row per student, a column per assignment and per test cell, the total;
  an empty cell where nothing was graded (not submitted, not graded yet), a 0 where it scored 0.

See ``book/instructors.md`` for the whole workflow, on one machine and on a JupyterHub.
"""

from __future__ import annotations

import csv
import html
import io
import re
import sys
import tempfile
from pathlib import Path

from ..files import atomic_write_text as atomic_write
from ._common import Course, CourseError, run_converter

__all__ = ["Course", "CourseError", "release", "feedback", "grades_table", "write_grades", "find_course"]


# --------------------------------------------------------------------------- release


def release(course: Course, assignments: list[str], progress: bool = True) -> list[Path]:
    """``nbgrader generate_assignment`` for each assignment; returns the release folders written.

    The release is generated into a scratch folder in the course and then renamed over
    ``exercises/<assignment>/``, so a failed run leaves the previous release as it was. The
    gradebook records each assignment (its cells and checksums), as nbgrader does.
    """
    from nbgrader.converters import GenerateAssignment
    from nbgrader.coursedir import CourseDirectory
    from tqdm.auto import tqdm

    release_dir = course.directory("release")
    release_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in tqdm(assignments, desc="release", unit="assignment", disable=not progress or None):
        with tempfile.TemporaryDirectory(prefix=".release-", dir=course.root) as tmp:
            cfg = course.config(**{"CourseDirectory.release_directory": tmp})
            coursedir = CourseDirectory(config=cfg)
            coursedir.assignment_id = name
            ok, log = run_converter(GenerateAssignment, coursedir, cfg, force=True, create_assignment=True)
            made = Path(tmp) / name
            if not ok or not made.is_dir():
                raise CourseError(f"nbgrader generate_assignment {name} failed:\n{log[-3000:]}")
            dest = release_dir / name
            if dest.exists():
                old = Path(tmp) / ".old"
                dest.rename(old)
            made.rename(dest)
        written.append(dest)
    return written


# --------------------------------------------------------------------------- feedback


_NOTES_MARK = "<!-- gptlab autograder notes -->"


def _notes_html(notes: list[dict]) -> str:
    items = "".join(f"<li>{html.escape(n['message'])}</li>" for n in notes)
    return (
        f"{_NOTES_MARK}<div class=\"gptlab-notes\" style=\"border:2px solid #b03a2e;background:#fdf2f0;"
        "padding:0.8em 1.2em;margin:1em auto;max-width:1000px;font-family:sans-serif\">"
        f"<h2 style=\"margin-top:0\">Notes from the autograder</h2><ul>{items}</ul></div>"
    )


def _inject(page: str, notes: list[dict]) -> str:
    page = re.sub(re.escape(_NOTES_MARK) + r"<div class=\"gptlab-notes\".*?</div>", "", page, flags=re.S)
    m = re.search(r"<body[^>]*>", page)
    at = m.end() if m else 0
    return page[:at] + _notes_html(notes) + page[at:]


def feedback(course: Course, assignments: list[str], students: list[str] | None = None,
             progress: bool = True) -> list[Path]:
    """HTML feedback per student and notebook (``nbgrader generate_feedback``), with the notes.

    A notebook nbgrader could not grade (malformed, missing, grader failure) gets a page of its
    own holding the notes. Returns the pages written.
    """
    from nbgrader.api import Gradebook, MissingEntry
    from nbgrader.converters import GenerateFeedback
    from nbgrader.coursedir import CourseDirectory
    from tqdm.auto import tqdm

    cfg = course.config()
    autograded, out_dir = course.directory("autograded"), course.directory("feedback")
    pages: list[Path] = []
    for name in assignments:
        who = sorted(p.name for p in autograded.iterdir() if (p / name).is_dir() and not p.name.startswith(".")) \
            if autograded.is_dir() else []
        notes_dir = autograded / ".gptlab" / name
        noted = sorted(p.stem for p in notes_dir.glob("*.json")) if notes_dir.is_dir() else []
        who = sorted(set(who) | set(noted))
        if students:
            who = [s for s in who if s in students]
        with Gradebook(course.gradebook_url) as gb:
            try:
                notebooks = [nb.name for nb in gb.find_assignment(name).notebooks]
            except MissingEntry:
                notebooks = []
        for student in tqdm(who, desc=f"feedback {name}", unit="student", disable=not progress or None):
            if (autograded / student / name).is_dir():
                coursedir = CourseDirectory(config=cfg)
                coursedir.assignment_id, coursedir.student_id = name, student
                ok, log = run_converter(GenerateFeedback, coursedir, cfg, force=True)
                if not ok:
                    print(f"feedback {name} for {student}: nbgrader failed:\n{log[-2000:]}", file=sys.stderr)
            notes = course.read_notes(name, student)
            for nb in notebooks:
                page = out_dir / student / name / f"{nb}.html"
                mine = [n for n in notes if n.get("notebook") in (nb, None)]
                if page.is_file():
                    if mine:
                        atomic_write(page, _inject(page.read_text(), mine))
                elif mine:
                    title = html.escape(f"{name} / {nb}: feedback for {student}")
                    atomic_write(page, f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{title}"
                                       f"</title></head><body><h1>{title}</h1><p>Score: 0</p></body></html>")
                    atomic_write(page, _inject(page.read_text(), mine))
                else:
                    continue
                pages.append(page)
    return pages


# --------------------------------------------------------------------------- grades


def grades_table(course: Course, assignments: list[str] | None = None) -> tuple[list[str], list[list]]:
    """The grade sheet: header and one row per student of the gradebook.

    Columns: ``student``, then for each assignment its total ``<assignment>`` and one column per
    test cell ``<assignment>/<grade_id>`` (``<assignment>/<notebook>/<grade_id>`` when the
    assignment has several notebooks), then ``total``. A score is a float; ``None`` (an empty
    cell in the CSV) where there is no score: an assignment the student never submitted or that
    was not graded yet, and its test cells (a test cell without a score in a graded submission
    too). A real 0 stays 0. An assignment's total and the overall total add up what was graded
    (``None`` when nothing was), less nbgrader's late penalty (the test cells keep their scores).
    The last column, ``notes``, names the test cells flagged for the instructor's review (their
    score is not final until a manual score is given), the late penalties (assignment, points
    taken, hours after the due date), and the assignments graded without the sandbox (``course
    autograde --no-sandbox``); ``None`` otherwise.
    """
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(course.gradebook_url) as gb:
        names = assignments or sorted(a.name for a in gb.assignments)
        layout = []  # (assignment, [(notebook, grade_id, column)])
        for name in names:
            try:
                a = gb.find_assignment(name)
            except MissingEntry:
                raise CourseError(f"assignment {name!r} is not in the gradebook {course.gradebook_url}") from None
            cells = []
            for nb in sorted(a.notebooks, key=lambda n: n.name):
                for g in nb.grade_cells:
                    col = f"{name}/{g.name}" if len(a.notebooks) == 1 else f"{name}/{nb.name}/{g.name}"
                    cells.append((nb.name, g.name, col))
            layout.append((name, cells))
        header = ["student"]
        for name, cells in layout:
            header += [name] + [col for _, _, col in cells]
        header += ["total", "notes"]
        rows = []
        for student in sorted(s.id for s in gb.students):
            row: list = [student]
            graded: list[float] = []
            review: list[str] = []
            unsandboxed: list[str] = []
            late: list[str] = []
            for name, cells in layout:
                scores: dict[tuple[str, str], float | None] = {}
                penalty = 0.0
                try:
                    sub = gb.find_submission(name, student)
                    for snb in sub.notebooks:
                        penalty += snb.late_submission_penalty or 0.0
                        for g in snb.grades:
                            # nbgrader's score is 0 when there is none: not graded yet is no score
                            none = g.auto_score is None and g.manual_score is None
                            scores[(snb.name, g.name)] = None if none else float(g.score or 0.0)
                            if g.needs_manual_grade and g.manual_score is None and g.auto_score is not None:
                                review.append(f"{name}/{g.name}")
                except MissingEntry:
                    pass
                if any(n.get("kind") == "no_sandbox" for n in course.read_notes(name, student)):
                    unsandboxed.append(name)
                values = [scores.get((nb, gid)) for nb, gid, _ in cells]
                got = [v for v in values if v is not None]
                if penalty:
                    late.append(f"{name} (-{penalty:g}, {sub.total_seconds_late / 3600:.1f} h after the due date)")
                row += [sum(got) - penalty if got else None] + values
                graded += got + ([-penalty] if got and penalty else [])
            row.append(sum(graded) if graded else None)
            notes = []
            if review:
                notes.append("needs review (score not final): " + ", ".join(review))
            if late:
                notes.append("late penalty: " + ", ".join(late))
            if unsandboxed:
                notes.append("graded without the sandbox: " + ", ".join(unsandboxed))
            row.append("; ".join(notes) or None)
            rows.append(row)
    return header, rows


def write_grades(course: Course, path: Path, assignments: list[str] | None = None) -> tuple[list[str], list[list]]:
    """Write the grade sheet (:func:`grades_table`) as CSV, atomically; no score is an empty cell."""
    header, rows = grades_table(course, assignments)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    for row in rows:
        w.writerow(["" if v is None else f"{v:g}" if isinstance(v, float) else v for v in row])
    atomic_write(Path(path), buf.getvalue())
    return header, rows


# --------------------------------------------------------------------------- the course folder


def find_course() -> Path:
    """The current folder or its nearest parent holding ``nbgrader_config.py``.

    There is no fallback (it used to be the installed package's checkout, so a command run from
    anywhere wrote that checkout's gradebook): without one, a :class:`CourseError` says what a
    course folder is and how to name it.
    """
    here = Path.cwd().resolve()
    for d in (here, *here.parents):
        if (d / "nbgrader_config.py").is_file():
            return d
    raise CourseError(
        f"no course folder at {here} or above it: a course folder holds nbgrader_config.py (and solutions/, "
        "exercises/, the gradebook); run the command inside one, or pass --course DIR"
    )
