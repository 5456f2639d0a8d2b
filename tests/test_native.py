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
import torch.nn.functional as F

from gptlab import beam_search, generate, speculative_generate, stream
from gptlab.cli import main
from gptlab.fast import cpu, native
from gptlab.fast.cpu import pack_for_decoding
from gptlab.interop.hf import to_hf
from gptlab.kvcache import StaticKVCache
from tiny_models import LLAMA, VARIANTS, tiny_gpt, variant_model

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
    """The built step, multiplying by its own product wherever it can (OWN_PRODUCT "always": the
    fused step, whose logits equal the model's up to rounding); a test of the bit-exact step sets
    "never"."""
    monkeypatch.setenv("GPTLAB_CACHE", native_cache)
    monkeypatch.setattr(native, "OWN_PRODUCT", "always")


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


def _compared(model, ids, max_len: int, products: str):
    """The model's own steps and native_decode's over ids (``_steps``), each on a cache of its own,
    the C++ step having reported ``products`` (last_products) -> (logits, want, got, ref)."""
    ref, got = StaticKVCache.for_model(model, 1, max_len), StaticKVCache.for_model(model, 1, max_len)
    want = _steps(model, model.decode, ref, ids)
    step = native.native_decode(model, got, model.decode)
    assert native.last_products() == products
    return _steps(model, step, got, ids), want, got, ref


@pytest.mark.parametrize("product", ["bag", "bmm", "plain"])
@pytest.mark.parametrize("kw", [{}, dict(bias=False), dict(tie_weights=False)], ids=["gpt2", "no_bias", "untied"])
def test_the_same_logits_and_cache_as_the_python_step(product, kw, monkeypatch):
    """Every product kind: packed blocks by the embedding bag (x86) or by a batched product (CPUs
    without FBGEMM's kernel), and the plain weight."""
    if product == "bmm":
        monkeypatch.setattr(cpu, "EMBEDDING_BAG_PRODUCT", False)
    monkeypatch.setattr(native, "OWN_PRODUCT", "never")  # at::linear where the weight is plain
    model = _gpt2(**kw)
    ids = torch.randint(0, 53, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), pack_for_decoding(model, 100, select=lambda name, m: product != "plain"):
        ref, got = StaticKVCache.for_model(model, 1, 32), StaticKVCache.for_model(model, 1, 32)
        want = _steps(model, model.decode, ref, ids)
        step = native.native_decode(model, got, model.decode)
        assert native.last_use() == "the C++ decode step"
        assert native.last_products().endswith("PyTorch operations step")
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
    # the Python twin of the model's step (LlamaPythonDecoder) where it reproduces the model, else the model's own step
    twin = variant in ("rope", "rmsnorm", "swiglu", "gqa")
    step = "the Python decode step" if twin else "the model's own step (GPT.decode)"
    assert native.last_use().startswith(f"{step}: not GPT-2's architecture")


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


@pytest.mark.parametrize("own", ["never", "always"])
def test_a_padded_batch_and_chunks_run_the_python_step_beside_it(own, monkeypatch):
    """Batch 2 with left padding: the Python step; then batch 1: prefill and the chunks in Python,
    the one-token steps in C++, on one cache: the same bits with the PyTorch operations step, the
    same up to rounding with the fused one."""
    monkeypatch.setattr(native, "OWN_PRODUCT", own)
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
            got = step(ids[:, a:b], caches[1], last_only=last_only) if not last_only else step(ids[:, a:b], caches[1])
            if own == "never":
                assert torch.equal(got, want), (a, b)
            else:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{(a, b)}")


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


# --------------------------------------------------------------------------- the step's own product


@pytest.mark.parametrize("out_features, in_features", [(1, 1), (5, 17), (7, 33), (4, 16), (65, 48), (130, 100),
                                                       (3, 1536), (1152, 384)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_the_own_product_is_f_linear_up_to_rounding(out_features, in_features, bias):
    """Rows not a multiple of 4, inputs not a multiple of 16 (the scalar tails), one row, one input."""
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(in_features, generator=g)
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).float()
    tol = 1e-6 * in_features ** 0.5 * 8
    torch.testing.assert_close(native.matvec(w, x, b), want, rtol=1e-5, atol=tol)
    torch.testing.assert_close(native.matvec(w, x.view(1, -1), b), want.view(1, -1), rtol=1e-5, atol=tol)
    strided = torch.randn(2 * in_features, generator=g)[::2]  # not contiguous: copied
    torch.testing.assert_close(native.matvec(w, strided, b),
                               torch.nn.functional.linear(strided, w, b), rtol=1e-5, atol=tol)


def test_the_own_product_does_not_depend_on_the_thread_count():
    """Each output's sum is one thread's, in one order, whatever the split: the same bits."""
    g = torch.Generator().manual_seed(3)
    w, x, b = torch.randn(1536, 384, generator=g), torch.randn(384, generator=g), torch.randn(1536, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.matvec(w, x, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(native.matvec(w, x, b), one)


@pytest.mark.parametrize("out, inp", [(37, 19), (64, 48), (131, 200)])
@pytest.mark.parametrize("n", [2, 3, 9, 33])
def test_the_own_product_of_several_vectors_is_each_vector_s_product(out, inp, n):
    """Several vectors (a chunk of tokens): each row the product of that vector alone, to the last bit
    (the same sums), whatever the thread count; F.linear's up to float rounding."""
    g = torch.Generator().manual_seed(out + n)
    w, x, b = torch.randn(out, inp, generator=g), torch.randn(1, n, inp, generator=g), torch.randn(out, generator=g)
    for bias in (b, None):
        y = native.matvec(w, x, bias)
        assert y.shape == (1, n, out)
        alone = torch.stack([native.matvec(w, x[0, j], bias) for j in range(n)])[None]
        assert torch.equal(y, alone)
        torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(native.matvec(w, x, bias), y)
        finally:
            torch.set_num_threads(threads)
    strided = torch.randn(n, 2 * inp, generator=g)[:, ::2]  # made contiguous first
    assert torch.equal(native.matvec(w, strided, b), native.matvec(w, strided.contiguous(), b))


def test_the_own_product_refuses_what_it_does_not_multiply():
    w, x = torch.randn(8, 16), torch.randn(16)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        native.matvec(w.t().contiguous().t(), x)  # a transposed weight
    with pytest.raises(RuntimeError, match="contiguous float32"):
        native.matvec(w.double(), x)
    with pytest.raises(RuntimeError, match=r"float32 vectors of in = 16 features \(\.\.\., 16\)"):
        native.matvec(w, torch.randn(2, 15))  # the wrong number of features
    with pytest.raises(RuntimeError, match="float32 vectors of in = 16"):
        native.matvec(w, torch.randn(2, 16).double())
    with pytest.raises(RuntimeError, match="float32 vectors of in = 16"):
        native.matvec(w, torch.randn(0, 16))  # no vector
    with pytest.raises(RuntimeError, match="empty or a contiguous float32"):
        native.matvec(w, x, torch.randn(7))


@pytest.mark.parametrize("kw", [{}, dict(bias=False), dict(tie_weights=False), dict(n_embd=60, n_head=3),
                                dict(n_embd=36, n_head=2)],
                         ids=["gpt2", "no_bias", "untied", "head_dim_20", "head_dim_18"])
def test_the_fused_step_gives_the_model_s_logits_up_to_rounding(kw):
    """The own product and the fused step (own layer norms, attention, GELU): the model's logits and
    cache within float rounding, past 32 cached positions (where the heads go to several threads),
    on widths and head sizes that are not multiples of 16."""
    model = _gpt2(scale=2.0, **kw)
    ids = torch.randint(0, 53, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits, want, got, ref = _compared(model, ids, 64, "own product for 13 of 13 linear layers, fused step")
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert got.length == ref.length == 60
    torch.testing.assert_close(got.k, ref.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.v, ref.v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("own", ["always", "never"])
def test_greedy_tokens_of_both_steps_equal_the_python_step_s(own, monkeypatch):
    monkeypatch.setattr(native, "OWN_PRODUCT", own)
    model = _gpt2(scale=3.0)
    idx = torch.tensor([[5, 1, 7]])
    with native.disabled():
        want = generate(model, idx, 60, temperature=0)
    assert torch.equal(generate(model, idx, 60, temperature=0), want)
    assert native.last_products().startswith("own product for 13 of 13" if own == "always" else "own product for 0 of 13")


def test_the_calibration_picks_the_own_product_per_shape_where_it_is_faster(tmp_path, monkeypatch):
    """products_plan times each plain weight shape both ways once, keeps it in fast-native.json, and
    the step multiplies by the own product only where it was clearly faster."""
    import json

    monkeypatch.setattr(native, "OWN_PRODUCT", "calibrated")
    monkeypatch.setattr(native, "_PRODUCT_TIMINGS", {})
    monkeypatch.setattr(cpu, "_busy", lambda: False)
    model = _gpt2()
    module = native._module()
    path = tmp_path / native.PRODUCTS_FILE
    monkeypatch.setattr(native, "products_path", lambda: path)
    timings = native.products_plan(module, model)
    assert set(timings) == {"144x48", "48x48", "192x48", "48x192", "53x48"}
    assert all(t.linear_us > 0 and t.own_us > 0 for t in timings.values())
    saved = json.loads(path.read_text())["machines"][native.products_key()]
    assert set(saved) == set(timings)
    # another process reads them: say the own product wins for c_fc's shape only
    fake = {s: {"linear_us": 10.0, "own_us": 5.0 if s == "192x48" else 10.0} for s in saved}
    path.write_text(json.dumps({"version": 1, "machines": {native.products_key(): fake}}))
    monkeypatch.setattr(native, "_PRODUCT_TIMINGS", {})
    model_scaled = _gpt2(scale=3.0)
    idx = torch.tensor([[5, 1, 7]])
    with native.disabled():
        want = generate(model_scaled, idx, 20, temperature=0)
    assert torch.equal(generate(model_scaled, idx, 20, temperature=0), want)
    assert native.last_products() == "own product for 3 of 13 linear layers, fused step"


def _made_up_timings(tmp_path, monkeypatch) -> dict:
    """``_gpt2``'s shapes timed, made up: the own product 4 us against at::linear's 10 everywhere
    (in a ``fast-native.json`` of its own), the packed product 3 us for c_attn's shape (faster than
    the own one) and 6 us for the others (``cpu.known_timing``); OWN_PRODUCT "calibrated". Returns
    the packed timings per shape."""
    import json

    monkeypatch.setattr(native, "OWN_PRODUCT", "calibrated")
    monkeypatch.setattr(native, "_PRODUCT_TIMINGS", {})
    path = tmp_path / native.PRODUCTS_FILE
    monkeypatch.setattr(native, "products_path", lambda: path)
    shapes = ("144x48", "48x48", "192x48", "48x192", "53x48")
    path.write_text(json.dumps({"version": 1, "machines": {
        native.products_key(): {s: {"linear_us": 10.0, "own_us": 4.0} for s in shapes}}}))
    timing = {s: cpu.Timing(10.0, 3.0 if s == "144x48" else 6.0, 1.0) for s in shapes}
    monkeypatch.setattr(cpu, "known_timing", timing.get)
    return timing


def test_a_packed_layer_runs_the_own_product_where_it_beats_the_packed_one_too(tmp_path, monkeypatch):
    """Where the packed products beat at::linear (the AMD EPYC measured: 42 against 124 us for
    1152x384, the own product 23 us), the packed layers keep their plain weight, and the C++ step
    multiplies by it with its own product where that is faster than the packed product too (by
    OWN_FASTER_BY); where the packed product is faster, it runs that one."""
    _made_up_timings(tmp_path, monkeypatch)
    model = _gpt2(scale=3.0)
    ids = torch.randint(0, 53, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), pack_for_decoding(model, 100, select=lambda name, m: name != "lm_head"):
        assert sum(type(m) is cpu.PackedLinear for m in model.modules()) == 12
        # 9 packed layers and lm_head (plain) by the own product, the 3 c_attn by the packed one
        logits, want, _, _ = _compared(model, ids, 32, "own product for 10 of 13 linear layers, fused step")
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # a shape never calibrated for packing: the own product wherever it beats at::linear
    monkeypatch.setattr(cpu, "known_timing", lambda s: None)
    with torch.inference_mode(), pack_for_decoding(model, 100, select=lambda name, m: True):
        native.native_decode(model, StaticKVCache.for_model(model, 1, 32), model.decode)
        assert native.last_products() == "own product for 13 of 13 linear layers, fused step"


def test_a_decode_through_the_cpp_step_packs_no_layer_it_multiplies_by_its_own_product(tmp_path, monkeypatch):
    """generate, stream and speculative decoding's draft leave plain the layers the C++ step will
    multiply by its own product (faster than at::linear and than the packed product: packing them
    copied their weights for nothing, 17-20 ms a call for GPT-2 Mini on the AMD EPYC measured), and
    still pack the others; a batch of two, or the Python step (disabled), packs every layer the
    calibration favours. The greedy tokens are fast=False's."""
    timing = _made_up_timings(tmp_path, monkeypatch)
    # packing pays everywhere (these weights are too small to be timed: the calibration is made up)
    monkeypatch.setattr(cpu, "SMALLEST_MEASURED", 0)
    monkeypatch.setattr(cpu, "calibrate", lambda model, **kw: timing)
    model = _gpt2(scale=3.0, tie_weights=False)
    idx = torch.randint(0, 53, (1, 6), generator=torch.Generator().manual_seed(4))
    want = generate(model, idx, 20, temperature=0, fast=False)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    attn = [name for name in linears if name.endswith("c_attn")]
    for run in (lambda: generate(model, idx, 20, temperature=0),
                lambda: torch.cat([idx, *stream(model, idx, 20, temperature=0)], 1)):
        assert torch.equal(run(), want)
        plan = cpu.last_plan()
        assert plan.packed == attn
        assert plan.plain == {name: native.KEPT_PLAIN for name in linears if name not in attn}
        assert native.last_products() == "own product for 10 of 13 linear layers, fused step"
    # as speculative decoding's draft (its plan is made after the target's, which packs every layer)
    target = _gpt2(seed=1, scale=3.0, tie_weights=False)
    out, _ = speculative_generate(target, model, idx, 12, temperature=0)
    assert cpu.last_plan().packed == attn
    assert torch.equal(out, generate(target, idx, 12, temperature=0, fast=False))
    generate(model, idx.repeat(2, 1), 20, temperature=0)  # a batch: the Python step's products
    assert cpu.last_plan().packed == linears
    with native.disabled():
        assert torch.equal(generate(model, idx, 20, temperature=0), want)
    assert cpu.last_plan().packed == linears
    model.train()  # generate decodes in eval mode, so the C++ step runs and the same layers stay plain
    assert torch.equal(generate(model, idx, 20, temperature=0), want)
    assert cpu.last_plan().packed == attn and model.training


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("own", ["always", "never"])
def test_chunks_run_the_own_product_where_it_is_built(arch, own, monkeypatch):
    """Where the C++ step is built, the twin's chunks (speculative decoding's verification, short
    prefills) multiply by its own product (``OWN_PRODUCT``): the model's logits and cache up to float
    rounding, and the same greedy tokens; with "never", the model's own products, to the last bit."""
    monkeypatch.setattr(native, "OWN_PRODUCT", own)
    cfg = dict(vocab_size=53, block_size=64, n_layer=3, n_head=4, n_embd=32, scale=3.0)
    model = tiny_gpt(0, **cfg) if arch == "gpt2" else tiny_gpt(0, **{**cfg, **LLAMA})
    ids = torch.randint(0, 53, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode(), pack_for_decoding(model, 100, select=lambda name, m: name.endswith("c_fc")):
        ref, got = StaticKVCache.for_model(model, 1, 48), StaticKVCache.for_model(model, 1, 48)
        step = native.native_decode(model, got, model.decode)
        n = len(native._linears(model))
        assert native.last_chunk_products() == f"own product for {n if own == 'always' else 0} of {n} linear layers"
        for a, b in ((0, 6), (6, 15), (15, 16), (16, 40)):
            last_only = b - a == 1
            want, logits = (f(ids[:, a:b], c, last_only=last_only) for f, c in ((model.decode, ref), (step, got)))
            if own == "never":
                assert torch.equal(logits, want), (a, b)
            else:
                torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4, msg=f"{(a, b)}")
        torch.testing.assert_close(got.k, ref.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.v, ref.v, rtol=1e-5, atol=1e-5)
    idx = torch.tensor([[2, 4, 6, 8]])
    want = generate(model, idx, 40, temperature=0, fast=False)
    draft = tiny_gpt(1, **{**cfg, "n_layer": 1})
    spec, _ = speculative_generate(model, draft, idx, 40, temperature=0, num_draft_tokens=4)
    assert torch.equal(spec, want)


def test_the_chunks_calibration_picks_the_own_product_per_shape(tmp_path, monkeypatch):
    """With OWN_PRODUCT "calibrated", each layer shape's chunk product is timed both ways once
    (CHUNK_TIMING_ROWS vectors), kept in fast-native.json, and the chunks take the own product only
    where it was clearly faster."""
    import json

    monkeypatch.setattr(native, "OWN_PRODUCT", "calibrated")
    monkeypatch.setattr(native, "_PRODUCT_TIMINGS", {})
    monkeypatch.setattr(cpu, "_busy", lambda: False)
    path = tmp_path / native.PRODUCTS_FILE
    monkeypatch.setattr(native, "products_path", lambda: path)
    model = tiny_gpt(0, **{**dict(vocab_size=53, block_size=64, n_layer=2, n_embd=32), **LLAMA})
    layers = native._linears(model)
    timings = native.time_chunk_products(native._module(), layers, rounds=2)
    assert set(timings) == {f"{m.out_features}x{m.in_features} x{native.CHUNK_TIMING_ROWS} rows" for m in layers}
    assert len(timings) == 5  # c_attn, c_proj, c_fc, the MLP's c_proj, lm_head
    assert all(t.linear_us > 0 and t.own_us > 0 for t in timings.values())
    with torch.inference_mode():
        native.native_decode(model, StaticKVCache.for_model(model, 1, 16), model.decode)
    saved = json.loads(path.read_text())["machines"][native.products_key()]
    assert {k for k in saved if k.endswith("rows")} == set(timings)
    # another process reads them: say the own product wins for c_fc's shape only (2 of 9 layers)
    fc = model.transformer.h[0].mlp.c_fc
    fake = {s: {"linear_us": 10.0, "own_us": 5.0 if s.startswith(f"{fc.out_features}x{fc.in_features} ") else 10.0}
            for s in saved}
    path.write_text(json.dumps({"version": 1, "machines": {native.products_key(): fake}}))
    monkeypatch.setattr(native, "_PRODUCT_TIMINGS", {})
    with torch.inference_mode():
        native.native_decode(model, StaticKVCache.for_model(model, 1, 16), model.decode)
    assert native.last_chunk_products() == "own product for 2 of 9 linear layers"
