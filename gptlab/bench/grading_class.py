"""A class graded one submission per job: ``python -m gptlab bench class --students N --workers W``.

Where this sits: beside the pipeline, in the instructor's workflow. In a throw-away copy of the
course (``nbgrader_config.py`` + ``solutions/``, released), ``N`` synthetic students hand in every
assignment: in turn a correct one (the solutions), a partly wrong one (the last task of each
assignment left as released), a blank one (the release) and a hostile one (the release, plus a cell
that kills its kernel's parent, starts a detached process and reads what it can of the file
system). ``course autograde --workers W`` grades them, every notebook a grade-one job in the
sandbox (:mod:`gptlab.course.grade_one`). It reports:

* the wall time, the jobs per core-hour (jobs / (W x hours)), the slowest job and each
  assignment's job times (mean, median, 90th percentile, maximum);
* the projection for ``--project-students`` students x every assignment on ``--project-cores``
  cores (one job per core): the summed job time of a class whose students are like these,
  divided by the cores, assuming cores as fast as this machine's; and the same if every job took
  the longest time seen for its assignment (a class of correct, complete submissions is nearer
  this one: the graded training runs in full);
* a plot of the jobs over time, one row per worker (``--plot``), and the figures as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..course import CourseError
from ..course.autograde import autograde
from ..device import cpu_model
from ..files import atomic_write_text
from . import error, machine_name
from .autograde import released_copy, solved_notebook

__all__ = ["run"]

HOSTILE = ("import os, signal, subprocess, sys\n"
           "try:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept Exception:\n    pass\n"
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
           "seen = []\nfor root, dirs, files in os.walk('/'):\n"
           "    if root.startswith(('/proc', '/sys', '/usr', '/dev')) or len(seen) > 2000:\n"
           "        dirs[:] = []\n    seen += files\nprint(len(seen), 'files seen')\n")


def _kinds(k: int) -> str:
    return ("correct", "partly", "blank", "hostile")[k % 4]


def _submit(course: Path, assignments: list[str], students: list[str]) -> dict[str, str]:
    """Write every student's submission of every assignment; returns student -> kind."""
    kinds = {}
    for name in assignments:
        for path in sorted((course / "exercises" / name).glob("*.ipynb")):
            rel = json.loads(path.read_text())
            solution = json.loads((course / "solutions" / name / path.name).read_text())
            solved = solved_notebook(rel, solution)
            answers = [c for c in solved["cells"] if c["metadata"].get("nbgrader", {}).get("solution")]
            partly = json.loads(json.dumps(solved))
            if answers:  # the last answer cell as released
                last = answers[-1]["metadata"]["nbgrader"]["grade_id"]
                stub = next(c for c in rel["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == last)
                for c in partly["cells"]:
                    if c["metadata"].get("nbgrader", {}).get("grade_id") == last:
                        c["source"] = stub["source"]
            hostile = json.loads(json.dumps(rel))
            hostile["cells"].insert(1, {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                                        "source": HOSTILE})
            notebooks = {"correct": solved, "partly": partly, "blank": rel, "hostile": hostile}
            for k, student in enumerate(students):
                kinds[student] = _kinds(k)
                dest = course / "submitted" / student / name / path.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(json.dumps(notebooks[kinds[student]]))
    return kinds


def _plot(jobs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t_start = min(j["t0"] for j in jobs)
    slots = sorted({j["slot"] for j in jobs})
    names = sorted({j["assignment"] for j in jobs})
    colours = {n: plt.get_cmap("tab10")(k % 10) for k, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.45 * len(slots)))
    for j in jobs:
        ax.barh(slots.index(j["slot"]), j["t1"] - j["t0"], left=j["t0"] - t_start, color=colours[j["assignment"]],
                edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(slots)), [f"worker {k + 1}" for k in range(len(slots))])
    ax.set_xlabel("seconds since the run started")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
    ax.legend(handles, names, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    src = Path(args.course) if args.course else Path(__file__).resolve().parents[2]
    if not (src / "nbgrader_config.py").is_file() or not (src / "solutions").is_dir():
        error("class", f"{src} has no nbgrader_config.py and solutions/ (pass --course)")
        return 2
    fig: dict = {"benchmark": "class", "machine": machine_name(), "cpu_model": cpu_model(),
                 "cpu_count": os.cpu_count(), "torch": torch.__version__, "students": args.students,
                 "workers": args.workers, "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="gptlab-bench-class-") as tmp:
        try:
            course, assignments = released_copy(src, Path(tmp))
        except CourseError as e:
            error("class", str(e))
            return 2
        course_dir = course.root
        students = [f"student{k:03d}" for k in range(args.students)]
        kinds = _submit(course_dir, assignments, students)
        print(f"machine: {fig['machine']}")
        print(f"{len(students)} students x {len(assignments)} assignments, {args.workers} worker(s) ...")
        t0 = time.perf_counter()
        results = autograde(course, assignments, workers=args.workers, progress=not args.quiet)
        wall = time.perf_counter() - t0
    jobs = [j for r in results for j in r.get("jobs", []) if j.get("t0") is not None]
    n = len(jobs)
    durations = {a: [j["t1"] - j["t0"] for j in jobs if j["assignment"] == a] for a in assignments}
    per_assignment = {}
    for a, d in durations.items():
        if d:
            d = sorted(d)
            per_assignment[a] = {"jobs": len(d), "mean_s": statistics.mean(d), "median_s": statistics.median(d),
                                 "p90_s": d[int(0.9 * (len(d) - 1))], "max_s": d[-1],
                                 "stdev_s": statistics.pstdev(d)}
    slowest = max(jobs, key=lambda j: j["t1"] - j["t0"]) if jobs else None
    totals_by_kind: dict[str, list[float]] = {}
    for r in results:
        totals_by_kind.setdefault(kinds[r["student"]], []).append(r["total"])
    job_seconds = sum(j["t1"] - j["t0"] for j in jobs)
    per_student = job_seconds / max(1, len(students))
    projected = args.project_students * per_student / args.project_cores
    # the same class if every student's every job took the longest time seen for its assignment
    worst_student = sum(st["max_s"] for st in per_assignment.values())
    worst = args.project_students * worst_student / args.project_cores
    fig.update({"assignments": assignments, "jobs": n, "wall_s": wall,
                "jobs_per_core_hour": n / (args.workers * wall / 3600) if wall else None,
                "mean_job_s": job_seconds / n if n else None, "job_seconds": job_seconds,
                "slowest_job": ({"assignment": slowest["assignment"], "student": slowest["student"],
                                 "kind": kinds[slowest["student"]], "seconds": slowest["t1"] - slowest["t0"]}
                                if slowest else None),
                "per_assignment": per_assignment,
                "scores_by_kind": {k: sorted(set(v)) for k, v in totals_by_kind.items()},
                "projection": {"students": args.project_students, "assignments": len(assignments),
                               "cores": args.project_cores, "job_seconds_per_student": per_student,
                               "hours": projected / 3600,
                               "worst_case_job_seconds_per_student": worst_student,
                               "worst_case_hours": worst / 3600},
                "job_times": [{"assignment": j["assignment"], "kind": kinds[j["student"]], "slot": j["slot"],
                               "start_s": j["t0"] - min(x["t0"] for x in jobs), "seconds": j["t1"] - j["t0"]}
                              for j in jobs],
                "load_average_after": os.getloadavg()})
    print(f"{n} jobs in {wall:.1f} s with {args.workers} worker(s): {fig['jobs_per_core_hour']:.0f} jobs per core-hour, "
          f"mean job {fig['mean_job_s']:.2f} s")
    if slowest:
        print(f"slowest job: {slowest['assignment']} of {slowest['student']} ({kinds[slowest['student']]}), "
              f"{slowest['t1'] - slowest['t0']:.1f} s")
    for a, st in per_assignment.items():
        print(f"  {a:14s} {st['jobs']:4d} jobs  mean {st['mean_s']:6.2f} s  median {st['median_s']:6.2f} s  "
              f"p90 {st['p90_s']:6.2f} s  max {st['max_s']:6.2f} s")
    print(f"projection: {args.project_students} students x {len(assignments)} assignments on {args.project_cores} "
          f"cores: {projected / 3600:.2f} h ({per_student:.1f} job-seconds per student, cores as fast as these); "
          f"if every job took its assignment's longest time: {worst / 3600:.2f} h ({worst_student:.1f} s per student)")
    if args.plot and jobs:
        _plot(jobs, Path(args.plot), f"{len(students)} students x {len(assignments)} assignments, "
                                     f"{args.workers} worker(s), {fig['machine'].split(',')[0]}")
        print(f"wrote {args.plot}")
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(fig, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
