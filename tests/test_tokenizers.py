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


# ---------------------------------------------------------------- BPE special tokens

EOT = "<|endoftext|>"


def _documents(text: str, n: int = 40, size: int = 1500) -> list[str]:
    """n pieces of Tiny Shakespeare, as the documents of a corpus."""
    return [text[i * size:(i + 1) * size] for i in range(n)]


def test_bpe_special_token_is_kept_whole_and_in_no_merge(text):
    """Documents joined by <|endoftext|>: the separator gets one id of its own, after the merges';
    nothing is learned from its characters nor across it (GPT-2's and CS336's rule)."""
    corpus = EOT.join(_documents(text, n=300, size=60))  # a separator every 60 characters
    plain = train_bpe(corpus, 256 + 120)
    assert any(b"<|" in t or b"|>" in t or b"endoftext" in t for t in plain.vocab.values())  # without: learned
    tok = train_bpe(corpus, 256 + 120 + 1, special_tokens=[EOT])
    assert len(tok.merges) == 120 and tok.vocab_size == 377
    assert tok.special_tokens == {EOT: 376} and tok.vocab[376] == EOT.encode()
    assert not any(b"<|" in tok.vocab[i] or b"|>" in tok.vocab[i] or b"endoftext" in tok.vocab[i] for i in range(376))
    a, b = "First Citizen:\nSpeak.", "\nAll:\nSpeak, speak."
    ids = tok.encode(a + EOT + b)
    assert ids == tok.encode(a) + [376] + tok.encode(b)
    assert ids.count(376) == 1 and tok.decode(ids) == a + EOT + b
    assert tok.encode(EOT + EOT) == [376, 376] and tok.encode("") == []
    assert 376 not in tok.encode("<|endoftext|"[:-1] + " <|end|>")  # only the whole string is special


def test_bpe_training_on_documents_ignores_the_separator_text(text):
    """Training with the separator as a special token learns what training on each document apart
    would: the merges of the joined corpus equal those of the documents separated by a chunk
    boundary that no merge crosses ('\\x00', which the pattern makes a chunk of its own)."""
    docs = _documents(text, n=12, size=800)
    with_special = train_bpe(EOT.join(docs), 256 + 80 + 1, special_tokens=[EOT])
    never_paired = r"\x00|" + GPT2_SPLIT_PATTERN.replace(r"[^\s\p{L}\p{N}]", r"[^\s\p{L}\p{N}\x00]")
    assert never_paired != r"\x00|" + GPT2_SPLIT_PATTERN
    apart = train_bpe("\x00".join(docs), 256 + 80 + 1, pat_str=never_paired)
    assert with_special.merges == apart.merges[:80]


def test_bpe_overlapping_special_tokens_longest_first():
    tok = train_bpe("hello world " * 10, 256 + 5, special_tokens=["<|a|>", "<|a|><|a|>"])
    one, two = tok.special_tokens["<|a|>"], tok.special_tokens["<|a|><|a|>"]
    assert (one, two) == (259, 260) and tok.vocab_size == 261
    assert tok.encode("hi<|a|><|a|>") == tok.encode("hi") + [two]
    assert tok.encode("<|a|><|a|><|a|>") == [two, one]
    assert tok.encode("<|a|>x<|a|>") == [one] + tok.encode("x") + [one]
    for s in ("<|a|><|a|><|a|>", "x<|a|>y", "<|a|", "|a|>"):
        assert tok.decode(tok.encode(s)) == s


def test_bpe_special_tokens_match_tiktoken(text, gpt2):
    """The same merges and special tokens in tiktoken's own Encoding (allowed_special="all", the way
    GPT-2's <|endoftext|> is encoded): the same ids and the same text back. And GPT-2's tokenizer
    itself obeys the rule ours follows: text, separator, text = their encodings side by side."""
    import tiktoken

    tok = train_bpe(EOT.join(_documents(text)), 256 + 150 + 2, special_tokens=[EOT, "<|pad|>"])
    enc = tiktoken.Encoding(name="taught", pat_str=tok.pat_str, mergeable_ranks=tok.mergeable_ranks(),
                            special_tokens=tok.special_tokens)
    held_out = text[-3000:-1500] + EOT + MIXED + EOT + EOT + "<|pad|>" + text[-1500:] + EOT
    ids = tok.encode(held_out)
    assert ids == enc.encode(held_out, allowed_special="all")
    assert tok.decode(ids) == enc.decode(ids) == held_out
    a, b = " the end.", "A new document"
    assert gpt2.encode(a + EOT + b, allowed_special="all") == gpt2.encode(a) + [gpt2.eot_token] + gpt2.encode(b)
    assert tok.encode(a + EOT + b) == tok.encode(a) + [tok.special_tokens[EOT]] + tok.encode(b)


def test_bpe_special_tokens_save_load_and_validation(tmp_path):
    tok = train_bpe("the cat sat on the mat", 256 + 6 + 1, special_tokens=[EOT])
    tok.save(tmp_path / "bpe.json")
    again = load_tokenizer(tmp_path / "bpe.json")
    assert again == tok and again.special_tokens == {EOT: 262}
    assert again.encode("the mat" + EOT) == tok.encode("the mat" + EOT)
    assert tok != BPETokenizer(tok.merges, tok.pat_str)  # the special tokens are part of the tokenizer
    assert "special_tokens" not in BPETokenizer(tok.merges).to_dict()  # older files: unchanged
    assert repr(tok) == "BPETokenizer(vocab_size=263, merges=6, special_tokens=['<|endoftext|>'])"
    with pytest.raises(ValueError, match="duplicates"):
        BPETokenizer([], special_tokens=[EOT, EOT])
    with pytest.raises(ValueError, match="non-empty"):
        BPETokenizer([], special_tokens=[""])
    with pytest.raises(TypeError, match="list of strings"):
        BPETokenizer([], special_tokens=EOT)
    with pytest.raises(ValueError, match=r"at least 256 .* \+ 2"):
        train_bpe("abc", 257, special_tokens=["<a>", "<b>"])
