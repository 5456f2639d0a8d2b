"""Training runs as data: :class:`TrainConfig` and the named recipes.

Where this sits: the settings of the *loss -> gradients -> update* loop (:mod:`gptlab.train.loop`).
A run is one :class:`TrainConfig`: the model it trains (``model``, a :class:`gptlab.config.GPTConfig`),
then batch, optimiser, schedule, evaluation and device, checked when built; :data:`RECIPES` names
the tested ones (``get_recipe("shakespeare-char-cpu")``). The schedule is :mod:`gptlab.train.schedule`.

The model's fields may also be given flat, as everywhere before the model was nested:
``TrainConfig(n_layer=4, lr=3e-3)``, ``get_recipe("tiny", n_embd=64)`` and ``--set n_layer=1`` set
``model.n_layer``, and ``cfg.n_layer`` reads it. :meth:`TrainConfig.from_dict` reads both dict
forms: ``to_dict()``'s (``"model": {...}``) and the flat one that older runs saved (``n_layer``, ...,
``model_kwargs`` at the top level).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import GPTConfig

# what distillation matches the teacher by (gptlab.train.distill): the forward KL, the total variation, or both
DIVERGENCES = ("kl", "tv", "kl+tv")

__all__ = ["TrainConfig", "RECIPES", "DATASETS", "MODEL_FIELDS", "get_recipe"]

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(GPTConfig) if f.name != "vocab_size")
"""The names that set (as options) and read (as attributes) the fields of a config's ``model`` (all
but ``vocab_size``: the data gives it)."""
FLAT_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias")
"""The model fields the flat form had as its own; ``model_kwargs`` held the others."""


def default_model() -> GPTConfig:
    """The model of a :class:`TrainConfig` that names none: 4 layers x 128, context 64, no biases.
    Its ``vocab_size`` is a placeholder: the data's replaces it (:meth:`TrainConfig.model_config`)."""
    return GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0, bias=False)


@dataclass(init=False)
class TrainConfig:
    """Everything a training run needs besides its output folder.

    Model: ``model``, a :class:`GPTConfig` (its ``vocab_size`` comes from the data); any of its
    fields may also be passed flat (``TrainConfig(n_layer=6, bias=True)``) and read flat
    (``cfg.block_size`` is ``cfg.model.block_size``). Tokens per optimiser step:
    ``batch_size * grad_accum * block_size`` (times the number of DDP processes).

    Evaluation: every ``eval_interval`` steps (and at step 0 with ``eval_at_start``, and at
    ``max_steps``) the validation loss over ``eval_tokens`` tokens (``None``: the whole split) is a
    row of ``metrics.jsonl``. With ``final_eval_whole_split`` the evaluation at ``max_steps`` scores
    the whole split whatever ``eval_tokens`` is (cheap intermediate points, an exact final figure),
    and ``target_loss`` is then checked on whole-split evaluations only. Logging: every
    ``log_interval`` steps (and at the last step) a row of ``train_log.jsonl`` with the mean
    training loss, the learning rate and the gradient norm of the steps since the previous row.
    """

    model: GPTConfig = field(default_factory=default_model)
    # data
    dataset: str = "shakespeare-char"
    data_dir: str | None = None
    # optimisation
    batch_size: int = 12
    grad_accum: int = 1
    max_steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    lr_decay_steps: int | None = None  # None: max_steps
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    # distillation: also match a trained teacher's next-token distributions (a speculative draft)
    teacher: str | None = None  # a run folder or checkpoint (gptlab.train.checkpoint.load_model); None: off
    # fine-tuning: start from the weights of this run folder or checkpoint (the same model config); None: fresh
    init_from: str | None = None
    distill_weight: float = 1.0  # loss = (1 - w) * cross-entropy + w * KL(teacher || model)
    distill_divergence: str = "kl"  # "kl", "tv" (the total variation) or "kl+tv" (gptlab.train.distill)
    # evaluation, logging, checkpoints
    eval_interval: int = 250
    eval_tokens: int | None = None  # None: the whole validation split
    eval_batch_size: int = 64  # windows per evaluation forward pass
    eval_at_start: bool = True
    final_eval_whole_split: bool = False  # the evaluation at max_steps scores the whole split (see below)
    log_interval: int = 10  # a train_log.jsonl row (train loss, lr, gradient norm) every N steps
    target_loss: float | None = None  # stop as soon as val_loss <= target_loss
    checkpoint_interval: int | None = None  # also save every N steps (always at the end)
    save: bool = True
    progress: bool = True
    plot: bool = True
    # system
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    compile: bool = False
    fused_adamw: bool | None = None  # None: fused on CUDA
    num_threads: int | None = None  # torch CPU threads; None: torch's default

    def __init__(self, model: GPTConfig | Mapping | None = None, **options: Any) -> None:
        """``model``: a :class:`GPTConfig`, its dict, or None (:func:`default_model`); ``options``:
        the other fields, and model fields given flat, which replace ``model``'s."""
        flat = {k: options.pop(k) for k in list(options) if k in MODEL_FIELDS or k == "model_kwargs"}
        own = [f for f in dataclasses.fields(TrainConfig) if f.name != "model"]
        unknown = sorted(set(options) - {f.name for f in own})
        if unknown:
            raise TypeError(f"TrainConfig: unknown option(s) {unknown}; known options: {', '.join(option_names())}")
        for f in own:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, options.get(f.name, default))
        object.__setattr__(self, "model", _model_with(model, flat))
        _validate(self)

    def __getattr__(self, name: str) -> Any:
        """Only for names a config does not hold: a model field reads ``self.model``'s."""
        if name in MODEL_FIELDS and "model" in self.__dict__:
            return getattr(self.__dict__["model"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in MODEL_FIELDS or name == "model_kwargs":
            raise AttributeError(f"TrainConfig.{name} is a field of TrainConfig.model: use "
                                 f"cfg.with_overrides({name}=...)")
        super().__setattr__(name, value)

    def with_overrides(self, **overrides: Any) -> "TrainConfig":
        """A copy with some fields (or model fields, flat) replaced; unknown names or wrong types
        raise clear errors."""
        unknown = [k for k in overrides if k not in option_names()]
        if unknown:
            raise ValueError(f"unknown training option(s) {unknown}; known options: {', '.join(option_names())}")
        mine = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TrainConfig(**{**mine, **overrides})

    def to_dict(self) -> dict:
        """The JSON form: every field, ``model`` as :meth:`GPTConfig.to_dict`'s dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        """The config a dict holds: :meth:`to_dict`'s form, or the flat form of older runs
        (``n_layer``, ..., ``model_kwargs`` beside the other fields). Fields left out take their
        defaults; an unknown one is an error naming it."""
        if not isinstance(d, Mapping):
            raise TypeError(f"TrainConfig.from_dict: a dict expected, got {type(d).__name__}")
        return cls(**d)

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimiser step in one process."""
        return self.batch_size * self.grad_accum * self.model.block_size

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The :class:`GPTConfig` of the model this run trains: ``model`` with the data's vocabulary."""
        return dataclasses.replace(self.model, vocab_size=vocab_size)


def option_names() -> list[str]:
    """Every name :class:`TrainConfig` and :meth:`TrainConfig.with_overrides` accept."""
    return [f.name for f in dataclasses.fields(TrainConfig)] + list(MODEL_FIELDS) + ["model_kwargs"]


def _model_with(model: GPTConfig | Mapping | None, flat: dict[str, Any]) -> GPTConfig:
    """``model`` (None: :func:`default_model`; a dict: :meth:`GPTConfig.from_dict`) with the
    flat model fields ``flat`` replaced. ``model_kwargs`` (the flat form's) sets every field
    beyond :data:`FLAT_FIELDS` and the vocabulary: GPTConfig's defaults updated with it."""
    if model is None:
        model = default_model()
    elif isinstance(model, Mapping):
        model = GPTConfig.from_dict(model, where="TrainConfig.model")
    elif not isinstance(model, GPTConfig):
        raise TypeError(f"TrainConfig.model must be a GPTConfig (or its dict), got {type(model).__name__}")
    extra = flat.pop("model_kwargs", None)
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"TrainConfig: model_kwargs must be a dict, got {type(extra).__name__}")
        clash = sorted(set(extra) & {"vocab_size", *FLAT_FIELDS})
        if clash:
            raise ValueError(f"model_kwargs must not set {clash}: they are model fields of their own")
        kept = {k: getattr(model, k) for k in ("vocab_size", *FLAT_FIELDS)}
        model = GPTConfig.from_dict({**kept, **extra}, where="TrainConfig.model_kwargs")
    return dataclasses.replace(model, **flat) if flat else model


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _validate(c: TrainConfig) -> None:
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(c):
        v = getattr(c, f.name)
        if not _type_ok(v, hints[f.name]):
            raise TypeError(f"TrainConfig.{f.name} must be {hints[f.name]}, got {v!r} ({type(v).__name__})")

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"TrainConfig: {msg}")

    for name in ("batch_size", "grad_accum", "max_steps", "eval_interval", "eval_batch_size", "log_interval"):
        need(getattr(c, name) >= 1, f"{name} must be >= 1, got {getattr(c, name)}")
    need(c.lr > 0 and math.isfinite(c.lr), f"lr must be a positive number, got {c.lr}")
    need(0 <= c.min_lr <= c.lr, f"min_lr must be in [0, lr={c.lr}], got {c.min_lr}")
    need(c.warmup_steps >= 0, f"warmup_steps must be >= 0, got {c.warmup_steps}")
    need(c.lr_decay_steps is None or c.lr_decay_steps > c.warmup_steps,
         f"lr_decay_steps ({c.lr_decay_steps}) must be larger than warmup_steps ({c.warmup_steps})")
    need(0 <= c.beta1 < 1 and 0 <= c.beta2 < 1, f"betas must be in [0, 1), got ({c.beta1}, {c.beta2})")
    need(c.weight_decay >= 0, f"weight_decay must be >= 0, got {c.weight_decay}")
    need(c.grad_clip is None or c.grad_clip > 0, f"grad_clip must be > 0 or None, got {c.grad_clip}")
    need(c.eval_tokens is None or c.eval_tokens >= c.model.block_size,
         f"eval_tokens must be None (whole split) or >= block_size ({c.model.block_size}), got {c.eval_tokens}")
    need(c.checkpoint_interval is None or c.checkpoint_interval >= 1,
         f"checkpoint_interval must be >= 1 or None, got {c.checkpoint_interval}")
    need(c.target_loss is None or c.target_loss > 0, f"target_loss must be > 0 or None, got {c.target_loss}")
    need(0.0 <= c.distill_weight <= 1.0, f"distill_weight must be in [0, 1], got {c.distill_weight}")
    need(c.distill_divergence in DIVERGENCES,
         f"distill_divergence must be one of {DIVERGENCES}, got {c.distill_divergence!r}")
    need(c.num_threads is None or c.num_threads >= 1, f"num_threads must be >= 1 or None, got {c.num_threads}")
    need(c.dataset in DATASETS, f"unknown dataset {c.dataset!r}; known: {sorted(DATASETS)}")
    need(c.dtype in ("auto", "float32", "bfloat16", "float16"),
         f"dtype must be one of 'auto', 'float32', 'bfloat16', 'float16', got {c.dtype!r}")


DATASETS = ("shakespeare-char",)

# Recipes: named, tested configurations.
RECIPES: dict[str, TrainConfig] = {
    # nanoGPT's config/train_shakespeare_char.py (a "baby GPT", 10.7M parameters). nanoGPT reports
    # a best validation loss of 1.4697 after about 3 minutes on one A100.
    "shakespeare-char": TrainConfig(
        model=GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, bias=False),
        batch_size=64, grad_accum=1, max_steps=5000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
        beta2=0.99, weight_decay=0.1, grad_clip=1.0, eval_interval=250, eval_batch_size=64,
    ),
    # Tuned for a 2-core CPU: reach val loss <= 1.886 (what nanoGPT's own train.py reaches with its
    # README's CPU command, 4 layers x 128, block 64, batch 12, 2000 steps at lr 1e-3) in as little time
    # as possible. Changes: Llama-style blocks (rotary positions, RMSNorm, SwiGLU), a small model (2
    # blocks of 96, 3 heads of 32: a step ~10% faster than 4 heads of 24 on an Intel Xeon, for the same
    # FLOPs), context 128, batch 16, a 5x higher peak learning rate after a short warmup, 520 steps:
    # fewer FLOPs for the same loss (0.22x nanoGPT's CPU run's). Evaluations: at steps 0, 130, 260 and
    # 390 on the first 16,384 validation tokens (~0.06 s), and at step 520 on the whole validation
    # split (111,488 tokens, ~0.4 s); the target is checked on that one only. 64 windows a forward
    # pass: 128 took about twice as long over the whole split on an Intel Xeon (its 4 MB activations
    # were mapped and unmapped by malloc at every pass; issue 34).
    # Float32 on a CPU (the trainer's "auto"): bfloat16 autocast was slower per step even on a CPU with
    # AMX (the casts cost more than the products save at these sizes), and torch.compile's seconds of
    # compiling are not won back in a run this short (benchmarks/results/README.md). Measured (whole
    # val split, Intel Xeon): 1.861-1.871, 1.873 and 1.865 with seeds 1337, 1 and 2 (not reproducible to
    # the last bit from one process to the next on a CPU: threaded reductions); the same blocks in 470
    # or 480 steps end at 1.885-1.886, no margin. With the CPU training paths of issue 34 (RoPE, RMSNorm
    # and SwiGLU backwards of their own, the allocator setting: the same numbers up to float rounding),
    # seed 1337 ends at 1.8607-1.8642 in 13.2-13.5 s against nanoGPT's 58.4-62.1 s (4.4-4.7x); seeds 1
    # and 2 at 1.8667 and 1.8637 (13.5 and 13.7 s).
    "shakespeare-char-cpu": TrainConfig(
        model=GPTConfig(n_layer=2, n_head=3, n_embd=96, block_size=128, dropout=0.0, bias=False,
                        pos_emb="rope", norm="rmsnorm", mlp="swiglu"),
        batch_size=16, grad_accum=1, max_steps=520, lr=5e-3, min_lr=5e-4, warmup_steps=30,
        beta2=0.99, weight_decay=0.1, grad_clip=1.0, eval_interval=130, eval_tokens=16384,
        eval_batch_size=64, final_eval_whole_split=True,
    ),
    # The baseline the CPU recipe is measured against: nanoGPT's own CPU command
    # (config/train_shakespeare_char.py with --device=cpu --compile=False --eval_iters=20
    # --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
    # --lr_decay_iters=2000 --dropout=0.0), evaluated like nanoGPT (20 batches of 12 x 64 tokens
    # every 250 steps). `python -m gptlab bench train --recipe nanogpt-cpu` times it on this machine.
    "nanogpt-cpu": TrainConfig(
        model=GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0, bias=False),
        batch_size=12, grad_accum=1, max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
        beta2=0.99, weight_decay=0.1, grad_clip=1.0, eval_interval=250, eval_tokens=20 * 12 * 64,
        eval_batch_size=12,
    ),
    # A seconds-long smoke test for tests and CI.
    "tiny": TrainConfig(
        model=GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0, bias=False),
        batch_size=16, grad_accum=1, max_steps=200, lr=5e-3, min_lr=5e-4, warmup_steps=10,
        beta2=0.99, weight_decay=0.1, grad_clip=1.0, eval_interval=50, eval_tokens=8192,
        eval_batch_size=128,
    ),
}

# The CPU recipe's variant for the speed benchmark (issue 24): the same run evaluated once, on the
# whole validation split, at the end (the interim evaluations only draw the chapter's curve). Before
# issue 34 it was the only recipe at 2 blocks x 520 steps; the chapter's recipe is now the same run.
# `python -m gptlab bench train --recipe shakespeare-char-cpu-fast` times it; benchmarks/results/README.md
# has the figures and the variants that were tried.
RECIPES["shakespeare-char-cpu-fast"] = RECIPES["shakespeare-char-cpu"].with_overrides(eval_interval=520)


def get_recipe(name: str, **overrides: Any) -> TrainConfig:
    """The recipe ``name`` with ``overrides`` applied; an unknown name lists the known ones."""
    if not isinstance(name, str) or name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(sorted(RECIPES))}")
    return RECIPES[name].with_overrides(**overrides)
