"""``course autograde``: every submission a grade-one job, run by a plain pool, merged into one gradebook.

How it works, once for the whole run:

1. The run takes the course's lock (``.gptlab-autograde.lock``): a second ``course autograde`` on
   the same course refuses with one line naming the first, instead of grading beside it.
2. Each assignment is in the gradebook, and its released notebooks are the gradebook's version
   (``exercises/<a>/``, or a fresh ``generate_assignment`` into a scratch folder when they differ).
3. Each (student, assignment) submission is copied to a scratch folder (only the assignment's
   notebooks: a learner's ``helper.py`` or ``torch.py`` is left out, and noted), and each notebook
   is one job for :func:`gptlab.course.grade_one.grade_one`, the same code path that grades a
   notebook on a cluster or on Gradescope. The jobs run in a plain pool of ``--workers`` worker
   processes (``python -m gptlab course grade-worker``, each its share of the cores, importing torch
   and nbgrader once for all its jobs); the longest assignments first. A worker that dies costs
   its job one retry on a fresh worker, then that job scores 0 with a note; a worker dies with the
   run (``kill -9`` included), and so do its kernels' sandboxes.
4. Each job's result (``autograded/.gptlab/results/<a>/<student>/<nb>.json``) is merged into the
   gradebook by this process alone, as the jobs finish, with :func:`gptlab.course.results.merge_result`
   (what ``course import-results`` does): the scores, the review flags, the notes (shown by
   ``feedback``), the graded notebook in ``autograded/<student>/<a>/``.
5. A result that is still valid (the same submission, assignment version, grader and sandbox setting)
   is merged again instead of graded again: a run that was killed is finished by the next one
   (``force=True`` grades everything again).
6. :func:`missing_summary`: the students with no submission of an assignment, and the graded ones
   with a notebook missing (``course autograde`` prints it at the end).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ._common import NOTES_DIR, Course, CourseError, run_converter

__all__ = ["autograde", "check_notebook", "missing_summary", "WorkerPool"]


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




@functools.lru_cache(maxsize=1)
def grader_digest() -> str:
    """A sha256 of the grading code (every ``.py`` of the installed gptlab): a stored result is
    reused only when the code that would grade it again is the same."""
    import gptlab

    root = Path(gptlab.__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- the pool of workers


class WorkerPool:
    """``size`` worker processes (``python -m gptlab course grade-worker``), one thread of this
    process feeding each: :meth:`run` yields ``(job, answer)`` as the jobs end. A worker that dies
    mid-job is replaced and the job tried once more on the new one; a second death is the job's
    answer (``{"ok": False, "died": True}``). Workers end with the pool, or with this process."""

    def __init__(self, size: int, threads: int, log: Path | None = None):
        self.size, self.threads, self.log = size, threads, log
        self.command = [sys.executable, "-m", "gptlab", "course", "grade-worker"]

    def _start(self) -> subprocess.Popen | None:
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the worker's share of the cores, unless set
            env.setdefault(var, str(self.threads))
        err = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
        try:
            proc = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err, env=env, text=True, bufsize=1)
        finally:
            if err is not subprocess.DEVNULL:
                err.close()
        line = proc.stdout.readline()
        if not line.startswith('{"ready"'):
            proc.kill()
            _close(proc)
            return None
        return proc

    def run(self, jobs: list[dict]):
        todo: queue.Queue = queue.Queue()
        for job in jobs:
            todo.put(job)
        out: queue.Queue = queue.Queue()
        threads = [threading.Thread(target=self._serve, args=(todo, out), daemon=True)
                   for _ in range(min(self.size, len(jobs)))]
        for t in threads:
            t.start()
        for _ in range(len(jobs)):
            yield out.get()
        for t in threads:
            t.join(60)

    def _serve(self, todo: queue.Queue, out: queue.Queue) -> None:
        proc = None
        try:
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                for attempt in (1, 2):
                    if proc is None or proc.poll() is not None:
                        proc = self._start()
                    if proc is None:
                        out.put((job, {"ok": False, "error": "a grading process could not start", "died": True}))
                        break
                    try:
                        proc.stdin.write(json.dumps(job) + "\n")
                        proc.stdin.flush()
                        line = proc.stdout.readline()
                    except (BrokenPipeError, OSError, ValueError):
                        line = ""
                    if line:
                        try:
                            out.put((job, json.loads(line)))
                        except json.JSONDecodeError:
                            out.put((job, {"ok": False, "error": f"a grading process answered {line[:100]!r}"}))
                        break
                    _close(proc)
                    proc = None  # it died: a fresh one, and the job once more
                    if attempt == 2:
                        out.put((job, {"ok": False, "error": "the grading process died", "died": True}))
        finally:
            if proc is not None:
                try:
                    proc.stdin.close()
                    proc.wait(timeout=30)
                except Exception:  # noqa: BLE001
                    proc.kill()
                _close(proc)


def _close(proc: subprocess.Popen) -> None:
    """Wait for a worker process and close its pipes."""
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    proc.wait()


# --------------------------------------------------------------------------- the main process


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




def _releases(course: Course, assignment: str, scratch: Path) -> dict[str, Path]:
    """notebook -> the released notebook that matches the gradebook's version of it: the course's
    ``exercises/<assignment>/`` when it does, else a fresh ``generate_assignment`` into ``scratch``."""
    import nbformat
    from nbgrader.api import Gradebook
    from nbgrader.converters import GenerateAssignment
    from nbgrader.coursedir import CourseDirectory

    from .grade_one import _release_version, release_reference
    from .results import gradebook_version

    def versions() -> dict[str, str | None]:
        with Gradebook(course.gradebook_url) as gb:
            return {nb.name: gradebook_version(gb, assignment, nb.name) for nb in gb.find_assignment(assignment).notebooks}

    def matching(folder: Path, want: dict) -> dict[str, Path]:
        out = {}
        for nb, version in want.items():
            path = folder / f"{nb}.ipynb"
            try:
                if path.is_file() and _release_version(release_reference(nbformat.read(path, as_version=4))[0]) == version:
                    out[nb] = path
            except Exception:  # noqa: BLE001 - an unreadable release is regenerated
                pass
        return out

    want = versions()
    found = matching(course.directory("release") / assignment, want)
    if len(found) == len(want):
        return found
    folder = scratch / "release"
    cfg = course.config(**{"CourseDirectory.release_directory": str(folder)})
    coursedir = CourseDirectory(config=cfg)
    coursedir.assignment_id = assignment
    ok, log = run_converter(GenerateAssignment, coursedir, cfg, force=True, create_assignment=True)
    if not ok:
        raise CourseError(f"nbgrader generate_assignment {assignment} failed:\n{log[-3000:]}")
    want = versions()
    found = matching(folder / assignment, want)
    if len(found) != len(want):
        raise CourseError(f"the released notebooks of {assignment} do not match the gradebook's")
    return found


def _blank_result(assignment: str, student: str, nb: str, release: Path, why: str, kind: str) -> dict:
    """A result that scores every test cell of ``nb`` 0, with a note (a missing or unreadable
    notebook, a grading process that died)."""
    import gptlab
    import nbformat

    from .grade_one import FORMAT, _release_version, release_reference

    reference = release_reference(nbformat.read(release, as_version=4))[0]
    cells = {g: {"points": 0.0, "max_points": r["points"], "kind": kind, "message": why, "printed": "",
                 "seconds": None, "review": []} for g, r in reference.items() if r["grade"]}
    return {"format": FORMAT, "assignment": assignment, "notebook": nb, "student": student,
            "assignment_version": _release_version(reference), "gptlab_version": gptlab.__version__,
            "cells": cells, "comments": {}, "score": 0.0, "error": None, "seconds": 0.0,
            "notes": [{"notebook": nb, "cell": None, "kind": kind, "message": why}]}


def _reusable(path: Path, submission: Path, sandbox: bool, version: str) -> dict | None:
    """A stored result still valid for this submission (same notebook bytes, assignment version,
    grading code and sandbox setting), or None."""
    from .grade_one import _sha256
    from .results import read_result

    try:
        old = read_result(path)
    except ValueError:
        return None
    same = (old.get("submission_sha256") == _sha256(submission) and old.get("assignment_version") == version
            and old.get("grader_sha256") == grader_digest() and bool(old.get("sandbox")) == sandbox
            and not old.get("error"))
    return old if same else None


def autograde(course: Course, assignments: list[str], students: list[str] | None = None, workers: int = 1,
              timeout: int | None = None, progress: bool = True, sandbox: bool = True,
              force: bool = False) -> list[dict]:
    """Autograde every (or the named) student's submission of each assignment; see the module doc.

    Every kernel runs in the operating-system sandbox (:mod:`gptlab.course.sandbox`); where none
    can start, a :class:`CourseError` says why and how to fix it, unless ``sandbox=False`` (the
    instructor's ``--no-sandbox``), which every result's notes then record. ``force``: grade again
    the submissions whose stored result is still valid.

    Returns one result per (assignment, student), in the order of ``assignments`` then students:
    ``notebooks`` (per notebook its ``grades``, ``comments``), ``notes``, ``times`` (per notebook,
    per graded cell, seconds), ``review``, ``seconds``, ``total``.
    """
    from nbgrader.api import Gradebook
    from tqdm.auto import tqdm

    from ..files import LockError, lock_folder
    from .grade_one import _release_version, release_reference
    from .results import merge_result, read_result

    _quiet_sqlalchemy()
    if workers < 1:
        raise CourseError(f"--workers must be at least 1, got {workers}")
    if timeout is not None and timeout <= 0:
        raise CourseError(f"--timeout must be a positive number of seconds, got {timeout}")
    if timeout is None:  # the course's own limit (nbgrader_config.py's Execute.timeout)
        configured = course.config().Execute.get("timeout")
        timeout = int(configured) if isinstance(configured, int | float) and configured > 0 else None
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
    try:
        lock = lock_folder(course.root, ".gptlab-autograde.lock", purpose="course autograde")
    except LockError as e:
        raise CourseError(str(e)) from None
    rank = {a: k for k, a in enumerate(assignments)}
    weight = {a: _weight(course, a) for a, _ in plan}
    autograded = course.directory("autograded")
    store = autograded / NOTES_DIR / "results"
    results: dict[tuple[str, str], dict] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="gptlab-autograde-") as scratch_dir:
            scratch = Path(scratch_dir)
            jobs, ready = [], []
            for assignment, who in plan:
                _ensure_assignment(course, assignment)
                releases = _releases(course, assignment, scratch / assignment)
                versions = {nb: _release_version(release_reference(_read(path))[0]) for nb, path in releases.items()}
                for student in who:
                    res = {"assignment": assignment, "student": student, "notebooks": {}, "notes": [], "times": {},
                           "review": {}, "seconds": 0.0, "failed": []}
                    results[(assignment, student)] = res
                    if not sandbox:
                        res["notes"].append({"notebook": None, "cell": None, "kind": "no_sandbox", "message": (
                            "graded WITHOUT the autograder's sandbox (course autograde --no-sandbox): the notebook ran "
                            "as the instructor, with the instructor's files, processes and network.")})
                    staged = scratch / "submitted" / student / assignment
                    shutil.copytree(course.directory("submitted") / student / assignment, staged, symlinks=True,
                                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
                    extra = _keep_only_notebooks(staged, list(releases))
                    if extra:
                        res["notes"].append({"notebook": None, "cell": None, "kind": "ignored_files", "message": (
                            f"not graded and not present while grading: {', '.join(extra)} (only the assignment's "
                            "notebooks are; code in other files would not be in the notebook).")})
                    stamp = staged / "timestamp.txt"
                    timestamp = _timestamp(stamp)
                    for nb, release in releases.items():
                        submission = staged / f"{nb}.ipynb"
                        out = store / assignment / student / f"{nb}.json"
                        graded_nb = autograded / student / assignment / f"{nb}.ipynb"
                        if not submission.is_file():
                            res["failed"].append(nb)
                            ready.append(_blank_result(assignment, student, nb, release, (
                                f"{nb}.ipynb was not submitted: every test in it scored 0."), "missing"))
                            continue
                        old = None if force else _reusable(out, submission, sandbox, versions[nb])
                        if old is not None and graded_nb.is_file():
                            ready.append(old)
                            continue
                        jobs.append({"id": len(jobs), "notebook": str(submission), "assignment": assignment,
                                     "release": str(release), "student": student, "timeout": timeout,
                                     "sandbox": sandbox, "notebook_out": str(graded_nb), "timestamp": timestamp,
                                     "out": str(out)})
            jobs.sort(key=lambda j: (-weight[j["assignment"]], rank[j["assignment"]], j["student"]))
            total_jobs = len(jobs) + len(ready)
            bar = tqdm(total=total_jobs, desc="autograde", unit="notebook", disable=not progress or None)
            threads = max(1, (os.cpu_count() or 1) // min(workers, max(1, len(jobs))))
            pool = WorkerPool(min(workers, max(1, len(jobs))), threads, log=scratch / "workers.log")
            with Gradebook(course.gradebook_url) as gb:
                def merge(result: dict) -> None:
                    res = results[(result["assignment"], result["student"])]
                    nb = result["notebook"]
                    res["notebooks"][nb] = {"grades": {g: c.get("points") for g, c in result["cells"].items()},
                                            "comments": dict(result.get("comments", {})), "late_penalty": None}
                    res["times"][nb] = {g: c["seconds"] for g, c in result["cells"].items() if c.get("seconds") is not None}
                    flagged = {g: c["review"] for g, c in result["cells"].items() if c.get("review")}
                    if flagged:
                        res["review"][nb] = flagged
                    if result.get("timestamp"):
                        res["timestamp"] = result["timestamp"]
                    res["notes"] = [n for n in res["notes"] if n.get("kind") in ("ignored_files", "no_sandbox")
                                    or n.get("notebook") not in (nb,)] + [
                        n for n in result.get("notes", []) if n.get("kind") != "no_sandbox"]
                    res["seconds"] += float(result.get("seconds") or 0.0)
                    result = {**result, "notes": res["notes"]}
                    res["total"] = merge_result(gb, course, result, None)
                    bar.set_postfix_str(f"{res['assignment']} {res['student']}: {res['total']:g}")
                    bar.update()

                for result in ready:
                    merge(result)
                for job, answer in pool.run(jobs):
                    path = Path(job["out"])
                    result = None
                    if answer.get("ok"):
                        try:
                            result = read_result(path)
                        except ValueError:
                            result = None
                    if result is None:
                        why = answer.get("error") or "no result was written"
                        kind = "grader_error"
                        msg = (f"the autograder itself failed on this submission ({why}): every test in "
                               f"{Path(job['notebook']).name} scored 0.")
                        result = _blank_result(job["assignment"], job["student"], Path(job["release"]).stem,
                                               Path(job["release"]), msg, kind)
                    merge(result)
            bar.close()
    finally:
        lock.release()
    out = sorted(results.values(), key=lambda r: (rank[r["assignment"]], r["student"]))
    for r in out:
        r.setdefault("total", 0.0)
    return out


def _read(path: Path):
    import nbformat

    return nbformat.read(path, as_version=4)


def _timestamp(path: Path) -> str | None:
    """nbgrader's submission time (``timestamp.txt``) as ISO 8601, or None."""
    if not path.is_file():
        return None
    from dateutil.parser import parse

    try:
        return parse(path.read_text().strip()).isoformat()
    except (ValueError, OverflowError):
        return None


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


