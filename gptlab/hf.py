"""Hugging Face ``transformers`` interop: load HF weights into gptlab's model and back.

Where this sits: beside the model. It is how gptlab proves itself against the real thing: the
same weights in both implementations must give the same logits.

* GPT-2 (``GPT2LMHeadModel``): HF stores its four projection matrices as ``Conv1D`` weights of
  shape (in, out); gptlab uses ``nn.Linear`` (out, in), so they are transposed. ``lm_head`` stays
  tied to ``wte``.
* Llama family (``LlamaForCausalLM``, e.g. SmolLM2): q/k/v projections are fused into
  ``c_attn``, gate/up into the SwiGLU ``c_fc``; RMSNorm, RoPE, grouped-query attention, no biases.
"""

from __future__ import annotations

import torch

from .model import GPT, GPTConfig

__all__ = ["from_hf", "to_hf", "config_from_hf"]

_GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _rope_theta(cfg) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def config_from_hf(hf_config) -> GPTConfig:
    """The :class:`GPTConfig` equivalent to a ``GPT2Config`` or ``LlamaConfig``."""
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt2":
        if getattr(hf_config, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"gptlab's MLP uses GPT-2's tanh GELU; got activation {hf_config.activation_function!r}")
        return GPTConfig(
            vocab_size=hf_config.vocab_size,
            block_size=hf_config.n_positions,
            n_layer=hf_config.n_layer,
            n_head=hf_config.n_head,
            n_embd=hf_config.n_embd,
            n_inner=hf_config.n_inner,
            dropout=0.0,
            bias=True,
            norm_eps=hf_config.layer_norm_epsilon,
        )
    if kind == "llama":
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"expected a SwiGLU (silu) Llama, got hidden_act={hf_config.hidden_act!r}")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return GPTConfig(
            vocab_size=hf_config.vocab_size,
            block_size=hf_config.max_position_embeddings,
            n_layer=hf_config.num_hidden_layers,
            n_head=hf_config.num_attention_heads,
            n_kv_head=hf_config.num_key_value_heads,
            n_embd=hf_config.hidden_size,
            n_inner=hf_config.intermediate_size,
            dropout=0.0,
            bias=bool(getattr(hf_config, "attention_bias", False)),
            norm="rmsnorm",
            norm_eps=hf_config.rms_norm_eps,
            mlp="swiglu",
            pos_emb="rope",
            rope_theta=_rope_theta(hf_config),
            tie_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
            head_dim_override=head_dim if head_dim * hf_config.num_attention_heads != hf_config.hidden_size else None,
        )
    raise ValueError(f"from_hf supports GPT-2 and Llama-family models, got model_type={kind!r}")


@torch.no_grad()
def from_hf(hf_model) -> GPT:
    """A gptlab :class:`GPT` with the weights of a HF ``GPT2LMHeadModel`` or ``LlamaForCausalLM``."""
    config = config_from_hf(hf_model.config)
    model = GPT(config)
    sd = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    if config.pos_emb == "learned":
        _load_gpt2(model, sd)
    else:
        _load_llama(model, sd, config)
    return model.to(next(hf_model.parameters()).device).eval()


def _load_gpt2(model: GPT, sd: dict) -> None:
    own = model.state_dict()
    for key, target in own.items():
        if key == "lm_head.weight":
            continue  # tied to wte
        src = sd.get(key)
        if src is None:
            raise KeyError(f"HF GPT-2 state dict has no {key!r}")
        if key.endswith(_GPT2_TRANSPOSED):
            src = src.t()
        if src.shape != target.shape:
            raise ValueError(f"{key}: HF shape {tuple(src.shape)} != gptlab shape {tuple(target.shape)}")
        target.copy_(src)


def _load_llama(model: GPT, sd: dict, config: GPTConfig) -> None:
    def get(name):
        if name not in sd:
            raise KeyError(f"HF Llama state dict has no {name!r}")
        return sd[name]

    t = model.transformer
    t.wte.weight.copy_(get("model.embed_tokens.weight"))
    t.ln_f.weight.copy_(get("model.norm.weight"))
    if not config.tie_weights:
        model.lm_head.weight.copy_(get("lm_head.weight"))
    for i, block in enumerate(t.h):
        p = f"model.layers.{i}."
        block.ln_1.weight.copy_(get(p + "input_layernorm.weight"))
        block.ln_2.weight.copy_(get(p + "post_attention_layernorm.weight"))
        a = p + "self_attn."
        block.attn.c_attn.weight.copy_(
            torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")])
        )
        if config.bias:
            block.attn.c_attn.bias.copy_(torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")]))
        block.attn.c_proj.weight.copy_(get(a + "o_proj.weight"))
        m = p + "mlp."
        block.mlp.c_fc.weight.copy_(torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]))
        block.mlp.c_proj.weight.copy_(get(m + "down_proj.weight"))


@torch.no_grad()
def to_hf(model: GPT):
    """An equivalent HF ``GPT2LMHeadModel`` for a GPT-2 style gptlab model (LayerNorm, GELU,
    learned positions, pre-norm, tied weights, full attention). ``bias=False`` models export
    with zero biases, which computes the same function."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    problems = [
        msg
        for bad, msg in [
            (c.norm != "layernorm", f"norm={c.norm!r}"),
            (c.mlp != "gelu", f"mlp={c.mlp!r}"),
            (c.pos_emb != "learned", f"pos_emb={c.pos_emb!r}"),
            (not c.prenorm, "prenorm=False"),
            (not c.tie_weights, "tie_weights=False"),
            (c.kv_heads != c.n_head, f"n_kv_head={c.n_kv_head}"),
            (c.window_size is not None, f"window_size={c.window_size}"),
        ]
        if bad
    ]
    if problems:
        raise ValueError("to_hf exports GPT-2 style models only; this one has " + ", ".join(problems))
    hf_config = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=c.n_inner,
        activation_function="gelu_new",
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.dropout,
        layer_norm_epsilon=c.norm_eps,
        tie_word_embeddings=True,
    )
    hf = GPT2LMHeadModel(hf_config)
    hf_sd = hf.state_dict()
    for key, src in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        if key.endswith(_GPT2_TRANSPOSED):
            src = src.t()
        hf_sd[key].copy_(src)
    own = model.state_dict()
    for name, param in hf.named_parameters():
        if name.endswith(".bias") and name not in own:
            param.zero_()  # bias=False: a zero bias computes the same function
    hf.tie_weights()
    p = next(model.parameters())
    return hf.to(device=p.device, dtype=p.dtype).eval()
