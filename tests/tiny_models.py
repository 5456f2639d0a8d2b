"""The one builder of the test suite's tiny random models (each test file picks its own sizes)."""

from __future__ import annotations

import torch

from gptlab import GPT, GPTConfig


def tiny_gpt(seed: int = 0, *, scale: float | None = None, std: float | None = None, eval_mode: bool = True,
             **config) -> GPT:
    """``GPT(GPTConfig(**config))`` initialised under ``torch.manual_seed(seed)``.

    ``scale`` multiplies every matrix (peaked next-token distributions: no near-ties that float
    rounding could flip between implementations); ``std`` redraws every matrix from N(0, std^2)
    instead. In eval mode unless ``eval_mode=False``.
    """
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**config))
    if scale is not None or std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, std) if std is not None else p.mul_(scale)
    return model.eval() if eval_mode else model
