"""The book: its configuration, its notebooks (run under nbval), and a full offline build.

The build check is the one `make book` relies on: ``jupyter-book build . -W -n --keep-going``
passes (any warning fails it), the intro page renders, notebooks are executed into the pages, and
no page loads MathJax from a CDN (the local copy from sphinx-mathjax-offline is used instead).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BOOK_NOTEBOOKS = sorted(p for p in (REPO / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def _toc_files(toc: dict) -> list[str]:
    files = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                files.append(node["file"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(toc.get("parts", toc.get("chapters", [])))
    return files


def _page(stem: str) -> Path:
    hits = [REPO / (stem + ext) for ext in (".md", ".ipynb") if (REPO / (stem + ext)).exists()]
    assert len(hits) == 1, f"_toc.yml names {stem!r}: expected exactly one of {stem}.md / {stem}.ipynb, found {hits}"
    return hits[0]


def test_config_and_toc():
    config = yaml.safe_load((REPO / "_config.yml").read_text())
    for pattern in (".venv", "_build", "tests", "exercises", "solutions"):
        assert pattern in config["exclude_patterns"], f"_config.yml exclude_patterns misses {pattern!r}"
    assert config["execute"]["execute_notebooks"] in ("cache", "force")
    assert isinstance(config["execute"]["timeout"], int) and config["execute"]["timeout"] > 0
    assert "sphinx-mathjax-offline" in config["sphinx"]["extra_extensions"]

    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    pages = [_page(stem) for stem in _toc_files(toc)]
    assert all(p.relative_to(REPO).parts[0] == "book" for p in pages), "every page must live under book/"
    # only_build_toc_files: a page missing from the toc would silently not be built
    listed = {p.resolve() for p in pages}
    book_pages = {p.resolve() for p in (REPO / "book").rglob("*") if p.suffix in (".md", ".ipynb")
                  and ".ipynb_checkpoints" not in p.parts}
    assert book_pages <= listed, f"pages under book/ missing from _toc.yml: {sorted(map(str, book_pages - listed))}"


def test_there_is_a_notebook():
    assert REPO / "book" / "setup_check.ipynb" in BOOK_NOTEBOOKS


@pytest.mark.parametrize("notebook", BOOK_NOTEBOOKS, ids=[p.relative_to(REPO / "book").as_posix() for p in BOOK_NOTEBOOKS])
def test_notebook_runs_under_nbval(notebook: Path, tmp_path: Path):
    """``pytest --nbval-lax`` on one book notebook: every cell runs without an error."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(notebook)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert r.returncode == 0, f"{notebook.name} failed under nbval:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert re.search(r"\d+ passed", r.stdout), r.stdout


def _scripts(html: str) -> list[str]:
    return re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", html)


@pytest.mark.slow
def test_book_builds_offline_without_warnings(tmp_path: Path):
    jb = shutil.which("jupyter-book", path=os.path.dirname(sys.executable)) or shutil.which("jupyter-book")
    assert jb, "jupyter-book is not installed (pip install -e '.[book]')"
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(
        [jb, "build", str(REPO), "--path-output", str(tmp_path), "-W", "-n", "--keep-going"],
        capture_output=True, text=True, timeout=1800, env=env,
    )
    assert r.returncode == 0, f"the book build failed:\n{r.stdout[-8000:]}\n{r.stderr[-4000:]}"
    html = tmp_path / "_build" / "html"
    assert (html / "index.html").is_file()

    intro = (html / "book" / "intro.html").read_text()
    intro_text = re.sub(r"<[^>]+>", "", intro)
    for text in ("Build a GPT from scratch", "Causal masks", "The KV cache", "Speculative decoding", "make book"):
        assert text in intro_text, f"the intro page does not show {text!r}"
    assert 'class="math' in intro, "the intro's formulas were not turned into math"

    setup = re.sub(r"<[^>]+>", "", (html / "book" / "setup_check.html").read_text())
    assert "verified" in setup and "ln(65)" in setup, "setup_check was not executed into the page"

    pages = sorted(html.rglob("*.html"))
    assert pages
    for page in pages:
        for src in _scripts(page.read_text()):
            assert not ("mathjax" in src.lower() and re.match(r"(https?:)?//", src)), (
                f"{page.relative_to(html)} loads MathJax from the network: {src}"
            )
    mathjax = [s for s in _scripts(intro) if "mathjax" in s.lower()]
    assert mathjax, "the intro page loads no MathJax at all"
    for src in mathjax:
        local = (html / "book" / src.split("?")[0]).resolve()
        assert local.is_file(), f"MathJax script {src} is not in the built site"
    fonts = list((html / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").glob("*.woff"))
    assert fonts, "MathJax's CHTML fonts are missing from the built site"
