"""Chapter 7 builds every piece the ``kv_cache`` assignment grades.

The chapter (book/07_kv_cache.ipynb) writes ``KVCache``, ``cached_attention_step``,
``generate_cached`` (with its helpers ``new_token_mask`` and ``cached_forward``) and
``kv_cache_bytes`` by hand. A learner who copies those definitions into the assignment must pass
it: each is run through the assignment's own check (gptlab.grading.kv_cache, visible and hidden
inputs), and the autograder's reading of the source (gptlab.grading.source.delegation) must find
nothing in the code each answer reaches. The definitions are taken from the notebook's code cells
(top-level ``def`` and ``class`` statements only; the cells' demonstrations need the chapter's
models), with the chapter's import cell before them.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from gptlab.grading import core, source
from gptlab.grading import kv_cache as checks

REPO = Path(__file__).resolve().parents[1]
CHAPTER = REPO / "book" / "07_kv_cache.ipynb"
TASKS = {
    "KVCache": lambda fn: checks.check_kv_cache(fn),
    "cached_attention_step": lambda fn: checks.check_cached_attention_step(fn),
    "generate_cached": lambda fn: checks.check_generate_cached(fn),
    "kv_cache_bytes": lambda fn: (checks.check_kv_cache_bytes(fn), checks.check_kv_cache_bytes(fn, seed=20)),
}
HELPERS = ("new_token_mask", "cached_forward")


def _chapter_code() -> tuple[str, str]:
    """(the chapter's import cell, its top-level definitions of the graded names and helpers)."""
    cells = ["".join(c["source"]) for c in json.loads(CHAPTER.read_text())["cells"] if c["cell_type"] == "code"]
    imports = [s for s in cells if "import gptlab" in s]
    assert len(imports) == 1, "chapter 7 should have one cell that imports gptlab"
    wanted = set(TASKS) | set(HELPERS)
    found: dict[str, str] = {}
    for text in cells:
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in wanted:
                assert node.name not in found, f"chapter 7 defines {node.name} twice"
                found[node.name] = ast.get_source_segment(text, node)
    missing = wanted - set(found)
    assert not missing, f"chapter 7 no longer defines {sorted(missing)}"
    order = ["KVCache", "cached_attention_step", "new_token_mask", "cached_forward", "generate_cached", "kv_cache_bytes"]
    return imports[0], "\n\n\n".join(found[name] for name in order)


@pytest.fixture(scope="module")
def chapter() -> tuple[dict, source.Program]:
    imports, definitions = _chapter_code()
    namespace: dict = {}
    exec(compile(imports + "\n\n" + definitions, str(CHAPTER), "exec"), namespace)  # the book's own code
    return namespace, source.Program([(1, imports, False), (2, definitions, True)])


@pytest.mark.parametrize("name", list(TASKS))
def test_the_chapters_code_passes_the_assignment(chapter, name):
    namespace, program = chapter
    core.record_forbidden(True)
    try:
        TASKS[name](namespace[name])
    finally:
        forbidden = core.record_forbidden(False)
    found = source.delegation(program, [name], forbidden)
    assert found == [], f"the autograder would call chapter 7's {name} delegation: " + "; ".join(f.text() for f in found)


def test_the_new_token_mask_is_the_shifted_lower_triangle(chapter):
    import torch

    from gptlab.masks import causal_mask, slot_mask

    new_token_mask = chapter[0]["new_token_mask"]
    for S in range(4):
        for T in range(1, 4):
            mask = new_token_mask(S, T)
            assert mask.dtype == torch.bool and tuple(mask.shape) == (T, S + T)
            assert torch.equal(mask, torch.tril(torch.ones(T, S + T), diagonal=S).bool())
            assert torch.equal(mask, slot_mask(S, T, 0, S + T))
        assert torch.equal(new_token_mask(0, S + 1), causal_mask(S + 1))


def test_the_chapters_code_would_not_be_flagged(chapter):
    assert source.guard_switches(chapter[1]) == []
