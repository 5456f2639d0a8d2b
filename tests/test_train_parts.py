"""The training loop's parts, each on its own: the processes (gptlab.train.distributed), the validation
loss (gptlab.train.evaluation) and the training log's running sums (gptlab.train.metrics.TrainLog)."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import gptlab.train
from gptlab.train.distributed import (
    DistInfo, all_gather_objects, all_mean, all_sum_, barrier, close_distributed, setup_distributed,
)
from gptlab.train.evaluation import mean_cross_entropy, val_windows
from gptlab.train.metrics import TrainLog, append_jsonl, read_metrics
from tiny_models import tiny_gpt

# ------------------------------------------------------------------------------------ distributed


def test_one_process_needs_no_group(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    info = setup_distributed("cpu")
    assert info == DistInfo(rank=0, local_rank=0, world=1, owns_group=False)
    assert info.master and not info.enabled
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert setup_distributed("auto") == DistInfo()
    assert not torch.distributed.is_initialized()


def test_collectives_are_no_ops_with_one_process():
    info = DistInfo()
    t = torch.tensor([1.5, -2.0])
    assert all_mean(t, info) is t
    assert all_sum_(t, info) is t and t.tolist() == [1.5, -2.0]
    assert barrier(info) is None
    obj = {"a": [1, 2]}
    got = all_gather_objects(obj, info)
    assert got == [obj] and got[0] is obj
    close_distributed(info)
    assert info == DistInfo()


def test_dist_info_roles():
    assert DistInfo(rank=0, world=2).master and DistInfo(rank=0, world=2).enabled
    assert not DistInfo(rank=1, local_rank=1, world=2).master


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collectives_worker(rank: int, world: int, port: int, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    info = setup_distributed("cpu")
    try:
        t = torch.tensor([float(rank + 1), 10.0 * rank])
        mean = all_mean(t, info)
        out = {
            "info": [info.rank, info.local_rank, info.world, info.owns_group],
            "mean": mean.tolist(),
            "t_after_mean": t.tolist(),  # all_mean leaves its argument alone
            "gathered": all_gather_objects({"rank": rank}, info),
        }
        s = torch.tensor(float(rank + 1))
        out["sum_is_same_tensor"] = all_sum_(s, info) is s
        out["sum"] = s.item()
        # the validation loss, each rank scoring every other window, equals one process's
        model = tiny_gpt(0, vocab_size=13, block_size=4, n_layer=1, n_head=1, n_embd=8)
        x, y = val_windows(torch.arange(4 * 5 + 1) % 13, 4)  # 5 windows: 3 on rank 0, 2 on rank 1
        out["val_shared"] = mean_cross_entropy(model, x, y, batch_size=2, dist=info)
        out["val_alone"] = mean_cross_entropy(model, x, y, batch_size=2)
        barrier(info)
        with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        close_distributed(info)
        out_closed = not info.owns_group and not torch.distributed.is_initialized()
        with open(os.path.join(results, f"closed{rank}.json"), "w") as f:
            json.dump(out_closed, f)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_collectives_with_two_gloo_processes(tmp_path):
    mp.spawn(_collectives_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["info"] == [rank, rank, 2, True]
        assert out["mean"] == [1.5, 5.0]
        assert out["t_after_mean"] == [float(rank + 1), 10.0 * rank]
        assert out["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert out["sum_is_same_tensor"] and out["sum"] == 3.0
        # float32 partial sums added in another order (per rank, then across ranks): equal to float32 precision
        assert out["val_shared"] == pytest.approx(out["val_alone"], rel=1e-6)
        assert json.loads((tmp_path / f"closed{rank}.json").read_text()) is True


# ------------------------------------------------------------------------------------ evaluation


def test_val_windows_is_the_same_function_in_train():
    assert gptlab.train.val_windows is val_windows
    x, y = val_windows(torch.arange(20), 4, max_tokens=12)
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert torch.equal(y, x + 1) and x.dtype == torch.int64


def _hand_loss(model, x, y) -> float:
    """The mean of F.cross_entropy over every window, one window at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(x.shape[0]):
            logits = model(x[i : i + 1])[0]
            total += F.cross_entropy(logits.flatten(0, 1).double(), y[i].flatten(), reduction="sum").item()
            count += y[i].numel()
    return total / count


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_mean_cross_entropy_equals_a_hand_loop(batch_size):
    model = tiny_gpt(0, eval_mode=False, vocab_size=29, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.2)
    stream = torch.randint(0, 29, (8 * 7 + 1,), generator=torch.Generator().manual_seed(1))
    x, y = val_windows(stream, 8)  # (7, 8)
    got = mean_cross_entropy(model, x, y, batch_size=batch_size)
    assert model.training  # its mode is restored
    model.eval()  # the windows are scored without dropout
    assert got == pytest.approx(_hand_loss(model, x, y), rel=1e-5)
    # the sharding of one process is all the windows; an autocast context is entered per batch
    entered = []

    class Ctx:
        def __enter__(self):
            entered.append(1)

        def __exit__(self, *exc):
            return False

    again = mean_cross_entropy(model, x, y, batch_size=batch_size, device="cpu", autocast=Ctx, dist=DistInfo())
    assert again == got and len(entered) == -(-7 // batch_size)
    assert not model.training


def test_mean_cross_entropy_needs_no_gradients():
    model = tiny_gpt(1, vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=8)
    x, y = val_windows(torch.arange(17) % 11, 4)
    mean_cross_entropy(model, x, y, batch_size=2)
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------------------------ training log


STEPS = [(2.0, 0.5), (1.0, 3.0), (1.5, 1.2), (0.5, 0.9)]  # (loss, gradient norm) per step


def _log(grad_clip=1.0, steps=STEPS) -> TrainLog:
    log = TrainLog("cpu", grad_clip)
    for loss, norm in steps:
        log.add(torch.tensor(loss), torch.tensor(norm))
    return log


def test_train_log_row_is_the_means_max_and_clip_fraction():
    log = _log()
    assert log.n == 4
    row = log.pop_row(step=40, lr=3e-4, tokens=1234, clock=lambda: 12.345678)
    assert list(row) == ["step", "train_loss", "lr", "grad_norm", "grad_norm_max", "clip_frac", "tokens",
                         "elapsed_s"]
    assert row["step"] == 40 and row["lr"] == 3e-4 and row["tokens"] == 1234 and row["elapsed_s"] == 12.3457
    assert row["train_loss"] == pytest.approx(sum(s[0] for s in STEPS) / 4)
    assert row["grad_norm"] == pytest.approx(sum(s[1] for s in STEPS) / 4)
    assert row["grad_norm_max"] == pytest.approx(3.0)
    assert row["clip_frac"] == pytest.approx(2 / 4)  # 3.0 and 1.2 exceed 1.0
    # reset: the next interval starts from zero
    assert log.n == 0 and all(v.item() == 0 for v in log.sums.values())
    log.add(torch.tensor(4.0), torch.tensor(0.25))
    row2 = log.pop_row(step=41, lr=1e-4, tokens=1300, clock=lambda: 13.0)
    assert (row2["train_loss"], row2["grad_norm"], row2["grad_norm_max"], row2["clip_frac"]) == (4.0, 0.25, 0.25, 0.0)


def test_train_log_without_clipping_and_with_a_mean_over_processes():
    row = _log(grad_clip=None).pop_row(step=4, lr=0.1, tokens=8, clock=lambda: 0.0, mean=lambda t: t * 0.5)
    assert row["clip_frac"] is None
    assert row["train_loss"] == pytest.approx(0.5 * sum(s[0] for s in STEPS) / 4)  # the loss only
    assert row["grad_norm"] == pytest.approx(sum(s[1] for s in STEPS) / 4)


def test_train_log_sums_stay_tensors_on_the_device():
    log = _log()
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype == torch.float32 for v in log.sums.values())


def test_train_log_state_round_trip_continues_the_interval():
    first, rest = STEPS[:2], STEPS[2:]
    whole = _log().pop_row(step=4, lr=0.1, tokens=8, clock=lambda: 1.0)
    state = _log(steps=first).state_dict()
    assert list(state) == ["loss_sum", "norm_sum", "norm_max", "clipped", "n"]  # the checkpoint's format
    assert state == {"loss_sum": 3.0, "norm_sum": 3.5, "norm_max": 3.0, "clipped": 1.0, "n": 2}
    resumed = TrainLog("cpu", 1.0)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as train_state.json stores it
    assert resumed.state_dict() == state
    for loss, norm in rest:
        resumed.add(torch.tensor(loss), torch.tensor(norm))
    assert resumed.pop_row(step=4, lr=0.1, tokens=8, clock=lambda: 1.0) == whole


def test_train_log_row_needs_a_step():
    with pytest.raises(ValueError, match="no step"):
        TrainLog().pop_row(step=0, lr=0.0, tokens=0, clock=lambda: 0.0)


def test_append_jsonl_adds_rows(tmp_path):
    p = tmp_path / "metrics.jsonl"
    append_jsonl(p, {"step": 1, "val_loss": 2.5})
    append_jsonl(p, {"step": 2, "val_loss": None})
    assert read_metrics(p) == [{"step": 1, "val_loss": 2.5}, {"step": 2, "val_loss": None}]
    assert p.read_text().count("\n") == 2


def test_loss_sums_are_float64_except_on_mps():
    """Apple's MPS has no float64: an evaluation there must sum in float32, not crash."""
    from gptlab.train.evaluation import sum_dtype

    assert sum_dtype("cpu") == sum_dtype(torch.device("cuda", 0)) == torch.float64
    assert sum_dtype("mps") == sum_dtype(torch.device("mps")) == torch.float32


def test_distillation_loss_is_ce_plus_forward_kl_per_position():
    """(1 - w) CE + w KL(teacher || model), the KL averaged over the B * T positions, against
    torch.distributions; no gradient reaches the teacher."""
    from gptlab.train import distillation_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, requires_grad=True)
    teacher = torch.randn(2, 5, 7, generator=g, requires_grad=True)
    ce = torch.tensor(1.25)
    kl = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=teacher),
                                           torch.distributions.Categorical(logits=logits)).mean()
    for w in (0.0, 0.3, 1.0):
        torch.testing.assert_close(distillation_loss(logits, teacher, ce, w), (1 - w) * ce + w * kl)
    distillation_loss(logits, teacher, ce, 0.5).backward()
    assert logits.grad is not None and teacher.grad is None
    assert float(distillation_loss(teacher.detach(), teacher, torch.tensor(0.0), 1.0)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match=r"weight must be in \[0, 1\]"):
        distillation_loss(logits, teacher, ce, 1.5)
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        distillation_loss(logits, teacher[:, :3], ce, 0.5)
    # the total variation, 1/2 sum |p - q| = 1 - sum min(p, q), alone or added to the KL
    p, q = torch.softmax(teacher, -1), torch.softmax(logits, -1)
    tv = (1 - torch.minimum(p, q).sum(-1)).mean()
    torch.testing.assert_close(distillation_loss(logits, teacher, ce, 0.3, "tv"), 0.7 * ce + 0.3 * tv)
    torch.testing.assert_close(distillation_loss(logits, teacher, ce, 0.3, "kl+tv"), 0.7 * ce + 0.3 * (kl + tv))
    logits.grad = None
    distillation_loss(logits, teacher, ce, 1.0, "tv").backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0 and teacher.grad is None
    with pytest.raises(ValueError, match=r"divergence must be one of \('kl', 'tv', 'kl\+tv'\), got 'js'"):
        distillation_loss(logits, teacher, ce, 0.5, "js")
