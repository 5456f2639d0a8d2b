"""Tokenizers: turn text into integer token ids and back.

Where this sits: text -> *tokens* -> batches -> model -> logits -> loss or samples -> *text*.

Three tokenizers, one interface (``encode(str) -> list[int]``, ``decode(ids) -> str``,
``vocab_size``, ``to_dict()``; :func:`tokenizer_from_dict` rebuilds any of them):

* :class:`CharTokenizer`: one id per distinct character (the Tiny Shakespeare chapters, 65 ids).
* :class:`GPT2Tokenizer`: OpenAI's GPT-2 byte-level BPE (50,257 ids) through ``tiktoken``, built
  from the verified ``vocab.bpe`` / ``encoder.json`` files so it works offline.
* :class:`BPETokenizer` + :func:`train_bpe`: a small byte-level BPE trainer written for reading,
  whose ordered ``merges`` a chapter can print (checked against ``tiktoken._educational``), with
  optional special tokens (``<|endoftext|>`` and the like): kept whole, never merged with the text
  around them, encoded to ids of their own after the merges' ids, as GPT-2 does.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .assets import ASSETS, atomic_write_json, fetch, sha256_file

__all__ = [
    "CharTokenizer",
    "GPT2Tokenizer",
    "BPETokenizer",
    "train_bpe",
    "tokenizer_from_dict",
    "load_tokenizer",
    "GPT2_SPLIT_PATTERN",
]

# GPT-2's pre-tokenization regex, in tiktoken's faster equivalent form (``r50k_pat_str``). The
# original release wrote it ``'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+``.
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def _as_id_list(ids: Any) -> list[int]:
    """Accept a list/tuple of ints, a 1-D numpy array or a 1-D torch tensor; return list[int]."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):
        if getattr(ids, "ndim", 1) != 1:
            raise ValueError(f"decode expects a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"decode expects a sequence of int token ids, got {type(ids).__name__}")
    out = list(ids)
    for i in out:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"token ids must be ints, got {i!r} ({type(i).__name__})")
    return out


def _check_text(text: Any) -> str:
    if not isinstance(text, str):
        raise TypeError(f"encode expects a str, got {type(text).__name__}")
    return text


def _read_json(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


_T = TypeVar("_T", bound="_SavedAsJSON")


class _SavedAsJSON:
    """``save`` and ``load`` for a tokenizer written whole as its ``to_dict()`` (and rebuilt by its
    ``from_dict``): the character-level one and the trained BPE, whose files are small."""

    def save(self, path: str | os.PathLike) -> Path:
        """Write the vocabulary as JSON, atomically."""
        return atomic_write_json(path, self.to_dict())  # type: ignore[attr-defined]

    @classmethod
    def load(cls: type[_T], path: str | os.PathLike) -> _T:
        return cls.from_dict(_read_json(path))  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# Character level
# --------------------------------------------------------------------------------------------

class CharTokenizer(_SavedAsJSON):
    """One token per character; ids follow the order of ``chars`` (sorted when built from text).

    >>> tok = CharTokenizer.from_text("hello")
    >>> tok.chars, tok.encode("hole"), tok.decode([1, 2, 3, 3, 4])
    (['e', 'h', 'l', 'o'], [1, 3, 2, 0], 'hello')
    """

    def __init__(self, chars: Sequence[str]):
        if isinstance(chars, str):
            chars = list(chars)
        chars = list(chars)
        for c in chars:
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(f"CharTokenizer vocabulary entries must be single characters, got {c!r}")
        if len(set(chars)) != len(chars):
            dups = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"CharTokenizer vocabulary has repeated characters: {dups!r}")
        if not chars:
            raise ValueError("CharTokenizer needs at least one character")
        self.chars: list[str] = chars
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(chars)}
        self.itos: dict[int, str] = dict(enumerate(chars))

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """Vocabulary = the sorted distinct characters of ``text`` (nanoGPT's convention)."""
        return cls(sorted(set(_check_text(text))))

    fit = from_text

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """``text`` (length T) -> T token ids. Raises ValueError naming an unknown character."""
        stoi = self.stoi
        try:
            return [stoi[c] for c in _check_text(text)]
        except KeyError as e:
            c = e.args[0]
            raise ValueError(
                f"character {c!r} (U+{ord(c):04X}) at position {text.index(c)} is not in the "
                f"tokenizer's vocabulary of {self.vocab_size} characters"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids (list, 1-D array or tensor) -> text. Raises ValueError on an id out of range."""
        itos = self.itos
        ids = _as_id_list(ids)
        try:
            return "".join(itos[i] for i in ids)
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is out of range for vocab_size {self.vocab_size}") from None

    def to_dict(self) -> dict:
        return {"type": "char", "chars": list(self.chars)}

    @classmethod
    def from_dict(cls, d: dict) -> "CharTokenizer":
        if not isinstance(d, dict) or d.get("type") != "char" or "chars" not in d:
            raise ValueError(f"expected a dict with type 'char' and 'chars', got {d!r:.200}")
        return cls(d["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, chars={''.join(self.chars)!r:.60})"


# --------------------------------------------------------------------------------------------
# GPT-2 BPE (tiktoken)
# --------------------------------------------------------------------------------------------

_GPT2_ENCODINGS: dict[tuple[str, str], Any] = {}


@contextlib.contextmanager
def _tiktoken_no_cache():
    """tiktoken copies the files it reads into a cache unless TIKTOKEN_CACHE_DIR is ''."""
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


def _check_gpt2_file(path: str, asset_name: str) -> None:
    """``path`` holds GPT-2's file (its sha256 is the asset's): tiktoken, told not to cache, checks
    no hash, and a wrong file fails inside it with a bare AssertionError or loads other merges."""
    asset = ASSETS[asset_name]
    got = sha256_file(path)
    if got != asset.sha256:
        raise ValueError(f"{path}: sha256 {got}, expected {asset.sha256}: not GPT-2's "
                         f"{Path(asset.filename).name} (a damaged or different file)")


def _gpt2_encoding(vocab_bpe: str, encoder_json: str):
    key = (vocab_bpe, encoder_json)
    if key not in _GPT2_ENCODINGS:
        import tiktoken
        import tiktoken.load

        _check_gpt2_file(vocab_bpe, "gpt2-vocab-bpe")
        _check_gpt2_file(encoder_json, "gpt2-encoder-json")
        with _tiktoken_no_cache():
            ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
                vocab_bpe, encoder_json,
                vocab_bpe_hash=ASSETS["gpt2-vocab-bpe"].sha256,
                encoder_json_hash=ASSETS["gpt2-encoder-json"].sha256,
            )
        _GPT2_ENCODINGS[key] = tiktoken.Encoding(
            name="gpt2", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257,
        )
    return _GPT2_ENCODINGS[key]


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50,257 ids, ``<|endoftext|>`` = 50256) via ``tiktoken``.

    Built from the sha256-verified ``vocab.bpe`` and ``encoder.json`` (fetched through
    :func:`gptlab.assets.fetch`, so it works offline), not from ``tiktoken.get_encoding``. Files
    given by path are checked too: one whose sha256 is not GPT-2's raises ``ValueError`` naming it
    and the expected sha256.
    """

    eot_token: int = 50256

    def __init__(self, vocab_bpe: str | os.PathLike | None = None,
                 encoder_json: str | os.PathLike | None = None, *, quiet: bool = False):
        vocab_bpe = str(vocab_bpe or fetch(ASSETS["gpt2-vocab-bpe"], quiet=quiet))
        encoder_json = str(encoder_json or fetch(ASSETS["gpt2-encoder-json"], quiet=quiet))
        self.encoding = _gpt2_encoding(vocab_bpe, encoder_json)

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    n_vocab = vocab_size

    def encode(self, text: str, *, allowed_special: Any = frozenset(),
               disallowed_special: Any = "all") -> list[int]:
        """Text -> token ids. Special tokens in ``text`` raise unless ``allowed_special`` ("all")."""
        return self.encoding.encode(_check_text(text), allowed_special=allowed_special,
                                    disallowed_special=disallowed_special)

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text (invalid UTF-8 byte sequences become U+FFFD)."""
        ids = _as_id_list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for vocab_size {self.vocab_size}")
        return self.encoding.decode(ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for."""
        return self.encoding.decode_single_token_bytes(token_id)

    def to_dict(self) -> dict:
        return {"type": "gpt2"}

    @classmethod
    def from_dict(cls, d: dict) -> "GPT2Tokenizer":
        if not isinstance(d, dict) or d.get("type") != "gpt2":
            raise ValueError(f"expected a dict with type 'gpt2', got {d!r:.200}")
        return cls()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GPT2Tokenizer)

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------------------------
# A byte-level BPE trainer for teaching
# --------------------------------------------------------------------------------------------

def _show(b: bytes) -> str:
    """Readable rendering of a token's bytes: the text if valid UTF-8, else escaped bytes."""
    try:
        return repr(b.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(b)[1:]  # b'\xe2\x80' -> '\xe2\x80'


def _check_special_tokens(special_tokens: Any) -> list[str]:
    """A list of distinct non-empty strings (None: no special token)."""
    if special_tokens is None:
        return []
    if isinstance(special_tokens, (str, bytes)) or not isinstance(special_tokens, Iterable):
        raise TypeError(f"special_tokens must be a list of strings, got {type(special_tokens).__name__}")
    out = list(special_tokens)
    for t in out:
        if not isinstance(t, str) or not t:
            raise ValueError(f"a special token must be a non-empty str, got {t!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"special_tokens has duplicates: {out!r}")
    return out


def _special_splitter(special_tokens: Sequence[str]):
    """A compiled regex whose ``split`` cuts text around the special tokens and keeps them (the
    longest first where one contains another: ``<|a|><|a|>`` before ``<|a|>``); None if none."""
    import regex

    if not special_tokens:
        return None
    alternatives = sorted(special_tokens, key=len, reverse=True)
    return regex.compile("(" + "|".join(regex.escape(t) for t in alternatives) + ")")


class BPETokenizer(_SavedAsJSON):
    """Byte-level BPE: ids 0..255 are the bytes, then one new id per merge, in order, then one id
    per special token.

    Args:
        merges: ordered ``[((left_id, right_id), new_id), ...]``; ``new_id`` must be
            ``256 + position`` (the i-th merge creates id 256 + i).
        pat_str: the regex that first splits text into chunks; merges never cross chunks.
        special_tokens: strings kept whole (``["<|endoftext|>"]``, say), with the ids
            ``256 + len(merges)``, ``256 + len(merges) + 1``, ... in the order given. ``encode``
            cuts the text at every occurrence (the longest special token first where two overlap),
            encodes the pieces between them as usual and each occurrence as its id, so a special
            token is never merged with its neighbours (what tiktoken does with ``allowed_special``);
            ``decode`` writes it back as its text.

    Attributes:
        merges: the ordered merges as given.
        special_tokens: ``dict[str, id]``.
        vocab: ``dict[id, bytes]`` for every id (a special token's: its UTF-8 text).
    """

    def __init__(self, merges: Sequence[tuple[tuple[int, int], int]], pat_str: str = GPT2_SPLIT_PATTERN,
                 special_tokens: Sequence[str] | None = None):
        import regex

        self.pat_str = pat_str
        self._pat = regex.compile(pat_str)
        self.merges: list[tuple[tuple[int, int], int]] = []
        self.vocab: dict[int, bytes] = {i: bytes([i]) for i in range(256)}
        self.ranks: dict[tuple[int, int], int] = {}
        for k, m in enumerate(merges):
            try:
                (a, b), new = m
                a, b, new = int(a), int(b), int(new)
            except (TypeError, ValueError):
                raise ValueError(f"merge {k} must be ((left_id, right_id), new_id), got {m!r}") from None
            if new != 256 + k:
                raise ValueError(f"merge {k} must create id {256 + k}, got {new}")
            if a not in self.vocab or b not in self.vocab:
                raise ValueError(f"merge {k} uses an id not defined before it: ({a}, {b})")
            if (a, b) in self.ranks:
                raise ValueError(f"merge {k} repeats the pair ({a}, {b})")
            self.merges.append(((a, b), new))
            self.ranks[(a, b)] = new
            self.vocab[new] = self.vocab[a] + self.vocab[b]
        first = 256 + len(self.merges)
        specials = _check_special_tokens(special_tokens)
        self.special_tokens: dict[str, int] = {t: first + k for k, t in enumerate(specials)}
        for t, i in self.special_tokens.items():
            self.vocab[i] = t.encode("utf-8")
        self._special = _special_splitter(specials)
        self._chunk_cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.merges) + len(self.special_tokens)

    def mergeable_ranks(self) -> dict[bytes, int]:
        """``{token bytes: id}`` of the bytes and the merges (the special tokens apart), the format of
        ``tiktoken`` (raises if two ids share bytes)."""
        n = 256 + len(self.merges)
        out = {b: i for i, b in self.vocab.items() if i < n}
        if len(out) != n:
            raise ValueError("two token ids have the same bytes; no tiktoken-style rank table exists")
        return out

    def _encode_chunk(self, chunk: bytes) -> list[int]:
        ids = list(chunk)
        ranks = self.ranks
        while len(ids) >= 2:
            # the adjacent pair that was merged earliest during training is merged first
            best = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, 1 << 62))
            new = ranks.get(best)
            if new is None:
                break
            out, i = [], 0
            while i < len(ids):
                if i + 1 < len(ids) and ids[i] == best[0] and ids[i + 1] == best[1]:
                    out.append(new)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            ids = out
        return ids

    def encode(self, text: str) -> list[int]:
        """Text -> ids: cut at the special tokens (each becomes its id), split the text between them
        with ``pat_str``, then apply the merges inside each chunk."""
        _check_text(text)
        if self._special is None:
            return self._encode_ordinary(text)
        out: list[int] = []
        for k, piece in enumerate(self._special.split(text)):
            if k % 2:  # split() puts the special tokens it cut at (its captured group) at the odd places
                out.append(self.special_tokens[piece])
            elif piece:
                out.extend(self._encode_ordinary(piece))
        return out

    def _encode_ordinary(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._chunk_cache
        for chunk in self._pat.findall(text):
            ids = cache.get(chunk)
            if ids is None:
                ids = self._encode_chunk(chunk.encode("utf-8"))
                if len(cache) < 100_000:
                    cache[chunk] = ids
            out.extend(ids)
        return out

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        try:
            return b"".join(self.vocab[i] for i in _as_id_list(ids))
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is out of range for vocab_size {self.vocab_size}") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text (a token sequence that splits a character decodes to U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def render_merge(self, k: int) -> str:
        """A readable line for the k-th merge, e.g. ``merge 0: 'e' + ' ' -> 'e ' (id 256)``."""
        (a, b), new = self.merges[k]
        return f"merge {k}: {_show(self.vocab[a])} + {_show(self.vocab[b])} -> {_show(self.vocab[new])} (id {new})"

    def render_merges(self, limit: int | None = None) -> list[str]:
        """:meth:`render_merge` for the first ``limit`` merges (all if None)."""
        n = len(self.merges) if limit is None else min(limit, len(self.merges))
        return [self.render_merge(k) for k in range(n)]

    def to_dict(self) -> dict:
        d = {"type": "bpe", "pat_str": self.pat_str, "merges": [[a, b, new] for (a, b), new in self.merges]}
        if self.special_tokens:
            d["special_tokens"] = list(self.special_tokens)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BPETokenizer":
        if not isinstance(d, dict) or d.get("type") != "bpe" or "merges" not in d:
            raise ValueError(f"expected a dict with type 'bpe' and 'merges', got {d!r:.200}")
        return cls([((a, b), new) for a, b, new in d["merges"]], d.get("pat_str", GPT2_SPLIT_PATTERN),
                   d.get("special_tokens"))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BPETokenizer) and self.merges == other.merges and self.pat_str == other.pat_str
                and self.special_tokens == other.special_tokens)

    def __repr__(self) -> str:
        special = f", special_tokens={list(self.special_tokens)!r}" if self.special_tokens else ""
        return f"BPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}{special})"


def train_bpe(text: str, vocab_size: int, *, pat_str: str = GPT2_SPLIT_PATTERN,
              special_tokens: Sequence[str] | None = None, verbose: bool = False) -> BPETokenizer:
    """Learn ``vocab_size - 256 - len(special_tokens)`` byte-pair merges from ``text``.

    ``special_tokens`` (``["<|endoftext|>"]``, say, the separator between documents) are part of
    the vocabulary (``vocab_size`` counts them, as Stanford CS336's trainer does) but of no merge:
    the text is first cut at every occurrence (the longest first where two overlap) and only the
    pieces between them are trained on, so no merge crosses a document boundary and nothing is
    learned from a special token's own characters. They get the ids after the merges', in the order
    given (:class:`BPETokenizer`).

    The algorithm: split the text into chunks with ``pat_str``; write every chunk as its UTF-8
    bytes (ids 0..255); then repeatedly count all adjacent pairs of ids inside chunks, and
    replace the most frequent pair everywhere by a new id (256, 257, ...). Ties go to the pair
    seen first when reading the text, as in ``tiktoken._educational.bpe_train``, whose result
    this reproduces id for id.

    Counting is done once per distinct chunk (weighted by how often it occurs) and updated only
    for the chunks a merge touches, so a few hundred merges on Tiny Shakespeare take seconds.
    Training stops early if no pair is left to merge (every chunk a single token).
    """
    import regex

    _check_text(text)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    specials = _check_special_tokens(special_tokens)
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size must be at least 256 (one id per byte) + {len(specials)} (the special "
                         f"tokens), got {vocab_size}")

    # the text between the special tokens (they are left out), then its distinct chunks in order of
    # first appearance, with their counts
    splitter = _special_splitter(specials)
    pieces = splitter.split(text)[::2] if splitter is not None else [text]
    freq: dict[str, int] = {}
    for piece in pieces:
        for chunk in regex.findall(pat_str, piece):
            freq[chunk] = freq.get(chunk, 0) + 1
    words: list[list[int]] = [list(c.encode("utf-8")) for c in freq]
    counts: list[int] = list(freq.values())

    stats: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for w, (ids, n) in enumerate(zip(words, counts)):
        for p in zip(ids, ids[1:]):
            stats[p] = stats.get(p, 0) + n
            where.setdefault(p, set()).add(w)

    merges: list[tuple[tuple[int, int], int]] = []
    for new in range(256, vocab_size - len(specials)):
        if not stats:
            break
        top = max(stats.values())
        tied = {p for p, c in stats.items() if c == top}
        if len(tied) == 1:
            pair = next(iter(tied))
        else:  # the tied pair that occurs first in the text
            pair = next(p for ids in words for p in zip(ids, ids[1:]) if p in tied)
        merges.append((pair, new))
        a, b = pair
        for w in sorted(where.pop(pair)):
            ids, n = words[w], counts[w]
            for p in zip(ids, ids[1:]):  # remove this chunk's old pairs ...
                stats[p] -= n
                if stats[p] == 0:
                    del stats[p]
            out, i = [], 0
            while i < len(ids):
                if i + 1 < len(ids) and ids[i] == a and ids[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            words[w] = out
            for p in zip(out, out[1:]):  # ... and add its new ones
                stats[p] = stats.get(p, 0) + n
                where.setdefault(p, set()).add(w)
        if verbose:
            tok = BPETokenizer(merges, pat_str)
            print(tok.render_merge(len(merges) - 1), f"(count {top})")
    return BPETokenizer(merges, pat_str, specials)


# --------------------------------------------------------------------------------------------

_TYPES = {"char": CharTokenizer, "gpt2": GPT2Tokenizer, "bpe": BPETokenizer}


def tokenizer_from_dict(d: dict) -> CharTokenizer | GPT2Tokenizer | BPETokenizer:
    """Rebuild a tokenizer from its ``to_dict()`` (as stored in checkpoints and meta.json)."""
    if not isinstance(d, dict):
        raise TypeError(f"tokenizer_from_dict expects a dict, got {type(d).__name__}")
    kind = d.get("type")
    if kind not in _TYPES:
        raise ValueError(f"unknown tokenizer type {kind!r}; expected one of {sorted(_TYPES)}")
    return _TYPES[kind].from_dict(d)


def load_tokenizer(path: str | os.PathLike) -> CharTokenizer | GPT2Tokenizer | BPETokenizer:
    """Read a tokenizer JSON file written by ``save`` (any type)."""
    return tokenizer_from_dict(_read_json(path))
