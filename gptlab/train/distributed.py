"""Several training processes (``torchrun``): who they are and the few exchanges between them.

Where this sits: beside the training loop (:mod:`gptlab.train.loop`) and its evaluation
(:mod:`gptlab.train.evaluation`). Data-parallel training runs one process per GPU (or several CPU
processes); each draws its own batches and DistributedDataParallel averages the gradients. The
loop itself needs little more: which process it is (:class:`DistInfo`, from the environment
``torchrun`` sets, by :func:`setup_distributed`), a mean or sum of a number over the processes
(:func:`all_mean`, :func:`all_sum_`), a wait for all of them (:func:`barrier`), every process's
random state for the checkpoint (:func:`all_gather_objects`), and leaving the group
(:func:`close_distributed`). With one process each of these is a no-op, and no process group
exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "setup_distributed", "all_mean", "all_sum_", "barrier", "all_gather_objects",
           "close_distributed"]


@dataclass
class DistInfo:
    """This process's place among the training processes.

    ``rank`` (0 .. ``world`` - 1) and ``local_rank`` (its GPU on this machine); ``world`` the number
    of processes (1: not distributed); ``owns_group`` whether :func:`setup_distributed` created the
    process group (and :func:`close_distributed` must destroy it).
    """

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    owns_group: bool = False

    @property
    def master(self) -> bool:
        """Rank 0: the process that logs and writes files."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """More than one process: the exchanges below communicate."""
        return self.world > 1


def setup_distributed(device_name: str) -> DistInfo:
    """This process's :class:`DistInfo`, joining the process group if ``torchrun`` started several.

    Reads ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``; with more than one process it initialises the
    group (NCCL when ``device_name`` is ``"auto"`` or ``"cuda"`` and CUDA exists, selecting GPU
    ``local_rank``; gloo otherwise). A group that already exists is used as it is (not owned).
    """
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), int(os.environ.get("LOCAL_RANK", dist.get_rank())), dist.get_world_size())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_name in ("auto", "cuda")
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistInfo(rank, local, world, owns_group=True)


def all_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """``t`` (any shape) averaged over the processes: a new tensor; ``t`` itself with one process."""
    if not info.enabled:
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t / info.world


def all_sum_(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Replace ``t`` (any shape) in place by its sum over the processes, and return it."""
    if info.enabled:
        dist.all_reduce(t)
    return t


def barrier(info: DistInfo) -> None:
    """Wait until every process gets here."""
    if info.enabled:
        dist.barrier()


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every process's ``obj`` (picklable), in rank order: ``[obj]`` with one process."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world
    dist.all_gather_object(out, obj)  # in-memory exchange between our own processes
    return out


def close_distributed(info: DistInfo) -> None:
    """Leave the process group if :func:`setup_distributed` created it (once; later calls do nothing)."""
    if info.owns_group:
        dist.destroy_process_group()
        info.owns_group = False
