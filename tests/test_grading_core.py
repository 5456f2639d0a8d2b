"""The grading framework (gptlab.grading.core): calling, delegation, tensor checks, comparisons,
distributions. Each assignment's checks are built from these, so their messages are pinned here."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from gptlab.grading.core import (
    FALSE_FAILURE_RATE,
    DelegationError,
    ExerciseError,
    Forbidden,
    call,
    expect_close,
    expect_distribution,
    expect_tensor,
    forbid,
    same,
)

SDPA = Forbidden(F.scaled_dot_product_attention, "F.scaled_dot_product_attention")
CE = Forbidden(F.cross_entropy, "F.cross_entropy")


# --------------------------------------------------------------------------- delegation


def test_forbid_sees_a_builtin_under_an_alias():
    from torch.nn.functional import scaled_dot_product_attention as renamed

    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(DelegationError, match="called F.scaled_dot_product_attention"):
        with forbid([SDPA], "attend"):
            renamed(q, q, q)


def test_forbid_sees_a_python_function_called_deep_inside():
    def helper(x, y):
        return F.cross_entropy(x, y)

    def learner(x, y):
        return helper(x, y) * 1.0

    with pytest.raises(DelegationError, match="cross_entropy must be written by hand"):
        call(learner, "cross_entropy", torch.randn(4, 3), torch.tensor([0, 1, 2, 0]), forbidden=[Forbidden(F.cross_entropy, "F.cross_entropy")])


def test_forbid_recognises_a_fresh_copy_of_the_same_function():
    """A notebook may hold the function from an earlier import of the module: same code, other object."""
    import importlib

    import gptlab.masks as m

    old = m.causal_mask
    saved = {k: v for k, v in sys.modules.items() if k.startswith("gptlab")}
    try:
        for k in list(saved):
            del sys.modules[k]
        fresh = importlib.import_module("gptlab.masks")
        assert fresh.causal_mask is not old
        with pytest.raises(DelegationError):
            call(lambda T: old(T), "causal_mask", 3, forbidden=[Forbidden(fresh.causal_mask, "gptlab.causal_mask")])
    finally:
        sys.modules.update(saved)


def test_forbid_a_class_catches_its_forward():
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8)
    with pytest.raises(DelegationError, match="nn.MultiheadAttention"):
        call(lambda x: mha(x, x, x)[0], "attention", x, forbidden=[Forbidden(torch.nn.MultiheadAttention, "nn.MultiheadAttention")])


def test_forbid_lets_other_calls_through_and_restores_the_profiler():
    events = []

    def outer(frame, event, arg):
        events.append(event)

    sys.setprofile(outer)
    try:
        out = call(lambda x: torch.softmax(x, -1), "softmax", torch.zeros(3), forbidden=[SDPA, CE])
        assert sys.getprofile() is outer
    finally:
        sys.setprofile(None)
    torch.testing.assert_close(out, torch.full((3,), 1 / 3))
    assert "c_call" in events, "the profiler that was installed first stopped receiving events"


# --------------------------------------------------------------------------- call


def test_call_not_written_yet():
    def blank(x):
        raise NotImplementedError()

    with pytest.raises(ExerciseError, match="not written yet"):
        call(blank, "f", 1)


def test_call_shows_the_input_of_a_crash():
    with pytest.raises(ExerciseError, match=r"f\(tensor\(\[1\.0, 2\.0\]\)\) raised ZeroDivisionError"):
        call(lambda x: 1 / 0, "f", torch.tensor([1.0, 2.0]))


def test_call_rejects_in_place_changes_but_not_nan_inputs():
    x = torch.tensor([1.0, float("nan")])
    assert call(lambda t: t * 2, "f", x).shape == (2,)
    with pytest.raises(ExerciseError, match="in place"):
        call(lambda t: t.mul_(2), "f", x)


# --------------------------------------------------------------------------- expect_tensor


@pytest.mark.parametrize(
    "got,kwargs,says",
    [
        ([1, 2], {}, "should return a torch.Tensor, got list"),
        (None, {}, "did you forget a return statement"),
        (torch.zeros(2, 3), {"shape": (3, 2)}, "should have shape (3, 2), got (2, 3)"),
        (torch.zeros(2, dtype=torch.long), {"dtype": "float"}, "floating-point tensor"),
        (torch.zeros(2), {"dtype": torch.bool}, "should have dtype torch.bool"),
        (torch.tensor([1.0, float("nan")]), {"finite": True}, "nan at index (1,)"),
        (torch.zeros(2, device="meta"), {"device": "cpu"}, "on the device meta, expected cpu"),
    ],
    ids=["list", "none", "shape", "int", "dtype", "nan", "device"],
)
def test_expect_tensor_messages(got, kwargs, says):
    with pytest.raises(ExerciseError) as e:
        expect_tensor(got, "f(x)", **kwargs)
    assert says in str(e.value)


def test_expect_tensor_passes_a_good_tensor():
    t = torch.ones(2, 3, requires_grad=True)
    out = expect_tensor(t * 2, "f", shape=(2, 3), dtype=torch.float32, device="cpu", finite=True)
    assert not out.requires_grad and same(out, torch.full((2, 3), 2.0))


# --------------------------------------------------------------------------- expect_close


def test_expect_close_within_tolerance_passes_and_beyond_fails():
    want = torch.tensor([1.0, 2.0])
    expect_close(want + 5e-6, want, "f", "x", atol=1e-5, rtol=0)
    with pytest.raises(ExerciseError, match=r"largest difference: 2e-05 at index \(0,\)"):
        expect_close(want + torch.tensor([2e-5, 0.0]), want, "f", "x", atol=1e-5, rtol=0)


def test_expect_close_names_the_matching_mistake_and_skips_broken_ones():
    x = torch.tensor([1.0, 2.0, 3.0])
    want = torch.softmax(x, 0)
    mistakes = [
        ("broken candidate", lambda: 1 / 0),
        ("softmax of the negation", lambda: torch.softmax(-x, 0)),
        ("no softmax", lambda: x),
    ]
    with pytest.raises(ExerciseError) as e:
        expect_close(x.clone(), want, "softmax(x)", "x = [1, 2, 3]", atol=1e-6, rtol=1e-5, mistakes=mistakes)
    msg = str(e.value)
    assert "Most likely mistake: no softmax" in msg and "input: x = [1, 2, 3]" in msg and "expected:" in msg


def test_expect_close_cannot_be_fooled_by_a_replaced_torch_allclose(monkeypatch):
    monkeypatch.setattr(torch, "allclose", lambda *a, **k: True)
    monkeypatch.setattr(torch, "equal", lambda *a, **k: True)
    with pytest.raises(ExerciseError):
        expect_close(torch.zeros(2), torch.ones(2), "f", "x", atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- expect_distribution


def _counts(draws: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(draws, minlength=V)


def test_a_correct_sampler_passes_for_many_seeds():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        expect_distribution(_counts(torch.multinomial(probs, 4000, True, generator=g), 5), probs, "sample")


def test_a_wrong_sampler_fails_and_the_mistake_is_named():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    g = torch.Generator().manual_seed(0)
    wrong = torch.softmax(probs, 0)  # softmax applied to probabilities a second time
    draws = torch.multinomial(wrong, 4000, True, generator=g)
    with pytest.raises(ExerciseError) as e:
        expect_distribution(_counts(draws, 4), probs, "sample", mistakes=[("argmax", torch.eye(4)[0]), ("softmax twice", wrong)])
    assert "softmax twice" in str(e.value) and "chi-square" in str(e.value)


def test_drawing_an_impossible_token_fails_at_once():
    with pytest.raises(ExerciseError, match="drew token 2, whose probability is 0"):
        expect_distribution(torch.tensor([10, 10, 1]), torch.tensor([0.5, 0.5, 0.0]), "sample")


def test_false_failure_rate_is_below_one_in_a_million():
    assert FALSE_FAILURE_RATE < 1e-6


def test_expect_close_reports_the_index_of_the_largest_difference_in_several_dimensions():
    want = torch.zeros(2, 3, 4)
    got = want.clone()
    got[1, 2, 3] = 0.5
    got[0, 1, 0] = 0.1
    with pytest.raises(ExerciseError, match=r"largest difference: 0\.5 at index \(1, 2, 3\)"):
        expect_close(got, want, "f", "x", atol=1e-6, rtol=0)


def test_forbid_a_tensor_method_by_name_on_any_tensor():
    lse = Forbidden(torch.Tensor.logsumexp, "Tensor.logsumexp")
    x = torch.randn(3, 4)
    with pytest.raises(DelegationError, match="called Tensor.logsumexp"):
        call(lambda t: t.logsumexp(dim=1), "cross_entropy", x, forbidden=[lse])
    out = call(lambda t: t.exp().sum(1).log(), "cross_entropy", x, forbidden=[lse])  # other methods pass
    torch.testing.assert_close(out, torch.logsumexp(x, 1))


def test_close_compares_shape_values_nan_and_booleans():
    from gptlab.grading.core import close

    a = torch.tensor([1.0, float("nan"), 3.0])
    assert close(a, a.clone(), 0.0, 0.0)  # NaN equals NaN
    assert close(a, [1.0 + 1e-7, float("nan"), 3.0], 1e-6, 0.0)  # a list is turned into a tensor
    assert not close(a, a + 1e-3, 1e-6, 0.0)
    assert not close(a, a.view(1, 3), 1.0, 1.0)  # the shape counts
    assert not close(a, object(), 1.0, 1.0)
    t = torch.tensor([True, False])
    assert close(t, t.clone(), 0.0, 0.0) and not close(t, t.float(), 1.0, 1.0)


def test_show_tensor_prints_short_floats_a_learner_can_read():
    from gptlab.grading.core import describe, show_tensor

    assert show_tensor(torch.tensor([0.1, 1 / 3, 2.0, float("-inf")])) == "[0.1, 0.3333, 2.0, -inf]"
    assert show_tensor(torch.tensor([1e-7, 0.0])) == "[1e-07, 0.0]"  # tiny is not zero
    assert show_tensor(torch.tensor([[1, 2], [3, 4]])) == "[1, 2]\n[3, 4]"
    assert show_tensor(torch.tensor(1 / 3)) == "0.3333"
    assert "first values [0.0, 0.01, 0.02, 0.03, 0.04, 0.05] ..." in show_tensor(torch.arange(100) / 100)
    assert describe(torch.tensor([0.1, 1 / 3])) == "tensor([0.1, 0.3333])"
