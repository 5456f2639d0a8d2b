"""``python -m gptlab COMMAND``: runs :func:`gptlab.cli.main` (every command's arguments are in
:mod:`gptlab.cli`)."""

from __future__ import annotations

import sys

from .cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
