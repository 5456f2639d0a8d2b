"""Other libraries' models as gptlab's: Hugging Face ``transformers`` and SmolLM2.

* :mod:`gptlab.interop.hf`: conversions to and from ``transformers`` (GPT-2, GPT-1, Llama):
  ``config_from_hf``, ``state_dict_from_hf``, ``to_hf``; :meth:`gptlab.GPT.from_hf` and
  :meth:`gptlab.GPT.to_hf` call them.
* :mod:`gptlab.interop.smollm`: SmolLM2-135M, a real Llama-family model, as a gptlab ``GPT``
  (``load_smollm2``).

Import the module you need (``from gptlab.interop.smollm import load_smollm2``): this package's
``__init__`` imports neither, because :mod:`gptlab.model` imports :mod:`gptlab.interop.hf`, and
:mod:`gptlab.interop.smollm` imports :mod:`gptlab.model`.
"""
