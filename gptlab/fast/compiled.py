"""A compiled decode step: :meth:`gptlab.GPT.decode` through ``torch.compile``, opt-in.

Why. Once the weights stream fast, what is left of a small model's decode step is a few hundred
small operations (norms, adds, views, the attention of one query), each a trip through Python and
PyTorch's dispatcher. ``torch.compile`` traces the step once into one graph and generates fused
kernels for it, so a step costs the kernels and little else: on a GPU, where each small
operation also costs a kernel launch, that is where decoding's time goes, and compiling is the
GPU's fast path (gpt-fast's). On a CPU it pays only where the generated code beats PyTorch's own
kernels; ``python -m gptlab bench generate --compile`` measures it (and the compile time,
separately) on the machine at hand. It needs a C++ compiler on a CPU (Inductor writes C++) and
Triton on a GPU.

What is compiled is the model's own forward (:meth:`gptlab.GPT.decode` with a
:class:`gptlab.kvcache.StaticKVCache`): nothing is rewritten, so the tokens are the same as
without compiling (up to float rounding, which can change a greedy choice only between two
logits equal to the last bits). The lengths of the cache and of the new tokens are symbolic
(``dynamic=True``): a prefill and the decode steps share one or two compiled graphs, whatever
their lengths. The compiled function is made once per model class and kept by ``torch.compile``'s
own cache (on disk too), so a second call in a process, or a second process, compiles little.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor

__all__ = ["compiled_decode", "decode_step", "CompileFallbackWarning"]

# One compiled function per model class (its graphs are specialised per model by torch.compile's
# guards); holding the unbound method keeps no model alive.
_COMPILED: dict[type, Callable[..., Tensor] | None] = {}  # None: compiling failed here


class CompileFallbackWarning(RuntimeWarning):
    """``compile=True`` could not compile on this machine; the decode runs eagerly (the same tokens)."""


def compiled_decode(model) -> Callable[..., Tensor]:
    """``model.decode`` compiled: ``f(idx (B, T), kv_cache, **kw) -> logits``, the arguments and
    results of :meth:`gptlab.GPT.decode`. Compiles on its first calls (seconds to a minute on a
    CPU), then reuses the graphs.

    Where the compiler's back end fails (no C++ compiler, no Triton, or a code generator bug such
    as torch 2.13's under ``ATEN_CPU_CAPABILITY=default``), the step runs eagerly from then on in
    this process, after one :class:`CompileFallbackWarning` saying why: the failure happens while
    compiling, before the step ran, so nothing (the cache included) is half done.
    """
    # torch._dynamo is imported here, when a decode compiles, not with gptlab: importing it costs
    # about a second, and it registers an exit handler that can deadlock a process whose
    # torch.distributed threads are still winding down at exit (a DDP training run).
    from torch._dynamo.exc import BackendCompilerFailed

    cls = type(model)
    if cls not in _COMPILED:
        _COMPILED[cls] = torch.compile(cls.decode, dynamic=True)

    def step(idx: Tensor, kv_cache, **kw) -> Tensor:
        compiled = _COMPILED.get(cls)
        if compiled is not None:
            try:
                return compiled(model, idx, kv_cache, **kw)
            except BackendCompilerFailed as e:
                _COMPILED[cls] = None
                reason = str(e).strip().splitlines()
                warnings.warn(f"compile=True: torch.compile failed on this machine ({' '.join(reason[:2])[:300]}); "
                              "decoding without compiling", CompileFallbackWarning, stacklevel=2)
        return model.decode(idx, kv_cache, **kw)

    return step


def decode_step(model, compile: bool = False) -> Callable[..., Tensor]:
    """The decode function a decoder calls: ``model.decode``, or with ``compile``
    :func:`compiled_decode`'s."""
    return compiled_decode(model) if compile else model.decode
