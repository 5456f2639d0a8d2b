"""Benchmarks: ``python -m gptlab bench {train,generate,speculative,autograde}``.

Speed and memory targets live here, not in timed unit tests. Every benchmark prints measured
absolute figures and ratios together with :func:`machine_name`, and can write them as JSON.
Each benchmark is a module of this package exposing ``add_arguments(parser)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import importlib
import os

__all__ = ["machine_name", "register_cli"]

_BENCHMARKS = {
    "train": "gptlab.bench.train",
    "generate": "gptlab.bench.generate",
    "speculative": "gptlab.bench.speculative",
    "autograde": "gptlab.bench.autograde",
}


def machine_name() -> str:
    """A human-readable description of the machine: CPU model and core count, GPU if any."""
    import torch

    from ..device import cpu_model

    cpu = cpu_model()
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        desc = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}); host: {desc}"
    return desc


class _DefaultsFormatter(argparse.HelpFormatter):
    """Adds ``(default: X)`` to an option's help once: not where the help already states its
    default (``ArgumentDefaultsHelpFormatter`` printed ``(default: see above) (default: None)``),
    and not for a default that says nothing (None, False, an empty string)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default == ""
                or default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark (train, generate, speculative, autograde)")
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name, module in _BENCHMARKS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # a broken benchmark is an error, never a silently missing command
            raise ImportError(f"python -m gptlab bench {name}: its module {module} failed to import: {e}") from e
        bp = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0] if mod.__doc__ else None,
                            formatter_class=_DefaultsFormatter)
        mod.add_arguments(bp)
        bp.set_defaults(func=mod.run)
