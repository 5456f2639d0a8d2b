"""gptlab: the reference package of the gptlab course.

The data's path through the package, one module per idea (ARCHITECTURE.md lists them all):

    text -> tokens (:mod:`gptlab.tokenizers`) -> batches (:mod:`gptlab.data`)
         -> model (:mod:`gptlab.config`, :mod:`gptlab.layers`, :mod:`gptlab.masks`,
                   :mod:`gptlab.rope`, :mod:`gptlab.attention`, :mod:`gptlab.model`)
         -> logits -> loss (:mod:`gptlab.train`)
                   -> samples (:mod:`gptlab.sampling`, :mod:`gptlab.kvcache`,
                               :mod:`gptlab.generation`) -> text
"""

import sys as _sys


def _one_line_interrupt(kind: type, value: BaseException, tb: object, *, _previous=_sys.excepthook) -> None:
    """``sys.excepthook`` of ``python -m gptlab COMMAND``: a Ctrl-C that no command caught (one in
    the first second, while torch and the rest are imported) is one line, not a traceback; the
    process still ends as Python ends it on SIGINT (the shell's exit status 130)."""
    if not issubclass(kind, KeyboardInterrupt):
        return _previous(kind, value, tb)
    command = next((a for a in _sys.argv[1:] if not a.startswith("-")), None)
    if command == "train":
        print("gptlab train: interrupted before training started; nothing was written", file=_sys.stderr)
    else:
        print(f"python -m gptlab{' ' + command if command else ''}: interrupted", file=_sys.stderr)


if _sys.argv[:1] == ["-m"]:  # being run as `python -m gptlab ...`: the package is imported first, then __main__
    _sys.excepthook = _one_line_interrupt

from .generation import GenerationConfig, beam_search, generate, speculative_generate, stream  # noqa: E402
from .masks import causal_mask  # noqa: E402
from .model import GPT, GPTConfig  # noqa: E402

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "GenerationConfig", "causal_mask", "generate", "stream", "beam_search",
           "speculative_generate", "__version__"]
