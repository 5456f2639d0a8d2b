"""Data-parallel training (DistributedDataParallel) with two CPU processes on the gloo backend:
the ranks stay in sync (identical weights), each draws its own batches, rank 0 alone writes the
metrics and the checkpoint, and the loss falls."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from gptlab.train import read_metrics

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, results: str) -> None:
    # what torchrun sets for each process
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from gptlab.train import Trainer, get_recipe

    cfg = get_recipe("tiny", max_steps=40, eval_interval=20, eval_tokens=2048, progress=False, num_threads=1,
                     device="cpu")
    t = Trainer(cfg, out)
    try:
        assert t.dist.world == world and t.dist.rank == rank
        seed = t.generator.initial_seed()
        summary = t.fit()
        state = {k: v.detach().clone().contiguous() for k, v in t.raw_model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, os.path.join(results, f"rank{rank}.safetensors"))
        with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
            json.dump({"seed": seed, "summary": summary, "log_rows": t.log_rows}, f)
    finally:
        t.close()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_ddp_two_cpu_processes_gloo(tmp_path):
    out, results = tmp_path / "run", tmp_path / "results"
    results.mkdir()
    mp.spawn(_worker, args=(WORLD, _free_port(), str(out), str(results)), nprocs=WORLD, join=True)

    w0, w1 = (load_file(str(results / f"rank{r}.safetensors")) for r in range(WORLD))
    assert w0.keys() == w1.keys()
    for k in w0:
        assert torch.equal(w0[k], w1[k]), f"ranks disagree on {k}"
    info = [json.loads((results / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert info[0]["seed"] != info[1]["seed"]  # each rank its own batches
    s = info[0]["summary"]
    assert s["world_size"] == WORLD and s["tokens"] == 40 * 16 * 32 * WORLD

    rows = read_metrics(out / "metrics.jsonl")  # written once, by rank 0
    assert [r["step"] for r in rows] == [0, 20, 40]
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.5
    assert info[1]["summary"]["val_loss"] == rows[-1]["val_loss"]  # the val loss is shared (all-reduced)
    # train_log.jsonl: written once, by rank 0; its training loss is the mean over both ranks' batches,
    # so the two ranks (which drew different batches) hold the same rows
    log = read_metrics(out / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(10, 41, 10))
    def no_clock(rows):  # each process times itself
        return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]

    assert no_clock(info[0]["log_rows"]) == no_clock(info[1]["log_rows"]) == no_clock(log)
    assert all(r["tokens"] == r["step"] * 16 * 32 * WORLD for r in log)
    state = json.loads((out / "ckpt" / "train_state.json").read_text())
    assert len(state["rng_ranks"]) == WORLD
    assert state["rng_ranks"][0]["generator"] != state["rng_ranks"][1]["generator"]
    # the checkpoint holds the synchronised weights
    ck = load_file(str(out / "ckpt" / "model.safetensors"))
    assert all(torch.equal(ck[k], w0[k]) for k in ck)
