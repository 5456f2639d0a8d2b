"""One submission, one job: a notebook graded alone, with no gradebook, its result as a JSON file.

Where this sits: beside the pipeline, in the instructor's workflow. Every grading in the course goes
through :func:`grade_one`: ``python -m gptlab course grade-one NOTEBOOK --assignment NAME --out
RESULT.json`` on a cluster node, a Gradescope container or a line of ``xargs -P``; ``course
autograde`` on one machine (a pool of :func:`worker` processes, each running it job after job);
the Gradescope autograder of ``course export-gradescope``. :mod:`gptlab.course.results` merges the
results into a gradebook.

What it needs: the submitted notebook, the assignment's released notebook (``exercises/<a>/<nb>.ipynb``:
the locked cells, their points, checksums and time limits are read from it) and the grading secret
(:mod:`gptlab.course.secret`). Nothing else of the course: no gradebook, no ``source/``.

What it does: repairs the notebook as ``course autograde`` always did (test cells restored from the
release, nbgrader metadata put back, only the instructor's time limits kept:
:func:`gptlab.course.autograde.check_notebook`), runs it with :class:`~gptlab.course.execute.
GptlabExecute` (the kernel in the sandbox, the verdicts decided in this process), scores each
graded cell as nbgrader does (:func:`nbgrader.utils.determine_grade`) and writes :data:`FORMAT`:
per test cell the points, the maximum, the verdict's kind and message, what the learner's code
printed, the seconds and the review flag; the notes (timeouts, dead kernels, repairs); the
assignment's version (:func:`assignment_version`, so a result is never merged into another
version); the submission's sha256.

Its exit status says whether grading itself worked (0), not whether the learner passed; 2 is a
bad input (no such notebook or release), 1 a failure of the grader (the result file then says why).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from ..files import atomic_write_text
from .notebooks import assignment_version, release_reference, release_version, sha256_of

__all__ = ["FORMAT", "grade_one", "release_reference", "assignment_version", "GradeOneError", "worker"]

FORMAT = "gptlab-grade-one/1"
"""The ``format`` field of every result file."""


class GradeOneError(ValueError):
    """A bad input to :func:`grade_one` (no notebook, no release): said in one line."""


def _result_skeleton(notebook: Path, assignment: str, nb_name: str, student: str | None, sandbox: bool,
                     timestamp: str | None) -> dict:
    import gptlab

    from .notebooks import grader_digest

    return {"format": FORMAT, "assignment": assignment, "notebook": nb_name, "student": student,
            "assignment_version": None, "gptlab_version": gptlab.__version__, "grader_sha256": grader_digest(),
            "sandbox": sandbox,
            "timestamp": timestamp, "submission_sha256": sha256_of(notebook) if notebook.is_file() else None,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": None,
            "score": 0.0, "max_score": 0.0, "cells": {}, "comments": {}, "notes": [], "error": None}


def _text(outputs) -> tuple[str, str]:
    """(what the learner printed, the verdict's message) from a test cell's outputs."""
    printed, message = [], []
    for o in outputs:
        if o.get("output_type") == "stream":
            text = o.get("text", "")
            text = text if isinstance(text, str) else "".join(text)
            prefix = "While it was checked, your code printed (shown only, never scored):\n"
            (printed if text.startswith(prefix) else message).append(text.removeprefix(prefix))
        elif o.get("output_type") == "error":
            message.append(f"{o.get('ename', '')}: {o.get('evalue', '')}")
    return "".join(printed).strip(), "\n".join(m.strip() for m in message if m.strip())


def grade_one(notebook: str | os.PathLike, assignment: str, release: str | os.PathLike, *,
              student: str | None = None, timeout: int | None = None, sandbox: bool = True,
              notebook_out: str | os.PathLike | None = None, timestamp: str | None = None,
              out: str | os.PathLike | None = None) -> dict:
    """Grade ``notebook`` (a submission of assignment ``assignment``) against the released notebook
    ``release``; returns the result (:data:`FORMAT`, see the module docstring) and writes it to
    ``out`` (atomically) when given, the graded notebook to ``notebook_out`` (for the feedback).

    ``timeout``: the per-cell time limit in seconds (default 30; cells declaring their own keep
    it); ``sandbox=False`` runs the kernel outside the sandbox (said in the result's notes).
    Raises :class:`GradeOneError` for a bad input; a failure of the grader itself is caught and
    written into the result's ``error`` (every cell then scores 0).
    """
    import nbformat

    from .notebooks import cell_times, check_notebook, events, reviews

    t0 = time.perf_counter()
    notebook, release = Path(notebook), Path(release)
    if release.is_dir():
        found = sorted(release.glob("*.ipynb"))
        if len(found) != 1:
            raise GradeOneError(f"{release} holds {len(found)} notebooks; name the released notebook itself")
        release = found[0]
    if not release.is_file():
        raise GradeOneError(f"no released notebook at {release} (expected exercises/<assignment>/<notebook>.ipynb)")
    if not notebook.is_file():
        raise GradeOneError(f"no notebook at {notebook}")
    if timeout is not None and timeout <= 0:
        raise GradeOneError(f"the time limit must be a positive number of seconds, got {timeout}")
    nb_name = release.stem
    result = _result_skeleton(notebook, assignment, nb_name, student, sandbox, timestamp)
    try:
        ref_nb = nbformat.read(release, as_version=4)
    except Exception as e:  # noqa: BLE001
        raise GradeOneError(f"{release} is not a readable notebook ({type(e).__name__}: {e})") from None
    reference, order, meta = release_reference(ref_nb)
    result["assignment_version"] = release_version(reference)
    points = {g: r["points"] for g, r in reference.items() if r["grade"]}
    result["max_score"] = float(sum(p or 0.0 for p in points.values()))
    for gid, p in points.items():
        result["cells"][gid] = {"points": 0.0, "max_points": p, "kind": "not_run", "message": "", "printed": "",
                                "seconds": None, "review": []}
    notes = result["notes"]
    if not sandbox:
        notes.append({"notebook": None, "cell": None, "kind": "no_sandbox", "message": (
            "graded WITHOUT the autograder's sandbox (--no-sandbox): the notebook ran as the instructor, with "
            "the instructor's files, processes and network.")})
    try:
        nb, found = check_notebook(notebook, reference, order, meta, nb_name)
        notes.extend(found)
        if nb is None:
            for cell in result["cells"].values():
                cell["kind"], cell["message"] = "malformed", notes[-1]["message"] if notes else "not a notebook"
            return _finish(result, t0, out)
        graded = _run(nb, nb_name, assignment, student, timeout, sandbox)
        if notebook_out is not None:
            notebook_out = Path(notebook_out)
            notebook_out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(notebook_out, nbformat.writes(graded))
        with tempfile.TemporaryDirectory(prefix="gptlab-graded-") as tmp:
            path = Path(tmp) / f"{nb_name}.ipynb"
            nbformat.write(graded, path)
            notes.extend(events(path, nb_name))
            times = cell_times(path)
            reviews = reviews(path)
        _score(graded, reference, result, times, reviews)
        for gid, why in reviews.items():
            notes.append({"notebook": nb_name, "cell": gid, "kind": "review", "message": (
                f"{gid} is flagged for the instructor's review (its score is not final): the notebook holds code "
                f"that could switch off the grader's check of which functions the answer calls: {'; '.join(why[:3])}")})
    except Exception as e:  # noqa: BLE001 - the grader failed: said in the result, every cell 0
        result["error"] = f"{type(e).__name__}: {e}"
        for cell in result["cells"].values():
            cell.update(points=0.0, kind="grader_error", message=f"the autograder itself failed ({result['error']})")
        notes.append({"notebook": nb_name, "cell": None, "kind": "grader_error", "message": (
            f"the autograder itself failed on {nb_name}.ipynb ({result['error'][:300]}): every test in it scored 0.")})
    return _finish(result, t0, out)


def _finish(result: dict, t0: float, out) -> dict:
    result["score"] = float(sum(c["points"] for c in result["cells"].values()))
    result["seconds"] = round(time.perf_counter() - t0, 3)
    if out is not None:
        atomic_write_text(Path(out), json.dumps(result, indent=1) + "\n")
    return result


def _run(nb, nb_name: str, assignment: str, student: str | None, timeout: int | None, sandbox: bool):
    """The repaired notebook run as nbgrader's Autograde runs it: outputs cleared, executed by
    GptlabExecute, outputs limited."""
    import nbformat
    from nbgrader.preprocessors import ClearOutput, IgnorePattern, LimitOutput
    from traitlets.config import Config

    from .execute import GptlabExecute

    cfg = Config()
    cfg.Execute.timeout = int(timeout) if timeout else 30
    cfg.Execute.interrupt_on_timeout = True
    cfg.GptlabExecute.sandbox = bool(sandbox)
    resources = {"nbgrader": {"notebook": nb_name, "assignment": assignment, "student": student or ""}}
    nb, resources = ClearOutput(config=cfg).preprocess(nb, resources)
    with tempfile.TemporaryDirectory(prefix="gptlab-one-") as folder:
        nbformat.write(nb, Path(folder) / f"{nb_name}.ipynb")
        resources["metadata"] = {"path": folder}
        executor = GptlabExecute(config=cfg)
        executor.log.setLevel(logging.ERROR)
        nb, resources = executor.preprocess(nb, resources)
    for pre in (IgnorePattern(config=cfg), LimitOutput(config=cfg)):
        nb, resources = pre.preprocess(nb, resources)
    return nb


def _score(nb, reference: dict, result: dict, times: dict, reviews: dict) -> None:
    """Each graded cell's score as nbgrader's SaveAutoGrades gives it, and each answer cell's
    comment ("No response." when it is as released)."""
    from nbgrader.utils import compute_checksum, determine_grade

    log = logging.getLogger("gptlab.grade_one")
    for cell in nb.cells:
        nbg = cell.get("metadata", {}).get("nbgrader", {})
        gid = nbg.get("grade_id")
        ref = reference.get(gid)
        if ref is None:
            continue
        if ref["solution"]:
            unchanged = ref["checksum"] is not None and compute_checksum(cell) == ref["checksum"]
            result["comments"][gid] = "No response." if unchanged else None
        if not ref["grade"]:
            continue
        cell.metadata.nbgrader["checksum"] = ref["checksum"]
        score, max_points = determine_grade(cell, log)
        verdict = cell.metadata.get("gptlab", {}).get("verdict", {})
        printed, message = _text(cell.get("outputs", []))
        kind = verdict.get("kind") or ("error" if score == 0 and any(
            o.get("output_type") == "error" for o in cell.get("outputs", [])) else "ran")
        result["cells"][gid] = {"points": None if score is None else float(score), "max_points": float(max_points),
                                "kind": kind, "message": verdict.get("message") or message, "printed": printed,
                                "seconds": times.get(gid), "review": reviews.get(gid, [])}
    for cell in result["cells"].values():
        if cell["points"] is None:  # a graded answer (manually graded): no automatic score
            cell["kind"] = "manual"


# --------------------------------------------------------------------------- the worker of course autograde


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a ``kill -9`` of ``course autograde``
    leaves no worker behind; its kernels' sandboxes die with it, ``--die-with-parent``)."""
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call
            os._exit(1)
    except Exception:  # noqa: BLE001 - best effort: stdin's end stops the worker too
        pass


def worker() -> int:
    """``python -m gptlab course grade-worker``: read jobs (one JSON object per line: the keyword
    arguments of :func:`grade_one` plus ``id``) from stdin, grade each, and answer one JSON line
    per job on stdout (``{"id", "ok", "error"}``; the result itself is in the job's ``out`` file).
    Ends at the end of stdin, or with its parent."""
    import sys

    _die_with_parent()
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # nothing a grading prints may break the protocol
    real_stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    real_stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            job = json.loads(line)
            ident = job.pop("id", None)
        except json.JSONDecodeError as e:
            real_stdout.write(json.dumps({"id": None, "ok": False, "error": f"bad job: {e}"}) + "\n")
            real_stdout.flush()
            continue
        try:
            grade_one(**job)
            answer = {"id": ident, "ok": True, "error": None}
        except Exception as e:  # noqa: BLE001 - one job's failure is that job's
            answer = {"id": ident, "ok": False, "error": f"{type(e).__name__}: {e}"}
        real_stdout.write(json.dumps(answer) + "\n")
        real_stdout.flush()
    return 0
