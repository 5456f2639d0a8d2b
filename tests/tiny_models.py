"""The one builder of the test suite's tiny random models (each test file picks its own sizes), and the
model variants the cache and fast-path tests run over."""

from __future__ import annotations

import torch

from gptlab import GPT, GPTConfig


def tiny_gpt(seed: int = 0, *, scale: float | None = None, std: float | None = None, eval_mode: bool = True,
             **config) -> GPT:
    """``GPT(GPTConfig(**config))`` initialised under ``torch.manual_seed(seed)``.

    ``scale`` multiplies every matrix (peaked next-token distributions: no near-ties that float
    rounding could flip between implementations); ``std`` redraws every matrix from N(0, std^2)
    instead. In eval mode unless ``eval_mode=False``.
    """
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**config))
    if scale is not None or std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, std) if std is not None else p.mul_(scale)
    return model.eval() if eval_mode else model


VARIANT_VOCAB = 37  # a vocabulary size that is not a power of two
VARIANTS = {
    "gpt2": {},
    "gqa": dict(n_head=4, n_kv_head=2),
    "mqa": dict(n_head=4, n_kv_head=1),
    "llama": dict(n_head=4, n_kv_head=2, norm="rmsnorm", mlp="swiglu", pos_emb="rope", bias=False, tie_weights=False),
    "window": dict(window_size=5),
    "window_gqa_rope": dict(window_size=4, n_head=4, n_kv_head=2, pos_emb="rope"),
    "postnorm_explicit": dict(prenorm=False, attn_impl="explicit"),
}
"""GPTConfig overrides of :func:`variant_model`'s base: every cache layout and attention path."""


def variant_model(seed: int = 0, **kw) -> GPT:
    """A 2-layer, 32-wide, 2-head model over :data:`VARIANT_VOCAB` tokens (block 40), with ``kw``
    overriding its config (a :data:`VARIANTS` entry) or passed to :func:`tiny_gpt` (``scale``)."""
    cfg = dict(vocab_size=VARIANT_VOCAB, block_size=40, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    return tiny_gpt(seed, **cfg)
