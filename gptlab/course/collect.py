"""``course collect DIR``: learners' notebooks into ``submitted/<student>/<assignment>/``.

Two layouts are understood:

* **a folder of submissions for one assignment** (``--assignment NAME``): ``<student>.ipynb``
  files (the file is taken as the assignment's notebook; an assignment with several notebooks
  needs the next form), or ``<student>/`` subfolders holding the notebooks (and any other
  files the learner handed in);
* **nbgrader's exchange inbound folder** (``<exchange>/<course>/inbound``, or the course folder
  or exchange root above it): ``<student>+<assignment>+<timestamp>[+<random>]/`` folders, as
  ``nbgrader submit`` writes them on a JupyterHub. The latest submission of each student wins,
  and its ``timestamp.txt`` is kept (nbgrader computes late penalties from it).

In a learner's folder (``<student>/`` or an exchange folder), a notebook saved under another
name than the assignment's is taken for it when the name is a copy's: Colab's ``Copy of
causal_mask.ipynb``, a browser's duplicate ``causal_mask (1).ipynb`` or ``causal_mask(2).ipynb``,
JupyterLab's ``causal_mask-Copy1.ipynb`` (:func:`copy_of`). It is collected as
``causal_mask.ipynb``, and a message says so; when the folder also holds ``causal_mask.ipynb``
itself, that one wins and the message names the copies left aside (they are still copied, under
their own names, with the learner's other files). Of several copies, the last modified wins.
In a flat folder, a file named after the notebook (or a copy of it) names no student: it is
skipped.

A learner's folder holding neither the notebook nor a copy of it is still collected (the
autograder marks the notebook missing), with a message naming what the folder holds.

Student ids are sanitized (letters, digits, ``_ . @ -``; anything else becomes ``_``). Two
submissions that become the same id (``Frank Smith.ipynb`` and ``Frank_Smith.ipynb``; or a file
and a folder of one name) are a conflict: both are skipped, with a reason naming both, and nothing
is collected for that id until all but one are renamed or removed. Each
student's folder is written next to its final place and renamed into it, so a half-copied
submission is never left behind.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ._common import Course, CourseError

__all__ = ["collect", "sanitize_student_id", "copy_of", "Collected"]

_BAD = re.compile(r"[^A-Za-z0-9_.@-]+")


def sanitize_student_id(name: str) -> str:
    """A student id usable as a folder name and by nbgrader (no ``+``, ``*``, ``/``, spaces ...)."""
    sid = _BAD.sub("_", name.strip()).strip("._")
    if not sid:
        raise ValueError(f"{name!r} gives an empty student id")
    return sid


@dataclass
class Collected:
    """What ``collect`` did: (student, assignment, source) copied, (source, reason) skipped, and
    one-line messages on notebooks taken under another name (``alice: took 'Copy of x.ipynb' as
    x.ipynb``) or left aside for the exact name."""

    copied: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


def copy_of(filename: str, notebook: str) -> bool:
    """Whether ``filename`` is a copy of ``<notebook>.ipynb`` under the name a tool gave it:
    ``Copy of <nb>.ipynb`` (Colab, possibly repeated), ``<nb> (1).ipynb`` or ``<nb>(1).ipynb`` (a
    browser's duplicate download), ``<nb>-Copy1.ipynb`` (JupyterLab), or a mix of these."""
    nb = re.escape(notebook)
    return re.fullmatch(rf"(?:Copy of )*{nb}(?:-Copy\d+| ?\(\d+\))*\.ipynb", filename) is not None \
        and filename != f"{notebook}.ipynb"


def _match_notebooks(folder: Path, notebooks: list[str], who: str) -> tuple[dict[str, str], list[str]]:
    """For a learner's folder: ``{copy's file name: notebook}`` to rename, and the messages.

    Only the folder's top level is looked at (that is where the autograder reads the notebooks).
    """
    files = [p for p in folder.iterdir() if p.is_file() and not p.is_symlink()] if folder.is_dir() else []
    renames: dict[str, str] = {}
    messages: list[str] = []
    for nb in notebooks:
        copies = [p for p in files if copy_of(p.name, nb)]
        if not copies:
            if not (folder / f"{nb}.ipynb").is_file():
                messages.append(f"{who}: no {nb}.ipynb (nor a copy of it) in the folder, which holds "
                                f"{_listing(folder)}; it is graded as missing unless renamed and collected again")
            continue
        # the last modified copy wins; at equal times, the higher-numbered name
        copies.sort(key=lambda p: (p.stat().st_mtime, [int(d) for d in re.findall(r"\d+", p.name[:-6])]))
        listed = ", ".join(repr(p.name) for p in copies[:-1])
        exact = folder / f"{nb}.ipynb"
        if exact.is_file() and not exact.is_symlink():
            listed = ", ".join(repr(p.name) for p in copies)
            messages.append(f"{who}: took {nb}.ipynb, ignored {listed}")
            continue
        chosen = copies[-1]
        renames[chosen.name] = f"{nb}.ipynb"
        messages.append(f"{who}: took {chosen.name!r} as {nb}.ipynb" + (f", ignored {listed}" if listed else ""))
    return renames, messages


def _listing(folder: Path, most: int = 6) -> str:
    """What a folder holds, for a message: ``'a.ipynb', 'work/'`` (at most ``most`` names)."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                   if not p.name.startswith(".") and p.name != "timestamp.txt") if folder.is_dir() else []
    if not names:
        return "nothing"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(repr(n) for n in names[:most]) + more


def _parse_time(text: str) -> datetime | None:
    from nbgrader.utils import parse_utc

    try:
        return parse_utc(text.strip())
    except Exception:  # noqa: BLE001 (dateutil raises several kinds)
        return None


def _inbound_folder(src: Path, course_id: str) -> Path | None:
    for cand in (src, src / "inbound", src / course_id / "inbound"):
        if cand.is_dir() and any("+" in p.name for p in cand.iterdir() if p.is_dir()):
            return cand
    return None


# (student, assignment) -> every submission found for it: (timestamp, source, how, name as given)
_Candidates = dict[tuple[str, str], list[tuple[datetime, Path, str, str]]]


def _student_id(student: str, entry: Path, found: Collected) -> str | None:
    """``student`` sanitized; None, with ``entry`` skipped for the reason, where nothing is left."""
    try:
        return sanitize_student_id(student)
    except ValueError as e:
        found.skipped.append((str(entry), str(e)))
        return None


def _inbound_candidates(inbound: Path, assignment: str | None, known: list[str],
                        found: Collected) -> _Candidates:
    """Every submission in nbgrader's exchange inbound folder, by (student id, assignment); the
    folders that are none go to ``found.skipped`` with the reason."""
    cands: _Candidates = {}
    for entry in sorted(inbound.iterdir()):
        parts = entry.name.rsplit("+", 3) if entry.is_dir() else []
        if len(parts) < 3:
            found.skipped.append((str(entry), "not a <student>+<assignment>+<timestamp> folder"))
            continue
        student, name, stamp = parts[0], parts[1], parts[2]
        if assignment and name != assignment:
            found.skipped.append((str(entry), f"assignment {name}, not {assignment}"))
            continue
        if name not in known:
            found.skipped.append((str(entry), f"unknown assignment {name!r}"))
            continue
        when = _parse_time(stamp)
        if when is None and (entry / "timestamp.txt").is_file():
            when = _parse_time((entry / "timestamp.txt").read_text())
        if when is None:
            found.skipped.append((str(entry), f"unreadable timestamp {stamp!r}"))
            continue
        sid = _student_id(student, entry, found)
        if sid is None:
            continue
        cands.setdefault((sid, name), []).append((when, entry, "folder", student))
    return cands


def _flat_candidates(course: Course, src: Path, assignment: str | None, known: list[str],
                     found: Collected) -> _Candidates:
    """Every submission of ``assignment`` in a plain folder (``<student>.ipynb`` files and
    ``<student>/`` folders), by (student id, assignment); the entries that are none go to
    ``found.skipped`` with the reason."""
    if not assignment:
        raise CourseError(
            f"{src} is not an nbgrader exchange inbound folder: name the assignment with --assignment "
            "for a folder of <student>.ipynb files or <student>/ folders"
        )
    if assignment not in known:
        raise CourseError(f"unknown assignment {assignment!r}; the course has: {', '.join(known)}")
    cands: _Candidates = {}
    for entry in sorted(src.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_symlink():
            found.skipped.append((str(entry), "a symbolic link"))
            continue
        if entry.is_file() and entry.suffix == ".ipynb":
            names = _notebook_names(course, assignment)
            if any(entry.name == f"{nb}.ipynb" or copy_of(entry.name, nb) for nb in names):
                found.skipped.append((str(entry), f"named after the notebook, not a student: hand it in as "
                                                  f"<student>/{names[0]}.ipynb"))
                continue
            if len(names) != 1:
                found.skipped.append((str(entry), f"{assignment} has several notebooks: hand them in as a "
                                                  "<student>/ folder"))
                continue
            how = "file"
            student = entry.stem
        elif entry.is_dir() and any(entry.rglob("*.ipynb")):
            how = "folder"
            student = entry.name
        else:
            found.skipped.append((str(entry), "neither <student>.ipynb nor a folder with notebooks"))
            continue
        sid = _student_id(student, entry, found)
        if sid is None:
            continue
        when = datetime.fromtimestamp(entry.stat().st_mtime, tz=timezone.utc)
        cands.setdefault((sid, assignment), []).append((when, entry, how, entry.name))
    return cands


def _write_submission(dest: Path, entry: Path, how: str, when: datetime, notebook: str,
                      renames: dict[str, str]) -> None:
    """Copy one submission into ``dest`` (``submitted/<student>/<assignment>``): a ``file`` as
    ``<notebook>.ipynb``, a ``folder`` whole with the copies in ``renames`` renamed; a
    ``timestamp.txt`` where it has none. It is written beside ``dest`` and renamed into place, replacing what was there."""
    name = dest.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=dest.parent))
    try:
        if how == "file":
            shutil.copyfile(entry, tmp / f"{notebook}.ipynb")
            (tmp / "timestamp.txt").write_text(when.strftime("%Y-%m-%d %H:%M:%S.%f %Z"))
        else:
            shutil.copytree(entry, tmp, dirs_exist_ok=True, ignore=_ignore)
            for old, new in renames.items():
                (tmp / old).rename(tmp / new)
            if not (tmp / "timestamp.txt").exists():
                (tmp / "timestamp.txt").write_text(when.strftime("%Y-%m-%d %H:%M:%S.%f %Z"))
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{name}.old.", dir=dest.parent))
            dest.rename(old / "x")
            tmp.rename(dest)
            shutil.rmtree(old)
        else:
            tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def collect(course: Course, src: Path, assignment: str | None = None, dry_run: bool = False) -> Collected:
    """Copy the submissions in ``src`` into the course's ``submitted/`` folder; see the module doc."""
    src = Path(src)
    if not src.is_dir():
        raise CourseError(f"{src} is not a folder")
    cfg = course.config()
    course_id = cfg.CourseDirectory.get("course_id", "") or ""
    known = course.assignments()
    found = Collected()
    inbound = _inbound_folder(src, course_id)
    if inbound is not None:
        cands = _inbound_candidates(inbound, assignment, known, found)
    else:
        cands = _flat_candidates(course, src, assignment, known, found)

    chosen = _choose(cands, found, flat=inbound is None)
    notebooks = {name: _notebook_names(course, name) for name in {a for _, a in chosen}}
    submitted = course.directory("submitted")
    for (sid, name), (when, entry, how) in sorted(chosen.items()):
        found.copied.append((sid, name, str(entry)))
        renames: dict[str, str] = {}
        if how == "folder":
            renames, messages = _match_notebooks(entry, notebooks[name], sid if name == assignment else f"{sid} ({name})")
            found.messages.extend(messages)
        if not dry_run:
            _write_submission(submitted / sid / name, entry, how, when, notebooks[name][0], renames)
    return found


def _choose(cands: _Candidates, found: Collected, flat: bool) -> dict[tuple[str, str], tuple[datetime, Path, str]]:
    """The one submission to collect for each (student id, assignment): ``{key: (timestamp,
    source, how)}``; the others go to ``found.skipped`` with the reason.

    Several submissions of one learner in the exchange (the same name, other timestamps): the
    latest wins. Submissions that only *become* the same id (``Frank Smith.ipynb`` and
    ``Frank_Smith.ipynb`` in a folder, or two exchange user names that sanitize alike) are a
    conflict: each is skipped with a reason naming all of them, and nothing is collected for that
    id until the instructor renames or removes all but one (one learner's work must not silently
    replace another's).
    """
    chosen: dict[tuple[str, str], tuple[datetime, Path, str]] = {}
    for (sid, name), subs in sorted(cands.items()):
        given = sorted({s[3] for s in subs})
        if len(given) > 1 or (flat and len(subs) > 1):
            both = ", ".join(repr(s[1].name) for s in subs)
            for s in subs:
                found.skipped.append((str(s[1]), f"conflict: {both} give the same student id {sid!r}; nothing is "
                                                 f"collected for {sid} until all but one are renamed or removed"))
            continue
        latest = max(subs, key=lambda s: s[0])  # the first of equal timestamps (in name order)
        for s in subs:
            if s is not latest:
                found.skipped.append((str(s[1]), f"a later submission of {sid} is collected: {latest[1].name}"))
        chosen[(sid, name)] = latest[:3]
    return chosen


def _ignore(folder: str, names: list[str]) -> set[str]:
    """Checkpoints, caches, and symbolic links (a link could point at any file of the grader's machine)."""
    return {n for n in names if n in (".ipynb_checkpoints", "__pycache__") or Path(folder, n).is_symlink()}


def _notebook_names(course: Course, assignment: str) -> list[str]:
    folder = course.directory("source") / assignment
    return sorted(p.stem for p in folder.glob("*.ipynb"))
