"""The first cell of every course notebook: set-up on Google Colab, nothing anywhere else.

Where this sits: before the pipeline (text -> tokens -> batches -> model -> logits -> loss |
samples -> text) can run in a notebook, ``gptlab`` must be importable and its data fetched. On a
learner's machine ``make book`` has done both; on Google Colab, a chapter or an exercise opened
from the book's launch button starts in a bare runtime. The first cell of every chapter notebook
(``book/*.ipynb``) and of every exercise notebook (``solutions/*/*.ipynb``, hence ``exercises/``)
is therefore the same small cell, rendered here from ONE template:

* on Colab (``"google.colab" in sys.modules``) it installs gptlab with its ``hf`` extra from the
  course repository and runs ``python -m gptlab fetch``; pip keeps the CUDA build of torch that
  Colab provides, because it already satisfies gptlab's ``torch`` requirement;
* anywhere else it does nothing, and prints nothing;
* it is plain Python (``subprocess`` and ``sys.executable -m pip``, no IPython ``!`` magics),
  because graders run exercise cells with ``exec``.

The repository address is not written here: it is read from ``repository:`` in the book's
``_config.yml``, the one place that names it. To (re)write the first cell of notebooks::

    python -m gptlab.notebook_setup book/*.ipynb solutions/*/*.ipynb

or, from Python, ``write_setup_cell(path, repo_url, branch)``; ``repository_from_config()``
reads the address and branch from ``_config.yml``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from .files import atomic_write_text

__all__ = [
    "SETUP_CELL_ID",
    "SETUP_CELL_TAGS",
    "render_setup_source",
    "render_setup_cell",
    "has_setup_cell",
    "write_setup_cell",
    "repository_from_config",
    "main",
]

#: The cell's id (nbformat >= 4.5): how a later run finds the cell again and replaces it.
SETUP_CELL_ID = "gptlab-colab-setup"
#: Jupyter Book leaves the cell out of the rendered page: it does nothing there, and the page
#: says in words how to run a chapter on Colab. The downloaded and the Colab notebook keep it.
SETUP_CELL_TAGS = ("remove-cell",)

_TEMPLATE = '''\
# Set-up on Google Colab (does nothing anywhere else): install gptlab, fetch and verify its data.
import subprocess
import sys

if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                    "gptlab[hf] @ git+{repo_url}@{branch}"], check=True)
    subprocess.run([sys.executable, "-m", "gptlab", "fetch"], check=True)'''

_URL = re.compile(r"https://[A-Za-z0-9.-]+(/[A-Za-z0-9._~-]+)+")
_BRANCH = re.compile(r"[A-Za-z0-9._/-]+")


def render_setup_source(repo_url: str, branch: str = "main") -> str:
    """The set-up cell's source code for the repository at ``repo_url`` (git branch ``branch``).

    ``repo_url`` must be a plain ``https://`` address without a trailing slash or ``.git``
    (e.g. ``https://github.com/owner/name``); it goes into a ``pip install`` requirement.
    """
    if not isinstance(repo_url, str) or not _URL.fullmatch(repo_url) or repo_url.endswith(".git"):
        raise ValueError(
            f"repo_url: expected a plain https:// repository address such as "
            f"'https://github.com/owner/name' (no trailing slash, no .git), got {repo_url!r}"
        )
    if not isinstance(branch, str) or not _BRANCH.fullmatch(branch) or branch.startswith("-"):
        raise ValueError(f"branch: expected a git branch name such as 'main', got {branch!r}")
    return _TEMPLATE.format(repo_url=repo_url, branch=branch)


def is_setup_source(source: str) -> bool:
    """Whether ``source`` is exactly a rendered set-up cell (for any repository and branch): the
    autograder leaves such a cell out (it does nothing outside Colab) and does not read it as the
    learner's code; any other text in its place is the learner's."""
    head, _, rest = _TEMPLATE.partition("{repo_url}")
    middle, _, tail = rest.partition("{branch}")
    text = source.strip("\n")
    if not (text.startswith(head) and text.endswith(tail)):
        return False
    inner = text[len(head): len(text) - len(tail)]
    url, sep, branch = inner.rpartition(middle)
    return bool(sep) and bool(_URL.fullmatch(url)) and bool(_BRANCH.fullmatch(branch)) and not branch.startswith("-")


def render_setup_cell(repo_url: str, branch: str = "main") -> dict[str, Any]:
    """The set-up cell as an nbformat 4 code cell (a JSON-ready dict, no outputs)."""
    return {
        "cell_type": "code",
        "execution_count": None,
        "id": SETUP_CELL_ID,
        "metadata": {"tags": list(SETUP_CELL_TAGS)},
        "outputs": [],
        "source": render_setup_source(repo_url, branch).splitlines(keepends=True),
    }


def _source(cell: dict[str, Any]) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def has_setup_cell(notebook: dict[str, Any], repo_url: str, branch: str = "main") -> bool:
    """Whether ``notebook`` (a parsed .ipynb) starts with exactly the rendered set-up cell."""
    cells = notebook.get("cells") or []
    if not cells:
        return False
    first, expected = cells[0], render_setup_cell(repo_url, branch)
    return (
        first.get("cell_type") == "code"
        and _source(first) == _source(expected)
        and first.get("metadata", {}).get("tags", []) == expected["metadata"]["tags"]
    )


def _is_setup_cell(cell: dict[str, Any]) -> bool:
    return cell.get("id") == SETUP_CELL_ID or _source(cell).startswith(_TEMPLATE.splitlines()[0])


def write_setup_cell(path: str | os.PathLike[str], repo_url: str, branch: str = "main") -> bool:
    """Make the set-up cell the first cell of the notebook at ``path``; return True if it changed.

    An existing set-up cell (recognised by its id or its first line) is replaced wherever it is;
    every other cell, and the notebook's metadata, are kept as they are. The file is written
    atomically (a temporary file in the same folder, then renamed), in nbformat's JSON layout.
    """
    path = Path(path)
    if path.suffix != ".ipynb":
        raise ValueError(f"expected a Jupyter notebook (.ipynb), got {str(path)!r}")
    text = path.read_text(encoding="utf-8")
    notebook = json.loads(text)
    if notebook.get("nbformat") != 4:
        raise ValueError(f"{path}: expected an nbformat 4 notebook, got nbformat {notebook.get('nbformat')!r}")
    cell = render_setup_cell(repo_url, branch)
    if notebook.get("nbformat_minor", 0) < 5:
        # cell ids exist from nbformat 4.5 on; older notebooks keep their format
        del cell["id"]
    cells = [c for c in notebook.get("cells", []) if not _is_setup_cell(c)]
    notebook["cells"] = [cell, *cells]
    new_text = json.dumps(notebook, sort_keys=True, indent=1, ensure_ascii=False) + "\n"
    if new_text == text:
        return False
    atomic_write_text(path, new_text)
    return True


def repository_from_config(config: str | os.PathLike[str] = "_config.yml") -> tuple[str, str]:
    """``(url, branch)`` from the ``repository:`` section of a Jupyter Book ``_config.yml``."""
    import yaml  # installed with the book extra (jupyter-book); only this helper needs it

    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; expected the book's _config.yml (run from the repository root)")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    repo = data.get("repository") or {}
    url, branch = repo.get("url"), repo.get("branch", "main")
    if not url:
        raise ValueError(f"{path}: expected `repository: url:` (the course repository's address)")
    render_setup_source(url, branch)  # validates both
    return url, branch


def main(argv: list[str] | None = None) -> int:
    """Command line: write the set-up cell into the given notebooks."""
    parser = argparse.ArgumentParser(
        prog="python -m gptlab.notebook_setup",
        description="Make the Colab set-up cell the first cell of each notebook "
        "(repository address and branch from _config.yml).",
    )
    parser.add_argument("notebooks", nargs="+", type=Path, help="the .ipynb files to update")
    parser.add_argument("--config", type=Path, default=Path("_config.yml"), help="the book's _config.yml (default: %(default)s)")
    args = parser.parse_args(argv)
    url, branch = repository_from_config(args.config)
    for nb in args.notebooks:
        changed = write_setup_cell(nb, url, branch)
        print(f"{'updated ' if changed else 'unchanged'} {nb}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
