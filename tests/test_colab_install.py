"""The notebooks' Colab set-up cell, run for real in a fresh virtual environment that stands in for a
Colab runtime: the install keeps the runtime's torch, the data is fetched, a chapter and an exercise run.

What is simulated, exactly:

* **Colab's torch.** A Colab runtime comes with its own build of torch (a CUDA build, e.g.
  ``2.x.y+cu126``), a release other than the one ``constraints.txt`` pins. Here the torch that
  this test suite runs with (the pinned ``torch==2.13.0`` CPU build) is repacked as a wheel that
  says it is another release, ``<major>.<minor - 1>.0+colab`` (``2.12.0+colab`` for 2.13.0): the
  same files, with the version changed in the wheel's metadata (``METADATA``, the ``.dist-info``
  folder's name, ``RECORD``) and in ``torch/version.py``, so that ``torch.__version__`` and pip
  agree on it. A real other release would mean several GB of downloads; what the test needs is
  a torch that pip sees as a release other than the pin, older than it as Colab's usually is, and
  that imports and computes. It is built once per test session (``tmp_path_factory``).
* **The runtime.** A new virtual environment (``python -m venv``, without the system's or this
  environment's packages) into which pip installs that torch with its dependencies, ipykernel
  (Colab's notebooks run in an IPython kernel, so it is there before the set-up cell runs) and the
  newest pip, from the machine's pip configuration (its package caches and indexes).
* **The set-up cell.** The first cell of ``book/01_*.ipynb`` (the same in every notebook, as
  ``tests/test_book.py`` checks), as the notebook holds it, is run by that environment's Python
  with a ``google.colab`` module in ``sys.modules`` (what makes the cell act), the only change
  being the address it installs from: ``git+<repository>@<branch>`` becomes ``file://`` of a copy
  of this checkout (the files a clone holds: tracked, and new ones git does not ignore). So the
  exact pip command of the cell runs, without options or constraints added, and then
  ``python -m gptlab fetch``, offline from the seed folder (``GPTLAB_SEED_DIR``, ``../shared/data``
  on development machines and CI) into a private cache (``GPTLAB_CACHE``). Before it, a dry run of
  the same pip command (``--dry-run --report``) must not plan to install torch: a regression then
  fails at once instead of downloading a torch with its CUDA packages.

Checked: the preinstalled torch is kept (same version for pip and for ``torch.__version__``, its
files untouched, pip's log says the requirement was already satisfied and uninstalled nothing);
the data is in the cache, verified; in a Jupyter kernel running that environment's Python, the
first code cells of chapter 1 run, and the causal-mask exercise as learners get it
(``exercises/``), with the solution cells taken from ``solutions/``, passes its visible tests.

Not simulated: Colab's other preinstalled packages (numpy, transformers, ... are installed by the
cell here, at their newest versions, as they would be on a runtime that lacked them), its GPU, and
the ``git clone`` that pip does for a ``git+`` address. One Python version: the one running the tests.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import nbexec
from gptlab.assets import ASSETS, sha256_file
from gptlab.data import DEFAULT_FETCH  # what `python -m gptlab fetch` fetches without --all
from gptlab.notebook_setup import SETUP_CELL_ID, is_setup_source, repository_from_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
CHAPTER = next(iter(sorted((REPO / "book").glob("01_*.ipynb"))), REPO / "book" / "01_missing.ipynb")
CHAPTER_CODE_CELLS = 6  # the set-up cell, the imports, and the first cells that read the data
EXERCISE = "causal_mask"
KERNEL = "gptlab-colab-sim"
TIMEOUT = 900  # seconds, for one pip run on a busy 2-core machine with cold caches

# pip options from the environment that would change what the cell's command installs
_PIP_ENV_DROPPED = {"PIP_CONSTRAINT", "PIP_REQUIREMENT", "PIP_UPGRADE", "PIP_UPGRADE_STRATEGY", "PIP_FORCE_REINSTALL",
                    "PIP_IGNORE_INSTALLED", "PIP_NO_DEPS", "PIP_USER", "PIP_TARGET", "PIP_PREFIX", "PIP_ROOT",
                    "PIP_REQUIRE_VIRTUALENV", "PIP_NO_BUILD_ISOLATION", "PIP_LOG", "PIP_DRY_RUN"}


# ---------------------------------------------------------------------------------------------
# Colab's torch: the installed torch, repacked as a wheel of another release


def _colab_version(version: str) -> str:
    """A release other than ``version`` and older than it, as Colab's torch usually is."""
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", version).groups())
    return f"{major}.{minor - 1}.0+colab" if minor > 0 else f"{major - 1}.99.0+colab"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack_torch(out_dir: Path, version: str) -> Path:
    """Write the torch distribution this interpreter has installed as a wheel that says it is
    ``version``: the same files (bytecode caches and console scripts left out, as in any wheel;
    pip writes the scripts from ``entry_points.txt``), with ``version`` in ``METADATA``, in the
    ``.dist-info`` folder's name, in ``RECORD`` and in ``torch/version.py``."""
    dist = importlib.metadata.distribution("torch")
    site = Path(dist.locate_file(""))
    old_info = f"torch-{dist.version}.dist-info"
    new_info = f"torch-{version}.dist-info"
    wheel_meta = (site / old_info / "WHEEL").read_text()
    tags = re.findall(r"^Tag: (\S+)$", wheel_meta, flags=re.M)
    assert tags, f"{old_info}/WHEEL names no tag:\n{wheel_meta}"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"torch-{version}-{tags[0]}.whl"
    partial = target.with_suffix(".partial")
    record: list[str] = []
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as zf:  # stored: fast to write and to install
        for f in dist.files or ():
            rel = f.as_posix()
            if rel.startswith("../") or "__pycache__" in f.parts or rel.endswith(".pyc"):
                continue
            arcname = rel
            if f.parts[0] == old_info:
                if f.parts[1] in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
                    continue
                arcname = new_info + rel[len(old_info):]
            src = site / f
            info = zipfile.ZipInfo.from_file(src, arcname)
            info.compress_type = zipfile.ZIP_STORED
            if rel == "torch/version.py" or arcname == f"{new_info}/METADATA":
                text = src.read_text(encoding="utf-8")
                if rel == "torch/version.py":
                    text, n = re.subn(r"^__version__ = .*$", f"__version__ = {version!r}", text, count=1, flags=re.M)
                else:
                    text, n = re.subn(r"^Version: .*$", f"Version: {version}", text, count=1, flags=re.M)
                assert n == 1, f"no version line in {rel}"
                data = text.encode("utf-8")
                zf.writestr(info, data)
                record.append(f"{arcname},{_record_hash(data)},{len(data)}")
                continue
            h, size = hashlib.sha256(), 0
            with open(src, "rb") as fin, zf.open(info, "w") as fout:
                for chunk in iter(lambda: fin.read(1 << 22), b""):
                    h.update(chunk)
                    size += len(chunk)
                    fout.write(chunk)
            digest = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
            record.append(f"{arcname},sha256={digest},{size}")
        record.append(f"{new_info}/RECORD,,")
        zf.writestr(f"{new_info}/RECORD", "\n".join(record) + "\n")
    partial.rename(target)
    return target


@pytest.fixture(scope="session")
def colab_torch_wheel(tmp_path_factory: pytest.TempPathFactory):
    """(wheel, version): this session's torch repacked as Colab's release; built once per session."""
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch is not installed as a distribution")
    needs = [r for r in dist.requires or () if "extra ==" not in r and re.match(r"(nvidia-|triton|pytorch-triton)", r)]
    if needs:
        pytest.skip(f"this torch ({dist.version}) is a CUDA build that requires {needs[:3]}...: a fresh environment "
                    "would download them; the test repacks a CPU build (the one constraints.txt pins)")
    folder = tmp_path_factory.mktemp("colab-torch")
    version = _colab_version(dist.version)
    wheel = repack_torch(folder, version)
    yield wheel, version
    shutil.rmtree(folder, ignore_errors=True)  # about 750 MB


# ---------------------------------------------------------------------------------------------
# the runtime, and the set-up cell run in it


def _copy_checkout(dst: Path) -> None:
    """The files a clone of this checkout holds: tracked ones, and new ones git does not ignore."""
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=REPO, capture_output=True, timeout=60)
    names = [n for n in r.stdout.decode("utf-8", "surrogateescape").split("\0") if n] if r.returncode == 0 else []
    if not names:  # not a git checkout: the tree, without what git would ignore
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(
            ".git", ".venv", "*.egg-info", "build", "dist", "_build", "data", "runs", "__pycache__", "*.pyc"))
        return
    for name in names:
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst / name)


def _setup_cell(path: Path) -> str:
    nb = nbexec.load(path)
    first = nb["cells"][0]
    source = nbexec.source(first)
    assert first.get("id") == SETUP_CELL_ID and is_setup_source(source), f"{path.name}: the first cell is not the set-up cell"
    return source


def _recorded_commands(source: str, executable: str) -> list[list[str]]:
    """The commands the cell runs on Colab (``subprocess.run`` recorded, nothing run)."""
    calls: list[list[str]] = []
    fakes = {"subprocess": types.SimpleNamespace(run=lambda args, **kw: calls.append(list(args))),
             "sys": types.SimpleNamespace(executable=executable, modules={"google.colab": types.ModuleType("google.colab")})}

    def fake_import(name, *args, **kwargs):
        return fakes[name] if name in fakes else builtins.__import__(name, *args, **kwargs)

    exec(compile(source, "<setup cell>", "exec"), {"__builtins__": {**vars(builtins), "__import__": fake_import}})
    return calls


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, **kw)
    assert r.returncode == 0, f"{what} failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return r


def _files_stat(paths: list[Path]) -> dict[str, tuple[int, int, int]]:
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in paths}


@dataclass
class Colab:
    root: Path
    venv: Path
    python: Path
    env: dict[str, str]
    cache: Path
    work: Path
    torch_version: str
    torch_before: dict[str, tuple[int, int, int]]
    torch_files: list[Path]
    pip_log: str
    planned: list[str]  # what the dry run planned to install


def _site_packages(python: Path) -> Path:
    r = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], "sysconfig")
    return Path(r.stdout.strip())


@pytest.fixture(scope="module")
def colab(tmp_path_factory: pytest.TempPathFactory, colab_torch_wheel):
    root = tmp_path_factory.mktemp("colab")
    try:
        yield _set_up_colab(root, *colab_torch_wheel)
    finally:  # the environment and the copy (about 1.5 GB) go; the logs (pip.log, dry-run.json) stay
        shutil.rmtree(root / "venv", ignore_errors=True)
        shutil.rmtree(root / "gptlab", ignore_errors=True)


def _set_up_colab(root: Path, wheel: Path, version: str) -> Colab:
    venv, cache, work = root / "venv", root / "gptlab-cache", root / "work"
    cache.mkdir()
    work.mkdir()  # the kernel's and the commands' working folder: not the checkout, whose gptlab/ would shadow
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    here_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join([str(bindir)] + [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != here_bin])
    env = {k: v for k, v in os.environ.items()
           if k not in _PIP_ENV_DROPPED and k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}
    env.update(PATH=path, VIRTUAL_ENV=str(venv), PYTHONNOUSERSITE="1", GPTLAB_CACHE=str(cache))

    # the runtime: a fresh venv with Colab's torch, ipykernel and a current pip
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv", env=env, cwd=work)
    cfg = (venv / "pyvenv.cfg").read_text()
    assert re.search(r"include-system-site-packages\s*=\s*false", cfg), cfg
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-compile", "--upgrade", "pip", "ipykernel", str(wheel)],
         "installing Colab's torch and ipykernel into the fresh venv", env=env, cwd=work)
    site = _site_packages(python)
    info = site / f"torch-{version}.dist-info"
    assert info.is_dir(), f"{info} is missing after installing {wheel.name}"
    torch_files = [info / "RECORD", info / "METADATA", site / "torch" / "__init__.py", site / "torch" / "version.py"]
    torch_before = _files_stat(torch_files)

    # the set-up cell, pointed at a copy of this checkout instead of the repository's address
    checkout = root / "gptlab"
    checkout.mkdir()
    _copy_checkout(checkout)
    url, branch = repository_from_config(REPO / "_config.yml")
    cell = _setup_cell(CHAPTER)
    remote = f"git+{url}@{branch}"
    assert cell.count(remote) == 1, f"the set-up cell does not install from {remote}:\n{cell}"
    cell = cell.replace(remote, checkout.as_uri())
    commands = _recorded_commands(cell, str(python))
    pip = [c for c in commands if c[1:3] == ["-m", "pip"]]
    assert len(pip) == 1 and pip[0][3] == "install", f"expected one `pip install` in the set-up cell, got {commands}"
    assert [str(python), "-m", "gptlab", "fetch"] in commands, commands

    # the guard: a dry run of the same command must not plan a torch (it would come with GBs of CUDA packages)
    report = root / "dry-run.json"
    _run([*pip[0][:4], "--dry-run", "--report", str(report), *pip[0][4:]], "pip install --dry-run of the set-up cell's command",
         env=env, cwd=work)
    planned = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.loads(report.read_text())["install"])
    torch_like = [p for p in planned if re.match(r"(torch|triton|nvidia-|cuda-)", p.lower())]
    assert not [p for p in torch_like if p.lower().startswith("torch==")], (
        f"the set-up cell's pip command would replace Colab's torch {version} (a dry run plans {torch_like}, "
        f"and {len(planned) - len(torch_like)} other packages): look at gptlab's torch requirement in pyproject.toml")

    log = root / "pip.log"
    colab_marker = "import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')\n"
    _run([str(python), "-c", colab_marker + cell], "the set-up cell", env={**env, "PIP_LOG": str(log)}, cwd=work)

    return Colab(root=root, venv=venv, python=python, env=env, cache=cache, work=work, torch_version=version,
                 torch_before=torch_before, torch_files=torch_files, pip_log=log.read_text(errors="replace"), planned=planned)


# ---------------------------------------------------------------------------------------------
# the checks


def test_setup_cell_keeps_colabs_torch(colab: Colab):
    r = _run([str(colab.python), "-c", "import importlib.metadata as m, torch; "
              "print(torch.__version__, m.version('torch'), float(torch.ones(3).sum()))"],
             "import torch in the venv", env=colab.env, cwd=colab.work)
    assert r.stdout.split() == [colab.torch_version, colab.torch_version, "3.0"], r.stdout
    assert _files_stat(colab.torch_files) == colab.torch_before, "pip rewrote the preinstalled torch's files"
    log = colab.pip_log
    assert re.search(r"Requirement already satisfied: torch\b", log), "pip's log does not say torch was already satisfied"
    assert "Uninstalling torch" not in log and not re.search(r"Successfully installed .*\btorch-", log), (
        "pip uninstalled or installed torch:\n" + "\n".join(l for l in log.splitlines() if "torch" in l.lower())[-3000:])
    assert any(p.startswith("gptlab==") for p in colab.planned), colab.planned
    # the environment's packages agree with each other
    _run([str(colab.python), "-m", "pip", "check"], "pip check in the venv", env=colab.env, cwd=colab.work)


def test_setup_cell_fetched_the_data(colab: Colab):
    # ASSETS holds every asset a module imported so far registered (SmolLM2's too, once
    # gptlab.interop.smollm is imported in this process): the set-up cell's plain `fetch` gets the defaults
    for asset in (ASSETS[name] for name in DEFAULT_FETCH):
        path = colab.cache.joinpath(*asset.filename.split("/"))
        assert path.is_file(), f"{asset.filename} is not in the cache after `python -m gptlab fetch`"
        assert sha256_file(path) == asset.sha256, asset.filename


def _execute(colab: Colab, nb: dict) -> dict:
    """Execute ``nb`` in a Jupyter kernel running the venv's Python (a kernel spec made for it)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    kernels = colab.root / "kernels"
    (kernels / KERNEL).mkdir(parents=True, exist_ok=True)
    spec = {"argv": [str(colab.python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (Colab simulation)", "language": "python",
            "env": {k: colab.env[k] for k in ("PATH", "VIRTUAL_ENV", "PYTHONNOUSERSITE", "GPTLAB_CACHE")}}
    (kernels / KERNEL / "kernel.json").write_text(json.dumps(spec))
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
    node = nbformat.reads(json.dumps(nb), as_version=4)  # sources as strings, as nbclient expects
    nbclient.NotebookClient(node, km=km, timeout=600, resources={"metadata": {"path": str(colab.work)}}).execute()
    return json.loads(nbformat.writes(node))


def _stdout(cell: dict) -> str:
    return "".join("".join(o["text"]) if isinstance(o["text"], list) else o["text"]
                   for o in cell.get("outputs", []) if o.get("output_type") == "stream" and o.get("name") == "stdout")


_WHERE = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "id": "colab-sim-where",
          "source": "import importlib.metadata, json, sys\nimport gptlab, torch\n"
                    "print(json.dumps({'prefix': sys.prefix, 'torch': torch.__version__, "
                    "'dist': importlib.metadata.version('torch'), 'gptlab': gptlab.__file__}))"}


def _check_where(colab: Colab, cell: dict) -> None:
    where = json.loads(_stdout(cell).strip().splitlines()[-1])
    assert Path(where["prefix"]) == colab.venv, where
    assert where["torch"] == where["dist"] == colab.torch_version, where
    assert Path(where["gptlab"]).is_relative_to(colab.venv), f"gptlab imported from {where['gptlab']}, not the venv"


def test_chapter_runs_in_the_colab_kernel(colab: Colab):
    nb = nbexec.load(CHAPTER)
    code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    assert len(code) >= CHAPTER_CODE_CELLS, CHAPTER.name
    nb["cells"] = nb["cells"][: code[CHAPTER_CODE_CELLS - 1] + 1] + [dict(_WHERE)]
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    done = _execute(colab, nb)
    text = "".join(_stdout(c) for c in done["cells"] if c["cell_type"] == "code")
    assert "characters" in text and "vocabulary size" in text, text[-2000:]
    _check_where(colab, done["cells"][-1])


def test_exercise_passes_its_visible_tests_in_the_colab_kernel(colab: Colab):
    solution = nbexec.load(REPO / "solutions" / EXERCISE / f"{EXERCISE}.ipynb")
    exercise = nbexec.load(REPO / "exercises" / EXERCISE / f"{EXERCISE}.ipynb")
    answers = {nbexec.grade_id(c): nbexec.source(c) for c in solution["cells"]
               if (nbexec.grade_id(c) or "").startswith("solution_")}
    replaced, tests = 0, []
    for c in exercise["cells"]:
        gid = nbexec.grade_id(c)
        if gid in answers:
            c["source"], replaced = answers[gid], replaced + 1
        if nbexec.is_test(c):
            tests.append(gid)
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    assert replaced == len(answers) > 0 and tests, (sorted(answers), tests)
    exercise["cells"].append(dict(_WHERE))
    done = _execute(colab, exercise)  # raises on the first cell that fails
    ran = {nbexec.grade_id(c): _stdout(c) for c in done["cells"] if nbexec.is_test(c)}
    assert set(ran) == set(tests)
    for gid, out in ran.items():
        assert "correct" in out, f"{gid}: {out!r}"
    _check_where(colab, done["cells"][-1])
