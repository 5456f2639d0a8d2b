"""The training loop: turn batches into a trained model by minimising the next-token loss.

Where this sits: text -> tokens -> batches (:mod:`gptlab.data`) -> model -> logits -> *loss*
-> gradients -> AdamW update, repeated; the result is a checkpoint (:mod:`gptlab.train.checkpoint`)
that sampling (:mod:`gptlab.generation`) reads back. :func:`train` is the short way;
:class:`Trainer` is the loop, in four parts as in minGPT and nanoGPT:

* **set-up** (:meth:`Trainer.__init__`, its pieces in :mod:`gptlab.train.setup`): device and
  dtype, data, model, AdamW with weight decay on matrices only
  (:meth:`gptlab.model.GPT.optimizer_groups`), or everything back from a checkpoint (``resume``:
  the continuation is bit-for-bit the same run on CPU, logs included);
* **step** (:meth:`Trainer.accumulate_gradients`, :meth:`Trainer.optimizer_step`): gradient
  accumulation over ``grad_accum`` micro-batches, gradient-norm clipping, the learning rate of
  :func:`gptlab.train.schedule.lr_at`; the loss is the cross-entropy, or with a ``teacher`` the
  distillation loss (:mod:`gptlab.train.distill`);
* **evaluate** (:meth:`Trainer.evaluate`): the validation loss on fixed windows
  (:mod:`gptlab.train.evaluation`), a ``metrics.jsonl`` row every ``eval_interval`` steps;
* **log**: a ``train_log.jsonl`` row every ``log_interval`` steps (:class:`gptlab.train.metrics.TrainLog`),
  a progress bar, ``loss.png`` at the end, the checkpoint ``OUT/ckpt``, the summary
  (:func:`gptlab.train.metrics.run_summary`).

:meth:`Trainer.fit` runs them in a folder it holds: one run per folder, one process at a time
(:mod:`gptlab.train.run_folder`); Ctrl-C (SIGINT) or SIGTERM stops at the end of the current
step, saves a checkpoint there and raises :class:`TrainingInterrupted` (:mod:`gptlab.train.signals`).
On CUDA: bf16 autocast where the GPU has bf16 natively, fp16 + GradScaler on older ones
(:func:`gptlab.device.autocast_dtype`), TF32 matmuls, fused AdamW, optional ``torch.compile``;
several GPUs (or CPU processes) with ``torchrun`` (:mod:`gptlab.train.distributed`: rank 0 logs
and saves, every rank draws its own batches).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.nn as nn

from ..data import get_batch
from ..files import fsync_path, remove_stale_temps
from ..model import GPT
from .checkpoint import load_initial_weights, save_checkpoint
from .config import TrainConfig
from .distill import distillation_loss, load_teacher
from .distributed import all_gather_objects, all_mean, barrier, close_distributed, setup_distributed
from .evaluation import fixed_batch_loss, mean_cross_entropy, val_windows
from .metrics import TrainBar, TrainLog, append_jsonl, plot_metrics, reaches_target, run_summary, write_metrics
from .rng import rng_state
from .run_folder import RunFolder, check_out_dir
from .schedule import lr_at
from .setup import (load_data, load_to_resume, make_optimizer, restore_streams, rows_to_resume, setup_device,
                    wrap_model)
from .signals import StopSignals, TrainingInterrupted, interruption

__all__ = ["Trainer", "train", "TrainingInterrupted"]


class Trainer:
    """One training run: model, optimiser, data, loop state. :func:`train` is the short way.

    ``Trainer(cfg, out_dir, resume=True)`` continues from ``out_dir/ckpt`` if it exists (model,
    optimiser, step, RNG states, metrics), so that the continuation is the same run; a folder that
    holds a run but no checkpoint raises :class:`RunFolderError` (an empty or missing folder starts
    a new run). Without ``resume``, a folder that holds a run (:data:`~gptlab.train.run_folder.RUN_FILES`)
    raises :class:`RunFolderError` unless ``overwrite=True``, which replaces it: the earlier run
    waits in :func:`~gptlab.train.run_folder.overwrite_backup` until the new run saves its first
    checkpoint (or ends, with ``save=False``), and is put back if the new run stops before.
    :meth:`fit` holds the folder's lock (``OUT/.gptlab-train.lock``) while it runs.
    """

    # ---- set-up (the pieces: gptlab.train.setup)

    def __init__(self, cfg: TrainConfig, out_dir: str | os.PathLike, *, resume: bool = False,
                 overwrite: bool = False):
        if not isinstance(cfg, TrainConfig):
            raise TypeError(f"cfg must be a TrainConfig (see RECIPES), got {type(cfg).__name__}")
        self.cfg = cfg
        self.out_dir = check_out_dir(out_dir)  # not "" (the current folder, unasked), a file, or under one
        self.ckpt_dir = self.out_dir / "ckpt"
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.log_path = self.out_dir / "train_log.jsonl"
        self.resume, self.overwrite = resume, overwrite
        self.folder = RunFolder(self.out_dir, resume=resume, overwrite=overwrite)  # its rules, lock, backup
        self.dropped_bytes = 0  # torn last lines dropped from the logs on resume
        self.dist = setup_distributed(cfg.device)
        try:
            if self.dist.master:
                self.folder.check()
            self._setup(cfg, resume)
        except BaseException:
            self.close()
            raise

    def _setup(self, cfg: TrainConfig, resume: bool) -> None:
        """Device, data, model and optimiser, the loop's state (or the checkpoint's), the
        teacher, the model as trained (compiled, DDP) and the validation windows."""
        self.device, self.dtype = setup_device(cfg, self.dist)
        self.signals = StopSignals(lambda: self.step, self.dist, self.device)  # SIGINT / SIGTERM during fit
        self.data = load_data(cfg)
        self.tokenizer = self.data.tokenizer
        # Same initial weights on every rank (DDP also broadcasts rank 0's); then every rank gets
        # its own dropout and batch streams.
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg.model_config(self.data.vocab_size)).to(self.device)
        if cfg.init_from is not None:  # fine-tuning (a checkpoint to resume from replaces these weights)
            load_initial_weights(self.model, cfg.init_from)
        torch.manual_seed(cfg.seed + 1 + self.dist.rank)
        self.generator = torch.Generator().manual_seed(cfg.seed + 1_000_003 * (self.dist.rank + 1))
        self.optimizer = make_optimizer(self.model, cfg, self.device)
        self.scaler = torch.amp.GradScaler("cuda", enabled=(self.dtype == torch.float16))
        self.step = 0
        self.elapsed_before = 0.0
        self.rows: list[dict] = []  # metrics.jsonl: one per evaluation
        self.log_rows: list[dict] = []  # train_log.jsonl: one every log_interval steps
        # the training loss since the previous evaluation (a tensor: no GPU sync per step)
        self._loss_sum = torch.zeros((), device=self.device)
        self._loss_n = 0
        self.train_log = TrainLog(self.device, cfg.grad_clip)  # the current train_log.jsonl interval
        if resume:
            self._resume()
        self.teacher = (load_teacher(cfg.teacher, self.device, self.data.vocab_size, cfg.model.block_size)
                        if cfg.teacher is not None else None)
        self.raw_model = self.model
        self.train_model = wrap_model(self.model, cfg, self.dist, self.device)
        block = cfg.model.block_size
        self.val_x, self.val_y = val_windows(self.data.val, block, cfg.eval_tokens)
        self.val_x_whole, self.val_y_whole = (
            val_windows(self.data.val, block) if cfg.final_eval_whole_split else (self.val_x, self.val_y))

    def _resume(self) -> None:
        """Load ``out_dir/ckpt`` (if there is one): weights, optimiser, step, sums, RNG streams, logs."""
        state = load_to_resume(self.ckpt_dir, self.model, self.optimizer, self.cfg)
        if state is None:
            return  # nothing to resume from: start fresh
        self.step = int(state["step"])
        self.elapsed_before = float(state["elapsed_s"])
        self._loss_sum = torch.tensor(float(state["loss_sum"]), dtype=torch.float32, device=self.device)
        self._loss_n = int(state["loss_n"])
        if state.get("log") is not None:
            self.train_log.load_state_dict(state["log"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        restore_streams(state, self.dist, self.generator, self.cfg.seed, self.step)
        # rows past the checkpoint's step (written after its last save) are dropped: fit rewrites both files
        # how many rows the logs held at the save (older checkpoints record only the last evaluation's row)
        counts = {k: state.get(k) for k in ("metrics_rows", "log_rows") if isinstance(state.get(k), int)}
        last = state.get("metrics")
        self.rows, torn = rows_to_resume(self.metrics_path, self.step, counts.get("metrics_rows"),
                                         last.get("step") if isinstance(last, dict) else None)
        self.log_rows, torn_log = rows_to_resume(self.log_path, self.step, counts.get("log_rows"))
        self.dropped_bytes += torn + torn_log

    # ---- the checkpoint

    def save(self) -> None:
        """Write the checkpoint (every rank must call it under DDP; rank 0 writes)."""
        rng_ranks = all_gather_objects(rng_state(self.generator), self.dist)
        if self.dist.master:
            state = {
                "step": self.step,
                "elapsed_s": self._elapsed(),
                "tokens": self.tokens_seen,
                "loss_sum": float(self._loss_sum.item()),
                "loss_n": self._loss_n,
                "log": self.train_log.state_dict(),
                "rng": rng_ranks[0],
                "rng_ranks": rng_ranks,
                "world_size": self.dist.world,
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                "config": self.cfg.to_dict(),
                "metrics": self.rows[-1] if self.rows else None,
                "metrics_rows": len(self.rows),  # what the logs hold now: a resume refuses logs that lost rows
                "log_rows": len(self.log_rows),
            }
            if self.folder.claimed:  # this run holds the folder's lock: no other process saves here
                remove_stale_temps(self.ckpt_dir, all_but_mine=True)
            for log in (self.metrics_path, self.log_path):  # the logs up to this step outlast a crash too
                if log.exists():
                    fsync_path(log)
            save_checkpoint(self.ckpt_dir, self.raw_model, tokenizer=self.tokenizer, optimizer=self.optimizer,
                            train_state=state)
            self.folder.drop_backup()
        barrier(self.dist)

    # ---- one optimiser step

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def batch_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch: the cross-entropy with the next tokens, or with a teacher
        :func:`~gptlab.train.distill.distillation_loss`."""
        logits, ce = model(x, y)
        if self.teacher is None:
            return ce
        with torch.no_grad():
            teacher_logits = self.teacher(x)[0]
        return distillation_loss(logits, teacher_logits, ce, self.cfg.distill_weight, self.cfg.distill_divergence)

    def accumulate_gradients(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward over micro-batches ``[(x, y), ...]`` (each (b, T)), summing into
        ``.grad`` the gradient of the mean of their losses. Returns that mean loss (a 0-d tensor).

        With equal micro-batch sizes this equals one backward pass over their concatenation;
        under DDP gradients are all-reduced on the last micro-batch only (``no_sync``).
        """
        n = len(micro_batches)
        if n < 1:
            raise ValueError("accumulate_gradients needs at least one (x, y) micro-batch")
        model = self.train_model
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            sync = model.no_sync() if self.dist.enabled and i < n - 1 else contextlib.nullcontext()
            with sync:
                with self._autocast():
                    loss = self.batch_loss(model, x, y) / n
                self.scaler.scale(loss).backward()
            total += loss.detach().float()
        return total

    def optimizer_step(self, lr: float) -> torch.Tensor:
        """Clip the gradient norm, take one AdamW step at learning rate ``lr``, zero the grads.

        Returns the total gradient norm before clipping (a 0-d tensor, not synchronised: the 2-norm
        of all parameters' gradients as one vector, what ``clip_grad_norm_`` returns; computed also
        when ``grad_clip`` is None). Under fp16 loss scaling it is the unscaled norm.
        """
        opt = self.optimizer
        for group in opt.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(opt)  # a no-op without loss scaling
        params = [p for p in self.raw_model.parameters() if p.grad is not None]
        if self.cfg.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        self.scaler.step(opt)
        self.scaler.update()
        opt.zero_grad(set_to_none=True)
        return norm

    def _train_step(self) -> tuple[float, torch.Tensor]:
        """One optimiser step on ``grad_accum`` fresh micro-batches; returns its learning rate and loss."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg)
        batches = [get_batch(self.data.train, cfg.batch_size, cfg.model.block_size, generator=self.generator,
                             device=self.device) for _ in range(cfg.grad_accum)]
        step_loss = self.accumulate_gradients(batches)
        grad_norm = self.optimizer_step(lr)
        self.step += 1
        self._loss_sum += step_loss
        self._loss_n += 1
        self.train_log.add(step_loss, grad_norm)
        return lr, step_loss

    # ---- evaluate

    def evaluate(self, whole_split: bool = False) -> float:
        """Mean cross-entropy (nats/token) over the fixed validation windows (shared by ranks):
        the first ``eval_tokens`` tokens, or the whole split with ``whole_split=True``
        (:func:`gptlab.train.evaluation.mean_cross_entropy`)."""
        x, y = (self.val_x_whole, self.val_y_whole) if whole_split else (self.val_x, self.val_y)
        return mean_cross_entropy(self.raw_model, x, y, batch_size=self.cfg.eval_batch_size, device=self.device,
                                  autocast=self._autocast, dist=self.dist)

    def _log_row(self) -> dict:
        """Evaluate and append a ``metrics.jsonl`` row (train loss: mean since the previous one;
        at step 0 the loss of one fixed training batch, the batch streams untouched)."""
        t_eval = time.perf_counter()
        whole = self.cfg.final_eval_whole_split and self.step == self.cfg.max_steps
        val = self.evaluate(whole_split=whole)
        if self._loss_n:
            train_loss = float(all_mean(self._loss_sum, self.dist).item()) / self._loss_n
        else:
            train_loss = fixed_batch_loss(self.raw_model, self.data.train, batch_size=self.cfg.eval_batch_size,
                                          block_size=self.cfg.model.block_size, seed=self.cfg.seed + 7,
                                          device=self.device, autocast=self._autocast)
        self._loss_sum.zero_()
        self._loss_n = 0
        self._eval_s += time.perf_counter() - t_eval
        row = {
            "step": self.step,
            "train_loss": train_loss,
            "val_loss": val,
            "val_tokens": int((self.val_y_whole if whole else self.val_y).numel()),
            "lr": lr_at(max(self.step - 1, 0), self.cfg),
            "tokens": self.tokens_seen,
            "elapsed_s": round(self._elapsed(), 4),
            "eval_s": round(self._eval_s, 4),
        }
        self.rows.append(row)
        if self.dist.master:
            append_jsonl(self.metrics_path, row)
        return row

    def _checks_target(self, row: dict) -> bool:
        """Whether ``row``'s val loss counts for ``target_loss`` (and is below it)."""
        whole = self.val_y_whole.numel() if self.cfg.final_eval_whole_split else None
        return reaches_target(row, self.cfg.target_loss, whole)

    # ---- log

    @property
    def tokens_seen(self) -> int:
        return self.step * self.cfg.tokens_per_step * self.dist.world

    def _elapsed(self) -> float:
        return self.elapsed_before + (time.perf_counter() - self._t0)

    def _train_log_row(self) -> dict:
        """Append a ``train_log.jsonl`` row for the steps since the previous one and reset the sums."""
        row = self.train_log.pop_row(step=self.step, lr=lr_at(self.step - 1, self.cfg), tokens=self.tokens_seen,
                                     clock=self._elapsed, mean=lambda t: all_mean(t, self.dist))
        self.log_rows.append(row)
        if self.dist.master:
            append_jsonl(self.log_path, row)
        return row

    def _summary(self, elapsed: float) -> dict:
        """The summary :meth:`fit` returns (:func:`gptlab.train.metrics.run_summary`)."""
        cfg, model = self.cfg, self.raw_model
        return run_summary(
            self.rows, step=self.step, max_steps=cfg.max_steps, elapsed=elapsed, eval_s=self._eval_s,
            tokens=self.tokens_seen, resumed=self.elapsed_before != 0, target_loss=cfg.target_loss,
            counts=self._checks_target, params=model.num_params(),
            flops_per_token=model.flops_per_token(cfg.model.block_size, training=True), device=str(self.device),
            dtype=str(self.dtype).replace("torch.", ""), world_size=self.dist.world, out_dir=str(self.out_dir),
            checkpoint=str(self.ckpt_dir) if cfg.save else None)

    # ---- the loop

    def fit(self, until: int | None = None) -> dict:
        """Train to ``cfg.max_steps`` (or stop after step ``until``, or once val <= target_loss),
        save the checkpoint and the plot, and return a summary dict.

        It logs an evaluation row (``self.rows``, ``metrics.jsonl``) every ``cfg.eval_interval``
        steps and a row about the steps since the previous one (``self.log_rows``,
        ``train_log.jsonl``: mean training loss over DDP processes, learning rate, gradient norms,
        clipped fraction) every ``cfg.log_interval`` steps and at the last; their fields are in
        :mod:`gptlab.train.metrics`. An interrupted run (``until``) keeps its partial sums in the
        checkpoint, so a resumed run writes the same rows as an uninterrupted one.

        While it runs it holds the folder's lock (:class:`~gptlab.files.LockError` if another
        process holds it) and answers SIGINT (Ctrl-C) and SIGTERM by finishing the current step,
        saving a checkpoint there (with ``save``) and raising :class:`TrainingInterrupted`;
        resuming from it continues exactly as the run would have. A second signal stops at once,
        saving nothing more (:mod:`gptlab.train.signals`). If the run stops before its first
        checkpoint, the run that ``overwrite`` replaced is put back.
        """
        if until is not None and (not isinstance(until, int) or until < 1):
            raise ValueError(f"until must be a positive int (a step to stop after), got {until!r}")
        lock = self.folder.lock() if self.dist.master else None
        try:
            with self.signals.installed():  # from here a signal never cuts a file operation short
                if self.dist.master:
                    self.folder.claim(self.step)
                return self._fit(until)
        except BaseException as e:
            # stopped before its first checkpoint: the earlier run comes back
            if self.folder.put_back() and not isinstance(e, TrainingInterrupted):
                print(f"note: this run stopped before its first checkpoint; put back the earlier run of "
                      f"{self.out_dir}", file=sys.stderr)
            raise
        finally:
            if lock is not None:
                lock.release()

    def _fit(self, until: int | None) -> dict:
        """The loop of :meth:`fit`, in the claimed, locked folder."""
        start_step = self.step
        reached = self._begin()
        stop = min(self.cfg.max_steps, until) if until is not None else self.cfg.max_steps
        bar = TrainBar(self.cfg.progress and self.dist.master, self.cfg.max_steps, self.step)
        interrupted = False
        try:
            while self.step < stop and reached is None:
                if self.signals.requested(self.step, self.cfg.log_interval):
                    interrupted = True
                    break
                lr, step_loss = self._train_step()
                reached = self._after_step(lr, step_loss, stop, bar)
        finally:
            bar.close()
        if interrupted:
            self._stop_for_signal(start_step)
        return self._finish()

    def _begin(self) -> dict | None:
        """Before the first step: the logs rewritten up to this step, the clocks, the step-0
        evaluation. Returns its row if it already reached ``target_loss``."""
        if self.dist.master:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_metrics(self.metrics_path, self.rows)  # drops rows past a resumed step
            write_metrics(self.log_path, self.log_rows)
        barrier(self.dist)
        self._t0 = time.perf_counter()
        self._eval_s = float(self.rows[-1].get("eval_s", 0.0)) if self.rows else 0.0
        self.train_model.train()
        if self.step == 0 and self.cfg.eval_at_start and not self.rows:
            row = self._log_row()
            if self._checks_target(row):
                return row
        return None

    def _after_step(self, lr: float, step_loss: torch.Tensor, stop: int, bar: TrainBar) -> dict | None:
        """What is due after a step: its log row, the bar, an evaluation, a checkpoint. Returns the
        evaluation's row if it reached ``target_loss`` (the run ends there)."""
        cfg, reached = self.cfg, None
        if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
            self._train_log_row()
        bar.stepped(self.step, stop, step_loss, lr)
        if self.step % cfg.eval_interval == 0 or self.step == cfg.max_steps:
            row = self._log_row()
            bar.evaluated(row, lr)
            if self._checks_target(row):
                reached = row
                if self.train_log.n:  # the run ends here: log its last steps
                    self._train_log_row()
        if cfg.save and cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
            self.save()
        return reached

    def _finish(self) -> dict:
        """After the last step: the checkpoint, the plot, the summary."""
        elapsed = self._elapsed()
        if self.cfg.save:
            self.save()
        else:
            self.folder.drop_backup()
        if self.dist.master and self.cfg.plot and self.rows:
            plot_metrics(self.rows, self.out_dir / "loss.png", title=f"{self.raw_model.num_params():,} parameters",
                         log_rows=self.log_rows, grad_clip=self.cfg.grad_clip)
        return self._summary(elapsed)

    def _stop_for_signal(self, start_step: int) -> None:
        """Save a checkpoint at this step (unless nothing was trained over a replaced run, or
        ``save`` is off) and raise :class:`TrainingInterrupted` saying where and how to resume."""
        first = self.overwrite and self.step == start_step
        saving = self.cfg.save and not first
        if saving:
            self.save()
        raise interruption(self.signals.signum, self.step, self.out_dir, self.ckpt_dir if saving else None,
                           before_first_step=first)

    def close(self) -> None:
        """Leave the process group if this trainer created it."""
        close_distributed(self.dist)


def train(cfg: TrainConfig, out_dir: str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
          until: int | None = None) -> dict:
    """Train a model with ``cfg`` and write ``out_dir/{metrics.jsonl, train_log.jsonl, loss.png, ckpt/}``.

    ``resume=True`` continues from ``out_dir/ckpt`` when it exists (a folder holding a run without
    a checkpoint raises :class:`RunFolderError`). A folder that already holds a run raises
    :class:`RunFolderError` unless ``resume`` or ``overwrite=True`` (replace it; the earlier run is
    kept aside until the new one's first checkpoint). ``until`` stops (and saves) after that step,
    as if interrupted; SIGINT / SIGTERM save and raise :class:`TrainingInterrupted`. Returns a
    summary dict (final and best val loss, elapsed seconds, tokens, tokens/s, time to
    ``cfg.target_loss``, ...). Under ``torchrun`` it trains with DistributedDataParallel; only rank
    0 writes files.
    """
    trainer = Trainer(cfg, out_dir, resume=resume, overwrite=overwrite)
    try:
        return trainer.fit(until=until)
    finally:
        trainer.close()
