"""Decoding speed: gptlab's generate (KV cache on and off) against HF generate and a bare mat-vec floor.

Where this sits: model -> logits -> *samples*. A decode step of a small model on a CPU is a chain
of matrix-vector products (memory-bound: every weight is read once per token) plus a long tail of
small operations and Python overhead. This benchmark measures, on the same random weights of GPT-2
Mini (6 layers, 6 heads, 384 wide, vocabulary 65, block 256), batch 1, greedy decoding of
``--new-tokens`` tokens from a 1-token prompt:

* ``hf_cached`` / ``hf_uncached``: ``transformers`` ``GPT2LMHeadModel.generate`` (``use_cache``
  on / off), on the weights of :meth:`gptlab.GPT.to_hf`;
* ``bare_matvec``: only the model's matrix-vector products, chained (per token, per layer the four
  weight matrices, then ``lm_head``): no attention, no norms, no Python bookkeeping. The practical
  floor for a decode step, with each product run as PyTorch runs ``F.linear`` (one BLAS call, which
  for one vector uses one core);
* ``bare_matvec_split``: the same chain run as ``fast=True`` runs a decode step's products
  (:mod:`gptlab.fast.cpu`): each weight packed once in row blocks, twice as many as there are CPU
  threads (:func:`gptlab.fast.cpu.row_blocks`), one vector's product an embedding-bag sum over each
  block (:func:`gptlab.fast.cpu.blocks_product`). The floor for the half-rate target is the faster
  of the two chains;
* ``bare_matvec_blocks_bmm``: the packed blocks multiplied by ``torch.bmm`` instead
  (:func:`gptlab.fast.cpu.batched_product`, a batched BLAS product): what the embedding bag is
  compared with;
* ``gptlab_uncached``, ``gptlab_concat``, ``gptlab_static_fwd`` and ``gptlab_cached``:
  :func:`gptlab.generate` without a cache, with the teaching :class:`~gptlab.kvcache.ConcatKVCache`,
  with the :class:`~gptlab.kvcache.StaticKVCache` and the model's own ``nn.Linear`` products
  (``fast=False``), and the default: static cache, ``fast=True``, the linear layers swapped for
  packed ones for each call where a calibration on this machine found them faster
  (:func:`gptlab.fast.cpu.pack_for_decoding`; each call packs afresh, and that time is counted).
  All four run the model's one forward path (:meth:`gptlab.GPT.decode` with a cache). The decode
  path ``fast=True`` took is printed (:func:`gptlab.fast.cpu.last_plan`);
* ``gptlab_python``: the default path with the C++ decode step turned off
  (:func:`gptlab.fast.native.disabled`): every one-token step through its Python twin
  (:class:`gptlab.fast.native.PythonDecoder`), what a machine without the build runs. Unless ``--no-native``, the
  benchmark first builds the C++ step on this machine (:func:`gptlab.fast.native.build`, kept in
  the gptlab cache; the build time, when it builds, is reported on its own), so ``gptlab_cached``
  runs each one-token step through it (:mod:`gptlab.fast.native`: the same operations from C++);
  the path it took is printed;
* ``gptlab_compiled`` (with ``--compile``): :func:`gptlab.generate` with ``compile=True``, the
  model's decode step through ``torch.compile`` (:mod:`gptlab.fast.compiled`); its compile time is
  measured on its own (``compile_s``), before the rounds.

The contenders run interleaved, round after round, and each reports its best round (the least
disturbed by other processes) and the median; the ratios that matter are computed from the best
rounds of the same run. A second sweep measures tokens/s against the number of generated tokens
with and without the cache, and is plotted to ``--plot``.

Targets (issue 34): the Python step alone (``gptlab_python``) >= 2.5x HF cached; the C++ step
(``gptlab_cached``) >= 3.5x HF cached and >= 0.85x the packed bare chain (``bare_matvec_split``);
issue 24's >= 0.75x the faster bare chain is still printed.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from ..fast import native
from ..fast.cpu import batched_product, blocks_product, calibration_path, last_plan, row_blocks
from ..files import atomic_path, atomic_write_json
from ..generation import generate
from ..model import GPT, GPTConfig
from . import cpu_settings, machine_name, native_build

__all__ = ["run", "mini_model", "mini_config"]


def mini_config(n_embd: int = 384) -> GPTConfig:
    """GPT-2 Mini's shape (6 layers, 6 heads, vocabulary 65, block 256), ``n_embd`` wide; a width
    the model cannot have (not a multiple of the 6 heads) raises ``ValueError``."""
    return GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=n_embd, dropout=0.0)


def mini_model(seed: int = 0, n_embd: int = 384) -> GPT:
    """GPT-2 Mini with random weights (the course's character-level model's shape)."""
    torch.manual_seed(seed)
    return GPT(mini_config(n_embd)).eval()


def _contenders(model, hf, n_new: int, device, compiled: bool = False) -> dict:
    parts = 2 * torch.get_num_threads() if torch.device(device).type == "cpu" else 1

    idx = torch.zeros(1, 1, dtype=torch.long, device=device)
    ones = torch.ones_like(idx)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def gptlab(cache: str | None, fast: bool = True, compile: bool = False, python: bool = False):
        def f(n=n_new):
            with native.disabled() if python else nullcontext():
                out = generate(model, idx, n, temperature=0, use_cache=cache is not None, cache=cache or "static",
                               fast=fast, compile=compile)
            sync()
            return out
        return f

    def hf_gen(use_cache: bool):
        def f(n=n_new):
            with torch.inference_mode():
                out = hf.generate(idx, attention_mask=ones, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, use_cache=use_cache)
            sync()
            return out
        return f

    mats = [(b.attn.c_attn.weight, b.attn.c_proj.weight, b.mlp.c_fc.weight, b.mlp.c_proj.weight)
            for b in model.transformer.h]
    head = model.lm_head.weight
    C = model.config.n_embd

    def bare_chain(linear):
        lin = [tuple(linear(w) for w in ws) for ws in mats]
        lm_head = linear(head)

        def bare(n=n_new):
            with torch.inference_mode():
                x = torch.zeros(1, C, device=device)
                for _ in range(n):
                    for l_attn, l_proj, l_fc, l_mlp in lin:
                        y = l_attn(x)[:, :C]
                        y = l_proj(y)
                        y = l_fc(y)
                        x = l_mlp(y)
                    logits = lm_head(x)
                sync()
                return logits

        return bare

    def whole(w):  # one BLAS matrix-vector product per matrix, as PyTorch runs F.linear
        return lambda x: F.linear(x, w)

    def split(w):  # the same products on packed row blocks, as fast=True runs them
        blocks = row_blocks(w, None, parts)
        return lambda x: blocks_product(x, blocks)

    def blocks_bmm(w):  # the packed blocks through one batched BLAS product
        blocks = row_blocks(w, None, parts)
        return lambda x: batched_product(x, blocks)

    out = {}
    if hf is not None:
        out["hf_cached"] = hf_gen(True)
        out["hf_uncached"] = hf_gen(False)
    out["bare_matvec"] = bare_chain(whole)
    if parts > 1:
        out["bare_matvec_split"] = bare_chain(split)
        out["bare_matvec_blocks_bmm"] = bare_chain(blocks_bmm)
    out["gptlab_uncached"] = gptlab(None)
    out["gptlab_concat"] = gptlab("concat")
    out["gptlab_static_fwd"] = gptlab("static", fast=False)
    out["gptlab_python"] = gptlab("static", python=True)
    out["gptlab_cached"] = gptlab("static")
    if compiled:
        out["gptlab_compiled"] = gptlab("static", compile=True)
    return out


def _compile_time(f, n: int) -> float:
    """Seconds the first call of the compiled contender takes beyond a later one (its compiling;
    torch.compile's on-disk cache makes it shorter on a second run). Printed."""
    first = _time(f, n)
    compile_s = max(0.0, first - _time(f, n))
    print(f"gptlab_compiled: compiled in {compile_s:.1f} s (first call {first:.1f} s)")
    return compile_s


def _time(f, n: int) -> float:
    t0 = time.perf_counter()
    f(n)
    return time.perf_counter() - t0


def _hf_model(model):
    """The HF twin of ``model`` for the HF contenders (no special tokens: it never stops early), or
    None where ``transformers`` is not installed."""
    try:
        hf = model.to_hf()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = None
        hf.generation_config.bos_token_id = None
    except ImportError:
        print("transformers not installed: skipping the HF contenders")
        return None
    return hf


def _same_tokens(fns: dict) -> tuple[dict, object, str]:
    """Correctness first: whether the cached and uncached paths, and HF, give gptlab_cached's tokens
    (None: not run); and the decode plan and step fast=True ran, which are printed."""
    same = {name: None for name in fns}
    ref = fns["gptlab_cached"]()
    plan = last_plan()  # what fast=True ran (the first call calibrates this machine if it has to)
    print(f"decode path of gptlab_cached (fast=True), from {calibration_path()}:")
    print("  " + (plan.describe().replace("\n", "\n  ") if plan is not None else "none recorded"))
    steps = native.last_use()
    print(f"  steps: {steps}" + (f" ({native.last_products()})" if native.last_products() and "C++" in steps else ""))
    for name in ("gptlab_uncached", "gptlab_concat", "gptlab_static_fwd", "gptlab_python", "hf_cached",
                 "gptlab_compiled"):
        if name in fns:
            same[name] = bool(torch.equal(fns[name](), ref))
    return same, plan, steps


def _timed_rounds(fns: dict, rounds: int, n_new: int) -> dict:
    """The contenders interleaved, round after round: each one's best and median tokens/s (printed)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            times[name].append(_time(f, n_new))
    results = {}
    print(f"\n{'contender':<24}{'best tok/s':>12}{'median tok/s':>14}")
    for name, ts in times.items():
        best, med = n_new / min(ts), n_new / statistics.median(ts)
        results[name] = {"tokens_per_s_best": best, "tokens_per_s_median": med, "seconds": ts}
        print(f"{name:<24}{best:>12.1f}{med:>14.1f}")
    return results


def _ratio(results: dict, a: str, b: str) -> float | None:
    if a not in results or b not in results:
        return None
    return results[a]["tokens_per_s_best"] / results[b]["tokens_per_s_best"]


def _ratios_and_targets(results: dict) -> tuple[dict, str, dict]:
    """The ratios of best rounds that matter, the floor (the faster bare chain) and whether each
    target is met (None: not measured); all printed."""
    # the floor: the faster of the two bare chains (BLAS's single-core mat-vec, or split over cores)
    floor = max((n for n in ("bare_matvec", "bare_matvec_split") if n in results),
                key=lambda n: results[n]["tokens_per_s_best"])
    pairs = [("gptlab_cached", "hf_cached"), ("gptlab_cached", "bare_matvec"), ("gptlab_cached", "bare_matvec_split"),
             ("gptlab_cached", "gptlab_python"), ("gptlab_python", "hf_cached"), ("gptlab_python", "bare_matvec_split"),
             ("bare_matvec_split", "bare_matvec"), ("bare_matvec_split", "bare_matvec_blocks_bmm"),
             ("gptlab_cached", "gptlab_uncached"), ("gptlab_static_fwd", "hf_cached"),
             ("gptlab_uncached", "hf_uncached"), ("hf_cached", "bare_matvec"), ("gptlab_compiled", "gptlab_cached"),
             ("gptlab_compiled", "gptlab_static_fwd")]
    ratios = {f"{a} / {b}": _ratio(results, a, b) for a, b in pairs}
    print()
    for k, v in ratios.items():
        if v is not None:
            print(f"{k:<44}{v:6.2f}x")
    def at_least(a: str, b: str, x: float) -> bool | None:
        r = _ratio(results, a, b)
        return None if r is None else r >= x

    targets = {  # issue 34: the Python step alone, the C++ step, against HF and the packed bare chain
        "gptlab_python >= 2.5x hf_cached": at_least("gptlab_python", "hf_cached", 2.5),
        "gptlab_cached >= 3.5x hf_cached": at_least("gptlab_cached", "hf_cached", 3.5),
        "gptlab_cached >= 0.85x bare_matvec_split (the packed bare chain)":
            at_least("gptlab_cached", "bare_matvec_split", 0.85),
        f"gptlab_cached >= 0.75x {floor} (the faster bare chain; issue 24)": _ratio(results, "gptlab_cached", floor) >= 0.75,
    }
    for k, v in targets.items():
        if v is not None:
            print(f"target {k}: {'MET' if v else 'NOT MET'}")
    return ratios, floor, targets


def _length_sweep(args, fns: dict, machine: str) -> tuple[list[int], dict]:
    """Tokens/s against the generated length, cached and uncached (printed, plotted to ``--plot``)."""
    sweep = {}
    lengths = [int(s) for s in args.lengths.split(",") if s.strip()] if args.lengths else []
    lengths = [n for n in lengths if 1 <= n <= 255]
    if lengths:
        names = [n for n in ("gptlab_cached", "gptlab_uncached", "hf_cached", "hf_uncached") if n in fns]
        sweep = {name: [] for name in names}
        print(f"\ntokens/s against generated length (best of {max(1, args.rounds // 2)}):")
        print(f"{'length':>8}" + "".join(f"{n:>17}" for n in names))
        for n in lengths:
            row = []
            for name in names:
                best = min(_time(fns[name], n) for _ in range(max(1, args.rounds // 2)))
                sweep[name].append(n / best)
                row.append(n / best)
            print(f"{n:>8}" + "".join(f"{v:>17.1f}" for v in row))
        if args.plot:
            _plot(args.plot, lengths, sweep, machine)
            print(f"plot: {args.plot}")
    return lengths, sweep


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.new_tokens, args.rounds, args.lengths = 31, 1, "8,31"
    n_new = args.new_tokens
    if not 1 <= n_new <= 255:
        raise SystemExit(f"--new-tokens must be in [1, 255] (block 256, 1-token prompt), got {n_new}")
    device = torch.device(args.device)
    model = mini_model(n_embd=args.n_embd).to(device)
    hf = None if args.no_hf else _hf_model(model)
    machine, settings = machine_name(), cpu_settings()
    print(f"machine: {machine}; {', '.join(f'{k}={v}' for k, v in settings.items())}")
    print(f"model: GPT-2 Mini shape (6 layers, 6 heads, {args.n_embd} wide, vocab 65, block 256), "
          f"{model.num_params() / 1e6:.2f} M params; batch 1, greedy, {n_new} new tokens from a 1-token prompt")

    build_s = native_build(args.no_native)
    fns = _contenders(model, hf, n_new, device, compiled=args.compile)
    compile_s = _compile_time(fns["gptlab_compiled"], n_new) if args.compile else None
    same, plan, steps = _same_tokens(fns)
    for f in fns.values():  # warm-up
        f(4)
    results = _timed_rounds(fns, args.rounds, n_new)
    ratios, floor, targets = _ratios_and_targets(results)
    print(f"same tokens as gptlab_cached: {', '.join(f'{k}={v}' for k, v in same.items() if v is not None)}")
    lengths, sweep = _length_sweep(args, fns, machine)

    if args.json:
        payload = {
            "machine": machine,
            "cpu_settings": settings,
            "device": str(device),
            "threads": torch.get_num_threads(),
            "n_embd": args.n_embd,
            "new_tokens": n_new,
            "rounds": args.rounds,
            "results": results,
            "ratios": ratios,
            "floor": floor,
            "targets_met": targets,
            "same_tokens": same,
            "compile_s": compile_s,
            "native": {"steps": steps, "build_s": build_s,
                       "built": native.is_built(), "products": native.last_products() or None},
            "decode_path": None if plan is None else {"path": plan.path, "packed": len(plan.packed),
                                                      "plain": len(plan.plain), "description": plan.describe()},
            "sweep": {"lengths": lengths, "tokens_per_s": sweep},
        }
        atomic_write_json(args.json, payload)
        print(f"json: {args.json}")
    return 0


def _plot(path: str, lengths, sweep: dict, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"gptlab_cached": "o-", "gptlab_uncached": "o--", "hf_cached": "s-", "hf_uncached": "s--"}
    for name, ys in sweep.items():
        ax.plot(lengths, ys, styles.get(name, "o-"), label=name.replace("_", " "))
    ax.set_xlabel("generated tokens (1-token prompt)")
    ax.set_ylabel("tokens / s")
    ax.set_yscale("log")
    ax.set_title("GPT-2 Mini greedy decoding, batch 1", fontsize=11)
    ax.text(0.01, 0.01, machine, transform=ax.transAxes, fontsize=6, alpha=0.7)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
