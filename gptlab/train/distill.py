"""Distillation: train a model to predict like a trained teacher (a draft for speculative decoding).

Where this sits: the training loss of :mod:`gptlab.train.loop` when ``TrainConfig.teacher`` names a
run: ``(1 - w) CE + w KL(teacher || model)`` (:func:`distillation_loss`), the teacher loaded frozen
by :func:`load_teacher`. Chapter 8 trains its distilled draft this way: a draft that guesses like
its target has more of its guesses accepted.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..model import GPT
from .checkpoint import load_model

__all__ = ["distillation_loss", "load_teacher"]


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, ce: torch.Tensor,
                      weight: float) -> torch.Tensor:
    """``(1 - weight) * ce + weight * KL(teacher || model)``, a 0-d tensor.

    logits and teacher_logits (B, T, V): the model's and the teacher's next-token logits for the
    same inputs; ce (0-d): the model's cross-entropy with the true next tokens; weight in [0, 1].
    The KL is the forward one, ``sum_v p_teacher(v) (log p_teacher(v) - log p_model(v))``, averaged
    over the B * T positions and computed in float32. Its gradient pulls the model's whole
    distribution toward the teacher's at every position, not only the observed token's
    probability: what makes a small draft model guess like its target in speculative decoding.
    No gradient reaches the teacher.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    if logits.shape != teacher_logits.shape or logits.dim() != 3:
        raise ValueError(f"logits and teacher_logits must both be (B, T, V), got {tuple(logits.shape)} "
                         f"and {tuple(teacher_logits.shape)}")
    t_logp = F.log_softmax(teacher_logits.detach().float(), dim=-1).flatten(0, 1)  # (B T, V)
    logq = F.log_softmax(logits.float(), dim=-1).flatten(0, 1)
    kl = F.kl_div(logq, t_logp, log_target=True, reduction="batchmean")
    return (1.0 - weight) * ce + weight * kl


def load_teacher(path: str | os.PathLike, device: torch.device, vocab_size: int, block_size: int) -> GPT:
    """The frozen teacher (eval mode, no gradients) in the run or checkpoint ``path``, checked
    against the student's data (the same ``vocab_size``) and context (at least ``block_size``)."""
    try:
        teacher, _ = load_model(path, device=device)
    except (OSError, ValueError) as e:
        raise ValueError(f"TrainConfig.teacher: cannot load a model from {str(path)!r}: {e}") from e
    tc = teacher.config
    if tc.vocab_size != vocab_size:
        raise ValueError(f"TrainConfig.teacher: the teacher's vocabulary has {tc.vocab_size} tokens, "
                         f"the data's {vocab_size}: distillation needs the same tokens")
    if tc.block_size < block_size:
        raise ValueError(f"TrainConfig.teacher: the teacher's block_size ({tc.block_size}) is shorter than "
                         f"the run's ({block_size})")
    teacher.requires_grad_(False)
    return teacher.eval()
