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
    assert a != b and a.startswith("blake3:")
    assert checkpoint_digest(_ckpt(tmp_path / "c", 0)) == a  # same bytes, same digest


def test_key_abi_marks_the_digest_format(tmp_path):
    """ABI 3: content digests are BLAKE3 trees ("blake3:"), the short hash is canonical; an older key never
    matches."""
    k = CacheKey(model="m", content_digest=checkpoint_digest(_ckpt(tmp_path / "a", 0)))
    assert k.abi == 3 and k.content_digest.startswith("blake3:")
    assert [d.field for d in diff(k, k.replace(abi=2))] == ["abi"]


def test_short_hash_ignores_the_order_extra_was_built_in():
    """A key read back from JSON (a restart record, the wire) names the same socket as the one the engine built,
    whatever order its `extra` fields came in."""
    built = CacheKey(model="m", content_digest="x", extra={"kernels": "auto", "arch": "Llama", "kv": "auto"})
    read_back = CacheKey(model="m", content_digest="x", extra=dict(sorted(built.extra.items())))
    assert built == read_back
    assert built.short_hash() == read_back.short_hash()


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
