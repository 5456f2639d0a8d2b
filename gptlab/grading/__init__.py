"""Checks for the graded exercises: compare a learner's function with gptlab's and say what the
mistake most likely is.

Where this sits: beside the pipeline (text -> tokens -> batches -> model -> logits -> loss or
samples -> text). Each assignment notebook (``solutions/`` for instructors, ``exercises/`` for
learners, see ``nbgrader_config.py``) asks the learner to write pieces of that pipeline by hand;
its autograded test cells call the checks of one module here, named after the assignment
(``gptlab.grading.causal_mask``, ...). They are all built from the framework in
:mod:`gptlab.grading.core`, so the diagnosis logic lives in one tested place instead of being
copied into every notebook.

A check returns ``None`` when the learner's function agrees with the reference, and otherwise
raises :class:`ExerciseError` (an ``AssertionError``, so nbgrader counts the test cell as failed)
whose message names the input, what was expected, what came, and the most likely mistake.
"""

from .causal_mask import __all__ as _causal_mask_names
from .causal_mask import (
    check_additive_mask,
    check_causal_attention_weights,
    check_causal_mask,
    check_combine_masks,
    diagnose_mask,
    reference_causal_attention_weights,
)
from .core import DelegationError, ExerciseError

__all__ = ["ExerciseError", "DelegationError", *_causal_mask_names]
