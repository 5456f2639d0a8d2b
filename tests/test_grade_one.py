"""One submission, one job (issue 32): grade-one, import-results, the jobs list, the Gradescope autograder.

* ``course grade-one`` grades one notebook with no gradebook and writes a result (per test cell the
  points, the maximum, the verdict's kind and message, what the code printed, the seconds); its exit
  status says whether grading worked, never whether the learner passed.
* ``course import-results`` merges a folder of results: the same gradebook rows as ``course
  autograde``; running it twice changes nothing; an unknown student or assignment, or a result of
  another version of the assignment, is named and skipped.
* ``course jobs`` prints one grade-one command per submission: the README's ``xargs -P`` line runs
  them, and their merged results equal ``course autograde``'s.
* ``course export-gradescope``: the zip laid out as Gradescope's ``/autograder`` (bubblewrap binds
  it there), ``run_autograder`` on a correct, a blank and a hostile submission: ``results.json`` in
  Gradescope's format with the scores ``course autograde`` gives; ``setup.sh`` in a fresh virtual
  environment (slow).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_course_run import RIGHT, TINY, WRONG_G, _submit, _tiny

from gptlab.__main__ import main
from gptlab.course import Course
from gptlab.course import autograde as ag
from gptlab.course.grade_one import FORMAT, grade_one
from gptlab.course.sandbox import bwrap_executable, unavailable

REPO = Path(__file__).resolve().parent.parent
LINUX = sys.platform.startswith("linux")


@pytest.fixture
def course(tmp_path) -> Path:
    root = tmp_path / "course"
    root.mkdir()
    shutil.copy(REPO / "nbgrader_config.py", root)
    for name in TINY[:2]:
        _tiny(root, name)
    assert main(["course", "release", "--course", str(root), "--quiet"]) == 0
    for student, answers in (("ann", RIGHT), ("bob", WRONG_G), ("cy", {})):
        for name in TINY[:2]:
            _submit(root, student, name, answers)
    return root


def _rows(course: Path) -> list[tuple]:
    con = sqlite3.connect(course / "gradebook.db")
    try:
        return con.execute(
            "SELECT a.name, sa.student_id, bc.name, g.auto_score, g.manual_score, g.needs_manual_grade FROM grade g "
            "JOIN submitted_notebook sn ON g.notebook_id = sn.id JOIN submitted_assignment sa ON sn.assignment_id = sa.id "
            "JOIN assignment a ON sa.assignment_id = a.id JOIN base_cell bc ON g.cell_id = bc.id ORDER BY 1, 2, 3"
        ).fetchall()
    finally:
        con.close()


def test_grade_one_writes_a_result_and_exits_0_whatever_the_learner_scored(course, tmp_path, capsys):
    release = course / "exercises" / "alpha" / "alpha.ipynb"
    for student, want in (("ann", 3.0), ("bob", 2.0), ("cy", 0.0)):
        out = tmp_path / f"{student}.json"
        code = main(["course", "grade-one", str(course / "submitted" / student / "alpha" / "alpha.ipynb"),
                     "--assignment", "alpha", "--release", str(release), "--student", student, "--out", str(out),
                     "--quiet"])
        assert code == 0
        result = json.loads(out.read_text())
        assert result["format"] == FORMAT and result["student"] == student and result["score"] == want
        assert result["max_score"] == 3.0 and set(result["cells"]) == {"test_f", "test_g"}
        for cell in result["cells"].values():
            assert set(cell) >= {"points", "max_points", "kind", "message", "printed", "seconds", "review"}
        assert result["sandbox"] is True and result["error"] is None and result["submission_sha256"]
    bob = json.loads((tmp_path / "bob.json").read_text())["cells"]["test_g"]
    assert bob["points"] == 0.0 and "AssertionError" in bob["message"]
    # bad input: exit 2 and one line; no result written
    assert main(["course", "grade-one", str(tmp_path / "nope.ipynb"), "--assignment", "alpha", "--release",
                 str(release), "--out", str(tmp_path / "x.json")]) == 2
    assert "no notebook at" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    assert main(["course", "grade-one", str(release), "--assignment", "alpha", "--release", str(tmp_path),
                 "--out", str(tmp_path / "x.json")]) == 2
    # a malformed notebook is the learner's: graded 0, exit 0
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    assert main(["course", "grade-one", str(bad), "--assignment", "alpha", "--release", str(release),
                 "--out", str(tmp_path / "bad.json"), "--quiet"]) == 0
    result = json.loads((tmp_path / "bad.json").read_text())
    assert result["score"] == 0.0 and "not valid JSON" in result["notes"][0]["message"]


def test_import_results_merges_like_autograde_once_and_names_what_it_skips(course, tmp_path, capsys):
    # the same submissions through course autograde, in a copy of the course
    other = tmp_path / "other"
    shutil.copytree(course, other)
    ag.autograde(Course(other), ["alpha", "beta"], workers=2, progress=False)
    results = tmp_path / "results"
    for student in ("ann", "bob", "cy"):
        for name in ("alpha", "beta"):
            grade_one(course / "submitted" / student / name / f"{name}.ipynb", name,
                      course / "exercises" / name / f"{name}.ipynb", student=student,
                      out=results / name / student / f"{name}.json",
                      notebook_out=results / name / student / f"{name}.ipynb")
    ag._ensure_assignment(Course(course), "alpha")
    ag._ensure_assignment(Course(course), "beta")
    assert main(["course", "import-results", str(results), "--course", str(course)]) == 0
    assert "6 result(s) merged" in capsys.readouterr().out
    assert _rows(course) == _rows(other)
    assert (course / "autograded" / "bob" / "beta" / "beta.ipynb").is_file()
    assert main(["course", "import-results", str(results), "--course", str(course)]) == 0
    assert _rows(course) == _rows(other)  # twice: nothing changes
    # what is skipped, and named
    odd = tmp_path / "odd"
    odd.mkdir()
    one = json.loads((results / "alpha" / "ann" / "alpha.json").read_text())
    (odd / "zed.json").write_text(json.dumps({**one, "student": "zed"}))
    (odd / "gamma.json").write_text(json.dumps({**one, "assignment": "gamma"}))
    (odd / "old.json").write_text(json.dumps({**one, "assignment_version": "0123456789abcdef"}))
    (odd / "junk.json").write_text("[1, 2]")
    capsys.readouterr()
    assert main(["course", "import-results", str(odd), "--course", str(course)]) == 0
    out = capsys.readouterr().out
    assert "unknown student 'zed'" in out and "unknown assignment 'gamma'" in out
    assert "another version of alpha" in out and "not a grade-one result" in out and "0 result(s) merged" in out
    assert _rows(course) == _rows(other)
    assert main(["course", "import-results", str(odd), "--course", str(course), "--add-students"]) == 0
    assert any(r[1] == "zed" for r in _rows(course))


def test_the_readmes_xargs_line_grades_every_submission_like_autograde(course, tmp_path):
    """`course jobs ... | xargs -P 2 -I{} sh -c {}` then `course import-results`: the README's
    one-machine recipe, as written there."""
    other = tmp_path / "other"
    shutil.copytree(course, other)
    ag.autograde(Course(other), ["alpha", "beta"], workers=2, progress=False)
    readme = (REPO / "README.md").read_text()
    line = next(x.strip() for x in readme.splitlines() if "xargs -P" in x and "course jobs" in x)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run(line, shell=True, cwd=course, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(list((course / "results").rglob("*.json"))) == 6
    done = subprocess.run([sys.executable, "-m", "gptlab", "course", "import-results", "results"], cwd=course,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "6 result(s) merged" in done.stdout, done.stdout + done.stderr
    assert _rows(course) == _rows(other)


# --------------------------------------------------------------------------- Gradescope


def _unzip(zip_path: Path, dest: Path) -> None:
    with zipfile.ZipFile(zip_path) as z:
        for info in z.infolist():
            z.extract(info, dest)
            os.chmod(dest / info.filename, (info.external_attr >> 16) & 0o777)


def _run_autograder(layout: Path, venv: Path) -> dict:
    """``run_autograder`` as Gradescope runs it: ``layout`` bound at /autograder (bubblewrap), the
    test's own environment as /autograder/venv."""
    argv = [bwrap_executable(), "--dev-bind", "/", "/", "--bind", str(layout), "/autograder",
            "--bind", str(venv), "/autograder/venv", "--", "/autograder/run_autograder"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((layout / "results" / "results.json").read_text())


def _check_format(results: dict) -> None:
    """Gradescope's documented results.json: the fields this autograder writes, their types."""
    assert set(results) >= {"score", "execution_time", "output", "stdout_visibility", "tests"}
    assert isinstance(results["score"], float) and isinstance(results["execution_time"], int)
    assert results["stdout_visibility"] in ("hidden", "visible")
    for test in results["tests"]:
        assert set(test) >= {"name", "score", "max_score", "output", "visibility", "status"}
        assert test["visibility"] in ("visible", "hidden", "after_due_date", "after_published")
        assert test["status"] in ("passed", "failed") and 0 <= test["score"] <= test["max_score"]
    assert results["score"] == pytest.approx(sum(t["score"] for t in results["tests"]))


@pytest.mark.slow
@pytest.mark.skipif(not LINUX or unavailable() is not None, reason="needs bubblewrap (Linux)")
def test_the_gradescope_autograder_gives_the_scores_of_course_autograde(tmp_path):
    from test_trusted_grading import _course, _Release

    root = _course(tmp_path / "course", ["causal_mask"])
    r = _Release(root, "causal_mask")
    hostile = r.extra(r.release, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                                 "print(open('/autograder/source/grading-secret').read())\n")
    subs = {"correct": r.solved(), "blank": r.release, "hostile": hostile,
            "lost": r.answer("causal_mask", "def causal_mask(T):\n    return torch.ones(T, T, dtype=torch.bool)\n")}
    inbox = tmp_path / "inbox"
    for student, nb in subs.items():
        (inbox / student).mkdir(parents=True)
        (inbox / student / "causal_mask.ipynb").write_text(json.dumps(nb))
    assert main(["course", "collect", str(inbox), "--assignment", "causal_mask", "--course", str(root)]) == 0
    graded = {x["student"]: x for x in ag.autograde(Course(root), ["causal_mask"], workers=2, progress=False)}
    zip_path = tmp_path / "autograder.zip"
    assert main(["course", "export-gradescope", "causal_mask", "--out", str(zip_path), "--course", str(root),
                 "--after-due-date", "test_combine_masks"]) == 0
    venv = Path(sys.prefix)
    secret = None
    for student, nb in subs.items():
        layout = tmp_path / f"autograder-{student}"
        (layout / "submission").mkdir(parents=True)
        (layout / "results").mkdir()
        (layout / "venv").mkdir()
        _unzip(zip_path, layout / "source")
        shutil.copy(layout / "source" / "run_autograder", layout / "run_autograder")
        secret = (layout / "source" / "grading-secret").read_text().strip()
        (layout / "submission" / "causal_mask.ipynb").write_text(json.dumps(nb))
        results = _run_autograder(layout, venv)
        _check_format(results)
        want = graded[student]["notebooks"]["causal_mask"]["grades"]
        assert {t["name"]: t["score"] for t in results["tests"]} == want, (student, results)
        visibility = {t["name"]: t["visibility"] for t in results["tests"]}
        assert visibility["test_combine_masks"] == "after_due_date" and visibility["test_causal_mask"] == "visible"
        text = json.dumps(results)
        assert secret not in text  # the hostile notebook could not read it
        if student == "lost":  # failed on the visible case: the message shows it; nothing of the hidden run
            assert "Most likely mistake" in text
    assert graded["correct"]["total"] == 10.0 and graded["hostile"]["total"] == 0.0


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the autograder's set-up is a bash script for Linux")
def test_setup_sh_installs_a_working_autograder_in_a_fresh_environment(tmp_path):
    """setup.sh, as Gradescope runs it once (apt-get skipped: the machine has Python), makes
    /autograder/venv from the zip's wheel and pinned requirements; run_autograder then grades."""
    root = tmp_path / "course"
    root.mkdir()
    shutil.copy(REPO / "nbgrader_config.py", root)
    _tiny(root, "alpha")
    assert main(["course", "release", "--course", str(root), "--quiet"]) == 0
    zip_path = tmp_path / "autograder.zip"
    assert main(["course", "export-gradescope", "alpha", "--out", str(zip_path), "--course", str(root)]) == 0
    layout = tmp_path / "autograder"
    _unzip(zip_path, layout / "source")
    shutil.copy(layout / "source" / "run_autograder", layout / "run_autograder")
    (layout / "submission").mkdir()
    nb = json.loads((root / "exercises" / "alpha" / "alpha.ipynb").read_text())
    for c in nb["cells"]:
        gid = c["metadata"].get("nbgrader", {}).get("grade_id")
        if gid in RIGHT:
            c["source"] = RIGHT[gid]
    (layout / "submission" / "alpha.ipynb").write_text(json.dumps(nb))
    env = {**os.environ, "GPTLAB_AUTOGRADER_ROOT": str(layout), "GPTLAB_SKIP_APT": "1",
           "GPTLAB_PYTHON": sys.executable, "PIP_CONSTRAINT": ""}
    done = subprocess.run(["bash", str(layout / "source" / "setup.sh")], env=env, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (layout / "venv" / "bin" / "python").exists()
    done = subprocess.run([str(layout / "run_autograder")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((layout / "results" / "results.json").read_text())
    _check_format(results)
    assert results["score"] == 3.0


@pytest.mark.slow
def test_bench_class_reports_a_class_through_grade_one(tmp_path):
    """`bench class` on a small torch-free course: every synthetic student graded, the figures and
    the plot written (the measured run is in benchmarks/results/)."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "nbgrader_config.py", src)
    _tiny(src, "alpha")
    out, plot = tmp_path / "class.json", tmp_path / "class.png"
    assert main(["bench", "class", "--course", str(src), "--students", "4", "--workers", "2", "--quiet",
                 "--json", str(out), "--plot", str(plot)]) == 0
    fig = json.loads(out.read_text())
    assert fig["jobs"] == 4 and fig["per_assignment"]["alpha"]["jobs"] == 4 and plot.stat().st_size > 1000
    assert fig["scores_by_kind"] == {"correct": [3.0], "partly": [2.0], "blank": [0.0], "hostile": [0.0]}
    assert 0 < fig["projection"]["hours"] <= fig["projection"]["worst_case_hours"]
    assert len(fig["job_times"]) == 4 and fig["slowest_job"]["seconds"] > 0


def test_a_late_submission_gets_the_courses_late_penalty_in_the_gradebook_and_the_sheet(course, tmp_path):
    """nbgrader's late penalty (its LateSubmissionPlugin, from the due date and the submission's
    time) is applied when a result is merged, and grades.csv takes it off the assignment's total."""
    from datetime import datetime

    from nbgrader.api import Gradebook

    from gptlab.course import grades_table

    with open(course / "nbgrader_config.py", "a") as f:
        f.write('\nc.LateSubmissionPlugin.penalty_method = "zero"\n')
    ag._ensure_assignment(Course(course), "alpha")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        gb.update_or_create_assignment("alpha", duedate=datetime(2026, 3, 1, 12, 0))
    results = tmp_path / "results"
    stamps = {"ann": "2026-03-02 15:00:00 UTC", "bob": "2026-03-01 11:00:00 UTC"}  # 27 h late; on time
    for student, stamp in stamps.items():
        grade_one(course / "submitted" / student / "alpha" / "alpha.ipynb", "alpha",
                  course / "exercises" / "alpha" / "alpha.ipynb", student=student, timestamp=stamp,
                  out=results / student / "alpha.json")
    assert main(["course", "import-results", str(results), "--course", str(course)]) == 0
    header, rows = grades_table(Course(course), ["alpha"])
    got = {r[0]: dict(zip(header, r)) for r in rows}
    assert got["ann"]["alpha/test_f"] == 2.0 and got["ann"]["alpha/test_g"] == 1.0  # the cells keep their points
    assert got["ann"]["alpha"] == 0.0 and got["ann"]["total"] == 0.0  # "zero": the whole score
    assert "late penalty: alpha (-3, 27.0 h after the due date)" in got["ann"]["notes"]
    assert got["bob"]["alpha"] == 2.0 and not (got["bob"]["notes"] or "").count("late")  # on time: bob's 2 of 3
    # the penalty follows the course's policy: with none, the late submission keeps its score
    with open(course / "nbgrader_config.py", "a") as f:
        f.write('\nc.LateSubmissionPlugin.penalty_method = "none"\n')
    assert main(["course", "import-results", str(results), "--course", str(course)]) == 0
    header, rows = grades_table(Course(course), ["alpha"])
    totals = {r[0]: r[header.index("alpha")] for r in rows}
    assert (totals["ann"], totals["bob"]) == (3.0, 2.0)


def test_the_gradescope_requirements_pin_public_versions():
    """requirements.txt pins what is installed here, without local labels: "torch==2.13.0" for an
    installed "2.13.0+cpu" (no index but PyTorch's own holds "+cpu"; "==2.13.0" still matches it)."""
    import torch

    from gptlab.course.gradescope import pinned_requirements

    pins = pinned_requirements()
    assert pins and all("+" not in p for p in pins), pins
    assert f"torch=={torch.__version__.split('+')[0]}" in pins
