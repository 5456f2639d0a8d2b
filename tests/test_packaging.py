"""gptlab installs as a wheel: ``pip wheel --no-deps`` builds one holding every package module,
and the package imports from the installed wheel (not from the source tree)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
