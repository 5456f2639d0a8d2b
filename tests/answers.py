"""Correct answers written the way a learner would, shared by the grading tests: the attention
pieces of the ``attention`` assignment, with an explicit mask instead of PyTorch's fused attention
(the ``blocks`` tests build their block on :class:`Layer`)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def attention_weights(q, k, mask=None):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1)


def split_heads(x, n_head):
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(x):
    B, H, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d)


class Layer(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (split_heads(t, self.n_head) for t in self.c_attn(x).split(C, dim=-1))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        return self.c_proj(merge_heads(attention_weights(q, k, mask) @ v))
