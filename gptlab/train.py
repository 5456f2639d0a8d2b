"""Training: turn batches into a trained model by minimising the next-token loss.

Where this sits: text -> tokens -> batches (:mod:`gptlab.data`) -> model -> logits -> *loss*
-> gradients -> AdamW update, repeated; the result is a checkpoint (:mod:`gptlab.checkpoint`)
that sampling (:mod:`gptlab.generation`) reads back.

The loop, as in nanoGPT:

* AdamW with weight decay on matrices only (:meth:`gptlab.model.GPT.optimizer_groups`);
* learning rate: linear warmup, then cosine decay to ``min_lr`` (:func:`lr_at`);
* gradient accumulation over ``grad_accum`` micro-batches, gradient-norm clipping;
* evaluation on a fixed, deterministic validation set (the whole validation split cut into
  disjoint windows of ``block_size`` tokens, or its first ``eval_tokens`` tokens; with
  ``final_eval_whole_split`` the last evaluation scores the whole split);
* a tqdm progress bar and, in ``OUT``: ``metrics.jsonl`` (one JSON object per evaluation:
  ``step, train_loss, val_loss, val_tokens, lr, tokens, elapsed_s, eval_s``), ``train_log.jsonl``
  (one JSON object every ``log_interval`` steps: ``step, train_loss, lr, grad_norm,
  grad_norm_max, clip_frac, tokens, elapsed_s``, see :meth:`Trainer.fit`), ``loss.png`` (both
  curves, :func:`gptlab.metrics.plot_metrics`), and a resumable checkpoint in ``OUT/ckpt``
  (bit-for-bit identical continuation on CPU, logs included);
* distillation (``teacher=RUN``): the loss becomes ``(1 - w) CE + w KL(teacher || model)``, which
  trains a small model to predict like a big one (a draft for speculative decoding accepts more of
  its guesses when it does); ``train_loss`` in the metrics is that loss, ``val_loss`` stays the
  cross-entropy;
* on CUDA: bf16 autocast where the GPU has bf16 natively, fp16 + GradScaler on older ones (Colab's
  T4; :func:`gptlab.device.autocast_dtype`), TF32 matmuls, fused AdamW,
  optional ``torch.compile``; several GPUs (or CPU processes) with ``torchrun``
  (DistributedDataParallel: rank 0 logs and saves, every rank draws its own batches).

Use :data:`RECIPES` + :func:`train`, or ``python -m gptlab train --recipe NAME --out DIR``.
This module is the loop (:class:`Trainer`: set-up, resume, one optimiser step, the loop, saving)
and its command line; the pieces it calls live beside it, and the names it has always offered are
re-exported here:

* :mod:`gptlab.train_config`: the run's settings (:class:`TrainConfig`), the recipes, :func:`lr_at`;
* :mod:`gptlab.distributed`: which process this is under ``torchrun`` and the exchanges between
  processes (no-ops with one);
* :mod:`gptlab.evaluation`: the fixed validation windows (:func:`val_windows`) and the mean
  cross-entropy over them (:func:`gptlab.evaluation.mean_cross_entropy`);
* :mod:`gptlab.metrics`: the ``train_log.jsonl`` interval's running sums
  (:class:`gptlab.metrics.TrainLog`), the two JSON Lines files and the plot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checkpoint import load_checkpoint, load_model, resolve_checkpoint, save_checkpoint
from .device import autocast_dtype, pick_device
from .distributed import all_gather_objects, all_mean, barrier, close_distributed, setup_distributed
from .evaluation import mean_cross_entropy, val_windows
from .metrics import TrainLog, append_jsonl, plot_metrics, read_metrics, read_train_log, write_metrics
from .model import GPT
from .progress import progress_bar
from .rng import rng_state, set_rng_state
from .train_config import RECIPES, TrainConfig, get_recipe, lr_at

__all__ = [
    "TrainConfig",
    "RECIPES",
    "get_recipe",
    "lr_at",
    "train",
    "Trainer",
    "distillation_loss",
    "val_windows",
    "plot_metrics",
    "read_metrics",
    "read_train_log",
    "register_cli",
]


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def _load_data(cfg: TrainConfig):
    from .data import prepare_char_data

    if cfg.data_dir is not None:
        d = Path(cfg.data_dir).expanduser()
        if not d.is_dir():
            raise FileNotFoundError(
                f"data directory {str(d)!r} does not exist; expected a folder holding train.bin, val.bin and "
                f"meta.json (or leave data_dir unset to prepare the data in the cache; "
                f"`python -m gptlab fetch` does that)"
            )
    try:
        return prepare_char_data(cfg.data_dir)
    except FileNotFoundError:
        raise
    except RuntimeError as e:  # AssetError: the corpus could not be fetched or verified
        raise RuntimeError(f"could not get the {cfg.dataset!r} training data: {e}") from e


# --------------------------------------------------------------------------------------------
# the trainer
# --------------------------------------------------------------------------------------------


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, ce: torch.Tensor,
                      weight: float) -> torch.Tensor:
    """``(1 - weight) * ce + weight * KL(teacher || model)``, a 0-d tensor.

    logits and teacher_logits (B, T, V): the model's and the teacher's next-token logits for the
    same inputs; ce (0-d): the model's cross-entropy with the true next tokens; weight in [0, 1].
    The KL is the forward one, ``sum_v p_teacher(v) (log p_teacher(v) - log p_model(v))``, averaged
    over the B * T positions and computed in float32. Its gradient pulls the model's whole
    distribution toward the teacher's at every position, not only the observed token's
    probability: what makes a small draft model guess like its target in speculative decoding.
    No gradient reaches the teacher.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    if logits.shape != teacher_logits.shape or logits.dim() != 3:
        raise ValueError(f"logits and teacher_logits must both be (B, T, V), got {tuple(logits.shape)} "
                         f"and {tuple(teacher_logits.shape)}")
    t_logp = F.log_softmax(teacher_logits.detach().float(), dim=-1).flatten(0, 1)  # (B T, V)
    logq = F.log_softmax(logits.float(), dim=-1).flatten(0, 1)
    kl = F.kl_div(logq, t_logp, log_target=True, reduction="batchmean")
    return (1.0 - weight) * ce + weight * kl


class Trainer:
    """One training run: model, optimiser, data, loop state. :func:`train` is the short way.

    ``Trainer(cfg, out_dir, resume=True)`` continues from ``out_dir/ckpt`` if it exists (model,
    optimiser, step, RNG states, metrics), so that the continuation is the same run.
    """

    def __init__(self, cfg: TrainConfig, out_dir: str | os.PathLike, *, resume: bool = False):
        if not isinstance(cfg, TrainConfig):
            raise TypeError(f"cfg must be a TrainConfig (see RECIPES), got {type(cfg).__name__}")
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.ckpt_dir = self.out_dir / "ckpt"
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.log_path = self.out_dir / "train_log.jsonl"
        self.dist = setup_distributed(cfg.device)
        try:
            self._setup(cfg, resume)
        except BaseException:
            self.close()
            raise

    def _setup(self, cfg: TrainConfig, resume: bool) -> None:
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        elif self.dist.enabled and not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.dist.world))

        if self.dist.enabled and torch.cuda.is_available() and cfg.device in ("auto", "cuda"):
            self.device = torch.device("cuda", self.dist.local_rank)
        else:
            self.device = pick_device(cfg.device)
        self.dtype = autocast_dtype(self.device, cfg.dtype)  # bf16 / fp16 + GradScaler / fp32 by GPU
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        self.data = _load_data(cfg)
        self.tokenizer = self.data.tokenizer

        # Same initial weights on every rank (DDP also broadcasts rank 0's); then every rank gets
        # its own dropout and batch streams.
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg.model_config(self.data.vocab_size)).to(self.device)
        torch.manual_seed(cfg.seed + 1 + self.dist.rank)
        self.generator = torch.Generator().manual_seed(cfg.seed + 1_000_003 * (self.dist.rank + 1))
        fused = cfg.fused_adamw if cfg.fused_adamw is not None else self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            self.model.optimizer_groups(cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
            **({"fused": True} if fused else {}),
        )
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

        self.teacher = self._load_teacher(cfg) if cfg.teacher is not None else None
        self.raw_model = self.model
        model: nn.Module = self.model
        if cfg.compile:
            model = torch.compile(model)
        if self.dist.enabled:
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.train_model = model
        self.val_x, self.val_y = val_windows(self.data.val, cfg.block_size, cfg.eval_tokens)
        self.val_x_whole, self.val_y_whole = (
            val_windows(self.data.val, cfg.block_size) if cfg.final_eval_whole_split else (self.val_x, self.val_y))

    def _load_teacher(self, cfg: TrainConfig) -> GPT:
        """The frozen teacher of a distillation run, checked against the data and the student."""
        try:
            teacher, _ = load_model(cfg.teacher, device=self.device)
        except (OSError, ValueError) as e:
            raise ValueError(f"TrainConfig.teacher: cannot load a model from {cfg.teacher!r}: {e}") from e
        tc = teacher.config
        if tc.vocab_size != self.data.vocab_size:
            raise ValueError(f"TrainConfig.teacher: the teacher's vocabulary has {tc.vocab_size} tokens, "
                             f"the data's {self.data.vocab_size}: distillation needs the same tokens")
        if tc.block_size < cfg.block_size:
            raise ValueError(f"TrainConfig.teacher: the teacher's block_size ({tc.block_size}) is shorter than "
                             f"the run's ({cfg.block_size})")
        teacher.requires_grad_(False)
        return teacher.eval()

    def _loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch: the cross-entropy with the next tokens, or with a teacher
        :func:`distillation_loss`."""
        logits, ce = model(x, y)
        if self.teacher is None:
            return ce
        with torch.no_grad():
            teacher_logits = self.teacher(x)[0]
        return distillation_loss(logits, teacher_logits, ce, self.cfg.distill_weight)

    # ---- state

    def _resume(self) -> None:
        try:
            resolve_checkpoint(self.ckpt_dir)
        except ValueError:
            return  # nothing to resume from: start fresh
        _, _, state = load_checkpoint(self.ckpt_dir, self.model, self.optimizer)
        if state is None:
            raise ValueError(f"{self.ckpt_dir} holds no train_state.json; it cannot be resumed")
        saved_cfg = state.get("config", {})
        mine = self.cfg.to_dict()
        for k in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "grad_accum", "seed", "model_kwargs"):
            if k in saved_cfg and saved_cfg[k] != mine[k]:
                raise ValueError(f"cannot resume {self.ckpt_dir}: it was trained with {k}={saved_cfg[k]!r}, "
                                 f"this run has {k}={mine[k]!r}")
        self.step = int(state["step"])
        self.elapsed_before = float(state["elapsed_s"])
        self._loss_sum = torch.tensor(float(state["loss_sum"]), dtype=torch.float32, device=self.device)
        self._loss_n = int(state["loss_n"])
        if state.get("log") is not None:
            self.train_log.load_state_dict(state["log"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        ranks = state.get("rng_ranks")
        if ranks is not None and len(ranks) == self.dist.world:
            set_rng_state(ranks[self.dist.rank], self.generator)
        else:
            if self.dist.world > 1:
                print(f"warning: resuming with {self.dist.world} processes from a {len(ranks or [])}-process "
                      "checkpoint; batch streams are reseeded", file=sys.stderr)
            set_rng_state(state["rng"], None)
            torch.manual_seed(self.cfg.seed + 1 + self.step + self.dist.rank)
            self.generator.manual_seed(self.cfg.seed + self.step + 1_000_003 * (self.dist.rank + 1))
        if self.metrics_path.exists():
            self.rows = [r for r in read_metrics(self.metrics_path) if r["step"] <= self.step]
        if self.log_path.exists():
            self.log_rows = [r for r in read_train_log(self.log_path) if r["step"] <= self.step]

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
            }
            save_checkpoint(self.ckpt_dir, self.raw_model, tokenizer=self.tokenizer, optimizer=self.optimizer,
                            train_state=state)
        barrier(self.dist)

    # ---- numbers, evaluation and the two logs

    @property
    def tokens_seen(self) -> int:
        return self.step * self.cfg.tokens_per_step * self.dist.world

    def _elapsed(self) -> float:
        return self.elapsed_before + (time.perf_counter() - self._t0)

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def evaluate(self, whole_split: bool = False) -> float:
        """Mean cross-entropy (nats/token) over the fixed validation windows (shared by ranks):
        the first ``eval_tokens`` tokens, or the whole split with ``whole_split=True``
        (:func:`gptlab.evaluation.mean_cross_entropy`)."""
        x, y = (self.val_x_whole, self.val_y_whole) if whole_split else (self.val_x, self.val_y)
        return mean_cross_entropy(self.raw_model, x, y, batch_size=self.cfg.eval_batch_size, device=self.device,
                                  autocast=self._autocast, dist=self.dist)

    def _initial_train_loss(self) -> float:
        """Loss on one fixed training batch (for the step-0 row), without touching the batch RNG."""
        from .data import get_batch

        g = torch.Generator().manual_seed(self.cfg.seed + 7)
        x, y = get_batch(self.data.train, self.cfg.eval_batch_size, self.cfg.block_size, generator=g,
                         device=self.device)
        model = self.raw_model
        model.eval()
        with torch.no_grad(), self._autocast():
            _, loss = model(x, y)
        model.train()
        return float(loss.item())

    def _log_row(self) -> dict:
        """Evaluate and append a ``metrics.jsonl`` row (train loss: mean since the previous one)."""
        t_eval = time.perf_counter()
        whole = self.cfg.final_eval_whole_split and self.step == self.cfg.max_steps
        val = self.evaluate(whole_split=whole)
        if self._loss_n:
            train_loss = float(all_mean(self._loss_sum, self.dist).item()) / self._loss_n
        else:
            train_loss = self._initial_train_loss()
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
        if self.cfg.target_loss is None or row["val_loss"] > self.cfg.target_loss:
            return False
        return not self.cfg.final_eval_whole_split or row["val_tokens"] == self.val_y_whole.numel()

    def _train_log_row(self) -> dict:
        """Append a ``train_log.jsonl`` row for the steps since the previous one and reset the sums."""
        row = self.train_log.pop_row(step=self.step, lr=lr_at(self.step - 1, self.cfg), tokens=self.tokens_seen,
                                     clock=self._elapsed, mean=lambda t: all_mean(t, self.dist))
        self.log_rows.append(row)
        if self.dist.master:
            append_jsonl(self.log_path, row)
        return row

    # ---- one optimiser step

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
                    loss = self._loss(model, x, y) / n
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

    # ---- the loop

    def fit(self, until: int | None = None) -> dict:
        """Train to ``cfg.max_steps`` (or stop after step ``until``, or once val <= target_loss),
        save the checkpoint and the plot, and return a summary dict.

        Besides the evaluation rows (``self.rows``, ``metrics.jsonl``) it logs, every
        ``cfg.log_interval`` optimiser steps and at the last step, a row (``self.log_rows``,
        ``train_log.jsonl``) about the steps since the previous row: ``train_loss`` (their mean
        training loss, averaged over DDP processes), ``lr`` (the learning rate of the last of them),
        ``grad_norm`` / ``grad_norm_max`` (mean / max over them of the total gradient norm before
        clipping), ``clip_frac`` (the fraction of them whose norm exceeded ``grad_clip`` and was
        scaled down to it; None without clipping), ``tokens`` and ``elapsed_s`` (evaluation
        included) at that step. An interrupted run (``until``) keeps its partial sums in the
        checkpoint, so a resumed run writes the same rows as an uninterrupted one.
        """
        from .data import get_batch

        cfg = self.cfg
        if until is not None and (not isinstance(until, int) or until < 1):
            raise ValueError(f"until must be a positive int (a step to stop after), got {until!r}")
        if self.dist.master:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_metrics(self.metrics_path, self.rows)  # drops rows past a resumed step
            write_metrics(self.log_path, self.log_rows)
        barrier(self.dist)
        self._t0 = time.perf_counter()
        self._eval_s = 0.0
        if self.rows:
            self._eval_s = float(self.rows[-1].get("eval_s", 0.0))
        self.train_model.train()
        stop = min(cfg.max_steps, until) if until is not None else cfg.max_steps
        reached: dict | None = None
        if self.step == 0 and cfg.eval_at_start and not self.rows:
            row = self._log_row()
            if self._checks_target(row):
                reached = row
        bar = None
        if cfg.progress and self.dist.master:
            # a widget in a notebook, plain text with GPTLAB_PROGRESS=text (the book build)
            bar = progress_bar(total=cfg.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        try:
            while self.step < stop and reached is None:
                lr = lr_at(self.step, cfg)
                batches = [get_batch(self.data.train, cfg.batch_size, cfg.block_size, generator=self.generator,
                                     device=self.device) for _ in range(cfg.grad_accum)]
                step_loss = self.accumulate_gradients(batches)
                grad_norm = self.optimizer_step(lr)
                self.step += 1
                self._loss_sum += step_loss
                self._loss_n += 1
                self.train_log.add(step_loss, grad_norm)
                if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
                    self._train_log_row()
                if bar is not None:
                    bar.update(1)
                    if self.step % 10 == 0 or self.step == stop:
                        bar.set_postfix(loss=f"{step_loss.item():.4f}", lr=f"{lr:.2e}", refresh=False)
                if self.step % cfg.eval_interval == 0 or self.step == cfg.max_steps:
                    row = self._log_row()
                    if bar is not None:
                        bar.set_postfix(loss=f"{row['train_loss']:.4f}", val=f"{row['val_loss']:.4f}", lr=f"{lr:.2e}",
                                        refresh=False)
                    if self._checks_target(row):
                        reached = row
                        if self.train_log.n:  # the run ends here: log its last steps
                            self._train_log_row()
                if cfg.save and cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                    self.save()
        finally:
            if bar is not None:
                bar.close()
        elapsed = self._elapsed()
        if cfg.save:
            self.save()
        if self.dist.master and cfg.plot and self.rows:
            plot_metrics(self.rows, self.out_dir / "loss.png", title=f"{self.raw_model.num_params():,} parameters",
                         log_rows=self.log_rows, grad_clip=self.cfg.grad_clip)
        return self._summary(elapsed, reached)

    def _summary(self, elapsed: float, reached: dict | None) -> dict:
        first = next((r for r in self.rows if self._checks_target(r)), None)
        last = self.rows[-1] if self.rows else {}
        # best over the evaluations that scored the same tokens as the last one
        same = [r["val_loss"] for r in self.rows if r.get("val_tokens") == last.get("val_tokens")]
        train_time = elapsed - self._eval_s
        return {
            "step": self.step,
            "max_steps": self.cfg.max_steps,
            "val_loss": last.get("val_loss"),
            "train_loss": last.get("train_loss"),
            "best_val_loss": min(same, default=None),
            "val_tokens": last.get("val_tokens"),
            "evaluations": len(self.rows),
            "elapsed_s": elapsed,
            "eval_s": self._eval_s,
            "tokens": self.tokens_seen,
            "tokens_per_s": self.tokens_seen / train_time if train_time > 0 and self.elapsed_before == 0 else None,
            "target_loss": self.cfg.target_loss,
            "time_to_target_s": first["elapsed_s"] if first else None,
            "step_at_target": first["step"] if first else None,
            "params": self.raw_model.num_params(),
            "flops_per_token": self.raw_model.flops_per_token(self.cfg.block_size, training=True),
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "world_size": self.dist.world,
            "out_dir": str(self.out_dir),
            "checkpoint": str(self.ckpt_dir) if self.cfg.save else None,
        }

    def close(self) -> None:
        """Leave the process group if this trainer created it."""
        close_distributed(self.dist)


def train(cfg: TrainConfig, out_dir: str | os.PathLike, *, resume: bool = False, until: int | None = None) -> dict:
    """Train a model with ``cfg`` and write ``out_dir/{metrics.jsonl, train_log.jsonl, loss.png, ckpt/}``.

    ``resume=True`` continues from ``out_dir/ckpt`` when it exists. ``until`` stops (and saves)
    after that step, as if interrupted. Returns a summary dict (final and best val loss, elapsed
    seconds, tokens, tokens/s, time to ``cfg.target_loss``, ...). Under ``torchrun`` it trains with
    DistributedDataParallel; only rank 0 writes files.
    """
    trainer = Trainer(cfg, out_dir, resume=resume)
    try:
        return trainer.fit(until=until)
    finally:
        trainer.close()


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def _parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def _cli(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    try:
        overrides.update(_parse_set(args.set or []))
        for name in ("max_steps", "batch_size", "lr", "eval_interval", "log_interval", "seed", "data_dir",
                     "target_loss", "device", "dtype", "num_threads"):
            v = getattr(args, name)
            if v is not None:
                overrides[name] = v
        if args.compile:
            overrides["compile"] = True
        if args.no_progress:
            overrides["progress"] = False
        cfg = get_recipe(args.recipe, **overrides)
        summary = train(cfg, args.out, resume=args.resume)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        print(f"gptlab train: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        from .bench import machine_name

        print(f"machine: {machine_name()}")
        print(f"final val loss {summary['val_loss']:.4f} (best {summary['best_val_loss']:.4f}) after "
              f"{summary['step']} steps, {summary['elapsed_s']:.1f} s ({summary['eval_s']:.1f} s evaluating)")
        if summary["time_to_target_s"] is not None:
            print(f"target {summary['target_loss']} reached at step {summary['step_at_target']} after "
                  f"{summary['time_to_target_s']:.1f} s")
        out = Path(args.out)
        print(f"wrote {out / 'metrics.jsonl'}, {out / 'train_log.jsonl'}, {out / 'loss.png'}, {out / 'ckpt'}")
    return 0


def register_cli(subparsers) -> None:
    """Add ``python -m gptlab train --recipe NAME --out DIR [options]``."""
    p = subparsers.add_parser(
        "train", help="train a model from a recipe",
        description="Train a GPT on Tiny Shakespeare from a named recipe. Writes DIR/metrics.jsonl "
                    "(one row per evaluation), DIR/train_log.jsonl (training loss, learning rate and "
                    "gradient norm every --log-interval steps), DIR/loss.png and the checkpoint DIR/ckpt. Several GPUs "
                    "(or CPU processes): torchrun --nproc_per_node N -m gptlab train ...",
        epilog="recipes: " + "; ".join(
            f"{k} ({c.n_layer} layers x {c.n_embd}, block {c.block_size}, batch {c.batch_size}, {c.max_steps} steps)"
            for k, c in RECIPES.items()),
    )
    p.add_argument("--recipe", required=True, metavar="NAME",
                   help=f"one of: {', '.join(RECIPES)}")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--max-steps", type=int, help="optimiser steps (the cosine schedule follows)")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--eval-interval", type=int, help="evaluate every N steps")
    p.add_argument("--log-interval", type=int, help="log the training loss, lr and gradient norm every N steps")
    p.add_argument("--target-loss", type=float, help="stop once the validation loss is <= this")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--data-dir", help="folder of the prepared data (default: the cache)")
    p.add_argument("--device", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="autocast dtype (auto: bf16 on GPUs with native bf16, e.g. A100/H100; fp16 + GradScaler on older "
                        "ones, e.g. T4; fp32 on MPS and CPU)")
    p.add_argument("--num-threads", type=int, help="CPU threads for torch")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--resume", action="store_true", help="continue from DIR/ckpt if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any TrainConfig field (JSON value), e.g. --set dropout=0.1; repeatable")
    p.set_defaults(func=_cli)
