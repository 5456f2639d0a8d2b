"""The kv_cache assignment's generation check rests on its bug simulator: pin it to gptlab."""

from __future__ import annotations

import itertools

import pytest
import torch

import gptlab
from gptlab.grading.core import ExerciseError
from gptlab.grading.kv_cache import BUGS, check_kv_cache_bytes, simulate_generate_cached, tiny_model


@pytest.mark.parametrize("seed", [0, 1])
def test_simulator_without_bug_is_greedy_generation(seed):
    model = tiny_model(seed)
    idx = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(simulate_generate_cached(model, idx, 10),
                               gptlab.generate(model, idx, 10, temperature=0.0, use_cache=False), rtol=0, atol=0)
    torch.testing.assert_close(simulate_generate_cached(model, idx, 10),
                               gptlab.generate(model, idx, 10, temperature=0.0, use_cache=True), rtol=0, atol=0)


def test_every_bug_changes_the_tokens_of_the_check_and_no_two_agree():
    """Otherwise the check could not tell a bug from a correct answer, or one bug from another."""
    model = tiny_model(0)
    idx = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    outs = {None: simulate_generate_cached(model, idx, 10)} | {b: simulate_generate_cached(model, idx, 10, b) for b in BUGS}
    for a, b in itertools.combinations(outs, 2):
        assert not torch.equal(outs[a], outs[b]), f"{a} and {b} give the same tokens"


def test_tiny_model_leaves_the_global_random_state_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    tiny_model(0)
    assert torch.equal(state, torch.get_rng_state())


def test_simulator_rejects_an_unknown_bug():
    with pytest.raises(ValueError, match="bug must be None or one of"):
        simulate_generate_cached(tiny_model(0), torch.zeros(1, 2, dtype=torch.long), 1, bug="typo")


def test_bytes_mistake_named_from_all_cases():
    """With 2-byte elements "keys only" and "elements" give one number; the first case (4-byte) tells them apart."""
    def elements(n_layer, n_kv_head, head_dim, seq_len, batch, bytes_per_elem):
        return 2 * n_layer * n_kv_head * head_dim * seq_len * batch

    with pytest.raises(ExerciseError, match="counted elements, not bytes"):
        check_kv_cache_bytes(elements)
