"""gptlab.diagram: the architecture figure is drawn from the model (names and shapes), not typed."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from gptlab.diagram import draw_gpt, trace_shapes
from gptlab.model import GPT, GPTConfig
from tiny_models import VARIANTS


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=24), **kw})).eval()


def test_trace_shapes_are_the_forward_pass_shapes():
    model, idx = _model(), torch.randint(0, 50, (3, 7))
    shapes = trace_shapes(model, idx)
    names = dict(model.named_modules())
    assert set(shapes) <= set(names)
    logits, _ = model(idx)
    assert shapes["lm_head"] == tuple(logits.shape) == (3, 7, 50)
    assert shapes["transformer.h.0.attn.c_attn"] == (3, 7, 3 * 24)
    assert shapes["transformer.h.2.mlp.c_fc"] == (3, 7, 4 * 24)
    assert all(h._forward_hooks == {} for h in model.modules()), "the hooks must be removed"


def test_every_box_names_a_module_of_the_model_and_its_shape():
    model, idx = _model(), torch.zeros(2, 5, dtype=torch.long)
    fig = draw_gpt(model, idx)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    names = set(dict(model.named_modules()))
    titles = [t for t in texts if t.split(" ")[0] in {"ln_1", "ln_2"} or "." in t.split(" ")[0]]
    for title in titles:
        name = title.split(" ")[0].split("[")[0]
        assert name in names or f"transformer.h.0.{name}" in names, f"box {title!r} names no module"
    joined = "\n".join(texts)
    assert "(2, 5, 72)" in joined and "(2, 5, 96)" in joined and "(2, 5, 50)" in joined
    assert "3 x Block" in joined and "2 heads of 12" in "\n".join(ax.get_title() for ax in fig.axes)
    matplotlib.pyplot.close(fig)


# draw_gpt draws GPT-2's boxes (pre-norm, GELU MLP, learned positions); the variants that change any
# of these have other boxes and are refused (a different norm, width or head count is still drawn).
OTHER_LAYOUTS = [name for name, kw in VARIANTS.items()
                 if kw.get("prenorm") is False or kw.get("mlp") == "swiglu" or kw.get("pos_emb") == "rope"]


@pytest.mark.parametrize("variant", OTHER_LAYOUTS)
def test_other_layouts_are_refused(variant):
    with pytest.raises(ValueError, match="GPT-2's layout"):
        draw_gpt(_model(**VARIANTS[variant]), torch.zeros(1, 4, dtype=torch.long))
