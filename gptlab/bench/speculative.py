"""Speculative decoding: acceptance rate, tokens per target pass and speed-up against draft length.

Where this sits: model -> logits -> *samples*. :func:`gptlab.generation.speculative.speculative_generate`
against the target decoding alone (:func:`gptlab.generate`, same decoding settings, same
:class:`~gptlab.kvcache.StaticKVCache`, same machine), for draft lengths ``g`` (``--gs``), greedy
(temperature 0) and sampled (temperature 1).

The models are course-trained on Tiny Shakespeare characters with :func:`gptlab.train.train`: a
*target* (``--preset default``: 6 layers x 192, Llama-style) and a much smaller *draft* (1 layer x
128, GPT-2-style: LayerNorm, learned positions and GELU cost half of RMSNorm, RoPE and SwiGLU per
decode step at this size), *distilled* from the target (``TrainConfig.teacher``: it learns the
target's next-token distributions, so it guesses what the target would sample more often than a
draft trained on the text alone), in two stages: the KL first, then, from those weights
(``TrainConfig.init_from``), the total variation, one minus the probability that a guess is kept at
temperature 1 (``distill_divergence="tv"``). They are trained on first use (with a progress bar) and cached
under ``--models`` (default ``<gptlab cache>/bench-speculative``, one folder per training
configuration), so later runs only measure. Prompts are slices of the validation text.

When sampling, a round's guesses are judged as one block (``--verification block``, the default:
Sun et al., ICLR 2025) or one by one (``token``, the algorithm chapter 8 builds); both keep the
target's distribution exactly, and the block keeps more guesses per round, the more the longer the
round (at g = 12 over 16 prompts on the AMD EPYC measured: 7.71 tokens per target pass against 6.68).

Reported per ``g``: the acceptance rate (accepted / drafted guesses), ``alpha`` (per-guess
acceptance probability), tokens per target forward pass (measured, and predicted by
``(1 - alpha^(g+1)) / (1 - alpha)``), decode time per token, and the speed-up over the target
alone. The target alone runs twice, its layers packed as the calibration chose and none packed
(:func:`gptlab.fast.cpu.packing_off`), and the faster is the baseline: the calibration times each
product on its own and can pack layers that slow a whole step down (on the AMD EPYC measured, 24 of
this target's 25 layers packed ran 0.62-0.74 ms a token, none packed 0.55-0.59). All contenders run
interleaved, round after round; the speed-up uses each contender's best round (least disturbed by
other processes), the median is reported beside it. Greedy outputs are
checked to equal the target's own greedy output. Target (issue 24): >= 2x at T = 1 on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..assets import cache_dir
from ..train.checkpoint import load_model
from ..data import prepare_char_data
from ..files import atomic_path, atomic_write_text
from ..fast import native
from ..fast.cpu import packing_off
from ..generation import SpeculativeStats, generate, speculative_generate
from ..generation.config import VERIFICATIONS
from ..train import get_recipe, train
from . import cpu_settings, machine_name, native_build

__all__ = ["run", "PRESETS", "PROMPT_LENGTH", "trained_models", "target_block_size"]

# Training configurations (overrides of gptlab.train's "shakespeare-char-cpu" recipe; the drafts are GPT-2-style).
_GPT2 = dict(norm="layernorm", mlp="gelu", pos_emb="learned")
_COMMON = dict(block_size=128, batch_size=16, dropout=0.0, bias=False, lr=2e-3, min_lr=2e-4, warmup_steps=30,
               eval_tokens=32768, eval_batch_size=64, plot=False, progress=True)
PRESETS: dict[str, dict[str, dict]] = {
    # about 18 minutes on an idle 2-core CPU (2 for the target, 5.5 for the draft's first stage, 10 for
    # its second). A draft's decode step costs the same however long it trained; what counts is how
    # often the target keeps its guesses. Distilling by the KL for 3000 steps instead of 1500 raised
    # alpha at T = 1 from 0.856 to 0.894 over 16 prompts; a second block (0.871 at 1500 steps) or width
    # 256 (0.872) cost more per guess. Over 128 prompts at g = 12: the KL for 3000 steps 0.881 (6.34
    # tokens a target pass), for 6000 steps 0.885 (6.53), 3000 steps of the KL then 3000 of the total
    # variation 0.896 (6.81). Over 64 prompts of 100 tokens at g = 16 (block verification): the total
    # variation for 3000 steps 0.920 (8.44 tokens a target pass), for 6000 steps 0.929 (8.95)
    "default": {
        "target": dict(n_layer=6, n_head=6, n_embd=192, max_steps=800),
        "draft": dict(n_layer=1, n_head=4, n_embd=128, max_steps=3000, lr=5e-3, min_lr=5e-4, **_GPT2,
                      distill=True, then=dict(max_steps=6000, lr=2e-3, min_lr=2e-4, weight_decay=0.0,
                                                distill_divergence="tv")),
    },
    # a smoke test: seconds
    "quick": {
        "target": dict(n_layer=2, n_head=2, n_embd=64, max_steps=60, eval_tokens=4096),
        "draft": dict(n_layer=1, n_head=2, n_embd=32, max_steps=60, eval_tokens=4096, **_GPT2, distill=True,
                      then=dict(max_steps=20, distill_divergence="tv")),
    },
}


def _train_config(preset: str, role: str, teacher: str | None = None, device: str = "cpu", *,
                  init_from: str | None = None):
    """The TrainConfig of ``preset``'s ``role``; with ``init_from`` (the first stage's folder), its
    second stage (the spec's ``then``: overrides of the first, starting from those weights)."""
    spec = dict(PRESETS[preset][role])
    then = spec.pop("then", None)
    if init_from is not None:
        if then is None:
            raise ValueError(f"preset {preset!r}: the {role} has one training stage")
        spec.update(then, init_from=init_from)
    if spec.pop("distill", False):
        if teacher is None:
            raise ValueError(f"preset {preset!r}: the {role} is distilled and needs the target's folder")
        spec["teacher"] = teacher
    return get_recipe("shakespeare-char-cpu").with_overrides(
        **{**_COMMON, **spec}, eval_interval=spec["max_steps"], device=device
    )


PROMPT_LENGTH = 16  # characters of validation text per prompt


def target_block_size(preset: str) -> int:
    """The block size of ``preset``'s target: the prompt and the new tokens must fit in it."""
    return _train_config(preset, "target").model.block_size


def _write_json_atomic(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str))


def trained_models(preset: str = "default", models_dir: str | os.PathLike | None = None, device: str = "cpu"):
    """The (target, draft) pair of ``preset`` on ``device``, trained there on Tiny Shakespeare
    characters if they are not cached yet (the cache does not depend on the training device).
    Returns ``(target, draft, info)``; info holds each model's folder, size and final validation
    loss."""
    root = Path(models_dir) if models_dir else cache_dir() / "bench-speculative"
    models, info = {}, {}
    for role in ("target", "draft"):  # the target first: the draft learns from it
        teacher = info["target"]["dir"] if role == "draft" else None
        cfg = _train_config(preset, role, teacher, device)
        out = _trained(cfg, role, root)
        steps = cfg.max_steps
        if "then" in PRESETS[preset][role]:  # a second stage, from the first one's weights
            cfg = _train_config(preset, role, teacher, device, init_from=str(out))
            out = _trained(cfg, role, root)
            steps += cfg.max_steps
        model, _tok = load_model(out, device=device)
        models[role] = model.eval()
        meta = json.loads((out / "bench_done.json").read_text())
        info[role] = {"dir": str(out), "params": model.num_params(), "n_layer": cfg.model.n_layer, "n_embd": cfg.model.n_embd,
                      "train_steps": steps, "val_loss": meta["summary"].get("val_loss"),
                      "style": "Llama" if cfg.model.norm == "rmsnorm" else "GPT-2",
                      "distilled": cfg.teacher is not None,
                      **({"distilled_by": cfg.distill_divergence} if cfg.teacher is not None else {})}
    return models["target"], models["draft"], info


def _trained(cfg, role: str, root: Path) -> Path:
    """The folder of a model trained with ``cfg``, trained now (on cfg.device) if it is not cached
    yet: ``root/<role>-<hash of the config>``."""
    same = {**cfg.to_dict(), "device": "cpu"}  # one cache entry whatever the device trained it
    for name, default in (("distill_divergence", "kl"), ("init_from", None)):  # fields newer than the
        if same.get(name) == default:  # first cached models, at their defaults: those entries stay valid
            same.pop(name, None)
    key = hashlib.sha256(json.dumps(same, sort_keys=True, default=str).encode()).hexdigest()[:12]
    out = root / f"{role}-{key}"
    done = out / "bench_done.json"
    if not done.is_file():
        start = f", from {Path(cfg.init_from).name}" if cfg.init_from else ""
        print(f"training the {role} ({cfg.model.n_layer} layers x {cfg.model.n_embd}, {cfg.max_steps} steps{start}) into {out}")
        summary = train(cfg, out, resume=True)  # resumes an interrupted run
        _write_json_atomic(done, {"train_config": cfg.to_dict(), "summary": summary})
    return out


def _prompts(n: int, length: int = PROMPT_LENGTH) -> list[torch.Tensor]:
    val = prepare_char_data(quiet=True).val
    step = (len(val) - length) // max(n, 1)
    return [torch.tensor(val[i * step : i * step + length].astype("int64"))[None] for i in range(n)]


def _timed_rounds(target, draft, prompts: list[torch.Tensor], gs: list[int], temp: float, n_new: int, args,
                  device: torch.device, sync, verifications: tuple[str, ...] = ("block",)) -> tuple[dict, dict]:
    """The target alone and speculative decoding with each draft length g (and each verification
    rule; greedy decoding runs the first only, the rule does not change it), interleaved round after
    round: the seconds of each round (summed over the prompts) and each contender's statistics,
    keyed ``"target"`` and ``(verification, g)``. Greedy speculative output must be the target's own."""
    contenders = [(v, g) for v in (verifications[:1] if temp == 0 else verifications) for g in gs]
    # seconds per round, summed over the prompts; the target alone twice: its layers packed as the
    # calibration chose, and none packed (the faster is the baseline: _mode_figures)
    times = {"target": [], "target_unpacked": [], **{c: [] for c in contenders}}
    stats = {c: [] for c in contenders}
    for r in range(args.rounds):
        gen = torch.Generator(device=device).manual_seed(args.seed + r)
        t_round = {"target": 0.0, "target_unpacked": 0.0, **{c: 0.0 for c in contenders}}
        for idx in prompts:
            t0 = time.perf_counter()
            want = generate(target, idx, n_new, temperature=temp, generator=gen)
            sync()
            t_round["target"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            with packing_off():
                generate(target, idx, n_new, temperature=temp, generator=gen)
            sync()
            t_round["target_unpacked"] += time.perf_counter() - t0
            for v, g in contenders:
                t0 = time.perf_counter()
                out, st = speculative_generate(target, draft, idx, n_new, num_draft_tokens=g,
                                               temperature=temp, generator=gen, verification=v)
                sync()
                t_round[v, g] += time.perf_counter() - t0
                if temp == 0 and not torch.equal(out, want):
                    raise RuntimeError(f"greedy speculative output (g={g}) differs from the target's own")
                stats[v, g].append(st)
        for k, val in t_round.items():
            times[k].append(val)
    return times, stats


def _mode_figures(times: dict, stats: dict, temp: float, n_tok: int) -> dict:
    """One temperature's figures: the target's ms/token, and a row per contender (verification, g):
    acceptance, speed-up. The speed-ups are over the faster way of running the target alone (by
    its best round): its layers packed as the calibration chose, or none packed. The calibration
    times each product alone and can pack more than pays in a whole step: on the AMD EPYC
    measured, with 24 of the target's 25 layers packed it ran 0.62-0.74 ms a token, unpacked 0.55-0.59."""
    base = min(("target", "target_unpacked"), key=lambda k: min(times[k]))
    base_best, base_med = min(times[base]), statistics.median(times[base])
    rows = []
    for v, g in stats:
        s = SpeculativeStats.combine(stats[v, g])
        best, med = min(times[v, g]), statistics.median(times[v, g])
        rows.append({"g": g, "verification": v, **s.summary(), "ms_per_token_best": 1e3 * best / n_tok,
                     "ms_per_token_median": 1e3 * med / n_tok, "speedup_best": base_best / best,
                     "speedup_median": base_med / med})
    return {"temperature": temp, "target_ms_per_token_best": 1e3 * base_best / n_tok,
            "target_ms_per_token_median": 1e3 * base_med / n_tok,
            "target_baseline": "unpacked" if base == "target_unpacked" else "packed as calibrated",
            "target_packed_ms_per_token_best": 1e3 * min(times["target"]) / n_tok,
            "target_unpacked_ms_per_token_best": 1e3 * min(times["target_unpacked"]) / n_tok, "rows": rows}


def _print_mode(mode: str, figures: dict) -> None:
    rows = figures["rows"]
    print(f"\n{mode}: target alone {figures['target_ms_per_token_best']:.2f} ms/token (best round; median "
          f"{figures['target_ms_per_token_median']:.2f}; {figures['target_baseline']}, the faster of packed as "
          f"calibrated {figures['target_packed_ms_per_token_best']:.2f} and unpacked "
          f"{figures['target_unpacked_ms_per_token_best']:.2f})")
    print(f"{'verify':>6} {'g':>3} {'accept':>7} {'alpha':>6} {'tok/pass':>9} {'predicted':>9} {'ms/tok':>7} "
          f"{'speed-up':>9} {'(median)':>9}")
    for row in rows:
        print(f"{row['verification']:>6} {row['g']:>3} {row['acceptance_rate']:>7.3f} {row['alpha']:>6.3f} "
              f"{row['tokens_per_target_forward']:>9.2f} {row['predicted_tokens_per_target_forward']:>9.2f} "
              f"{row['ms_per_token_best']:>7.2f} {row['speedup_best']:>8.2f}x {row['speedup_median']:>8.2f}x")
    for v in dict.fromkeys(r["verification"] for r in rows):
        best_row = max((r for r in rows if r["verification"] == v), key=lambda r: r["speedup_best"])
        print(f"best ({v} verification): g={best_row['g']} {best_row['speedup_best']:.2f}x (target >= 2x: "
              f"{'met' if best_row['speedup_best'] >= 2.0 else 'NOT met'})")


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    gs = [int(g) for g in args.gs.split(",") if g.strip()]
    verifications = tuple(dict.fromkeys(v.strip() for v in args.verification.split(",") if v.strip()))
    if not verifications or set(verifications) - set(VERIFICATIONS):
        raise SystemExit(f"--verification must list 'block' and/or 'token', got {args.verification!r}")
    temps = [float(t) for t in args.temperatures.split(",") if t.strip()]
    if not gs or min(gs) < 1:
        raise SystemExit(f"--gs must list draft lengths >= 1, got {args.gs!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available on this machine")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    target, draft, info = trained_models(args.preset, args.models, device=args.device)
    n_new = args.new_tokens
    if not 1 <= n_new <= target.config.block_size - PROMPT_LENGTH:
        raise SystemExit(f"--new-tokens must be in [1, {target.config.block_size - PROMPT_LENGTH}] "
                         f"({PROMPT_LENGTH}-character prompts)")
    prompts = [p.to(device) for p in _prompts(args.prompts)]
    print(f"machine: {machine_name()}")
    for role in ("target", "draft"):
        i = info[role]
        print(f"{role}: {i['n_layer']} layers x {i['n_embd']} ({i['style']}-style), {i['params'] / 1e6:.2f}M params, "
              f"{i['train_steps']} steps{' distilled from the target' if i['distilled'] else ''}, "
              f"val loss {i['val_loss']:.3f}")

    build_s = native_build(args.no_native)
    generate(target, prompts[0], 2, temperature=0)
    steps = {"target_alone": native.last_use()}
    speculative_generate(target, draft, prompts[0], 4, num_draft_tokens=2, temperature=0)
    steps["draft"] = native.last_use()
    steps["verification_products"] = native.last_chunk_products(target)
    print(f"decode steps: the target alone: {steps['target_alone']}; the draft's guesses: {steps['draft']}; "
          f"the target's verifications: {steps['verification_products']}")
    print(f"verification when sampling: {', '.join(verifications)} ('predicted' is token verification's formula)")
    results = {"machine": machine_name(), "cpu_settings": cpu_settings(), "device": str(device), "models": info,
               "new_tokens": n_new, "prompts": len(prompts), "rounds": args.rounds, "decode_steps": steps,
               "verification": list(verifications),
               "native_build_s": build_s, "modes": {}}
    for temp in temps:
        mode = "greedy" if temp == 0 else f"T={temp:g}"
        times, stats = _timed_rounds(target, draft, prompts, gs, temp, n_new, args, device, sync, verifications)
        results["modes"][mode] = _mode_figures(times, stats, temp, n_new * len(prompts))
        _print_mode(mode, results["modes"][mode])

    if args.json:
        _write_json_atomic(Path(args.json), results)
        print(f"wrote {args.json}")
    if args.plot:
        _plot(results, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, m in results["modes"].items():
        for v in dict.fromkeys(r.get("verification", "token") for r in m["rows"]):
            rows = [r for r in m["rows"] if r.get("verification", "token") == v]
            name = mode if mode == "greedy" else f"{mode}, {v}"
            gs = [r["g"] for r in rows]
            ax.plot(gs, [r["speedup_best"] for r in rows], marker="o", label=f"{name}: speed-up")
            ax.plot(gs, [r["tokens_per_target_forward"] for r in rows], ls="--", marker=".",
                    label=f"{name}: tokens per target pass")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(2.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("draft length g")
    ax.set_ylabel("speed-up over the target alone / tokens per pass")
    t, d = results["models"]["target"], results["models"]["draft"]
    ax.set_title(f"Speculative decoding: {t['n_layer']}x{t['n_embd']} target, {d['n_layer']}x{d['n_embd']} draft"
                 f"{' (distilled)' if d.get('distilled') else ''}", fontsize=10)
    ax.text(0.01, -0.16, results["machine"][:110], transform=ax.transAxes, fontsize=6, color="grey")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
