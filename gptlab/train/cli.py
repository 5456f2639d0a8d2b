"""``python -m gptlab train``: the training command, its options and what it prints.

Where this sits: the command line over :func:`gptlab.train.train`; :func:`register_cli` adds the
``train`` subcommand to ``python -m gptlab`` (:mod:`gptlab.__main__`). A recipe plus overrides
(``--max-steps``, ..., ``--set KEY=VALUE`` for any :class:`TrainConfig` field, model fields
included) make the run's config; errors print one line and exit 2, a signal exits 130 / 143 after
printing the command that resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from ..bench import machine_name
from .config import RECIPES, get_recipe
from .loop import TrainingInterrupted, train
from .run_folder import RunFolderError, has_checkpoint, overwrite_backup

__all__ = ["register_cli", "resume_command"]


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


_VALUE_OPTIONS = ("max_steps", "batch_size", "lr", "eval_interval", "log_interval", "seed", "data_dir",
                  "target_loss", "device", "dtype", "num_threads")


def _check_resume(args: argparse.Namespace) -> None:
    """``--resume`` needs a checkpoint to resume from: refuse rather than start again at step 0."""
    out = Path(args.out)
    if args.resume and not (has_checkpoint(out) or has_checkpoint(overwrite_backup(out))):
        raise RunFolderError(f"cannot resume {out}: it holds no checkpoint ({out / 'ckpt'} is missing); "
                             f"to start a new run there, leave out --resume")


def resume_command(args: argparse.Namespace) -> str:
    """The ``python -m gptlab train`` command that continues the run ``args`` describes."""
    cmd = ["python", "-m", "gptlab", "train", "--recipe", args.recipe, "--out", str(args.out)]
    for name in _VALUE_OPTIONS:
        v = getattr(args, name)
        if v is not None:
            cmd += ["--" + name.replace("_", "-"), str(v)]
    for item in args.set or []:
        cmd += ["--set", item]
    cmd += ["--compile"] * bool(args.compile) + ["--no-progress"] * bool(args.no_progress) + ["--resume"]
    return shlex.join(cmd)


def _interrupted_line(e: TrainingInterrupted, args: argparse.Namespace) -> str:
    """The one line the command prints when a signal stopped training."""
    name = signal.Signals(e.signum).name
    if e.checkpoint is None:
        return f"gptlab train: {e}"
    return (f"gptlab train: stopped by {name} at step {e.step}; checkpoint saved in {e.checkpoint}; "
            f"resume with: {resume_command(args)}")


def _cli(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    try:
        overrides.update(_parse_set(args.set or []))
        for name in _VALUE_OPTIONS:
            v = getattr(args, name)
            if v is not None:
                overrides[name] = v
        if args.compile:
            overrides["compile"] = True
        if args.no_progress:
            overrides["progress"] = False
        cfg = get_recipe(args.recipe, **overrides)
        _check_resume(args)
        summary = train(cfg, args.out, resume=args.resume, overwrite=args.overwrite)
    except TrainingInterrupted as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(_interrupted_line(e, args), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # before training started (loading, setting up): nothing written yet
        print("gptlab train: interrupted before training started; nothing was written", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        print(f"gptlab train: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
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
                    "(or CPU processes): torchrun --nproc_per_node N -m gptlab train ... Ctrl-C (or SIGTERM) saves "
                    "a checkpoint at the current step and prints the command that resumes (exit 130 / 143); one "
                    "process at a time may train into DIR.",
        epilog="recipes: " + "; ".join(
            f"{k} ({c.model.n_layer} layers x {c.model.n_embd}, block {c.model.block_size}, batch {c.batch_size}, {c.max_steps} steps)"
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
    p.add_argument("--resume", action="store_true",
                   help="continue the run in DIR from its checkpoint DIR/ckpt (an error if there is none)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run DIR holds (without it, or --resume, a DIR holding a run is refused); the "
                        "earlier run is kept aside until the new run saves its first checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any TrainConfig field or model field (JSON value), e.g. --set dropout=0.1, "
                        "--set norm=rmsnorm; repeatable")
    p.set_defaults(func=_cli)
