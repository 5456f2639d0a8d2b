"""KV caches: cached decoding equals full recomputation; kv_cache_bytes equals what is allocated."""

from __future__ import annotations

import pytest
import torch

from gptlab import GPT, generate
from gptlab.generation import make_cache
from tiny_models import VARIANT_VOCAB, VARIANTS, WINDOWED, assert_decode_matches, decode_case, tiny_gpt, variant_model

from gptlab.kvcache import ConcatKVCache, SlidingWindowKVCache, StaticKVCache, kv_cache_bytes, kv_cache_bytes_for

V = VARIANT_VOCAB

_model = variant_model


def _caches(m: GPT, B: int):
    out = {"static": StaticKVCache.for_model(m, B), "concat": ConcatKVCache(m.config.n_layer)}
    if m.config.window_size:
        out["sliding"] = SlidingWindowKVCache(m.config.n_layer, m.config.window_size)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_decode_equals_full_forward(variant):
    m = _model(**VARIANTS[variant])
    B, T0, steps = 2, 6, 12
    ids = torch.randint(0, V, (B, T0 + steps), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = m(ids)  # (B, T, V), no cache
        for name, cache in _caches(m, B).items():
            logits, _ = m(ids[:, :T0], kv_cache=cache)
            torch.testing.assert_close(logits, full[:, :T0], atol=1e-5, rtol=0, msg=f"{name} prefill")
            for t in range(T0, T0 + steps):
                step, _ = m(ids[:, t : t + 1], kv_cache=cache, last_only=True)
                torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=0, msg=f"{name} step {t}")
            assert cache.length == T0 + steps


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_and_uncached_greedy_tokens_identical(variant):
    m = _model(**VARIANTS[variant])
    idx = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(2))
    ref = generate(m, idx, 25, temperature=0, use_cache=False)
    caches = ["static", "concat"] + (["sliding"] if m.config.window_size else [])
    for c in caches:
        assert torch.equal(generate(m, idx, 25, temperature=0, cache=c), ref), c


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_multi_token_chunks_after_prefill(variant):
    """Several new tokens at once over a filled cache (what speculative decoding's verify step does)."""
    m = _model(**VARIANTS[variant])
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _ = m(ids)
        for name, cache in _caches(m, 2).items():
            parts = [m(ids[:, a:b], kv_cache=cache)[0] for a, b in ((0, 7), (7, 11), (11, 12), (12, 20))]
            torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0, msg=name)


def test_static_cache_crop_rolls_back():
    m = _model()
    ids = torch.randint(0, V, (1, 15), generator=torch.Generator().manual_seed(4))
    other = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full, _ = m(ids)
        for cache in (StaticKVCache.for_model(m, 1), ConcatKVCache(m.config.n_layer)):
            m(ids[:, :10], kv_cache=cache)
            m(other, kv_cache=cache)  # rejected guesses
            cache.crop(10)
            assert cache.length == 10
            out, _ = m(ids[:, 10:], kv_cache=cache)
            torch.testing.assert_close(out, full[:, 10:], atol=1e-5, rtol=0)


def test_reorder_moves_rows():
    m = _model()
    ids = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(6))
    nxt = torch.randint(0, V, (3, 1), generator=torch.Generator().manual_seed(7))
    index = torch.tensor([2, 2, 0])
    with torch.no_grad():
        for cache in (StaticKVCache.for_model(m, 3), ConcatKVCache(m.config.n_layer)):
            m(ids, kv_cache=cache)
            cache.reorder(index)
            out, _ = m(nxt, kv_cache=cache, last_only=True)
            expected, _ = m(torch.cat([ids[index], nxt], 1))
            torch.testing.assert_close(out[:, 0], expected[:, -1], atol=1e-5, rtol=0)


def test_static_cache_rejects_overflow_and_batch_mismatch():
    m = _model()
    cache = StaticKVCache.for_model(m, 2, max_len=8)
    with torch.no_grad():
        m(torch.zeros(2, 8, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError):
            m(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError):
            m(torch.zeros(3, 1, dtype=torch.long), kv_cache=StaticKVCache.for_model(m, 2, max_len=8))


# kv_cache_bytes_for caps a windowed model's cache at its window (what a SlidingWindowKVCache holds:
# test_sliding_window_cache_memory_stops_growing), while the static and concat caches here keep
# every token, so the windowed variants are left out of this comparison.
FULL_CACHE_VARIANTS = [name for name in VARIANTS if name not in WINDOWED]


@pytest.mark.parametrize("variant", FULL_CACHE_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_bytes_equals_allocated(variant, dtype):
    m = _model(**VARIANTS[variant]).to(dtype)
    cfg = m.config
    B, T = 3, 17
    static = StaticKVCache.for_model(m, B, max_len=T)
    assert static.nbytes == kv_cache_bytes_for(cfg, B, T, dtype)
    concat = ConcatKVCache(cfg.n_layer)
    with torch.no_grad():
        m(torch.zeros(B, 10, dtype=torch.long), kv_cache=concat)
        for _ in range(T - 10):
            m(torch.zeros(B, 1, dtype=torch.long), kv_cache=concat)
    assert concat.nbytes == kv_cache_bytes_for(cfg, B, T, dtype)
    # the formula, by hand: 2 (k, v) * layers * batch * kv heads * tokens * head_dim * bytes
    item = torch.empty((), dtype=dtype).element_size()
    assert kv_cache_bytes_for(cfg, B, T, dtype) == 2 * cfg.n_layer * B * cfg.kv_heads * T * cfg.head_dim * item


def test_grouped_query_attention_saves_cache_memory():
    mha, gqa, mqa = _model(n_head=VARIANTS["gqa"]["n_head"]), _model(**VARIANTS["gqa"]), _model(**VARIANTS["mqa"])
    sizes = {}
    for name, m in (("mha", mha), ("gqa", gqa), ("mqa", mqa)):
        c = StaticKVCache.for_model(m, 2, max_len=30)
        sizes[name] = c.nbytes
        assert c.nbytes == kv_cache_bytes_for(m.config, 2, 30)
    assert sizes["mha"] == 2 * sizes["gqa"] == 4 * sizes["mqa"]


def test_sliding_window_cache_memory_stops_growing():
    m = _model(**VARIANTS["window"])
    w = m.config.window_size
    cache = SlidingWindowKVCache(m.config.n_layer, w)
    full = ConcatKVCache(m.config.n_layer)
    seen = []
    with torch.no_grad():
        m(torch.zeros(2, 3, dtype=torch.long), kv_cache=cache)
        m(torch.zeros(2, 3, dtype=torch.long), kv_cache=full)
        for t in range(4, 30):
            m(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache)
            m(torch.zeros(2, 1, dtype=torch.long), kv_cache=full)
            seen.append(cache.nbytes)
            assert cache.nbytes == kv_cache_bytes_for(m.config, 2, t)  # capped at the window
            assert full.nbytes == kv_cache_bytes_for(m.config, 2, t, window=10**9)
    assert max(seen) == kv_cache_bytes_for(m.config, 2, w) < full.nbytes


def test_left_padded_cached_logits_equal_unpadded():
    m = _model()
    g = torch.Generator().manual_seed(8)
    a = torch.randint(0, V, (1, 9), generator=g)
    b = torch.randint(0, V, (1, 4), generator=g)
    idx = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    mask = torch.tensor([[1] * 9, [0] * 5 + [1] * 4])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    nxt = torch.randint(0, V, (2, 1), generator=g)
    with torch.no_grad():
        cache = StaticKVCache.for_model(m, 2)
        first, _ = m(idx, kv_cache=cache, position_ids=pos, attention_mask=mask, last_only=True)
        step, _ = m(nxt, kv_cache=cache, position_ids=pos[:, -1:] + 1,
                    attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1), last_only=True)
        for row, seq in ((0, a), (1, b)):
            alone, _ = m(torch.cat([seq, nxt[row : row + 1]], 1))
            torch.testing.assert_close(first[row, 0], alone[0, -2], atol=1e-5, rtol=0)
            torch.testing.assert_close(step[row, 0], alone[0, -1], atol=1e-5, rtol=0)


def test_make_cache_choices():
    m = _model()
    assert isinstance(make_cache(m, 2, 10, "static"), StaticKVCache)
    assert isinstance(make_cache(m, 2, 10, "concat"), ConcatKVCache)
    with pytest.raises(ValueError):
        make_cache(m, 2, 10, "sliding")  # no window on this model
    with pytest.raises(ValueError):
        make_cache(m, 2, 10, "paged")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_api_equals_model_forward(variant):
    """The model's decode API (static cache, no padding) computes the full forward's logits, one
    token at a time and a few at a time (speculative verification), for every variant. (With the
    decode products on packed weights: tests/test_fast_cpu.py.)"""
    m = _model(**VARIANTS[variant])
    ids, full, cache = decode_case(m)
    assert_decode_matches(m, ids, full, cache)
    with torch.no_grad(), pytest.raises(ValueError, match="KV cache full"):
        m.decode(ids[:, :5], cache)


def test_cached_decoding_runs_forward_hooks():
    """Every decode step runs the model's own modules, so a forward hook changes cached decoding
    exactly as it changes uncached decoding."""
    m = _model()
    idx = torch.randint(0, V, (1, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = m(idx)[0]
    h = m.transformer.h[0].mlp.register_forward_hook(lambda mod, i, o: o * 0)
    try:
        with torch.no_grad():
            assert not torch.allclose(m(idx)[0], plain)  # the hook changes the model
        hooked = generate(m, idx, 10, temperature=0)
        assert torch.equal(hooked, generate(m, idx, 10, temperature=0, use_cache=False))
    finally:
        h.remove()


def test_kv_cache_bytes_plain_numbers():
    """2 (k and v) * layers * batch * kv heads * tokens * head_dim * bytes per element."""
    assert kv_cache_bytes(6, 6, 64, 256, 1, 4) == 2 * 6 * 6 * 64 * 256 * 4 == 4718592
    assert kv_cache_bytes(n_layer=2, n_kv_head=1, head_dim=8, seq_len=10, batch=3, bytes_per_elem=2) == 2 * 2 * 3 * 10 * 8 * 2
    cfg = _model(**VARIANTS["gqa"]).config
    assert kv_cache_bytes_for(cfg, 2, 30) == kv_cache_bytes(cfg.n_layer, cfg.kv_heads, cfg.head_dim, 30, 2, 4)
    with pytest.raises(TypeError, match="kv_cache_bytes_for"):  # one signature: plain numbers
        kv_cache_bytes(cfg, 2, 30, 4)
    for bad in (dict(n_layer=0), dict(seq_len=-1), dict(bytes_per_elem=1.5)):
        args = dict(n_layer=1, n_kv_head=1, head_dim=1, seq_len=1, batch=1, bytes_per_elem=4) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            kv_cache_bytes(**args)


def test_static_cache_survives_autograd_mode_switches():
    """StaticKVCache keeps per-layer views between calls; PyTorch forbids writing into a view made
    under no_grad / inference_mode once that mode is left, so the views are remade when the mode
    changes: one cache decoded under inference_mode, no_grad and grad mode in turn gives the same
    logits as a full forward, and so does a model trained after decoding."""
    m = tiny_gpt()
    ids = torch.randint(0, m.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full, _ = m(ids)
    cache = StaticKVCache.for_model(m, 1, 6)
    modes = [torch.inference_mode, torch.no_grad, torch.enable_grad, torch.no_grad, torch.inference_mode,
             torch.enable_grad]
    for t, mode in enumerate(modes):
        with mode():
            logits = m.decode(ids[:, t : t + 1], cache)
        torch.testing.assert_close(logits.detach(), full[:, t], atol=1e-5, rtol=0, msg=f"step {t} under {mode}")
