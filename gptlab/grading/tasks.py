"""The graded tasks as data: for each test cell of each assignment, the check, the learner's names it
takes, and the hidden inputs the autograder adds.

Where this sits: beside the pipeline, between the assignments' notebooks and the autograder
(:mod:`gptlab.course.execute`). A notebook's test cell shows the learner the check in their own
kernel (instant feedback); the grade comes from the autograder, which looks the cell up here by
its nbgrader ``grade_id`` and runs the same check in its own process, on the learner's functions
called through :mod:`gptlab.grading.remote`:

* once as the notebook shows it (the visible inputs), then
* once more with ``hidden(seed)``: inputs drawn from a seed that the instructor's secret and the
  cell's id decide (:func:`hidden_seed`), and sizes larger than any small fixed table (masks of
  37 and 64 tokens), so a table of the visible inputs' answers does not pass.

Every grade cell of ``solutions/`` has an entry here (``tests/test_trusted_grading.py`` checks it).
"""

from __future__ import annotations

import hashlib
import hmac
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import attention, blocks, causal_mask, gpt_training, kv_cache, lm_basics, sampling, speculative

__all__ = ["Task", "TASKS", "task_for", "hidden_seed"]


@dataclass(frozen=True)
class Task:
    """One graded test cell: ``check(*learner_names, **kwargs)``."""

    check: Callable[..., Any]
    names: tuple[str, ...]
    hidden: Callable[[int], dict] | None = None
    """seed -> keyword arguments of the hidden run (None: the visible run only)."""
    visible: dict = field(default_factory=dict)
    """keyword arguments of the visible run (as the notebook's test cell calls it)."""


def _seed(s: int) -> dict:
    return {"seed": s}


def _mask_sizes(s: int) -> dict:
    r = random.Random(s)
    return {"sizes": (37, 64, r.randint(9, 33), r.randint(2, 7))}


def _attention_weights_sizes(s: int) -> dict:
    r = random.Random(s)
    return {"sizes": (37, r.randint(9, 30)), "seed": s}


TASKS: dict[str, dict[str, Task]] = {
    "causal_mask": {
        "test_causal_mask": Task(causal_mask.check_causal_mask, ("causal_mask",), _mask_sizes),
        "test_additive_mask": Task(causal_mask.check_additive_mask, ("additive_mask",), _mask_sizes),
        "test_causal_attention_weights": Task(causal_mask.check_causal_attention_weights,
                                              ("causal_attention_weights",), _attention_weights_sizes),
        "test_combine_masks": Task(causal_mask.check_combine_masks, ("combine_masks",), _seed),
    },
    "lm_basics": {
        "test_encode": Task(lm_basics.check_encode, ("encode",)),
        "test_decode": Task(lm_basics.check_decode, ("decode",)),
        "test_next_token_batch": Task(lm_basics.check_next_token_batch, ("next_token_batch",), _seed),
        "test_cross_entropy": Task(lm_basics.check_cross_entropy, ("cross_entropy",), _seed),
        "test_perplexity": Task(lm_basics.check_perplexity, ("perplexity",), _seed),
    },
    "attention": {
        "test_attention_weights": Task(attention.check_attention_weights, ("attention_weights",), _seed),
        "test_attend": Task(attention.check_attend, ("attend",), _seed),
        "test_split_heads": Task(attention.check_split_heads, ("split_heads",), _seed),
        "test_merge_heads": Task(attention.check_merge_heads, ("merge_heads",), _seed),
        "test_CausalSelfAttention": Task(attention.check_causal_self_attention, ("CausalSelfAttention",), _seed),
    },
    "blocks": {
        "test_layer_norm": Task(blocks.check_layer_norm, ("layer_norm",), _seed),
        "test_gelu": Task(blocks.check_gelu, ("gelu",), _seed),
        "test_rms_norm": Task(blocks.check_rms_norm, ("rms_norm",), _seed),
        "test_apply_rope": Task(blocks.check_apply_rope, ("apply_rope",), _seed),
        "test_Block": Task(blocks.check_Block, ("Block",), _seed),
    },
    "gpt_training": {
        "test_GPT": Task(gpt_training.check_GPT, ("GPT",), _seed),
        "test_count_params": Task(gpt_training.check_count_params, ("count_params",), _seed),
        "test_lr_at": Task(gpt_training.check_lr_at, ("lr_at",), _seed),
        # the training is long: graded once, with the hidden seed (its probe is the quick first run)
        "test_train": Task(gpt_training.check_train, ("train", "GPT")),
    },
    "kv_cache": {
        "test_KVCache": Task(kv_cache.check_kv_cache, ("KVCache",), _seed),
        "test_cached_attention_step": Task(kv_cache.check_cached_attention_step, ("cached_attention_step",), _seed),
        "test_generate_cached": Task(kv_cache.check_generate_cached, ("generate_cached",), _seed),
        "test_kv_cache_bytes": Task(kv_cache.check_kv_cache_bytes, ("kv_cache_bytes",), _seed),
    },
    "sampling": {
        "test_apply_temperature": Task(sampling.check_apply_temperature, ("apply_temperature",), _seed),
        "test_top_k_filter": Task(sampling.check_top_k_filter, ("top_k_filter",), _seed),
        "test_top_p_filter": Task(sampling.check_top_p_filter, ("top_p_filter",), _seed),
        "test_apply_repetition_penalty": Task(sampling.check_apply_repetition_penalty,
                                              ("apply_repetition_penalty",), _seed),
        "test_sample_next": Task(sampling.check_sample_next, ("sample_next",), _seed),
        "test_beam_search": Task(sampling.check_beam_search, ("beam_search",), _seed),
    },
    "speculative": {
        "test_accept_prob": Task(speculative.check_accept_prob, ("accept_prob",)),
        "test_residual_distribution": Task(speculative.check_residual_distribution, ("residual_distribution",), _seed),
        "test_expected_tokens_per_pass": Task(speculative.check_expected_tokens_per_pass,
                                              ("expected_tokens_per_pass",), _seed),
        "test_speculative_step": Task(speculative.check_speculative_step, ("speculative_step",), _seed),
    },
}


def task_for(notebook: str, grade_id: str) -> Task | None:
    """The task of test cell ``grade_id`` in the assignment notebook ``notebook`` (None if unknown)."""
    return TASKS.get(notebook, {}).get(grade_id)


def hidden_seed(secret: bytes, notebook: str, grade_id: str) -> int:
    """The hidden run's seed: an HMAC of the cell's name under the instructor's secret (31 bits)."""
    digest = hmac.new(secret, f"{notebook}/{grade_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
