"""The Python decode step where the C++ one is not built (gptlab.fast.native.PythonDecoder), the
one-line hint that says how to build the C++ one, and the set-up that builds it (``make setup`` ->
``python -m gptlab build-native --optional``). None of these needs the C++ step built: what does is
in tests/test_native.py."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from gptlab import generate, speculative_generate
from gptlab.cli import main
from gptlab.fast import cpu, native
from gptlab.fast.cpu import pack_for_decoding
from gptlab.kvcache import StaticKVCache
from tiny_models import LLAMA, tiny_gpt

from conftest import REPO_ROOT

# Marked like tests/test_native.py so that conftest leaves the C++ step on: each test that decodes
# points GPTLAB_CACHE at an empty folder, where nothing is built.
pytestmark = pytest.mark.native


def _gpt2(seed: int = 0, **kw):
    cfg = dict(vocab_size=53, block_size=64, n_layer=3, n_head=3, n_embd=48)
    cfg.update(kw)
    return tiny_gpt(seed, **cfg)


@pytest.mark.parametrize("product", ["bag", "bmm", "plain"])
@pytest.mark.parametrize("kw", [{}, dict(bias=False), dict(tie_weights=False)], ids=["gpt2", "no_bias", "untied"])
def test_the_python_twin_gives_the_model_s_logits_and_cache(product, kw, monkeypatch):
    """Its steps are the model's (``model.decode``) to the last bit, on every product kind."""
    if product == "bmm":
        monkeypatch.setattr(cpu, "EMBEDDING_BAG_PRODUCT", False)
    model = _gpt2(**kw)
    ids = torch.randint(0, 53, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), pack_for_decoding(model, 100, select=lambda name, m: product != "plain"):
        ref, got = StaticKVCache.for_model(model, 1, 32), StaticKVCache.for_model(model, 1, 32)
        want = [model.decode(ids[:, :4], ref)]
        model.decode(ids[:, :4], got)
        twin = native.PythonDecoder(model, got)
        logits = [want[0]]
        for t in range(4, 24):
            want.append(model.decode(ids[:, t : t + 1], ref))
            logits.append(twin.step(ids[:, t : t + 1], got.length))
            got.advance(1)
    assert torch.equal(torch.cat(logits), torch.cat(want))
    assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v)


def test_decoders_run_it_and_give_the_model_s_tokens(monkeypatch, tmp_path):
    """Nothing built: generate's and speculative decoding's one-token steps run the Python twin,
    with the tokens of the model's own step (a hooked model runs that one)."""
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    target, draft = _gpt2(scale=3.0), _gpt2(seed=1, n_layer=1, scale=3.0)
    idx = torch.tensor([[2, 4, 6]])
    calls = []
    real = native.PythonDecoder.step
    monkeypatch.setattr(native.PythonDecoder, "step", lambda self, i, p: calls.append(p) or real(self, i, p))
    got = generate(target, idx, 20, temperature=0)
    assert native.last_use() == f"the Python decode step: {native.NOT_BUILT}" and len(calls) == 19
    handle = target.transformer.h[0].register_forward_hook(lambda m, i, o: None)  # the model's own step
    assert torch.equal(generate(target, idx, 20, temperature=0), got)
    assert "hook" in native.last_use() and len(calls) == 19
    handle.remove()
    spec, _ = speculative_generate(target, draft, idx, 20, temperature=0, num_draft_tokens=4)
    assert torch.equal(spec, got) and len(calls) > 19  # the draft's guesses ran the twin


def test_the_hint_is_one_line_once_per_process(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    for name in ("PYTEST_CURRENT_TEST", "CI", "GPTLAB_PROGRESS", "GPTLAB_NATIVE_HINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(native, "_HINTED", [False])
    model = _gpt2()
    generate(model, torch.tensor([[1]]), 3, temperature=0)
    generate(model, torch.tensor([[1]]), 3, temperature=0)
    err = capsys.readouterr().err
    assert err == native.HINT + "\n" and "python -m gptlab build-native" in err
    monkeypatch.setattr(native, "_HINTED", [False])
    with native.disabled():  # a comparison that turns the C++ step off is not told
        generate(model, torch.tensor([[1]]), 3, temperature=0)
    for env in ({"GPTLAB_NATIVE_HINT": "0"}, {"CI": "true"}, {"GPTLAB_PROGRESS": "text"}):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            generate(model, torch.tensor([[1]]), 3, temperature=0)
    assert capsys.readouterr().err == ""


def test_build_native_optional_without_a_compiler(monkeypatch, tmp_path, capsys):
    """``make setup``'s call: one line saying what is lost and how to get it, exit 0; without
    ``--optional`` the same error exits 1."""
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    assert main(["build-native", "--optional"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("==> NOTE: building the C++ decode step needs a C++ compiler")
    assert "python -m gptlab build-native" in out
    assert main(["build-native"]) == 1
    assert "needs a C++ compiler" in capsys.readouterr().err


def test_make_setup_builds_the_native_step(tmp_path):
    """The set-up of both README commands runs ``build-native --optional`` (``make -n`` prints it)."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".gptlab-setup-stamp").touch()
    for goal in ("setup", "book", "test"):
        run = subprocess.run(["make", "-n", f"VENV={venv}", f"PY={sys.executable}", goal], cwd=REPO_ROOT,
                             capture_output=True, text=True)
        assert "-m gptlab build-native --optional" in run.stdout, (goal, run.stdout, run.stderr)


@pytest.mark.parametrize("version, flags", [
    ("c++ (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.", ["-fopenmp"]),
    ("Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu", []),
    ("Apple clang version 15.0.0 (clang-1500.3.9.4)", []),
])
def test_openmp_only_with_gcc(version, flags, monkeypatch):
    """``build-native`` compiles the own product's parallel loop with GCC's OpenMP (PyTorch's own
    pool, libgomp), never with clang's (another runtime, a second pool of threads)."""
    import types

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info() or sys.platform == "darwin":
        flags = []
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=version))
    assert native._openmp_flags("c++") == flags


# --------------------------------------------------------------------------- Llama-style blocks

LLAMA_CONFIGS = {
    "llama_gqa": {**LLAMA},
    "llama_full_heads": {**LLAMA, "n_kv_head": 4},
    "llama_mqa_bias": {**LLAMA, "n_kv_head": 1, "bias": True, "tie_weights": True},
    "llama_head_dim_6": {**LLAMA, "n_embd": 36, "head_dim_override": 6, "norm_eps": 1e-6},
    "llama_head_dim_10": {**LLAMA, "n_head": 6, "n_kv_head": 3, "n_embd": 60, "n_inner": 88},
    "rope": dict(pos_emb="rope"),
    "rmsnorm": dict(norm="rmsnorm"),
    "swiglu_no_bias": dict(mlp="swiglu", bias=False),
    "gqa_learned": dict(n_head=4, n_kv_head=2),
}


def _llama(name: str, seed: int = 0, **kw):
    cfg = dict(vocab_size=53, block_size=64, n_layer=3, n_head=4, n_embd=32)
    cfg.update(LLAMA_CONFIGS[name])
    cfg.update(kw)
    return tiny_gpt(seed, **cfg)


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("name", list(LLAMA_CONFIGS))
def test_the_llama_twin_gives_the_model_s_logits_and_cache(name, packed, grad_mode):
    """RoPE, RMSNorm, SwiGLU, grouped-query attention (and each alone): the twin's logits and cache
    writes are ``model.decode``'s to the last bit, over 44 steps after an 8-token prefill."""
    model = _llama(name)
    assert native.why_not(model, StaticKVCache.for_model(model, 1, 4)) is not None  # not the C++ step's
    ids = torch.randint(0, 53, (1, 52), generator=torch.Generator().manual_seed(2))
    mode = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with mode, pack_for_decoding(model, 100, select=lambda n, m: packed):
        assert packed == any(type(m) is cpu.PackedLinear for m in model.modules())
        ref, got = StaticKVCache.for_model(model, 1, 60), StaticKVCache.for_model(model, 1, 60)
        model.decode(ids[:, :8], ref)
        model.decode(ids[:, :8], got)
        assert native.why_not_python(model, got) is None
        twin = native.LlamaPythonDecoder(model, got)
        want, logits = [], []
        for t in range(8, 52):
            want.append(model.decode(ids[:, t : t + 1], ref))
            logits.append(twin.step(ids[:, t : t + 1], got.length))
            got.advance(1)
            assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v)
    assert torch.equal(torch.cat(logits), torch.cat(want))


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa_bias", "rope"])
def test_generate_runs_the_llama_twin_with_the_model_s_tokens(name, monkeypatch, tmp_path):
    """``fast=True`` runs the twin for every one-token step, and gives ``fast=False``'s tokens (and
    speculative decoding with a Llama-style target and draft the target's greedy tokens)."""
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    model = _llama(name, scale=3.0)
    idx = torch.tensor([[2, 4, 6, 8]])
    calls = []
    real = native.LlamaPythonDecoder.step
    monkeypatch.setattr(native.LlamaPythonDecoder, "step", lambda self, i, p: calls.append(p) or real(self, i, p))
    want = generate(model, idx, 40, temperature=0, fast=False)
    assert calls == []  # fast=False: the model's own step
    got = generate(model, idx, 40, temperature=0)
    assert torch.equal(got, want) and calls == list(range(4, 43))
    assert native.last_use().startswith("the Python decode step: not GPT-2's architecture")
    sampled = [generate(model, idx, 30, temperature=1.0, top_k=10, fast=f, generator=torch.Generator().manual_seed(5))
               for f in (True, False)]
    assert torch.equal(*sampled)
    draft = _llama(name, seed=1, n_layer=1, scale=3.0)
    spec, _ = speculative_generate(model, draft, idx, 40, temperature=0, num_draft_tokens=4)
    assert torch.equal(spec, want) and len(calls) > 39 + 30


@pytest.mark.parametrize("kw, reason", [
    ({**LLAMA, "window_size": 6}, "a sliding attention window"),
    (dict(prenorm=False, norm="rmsnorm"), "post-norm blocks"),
    ({**LLAMA, "attn_impl": "explicit"}, "written-out"),
])
def test_what_the_llama_twin_does_not_reproduce_runs_the_model_s_step(kw, reason, monkeypatch, tmp_path):
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    model = _gpt2(**{"n_head": 4, "n_embd": 32, **kw})
    monkeypatch.setattr(native.LlamaPythonDecoder, "step", lambda *a: pytest.fail("the twin ran"))
    idx = torch.tensor([[1, 2, 3]])
    got = generate(model, idx, 12, temperature=0)
    assert reason in native.why_not_python(model, StaticKVCache.for_model(model, 1, 8))
    use = native.last_use()
    assert use.startswith("the model's own step (GPT.decode): not GPT-2's architecture") and reason in use
    assert torch.equal(got, generate(model, idx, 12, temperature=0, fast=False))


def test_the_llama_twin_refuses_hooks_training_and_other_dtypes(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    model = _llama("llama_gqa")
    cache = StaticKVCache.for_model(model, 1, 8)
    assert native.why_not_python(model, cache) is None
    assert "batch-1" in native.why_not_python(model, StaticKVCache.for_model(model, 2, 8))
    model.train()
    assert "training mode" in native.why_not_python(model, cache)
    model.eval()
    seen = []
    handle = model.transformer.h[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert "hook" in native.why_not_python(model, cache)
    generate(model, torch.tensor([[1]]), 5, temperature=0)
    assert len(seen) == 5 and native.last_use().startswith("the model's own step") and "hook" in native.last_use()
    handle.remove()
    double = _llama("llama_gqa").double()
    assert "float32" in native.why_not_python(double, StaticKVCache.for_model(double, 1, 8))
    generate(double, torch.tensor([[1]]), 3, temperature=0)
    assert native.last_use().startswith("the model's own step")


def test_a_gpt2_model_the_cpp_step_refuses_may_run_the_llama_twin(monkeypatch, tmp_path):
    """Norms of different eps: not the C++ step's (one eps), but the twin gives each norm its own."""
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    model = _gpt2(scale=3.0)
    model.transformer.h[1].ln_2.eps = 1e-3
    idx = torch.tensor([[2, 4, 6]])
    got = generate(model, idx, 20, temperature=0)
    assert native.last_use() == "the Python decode step: the layer norms' eps differ"
    assert torch.equal(got, generate(model, idx, 20, temperature=0, fast=False))


# --------------------------------------------------------------------------- chunks of several tokens

CHUNKS = [(5, True), (2, False), (9, False), (3, True), (7, False), (native.CHUNK_MAX_TOKENS, False)]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("name", [*LLAMA_CONFIGS, "gpt2"])
def test_the_twin_s_chunks_give_the_model_s_logits_and_cache(name, packed):
    """Several tokens in one call (speculative decoding's verification, short prefills): the logits,
    all of them or the last one's, and the cache writes are ``model.decode``'s to the last bit."""
    model = _gpt2() if name == "gpt2" else _llama(name)
    with torch.inference_mode(), pack_for_decoding(model, 100, select=lambda n, m: packed):
        for T, logits, want, got, ref in _chunks_beside_the_model(model):
            assert torch.equal(logits, want), T
            assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v)


def _chunks_beside_the_model(model, product=None):
    """The twin's chunks of CHUNKS (``product``: its chunk products) and ``model.decode``'s of the
    same tokens, each into a cache of its own: yields ``(T, logits, want, got, ref)`` after each,
    the logits those ``decode`` returns (the last one's alone with ``last_only``), the two caches."""
    ids = torch.randint(0, 53, (1, 64), generator=torch.Generator().manual_seed(3))
    ref, got = StaticKVCache.for_model(model, 1, 64), StaticKVCache.for_model(model, 1, 64)
    twin = native.LlamaPythonDecoder(model, got, product)
    t = 0
    for T, last_only in CHUNKS:
        want = model.decode(ids[:, t : t + T], ref, last_only=last_only)
        logits = twin.chunk(ids[:, t : t + T], got.length, last_only)
        got.advance(T)
        assert logits.shape == (1, 1 if last_only else T, 53)
        yield T, logits.select(1, -1) if last_only else logits, want, got, ref
        t += T


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("name", [*LLAMA_CONFIGS, "gpt2"])
def test_the_lean_chunk_gives_the_model_s_logits_and_cache_up_to_rounding(name, parts, monkeypatch):
    """Where a chunk's products are not the model's (row blocks in place, the C++ step's own), a
    chunk of more than BAG_MAX_ROWS tokens runs the lean path (LlamaPythonDecoder._lean_chunk: the
    outputs block by block, RoPE's multiply-adds, the written-out attention under a float mask,
    grouped heads as a batch): its logits, all or the last one's, and its cache writes equal
    ``model.decode``'s up to float rounding, for every architecture the twin takes, with blocks in
    place for every other layer and a plain product for the rest (both ways of reading outputs), in
    two row blocks or four (SwiGLU's c_fc then in four too: its halves reordered)."""
    model = _gpt2(scale=3.0) if name == "gpt2" else _llama(name, scale=3.0)
    linears = native._linears(model)
    monkeypatch.setattr(native, "SWIGLU_TWO_BLOCKS_THREADS", 0 if parts == 4 else 1 << 10)

    def product(m):  # blocks in place for every other layer whose rows divide in parts (the block's
        i = linears.index(m)  # second two in every other block), F.linear for the rest
        if (i + i // 4) % 2 == 0 and m.out_features % parts == 0:
            return native._InPlaceBlocks(m, parts)
        return lambda x, w=m.weight.detach(), b=m.bias: torch.nn.functional.linear(x, w, b)

    lean = []
    monkeypatch.setattr(native.LlamaPythonDecoder, "_lean_chunk",
                        lambda self, *a, f=native.LlamaPythonDecoder._lean_chunk: lean.append(a[0].shape[1]) or f(self, *a))
    assert any(type(product(m)) is native._InPlaceBlocks for m in linears)
    with torch.inference_mode():
        for T, logits, want, got, ref in _chunks_beside_the_model(model, product):
            torch.testing.assert_close(logits, want, atol=3e-5, rtol=1e-5)
            torch.testing.assert_close(got.k, ref.k, atol=3e-5, rtol=1e-5)
            torch.testing.assert_close(got.v, ref.v, atol=3e-5, rtol=1e-5)
            ref.k.copy_(got.k)  # the next chunk reads the same keys and values in both
            ref.v.copy_(got.v)
    assert lean == [T for T, _ in CHUNKS if T > cpu.BAG_MAX_ROWS]


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_decoders_run_chunks_through_the_twin(name, monkeypatch, tmp_path):
    """``native_decode`` runs chunks of 2 to CHUNK_MAX_TOKENS tokens through the twin's chunk (with
    ``last_only`` either way), longer ones, other keywords and a full cache through the model's step;
    speculative decoding's verifications run it with the target's greedy tokens."""
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    model = _gpt2(scale=3.0) if name == "gpt2" else _llama(name, scale=3.0)
    chunks, own = [], []
    real = native.LlamaPythonDecoder.chunk
    monkeypatch.setattr(native.LlamaPythonDecoder, "chunk",
                        lambda self, i, p, last_only=False: chunks.append(i.shape[1]) or real(self, i, p, last_only))
    ids = torch.randint(0, 53, (1, 60), generator=torch.Generator().manual_seed(4))

    def fallback(idx, cache, **kw):
        own.append(idx.shape[1])
        return model.decode(idx, cache, **kw)

    with torch.inference_mode(), pack_for_decoding(model, 100):
        ref, got = StaticKVCache.for_model(model, 1, 48), StaticKVCache.for_model(model, 1, 48)
        step = native.native_decode(model, got, fallback)
        assert torch.equal(step(ids[:, :6], got), model.decode(ids[:, :6], ref))
        assert torch.equal(step(ids[:, 6:9], got, last_only=False), model.decode(ids[:, 6:9], ref, last_only=False))
        one = step(ids[:, 9:10], got, last_only=False)  # one token, all its logits: (1, 1, V)
        assert torch.equal(one, model.decode(ids[:, 9:10], ref, last_only=False)) and one.shape == (1, 1, 53)
        assert chunks == [6, 3] and own == []
        step(ids[:, 10:10 + native.CHUNK_MAX_TOKENS + 1], got)  # too long for the twin
        assert own == [native.CHUNK_MAX_TOKENS + 1]
        with pytest.raises(ValueError, match="KV cache full"):  # the model's step, with its own error
            step(ids[:, :8], got)
        assert own[-1] == 8 and chunks == [6, 3]
    idx = torch.tensor([[2, 4, 6, 8]])
    want = generate(model, idx, 40, temperature=0, fast=False)
    draft = _gpt2(seed=1, n_layer=1, scale=3.0) if name == "gpt2" else _llama(name, seed=1, n_layer=1, scale=3.0)
    chunks.clear()
    spec, stats = speculative_generate(model, draft, idx, 40, temperature=0, num_draft_tokens=4)
    assert torch.equal(spec, want)
    assert chunks.count(5) == stats.drafted.count(4) > 20  # each verification of 4 guesses (the draft's chunks: <= 2)


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_chunks_read_the_weights_in_place_up_to_rounding(name, monkeypatch, tmp_path):
    """Layers large enough (gptlab.fast.cpu.splits_chunks) run a chunk of more than BAG_MAX_ROWS
    tokens through the batched product over their weight's row blocks in place (and the lean path):
    the logits and cache writes equal the model's up to float rounding; to the last bit with
    SPLIT_CHUNKS off, and for chunks of 2 or 3 tokens read from the same cache. Speculative decoding's target then
    skips packing (its verifications are chunks) and gives the target's greedy tokens."""
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    wide = dict(n_embd=96, n_head=4)
    model = _gpt2(scale=3.0, **wide) if name == "gpt2" else _llama(name, scale=3.0, **wide)
    linears = native._linears(model)
    split = [m for m in linears if cpu.splits_chunks(m)]
    assert 0 < len(split) < len(linears)  # lm_head (53 rows) is not split
    ids = torch.randint(0, 53, (1, 60), generator=torch.Generator().manual_seed(4))
    for on in (True, False):
        monkeypatch.setattr(cpu, "SPLIT_CHUNKS", on)
        with torch.inference_mode():
            ref, got = StaticKVCache.for_model(model, 1, 64), StaticKVCache.for_model(model, 1, 64)
            step = native.native_decode(model, got, model.decode)
            assert native.last_chunk_products(model) == native.last_chunk_products() == \
                (f"row blocks in place for {len(split)} of {len(linears)} linear layers" if on else "the model's products")
            t = 0
            for T in (9, 2, 19, 3, 5):
                want, logits = model.decode(ids[:, t : t + T], ref, last_only=False), step(ids[:, t : t + T], got, last_only=False)
                if on and T > cpu.BAG_MAX_ROWS:
                    torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-5)
                else:
                    assert torch.equal(logits, want), (on, T)
                # the keys and values come from the products (and RoPE), bitwise only where they are the model's
                torch.testing.assert_close(got.k, ref.k, atol=2e-5, rtol=1e-5)
                torch.testing.assert_close(got.v, ref.v, atol=2e-5, rtol=1e-5)
                if on and T > cpu.BAG_MAX_ROWS:  # the next chunk reads the same keys and values in both
                    ref.k.copy_(got.k)
                    ref.v.copy_(got.v)
                t += T
    monkeypatch.setattr(cpu, "SPLIT_CHUNKS", True)
    keep = native.chunk_keeps_plain(model)
    assert {m for m in linears if keep(m)} == set(split)
    draft = _gpt2(seed=1, n_layer=1, scale=3.0) if name == "gpt2" else _llama(name, seed=1, n_layer=1, scale=3.0)
    from gptlab.generation import speculative as sp
    with torch.inference_mode(), sp._decode_mode(model, draft, True, 40):
        packed = [m for m in model.modules() if type(m) is cpu.PackedLinear]
        assert not any(m.weight is s.weight for m in packed for s in split)  # the split layers stay plain
    idx = torch.tensor([[2, 4, 6, 8]])
    want = generate(model, idx, 40, temperature=0, fast=False)
    spec, stats = speculative_generate(model, draft, idx, 40, temperature=0, num_draft_tokens=6)
    assert torch.equal(spec, want) and native.last_chunk_products(model).startswith("row blocks in place")
