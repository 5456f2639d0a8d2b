"""Generation: from a model's logits to new tokens.

Where this sits: text -> tokens -> model -> logits -> *samples* -> text. One module per decoder,
all run from one :class:`GenerationConfig` (the settings, checked once):

* :mod:`gptlab.generation.config`: :class:`GenerationConfig` (Hugging Face's is the anchor), with
  the logits settings nested as a :class:`gptlab.sampling.SamplingConfig`;
* :mod:`gptlab.generation.loop`: the decode loop, :func:`generate` and :func:`stream` (chapters 5-7);
* :mod:`gptlab.generation.beam`: :func:`beam_search`, Hugging Face's (chapter 6), and the same
  search on a step function, :func:`beam_search_fn` (what the beam-search assignment is checked with);
* :mod:`gptlab.generation.speculative`: speculative decoding, :func:`speculative_generate` and its
  pieces (chapter 8).

``from gptlab.generation import generate, stream, beam_search, speculative_generate``.
"""

from ..kvcache import make_cache
from ..sampling import SamplingConfig
from .beam import beam_search, beam_search_fn
from .config import GenerationConfig
from .loop import generate, stream
from .speculative import SpeculativeStats, speculative_generate

__all__ = ["GenerationConfig", "SamplingConfig", "generate", "stream", "beam_search", "beam_search_fn",
           "speculative_generate", "SpeculativeStats", "make_cache"]
