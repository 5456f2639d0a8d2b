"""The compiled decode step (gptlab.fast.compiled, ``compile=True``): the model's own decode through
``torch.compile`` gives the eager logits (to float rounding) and the same tokens, in generate (a
left-padded batch: positions and padding mask in the graph), stream, beam search and speculative
decoding.

On this project's CPU machines ``torch.compile`` writes and builds C++ (gcc): the first call of
each test compiles for 10-40 s on 2 cores, hence ``slow``."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import torch

from gptlab import beam_search, generate, speculative_generate, stream
from gptlab.fast import compiled
from gptlab.fast.compiled import CompileFallbackWarning, compiled_decode, decode_step
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


@contextmanager
def compiled_here():
    """Skip the test where torch.compile's back end cannot build on this machine (the decoders then
    fall back to the eager step, which test_compile_falls_back_to_the_eager_step checks): a
    missing C++ compiler, or torch 2.13's C++ under ATEN_CPU_CAPABILITY=default."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallbackWarning)
        yield
    fell_back = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
    if fell_back or None in compiled._COMPILED.values():  # now, or in an earlier test of this process
        pytest.skip(fell_back[0] if fell_back else "torch.compile failed on this machine earlier in this process")


def test_compile_falls_back_to_the_eager_step(monkeypatch):
    """A back end that fails to compile: one warning naming why, then the eager step's logits."""
    model = variant_model()

    def failing(model, idx, kv_cache, **kw):
        raise torch._dynamo.exc.BackendCompilerFailed(lambda: None, RuntimeError("no C++ compiler"), None)

    monkeypatch.setitem(compiled._COMPILED, type(model), failing)
    ids = torch.tensor([[1, 2, 3]])
    caches = [StaticKVCache.for_model(model, 1, 8) for _ in range(2)]
    with pytest.warns(CompileFallbackWarning, match="no C..? compiler"):
        got = compiled_decode(model)(ids, caches[0])
    torch.testing.assert_close(got, model.decode(ids, caches[1]), atol=0, rtol=0)
    assert compiled._COMPILED[type(model)] is None  # eager from then on, without another warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled_decode(model)(ids[:, :1], caches[0])


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_logits():
    """A prefill, then steps of one token and a chunk of three (speculative verification), on the
    variant that sets the most options at once (RoPE, grouped-query attention, a sliding window)."""
    model = variant_model(**VARIANTS["window_gqa_rope"])
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    caches = [StaticKVCache.for_model(model, 2, 16) for _ in range(2)]
    f = compiled_decode(model)
    with torch.inference_mode(), compiled_here():
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
    with compiled_here():
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
    with compiled_here():
        got, stats = speculative_generate(target, draft, prompt, 15, temperature=0, num_draft_tokens=3, compile=True)
    assert torch.equal(got, want)
    assert stats.new_tokens == 15
