"""A training run's folder: one run, one writer, nothing lost.

Where this sits: beside the training loop (:mod:`gptlab.train.loop`), which calls these rules
before it loads anything and while it holds the folder's lock. A folder holds one run
(:data:`RUN_FILES`); a new run over it is refused unless asked to ``overwrite`` it, which sets the
earlier run aside (:func:`set_run_aside`, in :func:`overwrite_backup`) until the new run's first
checkpoint and puts it back (:func:`restore_run`) if the new run stops before; ``resume`` needs a
checkpoint; what a killed process left half done is finished by :func:`recover_run_folder`.
:class:`RunFolder` applies these rules for one trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from ..files import FolderLock, atomic_write_json, lock_folder, remove_stale_temps
from .checkpoint import TRAIN_STATE_FILE, CheckpointError, resolve_checkpoint

__all__ = ["RUN_FILES", "LOCK_FILE", "MANIFEST", "RunFolder", "RunFolderError", "check_out_dir", "run_entries", "has_checkpoint",
           "saved_step", "overwrite_backup", "discard_backup", "set_run_aside", "restore_run", "recover_run_folder", "check_run_folder"]

RUN_FILES = ("ckpt", ".ckpt.old", "metrics.jsonl", "train_log.jsonl", "loss.png")  # what makes a folder a run
LOCK_FILE = ".gptlab-train.lock"
MANIFEST = "overwritten.json"  # in the backup folder: the entries moved there


class RunFolderError(ValueError):
    """A run folder cannot be used as asked (it holds a run, or nothing to resume); one line."""


def check_out_dir(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` as a ``Path``, refused (:class:`RunFolderError`) where it cannot be a run's folder:
    an empty string (which ``Path`` reads as the current folder), a file, or a path under a file."""
    if isinstance(out_dir, str) and not out_dir.strip():
        raise RunFolderError("the output folder (--out, out_dir) is an empty string; name a folder (to train into "
                             "the current folder, give '.')")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"the output folder {out} is a file; give a folder (a new one, or one holding a run)")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunFolderError(f"the output folder {out} cannot be made: {parent} is a file, not a folder")
            break
    return out


def run_entries(out_dir: Path) -> list[str]:
    """The names of the run files (:data:`RUN_FILES`) that ``out_dir`` holds."""
    return [n for n in RUN_FILES if (out_dir / n).exists()]


def has_checkpoint(out_dir: Path) -> bool:
    """Whether ``out_dir/ckpt`` (or the copy an interrupted swap kept aside) is a checkpoint."""
    try:
        resolve_checkpoint(out_dir / "ckpt")
    except CheckpointError:
        return False
    return True


def overwrite_backup(out_dir: Path) -> Path:
    """Where ``overwrite`` keeps the earlier run of ``out_dir``: ``.<name>.overwritten`` beside it."""
    out_dir = Path(os.path.abspath(out_dir))
    return out_dir.parent / f".{out_dir.name}.overwritten"


def discard_backup(backup: Path) -> None:
    """Delete a backup folder: renamed first, so that a crash midway never leaves half a backup
    that would later be restored."""
    if not backup.exists():
        return
    trash = backup.with_name(backup.name + ".delete")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(backup, trash)
    shutil.rmtree(trash, ignore_errors=True)


def set_run_aside(out_dir: Path) -> Path | None:
    """Move ``out_dir``'s run files into :func:`overwrite_backup` (a manifest first, then one
    rename per entry). Returns the backup folder, or None when there was no run."""
    names = run_entries(out_dir)
    if not names:
        return None
    backup = overwrite_backup(out_dir)
    backup.mkdir()
    atomic_write_json(backup / MANIFEST, {"from": str(out_dir), "entries": names})  # whole, or absent
    for n in names:
        os.replace(out_dir / n, backup / n)
    return backup


def restore_run(out_dir: Path, backup: Path) -> None:
    """Put the run kept in ``backup`` back into ``out_dir``, replacing what a newer run wrote.

    Idempotent (a crash midway is finished by the next call): run files not in the manifest are
    the newer run's and go; each entry still in the backup replaces its namesake.
    """
    names = json.loads((backup / MANIFEST).read_text())["entries"]
    for n in RUN_FILES:
        if n not in names and (out_dir / n).exists():
            _remove(out_dir / n)
    for n in names:
        if (backup / n).exists():
            if (out_dir / n).is_dir() and (backup / n).is_dir():
                _discard_dir(out_dir / n)
            os.replace(backup / n, out_dir / n)
    discard_backup(backup)


def _remove(p: Path) -> None:
    if p.is_dir():
        _discard_dir(p)
    else:
        p.unlink()


def _discard_dir(p: Path) -> None:
    trash = p.with_name(f".{p.name}.delete")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(p, trash)
    shutil.rmtree(trash, ignore_errors=True)


def recover_run_folder(out_dir: Path) -> None:
    """Finish what a killed process left half done in ``out_dir`` (call holding its lock):
    put back an earlier run that ``overwrite`` had set aside (the new run never saved), and
    remove half-deleted folders and the temporary files of interrupted writes."""
    backup = overwrite_backup(out_dir)
    shutil.rmtree(backup.with_name(backup.name + ".delete"), ignore_errors=True)
    if (backup / MANIFEST).is_file():
        restore_run(out_dir, backup)
        print(f"note: put back the earlier run of {out_dir}, kept aside in {backup} by an --overwrite run "
              "that stopped before its first checkpoint", file=sys.stderr)
    elif backup.exists():
        shutil.rmtree(backup, ignore_errors=True)  # killed before its manifest: nothing was moved
    for p in out_dir.glob(".*.delete"):
        shutil.rmtree(p, ignore_errors=True)
    for n in ("metrics.jsonl", "train_log.jsonl", "loss.png"):  # atomic_path's temporary files
        for p in out_dir.glob(f".{n}.*.tmp"):
            p.unlink(missing_ok=True)


def check_run_folder(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse (:class:`RunFolderError`) what would lose or silently misuse a run in ``out_dir``:
    a new run over an earlier one without ``overwrite``, or ``resume`` where a run left no
    checkpoint (it would restart at step 0 and rewrite its logs)."""
    if resume and overwrite:
        raise RunFolderError("resume and overwrite exclude each other: continue the run, or replace it")
    names = run_entries(out_dir)
    if not names or overwrite:
        return
    if not resume:
        raise RunFolderError(
            f"{out_dir} already holds a training run ({', '.join(names)}); continue it with --resume "
            f"(resume=True) or replace it with --overwrite (overwrite=True)")
    if not has_checkpoint(out_dir):
        raise RunFolderError(
            f"cannot resume {out_dir}: it holds {', '.join(names)} but no checkpoint (the run stopped "
            f"before its first save); start it again with --overwrite (overwrite=True)")


def saved_step(ckpt_dir: Path) -> int | None:
    """The step of the checkpoint in ``ckpt_dir`` now (None: none readable)."""
    try:
        state = json.loads((resolve_checkpoint(ckpt_dir) / TRAIN_STATE_FILE).read_text())
        return int(state["step"])
    except (OSError, ValueError, KeyError):
        return None


class RunFolder:
    """One trainer's folder: checked before anything is loaded (:meth:`check`), locked
    (:meth:`lock`) and claimed (:meth:`claim`) while it trains; the run that ``overwrite`` replaced
    is kept (``backup``) until the new run's first checkpoint (:meth:`drop_backup`), and put back
    if the new run stops before (:meth:`put_back`)."""

    def __init__(self, out_dir: Path, *, resume: bool, overwrite: bool):
        self.out_dir, self.resume, self.overwrite = Path(out_dir), resume, overwrite
        self.ckpt_dir = self.out_dir / "ckpt"
        self.claimed = False  # whether the trainer has made the folder this run's
        self.backup: Path | None = None  # the earlier run set aside by overwrite, until the first save

    def lock(self) -> FolderLock:
        """Take the folder's lock (:func:`gptlab.files.lock_folder`): one process at a time."""
        return lock_folder(self.out_dir, LOCK_FILE, purpose="training run")

    def check(self) -> None:
        """Before anything is loaded: finish an interrupted overwrite, then refuse what would lose a run."""
        if (overwrite_backup(self.out_dir) / MANIFEST).is_file():
            with self.lock():
                recover_run_folder(self.out_dir)
        check_run_folder(self.out_dir, resume=self.resume, overwrite=self.overwrite)

    def claim(self, step: int) -> None:
        """Make the locked folder this run's (once): recheck it, set an earlier run aside with
        ``overwrite``, clean what killed processes left. ``step``: the step the trainer loaded."""
        recover_run_folder(self.out_dir)
        remove_stale_temps(self.ckpt_dir, all_but_mine=True)
        if self.claimed:
            return
        if not self.resume:
            check_run_folder(self.out_dir, resume=False, overwrite=self.overwrite)
            self.backup = set_run_aside(self.out_dir) if self.overwrite else None
        elif has_checkpoint(self.out_dir) and saved_step(self.ckpt_dir) != step:
            raise RunFolderError(f"{self.out_dir}: its checkpoint changed (now at step {saved_step(self.ckpt_dir)}) "
                                 f"since this trainer loaded step {step}; create the Trainer again")
        self.claimed = True

    def drop_backup(self) -> None:
        """The new run has its own checkpoint (or has ended): the run it replaced goes for good."""
        if self.backup is not None:
            discard_backup(self.backup)
            self.backup = None

    def put_back(self) -> bool:
        """The new run stopped before its first checkpoint: the run it replaced comes back.
        Returns whether there was one."""
        if self.backup is None:
            return False
        restore_run(self.out_dir, self.backup)
        self.backup = None
        return True
