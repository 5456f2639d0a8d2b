"""Tests of gptlab.model against real references: PyTorch's own ops, Hugging Face ``transformers``
layers (GPT-2, Llama), FlopCounterMode, and statistics of the initialisation.

Everything here uses tiny seeded models so the file runs in seconds on a busy CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import gptlab
from tiny_models import COVERING, LLAMA, VARIANTS, WINDOWED, tiny_gpt

from gptlab.kvcache import ConcatKVCache, SlidingWindowKVCache, StaticKVCache
from gptlab.attention import attention
from gptlab.layers import LayerNorm, RMSNorm, SwiGLU, new_gelu
from gptlab.masks import causal_mask
from gptlab.model import GPT, Block, GPTConfig
from gptlab.rope import apply_rope, rope_cache

V = 61  # a vocabulary size that is not a power of two


GPT2_TINY = dict(vocab_size=V, block_size=32, n_layer=2, n_head=4, n_embd=32)
LLAMA_TINY = {**GPT2_TINY, **LLAMA}  # the "llama" variant of tests/tiny_models.py, whole


def tiny(seed: int = 0, **overrides) -> GPT:
    return tiny_gpt(seed, **{**GPT2_TINY, **overrides})


def ids(B: int = 2, T: int = 16, seed: int = 1, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


def randomize_norms(model: torch.nn.Module, seed: int = 3) -> None:
    """Give norm gains/biases non-trivial values (they start at ones/zeros)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (LayerNorm, RMSNorm, torch.nn.LayerNorm)):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))


# --------------------------------------------------------------------------- masks and attention


@pytest.mark.parametrize("T", [1, 2, 7])
def test_causal_mask_is_lower_triangular_bool(T):
    m = gptlab.causal_mask(T)
    assert m.dtype == torch.bool and m.shape == (T, T)
    assert torch.equal(m, torch.ones(T, T).tril().bool())


def test_causal_mask_matches_sdpa_is_causal():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 9, 8).unbind(0)
    with_mask = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(9))
    builtin = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(with_mask, builtin, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4"])
def test_causal_mask_rejects_bad_length(bad):
    with pytest.raises(ValueError, match="positive int"):
        causal_mask(bad)


def test_attention_matches_sdpa_and_returns_weights():
    torch.manual_seed(0)
    B, H, T, S, d = 2, 3, 5, 7, 8
    q, k, v = torch.randn(B, H, T, d), torch.randn(B, H, S, d), torch.randn(B, H, S, d)
    # no mask
    torch.testing.assert_close(attention(q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-6, rtol=1e-5)
    # an arbitrary boolean mask (every row keeps at least one key)
    mask = torch.rand(B, 1, T, S, generator=torch.Generator().manual_seed(1)) > 0.5
    mask[..., 0] = True
    out, w = attention(q, k, v, mask, return_weights=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-6, rtol=1e-5)
    assert w.shape == (B, H, T, S)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, T))
    assert (w.masked_select(~mask.expand_as(w)) == 0).all()
    # causal (square)
    q2 = torch.randn(B, H, S, d)
    out, w = attention(q2, k, v, causal_mask(S), return_weights=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q2, k, v, is_causal=True), atol=1e-6, rtol=1e-5)
    assert torch.equal(w.triu(1), torch.zeros_like(w))


def test_attention_fully_masked_row_gives_zeros_not_nan():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    mask = torch.tensor([[False, False, False], [True, True, False]])
    out, w = attention(q, k, v, mask, return_weights=True)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 0, 0], torch.zeros(4)) and torch.equal(w[0, 0, 0], torch.zeros(3))


# A variant that fixes attn_impl itself (postnorm_explicit) has no SDPA path to compare.
SDPA_VARIANTS = [name for name, kw in VARIANTS.items() if "attn_impl" not in kw]


@pytest.mark.parametrize("name", SDPA_VARIANTS)
def test_explicit_and_sdpa_paths_agree(name):
    fast = tiny(**VARIANTS[name])
    slow = GPT(GPTConfig(**{**fast.config.to_dict(), "attn_impl": "explicit"})).eval()
    slow.load_state_dict(fast.state_dict())
    x = ids(T=20)
    torch.testing.assert_close(slow(x)[0], fast(x)[0], atol=1e-5, rtol=1e-5)
    # with a left-padding attention mask
    am = torch.ones_like(x)
    am[0, :4] = 0
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    a = slow(x, attention_mask=am, position_ids=pos)[0]
    b = fast(x, attention_mask=am, position_ids=pos)[0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_record_weights_are_causal_distributions():
    model = tiny(window_size=4)
    attn = model.transformer.h[1].attn
    attn.record_weights = True
    x = ids(B=1, T=10)
    logits_rec = model(x)[0]
    attn.record_weights = False
    torch.testing.assert_close(logits_rec, model(x)[0], atol=1e-5, rtol=1e-5)
    w = attn.last_weights
    assert w.shape == (1, 4, 10, 10)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, 10))
    i, j = torch.meshgrid(torch.arange(10), torch.arange(10), indexing="ij")
    allowed = (j <= i) & (j > i - 4)
    assert (w[..., ~allowed] == 0).all()


# --------------------------------------------------------------------------- layers vs references


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_matches_torch(bias):
    torch.manual_seed(0)
    ours, ref = LayerNorm(24, bias=bias), torch.nn.LayerNorm(24, bias=bias)
    randomize_norms(ours)
    ref.load_state_dict(ours.state_dict())
    x = 3 * torch.randn(4, 5, 24) + 1
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-6)
    assert (ours.bias is None) == (not bias)


def test_rmsnorm_matches_hf_llama_and_torch():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    ours = RMSNorm(24, eps=1e-6)
    randomize_norms(ours)
    hf = LlamaRMSNorm(24, eps=1e-6)
    hf.load_state_dict(ours.state_dict())
    pt = torch.nn.RMSNorm(24, eps=1e-6)
    pt.load_state_dict(ours.state_dict())
    x = 3 * torch.randn(4, 5, 24)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours(x), pt(x), atol=1e-6, rtol=1e-6)
    xb = x.bfloat16()  # normalised in float32 like HF, cast back to bfloat16 before the gain
    torch.testing.assert_close(RMSNorm(24)(xb), LlamaRMSNorm(24, eps=1e-5)(xb), atol=0, rtol=0)


def test_new_gelu_matches_hf_gelu_new():
    from transformers.activations import NewGELUActivation

    x = torch.linspace(-8, 8, 2001)
    torch.testing.assert_close(new_gelu(x), NewGELUActivation()(x), atol=1e-6, rtol=1e-6)
    # and it is the tanh approximation, not the exact erf GELU (they differ by up to ~5e-4)
    assert (new_gelu(x) - F.gelu(x)).abs().max() > 1e-4


def test_swiglu_matches_hf_llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    cfg = GPTConfig(**{**LLAMA_TINY, "n_inner": 48})
    ours = SwiGLU(cfg).eval()
    hf = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu", mlp_bias=False))
    gate, up = ours.c_fc.weight.chunk(2, dim=0)
    with torch.no_grad():
        hf.gate_proj.weight.copy_(gate)
        hf.up_proj.weight.copy_(up)
        hf.down_proj.weight.copy_(ours.c_proj.weight)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-6, rtol=1e-5)


def test_swiglu_default_inner_dim_keeps_parameter_count():
    c = GPTConfig(**{**LLAMA_TINY, "n_embd": 192, "n_head": 4})
    # 8/3 * C rounded up to a multiple of 64: three C x inner matrices ~ two C x 4C matrices
    assert c.inner_dim == 512 and c.inner_dim % 64 == 0
    assert abs(3 * c.inner_dim - 2 * 4 * 192) / (2 * 4 * 192) < 0.01


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_rope_matches_hf_llama(theta):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    torch.manual_seed(0)
    B, H, T, D = 2, 3, 11, 16
    hf_cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    q, k = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    pos = torch.stack([torch.arange(T), torch.arange(5, 5 + T)])  # second row starts at 5
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(q, pos)
    hq, hk = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    cos, sin = rope_cache(64, D, theta)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    torch.testing.assert_close(apply_rope(q, c, s), hq, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(apply_rope(k, c, s), hk, atol=1e-6, rtol=1e-5)


def test_rope_is_a_relative_position_encoding():
    # <rope(q, m), rope(k, n)> depends on m - n only; and rotation preserves norms.
    torch.manual_seed(0)
    D = 8
    cos, sin = rope_cache(40, D, 100.0)
    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D)

    def rot(x, p):
        return apply_rope(x, cos[p].view(1, 1, 1, D), sin[p].view(1, 1, 1, D))

    dots = [float((rot(q, m) * rot(k, m - 3)).sum()) for m in (3, 10, 30)]
    assert max(dots) - min(dots) < 1e-4
    torch.testing.assert_close(rot(q, 17).norm(), q.norm())


def test_prenorm_block_matches_hf_gpt2_block():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    cfg = GPTConfig(**GPT2_TINY)
    ours = Block(cfg).eval()
    randomize_norms(ours)
    hf_cfg = GPT2Config(n_embd=32, n_head=4, n_positions=32, n_layer=1)
    hf_cfg._attn_implementation = "eager"  # a standalone block: HF builds masks at model level
    hf = GPT2Block(hf_cfg, layer_idx=0).eval()
    sd = {k: (v.t() if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else v)
          for k, v in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all(m.endswith("attn.bias") or m.endswith("masked_bias") for m in missing)
    x = torch.randn(2, 9, 32)
    additive = torch.zeros(9, 9).masked_fill(~causal_mask(9), float("-inf"))[None, None]
    out = hf(x, attention_mask=additive)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(ours(x), out, atol=1e-5, rtol=1e-5)


def test_postnorm_block_is_the_gpt1_formula():
    torch.manual_seed(0)
    cfg = GPTConfig(**{**GPT2_TINY, "prenorm": False})
    blk = Block(cfg).eval()
    randomize_norms(blk)
    x = torch.randn(2, 9, 32)
    h = blk.ln_1(x + blk.attn(x))
    expected = blk.ln_2(h + blk.mlp(h))
    torch.testing.assert_close(blk(x), expected)
    # post-norm blocks already end with a norm, so the model has no final ln_f (like HF's GPT-1,
    # matched whole in tests/test_hf.py)
    model = tiny(prenorm=False)
    assert isinstance(model.transformer.ln_f, torch.nn.Identity)


# --------------------------------------------------------------------------- init, tying, sizes


def test_gpt2_initialisation_statistics():
    from scipy import stats

    n_layer = 6
    model = tiny(n_layer=n_layer, n_embd=128, n_head=4, vocab_size=300, block_size=64)
    proj, other = [], []
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            proj.append(p.detach().flatten())
        elif p.dim() == 2:
            other.append(p.detach().flatten())
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:  # LayerNorm gains
            assert torch.equal(p, torch.ones_like(p)), name
    proj, other = torch.cat(proj), torch.cat(other)
    expected = 0.02 / math.sqrt(2 * n_layer)
    # std estimate of N normal samples has relative standard error 1/sqrt(2N) (< 0.2% here)
    assert abs(proj.std().item() / expected - 1) < 0.01
    assert abs(other.std().item() / 0.02 - 1) < 0.01
    assert abs(proj.mean().item()) < 5 * expected / math.sqrt(proj.numel())
    # normal, not e.g. uniform with the same std
    assert stats.kstest(proj[:20000].numpy() / expected, "norm").pvalue > 1e-3


def test_weight_tying_survives_a_gradient_step():
    model = tiny().train()
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = torch.optim.AdamW(model.optimizer_groups(0.1), lr=1e-2)
    before = model.transformer.wte.weight.detach().clone()
    _, loss = model(ids(), ids(seed=2))
    loss.backward()
    opt.step()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not torch.equal(before, model.transformer.wte.weight)  # it did move
    torch.testing.assert_close(model.lm_head.weight, model.transformer.wte.weight)
    untied = tiny(tie_weights=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight


def gpt2_param_formula(V, T, L, C, inner=None) -> int:
    inner = inner or 4 * C
    per_block = 2 * 2 * C  # two LayerNorms
    per_block += C * 3 * C + 3 * C  # c_attn
    per_block += C * C + C  # attn c_proj
    per_block += C * inner + inner + inner * C + C  # MLP
    return V * C + T * C + L * per_block + 2 * C  # wte (tied head) + wpe + blocks + ln_f


@pytest.mark.parametrize("shape", [(61, 32, 2, 4, 32), (300, 64, 3, 6, 48), (50257, 1024, 12, 12, 768)])
def test_parameter_count_formula(shape):
    V_, T_, L, H, C = shape
    cfg = GPTConfig(vocab_size=V_, block_size=T_, n_layer=L, n_head=H, n_embd=C)
    with torch.device("meta"):
        model = GPT(cfg)
    n = model.num_params()
    assert n == gpt2_param_formula(V_, T_, L, C)
    assert model.num_params(non_embedding=True) == n - T_ * C
    if shape[0] == 50257:
        assert n == 124_439_808  # GPT-2 small, the published 124M


def test_parameter_count_modern_variants():
    C, L, H, KV, inner, V_ = 32, 2, 4, 2, 48, 61
    cfg = GPTConfig(**{**LLAMA_TINY, "n_inner": inner})
    model = GPT(cfg)
    hd = C // H
    per_block = 2 * C + C * (H * hd + 2 * KV * hd) + H * hd * C + C * 2 * inner + inner * C
    assert model.num_params() == 2 * V_ * C + L * per_block + C  # untied head, no wpe, final norm
    assert model.num_params(non_embedding=True) == model.num_params() - V_ * C


@pytest.mark.parametrize("name", COVERING)  # every option the FLOP formula reads, and attention's
@pytest.mark.parametrize("T", [8, 32])
def test_flops_per_token_matches_flop_counter(name, T):
    # The explicit attention path does its matmuls with aten ops FlopCounterMode counts (it does
    # not count PyTorch's fused CPU SDPA kernel).
    model = tiny(**{**VARIANTS[name], "attn_impl": "explicit"}).train()
    B = 2
    x = ids(B=B, T=T)
    with FlopCounterMode(display=False) as fc:
        model(x)
    fwd = fc.get_total_flops() / (B * T)
    assert fwd == model.flops_per_token(T, training=False)
    with FlopCounterMode(display=False) as fc:
        _, loss = model(x, ids(B=B, T=T, seed=5))
        loss.backward()
    assert fc.get_total_flops() / (B * T) == model.flops_per_token(T, training=True)
    assert model.flops_per_token(T, training=True) == 3 * model.flops_per_token(T, training=False)


def test_flops_default_is_block_size_and_6n_rule():
    model = tiny(n_layer=4, n_embd=64, vocab_size=500, block_size=16)
    assert model.flops_per_token() == model.flops_per_token(16)
    # Kaplan et al.'s rule: training = 6 N + attention, N = weights used in matrix products
    # (every Linear, the tied head once; not embeddings lookups, norms or biases).
    n_matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attn = 3 * model.config.n_layer * 4 * 16 * 64  # 3 x (QK^T and AV: 2 x 2 T C per layer)
    assert model.flops_per_token() == 6 * n_matmul + attn


# --------------------------------------------------------------------------- bad input


def test_bad_config_errors_name_expectation():
    with pytest.raises(ValueError, match=r"n_embd \(30\) must be divisible by n_head \(4\)"):
        GPTConfig(**{**GPT2_TINY, "n_embd": 30})
    with pytest.raises(ValueError, match=r"n_head \(4\) must be divisible by n_kv_head \(3\)"):
        GPTConfig(**{**GPT2_TINY, "n_kv_head": 3})
    with pytest.raises(ValueError, match=r"norm must be 'layernorm' or 'rmsnorm', got 'batchnorm'"):
        GPTConfig(**{**GPT2_TINY, "norm": "batchnorm"})
    with pytest.raises(ValueError, match=r"mlp must be 'gelu' or 'swiglu', got 'relu'"):
        GPTConfig(**{**GPT2_TINY, "mlp": "relu"})
    with pytest.raises(ValueError, match=r"pos_emb must be 'learned' or 'rope'"):
        GPTConfig(**{**GPT2_TINY, "pos_emb": "alibi"})
    with pytest.raises(ValueError, match=r"n_layer must be a positive int, got 0"):
        GPTConfig(**{**GPT2_TINY, "n_layer": 0})
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        GPTConfig(**{**GPT2_TINY, "dropout": 1.5})
    with pytest.raises(TypeError, match="GPT expects a GPTConfig, got dict"):
        GPT(GPT2_TINY)


def test_bad_input_errors_name_expectation():
    model = tiny()
    with pytest.raises(ValueError, match=r"sequence of length 33 is longer than block_size=32"):
        model(ids(T=33))
    with pytest.raises(TypeError, match=r"integer token ids .* got dtype torch.float32"):
        model(ids().float())
    with pytest.raises(ValueError, match=r"idx must have shape \(B, T\), got shape \(16,\)"):
        model(ids()[0])
    with pytest.raises(ValueError, match=r"targets must have the shape of idx \(2, 16\), got \(2, 15\)"):
        model(ids(), ids()[:, :15])
    with pytest.raises(TypeError, match=r"targets must hold integer token ids .* got dtype torch.float32"):
        model(ids(), ids().float())
    with pytest.raises(TypeError, match=r"idx must be a torch.Tensor of token ids, got list"):
        model([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"at least one token"):
        model(torch.zeros(2, 0, dtype=torch.long))
    cache = ConcatKVCache(2)
    model(ids(T=30), kv_cache=cache)
    with pytest.raises(ValueError, match=r"longer than block_size=32 \(30 cached \+ 3 new\)"):
        model(ids(T=3), kv_cache=cache)


def test_int32_ids_and_loss_matches_cross_entropy():
    model = tiny()
    x, y = ids(), ids(seed=7)
    logits, loss = model(x, y)
    torch.testing.assert_close(model(x.int())[0], logits)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, V), y.reshape(-1)))
    # -100 entries are ignored
    y2 = y.clone()
    y2[:, :5] = -100
    torch.testing.assert_close(model(x, y2)[1], F.cross_entropy(logits[:, 5:].reshape(-1, V), y[:, 5:].reshape(-1)))
    # at init the loss is close to ln(V) (uniform predictions)
    assert abs(loss.item() - math.log(V)) < 0.1
    # last_only gives the last position's logits
    torch.testing.assert_close(model(x, last_only=True)[0], logits[:, -1:])


# --------------------------------------------------------------------------- variants train


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_trains(name):
    model = tiny(**VARIANTS[name]).train()
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, V, (4, 17), generator=g)
    x, y = batch[:, :-1], batch[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.6 * losses[0], losses


def test_dropout_only_in_training():
    model = tiny(dropout=0.3)
    x = ids()
    torch.testing.assert_close(model(x)[0], model(x)[0])  # eval: deterministic
    model.train()
    torch.manual_seed(0)
    a = model(x)[0]
    torch.manual_seed(1)
    assert not torch.allclose(a, model(x)[0])


# --------------------------------------------------------------------------- KV caches


def make_cache(kind: str, model: GPT, B: int):
    c = model.config
    if kind == "concat":
        return ConcatKVCache(c.n_layer)
    if kind == "static":
        return StaticKVCache.for_model(model, B)
    return SlidingWindowKVCache(c.n_layer, c.window_size or 8)


# tests/test_kvcache.py runs every variant through every cache; here the plain and the Llama model,
# each with and without a window, in one chunked prefill. A sliding-window cache forgets old keys, so
# it is exact only for a windowed model.
CACHE_VARIANTS = ["gpt2", "window", "llama", "llama_window"]
CACHE_CASES = [(n, k) for n in CACHE_VARIANTS for k in ("concat", "static", "sliding")
               if k != "sliding" or n in WINDOWED]


@pytest.mark.parametrize("name,kind", CACHE_CASES)
def test_kv_cache_prefill_and_decode_equal_full_forward(name, kind):
    model = tiny(**VARIANTS[name])
    x = ids(B=2, T=24)
    full = model(x)[0]
    cache = make_cache(kind, model, B=2)
    pieces = [model(x[:, :9], kv_cache=cache)[0]]  # prefill 9
    pieces.append(model(x[:, 9:12], kv_cache=cache)[0])  # a chunk of 3 (speculative-style)
    for t in range(12, 24):  # then one token at a time
        pieces.append(model(x[:, t : t + 1], kv_cache=cache)[0])
    assert cache.length == 24
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", COVERING)
def test_kv_cache_crop_then_continue(name):
    model = tiny(**VARIANTS[name])
    x = ids(B=1, T=20)
    full = model(x)[0]
    cache = StaticKVCache.for_model(model, 1)
    model(x[:, :12], kv_cache=cache)
    model(ids(B=1, T=4, seed=9), kv_cache=cache)  # tokens later rejected
    cache.crop(12)
    out = model(x[:, 12:], kv_cache=cache)[0]
    torch.testing.assert_close(out, full[:, 12:], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- from_state_dict


@pytest.mark.parametrize("name", COVERING)
def test_from_state_dict_skips_init_and_keeps_tying(name):
    src = tiny(**VARIANTS[name])
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    if src.config.tie_weights:
        sd.pop("lm_head.weight")
    model = GPT.from_state_dict(src.config, sd)
    assert not model.training
    assert all(p.requires_grad for p in model.parameters())  # trainable, like GPT(config)
    assert model.num_params() == src.num_params()
    assert (model.lm_head.weight is model.transformer.wte.weight) == src.config.tie_weights
    x = ids()
    torch.testing.assert_close(model(x)[0], src(x)[0], atol=0, rtol=0)
    if src.config.pos_emb == "rope":
        assert torch.equal(model.rope_cos, src.rope_cos) and not model.rope_cos.is_meta


def test_from_state_dict_rejects_mismatched_weights():
    src = tiny()
    sd = dict(src.state_dict())
    del sd["transformer.h.0.ln_1.weight"]
    with pytest.raises(ValueError, match=r"missing \['transformer.h.0.ln_1.weight'\]"):
        GPT.from_state_dict(src.config, sd)
    sd = dict(src.state_dict())
    sd["transformer.wte.weight"] = torch.zeros(V + 1, 32)
    with pytest.raises(RuntimeError, match="size mismatch"):
        GPT.from_state_dict(src.config, sd)
