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

Student ids are sanitized (letters, digits, ``_ . @ -``; anything else becomes ``_``). Each
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

__all__ = ["collect", "sanitize_student_id", "Collected"]

_BAD = re.compile(r"[^A-Za-z0-9_.@-]+")


def sanitize_student_id(name: str) -> str:
    """A student id usable as a folder name and by nbgrader (no ``+``, ``*``, ``/``, spaces ...)."""
    sid = _BAD.sub("_", name.strip()).strip("._")
    if not sid:
        raise ValueError(f"{name!r} gives an empty student id")
    return sid


@dataclass
class Collected:
    """What ``collect`` did: (student, assignment, source) copied, and (source, reason) skipped."""

    copied: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


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


def collect(course: Course, src: Path, assignment: str | None = None, dry_run: bool = False) -> Collected:
    """Copy the submissions in ``src`` into the course's ``submitted/`` folder; see the module doc."""
    src = Path(src)
    if not src.is_dir():
        raise CourseError(f"{src} is not a folder")
    cfg = course.config()
    course_id = cfg.CourseDirectory.get("course_id", "") or ""
    known = course.assignments()
    found = Collected()
    # (student, assignment) -> (timestamp, source folder or file, how)
    chosen: dict[tuple[str, str], tuple[datetime, Path, str]] = {}

    inbound = _inbound_folder(src, course_id)
    if inbound is not None:
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
            try:
                sid = sanitize_student_id(student)
            except ValueError as e:
                found.skipped.append((str(entry), str(e)))
                continue
            key = (sid, name)
            if key in chosen and chosen[key][0] >= when:
                found.skipped.append((str(entry), f"a later submission of {sid} is collected"))
                continue
            if key in chosen:
                found.skipped.append((str(chosen[key][1]), f"a later submission of {sid} is collected"))
            chosen[key] = (when, entry, "folder")
    else:
        if not assignment:
            raise CourseError(
                f"{src} is not an nbgrader exchange inbound folder: name the assignment with --assignment "
                "for a folder of <student>.ipynb files or <student>/ folders"
            )
        if assignment not in known:
            raise CourseError(f"unknown assignment {assignment!r}; the course has: {', '.join(known)}")
        for entry in sorted(src.iterdir()):
            if entry.name.startswith("."):
                continue
            if entry.is_symlink():
                found.skipped.append((str(entry), "a symbolic link"))
                continue
            if entry.is_file() and entry.suffix == ".ipynb":
                if len(_notebook_names(course, assignment)) != 1:
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
            try:
                sid = sanitize_student_id(student)
            except ValueError as e:
                found.skipped.append((str(entry), str(e)))
                continue
            when = datetime.fromtimestamp(entry.stat().st_mtime, tz=timezone.utc)
            if (sid, assignment) in chosen:
                found.skipped.append((str(entry), f"{sid} has two submissions here; the latest one is collected"))
                if chosen[(sid, assignment)][0] >= when:
                    continue
            chosen[(sid, assignment)] = (when, entry, how)

    notebooks = {name: _notebook_names(course, name) for name in {a for _, a in chosen}}
    submitted = course.directory("submitted")
    for (sid, name), (when, entry, how) in sorted(chosen.items()):
        found.copied.append((sid, name, str(entry)))
        if dry_run:
            continue
        dest = submitted / sid / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=dest.parent))
        try:
            if how == "file":
                shutil.copyfile(entry, tmp / f"{notebooks[name][0]}.ipynb")
                (tmp / "timestamp.txt").write_text(when.strftime("%Y-%m-%d %H:%M:%S.%f %Z"))
            else:
                shutil.copytree(entry, tmp, dirs_exist_ok=True, ignore=_ignore)
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
    return found


def _ignore(folder: str, names: list[str]) -> set[str]:
    """Checkpoints, caches, and symbolic links (a link could point at any file of the grader's machine)."""
    return {n for n in names if n in (".ipynb_checkpoints", "__pycache__") or Path(folder, n).is_symlink()}


def _notebook_names(course: Course, assignment: str) -> list[str]:
    folder = course.directory("source") / assignment
    return sorted(p.stem for p in folder.glob("*.ipynb"))
