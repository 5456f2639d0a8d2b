"""gptlab.data.batch_at: next-token windows at explicit starts (agrees with get_batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gptlab.data import batch_at, get_batch


def test_windows_and_shift():
    data = torch.arange(100, 120)
    x, y = batch_at(data, torch.tensor([0, 3, 12]), 7)
    assert x.shape == y.shape == (3, 7) and x.dtype == y.dtype == torch.int64
    assert x[1].tolist() == list(range(103, 110)) and y[1].tolist() == list(range(104, 111))
    assert torch.equal(y[:, :-1], x[:, 1:])
    # the last start that fits reads the last token as the last target
    x, y = batch_at(data, [12], 7)
    assert y[0, -1].item() == 119


def test_numpy_memmap_like_and_tensor_agree():
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 65, size=500).astype(np.uint16)
    starts = torch.tensor([5, 0, 491, 17])
    xa, ya = batch_at(arr, starts, 8)
    xt, yt = batch_at(torch.from_numpy(arr.astype(np.int64)), starts, 8)
    assert torch.equal(xa, xt) and torch.equal(ya, yt)


def test_same_as_get_batch_with_its_starts():
    data = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(1))
    x, y = get_batch(data, 4, 9, generator=torch.Generator().manual_seed(3))
    starts = torch.randint(300 - 9, (4,), generator=torch.Generator().manual_seed(3))  # get_batch's draw
    xs, ys = batch_at(data, starts, 9)
    assert torch.equal(x, xs) and torch.equal(y, ys)


def test_bad_input():
    data = torch.arange(10)
    with pytest.raises(ValueError, match="out of range"):
        batch_at(data, torch.tensor([3]), 7)  # needs 8 tokens from 3: 3..10
    with pytest.raises(ValueError, match="out of range"):
        batch_at(data, torch.tensor([-1]), 2)
    with pytest.raises(ValueError, match="1-D tensor of integer"):
        batch_at(data, torch.tensor([0.0]), 2)
    with pytest.raises(ValueError, match="smaller than the number of tokens"):
        batch_at(data, torch.tensor([0]), 10)
    with pytest.raises(ValueError, match="positive int"):
        batch_at(data, torch.tensor([0]), 0)
