"""The catalogue of learners' mistakes, one TOML file per assignment (``tests/mistakes/<assignment>.toml``).

Each entry is a buggy implementation written the way a learner would write it: the whole source
of one solution cell of the assignment's notebook. The mutation test (``tests/test_mutations.py``)
puts every entry in place of the instructor's solution cell, runs the notebook's cells up to and
including the task's test cell, and asserts that the test cell fails with a message that names the
mistake (``says``). The nbgrader round trip plants some of them in submissions as well.

Notebook convention (every assignment follows it): a task ``f`` has one solution cell with
nbgrader ``grade_id`` ``solution_f`` and one or more graded test cells whose ``grade_id`` starts
with ``test_f``.

The format of a catalogue file (TOML 1.0, read with :mod:`tomllib`)::

    [no_delegation]              # optional: tasks with nothing to delegate to, each with the reason
    cached_attention_step = "the attention itself may come from gptlab ..."

    [templates]                  # optional: named cell sources that several entries share
    causal_mask = '''
    def causal_mask(T):
        import torch
        return {}
    '''

    [defaults.Block]             # optional: values of a template's named fields
    mlp = 'self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))'

    # ---- causal_mask             (a comment line before the entries of each task)
    [[mistake]]
    task = "causal_mask"           # the task: the cell with grade_id solution_<task> is replaced
    name = "upper triangle"        # a short name, unique within the task (the test id)
    says = "you let tokens attend to the future"   # what the failing test cell's message must contain
    delegation = true              # optional (default false): the entry calls a forbidden reference
    code = '''
    def causal_mask(T):
        ...
    '''                            # EITHER the whole cell source,
    template = "causal_mask"       # OR a template, filled in with str.format:
    fill = "torch.ones(T, T, dtype=torch.bool).triu()"   # the text for a template's one ``{}``,
    fill.mlp = "self.c_proj(self.c_fc(x))"   # or values of its named fields (``{mlp}``), which
                                             # override [defaults.<template>]; an inline table
                                             # ``fill = { mlp = "..." }`` is the same thing

A template is a Python format string: a literal brace in it is doubled (``{{`` and ``}}``); the
fills and ``code`` are taken as they are. In a multi-line string ``'''...'''`` TOML drops a newline
right after the opening quotes, so ``code = '''`` followed by the code on the next lines is the code
alone; the closing ``'''`` at the start of a line keeps the last newline, at the end of the last
line it leaves it out (as the fills of most templates do: the template adds it).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
_ENTRY_KEYS = {"task", "name", "says", "delegation", "code", "template", "fill"}
_FILE_KEYS = {"no_delegation", "templates", "defaults", "mistake"}


@dataclass(frozen=True)
class Mistake:
    """One buggy learner answer for one task, and what the grader must say about it."""

    task: str
    """The task (function) name: the solution cell with grade_id ``solution_<task>`` is replaced."""
    name: str
    """A short name for the mistake (used as the test id)."""
    code: str
    """The full replacement source of the solution cell."""
    says: str
    """A phrase the failing test cell's message must contain (the diagnosis)."""
    delegation: bool = False
    """True when the entry calls a forbidden reference (gptlab's, or the fused PyTorch op)."""


def _read(assignment: str) -> dict:
    path = HERE / f"{assignment}.toml"
    with path.open("rb") as f:
        data = tomllib.load(f)
    if unknown := set(data) - _FILE_KEYS:
        raise ValueError(f"{path.name}: unknown top-level keys {sorted(unknown)}")
    return data


def _code(entry: dict, data: dict, where: str) -> str:
    """The cell source of one ``[[mistake]]``: its ``code``, or its template filled in."""
    if "code" in entry:
        if "template" in entry or "fill" in entry:
            raise ValueError(f"{where}: give either code or template (with fill), not both")
        return entry["code"]
    if "template" not in entry:
        raise ValueError(f"{where}: needs code, or a template to fill in")
    name = entry["template"]
    template = data.get("templates", {}).get(name)
    if template is None:
        raise ValueError(f"{where}: no template {name!r} in [templates]")
    fill = entry.get("fill", {})
    if isinstance(fill, str):
        return template.format(fill)
    return template.format(**{**data.get("defaults", {}).get(name, {}), **fill})


def catalogue(assignment: str) -> list[Mistake]:
    """The catalogue of ``assignment``: the ``[[mistake]]`` entries of ``tests/mistakes/<assignment>.toml``."""
    data = _read(assignment)
    mistakes = []
    for i, entry in enumerate(data.get("mistake", []), 1):
        where = f"{assignment}.toml, mistake {i} ({entry.get('task')}: {entry.get('name')})"
        if unknown := set(entry) - _ENTRY_KEYS:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        if missing := {"task", "name", "says"} - set(entry):
            raise ValueError(f"{where}: missing {sorted(missing)}")
        mistakes.append(Mistake(entry["task"], entry["name"], _code(entry, data, where), entry["says"],
                                entry.get("delegation", False)))
    return mistakes


def no_delegation(assignment: str) -> dict[str, str]:
    """Tasks of ``assignment`` with nothing to delegate to, each with the reason (the file's optional
    ``[no_delegation]`` table); every other task needs a delegation entry."""
    return dict(_read(assignment).get("no_delegation", {}))


def assignments_with_catalogues() -> list[str]:
    """Names of the assignments that have a catalogue file here."""
    return sorted(p.stem for p in HERE.glob("*.toml"))
