"""The ``blocks`` checks (gptlab.grading.blocks) beyond the mutation catalogue: correct answers
written differently pass, each verdict is quick, and the block's loading messages are clear."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.grading import blocks
from gptlab.grading.core import DelegationError, ExerciseError

from answers import Layer  # the attention, written out with an explicit mask


def _layer_norm(x, weight, bias, eps=1e-5):  # written with var(unbiased=False) and rsqrt
    xc = x - x.mean(-1, keepdim=True)
    return xc * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + eps) * weight + bias


def _gelu(x):
    return x * 0.5 * (1 + torch.tanh(0.7978845608028654 * x * (1 + 0.044715 * x * x)))


def _rms_norm(x, weight, eps=1e-5):
    return weight * x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def _apply_rope(x, cos, sin):
    h = x.shape[-1] // 2
    rot = torch.empty_like(x)
    rot[..., :h], rot[..., h:] = -x[..., h:], x[..., :h]
    return x * cos + rot * sin


def _make_block(bias: bool = True):
    class MLP(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.c_fc, self.c_proj = nn.Linear(n, 4 * n, bias=bias), nn.Linear(4 * n, n, bias=bias)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self, n_embd, n_head):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, bias=bias), nn.LayerNorm(n_embd, bias=bias)
            self.attn, self.mlp = Layer(n_embd, n_head), MLP(n_embd)
            self.dropout = nn.Dropout(0.1)  # eval mode during the check: must not matter

        def forward(self, x):
            x = x + self.dropout(self.attn(self.ln_1(x)))
            return x + self.dropout(self.mlp(self.ln_2(x)))

    return Block


@pytest.mark.parametrize(
    "check,fn",
    [(blocks.check_layer_norm, _layer_norm), (blocks.check_gelu, _gelu), (blocks.check_rms_norm, _rms_norm),
     (blocks.check_apply_rope, _apply_rope), (blocks.check_Block, _make_block())],
    ids=["layer_norm", "gelu", "rms_norm", "apply_rope", "Block"],
)
def test_correct_answers_written_differently_pass_quickly(check, fn):
    t0 = time.perf_counter()
    check(fn)
    assert time.perf_counter() - t0 < 5.0


def test_each_wrong_verdict_is_quick():
    t0 = time.perf_counter()
    with pytest.raises(ExerciseError, match="post-norm"):
        class Post(_make_block()):
            def forward(self, x):
                x = self.ln_1(x + self.attn(x))
                return self.ln_2(x + self.mlp(x))
        blocks.check_Block(Post)
    assert time.perf_counter() - t0 < 5.0


def test_block_without_biases_is_told_to_keep_them():
    with pytest.raises(ExerciseError, match="keep bias=True"):
        blocks.check_Block(_make_block(bias=False))


def test_torch_layer_norm_builtin_is_delegation():
    with pytest.raises(DelegationError, match="torch.layer_norm"):
        blocks.check_layer_norm(lambda x, w, b, eps: torch.layer_norm(x, x.shape[-1:], w, b, eps))


def test_check_block_needs_a_module_class():
    with pytest.raises(TypeError, match="Block class"):
        blocks.check_Block(lambda n_embd, n_head: None)


def test_gelu_must_keep_the_dtype():
    with pytest.raises(ExerciseError, match="dtype"):
        blocks.check_gelu(lambda x: _gelu(x).double())
