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
from .notebooks import (check_notebook, grader_digest, quiet_sqlalchemy, release_reference,
                        release_version, sha256_of, timestamp_of)

_quiet_sqlalchemy = quiet_sqlalchemy  # the name the tests and older callers use

__all__ = ["autograde", "check_notebook", "missing_summary", "WorkerPool", "ensure_assignment", "releases_for",
           "submitted_students", "grader_digest"]



# --------------------------------------------------------------------------- the reference cells


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


# --------------------------------------------------------------------------- one student (worker)


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
        slot = threading.current_thread().name
        try:
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                job = {**job}
                job_t0 = time.time()
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
                            answer = json.loads(line)
                        except json.JSONDecodeError:
                            answer = {"ok": False, "error": f"a grading process answered {line[:100]!r}"}
                        out.put((job, {**answer, "t0": job_t0, "t1": time.time(), "slot": slot}))
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



def ensure_assignment(course: Course, assignment: str) -> None:
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




def releases_for(course: Course, assignment: str, scratch: Path) -> dict[str, Path]:
    """notebook -> the released notebook that matches the gradebook's version of it: the course's
    ``exercises/<assignment>/`` when it does, else a fresh ``generate_assignment`` into ``scratch``."""
    import nbformat
    from nbgrader.api import Gradebook
    from nbgrader.converters import GenerateAssignment
    from nbgrader.coursedir import CourseDirectory

    from .results import gradebook_version

    def versions() -> dict[str, str | None]:
        with Gradebook(course.gradebook_url) as gb:
            return {nb.name: gradebook_version(gb, assignment, nb.name) for nb in gb.find_assignment(assignment).notebooks}

    def matching(folder: Path, want: dict) -> dict[str, Path]:
        out = {}
        for nb, version in want.items():
            path = folder / f"{nb}.ipynb"
            try:
                if path.is_file() and release_version(release_reference(nbformat.read(path, as_version=4))[0]) == version:
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

    from .grade_one import FORMAT

    reference = release_reference(nbformat.read(release, as_version=4))[0]
    cells = {g: {"points": 0.0, "max_points": r["points"], "kind": kind, "message": why, "printed": "",
                 "seconds": None, "review": []} for g, r in reference.items() if r["grade"]}
    return {"format": FORMAT, "assignment": assignment, "notebook": nb, "student": student,
            "assignment_version": release_version(reference), "gptlab_version": gptlab.__version__,
            "cells": cells, "comments": {}, "score": 0.0, "error": None, "seconds": 0.0,
            "notes": [{"notebook": nb, "cell": None, "kind": kind, "message": why}]}


def _reusable(path: Path, submission: Path, sandbox: bool, version: str) -> dict | None:
    """A stored result still valid for this submission (same notebook bytes, assignment version,
    grading code and sandbox setting), or None."""
    from .results import read_result

    try:
        old = read_result(path)
    except ValueError:
        return None
    same = (old.get("submission_sha256") == sha256_of(submission) and old.get("assignment_version") == version
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
    from .results import merge_result, read_result

    quiet_sqlalchemy()
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
    timing: list[dict] = []  # each job's start, end and worker
    try:
        with tempfile.TemporaryDirectory(prefix="gptlab-autograde-") as scratch_dir:
            scratch = Path(scratch_dir)
            jobs, ready = [], []
            for assignment, who in plan:
                ensure_assignment(course, assignment)
                releases = releases_for(course, assignment, scratch / assignment)
                versions = {nb: release_version(release_reference(_read(path))[0]) for nb, path in releases.items()}
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
                    timestamp = timestamp_of(stamp)
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
                    timing.append({"assignment": job["assignment"], "student": job["student"],
                                   "t0": answer.get("t0"), "t1": answer.get("t1"), "slot": answer.get("slot")})
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
        r["jobs"] = [t for t in timing if (t["assignment"], t["student"]) == (r["assignment"], r["student"])]
    return out


def _read(path: Path):
    import nbformat

    return nbformat.read(path, as_version=4)


_ensure_assignment = ensure_assignment  # the name the tests and older callers use


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


