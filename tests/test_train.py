"""Training (gptlab.train): schedule, weight-decay groups, gradient accumulation, a smoke run on
Tiny Shakespeare, exact resume, the command line and its errors. Device selection too."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal

import pytest
import torch

from gptlab.__main__ import main
from gptlab.train.checkpoint import load_model
from gptlab.config import GPTConfig
from gptlab.device import pick_device
from gptlab.train import (RECIPES, Trainer, TrainConfig, TrainingInterrupted, get_recipe, lr_at, read_metrics, train,
                          val_windows)

QUIET = dict(progress=False, num_threads=1)  # tiny models: one thread, no oversubscription


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def small(**kw) -> TrainConfig:
    """The tiny recipe, shortened."""
    base = dict(max_steps=30, eval_interval=10, eval_tokens=2048, **QUIET)
    base.update(kw)
    return get_recipe("tiny", **base)


# ------------------------------------------------------------------------------------ schedule


def test_lr_schedule_matches_warmup_and_torch_cosine():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    # linear warmup (nanoGPT): lr * (step + 1) / (warmup + 1)
    assert lr_at(0, cfg) == pytest.approx(1e-3 / 11)
    assert lr_at(9, cfg) == pytest.approx(1e-3 * 10 / 11)
    assert all(lr_at(s, cfg) < lr_at(s + 1, cfg) for s in range(10))
    # cosine part against PyTorch's CosineAnnealingLR (eta_max=lr, eta_min=min_lr, T_max=100)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100, eta_min=cfg.min_lr)
    for i in range(101):
        assert lr_at(10 + i, cfg) == pytest.approx(sched.get_last_lr()[0], rel=1e-9, abs=1e-15), i
        opt.step()
        sched.step()
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx((1e-3 + 1e-4) / 2)
    assert lr_at(110, cfg) == lr_at(5000, cfg) == pytest.approx(1e-4)
    cfg2 = cfg.with_overrides(lr_decay_steps=60)
    assert lr_at(60, cfg2) == pytest.approx(1e-4) and lr_at(35, cfg2) == pytest.approx((1e-3 + 1e-4) / 2)


def test_lr_at_plain_numbers_equals_the_config_form():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    for step in (0, 5, 9, 10, 37, 60, 109, 110, 500):
        assert lr_at(step, 1e-3, 1e-4, 10, 110) == lr_at(step, cfg)
    assert lr_at(3, 0.5, warmup=0) == 0.5  # no warmup, no decay: constant
    assert lr_at(60, 1.0, 0.0, 10, 110) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------ optimiser


def test_weight_decay_on_matrices_only():
    t = Trainer(small(weight_decay=0.5, lr=0.1, save=False), "unused-out")
    groups = t.optimizer.param_groups
    decay = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    params = dict(t.model.named_parameters())
    assert decay | no_decay == {id(p) for p in params.values()} and not decay & no_decay
    for name, p in params.items():
        assert (id(p) in decay) == (p.dim() >= 2), name
    assert any(p.dim() == 1 for p in params.values())  # the norm gains are there
    # the behaviour: with zero gradients, AdamW shrinks decayed weights by (1 - lr * wd) only
    before = {n: p.detach().clone() for n, p in params.items()}
    for p in params.values():
        p.grad = torch.zeros_like(p)
    t.optimizer.step()
    for n, p in params.items():
        expected = before[n] * (1 - 0.1 * 0.5) if p.dim() >= 2 else before[n]
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-8, msg=n)


def test_grad_accumulation_equals_full_batch():
    cfg = small(save=False)
    a, b = Trainer(cfg, "unused-a"), Trainer(cfg.with_overrides(batch_size=4, grad_accum=2), "unused-b")
    b.model.load_state_dict(a.model.state_dict())
    from gptlab.data import get_batch

    x, y = get_batch(a.data.train, 8, cfg.block_size, generator=torch.Generator().manual_seed(5))
    loss_a = a.accumulate_gradients([(x, y)])
    loss_b = b.accumulate_gradients([(x[:4], y[:4]), (x[4:], y[4:])])
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    for (n, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-7, msg=n)
    # and the micro-batch gradients really differ from each other (the test can fail)
    b.optimizer.zero_grad()
    b.accumulate_gradients([(x[:4], y[:4])])
    g4 = b.model.transformer.wte.weight.grad.clone()
    assert not torch.allclose(g4 / 2, a.model.transformer.wte.weight.grad, atol=1e-6)


# ------------------------------------------------------------------------------------ training


def test_smoke_loss_falls_and_outputs_written(tmp_path):
    cfg = get_recipe("tiny", **QUIET)
    summary = train(cfg, tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(0, cfg.max_steps + 1, cfg.eval_interval))
    for r in rows:
        assert {"step", "train_loss", "val_loss", "elapsed_s", "lr", "tokens"} <= set(r)
    assert abs(rows[0]["val_loss"] - math.log(65)) < 0.15  # uniform guess over 65 characters
    assert rows[-1]["val_loss"] < 3.0 and rows[-1]["train_loss"] < 3.1
    assert rows[-1]["tokens"] == cfg.max_steps * cfg.batch_size * cfg.block_size
    assert all(b["elapsed_s"] >= a["elapsed_s"] for a, b in zip(rows, rows[1:]))
    assert summary["val_loss"] == rows[-1]["val_loss"] and summary["step"] == cfg.max_steps
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the checkpoint gives back the same model: same validation loss
    model, tok = load_model(tmp_path)
    assert tok.vocab_size == 65
    from gptlab.data import prepare_char_data

    x, y = val_windows(prepare_char_data().val, cfg.block_size, cfg.eval_tokens)
    with torch.no_grad():
        losses = [model(x[i : i + 64], y[i : i + 64])[1] * y[i : i + 64].numel() for i in range(0, len(x), 64)]
    assert float(sum(losses) / y.numel()) == pytest.approx(rows[-1]["val_loss"], rel=1e-5)


def test_target_loss_stops_early(tmp_path):
    summary = train(small(max_steps=200, target_loss=3.6, save=False, plot=False), tmp_path)
    assert summary["step"] < 200 and summary["val_loss"] <= 3.6
    assert summary["step_at_target"] == summary["step"] and summary["time_to_target_s"] > 0


@contextlib.contextmanager
def _signal_after_step(step: int, signum: int):
    """Send ``signum`` to this process right after optimiser step ``step``, as Ctrl-C would."""
    original = Trainer.optimizer_step

    def step_then_signal(self, lr):
        norm = original(self, lr)
        if self.step + 1 == step:
            os.kill(os.getpid(), signum)
        return norm

    Trainer.optimizer_step = step_then_signal
    try:
        yield
    finally:
        Trainer.optimizer_step = original


def test_resume_is_bit_exact(tmp_path, monkeypatch):
    cfg = small(max_steps=30, eval_interval=10, dropout=0.1, plot=False)  # dropout: the torch RNG matters
    train(cfg, tmp_path / "a")
    train(cfg, tmp_path / "b", until=17)  # "interrupted" between two evaluations
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [0, 10]
    train(cfg, tmp_path / "b", resume=True)
    ra, rb = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in rb] == [0, 10, 20, 30]
    for x, y in zip(ra, rb):
        assert (x["step"], x["train_loss"], x["val_loss"], x["lr"], x["tokens"]) == (
            y["step"], y["train_loss"], y["val_loss"], y["lr"], y["tokens"])
    ma, mb = load_model(tmp_path / "a")[0], load_model(tmp_path / "b")[0]
    for (n, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(pa, pb), n
    # Ctrl-C (SIGINT) or SIGTERM with the default settings (no checkpoint_interval): a checkpoint
    # at the step reached, and resuming from it is the same run, bit for bit
    assert cfg.checkpoint_interval is None
    for signum, name in ((signal.SIGINT, "d"), (signal.SIGTERM, "e")):
        with _signal_after_step(17, signum), pytest.raises(TrainingInterrupted) as e:
            train(cfg, tmp_path / name)
        assert (e.value.step, e.value.checkpoint, e.value.exit_code) == (17, tmp_path / name / "ckpt", 128 + signum)
        assert "resume=True" in str(e.value)
        train(cfg, tmp_path / name, resume=True)
        rd = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [(r["step"], r["train_loss"], r["val_loss"]) for r in rd] == [
            (r["step"], r["train_loss"], r["val_loss"]) for r in ra]
        md = load_model(tmp_path / name)[0]
        for (n, pa), pd in zip(ma.state_dict().items(), md.state_dict().values()):
            assert torch.equal(pa, pd), n
    # without restoring the RNG states the continuation differs (so the check above can fail)
    train(cfg, tmp_path / "c", until=17)
    state_file = tmp_path / "c" / "ckpt" / "train_state.json"
    state = json.loads(state_file.read_text())
    state["rng_ranks"][0]["generator"] = state["rng_ranks"][0]["torch"]
    state_file.write_text(json.dumps(state))
    monkeypatch.setenv("GPTLAB_VERIFY_CHECKPOINTS", "0")  # the edit no longer matches the manifest's sha256
    train(cfg, tmp_path / "c", resume=True)
    assert read_metrics(tmp_path / "c" / "metrics.jsonl")[-1]["val_loss"] != ra[-1]["val_loss"]


# ------------------------------------------------------------------------------------ errors, CLI


def test_bad_configs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="known recipes: .*shakespeare-char-cpu.*tiny"):
        get_recipe("nope")
    with pytest.raises(ValueError, match="unknown training option.*batch_size"):
        get_recipe("tiny", batchsize=3)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        get_recipe("tiny", batch_size=0)
    with pytest.raises(TypeError, match="lr"):
        get_recipe("tiny", lr="fast")
    with pytest.raises(ValueError, match="min_lr"):
        TrainConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(small(data_dir=str(tmp_path / "no-such-dir")), tmp_path / "out")
    with pytest.raises(TypeError, match="TrainConfig"):
        train({"lr": 1}, tmp_path / "out")  # type: ignore[arg-type]


def test_the_model_is_a_nested_gptconfig_and_its_fields_work_flat():
    cpu = get_recipe("shakespeare-char-cpu")
    assert isinstance(cpu.model, GPTConfig)
    assert (cpu.model.n_embd, cpu.model.pos_emb, cpu.model.norm, cpu.model.mlp) == (96, "rope", "rmsnorm", "swiglu")
    assert (cpu.n_layer, cpu.block_size, cpu.norm) == (2, 128, "rmsnorm")  # read flat: the model's
    assert cpu.tokens_per_step == 16 * 128
    assert cpu.model_config(65) == dataclasses.replace(cpu.model, vocab_size=65)
    # set flat (chapter 5's form, get_recipe's and --set's): the model's fields change, nothing else
    flat = TrainConfig(n_layer=3, n_embd=64, bias=True, lr=3e-3)
    assert (flat.model.n_layer, flat.model.n_head, flat.model.n_embd, flat.model.bias, flat.lr) == (3, 4, 64, True, 3e-3)
    assert get_recipe("shakespeare-char-cpu", n_layer=1, pos_emb="learned").model == dataclasses.replace(
        cpu.model, n_layer=1, pos_emb="learned")
    assert cpu.with_overrides(model=GPTConfig(n_layer=1, n_head=2, n_embd=32)).model.n_embd == 32
    with pytest.raises(AttributeError, match="with_overrides"):
        cpu.n_layer = 2  # the model's field, not the config's
    with pytest.raises(ValueError, match="GPTConfig: n_embd"):
        get_recipe("tiny", n_embd=33)  # checked by GPTConfig
    with pytest.raises(TypeError, match="unknown option"):
        TrainConfig(n_layers=2)


def test_from_dict_reads_both_forms():
    """to_dict()'s form (the model nested) round-trips; the flat form that run folders and
    checkpoints written before the model was nested hold (model_kwargs included) reads the same."""
    for name, cfg in RECIPES.items():
        d = json.loads(json.dumps(cfg.to_dict()))  # as train_state.json stores it
        assert isinstance(d["model"], dict) and "n_layer" not in d
        assert TrainConfig.from_dict(d) == cfg, name
    cpu = get_recipe("shakespeare-char-cpu", seed=3)
    old = {k: v for k, v in cpu.to_dict().items() if k != "model"}
    old.update(n_layer=2, n_head=3, n_embd=96, block_size=128, dropout=0.0, bias=False,
               model_kwargs={"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu"})
    assert TrainConfig.from_dict(old) == cpu
    del old["log_interval"], old["final_eval_whole_split"]  # older still: fields added since take their defaults
    assert TrainConfig.from_dict(old) == cpu.with_overrides(log_interval=10, final_eval_whole_split=False)
    assert TrainConfig.from_dict({**old, "model_kwargs": {}}).model == dataclasses.replace(
        cpu.model, pos_emb="learned", norm="layernorm", mlp="gelu")
    with pytest.raises(TypeError, match="unknown option.*'nosuch'"):
        TrainConfig.from_dict({**old, "nosuch": 1})


def test_a_run_saved_in_the_flat_form_resumes(tmp_path):
    """A checkpoint whose train_state.json holds the flat config (older runs) resumes, bit for bit."""
    cfg = small(max_steps=12, eval_interval=6, log_interval=3, dropout=0.1, plot=False)
    whole = train(cfg, tmp_path / "whole")
    train(cfg, tmp_path / "cut", until=6)
    state_file = tmp_path / "cut" / "ckpt" / "train_state.json"
    state = json.loads(state_file.read_text())
    nested = state["config"]
    flat = {k: v for k, v in nested.items() if k != "model"}
    flat.update({k: nested["model"][k] for k in ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias")},
                model_kwargs={})
    state["config"] = flat
    state_file.write_text(json.dumps(state))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPTLAB_VERIFY_CHECKPOINTS", "0")  # the hand edit changes the file's recorded sha256
        resumed = train(cfg, tmp_path / "cut", resume=True)
    assert resumed["val_loss"] == whole["val_loss"]
    same = ("step", "train_loss", "val_loss", "lr", "tokens")
    ra, rb = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("whole", "cut"))
    assert [[r[k] for k in same] for r in ra] == [[r[k] for k in same] for r in rb]
    with pytest.raises(ValueError, match="trained with seed=1337, this run has seed=5"):
        Trainer(cfg.with_overrides(seed=5), tmp_path / "cut", resume=True)
    with pytest.raises(ValueError, match="model config"):  # the model: checked against the checkpoint's
        Trainer(cfg.with_overrides(n_layer=3), tmp_path / "cut", resume=True)


def test_cli_errors(tmp_path, capsys):
    assert main(["train", "--recipe", "nope", "--out", str(tmp_path)]) == 2
    assert "known recipes" in capsys.readouterr().err
    assert main(["train", "--recipe", "tiny", "--out", str(tmp_path), "--max-steps", "0"]) == 2
    assert "max_steps must be >= 1" in capsys.readouterr().err
    assert main(["train", "--recipe", "tiny", "--out", str(tmp_path), "--set", "nosuch=1"]) == 2
    assert "unknown training option" in capsys.readouterr().err
    assert main(["train", "--recipe", "tiny", "--out", str(tmp_path), "--data-dir", str(tmp_path / "nodata")]) == 2
    assert "nodata" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--recipe" in out and "shakespeare-char-cpu" in out


def test_cli_trains(tmp_path, capsys):
    rc = main(["train", "--recipe", "tiny", "--out", str(tmp_path), "--max-steps", "20", "--no-progress", "--num-threads", "1",
               "--set", "eval_tokens=2048", "--set", "eval_interval=10"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "machine:" in out and "final val loss" in out
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 10, 20]
    assert (tmp_path / "ckpt" / "model.safetensors").is_file() and (tmp_path / "loss.png").is_file()


def test_recipes_are_what_they_claim():
    r = RECIPES["shakespeare-char"]  # nanoGPT's config/train_shakespeare_char.py
    assert (r.n_layer, r.n_head, r.n_embd, r.block_size, r.batch_size, r.dropout) == (6, 6, 384, 256, 64, 0.2)
    assert (r.lr, r.min_lr, r.max_steps, r.warmup_steps, r.beta2, r.weight_decay, r.grad_clip) == (
        1e-3, 1e-4, 5000, 100, 0.99, 0.1, 1.0)
    from gptlab.model import GPT

    assert 10.5e6 < GPT(r.model_config(65)).num_params() < 10.9e6  # nanoGPT: "10.65M"
    # the CPU recipe trains with at most a quarter of the FLOPs of nanoGPT's CPU recipe (4 x 128, block
    # 64, batch 12, 2000 steps), which is what lets it reach the same val loss in a fraction of the time
    c = RECIPES["shakespeare-char-cpu"]
    nano = RECIPES["nanogpt-cpu"]
    assert (nano.n_layer, nano.n_head, nano.n_embd, nano.block_size, nano.batch_size, nano.max_steps, nano.lr) == (
        4, 4, 128, 64, 12, 2000, 1e-3)
    def flops(cfg: TrainConfig) -> float:
        return cfg.max_steps * cfg.tokens_per_step * GPT(cfg.model_config(65)).flops_per_token(cfg.block_size)
    assert flops(c) < 0.25 * flops(nano)


@pytest.mark.slow
def test_cpu_recipe_reaches_nanogpt_cpu_val_loss(tmp_path):
    """The full shakespeare-char-cpu recipe reaches nanoGPT's CPU-recipe val loss (1.886) on the
    whole validation split. (Its wall-clock time is measured by `python -m gptlab bench train`.)"""
    summary = train(get_recipe("shakespeare-char-cpu", progress=False, plot=False, save=False), tmp_path)
    assert summary["val_loss"] <= 1.886, summary
    from gptlab.data import prepare_char_data

    whole = val_windows(prepare_char_data().val, 128)[1].numel()
    assert summary["val_tokens"] == whole and summary["evaluations"] == 5  # steps 0, 130, ..., 520


@pytest.mark.slow
def test_cpu_fast_variant_reaches_nanogpt_cpu_val_loss(tmp_path):
    """The benchmark's variant (the chapter's run, evaluated once, at the end) reaches 1.886 on the
    whole validation split too."""
    fast, chapter = RECIPES["shakespeare-char-cpu-fast"], RECIPES["shakespeare-char-cpu"]
    assert fast == chapter.with_overrides(eval_interval=fast.max_steps)
    summary = train(get_recipe("shakespeare-char-cpu-fast", progress=False, plot=False, save=False), tmp_path)
    assert summary["val_loss"] <= 1.886, summary
    assert summary["evaluations"] == 2  # steps 0 and 520 (the whole split)


# ------------------------------------------------------------------------------------ devices


def test_pick_device():
    auto = pick_device()
    assert auto.type == ("cuda" if torch.cuda.is_available() else auto.type)
    if not torch.cuda.is_available():
        assert pick_device(None).type in ("mps", "cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            pick_device("cuda")
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("AUTO") == auto and pick_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        pick_device("tpu")
    with pytest.raises(TypeError):
        pick_device(3)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_cuda_bf16_fused_training(tmp_path):
    cfg = small(max_steps=60, eval_interval=30, device="cuda", save=False, plot=False)
    t = Trainer(cfg, tmp_path)
    assert t.device.type == "cuda"
    # native bf16 only (compute capability >= 8.0); a T4 emulates it and trains in fp16 + GradScaler
    native = torch.cuda.get_device_capability(t.device) >= (8, 0)
    assert t.dtype == (torch.bfloat16 if native else torch.float16)
    assert t.scaler.is_enabled() == (not native)
    assert t.optimizer.defaults.get("fused") is True
    assert torch.backends.cuda.matmul.allow_tf32
    summary = t.fit()
    rows = summary and read_metrics(tmp_path / "metrics.jsonl")
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.5


@pytest.mark.gpu
def test_cuda_fp16_gradscaler_and_compile(tmp_path):
    cfg = small(max_steps=40, eval_interval=20, device="cuda", dtype="float16", compile=True, save=False, plot=False)
    t = Trainer(cfg, tmp_path)
    assert t.scaler.is_enabled()
    t.fit()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isfinite(rows[-1]["val_loss"]) and rows[-1]["val_loss"] < rows[0]["val_loss"]


# ------------------------------------------------------------------------------------ benchmark


def test_bench_train_reports_figures(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc = main(["bench", "train", "--recipe", "tiny", "--max-steps", "20", "--target-loss", "3.9",
               "--num-threads", "1", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    fig = json.loads(path.read_text())
    assert fig["machine"] in out and "tokens/s" in out and "MFU" in out
    assert fig["tokens"] == 20 * 16 * 32 and fig["tokens_per_s"] > 0
    assert 0 < fig["mfu"] < 1  # achieved FLOP/s below the measured matmul peak
    assert fig["time_to_target_s"] > 0 and fig["step_at_target"] == 20
    assert fig["final_val_loss"] <= 3.9
    parts = fig["step_breakdown_ms"]  # where a step's time goes, measured on the trainer's own pieces
    assert set(parts) == {"data", "forward", "backward", "optimizer", "evaluation"}
    assert all(v > 0 for v in parts.values()) and "one step, ms: data" in out


# ------------------------------------------------------------------------------------ distillation


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher")
    train(get_recipe("tiny", n_layer=2, n_embd=48, max_steps=200, eval_interval=200, plot=False, **QUIET), out)
    return out


def _agreement(student, teacher, x) -> float:
    """E[sum_v min(p, q)]: the acceptance probability of speculative sampling with this draft."""
    with torch.no_grad():
        p, q = torch.softmax(teacher(x)[0], -1), torch.softmax(student(x)[0], -1)
    return float(torch.minimum(p, q).sum(-1).mean())


def test_distillation_loss_is_ce_plus_forward_kl(teacher_dir):
    """The loss is (1 - w) CE + w KL(teacher || student), per token; a student equal to its teacher
    has KL 0."""
    from gptlab.data import get_batch

    tr = Trainer(small(teacher=str(teacher_dir), distill_weight=0.3, save=False, plot=False), teacher_dir / "x")
    try:
        x, y = get_batch(tr.data.train, 4, 32, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits, ce = tr.model(x, y)
            p = torch.distributions.Categorical(logits=tr.teacher(x)[0])
            q = torch.distributions.Categorical(logits=logits)
            kl = torch.distributions.kl_divergence(p, q).mean()
            got = tr.batch_loss(tr.model, x, y)
        torch.testing.assert_close(got, 0.7 * ce + 0.3 * kl, atol=1e-5, rtol=1e-5)
        tr.cfg = tr.cfg.with_overrides(distill_weight=1.0)
        with torch.no_grad():
            assert float(tr.batch_loss(tr.teacher, x, y)) == pytest.approx(0.0, abs=1e-6)
        # "kl+tv" adds the total variation, 1 - sum min(p, q): what a guess loses at temperature 1
        tr.cfg = tr.cfg.with_overrides(distill_weight=0.3, distill_divergence="kl+tv")
        with torch.no_grad():
            tv = 1.0 - torch.minimum(p.probs, q.probs).sum(-1).mean()
            got = tr.batch_loss(tr.model, x, y)
            torch.testing.assert_close(got, 0.7 * ce + 0.3 * (kl + tv), atol=1e-5, rtol=1e-5)
            tr.cfg = tr.cfg.with_overrides(distill_weight=1.0)
            assert float(tr.batch_loss(tr.teacher, x, y)) == pytest.approx(0.0, abs=1e-6)
    finally:
        tr.close()


def test_distilled_draft_agrees_more_with_its_teacher(teacher_dir, tmp_path):
    """Same student, same batches, same steps: trained on the teacher's distributions it predicts
    like the teacher more often than trained on the data alone."""
    teacher, _ = load_model(teacher_dir)
    from gptlab.data import prepare_char_data

    x, _ = val_windows(prepare_char_data().val, 32, 8192)
    cfg = small(max_steps=100, eval_interval=100, plot=False)
    train(cfg, tmp_path / "plain")
    train(cfg.with_overrides(teacher=str(teacher_dir)), tmp_path / "distilled")
    plain, _ = load_model(tmp_path / "plain")
    distilled, _ = load_model(tmp_path / "distilled")
    a_plain, a_dist = _agreement(plain, teacher, x), _agreement(distilled, teacher, x)
    assert a_dist > a_plain + 0.01, (a_plain, a_dist)


def test_init_from_starts_a_run_from_another_runs_weights(teacher_dir, tmp_path):
    """A run with init_from starts from that run's weights (a fine-tuning, a draft's second stage);
    then it trains them. A model of another shape is refused, naming what differs; a checkpoint to
    resume from wins over init_from."""
    teacher, _ = load_model(teacher_dir)
    cfg = small(n_layer=2, n_embd=48, init_from=str(teacher_dir), max_steps=5, eval_interval=5, plot=False)
    tr = Trainer(cfg, tmp_path / "ft")
    try:
        start = tr.model.state_dict()
        for name, t in teacher.state_dict().items():
            assert torch.equal(start[name], t), name
    finally:
        tr.close()
    fresh = Trainer(cfg.with_overrides(init_from=None), tmp_path / "fresh")
    try:
        assert not torch.equal(fresh.model.state_dict()["lm_head.weight"], teacher.state_dict()["lm_head.weight"])
    finally:
        fresh.close()
    train(cfg, tmp_path / "ft")
    tuned, _ = load_model(tmp_path / "ft")
    assert not torch.equal(tuned.state_dict()["lm_head.weight"], teacher.state_dict()["lm_head.weight"])
    # resuming the run continues it, not init_from's weights
    resumed = Trainer(cfg.with_overrides(max_steps=6), tmp_path / "ft", resume=True)
    try:
        assert resumed.step == 5
        for name, t in tuned.state_dict().items():
            assert torch.equal(resumed.model.state_dict()[name], t), name
    finally:
        resumed.close()
    train(cfg.with_overrides(max_steps=6), tmp_path / "ft", resume=True)
    again, _ = load_model(tmp_path / "ft")
    assert torch.allclose(again.state_dict()["lm_head.weight"], tuned.state_dict()["lm_head.weight"], atol=0.05)
    assert not torch.equal(again.state_dict()["lm_head.weight"], teacher.state_dict()["lm_head.weight"])
    with pytest.raises(ValueError, match=r"init_from: the model in .* differs from this run's: n_embd=48 there, 32 here"):
        Trainer(small(n_layer=2, n_embd=32, init_from=str(teacher_dir)), tmp_path / "other")
    with pytest.raises(ValueError, match="init_from: cannot load a model from"):
        Trainer(small(init_from=str(tmp_path / "nowhere")), tmp_path / "out")


def test_distillation_bad_teacher_raises_clear_errors(tmp_path, teacher_dir):
    with pytest.raises(ValueError, match="distill_weight must be in"):
        small(distill_weight=1.5)
    with pytest.raises(ValueError, match=r"distill_divergence must be one of \('kl', 'tv', 'kl\+tv'\), got 'js'"):
        small(distill_divergence="js")
    with pytest.raises(ValueError, match="cannot load a model from"):
        Trainer(small(teacher=str(tmp_path / "nowhere")), tmp_path / "out")
    with pytest.raises(ValueError, match="block_size"):
        Trainer(small(teacher=str(teacher_dir), block_size=64), tmp_path / "out")
