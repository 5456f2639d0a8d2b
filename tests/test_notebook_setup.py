"""gptlab.notebook_setup: the one template of the notebooks' Colab set-up cell, and its writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptlab.notebook_setup import (
    SETUP_CELL_ID,
    has_setup_cell,
    main,
    render_setup_cell,
    render_setup_source,
    repository_from_config,
    write_setup_cell,
)

URL, OTHER = "https://github.com/example-org/course", "https://gitlab.com/someone/fork"


def _notebook(path: Path, cells: list[dict], minor: int = 5) -> Path:
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": minor}
    path.write_text(json.dumps(nb, sort_keys=True, indent=1) + "\n")
    return path


def _md(text: str, id: str = "md-1") -> dict:
    return {"cell_type": "markdown", "id": id, "metadata": {}, "source": [text]}


def _code(text: str, id: str = "code-1") -> dict:
    return {"cell_type": "code", "id": id, "metadata": {}, "execution_count": 1, "outputs": [], "source": [text]}


def test_source_names_the_repository_and_branch():
    source = render_setup_source(URL, "dev")
    assert f'"gptlab[hf] @ git+{URL}@dev"' in source
    assert '"google.colab" in sys.modules' in source
    assert "!" not in source  # no IPython magics
    cell = render_setup_cell(URL)
    assert cell["id"] == SETUP_CELL_ID and cell["cell_type"] == "code" and cell["outputs"] == []
    assert "".join(cell["source"]) == render_setup_source(URL, "main")


@pytest.mark.parametrize("url", ["http://github.com/a/b", "https://github.com/a/b/", "https://github.com/a/b.git",
                                 "github.com/a/b", "https://github.com/a/b x", "", None])
def test_bad_address_is_rejected(url):
    with pytest.raises(ValueError, match="repo_url"):
        render_setup_source(url)


@pytest.mark.parametrize("branch", ["", "-x", "main; rm", "a b"])
def test_bad_branch_is_rejected(branch):
    with pytest.raises(ValueError, match="branch"):
        render_setup_source(URL, branch)


def test_write_inserts_first_keeps_the_rest_and_is_idempotent(tmp_path: Path):
    path = _notebook(tmp_path / "ch.ipynb", [_md("# Title"), _code("x = 1")])
    assert write_setup_cell(path, URL) is True
    nb = json.loads(path.read_text())
    assert has_setup_cell(nb, URL) and not has_setup_cell(nb, OTHER)
    assert [c.get("id") for c in nb["cells"]] == [SETUP_CELL_ID, "md-1", "code-1"]
    before = path.read_text()
    assert write_setup_cell(path, URL) is False
    assert path.read_text() == before
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file left behind"


def test_write_replaces_an_old_cell_wherever_it_is(tmp_path: Path):
    old = render_setup_cell(OTHER)
    path = _notebook(tmp_path / "ch.ipynb", [_md("# Title"), old, _code("x = 1")])
    assert write_setup_cell(path, URL) is True
    nb = json.loads(path.read_text())
    assert has_setup_cell(nb, URL)
    assert sum(OTHER in "".join(c["source"]) for c in nb["cells"]) == 0
    assert len(nb["cells"]) == 3


def test_old_nbformat_gets_no_cell_id(tmp_path: Path):
    path = _notebook(tmp_path / "old.ipynb", [{"cell_type": "markdown", "metadata": {}, "source": ["# T"]}], minor=4)
    write_setup_cell(path, URL)
    nb = json.loads(path.read_text())
    assert "id" not in nb["cells"][0] and has_setup_cell(nb, URL)


def test_write_rejects_what_is_not_a_notebook(tmp_path: Path):
    with pytest.raises(ValueError, match=r"\.ipynb"):
        write_setup_cell(tmp_path / "notes.md", URL)
    bad = tmp_path / "v3.ipynb"
    bad.write_text(json.dumps({"nbformat": 3, "worksheets": []}))
    with pytest.raises(ValueError, match="nbformat 4"):
        write_setup_cell(bad, URL)


def test_command_line_reads_the_address_from_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = tmp_path / "_config.yml"
    config.write_text(f"title: t\nrepository:\n  url: {URL}\n  branch: trunk\n")
    assert repository_from_config(config) == (URL, "trunk")
    path = _notebook(tmp_path / "ch.ipynb", [_md("# Title")])
    assert main([str(path), "--config", str(config)]) == 0
    assert has_setup_cell(json.loads(path.read_text()), URL, "trunk")
    assert "updated" in capsys.readouterr().out
    (tmp_path / "empty.yml").write_text("title: t\n")
    with pytest.raises(ValueError, match="repository: url:"):
        repository_from_config(tmp_path / "empty.yml")
    with pytest.raises(FileNotFoundError, match="_config.yml"):
        repository_from_config(tmp_path / "missing.yml")
