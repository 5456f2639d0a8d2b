"""Shared pieces of the instructor's commands: the course folder, its nbgrader configuration,
running an nbgrader converter in-process, atomic writes, and the notebook convention.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Course", "CourseError", "run_converter", "NOTES_DIR"]

NOTES_DIR = ".gptlab"
"""Folder under ``autograded/`` with the autograder's notes, ``<assignment>/<student>.json``.

nbgrader lists ``autograded/*/<assignment>``; a name starting with a dot is not matched by that."""


class CourseError(RuntimeError):
    """A course command cannot go on (no nbgrader_config.py, unknown assignment, ...)."""


@dataclass
class Course:
    """A course folder: ``nbgrader_config.py`` with ``solutions/``, ``exercises/``, ``submitted/`` ..."""

    root: Path
    db_url: str | None = None

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        if not (self.root / "nbgrader_config.py").is_file():
            raise CourseError(
                f"{self.root} has no nbgrader_config.py: pass --course DIR, the folder that holds it "
                "(the gptlab repository root)."
            )
        # nbgrader runs alembic by name to check the gradebook's schema: it sits beside Python.
        if shutil.which("alembic") is None:
            os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        if self.db_url is not None and "://" not in self.db_url:  # a plain path
            self.db_url = "sqlite:///" + str(Path(self.db_url).resolve())

    def config(self, **overrides):
        """The course's nbgrader configuration (a traitlets ``Config``), rooted at the course folder."""
        from traitlets.config import PyFileConfigLoader

        cfg = PyFileConfigLoader("nbgrader_config.py", path=str(self.root)).load_config()
        cfg.CourseDirectory.root = str(self.root)
        url = self.db_url or cfg.CourseDirectory.get("db_url") or "sqlite:///gradebook.db"
        cfg.CourseDirectory.db_url = _absolute_sqlite(url, self.root)
        for key, value in overrides.items():
            section, name = key.split(".")
            setattr(cfg[section], name, value)
        return cfg

    @property
    def gradebook_url(self) -> str:
        return self.config().CourseDirectory.db_url

    def directory(self, kind: str) -> Path:
        """``source``, ``release``, ``submitted``, ``autograded`` or ``feedback`` folder (absolute)."""
        cfg = self.config()
        default = {"source": "source", "release": "release", "submitted": "submitted",
                   "autograded": "autograded", "feedback": "feedback"}[kind]
        return self.root / cfg.CourseDirectory.get(f"{kind}_directory", default)

    def assignments(self, names: list[str] | None = None) -> list[str]:
        """The named assignments (checked to exist in the source folder), or all of them, sorted."""
        source = self.directory("source")
        found = sorted(p.name for p in source.iterdir() if p.is_dir() and not p.name.startswith(".")) \
            if source.is_dir() else []
        if not names:
            if not found:
                raise CourseError(f"no assignment in {source}")
            return found
        unknown = [n for n in names if n not in found]
        if unknown:
            raise CourseError(f"unknown assignment(s) {', '.join(unknown)}; {source} has: {', '.join(found) or 'none'}")
        return list(names)

    def notes_path(self, assignment: str, student: str) -> Path:
        return self.directory("autograded") / NOTES_DIR / assignment / f"{student}.json"

    def read_notes(self, assignment: str, student: str) -> list[dict]:
        path = self.notes_path(assignment, student)
        return json.loads(path.read_text()) if path.is_file() else []


def _absolute_sqlite(url: str, root: Path) -> str:
    prefix = "sqlite:///"
    if url.startswith(prefix) and not os.path.isabs(url[len(prefix):]):
        return prefix + str(root / url[len(prefix):])
    return url


def run_converter(cls, coursedir, config, **attrs) -> tuple[bool, str]:
    """Run an nbgrader converter (``GenerateAssignment``, ``Autograde`` ...) in this process.

    Returns (success, log text). nbgrader logs each failed submission and raises at the end; the
    log says which.
    """
    app = cls(coursedir=coursedir, config=config)
    for key, value in attrs.items():
        setattr(app, key, value)
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    app.log.addHandler(handler)
    old_level = app.log.level
    app.log.setLevel(logging.INFO)
    try:
        app.start()
        ok = True
    except BaseException as e:  # noqa: BLE001 (nbgrader raises bare Exceptions; KeyboardInterrupt re-raised)
        if isinstance(e, KeyboardInterrupt):
            raise
        buf.write(traceback.format_exc())
        ok = False
    finally:
        app.log.removeHandler(handler)
        app.log.setLevel(old_level)
    return ok, buf.getvalue()
