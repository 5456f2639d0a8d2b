"""gptlab.grading.lm_basics: other correct answers pass; edge cases get the right message.

The catalogue of wrong answers is run by tests/test_mutations.py; here, correct answers written
differently from the instructor's solution must pass (a grader that fails a right answer is worse
than none), and the messages for cases the catalogue does not reach are pinned.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gptlab.grading.core import DelegationError, ExerciseError
from gptlab.grading.lm_basics import (
    check_cross_entropy,
    check_decode,
    check_encode,
    check_next_token_batch,
    check_perplexity,
)


def test_other_correct_answers_pass():
    check_encode(lambda text, stoi: list(map(stoi.__getitem__, text)))
    check_decode(lambda ids, itos: "".join(map(itos.__getitem__, ids)))

    def batch_unfold(ids, block_size, starts):
        windows = ids.unfold(0, block_size + 1, 1)[starts]  # (B, T+1)
        return windows[:, :-1], windows[:, 1:]

    def batch_gather(ids, block_size, starts):
        idx = starts[:, None] + torch.arange(block_size + 1)
        w = ids[idx]
        return w[:, :-1], w[:, 1:]

    check_next_token_batch(batch_unfold)
    check_next_token_batch(batch_gather)

    def ce_gather(logits, targets):
        m = logits.detach().max(dim=-1, keepdim=True).values  # a detached maximum is fine
        lse = m.squeeze(-1) + (logits - m).exp().sum(-1).log()
        return (lse - logits.gather(1, targets[:, None]).squeeze(1)).mean()

    def ce_softmax_shifted(logits, targets):
        # log-probabilities from the shifted logits, with the target's logit picked first
        z = logits - logits.amax(1, keepdim=True)
        return (z.exp().sum(1).log() - z[torch.arange(len(targets)), targets]).sum() / len(targets)

    check_cross_entropy(ce_gather)
    check_cross_entropy(ce_softmax_shifted)
    check_perplexity(lambda x: float(np.exp(x)))
    check_perplexity(lambda x: math.e ** x)


def test_reading_past_the_end_is_explained():
    def crashes_at_end(ids, block_size, starts):
        x = torch.stack([ids[s : s + block_size] for s in starts])
        y = torch.stack([ids[s + 1 : s + block_size + 1] + 0 * ids[s + block_size + 1] for s in starts])
        return x, y

    with pytest.raises(ExerciseError, match="reads past the end of ids"):
        check_next_token_batch(crashes_at_end)


def test_cross_entropy_messages():
    def in_place(logits, targets):
        logits.sub_(logits.max(1, keepdim=True).values.detach())
        return (logits.exp().sum(1).log() - logits[torch.arange(len(targets)), targets]).mean()

    with pytest.raises(ExerciseError, match="in-place operation"):  # torch says so itself on a leaf
        check_cross_entropy(in_place)

    def bad_grad(logits, targets):
        z = logits - logits.max(1, keepdim=True).values
        lse = z.exp().sum(1).log().detach()  # the normaliser must not be detached
        return (lse - z[torch.arange(len(targets)), targets]).mean()

    with pytest.raises(ExerciseError, match="gradient"):
        check_cross_entropy(bad_grad)

    def special(logits, targets):
        return -torch.special.log_softmax(logits, 1)[torch.arange(len(targets)), targets].mean()

    with pytest.raises(DelegationError, match="must be written by hand"):
        check_cross_entropy(special)


def test_checks_restore_the_profiler():
    import sys

    def uses_logsumexp(logits, targets):
        return (torch.logsumexp(logits, 1) - logits[torch.arange(len(targets)), targets]).mean()

    with pytest.raises(DelegationError):
        check_cross_entropy(uses_logsumexp)
    assert sys.getprofile() is None
    assert torch.logsumexp(torch.zeros(2), 0).item() == pytest.approx(math.log(2))


def test_not_a_function():
    with pytest.raises(TypeError, match="expects a function"):
        check_encode("encode")
