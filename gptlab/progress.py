"""Progress bars: a widget where someone is watching a notebook, plain text when asked.

Where this sits: beside the pipeline; the trainer's bar (:meth:`gptlab.train.Trainer.fit`) comes
from :func:`progress_bar`.

By default a bar is ``tqdm.auto``'s: in a notebook kernel (Jupyter, Colab, VS Code) an ipywidgets
bar, in a terminal a text bar. A widget needs a live frontend to draw it, though: in a notebook
executed with no one watching (the book build, ``jupyter nbconvert --execute``) it is stored as a
widget output plus the widget's state, and a page built from that loads the widget manager
(``require.js``, ``@jupyter-widgets/html-manager``) from a CDN, and shows no bar offline. With the
environment variable ``GPTLAB_PROGRESS=text`` every gptlab bar is tqdm's plain text bar instead:
``make book`` and the tests' book build set it (``tests/_book_build.py``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["PROGRESS_ENV", "TEXT_MININTERVAL_S", "progress_mode", "progress_bar"]

PROGRESS_ENV = "GPTLAB_PROGRESS"
_MODES = ("auto", "text")
#: In text mode, written to anything but a terminal (a built page, a log), a bar is refreshed at
#: most this often: each refresh there is a line of its own, not an update in place.
TEXT_MININTERVAL_S = 30.0


def progress_mode() -> str:
    """``"auto"`` (the default: tqdm.auto's choice, a widget in a notebook) or ``"text"`` (plain
    text everywhere), from the environment variable ``GPTLAB_PROGRESS``; anything else is a
    ``ValueError`` naming the two."""
    mode = os.environ.get(PROGRESS_ENV, "").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{PROGRESS_ENV}={os.environ[PROGRESS_ENV]!r}: expected one of {', '.join(_MODES)} "
                         "(text: plain text bars, e.g. for notebooks executed with no one watching)")
    return mode


def progress_bar(*args: Any, **kwargs: Any):
    """A ``tqdm`` progress bar (same arguments): ``tqdm.auto.tqdm``, or with ``GPTLAB_PROGRESS=text``
    tqdm's plain text bar (``tqdm.std.tqdm``), which writes text (to stderr) and never a widget;
    written to anything but a terminal it refreshes every ``TEXT_MININTERVAL_S`` seconds at most
    (unless ``mininterval`` is given), so that a built page or a log holds a few lines of it."""
    if progress_mode() == "text":
        from tqdm.std import tqdm

        out = kwargs.get("file") or sys.stderr
        try:
            terminal = bool(out.isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            terminal = False
        if not terminal:
            kwargs.setdefault("mininterval", TEXT_MININTERVAL_S)
            kwargs.setdefault("maxinterval", max(kwargs["mininterval"], 10.0))  # tqdm's monitor thread
    else:
        from tqdm.auto import tqdm
    return tqdm(*args, **kwargs)
