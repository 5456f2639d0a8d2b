"""Grades the learner cannot write: verdicts decided in the autograder's process.

* The protocol (:mod:`gptlab.grading.remote`) carries plain data only: tensors come back as plain
  ``torch.Tensor`` rebuilt from bytes, malformed replies are refused, exceptions are rebuilt by name.
* Every graded test cell of ``solutions/`` is a task of :data:`gptlab.grading.tasks.TASKS`, and
  the instructor's solution passes every task through the protocol, hidden inputs included.
* The source reader (:mod:`gptlab.grading.source`) finds nothing in the solutions, and finds each
  tampering and delegation spelling an attacker used.
* Through the real ``course autograde`` (one shared run): each attack of issue 18 scores 0 on the
  tasks it touches and is named in the feedback; correct answers that warn, print to stderr, or
  whose test cell was switched to markdown keep full marks; a hanging function costs one time limit.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from gptlab.course import Course
from gptlab.course.trusted import TrustedGrader, learner_cells
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
    assert grader.tampered == []
    for gid in _grade_ids(nb):
        verdict = grader.grade(gid, lambda: remote.local_connection(ns, timeout=900))
        assert verdict.passed, f"{name}/{gid}: {verdict.message}"


# --------------------------------------------------------------------------- reading the source


def _program(code: str, extra: str = "import torch\nimport torch.nn.functional as F\n") -> source.Program:
    return source.Program([(1, extra, False), (2, code, True)])


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_the_solutions_have_no_tampering_or_delegation(name):
    nb = _notebook(name)
    prog = source.Program(learner_cells(nb["cells"]))
    assert source.tampering(prog) == []


ATTACKS = [
    ("get_ipython().input_transformers_post.append(lambda lines: lines)", "IPython"),
    ("import sys\nsys.displayhook('ok')", "how results are shown"),
    ("import IPython.display\nip = IPython.get_ipython()", "reaches into IPython"),
    ("from IPython import get_ipython", "IPython"),
    ("import sys\nsys.meta_path.insert(0, object())", "import hook"),
    ("import sys as s\ns.setprofile(None)", "profiling hook"),
    ("class Yes(torch.Tensor):\n    pass", "subclass of torch.Tensor"),
    ("def f(x):\n    return torch.ops.aten.gelu(x)", "torch.ops"),
    ("def f(x, y):\n    return torch._C._nn.cross_entropy_loss(x, y)", "C bindings"),
    ("import threading", "threading"),
    ("import inspect", "inspect"),
    ("exec('x = 1')", "not in the notebook's source"),
    ("m = __import__('gpt' + 'lab')", "computed name"),
    ("torch.allclose = lambda *a, **k: True", "changes torch.allclose"),
    ("name = 'o' + 'ps'\nf = getattr(torch, name)", "computed names"),
    ("import sys\nx = sys.modules['gptlab']", "sys.modules"),
    ("def f(fn):\n    return fn.__globals__", "namespace"),
    ("import pkgutil\nf = pkgutil.resolve_name('gptlab.masks:causal_mask')", "pkgutil"),
    ("import torch.multiprocessing as mp", "torch.multiprocessing"),
    ("import sys\nsys.path.insert(0, '/tmp/answers')", "sys.path"),
    ("import sys as s\ns.path[:0] = ['/tmp/answers']", "sys.path"),
    ("open('helper.py', 'w').write('from gptlab.masks import causal_mask')\nfrom helper import causal_mask",
     "not an installed module"),
    ("from .helper import causal_mask", "a file beside the notebook"),
    ("from torch.utils import cpp_extension\nm = cpp_extension.load_inline('m', '')", "cpp_extension"),
    ("import torch.utils.cpp_extension as ce", "cpp_extension"),
    ("torch.ops.load_library('evil.so')", "torch.ops"),
    ("from torch.utils.cpp_extension import load_inline", "cpp_extension"),
]


@pytest.mark.parametrize("code, says", ATTACKS)
def test_tampering_is_found(code, says):
    found = source.tampering(_program(code))
    assert found and any(says in f.why or says in f.code for f in found), [f.text() for f in found]


def test_an_import_that_is_not_installed_is_tampering_only_if_the_notebook_writes_files():
    """`from google.colab import drive` in a Colab learner's notebook fails in the autograder's kernel
    (that cell only), it is not tampering; with a file written anywhere it is (the module may be it)."""
    assert source.tampering(_program("from google.colab import drive\ndrive.mount('/content/drive')")) == []
    found = source.tampering(_program("from google.colab import drive\nimport logging\n"
                                      "logging.basicConfig(filename='google.py')"))
    assert found and "writes files" in found[0].why
    for writes in ("open(name, 'w')", "open('x', mode='a')", "f = open", "Path('x.py').write_text('')",
                   "import shutil\nshutil.copy('a', 'b')", "import os\nos.rename('a', 'b')",
                   "import numpy as np\nnp.savetxt('a.py', [], header='import gptlab')"):
        assert source.file_writes(_program(writes)), writes
    for reads in ("open('x')", "open('x', 'rb')", "with open(p, mode='r') as f:\n    pass", "s.replace('a', 'b')"):
        assert source.file_writes(_program(reads)) == [], reads


def test_a_module_written_while_grading_is_found(tmp_path, monkeypatch):
    import time

    program = _program("import helper\nimport numpy\nfrom json import dumps")
    since = time.time() - 1
    assert source.planted_modules(program, tmp_path, since) == []
    (tmp_path / "helper.py").write_text("x = 1\n")
    assert source.planted_modules(program, tmp_path, since) == ["helper (written beside the notebook)"]
    # on the import path (a site-packages a kernel could write to), newer than the grading's start
    site = tmp_path / "site"
    site.mkdir()
    (site / "helper2.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(site))
    found = source.planted_modules(_program("import helper2"), None, since)
    assert len(found) == 1 and "while the notebook was graded" in found[0]
    assert source.planted_modules(_program("import helper2"), None, time.time() + 60) == []
    # a submodule added to a package that was there before grading; a package that only gains its
    # __pycache__ (its folder's time changes on a first import) is not flagged
    pkg = site / "oldpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub.py").write_text("x = 1\n")
    for f in (pkg / "__init__.py", pkg / "sub.py"):
        os.utime(f, (since - 100, since - 100))
    (pkg / "__pycache__").mkdir()
    assert source.planted_modules(_program("import oldpkg.sub\nfrom oldpkg import sub"), None, since) == []
    (pkg / "evil.py").write_text("x = 1\n")
    found = source.planted_modules(_program("from oldpkg import evil"), None, since)
    assert len(found) == 1 and found[0].startswith("oldpkg.evil") and "evil.py" in found[0]


def test_honest_code_is_not_tampering():
    code = ("import math, sys\nimport numpy as np\nfrom typing import Optional\n"
            "class Block(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.ln = torch.nn.LayerNorm(4)\n        for m in self.modules():\n            pass\n"
            "def f(x):\n    print('debug', file=sys.stderr)\n    return torch.tril(x) + math.sqrt(2)\n"
            "%matplotlib inline\nprint(f(torch.ones(2, 2)))\nx = torch.ones(3)\nx.data = x.data * 2\n"
            "from IPython.display import display, clear_output, Markdown\nfrom IPython import display as d\n"
            "import IPython.display\nclear_output(wait=True)\ndisplay(Markdown('**ok**'))\n")
    assert source.tampering(_program(code)) == []


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


def _causal_mask_submissions(r: _Release) -> dict[str, tuple[dict, dict, str]]:
    """student -> (notebook, expected scores, a phrase the test cells' outputs must contain)."""
    hook = ("ip = get_ipython()\nip.input_transformers_post.append(\n"
            "    lambda lines: ['pass\\n'] if any('check_' in l for l in lines) else lines)\n")
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
        "hook_ipython": (r.extra(r.release, hook), CM_ZERO, "IPython input transformer"),
        "displayhook": (r.answer("causal_mask", "import sys\n\ndef causal_mask(T):\n    sys.displayhook('ok')\n"
                                 "    return torch.ones(T, T, dtype=torch.bool)\n"), CM_ZERO, "how results are shown"),
        "meta_path": (r.extra(r.release, "import sys\nclass Finder:\n    def find_spec(self, *a):\n        return None\n"
                              "sys.meta_path.insert(0, Finder())\n"), CM_ZERO, "import hook"),
        "subclass": (r.answer("causal_mask", subclass), CM_ZERO, "subclass of torch.Tensor"),
        "buffer8": (r.answer("causal_mask", "_M = torch.ones(8, 8, dtype=torch.bool).tril()\n\n"
                             "def causal_mask(T):\n    return _M[:T, :T]\n"), CM_MASK_LOST, "hidden inputs"),
        "setprofile": (r.answer("causal_mask", "import sys\nimport gptlab\n\ndef causal_mask(T):\n"
                                "    sys.setprofile(None)\n    return gptlab.causal_mask(T)\n"), CM_ZERO, "profiling hook"),
        "alias": (r.answer("causal_mask", "from gptlab import masks as mm\nhelper = mm.causal_mask\n\n"
                           "def causal_mask(T):\n    return helper(T)\n"), CM_MASK_LOST, "gptlab.causal_mask"),
        "thread": (r.answer("causal_mask", "import threading\nimport gptlab\n\ndef causal_mask(T):\n    out = []\n"
                            "    t = threading.Thread(target=lambda: out.append(gptlab.causal_mask(T)))\n"
                            "    t.start()\n    t.join()\n    return out[0]\n"), CM_ZERO, "threading"),
        "exec_source": (r.answer("causal_mask", "import inspect\nimport gptlab\n"
                                 "exec(inspect.getsource(gptlab.masks.causal_mask))\n"), CM_ZERO, "inspect"),
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
        # a module written by a cell in a way the source scan does not see as a file write (ndarray.tofile): found
        # in the kernel's folder at the test (if tofile joins the scan's list, this tests the scan instead)
        "planted": (r.answer("causal_mask", "import numpy as np\n"
                                            f"np.frombuffer({HELPER_FILE.encode()!r}, dtype=np.uint8).tofile('helper.py')\n"
                                            "from helper import causal_mask\n"), CM_ZERO, "that it wrote while it ran"),
    }



@pytest.fixture(scope="module")
def autograded(tmp_path_factory):
    from gptlab.__main__ import main
    from gptlab.course.autograde import autograde

    root = _course(tmp_path_factory.mktemp("trusted") / "course", ["causal_mask", "kv_cache"])
    plan: dict[tuple[str, str], tuple[dict, str]] = {}
    r = _Release(root, "causal_mask")
    inbox = tmp_path_factory.mktemp("inbox-cm")
    for student, (nb, expected, says) in _causal_mask_submissions(r).items():
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
    results = autograde(Course(root), ["causal_mask", "kv_cache"], workers=2, timeout=TIMEOUT, progress=False)
    return root, plan, {(x["assignment"], x["student"]): x for x in results}


def _outputs(root: Path, name: str, student: str) -> str:
    nb = json.loads((root / "autograded" / student / name / f"{name}.ipynb").read_text())
    parts = []
    for c in nb["cells"]:
        if c["metadata"].get("nbgrader", {}).get("grade"):
            for o in c.get("outputs", []):
                parts.append(o.get("text", "") if isinstance(o.get("text"), str) else "".join(o.get("text", [])))
                parts.append(o.get("evalue", ""))
    return "\n".join(parts)


STUDENTS = ["solution", "blank", "hook_ipython", "displayhook", "meta_path", "subclass", "buffer8", "setprofile",
            "alias", "thread", "exec_source", "solution_file", "warns", "markdown", "loop", "extra_file", "planted"]


@pytest.mark.slow
def test_files_beside_the_notebook_are_not_there_while_grading(autograded):
    """A learner's helper.py (or torch.py, sitecustomize.py) in the submission folder is removed before
    the kernel starts in it, and the feedback says so."""
    _, _, results = autograded
    notes = [n["message"] for n in results[("causal_mask", "extra_file")]["notes"] if n["kind"] == "ignored_files"]
    assert notes and "helper.py" in notes[0], results[("causal_mask", "extra_file")]["notes"]
    assert not [n for n in results[("causal_mask", "solution")]["notes"] if n["kind"] == "ignored_files"]


@pytest.mark.slow
@pytest.mark.parametrize("student", STUDENTS)
def test_attacks_score_zero_and_correct_answers_full_marks(autograded, student):
    root, plan, results = autograded
    expected, says = plan[("causal_mask", student)]
    res = results[("causal_mask", student)]
    got = res["notebooks"]["causal_mask"]["grades"]
    assert got == expected, f"{student}: {got} (notes: {res['notes']})"
    text = _outputs(root, "causal_mask", student)
    assert says in text, f"{student}: the test cells' outputs lack {says!r}:\n{text[:3000]}"


@pytest.mark.slow
def test_a_lookup_table_of_the_visible_cases_fails_the_hidden_ones(autograded):
    root, _, results = autograded
    got = results[("kv_cache", "table")]["notebooks"]["kv_cache"]["grades"]
    assert got["test_kv_cache_bytes"] == 0.0 and got["test_KVCache"] == 4.0
    assert "hidden inputs" in _outputs(root, "kv_cache", "table")


@pytest.mark.slow
def test_a_hanging_function_costs_one_time_limit(autograded):
    _, _, results = autograded
    res = results[("causal_mask", "loop")]
    # the learner's own cell before the test that calls it (the kernel's limit), and ONE test; later tests
    # and the learner's later cells that call it are not run again (before: 30 s in every such cell, 180 s)
    assert res["seconds"] < 2 * TIMEOUT + 45, res["seconds"]
    later = [n["message"] for n in res["notes"] if n["cell"] in ("test_additive_mask", "test_causal_attention_weights")]
    assert len(later) == 2 and all("stopped earlier" in m for m in later), res["notes"]
