"""gptlab: the reference package of the gptlab course.

The data's path through the package, one module per idea (ARCHITECTURE.md lists them all):

    text -> tokens (:mod:`gptlab.tokenizers`) -> batches (:mod:`gptlab.data`)
         -> model (:mod:`gptlab.config`, :mod:`gptlab.layers`, :mod:`gptlab.masks`,
                   :mod:`gptlab.rope`, :mod:`gptlab.attention`, :mod:`gptlab.model`)
         -> logits -> loss (:mod:`gptlab.train`)
                   -> samples (:mod:`gptlab.sampling`, :mod:`gptlab.kvcache`,
                               :mod:`gptlab.generation`) -> text
"""

from .generation import GenerationConfig, beam_search, generate, speculative_generate, stream
from .masks import causal_mask
from .model import GPT, GPTConfig

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "GenerationConfig", "causal_mask", "generate", "stream", "beam_search",
           "speculative_generate", "__version__"]
