"""Distillation: train a model to predict like a trained teacher (a draft for speculative decoding).

Where this sits: the training loss of :mod:`gptlab.train.loop` when ``TrainConfig.teacher`` names a
run: ``(1 - w) CE + w D(teacher, model)`` (:func:`distillation_loss`), the teacher loaded frozen
by :func:`load_teacher`. Chapter 8 trains its distilled draft this way: a draft that guesses like
its target has more of its guesses accepted.

``D`` is the forward KL by default; ``"tv"`` is the total variation distance
``TV(p, q) = 1/2 sum_v |p(v) - q(v)|`` and ``"kl+tv"`` their sum. The TV is exactly what speculative
decoding at temperature 1 loses per guess: a guess drawn from q is kept with probability
``sum_v min(p(v), q(v)) = 1 - TV``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..model import GPT
from .checkpoint import load_model
from .config import DIVERGENCES

__all__ = ["distillation_loss", "load_teacher", "DIVERGENCES"]


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, ce: torch.Tensor,
                      weight: float, divergence: str = "kl") -> torch.Tensor:
    """``(1 - weight) * ce + weight * KL(teacher || model)``, a 0-d tensor; with
    ``divergence="tv"``, ``weight * TV`` instead, with ``"kl+tv"``, ``weight * (KL + TV)``.

    logits and teacher_logits (B, T, V): the model's and the teacher's next-token logits for the
    same inputs; ce (0-d): the model's cross-entropy with the true next tokens; weight in [0, 1].
    The KL is the forward one, ``sum_v p_teacher(v) (log p_teacher(v) - log p_model(v))``, averaged
    over the B * T positions and computed in float32. Its gradient pulls the model's whole
    distribution toward the teacher's at every position, not only the observed token's
    probability: what makes a small draft model guess like its target in speculative decoding.
    No gradient reaches the teacher.

    ``TV = 1/2 sum_v |p_teacher(v) - p_model(v)|`` (averaged over the positions too) is one minus the
    probability that speculative decoding at temperature 1 keeps a guess the model drew; the KL
    bounds it (Pinsker: ``TV <= sqrt(KL / 2)``). The KL's pull on each logit grows with the gap
    between the two distributions (``q - p``), the TV's depends only on the gaps' signs: from scratch
    the KL trains a draft faster, alone or under the TV; after it, as a second stage
    (``TrainConfig.init_from``), the TV raised a small draft's acceptance more than as many more
    steps of the KL (``bench speculative``'s draft, ``benchmarks/results/README.md``).
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if logits.shape != teacher_logits.shape or logits.dim() != 3:
        raise ValueError(f"logits and teacher_logits must both be (B, T, V), got {tuple(logits.shape)} "
                         f"and {tuple(teacher_logits.shape)}")
    t_logp = F.log_softmax(teacher_logits.detach().float(), dim=-1).flatten(0, 1)  # (B T, V)
    logq = F.log_softmax(logits.float(), dim=-1).flatten(0, 1)
    d = 0.0
    if divergence in ("kl", "kl+tv"):
        d = F.kl_div(logq, t_logp, log_target=True, reduction="batchmean")
    if divergence in ("tv", "kl+tv"):
        d = d + 0.5 * (t_logp.exp() - logq.exp()).abs().sum(-1).mean()
    return (1.0 - weight) * ce + weight * d


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
