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
* Every step calls the model's decoding API, :meth:`gptlab.GPT.decode` (its one forward path,
  with a cache). Speculative decoding (:mod:`gptlab.speculative`) calls the same API.
* ``fast=True`` (the default): on a CPU, for the length of the call, the model's linear layers are
  swapped for ones that multiply by a copy of their weights packed in row blocks, every core
  streaming its own, wherever a calibration found that faster on this machine
  (:func:`gptlab.fast.cpu.pack_for_decoding`); the originals are back when the call returns. A batch-1 step's time goes mostly into reading the
  weights, so this is what makes it fast. ``fast=False`` runs the model as it is.
  ``python -m gptlab bench generate`` measures both.
* Past ``block_size`` tokens the context is cropped to the last ``block_size`` (nanoGPT's rule);
  from then on each step recomputes the cropped window without the cache (learned positions cannot
  go further), so cached and uncached generation stay identical.
"""

from __future__ import annotations

import argparse
import math
import numbers
import sys
from collections.abc import Iterator, Sequence
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .fast.cpu import pack_for_decoding, packed_layers
from .kvcache import CACHE_IMPLS, make_cache
from .model import check_token_ids
from .sampling import SamplingConfig

__all__ = ["generate", "stream", "beam_search", "make_cache", "register_cli"]


# --------------------------------------------------------------------------- helpers


def _check_idx(model, idx: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """Validate the prompt; return the attention mask as int64, or None when nothing is padded."""
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


def _as_id(x) -> int | None:
    """``x`` as a Python int if it is one token id: an int, a NumPy integer, or a 0-d integer
    tensor or array (what ``tokenizer(...)`` and ``model.config`` hand out); None otherwise. A bool
    is not an id."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, Tensor):
        integer = not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
        return int(x.item()) if x.ndim == 0 and integer else None
    if isinstance(x, np.ndarray):
        return int(x.item()) if x.ndim == 0 and x.dtype.kind in "iu" else None
    return int(x) if isinstance(x, numbers.Integral) else None


def _eos_tensor(eos_token_id, vocab_size: int, device) -> Tensor | None:
    """The end-of-sequence ids as a tensor (n,), each checked to be in [0, vocab_size).

    ``eos_token_id``: one id or a non-empty sequence of ids (list, tuple, 1-d tensor or array); an
    id may be an int, a NumPy integer or a 0-d integer tensor, as Hugging Face accepts."""
    if eos_token_id is None:
        return None
    one = _as_id(eos_token_id)
    if one is not None:
        ids = [one]
    else:
        many = isinstance(eos_token_id, (list, tuple)) or (
            isinstance(eos_token_id, (Tensor, np.ndarray)) and eos_token_id.ndim == 1)
        ids = [_as_id(i) for i in eos_token_id] if many else []
        if not ids or None in ids:
            raise TypeError(f"eos_token_id must be an int or a non-empty sequence of ints, got {eos_token_id!r}")
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ValueError(f"eos_token_id must be in [0, {vocab_size}) (the vocabulary), got {i}")
    return torch.tensor(ids, dtype=torch.long, device=device)


def _check_pad(pad_token_id, vocab_size: int) -> int | None:
    """``pad_token_id`` as an int (an int, NumPy integer or 0-d integer tensor), in [0, vocab_size)."""
    if pad_token_id is None:
        return None
    pad = _as_id(pad_token_id)
    if pad is None:
        raise TypeError(f"pad_token_id must be an int, got {type(pad_token_id).__name__} {pad_token_id!r}")
    if not 0 <= pad < vocab_size:
        raise ValueError(f"pad_token_id must be in [0, {vocab_size}), got {pad}")
    return pad


class _Runner:
    """Feeds the model the tokens it has not seen yet and returns next-token logits (B, V).

    Owns the KV cache, the padding mask and the positions. Falls back to recomputing the cropped
    last ``block_size`` tokens (no cache) once the sequence no longer fits.
    """

    def __init__(self, model, batch: int, prompt_len: int, total_len: int, mask: Tensor | None,
                 use_cache: bool, cache_impl: str, device):
        self.model = model
        self.block_size = model.config.block_size
        self.max_len = min(total_len, self.block_size)
        self.cache = make_cache(model, batch, self.max_len, cache_impl) if use_cache else None
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
            if self.mask is None:
                return model.decode(ids[:, start:cur], cache)
            return model.decode(ids[:, start:cur], cache, position_ids=self.positions[:, start:cur],
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
        """Row ``b`` becomes old row ``index[b]`` (beam search)."""
        if self.cache is not None:
            self.cache.reorder(index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
            self.positions = self.positions.index_select(0, index)


def _fast_path(model, fast: bool, steps: int):
    """``fast=True``: the model's layers packed for a decode of ``steps`` steps on a CPU, for the
    block (:func:`gptlab.fast.cpu.pack_for_decoding`); ``False``: the model as it is."""
    return pack_for_decoding(model, steps) if fast else nullcontext()


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
    sampling: SamplingConfig,
    eos: Tensor | None,
    pad: int | None,
    use_cache: bool,
    cache: str,
    generator: torch.Generator | None,
    mask: Tensor | None,
) -> Iterator[Tensor]:
    """The decode loop. Writes new tokens into ``out`` (B, T + max_new_tokens) and yields each
    step's tokens (B, 1) (a view of ``out``)."""
    B = out.shape[0]
    device = out.device
    runner = _Runner(model, B, prompt_len, prompt_len + max_new_tokens, mask, use_cache, cache, device)
    done = torch.zeros(B, 1, dtype=torch.bool, device=device) if eos is not None else None
    for cur in range(prompt_len, prompt_len + max_new_tokens):
        logits = runner.logits(out, cur)  # (B, V)
        pen_mask = None if runner.mask is None else runner.mask[:, :cur]
        nxt = sampling.next_token(logits, out[:, :cur], pen_mask, generator)
        if done is not None:
            nxt = nxt.masked_fill(done, pad)
            done = done | torch.isin(nxt, eos)
        out[:, cur : cur + 1] = nxt
        yield out[:, cur : cur + 1]
        if done is not None and bool(done.all()):
            return


_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _decoding(model, idx: Tensor, max_new_tokens: int, options: dict) -> tuple[Iterator[Tensor], Tensor, int]:
    """Check the arguments of :func:`generate` / :func:`stream` (``options``: their keywords) and
    return the decode loop, the output buffer (B, T + max_new_tokens) and the fast flag."""
    if not hasattr(model, "config") or not callable(model):
        raise TypeError(f"model must be a gptlab GPT, got {type(model).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    sampling = SamplingConfig(**{k: options[k] for k in _SAMPLING})
    if options["cache"] not in CACHE_IMPLS:
        raise ValueError(f"cache must be one of {CACHE_IMPLS}, got {options['cache']!r}")
    V = model.config.vocab_size
    pad = _check_pad(options["pad_token_id"], V)
    mask = _check_idx(model, idx, options["attention_mask"])
    eos = _eos_tensor(options["eos_token_id"], V, idx.device)
    if pad is None and eos is not None:
        pad = int(eos[0])
    B, T = idx.shape
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=idx.device)
    out[:, :T] = idx
    steps = _steps(model, out, T, max_new_tokens, sampling, eos, pad, options["use_cache"], options["cache"],
                   options["generator"], mask)
    return steps, out, bool(options["fast"])


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
    """Like :func:`generate` (same arguments), but yield each step's new tokens (B, 1) int64 as
    soon as they exist.

    Stops after ``max_new_tokens`` steps, or once every row has emitted ``eos_token_id``. The
    arguments are checked when ``stream`` is called, not at the first ``next()``.
    """
    options = dict(locals())
    steps, _, fast = _decoding(model, idx, max_new_tokens, options)
    return _stream_steps(model, steps, fast, max_new_tokens)


def _stream_steps(model, steps: Iterator[Tensor], fast: bool, n: int) -> Iterator[Tensor]:
    """:func:`stream`'s generator: each step run in inference mode, a copy of its tokens yielded.
    With ``fast``, the layers are packed once and swapped in for each step only: between the
    steps (and once the stream is dropped) the model is its own."""
    packing = None
    with _EvalMode(model):
        while True:
            with torch.inference_mode():
                if fast and packing is None:
                    packing = packed_layers(model, n)
                with packing.installed() if fast else nullcontext():
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
    eos_token_id: an id or ids (each in [0, vocab_size)) that end a row. A finished row emits
        ``pad_token_id`` (default the first eos id) from then on; generation stops early when
        every row is done, so ``n <= max_new_tokens``.
    use_cache / cache: KV cache on (``"static"``: pre-allocated, the fast default; ``"concat"``;
        ``"sliding"`` for sliding-window models) or off (recompute the whole context each step).
    generator: a ``torch.Generator`` for reproducible sampling.
    attention_mask: (B, T), 1 = real token, 0 = left padding. Each row's output equals generating
        that row alone.
    fast: on a CPU, run the decode steps' matrix products on weights packed in row blocks over the
        cores, in the layers where that is faster on this machine (:mod:`gptlab.fast.cpu`: the same
        products, summed in another order); ``False`` runs the model's own ``nn.Linear`` layers.

    Logits holding NaN or only ``-inf`` (a diverged checkpoint) raise ``ValueError`` rather than
    produce token 0.
    """
    options = dict(locals())
    steps, out, fast = _decoding(model, idx, max_new_tokens, options)
    n = 0
    with _EvalMode(model), torch.inference_mode(), _fast_path(model, fast, max_new_tokens):
        for _ in steps:
            n += 1
    return out[:, : idx.shape[1] + n].clone()


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
    early_stopping: bool | str = False,
    fast: bool = True,
) -> Tensor:
    """Beam search, as Hugging Face's ``generate(num_beams=num_beams, do_sample=False,
    early_stopping=early_stopping)``.

    idx (B, T) -> (B, T + n), the best finished hypothesis of each row, n <= max_new_tokens (rows
    shorter than the longest are filled with ``pad_token_id``, default the first eos id).

    Each step extends every live beam by every token, scores candidates by their summed
    log-probabilities, and keeps the best ``max(2, 1 + #eos) * num_beams``; of those, the ones in
    the top ``num_beams`` that end in eos (or reach the length limit) become finished hypotheses
    with score ``sum_logprobs / generated_len ** length_penalty``, and the best ``num_beams``
    unfinished ones live on. A row stops (HF's default ``early_stopping=False`` heuristic) once it
    has ``num_beams`` finished hypotheses and its best live beam, length-normalised at the current
    length, cannot beat the worst of them.

    ``early_stopping`` (Hugging Face's three modes): ``False`` is the heuristic above; ``True``
    stops a row as soon as it has ``num_beams`` finished hypotheses; ``"never"`` estimates the
    best live beam's score at the longest length it could reach (with ``length_penalty > 0``),
    so a row stops only when no beam can possibly do better.

    ``fast``: as in :func:`generate` (the decode steps' products on packed weights where faster).
    """
    if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an int >= 1, got {num_beams!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, numbers.Real):
        raise TypeError(f"length_penalty must be a real number, got {type(length_penalty).__name__} {length_penalty!r}")
    lp = float(length_penalty)
    if not math.isfinite(lp):  # NaN or inf would make every score NaN or 0: no ranking at all
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1 for beam search, got {max_new_tokens!r}")
    mask = _check_idx(model, idx, attention_mask)
    pad_token_id = _check_pad(pad_token_id, model.config.vocab_size)
    device = idx.device
    B, T = idx.shape
    nb = num_beams
    total = T + max_new_tokens
    eos = _eos_tensor(eos_token_id, model.config.vocab_size, device)
    stop_when_full = early_stopping is True
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
    with _EvalMode(model), torch.inference_mode(), _fast_path(model, fast, max_new_tokens):
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
            fin = fin + (finished.all(dim=-1, keepdim=True) & stop_when_full).to(torch.float32) * NEG
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
            # HF's early-stopping heuristic: can the best live beam still beat the worst finished one?
            best_len = total - T if early_stopping == "never" and lp > 0.0 else cur + 1 - T
            best_running = running_scores[:, :1] / (best_len**lp)
            worst = torch.where(finished, scores.min(dim=1, keepdim=True).values, NEG)
            improvable = improvable & (best_running > worst).any(dim=-1, keepdim=True)
            if not bool(improvable.any()) or bool(hits.all()) or (stop_when_full and bool(finished.all())):
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


_PROG = "python -m gptlab sample"
_DEFAULT_MAX_NEW_TOKENS = 500


class _UsageError(Exception):
    """A mistake in ``sample``'s arguments (a bad value, a missing checkpoint, a prompt the
    tokenizer cannot encode): one line on stderr, exit status 2."""


def _option_error(e: Exception) -> _UsageError:
    """A sampling argument's error, with the argument named as its command-line option
    (``top_p must be ...`` -> ``--top-p must be ...``)."""
    msg = str(e)
    name = msg.split(" ", 1)[0]
    if name in ("temperature", "top_k", "top_p", "repetition_penalty"):
        msg = "--" + name.replace("_", "-") + msg[len(name):]
    return _UsageError(msg)


def _check_sample_args(args) -> None:
    """Check every numeric option before anything is loaded; the error names the option."""
    try:
        SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       repetition_penalty=args.repetition_penalty)
    except (TypeError, ValueError) as e:
        raise _option_error(e) from None
    for option, value, least in (("--max-new-tokens", args.max_new_tokens, 0), ("--num-samples", args.num_samples, 1),
                                 ("--num-draft-tokens", args.num_draft_tokens, 1)):
        if value is not None and value < least:
            raise _UsageError(f"{option} must be >= {least}, got {value}")
    if args.draft is not None and args.repetition_penalty is not None:
        raise _UsageError("--repetition-penalty is not supported with --draft (speculative decoding "
                          "applies --temperature, --top-k and --top-p only)")


def _load(path: str, what: str, device):
    """``load_model(path)``: a folder that holds no checkpoint is a usage error (exit 2), one that
    cannot be read a ``RuntimeError`` (exit 1)."""
    from .train.checkpoint import CheckpointError, load_model, resolve_checkpoint  # only the command needs it

    try:
        resolve_checkpoint(path)
    except CheckpointError as e:
        raise _UsageError(f"{what}: {e}") from None
    try:
        return load_model(path, device=device)
    except (OSError, ValueError, TypeError) as e:
        raise RuntimeError(f"{what} {path}: cannot load the checkpoint: {e}") from None


def _max_new_tokens(args, models: list[tuple[str, object]], prompt_len: int) -> int:
    """``--max-new-tokens``, or its default fitted to the models. Speculative decoding needs the
    prompt and the new tokens within every model's block size: the default is clipped to what they
    allow (with a note on stderr), an explicit value beyond it is a usage error. Plain sampling
    crops the context past the block size, so any length works."""
    n = args.max_new_tokens
    if args.draft is None:
        return _DEFAULT_MAX_NEW_TOKENS if n is None else n
    option, block = min(((o, m.config.block_size) for o, m in models), key=lambda x: x[1])
    room = block - prompt_len
    if room < 0:
        raise _UsageError(f"the prompt is {prompt_len} tokens, longer than the block size {block} of {option}: "
                          "speculative decoding needs the prompt and the new tokens within it; give a shorter --prompt")
    if n is None:
        n = min(_DEFAULT_MAX_NEW_TOKENS, room)
        if n < _DEFAULT_MAX_NEW_TOKENS:
            print(f"note: --max-new-tokens {n}, what the block size {block} of {option} leaves after the "
                  f"{prompt_len}-token prompt (speculative decoding does not crop the context)", file=sys.stderr)
    elif n > room:
        raise _UsageError(f"--max-new-tokens {n} is too many for --draft: the block size {block} of {option} "
                          f"leaves {room} after the {prompt_len}-token prompt")
    return n


def _prompt_ids(prompt: str | None, tokenizer) -> list[int]:
    """The prompt's token ids. ``None`` (no ``--prompt``) is a newline, or token 0 with a note when
    the vocabulary has no newline (a default must work for any checkpoint)."""
    if prompt is None:
        try:
            return tokenizer.encode("\n")
        except ValueError:
            print(f"note: the vocabulary has no newline; starting from token 0, {tokenizer.decode([0])!r}",
                  file=sys.stderr)
            return [0]
    try:
        return tokenizer.encode(prompt)
    except ValueError as e:
        raise _UsageError(f"--prompt: {e}") from None


def _cli_sample(args) -> int:
    """``python -m gptlab sample``: a mistake in the arguments is one line on stderr and exit
    status 2; a failure afterwards (an unreadable checkpoint, a diverged model) one line and 1."""
    try:
        return _sample(args)
    except _UsageError as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as e:
        print(f"{_PROG}: {e}", file=sys.stderr)
        return 1


def _sample(args) -> int:
    from .device import pick_device

    _check_sample_args(args)
    try:
        device = pick_device(args.device)
    except (TypeError, ValueError) as e:
        raise _UsageError(f"--device: {e}") from None
    model, tokenizer = _load(args.ckpt, "--ckpt", device)
    dev = next(model.parameters()).device
    if tokenizer is None:
        raise _UsageError(f"--ckpt {args.ckpt}: the checkpoint has no tokenizer, so a text prompt cannot be encoded")
    ids = _prompt_ids(args.prompt, tokenizer)
    if not ids:
        raise _UsageError("--prompt encodes to no tokens; give a non-empty prompt")
    models = [("--ckpt", model)]
    draft = None
    if args.draft is not None:
        draft, _ = _load(args.draft, "--draft", dev)
        if draft.config.vocab_size != model.config.vocab_size:
            raise _UsageError(f"--draft must share the vocabulary of --ckpt: vocab_size {draft.config.vocab_size} "
                              f"vs {model.config.vocab_size}")
        models.append(("--draft", draft))
    max_new_tokens = _max_new_tokens(args, models, len(ids))
    idx = torch.tensor([ids], dtype=torch.long, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    if draft is not None:
        return _cli_speculative(args, model, draft, tokenizer, idx, max_new_tokens, gen)
    kwargs = dict(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, generator=gen,
    )
    for s in range(args.num_samples):
        if s:
            print("\n" + "-" * 40)
        if args.no_stream:
            out = generate(model, idx, max_new_tokens, **kwargs)
            print(tokenizer.decode(out[0].tolist()))
            continue
        all_ids = list(ids)
        printed = _print_stream(tokenizer, all_ids, "")
        for tok in stream(model, idx, max_new_tokens, **kwargs):
            all_ids.append(int(tok[0, 0]))
            printed = _print_stream(tokenizer, all_ids, printed)
        print()
    return 0


def _cli_speculative(args, model, draft, tokenizer, idx: Tensor, max_new_tokens: int, gen: torch.Generator) -> int:
    """``sample --draft``: speculative decoding, each sample printed whole, then its statistics."""
    from .speculative import speculative_generate

    for s in range(args.num_samples):
        if s:
            print("\n" + "-" * 40)
        try:
            out, stats = speculative_generate(
                model, draft, idx, max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, generator=gen,
            )
        except ValueError as e:
            raise RuntimeError(f"speculative decoding: {e}") from None
        print(tokenizer.decode(out[0].tolist()))
        print(f"[speculative decoding: {stats.acceptance_rate:.0%} of the draft's guesses accepted, "
              f"{stats.tokens_per_target_forward:.2f} tokens per target forward pass]", file=sys.stderr)
    return 0


def register_cli(subparsers) -> None:
    """Add ``python -m gptlab sample``. Each option's help states its default itself (no
    ``ArgumentDefaultsHelpFormatter``, which printed ``(default: None)`` beside a default the text
    already explained, and nothing for options without a help text)."""
    p = subparsers.add_parser(
        "sample",
        help="generate text from a trained checkpoint",
        description="Load a checkpoint (model.safetensors + config.json) and stream generated text.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint folder written by `python -m gptlab train` (required)")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="text to continue (default: a newline, or token 0 if the vocabulary has none)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens to generate per sample (default: {_DEFAULT_MAX_NEW_TOKENS}; with --draft, at most "
                        "what the smaller block size leaves after the prompt)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="keep the k most likely tokens (default: off)")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling, in (0, 1] (default: off)")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="> 0; above 1 discourages repeating tokens (default: off)")
    p.add_argument("--seed", type=int, default=1337, metavar="S", help="random seed (default: %(default)s)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="how many samples (default: %(default)s)")
    p.add_argument("--no-stream", action="store_true", help="print each sample at the end instead of streaming")
    p.add_argument("--device", default=None, help="cpu, cuda, mps or auto (default: auto, the best available)")
    p.add_argument("--draft", default=None, metavar="CKPT",
                   help="a smaller checkpoint with the same tokenizer: decode speculatively, the draft "
                        "guessing and --ckpt checking (same output distribution, fewer passes of --ckpt)")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="G",
                   help="guesses per round with --draft (default: %(default)s)")
    p.set_defaults(func=_cli_sample)
