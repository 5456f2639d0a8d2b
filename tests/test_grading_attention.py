"""The checks of the ``attention`` assignment (gptlab.grading.attention): what they accept, and
the messages of the cases the mistake catalogue (tests/mistakes/attention.toml) does not cover."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from gptlab.grading import attention as A
from gptlab.grading.core import ExerciseError

from answers import Layer, attention_weights, merge_heads, split_heads


def test_correct_answers_pass():
    A.check_attention_weights(attention_weights)
    A.check_attend(lambda q, k, v, mask=None: attention_weights(q, k, mask) @ v)
    A.check_split_heads(split_heads)
    A.check_merge_heads(merge_heads)
    A.check_causal_self_attention(Layer)


def test_no_mask_of_the_checks_blocks_a_whole_row():
    """The task text promises it: a fully masked row (0/0) never has to be handled."""
    for seed in (0, 1):
        for _text, q, k, _v, mask in A._attention_cases(seed):
            if mask is not None:
                full = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
                assert full.any(-1).all()


def test_a_large_negative_fill_is_accepted_in_float32():
    def big_negative(q, k, mask=None):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            s = s.masked_fill(~mask, -1e9)
        return torch.softmax(s, dim=-1)

    A.check_attention_weights(big_negative)


def test_a_float64_answer_is_accepted():
    A.check_attention_weights(lambda q, k, mask=None: attention_weights(q.double(), k.double(), mask))


def test_not_a_class_or_not_a_module():
    with pytest.raises(ExerciseError, match="subclass of nn.Module"):
        A.check_causal_self_attention(lambda n_embd, n_head: None)
    with pytest.raises(ExerciseError, match="subclass of nn.Module"):
        A.check_causal_self_attention(object)


def test_extra_parameters_are_named_when_the_output_differs():
    class Extra(Layer):
        def __init__(self, n_embd, n_head):
            super().__init__(n_embd, n_head)
            self.gate = nn.Linear(n_embd, n_embd)

        def forward(self, x):
            return super().forward(x) + self.gate(x)

    with pytest.raises(ExerciseError, match=r"also has the parameters \['gate.weight', 'gate.bias'\]"):
        A.check_causal_self_attention(Extra)


def test_c_proj_of_the_wrong_shape():
    class Wide(Layer):
        def __init__(self, n_embd, n_head):
            super().__init__(n_embd, n_head)
            self.c_proj = nn.Linear(3 * n_embd, n_embd)

    with pytest.raises(ExerciseError, match=r"self.c_proj.weight has shape \(16, 48\), expected \(16, 16\)"):
        A.check_causal_self_attention(Wide)


def test_attend_returning_the_weights_when_the_shapes_coincide():
    with pytest.raises(ExerciseError, match="returned the attention weights"):
        A.check_attend(lambda q, k, v, mask=None: attention_weights(q, k, mask))


def test_renormalising_after_a_late_mask_is_accepted():
    """softmax, then zero the blocked keys and divide by the row sum: the same weights (when no row
    is fully blocked), so it is not a mistake."""

    def late(q, k, mask=None):
        w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        if mask is None:
            return w
        w = w * mask
        return w / w.sum(-1, keepdim=True)

    A.check_attention_weights(late)


def test_a_crash_shows_the_input():
    with pytest.raises(ExerciseError, match=r"split_heads\(.*\) raised RuntimeError"):
        A.check_split_heads(lambda x, n: x.view(-1, n, 7))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weights_right_but_in_half_precision_say_so(dtype):
    """Correct weights computed in float16 or bfloat16 fail the check (too far from float32's), and
    the message says the precision is too low, not "the weights of a query do not sum to 1"."""
    with pytest.raises(ExerciseError) as e:
        A.check_attention_weights(lambda q, k, mask=None: attention_weights(q.to(dtype), k.to(dtype), mask).float())
    text = str(e.value)
    assert f"your weights are right, but computed in {str(dtype).split('.')[1]}, whose precision is too low" in text
    assert "do not sum to 1" not in text
