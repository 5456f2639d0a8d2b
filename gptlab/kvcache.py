"""Key/value caches for fast autoregressive decoding.

Where this sits: model -> logits -> *samples*. Generating token t+1 needs the keys and values of
every earlier token in every layer. Recomputing them each step costs O(T) work per layer per
token; a cache keeps them, so a decode step only computes the newest token's q, k and v.

Three caches share one small interface, used by :class:`gptlab.model.CausalSelfAttention`:

* :class:`ConcatKVCache` grows by concatenation: the simplest possible cache, for teaching.
* :class:`StaticKVCache` pre-allocates ``(B, n_kv_head, max_len, head_dim)`` buffers per layer and
  writes new entries in place (gpt-fast's design). Rolling back rejected speculative tokens is
  just moving the length pointer back; the slots are overwritten later.
* :class:`SlidingWindowKVCache` keeps only the last ``window`` entries (Mistral-style local
  attention), so its memory stops growing.

Slots. Every token that enters the cache gets a *slot* index 0, 1, 2, ... in order of arrival,
shared by all rows of the batch. Causality is "key slot <= query slot"; a sliding window adds
"key slot > query slot - window"; left padding is a per-row boolean mask over slots. Positions
(for the positional embedding) are separate and may differ per row.

Interface (per forward pass of the model):
    ``start = cache.length``                       slot of the first new token
    ``k_all, v_all, first = cache.update(i, k, v)`` for each layer ``i``
    ``cache.advance(T)``                           commit the T new slots once all layers ran
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "KVCache",
    "ConcatKVCache",
    "StaticKVCache",
    "SlidingWindowKVCache",
    "kv_cache_bytes",
    "kv_cache_bytes_for",
    "make_cache",
    "CACHE_IMPLS",
]

CACHE_IMPLS = ("static", "concat", "sliding")


def kv_cache_bytes(
    n_layer: int,
    n_kv_head: int,
    head_dim: int,
    seq_len: int,
    batch: int = 1,
    bytes_per_elem: int = 4,
) -> int:
    """Bytes a KV cache needs: ``2 (k and v) * n_layer * batch * n_kv_head * seq_len * head_dim
    * bytes_per_elem``, all plain numbers (``bytes_per_elem``: 4 for float32, 2 for bfloat16).

    Grouped-query attention caches ``n_kv_head < n_head`` heads, which divides the figure by
    ``n_head / n_kv_head``. For a model config, use :func:`kv_cache_bytes_for`.
    """
    if not isinstance(n_layer, int):
        raise TypeError(f"kv_cache_bytes takes plain numbers (n_layer, n_kv_head, head_dim, seq_len, batch, "
                        f"bytes_per_elem); got {type(n_layer).__name__} for n_layer: for a model config use "
                        "kv_cache_bytes_for(config, batch_size, seq_len, dtype)")
    for name, v in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim),
                    ("seq_len", seq_len), ("batch", batch), ("bytes_per_elem", bytes_per_elem)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "seq_len" else 1):
            raise ValueError(f"kv_cache_bytes: {name} must be an int >= {0 if name == 'seq_len' else 1}, got {v!r}")
    return 2 * n_layer * batch * n_kv_head * seq_len * head_dim * bytes_per_elem


def kv_cache_bytes_for(
    config,
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
) -> int:
    """:func:`kv_cache_bytes` for a model config (a :class:`gptlab.GPTConfig`): ``seq_len`` tokens
    for ``batch_size`` sequences in ``dtype``. A sliding window caps the ``seq_len`` factor at
    ``window`` (default: ``config.window_size``)."""
    if batch_size < 1 or seq_len < 0:
        raise ValueError(f"expected batch_size >= 1 and seq_len >= 0, got {batch_size}, {seq_len}")
    window = window if window is not None else getattr(config, "window_size", None)
    kept = min(seq_len, window) if window else seq_len
    itemsize = torch.empty((), dtype=dtype).element_size()
    return kv_cache_bytes(config.n_layer, config.kv_heads, config.head_dim, kept, batch_size, itemsize)


class KVCache:
    """Base class: the interface the attention layers use. See the module docstring."""

    length: int
    offset: int = 0  # slot of the oldest entry kept (non-zero only once a sliding window evicts)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """Store ``k, v`` (B, n_kv_head, T, head_dim) for ``layer`` at slots ``length .. length+T-1``.

        Returns all keys and values the new queries may attend to, (B, n_kv_head, S, head_dim), and
        the slot index of the first returned key.
        """
        raise NotImplementedError

    def advance(self, n: int) -> None:
        """Commit ``n`` new slots (called once per forward pass, after every layer updated)."""
        self.length += n

    def crop(self, length: int) -> None:
        """Forget every slot from ``length`` on (roll back rejected speculative tokens)."""
        raise NotImplementedError

    def reorder(self, index: Tensor) -> None:
        """Reorder (or repeat) the batch rows: row ``b`` becomes old row ``index[b]`` (beam search)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached keys and values right now."""
        raise NotImplementedError


class ConcatKVCache(KVCache):
    """The teaching cache: keep a tensor per layer and ``torch.cat`` each new step onto it."""

    def __init__(self, n_layer: int):
        self.k: list[Tensor | None] = [None] * n_layer
        self.v: list[Tensor | None] = [None] * n_layer
        self.length = 0
        self.offset = 0  # slot index of the first stored entry (non-zero only for sliding windows)

    def update(self, layer, k, v):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer], self.offset

    def crop(self, length):
        if length < self.offset:
            raise ValueError(f"cannot crop to {length}: slots before {self.offset} were evicted")
        keep = length - self.offset
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i] = self.k[i][:, :, :keep]
                self.v[i] = self.v[i][:, :, :keep]
        self.length = min(self.length, length)

    def reorder(self, index):
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i] = self.k[i].index_select(0, index)
                self.v[i] = self.v[i].index_select(0, index)

    @property
    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


class SlidingWindowKVCache(ConcatKVCache):
    """Keep only the last ``window`` slots: attention to older tokens is masked anyway.

    Memory is ``O(window)`` instead of ``O(T)``. During one forward pass every new key is returned
    (a long prefill still needs them for its own queries); the trim happens in :meth:`advance`.
    """

    def __init__(self, n_layer: int, window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        super().__init__(n_layer)
        self.window = window

    def advance(self, n):
        self.length += n
        drop = self.length - self.offset - self.window
        if drop > 0:
            for i in range(len(self.k)):
                if self.k[i] is not None:
                    self.k[i] = self.k[i][:, :, drop:]
                    self.v[i] = self.v[i][:, :, drop:]
            self.offset += drop


class StaticKVCache(KVCache):
    """Pre-allocated cache written in place: no allocation per step, O(1) rollback.

    Buffers have shape (n_layer, B, n_kv_head, max_len, head_dim). ``update`` returns views of the
    filled prefix, so attention never touches the unused tail.
    """

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_kv_head: int,
        max_len: int,
        head_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0
        self._layers: tuple[Tensor, Tensor, tuple[bool, bool], list[tuple[Tensor, Tensor]]] | None = None

    def _layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s buffers (B, n_kv_head, max_len, head_dim): views made once, and again if
        ``k`` or ``v`` was replaced or the autograd mode changed (PyTorch forbids writing into a view
        made under ``no_grad`` or ``inference_mode`` once that mode is left)."""
        if torch.compiler.is_compiling():  # a compiled step (gptlab.fast.compiled): views inside its graph
            return self.k[layer], self.v[layer]
        views, mode = self._layers, (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        if views is None or views[0] is not self.k or views[1] is not self.v or views[2] != mode:
            pairs = [(self.k[i], self.v[i]) for i in range(self.k.shape[0])]
            views = self._layers = (self.k, self.v, mode, pairs)
        return views[3][layer]

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None, dtype=None) -> "StaticKVCache":
        """A cache sized for ``model`` (a :class:`gptlab.GPT`), on its device and dtype."""
        cfg = model.config
        p = next(model.parameters())
        return cls(
            cfg.n_layer,
            batch_size,
            cfg.kv_heads,
            max_len or cfg.block_size,
            cfg.head_dim,
            device=p.device,
            dtype=dtype or p.dtype,
        )

    def update(self, layer, k, v):
        T = k.shape[2]
        end = self.length + T
        if end > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {T} tokens > max_len={self.max_len}")
        K, V = self._layer(layer)  # (B, n_kv_head, max_len, head_dim)
        if k.shape[0] != K.shape[0]:
            raise ValueError(f"cache holds batch {K.shape[0]}, got keys of batch {k.shape[0]}")
        K.narrow(2, self.length, T).copy_(k)  # in place
        V.narrow(2, self.length, T).copy_(v)
        return K.narrow(2, 0, end), V.narrow(2, 0, end), 0

    def crop(self, length):
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self.length = min(self.length, length)

    def reorder(self, index):
        if index.numel() == self.k.shape[1]:  # same batch size: permute the filled prefix in place
            n = self.length
            self.k[:, :, :, :n] = self.k[:, index, :, :n]
            self.v[:, :, :, :n] = self.v[:, index, :, :n]
        else:  # a different batch size (e.g. repeating rows for beam search): new buffers
            self.k = self.k.index_select(1, index)
            self.v = self.v.index_select(1, index)

    @property
    def nbytes(self):
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def make_cache(model, batch_size: int, max_len: int, impl: str = "static") -> KVCache:
    """A KV cache for ``model`` (a :class:`gptlab.GPT`) holding up to ``max_len`` slots for
    ``batch_size`` rows.

    ``impl``: ``"static"`` (pre-allocated, in place: the fast one), ``"concat"`` (grows by
    ``torch.cat``: the teaching one) or ``"sliding"`` (keeps the last ``config.window_size`` slots;
    needs a sliding-window model).
    """
    if impl == "static":
        return StaticKVCache.for_model(model, batch_size, max_len)
    if impl == "concat":
        return ConcatKVCache(model.config.n_layer)
    if impl == "sliding":
        w = model.config.window_size
        if w is None:
            raise ValueError("cache='sliding' needs a model with config.window_size set, got window_size=None")
        return SlidingWindowKVCache(model.config.n_layer, w)
    raise ValueError(f"cache must be one of {CACHE_IMPLS}, got {impl!r}")
