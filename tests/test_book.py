"""The book: its configuration, its notebooks, and one full offline build.

* Configuration: `_config.yml` and `_toc.yml` agree with the files under `book/`; the repository
  address is written once (`repository: url:`) and the README and every notebook use that one.
* The first cell of every book notebook and every exercise notebook (`solutions/` and the
  learners' copies in `exercises/`) is exactly the Colab set-up cell rendered by
  `gptlab.notebook_setup` (one parametrized case per notebook).
* The build (`jupyter-book build . -W -n --keep-going`, as `make book`; built once per session by
  `tests/_book_build.py`, shared with the browser test) passes without a warning, executes every
  notebook, and gives every notebook page a download button and a launch button into Colab.
* Offline, whatever the build machine's network: no built page names a resource on another host
  (tests/_offline.py reads every page's source; the browser test also watches the requests), and
  no notebook, as committed or as the build executed it, holds an ipywidgets widget (a tqdm.auto
  progress bar, say: its page would load the widget manager from a CDN). The build runs the
  chapters with plain-text progress bars (`BOOK_ENV`, the same in the Makefile), and myst-nb is
  told never to load the widget scripts (`nb_ipywidgets_js: {}`).
* nbval-style, from that one execution: no cell of a book notebook raises, and every cell's output
  equals the output committed in the notebook, except cells tagged `nbval-ignore-output` (the
  tag `pytest --nbval` honours too) whose output depends on the machine.
* Time: no cell of the build takes more than `CELL_LIMIT_S` (60 s; the build times every cell, see
  tests/_book_build.py), so that a learner's laptop builds the book; the one exception is a cell
  tagged `long-training` (chapter 5's training, which shows a progress bar and says how long it
  takes). A cell counts as over the limit only when both its wall-clock time and its CPU time are:
  on a machine whose cores other programs take, a cell waits (wall-clock time) without computing,
  and that is no fault of the chapter.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from _book_build import (BOOK_ENV, REPO, BookBuild, build_book_once, read_cell_times, source_sha256,
                         timing_env)
from _nbcompare import comparable, ignored
from _offline import WIDGET_STATE, WIDGET_VIEW, foreign_resources, widget_problems
from gptlab.notebook_setup import has_setup_cell, render_setup_source

BOOK_NOTEBOOKS = sorted(p for p in (REPO / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
# instructors' sources, and the learners' copies nbgrader makes from them (what Colab opens)
EXERCISE_NOTEBOOKS = sorted(p for folder in ("solutions", "exercises") for p in (REPO / folder).glob("*/*.ipynb")
                            if ".ipynb_checkpoints" not in p.parts)
CONFIG = yaml.safe_load((REPO / "_config.yml").read_text())
REPO_URL, REPO_BRANCH = CONFIG["repository"]["url"], CONFIG["repository"].get("branch", "main")
CELL_LIMIT_S = 60  # the most one cell of the book may take (on 2 cores, with the machine's best kernels)
LONG_TRAINING_TAG = "long-training"  # the cell tag that exempts a cell (chapter 5's training) from it
REFRESH_OUTPUTS = (
    " ".join(f"{k}={v}" for k, v in BOOK_ENV.items())
    + " jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.record_timing=False {nb}"
)


def _rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


@pytest.fixture(scope="session")
def book(tmp_path_factory: pytest.TempPathFactory) -> BookBuild:
    return build_book_once(tmp_path_factory)


# ---------------------------------------------------------------------------------------------
# configuration


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
    config = CONFIG
    for pattern in (".venv", "_build", "tests", "exercises", "solutions"):
        assert pattern in config["exclude_patterns"], f"_config.yml exclude_patterns misses {pattern!r}"
    assert config["execute"]["execute_notebooks"] in ("cache", "force")
    assert isinstance(config["execute"]["timeout"], int) and config["execute"]["timeout"] > 0
    sphinx = config["sphinx"]
    assert "sphinx-mathjax-offline" in sphinx["extra_extensions"]
    # sphinx.config replaces Jupyter Book's extension list: it must keep MathJax offline and the
    # theme, and leave out sphinx_thebe (it declares `const THEBE_JS_URL` twice on every page)
    extensions = sphinx["config"]["extensions"]
    for ext in ("myst_nb", "jupyter_book", "sphinx_book_theme", "sphinx_external_toc", "sphinx-mathjax-offline"):
        assert ext in extensions, f"_config.yml sphinx.config.extensions misses {ext!r}"
    assert "sphinx_thebe" not in extensions
    # html_theme_options must be merged into the launch/repository options, not replace them
    assert sphinx["recursive_update"] is True
    assert sphinx["config"]["html_theme_options"]["navbar_persistent"] == []
    assert sphinx["config"]["html_context"]["default_mode"] in ("auto", "light", "dark")
    # a page with an ipywidgets widget must not load require.js and the widget manager from CDNs
    assert sphinx["config"]["nb_ipywidgets_js"] == {}, "_config.yml: sphinx.config.nb_ipywidgets_js must be {}"
    assert config["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    assert not config["launch_buttons"].get("thebe")

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


def test_make_book_runs_the_chapters_as_the_tests_build_does():
    """`make book` (the published book) sets the environment of tests/_book_build.py: plain-text
    progress bars, none from Hugging Face, so that no executed cell displays a widget."""
    makefile = (REPO / "Makefile").read_text()
    line = re.search(r"^BOOK_ENV\s*:?=\s*(.*)$", makefile, re.MULTILINE)
    assert line, "the Makefile defines no BOOK_ENV"
    assert dict(item.split("=", 1) for item in line.group(1).split()) == BOOK_ENV
    recipe = re.search(r"^book:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE).group(1)
    build = [cmd for cmd in recipe.splitlines() if "jupyter-book build" in cmd]
    assert build and all(cmd.strip().startswith("$(BOOK_ENV) ") for cmd in build), build


@pytest.mark.parametrize("notebook", BOOK_NOTEBOOKS, ids=[_rel(p) for p in BOOK_NOTEBOOKS])
def test_committed_notebook_holds_no_widget(notebook: Path):
    """An ipywidgets widget stored in a chapter (its output, or its state in the metadata) makes
    its page load the widget manager from a CDN, and draws nothing offline."""
    problems = widget_problems(json.loads(notebook.read_text()))
    assert not problems, (
        f"{_rel(notebook)} holds ipywidgets widgets:\n  " + "\n  ".join(problems)
        + f"\nStore its outputs again with plain-text progress bars: {REFRESH_OUTPUTS.format(nb=_rel(notebook))}"
        + "\n(and remove the notebook metadata key 'widgets')"
    )


# ---------------------------------------------------------------------------------------------
# one repository address


GITHUB_REPO = re.compile(r"https://github\.com/[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+")


def test_repository_address_is_written_once():
    """The README and every notebook name the repository of `_config.yml`, and no other one."""
    assert GITHUB_REPO.fullmatch(REPO_URL), f"_config.yml repository.url: expected https://github.com/owner/name, got {REPO_URL!r}"
    readme = (REPO / "README.md").read_text()
    assert "REPO_URL" not in readme, "README.md still has the REPO_URL placeholder"
    assert f"{REPO_URL}@{REPO_BRANCH}" in readme, f"README.md's Colab instructions do not install from {REPO_URL}@{REPO_BRANCH}"
    files = [REPO / "README.md", *sorted((REPO / "book").rglob("*.md")), *BOOK_NOTEBOOKS, *EXERCISE_NOTEBOOKS]
    for f in files:
        for url in GITHUB_REPO.findall(f.read_text()):
            assert url.removesuffix(".git") == REPO_URL, f"{_rel(f)} names {url}, but _config.yml's repository is {REPO_URL}"


def _setup_cell_case(nb: Path):
    return pytest.param(nb, id=_rel(nb))


@pytest.mark.parametrize("notebook", [_setup_cell_case(nb) for nb in [*BOOK_NOTEBOOKS, *EXERCISE_NOTEBOOKS]])
def test_notebook_starts_with_the_colab_setup_cell(notebook: Path):
    nb = json.loads(notebook.read_text())
    assert has_setup_cell(nb, REPO_URL, REPO_BRANCH), (
        f"{_rel(notebook)} does not start with the Colab set-up cell rendered from _config.yml's repository "
        f"({REPO_URL}@{REPO_BRANCH}); write it with:\n    python -m gptlab.notebook_setup {_rel(notebook)}"
    )


def test_setup_cell_is_plain_python_and_idle_off_colab():
    """Graders exec notebook cells as plain Python: the cell must run there and do nothing."""
    import subprocess
    import sys

    source = render_setup_source(REPO_URL, REPO_BRANCH)
    assert "!" not in "".join(line.split("#")[0] for line in source.splitlines()), "no IPython ! magics"
    compile(source, "<setup cell>", "exec")
    # off Colab: runs, prints nothing, starts no pip
    r = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", (r.stdout, r.stderr)
    # on Colab: run the cell with stand-ins for `subprocess` and for `sys` (whose modules hold a
    # `google.colab`); pip installs gptlab[hf] from the repository, then fetch runs
    import builtins
    import types

    calls: list[list[str]] = []
    fake_subprocess = types.SimpleNamespace(run=lambda args, check: calls.append(list(args)))
    fake_sys = types.SimpleNamespace(executable=sys.executable, modules={**sys.modules, "google.colab": types.ModuleType("google.colab")})
    fakes = {"subprocess": fake_subprocess, "sys": fake_sys}

    def fake_import(name, *args, **kwargs):
        return fakes[name] if name in fakes else builtins.__import__(name, *args, **kwargs)

    exec(compile(source, "<setup cell>", "exec"), {"__builtins__": {**vars(builtins), "__import__": fake_import}})
    assert calls == [
        [sys.executable, "-m", "pip", "install", "--quiet", f"gptlab[hf] @ git+{REPO_URL}@{REPO_BRANCH}"],
        [sys.executable, "-m", "gptlab", "fetch"],
    ], calls


# ---------------------------------------------------------------------------------------------
# the build


def _scripts(html: str) -> list[str]:
    return re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", html)


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


@pytest.mark.slow
def test_book_builds_offline_without_warnings(book: BookBuild):
    book.check()
    html = book.html
    assert (html / "index.html").is_file()

    intro = (html / "book" / "intro.html").read_text()
    intro_text = _text(intro)
    for text in ("Build a GPT from scratch", "Causal masks", "The KV cache", "Speculative decoding", "make book"):
        assert text in intro_text, f"the intro page does not show {text!r}"
    assert 'class="math' in intro, "the intro's formulas were not turned into math"

    setup = _text((html / "book" / "setup_check.html").read_text())
    assert "verified" in setup and "ln(65)" in setup, "setup_check was not executed into the page"
    assert "cache folder: ~/" in setup or "cache folder: $GPTLAB_CACHE" in setup, "setup_check shows no cache folder"

    pages = sorted(html.rglob("*.html"))
    assert pages
    outside = {}
    for page in pages:
        source = page.read_text()
        name = page.relative_to(html).as_posix()
        if foreign_resources(source):
            outside[name] = foreign_resources(source)
        for kind in (WIDGET_VIEW, WIDGET_STATE):
            assert kind not in source, f"{name} holds an ipywidgets widget ({kind}): it draws nothing offline"
        assert "THEBE_JS_URL" not in source, f"{name} still carries sphinx-thebe's script"
        # pydata-sphinx-theme's top bar (its <header> stays, empty, taking no room)
        assert "bd-header__inner" not in source, f"{name} has the extra top bar with a second search field"
    assert not outside, "pages load resources from other hosts (scripts, styles, images, ...):\n" + "\n".join(
        f"  {name}: {', '.join(urls)}" for name, urls in outside.items())
    assert "_static/gptlab.css" in intro, "the local style fixes (_static/gptlab.css) are not loaded"
    mathjax = [s for s in _scripts(intro) if "mathjax" in s.lower()]
    assert mathjax, "the intro page loads no MathJax at all"
    for src in mathjax:
        local = (html / "book" / src.split("?")[0]).resolve()
        assert local.is_file(), f"MathJax script {src} is not in the built site"
    fonts = list((html / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").glob("*.woff"))
    assert fonts, "MathJax's CHTML fonts are missing from the built site"


@pytest.mark.slow
@pytest.mark.parametrize("notebook", BOOK_NOTEBOOKS, ids=[_rel(p) for p in BOOK_NOTEBOOKS])
def test_notebook_page_offers_download_and_colab(book: BookBuild, notebook: Path):
    book.check()
    rel = notebook.relative_to(REPO)
    page = (book.html / rel.with_suffix(".html")).read_text()
    colab = f"https://colab.research.google.com/github/{REPO_URL.removeprefix('https://github.com/')}/blob/{REPO_BRANCH}/{rel.as_posix()}"
    assert f'href="{colab}"' in page, f"{rel}: no launch button to {colab}"
    download = f"_sources/{rel.as_posix()}"
    assert re.search(rf'href="[./]*{re.escape(download)}"', page), f"{rel}: no download button for the notebook"
    assert (book.html / download).is_file(), f"{rel}: the notebook offered for download is not in the built site"


# ---------------------------------------------------------------------------------------------
# nbval-style check of the build's one execution


@pytest.mark.slow
@pytest.mark.parametrize("notebook", BOOK_NOTEBOOKS, ids=[_rel(p) for p in BOOK_NOTEBOOKS])
def test_notebook_outputs_match_the_build(book: BookBuild, notebook: Path):
    book.check()
    rel = notebook.relative_to(REPO)
    executed_path = book.executed / rel
    assert executed_path.is_file(), f"the build wrote no executed copy of {rel} ({executed_path})"
    committed, executed = json.loads(notebook.read_text()), json.loads(executed_path.read_text())
    by_id = {c.get("id"): c for c in executed["cells"] if c["cell_type"] == "code"}
    code_cells = [c for c in committed["cells"] if c["cell_type"] == "code"]
    assert len(by_id) == len(code_cells), f"{rel}: the executed copy has {len(by_id)} code cells, the notebook {len(code_cells)}"
    refresh = REFRESH_OUTPUTS.format(nb=rel.as_posix())
    widgets = widget_problems(executed)
    assert not widgets, (
        f"{rel}: the build's execution displayed ipywidgets widgets (a page holding one would load the widget "
        f"manager from a CDN, and draws nothing offline):\n  " + "\n  ".join(widgets)
        + f"\nThe build must run with {BOOK_ENV} (tests/_book_build.py, the Makefile's BOOK_ENV): gptlab's bars "
        "(gptlab.progress.progress_bar) are then plain text; turn off any other library's tqdm.auto bar."
    )
    for i, cell in enumerate(code_cells):
        ran = by_id[cell["id"]]
        where = f"{rel}, code cell {i} (id {cell['id']!r})"
        errors = [o for o in ran["outputs"] if o["output_type"] == "error"]
        assert not errors, f"{where} raised {errors[0].get('ename')}: {errors[0].get('evalue')}"
        if ignored(cell):
            continue
        want, got = comparable(cell["outputs"]), comparable(ran["outputs"])
        assert got == want, (
            f"{where}: the output of the build's execution differs from the output stored in the notebook.\n"
            f"stored:   {want}\nexecuted: {got}\n"
            f"If the new output is right, store it: {refresh}\n"
            f"(a cell whose output depends on the machine gets the tag nbval-ignore-output)"
        )


# ---------------------------------------------------------------------------------------------
# publishing


def test_pages_workflow_builds_with_make_book_and_deploys_the_html():
    """.github/workflows/book.yml: on a push to main, `make book`, then _build/html to GitHub Pages."""
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "book.yml").read_text())
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads the key `on` as True
    assert on["push"]["branches"] == ["main"], on
    assert workflow["permissions"]["pages"] == "write" and workflow["permissions"]["id-token"] == "write"
    build, deploy = workflow["jobs"]["build"], workflow["jobs"]["deploy"]
    uses = [step.get("uses", "").split("@")[0] for step in build["steps"]]
    assert uses[:2] == ["actions/checkout", "actions/setup-python"], uses
    runs = [step["run"].strip() for step in build["steps"] if "run" in step]
    assert runs == ["make book"], f"the workflow must build with `make book` (the same build as a reader's), runs {runs}"
    upload = next(s for s in build["steps"] if s.get("uses", "").startswith("actions/upload-pages-artifact@"))
    assert upload["with"]["path"] == "_build/html"
    order = [s.get("uses", "") or s.get("run", "") for s in build["steps"]]
    assert order.index("make book") < order.index(upload["uses"]), "upload after the build"
    assert deploy["needs"] in ("build", ["build"])
    assert deploy["environment"]["name"] == "github-pages"
    assert [s["uses"].split("@")[0] for s in deploy["steps"]] == ["actions/deploy-pages"]
    for job in (build, deploy):
        for step in job["steps"]:
            if "uses" in step:
                assert re.fullmatch(r"actions/[a-z-]+@v\d+", step["uses"]), f"only official actions, pinned to a major version: {step['uses']}"


# ---------------------------------------------------------------------------------------------
# time: no cell over a minute


def cells_over_the_limit(times: list[dict], notebooks: dict[str, dict], limit: float = CELL_LIMIT_S) -> list[str]:
    """The cells of ``times`` (records of tests/_book_build.py's kernels) over ``limit`` seconds, named by
    notebook and code-cell index (``notebooks``: name -> notebook JSON). A cell is over when both its
    wall-clock and its CPU seconds are; a cell tagged LONG_TRAINING_TAG is exempt."""
    where: dict[str, list[tuple[str, int, list[str]]]] = {}
    for name, nb in notebooks.items():
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        for i, cell in enumerate(code):
            where.setdefault(source_sha256(cell["source"]), []).append((name, i, cell.get("metadata", {}).get("tags", [])))
    over = []
    for t in times:
        if min(t["seconds"], t["cpu_seconds"]) <= limit:
            continue
        places = where.get(t["sha256"], [])
        if places and all(LONG_TRAINING_TAG in tags for _, _, tags in places):
            continue
        named = "; ".join(f"{name}, code cell {i}" for name, i, _ in places) or f"a cell beginning {t['head']!r}"
        over.append(f"{named}: {t['seconds']:.0f} s (CPU time {t['cpu_seconds']:.0f} s)")
    return over


def _nb(*cells: tuple[str, list[str]]) -> dict:
    return {"cells": [{"cell_type": "code", "source": src, "metadata": {"tags": tags}} for src, tags in cells]}


def test_cells_over_the_limit_are_named_and_the_tag_exempts():
    nbs = {"book/a.ipynb": _nb(("fast()", []), ("train()", [LONG_TRAINING_TAG])),
           "book/b.ipynb": _nb(("slow()", []))}

    def rec(src, seconds, cpu):
        return {"sha256": source_sha256(src), "seconds": seconds, "cpu_seconds": cpu, "head": src}

    assert cells_over_the_limit([rec("fast()", 59, 100), rec("train()", 900, 1800)], nbs) == []
    assert cells_over_the_limit([rec("slow()", 61, 120)], nbs) == ["book/b.ipynb, code cell 0: 61 s (CPU time 120 s)"]
    assert cells_over_the_limit([rec("slow()", 300, 20)], nbs) == []  # waiting for a core: no computing
    assert cells_over_the_limit([rec("slow()", 61, 61)], nbs, limit=61) == []
    [unknown] = cells_over_the_limit([rec("other()", 70, 70)], nbs)
    assert "other()" in unknown


def test_a_kernel_under_the_build_environment_times_its_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The IPython start-up file of tests/_book_build.py records each cell, with its sha256, in a
    kernel started as the build starts them (nbclient, the environment inherited)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for name, value in timing_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    sources = ["import time\ntime.sleep(0.5)", "x = sum(range(10))"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    times = read_cell_times(tmp_path / "cell-times.jsonl")
    assert [t["sha256"] for t in times] == [source_sha256(s) for s in sources]
    assert times[0]["seconds"] >= 0.5 > times[0]["cpu_seconds"]
    assert len({t["pid"] for t in times}) == 1


@pytest.mark.slow
def test_no_cell_takes_more_than_a_minute(book: BookBuild):
    book.check()
    times = book.cell_times
    n_code = sum(c["cell_type"] == "code" for p in BOOK_NOTEBOOKS for c in json.loads(p.read_text())["cells"])
    assert len(times) >= n_code, f"the build timed {len(times)} cells, the book has {n_code} code cells"
    notebooks = {_rel(p): json.loads(p.read_text()) for p in BOOK_NOTEBOOKS}
    over = cells_over_the_limit(times, notebooks)
    assert not over, (
        f"cells of the book take more than {CELL_LIMIT_S} s (a learner's 2-core laptop must build the book; "
        f"only a cell tagged {LONG_TRAINING_TAG!r}, chapter 5's training, may):\n  " + "\n  ".join(over))
