"""gptlab's progress bars (gptlab.progress): a widget in a notebook, plain text with GPTLAB_PROGRESS=text.

The book is built with GPTLAB_PROGRESS=text (Makefile's BOOK_ENV, tests/_book_build.py): a bar
displayed as an ipywidgets widget would make its page load the widget manager from a CDN. The
last test runs a real kernel, as the book build does, and looks at what it stores.
"""

from __future__ import annotations

import io
import json

import pytest
import tqdm.auto
import tqdm.std

from _offline import widget_problems
from gptlab.progress import PROGRESS_ENV, TEXT_MININTERVAL_S, progress_bar, progress_mode


def test_auto_is_tqdm_auto_and_text_is_plain_tqdm(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    assert progress_mode() == "auto"
    with progress_bar(total=3, file=io.StringIO()) as bar:
        assert type(bar) is tqdm.auto.tqdm
    for value in ("text", " TEXT "):
        monkeypatch.setenv(PROGRESS_ENV, value)
        assert progress_mode() == "text"
        out = io.StringIO()
        with progress_bar(total=3, desc="train", unit="step", file=out) as bar:
            assert type(bar) is tqdm.std.tqdm
            bar.update(3)
        assert "train: 100%" in out.getvalue() and "3/3" in out.getvalue()
    monkeypatch.setenv(PROGRESS_ENV, "")
    assert progress_mode() == "auto"


def test_text_bars_refresh_rarely_off_a_terminal(monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "text")
    with progress_bar(total=3, file=io.StringIO()) as bar:  # a log, a notebook's output
        assert bar.mininterval == TEXT_MININTERVAL_S and bar.maxinterval >= TEXT_MININTERVAL_S
    with progress_bar(total=3, file=io.StringIO(), mininterval=0.5) as bar:  # asked for
        assert bar.mininterval == 0.5

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    with progress_bar(total=3, file=Terminal()) as bar:  # updated in place: tqdm's default
        assert bar.mininterval == 0.1


def test_an_unknown_mode_is_an_error(monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "widget")
    with pytest.raises(ValueError, match="GPTLAB_PROGRESS='widget'.*auto, text"):
        progress_bar(total=1)


def test_the_trainers_bar_in_text_mode(monkeypatch, capsys, tmp_path):
    """Trainer.fit's bar with GPTLAB_PROGRESS=text, written to a log (not a terminal): its first
    and its last state, not one line per refresh (the loss and learning rate shown every 10 steps
    wait for the next refresh)."""
    import torch

    from gptlab.train import Trainer, get_recipe

    monkeypatch.setenv(PROGRESS_ENV, "text")
    n = torch.get_num_threads()
    try:
        cfg = get_recipe("tiny", max_steps=30, eval_interval=10, eval_tokens=2048, progress=True, num_threads=1,
                         save=False, plot=False)
        trainer = Trainer(cfg, tmp_path)
        trainer.fit()
        trainer.close()
    finally:
        torch.set_num_threads(n)
    states = [s for s in capsys.readouterr().err.replace("\n", "\r").split("\r") if s.strip()]
    assert len(states) <= 3 and states[0].startswith("train:   0%") and "30/30" in states[-1], states
    assert "val=" in states[-1] and "loss=" in states[-1], states


@pytest.mark.slow
def test_in_a_kernel_text_mode_stores_no_widget(monkeypatch, tmp_path):
    """A notebook executed as the book build executes it (nbclient, a python3 kernel): by default
    the bar is an ipywidgets widget (what a learner in Jupyter or Colab sees); with
    GPTLAB_PROGRESS=text it is plain text on stderr, and the notebook holds no widget."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipywidgets")

    code = ("from gptlab.progress import progress_bar\n"
            "with progress_bar(total=5, desc='train', unit='step') as bar:\n"
            "    for _ in range(5):\n"
            "        bar.update(1)\n")

    def run(mode: str | None) -> dict:
        if mode is None:
            monkeypatch.delenv(PROGRESS_ENV, raising=False)
        else:
            monkeypatch.setenv(PROGRESS_ENV, mode)
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        # jupyter_client starts the python3 kernel with this interpreter (the venv's)
        nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
        return json.loads(nbformat.writes(nb))

    widget = run(None)
    assert any("displays an ipywidgets widget" in p for p in widget_problems(widget)), widget["cells"][0]["outputs"]
    text = run("text")
    assert widget_problems(text) == []
    stderr = "".join("".join(o["text"]) for o in text["cells"][0]["outputs"] if o.get("name") == "stderr")
    assert "train: 100%" in stderr and "5/5" in stderr, text["cells"][0]["outputs"]
