"""Reading a learner's submitted code, on the trusted side: tampering and delegation found in the source.

Where this sits: beside the pipeline, in the autograder (:mod:`gptlab.course.execute`). The runtime
guard of :func:`gptlab.grading.core.forbid` runs inside the learner's process, where the learner's
own code could switch it off; the submitted source cannot be switched off. Before any verdict, the
trusted process reads the learner's cells (every code cell that is not locked) and finds:

* **tampering** (:func:`tampering`), anywhere in the notebook: code that changes how Python, IPython
  or PyTorch run other code or report results (IPython hooks, ``sys.setprofile``, import hooks,
  ``exec``/``eval``/``compile``, frames and code objects, ``__torch_function__`` subclasses,
  ``torch.ops``/``torch._C``, threads and processes, assignments into imported modules). Such a
  notebook scores 0, and the feedback names the line.
* **delegation** (:func:`delegation`), in the code a task's answer can reach (its function or
  class, and every function, class or module-level name of the learner's that it uses, however
  deep): any of gptlab's graders (``gptlab.grading``), every entry point the task's check forbids
  (gptlab's reference for the task, the fused PyTorch op), however it was imported or renamed, and
  reading files. Such a task scores 0, and the feedback names the spelling.

Shell escapes and the magics that run other programs or write files (``!cmd``, ``%%bash``,
``%%writefile``, ``%run``, ...) are not run by the autograder at all (:func:`neutralise_shell`).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Finding", "Program", "neutralise_shell", "tampering", "delegation", "bound_names", "file_writes",
           "imported_modules", "planted_modules"]


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


# --------------------------------------------------------------------------- tampering

_TAMPER_NAMES = {
    "get_ipython": "it reaches into IPython, which runs the notebook's code",
    "exec": "it runs code that is not in the notebook's source",
    "eval": "it runs code that is not in the notebook's source",
    "compile": "it makes code that is not in the notebook's source",
    "__import__": "it imports a module by a computed name",
    "globals": "it reads or changes the interpreter's namespaces directly",
    "locals": "it reads or changes the interpreter's namespaces directly",
    "vars": "it reads or changes the interpreter's namespaces directly",
    "breakpoint": "it starts a debugger",
    "__builtins__": "it changes Python's built-in functions",
}
_TAMPER_ATTRS = {
    "setprofile": "it replaces the interpreter's profiling hook, which the grader's guard uses",
    "settrace": "it replaces the interpreter's tracing hook",
    "monitoring": "it uses the interpreter's monitoring hooks",
    "meta_path": "it installs an import hook",
    "path_hooks": "it installs an import hook",
    "path_importer_cache": "it changes how modules are imported",
    "displayhook": "it replaces how results are shown",
    "excepthook": "it replaces how errors are reported",
    "_getframe": "it reads the interpreter's call frames",
    "f_back": "it reads the interpreter's call frames",
    "f_globals": "it reads the interpreter's call frames",
    "f_locals": "it reads the interpreter's call frames",
    "f_builtins": "it reads the interpreter's call frames",
    "f_code": "it reads the interpreter's call frames",
    "tb_frame": "it reads the interpreter's call frames",
    "gi_frame": "it reads the interpreter's call frames",
    "__code__": "it reads or replaces a function's code",
    "__globals__": "it reads a function's namespace",
    "__closure__": "it reads a function's closure",
    "__builtins__": "it changes Python's built-in functions",
    "__torch_function__": "a tensor that overrides PyTorch's functions can answer any comparison",
    "__torch_dispatch__": "a tensor that overrides PyTorch's operators can answer any comparison",
    "_make_subclass": "it makes a tensor subclass",
    "as_subclass": "it makes a tensor subclass",
    "__subclasses__": "it walks the class hierarchy to reach other code",
    "__bases__": "it walks the class hierarchy to reach other code",
    "__mro__": "it walks the class hierarchy to reach other code",
    "__dict__": "it reads or changes an object's namespace directly",
    "__getattribute__": "it reads attributes by computed names",
    "_C": "it calls PyTorch's internal C bindings",
    "_VF": "it calls PyTorch's internal C bindings",
    "ops": "it calls PyTorch's operator library directly (torch.ops)",
    "overrides": "it uses PyTorch's override machinery",
    "library": "it defines PyTorch operators",
    "cpp_extension": "it compiles and loads native code, which the notebook's source does not show",
    "load_library": "it loads native code, which the notebook's source does not show",
    "get_ipython": "it reaches into IPython, which runs the notebook's code",
    "input_transformers_post": "it installs an IPython input transformer",
    "input_transformers_cleanup": "it installs an IPython input transformer",
    "ast_transformers": "it installs an IPython AST transformer",
    "register_magic_function": "it defines an IPython magic",
    "run_cell": "it changes how IPython runs cells",
    "user_ns": "it reaches into IPython's namespace",
    "system": "it runs another program",
    "popen": "it runs another program",
    "fork": "it starts another process",
    "FunctionType": "it makes functions from code objects",
    "CodeType": "it makes code objects",
    "attrgetter": "it reads attributes by computed names",
    "methodcaller": "it calls methods by computed names",
}
_TAMPER_MODULES = {
    "importlib", "inspect", "ctypes", "gc", "threading", "_thread", "multiprocessing", "concurrent", "subprocess",
    "signal", "builtins", "IPython", "ipykernel", "marshal", "pickle", "dill", "cloudpickle", "code", "codeop",
    "runpy", "pdb", "bdb", "trace", "socket", "atexit", "sysconfig", "torch._C", "torch.ops", "torch.overrides",
    "torch.library", "torch.utils._python_dispatch", "torch._VF", "torch._ops", "torch._dynamo", "asyncio",
    "types", "operator", "dis", "tracemalloc", "faulthandler", "sitecustomize", "usercustomize", "site",
    "pkgutil", "zipimport", "imp", "torch.multiprocessing", "torch.utils.cpp_extension", "cffi",
}
_DISPLAY_MODULES = {"IPython.display", "IPython.core.display"}
"""Showing results (``display``, ``clear_output``, ``Markdown``): fair to import; reaching IPython itself
through them (``get_ipython``) is still found."""
_PATH_MUTATORS = {"append", "insert", "extend", "remove", "pop", "clear", "__setitem__", "__iadd__"}


def _installed(name: str) -> bool:
    """Whether the top-level module ``name`` is part of the environment (the standard library or an
    installed package, gptlab included) rather than a file beside the notebook, which a cell can
    write and then import: code the source scan never sees. Finds, never imports."""
    if name in sys.builtin_module_names or name in getattr(sys, "stdlib_module_names", ()) or name == "gptlab":
        return True
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    here = os.path.realpath(os.getcwd())
    if spec.submodule_search_locations:  # a package: the folders that hold it
        folders = [os.path.dirname(os.path.realpath(p)) for p in spec.submodule_search_locations]
    elif spec.origin and spec.has_location:  # a module file: its folder
        folders = [os.path.dirname(os.path.realpath(spec.origin))]
    else:
        return True  # builtin or frozen
    return bool(folders) and here not in folders


_WRITE_PATHS = ("shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree", "shutil.move",
                "shutil.unpack_archive", "os.rename", "os.replace", "os.link", "os.symlink", "os.write", "os.open",
                "os.fdopen", "io.FileIO", "logging.FileHandler", "logging.basicConfig", "tempfile", "numpy.savetxt",
                "numpy.save", "tarfile", "zipfile", "urllib.request.urlretrieve", "codecs.open")
_WRITE_ATTRS = ("write_text", "write_bytes", "urlretrieve", "symlink_to", "hardlink_to", "extractall", "savetxt",
                "FileHandler")


def file_writes(program: Program) -> list[Finding]:
    """Where the learner's cells may write a file: ``open`` with a mode that writes (or ``open``
    passed around rather than called), ``Path.write_text``, ``shutil``, ``os.rename``, downloads,
    logging to a file... A cell can write a module and import it (:func:`tampering`)."""
    found: list[Finding] = []
    for cell in program.cells:
        if not cell.learner:
            continue
        calls = {id(n.func): n for n in ast.walk(cell.tree) if isinstance(n, ast.Call)}
        for node in ast.walk(cell.tree):
            why = None
            if isinstance(node, ast.Name) and node.id == "open" and node.id not in program.defs:
                call = calls.get(id(node))
                mode = None if call is None else (call.args[1] if len(call.args) > 1 else next(
                    (k.value for k in call.keywords if k.arg == "mode"), ast.Constant("r")))
                if call is None or not (isinstance(mode, ast.Constant) and isinstance(mode.value, str)
                                        and not set(mode.value) & set("wax+")):
                    why = "it writes a file"
            elif isinstance(node, ast.Attribute) and node.attr in _WRITE_ATTRS:
                why = "it writes a file"
            elif isinstance(node, ast.Attribute | ast.Name) and any(
                    p == w or p.startswith(w + ".") for p in _paths(node, program.aliases) for w in _WRITE_PATHS):
                why = "it writes a file"
            if why:
                found.append(Finding(cell.number, getattr(node, "lineno", 1), program.code(cell, node), why))
    return found


def imported_modules(program: Program) -> set[str]:
    """The dotted names the learner's cells import, and for ``from a.b import c`` also ``a.b.c``
    (``c`` may be a module)."""
    out: set[str] = set()
    for cell in program.cells:
        if cell.learner:
            for node in ast.walk(cell.tree):
                if isinstance(node, ast.Import):
                    out |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names if a.name != "*"}
    return out


def _module_files(name: str) -> list[str]:
    """The files that ``import name`` (dotted) would run, found without importing anything: the
    top-level module's file (a package's ``__init__.py``), then each submodule's beneath it."""
    parts = name.split(".")
    if parts[0] in sys.builtin_module_names:
        return []
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: finds, never imports
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    files = [spec.origin] if spec.origin and spec.has_location else []
    folders = list(spec.submodule_search_locations or [])
    for part in parts[1:]:
        found = [c for f in folders for c in (os.path.join(f, part + ".py"), os.path.join(f, part, "__init__.py"))
                 if os.path.isfile(c)]
        if not found:
            break
        files.append(found[0])
        folders = [os.path.dirname(found[0])] if found[0].endswith("__init__.py") else []
    return files


def planted_modules(program: Program, folder: str | os.PathLike | None, since: float) -> list[str]:
    """Modules the notebook imports that were written while it was graded: a file or folder of that
    name in the kernel's ``folder`` (which held only the notebooks when the kernel started), or a
    module file on the import path (a package's ``__init__.py``, a submodule's file) modified after
    ``since`` (a time.time()). Folders' times are not read: importing a package writes its
    ``__pycache__`` there."""
    found = []
    for dotted in sorted(imported_modules(program)):
        name = dotted.split(".")[0]
        if folder is not None:
            base = os.path.join(os.fspath(folder), name)
            if os.path.exists(base + ".py") or os.path.isdir(base) or any(
                    f.startswith(name + ".") and f.endswith((".so", ".pyd", ".pyc"))
                    for f in os.listdir(folder)):
                found.append(f"{name} (written beside the notebook)")
                continue
        new = [f for f in _module_files(dotted) if os.path.getmtime(f) > since]
        if new:
            found.append(f"{dotted} (written to {new[0]} while the notebook was graded)")
    return sorted(set(found))


def tampering(program: Program) -> list[Finding]:
    """Code anywhere in the learner's cells that can change how code runs or how results are
    reported (see the module docstring). An empty list for an honest notebook."""
    found: list[Finding] = []
    writes = file_writes(program)
    modules = {name for name, paths in program.aliases.items()
               if any(p.split(".")[0] in ("torch", "gptlab", "numpy", "math", "sys", "os", "builtins") for p in paths)}

    def add(cell: _Cell, node: ast.AST, why: str) -> None:
        found.append(Finding(cell.number, getattr(node, "lineno", 1), program.code(cell, node), why))

    for cell in program.cells:
        if not cell.learner:
            continue
        called = {id(n.func) for n in ast.walk(cell.tree) if isinstance(n, ast.Call)}
        for node in ast.walk(cell.tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.module:  # from torch.utils import cpp_extension
                    names += [f"{node.module}.{a.name}" for a in node.names]
                if isinstance(node, ast.ImportFrom) and node.module == "IPython" and \
                        all(a.name == "display" for a in node.names):
                    names = ["IPython.display"]
                names = [n for n in names if not any(n == m or n.startswith(m + ".") for m in _DISPLAY_MODULES)]
                if isinstance(node, ast.ImportFrom) and node.level:
                    add(cell, node, "it imports a module from a file beside the notebook, whose code is not in "
                                    "the notebook")
                    continue
                local = next((n for n in names if n and not _installed(n.split(".")[0])), None) if writes else None
                if local:
                    add(cell, node, f"it imports {local.split('.')[0]}, which is not an installed module, and the "
                                    f"notebook writes files ({writes[0].code}): a module written from the notebook "
                                    "runs code that is not in its source")
                    continue
                for n in names:
                    if n in _TAMPER_MODULES or n.split(".")[0] in _TAMPER_MODULES or \
                            any(n == m or n.startswith(m + ".") for m in _TAMPER_MODULES if "." in m) or \
                            n.split(".")[-1] in _TAMPER_ATTRS:
                        add(cell, node, f"it imports {n}, which can change how code runs")
                        break
            elif isinstance(node, ast.Name) and node.id in _TAMPER_NAMES and node.id not in program.defs:
                add(cell, node, _TAMPER_NAMES[node.id])
            elif isinstance(node, ast.Attribute):
                if node.attr in _TAMPER_ATTRS:
                    add(cell, node, _TAMPER_ATTRS[node.attr])
                elif node.attr == "modules" and id(node) not in called:
                    add(cell, node, "it reads or changes the table of imported modules (sys.modules)")
                elif node.attr in _PATH_MUTATORS and "sys.path" in _paths(node.value, program.aliases):
                    add(cell, node, "it changes where modules are imported from (sys.path)")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "setattr", "delattr", "hasattr") and len(node.args) >= 2 and \
                    not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                if node.func.id != "hasattr":
                    add(cell, node, "it reads or writes attributes by computed names")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("setattr", "delattr") and node.args and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id in modules:
                add(cell, node, "it changes a module other code uses")
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
                targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Subscript) and "sys.path" in _paths(t.value, program.aliases):
                        add(cell, node, "it changes where modules are imported from (sys.path)")
                    chain = _chain(t) if isinstance(t, ast.Attribute) else None
                    if chain and chain[0] in modules:
                        add(cell, node, f"it changes {chain[0]}.{'.'.join(chain[1])}, which other code uses")
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    if any(p in ("torch.Tensor", "torch.nn.Parameter", "torch._C.TensorBase")
                           for p in _paths(base, program.aliases)):
                        add(cell, node, "a subclass of torch.Tensor can answer any comparison")
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

