"""A submitted notebook as the autograder reads it: checked and repaired, versioned, and read back once graded.

Where this sits: beside the pipeline, in the instructor's workflow, below every grading command:
:mod:`gptlab.course.grade_one` (one notebook, one job), :mod:`gptlab.course.autograde` (a class),
:mod:`gptlab.course.results` (the merge) and :mod:`gptlab.course.gradescope` use these pieces:

* :func:`release_reference`: what a released notebook says of its nbgrader cells (type, released
  source, checksum, locked, graded, points, time limit), the reference every submission is repaired
  against; :func:`release_version` and :func:`assignment_version`, the version a result carries;
* :func:`check_notebook`: a submitted notebook read (malformed JSON, not a notebook: noted) and
  repaired (locked cells restored from the release, nbgrader metadata put back, cells the learner
  deleted put back, only the instructor's time limits kept);
* :func:`events`, :func:`cell_times`, :func:`reviews`: what a graded notebook says (timeouts and
  dead kernels, the seconds each cell took, the cells flagged for review);
* :func:`grader_digest`: the grading code's own hash, so a stored result is reused only by the same code.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

__all__ = ["check_notebook", "released_text", "norm", "release_reference", "release_version", "assignment_version",
           "events", "cell_times", "reviews", "grader_digest", "quiet_sqlalchemy", "timestamp_of", "sha256_of"]


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def released_text(source: str) -> str:
    """A locked cell's source as the learners received it: the hidden tests removed."""
    from nbformat.notebooknode import NotebookNode
    from nbgrader.preprocessors import ClearHiddenTests

    cell = NotebookNode(cell_type="code", source=source, metadata=NotebookNode())
    ClearHiddenTests()._remove_hidden_test_region(cell)
    return cell.source


def norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _read_notebook(path: Path, notebook: str, note):
    """The notebook at ``path``, or None (with a ``malformed`` note) where it is not UTF-8 text,
    not JSON or not a valid Jupyter notebook."""
    import nbformat

    try:
        text = path.read_bytes().decode("utf-8")
        json.loads(text)
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
    except UnicodeDecodeError as e:
        note("malformed", f"{notebook}.ipynb is not UTF-8 text (byte {e.start}), so it could not be graded: "
                          "every test in it scored 0.")
        return None
    except json.JSONDecodeError as e:
        note("malformed", f"{notebook}.ipynb is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}), "
                          "so it could not be graded: every test in it scored 0.")
        return None
    except Exception as e:  # noqa: BLE001 (nbformat raises several kinds)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        note("malformed", f"{notebook}.ipynb is not a valid Jupyter notebook ({first[:200]}), so it could not "
                          "be graded: every test in it scored 0.")
        return None
    return nb


def _repair_cells(nb, reference: dict, gptlab_meta: dict, note) -> None:
    """Restore each graded cell's type, nbgrader settings and (locked) released text; a cell with an
    unknown or repeated id becomes an ordinary cell. Only the instructor's time limits are kept."""
    import nbformat

    seen: dict[str, int] = {}
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("gptlab", None)  # time limits come from the instructor's notebook only
        meta = cell.metadata.get("nbgrader")
        if not isinstance(meta, dict):
            cell.metadata.pop("nbgrader", None)
            continue
        gid = meta.get("grade_id")
        if gid not in reference or gid in seen:
            # unknown or duplicated id: the cell becomes an ordinary cell
            cell.metadata.pop("nbgrader", None)
            if gid in seen and reference.get(gid, {}).get("locked"):
                note("duplicate", f"a copy of the cell {gid} was found and run as an ordinary cell.", gid)
            continue
        seen[gid] = i
        ref = reference[gid]
        if cell.cell_type != ref["cell_type"]:
            note("edited", f"the cell {gid} had been changed to a {cell.cell_type} cell; it was run as the "
                           f"{ref['cell_type']} cell it is.", gid)
            maker = nbformat.v4.new_code_cell if ref["cell_type"] == "code" else nbformat.v4.new_markdown_cell
            cell = nb.cells[i] = maker(source=cell.source, metadata=cell.metadata)
        fixed = {"grade": ref["grade"], "solution": ref["solution"], "locked": ref["locked"], "grade_id": gid,
                 "schema_version": 3, "task": False}
        if ref["points"] is not None:
            fixed["points"] = ref["points"]
        changed = any(meta.get(k) != v for k, v in fixed.items() if k not in ("schema_version", "task"))
        cell.metadata["nbgrader"] = {**meta, **fixed}
        if changed and ref["locked"]:
            note("edited", f"the nbgrader settings of the cell {gid} had been changed; they were restored.", gid)
        if ref["locked"] and norm(cell.source) != norm(released_text(ref["source"])):
            kind = "test cell" if ref["grade"] else "read-only cell"
            note("edited", f"the {kind} {gid} had been edited; the released version was run instead.", gid)
        if gid in gptlab_meta:
            cell.metadata["gptlab"] = gptlab_meta[gid]


def _restore_missing(nb, reference: dict, order: list[str], gptlab_meta: dict, note) -> None:
    """Put back the locked cells that are missing, each where the source has it; note the missing
    answer cells."""
    import nbformat

    ids = order or list(reference)
    for k, gid in enumerate(ids):
        ref = reference.get(gid)
        if ref is None:
            continue
        present = any(c.metadata.get("nbgrader", {}).get("grade_id") == gid for c in nb.cells)
        if present:
            continue
        if not ref["locked"]:
            if ref["solution"]:
                note("missing", f"the answer cell {gid} was not in the notebook; the tests that need it scored 0.", gid)
            continue
        md = {"nbgrader": {"grade": ref["grade"], "grade_id": gid, "locked": True, "schema_version": 3,
                           "solution": ref["solution"], "task": False, "checksum": ref["checksum"]},
              "deletable": False, "editable": False}
        if ref["points"] is not None:
            md["nbgrader"]["points"] = ref["points"]
        if gid in gptlab_meta:
            md["gptlab"] = gptlab_meta[gid]
        if ref["cell_type"] == "code":
            new = nbformat.v4.new_code_cell(source=ref["source"], metadata=md)
        else:
            new = nbformat.v4.new_markdown_cell(source=ref["source"], metadata=md)
        def where(gid_):
            return next((j for j, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade_id") == gid_),
                        None)

        # just before the next cell of the source that is there (after the task's other cells),
        # else just after the previous one, else at the end
        nxt = [j for j in (where(g) for g in ids[k + 1:]) if j is not None]
        prv = [j for j in (where(g) for g in ids[:k]) if j is not None]
        pos = nxt[0] if nxt else (prv[-1] + 1 if prv else len(nb.cells))
        nb.cells.insert(pos, new)
        kind = "test cell" if ref["grade"] else "read-only cell"
        note("deleted", f"the {kind} {gid} was missing from the notebook; it was put back and run.", gid)


def check_notebook(path: Path, reference: dict, order: list[str], gptlab_meta: dict, notebook: str) -> tuple[object, list[dict]]:
    """Read a submitted notebook and repair what nbgrader cannot: returns (notebook or None, notes).

    ``None`` means the file is not a readable notebook (then nbgrader grades it as missing: 0).
    """
    notes: list[dict] = []

    def note(kind: str, message: str, cell: str | None = None) -> None:
        notes.append({"notebook": notebook, "cell": cell, "kind": kind, "message": message})

    nb = _read_notebook(path, notebook, note)
    if nb is None:
        return None, notes
    _repair_cells(nb, reference, gptlab_meta, note)
    _restore_missing(nb, reference, order, gptlab_meta, note)
    for cell in nb.cells:  # nbformat 4.5 cell ids, unique
        cell.pop("id", None)
    nb.nbformat_minor = 4
    return nb, notes


def _cell_label(cell) -> str:
    gid = cell.metadata.get("nbgrader", {}).get("grade_id")
    if gid:
        return gid
    first = next((line for line in cell.source.splitlines() if line.strip()), "")
    return f"the cell starting `{first[:60]}`"


def events(autograded_nb: Path, notebook: str) -> list[dict]:
    """Notes for the cells the runner had to stop: timeouts, kernel deaths, cells not run."""
    import nbformat

    notes = []
    nb = nbformat.read(autograded_nb, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") != "error":
                continue
            ename = out.get("ename")
            if ename in ("CellTimeoutError", "DeadKernelError", "NotRun"):
                kind = {"CellTimeoutError": "timeout", "DeadKernelError": "kernel_died", "NotRun": "not_run"}[ename]
                notes.append({"notebook": notebook, "cell": cell.metadata.get("nbgrader", {}).get("grade_id"),
                              "kind": kind, "message": f"{_cell_label(cell)}: {out.get('evalue', '')}"})
                break
    return notes


def cell_times(autograded_nb: Path) -> dict[str, float]:
    """grade_id -> seconds the cell ran, from nbclient's recorded timing (solution cells), or for a
    test cell graded by the trusted grader the seconds its verdict took (``gptlab.verdict.seconds``)."""
    from datetime import datetime

    import nbformat

    times = {}
    nb = nbformat.read(autograded_nb, as_version=4)
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        ex = cell.metadata.get("execution", {})
        if gid and "iopub.execute_input" in ex and "shell.execute_reply" in ex:
            t0 = datetime.fromisoformat(ex["iopub.execute_input"].replace("Z", "+00:00"))
            t1 = datetime.fromisoformat(ex["shell.execute_reply"].replace("Z", "+00:00"))
            times[gid] = (t1 - t0).total_seconds()
        verdict = cell.metadata.get("gptlab", {}).get("verdict", {})
        if gid and "seconds" in verdict:
            times[gid] = float(verdict["seconds"])
    return times


def reviews(autograded_nb: Path) -> dict[str, list[str]]:
    """grade_id -> why the instructor should review it (``gptlab.verdict.review``), for the test
    cells the trusted grader flagged."""
    import nbformat

    out = {}
    nb = nbformat.read(autograded_nb, as_version=4)
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        review = cell.metadata.get("gptlab", {}).get("verdict", {}).get("review")
        if gid and review:
            out[gid] = [str(x) for x in review]
    return out


def quiet_sqlalchemy() -> None:
    """nbgrader 0.9's gradebook code makes SQLAlchemy 2 warn that cascaded objects are "not in
    session" when a submission is created; the rows are written all the same (the tests count them)."""
    import warnings

    from sqlalchemy.exc import SAWarning

    warnings.filterwarnings("ignore", category=SAWarning)




@functools.lru_cache(maxsize=1)
def grader_digest() -> str:
    """A sha256 of the grading code (every ``.py`` of the installed gptlab): a stored result is
    reused only when the code that would grade it again is the same."""
    import gptlab

    root = Path(gptlab.__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def timestamp_of(path: Path) -> str | None:
    """nbgrader's submission time (``timestamp.txt``) as ISO 8601, or None."""
    if not path.is_file():
        return None
    from dateutil.parser import parse

    try:
        return parse(path.read_text().strip()).isoformat()
    except (ValueError, OverflowError):
        return None


def release_reference(release_nb) -> tuple[dict, list[str], dict]:
    """What a released notebook says of its nbgrader cells: ``(reference, order, gptlab metadata)``,
    in the shapes :func:`gptlab.course.autograde.check_notebook` takes (grade_id -> type, released
    source, checksum, locked, grade, solution, points; the grade_ids in order; each cell's
    ``gptlab`` metadata, its time limit)."""
    reference, order, meta = {}, [], {}
    for cell in release_nb.cells:
        nbg = cell.get("metadata", {}).get("nbgrader", {})
        gid = nbg.get("grade_id")
        if not gid or gid in reference:
            continue
        order.append(gid)
        reference[gid] = {"name": gid, "cell_type": cell.cell_type, "source": cell.source,
                          "checksum": nbg.get("checksum"), "locked": bool(nbg.get("locked")),
                          "grade": bool(nbg.get("grade")), "solution": bool(nbg.get("solution")),
                          "points": float(nbg["points"]) if nbg.get("grade") and "points" in nbg else None}
        if "gptlab" in cell.get("metadata", {}):
            meta[gid] = json.loads(json.dumps(cell.metadata["gptlab"]))
    return reference, order, meta


def assignment_version(cells: list[tuple[str, float | None, str | None]]) -> str:
    """The version of one assignment notebook: a sha256 of its nbgrader cells' ``(grade_id,
    points, text)``, sorted: ``points`` for graded cells, ``text`` the released source of a locked
    cell (hidden tests removed, trailing spaces ignored), None for an answer cell. The release and
    the gradebook give the same value for the same ``generate_assignment``; a change to a graded
    or locked cell changes it."""
    text = json.dumps(sorted([str(g), None if p is None else float(p), t] for g, p, t in cells))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def release_version(reference: dict) -> str:
    return assignment_version([(g, r["points"], norm(r["source"]) if r["locked"] else None)
                               for g, r in reference.items()])


