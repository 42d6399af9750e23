import os

import pytest
import torch
from safetensors.torch import save_file

from weightcache import digests as wkey
from weightcache.digests import checkpoint_digest
from weightcache.key import CacheKey, diff


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _ckpt(d, seed):
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(16, 16, generator=g)}, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}')
    return d


def test_fine_tune_with_same_layout_gets_another_digest(tmp_path):
    a = checkpoint_digest(_ckpt(tmp_path / "a", 0))
    b = checkpoint_digest(_ckpt(tmp_path / "b", 1))
    assert a != b and a.startswith("sha256:")
    assert checkpoint_digest(_ckpt(tmp_path / "c", 0)) == a  # same bytes, same digest


def test_digest_is_remembered_by_stat(tmp_path, monkeypatch):
    d = _ckpt(tmp_path / "a", 0)
    first = checkpoint_digest(d)
    opened = []
    real_open = open

    def spy(path, *a, **k):
        opened.append(str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", spy)
    assert checkpoint_digest(d) == first
    assert not any(p.endswith(".safetensors") for p in opened)


def test_rewritten_file_is_hashed_again(tmp_path):
    d = _ckpt(tmp_path / "a", 0)
    first = checkpoint_digest(d)
    _ckpt(d, 5)
    os.utime(os.path.join(d, "model.safetensors"), ns=(1, 1))
    assert checkpoint_digest(d) != first


def test_hf_blob_names_are_reused(tmp_path):
    blobs = tmp_path / "blobs"
    snap = tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    sha = "a" * 64
    (blobs / sha).write_bytes(b"not really safetensors")
    os.symlink(blobs / sha, snap / "model.safetensors")
    assert wkey.file_digest(snap / "model.safetensors") == "sha256:" + sha


def test_files_are_hashed_in_parallel_and_in_order(tmp_path, monkeypatch, caplog):
    import hashlib
    import logging
    import threading

    paths = []
    for i, size in enumerate([3 << 20, 1 << 10, 5 << 20, 0]):
        p = tmp_path / f"model-{i}.safetensors"
        p.write_bytes(os.urandom(size))
        paths.append(p)
    real = wkey._sha256_file
    meet = threading.Barrier(3, timeout=10)  # three hashes must be under way at once, or this breaks

    def hash_together(path, progress=None):
        if path.stat().st_size >= 1 << 10:
            meet.wait()
        return real(path, progress)

    monkeypatch.setattr(wkey, "_sha256_file", hash_together)
    monkeypatch.setattr(wkey, "_LOG_HASHING_FROM", 0)
    with caplog.at_level(logging.INFO, logger="weightcache.digests"):
        got = wkey.file_digests(paths)
    assert got == ["sha256:" + hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    assert "hashing 0.0 GB in 4 checkpoint file(s)" in caplog.text and "GB/s" in caplog.text
    total = sum(p.stat().st_size for p in paths)
    assert f"hashing the checkpoint: {total / 1e9:.2f} / {total / 1e9:.2f} GB (100%)" in caplog.text  # progress


def test_one_hashing_thread_is_enough(tmp_path, monkeypatch):
    monkeypatch.setattr(wkey, "HASH_THREADS", 1)
    d = _ckpt(tmp_path / "a", 0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other-cache"))
    one = checkpoint_digest(d)
    monkeypatch.setattr(wkey, "HASH_THREADS", 16)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "third-cache"))
    assert checkpoint_digest(d) == one


def test_missing_checkpoint_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no weight files"):
        checkpoint_digest(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        checkpoint_digest(tmp_path / "nope")


def test_diff_names_each_field():
    k = CacheKey(model="m", content_digest="x", extra={"a": "1"})
    other = k.replace(rank=3, engine="vllm", extra={"a": "2", "b": "3"})
    fields = [d.field for d in diff(k, other)]
    assert fields == ["rank", "engine", "extra.a", "extra.b"]
    assert diff(k, k) == []
    assert k.short_hash() != other.short_hash() and len(k.short_hash()) == 12


def test_config_digest_is_order_independent():
    assert wkey.config_digest({"a": 1, "b": [1, 2]}) == wkey.config_digest({"b": [1, 2], "a": 1})
    assert wkey.config_digest(None) == "none"
