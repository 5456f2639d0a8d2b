"""A run's set-up: its data, device and dtype, optimiser, the model as trained, and a resume's checks.

Where this sits: the first of the loop's four parts (:class:`gptlab.train.loop.Trainer`: set-up,
step, evaluate, log). These functions take a :class:`~gptlab.train.config.TrainConfig` and the
processes (:class:`~gptlab.train.distributed.DistInfo`) and return what the loop holds:

* :func:`load_data`: the characters of the corpus, with errors that say what to do;
* :func:`setup_device`: threads, the device (this rank's GPU under ``torchrun``), TF32 and the
  dtype training computes in (:func:`gptlab.device.autocast_dtype`); on a CPU under Linux, the
  C allocator told to keep the activations' memory between steps (:func:`keep_cpu_memory`);
* :func:`make_optimizer`: AdamW with weight decay on matrices only, fused on CUDA;
* :func:`wrap_model`: the model as the steps run it (``torch.compile``, DDP);
* on resume, :func:`load_to_resume` (the checkpoint's weights and optimiser state, its training
  state), :func:`check_resumable` (the checkpoint's run drew the same batches),
  :func:`restore_streams` (every random stream, or reseeded ones with another process count) and
  :func:`rows_to_resume` (a log's rows up to the checkpoint's step; a log that lost rows the
  checkpoint counted is refused).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn as nn

from ..data import CharData, prepare_char_data
from ..device import autocast_dtype, pick_device
from .checkpoint import load_checkpoint, resolve_checkpoint
from .config import TrainConfig
from .distributed import DistInfo
from .metrics import read_jsonl_torn
from .run_folder import RunFolderError
from .rng import set_rng_state

__all__ = ["RESUME_FIELDS", "load_data", "setup_device", "keep_cpu_memory", "make_optimizer", "wrap_model", "load_to_resume",
           "check_resumable", "restore_streams", "rows_to_resume"]

RESUME_FIELDS = ("batch_size", "grad_accum", "seed")
"""Besides the model, what a resumed run must share with its checkpoint's."""


def load_data(cfg: TrainConfig) -> CharData:
    """The run's data (:func:`gptlab.data.prepare_char_data`), with errors that say what to do."""
    if cfg.data_dir is not None and not Path(cfg.data_dir).expanduser().is_dir():
        raise FileNotFoundError(
            f"data directory {str(Path(cfg.data_dir).expanduser())!r} does not exist; expected a folder holding "
            f"train.bin, val.bin and meta.json (or leave data_dir unset to prepare the data in the cache; "
            f"`python -m gptlab fetch` does that)")
    try:
        return prepare_char_data(cfg.data_dir)
    except FileNotFoundError:
        raise
    except RuntimeError as e:  # AssetError: the corpus could not be fetched or verified
        raise RuntimeError(f"could not get the {cfg.dataset!r} training data: {e}") from e


def setup_device(cfg: TrainConfig, dist: DistInfo) -> tuple[torch.device, torch.dtype]:
    """Threads, the device (this rank's GPU under torchrun) and the dtype training computes in."""
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    elif dist.enabled and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.world))
    if dist.enabled and torch.cuda.is_available() and cfg.device in ("auto", "cuda"):
        device = torch.device("cuda", dist.local_rank)
    else:
        device = pick_device(cfg.device)
    dtype = autocast_dtype(device, cfg.dtype)  # bf16 / fp16 + GradScaler / fp32 by GPU
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    elif device.type == "cpu":
        keep_cpu_memory()
    return device, dtype


_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest allowed M_MMAP_THRESHOLD on 64-bit
_TRIM_THRESHOLD = 256 * 1024 * 1024
_kept_cpu_memory: bool | None = None


def keep_cpu_memory() -> bool:
    """On Linux with glibc, let freed tensor memory (blocks up to 32 MB, up to 256 MB in all) stay
    in the process for the next step instead of going back to the system; once per process.
    Returns whether the setting is in force.

    PyTorch's CPU tensors come from ``malloc``. glibc serves a large block (128 kB at first) by
    mapping fresh pages and unmaps it when freed, so every step's activations of a megabyte or
    more were new pages again, each one a page fault that zeroes it: on a 2-core Intel Xeon the
    CPU recipe took 1,600-2,300 faults a step and 8% longer (28.2 against 26.0 ms), and an
    evaluation over the whole validation split in batches of 128 windows twice as long (issue 34).
    ``mallopt`` raises the mapping threshold to 32 MB and the amount of free memory kept at the
    top of the heap to 256 MB: the numbers computed are the same, the process just keeps up to
    that much memory it has freed. Elsewhere (macOS, Windows, musl) nothing changes.
    """
    global _kept_cpu_memory
    if _kept_cpu_memory is None:
        _kept_cpu_memory = False
        if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL(None)
                m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
                _kept_cpu_memory = bool(libc.mallopt(m_mmap_threshold, _MMAP_THRESHOLD)) and bool(
                    libc.mallopt(m_trim_threshold, _TRIM_THRESHOLD))
            except (OSError, AttributeError):
                pass
    return _kept_cpu_memory


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only (:meth:`gptlab.model.GPT.optimizer_groups`); fused on
    CUDA unless ``cfg.fused_adamw`` says otherwise."""
    fused = cfg.fused_adamw if cfg.fused_adamw is not None else device.type == "cuda"
    return torch.optim.AdamW(
        model.optimizer_groups(cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
        **({"fused": True} if fused else {}),
    )


def wrap_model(model: nn.Module, cfg: TrainConfig, dist: DistInfo, device: torch.device) -> nn.Module:
    """The model as the steps run it: compiled with ``compile``, in DDP under torchrun."""
    if cfg.compile:
        model = torch.compile(model)
    if dist.enabled:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def load_to_resume(ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                   cfg: TrainConfig) -> dict | None:
    """Load the checkpoint in ``ckpt_dir`` into ``model`` and ``optimizer`` and return its training
    state (``train_state.json``), checked against ``cfg`` (:func:`check_resumable`); None if there
    is no checkpoint (a fresh start)."""
    try:
        resolve_checkpoint(ckpt_dir)
    except ValueError:
        return None
    _, _, state = load_checkpoint(ckpt_dir, model, optimizer)
    if state is None:
        raise ValueError(f"{ckpt_dir} holds no train_state.json; it cannot be resumed")
    check_resumable(state.get("config", {}), cfg, ckpt_dir)
    return state


def check_resumable(saved: dict, cfg: TrainConfig, ckpt_dir: Path) -> None:
    """Refuse a checkpoint whose run (its saved config, either dict form) drew other batches
    than this one would: the continuation would not be that run. (Its model is checked by
    :func:`~gptlab.train.checkpoint.load_checkpoint`, against this run's.)"""
    try:
        then = TrainConfig.from_dict(saved)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot resume {ckpt_dir}: its saved config is not one: {e}") from e
    for k in RESUME_FIELDS:
        was, now = getattr(then, k), getattr(cfg, k)
        if was != now:
            raise ValueError(f"cannot resume {ckpt_dir}: it was trained with {k}={was!r}, "
                             f"this run has {k}={now!r}")


def restore_streams(state: dict, dist: DistInfo, generator: torch.Generator, seed: int, step: int) -> None:
    """Every random stream as the checkpoint left it (this rank's); with another number of
    processes than the checkpoint's, the global streams and fresh batch streams seeded by step."""
    ranks = state.get("rng_ranks")
    if ranks is not None and len(ranks) == dist.world:
        set_rng_state(ranks[dist.rank], generator)
        return
    if dist.world > 1:
        print(f"warning: resuming with {dist.world} processes from a {len(ranks or [])}-process "
              "checkpoint; batch streams are reseeded", file=sys.stderr)
    set_rng_state(state["rng"], None)
    torch.manual_seed(seed + 1 + step + dist.rank)
    generator.manual_seed(seed + step + 1_000_003 * (dist.rank + 1))


def rows_to_resume(path: Path, step: int, saved: int | None = None, last_step: int | None = None
                   ) -> tuple[list[dict], int]:
    """A log's rows up to ``step`` (rows written after the checkpoint's last save are dropped) and
    the bytes of a torn last line (a crash mid-write), dropped with a warning.

    ``saved``: how many rows the log held when the checkpoint was saved (its ``train_state.json``
    records it); ``last_step``: the step of its last row (older checkpoints record only that). A log
    that holds fewer rows up to ``step``, or not that row (cut short, emptied or deleted since),
    raises :class:`~gptlab.train.run_folder.RunFolderError`: resuming would drop the earlier steps
    from the record, the plot and the best validation loss without a word.
    """
    rows, dropped = read_jsonl_torn(path) if path.exists() else ([], 0)
    if dropped:
        print(f"warning: {path}: dropped its torn last line ({dropped} bytes: a write cut short by a crash); "
              f"resuming from the checkpoint at step {step}", file=sys.stderr)
    kept = [r for r in rows if r["step"] <= step]
    lost = saved is not None and len(kept) < saved
    if not lost and saved is None and last_step is not None:
        lost = not any(r["step"] == last_step for r in kept)
    if lost:
        held = (f"holds {len(kept)} row(s) up to step {step}" if path.exists() else "is missing")
        then = f"{saved} row(s)" if saved is not None else f"a row at step {last_step}"
        raise RunFolderError(
            f"cannot resume {path.parent}: {path} {held}, but its checkpoint at step {step} was saved when it held "
            f"{then} (the file was cut short, emptied or deleted since); resuming would drop those steps from the "
            f"record, the plot and the best validation loss. Put the file back (from a backup), or start the run "
            f"again with --overwrite")
    return kept, dropped
