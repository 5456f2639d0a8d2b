"""Checkpoints: a trained model (and, for resuming, its optimiser and training state) on disk.

Where this sits: after training (text -> tokens -> batches -> model -> logits -> loss), before
sampling. :func:`save_checkpoint` writes a folder, :func:`load_model` rebuilds the model and its
tokenizer from it for sampling, and :func:`load_checkpoint` restores everything for resuming.

A checkpoint folder holds:

* ``model.safetensors``: the weights. Tied weights (``lm_head.weight`` is ``wte.weight``) are
  stored once and re-tied on load.
* ``config.json``: ``{"format", "version", "model": GPTConfig dict, "tokenizer": tokenizer dict
  or null, "tied": {dropped name: kept name}}``.
* ``optimizer.safetensors`` (optional): every tensor of the optimiser's state (AdamW's moments
  and step counts), with the parameter groups and any non-tensor state as JSON in the file's
  metadata header.
* ``train_state.json`` (optional): the step, the RNG states (python, numpy, torch, CUDA, the
  batch generator) in a JSON-safe form (see :func:`gptlab.rng.rng_state`), metrics, ...

Safety: weights are read with ``safetensors`` and everything else is JSON, so loading a
checkpoint never unpickles anything (no ``torch.load``).

Atomicity: the whole folder is first written under a temporary name beside the target, then
swapped in with renames (:func:`gptlab.files.atomic_dir`), so a crash during a save never leaves a half
written checkpoint in the target's place. If a crash falls between the two renames of the swap
the previous checkpoint survives as ``.<name>.old``, and :func:`resolve_checkpoint` finds it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .files import atomic_dir, kept_aside
from .model import GPT, GPTConfig
from .rng import rng_state, set_rng_state  # re-exported: the training state they make is saved here

__all__ = [
    "save_checkpoint",
    "load_model",
    "load_checkpoint",
    "resolve_checkpoint",
    "unwrap_model",
    "rng_state",
    "set_rng_state",
    "optimizer_state_to_tensors",
    "optimizer_state_from_tensors",
    "CheckpointError",
    "MODEL_FILE",
    "CONFIG_FILE",
    "OPTIMIZER_FILE",
    "TRAIN_STATE_FILE",
]

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAIN_STATE_FILE = "train_state.json"
FORMAT = "gptlab-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete or inconsistent."""


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside ``DistributedDataParallel`` (``.module``) and/or ``torch.compile``
    (``._orig_mod``) wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel) or (
            hasattr(model, "module") and isinstance(getattr(model, "module"), nn.Module)
            and type(model).__name__ in ("DistributedDataParallel", "DataParallel")
        ):
            model = model.module
        else:
            return model


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    raise TypeError(f"train_state must be JSON-serialisable; got a {type(obj).__name__}: {obj!r:.80}")


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=_json_default)  # atomic_dir flushes it to the disk


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from e


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; a truncated or foreign file raises CheckpointError
    naming it (safetensors' own error names no file)."""
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises SafetensorError, OSError or ValueError by case
        if isinstance(e, FileNotFoundError):
            raise
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or another format?): {e}") from e


# --------------------------------------------------------------------------------------------
# model weights
# --------------------------------------------------------------------------------------------


def _model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict with each shared tensor kept once (first name wins), as contiguous CPU
    tensors, and the map {dropped name: kept name}."""
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict().items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() > 0 and key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().cpu().contiguous()
    return tensors, tied


def _load_weights(model: GPT, tensors: dict[str, torch.Tensor], tied: dict[str, str], where: Path) -> None:
    expected = set(model.state_dict().keys())
    got = set(tensors) | set(tied)
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: weights do not match the model built from config.json: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    state = model.state_dict()
    for name, t in tensors.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, the model expects {tuple(state[name].shape)}")
    model.load_state_dict(tensors, strict=False)
    # re-tie: the model's constructor ties lm_head to wte when config.tie_weights; for any other
    # tie recorded in the file, copy the kept tensor (values are equal by construction).
    params = dict(model.named_parameters(remove_duplicate=False))
    for dropped, kept in tied.items():
        if dropped in params and kept in params and params[dropped] is params[kept]:
            continue
        with torch.no_grad():
            state[dropped].copy_(tensors[kept])


# --------------------------------------------------------------------------------------------
# optimizer state
# --------------------------------------------------------------------------------------------


def optimizer_state_to_tensors(opt_state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split ``optimizer.state_dict()`` into flat tensors ``{"state.<param id>.<key>": tensor,
    "group.<i>.<key>": tensor}`` and a JSON-safe remainder (param groups, non-tensor state)."""
    tensors: dict[str, torch.Tensor] = {}
    meta_state: dict[str, dict] = {}
    for pid, st in opt_state["state"].items():
        entry = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                entry[k] = v
        meta_state[str(pid)] = entry
    groups = []
    for i, g in enumerate(opt_state["param_groups"]):
        gm = {}
        for k, v in g.items():
            if isinstance(v, torch.Tensor):
                tensors[f"group.{i}.{k}"] = v.detach().cpu().contiguous()
                gm[k] = {"__tensor__": f"group.{i}.{k}"}
            elif isinstance(v, tuple):
                gm[k] = {"__tuple__": list(v)}
            else:
                gm[k] = v
        groups.append(gm)
    meta = {"state": meta_state, "state_keys": sorted(opt_state["state"].keys(), key=str), "param_groups": groups}
    json.dumps(meta)  # raises TypeError here, before any file is written, if not JSON-safe
    return tensors, meta


def optimizer_state_from_tensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """The inverse of :func:`optimizer_state_to_tensors`: a dict for ``optimizer.load_state_dict``."""
    state: dict[Any, dict] = {}
    for pid_s, entry in meta["state"].items():
        pid: Any = int(pid_s) if pid_s.lstrip("-").isdigit() else pid_s
        state[pid] = dict(entry)
    for name, t in tensors.items():
        kind, rest = name.split(".", 1)
        if kind == "state":
            pid_s, key = rest.split(".", 1)
            pid = int(pid_s) if pid_s.lstrip("-").isdigit() else pid_s
            state.setdefault(pid, {})[key] = t
    groups = []
    for gm in meta["param_groups"]:
        g = {}
        for k, v in gm.items():
            if isinstance(v, dict) and "__tensor__" in v:
                g[k] = tensors[v["__tensor__"]]
            elif isinstance(v, dict) and "__tuple__" in v:
                g[k] = tuple(v["__tuple__"])
            else:
                g[k] = v
        groups.append(g)
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------


def save_checkpoint(
    out_dir: str | os.PathLike,
    model: nn.Module,
    *,
    tokenizer: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    train_state: dict | None = None,
) -> Path:
    """Write a checkpoint folder ``out_dir`` atomically and return its path.

    Args:
        out_dir: the checkpoint folder; an existing checkpoint there is replaced as a whole.
        model: a :class:`GPT` (possibly wrapped by DDP / ``torch.compile``).
        tokenizer: anything with ``to_dict()`` (stored in ``config.json``), or None.
        optimizer: if given, its full state goes to ``optimizer.safetensors``.
        train_state: a JSON-serialisable dict (step, RNG states, ...) for ``train_state.json``.

    Everything is written into a temporary folder beside ``out_dir`` first and swapped in with
    renames, so an interrupted save leaves the previous checkpoint in place.
    """
    out_dir = Path(out_dir)
    raw = unwrap_model(model)
    if not isinstance(raw, GPT):
        raise TypeError(f"save_checkpoint expects a gptlab GPT model, got {type(raw).__name__}")
    if tokenizer is not None and not hasattr(tokenizer, "to_dict"):
        raise TypeError(f"tokenizer must have a to_dict() method, got {type(tokenizer).__name__}")
    if train_state is not None and not isinstance(train_state, dict):
        raise TypeError(f"train_state must be a dict, got {type(train_state).__name__}")

    # Prepare everything in memory first: a bad argument fails before touching the disk.
    tensors, tied = _model_tensors(raw)
    config = {
        "format": FORMAT,
        "version": VERSION,
        "model": raw.config.to_dict(),
        "tokenizer": tokenizer.to_dict() if tokenizer is not None else None,
        "tied": tied,
    }
    opt_payload = None
    if optimizer is not None:
        opt_payload = optimizer_state_to_tensors(optimizer.state_dict())
    if train_state is not None:
        json.dumps(train_state, default=_json_default)

    if out_dir.exists() and not (out_dir / CONFIG_FILE).exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir} exists and is not a gptlab checkpoint folder; refusing to replace it")
    with atomic_dir(out_dir) as tmp:  # an interrupted save leaves the previous checkpoint in place
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt", "gptlab": FORMAT})
        if opt_payload is not None:
            opt_tensors, opt_meta = opt_payload
            save_file(opt_tensors, str(tmp / OPTIMIZER_FILE),
                      metadata={"format": "pt", "gptlab_optimizer": json.dumps(opt_meta)})
        if train_state is not None:
            _write_json(tmp / TRAIN_STATE_FILE, train_state)
        _write_json(tmp / CONFIG_FILE, config)  # last: a folder without config.json is incomplete
    return out_dir


# --------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder that ``path`` names.

    ``path`` may be the folder itself, a training run's output folder holding it as ``ckpt/``,
    or the ``model.safetensors`` / ``config.json`` file inside it. If the folder is missing
    because a save was interrupted between its two renames, the previous checkpoint kept aside
    as ``.<name>.old`` is used. Raises :class:`CheckpointError` (a ``ValueError``) otherwise.
    """
    p = Path(path).expanduser()
    if p.is_file() and p.name in (MODEL_FILE, CONFIG_FILE):
        p = p.parent
    for cand in (p, p / "ckpt"):
        if (cand / CONFIG_FILE).is_file():
            return cand
    for cand in (p, p / "ckpt"):
        old = kept_aside(cand)
        if not cand.exists() and (old / CONFIG_FILE).is_file():
            return old
    raise CheckpointError(
        f"no gptlab checkpoint at {p}: expected a folder holding {CONFIG_FILE} and {MODEL_FILE} "
        f"(written by save_checkpoint or `python -m gptlab train --out DIR`, which keeps it in DIR/ckpt)"
    )


def _read_config(ckpt: Path) -> dict:
    cfg = _read_json(ckpt / CONFIG_FILE)
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt / CONFIG_FILE} is not a gptlab checkpoint config (format {FORMAT!r} expected)")
    if cfg.get("version") != VERSION:
        raise CheckpointError(f"{ckpt}: checkpoint version {cfg.get('version')!r}, this gptlab reads version {VERSION}")
    return cfg


def _build_model(ckpt: Path, cfg: dict) -> GPT:
    fields = set(GPTConfig.__dataclass_fields__)
    model_cfg = cfg.get("model")
    if not isinstance(model_cfg, dict):
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: 'model' must hold the GPTConfig dict")
    unknown = sorted(set(model_cfg) - fields)
    if unknown:
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: unknown GPTConfig fields {unknown}")
    model = GPT(GPTConfig(**model_cfg))
    if not (ckpt / MODEL_FILE).is_file():
        raise CheckpointError(f"{ckpt}: {MODEL_FILE} is missing")
    tensors = _read_safetensors(ckpt / MODEL_FILE)
    _load_weights(model, tensors, dict(cfg.get("tied") or {}), ckpt)
    return model


def _tokenizer(cfg: dict) -> Any:
    d = cfg.get("tokenizer")
    if d is None:
        return None
    from .tokenizers import tokenizer_from_dict

    return tokenizer_from_dict(d)


def load_model(path: str | os.PathLike, device: str | torch.device | None = None) -> tuple[GPT, Any]:
    """Rebuild the model (in eval mode) and its tokenizer (or None) from a checkpoint.

    ``path``: see :func:`resolve_checkpoint`. ``device``: where to put the model (default: CPU;
    ``"auto"`` picks like :func:`gptlab.device.pick_device`). Reads safetensors and JSON only.
    """
    ckpt = resolve_checkpoint(path)
    cfg = _read_config(ckpt)
    model = _build_model(ckpt, cfg)
    if device is not None:
        from .device import pick_device

        model.to(pick_device(device))
    model.eval()
    return model, _tokenizer(cfg)


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device: str | torch.device | None = None,
) -> tuple[nn.Module, Any, dict | None]:
    """Restore a checkpoint for resuming training.

    If ``model`` is given its weights are overwritten in place (its config must equal the saved
    one), else a new model is built. If ``optimizer`` is given (built over that model's
    parameters) its state is restored from ``optimizer.safetensors``. Returns ``(model, tokenizer,
    train_state)``; ``train_state`` is the dict of ``train_state.json`` or None.
    """
    ckpt = resolve_checkpoint(path)
    cfg = _read_config(ckpt)
    if model is None:
        model = _build_model(ckpt, cfg)
        if device is not None:
            from .device import pick_device

            model.to(pick_device(device))
    else:
        raw = unwrap_model(model)
        if not isinstance(raw, GPT):
            raise TypeError(f"model must be a gptlab GPT, got {type(raw).__name__}")
        saved = GPTConfig(**cfg["model"])
        if saved != raw.config:
            raise CheckpointError(f"{ckpt}: the checkpoint's model config {saved} differs from the model's {raw.config}")
        tensors = _read_safetensors(ckpt / MODEL_FILE)
        _load_weights(raw, tensors, dict(cfg.get("tied") or {}), ckpt)
    if optimizer is not None:
        f = ckpt / OPTIMIZER_FILE
        if not f.is_file():
            raise CheckpointError(f"{ckpt}: {OPTIMIZER_FILE} is missing; this checkpoint cannot resume an optimiser")
        try:
            with safe_open(str(f), framework="pt") as sf:
                meta_s = (sf.metadata() or {}).get("gptlab_optimizer")
                tensors = {k: sf.get_tensor(k) for k in sf.keys()}
        except Exception as e:  # as in _read_safetensors
            raise CheckpointError(f"{f} is not a readable safetensors file (truncated or another format?): {e}") from e
        if meta_s is None:
            raise CheckpointError(f"{f}: no 'gptlab_optimizer' metadata in the header")
        state = optimizer_state_from_tensors(tensors, json.loads(meta_s))
        optimizer.load_state_dict(state)
    train_state = None
    if (ckpt / TRAIN_STATE_FILE).is_file():
        train_state = _read_json(ckpt / TRAIN_STATE_FILE)
    return model, _tokenizer(cfg), train_state
