"""Device selection: where the model and its batches live, and the dtype training computes in there.

Where this sits: beside the pipeline (text -> tokens -> batches -> model -> logits -> loss or
samples -> text). Training, sampling and the benchmarks all call :func:`pick_device` so that the
same command runs on a laptop CPU, an Apple GPU (MPS) or an NVIDIA GPU (CUDA) unchanged; the
trainer calls :func:`autocast_dtype` for the 16-bit type it trains in on that device.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import platform

import torch

__all__ = ["pick_device", "available_devices", "device_type", "cuda_bf16_native", "autocast_dtype", "cpu_model"]

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


def _bf16_check_has_emulation_keyword() -> bool:
    """Whether this torch's ``torch.cuda.is_bf16_supported`` takes ``including_emulation`` (newer
    torch does; Colab and GPU users install their own torch, which may be older)."""
    try:
        return "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def cuda_bf16_native(device: torch.device | str | int | None = None) -> bool:
    """Whether a CUDA device computes bfloat16 in hardware: compute capability 8.0 or newer
    (A100 sm_80, RTX 30xx sm_86, L4 sm_89, H100 sm_90, ...). False without CUDA.

    ``torch.cuda.is_bf16_supported()`` alone is not the test: newer torch counts emulation and says
    True on older GPUs too, Colab's free T4 (sm_75) and the V100 (sm_70) among them, where bfloat16
    arithmetic is emulated and slow. So this asks ``is_bf16_supported(including_emulation=False)``
    where torch has that keyword, and otherwise reads the compute capability (>= 8.0).
    ``device``: a CUDA device (default: the current one).
    """
    if not torch.cuda.is_available():
        return False
    index = None
    if device is not None:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            return False
        index = dev.index
    if _bf16_check_has_emulation_keyword():
        # is_bf16_supported asks the current device
        with torch.cuda.device(index) if index is not None else contextlib.nullcontext():
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return tuple(torch.cuda.get_device_capability(index)) >= (8, 0)


def autocast_dtype(device: torch.device | str, dtype: str = "auto") -> torch.dtype:
    """The dtype training computes in under ``torch.autocast`` on ``device`` (float32: no autocast).

    ``dtype`` is :class:`gptlab.train.TrainConfig`'s ``dtype`` (``--dtype`` on the command
    line). ``"auto"``, the default, picks by device:

    * CUDA with native bfloat16 (:func:`cuda_bf16_native`: A100, H100, L4, RTX 30xx/40xx):
      ``torch.bfloat16``; it has float32's range, so no loss scaling;
    * older CUDA GPUs, where bfloat16 is only emulated (Colab's free T4, V100): ``torch.float16``,
      with a loss scaler (the trainer turns ``torch.amp.GradScaler`` on exactly for float16);
    * MPS (Apple GPUs) and the CPU: ``torch.float32``, no autocast.

    ``"float32"``, ``"bfloat16"`` and ``"float16"`` are taken as asked (bfloat16 even where it is
    emulated), except float16 off CUDA: ``ValueError`` (its loss scaler is CUDA's).
    """
    device = torch.device(device)
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if cuda_bf16_native(device) else torch.float16
        return torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, dtypes))}, got {dtype!r}")
    if dtype == "float16" and device.type != "cuda":
        raise ValueError(f"dtype 'float16' needs CUDA (loss scaling); device is {device.type!r}: use 'bfloat16' or 'float32'")
    return dtypes[dtype]


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``; elsewhere what :mod:`platform`
    says), for benchmarks and per-machine calibrations. Read once per process (a decode's set-up
    asks for it several times, and reading the file took 28 us)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
