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


def _parent(pid: str) -> str | None:
    try:
        stat = (Path("/proc") / pid / "stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[1]  # the field after the state, past the command's parentheses


def of_another_test_worker(pid: str, envs: dict[str, bytes]) -> bool:
    """Whether ``pid`` belongs to another pytest-xdist worker: the nearest process up its chain of
    parents that names a worker (``PYTEST_XDIST_WORKER``, inherited by every process a test starts;
    a sandbox clears it for what runs inside, so the sandbox's bwrap answers for those) names
    another one. An orphan, or any process when the tests run in one process, counts as ours."""
    mine = os.environ.get("PYTEST_XDIST_WORKER")
    if not mine:
        return False
    seen = set()
    while pid and pid not in seen and pid != "0":
        seen.add(pid)
        for item in envs.get(pid, b"").split(b"\0"):
            if item.startswith(b"PYTEST_XDIST_WORKER="):
                return item.split(b"=", 1)[1].decode() != mine
        pid = _parent(pid)
    return False
