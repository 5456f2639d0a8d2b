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

__all__ = ["GradedCell", "TASKS", "task_for", "hidden_seed"]


@dataclass(frozen=True)
class GradedCell:
    """One graded test cell: ``check(*learner_names, **kwargs)`` (the check of one task, or of a
    few together)."""

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


def _cells(module: Any, hidden: Callable[[int], dict] | None, *names: str, check: str | None = None) -> dict[str, GradedCell]:
    """The cells ``test_<name>`` of one assignment's tasks ``names``, each checked by
    ``module.check_<name>`` (or ``module.<check>``) on the learner's ``name``."""
    return {f"test_{n}": GradedCell(getattr(module, check or f"check_{n}"), (n,), hidden) for n in names}


TASKS: dict[str, dict[str, GradedCell]] = {
    "causal_mask": {
        **_cells(causal_mask, _mask_sizes, "causal_mask", "additive_mask"),
        **_cells(causal_mask, _attention_weights_sizes, "causal_attention_weights"),
        **_cells(causal_mask, _seed, "combine_masks"),
    },
    "lm_basics": {
        **_cells(lm_basics, None, "encode", "decode"),
        **_cells(lm_basics, _seed, "next_token_batch", "cross_entropy", "perplexity"),
    },
    "attention": {
        **_cells(attention, _seed, "attention_weights", "attend", "split_heads", "merge_heads"),
        **_cells(attention, _seed, "CausalSelfAttention", check="check_causal_self_attention"),
    },
    "blocks": _cells(blocks, _seed, "layer_norm", "gelu", "rms_norm", "apply_rope", "Block"),
    "gpt_training": {
        **_cells(gpt_training, _seed, "GPT", "count_params", "lr_at"),
        # the training is long: graded once, with the hidden seed (its probe is the quick first run)
        "test_train": GradedCell(gpt_training.check_train, ("train", "GPT")),
    },
    "kv_cache": {
        **_cells(kv_cache, _seed, "KVCache", check="check_kv_cache"),
        **_cells(kv_cache, _seed, "cached_attention_step", "generate_cached", "kv_cache_bytes"),
    },
    "sampling": _cells(sampling, _seed, "apply_temperature", "top_k_filter", "top_p_filter",
                       "apply_repetition_penalty", "sample_next", "beam_search"),
    "speculative": {
        **_cells(speculative, None, "accept_prob"),
        **_cells(speculative, _seed, "residual_distribution", "expected_tokens_per_pass", "speculative_step"),
    },
}


def task_for(notebook: str, grade_id: str) -> GradedCell | None:
    """The task of test cell ``grade_id`` in the assignment notebook ``notebook`` (None if unknown)."""
    return TASKS.get(notebook, {}).get(grade_id)


def hidden_seed(secret: bytes, notebook: str, grade_id: str) -> int:
    """The hidden run's seed: an HMAC of the cell's name under the instructor's secret (31 bits)."""
    digest = hmac.new(secret, f"{notebook}/{grade_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
