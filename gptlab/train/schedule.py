"""The learning-rate schedule: :func:`lr_at`, linear warmup then cosine decay, in plain numbers.

Where this sits: the training loop (:mod:`gptlab.train.loop`) sets each optimiser step's learning
rate to ``lr_at(step, cfg)``; the ``gpt_training`` assignment writes the same function by hand.
"""

from __future__ import annotations

import math

from .config import TrainConfig

__all__ = ["lr_at"]


def lr_at(
    step: int,
    max_lr: float | TrainConfig,
    min_lr: float = 0.0,
    warmup: int = 0,
    total: int | None = None,
) -> float:
    """The learning rate at optimiser step ``step`` (0-based), all plain numbers (nanoGPT's schedule):

    * linear warmup from 0 for ``step < warmup``: ``max_lr * (step + 1) / (warmup + 1)`` (so the
      first step already moves, and step ``warmup`` reaches ``max_lr``);
    * then a cosine from ``max_lr`` down to ``min_lr`` at step ``total``:
      ``min_lr + (max_lr - min_lr) * (1 + cos(pi * (step - warmup) / (total - warmup))) / 2``;
    * ``min_lr`` from ``total`` on (``total=None``: no decay, ``max_lr`` after the warmup).

    ``lr_at(step, cfg)`` with a :class:`TrainConfig` reads the numbers from it (``lr``,
    ``min_lr``, ``warmup_steps``, ``lr_decay_steps`` or else ``max_steps``).
    """
    if isinstance(max_lr, TrainConfig):  # the config form
        cfg = max_lr
        return lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.lr_decay_steps or cfg.max_steps)
    if step < warmup:
        return max_lr * (step + 1) / (warmup + 1)
    if total is None:
        return max_lr
    if step >= total:
        return min_lr
    ratio = (step - warmup) / (total - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)
