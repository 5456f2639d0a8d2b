"""Writing files atomically: a reader sees the old file or the new one, never half of one.

Where this sits: beside the pipeline; every module that writes a file (the data cache, tokenizers,
metrics, plots, benchmark results) goes through these. The bytes go to a temporary file in the
destination folder, which then replaces the destination with :func:`os.replace` (atomic on POSIX
and Windows). A whole folder (a checkpoint, :mod:`gptlab.checkpoint`) is written the same way by
:func:`atomic_dir`: into a temporary folder beside it, then swapped in.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
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
