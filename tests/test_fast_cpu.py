"""The CPU decode path of gptlab.fast.cpu: the packed product equals F.linear; PackedLinear shares
its layer's weights and hooks; pack_for_decoding swaps the layers in for a decode and always puts
the originals back; fast and plain decoding agree; the calibration is cached per machine."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab import beam_search, generate, speculative_generate, stream
from gptlab.fast import cpu
from gptlab.fast.cpu import PackedLinear, Timing, blocks_product, pack_for_decoding, row_blocks, row_split_linear
from tiny_models import COVERING, VARIANT_VOCAB, VARIANTS, assert_decode_matches, decode_case, variant_model

V = VARIANT_VOCAB
ALL = lambda name, layer: True  # noqa: E731  (select every layer that can be packed)

_model = variant_model


def _linears(model) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, PackedLinear))}


def _all_plain(model, before: dict[str, nn.Module]) -> None:
    """The model holds exactly its original nn.Linear modules again (the same objects)."""
    after = _linears(model)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


# --------------------------------------------------------------------------- the packed product


@pytest.mark.parametrize("bag", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(96, 32), (65, 32), (8, 32)])
def test_row_split_linear_equals_f_linear(shape, bias, bag, monkeypatch):
    """The packed product equals F.linear for one vector (the embedding-bag sum, or the batched
    product where FBGEMM is missing) and several (the batched product), whatever the number of
    parts: a row count the parts do not divide (65), or fewer rows than parts (8 rows in 7 parts),
    is padded with zero rows and cut back."""
    monkeypatch.setattr(cpu, "EMBEDDING_BAG_PRODUCT", bag)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    b = torch.randn(shape[0], generator=g) if bias else None
    for parts in (1, 2, 3, 4, 7):
        blocks = row_blocks(w, b, parts)
        part = -(-shape[0] // parts)
        assert blocks.weight.shape == (parts, shape[1], part) and blocks.weight.is_contiguous()
        assert blocks.out_features == shape[0]
        torch.testing.assert_close(blocks.weight.transpose(1, 2).reshape(-1, shape[1])[: shape[0]], w, rtol=0, atol=0)
        for lead in ((1, 1), (2, 1), (1, 5), (3, 4), (7,), (2, 2, 3), (1,), (1, 1, 1)):
            x = torch.randn(*lead, shape[1], generator=g)
            torch.testing.assert_close(row_split_linear(x, w, b, parts), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        x = torch.randn(1, shape[1], 5, generator=g).transpose(1, 2)  # (1, 5, in), not contiguous
        torch.testing.assert_close(row_split_linear(x, w, b, parts), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        x = torch.randn(1, shape[1], 1, generator=g).transpose(1, 2)  # one vector, not contiguous
        torch.testing.assert_close(row_split_linear(x, w, b, parts), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="parts"):
        row_blocks(w, b, 0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(96, 32), (1024, 192), (12, 7)])
def test_split_product_reads_the_weight_in_place_and_equals_f_linear(shape, bias):
    """The batched product over the weight's own row blocks (a view, no copy) equals F.linear for
    any batch of vectors, contiguous or not, whatever the parts that divide the rows; parts that do
    not divide them are refused."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    b = torch.randn(shape[0], generator=g) if bias else None
    for parts in (d for d in (1, 2, 3, 4, 6, 8) if shape[0] % d == 0):
        for lead in ((1, 19), (4,), (2, 3, 5), (1, 1)):
            x = torch.randn(*lead, shape[1], generator=g)
            torch.testing.assert_close(cpu.split_product(x, w, b, parts), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        x = torch.randn(1, shape[1], 9, generator=g).transpose(1, 2)  # (1, 9, in), not contiguous
        torch.testing.assert_close(cpu.split_product(x, w, b, parts), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    bad = next(d for d in (5, 7, 9, 11) if shape[0] % d)
    with pytest.raises(ValueError, match=f"parts dividing the weight's {shape[0]} rows"):
        cpu.split_product(torch.randn(2, shape[1]), w, b, bad)


def test_which_layers_chunks_read_in_place(monkeypatch):
    """Float32 layers on the CPU, plain or packed, of at least SMALLEST_MEASURED numbers, whose rows
    the thread blocks divide; none with SPLIT_CHUNKS off."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # 4 blocks
    big, small, odd = nn.Linear(192, 1024), nn.Linear(32, 96), nn.Linear(192, 130)
    assert cpu.splits_chunks(big) and cpu.splits_chunks(PackedLinear(big, 4))
    assert not cpu.splits_chunks(small)  # 3072 numbers: its product is mostly the call
    assert not cpu.splits_chunks(odd)  # 130 rows in 4 blocks
    assert not cpu.splits_chunks(nn.Linear(192, 1024).double())
    monkeypatch.setattr(cpu, "SPLIT_CHUNKS", False)
    assert not cpu.splits_chunks(big)


def test_blocks_product_uses_the_embedding_bag_for_a_few_vectors(monkeypatch):
    """Up to BAG_MAX_ROWS vectors' product is the embedding-bag sum (the fast kernel for them), more
    vectors' the batched product; both equal F.linear (checked above)."""
    assert cpu.EMBEDDING_BAG_PRODUCT == ("fbgemm" in torch.backends.quantized.supported_engines)
    monkeypatch.setattr(cpu, "EMBEDDING_BAG_PRODUCT", True)
    used = []
    for name in ("embedding_bag", "baddbmm", "bmm"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _r=real, _n=name, **k: used.append(_n) or _r(*a, **k))
    w, b = torch.randn(96, 32), torch.randn(96)
    blocks = row_blocks(w, b, 4)
    blocks_product(torch.randn(1, 1, 32), blocks)
    assert used == ["embedding_bag"]
    blocks_product(torch.randn(1, cpu.BAG_MAX_ROWS, 32), blocks)
    assert used == ["embedding_bag"] * 2
    blocks_product(torch.randn(1, cpu.BAG_MAX_ROWS + 1, 32), blocks)
    assert used == ["embedding_bag"] * 2 + ["baddbmm"]
    blocks_product(torch.randn(cpu.BAG_MAX_ROWS + 1, 32), row_blocks(w, None, 4))
    assert used[-1] == "bmm"
    with pytest.raises(ValueError, match="at most BAG_MAX_ROWS"):
        cpu.bag_product(torch.randn(cpu.BAG_MAX_ROWS + 1, 32), blocks)
    monkeypatch.setattr(cpu, "EMBEDDING_BAG_PRODUCT", False)  # no FBGEMM (an Arm CPU)
    blocks_product(torch.randn(1, 1, 32), blocks)
    assert used[-1] == "baddbmm"


def test_packed_linear_shares_the_layer_and_packs_only_small_products_without_autograd(monkeypatch):
    """PackedLinear holds its layer's own Parameters (same state dict names and tensors) and hooks;
    a few vectors without autograd run the packed product, training and long inputs F.linear."""
    calls = []
    real = cpu.blocks_product
    monkeypatch.setattr(cpu, "blocks_product", lambda *a: calls.append(1) or real(*a))
    lin = nn.Linear(32, 96)
    seen = []
    lin.register_forward_hook(lambda m, a, o: seen.append(a[0].shape))
    p = PackedLinear(lin, 3)
    assert p.weight is lin.weight and p.bias is lin.bias
    assert p.state_dict().keys() == lin.state_dict().keys()
    assert all(p.state_dict()[k].data_ptr() == lin.state_dict()[k].data_ptr() for k in lin.state_dict())
    assert list(p.parameters()) == list(lin.parameters())
    assert p.blocks.weight.shape == (3, 32, 32) and "parts=3" in repr(p)
    x = torch.randn(2, 3, 32)
    y = p(x)  # autograd on: training
    assert not calls and y.requires_grad
    torch.testing.assert_close(y, lin(x))
    with torch.no_grad():
        p(torch.randn(1, cpu.ROW_SPLIT_MAX_ROWS + 1, 32))  # a long prefill
        assert not calls
        y = p(x)
        assert len(calls) == 1
        torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        p(x[:, :1])
    assert len(calls) == 2
    assert len(seen) == 5  # the layer's hooks ran on its stand-in, every call
    q = PackedLinear(nn.Linear(32, 8, bias=False), 2)
    assert q.bias is None
    with torch.no_grad():
        torch.testing.assert_close(q(x), F.linear(x, q.weight), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the swap


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_api_on_packed_layers_equals_model_forward(variant, parts, monkeypatch):
    """With every linear layer packed (``parts`` row blocks), the decode API computes the full
    forward's logits, one token and a few at a time, for every variant; the packed products really
    run, and after the block the model is its own again."""
    calls = []
    real = cpu.blocks_product
    monkeypatch.setattr(cpu, "blocks_product", lambda *a: calls.append(a[1].weight.shape[0]) or real(*a))
    m = _model(**VARIANTS[variant])
    before = _linears(m)
    ids, full, cache = decode_case(m)  # the full forward on the model's own layers
    with torch.no_grad(), pack_for_decoding(m, parts=parts, select=ALL) as plan:
        assert plan.path == "packed" and len(plan.packed) == len(before)
        assert all(isinstance(m.get_submodule(name), PackedLinear) for name in before)
        assert_decode_matches(m, ids, full, cache)
        assert len(calls) > 0 and set(calls) == {parts}
    _all_plain(m, before)
    if not m.config.tie_weights:
        assert m.lm_head.weight is not m.transformer.wte.weight
    else:
        assert m.lm_head.weight is m.transformer.wte.weight  # the tying survives the swap


def _force_packing(monkeypatch):
    """generate's fast path packs every layer of the tiny models (they are below the size that is
    timed, so it would leave them plain)."""
    real = cpu.decode_plan
    monkeypatch.setattr(cpu, "decode_plan", lambda model, steps=None, **kw: real(model, steps, select=ALL))


# Every variant's decode on packed layers is checked above; this end-to-end check of the generation
# entry points (several decodes per variant) runs over the variants that cover every option.
@pytest.mark.parametrize("variant", COVERING)
def test_fast_and_plain_decoding_agree(variant, monkeypatch):
    """generate, stream, beam search and speculative decoding give the same greedy tokens with the
    packed layers (fast=True) as with the model's own (fast=False); sampled tokens too, here."""
    _force_packing(monkeypatch)
    m = _model(scale=3.0, **VARIANTS[variant])
    before = _linears(m)
    idx = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(1))
    plain = generate(m, idx, 20, temperature=0, fast=False)
    assert torch.equal(generate(m, idx, 20, temperature=0, fast=True), plain)
    assert cpu.last_plan().path == "packed"
    _all_plain(m, before)
    assert torch.equal(torch.cat(list(stream(m, idx, 20, temperature=0)), 1), plain[:, 4:])
    _all_plain(m, before)
    assert torch.equal(beam_search(m, idx, 8, 3, fast=True), beam_search(m, idx, 8, 3, fast=False))
    _all_plain(m, before)
    sampled = [generate(m, idx, 12, temperature=1.0, generator=torch.Generator().manual_seed(5), fast=f)
               for f in (True, False)]
    assert torch.equal(*sampled)
    draft = _model(seed=1, **VARIANTS[variant])
    spec = [speculative_generate(m, draft, idx[:1], 12, temperature=0, fast=f)[0] for f in (True, False)]
    assert torch.equal(spec[0], spec[1]) and torch.equal(spec[0], generate(m, idx[:1], 12, temperature=0))
    _all_plain(m, before)


def test_outside_the_block_the_model_is_plain():
    """No global state: after a decode, model(x) under no_grad is nn.Linear's computation exactly,
    the packed copies are freed, and the state dict is unchanged (also during the decode)."""
    m = _model(n_embd=64)
    x = torch.randint(0, V, (1, 3))
    with torch.no_grad():
        ref = m(x)[0]
    keys = list(m.state_dict())
    ptrs = {k: t.data_ptr() for k, t in m.state_dict().items()}
    with torch.no_grad(), pack_for_decoding(m, select=ALL):
        stand_in = weakref.ref(m.lm_head)
        blocks = weakref.ref(m.lm_head.blocks.weight)
        assert isinstance(stand_in(), PackedLinear)
        assert list(m.state_dict()) == keys  # the same names and tensors while packed
        assert {k: t.data_ptr() for k, t in m.state_dict().items()} == ptrs
        during = m(x)[0]
    torch.testing.assert_close(during, ref, atol=1e-5, rtol=1e-5)
    gc.collect()
    assert stand_in() is None  # the stand-ins went with the block; the copies' memory is kept, for
    assert blocks() is not None  # the next packing, until forget_packed_memory frees it
    assert cpu.forget_packed_memory() > 0
    gc.collect()
    assert blocks() is None
    with torch.no_grad():
        assert torch.equal(m(x)[0], ref)  # bit for bit: F.linear, not the packed product
    assert list(m.state_dict()) == keys
    assert type(m.lm_head) is nn.Linear and type(m.transformer.h[0].attn.c_attn) is nn.Linear


def test_the_next_packing_writes_into_the_kept_memory_afresh(monkeypatch):
    """A decode's packed copies are dropped with it but their memory is kept: the layer's next
    packing writes into it (no page faults), with the weights as they are then (here changed
    behind autograd's back, through .data). A packing still in use keeps its own; beyond
    KEEP_PACKED_BYTES nothing is kept; the memory goes with the model."""
    cpu.forget_packed_memory()
    m = _model(n_embd=64)
    layer = m.transformer.h[0].attn.c_attn
    x = torch.randn(1, 64)
    with torch.no_grad(), pack_for_decoding(m, select=ALL):
        first = m.transformer.h[0].attn.c_attn.blocks.weight.data_ptr()
    gc.collect()
    with torch.no_grad():
        layer.weight.data.mul_(-2.0)  # no version bump: only packing afresh sees it
    with torch.no_grad(), pack_for_decoding(m, select=ALL):
        packed = m.transformer.h[0].attn.c_attn
        assert packed.blocks.weight.data_ptr() == first
        assert torch.equal(packed.blocks.weight, row_blocks(layer.weight, layer.bias, packed.parts).weight)
        torch.testing.assert_close(packed(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        view = packed.blocks.weight[0]  # a view still holds the memory when the block ends
    gc.collect()
    with torch.no_grad(), pack_for_decoding(m, select=ALL):
        assert m.transformer.h[0].attn.c_attn.blocks.weight.data_ptr() != view.data_ptr()  # not reused
    del view, packed
    gc.collect()
    # memory kept from a decode under inference mode (generate's) cannot be written outside it: new memory
    cpu.forget_packed_memory()
    with torch.inference_mode(), pack_for_decoding(m, select=ALL):
        pass
    gc.collect()
    assert cpu._SPARE[layer].is_inference()
    with torch.no_grad(), pack_for_decoding(m, select=ALL):
        assert not m.transformer.h[0].attn.c_attn.blocks.weight.is_inference()
    # two packings alive at once (made, not installed) never share memory
    one, two = cpu.packed_layers(m, select=ALL), cpu.packed_layers(m, select=ALL)
    ptrs = [{id(orig): new.blocks.weight.data_ptr() for _, _, orig, new in p._swaps} for p in (one, two)]
    assert ptrs[0].keys() == ptrs[1].keys() and not set(ptrs[0].values()) & set(ptrs[1].values())
    del one, two
    gc.collect()
    kept = weakref.ref(cpu._SPARE[layer])
    del m, layer
    gc.collect()
    assert kept() is None  # the model is gone, and the memory kept for its layers with it
    monkeypatch.setattr(cpu, "KEEP_PACKED_BYTES", 0)
    m = _model(n_embd=64)
    with torch.no_grad(), pack_for_decoding(m, select=ALL):
        pass
    gc.collect()
    assert not any(mod in cpu._SPARE for mod in m.modules())


def test_layers_restored_after_an_exception(monkeypatch):
    """A decode that fails half-way (here a hook raising at the fourth step) leaves the model's own
    layers in place, in generate, stream (also a stream dropped half-way) and speculative decoding."""
    _force_packing(monkeypatch)
    m = _model()
    before = _linears(m)
    idx = torch.zeros(1, 2, dtype=torch.long)
    n = []

    def boom(mod, args, out):
        n.append(1)
        if len(n) == 4:
            raise RuntimeError("boom")

    h = m.transformer.h[0].register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            generate(m, idx, 10, temperature=0)
        _all_plain(m, before)
        n.clear()
        with pytest.raises(RuntimeError, match="boom"):
            list(stream(m, idx, 10, temperature=0))
        _all_plain(m, before)
    finally:
        h.remove()
    draft = _model(seed=2)
    draft_before = _linears(draft)
    n.clear()
    h = draft.transformer.h[0].register_forward_hook(boom)  # the draft runs once per guess: it fails
    try:
        with pytest.raises(RuntimeError, match="boom"):
            speculative_generate(m, draft, idx, 10, temperature=0)
        _all_plain(m, before)
        _all_plain(draft, draft_before)
    finally:
        h.remove()
    s = stream(m, idx, 10, temperature=0)
    next(s)
    _all_plain(m, before)  # between two steps the model is its own
    del s
    gc.collect()
    _all_plain(m, before)
    with pytest.raises(KeyError):
        with pack_for_decoding(m, select=ALL):
            assert isinstance(m.lm_head, PackedLinear)
            raise KeyError("inside the block")
    _all_plain(m, before)


def test_hooks_on_the_linear_layers_run_while_packed(monkeypatch):
    """A forward hook on a linear layer (what the kv_cache grader and the chapters' shape traces
    put there) sees the same calls with fast=True as with fast=False."""
    _force_packing(monkeypatch)
    m = _model()
    idx = torch.zeros(1, 3, dtype=torch.long)
    seen = []
    h = m.transformer.h[1].attn.c_attn.register_forward_hook(lambda mod, a, o: seen.append(a[0].shape[1]))
    try:
        generate(m, idx, 6, temperature=0, fast=True)
        fast = list(seen)
        seen.clear()
        generate(m, idx, 6, temperature=0, fast=False)
    finally:
        h.remove()
    assert fast == seen == [3, 1, 1, 1, 1, 1]


def test_a_layer_shared_by_two_parents_gets_one_stand_in():
    lin = nn.Linear(16, 16)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    x = torch.randn(1, 16)
    with torch.no_grad(), pack_for_decoding(model, select=ALL) as plan:
        assert plan.packed == ["0"] and model[0] is model[2] and isinstance(model[0], PackedLinear)
        torch.testing.assert_close(model(x), lin(torch.relu(lin(x))), atol=1e-5, rtol=1e-5)
    assert model[0] is lin and model[2] is lin


# --------------------------------------------------------------------------- the plan and the calibration


def _timings(plain, packed, pack):
    return lambda model, **kw: {s: Timing(plain, packed, pack) for s in
                                {f"{m.out_features}x{m.in_features}" for m in model.modules() if isinstance(m, nn.Linear)}}


def test_the_plan_follows_the_calibration(monkeypatch):
    """A layer is packed when its packed product is clearly faster and the decode pays the packing
    back; small weights, other dtypes and nn.Linear subclasses stay plain, each with its reason."""
    m = _model(n_embd=128)  # c_attn 384 x 128 and the MLP's 512 x 128 are timed; the head (37 x 128) is not
    monkeypatch.setattr(cpu, "calibrate", _timings(100.0, 25.0, 750.0))  # gains 75 us, pays back in 10 steps
    plan = cpu.decode_plan(m, 255)
    assert plan.path == "mixed" and "transformer.h.0.attn.c_attn" in plan.packed
    assert "under" in plan.plain["lm_head"]
    assert "packed row blocks" in plan.describe() and "384x128" in plan.describe()
    assert cpu.decode_plan(m, 5).packed == []  # 5 steps do not pay the packing back
    assert "pays back after 10 steps" in cpu.decode_plan(m, 5).plain["transformer.h.0.attn.c_attn"]
    assert cpu.decode_plan(m, None).packed == plan.packed  # any length
    monkeypatch.setattr(cpu, "calibrate", _timings(100.0, 95.0, 1.0))  # within the noise: not faster
    slow = cpu.decode_plan(m, 255)
    assert slow.path == "plain" and "plain F.linear" in slow.describe()
    monkeypatch.setattr(cpu, "calibrate", lambda model, **kw: pytest.fail("nothing to time in a float64 model"))
    d = cpu.decode_plan(m.double(), 255)
    assert d.packed == [] and all("not float32" in why for why in d.plain.values())

    class Mine(nn.Linear):
        pass

    odd = nn.Sequential(Mine(4, 4))
    assert "subclass" in cpu.decode_plan(odd, select=ALL).plain["0"]
    with pytest.raises(ValueError, match="parts"):
        cpu.decode_plan(m, parts=0)


def test_packing_off_packs_nothing_and_times_nothing(monkeypatch):
    """Within packing_off() the plan keeps every layer plain (saying why) without calibrating;
    after it, the calibration decides again."""
    m = _model(n_embd=128)
    monkeypatch.setattr(cpu, "calibrate", _timings(100.0, 25.0, 750.0))
    with cpu.packing_off():
        monkeypatch.setattr(cpu, "calibrate", lambda model, **kw: pytest.fail("packing_off calibrated"))
        with cpu.packing_off():  # nested
            plan = cpu.decode_plan(m, 255)
        assert plan.packed == [] and cpu.decode_plan(m, 255, select=ALL).packed == []
        assert all(why == cpu.PACKING_OFF or "under" in why for why in plan.plain.values())
        with pack_for_decoding(m, 255):
            assert not any(isinstance(x, PackedLinear) for x in m.modules())
    monkeypatch.setattr(cpu, "calibrate", _timings(100.0, 25.0, 750.0))
    assert "transformer.h.0.attn.c_attn" in cpu.decode_plan(m, 255).packed


def test_calibration_cache_round_trip(tmp_cache, monkeypatch):
    """The first calibration measures the model's shapes and saves them under this machine's key;
    a new process reads them back instead of measuring; a damaged file is measured again; a cache
    that cannot be written is no error."""
    monkeypatch.setattr(cpu, "_TIMINGS", {})
    monkeypatch.setattr(cpu, "SMALLEST_MEASURED", 0)  # time the tiny model's weights
    monkeypatch.setattr(cpu, "_busy", lambda: False)  # (the test machine may be busy)
    measure = cpu._measure
    m = _model()
    measured = cpu.calibrate(m, rounds=1)
    shapes = {f"{x.out_features}x{x.in_features}" for x in m.modules() if isinstance(x, nn.Linear)}
    assert set(measured) == shapes
    assert all(t.plain_us > 0 and t.packed_us > 0 and t.pack_us > 0 for t in measured.values())
    path = cpu.calibration_path()
    assert path == tmp_cache / "fast-cpu.json"
    saved = json.loads(path.read_text())
    assert set(saved["machines"][cpu.machine_key()]) == shapes
    assert f"{torch.get_num_threads()} threads" in cpu.machine_key()

    monkeypatch.setattr(cpu, "_TIMINGS", {})  # a new process: reads the file, measures nothing
    monkeypatch.setattr(cpu, "_measure", lambda *a: pytest.fail("measured again"))
    assert cpu.calibrate(m) == measured
    assert cpu.calibrate(m) == measured  # and then from memory

    monkeypatch.setattr(cpu, "_measure", measure)
    monkeypatch.setattr(cpu, "_TIMINGS", {})
    path.write_text("{not json")
    again = cpu.calibrate(m, rounds=1)
    assert set(again) == shapes and set(json.loads(path.read_text())["machines"][cpu.machine_key()]) == shapes
    first = dict(again)
    assert cpu.calibrate(m, refresh=True, rounds=1).keys() == first.keys()  # measured anew on request

    monkeypatch.setattr(cpu, "_busy", lambda: True)  # measured on a busy machine: used, not saved
    monkeypatch.setattr(cpu, "_TIMINGS", {})
    path.unlink()
    assert set(cpu.calibrate(m, rounds=1)) == shapes and not path.exists()

    blocked = tmp_cache / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("GPTLAB_CACHE", str(blocked))
    monkeypatch.setattr(cpu, "_TIMINGS", {})
    assert set(cpu.calibrate(m, rounds=1)) == shapes  # not saved, still used
