"""Tampered or inconsistent files are refused on load, naming the file (issue 22, item 4).

A checkpoint's ``config.json`` records the sha256 of every file written with it (and of its own
content); a flipped byte in the weights, a hand-edited ``n_head`` or ``norm_eps``, weights stored as
integers, a tokenizer of another size than the model's vocabulary, each used to load silently and
give other logits. The same for SmolLM2's converted cache and for GPT-2's tokenizer files given by
path. Checkpoints written before the hashes existed still load.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gptlab.train.checkpoint import CheckpointError, load_checkpoint, load_model, save_checkpoint
from gptlab.tokenizers import CharTokenizer
from tiny_models import tiny_gpt

V = 37
TEXT = "abcdefghijklmnopqrstuvwxyz0123456789 "  # 37 distinct characters


def tiny(**kw):
    return tiny_gpt(0, **{"vocab_size": V, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, **kw})


def idx() -> torch.Tensor:
    return torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def ckpt(tmp_path):
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    model(idx())[0].sum().backward()
    opt.step()
    model.eval()
    out = save_checkpoint(tmp_path / "ck", model, tokenizer=CharTokenizer(TEXT), optimizer=opt,
                          train_state={"step": 1})
    return out, model


def flip_byte(path, at: float = 0.6) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)  # past the safetensors header: the file still parses
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def edit_config(ck, fn) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    fn(cfg)
    (ck / "config.json").write_text(json.dumps(cfg, indent=1))


def as_old_checkpoint(ck) -> None:
    """What save_checkpoint wrote before the hashes: no sha256 in config.json, no config in the
    weights' header."""
    edit_config(ck, lambda c: [c.pop(k, None) for k in ("sha256", "config_sha256")])
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt", "gptlab": "gptlab-checkpoint"})


# ---------------------------------------------------------------------------- hashes


def test_manifest_records_a_sha256_per_file(ckpt):
    import hashlib

    ck, _ = ckpt
    cfg = json.loads((ck / "config.json").read_text())
    for name in ("model.safetensors", "optimizer.safetensors", "train_state.json"):
        assert cfg["sha256"][name] == hashlib.sha256((ck / name).read_bytes()).hexdigest(), name
    assert len(cfg["config_sha256"]) == 64


def test_flipped_byte_in_the_weights_names_the_file(ckpt):
    ck, model = ckpt
    flip_byte(ck / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 [0-9a-f]{64} does not match"):
        load_model(ck)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256"):
        load_checkpoint(ck)
    loaded, _ = load_model(ck, verify=False)  # the documented way round, for very large files
    assert any(not torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_flipped_byte_in_the_optimizer_state_and_train_state(ckpt):
    ck, _ = ckpt
    flip_byte(ck / "optimizer.safetensors")
    fresh = tiny()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    opt = torch.optim.AdamW(fresh.parameters())
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: sha256"):
        load_checkpoint(ck, fresh, opt)
    # every file is checked before anything changes: the model keeps its weights, the optimiser its state
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items()) and not opt.state
    (ck / "train_state.json").write_text('{"step": 2}')
    with pytest.raises(CheckpointError, match=r"train_state\.json: sha256"):
        load_checkpoint(ck, tiny())  # no optimizer: its file is not read


def test_skip_verification_with_the_environment_variable(ckpt, monkeypatch):
    ck, _ = ckpt
    flip_byte(ck / "model.safetensors")
    monkeypatch.setenv("GPTLAB_VERIFY_CHECKPOINTS", "0")
    load_model(ck)
    with pytest.raises(CheckpointError, match="sha256"):
        load_model(ck, verify=True)  # the argument wins


@pytest.mark.parametrize("field, value", [("n_head", 4), ("norm_eps", 1e-3)])
def test_edited_config_fails_the_manifest_hash(ckpt, field, value):
    """Still a valid config (n_embd 16 divides by 4 heads), so it passes the field checks, and the
    weights have the same shapes: only the recorded hash tells."""
    ck, _ = ckpt
    edit_config(ck, lambda c: c["model"].__setitem__(field, value))
    with pytest.raises(CheckpointError, match=r"config\.json: its content does not match the config_sha256"):
        load_model(ck)


@pytest.mark.parametrize("field, value", [("n_head", 4), ("norm_eps", 1e-3)])
def test_edited_config_against_the_weights_without_the_hash_check(ckpt, field, value):
    """With verification skipped, the config the weights were saved with (in model.safetensors'
    header) still tells."""
    ck, _ = ckpt
    edit_config(ck, lambda c: c["model"].__setitem__(field, value))
    with pytest.raises(CheckpointError, match=rf"{field} is {value!r} in .*config\.json.* but the weights in "
                                              rf".*model\.safetensors were saved with {field} ="):
        load_model(ck, verify=False)


def test_n_head_edit_of_an_old_checkpoint_fails_the_shape_check(tmp_path):
    """No hash, no config in the header (an old checkpoint): with grouped-query attention the
    number of heads sets the key/value projection's shape, which is checked."""
    ck = save_checkpoint(tmp_path / "ck", tiny(n_kv_head=1))
    as_old_checkpoint(ck)
    edit_config(ck, lambda c: c["model"].__setitem__("n_head", 4))
    with pytest.raises(CheckpointError, match=r"transformer\.h\.0\.attn\..* has shape .* the model expects"):
        load_model(ck)


# ---------------------------------------------------------------------------- old checkpoints


def test_old_checkpoint_without_hashes_still_loads_without_warnings(ckpt, recwarn):
    ck, model = ckpt
    as_old_checkpoint(ck)
    loaded, tok = load_model(ck)
    assert torch.equal(loaded(idx())[0], model(idx())[0]) and tok == CharTokenizer(TEXT)
    opt = torch.optim.AdamW(tiny().parameters(), lr=1e-2)
    _, _, state = load_checkpoint(ck, tiny(), opt)
    assert state == {"step": 1}
    assert len(recwarn) == 0


# ---------------------------------------------------------------------------- dtypes, tokenizer


def test_weights_stored_as_int64_name_the_tensor_and_dtype(ckpt):
    ck, _ = ckpt
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["transformer.wte.weight"] = (tensors["transformer.wte.weight"] * 100).to(torch.int64)
    save_file(tensors, str(ck / "model.safetensors"), metadata=meta)
    for verify in (True, False):  # the precise message first, before the hash's
        with pytest.raises(CheckpointError, match=r"model\.safetensors: transformer\.wte\.weight is stored as "
                                                  r"torch\.int64"):
            load_model(ck, verify=verify)


def test_tokenizer_larger_than_the_vocabulary(ckpt, tmp_path):
    ck, model = ckpt
    edit_config(ck, lambda c: c["tokenizer"].__setitem__("chars", list(TEXT + "ABC")))
    for load in (load_model, load_checkpoint, lambda p: load_model(p, verify=False)):
        with pytest.raises(CheckpointError, match=r"config\.json: the tokenizer has 40 tokens but the model's "
                                                  r"vocab_size is 37"):
            load(ck)
    with pytest.raises(ValueError, match=r"save_checkpoint: the tokenizer has 38 tokens but the model's vocab_size "
                                         r"is 37 \(ids 37 to 37 have no embedding\)"):
        save_checkpoint(tmp_path / "other", model, tokenizer=CharTokenizer(TEXT + "X"))
    assert not (tmp_path / "other").exists()
    save_checkpoint(tmp_path / "padded", model, tokenizer=CharTokenizer(TEXT[:-1]))  # fewer ids: a padded vocabulary
    assert load_model(tmp_path / "padded")[1] == CharTokenizer(TEXT[:-1])


# ---------------------------------------------------------------------------- config fields


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.__setitem__("tied", "nope"), r"'tied' must map .*got str 'nope'"),
        (lambda c: c.__setitem__("tied", {"lm_head.weight": 3}), r"'tied' must map .*got .*3"),
        (lambda c: c.__setitem__("tied", None), r"'tied' must map .*\{\} when none are tied\), got null None"),
        (lambda c: c["model"].__setitem__("tie_weights", "nope"), r"tie_weights must be True or False, got str 'nope'"),
        (lambda c: c["model"].__setitem__("n_layer", "2"), r"n_layer must be a positive int, got str '2'"),
        (lambda c: c["model"].__setitem__("n_layers", 2), r"unknown GPTConfig field\(s\) \['n_layers'\]"),
        (lambda c: c.__setitem__("tokenizer", {"type": "nope"}), r"unknown tokenizer type 'nope'"),
    ],
    ids=["tied-str", "tied-int", "tied-null", "tie_weights", "n_layer-str", "unknown-field", "tokenizer-type"],
)
def test_bad_config_fields_are_one_line_naming_the_file(ckpt, edit, message):
    ck, model = ckpt
    edit_config(ck, edit)
    for load in (load_model, load_checkpoint, lambda p: load_checkpoint(p, model)):
        with pytest.raises(CheckpointError, match=message) as e:
            load(ck)
        text = str(e.value)
        assert str(ck / "config.json") in text and "\n" not in text, text


# ---------------------------------------------------------------------------- SmolLM2's cache


class FakeHFTokenizer:
    """Stands in for the HF tokenizer the cache stores (the real one needs the GGUF file)."""

    def save_pretrained(self, folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tokenizer.json").write_text('{"fake": true}')


@pytest.fixture
def smol_cache(tmp_cache, monkeypatch):
    """A tiny Llama-style model written as SmolLM2's converted cache, in a private cache folder."""
    pytest.importorskip("transformers")
    import transformers

    from gptlab.interop import smollm

    model = tiny(norm="rmsnorm", mlp="swiglu", pos_emb="rope", n_kv_head=1, bias=False)
    smollm._save_converted(smollm.converted_dir(), model, FakeHFTokenizer())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: "the tokenizer")

    def no_fetch(*a, **k):
        raise AssertionError("the test must not convert the GGUF file")

    monkeypatch.setattr(smollm, "load_smollm2_hf", no_fetch)
    return smollm.converted_dir(), model


def test_smollm2_cache_loads_when_intact(smol_cache):
    from gptlab.interop.smollm import load_smollm2

    folder, model = smol_cache
    loaded, tok = load_smollm2("cpu")
    assert tok == "the tokenizer"
    assert torch.equal(loaded(idx())[0], model(idx())[0])


def test_smollm2_cache_with_a_flipped_byte_is_an_error(smol_cache):
    from gptlab.assets import AssetError
    from gptlab.interop.smollm import load_smollm2

    folder, _ = smol_cache
    flip_byte(folder / "model.safetensors")
    with pytest.raises(AssetError, match=r"model\.safetensors: sha256 [0-9a-f]{64} does not match .*delete"):
        load_smollm2("cpu")
    load_smollm2("cpu", verify=False)  # loads (other weights) when asked not to check


def test_smollm2_cache_with_an_edited_config_is_an_error(smol_cache):
    from gptlab.assets import AssetError
    from gptlab.interop.smollm import load_smollm2

    folder, _ = smol_cache
    meta = json.loads((folder / "config.json").read_text())
    meta["config"]["norm_eps"] = 1e-3
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(AssetError, match=r"config\.json: its content does not match"):
        load_smollm2("cpu")
    meta["config"]["tie_weights"] = "nope"
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(TypeError, match=r"config\.json: GPTConfig: tie_weights must be True or False"):
        load_smollm2("cpu", verify=False)


def test_smollm2_cache_tokenizer_file_is_hashed(smol_cache):
    from gptlab.assets import AssetError
    from gptlab.interop.smollm import load_smollm2

    folder, _ = smol_cache
    (folder / "tokenizer" / "tokenizer.json").write_text('{"fake": false}')
    with pytest.raises(AssetError, match=r"tokenizer\.json: sha256"):
        load_smollm2("cpu")


# ---------------------------------------------------------------------------- GPT-2's files


@pytest.mark.parametrize("which", ["vocab-bpe", "encoder-json"])
def test_gpt2_tokenizer_files_given_by_path_are_checked(tmp_path, which):
    from gptlab.assets import ASSETS, fetch
    from gptlab.tokenizers import GPT2Tokenizer

    paths = {}
    for name in ("vocab-bpe", "encoder-json"):
        src = fetch(ASSETS[f"gpt2-{name}"], quiet=True)
        paths[name] = tmp_path / src.name
        shutil.copyfile(src, paths[name])
    data = bytearray(paths[which].read_bytes())
    data[len(data) // 2] ^= 0x01
    paths[which].write_bytes(bytes(data))
    expected = ASSETS[f"gpt2-{which}"].sha256
    with pytest.raises(ValueError, match=rf"{paths[which].name}: sha256 [0-9a-f]{{64}}, expected {expected}"):
        GPT2Tokenizer(paths["vocab-bpe"], paths["encoder-json"])
