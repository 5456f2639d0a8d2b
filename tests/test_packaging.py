"""gptlab installs as a wheel: ``pip wheel --no-deps`` builds one holding every package module,
and the package imports from the installed wheel (not from the source tree). The wheel and the
sdist ship no solutions: nothing of solutions/ or tests/, no solution or hidden-test marker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_contains_the_package(tmp_path: Path):
    # Build from a copy, so that the build leaves no build/ or egg-info folders in the repository.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src)
    shutil.copytree(REPO / "gptlab", src / "gptlab", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    wheels = list(dist.glob("gptlab-*.whl"))
    assert len(wheels) == 1, f"expected one gptlab wheel, got {wheels}"

    names = set(zipfile.ZipFile(wheels[0]).namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "gptlab").rglob("*.py") if "__pycache__" not in p.parts}
    assert {"gptlab/__init__.py", "gptlab/__main__.py", "gptlab/model.py", "gptlab/attention.py"} <= modules
    missing = modules - names
    assert not missing, f"the wheel lacks these package modules: {sorted(missing)}"
    assert "gptlab/fast/decode_step.cpp" in names, "the wheel lacks the C++ decode step's source (build-native)"
    assert not any(n.startswith(("tests/", "book/", "solutions/", "exercises/")) for n in names)
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names), "the `gptlab` console script is missing"

    # Install the wheel into a private folder and import from there, away from the source tree.
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheels[0])],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    code = "import gptlab, gptlab.grading; print(gptlab.__file__); print(gptlab.causal_mask(3).sum().item())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    path, total = r.stdout.split()
    assert Path(path).resolve().is_relative_to(site.resolve()), f"gptlab was imported from {path}, not from the wheel"
    assert total == "6"


# ---------------------------------------------------------------------------------------------
# Solutions stay with the instructor: what a learner installs (the notebooks' Colab cell runs
# `pip install "gptlab[hf] @ git+<repository>@<branch>"`, which builds a wheel from a clone of the
# repository) and the source distribution hold the package, never the course's solutions/ (the
# instructors' notebooks, with solutions and hidden tests) or tests/ (with tests/mistakes/, the
# catalogue of planted mistakes).

# Built from pieces, so that this file holds none of the markers it looks for.
_MARKERS = tuple(m.encode() for m in ("BEGIN " + "HIDDEN TESTS", "BEGIN " + "SOLUTION", "### END " + "SOLUTION"))
_PRIVATE_DIRS = {"solutions", "tests"}
_BUILD = "import sys; from setuptools import build_meta; getattr(build_meta, sys.argv[1])(sys.argv[2])"


def _copy_repository(dst: Path) -> None:
    """Copy what a clone of the working tree would hold: the files git tracks, and the new ones it
    does not ignore (no .venv, no egg-info or build folders, no data)."""
    try:
        r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, check=True, timeout=60)
        names = [n for n in r.stdout.decode("utf-8", "surrogateescape").split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = []
    if not names:  # not a git checkout: copy the tree, leaving out what git would ignore
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(
            ".git", ".venv", "*.egg-info", "build", "dist", "_build", "data", "runs", "__pycache__", "*.pyc"))
        return
    for name in names:
        src = REPO / name
        if src.is_file() and not src.is_symlink():  # a file deleted since `git ls-files` is skipped
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst / name)


def _build(kind: str, src: Path, out: Path) -> Path:
    """Run setuptools' PEP 517 hook ``kind`` (build_sdist, build_wheel) in ``src``, as pip does."""
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-c", _BUILD, kind, str(out)], cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{kind} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    built = sorted(out.glob("gptlab-*.tar.gz" if kind == "build_sdist" else "gptlab-*.whl"))
    assert len(built) == 1, f"{kind}: expected one gptlab archive in {out}, got {built}"
    return built[0]


def _members(archive: Path) -> dict[str, bytes]:
    """Every file of a wheel or an sdist, by its path inside the archive (an sdist's top folder,
    ``gptlab-<version>/``, left out), with its bytes."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            return {i.filename: zf.read(i) for i in zf.infolist() if not i.is_dir()}
    with tarfile.open(archive) as tf:
        members = {}
        for m in tf.getmembers():
            if m.isfile():
                top, _, rest = m.name.partition("/")
                assert top.startswith("gptlab-") and rest, f"{archive.name}: {m.name} is outside the top folder"
                members[rest] = tf.extractfile(m).read()
            else:
                assert m.isdir(), f"{archive.name}: {m.name} is a link or a special file"
        return members


def _private_parts(archive: Path) -> list[str]:
    """What in ``archive`` belongs to the instructor: members under solutions/ or tests/ (at any
    depth, data-files included), and members whose bytes hold a solution or hidden-test marker."""
    found = []
    for name, data in sorted(_members(archive).items()):
        folders = set(Path(name).parts[:-1])
        if folders & _PRIVATE_DIRS:
            found.append(f"{name} (under {'/'.join(sorted(folders & _PRIVATE_DIRS))}/)")
        for marker in _MARKERS:
            if marker in data:
                found.append(f"{name} (holds {marker.decode()!r})")
    return found


@pytest.mark.slow
def test_wheel_and_sdist_ship_no_solutions(tmp_path: Path):
    src = tmp_path / "repo"
    src.mkdir()
    _copy_repository(src)
    # The copy holds what must stay out, or this test proves nothing.
    assert any(_MARKERS[0] in p.read_bytes() for p in (src / "solutions").rglob("*.ipynb")), "no hidden tests in solutions/?"
    assert any(_MARKERS[1] in p.read_bytes() for p in (src / "solutions").rglob("*.ipynb")), "no solutions in solutions/?"
    assert (src / "tests" / "mistakes").is_dir(), "tests/mistakes/ is missing from the copy"

    wheel = _build("build_wheel", src, tmp_path / "dist")  # what `pip install git+<repository>` installs
    sdist = _build("build_sdist", src, tmp_path / "dist")
    for archive in (wheel, sdist):
        private = _private_parts(archive)
        assert not private, f"{archive.name} ships what stays with the instructor:\n  " + "\n  ".join(private)

    # The sdist must build a wheel on its own (as `pip install <sdist>` does): the same wheel.
    unpacked = tmp_path / "sdist"
    with tarfile.open(sdist) as tf:
        tf.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (sdist_src,) = unpacked.iterdir()
    wheel_from_sdist = _build("build_wheel", sdist_src, tmp_path / "dist-from-sdist")

    sdist_names = set(_members(sdist))
    assert {"pyproject.toml", "gptlab/__init__.py", "gptlab/grading/core.py"} <= sdist_names, sorted(sdist_names)
    direct, rebuilt = _members(wheel), _members(wheel_from_sdist)
    assert sorted(direct) == sorted(rebuilt), "the wheel built from the sdist differs from the one built from the repository"
    differ = [n for n in direct if direct[n] != rebuilt[n]]
    assert not differ, f"the wheel built from the sdist differs from the one built from the repository in {differ}"
    modules = {p.relative_to(src).as_posix() for p in (src / "gptlab").rglob("*.py")}
    assert modules <= set(direct), f"the wheel lacks these package modules: {sorted(modules - set(direct))}"
