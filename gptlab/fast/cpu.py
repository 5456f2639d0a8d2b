"""Fast batch-1 decoding on a CPU: a model's linear layers swapped, for the length of a decode, for
layers that multiply by a copy of their weight packed in row blocks.

Why. A decode step multiplies a handful of vectors by each weight matrix, so it is memory-bound
(every 4-byte weight is read once per token for two floating-point operations per vector): what
counts is how fast the weights stream from memory. ``F.linear`` runs one vector's product on one
core. Packed, the weight's rows are split in blocks, twice as many as there are threads, each
stored transposed and contiguous (:func:`row_blocks`), and one call spreads the blocks over the
cores (:func:`blocks_product`): one vector's product as an embedding-bag sum where FBGEMM's kernel
exists (x86 CPUs), a batched product elsewhere. Each output is the same dot product, summed in
another order: equal to ``F.linear``'s up to float rounding.

What it costs: the packed copy is as large as the weight, and packing it takes time. So the copy
is made afresh for each decode and used only while it runs (:func:`pack_for_decoding` makes it,
swaps the layers in, and puts the originals back after, an exception included), and only where it
pays off on the machine at hand. Its memory is kept for the layer's next packing, up to
``KEEP_PACKED_BYTES`` in all: new memory costs the page faults of its first write
(:func:`forget_packed_memory` frees it). Where it pays off: :func:`calibrate` times a decode
step's product both ways for each of the model's weight shapes, once per machine (cached in
``cache_dir() / "fast-cpu.json"`` under the CPU's name, the thread count and the torch version),
and :func:`decode_plan` packs a layer when its packed product is clearly faster and the decode is
long enough to pay the packing back. :func:`last_plan` is the plan the last decode of this process
ran (``python -m gptlab bench generate`` prints it).

Outside a ``pack_for_decoding`` block nothing here changes what a model computes: the model is
built from ``nn.Linear`` (:mod:`gptlab.layers`, :mod:`gptlab.attention`, :mod:`gptlab.model`, which
never import this module), and its state dict and checkpoints are the same with or without it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..assets import cache_dir
from ..device import cpu_model
from ..files import atomic_write_json

__all__ = [
    "PackedLinear",
    "pack_for_decoding",
    "packed_layers",
    "Packing",
    "decode_plan",
    "Plan",
    "last_plan",
    "calibrate",
    "Timing",
    "machine_key",
    "calibration_path",
    "row_split_linear",
    "forget_packed_memory",
    "KEEP_PACKED_BYTES",
    "RowBlocks",
    "row_blocks",
    "blocks_product",
    "bag_product",
    "batched_product",
    "split_product",
    "split_blocks",
    "splits_chunks",
    "packing_off",
]

ROW_SPLIT_MAX_ROWS = 32  # packed products for at most this many input vectors (decode steps, short chunks)
# Up to this many vectors, one embedding-bag call (P bags per vector); more: one batched product.
# A batched BLAS product of 1-3 vectors per block ran 2-3x slower than of 4 on the AMD EPYC
# measured (``torch.bmm`` picks another kernel below 4 rows), the bag no slower than linear in n.
BAG_MAX_ROWS = 3
# Weights with fewer numbers (64 KB in float32) stay plain without being timed: they sit in the
# caches between tokens and their product takes a few microseconds, mostly the call itself.
SMALLEST_MEASURED = 1 << 14
FASTER_BY = 0.9  # packed only when its product takes under 90% of the plain one's (beyond timing noise)
CALIBRATION_FILE = "fast-cpu.json"
# One vector's product as an embedding-bag sum where PyTorch has FBGEMM's kernel for it (x86 CPUs);
# elsewhere the bag is a plain loop, and the batched product is faster.
EMBEDDING_BAG_PRODUCT = "fbgemm" in torch.backends.quantized.supported_engines


# --------------------------------------------------------------------------- the packed product


class RowBlocks(NamedTuple):
    """A weight (out, in) and bias (out,) packed for decoding's products (:func:`row_blocks`)."""

    weight: Tensor  # (P, in, part): block p is rows p*part .. (p+1)*part - 1 of the weight, transposed
    bias: Tensor | None  # (P, 1, part): the same slices of the bias
    out_features: int  # out <= P * part: the last block is padded with zero rows
    indices: Tensor  # (P * in,) int64: 0, 1, ..., P*in - 1, every row of every block, in order
    offsets: Tensor  # (P,) int64: 0, in, 2 in, ..., where each block's rows start
    many_indices: Tensor  # (BAG_MAX_ROWS * P * in,) int64: ``indices`` once per vector, for up to BAG_MAX_ROWS
    many_offsets: Tensor  # (BAG_MAX_ROWS * P,) int64: where each (vector, block) bag starts


def row_blocks(weight: Tensor, bias: Tensor | None, parts: int, *, into: Tensor | None = None) -> RowBlocks:
    """Pack ``weight`` (out, in) and ``bias`` (out,) for :func:`blocks_product`: the weight's rows
    in ``parts`` equal blocks of ``part = ceil(out / P)`` rows (zero rows pad the last block), each
    stored transposed and contiguous, (P, in, part), the bias likewise (P, 1, part). A copy,
    detached from autograd: :class:`PackedLinear` makes it once, when it is made. ``into``: a
    contiguous (P, in, part) tensor of the weight's dtype and device to write the blocks into
    (memory kept from an earlier packing); else (or if it does not fit) new memory."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an int >= 1, got {parts!r}")
    out, inp = weight.shape
    part = -(-out // parts)
    with torch.no_grad():
        padded = weight
        if parts * part != out:  # zero rows pad the last block (else the weight is copied once, here:)
            padded = weight.new_zeros(parts * part, inp)
            padded[:out] = weight
        blocks = padded.reshape(parts, part, inp).transpose(1, 2)  # (P, in, part), a view
        if into is not None and into.shape == blocks.shape and into.dtype == blocks.dtype \
                and into.device == blocks.device and into.is_contiguous() \
                and (torch.is_inference_mode_enabled() or not into.is_inference()):  # else not writable here
            blocks = into.copy_(blocks)
        else:
            blocks = blocks.contiguous()
        bias_blocks = None
        if bias is not None:
            bias_blocks = bias.new_zeros(parts * part)
            bias_blocks[:out] = bias
            bias_blocks = bias_blocks.view(parts, 1, part)
    indices = torch.arange(parts * inp, device=weight.device)
    offsets = torch.arange(0, parts * inp, max(inp, 1), device=weight.device)
    # a bag per block per vector: the first n * P bags serve n vectors (prefixes, no copy)
    many_offsets = torch.arange(0, BAG_MAX_ROWS * parts * inp, max(inp, 1), device=weight.device)
    return RowBlocks(blocks, bias_blocks, out, indices, offsets, indices.repeat(BAG_MAX_ROWS), many_offsets)


def blocks_product(x: Tensor, blocks: RowBlocks) -> Tensor:
    """``F.linear(x, weight, bias)`` from the packed weight of :func:`row_blocks`: x (..., in) ->
    (..., out), the P blocks in one call that spreads them over the cores.

    Up to ``BAG_MAX_ROWS`` vectors (a batch-1 decode step, the case that matters, and speculative
    decoding's short verifications) run :func:`bag_product` where FBGEMM's embedding-bag kernel
    exists (``EMBEDDING_BAG_PRODUCT``: x86 CPUs); more vectors, or where that kernel is missing,
    run :func:`batched_product`. ``python -m gptlab bench generate`` measures both on one vector.
    """
    inp = blocks.weight.shape[1]
    if EMBEDDING_BAG_PRODUCT and inp > 0 and 0 < x.numel() <= BAG_MAX_ROWS * inp:
        return bag_product(x, blocks)
    return batched_product(x, blocks)


def bag_product(x: Tensor, blocks: RowBlocks) -> Tensor:
    """A few vectors' product from the packed blocks: x (..., in) holding n <= ``BAG_MAX_ROWS``
    vectors -> (..., out).

    ``y = sum_i x_i W^T[i, :]`` is a weighted sum of the rows of ``W^T``, exactly what
    ``torch.embedding_bag`` computes (mode sum with ``per_sample_weights``, one bag per block and
    vector). Its kernel streams the table from memory several times faster than a BLAS
    matrix-vector product on the CPUs measured, and a decode step spends most of its time reading
    weights.
    """
    w = blocks.weight
    P, inp, part = w.shape
    n = x.numel() // inp
    if n > BAG_MAX_ROWS:
        raise ValueError(f"bag_product takes at most BAG_MAX_ROWS={BAG_MAX_ROWS} vectors, got {n}")
    if n == 1:  # the decode step: x once per block
        weights, indices, offsets = torch.cat([x.reshape(inp)] * P), blocks.indices, blocks.offsets
    else:  # (n * P * in,): each vector once per block
        weights = x.reshape(n, 1, inp).expand(n, P, inp).reshape(-1)
        indices, offsets = blocks.many_indices[: n * P * inp], blocks.many_offsets[: n * P]
    y = torch.embedding_bag(w.view(P * inp, part), indices, offsets, per_sample_weights=weights)[0]  # (n * P, part)
    if blocks.bias is not None:  # y (n * P, part) is a new tensor: add in place
        y = y.view(n, P, part).add_(blocks.bias.view(P, part))
    y = y.view(*x.shape[:-1], P * part)
    return y if P * part == blocks.out_features else y.narrow(-1, 0, blocks.out_features)


def batched_product(x: Tensor, blocks: RowBlocks) -> Tensor:
    """Any number of vectors' product from the packed blocks: x (..., in) -> (..., out), one
    batched matrix product (``torch.baddbmm``) that reads each block once for all the vectors."""
    return _blocks_bmm(x, blocks.weight, blocks.bias, blocks.out_features)


def _blocks_bmm(x: Tensor, w: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """x (..., in) times the row blocks w (P, in, part) (bias (P, 1, part)) -> (..., out_features)."""
    P, inp, part = w.shape
    lead = x.shape[:-1]
    y = _outputs_by_block(x.reshape(math.prod(lead), inp), w, bias)  # (P, n, part)
    y = y.transpose(0, 1).reshape(*lead, P * part)  # (n, P, part): block p holds outputs p*part ..
    return y if P * part == out_features else y.narrow(-1, 0, out_features)


def _outputs_by_block(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x (n, in) times the row blocks w (P, in, part) (bias (P, 1, part)), one batched product, the
    outputs left block by block: (P, n, part)."""
    xs = x.expand(w.shape[0], *x.shape)
    return torch.bmm(xs, w) if bias is None else torch.baddbmm(bias, xs, w)


def row_split_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, parts: int = 2) -> Tensor:
    """``F.linear(x, weight, bias)`` computed as :class:`PackedLinear` computes a decode step's
    product: x (..., in), weight (out, in), bias (out,) -> (..., out), the weight's rows split in
    ``parts`` blocks (:func:`row_blocks`) multiplied in one call (:func:`blocks_product`). Equal to
    ``F.linear``'s result up to float rounding (the same sums in another order). This packs the
    weight on every call; :class:`PackedLinear` packs it once.
    """
    return blocks_product(x, row_blocks(weight, bias, parts))


# The memory of a layer's packed copy is kept when its PackedLinear is dropped (at the end of a decode),
# up to this many bytes for all layers together, and the layer's next packing writes into it. New
# memory costs the page faults of its first write: the copies of the speculative benchmark's 7.4 MB
# target took 2.7 ms into new memory, 0.6 ms into memory written before, on the AMD EPYC measured
# (2 threads; its whole pack_for_decoding 3.65 -> 1.52 ms).
KEEP_PACKED_BYTES = 64 << 20
_SPARE: "weakref.WeakKeyDictionary[nn.Module, Tensor]" = weakref.WeakKeyDictionary()  # layer -> its kept blocks


def _keep_spare(layer_ref: "weakref.ref[nn.Module]", blocks: Tensor) -> None:
    """A PackedLinear was dropped: keep its blocks' memory for its layer's next packing, within
    ``KEEP_PACKED_BYTES`` (else it is freed)."""
    layer = layer_ref()
    if layer is None or layer in _SPARE:
        return
    size = blocks.numel() * blocks.element_size()
    if sum(t.numel() * t.element_size() for t in list(_SPARE.values())) + size <= KEEP_PACKED_BYTES:
        _SPARE[layer] = blocks


def _spare_memory(layer: nn.Module) -> Tensor | None:
    """The memory kept for ``layer`` (taken out of the pool), if nothing else holds it: no view of
    it, no decoder still reading it (its storage's use count is that of a lone tensor's)."""
    kept = _SPARE.pop(layer, None)
    return kept if kept is not None and _storage_uses(kept) <= _storage_uses(torch.empty(1)) else None


def _storage_uses(t: Tensor) -> int:
    """How many tensors (Python's or C++'s) hold ``t``'s storage, plus the storage object asked
    (PyTorch's own count); a large number where PyTorch has no such count (then nothing is reused)."""
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return 1 << 30


def forget_packed_memory() -> int:
    """Free the packed copies' memory kept between decodes (``KEEP_PACKED_BYTES``); returns the bytes
    let go."""
    kept = list(_SPARE.values())
    _SPARE.clear()
    return sum(t.numel() * t.element_size() for t in kept)


# Hook dictionaries a PackedLinear shares with the layer it stands in for: hooks registered on the
# model's layers (the chapters' shape traces, the kv_cache grader's counters) keep running.
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class PackedLinear(nn.Module):
    """Stands in for an ``nn.Linear`` while decoding: the same ``weight`` and ``bias`` (the same
    Parameter objects, shared, never copied: the state dict keeps its names and tensors) and a copy
    of them packed in ``parts`` row blocks (:func:`row_blocks`), made once, here.

    A product of at most ``ROW_SPLIT_MAX_ROWS`` input vectors without autograd (a decode step, a
    short prompt, speculative verification) runs :func:`blocks_product` on the copy; anything else
    (training, a long prefill) runs ``F.linear`` on the shared weight. The copy does not follow
    later changes of the weight: make a new one (:func:`pack_for_decoding` packs afresh for each
    decode). The layer's hooks keep running (the hook dictionaries are shared with it).
    """

    def __init__(self, linear: nn.Linear, parts: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.parts = parts
        # a plain attribute (no state dict entry), written into the memory of the layer's last packed
        # copy where it was kept (_spare_memory), which it returns to when this stand-in is dropped
        self.blocks = row_blocks(linear.weight, linear.bias, parts, into=_spare_memory(linear))
        weakref.finalize(self, _keep_spare, weakref.ref(linear), self.blocks.weight).atexit = False
        self.training = linear.training
        for name in _HOOKS:
            if name in linear.__dict__:
                self.__dict__[name] = linear.__dict__[name]

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() and x.numel() <= ROW_SPLIT_MAX_ROWS * self.in_features \
                and x.dtype == self.blocks.weight.dtype:
            return blocks_product(x, self.blocks)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, parts={self.parts}"


# --------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Timing:
    """One weight shape's decode-step product on this machine, microseconds, best of the rounds."""

    plain_us: float  # F.linear on one vector
    packed_us: float  # blocks_product on one vector
    pack_us: float  # row_blocks: making the packed copy

    @property
    def faster(self) -> bool:
        """The packed product is clearly faster (beyond timing noise: ``FASTER_BY``)."""
        return self.packed_us < FASTER_BY * self.plain_us

    @property
    def pay_back_steps(self) -> float:
        """How many decode steps the packing takes to pay back (inf: never)."""
        gain = self.plain_us - self.packed_us
        return math.inf if gain <= 0 else self.pack_us / gain


def machine_key() -> str:
    """What a calibration holds for: the CPU's name, the thread count (the blocks are twice as
    many), the torch version, and the kernel of one vector's packed product."""
    kernel = "embedding_bag" if EMBEDDING_BAG_PRODUCT else "bmm"
    return f"{cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__} | {kernel}"


def calibration_path() -> Path:
    """Where calibrations are kept: ``cache_dir() / "fast-cpu.json"`` (``$GPTLAB_CACHE``)."""
    return cache_dir() / CALIBRATION_FILE


# The timings read or measured by this process, per (calibration file, machine key).
_TIMINGS: dict[tuple[str, str], dict[str, Timing]] = {}


def _shape(linear: nn.Linear) -> str:
    return f"{linear.out_features}x{linear.in_features}"


def _read(path: Path, key: str) -> dict[str, Timing]:
    """The timings saved for ``key`` ({} when the file is missing, unreadable or holds others)."""
    try:
        machines = json.loads(path.read_text(encoding="utf-8")).get("machines", {})
        saved = machines.get(key, {})
    except (OSError, ValueError, AttributeError):
        return {}
    out = {}
    for shape, t in saved.items() if isinstance(saved, dict) else ():
        try:
            out[shape] = Timing(float(t["plain_us"]), float(t["packed_us"]), float(t["pack_us"]))
        except (KeyError, TypeError, ValueError):
            continue  # a damaged entry is measured again
    return out


def _busy() -> bool:
    """The machine is busy: its load average over the last minute is at least its core count.
    Other processes then take the cores from the threads of a parallel product, which can make
    it a hundred times slower; a calibration measured then is not saved."""
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except (AttributeError, OSError):  # no load average (Windows)
        return False


def _save(path: Path, key: str, timings: dict[str, Timing]) -> None:
    """Merge ``timings`` into the file (atomically). A cache that cannot be written is no error:
    the timings still hold for this process."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("machines"), dict):
            raise ValueError
    except (OSError, ValueError):
        data = {"version": 1, "machines": {}}
    entry = data["machines"].setdefault(key, {})
    if not isinstance(entry, dict):
        entry = data["machines"][key] = {}
    entry.update({shape: asdict(t) for shape, t in timings.items()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, data)
    except OSError:
        pass


def _measure(layers: list[nn.Linear], parts: int, rounds: int) -> dict[str, Timing]:
    """Time one vector's product by each layer both ways, in the model's order (so the weights
    stream from memory as in a decode step), the two ways alternating round after round; per shape
    the best round's mean per layer."""
    shapes = [_shape(m) for m in layers]
    count = Counter(shapes)
    pack_ns: dict[str, list[int]] = {}
    blocks = []
    with torch.no_grad():
        for m, s in zip(layers, shapes):
            t0 = time.perf_counter_ns()
            blocks.append(row_blocks(m.weight, m.bias, parts))
            pack_ns.setdefault(s, []).append(time.perf_counter_ns() - t0)
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(1, m.in_features, generator=g) for m in layers]
        ways = {
            "plain": lambda i: F.linear(xs[i], layers[i].weight, layers[i].bias),
            "packed": lambda i: blocks_product(xs[i], blocks[i]),
        }
        best: dict[str, dict[str, float]] = {"plain": {}, "packed": {}}
        for r in range(rounds + 1):  # round 0 warms up
            for way in ("plain", "packed") if r % 2 else ("packed", "plain"):
                run, total = ways[way], dict.fromkeys(count, 0)
                for i, s in enumerate(shapes):
                    t0 = time.perf_counter_ns()
                    run(i)
                    total[s] += time.perf_counter_ns() - t0
                if r:
                    for s, t in total.items():
                        best[way][s] = min(best[way].get(s, math.inf), t / count[s])
    return {s: Timing(best["plain"][s] / 1e3, best["packed"][s] / 1e3, statistics.median(pack_ns[s]) / 1e3)
            for s in count}


def _candidates(model: nn.Module) -> tuple[list[tuple[str, nn.Linear]], dict[str, str], dict[str, str]]:
    """The model's linear layers that could be packed (plain ``nn.Linear``, float32 weights on the
    CPU, not the model itself), the others' reasons, and every linear layer's shape by name."""
    ok, why, shapes = [], {}, {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        shapes[name] = _shape(m)
        w = m.weight
        if not name:
            why[name or "(the model)"] = "the model itself: no parent to swap it in"
        elif type(m) is not nn.Linear:
            why[name] = f"a subclass of nn.Linear ({type(m).__name__}): its forward may differ"
        elif w.device.type != "cpu" or w.is_meta:
            why[name] = f"weights on {w.device}, not the CPU"
        elif w.dtype != torch.float32:
            why[name] = f"weights in {w.dtype}, not float32"
        else:
            ok.append((name, m))
    return ok, why, shapes


def calibrate(model: nn.Module, *, refresh: bool = False, rounds: int = 5) -> dict[str, Timing]:
    """The timings, on this machine, of the weight shapes (``"out x in"``) of ``model``'s linear
    layers that could be packed (float32 on the CPU, at least ``SMALLEST_MEASURED`` numbers).

    A shape is timed once per machine (:func:`machine_key`): the first call measures it on the
    model's own weights (``rounds`` rounds, the two ways alternating, about as long as a few dozen
    decode steps) and saves it in :func:`calibration_path`; later calls, in this process or another,
    read it. A measurement made while the machine is busy (:func:`_busy`) holds for this process
    only: the next one measures again. ``refresh=True`` measures every shape again.
    """
    path, key, memo = _memo()
    layers = [m for _, m in _candidates(model)[0] if m.weight.numel() >= SMALLEST_MEASURED]
    todo = [m for m in layers if refresh or _shape(m) not in memo]
    if todo:
        measured = _measure(todo, 2 * torch.get_num_threads(), rounds)
        memo.update(measured)
        if not _busy():
            _save(path, key, measured)
    return {s: memo[s] for s in dict.fromkeys(_shape(m) for m in layers)}


def _memo() -> tuple[Path, str, dict[str, Timing]]:
    """This process's copy of this machine's calibration (read from its file once), with the file and key."""
    path, key = calibration_path(), machine_key()
    memo = _TIMINGS.get((str(path), key))
    if memo is None:
        memo = _TIMINGS[(str(path), key)] = _read(path, key)
    return path, key, memo


def known_timing(shape: str) -> Timing | None:
    """This machine's calibration of one weight shape (``"out x in"``), None where it was never measured."""
    return _memo()[2].get(shape)


# --------------------------------------------------------------------------- the plan and the swap


@dataclass
class Plan:
    """Which of a model's linear layers a decode runs packed, and why the others stay plain."""

    machine: str  # machine_key()
    parts: int  # row blocks per packed weight
    kernel: str  # one vector's packed product: "embedding_bag" (FBGEMM) or "bmm"
    steps: int | None  # the decode length the choice was made for (None: any length)
    packed: list[str] = field(default_factory=list)  # module names
    plain: dict[str, str] = field(default_factory=dict)  # module name -> why it stays nn.Linear
    timings: dict[str, Timing] = field(default_factory=dict)  # per weight shape, when calibrated
    shapes: dict[str, str] = field(default_factory=dict)  # module name -> its shape "out x in"

    @property
    def path(self) -> str:
        """``"packed"`` (every linear layer), ``"mixed"`` or ``"plain"``."""
        if not self.packed:
            return "plain"
        return "packed" if not self.plain else "mixed"

    def describe(self) -> str:
        """The plan in a few lines: how many layers run packed, and per shape the timings behind it."""
        n = len(self.packed) + len(self.plain)
        if self.packed:
            head = (f"packed row blocks for {len(self.packed)} of {n} linear layers ({self.parts} blocks per weight, "
                    f"one vector by {self.kernel})")
        else:
            head = f"plain F.linear for all {n} linear layers"
        lines = [f"{head}; {self.machine}" + ("" if self.steps is None else f"; for {self.steps} steps")]
        groups: dict[tuple[str, str], int] = {}
        for name in self.packed:
            groups[(self.shapes.get(name, "?"), "packed")] = groups.get((self.shapes.get(name, "?"), "packed"), 0) + 1
        for name, why in self.plain.items():
            k = (self.shapes.get(name, "?"), f"plain: {why}")
            groups[k] = groups.get(k, 0) + 1
        for (shape, what), k in groups.items():
            t = self.timings.get(shape)
            timing = "" if t is None else \
                f"one vector {t.plain_us:.1f} us plain, {t.packed_us:.1f} us packed, packing {t.pack_us:.0f} us; "
            lines.append(f"  {shape} x{k}: {timing}{what}")
        return "\n".join(lines)


_LAST: Plan | None = None  # the plan of this process's last pack_for_decoding (a record, read by last_plan)


def last_plan() -> Plan | None:
    """The plan the last :func:`pack_for_decoding` of this process ran (None before any)."""
    return _LAST


def decode_plan(model: nn.Module, steps: int | None = None, *, parts: int | None = None,
                select: Callable[[str, nn.Linear], bool] | None = None,
                keep_plain: Callable[[nn.Linear], str | None] | None = None) -> Plan:
    """Which of ``model``'s linear layers to pack for a decode of ``steps`` steps (None: any).

    By default from :func:`calibrate`: a layer is packed when its packed product is clearly faster
    on this machine (``Timing.faster``) and the decode is long enough to pay back its packing
    (``Timing.pay_back_steps <= steps``), unless ``keep_plain(layer)`` gives a reason to leave it
    plain (the C++ decode step multiplies it by its own product, which does not read a packed
    copy: :func:`gptlab.fast.native.step_keeps_plain`). ``select(name, layer) -> bool`` chooses
    instead, among the layers that can be packed (tests, experiments). ``parts``: row blocks per
    weight (default twice ``torch.get_num_threads()``). Within :func:`packing_off` no layer is packed.
    """
    parts = 2 * torch.get_num_threads() if parts is None else parts
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be None or an int >= 1, got {parts!r}")
    ok, why, shapes = _candidates(model)
    if _NO_PACKING[0]:
        select = lambda name, m: False  # noqa: E731
        why_not = PACKING_OFF
    else:
        why_not = "not selected"
    plan = Plan(machine_key(), parts, "embedding_bag" if EMBEDDING_BAG_PRODUCT else "bmm", steps, plain=why)
    plan.shapes = shapes
    if select is None and ok:
        plan.timings = calibrate(model)
    for name, m in ok:
        if select is not None:
            reason = None if select(name, m) else why_not
        elif m.weight.numel() < SMALLEST_MEASURED:
            reason = f"under {SMALLEST_MEASURED} numbers, not timed (cache-resident, faster whole)"
        else:
            t = plan.timings[_shape(m)]
            if not t.faster:
                reason = "the packed product is not faster on this machine"
            elif steps is not None and t.pay_back_steps > steps:
                reason = f"packing pays back after {t.pay_back_steps:.0f} steps, more than {steps}"
            else:
                reason = None if keep_plain is None else keep_plain(m)
        if reason is None:
            plan.packed.append(name)
        else:
            plan.plain[name] = reason
    return plan


PACKING_OFF = "packing turned off (gptlab.fast.cpu.packing_off)"
_NO_PACKING = [0]  # open packing_off() blocks


@contextmanager
def packing_off() -> Iterator[None]:
    """Within the block, :func:`decode_plan` packs no layer (the reason: ``PACKING_OFF``): decodes
    multiply by the plain weights. For comparisons: the per-shape calibration times each product
    alone, and a whole decode step can run faster with fewer packed layers than it chose (``bench
    speculative`` times its target alone both ways and compares with the faster)."""
    _NO_PACKING[0] += 1
    try:
        yield
    finally:
        _NO_PACKING[0] -= 1


class Packing:
    """A model's layers packed by a :class:`Plan`, ready to swap in: ``with packing.installed():``.
    The packed copies live as long as this object."""

    def __init__(self, model: nn.Module, plan: Plan):
        self.plan = plan
        chosen = set(plan.packed)
        made: dict[int, PackedLinear] = {}
        self._swaps: list[tuple[nn.Module, str, nn.Module, PackedLinear]] = []
        if not chosen:
            return
        names = {id(m): name for name, m in model.named_modules()}
        for parent in model.modules():
            for attr, child in parent._modules.items():
                if child is not None and names.get(id(child)) in chosen:
                    if id(child) not in made:  # a layer shared by two parents gets one stand-in
                        made[id(child)] = PackedLinear(child, plan.parts)
                    self._swaps.append((parent, attr, child, made[id(child)]))

    def install(self) -> None:
        """Swap the packed layers in (where the original layer still is)."""
        global _LAST
        _LAST = self.plan
        for parent, attr, original, packed in self._swaps:
            if parent._modules.get(attr) is original:
                parent._modules[attr] = packed

    def uninstall(self) -> None:
        """Put the original layers back."""
        for parent, attr, original, packed in reversed(self._swaps):
            if parent._modules.get(attr) is packed:
                parent._modules[attr] = original

    @contextmanager
    def installed(self) -> Iterator[Plan]:
        """The packed layers in place for the block, the originals back after (an exception included)."""
        self.install()
        try:
            yield self.plan
        finally:
            self.uninstall()


def packed_layers(model: nn.Module, steps: int | None = None, *, parts: int | None = None,
                  select: Callable[[str, nn.Linear], bool] | None = None,
                  keep_plain: Callable[[nn.Linear], str | None] | None = None) -> Packing:
    """:func:`decode_plan`'s layers packed (the copies made now), not yet swapped in."""
    return Packing(model, decode_plan(model, steps, parts=parts, select=select, keep_plain=keep_plain))


@contextmanager
def pack_for_decoding(model: nn.Module, steps: int | None = None, *, parts: int | None = None,
                      select: Callable[[str, nn.Linear], bool] | None = None,
                      keep_plain: Callable[[nn.Linear], str | None] | None = None) -> Iterator[Plan]:
    """Within the block, ``model``'s linear layers that :func:`decode_plan` chooses are
    :class:`PackedLinear`; on exit (an exception included) the original ``nn.Linear`` modules are
    back and the packed copies are dropped. Yields the plan. ``steps``: how many decode steps the
    block will run (the packing must pay itself back within them; None: any number).
    """
    with packed_layers(model, steps, parts=parts, select=select, keep_plain=keep_plain).installed() as plan:
        yield plan


# --------------------------------------------------------------------------- chunks: row blocks read in place

# A chunk is a few vectors multiplied by each weight in one call: speculative decoding's verification
# (the last token and g guesses), a short prefill. The packed copy's batched product (row blocks, one
# call) runs it faster than F.linear's BLAS call, and needs no copy: the same batched product reads
# the weight's own row blocks in place, as a view. On the AMD EPYC measured (2 threads, torch 2.13),
# 19 vectors by a 1024 x 192 weight took 66 us by F.linear, 61 us from the packed copy, 55 us from
# the weight in place; and a decode whose products all run in chunks (speculative decoding's target)
# then needs no packed copy at all (its packing took 1.2-1.6 ms a call).
SPLIT_CHUNKS = True  # False: chunks multiply as the model does (tests, experiments)


def split_product(x: Tensor, weight: Tensor, bias: Tensor | None = None, parts: int | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` as one batched product over ``parts`` row blocks of the weight
    (out, in), read in place (a view, no copy): x (..., in) -> (..., out). The same dot products,
    equal to ``F.linear``'s up to float rounding. ``parts`` (default ``2 * torch.get_num_threads()``)
    must divide ``out``."""
    view, bias_view = split_blocks(weight, bias, parts)
    return _blocks_bmm(x, view, bias_view, weight.shape[0])


def split_blocks(weight: Tensor, bias: Tensor | None = None, parts: int | None = None) -> tuple[Tensor, Tensor | None]:
    """The row blocks :func:`split_product` multiplies by, as views (no copy): weight (out, in) ->
    (P, in, part), block p the rows ``p * part ..`` transposed, and bias (out,) -> (P, 1, part) (or
    None); ``P = parts`` (default ``2 * torch.get_num_threads()``) must divide ``out``. ``torch.bmm``
    of x (T, in) expanded to (P, T, in) by them gives the product's outputs block by block, (P, T,
    part): output feature ``p * part + j`` of row t at ``[p, t, j]``."""
    P = 2 * torch.get_num_threads() if parts is None else parts
    out, inp = weight.shape
    if isinstance(P, bool) or not isinstance(P, int) or P < 1 or out % P:
        raise ValueError(f"split_product needs parts dividing the weight's {out} rows, got parts={P!r}")
    view = weight.view(P, out // P, inp).transpose(1, 2)  # (P, in, part): block p is rows p*part.., transposed
    return view, None if bias is None else bias.view(P, 1, out // P)


def splits_chunks(m: nn.Module) -> bool:
    """Whether a chunk multiplies by the linear layer ``m`` with :func:`split_product` on its weight
    (``SPLIT_CHUNKS``): a float32 ``nn.Linear`` or :class:`PackedLinear` (its plain weight) on the
    CPU, of at least ``SMALLEST_MEASURED`` numbers (a smaller one's product is mostly the call
    itself), whose rows the ``2 * torch.get_num_threads()`` blocks divide."""
    return SPLIT_CHUNKS and type(m) in (nn.Linear, PackedLinear) and m.weight.dtype == torch.float32 \
        and m.weight.device.type == "cpu" and m.weight.numel() >= SMALLEST_MEASURED \
        and m.out_features % (2 * torch.get_num_threads()) == 0
