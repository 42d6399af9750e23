"""Digests of resident blocks: compute them where the bytes live (a kernel on a GPU, C threads on a CPU), record
them in a manifest, and compare the bytes with them later, naming the tensors whose bytes changed."""

from __future__ import annotations

import bisect
import logging
import mmap
import os

import numpy as np

from .. import wire
from ..dtypes import itemsize
from ..errors import WeightCacheError
from ..manifest import Manifest, extent_bytes
from . import algorithm, native

log = logging.getLogger("weightcache.integrity")

NAMED = 8  # tensors named in a one-line description
_fallback_logged = False


class IntegrityError(WeightCacheError):
    """Resident bytes differ from the digests recorded when they were loaded (or none were recorded)."""

    def __init__(self, message: str, mismatches=()):
        super().__init__(message)
        self.mismatches = list(mismatches)

    @property
    def tensors(self) -> list[str]:
        return [n for m in self.mismatches for n in m.tensors]


def _log_fallback(e: Exception) -> None:
    global _fallback_logged
    if not _fallback_logged:
        log.warning("the digest kernel is unavailable (%s): torch computes the digests instead (slower)", e)
        _fallback_logged = True


def chunk_sums(block, chunk_bytes: int) -> np.ndarray:
    """``acc`` of every chunk of a 1-D uint8 torch tensor, computed on its device."""
    if block.device.type == "cuda":
        from . import cuda

        try:
            return cuda.kernel_chunk_sums(block, chunk_bytes)
        except cuda.KernelUnavailable as e:
            _log_fallback(e)
            return cuda.torch_chunk_sums(block, chunk_bytes)
    if block.device.type != "cpu":
        raise ValueError(f"no digest for blocks on {block.device}")
    if not block.is_contiguous():
        raise ValueError("a block to digest must be contiguous")
    return native.chunk_sums(block.data_ptr(), block.numel() * block.element_size(), chunk_bytes)


def block_digests(block, chunk_bytes: int = algorithm.DEFAULT_CHUNK_BYTES) -> np.ndarray:
    nbytes = block.numel() * block.element_size()
    return algorithm.finalize(chunk_sums(block, chunk_bytes), algorithm.chunk_lengths(nbytes, chunk_bytes))


def fd_digests(fd: int, nbytes: int, device, chunk_bytes: int) -> np.ndarray:
    """Digests of a block known only by its fd (one taken over from the custodian), through a read-only
    mapping made for the purpose; ``device`` has ``type`` ("cpu" | "cuda") and ``index``. Needs no torch."""
    if device.type == "cpu":
        with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mm:
            view = np.frombuffer(mm, dtype=np.uint8)
            try:
                sums = native.chunk_sums(view.ctypes.data, nbytes, chunk_bytes)
            finally:
                del view  # the mapping closes only once no array holds it
    elif device.type == "cuda":
        from . import cuda

        try:
            with cuda.mapped_fd(fd, nbytes, device.index) as address:
                sums = cuda.device_sums(device.index, address, nbytes, chunk_bytes)
        except cuda.KernelUnavailable as e:  # map it through the arena (torch) and let torch hash it
            _log_fallback(e)
            from ..arena import import_blocks

            (block,) = import_blocks([os.dup(fd)], [nbytes], device, True)
            sums = cuda.torch_chunk_sums(block, chunk_bytes)
    else:
        raise ValueError(f"no digest for blocks on {device}")
    return algorithm.finalize(sums, algorithm.chunk_lengths(nbytes, chunk_bytes))


def record_digests(manifest: Manifest, digests: list[np.ndarray], chunk_bytes: int) -> None:
    """Write each block's digests into the manifest."""
    algorithm.check_chunk_bytes(chunk_bytes)
    if len(digests) != len(manifest.blocks):
        raise ValueError(f"manifest has {len(manifest.blocks)} blocks, got digests of {len(digests)}")
    packed = []
    for spec, d in zip(manifest.blocks, digests, strict=True):
        if len(d) != algorithm.chunk_count(spec.nbytes, chunk_bytes):
            raise ValueError(f"{len(d)} digests for a block of {spec.nbytes} bytes in chunks of {chunk_bytes}")
        packed.append(algorithm.pack(d))
    for spec, raw in zip(manifest.blocks, packed, strict=True):
        spec.digests = raw
    manifest.integrity, manifest.chunk_bytes = algorithm.NAME, chunk_bytes


def record(manifest: Manifest, blocks, chunk_bytes: int = algorithm.DEFAULT_CHUNK_BYTES) -> None:
    """Digest every block (1-D uint8 torch tensors) and write the digests into the manifest."""
    algorithm.check_chunk_bytes(chunk_bytes)
    record_digests(manifest, [block_digests(b, chunk_bytes) for b in blocks], chunk_bytes)


def require_digests(manifest: Manifest) -> None:
    """Raises IntegrityError unless the manifest records digests this version computes."""
    if not manifest.integrity:
        raise IntegrityError("the weight cache recorded no digests of its blocks: nothing to verify against")
    if manifest.integrity != algorithm.NAME:
        raise IntegrityError(f"the weight cache's digests are {manifest.integrity!r}; this weightcache computes "
                             f"{algorithm.NAME!r}")


def compare(manifest: Manifest, digests: list[np.ndarray]) -> list[wire.BlockMismatch]:
    """The blocks whose digests now differ from the recorded ones, with their chunks and tensors."""
    require_digests(manifest)
    if len(digests) != len(manifest.blocks):
        raise ValueError(f"manifest has {len(manifest.blocks)} blocks, got digests of {len(digests)}")
    out = []
    for i, (spec, now) in enumerate(zip(manifest.blocks, digests, strict=True)):
        recorded = algorithm.unpack(spec.digests)
        if len(now) != len(recorded):
            raise ValueError(f"block {i}: {len(now)} digests now, {len(recorded)} recorded")
        bad = np.flatnonzero(now != recorded).tolist()
        if bad:
            out.append(wire.BlockMismatch(block=i, chunks=bad, tensors=tensors_in_chunks(manifest, i, bad)))
    return out


def check(manifest: Manifest, blocks) -> list[wire.BlockMismatch]:
    """Re-hash ``blocks`` (1-D uint8 torch tensors, what the manifest describes) and compare them with its
    recorded digests; one entry per block that differs. Raises IntegrityError when the manifest records no
    digests this version knows."""
    require_digests(manifest)
    if len(blocks) != len(manifest.blocks):
        raise ValueError(f"manifest has {len(manifest.blocks)} blocks, got {len(blocks)}")
    return compare(manifest, [block_digests(b, manifest.chunk_bytes) for b in blocks])


def tensors_in_chunks(manifest: Manifest, block: int, chunks: list[int]) -> list[str]:
    """Names of the tensors (in manifest order) with bytes in any of ``chunks`` (sorted) of ``block``."""
    size = manifest.chunk_bytes
    names = []
    for t in manifest.tensors:
        s = manifest.storages[t.storage]
        if s.block != block:
            continue
        extent = extent_bytes(t.shape, t.stride, itemsize(t.dtype))
        if not extent:
            continue
        lo = s.offset + t.byte_offset
        first, last = lo // size, (lo + extent - 1) // size
        k = bisect.bisect_left(chunks, first)
        if k < len(chunks) and chunks[k] <= last:
            names.append(t.name)
    return names


def describe(mismatches: list[wire.BlockMismatch], chunk_bytes: int) -> str:
    """One line: which tensors (and chunks) differ."""
    names = list(dict.fromkeys(n for m in mismatches for n in m.tensors))
    shown = ", ".join(repr(n) for n in names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
    where = "; ".join(f"block {m.block} chunk(s) {_ranges(m.chunks)}" for m in mismatches)
    what = f"{len(names)} tensor(s) differ from their recorded digests: {shown}" if names else \
        "bytes between tensors differ from their recorded digests"
    size = f"{chunk_bytes >> 20} MiB" if chunk_bytes % (1 << 20) == 0 else f"{chunk_bytes} B"
    return f"{what} ({where}, {size} chunks)"


def _ranges(chunks: list[int], most: int = 6) -> str:
    runs: list[list[int]] = []
    for c in chunks:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:most])
    return text + (f" and {len(runs) - most} more run(s)" if len(runs) > most else "")
