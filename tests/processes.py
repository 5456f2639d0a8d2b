"""The machine's processes as the tests that look for survivors read them (Linux ``/proc``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def command_lines() -> Iterator[tuple[str, str, bytes]]:
    """``(pid, command line, environment bytes)`` of every process this user may read."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (Path("/proc") / pid / "environ").read_bytes()
        except OSError:
            continue
        yield pid, cmd, env
