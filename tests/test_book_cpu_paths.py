"""The chapters give their stored outputs on another CPU's code paths too.

A stored output that depends on the last bits of a float fails on the next machine: Intel CPUs
with AVX-512, AMD ones, MKL and PyTorch each pick other kernels. One machine can run the code paths
of others: MKL's ``MKL_CBWR`` (``COMPATIBLE``, ``AVX2``, ``AVX512``) and PyTorch's
``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``, ``avx512``, as the CPU supports). This file
executes every book notebook in a kernel started under such a setting and compares its outputs with
the ones stored in the notebook, as tests/test_book.py does for the build (same rules: cells tagged
``nbval-ignore-output`` may print anything but must not raise).

The setting comes from ``GPTLAB_CPU_PATHS``: settings separated by ``;``, each a space-separated
list of ``NAME=VALUE``. By default (what ``make test`` runs in CI) one setting far from any
machine's default: ``MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default`` (MKL's portable SSE code
path and PyTorch's kernels without vector instructions), the whole book (about as long as the
build's own execution). ``make test-cpu-paths`` runs each setting on its own (README, "Tests").
A setting whose ``ATEN_CPU_CAPABILITY`` this CPU does not support is skipped with that reason.

The time limits are the ordinary build's: a cell may run for ``execute: timeout:`` of _config.yml
(the limit jupyter-book gives each cell), a notebook for the build's ``BUILD_TIMEOUT_S``. A chapter
that only passes with more time here would fail the book's build on a CPU without AVX2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest
import yaml

from _book_build import BOOK_ENV, BUILD_TIMEOUT_S, REPO
from _nbcompare import mismatches

DEFAULT_SETTINGS = "MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default"
ALLOWED = {"MKL_CBWR": {"COMPATIBLE", "AVX2", "AVX512", "AUTO"}, "ATEN_CPU_CAPABILITY": {"default", "avx2", "avx512"}}
BOOK_NOTEBOOKS = sorted(p for p in (REPO / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
EXECUTE_TIMEOUT_S = yaml.safe_load((REPO / "_config.yml").read_text())["execute"]["timeout"]  # per cell, as the build
NOTEBOOK_TIMEOUT_S = BUILD_TIMEOUT_S  # a whole notebook, as the whole build


def parse_settings(text: str) -> list[dict[str, str]]:
    """``"A=1 B=2; A=3"`` -> ``[{"A": "1", "B": "2"}, {"A": "3"}]``, each name and value checked."""
    settings = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        setting = {}
        for item in part.split():
            name, sep, value = item.partition("=")
            if not sep or name not in ALLOWED or value not in ALLOWED[name]:
                raise ValueError(f"GPTLAB_CPU_PATHS: {item!r} is not one of "
                                 + ", ".join(f"{n}={'|'.join(sorted(v))}" for n, v in ALLOWED.items()))
            setting[name] = value
        settings.append(setting)
    if not settings:
        raise ValueError("GPTLAB_CPU_PATHS names no setting")
    return settings


SETTINGS = parse_settings(os.environ.get("GPTLAB_CPU_PATHS", DEFAULT_SETTINGS))


def _label(setting: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(setting.items()))


def _env(setting: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ALLOWED}
    env.pop("MPLBACKEND", None)  # the kernels draw inline, as in the build
    env.update(BOOK_ENV)
    env.update(setting)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


@cache
def _capability(label: str) -> str:
    """The ATen CPU capability a process started under this setting reports."""
    setting = dict(item.split("=", 1) for item in label.split(",") if item)
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                       capture_output=True, text=True, env=_env(setting), timeout=120, check=True)
    return r.stdout.strip()


def _skip_unsupported(setting: dict[str, str]) -> None:
    want = setting.get("ATEN_CPU_CAPABILITY")
    if want and _capability(_label(setting)) != want.upper():
        pytest.skip(f"this CPU does not support ATEN_CPU_CAPABILITY={want} "
                    f"(PyTorch runs {_capability(_label(setting))} under it)")


def _execute(notebook: Path, setting: dict[str, str], out_dir: Path) -> dict:
    """Execute ``notebook`` (in its own folder, as the build does) in a kernel under ``setting``;
    the executed notebook."""
    jupyter = shutil.which("jupyter", path=os.path.dirname(sys.executable)) or "jupyter"
    r = subprocess.run(
        [jupyter, "nbconvert", "--to", "notebook", "--execute", f"--ExecutePreprocessor.timeout={EXECUTE_TIMEOUT_S}",
         "--ExecutePreprocessor.record_timing=False", "--allow-errors", "--output-dir", str(out_dir), str(notebook)],
        capture_output=True, text=True, env=_env(setting), cwd=notebook.parent, timeout=NOTEBOOK_TIMEOUT_S,
    )
    executed = out_dir / notebook.name
    if r.returncode != 0 or not executed.is_file():
        pytest.fail(f"executing {notebook.relative_to(REPO)} under {_label(setting)} failed "
                    f"(exit {r.returncode}):\n{r.stderr[-6000:]}", pytrace=False)
    return json.loads(executed.read_text())


def test_settings_are_checked():
    assert parse_settings("MKL_CBWR=AVX2; ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE") == [
        {"MKL_CBWR": "AVX2"}, {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}]
    for bad in ("MKL_CBWR=SSE9", "OMP_NUM_THREADS=1", "MKL_CBWR", " ; "):
        with pytest.raises(ValueError, match="GPTLAB_CPU_PATHS"):
            parse_settings(bad)


def test_comparison_names_a_changed_output():
    """The comparison this file relies on sees the difference the first CPU-dependence bug was:
    a tensor printed ``1.`` on one CPU, ``1.0000`` on another."""
    cell = {"cell_type": "code", "id": "c1", "metadata": {}, "source": "print(x)",
            "outputs": [{"output_type": "stream", "name": "stdout", "text": "tensor([1., 1.])\n"}]}
    other = {**cell, "outputs": [{"output_type": "stream", "name": "stdout", "text": "tensor([1.0000, 1.0000])\n"}]}
    assert mismatches({"cells": [cell]}, {"cells": [cell]}, "nb") == []
    [problem] = mismatches({"cells": [cell]}, {"cells": [other]}, "nb")
    assert "code cell 0" in problem and "1.0000" in problem
    tagged = {**cell, "metadata": {"tags": ["nbval-ignore-output"]}}
    assert mismatches({"cells": [tagged]}, {"cells": [other]}, "nb") == []
    error = {**cell, "outputs": [{"output_type": "error", "ename": "ValueError", "evalue": "bad", "traceback": []}]}
    assert "raised ValueError" in mismatches({"cells": [tagged]}, {"cells": [error]}, "nb")[0]


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS, ids=_label)
def test_a_kernel_runs_under_the_setting(setting: dict[str, str], tmp_path: Path):
    """The setting reaches the kernel that runs the chapters (not only this process)."""
    _skip_unsupported(setting)
    probe = {"cells": [{"cell_type": "code", "id": "probe", "metadata": {}, "execution_count": None, "outputs": [],
                        "source": "import os, torch\nprint(os.environ.get('MKL_CBWR'), torch.backends.cpu.get_cpu_capability())"}],
             "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
             "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "probe.ipynb"
    path.write_text(json.dumps(probe))
    out = _execute(path, setting, tmp_path / "out")
    printed = "".join(out["cells"][0]["outputs"][0]["text"]).split()
    assert printed[0] == setting.get("MKL_CBWR", "None")
    if "ATEN_CPU_CAPABILITY" in setting:
        assert printed[1] == setting["ATEN_CPU_CAPABILITY"].upper()


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS, ids=_label)
@pytest.mark.parametrize("notebook", BOOK_NOTEBOOKS, ids=[p.relative_to(REPO).as_posix() for p in BOOK_NOTEBOOKS])
def test_chapter_outputs_hold_on_another_cpu_path(notebook: Path, setting: dict[str, str], tmp_path: Path):
    _skip_unsupported(setting)
    start = time.perf_counter()
    executed = _execute(notebook, setting, tmp_path)
    seconds = time.perf_counter() - start
    rel = notebook.relative_to(REPO).as_posix()
    problems = mismatches(json.loads(notebook.read_text()), executed, rel)
    print(f"{rel} under {_label(setting)}: {seconds:.0f} s, {len(problems)} difference(s)")
    assert not problems, (
        f"under {_label(setting)} (another CPU's code path) {rel} gives other outputs than the stored ones:\n"
        + "\n".join(problems)
        + "\nA printed float must not depend on the last bits: round it, compare with a stated tolerance, "
          "or assert the claim in code (see the README, Tests)."
    )
