"""A Gradescope autograder for one assignment: ``course export-gradescope NAME --out autograder.zip``.

Where this sits: beside the pipeline, in the instructor's workflow. Gradescope builds an image from
the zip (its ``setup.sh``, run once), then grades each submission in its own container with
``run_autograder``: the student's files in ``/autograder/submission/``, the zip in
``/autograder/source/``, the verdict written to ``/autograder/results/results.json``. This module
makes the zip (:func:`export`) and is what ``run_autograder`` runs (:func:`run`):

* ``setup.sh`` makes a virtual environment in ``/autograder/venv`` and installs into it the
  course's own gptlab (a wheel of the installed package, carried in the zip) and every requirement
  pinned to the version the instructor's environment has (``requirements.txt``);
* ``run_autograder`` grades ``/autograder/submission/*.ipynb`` with
  :func:`gptlab.course.grade_one.grade_one` (in the sandbox where bubblewrap can start in
  Gradescope's container, else without it, which the instructor-only output says) and writes
  Gradescope's ``results.json``: one test per graded cell (``name``, ``score``, ``max_score``,
  ``status``, ``output``, ``visibility``), the overall ``score``, ``execution_time``, ``output`` and
  ``stdout_visibility`` (hidden: the grader's log is for the instructor).
* The grading secret travels in the zip (Gradescope never shows the autograder's source to
  students, and the sandbox never shows it to the notebook); the hidden inputs stay out of every
  message (:func:`gptlab.course.trusted.without_inputs`).
* Which tests students see before the due date is the instructor's choice (``--after-due-date``,
  ``--hidden``; Gradescope's visibilities).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import stat
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

from ..files import atomic_write_bytes, atomic_write_text
from ._common import Course, CourseError

__all__ = ["export", "run", "VISIBILITIES", "package_wheel", "pinned_requirements", "results_json"]

VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")
"""Gradescope's visibilities of a test (and of the whole result)."""

SETUP_SH = """#!/usr/bin/env bash
# gptlab's Gradescope autograder: the set-up Gradescope runs once when it builds the image.
# It makes /autograder/venv and installs this course's gptlab (wheels/) with every requirement pinned
# (requirements.txt). GPTLAB_AUTOGRADER_ROOT moves /autograder (tests); GPTLAB_SKIP_APT skips apt-get.
set -euo pipefail
# PyTorch from the default index is its CUDA build (several GB), and Gradescope's machines have no
# GPU: set TORCH_INDEX to PyTorch's CPU wheel index (see the instructors' guide) for a small image.
TORCH_INDEX="${GPTLAB_TORCH_INDEX:-}"
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${GPTLAB_AUTOGRADER_ROOT:-/autograder}"
if [ -z "${GPTLAB_SKIP_APT:-}" ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-pip
fi
PYTHON="${GPTLAB_PYTHON:-python3}"
"$PYTHON" -m venv "$ROOT/venv"
WHEEL="$(ls "$SRC"/wheels/gptlab-*.whl)"
if [ -n "$TORCH_INDEX" ]; then
  "$ROOT/venv/bin/python" -m pip install --quiet --disable-pip-version-check \\
    --index-url "$TORCH_INDEX" "$(grep -i '^torch==' "$SRC/requirements.txt")"
fi
"$ROOT/venv/bin/python" -m pip install --quiet --disable-pip-version-check \\
  -c "$SRC/requirements.txt" -r "$SRC/requirements.txt" "$WHEEL[grading]"
"$ROOT/venv/bin/python" -c "import gptlab; print('gptlab', gptlab.__version__, 'installed for the autograder')"
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# gptlab's Gradescope autograder: grades /autograder/submission/*.ipynb into /autograder/results/results.json.
ROOT="${GPTLAB_AUTOGRADER_ROOT:-/autograder}"
exec "$ROOT/venv/bin/python" -m gptlab.course.gradescope "$ROOT"
"""


# --------------------------------------------------------------------------- the zip


def _requires(dist: str, extras: set[str]) -> list[str]:
    """The requirement names of installed ``dist`` (with ``extras``), markers evaluated here."""
    from packaging.requirements import Requirement

    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        env_ok = True
        if req.marker is not None:
            env_ok = any(req.marker.evaluate({"extra": e}) for e in (extras or {""})) if "extra" in str(req.marker) \
                else req.marker.evaluate()
        if env_ok:
            out.append(req.name)
    return out


def pinned_requirements(extras: tuple[str, ...] = ("grading",)) -> list[str]:
    """``name==version`` of everything gptlab (with ``extras``) needs, as installed here, sorted
    (public versions: ``torch==2.13.0`` for an installed ``2.13.0+cpu``)."""
    seen: dict[str, str] = {}
    todo = [(n, set()) for n in _requires("gptlab", set(extras))]
    while todo:
        name, ext = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen or key == "gptlab":
            continue
        try:
            # the public version: a local label (torch's "+cpu") is in no index but the one it came
            # from, and "==2.13.0" matches "2.13.0+cpu" where that build is what the index holds
            version = metadata.version(name).split("+")[0]
            seen[key] = f"{metadata.distribution(name).metadata['Name']}=={version}"
        except metadata.PackageNotFoundError:
            continue
        todo += [(n, set()) for n in _requires(name, ext)]
    return sorted(seen.values(), key=str.lower)


def package_wheel() -> tuple[str, bytes]:
    """A wheel of the installed gptlab (its files as they are, its metadata): ``(file name, bytes)``."""
    import gptlab

    root = Path(gptlab.__file__).resolve().parent
    version = gptlab.__version__
    dist = metadata.distribution("gptlab")
    info = f"gptlab-{version}.dist-info"
    files: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".so"):
            files[f"gptlab/{path.relative_to(root).as_posix()}"] = path.read_bytes()
    meta = ["Metadata-Version: 2.1", "Name: gptlab", f"Version: {version}"]
    for key in ("Summary", "Requires-Python", "License-Expression", "License"):
        if dist.metadata.get(key):
            meta.append(f"{key}: {dist.metadata[key]}")
    meta += [f"Provides-Extra: {e}" for e in dist.metadata.get_all("Provides-Extra") or []]
    meta += [f"Requires-Dist: {r}" for r in dist.metadata.get_all("Requires-Dist") or []]
    files[f"{info}/METADATA"] = ("\n".join(meta) + "\n").encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: gptlab export-gradescope\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/entry_points.txt"] = b"[console_scripts]\ngptlab = gptlab.__main__:main\n"
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(_info(name), data)
    return f"gptlab-{version}-py3-none-any.whl", buf.getvalue()


def _info(name: str, executable: bool = False) -> zipfile.ZipInfo:
    zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # the same bytes for the same files
    zi.compress_type = zipfile.ZIP_DEFLATED
    zi.external_attr = ((0o755 if executable else 0o644) | stat.S_IFREG) << 16
    return zi


def export(course: Course, assignment: str, out: str | os.PathLike, *, after_due_date: tuple[str, ...] = (),
           hidden: tuple[str, ...] = (), timeout: int | None = None) -> Path:
    """Write the Gradescope autograder zip of ``assignment`` to ``out`` (see the module docstring):
    the released notebook that matches the gradebook, the grading secret, the course's gptlab wheel,
    the pinned requirements, ``setup.sh``, ``run_autograder`` and ``gptlab_autograder.json``
    (the assignment, the per-cell visibilities, the time limit)."""
    import nbformat

    from .autograde import ensure_assignment, releases_for
    from .notebooks import quiet_sqlalchemy, release_reference
    from .secret import load_secret

    quiet_sqlalchemy()
    if assignment not in course.assignments():
        raise CourseError(f"unknown assignment {assignment!r}")
    if timeout is not None and timeout <= 0:
        raise CourseError(f"--timeout must be a positive number of seconds, got {timeout}")
    ensure_assignment(course, assignment)
    with tempfile.TemporaryDirectory(prefix="gptlab-gradescope-") as tmp:
        releases = releases_for(course, assignment, Path(tmp))
        if len(releases) != 1:
            raise CourseError(f"a Gradescope autograder grades one notebook; {assignment} has {len(releases)}")
        (nb_name, path), = releases.items()
        release_text = path.read_text()
    reference = release_reference(nbformat.reads(release_text, as_version=4))[0]
    graded = [g for g, r in reference.items() if r["grade"]]
    for gid in (*after_due_date, *hidden):
        if gid not in graded:
            raise CourseError(f"{assignment} has no test cell {gid!r} (its test cells: {', '.join(graded)})")
    visibility = {g: "hidden" if g in hidden else "after_due_date" if g in after_due_date else "visible"
                  for g in graded}
    configured = course.config().Execute.get("timeout")
    config = {"assignment": assignment, "notebook": nb_name, "visibility": visibility,
              "timeout": timeout or (int(configured) if isinstance(configured, int | float) else None)}
    wheel_name, wheel = package_wheel()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(_info("setup.sh", executable=True), SETUP_SH)
        z.writestr(_info("run_autograder", executable=True), RUN_AUTOGRADER)
        z.writestr(_info("gptlab_autograder.json"), json.dumps(config, indent=1) + "\n")
        z.writestr(_info(f"release/{nb_name}.ipynb"), release_text)
        z.writestr(_info("grading-secret"), load_secret().decode() + "\n")
        z.writestr(_info("requirements.txt"), "\n".join(pinned_requirements()) + "\n")
        z.writestr(_info(f"wheels/{wheel_name}"), wheel)
    out = Path(out)
    atomic_write_bytes(out, buf.getvalue())
    return out


# --------------------------------------------------------------------------- run_autograder


def results_json(result: dict | None, visibility: dict[str, str], *, output: str, seconds: float) -> dict:
    """Gradescope's ``results.json`` for one grade-one result (None: nothing could be graded)."""
    tests = []
    for k, (gid, cell) in enumerate((result or {}).get("cells", {}).items(), 1):
        points = cell.get("points")
        message = (cell.get("message") or "").strip()
        if cell.get("printed"):
            message += "\n\nWhile it was checked, your code printed (shown only, never scored):\n" + cell["printed"]
        if cell.get("review"):
            message += "\n\nFlagged for your instructor's review: this score is not final."
        tests.append({"name": gid, "number": str(k), "score": float(points or 0.0),
                      "max_score": float(cell.get("max_points") or 0.0),
                      "status": "passed" if points is not None and points >= (cell.get("max_points") or 0) else "failed",
                      "output": message[:20000], "visibility": visibility.get(gid, "visible"),
                      **({"tags": ["needs review"]} if cell.get("review") else {})})
    return {"score": float(sum(t["score"] for t in tests)), "execution_time": int(round(seconds)),
            "output": output, "visibility": "visible", "stdout_visibility": "hidden", "tests": tests}


def run(root: str | os.PathLike = "/autograder") -> int:
    """``run_autograder``: grade the submission in ``root/submission`` and write
    ``root/results/results.json`` (always, also when nothing could be graded); 0 once it is written."""
    from .grade_one import GradeOneError, grade_one
    from .sandbox import unavailable

    t0 = time.perf_counter()
    root = Path(root)
    source = root / "source"
    config = json.loads((source / "gptlab_autograder.json").read_text())
    os.environ["GPTLAB_GRADING_SECRET"] = str(source / "grading-secret")
    nb_name = config["notebook"]
    release = source / "release" / f"{nb_name}.ipynb"
    submitted = sorted((root / "submission").rglob("*.ipynb"))
    exact = [p for p in submitted if p.name == f"{nb_name}.ipynb"]
    notebook = exact[0] if exact else (submitted[0] if len(submitted) == 1 else None)
    why_not = unavailable()
    print(f"gptlab autograder: {config['assignment']}, sandbox: {'no (' + why_not + ')' if why_not else 'yes'}")
    result, output = None, ""
    if notebook is None:
        output = (f"No notebook to grade: submit {nb_name}.ipynb (found: "
                  f"{', '.join(p.name for p in submitted) or 'no notebook'}).")
        result = grade_one_blank(release, config["assignment"])
    else:
        with tempfile.TemporaryDirectory(prefix="gptlab-gs-") as tmp:
            try:
                result = grade_one(notebook, config["assignment"], release, timeout=config.get("timeout"),
                                   sandbox=why_not is None, out=Path(tmp) / "result.json")
            except GradeOneError as e:
                output = f"The autograder could not grade this submission: {e}"
                result = grade_one_blank(release, config["assignment"])
        if result.get("error"):
            print(f"gptlab autograder: the grader failed: {result['error']}")
            output = "The autograder itself failed on this submission; your instructor can see why."
        notes = [n["message"] for n in result.get("notes", []) if n.get("kind") not in ("no_sandbox", "review")]
        if notes:
            output = (output + "\n" if output else "") + "\n".join(f"- {n}" for n in notes)
        if not result.get("sandbox", True):
            print("gptlab autograder: graded WITHOUT the sandbox (bubblewrap cannot start in this container)")
    results = results_json(result, config.get("visibility", {}), output=output, seconds=time.perf_counter() - t0)
    (root / "results").mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / "results" / "results.json", json.dumps(results, indent=1) + "\n")
    print(f"gptlab autograder: {results['score']:g} points, written to {root / 'results' / 'results.json'}")
    return 0


def grade_one_blank(release: Path, assignment: str) -> dict:
    """Every graded cell of ``release`` at 0 (nothing was graded)."""
    import nbformat

    from .notebooks import release_reference

    reference = release_reference(nbformat.read(release, as_version=4))[0]
    return {"cells": {g: {"points": 0.0, "max_points": r["points"], "message": "not graded", "printed": "",
                          "review": []} for g, r in reference.items() if r["grade"]}, "notes": []}


if __name__ == "__main__":
    sys.exit(run(sys.argv[1] if len(sys.argv) > 1 else "/autograder"))
