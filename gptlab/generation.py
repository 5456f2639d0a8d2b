"""Autoregressive generation: greedy and sampled decoding, streaming, beam search, the CLI ``sample``.

Where this sits: text -> tokens -> model -> logits -> *samples* -> text. :func:`generate` runs the
model on the prompt once (*prefill*), then one token at a time (*decode*), each step turning the
last position's logits into a token with :mod:`gptlab.sampling` and feeding it back. With a KV
cache (:mod:`gptlab.kvcache`) a decode step only computes the newest token's keys and values.

* :func:`generate` -> (B, T + new) ids; ``temperature=0`` is greedy. Hugging Face's order of
  logits transforms: penalties, temperature, top-k, top-p, min-p. Rows that emit ``eos_token_id``
  keep emitting the pad token (default: the eos token); generation stops when every row is done.
* :func:`stream` yields the new tokens (B, 1) as they come (the CLI prints them as text).
* :func:`beam_search` is Hugging Face's beam search (``generate(num_beams=n, do_sample=False)``):
  same hypotheses, length penalty and default early-stopping heuristic.
* Prompts of different lengths go in one batch *left-padded*, with ``attention_mask`` (B, T) (1 =
  real token). Positions come from the mask's cumulative sum, so each row generates exactly what it
  would alone.
* Decode steps over an unpadded :class:`~gptlab.kvcache.StaticKVCache` run a lean step
  (:class:`_FastDecodeStep`: the same weights and logits as ``GPT.forward``, without its per-call
  generality, and with each matrix product split in row blocks over the CPU's cores), which is
  what makes batch-1 decoding fast on a CPU; ``fast=False`` calls ``GPT.forward`` every step.
  ``python -m gptlab bench generate`` measures both. Speculative decoding
  (:mod:`gptlab.speculative`) runs its draft's steps and its target's verification on it too.
* Past ``block_size`` tokens the context is cropped to the last ``block_size`` (nanoGPT's rule);
  from then on each step recomputes the cropped window without the cache (learned positions cannot
  go further), so cached and uncached generation stay identical.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .kvcache import ConcatKVCache, KVCache, SlidingWindowKVCache, StaticKVCache
from .sampling import (
    _check_min_p,
    _check_top_k,
    _check_top_p,
    _real,
    process_logits,
    sample_next,
)

__all__ = ["generate", "stream", "beam_search", "make_cache", "register_cli"]

CACHE_IMPLS = ("static", "concat", "sliding")


# --------------------------------------------------------------------------- helpers


def make_cache(model, batch_size: int, max_len: int, impl: str = "static") -> KVCache:
    """A KV cache for ``model`` holding up to ``max_len`` slots for ``batch_size`` rows.

    ``impl``: ``"static"`` (pre-allocated, in place: the fast one), ``"concat"`` (grows by
    ``torch.cat``: the teaching one) or ``"sliding"`` (keeps the last ``config.window_size`` slots;
    needs a sliding-window model).
    """
    if impl == "static":
        return StaticKVCache.for_model(model, batch_size, max_len)
    if impl == "concat":
        return ConcatKVCache(model.config.n_layer)
    if impl == "sliding":
        w = model.config.window_size
        if w is None:
            raise ValueError("cache='sliding' needs a model with config.window_size set, got window_size=None")
        return SlidingWindowKVCache(model.config.n_layer, w)
    raise ValueError(f"cache must be one of {CACHE_IMPLS}, got {impl!r}")


def _check_idx(model, idx: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """Validate the prompt; return the attention mask as int64, or None when nothing is padded."""
    if not isinstance(idx, Tensor):
        raise TypeError(f"idx must be a torch.Tensor of token ids (B, T), got {type(idx).__name__}")
    if idx.dim() != 2 or idx.shape[0] < 1 or idx.shape[1] < 1:
        raise ValueError(f"idx must have shape (B, T) with B, T >= 1, got shape {tuple(idx.shape)}")
    if idx.is_floating_point() or idx.dtype == torch.bool:
        raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype}")
    V = model.config.vocab_size
    if int(idx.min()) < 0 or int(idx.max()) >= V:
        raise ValueError(f"idx holds token ids outside [0, {V}): min {int(idx.min())}, max {int(idx.max())}")
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != tuple(idx.shape):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a tensor of the shape of idx {tuple(idx.shape)}, got {got}")
    m = attention_mask.to(device=idx.device, dtype=torch.long)
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
    if bool((m[:, -1] == 0).any()) or bool((m[:, 1:] < m[:, :-1]).any()):
        raise ValueError("attention_mask must describe LEFT padding (zeros first, then ones, last column 1)")
    return None if bool(m.all()) else m


def _eos_tensor(eos_token_id, device) -> Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"eos_token_id must be an int or a sequence of ints, got {eos_token_id!r}")
    return torch.tensor(ids, dtype=torch.long, device=device)


class _RowSplitLinear:
    """``F.linear(x, weight, bias)`` for a few tokens, computed as ``parts`` row blocks of the
    weight in one batched matrix product: x (..., in) -> (..., out).

    Why: decoding multiplies a handful of vectors by each weight matrix, so a step is memory-bound
    (every weight is read once) and BLAS runs such a product on one core. Split into row blocks,
    ``torch.bmm`` hands each core its own block to stream, and a 2-core CPU reads the weights about
    1.7x faster (``python -m gptlab bench generate`` reports the bare chains both ways). The blocks
    are views of the model's own weight (no copy) and each output is the same dot product, so the
    result equals ``F.linear``'s up to float rounding. ``parts=1`` (or a GPU) is plain ``F.linear``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, parts: int = 1):
        out, inp = weight.shape
        p = max(1, parts)
        while p > 1 and (out % p or out // p < 16):  # equal blocks, and not absurdly thin ones
            p -= 1
        if weight.device.type != "cpu" or not weight.is_contiguous():
            p = 1
        self.weight, self.bias, self.parts, self.out, self.inp = weight, bias, p, out, inp
        if p > 1:
            self.blocks = weight.detach().view(p, out // p, inp).transpose(1, 2)  # (P, in, out/P)
            self.bias_blocks = None if bias is None else bias.detach().view(p, 1, out // p)  # (P, 1, out/P)

    def __call__(self, x: Tensor) -> Tensor:
        if self.parts == 1:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(1, -1, self.inp).expand(self.parts, -1, -1)  # (P, N, in): a view
        if self.bias_blocks is None:
            y = torch.bmm(x2, self.blocks)  # (P, N, out/P)
        else:
            y = torch.baddbmm(self.bias_blocks, x2, self.blocks)
        return y.transpose(0, 1).reshape(*lead, self.out)  # block p holds outputs p*out/P.. : a view for N=1


def _lean_norm(module):
    """A norm's ``forward`` without ``nn.Module.__call__``'s bookkeeping (GPT-2's LayerNorm reduced
    to the kernel its ``forward`` calls)."""
    from .model import LayerNorm

    if type(module) is LayerNorm:
        shape, w, b, eps = module.weight.shape, module.weight, module.bias, module.eps

        def layer_norm(x):
            return torch.layer_norm(x, shape, w, b, eps)

        return layer_norm
    return module.forward


def _lean_mlp(module, parts: int):
    """The feed-forward's ``forward`` (dropout off) with its two matrix products row-split."""
    from .model import MLP, SwiGLU, new_gelu

    fc = _RowSplitLinear(module.c_fc.weight, module.c_fc.bias, parts)
    proj = _RowSplitLinear(module.c_proj.weight, module.c_proj.bias, parts)
    if type(module) is MLP:

        def mlp(x):
            return proj(new_gelu(fc(x)))

        return mlp
    if type(module) is SwiGLU:

        def swiglu(x):
            gate, up = fc(x).chunk(2, dim=-1)
            return proj(F.silu(gate) * up)

        return swiglu
    return module.forward


class _FastDecodeStep:
    """Decode steps (a few new tokens per row over a :class:`StaticKVCache`, no padding) of a
    :class:`gptlab.GPT`, with the per-step Python overhead cut to the bone.

    ``GPT.forward`` is general (any T, masks, padding, any cache); at batch 1 on a CPU its module
    calls and bookkeeping cost about as much as the matrix products themselves. This step does the
    same arithmetic with the same weights: the model's own norm kernels, its matrix products split
    in row blocks over the CPU's cores (:class:`_RowSplitLinear`), and the attention of the new
    queries written out (append k, v to the cache in place; attend to the filled prefix, or the
    last ``window_size`` slots, causally within the new tokens). One token is a decode step; a few
    (``T > 1``) are speculative decoding's verification pass. Tests check it against
    ``GPT.forward`` for every model variant it accepts (:meth:`supports`) and both ways of
    computing the products.

    ``parts``: row blocks per weight matrix (default: ``torch.get_num_threads()`` on a CPU, 1 on
    a GPU, where one kernel already uses the whole device).
    """

    def __init__(self, model, cache: StaticKVCache, parts: int | None = None):
        from .model import apply_rope, slot_mask

        c = model.config
        device = model.lm_head.weight.device
        if parts is None:
            parts = torch.get_num_threads() if device.type == "cpu" else 1
        self.parts = parts
        self.apply_rope, self.slot_mask = apply_rope, slot_mask
        self.model, self.cache = model, cache
        self.nh, self.nkv, self.hd = c.n_head, c.kv_heads, c.head_dim
        self.q_dim, self.kv_dim = c.n_head * c.head_dim, c.kv_heads * c.head_dim
        self.rep = c.n_head // c.kv_heads
        self.window = c.window_size
        t = model.transformer
        self.wte = t.wte.weight
        self.wpe = t.wpe.weight if c.pos_emb == "learned" else None
        self.rope = (model.rope_cos, model.rope_sin) if c.pos_emb == "rope" else None
        self.ln_f = _lean_norm(t.ln_f)
        self.head = _RowSplitLinear(model.lm_head.weight, None, parts)
        self.blocks = [
            (_lean_norm(b.ln_1), _RowSplitLinear(b.attn.c_attn.weight, b.attn.c_attn.bias, parts),
             _RowSplitLinear(b.attn.c_proj.weight, b.attn.c_proj.bias, parts),
             _lean_norm(b.ln_2), _lean_mlp(b.mlp, parts))
            for b in t.h
        ]
        self._bind()

    def _bind(self) -> None:
        """The cache's per-layer buffers (rebound if the cache replaced its buffers)."""
        self._k = self.cache.k
        self.kv = [(self.cache.k[i], self.cache.v[i]) for i in range(len(self.blocks))]

    @staticmethod
    def supports(model, cache) -> bool:
        """True for a plain :class:`gptlab.GPT` in eval mode: pre-norm, SDPA attention, no hooks."""
        from .model import GPT

        if type(model) is not GPT or model.training or not isinstance(cache, StaticKVCache):
            return False
        c = model.config
        if not c.prenorm or c.attn_impl != "sdpa" or model.lm_head.bias is not None:
            return False
        for mod in model.modules():
            if mod._forward_hooks or mod._forward_pre_hooks or getattr(mod, "record_weights", False):
                return False
        return True

    def __call__(self, tok: Tensor, pos: int, last_only: bool = True) -> Tensor:
        """tok (B, T) at slots ``pos..pos+T-1`` (``pos == cache.length``) -> next-token logits:
        (B, V) for the last position if ``last_only``, else (B, T, V)."""
        if self.cache.k is not self._k:
            self._bind()
        B, T = tok.shape
        nh, nkv, hd, qd, kvd = self.nh, self.nkv, self.hd, self.q_dim, self.kv_dim
        if pos + T > self.cache.max_len:
            raise ValueError(f"the cache holds {self.cache.max_len} slots, got tokens up to slot {pos + T}")
        x = F.embedding(tok, self.wte)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe[pos : pos + T]
        cos = sin = None
        if self.rope is not None:
            cos, sin = self.rope[0][pos : pos + T], self.rope[1][pos : pos + T]  # (T, hd), broadcast
        lo = max(0, pos + 1 - self.window) if self.window else 0  # the first query's oldest key
        n_keys = pos + T - lo
        # one query sees every key in [lo, pos]; several are causal (and windowed) among themselves
        mask = None if T == 1 else self.slot_mask(pos, T, lo, n_keys, window=self.window, device=tok.device)
        one_fused = T == 1 and nkv == nh
        for (ln_1, attn, proj, ln_2, mlp), (K, Vc) in zip(self.blocks, self.kv):
            qkv = attn(ln_1(x))  # (B, T, qd + 2 kvd)
            if cos is not None:  # rotate the queries' and the keys' heads in one go
                qk = qkv.narrow(2, 0, qd + kvd).view(B, T, nh + nkv, hd).transpose(1, 2)
                qk = self.apply_rope(qk, cos, sin)  # (B, nh + nkv, T, hd)
                q, k = qk.narrow(1, 0, nh), qk.narrow(1, nh, nkv)
                v = qkv.narrow(2, qd + kvd, kvd).view(B, T, nkv, hd).transpose(1, 2)
            elif one_fused:  # with one token, (B, 1, h, hd) and (B, h, 1, hd) share their memory layout
                q, k, v = qkv.view(B, 3, nh, 1, hd).unbind(1)
            else:
                q = qkv.narrow(2, 0, qd).view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
                k = qkv.narrow(2, qd, kvd).view(B, T, nkv, hd).transpose(1, 2)
                v = qkv.narrow(2, qd + kvd, kvd).view(B, T, nkv, hd).transpose(1, 2)
            K.narrow(2, pos, T).copy_(k)  # append to the cache, in place
            Vc.narrow(2, pos, T).copy_(v)
            ks, vs = K.narrow(2, lo, n_keys), Vc.narrow(2, lo, n_keys)
            if self.rep > 1:
                ks, vs = ks.repeat_interleave(self.rep, dim=1), vs.repeat_interleave(self.rep, dim=1)
            y = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask)  # (B, nh, T, hd)
            x = x + proj(y.transpose(1, 2).reshape(B, T, qd))
            x = x + mlp(ln_2(x))
        self.cache.length = pos + T
        x = self.ln_f(x)
        if last_only:
            return self.head(x[:, -1])  # (B, V)
        return self.head(x)  # (B, T, V)


class _Runner:
    """Feeds the model the tokens it has not seen yet and returns next-token logits (B, V).

    Owns the KV cache, the padding mask and the positions. Falls back to recomputing the cropped
    last ``block_size`` tokens (no cache) once the sequence no longer fits.
    """

    def __init__(self, model, batch: int, prompt_len: int, total_len: int, mask: Tensor | None,
                 use_cache: bool, cache_impl: str, device, fast: bool = True):
        self.model = model
        self.block_size = model.config.block_size
        self.max_len = min(total_len, self.block_size)
        self.cache = make_cache(model, batch, self.max_len, cache_impl) if use_cache else None
        self.fast = None
        if fast and mask is None and self.cache is not None and _FastDecodeStep.supports(model, self.cache):
            self.fast = _FastDecodeStep(model, self.cache)
        self.mask = self.positions = None
        if mask is not None:
            full = torch.ones(batch, total_len, dtype=torch.long, device=device)
            full[:, :prompt_len] = mask
            self.mask = full  # (B, total_len)
            self.positions = (full.cumsum(-1) - 1).clamp(min=0)  # (B, total_len)

    def logits(self, ids: Tensor, cur: int) -> Tensor:
        """Logits (B, V) for the token at index ``cur``, given ``ids[:, :cur]``."""
        model, cache = self.model, self.cache
        if cache is not None and cur <= self.max_len and cache.length < cur:
            start = cache.length
            if self.fast is not None and start == cur - 1 and start > 0:
                return self.fast(ids[:, start:cur], start)
            if self.mask is None:
                out, _ = model(ids[:, start:cur], kv_cache=cache, last_only=True)
            else:
                out, _ = model(ids[:, start:cur], kv_cache=cache, last_only=True,
                               position_ids=self.positions[:, start:cur], attention_mask=self.mask[:, :cur])
            return out[:, -1, :]
        self.cache = None  # past block_size (or no cache): recompute the cropped window
        start = max(0, cur - self.block_size)
        if self.mask is None:
            out, _ = model(ids[:, start:cur], last_only=True)
        else:
            m = self.mask[:, start:cur]
            pos = (m.cumsum(-1) - 1).clamp(min=0)
            out, _ = model(ids[:, start:cur], last_only=True, position_ids=pos, attention_mask=m)
        return out[:, -1, :]

    def reorder(self, index: Tensor) -> None:
        """Row ``b`` becomes old row ``index[b]`` (beam search)."""
        if self.cache is not None:
            self.cache.reorder(index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
            self.positions = self.positions.index_select(0, index)


class _EvalMode:
    """Put the model in eval mode (no dropout) for the duration, restoring its mode after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.was_training = self.model.training
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)


# --------------------------------------------------------------------------- sampling decode loop


def _steps(
    model,
    out: Tensor,
    prompt_len: int,
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    repetition_penalty: float | None,
    frequency_penalty: float | None,
    presence_penalty: float | None,
    eos_token_id,
    pad_token_id: int | None,
    use_cache: bool,
    cache: str,
    generator: torch.Generator | None,
    mask: Tensor | None,
    fast: bool = True,
) -> Iterator[Tensor]:
    """The decode loop. Writes new tokens into ``out`` (B, T + max_new_tokens) and yields each
    step's tokens (B, 1) (a view of ``out``)."""
    B = out.shape[0]
    device = out.device
    runner = _Runner(model, B, prompt_len, prompt_len + max_new_tokens, mask, use_cache, cache, device, fast)
    eos = _eos_tensor(eos_token_id, device)
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos is not None else None)
    done = torch.zeros(B, 1, dtype=torch.bool, device=device) if eos is not None else None
    greedy = temperature == 0
    penalties = any(
        v is not None and v != neutral
        for v, neutral in ((repetition_penalty, 1.0), (frequency_penalty, 0.0), (presence_penalty, 0.0))
    )
    plain_greedy = greedy and not penalties
    for cur in range(prompt_len, prompt_len + max_new_tokens):
        logits = runner.logits(out, cur)  # (B, V)
        if plain_greedy:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            pen_mask = None if runner.mask is None else runner.mask[:, :cur]
            logits = process_logits(
                logits.float(), out[:, :cur] if penalties else None,
                temperature=1.0 if greedy else temperature,
                top_k=None if greedy else top_k, top_p=None if greedy else top_p, min_p=None if greedy else min_p,
                repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty, mask=pen_mask,
            )
            nxt = logits.argmax(dim=-1, keepdim=True) if greedy else sample_next(logits, generator)
        if done is not None:
            nxt = nxt.masked_fill(done, pad)
            done = done | torch.isin(nxt, eos)
        out[:, cur : cur + 1] = nxt
        yield out[:, cur : cur + 1]
        if done is not None and bool(done.all()):
            return


def _setup(model, idx, max_new_tokens, temperature, top_k, top_p, min_p, cache, attention_mask, pad_token_id):
    if not hasattr(model, "config") or not callable(model):
        raise TypeError(f"model must be a gptlab GPT, got {type(model).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    t = _real(temperature, "temperature")
    if t < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    for v, check in ((top_k, _check_top_k), (top_p, _check_top_p), (min_p, _check_min_p)):
        if v is not None:
            check(v)
    if cache not in CACHE_IMPLS:
        raise ValueError(f"cache must be one of {CACHE_IMPLS}, got {cache!r}")
    if pad_token_id is not None and not 0 <= pad_token_id < model.config.vocab_size:
        raise ValueError(f"pad_token_id must be in [0, {model.config.vocab_size}), got {pad_token_id}")
    mask = _check_idx(model, idx, attention_mask)
    B, T = idx.shape
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=idx.device)
    out[:, :T] = idx
    return t, mask, out


def stream(
    model,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    use_cache: bool = True,
    cache: str = "static",
    generator: torch.Generator | None = None,
    attention_mask: Tensor | None = None,
    fast: bool = True,
) -> Iterator[Tensor]:
    """Like :func:`generate`, but yield each step's new tokens (B, 1) int64 as soon as they exist.

    Stops after ``max_new_tokens`` steps, or once every row has emitted ``eos_token_id``.
    """
    t, mask, out = _setup(model, idx, max_new_tokens, temperature, top_k, top_p, min_p, cache,
                          attention_mask, pad_token_id)
    with _EvalMode(model):
        steps = _steps(
            model, out, idx.shape[1], max_new_tokens, temperature=t, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
            use_cache=use_cache, cache=cache, generator=generator, mask=mask, fast=fast,
        )
        while True:
            with torch.inference_mode():
                tok = next(steps, None)
            if tok is None:
                return
            yield tok.clone()


def generate(
    model,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    use_cache: bool = True,
    cache: str = "static",
    generator: torch.Generator | None = None,
    attention_mask: Tensor | None = None,
    fast: bool = True,
) -> Tensor:
    """Continue each prompt by up to ``max_new_tokens`` tokens: idx (B, T) -> ids (B, T + n).

    temperature: 0 = greedy (arg-max); otherwise sample from softmax(logits / temperature) after
        the filters top_k (keep the k best, ties kept), top_p (nucleus) and min_p.
    repetition_penalty (CTRL / HF, > 0), frequency_penalty and presence_penalty (OpenAI): applied
        first, over every token so far, prompt included (padding excluded).
    eos_token_id: an id or ids that end a row. A finished row emits ``pad_token_id`` (default the
        first eos id) from then on; generation stops early when every row is done, so
        ``n <= max_new_tokens``.
    use_cache / cache: KV cache on (``"static"``: pre-allocated, the fast default; ``"concat"``;
        ``"sliding"`` for sliding-window models) or off (recompute the whole context each step).
    generator: a ``torch.Generator`` for reproducible sampling.
    attention_mask: (B, T), 1 = real token, 0 = left padding. Each row's output equals generating
        that row alone.
    fast: decode steps over an unpadded static cache skip ``GPT.forward``'s generality and run
        :class:`_FastDecodeStep` (same weights, same kernels, same logits); ``False`` calls
        ``model(...)`` for every step (the path the course derives first).
    """
    t, mask, out = _setup(model, idx, max_new_tokens, temperature, top_k, top_p, min_p, cache,
                          attention_mask, pad_token_id)
    T = idx.shape[1]
    n = 0
    with _EvalMode(model), torch.inference_mode():
        for _ in _steps(
            model, out, T, max_new_tokens, temperature=t, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
            use_cache=use_cache, cache=cache, generator=generator, mask=mask, fast=fast,
        ):
            n += 1
    return out[:, : T + n].clone()


# --------------------------------------------------------------------------- beam search


def beam_search(
    model,
    idx: Tensor,
    max_new_tokens: int,
    num_beams: int,
    length_penalty: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    *,
    pad_token_id: int | None = None,
    use_cache: bool = True,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """Beam search, as Hugging Face's ``generate(num_beams=num_beams, do_sample=False)``.

    idx (B, T) -> (B, T + n), the best finished hypothesis of each row, n <= max_new_tokens (rows
    shorter than the longest are filled with ``pad_token_id``, default the first eos id).

    Each step extends every live beam by every token, scores candidates by their summed
    log-probabilities, and keeps the best ``max(2, 1 + #eos) * num_beams``; of those, the ones in
    the top ``num_beams`` that end in eos (or reach the length limit) become finished hypotheses
    with score ``sum_logprobs / generated_len ** length_penalty``, and the best ``num_beams``
    unfinished ones live on. A row stops (HF's default ``early_stopping=False`` heuristic) once it
    has ``num_beams`` finished hypotheses and its best live beam, length-normalised at the current
    length, cannot beat the worst of them.
    """
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an int >= 1, got {num_beams!r}")
    lp = _real(length_penalty, "length_penalty")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1 for beam search, got {max_new_tokens!r}")
    mask = _check_idx(model, idx, attention_mask)
    device = idx.device
    B, T = idx.shape
    nb = num_beams
    total = T + max_new_tokens
    eos = _eos_tensor(eos_token_id, device)
    n_eos = 0 if eos is None else eos.numel()
    K = max(2, 1 + n_eos) * nb
    fill = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos is not None else 0)
    top_nb = torch.zeros(K, dtype=torch.bool, device=device)
    top_nb[:nb] = True
    NEG = -1.0e9

    running = torch.full((B, nb, total), fill, dtype=torch.long, device=device)
    running[:, :, :T] = idx[:, None, :]
    running_scores = torch.zeros(B, nb, device=device)
    running_scores[:, 1:] = NEG  # only the first beam's continuations count at step one
    seqs = running.clone()
    scores = torch.full((B, nb), NEG, device=device)
    lengths = torch.zeros(B, nb, dtype=torch.long, device=device)  # generated tokens of each finished one
    finished = torch.zeros(B, nb, dtype=torch.bool, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    batch_offset = torch.arange(B, device=device)[:, None] * nb

    flat_mask = None if mask is None else mask.repeat_interleave(nb, dim=0)
    with _EvalMode(model), torch.inference_mode():
        runner = _Runner(model, B * nb, T, total, flat_mask, use_cache, "static", device)
        flat = running.view(B * nb, total)
        for cur in range(T, total):
            logits = runner.logits(flat, cur)  # (B*nb, V)
            V = logits.shape[-1]
            logp = F.log_softmax(logits.float(), dim=-1).view(B, nb, V) + running_scores[:, :, None]
            topk_lp, topk_idx = torch.topk(logp.view(B, nb * V), K)
            src_beam = topk_idx // V
            tok = topk_idx % V
            cand = torch.take_along_dim(running, src_beam[:, :, None], dim=1)  # (B, K, total)
            cand[:, :, cur] = tok
            hits = torch.full((B, K), cur + 1 >= total, dtype=torch.bool, device=device)
            if eos is not None:
                hits = hits | torch.isin(tok, eos)
            # the best num_beams candidates that go on
            run_lp = topk_lp + hits.to(torch.float32) * NEG
            keep = torch.topk(run_lp, nb).indices
            running = torch.take_along_dim(cand, keep[:, :, None], dim=1)
            running_scores = torch.take_along_dim(run_lp, keep, dim=1)
            parent = torch.take_along_dim(src_beam, keep, dim=1)
            # finished hypotheses: only candidates in the top num_beams, only while improvable
            just = hits & top_nb[None, :]
            fin = topk_lp / ((cur + 1 - T) ** lp)
            fin = fin + (~improvable).to(torch.float32) * NEG
            fin = fin + (~just) * NEG
            m_seqs = torch.cat([seqs, cand], dim=1)
            m_scores = torch.cat([scores, fin], dim=1)
            m_fin = torch.cat([finished, just], dim=1)
            m_len = torch.cat([lengths, torch.full((B, K), cur + 1 - T, dtype=torch.long, device=device)], dim=1)
            best = torch.topk(m_scores, nb).indices
            seqs = torch.take_along_dim(m_seqs, best[:, :, None], dim=1)
            scores = torch.take_along_dim(m_scores, best, dim=1)
            finished = torch.take_along_dim(m_fin, best, dim=1)
            lengths = torch.take_along_dim(m_len, best, dim=1)
            # HF's early-stopping heuristic (early_stopping=False)
            best_running = running_scores[:, :1] / ((cur + 1 - T) ** lp)
            worst = torch.where(finished, scores.min(dim=1, keepdim=True).values, NEG)
            improvable = improvable & (best_running > worst).any(dim=-1, keepdim=True)
            if not bool(improvable.any()) or bool(hits.all()):
                break
            runner.reorder((parent + batch_offset).view(-1))
            flat = running.view(B * nb, total)
    n = int(lengths[:, 0].max())
    return seqs[:, 0, : T + n].clone()


# --------------------------------------------------------------------------- command line


def _print_stream(tokenizer, ids: list[int], printed: str) -> str:
    """Print the part of decode(ids) not printed yet (holding back a partial UTF-8 character)."""
    text = tokenizer.decode(ids)
    if text.endswith("\ufffd"):
        return printed
    new = text[len(printed):] if text.startswith(printed) else text
    sys.stdout.write(new)
    sys.stdout.flush()
    return text


def _cli_sample(args) -> int:
    from .checkpoint import load_model  # engineer B's module; imported when the command runs

    device = args.device
    if device is None:
        try:
            from .device import pick_device

            device = pick_device()
        except ImportError:
            device = "cpu"
    model, tokenizer = load_model(args.ckpt, device=device)
    model.eval()
    dev = next(model.parameters()).device
    if tokenizer is None:
        raise SystemExit(f"{args.ckpt}: checkpoint has no tokenizer, cannot encode a text prompt")
    prompt = args.prompt if args.prompt is not None else "\n"
    ids = tokenizer.encode(prompt)
    if not ids:
        raise SystemExit("the prompt encodes to no tokens; give a non-empty --prompt")
    idx = torch.tensor([ids], dtype=torch.long, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    if args.draft is not None:
        return _cli_speculative(args, model, tokenizer, idx, gen)
    kwargs = dict(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, generator=gen,
    )
    for s in range(args.num_samples):
        if s:
            print("\n" + "-" * 40)
        if args.no_stream:
            out = generate(model, idx, args.max_new_tokens, **kwargs)
            print(tokenizer.decode(out[0].tolist()))
            continue
        all_ids = list(ids)
        printed = _print_stream(tokenizer, all_ids, "")
        for tok in stream(model, idx, args.max_new_tokens, **kwargs):
            all_ids.append(int(tok[0, 0]))
            printed = _print_stream(tokenizer, all_ids, printed)
        print()
    return 0


def _cli_speculative(args, model, tokenizer, idx: Tensor, gen: torch.Generator) -> int:
    """``sample --draft``: speculative decoding, each sample printed whole, then its statistics."""
    from .checkpoint import load_model
    from .speculative import speculative_generate

    if args.repetition_penalty is not None:
        raise SystemExit("--repetition-penalty is not supported with --draft (speculative decoding "
                         "applies temperature, top-k and top-p only)")
    draft, _ = load_model(args.draft, device=idx.device)
    for s in range(args.num_samples):
        if s:
            print("\n" + "-" * 40)
        try:
            out, stats = speculative_generate(
                model, draft, idx, args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, generator=gen,
            )
        except ValueError as e:
            raise SystemExit(f"speculative decoding: {e}") from e
        print(tokenizer.decode(out[0].tolist()))
        print(f"[speculative decoding: {stats.acceptance_rate:.0%} of the draft's guesses accepted, "
              f"{stats.tokens_per_target_forward:.2f} tokens per target forward pass]", file=sys.stderr)
    return 0


def register_cli(subparsers) -> None:
    """Add ``python -m gptlab sample``."""
    p = subparsers.add_parser(
        "sample",
        help="generate text from a trained checkpoint",
        description="Load a checkpoint (model.safetensors + config.json) and stream generated text.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ckpt", required=True, help="checkpoint directory written by `gptlab train`")
    p.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--no-stream", action="store_true", help="print each sample at the end instead of streaming")
    p.add_argument("--device", default=None, help="cpu, cuda, mps (default: the best available)")
    p.add_argument("--draft", default=None, metavar="CKPT",
                   help="a smaller checkpoint with the same tokenizer: decode speculatively, the draft "
                        "guessing and --ckpt checking (same output distribution, fewer passes of --ckpt)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="guesses per round with --draft")
    p.set_defaults(func=_cli_sample)
