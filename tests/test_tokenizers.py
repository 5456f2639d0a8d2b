"""gptlab.tokenizers against known answers and real references (tiktoken, HF transformers)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from gptlab.assets import ASSETS, fetch
from gptlab.data import shakespeare_text
from gptlab.tokenizers import (
    GPT2_SPLIT_PATTERN,
    BPETokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    load_tokenizer,
    tokenizer_from_dict,
    train_bpe,
)

MIXED = "Héllo wörld! naïve café 😀 — 12345 it's  spaced   out\n\n\tend"


@pytest.fixture(scope="module")
def text() -> str:
    return shakespeare_text()


@pytest.fixture(scope="module")
def gpt2() -> GPT2Tokenizer:
    return GPT2Tokenizer()


# ---------------------------------------------------------------- characters

def test_char_vocab_is_sorted_distinct_chars():
    tok = CharTokenizer.from_text("hello world")
    assert tok.chars == [" ", "d", "e", "h", "l", "o", "r", "w"]
    assert tok.vocab_size == 8
    assert tok.encode("hello") == [3, 2, 4, 4, 5]
    assert tok.decode([3, 2, 4, 4, 5]) == "hello"


def test_char_round_trip_shakespeare(text):
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == 65
    ids = tok.encode(text)
    assert len(ids) == len(text) and max(ids) == 64 and min(ids) == 0
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids[:100])) == text[:100]
    assert tok.decode(np.array(ids[:100], dtype=np.uint16)) == text[:100]


def test_char_unknown_character_is_named():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"'z'.*position 2"):
        tok.encode("abz")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([0, 3])
    with pytest.raises(TypeError):
        tok.encode(b"abc")
    with pytest.raises(TypeError):
        tok.decode("abc")


def test_char_bad_vocab():
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer(["a", "b", "a"])
    with pytest.raises(ValueError, match="single characters"):
        CharTokenizer(["ab"])


def test_char_save_load(tmp_path):
    tok = CharTokenizer.from_text("To be\nor not!")
    path = tok.save(tmp_path / "tok.json")
    assert json.loads(path.read_text())["type"] == "char"
    assert CharTokenizer.load(path) == tok
    assert load_tokenizer(path) == tok
    assert tokenizer_from_dict(tok.to_dict()) == tok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok.json"]  # no temporary left behind
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        tokenizer_from_dict({"type": "wordpiece"})


# ---------------------------------------------------------------- GPT-2 (tiktoken)

def test_gpt2_known_answers(gpt2):
    assert gpt2.vocab_size == 50257
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("<|endoftext|>", allowed_special="all") == [50256]
    with pytest.raises(ValueError):  # special tokens in plain text are refused by default
        gpt2.encode("<|endoftext|>")
    assert gpt2.decode([15496, 995]) == "Hello world"
    assert gpt2.token_bytes(995) == b" world"
    assert isinstance(tokenizer_from_dict(gpt2.to_dict()), GPT2Tokenizer)
    with pytest.raises(ValueError, match="out of range"):
        gpt2.decode([50257])


def test_gpt2_round_trip(gpt2, text):
    sample = text[:50_000] + MIXED
    assert gpt2.decode(gpt2.encode(sample)) == sample


def test_gpt2_pattern_is_tiktokens_r50k():
    from tiktoken_ext.openai_public import r50k_pat_str

    assert GPT2_SPLIT_PATTERN == r50k_pat_str


def test_gpt2_matches_hf_transformers(gpt2, text, tmp_path):
    """HF's GPT-2 tokenizer built from the same two files gives the same ids."""
    from transformers import GPT2Tokenizer as HFGPT2Tokenizer

    shutil.copy(fetch(ASSETS["gpt2-encoder-json"], quiet=True), tmp_path / "vocab.json")
    shutil.copy(fetch(ASSETS["gpt2-vocab-bpe"], quiet=True), tmp_path / "merges.txt")
    hf = HFGPT2Tokenizer.from_pretrained(tmp_path)
    sample = text[100_000:110_000] + MIXED
    assert hf.encode("Hello world") == [15496, 995]
    assert gpt2.encode(sample) == hf.encode(sample)


# ---------------------------------------------------------------- teaching BPE

def test_bpe_hand_checked_example():
    # "aaabdaaabac" (one chunk): 'aa' occurs 4 times -> 256; then ('aa','a') and ('a','b') tie
    # at 2 and the first in the text wins -> 257 = 'aaa'; then ('aaa','b') occurs twice -> 258.
    tok = train_bpe("aaabdaaabac", 259)
    assert tok.merges == [((97, 97), 256), ((256, 97), 257), ((257, 98), 258)]
    assert tok.vocab[258] == b"aaab"
    assert tok.encode("aaabdaaabac") == [258, 100, 258, 97, 99]
    assert tok.decode([258, 100, 258, 97, 99]) == "aaabdaaabac"
    assert tok.render_merge(1) == "merge 1: 'aa' + 'a' -> 'aaa' (id 257)"


def _tiktoken_reference(data: str, vocab_size: int, pat_str: str) -> dict[bytes, int]:
    from tiktoken._educational import bpe_train

    return bpe_train(data=data, vocab_size=vocab_size, pat_str=pat_str, visualise=None)


@pytest.mark.parametrize("pat_str", [GPT2_SPLIT_PATTERN, r"\S+|\s+"])
def test_bpe_matches_tiktoken_educational(text, pat_str):
    """Same text, same regex: the same merges with the same ids as tiktoken._educational.bpe_train."""
    from tiktoken._educational import SimpleBytePairEncoding

    train = text[:6000]
    ref = _tiktoken_reference(train, 256 + 60, pat_str)
    tok = train_bpe(train, 256 + 60, pat_str=pat_str)
    assert tok.vocab_size == 316
    assert tok.mergeable_ranks() == ref
    held_out = text[300_000:302_000]
    simple = SimpleBytePairEncoding(pat_str=pat_str, mergeable_ranks=ref)
    assert tok.encode(held_out) == simple.encode(held_out, visualise=None)


def test_bpe_encode_matches_tiktoken_rust(text):
    """Encoding with the learned merges agrees with tiktoken's own (Rust) BPE on unseen text."""
    import tiktoken

    tok = train_bpe(text[:200_000], 256 + 200)
    enc = tiktoken.Encoding(name="taught", pat_str=tok.pat_str, mergeable_ranks=tok.mergeable_ranks(),
                            special_tokens={})
    held_out = text[-50_000:] + MIXED
    ids = tok.encode(held_out)
    assert ids == enc.encode(held_out)
    assert tok.decode(ids) == held_out
    assert len(ids) < len(held_out.encode("utf-8")) * 0.6  # the merges really compress


def test_bpe_round_trip_and_bytes():
    tok = train_bpe("low lower lowest newest widest " * 20, 280)
    for s in ["lowest", "unseen wörds 😀", "", "\n\n  x"]:
        assert tok.decode(tok.encode(s)) == s
    emoji = tok.encode("😀")
    assert emoji == list("😀".encode("utf-8"))  # unseen bytes stay single-byte tokens
    assert tok.decode(emoji[:2]) == "\ufffd"  # half a character decodes to U+FFFD
    assert all(line.startswith(f"merge {k}: ") for k, line in enumerate(tok.render_merges()))
    assert len(tok.render_merges(3)) == 3


def test_bpe_save_load_and_validation(tmp_path):
    tok = train_bpe("the cat sat on the mat with the hat", 270)
    tok.save(tmp_path / "bpe.json")
    again = load_tokenizer(tmp_path / "bpe.json")
    assert again == tok and again.encode("the mat") == tok.encode("the mat")
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe("abc", 100)
    with pytest.raises(ValueError, match="must create id 256"):
        BPETokenizer([((97, 98), 300)])
    with pytest.raises(ValueError, match="not defined"):
        BPETokenizer([((97, 999), 256)])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_bpe_stops_when_nothing_left_to_merge():
    # chunks "ab" and " ab": merge 'a'+'b' -> 256, then ' '+'ab' -> 257, then no pair is left
    tok = train_bpe("ab ab", 1000)
    assert tok.merges == [((97, 98), 256), ((32, 256), 257)]
    assert tok.vocab_size == 258
    assert tok.encode("ab ab") == [256, 257]
