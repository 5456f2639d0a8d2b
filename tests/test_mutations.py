"""Every assignment against its catalogue of mistakes (``tests/mistakes/``), in its own notebook.

* The instructor's solution passes every test cell of its notebook.
* Each catalogued mistake, put in place of the solution cell, makes the task's test cells fail with
  an ``AssertionError`` whose message names that mistake; delegating to the reference fails too.
* Tampering: replacing a check, or torch's comparison functions, from an earlier cell does not make a
  wrong answer pass (the hidden part of the test cell re-imports gptlab before checking again, and
  the checks compare with PyTorch's own C functions).
* The learners' release fails every test cell with "not written yet".
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import nbexec
from mistakes import assignments_with_catalogues, catalogue, no_delegation

REPO = Path(__file__).resolve().parent.parent
ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").iterdir() if p.is_dir())
CATALOGUED = assignments_with_catalogues()


def _solution(name: str) -> dict:
    return nbexec.load(REPO / "solutions" / name / f"{name}.ipynb")


def test_every_assignment_has_a_catalogue():
    assert sorted(ASSIGNMENTS) == sorted(CATALOGUED), "each assignment in solutions/ needs tests/mistakes/<name>.toml"


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_notebook_follows_the_conventions(name):
    nb = _solution(name)
    tasks = nbexec.tasks(nb)
    assert tasks, f"{name} has no solution cell named solution_<task>"
    for task in tasks:
        assert nbexec.test_ids(nb, task), f"{name}: task {task} has no test cell test_{task}"
    points = [c["metadata"]["nbgrader"]["points"] for c in nb["cells"] if nbexec.is_test(c)]
    assert sum(points) % 5 == 0, f"{name}: points sum to {sum(points)}, not a round total"
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            assert not re.search(r"^\s*[!%]", nbexec.source(c), re.M), f"{name}: IPython magics cannot be graded in-process"
        if nbexec.is_test(c):
            src = nbexec.source(c)
            assert c["metadata"]["nbgrader"]["locked"], f"{name}: test cell {nbexec.grade_id(c)} is not locked"
            assert "### BEGIN HIDDEN TESTS" in src, f"{name}: {nbexec.grade_id(c)} has no hidden re-check"


@pytest.mark.parametrize("name", CATALOGUED)
def test_catalogue_covers_every_task(name):
    entries = catalogue(name)
    tasks = nbexec.tasks(_solution(name))
    for task in tasks:
        mine = [m for m in entries if m.task == task]
        assert len([m for m in mine if not m.delegation]) >= 3, f"{name}.{task}: fewer than 3 catalogued mistakes"
        if task not in no_delegation(name):
            assert any(m.delegation for m in mine), f"{name}.{task}: no delegation entry (or a reason in [no_delegation])"
    assert {m.task for m in entries} <= set(tasks), "catalogue entries for tasks the notebook does not have"
    assert len({(m.task, m.name) for m in entries}) == len(entries), "duplicate mistake names"


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_solution_passes_every_test_cell(name):
    result = nbexec.run(_solution(name))
    assert result.tests, "no test cell ran"
    failed = {t: result.message(t) for t, e in result.tests.items() if e is not None}
    assert not failed, f"the instructor's solution fails: {failed}"
    assert not result.other_errors, f"cells raised: {result.other_errors}"


MUTANTS = [(name, m) for name in CATALOGUED for m in catalogue(name)]


@pytest.mark.parametrize("name,mistake", MUTANTS, ids=[f"{n}-{m.task}-{m.name}" for n, m in MUTANTS])
def test_mistake_is_named(name, mistake):
    nb = _solution(name)
    tests = nbexec.test_ids(nb, mistake.task)
    result = nbexec.run(nb, replace={f"solution_{mistake.task}": mistake.code}, tests=tests)
    for t in tests:
        err = result.tests[t]
        assert isinstance(err, AssertionError), f"{t} should fail with a diagnosis, got: {result.message(t) or 'it passed'}"
        assert mistake.says in str(err), f"{t}: the message does not name {mistake.name!r}:\n{err}"
        if mistake.delegation:
            assert "must be written by hand" in str(err), str(err)


def _checks_in(cell_source: str) -> list[tuple[str, str]]:
    return re.findall(r"^from (gptlab\.grading[\w.]*) import (\w+)", cell_source, re.M)


@pytest.mark.parametrize("name", CATALOGUED)
def test_replacing_a_check_does_not_pass_a_wrong_answer(name):
    """``gptlab.grading.<module>.check_x = lambda f: None`` in an earlier cell changes nothing."""
    nb = _solution(name)
    entries = catalogue(name)
    for task in nbexec.tasks(nb):
        wrong = next(m for m in entries if m.task == task and not m.delegation)
        for t in nbexec.test_ids(nb, task):
            cell = next(c for c in nb["cells"] if nbexec.grade_id(c) == t)
            checks = _checks_in(nbexec.source(cell))
            assert checks, f"{t}: no check imported from gptlab.grading"
            replaced = "\n".join(
                f"import {mod} as _g\n_g.{fn} = lambda *a, **k: None\nimport gptlab.grading as _gg\n_gg.{fn} = lambda *a, **k: None"
                for mod, fn in checks
            )
            torch_lies = "import torch\ntorch.equal = lambda *a, **k: True\ntorch.allclose = lambda *a, **k: True\n"
            for tamper in (replaced, torch_lies):
                result = nbexec.run(nb, replace={f"solution_{task}": wrong.code}, tests=[t], insert_before={t: tamper})
                err = result.tests[t]
                assert isinstance(err, AssertionError) and wrong.says in str(err), (
                    f"{t}: tampering ({tamper.splitlines()[-1]}) let {wrong.name!r} pass: {result.message(t)}"
                )


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_release_fails_with_not_written_yet(name):
    release = nbexec.load(REPO / "exercises" / name / f"{name}.ipynb")
    result = nbexec.run(release)
    assert result.tests
    for t, err in result.tests.items():
        assert isinstance(err, AssertionError) and "not written yet" in str(err), f"{t}: {result.message(t)}"
