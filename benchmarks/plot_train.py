"""The CPU training benchmark as a picture: time to nanoGPT's validation loss, and where a step's
time goes (benchmarks/results/train.png), from the JSON files of benchmarks/results/.

    python benchmarks/plot_train.py [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RUNS = [  # (file, label, pair): back-to-back pairs in the order they ran; each recipe run against its own pair's nanoGPT
    ("nanogpt_cpu.json", "nanoGPT's CPU command, pair 1\n(its own train.py)", 1),
    ("train_shakespeare-char-cpu.json", "gptlab shakespeare-char-cpu, pair 1\n(the README's and chapter 5b's recipe)", 1),
    ("train_shakespeare-char-cpu_pair2.json", "gptlab shakespeare-char-cpu, pair 2", 2),
    ("nanogpt_cpu_pair2.json", "nanoGPT's CPU command, pair 2", 2),
    ("train_shakespeare-char-cpu_pair3.json", "gptlab shakespeare-char-cpu, pair 3", 3),
    ("nanogpt_cpu_pair3.json", "nanoGPT's CPU command, pair 3", 3),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    found = [(json.loads((args.results / f).read_text()), label, pair) for f, label, pair in RUNS
             if (args.results / f).exists()]
    if not found:
        print(f"no results in {args.results}")
        return 1
    bases = {pair: d["time_to_target_s"] for d, _, pair in found if d["benchmark"] == "nanogpt_cpu"}
    runs = [(d, label) for d, label, _ in found]
    base = bases.get(1)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    labels = [label for _, label in runs]
    times = [d["time_to_target_s"] or 0.0 for d, _ in runs]
    colors = ["grey" if d["benchmark"] == "nanogpt_cpu" else "tab:blue" for d, _ in runs]
    bars = ax.barh(labels, times, color=colors)
    for bar, t, (d, _, pair) in zip(bars, times, found):
        own = bases.get(pair)
        ratio = f"  ({own / t:.2f}x its pair's nanoGPT)" if own and t and d["benchmark"] != "nanogpt_cpu" else ""
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {t:.1f} s{ratio}", va="center")
    if base:
        ax.axvline(base / 4, color="tab:red", ls="--", lw=1)
    ax.invert_yaxis()
    ax.set_xlim(0, max(times) * 1.45)
    target_note = "\n(red dashes: a quarter of pair 1's nanoGPT time, the target)" if base else ""
    ax.set_xlabel(f"seconds to validation loss <= {runs[0][0].get('target_loss', 1.886)}{target_note}")
    ax.set_title(runs[0][0]["machine"], fontsize=9)
    parts = [(label.split("\n")[0], d["step_breakdown_ms"]) for d, label in runs if d.get("step_breakdown_ms")]
    names = ["data", "forward", "backward", "optimizer"]
    left = [0.0] * len(parts)
    for name in names:
        vals = [p[name] for _, p in parts]
        bx.barh([n for n, _ in parts], vals, left=left, label=name)
        left = [a + b for a, b in zip(left, vals)]
    bx.invert_yaxis()
    bx.set_xlabel("ms per training step (evaluation not included)")
    bx.set_title("where a gptlab step's time goes", fontsize=9)
    bx.set_xlim(0, max(left) * 1.05)
    bx.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(names), frameon=False)
    fig.tight_layout()
    out = args.results / "train.png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
