"""The instructor's workflow, ``python -m gptlab course ...``, for every assignment in solutions/.

* ``release`` writes exactly what ``nbgrader generate_assignment`` makes, and ``exercises/`` is
  the current release.
* ``collect`` understands a folder of ``<student>.ipynb``, ``<student>/`` folders, and nbgrader's
  exchange inbound layout (latest submission wins, ids sanitized).
* One shared autograde run (2 workers) over, for each assignment: the solution (full marks), the
  blank release (zero), one planted mistake per task and one delegation from the catalogue
  (``tests/mistakes``: zero on that task, the diagnosis in the feedback HTML); and, in one
  assignment, tampering with its last task: its test cells edited to ``pass`` or deleted (the
  released test runs anyway), an endless loop (stopped by the time limit), a kernel crash
  (``os._exit``), and a notebook that is not JSON. Each costs only the affected points and leaves
  a note in the feedback.
* Re-grading students with 1 worker gives the same scores, and the gradebook holds exactly one
  grade per (student, test cell).
* A cell's declared time limit (``{"gptlab": {"timeout": S}}``) is honoured by plain
  ``nbgrader autograde`` with the repository's ``nbgrader_config.py``; a learner's own declaration
  is not.
* ``grades`` CSV: its columns and totals. Every subcommand has ``--help``.
"""

from __future__ import annotations

import copy
import csv
import html
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptlab.__main__ import main
from gptlab.course import Course
from gptlab.course.autograde import check_notebook
from gptlab.course.collect import sanitize_student_id

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from mistakes import Mistake, assignments_with_catalogues, catalogue  # noqa: E402

ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").iterdir() if p.is_dir())
TIMEOUT = 30  # per-cell limit (nbgrader_config.py's): a busy 2-core machine must not stop an honest cell
# Tampering is handled before and around nbgrader, the same way for every assignment: it is
# planted in one assignment only, to keep the shared round trip short.
TAMPERED = "causal_mask" if "causal_mask" in ASSIGNMENTS else ASSIGNMENTS[0]
TAMPERING = ["edited", "deleted", "loop", "crash", "notjson"]


def _run(*argv: str) -> int:
    return main(["course", *argv])


def _new_course(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "nbgrader_config.py", root)
    shutil.copytree(REPO / "solutions", root / "solutions", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    return root


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and ".ipynb_checkpoints" not in p.parts
    }


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    r = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A throw-away course with every assignment released by ``python -m gptlab course release``."""
    root = _new_course(tmp_path_factory.mktemp("course"))
    assert _run("release", "--course", str(root), "--quiet") == 0
    return root


# --------------------------------------------------------------------------- release


def test_exercises_are_the_current_release(released):
    """exercises/ must be exactly the current release; after editing solutions/, run `make exercises`."""
    made, committed = _files(released / "exercises"), _files(REPO / "exercises")
    assert sorted(made) == sorted(committed), "exercises/ has other files than the release: run `make exercises`"
    for name, data in made.items():
        assert committed[name] == data, f"exercises/{name} is stale: run `make exercises`"


@pytest.mark.slow
def test_release_is_byte_for_byte_nbgrader(released, tmp_path):
    other = _new_course(tmp_path / "plain")
    for name in ASSIGNMENTS:
        _nbgrader(other, "generate_assignment", name, "--force")
    assert _files(released / "exercises") == _files(other / "exercises")


def test_release_hides_solutions_and_locks_tests(released):
    for name in ASSIGNMENTS:
        for path in (released / "exercises" / name).glob("*.ipynb"):
            nb = json.loads(path.read_text())
            text = "".join("".join(c["source"]) for c in nb["cells"])
            assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
            tests = [c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade")]
            assert tests and all(c["metadata"]["nbgrader"]["locked"] for c in tests)


def test_release_rejects_an_unknown_assignment(released, capsys):
    assert _run("release", "no_such_assignment", "--course", str(released), "--quiet") == 2
    assert "unknown assignment" in capsys.readouterr().err


# --------------------------------------------------------------------------- notebooks to submit


def _ids(nb: dict) -> list[tuple[str, dict]]:
    return [(c["metadata"]["nbgrader"]["grade_id"], c) for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id")]


def tasks_of(nb: dict) -> list[str]:
    """Tasks in notebook order: solution cells ``solution_<task>``."""
    return [gid[len("solution_"):] for gid, c in _ids(nb) if c["metadata"]["nbgrader"].get("solution")
            and gid.startswith("solution_")]


def graded_cells_of(nb: dict, task: str) -> list[str]:
    return [gid for gid, c in _ids(nb) if c["metadata"]["nbgrader"].get("grade") and gid.startswith(f"test_{task}")]


def _cell(nb: dict, gid: str) -> dict:
    return next(c for g, c in _ids(nb) if g == gid)


class Assignment:
    """The release and solution of one assignment (one notebook per assignment in this course)."""

    def __init__(self, course: Path, name: str):
        paths = sorted((course / "exercises" / name).glob("*.ipynb"))
        assert len(paths) == 1, f"{name}: these tests expect one notebook per assignment, found {paths}"
        self.name, self.notebook = name, paths[0].stem
        self.release = json.loads(paths[0].read_text())
        solution = json.loads((course / "solutions" / name / paths[0].name).read_text())
        self.answers = {gid: c["source"] for gid, c in _ids(solution) if c["metadata"]["nbgrader"].get("solution")}
        self.tasks = tasks_of(self.release)
        assert self.tasks, f"{name}: no solution cell follows the convention solution_<task>"
        self.points = {gid: float(c["metadata"]["nbgrader"]["points"]) for gid, c in _ids(self.release)
                       if c["metadata"]["nbgrader"].get("grade")}
        self.last = self.tasks[-1]

    def solved(self) -> dict:
        nb = copy.deepcopy(self.release)
        for gid, c in _ids(nb):
            if gid in self.answers:
                c["source"] = self.answers[gid]
        return nb

    def with_answer(self, task: str, code: str) -> dict:
        nb = self.solved()
        _cell(nb, f"solution_{task}")["source"] = code
        return nb

    def full(self) -> dict[str, float]:
        return dict(self.points)

    def without(self, task: str) -> dict[str, float]:
        lost = set(graded_cells_of(self.release, task))
        return {gid: (0.0 if gid in lost else p) for gid, p in self.points.items()}


def _planted(a: Assignment) -> list[Mistake]:
    """One mistake per task from the catalogue, and its first delegation to a reference."""
    entries = catalogue(a.name)
    chosen = []
    for task in a.tasks:
        first = next((m for m in entries if m.task == task and not m.delegation), None)
        if first is not None:
            chosen.append(first)
    delegation = next((m for m in entries if m.delegation), None)
    if delegation is not None:
        chosen.append(delegation)
    return chosen


def _submissions(a: Assignment) -> dict[str, tuple[object, dict[str, float] | None, list[str]]]:
    """student -> (notebook JSON or raw text, expected scores or None, phrases expected in the notes)."""
    last, subs = a.last, {}
    subs["solution"] = (a.solved(), a.full(), [])
    subs["blank"] = (a.release, {g: 0.0 for g in a.points}, [])
    if a.name != TAMPERED:
        return subs
    blank_last = a.with_answer(last, "".join(_cell(a.release, f"solution_{last}")["source"]))
    edited = copy.deepcopy(blank_last)
    for gid in graded_cells_of(a.release, last):
        _cell(edited, gid)["source"] = "pass"
    subs["edited"] = (edited, a.without(last), ["had been edited; the released version was run instead"])
    deleted = copy.deepcopy(blank_last)
    deleted["cells"] = [c for c in deleted["cells"]
                        if c["metadata"].get("nbgrader", {}).get("grade_id") not in graded_cells_of(a.release, last)]
    subs["deleted"] = (deleted, a.without(last), ["was missing from the notebook; it was put back and run"])
    # the learner's function, whatever its signature, loops / kills the kernel when it is called
    fname = _function_name(a, last)
    subs["loop"] = (a.with_answer(last, f"def {fname}(*args, **kwargs):\n    while True:\n        pass\n"),
                    a.without(last), [f"stopped after {TIMEOUT} s"])
    subs["crash"] = (a.with_answer(last, f"def {fname}(*args, **kwargs):\n    import os\n    os._exit(1)\n"),
                     a.without(last), ["kernel died"])
    subs["notjson"] = (json.dumps(a.solved())[:-40], {g: 0.0 for g in a.points}, ["is not valid JSON"])
    return subs


def _function_name(a: Assignment, task: str) -> str:
    src = "".join(a.answers[f"solution_{task}"])
    m = re.search(r"^def (\w+)\(", src, flags=re.M)
    assert m, f"{a.name}: solution_{task} defines no function"
    return m.group(1)


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


# --------------------------------------------------------------------------- the shared round trip


@pytest.fixture(scope="module")
def graded(released, tmp_path_factory):
    """Every assignment's submissions collected, autograded with 2 workers, and their feedback."""
    course = released
    plan: dict[tuple[str, str], tuple[dict | None, list[str], str | None]] = {}
    for name in ASSIGNMENTS:
        a = Assignment(course, name)
        inbox = tmp_path_factory.mktemp(f"inbox-{name}")
        subs = _submissions(a)
        for student, (nb, expected, says) in subs.items():
            (inbox / student).mkdir()
            text = nb if isinstance(nb, str) else json.dumps(nb, indent=1)
            (inbox / student / f"{a.notebook}.ipynb").write_text(text)
            plan[(name, student)] = (expected, says, None)
        if name in assignments_with_catalogues():
            for k, m in enumerate(_planted(a)):
                student = f"mistake{k}"
                (inbox / student).mkdir()
                (inbox / student / f"{a.notebook}.ipynb").write_text(json.dumps(a.with_answer(m.task, m.code)))
                plan[(name, student)] = (None, [], m)
        assert _run("collect", str(inbox), "--assignment", name, "--course", str(course)) == 0
    t0 = time.perf_counter()
    from gptlab.course.autograde import autograde

    results = autograde(Course(course), ASSIGNMENTS, workers=2, timeout=TIMEOUT, progress=False)
    seconds = time.perf_counter() - t0
    assert _run("feedback", "--course", str(course), "--quiet") == 0
    return course, plan, {(r["assignment"], r["student"]): r for r in results}, seconds


def _scores(course: Path) -> dict[tuple[str, str, str], float]:
    """(assignment, student, grade_id) -> score, straight from the gradebook's tables."""
    db = sqlite3.connect(course / "gradebook.db")
    rows = db.execute(
        "SELECT a.name, sa.student_id, bc.name, g.auto_score, g.manual_score FROM grade g "
        "JOIN submitted_notebook sn ON g.notebook_id = sn.id JOIN submitted_assignment sa ON sn.assignment_id = sa.id "
        "JOIN assignment a ON sa.assignment_id = a.id JOIN base_cell bc ON g.cell_id = bc.id"
    ).fetchall()
    db.close()
    out = {}
    for a, s, gid, auto, manual in rows:
        assert (a, s, gid) not in out, f"two grades for {(a, s, gid)}"
        out[(a, s, gid)] = manual if manual is not None else auto
    return out


def _feedback(course: Path, name: str, student: str) -> str:
    pages = sorted((course / "feedback" / student / name).glob("*.html"))
    assert pages, f"no feedback for {student} in {name}"
    return "\n".join(_text(p.read_text()) for p in pages)


@pytest.mark.slow
@pytest.mark.parametrize("name", ASSIGNMENTS)
@pytest.mark.parametrize("student", ["solution", "blank"])
def test_solution_scores_full_marks_and_the_blank_release_zero(graded, name, student):
    _check_student(graded, name, student)


@pytest.mark.slow
@pytest.mark.parametrize("student", TAMPERING)
def test_tampering_costs_only_the_affected_points(graded, student):
    _check_student(graded, TAMPERED, student)


def _check_student(graded, name: str, student: str) -> None:
    course, plan, results, _ = graded
    expected, says, _ = plan[(name, student)]
    scores = _scores(course)
    got = {gid: scores[(name, student, gid)] for (a, s, gid) in scores if (a, s) == (name, student)}
    assert got == expected, f"{student} in {name}: {results[(name, student)]['notes']}"
    page = _feedback(course, name, student)
    for phrase in says:
        assert phrase in page, f"{student} in {name}: the feedback lacks {phrase!r}"
    if not says:
        assert "Notes from the autograder" not in page


@pytest.mark.slow
@pytest.mark.parametrize("name", ["causal_mask", "sampling", "speculative"])
def test_grade_one_and_import_results_give_the_scores_of_course_autograde(graded, name, tmp_path):
    """The solution, the blank release and a planted mistake, each graded alone by
    ``course grade-one`` (a subprocess, as a cluster job runs it) and merged with ``course
    import-results`` into a fresh copy of the course: the gradebook rows equal course autograde's."""
    course, plan, results, _ = graded
    students = ["solution", "blank"] + [s for (a, s) in plan if a == name and s.startswith("mistake")][:1]
    copy_dir = tmp_path / "course"
    shutil.copytree(course, copy_dir, ignore=shutil.ignore_patterns("gradebook.db", "autograded", "feedback"))
    out = tmp_path / "results"
    release = course / "exercises" / name
    for student in students:
        nb = next((course / "submitted" / student / name).glob("*.ipynb"))
        done = subprocess.run([sys.executable, "-m", "gptlab", "course", "grade-one", str(nb), "--assignment", name,
                               "--release", str(release), "--student", student, "--timeout", str(TIMEOUT),
                               "--out", str(out / f"{student}.json"), "--quiet"], capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    assert _run("release", name, "--course", str(copy_dir), "--quiet") == 0
    assert _run("import-results", str(out), "--course", str(copy_dir)) == 0
    want = {k: v for k, v in _scores(course).items() if k[0] == name and k[1] in students}
    got = {k: v for k, v in _scores(copy_dir).items() if k[0] == name}
    assert got == want


@pytest.mark.slow
def test_an_endless_loop_costs_bounded_time(graded):
    """The looping student's job ends within a few time limits (two cells call the loop at most)."""
    _, _, results, _ = graded
    r = results[(TAMPERED, "loop")]
    assert r["seconds"] < 4 * TIMEOUT + 120, f"the looping submission took {r['seconds']:.0f} s"


@pytest.mark.slow
@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_planted_mistakes_are_diagnosed(graded, name):
    if name not in assignments_with_catalogues():
        pytest.skip(f"no mistake catalogue tests/mistakes/{name}.toml yet")
    course, plan, _, _ = graded
    scores = _scores(course)
    planted = [(s, m) for (a, s), (_, _, m) in plan.items() if a == name and m is not None]
    assert planted
    for student, m in planted:
        tests = graded_cells_of(Assignment(course, name).release, m.task)
        for gid in tests:
            assert scores[(name, student, gid)] == 0.0, f"{m.name}: {gid} scored {scores[(name, student, gid)]}"
        page = _feedback(course, name, student)
        assert m.says in page, f"{m.name}: the feedback lacks the diagnosis {m.says!r}"


@pytest.mark.slow
def test_one_worker_gives_the_same_grades_and_one_grade_per_cell(graded):
    course, plan, _, _ = graded
    before = _scores(course)
    students = sorted({s for (_, s) in plan})
    n_cells = {name: len(Assignment(course, name).points) for name in ASSIGNMENTS}
    assert len(before) == sum(n_cells[a] for (a, _) in plan)  # one grade per (student, cell), no more
    for (a, s), (expected, _, _) in plan.items():
        assert all((a, s, gid) in before for gid in Assignment(course, a).points)
    again = ["solution", "crash", "edited", "mistake0"]
    argv = ["autograde", TAMPERED, "--course", str(course), "--workers", "1", "--timeout", str(TIMEOUT), "--quiet"]
    for s in again:
        argv += ["--student", s]
    assert _run(*argv) == 0
    after = _scores(course)
    assert after == before
    assert set(students) >= set(again)


@pytest.mark.slow
def test_grades_csv(graded, tmp_path):
    course, plan, _, _ = graded
    out = tmp_path / "grades.csv"
    assert _run("grades", "--course", str(course), "--output", str(out)) == 0
    rows = list(csv.reader(out.open()))
    header, body = rows[0], rows[1:]
    expect = ["student"]
    for name in ASSIGNMENTS:
        a = Assignment(course, name)
        expect += [name] + [f"{name}/{gid}" for gid in a.points]
    assert sorted(header[1:-2]) == sorted(expect[1:]) and header[0] == "student" and header[-2:] == ["total", "notes"]
    students = sorted({s for (_, s) in plan})
    assert [r[0] for r in body] == students
    for r in body:
        values = dict(zip(header, r))
        total = 0.0
        for name in ASSIGNMENTS:
            texts = [values[f"{name}/{gid}"] for gid in Assignment(course, name).points]
            if (name, r[0]) not in plan:  # never submitted: empty cells, not zeros
                assert set(texts) == {""} and values[name] == "", (r[0], name, texts)
                continue
            cells = [float(t) for t in texts]
            assert float(values[name]) == pytest.approx(sum(cells))
            total += float(values[name])
        assert float(values["total"]) == pytest.approx(total)
        assert values["notes"] == "", (r[0], values["notes"])  # nothing flagged, everything sandboxed
    solution = dict(zip(header, next(r for r in body if r[0] == "solution")))
    assert float(solution["total"]) == sum(sum(Assignment(course, n).points.values()) for n in ASSIGNMENTS)


# --------------------------------------------------------------------------- time limits


def _tiny_assignment(course: Path) -> None:
    """A torch-free assignment: f's test declares a long limit and sleeps; g loops; h passes."""
    import nbformat

    def code(src, gid=None, test=False, points=1, meta=None):
        md = {}
        if gid:
            md["nbgrader"] = {"grade": test, "solution": not test, "locked": test, "grade_id": gid,
                              "schema_version": 3, "task": False}
            if test:
                md["nbgrader"]["points"] = points
        if meta:
            md["gptlab"] = meta
        return nbformat.v4.new_code_cell(src, metadata=md)

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    nb.cells = [
        code("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION", "solution_f"),
        code("import time\ntime.sleep(4)\nassert f() == 1", "test_f", test=True, meta={"timeout": 20}),
        code("def g():\n    ### BEGIN SOLUTION\n    return 2\n    ### END SOLUTION", "solution_g"),
        code("assert g() == 2", "test_g", test=True),
        code("def h():\n    ### BEGIN SOLUTION\n    return 3\n    ### END SOLUTION", "solution_h"),
        code("assert h() == 3", "test_h", test=True),
    ]
    (course / "solutions" / "tiny").mkdir(parents=True)
    nbformat.write(nb, course / "solutions" / "tiny" / "tiny.ipynb")


@pytest.mark.slow
def test_declared_time_limits(tmp_path):
    course = tmp_path / "c"
    course.mkdir()
    shutil.copy(REPO / "nbgrader_config.py", course)
    _tiny_assignment(course)
    assert _run("release", "--course", str(course), "--quiet") == 0
    release = json.loads((course / "exercises" / "tiny" / "tiny.ipynb").read_text())
    answers = {"solution_f": "def f():\n    return 1\n", "solution_h": "def h():\n    return 3\n",
               "solution_g": "def g():\n    while True:\n        pass\n"}
    nb = copy.deepcopy(release)
    for gid, c in _ids(nb):
        if gid in answers:
            c["source"] = answers[gid]
    assert _cell(nb, "test_f")["metadata"]["gptlab"] == {"timeout": 20}  # the release keeps the declaration
    sub = course / "submitted" / "ann" / "tiny"
    sub.mkdir(parents=True)

    # plain nbgrader with the repository's configuration: f's test may sleep 4 s under a 2 s limit
    (sub / "tiny.ipynb").write_text(json.dumps(nb))
    t0 = time.perf_counter()
    _nbgrader(course, "autograde", "tiny", "--force", "--Execute.timeout=2")
    assert time.perf_counter() - t0 < 60
    scores = {gid: s for (a, st, gid), s in _scores(course).items() if st == "ann"}
    assert scores == {"test_f": 1.0, "test_g": 0.0, "test_h": 1.0}

    # course autograde ignores the learner's own declarations: their looping cell, and g's test,
    # asking for a long limit
    _cell(nb, "solution_g")["metadata"]["gptlab"] = {"timeout": 600}
    _cell(nb, "test_g")["metadata"]["gptlab"] = {"timeout": 600}
    (sub / "tiny.ipynb").write_text(json.dumps(nb))
    t0 = time.perf_counter()
    assert _run("autograde", "--course", str(course), "--timeout", "2", "--quiet") == 0
    assert time.perf_counter() - t0 < 60
    scores = {gid: s for (a, st, gid), s in _scores(course).items() if st == "ann"}
    assert scores == {"test_f": 1.0, "test_g": 0.0, "test_h": 1.0}
    notes = Course(course).read_notes("tiny", "ann")
    assert any(n["kind"] == "timeout" and n["cell"] == "test_g" for n in notes), notes


# --------------------------------------------------------------------------- checks before grading


def test_check_notebook_repairs_tampering(released):
    import nbformat

    from gptlab.course.notebooks import release_reference

    name = ASSIGNMENTS[0]
    a = Assignment(released, name)
    ref, order, meta = release_reference(nbformat.read(released / "exercises" / name / f"{a.notebook}.ipynb",
                                                       as_version=4))
    test = graded_cells_of(a.release, a.last)[0]

    def check(nb, tmp):
        p = released / f"{tmp}.ipynb"
        p.write_text(nb if isinstance(nb, str) else json.dumps(nb))
        try:
            return check_notebook(p, ref, order, meta, a.notebook)
        finally:
            p.unlink()

    nb, notes = check(a.solved(), "ok")
    assert nb is not None and notes == []
    edited = a.solved()
    _cell(edited, test)["source"] = "pass"
    _cell(edited, test)["metadata"]["nbgrader"]["points"] = 100
    nb, notes = check(edited, "edited")
    assert [n["kind"] for n in notes] == ["edited", "edited"]
    assert next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == test).metadata.nbgrader.points \
        == a.points[test]
    deleted = a.solved()
    deleted["cells"] = [c for c in deleted["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") != test]
    nb, notes = check(deleted, "deleted")
    assert [n["kind"] for n in notes] == ["deleted"]
    ids = [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells]
    released_ids = [c["metadata"].get("nbgrader", {}).get("grade_id") for c in a.release["cells"]]
    assert ids.index(test) > ids.index(f"solution_{a.last}")
    following = [g for g in released_ids[released_ids.index(test) + 1:] if g]
    if following:
        assert ids.index(test) == ids.index(following[0]) - 1
    nb, notes = check("{not json", "broken")
    assert nb is None and "is not valid JSON" in notes[0]["message"]


# --------------------------------------------------------------------------- collect


@pytest.fixture
def course_dir(tmp_path) -> Path:
    return _new_course(tmp_path / "course")


def _nb_text(tag: str) -> str:
    import nbformat

    return nbformat.writes(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f"# {tag}")]))


def _notebook(course: Path, name: str) -> str:
    return sorted((course / "solutions" / name).glob("*.ipynb"))[0].stem


def test_collect_a_flat_folder(course_dir, tmp_path, capsys):
    name = ASSIGNMENTS[0]
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "ann.ipynb").write_text(_nb_text("ann"))
    (inbox / "Bob Smith.ipynb").write_text(_nb_text("bob"))
    (inbox / "notes.txt").write_text("not a submission")
    (inbox / "cy").mkdir()
    (inbox / "cy" / f"{_notebook(course_dir, name)}.ipynb").write_text(_nb_text("cy"))
    (inbox / "cy" / "data.csv").write_text("1,2\n")
    (inbox / "cy" / "secrets").symlink_to("/etc/hostname")  # links are never followed
    (inbox / "evil.ipynb").symlink_to(inbox / "ann.ipynb")
    assert _run("collect", str(inbox), "--assignment", name, "--course", str(course_dir)) == 0
    out = capsys.readouterr().out
    nb = _notebook(course_dir, name)
    sub = course_dir / "submitted"
    assert sorted(p.name for p in sub.iterdir()) == ["Bob_Smith", "ann", "cy"]
    assert "# bob" in (sub / "Bob_Smith" / name / f"{nb}.ipynb").read_text()
    assert (sub / "cy" / name / "data.csv").is_file() and (sub / "ann" / name / "timestamp.txt").is_file()
    assert not (sub / "cy" / name / "secrets").exists()
    assert "notes.txt" in out and "evil.ipynb: a symbolic link" in out and "3 submission(s) collected, 2 skipped" in out


def test_collect_needs_the_assignment_for_a_plain_folder(course_dir, tmp_path, capsys):
    (tmp_path / "inbox").mkdir()
    assert _run("collect", str(tmp_path / "inbox"), "--course", str(course_dir)) == 2
    assert "--assignment" in capsys.readouterr().err


def test_collect_the_exchange_inbound_layout(course_dir, tmp_path, capsys):
    name = ASSIGNMENTS[0]
    nb = _notebook(course_dir, name)
    inbound = tmp_path / "exchange" / "gptlab" / "inbound"
    for student, stamp, tag in [("ann", "2026-03-01 10:00:00.000000 UTC", "old"),
                                ("ann", "2026-03-02 09:00:00.000000 UTC", "new"),
                                ("bo*b", "2026-03-01 11:00:00.000000 UTC", "bob")]:
        d = inbound / f"{student}+{name}+{stamp}+Zx9_k2"
        d.mkdir(parents=True)
        (d / f"{nb}.ipynb").write_text(_nb_text(tag))
        (d / "timestamp.txt").write_text(stamp)
    (inbound / "ann+not_an_assignment+2026-03-01 10:00:00.000000 UTC+abc").mkdir()
    assert _run("collect", str(tmp_path / "exchange"), "--course", str(course_dir)) == 0
    out = capsys.readouterr().out
    sub = course_dir / "submitted"
    assert "# new" in (sub / "ann" / name / f"{nb}.ipynb").read_text()
    assert (sub / "ann" / name / "timestamp.txt").read_text() == "2026-03-02 09:00:00.000000 UTC"
    assert (sub / "bo_b" / name / f"{nb}.ipynb").is_file()
    assert "unknown assignment" in out and "2 submission(s) collected" in out
    # collecting again replaces the submission in one rename, leaving no scratch folder behind
    assert _run("collect", str(tmp_path / "exchange"), "--course", str(course_dir)) == 0
    assert sorted(p.name for p in (sub / "ann").iterdir()) == [name]


def test_sanitize_student_id():
    assert sanitize_student_id("jane.doe@uni.edu") == "jane.doe@uni.edu"
    assert sanitize_student_id("Jane Doe/../x") == "Jane_Doe_.._x"
    with pytest.raises(ValueError, match="empty student id"):
        sanitize_student_id("///")


# --------------------------------------------------------------------------- command line


@pytest.mark.parametrize("step", ["release", "collect", "autograde", "feedback", "grades"])
def test_every_step_has_help(step, capsys):
    with pytest.raises(SystemExit) as e:
        _run(step, "--help")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"python -m gptlab course {step}" in out and "--course" in out


def test_course_without_config_is_a_clear_error(tmp_path, capsys):
    assert _run("grades", "--course", str(tmp_path)) == 2
    assert "has no nbgrader_config.py" in capsys.readouterr().err


# --------------------------------------------------------------------------- the instructors' appendix


def _book_commands() -> list[str]:
    text = (REPO / "book" / "instructors.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def test_the_appendix_commands_are_real():
    """Every command of book/instructors.md parses: gptlab's with its parser, nbgrader's as its subcommands."""
    import shlex

    from nbgrader.apps.nbgraderapp import NbGraderApp

    from gptlab.__main__ import build_parser

    commands = _book_commands()
    assert any(c.startswith("python -m gptlab course autograde") for c in commands)
    parser = build_parser()
    for command in commands:
        argv = shlex.split(command)
        if argv[:3] == ["python", "-m", "gptlab"]:
            args = parser.parse_args(argv[3:])
            assert callable(args.func), command
        elif argv[0] == "nbgrader":
            assert argv[1] in NbGraderApp.subcommands, command
        elif argv[:3] == ["python", "-m", "pytest"]:
            assert all((REPO / a).is_file() for a in argv[3:] if a.startswith("tests/")), command
        else:
            raise AssertionError(f"unexpected command in book/instructors.md: {command}")
