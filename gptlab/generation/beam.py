"""Beam search, as Hugging Face's ``generate(num_beams=n, do_sample=False)``.

Where this sits: logits -> *samples*, beside :mod:`gptlab.generation.loop` (whose :class:`Runner`
feeds the model here too). Instead of one token per step, every live beam is extended by every
token and the best continuations are kept: same hypotheses, length penalty and early-stopping
modes as Hugging Face's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import GenerationConfig, check_pad, eos_tensor
from .loop import EvalMode, Runner, check_prompt, fast_path

__all__ = ["beam_search"]


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
            ``early_stopping``, ``fast`` (as in :func:`gptlab.generate`).

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
    with EvalMode(model), torch.inference_mode(), fast_path(model, config.fast, max_new_tokens):
        runner = Runner(model, B * nb, T, total, flat_mask, config.use_cache, "static", idx.device)
        hyps = _search(runner, idx, config, total, eos, fill)
    n = int(hyps.lengths[:, 0].max())
    return hyps.seqs[:, 0, : T + n].clone()


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


def _search(runner: Runner, idx: Tensor, config: GenerationConfig, total: int, eos: Tensor | None,
            fill: int) -> _Finished:
    """The search from the prompts ``idx`` (B, T) to at most ``total`` tokens: every step extends
    the live beams (:func:`_candidates`), keeps the best ``nb`` unfinished ones running and adds
    the finished ones in the top ``nb`` to the hypotheses, until no row can improve."""
    device = idx.device
    B, T = idx.shape
    nb, lp, early_stopping = config.num_beams, config.length_penalty, config.early_stopping
    stop_when_full = early_stopping is True
    K = max(2, 1 + (0 if eos is None else eos.numel())) * nb
    top_nb = torch.zeros(K, dtype=torch.bool, device=device)
    top_nb[:nb] = True
    running = torch.full((B, nb, total), fill, dtype=torch.long, device=device)
    running[:, :, :T] = idx[:, None, :]
    running_scores = torch.zeros(B, nb, device=device)
    running_scores[:, 1:] = NEG  # only the first beam's continuations count at step one
    hyps = _Finished(running)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    batch_offset = torch.arange(B, device=device)[:, None] * nb
    flat = running.view(B * nb, total)
    for cur in range(T, total):
        topk_lp, src_beam, cand, hits = _candidates(runner.logits(flat, cur), running, running_scores, cur, K, eos)
        # the best num_beams candidates that go on
        run_lp = topk_lp + hits.to(torch.float32) * NEG
        keep = torch.topk(run_lp, nb).indices
        running = torch.take_along_dim(cand, keep[:, :, None], dim=1)
        running_scores = torch.take_along_dim(run_lp, keep, dim=1)
        parent = torch.take_along_dim(src_beam, keep, dim=1)
        # finished hypotheses: only candidates in the top num_beams, only while improvable
        just = hits & top_nb[None, :]
        fin = topk_lp / ((cur + 1 - T) ** lp)
        fin = fin + (hyps.done.all(dim=-1, keepdim=True) & stop_when_full).to(torch.float32) * NEG
        fin = fin + (~improvable).to(torch.float32) * NEG
        fin = fin + (~just) * NEG
        hyps.add(cand, fin, just, cur + 1 - T)
        # HF's early-stopping heuristic: can the best live beam still beat the worst finished one?
        best_len = total - T if early_stopping == "never" and lp > 0.0 else cur + 1 - T
        best_running = running_scores[:, :1] / (best_len**lp)
        worst = torch.where(hyps.done, hyps.scores.min(dim=1, keepdim=True).values, NEG)
        improvable = improvable & (best_running > worst).any(dim=-1, keepdim=True)
        if not bool(improvable.any()) or bool(hits.all()) or (stop_when_full and bool(hyps.done.all())):
            break
        runner.reorder((parent + batch_offset).view(-1))
        flat = running.view(B * nb, total)
    return hyps


def _candidates(logits: Tensor, running: Tensor, running_scores: Tensor, cur: int, K: int,
                eos: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ``K`` best continuations of each row's live beams by summed log-probability, from the
    step's ``logits`` (B*nb, V): their log-probs and source beams (B, K), their ids (B, K, total)
    with the new token at ``cur``, and whether they end there (eos, or the length limit)."""
    B, nb, total = running.shape
    V = logits.shape[-1]
    logp = F.log_softmax(logits.float(), dim=-1).view(B, nb, V) + running_scores[:, :, None]
    topk_lp, topk_idx = torch.topk(logp.view(B, nb * V), K)
    src_beam = topk_idx // V
    tok = topk_idx % V
    cand = torch.take_along_dim(running, src_beam[:, :, None], dim=1)  # (B, K, total)
    cand[:, :, cur] = tok
    hits = torch.full((B, K), cur + 1 >= total, dtype=torch.bool, device=running.device)
    if eos is not None:
        hits = hits | torch.isin(tok, eos)
    return topk_lp, src_beam, cand, hits
