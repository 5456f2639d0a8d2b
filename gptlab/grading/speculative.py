"""Checks of the ``speculative`` assignment (chapter 8, speculative decoding).

Tasks:

* ``accept_prob(p, q, token)``: ``min(1, p[token] / q[token])``, compared with
  :func:`gptlab.generation.speculative.accept_prob` (atol 1e-6, rtol 1e-5: one division);
* ``residual_distribution(p, q)``: ``max(0, p - q)`` normalised, compared with
  :func:`gptlab.generation.speculative.residual_distribution` (atol 1e-6, rtol 1e-5);
* ``expected_tokens_per_pass(alpha, g)``: ``(1 - alpha^(g+1)) / (1 - alpha)``, ``g + 1`` at
  ``alpha = 1``, compared with :func:`gptlab.generation.speculative.expected_tokens_per_pass` (atol 1e-9, rtol 1e-9);
* ``speculative_step(target_probs, draft_probs, draft_tokens, generator)``: one round. Its
  structure is checked exactly (the accepted guesses are a prefix of the draft, then exactly one
  token of the target's; ``n_accepted = g`` whenever the draft equals the target), and its
  randomness by distribution over seeded rounds: the first token it emits must follow the target's
  first distribution, the bonus token the target's last, whatever the draft (chi-square tests, a
  correct step fails with probability below 1e-7 each).
"""

from __future__ import annotations

import random

from collections.abc import Callable

import torch
from torch import Tensor

from ..generation import speculative as _spec
from .core import (
    Candidate,
    ExerciseError,
    Forbidden,
    call,
    entries_of,
    expect_distribution,
    expect_number,
    expect_tensor,
    require_function,
    show_number,
)
from .task import Case, Task

__all__ = [
    "check_accept_prob",
    "check_residual_distribution",
    "check_expected_tokens_per_pass",
    "check_speculative_step",
    "first_token_distribution",
]

_GPTLAB = entries_of(_spec, "accept_prob", "residual_distribution", "expected_tokens_per_pass",
                          "speculative_step") + (Forbidden(_spec.speculative_generate, "gptlab.speculative_generate"),)

# A target and a draft that disagree a lot, so that every mistake moves the distributions far.
P = torch.tensor([
    [0.40, 0.30, 0.15, 0.10, 0.05, 0.00],
    [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
    [0.25, 0.25, 0.00, 0.25, 0.25, 0.00],
    [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],
])
Q = torch.tensor([
    [0.10, 0.20, 0.30, 0.30, 0.05, 0.05],
    [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    [0.10, 0.10, 0.40, 0.20, 0.10, 0.10],
])


def _probs(g: torch.Generator, n: int, V: int, zeros: bool = True) -> Tensor:
    x = torch.rand(n, V, generator=g) ** 2
    if zeros:
        x[:, 0] = 0.0
    return x / x.sum(-1, keepdim=True)


# --------------------------------------------------------------------------- accept_prob


def _accept_cases(seed: int = 0) -> list[Case]:
    """Every token the draft can propose (q[token] > 0) of the fixed rows P, Q (the seed is unused)."""
    return [Case((P[r], Q[r], token), f"p = {P[r].tolist()}, q = {Q[r].tolist()}", f"accept_prob(p, q, token={token})")
            for r in range(Q.shape[0]) for token in range(Q.shape[1]) if Q[r, token] > 0]


def _expect_number(got, case: Case) -> Tensor:
    """One number, as a float or a 1-element tensor, returned as a 0-d float tensor."""
    what = f"accept_prob(p, q, {case.args[2]})"
    if isinstance(got, Tensor):
        got = expect_tensor(got, what, dtype="float")
        if got.numel() != 1:
            raise ExerciseError(f"{what} should be one number, got a tensor of shape "
                                f"{tuple(got.shape)}: pick the draft token's entries p[token] and q[token].")
        return got.reshape(()).float()
    if isinstance(got, float | int) and not isinstance(got, bool):
        return torch.tensor(float(got))
    raise ExerciseError(f"accept_prob should return a number, got {type(got).__name__}.")


def _accept_mistakes(p: Tensor, q: Tensor, token: int) -> list:
    pt, qt = p[token], q[token]
    return [
        ("the ratio is upside down: accept with probability min(1, p/q), the TARGET's probability over the "
         "draft's, so guesses the target likes more than the draft are always kept.",
         lambda: torch.clamp(qt / pt, max=1.0) if pt > 0 else torch.tensor(float("inf"))),
        ("you forgot the min(1, ...): a probability cannot exceed 1.", lambda: pt / qt),
        ("you used a difference instead of the ratio p/q.", lambda: torch.clamp(pt - qt, min=0.0)),
        ("you returned the target's probability p[token]; the rule is min(1, p[token] / q[token]).", lambda: pt),
    ]


ACCEPT_PROB = Task("accept_prob", lambda p, q, token: _spec.accept_prob(p, q, torch.tensor(token)).float(), _GPTLAB,
                   _accept_cases, 1e-6, 1e-5, _accept_mistakes, _expect_number)


def check_accept_prob(fn: Callable) -> None:
    """Check ``accept_prob(p, q, token)``: p, q (V,) distributions, token an int (drawn from q,
    so ``q[token] > 0``); returns ``min(1, p[token] / q[token])`` as a float or 0-d tensor."""
    ACCEPT_PROB.check(fn)


# --------------------------------------------------------------------------- residual_distribution


def _residual_cases(seed: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    cases = [(P[r], Q[r]) for r in range(Q.shape[0])] + [(a, b) for a, b in zip(_probs(g, 3, 7), _probs(g, 3, 7, zeros=False))]
    return [Case((p, q), f"p = {p.tolist()}, q = {q.tolist()}", "residual_distribution(p, q)") for p, q in cases]


def _residual_mistakes(p: Tensor, q: Tensor) -> list:
    raw = (p - q).clamp_min(0)
    back = (q - p).clamp_min(0)
    return [
        ("you did not renormalise: divide max(0, p - q) by its sum so the probabilities add up to 1.", lambda: raw),
        ("you subtracted the wrong way round: the residual is max(0, p - q), the probability the TARGET has and "
         "the draft lacks.", lambda: back / back.sum()),
        ("you used |p - q|; negative differences must be cut to 0 with max(0, p - q).",
         lambda: (p - q).abs() / (p - q).abs().sum()),
        ("you returned p itself; after a rejection the correction is drawn from max(0, p - q), normalised.", lambda: p),
    ]


RESIDUAL = Task("residual_distribution", _spec.residual_distribution, _GPTLAB, _residual_cases, 1e-6, 1e-5,
                _residual_mistakes)


def check_residual_distribution(fn: Callable, seed: int = 0) -> None:
    """Check ``residual_distribution(p, q) -> (V,)``: ``max(0, p - q)`` normalised to sum to 1.
    p, q (V,) are distributions that differ (so the residual is not all zero)."""
    RESIDUAL.check(fn, seed)


# --------------------------------------------------------------------------- expected tokens per pass


def _tokens_cases(seed: int | None) -> list[Case]:
    """Fixed (alpha, g), alpha = 0 and 1 and g = 0 among them, and with ``seed`` three drawn from it
    (the autograder's hidden cases)."""
    cases = [(0.8, 4), (0.5, 1), (0.0, 3), (0.9, 8), (1.0, 5), (0.3, 0)]
    if seed is not None:
        r = random.Random(seed)
        cases += [(round(r.uniform(0.05, 0.97), 4), r.randint(1, 12)) for _ in range(3)]
    return [Case((a, g), f"alpha={a}, g={g}", f"expected_tokens_per_pass({a}, {g})") for a, g in cases]


def _tokens_mistakes(a: float, g: int) -> list[Candidate]:
    return [
        ("you counted the accepted guesses only: a pass also yields one token of the target's (the correction or "
         "the bonus), so the expectation is (1 - a^(g+1)) / (1 - a), one more.",
         lambda: (a - a ** (g + 1)) / (1 - a) if a < 1 else g),
        ("the exponent is off by one: with g guesses there are g + 1 possible outcomes, so it is a^(g+1).",
         lambda: (1 - a**g) / (1 - a) if a < 1 else g),
        ("you used the infinite sum 1 / (1 - a): there are only g guesses.",
         lambda: 1 / (1 - a) if a < 1 else float("inf")),
    ]


EXPECTED_TOKENS = Task(
    "expected_tokens_per_pass", _spec.expected_tokens_per_pass, _GPTLAB, _tokens_cases,
    1e-9, 1e-9, _tokens_mistakes, lambda got, case: expect_number(got, case.what),
    lambda got, want, case: "none of the usual ones: the geometric sum 1 + a + ... + a^g.", show=show_number)


def check_expected_tokens_per_pass(fn: Callable, seed: int | None = None) -> None:
    """Check ``expected_tokens_per_pass(alpha, g) -> float``: the expected number of tokens one
    target pass produces with ``g`` guesses each accepted with probability ``alpha``, the bonus or
    correction token included: ``(1 - alpha^(g+1)) / (1 - alpha)``; ``g + 1`` when ``alpha == 1``."""
    EXPECTED_TOKENS.check(fn, seed)


# --------------------------------------------------------------------------- speculative_step


def first_token_distribution(p: Tensor, q: Tensor, accept: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """The distribution of the first token a round emits when the guess is drawn from ``q`` (V,),
    kept with probability ``accept`` (V,) (default min(1, p/q)), and replaced after a rejection by a
    draw from ``residual`` (V,) (default max(0, p - q) normalised). For the correct rule it is p."""
    if accept is None:
        accept = torch.where(q > 0, (p / q.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(q))
    if residual is None:
        residual = _spec.residual_distribution(p, q)
    kept = q * accept
    return kept + (1 - kept.sum()) * residual


def _step_mistakes(p: Tensor, q: Tensor) -> list[tuple[str, Tensor]]:
    inv = torch.where(p > 0, (q / p.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(p))
    back = (q - p).clamp_min(0)
    return [
        ("the accept ratio is upside down: keep a guess with probability min(1, p/q), not min(1, q/p).",
         first_token_distribution(p, q, accept=inv)),
        ("after a rejection you drew from max(0, q - p): the correction comes from max(0, p - q), normalised.",
         first_token_distribution(p, q, residual=back / back.sum())),
        ("after a rejection you drew from the target's p itself instead of the residual max(0, p - q): the output "
         "is then biased towards the draft's choices.", first_token_distribution(p, q, residual=p)),
        ("after a rejection you drew from the draft's q: the correction must come from max(0, p - q), normalised.",
         first_token_distribution(p, q, residual=q)),
        ("you reject the guesses too often (is the comparison r < min(1, p/q) the wrong way round?).",
         first_token_distribution(p, q, accept=torch.zeros_like(q))),
    ]


def _one_round(fn, p: Tensor, q: Tensor, draft: Tensor, seed: int, forbidden) -> tuple[Tensor, int]:
    gen = torch.Generator().manual_seed(seed)
    out = call(fn, "speculative_step", p, q, draft, gen, forbidden=forbidden, check_inputs_unchanged=False)
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise ExerciseError("speculative_step should return a pair (accepted_tokens, n_accepted), got "
                            f"{type(out).__name__}.")
    tokens, n = out
    if isinstance(n, Tensor) and n.numel() == 1:
        n = int(n.item())
    if isinstance(n, bool) or not isinstance(n, int):
        raise ExerciseError(f"n_accepted should be an int, got {type(n).__name__}.")
    tokens = expect_tensor(tokens, "accepted_tokens", device="cpu")
    if tokens.dim() != 1 or tokens.is_floating_point():
        raise ExerciseError(f"accepted_tokens should be a 1-D tensor of token ids, got shape {tuple(tokens.shape)}, "
                            f"dtype {tokens.dtype}.")
    g = draft.shape[0]
    if not 0 <= n <= g:
        raise ExerciseError(f"n_accepted = {n}, but there are only g = {g} guesses.")
    if tokens.shape[0] == n and n == g:
        raise ExerciseError(
            f"all {g} guesses were accepted but accepted_tokens has only those {g}: when every guess passes, the "
            "target's pass has already computed the distribution after the last guess, so add one bonus token drawn "
            "from target_probs[g]. A round always yields n_accepted + 1 tokens."
        )
    if tokens.shape[0] != n + 1:
        more = " Did you keep testing guesses after a rejection? The round stops at the first rejected guess." \
            if tokens.shape[0] > n + 1 else ""
        raise ExerciseError(f"accepted_tokens has {tokens.shape[0]} tokens for n_accepted = {n}: a round yields the "
                            f"n_accepted kept guesses plus exactly one token of the target's.{more}")
    if not torch.equal(tokens[:n].long(), draft[:n].long()):
        raise ExerciseError(
            f"the first n_accepted = {n} tokens should be the first {n} guesses {draft[:n].tolist()}, got "
            f"{tokens[:n].tolist()}. Did you keep testing guesses after a rejection, or skip one?"
        )
    return tokens.long(), n


def check_speculative_step(fn: Callable, rounds: int = 1200, seed: int = 0) -> None:
    """Check ``speculative_step(target_probs, draft_probs, draft_tokens, generator)``.

    target_probs (g + 1, V), draft_probs (g, V), draft_tokens (g,) long drawn from the draft;
    returns ``(accepted_tokens, n_accepted)``: the first ``n_accepted`` guesses (each kept with
    probability min(1, p/q), stopping at the first rejection) followed by one token of the
    target's: from max(0, p - q) normalised after a rejection, or the bonus from
    ``target_probs[g]`` when all are kept. Structure is checked on every round; over ``rounds``
    seeded rounds with g = 3, V = 6, the first emitted token must follow ``target_probs[0]`` and,
    with a draft equal to the target, every guess must be kept and the bonus follow
    ``target_probs[3]``.
    """
    require_function(fn, "speculative_step")
    forbidden = _GPTLAB
    g = Q.shape[0]
    V = P.shape[1]
    draws = torch.Generator().manual_seed(seed)
    first = torch.zeros(V)
    kept = torch.zeros(g + 1)
    kept_impossible = None  # a kept guess the target gives probability 0
    sure = [0, 0]  # guesses with p >= q (always to be kept): seen, kept
    for i in range(rounds):
        draft = torch.stack([torch.multinomial(Q[j], 1, generator=draws)[0] for j in range(g)])
        tokens, n = _one_round(fn, P, Q, draft, seed + 1 + i, forbidden)
        for j in range(min(n + 1, g)):  # the guesses that were tested: the kept ones and the first rejected
            p_x, q_x = P[j, draft[j]], Q[j, draft[j]]
            if j < n and p_x == 0 and kept_impossible is None:
                kept_impossible = (j, int(draft[j]))
            if p_x >= q_x:
                sure[0] += 1
                sure[1] += int(j < n)
        first[tokens[0]] += 1
        kept[n] += 1
    if kept[g] == rounds:
        raise ExerciseError(
            f"you keep every guess: in {rounds} rounds with a draft that differs from the target, all {g} guesses were "
            "always accepted. A guess must pass the test r < min(1, p/q), with r uniform in [0, 1)."
        )
    if kept[0] == rounds:
        raise ExerciseError(
            f"you never keep a guess: in {rounds} rounds not one of the first guesses was accepted, although the target "
            "and the draft often agree. Keep guess i when r < min(1, p_i/q_i) (check the direction of the comparison)."
        )
    if sure[1] < sure[0]:
        why = ("the comparison is the wrong way round (reject when r >= min(1, p/q), keep when r < min(1, p/q))"
               if sure[1] == 0 else "the ratio is upside down: it is min(1, p/q), the target's probability over the draft's")
        raise ExerciseError(
            f"a guess that the target likes at least as much as the draft (p >= q) must always be kept, since "
            f"min(1, p/q) = 1; you kept {sure[1]} of {sure[0]} such guesses.\n  Most likely mistake: {why}."
        )
    if kept_impossible is not None:
        j, x = kept_impossible
        raise ExerciseError(
            f"you kept guess {j + 1} (token {x}), which the target gives probability 0: it must be rejected, since "
            "min(1, p/q) = 0. Keep a guess only when r < min(1, p/q)."
        )
    expect_distribution(first, P[0], "speculative_step's first token (draft q != target p)",
                        mistakes=_step_mistakes(P[0], Q[0]))
    bonus = torch.zeros(V)
    same_q = P[:g].clone()
    for i in range(rounds // 3):
        draft = torch.stack([torch.multinomial(same_q[j], 1, generator=draws)[0] for j in range(g)])
        tokens, n = _one_round(fn, P, same_q, draft, 10**6 + i, forbidden)
        if n != g:
            raise ExerciseError(
                f"with a draft identical to the target (q = p) every guess must be kept (min(1, p/q) = 1), but only "
                f"{n} of {g} were accepted. Accept when r < min(1, p/q), with r uniform in [0, 1)."
            )
        bonus[tokens[-1]] += 1
    expect_distribution(bonus, P[g], "speculative_step's bonus token (all guesses kept)",
                        mistakes=[("the bonus token must come from target_probs[g], the row after the last guess.", P[g - 1]),
                                  ("the bonus token must come from the target's distribution, not the draft's.", same_q[g - 1])])
