"""The C++ decode step (gptlab.fast.native, ``python -m gptlab build-native``): the same operations
as the model's Python step, so the same logits to the last bit, the same cache contents, and the
same tokens in generate, stream, beam search and speculative decoding; everything it does not
reproduce (other architectures, hooks, batches, padding, chunks) runs the Python step.

The module's fixture builds the extension once per test session (20-40 s on 2 cores) in a folder of
its own; where it cannot be built (no C++ compiler, no ninja) the tests skip, saying why."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gptlab import beam_search, generate, speculative_generate, stream
from gptlab.cli import main
from gptlab.fast import cpu, native
from gptlab.fast.cpu import pack_for_decoding
from gptlab.interop.hf import to_hf
from gptlab.kvcache import StaticKVCache
from tiny_models import VARIANTS, tiny_gpt, variant_model

pytestmark = pytest.mark.native


@pytest.fixture(scope="session")
def native_cache(tmp_path_factory) -> str:
    """A gptlab cache folder holding the built extension, shared by the pytest-xdist workers (the
    build's own lock lets one build while the other waits)."""
    folder = tmp_path_factory.getbasetemp().parent / "gptlab-native-cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("GPTLAB_CACHE", str(folder))
    try:
        native.build()
    except native.NativeBuildError as e:
        pytest.skip(str(e))
    finally:
        mp.undo()
    return str(folder)


@pytest.fixture(autouse=True)
def built(native_cache, monkeypatch) -> None:
    monkeypatch.setenv("GPTLAB_CACHE", native_cache)


def _gpt2(seed: int = 0, **kw):
    """A 3-layer GPT-2-style model, 48 wide (3 heads of 16): the architecture the C++ step reproduces."""
    cfg = dict(vocab_size=53, block_size=64, n_layer=3, n_head=3, n_embd=48)
    cfg.update(kw)
    return tiny_gpt(seed, **cfg)


def _steps(model, decode, cache, ids):
    """Logits (T, V) of a 4-token prefill's last position, then one token at a time."""
    out = [decode(ids[:, :4], cache)]
    for t in range(4, ids.shape[1]):
        out.append(decode(ids[:, t : t + 1], cache))
    return torch.cat(out)


@pytest.mark.parametrize("product", ["bag", "bmm", "plain"])
@pytest.mark.parametrize("kw", [{}, dict(bias=False), dict(tie_weights=False)], ids=["gpt2", "no_bias", "untied"])
def test_the_same_logits_and_cache_as_the_python_step(product, kw, monkeypatch):
    """Every product kind: packed blocks by the embedding bag (x86) or by a batched product (CPUs
    without FBGEMM's kernel), and the plain weight."""
    if product == "bmm":
        monkeypatch.setattr(cpu, "EMBEDDING_BAG_PRODUCT", False)
    model = _gpt2(**kw)
    ids = torch.randint(0, 53, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), pack_for_decoding(model, 100, select=lambda name, m: product != "plain"):
        ref, got = StaticKVCache.for_model(model, 1, 32), StaticKVCache.for_model(model, 1, 32)
        want = _steps(model, model.decode, ref, ids)
        step = native.native_decode(model, got, model.decode)
        assert native.last_use() == "the C++ decode step"
        logits = _steps(model, step, got, ids)
    assert torch.equal(logits, want)  # the same operations on the same tensors: the same bits
    assert got.length == ref.length == 24
    assert torch.equal(got.k[:, :, :, :24], ref.k[:, :, :, :24]) and torch.equal(got.v, ref.v)


def test_generate_and_stream_give_the_python_step_s_tokens():
    model = _gpt2(scale=3.0)
    idx = torch.tensor([[5, 1, 7]])
    with native.disabled():
        greedy = generate(model, idx, 40, temperature=0)
        sampled = generate(model, idx, 40, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(2))
    assert native.last_use().startswith("the Python decode step: turned off")
    assert torch.equal(generate(model, idx, 40, temperature=0), greedy)
    assert native.last_use() == "the C++ decode step"
    got = generate(model, idx, 40, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(2))
    assert torch.equal(got, sampled)
    assert torch.equal(torch.cat(list(stream(model, idx, 40, temperature=0)), 1), greedy[:, 3:])
    assert native.last_use() == "the C++ decode step"


def test_greedy_tokens_equal_hugging_face():
    pytest.importorskip("transformers")
    model = _gpt2(scale=2.0)
    hf = to_hf(model).eval()
    idx = torch.tensor([[3, 14, 15, 9]])
    ours = generate(model, idx, 30, temperature=0)
    assert native.last_use() == "the C++ decode step"
    with torch.no_grad():
        theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=30, min_new_tokens=30,
                             do_sample=False)
    assert torch.equal(ours, theirs)


def test_beam_search_and_speculative_decoding_are_unchanged():
    target, draft = _gpt2(scale=3.0), _gpt2(seed=1, n_layer=1, scale=3.0)
    idx = torch.tensor([[2, 4, 6]])
    with native.disabled():
        beams = beam_search(target, idx, num_beams=1, max_new_tokens=12)
        spec, _ = speculative_generate(target, draft, idx, 30, temperature=0, num_draft_tokens=4)
    assert torch.equal(beam_search(target, idx, num_beams=1, max_new_tokens=12), beams)
    got, stats = speculative_generate(target, draft, idx, 30, temperature=0, num_draft_tokens=4)
    assert native.last_use() == "the C++ decode step"  # the draft's one-token guesses
    assert torch.equal(got, spec)
    assert torch.equal(got, generate(target, idx, 30, temperature=0))  # greedy speculative = the target's greedy


@pytest.mark.parametrize("variant", ["rope", "rmsnorm", "swiglu", "gqa", "window", "postnorm", "postnorm_explicit"])
def test_other_architectures_run_the_python_step(variant):
    model = variant_model(**VARIANTS[variant])
    idx = torch.tensor([[1, 2, 3]])
    with native.disabled():
        want = generate(model, idx, 10, temperature=0)
    assert torch.equal(generate(model, idx, 10, temperature=0), want)
    assert native.last_use().startswith("the Python decode step: not GPT-2's architecture")


def test_what_it_does_not_reproduce_runs_the_python_step():
    model = _gpt2()
    cache = StaticKVCache.for_model(model, 1, 8)
    assert native.why_not(model, cache) is None
    assert "batch-1" in native.why_not(model, StaticKVCache.for_model(model, 2, 8))
    model.train()
    assert native.why_not(model, cache) == "the model (or one of its modules) is in training mode"
    model.eval()
    model.transformer.h[0].attn.record_weights = True
    assert "written-out" in native.why_not(model, cache)
    model.transformer.h[0].attn.record_weights = False
    seen = []
    handle = model.transformer.h[1].mlp.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert "hook" in native.why_not(model, cache)
    generate(model, torch.tensor([[1]]), 5, temperature=0)
    assert len(seen) == 5 and "hook" in native.last_use()  # the hook ran at every step
    handle.remove()
    assert "not a float32" in native.why_not(model.double(), StaticKVCache.for_model(model.double(), 1, 8))


def test_a_padded_batch_and_chunks_run_the_python_step_beside_it():
    """Batch 2 with left padding: the Python step; then batch 1: prefill and the chunks in Python,
    the one-token steps in C++, on one cache."""
    model = _gpt2(scale=3.0)
    idx = torch.tensor([[0, 4, 5], [6, 7, 8]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with native.disabled():
        want = generate(model, idx, 8, temperature=0, attention_mask=mask)
    assert torch.equal(generate(model, idx, 8, temperature=0, attention_mask=mask), want)
    assert "batch-1" in native.last_use()
    ids = torch.randint(0, 53, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        caches = StaticKVCache.for_model(model, 1, 20), StaticKVCache.for_model(model, 1, 20)
        step = native.native_decode(model, caches[1], model.decode)
        for a, b in ((0, 5), (5, 6), (6, 9), (9, 10), (10, 11), (11, 15), (15, 16)):
            last_only = b - a == 1
            want = model.decode(ids[:, a:b], caches[0], last_only=last_only)
            assert torch.equal(step(ids[:, a:b], caches[1], last_only=last_only) if not last_only
                               else step(ids[:, a:b], caches[1]), want), (a, b)


def test_past_block_size_and_a_full_cache():
    """Past block_size the decoder recomputes the cropped window without the cache (the Python
    forward); a cache that is full is the Python step's error."""
    model = _gpt2(scale=3.0, block_size=16)
    idx = torch.tensor([[1, 2]])
    with native.disabled():
        want = generate(model, idx, 30, temperature=0)
    assert torch.equal(generate(model, idx, 30, temperature=0), want)
    cache = StaticKVCache.for_model(model, 1, 2)
    step = native.native_decode(model, cache, model.decode)
    with torch.inference_mode():
        step(idx, cache)
        with pytest.raises(ValueError, match="KV cache full"):
            step(idx[:, :1], cache)


def test_not_built_runs_the_python_step(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    model = _gpt2()
    assert not native.is_built()
    generate(model, torch.tensor([[1]]), 3, temperature=0)
    assert native.last_use() == "the Python decode step: not built on this machine (python -m gptlab build-native)"


def test_build_native_command(capsys, monkeypatch, tmp_path):
    assert main(["build-native"]) == 0
    assert "the C++ decode step is already built: " in capsys.readouterr().out
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))  # nothing built there, and no ninja
    import torch.utils.cpp_extension as ext

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(ext, "verify_ninja_availability", no_ninja)
    assert main(["build-native"]) == 1
    err = capsys.readouterr().err
    assert "build-native: building the C++ decode step needs ninja (pip install ninja)" in err


def test_a_linear_layer_of_another_kind_runs_the_python_step():
    model = _gpt2()

    class Scaled(nn.Linear):
        pass

    old = model.transformer.h[0].mlp.c_fc
    model.transformer.h[0].mlp.c_fc = Scaled(old.in_features, old.out_features).eval()
    assert "neither nn.Linear nor PackedLinear" in native.why_not(model, StaticKVCache.for_model(model, 1, 4))


def test_bench_generate_runs_the_cpp_step(tmp_path, capsys):
    """The benchmark's default contender runs the C++ step, and gives gptlab_python's tokens."""
    import json

    out = tmp_path / "gen.json"
    assert main(["bench", "generate", "--quick", "--no-hf", "--lengths", "", "--json", str(out), "--plot", ""]) == 0
    data = json.loads(out.read_text())
    assert data["native"]["steps"] == "the C++ decode step" and data["native"]["built"] is True
    assert data["same_tokens"]["gptlab_python"] is True and data["same_tokens"]["gptlab_static_fwd"] is True
    assert "steps: the C++ decode step" in capsys.readouterr().out
