"""Checkpoints: a trained model (and, for resuming, its optimiser and training state) on disk.

Where this sits: after training (text -> tokens -> batches -> model -> logits -> loss), before
sampling. :func:`save_checkpoint` writes a folder, :func:`load_model` rebuilds the model and its
tokenizer from it for sampling, and :func:`load_checkpoint` restores everything for resuming.

A checkpoint folder holds:

* ``model.safetensors``: the weights. Tied weights (``lm_head.weight`` is ``wte.weight``) are
  stored once and re-tied on load.
* ``config.json``: ``{"format", "version", "model": GPTConfig dict, "tokenizer": tokenizer dict
  or null, "tied": {dropped name: kept name}, "sha256": {file name: sha256 of its bytes},
  "config_sha256": sha256 of config.json's own content}``. It is the checkpoint's manifest,
  written last.
* ``optimizer.safetensors`` (optional): every tensor of the optimiser's state (AdamW's moments
  and step counts), with the parameter groups and any non-tensor state as JSON in the file's
  metadata header.
* ``train_state.json`` (optional): the step, the RNG states (python, numpy, torch, CUDA, the
  batch generator) in a JSON-safe form (see :func:`gptlab.train.rng.rng_state`), metrics, ...

Safety: weights are read with ``safetensors`` and everything else is JSON, so loading a
checkpoint never unpickles anything (no ``torch.load``).

Integrity: a load refuses, with a :class:`CheckpointError` naming the file, a file whose sha256 is
not the one the manifest records (a flipped byte, a hand edit of ``config.json``), a config field
of the wrong type or range, weights that are not floating point or not of the shapes the config
gives, a config that differs from the one the weights were saved with (kept in
``model.safetensors``' header: this still tells when the hashes are not checked), and a tokenizer
with more ids than the model's ``vocab_size`` (fewer is a padded vocabulary, allowed).
``verify=False`` (or ``GPTLAB_VERIFY_CHECKPOINTS=0``) skips the hashes, which read every byte
(about a second per GB); checkpoints written before the hashes existed load without them.

Atomicity: the whole folder is first written under a temporary name beside the target, then
swapped in with renames (:func:`gptlab.files.atomic_dir`), so a crash during a save never leaves a half
written checkpoint in the target's place. If a crash falls between the two renames of the swap
the previous checkpoint survives as ``.<name>.old``, and :func:`resolve_checkpoint` finds it.
A load while a save swaps a new folder in reads again if the folder changed under it
(:func:`_read_unchanged`): it returns the previous checkpoint or the new one, never a mix. A full
disk during a save raises the ``OSError`` it is (``ENOSPC``), naming the file, whichever file it hit.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from ..assets import VERIFY_ENV, sha256_file, sha256_json, verify_hashes
from ..device import pick_device
from ..files import atomic_dir, kept_aside
from ..model import GPT, GPTConfig
from ..tokenizers import tokenizer_from_dict

__all__ = [
    "save_checkpoint",
    "load_model",
    "load_initial_weights",
    "load_checkpoint",
    "resolve_checkpoint",
    "unwrap_model",
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


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file and its header's metadata; a truncated or foreign file
    raises CheckpointError naming it (safetensors' own error names no file)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # safetensors raises SafetensorError, OSError or ValueError by case
        if isinstance(e, FileNotFoundError):
            raise
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or another format?): {e}") from e


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' Rust code reports an I/O error


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, an I/O error (a full disk) raised as the ``OSError`` it is,
    naming the file (safetensors raises its own ``SafetensorError``, with the errno in its text)."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:
        found = _OS_ERROR.search(str(e)) if type(e).__name__ == "SafetensorError" else None
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e


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


def _check_weights(model: GPT, tensors: dict[str, torch.Tensor], tied: dict[str, str], where: Path) -> None:
    """The tensors of ``where`` (a model.safetensors) fit ``model``: the same names (those stored
    once under a kept name included), floating-point dtypes, the same shapes."""
    expected = set(model.state_dict().keys())
    got = set(tensors) | set(tied)
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: weights do not match the model built from config.json: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    lost = sorted(kept for kept in tied.values() if kept not in tensors)
    if lost:
        raise CheckpointError(f"{where}: config.json's 'tied' names weights the file does not hold: {lost[:8]}")
    state = model.state_dict()
    for name, t in tensors.items():
        if not t.dtype.is_floating_point:
            raise CheckpointError(f"{where}: {name} is stored as {t.dtype}; a checkpoint's weights are floating point "
                                  "(float32, bfloat16, float16 or float64)")
        if tuple(state[name].shape) != tuple(t.shape):
            raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, the model expects {tuple(state[name].shape)}")


def _load_weights(model: GPT, tensors: dict[str, torch.Tensor], tied: dict[str, str]) -> None:
    """Copy checked tensors (:func:`_check_weights`) into ``model`` and re-tie the shared ones."""
    state = model.state_dict()
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

    if tokenizer is not None:
        _check_tokenizer_size(tokenizer, raw.config.vocab_size, "save_checkpoint")

    # Prepare everything in memory first: a bad argument fails before touching the disk.
    tensors, tied = _model_tensors(raw)
    config = {
        "format": FORMAT,
        "version": VERSION,
        "model": raw.config.to_dict(),
        "tokenizer": tokenizer.to_dict() if tokenizer is not None else None,
        "tied": tied,
    }
    header = {"format": "pt", "gptlab": FORMAT, _HEADER_CONFIG: json.dumps(config["model"], sort_keys=True)}
    opt_payload = None
    if optimizer is not None:
        opt_payload = optimizer_state_to_tensors(optimizer.state_dict())
    if train_state is not None:
        json.dumps(train_state, default=_json_default)

    if out_dir.exists() and not (out_dir / CONFIG_FILE).exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir} exists and is not a gptlab checkpoint folder; refusing to replace it")
    with atomic_dir(out_dir) as tmp:  # an interrupted save leaves the previous checkpoint in place
        _save_safetensors(tensors, tmp / MODEL_FILE, header)
        if opt_payload is not None:
            opt_tensors, opt_meta = opt_payload
            _save_safetensors(opt_tensors, tmp / OPTIMIZER_FILE,
                              {"format": "pt", "gptlab_optimizer": json.dumps(opt_meta)})
        if train_state is not None:
            _write_json(tmp / TRAIN_STATE_FILE, train_state)
        # the manifest: the hash of each file's bytes as written, then of its own content
        config["sha256"] = {f.name: sha256_file(f) for f in sorted(tmp.iterdir())}
        config["config_sha256"] = _config_digest(json.loads(json.dumps(config)))
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
    for _ in range(3):  # a save swapping its folder in may move it between two looks: look again
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


def _is_sha256(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _read_config(ckpt: Path) -> dict:
    """config.json, its format, version, ``tied`` map and manifest checked (each error names the
    file). The model config and the tokenizer are read by :func:`_model_config`, :func:`_tokenizer`."""
    where = ckpt / CONFIG_FILE
    cfg = _read_json(where)
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a gptlab checkpoint config (format {FORMAT!r} expected)")
    if cfg.get("version") != VERSION:
        raise CheckpointError(f"{ckpt}: checkpoint version {cfg.get('version')!r}, this gptlab reads version {VERSION}")
    tied = cfg.get("tied", {})  # absent: nothing tied
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise CheckpointError(f"{where}: 'tied' must map dropped weight names to kept ones ({{str: str}}, {{}} when "
                              f"none are tied), got {'null' if tied is None else type(tied).__name__} {tied!r:.120}")
    hashes = cfg.get("sha256")
    if hashes is not None and not (isinstance(hashes, dict) and all(
            isinstance(k, str) and _is_sha256(v) for k, v in hashes.items())):
        raise CheckpointError(f"{where}: 'sha256' must map file names to sha256s (64 lowercase hex digits), "
                              f"got {type(hashes).__name__} {hashes!r:.120}")
    if cfg.get("config_sha256") is not None and not _is_sha256(cfg["config_sha256"]):
        raise CheckpointError(f"{where}: 'config_sha256' must be a sha256 (64 lowercase hex digits), "
                              f"got {cfg['config_sha256']!r:.120}")
    return cfg


def _model_config(ckpt: Path, cfg: dict) -> GPTConfig:
    """The GPTConfig of config.json's "model", each field checked; an error names the file, the
    field, the value and what is allowed, on one line."""
    where = ckpt / CONFIG_FILE
    model_cfg = cfg.get("model")
    if not isinstance(model_cfg, dict):
        raise CheckpointError(f"{where}: 'model' must hold the GPTConfig dict, got {type(model_cfg).__name__}")
    try:
        return GPTConfig.from_dict(model_cfg, where=str(where))
    except (TypeError, ValueError) as e:
        raise CheckpointError(str(e)) from None


def _config_digest(cfg: dict) -> str:
    """The sha256 config.json records of its own content: everything but that hash itself."""
    return sha256_json({k: v for k, v in cfg.items() if k != "config_sha256"})


def _check_tokenizer_size(tokenizer: Any, vocab_size: int, where: Any, error: type[Exception] = ValueError) -> None:
    """A tokenizer with more ids than the model's embedding has rows is refused; fewer is allowed
    (a vocabulary padded to a round size, as nanoGPT's 50304 rows for GPT-2's 50257 ids)."""
    n = getattr(tokenizer, "vocab_size", None)
    if isinstance(n, int) and n > vocab_size:
        raise error(f"{where}: the tokenizer has {n} tokens but the model's vocab_size is {vocab_size} "
                    f"(ids {vocab_size} to {n - 1} have no embedding)")


def _tokenizer(ckpt: Path, cfg: dict, vocab_size: int) -> Any:
    """The tokenizer config.json holds (or None), of the model's vocabulary size."""
    d = cfg.get("tokenizer")
    if d is None:
        return None
    where = ckpt / CONFIG_FILE
    try:
        tok = tokenizer_from_dict(d)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: 'tokenizer': {e}") from None
    _check_tokenizer_size(tok, vocab_size, where, CheckpointError)
    return tok


def _verify_config(ckpt: Path, cfg: dict, verify: bool) -> None:
    """config.json's content against the hash it records (none in an older checkpoint)."""
    digest = cfg.get("config_sha256")
    if verify and digest is not None and _config_digest(cfg) != digest:
        raise CheckpointError(
            f"{ckpt / CONFIG_FILE}: its content does not match the config_sha256 it records ({digest}): it was "
            f"edited after the save; verify=False (or {VERIFY_ENV}=0) loads it unchecked")


def _verify_file(ckpt: Path, cfg: dict, name: str, verify: bool) -> None:
    """``ckpt / name``'s bytes against the sha256 the manifest records (none in an older checkpoint)."""
    hashes = cfg.get("sha256")
    if not verify or hashes is None:
        return
    path = ckpt / name
    expected = hashes.get(name)
    if expected is None:
        raise CheckpointError(f"{path}: not recorded in the manifest {ckpt / CONFIG_FILE} (added after the save?)")
    got = sha256_file(path)
    if got != expected:
        raise CheckpointError(
            f"{path}: sha256 {got} does not match the {expected} recorded in {ckpt / CONFIG_FILE} (the file was "
            f"damaged or changed after the save); verify=False (or {VERIFY_ENV}=0) loads it unchecked")


_HEADER_CONFIG = "gptlab_model"  # in model.safetensors' header: the GPTConfig the weights were saved with
_SAME_WEIGHTS_FIELDS = ("dropout", "attn_impl")  # change neither what the weights mean nor the logits


def _check_header(ckpt: Path, config: GPTConfig, meta: dict[str, str]) -> None:
    """config.json's model config against the one model.safetensors was saved with (absent in an
    older checkpoint): a hand edit that keeps the weights' shapes (``n_head``, ``norm_eps``)."""
    s = meta.get(_HEADER_CONFIG)
    if s is None:
        return
    path, where = ckpt / MODEL_FILE, ckpt / CONFIG_FILE
    try:
        saved = GPTConfig.from_dict(json.loads(s), where=f"{path}'s header").to_dict()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: the header's {_HEADER_CONFIG} is not a valid GPTConfig ({e})") from None
    now = config.to_dict()
    diff = [f"{k} is {now[k]!r} in {where} but the weights in {path} were saved with {k} = {saved[k]!r}"
            for k in now if k not in _SAME_WEIGHTS_FIELDS and now[k] != saved[k]]
    if diff:
        raise CheckpointError(f"{where} does not describe the weights: " + "; ".join(diff))


def _checked_weights(model: GPT, ckpt: Path, cfg: dict, verify: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """model.safetensors' tensors and the ``tied`` map, checked against ``model`` (built from
    config.json): names, dtypes and shapes first (the most precise message), then the hashes of
    config.json and of the weights, then the config the weights were saved with."""
    path = ckpt / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: {MODEL_FILE} is missing")
    tensors, meta = _read_safetensors(path)
    tied = cfg.get("tied") or {}
    _check_weights(model, tensors, tied, path)
    _verify_config(ckpt, cfg, verify)
    _verify_file(ckpt, cfg, MODEL_FILE, verify)
    _check_header(ckpt, model.config, meta)
    return tensors, tied


_READ_TRIES = 50  # reads of a checkpoint that saves keep replacing, before giving up


def _identity(path: str | os.PathLike) -> tuple | None:
    """What tells one saved checkpoint from the next at ``path``: the folder it resolves to, that
    folder's inode and change time (each save swaps in a new folder) and its config.json's bytes
    (which record every file's sha256); None while there is none (a save between its renames)."""
    try:
        ckpt = resolve_checkpoint(path)
        st = os.stat(ckpt)
        return str(ckpt), st.st_dev, st.st_ino, st.st_ctime_ns, (ckpt / CONFIG_FILE).read_bytes()
    except (FileNotFoundError, CheckpointError):
        return None


def _read_unchanged(path: str | os.PathLike, read: Any) -> Any:
    """``read(ckpt)`` of the checkpoint folder ``path`` names, every file from one save.

    A training run may save while this reads: the save swaps a whole new folder in
    (:func:`gptlab.files.atomic_dir`), so a read that began in the old folder could go on in the
    new one, and a file's sha256 would not match the manifest read before. The folder's identity
    (:func:`_identity`) is taken before and after the read; if a save came between, the read is
    done again, so the caller gets the old checkpoint or the new one, never a mix, and an error
    only when the checkpoint did not change while it was read.
    """
    for _ in range(_READ_TRIES):
        before = _identity(path)
        if before is None:
            resolve_checkpoint(path)  # no checkpoint there: its error says what is expected
            continue  # one was being swapped in: look again
        try:
            result = read(Path(before[0]))  # the very folder identified
        except (CheckpointError, OSError):
            if _identity(path) == before:
                raise  # the same checkpoint throughout: the error is its own
            continue
        if _identity(path) == before:
            return result
    raise CheckpointError(f"{path}: the checkpoint was replaced by a new save each of the {_READ_TRIES} times it "
                          "was read (a training run saving it very often?); try again")


def load_model(
    path: str | os.PathLike,
    device: str | torch.device | None = None,
    *,
    verify: bool | None = None,
) -> tuple[GPT, Any]:
    """Rebuild the model (in eval mode) and its tokenizer (or None) from a checkpoint.

    ``path``: see :func:`resolve_checkpoint`. ``device``: where to put the model (default: CPU;
    ``"auto"`` picks like :func:`gptlab.device.pick_device`). Reads safetensors and JSON only.

    ``verify``: check config.json and model.safetensors against the sha256s the manifest records
    (a checkpoint written before them has none: nothing to check). None (the default): True unless
    the environment variable ``GPTLAB_VERIFY_CHECKPOINTS`` is ``0``; False skips reading every byte
    twice, for very large files. The config's fields, the weights' dtypes and shapes, the config
    the weights were saved with and the tokenizer's size (at most ``vocab_size``) are checked either
    way. Every problem raises :class:`CheckpointError` naming the file.

    A training run may be saving the checkpoint meanwhile: what is loaded is one save's, the one
    before or the new one, never a mix (:func:`_read_unchanged`).
    """
    verify = verify_hashes(verify)

    def read(ckpt: Path) -> tuple[GPT, Any]:
        cfg = _read_config(ckpt)
        config = _model_config(ckpt, cfg)
        tokenizer = _tokenizer(ckpt, cfg, config.vocab_size)
        model = GPT(config)
        _load_weights(model, *_checked_weights(model, ckpt, cfg, verify))
        return model, tokenizer

    model, tokenizer = _read_unchanged(path, read)
    if device is not None:
        model.to(pick_device(device))
    model.eval()
    return model, tokenizer


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device: str | torch.device | None = None,
    verify: bool | None = None,
) -> tuple[nn.Module, Any, dict | None]:
    """Restore a checkpoint for resuming training.

    If ``model`` is given its weights are overwritten in place (its config must equal the saved
    one), else a new model is built. If ``optimizer`` is given (built over that model's
    parameters) its state is restored from ``optimizer.safetensors``. Returns ``(model, tokenizer,
    train_state)``; ``train_state`` is the dict of ``train_state.json`` or None.

    ``verify``: check every file read against the sha256 the manifest records, as in
    :func:`load_model` (None: True unless ``GPTLAB_VERIFY_CHECKPOINTS=0``). Every problem raises
    :class:`CheckpointError` naming the file. As with :func:`load_model`, every file comes from
    one save, even while a training run saves the checkpoint again.
    """
    verify = verify_hashes(verify)
    raw = None
    if model is not None:
        raw = unwrap_model(model)
        if not isinstance(raw, GPT):
            raise TypeError(f"model must be a gptlab GPT, got {type(raw).__name__}")
    # every file read and checked, all from one save, before the model or the optimizer changes
    found = _read_unchanged(path, lambda ckpt: _read_to_resume(ckpt, raw, optimizer is not None, verify))
    raw, tokenizer, tensors, tied, opt_state, train_state = found
    built = model is None
    if built:
        model = raw
    _load_weights(raw, tensors, tied)
    if built and device is not None:
        model.to(pick_device(device))
    if opt_state is not None:
        optimizer.load_state_dict(opt_state)
    return model, tokenizer, train_state


def _read_to_resume(ckpt: Path, raw: GPT | None, with_optimizer: bool, verify: bool) -> tuple:
    """Everything :func:`load_checkpoint` loads from ``ckpt``, read and checked against ``raw``, the
    model to load into (None: one is built from the config): ``(that model, tokenizer, tensors,
    tied, optimizer state or None, train state or None)``; nothing is loaded into the model yet."""
    cfg = _read_config(ckpt)
    config = _model_config(ckpt, cfg)
    tokenizer = _tokenizer(ckpt, cfg, config.vocab_size)
    if raw is None:
        raw = GPT(config)
    elif config != raw.config:
        raise CheckpointError(f"{ckpt}: the checkpoint's model config {config} differs from the model's {raw.config}")
    tensors, tied = _checked_weights(raw, ckpt, cfg, verify)
    opt_state = None
    if with_optimizer:
        f = ckpt / OPTIMIZER_FILE
        if not f.is_file():
            raise CheckpointError(f"{ckpt}: {OPTIMIZER_FILE} is missing; this checkpoint cannot resume an optimiser")
        opt_tensors, meta = _read_safetensors(f)
        _verify_file(ckpt, cfg, OPTIMIZER_FILE, verify)
        meta_s = meta.get("gptlab_optimizer")
        if meta_s is None:
            raise CheckpointError(f"{f}: no 'gptlab_optimizer' metadata in the header")
        try:
            opt_meta = json.loads(meta_s)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{f}: the header's 'gptlab_optimizer' is not valid JSON ({e})") from None
        opt_state = optimizer_state_from_tensors(opt_tensors, opt_meta)
    train_state = None
    if (ckpt / TRAIN_STATE_FILE).is_file():
        train_state = _read_json(ckpt / TRAIN_STATE_FILE)
        _verify_file(ckpt, cfg, TRAIN_STATE_FILE, verify)
    elif verify and TRAIN_STATE_FILE in (cfg.get("sha256") or {}):
        raise CheckpointError(f"{ckpt}: {TRAIN_STATE_FILE} is missing (the manifest {CONFIG_FILE} records it)")
    return raw, tokenizer, tensors, tied, opt_state, train_state


def load_initial_weights(model: GPT, path: str | os.PathLike) -> None:
    """Copy into ``model`` the weights of the run or checkpoint ``path`` (``TrainConfig.init_from``:
    a fine-tuning run starts from them, a draft distilled in two stages, say). Its model config must
    be ``model``'s, vocabulary and context included (dropout, a training setting, may differ); else
    a ``ValueError`` naming the fields that differ."""
    try:
        start, _ = load_model(path, device=next(model.parameters()).device)
    except (OSError, ValueError) as e:
        raise ValueError(f"TrainConfig.init_from: cannot load a model from {str(path)!r}: {e}") from e
    a, b = dict(start.config.__dict__, dropout=None), dict(model.config.__dict__, dropout=None)
    if a != b:
        diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        raise ValueError(f"TrainConfig.init_from: the model in {str(path)!r} differs from this run's: "
                         + ", ".join(f"{k}={x!r} there, {y!r} here" for k, (x, y) in diff.items()))
    with torch.no_grad():
        model.load_state_dict(start.state_dict())
