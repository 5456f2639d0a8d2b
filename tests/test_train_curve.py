"""The training curve (gptlab.train.loop + gptlab.train.metrics): ``train_log.jsonl`` rows every
``log_interval`` steps (training loss, learning rate, gradient norm checked against a step done by
hand), evaluation rows at every ``eval_interval``, a whole-split final evaluation, exact resume of
the log, the two-panel plot, the recipes' evaluation points and the errors."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from gptlab.__main__ import main
from gptlab.data import get_batch
from gptlab.train.metrics import metrics_figure, read_train_log
from gptlab.train import RECIPES, Trainer, get_recipe, lr_at, read_metrics, train, val_windows

QUIET = dict(progress=False, num_threads=1)
LOG_KEYS = ("step", "train_loss", "lr", "grad_norm", "grad_norm_max", "clip_frac", "tokens")


def small(**kw):
    base = dict(max_steps=45, eval_interval=10, log_interval=5, eval_tokens=2048, **QUIET)
    base.update(kw)
    return get_recipe("tiny", **base)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short run: 45 steps, a log row every 5, an evaluation every 10 (and at 0 and 45)."""
    out = tmp_path_factory.mktemp("curve")
    cfg = small()
    torch_threads = torch.get_num_threads()
    t = Trainer(cfg, out)
    summary = t.fit()
    torch.set_num_threads(torch_threads)
    return cfg, out, t, summary


def test_log_rows_every_interval(run):
    cfg, out, t, _ = run
    log = read_train_log(out / "train_log.jsonl")
    assert log == t.log_rows and read_train_log(out) == log  # the file, the folder, the trainer agree
    assert [r["step"] for r in log] == [5, 10, 15, 20, 25, 30, 35, 40, 45]
    for r in log:
        assert set(LOG_KEYS) | {"elapsed_s"} <= set(r)
        assert all(math.isfinite(r[k]) for k in ("train_loss", "grad_norm", "grad_norm_max", "lr"))
        assert r["lr"] == lr_at(r["step"] - 1, cfg)  # the rate of the interval's last step
        assert r["tokens"] == r["step"] * cfg.batch_size * cfg.block_size
        assert 0 < r["grad_norm"] <= r["grad_norm_max"]
        assert 0.0 <= r["clip_frac"] <= 1.0 and (r["clip_frac"] * cfg.log_interval) % 1 == pytest.approx(0, abs=1e-6)
    assert all(b["elapsed_s"] >= a["elapsed_s"] for a, b in zip(log, log[1:]))
    losses = [r["train_loss"] for r in log]
    assert losses[0] > losses[-1] + 0.5  # it learns: from ~ln 65 = 4.17 toward 3
    assert sum(losses[5:]) / 4 < sum(losses[:4]) / 4
    assert losses[0] < math.log(65) + 0.2  # the first steps start near a uniform guess


def test_evaluation_rows_and_train_loss_agree_with_the_log(run):
    cfg, out, t, summary = run
    rows = read_metrics(out / "metrics.jsonl")
    assert rows == t.rows
    assert [r["step"] for r in rows] == [0, 10, 20, 30, 40, 45]
    assert all(r["val_tokens"] == 2048 // cfg.block_size * cfg.block_size for r in rows)
    by_step = {r["step"]: r for r in t.log_rows}
    for r in rows[1:-1]:  # the mean over 10 steps is the mean of the two 5-step log rows
        s = r["step"]
        assert r["train_loss"] == pytest.approx((by_step[s - 5]["train_loss"] + by_step[s]["train_loss"]) / 2, rel=1e-5)
    assert rows[-1]["train_loss"] == pytest.approx(by_step[45]["train_loss"], rel=1e-5)
    assert summary["evaluations"] == 6 and summary["val_tokens"] == rows[-1]["val_tokens"]


def _first_step_by_hand(t: Trainer) -> tuple[float, float]:
    """The first optimiser step's loss and total gradient norm, recomputed outside the Trainer from
    a copy of its initial weights and of its batch generator."""
    model = copy.deepcopy(t.model)
    g = torch.Generator()
    g.set_state(t.generator.get_state())
    x, y = get_batch(t.data.train, t.cfg.batch_size, t.cfg.block_size, generator=g)
    _, loss = model(x, y)
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), float(norm)


@pytest.mark.parametrize("grad_clip", [1.0, 0.05, None])
def test_grad_norm_is_the_total_norm_before_clipping(tmp_path, grad_clip):
    t = Trainer(small(max_steps=3, log_interval=1, grad_clip=grad_clip, save=False, plot=False), tmp_path)
    loss, norm = _first_step_by_hand(t)
    t.fit()
    first = t.log_rows[0]
    assert first["step"] == 1 and first["train_loss"] == pytest.approx(loss, rel=1e-5)
    assert first["grad_norm"] == pytest.approx(norm, rel=1e-5) and first["grad_norm_max"] == first["grad_norm"]
    if grad_clip is None:
        assert first["clip_frac"] is None
    else:
        assert first["clip_frac"] == float(norm > grad_clip)
    if grad_clip == 0.05:  # a tiny threshold clips every step
        assert all(r["clip_frac"] == 1.0 for r in t.log_rows)


def test_resume_gives_the_same_log(tmp_path, monkeypatch):
    cfg = small(max_steps=30, eval_interval=10, log_interval=4, dropout=0.1, plot=False)
    train(cfg, tmp_path / "a")
    train(cfg, tmp_path / "b", until=17)  # between two log rows: steps 17 is pending
    assert [r["step"] for r in read_train_log(tmp_path / "b")] == [4, 8, 12, 16]
    # a stale row past the checkpoint (as if written after the last save) is dropped on resume
    with open(tmp_path / "b" / "train_log.jsonl", "a") as f:
        f.write(json.dumps({"step": 20, "train_loss": 0.0}) + "\n")
    train(cfg, tmp_path / "b", resume=True)
    la, lb = read_train_log(tmp_path / "a"), read_train_log(tmp_path / "b")
    assert [r["step"] for r in lb] == [4, 8, 12, 16, 20, 24, 28, 30]
    assert [tuple(r[k] for k in LOG_KEYS) for r in la] == [tuple(r[k] for k in LOG_KEYS) for r in lb]
    # without the pending sums the row after the interruption differs (so the check above can fail)
    train(cfg, tmp_path / "c", until=17)
    state_file = tmp_path / "c" / "ckpt" / "train_state.json"
    state = json.loads(state_file.read_text())
    del state["log"]
    state_file.write_text(json.dumps(state))
    monkeypatch.setenv("GPTLAB_VERIFY_CHECKPOINTS", "0")  # the edit no longer matches the manifest's sha256
    train(cfg, tmp_path / "c", resume=True)
    lc = read_train_log(tmp_path / "c")
    assert lc[4]["step"] == 20 and lc[4]["train_loss"] != la[4]["train_loss"]
    assert [r[k] for r in lc[:4] for k in LOG_KEYS] == [r[k] for r in lb[:4] for k in LOG_KEYS]


def test_plot_draws_the_logged_curve_and_the_evaluations(run, tmp_path):
    cfg, out, t, _ = run
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = metrics_figure(t.rows, t.log_rows, grad_clip=cfg.grad_clip)
    loss_ax, norm_ax = fig.axes[:2]
    train_line, val_line = loss_ax.get_lines()[:2]
    assert list(train_line.get_xdata()) == [r["step"] for r in t.log_rows]
    assert list(train_line.get_ydata()) == [r["train_loss"] for r in t.log_rows]
    assert list(val_line.get_xdata()) == [0, 10, 20, 30, 40, 45] and val_line.get_marker() == "o"
    assert list(val_line.get_ydata()) == [r["val_loss"] for r in t.rows]
    assert list(norm_ax.get_lines()[0].get_ydata()) == [r["grad_norm"] for r in t.log_rows]
    lr_ax = fig.axes[2]
    assert list(lr_ax.get_lines()[0].get_ydata()) == [r["lr"] for r in t.log_rows]
    # an old run (metrics rows only) still plots, on one panel
    old = [{k: v for k, v in r.items() if k != "val_tokens"} for r in t.rows]
    fig_old = metrics_figure(old)
    assert len(fig_old.axes) == 1 and len(fig_old.axes[0].get_lines()) == 2


def test_final_evaluation_on_the_whole_split(tmp_path):
    cfg = small(max_steps=20, log_interval=10, final_eval_whole_split=True, plot=False)
    t = Trainer(cfg, tmp_path / "a")
    t.fit()
    whole = val_windows(t.data.val, cfg.block_size)[1].numel()
    assert [(r["step"], r["val_tokens"]) for r in t.rows] == [(0, 2048), (10, 2048), (20, whole)]
    assert t.rows[-1]["val_loss"] == pytest.approx(t.evaluate(whole_split=True), rel=1e-6)
    assert t.rows[-1]["val_loss"] != pytest.approx(t.evaluate(), rel=1e-6)  # a different set of tokens
    # the target is checked on the whole split only: a target the step-0 subset already meets
    # does not stop the run there...
    s = train(cfg.with_overrides(target_loss=10.0), tmp_path / "b")
    assert s["step"] == 20 and s["step_at_target"] == 20 and s["val_tokens"] == whole
    # ...while without the whole-split evaluation it does
    s = train(cfg.with_overrides(target_loss=10.0, final_eval_whole_split=False), tmp_path / "c")
    assert s["step"] == 0 and s["step_at_target"] == 0


def test_target_reached_logs_the_last_steps(tmp_path):
    train(small(max_steps=200, log_interval=7, target_loss=3.6, save=False, plot=False), tmp_path)
    rows, log = read_metrics(tmp_path / "metrics.jsonl"), read_train_log(tmp_path)
    assert rows[-1]["val_loss"] <= 3.6 and log[-1]["step"] == rows[-1]["step"] < 200


def test_every_recipe_draws_a_curve():
    for name, r in RECIPES.items():
        if name == "shakespeare-char-cpu-fast":  # the speed benchmark's variant: one evaluation, at the end
            assert r.eval_interval == r.max_steps and r.final_eval_whole_split
            continue
        evals = int(r.eval_at_start) + r.max_steps // r.eval_interval + int(r.max_steps % r.eval_interval > 0)
        assert evals >= 5, (name, evals)
        assert r.max_steps // r.log_interval >= 20, name
    cpu = RECIPES["shakespeare-char-cpu"]  # its claim is about the whole validation split
    assert cpu.final_eval_whole_split and cpu.max_steps % cpu.eval_interval == 0
    assert RECIPES["shakespeare-char"].eval_interval == 250  # nanoGPT's


def test_bad_log_interval_raises_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="log_interval must be >= 1, got 0"):
        get_recipe("tiny", log_interval=0)
    with pytest.raises(TypeError, match="log_interval"):
        get_recipe("tiny", log_interval=2.5)
    assert main(["train", "--recipe", "tiny", "--out", str(tmp_path), "--log-interval", "-3"]) == 2
    assert "log_interval must be >= 1" in capsys.readouterr().err


def test_cli_log_interval(tmp_path, capsys):
    rc = main(["train", "--recipe", "tiny", "--out", str(tmp_path), "--max-steps", "12", "--log-interval", "4",
               "--no-progress", "--num-threads", "1", "--set", "eval_tokens=2048", "--set", "eval_interval=6"])
    assert rc == 0
    assert "train_log.jsonl" in capsys.readouterr().out
    assert [r["step"] for r in read_train_log(tmp_path)] == [4, 8, 12]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 6, 12]
