"""gptlab.sampling against Hugging Face's logits processors, OpenAI's penalty formula, and statistics."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from gptlab.sampling import (
    apply_frequency_penalty,
    apply_presence_penalty,
    apply_repetition_penalty,
    apply_temperature,
    greedy_filter,
    min_p_filter,
    process_logits,
    sample_next,
    token_counts,
    top_k_filter,
    top_p_filter,
)

import transformers.generation.logits_process as lp  # noqa: E402
import scipy.stats as stats  # noqa: E402

V = 40


def _logit_cases():
    g = torch.Generator().manual_seed(0)
    cases = {
        "normal": torch.randn(4, V, generator=g) * 3,
        # many exact ties (integers), so the k-th value and the nucleus boundary are tied
        "ties": torch.randint(-3, 3, (4, V), generator=g).float(),
        "all_equal": torch.zeros(3, V),
        "peaked": torch.cat([torch.full((2, 1), 30.0), torch.randn(2, V - 1, generator=g)], dim=1),
    }
    with_inf = torch.randn(3, V, generator=g)
    with_inf[:, ::3] = float("-inf")  # already-filtered entries
    cases["with_-inf"] = with_inf
    return cases


CASES = _logit_cases()
IDS = torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(1))


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.equal(torch.isinf(a), torch.isinf(b)), "different tokens filtered out"
    torch.testing.assert_close(a[~torch.isinf(a)], b[~torch.isinf(b)], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("t", [0.3, 1.0, 1.7])
def test_temperature_matches_hf(name, t):
    x = CASES[name]
    _same(apply_temperature(x, t), lp.TemperatureLogitsWarper(t)(None, x.clone()))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("k", [1, 2, 5, 17, V - 1, V, V + 10])
def test_top_k_matches_hf(name, k):
    x = CASES[name]
    ours = top_k_filter(x, k)
    _same(ours, lp.TopKLogitsWarper(k)(None, x.clone()))
    # ties at the k-th value are kept, so at least min(k, V) survive (finite or not)
    assert ((~torch.isinf(ours)) | torch.isinf(x)).sum(-1).min() >= min(k, V)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("p", [1e-9, 0.05, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_top_p_matches_hf(name, p):
    x = CASES[name]
    ours = top_p_filter(x, p)
    _same(ours, lp.TopPLogitsWarper(p)(None, x.clone()))
    kept = ~torch.isinf(ours)
    assert kept.sum(-1).min() >= 1  # never empty
    probs = torch.softmax(x, -1)
    assert ((probs * kept).sum(-1) >= p - 1e-5).all()  # the kept set reaches p


def test_top_p_keeps_smallest_set():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda p: (~torch.isinf(top_p_filter(x, p))).squeeze(0).tolist()  # noqa: E731
    assert keep(0.5) == [True, False, False, False]
    assert keep(0.6) == [True, True, False, False]
    assert keep(0.81) == [True, True, True, False]
    assert keep(1e-9) == [True, False, False, False]
    assert keep(1.0) == [True, True, True, True]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("m", [0.0, 0.05, 0.2, 0.9, 1.0])
def test_min_p_matches_hf(name, m):
    x = CASES[name]
    _same(min_p_filter(x, m), lp.MinPLogitsWarper(m)(None, x.clone()))


@pytest.mark.parametrize("name", ["normal", "ties", "peaked", "with_-inf"])
@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 3.0])
def test_repetition_penalty_matches_hf(name, penalty):
    x = CASES[name]
    ids = IDS[: x.shape[0]]
    _same(apply_repetition_penalty(x, ids, penalty), lp.RepetitionPenaltyLogitsProcessor(penalty)(ids, x.clone()))


def test_repetition_penalty_divides_positive_multiplies_negative():
    x = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    ids = torch.tensor([[0, 1, 1, 0]])  # repeated ids are penalised once
    out = apply_repetition_penalty(x, ids, 2.0)
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]
    # the mask leaves (padded) positions out
    out = apply_repetition_penalty(x, ids, 2.0, mask=torch.tensor([[0, 1, 1, 0]]))
    assert out.tolist() == [[2.0, -4.0, 2.0, -2.0]]


def _openai_reference(logits, ids, freq, pres):
    out = logits.clone()
    for b in range(ids.shape[0]):
        for tok, c in Counter(ids[b].tolist()).items():
            out[b, tok] -= freq * c + pres * (c > 0)
    return out


@pytest.mark.parametrize("freq,pres", [(0.5, 0.0), (0.0, 0.7), (0.4, 1.1), (-0.3, -0.2)])
def test_frequency_presence_penalties_match_openai_formula(freq, pres):
    x = CASES["normal"]
    ref = _openai_reference(x, IDS, freq, pres)
    out = apply_presence_penalty(apply_frequency_penalty(x, IDS, freq), IDS, pres)
    torch.testing.assert_close(out, ref)
    out2 = process_logits(x, IDS, frequency_penalty=freq, presence_penalty=pres)
    torch.testing.assert_close(out2, ref)


def test_token_counts():
    ids = torch.tensor([[1, 1, 3, 7], [0, 0, 0, 2]])
    c = token_counts(ids, 5)  # id 7 is outside the vocabulary: ignored
    assert c.tolist() == [[0, 2, 0, 1, 0], [3, 0, 1, 0, 0]]
    c = token_counts(ids, 5, mask=torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]]))
    assert c.tolist() == [[0, 1, 0, 1, 0], [1, 0, 1, 0, 0]]


@pytest.mark.parametrize("name", list(CASES))
def test_process_logits_matches_hf_chain(name):
    x = CASES[name]
    ids = IDS[: x.shape[0]]
    kw = dict(repetition_penalty=1.2, temperature=0.7, top_k=9, top_p=0.8, min_p=0.05)
    hf = lp.LogitsProcessorList(
        [
            lp.RepetitionPenaltyLogitsProcessor(1.2),
            lp.TemperatureLogitsWarper(0.7),
            lp.TopKLogitsWarper(9),
            lp.TopPLogitsWarper(0.8),
            lp.MinPLogitsWarper(0.05),
        ]
    )
    _same(process_logits(x, ids, **kw), hf(ids, x.clone()))


def test_temperature_zero_is_greedy():
    x = CASES["ties"]
    out = process_logits(x, temperature=0, top_k=3, top_p=0.5)
    assert (~torch.isinf(out)).sum(-1).tolist() == [1] * x.shape[0]
    assert torch.equal(out.argmax(-1), x.argmax(-1))  # first maximum, as torch.argmax
    assert torch.equal(greedy_filter(x), out)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(out, g).squeeze(1), x.argmax(-1))


@pytest.mark.parametrize(
    "call",
    [
        lambda x: apply_temperature(x, -0.1),
        lambda x: apply_temperature(x, 0.0),
        lambda x: top_k_filter(x, 0),
        lambda x: top_k_filter(x, -3),
        lambda x: top_p_filter(x, 0.0),
        lambda x: top_p_filter(x, 1.5),
        lambda x: top_p_filter(x, -0.2),
        lambda x: min_p_filter(x, 1.5),
        lambda x: min_p_filter(x, -0.1),
        lambda x: apply_repetition_penalty(x, IDS[:4], 0.0),
        lambda x: apply_repetition_penalty(x, IDS[:4], -1.0),
        lambda x: apply_repetition_penalty(x, IDS[:2], 1.2),  # batch mismatch
        lambda x: process_logits(x, temperature=-1.0),
        lambda x: process_logits(x, temperature=0, top_k=0),  # validated even when greedy
        lambda x: process_logits(x, repetition_penalty=1.2),  # needs input_ids
    ],
)
def test_bad_arguments_raise_value_error(call):
    with pytest.raises(ValueError):
        call(CASES["normal"])


def test_bad_types_raise_type_error():
    x = CASES["normal"]
    with pytest.raises(TypeError):
        top_k_filter(x, 2.5)
    with pytest.raises(TypeError):
        top_k_filter(x.long(), 2)
    with pytest.raises(TypeError):
        apply_temperature([1.0, 2.0], 1.0)


def test_inputs_never_modified_in_place():
    for x in CASES.values():
        ids = IDS[: x.shape[0]]
        before, ids_before = x.clone(), ids.clone()
        outs = [
            apply_temperature(x, 0.5),
            top_k_filter(x, 3),
            top_p_filter(x, 0.5),
            min_p_filter(x, 0.1),
            greedy_filter(x),
            apply_repetition_penalty(x, ids, 1.5),
            apply_frequency_penalty(x, ids, 0.5),
            apply_presence_penalty(x, ids, 0.5),
            process_logits(x, ids, temperature=0.5, top_k=5, top_p=0.9, repetition_penalty=1.3),
        ]
        assert torch.equal(x, before) and torch.equal(ids, ids_before)
        assert all(o.data_ptr() != x.data_ptr() for o in outs)


# --------------------------------------------------------------------------- statistics


def _draws(logits_row: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return sample_next(logits_row.expand(n, -1), g).squeeze(1)


def _chi2_pvalue(draws: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    expected = probs[support].double()
    expected = expected / expected.sum() * draws.numel()
    return float(stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=6), dict(top_p=0.7), dict(top_k=8, top_p=0.8, temperature=0.8), dict(min_p=0.1, temperature=1.3)],
)
def test_sampling_follows_renormalised_filtered_distribution(kw):
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(3)) * 1.5
    filtered = process_logits(logits, **kw)
    probs = torch.softmax(filtered, -1)[0]
    n = 20000
    draws = _draws(filtered, n, seed=4)
    assert _chi2_pvalue(draws, probs) > 1e-3
    # the test has power: the same draws are far from the unfiltered distribution
    unfiltered = torch.softmax(logits, -1)[0]
    counts = torch.bincount(draws, minlength=20).double()
    expected = unfiltered.double() / unfiltered.double().sum() * n
    p_wrong = stats.chisquare(counts.numpy(), expected.numpy()).pvalue
    assert p_wrong < 1e-6


def test_sample_next_is_reproducible_and_shaped():
    x = CASES["normal"]
    a = sample_next(x, torch.Generator().manual_seed(7))
    b = sample_next(x, torch.Generator().manual_seed(7))
    assert a.shape == (x.shape[0], 1) and a.dtype == torch.int64
    assert torch.equal(a, b)


def test_sample_from_probs_draws_what_torch_multinomial_draws():
    """The exponential race is torch.multinomial's own one-sample algorithm: same generator state,
    same tokens (so gptlab's sampled decoding equals HF's, which calls multinomial), and a
    probability-0 token is never drawn."""
    from gptlab.sampling import sample_from_probs

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 50, generator=g), -1)
    probs[:, :10] = 0.0  # filtered-out tokens
    probs = probs / probs.sum(-1, keepdim=True)
    buffer = torch.empty_like(probs)  # the noise drawn into a buffer reused from draw to draw
    for seed in range(20):
        want = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))
        got = sample_from_probs(probs, torch.Generator().manual_seed(seed))
        assert got.shape == (64, 1) and got.dtype == torch.int64
        assert torch.equal(got, want)
        assert bool((got >= 10).all())
        assert torch.equal(sample_from_probs(probs, torch.Generator().manual_seed(seed), buffer), want)
