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
* **Test cells are not run in the kernel.** For every test cell that :data:`gptlab.grading.tasks.
  TASKS` knows, the verdict comes from this process (:class:`gptlab.course.trusted.TrustedGrader`):
  the kernel only runs a short server (:func:`gptlab.grading.remote.serve`) that calls the
  learner's functions on the inputs sent to it and answers with plain data. The cell's outputs are
  the verdict (an error output when the test failed: nbgrader scores it 0), so nothing the learner's
  code prints, hooks or patches in the kernel can change a grade. A function stopped at its time
  limit is remembered: later tests whose answers call it fail at once with the same note.
* **Shell escapes are not run**: ``!cmd`` and the magics that run programs or write files
  (``%%bash``, ``%%writefile``, ``%run``, ...) in the learner's cells become comments.
* **The kernel runs in a sandbox** (:mod:`gptlab.course.sandbox`, ``GptlabExecute.sandbox``, on by
  default): bubblewrap, a private folder holding only the notebook, no network, its own PID
  namespace, resource limits, and the assignment's copy of gptlab without the references its
  checks forbid. The kernel talks to this process over Unix sockets only (``ipc`` transport).
* **Output is capped**: a cell's outputs past ``max_output_bytes`` (1 MB) are dropped, with a
  note saying so, so one cell printing without end cannot fill the autograder's memory or the
  graded notebook.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from jupyter_core.utils import run_sync
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat.notebooknode import NotebookNode
from nbgrader.preprocessors import Execute
from traitlets import Bool, Float, Integer

from ..grading import remote
from ..grading.source import neutralise_shell
from ..notebook_setup import is_setup_source
from . import sandbox as _sandbox
from .trusted import TrustedGrader, Verdict

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
    sandbox = Bool(True, help="Run every kernel in the operating-system sandbox (gptlab.course.sandbox); "
                              "False only where none can start (course autograde --no-sandbox).").tag(config=True)
    sandbox_memory_gb = Float(8.0, help="Address space (GB) of each process in the sandbox.").tag(config=True)
    max_output_bytes = Integer(1 << 20, help="Output kept per cell (bytes of text); the rest is dropped with a "
                                             "note.").tag(config=True)


    # -- the sandbox ---------------------------------------------------------------------------

    def _sandbox_start(self, nb, resources) -> None:
        """The kernel's private folders and the assignment's copy of gptlab (one per notebook run)."""
        res = resources or {}
        notebook = (res.get("nbgrader") or {}).get("notebook") or ""
        self._runtime = tempfile.mkdtemp(prefix="gl-")  # short: Unix socket paths are limited to 107 bytes
        self._workdir = tempfile.mkdtemp(prefix="gl-nb-")
        os.chmod(self._runtime, 0o700)
        source = ((res.get("metadata") or {}).get("path")) or ""
        mine = os.path.join(source, f"{notebook}.ipynb") if notebook and source else ""
        if mine and os.path.isfile(mine):  # the notebook, and nothing else, beside the kernel
            shutil.copyfile(mine, os.path.join(self._workdir, os.path.basename(mine)))
        self._kernels = 0
        # the package the kernel imports: without the references of a known assignment, the graders
        # stubbed for any notebook (the kernel's own start-up script is in it)
        self._view = _sandbox.package_view(notebook or "notebook")
        if self.sandbox:
            why = _sandbox.unavailable()
            if why:
                raise RuntimeError(_sandbox.REFUSAL.format(why=why))

    def _sandbox_end(self) -> None:
        for folder in (getattr(self, "_runtime", None), getattr(self, "_workdir", None)):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)

    def create_kernel_manager(self):
        # always gptlab's manager (nbclient's own default would start the kernel unconfined)
        self.kernel_manager_class = _sandbox.SandboxKernelManager
        km = super().create_kernel_manager()
        if not isinstance(km, _sandbox.SandboxKernelManager):
            raise RuntimeError(f"the autograder's kernel manager is {type(km).__name__}, not gptlab's sandbox")
        if getattr(self, "_runtime", None):
            from ..assets import cache_dir

            self._kernels += 1
            km.transport = "ipc"
            km.ip = os.path.join(self._runtime, f"k{self._kernels}")
            km.connection_file = os.path.join(self._runtime, f"kernel-{self._kernels}.json")
            cache = cache_dir()
            mine = sorted(Path(self._workdir).glob("*.ipynb"))
            km.gptlab_spec = {"workdir": Path(self._workdir), "runtime": Path(self._runtime),
                              "notebook": mine[0] if mine else None,
                              "view": self._view, "sandbox": bool(self.sandbox),
                              "limits": _sandbox.Limits(memory_gb=self.sandbox_memory_gb),
                              "cache": cache if cache.is_dir() else None}
        return km

    # -- output ------------------------------------------------------------------------------

    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content") or {}
        size = len(content.get("text") or "") + sum(
            len(v) if isinstance(v, str) else 0 for v in (content.get("data") or {}).values())
        used = self._output_used.get(cell_index, 0) if hasattr(self, "_output_used") else 0
        cap = self.max_output_bytes
        if used + size <= cap:
            if hasattr(self, "_output_used"):
                self._output_used[cell_index] = used + size
            return super().output(outs, msg, display_id, cell_index)
        if used > cap:  # already noted
            return None
        self._output_used[cell_index] = cap + 1
        room = max(0, cap - used)
        if msg.get("msg_type") == "stream" and room:
            msg = {**msg, "content": {**content, "text": content.get("text", "")[:room]}}
            super().output(outs, msg, display_id, cell_index)
        outs.append(NotebookNode(output_type="stream", name="stderr", text=(
            f"\n[the autograder kept the first {cap // 1024} KB of this cell's output and dropped the rest]\n")))
        return None

    # -- time limits ---------------------------------------------------------------------------

    def _get_timeout(self, cell: NotebookNode | None) -> int | None:
        timeout = self.timeout
        if cell is not None and isinstance(cell.get("metadata", {}).get("gptlab_serve"), int):
            return cell.metadata["gptlab_serve"]  # the autograder's own serving cell (_grade_trusted)
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
        # through the notebook's outputs, not there. The kernel does not learn where the grading
        # secret is kept.
        kwargs.setdefault("stderr", subprocess.DEVNULL)
        kwargs.setdefault("stdout", subprocess.DEVNULL)
        from .secret import ENV

        # nor prints the C++ decode step's build hint into a learner's graded output
        kwargs.setdefault("env", {**{k: v for k, v in os.environ.items() if k != ENV}, "GPTLAB_NATIVE_HINT": "0"})
        if getattr(self, "_workdir", None):
            kwargs["cwd"] = self._workdir
        return await super().async_start_new_kernel(**kwargs)

    start_new_kernel = run_sync(async_start_new_kernel)

    # -- running cells -------------------------------------------------------------------------

    def preprocess(self, nb, resources=None, km=None):
        self._ran_ok: list[int] = []  # cells to run again after a kernel restart
        self._restarts = 0
        self._trusted = None
        self._output_used: dict[int, int] = {}
        self._sandbox_start(nb, resources)
        try:
            return self._preprocess(nb, resources, km)
        finally:
            self._sandbox_end()

    def _preprocess(self, nb, resources=None, km=None):
        notebook = ((resources or {}).get("nbgrader") or {}).get("notebook")
        if notebook:
            from .secret import load_secret

            self._trusted = TrustedGrader(nb.cells, notebook, load_secret())
        for cell in nb.cells:  # the learner's shell escapes are not run, nor the Colab set-up cell
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if cell.cell_type == "code" and is_setup_source(cell.source):
                cell.source = "# (the Colab set-up cell: not run by the autograder)"
            elif cell.cell_type == "code" and not meta.get("locked") and not meta.get("grade"):
                cell.source, _ = neutralise_shell(cell.source)
        return super().preprocess(nb, resources, km)

    def preprocess_cell(self, cell, resources, index):
        self._check_assign_resources(resources)
        if cell.cell_type != "code" or not cell.source.strip():
            return cell, self.resources
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") and self._trusted is not None and self._trusted.knows(meta.get("grade_id")):
            self._grade_trusted(cell, index, meta["grade_id"])
            return cell, self.resources
        skipped = self._calls_hung(cell)
        if skipped:
            cell.outputs = [_error("NotRun", f"not run by the autograder: it calls {skipped}, which was stopped at "
                                             "its time limit in a test above.")]
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

    def _calls_hung(self, cell: NotebookNode) -> str | None:
        """The learner's function, stopped at its limit in a test, that this learner cell calls
        (at its top level, directly or through other functions), or None."""
        if self._trusted is None or not self._trusted.hung:
            return None
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("locked") or meta.get("grade"):
            return None
        import ast

        from ..grading.source import Program, bound_names

        parsed = Program([(0, cell.source, True)]).cells
        if not parsed:
            return None
        used = {n.id for stmt in parsed[0].tree.body
                if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                for n in ast.walk(stmt) if isinstance(n, ast.Name)}
        reached = {name for _, node in self._trusted.program.reachable(sorted(used)) for name in bound_names(node)} | used
        hit = sorted(reached & set(self._trusted.hung))
        return hit[0] if hit else None

    # -- test cells: the verdict from this process ------------------------------------------------

    def _grade_trusted(self, cell: NotebookNode, index: int, grade_id: str) -> None:
        """Grade one test cell with :class:`TrustedGrader`, the kernel serving calls meanwhile."""
        limit = self._get_timeout(cell) or 30
        started = time.perf_counter()
        runtime = getattr(self, "_runtime", None)
        folder = tempfile.mkdtemp(prefix="s", dir=runtime) if runtime else tempfile.mkdtemp(prefix="gl-")
        os.chmod(folder, 0o755)
        address = os.path.join(folder, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(1)
        token = os.urandom(16).hex()
        wanted, done = threading.Event(), threading.Event()
        result: dict = {}

        def connect() -> remote.Connection:
            wanted.set()
            sock = remote.accept(listener, token, time.monotonic() + 60)
            conn = remote.Connection(sock, deadline=time.monotonic() + limit, limit_s=limit)
            result["conn"] = conn
            return conn

        def run() -> None:
            try:
                result["verdict"] = self._trusted.grade(grade_id, connect)
            except BaseException as e:  # noqa: BLE001 - a grader failure scores 0 with a note, never a crash
                result["verdict"] = Verdict(False, f"the autograder could not run this test ({type(e).__name__}: "
                                                   f"{e}); ask your instructor.", "grader_error")
            finally:
                done.set()
                wanted.set()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        wanted.wait()
        if not done.is_set():
            serve = NotebookNode(cell_type="code", outputs=[], execution_count=None, source=(
                f"__import__('gptlab.grading.remote', fromlist=['serve']).serve({address!r}, {token!r}, globals())"),
                metadata=NotebookNode(gptlab_serve=int(limit) + 20))
            serving = threading.Event()
            serving.set()
            watcher = threading.Thread(target=self._interrupt_on_timeout, args=(result, done, serving), daemon=True)
            watcher.start()
            try:
                self.execute_cell(serve, index, store_history=False)
            except (DeadKernelError, CellTimeoutError):
                serving.clear()
                self._restart_kernel()
            except Exception as e:  # noqa: BLE001 - the runner must go on with the next cells
                serving.clear()
                self.log.warning("serving test cell %s failed: %s", grade_id, e)
            finally:
                serving.clear()
                self.nb.cells[index] = cell
        thread.join(limit + 60)
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)
        verdict = result.get("verdict") or Verdict(False, "the autograder did not finish this test; ask your "
                                                          "instructor.", "grader_error")
        self._show_verdict(cell, verdict, time.perf_counter() - started)

    def _interrupt_on_timeout(self, result: dict, done: threading.Event, serving: threading.Event) -> None:
        """Interrupt the kernel as soon as the grader gave up waiting for the learner's function
        (only while the kernel still runs the serving cell, never a later cell)."""
        while serving.is_set():
            conn = result.get("conn")
            if conn is not None and isinstance(conn.failure, remote.LearnerTimeout):
                break
            time.sleep(0.2)
        conn = result.get("conn")
        if not serving.is_set() or conn is None or not isinstance(conn.failure, remote.LearnerTimeout):
            return
        try:
            if hasattr(self.km, "interrupt_now"):
                self.km.interrupt_now()
            else:
                os.kill(self.km.provisioner.process.pid, signal.SIGINT)
        except Exception:  # noqa: BLE001 - the cell's own time limit interrupts it then
            pass

    @staticmethod
    def _show_verdict(cell: NotebookNode, verdict: Verdict, seconds: float | None = None) -> None:
        outputs = []
        if verdict.output:
            text = "\n".join(verdict.output)
            outputs.append(NotebookNode(output_type="stream", name="stdout", text=(
                "While it was checked, your code printed (shown only, never scored):\n" + text[:4000] + "\n")))
        if verdict.passed:
            outputs.append(NotebookNode(output_type="stream", name="stdout", text=verdict.message + "\n"))
        else:
            outputs.append(_error(verdict.ename, verdict.message))
        if verdict.review:
            outputs.append(NotebookNode(output_type="stream", name="stdout", text=(
                "Flagged for your instructor's review (this score is not final): your notebook holds code that "
                "could switch off the grader's check of which functions your answer calls:\n"
                + "\n".join("  " + line for line in verdict.review) + "\n")))
        cell.outputs = outputs
        cell.execution_count = None
        cell.metadata.setdefault(TIMEOUT_KEY, {})
        cell.metadata[TIMEOUT_KEY] = {**cell.metadata[TIMEOUT_KEY], "verdict": {
            "passed": verdict.passed, "kind": verdict.kind, "message": verdict.message}}
        if verdict.review:
            cell.metadata[TIMEOUT_KEY]["verdict"]["review"] = list(verdict.review)
        if seconds is not None:  # how long the trusted check took, the learner's calls included
            cell.metadata[TIMEOUT_KEY]["verdict"]["seconds"] = round(seconds, 3)

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
