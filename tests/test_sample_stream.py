"""``python -m gptlab sample`` streams text at a cost per token that does not grow with the text
(issue 34: printing alone took 22 s for 20,000 tokens, each token re-decoding the whole text), and
the streamed text is exactly the decoded tokens, characters split across byte-level BPE tokens
included."""

from __future__ import annotations

import random

import pytest
import torch

from gptlab import GPT, GPTConfig
from gptlab.__main__ import main
from gptlab.cli import TextStream
from gptlab.tokenizers import BPETokenizer, CharTokenizer, train_bpe
from gptlab.train.checkpoint import save_checkpoint

TEXT = "Grüße aus Köln! 日本語のテキスト, ελληνικά, emoji 🙂🙃 and plain ASCII. " * 3


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return train_bpe(TEXT, 300)


def test_text_stream_joins_to_the_decoded_text_whatever_the_split(bpe):
    """Random ids over the whole vocabulary (single bytes of split characters, invalid sequences):
    the pieces, joined, are the one-shot decode, U+FFFD where that has one."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(bpe.vocab_size) for _ in range(rng.randrange(1, 40))]
        stream = TextStream(bpe)
        pieces = [stream.add([i]) for i in ids] + [stream.flush()]
        assert "".join(pieces) == bpe.decode(ids)


def test_text_stream_holds_back_a_split_character(bpe):
    """A character whose bytes come in several tokens is printed once whole, never as U+FFFD."""
    ids = [b for b in "日本🙂".encode("utf-8")]  # one token per byte: every character split
    stream = TextStream(bpe)
    pieces = [stream.add([i]) for i in ids] + [stream.flush()]
    assert [p for p in pieces if p] == ["日", "本", "🙂"]


def test_text_stream_of_characters_keeps_a_real_replacement_character():
    """A character tokenizer whose vocabulary holds U+FFFD: held back a while, never lost."""
    tok = CharTokenizer(["a", "\ufffd"])
    stream = TextStream(tok)
    ids = [0, 1, 0, 1, 1]
    assert "".join([stream.add([i]) for i in ids] + [stream.flush()]) == tok.decode(ids)


class _Counting(CharTokenizer):
    """A character tokenizer that counts the ids it decodes."""

    decoded = 0

    def decode(self, ids):
        ids = list(ids)
        _Counting.decoded += len(ids)
        return super().decode(ids)


def test_sample_decodes_each_token_once(tmp_path, monkeypatch, capsys):
    """The work per streamed token is constant: 1,500 tokens decode about 1,500 ids, not the
    1,100,000 that re-decoding the whole text each token costs."""
    import gptlab.cli

    tok = CharTokenizer.from_text("abcdefgh\n")
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "c", GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2,
                                                  n_embd=16)), tokenizer=tok)
    real = gptlab.cli.load_model

    def load_counting(path, device=None):
        model, t = real(path, device=device)
        return model, _Counting(list(t.chars))

    monkeypatch.setattr(gptlab.cli, "load_model", load_counting)
    _Counting.decoded = 0
    n = 1500
    assert main(["sample", "--ckpt", str(tmp_path / "c"), "--prompt", "abc", "--max-new-tokens", str(n),
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert len(out) == 3 + n + 1
    assert _Counting.decoded <= 2 * (n + 3), _Counting.decoded


def test_sample_streams_exactly_the_generated_tokens(bpe, tmp_path, monkeypatch, capsys):
    """With a byte-level BPE checkpoint (characters split across tokens), the streamed output is
    the decode of the prompt and the tokens the model generated."""
    import gptlab.cli

    torch.manual_seed(0)
    save_checkpoint(tmp_path / "b", GPT(GPTConfig(vocab_size=bpe.vocab_size, block_size=64, n_layer=1, n_head=2,
                                                  n_embd=16)), tokenizer=bpe)
    got: list[int] = []
    real = gptlab.cli.stream

    def recording(*a, **k):
        for t in real(*a, **k):
            got.append(int(t[0, 0]))
            yield t

    monkeypatch.setattr(gptlab.cli, "stream", recording)
    assert main(["sample", "--ckpt", str(tmp_path / "b"), "--prompt", "Köln 日本", "--max-new-tokens", "300",
                 "--temperature", "1.5", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert len(got) == 300
    assert out == bpe.decode(bpe.encode("Köln 日本") + got) + "\n"
