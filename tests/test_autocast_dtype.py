"""The dtype the trainer computes in on each device (gptlab.device.autocast_dtype), on the CPU.

The GPUs are simulated with monkeypatch: ``torch.cuda`` answers as the GPU would (availability,
compute capability, ``is_bf16_supported`` with and without counting emulation). What each gets
with ``dtype="auto"``:

* Colab's free T4 (sm_75): float16 with a GradScaler. Newer torch's ``is_bf16_supported()`` says
  True there (it counts emulation): only native support counts;
* A100 (sm_80) and H100 (sm_90): bfloat16;
* Apple's MPS and the CPU: float32 (no autocast).
"""

from __future__ import annotations

import types

import pytest
import torch

import gptlab.device
import gptlab.train.setup
from gptlab.device import autocast_dtype, cuda_bf16_native, pick_device

GPUS = {"T4": (7, 5), "V100": (7, 0), "A100": (8, 0), "L4": (8, 9), "H100": (9, 0)}


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], *, keyword: bool = True) -> None:
    """torch.cuda as on a machine with one GPU of this compute capability.

    ``keyword=True``: a torch whose ``is_bf16_supported(including_emulation=True)`` counts emulation
    (any CUDA GPU can hold bfloat16 tensors); ``keyword=False``: an older torch whose
    ``is_bf16_supported()`` has no such keyword (and says True everywhere, the worst case)."""
    native = capability >= (8, 0)
    if keyword:
        def is_bf16_supported(including_emulation: bool = True) -> bool:
            return native or including_emulation
    else:
        def is_bf16_supported() -> bool:
            return True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(major=capability[0], minor=capability[1]))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)


@pytest.mark.parametrize("keyword", [True, False], ids=["torch-with-including_emulation", "older-torch"])
@pytest.mark.parametrize("gpu", list(GPUS))
def test_each_gpu_gets_its_dtype(monkeypatch, gpu, keyword):
    _fake_cuda(monkeypatch, GPUS[gpu], keyword=keyword)
    native = GPUS[gpu] >= (8, 0)
    device = pick_device()
    assert device.type == "cuda"
    assert torch.cuda.is_bf16_supported()  # what torch says, emulation counted: not the test
    assert cuda_bf16_native() is native and cuda_bf16_native(device) is native and cuda_bf16_native("cuda") is native
    want = torch.bfloat16 if native else torch.float16
    assert autocast_dtype(device) == autocast_dtype("cuda", "auto") == want
    # an explicit choice is taken as it is (bf16 even where it is emulated)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        assert autocast_dtype(device, name) == dtype


def test_colab_t4_with_torchs_own_check(monkeypatch):
    """The T4 through torch's real ``is_bf16_supported``: only its inputs are simulated (a GPU of
    compute capability 7.5 on which a bfloat16 tensor can be made). torch says True; gptlab
    trains in float16 with a GradScaler."""
    import inspect

    check = torch.cuda.is_bf16_supported
    if "including_emulation" not in inspect.signature(check).parameters or not hasattr(torch.cuda, "_check_bf16_tensor_supported"):
        pytest.skip(f"torch {torch.__version__}: is_bf16_supported has no including_emulation (covered by test_each_gpu_gets_its_dtype)")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(major=7, minor=5))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulated
    assert check() is True  # the trap: Colab's T4 "supports" bf16
    assert check(including_emulation=False) is False
    assert autocast_dtype("cuda") == torch.float16
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(major=8, minor=0))
    assert autocast_dtype("cuda") == torch.bfloat16  # an A100


def test_mps_and_cpu_train_in_float32(monkeypatch):
    # an Apple machine: no CUDA, MPS available
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gptlab.device, "_mps_available", lambda: True)
    device = pick_device()
    assert device.type == "mps"
    assert autocast_dtype(device) == torch.float32
    assert autocast_dtype(device, "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="float16.*needs CUDA"):
        autocast_dtype(device, "float16")
    assert cuda_bf16_native() is False and cuda_bf16_native("mps") is False
    # a CPU-only machine
    monkeypatch.setattr(gptlab.device, "_mps_available", lambda: False)
    assert pick_device() == torch.device("cpu")
    assert autocast_dtype("cpu") == torch.float32
    with pytest.raises(ValueError, match="float16.*needs CUDA"):
        autocast_dtype("cpu", "float16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        autocast_dtype("cpu", "half")


def test_the_trainer_takes_its_dtype_from_autocast_dtype(monkeypatch, tmp_path):
    """The Trainer asks autocast_dtype (and turns the GradScaler on exactly for float16)."""
    from gptlab.train import Trainer, get_recipe

    asked = []

    def spy(device, dtype="auto"):
        asked.append((torch.device(device).type, dtype))
        return torch.float32

    monkeypatch.setattr(gptlab.train.setup, "autocast_dtype", spy)
    n = torch.get_num_threads()
    try:
        t = Trainer(get_recipe("tiny", device="cpu", max_steps=1, progress=False, num_threads=1, save=False, plot=False),
                    tmp_path)
    finally:
        torch.set_num_threads(n)
    assert asked == [("cpu", "auto")]
    assert t.dtype == torch.float32 and not t.scaler.is_enabled()
    t.close()
