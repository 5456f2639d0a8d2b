"""Random-number generator states, saved as JSON and restored: what makes a resumed training run
continue exactly as if it had never stopped.

Where this sits: beside training (:mod:`gptlab.train.loop` saves these states in a checkpoint's
``train_state.json``, :mod:`gptlab.train.checkpoint`). Every generator a run draws from is covered:
Python's ``random``, NumPy's global one, PyTorch's CPU and CUDA ones, and the run's own batch
``torch.Generator``. Binary states are base64 text, so the file stays JSON (nothing is pickled).
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().cpu().contiguous().numpy().tobytes()).decode("ascii")


def _unb64_bytes(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(generator: torch.Generator | None = None) -> dict:
    """Every random-number generator's state in a JSON-safe dict.

    Keys: ``python`` (``random.getstate()`` as lists), ``numpy`` (the legacy global
    ``np.random`` MT19937 state), ``torch`` (CPU default generator, base64), ``cuda`` (one base64
    state per visible GPU, if CUDA is initialised) and ``generator`` (``generator``'s state, e.g.
    the one that draws batches, base64), all restorable with :func:`set_rng_state`.
    """
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    if generator is not None:
        state["generator"] = _b64(generator.get_state())
        state["generator_device"] = str(generator.device)
    return state


def set_rng_state(state: dict, generator: torch.Generator | None = None) -> None:
    """Restore the states saved by :func:`rng_state` (``generator`` gets ``state['generator']``)."""
    if not isinstance(state, dict):
        raise TypeError(f"rng state must be a dict from rng_state(), got {type(state).__name__}")
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in state:
        torch.set_rng_state(_unb64_bytes(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        states = [_unb64_bytes(s) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    if generator is not None:
        if "generator" not in state:
            raise ValueError("the saved RNG state holds no batch-generator state to restore")
        generator.set_state(_unb64_bytes(state["generator"]))
