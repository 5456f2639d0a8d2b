"""Architecture diagrams drawn from a model itself.

Where this sits: beside the model, for the chapters. A diagram typed by hand drifts from the code;
this one takes its box names from the model's own modules (``transformer.wte``,
``transformer.h.0.attn.c_attn``, ...) and its shapes from one real forward pass, recorded by forward
hooks (:func:`trace_shapes`), so it shows what the code computes.

* :func:`trace_shapes`: ``{module name: output shape}`` of one forward pass.
* :func:`draw_gpt`: GPT-2's layout (pre-norm blocks, GELU MLP, learned positions) as two panels,
  the whole model and one block, every box labelled with its module name and output shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    import matplotlib.figure

    from .model import GPT

__all__ = ["trace_shapes", "draw_gpt"]


def trace_shapes(model: torch.nn.Module, idx: Tensor) -> dict[str, tuple[int, ...]]:
    """Run ``model(idx)`` once (no gradients) and return the output shape of every submodule that
    ran, by its name in ``model.named_modules()`` (a module returning a tuple: its first element).
    A module called several times keeps the shape of its first call."""
    shapes: dict[str, tuple[int, ...]] = {}

    def record(name: str):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, Tensor):
                shapes.setdefault(name, tuple(out.shape))
        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            model(idx)
    finally:
        for h in handles:
            h.remove()
    return shapes


def _shape(s: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in s) + ")"


def draw_gpt(model: "GPT", idx: Tensor) -> "matplotlib.figure.Figure":
    """GPT-2's architecture as ``model`` runs it on ``idx`` (B, T): the whole model (left) and its
    first block (right). Box labels are module names of ``model`` and the output shapes of one
    forward pass. Raises ``ValueError`` for a model that is not GPT-2's layout (post-norm,
    SwiGLU or RoPE models have other boxes)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    c = model.config
    if not (c.prenorm and c.mlp == "gelu" and c.pos_emb == "learned"):
        raise ValueError("draw_gpt draws GPT-2's layout (prenorm=True, mlp='gelu', pos_emb='learned'); "
                         f"this model has prenorm={c.prenorm}, mlp={c.mlp!r}, pos_emb={c.pos_emb!r}")
    shapes = trace_shapes(model, idx)
    B, T = idx.shape
    hd = c.n_embd // c.n_head
    b0 = "transformer.h.0"

    def box(ax, y, title, detail, color, x=0.5, w=0.84, h=0.054):
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.006",
                                    fc=color, ec="0.35", lw=1))
        ax.text(x, y + 0.011, title, ha="center", va="center", fontsize=8.5, family="monospace", weight="bold")
        ax.text(x, y - 0.016, detail, ha="center", va="center", fontsize=7.5, color="0.2")

    def arrow(ax, y0, y1, x=0.5):
        ax.add_patch(FancyArrowPatch((x, y0), (x, y1), arrowstyle="-|>", mutation_scale=9, lw=1, color="0.3"))

    def column(ax, rows, top=0.95, step=0.079, h=0.054):
        ys = [top - i * step for i in range(len(rows))]
        for y, row in zip(ys, rows):
            box(ax, y, *row, h=h)
        for y0, y1 in zip(ys, ys[1:]):
            arrow(ax, y0 - h / 2 - 0.004, y1 + h / 2 + 0.004)
        return ys

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 8.6))
    for ax in (left, right):
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.axis("off")
    left.set_title(f"the model: GPT(config), B={B}, T={T}", fontsize=10)
    column(left, [
        ("idx", f"token ids {_shape((B, T))}", "white"),
        ("transformer.wte", f"token embedding -> {_shape(shapes['transformer.wte'])}", "#dbe9f6"),
        ("+ transformer.wpe", f"position embedding rows 0..{T - 1}: ({T}, {c.n_embd}), broadcast", "#dbe9f6"),
        (f"transformer.h[0 .. {c.n_layer - 1}]", f"{c.n_layer} x Block -> {_shape(shapes[f'transformer.h.{c.n_layer - 1}'])}", "#fde8c8"),
        ("transformer.ln_f", f"LayerNorm -> {_shape(shapes['transformer.ln_f'])}", "#e3f1df"),
        ("lm_head", f"Linear(C={c.n_embd}, V={c.vocab_size}) -> {_shape(shapes['lm_head'])}"
                    + (", tied to wte" if model.lm_head.weight is model.transformer.wte.weight else ""), "#e8e0f3"),
        ("logits", "softmax over V: next-token probabilities", "white"),
    ], top=0.9, step=0.12, h=0.062)

    right.set_title(f"one Block: {b0} (pre-norm, {c.n_head} heads of {hd})", fontsize=10)
    ys = column(right, [
        ("x", f"residual stream in {_shape(shapes[b0 + '.ln_1'])}", "white"),
        ("ln_1", f"LayerNorm -> {_shape(shapes[b0 + '.ln_1'])}", "#e3f1df"),
        ("attn.c_attn", f"Linear(C, 3C) -> {_shape(shapes[b0 + '.attn.c_attn'])}", "#dbe9f6"),
        ("q, k, v", f"split into heads: 3 x {_shape((B, c.n_head, T, hd))}", "#dbe9f6"),
        ("softmax(q k^T / sqrt(d) + mask) v", f"causal attention per head -> {_shape((B, c.n_head, T, hd))}", "#dbe9f6"),
        ("attn.c_proj", f"merge heads, Linear(C, C) -> {_shape(shapes[b0 + '.attn.c_proj'])}", "#dbe9f6"),
        ("x = x + attn(ln_1(x))", "residual add", "#fde8c8"),
        ("ln_2", f"LayerNorm -> {_shape(shapes[b0 + '.ln_2'])}", "#e3f1df"),
        ("mlp.c_fc", f"Linear(C, {c.inner_dim}) -> {_shape(shapes[b0 + '.mlp.c_fc'])}", "#f6dbe0"),
        ("GELU (tanh)", "elementwise", "#f6dbe0"),
        ("mlp.c_proj", f"Linear({c.inner_dim}, C) -> {_shape(shapes[b0 + '.mlp.c_proj'])}", "#f6dbe0"),
        ("x = x + mlp(ln_2(x))", f"residual add -> {_shape(shapes[b0])}", "#fde8c8"),
    ])
    # the two residual paths: around attention (x -> first add) and around the MLP
    for (start, end), x in (((0, 6), 0.95), ((6, 11), 0.97)):
        y0, y1 = ys[start], ys[end]
        right.plot([0.92, x, x], [y0, y0, y1], color="#c77c02", lw=1.3)
        right.add_patch(FancyArrowPatch((x, y1), (0.92, y1), arrowstyle="-|>", mutation_scale=9, lw=1.3, color="#c77c02"))
    right.text(0.993, (ys[0] + ys[11]) / 2, "residual (identity) paths", rotation=90, va="center", ha="center",
               fontsize=8, color="#c77c02")
    fig.tight_layout()
    return fig
