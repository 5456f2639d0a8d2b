"""``course autograde`` over a whole run, and ``course grades``, on small torch-free assignments.

* One pool of worker processes serves every (student, assignment) of a run: it is created once,
  whatever the number of assignments, and gives the same scores as one worker (a real spawn pool
  and real nbgrader grading, marked slow; and a fast version with a thread pool in its place and
  a stand-in for ``grade_student``, which also checks the retry of a job whose worker died).
* The summary at the end of ``course autograde`` names the students with no submission of an
  assignment, and the graded ones with a notebook missing.
* ``grades.csv`` leaves the cells empty for an assignment a student did not submit (or that was
  not graded yet), keeps a real 0, and its totals add up what was graded.
"""

from __future__ import annotations

import concurrent.futures as cf
import csv
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from gptlab.__main__ import main
from gptlab.course import Course, grades_table
from gptlab.course import autograde as ag

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


# --------------------------------------------------------------------------- one pool, real grading


@pytest.mark.slow
def test_one_pool_for_the_whole_run_and_the_same_scores_as_one_worker(course, monkeypatch):
    for name in TINY:
        _submit(course, "ann", name, RIGHT)
        _submit(course, "bob", name, WRONG_G)
    _submit(course, "cy", "alpha", {})  # the blank release
    made = []

    class Counting(cf.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("max_workers", args[0] if args else None))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ag.cf, "ProcessPoolExecutor", Counting)
    c = Course(course)
    t0 = time.perf_counter()
    pooled = ag.autograde(c, TINY, workers=2, progress=False)
    t_pool = time.perf_counter() - t0
    assert made == [2], f"{len(made)} pools for one run over {len(TINY)} assignments: {made}"
    t0 = time.perf_counter()
    alone = ag.autograde(c, TINY, workers=1, progress=False)
    t_alone = time.perf_counter() - t0
    assert made == [2]  # one worker grades in this process
    print(f"7 submissions: 2 workers {t_pool:.1f} s, 1 worker {t_alone:.1f} s")
    assert [(r["assignment"], r["student"]) for r in pooled] == [(r["assignment"], r["student"]) for r in alone]
    assert _scores(pooled) == _scores(alone)
    totals = {(r["assignment"], r["student"]): r["total"] for r in pooled}
    assert totals == {**{(n, "ann"): 3.0 for n in TINY}, **{(n, "bob"): 2.0 for n in TINY}, ("alpha", "cy"): 0.0}


def _die(job: dict, marker: str) -> dict:
    """In a worker process, in place of ``_work``: the job starts, and its process dies."""
    import os

    Path(marker).touch()
    os._exit(1)


@pytest.mark.slow
def test_a_worker_process_that_dies_costs_its_job_only(course, monkeypatch):
    """The student "crash" kills every worker process that grades them: each such job is retried
    once, alone, then scores 0 with a note; the other jobs are graded as usual."""
    for student in ("ann", "bob", "crash"):
        _submit(course, student, "alpha", RIGHT)
        _submit(course, student, "beta", RIGHT)
    made, here = [], []

    class Dying(cf.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("max_workers", args[0] if args else None))
            super().__init__(*args, **kwargs)

        def submit(self, fn, *args, **kwargs):
            if fn is ag._work and args[0]["student"] == "crash":
                fn = _die
            return super().submit(fn, *args, **kwargs)

    in_process = ag._in_process

    def slowly(job):  # the main process grades while the pool starts: let the pool take most jobs
        here.append((job["assignment"], job["student"]))
        time.sleep(5)
        return in_process(job)

    monkeypatch.setattr(ag.cf, "ProcessPoolExecutor", Dying)
    monkeypatch.setattr(ag, "_in_process", slowly)
    results = {(r["assignment"], r["student"]): r for r in ag.autograde(Course(course), ["alpha", "beta"], workers=2,
                                                                        progress=False)}
    assert len(results) == 6
    died = [k for k in results if k[1] == "crash" and k not in here]
    assert died, f"the main process graded every job: {here}"
    for key, r in results.items():
        if key in died:
            assert r["total"] == 0.0 and "the grading process died" in r["notes"][0]["message"], r
        else:
            assert r["total"] == 3.0 and not r["notes"], r
    assert made[0] == 2 and made[-1] == 1  # the run's pool, ..., a retry alone


# --------------------------------------------------------------------------- one pool, stand-ins


class ThreadPool(cf.ThreadPoolExecutor):
    """In place of the process pool: threads, no initializer (it sets this process's threads)."""

    made: list[int] = []

    def __init__(self, max_workers=None, mp_context=None, initializer=None, initargs=()):
        ThreadPool.made.append(max_workers)
        super().__init__(max_workers)


def _fake_grade(kills: dict[tuple[str, str], int], missing: set[tuple[str, str]], seen: list, lock):
    """A stand-in for grade_student: full marks, except g for bob; a notebook missing for
    ``missing``; a dead worker (BrokenProcessPool) the first ``kills[key]`` times."""

    def grade(job: dict) -> dict:
        key = (job["assignment"], job["student"])
        with lock:
            seen.append(key)
            dies = kills.get(key, 0) > 0
            if dies:
                kills[key] -= 1
        time.sleep(0.01)
        if dies:
            raise cf.process.BrokenProcessPool("a worker died")
        name = job["assignment"]
        result = {"assignment": name, "student": job["student"], "notebooks": {}, "notes": [], "times": {},
                  "failed": [], "log": "", "seconds": 0.01}
        if key in missing:
            result["failed"].append(name)
            result["notes"].append({"notebook": name, "cell": None, "kind": "missing",
                                    "message": f"{name}.ipynb was not submitted: every test in it scored 0."})
        else:
            result["notebooks"][name] = {"grades": {"test_f": 2.0, "test_g": 0.0 if job["student"] == "bob" else 1.0},
                                         "comments": {}, "late_penalty": None}
        return result

    return grade


@pytest.fixture
def fake_pool(monkeypatch):
    ThreadPool.made = []
    monkeypatch.setattr(ag.cf, "ProcessPoolExecutor", ThreadPool)
    return ThreadPool


def _everyone(course: Path) -> None:
    for name in TINY:
        for student in ("ann", "bob", "cy"):
            _submit(course, student, name, RIGHT)
    _submit(course, "dee", "alpha", RIGHT)


def test_one_pool_serves_every_assignment(course, fake_pool, monkeypatch):
    _everyone(course)
    seen, lock = [], threading.Lock()
    monkeypatch.setattr(ag, "grade_student", _fake_grade({}, set(), seen, lock))
    c = Course(course)
    pooled = ag.autograde(c, TINY, workers=2, progress=False)
    assert fake_pool.made == [2]
    assert sorted(seen) == sorted((r["assignment"], r["student"]) for r in pooled) and len(seen) == 10
    seen.clear()
    alone = ag.autograde(c, TINY, workers=1, progress=False)
    assert fake_pool.made == [2] and len(seen) == 10
    assert _scores(pooled) == _scores(alone)
    assert [(r["assignment"], r["student"]) for r in pooled] == \
        [(n, s) for n in TINY for s in ("ann", "bob", "cy", "dee") if n == "alpha" or s != "dee"]
    assert {r["total"] for r in pooled if r["student"] == "bob"} == {2.0}
    assert {r["total"] for r in pooled if r["student"] != "bob"} == {3.0}


def test_the_longest_assignment_goes_first(course, fake_pool, monkeypatch):
    import nbformat

    path = course / "solutions" / "gamma" / "gamma.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].metadata["gptlab"] = {"timeout": 300}
    nbformat.write(nb, path)
    _everyone(course)
    seen, lock = [], threading.Lock()
    monkeypatch.setattr(ag, "grade_student", _fake_grade({}, set(), seen, lock))
    ag.autograde(Course(course), TINY, workers=2, progress=False)
    # the jobs are taken gamma first, but up to 3 graders run at once (2 workers, and the main process until
    # one is ready) and a grader may be paused between taking a job and recording it. What holds whatever the
    # timing: the first 3 jobs taken are gamma's, and a 4th is taken only after one of them was recorded,
    # so gamma's is recorded first; and gamma's jobs are recorded well before the others on average.
    gamma = [i for i, (a, _) in enumerate(seen) if a == "gamma"]
    others = [i for i, (a, _) in enumerate(seen) if a != "gamma"]
    assert seen[0][0] == "gamma" and len(gamma) == 3, seen
    assert sum(gamma) / len(gamma) + 2 < sum(others) / len(others), seen


def test_a_dead_worker_costs_its_job_only(course, fake_pool, monkeypatch):
    _everyone(course)
    seen, lock = [], threading.Lock()
    # the last jobs of the run (the main process may grade the first ones itself while the pool
    # starts): one kills its worker once (retried), one twice (0 and a note)
    kills = {("gamma", "cy"): 1, ("gamma", "bob"): 2}
    monkeypatch.setattr(ag, "grade_student", _fake_grade(kills, set(), seen, lock))
    results = {(r["assignment"], r["student"]): r for r in ag.autograde(Course(course), TINY, workers=2,
                                                                        progress=False)}
    assert len(results) == 10
    assert results[("gamma", "cy")]["total"] == 3.0 and not results[("gamma", "cy")]["notes"]
    assert results[("gamma", "bob")]["total"] == 0.0
    assert "the grading process died" in results[("gamma", "bob")]["notes"][0]["message"]
    assert seen.count(("gamma", "cy")) == 2 and seen.count(("gamma", "bob")) == 2
    assert all(seen.count(k) == 1 for k in results if k not in kills)
    # the run's pool, then new ones only because workers died: the retries one at a time
    assert fake_pool.made[0] == 2 and fake_pool.made[-1] == 1 and len(fake_pool.made) <= 4


def test_the_summary_names_what_is_missing(course, fake_pool, monkeypatch, capsys):
    _everyone(course)
    (course / "submitted" / "eve").mkdir()  # a learner folder with nothing in it
    seen, lock = [], threading.Lock()
    monkeypatch.setattr(ag, "grade_student", _fake_grade({}, {("beta", "cy")}, seen, lock))
    assert main(["course", "autograde", "--course", str(course), "--workers", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "missing:\n" in out
    assert "  alpha: no submission from eve\n" in out
    assert "  beta: no submission from dee, eve\n" in out and "  gamma: no submission from dee, eve\n" in out
    assert "  beta: notebook(s) missing from cy (beta.ipynb)\n" in out
    assert "10 submission(s) graded" in out
    # only the named students
    assert main(["course", "autograde", "beta", "--course", str(course), "--student", "dee", "--student", "ann",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "  beta: no submission from dee\n" in out and "eve" not in out


# --------------------------------------------------------------------------- grades.csv


def test_grades_csv_leaves_what_was_not_graded_empty(course, tmp_path):
    """ann: everything right; bob: alpha wrong (a real 0 on g, 0 on a missing notebook in beta),
    gamma not submitted; cy: in the gradebook, nothing graded."""
    from nbgrader.api import Gradebook

    ag._quiet_sqlalchemy()  # nbgrader 0.9 and SQLAlchemy 2 (see there)
    c = Course(course)
    for name in TINY:
        ag._ensure_assignment(c, name)

    def result(name, student, grades, missing=False):
        return {"assignment": name, "student": student, "notes": [], "failed": [name] if missing else [],
                "notebooks": {} if missing else {name: {"grades": grades, "comments": {}, "late_penalty": None}}}

    with Gradebook(c.gradebook_url) as gb:
        for name in TINY:
            ag._merge(gb, result(name, "ann", {"test_f": 2.0, "test_g": 1.0}))
        ag._merge(gb, result("alpha", "bob", {"test_f": 2.0, "test_g": 0.0}))
        ag._merge(gb, result("beta", "bob", {}, missing=True))
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
        ag._merge(gb, {"assignment": "alpha", "student": "ann", "notes": [], "failed": [],
                       "notebooks": {"alpha": {"grades": {"test_f": 2.0, "test_g": None}, "comments": {},
                                               "late_penalty": None}}})
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
        ag._merge(gb, {"assignment": "alpha", "student": "ann", "notes": [], "failed": [],
                       "review": {"alpha": {"test_f": ["cell 3, line 1: `sys.setprofile(None)`: ..."]}},
                       "notebooks": {"alpha": {"grades": {"test_f": 2.0, "test_g": 1.0}, "comments": {},
                                               "late_penalty": None}}})
        ag._merge(gb, {"assignment": "beta", "student": "ann", "notes": [], "failed": [],
                       "notebooks": {"beta": {"grades": {"test_f": 2.0, "test_g": 1.0}, "comments": {},
                                              "late_penalty": None}}})
        flagged = {g.name: g.needs_manual_grade for g in gb.find_submission_notebook("alpha", "alpha", "ann").grades}
    assert flagged == {"test_f": True, "test_g": False}
    path = c.notes_path("beta", "ann")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"notebook": None, "cell": None, "kind": "no_sandbox", "message": "..."}]))
    header, table = grades_table(c, ["alpha", "beta"])
    row = dict(zip(header, table[0]))
    assert row["alpha/test_f"] == 2.0 and row["total"] == 6.0
    assert row["notes"] == "needs review (score not final): alpha/test_f; graded without the sandbox: beta"

