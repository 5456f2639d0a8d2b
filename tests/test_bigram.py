"""gptlab.bigram: the count-based bigram baseline, checked by hand and against PyTorch's loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

from gptlab.bigram import BigramModel, bigram_counts, perplexity, shakespeare_bigram_baseline

IDS = [0, 1, 2, 1, 0, 1, 1, 2, 0]  # pairs: 01 12 21 10 01 11 12 20


def test_counts_by_hand():
    c = bigram_counts(IDS, 4)
    want = torch.zeros(4, 4, dtype=torch.int64)
    for a, b in zip(IDS, IDS[1:]):
        want[a, b] += 1
    assert torch.equal(c, want)
    assert c.sum().item() == len(IDS) - 1
    assert c[0, 1].item() == 2 and c[1, 2].item() == 2 and c[3].sum().item() == 0
    # the same from a numpy array and a tensor
    assert torch.equal(bigram_counts(np.array(IDS, dtype=np.uint16), 4), c)
    assert torch.equal(bigram_counts(torch.tensor(IDS), 4), c)


def test_loss_equals_hand_computation_and_cross_entropy():
    alpha, V = 0.5, 4
    model = BigramModel.fit(IDS, V, alpha)
    counts = bigram_counts(IDS, V)
    test_ids = [2, 1, 1, 0, 3, 0]  # includes pairs never seen in training (1->1 seen, 0->3 and 3->0 not)
    hand = 0.0
    for a, b in zip(test_ids, test_ids[1:]):
        p = (counts[a, b].item() + alpha) / (counts[a].sum().item() + alpha * V)
        hand -= math.log(p)
    hand /= len(test_ids) - 1
    assert model.loss(test_ids) == pytest.approx(hand, rel=1e-12)
    t = torch.tensor(test_ids)
    # log_probs rows are log-softmaxed already, so cross_entropy on them gives the same mean NLL
    ce = F.cross_entropy(model.log_probs[t[:-1]], t[1:])
    assert model.loss(test_ids) == pytest.approx(ce.item(), rel=1e-12)
    assert torch.allclose(model.probs.sum(1), torch.ones(V, dtype=torch.float64))
    assert torch.allclose(model.log_probs.exp(), model.probs)


def test_smoothing():
    V = 4
    # token 3 never occurs, so its row has no counts: without smoothing it has no distribution
    with pytest.raises(ValueError, match="alpha is 0"):
        BigramModel.fit(IDS, V, alpha=0.0)
    # alpha = 0 on a stream where every token occurs as a previous token: the raw frequencies
    ids = [0, 1, 0, 0, 1, 1, 0]
    m0 = BigramModel.fit(ids, 2, alpha=0.0)
    assert torch.allclose(m0.probs, torch.tensor([[1 / 3, 2 / 3], [2 / 3, 1 / 3]], dtype=torch.float64))
    m3 = BigramModel.fit(IDS, V, alpha=1.0)
    assert torch.allclose(m3.probs[3], torch.full((V,), 1 / V, dtype=torch.float64))  # unseen row: uniform
    # an unseen pair costs infinity without smoothing, a finite amount with it
    m0b = BigramModel.fit([0, 0, 1, 1, 0], 2, alpha=0.0)  # pairs 00 01 11 10: all seen
    assert math.isfinite(m0b.loss([0, 1, 0]))
    m_unseen = BigramModel(torch.tensor([[3, 0], [1, 1]]), alpha=0.0)
    assert m_unseen.loss([0, 1]) == math.inf
    assert math.isfinite(BigramModel(torch.tensor([[3, 0], [1, 1]]), alpha=0.1).loss([0, 1]))
    # a huge alpha tends to the uniform guess, loss ln(V)
    big = BigramModel.fit(IDS, V, alpha=1e9)
    assert big.loss(IDS) == pytest.approx(math.log(V), rel=1e-6)


def test_sample_follows_the_rows():
    counts = torch.tensor([[1, 5, 2], [4, 0, 4], [1, 1, 6]])
    model = BigramModel(counts, alpha=0.0)
    g = torch.Generator().manual_seed(0)
    draws = model.sample(6000, start=0, generator=g)
    assert len(draws) == 6000 and set(draws) <= {0, 1, 2}
    assert 1 not in {b for a, b in zip(draws, draws[1:]) if a == 1}  # p(1 | 1) = 0
    transitions = bigram_counts([0] + draws, 3)
    for a in range(3):
        n = transitions[a].sum().item()
        p = model.probs[a]
        keep = p > 0
        # a correct sampler fails this with probability 1e-6 per row
        assert chisquare(transitions[a][keep].double().numpy(), (p[keep] * n).numpy()).pvalue > 1e-6
    again = model.sample(50, start=0, generator=torch.Generator().manual_seed(0))
    assert again == draws[:50]


def test_perplexity():
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(65)) == pytest.approx(65)
    assert perplexity(torch.tensor(1.5)) == pytest.approx(math.exp(1.5))
    with pytest.raises(ValueError, match=">= 0"):
        perplexity(-0.1)
    with pytest.raises(TypeError, match="float"):
        perplexity("2.0")


def test_bad_input():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bigram_counts([0, 4], 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bigram_counts([-1, 0], 4)
    with pytest.raises(ValueError, match="1-D"):
        bigram_counts(torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(TypeError, match="integer"):
        bigram_counts(torch.zeros(3), 4)
    with pytest.raises(TypeError, match="list of ints"):
        bigram_counts("abc", 4)
    with pytest.raises(ValueError, match="vocab_size"):
        bigram_counts([0, 1], 0)
    with pytest.raises(ValueError, match="square"):
        BigramModel(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="non-negative"):
        BigramModel(torch.tensor([[1, -1], [0, 1]]))
    with pytest.raises(ValueError, match="alpha"):
        BigramModel(torch.ones(2, 2, dtype=torch.long), alpha=-1)
    model = BigramModel.fit(IDS, 4)
    with pytest.raises(ValueError, match="at least 2"):
        model.loss([1])
    with pytest.raises(ValueError, match="start"):
        model.sample(3, start=4)


def test_shakespeare_baseline():
    base = shakespeare_bigram_baseline()
    # a bigram model knows the previous character: far better than a uniform guess over 65
    assert base["val_loss"] < math.log(65) - 1.5
    assert base["train_loss"] < base["val_loss"] < base["train_loss"] + 0.1
    assert base["val_perplexity"] == pytest.approx(math.exp(base["val_loss"]))
