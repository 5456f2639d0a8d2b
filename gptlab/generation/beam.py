"""Beam search, as Hugging Face's ``generate(num_beams=n, do_sample=False)``.

Where this sits: logits -> *samples*, beside :mod:`gptlab.generation.loop` (whose :class:`Runner`
feeds the model here too). Instead of one token per step, every live beam is extended by every
token and the best continuations are kept: same hypotheses, length penalty and early-stopping
modes as Hugging Face's.

One loop serves a model (:func:`beam_search`, with its KV cache) and a plain step function
``step_fn(ids (N, T)) -> logits (N, V)`` (:func:`beam_search_fn`). Its three decisions are small
public functions that :func:`beam_search_fn` lets a caller replace: how a candidate is scored
(:func:`candidate_scores`), which candidates become finished hypotheses
(:func:`finish_in_top_beams`) and what a finished hypothesis scores (:func:`hypothesis_score`).
The graders run the same loop with one decision replaced by a learner's known mistake, to name it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model import check_token_ids
from .config import GenerationConfig, check_pad, eos_tensor
from .loop import EvalMode, Runner, check_prompt, fast_path

__all__ = ["beam_search", "beam_search_fn", "Candidates", "candidate_scores", "finish_in_top_beams",
           "hypothesis_score"]


NEG = -1.0e9
"""The score of what must not be chosen (a beam that cannot go on, a candidate that did not finish)."""


def beam_search(model, idx: Tensor, max_new_tokens: int | None = None, num_beams: int | None = None,
                length_penalty: float | None = None, eos_token_id: int | Sequence[int] | None = None, *,
                config: GenerationConfig | None = None, attention_mask: Tensor | None = None,
                **settings: Any) -> Tensor:
    """Beam search, as Hugging Face's ``generate(num_beams=num_beams, do_sample=False,
    early_stopping=early_stopping)``.

    idx (B, T) int64 -> (B, T + n) int64, the best finished hypothesis of each row, n <=
    max_new_tokens (rows shorter than the longest are filled with ``pad_token_id``, default the
    first eos id).

    Args:
        model: a :class:`gptlab.GPT`.
        idx: (B, T) the prompts' token ids (left-padded, with ``attention_mask``, when their
            lengths differ).
        max_new_tokens, num_beams, length_penalty, eos_token_id: the settings beam search is
            about, given positionally as ever; each None: the config's (``num_beams`` 1,
            ``length_penalty`` 1.0, no eos).
        config: a :class:`gptlab.generation.GenerationConfig` (its sampling settings are not
            used: beam search scores log-probabilities).
        attention_mask: (B, T), 1 = real token, 0 = left padding.
        **settings: other fields of :class:`GenerationConfig`: ``pad_token_id``, ``use_cache``,
            ``early_stopping``, ``fast``, ``compile`` (as in :func:`gptlab.generate`).

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
    """
    given = {k: v for k, v in (("num_beams", num_beams), ("length_penalty", length_penalty),
                               ("eos_token_id", eos_token_id)) if v is not None}
    config = GenerationConfig.build(config, max_new_tokens, **given, **settings)
    max_new_tokens = config.needs_max_new_tokens(1, " for beam search")
    mask = check_prompt(model, idx, attention_mask)
    pad_token_id = check_pad(config.pad_token_id, model.config.vocab_size)
    B, T = idx.shape
    nb = config.num_beams
    total = T + max_new_tokens
    eos = eos_tensor(config.eos_token_id, model.config.vocab_size, idx.device)
    fill = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos is not None else 0)
    flat_mask = None if mask is None else mask.repeat_interleave(nb, dim=0)
    with EvalMode(model), torch.inference_mode(), fast_path(model, config.packs, max_new_tokens):
        runner = Runner(model, B * nb, T, total, flat_mask, config.use_cache, "static", idx.device,
                        compile=config.compile, fast=config.packs)
        hyps = _search(runner, idx, _Search.of(config, eos), total, eos, fill)
    return _best(hyps, T)


# --------------------------------------------------------------------------- the step's three decisions


class Candidates(NamedTuple):
    """A step's ``K`` best continuations of each row, best first (K: :func:`beam_search_fn`'s
    ``num_candidates``, by default Hugging Face's ``max(2, 1 + #eos) * num_beams``, enough for
    ``num_beams`` of them not to end)."""

    scores: Tensor
    """(B, K) float32: their scores (:func:`candidate_scores`)."""
    beams: Tensor
    """(B, K) int64: the beam each one extends."""
    ids: Tensor
    """(B, K, total) int64: their token ids, the new token at the step's index."""
    ends: Tensor
    """(B, K) bool: they end here (eos, or the length limit)."""
    eos: Tensor
    """(B, K) bool: their new token is an eos id."""


def candidate_scores(beam_scores: Tensor, logprobs: Tensor) -> Tensor:
    """A candidate's score: its beam's summed log-probability (B, nb) plus the new token's
    ``logprobs`` (B, nb, V) -> (B, nb, V). Log-probabilities add because the sequence's
    probability is the product of its tokens' probabilities."""
    return beam_scores[:, :, None] + logprobs


def finish_in_top_beams(candidates: Candidates, num_beams: int) -> Tensor:
    """Which candidates become finished hypotheses (B, K) bool: those that end, among the step's
    best ``num_beams``. An ending candidate ranked lower is dropped (as in Hugging Face's), since
    the best ``num_beams`` of the step are the ones beam search follows."""
    rank = torch.arange(candidates.ends.shape[1], device=candidates.ends.device)
    return candidates.ends & (rank < num_beams)


def hypothesis_score(sum_logprobs: Tensor, generated_len: int, length_penalty: float, prompt_len: int) -> Tensor:
    """A finished hypothesis's score: ``sum_logprobs / generated_len ** length_penalty``, any
    shape. Only the generated tokens (eos included) count, so that prompts of other lengths do
    not change the search (``prompt_len`` is not used: it is there for rules that count it).
    ``length_penalty`` > 0 favours longer hypotheses, < 0 shorter ones."""
    return sum_logprobs / (generated_len**length_penalty)


def beam_search_fn(step_fn: Callable[[Tensor], Tensor], prompt_ids: Tensor, num_beams: int, max_new_tokens: int,
                   eos_token_id: int | Sequence[int] | None = None, length_penalty: float = 1.0, *,
                   early_stopping: bool | str | None = False, pad_token_id: int | None = None,
                   score: Callable[[Tensor, Tensor], Tensor] = candidate_scores,
                   finish: Callable[[Candidates, int], Tensor] = finish_in_top_beams,
                   final_score: Callable[[Tensor, int, float, int], Tensor] = hypothesis_score,
                   num_candidates: int | None = None) -> Tensor:
    """Beam search on a step function: the loop of :func:`beam_search`, fed by
    ``step_fn(ids (N, T) int64) -> logits (N, V)`` (the next token's logits of each sequence)
    instead of a model, so a toy language model, or any scorer, can be searched.

    prompt_ids (B, T) int64 -> (B, T + n) int64, the best finished hypothesis of each row, n <=
    max_new_tokens (shorter rows filled with ``pad_token_id``, default the first eos id). Every step
    calls ``step_fn`` on all B * num_beams live sequences, whole (there is no cache).

    Args:
        step_fn: ids (N, T) -> logits (N, V).
        prompt_ids: (B, T) the prompts, all of the same length.
        num_beams, max_new_tokens, eos_token_id, length_penalty, early_stopping, pad_token_id: as
            in :func:`beam_search` (ids outside the step function's vocabulary never match), and
            ``early_stopping=None``: no early stop, every step up to ``max_new_tokens`` is searched.
            With the default decisions that is ``"never"``'s answer; with a replaced ``score``,
            which may raise a beam's score, the bound of ``"never"`` no longer holds.
        score: ``score(beam_scores (B, nb), logprobs (B, nb, V)) -> (B, nb, V)``, each candidate's
            score (default :func:`candidate_scores`).
        finish: ``finish(candidates, num_beams) -> (B, K) bool``, which of the step's best
            candidates become finished hypotheses (default :func:`finish_in_top_beams`).
        final_score: ``final_score(sum_logprobs (B, K), generated_len, length_penalty, prompt_len)
            -> (B, K)``, a finished hypothesis's score (default :func:`hypothesis_score`); the
            early-stopping bound uses it too.
        num_candidates: K, how many of each step's best candidates the decisions see (default
            Hugging Face's ``max(2, 1 + #eos) * num_beams``, enough for ``num_beams`` of them not
            to end); a ``finish`` that finishes lower-ranked candidates needs more. At most
            ``num_beams * V`` are taken, so a large number means every candidate.

    The three decisions are replaceable so that a search with one of them done differently (the
    graders' diagnoses of a learner's known mistakes, or an experiment with another length
    normalisation) is this same loop, not a second beam search.
    """
    config = GenerationConfig.build(None, max_new_tokens, num_beams=num_beams, length_penalty=length_penalty,
                                    eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                    early_stopping="never" if early_stopping is None else early_stopping)
    max_new_tokens = config.needs_max_new_tokens(1, " for beam search")
    check_token_ids(prompt_ids, sys.maxsize, "prompt_ids")  # the vocabulary is the step function's, unknown here
    B, T = prompt_ids.shape
    eos = None if config.eos_token_id is None else torch.tensor(config.eos_token_id, device=prompt_ids.device)
    fill = config.pad_token_id if config.pad_token_id is not None else (int(eos[0]) if eos is not None else 0)
    search = _Search.of(config, eos, score, finish, final_score, num_candidates)
    if early_stopping is None:  # not one of the config's modes: checked as "never", searched without a stop
        search = search._replace(early_stopping=None)
    with torch.inference_mode():
        hyps = _search(_StepFnRunner(step_fn), prompt_ids, search, T + max_new_tokens, eos, fill)
    return _best(hyps, T)


class _StepFnRunner:
    """The loop's source of logits for a step function (a :class:`Runner` without a model): each
    step recomputes from the whole sequences, so there is no cache to reorder."""

    def __init__(self, step_fn: Callable[[Tensor], Tensor]):
        self.step_fn = step_fn

    def logits(self, ids: Tensor, cur: int) -> Tensor:
        """Logits (N, V) for the token at index ``cur``, given ``ids[:, :cur]``."""
        return self.step_fn(ids[:, :cur])

    def reorder(self, index: Tensor) -> None:
        """Nothing to follow: the next step sees the reordered ids whole."""


def _best(hyps: _Finished, prompt_len: int) -> Tensor:
    """Each row's best finished hypothesis (B, prompt_len + n), n: the longest one's generated length."""
    n = int(hyps.lengths[:, 0].max())
    return hyps.seqs[:, 0, : prompt_len + n].clone()


class _Search(NamedTuple):
    """How one search runs: its settings and its three decisions (:func:`beam_search_fn`)."""

    num_beams: int
    length_penalty: float
    early_stopping: bool | str | None
    """Hugging Face's three modes, or None: every step is searched."""
    num_candidates: int
    """K, the candidates of each step the decisions see (at most num_beams * V are)."""
    score: Callable[[Tensor, Tensor], Tensor]
    finish: Callable[[Candidates, int], Tensor]
    final_score: Callable[[Tensor, int, float, int], Tensor]

    @classmethod
    def of(cls, config: GenerationConfig, eos: Tensor | None, score=candidate_scores, finish=finish_in_top_beams,
           final_score=hypothesis_score, num_candidates: int | None = None) -> _Search:
        """A config's search (Hugging Face's decisions unless others are given)."""
        nb = config.num_beams
        K = num_candidates or max(2, 1 + (0 if eos is None else eos.numel())) * nb
        return cls(nb, config.length_penalty, config.early_stopping, K, score, finish, final_score)


# --------------------------------------------------------------------------- the loop


class _Finished:
    """The ``nb`` best finished hypotheses of each row, best first: their ids ``seqs`` (B, nb,
    total), ``scores`` (B, nb; NEG where there is none yet), generated ``lengths`` and ``done`` flags."""

    def __init__(self, running: Tensor):
        B, nb, _ = running.shape
        device = running.device
        self.seqs = running.clone()
        self.scores = torch.full((B, nb), NEG, device=device)
        self.lengths = torch.zeros(B, nb, dtype=torch.long, device=device)  # generated tokens of each finished one
        self.done = torch.zeros(B, nb, dtype=torch.bool, device=device)

    def add(self, cand: Tensor, scores: Tensor, just: Tensor, length: int) -> None:
        """Candidates ``cand`` (B, K, total) with their ``scores`` (B, K; NEG unless they finish
        here, ``just``) and ``length`` generated tokens join: the best ``nb`` of all stay."""
        B, K = scores.shape
        m_seqs = torch.cat([self.seqs, cand], dim=1)
        m_scores = torch.cat([self.scores, scores], dim=1)
        m_fin = torch.cat([self.done, just], dim=1)
        m_len = torch.cat([self.lengths, torch.full((B, K), length, dtype=torch.long, device=scores.device)], dim=1)
        best = torch.topk(m_scores, self.scores.shape[1]).indices
        self.seqs = torch.take_along_dim(m_seqs, best[:, :, None], dim=1)
        self.scores = torch.take_along_dim(m_scores, best, dim=1)
        self.done = torch.take_along_dim(m_fin, best, dim=1)
        self.lengths = torch.take_along_dim(m_len, best, dim=1)


def _search(runner, idx: Tensor, search: _Search, total: int, eos: Tensor | None, fill: int) -> _Finished:
    """The search from the prompts ``idx`` (B, T) to at most ``total`` tokens: every step extends
    the live beams (:func:`_candidates`), keeps the best ``nb`` unfinished ones running and adds
    the finished ones (``search.finish``) to the hypotheses, until no row can improve. ``runner``
    gives the logits (B * nb, V) of the flat beams and follows their reordering (a :class:`Runner`)."""
    device = idx.device
    B, T = idx.shape
    nb, lp, early_stopping = search.num_beams, search.length_penalty, search.early_stopping
    stop_when_full = early_stopping is True
    running = torch.full((B, nb, total), fill, dtype=torch.long, device=device)
    running[:, :, :T] = idx[:, None, :]
    running_scores = torch.zeros(B, nb, device=device)
    copies = torch.zeros(B, nb, 1, device=device)
    copies[:, 1:] = NEG  # the beams start as copies of the prompt: only the first one's continuations count
    hyps = _Finished(running)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    batch_offset = torch.arange(B, device=device)[:, None] * nb
    flat = running.view(B * nb, total)
    for cur in range(T, total):
        logprobs = F.log_softmax(runner.logits(flat, cur).float(), dim=-1).view(B, nb, -1)
        scores = search.score(running_scores, logprobs)
        cands = _candidates(scores + copies if cur == T else scores, running, cur, search.num_candidates, eos)
        # the best num_beams candidates that go on
        run_lp = cands.scores + cands.ends.to(torch.float32) * NEG
        keep = torch.topk(run_lp, nb).indices
        running = torch.take_along_dim(cands.ids, keep[:, :, None], dim=1)
        running_scores = torch.take_along_dim(run_lp, keep, dim=1)
        parent = torch.take_along_dim(cands.beams, keep, dim=1)
        # finished hypotheses: only while improvable
        just = search.finish(cands, nb)
        fin = search.final_score(cands.scores, cur + 1 - T, lp, T)
        fin = fin + (hyps.done.all(dim=-1, keepdim=True) & stop_when_full).to(torch.float32) * NEG
        fin = fin + (~improvable).to(torch.float32) * NEG
        fin = fin + (~just) * NEG
        hyps.add(cands.ids, fin, just, cur + 1 - T)
        # HF's early-stopping heuristic: can the best live beam still beat the worst finished one?
        best_len = total - T if early_stopping == "never" and lp > 0.0 else cur + 1 - T
        best_running = search.final_score(running_scores[:, :1], best_len, lp, T)
        worst = torch.where(hyps.done, hyps.scores.min(dim=1, keepdim=True).values, NEG)
        if early_stopping is not None:
            improvable = improvable & (best_running > worst).any(dim=-1, keepdim=True)
        if not bool(improvable.any()) or bool(cands.ends.all()) or (stop_when_full and bool(hyps.done.all())):
            break
        runner.reorder((parent + batch_offset).view(-1))
        flat = running.view(B * nb, total)
    return hyps


def _candidates(scores: Tensor, running: Tensor, cur: int, K: int, eos: Tensor | None) -> Candidates:
    """The ``K`` best (at most all) of the step's candidate ``scores`` (B, nb, V) of each row, with
    their ids (the live beams ``running`` (B, nb, total) extended by the new token at ``cur``)."""
    B, nb, total = running.shape
    V = scores.shape[-1]
    top_scores, top_idx = torch.topk(scores.view(B, nb * V), min(K, nb * V))
    src_beam = top_idx // V
    tok = top_idx % V
    ids = torch.take_along_dim(running, src_beam[:, :, None], dim=1)  # (B, K, total)
    ids[:, :, cur] = tok
    is_eos = torch.zeros_like(tok, dtype=torch.bool) if eos is None else torch.isin(tok, eos)
    return Candidates(top_scores, src_beam, ids, is_eos | (cur + 1 >= total), is_eos)
