"""Reading a learner's submitted code, on the trusted side: delegation, and what could switch the guard off.

Where this sits: beside the pipeline, in the autograder (:mod:`gptlab.course.execute`). The
learner's kernel runs in an operating-system sandbox (:mod:`gptlab.course.sandbox`): it cannot reach
the gradebook, the grader, other students, the network or the solutions, nothing it starts outlives
it, and gptlab's references for the assignment are absent from it. The source is read for what the
operating system cannot see, inside the kernel's own process:

* **delegation** (:func:`delegation`), task by task, in the code a task's answer can reach (its
  function or class, and every function, class or module-level name of the learner's that it uses,
  however deep): any of gptlab's graders (``gptlab.grading``), every entry point the task's check
  forbids (gptlab's reference for the task, the fused PyTorch op), however it was imported or
  renamed, and reading files. Such a task scores 0, and the feedback names the spelling.
* **what could switch the runtime guard off** (:func:`guard_switches`), anywhere in the notebook:
  the guard that stops PyTorch's fused ops during a graded call lives in the kernel, so profiling
  and tracing hooks, computed attribute access, frames, code objects, tensor subclasses,
  ``torch.ops``/``torch._C``, compiled graphs and computed imports could get around it. Such a
  notebook is graded as usual and flagged for the instructor's review (nbgrader's
  needs-manual-grade), named in ``course grades`` and in the feedback: never zeroed, never silently
  passed. Importing or calling an ordinary module never zeroes or flags a notebook.

Shell escapes and the magics that run other programs or write files (``!cmd``, ``%%bash``,
``%%writefile``, ``%run``, ...) are not run by the autograder at all (:func:`neutralise_shell`).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Finding", "Program", "neutralise_shell", "guard_switches", "delegation", "bound_names",
           "REVIEW_LIST_SIZE"]


@dataclass(frozen=True)
class Finding:
    """One thing found in the learner's code: where (cell number, counted from 1 over the notebook's
    cells, and line) and what."""

    cell: int
    line: int
    code: str
    why: str

    def text(self) -> str:
        return f"cell {self.cell}, line {self.line}: `{self.code}`: {self.why}"


# --------------------------------------------------------------------------- IPython syntax

_SHELL_MAGICS = ("bash", "sh", "script", "writefile", "file", "python", "python2", "python3", "pypy", "perl",
                 "ruby", "system", "sx", "run", "load", "loadpy", "javascript", "js", "capture_shell", "cd",
                 "env", "set_env", "store", "macro", "edit", "save", "pycat", "bookmark", "alias", "unalias",
                 "autoawait", "pdb", "debug", "prun", "reset", "reset_selective", "xdel", "load_ext",
                 "reload_ext", "unload_ext", "conda", "pip", "mamba")


def neutralise_shell(source: str) -> tuple[str, list[str]]:
    """``source`` with shell escapes and program-running or file-writing magics made inert (a
    comment), and the lines that were. Plain magics (``%matplotlib``, ``%time``) are kept."""
    lines = source.split("\n")
    first = lines[0].strip() if lines else ""
    if first.startswith("%%"):
        name = first[2:].split()[0] if first[2:].split() else ""
        if name in _SHELL_MAGICS:
            return "\n".join("# (not run by the autograder) " + line for line in lines), [first]
    out, removed = [], []
    for line in lines:
        s = line.lstrip()
        word = re.match(r"%+(\w+)", s)
        if s.startswith("!") or (word and word.group(1) in _SHELL_MAGICS) or re.match(r"^\w+\s*=\s*[!%]", s):
            removed.append(s)
            out.append(line[: len(line) - len(s)] + "pass  # (not run by the autograder) " + s)
        else:
            out.append(line)
    return "\n".join(out), removed


def _python(source: str) -> str:
    """IPython's extra syntax turned into Python that parses with the same lines."""
    lines = source.split("\n")
    if lines and lines[0].lstrip().startswith("%%"):
        lines[0] = "pass"
    out = []
    for line in lines:
        s = line.lstrip()
        indent = line[: len(line) - len(s)]
        if s.startswith(("%", "!")) or (s.endswith("?") and not s.startswith("#")):
            out.append(indent + "pass")
        elif re.match(r"^[\w.]+\s*=\s*[!%]", s):
            out.append(indent + s.split("=", 1)[0] + "= None")
        else:
            out.append(line)
    return "\n".join(out)


# --------------------------------------------------------------------------- the program


@dataclass
class _Cell:
    number: int  # 1-based position in the notebook
    tree: ast.Module
    lines: list[str]
    learner: bool


class Program:
    """The notebook's code cells parsed: ``cells`` is ``[(number, source, written_by_learner)]``.

    Cells that do not parse are skipped (they fail in the kernel too); the names they would define
    are then undefined there as well.
    """

    def __init__(self, cells: Iterable[tuple[int, str, bool]]):
        self.cells: list[_Cell] = []
        self.unparsed: list[int] = []
        for number, source, learner in cells:
            text = _python(source)
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError):
                if learner:
                    self.unparsed.append(number)
                continue
            self.cells.append(_Cell(number, tree, text.split("\n"), learner))
        self.aliases = self._aliases()
        self.defs = self._defs()

    # name -> dotted path it stands for (imports and plain renames, anywhere in the notebook)
    def _aliases(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        stars: list[str] = []
        for cell in self.cells:
            for node in ast.walk(cell.tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.asname:
                            out.setdefault(a.asname, set()).add(a.name)
                        else:
                            out.setdefault(a.name.split(".")[0], set()).add(a.name.split(".")[0])
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    for a in node.names:
                        if a.name == "*":
                            stars.append(node.module)
                        else:
                            out.setdefault(a.asname or a.name, set()).add(f"{node.module}.{a.name}")
        for module in stars:
            if module.split(".")[0] not in ("gptlab", "torch"):
                continue
            try:
                mod = importlib.import_module(module)
            except Exception:  # noqa: BLE001
                continue
            for name in set(getattr(mod, "__all__", [])) | {n for n in dir(mod) if not n.startswith("_")}:
                out.setdefault(name, set()).add(f"{module}.{name}")
        # plain renames: x = a.b.c (anywhere), followed up to a fixed point
        renames: list[tuple[str, ast.AST]] = []
        for cell in self.cells:
            for node in ast.walk(cell.tree):
                if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    value = node.value
                    if value is None:
                        continue
                    for t in targets:
                        if isinstance(t, ast.Name) and isinstance(value, ast.Name | ast.Attribute):
                            renames.append((t.id, value))
        for _ in range(8):
            changed = False
            for name, value in renames:
                for path in _paths(value, out):
                    if path not in out.setdefault(name, set()):
                        out[name].add(path)
                        changed = True
            if not changed:
                break
        return out

    # top-level names the learner's cells define -> their nodes (functions, classes, assignments)
    def _defs(self) -> dict[str, list[tuple[_Cell, ast.AST]]]:
        out: dict[str, list[tuple[_Cell, ast.AST]]] = {}
        for cell in self.cells:
            if not cell.learner:
                continue
            for node in cell.tree.body:
                for name in bound_names(node):
                    out.setdefault(name, []).append((cell, node))
        return out

    def reachable(self, names: Sequence[str]) -> list[tuple[_Cell, ast.AST]]:
        """The learner's top-level statements that the answers ``names`` can reach, by the names
        they use (functions calling functions, classes using classes, module-level values)."""
        seen_names: set[str] = set()
        todo = list(names)
        nodes: list[tuple[_Cell, ast.AST]] = []
        seen_nodes: set[int] = set()
        while todo:
            name = todo.pop()
            if name in seen_names:
                continue
            seen_names.add(name)
            for cell, node in self.defs.get(name, []):
                if id(node) in seen_nodes:
                    continue
                seen_nodes.add(id(node))
                nodes.append((cell, node))
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Name) and sub.id in self.defs:
                        todo.append(sub.id)
                    elif isinstance(sub, ast.Attribute) and sub.attr in self.defs:
                        todo.append(sub.attr)  # self.helper / module-level helper used as an attribute
        return nodes

    def code(self, cell: _Cell, node: ast.AST) -> str:
        line = cell.lines[node.lineno - 1] if 0 < getattr(node, "lineno", 0) <= len(cell.lines) else ""
        text = ast.get_source_segment("\n".join(cell.lines), node) or line.strip()
        text = " ".join(text.split())
        return text if len(text) <= 80 else text[:77] + "..."


def bound_names(node: ast.AST) -> list[str]:
    """The names a top-level statement binds (a def, a class, an assignment, an import)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
    if isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
        return [n for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt) for n in bound_names(child)]
    return []


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """``a.b.c`` -> ("a", ["b", "c"]); None if the chain does not start at a name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id, list(reversed(attrs))
    return None


def _paths(node: ast.AST, aliases: dict[str, set[str]]) -> set[str]:
    """Every dotted path an expression ``a.b.c`` can stand for, through the notebook's imports."""
    chain = _chain(node)
    if chain is None:
        return set()
    root, attrs = chain
    return {".".join([p, *attrs]) for p in aliases.get(root, ())}


def _resolve(path: str) -> Any:
    """The object a dotted path of torch or gptlab names, imported here (trusted side), or None."""
    parts = path.split(".")
    if parts[0] not in ("torch", "gptlab"):
        return None
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # noqa: BLE001
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


# --------------------------------------------------------------------------- what could switch the guard off

# The operating system keeps the learner's kernel away from the gradebook, the grader, the network
# and the references (gptlab.course.sandbox). What it cannot see is inside the kernel's own process:
# the runtime guard (gptlab.grading.core.forbid) that stops PyTorch's fused ops during a graded
# call uses the interpreter's profiling hook, which code in the same process can switch off. The
# constructs below can do that, or reach a function by a name the source does not show; a notebook
# holding one is flagged for the instructor's review (never zeroed, never silently passed).

_REVIEW_NAMES = {
    "exec": "it runs code that is not in the notebook's source",
    "eval": "it runs code that is not in the notebook's source",
    "compile": "it makes code that is not in the notebook's source",
    "__import__": "it imports a module by a computed name",
    "globals": "it reads or changes the interpreter's namespaces directly",
    "locals": "it reads or changes the interpreter's namespaces directly",
    "vars": "it reads or changes the interpreter's namespaces directly",
    "breakpoint": "it starts a debugger",
    "__builtins__": "it reaches Python's built-in functions by name",
    "get_ipython": "it reaches into IPython, which runs the notebook's cells and the grader's server",
}
_REVIEW_ATTRS = {
    "setprofile": "it replaces the interpreter's profiling hook, which the grader's guard uses",
    "setprofile_all_threads": "it replaces the interpreter's profiling hook, which the grader's guard uses",
    "settrace": "it replaces the interpreter's tracing hook",
    "settrace_all_threads": "it replaces the interpreter's tracing hook",
    "monitoring": "it uses the interpreter's monitoring hooks",
    "_getframe": "it reads the interpreter's call frames",
    "currentframe": "it reads the interpreter's call frames",
    "f_back": "it reads the interpreter's call frames",
    "f_globals": "it reads the interpreter's call frames",
    "f_locals": "it reads the interpreter's call frames",
    "f_builtins": "it reads the interpreter's call frames",
    "tb_frame": "it reads the interpreter's call frames",
    "gi_frame": "it reads the interpreter's call frames",
    "__code__": "it reads or replaces a function's code",
    "__globals__": "it reads a function's namespace",
    "__closure__": "it reads a function's closure",
    "__builtins__": "it reaches Python's built-in functions by name",
    "__dict__": "it reads or changes an object's namespace by computed names",
    "__getattribute__": "it reads attributes by computed names",
    "__subclasses__": "it walks the class hierarchy to reach other code",
    "__torch_function__": "a tensor that overrides PyTorch's functions can answer any comparison",
    "__torch_dispatch__": "a tensor that overrides PyTorch's operators can answer any comparison",
    "_make_subclass": "it makes a tensor subclass",
    "as_subclass": "it makes a tensor subclass",
    "_C": "it calls PyTorch's internal C bindings, which the guard does not see",
    "_VF": "it calls PyTorch's internal C bindings, which the guard does not see",
    "ops": "it calls PyTorch's operator library directly (torch.ops), which the guard does not see",
    "library": "it defines PyTorch operators",
    "overrides": "it uses PyTorch's override machinery",
    "load_library": "it loads native code, which the notebook's source does not show",
    "cpp_extension": "it compiles and loads native code, which the notebook's source does not show",
    "meta_path": "it installs an import hook",
    "path_hooks": "it installs an import hook",
    "attrgetter": "it reads attributes by computed names",
    "methodcaller": "it calls methods by computed names",
    "getattr_static": "it reads attributes by computed names",
    "get_referrers": "it walks the interpreter's objects to reach other code",
    "get_referents": "it walks the interpreter's objects to reach other code",
    "get_objects": "it walks the interpreter's objects to reach other code",
    "import_module": "it imports a module by a computed name",
    "spec_from_file_location": "it imports code from a file, which the notebook's source does not show",
    "run_path": "it runs code from a file, which the notebook's source does not show",
    "run_module": "it runs code from a module by a computed name",
    "FunctionType": "it makes functions from code objects",
    "CodeType": "it makes code objects",
}
_REVIEW_PATHS = {
    "sys.modules": "it reads or changes the table of imported modules (sys.modules)",
    "sys.path": "it changes where modules are imported from (sys.path)",
    "torch.compile": "a compiled function runs PyTorch's operators where the guard does not see them",
    "torch.jit": "a scripted or traced function runs PyTorch's operators where the guard does not see them",
    "torch.fx": "it rewrites functions into graphs the guard does not see",
    "torch.export": "it rewrites functions into graphs the guard does not see",
    "torch._dynamo": "it rewrites functions into graphs the guard does not see",
    "pickle.loads": "unpickling can call any function, by names the source does not show",
    "pickle.load": "unpickling can call any function, by names the source does not show",
    "pickle.Unpickler": "unpickling can call any function, by names the source does not show",
    "marshal": "it loads code objects",
    "dill": "unpickling can call any function, by names the source does not show",
    "cloudpickle": "unpickling can call any function, by names the source does not show",
    "ctypes": "it calls native code directly",
    "cffi": "it calls native code directly",
    "importlib": "it imports modules by computed names",
    "runpy": "it runs code the notebook's source does not show",
    "code": "it runs code the notebook's source does not show",
    "codeop": "it compiles code the notebook's source does not show",
    "IPython.core": "it reaches into IPython, which runs the notebook's cells and the grader's server",
    "ipykernel": "it reaches into the kernel, which runs the notebook's cells and the grader's server",
    "threading.setprofile": "it replaces the interpreter's profiling hook, which the grader's guard uses",
    "threading.settrace": "it replaces the interpreter's tracing hook",
}
REVIEW_LIST_SIZE = len(_REVIEW_NAMES) + len(_REVIEW_ATTRS) + len(_REVIEW_PATHS)
"""How many constructs :func:`guard_switches` looks for (the closing note of issue 31 counts them)."""

_GETATTRS = ("getattr", "setattr", "delattr")


def guard_switches(program: Program) -> list[Finding]:
    """Where the learner's cells could switch the grader's runtime guard off, or reach a function
    by a name their source does not show (see above): the notebook is then flagged for the
    instructor's review. An empty list for an honest notebook: importing or calling an ordinary
    module (``types``, ``operator``, ``gc``, ``pickle.dump``, ``inspect.signature``, ``functools``,
    ``threading.Thread``, ``dataclasses``, ``itertools``) is not flagged."""
    found: list[Finding] = []

    def add(cell: _Cell, node: ast.AST, why: str) -> None:
        found.append(Finding(cell.number, getattr(node, "lineno", 1), program.code(cell, node), why))

    def path_hit(paths: Iterable[str]) -> str | None:
        for p in sorted(paths):
            for prefix, why in _REVIEW_PATHS.items():
                if p == prefix or p.startswith(prefix + "."):
                    return why
        return None

    for cell in program.cells:
        if not cell.learner:
            continue
        constant_getattr = {id(n.func) for n in ast.walk(cell.tree) if isinstance(n, ast.Call)
                            and isinstance(n.func, ast.Name) and n.func.id in _GETATTRS and len(n.args) >= 2
                            and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)}
        for node in ast.walk(cell.tree):
            why = None
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if isinstance(node, ast.ImportFrom) and node.level:
                    why = "it imports a module from a file beside the notebook, whose code is not in the notebook"
                else:
                    why = path_hit(names) or next((_REVIEW_ATTRS[n.split(".")[-1]] for n in names
                                                   if n.split(".")[-1] in _REVIEW_ATTRS), None)
            elif isinstance(node, ast.Name) and node.id not in program.defs:
                if node.id in _REVIEW_NAMES:
                    why = _REVIEW_NAMES[node.id]
                elif node.id in _GETATTRS and id(node) not in constant_getattr:
                    why = "it reads or writes attributes by computed names"
                elif node.id in program.aliases:
                    why = path_hit(program.aliases[node.id])
            elif isinstance(node, ast.Attribute):
                why = _REVIEW_ATTRS.get(node.attr) or path_hit(_paths(node, program.aliases))
            elif isinstance(node, ast.ClassDef):
                if any(p in ("torch.Tensor", "torch.nn.Parameter", "torch._C.TensorBase")
                       for b in node.bases for p in _paths(b, program.aliases)):
                    why = "a subclass of torch.Tensor can answer any comparison"
            if why:
                add(cell, node, why)
    unique: dict[tuple, Finding] = {}
    for f in found:
        unique.setdefault((f.cell, f.line, f.why), f)
    return sorted(unique.values(), key=lambda f: (f.cell, f.line))


# --------------------------------------------------------------------------- delegation

_FILE_READS = {"open": "it reads a file", "read_text": "it reads a file", "read_bytes": "it reads a file",
               "loadtxt": "it reads a file", "fromfile": "it reads a file", "load_file": "it reads a file",
               "safe_open": "it reads a file", "urlopen": "it downloads", "from_file": "it reads a file",
               "genfromtxt": "it reads a file", "memmap": "it reads a file", "getline": "it reads a file",
               "getlines": "it reads a file", "urlretrieve": "it downloads"}
_FILE_READ_PATHS = {
    "torch.load": "it reads a file", "torch.jit.load": "it reads a file", "torch.hub": "it downloads or reads a file",
    "numpy.load": "it reads a file", "linecache": "it reads a file", "fileinput": "it reads a file",
    "requests": "it downloads", "urllib": "it downloads", "http.client": "it downloads",
}


def _walk_code(node: ast.AST):
    """``ast.walk`` without type annotations (naming a type is not calling it)."""
    skip: set[int] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg) and sub.annotation is not None:
            skip.update(id(n) for n in ast.walk(sub.annotation))
        elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and sub.returns is not None:
            skip.update(id(n) for n in ast.walk(sub.returns))
        elif isinstance(sub, ast.AnnAssign):
            skip.update(id(n) for n in ast.walk(sub.annotation))
    for sub in ast.walk(node):
        if id(sub) not in skip:
            yield sub


def delegation(program: Program, names: Sequence[str], forbidden: Iterable[Any] = (), task: str = "") -> list[Finding]:
    """Where the code reachable from the answers ``names`` uses gptlab's graders, one of the
    ``forbidden`` entry points (:class:`gptlab.grading.core.Forbidden`), or reads files."""
    keys: dict[Any, str] = {}
    methods: dict[str, str] = {}
    classes = {id(f.target): f.name for f in forbidden if isinstance(f.target, type)}
    for f in forbidden:
        for k in f.keys():
            if k[0] == "method":
                methods[k[1]] = f.name
            else:
                keys[k] = f.name
    found: list[Finding] = []
    resolved: dict[str, Any] = {}

    def entry(path: str) -> str | None:
        if path.startswith("gptlab.grading"):
            return f"{path} (the grader's own code)"
        if path not in resolved:
            resolved[path] = _resolve(path)
        obj = resolved[path]
        if obj is None:
            return None
        if isinstance(obj, type):  # naming a class is using it only when the class itself is forbidden
            return classes.get(id(obj))
        from .core import Forbidden

        for k in Forbidden(obj, path).keys():
            if k in keys:
                return keys[k]
        return None

    for cell, top in program.reachable(names):
        for node in _walk_code(top):
            why = None
            if isinstance(node, ast.Attribute | ast.Name):
                for path in sorted(_paths(node, program.aliases)):
                    hit = entry(path)
                    if hit:
                        why = f"it uses {hit}, which computes the answer for you"
                        break
                if why is None and isinstance(node, ast.Attribute) and node.attr in methods:
                    why = f"it uses {methods[node.attr]}, which computes the answer for you"
                if why is None and isinstance(node, ast.Name) and node.id == "open" and node.id not in program.defs:
                    why = _FILE_READS["open"]
                if why is None and isinstance(node, ast.Attribute) and node.attr in _FILE_READS:
                    why = _FILE_READS[node.attr]
                if why is None and isinstance(node, ast.Name) and node.id in _FILE_READS and \
                        node.id in program.aliases:  # from safetensors.torch import load_file
                    why = _FILE_READS[node.id]
                if why is None:
                    why = next((w for path in _paths(node, program.aliases) for prefix, w in _FILE_READ_PATHS.items()
                                if path == prefix or path.startswith(prefix + ".")), None)
            elif isinstance(node, ast.ImportFrom | ast.Import):
                mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                if any(m.startswith("gptlab.grading") for m in mods):
                    why = "it imports the grader's own code"
            if why:
                found.append(Finding(cell.number, getattr(node, "lineno", 1), program.code(cell, node), why))
    unique: dict[tuple, Finding] = {}
    for f in found:
        unique.setdefault((f.cell, f.line, f.why), f)
    return sorted(unique.values(), key=lambda f: (f.cell, f.line))

