"""Writing files atomically: a reader sees the old file or the new one, never half of one.

Where this sits: beside the pipeline; every module that writes a file (the data cache, tokenizers,
metrics, plots, benchmark results) goes through these. The bytes go to a temporary file in the
destination folder, which then replaces the destination with :func:`os.replace` (atomic on POSIX
and Windows). A whole folder (a checkpoint, :mod:`gptlab.train.checkpoint`) is written the same way by
:func:`atomic_dir`: into a temporary folder beside it, then swapped in. That temporary folder's
name holds its creator's host and process id, so that one left behind by a killed process is
recognised and removed at the next save (:func:`remove_stale_temps`).

:func:`lock_folder` keeps a folder to one writer at a time (a training run's output folder): a
lock file holding the owner's pid and host, created whole and only if there is none (written
beside it, then hard-linked into place); a lock whose process is gone, or an empty one that no
process is writing, is taken over, one whose process lives refuses with :class:`LockError`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

__all__ = [
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_dir",
    "kept_aside",
    "fsync_path",
    "remove_stale_temps",
    "pid_alive",
    "lock_folder",
    "FolderLock",
    "LockError",
]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically.

    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o644)  # mkstemp's 0600 would otherwise carry over to the final file
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file + :func:`os.replace`)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj) -> Path:
    """Write ``obj`` as indented UTF-8 JSON to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file, or a folder's list of entries, to the disk (a folder that cannot be opened,
    as on Windows, is skipped)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if Path(path).is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not Path(path).is_dir():
            raise
    finally:
        os.close(fd)


def kept_aside(path: str | os.PathLike) -> Path:
    """Where :func:`atomic_dir` keeps the previous folder ``path`` while it swaps the new one in:
    ``.<name>.old`` beside it. Only a crash between the swap's two renames leaves it there."""
    path = Path(path)
    return path.parent / f".{path.name}.old"


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new temporary folder beside ``path``; on success it replaces the folder ``path``
    (or takes its place), on an exception it is removed and ``path`` is left untouched.

    The swap is two renames: the old folder goes to :func:`kept_aside`, then the new one to
    ``path``; every file and both folders are flushed to the disk first. A crash between the two
    renames leaves no ``path`` but the previous folder intact at ``kept_aside(path)``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)  # left by a process killed during an earlier save
    tmp = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(path)}{_host_tag()}-{os.getpid()}-", dir=path.parent))
    try:
        yield tmp
        for folder, subfolders, names in os.walk(tmp):  # mkdtemp's 0700 would otherwise carry over
            os.chmod(folder, 0o755)
            for name in names:
                os.chmod(os.path.join(folder, name), 0o644)
                fsync_path(os.path.join(folder, name))
            fsync_path(folder)
        old = kept_aside(path)
        if path.exists():
            if old.exists():  # left by an earlier crash; path is the newer folder
                shutil.rmtree(old)
            os.replace(path, old)  # 1: the previous folder goes aside
        os.replace(tmp, path)  # 2: the new one takes its place
        fsync_path(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------------------------
# temporary folders left by killed processes
# --------------------------------------------------------------------------------------------


def _host_tag() -> str:
    """This machine's name as it goes into a temporary folder's name (letters, digits, dots)."""
    return "".join(c if c.isalnum() or c == "." else "_" for c in socket.gethostname()) or "host"


def _temp_prefix(path: Path) -> str:
    """The name every temporary folder of :func:`atomic_dir` for ``path`` starts with."""
    return f".{path.name}.tmp-"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (a zombie counts as running).

    On Windows, where ``os.kill(pid, 0)`` would end the process, every pid counts as running.
    """
    if pid <= 0:
        return False
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _temp_owner(name: str, prefix: str) -> tuple[str, int] | None:
    """``(host, pid)`` from a temporary folder's name ``<prefix><host>-<pid>-<random>``, or None
    for a name of another form (the pid-less names older versions wrote)."""
    parts = name[len(prefix):].rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def remove_stale_temps(path: str | os.PathLike, *, all_but_mine: bool = False) -> list[Path]:
    """Remove the temporary folders of :func:`atomic_dir` for ``path`` that no running process
    writes: those created on this machine by a process that is gone (killed during a save).

    ``all_but_mine=True`` also removes those of other live processes and those whose name holds
    no pid: for a caller that knows nobody else writes ``path`` (a training run holding its
    folder's lock). Returns the folders removed.
    """
    path = Path(path)
    prefix, me = _temp_prefix(path), (_host_tag(), os.getpid())
    removed = []
    if not path.parent.is_dir():
        return removed
    for entry in path.parent.iterdir():
        if not entry.name.startswith(prefix) or not entry.is_dir():
            continue
        owner = _temp_owner(entry.name, prefix)
        if owner == me:
            continue
        dead = owner is not None and owner[0] == me[0] and not pid_alive(owner[1])
        if dead or all_but_mine:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


# --------------------------------------------------------------------------------------------
# a folder's lock
# --------------------------------------------------------------------------------------------


class LockError(RuntimeError):
    """A folder is locked by another process that runs (or may run: on another machine)."""


STALE_EMPTY_LOCK_S = 2.0
"""An empty or garbled lock file older than this is taken over. This module never shows one (a
lock file appears whole: :func:`_create_exclusive`); an older gptlab, or the fallback for file
systems without hard links, shows one for the moment between creating the file and writing it."""


def _owner_record(purpose: str) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "purpose": purpose}


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to ``fd`` (every byte, however many calls it takes) and flush it to the disk."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def _create_exclusive(path: Path, record: dict) -> bool:
    """Create ``path`` holding ``record`` as JSON if it does not exist; False if it does.

    The record is written to a temporary file first, which is then hard-linked as ``path``
    (``os.link`` fails if ``path`` exists): the file appears whole or not at all, so a write that
    fails (a full disk) or a process killed meanwhile never leaves an empty lock behind. Where
    the file system has no hard links, ``O_CREAT | O_EXCL`` and a write, the file removed again if
    the write fails.
    """
    data = (json.dumps(record) + "\n").encode("utf-8")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o644)  # mkstemp's 0600 would carry over to the lock
            _write_all(fd, data)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as e:  # no hard links here (some network and FAT file systems)
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise
    return True


def _read_lock(path: Path) -> tuple[str, dict | None] | None:
    """``(text, owner record or None if unreadable)``, or None when ``path`` does not exist."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        return text, None
    ok = isinstance(owner, dict) and isinstance(owner.get("pid"), int) and isinstance(owner.get("host"), str)
    return text, owner if ok else None


def _lock_age(path: Path) -> float | None:
    """Seconds since ``path`` last changed; None when it does not exist."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


def _is_stale(path: Path, owner: dict | None) -> bool:
    """Whether a lock's process is certainly gone: on this machine and not running, or a lock file
    left empty or garbled (its creator killed, or out of disk space, while writing it) for over
    ``STALE_EMPTY_LOCK_S``."""
    if owner is None:
        age = _lock_age(path)
        return age is not None and age > STALE_EMPTY_LOCK_S
    return owner["host"] == socket.gethostname() and owner["pid"] != os.getpid() and not pid_alive(owner["pid"])


def _take_over(path: Path, stale_text: str) -> bool:
    """Remove the stale lock ``path`` if it still holds ``stale_text``; one process at a time (a
    second lock file, ``<lock>.takeover``, created with ``O_EXCL``). True if this call removed it."""
    guard = path.with_name(path.name + ".takeover")
    if not _create_exclusive(guard, _owner_record("takeover")):
        seen = _read_lock(guard)
        if seen is not None and _is_stale(guard, seen[1]):
            with contextlib.suppress(FileNotFoundError):
                guard.unlink()
        return False
    try:
        now = _read_lock(path)
        if now is None or now[0] != stale_text:
            return False  # gone, or another process's fresh lock: not ours to remove
        path.unlink()
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            guard.unlink()


def _describe(owner: dict | None) -> str:
    if owner is None:
        return "an unreadable lock"
    return f"pid {owner['pid']} on {owner['host']}, since {owner.get('since', '?')}"


class FolderLock:
    """A held folder lock (:func:`lock_folder`); :meth:`release` (or leaving a ``with``) removes it."""

    def __init__(self, path: Path, owner: dict):
        self.path = path
        self.owner = owner

    def release(self) -> None:
        """Remove the lock file if it is still this lock's (idempotent)."""
        seen = _read_lock(self.path)
        if seen is not None and seen[1] is not None and (seen[1]["pid"], seen[1]["host"]) == (
                self.owner["pid"], self.owner["host"]):
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_folder(folder: str | os.PathLike, name: str = ".gptlab.lock", *, purpose: str = "") -> FolderLock:
    """Lock ``folder`` (created if missing) for this process: the file ``folder/name``, created
    atomically with ``O_CREAT | O_EXCL``, holds ``{"pid", "host", "since", "purpose"}``.

    A lock whose process is gone (same machine, pid not running) is taken over with a note on
    stderr, and so is an empty or garbled lock file (no process's: its creator died, or ran out of
    disk space, while writing it) once it is ``STALE_EMPTY_LOCK_S`` old (this waits until then); a
    lock of a running process, of this same process, or of another machine raises
    :class:`LockError` naming the owner and the lock file. The lock file appears whole or not at
    all (:func:`_create_exclusive`): a failed write (a full disk) raises its ``OSError`` and leaves
    no lock behind.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    me = _owner_record(purpose)
    for _ in range(20):
        if _create_exclusive(path, me):
            for tmp in folder.glob(f".{name}.*.tmp"):  # left by a process killed while creating a lock
                age = _lock_age(tmp)
                if age is not None and age > STALE_EMPTY_LOCK_S:
                    tmp.unlink(missing_ok=True)
            return FolderLock(path, me)
        seen = _read_lock(path)
        if seen is None:
            continue  # released meanwhile: try again
        text, owner = seen
        age = _lock_age(path)
        if owner is None and age is not None and age <= STALE_EMPTY_LOCK_S:
            time.sleep(STALE_EMPTY_LOCK_S - age + 0.05)  # being written, or left empty: look again once it is old
            continue
        if not _is_stale(path, owner):
            raise LockError(
                f"{folder} is in use by another {purpose or 'process'} ({_describe(owner)}); wait for it to end, "
                f"or, if no such process runs any more, delete {path}")
        if _take_over(path, text):
            print(f"note: took over the stale lock {path} ({_describe(owner)}: that process is gone)", file=sys.stderr)
        time.sleep(0.01)
    raise LockError(f"could not lock {folder}: its lock file {path} keeps changing")
