"""The decoder-only transformer: GPT-2 Mini, and the modern variants as configuration options.

Where this sits: tokens -> *model* -> logits -> loss or samples. ``GPT(config)(idx)`` maps token
ids (B, T) to next-token logits (B, T, V).

The parts live in their own modules, in the order the data meets them: :mod:`gptlab.config`
(the hyper-parameters and variants), :mod:`gptlab.layers` (norms, MLPs), :mod:`gptlab.masks`,
:mod:`gptlab.rope` and :mod:`gptlab.attention`; the linear layers are PyTorch's ``nn.Linear``.
This module assembles them into a :class:`Block` and the :class:`GPT` (each part is imported from
its own module: ``gptlab.masks.causal_mask``, ``gptlab.layers.LayerNorm``). :meth:`GPT.forward` is the model's one code path: training,
a full forward, a prompt prefill and decode steps of one or several tokens over a KV cache
(:meth:`GPT.decode`, what :mod:`gptlab.generation` and :mod:`gptlab.generation.speculative` call) all run it.

Names follow GPT-2's own (``wte``, ``wpe``, ``h``, ``ln_1``, ``attn.c_attn``, ``attn.c_proj``,
``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``, ``ln_f``, ``lm_head``) so that loading real GPT-2 weights is
a short, checkable mapping (see :mod:`gptlab.interop.hf`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .interop import hf
from .attention import CausalSelfAttention
from .config import GPTConfig
from .kvcache import KVCache
from .layers import MLP, LayerNorm, RMSNorm, SwiGLU
from .masks import slot_mask
from .rope import rope_cache

IGNORE_INDEX = -100  # a target equal to it is left out of the loss (PyTorch's and Hugging Face's value)

__all__ = ["GPTConfig", "GPT", "Block", "check_token_ids", "IGNORE_INDEX"]


def check_token_ids(idx: Tensor, vocab_size: int, name: str = "idx") -> None:
    """Check a batch of token ids (B, T): a tensor, two dimensions with B, T >= 1, an integer
    dtype, every id in [0, vocab_size). The error names what was expected, and for an id out of
    range, the first such id, where it is and the vocabulary size."""
    if not isinstance(idx, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids (B, T), got {type(idx).__name__}")
    if idx.dim() != 2 or idx.shape[0] < 1 or idx.shape[1] < 1:
        raise ValueError(f"{name} must have shape (B, T) with B, T >= 1, got shape {tuple(idx.shape)}")
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {idx.dtype}")
    bad = ((idx < 0) | (idx >= vocab_size)).nonzero()
    if len(bad):
        b, t = (int(i) for i in bad[0])
        raise ValueError(
            f"token id {int(idx[b, t])} at {name}[{b}, {t}] is outside the vocabulary [0, {vocab_size}) "
            f"(vocab_size={vocab_size}; {len(bad)} id(s) out of range)"
        )


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
        """x (B, T, C) -> (B, T, C); the keywords go to :class:`CausalSelfAttention` as they are."""
        if self.prenorm:
            x = x + self.attn(self.ln_1(x), **attn_kwargs)
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(x + self.attn(x, **attn_kwargs))
        return self.ln_2(x + self.mlp(x))


# --------------------------------------------------------------------------- the model


class GPT(nn.Module):
    """A decoder-only transformer language model.

    ``model(idx, targets=None) -> (logits, loss)``: idx (B, T) int64 token ids, logits (B, T, V),
    loss the mean cross-entropy against targets (B, T) (entries equal to -100, ``IGNORE_INDEX``, are
    ignored; any other id outside the vocabulary is a ValueError naming it) or None.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}")
        self.config = config
        parts = dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
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

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of logits (B, T, V) against targets (B, T); entries equal to
        ``IGNORE_INDEX`` (-100, PyTorch's and Hugging Face's convention) are left out. Any other id
        outside [0, vocab_size) is named, with its position, in a ValueError (as :meth:`_embed`
        does for the inputs) instead of torch's bare IndexError or a device-side assert."""
        flat_logits, flat_targets = logits.view(-1, logits.size(-1)), targets.reshape(-1).long()
        if targets.device.type == "cpu":  # the CPU loss checks the ids itself: explain only a failure
            try:
                return F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX)
            except IndexError:
                pass
        V = self.config.vocab_size
        bad = ((targets != IGNORE_INDEX) & ((targets < 0) | (targets >= V))).nonzero()
        if len(bad):
            b, t = (int(i) for i in bad[0])
            raise ValueError(
                f"target id {int(targets[b, t])} at targets[{b}, {t}] is outside the vocabulary [0, {V}) "
                f"and is not the ignore index {IGNORE_INDEX} ({len(bad)} target(s) out of range)"
            )
        return F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX)

    def _embed(self, idx: Tensor) -> Tensor:
        """Token embeddings (B, T, C); an id outside [0, vocab_size) is named in a ValueError."""
        V = self.config.vocab_size
        if idx.device.type == "cpu":  # the CPU lookup checks the ids itself: explain only a failure
            try:
                return self.transformer.wte(idx)
            except IndexError:
                pass
        elif not bool(((idx < 0) | (idx >= V)).any()):  # elsewhere a bad id is a device-side assert
            return self.transformer.wte(idx)
        check_token_ids(idx, V)  # names the id out of range
        return self.transformer.wte(idx)  # not an id problem: the lookup raises its own error

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
        x = self._embed(idx)  # (B, T, C)
        if c.pos_emb == "learned":  # consecutive positions are a slice of the table (T, C)
            wpe = self.transformer.wpe
            x = x + (wpe.weight.narrow(0, start, T) if position_ids is None else wpe(position_ids))
        if self.training and c.dropout > 0.0:
            x = F.dropout(x, c.dropout)
        rope = None
        if c.pos_emb == "rope":
            if position_ids is None:  # (T, hd), broadcast over batch and heads
                rope = (self.rope_cos.narrow(0, start, T), self.rope_sin.narrow(0, start, T))
            else:  # each row its own positions: (B, 1, T, hd)
                rope = (self.rope_cos[position_ids].unsqueeze(1), self.rope_sin[position_ids].unsqueeze(1))

        # One mask for all layers, over the keys at slots key_start .. S-1: the first slot the
        # oldest new query may see (the cache's oldest, or the sliding window's edge).
        S = start + T
        key_start = kv_cache.offset if kv_cache is not None else 0
        if c.window_size is not None:
            key_start = max(key_start, start + 1 - c.window_size)
        mask, is_causal = None, True
        if attention_mask is not None:
            if attention_mask.shape != (B, S):
                raise ValueError(f"attention_mask must have shape (B, S)=({B}, {S}), got {tuple(attention_mask.shape)}")
            mask = slot_mask(start, T, key_start, S - key_start, window=c.window_size,
                             key_padding=attention_mask[:, key_start:S], device=device)
        elif T == 1:
            is_causal = False  # one query may see every key from key_start on
        elif start > 0 or c.window_size is not None:
            mask = slot_mask(start, T, key_start, S - key_start, window=c.window_size, device=device)
        for block in self.transformer.h:
            x = block(x, rope=rope, mask=mask, is_causal=is_causal, kv_cache=kv_cache, key_start=key_start)
        if kv_cache is not None:
            kv_cache.advance(T)
        x = self.transformer.ln_f(x)

        if targets is not None:
            logits = self.lm_head(x)
            return logits, self._loss(logits, targets)
        if last_only and T > 1:
            x = x.narrow(1, T - 1, 1)
        return self.lm_head(x), None

    def decode(
        self,
        idx: Tensor,
        kv_cache: KVCache,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        last_only: bool = True,
    ) -> Tensor:
        """The decoding API: feed the new tokens idx (B, T) after the ``kv_cache.length`` tokens
        the cache holds, and return next-token logits: (B, V) for the last position if
        ``last_only``, else (B, T, V) (speculative decoding's verification pass).

        A prompt prefill (T = prompt length), a decode step (T = 1) and a chunk of several tokens
        are the same call. It is :meth:`forward` with a cache (so the same code path), without
        targets. ``position_ids`` and ``attention_mask`` are as in :meth:`forward` (left padding).
        """
        if kv_cache is None:
            raise ValueError("decode needs a kv_cache (see gptlab.kvcache); use model(idx) without one")
        logits, _ = self(idx, kv_cache=kv_cache, position_ids=position_ids, attention_mask=attention_mask,
                         last_only=last_only)
        return logits.select(1, -1) if last_only else logits

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

    # ---- Hugging Face interop (the conversions live in gptlab.interop.hf)

    @classmethod
    @torch.no_grad()
    def from_hf(cls, hf_model) -> "GPT":
        """A gptlab model with the weights of a ``transformers`` ``GPT2LMHeadModel`` (Conv1D
        weights transposed, tied embeddings kept tied), ``OpenAIGPTLMHeadModel`` or
        ``LlamaForCausalLM``, in float32 on the HF model's device, in eval mode: same logits
        (B, T, V) for the same ids (B, T)."""
        config = hf.config_from_hf(getattr(hf_model, "config", None)) if hasattr(hf_model, "state_dict") else None
        if config is None:
            raise TypeError(f"from_hf expects a transformers model (e.g. GPT2LMHeadModel), got {type(hf_model).__name__}")
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in cls(config).state_dict().items()}
        own = hf.state_dict_from_hf(hf_model, config, shapes)
        return cls.from_state_dict(config, own, device=next(hf_model.parameters()).device)

    def to_hf(self):
        """An equivalent ``transformers`` ``GPT2LMHeadModel`` (GPT-2 style configs only)."""
        return hf.to_hf(self)
