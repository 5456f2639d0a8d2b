"""The one builder of the test suite's tiny random models (each test file picks its own sizes), the
one table of model variants (:data:`VARIANTS`) the model, cache, generation, fast-path and diagram
tests run over, and the decode check (:func:`assert_decode_matches`) that the cache tests run on the
model's own layers and the fast-path tests on packed ones."""

from __future__ import annotations

import torch

from gptlab import GPT, GPTConfig
from gptlab.kvcache import StaticKVCache


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

LLAMA = dict(n_head=4, n_kv_head=2, norm="rmsnorm", mlp="swiglu", pos_emb="rope", rope_theta=500.0, bias=False,
             tie_weights=False)
"""A Llama-style block: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, an untied head."""

VARIANTS = {
    "gpt2": {},
    "rmsnorm": dict(norm="rmsnorm"),
    "swiglu": dict(mlp="swiglu"),
    "rope": dict(pos_emb="rope"),
    "inner": dict(n_inner=40),
    "gqa": dict(n_head=4, n_kv_head=2),
    "mqa": dict(n_head=4, n_kv_head=1),
    "mqa_rope": dict(n_head=4, n_kv_head=1, pos_emb="rope"),
    "postnorm": dict(prenorm=False),
    "postnorm_explicit": dict(prenorm=False, attn_impl="explicit"),
    "window": dict(window_size=5),
    "window_gqa_rope": dict(window_size=4, n_head=4, n_kv_head=2, pos_emb="rope"),
    "llama": LLAMA,
    "llama_window": {**LLAMA, "window_size": 6},
}
"""The test suite's one table of model variants: ``{id: GPTConfig overrides}``, each applied over a
test file's own tiny base config (:func:`variant_model`'s; ``GPT2_TINY`` in tests/test_model.py; the
``_model`` of tests/test_generation.py and tests/test_diagram.py; every one has ``n_embd`` divisible
by 4 heads). ``"gpt2"`` is the base itself; the others change one
thing (norm, MLP, positions, MLP width, key/value heads, post-norm, the attention path, a sliding
window) or combine several (``"llama"``). Head counts are written out wherever a variant depends on
them, so a variant is the same whatever the base's ``n_head``. The model, KV-cache, generation,
fast-path and diagram tests parametrize over this table or a named subset of it (each subset says
why the others cannot apply)."""

COVERING = ["gpt2", "inner", "gqa", "llama", "window_gqa_rope", "postnorm_explicit"]
"""Six variants that between them set every option the table varies (LayerNorm and RMSNorm, GELU and
SwiGLU and the MLP width, learned and rotary positions, full and grouped key/value heads, pre- and
post-norm, SDPA and explicit attention, with and without a window, biases, a tied head): for the
slower per-variant tests, and those whose every variant another test already runs, where the other
variants would add time and nothing that test checks."""
assert {k for kw in VARIANTS.values() for k in kw} == {k for name in COVERING for k in VARIANTS[name]}

WINDOWED = [name for name, kw in VARIANTS.items() if kw.get("window_size")]
"""The variants with a sliding attention window: the only ones a ``SlidingWindowKVCache`` (which
forgets keys older than the window) decodes exactly."""


def variant_model(seed: int = 0, **kw) -> GPT:
    """A 2-layer, 32-wide, 2-head model over :data:`VARIANT_VOCAB` tokens (block 40), with ``kw``
    overriding its config (a :data:`VARIANTS` entry) or passed to :func:`tiny_gpt` (``scale``)."""
    cfg = dict(vocab_size=VARIANT_VOCAB, block_size=40, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    return tiny_gpt(seed, **cfg)


def decode_case(model: GPT, batch: int = 2, length: int = 20, seed: int = 9):
    """``(ids, full, cache)`` for :func:`assert_decode_matches`: ``batch`` rows of ``length`` random
    tokens, the model's full (uncached) forward logits on them, and an empty static cache that fits."""
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full, _ = model(ids)
    return ids, full, StaticKVCache.for_model(model, batch, length)


def assert_decode_matches(model: GPT, ids, full, cache, prefill: int = 5) -> None:
    """The decode API computes the full forward's logits: after a prefill of ``prefill`` tokens, one
    token at a time up to 12, then chunks of 3, 1 and 4 (speculative verification: causal within, and
    windowed); the cache grows by each step's tokens. ``ids`` (20 tokens), ``full`` and ``cache`` are
    :func:`decode_case`'s."""
    with torch.no_grad():
        model(ids[:, :prefill], kv_cache=cache)
        for t in range(prefill, 12):
            logits = model.decode(ids[:, t : t + 1], cache)
            torch.testing.assert_close(logits, full[:, t], atol=1e-5, rtol=0, msg=f"step {t}")
            assert cache.length == t + 1
        for t, n in ((12, 3), (15, 1), (16, 4)):
            logits = model.decode(ids[:, t : t + n], cache, last_only=False)
            torch.testing.assert_close(logits, full[:, t : t + n], atol=1e-5, rtol=0, msg=f"chunk {t}+{n}")
            assert cache.length == t + n
