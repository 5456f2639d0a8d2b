"""Speed-ups swapped into a model from outside, never part of its definition.

The teaching modules (:mod:`gptlab.layers`, :mod:`gptlab.attention`, :mod:`gptlab.model`, ...)
build the model from plain PyTorch layers and never import this package (``tests/test_imports.py``
says so). What is here replaces some of a model's modules with faster equivalents for the length of
one job and puts the originals back after, the pattern of gpt-fast's ``quantize.py``:

* :mod:`gptlab.fast.cpu`: batch-1 decoding on a CPU, each ``nn.Linear`` worth it swapped for a
  :class:`~gptlab.fast.cpu.PackedLinear` (:func:`~gptlab.fast.cpu.pack_for_decoding`), chosen by
  timing both products on this CPU (:func:`~gptlab.fast.cpu.calibrate`). :func:`gptlab.generate`,
  :func:`gptlab.stream`, :func:`gptlab.beam_search` and :func:`gptlab.speculative_generate` use it
  with ``fast=True``.
* :mod:`gptlab.fast.native`: the batch-1 one-token decode step in C++ (``decode_step.cpp``), the
  same operations as the model's Python step without Python between them, or, where its own
  one-vector product is faster on this machine, a fused step equal to it up to rounding; built once per machine
  (``python -m gptlab build-native``), then used by the same four decoders with ``fast=True``.
* :mod:`gptlab.fast.compiled`: the model's own decode step through ``torch.compile``
  (:func:`~gptlab.fast.compiled.compiled_decode`), the GPU's fast path; the same four decoders use
  it with ``compile=True``.
"""

from .cpu import PackedLinear, Plan, calibrate, decode_plan, last_plan, pack_for_decoding, packed_layers

__all__ = ["PackedLinear", "Plan", "calibrate", "decode_plan", "last_plan", "pack_for_decoding", "packed_layers"]
