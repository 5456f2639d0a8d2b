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
"""

from __future__ import annotations

import dataclasses
import fcntl
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
