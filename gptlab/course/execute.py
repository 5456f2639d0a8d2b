"""The autograder's notebook runner: per-cell time limits, and a run that survives a dead kernel.

Where this sits: beside the pipeline, in the instructor's workflow (``python -m gptlab course``).
``nbgrader_config.py`` puts :class:`GptlabExecute` in place of nbgrader's ``Execute`` in
``nbgrader autograde``, so the same rules hold whether the instructor runs ``nbgrader autograde``
or ``python -m gptlab course autograde``:

* **Time limits per cell.** Every cell gets ``Execute.timeout`` seconds (30 in
  ``nbgrader_config.py``). A cell that needs longer (the graded training of a training
  assignment) declares it in its metadata, ``{"gptlab": {"timeout": 600}}``; only cells with an
  nbgrader ``grade_id`` may declare one, and it is capped at ``GptlabExecute.max_timeout``.
  ``course autograde`` also resets that metadata from the instructor's notebook before the run,
  so a learner cannot lengthen a limit.
* **A cell past its limit** is interrupted (``KeyboardInterrupt`` in the kernel), gets a
  ``CellTimeoutError`` output saying so, and the notebook goes on with the next cell: only the
  tasks that depend on that cell are lost.
* **A kernel that dies** (``os._exit``, a segfault, out of memory) or no longer answers after an
  interrupt is restarted; the cells that had run fine before are run again, silently, to rebuild
  the learner's definitions, and the notebook goes on after the cell that killed it. That cell
  gets a ``DeadKernelError`` output. After ``max_kernel_restarts`` restarts, the remaining
  cells are not run (each gets a ``NotRun`` output), so a run always ends in bounded time.
"""

from __future__ import annotations

import copy
import subprocess

from jupyter_core.utils import run_sync
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat.notebooknode import NotebookNode
from nbgrader.preprocessors import Execute
from traitlets import Integer

__all__ = ["GptlabExecute", "declared_timeout", "TIMEOUT_KEY"]

TIMEOUT_KEY = "gptlab"
"""Cell metadata key: ``cell.metadata["gptlab"]["timeout"]`` is the cell's own time limit in seconds."""


def declared_timeout(cell: NotebookNode) -> int | None:
    """The time limit (seconds) a cell declares in ``metadata.gptlab.timeout``, or ``None``.

    Only cells that carry an nbgrader ``grade_id`` (solution or test cells, whose metadata the
    instructor wrote) may declare one; any other cell, or a value that is not a positive number,
    gives ``None``.
    """
    meta = cell.get("metadata", {})
    if not meta.get("nbgrader", {}).get("grade_id"):
        return None
    value = meta.get(TIMEOUT_KEY, {}).get("timeout") if isinstance(meta.get(TIMEOUT_KEY), dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return int(value)


def _error(ename: str, evalue: str) -> NotebookNode:
    return NotebookNode(
        output_type="error", ename=ename, evalue=evalue, traceback=[f"\x1b[0;31m{ename}\x1b[0m: {evalue}"]
    )


class GptlabExecute(Execute):
    """nbgrader's ``Execute`` with per-cell time limits and recovery from a dead kernel."""

    max_timeout = Integer(1800, help="Upper bound (s) on a time limit declared in a cell's metadata.").tag(
        config=True
    )
    max_kernel_restarts = Integer(
        3, help="Kernel restarts allowed per notebook; after that the remaining cells are not run."
    ).tag(config=True)

    # -- time limits ---------------------------------------------------------------------------

    def _get_timeout(self, cell: NotebookNode | None) -> int | None:
        timeout = self.timeout
        if cell is not None:
            declared = declared_timeout(cell)
            if declared is not None:
                timeout = min(declared, self.max_timeout)
        if not timeout or timeout < 0:
            return None
        return timeout

    async def _async_handle_timeout(self, timeout: int, cell: NotebookNode | None = None):
        self._timed_out = True
        reply = await super()._async_handle_timeout(timeout, cell)
        if reply is not None:  # interrupt_on_timeout: nbgrader's generic reply, made specific
            msg = (
                f"this cell was stopped after {timeout} s, its time limit (an endless loop, or code far "
                "too slow?). The cells after it still ran."
            )
            reply["content"] = {**reply["content"], "ename": "CellTimeoutError", "evalue": msg,
                                "traceback": [f"\x1b[0;31mCellTimeoutError\x1b[0m: {msg}"]}
        return reply

    async def async_start_new_kernel(self, **kwargs):
        # The kernel's own stderr (ipykernel's start-up warnings, C-level messages) would be
        # interleaved from every worker on the instructor's terminal; learners' output goes
        # through the notebook's outputs, not there.
        kwargs.setdefault("stderr", subprocess.DEVNULL)
        return await super().async_start_new_kernel(**kwargs)

    start_new_kernel = run_sync(async_start_new_kernel)

    # -- running cells -------------------------------------------------------------------------

    def preprocess(self, nb, resources=None, km=None):
        self._ran_ok: list[int] = []  # cells to run again after a kernel restart
        self._restarts = 0
        return super().preprocess(nb, resources, km)

    def preprocess_cell(self, cell, resources, index):
        self._check_assign_resources(resources)
        if cell.cell_type != "code" or not cell.source.strip():
            return cell, self.resources
        if self._restarts > self.max_kernel_restarts:
            cell.outputs = [_error("NotRun", f"not run: the kernel died {self._restarts} times in this notebook.")]
            return cell, self.resources
        self._timed_out = False
        try:
            self.execute_cell(cell, index, store_history=True)
        except DeadKernelError:
            cell.outputs = list(cell.get("outputs", [])) + [_error(
                "DeadKernelError",
                "the Python kernel died while running this cell (os._exit, a crash in compiled code, or out "
                "of memory?). It was restarted and the cells after this one still ran.",
            )]
            self._restart_kernel()
        except CellTimeoutError:  # the kernel did not answer even after the interrupt
            cell.outputs = list(cell.get("outputs", [])) + [_error(
                "CellTimeoutError",
                f"this cell was stopped after {self._get_timeout(cell)} s, its time limit, and the kernel no "
                "longer answered: it was restarted and the cells after this one still ran.",
            )]
            self._restart_kernel()
        else:
            if not self._timed_out:
                self._ran_ok.append(index)
        return cell, self.resources

    def _restart_kernel(self) -> None:
        """A fresh kernel, with the cells that had run fine run again (their outputs discarded)."""
        while True:
            self._restarts += 1
            if self._restarts > self.max_kernel_restarts:
                return
            self.log.warning("Restarting the kernel (restart %d)", self._restarts)
            try:
                self._cleanup_kernel()
            except Exception:  # the old kernel is dead already: nothing to clean
                pass
            self.km, self.kc = None, None
            self.km = self.create_kernel_manager()
            self.start_new_kernel()
            self.start_new_kernel_client()
            try:
                for i in self._ran_ok:
                    self.execute_cell(copy.deepcopy(self.nb.cells[i]), i, store_history=False)
                return
            except (DeadKernelError, CellTimeoutError):
                self.log.warning("The kernel died again while re-running the earlier cells")
