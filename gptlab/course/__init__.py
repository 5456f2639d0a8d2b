"""The instructor's workflow: ``python -m gptlab course {release,collect,autograde,feedback,grades}``.

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

import argparse
import csv
import html
import io
import re
import sys
import tempfile
from pathlib import Path

from ..files import atomic_write_text as atomic_write
from ._common import Course, CourseError, run_converter

__all__ = ["Course", "CourseError", "release", "feedback", "grades_table", "write_grades", "register_cli"]


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
    (``None`` when nothing was).
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
        header.append("total")
        rows = []
        for student in sorted(s.id for s in gb.students):
            row: list = [student]
            graded: list[float] = []
            for name, cells in layout:
                scores: dict[tuple[str, str], float | None] = {}
                try:
                    sub = gb.find_submission(name, student)
                    for snb in sub.notebooks:
                        for g in snb.grades:
                            # nbgrader's score is 0 when there is none: not graded yet is no score
                            none = g.auto_score is None and g.manual_score is None
                            scores[(snb.name, g.name)] = None if none else float(g.score or 0.0)
                except MissingEntry:
                    pass
                values = [scores.get((nb, gid)) for nb, gid, _ in cells]
                got = [v for v in values if v is not None]
                row += [sum(got) if got else None] + values
                graded += got
            row.append(sum(graded) if graded else None)
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


# --------------------------------------------------------------------------- command line


def _course(args) -> Course:
    return Course(Path(args.course) if args.course else _find_course(), args.db)


def _find_course() -> Path:
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


def _friendly(fn):
    """Run a command; a CourseError is printed as one line and exit status 2, not a traceback."""

    def run(args) -> int:
        try:
            return fn(args)
        except (CourseError, ValueError) as e:
            print(f"python -m gptlab course: error: {e}", file=sys.stderr)
            return 2
        except (IsADirectoryError, NotADirectoryError) as e:  # a path given where the other kind is needed
            print(f"python -m gptlab course: error: {e.strerror}: {e.filename}", file=sys.stderr)
            return 2

    return run


def _cmd_release(args) -> int:
    course = _course(args)
    for dest in release(course, course.assignments(args.assignments), progress=not args.quiet):
        print(f"released {dest.relative_to(course.root)}")
    return 0


def _cmd_collect(args) -> int:
    from .collect import collect

    course = _course(args)
    got = collect(course, Path(args.dir), args.assignment, dry_run=args.dry_run)
    verb = "would collect" if args.dry_run else "collected"
    for student, name, src in got.copied:
        print(f"{verb} {student}/{name} <- {src}")
    for message in got.messages:
        print(message)
    for src, why in got.skipped:
        print(f"skipped {src}: {why}")
    print(f"{len(got.copied)} submission(s) {verb}, {len(got.skipped)} skipped")
    return 0


def _cmd_autograde(args) -> int:
    from .autograde import autograde, missing_summary

    course = _course(args)
    assignments = course.assignments(args.assignments)
    results = autograde(course, assignments, args.student or None, args.workers, args.timeout,
                        progress=not args.quiet)
    for r in sorted(results, key=lambda r: (r["assignment"], r["student"])):
        notes = f"  ({len(r['notes'])} note(s))" if r["notes"] else ""
        print(f"{r['assignment']}  {r['student']}: {r['total']:g}{notes}")
        for n in r["notes"]:
            print(f"    - {n['message']}")
    missing = missing_summary(course, assignments, results, args.student or None)
    if missing:
        print("missing:")
        for line in missing:
            print(f"  {line}")
    print(f"{len(results)} submission(s) graded into {course.gradebook_url}")
    return 0


def _cmd_feedback(args) -> int:
    course = _course(args)
    pages = feedback(course, course.assignments(args.assignments), args.student or None, progress=not args.quiet)
    print(f"{len(pages)} feedback page(s) in {course.directory('feedback')}")
    return 0


def _cmd_grades(args) -> int:
    course = _course(args)
    out = Path(args.output) if args.output else course.root / "grades.csv"
    if out.is_dir():
        raise CourseError(f"--output {out} is a folder: give a file path, e.g. --output {out / 'grades.csv'}")
    header, rows = write_grades(course, out, args.assignments or None)
    print(f"{len(rows)} student(s), {len(header) - 2} column(s) of scores -> {out}")
    return 0


def register_cli(subparsers) -> None:
    """Add ``course`` and its subcommands to ``python -m gptlab``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--course", metavar="DIR", default=None,
                        help="the course folder, holding nbgrader_config.py (default: the current folder "
                             "or the nearest parent with one; none found is an error)")
    common.add_argument("--db", metavar="URL_OR_PATH", default=None,
                        help="the gradebook (default: nbgrader_config.py's, gradebook.db in the course)")
    common.add_argument("--quiet", action="store_true", help="no progress bars")

    p = subparsers.add_parser("course", help="the instructor's workflow: release, collect, autograde, feedback, grades",
                              description="The instructor's workflow with nbgrader: release the exercises, collect the "
                              "submissions, autograde them, return feedback, export the grades. "
                              "See book/instructors.md.")
    sub = p.add_subparsers(dest="course_command", metavar="STEP")
    fmt = argparse.HelpFormatter

    r = sub.add_parser("release", parents=[common], formatter_class=fmt,
                       help="solutions/<a> -> exercises/<a> (nbgrader generate_assignment)",
                       description="Generate the learners' notebooks of each assignment (all by default) "
                                   "from solutions/ into exercises/, exactly as nbgrader generate_assignment does.")
    r.add_argument("assignments", nargs="*", metavar="ASSIGNMENT")
    r.set_defaults(func=_friendly(_cmd_release))

    c = sub.add_parser("collect", parents=[common], formatter_class=fmt,
                       help="copy submissions into submitted/<student>/<assignment>/",
                       description="Collect submissions from DIR: nbgrader's exchange inbound folder "
                                   "(<student>+<assignment>+<timestamp>+<random>/, the latest per student wins), "
                                   "or, with --assignment, a folder of <student>.ipynb files or <student>/ folders.")
    c.add_argument("dir", metavar="DIR")
    c.add_argument("--assignment", default=None, help="the assignment of a plain folder of submissions")
    c.add_argument("--dry-run", action="store_true", help="only say what would be collected")
    c.set_defaults(func=_friendly(_cmd_collect))

    a = sub.add_parser("autograde", parents=[common], formatter_class=fmt,
                       help="run the tests of every submission; scores into the gradebook",
                       description="Autograde the submissions in submitted/ (all assignments by default). "
                                   "A notebook that is malformed, crashes its kernel, loops or was tampered with "
                                   "costs only the points it affects, and gets a note in the feedback.")
    a.add_argument("assignments", nargs="*", metavar="ASSIGNMENT")
    a.add_argument("--student", action="append", metavar="ID", help="only this student (repeatable)")
    a.add_argument("--workers", type=int, default=1, help="students graded in parallel (one process each)")
    a.add_argument("--timeout", type=int, default=None,
                   help="time limit per cell in seconds (default: nbgrader_config.py's Execute.timeout); "
                        "cells declaring {\"gptlab\": {\"timeout\": S}} keep theirs")
    a.set_defaults(func=_friendly(_cmd_autograde))

    f = sub.add_parser("feedback", parents=[common], formatter_class=fmt,
                       help="HTML feedback per student, with the autograder's notes",
                       description="Write feedback/<student>/<assignment>/<notebook>.html for every autograded "
                                   "submission (nbgrader generate_feedback), with the autograder's notes on top.")
    f.add_argument("assignments", nargs="*", metavar="ASSIGNMENT")
    f.add_argument("--student", action="append", metavar="ID", help="only this student (repeatable)")
    f.set_defaults(func=_friendly(_cmd_feedback))

    g = sub.add_parser("grades", parents=[common], formatter_class=fmt,
                       help="grades CSV: a row per student, a column per assignment and test cell, the total",
                       description="Write the gradebook as CSV: one row per student; for each assignment its "
                                   "total and one column per test cell (<assignment>/<grade_id>); the total.")
    g.add_argument("assignments", nargs="*", metavar="ASSIGNMENT", help="default: every assignment in the gradebook")
    g.add_argument("--output", "-o", default=None, help="CSV path (default: grades.csv in the course folder)")
    g.set_defaults(func=_friendly(_cmd_grades))

    def _no_step(args) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=_no_step)

