"""One build of the book per test session, shared by tests/test_book.py and tests/test_browser.py.

The build is ``jupyter-book build <repo> --path-output <dir> -W -n --keep-going``, the command of
``make book`` with a fresh output folder: every page is read again (so every warning is reported)
and every notebook is executed exactly once, into a fresh jupyter-cache. The notebook checks read
the executed notebooks the build wrote (``_build/jupyter_execute/``), the browser test serves the
built ``_build/html``: nothing is executed a second time.

``make test`` runs the two book test files in a pytest of their own, after the rest of the suite
(so the chapters' training has the machine to itself). Under pytest-xdist the two test files may land
on different workers: the build lives in the folder the workers share (the parent of their
temporary folders) and a file lock makes the second worker wait for the first one's build instead
of building again.

The build also times every cell (for the 60-second rule of tests/test_book.py): the kernels start
with an IPython start-up file (``CELL_TIMES_STARTUP``, in an ``IPYTHONDIR`` of the build's own) that
appends each cell's wall-clock and CPU seconds (all threads) and the sha256 of its source to ``cell-times.jsonl``.
jupyter-cache, which runs the chapters for jupyter-book, records no timing of its own.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 3600
# The chapters run with no one watching: their progress bars are plain text (gptlab's, see
# gptlab/progress.py) or off (Hugging Face's, e.g. a download), never ipywidgets widgets, whose
# page would load the widget manager from a CDN. `make book` sets the same (its BOOK_ENV; checked
# by tests/test_book.py).
BOOK_ENV = {"GPTLAB_PROGRESS": "text", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
CELL_TIMES_ENV = "GPTLAB_CELL_TIMES"  # where the kernels append their cells' times (a .jsonl file)
CELL_TIMES_STARTUP = """\
# Written by tests/_book_build.py: time every cell this kernel runs, for tests/test_book.py.
import hashlib as _h, json as _j, os as _o, time as _t

def _gptlab_cell_times():
    path, started = _o.environ.get("GPTLAB_CELL_TIMES"), {}
    if not path:
        return

    def pre(info):
        started["t"], started["cpu"] = _t.perf_counter(), _t.process_time()

    def post(result):
        if "t" not in started:
            return
        seconds, cpu = _t.perf_counter() - started.pop("t"), _t.process_time() - started.pop("cpu")
        source = result.info.raw_cell or ""
        with open(path, "a", encoding="utf-8") as f:
            f.write(_j.dumps({"sha256": _h.sha256(source.encode()).hexdigest(), "seconds": seconds,
                              "cpu_seconds": cpu, "pid": _o.getpid(), "head": source[:80]}) + "\\n")

    ip = get_ipython()
    ip.events.register("pre_run_cell", pre)
    ip.events.register("post_run_cell", post)

_gptlab_cell_times()
del _gptlab_cell_times
"""


def source_sha256(source: str | list[str]) -> str:
    """The sha256 a kernel under CELL_TIMES_STARTUP records for a cell of this source."""
    text = "".join(source) if isinstance(source, list) else source
    return hashlib.sha256(text.encode()).hexdigest()


def timing_env(folder: Path) -> dict[str, str]:
    """The variables that make a kernel record its cells' times under ``folder`` (created here)."""
    startup = folder / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-gptlab-cell-times.py").write_text(CELL_TIMES_STARTUP)
    return {"IPYTHONDIR": str(folder / "ipython"), CELL_TIMES_ENV: str(folder / "cell-times.jsonl")}


def read_cell_times(path: Path) -> list[dict]:
    """The records a kernel wrote (none when the file is missing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@dataclasses.dataclass(frozen=True)
class BookBuild:
    """The result of the session's book build."""

    root: Path  #: the --path-output folder
    returncode: int
    log: str  #: the end of the build's stdout + stderr
    seconds: float  #: wall-clock time of the build (0 when another worker built it)

    @property
    def html(self) -> Path:
        return self.root / "_build" / "html"

    @property
    def executed(self) -> Path:
        """Where the build wrote the executed notebooks (same paths as under the repository)."""
        return self.root / "_build" / "jupyter_execute"

    @property
    def cell_times(self) -> list[dict]:
        """Each executed cell's ``{"sha256", "seconds", "cpu_seconds", "pid", "head"}``, in the order they ran."""
        return read_cell_times(self.root / "timing" / "cell-times.jsonl")

    def check(self) -> None:
        """Fail the calling test, with the build's log, when the build failed."""
        if self.returncode != 0:
            pytest.fail(f"the book build failed (exit status {self.returncode}):\n{self.log}", pytrace=False)


def _shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # xdist workers' temporary folders (popen-gw0, popen-gw1, ...) share their parent
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_book_once(tmp_path_factory: pytest.TempPathFactory) -> BookBuild:
    """Build the book into the session's shared temporary folder, unless already built there."""
    shared = _shared_dir(tmp_path_factory)
    out, result = shared / "gptlab-book", shared / "gptlab-book.json"
    with open(shared / "gptlab-book.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if result.is_file():
            data = json.loads(result.read_text())
            return BookBuild(out, data["returncode"], data["log"], 0.0)
        jb = shutil.which("jupyter-book", path=os.path.dirname(sys.executable)) or shutil.which("jupyter-book")
        if not jb:
            pytest.fail("jupyter-book is not installed: pip install -c constraints.txt -e '.[book]'", pytrace=False)
        env = dict(os.environ)
        env.pop("MPLBACKEND", None)  # the kernels must draw inline, whatever a test process set
        env.update(BOOK_ENV)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        shutil.rmtree(out, ignore_errors=True)
        env.update(timing_env(out / "timing"))
        start = time.perf_counter()
        try:
            r = subprocess.run(
                [jb, "build", str(REPO), "--path-output", str(out), "-W", "-n", "--keep-going"],
                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env, cwd=REPO,
            )
            returncode, log = r.returncode, (r.stdout[-12000:] + "\n" + r.stderr[-6000:])
        except subprocess.TimeoutExpired as e:
            partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            returncode, log = -1, f"timed out after {BUILD_TIMEOUT_S} s\n{partial[-12000:]}"
        seconds = time.perf_counter() - start
        tmp = result.with_suffix(".tmp")
        tmp.write_text(json.dumps({"returncode": returncode, "log": log, "seconds": seconds}))
        os.replace(tmp, result)
        return BookBuild(out, returncode, log, seconds)
