"""The small trusted objects a check hands to the learner's code: rebuilt in the learner's kernel.

Where this sits: beside the pipeline, between the graders (:mod:`gptlab.grading`) and the learner's
kernel. Some checks call the learner's function on an object of their own: a toy language model
(beam search), a cache holding a few tokens (one cached attention step), a tiny GPT-2-style model
that records what its layers saw (cached generation), a spy on a model's gradients (training). In the autograder the learner's function runs
in a sandboxed kernel (:mod:`gptlab.course.sandbox`), so the object is sent there as a recipe
(``__gptlab_portable__``: a factory named ``"gptlab.grading.portables:Name"`` and its arguments)
and its state is read back (``__gptlab_state__`` / ``__gptlab_sync__``).

This module is what the sandbox keeps of the graders: it holds no reference answer and calls none
of the entry points an assignment forbids (the cache below appends with ``torch.cat`` itself
rather than through gptlab's caches), so it works in a kernel where those are absent.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..model import GPT, GPTConfig

__all__ = ["ToyLM", "ReferenceCache", "tiny_model", "recording_tiny_model", "GradSpy"]


class ToyLM:
    """A small fixed language model for the beam-search check: ``step_fn(ids (N, T)) -> logits (N, V)``.

    The next token's logits depend on the last two tokens and on the length T (so no two different
    sequences tie exactly); they are a fixed function of ``seed``. Token ``eos`` gets a bias
    ``eos_bias`` so that hypotheses end at different lengths.
    """

    def __init__(self, seed: int, vocab_size: int = 10, eos: int = 0, eos_bias: float = -1.0):
        self._recipe = [seed, vocab_size, eos, eos_bias]
        g = torch.Generator().manual_seed(seed)
        V = vocab_size
        self.vocab_size, self.eos = V, eos
        self.w1 = torch.randn(V, V, generator=g) * 2.0
        self.w2 = torch.randn(V, V, generator=g)
        self.pos = torch.randn(32, V, generator=g)
        self.w1[:, eos] += eos_bias

    def __call__(self, ids: Tensor) -> Tensor:
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point():
            got = f"shape {tuple(ids.shape)}, dtype {ids.dtype}" if isinstance(ids, Tensor) else type(ids).__name__
            raise TypeError(f"step_fn expects token ids as an integer tensor (N, T), got {got}")
        ids = ids.long()
        out = self.w1[ids[:, -1]] + self.pos[ids.shape[1] % 32]
        if ids.shape[1] > 1:
            out = out + self.w2[ids[:, -2]]
        return out.clone()

    def __gptlab_portable__(self):
        """The autograder rebuilds the same toy model in the learner's process from its arguments."""
        return "gptlab.grading.portables:ToyLM", list(self._recipe)


class ReferenceCache:
    """A cache with the ``kv_cache`` assignment's interface, for checking one attention step on its
    own: ``update(k, v)`` appends (B, H, T_new, d) keys and values on the time axis (dim 2) and
    returns everything held; ``held()`` returns it without appending; ``calls`` counts updates."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.calls = 0

    def _append(self, k: Tensor, v: Tensor) -> None:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.calls += 1
        self._append(k, v)
        return self.k, self.v

    def held(self) -> tuple[Tensor, Tensor]:
        """Every key and value cached so far, (B, H, S, d) each."""
        return self.k, self.v

    # the autograder sends this cache to the learner's process as a recipe, and reads it back
    def __gptlab_portable__(self):
        return "gptlab.grading.portables:ReferenceCache.rebuilt", [self.k, self.v, self.calls]

    def __gptlab_state__(self):
        return [self.k, self.v, self.calls]

    def __gptlab_sync__(self, state) -> None:
        k, v, calls = state
        self.k = self.v = None
        if isinstance(k, Tensor) and isinstance(v, Tensor):
            self._append(k, v)
        self.calls = int(calls)

    @classmethod
    def rebuilt(cls, k: Tensor | None, v: Tensor | None, calls: int) -> ReferenceCache:
        cache = cls()
        if k is not None:
            cache._append(k, v)
        cache.calls = calls
        return cache


def tiny_model(seed: int = 0) -> GPT:
    """The GPT-2-style model the generation check runs on: 2 layers, 2 heads, 32 wide, 50 tokens,
    learned positions, with weights large enough that every listed bug changes the tokens."""
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=50, block_size=48, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def recording_tiny_model(seed: int = 0) -> GPT:
    """:func:`tiny_model` whose layers record how many positions each ``c_attn`` call saw
    (``model.__gptlab_state__()``): what the autograder builds in the learner's process."""
    model = tiny_model(seed)
    seen: list[list[int]] = [[] for _ in model.transformer.h]
    for i, blk in enumerate(model.transformer.h):
        blk.attn.c_attn.register_forward_hook(lambda m, a, o, i=i: seen[i].append(int(a[0].shape[1])))
    model.__gptlab_state__ = lambda: seen
    return model


class GradSpy:
    """Counts backward passes that found a parameter's ``.grad`` still holding an earlier step's
    gradient (no ``zero_grad`` between steps): the training check puts one on the learner's model."""

    def __init__(self, p: Tensor):
        self.calls = 0
        self.stale = 0
        self._p = p
        self._handle = p.register_hook(self._hook)

    def _hook(self, grad: Tensor) -> None:
        self.calls += 1
        old = self._p.grad
        if old is not None and bool(old.abs().sum() > 0):
            self.stale += 1

    def remove(self) -> None:
        self._handle.remove()

    @classmethod
    def on_model(cls, model: nn.Module) -> GradSpy:
        """A spy on the model's first parameter."""
        return cls(next(model.parameters()))
