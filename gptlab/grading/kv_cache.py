"""Checks of the ``kv_cache`` assignment (chapter 7, the KV cache).

Tasks:

* ``KVCache``: a class whose ``update(k, v)`` appends new keys and values (B, H, T_new, d) along
  the time axis and returns everything cached so far, compared exactly with
  :class:`gptlab.kvcache.ConcatKVCache`;
* ``cached_attention_step(q, cache, k_new, v_new)``: one decode step of attention for one new
  token: store its key and value, then attend its query over every cached key; compared with
  :func:`gptlab.attention.attention` (one softmax and two matrix products: atol 1e-5, rtol 1e-4);
* ``generate_cached(model, idx, n)``: greedy generation with a cache on a gptlab GPT-2-style
  model, equal token for token to :func:`gptlab.generate` without a cache; the check also makes
  sure that after the prompt every step feeds one token per layer (no recomputed prefix);
* ``kv_cache_bytes(n_layer, n_kv_head, head_dim, seq_len, batch, bytes_per_elem)``: exactly
  :func:`gptlab.kvcache.kv_cache_bytes`.

Mistakes are named by re-running known buggy variants on the same input: for generation, a small
simulator below (:func:`simulate_generate_cached`) reproduces each bug with gptlab's pieces.
"""

from __future__ import annotations

import random

from collections.abc import Callable

import torch
from torch import Tensor

from .. import generation as _generation
from .. import kvcache as _kvcache
from ..attention import CausalSelfAttention, attention, merge_heads, split_heads
from ..masks import causal_mask
from ..model import GPT, Block
from .core import (Candidate, ExerciseError, Forbidden, call, call_by_keyword, entries_of, expect_close,
                   expect_number, expect_tensor, require_function, same, show_number, show_tensor)
from .portables import ReferenceCache, recording_tiny_model, tiny_model  # noqa: F401 (public here too)
from .task import Case, Task

__all__ = [
    "check_kv_cache",
    "check_cached_attention_step",
    "check_generate_cached",
    "check_kv_cache_bytes",
    "simulate_generate_cached",
    "BUGS",
    "tiny_model",
]

_CACHES = entries_of(_kvcache, "ConcatKVCache.update", "StaticKVCache.update")
_MODEL_PATHS = _CACHES + (
    Forbidden(GPT.forward, "the model's own forward (model(idx))"),
    Forbidden(GPT.decode, "model.decode"),
    Forbidden(Block.forward, "a block's own forward (block(x))"),
    Forbidden(CausalSelfAttention.forward, "the attention module's own forward (block.attn(x))"),
    Forbidden(_generation.generate, "gptlab.generate"),
    Forbidden(_generation.stream, "gptlab.stream"),
)


# --------------------------------------------------------------------------- KVCache


def _pairs(seed: int, sizes=(2, 2, 1, 3), B: int = 2, H: int = 3, d: int = 4) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, t, d, generator=g), torch.randn(B, H, t, d, generator=g)) for t in sizes]


def _unpack(out, what: str) -> tuple[Tensor, Tensor]:
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise ExerciseError(
            f"{what} should return a pair (k_all, v_all), got "
            + (f"a {type(out).__name__} of length {len(out)}" if isinstance(out, tuple | list) else type(out).__name__)
            + "."
        )
    return out[0], out[1]


def check_kv_cache(cls: Callable[[], object], seed: int = 0) -> None:
    """Check a learner's ``KVCache`` class: ``KVCache()`` then ``update(k, v) -> (k_all, v_all)``.

    k, v (B, H, T_new, d) arrive in chunks of 2, 2, 1 and 3 tokens; after each, k_all and v_all
    (B, H, S, d) must equal everything so far concatenated along the time axis (dim 2), exactly.
    The learner's class must not use gptlab's caches.
    """
    require_function(cls, "KVCache")
    cache = call(cls, "KVCache", forbidden=_CACHES)
    if not hasattr(cache, "update") or not callable(cache.update):
        raise ExerciseError("KVCache() has no method update(k, v): define `def update(self, k, v):` in the class.")
    ref = _kvcache.ConcatKVCache(1)
    before: tuple[Tensor, Tensor] | None = None
    for step, (k, v) in enumerate(_pairs(seed)):
        try:
            got = call(cache.update, "KVCache.update", k, v, forbidden=_CACHES)
        except ExerciseError as e:
            if "must match except in dimension" in str(e):
                raise ExerciseError(f"{e}\n  Most likely mistake: you concatenated along the wrong axis; time is dim 2 "
                                    "of (B, H, T, d): torch.cat([old, new], dim=2).") from None
            raise
        k_all, v_all = _unpack(got, "KVCache.update")
        want_k, want_v, _ = ref.update(0, k, v)
        what = f"KVCache.update, call {step + 1} (new k of shape {tuple(k.shape)})"
        for name, t in (("k_all", k_all), ("v_all", v_all)):
            if isinstance(t, Tensor) and tuple(t.shape) != tuple(want_k.shape):
                raise ExerciseError(f"{what}: {name} has shape {tuple(t.shape)}, expected {tuple(want_k.shape)}. "
                                    + _kv_shape_hint(t, k, v, before))
            expect_tensor(t, f"{what}: {name}", dtype="float")
        if same(k_all, want_v) and same(v_all, want_k):
            raise ExerciseError(f"{what}: you returned (v_all, k_all); return the keys first: (k_all, v_all).")
        expect_close(k_all, want_k, f"{what}: k_all", "chunks of (B, H, T, d) = (2, 3, t, 4), t = 2, 2, 1, 3", 0.0, 0.0)
        expect_close(v_all, want_v, f"{what}: v_all", "chunks of (B, H, T, d) = (2, 3, t, 4), t = 2, 2, 1, 3", 0.0, 0.0)
        before = (want_k, want_v)


def _older_state_then_new(t: Tensor, k: Tensor, v: Tensor, before: tuple[Tensor, Tensor]) -> bool:
    """Whether ``t`` is a shorter prefix of what the cache should hold (``before``) followed by the new
    chunk: the concatenation was returned, never stored."""
    if t.dim() != 4 or tuple(t.shape[:2]) != tuple(k.shape[:2]) or t.shape[3] != k.shape[3]:
        return False
    Tn, S = k.shape[2], t.shape[2]
    if not Tn < S < before[0].shape[2] + Tn:  # a non-empty prefix, shorter than what was stored
        return False
    return any(same(t[:, :, S - Tn:], new) and same(t[:, :, :S - Tn], prev[:, :, :S - Tn])
               for new, prev in ((k, before[0]), (v, before[1])))


def _kv_shape_hint(t: Tensor, k: Tensor, v: Tensor, before: tuple[Tensor, Tensor] | None) -> str:
    B, H, Tn, d = k.shape
    if before is not None and (same(t, before[0]) or same(t, before[1])):
        return "It is what was stored BEFORE this call: append the new chunk first, then return."
    if same(t, k) or same(t, v):
        return ("It is only the new chunk: keep what was stored before (store the concatenation: self.k = "
                "torch.cat([self.k, k], dim=2)) and return everything so far.")
    if before is not None and _older_state_then_new(t, k, v, before):
        return ("It is what the cache held some calls ago followed by the new chunk: update returns the "
                "concatenation but never stores it, so the cache forgets each chunk after returning it. Store it "
                "first (self.k = torch.cat([self.k, k], dim=2), the same for v), then return self.k, self.v.")
    if t.dim() == 4 and t.shape[1] != H:
        return "You appended on the heads axis (dim 1): time is dim 2 of (B, H, T, d); use torch.cat(..., dim=2)."
    if t.dim() == 4 and t.shape[0] != B:
        return "You appended on the batch axis (dim 0): time is dim 2 of (B, H, T, d); use torch.cat(..., dim=2)."
    if t.dim() == 4 and t.shape[3] != d:
        return "You appended on the last axis (the head dimension): time is dim 2 of (B, H, T, d); use dim=2."
    return ""


# --------------------------------------------------------------------------- one cached attention step


_ReferenceCache = ReferenceCache  # the name the checks below use


def _step_cases(seed: int) -> list[Case]:
    """Three steps of one token: caches that hold 5, 6 and 7 seeded tokens (each holds the previous
    step's tokens and its new one), and q, k_new, v_new (2, 3, 1, 8)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)
    cases = []
    for step in range(3):
        q, k_new, v_new = (torch.randn(2, 3, 1, 8, generator=g) for _ in range(3))
        cache = _ReferenceCache()
        cache.update(k, v)
        cases.append(Case((q, cache, k_new, v_new), f"q, k_new, v_new of shape {tuple(q.shape)} (seeded)",
                          f"cached_attention_step (step {step + 1}, {k.shape[2]} tokens cached before it)"))
        k, v = torch.cat([k, k_new], dim=2), torch.cat([v, v_new], dim=2)
    return cases


def _expect_step(got, case: Case) -> Tensor:
    """The cache was updated exactly once (its prefill was its first call), so that the reference and
    the mistakes can read it as the learner's step left it; then the output is (B, H, 1, d)."""
    q, cache = case.args[:2]
    if cache.calls == 1:
        raise ExerciseError(f"{case.what}: you never called cache.update(k_new, v_new): the new token's key and value "
                            "must be stored, and the query attends over them too.")
    if cache.calls > 2:
        raise ExerciseError(f"{case.what}: you called cache.update {cache.calls - 1} times: store the new key and "
                            "value exactly once per step.")
    return expect_tensor(got, case.what, shape=q.shape, dtype="float", device="cpu")


def _step_mistakes(q: Tensor, cache: _ReferenceCache, k_new: Tensor, v_new: Tensor) -> list[Candidate]:
    k_all, v_all = cache.held()
    first_only = torch.zeros(1, k_all.shape[2], dtype=torch.bool)
    first_only[0, 0] = True
    return [
        ("you attended BEFORE adding the new key and value to the cache, so the new token cannot see itself: "
         "call cache.update(k_new, v_new) first and attend over what it returns.",
         lambda: attention(q, k_all[:, :, :-1], v_all[:, :, :-1])),
        ("your mask lets the new token see only the first cached key. A single new query is the LAST position: "
         "it may attend to every key, so it needs no mask at all (the last row of a causal mask is all True).",
         lambda: attention(q, k_all, v_all, first_only)),
        ("you attended only to the new token's own key and value: attend over everything the cache returns.",
         lambda: attention(q, k_new, v_new)),
        ("you forgot to divide the scores by sqrt(d).", lambda: attention(q * q.shape[-1] ** 0.5, k_all, v_all)),
        ("you took the softmax over the query axis, which has length 1 here: take it over the keys (dim=-1).",
         lambda: v_all.sum(dim=2, keepdim=True)),
    ]


CACHED_ATTENTION_STEP = Task(
    "cached_attention_step", lambda q, cache, k_new, v_new: attention(q, *cache.held()),
    _CACHES[1:], _step_cases, 1e-5, 1e-4, _step_mistakes, _expect_step)


def check_cached_attention_step(fn: Callable, seed: int = 0) -> None:
    """Check ``cached_attention_step(q, cache, k_new, v_new) -> (B, H, 1, d)``.

    The cache (the assignment's interface, ``update(k, v) -> (k_all, v_all)``) already holds 5, 6
    or 7 tokens; q, k_new, v_new (B, H, 1, d) belong to the newest token. It must call
    ``cache.update(k_new, v_new)`` once, then attend q over every key, its own included, with no
    mask (the newest token may see all earlier ones). Compared with
    ``gptlab.attention.attention(q, k_all, v_all)``: atol 1e-5, rtol 1e-4.
    """
    CACHED_ATTENTION_STEP.check(fn, seed)


# --------------------------------------------------------------------------- cached generation

BUGS = {
    "positions_restart": "the positions restart at 0 at every decode step: the new token at position t must get the "
                         "position embedding wpe[t] (t = the number of tokens so far), not wpe[0].",
    "mask_first_key": "during decoding, your mask lets the new token see only the first key (position 0). A single new "
                      "query is the last position and may attend to every cached key: use no mask for one new token.",
    "attend_before_update": "each new token attends to the cache as it was BEFORE adding its own key and value: "
                            "update the cache first, then attend over everything it returns.",
    "no_prefill_mask": "the prompt (prefill) was attended without a causal mask, so prompt positions saw their future "
                       "and the cached keys and values are wrong: mask the prefill causally (T > 1 new tokens).",
}


def simulate_generate_cached(model: GPT, idx: Tensor, n: int, bug: str | None = None) -> Tensor:
    """Greedy cached generation on a GPT-2-style gptlab model, written with gptlab's pieces, with
    one of :data:`BUGS` put in on purpose (``bug=None``: correct). idx (B, T) -> (B, T + n).

    Used to name a learner's mistake: the learner's tokens are compared with each variant's.
    """
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug must be None or one of {sorted(BUGS)}, got {bug!r}")
    cfg, tr = model.config, model.transformer
    C, nh = cfg.n_embd, cfg.n_head
    caches: list[tuple[Tensor, Tensor] | None] = [None] * len(tr.h)
    out, cur, start = idx, idx, 0
    with torch.no_grad():
        for _ in range(n):
            T = cur.shape[1]
            pos = torch.arange(T) if (bug == "positions_restart" and start > 0) else torch.arange(start, start + T)
            x = tr.wte(cur) + tr.wpe(pos)
            for i, blk in enumerate(tr.h):
                q, k, v = blk.attn.c_attn(blk.ln_1(x)).split(C, dim=2)
                q, k, v = split_heads(q, nh), split_heads(k, nh), split_heads(v, nh)
                old = caches[i]
                k_all = k if old is None else torch.cat([old[0], k], dim=2)
                v_all = v if old is None else torch.cat([old[1], v], dim=2)
                caches[i] = (k_all, v_all)
                k_att, v_att = (old if (bug == "attend_before_update" and old is not None) else (k_all, v_all))
                mask = None
                if T > 1 and bug != "no_prefill_mask":
                    mask = causal_mask(T)
                elif T == 1 and bug == "mask_first_key":
                    mask = torch.zeros(1, k_att.shape[2], dtype=torch.bool)
                    mask[0, 0] = True
                y = attention(q, k_att, v_att, mask)
                x = x + blk.attn.c_proj(merge_heads(y))
                x = x + blk.mlp(blk.ln_2(x))
            nxt = model.lm_head(tr.ln_f(x))[:, -1].argmax(-1, keepdim=True)
            out, cur, start = torch.cat([out, nxt], dim=1), nxt, start + T
    return out


def check_generate_cached(fn: Callable, seed: int = 0, n: int = 10) -> None:
    """Check ``generate_cached(model, idx, n) -> (B, T + n)`` ids.

    On a small GPT-2-style gptlab model (:func:`tiny_model`), a batch of 2 prompts of 5 tokens: the
    ids must equal greedy generation without a cache (``gptlab.generate(..., temperature=0,
    use_cache=False)``) exactly, and after the prompt every step must feed ONE new token through each
    layer's ``c_attn`` (a cache, not a recomputed prefix). The model's own forward, its blocks'
    forwards, ``model.decode``, gptlab's caches and ``gptlab.generate`` are off limits.
    """
    require_function(fn, "generate_cached")
    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (2, 5), generator=g)
    seen: list[list[int]] = [[] for _ in model.transformer.h]
    hooks = [
        blk.attn.c_attn.register_forward_hook(lambda m, a, o, i=i: seen[i].append(int(a[0].shape[1])))
        for i, blk in enumerate(model.transformer.h)
    ]
    # in the autograder the learner's process gets the same model, with the same recording hooks
    model.__gptlab_portable__ = lambda: ("gptlab.grading.portables:recording_tiny_model", [seed])
    model.__gptlab_sync__ = lambda state: [seen[i].extend(int(t) for t in s) for i, s in enumerate(state[:len(seen)])]
    try:
        got = call(fn, "generate_cached", model, idx.clone(), n, forbidden=_MODEL_PATHS)
    finally:
        for h in hooks:
            h.remove()
    B, T = idx.shape
    got = expect_tensor(got, "generate_cached", shape=(B, T + n), device="cpu")
    if got.dtype not in (torch.int64, torch.int32):
        raise ExerciseError(f"generate_cached should return token ids (dtype torch.long), got {got.dtype}.")
    if not same(got[:, :T].long(), idx):
        raise ExerciseError("generate_cached must return the prompt followed by the new tokens: its first T columns "
                            "differ from idx.")
    want = _generation.generate(model, idx, n, temperature=0.0, use_cache=False)
    got = got.long()
    if not same(got, want):
        reason = None
        for bug, text in BUGS.items():
            if same(got, simulate_generate_cached(model, idx, n, bug)):
                reason = text
                break
        diff = (got != want).nonzero()
        b, t = (int(v) for v in diff[0])
        where = (
            "the first new token is already different, so the prompt pass (prefill) is wrong"
            if t == T else f"the first {t - T} new token(s) match, so the prefill works; the decode steps go wrong"
        )
        raise ExerciseError(
            "generate_cached is wrong: its tokens differ from greedy generation without a cache.\n"
            f"  Most likely mistake: {reason or 'none of the usual ones; check positions, masks and the cache update.'}\n"
            f"  In sequence {b}, {where}.\n  expected:\n      {show_tensor(want[b])}\n  got:\n      {show_tensor(got[b])}"
        )
    for i, lengths in enumerate(seen):
        if lengths and any(t > 1 for t in lengths[1:]):
            raise ExerciseError(
                f"generate_cached gives the right tokens but recomputes the prefix: after the prompt, layer {i}'s c_attn "
                f"saw {max(lengths[1:])} positions in one call. With a KV cache each decode step feeds only the ONE new "
                "token; the keys and values of the earlier ones come from the cache."
            )


# --------------------------------------------------------------------------- memory

_BYTES_CASES = [  # the first tells every listed mistake apart (with 2-byte elements "keys only" and "elements" agree)
    dict(n_layer=6, n_kv_head=6, head_dim=64, seq_len=256, batch=3, bytes_per_elem=4),
    dict(n_layer=36, n_kv_head=20, head_dim=64, seq_len=1024, batch=1, bytes_per_elem=2),  # GPT-2 Large, fp16
    dict(n_layer=32, n_kv_head=8, head_dim=128, seq_len=4096, batch=4, bytes_per_elem=2),  # a GQA model
    dict(n_layer=1, n_kv_head=1, head_dim=1, seq_len=1, batch=1, bytes_per_elem=4),
]


def _bytes_cases(seed: int | None) -> list[Case]:
    """:data:`_BYTES_CASES`, and with ``seed`` three more drawn from it (the autograder's hidden ones,
    unknown in advance)."""
    cases = list(_BYTES_CASES)
    if seed is not None:
        r = random.Random(seed)
        cases += [dict(n_layer=r.randint(2, 48), n_kv_head=r.randint(1, 32), head_dim=r.choice([16, 32, 64, 80, 96, 128]),
                       seq_len=r.randint(3, 8192), batch=r.randint(2, 9), bytes_per_elem=r.choice([2, 4, 8]))
                  for _ in range(3)]
    texts = [", ".join(f"{k}={v}" for k, v in c.items()) for c in cases]
    return [Case((c,), text, f"kv_cache_bytes({text})") for c, text in zip(cases, texts)]


def _bytes_mistakes(c: dict) -> list[Candidate]:
    want = _kvcache.kv_cache_bytes(**c)
    return [
        ("you counted the keys only: the cache holds keys AND values (a factor 2).", lambda: want // 2),
        ("you counted elements, not bytes: multiply by bytes_per_elem (2 for float16, 4 for float32).",
         lambda: want // c["bytes_per_elem"]),
        ("you counted bits: bytes_per_elem is already in bytes.", lambda: want * 8),
        ("you left out the batch: every sequence of the batch has its own cache.", lambda: want // c["batch"]),
        ("you left out the layers: every layer caches its own keys and values.", lambda: want // c["n_layer"]),
        ("you left out head_dim: each cached key and value is a vector of head_dim numbers.",
         lambda: want // c["head_dim"]),
    ]


def _expect_bytes(got, case: Case) -> Tensor:
    got = got.item() if isinstance(got, Tensor) and got.numel() == 1 else got
    if isinstance(got, float) and got.is_integer():
        raise ExerciseError(f"{case.what} returned the float {got}: return an int (a number of bytes).")
    return expect_number(got, case.what, integer=True)


KV_CACHE_BYTES = Task(
    "kv_cache_bytes", lambda c: _kvcache.kv_cache_bytes(**c),
    entries_of(_kvcache, "kv_cache_bytes", "kv_cache_bytes_for"), _bytes_cases, mistakes=_bytes_mistakes,
    expect=_expect_bytes, caller=call_by_keyword, show=show_number,
    diagnose=lambda got, want, case: "none of the usual ones: 2 (k and v) x n_layer x batch x n_kv_head x seq_len x "
                                     "head_dim x bytes_per_elem.")


def check_kv_cache_bytes(fn: Callable[..., int], seed: int | None = None) -> None:
    """Check ``kv_cache_bytes(n_layer, n_kv_head, head_dim, seq_len, batch, bytes_per_elem) -> int``
    against :func:`gptlab.kvcache.kv_cache_bytes` (keys AND values), exactly, called by keyword.
    With ``seed``, three more cases drawn from it (the autograder's hidden cases). The mistake is
    named on the first case that differs."""
    KV_CACHE_BYTES.check(fn, seed)
