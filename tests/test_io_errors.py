"""Write failures and a missing course folder are one line naming the cause and the fix, no
traceback (issue 22): a read-only cache or HOME, a full disk while fetching, ``course grades
--output`` an existing folder, ``course`` run outside a course folder."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from gptlab import assets
from gptlab.__main__ import main
from gptlab.assets import Asset, CacheWriteError, fetch

REPO = Path(__file__).resolve().parent.parent
DATA = b"a small asset for the tests\n"


@pytest.fixture
def seeded(tmp_path, monkeypatch) -> Asset:
    """A registered asset whose only route is a seed folder (no network needed)."""
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "small.txt").write_bytes(DATA)
    monkeypatch.setenv("GPTLAB_SEED_DIR", str(seed))
    asset = Asset(name="io-errors-test", filename="io/small.txt", sha256=hashlib.sha256(DATA).hexdigest())
    monkeypatch.setitem(assets.ASSETS, asset.name, asset)
    return asset


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_fetch_into_an_unwritable_cache_names_gptlab_cache(seeded, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GPTLAB_CACHE", str(blocker / "cache"))  # cannot be created, even by root
    with pytest.raises(CacheWriteError, match=r"cannot write the cache folder .* set GPTLAB_CACHE to a writable"):
        fetch(seeded, quiet=True)
    assert main(["fetch", seeded.name, "-q"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("python -m gptlab fetch: error: cannot write the cache folder")
    assert "GPTLAB_CACHE" in line and "--cache-dir" in line


def test_fetch_with_an_unwritable_home_names_gptlab_cache(seeded, tmp_path, monkeypatch):
    home = tmp_path / "home-file"
    home.write_text("HOME is not a folder here")
    monkeypatch.delenv("GPTLAB_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(CacheWriteError, match=r"GPTLAB_CACHE"):
        fetch(seeded, quiet=True)


def test_fetch_into_a_read_only_cache(seeded, tmp_path, monkeypatch):
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    real_access = os.access
    monkeypatch.setattr(assets.os, "access", lambda p, mode: False if "cache" in str(p) else real_access(p, mode))
    with pytest.raises(CacheWriteError, match=r"cannot write the cache folder .*Permission denied.*GPTLAB_CACHE"):
        fetch(seeded, quiet=True)


def test_a_full_disk_while_fetching_says_free_space(seeded, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(assets.os, "fsync", full)
    with pytest.raises(CacheWriteError, match=r"no space left to write .*small.txt.*free some disk space, or set GPTLAB_CACHE"):
        fetch(seeded, quiet=True)
    assert not (tmp_path / "cache" / "io" / "small.txt").exists()
    assert list((tmp_path / "cache" / "io").iterdir()) == []  # no temporary file left behind
    assert main(["fetch", seeded.name, "-q"]) == 1
    assert "free some disk space" in _one_line(capsys.readouterr().err)


def test_a_full_disk_in_any_command_is_one_line(monkeypatch, capsys):
    """Any command's save that hits a full disk (here fetch's, replaced) ends in one line."""
    import gptlab.cli

    def save(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/ckpt/model.safetensors")

    monkeypatch.setattr(gptlab.cli, "cmd_fetch", save)
    assert main(["fetch"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "no space left on the device (/runs/x/ckpt/model.safetensors): free some disk space" in line


def test_a_file_over_the_size_limit_in_any_command_is_one_line(monkeypatch, capsys, tmp_path):
    """EFBIG (a file system's largest file, or ``ulimit -f``: Python ignores SIGXFSZ, so the write
    fails with it) ended in a traceback; a real write under a 1 kB limit, in a child process."""
    import resource
    import subprocess
    import sys

    code = ("import resource, sys; from gptlab.cli import main; import gptlab.cli as c\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))\n"
            "def big(args):\n"
            f"    with open({str(tmp_path / 'big.bin')!r}, 'wb') as f:\n"
            "        f.write(b'x' * 65536)\n"
            "c.cmd_fetch = big\n"
            "sys.exit(main(['fetch']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    line = _one_line(done.stderr)
    assert "file too large" in line and "ulimit -f" in line, line
    assert resource.getrlimit(resource.RLIMIT_FSIZE)  # (this process's own limit untouched)


# --------------------------------------------------------------------------- course


@pytest.fixture
def course_dir(tmp_path) -> Path:
    root = tmp_path / "course"
    root.mkdir()
    shutil.copy(REPO / "nbgrader_config.py", root)
    return root


def test_course_outside_a_course_folder_is_refused(tmp_path, monkeypatch, capsys):
    """No fallback to the installed package's checkout (which wrote its gradebook.db from anywhere)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["course", "grades"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "no course folder at" in line and "holds nbgrader_config.py" in line and "--course DIR" in line


def test_course_finds_the_course_folder_above_the_current_one(course_dir, monkeypatch, capsys):
    from gptlab.course import find_course

    (course_dir / "sub" / "deeper").mkdir(parents=True)
    monkeypatch.chdir(course_dir / "sub" / "deeper")
    assert find_course() == course_dir.resolve()


def test_course_grades_output_an_existing_folder(course_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert main(["course", "grades", "--course", str(course_dir), "--output", str(out)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"--output {out} is a folder: give a file path, e.g. --output {out / 'grades.csv'}" in line


# --------------------------------------------------------------------------- a checkpoint on a full disk

TRAIN = ["--recipe", "tiny", "--max-steps", "6", "--eval-interval", "6", "--no-progress", "--num-threads", "1",
         "--set", "eval_tokens=2048", "--set", "plot=false"]


def test_a_full_disk_while_writing_the_weights_is_one_line(tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as its own ``SafetensorError`` (the errno in its text): the
    save raises the ``OSError`` it is, and ``train`` ends in the one line every full disk gives,
    not a traceback, leaving no lock and no temporary folder behind."""
    from safetensors import SafetensorError

    from gptlab.train import checkpoint

    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_file", full)
    out = tmp_path / "run"
    assert main(["train", *TRAIN, "--out", str(out)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("python -m gptlab train: error: no space left on the device (")
    assert "model.safetensors): free some disk space" in line
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_an_io_error_of_safetensors_is_an_os_error_naming_the_file(tmp_path):
    """A real write error inside safetensors' Rust code (here the file-size limit, ``ulimit -f``,
    which any user can lower; a full disk reads the same with errno 28)."""
    import subprocess
    import sys

    code = r"""
import errno, resource, signal, sys
from gptlab.model import GPT, GPTConfig
from gptlab.train.checkpoint import save_checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    save_checkpoint(sys.argv[1], GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, n_embd=16)))
except OSError as e:
    print(errno.errorcode[e.errno], e.filename)
"""
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    name, filename = r.stdout.split()
    assert name == "EFBIG" and filename.endswith("model.safetensors"), r.stdout
    assert list(tmp_path.iterdir()) == []  # the temporary folder removed
