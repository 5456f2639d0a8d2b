"""The model's standalone pieces (gptlab.layers, .masks, .rope, .attention) against PyTorch's own ops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gptlab.attention import CausalSelfAttention, attention, attention_weights, merge_heads, split_heads
from gptlab.layers import LayerNorm, RMSNorm, gelu, layer_norm, new_gelu, rms_norm
from gptlab.masks import additive_mask, causal_mask, combine_masks, slot_mask
from gptlab.rope import apply_rope, rope_cache

G = torch.Generator().manual_seed(0)


def _randn(*shape):
    return torch.randn(*shape, generator=G)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_equals_torch(bias):
    x, w = _randn(3, 5, 16) * 3 + 1, _randn(16)
    b = _randn(16) if bias else None
    torch.testing.assert_close(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (16,), w, b, 1e-5))
    torch.testing.assert_close(LayerNorm(16, bias=bias)(x), F.layer_norm(x, (16,)))


def test_rms_norm_equals_torch():
    x, w = _randn(3, 5, 16) * 3, _randn(16)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (16,), w, 1e-6))
    m = RMSNorm(16, eps=1e-6)
    torch.testing.assert_close(m(x), rms_norm(x, m.weight, 1e-6))
    # the low-precision branch of the module: computed in float32, equal up to bfloat16 rounding
    torch.testing.assert_close(m(x.bfloat16()).float(), rms_norm(x, m.weight, 1e-6), atol=0.05, rtol=0.02)


def test_gelu_equals_torch_tanh_gelu():
    x = torch.linspace(-8, 8, 1001)
    torch.testing.assert_close(gelu(x), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(new_gelu(x), F.gelu(x, approximate="tanh"))
    assert (gelu(x) - F.gelu(x)).abs().max() > 1e-4  # the approximation, not the exact erf GELU


def test_masks():
    m = causal_mask(4)
    assert m.dtype == torch.bool and torch.equal(m, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    add = additive_mask(4)
    assert torch.equal(add == 0, m) and torch.isinf(add[~m]).all() and (add[~m] < 0).all()
    assert additive_mask(3, dtype=torch.float16).dtype == torch.float16
    pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    both = combine_masks(m, pad)
    assert both.shape == (2, 1, 4, 4)
    for b in range(2):
        for i in range(4):
            for j in range(4):
                assert bool(both[b, 0, i, j]) == (j <= i and bool(pad[b, j]))
    assert torch.equal(slot_mask(0, 4, 0, 4), m)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="T must be a positive int"):
            causal_mask(bad)
    with pytest.raises(ValueError, match="key_padding"):
        combine_masks(m, pad[:, :3])


@pytest.mark.parametrize("masked", [False, True])
def test_attention_equals_sdpa(masked):
    q, k, v = _randn(2, 3, 5, 8), _randn(2, 3, 7, 8), _randn(2, 3, 7, 8)
    mask = slot_mask(2, 5, 0, 7) if masked else None  # queries at slots 2..6 over keys 0..6
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out, w = attention(q, k, v, mask, return_weights=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w, attention_weights(q, k, mask))
    expect = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8) + (0 if mask is None else
                           torch.zeros(5, 7).masked_fill(~mask, float("-inf"))), dim=-1)
    torch.testing.assert_close(w, expect)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 5))
    # a query with no key allowed gets zero weights, not NaN
    none = torch.zeros(5, 7, dtype=torch.bool)
    assert torch.equal(attention_weights(q, k, none), torch.zeros(2, 3, 5, 7))


def test_split_and_merge_heads():
    x = _randn(2, 5, 12)
    h = split_heads(x, 3)
    assert h.shape == (2, 3, 5, 4)
    assert torch.equal(h[:, 1], x[:, :, 4:8])
    assert torch.equal(merge_heads(h), x)
    with pytest.raises(ValueError, match="divisible"):
        split_heads(x, 5)


def test_rope_matches_hf_rotary():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = rope_cache(10, 8, theta=500.0)
    assert cos.shape == sin.shape == (10, 8)
    q, k = _randn(1, 2, 10, 8), _randn(1, 2, 10, 8)
    hq, hk = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    torch.testing.assert_close(apply_rope(q, cos, sin), hq)
    torch.testing.assert_close(apply_rope(k, cos, sin), hk)
    # q . k depends on the positions only through their difference
    a, b = _randn(8), _randn(8)
    def dot(i, j):
        return float(apply_rope(a.view(1, 1, 1, 8), cos[i], sin[i]).flatten() @ apply_rope(b.view(1, 1, 1, 8), cos[j], sin[j]).flatten())
    assert dot(5, 3) == pytest.approx(dot(4, 2), abs=1e-5)
    with pytest.raises(ValueError, match="even"):
        rope_cache(4, 7)


def test_attention_module_equals_its_formula():
    """CausalSelfAttention is c_attn (q, k, v in that order) -> heads -> causal attention -> c_proj."""
    from gptlab import GPTConfig

    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)
    attn = CausalSelfAttention(cfg).eval()
    x = _randn(2, 6, 16)
    q, k, v = attn.c_attn(x).split(16, dim=-1)
    y = attention(split_heads(q, 2), split_heads(k, 2), split_heads(v, 2), causal_mask(6))
    torch.testing.assert_close(attn(x), attn.c_proj(merge_heads(y)))


# ---- the training paths: the same numbers as the written-out formulas, forward and backward


def test_rms_norm_training_path_equals_torch():
    """RMSNorm with gradients runs its own backward (layers._RMSNormFunction): the output and the
    gradients of x and the gain equal those of F.rms_norm's, up to float rounding; without
    gradients it is F.rms_norm itself, to the last bit."""
    m = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(_randn(16))
    x = (_randn(3, 5, 16) * 3).requires_grad_()
    g = _randn(3, 5, 16)
    y = m(x)
    assert type(y.grad_fn).__name__ == "_RMSNormFunctionBackward"  # the training path ran
    dx, dw = torch.autograd.grad(y, (x, m.weight), g)
    y_ref = F.rms_norm(x, (16,), m.weight, 1e-6)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, m.weight), g)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(dw, dw_ref)
    # only the input needs a gradient (a frozen gain), or only the gain
    m.weight.requires_grad_(False)
    (dx_only,) = torch.autograd.grad(m(x), (x,), g)
    torch.testing.assert_close(dx_only, dx_ref)
    m.weight.requires_grad_(True)
    (dw_only,) = torch.autograd.grad(m(x.detach()), (m.weight,), g)
    torch.testing.assert_close(dw_only, dw_ref)
    with torch.no_grad():
        assert torch.equal(m(x), F.rms_norm(x, (16,), m.weight, 1e-6))


def test_apply_rope_into_writes_apply_rope_s_rotation():
    """apply_rope_into: apply_rope's rotation, up to float rounding, into any tensor of x's shape
    (here a strided view, the heads of a fused projection), for any tables."""
    from gptlab.rope import apply_rope_into

    for cos, sin in (rope_cache(10, 8), (_randn(10, 8), _randn(10, 8))):
        qkv = _randn(2, 10, 5 * 8)
        x = qkv.view(2, 10, 5, 8).transpose(1, 2)  # (2, 5, 10, 8), not contiguous
        out = torch.full((2, 10, 5, 8), float("nan")).transpose(1, 2)
        assert apply_rope_into(out, x, cos, sin) is out
        torch.testing.assert_close(out, apply_rope(x, cos, sin))
        torch.testing.assert_close(apply_rope_into(torch.empty(2, 5, 10, 8), x, cos, sin), apply_rope(x, cos, sin))


def test_rope_training_paths_equal_apply_rope():
    """apply_rope_train and rope_qkv_train (the attention's training path) give apply_rope's
    rotation and its gradient, up to float rounding; where no gradient is needed they step aside."""
    from gptlab.rope import apply_rope_train, rope_qkv_train

    cos, sin = rope_cache(10, 8)
    x = _randn(2, 3, 10, 8).requires_grad_()
    g = _randn(2, 3, 10, 8)
    y = apply_rope_train(x, cos, sin)
    assert type(y.grad_fn).__name__ == "_RopeRotationBackward"
    y_ref = apply_rope(x, cos, sin)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_ref, x, g)[0])
    with torch.no_grad():
        assert torch.equal(apply_rope_train(x, cos, sin), apply_rope(x, cos, sin))

    # the fused projection: 3 query heads and 1 key/value head (grouped-query) of 8 numbers, T = 10
    nq, nkv, d = 3, 1, 8
    qkv = _randn(2, 10, (nq + 2 * nkv) * d).requires_grad_()
    q, k, v = rope_qkv_train(qkv, cos, sin, nq, nkv)
    heads = qkv.view(2, 10, nq + 2 * nkv, d).transpose(1, 2)
    q_ref = apply_rope(heads[:, :nq], cos, sin)
    k_ref = apply_rope(heads[:, nq:nq + nkv], cos, sin)
    v_ref = heads[:, nq + nkv:]
    for a, b in ((q, q_ref), (k, k_ref), (v, v_ref)):
        torch.testing.assert_close(a, b)
    gs = [_randn(*t.shape) for t in (q, k, v)]
    got = torch.autograd.grad((q, k, v), qkv, gs)[0]
    want = torch.autograd.grad((q_ref, k_ref, v_ref), qkv, gs, retain_graph=True)[0]
    torch.testing.assert_close(got, want)
    # a gradient reaching only some of the three (here v unused): the others count as zero
    q, k, v = rope_qkv_train(qkv, cos, sin, nq, nkv)
    got_qk = torch.autograd.grad((q * 2).sum() + k.sum(), qkv)[0]
    want_qk = torch.autograd.grad((q_ref * 2).sum() + k_ref.sum(), qkv)[0]
    torch.testing.assert_close(got_qk, want_qk)
    with torch.no_grad():
        assert rope_qkv_train(qkv, cos, sin, nq, nkv) is None
    # any tables, not only rope_cache's (whose two halves are equal): the formula is apply_rope's
    cos_any, sin_any = _randn(10, 8), _randn(10, 8)
    q, k, v = rope_qkv_train(qkv, cos_any, sin_any, nq, nkv)
    y = apply_rope_train(x, cos_any, sin_any)
    q_ref, k_ref = apply_rope(heads[:, :nq], cos_any, sin_any), apply_rope(heads[:, nq:nq + nkv], cos_any, sin_any)
    y_ref = apply_rope(x, cos_any, sin_any)
    for a, b in ((q, q_ref), (k, k_ref), (y, y_ref)):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(torch.autograd.grad((q, k), qkv, gs[:2])[0],
                               torch.autograd.grad((q_ref, k_ref), qkv, gs[:2], retain_graph=True)[0])
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_ref, x, g)[0])


def test_rope_model_training_gradients_equal_the_written_out_path(monkeypatch):
    """A RoPE + RMSNorm model's loss and gradients through the training paths equal those of the
    written-out formulas (apply_rope, F.rms_norm, SwiGLU's chunk), up to float rounding."""
    import gptlab.attention as attention_module
    from gptlab import GPT, GPTConfig
    from gptlab.layers import SwiGLU

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=16, bias=False,
                    pos_emb="rope", norm="rmsnorm", mlp="swiglu")
    model = GPT(cfg)
    x, y = torch.randint(0, 11, (3, 16), generator=G), torch.randint(0, 11, (3, 16), generator=G)
    _, loss = model(x, y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    monkeypatch.setattr(attention_module, "rope_qkv_train", lambda *a: None)
    monkeypatch.setattr(attention_module, "apply_rope_train", apply_rope)
    monkeypatch.setattr(RMSNorm, "forward", lambda self, t: F.rms_norm(t, self.weight.shape, self.weight, self.eps))

    def swiglu(self, t):
        gate, up = self.c_fc(t).chunk(2, dim=-1)
        return self.c_proj(F.silu(gate) * up)
    monkeypatch.setattr(SwiGLU, "forward", swiglu)
    _, loss_ref = model(x, y)
    grads_ref = torch.autograd.grad(loss_ref, list(model.parameters()))
    torch.testing.assert_close(loss, loss_ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_swiglu_training_path_equals_the_module_formula():
    """SwiGLU with gradients on a CPU runs its own backward (layers._SwiGLUFunction): output and
    gradients (input, c_fc, c_proj) equal those of c_proj(silu(gate) * up), up to float rounding."""
    from gptlab import GPTConfig
    from gptlab.layers import SwiGLU

    torch.manual_seed(0)
    m = SwiGLU(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16, bias=False, mlp="swiglu"))
    x = _randn(3, 5, 16).requires_grad_()
    g = _randn(3, 5, 16)
    y = m(x)
    assert type(y.grad_fn).__name__ == "_SwiGLUFunctionBackward"
    params = (x, m.c_fc.weight, m.c_proj.weight)
    got = torch.autograd.grad(y, params, g)
    gate, up = F.linear(x, m.c_fc.weight).chunk(2, dim=-1)
    y_ref = F.linear(F.silu(gate) * up, m.c_proj.weight)
    want = torch.autograd.grad(y_ref, params, g)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # frozen weights: only the input's gradient
    m.requires_grad_(False)
    (dx,) = torch.autograd.grad(m(x), (x,), g)
    torch.testing.assert_close(dx, want[0])
    with torch.no_grad():
        assert torch.equal(m(x), y_ref)


def test_cpu_training_paths_stay_out_of_torch_compile():
    """The CPU training paths (RoPE, RMSNorm, SwiGLU backwards of their own) write into strided
    views with ``out=``, which Dynamo cannot trace: under ``torch.compile`` (chapter 5b's GPU run)
    the model must take the plain formulas, or each layer would break the compiled graph."""
    from gptlab import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=1, n_head=2, n_embd=32, dropout=0.0, bias=False,
                          pos_emb="rope", norm="rmsnorm", mlp="swiglu"))
    x, y = torch.randint(0, 65, (2, 16)), torch.randint(0, 65, (2, 16))
    explained = torch._dynamo.explain(model)(x, y)
    assert explained.graph_break_count == 0, [r.reason.splitlines()[0] for r in explained.break_reasons]
