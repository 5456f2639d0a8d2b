"""Atomic folder writes (gptlab.files.atomic_dir) and the JSON-safe RNG states (gptlab.train.rng)."""

from __future__ import annotations

import json
import os
import random
import stat

import numpy as np
import pytest
import torch

from gptlab import files
from gptlab.train import rng


def test_atomic_dir_creates_then_replaces_a_folder(tmp_path):
    target = tmp_path / "run" / "ck"  # the parent is created
    with files.atomic_dir(target) as tmp:
        assert tmp.parent == target.parent and tmp != target
        (tmp / "a.txt").write_text("one")
    assert (target / "a.txt").read_text() == "one"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(target / "a.txt").st_mode) == 0o644
    with files.atomic_dir(target) as tmp:
        (tmp / "b.txt").write_text("two")
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]  # replaced as a whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["ck"]  # nothing left beside it


def test_atomic_dir_failure_leaves_the_folder_untouched(tmp_path):
    target = tmp_path / "ck"
    with files.atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("one")
    with pytest.raises(RuntimeError, match="interrupted"):
        with files.atomic_dir(target) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("interrupted")
    assert (target / "a.txt").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_atomic_dir_crash_between_renames_keeps_the_previous_folder_aside(tmp_path, monkeypatch):
    target = tmp_path / "ck"
    with files.atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("one")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed (injected)")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_dir(target) as tmp:
            (tmp / "a.txt").write_text("two")
    monkeypatch.undo()
    aside = files.kept_aside(target)
    assert aside.name == ".ck.old" and not target.exists()
    assert (aside / "a.txt").read_text() == "one"  # the previous folder survives
    with files.atomic_dir(target) as tmp:  # the next write takes its place and cleans up
        (tmp / "a.txt").write_text("three")
    assert (target / "a.txt").read_text() == "three"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_rng_state_round_trips_through_json():
    g = torch.Generator().manual_seed(3)
    random.seed(1), np.random.seed(2), torch.manual_seed(4)
    saved = json.loads(json.dumps(rng.rng_state(g)))
    want = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=g))
    random.seed(9), np.random.seed(9), torch.manual_seed(9), g.manual_seed(9)
    rng.set_rng_state(saved, g)
    got = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=g))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


def test_set_rng_state_rejects_bad_states():
    with pytest.raises(TypeError, match="dict"):
        rng.set_rng_state([1, 2])
    with pytest.raises(ValueError, match="batch-generator"):
        rng.set_rng_state(rng.rng_state(), torch.Generator())
