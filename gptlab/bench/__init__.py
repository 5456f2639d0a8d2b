"""Benchmarks: ``python -m gptlab bench {train,generate,speculative,autograde}``.

Speed and memory targets live here, not in timed unit tests. Every benchmark prints measured
absolute figures and ratios together with :func:`machine_name`, and can write them as JSON.
Each benchmark is a module of this package exposing ``run(args)``; its arguments are defined in
:mod:`gptlab.cli`.
"""

from __future__ import annotations

import os

import torch

from ..device import cpu_model

__all__ = ["machine_name"]


def machine_name() -> str:
    """A human-readable description of the machine: CPU model and core count, GPU if any."""
    cpu = cpu_model()
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        desc = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}); host: {desc}"
    return desc
