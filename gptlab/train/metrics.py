"""A training run's record: ``metrics.jsonl``, ``train_log.jsonl`` and the loss plot.

Where this sits: beside the training loop (:mod:`gptlab.train.loop`), which writes them; the chapters
and benchmarks read them back. Both files are JSON Lines, one object per line:

* ``metrics.jsonl``, one row per evaluation: ``step``, ``train_loss`` (mean training loss since
  the previous evaluation; at step 0 the loss of one fixed batch), ``val_loss`` (cross-entropy in
  nats/token over ``val_tokens`` validation tokens), ``lr``, ``tokens``, ``elapsed_s``, ``eval_s``;
* ``train_log.jsonl``, one row every ``log_interval`` optimiser steps (and at the last step):
  ``step``, ``train_loss`` (mean over the steps since the previous row), ``lr`` (of the last of
  them), ``grad_norm`` and ``grad_norm_max`` (mean and max over them of the total gradient norm
  before clipping), ``clip_frac`` (the fraction of them that were clipped; None without
  clipping), ``tokens``, ``elapsed_s``.

:class:`TrainLog` keeps the running sums of the current ``train_log.jsonl`` interval and makes its
row; :func:`append_jsonl` adds a row to either file, :func:`write_metrics` rewrites one.
:func:`read_metrics` and :func:`read_train_log` read them (:func:`read_jsonl_torn` also reads a
file whose last line a crash cut short, for resuming); :func:`metrics_figure` draws both
(:func:`plot_metrics` writes it as ``loss.png``). Runs older than ``train_log.jsonl`` plot from
their metrics rows alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..files import atomic_path, atomic_write_text
from ..progress import progress_bar

__all__ = ["TrainLog", "append_jsonl", "read_metrics", "read_train_log", "read_jsonl_torn", "write_metrics",
           "reaches_target", "run_summary", "TrainBar", "metrics_figure", "plot_metrics"]


def _checked_row(row: Any, path: str | os.PathLike, line: int) -> dict:
    """A row of ``metrics.jsonl`` / ``train_log.jsonl``: a JSON object with an integer ``step``;
    anything else raises ``ValueError`` naming the file and the line."""
    if not isinstance(row, dict):
        raise ValueError(f"{path}, line {line}: not a JSON object, got {type(row).__name__} {row!r:.80}")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        got = "no \"step\"" if "step" not in row else f"\"step\": {json.dumps(step)}"
        raise ValueError(f"{path}, line {line}: every row needs the integer step it was written at "
                         f"(\"step\": 50), got {got}")
    return row


def _read_jsonl(path: str | os.PathLike) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}, line {i}: not a JSON object ({e})") from e
                rows.append(_checked_row(row, path, i))
    return rows


def read_jsonl_torn(path: str | os.PathLike) -> tuple[list[dict], int]:
    """The rows of a JSON Lines file whose last line may be torn, and the bytes dropped.

    A process killed while appending a row (:func:`append_jsonl`) leaves a partial last line (or,
    on some file systems, one of NUL bytes): that line, if it is not a JSON object, is dropped and
    its length in bytes returned. A bad line before the last one still raises ``ValueError``:
    that is damage, not an interrupted append; so does a row without an integer ``step`` (both
    name the file and the line). Returns ``(rows, dropped_bytes)``.
    """
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    rows: list[dict] = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError) as e:
            if i == last:
                return rows, len(data) - sum(len(x) + 1 for x in lines[:i])
            raise ValueError(f"{path}, line {i + 1}: not a JSON object ({e})") from e
        rows.append(_checked_row(row, path, i + 1))
    return rows, 0


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a ``metrics.jsonl`` file (one dict per evaluation); a line that is not a JSON
    object with an integer ``step`` raises ``ValueError`` naming the file and the line."""
    return _read_jsonl(path)


def read_train_log(path: str | os.PathLike) -> list[dict]:
    """The rows of a ``train_log.jsonl`` file (one dict every ``log_interval`` steps; fields in the
    module docstring). ``path`` may also be the run folder."""
    p = Path(path)
    return _read_jsonl(p / "train_log.jsonl" if p.is_dir() else p)


def write_metrics(path: str | os.PathLike, rows: list[dict]) -> None:
    """Write ``rows`` (dicts) as a JSON Lines file such as ``metrics.jsonl``, atomically."""
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    """Append ``row`` as one line of a JSON Lines file such as ``metrics.jsonl``."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


class TrainLog:
    """The running sums behind one ``train_log.jsonl`` row: the optimiser steps since the previous row.

    ``TrainLog(device, grad_clip)``; :meth:`add` each step's loss and gradient norm (0-d tensors),
    :meth:`pop_row` makes the row and starts a new interval. The sums (``sums``: ``loss_sum``,
    ``norm_sum``, ``norm_max``, ``clipped``) are 0-d float32 tensors on ``device``, so adding a
    step never waits for the GPU; ``n`` counts the steps. :meth:`state_dict` /
    :meth:`load_state_dict` carry an unfinished interval through a checkpoint, so that a resumed
    run writes the same rows as an uninterrupted one.
    """

    KEYS = ("loss_sum", "norm_sum", "norm_max", "clipped")

    def __init__(self, device: torch.device | str = "cpu", grad_clip: float | None = None):
        self.grad_clip = grad_clip
        self.sums = {k: torch.zeros((), device=device) for k in self.KEYS}
        self.n = 0

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Add one optimiser step: its loss and its total gradient norm before clipping (0-d tensors)."""
        s = self.sums
        s["loss_sum"] += loss.float()
        norm = grad_norm.detach().float()
        s["norm_sum"] += norm
        torch.maximum(s["norm_max"], norm, out=s["norm_max"])
        if self.grad_clip is not None:
            s["clipped"] += (norm > self.grad_clip).float()
        self.n += 1

    def pop_row(self, *, step: int, lr: float, tokens: int, clock: Callable[[], float],
                mean: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
        """The interval's ``train_log.jsonl`` row, and reset the sums for the next one.

        ``train_loss`` is the mean loss of the interval's steps (its sum first passed through
        ``mean``, e.g. the mean over DDP processes), ``grad_norm`` / ``grad_norm_max`` the mean /
        max norm, ``clip_frac`` the fraction of steps whose norm exceeded ``grad_clip`` (None
        without clipping); ``step``, ``lr`` and ``tokens`` are the caller's, and ``elapsed_s`` is
        ``clock()`` (the run's seconds so far, rounded to 0.1 ms), called once the sums are read:
        on a GPU, after the queued steps have run. Needs at least one step since the previous row.
        """
        n, s = self.n, self.sums
        if n < 1:
            raise ValueError("TrainLog.pop_row: no step was added since the previous row")
        loss_sum = s["loss_sum"] if mean is None else mean(s["loss_sum"])
        row = {
            "step": step,
            "train_loss": float(loss_sum.item()) / n,
            "lr": lr,
            "grad_norm": float(s["norm_sum"].item()) / n,
            "grad_norm_max": float(s["norm_max"].item()),
            "clip_frac": float(s["clipped"].item()) / n if self.grad_clip is not None else None,
            "tokens": tokens,
            "elapsed_s": round(clock(), 4),
        }
        for v in s.values():
            v.zero_()
        self.n = 0
        return row

    def state_dict(self) -> dict:
        """The unfinished interval as plain numbers: ``{"loss_sum", "norm_sum", "norm_max", "clipped", "n"}``."""
        return {**{k: float(v.item()) for k, v in self.sums.items()}, "n": self.n}

    def load_state_dict(self, state: dict) -> None:
        """Continue the interval saved by :meth:`state_dict`."""
        device = self.sums["loss_sum"].device
        self.sums = {k: torch.tensor(float(state[k]), dtype=torch.float32, device=device) for k in self.KEYS}
        self.n = int(state["n"])


def reaches_target(row: dict, target_loss: float | None, whole_tokens: int | None = None) -> bool:
    """Whether a ``metrics.jsonl`` row's val loss counts for ``target_loss`` and is at or below it;
    with ``whole_tokens`` (``final_eval_whole_split``) only a row scored on that many tokens counts."""
    if target_loss is None or row["val_loss"] > target_loss:
        return False
    return whole_tokens is None or row["val_tokens"] == whole_tokens


def run_summary(rows: list[dict], *, step: int, max_steps: int, elapsed: float, eval_s: float, tokens: int,
                resumed: bool, target_loss: float | None, counts: Callable[[dict], bool], **run: Any) -> dict:
    """What :func:`gptlab.train.train` returns: the run's last and best evaluations (``rows``), its
    clock, tokens and throughput (None for a resumed run: its clock started elsewhere), when it
    first reached ``target_loss`` (the first row that ``counts``), then the facts ``run`` gives
    (params, device, folders, ...), in that order."""
    first = next((r for r in rows if counts(r)), None)
    last = rows[-1] if rows else {}
    # best over the evaluations that scored the same tokens as the last one
    same = [r["val_loss"] for r in rows if r.get("val_tokens") == last.get("val_tokens")]
    train_time = elapsed - eval_s
    return {
        "step": step,
        "max_steps": max_steps,
        "val_loss": last.get("val_loss"),
        "train_loss": last.get("train_loss"),
        "best_val_loss": min(same, default=None),
        "val_tokens": last.get("val_tokens"),
        "evaluations": len(rows),
        "elapsed_s": elapsed,
        "eval_s": eval_s,
        "tokens": tokens,
        "tokens_per_s": tokens / train_time if train_time > 0 and not resumed else None,
        "target_loss": target_loss,
        "time_to_target_s": first["elapsed_s"] if first else None,
        "step_at_target": first["step"] if first else None,
        **run,
    }


class TrainBar:
    """A run's progress bar: shown on rank 0 with ``progress`` (a widget in a notebook, plain text
    with ``GPTLAB_PROGRESS=text``, the book build), each method a no-op otherwise."""

    def __init__(self, show: bool, total: int, initial: int):
        self.bar = (progress_bar(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
                    if show else None)

    def stepped(self, step: int, stop: int, loss: torch.Tensor, lr: float) -> None:
        """One step more; every 10 steps (and at ``stop``) its loss and learning rate."""
        if self.bar is not None:
            self.bar.update(1)
            if step % 10 == 0 or step == stop:
                self.bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{lr:.2e}", refresh=False)

    def evaluated(self, row: dict, lr: float) -> None:
        """An evaluation's ``metrics.jsonl`` row: its train and val loss."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['train_loss']:.4f}", val=f"{row['val_loss']:.4f}", lr=f"{lr:.2e}",
                                 refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def metrics_figure(rows: list[dict], log_rows: list[dict] | None = None, title: str | None = None,
                   grad_clip: float | None = None):
    """A matplotlib ``Figure`` of a run: losses against step, and with ``log_rows`` a second panel.

    Top panel: the logged training loss (``log_rows``) as a line, or without them the training
    loss of the evaluation rows; the validation losses (``rows``) as markers, one series per
    number of validation tokens scored (a subset and the whole split are different estimates).
    Bottom panel (only with ``log_rows``): the gradient norm before clipping (mean per logged
    interval, log scale, the ``grad_clip`` threshold dotted) and, on a right-hand axis, the
    learning rate.
    Drawn on matplotlib's Agg canvas directly: the pyplot backend is never changed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    log_rows = log_rows or []
    fig = Figure(figsize=(6.4, 6.0 if log_rows else 4.0), dpi=100)
    FigureCanvasAgg(fig)
    if log_rows:
        ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    else:
        ax, ax2 = fig.add_subplot(1, 1, 1), None
    if log_rows:
        ax.plot([r["step"] for r in log_rows], [r["train_loss"] for r in log_rows], lw=1.2,
                label="train (mean per logged interval)")
    else:
        tr = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
        if tr:
            ax.plot([s for s, _ in tr], [v for _, v in tr], marker="o", ms=3, label="train")
    sizes = list(dict.fromkeys(r.get("val_tokens") for r in rows))
    for n in sizes:
        sel = [r for r in rows if r.get("val_tokens") == n]
        label = "validation" if len(sizes) == 1 or n is None else f"validation ({n:,} tokens)"
        ax.plot([r["step"] for r in sel], [r["val_loss"] for r in sel], ls="--" if log_rows else "-",
                marker="o" if n == sizes[0] else "s", ms=4, label=label)
    ax.set_ylabel("cross-entropy (nats / token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    last = ax
    if ax2 is not None:
        steps = [r["step"] for r in log_rows]
        ax2.plot(steps, [r["grad_norm"] for r in log_rows], color="C3", lw=1.0, label="gradient norm")
        if grad_clip is not None:
            ax2.axhline(grad_clip, color="C3", ls=":", lw=1.0, label=f"clip at {grad_clip:g}")
        ax2.set_yscale("log")  # early spikes are orders of magnitude above the rest
        plain = FuncFormatter(lambda v, _pos: f"{v:g}")
        ax2.yaxis.set_major_formatter(plain)
        ax2.yaxis.set_minor_formatter(plain)
        ax2.tick_params(axis="y", which="minor", labelsize="x-small")
        ax2.set_ylabel("gradient norm", color="C3")
        ax2.grid(alpha=0.3)
        ax_lr = ax2.twinx()
        ax_lr.plot(steps, [r["lr"] for r in log_rows], color="C2", lw=1.0, label="learning rate")
        ax_lr.set_ylabel("learning rate", color="C2")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        h1, l1 = ax2.get_legend_handles_labels()
        h2, l2 = ax_lr.get_legend_handles_labels()
        ax2.legend(h1 + h2, l1 + l2, fontsize="small", loc="upper right")
        last = ax2
    last.set_xlabel("optimiser step")
    fig.tight_layout()
    return fig


def plot_metrics(rows: list[dict], path: str | os.PathLike, title: str | None = None, *,
                 log_rows: list[dict] | None = None, grad_clip: float | None = None) -> Path:
    """Write :func:`metrics_figure` of ``rows`` (and ``log_rows``) as a PNG at ``path``, atomically."""
    path = Path(path)
    fig = metrics_figure(rows, log_rows, title=title, grad_clip=grad_clip)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path
