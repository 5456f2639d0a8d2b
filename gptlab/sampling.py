"""Turning next-token logits into a choice: penalties, temperature, top-k, top-p, min-p, sampling.

Where this sits: text -> tokens -> batches -> model -> *logits -> samples* -> text. The model gives
one logit vector per sequence for the next token, ``logits`` (B, V); these functions reshape that
distribution before :func:`sample_next` draws from it (or ``argmax`` picks from it, for greedy
decoding in :mod:`gptlab.generation`).

Semantics follow Hugging Face ``transformers`` exactly (the tests compare with its
``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper`` and
``RepetitionPenaltyLogitsProcessor`` on the same inputs); the frequency and presence penalties
follow OpenAI's definition. Conventions shared by every function here:

* logits are floating point, shape (B, V) (the filters also accept any (..., V));
* a filtered-out token gets the logit ``-inf`` (probability exactly 0 after softmax);
* inputs are never modified in place: every function returns a new tensor;
* an out-of-range argument raises ``ValueError`` naming the expected range and the value given.

:func:`process_logits` chains them in Hugging Face's order: repetition penalty (then frequency and
presence penalties), temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "apply_temperature",
    "top_k_filter",
    "top_p_filter",
    "min_p_filter",
    "greedy_filter",
    "token_counts",
    "apply_repetition_penalty",
    "apply_frequency_penalty",
    "apply_presence_penalty",
    "process_logits",
    "sample_next",
    "sample_from_probs",
    "check_drawn",
    "SamplingConfig",
]

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- argument checks


def _check_logits(logits: Tensor, name: str = "logits", exact_2d: bool = False) -> None:
    if not isinstance(logits, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {logits.dtype}")
    if exact_2d and logits.dim() != 2:
        raise ValueError(f"{name} must have shape (B, V), got shape {tuple(logits.shape)}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have shape (..., V) with V >= 1, got shape {tuple(logits.shape)}")


def _real(x, name: str) -> float:
    """``x`` as a float, checked where the argument is given: a real number (not a bool, not a
    string) and finite (NaN or inf would turn the logits into NaN, which would then look like a
    broken model at sampling time). The error names the argument and the value."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    return v


def _check_ids(logits: Tensor, input_ids: Tensor, mask: Tensor | None) -> None:
    _check_logits(logits, exact_2d=True)
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[0] != logits.shape[0]:
        raise ValueError(
            f"input_ids must have shape (B, T) with B={logits.shape[0]} (the logits' batch), "
            f"got shape {tuple(input_ids.shape)}"
        )
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"mask must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(mask.shape)}")


def _check_top_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"top_k must be an int, got {type(k).__name__} {k!r}")
    if k < 1:
        raise ValueError(f"top_k must be >= 1, got {k}")
    return int(k)


def _check_top_p(p) -> float:
    p = _real(p, "top_p")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    return p


def _check_min_p(m) -> float:
    m = _real(m, "min_p")
    if not 0.0 <= m <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {m}")
    return m


# --------------------------------------------------------------------------- warpers


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """Divide logits (..., V) by ``temperature`` > 0: below 1 sharpens, above 1 flattens.

    ``temperature == 0`` raises ``ValueError`` here, as in Hugging Face's
    ``TemperatureLogitsWarper``: dividing by zero is not a distribution. Temperature 0 *does* mean
    greedy decoding in :func:`gptlab.generation.generate` and :func:`process_logits`, which handle
    it with :func:`greedy_filter` instead of a division.
    """
    _check_logits(logits)
    t = _real(temperature, "temperature")
    if not t > 0:
        hint = " (temperature 0 means greedy: use generate(temperature=0) or greedy_filter)" if t == 0 else ""
        raise ValueError(f"temperature must be > 0, got {temperature}{hint}")
    return logits / t


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest logits of each row (..., V), and every logit tied with the k-th.

    The rest become ``-inf``. ``k >= V`` keeps everything. (Hugging Face's ``TopKLogitsWarper``.)
    """
    _check_logits(logits)
    k = min(_check_top_k(k), logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, _NEG_INF)


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability reaches ``p``.

    logits (..., V), ``0 < p <= 1``. At least the most likely token is always kept. As in Hugging
    Face's ``TopPLogitsWarper``: sort ascending, drop the tokens whose cumulative probability is
    ``<= 1 - p``. With ``p = 1`` only tokens of probability exactly 0 are dropped.
    """
    _check_logits(logits)
    p = _check_top_p(p)
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1.0 - p)
    remove_sorted[..., -1:] = False  # keep the most likely token
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, _NEG_INF)


def min_p_filter(logits: Tensor, min_p: float) -> Tensor:
    """Keep tokens whose probability is at least ``min_p`` times the top token's probability.

    logits (..., V), ``0 <= min_p <= 1`` (0 keeps everything). The most likely token is always
    kept. Hugging Face's ``MinPLogitsWarper``.
    """
    _check_logits(logits)
    m = _check_min_p(min_p)
    probs = torch.softmax(logits, dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    remove = probs < m * top
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(remove, _NEG_INF)


def greedy_filter(logits: Tensor) -> Tensor:
    """Temperature 0 as a distribution: keep only the arg-max of each row (..., V) (the first one if
    several tie), every other logit ``-inf``. Sampling from it always returns ``argmax``."""
    _check_logits(logits)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.argmax(dim=-1, keepdim=True), True)
    return logits.masked_fill(~keep, _NEG_INF)


# --------------------------------------------------------------------------- penalties


def token_counts(input_ids: Tensor, vocab_size: int, mask: Tensor | None = None) -> Tensor:
    """How often each token id occurs in each row: input_ids (B, T) -> counts (B, V) float32.

    ``mask`` (B, T), 1 for positions that count (real tokens) and 0 for ones that do not (left
    padding). Ids outside ``[0, vocab_size)`` are ignored (as Hugging Face does for ids the output
    head cannot produce).
    """
    ids = input_ids.long()
    w = torch.ones(ids.shape, dtype=torch.float32, device=ids.device) if mask is None else mask.to(torch.float32)
    out_of_range = (ids < 0) | (ids >= vocab_size)
    ids = ids.masked_fill(out_of_range, vocab_size)  # an extra bucket, dropped below
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, w)
    return counts[:, :vocab_size]


def apply_repetition_penalty(
    logits: Tensor, input_ids: Tensor, penalty: float, *, mask: Tensor | None = None
) -> Tensor:
    """CTRL's repetition penalty (Keskar et al., 2019), as Hugging Face applies it.

    logits (B, V), input_ids (B, T) (the prompt included). For every token present in a row's ids,
    a positive logit is divided by ``penalty`` and a negative one multiplied by it, once however
    often it occurs. ``penalty > 0``; 1 is no change, above 1 discourages repetition. ``mask``
    (B, T): only positions with 1 count (leave left padding out).
    """
    _check_ids(logits, input_ids, mask)
    pen = _real(penalty, "repetition_penalty")
    if not pen > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {penalty}")
    present = token_counts(input_ids, logits.shape[-1], mask) > 0
    penalised = torch.where(logits < 0, logits * pen, logits / pen)
    return torch.where(present, penalised, logits)


def apply_frequency_penalty(
    logits: Tensor, input_ids: Tensor, penalty: float, *, mask: Tensor | None = None
) -> Tensor:
    """OpenAI's frequency penalty: ``logit[j] -= penalty * count[j]``, count[j] = occurrences of
    token j in the row's ids (B, T) (only where ``mask`` is 1). logits (B, V). Any real penalty
    (OpenAI uses -2..2); negative values encourage repetition."""
    _check_ids(logits, input_ids, mask)
    pen = _real(penalty, "frequency_penalty")
    counts = token_counts(input_ids, logits.shape[-1], mask).to(logits.dtype)
    return logits - pen * counts


def apply_presence_penalty(
    logits: Tensor, input_ids: Tensor, penalty: float, *, mask: Tensor | None = None
) -> Tensor:
    """OpenAI's presence penalty: ``logit[j] -= penalty * (count[j] > 0)`` for the tokens present in
    the row's ids (B, T) (only where ``mask`` is 1). logits (B, V). Any real penalty."""
    _check_ids(logits, input_ids, mask)
    pen = _real(penalty, "presence_penalty")
    present = (token_counts(input_ids, logits.shape[-1], mask) > 0).to(logits.dtype)
    return logits - pen * present


# --------------------------------------------------------------------------- the chain


def process_logits(
    logits: Tensor,
    input_ids: Tensor | None = None,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """All transforms in Hugging Face's order: repetition penalty, frequency and presence
    penalties, temperature, top-k, top-p, min-p. logits (B, V) -> logits (B, V).

    ``input_ids`` (B, T), the tokens so far (prompt included), is needed by the penalties; ``mask``
    (B, T) leaves padded positions out of them. ``temperature == 0`` means greedy: the result keeps
    only the arg-max (:func:`greedy_filter`), so sampling from it is deterministic. Arguments that
    are ``None`` (and temperature 1, penalties 1 / 0) are skipped.
    """
    _check_logits(logits)
    t = _real(temperature, "temperature")
    if t < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    penalties = [
        (repetition_penalty, apply_repetition_penalty, 1.0),
        (frequency_penalty, apply_frequency_penalty, 0.0),
        (presence_penalty, apply_presence_penalty, 0.0),
    ]
    for value, fn, neutral in penalties:
        if value is None:
            continue
        if input_ids is None:
            raise ValueError(f"{fn.__name__.removeprefix('apply_')} needs input_ids (B, T), got None")
        if value != neutral:  # the neutral value changes nothing: skip the work
            logits = fn(logits, input_ids, value, mask=mask)
    # Validate everything first, so a bad argument fails the same way whatever the temperature.
    top_k = None if top_k is None else _check_top_k(top_k)
    top_p = None if top_p is None else _check_top_p(top_p)
    min_p = None if min_p is None else _check_min_p(min_p)
    if t == 0:
        return greedy_filter(logits)  # the arg-max is kept by every filter, so they are moot
    if t != 1.0:
        logits = apply_temperature(logits, t)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:  # p = 1 only drops zero-probability tokens: skip it
        logits = top_p_filter(logits, top_p)
    if min_p is not None and min_p > 0.0:
        logits = min_p_filter(logits, min_p)
    return logits


def check_drawn(logits: Tensor, tokens: Tensor) -> None:
    """Raise ``ValueError`` if a row's chosen token is not a real choice: logits (B, V), tokens
    (B, 1). A row of logits holding NaN, or only ``-inf``, is no distribution; the arg-max or a
    draw from it returns some id (often 0) whose logit is NaN or ``-inf``, and a diverged model
    would emit that id forever. Costs one gather and one reduction (a decode step pays it)."""
    chosen = logits.gather(-1, tokens)  # (B, 1)
    if not float(chosen.min()) > float("-inf"):  # the minimum is NaN if any is; False for NaN and -inf
        ok = chosen > float("-inf")
        _not_a_distribution(logits, int((~ok).nonzero()[0, 0]))


def _not_a_distribution(logits: Tensor, row: int) -> None:
    what = "NaN" if bool(logits[row].isnan().any()) else "no finite value (every token filtered out or -inf)"
    raise ValueError(
        f"the logits of row {row} hold {what}: they are no distribution to pick a token from "
        f"(a diverged or corrupted model gives NaN logits; check the checkpoint)"
    )


def sample_next(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row from softmax(logits): logits (B, V) -> token ids (B, 1) int64.

    ``generator`` (a ``torch.Generator`` on the logits' device) makes the draw reproducible. A row
    holding NaN or only ``-inf`` raises ``ValueError`` (:func:`check_drawn`), as
    ``torch.multinomial`` does, instead of returning token 0.
    """
    _check_logits(logits, exact_2d=True)
    probs = torch.softmax(logits.float(), dim=-1)
    tokens = sample_from_probs(probs, generator)
    ok = probs.gather(-1, tokens) > 0  # a drawn token of probability 0 or NaN: no distribution
    if not bool(ok.all()):
        _not_a_distribution(logits, int((~ok).nonzero()[0, 0]))
    return tokens


@dataclass(frozen=True)
class SamplingConfig:
    """The decoding settings of :func:`process_logits`, checked once when built (a bad value
    raises ``ValueError`` naming the expected range): temperature (0 = greedy), top_k, top_p,
    min_p, repetition_penalty, frequency_penalty, presence_penalty. ``None`` = off."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    def __post_init__(self):
        t = _real(self.temperature, "temperature")
        if t < 0 or t != t:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        object.__setattr__(self, "temperature", t)
        for name, check in (("top_k", _check_top_k), ("top_p", _check_top_p), ("min_p", _check_min_p)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check(getattr(self, name)))
        if self.repetition_penalty is not None and _real(self.repetition_penalty, "repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) is not None:
                _real(getattr(self, name), name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalties(self) -> bool:
        """True if a penalty is set to a value that changes the logits."""
        return any(
            v is not None and v != neutral
            for v, neutral in ((self.repetition_penalty, 1.0), (self.frequency_penalty, 0.0),
                               (self.presence_penalty, 0.0))
        )

    def process(self, logits: Tensor, input_ids: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        """:func:`process_logits` with these settings: logits (B, V) -> (B, V); ``input_ids``
        (B, T) and ``mask`` (B, T) feed the penalties."""
        return process_logits(
            logits, input_ids, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, mask=mask,
        )

    def next_token(
        self,
        logits: Tensor,
        input_ids: Tensor | None = None,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """The next token of each row: logits (B, V) -> ids (B, 1). Greedy is the arg-max (of the
        penalised logits, if penalties are set); otherwise a draw after every filter."""
        if self.greedy and not self.penalties:
            # the arg-max (the first of equal maxima, as argmax) and its logit in one call: a decode
            # step checks the chosen logit (check_drawn) without a gather
            best, tokens = logits.max(dim=-1, keepdim=True)
            if not float(best if best.numel() == 1 else best.min()) > float("-inf"):  # NaN or -inf
                check_drawn(logits, tokens)
            return tokens
        processed = self.process(logits.float(), input_ids if self.penalties else None, mask)
        if self.greedy:  # process() kept the arg-max only
            tokens = processed.argmax(dim=-1, keepdim=True)
            check_drawn(processed, tokens)
            return tokens
        return sample_next(processed, generator)


def sample_from_probs(probs: Tensor, generator: torch.Generator | None = None, buffer: Tensor | None = None) -> Tensor:
    """One draw per row of a probability table: probs (B, V) -> token ids (B, 1) int64.

    The *exponential race*: token ``i`` draws an arrival time ``E_i ~ Exp(1) / p_i`` and the first
    to arrive wins, which happens with probability exactly ``p_i`` (it is the Gumbel-max trick,
    exponentiated). It is the algorithm ``torch.multinomial(probs, 1)`` runs, with the same random
    numbers, so it returns the very same tokens for the same generator state; it skips
    ``multinomial``'s validity checks (reductions and a device sync), which makes it about 3x
    faster on a small vocabulary, where decoding one token at a time pays for them every step.
    The caller guarantees ``probs`` is a distribution (softmax output, say): non-negative, finite.
    ``generator`` must live on ``probs``' device. ``buffer``, a tensor of probs' shape, dtype and
    device, takes the arrival times instead of a new tensor (a loop of draws reuses one: the same
    numbers, the same tokens).
    """
    race = (torch.empty_like(probs) if buffer is None else buffer).exponential_(generator=generator)
    return (probs / race).argmax(dim=-1, keepdim=True)
