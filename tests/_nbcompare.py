"""Comparing a notebook's stored outputs with the outputs of an execution, as nbval does.

Shared by the book's check of its one build (tests/test_book.py) and the check of the chapters run
on other CPU code paths (tests/test_book_cpu_paths.py). A cell tagged ``nbval-ignore-output`` (or
``nbval-skip``, or holding ``# NBVAL_IGNORE_OUTPUT``) may print anything but must not raise.
"""

from __future__ import annotations

import re

_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+")


def ignored(cell: dict) -> bool:
    """Whether a cell's output is machine-dependent by declaration (its tags or a marker comment)."""
    src = "".join(cell.get("source", ""))
    tags = cell.get("metadata", {}).get("tags", [])
    return "nbval-ignore-output" in tags or "nbval-skip" in tags or "# NBVAL_IGNORE_OUTPUT" in src or "# NBVAL_SKIP" in src


def sanitize(text: str) -> str:
    """A repr's memory address (``<... at 0x7f3a...>``) differs on every run: not an output."""
    return _ADDRESS.sub("at 0x...", text)


def comparable(outputs: list[dict]) -> list[tuple]:
    """Outputs as nbval compares them: streams merged per name, rich outputs by their text,
    memory addresses in reprs masked (what nbval's usual sanitize file does)."""
    result: list[tuple] = []
    for out in outputs:
        kind = out["output_type"]
        if kind == "stream":
            text = sanitize("".join(out["text"]))
            if result and result[-1][:2] == ("stream", out["name"]):
                result[-1] = ("stream", out["name"], result[-1][2] + text)
            else:
                result.append(("stream", out["name"], text))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            # images may differ in their bytes between library versions: compare their presence
            result.append((kind, sanitize("".join(data.get("text/plain", ""))), tuple(sorted(data))))
        else:
            result.append((kind, out.get("ename"), out.get("evalue")))
    return result


def mismatches(committed: dict, executed: dict, rel: str) -> list[str]:
    """What differs between a notebook as committed and as executed: one message per cell that
    raised or whose (not ignored) output differs; empty when they agree."""
    by_id = {c.get("id"): c for c in executed["cells"] if c["cell_type"] == "code"}
    code_cells = [c for c in committed["cells"] if c["cell_type"] == "code"]
    if len(by_id) != len(code_cells) or any(c.get("id") not in by_id for c in code_cells):
        return [f"{rel}: the executed copy has {len(by_id)} code cells, the notebook {len(code_cells)} "
                "(or their ids differ)"]
    problems = []
    for i, cell in enumerate(code_cells):
        ran = by_id[cell["id"]]
        where = f"{rel}, code cell {i} (id {cell['id']!r})"
        errors = [o for o in ran["outputs"] if o["output_type"] == "error"]
        if errors:
            problems.append(f"{where} raised {errors[0].get('ename')}: {errors[0].get('evalue')}")
            continue
        if ignored(cell):
            continue
        want, got = comparable(cell["outputs"]), comparable(ran["outputs"])
        if got != want:
            problems.append(f"{where}: the executed output differs from the output stored in the notebook.\n"
                            f"stored:   {want}\nexecuted: {got}")
    return problems
