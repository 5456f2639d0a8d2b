"""The compiled decode step (gptlab.fast.compiled, ``compile=True``): the model's own decode through
``torch.compile`` gives the eager logits (to float rounding) and the same tokens, in generate (a
left-padded batch: positions and padding mask in the graph), stream, beam search and speculative
decoding.

On this project's CPU machines ``torch.compile`` writes and builds C++ (gcc): the first call of
each test compiles for 10-40 s on 2 cores, hence ``slow``."""

from __future__ import annotations

import pytest
import torch

from gptlab import beam_search, generate, speculative_generate, stream
from gptlab.fast.compiled import compiled_decode, decode_step
from gptlab.generation import GenerationConfig
from gptlab.kvcache import StaticKVCache
from tiny_models import VARIANTS, variant_model


def test_compile_is_a_checked_setting():
    assert GenerationConfig().compile is False and GenerationConfig().packs is True
    config = GenerationConfig(compile=True)
    assert config.packs is False  # the compiled graph multiplies by the model's own weights
    with pytest.raises(TypeError, match="compile must be True or False, got str 'yes'"):
        GenerationConfig(compile="yes")


def test_decode_step_is_the_model_s_own_unless_compiled():
    model = variant_model()
    assert decode_step(model) == model.decode
    assert decode_step(model, compile=True) is not model.decode


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_logits():
    """A prefill, then steps of one token and a chunk of three (speculative verification), on the
    variant that sets the most options at once (RoPE, grouped-query attention, a sliding window)."""
    model = variant_model(**VARIANTS["window_gqa_rope"])
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    caches = [StaticKVCache.for_model(model, 2, 16) for _ in range(2)]
    f = compiled_decode(model)
    with torch.inference_mode():
        for start, end in ((0, 5), (5, 6), (6, 7), (7, 10), (10, 11)):
            want = model.decode(ids[:, start:end], caches[0], last_only=False)
            got = f(ids[:, start:end], caches[1], last_only=False)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert caches[0].length == caches[1].length == end


@pytest.mark.slow
def test_compiled_generation_gives_the_same_tokens():
    model = variant_model(**VARIANTS["llama"])
    prompts = torch.tensor([[0, 0, 5, 9, 2], [7, 1, 4, 4, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    want = generate(model, prompts, 12, temperature=0, attention_mask=mask, fast=False)
    got = generate(model, prompts, 12, temperature=0, attention_mask=mask, compile=True)
    assert torch.equal(got, want)
    streamed = torch.cat(list(stream(model, prompts, 12, temperature=0, attention_mask=mask, compile=True)), dim=1)
    assert torch.equal(streamed, want[:, prompts.shape[1]:])
    beams = beam_search(model, prompts, 6, 3, attention_mask=mask, fast=False)  # the cache reordered each step
    assert torch.equal(beam_search(model, prompts, 6, 3, attention_mask=mask, compile=True), beams)


@pytest.mark.slow
def test_compiled_speculative_decoding_is_the_target_s_greedy_output():
    target, draft = variant_model(seed=1), variant_model(seed=2, n_layer=1)
    prompt = torch.tensor([[3, 1, 4]])
    want = generate(target, prompt, 15, temperature=0, fast=False)
    got, stats = speculative_generate(target, draft, prompt, 15, temperature=0, num_draft_tokens=3, compile=True)
    assert torch.equal(got, want)
    assert stats.new_tokens == 15
