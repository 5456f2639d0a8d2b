"""GenerationConfig (issue 23): the decoding settings as one object, checked once, consumed by
generate, stream, beam_search, speculative_generate and ``python -m gptlab sample``; the keyword
arguments are a convenience that builds it (or changes a given one), and give the same tokens."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from gptlab import GenerationConfig, beam_search, generate, speculative_generate, stream
from gptlab.sampling import SamplingConfig
from tiny_models import tiny_gpt

SMALL = dict(vocab_size=23, block_size=32, n_layer=1, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def model():
    return tiny_gpt(0, scale=4.0, **SMALL)


@pytest.fixture(scope="module")
def draft():
    return tiny_gpt(1, scale=4.0, **SMALL)


IDX = torch.tensor([[1, 2, 3], [4, 5, 6]])


# --------------------------------------------------------------------------- the object


def test_defaults_are_today_s_keyword_defaults():
    c = GenerationConfig()
    assert (c.max_new_tokens, c.sampling, c.eos_token_id, c.pad_token_id) == (None, SamplingConfig(), None, None)
    assert (c.use_cache, c.cache, c.fast, c.num_beams, c.length_penalty, c.early_stopping, c.num_draft_tokens) == (
        True, "static", True, 1, 1.0, False, 4)
    assert c.sampling.temperature == 1.0


def test_frozen_and_normalised():
    c = GenerationConfig(eos_token_id=torch.tensor([3, 4]), pad_token_id=np.int64(2), length_penalty=2)
    assert c.eos_token_id == (3, 4) and type(c.pad_token_id) is int and type(c.length_penalty) is float
    assert GenerationConfig(eos_token_id=7).eos_token_id == (7,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_new_tokens = 3
    assert hash(c) == hash(GenerationConfig(eos_token_id=[3, 4], pad_token_id=2, length_penalty=2.0))


@pytest.mark.parametrize(
    "settings, error, message",
    [
        (dict(max_new_tokens=-1), ValueError, r"max_new_tokens must be an int >= 0, got -1"),
        (dict(max_new_tokens=True), ValueError, r"max_new_tokens must be an int >= 0, got True"),
        (dict(sampling={"temperature": 0}), TypeError, r"sampling must be a gptlab.sampling.SamplingConfig, got dict"),
        (dict(eos_token_id=[]), TypeError, r"eos_token_id must be an int or a non-empty sequence of ints"),
        (dict(pad_token_id=2.0), TypeError, r"pad_token_id must be an int, got float 2.0"),
        (dict(use_cache="yes"), TypeError, r"use_cache must be True or False, got str 'yes'"),
        (dict(cache="paged"), ValueError, r"cache must be one of \('static', 'concat', 'sliding'\), got 'paged'"),
        (dict(fast=1), TypeError, r"fast must be True or False, got int 1"),
        (dict(num_beams=0), ValueError, r"num_beams must be an int >= 1, got 0"),
        (dict(length_penalty="1"), TypeError, r"length_penalty must be a real number, got str '1'"),
        (dict(length_penalty=math.nan), ValueError, r"length_penalty must be a finite number, got nan"),
        (dict(early_stopping="sometimes"), ValueError, r"early_stopping must be True, False or 'never', got 'sometimes'"),
        (dict(num_draft_tokens=0), ValueError, r"num_draft_tokens must be an int >= 1, got 0"),
    ],
)
def test_a_bad_setting_is_refused_when_the_config_is_built(settings, error, message):
    with pytest.raises(error, match=message):
        GenerationConfig(**settings)


def test_replace_routes_sampling_settings_and_names_unknown_ones():
    c = GenerationConfig(max_new_tokens=5, sampling=SamplingConfig(top_k=3))
    d = c.replace(temperature=0, eos_token_id=2)
    assert d.sampling == SamplingConfig(temperature=0.0, top_k=3) and d.eos_token_id == (2,) and d.max_new_tokens == 5
    assert c.sampling.temperature == 1.0  # the original is untouched
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        c.replace(top_p=0)
    with pytest.raises(TypeError, match=r"unknown decoding setting\(s\) \['topk'\]; the settings are .*'top_k'"):
        c.replace(topk=3)


def test_build_keywords_override_the_config():
    base = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(temperature=0.5))
    assert GenerationConfig.build(base) is base
    assert GenerationConfig.build(base, 9).max_new_tokens == 9
    assert GenerationConfig.build(base, top_k=None).sampling.temperature == 0.5
    assert GenerationConfig.build(None, 3, temperature=0) == GenerationConfig(3, SamplingConfig(temperature=0))
    with pytest.raises(TypeError, match=r"config must be a gptlab GenerationConfig, got dict"):
        GenerationConfig.build({"max_new_tokens": 3})


# --------------------------------------------------------------------------- every decoder consumes it


def test_generate_and_stream_with_a_config_equal_the_keywords(model):
    g = torch.Generator().manual_seed
    kw = dict(temperature=0.9, top_k=5, repetition_penalty=1.3, eos_token_id=[7, 8], pad_token_id=0)
    config = GenerationConfig(max_new_tokens=10, sampling=SamplingConfig(temperature=0.9, top_k=5, repetition_penalty=1.3),
                              eos_token_id=[7, 8], pad_token_id=0)
    want = generate(model, IDX, 10, generator=g(0), **kw)
    assert torch.equal(generate(model, IDX, config=config, generator=g(0)), want)
    assert torch.equal(generate(model, IDX, 10, config, generator=g(0)), want)
    steps = list(stream(model, IDX, config=config, generator=g(0)))
    assert torch.equal(torch.cat([IDX, *steps], dim=1), want)
    # a keyword changes the config's setting for the call
    greedy = generate(model, IDX, 6, temperature=0)
    assert torch.equal(generate(model, IDX, 6, config, temperature=0, top_k=None, repetition_penalty=None,
                                eos_token_id=None, pad_token_id=None), greedy)


def test_generate_needs_max_new_tokens_somewhere_and_refuses_beams(model):
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int >= 0, got None"):
        generate(model, IDX)
    with pytest.raises(ValueError, match=r"num_beams=3: generate and stream decode one sequence per row"):
        generate(model, IDX, 3, num_beams=3)
    with pytest.raises(TypeError, match=r"unknown decoding setting\(s\) \['temprature'\]"):
        generate(model, IDX, 3, temprature=0)


def test_beam_search_reads_its_settings_from_the_config(model):
    want = beam_search(model, IDX, 8, 3, 0.5, 7, early_stopping=True)
    config = GenerationConfig(max_new_tokens=8, num_beams=3, length_penalty=0.5, eos_token_id=7, early_stopping=True)
    assert torch.equal(beam_search(model, IDX, config=config), want)
    assert torch.equal(beam_search(model, IDX, 8, 3, config=config.replace(max_new_tokens=None)), want)
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int >= 1 for beam search, got 0"):
        beam_search(model, IDX, 0, 2)


def test_speculative_generate_reads_its_settings_from_the_config(model, draft):
    idx = IDX[:1]
    want, _ = speculative_generate(model, draft, idx, 9, num_draft_tokens=3, temperature=0)
    config = GenerationConfig(max_new_tokens=9, num_draft_tokens=3, sampling=SamplingConfig(temperature=0))
    got, stats = speculative_generate(model, draft, idx, config=config)
    assert torch.equal(got, want) and stats.num_draft_tokens == 3
    assert torch.equal(got, generate(model, idx, 9, temperature=0))  # greedy: the target's own output
    with pytest.raises(ValueError, match=r"applies temperature, top_k and top_p only; the config also sets "
                                         r"\{'min_p': 0.1\}"):
        speculative_generate(model, draft, idx, 4, min_p=0.1)
    with pytest.raises(ValueError, match=r"num_draft_tokens must be an int >= 1, got 0"):
        speculative_generate(model, draft, idx, 4, num_draft_tokens=0)
