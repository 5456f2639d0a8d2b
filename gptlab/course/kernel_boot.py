"""Starts a learner's Jupyter kernel for the autograder: resource limits first, then ipykernel.

Where this sits: beside the pipeline, in the autograder (:mod:`gptlab.course.sandbox`). The
autograder runs this file as a script (``python .../kernel_boot.py --rlimit AS=... -- -f
CONNECTION_FILE``), inside the sandbox, in place of ``python -m ipykernel_launcher``. It imports
nothing of gptlab, so the limits hold before any learner code, or any import, runs:

* ``--rlimit NAME=VALUE``: ``resource.setrlimit(RLIMIT_NAME, (VALUE, VALUE))`` for every process the
  kernel is or starts (address space, processes, CPU seconds, file size, open files, core files);
* the kernel's working folder is taken off ``sys.path`` once IPython has put it there: a module the
  notebook writes beside itself cannot be imported by name (code that is not in the notebook).
"""

from __future__ import annotations

import os
import resource
import sys


def _set_limits(specs: list[str]) -> None:
    for spec in specs:
        name, _, value = spec.partition("=")
        which = getattr(resource, f"RLIMIT_{name}", None)
        if which is None:  # a limit this system does not have (RLIMIT_NPROC off Linux, ...)
            continue
        limit = int(value)
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(which, (limit, limit))


def main(argv: list[str]) -> None:
    """``argv``: ``--rlimit NAME=VALUE`` options, ``--``, then ipykernel's own arguments."""
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, kernel_args = argv[:cut], argv[cut + 1:]
    limits = [ours[i + 1] for i, a in enumerate(ours[:-1]) if a == "--rlimit"]
    _set_limits(limits)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]

    from ipykernel.kernelapp import IPKernelApp

    app = IPKernelApp.instance()
    app.initialize(kernel_args)
    cwd = os.path.abspath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != cwd]
    app.start()


if __name__ == "__main__":
    main(sys.argv[1:])
