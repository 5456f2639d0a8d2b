"""Ctrl-C (SIGINT) and SIGTERM while training: stop at the end of the step, save, raise.

Where this sits: beside the training loop (:meth:`gptlab.train.loop.Trainer.fit`), which installs
:class:`StopSignals` while it runs. A first signal only asks to stop: the loop finishes its step,
saves a checkpoint there and raises :func:`interruption`'s :class:`TrainingInterrupted` (resuming
from it continues exactly as the run would have); a second one stops at once, saving nothing more.
Under DDP every process stops at the same step, the first at which any of them was signalled
(asked every ``log_interval`` steps).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .distributed import DistInfo, all_sum_

__all__ = ["TrainingInterrupted", "StopSignals", "interruption"]


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on SIGINT (Ctrl-C) or SIGTERM.

    ``signum``: the signal; ``step``: the step reached; ``checkpoint``: the folder saved at that
    step (None if nothing was saved); ``exit_code``: 128 + signum, what the command line returns.
    """

    def __init__(self, message: str, *, signum: int, step: int, checkpoint: Path | None):
        super().__init__(message)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + int(signum)


class StopSignals:
    """The signals a run answers: ``installed()`` while training, ``requested(step)`` between steps.

    ``step``: the loop's step now (for the message of a second signal).
    """

    def __init__(self, step: Callable[[], int], dist: DistInfo, device: torch.device):
        self.step, self.dist, self.device = step, dist, device
        self.received: int | None = None  # SIGINT / SIGTERM received during fit

    @property
    def signum(self) -> int:
        """The signal that asked to stop (SIGINT when another process's did)."""
        return int(self.received or signal.SIGINT)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While training: SIGINT and SIGTERM ask to stop after the current step (a second one stops
        at once). Only in the main thread (Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.received = None

        def handler(signum: int, frame: Any) -> None:
            if self.received is not None:
                step = self.step()
                raise TrainingInterrupted(
                    f"training stopped at once by a second {signal.Signals(signum).name} at step {step}; "
                    f"nothing saved since the last checkpoint", signum=signum, step=step, checkpoint=None)
            self.received = signum

        sigs = (signal.SIGINT, signal.SIGTERM)
        before = {s: signal.getsignal(s) for s in sigs}
        for s in sigs:
            signal.signal(s, handler)
        try:
            yield
        finally:
            for s, h in before.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)

    def requested(self, step: int, log_interval: int) -> bool:
        """Whether a signal asked to stop. Under DDP: any process's, so that all stop at the same
        step, asked every ``log_interval`` steps only (the exchange waits for the GPU)."""
        flag = self.received is not None
        if self.dist.enabled:
            if step % log_interval:
                return False
            t = torch.tensor(float(flag), device=self.device)
            flag = bool(all_sum_(t, self.dist).item() > 0)
            if flag and self.received is None:
                self.received = int(signal.SIGINT)
        return flag


def interruption(signum: int, step: int, out_dir: Path, checkpoint: Path | None, *,
                 before_first_step: bool = False) -> TrainingInterrupted:
    """The :class:`TrainingInterrupted` to raise at ``step``, saying where and how to resume:
    ``checkpoint`` the folder saved there (None: nothing saved, ``save=False``), or nothing
    trained over a replaced run (``before_first_step``: the earlier run is put back)."""
    name = signal.Signals(signum).name
    if before_first_step:
        message = (f"training stopped by {name} before its first step; nothing saved, and the earlier run of "
                   f"{out_dir} (if any) is put back")
    elif checkpoint is None:
        message = f"training stopped by {name} at step {step}; nothing saved (save=False)"
    else:
        message = (f"training stopped by {name} at step {step}: checkpoint saved in {checkpoint}; resume with "
                   f"train(cfg, {str(out_dir)!r}, resume=True)")
    return TrainingInterrupted(message, signum=signum, step=step, checkpoint=checkpoint)
