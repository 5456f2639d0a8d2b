"""Checkpoints (gptlab.train.checkpoint): safetensors weights with tied weights stored once, optimiser
state and RNG states that round-trip exactly, atomic saves, no unpickling on load."""

from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from gptlab.train import checkpoint as ck
from gptlab.train.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model,
    resolve_checkpoint,
    save_checkpoint,
)
from gptlab.train.rng import rng_state, set_rng_state
from gptlab.model import GPT, GPTConfig
from gptlab.tokenizers import CharTokenizer
from tiny_models import tiny_gpt


def tiny(tie: bool = True, **kw) -> GPT:
    return tiny_gpt(0, eval_mode=False, vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=16,
                    tie_weights=tie, **kw)


def idx(B: int = 2, T: int = 8, V: int = 37) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))


def trained_pair(steps: int = 3):
    model = tiny()
    opt = torch.optim.AdamW(model.optimizer_groups(0.1), lr=1e-2, betas=(0.9, 0.99))
    x = idx()
    for _ in range(steps):
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_roundtrip_tied_weights_stored_once_and_retied(tmp_path):
    model = tiny(tie=True)
    with torch.no_grad():
        model.transformer.wte.weight.add_(0.5)  # not the init values
    tok = CharTokenizer.from_text("hello world, a tiny corpus!")
    out = save_checkpoint(tmp_path / "ck", model, tokenizer=tok)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tied"] == {"lm_head.weight": "transformer.wte.weight"}

    loaded, tok2 = load_model(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # re-tied, not a copy
    assert loaded.config == model.config
    assert tok2 == tok and tok2.decode(tok2.encode("hello")) == "hello"
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    model.eval()
    x = idx()
    assert torch.equal(model(x)[0], loaded(x)[0])
    assert not loaded.training  # load_model returns an eval-mode model


def test_roundtrip_untied_and_variants(tmp_path):
    model = tiny(tie=False, norm="rmsnorm", mlp="swiglu", pos_emb="rope", n_kv_head=1)
    save_checkpoint(tmp_path / "ck", model)
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" in set(f.keys())
    loaded, tok = load_model(tmp_path / "ck")
    assert tok is None
    assert loaded.lm_head.weight is not loaded.transformer.wte.weight
    model.eval()
    x = idx()
    assert torch.equal(model(x)[0], loaded(x)[0])


def test_resolve_accepts_run_dir_and_files(tmp_path):
    model = tiny()
    save_checkpoint(tmp_path / "run" / "ckpt", model)
    for p in (tmp_path / "run", tmp_path / "run" / "ckpt", tmp_path / "run" / "ckpt" / "model.safetensors"):
        assert resolve_checkpoint(p) == tmp_path / "run" / "ckpt"


def test_optimizer_state_roundtrip_continues_identically(tmp_path):
    model, opt = trained_pair()
    save_checkpoint(tmp_path / "ck", model, optimizer=opt, train_state={"step": 3})
    model2 = tiny()
    opt2 = torch.optim.AdamW(model2.optimizer_groups(0.1), lr=1e-2, betas=(0.9, 0.99))
    _, _, state = load_checkpoint(tmp_path / "ck", model2, opt2)
    assert state == {"step": 3}
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for k in s1["state"]:
        for name, v in s1["state"][k].items():
            assert torch.equal(v, s2["state"][k][name]), (k, name)
    # one more identical step on both gives bit-identical weights
    x = idx()
    for m, o in ((model, opt), (model2, opt2)):
        _, loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        o.step()
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)


def test_rng_state_is_json_and_restores_every_stream():
    g = torch.Generator().manual_seed(123)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.randn(5, generator=g)
    saved = json.loads(json.dumps(rng_state(g)))  # survives JSON
    first = (random.random(), np.random.rand(), torch.rand(3), torch.randint(0, 1000, (4,), generator=g))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    g.manual_seed(99)
    set_rng_state(saved, g)
    again = (random.random(), np.random.rand(), torch.rand(3), torch.randint(0, 1000, (4,), generator=g))
    assert first[0] == again[0] and first[1] == again[1]
    assert torch.equal(first[2], again[2]) and torch.equal(first[3], again[3])


def test_failure_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model_a = tiny()
    save_checkpoint(tmp_path / "ck", model_a, train_state={"step": 1})
    model_b = tiny()
    with torch.no_grad():
        for p in model_b.parameters():
            p.add_(1.0)

    def boom(*a, **k):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(ck, "_write_json", boom)  # dies after model.safetensors was written
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(tmp_path / "ck", model_b, train_state={"step": 2})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the temporary folder was cleaned up
    loaded, _ = load_model(tmp_path / "ck")
    for p1, p2 in zip(model_a.parameters(), loaded.parameters()):
        assert torch.equal(p1, p2)
    _, _, state = load_checkpoint(tmp_path / "ck")
    assert state == {"step": 1}


def test_crash_between_renames_recovers_previous(tmp_path, monkeypatch):
    model_a = tiny()
    save_checkpoint(tmp_path / "ck", model_a)
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the old one is already aside, the new one not yet in place
            raise KeyboardInterrupt("killed (injected)")
        return real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", replace)
    model_b = tiny()
    with torch.no_grad():
        model_b.transformer.wte.weight.mul_(2)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "ck", model_b)
    monkeypatch.undo()
    assert not (tmp_path / "ck").exists()
    loaded, _ = load_model(tmp_path / "ck")  # falls back to the checkpoint kept aside
    assert torch.equal(loaded.transformer.wte.weight, model_a.transformer.wte.weight)
    save_checkpoint(tmp_path / "ck", model_b)  # the next save cleans up
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert torch.equal(load_model(tmp_path / "ck")[0].transformer.wte.weight, model_b.transformer.wte.weight)


def test_loading_never_unpickles(tmp_path, monkeypatch):
    model, opt = trained_pair()
    save_checkpoint(tmp_path / "ck", model, optimizer=opt, train_state={"step": 3})

    def forbidden(*a, **k):
        raise AssertionError("a checkpoint load must not unpickle")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    m2 = tiny()
    o2 = torch.optim.AdamW(m2.optimizer_groups(0.1), lr=1e-2)
    load_checkpoint(tmp_path / "ck", m2, o2)
    load_model(tmp_path / "ck")


def test_bad_inputs(tmp_path):
    with pytest.raises(CheckpointError, match="no gptlab checkpoint"):
        load_model(tmp_path / "missing")
    with pytest.raises(TypeError, match="GPT"):
        save_checkpoint(tmp_path / "x", torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(tmp_path / "x", tiny(), train_state={"bad": object()})
    assert not (tmp_path / "x").exists()  # nothing written for a bad argument
    (tmp_path / "notckpt").mkdir()
    (tmp_path / "notckpt" / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a gptlab checkpoint"):
        save_checkpoint(tmp_path / "notckpt", tiny())
    assert (tmp_path / "notckpt" / "precious.txt").read_text() == "keep me"
    # a checkpoint whose weights do not fit its config
    save_checkpoint(tmp_path / "ck", tiny())
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["model"]["n_embd"] = 32
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(tmp_path / "ck")
    # resuming into a model of another shape
    save_checkpoint(tmp_path / "ck2", tiny())
    other = GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(CheckpointError, match="differs"):
        load_checkpoint(tmp_path / "ck2", other)


@pytest.mark.parametrize("damage", ["truncate", "not_safetensors"])
def test_damaged_weights_file_names_the_file(tmp_path, damage):
    """A truncated or foreign model.safetensors raises the package's CheckpointError with the path,
    not safetensors' bare header error; the same for optimizer.safetensors."""
    model = tiny()
    opt = torch.optim.AdamW(model.parameters())
    model(idx())[0].sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "ck", model, optimizer=opt)
    for name in ("model.safetensors", "optimizer.safetensors"):
        f = tmp_path / "ck" / name
        good = f.read_bytes()
        f.write_bytes(good[: len(good) // 3] if damage == "truncate" else b"PK\x03\x04 a zip, not weights")
        with pytest.raises(CheckpointError, match=rf"{name} is not a readable safetensors file"):
            if name == "model.safetensors":
                load_model(tmp_path / "ck")
            else:
                load_checkpoint(tmp_path / "ck", tiny(), optimizer=torch.optim.AdamW(tiny().parameters()))
        f.write_bytes(good)


# ---------------------------------------------------------------------------- a load during a save

SAVER = r"""
import sys, torch
from gptlab.train.checkpoint import save_checkpoint
from gptlab.model import GPT, GPTConfig
model = GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=16))
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
opt.step()
k = 0
print("ready", flush=True)
while True:
    k += 1
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(k)
    save_checkpoint(sys.argv[1], model, optimizer=opt, train_state={"step": k})
"""


@pytest.mark.slow
def test_a_load_while_a_training_run_saves_sees_one_whole_save(tmp_path):
    """A loader racing a process that saves the checkpoint again and again (as ``train`` with a
    short checkpoint_interval does) gets the previous save or the new one, never a mix: no false
    "sha256 does not match" error, and the weights are those of the save whose step it reports.
    Before the fix 1.6% of the loads failed (the audit), and this test within its first seconds."""
    import subprocess
    import sys
    import time

    path = tmp_path / "ck"
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert saver.stdout.readline().strip() == "ready"
        while not (path / "config.json").exists():
            time.sleep(0.01)
        steps = set()
        deadline = time.monotonic() + 8
        loads = 0
        while time.monotonic() < deadline or loads < 100:
            model, _, state = load_checkpoint(path)
            values = {float(p.detach().flatten()[0]) for p in model.parameters()}
            assert values == {float(state["step"])}, (values, state["step"])
            steps.add(state["step"])
            m, _ = load_model(path)
            assert len({float(p.detach().flatten()[0]) for p in m.parameters()}) == 1
            loads += 1
        assert saver.poll() is None, "the saving process ended"
        assert len(steps) > 10  # the loads did race the saves
    finally:
        saver.kill()
        saver.wait()
