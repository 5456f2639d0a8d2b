"""Device selection: where the model and its batches live.

Where this sits: beside the pipeline (text -> tokens -> batches -> model -> logits -> loss or
samples -> text). Training, sampling and the benchmarks all call :func:`pick_device` so that the
same command runs on a laptop CPU, an Apple GPU (MPS) or an NVIDIA GPU (CUDA) unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["pick_device", "available_devices", "device_type"]

_KNOWN = ("cpu", "cuda", "mps")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def pick_device(name: str | torch.device | None = None) -> torch.device:
    """The device to compute on.

    ``name=None`` or ``"auto"`` picks automatically: CUDA if available, then MPS (Apple GPUs),
    then CPU. Otherwise ``name`` is an explicit choice such as ``"cpu"``, ``"cuda"``,
    ``"cuda:1"`` or ``"mps"``; asking for a device that this machine does not have raises a
    ``ValueError`` that says what is available.
    """
    if isinstance(name, torch.device):
        name = str(name)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"device must be a string like 'cpu', 'cuda' or 'mps' (or None), got {type(name).__name__}")
    if name is None or name.strip().lower() in ("", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    name = name.strip().lower()
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"unknown device {name!r}; expected one of 'auto', {', '.join(map(repr, _KNOWN))} "
                         f"(optionally with an index, e.g. 'cuda:0')") from e
    if dev.type not in _KNOWN:
        raise ValueError(f"unsupported device {name!r}; expected one of 'auto', {', '.join(map(repr, _KNOWN))}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available here; available: {available_devices()}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    if dev.type == "mps" and not _mps_available():
        raise ValueError(f"device {name!r} requested but MPS is not available here; available: {available_devices()}")
    return dev


def available_devices() -> list[str]:
    """Names of the device types usable on this machine, best first (always ends with 'cpu')."""
    out = []
    if torch.cuda.is_available():
        out.append("cuda")
    if _mps_available():
        out.append("mps")
    out.append("cpu")
    return out


def device_type(device: torch.device | str) -> str:
    """``"cuda"``, ``"mps"`` or ``"cpu"`` for a device (what ``torch.autocast`` wants)."""
    return torch.device(device).type
