"""The digest of resident bytes, ``wc-mix64-v1``: its definition, in numpy (what the C loop and the CUDA kernel
are tested against).

A block is cut into chunks of ``chunk_bytes`` (the last one may be shorter). A chunk of ``n`` bytes is read as
little-endian 64-bit words ``w[j]`` (the last one zero-padded); word ``j`` is keyed by its position and mixed by
the splitmix64 finalizer, and the chunk's digest is the mixed sum::

    acc    = sum over j of mix(w[j] ^ (SEED + j * STEP))   (mod 2**64)
    digest = mix(acc ^ n)

The sum makes the order of the additions free (threads, blocks of threads and atomics on a GPU; several
threads on a CPU all give the same number); the position key makes swapped or shifted words count; ``mix`` is
a bijection, so a change of any single word always changes the digest, and changes of several words go unseen
with a chance of about 2**-64. It is not a cryptographic hash nor keyed: it finds corruption (stray writes,
bugs, a wrong or swapped deposit), not a forger who can write both the bytes and the recorded digests.
"""

from __future__ import annotations

import functools

import numpy as np

NAME = "wc-mix64-v1"
DEFAULT_CHUNK_BYTES = 4 << 20  # 64 GB in 16,384 chunks: 128 KiB of digests in the manifest
SEED = 0x243F6A8885A308D3
STEP = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
MASK = (1 << 64) - 1
WORD = np.dtype("<u8")


def check_chunk_bytes(chunk_bytes: int) -> int:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 16 or chunk_bytes % 16:
        raise ValueError(f"digest chunk size must be a positive multiple of 16 bytes, got {chunk_bytes!r}")
    return chunk_bytes


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


def chunk_lengths(nbytes: int, chunk_bytes: int) -> np.ndarray:
    """Bytes of each chunk of an ``nbytes`` span."""
    n = chunk_count(nbytes, chunk_bytes)
    out = np.full(n, chunk_bytes, dtype=np.uint64)
    if n:
        out[-1] = nbytes - (n - 1) * chunk_bytes
    return out


def mix_array(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 values, in place (numpy wraps uint64 products modulo 2**64)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(M2)
    z ^= z >> np.uint64(31)
    return z


@functools.lru_cache(maxsize=4)
def _keys(nwords: int) -> np.ndarray:
    keys = np.arange(nwords, dtype=np.uint64)
    keys *= np.uint64(STEP)
    keys += np.uint64(SEED)
    keys.flags.writeable = False
    return keys


def chunk_sum(data: np.ndarray) -> int:
    """``acc`` of one chunk (a 1-D uint8 array)."""
    n = data.nbytes
    whole = n - n % 8
    words = np.frombuffer(data[:whole], dtype=WORD) if whole else np.empty(0, WORD)
    if whole != n:
        tail = np.zeros(8, dtype=np.uint8)
        tail[:n - whole] = data[whole:]
        words = np.concatenate([words, tail.view(WORD)])
    z = words.astype(np.uint64) ^ _keys(len(words))
    return int(mix_array(z).sum(dtype=np.uint64))


def finalize(acc: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each chunk's digest from its ``acc`` and its length in bytes."""
    return mix_array(np.asarray(acc, dtype=np.uint64) ^ np.asarray(lengths, dtype=np.uint64))


def digests_numpy(data: np.ndarray, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> np.ndarray:
    """Every chunk's digest of a 1-D uint8 array (the reference; the native loop and the kernel are faster)."""
    check_chunk_bytes(chunk_bytes)
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    lengths = chunk_lengths(data.nbytes, chunk_bytes)
    acc = np.fromiter((chunk_sum(data[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(len(lengths))),
                      dtype=np.uint64, count=len(lengths))
    return finalize(acc, lengths)


def pack(digests: np.ndarray) -> bytes:
    """Digests as they are recorded in a manifest: little-endian 64-bit words."""
    return np.asarray(digests, dtype=np.uint64).astype(WORD).tobytes()


def unpack(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=WORD).astype(np.uint64)
