"""The instructor's grading secret: what the autograder's hidden cases are drawn from.

Where this sits: beside the pipeline, in the instructor's workflow. The autograder runs every
graded check twice, on the inputs the notebook shows and on hidden ones drawn from a seed that this
secret and the test cell's id decide (:func:`gptlab.grading.tasks.hidden_seed`), so no table of
answers written before the grading can match them. The secret is 32 random bytes, created on first
use, kept OUTSIDE the course folder (so that it is never committed, released or collected):

* ``$GPTLAB_GRADING_SECRET``, a file path, if set;
* else ``$XDG_CONFIG_HOME/gptlab/grading-secret`` (``~/.config/gptlab/grading-secret``).

The file is written atomically with mode 600. Keep it (and back it up) for as long as grades may be
recomputed: another secret gives other hidden inputs (a correct answer passes them all the same).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ..files import atomic_write_text

__all__ = ["secret_path", "load_secret", "ENV"]

ENV = "GPTLAB_GRADING_SECRET"


def secret_path() -> Path:
    """Where the grading secret lives (see the module docstring)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "gptlab" / "grading-secret"


def load_secret(create: bool = True) -> bytes:
    """The grading secret's bytes, created (64 hex digits, mode 600) if missing and ``create``."""
    path = secret_path()
    if not path.is_file():
        if not create:
            raise FileNotFoundError(f"no grading secret at {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, secrets.token_hex(32) + "\n")
        os.chmod(path, 0o600)
    text = path.read_text().strip()
    if len(text) < 32:
        raise ValueError(f"the grading secret {path} is too short ({len(text)} characters; at least 32 expected): "
                         "delete it to make a new one")
    return text.encode()
