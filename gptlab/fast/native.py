"""A batch-1 decode step in C++ (``decode_step.cpp``): the same PyTorch operations as the model's
Python step, without Python between them. Built once per machine, opt-in; used by ``fast=True``
once built.

Why. With the weights streaming fast (:mod:`gptlab.fast.cpu`), what is left of a small model's
decode step on a CPU is a few hundred small operations (norms, adds, views, one query's
attention), and from Python each costs about a microsecond of interpreter and argument parsing
on top of its work: GPT-2 Mini's step spends about a third of its time there. ``decode_step.cpp`` makes
the same calls, in the same order, on the same tensors (the model's weights, the packed copies
:class:`~gptlab.fast.cpu.PackedLinear` made, the :class:`~gptlab.kvcache.StaticKVCache`'s
buffers, written in place), from C++: the logits are the same numbers, and a step costs the
operations' own work.

Its own product. PyTorch multiplies one vector by a weight (``F.linear``) on one core; the step
has a product of its own (``matvec_into`` in ``decode_step.cpp``: four rows at a time in 16-lane
vectors, GCC/clang vector extensions compiled for AVX-512, AVX2 or the baseline on x86 and picked
at load time, NEON on ARM; the rows split over PyTorch's threads). Where a timing on this machine
finds it faster than ``at::linear`` for a weight shape (:func:`products_plan`, once per machine and
build, kept in ``cache_dir() / "fast-native.json"``), the step multiplies by it, and then runs
fused: layer norms, the one query's attention (one head per thread), GELU and the residual adds
as loops of its own on buffers made once. Its logits then equal the model's up to float rounding
(the same sums in other orders), not to the last bit; where no shape is faster, the step is the
PyTorch calls above, bit for bit. A layer ``fast=True`` would pack (:mod:`gptlab.fast.cpu`) is
multiplied by the own product too where that also beats the packed product; such a layer is then
left unpacked for the decodes that run this step (:func:`step_keeps_plain`), since the step would
not read its packed copy. (``torch.compile`` is the other way to drop the Python; on the CPUs measured
its generated code was slower than these kernels, see :mod:`gptlab.fast.compiled`.)

How it is used.

* :func:`build` compiles ``decode_step.cpp`` against the installed PyTorch with the machine's C++
  compiler (``python -m gptlab build-native``; tens of seconds, once: the library is kept under
  ``cache_dir() / "native"``, per PyTorch version and source). It needs a C++ compiler and ninja.
* Once built, :func:`gptlab.generate`, :func:`gptlab.stream`, :func:`gptlab.beam_search` and
  :func:`gptlab.speculative_generate` with ``fast=True`` (the default) run each one-token step of a
  batch-1 decode through it, wherever the model is one it reproduces exactly (:func:`why_not`: a
  :class:`gptlab.GPT` of GPT-2's architecture, float32 on the CPU, in eval mode, with no hooks).
* The C++ step reproduces GPT-2's architecture only. A batch-1 one-token step of the other pre-norm
  architectures (Llama's block: RoPE, RMSNorm, SwiGLU, grouped-query attention, or any mix of those
  with GPT-2's parts; float32 on the CPU, eval mode, no hooks, no sliding window, the fused
  attention: :func:`why_not_python`) runs :class:`LlamaPythonDecoder`, a Python twin of
  :meth:`gptlab.GPT.decode`'s step for them: the same operations on the same tensors, so the same
  logits to the last bit, without the model's modules between them.
* A chunk of 2 to ``CHUNK_MAX_TOKENS`` (32) tokens of a model the twin reproduces, GPT-2's
  included, runs :meth:`LlamaPythonDecoder.chunk`, :meth:`gptlab.GPT.decode`'s calls for several
  tokens without the modules (to the last bit again): speculative decoding's verification of the
  draft's guesses (one call, every position's logits), a short prompt's prefill. Where the C++
  step is built, the chunk multiplies by its own product (``matvec`` on several vectors) wherever a
  one-time timing at ``CHUNK_TIMING_ROWS`` rows finds it faster than the model's product
  (:func:`time_chunk_products`; :func:`last_chunk_products` says how many layers), and elsewhere
  over the weight's row blocks in place (:func:`gptlab.fast.cpu.split_product`) where that is
  faster: the logits then equal the model's up to float rounding, and such a chunk of more than
  ``BAG_MAX_ROWS`` tokens runs the same arithmetic in fewer calls
  (:meth:`LlamaPythonDecoder._lean_chunk`).
* Anything else (a longer prefill, a batch, a padded prompt, a sliding window, post-norm blocks,
  the written-out attention, a forward hook) runs the model's own step, :meth:`gptlab.GPT.decode`.
* Without a build, the same one-token steps run :class:`PythonDecoder`, the C++ step's twin in
  Python: the same operations on the same tensors, without the model's modules between them (the
  same logits again). ``make setup`` builds the C++ step where a compiler exists
  (``python -m gptlab build-native --optional``); elsewhere a decode that runs the Python twin says
  once per process, in one line, how to build it (:func:`hint`). Nothing is ever built behind the
  learner's back.

:func:`last_use` says which of these steps the last decode of this process ran (the C++ step, a
Python twin, or the model's own), and why not the C++ one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from ..assets import cache_dir
from ..attention import CausalSelfAttention
from ..kvcache import StaticKVCache
from ..layers import MLP, LayerNorm, RMSNorm, SwiGLU
from ..masks import slot_mask
from ..model import GPT, Block
from ..rope import apply_rope, apply_rope_into
from . import cpu
from .cpu import PackedLinear

__all__ = [
    "LlamaPythonDecoder",
    "NativeBuildError",
    "ProductTiming",
    "PythonDecoder",
    "build",
    "build_dir",
    "disabled",
    "hint",
    "is_built",
    "last_chunk_products",
    "last_products",
    "last_use",
    "matvec",
    "native_decode",
    "products_plan",
    "step_keeps_plain",
    "time_products",
    "why_not",
    "why_not_python",
]

SOURCE = Path(__file__).with_name("decode_step.cpp")


class NativeBuildError(RuntimeError):
    """``decode_step.cpp`` could not be built here (no C++ compiler, no ninja, a compiler error)."""


@functools.cache
def _name() -> str:
    """The extension's name: the source's hash and the PyTorch version (a library is built for one)."""
    h = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    return f"gptlab_decode_{h}"


def build_dir() -> Path:
    """Where the built library lives: ``cache_dir() / "native" / <name>`` (``$GPTLAB_CACHE``)."""
    return cache_dir() / "native" / _name()


_MODULE: dict[str, Any] = {}  # name -> the loaded extension module (a process loads it once)


def _library() -> Path | None:
    """The built library's file in :func:`build_dir`, if any."""
    found = sorted(build_dir().glob(f"{_name()}*.so")) + sorted(build_dir().glob(f"{_name()}*.pyd"))
    return found[0] if found else None


def _module() -> Any | None:
    """The built extension, loaded (None when :func:`build_dir` holds no build)."""
    path = _library()
    if path is None:
        return None
    name = _name()
    if name not in _MODULE:
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, str(path), loader=loader))
        loader.exec_module(module)
        _MODULE[name] = module
    return _MODULE[name]


def matvec(weight: Tensor, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """The C++ step's own product: ``F.linear(x, weight, bias)`` for x (..., in) holding one vector or
    several (made contiguous), weight (out, in) float32 contiguous -> (..., out); equal to it up to
    float rounding (the same sums in another order), and each vector's row equal to its product
    alone to the last bit. Raises :class:`NativeBuildError` where nothing is built, ``RuntimeError``
    on other shapes or dtypes."""
    module = _module()
    if module is None:
        raise NativeBuildError(NOT_BUILT)
    return module.matvec(weight.detach(), x.detach(), torch.empty(0) if bias is None else bias.detach())


def is_built() -> bool:
    """``decode_step.cpp`` is built for this PyTorch, in :func:`build_dir`."""
    return _library() is not None


def build(verbose: bool = False) -> float:
    """Compile ``decode_step.cpp`` into :func:`build_dir` (nothing to do if it is there); return the
    seconds it took. Raises :class:`NativeBuildError` saying why where it cannot be built."""
    if is_built():
        _module()
        return 0.0
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise NativeBuildError(f"building the C++ decode step needs a C++ compiler: no {compiler!r} on the PATH "
                               "(e.g. apt-get install g++, or set $CXX)")
    try:
        from torch.utils.cpp_extension import load, verify_ninja_availability

        verify_ninja_availability()
    except (ImportError, RuntimeError) as e:
        raise NativeBuildError(f"building the C++ decode step needs ninja (pip install ninja): {e}") from e
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    flags = _openmp_flags(compiler)
    while True:
        try:
            module = load(_name(), [str(SOURCE)], extra_cflags=["-O2", *flags], extra_ldflags=flags,
                          build_directory=str(folder), verbose=verbose)
            break
        except (RuntimeError, OSError) as e:  # no compiler, or it failed: say what it said
            if flags and any(w in str(e) for w in ("fopenmp'", "fopenmp\"", "omp.h", "-lgomp", "-lomp")):
                # a compiler without OpenMP: the own product then runs on one thread
                flags = []
                continue
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            raise NativeBuildError(f"building the C++ decode step failed: {' '.join(lines[-3:])[:500]}") from e
    _MODULE.setdefault(_name(), module)
    return time.perf_counter() - t0


def _openmp_flags(compiler: str) -> list[str]:
    """``-fopenmp`` where PyTorch's threads are OpenMP's and the compiler is GCC (off macOS and
    Windows): ``at::parallel_for`` in the step's own product is a ``#pragma omp parallel`` compiled
    into the extension, which runs on one thread without it, and with it joins PyTorch's own OpenMP
    pool (GCC's runtime, ``libgomp.so.1``, the one PyTorch's Linux wheels load). Not with clang,
    whose ``-fopenmp`` links another runtime (``libomp``: a second pool of threads beside
    PyTorch's); there, and where the build fails with it, the own product runs on one thread, and
    the timing (:func:`products_plan`) decides whether it is worth it."""
    if sys.platform == "darwin" or os.name == "nt":
        return []
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return []
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return ["-fopenmp"] if "Free Software Foundation" in version and "clang" not in version.lower() else []


# --------------------------------------------------------------------------- which models, which steps


def _linears(model: nn.Module) -> list[nn.Module]:
    out = []
    for b in model.transformer.h:
        out += [b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj]
    return out + [model.lm_head]


def _hooked(model: nn.Module) -> bool:
    """Some module of ``model`` (or every module, globally) has a forward hook: the model's own step runs them."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(mod._forward_hooks or mod._forward_pre_hooks for mod in model.modules())


def why_not(model: nn.Module, cache: Any) -> str | None:
    """Why the C++ step cannot stand in for ``model.decode`` on ``cache`` (None: it can).

    It reproduces a :class:`gptlab.GPT` of GPT-2's architecture (learned positions, pre-norm
    LayerNorm, GELU MLP, one key/value head per query head, no sliding window, PyTorch's fused
    attention), float32 on the CPU, in eval mode, without hooks, decoding batch 1 into a
    :class:`~gptlab.kvcache.StaticKVCache`. (Where it cannot, a model of the other pre-norm
    architectures may still run a Python twin, :class:`LlamaPythonDecoder`: :func:`why_not_python`.)
    """
    if type(model) is not GPT:
        return f"not a gptlab.GPT ({type(model).__name__})"
    c = model.config
    if (c.pos_emb, c.norm, c.mlp, c.prenorm, c.kv_heads == c.n_head, c.window_size) != \
            ("learned", "layernorm", "gelu", True, True, None):
        return "not GPT-2's architecture (learned positions, pre-norm LayerNorm, GELU, full heads, no window)"
    reason = _why_not_common(model, cache, LayerNorm, MLP)
    if reason is not None:
        return reason
    blocks = list(model.transformer.h)
    if len({m.eps for b in blocks for m in (b.ln_1, b.ln_2)} | {model.transformer.ln_f.eps}) != 1:
        return "the layer norms' eps differ"
    if _hooked(model):
        return HOOKED
    return None


HOOKED = "a module has a forward hook (the model's own step runs it)"


def _why_not_common(model: nn.Module, cache: Any, norm: type, mlp: type) -> str | None:
    """What both steps need of a :class:`gptlab.GPT` whose blocks hold ``norm`` and ``mlp`` modules."""
    if any(mod.training for mod in model.modules()):
        return "the model (or one of its modules) is in training mode"
    if type(cache) is not StaticKVCache or cache.k.shape[1] != 1 or cache.k.dtype != torch.float32:
        return "not a float32 batch-1 StaticKVCache"
    blocks = list(model.transformer.h)
    if any(type(b) is not Block or type(b.ln_1) is not norm or type(b.ln_2) is not norm
           or type(b.attn) is not CausalSelfAttention or type(b.mlp) is not mlp for b in blocks) \
            or type(model.transformer.ln_f) is not norm:
        return "a block's modules are not gptlab's own"
    if any(b.attn.impl == "explicit" or b.attn.record_weights for b in blocks):
        return "the attention is the written-out one (attn_impl='explicit' or record_weights)"
    if any(type(m) not in (nn.Linear, PackedLinear) for m in _linears(model)):
        return "a linear layer is neither nn.Linear nor PackedLinear"
    params = list(model.parameters())
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return "the weights are not float32 on the CPU"
    return None


def why_not_python(model: nn.Module, cache: Any) -> str | None:
    """Why :class:`LlamaPythonDecoder`, the Python twin of ``model.decode``'s one-token step for the
    architectures the C++ step does not reproduce, cannot stand in for it (None: it can).

    It reproduces a pre-norm :class:`gptlab.GPT` with any mix of learned or rotary positions
    (RoPE), LayerNorm or RMSNorm, a GELU MLP or SwiGLU, full or grouped-query attention (Llama's
    block: RoPE, RMSNorm, SwiGLU, GQA), without a sliding window, with PyTorch's fused attention,
    float32 on the CPU, in eval mode, without hooks, decoding batch 1 into a
    :class:`~gptlab.kvcache.StaticKVCache`. Everything else runs :meth:`gptlab.GPT.decode`.
    """
    if type(model) is not GPT:
        return f"not a gptlab.GPT ({type(model).__name__})"
    c = model.config
    if not c.prenorm:
        return "post-norm blocks"
    if c.window_size is not None:
        return "a sliding attention window"
    if c.pos_emb not in ("learned", "rope") or c.norm not in ("layernorm", "rmsnorm") or c.mlp not in ("gelu", "swiglu"):
        return f"positions {c.pos_emb!r}, norm {c.norm!r}, MLP {c.mlp!r}"
    reason = _why_not_common(model, cache, RMSNorm if c.norm == "rmsnorm" else LayerNorm,
                             SwiGLU if c.mlp == "swiglu" else MLP)
    if reason is not None:
        return reason
    if c.pos_emb == "rope" and any(t.dtype != torch.float32 or t.device.type != "cpu"
                                   for t in (model.rope_cos, model.rope_sin)):
        return "the RoPE tables are not float32 on the CPU"
    if _hooked(model):
        return HOOKED
    return None


# --------------------------------------------------------------------------- the own product, where it pays

# Which plain weights the C++ step multiplies by its own product (decode_step.cpp, matvec_into)
# instead of at::linear: "calibrated" (where products_plan's timing on this machine found it faster),
# "always" or "never" (tests, experiments).
OWN_PRODUCT = "calibrated"
OWN_FASTER_BY = 0.95  # the own product where it takes under 95% of at::linear's time (beyond the noise)
PRODUCTS_FILE = "fast-native.json"


@dataclass(frozen=True)
class ProductTiming:
    """One weight shape's product of one vector in the C++ step, microseconds, best of the rounds."""

    linear_us: float  # at::linear (PyTorch's BLAS call: for one vector, one core)
    own_us: float  # decode_step.cpp's own product, split over the threads

    @property
    def faster(self) -> bool:
        return self.own_us < OWN_FASTER_BY * self.linear_us


def products_path() -> Path:
    """Where the timings of the own product are kept: ``cache_dir() / "fast-native.json"``."""
    return cache_dir() / PRODUCTS_FILE


def products_key() -> str:
    """What a timing of the own product holds for: :func:`gptlab.fast.cpu.machine_key` (CPU, threads,
    torch) and the build (the source's hash)."""
    return f"{cpu.machine_key()} | {_name()}"


_PRODUCT_TIMINGS: dict[tuple[str, str], dict[str, ProductTiming]] = {}


def _read_products(path: Path, key: str) -> dict[str, ProductTiming]:
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))["machines"][key]
        return {shape: ProductTiming(float(t["linear_us"]), float(t["own_us"])) for shape, t in saved.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _save_products(path: Path, key: str, timings: dict[str, ProductTiming]) -> None:
    """Merge ``timings`` into the file, atomically, as the packed products' calibration does
    (:mod:`gptlab.fast.cpu`); a cache that cannot be written is no error."""
    cpu._save(path, key, timings)


def time_products(module: Any, layers: list[nn.Linear], rounds: int = 7) -> dict[str, ProductTiming]:
    """Time one vector's product by each layer both ways in the C++ step (at::linear, the own
    product), in the model's order (the weights stream as in a decode step), the two ways alternating
    round after round; per shape the best round's mean per layer."""
    shapes = [cpu._shape(m) for m in layers]
    g = torch.Generator().manual_seed(0)
    ws = [m.weight.detach().contiguous() for m in layers]
    bs = [torch.empty(0) if m.bias is None else m.bias.detach().contiguous() for m in layers]
    xs = [torch.randn(m.in_features, generator=g) for m in layers]
    best: dict[bool, dict[str, float]] = {True: {}, False: {}}
    for r in range(rounds + 1):  # round 0 warms up
        for own in (True, False) if r % 2 else (False, True):
            ns = module.time_products(ws, bs, xs, own)
            if r:
                total: dict[str, list[int]] = {}
                for shape, t in zip(shapes, ns):
                    total.setdefault(shape, []).append(t)
                for shape, ts in total.items():
                    best[own][shape] = min(best[own].get(shape, math.inf), sum(ts) / len(ts))
    return {shape: ProductTiming(best[False][shape] / 1e3, best[True][shape] / 1e3) for shape in best[True]}


def products_plan(module: Any, model: nn.Module) -> dict[str, ProductTiming]:
    """The timings, on this machine and build, of ``model``'s plain weight shapes (``"out x in"``)
    both ways in the C++ step: measured once (:func:`time_products`, about a decode step's time a
    round) and kept in ``cache_dir() / "fast-native.json"`` under :func:`products_key` (not when the
    machine is busy, :func:`gptlab.fast.cpu._busy`: the next process measures again)."""
    layers = [m for m in _linears(model) if type(m) in (nn.Linear, PackedLinear)]  # a packed layer: its plain weight
    memo = _timings(layers, cpu._shape, lambda todo: time_products(module, todo))
    return {s: memo[s] for s in dict.fromkeys(cpu._shape(m) for m in layers)}


def _timings(layers: list[nn.Module], key_of: Callable[[nn.Module], str],
             measure: Callable[[list[nn.Module]], dict[str, ProductTiming]]) -> dict[str, ProductTiming]:
    """This process's timings of the C++ step's products (read once from ``fast-native.json``, under
    :func:`products_key`), after ``measure`` has timed the ``layers`` whose ``key_of`` is missing; what
    it measured is kept in the file unless the machine is busy (:func:`gptlab.fast.cpu._busy`)."""
    path, key = products_path(), products_key()
    memo = _PRODUCT_TIMINGS.get((str(path), key))
    if memo is None:
        memo = _PRODUCT_TIMINGS[(str(path), key)] = _read_products(path, key)
    todo = [m for m in layers if key_of(m) not in memo]
    if todo:
        measured = measure(todo)
        memo.update(measured)
        if not cpu._busy():
            _save_products(path, key, measured)
    return memo


def _own(module: Any, model: nn.Module) -> Callable[[nn.Module], bool]:
    """Whether the C++ step multiplies by a layer's plain weight with its own product (OWN_PRODUCT):
    for a plain layer where it is faster than at::linear; for a packed one (:class:`PackedLinear`, which
    keeps the plain weight too) where it is also faster than the packed product (``gptlab.fast.cpu``'s
    calibration of that shape, timed from Python: a few microseconds of calls included)."""
    if OWN_PRODUCT == "never":
        return lambda m: False
    if OWN_PRODUCT == "always":
        return lambda m: type(m) in (nn.Linear, PackedLinear)
    timings = products_plan(module, model)

    def own(m: nn.Module) -> bool:
        if type(m) is nn.Linear:
            return timings[cpu._shape(m)].faster
        return type(m) is PackedLinear and _beats_packed(timings, m)

    return own


def _beats_packed(timings: dict[str, ProductTiming], m: nn.Module) -> bool:
    """The own product of ``m``'s shape beats at::linear and, where this machine's packing
    calibration timed that shape (:func:`gptlab.fast.cpu.known_timing`), the packed product too."""
    shape = cpu._shape(m)
    p = cpu.known_timing(shape)
    return timings[shape].faster and (p is None or timings[shape].own_us < OWN_FASTER_BY * p.packed_us)


KEPT_PLAIN = "the C++ decode step multiplies it by its own product (it would not read a packed copy)"


def step_keeps_plain(model: nn.Module, batch: int, cache_impl: str | None,
                     padded: bool) -> Callable[[nn.Module], str | None] | None:
    """What :func:`gptlab.fast.cpu.decode_plan` takes as ``keep_plain`` for a decode that will run
    its one-token steps through the C++ step (:func:`native_decode`): a layer it would multiply by
    its own product even if packed (:func:`_own`: faster than at::linear and than the packed
    product) is left plain, with :data:`KEPT_PLAIN` as the reason, since packing it would copy its
    weight for nothing (17-20 ms a call for GPT-2 Mini's shape on the AMD EPYC measured). None
    where the C++ step will not run: not built, under :func:`disabled`, ``OWN_PRODUCT = "never"``,
    ``batch`` rows other than 1, ``padded`` rows, a cache other than ``"static"`` (``cache_impl``;
    None: no cache), or a model it does not reproduce (:func:`why_not`)."""
    if batch != 1 or padded or cache_impl != "static" or _OFF[0] or OWN_PRODUCT == "never":
        return None
    module = _module()
    if module is None or type(model) is not GPT or why_not(model, StaticKVCache.for_model(model, 1, 1)) is not None:
        return None
    if OWN_PRODUCT == "always":
        return lambda m: KEPT_PLAIN if _laid_out(m) else None
    timings = products_plan(module, model)
    return lambda m: KEPT_PLAIN if _laid_out(m) and _beats_packed(timings, m) else None


CHUNK_TIMING_ROWS = 8  # a verification of 7 guesses: the chunk size the own product is timed at


def time_chunk_products(module: Any, layers: list[nn.Module], rounds: int = 7) -> dict[str, ProductTiming]:
    """Time a chunk's product (``CHUNK_TIMING_ROWS`` vectors) by each layer both ways, from Python as
    :meth:`LlamaPythonDecoder.chunk` calls them: the layer's own product as the model computes it
    (``linear_us``: the packed blocks or ``F.linear``) and the C++ step's (``own_us``: ``matvec`` on the
    plain weight); in the model's order, the two ways alternating round after round; per shape the best
    round's mean per layer."""
    g = torch.Generator().manual_seed(0)
    ways = ([_product(m) for m in layers], [_own_product(module, m) for m in layers])
    xs = [torch.randn(1, CHUNK_TIMING_ROWS, m.in_features, generator=g) for m in layers]
    shapes = [_chunk_key(m) for m in layers]
    best: list[dict[str, float]] = [{}, {}]
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up
            for way in (0, 1) if r % 2 else (1, 0):
                total: dict[str, list[float]] = {}
                for shape, f, x in zip(shapes, ways[way], xs):
                    t0 = time.perf_counter()
                    f(x)
                    total.setdefault(shape, []).append(time.perf_counter() - t0)
                if r:
                    for shape, ts in total.items():
                        best[way][shape] = min(best[way].get(shape, math.inf), sum(ts) / len(ts))
    return {shape: ProductTiming(best[0][shape] * 1e6, best[1][shape] * 1e6) for shape in best[1]}


def _chunk_key(m: nn.Module) -> str:
    return f"{m.out_features}x{m.in_features} x{CHUNK_TIMING_ROWS} rows"


def _own_product(module: Any, m: nn.Module) -> Callable[[Tensor], Tensor]:
    """A layer's product of x (..., in) by the C++ step's own kernel on its plain weight."""
    matvec, weight, bias = module.matvec, m.weight.detach(), torch.empty(0) if m.bias is None else m.bias.detach()
    return lambda x: matvec(weight, x, bias)


def _chunk_products(model: nn.Module, module: Any | None) -> Callable[[nn.Module], Callable[[Tensor], Tensor] | None]:
    """Which product :meth:`LlamaPythonDecoder.chunk` runs for each linear layer, None for the
    model's own (see :func:`native_decode`); says so in :func:`last_chunk_products`."""
    linears = _linears(model)
    own = (lambda m: False) if module is None else _own_chunks(module, model)  # noqa: E731
    split = cpu.splits_chunks
    n_own = sum(bool(own(m)) for m in linears)
    n_split = sum(bool(split(m)) and not own(m) for m in linears)
    said = [] if module is None else [f"own product for {n_own} of {len(linears)} linear layers"]
    if n_split:
        said.append(f"row blocks in place for {n_split} of {len(linears)} linear layers")
    _CHUNKS[0] = _CHUNKS_OF[model] = ", ".join(said) or "the model's products"

    def product(m: nn.Module) -> Callable[[Tensor], Tensor] | None:
        if own(m):
            return _own_product(module, m)
        return _InPlaceBlocks(m) if split(m) else None

    return product


class _InPlaceBlocks:
    """A layer's chunk product of x (..., in) over its weight's row blocks in place
    (:func:`gptlab.fast.cpu.split_product`), or as the model computes it (:func:`_product`) for at
    most ``BAG_MAX_ROWS`` vectors (a batched product of so few runs slower than F.linear's and the
    packed copy's). :meth:`LlamaPythonDecoder.chunk`'s lean path reads ``blocks`` and ``bias`` (the
    views of :func:`gptlab.fast.cpu.split_blocks`) and takes the outputs block by block."""

    __slots__ = ("layer", "blocks", "bias", "out_features", "few", "own")

    def __init__(self, m: nn.Module, parts: int | None = None):
        self.layer, self.blocks, self.bias = m, *cpu.split_blocks(m.weight.detach(), _detached(m.bias), parts)
        self.out_features, self.few, self.own = m.out_features, cpu.BAG_MAX_ROWS * m.in_features, None

    def __call__(self, x: Tensor) -> Tensor:
        if x.numel() <= self.few:
            if self.own is None:  # made at the first short chunk (a verification never needs it)
                self.own = _product(self.layer)
            return self.own(x)
        return cpu._blocks_bmm(x, self.blocks, self.bias, self.out_features)


def chunk_keeps_plain(model: nn.Module) -> Callable[[nn.Module], str | None]:
    """What :func:`gptlab.fast.cpu.decode_plan` takes as ``keep_plain`` for a model that will run
    chunks only (speculative decoding's target: its verifications): a layer whose chunks would not
    read a packed copy (the C++ step's own product, :func:`_own_chunks`) or would not run faster
    from one (they read its weight in place: :func:`gptlab.fast.cpu.splits_chunks`) stays plain, with
    the reason: speculative decoding's target then skips the packing (1.2-1.6 ms a call for the
    benchmark's target on the AMD EPYC measured)."""
    module = None if _OFF[0] else _module()
    own = _own_chunks(module, model) if module is not None and type(model) is GPT else lambda m: False

    def keep(m: nn.Module) -> str | None:
        if own(m):
            return "its chunks run the C++ step's own product (it would not read a packed copy)"
        return "its chunks read its weight in place (gptlab.fast.cpu.split_product)" if cpu.splits_chunks(m) else None

    return keep


def _laid_out(m: nn.Module) -> bool:
    """A plain or packed layer whose plain weight (and bias) the own product can read as they are."""
    return type(m) in (nn.Linear, PackedLinear) and m.weight.is_contiguous() and \
        (m.bias is None or m.bias.is_contiguous())


def _own_chunks(module: Any, model: nn.Module) -> Callable[[nn.Module], bool]:
    """Whether :meth:`LlamaPythonDecoder.chunk` multiplies by a layer's plain weight with the C++
    step's own product (OWN_PRODUCT): where :func:`time_chunk_products` found it faster than the
    layer's product as the model computes it (measured once per machine and build, kept in
    ``fast-native.json`` beside :func:`products_plan`'s timings)."""
    if OWN_PRODUCT == "never":
        return lambda m: False
    if OWN_PRODUCT == "always":
        return _laid_out
    memo = _timings([m for m in _linears(model) if _laid_out(m)], _chunk_key,  # one layer per shape timed
                    lambda todo: time_chunk_products(module, list({_chunk_key(m): m for m in todo}.values())))
    return lambda m: _laid_out(m) and memo[_chunk_key(m)].faster


_PRODUCTS: list[str] = [""]  # the products the last C++ step ran (last_products)


def last_products() -> str:
    """How the last decode that ran the C++ step multiplied by its weights ("" before any)."""
    return _PRODUCTS[0]


def _tensors(model: nn.Module, cache: Any,
             own: Callable[[nn.Module], bool] = lambda m: False) -> tuple[list[Tensor], list[int], float]:
    """What ``Decoder`` takes (see ``decode_step.cpp``): the model's tensors, and per linear layer
    its packed copy (a :class:`PackedLinear`'s blocks) or its plain weight (multiplied by at::linear,
    or by the step's own product where ``own(layer)``)."""
    none = torch.empty(0)
    c, t = model.config, model.transformer
    tensors = [t.wte.weight, t.wpe.weight, t.ln_f.weight, none if t.ln_f.bias is None else t.ln_f.bias,
               cache.k, cache.v]
    ints = [c.n_layer, c.n_head, c.head_dim]

    def product(m: nn.Module) -> None:
        if isinstance(m, PackedLinear) and not own(m):  # one vector's product as blocks_product runs it here
            b = m.blocks
            P, inp, part = b.weight.shape
            if cpu.EMBEDDING_BAG_PRODUCT:
                tensors.extend([b.weight.view(P * inp, part), none if b.bias is None else b.bias.view(P, part),
                                b.indices, b.offsets])
                ints.extend([1, P, inp, b.out_features])
            else:
                tensors.extend([b.weight, none if b.bias is None else b.bias, none, none])
                ints.extend([2, P, inp, b.out_features])
        else:  # the plain weight (a packed layer's too, where the own product is faster)
            tensors.extend([m.weight, none if m.bias is None else m.bias, none, none])
            ints.extend([3 if _laid_out(m) and own(m) else 0, 1, m.in_features, m.out_features])

    for b in t.h:
        tensors.extend([b.ln_1.weight, none if b.ln_1.bias is None else b.ln_1.bias,
                        b.ln_2.weight, none if b.ln_2.bias is None else b.ln_2.bias])
        for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj):
            product(m)
    product(model.lm_head)
    return [x.detach() for x in tensors], ints, float(t.ln_f.eps)


class PythonDecoder:
    """The Python twin of ``decode_step.cpp``'s ``Decoder``: the same operations, in the same order,
    on the same tensors, called from Python but without the model's modules between them (no
    ``nn.Module`` calls, no keyword arguments, no checks: :func:`why_not` made them once). What a
    machine without the C++ build runs for a batch-1 one-token step; its logits are the model's to
    the last bit (``tests/test_native.py``), and a step costs about 0.1 ms of Python less than
    :meth:`gptlab.GPT.decode` on GPT-2 Mini's shape.

    A plain layer's product is written into a buffer of its own, made once (``torch.addmm`` or
    ``torch.mm`` with ``out=``: the kernels ``F.linear`` calls, so the same bits), and the GELU
    runs in place on the ``c_fc`` product: no tensor is allocated per layer but the attention's
    output. That saved about 4% of a step on GPT-2 Mini's shape (``bench generate``).

    Built, like the C++ ``Decoder``, from the model with its packed layers installed and the
    cache whose buffers it writes in place; ``step(idx (1, 1), pos) -> logits (1, V)``.
    """

    def __init__(self, model: nn.Module, cache: Any):
        c, t = model.config, model.transformer
        self.C, self.shape, self.eps = c.n_embd, (c.n_embd,), float(t.ln_f.eps)
        self.heads = (1, 3, c.n_head, 1, c.head_dim)
        self.wte, self.wpe = t.wte.weight.detach(), t.wpe.weight.detach()
        self.lnf = (t.ln_f.weight.detach(), _detached(t.ln_f.bias))
        dtype = self.wte.dtype
        # A plain c_attn writes its product into one buffer whose q, k and v views are made once.
        self.qkv = torch.empty(1, 3 * c.n_embd, dtype=dtype)
        self.qkv_views = self.qkv.view(self.heads).unbind(1)
        attn_out, fc_out, mlp_out = (torch.empty(1, n, dtype=dtype) for n in (c.n_embd, c.inner_dim, c.n_embd))
        self.layers = [(b.ln_1.weight.detach(), _detached(b.ln_1.bias), b.ln_2.weight.detach(), _detached(b.ln_2.bias),
                        _plain(b.attn.c_attn), _product(b.attn.c_attn), _into(b.attn.c_proj, attn_out),
                        _into(b.mlp.c_fc, fc_out), _into(b.mlp.c_proj, mlp_out), cache.k[i], cache.v[i])
                       for i, b in enumerate(t.h)]
        self.head = _product(model.lm_head)  # the logits: a new tensor per step (the caller keeps them)
        self.x = torch.empty(1, c.n_embd, dtype=dtype)  # the residual stream, added to in place

    def step(self, idx: Tensor, pos: int) -> Tensor:
        """The token idx (1, 1) at position ``pos`` (the cache holds 0 .. pos - 1) -> next-token
        logits (1, V); writes its keys and values at slot ``pos``."""
        C, shape, eps, layer_norm, end = self.C, self.shape, self.eps, torch.layer_norm, pos + 1
        qkv, views = self.qkv, self.qkv_views
        x = torch.add(torch.embedding(self.wte, idx).view(1, C), self.wpe.narrow(0, pos, 1), out=self.x)
        for ln1_w, ln1_b, ln2_w, ln2_b, plain, attn, attn_proj, fc, mlp_proj, k, v in self.layers:
            h = layer_norm(x, shape, ln1_w, ln1_b, eps)
            if plain is None:
                q, k_new, v_new = attn(h).view(self.heads).unbind(1)
            else:
                plain(h, out=qkv)
                q, k_new, v_new = views
            k.narrow(2, pos, 1).copy_(k_new)
            v.narrow(2, pos, 1).copy_(v_new)
            y = _sdpa(q, k.narrow(2, 0, end), v.narrow(2, 0, end))
            x.add_(attn_proj(y.view(1, C)))
            x.add_(mlp_proj(_gelu_(fc(layer_norm(x, shape, ln2_w, ln2_b, eps)), approximate="tanh")))
        return self.head(layer_norm(x, shape, self.lnf[0], self.lnf[1], eps))


_sdpa, _gelu = torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.gelu
_gelu_ = torch._C._nn.gelu_  # in place: the kernel of F.gelu, the same bits
_silu = torch.nn.functional.silu


# Up to this many threads a SwiGLU's c_fc multiplies its chunks in two row blocks (the gate's and the
# up projection's) rather than in 2 * threads (LlamaPythonDecoder)
SWIGLU_TWO_BLOCKS_THREADS = 2


class LlamaPythonDecoder:
    """The Python twin of :meth:`gptlab.GPT.decode`'s one-token step for the pre-norm architectures
    the C++ step does not reproduce (:func:`why_not_python`): Llama's block (RoPE, RMSNorm, SwiGLU,
    grouped-query attention) and any mix of those with GPT-2's parts. It makes the PyTorch calls
    the model's modules make for one token with a :class:`~gptlab.kvcache.StaticKVCache`, in the
    same order, on the same tensors, without the modules between them:

    * the token's embedding (plus its learned position's row, where the model has one);
    * per block, the norm (``torch.rms_norm``, the kernel :class:`~gptlab.layers.RMSNorm` calls in
      eval mode for float32, or ``torch.layer_norm``), ``c_attn``'s product, the heads as the
      attention's views of it; with RoPE, :func:`gptlab.rope.apply_rope` on the query and key heads
      together with the model's own tables' row ``pos`` (what ``apply_rope_train`` runs without a
      gradient); the key and value written at slot ``pos`` of the cache's buffers; with fewer
      key/value heads, ``repeat_interleave`` of the cached keys and values; PyTorch's fused
      attention; ``c_proj``; the residual add; the norm; the MLP (``silu(gate) * up`` from
      ``c_fc``'s two halves, or GELU); the residual add;
    * the final norm and ``lm_head``.

    Its logits and cache writes are the model's to the last bit (``tests/test_python_step.py``).
    Built from the model with its packed layers installed and the cache whose buffers it writes;
    ``step(idx (1, 1), pos) -> logits (1, V)``. ``chunk_product(layer)``, where given, returns the
    product :meth:`chunk` runs for that layer instead (``native_decode`` gives the C++ step's own
    product where it is built and faster: the chunk's logits then equal the model's up to float
    rounding).
    """

    def __init__(self, model: nn.Module, cache: Any,
                 chunk_product: Callable[[nn.Module], Callable[[Tensor], Tensor] | None] | None = None):
        c, t = model.config, model.transformer
        nh, nkv, hd = c.n_head, c.kv_heads, c.head_dim
        self.C, self.shape, self.q_dim = c.n_embd, (c.n_embd,), nh * hd
        self.nh, self.nkv, self.groups = nh, nkv, nh // nkv
        self.rope = c.pos_emb == "rope"
        # the attention's heads for one token: one view and unbind without RoPE and with full heads,
        # else (1, 1, nh + 2 nkv, hd) -> transposed, split in (q and k) and v
        self.full_view = (1, 3, nh, 1, hd)
        self.heads = (1, 1, nh + 2 * nkv, hd)
        self.split = (nh + nkv, nkv)
        self.qk_split = (nh, nkv)
        self.wte = t.wte.weight.detach()
        self.wpe = None if self.rope else t.wpe.weight.detach()
        if self.rope:
            self.cos, self.sin = model.rope_cos, model.rope_sin
        self.norm = _norm_call(t.ln_f)
        self.swiglu = c.mlp == "swiglu"
        self.layers = [(_norm_call(b.ln_1), _norm_call(b.ln_2), _plain(b.attn.c_attn), _product(b.attn.c_attn),
                        _product(b.attn.c_proj), _product(b.mlp.c_fc), _product(b.mlp.c_proj), cache.k[i], cache.v[i])
                       for i, b in enumerate(t.h)]
        self.head = _product(model.lm_head)
        self.qkv = torch.empty(1, (nh + 2 * nkv) * hd, dtype=self.wte.dtype)  # a plain c_attn's output

        others: list[nn.Module] = []  # the layers whose chunk products are not the model's

        def for_chunks(m: nn.Module) -> Callable[[Tensor], Tensor]:
            f = None if chunk_product is None else chunk_product(m)
            if f is not None:
                others.append(m)
            return _product(m) if f is None else f

        # the chunk's products per block: c_attn, c_proj, c_fc, the MLP's c_proj; then lm_head's
        self.chunk_products = [tuple(for_chunks(m) for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj))
                               for b in t.h]
        self.chunk_head = for_chunks(model.lm_head)
        if self.swiglu and torch.get_num_threads() <= SWIGLU_TWO_BLOCKS_THREADS:
            # SwiGLU's c_fc in two row blocks, the gate's and the up projection's, on up to two threads
            # as fast as in four (1024 x 192 by 15 vectors: 41 us either way on the AMD EPYC measured):
            # the lean path then multiplies one by the other as they are (4 us against 7 with the
            # blocks reordered)
            self.chunk_products = [(a, p, _InPlaceBlocks(f.layer, 2) if type(f) is _InPlaceBlocks else f, mp)
                                   for a, p, f, mp in self.chunk_products]
        # Where some product is not the model's, a chunk of more than BAG_MAX_ROWS tokens equals the
        # model's up to float rounding only, and runs the lean path (_lean_chunk)
        self.lean = bool(others)
        self.scale = 1.0 / math.sqrt(hd)  # the fused attention's default

    def step(self, idx: Tensor, pos: int) -> Tensor:
        """The token idx (1, 1) at position ``pos`` (the cache holds 0 .. pos - 1) -> next-token
        logits (1, V); writes its keys and values at slot ``pos``."""
        rope, swiglu, groups = self.rope, self.swiglu, self.groups
        x = torch.embedding(self.wte, idx).view(1, self.C)  # a new tensor: added to in place
        if rope:
            cos, sin = self.cos.narrow(0, pos, 1), self.sin.narrow(0, pos, 1)
        else:
            x = x + self.wpe.narrow(0, pos, 1)
        for norm_1, norm_2, plain, attn, attn_proj, fc, mlp_proj, k_buf, v_buf in self.layers:
            h = norm_1(x)
            if plain is None:
                qkv = attn(h)
            else:
                qkv = plain(h, out=self.qkv)
            if not rope and groups == 1:  # the attention's one-token views
                q, k, v = qkv.view(self.full_view).unbind(1)
            else:
                qk, v = qkv.view(self.heads).transpose(1, 2).split(self.split, dim=1)
                if rope:
                    qk = apply_rope(qk, cos, sin)
                q, k = qk.split(self.qk_split, dim=1)
            k, v = _cache_update(k_buf, v_buf, k, v, pos, groups)
            y = _sdpa(q, k, v)
            x.add_(attn_proj(y.reshape(1, self.q_dim)))
            x.add_(mlp_proj(_activation(fc(norm_2(x)), swiglu)))
        return self.head(self.norm(x))

    def chunk(self, idx: Tensor, pos: int, last_only: bool = False) -> Tensor:
        """Several tokens idx (1, T), 2 <= T <= ``CHUNK_MAX_TOKENS``, at positions ``pos .. pos + T - 1``
        (the cache holds 0 .. pos - 1) -> next-token logits (1, T, V), or (1, 1, V) for the last one
        with ``last_only``; writes their keys and values at slots ``pos .. pos + T - 1``.

        Speculative decoding's verification (the last token and the draft's guesses in one pass), a
        short prompt's prefill: :meth:`gptlab.GPT.decode`'s calls for T tokens, in its order, to the
        last bit, without the modules between them (the causal slot mask made once, the heads as
        views of ``c_attn``'s product, RoPE's rows ``pos .. pos + T - 1``, PyTorch's fused attention
        under the mask, the norms and products of :meth:`step` on T rows); with ``chunk_product``
        given, its products instead (the logits then equal the model's up to float rounding), and
        where one of them is not the model's, for more than ``BAG_MAX_ROWS`` tokens, the same
        arithmetic in fewer calls (:meth:`_lean_chunk`)."""
        T = idx.shape[1]
        if self.lean and T > cpu.BAG_MAX_ROWS:
            return self._lean_chunk(idx, pos, last_only)
        end, rope, swiglu, groups = pos + T, self.rope, self.swiglu, self.groups
        x = torch.embedding(self.wte, idx)  # (1, T, C)
        if rope:
            cos, sin = self.cos.narrow(0, pos, T), self.sin.narrow(0, pos, T)
        else:
            x = x + self.wpe.narrow(0, pos, T)
        # as GPT.forward: from an empty cache PyTorch's causal flag, else the slot mask (T, end) under
        # which query t sees keys 0 .. pos + t
        mask = None if pos == 0 else slot_mask(pos, T, 0, end, device=x.device)
        heads = (1, T, self.heads[2], self.heads[3])
        for (norm_1, norm_2, *_, k_buf, v_buf), (attn, attn_proj, fc, mlp_proj) in zip(self.layers, self.chunk_products):
            qk, v = attn(norm_1(x)).view(heads).transpose(1, 2).split(self.split, dim=1)
            if rope:
                qk = apply_rope(qk, cos, sin)
            q, k = qk.split(self.qk_split, dim=1)
            k, v = _cache_update(k_buf, v_buf, k, v, pos, groups)
            y = _sdpa(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=mask is None)
            x = x + attn_proj(y.transpose(1, 2).reshape(1, T, self.q_dim))
            x = x + mlp_proj(_activation(fc(norm_2(x)), swiglu))
        x = self.norm(x)
        return self.chunk_head(x.narrow(1, T - 1, 1) if last_only else x)

    def _lean_chunk(self, idx: Tensor, pos: int, last_only: bool) -> Tensor:
        """:meth:`chunk` where its products already equal the model's up to float rounding only
        (the weight's row blocks in place, the C++ step's own product): the same arithmetic in fewer
        calls, equal to the model's up to float rounding. Each call from Python costs about a
        microsecond or two besides its work, and a verification makes about 30 a block, so:

        * a product over row blocks is one ``torch.bmm`` whose outputs stay block by block, (P, T,
          part): the residual add reads them so (no reordering copy), SwiGLU's halves are blocks;
        * RoPE rotates the query and key heads into one buffer in three calls
          (:func:`gptlab.rope.apply_rope_into`: multiply-adds, where :func:`~gptlab.rope.apply_rope`
          negates, concatenates, multiplies twice and adds);
        * the attention is written out, ``softmax(q k^T / sqrt(d) + mask) v`` by ``baddbmm``,
          ``softmax`` and ``bmm``, a float mask made once a chunk (0 where a query may look, ``-inf``
          after its own slot), and grouped-query heads share their keys as a batch (no repeated
          copies of the keys and values). For 15 queries over 55 keys of 6 heads (the benchmark's
          verification) this took 15 us against 22 for PyTorch's fused CPU kernel under a bool mask
          on the AMD EPYC measured.

        A 15-token verification of ``bench speculative``'s target took 1161 against 1278 us there
        (best of 400, alternating; medians 1230 and 1349)."""
        T = idx.shape[1]
        end, C, nh, nkv, groups, hd = pos + T, self.C, self.nh, self.nkv, self.groups, self.heads[3]
        x = torch.embedding(self.wte, idx).view(T, C)
        if self.rope:
            cos, sin = self.cos.narrow(0, pos, T), self.sin.narrow(0, pos, T)
        else:
            x = x + self.wpe.narrow(0, pos, T)
        # 0 where query t may look (keys 0 .. pos + t), -inf after: the slot mask (gptlab.masks.slot_mask)
        # as a float mask; one row block per group of query heads that share a key head
        mask = torch.full((T, end), float("-inf"), dtype=x.dtype).triu_(pos + 1)
        if groups != 1:
            mask = mask.repeat(groups, 1)  # (groups * T, end)
        bmm, baddbmm, n_qk = torch.bmm, torch.baddbmm, nh + nkv
        for (norm_1, norm_2, *_, k_buf, v_buf), (attn, attn_proj, fc, mlp_proj) in zip(self.layers, self.chunk_products):
            heads = _blocks_in_order(_by_blocks(attn, norm_1(x)), T).view(T, n_qk + nkv, hd).transpose(0, 1)
            if self.rope:  # the query and key heads rotated into a buffer of their own
                qk = apply_rope_into(torch.empty(n_qk, T, hd, dtype=x.dtype), heads.narrow(0, 0, n_qk), cos, sin)
            else:
                qk = heads.narrow(0, 0, n_qk)
            k_buf.narrow(2, pos, T).copy_(qk.narrow(0, nh, nkv)[None])
            v_buf.narrow(2, pos, T).copy_(heads.narrow(0, n_qk, nkv)[None])
            keys, values = k_buf[0].narrow(1, 0, end), v_buf[0].narrow(1, 0, end)  # (nkv, end, hd)
            q = qk.narrow(0, 0, nh).reshape(nkv, groups * T, hd)
            weights = baddbmm(mask, q, keys.transpose(1, 2), alpha=self.scale).softmax(-1)
            y = bmm(weights, values).view(nh, T, hd).transpose(0, 1).reshape(T, nh * hd)
            x = _add_blocks(x, _by_blocks(attn_proj, y))
            h = _by_blocks(fc, norm_2(x))  # (P, T, part)
            P = h.shape[0]
            if self.swiglu:
                if P % 2:  # the product's own layout: the two halves of its last dimension
                    gate, up = h[0].chunk(2, dim=-1)
                    h = _silu(gate).mul_(up)
                elif P == 2:  # the gate's block and the up projection's
                    h = _silu(h[0]).mul_(h[1])
                else:  # the first P / 2 blocks are the gate's, the others the up projection's
                    h = _blocks_in_order(_silu(h[: P // 2]).mul_(h[P // 2 :]), T)
            else:
                h = _gelu_(_blocks_in_order(h, T), approximate="tanh")
            x = _add_blocks(x, _by_blocks(mlp_proj, h))
        x = self.norm(x)
        return self.chunk_head((x.narrow(0, T - 1, 1) if last_only else x)[None])


def _by_blocks(product: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """A chunk product of x (T, in), block by block: (P, T, part) by one batched product over the
    weight's row blocks in place (:class:`_InPlaceBlocks`), else the product's own (1, T, out)."""
    if type(product) is _InPlaceBlocks:
        return cpu._outputs_by_block(x, product.blocks, product.bias)
    return product(x)[None]


def _blocks_in_order(y: Tensor, T: int) -> Tensor:
    """Outputs block by block, (P, T, part) -> (T, P * part): a new tensor, or where P is 1 a view of
    y (a product's own new output, so either may be written in place)."""
    return y.transpose(0, 1).reshape(T, -1)


def _add_blocks(x: Tensor, y: Tensor) -> Tensor:
    """The residual add of x (T, C) and a product's outputs block by block y (P, T, C / P) -> (T, C)."""
    T, C = x.shape
    return torch.add(x.view(T, y.shape[0], -1), y.transpose(0, 1)).view(T, C)


# The most tokens LlamaPythonDecoder.chunk takes in one call: the packed layers' products of at most
# this many vectors (gptlab.fast.cpu.PackedLinear); longer chunks run the model's own step.
CHUNK_MAX_TOKENS = cpu.ROW_SPLIT_MAX_ROWS


def _cache_update(k_buf: Tensor, v_buf: Tensor, k: Tensor, v: Tensor, pos: int, groups: int) -> tuple[Tensor, Tensor]:
    """What ``StaticKVCache.update`` and the attention do with a layer's new keys and values k, v
    (1, nkv, T, hd): written at slots ``pos .. pos + T - 1`` of the cache's buffers (1, nkv, max_len,
    hd), then every key and value so far read back (1, nkv, pos + T, hd), each repeated ``groups``
    times for grouped-query attention -> (1, nkv * groups, pos + T, hd)."""
    T, end = k.shape[2], pos + k.shape[2]
    k_buf.narrow(2, pos, T).copy_(k)
    v_buf.narrow(2, pos, T).copy_(v)
    k, v = k_buf.narrow(2, 0, end), v_buf.narrow(2, 0, end)
    if groups != 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return k, v


def _activation(h: Tensor, swiglu: bool) -> Tensor:
    """The MLP's activation of ``c_fc``'s product h (..., n): SwiGLU's ``silu(gate) * up`` from its
    two halves (..., n / 2), or GELU (tanh) (..., n); the module's calls."""
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        return _silu(gate) * up
    return _gelu(h, approximate="tanh")


def _norm_call(m: nn.Module) -> Callable[[Tensor], Tensor]:
    """A norm module's call for a float32 vector (1, C) in eval mode, without the module: the kernel
    its ``forward`` calls there (``torch.rms_norm`` for :class:`~gptlab.layers.RMSNorm`,
    ``torch.layer_norm`` for :class:`~gptlab.layers.LayerNorm`)."""
    weight, eps = m.weight.detach(), float(m.eps)
    shape = tuple(weight.shape)
    if isinstance(m, RMSNorm):
        rms_norm = torch.rms_norm
        return lambda x: rms_norm(x, shape, weight, eps)
    bias, layer_norm = _detached(m.bias), torch.layer_norm
    return lambda x: layer_norm(x, shape, weight, bias, eps)


def _detached(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach()


def _plain(m: nn.Module) -> Callable[..., Tensor] | None:
    """A plain layer's product into a buffer, ``f(x, out=y)``, by the kernel ``F.linear`` runs
    (``addmm`` with a bias, ``mm`` without); None for a packed layer."""
    if isinstance(m, PackedLinear):
        return None
    wt = m.weight.detach().t()
    if m.bias is None:
        return lambda x, out: torch.mm(x, wt, out=out)
    return functools.partial(_addmm_out, m.bias.detach(), wt)


def _addmm_out(bias: Tensor, wt: Tensor, x: Tensor, out: Tensor) -> Tensor:
    return torch.addmm(bias, x, wt, out=out)


def _into(m: nn.Module, out: Tensor) -> Callable[[Tensor], Tensor]:
    """One linear layer's product of a vector (1, in) into ``out`` (1, out_features), a buffer the
    caller reuses, where the layer is plain (:func:`_plain`, ``F.linear``'s kernel: the same bits);
    a packed layer's product (:func:`_product`) is a new tensor, as in the model's step."""
    plain = _plain(m)
    return _product(m) if plain is None else functools.partial(plain, out=out)


def _product(m: nn.Module) -> Callable[[Tensor], Tensor]:
    """One linear layer's product of a vector (1, in) as the model's step computes it: the packed
    blocks' (:func:`gptlab.fast.cpu.blocks_product`) or ``F.linear`` on the plain weight."""
    if isinstance(m, PackedLinear):
        blocks = m.blocks
        return lambda x: cpu.blocks_product(x, blocks)
    weight, bias, linear = m.weight.detach(), _detached(m.bias), torch.nn.functional.linear
    return lambda x: linear(x, weight, bias)


_LAST: list[str | None] = [None]  # why the last decode did not use the C++ step (None: it did)
_STEP: list[str] = ["the C++ decode step"]  # which step the last decode ran, as last_use names it
_OFF: list[int] = [0]  # open disabled() blocks


@contextmanager
def disabled() -> Iterator[None]:
    """Within the block, decoders run the Python step (:class:`PythonDecoder`, what a machine
    without the build runs) even where the C++ one is built (a benchmark's comparison, a test of
    the Python path). The models of :class:`LlamaPythonDecoder` run it either way."""
    _OFF[0] += 1
    try:
        yield
    finally:
        _OFF[0] -= 1


PYTHON_STEP = "the Python decode step"  # PythonDecoder or LlamaPythonDecoder
MODEL_STEP = "the model's own step (GPT.decode)"


def last_use() -> str:
    """Which step the last decode of this process ran its one-token steps through, and if not the
    C++ one, why not: ``"the C++ decode step"``; ``"the Python decode step: <why not C++>"`` (a
    Python twin, :class:`PythonDecoder` or :class:`LlamaPythonDecoder`); or ``"the model's own step
    (GPT.decode): <why not C++>; <why no twin>"``."""
    return _STEP[0] if _LAST[0] is None else f"{_STEP[0]}: {_LAST[0]}"


def native_decode(model: nn.Module, cache: Any,
                  fallback: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """A decode function for the Runner: ``f(idx (B, T), cache, **kw) -> logits (B, V)`` that runs
    one-token, batch-1, unpadded steps on ``cache`` in C++ where it is built and reproduces the
    model (:func:`why_not`), else through the C++ step's Python twin, :class:`PythonDecoder` (a
    GPT-2 model where nothing is built, or under :func:`disabled`), or, for the other pre-norm
    architectures (Llama's), through :class:`LlamaPythonDecoder` (:func:`why_not_python`), and
    everything else through ``fallback`` (``model.decode``). Chunks of 2 to ``CHUNK_MAX_TOKENS``
    tokens (speculative decoding's verification with ``last_only=False``, short prefills) run
    :meth:`LlamaPythonDecoder.chunk` wherever that twin reproduces the model (GPT-2's architecture
    included), to the last bit of ``fallback``'s, or up to float rounding where the chunk's products
    are the C++ step's own (where it is built and faster: :func:`_own_chunks`) or batched over the
    weight's row blocks in place (:func:`gptlab.fast.cpu.splits_chunks`). Returns ``fallback`` itself where no
    step reproduces the model; :func:`last_use` says which step ran, and why not the C++ one. A
    decode of a GPT-2 model that runs the Python twin because nothing is built prints, once per
    process, how to build the C++ step (:func:`hint`); a Llama-style one does not (no build would
    run it).

    Call it with the model as the decode will run it (the packed layers installed): the step
    holds the tensors it finds now, and the cache's buffers.
    """
    reason = why_not(model, cache)
    twin_reason = why_not_python(model, cache)
    module = None if _OFF[0] else _module()
    # a chunk's products: the C++ step's own kernel where it is built and faster (_own_chunks), else
    # the batched product over the weight's row blocks in place (gptlab.fast.cpu.splits_chunks),
    # else the model's
    chunk_product = None
    if twin_reason is None:
        chunk_product = _chunk_products(model, module)
    if reason is not None:
        if twin_reason is not None:
            _STEP[0], _LAST[0] = MODEL_STEP, reason if twin_reason == reason else f"{reason}; for the Python twin: {twin_reason}"
            return fallback
        # an architecture the C++ step does not reproduce (no build would run it: no hint)
        _STEP[0], _LAST[0] = PYTHON_STEP, reason
        decoder: Any = LlamaPythonDecoder(model, cache, chunk_product)
    else:
        if module is not None:
            _STEP[0], _LAST[0] = "the C++ decode step", None
            tensors, ints, eps = _tensors(model, cache, _own(module, model))
            decoder = module.Decoder(tensors, ints, eps)
            kinds = ints[3::4]
            n_own = sum(k == 3 for k in kinds)
            _PRODUCTS[0] = (f"own product for {n_own} of {len(kinds)} linear layers, "
                            f"{'fused' if decoder.fused else 'PyTorch operations'} step")
        else:
            _STEP[0] = PYTHON_STEP
            _LAST[0] = "turned off (gptlab.fast.native.disabled)" if _OFF[0] else NOT_BUILT
            if not _OFF[0]:
                hint()
            decoder = PythonDecoder(model, cache)
    # chunks of several tokens (verification, short prefills) through the Llama twin's chunk, where it
    # reproduces the model (whichever step runs the one-token steps)
    chunks = None if twin_reason is not None else decoder if isinstance(decoder, LlamaPythonDecoder) \
        else LlamaPythonDecoder(model, cache, chunk_product)
    k, v = cache.k, cache.v

    def step(idx: Tensor, kv_cache: Any, **kw: Any) -> Tensor:
        if kv_cache is not cache or idx.dim() != 2 or idx.shape[0] != 1 or cache.k is not k or cache.v is not v \
                or torch.is_grad_enabled() or (kw and set(kw) != {"last_only"}):
            return fallback(idx, kv_cache, **kw)
        T, pos = idx.shape[1], cache.length
        if pos + T > cache.max_len:
            return fallback(idx, kv_cache, **kw)  # the cache's own error
        last_only = kw.get("last_only", True)
        if T == 1:
            logits = decoder.step(idx, pos)  # (1, V): the (1, 1, V) logits' only row
            cache.advance(1)
            return logits if last_only else logits[:, None]
        if chunks is None or T > CHUNK_MAX_TOKENS:
            return fallback(idx, kv_cache, **kw)
        logits = chunks.chunk(idx, pos, last_only)  # (1, T or 1, V)
        cache.advance(T)
        return logits.select(1, -1) if last_only else logits

    return step


_CHUNKS: list[str] = [""]  # the products the last chunks ran (last_chunk_products)
_CHUNKS_OF: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()  # the same, per model


def last_chunk_products(model: nn.Module | None = None) -> str:
    """How the chunks of the last decode that could run them (:meth:`LlamaPythonDecoder.chunk`)
    multiplied by the weights, of ``model``'s last such decode if given (speculative decoding's
    target: its verifications): ``"own product for N of M linear layers"`` where the C++ step is
    built, then ``"row blocks in place for K of M linear layers"`` where :func:`gptlab.fast.cpu.split_product`
    runs, ``"the model's products"`` where neither ("" before any)."""
    return _CHUNKS[0] if model is None else _CHUNKS_OF.get(model, "")


NOT_BUILT = "not built on this machine (python -m gptlab build-native)"
HINT = ("gptlab: batch-1 decoding runs its Python step here; `python -m gptlab build-native` (once per machine, "
        "needs a C++ compiler) runs its steps in C++, faster")
_HINTED: list[bool] = [False]


def hint() -> bool:
    """Print :data:`HINT` to stderr, once per process; return whether it printed now. Never where
    no one reads it: under pytest, in CI (``$CI``), in the book's unattended builds
    (``GPTLAB_PROGRESS=text``, which ``make book`` sets), or with ``GPTLAB_NATIVE_HINT=0``."""
    env = os.environ
    if _HINTED[0] or env.get("GPTLAB_NATIVE_HINT") == "0" or "PYTEST_CURRENT_TEST" in env or env.get("CI") \
            or env.get("GPTLAB_PROGRESS") == "text":
        return False
    _HINTED[0] = True
    print(HINT, file=sys.stderr)
    return True
