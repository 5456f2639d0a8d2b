"""The decoder-only transformer: GPT-2 Mini, and the modern variants as configuration options.

Where this sits: tokens -> *model* -> logits -> loss or samples. ``GPT(config)(idx)`` maps token
ids (B, T) to next-token logits (B, T, V).

Names follow GPT-2's own (``wte``, ``wpe``, ``h``, ``ln_1``, ``attn.c_attn``, ``attn.c_proj``,
``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``, ``ln_f``, ``lm_head``) so that loading real GPT-2 weights is
a short, checkable mapping (see :mod:`gptlab.hf`).

Configuration options a chapter teaches, each checked against a reference in ``tests/``:

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

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .kvcache import KVCache

__all__ = [
    "GPTConfig",
    "GPT",
    "causal_mask",
    "attention",
    "LayerNorm",
    "RMSNorm",
    "MLP",
    "SwiGLU",
    "CausalSelfAttention",
    "Block",
    "new_gelu",
    "rope_cache",
    "apply_rope",
]


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


# --------------------------------------------------------------------------- masks and attention


def causal_mask(T: int, device: torch.device | str | None = None) -> Tensor:
    """Boolean (T, T) lower-triangular mask, True where attention is allowed.

    Query ``i`` may attend to key ``j`` iff ``j <= i``: this is the convention of PyTorch's
    ``scaled_dot_product_attention(attn_mask=...)`` (True = take part in attention).
    """
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"causal_mask: T must be a positive int, got {T!r}")
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def slot_mask(
    q_start: int,
    T: int,
    k_start: int,
    S: int,
    *,
    window: int | None = None,
    key_padding: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The general attention mask for queries at slots ``q_start..q_start+T-1`` over keys at slots
    ``k_start..k_start+S-1``: causal, optionally windowed, optionally without padded keys.

    Returns a bool mask of shape (T, S), or (B, 1, T, S) when ``key_padding`` (B, S) is given
    (True = real token). True = may attend.
    """
    q = torch.arange(q_start, q_start + T, device=device)[:, None]
    k = torch.arange(k_start, k_start + S, device=device)[None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (k > q - window)
    if key_padding is not None:
        # A padded query attends to itself only, so no row is fully masked (which would give NaN);
        # real queries never see padded keys.
        mask = mask[None, None] & (key_padding[:, None, None, :].bool() | (k == q)[None, None])
    return mask


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention written out: ``softmax(q k^T / sqrt(d) + mask) v``.

    q (..., T, d), k and v (..., S, d); ``mask`` broadcastable to (..., T, S), True where allowed.
    Returns the output (..., T, d), and the attention weights (..., T, S) if ``return_weights``.
    A query row whose keys are all masked gets all-zero weights (not NaN).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:
        weights = torch.nan_to_num(weights, nan=0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = weights @ v
    return (out, weights) if return_weights else out


# --------------------------------------------------------------------------- layers


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension with an optional bias (PyTorch's has no ``bias=False``
    before 2.1). Equal to ``torch.nn.LayerNorm`` when ``bias=True``."""

    def __init__(self, ndim: int, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama): ``x / sqrt(mean(x^2) + eps) * weight``, computed in float32."""

    def __init__(self, ndim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same formula in one fused kernel (its backward too): ~25% faster CPU training
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def new_gelu(x: Tensor) -> Tensor:
    """GPT-2's GELU, the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """GPT-2's feed-forward: Linear(C, 4C) -> GELU(tanh) -> Linear(4C, C) -> dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.inner_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.inner_dim, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(new_gelu(self.c_fc(x))))


class SwiGLU(nn.Module):
    """Llama's feed-forward: ``c_proj(silu(x W_gate) * (x W_up))``; gate and up fused in ``c_fc``
    (its first half is the gate, its second half the up projection)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 2 * config.inner_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.inner_dim, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.dropout(self.c_proj(F.silu(gate) * up))


def rope_cache(
    max_len: int, head_dim: int, theta: float = 10000.0, device=None, dtype=torch.float32
) -> tuple[Tensor, Tensor]:
    """cos and sin tables (max_len, head_dim) for rotary position embeddings (HF/Llama layout:
    the two halves of each head are the rotated pairs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (max_len, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (max_len, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, H, T, D) by the angles of its positions; cos, sin (B or 1, 1, T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention.

    ``c_attn`` projects to queries (n_head heads) and keys and values (n_kv_head heads each) in
    one matrix product; ``c_proj`` mixes the heads back. Set ``record_weights = True`` (explicit
    path only) to keep the last attention weights in ``last_weights`` (B, n_head, T, S).
    """

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.layer_idx = layer_idx
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, q_dim + 2 * kv_dim, bias=config.bias)
        self.c_proj = nn.Linear(q_dim, config.n_embd, bias=config.bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.impl = config.attn_impl
        self.record_weights = False
        self.last_weights: Tensor | None = None
        self._split = (q_dim, kv_dim, kv_dim)

    def forward(
        self,
        x: Tensor,
        *,
        rope: tuple[Tensor, Tensor] | None = None,
        mask: Tensor | None = None,
        is_causal: bool = True,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self._split, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v, _ = kv_cache.update(self.layer_idx, k, v)  # (B, nkv, S, hd)
        if self.n_kv_head != self.n_head:
            rep = self.n_head // self.n_kv_head
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        dropout_p = self.attn_dropout if self.training else 0.0
        if self.impl == "explicit" or self.record_weights:
            m = mask
            if m is None and is_causal:
                m = slot_mask(k.shape[2] - T, T, 0, k.shape[2], device=x.device)
            y, w = attention(q, k, v, m, dropout_p, return_weights=True)
            if self.record_weights:
                self.last_weights = w.detach()
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal and mask is None
            )
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh*hd)
        return self.resid_dropout(self.c_proj(y))


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, eps=config.norm_eps)
    return LayerNorm(config.n_embd, bias=config.bias, eps=config.norm_eps)


class Block(nn.Module):
    """One transformer block.

    Pre-norm (GPT-2): ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``.
    Post-norm (GPT-1, the original transformer): ``x = ln_1(x + attn(x)); x = ln_2(x + mlp(x))``.
    """

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.prenorm = config.prenorm
        self.ln_1 = _norm(config)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = _norm(config)
        self.mlp = SwiGLU(config) if config.mlp == "swiglu" else MLP(config)

    def forward(self, x: Tensor, **attn_kwargs) -> Tensor:
        if self.prenorm:
            x = x + self.attn(self.ln_1(x), **attn_kwargs)
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(x + self.attn(x, **attn_kwargs))
        return self.ln_2(x + self.mlp(x))


# --------------------------------------------------------------------------- the model


class GPT(nn.Module):
    """A decoder-only transformer language model.

    ``model(idx, targets=None) -> (logits, loss)``: idx (B, T) int64 token ids, logits (B, T, V),
    loss the mean cross-entropy against targets (B, T) (entries equal to -100 are ignored) or None.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}")
        self.config = config
        parts = dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=_norm(config) if config.prenorm else nn.Identity(),
        )
        if config.pos_emb == "learned":
            parts["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        self.transformer = nn.ModuleDict(parts)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight  # weight tying (Press & Wolf, 2017)
        if config.pos_emb == "rope":
            cos, sin = rope_cache(config.block_size, config.head_dim, config.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) (two per block)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @classmethod
    def from_state_dict(
        cls, config: GPTConfig, state_dict: dict[str, Tensor], *, device: torch.device | str | None = None
    ) -> "GPT":
        """A model with the given weights, built without the random initialisation (which takes
        seconds for a 100M-parameter model): the modules are created on the ``meta`` device and
        the tensors of ``state_dict`` are assigned to them (shapes are checked).

        ``state_dict`` holds every entry of ``GPT(config).state_dict()``; ``lm_head.weight`` may be
        left out when the weights are tied. The model is returned in eval mode, on ``device``
        (default: where the tensors are).
        """
        with torch.device("meta"):
            model = cls(config)
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        allowed_missing = {"lm_head.weight"} if config.tie_weights else set()
        if unexpected or set(missing) - allowed_missing:
            raise ValueError(
                "state dict does not match GPT(config): "
                f"missing {sorted(set(missing) - allowed_missing)}, unexpected {sorted(unexpected)}"
            )
        if config.tie_weights:
            if "lm_head.weight" in state_dict and not torch.equal(
                state_dict["lm_head.weight"], state_dict["transformer.wte.weight"]
            ):
                raise ValueError("config.tie_weights is True but lm_head.weight differs from transformer.wte.weight")
            model.lm_head.weight = model.transformer.wte.weight
        if config.pos_emb == "rope":  # non-persistent buffers: recompute them off the meta device
            w = model.transformer.wte.weight
            cos, sin = rope_cache(config.block_size, config.head_dim, config.rope_theta, device=w.device, dtype=w.dtype)
            model.rope_cos, model.rope_sin = cos, sin
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_meta:
                raise ValueError(f"state dict left {name} uninitialised")
        if device is not None:
            model = model.to(device)
        return model.eval()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # ---- sizes

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (tied weights counted once). ``non_embedding`` leaves out the
        position embedding (and the token embedding when it is not tied to the output head)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        if non_embedding:
            if "wpe" in self.transformer:
                n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_weights:
                n -= self.transformer.wte.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None, training: bool = True) -> int:
        """Matrix-multiply FLOPs per token (a multiply-add is 2 FLOPs) for sequences of
        ``seq_len`` tokens (default block_size). Forward only if not ``training``; training is
        3x forward (backward = 2x forward). Attention scores and the weighted sum are counted over
        the full ``seq_len`` context, as in the PaLM / nanoGPT convention (causal masking does not
        skip work in a dense kernel). Embedding lookups, norms, activations and softmax are not
        counted. This is exactly what ``torch.utils.flop_counter.FlopCounterMode`` counts for a
        forward (and forward + backward) pass of the ``attn_impl="explicit"`` model, divided by
        the number of tokens (tests/test_model.py checks it).
        """
        c = self.config
        T = seq_len or c.block_size
        C, hd = c.n_embd, c.head_dim
        q_dim, kv_dim = c.n_head * hd, c.kv_heads * hd
        per_layer = 2 * C * (q_dim + 2 * kv_dim)  # c_attn
        per_layer += 2 * T * q_dim * 2  # q k^T and weights @ v
        per_layer += 2 * q_dim * C  # attn c_proj
        n_fc = 2 if c.mlp == "swiglu" else 1
        per_layer += 2 * C * c.inner_dim * n_fc + 2 * c.inner_dim * C  # MLP
        fwd = c.n_layer * per_layer + 2 * C * c.vocab_size  # + lm_head
        return 3 * fwd if training else fwd

    # ---- forward

    def _check_input(self, idx: Tensor, targets: Tensor | None, start: int) -> None:
        if not isinstance(idx, Tensor):
            raise TypeError(f"idx must be a torch.Tensor of token ids, got {type(idx).__name__}")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got shape {tuple(idx.shape)}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"idx must hold integer token ids (torch.long or torch.int32), got dtype {idx.dtype}")
        T = idx.shape[1]
        if T == 0:
            raise ValueError("idx must hold at least one token (T >= 1)")
        if start + T > self.config.block_size:
            raise ValueError(
                f"sequence of length {start + T} is longer than block_size={self.config.block_size}"
                + (f" ({start} cached + {T} new)" if start else "")
            )
        if targets is not None:
            if not isinstance(targets, Tensor):
                raise TypeError(f"targets must be a torch.Tensor of token ids, got {type(targets).__name__}")
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}")
            if targets.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"targets must hold integer token ids (torch.long), got dtype {targets.dtype}")

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) -> (logits (B, T, V), loss or None).

        kv_cache: a :class:`gptlab.kvcache.KVCache`; the T tokens are appended after the
            ``kv_cache.length`` tokens it already holds, and attend to them.
        position_ids: (B, T) positions for the positional embedding (default: consecutive, from
            ``kv_cache.length``). Left-padded batches pass their own.
        attention_mask: (B, S) with 1 for real tokens and 0 for padding, over every slot so far
            (cached and new, S = kv_cache.length + T): padded keys are never attended to.
        last_only: compute logits for the last position only (logits (B, 1, V)); for decoding.
        """
        start = kv_cache.length if kv_cache is not None else 0
        self._check_input(idx, targets, start)
        B, T = idx.shape
        device = idx.device
        c = self.config
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=device).unsqueeze(0)  # (1, T)
        x = self.transformer.wte(idx)  # (B, T, C)
        if c.pos_emb == "learned":
            x = x + self.transformer.wpe(position_ids)
        x = self.transformer.drop(x)
        rope = None
        if c.pos_emb == "rope":
            rope = (self.rope_cos[position_ids].unsqueeze(1), self.rope_sin[position_ids].unsqueeze(1))

        # One mask for all layers. Fast paths: no mask at all (is_causal, or one query over a full
        # unpadded cache, which may attend to everything).
        mask, is_causal = None, True
        S = start + T
        k_start = getattr(kv_cache, "offset", 0) if kv_cache is not None else 0
        if attention_mask is not None:
            if attention_mask.shape != (B, S):
                raise ValueError(f"attention_mask must have shape (B, S)=({B}, {S}), got {tuple(attention_mask.shape)}")
            pad = attention_mask[:, k_start:S] if k_start else attention_mask
            mask = slot_mask(start, T, k_start, S - k_start, window=c.window_size, key_padding=pad, device=device)
        elif c.window_size is not None and S - k_start > 1:
            mask = slot_mask(start, T, k_start, S - k_start, window=c.window_size, device=device)
        elif start > 0:
            if T == 1:
                is_causal = False  # the newest token may see every cached one
            else:
                mask = slot_mask(start, T, 0, S, device=device)
        for block in self.transformer.h:
            x = block(x, rope=rope, mask=mask, is_causal=is_causal, kv_cache=kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        x = self.transformer.ln_f(x)

        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1).long(), ignore_index=-100)
            return logits, loss
        if last_only:
            x = x[:, -1:, :]
        return self.lm_head(x), None

    # ---- optimiser

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Parameter groups for AdamW: weight decay on matrices (dim >= 2: linear weights and
        embeddings) only, none on biases and norm gains."""
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    # ---- Hugging Face interop (implemented in gptlab.hf)

    @classmethod
    def from_hf(cls, hf_model) -> "GPT":
        """Build a gptlab model from a ``transformers`` ``GPT2LMHeadModel`` (Conv1D weights
        transposed, tied embeddings kept tied) or ``LlamaForCausalLM``; same logits."""
        from .hf import from_hf

        return from_hf(hf_model)

    def to_hf(self):
        """An equivalent ``transformers`` ``GPT2LMHeadModel`` (GPT-2 style configs only)."""
        from .hf import to_hf

        return to_hf(self)
