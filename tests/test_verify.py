"""Verified resident weights: the digest's definition against a plain reference, its native, torch and CUDA
implementations against the definition, and a daemon that finds bytes changed under it (a write through a
writable mapping, a poisoned deposit) and names the tensors."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from weightcache.integrity import algorithm, native
from weightcache.integrity import cuda as icuda

MASK = (1 << 64) - 1


def reference_digests(data: bytes, chunk: int) -> list[int]:
    """The definition, word by word in plain Python integers."""
    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    out = []
    for start in range(0, len(data), chunk):
        piece = data[start:start + chunk]
        padded = piece + b"\0" * (-len(piece) % 8)
        acc = 0
        for j in range(len(padded) // 8):
            (w,) = struct.unpack_from("<Q", padded, 8 * j)
            acc = (acc + mix(w ^ ((0x243F6A8885A308D3 + j * 0x9E3779B97F4A7C15) & MASK))) & MASK
        out.append(mix(acc ^ len(piece)))
    return out


SIZES = [0, 1, 7, 8, 15, 16, 17, 100, 4095, 4096, 4097, 10_000]


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("chunk", [16, 48, 1024])
def test_numpy_definition_matches_the_plain_reference(nbytes, chunk):
    data = np.random.default_rng(nbytes * 31 + chunk).integers(0, 256, nbytes, dtype=np.uint8)
    got = algorithm.digests_numpy(data, chunk)
    assert got.tolist() == reference_digests(data.tobytes(), chunk)
    assert len(got) == algorithm.chunk_count(nbytes, chunk)


def test_every_single_word_change_and_a_swap_change_the_digest():
    data = np.random.default_rng(1).integers(0, 256, 256, dtype=np.uint8)
    base = algorithm.digests_numpy(data, 256)[0]
    for i in range(0, 256, 8):
        for bit in (0, 7, 63):
            changed = data.copy().view("<u8")
            changed[i // 8] ^= np.uint64(1 << bit)
            assert algorithm.digests_numpy(changed.view(np.uint8), 256)[0] != base
    swapped = data.copy().view("<u8")
    swapped[[0, 1]] = swapped[[1, 0]]
    assert algorithm.digests_numpy(swapped.view(np.uint8), 256)[0] != base
    zeros = np.zeros(256, np.uint8)
    assert algorithm.digests_numpy(zeros, 256)[0] != algorithm.digests_numpy(zeros[:255], 256)[0]  # length counts


@pytest.mark.parametrize("nbytes", [0, 5, 4096, 65_536 + 24, 3 * 1024 * 1024 + 8])
@pytest.mark.parametrize("threads", [1, 3])
def test_native_loop_matches_the_definition(nbytes, threads):
    lib, why = native.library()
    if lib is None:
        pytest.skip(f"no native digest: {why}")
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    for chunk in (16, 4096, 1 << 20):
        acc = native.chunk_sums(data.ctypes.data, nbytes, chunk, threads=threads)
        got = algorithm.finalize(acc, algorithm.chunk_lengths(nbytes, chunk))
        assert got.tolist() == algorithm.digests_numpy(data, chunk).tolist()


def test_native_fallback_without_a_compiler_gives_the_same_numbers(monkeypatch):
    data = np.random.default_rng(2).integers(0, 256, 70_001, dtype=np.uint8)
    want = native.chunk_sums(data.ctypes.data, data.nbytes, 4096)
    monkeypatch.setattr(native, "library", lambda: (None, "no C compiler"))
    assert native.chunk_sums(data.ctypes.data, data.nbytes, 4096).tolist() == want.tolist()


@pytest.mark.parametrize("nbytes", [0, 9, 4096, 100_000])
def test_torch_fallback_matches_the_definition(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    for chunk in (16, 1024, 65_536):
        got = algorithm.finalize(icuda.torch_chunk_sums(data, chunk, slab_bytes=4 * chunk),
                                 algorithm.chunk_lengths(nbytes, chunk))
        assert got.tolist() == algorithm.digests_numpy(data.numpy(), chunk).tolist()


@pytest.mark.parametrize("bad", [0, -16, 8, 24, 2.0, True])
def test_bad_chunk_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="multiple of 16"):
        algorithm.digests_numpy(np.zeros(64, np.uint8), bad)
