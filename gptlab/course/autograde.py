"""``course autograde``: students graded in parallel workers, one consistent SQLite gradebook.

How it works, once for the whole run:

1. The main gradebook gets every assignment of the run (nbgrader ``generate_assignment`` into a
   scratch release folder, if it is not there yet), then one read-only snapshot of it is taken.
2. Each (student, assignment) submission is one job for ONE pool of ``--workers`` processes that
   lasts the whole run (a process costs seconds to start: ``import torch``, nbgrader), started
   while step 1 runs; the longest assignments go first (the time limits their cells declare), so
   no worker is left alone with a long job at the end; each process gets its share of the cores
   for PyTorch. One worker grades in the main process. A job works in its own scratch folder, on
   its own copy of the snapshot gradebook, so no two processes ever write the same SQLite file:

   * *check*: each submitted notebook is read; one that is not valid JSON or not a notebook is
     left out (nbgrader then gives it 0) and noted. Locked cells (the test cells) that were
     deleted are put back from the gradebook, edited ones are noted (nbgrader runs the released
     version, hidden tests included), nbgrader metadata the learner changed is restored, and the
     ``gptlab`` time-limit metadata is taken from the instructor's notebook.
   * *grade*: nbgrader's ``Autograde`` runs each notebook (``GptlabExecute``: per-cell time
     limits, kernel restarts), writing ``autograded/<student>/<assignment>/``.
   * *report*: the scores are read back from the job's gradebook, and the timeouts and kernel
     deaths found in the autograded notebook become notes.

3. The main process alone writes each job's scores into the main gradebook (one grade per test
   cell), as the jobs finish, and the notes to ``autograded/.gptlab/<assignment>/<student>.json``;
   ``feedback`` puts them in the student's HTML. A job that fails as a whole gives that student 0
   and a note; a worker process that dies costs only the job it was running (retried once, alone).
4. :func:`missing_summary`: the students with no submission of an assignment, and the graded
   ones with a notebook missing (``course autograde`` prints it at the end).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..files import atomic_write_text as atomic_write
from ._common import Course, CourseError, run_converter

__all__ = ["autograde", "check_notebook", "grade_student", "missing_summary"]


# --------------------------------------------------------------------------- the reference cells


def _reference(gb, assignment: str, notebook: str) -> dict:
    """What the gradebook knows of a notebook's nbgrader cells, in the source notebook's order."""
    nb = gb.find_notebook(notebook, assignment)
    grade_cells = {c.name: c for c in nb.grade_cells}
    solution = {c.name for c in nb.solution_cells}
    cells = {}
    for c in nb.source_cells:
        cells[c.name] = {
            "name": c.name,
            "cell_type": c.cell_type,
            "source": c.source,
            "checksum": c.checksum,
            "locked": bool(c.locked),
            "grade": c.name in grade_cells,
            "solution": c.name in solution,
            "points": float(grade_cells[c.name].max_score) if c.name in grade_cells else None,
        }
    return cells


def _source_order_and_meta(course: Course, assignment: str, notebook: str) -> tuple[list[str], dict]:
    """grade_ids in the instructor's notebook order, and each one's ``gptlab`` cell metadata."""
    import nbformat

    path = course.directory("source") / assignment / f"{notebook}.ipynb"
    order, meta = [], {}
    if path.is_file():
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if gid:
                order.append(gid)
                if "gptlab" in cell.metadata:
                    meta[gid] = json.loads(json.dumps(cell.metadata["gptlab"]))
    return order, meta


def _released_text(source: str) -> str:
    """A locked cell's source as the learners received it: the hidden tests removed."""
    from nbformat.notebooknode import NotebookNode
    from nbgrader.preprocessors import ClearHiddenTests

    cell = NotebookNode(cell_type="code", source=source, metadata=NotebookNode())
    ClearHiddenTests()._remove_hidden_test_region(cell)
    return cell.source


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _read_notebook(path: Path, notebook: str, note):
    """The notebook at ``path``, or None (with a ``malformed`` note) where it is not UTF-8 text,
    not JSON or not a valid Jupyter notebook."""
    import nbformat

    try:
        text = path.read_bytes().decode("utf-8")
        json.loads(text)
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
    except UnicodeDecodeError as e:
        note("malformed", f"{notebook}.ipynb is not UTF-8 text (byte {e.start}), so it could not be graded: "
                          "every test in it scored 0.")
        return None
    except json.JSONDecodeError as e:
        note("malformed", f"{notebook}.ipynb is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}), "
                          "so it could not be graded: every test in it scored 0.")
        return None
    except Exception as e:  # noqa: BLE001 (nbformat raises several kinds)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        note("malformed", f"{notebook}.ipynb is not a valid Jupyter notebook ({first[:200]}), so it could not "
                          "be graded: every test in it scored 0.")
        return None
    return nb


def _repair_cells(nb, reference: dict, gptlab_meta: dict, note) -> None:
    """Restore each graded cell's type, nbgrader settings and (locked) released text; a cell with an
    unknown or repeated id becomes an ordinary cell. Only the instructor's time limits are kept."""
    import nbformat

    seen: dict[str, int] = {}
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("gptlab", None)  # time limits come from the instructor's notebook only
        meta = cell.metadata.get("nbgrader")
        if not isinstance(meta, dict):
            cell.metadata.pop("nbgrader", None)
            continue
        gid = meta.get("grade_id")
        if gid not in reference or gid in seen:
            # unknown or duplicated id: the cell becomes an ordinary cell
            cell.metadata.pop("nbgrader", None)
            if gid in seen and reference.get(gid, {}).get("locked"):
                note("duplicate", f"a copy of the cell {gid} was found and run as an ordinary cell.", gid)
            continue
        seen[gid] = i
        ref = reference[gid]
        if cell.cell_type != ref["cell_type"]:
            note("edited", f"the cell {gid} had been changed to a {cell.cell_type} cell; it was run as the "
                           f"{ref['cell_type']} cell it is.", gid)
            maker = nbformat.v4.new_code_cell if ref["cell_type"] == "code" else nbformat.v4.new_markdown_cell
            cell = nb.cells[i] = maker(source=cell.source, metadata=cell.metadata)
        fixed = {"grade": ref["grade"], "solution": ref["solution"], "locked": ref["locked"], "grade_id": gid,
                 "schema_version": 3, "task": False}
        if ref["points"] is not None:
            fixed["points"] = ref["points"]
        changed = any(meta.get(k) != v for k, v in fixed.items() if k not in ("schema_version", "task"))
        cell.metadata["nbgrader"] = {**meta, **fixed}
        if changed and ref["locked"]:
            note("edited", f"the nbgrader settings of the cell {gid} had been changed; they were restored.", gid)
        if ref["locked"] and _norm(cell.source) != _norm(_released_text(ref["source"])):
            kind = "test cell" if ref["grade"] else "read-only cell"
            note("edited", f"the {kind} {gid} had been edited; the released version was run instead.", gid)
        if gid in gptlab_meta:
            cell.metadata["gptlab"] = gptlab_meta[gid]


def _restore_missing(nb, reference: dict, order: list[str], gptlab_meta: dict, note) -> None:
    """Put back the locked cells that are missing, each where the source has it; note the missing
    answer cells."""
    import nbformat

    ids = order or list(reference)
    for k, gid in enumerate(ids):
        ref = reference.get(gid)
        if ref is None:
            continue
        present = any(c.metadata.get("nbgrader", {}).get("grade_id") == gid for c in nb.cells)
        if present:
            continue
        if not ref["locked"]:
            if ref["solution"]:
                note("missing", f"the answer cell {gid} was not in the notebook; the tests that need it scored 0.", gid)
            continue
        md = {"nbgrader": {"grade": ref["grade"], "grade_id": gid, "locked": True, "schema_version": 3,
                           "solution": ref["solution"], "task": False, "checksum": ref["checksum"]},
              "deletable": False, "editable": False}
        if ref["points"] is not None:
            md["nbgrader"]["points"] = ref["points"]
        if gid in gptlab_meta:
            md["gptlab"] = gptlab_meta[gid]
        if ref["cell_type"] == "code":
            new = nbformat.v4.new_code_cell(source=ref["source"], metadata=md)
        else:
            new = nbformat.v4.new_markdown_cell(source=ref["source"], metadata=md)
        def where(gid_):
            return next((j for j, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade_id") == gid_),
                        None)

        # just before the next cell of the source that is there (after the task's other cells),
        # else just after the previous one, else at the end
        nxt = [j for j in (where(g) for g in ids[k + 1:]) if j is not None]
        prv = [j for j in (where(g) for g in ids[:k]) if j is not None]
        pos = nxt[0] if nxt else (prv[-1] + 1 if prv else len(nb.cells))
        nb.cells.insert(pos, new)
        kind = "test cell" if ref["grade"] else "read-only cell"
        note("deleted", f"the {kind} {gid} was missing from the notebook; it was put back and run.", gid)


def check_notebook(path: Path, reference: dict, order: list[str], gptlab_meta: dict, notebook: str) -> tuple[object, list[dict]]:
    """Read a submitted notebook and repair what nbgrader cannot: returns (notebook or None, notes).

    ``None`` means the file is not a readable notebook (then nbgrader grades it as missing: 0).
    """
    notes: list[dict] = []

    def note(kind: str, message: str, cell: str | None = None) -> None:
        notes.append({"notebook": notebook, "cell": cell, "kind": kind, "message": message})

    nb = _read_notebook(path, notebook, note)
    if nb is None:
        return None, notes
    _repair_cells(nb, reference, gptlab_meta, note)
    _restore_missing(nb, reference, order, gptlab_meta, note)
    for cell in nb.cells:  # nbformat 4.5 cell ids, unique
        cell.pop("id", None)
    nb.nbformat_minor = 4
    return nb, notes


# --------------------------------------------------------------------------- one student (worker)


def _cell_label(cell) -> str:
    gid = cell.metadata.get("nbgrader", {}).get("grade_id")
    if gid:
        return gid
    first = next((line for line in cell.source.splitlines() if line.strip()), "")
    return f"the cell starting `{first[:60]}`"


def _events(autograded_nb: Path, notebook: str) -> list[dict]:
    """Notes for the cells the runner had to stop: timeouts, kernel deaths, cells not run."""
    import nbformat

    notes = []
    nb = nbformat.read(autograded_nb, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") != "error":
                continue
            ename = out.get("ename")
            if ename in ("CellTimeoutError", "DeadKernelError", "NotRun"):
                kind = {"CellTimeoutError": "timeout", "DeadKernelError": "kernel_died", "NotRun": "not_run"}[ename]
                notes.append({"notebook": notebook, "cell": cell.metadata.get("nbgrader", {}).get("grade_id"),
                              "kind": kind, "message": f"{_cell_label(cell)}: {out.get('evalue', '')}"})
                break
    return notes


def _cell_times(autograded_nb: Path) -> dict[str, float]:
    """grade_id -> seconds the cell ran, from nbclient's recorded timing (solution cells), or for a
    test cell graded by the trusted grader the seconds its verdict took (``gptlab.verdict.seconds``)."""
    from datetime import datetime

    import nbformat

    times = {}
    nb = nbformat.read(autograded_nb, as_version=4)
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        ex = cell.metadata.get("execution", {})
        if gid and "iopub.execute_input" in ex and "shell.execute_reply" in ex:
            t0 = datetime.fromisoformat(ex["iopub.execute_input"].replace("Z", "+00:00"))
            t1 = datetime.fromisoformat(ex["shell.execute_reply"].replace("Z", "+00:00"))
            times[gid] = (t1 - t0).total_seconds()
        verdict = cell.metadata.get("gptlab", {}).get("verdict", {})
        if gid and "seconds" in verdict:
            times[gid] = float(verdict["seconds"])
    return times


def _reviews(autograded_nb: Path) -> dict[str, list[str]]:
    """grade_id -> why the instructor should review it (``gptlab.verdict.review``), for the test
    cells the trusted grader flagged."""
    import nbformat

    out = {}
    nb = nbformat.read(autograded_nb, as_version=4)
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        review = cell.metadata.get("gptlab", {}).get("verdict", {}).get("review")
        if gid and review:
            out[gid] = [str(x) for x in review]
    return out


def _quiet_sqlalchemy() -> None:
    """nbgrader 0.9's gradebook code makes SQLAlchemy 2 warn that cascaded objects are "not in
    session" when a submission is created; the rows are written all the same (the tests count them)."""
    import warnings

    from sqlalchemy.exc import SAWarning

    warnings.filterwarnings("ignore", category=SAWarning)


def _stage_notebooks(course: Course, assignment: str, staged: Path, notebooks: list[str], references: dict,
                     result: dict) -> None:
    """Make the staged submission gradable: files other than the notebooks removed, each notebook
    checked and repaired (:func:`check_notebook`); one missing or unreadable goes to ``failed``."""
    import nbformat

    notes = result["notes"]
    extra = _keep_only_notebooks(staged, notebooks)
    if extra:
        notes.append({"notebook": None, "cell": None, "kind": "ignored_files",
                      "message": f"not graded and not present while grading: {', '.join(extra)} (only the "
                                 "assignment's notebooks are; code in other files would not be in the notebook)."})
    for nb_name in notebooks:
        path = staged / f"{nb_name}.ipynb"
        if not path.is_file():
            notes.append({"notebook": nb_name, "cell": None, "kind": "missing",
                          "message": f"{nb_name}.ipynb was not submitted: every test in it scored 0."})
            result["failed"].append(nb_name)
            continue
        order, meta = _source_order_and_meta(course, assignment, nb_name)
        nb, found = check_notebook(path, references[nb_name], order, meta, nb_name)
        notes.extend(found)
        if nb is None:
            path.unlink()
            result["failed"].append(nb_name)
            continue
        nbformat.write(nb, path)


def _run_autograde(cfg, student: str, notebooks: list[str], autograded: Path, result: dict) -> None:
    """nbgrader's Autograde on each notebook not failed yet: the runner's notes and the cell times
    into ``result``; a notebook it cannot grade goes to ``failed``, with the log's tail."""
    from nbgrader.converters import Autograde
    from nbgrader.coursedir import CourseDirectory

    assignment, notes = result["assignment"], result["notes"]
    for nb_name in notebooks:
        if nb_name in result["failed"]:
            continue
        coursedir = CourseDirectory(config=cfg)
        coursedir.assignment_id, coursedir.student_id, coursedir.notebook_id = assignment, student, nb_name
        ok, log = run_converter(Autograde, coursedir, cfg, force=True, create_student=True)
        out = autograded / f"{nb_name}.ipynb"
        if not ok or not out.is_file():
            last = [line for line in log.strip().splitlines() if line.strip()][-1:] or ["unknown error"]
            notes.append({"notebook": nb_name, "cell": None, "kind": "grader_error",
                          "message": f"the autograder could not run {nb_name}.ipynb ({last[0][:300]}): every test "
                                     "in it scored 0."})
            result["failed"].append(nb_name)
            result["log"] += log[-4000:]
            continue
        notes.extend(_events(out, nb_name))
        result["times"][nb_name] = _cell_times(out)
        flagged = _reviews(out)
        if flagged:
            result.setdefault("review", {})[nb_name] = flagged
            for gid, why in flagged.items():
                notes.append({"notebook": nb_name, "cell": gid, "kind": "review", "message": (
                    f"{gid} is flagged for the instructor's review (its score is not final): the notebook holds "
                    f"code that could switch off the grader's check of which functions the answer calls: "
                    f"{'; '.join(why[:3])}")})


def _read_scores(db_url: str, result: dict) -> None:
    """The scores, comments and late penalties of the graded notebooks, read back from the job's
    gradebook into ``result`` (with the submission's timestamp)."""
    from nbgrader.api import Gradebook

    with Gradebook(db_url) as gb:
        try:
            sub = gb.find_submission(result["assignment"], result["student"])
        except Exception:  # noqa: BLE001 (MissingEntry: nothing could be graded)
            sub = None
        if sub is not None:
            result["timestamp"] = sub.timestamp.isoformat() if sub.timestamp else None
            for snb in sub.notebooks:
                if snb.name in result["failed"]:
                    continue
                result["notebooks"][snb.name] = {
                    "grades": {g.name: g.auto_score for g in snb.grades},
                    "comments": {c.name: c.auto_comment for c in snb.comments},
                    "late_penalty": snb.late_submission_penalty,
                }


def grade_student(job: dict) -> dict:
    """Autograde one student's submission of one assignment (runs in a worker process).

    ``job``: course root, db_url of the main gradebook (for the config), snapshot path, scratch
    folder, assignment, student, per-cell timeout or None. Returns the scores read back from the
    job's own gradebook, notes, per-cell times and the log of any failure.
    """
    from nbgrader.api import Gradebook

    _quiet_sqlalchemy()
    t0 = time.perf_counter()
    course = Course(job["root"], job["db_url"])
    assignment, student = job["assignment"], job["student"]
    scratch = Path(tempfile.mkdtemp(prefix=f"{student}-", dir=job["scratch"]))
    db = scratch / "gradebook.db"
    shutil.copyfile(job["snapshot"], db)
    db_url = f"sqlite:///{db}"
    submitted = course.directory("submitted") / student / assignment
    staged = scratch / "submitted" / student / assignment
    shutil.copytree(submitted, staged, symlinks=True, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    autograded = course.directory("autograded") / student / assignment
    if autograded.exists():
        shutil.rmtree(autograded)

    notes: list[dict] = []
    result = {"assignment": assignment, "student": student, "notebooks": {}, "notes": notes, "times": {},
              "failed": [], "log": ""}
    with Gradebook(db_url) as gb:
        notebooks = [nb.name for nb in gb.find_assignment(assignment).notebooks]
        references = {nb: _reference(gb, assignment, nb) for nb in notebooks}
    _stage_notebooks(course, assignment, staged, notebooks, references, result)

    overrides = {"CourseDirectory.db_url": db_url, "CourseDirectory.submitted_directory": str(scratch / "submitted"),
                 "GptlabExecute.sandbox": bool(job.get("sandbox", True))}
    if not job.get("sandbox", True):
        notes.append({"notebook": None, "cell": None, "kind": "no_sandbox", "message": (
            "graded WITHOUT the autograder's sandbox (course autograde --no-sandbox): the notebook ran as the "
            "instructor, with the instructor's files, processes and network.")})
    if job.get("timeout"):
        overrides["Execute.timeout"] = int(job["timeout"])
    cfg = course.config(**overrides)
    _run_autograde(cfg, student, notebooks, autograded, result)
    _read_scores(db_url, result)
    result["seconds"] = time.perf_counter() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    return result


_NBGRADER_FILES = {"timestamp.txt"}
"""Files nbgrader itself keeps in a submission folder (the submission time)."""


def _keep_only_notebooks(folder: Path, notebooks: list[str]) -> list[str]:
    """Remove from the staged submission ``folder`` everything but the assignment's notebooks and
    nbgrader's own files; returns what was removed (sorted names, folders with a ``/``).

    The kernel runs in this folder, where a learner's ``evil.py``, ``torch.py``, ``gptlab/`` or
    ``sitecustomize.py`` would be importable: code the source scan never sees."""
    keep = {f"{nb}.ipynb" for nb in notebooks} | _NBGRADER_FILES
    removed = []
    for entry in sorted(folder.iterdir()):
        if entry.name in keep and entry.is_file() and not entry.is_symlink():
            continue
        removed.append(entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else ""))
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return removed


# --------------------------------------------------------------------------- the main process


def _ensure_assignment(course: Course, assignment: str) -> None:
    """Put the assignment in the main gradebook (nbgrader generate_assignment into a scratch folder)."""
    from nbgrader.api import Gradebook, MissingEntry
    from nbgrader.converters import GenerateAssignment
    from nbgrader.coursedir import CourseDirectory

    url = course.gradebook_url
    with Gradebook(url) as gb:
        try:
            a = gb.find_assignment(assignment)
            if a.notebooks:
                return
        except MissingEntry:
            pass
    with tempfile.TemporaryDirectory(prefix="gptlab-release-") as tmp:
        cfg = course.config(**{"CourseDirectory.release_directory": tmp})
        coursedir = CourseDirectory(config=cfg)
        coursedir.assignment_id = assignment
        ok, log = run_converter(GenerateAssignment, coursedir, cfg, force=True, create_assignment=True)
    if not ok:
        raise CourseError(f"nbgrader generate_assignment {assignment} failed:\n{log[-3000:]}")


def _merge(gb, result: dict) -> float:
    """Write one job's scores into the main gradebook (this process only). Returns the total."""
    from datetime import datetime

    assignment, student = result["assignment"], result["student"]
    gb.update_or_create_student(student)
    kwargs = {}
    if result.get("timestamp"):
        kwargs["timestamp"] = datetime.fromisoformat(result["timestamp"])
    sub = gb.update_or_create_submission(assignment, student, **kwargs)
    total = 0.0
    flagged = result.get("review") or {}
    for snb in sub.notebooks:
        got = result["notebooks"].get(snb.name)
        for grade in snb.grades:
            auto = got["grades"].get(grade.name) if got else 0.0
            grade.auto_score = auto if auto is not None else (0.0 if not got else None)
            review = grade.name in flagged.get(snb.name, {})
            grade.needs_manual_grade = grade.manual_score is not None or grade.auto_score is None or review
        for comment in snb.comments:
            comment.auto_comment = got["comments"].get(comment.name) if got else None
        snb.late_submission_penalty = got["late_penalty"] if got else None
    gb.db.commit()
    for snb in sub.notebooks:
        total += sum(g.score or 0.0 for g in snb.grades)
    return total


def submitted_students(course: Course, assignment: str) -> list[str]:
    folder = course.directory("submitted")
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / assignment).is_dir() and not p.name.startswith("."))


def _weight(course: Course, assignment: str) -> float:
    """How long one submission of an assignment may take, roughly, to start the longest first:
    the time limits its instructor's cells declare (the graded training of ``gpt_training``),
    then its number of graded and answer cells."""
    total = 0.0
    for path in sorted((course.directory("source") / assignment).glob("*.ipynb")):
        order, meta = _source_order_and_meta(course, assignment, path.stem)
        total += len(order) + sum(float(m.get("timeout", 0) or 0) for m in meta.values() if isinstance(m, dict))
    return total


def autograde(course: Course, assignments: list[str], students: list[str] | None = None, workers: int = 1,
              timeout: int | None = None, progress: bool = True, sandbox: bool = True) -> list[dict]:
    """Autograde every (or the named) student's submission of each assignment; see the module doc.

    Every kernel runs in the operating-system sandbox (:mod:`gptlab.course.sandbox`); where none
    can start, a :class:`CourseError` says why and how to fix it, unless ``sandbox=False`` (the
    instructor's ``--no-sandbox``), which every result's notes then record.

    Returns one result per (assignment, student), in the order of ``assignments`` then students:
    scores, notes, cell times, total.
    """
    from nbgrader.api import Gradebook
    from tqdm.auto import tqdm

    _quiet_sqlalchemy()
    if workers < 1:
        raise CourseError(f"--workers must be at least 1, got {workers}")
    if sandbox:
        from .sandbox import REFUSAL, unavailable

        why = unavailable()
        if why:
            raise CourseError(REFUSAL.format(why=why))
    plan = []
    for assignment in assignments:
        who = submitted_students(course, assignment)
        if students:
            missing = [s for s in students if s not in who]
            if missing:
                print(f"{assignment}: no submission from {', '.join(missing)}", file=sys.stderr)
            who = [s for s in who if s in students]
        if not who:
            print(f"{assignment}: nothing submitted in {course.directory('submitted')}/*/{assignment}", file=sys.stderr)
            continue
        plan.append((assignment, who))
    if not plan:
        return []
    if not course.gradebook_url.startswith("sqlite:///"):
        raise CourseError(f"course autograde needs a SQLite gradebook (sqlite:///PATH), got {course.gradebook_url}")
    rank = {a: k for k, a in enumerate(assignments)}
    weight = {a: _weight(course, a) for a, _ in plan}
    results = []
    with tempfile.TemporaryDirectory(prefix="gptlab-autograde-") as scratch:
        snapshot = Path(scratch) / "snapshot.db"

        def prepare() -> None:
            # every assignment in the main gradebook, then one snapshot for every job of the run
            for assignment, _ in plan:
                _ensure_assignment(course, assignment)
            shutil.copyfile(course.gradebook_url[len("sqlite:///"):], snapshot)

        jobs = [{"root": str(course.root), "db_url": course.db_url, "snapshot": str(snapshot), "scratch": scratch,
                 "assignment": assignment, "student": s, "timeout": timeout, "sandbox": sandbox}
                for assignment, who in plan for s in who]
        # the longest submissions first, so that no worker is left with a long one at the end
        jobs.sort(key=lambda j: (-weight[j["assignment"]], rank[j["assignment"]], j["student"]))
        bar = tqdm(total=len(jobs), desc="autograde", unit="submission", disable=not progress or None)
        gb = None
        try:
            for res in _run_jobs(jobs, workers, prepare):
                if gb is None:
                    gb = Gradebook(course.gradebook_url)
                res["total"] = _merge(gb, res)
                atomic_write(course.notes_path(res["assignment"], res["student"]), json.dumps(res["notes"], indent=1))
                results.append(res)
                bar.set_postfix_str(f"{res['assignment']} {res['student']}: {res['total']:g}")
                bar.update()
        finally:
            if gb is not None:
                gb.close()
            bar.close()
    results.sort(key=lambda r: (rank[r["assignment"]], r["student"]))
    return results


def missing_summary(course: Course, assignments: list[str], results: list[dict],
                    students: list[str] | None = None) -> list[str]:
    """What an autograde run could not grade, one line per assignment and kind, for the summary:
    the students (of the gradebook or of ``submitted/``; only the named ones with ``students``)
    with no submission of an assignment, and the graded students with a notebook missing (their
    results' notes of kind ``missing`` on a whole notebook)."""
    from nbgrader.api import Gradebook

    if students:
        roster = set(students)
    else:
        roster = set()
        url = course.gradebook_url
        if not url.startswith("sqlite:///") or Path(url[len("sqlite:///"):]).is_file():
            with Gradebook(url) as gb:
                roster = {s.id for s in gb.students}
        folder = course.directory("submitted")
        if folder.is_dir():
            roster |= {p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}
    lines = []
    for assignment in assignments:
        handed_in = set(submitted_students(course, assignment))
        absent = sorted(roster - handed_in)
        if absent:
            lines.append(f"{assignment}: no submission from {', '.join(absent)}")
        lacking = {}
        for r in results:
            if r["assignment"] != assignment:
                continue
            gone = [n["notebook"] for n in r["notes"]
                    if n.get("kind") == "missing" and n.get("cell") is None and n.get("notebook")]
            if gone:
                lacking[r["student"]] = gone
        if lacking:
            lines.append(f"{assignment}: notebook(s) missing from " + ", ".join(
                f"{s} ({', '.join(f'{nb}.ipynb' for nb in nbs)})" for s, nbs in sorted(lacking.items())))
    return lines


def _failed_job(job: dict, why: str) -> dict:
    return {"assignment": job["assignment"], "student": job["student"], "notebooks": {}, "failed": ["*"],
            "times": {}, "log": why, "seconds": 0.0,
            "notes": [{"notebook": None, "cell": None, "kind": "grader_error",
                       "message": f"the autograder itself failed on this submission ({why}): it scored 0."}]}


# --------------------------------------------------------------------------- the pool of workers


def _worker_start(threads: int) -> None:
    """A worker process's start: its share of the cores for PyTorch (its own checks, and the
    kernels it starts, which inherit the environment), and the imports every job needs, done once."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # unless set by the instructor
        os.environ.setdefault(var, str(threads))
    import torch

    try:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    except ValueError:
        torch.set_num_threads(threads)
    import nbgrader.api  # noqa: F401
    import nbgrader.converters  # noqa: F401

    from . import execute  # noqa: F401
    _quiet_sqlalchemy()


def _started() -> None:
    """Nothing: submitted to a new pool, it says when a worker process is ready."""


def _work(job: dict, marker: str) -> dict:
    """One job in a worker: leaves ``marker`` (the job has started), then grades it."""
    Path(marker).touch()
    return grade_student(job)


def _stop(pool) -> None:
    """Shut a pool down without waiting for processes that are still starting (no job runs):
    the idle ones exit, the others are stopped."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # shutdown forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + 1
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(10)


_END = object()


class _Feeder(threading.Thread):
    """Keeps the pool's processes busy with the run's jobs, in a thread of the main process, and
    puts each result in ``out`` (then ``_END``). A pool broken by a dying process is replaced:
    the jobs that had not started go on in a new pool of ``size``; those that had started are
    retried once, one at a time; a job that kills its process again gets ``_failed_job``."""

    def __init__(self, pool, ready: list, size: int, todo: collections.deque, lock: threading.Lock, ctx,
                 threads: int, marks: str):
        super().__init__(name="gptlab-autograde-feeder", daemon=True)
        self.pool, self.ready, self.size, self.todo, self.lock = pool, ready, size, todo, lock
        self.ctx, self.threads, self.marks = ctx, threads, Path(marks)
        self.out: queue.Queue = queue.Queue()
        self.warm = threading.Event()  # a process of the first pool is ready: the main process stops grading
        self.halt = threading.Event()
        self.error: BaseException | None = None
        self.count = 0

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 (handed to the main thread)
            self.error = e
        finally:
            self.out.put(_END)

    def _take(self, source: list | collections.deque):
        with self.lock:
            return source.popleft() if isinstance(source, collections.deque) and source else \
                (source.pop(0) if source else None)

    def _run(self) -> None:
        suspects: list[dict] = []
        pool, ready, size, alone = self.pool, self.ready, self.size, False
        fruitless = 0
        while True:
            broken, died = self._generation(pool, ready, size, suspects if alone else self.todo)
            _stop(pool)
            if self.halt.is_set():
                return
            started = [job for job, marker in broken if marker.exists()]
            waiting = [job for job, marker in broken if not marker.exists()]
            if alone:
                suspects[:0] = waiting
                for job in started:
                    self.out.put(_failed_job(job, "the grading process died"))
            else:
                with self.lock:
                    self.todo.extendleft(reversed(waiting))
                suspects += started
            fruitless = fruitless + 1 if died and not started else 0
            with self.lock:
                left = len(self.todo)
            if fruitless >= 2:  # the processes die before any job starts
                with self.lock:
                    rest = list(self.todo) + suspects
                    self.todo.clear()
                for job in rest:
                    self.out.put(_failed_job(job, "the grading processes died before it could start"))
                return
            if left:
                alone, size = False, min(self.size, left)
            elif suspects:
                alone, size = True, 1
            else:
                return
            self.warm.set()
            pool, ready = self._pool(size), None

    def _pool(self, size: int):
        return cf.ProcessPoolExecutor(max_workers=size, mp_context=self.ctx, initializer=_worker_start,
                                      initargs=(self.threads,))

    def _generation(self, pool, ready: list | None, size: int, source) -> tuple[list[tuple[dict, Path]], bool]:
        """Run jobs from ``source`` on ``pool`` until none is left or the pool breaks; returns the
        (job, marker) of the jobs it broke, and whether it broke."""
        in_flight: dict = {}
        broken: list[tuple[dict, Path]] = []
        while not self.halt.is_set():
            is_ready = ready is None or any(f.done() for f in ready)
            if is_ready:
                self.warm.set()
                while len(in_flight) < size and not broken:
                    job = self._take(source)
                    if job is None:
                        break
                    self.count += 1
                    marker = self.marks / str(self.count)
                    try:
                        in_flight[pool.submit(_work, job, str(marker))] = (job, marker)
                    except cf.process.BrokenProcessPool:
                        broken.append((job, marker))
            if not in_flight:
                with self.lock:
                    more = bool(source)
                if is_ready or broken or not more:
                    break  # done, or broken, or the main process took the last jobs before a process was ready
            waiting = list(in_flight) + [f for f in ready or [] if not f.done()]
            done, _ = cf.wait(waiting, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                if fut not in in_flight:
                    if fut.exception() is not None:  # a process died while starting
                        broken.append((None, None))
                    continue
                self._settle(fut, *in_flight.pop(fut), broken)
            if broken:  # the pool is dead: every job in it ends now, with a result or broken
                for fut, (job, marker) in in_flight.items():
                    self._settle(fut, job, marker, broken)
                break
        return [(job, marker) for job, marker in broken if job is not None], bool(broken)

    def _settle(self, fut, job, marker, broken: list) -> None:
        """A finished future's result onto the queue; a job of a broken pool onto ``broken``."""
        try:
            self.out.put(fut.result())
        except cf.process.BrokenProcessPool:
            broken.append((job, marker))
        except Exception as e:  # noqa: BLE001
            self.out.put(_failed_job(job, f"{type(e).__name__}: {e}"))


def _run_jobs(jobs: list[dict], workers: int, prepare=None):
    """Yield each job's result as it finishes, from ONE pool of ``workers`` processes for all the
    jobs of the run (a process costs seconds to start: ``import torch``, nbgrader).

    ``prepare()`` runs in this process first, while the pool's processes start; until one of them
    is ready, this process grades jobs itself (so a short run is never slower than one worker).
    One worker, or one job, runs in this process. A worker process that dies costs its job only:
    the jobs it broke that had not started go on in a new pool; those that had started are
    retried once, one at a time, and a job that kills its process again scores 0 with a note.
    """
    workers = min(workers, len(jobs))
    if workers <= 1:
        if prepare is not None:
            prepare()
        for job in jobs:
            yield _in_process(job)
        return
    ctx = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // workers)
    todo, lock = collections.deque(jobs), threading.Lock()
    with tempfile.TemporaryDirectory(prefix="gptlab-started-") as marks:
        pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_start,
                                      initargs=(threads,))
        try:
            ready = [pool.submit(_started) for _ in range(workers)]
            if prepare is not None:
                prepare()
        except BaseException:
            _stop(pool)
            raise
        feeder = _Feeder(pool, ready, workers, todo, lock, ctx, threads, marks)
        feeder.start()
        try:
            while True:
                item = None
                while True:  # what the pool finished first
                    try:
                        item = feeder.out.get_nowait()
                    except queue.Empty:
                        break
                    if item is _END:
                        break
                    yield item
                if item is _END:
                    break
                if not feeder.warm.is_set():
                    with lock:
                        job = todo.popleft() if todo else None
                    if job is not None:
                        yield _in_process(job)
                        continue
                item = feeder.out.get()
                if item is _END:
                    break
                yield item
        finally:
            feeder.halt.set()
            feeder.join()
        if feeder.error is not None:
            raise feeder.error


def _in_process(job: dict) -> dict:
    try:
        return grade_student(job)
    except Exception as e:  # noqa: BLE001 (one student must not stop the run)
        return _failed_job(job, f"{type(e).__name__}: {e}")
