"""Graded exercises: the causal_mask checks in gptlab.grading.

* Each typical mistake, written as real code, gets its own diagnosis; correct answers written in
  different styles all pass.
* The nbgrader round trip of every assignment (release byte for byte, solution full marks, blank
  zero, planted mistakes diagnosed, tampering) is in ``tests/test_course.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gptlab
from gptlab.grading import (
    DelegationError,
    ExerciseError,
    check_causal_attention_weights,
    check_causal_mask,
    diagnose_mask,
    reference_causal_attention_weights,
)

REPO = Path(__file__).resolve().parent.parent
NINF = float("-inf")


# --------------------------------------------------------------------------- check_causal_mask


def test_the_reference_itself_is_delegation():
    """Handing in gptlab's own function is not an answer: the task asks for it by hand."""
    with pytest.raises(DelegationError, match="gptlab.causal_mask"):
        check_causal_mask(gptlab.causal_mask)


@pytest.mark.parametrize(
    "fn",
    [
        lambda T: torch.tril(torch.ones(T, T)).bool(),
        lambda T: torch.arange(T)[None, :] <= torch.arange(T)[:, None],
        lambda T: ~torch.ones(T, T, dtype=torch.bool).triu(1),
    ],
    ids=["tril-bool", "arange", "not-strict-upper"],
)
def test_correct_masks_pass(fn):
    check_causal_mask(fn)


MASK_MISTAKES = {
    "upper triangle": (lambda T: torch.ones(T, T, dtype=torch.bool).triu(), "you let tokens attend to the future"),
    "inverted convention": (
        lambda T: torch.ones(T, T, dtype=torch.bool).triu(1),
        "True = may attend",
    ),
    "diagonal excluded": (
        lambda T: torch.ones(T, T, dtype=torch.bool).tril(-1),
        "a token must be able to attend to itself",
    ),
    "float 0/1": (lambda T: torch.ones(T, T).tril(), "PyTorch treats a float mask as numbers to ADD"),
    "additive mask": (
        lambda T: torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), NINF),
        "additive mask",
    ),
    "no mask": (lambda T: torch.ones(T, T, dtype=torch.bool), "every token can attend to the future"),
    "sees one ahead": (lambda T: torch.ones(T, T, dtype=torch.bool).tril(1), "see 1 token(s) ahead"),
    "hard-coded size": (lambda T: torch.ones(5, 5, dtype=torch.bool).tril(), "hard-code the size"),
    "list, not tensor": (lambda T: torch.ones(T, T, dtype=torch.bool).tril().tolist(), "should return a torch.Tensor"),
    "not written": (lambda T: (_ for _ in ()).throw(NotImplementedError()), "not written yet"),
    "crashes": (lambda T: torch.ones(T).tril(), "raised RuntimeError"),
}


def _assert_diagnosed(check, mistakes: dict, mistake: str) -> None:
    """``check`` rejects the planted mistake ``mistakes[mistake]`` with its own diagnosis."""
    fn, diagnosis = mistakes[mistake]
    with pytest.raises(ExerciseError) as exc:
        check(fn)
    assert diagnosis in str(exc.value), f"{mistake}: got the message\n{exc.value}"


@pytest.mark.parametrize("mistake", list(MASK_MISTAKES))
def test_mask_mistakes_are_diagnosed(mistake):
    _assert_diagnosed(check_causal_mask, MASK_MISTAKES, mistake)


def test_mask_diagnosis_shows_both_masks():
    with pytest.raises(ExerciseError) as exc:
        check_causal_mask(lambda T: torch.ones(T, T, dtype=torch.bool).triu())
    msg = str(exc.value)
    assert "expected (1 = may attend)" in msg and "1....\n" in msg and "11111\n" in msg


def test_diagnose_mask_general_case():
    """A mask matching no known pattern still gets a precise message naming the position."""
    m = gptlab.causal_mask(4).clone()
    m[1, 3] = True
    assert diagnose_mask(m, 4) == "query 1 may attend to key 3, which is in its future (j > i): that leaks the future."
    m = gptlab.causal_mask(4).clone()
    m[2, 0] = False
    assert "query 2 may not attend to key 0" in diagnose_mask(m, 4)
    assert diagnose_mask(gptlab.causal_mask(4), 4) is None


def test_check_rejects_a_non_function():
    with pytest.raises(TypeError, match="expects a function"):
        check_causal_mask(gptlab.causal_mask(3))


# --------------------------------------------------------------------------- attention weights


def test_reference_weights_match_sdpa():
    """The reference equals PyTorch's own causal attention: weights @ v == SDPA(is_causal=True)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(3))
    scores = q @ k.transpose(-2, -1) / 8**0.5
    out = reference_causal_attention_weights(scores) @ v
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def _weights_solution(scores):
    T = scores.shape[-1]
    return torch.softmax(scores.masked_fill(~_tril(T), NINF), dim=-1)


def _big_negative(scores):
    T = scores.shape[-1]
    return torch.softmax(scores.masked_fill(~_tril(T), -1e9), dim=-1)


def _in_place(scores):
    T = scores.shape[-1]
    return torch.softmax(scores.masked_fill_(~_tril(T), NINF), dim=-1)


@pytest.mark.parametrize("fn", [_weights_solution, _big_negative], ids=["-inf", "-1e9"])
def test_correct_weights_pass(fn):
    check_causal_attention_weights(fn)


def _tril(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


WEIGHT_MISTAKES = {
    "no mask": (lambda s: torch.softmax(s, dim=-1), "you did not mask anything"),
    "fill with 0": (
        lambda s: torch.softmax(s.masked_fill(~_tril(s.shape[-1]), 0.0), dim=-1),
        "exp(0) = 1",
    ),
    "wrong entries": (
        lambda s: torch.softmax(s.masked_fill(_tril(s.shape[-1]), NINF), dim=-1),
        "fill where the mask is False",
    ),
    "softmax over queries": (
        lambda s: torch.softmax(s.masked_fill(~_tril(s.shape[-1]), NINF), dim=-2),
        "over the wrong dimension",
    ),
    "mask after softmax": (lambda s: torch.softmax(s, dim=-1) * _tril(s.shape[-1]), "you masked after the softmax"),
    "upper triangle": (
        lambda s: torch.softmax(s.masked_fill(~_tril(s.shape[-1]).T, NINF), dim=-1),
        "tokens attend to the future",
    ),
    "no softmax": (lambda s: s.masked_fill(~_tril(s.shape[-1]), NINF), "apply the softmax"),
    "scaled again": (lambda s: _weights_solution(s / s.shape[-1] ** 0.5), "you rescaled the scores"),
    "in place": (_in_place, "in place"),
    "wrong shape": (lambda s: _weights_solution(s)[0], "should have the same shape"),
    "not written": (lambda s: (_ for _ in ()).throw(NotImplementedError()), "not written yet"),
}


@pytest.mark.parametrize("mistake", list(WEIGHT_MISTAKES))
def test_weight_mistakes_are_diagnosed(mistake):
    _assert_diagnosed(check_causal_attention_weights, WEIGHT_MISTAKES, mistake)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_causal_weights_right_but_in_half_precision_say_so(dtype):
    """Correct weights computed in float16 or bfloat16 fail the check, and the message says the
    precision is too low, not "the weights of a query do not sum to 1"."""
    with pytest.raises(ExerciseError) as e:
        check_causal_attention_weights(lambda s: _weights_solution(s.to(dtype)))
    text = str(e.value)
    assert f"your weights are right, but computed in {str(dtype).split('.')[1]}, whose precision is too low" in text
    assert "do not sum to 1" not in text
