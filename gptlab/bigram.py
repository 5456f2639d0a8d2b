"""A count-based bigram model: the first baseline every later language model must beat.

Where this sits: text -> tokens -> batches -> *model* -> logits -> *loss* | samples -> text. The
"model" here has no parameters to train: it counts, in the training ids, how often token ``b``
follows token ``a``, and predicts

    p(b | a) = (count(a, b) + alpha) / (count(a, .) + alpha * V)

(add-alpha, or Laplace, smoothing: ``alpha > 0`` gives every pair a small probability, so a pair
never seen in training does not cost an infinite loss). Its mean negative log-likelihood on held-
out ids is the number a neural model has to get below; :func:`shakespeare_bigram_baseline`
measures it on Tiny Shakespeare's validation split (nanoGPT's split, 65 characters), so later
chapters import the figure instead of retyping it.

* :func:`bigram_counts`: token ids (N,) -> counts (V, V), ``counts[a, b]`` = number of times
  ``b`` follows ``a``.
* :class:`BigramModel`: ``fit`` from ids, ``log_probs`` (V, V), ``loss`` on ids, ``sample``.
* :func:`perplexity`: ``exp(mean NLL in nats)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["bigram_counts", "BigramModel", "perplexity", "shakespeare_bigram_baseline"]


def _as_ids(ids: Any, vocab_size: int, what: str = "ids") -> Tensor:
    """list/tuple of ints, 1-D numpy array (memmap) or 1-D integer tensor -> int64 CPU tensor (N,)."""
    if isinstance(ids, Tensor):
        t = ids.detach().cpu()
    elif isinstance(ids, np.ndarray):
        t = torch.from_numpy(np.asarray(ids).astype(np.int64))
    elif isinstance(ids, (list, tuple)):
        if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
            raise TypeError(f"{what} must be ints")
        t = torch.tensor(list(ids), dtype=torch.int64)
    else:
        raise TypeError(f"{what} must be a list of ints, a 1-D numpy array or a 1-D tensor, got {type(ids).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{what} must be 1-D (a stream of token ids), got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{what} must be integer token ids, got dtype {t.dtype}")
    t = t.long()
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        bad = t[(t < 0) | (t >= vocab_size)][0].item()
        raise ValueError(f"{what} contains {bad}, outside the vocabulary 0..{vocab_size - 1}")
    return t


def _check_vocab_size(vocab_size: Any) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    return int(vocab_size)


def bigram_counts(ids: Sequence[int] | np.ndarray | Tensor, vocab_size: int) -> Tensor:
    """Count the adjacent pairs of a token stream.

    Args:
        ids: (N,) token ids in ``0 .. vocab_size - 1``.
        vocab_size: V.

    Returns:
        (V, V) int64 tensor, ``counts[a, b]`` = number of ``t`` with ``ids[t] == a`` and
        ``ids[t + 1] == b``; it sums to ``N - 1``.
    """
    V = _check_vocab_size(vocab_size)
    t = _as_ids(ids, V)
    pair = t[:-1] * V + t[1:]  # one index per (a, b) pair, row-major
    return torch.bincount(pair, minlength=V * V).reshape(V, V)


def perplexity(mean_nll: float) -> float:
    """``exp(mean_nll)``: the perplexity of a mean negative log-likelihood in nats (natural log).

    A model with perplexity P is as unsure as a uniform choice among P tokens; a uniform guess
    over V tokens has loss ``ln V`` and perplexity ``V``.
    """
    if isinstance(mean_nll, Tensor):
        if mean_nll.numel() != 1:
            raise ValueError(f"perplexity expects one number (a mean loss), got shape {tuple(mean_nll.shape)}")
        mean_nll = mean_nll.item()
    if isinstance(mean_nll, bool) or not isinstance(mean_nll, (int, float, np.floating, np.integer)):
        raise TypeError(f"perplexity expects a float (a mean loss in nats), got {type(mean_nll).__name__}")
    if math.isnan(mean_nll) or mean_nll < 0:
        raise ValueError(f"a mean negative log-likelihood is >= 0, got {mean_nll}")
    return math.exp(mean_nll)


class BigramModel:
    """p(next | previous) from counted pairs with add-alpha smoothing.

    Args:
        counts: (V, V) pair counts (see :func:`bigram_counts`), non-negative.
        alpha: the pseudo-count added to every pair, ``>= 0``. With ``alpha == 0`` every row must
            have at least one count (an unseen previous token would have no distribution).

    Attributes:
        counts: (V, V) int64.
        alpha: float.
        probs: (V, V) float64, every row sums to 1.
        log_probs: (V, V) float64, ``log(probs)`` (``-inf`` for an unseen pair when ``alpha == 0``).
    """

    def __init__(self, counts: Tensor, alpha: float = 1.0):
        if not isinstance(counts, Tensor) or counts.dim() != 2 or counts.shape[0] != counts.shape[1]:
            shape = tuple(counts.shape) if isinstance(counts, Tensor) else type(counts).__name__
            raise ValueError(f"counts must be a square (V, V) tensor, got {shape}")
        if counts.is_floating_point() or counts.dtype == torch.bool or counts.is_complex():
            raise TypeError(f"counts must be integers, got dtype {counts.dtype}")
        if counts.numel() == 0 or bool((counts < 0).any()):
            raise ValueError("counts must be non-empty and non-negative")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
        self.counts = counts.detach().cpu().long()
        self.alpha = float(alpha)
        smoothed = self.counts.double() + self.alpha
        totals = smoothed.sum(dim=1, keepdim=True)  # (V, 1) = count(a, .) + alpha * V
        if bool((totals == 0).any()):
            a = int((totals[:, 0] == 0).nonzero()[0])
            raise ValueError(f"token {a} never occurs as a previous token and alpha is 0: its row has no "
                             "distribution; use alpha > 0")
        self.probs: Tensor = smoothed / totals  # (V, V)
        self.log_probs: Tensor = smoothed.log() - totals.log()  # (V, V)

    @classmethod
    def fit(cls, ids: Sequence[int] | np.ndarray | Tensor, vocab_size: int, alpha: float = 1.0) -> "BigramModel":
        """Count the pairs of ``ids`` (N,) and smooth them with ``alpha``."""
        return cls(bigram_counts(ids, vocab_size), alpha)

    @property
    def vocab_size(self) -> int:
        return int(self.counts.shape[0])

    def nll(self, ids: Sequence[int] | np.ndarray | Tensor) -> Tensor:
        """The negative log-likelihood of every next token: ids (N,) -> (N - 1,) float64 nats."""
        t = _as_ids(ids, self.vocab_size)
        if t.numel() < 2:
            raise ValueError(f"need at least 2 token ids (one pair) to score, got {t.numel()}")
        return -self.log_probs[t[:-1], t[1:]]

    def loss(self, ids: Sequence[int] | np.ndarray | Tensor) -> float:
        """Mean negative log-likelihood (nats) of ``ids[t + 1]`` given ``ids[t]`` over the N - 1 pairs."""
        return float(self.nll(ids).mean())

    def sample(self, n: int, start: int, *, generator: torch.Generator | None = None) -> list[int]:
        """Draw ``n`` tokens, each from ``p(. | previous token)``, after the token ``start``.

        Returns the ``n`` new ids (``start`` not included). A seeded CPU ``generator`` makes it
        reproducible.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start < self.vocab_size:
            raise ValueError(f"start must be a token id in 0..{self.vocab_size - 1}, got {start!r}")
        out, prev = [], int(start)
        for _ in range(int(n)):
            prev = int(torch.multinomial(self.probs[prev], 1, generator=generator))
            out.append(prev)
        return out

    def __repr__(self) -> str:
        return f"BigramModel(vocab_size={self.vocab_size}, alpha={self.alpha:g}, pairs={int(self.counts.sum())})"


def shakespeare_bigram_baseline(alpha: float = 1.0) -> dict[str, float]:
    """Fit the character bigram model on Tiny Shakespeare's training split, score both splits.

    Uses :func:`gptlab.data.prepare_char_data` (nanoGPT's split, 65 characters). Returns
    ``{"alpha", "train_loss", "val_loss", "val_perplexity"}`` (losses in nats per character):
    the validation loss is the baseline later chapters' models must beat. Takes well under a second
    once the data is prepared.
    """
    from .data import prepare_char_data

    data = prepare_char_data(quiet=True)
    model = BigramModel.fit(data.train, data.vocab_size, alpha)
    val = model.loss(data.val)
    return {"alpha": float(alpha), "train_loss": model.loss(data.train), "val_loss": val,
            "val_perplexity": perplexity(val)}
