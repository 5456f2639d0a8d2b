"""A training run's record: ``metrics.jsonl`` (one JSON object per evaluation) and its loss plot.

Where this sits: beside the training loop (:mod:`gptlab.train`), which writes them; the chapters
and benchmarks read them back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .files import atomic_path, atomic_write_text

__all__ = ["read_metrics", "write_metrics", "plot_metrics"]



def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a ``metrics.jsonl`` file (one dict per evaluation)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


def write_metrics(path: str | os.PathLike, rows: list[dict]) -> None:
    """Write ``rows`` (one dict per evaluation) as ``metrics.jsonl``, atomically."""
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def plot_metrics(rows: list[dict], path: str | os.PathLike, title: str | None = None) -> Path:
    """Plot train and validation loss against step into a PNG at ``path`` (written atomically).

    Uses matplotlib's Agg canvas directly, so it never changes the pyplot backend.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    steps = [r["step"] for r in rows]
    tr = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
    if tr:
        ax.plot([s for s, _ in tr], [v for _, v in tr], marker="o", ms=3, label="train")
    ax.plot(steps, [r["val_loss"] for r in rows], marker="o", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats / token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path
