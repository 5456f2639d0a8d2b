"""Hugging Face ``transformers`` interop: load HF weights into gptlab's model and back.

Where this sits: beside the model. It is how gptlab proves itself against the real thing: the
same weights in both implementations must give the same logits.

* GPT-2 (``GPT2LMHeadModel``): HF stores its four projection matrices as ``Conv1D`` weights of
  shape (in, out); gptlab uses ``nn.Linear`` (out, in), so they are transposed. ``lm_head`` stays
  tied to ``wte``.
* GPT-1 (``OpenAIGPTLMHeadModel``): the same Conv1D layout, but post-norm blocks
  (``x = ln_1(x + attn(x)); x = ln_2(x + mlp(x))``) and no final LayerNorm: ``prenorm=False``.
* Llama family (``LlamaForCausalLM``, e.g. SmolLM2): q/k/v projections are fused into
  ``c_attn``, gate/up into the SwiGLU ``c_fc``; RMSNorm, RoPE, grouped-query attention, no biases.
"""

from __future__ import annotations

import torch

from ..config import GPTConfig

__all__ = ["config_from_hf", "state_dict_from_hf", "to_hf"]  # GPT.from_hf builds the model

_GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _rope_theta(cfg) -> float:
    """RoPE base of a HF config (``rope_parameters`` in transformers 5, ``rope_theta`` before)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    scaling = getattr(cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(f"gptlab implements plain RoPE (rope_type 'default'), got rope_type={rope_type!r}")
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


_GPT2_EOS = 50256  # GPT-2's <|endoftext|>

# GPTConfig field -> the HF config attribute holding it, per family (GPT-1's names are GPT-2's);
# to_hf reads the GPT-2 table the other way round
_HF_NAMES = {
    "gpt2": dict(block_size="n_positions", n_layer="n_layer", n_head="n_head", n_embd="n_embd",
                 norm_eps="layer_norm_epsilon"),
    "llama": dict(block_size="max_position_embeddings", n_layer="num_hidden_layers", n_head="num_attention_heads",
                  n_kv_head="num_key_value_heads", n_embd="hidden_size", n_inner="intermediate_size",
                  norm_eps="rms_norm_eps"),
}


def _hf_fields(hf_config, family: str) -> dict:
    """The GPTConfig fields every family converts alike: the vocabulary, the sizes named in
    ``_HF_NAMES[family]``, and no dropout (a converted model is for inference)."""
    sizes = {field: getattr(hf_config, name) for field, name in _HF_NAMES[family].items()}
    return dict(vocab_size=hf_config.vocab_size, dropout=0.0, **sizes)


def config_from_hf(hf_config) -> GPTConfig:
    """The :class:`GPTConfig` equivalent to a ``GPT2Config`` or ``LlamaConfig``."""
    kind = getattr(hf_config, "model_type", None)
    if kind in ("gpt2", "openai-gpt"):  # the same fields; GPT-1 normalises after each sub-layer
        if kind == "gpt2":
            if getattr(hf_config, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
                raise ValueError(
                    f"gptlab's MLP uses GPT-2's tanh GELU; got activation {hf_config.activation_function!r}")
            if not getattr(hf_config, "scale_attn_weights", True) or getattr(
                hf_config, "scale_attn_by_inverse_layer_idx", False
            ):
                raise ValueError(
                    "gptlab scales attention scores by 1/sqrt(head_dim) only; this GPT2Config scales differently")
        elif hf_config.afn not in ("gelu", "gelu_new"):  # HF's GPT-1 maps "gelu" to the tanh GELU
            raise ValueError(f"gptlab's MLP uses the tanh GELU; got afn={hf_config.afn!r}")
        return GPTConfig(
            **_hf_fields(hf_config, "gpt2"),
            n_inner=getattr(hf_config, "n_inner", None),
            bias=True,
            prenorm=kind == "gpt2",
            tie_weights=bool(getattr(hf_config, "tie_word_embeddings", True)),
        )
    if kind == "llama":
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"expected a SwiGLU (silu) Llama, got hidden_act={hf_config.hidden_act!r}")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        attn_bias = bool(getattr(hf_config, "attention_bias", False))
        if bool(getattr(hf_config, "mlp_bias", False)) != attn_bias:
            raise ValueError(
                "gptlab has one bias switch for attention and MLP; this LlamaConfig has "
                f"attention_bias={attn_bias}, mlp_bias={hf_config.mlp_bias}"
            )
        return GPTConfig(
            **_hf_fields(hf_config, "llama"),
            bias=attn_bias,
            norm="rmsnorm",
            mlp="swiglu",
            pos_emb="rope",
            rope_theta=_rope_theta(hf_config),
            tie_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
            head_dim_override=head_dim if head_dim * hf_config.num_attention_heads != hf_config.hidden_size else None,
        )
    raise ValueError(f"from_hf supports GPT-2, GPT-1 (openai-gpt) and Llama-family models, got model_type={kind!r}")


@torch.no_grad()
def state_dict_from_hf(hf_model, config: GPTConfig, shapes: dict) -> dict:
    """gptlab's state dict (float32 copies) for the weights of a HF ``GPT2LMHeadModel``,
    ``OpenAIGPTLMHeadModel`` or ``LlamaForCausalLM`` whose config converts to ``config``;
    ``shapes``: name -> shape of every entry of ``GPT(config).state_dict()`` (checked).
    :meth:`gptlab.GPT.from_hf` builds the model from it."""
    # float32 copies (clone: the gptlab model must not share storage with the HF model)
    sd = {k: v.detach().to(torch.float32, copy=True) for k, v in hf_model.state_dict().items()}
    if config.pos_emb == "learned":
        if hf_model.config.model_type == "openai-gpt":
            sd = _rename_gpt1(sd)
        return _gpt2_state_dict(sd, config, shapes)
    return _llama_state_dict(sd, config)


def _rename_gpt1(sd: dict) -> dict:
    """HF GPT-1 names -> GPT-2 names (``tokens_embed`` -> ``wte``, ``positions_embed`` -> ``wpe``)."""
    out = {}
    for k, v in sd.items():
        k = k.replace("transformer.tokens_embed.", "transformer.wte.")
        k = k.replace("transformer.positions_embed.", "transformer.wpe.")
        out[k] = v
    return out


def _gpt2_state_dict(sd: dict, config: GPTConfig, shapes: dict) -> dict:
    """gptlab's state dict from a HF GPT-2 one: same names, Conv1D (in, out) weights transposed."""
    out = {}
    for key, shape in shapes.items():
        if key == "lm_head.weight" and config.tie_weights:
            continue  # tied to wte
        src = sd.get(key)
        if src is None:
            raise KeyError(f"HF state dict has no {key!r}")
        if key.endswith(_GPT2_TRANSPOSED):
            src = src.t().contiguous()
        if src.shape != shape:
            raise ValueError(f"{key}: HF shape {tuple(src.shape)} != gptlab shape {tuple(shape)}")
        out[key] = src
    return out


def _llama_state_dict(sd: dict, config: GPTConfig) -> dict:
    """gptlab's state dict from a HF Llama one: q/k/v fused into ``c_attn``, gate/up into ``c_fc``."""

    def get(name):
        if name not in sd:
            raise KeyError(f"HF Llama state dict has no {name!r}")
        return sd[name]

    out = {
        "transformer.wte.weight": get("model.embed_tokens.weight"),
        "transformer.ln_f.weight": get("model.norm.weight"),
    }
    if not config.tie_weights:
        out["lm_head.weight"] = get("lm_head.weight")
    for i in range(config.n_layer):
        p, g = f"model.layers.{i}.", f"transformer.h.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[g + "ln_1.weight"] = get(p + "input_layernorm.weight")
        out[g + "ln_2.weight"] = get(p + "post_attention_layernorm.weight")
        out[g + "attn.c_attn.weight"] = torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")])
        out[g + "attn.c_proj.weight"] = get(a + "o_proj.weight")
        out[g + "mlp.c_fc.weight"] = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
        out[g + "mlp.c_proj.weight"] = get(m + "down_proj.weight")
        if config.bias:
            out[g + "attn.c_attn.bias"] = torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
            out[g + "attn.c_proj.bias"] = get(a + "o_proj.bias")
            out[g + "mlp.c_fc.bias"] = torch.cat([get(m + "gate_proj.bias"), get(m + "up_proj.bias")])
            out[g + "mlp.c_proj.bias"] = get(m + "down_proj.bias")
    return out


@torch.no_grad()
def to_hf(model):
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
        **{name: getattr(c, field) for field, name in _HF_NAMES["gpt2"].items()},
        vocab_size=c.vocab_size,
        n_inner=c.n_inner,
        activation_function="gelu_new",
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.dropout,
        tie_word_embeddings=True,
        # GPT2Config's defaults name GPT-2's <|endoftext|> (50256): only a token of this vocabulary
        bos_token_id=_GPT2_EOS if c.vocab_size > _GPT2_EOS else None,
        eos_token_id=_GPT2_EOS if c.vocab_size > _GPT2_EOS else None,
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
