"""gptlab.data: nanoGPT's shakespeare_char split, memmaps, batches and the fetch command."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from gptlab.assets import ASSETS, fetch
from gptlab.data import TokenDataset, get_batch, prepare_char_data, shakespeare_text

N_TEXT, N_TRAIN, N_VAL = 1_115_394, 1_003_854, 111_540


@pytest.fixture(scope="module")
def text() -> str:
    return shakespeare_text()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare_char_data(tmp_path_factory.mktemp("shakespeare_char"))


def test_corpus(text):
    assert len(text) == N_TEXT
    assert len(set(text)) == 65
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")


def test_split_counts_and_contents(prepared, text):
    assert prepared.vocab_size == 65
    assert len(prepared.train) == N_TRAIN and len(prepared.val) == N_VAL
    assert prepared.train.dtype == np.uint16 and prepared.val.dtype == np.uint16
    assert isinstance(prepared.train, np.memmap)
    tok = prepared.tokenizer
    assert tok.decode(prepared.train) == text[:N_TRAIN]
    assert tok.decode(prepared.val) == text[N_TRAIN:]
    assert tok.decode(tok.encode(text)) == text
    meta = json.loads((prepared.data_dir / "meta.json").read_text())
    assert meta["vocab_size"] == 65 and meta["train"]["tokens"] == N_TRAIN and meta["val"]["tokens"] == N_VAL
    assert meta["tokenizer"] == tok.to_dict()
    assert (prepared.data_dir / "train.bin").stat().st_size == 2 * N_TRAIN


def test_prepare_is_idempotent_and_repairs(tmp_path):
    d = tmp_path / "sc"
    first = prepare_char_data(d)
    files = {name: (d / name).stat().st_mtime_ns for name in ("train.bin", "val.bin", "meta.json")}
    good_train = np.array(first.train)
    del first
    prepare_char_data(d)
    assert {name: (d / name).stat().st_mtime_ns for name in files} == files  # nothing rewritten

    # corrupt: flip bytes in train.bin (same size) -> detected by sha256 and rebuilt
    raw = bytearray((d / "train.bin").read_bytes())
    raw[1000:1010] = b"\xff" * 10
    (d / "train.bin").write_bytes(bytes(raw))
    assert np.array_equal(prepare_char_data(d).train, good_train)

    # truncated val.bin -> rebuilt
    (d / "val.bin").write_bytes((d / "val.bin").read_bytes()[:100])
    assert len(prepare_char_data(d).val) == N_VAL

    # stale: meta.json from another corpus -> rebuilt
    meta = json.loads((d / "meta.json").read_text())
    meta["source_sha256"] = "0" * 64
    (d / "meta.json").write_text(json.dumps(meta))
    prepare_char_data(d)
    assert json.loads((d / "meta.json").read_text())["source_sha256"] == ASSETS["tinyshakespeare"].sha256
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------- get_batch

def test_get_batch_shapes_shift_and_windows(prepared):
    data = prepared.train
    B, T = 8, 32
    x, y = get_batch(data, B, T, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # replay the generator: row b is data[i:i+T], data[i+1:i+T+1] for the drawn start i
    ix = torch.randint(len(data) - T, (B,), generator=torch.Generator().manual_seed(0))
    for b, i in enumerate(ix.tolist()):
        assert x[b].tolist() == data[i : i + T].tolist()
        assert y[b].tolist() == data[i + 1 : i + T + 1].tolist()


def test_get_batch_deterministic_with_seed(prepared):
    a = get_batch(prepared.val, 4, 16, generator=torch.Generator().manual_seed(123))
    b = get_batch(prepared.val, 4, 16, generator=torch.Generator().manual_seed(123))
    c = get_batch(prepared.val, 4, 16, generator=torch.Generator().manual_seed(124))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_get_batch_tensor_input_and_uniform_starts():
    """Window starts are uniform over all N - T positions (the last target token included)."""
    from scipy.stats import chisquare

    N, T = 20, 4
    data = torch.arange(N) * 3  # distinct values: the start is readable from x[:, 0]
    g = torch.Generator().manual_seed(7)
    x, y = get_batch(data, 16_000, T, generator=g)
    assert torch.equal(y, x + 3)
    starts = (x[:, 0] // 3).numpy()
    counts = np.bincount(starts, minlength=N - T)
    assert len(counts) == N - T and counts.min() > 0  # start N-T-1 reaches the last token
    assert chisquare(counts).pvalue > 1e-3


def test_get_batch_bad_arguments():
    data = np.arange(10, dtype=np.uint16)
    with pytest.raises(ValueError, match="block_size"):
        get_batch(data, 2, 10)
    with pytest.raises(ValueError, match="batch_size"):
        get_batch(data, 0, 4)
    with pytest.raises(TypeError, match="block_size"):
        get_batch(data, 2, 4.0)
    with pytest.raises(ValueError, match="1-D"):
        get_batch(data.reshape(2, 5), 2, 2)
    with pytest.raises(TypeError, match="numpy"):
        get_batch(list(range(10)), 2, 2)
    x, y = get_batch(data, 3, 9)  # the largest legal block_size: a single window
    assert x.tolist() == [list(range(9))] * 3 and y.tolist() == [list(range(1, 10))] * 3


# ---------------------------------------------------------------- TokenDataset

def test_token_dataset():
    data = np.arange(100, dtype=np.uint16)
    ds = TokenDataset(data, 8)
    assert len(ds) == 92
    x, y = ds[5]
    assert x.dtype == torch.int64 and x.tolist() == list(range(5, 13)) and y.tolist() == list(range(6, 14))
    assert ds[-1][1][-1].item() == 99
    with pytest.raises(IndexError):
        ds[92]
    disjoint = TokenDataset(torch.arange(100), 10, stride=10)
    assert len(disjoint) == 9 and disjoint[8][0].tolist() == list(range(80, 90))
    xb, yb = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert xb.shape == (4, 8) and torch.equal(xb[:, 1:], yb[:, :-1])
    with pytest.raises(ValueError, match="block_size"):
        TokenDataset(data, 100)


# ---------------------------------------------------------------- python -m gptlab fetch

def test_fetch_cli(tmp_path, monkeypatch, capsys):
    # seed a fresh cache from verified copies so the command runs offline and quickly
    seed = tmp_path / "seed"
    for name in ("tinyshakespeare", "gpt2-vocab-bpe", "gpt2-encoder-json"):
        a = ASSETS[name]
        (seed / a.filename).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(fetch(a, quiet=True), seed / a.filename)
    monkeypatch.setenv("GPTLAB_SEED_DIR", str(seed))
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "unused"))
    from gptlab.__main__ import main

    assert main(["fetch", "-q", "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    for name in ("tinyshakespeare", "gpt2-vocab-bpe", "gpt2-encoder-json"):
        assert ASSETS[name].sha256 in out
    assert "train 1,003,854 tokens, val 111,540 tokens" in out
    assert "[15496, 995]" in out
    assert (tmp_path / "cache" / "shakespeare_char" / "train.bin").stat().st_size == 2 * N_TRAIN
    assert (tmp_path / "cache" / "gpt2" / "vocab.bpe").is_file()
    assert not (tmp_path / "unused").exists()
    assert main(["fetch", "no-such-asset"]) == 2  # one line, as tests/test_cli_errors.py checks
