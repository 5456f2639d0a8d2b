"""Run an assignment notebook's cells in this process, for the mutation and tampering tests.

Much faster than a kernel per variant: the cells are plain Python (assignment notebooks use no
IPython magics, which ``test_mutations.py`` checks). Non-graded cells that raise are recorded and
skipped, as nbgrader's autograde does; graded test cells are run only when asked for. The hidden
tests purge ``gptlab`` from ``sys.modules`` to re-import it fresh. Each run imports its own gptlab
(what a tampering cell changes stays in that run), and the modules this process had are put back
afterwards, so the rest of the test session keeps its own.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path



def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def grade_id(cell: dict) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def is_test(cell: dict) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


def source(cell: dict) -> str:
    s = cell["source"]
    return s if isinstance(s, str) else "".join(s)


def tasks(nb: dict) -> list[str]:
    """The task names of a notebook: its solution cells' grade ids without ``solution_``."""
    return [grade_id(c)[len("solution_"):] for c in nb["cells"] if (grade_id(c) or "").startswith("solution_")]


def test_ids(nb: dict, task: str | None = None) -> list[str]:
    return [grade_id(c) for c in nb["cells"] if is_test(c) and (task is None or _task_of(grade_id(c)) == task)]


def _task_of(test_grade_id: str) -> str:
    return test_grade_id[len("test_"):]


@dataclass
class Run:
    """What happened: each test cell run -> the exception it raised (None when it passed)."""

    tests: dict[str, BaseException | None] = field(default_factory=dict)
    other_errors: list[tuple[int, BaseException]] = field(default_factory=list)
    namespace: dict = field(default_factory=dict)

    def message(self, test: str) -> str:
        e = self.tests[test]
        return "" if e is None else f"{type(e).__name__}: {e}"


def run(
    nb: dict,
    replace: dict[str, str] | None = None,
    tests: list[str] | None = None,
    insert_before: dict[str, str] | None = None,
) -> Run:
    """Execute ``nb``'s code cells in order in a fresh namespace.

    ``replace`` maps a grade id to the source that replaces that cell's; ``tests`` lists the test
    cells to run (default: all); ``insert_before`` maps a grade id to code run just before that cell
    (a learner's tampering cell). Stops after the last requested test cell.
    """
    replace, insert_before = replace or {}, insert_before or {}
    wanted = set(test_ids(nb) if tests is None else tests)
    saved = {k: v for k, v in sys.modules.items() if k == "gptlab" or k.startswith("gptlab.")}
    for k in saved:  # the notebook gets its own gptlab, so that what it changes stays in this run
        del sys.modules[k]
    import torch
    import torch.nn.functional as F

    torch_names = {m: dict(vars(m)) for m in (torch, F)}  # a tampering cell may replace torch functions
    out = Run(namespace={"__name__": "__main__"})
    try:
        for i, cell in enumerate(nb["cells"]):
            if not wanted - set(out.tests):
                break
            if cell["cell_type"] != "code":
                continue
            gid = grade_id(cell)
            if gid in insert_before:
                exec(compile(insert_before[gid], f"<inserted before {gid}>", "exec"), out.namespace)
            if is_test(cell) and gid not in wanted:
                continue
            code = replace.get(gid, source(cell))
            try:
                exec(compile(code, f"<cell {i}: {gid or 'code'}>", "exec"), out.namespace)
            except Exception as e:  # noqa: BLE001 - a notebook cell may raise anything
                if is_test(cell):
                    out.tests[gid] = e
                else:
                    out.other_errors.append((i, e))
            else:
                if is_test(cell):
                    out.tests[gid] = None
    finally:
        for m, names in torch_names.items():
            for k in set(vars(m)) - set(names):
                delattr(m, k)
            for k, v in names.items():
                if vars(m).get(k) is not v:
                    setattr(m, k, v)
        for k in [k for k in sys.modules if k == "gptlab" or k.startswith("gptlab.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return out
