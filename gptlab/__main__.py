"""Command line: ``python -m gptlab {fetch,train,sample,bench} ...`` (each with ``--help``).

Each module that owns a command registers it here through a ``register_cli(subparsers)``
function, so the command's options live beside the code they drive.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys

# (module, subcommand) pairs; a module's register_cli adds its subparser and sets `func`.
_COMMANDS = [
    ("gptlab.data", "fetch"),
    ("gptlab.train.cli", "train"),
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


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest (sub)parser the command line chose: ``bench`` for ``python -m gptlab bench``,
    so that a command given without its subcommand prints its own usage, not the top level's."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def _disk_error(e: OSError) -> str | None:
    """One line naming the cause and the fix of a file-system error no command can do better
    about (a full disk, a read-only file system, a permission denied); None for any other error."""
    on = f" ({e.filename})" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device{on}: free some disk space, or write to another disk"
    if e.errno == errno.EROFS:
        return f"read-only file system{on}: write to another folder"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied{on}: use a file or folder you may write to, or change its permissions"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):  # no command, or a command without its subcommand
        _chosen_parser(parser, args).print_help()
        return 2
    from .assets import AssetError

    prog = f"{parser.prog} {args.command}"
    try:
        return int(args.func(args) or 0)
    except AssetError as e:  # the data could not be fetched: the message says why, route by route
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        line = _disk_error(e)
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
