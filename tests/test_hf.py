"""gptlab <-> Hugging Face ``transformers``: the same weights must give the same logits.

References: randomly initialised HF ``GPT2LMHeadModel``, ``OpenAIGPTLMHeadModel`` (GPT-1, post-norm)
and ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU, grouped-query attention); no download needed.
"""

from __future__ import annotations

import pytest
import torch

import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OpenAIGPTConfig,
    OpenAIGPTLMHeadModel,
)

from gptlab.interop.hf import config_from_hf
from gptlab.kvcache import StaticKVCache
from gptlab.model import GPT, GPTConfig

from_hf = GPT.from_hf

ATOL = 1e-5


def ids(vocab: int, B: int = 2, T: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


def perturb(hf_model, seed: int = 0, scale: float = 0.05) -> None:
    """HF initialises biases to 0 and norm gains to 1; make every parameter non-trivial so a
    mapping mistake (e.g. a missed bias, a swapped gate/up) cannot hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


GPT2_CONFIGS = {
    "small": dict(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4),
    "odd": dict(vocab_size=50, n_positions=20, n_embd=24, n_layer=3, n_head=3, n_inner=40),
    "one_head": dict(vocab_size=120, n_positions=16, n_embd=16, n_layer=1, n_head=1, layer_norm_epsilon=1e-6),
    "deep": dict(vocab_size=64, n_positions=24, n_embd=48, n_layer=4, n_head=6),
}


def hf_gpt2(name: str, seed: int = 0, **extra) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(GPT2Config(**GPT2_CONFIGS[name], **extra)).eval()
    perturb(hf, seed)
    return hf


@pytest.mark.parametrize("name", GPT2_CONFIGS)
def test_gpt2_from_hf_same_logits(name):
    hf = hf_gpt2(name)
    ours = GPT.from_hf(hf)
    assert ours.lm_head.weight is ours.transformer.wte.weight  # tied stays tied
    x = ids(hf.config.vocab_size, T=hf.config.n_positions)
    with torch.no_grad():
        ref = hf(x).logits
    got, _ = ours(x)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    # and the loss: HF shifts labels inside; gptlab takes shifted targets
    with torch.no_grad():
        ref_loss = hf(x, labels=x).loss
    _, loss = ours(x[:, :-1], x[:, 1:])
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=ATOL)


def test_gpt2_untied_from_hf():
    hf = hf_gpt2("small", tie_word_embeddings=False)
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    ours = from_hf(hf)
    assert not ours.config.tie_weights and ours.lm_head.weight is not ours.transformer.wte.weight
    x = ids(97)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], hf(x).logits, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("name", ["small", "odd"])
def test_parameter_count_equals_hf(name):
    hf = hf_gpt2(name)
    assert from_hf(hf).num_params() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("bias", [True, False])
def test_to_hf_roundtrip_and_save_pretrained(bias, tmp_path):
    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=71, block_size=24, n_layer=2, n_head=4, n_embd=32, bias=bias)).eval()
    with torch.no_grad():  # non-trivial norm gains
        for n, p in ours.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    hf = ours.to_hf()
    assert isinstance(hf, GPT2LMHeadModel)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    x = ids(71, T=24)
    want, _ = ours(x)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, want, atol=ATOL, rtol=ATOL)
    hf.save_pretrained(tmp_path)
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, want, atol=ATOL, rtol=ATOL)
    # and back again
    back = from_hf(reloaded)
    torch.testing.assert_close(back(x)[0], want, atol=ATOL, rtol=ATOL)


def test_to_hf_refuses_non_gpt2_models():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16, norm="rmsnorm", n_kv_head=1))
    with pytest.raises(ValueError, match=r"GPT-2 style models only.*norm='rmsnorm'.*n_kv_head=1"):
        model.to_hf()


def test_gpt1_post_norm_from_hf_same_logits():
    """HF's GPT-1 is post-norm with no final LayerNorm: gptlab's ``prenorm=False``."""
    torch.manual_seed(0)
    hf = OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=83, n_positions=20, n_embd=32, n_layer=3, n_head=4)).eval()
    perturb(hf)
    ours = from_hf(hf)
    assert ours.config.prenorm is False
    x = ids(83, T=20)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], hf(x).logits, atol=ATOL, rtol=ATOL)


LLAMA_CONFIGS = {
    "gqa_tied": dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500.0),
    "gqa_untied": dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=100000.0),
    "mqa": dict(num_key_value_heads=1, tie_word_embeddings=False, rope_theta=10000.0),
    "mha_bias": dict(num_key_value_heads=4, tie_word_embeddings=False, rope_theta=2000.0,
                     attention_bias=True, mlp_bias=True),
    "head_dim": dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=700.0, head_dim=12),
}


def hf_llama(name: str, seed: int = 0) -> LlamaForCausalLM:
    extra = dict(LLAMA_CONFIGS[name])
    theta = extra.pop("rope_theta")
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=89, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=40, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": theta}, **extra,
    )
    hf = LlamaForCausalLM(cfg).eval()
    perturb(hf, seed, scale=0.1)
    return hf


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_llama_from_hf_same_logits(name):
    hf = hf_llama(name)
    ours = from_hf(hf)
    c = ours.config
    assert (c.norm, c.mlp, c.pos_emb) == ("rmsnorm", "swiglu", "rope")
    assert c.kv_heads == hf.config.num_key_value_heads and c.rope_theta == hf.config.rope_parameters["rope_theta"]
    assert (ours.lm_head.weight is ours.transformer.wte.weight) == hf.config.tie_word_embeddings
    x = ids(89, T=40)
    with torch.no_grad():
        ref = hf(x).logits
    torch.testing.assert_close(ours(x)[0], ref, atol=ATOL, rtol=ATOL)
    # left-padded batch: real tokens see only real tokens, with positions starting at 0 per row
    am = torch.ones_like(x)
    am[1, :7] = 0
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(x, attention_mask=am, position_ids=pos).logits
    got = ours(x, attention_mask=am, position_ids=pos)[0]
    torch.testing.assert_close(got[am.bool()], ref[am.bool()], atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_kv_cache_decode_matches_hf_full_forward(family):
    hf = hf_gpt2("small") if family == "gpt2" else hf_llama("gqa_untied")
    ours = from_hf(hf)
    x = ids(hf.config.vocab_size, T=20)
    with torch.no_grad():
        ref = hf(x).logits
    cache = StaticKVCache.for_model(ours, batch_size=2)
    out = [ours(x[:, :8], kv_cache=cache)[0]]
    out += [ours(x[:, t : t + 1], kv_cache=cache)[0] for t in range(8, 20)]
    torch.testing.assert_close(torch.cat(out, 1), ref, atol=ATOL, rtol=ATOL)


def test_greedy_continuation_matches_hf_generate():
    hf = hf_llama("gqa_tied")
    ours = from_hf(hf)
    x = ids(89, B=1, T=5)
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    seq = x
    for _ in range(10):
        nxt = ours(seq)[0][:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(seq, ref)


def test_config_from_hf_rejects_what_gptlab_cannot_compute():
    with pytest.raises(ValueError, match=r"tanh GELU; got activation 'relu'"):
        config_from_hf(GPT2Config(activation_function="relu"))
    with pytest.raises(ValueError, match=r"1/sqrt\(head_dim\) only"):
        config_from_hf(GPT2Config(scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(ValueError, match=r"rope_type 'default'.*'linear'"):
        config_from_hf(LlamaConfig(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}))
    with pytest.raises(ValueError, match=r"attention_bias=True, mlp_bias=False"):
        config_from_hf(LlamaConfig(attention_bias=True, mlp_bias=False))
    with pytest.raises(ValueError, match=r"got model_type='bert'"):
        config_from_hf(transformers.BertConfig())
    with pytest.raises(TypeError, match=r"expects a transformers model.*got dict"):
        from_hf({})


def test_to_hf_config_is_valid_for_a_small_vocabulary(capfd):
    """GPT2Config's default bos/eos (GPT-2's <|endoftext|>, 50256) are only kept when the
    vocabulary holds them; transformers then has nothing to warn about when generating."""
    import warnings

    torch.manual_seed(0)
    small = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf = small.to_hf()
        assert hf.config.eos_token_id is None and hf.config.bos_token_id is None
        idx = torch.zeros(1, 1, dtype=torch.long)
        out = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 4)
    err = capfd.readouterr().err
    assert "eos_token_id" not in err and "bos_token_id" not in err, err
    big = GPT(GPTConfig(vocab_size=50257, block_size=16, n_layer=1, n_head=2, n_embd=16)).to_hf()
    assert big.config.eos_token_id == big.config.bos_token_id == 50256
