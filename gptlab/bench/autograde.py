"""Autograding time: one full submission of every assignment, and a class of students with 1 and N workers.

Where this sits: beside the pipeline, in the instructor's workflow (``python -m gptlab course``).
In a throw-away copy of the course (``nbgrader_config.py`` + ``solutions/``, released with
``course release``), this benchmark times :func:`gptlab.course.autograde.autograde`:

* ``one_submission``: one student's submission of every assignment (the instructor's solution),
  for each worker count in ``--workers``: what a single learner costs, kernel start and
  ``import torch`` included (the worker processes' start too);
* ``class_workers_<n>``: ``--students`` students (solutions, with every ``--blank-every``-th
  student handing in the blank release) for each worker count in ``--workers``, and the speed-up
  over the first count;
* ``runs``: every run above as one record: students, assignments, submissions, workers, seconds,
  seconds per submission, speed-up over the first worker count, the CPU seconds it used (this
  process and its finished descendants: workers, kernels), the load averages before and after;
* ``sandbox_cost`` (``--sandbox-cost N``): one full submission of every assignment graded N times
  with the operating-system sandbox (:mod:`gptlab.course.sandbox`) and N times without it
  (``--no-sandbox``), alternated so that a drift of the machine hits both; the medians, their
  spread and their ratio (target: the sandbox costs at most 10%);
* ``test_cells``: for every graded test cell, the longest time its trusted verdict took over all
  those runs (the grader's checks and the learner's calls they make, recorded by the autograder
  in the cell's ``gptlab.verdict.seconds``). A test cell must give its verdict in under 5 s on
  2 cores.

Target: N workers never slower than one, for any class size, and close to N times faster than
one on a class (on a machine with at least N free cores).
"""

from __future__ import annotations

import copy
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ..course import Course, CourseError, release
from ..course.autograde import autograde
from ..device import cpu_model
from ..files import atomic_write_text
from . import error, machine_name

__all__ = ["run", "copy_course", "solved_notebook", "released_copy"]


def solved_notebook(release: dict, solution: dict) -> dict:
    answers = {c["metadata"]["nbgrader"]["grade_id"]: c["source"] for c in solution["cells"]
               if c["metadata"].get("nbgrader", {}).get("solution")}
    nb = copy.deepcopy(release)
    for c in nb["cells"]:
        gid = c["metadata"].get("nbgrader", {}).get("grade_id")
        if gid in answers:
            c["source"] = answers[gid]
    return nb


def _submit(course: Path, assignments: list[str], students: list[str], blank_every: int) -> None:
    sub = course / "submitted"
    if sub.exists():
        shutil.rmtree(sub)
    for name in assignments:
        for path in sorted((course / "exercises" / name).glob("*.ipynb")):
            release = json.loads(path.read_text())
            solved = solved_notebook(release, json.loads((course / "solutions" / name / path.name).read_text()))
            for k, student in enumerate(students):
                blank = blank_every > 0 and (k + 1) % blank_every == 0
                dest = sub / student / name / path.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(json.dumps(release if blank else solved))


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished descendants (worker processes, kernels)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _declared_limits(course: Path) -> dict[str, float]:
    """``assignment/grade_id`` -> the time limit a test cell declares (``gptlab.timeout``: the
    graded training), for the cells exempt from the 5 s rule."""
    limits = {}
    for path in sorted((course / "solutions").glob("*/*.ipynb")):
        for cell in json.loads(path.read_text()).get("cells", []):
            gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            limit = cell.get("metadata", {}).get("gptlab", {}).get("timeout")
            if gid and limit:
                limits[f"{path.parent.name}/{gid}"] = float(limit)
    return limits


def _fresh_gradebook(course: Path) -> None:
    for p in ("gradebook.db", "autograded", "feedback"):
        q = course / p
        if q.is_dir():
            shutil.rmtree(q)
        elif q.exists():
            q.unlink()


def _note_times(results, cells: dict[str, float]) -> None:
    """Keep in ``cells`` the longest time each test cell's verdict took (``assignment/grade_id``)."""
    for r in results:
        for nb, times in r["times"].items():
            for gid, s in times.items():
                if gid.startswith("test_"):
                    key = f"{r['assignment']}/{gid}"
                    cells[key] = max(cells.get(key, 0.0), s)


def _timed(course, names: list[str], students: list[str], label: str, worker_counts: list[int],
           timeout: int | None, fig: dict, cells: dict[str, float]):
    """One fresh gradebook and one autograde run per worker count: yields (workers, seconds,
    results) for each; stops early when a count gives other scores than the first."""
    scores, runs = None, []
    for w in worker_counts:
        _fresh_gradebook(course.root)
        load = os.getloadavg()
        cpu0 = _cpu_seconds()
        t0 = time.perf_counter()
        res = autograde(course, names, workers=w, timeout=timeout, progress=False)
        wall = time.perf_counter() - t0
        cpu = _cpu_seconds() - cpu0
        got = sorted((r["assignment"], r["student"], r["total"]) for r in res)
        if scores is not None and got != scores:
            error("autograde", f"{w} workers gave other scores than {worker_counts[0]}")
            return
        scores = got
        _note_times(res, cells)
        n = len(students) * len(names)
        run = {"run": label, "students": len(students), "assignments": len(names), "submissions": n,
               "workers": w, "seconds": wall, "per_submission_s": wall / n, "cpu_s": cpu,
               "load_average_before": load, "load_average_after": os.getloadavg()}
        if runs:
            run["speedup_vs_workers_" + str(worker_counts[0])] = runs[0]["seconds"] / wall
        runs.append(run)
        fig["runs"].append(run)
        print(f"{len(students)} student(s) x {len(names)} assignment(s), {w} worker(s): {wall:.1f} s "
              f"({wall / n:.2f} s per submission, {cpu:.0f} CPU s)"
              + (f", {runs[0]['seconds'] / wall:.2f}x {worker_counts[0]} worker(s)" if len(runs) > 1 else ""))
        yield w, wall, res


def copy_course(src: Path, course_dir: Path) -> None:
    """The throw-away course: ``src``'s nbgrader_config.py and solutions/ copied into ``course_dir``."""
    course_dir.mkdir()
    shutil.copy(src / "nbgrader_config.py", course_dir)
    shutil.copytree(src / "solutions", course_dir / "solutions",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))


def released_copy(src: Path, folder: Path) -> tuple[Course, list[str]]:
    """The throw-away course ``folder/course`` (:func:`copy_course`), released; its assignments.
    Raises :class:`CourseError` where it cannot be released."""
    course_dir = folder / "course"
    copy_course(src, course_dir)
    course = Course(course_dir)
    assignments = course.assignments()
    release(course, assignments, progress=False)
    return course, assignments


def _one_submission(course_dir: Path, assignments: list[str], worker_counts: list[int], timed, fig: dict) -> bool:
    """The ``one_submission`` runs into ``fig``; False where a worker count gave other scores."""
    _submit(course_dir, assignments, ["one"], 0)
    done = 0
    for w, wall, res in timed(assignments, ["one"], "one_submission"):
        done += 1
        fig[f"one_submission_workers_{w}_s"] = wall
        if w == worker_counts[0]:
            fig["one_submission_s"] = wall
            fig["one_submission_per_assignment_s"] = {r["assignment"]: r["seconds"] for r in res}
            fig["one_submission_scores"] = {r["assignment"]: r["total"] for r in res}
            print("  (" + ", ".join(f"{a} {s:.1f} s" for a, s in fig["one_submission_per_assignment_s"].items())
                  + ")")
    if done < len(worker_counts):
        return False
    for w in worker_counts[1:]:
        fig[f"one_submission_speedup_{w}_vs_{worker_counts[0]}"] = \
            fig[f"one_submission_workers_{worker_counts[0]}_s"] / fig[f"one_submission_workers_{w}_s"]
    return True


def _class_runs(args, course_dir: Path, assignments: list[str], n_students: int, worker_counts: list[int],
                timed, fig: dict) -> int | None:
    """The ``class`` runs into ``fig``; the exit status where they cannot be done or compared."""
    in_class = [a for a in args.class_assignments.split(",") if a.strip()] or assignments
    unknown = [a for a in in_class if a not in assignments]
    if unknown:
        error("autograde", f"unknown assignment(s) {', '.join(unknown)}")
        return 2
    fig["class_assignments"] = in_class
    students = [f"student{k:02d}" for k in range(n_students)]
    if students:
        _submit(course_dir, in_class, students, args.blank_every)
        done = 0
        for w, wall, _ in timed(in_class, students, "class"):
            done += 1
            fig[f"class_workers_{w}_s"] = wall
        if done < len(worker_counts):
            return 1
        base = fig.get(f"class_workers_{worker_counts[0]}_s")
        for w in worker_counts[1:]:
            fig[f"speedup_{w}_vs_{worker_counts[0]}"] = base / fig[f"class_workers_{w}_s"]
    return None


def _sandbox_cost(course, assignments: list[str], repeats: int, timeout: int | None, fig: dict) -> bool:
    """One full submission (the solutions, one worker) graded ``repeats`` times with and without the
    sandbox, alternated; the figures into ``fig["sandbox_cost"]``. False where the scores differ."""
    import statistics

    _submit(course.root, assignments, ["one"], 0)
    times: dict[bool, list[float]] = {True: [], False: []}
    scores: dict[bool, list] = {}
    for k in range(repeats):
        for sandbox in ((True, False) if k % 2 == 0 else (False, True)):
            _fresh_gradebook(course.root)
            t0 = time.perf_counter()
            res = autograde(course, assignments, workers=1, timeout=timeout, progress=False, sandbox=sandbox)
            times[sandbox].append(time.perf_counter() - t0)
            got = sorted((r["assignment"], r["total"]) for r in res)
            if scores.setdefault(sandbox, got) != got or scores.get(not sandbox, got) != got:
                error("autograde", "the sandbox changed the scores: "
                      f"{scores.get(True)} against {scores.get(False)}")
                return False
            print(f"one full submission, {'with' if sandbox else 'without'} the sandbox: {times[sandbox][-1]:.1f} s")
    med = {m: statistics.median(v) for m, v in times.items()}
    fig["sandbox_cost"] = {"repeats": repeats, "with_s": times[True], "without_s": times[False],
                           "median_with_s": med[True], "median_without_s": med[False],
                           "spread_with_s": max(times[True]) - min(times[True]),
                           "spread_without_s": max(times[False]) - min(times[False]),
                           "ratio": med[True] / med[False]}
    print(f"sandbox cost on one full submission ({len(assignments)} assignments, 1 worker, median of {repeats}): "
          f"{med[True]:.1f} s with, {med[False]:.1f} s without: {med[True] / med[False]:.3f}x "
          f"(spread {fig['sandbox_cost']['spread_with_s']:.1f} s and {fig['sandbox_cost']['spread_without_s']:.1f} s)")
    return True


def _report_test_cells(fig: dict, cells: dict[str, float], src: Path) -> None:
    """The longest verdict of each test cell into ``fig``, and printed (with the declared limits)."""
    fig["test_cells_max_s"] = dict(sorted(cells.items()))
    fig["slowest_test_cell_s"] = max(cells.values()) if cells else None
    fig["load_average_after"] = os.getloadavg()
    limits = _declared_limits(src)
    fig["test_cells_declared_limit_s"] = {k: limits[k] for k in fig["test_cells_max_s"] if k in limits}
    print("longest trusted verdict of each test cell (s):")
    for k, s in fig["test_cells_max_s"].items():
        flag = f"   (declared limit {limits[k]:g} s)" if k in limits else ("   OVER 5 s" if s >= 5 else "")
        print(f"  {k:60s} {s:6.2f}{flag}")


def run(args) -> int:
    src = Path(args.course) if args.course else Path(__file__).resolve().parents[2]
    if not (src / "nbgrader_config.py").is_file() or not (src / "solutions").is_dir():
        error("autograde", f"{src} has no nbgrader_config.py and solutions/ (pass --course)")
        return 2
    n_students = 4 if args.quick else args.students
    try:
        worker_counts = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        error("autograde", f"--workers must be comma-separated integers, got {args.workers!r}")
        return 2
    load_before = os.getloadavg()
    fig: dict = {"benchmark": "autograde", "machine": machine_name(), "cpu_model": cpu_model(),
                 "cpu_count": os.cpu_count(), "torch": torch.__version__,
                 "load_average_before": load_before, "students": n_students, "blank_every": args.blank_every,
                 "workers": worker_counts, "runs": []}
    cells: dict[str, float] = {}

    with tempfile.TemporaryDirectory(prefix="gptlab-bench-autograde-") as tmp:
        try:
            course, assignments = released_copy(src, Path(tmp))
        except CourseError as e:
            error("autograde", str(e))
            return 2
        course_dir = course.root
        fig["assignments"] = assignments
        print(f"machine: {fig['machine']}")
        print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")

        def timed(names: list[str], students: list[str], label: str):
            return _timed(course, names, students, label, worker_counts, args.timeout, fig, cells)

        if getattr(args, "sandbox_cost", 0):
            if not _sandbox_cost(course, assignments, args.sandbox_cost, args.timeout, fig):
                return 1
            if getattr(args, "only_sandbox_cost", False):
                if args.json:
                    atomic_write_text(Path(args.json), json.dumps(fig, indent=2) + "\n")
                    print(f"wrote {args.json}")
                return 0
        if not _one_submission(course_dir, assignments, worker_counts, timed, fig):
            return 1
        status = _class_runs(args, course_dir, assignments, n_students, worker_counts, timed, fig)
        if status is not None:
            return status

    _report_test_cells(fig, cells, src)
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(fig, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
