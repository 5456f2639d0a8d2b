"""Autoregressive generation: the decode loop, :func:`generate` and :func:`stream`.

Where this sits: text -> tokens -> model -> logits -> *samples* -> text. :func:`generate` runs the
model on the prompt once (*prefill*), then one token at a time (*decode*), each step turning the
last position's logits into a token with :mod:`gptlab.sampling` and feeding it back. With a KV
cache (:mod:`gptlab.kvcache`) a decode step only computes the newest token's keys and values.

* The settings are one :class:`gptlab.generation.GenerationConfig` (checked once, when built);
  keyword arguments (``temperature=0``, ``top_k=50``, ...) build it or change a given one.
* :func:`generate` -> (B, T + new) ids; ``temperature=0`` is greedy. Hugging Face's order of
  logits transforms: penalties, temperature, top-k, top-p, min-p. Rows that emit ``eos_token_id``
  keep emitting the pad token (default: the eos token); generation stops when every row is done.
* :func:`stream` yields the new tokens (B, 1) as they come (``python -m gptlab sample`` prints them
  as text).
* Prompts of different lengths go in one batch *left-padded*, with ``attention_mask`` (B, T) (1 =
  real token). Positions come from the mask's cumulative sum, so each row generates exactly what it
  would alone.
* Every step calls the model's decoding API, :meth:`gptlab.GPT.decode` (its one forward path,
  with a cache), through a :class:`Runner`; beam search (:mod:`gptlab.generation.beam`) and
  speculative decoding (:mod:`gptlab.generation.speculative`) call the same API.
* ``fast=True`` (the default): on a CPU, for the length of the call, the model's linear layers are
  swapped for ones that multiply by a copy of their weights packed in row blocks, every core
  streaming its own, wherever a calibration found that faster on this machine
  (:func:`gptlab.fast.cpu.pack_for_decoding`); the originals are back when the call returns. A
  batch-1 step's time goes mostly into reading the weights, so this is what makes it fast. Where
  the C++ decode step has been built on this machine (``python -m gptlab build-native``), each
  one-token step of a batch-1 decode runs the same operations from C++
  (:mod:`gptlab.fast.native`), and the layers it multiplies by its own product are not packed.
  ``fast=False`` runs the model as it is. ``python -m gptlab bench generate`` measures both.
* Past ``block_size`` tokens the context is cropped to the last ``block_size`` (nanoGPT's rule);
  from then on each step recomputes the cropped window without the cache (learned positions cannot
  go further), so cached and uncached generation stay identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from ..fast.compiled import decode_step
from ..fast.cpu import pack_for_decoding, packed_layers
from ..fast.native import native_decode, step_keeps_plain
from ..kvcache import make_cache
from ..model import check_token_ids
from .config import GenerationConfig, check_pad, eos_tensor

__all__ = ["generate", "stream", "Runner", "EvalMode", "check_prompt", "fast_path"]


# --------------------------------------------------------------------------- what every decoder shares


def check_prompt(model, idx: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """Check the prompt idx (B, T) (ids in the model's vocabulary) and its ``attention_mask``
    (B, T) (0/1, left padding); return the mask as int64, or None when nothing is padded."""
    check_token_ids(idx, model.config.vocab_size)
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


class Runner:
    """Feeds the model the tokens it has not seen yet and returns next-token logits (B, V).

    Owns the KV cache, the padding mask (B, total_len) and the positions (B, total_len). Falls back
    to recomputing the cropped last ``block_size`` tokens (no cache) once the sequence no longer
    fits.
    """

    def __init__(self, model, batch: int, prompt_len: int, total_len: int, mask: Tensor | None,
                 use_cache: bool, cache_impl: str, device, compile: bool = False, fast: bool = False):
        self.model = model
        self.decode = decode_step(model, compile and use_cache)  # model.decode, or compiled (gptlab.fast.compiled)
        self.block_size = model.config.block_size
        self.max_len = min(total_len, self.block_size)
        self.cache = make_cache(model, batch, self.max_len, cache_impl) if use_cache else None
        if fast and self.cache is not None:  # one-token steps in C++ where built (gptlab.fast.native)
            self.decode = native_decode(model, self.cache, self.decode)
        self.mask = self.positions = None
        if mask is not None:
            full = torch.ones(batch, total_len, dtype=torch.long, device=device)
            full[:, :prompt_len] = mask
            self.mask = full  # (B, total_len)
            self.positions = (full.cumsum(-1) - 1).clamp(min=0)  # (B, total_len)

    def logits(self, ids: Tensor, cur: int) -> Tensor:
        """Logits (B, V) for the token at index ``cur``, given ``ids[:, :cur]`` (ids: (B, >= cur))."""
        model, cache = self.model, self.cache
        if cache is not None and cur <= self.max_len and cache.length < cur:
            start = cache.length
            if self.mask is None:
                return self.decode(ids[:, start:cur], cache)
            return self.decode(ids[:, start:cur], cache, position_ids=self.positions[:, start:cur],
                               attention_mask=self.mask[:, :cur])
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
        """Row ``b`` becomes old row ``index[b]`` (beam search); index (B,) int64."""
        if self.cache is not None:
            self.cache.reorder(index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
            self.positions = self.positions.index_select(0, index)


def fast_path(model, fast: bool, steps: int, *, batch: int | None = None, padded: bool = False,
              cache_impl: str | None = None):
    """``fast=True``: the model's layers packed for a decode of ``steps`` steps on a CPU, for the
    block (:func:`gptlab.fast.cpu.pack_for_decoding`); ``False``: the model as it is. Given the
    decode's ``batch`` rows, whether they are ``padded`` and its cache (``cache_impl``, None: no
    cache), the layers the C++ decode step will multiply by its own product stay plain
    (:func:`gptlab.fast.native.step_keeps_plain`: it would not read their packed copies). Call it
    with the model in eval mode (the C++ step runs only then)."""
    if not fast:
        return nullcontext()
    keep = None if batch is None else step_keeps_plain(model, batch, cache_impl, padded)
    return pack_for_decoding(model, steps, keep_plain=keep)


class EvalMode:
    """Put the model in eval mode (no dropout) for the duration, restoring its mode after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.was_training = self.model.training
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)


# --------------------------------------------------------------------------- the sampling decode loop


def _steps(
    model,
    out: Tensor,
    prompt_len: int,
    config: GenerationConfig,
    generator: torch.Generator | None,
    mask: Tensor | None,
) -> Iterator[Tensor]:
    """The decode loop. Writes new tokens into ``out`` (B, T + max_new_tokens) and yields each
    step's tokens (B, 1) (a view of ``out``)."""
    B = out.shape[0]
    device = out.device
    n = config.max_new_tokens
    V = model.config.vocab_size
    eos = eos_tensor(config.eos_token_id, V, device)
    pad = config.pad_token_id if config.pad_token_id is not None else (int(eos[0]) if eos is not None else None)
    runner = Runner(model, B, prompt_len, prompt_len + n, mask, config.use_cache, config.cache, device,
                    compile=config.compile, fast=config.packs)
    done = torch.zeros(B, 1, dtype=torch.bool, device=device) if eos is not None else None
    for cur in range(prompt_len, prompt_len + n):
        logits = runner.logits(out, cur)  # (B, V)
        pen_mask = None if runner.mask is None else runner.mask[:, :cur]
        nxt = config.sampling.next_token(logits, out[:, :cur], pen_mask, generator)
        if done is not None:
            nxt = nxt.masked_fill(done, pad)
            done = done | torch.isin(nxt, eos)
        slot = out.narrow(1, cur, 1)  # out[:, cur : cur + 1], cheaper to make and to fill
        slot.copy_(nxt)
        yield slot
        if done is not None and bool(done.all()):
            return


def _decoding(model, idx: Tensor, max_new_tokens: int | None, config: GenerationConfig | None, settings: dict,
              attention_mask: Tensor | None,
              generator: torch.Generator | None) -> tuple[GenerationConfig, Iterator[Tensor], Tensor, dict]:
    """Read and check a call of :func:`generate` / :func:`stream` (their arguments) against the
    model; return its config, the decode loop, the output buffer (B, T + max_new_tokens), the
    prompt in its first T columns, and what :func:`fast_path` needs to know of the decode."""
    config = GenerationConfig.build(config, max_new_tokens, **settings)
    if not hasattr(model, "config") or not callable(model):
        raise TypeError(f"model must be a gptlab GPT, got {type(model).__name__}")
    n = config.needs_max_new_tokens()
    if config.num_beams != 1:
        raise ValueError(f"num_beams={config.num_beams}: generate and stream decode one sequence per row; "
                         "call gptlab.beam_search for beam search")
    V = model.config.vocab_size
    check_pad(config.pad_token_id, V)
    mask = check_prompt(model, idx, attention_mask)
    eos_tensor(config.eos_token_id, V, idx.device)  # checked at the call, not at the first step
    B, T = idx.shape
    out = torch.empty(B, T + n, dtype=torch.long, device=idx.device)
    out[:, :T] = idx
    decode = dict(batch=B, padded=mask is not None, cache_impl=config.cache if config.use_cache else None)
    return config, _steps(model, out, T, config, generator, mask), out, decode


def stream(model, idx: Tensor, max_new_tokens: int | None = None, config: GenerationConfig | None = None, *,
           generator: torch.Generator | None = None, attention_mask: Tensor | None = None,
           **settings: Any) -> Iterator[Tensor]:
    """Like :func:`generate` (same arguments), but yield each step's new tokens (B, 1) int64 as
    soon as they exist.

    Stops after ``max_new_tokens`` steps, or once every row has emitted ``eos_token_id``. The
    arguments are checked when ``stream`` is called, not at the first ``next()``.
    """
    config, steps, _, decode = _decoding(model, idx, max_new_tokens, config, settings, attention_mask, generator)
    return _stream_steps(model, steps, config.packs, config.max_new_tokens, decode)


def _stream_steps(model, steps: Iterator[Tensor], fast: bool, n: int, decode: dict) -> Iterator[Tensor]:
    """:func:`stream`'s generator: each step run in inference mode, a copy of its tokens yielded.
    With ``fast``, the layers are packed once and swapped in for each step only: between the
    steps (and once the stream is dropped) the model is its own."""
    packing = None
    with EvalMode(model):
        while True:
            with torch.inference_mode():
                if fast and packing is None:
                    packing = packed_layers(model, n, keep_plain=step_keeps_plain(model, **decode))
                with packing.installed() if fast else nullcontext():
                    tok = next(steps, None)
            if tok is None:
                return
            yield tok.clone()


def generate(model, idx: Tensor, max_new_tokens: int | None = None, config: GenerationConfig | None = None, *,
             generator: torch.Generator | None = None, attention_mask: Tensor | None = None,
             **settings: Any) -> Tensor:
    """Continue each prompt by up to ``max_new_tokens`` tokens: idx (B, T) int64 -> ids (B, T + n).

    Args:
        model: a :class:`gptlab.GPT`.
        idx: (B, T) the prompts' token ids (left-padded when their lengths differ).
        max_new_tokens: tokens to add (an int >= 0); None: the config's.
        config: the decoding settings, a :class:`gptlab.generation.GenerationConfig` (default:
            ``GenerationConfig()``: sampling at temperature 1, KV cache on, ``fast``).
        generator: a ``torch.Generator`` for reproducible sampling.
        attention_mask: (B, T), 1 = real token, 0 = left padding. Each row's output equals
            generating that row alone.
        **settings: any field of :class:`GenerationConfig` or of
            :class:`gptlab.sampling.SamplingConfig`, replacing the config's value (a convenience:
            ``generate(model, idx, 20, temperature=0)`` is
            ``generate(model, idx, 20, GenerationConfig(sampling=SamplingConfig(temperature=0)))``):

            * temperature: 0 = greedy (arg-max); otherwise sample from softmax(logits /
              temperature) after the filters top_k (keep the k best, ties kept), top_p (nucleus)
              and min_p.
            * repetition_penalty (CTRL / HF, > 0), frequency_penalty and presence_penalty
              (OpenAI): applied first, over every token so far, prompt included (padding excluded).
            * eos_token_id: an id or ids (each in [0, vocab_size)) that end a row. A finished row
              emits ``pad_token_id`` (default the first eos id) from then on; generation stops
              early when every row is done, so ``n <= max_new_tokens``.
            * use_cache / cache: KV cache on (``"static"``: pre-allocated, the fast default;
              ``"concat"``; ``"sliding"`` for sliding-window models) or off (recompute the whole
              context each step).
            * fast: on a CPU, run the decode steps' matrix products on weights packed in row
              blocks over the cores, in the layers where that is faster on this machine
              (:mod:`gptlab.fast.cpu`: the same products, summed in another order), and
              batch-1 one-token steps in C++ where ``python -m gptlab build-native`` built that
              step (:mod:`gptlab.fast.native`: the same operations, the same numbers, or, where its own
              product is faster on this machine, the same numbers up to float rounding); ``False``
              runs the model's own ``nn.Linear`` layers.
            * compile: run the decode steps through ``torch.compile`` (the GPU's fast path,
              :mod:`gptlab.fast.compiled`); the first call compiles.

    Returns:
        (B, T + n) int64: the prompts followed by the new tokens.

    Logits holding NaN or only ``-inf`` (a diverged checkpoint) raise ``ValueError`` rather than
    produce token 0.
    """
    config, steps, out, decode = _decoding(model, idx, max_new_tokens, config, settings, attention_mask, generator)
    n = 0
    with EvalMode(model), torch.inference_mode(), fast_path(model, config.packs, config.max_new_tokens, **decode):
        for _ in steps:
            n += 1
    return out[:, : idx.shape[1] + n].clone()
