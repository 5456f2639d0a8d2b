"""``course autograde`` over a whole run, and ``course grades``, on small torch-free assignments.

* The pool of grade-worker processes gives the same scores with 2 workers as with 1, and a third
  run reuses every stored result; a worker that dies costs its job one retry (then "died"); a
  second run on a course being graded is refused; ``kill -9`` of a run leaves no worker, kernel or
  sandbox behind, and the next run finishes what it left.
* The summary at the end of ``course autograde`` names the students with no submission of an
  assignment, and the graded ones with a notebook missing.
* ``grades.csv`` leaves the cells empty for an assignment a student did not submit (or that was
  not graded yet), keeps a real 0, and its totals add up what was graded.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

import pytest

from processes import command_lines

from gptlab.__main__ import main
from gptlab.course import Course, grades_table
from gptlab.course import autograde as ag
from gptlab.course.results import merge_result

REPO = Path(__file__).resolve().parent.parent
TINY = ["alpha", "beta", "gamma"]


def _tiny(course: Path, name: str) -> None:
    """An assignment of one notebook, ``<name>.ipynb``: f (2 points) and g (1 point)."""
    import nbformat

    def code(src, gid, test=False, points=1):
        md = {"nbgrader": {"grade": test, "solution": not test, "locked": test, "grade_id": gid,
                           "schema_version": 3, "task": False}}
        if test:
            md["nbgrader"]["points"] = points
        return nbformat.v4.new_code_cell(src, metadata=md)

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    nb.cells = [
        code("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION", "solution_f"),
        code("assert f() == 1", "test_f", test=True, points=2),
        code("def g():\n    ### BEGIN SOLUTION\n    return 2\n    ### END SOLUTION", "solution_g"),
        code("assert g() == 2", "test_g", test=True),
    ]
    (course / "solutions" / name).mkdir(parents=True)
    nbformat.write(nb, course / "solutions" / name / f"{name}.ipynb")


@pytest.fixture
def course(tmp_path) -> Path:
    root = tmp_path / "course"
    root.mkdir()
    shutil.copy(REPO / "nbgrader_config.py", root)
    for name in TINY:
        _tiny(root, name)
    assert main(["course", "release", "--course", str(root), "--quiet"]) == 0
    return root


def _submit(course: Path, student: str, name: str, answers: dict[str, str]) -> None:
    nb = json.loads((course / "exercises" / name / f"{name}.ipynb").read_text())
    for c in nb["cells"]:
        gid = c["metadata"].get("nbgrader", {}).get("grade_id")
        if gid in answers:
            c["source"] = answers[gid]
    dest = course / "submitted" / student / name
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{name}.ipynb").write_text(json.dumps(nb))


RIGHT = {"solution_f": "def f():\n    return 1\n", "solution_g": "def g():\n    return 2\n"}
WRONG_G = {"solution_f": "def f():\n    return 1\n", "solution_g": "def g():\n    return 3\n"}


def _scores(results) -> dict:
    return {(r["assignment"], r["student"]): (r["total"], r["notebooks"]) for r in results}


# --------------------------------------------------------------------------- the pool, real grading


@pytest.mark.slow
def test_the_pool_gives_the_same_scores_as_one_worker_and_names_what_is_missing(course, capsys):
    for name in TINY:
        _submit(course, "ann", name, RIGHT)
        _submit(course, "bob", name, WRONG_G)
    _submit(course, "cy", "alpha", {})  # the blank release
    (course / "submitted" / "cy" / "beta").mkdir(parents=True)  # a folder without the notebook
    (course / "submitted" / "eve").mkdir()  # a learner folder with nothing in it
    c = Course(course)
    t0 = time.perf_counter()
    pooled = ag.autograde(c, TINY, workers=2, progress=False)
    t_pool = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = ag.autograde(c, TINY, workers=1, progress=False, force=True)
    t_alone = time.perf_counter() - t0
    print(f"8 submissions: 2 workers {t_pool:.1f} s, 1 worker {t_alone:.1f} s")
    assert [(r["assignment"], r["student"]) for r in pooled] == [(r["assignment"], r["student"]) for r in alone]
    assert _scores(pooled) == _scores(alone)
    totals = {(r["assignment"], r["student"]): r["total"] for r in pooled}
    assert totals == {**{(n, "ann"): 3.0 for n in TINY}, **{(n, "bob"): 2.0 for n in TINY}, ("alpha", "cy"): 0.0,
                      ("beta", "cy"): 0.0}
    missing = ag.missing_summary(c, TINY, pooled)
    assert "alpha: no submission from eve" in missing and "gamma: no submission from cy, eve" in missing
    assert "beta: notebook(s) missing from cy (beta.ipynb)" in missing
    # a third run grades nothing again: every stored result is still valid, and merged as it is
    t0 = time.perf_counter()
    again = ag.autograde(c, TINY, workers=2, progress=False)
    assert _scores(again) == _scores(pooled) and time.perf_counter() - t0 < t_alone / 2


def _fake_worker(tmp_path: Path) -> list[str]:
    """A worker command that answers like grade-worker: job 'b' kills its process once (a marker
    file remembers), job 'c' every time, the others answer ok."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        print(json.dumps({{"ready": os.getpid()}}), flush=True)
        for line in sys.stdin:
            job = json.loads(line)
            if job["name"] == "c" or (job["name"] == "b" and not os.path.exists({str(tmp_path / 'b-died')!r})):
                open({str(tmp_path / 'b-died')!r}, "a").write("x") if job["name"] == "b" else None
                os._exit(1)
            print(json.dumps({{"id": job["id"], "ok": True, "error": None}}), flush=True)
    """))
    return [sys.executable, str(script)]


def test_a_worker_that_dies_costs_its_job_one_retry(tmp_path, monkeypatch):
    """A worker process that dies mid-job is replaced and the job tried once more; a job that kills
    its worker twice is answered "died"; the other jobs are answered as usual."""
    pool = ag.WorkerPool(2, 1)
    monkeypatch.setattr(pool, "command", _fake_worker(tmp_path))
    jobs = [{"id": k, "name": n} for k, n in enumerate("abcde")]
    answers = {job["name"]: answer for job, answer in pool.run(jobs)}
    assert sorted(answers) == list("abcde")
    assert all(answers[n]["ok"] for n in "abde")
    assert not answers["c"]["ok"] and answers["c"].get("died") and "died" in answers["c"]["error"]


def test_two_runs_on_one_course_at_once_are_refused_cleanly(course):
    """A second course autograde on a course that one is grading refuses with one line naming it
    (it used to grade beside it and store 0 for a submission it failed)."""
    from gptlab.files import lock_folder

    _submit(course, "ann", "alpha", RIGHT)
    with lock_folder(course, ".gptlab-autograde.lock", purpose="course autograde"):
        with pytest.raises(ag.CourseError, match="in use by another course autograde"):
            ag.autograde(Course(course), ["alpha"], progress=False)
    assert not (course / "autograded").exists()  # nothing was graded beside the run that holds the lock


def _our_processes(course: Path) -> list[str]:
    return [f"{pid} {cmd[:120]}" for pid, cmd, env in command_lines()
            if ("grade-worker" in cmd or "kernel_boot.py" in cmd or "gptlab-sandbox" in cmd)
            and str(course).encode() in env + cmd.encode()]


@pytest.mark.slow
def test_a_killed_run_leaves_nothing_running_and_the_next_run_finishes_it(course):
    """kill -9 of course autograde in the middle of a run: its workers and their kernels die with it;
    the next run merges what the killed one had graded and grades the rest."""
    import signal
    import subprocess

    students = [f"s{k}" for k in range(6)]
    for student in students:
        _submit(course, student, "alpha", RIGHT)
    env = {**os.environ, "GPTLAB_TEST_COURSE": str(course)}  # to find this run's processes by
    proc = subprocess.Popen([sys.executable, "-m", "gptlab", "course", "autograde", "alpha", "--course", str(course),
                             "--workers", "2", "--quiet"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = course / "autograded" / ".gptlab" / "results" / "alpha"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(list(store.glob("*/*.json"))) < 2:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(list(store.glob("*/*.json")))
    time.sleep(1.5)
    assert _our_processes(course) == [], _our_processes(course)
    assert 2 <= done_before < len(students)
    # the stale lock of the killed run is taken over; the results it wrote are merged, not graded again
    results = ag.autograde(Course(course), ["alpha"], workers=2, progress=False)
    assert {r["student"]: r["total"] for r in results} == {s: 3.0 for s in students}


# --------------------------------------------------------------------------- grades.csv


def _result(name: str, student: str, grades: dict, review: dict | None = None) -> dict:
    """A grade-one result for the tiny assignment ``name`` (a missing cell scores 0)."""
    from gptlab.course.grade_one import FORMAT

    cells = {g: {"points": grades.get(g, 0.0), "max_points": m, "kind": "correct", "message": "", "printed": "",
                 "seconds": None, "review": (review or {}).get(g, [])} for g, m in (("test_f", 2.0), ("test_g", 1.0))}
    return {"format": FORMAT, "assignment": name, "notebook": name, "student": student, "assignment_version": "x",
            "cells": cells, "comments": {}, "notes": []}


def test_grades_csv_leaves_what_was_not_graded_empty(course, tmp_path):
    """ann: everything right; bob: alpha wrong (a real 0 on g, 0 on a missing notebook in beta),
    gamma not submitted; cy: in the gradebook, nothing graded."""
    from nbgrader.api import Gradebook

    ag._quiet_sqlalchemy()  # nbgrader 0.9 and SQLAlchemy 2 (see there)
    c = Course(course)
    for name in TINY:
        ag._ensure_assignment(c, name)

    with Gradebook(c.gradebook_url) as gb:
        for name in TINY:
            merge_result(gb, c, _result(name, "ann", {"test_f": 2.0, "test_g": 1.0}))
        merge_result(gb, c, _result("alpha", "bob", {"test_f": 2.0, "test_g": 0.0}))
        merge_result(gb, c, _result("beta", "bob", {}))
        gb.update_or_create_student("cy")
    out = tmp_path / "grades.csv"
    assert main(["course", "grades", "--course", str(course), "--output", str(out)]) == 0
    rows = {r["student"]: r for r in csv.DictReader(out.open())}
    assert list(rows) == ["ann", "bob", "cy"]
    assert rows["ann"]["total"] == "9" and rows["ann"]["gamma/test_g"] == "1"
    bob = rows["bob"]
    assert (bob["alpha"], bob["alpha/test_f"], bob["alpha/test_g"]) == ("2", "2", "0")
    assert (bob["beta"], bob["beta/test_f"], bob["beta/test_g"]) == ("0", "0", "0")
    assert (bob["gamma"], bob["gamma/test_f"], bob["gamma/test_g"]) == ("", "", "")
    assert bob["total"] == "2"
    assert all(v == "" for k, v in rows["cy"].items() if k != "student")
    header, table = grades_table(c)
    assert table[2] == ["cy"] + [None] * (len(header) - 1)


def test_grades_csv_a_test_cell_without_a_score_is_empty(course, tmp_path):
    from nbgrader.api import Gradebook

    ag._quiet_sqlalchemy()
    c = Course(course)
    ag._ensure_assignment(c, "alpha")
    with Gradebook(c.gradebook_url) as gb:
        merge_result(gb, c, _result("alpha", "ann", {"test_f": 2.0, "test_g": None}))
    header, table = grades_table(c, ["alpha"])
    assert header == ["student", "alpha", "alpha/test_f", "alpha/test_g", "total", "notes"]
    assert table == [["ann", 2.0, 2.0, None, 2.0, None]]


def test_grades_csv_names_what_needs_review_and_what_ran_without_the_sandbox(course, tmp_path):
    """A test cell the autograder flagged keeps its score, needs a manual grade in the gradebook,
    and is named in the last column, as is an assignment graded with --no-sandbox."""
    import json

    from nbgrader.api import Gradebook

    ag._quiet_sqlalchemy()
    c = Course(course)
    ag._ensure_assignment(c, "alpha")
    ag._ensure_assignment(c, "beta")
    with Gradebook(c.gradebook_url) as gb:
        merge_result(gb, c, _result("alpha", "ann", {"test_f": 2.0, "test_g": 1.0},
                                    review={"test_f": ["cell 3, line 1: `sys.setprofile(None)`: ..."]}))
        merge_result(gb, c, _result("beta", "ann", {"test_f": 2.0, "test_g": 1.0}))
        flagged = {g.name: g.needs_manual_grade for g in gb.find_submission_notebook("alpha", "alpha", "ann").grades}
    assert flagged == {"test_f": True, "test_g": False}
    path = c.notes_path("beta", "ann")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"notebook": None, "cell": None, "kind": "no_sandbox", "message": "..."}]))
    header, table = grades_table(c, ["alpha", "beta"])
    row = dict(zip(header, table[0]))
    assert row["alpha/test_f"] == 2.0 and row["total"] == 6.0
    assert row["notes"] == "needs review (score not final): alpha/test_f; graded without the sandbox: beta"

