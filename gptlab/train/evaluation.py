"""Evaluation: a model's validation loss over a fixed set of windows.

Where this sits: text -> tokens -> batches -> model -> logits -> *loss on held-out text*. The
training loop (:mod:`gptlab.train.loop`) scores its model with :func:`mean_cross_entropy` every
``eval_interval`` steps; the graders and chapter 5 cut the same windows with :func:`val_windows`.

The validation set is deterministic: the validation split cut into disjoint windows of
``block_size`` tokens (or only its first ones), so every evaluation scores the same tokens and two
runs' numbers compare. The loss is the mean next-token cross-entropy in nats per token; under
several processes each scores every ``world``-th window and the sums are added up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..data import get_batch
from .distributed import DistInfo, all_sum_

__all__ = ["val_windows", "mean_cross_entropy", "fixed_batch_loss", "sum_dtype"]


def val_windows(val: Any, block_size: int, max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed validation set: the split cut into disjoint windows of ``block_size`` tokens.

    ``val`` is a 1-D stream of token ids (a tensor, array or memmap). Returns ``x``, ``y`` (N, T)
    int64 on the CPU with ``y`` the next tokens, N = (len - 1) // T (or fewer to stay within
    ``max_tokens``). Deterministic: every evaluation scores the same tokens.
    """
    if isinstance(val, torch.Tensor):
        v = val.detach().cpu().to(torch.int64)
    else:
        v = torch.from_numpy(np.asarray(val).astype(np.int64))
    if v.dim() != 1:
        raise ValueError(f"val must be a 1-D stream of token ids, got shape {tuple(v.shape)}")
    n = (len(v) - 1) // block_size
    if max_tokens is not None:
        n = min(n, max_tokens // block_size)
    if n < 1:
        raise ValueError(f"the validation split ({len(v)} tokens) is too short for block_size {block_size}")
    x = v[: n * block_size].view(n, block_size)
    y = v[1 : n * block_size + 1].view(n, block_size)
    return x, y


def sum_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype a loss sum is kept in on ``device``: float64, or float32 on MPS (no float64)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


@torch.no_grad()
def mean_cross_entropy(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device | str | None = None,
    autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    dist: DistInfo | None = None,
) -> float:
    """Mean cross-entropy (nats/token) of ``model`` predicting ``y`` from ``x``, both (N, T) ids.

    ``model(x, y)`` takes a (B, T) batch of inputs and targets and returns ``(logits, loss)`` with
    ``loss`` the mean cross-entropy of the batch (:class:`gptlab.model.GPT`'s forward). The
    windows go through it ``batch_size`` at a time, moved to ``device`` (default: the model's),
    in eval mode (restored afterwards), without gradients, each forward inside a fresh
    ``autocast()`` context (e.g. ``lambda: torch.autocast("cuda", torch.bfloat16)``). The sum is
    kept in float64 (float32 on Apple's MPS, which has no float64).

    With ``dist`` (several processes) rank ``r`` scores windows ``r, r + world, ...`` and the sums
    are all-reduced: every process gets the same mean over all N windows.
    """
    if device is None:
        device = next(model.parameters()).device
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    was_training = model.training
    model.eval()
    try:
        idx = torch.arange(rank, x.shape[0], world)
        total = torch.zeros((), dtype=sum_dtype(device), device=device)
        for i in range(0, len(idx), batch_size):
            sel = idx[i : i + batch_size]
            xb = x[sel].to(device, non_blocking=True)
            yb = y[sel].to(device, non_blocking=True)
            with autocast():
                _, loss = model(xb, yb)
            total += loss.to(total.dtype) * yb.numel()
        if dist is not None:
            all_sum_(total, dist)
    finally:
        model.train(was_training)
    return float(total.item() / y.numel())


def fixed_batch_loss(
    model: nn.Module,
    data: Any,
    *,
    batch_size: int,
    block_size: int,
    seed: int,
    device: torch.device | str,
    autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext,
) -> float:
    """The loss of ``model`` on one fixed batch of ``data`` (the training loop's step-0 train
    loss), drawn by a generator of its own seeded with ``seed`` (the batch streams are not
    touched), in eval mode and without gradients; the model is left in train mode."""
    g = torch.Generator().manual_seed(seed)
    x, y = get_batch(data, batch_size, block_size, generator=g, device=device)
    model.eval()
    with torch.no_grad(), autocast():
        _, loss = model(x, y)
    model.train()
    return float(loss.item())
