"""Graded exercises: the checks in gptlab.grading, and the nbgrader round trip.

* Each typical mistake, written as real code, gets its own diagnosis; correct answers written in
  different styles all pass.
* ``exercises/`` is exactly what ``nbgrader generate_assignment`` makes from ``solutions/`` now.
* In a throw-away course folder: the solution scores full marks, the blank release scores zero
  with "not written yet" in the feedback, and an upper-triangular mask fails its test cell with
  the diagnosis "you let tokens attend to the future".
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gptlab
from gptlab.grading import (
    DelegationError,
    ExerciseError,
    check_causal_attention_weights,
    check_causal_mask,
    diagnose_mask,
    reference_causal_attention_weights,
)

REPO = Path(__file__).resolve().parent.parent
NINF = float("-inf")


# --------------------------------------------------------------------------- check_causal_mask


def test_the_reference_itself_is_delegation():
    """Handing in gptlab's own function is not an answer: the task asks for it by hand."""
    with pytest.raises(DelegationError, match="gptlab.causal_mask"):
        check_causal_mask(gptlab.causal_mask)


@pytest.mark.parametrize(
    "fn",
    [
        lambda T: torch.tril(torch.ones(T, T)).bool(),
        lambda T: torch.arange(T)[None, :] <= torch.arange(T)[:, None],
        lambda T: ~torch.ones(T, T, dtype=torch.bool).triu(1),
    ],
    ids=["tril-bool", "arange", "not-strict-upper"],
)
def test_correct_masks_pass(fn):
    check_causal_mask(fn)


MASK_MISTAKES = {
    "upper triangle": (lambda T: torch.ones(T, T, dtype=torch.bool).triu(), "you let tokens attend to the future"),
    "inverted convention": (
        lambda T: torch.ones(T, T, dtype=torch.bool).triu(1),
        "True = may attend",
    ),
    "diagonal excluded": (
        lambda T: torch.ones(T, T, dtype=torch.bool).tril(-1),
        "a token must be able to attend to itself",
    ),
    "float 0/1": (lambda T: torch.ones(T, T).tril(), "PyTorch treats a float mask as numbers to ADD"),
    "additive mask": (
        lambda T: torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), NINF),
        "additive mask",
    ),
    "no mask": (lambda T: torch.ones(T, T, dtype=torch.bool), "every token can attend to the future"),
    "sees one ahead": (lambda T: torch.ones(T, T, dtype=torch.bool).tril(1), "see 1 token(s) ahead"),
    "hard-coded size": (lambda T: torch.ones(5, 5, dtype=torch.bool).tril(), "hard-code the size"),
    "list, not tensor": (lambda T: torch.ones(T, T, dtype=torch.bool).tril().tolist(), "should return a torch.Tensor"),
    "not written": (lambda T: (_ for _ in ()).throw(NotImplementedError()), "not written yet"),
    "crashes": (lambda T: torch.ones(T).tril(), "raised RuntimeError"),
}


@pytest.mark.parametrize("mistake", list(MASK_MISTAKES))
def test_mask_mistakes_are_diagnosed(mistake):
    fn, diagnosis = MASK_MISTAKES[mistake]
    with pytest.raises(ExerciseError) as exc:
        check_causal_mask(fn)
    assert diagnosis in str(exc.value), f"{mistake}: got the message\n{exc.value}"


def test_mask_diagnosis_shows_both_masks():
    with pytest.raises(ExerciseError) as exc:
        check_causal_mask(lambda T: torch.ones(T, T, dtype=torch.bool).triu())
    msg = str(exc.value)
    assert "expected (1 = may attend)" in msg and "1....\n" in msg and "11111\n" in msg


def test_diagnose_mask_general_case():
    """A mask matching no known pattern still gets a precise message naming the position."""
    m = gptlab.causal_mask(4).clone()
    m[1, 3] = True
    assert diagnose_mask(m, 4) == "query 1 may attend to key 3, which is in its future (j > i): that leaks the future."
    m = gptlab.causal_mask(4).clone()
    m[2, 0] = False
    assert "query 2 may not attend to key 0" in diagnose_mask(m, 4)
    assert diagnose_mask(gptlab.causal_mask(4), 4) is None


def test_check_rejects_a_non_function():
    with pytest.raises(TypeError, match="expects a function"):
        check_causal_mask(gptlab.causal_mask(3))


# --------------------------------------------------------------------------- attention weights


def test_reference_weights_match_sdpa():
    """The reference equals PyTorch's own causal attention: weights @ v == SDPA(is_causal=True)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(3))
    scores = q @ k.transpose(-2, -1) / 8**0.5
    out = reference_causal_attention_weights(scores) @ v
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def _weights_solution(scores):
    T = scores.shape[-1]
    return torch.softmax(scores.masked_fill(~_tril(T), NINF), dim=-1)


def _big_negative(scores):
    T = scores.shape[-1]
    return torch.softmax(scores.masked_fill(~_tril(T), -1e9), dim=-1)


def _in_place(scores):
    T = scores.shape[-1]
    return torch.softmax(scores.masked_fill_(~_tril(T), NINF), dim=-1)


@pytest.mark.parametrize("fn", [_weights_solution, _big_negative], ids=["-inf", "-1e9"])
def test_correct_weights_pass(fn):
    check_causal_attention_weights(fn)


def _tril(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


WEIGHT_MISTAKES = {
    "no mask": (lambda s: torch.softmax(s, dim=-1), "you did not mask anything"),
    "fill with 0": (
        lambda s: torch.softmax(s.masked_fill(~_tril(s.shape[-1]), 0.0), dim=-1),
        "exp(0) = 1",
    ),
    "wrong entries": (
        lambda s: torch.softmax(s.masked_fill(_tril(s.shape[-1]), NINF), dim=-1),
        "fill where the mask is False",
    ),
    "softmax over queries": (
        lambda s: torch.softmax(s.masked_fill(~_tril(s.shape[-1]), NINF), dim=-2),
        "over the wrong dimension",
    ),
    "mask after softmax": (lambda s: torch.softmax(s, dim=-1) * _tril(s.shape[-1]), "you masked after the softmax"),
    "upper triangle": (
        lambda s: torch.softmax(s.masked_fill(~_tril(s.shape[-1]).T, NINF), dim=-1),
        "tokens attend to the future",
    ),
    "no softmax": (lambda s: s.masked_fill(~_tril(s.shape[-1]), NINF), "apply the softmax"),
    "scaled again": (lambda s: _weights_solution(s / s.shape[-1] ** 0.5), "you rescaled the scores"),
    "in place": (_in_place, "in place"),
    "wrong shape": (lambda s: _weights_solution(s)[0], "should have the same shape"),
    "not written": (lambda s: (_ for _ in ()).throw(NotImplementedError()), "not written yet"),
}


@pytest.mark.parametrize("mistake", list(WEIGHT_MISTAKES))
def test_weight_mistakes_are_diagnosed(mistake):
    fn, diagnosis = WEIGHT_MISTAKES[mistake]
    with pytest.raises(ExerciseError) as exc:
        check_causal_attention_weights(fn)
    assert diagnosis in str(exc.value), f"{mistake}: got the message\n{exc.value}"


# --------------------------------------------------------------------------- nbgrader


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # nbgrader runs helper programs (alembic) by name: they sit beside this interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r


ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    """A throw-away course folder: nbgrader_config.py + solutions/, with every assignment generated."""
    root = tmp_path_factory.mktemp("course")
    shutil.copy(REPO / "nbgrader_config.py", root)
    shutil.copytree(REPO / "solutions", root / "solutions", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for name in ASSIGNMENTS:
        _nbgrader(root, "generate_assignment", name, "--force")
    return root


def _files(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): p.read_text()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and ".ipynb_checkpoints" not in p.parts
    }


def test_there_is_an_assignment():
    assert "causal_mask" in ASSIGNMENTS


def test_exercises_are_generated_from_solutions(course):
    """exercises/ must be exactly the current release; after editing solutions/, run `make exercises`."""
    made, committed = _files(course / "exercises"), _files(REPO / "exercises")
    assert sorted(made) == sorted(committed), "exercises/ has other files than the release: run `make exercises`"
    for name, text in made.items():
        assert committed[name] == text, f"exercises/{name} is stale: run `make exercises`"


def test_release_hides_the_solutions(course):
    nb = json.loads((course / "exercises" / "causal_mask" / "causal_mask.ipynb").read_text())
    text = "".join("".join(c["source"]) for c in nb["cells"])
    assert "BEGIN SOLUTION" not in text and ".tril()" not in text
    assert text.count("raise NotImplementedError()") == 4
    assert "BEGIN HIDDEN TESTS" not in text and "sys.modules" not in text
    tests = [c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade")]
    assert [c["metadata"]["nbgrader"]["points"] for c in tests] == [2, 2, 3, 3]
    assert all(c["metadata"]["nbgrader"]["locked"] for c in tests)


def _solved(release: dict, solution: dict) -> dict:
    """The release with each solution cell's code replaced by the instructor's."""
    answers = {
        c["metadata"]["nbgrader"]["grade_id"]: c["source"]
        for c in solution["cells"]
        if c["metadata"].get("nbgrader", {}).get("solution")
    }
    nb = copy.deepcopy(release)
    for c in nb["cells"]:
        meta = c["metadata"].get("nbgrader", {})
        if meta.get("solution"):
            c["source"] = answers[meta["grade_id"]]
    return nb


def _test_outputs(nb: dict) -> dict[str, str]:
    """grade_id -> the text of each graded test cell's outputs (errors included)."""
    out = {}
    for c in nb["cells"]:
        meta = c["metadata"].get("nbgrader", {})
        if c["cell_type"] == "code" and meta.get("grade"):
            parts = []
            for o in c.get("outputs", []):
                parts.append("".join(o["text"]) if "text" in o else f"{o.get('ename', '')}: {o.get('evalue', '')}")
            out[meta["grade_id"]] = "\n".join(parts)
    return out


@pytest.mark.slow
def test_autograde_round_trip(course):
    from nbgrader.api import Gradebook

    release = json.loads((course / "exercises" / "causal_mask" / "causal_mask.ipynb").read_text())
    solution = json.loads((course / "solutions" / "causal_mask" / "causal_mask.ipynb").read_text())
    good = _solved(release, solution)
    upper = copy.deepcopy(good)
    for c in upper["cells"]:
        if c["metadata"].get("nbgrader", {}).get("grade_id") == "solution_causal_mask":
            src = "".join(c["source"])
            assert ".tril()" in src
            c["source"] = src.replace(".tril()", ".triu()")
    for student, nb in {"solution": good, "blank": release, "upper": upper}.items():
        folder = course / "submitted" / student / "causal_mask"
        folder.mkdir(parents=True)
        (folder / "causal_mask.ipynb").write_text(json.dumps(nb))

    _nbgrader(course, "autograde", "causal_mask", "--create")

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {
            s: {g.name: g.score for g in gb.find_submission_notebook("causal_mask", "causal_mask", s).grades}
            for s in ("solution", "blank", "upper")
        }
    assert scores["solution"] == {
        "test_causal_mask": 2.0, "test_additive_mask": 2.0, "test_causal_attention_weights": 3.0, "test_combine_masks": 3.0
    }
    assert set(scores["blank"].values()) == {0.0}
    assert scores["upper"]["test_causal_mask"] == 0.0

    def outputs(student):
        path = course / "autograded" / student / "causal_mask" / "causal_mask.ipynb"
        return _test_outputs(json.loads(path.read_text()))

    assert "causal_mask: correct" in outputs("solution")["test_causal_mask"]
    blank = outputs("blank")
    assert "ExerciseError" in blank["test_causal_mask"] and "not written yet" in blank["test_causal_mask"]
    assert "not written yet" in blank["test_causal_attention_weights"]
    up = outputs("upper")["test_causal_mask"]
    assert "ExerciseError" in up and "you let tokens attend to the future" in up
