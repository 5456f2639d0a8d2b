"""nanoGPT's own CPU command, timed: the baseline of the CPU training target (issue 24).

    python benchmarks/nanogpt_cpu.py --nanogpt PATH/TO/nanoGPT --json benchmarks/results/nanogpt_cpu.json

PATH/TO/nanoGPT is a checkout of https://github.com/karpathy/nanoGPT whose
data/shakespeare_char/ has been prepared (its prepare.py; put Tiny Shakespeare there as input.txt
first where there is no internet, e.g. from ``python -m gptlab fetch``'s cache). This runs the
command of nanoGPT's README ("I only have a macbook"): train.py config/train_shakespeare_char.py
--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12
--n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0, stamps
each evaluation line with the seconds since the start, and records the first time the validation
loss reaches ``--target-loss`` (nanoGPT's published 1.88; 1.886 is what the gptlab benchmark
targets) together with :func:`gptlab.bench.machine_name`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from gptlab.bench import machine_name
from gptlab.files import atomic_write_text

ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
        "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
        "--lr_decay_iters=2000", "--dropout=0.0"]
EVAL_LINE = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanogpt", required=True, type=Path, help="a nanoGPT checkout with shakespeare_char prepared")
    ap.add_argument("--target-loss", type=float, default=1.886)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not (args.nanogpt / "data" / "shakespeare_char" / "train.bin").exists():
        print(f"error: {args.nanogpt}/data/shakespeare_char/train.bin missing: run its prepare.py first")
        return 2
    out_dir = Path(args.nanogpt) / "out-gptlab-bench"
    cmd = [sys.executable, "-u", "train.py", *ARGS, f"--out_dir={out_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=args.nanogpt, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    evals = []
    for line in proc.stdout:
        m = EVAL_LINE.match(line)
        if m:
            t = time.perf_counter() - t0
            evals.append({"step": int(m[1]), "train_loss": float(m[2]), "val_loss": float(m[3]), "s": round(t, 2)})
            print(f"{t:7.2f} s  {line.rstrip()}", flush=True)
    rc = proc.wait()
    wall = time.perf_counter() - t0
    hit = next((e for e in evals if e["val_loss"] <= args.target_loss), None)
    fig = {"benchmark": "nanogpt_cpu", "machine": machine_name(), "command": ["train.py", *ARGS],
           "target_loss": args.target_loss, "time_to_target_s": hit["s"] if hit else None,
           "step_at_target": hit["step"] if hit else None, "final_val_loss": evals[-1]["val_loss"] if evals else None,
           "wall_s": round(wall, 2), "evaluations": evals, "returncode": rc}
    print(f"time to val loss <= {args.target_loss}: "
          + (f"{hit['s']:.1f} s (step {hit['step']})" if hit else "not reached") + f"; wall {wall:.1f} s")
    if args.json:
        print(f"wrote {atomic_write_text(args.json, json.dumps(fig, indent=2) + chr(10))}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
