"""A training run's folder (gptlab.train, gptlab.files): nothing lost, nothing silently wrong.

Training into a folder that holds a run refuses unless --resume or --overwrite (which keeps the
earlier run aside until the new one's first checkpoint, and puts it back if the new run stops
before); one process at a time (a lock file with pid and host; a dead owner's lock is taken over);
SIGINT / SIGTERM save a checkpoint at the current step and exit 130 / 143 with the resume command;
--resume without a checkpoint refuses; a torn last line of metrics.jsonl is dropped on resume;
temporary folders left by a killed save are removed at the next save. The same faults injected
into real processes (kill -9 at random points): tests/test_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptlab import files
from gptlab.__main__ import main
from gptlab.train import (LOCK_FILE, LockError, RunFolderError, Trainer, TrainingInterrupted, get_recipe,
                          overwrite_backup, read_metrics, train)
from gptlab.train.run_folder import set_run_aside


def small(**kw):
    """The tiny recipe, a few steps."""
    base = dict(max_steps=12, eval_interval=6, eval_tokens=2048, progress=False, num_threads=1, plot=False)
    base.update(kw)
    return get_recipe("tiny", **base)


CLI = ["--recipe", "tiny", "--max-steps", "12", "--eval-interval", "6", "--no-progress", "--num-threads", "1",
       "--set", "eval_tokens=2048", "--set", "plot=false"]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name -> bytes), the lock file aside."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def signal_at_step(monkeypatch, step: int, signum: int = signal.SIGINT, times: int = 1) -> None:
    """Send ``signum`` to this process ``times`` times right after optimiser step ``step``."""
    original = Trainer.optimizer_step

    def step_then_signal(self, lr):
        norm = original(self, lr)
        if self.step + 1 == step:  # self.step counts after the call
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return norm

    monkeypatch.setattr(Trainer, "optimizer_step", step_then_signal)


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------ an existing run


def test_a_new_run_into_a_run_folder_is_refused_and_the_run_kept(tmp_path, capsys):
    out = tmp_path / "run"
    train(small(), out)
    before = snapshot(out)
    with pytest.raises(RunFolderError, match=r"already holds a training run .*--resume.*--overwrite"):
        train(small(seed=2), out)
    rc = main(["train", *CLI, "--out", str(out), "--seed", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "--resume" in err and "--overwrite" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert snapshot(out) == before  # nothing rewritten, not even metrics.jsonl
    # a folder with metrics.jsonl alone (a run stopped before its first checkpoint) is a run too
    only = tmp_path / "only-metrics"
    only.mkdir()
    (only / "metrics.jsonl").write_text('{"step": 0, "val_loss": 4.2}\n')
    with pytest.raises(RunFolderError, match="already holds"):
        train(small(), only)
    with pytest.raises(RunFolderError, match="exclude each other"):
        train(small(), only, resume=True, overwrite=True)
    # an empty or missing folder is a new run
    (tmp_path / "empty").mkdir()
    train(small(max_steps=1), tmp_path / "empty")


def test_overwrite_keeps_the_earlier_run_until_the_first_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    train(small(), out)
    old = snapshot(out)
    backup = overwrite_backup(out)
    seen = []
    original = Trainer.save

    def save(self):
        seen.append(json.loads((backup / "overwritten.json").read_text())["entries"] if backup.exists() else None)
        original(self)

    monkeypatch.setattr(Trainer, "save", save)
    train(small(seed=2, checkpoint_interval=5), out, overwrite=True)
    assert seen[0] == ["ckpt", "metrics.jsonl", "train_log.jsonl"] and seen[1:] == [None, None]
    assert not backup.exists() and not backup.with_name(backup.name + ".delete").exists()
    new = snapshot(out)
    assert new["ckpt/model.safetensors"] != old["ckpt/model.safetensors"]
    assert json.loads((out / "ckpt" / "train_state.json").read_text())["config"]["seed"] == 2
    # the command line: --overwrite replaces, exit 0
    assert main(["train", *CLI, "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "ckpt" / "train_state.json").read_text())["config"]["seed"] == 1337
    assert not backup.exists()


def test_overwrite_puts_the_earlier_run_back_when_the_new_one_fails(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    train(small(), out)
    old = snapshot(out)
    original = Trainer.optimizer_step

    def failing(self, lr):
        if self.step == 3:
            raise RuntimeError("the new run breaks at step 3")
        return original(self, lr)

    monkeypatch.setattr(Trainer, "optimizer_step", failing)
    with pytest.raises(RuntimeError, match="breaks at step 3"):
        train(small(seed=2), out, overwrite=True)
    assert snapshot(out) == old and not overwrite_backup(out).exists()
    assert "put back the earlier run" in capsys.readouterr().err
    assert not (out / LOCK_FILE).exists()  # released on an exception too
    # Ctrl-C before the new run's first step: the earlier run comes back, nothing saved
    monkeypatch.setattr(Trainer, "optimizer_step", original)
    signal_at_step(monkeypatch, 0)  # never reached: the signal comes during the step-0 evaluation
    evaluate = Trainer.evaluate

    def evaluate_then_signal(self, whole_split=False):
        os.kill(os.getpid(), signal.SIGINT)
        return evaluate(self, whole_split)

    monkeypatch.setattr(Trainer, "evaluate", evaluate_then_signal)
    with pytest.raises(TrainingInterrupted, match="before its first step") as e:
        train(small(seed=2), out, overwrite=True)
    assert e.value.checkpoint is None and e.value.exit_code == 130
    assert snapshot(out) == old and not overwrite_backup(out).exists()


def test_an_overwrite_killed_before_its_first_save_is_undone(tmp_path, capsys):
    """As a kill -9 leaves it: the earlier run set aside, the new run's first logs written."""
    out = tmp_path / "run"
    train(small(max_steps=6), out)
    old = snapshot(out)
    backup = set_run_aside(out)
    (out / "metrics.jsonl").write_text('{"step": 0, "val_loss": 9.9}\n')
    summary = train(small(), out, resume=True)  # continues the earlier run from its step 6
    assert "put back the earlier run" in capsys.readouterr().err
    assert not backup.exists() and summary["step"] == 12
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 6, 12]
    assert read_metrics(out / "metrics.jsonl")[:2] == [json.loads(x) for x in old["metrics.jsonl"].splitlines()]


# ------------------------------------------------------------------------------------ --resume


def test_resume_needs_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", *CLI, "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "holds no checkpoint" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "val_loss": 4.2}\n')
    with pytest.raises(RunFolderError, match="no checkpoint .*--overwrite"):
        train(small(), out, resume=True)
    assert main(["train", *CLI, "--out", str(out), "--resume"]) == 2
    assert (out / "metrics.jsonl").read_text() == '{"step": 0, "val_loss": 4.2}\n'


# ------------------------------------------------------------------------------------ the lock


def test_a_second_process_is_refused_while_the_lock_is_held(tmp_path, capsys):
    out = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out.mkdir()
        (out / LOCK_FILE).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(), "since": "now"}))
        with pytest.raises(LockError, match=rf"in use by another training run \(pid {other.pid}"):
            train(small(), out)
        assert main(["train", *CLI, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"pid {other.pid}" in err and LOCK_FILE in err and len(err.strip().splitlines()) == 1
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written
    finally:
        other.kill()
        other.wait()
    # its process is gone now: the lock is stale and taken over, with a note
    train(small(), out)
    assert "took over the stale lock" in capsys.readouterr().err
    assert not (out / LOCK_FILE).exists()  # released at the end
    # a lock of another machine cannot be checked: refused
    (out / LOCK_FILE).write_text(json.dumps({"pid": dead_pid(), "host": "elsewhere", "since": "now"}))
    with pytest.raises(LockError, match="elsewhere"):
        train(small(max_steps=14), out, resume=True)


def test_lock_folder_is_exclusive_and_released(tmp_path):
    lock = files.lock_folder(tmp_path, "x.lock", purpose="test")
    assert json.loads((tmp_path / "x.lock").read_text())["pid"] == os.getpid()
    with pytest.raises(LockError, match="in use"):
        files.lock_folder(tmp_path, "x.lock")  # this same process: still refused
    lock.release()
    lock.release()  # idempotent
    assert not (tmp_path / "x.lock").exists()
    (tmp_path / "x.lock").write_text("")  # a creator killed between creating and writing it
    old = os.stat(tmp_path / "x.lock").st_mtime - 60
    os.utime(tmp_path / "x.lock", (old, old))
    with files.lock_folder(tmp_path, "x.lock"):
        pass
    assert not (tmp_path / "x.lock").exists()


def test_an_empty_lock_of_no_process_is_taken_over(tmp_path, capsys):
    """A 0-byte lock (an older gptlab's creator that ran out of disk space or was killed before
    writing its record) holds no live process: the next run waits out the few seconds a writer
    could still be writing it, then takes it over, with a note; it is never refused."""
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_bytes(b"")
    train(small(), out)
    assert "took over the stale lock" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # released, nothing left


def test_a_lock_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """Another process never reads a half-written lock: it is written beside and linked into place."""
    seen = []
    real = os.link

    def link(src, dst, **kw):
        seen.append(Path(src).read_text())
        return real(src, dst, **kw)

    monkeypatch.setattr(os, "link", link)
    with files.lock_folder(tmp_path, "x.lock", purpose="test") as lock:
        assert json.loads(seen[0]) == lock.owner
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_locking_leaves_no_lock(tmp_path, monkeypatch, capsys):
    """``train`` on a full disk: one line saying so (exit 1), no lock file left behind (it was
    left empty, and every later run refused as "in use by another training run"), and the next
    run, once there is space, trains."""
    import errno

    out = tmp_path / "run"
    out.mkdir()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        files.lock_folder(out, LOCK_FILE)
    assert list(out.iterdir()) == []
    assert main(["train", *CLI, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no space left on the device" in err, err
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    assert main(["train", *CLI, "--out", str(out)]) == 0
    assert "in use" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------ signals


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_and_prints_the_resume_command(tmp_path, monkeypatch, capsys, signum, code):
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # SIG_IGN in a background job
    signal_at_step(monkeypatch, 5, signum)
    rc = main(["train", *CLI, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == code and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"at step 5; checkpoint saved in {out / 'ckpt'}" in lines[0]
    command = lines[0].split("resume with: ", 1)[1]
    assert command.startswith("python -m gptlab train --recipe tiny") and command.endswith("--resume")
    assert json.loads((out / "ckpt" / "train_state.json").read_text())["step"] == 5
    assert not (out / LOCK_FILE).exists()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # handlers restored
    monkeypatch.undo()
    import shlex

    assert main(shlex.split(command)[3:]) == 0  # the printed command, as is
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 6, 12]


def test_a_second_signal_stops_at_once(tmp_path, monkeypatch):
    signal_at_step(monkeypatch, 3, times=2)
    with pytest.raises(TrainingInterrupted, match="second SIGINT") as e:
        train(small(), tmp_path / "run")
    assert e.value.checkpoint is None and not (tmp_path / "run" / "ckpt").exists()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


# ------------------------------------------------------------------------------------ torn logs, temporary folders


def test_a_torn_last_line_is_dropped_on_resume(tmp_path, capsys):
    cfg = small(log_interval=2)
    train(cfg, tmp_path / "a")
    out = tmp_path / "b"
    train(cfg, out, until=8)
    torn = '{"step": 12, "train_loss": 3.1, "val_lo'
    with open(out / "metrics.jsonl", "a") as f:
        f.write(torn)  # a crash in the middle of a write
    with open(out / "train_log.jsonl", "a") as f:
        f.write('{"step": 10, "tra')
    with pytest.raises(ValueError, match="line 3"):
        read_metrics(out / "metrics.jsonl")  # the plain reader still says so
    train(cfg, out, resume=True)
    err = capsys.readouterr().err
    assert f"dropped its torn last line ({len(torn)} bytes" in err and "train_log.jsonl" in err
    a, b = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["val_loss"]) for r in a] == [(r["step"], r["val_loss"]) for r in b]
    # a bad line before the last one is damage, not an interrupted write: refused
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([lines[0], lines[1][:10], lines[2]]) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        train(cfg.with_overrides(max_steps=14), out, resume=True)


@pytest.mark.parametrize("damage", ["cut", "emptied", "deleted"])
@pytest.mark.parametrize("log", ["metrics.jsonl", "train_log.jsonl"])
def test_a_log_that_lost_rows_is_refused_on_resume(tmp_path, capsys, damage, log):
    """A log cut at a line boundary, emptied or deleted after the checkpoint: --resume refuses,
    naming the file and what it lost (it went on silently, the earlier steps gone from the record,
    the plot and the summary's best validation loss), and the files stay as they were."""
    cfg = small(log_interval=2)
    out = tmp_path / "run"
    train(cfg, out, until=8)
    path = out / log
    lines = path.read_text().splitlines(keepends=True)
    if damage == "cut":
        path.write_text("".join(lines[:-1]))
    elif damage == "emptied":
        path.write_text("")
    else:
        path.unlink()
    before = snapshot(out)
    with pytest.raises(RunFolderError, match=rf"cannot resume .*{log} (holds \d+ row|is missing).*checkpoint at "
                                             rf"step 8 was saved when it held {len(lines)} row"):
        train(cfg, out, resume=True)
    assert main(["train", *CLI, "--set", "log_interval=2", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("gptlab train: error: cannot resume"), err
    assert snapshot(out) == before


def test_an_older_checkpoint_without_row_counts_checks_its_last_evaluation(tmp_path, monkeypatch):
    """A checkpoint written before the row counts records the last evaluation's row: a
    metrics.jsonl without it is refused too."""
    from gptlab.train.checkpoint import TRAIN_STATE_FILE

    cfg = small()
    out = tmp_path / "run"
    train(cfg, out, until=8)
    ckpt = out / "ckpt"
    state = json.loads((ckpt / TRAIN_STATE_FILE).read_text())
    del state["metrics_rows"], state["log_rows"]
    (ckpt / TRAIN_STATE_FILE).write_text(json.dumps(state))
    monkeypatch.setenv("GPTLAB_VERIFY_CHECKPOINTS", "0")  # the edit breaks the manifest's hash
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text().splitlines(keepends=True)[0])
    with pytest.raises(RunFolderError, match=r"saved when it held a row at step 6"):
        train(cfg, out, resume=True)


@pytest.mark.parametrize("row, message", [
    ("{}", r'line 2: every row needs the integer step it was written at \("step": 50\), got no "step"'),
    ('{"step": "50", "val_loss": 3.0}', r'line 2: every row needs the integer step .*got "step": "50"'),
    ("[1, 2]", r"line 2: not a JSON object"),
])
def test_a_row_without_an_integer_step_names_the_file_and_line(tmp_path, capsys, row, message):
    cfg = small()
    out = tmp_path / "run"
    train(cfg, out, until=8)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text(lines[0] + row + "\n" + "".join(lines[1:]))
    with pytest.raises(ValueError, match=rf"metrics.jsonl, {message}"):
        train(cfg, out, resume=True)
    with pytest.raises(ValueError, match=rf"metrics.jsonl, {message}"):
        read_metrics(out / "metrics.jsonl")
    assert main(["train", *CLI, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "metrics.jsonl, line 2" in err, err


def test_temporary_folders_of_killed_saves_are_removed_at_the_next_save(tmp_path):
    out = tmp_path / "run"
    train(small(max_steps=6), out)
    host = files._host_tag()

    def leftovers(name: str) -> tuple[Path, Path, Path]:
        dead = out / f".{name}.tmp-{host}-{dead_pid()}-abc123"  # its process was killed
        old_style = out / f".{name}.tmp-k2j3h4"  # the pid-less names of older versions
        live = out / f".{name}.tmp-{host}-{os.getppid()}-def456"  # a running process's
        for d in (dead, old_style, live):
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"\0" * 1000)
        return dead, old_style, live

    # any atomic folder write (save_checkpoint outside a run) removes those of dead processes only
    dead, old_style, live = leftovers("other")
    with files.atomic_dir(out / "other") as t:
        (t / "a").write_text("a")
    assert not dead.exists() and old_style.exists() and live.exists()
    # a run holding the folder's lock knows nobody else saves its checkpoint: it removes them all
    leftovers("ckpt")
    (out / ".metrics.jsonl.x1y2.tmp").write_text("half")
    train(small(), out, resume=True)
    left = sorted(p.name for p in out.iterdir() if not p.name.startswith(".other."))
    assert left == ["ckpt", "metrics.jsonl", "other", "train_log.jsonl"], left


# ------------------------------------------------------------------------------------ DDP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, out: str, results: str, signal_step: int, resume: bool) -> None:
    """One of ``world`` gloo processes: train (rank 1 alone gets SIGINT after ``signal_step``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from gptlab.train import Trainer as T
    from gptlab.train import TrainingInterrupted as Interrupted

    if rank == 1 and signal_step:
        original = T.optimizer_step

        def step_then_signal(self, lr):
            norm = original(self, lr)
            if self.step + 1 == signal_step:
                os.kill(os.getpid(), signal.SIGINT)
            return norm

        T.optimizer_step = step_then_signal
    t = T(small(max_steps=20, eval_interval=10, log_interval=4, device="cpu", dropout=0.1), out, resume=resume)
    try:
        try:
            t.fit()
            outcome = {"step": t.step, "interrupted": False}
        except Interrupted as e:
            outcome = {"step": e.step, "interrupted": True, "saved": str(e.checkpoint)}
        with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
            json.dump(outcome, f)
    finally:
        t.close()


@pytest.mark.slow  # three pairs of spawned processes: about 35 s on 2 cores
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_a_signal_to_one_ddp_process_stops_all_at_one_step(tmp_path):
    """Under DDP the processes agree (every log_interval steps) to stop: all at the same step, one
    checkpoint, and the resumed run ends where an uninterrupted one does."""
    import torch.multiprocessing as mp

    def run(out: Path, signal_step: int, resume: bool) -> list[dict]:
        results = tmp_path / f"results-{out.name}-{int(resume)}"
        results.mkdir()
        mp.spawn(_ddp_worker, args=(2, _free_port(), str(out), str(results), signal_step, resume), nprocs=2,
                 join=True)
        return [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]

    first = run(tmp_path / "b", 5, False)
    assert [o["step"] for o in first] == [8, 8] and all(o["interrupted"] for o in first)  # the next multiple of 4
    assert json.loads((tmp_path / "b" / "ckpt" / "train_state.json").read_text())["step"] == 8
    assert [o["step"] for o in run(tmp_path / "b", 0, True)] == [20, 20]
    run(tmp_path / "a", 0, False)
    from gptlab.train.checkpoint import load_model

    ma, mb = load_model(tmp_path / "a")[0], load_model(tmp_path / "b")[0]
    for (n, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(pa, pb), n
    assert read_metrics(tmp_path / "a" / "metrics.jsonl")[-1]["val_loss"] == read_metrics(
        tmp_path / "b" / "metrics.jsonl")[-1]["val_loss"]
