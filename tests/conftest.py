"""Shared pytest set-up for the gptlab test suite.

* Every test process uses one torch thread: the tests run tiny models, which are dominated by
  per-op overhead (several threads only contend, badly so on a busy machine), and under
  pytest-xdist the workers already share the cores.
* ``GPTLAB_SEED_DIR`` defaults to ``../shared/data`` when that folder exists (development machines
  and CI), so the data cache can be seeded offline; the project works without it.
* Tests marked ``gpu`` are skipped, with the reason, when no CUDA device is available.
* A test that changes torch's thread count (training with ``num_threads``) gets it restored after.
* Decoders run the Python decode step (``gptlab.fast.native.PythonDecoder``, or the model's own
  step where that cannot reproduce the model) even where the C++ one is built in the user's cache
  (``python -m gptlab build-native``), so a test's path does not depend on what that cache holds;
  tests marked ``native`` (tests/test_native.py) build it in a folder of their own and use it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)
    seed = REPO_ROOT.parent / "shared" / "data"
    if "GPTLAB_SEED_DIR" not in os.environ and seed.is_dir():
        os.environ["GPTLAB_SEED_DIR"] = str(seed)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Every test ends with torch's thread count as it began (training sets its own)."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _python_decode_step(request):
    """The Python decode step unless the test is marked ``native`` (see the module's docstring)."""
    if request.node.get_closest_marker("native"):
        yield
        return
    from gptlab.fast import native

    with native.disabled():
        yield


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository's root folder."""
    return REPO_ROOT


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty, private gptlab cache folder (``$GPTLAB_CACHE``) for one test."""
    cache = tmp_path / "gptlab-cache"
    cache.mkdir()
    monkeypatch.setenv("GPTLAB_CACHE", str(cache))
    return cache
