"""Training benchmark: tokens/s, model FLOPs utilisation and time to a target validation loss.

Where this sits: it runs the training loop (:mod:`gptlab.train`) on a recipe and reports

* training throughput in tokens/s (evaluation time excluded),
* model FLOPs utilisation (MFU): ``tokens/s * model.flops_per_token(block_size) / peak``, where
  the peak is 989 TFLOP/s for an H100 (bf16 dense, SXM datasheet), 312 for an A100 (bf16 dense),
  or, on a CPU, a *measured* dense fp32 matrix-multiply peak (best of several 1024x1024 ``torch.mm``
  on this machine with the current thread count); ``--peak-tflops`` overrides it;
* the wall-clock time until the validation loss first reaches ``--target-loss`` (seconds since
  training began, evaluation included; training stops there), and the step it happened at (with
  a recipe's ``final_eval_whole_split``, only whole-split evaluations count),
* the wall-clock time of the run with its set-up (``wall_s_including_setup``), and from the
  process's start, imports included (``wall_s_from_process_start``, Linux), as nanoGPT's own time
  is counted (``benchmarks/nanogpt_cpu.py``),

together with :func:`gptlab.bench.machine_name`. ``--json PATH`` writes the figures.

    python -m gptlab bench train --recipe shakespeare-char-cpu            # target 1.886
    python -m gptlab bench train --recipe shakespeare-char --compile      # on a GPU, target 1.47
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from ..files import LockError, atomic_write_text
from ..data import get_batch
from ..train import RunFolderError, Trainer, get_recipe, train
from . import error, machine_name

__all__ = ["run", "peak_flops", "measure_cpu_matmul_flops", "DEFAULT_TARGETS"]

# Validation-loss targets per recipe: nanoGPT's published CPU-recipe result (1.886) and its GPU
# baby-GPT result (1.4697, rounded up to 1.47).
DEFAULT_TARGETS = {"shakespeare-char-cpu": 1.886, "shakespeare-char-cpu-fast": 1.886, "nanogpt-cpu": 1.886,
                   "shakespeare-char": 1.47, "tiny": None}

# Dense (no sparsity) peak tensor-core throughput from the vendors' datasheets, FLOP/s.
_GPU_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def measure_cpu_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """Measured dense fp32 matmul throughput of this CPU (FLOP/s): best of ``repeats`` timings
    of an (n x n) @ (n x n) product, 2 n^3 FLOPs each, with torch's current thread count."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: torch.device, override_tflops: float | None = None) -> tuple[float | None, str]:
    """The peak FLOP/s MFU is measured against, and where the figure comes from."""
    if override_tflops is not None:
        return override_tflops * 1e12, "given with --peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in _GPU_PEAKS.items():
            if key in name:
                return peak, f"{key} datasheet, bf16 dense"
        return None, f"unknown GPU {name!r}: pass --peak-tflops"
    if device.type == "cpu":
        return measure_cpu_matmul_flops(), "measured: best fp32 1024x1024 torch.mm on this CPU"
    return None, f"no peak known for {device.type}: pass --peak-tflops"


def _recipe_overrides(args: argparse.Namespace, target: float | None) -> dict:
    """The recipe's overrides the command line asks for (no plot; progress only with --progress)."""
    overrides: dict = {"target_loss": target, "progress": bool(args.progress), "plot": False}
    if args.max_steps is not None:
        overrides["max_steps"] = args.max_steps
    if args.device is not None:
        overrides["device"] = args.device
    if args.compile:
        overrides["compile"] = True
    if args.num_threads is not None:
        overrides["num_threads"] = args.num_threads
    return overrides


def process_age_s() -> float | None:
    """Seconds since this process started (the interpreter's start: imports included), as
    nanoGPT's time is counted (``benchmarks/nanogpt_cpu.py``); None where ``/proc`` does not say."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _figures(args: argparse.Namespace, cfg, summary: dict, target: float | None, wall: float,
             from_start: float | None = None) -> dict:
    """The benchmark's figures from the run's summary: throughput, MFU, time to the target loss."""
    device = torch.device(summary["device"])
    peak, peak_src = peak_flops(device, args.peak_tflops)
    tps = summary["tokens_per_s"]
    achieved = tps * summary["flops_per_token"] if tps else None
    mfu = achieved / peak if (achieved and peak) else None
    return {
        "benchmark": "train",
        "machine": machine_name(),
        "recipe": args.recipe,
        "device": summary["device"],
        "dtype": summary["dtype"],
        "compile": cfg.compile,
        "params": summary["params"],
        "steps": summary["step"],
        "tokens": summary["tokens"],
        "tokens_per_s": tps,
        "ms_per_step": 1000 * (summary["elapsed_s"] - summary["eval_s"]) / max(summary["step"], 1),
        "flops_per_token": summary["flops_per_token"],
        "achieved_tflops": achieved / 1e12 if achieved else None,
        "peak_tflops": peak / 1e12 if peak else None,
        "peak_source": peak_src,
        "mfu": mfu,
        "target_loss": target,
        "time_to_target_s": summary["time_to_target_s"],
        "step_at_target": summary["step_at_target"],
        "final_val_loss": summary["val_loss"],
        "final_val_tokens": summary["val_tokens"],
        "evaluations": summary["evaluations"],
        "best_val_loss": summary["best_val_loss"],
        "train_elapsed_s": summary["elapsed_s"],
        "eval_s": summary["eval_s"],
        "wall_s_including_setup": wall,
        "wall_s_from_process_start": from_start,
    }


def _print_figures(fig: dict, cfg, target: float | None) -> None:
    tps, mfu, peak_src, wall = fig["tokens_per_s"], fig["mfu"], fig["peak_source"], fig["wall_s_including_setup"]
    print(f"machine: {fig['machine']}")
    print(f"recipe {fig['recipe']}: {fig['params']:,} parameters on {fig['device']} ({fig['dtype']}"
          f"{', compiled' if cfg.compile else ''})")
    print(f"throughput: {tps:,.0f} tokens/s, {fig['ms_per_step']:.1f} ms/step (evaluation excluded)")
    if mfu is not None:
        print(f"MFU: {100 * mfu:.1f}% ({fig['achieved_tflops']:.3f} of {fig['peak_tflops']:.3f} TFLOP/s; "
              f"peak {peak_src})")
    else:
        print(f"MFU: n/a ({peak_src})")
    if target is not None:
        if fig["time_to_target_s"] is not None:
            print(f"time to val loss <= {target}: {fig['time_to_target_s']:.1f} s (step {fig['step_at_target']}, "
                  f"evaluation included; {fig['eval_s']:.1f} s of it evaluating)")
        else:
            print(f"target val loss {target} NOT reached: final {fig['final_val_loss']:.4f} after {fig['steps']} steps, "
                  f"{fig['train_elapsed_s']:.1f} s")
    print(f"final val loss {fig['final_val_loss']:.4f} ({fig['final_val_tokens']:,} validation tokens, "
          f"{fig['evaluations']} evaluations); wall time including setup {wall:.1f} s"
          + (f", {fig['wall_s_from_process_start']:.1f} s from the process's start (imports included)"
             if fig.get("wall_s_from_process_start") is not None else ""))
    parts = fig.get("step_breakdown_ms")
    if parts:
        print("one step, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if k != "evaluation")
              + f"; one evaluation of {cfg.eval_tokens:,} tokens: {parts['evaluation']:.0f} ms")


def step_breakdown(cfg, steps: int = 12, warmup: int = 3) -> dict:
    """Where one training step's time goes, in ms: drawing the batch (``data``), the forward pass
    with the loss, the backward pass, the optimiser step (clipping included), each the mean of
    ``steps`` steps after ``warmup`` (a compiled model compiles there), and one evaluation of the
    recipe's ``eval_tokens`` (``evaluation``, ms per evaluation). Runs the :class:`Trainer`'s own
    pieces on a fresh run of ``cfg`` in a temporary folder."""
    parts = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    with tempfile.TemporaryDirectory(prefix="gptlab-bench-") as tmp:
        t = Trainer(cfg, Path(tmp) / "run")
        try:
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                x, y = get_batch(t.data.train, cfg.batch_size, cfg.model.block_size, generator=t.generator,
                                 device=t.device)
                t1 = time.perf_counter()
                loss = t.batch_loss(t.train_model, x, y)
                t2 = time.perf_counter()
                loss.backward()
                t3 = time.perf_counter()
                t.optimizer_step(cfg.lr)
                t4 = time.perf_counter()
                if i >= warmup:
                    for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                        parts[k] += dt
            out = {k: 1000 * v / steps for k, v in parts.items()}
            t0 = time.perf_counter()
            t.evaluate()
            out["evaluation"] = 1000 * (time.perf_counter() - t0)
        finally:
            t.close()
    return out


def run(args: argparse.Namespace) -> int:
    target = args.target_loss if args.target_loss is not None else DEFAULT_TARGETS.get(args.recipe)
    try:
        cfg = get_recipe(args.recipe, **_recipe_overrides(args, target))
    except (ValueError, TypeError) as e:
        error("train", str(e))
        return 2
    with tempfile.TemporaryDirectory(prefix="gptlab-bench-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        t0 = time.perf_counter()
        try:
            summary = train(cfg, out)
        except (RunFolderError, LockError) as e:  # --out names a folder that holds a run, or a live one
            error("train", str(e))
            return 2
        wall = time.perf_counter() - t0
        from_start = process_age_s()  # the same run's end, counted from the process's start
    fig = _figures(args, cfg, summary, target, wall, from_start)
    fig["step_breakdown_ms"] = step_breakdown(cfg)
    _print_figures(fig, cfg, target)
    if args.json:
        p = atomic_write_text(args.json, json.dumps(fig, indent=2) + "\n")
        print(f"wrote {p}")
    return 0
