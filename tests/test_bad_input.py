"""Bad input is refused where it is given, with a message naming the argument, the value and what
is allowed (issue 22): the model's config, decoding arguments, end-of-sequence ids, targets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gptlab import GPTConfig
from gptlab.generation import beam_search, generate, stream
from gptlab.sampling import (
    SamplingConfig,
    apply_frequency_penalty,
    apply_presence_penalty,
    apply_repetition_penalty,
    apply_temperature,
    process_logits,
)
from gptlab.generation import speculative_generate
from tiny_models import tiny_gpt

SMALL = dict(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=16)


# --------------------------------------------------------------------------- A. GPTConfig


@pytest.mark.parametrize(
    "field, value, error, message",
    [
        ("n_inner", 0, ValueError, r"n_inner must be a positive int or None, got 0"),
        ("norm_eps", -1, ValueError, r"norm_eps must be a finite number > 0, got -1"),
        ("norm_eps", 0.0, ValueError, r"norm_eps must be a finite number > 0, got 0.0"),
        ("norm_eps", math.nan, ValueError, r"norm_eps must be a finite number > 0, got nan"),
        ("rope_theta", -5, ValueError, r"rope_theta must be a finite number > 0, got -5"),
        ("rope_theta", math.inf, ValueError, r"rope_theta must be a finite number > 0, got inf"),
        ("head_dim_override", 0, ValueError, r"head_dim_override must be a positive int or None, got 0"),
        ("bias", "no", TypeError, r"bias must be True or False, got str 'no'"),
        ("tie_weights", "nope", TypeError, r"tie_weights must be True or False, got str 'nope'"),
        ("prenorm", 1, TypeError, r"prenorm must be True or False, got int 1"),
        ("n_layer", True, TypeError, r"n_layer must be a positive int, got bool True"),
        ("n_layer", 2.0, TypeError, r"n_layer must be a positive int, got float 2.0"),
        ("n_embd", "16", TypeError, r"n_embd must be a positive int, got str '16'"),
        ("window_size", True, TypeError, r"window_size must be a positive int or None, got bool True"),
        ("n_kv_head", 0, ValueError, r"n_kv_head must be a positive int or None, got 0"),
        ("dropout", "0.1", TypeError, r"dropout must be a number in \[0, 1\), got str '0.1'"),
        ("dropout", math.nan, ValueError, r"dropout must be in \[0, 1\), got nan"),
        ("norm", None, TypeError, r"norm must be 'layernorm' or 'rmsnorm', got NoneType None"),
        ("attn_impl", "flash", ValueError, r"attn_impl must be 'sdpa' or 'explicit', got 'flash'"),
    ],
)
def test_config_rejects_wrong_type_or_range_naming_field_value_and_range(field, value, error, message):
    with pytest.raises(error, match=message):
        GPTConfig(**{**SMALL, field: value})


def test_config_accepts_numpy_ints_and_int_reals_and_normalises_them():
    c = GPTConfig(**{**SMALL, "n_layer": np.int64(2), "dropout": 0, "rope_theta": 500, "norm_eps": 1e-6})
    assert type(c.n_layer) is int and c.n_layer == 2
    assert type(c.dropout) is float and type(c.rope_theta) is float
    assert GPTConfig.from_dict(c.to_dict()) == c


def test_config_from_dict_names_unknown_fields_and_bad_values():
    with pytest.raises(ValueError, match=r"ckpt/config.json: unknown GPTConfig field\(s\) \['n_layers'\]"):
        GPTConfig.from_dict({**SMALL, "n_layers": 2}, where="ckpt/config.json")
    with pytest.raises(TypeError, match=r"ckpt/config.json: GPTConfig: n_layer must be a positive int, got str '2'"):
        GPTConfig.from_dict({**SMALL, "n_layer": "2"}, where="ckpt/config.json")
    with pytest.raises(TypeError, match=r"tie_weights must be True or False, got str 'nope'"):
        GPTConfig.from_dict({**SMALL, "tie_weights": "nope"})
    with pytest.raises(TypeError, match=r"a GPTConfig dict expected, got list"):
        GPTConfig.from_dict([("n_layer", 2)])


# --------------------------------------------------------------------------- B. decoding arguments


@pytest.fixture(scope="module")
def model():
    return tiny_gpt(0, **SMALL)


@pytest.mark.parametrize("lp", [math.nan, math.inf, -math.inf])
def test_beam_search_rejects_non_finite_length_penalty(model, lp):
    with pytest.raises(ValueError, match=r"length_penalty must be a finite number"):
        beam_search(model, torch.zeros(1, 2, dtype=torch.long), 3, 2, length_penalty=lp)


BAD_DECODING = [
    ("temperature", math.inf), ("temperature", math.nan), ("top_p", math.nan), ("min_p", math.nan),
    ("repetition_penalty", math.nan), ("repetition_penalty", math.inf), ("frequency_penalty", math.nan),
    ("frequency_penalty", -math.inf), ("presence_penalty", math.nan), ("presence_penalty", math.inf),
]


@pytest.mark.parametrize("name, value", BAD_DECODING)
def test_non_finite_decoding_arguments_are_refused_where_given(model, name, value):
    """Refused by generate/stream/SamplingConfig before any step runs, naming the argument (not
    blamed on the model as NaN logits at sampling time)."""
    idx = torch.zeros(1, 2, dtype=torch.long)
    pattern = rf"{name} must be a finite number, got {value}"
    with pytest.raises(ValueError, match=pattern):
        generate(model, idx, 3, **{name: value})
    with pytest.raises(ValueError, match=pattern):
        stream(model, idx, 3, **{name: value})  # at the call, not at the first next()
    with pytest.raises(ValueError, match=pattern):
        SamplingConfig(**{name: value})
    with pytest.raises(ValueError, match=pattern):
        process_logits(torch.zeros(1, 11), idx, **{name: value})


@pytest.mark.parametrize("fn, name", [(apply_repetition_penalty, "repetition_penalty"),
                                      (apply_frequency_penalty, "frequency_penalty"),
                                      (apply_presence_penalty, "presence_penalty")])
def test_penalty_functions_reject_non_finite(fn, name):
    with pytest.raises(ValueError, match=rf"{name} must be a finite number, got nan"):
        fn(torch.zeros(1, 5), torch.zeros(1, 2, dtype=torch.long), math.nan)
    with pytest.raises(ValueError, match=r"temperature must be a finite number, got inf"):
        apply_temperature(torch.zeros(1, 5), math.inf)


def test_speculative_rejects_non_finite_and_bool_arguments(model):
    idx = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"top_p must be a finite number, got nan"):
        speculative_generate(model, model, idx, 3, top_p=math.nan)
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int >= 0, got True"):
        speculative_generate(model, model, idx, True)


# --------------------------------------------------------------------------- C. eos_token_id


@pytest.mark.parametrize("eos", [0, np.int64(0), torch.tensor(0), np.array(0), [torch.tensor(0)],
                                 [np.int32(0), 5], torch.tensor([0, 5]), np.array([0])],
                         ids=["int", "np.int64", "0-d tensor", "0-d array", "[tensor]", "[np.int32, int]",
                              "1-d tensor", "1-d array"])
def test_eos_token_id_accepts_tensors_and_numpy_integers(model, eos):
    """As Hugging Face does: ``eos`` holds id 0, replaced by the greedy first token, so generation
    stops right after it whatever container the id comes in."""
    idx = torch.zeros(1, 2, dtype=torch.long)
    first = int(generate(model, idx, 1, temperature=0)[0, -1])
    eos = _replace_zero(eos, first)
    out = generate(model, idx, 6, temperature=0, eos_token_id=eos)
    assert out.tolist() == generate(model, idx, 6, temperature=0, eos_token_id=first).tolist()
    assert out.shape[1] == 3
    beams = beam_search(model, idx, 4, 2, eos_token_id=eos, pad_token_id=np.int64(1))
    assert beams.shape[1] <= 6


def _replace_zero(eos, value: int):
    """The same container type as ``eos`` with its id 0 replaced by ``value``."""
    if isinstance(eos, torch.Tensor):
        return torch.where(eos == 0, torch.tensor(value), eos)
    if isinstance(eos, np.ndarray):
        return np.where(eos == 0, value, eos).astype(eos.dtype)
    if isinstance(eos, list):
        return [_replace_zero(e, value) for e in eos]
    return type(eos)(value) if eos == 0 else eos


@pytest.mark.parametrize("eos", [torch.tensor(1.0), True, [True], [], "3", torch.tensor([[3]]), np.float64(3)])
def test_eos_token_id_still_rejects_non_ids(model, eos):
    with pytest.raises(TypeError, match=r"eos_token_id must be an int or a non-empty sequence of ints"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 3, eos_token_id=eos)


def test_pad_token_id_accepts_numpy_and_0d_tensor(model):
    idx = torch.zeros(1, 2, dtype=torch.long)
    a = generate(model, idx, 4, temperature=0, eos_token_id=1, pad_token_id=np.int64(2))
    b = generate(model, idx, 4, temperature=0, eos_token_id=1, pad_token_id=torch.tensor(2))
    assert a.tolist() == b.tolist()
    with pytest.raises(TypeError, match=r"pad_token_id must be an int, got float 2.0"):
        generate(model, idx, 4, pad_token_id=2.0)


# --------------------------------------------------------------------------- D. targets


def test_out_of_range_target_is_named_with_its_position(model):
    idx = torch.zeros(2, 4, dtype=torch.long)
    targets = idx.clone()
    targets[1, 2] = 11
    with pytest.raises(ValueError, match=r"target id 11 at targets\[1, 2\] is outside the vocabulary \[0, 11\)"):
        model(idx, targets)
    targets[1, 2] = -1
    with pytest.raises(ValueError, match=r"target id -1 at targets\[1, 2\]"):
        model(idx, targets)


def test_ignore_index_minus_100_still_ignored(model):
    idx = torch.zeros(1, 4, dtype=torch.long)
    targets = torch.tensor([[1, -100, 2, -100]])
    _, loss = model(idx, targets)
    logits, _ = model(idx)
    ref = torch.nn.functional.cross_entropy(logits[0, [0, 2]], torch.tensor([1, 2]))
    torch.testing.assert_close(loss, ref)
