"""The checks of the ``sampling`` assignment (gptlab.grading.sampling): the beam-search recipe the
task states equals gptlab's beam search, its cases tell every known mistake apart, edge messages."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from gptlab.grading.core import ExerciseError
from gptlab.grading.sampling import (
    _BEAM_CASES,
    _BEAM_MISTAKES,
    ToyLM,
    check_beam_search,
    check_sample_next,
    check_top_k_filter,
    reference_beam_search,
)


def recipe(step_fn, prompt, num_beams, max_new_tokens, eos_token_id, length_penalty=1.0, copies=1):
    """The task text's recipe, step by step (plain Python, double precision); ``copies`` > 1: the
    search starts from that many copies of the prompt (a learner's mistake)."""
    beams, finished = [(list(prompt), 0.0)] * copies, []
    for step in range(1, max_new_tokens + 1):
        logp = F.log_softmax(step_fn(torch.tensor([s for s, _ in beams])).double(), dim=-1)
        cands = sorted(((sc + logp[i, v].item(), seq + [v]) for i, (seq, sc) in enumerate(beams)
                        for v in range(logp.shape[1])), key=lambda c: -c[0])
        live = []
        for rank, (sc, seq) in enumerate(cands):
            if seq[-1] == eos_token_id or step == max_new_tokens:
                if rank < num_beams:
                    finished.append((sc / step**length_penalty, seq))
            elif len(live) < num_beams:
                live.append((seq, sc))
        beams = live
    return max(finished, key=lambda f: f[0])[1]


@pytest.mark.parametrize("nb,n,lp", [(3, 6, 1.0), (2, 5, 2.0), (4, 7, 0.5), (3, 6, -1.0), (1, 4, 1.0), (3, 1, 1.0)])
def test_recipe_in_the_task_text_is_gptlab_beam_search(nb, n, lp):
    for seed in range(40):
        toy = ToyLM(seed)
        assert recipe(toy, [1, 2], nb, n, 0, lp) == reference_beam_search(toy, [1, 2], nb, n, 0, lp), seed


def test_reference_runs_until_the_last_step_and_finds_short_hypotheses():
    lengths = {len(reference_beam_search(ToyLM(s), [3], 3, 6, 0, 1.0)) for s in range(30)}
    assert len(lengths) > 2, lengths  # eos ends hypotheses at several lengths on the toy models


def test_every_beam_mistake_changes_an_answer_and_no_two_look_alike():
    def answers(**mistake):
        return tuple(tuple(reference_beam_search(ToyLM(s), p, **(dict(num_beams=nb, max_new_tokens=n, eos_token_id=0,
                                                                      length_penalty=lp) | mistake)))
                     for s, p, nb, n, lp in _BEAM_CASES)

    right = answers()
    assert right == tuple(tuple(recipe(ToyLM(s), p, nb, n, 0, lp)) for s, p, nb, n, lp in _BEAM_CASES)
    wrong = [answers(**mistake) for mistake, _ in _BEAM_MISTAKES]
    assert all(w != right for w in wrong)
    assert all(a != b for a, b in itertools.combinations(wrong, 2))


def test_duplicated_start_beams_is_greedy_and_named_so():
    """num_beams copies of the prompt make every beam the same sequence: greedy decoding."""
    def dup(step_fn, prompt, num_beams, max_new_tokens, eos_token_id, length_penalty=1.0):
        return recipe(step_fn, prompt, num_beams, max_new_tokens, eos_token_id, length_penalty, copies=num_beams)

    with pytest.raises(ExerciseError, match="copies of the prompt"):
        check_beam_search(dup)


def test_top_k_larger_than_vocabulary_gets_a_hint():
    def no_min(logits, k):
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, float("-inf"))

    with pytest.raises(ExerciseError, match=r"min\(k, logits.shape\[-1\]\)"):
        check_top_k_filter(no_min)


def test_sample_next_accepts_a_correct_sampler_of_another_algorithm():
    """The Gumbel-max trick draws the same distribution as torch.multinomial with other numbers."""
    def gumbel(logits, generator):
        u = torch.rand(logits.shape, generator=generator).clamp_min(1e-20)
        return (logits - torch.log(-torch.log(u))).argmax(dim=-1)

    check_sample_next(gumbel)
