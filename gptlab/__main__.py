"""Command line: ``python -m gptlab {fetch,train,sample,bench} ...`` (each with ``--help``).

Each module that owns a command registers it here through a ``register_cli(subparsers)``
function, so the command's options live beside the code they drive.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, subcommand) pairs; a module's register_cli adds its subparser and sets `func`.
_COMMANDS = [
    ("gptlab.data", "fetch"),
    ("gptlab.train", "train"),
    ("gptlab.generation", "sample"),
    ("gptlab.bench", "bench"),
    ("gptlab.course", "course"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gptlab",
        description="gptlab: build, train and sample from a GPT-style language model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, _name in _COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # fail loudly: a command must not silently disappear
            raise ImportError(f"python -m gptlab {_name}: its module {module} failed to import: {e}") from e
        if hasattr(mod, "register_cli"):
            mod.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
