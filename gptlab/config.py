"""The model's hyper-parameters: :class:`GPTConfig`, checked when built.

Where this sits: the shape of the *model* (tokens -> model -> logits): sizes, and the variants a
chapter teaches, each a configuration option:

* ``norm``: ``"layernorm"`` (GPT-2, optional bias) or ``"rmsnorm"`` (Llama).
* ``mlp``: ``"gelu"`` (GPT-2's tanh-approximated GELU) or ``"swiglu"`` (Llama).
* ``pos_emb``: ``"learned"`` absolute positions (GPT-2) or ``"rope"`` rotary embeddings (Llama).
* ``n_kv_head``: grouped-query attention (``1`` is multi-query attention).
* ``prenorm``: pre-norm blocks (GPT-2) or post-norm blocks (GPT-1, the original transformer).
* ``window_size``: sliding-window (local) attention.
* ``attn_impl``: ``"sdpa"`` (PyTorch's fused ``scaled_dot_product_attention``) or ``"explicit"``
  (softmax(QK^T / sqrt(d)) V written out, which can keep its attention weights for plotting).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

__all__ = ["GPTConfig"]


@dataclass
class GPTConfig:
    """Hyper-parameters of a :class:`GPT`. The defaults are GPT-2 small's shape.

    ``n_kv_head=None`` means ``n_head`` (plain multi-head attention). ``n_inner=None`` means
    ``4 * n_embd`` for the GELU MLP and ``int(8/3 * n_embd)`` rounded up to a multiple of 64 for
    SwiGLU (equal parameter count).
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    n_kv_head: int | None = None
    n_inner: int | None = None
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    pos_emb: str = "learned"
    rope_theta: float = 10000.0
    prenorm: bool = True
    tie_weights: bool = True
    window_size: int | None = None
    attn_impl: str = "sdpa"
    head_dim_override: int | None = field(default=None, repr=False)

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"GPTConfig: {msg}")

        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, f"{name} must be a positive int, got {v!r}")
        need(
            self.n_embd % self.n_head == 0 or self.head_dim_override is not None,
            f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})",
        )
        kv = self.kv_heads
        need(kv >= 1 and self.n_head % kv == 0, f"n_head ({self.n_head}) must be divisible by n_kv_head ({kv})")
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        need(self.norm in ("layernorm", "rmsnorm"), f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        need(self.mlp in ("gelu", "swiglu"), f"mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
        need(self.pos_emb in ("learned", "rope"), f"pos_emb must be 'learned' or 'rope', got {self.pos_emb!r}")
        need(self.attn_impl in ("sdpa", "explicit"), f"attn_impl must be 'sdpa' or 'explicit', got {self.attn_impl!r}")
        need(self.window_size is None or self.window_size >= 1, f"window_size must be >= 1, got {self.window_size}")
        if self.pos_emb == "rope":
            need(self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        if self.n_inner is not None:
            return self.n_inner
        if self.mlp == "gelu":
            return 4 * self.n_embd
        return 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def to_dict(self) -> dict:
        return asdict(self)
