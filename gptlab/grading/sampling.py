"""Checks of the ``sampling`` assignment (chapter 6, sampling strategies).

Where this sits: beside the pipeline's last stage (model -> *logits -> samples* -> text). Tasks, each
compared with gptlab's own piece on seeded inputs and edge cases:

* ``apply_temperature(logits, temperature)``: logits (B, V) / temperature, ``ValueError`` for
  temperature <= 0 (:func:`gptlab.sampling.apply_temperature`);
* ``top_k_filter(logits, k)``: keep the k largest logits of each row and every logit tied with the
  k-th, the rest ``-inf`` (:func:`gptlab.sampling.top_k_filter`);
* ``top_p_filter(logits, p)``: keep the smallest set of most likely tokens whose probability
  reaches p, the token that crosses p included (:func:`gptlab.sampling.top_p_filter`);
* ``apply_repetition_penalty(logits, input_ids, penalty)``: CTRL's penalty, as Hugging Face applies
  it (:func:`gptlab.sampling.apply_repetition_penalty`);
* ``sample_next(logits, generator)``: one draw per row from softmax(logits), ids (B,) int64,
  judged by the distribution of many seeded draws (:func:`gptlab.grading.core.expect_distribution`);
* ``beam_search(step_fn, prompt, num_beams, max_new_tokens, eos_token_id, length_penalty)``: the
  best hypothesis as a list of ids, compared with :func:`gptlab.generation.beam_search_fn` (the
  package's beam search on a step function, every step searched) on a small fixed toy language model.

The filters are single operations on float32 logits: compared with atol 1e-6, rtol 1e-5 (a
filtered entry must be exactly ``-inf``). Each task forbids gptlab's own function and Hugging
Face's logits processor for it (``transformers.TopKLogitsWarper`` and the others, once
``transformers`` is imported) as delegation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import generation as _generation
from ..generation.beam import Candidates, finish_in_top_beams, hypothesis_score
from .. import sampling as _sampling
from .core import (
    ExerciseError,
    Forbidden,
    call,
    entries_of,
    close,
    describe,
    expect_distribution,
    expect_tensor,
    require_function,
    same,
)
from .portables import ToyLM
from .task import Case, Task

__all__ = [
    "check_apply_temperature",
    "check_top_k_filter",
    "check_top_p_filter",
    "check_apply_repetition_penalty",
    "check_sample_next",
    "check_beam_search",
    "ToyLM",
    "reference_beam_search",
]

NINF = float("-inf")
ATOL, RTOL = 1e-6, 1e-5

_GPTLAB_FILTERS = entries_of(
    _sampling, "apply_temperature", "top_k_filter", "top_p_filter", "min_p_filter", "greedy_filter",
    "apply_repetition_penalty", "apply_frequency_penalty", "apply_presence_penalty", "process_logits")
_GPTLAB_SAMPLERS = entries_of(_sampling, "sample_next", "sample_from_probs") + (
    Forbidden(_generation.generate, "gptlab.generate"),)
_GPTLAB_BEAM = (Forbidden(_generation.beam_search, "gptlab.beam_search"),
                Forbidden(_generation.beam_search_fn, "gptlab.generation.beam_search_fn"))

_HF_MODULE = "transformers.generation.logits_process"
_HF_PROCESSORS = (
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "RepetitionPenaltyLogitsProcessor",
    "LogitsProcessorList",
)


def _hf_forbidden() -> tuple[Forbidden, ...]:
    """Hugging Face's logits processors, if ``transformers`` has loaded them (importing it here
    would cost seconds; :func:`_call` re-runs a call that imported them itself)."""
    mod = sys.modules.get(_HF_MODULE)
    if mod is None:
        return ()
    out = []
    for name in _HF_PROCESSORS:
        cls = getattr(mod, name, None)
        if cls is not None:
            out += [Forbidden(cls, f"transformers.{name}"), Forbidden(cls.__call__, f"transformers.{name}")]
    return tuple(out)


def _call(fn: Callable, name: str, *args, forbidden: Sequence[Forbidden]):
    """:func:`call` with gptlab's pieces and HF's processors forbidden. A function that imports
    ``transformers`` during the call is called a second time with the processors forbidden too."""
    had_hf = _HF_MODULE in sys.modules
    out = call(fn, name, *args, forbidden=tuple(forbidden) + _hf_forbidden())
    if not had_hf and _HF_MODULE in sys.modules:
        out = call(fn, name, *args, forbidden=tuple(forbidden) + _hf_forbidden())
    return out


def _expect_logits(got, case: Case) -> Tensor:
    """Logits shaped like the input logits (the first argument), not a boolean mask."""
    what, like = case.what, case.args[0]
    if isinstance(got, Tensor) and got.dtype == torch.bool:
        raise ExerciseError(
            f"{what} returned a boolean mask. Return the logits themselves, with the filtered entries set to "
            "float('-inf') (e.g. logits.masked_fill(remove, float('-inf')))."
        )
    return expect_tensor(got, what, shape=like.shape, dtype="float", device=like.device).float()


def _softmax_hint(got: Tensor) -> str | None:
    """Recognise probabilities returned instead of logits."""
    if got.dim() == 2 and bool((got >= 0).all()) and bool(torch.isfinite(got).all()):
        rows = got.double().sum(-1)
        if bool(((rows - 1).abs() < 1e-4).all()):
            return ("you returned probabilities (each row sums to 1). Return logits: the sampler applies the "
                    "softmax later, and a filtered token must be float('-inf'), not 0.")
    return None


def _zero_hint(got: Tensor, want: Tensor) -> str | None:
    """Recognise filtered entries set to 0 (or another finite number) instead of -inf."""
    removed = torch.isinf(want) & (want < 0)
    if bool(removed.any()) and not bool(torch.isinf(got[removed]).all()):
        kept = ~removed
        if _close(got[kept], want[kept]):
            value = got[removed & torch.isfinite(got)][0].item()
            return (f"the right tokens are kept, but the filtered ones hold {value:g} instead of float('-inf'): "
                    "after the softmax they would still be drawn. Set them to float('-inf').")
    return None


def _close(a: Tensor, b: Tensor) -> bool:
    return close(a, b, ATOL, RTOL)


def _cases(seed: int, shapes: Sequence[tuple[int, int]], scale: float = 2.0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) * scale for s in shapes]


# --------------------------------------------------------------------------- temperature


def _temperature_cases(seed: int) -> list[Case]:
    a, b = _cases(seed, [(3, 7), (1, 5)])
    filtered = a.clone()
    filtered[:, ::3] = NINF
    cases = [(a, 0.5), (a, 1.0), (b, 2.0), (filtered, 0.7), (a * 500, 0.5)]
    return [Case((logits, t), f"logits {describe(logits)}, temperature={t}", f"apply_temperature(logits, {t})")
            for logits, t in cases]


def _temperature_mistakes(logits: Tensor, t: float) -> list:
    return [
        ("you multiplied by the temperature; divide by it (logits / temperature): a temperature below 1 "
         "must sharpen the distribution.", lambda: logits * t),
        ("you returned softmax(logits / temperature), probabilities; return the scaled logits.",
         lambda: torch.softmax(logits / t, dim=-1)),
        ("you returned probabilities; return logits / temperature.",
         lambda: torch.softmax(logits, dim=-1) ** (1 / t)),
        ("you subtracted the temperature; divide the logits by it.", lambda: logits - t),
    ]


TEMPERATURE = Task("apply_temperature", _sampling.apply_temperature, _GPTLAB_FILTERS, _temperature_cases,
                   ATOL, RTOL, _temperature_mistakes, _expect_logits, caller=_call)


def check_apply_temperature(fn: Callable[[Tensor, float], Tensor], seed: int = 0) -> None:
    """Check ``apply_temperature(logits, temperature)``: logits (B, V) -> logits / temperature
    (B, V), a new tensor, compared with :func:`gptlab.sampling.apply_temperature` (atol 1e-6,
    rtol 1e-5) for temperatures 0.5, 1, 2 and 0.7, on random logits, logits holding ``-inf`` and
    large logits. ``temperature <= 0`` must raise ``ValueError``.
    """
    TEMPERATURE.check(fn, seed)
    a = _cases(seed, [(3, 7)])[0]
    for t in (0.0, -1.0):
        try:
            with_forbidden = tuple(_GPTLAB_FILTERS) + _hf_forbidden()
            out = call(fn, "apply_temperature", a, t, forbidden=with_forbidden)
        except ExerciseError as e:
            if isinstance(e.__cause__, ValueError):
                continue
            raise
        raise ExerciseError(
            f"apply_temperature(logits, {t}) returned {describe(out)} instead of raising ValueError. A temperature "
            "must be > 0: dividing by 0 gives inf and NaN (temperature 0 means greedy decoding, which is the "
            "arg-max, not a division). Add: if temperature <= 0: raise ValueError(...)."
        )


# --------------------------------------------------------------------------- top-k


def _top_k_mistakes(logits: Tensor, k: int) -> list:
    kk = min(k, logits.shape[-1])

    def scatter_topk():
        vals, idx = torch.topk(logits, kk, dim=-1)
        return torch.full_like(logits, NINF).scatter(-1, idx, vals)

    def smallest():
        kth = torch.topk(logits, kk, dim=-1, largest=False).values[..., -1:]
        return logits.masked_fill(logits > kth, NINF)

    def off_by_one_more():
        kth = torch.sort(logits, dim=-1, descending=True).values[..., min(kk, logits.shape[-1] - 1)][..., None]
        return logits.masked_fill(logits < kth, NINF)

    def off_by_one_less():
        kth = torch.topk(logits, kk, dim=-1).values[..., -1:]
        return logits.masked_fill(logits <= kth, NINF)

    return [
        ("you kept exactly k tokens (torch.topk indices scattered back), so a token tied with the k-th largest "
         "logit is dropped. Keep every logit >= the k-th largest value: logits < kth become -inf.", scatter_topk),
        ("you kept the k SMALLEST logits; keep the k largest (torch.topk returns the largest by default).", smallest),
        ("you kept one token too many: the threshold is the k-th largest value, torch.topk(logits, k).values[..., -1].",
         off_by_one_more),
        ("you removed the k-th token too (logits <= kth): keep it, remove only logits < kth.", off_by_one_less),
    ]


def _top_k_cases(seed: int) -> list[Case]:
    a, b = _cases(seed, [(3, 10), (1, 6)])
    ties = torch.tensor([[2.0, 1.0, 1.0, 0.5, 1.0, -1.0], [0.0, 3.0, 3.0, 3.0, -2.0, 1.0]])
    cases = [(a, 3), (ties, 2), (a, 1), (b, 6), (b, 9), (ties, 4)]
    return [Case((logits, k), f"logits {describe(logits)}, k={k}", f"top_k_filter(logits, k={k})")
            for logits, k in cases]


def _top_k_call(fn: Callable, name: str, logits: Tensor, k: int, forbidden: Sequence[Forbidden]):
    """:func:`_call`, with a hint when a crash comes from k larger than the vocabulary."""
    try:
        return _call(fn, name, logits, k, forbidden=forbidden)
    except ExerciseError as e:
        if k > logits.shape[-1] and not isinstance(e.__cause__, (ExerciseError, type(None))):
            raise ExerciseError(
                f"{e}\n  Hint: k may exceed the vocabulary size V={logits.shape[-1]}; then every token is kept. "
                "Use min(k, logits.shape[-1])."
            ) from None
        raise


def _filter_hints(got: Tensor, want: Tensor, case: Case) -> str | None:
    """Property-based diagnoses shared by the filters: probabilities returned, or 0 instead of -inf."""
    return _softmax_hint(got) or _zero_hint(got, want)


TOP_K = Task("top_k_filter", _sampling.top_k_filter, _GPTLAB_FILTERS, _top_k_cases, ATOL, RTOL, _top_k_mistakes,
             _expect_logits, _filter_hints, caller=_top_k_call)


def check_top_k_filter(fn: Callable[[Tensor, int], Tensor], seed: int = 0) -> None:
    """Check ``top_k_filter(logits, k)``: logits (B, V); the k largest logits of each row and every
    logit tied with the k-th stay, the rest become ``-inf``; ``k >= V`` keeps everything. Compared
    with :func:`gptlab.sampling.top_k_filter` (atol 1e-6, rtol 1e-5) on random logits, ties, k = 1,
    k = V and k > V.
    """
    TOP_K.check(fn, seed)


# --------------------------------------------------------------------------- top-p


def _top_p_mistakes(logits: Tensor, p: float) -> list:
    def desc(strict_crossing: bool, unsort: bool = True, ascending: bool = False):
        s, idx = torch.sort(logits, dim=-1, descending=not ascending)
        cum = torch.softmax(s, dim=-1).cumsum(-1)
        remove = cum > p if strict_crossing else cum >= p
        if unsort:
            remove = torch.zeros_like(remove).scatter(-1, idx, remove)
        return logits.masked_fill(remove, NINF)

    def shifted_no_unsort():
        s, _ = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(s, dim=-1).cumsum(-1)
        remove = cum > p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        return logits.masked_fill(remove, NINF)

    return [
        ("you dropped the token that crosses p: the nucleus is the smallest set whose probability REACHES p, "
         "so the token that takes the cumulative sum past p stays. Remove a token only when the tokens more "
         "likely than it already sum to p (shift the mask right by one).", lambda: desc(True)),
        ("you dropped the token that crosses p (cumulative >= p removes it); keep it: remove a token only when "
         "the tokens before it already reach p.", lambda: desc(False)),
        ("you sorted in ascending order, so the cumulative sum starts from the least likely tokens and you keep "
         "the wrong ones. Sort descending (most likely first), or follow Hugging Face: ascending, remove "
         "cumulative <= 1 - p.", lambda: desc(True, ascending=True)),
        ("you set -inf at positions of the SORTED order: map the mask back to the original token ids "
         "(scatter it with the sort indices) before filtering.", shifted_no_unsort),
        ("you did not map the mask back to the original token order (scatter with the sort indices).",
         lambda: desc(True, unsort=False)),
    ]


def _top_p_cases(seed: int) -> list[Case]:
    a, b = _cases(seed, [(4, 12), (1, 8)])
    hand = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()  # p=0.7: keep 0.5 and 0.3 (0.8 >= 0.7)
    shuffled = hand[:, [2, 0, 3, 1]]
    cases = [(hand, 0.7), (shuffled, 0.7), (a, 0.9), (a, 0.5), (b, 0.05), (a, 1.0), (b, 0.75)]
    return [Case((logits, p), f"logits {describe(logits)} (probabilities "
                 f"{describe(torch.softmax(logits, dim=-1).round(decimals=3))}), p={p}", f"top_p_filter(logits, p={p})")
            for logits, p in cases]


def check_top_p_filter(fn: Callable[[Tensor, float], Tensor], seed: int = 0) -> None:
    """Check ``top_p_filter(logits, p)``: logits (B, V), 0 < p <= 1; keep the smallest set of most
    likely tokens whose probability reaches p (the token that crosses p is kept; the most likely
    token always is); the rest become ``-inf``. Compared with :func:`gptlab.sampling.top_p_filter`
    (Hugging Face's ``TopPLogitsWarper``; atol 1e-6, rtol 1e-5) on random logits, p = 0.9, 0.5,
    0.05, 1.0 and a hand-made row whose crossing token is easy to see.
    """
    TOP_P.check(fn, seed)


def _empty_hint(got: Tensor) -> str | None:
    if bool((torch.isinf(got) & (got < 0)).all(dim=-1).any()):
        return ("a row has every token filtered out: always keep at least the most likely token, even when its "
                "probability alone exceeds p.")
    return None


TOP_P = Task("top_p_filter", _sampling.top_p_filter, _GPTLAB_FILTERS, _top_p_cases, ATOL, RTOL, _top_p_mistakes,
             _expect_logits, lambda got, want, case: _filter_hints(got, want, case) or _empty_hint(got), caller=_call)


# --------------------------------------------------------------------------- repetition penalty


def _penalty_mistakes(logits: Tensor, ids: Tensor, pen: float) -> list:
    V = logits.shape[-1]
    counts = torch.zeros(logits.shape[0], V).scatter_add(1, ids, torch.ones(ids.shape))
    present = counts > 0
    everywhere = torch.ones_like(present)
    anyrow = present.any(dim=0, keepdim=True).expand_as(present)

    def ctrl(mask):
        return torch.where(mask, torch.where(logits < 0, logits * pen, logits / pen), logits)

    return [
        ("you divided every present token's logit by the penalty, negative ones too: dividing a negative logit "
         "by a penalty > 1 brings it closer to 0, which makes the token MORE likely. Multiply negative logits, "
         "divide positive ones.", lambda: torch.where(present, logits / pen, logits)),
        ("you penalised every token of the vocabulary, not only the ones present in input_ids.",
         lambda: ctrl(everywhere)),
        ("you penalised a token once per occurrence; the repetition penalty applies once to each token present, "
         "however often it occurs (that is the frequency penalty's job).",
         lambda: torch.where(logits < 0, logits * pen**counts, logits / pen**counts)),
        ("you swapped the cases: positive logits must be divided by the penalty and negative ones multiplied.",
         lambda: torch.where(present, torch.where(logits < 0, logits / pen, logits * pen), logits)),
        ("you subtracted the penalty; CTRL's penalty divides positive logits by it and multiplies negative ones.",
         lambda: logits - pen * present),
        ("you penalised tokens that appear in OTHER rows of the batch: each row has its own history "
         "input_ids[b].", lambda: ctrl(anyrow)),
    ]


def _penalty_cases(seed: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 10, generator=g) * 2
    ids = torch.tensor([[1, 4, 4, 7, 1, 4], [0, 2, 2, 2, 9, 5], [3, 3, 3, 3, 3, 3]])
    one = (torch.randn(1, 6, generator=g) * 3, torch.tensor([[5, 0, 5]]))
    cases = [(logits, ids, 1.3), (logits, ids, 0.8), (*one, 2.0), (logits, ids, 1.0)]
    return [Case((lg, x, pen), f"logits {describe(lg)}, input_ids {describe(x)}, penalty={pen}",
                 f"apply_repetition_penalty(logits, input_ids, penalty={pen})") for lg, x, pen in cases]


REPETITION_PENALTY = Task("apply_repetition_penalty", _sampling.apply_repetition_penalty, _GPTLAB_FILTERS,
                          _penalty_cases, ATOL, RTOL, _penalty_mistakes, _expect_logits, caller=_call)


def check_apply_repetition_penalty(fn: Callable[[Tensor, Tensor, float], Tensor], seed: int = 0) -> None:
    """Check ``apply_repetition_penalty(logits, input_ids, penalty)``: logits (B, V), input_ids (B, T)
    int64; for each token present in row b's ids, a positive logit is divided by ``penalty`` and a
    negative one multiplied by it (once, however often it occurs); other tokens are unchanged.
    Compared with :func:`gptlab.sampling.apply_repetition_penalty` (Hugging Face's
    ``RepetitionPenaltyLogitsProcessor``; atol 1e-6, rtol 1e-5) for penalties 1.3, 0.8 and 1, with
    repeated ids and rows of different histories.
    """
    REPETITION_PENALTY.check(fn, seed)


# --------------------------------------------------------------------------- sample_next

_DRAWS = 4000  # draws per distribution


def _row_counts(tokens: Tensor, rows: int, V: int) -> list[Tensor]:
    t = tokens.view(-1, rows)
    return [torch.bincount(t[:, r], minlength=V)[:V] for r in range(rows)]


def _normalise(p: Tensor) -> Tensor:
    return p / p.sum(-1, keepdim=True)


def _draw(fn, logits: Tensor, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    got = call(fn, "sample_next", logits, g, forbidden=_GPTLAB_SAMPLERS)
    B = logits.shape[0]
    if isinstance(got, Tensor) and tuple(got.shape) == (B, 1):
        raise ExerciseError(
            f"sample_next should return one id per row, shape (B,) = ({B},), got (B, 1) = {tuple(got.shape)}: "
            "torch.multinomial(probs, 1) returns (B, 1); squeeze the last axis (.squeeze(-1))."
        )
    got = expect_tensor(got, "sample_next(logits, generator)", shape=(B,), device=logits.device)
    if got.is_floating_point() or got.dtype == torch.bool:
        raise ExerciseError(f"sample_next should return token ids (an integer tensor, torch.long), got dtype {got.dtype}.")
    if got.dtype != torch.long:
        raise ExerciseError(f"sample_next should return torch.long (int64) ids, got {got.dtype}: add .long().")
    V = logits.shape[-1]
    if bool(((got < 0) | (got >= V)).any()):
        bad = int(got[(got < 0) | (got >= V)][0])
        raise ExerciseError(f"sample_next returned the id {bad}, outside the vocabulary [0, {V}).")
    return got


def check_sample_next(fn: Callable[[Tensor, torch.Generator], Tensor], seed: int = 0) -> None:
    """Check ``sample_next(logits, generator) -> ids (B,)`` int64, one draw per row from
    softmax(logits of that row), using ``generator`` for every random number.

    Three distributions (positive logits, so that sampling from the logits themselves is a
    distribution too, and recognisable) are repeated 4000 times in one batch (B = 12000); the
    draws of each are compared with softmax by a chi-square test, and so are 4000 draws from a row
    holding ``-inf`` (those tokens must never come). Four tests at a false-failure rate below 1e-7
    each: a correct sampler fails this check with probability below 1e-6. Two calls with
    generators seeded alike must return the same ids.
    """
    require_function(fn, "sample_next")
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(3, 6, generator=g) * 3 + 0.25  # positive logits, three distributions
    base[1] = base[1] * 1.5
    batch = base.repeat(_DRAWS, 1)  # (3 * _DRAWS, 6)
    got = _draw(fn, batch, seed + 1)
    again = _draw(fn, batch, seed + 1)
    if not same(got, again):
        raise ExerciseError(
            "sample_next returned different ids for two calls with generators seeded alike: pass the generator "
            "to the random function (torch.multinomial(probs, 1, generator=generator)), so that a seed "
            "reproduces the draws."
        )
    probs = torch.softmax(base, dim=-1)
    alternatives = {
        "you took the arg-max (greedy decoding): sample_next must DRAW a token at random with probability "
        "softmax(logits), e.g. torch.multinomial(probs, 1, generator=generator).":
            F.one_hot(base.argmax(-1), base.shape[-1]).double(),
        "you took the softmax over the batch (dim=0): each row is one distribution, use dim=-1.":
            _normalise(torch.softmax(base, dim=0)),
        "you sampled from the logits themselves (torch.multinomial treats its input as unnormalised "
        "probabilities): apply the softmax first.": _normalise(base),
        "you applied the softmax twice (once to the logits, once to the probabilities).":
            torch.softmax(probs, dim=-1),
        "you drew every token with the same probability: weight the draw by softmax(logits).":
            torch.full_like(base, 1 / base.shape[-1]),
    }
    for r, counts in enumerate(_row_counts(got, 3, base.shape[-1])):
        expect_distribution(counts, probs[r], f"sample_next (distribution {r + 1} of 3, {describe(base[r].round(decimals=3))})",
                            mistakes=[(text, alt[r]) for text, alt in alternatives.items()])
    # a filtered row: -inf tokens must never be drawn
    filtered = torch.tensor([[1.0, NINF, 0.5, NINF, 2.0, -0.5, NINF]])
    got = _draw(fn, filtered.repeat(_DRAWS, 1), seed + 2)
    expect_distribution(torch.bincount(got, minlength=7)[:7], torch.softmax(filtered[0], -1),
                        f"sample_next on filtered logits {describe(filtered)}",
                        mistakes=[("you took the arg-max: draw at random instead.",
                                   F.one_hot(filtered.argmax(-1), 7)[0].double())])


# --------------------------------------------------------------------------- beam search


def reference_beam_search(step_fn, prompt: Sequence[int], num_beams: int, max_new_tokens: int,
                          eos_token_id: int | None, length_penalty: float, **decisions) -> list[int]:
    """The expected answer: :func:`gptlab.generation.beam_search_fn` on ``step_fn`` with every step
    searched (``early_stopping=None``, the learner's loop), as a list of ids (prompt included).
    ``decisions``: its keyword arguments that replace a decision (a known mistake, :data:`_BEAM_MISTAKES`)."""
    out = _generation.beam_search_fn(step_fn, torch.tensor([list(prompt)]), num_beams, max_new_tokens, eos_token_id,
                                     length_penalty, early_stopping=None, **decisions)
    return out[0].tolist()


_BEAM_CASES = [  # (toy seed, prompt, num_beams, max_new_tokens, length_penalty)
    (0, [7, 1], 3, 8, 1.5),
    (15, [3, 3, 1], 2, 8, -1.0),
    (55, [3], 3, 6, 1.0),
    (2, [4, 5, 6], 4, 7, 0.5),
    (4, [2, 9], 1, 4, 1.0),
    (5, [8], 3, 1, 1.0),
]
"""Chosen (by trying the known mistakes of :data:`_BEAM_MISTAKES` on many toy seeds) so that every
known mistake changes at least one answer and no two mistakes give the same answers on all of them."""


def _as_ids(got, what: str) -> list[int]:
    if isinstance(got, Tensor):
        if got.dim() == 2 and got.shape[0] == 1:
            got = got[0]
        if got.dim() != 1 or got.is_floating_point():
            raise ExerciseError(f"{what} should return a list of token ids, got a tensor of shape {tuple(got.shape)} "
                                f"and dtype {got.dtype}.")
        return [int(v) for v in got.tolist()]
    if isinstance(got, tuple) and len(got) == 2 and not all(isinstance(v, int) for v in got):
        raise ExerciseError(f"{what} should return only the best sequence (a list of ids), not a pair such as "
                            "(sequence, score).")
    if not isinstance(got, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in got):
        extra = " (did you forget a return statement?)" if got is None else ""
        raise ExerciseError(f"{what} should return a list of ints (the prompt followed by the generated ids), "
                            f"got {describe(got)}{extra}.")
    return list(got)


def check_beam_search(fn: Callable, seed: int = 0) -> None:
    """Check ``beam_search(step_fn, prompt, num_beams, max_new_tokens, eos_token_id, length_penalty)``
    -> the best finished hypothesis as a list of ids (the prompt, then the generated ids, eos
    included when it ended with eos), on a fixed toy model (:class:`ToyLM`, vocabulary of 10, eos 0)
    for 7 settings (1 to 4 beams, 1 to 8 new tokens, length penalties 0 to 2). The expected answer
    is :func:`gptlab.generation.beam_search_fn` with every step searched; ids are compared
    exactly.
    """
    require_function(fn, "beam_search")
    runs = []  # (what, toy, prompt, num_beams, max_new_tokens, length_penalty, got, want)
    for toy_seed, prompt, nb, n, lp in _BEAM_CASES:
        toy = ToyLM(toy_seed + seed)
        what = (f"beam_search(step_fn, prompt={prompt}, num_beams={nb}, max_new_tokens={n}, eos_token_id=0, "
                f"length_penalty={lp})")
        got = _as_ids(call(fn, "beam_search", toy, list(prompt), nb, n, toy.eos, lp, forbidden=_GPTLAB_BEAM), what)
        runs.append((what, toy, prompt, nb, n, lp, got, reference_beam_search(toy, prompt, nb, n, toy.eos, lp)))
    wrong = [r for r in runs if r[6] != r[7]]
    if not wrong:
        return
    what, toy, prompt, nb, n, lp, got, want = wrong[0]
    reason = _beam_diagnosis(runs, wrong[0])
    raise ExerciseError(
        f"{what} is wrong (on the toy model of the check, vocabulary 0..9, eos 0).\n  Most likely mistake: {reason}\n"
        f"  expected: {want}\n  got:      {got}"
    )


# the known mistakes, each a replacement for one decision of gptlab.generation.beam_search_fn


def _added_probabilities(beam_scores: Tensor, logprobs: Tensor) -> Tensor:
    """Probabilities added instead of log-probabilities."""
    return beam_scores[:, :, None] + logprobs.exp()


def _last_token_only(beam_scores: Tensor, logprobs: Tensor) -> Tensor:
    """The new token's log-probability alone, the beam's score forgotten."""
    return logprobs


def _no_length_penalty(sum_logprobs: Tensor, generated_len: int, length_penalty: float, prompt_len: int) -> Tensor:
    """The summed log-probability, not divided by the length."""
    return sum_logprobs


def _prompt_counted(sum_logprobs: Tensor, generated_len: int, length_penalty: float, prompt_len: int) -> Tensor:
    """Divided by the whole sequence's length, the prompt's included."""
    return hypothesis_score(sum_logprobs, prompt_len + generated_len, length_penalty, prompt_len)


def _every_eos(candidates: Candidates, num_beams: int) -> Tensor:
    """Every candidate ending in eos finishes, however low its rank."""
    return finish_in_top_beams(candidates, num_beams) | candidates.eos


_BEAM_MISTAKES = [  # (keyword arguments of reference_beam_search that make the mistake, diagnosis)
    (dict(score=_added_probabilities), "you added probabilities; a sequence's score is the SUM OF LOG-probabilities "
     "of its tokens (the log of their product): add log_softmax values."),
    (dict(score=_last_token_only), "you did not accumulate the scores: a candidate's score is its beam's score plus "
     "the new token's log-probability, not the new token's log-probability alone."),
    (dict(final_score=_no_length_penalty), "you ignored the length penalty: a finished hypothesis scores "
     "sum_logprobs / generated_len ** length_penalty."),
    (dict(final_score=_prompt_counted), "your length counts the prompt: the length penalty divides by the number of "
     "GENERATED tokens (eos included), len(seq) - len(prompt)."),
    (dict(finish=_every_eos, num_candidates=sys.maxsize), "every candidate ending in eos became a finished "
     "hypothesis; only those ranked among the best num_beams candidates of the step do (the others are dropped)."),
    (dict(num_beams=1), "your search is greedy decoding: all beams hold the same sequence. Either you started "
     "with num_beams copies of the prompt (every candidate then appears num_beams times and the copies fill "
     "every beam: start with ONE beam, the prompt), or you kept a single beam (keep the num_beams best "
     "candidates each step)."),
]
"""Each known mistake is the package's one beam search with one of its decisions replaced
(:func:`gptlab.generation.beam_search_fn`'s ``score``, ``final_score`` or ``finish``, with every
candidate seen so that a low-ranked eos can finish), or run with one beam: greedy decoding."""


def _beam_diagnosis(runs: list, first: tuple) -> str:
    """Name the mistake: the known one that gives the learner's answers on every case (else on
    the first wrong one)."""
    what, toy, prompt, nb, n, lp, got, want = first
    if got[: len(prompt)] != list(prompt):
        return "the result must start with the prompt: return prompt + generated ids."
    new = got[len(prompt):]
    if len(new) > n:
        return f"you generated {len(new)} tokens, more than max_new_tokens={n}."
    if toy.eos in new[:-1]:
        return "a hypothesis went on after eos: a beam that emits eos_token_id is finished."

    def agreements(mistake: dict) -> int:
        """On how many cases the mistake gives the learner's answer (0 unless the first wrong one)."""
        try:
            if first[6] != _mistaken(first, mistake):
                return 0
            return sum(r[6] == _mistaken(r, mistake) for r in runs)
        except Exception:
            return 0

    # the mistake that agrees on most cases (exact ties between candidates may be broken differently)
    counts = [agreements(kw) for kw, _ in _BEAM_MISTAKES]
    if max(counts) > 0:
        return _BEAM_MISTAKES[counts.index(max(counts))][1]
    return ("none of the usual ones; compare each step with the recipe: score candidates by summed "
            "log-probabilities, finish eos candidates ranked in the top num_beams, keep the num_beams best others.")


def _mistaken(run: tuple, mistake: dict) -> list[int]:
    """The answer to the case of ``run`` with the known ``mistake`` (an entry of :data:`_BEAM_MISTAKES`) made."""
    what, toy, prompt, nb, n, lp, got, want = run
    return reference_beam_search(toy, prompt, **(dict(num_beams=nb, max_new_tokens=n, eos_token_id=toy.eos,
                                                      length_penalty=lp) | mistake))
