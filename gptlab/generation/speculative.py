"""Speculative decoding: a small draft model proposes, the large target model verifies.

Where this sits: model -> logits -> *samples* -> text, beside :mod:`gptlab.generation.loop`. Plain
decoding runs the (slow) target once per new token. Speculative decoding (Leviathan et al., 2023;
Chen et al., 2023) lets a cheap *draft* model guess ``g`` tokens one by one, then runs the target
*once* over all ``g`` guesses (``g + 1`` positions, in parallel, like a short prefill) and keeps the
longest prefix of guesses that the target agrees with, plus one token of the target's own. Each
target forward pass therefore yields between 1 and ``g + 1`` tokens.

The acceptance rule makes the output distribution *exactly* the target's:

* draft token ``x ~ q`` is accepted with probability ``min(1, p(x) / q(x))``;
* on rejection, a token is drawn from the residual ``normalize(max(0, p - q))`` and the round ends;
* when all ``g`` guesses are accepted, a bonus token is drawn from the target's next distribution.

*Block verification* (Sun et al., ICLR 2025; ``verification="block"``) judges the guesses as one
block instead of one by one, and keeps the output exactly the target's too. It carries the ratio
``w_i = min(1, w_(i-1) p(x_i) / q(x_i))`` along the block (``w_0 = 1``), so a guess the target finds
less likely than the draft can be made up for by later ones it finds more likely; it keeps the
*last* ``i`` whose test passes (:func:`block_accept_probs`), and draws the correction from
``max(0, w_i p - q)`` normalised. It never keeps fewer tokens on average, and keeps more the longer
the block and the better the draft.

``p`` and ``q`` are the *processed* distributions: the same temperature, top-k and top-p (through
:func:`gptlab.sampling.process_logits`) are applied to both models' logits, so the output follows
the distribution the target alone would sample from with those settings. ``temperature=0`` is
greedy decoding: a guess is kept while it equals the target's argmax, and the output is token for
token the target's own greedy output.

Both models keep a :class:`gptlab.kvcache.StaticKVCache`. Rolling back rejected guesses is
``cache.crop(n)``: only the length pointer moves; the stale slots are overwritten next round.

How many tokens a round yields. If every guess were accepted independently with the same
probability ``alpha`` (for a context-free pair of models ``alpha = sum_x min(p(x), q(x))``), the
number of accepted guesses is a geometric variable truncated at ``g`` and the expected number of
tokens per target forward pass is ``(1 - alpha^(g+1)) / (1 - alpha)``
(:func:`expected_tokens_per_pass`). :class:`SpeculativeStats` measures both sides of that formula.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..fast.compiled import decode_step
from ..fast.cpu import pack_for_decoding
from ..fast.native import chunk_keeps_plain, native_decode, step_keeps_plain
from ..kvcache import StaticKVCache
from ..model import GPT, check_token_ids
from ..sampling import sample_from_probs
from .config import VERIFICATIONS, GenerationConfig

__all__ = [
    "speculative_generate",
    "SpeculativeStats",
    "accept_prob",
    "block_accept_probs",
    "residual_distribution",
    "speculative_step",
    "expected_tokens_per_pass",
    "expected_tokens_per_round",
    "verify_draft",
    "VERIFICATIONS",
]


def expected_tokens_per_pass(alpha: float, g: int) -> float:
    """Expected tokens per target forward pass, ``(1 - alpha^(g+1)) / (1 - alpha)``.

    Assumes each of the ``g`` guesses is accepted independently with probability ``alpha``
    (stopping at the first rejection); the round always adds one target token (correction or
    bonus). ``alpha = 1`` gives ``g + 1``, ``alpha = 0`` gives 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a probability in [0, 1], got {alpha}")
    if not isinstance(g, int) or g < 0:
        raise ValueError(f"g must be an int >= 0, got {g!r}")
    if alpha == 1.0:
        return float(g + 1)
    return (1.0 - alpha ** (g + 1)) / (1.0 - alpha)


expected_tokens_per_round = expected_tokens_per_pass  # the name the tests and the benchmark first used


@dataclass
class SpeculativeStats:
    """What a speculative run did, round by round (a round = one target verification pass).

    Attributes:
        num_draft_tokens: ``g``, the draft length asked for.
        drafted: guesses proposed in each round (``g``, or fewer near ``max_new_tokens``).
        accepted: guesses the target accepted in each round (``0 <= accepted <= drafted``).
        target_forwards: target forward passes, the prompt prefill included.
        draft_forwards: draft forward passes, the prompt prefill included.
        new_tokens: tokens generated (each round yields ``accepted + 1``).
    """

    num_draft_tokens: int
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    target_forwards: int = 0
    draft_forwards: int = 0
    new_tokens: int = 0

    @property
    def rounds(self) -> int:
        """Target verification passes (the prompt prefill is not a round)."""
        return len(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens the target accepted: ``sum(accepted) / sum(drafted)``."""
        total = sum(self.drafted)
        return sum(self.accepted) / total if total else float("nan")

    @property
    def alpha(self) -> float:
        """Per-guess acceptance probability, estimated from the accept/reject decisions actually
        made: ``accepted / (accepted + rejections)``. A round stops at its first rejection, so the
        guesses after it are never judged; this is the maximum-likelihood estimate of ``alpha``
        in the i.i.d. model of :func:`expected_tokens_per_pass` (it differs from
        :attr:`acceptance_rate`, which counts unjudged guesses as not accepted)."""
        acc = sum(self.accepted)
        rejections = sum(1 for a, d in zip(self.accepted, self.drafted) if a < d)
        return acc / (acc + rejections) if acc + rejections else float("nan")

    @property
    def tokens_per_target_forward(self) -> float:
        """Mean tokens produced per target verification pass: ``mean(accepted + 1)``
        (plain decoding makes 1). The prompt prefill, which plain decoding needs too, is left out."""
        return self.new_tokens / self.rounds if self.rounds else float("nan")

    @property
    def predicted_tokens_per_target_forward(self) -> float:
        """:func:`expected_tokens_per_pass` at the measured :attr:`alpha` and ``g``."""
        a = self.alpha
        return float("nan") if math.isnan(a) else expected_tokens_per_pass(a, self.num_draft_tokens)

    @classmethod
    def combine(cls, stats: list["SpeculativeStats"]) -> "SpeculativeStats":
        """Pool the rounds of several runs with the same ``num_draft_tokens``."""
        if not stats:
            raise ValueError("combine needs at least one SpeculativeStats")
        g = {s.num_draft_tokens for s in stats}
        if len(g) != 1:
            raise ValueError(f"cannot pool runs with different num_draft_tokens {sorted(g)}")
        out = cls(num_draft_tokens=g.pop())
        for s in stats:
            out.drafted += s.drafted
            out.accepted += s.accepted
            out.target_forwards += s.target_forwards
            out.draft_forwards += s.draft_forwards
            out.new_tokens += s.new_tokens
        return out

    def summary(self) -> dict:
        """The headline figures as a plain dict (for printing and JSON)."""
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "acceptance_rate": self.acceptance_rate,
            "alpha": self.alpha,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "predicted_tokens_per_target_forward": self.predicted_tokens_per_target_forward,
        }


# --------------------------------------------------------------------------- the acceptance step


def _multinomial(probs: Tensor, generator: torch.Generator | None, buffer: Tensor | None = None) -> Tensor:
    """One draw per row of ``probs`` (N, V) -> (N,), on the generator's device if one is given
    (the draws of ``torch.multinomial(probs, 1)``, without its checks: see ``sample_from_probs``,
    which draws its noise into ``buffer`` where given, on probs' device)."""
    if generator is not None and probs.device != generator.device:
        return sample_from_probs(probs.to(generator.device), generator).squeeze(-1).to(probs.device)
    return sample_from_probs(probs, generator, buffer).squeeze(-1)


def accept_prob(p: Tensor, q: Tensor, token: Tensor) -> Tensor:
    """The probability of keeping a draft token: ``min(1, p[token] / q[token])``.

    p, q (..., V): the target's and the draft's distributions at the same positions; token (...)
    the draft's guesses (int64), drawn from q (so ``q[token] > 0``). Returns (...) floats.
    """
    idx = token.long().unsqueeze(-1)
    return (p.gather(-1, idx) / q.gather(-1, idx)).clamp(max=1.0).squeeze(-1)


def residual_distribution(p: Tensor, q: Tensor, weight: float = 1.0) -> Tensor:
    """Where to draw from after a rejection: ``max(0, p - q)`` normalised, (..., V) -> (..., V).

    This is what makes the output follow ``p`` exactly: it adds back the probability that
    ``min(p, q)`` (what acceptance passes on) leaves out. Where ``p == q`` up to rounding (a
    rejection of probability ~0) it falls back on ``p``. Block verification draws from
    ``max(0, weight * p - q)`` normalised, ``weight`` the block's ratio ``w_i`` where it stopped
    (:func:`block_accept_probs`; 1 is token verification's).
    """
    residual = (p - q if weight == 1.0 else weight * p - q).clamp_min(0.0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p / p.sum(-1, keepdim=True))


def block_accept_probs(p: Tensor, q: Tensor, token: Tensor) -> tuple[Tensor, Tensor]:
    """Block verification's tests (Sun et al., "Block verification accelerates speculative
    decoding", ICLR 2025): ``(h, w)``, h (g,) and w (g + 1,) floats.

    p (g + 1, V) and q (g, V): the target's and the draft's distributions after each prefix of the
    guesses token (g,) (int64, drawn from q). ``w_0 = 1`` and ``w_i = min(1, w_(i-1) p_i(x_i) / q_i(x_i))``:
    how far the block's first ``i`` guesses are, jointly, from being too likely under the draft. Then
    for ``i < g``, with ``S_i = sum_v max(0, w_i p_(i+1)(v) - q_(i+1)(v))``,
    ``h_i = S_i / (S_i + 1 - w_i)`` (1 where both are 0: then ``p_(i+1) = q_(i+1)``), and ``h_g = w_g``.
    :func:`speculative_step` keeps the first ``i`` guesses for the *last* ``i`` with
    ``U_i < h_i`` (``U_i`` uniform on [0, 1)), none if there is none, and draws the round's own token
    from :func:`residual_distribution` of the rows after those guesses, ``(p[i], q[i], w_i)``
    (0-based rows), or from ``p[g]`` after all ``g``.
    """
    h, w = _block_tests(p, q, token)
    return torch.tensor(h, dtype=p.dtype, device=p.device), torch.tensor(w, dtype=p.dtype, device=p.device)


def _block_tests(p: Tensor, q: Tensor, token: Tensor) -> tuple[list[float], list[float]]:
    """:func:`block_accept_probs` as two lists of floats, h (g) and w (g + 1): a round's g floats are
    read once and the rest is arithmetic on them (a handful of tensor calls, not one per guess)."""
    g = token.shape[0]
    idx = token.long().unsqueeze(-1)
    ratios = (p[:g].gather(-1, idx) / q.gather(-1, idx)).squeeze(-1).tolist()
    w = [1.0]
    for r in ratios:  # the cap makes it a loop: w_i = min(1, w_(i-1) r_i)
        w.append(min(w[-1] * r, 1.0))
    if g < 2:
        return w[g:], w
    w_mid = torch.tensor(w[1:g], dtype=p.dtype, device=p.device).unsqueeze(-1)  # w_1 .. w_(g-1)
    sums = (w_mid * p[1:g] - q[1:g]).clamp_min_(0.0).sum(-1).tolist()  # S_1 .. S_(g-1)
    h = [s / (s + 1.0 - wi) if s + 1.0 - wi > 0.0 else 1.0 for s, wi in zip(sums, w[1:g])]
    return h + [w[g]], w


def speculative_step(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    draft_tokens: Tensor,
    generator: torch.Generator | None = None,
    verification: str = "token",
) -> tuple[Tensor, int]:
    """Judge ``g`` draft tokens against the target: the heart of speculative decoding.

    Args:
        target_probs: (g + 1, V) the target's processed distributions after each prefix (the
            last row is the bonus position). For greedy decoding raw logits do: only the argmax
            is used.
        draft_probs: (g, V) the draft's processed distributions the guesses were drawn from, or
            ``None`` for greedy decoding (keep guesses while they are the target's argmax).
        draft_tokens: (g,) int64, the draft's guesses ``x_1..x_g``.
        generator: random source for the accept tests and the correction draw.
        verification: ``"token"`` (each guess kept with :func:`accept_prob`, stopping at the
            first rejection) or ``"block"`` (the guesses judged as one block,
            :func:`block_accept_probs`: as exact, and never fewer tokens on average). Greedy
            decoding ignores it.

    Returns:
        ``(accepted_tokens, n_accepted)``: the tokens this round adds, (n_accepted + 1,) int64,
        i.e. the first ``n_accepted`` guesses followed by one token of the target's: drawn from
        :func:`residual_distribution` after a rejection, from ``target_probs[g]`` (the bonus) when
        all ``g`` were accepted, or the argmax in the greedy case.
    """
    p, q = target_probs, draft_probs
    g = draft_tokens.shape[0]
    if p.shape[0] != g + 1:
        raise ValueError(f"target_probs must have g + 1 = {g + 1} rows (one per guess plus the bonus), got {p.shape[0]}")
    if q is None:  # greedy: keep guesses while they are the target's argmax
        best = p.argmax(dim=-1)  # (g+1,)
        k = int((draft_tokens == best[:g]).long().cumprod(0).sum()) if g else 0
        return torch.cat([draft_tokens[:k], best[k : k + 1]]), k
    if q.shape != (g, p.shape[1]):
        raise ValueError(f"draft_probs must have shape (g, V) = ({g}, {p.shape[1]}), got {tuple(q.shape)}")
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {VERIFICATIONS}, got {verification!r}")
    dev = generator.device if generator is not None else p.device
    r = torch.rand(g, generator=generator, device=dev).to(p.device)
    weight = 1.0
    if verification == "block" and g:
        h, w = _block_tests(p, q, draft_tokens)
        # keep the guesses up to the last test passed
        k = max((i + 1 for i, (u, hi) in enumerate(zip(r.tolist(), h)) if u < hi), default=0)
        weight = w[k]
    else:
        ok = (r < accept_prob(p[:g], q, draft_tokens)).long()  # accept with probability min(1, p/q)
        k = int(ok.cumprod(0).sum()) if g else 0
    last = p[g : g + 1] if k == g else residual_distribution(p[k], q[k], weight)[None]
    token = _multinomial(last, generator)  # (1,)
    return torch.cat([draft_tokens[:k], token.to(draft_tokens.dtype)]), k


def verify_draft(draft_tokens: Tensor, q: Tensor | None, p: Tensor, *,
                 generator: torch.Generator | None = None, verification: str = "token") -> tuple[int, Tensor]:
    """:func:`speculative_step` returning ``(k, token)``: the number of accepted guesses and the
    target's own token (0-d). draft_tokens (g,), q (g, V) or None (greedy), p (g + 1, V)."""
    tokens, k = speculative_step(p, q, draft_tokens, generator, verification)
    return k, tokens[k]


# --------------------------------------------------------------------------- the decoding loop


def _check_inputs(target, draft, idx: Tensor, config: GenerationConfig) -> int:
    """Check the models, the prompt and the config for speculative decoding; return max_new_tokens."""
    for name, m in (("target", target), ("draft", draft)):
        if not isinstance(m, GPT):
            raise TypeError(f"{name} must be a gptlab GPT model, got {type(m).__name__}")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(
            f"target and draft must share a vocabulary: target vocab_size={target.config.vocab_size}, "
            f"draft vocab_size={draft.config.vocab_size}"
        )
    check_token_ids(idx, target.config.vocab_size)
    if idx.shape[0] != 1:
        raise ValueError(f"speculative_generate decodes one sequence at a time (batch size 1), got batch size {idx.shape[0]}")
    max_new_tokens = config.needs_max_new_tokens()
    s = config.sampling
    unused = {k: v for k, v in (("min_p", s.min_p), ("repetition_penalty", s.repetition_penalty),
                                ("frequency_penalty", s.frequency_penalty), ("presence_penalty", s.presence_penalty),
                                ("eos_token_id", config.eos_token_id)) if v is not None}
    if config.num_beams != 1:
        unused["num_beams"] = config.num_beams
    if unused:
        raise ValueError(f"speculative_generate applies temperature, top_k and top_p only; the config also sets "
                         f"{unused}")
    total = idx.shape[1] + max_new_tokens
    for name, m in (("target", target), ("draft", draft)):
        if total > m.config.block_size:
            raise ValueError(
                f"prompt ({idx.shape[1]}) + max_new_tokens ({max_new_tokens}) = {total} tokens exceeds "
                f"the {name}'s block_size={m.config.block_size}"
            )
    d_t, d_d = next(target.parameters()).device, next(draft.parameters()).device
    if d_t != d_d:
        raise ValueError(f"target and draft must be on the same device, got {d_t} and {d_d}")
    return max_new_tokens


@torch.inference_mode()
def speculative_generate(
    target,
    draft,
    idx: Tensor,
    max_new_tokens: int | None = None,
    config: GenerationConfig | None = None,
    *,
    generator: torch.Generator | None = None,
    **settings: Any,
) -> tuple[Tensor, SpeculativeStats]:
    """Generate ``max_new_tokens`` tokens from ``target`` with ``draft`` proposing guesses.

    Args:
        target: the :class:`gptlab.GPT` whose distribution the output follows.
        draft: a (smaller, faster) :class:`gptlab.GPT` with the same vocabulary.
        idx: (1, T) int64 prompt token ids.
        max_new_tokens: how many tokens to add (None: the config's); the prompt and the new tokens
            must fit in both models' block size.
        config: a :class:`gptlab.generation.GenerationConfig`; the settings used are
            ``num_draft_tokens`` (``g``, guesses per round, default 4; the last round drafts fewer
            so that it never overshoots ``max_new_tokens``), ``verification`` (``"token"``, the
            default, or ``"block"``: :func:`speculative_step`), ``sampling``'s temperature, top_k
            and top_p (applied to both models' logits, :func:`gptlab.sampling.process_logits`;
            ``temperature=0`` is greedy) and ``fast`` (on a CPU, both models' decode products on
            packed weights where that is faster on this machine, as :func:`gptlab.generate` runs
            them) or ``compile`` (both models' decode steps through ``torch.compile``,
            :mod:`gptlab.fast.compiled`). A config that sets min_p, a penalty, eos_token_id or num_beams > 1 is refused.
        generator: a seeded ``torch.Generator`` for reproducible sampling.
        **settings: fields of :class:`GenerationConfig` or :class:`gptlab.sampling.SamplingConfig`
            replacing the config's (``num_draft_tokens=4, temperature=0``).

    Returns:
        ``(ids, stats)``: ids (1, T + max_new_tokens), the prompt followed by the new tokens, and a
        :class:`SpeculativeStats`. Both models are put in eval mode for the call and restored after.
    """
    config = _build_config(config, max_new_tokens, settings)
    max_new_tokens = _check_inputs(target, draft, idx, config)
    device = next(target.parameters()).device
    T0 = idx.shape[1]
    seq = torch.empty(T0 + max_new_tokens, dtype=torch.long, device=device)  # prompt, then accepted tokens
    seq[:T0] = idx[0].to(device=device, dtype=torch.long)
    stats = SpeculativeStats(num_draft_tokens=config.num_draft_tokens)
    if max_new_tokens == 0:
        return seq[None], stats
    with _decode_mode(target, draft, config.packs, max_new_tokens):
        _rounds(target, draft, seq, T0, config, generator, stats)
    return seq[None], stats


def _build_config(config: GenerationConfig | None, max_new_tokens: int | None, settings: dict) -> GenerationConfig:
    """:meth:`GenerationConfig.build`, a non-number raising ``ValueError`` as any other bad setting here."""
    try:
        return GenerationConfig.build(config, max_new_tokens, **settings)
    except TypeError as e:  # a non-number: the same error type as any other bad setting here
        if str(e).startswith("unknown decoding setting"):
            raise
        raise ValueError(str(e)) from None


@contextmanager
def _decode_mode(target, draft, fast: bool, max_new_tokens: int) -> Iterator[None]:
    """For the call: both models in eval mode, and with ``fast`` their decode products on packed
    weights (:func:`gptlab.fast.cpu.pack_for_decoding`), but for the draft's layers that the C++
    step multiplies by its own product (:func:`gptlab.fast.native.step_keeps_plain`) and the
    target's layers whose verification chunks would not read a packed copy or run no faster from
    one (:func:`gptlab.fast.native.chunk_keeps_plain`: the target runs chunks only); the models
    are their own again after."""
    was_training = [m for m in {id(target): target, id(draft): draft}.values() if m.training]
    for m in was_training:  # no dropout while decoding (checking first: .eval() walks every module)
        m.eval()
    packs = ExitStack()
    try:
        if fast:  # for the call: the originals are back in the finally clause
            packs.enter_context(pack_for_decoding(target, max_new_tokens, keep_plain=chunk_keeps_plain(target)))
            # the draft's one-token steps (batch 1, a static cache): the layers the C++ step multiplies
            # by its own product stay plain
            packs.enter_context(pack_for_decoding(draft, max_new_tokens,
                                                  keep_plain=step_keeps_plain(draft, 1, "static", False)))
        yield
    finally:
        packs.close()
        for m in was_training:
            m.train()


def _rounds(target, draft, seq: Tensor, n: int, config: GenerationConfig, generator: torch.Generator | None,
            stats: SpeculativeStats) -> None:
    """Fill ``seq`` (the prompt in its first ``n`` slots) round by round: the draft guesses, the
    target judges all guesses in one pass (:func:`speculative_step`), both caches roll back."""
    end = seq.shape[0]
    sampling = config.sampling
    greedy = sampling.greedy

    if sampling.temperature == 1.0 and sampling.top_k is None and sampling.top_p is None:
        def probs(logits: Tensor) -> Tensor:  # nothing to process (min_p is refused): a guess pays no checks
            return torch.softmax(logits.float(), dim=-1)
    else:
        def probs(logits: Tensor) -> Tensor:  # (N, V) logits -> (N, V) processed distributions
            return torch.softmax(sampling.process(logits.float()), dim=-1)

    # Invariant at the top of each round, with n tokens in seq: the target's cache holds
    # seq[:n-1]; the draft's holds a prefix of it (it lags one token after a full accept).
    tcache = StaticKVCache.for_model(target, 1, end)
    dcache = StaticKVCache.for_model(draft, 1, end)
    tdecode, ddecode = decode_step(target, config.compile), decode_step(draft, config.compile)
    # The one-token steps in C++ where built, else a Python twin of the model's step; the target's
    # verification of each round (g + 1 tokens) through the twin's chunk (gptlab.fast.native)
    if config.packs:
        tdecode, ddecode = native_decode(target, tcache, tdecode), native_decode(draft, dcache, ddecode)
    if n > 1:  # prefill everything but the last prompt token, which opens round one
        tdecode(seq[None, : n - 1], tcache)
        ddecode(seq[None, : n - 1], dcache)
        stats.target_forwards += 1
        stats.draft_forwards += 1
    while n < end:
        g = min(config.num_draft_tokens, end - n - 1)  # never draft past max_new_tokens
        # 1. the draft guesses g tokens, one forward pass each
        draft_tokens, qs = _guesses(ddecode, dcache, seq[None, dcache.length : n], g, None if greedy else probs,
                                    generator, stats)
        # 2. the target scores the last token and all g guesses in one forward pass
        cand = torch.cat([seq[n - 1 : n], draft_tokens])[None]  # (1, g+1)
        tlogits = tdecode(cand, tcache, last_only=False)[0]  # (g+1, V)
        stats.target_forwards += 1
        # 3. keep the agreed prefix, add one target token
        if greedy:
            tokens, k = speculative_step(tlogits, None, draft_tokens)
        else:
            q_all = torch.cat(qs) if qs else tlogits.new_empty(0, tlogits.shape[-1])  # (g, V)
            tokens, k = speculative_step(probs(tlogits), q_all, draft_tokens, generator, config.verification)
        seq[n : n + k + 1] = tokens
        n += k + 1
        stats.drafted.append(g)
        stats.accepted.append(k)
        stats.new_tokens += k + 1
        # 4. roll both caches back to seq[:n-1]; rejected slots are overwritten later
        tcache.crop(n - 1)
        dcache.crop(n - 1)


def _guesses(decode: Callable[..., Tensor], cache: StaticKVCache, x: Tensor, g: int,
             probs: Callable[[Tensor], Tensor] | None, generator: torch.Generator | None,
             stats: SpeculativeStats) -> tuple[Tensor, list[Tensor]]:
    """The draft's ``g`` guesses (g,) after ``x`` (1, t), what its ``cache`` has not seen yet, one
    forward pass each (``decode``: the draft's :meth:`~gptlab.GPT.decode`, maybe compiled):
    arg-maxes without ``probs`` (greedy), else draws from ``probs(logits)``, returned too (each (1, V))."""
    guesses, qs, race = [], [], None
    if g and x.shape[1] == 2:
        # after a full accept the draft is a token behind: that token's one-token step costs less
        # than a 2-token chunk (a speculative call at g = 16 on the AMD EPYC measured: 1.7-4.6%
        # shorter, best and median of 12 interleaved rounds)
        decode(x[:, :1], cache)
        stats.draft_forwards += 1
        x = x[:, 1:]
    for _ in range(g):
        logits = decode(x, cache)  # (1, V)
        stats.draft_forwards += 1
        if probs is None:
            tok = logits.argmax(dim=-1)  # (1,)
        else:
            q = probs(logits)
            qs.append(q)
            race = torch.empty_like(q) if race is None else race  # the draws' noise, one buffer a round
            tok = _multinomial(q, generator, race)
        guesses.append(tok)
        x = tok.view(1, 1)
    draft_tokens = torch.cat(guesses) if guesses else x.new_empty(0)  # (g,)
    return draft_tokens, qs
