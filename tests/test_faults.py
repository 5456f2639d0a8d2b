"""Fault injection into real training processes: each fault, then its recovery, checked.

Faults, at random points drawn from a seeded generator: ``kill -9`` and SIGINT / SIGTERM during
training and in the middle of a checkpoint save (between any two of its file writes, flushes and
renames), two processes training into one folder at once, and a metrics.jsonl whose last line a
crash cut short. After each, the run is recovered the documented way (``--resume``, or
``--overwrite`` when the run died before its first checkpoint) and must end exactly as an
uninterrupted run (same metrics rows, same train_log rows, same weights, bit for bit on CPU), its
checkpoint must load, and nothing may be left behind (lock, temporary folders, backups).

The counts (faults injected, runs recovered, bytes lost) are printed at the end of the module.
Each test runs one or two short ``python -m gptlab train`` processes of the tiny recipe (about 5 s
each on 2 cores, most of it importing torch).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gptlab.__main__ import main
from gptlab.train.checkpoint import load_model
from gptlab.train import LOCK_FILE, get_recipe, overwrite_backup, read_metrics, read_train_log, train

SEED = 20261125
STEPS, CKPT_EVERY = 200, 20
SETS = {"eval_tokens": 2048, "plot": False, "dropout": 0.1, "checkpoint_interval": CKPT_EVERY}
ARGS = ["--recipe", "tiny", "--max-steps", str(STEPS), "--eval-interval", "50", "--log-interval", "5",
        "--no-progress", "--num-threads", "1"] + [a for k, v in SETS.items() for a in ("--set", f"{k}={json.dumps(v)}")]
COUNTS: collections.Counter = collections.Counter()

# Run inside a child process: `python -c DRIVER SAVE POINT SIGNUM ARGS...` trains with ARGS and
# sends itself SIGNUM at the POINT-th file operation of its SAVE-th checkpoint save (each file
# written, each flush, each rename; a POINT past the save's last one: right after the save).
DRIVER = r"""
import os, sys
import gptlab.train.loop
import gptlab.train.checkpoint as ck, gptlab.files as fl
save_no, point, signum = (int(a) for a in sys.argv[1:4])
state = {"saves": 0, "ops": 0, "fired": False}

def fire():
    if not state["fired"]:
        state["fired"] = True
        os.kill(os.getpid(), signum)

def hit():
    if state["saves"] == save_no:
        state["ops"] += 1
        if state["ops"] == point:
            fire()

def wrap(module, name):
    real = getattr(module, name)
    def wrapped(*a, **k):
        hit()
        return real(*a, **k)
    setattr(module, name, wrapped)

class Os:
    def __getattr__(self, name):
        return getattr(os, name)
    def replace(self, a, b):
        hit()
        return os.replace(a, b)

for module, name in ((ck, "save_file"), (ck, "_write_json"), (fl, "fsync_path")):
    wrap(module, name)
fl.os = Os()
real_save = ck.save_checkpoint
def save_checkpoint(*a, **k):
    state["saves"] += 1
    state["ops"] = 0
    out = real_save(*a, **k)
    if state["saves"] == save_no:
        fire()
    return out
ck.save_checkpoint = save_checkpoint
gptlab.train.loop.save_checkpoint = save_checkpoint
from gptlab.__main__ import main
sys.exit(main(["train", *sys.argv[4:]]))
"""


@pytest.fixture(scope="module", autouse=True)
def report(request):
    """Print the module's counts at its end, on the terminal (pytest captures the tests' output)."""
    yield COUNTS
    summary = ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items()))
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print(f"\nfault injection: {summary}", flush=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process."""
    out = tmp_path_factory.mktemp("reference")
    n = torch.get_num_threads()
    train(get_recipe("tiny", max_steps=STEPS, eval_interval=50, log_interval=5, num_threads=1, progress=False,
                     **SETS), out)
    torch.set_num_threads(n)
    return out


def rng_for(name: str) -> random.Random:
    """A generator of fault points of its own for each test, from the module's seed."""
    return random.Random(f"{SEED}-{name}")


def spawn(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gptlab", "train", *ARGS, "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def logged_step(out: Path) -> int:
    """The last step train_log.jsonl shows (0 before any row; a torn last line is ignored)."""
    try:
        lines = (out / "train_log.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError):
            continue
    return 0


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 180.0) -> None:
    """Poll until the training process has logged ``step`` (or ended)."""
    t0 = time.monotonic()
    while logged_step(out) < step and proc.poll() is None:
        assert time.monotonic() - t0 < timeout, f"no step {step} after {timeout} s"
        time.sleep(0.005)


def recover(out: Path, capsys) -> str:
    """Resume the run in ``out`` in this process; a run that died before its first checkpoint
    cannot be resumed (exit 2, saying so) and is started again with --overwrite."""
    n = torch.get_num_threads()
    rc = main(["train", *ARGS, "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    how = "resumed"
    if rc == 2:
        assert "holds no checkpoint" in err or "no checkpoint" in err, err
        rc = main(["train", *ARGS, "--out", str(out), "--overwrite"])
        err += capsys.readouterr().err
        how = "restarted"
    torch.set_num_threads(n)
    assert rc == 0, err
    COUNTS["runs recovered"] += 1
    return how


def rows_bytes(rows: list[dict], drop: tuple[str, ...]) -> list[str]:
    return [json.dumps({k: v for k, v in r.items() if k not in drop}, sort_keys=True) for r in rows]


def check_same_run(out: Path, reference: Path) -> None:
    """``out`` ended as the uninterrupted run: metrics and train_log rows (clocks aside), weights;
    its checkpoint loads; no lock, temporary folder or backup is left. Counts the bytes lost."""
    lost = 0
    for name, reader, drop in (("metrics.jsonl", read_metrics, ("elapsed_s", "eval_s")),
                               ("train_log.jsonl", read_train_log, ("elapsed_s",))):
        want, got = rows_bytes(reader(reference / name), drop), rows_bytes(reader(out / name), drop)
        lost += sum(len(w) + 1 for w in want if w not in got)
        assert got == want, name
    COUNTS["bytes lost"] += lost
    m_ref, _ = load_model(reference)
    m_out, _ = load_model(out)
    for (n, a), b in zip(m_ref.state_dict().items(), m_out.state_dict().values()):
        assert torch.equal(a, b), n
    assert sorted(p.name for p in out.iterdir()) == ["ckpt", "metrics.jsonl", "train_log.jsonl"]
    assert not overwrite_backup(out).exists()


# ------------------------------------------------------------------------------------ kill -9


@pytest.mark.parametrize("case", range(4))
def test_kill_9_during_training(tmp_path, reference, capsys, case):
    """Case 0 dies before the first checkpoint (recovered with --overwrite), the others anywhere."""
    rng = rng_for(f"kill-train-{case}")
    out = tmp_path / "run"
    step = rng.randrange(2, CKPT_EVERY - 5) if case == 0 else rng.randrange(10, STEPS - 10)
    proc = spawn(out)
    wait_for_step(proc, out, step)
    time.sleep(rng.uniform(0, 0.05))  # anywhere in the steps after it, evaluations and saves included
    proc.kill()
    proc.communicate()
    COUNTS["faults injected"] += 1
    COUNTS["kill -9 during training"] += 1
    assert not (out / "ckpt").exists() or load_model(out)  # whatever was saved loads
    COUNTS[f"recovery: {recover(out, capsys)}"] += 1
    check_same_run(out, reference)


@pytest.mark.parametrize("case, signum", [(0, signal.SIGKILL), (1, signal.SIGKILL), (2, signal.SIGKILL),
                                          (3, signal.SIGINT), (4, signal.SIGTERM)])
def test_signal_in_the_middle_of_a_save(tmp_path, reference, capsys, case, signum):
    rng = rng_for(f"save-{case}")
    out = tmp_path / "run"
    save_no, point = rng.randrange(1, STEPS // CKPT_EVERY), rng.randrange(1, 15)
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(save_no), str(point), str(signum), *ARGS,
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    COUNTS["faults injected"] += 1
    COUNTS[f"{signal.Signals(signum).name} in a save"] += 1
    if signum == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        leftovers = [p.name for p in out.iterdir() if p.name.startswith(".ckpt.")]
        COUNTS["temporary folders left by a killed save"] += len([n for n in leftovers if ".tmp-" in n])
    else:  # the save in progress completes, the run stops after the step, saves, says how to resume
        assert proc.returncode == 128 + signum and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.rstrip().endswith("--resume")
        saved = json.loads((out / "ckpt" / "train_state.json").read_text())["step"]
        assert saved == save_no * CKPT_EVERY, (saved, save_no)  # stopped before the next step
    assert load_model(out)  # the checkpoint loads: the previous one, or the new one, never half of one
    COUNTS[f"recovery: {recover(out, capsys)}"] += 1
    check_same_run(out, reference)


def set_aside(out: Path) -> bool:
    """Whether an --overwrite run has moved every entry of the earlier run into its backup (the
    manifest is written first, then one rename per entry: until the last, the old train_log may
    still be in ``out`` and look like the new run's progress)."""
    try:
        names = json.loads((overwrite_backup(out) / "overwritten.json").read_text())["entries"]
    except FileNotFoundError:
        return False
    return all((overwrite_backup(out) / n).exists() for n in names)


def test_kill_9_during_an_overwrite(tmp_path, reference, capsys):
    """An --overwrite run killed before its first checkpoint: the run it was replacing comes back."""
    rng = rng_for("kill-overwrite")
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    proc = spawn(out, "--overwrite", "--seed", "7", "--set", "checkpoint_interval=null")
    t0 = time.monotonic()
    while not set_aside(out):  # the new run has begun: every entry of the earlier run is in the backup
        assert proc.poll() is None and time.monotonic() - t0 < 180, proc.communicate()
        time.sleep(0.005)
    wait_for_step(proc, out, rng.randrange(5, STEPS - 10))
    proc.kill()
    proc.communicate()
    COUNTS["faults injected"] += 1
    COUNTS["kill -9 during an --overwrite"] += 1
    assert (overwrite_backup(out) / "overwritten.json").is_file()  # the earlier run, kept aside
    assert not (out / "ckpt").exists()
    COUNTS[f"recovery: {recover(out, capsys)}"] += 1  # puts it back, then resumes it (already complete)
    check_same_run(out, reference)


# ------------------------------------------------------------------------------------ SIGINT, SIGTERM


@pytest.mark.parametrize("case, signum", [(0, signal.SIGINT), (1, signal.SIGINT), (2, signal.SIGTERM)])
def test_signal_during_training(tmp_path, reference, capsys, case, signum):
    """The default recipe settings save only at the end; a signal saves at the step reached."""
    rng = rng_for(f"signal-train-{case}")
    out = tmp_path / "run"
    step = rng.randrange(5, STEPS - 10)
    proc = spawn(out, "--set", "checkpoint_interval=null")
    wait_for_step(proc, out, step)
    time.sleep(rng.uniform(0, 0.05))
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    COUNTS["faults injected"] += 1
    COUNTS[f"{signal.Signals(signum).name} during training"] += 1
    assert proc.returncode == 128 + signum and "Traceback" not in err, err
    line, = err.strip().splitlines()
    saved = json.loads((out / "ckpt" / "train_state.json").read_text())["step"]
    assert f"at step {saved}; checkpoint saved in {out / 'ckpt'}" in line and saved >= step
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[:4] == ["python", "-m", "gptlab", "train"] and command[-1] == "--resume"
    n = torch.get_num_threads()
    assert main(command[3:]) == 0  # the printed command, as is
    torch.set_num_threads(n)
    COUNTS["runs recovered"] += 1
    COUNTS["recovery: resumed"] += 1
    check_same_run(out, reference)


# ------------------------------------------------------------------------------------ two processes


def test_two_processes_into_one_folder(tmp_path, reference):
    out = tmp_path / "run"
    procs = [spawn(out), spawn(out)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    COUNTS["faults injected"] += 1
    COUNTS["concurrent runs"] += 1
    codes = sorted(rc for _, _, rc in results)
    assert codes == [0, 2], results
    _, err, _ = next(r for r in results if r[2] == 2)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    # refused by the lock, or (if the other had already begun writing) as a folder holding a run
    assert "in use by another training run" in err or "already holds a training run" in err, err
    COUNTS["second process refused: " + ("lock" if "in use" in err else "existing run")] += 1
    check_same_run(out, reference)  # the run that went ahead is whole


# ------------------------------------------------------------------------------------ torn metrics file


@pytest.mark.parametrize("case", range(2))
def test_kill_9_in_the_middle_of_a_row(tmp_path, reference, capsys, case):
    """A crash in the middle of appending a row: kill -9, then the row it was writing cut at a
    random byte (no newline) at the end of metrics.jsonl and of train_log.jsonl."""
    rng = rng_for(f"torn-{case}")
    out = tmp_path / "run"
    step = rng.randrange(CKPT_EVERY + 10, STEPS - 60)
    proc = spawn(out)
    wait_for_step(proc, out, step)
    proc.kill()
    proc.communicate()
    for name in ("metrics.jsonl", "train_log.jsonl"):
        have = read_metrics(out / name)  # whole rows only: a kill between two writes
        ahead = [r for r in read_metrics(reference / name) if r["step"] > have[-1]["step"]][0]
        line = json.dumps(ahead)
        torn = line[: rng.randrange(1, len(line))]
        with open(out / name, "a") as f:
            f.write(torn)
        COUNTS["torn bytes written"] += len(torn)
    COUNTS["faults injected"] += 1
    COUNTS["torn last lines"] += 2
    n = torch.get_num_threads()
    assert main(["train", *ARGS, "--out", str(out), "--resume"]) == 0
    torch.set_num_threads(n)
    err = capsys.readouterr().err
    dropped = [int(w.split("(")[1].split()[0]) for w in err.split("dropped its torn last line ")[1:]]
    assert len(dropped) == 2, err
    COUNTS["torn bytes dropped on resume"] += sum(dropped)
    COUNTS["runs recovered"] += 1
    COUNTS["recovery: resumed"] += 1
    check_same_run(out, reference)
