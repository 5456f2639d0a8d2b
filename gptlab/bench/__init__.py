"""Benchmarks: ``python -m gptlab bench {train,generate,speculative,autograde}``.

Speed and memory targets live here, not in timed unit tests. Every benchmark prints measured
absolute figures and ratios together with :func:`machine_name`, and can write them as JSON.
Each benchmark is a module of this package exposing ``run(args)``; its arguments are defined in
:mod:`gptlab.cli`.
"""

from __future__ import annotations

import os
import sys

import torch

from ..device import cpu_model
from ..fast import native

__all__ = ["machine_name", "cpu_settings", "native_build", "error"]


def error(bench: str, message: str) -> None:
    """Say on stderr, in one line and with the prefix every command's errors have
    (``python -m gptlab bench NAME: error: ...``), why the benchmark ``bench`` stops."""
    print(f"python -m gptlab bench {bench}: error: {message}", file=sys.stderr)


def cpu_settings() -> dict:
    """What picks the CPU kernels, and so the last digits of a float and the speed: the
    ``MKL_CBWR`` and ``ATEN_CPU_CAPABILITY`` environment variables as set (None: unset) and the
    vector instruction set PyTorch runs (``torch.backends.cpu.get_cpu_capability()``)."""
    return {"MKL_CBWR": os.environ.get("MKL_CBWR"), "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def machine_name() -> str:
    """A human-readable description of the machine: CPU model and core count, GPU if any."""
    cpu = cpu_model()
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        desc = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}); host: {desc}"
    return desc


def native_build(skip: bool) -> float | None:
    """Build the C++ decode step unless ``skip`` (``--no-native``) or built already; the seconds the
    build took (None: no build now). Printed; a machine that cannot build it runs the Python step."""
    if skip:
        print("C++ decode step: not built now (--no-native); decoding uses it only where it was built before")
        return None
    try:
        seconds = native.build()
    except native.NativeBuildError as e:
        print(f"C++ decode step: {e}; decoding runs the Python step")
        return None
    print(f"C++ decode step: {'already built' if seconds == 0 else f'built in {seconds:.1f} s'} ({native.build_dir()})")
    return seconds or None
