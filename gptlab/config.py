"""The model's hyper-parameters: :class:`GPTConfig`, checked when built.

Where this sits: the shape of the *model* (tokens -> model -> logits): sizes, and the variants a
chapter teaches, each a configuration option:

* ``norm``: ``"layernorm"`` (GPT-2, optional bias) or ``"rmsnorm"`` (Llama).
* ``mlp``: ``"gelu"`` (GPT-2's tanh-approximated GELU) or ``"swiglu"`` (Llama).
* ``pos_emb``: ``"learned"`` absolute positions (GPT-2) or ``"rope"`` rotary embeddings (Llama).
* ``n_kv_head``: grouped-query attention (``1`` is multi-query attention).
* ``prenorm``: pre-norm blocks (GPT-2) or post-norm blocks (GPT-1, the original transformer).
* ``window_size``: sliding-window (local) attention.
* ``attn_impl``: ``"sdpa"`` (PyTorch's fused ``scaled_dot_product_attention``) or ``"explicit"``
  (softmax(QK^T / sqrt(d)) V written out, which can keep its attention weights for plotting).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["GPTConfig"]


@dataclass
class GPTConfig:
    """Hyper-parameters of a :class:`GPT`. The defaults are GPT-2 small's shape.

    ``n_kv_head=None`` means ``n_head`` (plain multi-head attention). ``n_inner=None`` means
    ``4 * n_embd`` for the GELU MLP and ``int(8/3 * n_embd)`` rounded up to a multiple of 64 for
    SwiGLU (equal parameter count).
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    n_kv_head: int | None = None
    n_inner: int | None = None
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    pos_emb: str = "learned"
    rope_theta: float = 10000.0
    prenorm: bool = True
    tie_weights: bool = True
    window_size: int | None = None
    attn_impl: str = "sdpa"
    head_dim_override: int | None = field(default=None, repr=False)

    def __post_init__(self):
        """Check every field's type and range (see :func:`_check_field`), then how they combine."""
        for name in _FIELD_RULES:
            object.__setattr__(self, name, _check_field(name, getattr(self, name)))

        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"GPTConfig: {msg}")

        need(
            self.n_embd % self.n_head == 0 or self.head_dim_override is not None,
            f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})",
        )
        kv = self.kv_heads
        need(self.n_head % kv == 0, f"n_head ({self.n_head}) must be divisible by n_kv_head ({kv})")
        if self.pos_emb == "rope":
            need(self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "GPTConfig.from_dict") -> "GPTConfig":
        """The config a dict holds (``to_dict()``'s output, a checkpoint's ``config.json``).

        Fields left out take their defaults; an unknown field is a ``ValueError`` naming it and
        the known ones (a typo or a config from another program must not be dropped silently);
        each value is checked like the constructor's arguments. ``where`` prefixes the messages
        (a file name, say).
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"{where}: a GPTConfig dict expected, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in _FIELD_RULES)
        if unknown:
            raise ValueError(f"{where}: unknown GPTConfig field(s) {unknown}; the fields are {sorted(_FIELD_RULES)}")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        if self.n_inner is not None:
            return self.n_inner
        if self.mlp == "gelu":
            return 4 * self.n_embd
        return 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------ field checks

# Each field's rule: ("int", least value), ("real", low, high, low included, high included: the
# value must also be finite), ("bool",), ("choice", allowed values); optional: None is allowed.
_FIELD_RULES: dict[str, tuple[tuple, bool]] = {
    "vocab_size": (("int", 1), False),
    "block_size": (("int", 1), False),
    "n_layer": (("int", 1), False),
    "n_head": (("int", 1), False),
    "n_embd": (("int", 1), False),
    "dropout": (("real", 0.0, 1.0, True, False), False),
    "bias": (("bool",), False),
    "n_kv_head": (("int", 1), True),
    "n_inner": (("int", 1), True),
    "norm": (("choice", ("layernorm", "rmsnorm")), False),
    "norm_eps": (("real", 0.0, math.inf, False, False), False),
    "mlp": (("choice", ("gelu", "swiglu")), False),
    "pos_emb": (("choice", ("learned", "rope")), False),
    "rope_theta": (("real", 0.0, math.inf, False, False), False),
    "prenorm": (("bool",), False),
    "tie_weights": (("bool",), False),
    "window_size": (("int", 1), True),
    "attn_impl": (("choice", ("sdpa", "explicit")), False),
    "head_dim_override": (("int", 1), True),
}


def _check_field(name: str, value: Any) -> Any:
    """``value`` checked against ``name``'s rule and normalised (a NumPy integer becomes an
    ``int``, an int given for a real field a ``float``). A value of the wrong type (``True`` for an
    int: a bool is not a count; ``"0.1"`` for a real: a string is not a number; ``"no"`` for a
    bool) raises ``TypeError``, one out of range ``ValueError``; both name the field, the value and
    what is allowed."""
    rule, optional = _FIELD_RULES[name]
    kind = rule[0]
    if value is None and optional:
        return None
    none = " or None" if optional else ""
    if kind == "int":
        lo = rule[1]
        what = f"a positive int{none}" if lo == 1 else f"an int >= {lo}{none}"
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"GPTConfig: {name} must be {what}, got {type(value).__name__} {value!r}")
        if value < lo:
            raise ValueError(f"GPTConfig: {name} must be {what}, got {value!r}")
        return int(value)
    if kind == "real":
        lo, hi, lo_in, hi_in = rule[1:]
        if hi == math.inf:
            what = f"a finite number {'>=' if lo_in else '>'} {lo:g}"  # not inf, not NaN
        else:
            what = f"in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"GPTConfig: {name} must be {what if hi == math.inf else 'a number ' + what}, "
                            f"got {type(value).__name__} {value!r}")
        v = float(value)
        ok = math.isfinite(v) and (lo <= v if lo_in else lo < v) and (v <= hi if hi_in else v < hi)
        if not ok:
            raise ValueError(f"GPTConfig: {name} must be {what}, got {value!r}")
        return v
    if kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"GPTConfig: {name} must be True or False, got {type(value).__name__} {value!r}")
        return value
    allowed = rule[1]
    names = " or ".join(repr(a) for a in allowed)
    if not isinstance(value, str):
        raise TypeError(f"GPTConfig: {name} must be {names}, got {type(value).__name__} {value!r}")
    if value not in allowed:
        raise ValueError(f"GPTConfig: {name} must be {names}, got {value!r}")
    return value
