"""Copying a chapter passes its assignment: every graded function and module is written in its
chapter, under the assignment's own name and signature, and passes the assignment's own check.

For each graded test cell of ``gptlab.grading.tasks.TASKS`` (37 names in 8 assignments), the
chapter's code is read from the notebook as stored (``book/0N_*.ipynb``, its code cells parsed by
``ast``; an assignment spread over two chapters, ``gpt_training`` over 5 and 5b, reads both, in order): the last top-level ``def`` or ``class`` of the graded name, and what it needs from the
chapter (the top-level imports, functions, classes and assignments it reaches, however deep, each
taken as the chapter writes it: the binding in force where the graded name is defined). Those
statements alone, in the chapter's order, are executed in a fresh namespace (no other statement of
the chapter runs: no data, no model), and the graded names from it go through the task's check,
with the notebook's visible arguments, then with the hidden run's arguments for one seed.

A chapter that writes a graded piece under another name, with another signature, or leans on a
cell's state fails here, naming the chapter and the name. A second test checks that the chapter
itself calls the task's check on its own definitions (``grading.check_x(x)``), so that its reader
sees the piece pass: the chapter that writes the graded piece first. Only the graded training run (``gpt_training``'s ``train``, about 20 s on 2
cores) is marked slow.
"""

from __future__ import annotations

import ast
import builtins
import json
import symtable
from functools import cache
from pathlib import Path

import pytest

from gptlab.grading.tasks import TASKS

REPO = Path(__file__).resolve().parent.parent
CHAPTERS = {
    "lm_basics": "01_language_modelling",
    "causal_mask": "02_causal_masks",
    "attention": "03_attention",
    "blocks": "04_transformer_blocks",
    "gpt_training": ("05_gpt2_mini", "05b_training"),  # the model and its count; the schedule and the loop
    "sampling": "06_sampling",
    "kv_cache": "07_kv_cache",
    "speculative": "08_speculative_decoding",
}
SLOW = {("gpt_training", "test_train")}  # the graded 300-step training run (a minute or more on 2 cores)
HIDDEN_SEED = 12345
CELLS = [(a, gid) for a in TASKS for gid in TASKS[a]]


def _bound(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds in the module (defs, classes, imports, assignments)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _needs(source: str) -> set[str]:
    """The module-level names a statement reads (globals of its functions and classes included)."""
    out: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            if not sym.is_referenced():
                continue
            if table.get_type() == "module" or sym.is_global() or (
                    table.get_type() == "class" and not sym.is_assigned() and not sym.is_imported()):
                out.add(sym.get_name())
        for child in table.get_children():
            walk(child)

    walk(symtable.symtable(source, "<chapter>", "exec"))
    return out - set(dir(builtins))


def _chapters(assignment: str) -> tuple[str, ...]:
    """The chapter (or chapters, in reading order) that write an assignment's graded pieces."""
    chapters = CHAPTERS[assignment]
    return (chapters,) if isinstance(chapters, str) else chapters


def _cells(chapters: str | tuple[str, ...]) -> list[dict]:
    """The cells of a chapter, or of several chapters one after the other."""
    chapters = (chapters,) if isinstance(chapters, str) else chapters
    return [cell for ch in chapters for cell in json.loads((REPO / "book" / f"{ch}.ipynb").read_text())["cells"]]


@cache
def _statements(chapter: str | tuple[str, ...]) -> list[tuple[ast.stmt, str, set[str]]]:
    """The chapter's (or chapters') top-level statements that bind names, in order: (node, its
    source, names bound)."""
    out = []
    for cell in _cells(chapter):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        if source.lstrip().startswith(("%", "!")):
            continue
        for node in ast.parse(source).body:
            names = _bound(node)
            if names:
                out.append((node, ast.get_source_segment(source, node), names))
    return out


def chapter_namespace(chapter: str | tuple[str, ...], names: tuple[str, ...]) -> dict:
    """Execute the chapter's definitions of ``names`` and what they need; return the namespace."""
    statements = _statements(chapter)
    chosen: set[int] = set()
    todo: list[tuple[str, int]] = []
    for name in names:
        defs = [i for i, (node, _, bound) in enumerate(statements)
                if name in bound and isinstance(node, ast.FunctionDef | ast.ClassDef)]
        assert defs, f"{_label(chapter)} writes no top-level `def {name}` or `class {name}`"
        todo.append((name, defs[-1]))
    while todo:
        name, where = todo.pop()
        bindings = [i for i, (_, _, bound) in enumerate(statements) if name in bound]
        if not bindings:
            continue  # a builtin, or a name bound inside the statement itself
        before = [i for i in bindings if i <= where]
        i = before[-1] if before else bindings[0]
        if i in chosen:
            continue
        chosen.add(i)
        for needed in _needs(statements[i][1]):
            todo.append((needed, i))
    module = ast.Module(body=[statements[i][0] for i in sorted(chosen)], type_ignores=[])
    namespace: dict = {"__name__": f"chapter_{'_'.join(_chapters_of(chapter))}"}
    exec(compile(module, _label(chapter), "exec"), namespace)  # noqa: S102 - the repository's own chapter
    return namespace


def _chapters_of(chapter: str | tuple[str, ...]) -> tuple[str, ...]:
    return (chapter,) if isinstance(chapter, str) else chapter


def _label(chapter: str | tuple[str, ...]) -> str:
    return " + ".join(f"book/{ch}.ipynb" for ch in _chapters_of(chapter))


def _writer(assignment: str, name: str) -> str:
    """Of an assignment's chapters, the first that writes ``name`` as a top-level def or class (a later
    chapter may repeat it, as 5b repeats 5's model, so that it runs on its own)."""
    found = [ch for ch in _chapters(assignment)
             if any(name in bound and isinstance(node, ast.FunctionDef | ast.ClassDef) for node, _, bound in _statements(ch))]
    assert found, f"{_label(CHAPTERS[assignment])} writes no top-level `def {name}` or `class {name}`"
    return found[0]


def test_every_assignment_has_a_chapter_and_37_graded_cells():
    assert set(CHAPTERS) == set(TASKS)
    assert len(CELLS) == 37
    names = {n for a in TASKS for cell in TASKS[a].values() for n in cell.names}
    assert len(names) == 37  # test_train grades train with task 1's GPT


@cache
def _calls(chapter: str) -> set[tuple[str, tuple[str, ...]]]:
    """(function name, names of its positional arguments) of every call in the chapter's code."""
    out = set()
    for cell in _cells(chapter):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.lstrip().startswith(("%", "!")):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                out.add((func, tuple(a.id if isinstance(a, ast.Name) else "" for a in node.args)))
    return out


@pytest.mark.parametrize("assignment,grade_id", CELLS, ids=[f"{a}-{g.removeprefix('test_')}" for a, g in CELLS])
def test_the_chapter_runs_the_assignments_check(assignment: str, grade_id: str):
    """The chapter itself calls the check on its own definitions (``grading.check_x(x)``), so that a
    reader sees it pass."""
    cell = TASKS[assignment][grade_id]
    check = cell.check.__name__
    chapter = _writer(assignment, cell.names[0])  # the chapter that writes the graded piece checks it
    assert (check, cell.names) in _calls(chapter), (
        f"book/{chapter}.ipynb never calls {check}({', '.join(cell.names)})")


@pytest.mark.parametrize("assignment,grade_id", [
    pytest.param(a, g, marks=[pytest.mark.slow] if (a, g) in SLOW else []) for a, g in CELLS],
    ids=[f"{a}-{g.removeprefix('test_')}" for a, g in CELLS])
def test_the_chapter_passes_the_assignments_check(assignment: str, grade_id: str):
    cell = TASKS[assignment][grade_id]
    namespace = chapter_namespace(_chapters(assignment), cell.names)
    learner = [namespace[n] for n in cell.names]
    cell.check(*learner, **cell.visible)
    if cell.hidden is not None:
        cell.check(*learner, **cell.hidden(HIDDEN_SEED))
