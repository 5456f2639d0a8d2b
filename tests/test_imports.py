"""The package's import graph: no cycles, and no module imports another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "gptlab"


def _modules() -> dict[str, Path]:
    """Every module of the package, its subpackages' (``gptlab.grading.core``, ...) included."""
    mods = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = ("gptlab",) + f.relative_to(PKG).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _package(name: str, path: Path) -> str:
    """The package a relative import in module ``name`` starts from."""
    return name if path.stem == "__init__" else name.rpartition(".")[0]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations only, never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    return skip


def _imports(name: str, path: Path, mods: dict) -> tuple[set[str], list[str]]:
    """The package modules ``name`` imports (at any depth: module level or inside functions), and
    the private names it imports from other modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_nodes(tree)
    deps, private = set(), []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import y, from ..x import y
                pkg = _package(name, path).split(".")
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base.startswith("gptlab"):
                continue
            parent, _, last = base.rpartition(".")
            if last.startswith("_") and not last.startswith("__") and _package(name, path) != parent:
                private.append(f"{name} imports the private module {base}")  # another package's _common
            for a in node.names:
                if f"{base}.{a.name}" in mods:  # from . import hf
                    deps.add(f"{base}.{a.name}")
                else:
                    if base in mods:
                        deps.add(base)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(f"{name} imports {base}.{a.name}")
    deps.discard(name)
    return deps, private


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    graph, private = {}, []
    for name, path in mods.items():
        graph[name], p = _imports(name, path, mods)
        private += p
    return graph, private


def test_no_module_imports_private_names():
    _, private = _graph()
    assert private == []


def test_no_import_cycles():
    graph, _ = _graph()
    graph.pop("gptlab")  # the package's __init__ re-exports; its submodules never import it
    state: dict[str, int] = {}
    cycles = []

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(" -> ".join(path[path.index(m):] + [m]))
            elif m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert cycles == []


DOWNSTREAM = ("gptlab.generation", "gptlab.interop", "gptlab.train", "gptlab.model", "gptlab.cli")


def _is_downstream(m: str) -> bool:
    return any(m == d or m.startswith(d + ".") for d in DOWNSTREAM)


@pytest.mark.parametrize("module", ["masks", "rope", "layers", "attention", "kvcache", "sampling", "config"])
def test_model_parts_import_nothing_downstream(module):
    """The model's parts sit upstream of generation, training and interop."""
    graph, _ = _graph()
    assert {m for m in graph[f"gptlab.{module}"] if _is_downstream(m)} == set()


def test_the_model_imports_only_the_hf_conversions_downstream():
    """model.py needs interop.hf for GPT.from_hf / GPT.to_hf, and nothing else below it."""
    graph, _ = _graph()
    assert {m for m in graph["gptlab.model"] if _is_downstream(m)} == {"gptlab.interop.hf"}
    assert {m for m in graph["gptlab.interop.hf"] if m.startswith("gptlab.")} == {"gptlab.config"}


def test_only_the_entry_point_imports_the_command_line():
    """Library modules hold no command-line code and never import gptlab.cli (only __main__ runs it)."""
    graph, _ = _graph()
    assert sorted(n for n, deps in graph.items() if "gptlab.cli" in deps) == ["gptlab.__main__"]


# gptlab.train's modules in the data's order: each imports only those before it (and the package's
# modules outside gptlab.train); the package's __init__ re-exports. The command is in gptlab/cli.py.
TRAIN_ORDER = ["config", "schedule", "rng", "distributed", "signals", "evaluation", "metrics", "checkpoint",
               "run_folder", "setup", "distill", "loop"]


def test_train_modules_are_all_in_the_order():
    names = {p.stem for p in (PKG / "train").glob("*.py")} - {"__init__"}
    assert names == set(TRAIN_ORDER), "a module added to gptlab/train/ needs its place in TRAIN_ORDER"


@pytest.mark.parametrize("module", TRAIN_ORDER)
def test_train_modules_import_only_those_before_them(module):
    graph, _ = _graph()
    before = {f"gptlab.train.{m}" for m in TRAIN_ORDER[: TRAIN_ORDER.index(module)]}
    inside = {m for m in graph[f"gptlab.train.{module}"] if m == "gptlab.train" or m.startswith("gptlab.train.")}
    assert inside <= before, f"gptlab.train.{module} imports {sorted(inside - before)}, which come after it"


def test_training_holds_no_command_line_code():
    """The modules of gptlab.train take values, never an argparse namespace: the ``train``
    command's arguments are in gptlab/cli.py with every other command's."""
    users = [m for m in TRAIN_ORDER if "argparse" in (PKG / "train" / f"{m}.py").read_text(encoding="utf-8")]
    assert users == []


# The modules a learner reads as the definition of the model and its pieces. The speed-ups of
# gptlab.fast are swapped in from outside (by generation and speculative decoding), never imported
# by these, not even through another module.
TEACHING = ["config", "layers", "masks", "rope", "attention", "model", "kvcache", "sampling", "interop.hf",
            "tokenizers", "data", "bigram", "generation.config"]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


@pytest.mark.parametrize("module", TEACHING)
def test_teaching_modules_never_import_fast(module):
    graph, _ = _graph()
    fast = {m for m in _reachable(graph, f"gptlab.{module}") if m == "gptlab.fast" or m.startswith("gptlab.fast.")}
    assert fast == set(), f"gptlab.{module} imports {sorted(fast)}: the teaching modules stay plain PyTorch"


def test_the_fast_path_is_installed_from_outside():
    """gptlab.fast is used (by generation), and the rule above would catch a teaching module that did."""
    graph, _ = _graph()
    assert "gptlab.fast.cpu" in graph["gptlab.generation.loop"]
    assert "gptlab.fast.cpu" in graph["gptlab.generation.speculative"]
    assert "gptlab.fast.cpu" in _reachable(graph, "gptlab")  # through generation, re-exported by the package
