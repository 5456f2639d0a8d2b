"""The decoding settings as one object: :class:`GenerationConfig`, checked once when it is built.

Where this sits: logits -> *samples*. Every decoder of :mod:`gptlab.generation` (:func:`generate`,
:func:`stream`, :func:`beam_search`, :func:`speculative_generate`) and ``python -m gptlab sample``
run from a :class:`GenerationConfig`; the keyword arguments those functions take
(``generate(model, idx, 20, temperature=0.8)``) are a convenience that builds one, in one place
(:meth:`GenerationConfig.build`). The anchor is Hugging Face's ``transformers.GenerationConfig``:
the same field names (``max_new_tokens``, ``eos_token_id``, ``pad_token_id``, ``use_cache``,
``num_beams``, ``length_penalty``, ``early_stopping``), with the logits settings (temperature,
top-k, top-p, min-p, the penalties) grouped in a nested :class:`gptlab.sampling.SamplingConfig`.

What a setting means is checked here (a type, a range); what depends on the model (an id below
the vocabulary size) is checked when a decoder runs with a model.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..kvcache import CACHE_IMPLS
from ..sampling import SamplingConfig

__all__ = ["GenerationConfig", "as_token_id", "eos_tensor", "check_pad"]

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingConfig))
VERIFICATIONS = ("token", "block")  # how speculative decoding judges a round's guesses (speculative_step)


def as_token_id(x: Any) -> int | None:
    """``x`` as a Python int if it is one token id: an int, a NumPy integer, or a 0-d integer
    tensor or array (what ``tokenizer(...)`` and ``model.config`` hand out); None otherwise. A bool
    is not an id."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, Tensor):
        integer = not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
        return int(x.item()) if x.ndim == 0 and integer else None
    if isinstance(x, np.ndarray):
        return int(x.item()) if x.ndim == 0 and x.dtype.kind in "iu" else None
    return int(x) if isinstance(x, numbers.Integral) else None


def _eos_ids(eos_token_id: Any) -> tuple[int, ...] | None:
    """One id or a non-empty sequence of ids (list, tuple, 1-d tensor or array), as a tuple of ints."""
    if eos_token_id is None:
        return None
    one = as_token_id(eos_token_id)
    if one is not None:
        return (one,)
    many = isinstance(eos_token_id, (list, tuple)) or (
        isinstance(eos_token_id, (Tensor, np.ndarray)) and eos_token_id.ndim == 1)
    ids = [as_token_id(i) for i in eos_token_id] if many else []
    if not ids or None in ids:
        raise TypeError(f"eos_token_id must be an int or a non-empty sequence of ints, got {eos_token_id!r}")
    return tuple(ids)


def eos_tensor(eos_token_id: tuple[int, ...] | None, vocab_size: int, device) -> Tensor | None:
    """A config's end-of-sequence ids as a tensor (n,) int64 on ``device``, each checked to be in
    [0, vocab_size); None when there are none."""
    if eos_token_id is None:
        return None
    for i in eos_token_id:
        if not 0 <= i < vocab_size:
            raise ValueError(f"eos_token_id must be in [0, {vocab_size}) (the vocabulary), got {i}")
    return torch.tensor(eos_token_id, dtype=torch.long, device=device)


def check_pad(pad_token_id: int | None, vocab_size: int) -> int | None:
    """A config's ``pad_token_id`` checked to be in [0, vocab_size)."""
    if pad_token_id is not None and not 0 <= pad_token_id < vocab_size:
        raise ValueError(f"pad_token_id must be in [0, {vocab_size}), got {pad_token_id}")
    return pad_token_id


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode: every setting of :func:`gptlab.generate` and its siblings, checked once.

    Args:
        max_new_tokens: tokens to add (an int >= 0; beam search needs >= 1). ``None``: not set
            here, given to the call instead (``generate(model, idx, 20, config)``).
        sampling: the logits settings (:class:`gptlab.sampling.SamplingConfig`: temperature, 0 =
            greedy; top_k, top_p, min_p; repetition, frequency and presence penalties).
        eos_token_id: an id or ids that end a row (kept as a tuple of ints); each must be below
            the model's vocabulary size. A finished row emits ``pad_token_id`` from then on.
        pad_token_id: what a finished row emits (default: the first eos id).
        use_cache: keep a KV cache (False: recompute the whole context every step).
        cache: the cache's kind, one of :data:`gptlab.kvcache.CACHE_IMPLS` (``"static"``:
            pre-allocated, the default; ``"concat"``; ``"sliding"`` for sliding-window models).
        fast: on a CPU, run the decode steps' products on packed weights where that is faster on
            this machine (:mod:`gptlab.fast.cpu`), and a batch-1 decode's one-token steps through
            the C++ decode step where it was built (:mod:`gptlab.fast.native`, ``python -m gptlab
            build-native``); False runs the model's own layers, in Python.
        compile: run the model's decode steps through ``torch.compile``
            (:mod:`gptlab.fast.compiled`): the GPU's fast path; on a CPU it needs a C++ compiler
            and pays only where ``python -m gptlab bench generate --compile`` says so. The first
            call compiles (seconds to a minute). With ``compile``, ``fast`` packs nothing (the
            compiled graph multiplies by the model's own weights).
        num_beams: beams of :func:`gptlab.beam_search` (1 for every other decoder).
        length_penalty: beam search's exponent of the length in a finished hypothesis's score
            ``sum_logprobs / generated_len ** length_penalty`` (a finite number).
        early_stopping: beam search's stopping rule, Hugging Face's three: ``False`` (the
            heuristic), ``True`` (stop at ``num_beams`` finished hypotheses), ``"never"``.
        num_draft_tokens: speculative decoding's guesses per round (Hugging Face's
            ``num_assistant_tokens``), an int >= 1.
        verification: how speculative decoding judges a round's guesses when it samples:
            ``"token"`` (one by one, stopping at the first rejection: Leviathan et al.) or
            ``"block"`` (as one block: Sun et al., ICLR 2025; as exact, and it keeps more guesses
            the longer the round). See :func:`gptlab.generation.speculative.speculative_step`.

    A wrong type raises ``TypeError`` and a value out of range ``ValueError``, each naming the
    setting, what was expected and what was given. :meth:`replace` returns a copy with some
    settings changed (the sampling ones by their own names: ``config.replace(temperature=0)``).
    """

    max_new_tokens: int | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_id: tuple[int, ...] | None = None
    pad_token_id: int | None = None
    use_cache: bool = True
    cache: str = "static"
    fast: bool = True
    compile: bool = False
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_draft_tokens: int = 4
    verification: str = "token"

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"max_new_tokens must be an int >= 0, got {n!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError(f"sampling must be a gptlab.sampling.SamplingConfig, got {type(self.sampling).__name__}")
        object.__setattr__(self, "eos_token_id", _eos_ids(self.eos_token_id))
        if self.pad_token_id is not None:
            pad = as_token_id(self.pad_token_id)
            if pad is None:
                raise TypeError(f"pad_token_id must be an int, got {type(self.pad_token_id).__name__} "
                                f"{self.pad_token_id!r}")
            object.__setattr__(self, "pad_token_id", pad)
        object.__setattr__(self, "use_cache", _check_bool(self.use_cache, "use_cache"))
        if self.cache not in CACHE_IMPLS:
            raise ValueError(f"cache must be one of {CACHE_IMPLS}, got {self.cache!r}")
        object.__setattr__(self, "fast", _check_bool(self.fast, "fast"))
        object.__setattr__(self, "compile", _check_bool(self.compile, "compile"))
        nb = self.num_beams
        if isinstance(nb, bool) or not isinstance(nb, int) or nb < 1:
            raise ValueError(f"num_beams must be an int >= 1, got {nb!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, numbers.Real):
            raise TypeError(f"length_penalty must be a real number, got {type(lp).__name__} {lp!r}")
        if not math.isfinite(float(lp)):  # NaN or inf would make every score NaN or 0: no ranking at all
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")
        object.__setattr__(self, "length_penalty", float(lp))
        es = self.early_stopping
        if not (es is True or es is False or (isinstance(es, str) and es == "never")):
            raise ValueError(f"early_stopping must be True, False or 'never', got {es!r}")
        g = self.num_draft_tokens
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"num_draft_tokens must be an int >= 1, got {g!r}")
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification must be 'token' or 'block', got {self.verification!r}")

    @property
    def packs(self) -> bool:
        """Whether the call packs the CPU products (:mod:`gptlab.fast.cpu`): ``fast`` and not
        ``compile``."""
        return self.fast and not self.compile

    def replace(self, **settings: Any) -> GenerationConfig:
        """A copy with ``settings`` changed, checked again. A setting is a field of this class or
        of :class:`gptlab.sampling.SamplingConfig` (``temperature=0`` changes ``sampling``); an
        unknown name raises ``TypeError`` listing the known ones."""
        sampling = {k: settings.pop(k) for k in list(settings) if k in _SAMPLING_FIELDS}
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            known = sorted({f.name for f in dataclasses.fields(self)} - {"sampling"} | set(_SAMPLING_FIELDS))
            raise TypeError(f"unknown decoding setting(s) {unknown}; the settings are {known}")
        if sampling:
            base = settings.get("sampling", self.sampling)
            if not isinstance(base, SamplingConfig):
                raise TypeError(f"sampling must be a gptlab.sampling.SamplingConfig, got {type(base).__name__}")
            settings["sampling"] = dataclasses.replace(base, **sampling)
        return dataclasses.replace(self, **settings) if settings else self

    @classmethod
    def build(cls, config: GenerationConfig | None = None, max_new_tokens: int | None = None,
              **settings: Any) -> GenerationConfig:
        """The config a decoding call runs with: ``config`` (default: ``GenerationConfig()``), with
        ``max_new_tokens`` when given (not None) and every keyword setting in ``settings`` replacing
        its value (:meth:`replace`). The one place where keyword arguments become a config."""
        if config is None:
            config = cls()
        elif not isinstance(config, cls):
            raise TypeError(f"config must be a gptlab GenerationConfig, got {type(config).__name__}")
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        return config.replace(**settings)

    def needs_max_new_tokens(self, least: int = 0, what: str = "") -> int:
        """``max_new_tokens``, checked to be set and ``>= least`` (``what``: for which decoder)."""
        n = self.max_new_tokens
        if n is None or n < least:
            raise ValueError(f"max_new_tokens must be an int >= {least}{what}, got {n!r}")
        return n
